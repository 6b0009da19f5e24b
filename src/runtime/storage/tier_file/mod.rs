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
//!
//! Design: docs/memory-and-tier.md (the tier file).

use crate::runtime::clock::Stopwatch;
use std::collections::VecDeque;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

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
    /// on into the next step's compute). A read or a write waits for those it overlaps, a
    /// buffer wanted when none is free is taken from the oldest, and their first error is
    /// returned by the next read, write or [`TierFile::settle`].
    deferred: VecDeque<Pending>,
    deferred_err: Option<TierError>,
    /// Reads started before anyone asked for them ([`TierFile::read_ahead`]).
    ahead: VecDeque<Ahead>,
    pub stats: TierStats,
    /// With two copies of every record, which copy holds each unit's state; `None` with one.
    copies: Option<Copies>,
}

/// Two copies of every record (`plan::tier::updates_in_backward`): a step's updates are
/// written to each unit's other copy, which becomes its state only when the step is agreed
/// ([`TierFile::commit_next`]); until then, and for ever if the step is redone or skipped,
/// the state is what it was. The second copy follows the first in the file.
struct Copies {
    /// Per unit: its state is in the second copy.
    second: Vec<bool>,
    /// Per unit: its other copy holds this step's update, complete.
    staged: Vec<bool>,
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
        dev: Box<dyn Device>,
        layout: TierLayout,
        staging: usize,
    ) -> Result<Self, TierError> {
        Self::create_with(path, dev, layout, staging, false)
    }

    /// Like [`TierFile::create`]; with `two_copies`, the file holds every record twice (see
    /// `Copies`).
    pub fn create_with(
        path: &Path,
        mut dev: Box<dyn Device>,
        layout: TierLayout,
        staging: usize,
        two_copies: bool,
    ) -> Result<Self, TierError> {
        let copies = two_copies.then(|| Copies {
            second: vec![false; layout.unit_lens.len()],
            staged: vec![false; layout.unit_lens.len()],
        });
        let bytes = layout.file_bytes() * if two_copies { 2 } else { 1 };
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
            ahead: VecDeque::new(),
            stats: TierStats::default(),
            copies,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes the file takes (both copies where it keeps two).
    pub fn file_bytes(&self) -> u64 {
        self.layout.file_bytes() * if self.copies.is_some() { 2 } else { 1 }
    }

    /// Whether the file keeps two copies of every record (updates go to the other one).
    pub fn two_copies(&self) -> bool {
        self.copies.is_some()
    }

    /// File offset of logical offset `offset` of unit `u`'s records: in the copy holding the
    /// unit's state, or with `next` in the other one.
    fn placed(&self, offset: u64, u: usize, next: bool) -> u64 {
        match &self.copies {
            Some(c) if c.second[u] != next => offset + self.layout.file_bytes(),
            _ => offset,
        }
    }

    /// Marks unit `u`'s other copy as holding its complete update for this step.
    pub fn stage_next(&mut self, u: usize) {
        if let Some(c) = &mut self.copies {
            c.staged[u] = true;
        }
    }

    /// Units whose other copy holds this step's complete update.
    pub fn staged_units(&self) -> usize {
        self.copies
            .as_ref()
            .map_or(0, |c| c.staged.iter().filter(|s| **s).count())
    }

    /// Makes every staged unit's other copy its state; how many units that was.
    pub fn commit_next(&mut self) -> usize {
        let Some(c) = &mut self.copies else {
            return 0;
        };
        let mut n = 0;
        for (second, staged) in c.second.iter_mut().zip(&mut c.staged) {
            if std::mem::take(staged) {
                *second = !*second;
                n += 1;
            }
        }
        n
    }

    /// Forgets what was written to the other copies (a pass redone, a step skipped or
    /// abandoned): the state stays what it was.
    pub fn drop_next(&mut self) {
        if let Some(c) = &mut self.copies {
            c.staged.iter_mut().for_each(|s| *s = false);
        }
    }

    /// A staging buffer of one record, if one is free, a deferred write can give one back, or
    /// (the last resort) a read ahead nobody has taken yet gives its up, the newest first.
    pub fn take_buf(&mut self) -> Option<AlignedBuf> {
        let b = self.take_free_buf();
        if b.is_some() {
            return b;
        }
        self.drop_newest_read_ahead();
        self.pool.pop()
    }

    /// [`TierFile::take_buf`] without taking one from a read ahead.
    pub fn take_free_buf(&mut self) -> Option<AlignedBuf> {
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

    /// Staging buffers not in use (a deferred write's and a read ahead's count:
    /// [`TierFile::take_buf`] waits for them and takes their buffers).
    pub fn free_bufs(&self) -> usize {
        self.pool.len() + self.deferred.len() + self.ahead.len()
    }

    /// Starts reading values `kinds` (a range of value indices) of record `rec` into `buf`.
    pub fn start_read(
        &mut self,
        rec: usize,
        kinds: Range<usize>,
        buf: AlignedBuf,
    ) -> Result<Pending, TierError> {
        if let Some(p) = self.take_read_ahead(rec, &kinds) {
            self.pool.push(buf);
            return Ok(p);
        }
        let (offset, len, buf) = self.settled_span(rec, kinds, false, buf)?;
        self.start(Op::Read, offset, len, buf)
    }

    /// File offset and bytes of values `kinds` of record `rec` (in the unit's other copy with
    /// `next`), once the deferred writes of those bytes have landed: a read may want what one
    /// is writing, and two writes of the same blocks in flight could land in either order (an
    /// update of a redone pass over the first pass's). The other deferred writes stay in
    /// flight (the next step's first reads need not wait for the last records the optimizer
    /// wrote back). On error `buf` goes back to the pool.
    fn settled_span(
        &mut self,
        rec: usize,
        kinds: Range<usize>,
        next: bool,
        buf: AlignedBuf,
    ) -> Result<(u64, usize, AlignedBuf), TierError> {
        let (offset, len) = self.layout.values_span(rec, kinds);
        let offset = self.placed(offset, self.layout.record_span(rec).0, next);
        match self.settle_range(offset, len) {
            Ok(()) => Ok((offset, len, buf)),
            Err(e) => {
                self.pool.push(buf);
                Err(e)
            }
        }
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
        self.write_values(rec, kinds, buf, false)
    }

    /// Like [`TierFile::start_write_values`], into the unit's other copy: its update, which
    /// becomes its state at [`TierFile::commit_next`]. Needs a file with two copies.
    pub fn start_write_next(
        &mut self,
        rec: usize,
        kinds: Range<usize>,
        buf: AlignedBuf,
    ) -> Result<Pending, TierError> {
        debug_assert!(self.copies.is_some(), "a file with one copy has no other");
        self.write_values(rec, kinds, buf, true)
    }

    fn write_values(
        &mut self,
        rec: usize,
        kinds: Range<usize>,
        buf: AlignedBuf,
        next: bool,
    ) -> Result<Pending, TierError> {
        let (offset, len, buf) = self.settled_span(rec, kinds, next, buf)?;
        // A read ahead of these bytes would hand out what they held before.
        self.drop_read_ahead_over(offset, len);
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
        let t0 = Stopwatch::start();
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
                        let rec = self.layout.record_at(offset % self.layout.file_bytes());
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
        // No read or write may still be landing in buffers or a file about to go.
        self.drop_read_ahead_over(0, usize::MAX);
        let _ = self.settle();
        // Scratch state: a dropped rank state's file is of no use to anyone.
        super::folder::remove_with_folder(&self.path);
    }
}

mod read_ahead;
use read_ahead::Ahead;

#[cfg(test)]
mod tests;
