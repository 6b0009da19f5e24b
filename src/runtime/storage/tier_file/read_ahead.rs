//! Reads started before anyone asks for them. The optimizer phase streams every record of the
//! rank's shard through RAM right after the backward, and the backward before it leaves the
//! disk idle when only the optimizer state lives on the tier; so the step starts the phase's
//! first reads as the backward begins, into staging buffers nobody else wants then, and the
//! phase's own [`TierFile::start_read`] of the same values takes the read in flight (or done)
//! instead of starting another.
//!
//! A read ahead is only a head start, never a second copy of the state: a write over any of its
//! bytes drops it first (its values would be stale), a buffer wanted when the pool is empty is
//! taken back from the newest one, and the file waits for all of them before it goes. A read
//! ahead that fails is dropped without an error; the read that wants its values reads them
//! again and reports what it finds (a damaged block is still never used).

use std::ops::Range;

use super::{Op, Pending, TierError, TierFile};

/// One read ahead: which record and values it reads.
pub(super) struct Ahead {
    rec: usize,
    kinds: Range<usize>,
    pending: Pending,
}

impl TierFile {
    /// Starts reading values `kinds` of record `rec` for a later [`TierFile::start_read`] of
    /// the same values, if more than `keep` staging buffers are free in the pool (already
    /// started counts as started). False where it did not start: no buffer to spare, or a file
    /// with two copies (whose placement moves at every commit). A deferred write of those bytes
    /// is waited for first, as for any read.
    pub fn read_ahead(
        &mut self,
        rec: usize,
        kinds: Range<usize>,
        keep: usize,
    ) -> Result<bool, TierError> {
        if self.copies.is_some() {
            return Ok(false);
        }
        if self.ahead.iter().any(|a| a.rec == rec && a.kinds == kinds) {
            return Ok(true);
        }
        if self.pool.len() <= keep {
            return Ok(false);
        }
        let buf = self.pool.pop().expect("more than `keep` buffers are free");
        let (offset, len, buf) = self.settled_span(rec, kinds.clone(), false, buf)?;
        let pending = self.start(Op::Read, offset, len, buf)?;
        self.ahead.push_back(Ahead {
            rec,
            kinds,
            pending,
        });
        Ok(true)
    }

    /// Reads ahead that are still to be taken.
    pub fn reads_ahead(&self) -> usize {
        self.ahead.len()
    }

    /// Lands every deferred write that has finished, without waiting for the others: their
    /// buffers go back to the pool (an error is kept for the next read, write or settle).
    pub fn land_finished_writes(&mut self) {
        let mut still = std::collections::VecDeque::with_capacity(self.deferred.len());
        while let Some(mut p) = self.deferred.pop_front() {
            if p.ticket.is_done() {
                if let Some(b) = self.land(p) {
                    self.pool.push(b);
                }
            } else {
                still.push_back(p);
            }
        }
        self.deferred = still;
    }

    /// The read ahead of exactly values `kinds` of record `rec`, if one was started.
    pub(super) fn take_read_ahead(&mut self, rec: usize, kinds: &Range<usize>) -> Option<Pending> {
        let i = self
            .ahead
            .iter()
            .position(|a| a.rec == rec && a.kinds == *kinds)?;
        self.ahead.remove(i).map(|a| a.pending)
    }

    /// Drops the reads ahead that overlap bytes `offset..offset + len` of the file, once they
    /// have landed (a write must not race a read of the same blocks).
    pub(super) fn drop_read_ahead_over(&mut self, offset: u64, len: usize) {
        let end = offset.saturating_add(len as u64);
        let (now, later) = std::mem::take(&mut self.ahead).into_iter().partition(|a| {
            let p = &a.pending;
            p.offset < end && offset < p.offset + p.len as u64
        });
        self.ahead = later;
        for a in now {
            self.forget(a);
        }
    }

    /// Gives the newest read ahead's buffer back to the pool.
    pub(super) fn drop_newest_read_ahead(&mut self) {
        if let Some(a) = self.ahead.pop_back() {
            self.forget(a);
        }
    }

