//! The one network seam. Everything that moves bytes between ranks goes through `Transport`:
//! the in-process channels of the embedded default, a seeded simulated network for chaos runs,
//! and QUIC between processes.
//!
//! A transport moves whole frames and never blocks on the receiver. Matching frames to the
//! collective waiting for them, dropping stale ones and enforcing deadlines happen above it, in
//! `step::comm`, so every transport gets the same rules. The frame itself (`Frame`, `Tag`) is
//! defined with its wire format in `crate::wire::frame` and re-exported here.
//!
//! The bottom of the runtime's parts: of the runtime it imports only the clock (the in-process
//! network keeps time by it). Imports: `wire`, `net`, `plan` and the seeded RNG of `model::rng`.

pub mod detached;
pub mod local;
pub mod net_faults;
pub mod quic;
pub mod tcp;
#[cfg(feature = "ucx")]
pub mod ucx;

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use crate::plan::RankId;

/// What `--transport ucx` says on a build without the `ucx` feature.
pub const NO_UCX_BUILD: &str = "--transport ucx: this ezero was built without UCX; rebuild with the `ucx` cargo feature (on by default: `cargo build --release`, or add `--features ucx` after `--no-default-features`)";
pub use crate::wire::frame::{Frame, Tag, TagKind, FRAME_HEADER_BYTES};

/// Expected transport failures: typed, never panics.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    #[error("no frame arrived within {0} ms")]
    Timeout(u64),
    #[error("the transport was closed (the run is stopping)")]
    Closed,
    #[error("rank {0} is not reachable (departed or never joined)")]
    UnknownPeer(RankId),
    /// A pull from a peer's memory failed: it named memory it does not have, or this
    /// transport cannot read that peer's memory.
    #[error("reading rank {from}'s memory failed: {what}")]
    Pull { from: RankId, what: String },
}

/// Adds encoded values `src` into `dst` (the same length): how a payload lent memory to be
/// added into meets it ([`Transport::lend`]).
pub type AddFn = fn(&mut [u8], &[u8]);

