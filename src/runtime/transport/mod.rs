//! The one network seam. Everything that moves bytes between ranks goes through `Transport`:
//! the in-process channels of the embedded default, a seeded simulated network for chaos runs,
//! and QUIC between processes.
//!
//! A transport moves whole frames and never blocks on the receiver. Matching frames to the
//! collective waiting for them, dropping stale ones and enforcing deadlines happen above it, in
//! `comm.rs`, so every transport gets the same rules.

use bytes::Bytes;

use crate::plan::RankId;

/// What a frame carries, so that the receiver can match it to the collective waiting for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TagKind {
    /// ZeRO-3 parameter all-gather of one unit.
    Gather = 1,
    /// Gradient partial sums for the chunks a rank owns.
    ReduceScatter = 2,
    /// Reduced gradient chunks (stage 0's all-reduce, second half).
    GatherGrads = 3,
    /// Updated parameter chunks after the optimizer step (stages 1 and 2).
    GatherParams = 4,
    /// The small all-reduce of losses, maxima, flags and norms.
    Agree = 5,
    /// Chunk states moving to their new owners when the membership changes.
    Reshard = 6,
    /// Copies of a rank's chunk states kept by its buddy, for recovery from its loss.
    Replica = 7,
    /// From the runtime, not a rank: stop waiting, the step is being abandoned (a peer died).
    Interrupt = 8,
    /// A root's buffer sent to every member.
    Broadcast = 9,
    /// An empty message that only says "I got here".
    Barrier = 10,
}

/// Identifies one message within a step: which collective, which unit, which pass, which try.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag {
    pub kind: TagKind,
    pub attempt: u8,
    pub unit: u32,
    pub pass: u8,
}

/// One message between ranks. Every frame carries (epoch, step); stale ones are dropped.
#[derive(Clone, Debug)]
pub struct Frame {
    pub epoch: u64,
    pub step: u64,
    pub from: RankId,
    pub tag: Tag,
    pub payload: Bytes,
}

/// Bytes of framing a frame costs on a wire transport (version, lengths, tag, epoch, step,
/// checksum). Counted for every frame, in-process too, so reported volumes compare across
/// transports.
pub const FRAME_HEADER_BYTES: u64 = 40;

/// Expected transport failures: typed, never panics.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    #[error("no frame arrived within {0} ms")]
    Timeout(u64),
    #[error("the transport was closed (the run is stopping)")]
    Closed,
    #[error("rank {0} is not reachable (departed or never joined)")]
    UnknownPeer(RankId),
}

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
    /// The next frame addressed to this rank, waiting at most `timeout_ms`.
    fn recv_timeout(&mut self, timeout_ms: u64) -> Result<Frame, TransportError>;
    /// Delivers anything the transport is still holding back (called when a rank finishes a
    /// job and may not send or receive again for a while).
    fn flush(&self) {}
}
