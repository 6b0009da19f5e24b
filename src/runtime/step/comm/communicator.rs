//! A rank's communicator: matches incoming frames to the collective waiting for them, drops stale
//! ones, enforces deadlines and bounds, and counts every byte sent.
//!
//! Frames can arrive early (a peer already posted a later phase), late (from an aborted attempt
//! or an old step) or twice (a duplicating network). Early frames wait in a bounded pending set
//! keyed by (epoch, step, sender, tag); late and duplicate frames are dropped and counted, never
//! applied.
//!
//! Where the transport shares memory with its peers ([`SharedMemory`], asked for in one place:
//! `Comm::shared_memory`), payloads are written straight into a slot the receivers read,
//! checksummed as they are written, and received into memory the rank lends ([`Comm::lent`]);
//! without it every payload travels in its frame. The rules of lent memory are in
//! `transport::shared_memory`.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;

use crate::plan::RankId;
use crate::runtime::clock::{Clock, Deadline, SystemClock};
use crate::runtime::transport::{
    AddFn, Frame, PeerMemory, SharedMemory, Tag, TagKind, Transport, TransportError,
    FRAME_HEADER_BYTES,
};
use crate::wire::frame::pieces;

/// Memory lent for one payload: its sender, its tag (piece 0), where it goes, its length, and,
/// for a payload to be added into the memory rather than written there, the addition
/// ([`SharedMemory::lend`]; the caller adds what did not land itself).
pub type Lend = (RankId, Tag, *mut u8, usize, Option<AddFn>);

/// Bytes encoded at a time by [`Comm::send_pieces_encoded`] before their checksum is taken: small
/// enough to be read back from L1/L2 (a 4 MiB piece read again for its checksum comes from
/// memory), a multiple of every element width.
pub const SUM_BLOCK_BYTES: usize = 64 << 10;

/// Copies `src` into `dst` (the same length) a block at a time, taking the CRC-32 of each block
/// while it is in cache: a staged payload's checksum without a second pass.
fn copy_summed(src: &[u8], dst: &mut [u8]) -> u32 {
    let mut sum = crc32fast::Hasher::new();
    for (s, d) in src
        .chunks(SUM_BLOCK_BYTES)
        .zip(dst.chunks_mut(SUM_BLOCK_BYTES))
    {
        d.copy_from_slice(s);
        sum.update(d);
    }
    sum.finalize()
}

/// Most frames held for later phases; a peer that floods us is a protocol error, not an OOM.
pub const MAX_PENDING_FRAMES: usize = 1 << 16;

/// Expected communication failures, reported as typed events by the rank.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommError {
    #[error("waited {timeout_ms} ms for {tag:?} from rank {from}; it may have failed")]
    Timeout {
        from: RankId,
        tag: Tag,
        timeout_ms: u64,
    },
    #[error("the run is stopping (transport closed)")]
    Closed,
    #[error("rank {0} is unreachable")]
    PeerGone(RankId),
    #[error("protocol error from rank {from}: {what}")]
    Protocol { from: RankId, what: String },
    #[error("interrupted: the step is being abandoned")]
    Interrupted,
    /// The rank's storage tier failed (I/O error, damaged block): its state cannot be trusted,
    /// so the rank counts as lost.
    #[error("{0}")]
    Storage(String),
    /// Fault injection: this rank vanishes (the runtime disconnects it).
    #[error("this rank vanished (injected fault)")]
    Vanished,
}

impl From<TransportError> for CommError {
    fn from(e: TransportError) -> Self {
        match e {
            TransportError::Closed => CommError::Closed,
            TransportError::UnknownPeer(r) => CommError::PeerGone(r),
            TransportError::Pull { from, what } => CommError::Protocol {
                from,
                what: format!("reading its memory failed: {what}"),
            },
            TransportError::Timeout(ms) => CommError::Protocol {
                from: u32::MAX,
                what: format!("bare transport timeout after {ms} ms"),
            },
        }
    }
}

/// Counters for one step (reset by `begin_step`), plus lifetime drop counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommStats {
    pub frames_sent: u64,
    pub bytes_sent: u64,
    pub param_elems_sent: u64,
    pub grad_elems_sent: u64,
    pub stale_dropped: u64,
    pub duplicates_dropped: u64,
}