/// One rank's endpoint on a network of ranks.
pub trait Transport: Send + 'static {
    fn rank(&self) -> RankId;
    /// Queues `frame` for `to`; never waits for the receiver.
    fn send(&self, to: RankId, frame: Frame) -> Result<(), TransportError>;
    /// Queues the same `frame` for each of `to`, in order, stopping at the first failure. A
    /// wire transport may encode and checksum it once for all of them (a broadcast root or an
    /// all-gather sends one buffer to every peer).
    fn send_to_each(&self, to: &[RankId], frame: Frame) -> Result<(), TransportError> {
        to.iter().try_for_each(|&r| self.send(r, frame.clone()))
    }
    /// Whether [`Transport::send_to_each_summed`] uses the payload's CRC-32: a sender that
    /// would compute it only for this skips it where it is not (the default).
    fn wants_payload_crc(&self) -> bool {
        false
    }
    /// `send_to_each` of a frame whose payload's CRC-32 ([`crate::wire::crc32_of`]) the sender
    /// computed while it wrote the payload: a transport whose frames carry that checksum
    /// combines it with its header's instead of reading the payload again (UCX). It must be
    /// the payload's. The default ignores it.
    fn send_to_each_summed(
        &self,
        to: &[RankId],
        frame: Frame,
        payload_crc: u32,
    ) -> Result<(), TransportError> {
        let _ = payload_crc;
        self.send_to_each(to, frame)
    }
    /// Sends `frame` (its own payload ignored) to each of `to` with a `len`-byte payload that
    /// `fill` writes straight into memory the receivers read it from (a shared-memory slot),
    /// returning the payload's CRC-32 ([`crate::wire::crc32_of`]); `fill` writes all `len`
    /// bytes. `Ok(false)` (the default): no such memory for these receivers now, and nothing
    /// was written or sent: send the frame another way.
    fn send_to_each_staged(
        &self,
        _to: &[RankId],
        _frame: &Frame,
        _len: usize,
        _fill: &mut dyn FnMut(&mut [u8]) -> u32,
    ) -> Result<bool, TransportError> {
        Ok(false)
    }
    /// The next frame addressed to this rank, waiting at most `timeout_ms`.
    fn recv_timeout(&mut self, timeout_ms: u64) -> Result<Frame, TransportError>;
    /// Delivers anything the transport is still holding back (called when a rank finishes a
    /// job and may not send or receive again for a while).
    fn flush(&self) {}
    /// Lends `len` bytes at `at` for the payload of the frame `from` sends at (epoch, step)
    /// with `tag`, if it has exactly that length: a transport that can land it there without a
    /// copy does, checks it there, and delivers the frame with an empty payload that
    /// [`Transport::was_placed`] recognises. With `add`, the payload is added into the memory
    /// (`add(dst, src)` over consecutive parts of it) instead of written there; loans of the
    /// same memory are added in the order their frames arrive, so `add` must not depend on
    /// that order. `false` (the default): not lent, and the frame comes with its payload as
    /// usual.
    ///
    /// # Safety
    /// The memory must stay valid, and nobody may read or write it, until
    /// [`Transport::end_loans`] returns (or, for a frame that arrived, until then for the
    /// loans of the same memory still open).
    unsafe fn lend(
        &self,
        _from: RankId,
        _at_step: (u64, u64),
        _tag: Tag,
        (_at, _len): (*mut u8, usize),
        _add: Option<AddFn>,
    ) -> bool {
        false
    }
    /// Ends every loan: once it returns, the transport no longer touches lent memory.
    fn end_loans(&self) {}
    /// The rank, its loans still open, is about to wait for a frame it lent nothing for: a
    /// transport that keeps unmatched payloads back while loans are open (for loans still to
    /// come) must deliver them from now on, or that wait lasts until its deadline. The default
    /// keeps nothing back.
    fn fetch_unlent(&self) {}
    /// Whether `frame` is the notice that its payload landed in lent memory and passed every
    /// check there, rather than a frame carrying its payload (true once per frame).
    fn was_placed(&self, _frame: &Frame) -> bool {
        false
    }
    /// Whether [`Transport::peer_memory`] can read `from`'s memory: a process on this host whose
    /// identity the transport verified. Collectives choose their path by it on both sides of
    /// a pair, so a transport answers it alike on both (once either says yes, the other does
    /// too, waiting a bounded time if it must). The default: no peer's.
    fn can_pull(&self, _from: RankId) -> bool {
        false
    }
    /// `from`'s memory, to read from any thread: a process on this host whose identity the
    /// transport verified ([`Transport::can_pull`]). The default refuses every peer.
    fn peer_memory(&self, from: RankId) -> Result<Arc<dyn PeerMemory>, TransportError> {
        Err(TransportError::Pull {
            from,
            what: "this transport cannot read peers' memory".into(),
        })
    }
}

/// A peer's memory that this process can read ([`Transport::peer_memory`]); `Send` and `Sync`
/// so that a collective can read one peer from two threads.
pub trait PeerMemory: Send + Sync {
    /// Copies `dst.len()` bytes at address `at` of the peer's memory into `dst`, in one copy
    /// made by the kernel: the peer
    /// named the address in a frame of this step and keeps that memory unchanged until it
    /// hears that the read is over. What was read is not trusted: the caller checks it against
    /// the checksum the peer sent.
    fn read(&self, at: u64, dst: &mut [u8]) -> Result<(), TransportError>;
}

/// The next frame of a rank's inbox channel, waiting at most `timeout_ms` (the receive side of
/// the transports that feed one channel from their reader threads).
pub(crate) fn recv_inbox(rx: &Receiver<Frame>, timeout_ms: u64) -> Result<Frame, TransportError> {
    match rx.recv_timeout(Duration::from_millis(timeout_ms)) {
        Ok(f) => Ok(f),
        Err(RecvTimeoutError::Timeout) => Err(TransportError::Timeout(timeout_ms)),
        Err(RecvTimeoutError::Disconnected) => Err(TransportError::Closed),
    }
}

/// A gather frame for the transports' tests.
#[cfg(test)]
pub(crate) fn test_frame(
    epoch: u64,
    from: RankId,
    unit: u32,
    payload: impl Into<bytes::Bytes>,
) -> Frame {
    Frame {
        epoch,
        step: 2,
        from,
        tag: Tag {
            kind: TagKind::Gather,
            attempt: 0,
            unit,
            pass: 1,
            piece: 0,
        },
        payload: payload.into(),
    }
}
