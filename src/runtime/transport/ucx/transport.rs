//! `Transport` over a UCX [`Engine`]: each frame is one active message in our wire format
//! (version, lengths, epoch, step, tag, CRC-32), checked on arrival exactly as the TCP and QUIC
//! planes check theirs; a frame that fails a check is counted in [`WireStats`] and dropped,
//! and so is one whose `from` is not the engine that sent it.
//!
//! The frame is sent in two pieces: its prefix, header and checksum in the active message's
//! header, and its payload from where it lies, which the receiver reads from the sender's memory
//! into the buffer it hands out (CMA, one copy in all); one encoding serves every peer of a
//! broadcast, and the received payload becomes the frame's without another copy.
//!
//! [`UcxPlane`] is the sending side plus a thread that checks arriving messages and delivers the
//! frames into an inbox it is given: its own in [`UcxTransport`], the TCP plane's in
//! [`super::mixed::MixedTransport`]. Worker addresses come from outside (the control plane;
//! tests pass them directly): this module never listens.
//!
//! A delivered frame keeps the engine's receive credit until the rank takes it out of the
//! inbox ([`UcxPlane::taken`]), so what a busy rank has received and not yet looked at is
//! bounded by the credit, not by how much its peers send. Frames are known by their payload's
//! address, which is unique while the frame lives, so frames from another plane or from the
//! rank itself sharing the inbox are told apart.
//!
//! A rank that knows which frame comes next can lend the memory its payload belongs in
//! ([`UcxPlane::lend`]): the engine receives the payload there, this plane checks it there
//! (CRC included), and the rank gets the frame with an empty payload that
//! [`UcxPlane::was_placed`] recognises. A payload that fails a check is counted and never
//! reported placed, so the rank times out as for a lost frame. [`UcxTransport`] offers this,
//! the staged sends and the pulls as the [`SharedMemory`] capability, whose module docs give
//! the rules of lent memory.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::engine::{Engine, Inbound};
use super::lending::{LendState, Lending, LOANS_DRAIN_MAX};
use super::lent::{LEND_MIN_BYTES, LOANS_MAX};
use super::UcxError;
use crate::plan::RankId;
use crate::runtime::transport::{
    recv_inbox, AddFn, Frame, PeerMemory, SharedMemory, Tag, Transport, TransportError,
};
use crate::wire::{
    check_split_in_place, decode_split, encode_split_summed, frame_around, frame_head, WireMsg,
    WireStats,
};

/// Frames delivered, and their payload bytes.
#[derive(Default, Debug)]
pub struct Received {
    pub frames: AtomicU64,
    pub bytes: AtomicU64,
}

/// How often the delivering thread looks at its stop flag while no message arrives.
const DELIVER_POLL: Duration = Duration::from_millis(50);

/// Frames delivered and not yet taken from the inbox: their payload's address and the credit
/// each holds.
type InInbox = Arc<Mutex<HashMap<usize, usize>>>;

fn lock(u: &InInbox) -> std::sync::MutexGuard<'_, HashMap<usize, usize>> {
    u.lock().unwrap_or_else(|p| p.into_inner())
}

/// The UCX side of a rank's data plane.
pub struct UcxPlane {
    rank: RankId,
    engine: Arc<Engine>,
    stats: Arc<WireStats>,
    received: Arc<Received>,
    in_inbox: InInbox,
    lending: Arc<Lending>,
    stop: Arc<AtomicBool>,
    deliverer: Option<JoinHandle<()>>,
}

