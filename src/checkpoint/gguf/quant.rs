//! ggml tensor types and their dequantization to f32.
//!
//! Supported: F32, F16, BF16 and the 32-element block formats Q4_0, Q4_1, Q8_0 (layouts in
//! ggml `src/ggml-quants.c`). Each element is computed with the same f32 operations, in the same
//! order, as ggml's reference dequantizer and the `gguf` Python package (`d * q`, then `+ m`),
//! so the values are bit for bit those; Rust never fuses the multiply and add on its own.

use rayon::prelude::*;

use crate::checkpoint::hf::files::f16_to_f32;

/// The tensor types this reader dequantizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    BF16,
}

/// For error messages: what the reader accepts.
pub const SUPPORTED: &str = "F32 (0), F16 (1), Q4_0 (2), Q4_1 (3), Q8_0 (8), BF16 (30)";

/// Elements per quantization block of the block formats.
const QK: usize = 32;

/// Work per rayon task: enough blocks that scheduling costs little next to the arithmetic.
const BLOCKS_PER_TASK: usize = 4096;

impl GgmlType {
    /// The type for a ggml type number, or the number back when it is not supported.
    pub fn from_u32(n: u32) -> Result<Self, u32> {
        Ok(match n {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            30 => Self::BF16,
            other => return Err(other),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q8_0 => "Q8_0",
            Self::BF16 => "BF16",
        }
    }

    /// (elements per block, bytes per block).
    fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            Self::Q4_0 => (QK, 18),
            Self::Q4_1 => (QK, 20),
            Self::Q8_0 => (QK, 34),
        }
    }

    /// Bytes of a tensor with `dims` (innermost first), or why it cannot have this type: ggml
    /// quantizes along rows, so the innermost dimension must be whole blocks.
    pub fn n_bytes(self, dims: &[u64]) -> Result<u64, String> {
        let (per_block, block_bytes) = self.block();
        let inner = dims.first().copied().unwrap_or(1);
        if !inner.is_multiple_of(per_block as u64) {
            return Err(format!(
                "its row length {inner} is not a multiple of {}'s block of {per_block}",
                self.name()
            ));
        }
        dims.iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .and_then(|n| (n / per_block as u64).checked_mul(block_bytes as u64))
            .ok_or_else(|| format!("its dimensions {dims:?} overflow"))
    }
}

/// The name ggml gives a type number (for refusing the ones not read here).
pub fn ggml_type_name(n: u32) -> &'static str {
    const NAMES: &[(u32, &str)] = &[
        (0, "F32"),
        (1, "F16"),
        (2, "Q4_0"),
        (3, "Q4_1"),
        (6, "Q5_0"),
        (7, "Q5_1"),
        (8, "Q8_0"),
        (9, "Q8_1"),
        (10, "Q2_K"),
        (11, "Q3_K"),
        (12, "Q4_K"),
        (13, "Q5_K"),
        (14, "Q6_K"),
        (15, "Q8_K"),
        (16, "IQ2_XXS"),
        (17, "IQ2_XS"),
        (18, "IQ3_XXS"),
        (19, "IQ1_S"),
        (20, "IQ4_NL"),
        (21, "IQ3_S"),
        (22, "IQ2_S"),
        (23, "IQ4_XS"),
        (24, "I8"),
        (25, "I16"),
        (26, "I32"),
        (27, "I64"),
        (28, "F64"),
        (29, "IQ1_M"),
        (30, "BF16"),
        (34, "TQ1_0"),
        (35, "TQ2_0"),
        (39, "MXFP4"),
    ];
    NAMES
        .iter()
        .find(|(k, _)| *k == n)
        .map_or("unknown", |(_, name)| name)
}

/// Dequantizes `bytes` (exactly the tensor's bytes, `ty.n_bytes` long) into `out`.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    let (per_block, block_bytes) = ty.block();
    debug_assert_eq!(bytes.len() / block_bytes * per_block, out.len());
    let task_in = block_bytes * BLOCKS_PER_TASK;
    let task_out = per_block * BLOCKS_PER_TASK;
    bytes
        .par_chunks(task_in)
        .zip(out.par_chunks_mut(task_out))
        .for_each(|(src, dst)| {
            for (b, y) in src
                .chunks_exact(block_bytes)
                .zip(dst.chunks_exact_mut(per_block))
            {
                block(ty, b, y);
            }
        });
}

fn half(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// One block: `b` is `block_bytes` long and `y` `per_block` long (the callers' chunking).
fn block(ty: GgmlType, b: &[u8], y: &mut [f32]) {
    match ty {
        GgmlType::F32 => y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => y[0] = half(b, 0),
        GgmlType::BF16 => y[0] = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16),
        GgmlType::Q8_0 => {
            let d = half(b, 0);
            for (y, &q) in y.iter_mut().zip(&b[2..2 + QK]) {
                *y = f32::from(q as i8) * d;
            }
        }
        // Low nibbles are the block's first 16 elements, high nibbles its last 16.
        GgmlType::Q4_0 => {
            let d = half(b, 0);
            let (lo, hi) = y.split_at_mut(QK / 2);
            for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&b[2..2 + QK / 2]) {
                *l = d * f32::from((q & 0x0f) as i8 - 8);
                *h = d * f32::from((q >> 4) as i8 - 8);
            }
        }
        GgmlType::Q4_1 => {
            let d = half(b, 0);
            let m = half(b, 2);
            let (lo, hi) = y.split_at_mut(QK / 2);
            for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&b[4..4 + QK / 2]) {
                *l = d * f32::from(q & 0x0f) + m;
                *h = d * f32::from(q >> 4) + m;
            }
        }
    }
}
