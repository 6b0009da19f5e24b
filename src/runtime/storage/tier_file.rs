//! One rank's tier file: its shard state cut into fixed-size records, addressed by offset, each
//! 4 KiB block checked by a CRC on every read.
//!
//! Layout: the shard of unit `u` (the owned chunks concatenated, as in RAM) is cut into tiles of
//! `tile_elems` elements; tile `k` of unit `u` is one record. A record holds its tile's values
//! one kind after another (`[params][m][v]`, whichever kinds this placement keeps on the tier),
//! each kind taking `4 * tile_elems` bytes (a multiple of 4096), so any one kind of a record, and
//! any 4 KiB-aligned part of it, can be read on its own. Records follow each other with no gaps:
//! one preallocated file per rank, no file per tensor, no open or close per request.
//!
//! The CRCs live in RAM (4 bytes per 4 KiB block, 0.1% of the tier) because the file is scratch
//! space for this run: a checkpoint, not this file, is what outlives the process. A block whose
//! CRC does not match is reported with its unit and offset and its values are never used.

use std::collections::VecDeque;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use super::aligned::AlignedBuf;
use super::device::{submit, Device, IoError, Op, Ticket};
pub use crate::plan::tier::RecordKinds;
use crate::plan::tier::IO_ALIGN_BYTES;

const BLOCK: usize = IO_ALIGN_BYTES as usize;

/// Where each record of a rank's shard lives in its tier file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierLayout {
    pub unit_lens: Vec<usize>,
    pub tile_elems: usize,
    pub kinds: RecordKinds,
    /// Index of each unit's first record; one more entry at the end.
    first: Vec<usize>,
    /// File offset of each record; one more entry at the end (the file's size).
    offsets: Vec<u64>,
}

impl TierLayout {
    pub fn new(unit_lens: Vec<usize>, tile_elems: usize, kinds: RecordKinds) -> Self {
        assert!(
            tile_elems > 0 && (4 * tile_elems).is_multiple_of(BLOCK),
            "tiles are whole blocks"
        );
        let mut first = Vec::with_capacity(unit_lens.len() + 1);
        let mut offsets = vec![0u64];
        let mut n = 0;
        for &len in &unit_lens {
            first.push(n);
            n += len.div_ceil(tile_elems);
            // Full tiles, then a last one only as long as the unit's rest (in whole blocks): a
            // shard is read and written without padding to the tile size.
            let mut left = len;
            while left > 0 {
                let t = left.min(tile_elems).div_ceil(BLOCK / 4) * (BLOCK / 4);
                let at = *offsets.last().expect("starts with 0");
                offsets.push(at + (4 * t * kinds.values()) as u64);
                left -= left.min(tile_elems);
            }
        }
        first.push(n);
        Self {
            unit_lens,
            tile_elems,
            kinds,
            first,
            offsets,
        }
    }

    /// Elements each value of record `rec` has room for (its tile; shorter for a unit's last).
    pub fn record_tile(&self, rec: usize) -> usize {
        ((self.offsets[rec + 1] - self.offsets[rec]) as usize / 4)
            .checked_div(self.kinds.values())
            .unwrap_or(0)
    }

    pub fn records(&self) -> usize {
        *self.first.last().expect("one entry per unit plus one")
    }

    /// Bytes of the largest record: every kind's full tile (a staging buffer's size).
    pub fn stride(&self) -> usize {
        4 * self.tile_elems * self.kinds.values()
    }

    pub fn file_bytes(&self) -> u64 {
        *self.offsets.last().expect("starts with 0")
    }

    /// File offset and bytes of values `kinds` of record `rec`.
    pub fn values_span(&self, rec: usize, kinds: Range<usize>) -> (u64, usize) {
        let len = 4 * self.record_tile(rec) * kinds.len();
        (self.value_offset(rec, kinds.start), len)
    }

    /// The record that holds file offset `offset`.
    pub fn record_at(&self, offset: u64) -> usize {
        self.offsets.partition_point(|&o| o <= offset) - 1
    }

    /// The records of unit `u`.
    pub fn unit_records(&self, u: usize) -> Range<usize> {
        self.first[u]..self.first[u + 1]
    }

    /// The unit a record belongs to and the shard elements it holds.
    pub fn record_span(&self, rec: usize) -> (usize, Range<usize>) {
        let u = self.first.partition_point(|&f| f <= rec) - 1;
        let start = (rec - self.first[u]) * self.tile_elems;
        (u, start..(start + self.tile_elems).min(self.unit_lens[u]))
    }