impl UcxPlane {
    /// Sends as `rank` over `engine` (whose id must be `rank`); frames that arrive, checked
    /// against `max_frame_bytes`, go to `deliver`.
    pub fn start(
        rank: RankId,
        engine: Arc<Engine>,
        max_frame_bytes: u32,
        deliver: Sender<Frame>,
    ) -> Result<Self, UcxError> {
        assert_eq!(engine.id(), rank, "the engine speaks for this rank");
        let stats: Arc<WireStats> = Arc::default();
        let received: Arc<Received> = Arc::default();
        let in_inbox: InInbox = Arc::default();
        let lending: Arc<Lending> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (e, halt) = (Arc::clone(&engine), Arc::clone(&stop));
        let counters = (Arc::clone(&stats), Arc::clone(&received));
        let (held, lent) = (Arc::clone(&in_inbox), Arc::clone(&lending));
        let deliverer = std::thread::Builder::new()
            .name(format!("ucx-deliver-{rank}"))
            .spawn(move || {
                let to = Deliver {
                    inbox: &held,
                    lending: &lent,
                    frames: &deliver,
                };
                deliver_loop(&e, max_frame_bytes, &counters, &to, &halt)
            })
            .map_err(|e| UcxError::Call {
                call: "spawning the delivering thread",
                status: e.to_string(),
            })?;
        Ok(Self {
            rank,
            engine,
            stats,
            received,
            in_inbox,
            lending,
            stop,
            deliverer: Some(deliverer),
        })
    }

    /// Lends `len` bytes at `at` for the payload of the frame (epoch, step, `from`, `tag`) of
    /// exactly that length; `false` (nothing lent) for a payload too small to be worth it, a
    /// frame from this rank, or a full batch. The frame then arrives with an empty payload
    /// that [`UcxPlane::was_placed`] recognises, unless it came before the loan. With `add`,
    /// the payload is added into the memory instead ([`SharedMemory::lend`]).
    ///
    /// # Safety
    /// The memory is borrowed as [`crate::runtime::transport::shared_memory`]'s loans section
    /// says, until [`UcxPlane::end_loans`] returns.
    pub unsafe fn lend(
        &self,
        from: RankId,
        (epoch, step): (u64, u64),
        tag: Tag,
        (at, len): (*mut u8, usize),
        add: Option<AddFn>,
    ) -> bool {
        if from == self.rank || len < LEND_MIN_BYTES {
            return false;
        }
        let mut st = self.lending.lock();
        if st.opened >= LOANS_MAX {
            return false;
        }
        let key = frame_head(epoch, step, from, tag, len);
        // SAFETY: passed on from the caller.
        if unsafe { self.engine.lend(st.batch, from, key, (at, len), add) }.is_err() {
            return false;
        }
        st.opened += 1;
        st.open += 1;
        st.engine_waits = true;
        true
    }

    /// The rank is about to wait for frames: if no loan is open, the engine must not keep
    /// messages back for loans any longer (it would until its grace or hold ran out).
    pub fn before_wait(&self) {
        self.stop_keeping_back(|st| st.opened == 0)
    }

    /// The rank waits, loans open, for a frame it lent nothing for: the engine fetches what it
    /// keeps back for loans, and keeps nothing back until the next loan.
    pub fn fetch_unlent(&self) {
        self.stop_keeping_back(|_| true)
    }

    /// Tells the engine to fetch what it keeps back for loans, if it was told to keep anything
    /// since and `now` says so.
    fn stop_keeping_back(&self, now: impl FnOnce(&LendState) -> bool) {
        let mut st = self.lending.lock();
        if (st.engine_waits || self.engine.holds_staged()) && now(&st) {
            st.engine_waits = false;
            drop(st);
            // A stopped engine keeps nothing back.
            let _ = self.engine.fetch_now();
        }
    }

