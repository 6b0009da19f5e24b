//! The one network seam. Everything that moves bytes between ranks goes through [`Transport`],
//! which carries only what every transport must do: say its rank, send a frame to one peer or
//! to several, receive with a deadline, and flush. The transports:
//!
//! - [`local`]: in-process channels between the ranks of one process (the embedded default),
//!   with [`net_faults`], the seeded simulated network (losses, damage, delays, partitions)
//!   that chaos runs put under it.
//! - [`tcp`]: mutual TLS over TCP between worker processes, one connection per ordered pair.
//! - [`quic`]: QUIC (quinn) with mutual TLS, separate control and bulk streams per peer.
//! - `ucx` (the `ucx` cargo feature): UCX shared memory between processes on one host, and
//!   the mixed plane (`ucx::mixed`) that reaches the peers on this host over UCX and the
//!   others over TLS TCP.
//! - [`detached`]: the empty transport type of a process that hosts no rank.
//!
//! What only shared memory can do (payloads written straight into a slot the receiver reads,
//! receives that land in memory the rank lends, reads of a peer's memory) is the optional
//! [`SharedMemory`] capability ([`shared_memory`]), which a transport offers through
//! [`Transport::shared_memory`]: UCX and the mixed plane do, the others do not. Its module
//! docs hold every rule of the unsafe surface (lent memory, pulled bytes).
//!
//! A transport moves whole frames and never blocks on the receiver. Matching frames to the
//! collective waiting for them, dropping stale ones and enforcing deadlines happen above it, in
//! `step::comm`, so every transport gets the same rules. The frame itself (`Frame`, `Tag`) is
//! defined with its wire format in `crate::wire::frame` and re-exported here.
//!
//! The bottom of the runtime's parts: of the runtime it imports only the clock (the in-process
//! network keeps time by it). Imports: `wire`, `net`, `plan` and the seeded RNG of `model::rng`.
//!
//! Design: docs/transports.md.

pub mod detached;
pub mod local;
pub mod net_faults;
pub mod quic;
pub mod shared_memory;
pub mod tcp;
#[cfg(feature = "ucx")]
pub mod ucx;

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

use crate::plan::RankId;

/// What `--transport ucx` says on a build without the `ucx` feature.
pub const NO_UCX_BUILD: &str = "--transport ucx: this ezero was built without UCX; rebuild with the `ucx` cargo feature (on by default: `cargo build --release`, or add `--features ucx` after `--no-default-features`)";
pub use crate::wire::frame::{Frame, Tag, TagKind, FRAME_HEADER_BYTES};
pub use shared_memory::{AddFn, PeerMemory, SharedMemory};

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

/// One rank's endpoint on a network of ranks: what every transport must do.
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
    /// The next frame addressed to this rank, waiting at most `timeout_ms`.
    fn recv_timeout(&mut self, timeout_ms: u64) -> Result<Frame, TransportError>;
    /// Delivers anything the transport is still holding back (called when a rank finishes a
    /// job and may not send or receive again for a while).
    fn flush(&self) {}
    /// The transport's shared-memory capability (staged and summed sends, loans, pulls), if it
    /// has one. The default: none, and every payload travels in its frame.
    fn shared_memory(&self) -> Option<&dyn SharedMemory> {
        None
    }
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
