//! Gradient accumulation buffers for both reduction modes behind one type.
//!
//! `exact` mode accumulates 64-bit fixed point (see `exact.rs`); `fast` mode accumulates `f32`
//! (reproducible only at a fixed world size and micro-batch placement). Everything else in the
//! runtime (the reduce-scatter, the optimizer feed, the byte accounting) goes through this type so
//! that the two modes share one code path.

use serde::{Deserialize, Serialize};

use super::exact::{self, QuantStats};
use super::le::{copy_le_into, extend_le, le_bytes_mut};

/// How gradients are reduced across micro-batches and ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ReduceMode {
    /// Bit-identical across world sizes, stages and micro-batch placement (default).
    #[default]
    Exact,
    /// Plain `f32` sums; reproducible only at a fixed world size.
    Fast,
}

impl ReduceMode {
    /// Adds the encoded values `src` into the encoded values `dst` (this mode's wire encoding,
    /// the same length, a multiple of the element's): [`GradBuf::add_encoded`] for an
    /// accumulator seen as its bytes, as when its sums are sent and received in place. Exact
    /// adds wrap, as there.
    pub fn add_encoded_into(self, dst: &mut [u8], src: &[u8]) {
        assert_eq!(dst.len(), src.len(), "sums of equal lengths");
        match self {
            ReduceMode::Exact => {
                for (d, s) in dst.chunks_exact_mut(8).zip(src.chunks_exact(8)) {
                    let a = i64::from_le_bytes((&*d).try_into().expect("8 bytes"));
                    let b = i64::from_le_bytes(s.try_into().expect("8 bytes"));
                    d.copy_from_slice(&a.wrapping_add(b).to_le_bytes());
                }
            }
            ReduceMode::Fast => {
                for (d, s) in dst.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
                    let a = f32::from_le_bytes((&*d).try_into().expect("4 bytes"));
                    let b = f32::from_le_bytes(s.try_into().expect("4 bytes"));
                    d.copy_from_slice(&(a + b).to_le_bytes());
                }
            }
        }
    }

    /// Bytes one accumulated gradient element takes in memory and on the wire.
    pub fn elem_bytes(self) -> usize {
        match self {
            ReduceMode::Exact => 8,
            ReduceMode::Fast => 4,
        }
    }
}

/// A gradient accumulator of one mode.
#[derive(Clone, Debug, PartialEq)]
pub enum GradBuf {
    Exact(Vec<i64>),
    Fast(Vec<f32>),
}

