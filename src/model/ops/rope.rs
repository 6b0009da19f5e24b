//! Rotary position embedding in the rotate-half convention of Hugging Face's Llama checkpoints:
//! within each head, element `i` and element `i + head_dim/2` form a pair rotated by
//! `pos · θ^(-2i/head_dim)` (not interleaved pairs as in Meta's original layout).
//!
//! The backward of a rotation is the rotation by the opposite angle, so one kernel with an
//! `inverse` flag serves both.

use super::check_len;

/// `cos` and `sin` of every (position, pair) angle, `[positions, head_dim/2]` row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable {
    pub head_dim: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeTable {
    /// The table transformers computes for `theta` (`rope_theta`): `inv_freq` and the angles in
    /// f32 exactly as `LlamaRotaryEmbedding` rounds them, so positions far from 0 carry the same
    /// rounding as the reference. `cos`/`sin` come from f64 libm rounded to f32; a libm that
    /// differed in the last f64 bit would change a value only at an f32 rounding tie, and every
    /// rank of a run shares one table anyway (it is computed once per model).
    pub fn new(theta: f64, head_dim: usize, positions: usize) -> Self {
        assert!(
            head_dim >= 2 && head_dim.is_multiple_of(2),
            "RoPE head_dim {head_dim} must be even"
        );
        let half = head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| {
                let exponent = (2 * i) as f32 / head_dim as f32;
                1.0f32 / (theta.powf(exponent as f64) as f32)
            })
            .collect();
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for &f in &inv_freq {
                let angle = (p as f32 * f) as f64;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Self { head_dim, cos, sin }
    }

    /// Positions the table covers.
    pub fn positions(&self) -> usize {
        self.cos.len() / (self.head_dim / 2)
    }
}

/// Rotates every head of every row of `x` (rows of `width`, a multiple of `head_dim`) in place
/// by its position's angles; row `r` is at position `r % seq` (micro-batch rows are sequences
/// of `seq` tokens starting at 0) or `pos0 + r` when `seq` is 0 (incremental decoding). With
/// `inverse`, rotates back (the backward).
pub fn rope_rotate(
    x: &mut [f32],
    width: usize,
    seq: usize,
    pos0: usize,
    t: &RopeTable,
    inverse: bool,
) {
    let (hd, half) = (t.head_dim, t.head_dim / 2);
    assert!(
        width > 0 && width.is_multiple_of(hd) && x.len().is_multiple_of(width),
        "rope: rows of {width} are not whole heads of {hd}"
    );
    check_len("rope cos", t.sin.len(), t.cos.len());
    for (r, row) in x.chunks_exact_mut(width).enumerate() {
        let pos = if seq == 0 { pos0 + r } else { r % seq };
        assert!(pos < t.positions(), "rope: position {pos} past the table");
        let (c, s) = (&t.cos[pos * half..][..half], &t.sin[pos * half..][..half]);
        for head in row.chunks_exact_mut(hd) {
            let (lo, hi) = head.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (lo[i], hi[i]);
                (lo[i], hi[i]) = match inverse {
                    false => (a * c[i] - b * s[i], b * c[i] + a * s[i]),
                    true => (a * c[i] + b * s[i], b * c[i] - a * s[i]),
                };
            }
        }
    }
}
