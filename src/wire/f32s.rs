//! Tensor values on the wire and on disk: raw little-endian f32 (or bf16 for gathered
//! parameters under mixed precision), never run through a serializer (a per-element one cost a
//! fifth of a step's CPU).

use std::ops::Range;

use bytes::Bytes;

use crate::model::gemm::{from_bf16, to_bf16};

/// Appends `v` as little-endian f32 bytes.
pub fn put_f32s(out: &mut Vec<u8>, v: &[f32]) {
    crate::reduce::le::extend_le(out, v);
}

/// Little-endian f32 values of `bytes` (whose length is a multiple of 4).
pub fn get_f32s(bytes: &[u8]) -> Vec<f32> {
    let mut out = vec![0f32; bytes.len() / 4];
    decode_f32_into(bytes, &mut out);
    out
}

/// Little-endian bytes of `src` at the given ranges, concatenated.
pub fn encode_f32(src: &[f32], ranges: impl Iterator<Item = Range<usize>>) -> Bytes {
    let mut out = Vec::new();
    for r in ranges {
        put_f32s(&mut out, &src[r]);
    }
    Bytes::from(out)
}

/// Writes little-endian `f32` bytes into `dst`.
pub fn decode_f32_into(bytes: &[u8], dst: &mut [f32]) {
    let n = (bytes.len() / 4).min(dst.len());
    crate::reduce::le::copy_le_into(&bytes[..4 * n], dst);
}

/// Appends `src` rounded to bf16 (`model::gemm::to_bf16`) as little-endian bytes: ZeRO-3's
/// parameter gather under bf16 mixed precision, half the bytes of [`put_f32s`].
pub fn put_bf16s(out: &mut Vec<u8>, src: &[f32]) {
    let at = out.len();
    out.resize(at + 2 * src.len(), 0);
    for (dst, &x) in out[at..].chunks_exact_mut(2).zip(src) {
        dst.copy_from_slice(&to_bf16(x).to_le_bytes());
    }
}

/// Writes the `f32` values of little-endian bf16 `bytes` into `dst` (exact: every bf16 is an
/// `f32`).
pub fn decode_bf16_into(bytes: &[u8], dst: &mut [f32]) {
    for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
        *d = from_bf16(u16::from_le_bytes([b[0], b[1]]));
    }
}