    /// Ends the current batch of loans: withdraws the unmatched ones and waits until the
    /// matched ones are placed and checked, so that once it returns nothing touches the lent
    /// memory. Frames placed but not claimed are forgotten.
    pub fn end_loans(&self) {
        let (batch, opened) = {
            let st = self.lending.lock();
            (st.batch, st.opened)
        };
        if opened == 0 {
            return;
        }
        // A stopped engine's thread has ended, and its receives with it.
        let withdrawn = self.engine.end_loans(batch).unwrap_or(usize::MAX);
        let deadline = Instant::now() + LOANS_DRAIN_MAX;
        let mut st = self.lending.lock();
        st.open = st.open.saturating_sub(withdrawn);
        while st.open > 0 {
            let dead = self.deliverer.as_ref().is_none_or(JoinHandle::is_finished);
            if Instant::now() >= deadline || dead {
                tracing::error!(
                    "ucx: {} receive(s) into lent memory did not finish within {LOANS_DRAIN_MAX:?}; stopping the process rather than hand the memory back",
                    st.open
                );
                std::process::abort();
            }
            st = self
                .lending
                .settled
                .wait_timeout(st, Duration::from_millis(100))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        st.placed.retain(|_, b| *b != batch);
        st.batch += 1;
        st.opened = 0;
    }

    /// Whether `frame` says that its payload landed in a loan of the current batch and passed
    /// every check there (claimed: true once).
    pub fn was_placed(&self, frame: &Frame) -> bool {
        frame.payload.is_empty()
            && self
                .lending
                .lock()
                .placed
                .remove(&(frame.from, frame.epoch, frame.step, frame.tag))
                .is_some()
    }

    /// The rank took `frame` out of its inbox: if it came over UCX, its receive credit goes
    /// back to the engine.
    pub fn taken(&self, frame: &Frame) {
        if frame.payload.is_empty() {
            return;
        }
        let credit = lock(&self.in_inbox).remove(&(frame.payload.as_ptr() as usize));
        if let Some(bytes) = credit {
            self.engine.release(bytes);
        }
    }

    /// Bytes received over UCX that the rank has not taken yet (in the engine or the inbox).
    pub fn held_bytes(&self) -> usize {
        self.engine.held_bytes()
    }

    /// Opens the endpoint to `peer` at its worker `address`.
    pub fn connect(&self, peer: RankId, address: Vec<u8>) -> Result<(), UcxError> {
        self.engine.connect(peer, address)
    }

    /// What arriving frames were refused for.
    pub fn stats(&self) -> &Arc<WireStats> {
        &self.stats
    }

    /// Frames received over UCX.
    pub fn received(&self) -> &Received {
        &self.received
    }

    /// The engine's counters (staged, lent, refused, failed).
    pub fn engine_counts(&self) -> super::engine::EngineCounts {
        self.engine.counts()
    }

    /// This side's worker address, for peers to connect with.
    pub fn engine_address(&self) -> &[u8] {
        self.engine.address()
    }

    /// Sends `frame` (its own payload ignored) to each of `to` (none of them this rank) with a
    /// `len`-byte payload that `fill` writes straight into a staging slot they read it from,
    /// returning its CRC-32. `Ok(false)`: no slot for these peers now (some peer did not map
    /// this engine's segment, or none was freed in time); nothing was written or sent.
    pub fn send_written(
        &self,
        to: &[RankId],
        frame: &Frame,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> u32,
    ) -> Result<bool, TransportError> {
        let Some(mut staged) = self.engine.stage(to, len) else {
            return Ok(false);
        };
        let crc = fill(staged.bytes());
        let around = frame_around(frame, len, crc);
        self.engine
            .send_staged(to, staged, around)
            .map_err(|e| plane_error(e, to))?;
        Ok(true)
    }

    /// Whether `from`'s memory can be pulled: its staging segment is attached, so it runs on
    /// this host as this user, and its process is the one the kernel says made the segment.
    pub fn can_pull(&self, from: RankId) -> bool {
        self.engine.pid_of(from).is_some()
    }

    /// `from`'s memory, read with `process_vm_readv` (what UCX's `cma` transport does, here
    /// under our own checks): one copy, made by the kernel, of memory the peer named. A peer
    /// that names memory it does not have gets an error. A peer that passed another process's
    /// segment off as its own (the descriptors travel to every member) would have us read
    /// that process: one of this user on this host, which it could read itself (`ptrace`):
    /// the trust shared memory assumes.
    pub fn peer_memory(&self, from: RankId) -> Result<Arc<dyn PeerMemory>, TransportError> {
        let pid = self
            .engine
            .pid_of(from)
            .ok_or_else(|| TransportError::Pull {
                from,
                what: "its memory is not readable from here (no shared segment)".into(),
            })?;
        Ok(Arc::new(CmaMemory {
            from,
            pid,
            engine: self.engine.clone(),
        }))
    }

    /// Sends `frame` to each of `to` (none of them this rank), encoded once; `payload_crc`: its
    /// payload's CRC-32 if the sender has it.
    pub fn send_to_each(
        &self,
        to: &[RankId],
        frame: Frame,
        payload_crc: Option<u32>,
    ) -> Result<(), TransportError> {
        let (around, payload) = encode_split_summed(&WireMsg::Frame(frame), payload_crc);
        for &peer in to {
            debug_assert_ne!(peer, self.rank, "a rank's frames to itself skip UCX");
            self.engine
                .send_with_header(peer, around.clone(), payload.clone())
                .map_err(|e| plane_error(e, &[peer]))?;
        }
        Ok(())
    }
}

/// A send's failure as the rank sees it: the engine stopped, or a peer is not reachable.
fn plane_error(e: UcxError, to: &[RankId]) -> TransportError {
    match e {
        UcxError::Stopped => TransportError::Closed,
        UcxError::NoPeer(p) => TransportError::UnknownPeer(p),
        _ => TransportError::UnknownPeer(to.first().copied().unwrap_or_default()),
    }
}

impl Drop for UcxPlane {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.deliverer.take() {
            let _ = t.join();
        }
    }
}