pub struct Comm<T: Transport> {
    transport: T,
    epoch: u64,
    step: u64,
    timeout_ms: u64,
    /// What the deadlines are read on.
    clock: Arc<dyn Clock>,
    /// Early frames by (epoch, step, sender, tag): a fast peer may already be one step ahead.
    pending: BTreeMap<(u64, u64, RankId, Tag), Bytes>,
    /// Frames whose payload the transport placed in lent memory (`recv_pieces_into`), by the
    /// same key: their frames arrive with empty payloads.
    placed: BTreeSet<(u64, u64, RankId, Tag)>,
    /// While a batch of loans is open: the pieces lent for, by (sender, tag), and whether the
    /// transport was told that the rank waits for something else (`fetch_unlent`).
    lent: Option<(BTreeSet<(RankId, Tag)>, bool)>,
    stats: CommStats,
}

impl<T: Transport> Comm<T> {
    /// A communicator whose deadlines are wall time.
    pub fn new(transport: T, timeout_ms: u64) -> Self {
        Self::on_clock(transport, timeout_ms, SystemClock::shared())
    }

    /// A communicator whose deadlines are read on `clock`: the clock its transport waits on.
    pub fn on_clock(transport: T, timeout_ms: u64, clock: Arc<dyn Clock>) -> Self {
        Self {
            transport,
            epoch: 0,
            step: 0,
            timeout_ms,
            clock,
            pending: BTreeMap::new(),
            placed: BTreeSet::new(),
            lent: None,
            stats: CommStats::default(),
        }
    }

    pub fn rank(&self) -> RankId {
        self.transport.rank()
    }

    /// The transport's shared-memory capability, if it has one: the one place this
    /// communicator asks for it.
    fn shared_memory(&self) -> Option<&dyn SharedMemory> {
        self.transport.shared_memory()
    }

    pub fn stats(&self) -> CommStats {
        self.stats
    }

    /// Enters (epoch, step): frames of earlier steps still pending are now stale; frames a
    /// faster peer already sent for this step stay.
    pub fn begin_step(&mut self, epoch: u64, step: u64) {
        self.epoch = epoch;
        self.step = step;
        let before = self.pending.len();
        self.pending
            .retain(|&(e, s, _, _), _| (e, s) >= (epoch, step));
        self.placed.retain(|&(e, s, _, _)| (e, s) >= (epoch, step));
        let stale_dropped = self.stats.stale_dropped + (before - self.pending.len()) as u64;
        self.stats = CommStats {
            stale_dropped,
            ..CommStats::default()
        };
    }

    /// Records data elements sent, for the volume report (the collectives know what they send).
    pub fn count_elems(&mut self, param_elems: u64, grad_elems: u64) {
        self.stats.param_elems_sent += param_elems;
        self.stats.grad_elems_sent += grad_elems;
    }

    /// Hands over anything the transport held back; call when a job's sends are done.
    pub fn flush(&self) {
        self.transport.flush();
    }

    pub fn send(&mut self, to: RankId, tag: Tag, payload: Bytes) -> Result<(), CommError> {
        self.stats.frames_sent += 1;
        self.stats.bytes_sent += payload.len() as u64 + FRAME_HEADER_BYTES;
        let frame = self.frame(tag, payload);
        Ok(self.transport.send(to, frame)?)
    }

    /// `send` of one payload to each of `to`; the transport may encode it once.
    pub fn send_to_each(
        &mut self,
        to: &[RankId],
        tag: Tag,
        payload: Bytes,
    ) -> Result<(), CommError> {
        if to.is_empty() {
            return Ok(());
        }
        self.stats.frames_sent += to.len() as u64;
        self.stats.bytes_sent += (payload.len() as u64 + FRAME_HEADER_BYTES) * to.len() as u64;
        let mut frame = self.frame(tag, Bytes::new());
        let staged = match self.shared_memory() {
            Some(shm) => shm.send_to_each_staged(to, &frame, payload.len(), &mut |dst| {
                copy_summed(&payload, dst)
            })?,
            None => false,
        };
        if !staged {
            frame.payload = payload;
            self.transport.send_to_each(to, frame)?;
        }
        Ok(())
    }