    /// File offset of value `k` of record `rec`.
    pub fn value_offset(&self, rec: usize, k: usize) -> u64 {
        self.offsets[rec] + (4 * self.record_tile(rec) * k) as u64
    }
}

/// Bytes moved and time spent waiting for the disk, since the file was created.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TierStats {
    pub read_bytes: u64,
    pub write_bytes: u64,
    /// Time the rank's own thread was held up by the tier: requests it waited for, and the
    /// helpers it joined ([`TierFile::add_wait`]). A helper's waits beside compute are not
    /// counted: they stall nothing (see [`beside_compute`]).
    pub wait_s: f64,
}

thread_local! {
    static BESIDE_COMPUTE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` on this thread as tier I/O beside the step's compute (a read-ahead or a gradient
/// write on a helper thread): the waits inside it are not the step's.
pub fn beside_compute<T>(f: impl FnOnce() -> T) -> T {
    BESIDE_COMPUTE.with(|b| b.set(true));
    let out = f();
    BESIDE_COMPUTE.with(|b| b.set(false));
    out
}

/// What went wrong with the tier, naming the file.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TierError {
    #[error("tier file {path}: {op:?} of {len} bytes at offset {offset} failed: {source}")]
    Io {
        path: PathBuf,
        op: Op,
        offset: u64,
        len: usize,
        source: IoError,
    },
    #[error("tier file {path}: block at offset {offset} (unit {unit}) fails its CRC check: the file was damaged on disk; its values were not used")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        unit: usize,
    },
    #[error("tier file {path}: reserving {bytes} bytes failed: {source} (the tier needs that much free space in its directory)")]
    Reserve {
        path: PathBuf,
        bytes: u64,
        source: IoError,
    },
    #[error("tier I/O: {0}")]
    Helper(String),
}

/// A request in flight.
pub struct Pending {
    ticket: Ticket,
    op: Op,
    offset: u64,
    len: usize,
}

/// One rank's tier file and its staging buffers.
pub struct TierFile {
    path: PathBuf,
    dev: Box<dyn Device>,
    pub layout: TierLayout,
    /// CRC32 of each 4 KiB block as last written (of zeros before).
    crcs: Vec<u32>,
    pool: Vec<AlignedBuf>,
    /// Writes left in flight past the phase that started them (the optimizer's write-back runs
    /// on into the next step's compute). A read waits for those it overlaps, a buffer wanted
    /// when none is free is taken from the oldest, and their first error is returned by the
    /// next read, write or [`TierFile::settle`].
    deferred: VecDeque<Pending>,
    deferred_err: Option<TierError>,
    pub stats: TierStats,
}

static FILE_SEQ: AtomicU64 = AtomicU64::new(0);

/// A file name no other tier file of this process uses.
pub fn fresh_name(epoch: u64) -> String {
    format!(
        "state-e{epoch}-{}.bin",
        FILE_SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

impl TierFile {
    /// Takes over `dev` (a fresh file at `path`), reserves the space the layout needs and
    /// allocates `staging` buffers of one record each.
    pub fn create(
        path: &Path,
        mut dev: Box<dyn Device>,
        layout: TierLayout,
        staging: usize,
    ) -> Result<Self, TierError> {
        let bytes = layout.file_bytes();
        dev.reserve(bytes).map_err(|source| TierError::Reserve {
            path: path.to_path_buf(),
            bytes,
            source,
        })?;
        let zero = crc32fast::hash(&[0u8; BLOCK]);
        let mut pool: Vec<AlignedBuf> = (0..staging.max(1))
            .map(|_| AlignedBuf::new(layout.stride()))
            .collect();
        // The staging buffers live as long as the file: pinned once, not per request.
        dev.register(&mut pool);
        Ok(Self {
            path: path.to_path_buf(),
            dev,
            crcs: vec![zero; bytes as usize / BLOCK],
            pool,
            layout,
            deferred: VecDeque::new(),
            deferred_err: None,
            stats: TierStats::default(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A staging buffer of one record, if one is free or a deferred write can give one back.
    pub fn take_buf(&mut self) -> Option<AlignedBuf> {
        if self.pool.is_empty() {
            if let Some(b) = self.deferred.pop_front().and_then(|p| self.land(p)) {
                return Some(b);
            }
        }
        self.pool.pop()
    }

    /// Leaves write `p` in flight; see `deferred`.
    pub fn defer(&mut self, p: Pending) {
        debug_assert!(p.op == Op::Write, "only writes are deferred");
        self.deferred.push_back(p);
    }

    /// Waits for every deferred write; the first error among them (or one kept from earlier).
    pub fn settle(&mut self) -> Result<(), TierError> {
        self.settle_where(|_| true)
    }

    /// Waits for the deferred writes that overlap bytes `offset..offset + len`; the first
    /// error among all deferred writes finished so far.
    fn settle_range(&mut self, offset: u64, len: usize) -> Result<(), TierError> {
        let end = offset + len as u64;
        self.settle_where(|p| p.offset < end && offset < p.offset + p.len as u64)
    }

    /// Waits for the deferred writes `wanted` picks, oldest first, and puts their buffers back;
    /// the first error among all deferred writes finished so far.
    fn settle_where(&mut self, wanted: impl Fn(&Pending) -> bool) -> Result<(), TierError> {
        let (now, later): (VecDeque<Pending>, VecDeque<Pending>) =
            std::mem::take(&mut self.deferred)
                .into_iter()
                .partition(|p| wanted(p));
        self.deferred = later;
        for p in now {
            if let Some(b) = self.land(p) {
                self.pool.push(b);
            }
        }
        self.deferred_err.take().map_or(Ok(()), Err)
    }

    /// Waits for deferred write `p`: its buffer, or `None` with its error kept for the next
    /// read, write or settle (the buffer went back to the pool).
    fn land(&mut self, p: Pending) -> Option<AlignedBuf> {
        match self.finish(p) {
            Ok(b) => Some(b),
            Err(e) => {
                self.deferred_err.get_or_insert(e);
                None
            }
        }
    }

    pub fn put_buf(&mut self, b: AlignedBuf) {
        self.pool.push(b);
    }

    /// Staging buffers not in use (a deferred write's counts: [`TierFile::take_buf`] waits for
    /// it and takes its buffer).
    pub fn free_bufs(&self) -> usize {
        self.pool.len() + self.deferred.len()
    }

    /// Starts reading values `kinds` (a range of value indices) of record `rec` into `buf`.
    pub fn start_read(
        &mut self,
        rec: usize,
        kinds: Range<usize>,
        buf: AlignedBuf,
    ) -> Result<Pending, TierError> {
        let (offset, len) = self.layout.values_span(rec, kinds);
        // What it reads may be what a deferred write is writing: those writes land first. The
        // others stay in flight (the next step's first reads need not wait for the last
        // records the optimizer wrote back).
        if let Err(e) = self.settle_range(offset, len) {
            self.pool.push(buf);
            return Err(e);
        }
        self.start(Op::Read, offset, len, buf)
    }

    /// Starts writing the whole record `rec` from `buf`.
    pub fn start_write(&mut self, rec: usize, buf: AlignedBuf) -> Result<Pending, TierError> {
        let all = 0..self.layout.kinds.values();
        self.start_write_values(rec, all, buf)
    }

    /// Starts writing values `kinds` of record `rec`; `buf` holds them from its start.
    pub fn start_write_values(
        &mut self,
        rec: usize,
        kinds: Range<usize>,
        buf: AlignedBuf,
    ) -> Result<Pending, TierError> {
        if let Some(e) = self.deferred_err.take() {
            self.pool.push(buf);
            return Err(e);
        }
        let (offset, len) = self.layout.values_span(rec, kinds);
        let first = offset as usize / BLOCK;
        for (i, block) in buf.bytes()[..len].chunks(BLOCK).enumerate() {
            self.crcs[first + i] = crc32fast::hash(block);
        }
        self.stats.write_bytes += len as u64;
        self.start(Op::Write, offset, len, buf)
    }

    fn start(
        &mut self,
        op: Op,
        offset: u64,
        len: usize,
        buf: AlignedBuf,
    ) -> Result<Pending, TierError> {
        debug_assert!(
            (offset as usize).is_multiple_of(BLOCK)
                && len.is_multiple_of(BLOCK)
                && len <= buf.len()
        );
        let ticket =
            submit(self.dev.as_mut(), op, offset, len, buf).map_err(|source| TierError::Io {
                path: self.path.clone(),
                op,
                offset,
                len,
                source,
            })?;
        Ok(Pending {
            ticket,
            op,
            offset,
            len,
        })
    }

    /// Counts `s` seconds the rank's thread spent waiting for a helper's I/O on this file.
    pub fn add_wait(&mut self, s: f64) {
        self.stats.wait_s += s;
    }

    /// Waits for `p`, checks what was read against the CRCs, and returns the buffer. On error
    /// the buffer still goes back to the pool.
    pub fn finish(&mut self, p: Pending) -> Result<AlignedBuf, TierError> {
        let t0 = Instant::now();
        let done = p.ticket.wait();
        if !BESIDE_COMPUTE.with(|b| b.get()) {
            self.stats.wait_s += t0.elapsed().as_secs_f64();
        }
        let fail = |source| TierError::Io {
            path: self.path.clone(),
            op: p.op,
            offset: p.offset,
            len: p.len,
            source,
        };
        if let Err(e) = done.result {
            let err = fail(e);
            if done.buf.len() >= self.layout.stride() {
                self.pool.push(done.buf);
            }
            return Err(err);
        }
        match p.op {
            Op::Read => {
                self.stats.read_bytes += p.len as u64;
                let first = p.offset as usize / BLOCK;
                for (i, block) in done.buf.bytes()[..p.len].chunks(BLOCK).enumerate() {
                    if crc32fast::hash(block) != self.crcs[first + i] {
                        let offset = ((first + i) * BLOCK) as u64;
                        let rec = self.layout.record_at(offset);
                        let unit = self.layout.record_span(rec).0;
                        self.pool.push(done.buf);
                        return Err(TierError::Corrupt {
                            path: self.path.clone(),
                            offset,
                            unit,
                        });
                    }
                }
            }
            // Counted when started (a deferred write may finish in a later step).
            Op::Write => {}
        }
        Ok(done.buf)
    }
}

impl Drop for TierFile {
    fn drop(&mut self) {
        // No write may still be landing in a file about to be removed.
        let _ = self.settle();
        // Scratch state: a dropped rank state's file is of no use to anyone.
        let _ = std::fs::remove_file(&self.path);
        // And the rank's folder once its last file is gone (fails harmlessly otherwise).
        if let Some(dir) = self.path.parent() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::super::device::{Faults, FaultyDevice, MemDevice};
    use super::*;

    fn layout() -> TierLayout {
        TierLayout::new(
            vec![3000, 0, 1024],
            1024,
            RecordKinds {
                params: true,
                state: 2,
                grads: 0,
            },
        )
    }

    #[test]
    fn records_tile_each_unit() {
        let l = layout();
        assert_eq!(l.records(), 4);
        assert_eq!(l.unit_records(0), 0..3);
        assert_eq!(l.unit_records(1), 3..3);
        assert_eq!(l.record_span(2), (0, 2048..3000));
        assert_eq!(l.record_span(3), (2, 0..1024));
        assert_eq!(l.stride(), 3 * 4096);
        assert_eq!(l.value_offset(1, 2), (3 * 4096 + 2 * 4096) as u64);
    }

    fn file(faults: Faults) -> TierFile {
        file_and_bytes(faults).0
    }

    fn file_and_bytes(faults: Faults) -> (TierFile, Arc<Mutex<Vec<u8>>>) {
        let dev = MemDevice::new();
        let bytes = Arc::clone(&dev.data);
        let f = TierFile::create(
            Path::new("/nonexistent/never-written"),
            Box::new(FaultyDevice::new(dev, faults)),
            layout(),
            2,
        )
        .unwrap();
        (f, bytes)
    }

    #[test]
    fn round_trip_and_partial_reads() {
        let mut f = file(Faults::default());
        let mut b = f.take_buf().unwrap();
        for (i, x) in b.f32s_mut().iter_mut().enumerate() {
            *x = i as f32;
        }
        let p = f.start_write(1, b).unwrap();
        let b = f.finish(p).unwrap();
        f.put_buf(b);
        let b = f.take_buf().unwrap();
        let p = f.start_read(1, 1..3, b).unwrap();
        let b = f.finish(p).unwrap();
        assert_eq!(b.f32s()[0], 1024.0);
        assert_eq!(b.f32s()[2047], 3071.0);
        f.put_buf(b);
        // Elements 1030..1040 of the shard are record 1's elements 6..16; value 2 is v.
        let b = f.take_buf().unwrap();
        let p = f.start_read(1, 2..3, b).unwrap();
        let b = f.finish(p).unwrap();
        let v = b.f32s()[6..16].to_vec();
        assert_eq!(v, (2054..2064).map(|i| i as f32).collect::<Vec<_>>());
        assert_eq!(f.stats.write_bytes, 3 * 4096);
    }

    /// The waits of a helper beside compute are not the step's; joining one is.
    #[test]
    fn waits_beside_compute_are_not_counted() {
        let mut f = file(Faults::default());
        let moved = beside_compute(|| {
            let b = f.take_buf().unwrap();
            let p = f.start_write(0, b).unwrap();
            let b = f.finish(p).unwrap();
            f.put_buf(b);
            f.stats
        });
        assert_eq!(moved.write_bytes, 3 * 4096);
        assert_eq!(moved.wait_s, 0.0);
        f.add_wait(0.25);
        assert_eq!(f.stats.wait_s, 0.25);
        // The thread is the step's again once `beside_compute` returns.
        assert!(!BESIDE_COMPUTE.with(|b| b.get()));
    }

    #[test]
    fn a_damaged_block_is_named_and_not_used() {
        let (mut f, bytes) = file_and_bytes(Faults::default());
        let b = f.take_buf().unwrap();
        let p = f.start_write(2, b).unwrap();
        let b = f.finish(p).unwrap();
        f.put_buf(b);
        // Flip a bit behind the engine's back, in record 2's v.
        bytes.lock().unwrap()[2 * 3 * 4096 + 2 * 4096 + 17] ^= 1;
        let b = f.take_buf().unwrap();
        let p = f.start_read(2, 0..3, b).unwrap();
        let err = f.finish(p).unwrap_err();
        assert_eq!(
            err,
            TierError::Corrupt {
                path: PathBuf::from("/nonexistent/never-written"),
                offset: (2 * 3 * 4096 + 2 * 4096) as u64,
                unit: 0,
            }
        );
        assert!(err.to_string().contains("fails its CRC check"));
        // The buffer went back to the pool.
        assert_eq!(f.pool.len(), 2);
    }

    #[test]
    fn a_full_disk_is_a_typed_error() {
        let mut f = file(Faults {
            fail_after_write_bytes: Some(4096),
            errno: libc::ENOSPC,
        });
        let b = f.take_buf().unwrap();
        let p = f.start_write(0, b).unwrap();
        let err = f.finish(p).unwrap_err();
        assert!(matches!(
            err,
            TierError::Io {
                source: IoError::NoSpace,
                ..
            }
        ));
        assert!(err.to_string().contains("no space left"));
    }

    #[test]
    fn deferred_writes_are_waited_for_by_overlapping_reads_and_their_errors_surface() {
        let mut f = file(Faults::default());
        let mut b = f.take_buf().unwrap();
        b.f32s_mut().iter_mut().for_each(|x| *x = 7.0);
        let p = f.start_write(0, b).unwrap();
        f.defer(p);
        // The deferred write's buffer counts as free and is taken back when wanted.
        assert_eq!(f.free_bufs(), 2);
        let b1 = f.take_buf().unwrap();
        let b2 = f.take_buf().unwrap();
        assert!(f.take_buf().is_none());
        f.put_buf(b2);
        // A read waits for what is deferred and sees it.
        let p = f.start_read(0, 0..1, b1).unwrap();
        assert_eq!(f.finish(p).unwrap().f32s()[0], 7.0);
        // A failed deferred write is reported by the next operation, not lost.
        let mut f = file(Faults {
            fail_after_write_bytes: Some(4096),
            errno: libc::EIO,
        });
        let b = f.take_buf().unwrap();
        let p = f.start_write(0, b).unwrap();
        f.defer(p);
        // A read of another record leaves it in flight...
        let b = f.take_buf().unwrap();
        let p = f.start_read(1, 0..1, b).unwrap();
        let b = f.finish(p).unwrap();
        f.put_buf(b);
        assert_eq!(f.deferred.len(), 1);
        // ... and one that overlaps it waits for it and gets its error.
        let b = f.take_buf().unwrap();
        assert!(matches!(
            f.start_read(0, 1..2, b),
            Err(TierError::Io { .. })
        ));
        assert_eq!(f.free_bufs(), 2, "every buffer is back");
        assert!(f.settle().is_ok(), "reported once");
    }
}
