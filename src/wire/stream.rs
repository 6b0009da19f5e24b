//! Incremental decoding of frames from a byte stream (a QUIC stream delivers arbitrary chunks).
//!
//! Buffering is bounded: the decoder holds at most one frame, and it allocates the frame's
//! buffer only after the prefix passed the version and length checks.

use bytes::{Buf, Bytes, BytesMut};

use super::codec::{check_prefix, decode_body};
use super::{WireError, WireMsg, CHECKSUM_BYTES, PREFIX_BYTES};

pub struct StreamDecoder {
    max_frame_bytes: u32,
    prefix: [u8; PREFIX_BYTES],
    have_prefix: usize,
    /// Header length and the bytes still missing, once the prefix is in.
    header_len: usize,
    need: usize,
    body: BytesMut,
    /// Checksum of the prefix and of the body so far, up to the trailing checksum: each piece
    /// is summed right after it is copied, while it is in cache. Summing the whole frame at
    /// the end read it back from memory (a 64 MiB frame does not fit in L3).
    crc: crc32fast::Hasher,
    /// Whether `body` is a large frame's (see `spares`).
    large: bool,
    /// The allocations of the last large frames, reused for the next one once their consumer
    /// has dropped them. A fresh multi-MiB buffer per frame costs a page fault and a page of
    /// zeroing per 4 KiB (and an munmap after): more CPU than the copy into it. Two, because
    /// the next frame usually starts arriving while the consumer still holds the last one.
    spares: Vec<Bytes>,
}

/// Large frames' allocations kept for reuse, per decoder.
const SPARES: usize = 2;

/// Frames from this size up are assembled in the reused allocation; smaller ones get their own
/// (a small frame held for long must not pin a large buffer).
const REUSE_MIN_BYTES: usize = 1 << 20;

impl StreamDecoder {
    pub fn new(max_frame_bytes: u32) -> Self {
        Self {
            max_frame_bytes,
            prefix: [0; PREFIX_BYTES],
            have_prefix: 0,
            header_len: 0,
            need: 0,
            body: BytesMut::new(),
            crc: crc32fast::Hasher::new(),
            large: false,
            spares: Vec::new(),
        }
    }

    /// Consumes bytes from `input` until one frame is complete (returned) or `input` is empty
    /// (`Ok(None)`). An error means the stream is unusable: framing is lost.
    pub fn next(&mut self, input: &mut Bytes) -> Result<Option<WireMsg>, WireError> {
        if self.have_prefix < PREFIX_BYTES {
            let n = (PREFIX_BYTES - self.have_prefix).min(input.len());
            self.prefix[self.have_prefix..self.have_prefix + n].copy_from_slice(&input[..n]);
            input.advance(n);
            self.have_prefix += n;
            if self.have_prefix < PREFIX_BYTES {
                return Ok(None);
            }
            let (body, h) = check_prefix(&self.prefix, self.max_frame_bytes)?;
            self.header_len = h;
            self.need = body + CHECKSUM_BYTES;
            self.crc = crc32fast::Hasher::new();
            self.crc.update(&self.prefix);
            self.large = self.need >= REUSE_MIN_BYTES;
            self.body = if self.large {
                self.reuse(self.need)
            } else {
                BytesMut::with_capacity(self.need)
            };
        }
        let n = self.need.min(input.len());
        // Everything before the trailing checksum is summed.
        let summed = self.need.saturating_sub(CHECKSUM_BYTES).min(n);
        self.body.extend_from_slice(&input[..n]);
        self.crc.update(&input[..summed]);
        input.advance(n);
        self.need -= n;
        if self.need > 0 {
            return Ok(None);
        }
        self.have_prefix = 0;
        let body = std::mem::take(&mut self.body).freeze();
        if self.large {
            if self.spares.len() == SPARES {
                self.spares.remove(0);
            }
            self.spares.push(body.clone());
        }
        let got = std::mem::replace(&mut self.crc, crc32fast::Hasher::new()).finalize();
        decode_body(self.header_len, body, got).map(Some)
    }

    /// An empty buffer of at least `need` bytes, in a spare allocation nobody else holds if
    /// there is one.
    fn reuse(&mut self, need: usize) -> BytesMut {
        let free = self.spares.iter().position(Bytes::is_unique);
        let mut buf = match free.map(|i| self.spares.remove(i).try_into_mut()) {
            Some(Ok(b)) => b,
            _ => BytesMut::new(),
        };
        buf.clear();
        buf.reserve(need);
        buf
    }

    /// Bytes of a partial frame held (0 between frames). A stream that ends with this non-zero
    /// ended mid-frame.
    pub fn pending_bytes(&self) -> usize {
        if self.have_prefix < PREFIX_BYTES {
            self.have_prefix
        } else {
            PREFIX_BYTES + self.body.len()
        }
    }

    /// The error to report when the stream ends now.
    pub fn finish(&self) -> Result<(), WireError> {
        match self.pending_bytes() {
            0 => Ok(()),
            have => Err(WireError::Truncated {
                have,
                need: if self.have_prefix < PREFIX_BYTES {
                    PREFIX_BYTES
                } else {
                    PREFIX_BYTES + self.body.len() + self.need
                },
            }),
        }
    }
}