/// Checks one message from engine `from`: a frame of ours, from that rank.
fn accept(
    from: u32,
    around: &[u8],
    payload: Bytes,
    (max_frame_bytes, crc): (u32, Option<u32>),
    stats: &WireStats,
) -> Option<Frame> {
    frame_from(
        from,
        decode_split(around, payload, max_frame_bytes, crc),
        stats,
    )
}

/// [`accept`] for a payload checked where it landed: the frame comes back with an empty
/// payload.
fn accept_in_place(
    from: u32,
    around: &[u8],
    payload: &[u8],
    (max_frame_bytes, crc): (u32, Option<u32>),
    stats: &WireStats,
) -> Option<Frame> {
    frame_from(
        from,
        check_split_in_place(around, payload, max_frame_bytes, crc),
        stats,
    )
}

/// The frame of a decoded message if it is one from engine `from`; anything else is counted.
fn frame_from(
    from: u32,
    decoded: Result<WireMsg, crate::wire::WireError>,
    stats: &WireStats,
) -> Option<Frame> {
    match decoded {
        Ok(WireMsg::Frame(f)) if f.from == from => Some(f),
        Ok(_) => {
            // Another message kind, or a frame claiming another sender.
            stats.header.fetch_add(1, Ordering::Relaxed);
            None
        }
        Err(e) => {
            stats.count(&e);
            None
        }
    }
}

/// Where the delivering thread puts what arrives.
struct Deliver<'a> {
    inbox: &'a InInbox,
    lending: &'a Lending,
    frames: &'a Sender<Frame>,
}