    /// A frame of this rank in the current (epoch, step).
    fn frame(&self, tag: Tag, payload: Bytes) -> Frame {
        Frame {
            epoch: self.epoch,
            step: self.step,
            from: self.rank(),
            tag,
            payload,
        }
    }

    /// `send_to_each` of `payload` as its pieces ([`pieces`]), each its own frame (a slice of
    /// `payload`, no copy).
    pub fn send_pieces(
        &mut self,
        to: &[RankId],
        tag: Tag,
        payload: Bytes,
    ) -> Result<(), CommError> {
        if to.is_empty() {
            return Ok(());
        }
        for (i, r) in pieces(payload.len()).enumerate() {
            self.send_to_each(to, tag.piece(i as u32), payload.slice(r))?;
        }
        Ok(())
    }

    /// Sends a `len`-byte payload as its pieces, each written by `encode(byte range, out)`
    /// (appending exactly that range's bytes to `out`) just before it goes, in blocks of
    /// [`SUM_BLOCK_BYTES`] whose checksum is taken while they are still in cache where the
    /// transport shares memory ([`SharedMemory::send_to_each_summed`]): it then need not read
    /// the piece again for its frame's checksum.
    pub fn send_pieces_encoded(
        &mut self,
        to: &[RankId],
        tag: Tag,
        len: usize,
        mut encode: impl FnMut(Range<usize>, &mut Vec<u8>),
    ) -> Result<(), CommError> {
        if to.is_empty() {
            return Ok(());
        }
        for (i, r) in pieces(len).enumerate() {
            self.send_encoded(to, tag.piece(i as u32), r, &mut encode)?;
        }
        Ok(())
    }

    /// One frame of [`Comm::send_pieces_encoded`]: the bytes `range` of a payload, as `tag`.
    pub fn send_encoded(
        &mut self,
        to: &[RankId],
        tag: Tag,
        range: Range<usize>,
        mut encode: impl FnMut(Range<usize>, &mut Vec<u8>),
    ) -> Result<(), CommError> {
        if to.is_empty() {
            return Ok(());
        }
        self.stats.frames_sent += to.len() as u64;
        self.stats.bytes_sent += (range.len() as u64 + FRAME_HEADER_BYTES) * to.len() as u64;
        let frame = self.frame(tag, Bytes::new());
        let Some(shm) = self.shared_memory() else {
            // Without a checksum to take, the piece is encoded in one go.
            let mut out = Vec::with_capacity(range.len());
            encode_in_blocks(
                range.clone(),
                range.len().max(1),
                &mut encode,
                &mut out,
                None,
            );
            let frame = Frame {
                payload: Bytes::from(out),
                ..frame
            };
            return Ok(self.transport.send_to_each(to, frame)?);
        };
        let mut block_out = Vec::new();
        let staged = shm.send_to_each_staged(to, &frame, range.len(), &mut |dst| {
            encode_into_slot(range.clone(), &mut encode, &mut block_out, dst)
        })?;
        if staged {
            return Ok(());
        }
        let mut out = Vec::with_capacity(range.len());
        let mut sum = crc32fast::Hasher::new();
        encode_in_blocks(
            range,
            SUM_BLOCK_BYTES,
            &mut encode,
            &mut out,
            Some(&mut sum),
        );
        let frame = Frame {
            payload: Bytes::from(out),
            ..frame
        };
        Ok(shm.send_to_each_summed(to, frame, sum.finalize())?)
    }

    /// Receives the `len`-byte payload `from` sent as pieces, handing each to
    /// `place(byte offset, bytes)` in order, within one deadline for the whole payload. A piece
    /// of the wrong length is a protocol error, and nothing after it is placed.
    pub fn recv_pieces(
        &mut self,
        from: RankId,
        tag: Tag,
        len: usize,
        mut place: impl FnMut(usize, &[u8]),
    ) -> Result<(), CommError> {
        let deadline = self.deadline();
        for (i, r) in pieces(len).enumerate() {
            let tag = tag.piece(i as u32);
            let got = self.recv_until(from, tag, deadline)?;
            piece_fits(from, tag, i, got.len(), r.len(), len)?;
            place(r.start, &got);
        }
        Ok(())
    }

