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
}

impl StreamDecoder {
    pub fn new(max_frame_bytes: u32) -> Self {
        Self {
            max_frame_bytes,
            prefix: [0; PREFIX_BYTES],
            have_prefix: 0,
            header_len: 0,
            need: 0,
            body: BytesMut::new(),
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
            self.body = BytesMut::with_capacity(self.need);
        }
        let n = self.need.min(input.len());
        self.body.extend_from_slice(&input[..n]);
        input.advance(n);
        self.need -= n;
        if self.need > 0 {
            return Ok(None);
        }
        self.have_prefix = 0;
        let body = std::mem::take(&mut self.body).freeze();
        decode_body(&self.prefix, self.header_len, body).map(Some)
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