    /// Waits for a read ahead nobody will take and puts its buffer back. What it found does not
    /// matter: its values are not used (`finish` returns the buffer to the pool on an error).
    fn forget(&mut self, a: Ahead) {
        if let Ok(b) = self.finish(a.pending) {
            self.pool.push(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};
    use std::sync::{Arc, Mutex};

    use super::super::super::device::MemDevice;
    use super::super::{RecordKinds, TierLayout};
    use super::*;

    /// Two units of two and one records of m and v; `staging` buffers. The device completes
    /// every request at once, so a read ahead holds the bytes of the moment it started.
    fn file(staging: usize) -> (TierFile, Arc<Mutex<Vec<u8>>>) {
        let layout = TierLayout::new(
            vec![2048, 1024],
            1024,
            RecordKinds {
                params: false,
                state: 2,
                grads: 0,
            },
        );
        let dev = MemDevice::new();
        let bytes = Arc::clone(&dev.data);
        let f = TierFile::create(
            Path::new("/nonexistent/ahead"),
            Box::new(dev),
            layout,
            staging,
        )
        .unwrap();
        (f, bytes)
    }

    fn write(f: &mut TierFile, rec: usize, x: f32) {
        let mut b = f.take_buf().unwrap();
        b.f32s_mut().iter_mut().for_each(|v| *v = x);
        let p = f.start_write(rec, b).unwrap();
        let b = f.finish(p).unwrap();
        f.put_buf(b);
    }

    /// Record `rec`'s m and v as a read of them gives them now.
    fn read(f: &mut TierFile, rec: usize) -> Result<f32, TierError> {
        let b = f.take_buf().unwrap();
        let p = f.start_read(rec, 0..2, b)?;
        let b = f.finish(p)?;
        let x = b.f32s()[0];
        assert!(b.f32s()[..2048].iter().all(|&y| y == x));
        f.put_buf(b);
        Ok(x)
    }

    #[test]
    fn a_read_ahead_is_taken_by_the_read_of_the_same_values() {
        let (mut f, _) = file(4);
        (0..3).for_each(|rec| write(&mut f, rec, rec as f32 + 1.0));
        let read_before = f.stats.read_bytes;
        // Two buffers kept: two of three records start.
        assert!(f.read_ahead(0, 0..2, 2).unwrap());
        assert!(f.read_ahead(1, 0..2, 2).unwrap());
        assert!(
            !f.read_ahead(2, 0..2, 2).unwrap(),
            "no buffer beyond the two kept"
        );
        assert!(f.read_ahead(1, 0..2, 2).unwrap(), "already started");
        assert_eq!((f.reads_ahead(), f.free_bufs()), (2, 4));
        // A read of other values of the record does not take it.
        let b = f.take_buf().unwrap();
        let p = f.start_read(0, 1..2, b).unwrap();
        let b = f.finish(p).unwrap();
        f.put_buf(b);
        assert_eq!(f.reads_ahead(), 2);
        assert_eq!(read(&mut f, 1).unwrap(), 2.0);
        assert_eq!(read(&mut f, 0).unwrap(), 1.0);
        assert_eq!(f.reads_ahead(), 0);
        assert_eq!(f.pool.len(), 4, "every buffer is back");
        // v of record 0 alone, and records 0 and 1 once each: the reads ahead were taken, not
        // read again.
        assert_eq!(f.stats.read_bytes - read_before, 4096 + 2 * 2 * 4096);
    }

    #[test]
    fn a_write_drops_the_read_ahead_of_its_bytes() {
        let (mut f, _) = file(4);
        (0..3).for_each(|rec| write(&mut f, rec, 1.0));
        assert!(f.read_ahead(0, 0..2, 0).unwrap());
        assert!(f.read_ahead(2, 0..2, 0).unwrap());
        // Only v of record 0 is written: its read ahead (m and v) is stale, record 2's is not.
        let mut b = f.take_buf().unwrap();
        b.f32s_mut().iter_mut().for_each(|v| *v = 5.0);
        let p = f.start_write_values(0, 1..2, b).unwrap();
        let b = f.finish(p).unwrap();
        f.put_buf(b);
        assert_eq!(f.reads_ahead(), 1);
        let b = f.take_buf().unwrap();
        let p = f.start_read(0, 0..2, b).unwrap();
        let b = f.finish(p).unwrap();
        assert_eq!((b.f32s()[0], b.f32s()[1024]), (1.0, 5.0));
        f.put_buf(b);
        assert_eq!(read(&mut f, 2).unwrap(), 1.0);
    }

    #[test]
    fn a_buffer_wanted_takes_back_the_newest_read_ahead() {
        let (mut f, _) = file(2);
        (0..3).for_each(|rec| write(&mut f, rec, rec as f32));
        assert!(f.read_ahead(0, 0..2, 0).unwrap());
        assert!(f.read_ahead(1, 0..2, 0).unwrap());
        assert_eq!(f.pool.len(), 0);
        let b = f.take_buf().expect("a read ahead gives its buffer up");
        assert_eq!(f.reads_ahead(), 1);
        // The one left is still good; the one dropped is read again when wanted.
        f.put_buf(b);
        assert_eq!(read(&mut f, 0).unwrap(), 0.0);
        assert_eq!(read(&mut f, 1).unwrap(), 1.0);
    }

    #[test]
    fn a_damaged_block_under_a_read_ahead_is_still_named() {
        let (mut f, bytes) = file(3);
        write(&mut f, 1, 3.0);
        assert!(f.read_ahead(1, 0..2, 0).unwrap());
        // The read ahead took the bytes before the damage: the check is on the take, and the
        // CRC is what was written, so damage before the read ahead started is caught too.
        let (mut g, bytes_g) = file(3);
        write(&mut g, 1, 3.0);
        bytes_g.lock().unwrap()[2 * 4096 + 9] ^= 1;
        assert!(g.read_ahead(1, 0..2, 0).unwrap());
        assert!(matches!(
            read(&mut g, 1),
            Err(TierError::Corrupt { unit: 0, .. })
        ));
        assert_eq!(g.free_bufs(), 3, "the buffer went back");
        drop(bytes);
        assert_eq!(read(&mut f, 1).unwrap(), 3.0);
    }

    #[test]
    fn finished_writes_land_without_waiting_and_a_file_goes_with_reads_ahead_in_flight() {
        let (mut f, _) = file(3);
        let b = f.take_buf().unwrap();
        let p = f.start_write(0, b).unwrap();
        f.defer(p);
        assert_eq!(f.pool.len(), 2);
        f.land_finished_writes();
        assert_eq!((f.pool.len(), f.deferred.len()), (3, 0));
        assert!(f.read_ahead(0, 0..2, 0).unwrap());
        assert_eq!(f.path(), PathBuf::from("/nonexistent/ahead"));
        drop(f);
    }

    #[test]
    fn no_read_ahead_in_a_file_with_two_copies() {
        let layout = TierLayout::new(
            vec![1024],
            1024,
            RecordKinds {
                params: true,
                state: 2,
                grads: 0,
            },
        );
        let mut f = TierFile::create_with(
            Path::new("/nonexistent/two"),
            Box::new(MemDevice::new()),
            layout,
            3,
            true,
        )
        .unwrap();
        assert!(!f.read_ahead(0, 0..3, 0).unwrap());
        assert_eq!(f.reads_ahead(), 0);
    }
}