    /// Receives the payload `from` sent as pieces (as `recv_pieces`) into `dest`, which is
    /// exactly its length. Where the transport can (UCX), each piece lands in `dest` with no
    /// copy and is checked there; otherwise, and for pieces that arrived before this call,
    /// the bytes are copied in. On an error `dest` holds an unspecified mix of old and new
    /// bytes.
    pub fn recv_pieces_into(
        &mut self,
        from: RankId,
        tag: Tag,
        dest: &mut [u8],
    ) -> Result<(), CommError> {
        self.recv_pieces_into_after(tag, vec![(from, dest)], |_| Ok(()))
    }

    /// `recv_pieces_into` from several peers at once (each `dests` entry is one peer's payload
    /// and where it goes), with `before` run after the buffers are lent and before the wait:
    /// sends made there let the peers' answers, often sent at the same moment, land in place
    /// instead of arriving before their buffers were lent.
    pub fn recv_pieces_into_after(
        &mut self,
        tag: Tag,
        mut dests: Vec<(RankId, &mut [u8])>,
        before: impl FnOnce(&mut Self) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        // One pointer per buffer, taken once: the pieces' pointers derive from it, and the
        // buffer is not reborrowed while they are lent.
        let loans: Vec<Lend> = dests
            .iter_mut()
            .map(|(from, d)| (*from, tag, d.as_mut_ptr(), d.len(), None))
            .collect();
        let mut later = Vec::new();
        // SAFETY: the buffers (borrowed by `dests` until the end) outlive the call, and
        // nothing else touches them.
        unsafe {
            self.lent(&loans, |c, any_lent| {
                before(c)?;
                let deadline = c.deadline();
                c.recv_all_lent(&loans, any_lent, deadline, &mut later)
            })?;
            place_later(&loans, later);
        }
        Ok(())
    }

    /// Inside [`Comm::lent`]'s body (`any_lent` as it was given): waits (until `deadline`) for
    /// every piece of each of `loans`' payloads. A piece that did not land in place is copied
    /// into its buffer at once when nothing is lent; otherwise it waits in `later` (loan,
    /// offset, bytes) for [`place_later`] once the loans have ended, so that nothing writes
    /// lent memory while the transport might.
    ///
    /// # Safety
    /// `loans`' memory is lent as for [`Comm::lent`] (`transport::shared_memory`'s loans
    /// section).
    pub unsafe fn recv_all_lent(
        &mut self,
        loans: &[Lend],
        any_lent: bool,
        deadline: Deadline,
        later: &mut Vec<(usize, usize, Bytes)>,
    ) -> Result<(), CommError> {
        for (k, &(from, tag, base, len, add)) in loans.iter().enumerate() {
            debug_assert!(add.is_none(), "pieces that did not land are copied in");
            for (i, r) in pieces(len).enumerate() {
                match self.recv_piece(from, tag, i, len, deadline)? {
                    None => {}
                    Some(b) if any_lent => later.push((k, r.start, b)),
                    // SAFETY: nothing is lent, so only this rank writes the buffer, and the
                    // piece is its range's length (checked).
                    Some(b) => unsafe {
                        std::ptr::copy_nonoverlapping(b.as_ptr(), base.add(r.start), b.len())
                    },
                }
            }
        }
        Ok(())
    }

    /// Lends the memory of each of `loans`, piece by piece (those not here yet), runs
    /// `body(self, anything lent)`, and ends the loans once it returns; a panic in between
    /// aborts the process. Inside, [`Comm::recv_piece`] says which pieces landed in place.
    /// Without the transport's [`SharedMemory`] nothing is lent.
    ///
    /// # Safety
    /// Each loan's memory is borrowed as `transport::shared_memory`'s loans section says:
    /// valid until this returns, and read or written by nothing meanwhile except a piece that
    /// `recv_piece` reported landed.
    pub unsafe fn lent<R>(
        &mut self,
        loans: &[Lend],
        body: impl FnOnce(&mut Self, bool) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        // SAFETY: passed on from the caller.
        let keys = unsafe { self.lend_pieces(loans) };
        if keys.is_empty() {
            return body(self, false);
        }
        let armed = AbortOnUnwind;
        self.lent = Some((keys, false));
        let got = body(self, true);
        self.lent = None;
        if let Some(shm) = self.shared_memory() {
            shm.end_loans();
        }
        drop(armed);
        got
    }