fn deliver_loop(
    engine: &Engine,
    max_frame_bytes: u32,
    (stats, received): &(Arc<WireStats>, Arc<Received>),
    to: &Deliver<'_>,
    stop: &AtomicBool,
) {
    let (in_inbox, deliver) = (to.inbox, to.frames);
    while !stop.load(Ordering::Relaxed) {
        match engine.recv_timeout(DELIVER_POLL) {
            Ok(Inbound::Message {
                from,
                header,
                bytes,
                crc,
            }) => {
                let credit = bytes.len();
                let limit = (max_frame_bytes, crc);
                let Some(f) = accept(from, &header, bytes, limit, stats) else {
                    engine.release(credit);
                    continue;
                };
                received.frames.fetch_add(1, Ordering::Relaxed);
                received
                    .bytes
                    .fetch_add(f.payload.len() as u64, Ordering::Relaxed);
                if f.payload.is_empty() {
                    engine.release(credit);
                } else {
                    // Before the send: the rank may take the frame at once.
                    lock(in_inbox).insert(f.payload.as_ptr() as usize, credit);
                }
                if deliver.send(f).is_err() {
                    return;
                }
            }
            Ok(Inbound::Placed {
                from,
                header,
                batch,
                at,
                len,
                ok,
                crc,
            }) => {
                let placed = ok
                    .then(|| {
                        // SAFETY: the engine wrote these `len` bytes and no longer touches
                        // them, and the rank does not until this loan is settled (below).
                        let payload = unsafe { std::slice::from_raw_parts(at as *const u8, len) };
                        accept_in_place(from, &header, payload, (max_frame_bytes, crc), stats)
                    })
                    .flatten();
                if placed.is_some() {
                    received.frames.fetch_add(1, Ordering::Relaxed);
                    received.bytes.fetch_add(len as u64, Ordering::Relaxed);
                }
                // Before the frame goes: the rank may take it at once.
                to.lending.settle(batch, placed.as_ref());
                if let Some(f) = placed {
                    if deliver.send(f).is_err() {
                        return;
                    }
                }
            }
            // The collective waiting on that peer fails at its deadline; the control plane's
            // heartbeats decide membership.
            Ok(Inbound::PeerLost { peer, why }) => {
                tracing::warn!("ucx: the endpoint to rank {peer} failed: {why}");
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// A peer process's memory, read with `process_vm_readv` ([`UcxPlane::peer_memory`]).
struct CmaMemory {
    from: RankId,
    pid: i32,
    engine: Arc<Engine>,
}

impl PeerMemory for CmaMemory {
    fn read(&self, at: u64, dst: &mut [u8]) -> Result<(), TransportError> {
        let (from, pid) = (self.from, self.pid);
        let failed = |what: String| TransportError::Pull { from, what };
        let len = dst.len();
        at.checked_add(len as u64)
            .ok_or_else(|| failed(format!("{len} bytes at {at:#x} wrap the address space")))?;
        let mut done = 0usize;
        while done < len {
            let local = libc::iovec {
                iov_base: dst[done..].as_mut_ptr().cast(),
                iov_len: len - done,
            };
            let remote = libc::iovec {
                iov_base: (at as usize + done) as *mut libc::c_void,
                iov_len: len - done,
            };
            // SAFETY: `local` is `dst`'s unread tail, which we hold mutably; the kernel checks
            // `remote` against the peer's mappings and fails the call rather than fault.
            let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
            if n <= 0 {
                let e = std::io::Error::last_os_error();
                if n < 0 && e.raw_os_error() == Some(libc::ESRCH) {
                    return Err(TransportError::UnknownPeer(from));
                }
                return Err(failed(format!(
                    "{} bytes at {:#x}: {}",
                    len - done,
                    at as usize + done,
                    if n == 0 {
                        "nothing read".to_string()
                    } else {
                        e.to_string()
                    }
                )));
            }
            done += n as usize;
        }
        self.engine.count_pull(len);
        Ok(())
    }
}

/// A rank's endpoint with UCX to every peer.
pub struct UcxTransport {
    plane: UcxPlane,
    inbox_tx: Sender<Frame>,
    inbox_rx: Receiver<Frame>,
}

impl UcxTransport {
    /// A transport for `rank` over `engine` (whose id must be `rank`), connected to every peer
    /// in `peers` (rank → worker address).
    pub fn connect(
        rank: RankId,
        engine: Arc<Engine>,
        peers: &BTreeMap<RankId, Vec<u8>>,
        max_frame_bytes: u32,
    ) -> Result<Self, UcxError> {
        let (inbox_tx, inbox_rx) = mpsc::channel();
        let plane = UcxPlane::start(rank, engine, max_frame_bytes, inbox_tx.clone())?;
        for (&peer, address) in peers.iter().filter(|(&p, _)| p != rank) {
            plane.connect(peer, address.clone())?;
        }
        Ok(Self {
            plane,
            inbox_tx,
            inbox_rx,
        })
    }

    /// What arriving frames were refused for.
    pub fn stats(&self) -> &Arc<WireStats> {
        self.plane.stats()
    }

    /// Sends `frame` to each of `to`: to this rank through its inbox, to the others over UCX,
    /// encoded once.
    fn send_summed(
        &self,
        to: &[RankId],
        frame: Frame,
        payload_crc: Option<u32>,
    ) -> Result<(), TransportError> {
        let me = self.plane.rank;
        let others: Vec<RankId> = to.iter().copied().filter(|&r| r != me).collect();
        if others.len() < to.len() {
            self.inbox_tx
                .send(frame.clone())
                .map_err(|_| TransportError::Closed)?;
        }
        if others.is_empty() {
            return Ok(());
        }
        self.plane.send_to_each(&others, frame, payload_crc)
    }
}

impl Transport for UcxTransport {
    fn rank(&self) -> RankId {
        self.plane.rank
    }

    fn send(&self, to: RankId, frame: Frame) -> Result<(), TransportError> {
        self.send_summed(&[to], frame, None)
    }

    fn send_to_each(&self, to: &[RankId], frame: Frame) -> Result<(), TransportError> {
        self.send_summed(to, frame, None)
    }

    fn recv_timeout(&mut self, timeout_ms: u64) -> Result<Frame, TransportError> {
        self.plane.before_wait();
        let f = recv_inbox(&self.inbox_rx, timeout_ms)?;
        self.plane.taken(&f);
        Ok(f)
    }

    fn shared_memory(&self) -> Option<&dyn SharedMemory> {
        Some(self)
    }
}

impl SharedMemory for UcxTransport {
    fn send_to_each_summed(
        &self,
        to: &[RankId],
        frame: Frame,
        payload_crc: u32,
    ) -> Result<(), TransportError> {
        self.send_summed(to, frame, Some(payload_crc))
    }

    fn send_to_each_staged(
        &self,
        to: &[RankId],
        frame: &Frame,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> u32,
    ) -> Result<bool, TransportError> {
        // Frames to itself go through the inbox, with their payload.
        if to.contains(&self.plane.rank) {
            return Ok(false);
        }
        self.plane.send_written(to, frame, len, fill)
    }

    unsafe fn lend(
        &self,
        from: RankId,
        at_step: (u64, u64),
        tag: Tag,
        memory: (*mut u8, usize),
        add: Option<AddFn>,
    ) -> bool {
        // SAFETY: the trait's contract (`shared_memory`'s loans) is the plane's.
        unsafe { self.plane.lend(from, at_step, tag, memory, add) }
    }

    fn end_loans(&self) {
        self.plane.end_loans()
    }

    fn fetch_unlent(&self) {
        self.plane.fetch_unlent()
    }

    fn was_placed(&self, frame: &Frame) -> bool {
        self.plane.was_placed(frame)
    }

    fn can_pull(&self, from: RankId) -> bool {
        self.plane.can_pull(from)
    }

    fn peer_memory(&self, from: RankId) -> Result<Arc<dyn PeerMemory>, TransportError> {
        self.plane.peer_memory(from)
    }
}

#[cfg(test)]
#[path = "staged_tests.rs"]
mod staged_tests;

#[cfg(test)]
#[path = "transport_tests.rs"]
mod tests;
