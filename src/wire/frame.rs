//! What moves between ranks: one frame, tagged with the collective it belongs to and stamped
//! with (epoch, step). Defined here, below the runtime, because the wire format encodes it and
//! must not depend on the runtime that sends it.

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

/// Identifies one message within a step: which collective, which unit, which pass, which try,
/// and which piece of a large payload ([`PIECE_BYTES`]; 0 for a payload sent whole).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag {
    pub kind: TagKind,
    pub attempt: u8,
    pub unit: u32,
    pub pass: u8,
    pub piece: u32,
}

impl Tag {
    /// This tag for piece `piece` of its payload.
    pub fn piece(self, piece: u32) -> Tag {
        Tag { piece, ..self }
    }
}

/// Collectives move payloads larger than this as pieces of this size, each its own frame, so
/// that the sender's encoding and checksum, the transfer, and the receiver's checksum and
/// placing of one piece overlap with those of the next (one 64 MiB frame runs them one after
/// the other), and so that no piece needs a buffer the allocator maps afresh for each message.
/// Both sides compute the pieces of a payload from its length, so this is part of the protocol
/// ([`crate::wire::WIRE_VERSION`]).
pub const PIECE_BYTES: usize = 4 << 20;

/// The byte ranges of the pieces of a `len`-byte payload: one empty piece for an empty payload.
pub fn pieces(len: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let n = len.div_ceil(PIECE_BYTES).max(1);
    (0..n).map(move |i| i * PIECE_BYTES..((i + 1) * PIECE_BYTES).min(len))
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