    /// Lends each piece of `loans` that is not pending already; the (sender, tag) of the
    /// pieces lent.
    ///
    /// # Safety
    /// As for [`Comm::lent`], which ends the loans.
    unsafe fn lend_pieces(&self, loans: &[Lend]) -> BTreeSet<(RankId, Tag)> {
        let mut keys = BTreeSet::new();
        let Some(shm) = self.shared_memory() else {
            return keys;
        };
        let at_step = (self.epoch, self.step);
        for &(from, tag, base, len, add) in loans {
            for (i, r) in pieces(len).enumerate() {
                let t = tag.piece(i as u32);
                if self.pending.contains_key(&(self.epoch, self.step, from, t)) {
                    continue;
                }
                // SAFETY: passed on from the caller.
                if unsafe { shm.lend(from, at_step, t, (base.add(r.start), r.len()), add) } {
                    keys.insert((from, t));
                }
            }
        }
        keys
    }

    /// Waits (until `deadline`) for piece `i` of the `len`-byte payload `tag` from `from`:
    /// `None` when it landed in memory lent for it and passed every check there, else its
    /// bytes (checked to be the piece's length).
    pub fn recv_piece(
        &mut self,
        from: RankId,
        tag: Tag,
        i: usize,
        len: usize,
        deadline: Deadline,
    ) -> Result<Option<Bytes>, CommError> {
        let t = tag.piece(i as u32);
        let got = self.recv_until(from, t, deadline)?;
        if self.placed.remove(&(self.epoch, self.step, from, t)) {
            return Ok(None);
        }
        let want = pieces(len).nth(i).map_or(0, |r| r.len());
        piece_fits(from, t, i, got.len(), want, len)?;
        Ok(Some(got))
    }

    /// One collective timeout from now.
    pub fn deadline(&self) -> Deadline {
        self.deadline_in(self.timeout_ms)
    }

    /// `ms` from now on this communicator's clock.
    pub fn deadline_in(&self, ms: u64) -> Deadline {
        Deadline::after(&*self.clock, ms)
    }

    /// Waits for the frame `tag` from `from` in the current (epoch, step).
    pub fn recv(&mut self, from: RankId, tag: Tag) -> Result<Bytes, CommError> {
        let deadline = self.deadline();
        self.recv_until(from, tag, deadline)
    }

    /// Whether the transport can read the memory of every one of `peers` (at least one).
    pub fn can_pull_all(&self, peers: &[RankId]) -> bool {
        !peers.is_empty() && peers.iter().all(|&p| self.can_pull(p))
    }

    /// [`SharedMemory::can_pull`]: whether this rank and `peer` can read each other's memory
    /// (never without the capability).
    pub fn can_pull(&self, peer: RankId) -> bool {
        self.shared_memory().is_some_and(|shm| shm.can_pull(peer))
    }

    /// [`SharedMemory::peer_memory`]: `from`'s memory, to read from any thread.
    pub fn peer_memory(&self, from: RankId) -> Result<Arc<dyn PeerMemory>, CommError> {
        let shm = self.shared_memory().ok_or_else(|| TransportError::Pull {
            from,
            what: "this transport cannot read peers' memory".into(),
        })?;
        Ok(shm.peer_memory(from)?)
    }