impl GradBuf {
    pub fn zeros(mode: ReduceMode, len: usize) -> Self {
        match mode {
            ReduceMode::Exact => GradBuf::Exact(vec![0; len]),
            ReduceMode::Fast => GradBuf::Fast(vec![0.0; len]),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            GradBuf::Exact(v) => v.len(),
            GradBuf::Fast(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn bytes(&self) -> usize {
        match self {
            GradBuf::Exact(v) => v.len() * 8,
            GradBuf::Fast(v) => v.len() * 4,
        }
    }

    pub fn fill_zero(&mut self) {
        match self {
            GradBuf::Exact(v) => v.fill(0),
            GradBuf::Fast(v) => v.fill(0.0),
        }
    }

    /// Adds one micro-batch's gradient `g` at `offset` (scale exponent `s` in exact mode).
    pub fn accumulate(
        &mut self,
        offset: usize,
        g: &[f32],
        s: i32,
        micro_batches: u32,
    ) -> QuantStats {
        match self {
            GradBuf::Exact(v) => {
                exact::quantize_add(&mut v[offset..offset + g.len()], g, s, micro_batches)
            }
            GradBuf::Fast(v) => {
                let mut st = QuantStats::default();
                for (a, &x) in v[offset..offset + g.len()].iter_mut().zip(g) {
                    st.max_abs = exact::max_nan(st.max_abs, x.abs());
                    *a += x;
                }
                st.overflow = !st.max_abs.is_finite();
                st
            }
        }
    }

    /// Appends the little-endian bytes of `range` to `out` (what travels in a reduce-scatter).
    pub fn encode_into(&self, range: std::ops::Range<usize>, out: &mut Vec<u8>) {
        match self {
            GradBuf::Exact(v) => extend_le(out, &v[range]),
            GradBuf::Fast(v) => extend_le(out, &v[range]),
        }
    }

    /// The accumulator's memory as its wire encoding, to receive into in place (`None` on a
    /// big-endian target).
    pub fn le_bytes_mut(&mut self) -> Option<&mut [u8]> {
        match self {
            GradBuf::Exact(v) => le_bytes_mut(v),
            GradBuf::Fast(v) => le_bytes_mut(v),
        }
    }

    pub fn mode(&self) -> ReduceMode {
        match self {
            GradBuf::Exact(_) => ReduceMode::Exact,
            GradBuf::Fast(_) => ReduceMode::Fast,
        }
    }

    /// Bytes per element on the wire: 8 for `Exact`'s fixed-point, 4 for `Fast`'s f32.
    pub fn elem_bytes(&self) -> usize {
        match self {
            GradBuf::Exact(_) => 8,
            GradBuf::Fast(_) => 4,
        }
    }

    /// Adds encoded partial sums (from `encode`) into `offset..`. Returns false if the byte
    /// length does not match, in which case nothing is changed.
    pub fn add_encoded(&mut self, offset: usize, bytes: &[u8]) -> bool {
        match self {
            GradBuf::Exact(v) => {
                if !bytes.len().is_multiple_of(8) || offset + bytes.len() / 8 > v.len() {
                    return false;
                }
                for (a, b) in v[offset..].iter_mut().zip(bytes.chunks_exact(8)) {
                    // Wrapping: a corrupt peer cannot make us panic; overflow is impossible for
                    // honest peers by the bound on each term.
                    *a = a.wrapping_add(i64::from_le_bytes(b.try_into().expect("8-byte chunk")));
                }
            }
            GradBuf::Fast(v) => {
                if !bytes.len().is_multiple_of(4) || offset + bytes.len() / 4 > v.len() {
                    return false;
                }
                for (a, b) in v[offset..].iter_mut().zip(bytes.chunks_exact(4)) {
                    *a += f32::from_le_bytes(b.try_into().expect("4-byte chunk"));
                }
            }
        }
        true
    }

    /// Overwrites `offset..` with encoded values (the all-gather half of an all-reduce).
    pub fn set_encoded(&mut self, offset: usize, bytes: &[u8]) -> bool {
        let eb = self.elem_bytes();
        if !bytes.len().is_multiple_of(eb) || offset + bytes.len() / eb > self.len() {
            return false;
        }
        match self {
            GradBuf::Exact(v) => copy_le_into(bytes, &mut v[offset..]),
            GradBuf::Fast(v) => copy_le_into(bytes, &mut v[offset..]),
        }
        true
    }

    /// Copies `src[range]` into `self[offset..]` (same mode).
    pub fn copy_from(&mut self, offset: usize, src: &GradBuf, range: std::ops::Range<usize>) {
        match (self, src) {
            (GradBuf::Exact(d), GradBuf::Exact(s)) => {
                d[offset..offset + range.len()].copy_from_slice(&s[range])
            }
            (GradBuf::Fast(d), GradBuf::Fast(s)) => {
                d[offset..offset + range.len()].copy_from_slice(&s[range])
            }
            _ => unreachable!("gradient buffers of one run share a mode"),
        }
    }

    /// Partial squared norm of `range`, in a form that sums exactly across ranks in exact mode.
    pub fn sum_squares(&self, range: std::ops::Range<usize>) -> SumSquares {
        match self {
            GradBuf::Exact(v) => SumSquares::Exact(exact::sum_squares(&v[range])),
            GradBuf::Fast(v) => {
                SumSquares::Fast(v[range].iter().map(|&x| x as f64 * x as f64).sum())
            }
        }
    }

    /// The shard made of `ranges` (concatenated) times `factor` as `f32`, and its partial sum
    /// of squares, as [`to_f32`](Self::to_f32) and [`sum_squares`](Self::sum_squares) give them
    /// on a buffer holding that shard, without making one.
    pub fn shard_mean(
        &self,
        ranges: &[std::ops::Range<usize>],
        factor: f64,
    ) -> (Vec<f32>, SumSquares) {
        let len = ranges.iter().map(|r| r.len()).sum();
        let mut out = vec![0f32; len];
        let ss = self.shard_mean_into(ranges, factor, &mut out);
        (out, ss)
    }

    /// [`shard_mean`](Self::shard_mean) into `out` (the shard's length).
    pub fn shard_mean_into(
        &self,
        ranges: &[std::ops::Range<usize>],
        factor: f64,
        out: &mut [f32],
    ) -> SumSquares {
        let mut at = 0;
        for r in ranges {
            self.to_f32(r.clone(), factor, &mut out[at..at + r.len()]);
            at += r.len();
        }
        let ss = match self {
            // Integer sums of squares: the same however the shard is cut.
            GradBuf::Exact(_) => ranges.iter().fold(SumSquares::Exact(0), |ss, r| {
                ss.plus(self.sum_squares(r.clone()))
            }),
            // A float sum, in the shard's order, as `sum_squares` over the shard adds it.
            GradBuf::Fast(v) => SumSquares::Fast(
                ranges
                    .iter()
                    .flat_map(|r| &v[r.clone()])
                    .map(|&x| x as f64 * x as f64)
                    .sum(),
            ),
        };
        ss
    }

    /// `range` times `factor` (see [`mean_factor`]) as `f32`, into `out`.
    pub fn to_f32(&self, range: std::ops::Range<usize>, factor: f64, out: &mut [f32]) {
        match self {
            GradBuf::Exact(v) => exact::dequantize(&v[range], factor, out),
            GradBuf::Fast(v) => {
                let f = factor as f32;
                for (o, &x) in out.iter_mut().zip(&v[range]) {
                    *o = x * f;
                }
            }
        }
    }
}

/// A partial sum of squares: an integer in exact mode (so the global sum is order-free).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum SumSquares {
    Exact(i128),
    Fast(f64),
}

impl SumSquares {
    pub fn zero(mode: ReduceMode) -> Self {
        match mode {
            ReduceMode::Exact => SumSquares::Exact(0),
            ReduceMode::Fast => SumSquares::Fast(0.0),
        }
    }

    pub fn plus(self, other: SumSquares) -> SumSquares {
        match (self, other) {
            (SumSquares::Exact(a), SumSquares::Exact(b)) => SumSquares::Exact(a.wrapping_add(b)),
            (SumSquares::Fast(a), SumSquares::Fast(b)) => SumSquares::Fast(a + b),
            (a, _) => a,
        }
    }
}

/// Factor that turns accumulated sums into the mean gradient ([`GradBuf::to_f32`]).
pub fn mean_factor(mode: ReduceMode, s: i32, micro_batches: u32) -> f64 {
    match mode {
        ReduceMode::Exact => exact::dequant_factor(s, micro_batches),
        ReduceMode::Fast => 1.0 / micro_batches.max(1) as f64,
    }
}

/// Scales the mean gradient by the clip coefficient, in `f32`. Clipping is a second step, after
/// the mean is rounded to `f32`, so that the mean can be stored as `f32` (on the NVMe tier)
/// before the global norm is known and every path still computes the same bits. A coefficient
/// of 1 changes nothing.
pub fn apply_clip(g: &mut [f32], clip_coef: f64) {
    if clip_coef != 1.0 {
        let c = clip_coef as f32;
        g.iter_mut().for_each(|x| *x *= c);
    }
}

/// Global norm of the mean gradient from agreed per-unit partial sums of squares.
pub fn global_norm(
    mode: ReduceMode,
    per_unit: &[SumSquares],
    exps: &[i32],
    micro_batches: u32,
) -> f64 {
    match mode {
        ReduceMode::Exact => {
            let ints: Vec<i128> = per_unit
                .iter()
                .map(|s| match s {
                    SumSquares::Exact(v) => *v,
                    SumSquares::Fast(_) => 0,
                })
                .collect();
            exact::global_norm(&ints, exps, micro_batches)
        }
        ReduceMode::Fast => {
            let m = micro_batches.max(1) as f64;
            let total: f64 = per_unit
                .iter()
                .map(|s| match s {
                    SumSquares::Fast(v) => *v,
                    SumSquares::Exact(_) => 0.0,
                })
                .sum();
            total.sqrt() / m
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Adding on the bytes gives what adding into the accumulator gives, bit for bit, in both
    /// modes (wrapping in exact mode).
    #[test]
    fn adding_encoded_bytes_matches_adding_into_the_buffer() {
        for mode in [ReduceMode::Exact, ReduceMode::Fast] {
            let mut a = GradBuf::zeros(mode, 40);
            let mut b = GradBuf::zeros(mode, 40);
            match (&mut a, &mut b) {
                (GradBuf::Exact(x), GradBuf::Exact(y)) => {
                    for i in 0..40 {
                        x[i] = i64::MAX - i as i64;
                        y[i] = i as i64 * 1_000_003 + 7;
                    }
                }
                (GradBuf::Fast(x), GradBuf::Fast(y)) => {
                    for i in 0..40 {
                        x[i] = 0.1 * i as f32 - 1.7;
                        y[i] = 1e-3 / (i as f32 + 0.5);
                    }
                }
                _ => unreachable!(),
            }
            let mut src = Vec::new();
            b.encode_into(3..31, &mut src);
            let mut want = a.clone();
            assert!(want.add_encoded(3, &src));
            let mut got = a.clone();
            let eb = got.elem_bytes();
            let bytes = got.le_bytes_mut().expect("little-endian target");
            mode.add_encoded_into(&mut bytes[3 * eb..31 * eb], &src);
            assert_eq!(got, want, "{mode:?}");
            assert_ne!(got, a, "{mode:?}: something was added");
        }
    }
}
