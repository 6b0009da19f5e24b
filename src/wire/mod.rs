//! The wire format of frames between processes, and its typed rejections.
//!
//! Every message on a QUIC stream is one wire frame:
//!
//! ```text
//! offset  size  field
//! 0       1     version (WIRE_VERSION)
//! 1       4     body length L, little-endian: header + payload, at most max_frame_bytes + 64
//! 5       1     header length H, at most MAX_HEADER_BYTES
//! 6       H     header (bincode 2, standard config): what the message is, epoch, step, tag
//! 6+H     L-H   payload, raw bytes (tensor data is never run through bincode)
//! 6+L     4     CRC-32 (IEEE) of bytes [0, 6+L), little-endian
//! ```
//!
//! The length is checked against the configured maximum as soon as the 6-byte prefix is in,
//! before anything is allocated; a frame that fails any check is rejected with a [`WireError`],
//! counted in [`WireStats`], and never applied. After a rejection the byte stream has lost its
//! framing, so the reader drops the stream (and the QUIC layer the connection).
//!
//! Design: docs/wire.md.

mod codec;
pub mod f32s;
pub mod frame;
mod stream;

pub use codec::{
    check_split_in_place, crc32_of, decode, decode_split, encode, encode_split,
    encode_split_summed, encode_to_vec, frame_around, frame_head, Lane, WireMsg,
};
pub use stream::StreamDecoder;

use std::sync::atomic::{AtomicU64, Ordering};

/// Protocol version carried by every frame; a peer speaking another one is refused.
pub const WIRE_VERSION: u8 = 2;
/// Bytes before the header: version, body length, header length.
pub const PREFIX_BYTES: usize = 6;
/// The largest header any message kind encodes to (a frame header is at most 37 bytes).
pub const MAX_HEADER_BYTES: usize = 64;
/// Bytes of the trailing checksum.
pub const CHECKSUM_BYTES: usize = 4;
/// Default hard limit on one frame's payload.
pub const DEFAULT_MAX_FRAME_BYTES: u32 = 256 << 20;

/// Why a frame was rejected. Expected from hostile or broken peers: typed, never a panic.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("truncated frame: {have} bytes, {need} needed")]
    Truncated { have: usize, need: usize },
    #[error("frame body of {len} bytes exceeds the limit of {max} bytes")]
    Oversize { len: u64, max: u64 },
    #[error("wire protocol version {got}, this build speaks {WIRE_VERSION}")]
    Version { got: u8 },
    #[error("checksum mismatch: frame says {expected:#010x}, bytes give {got:#010x}")]
    Checksum { expected: u32, got: u32 },
    #[error("header length {len} is out of range (body {body} bytes, at most {MAX_HEADER_BYTES})")]
    HeaderLength { len: usize, body: usize },
    #[error("undecodable header: {0}")]
    Header(String),
    #[error("unknown tag kind {0}")]
    UnknownTagKind(u8),
    #[error("unknown lane {0}")]
    UnknownLane(u8),
    #[error("{kind} message must have an empty payload, got {len} bytes")]
    UnexpectedPayload { kind: &'static str, len: usize },
}

/// Rejection counters, one per error kind, shared by every reader of a transport.
#[derive(Debug, Default)]
pub struct WireStats {
    pub truncated: AtomicU64,
    pub oversize: AtomicU64,
    pub version: AtomicU64,
    pub checksum: AtomicU64,
    pub header: AtomicU64,
    pub unknown_kind: AtomicU64,
}

/// A point-in-time copy of [`WireStats`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct WireCounts {
    pub truncated: u64,
    pub oversize: u64,
    pub version: u64,
    pub checksum: u64,
    pub header: u64,
    pub unknown_kind: u64,
}

impl WireCounts {
    pub fn total(&self) -> u64 {
        self.truncated
            + self.oversize
            + self.version
            + self.checksum
            + self.header
            + self.unknown_kind
    }
}

impl WireStats {
    pub fn count(&self, e: &WireError) {
        let c = match e {
            WireError::Truncated { .. } => &self.truncated,
            WireError::Oversize { .. } => &self.oversize,
            WireError::Version { .. } => &self.version,
            WireError::Checksum { .. } => &self.checksum,
            WireError::HeaderLength { .. }
            | WireError::Header(_)
            | WireError::UnexpectedPayload { .. } => &self.header,
            WireError::UnknownTagKind(_) | WireError::UnknownLane(_) => &self.unknown_kind,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> WireCounts {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        WireCounts {
            truncated: g(&self.truncated),
            oversize: g(&self.oversize),
            version: g(&self.version),
            checksum: g(&self.checksum),
            header: g(&self.header),
            unknown_kind: g(&self.unknown_kind),
        }
    }
}