    /// [`Comm::recv`] until `deadline` (one deadline for a whole collective).
    pub fn recv_until(
        &mut self,
        from: RankId,
        tag: Tag,
        deadline: Deadline,
    ) -> Result<Bytes, CommError> {
        if let Some(p) = self.pending.remove(&(self.epoch, self.step, from, tag)) {
            return Ok(p);
        }
        if let Some((keys, told)) = &mut self.lent {
            // A frame nothing was lent for (or whose loan was refused: too many open) is
            // kept back like any unmatched one until the transport hears that the rank waits.
            if !*told && !keys.contains(&(from, tag)) {
                *told = true;
                if let Some(shm) = self.shared_memory() {
                    shm.fetch_unlent();
                }
            }
        }
        loop {
            let left_ms = deadline.left_ms(&*self.clock);
            if left_ms == 0 {
                return Err(CommError::Timeout {
                    from,
                    tag,
                    timeout_ms: self.timeout_ms,
                });
            }
            let frame = match self.transport.recv_timeout(left_ms) {
                Ok(f) => f,
                Err(TransportError::Timeout(_)) => continue,
                Err(e) => return Err(e.into()),
            };
            if (frame.epoch, frame.step) < (self.epoch, self.step) {
                self.stats.stale_dropped += 1;
                continue;
            }
            if frame.tag.kind == TagKind::Interrupt {
                // Whatever we were waiting for is not coming: a peer died.
                return Err(CommError::Interrupted);
            }
            if frame.payload.is_empty()
                && self
                    .shared_memory()
                    .is_some_and(|shm| shm.was_placed(&frame))
            {
                self.placed
                    .insert((frame.epoch, frame.step, frame.from, frame.tag));
            }
            if frame.from == from
                && frame.tag == tag
                && (frame.epoch, frame.step) == (self.epoch, self.step)
            {
                return Ok(frame.payload);
            }
            self.hold(frame)?;
        }
    }

    fn hold(&mut self, frame: Frame) -> Result<(), CommError> {
        // A frame from a later step can only come from a peer that already finished this one;
        // keep it only if it is for the next step (the coordinator never runs two steps apart).
        if frame.step > self.step + 1 || frame.epoch > self.epoch + 1 {
            return Err(CommError::Protocol {
                from: frame.from,
                what: format!("frame for step {} while at step {}", frame.step, self.step),
            });
        }
        if self.pending.len() >= MAX_PENDING_FRAMES {
            return Err(CommError::Protocol {
                from: frame.from,
                what: format!("more than {MAX_PENDING_FRAMES} frames pending"),
            });
        }
        let key = (frame.epoch, frame.step, frame.from, frame.tag);
        match self.pending.entry(key) {
            std::collections::btree_map::Entry::Occupied(_) => self.stats.duplicates_dropped += 1,
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(frame.payload);
            }
        }
        Ok(())
    }
}

/// Appends the bytes `range` of a payload to `out`, `encode`d `block_bytes` at a time, each
/// block added to `sum` (where one is taken) while it is still in cache.
fn encode_in_blocks(
    range: Range<usize>,
    block_bytes: usize,
    encode: &mut impl FnMut(Range<usize>, &mut Vec<u8>),
    out: &mut Vec<u8>,
    mut sum: Option<&mut crc32fast::Hasher>,
) {
    let mut at = range.start;
    while at < range.end {
        let block = at..(at + block_bytes).min(range.end);
        let from = out.len();
        encode(block.clone(), out);
        assert_eq!(
            out.len() - from,
            block.len(),
            "an encoded block has its length"
        );
        if let Some(h) = &mut sum {
            h.update(&out[from..]);
        }
        at = block.end;
    }
}

/// Writes the bytes `range` of a payload into a shared-memory slot `dst`, returning their
/// CRC-32: each block is encoded into `block_out`, a small buffer still in cache, summed there
/// and copied into the slot, so the payload is written to memory once.
fn encode_into_slot(
    range: Range<usize>,
    encode: &mut impl FnMut(Range<usize>, &mut Vec<u8>),
    block_out: &mut Vec<u8>,
    dst: &mut [u8],
) -> u32 {
    let mut sum = crc32fast::Hasher::new();
    let mut at = range.start;
    while at < range.end {
        let block = at..(at + SUM_BLOCK_BYTES).min(range.end);
        block_out.clear();
        encode(block.clone(), block_out);
        assert_eq!(
            block_out.len(),
            block.len(),
            "an encoded block has its length"
        );
        sum.update(block_out);
        dst[block.start - range.start..block.end - range.start].copy_from_slice(block_out);
        at = block.end;
    }
    sum.finalize()
}

/// A piece of the wrong length is a protocol error (nothing of it is placed).
fn piece_fits(
    from: RankId,
    tag: Tag,
    i: usize,
    got: usize,
    want: usize,
    len: usize,
) -> Result<(), CommError> {
    if got == want {
        return Ok(());
    }
    Err(CommError::Protocol {
        from,
        what: format!("{tag:?}: {got} bytes, expected {want} (piece {i} of a {len}-byte payload)"),
    })
}

/// Copies the pieces [`Comm::recv_all_lent`] kept for later into `loans`' buffers.
///
/// # Safety
/// The loans have ended (`transport::shared_memory`'s loans section), and `loans`' memory is
/// valid and touched by nothing else.
pub unsafe fn place_later(loans: &[Lend], later: Vec<(usize, usize, Bytes)>) {
    for (k, at, b) in later {
        // SAFETY: no loan is open; the piece fits its buffer (its length was checked).
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), loans[k].2.add(at), b.len()) }
    }
}

/// Stops the process if dropped while unwinding: memory lent to a transport must not be handed
/// back (freed, reused) while the transport may still write it, and a panic between lending and
/// `end_loans` would do that.
struct AbortOnUnwind;

impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("ezero: a panic while memory was lent to the transport; aborting");
            std::process::abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::transport::local::LocalNetwork;

    fn tag(unit: u32) -> Tag {
        Tag {
            kind: TagKind::Gather,
            attempt: 0,
            unit,
            pass: 0,
            piece: 0,
        }
    }

    #[test]
    fn out_of_order_frames_are_matched_and_stale_ones_dropped() {
        let net = LocalNetwork::new();
        let mut a = Comm::new(net.endpoint(0), 100);
        let mut b = Comm::new(net.endpoint(1), 100);
        b.begin_step(0, 0);
        b.send(0, tag(7), Bytes::from_static(b"old")).unwrap();
        a.begin_step(0, 1);
        b.begin_step(0, 1);
        b.send(0, tag(2), Bytes::from_static(b"two")).unwrap();
        b.send(0, tag(1), Bytes::from_static(b"one")).unwrap();
        b.send(0, tag(1), Bytes::from_static(b"dup")).unwrap();
        assert_eq!(&a.recv(1, tag(1)).unwrap()[..], b"one");
        assert_eq!(&a.recv(1, tag(2)).unwrap()[..], b"two");
        assert_eq!(a.stats().stale_dropped, 1);
        // The duplicate of tag 1 is still queued; once in step 2 it is stale and dropped.
        a.begin_step(0, 2);
        assert!(matches!(a.recv(1, tag(9)), Err(CommError::Timeout { .. })));
        assert_eq!(a.stats().stale_dropped, 2);
    }

    /// A peer that finished step 1 first sends its step-2 frame while we still wait in step 1:
    /// it is kept for step 2, not dropped when step 2 begins.
    #[test]
    fn a_frame_for_the_next_step_survives_begin_step() {
        let net = LocalNetwork::new();
        let mut a = Comm::new(net.endpoint(0), 100);
        let mut b = Comm::new(net.endpoint(1), 100);
        let mut c = Comm::new(net.endpoint(2), 100);
        a.begin_step(0, 1);
        b.begin_step(0, 2);
        c.begin_step(0, 1);
        b.send(0, tag(1), Bytes::from_static(b"b2")).unwrap();
        c.send(0, tag(1), Bytes::from_static(b"c1")).unwrap();
        assert_eq!(&a.recv(2, tag(1)).unwrap()[..], b"c1");
        a.begin_step(0, 2);
        assert_eq!(&a.recv(1, tag(1)).unwrap()[..], b"b2");
        assert_eq!(a.stats().stale_dropped, 0);
    }

    /// Three ranks each send the others a payload of several pieces (the last one short)
    /// while receiving theirs into one buffer with `recv_pieces_into_after`: every byte lands
    /// where it belongs, whether the transport lends (UCX) or copies (in-process).
    fn exchange_into<T: Transport>(eps: Vec<T>) {
        const LEN: usize = 9 << 20;
        let body =
            |r: RankId| -> Vec<u8> { (0..LEN).map(|i| (i * 7 + r as usize) as u8).collect() };
        let hs: Vec<_> = eps
            .into_iter()
            .map(|ep| {
                std::thread::spawn(move || {
                    let mut c = Comm::new(ep, 10_000);
                    c.begin_step(0, 1);
                    let me = c.rank();
                    let peers: Vec<RankId> = (0..3).filter(|&r| r != me).collect();
                    let mut buf = vec![0u8; 2 * LEN];
                    let (x, y) = buf.split_at_mut(LEN);
                    let dests = vec![(peers[0], x), (peers[1], y)];
                    let mine = Bytes::from(body(me));
                    c.recv_pieces_into_after(tag(4), dests, |c| {
                        c.send_pieces(&peers, tag(4), mine)
                    })
                    .unwrap();
                    assert!(buf[..LEN] == body(peers[0]), "rank {me} from {}", peers[0]);
                    assert!(buf[LEN..] == body(peers[1]), "rank {me} from {}", peers[1]);
                    assert!(c.placed.is_empty());
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    }

    #[test]
    fn payloads_received_into_a_buffer_land_whole_in_process() {
        let net = LocalNetwork::new();
        exchange_into((0..3).map(|r| net.endpoint(r)).collect());
    }

    #[cfg(feature = "ucx")]
    #[ignore = "needs libucx0 (apt-get install libucx0)"]
    #[test]
    fn payloads_received_into_a_buffer_land_whole_over_ucx() {
        let (_engines, eps) = crate::runtime::transport::ucx::transports_for_tests(3);
        exchange_into(eps);
    }

    /// With loans open, a rank may still wait for a frame it lent nothing for: the UCX
    /// engine, which keeps unmatched payloads back for loans to come, must hand that one over
    /// (it kept it back until the rank's deadline), and the lent payload still lands in place.
    #[cfg(feature = "ucx")]
    #[ignore = "needs libucx0 (apt-get install libucx0)"]
    #[test]
    fn a_frame_nothing_was_lent_for_arrives_while_loans_are_open() {
        let (engines, eps) = crate::runtime::transport::ucx::transports_for_tests(2);
        let mut eps = eps.into_iter();
        // The deadline is the test's only bound: an engine keeping the frame back fails it.
        let (mut a, mut b) = (
            Comm::new(eps.next().unwrap(), 20_000),
            Comm::new(eps.next().unwrap(), 20_000),
        );
        a.begin_step(0, 1);
        b.begin_step(0, 1);
        const LEN: usize = 1 << 20;
        let (lent_body, other) = (Bytes::from(vec![7u8; LEN]), Bytes::from(vec![9u8; LEN]));
        let mut buf = vec![0u8; LEN];
        let loans = [(0, tag(1), buf.as_mut_ptr(), LEN, None)];
        // SAFETY: `buf` is not touched until `lent` returns.
        let got = unsafe {
            b.lent(&loans, |b, any_lent| {
                assert!(any_lent);
                a.send(1, tag(2), other.clone())?;
                a.send(1, tag(1), lent_body.clone())?;
                let d = b.deadline();
                let unlent = b.recv_until(0, tag(2), d)?;
                let placed = b.recv_piece(0, tag(1), 0, LEN, d)?;
                Ok((unlent, placed))
            })
        }
        .unwrap();
        assert_eq!(got.0, other);
        assert!(got.1.is_none(), "the lent payload landed in place");
        assert!(buf == lent_body);
        assert!(engines[1].counts().lent > 0);
    }

    #[test]
    fn timeout_and_close_are_typed_errors() {
        let net = LocalNetwork::new();
        let mut a = Comm::new(net.endpoint(0), 30);
        assert!(matches!(
            a.recv(1, tag(0)),
            Err(CommError::Timeout { from: 1, .. })
        ));
        net.close();
        assert_eq!(a.recv(1, tag(0)), Err(CommError::Closed));
        assert!(matches!(
            a.send(1, tag(0), Bytes::new()),
            Err(CommError::PeerGone(1))
        ));
    }
}
