//! Exact, order-independent gradient reduction in 64-bit fixed point.
//!
//! Floating-point sums depend on order, so a world of 3 ranks and a world of 4 reduce the same
//! micro-batch gradients to different bits. Integers do not: each micro-batch gradient element is
//! rounded to a multiple of 2^-s (one `s` per unit, agreed by every rank), stored as `i64`, and
//! summed; the sum is the same whatever the grouping. The only rounding happens once per
//! micro-batch element and once when the sum is turned back into `f32`, both pure functions of
//! the element, so the reduced gradient is bit-identical across world sizes, stages and
//! micro-batch placement.
//!
//! Choosing `s`: every rank derives it from a bound on |g| for the unit (the previous step's
//! agreed global maximum times a headroom factor) and the number of micro-batches M, so that M
//! rounded terms can never overflow 62 bits. If a gradient exceeds the bound anyway, the step is
//! flagged as overflowed, every rank learns it through the agreed flags, and the step is redone
//! with the bound taken from the maximum actually seen, which is itself exact (max is
//! associative). A non-finite gradient cannot be represented and skips the step.

use crate::optim::{multiversion, Isa};

/// Largest magnitude one micro-batch term may reach: M terms then sum below 2^62 < i64::MAX.
const SUM_BITS: i32 = 62;

/// Growth the bound allows before a step overflows (2^8: gradients rarely grow 256x per step).
pub const HEADROOM_LOG2: i32 = 8;

/// Bound used when no maximum has been agreed yet (first step): 2^16.
pub const INITIAL_BOUND: f32 = 65536.0;

/// What quantizing one buffer saw.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct QuantStats {
    /// Largest |g| (NaN if any element was NaN; inf if any was infinite).
    pub max_abs: f32,
    /// Some element exceeded the representable bound for this step's scale.
    pub overflow: bool,
}

impl QuantStats {
    pub fn merge(self, other: QuantStats) -> QuantStats {
        QuantStats {
            max_abs: max_nan(self.max_abs, other.max_abs),
            overflow: self.overflow || other.overflow,
        }
    }
}

/// `max` that keeps NaN (so a NaN anywhere is seen everywhere).
pub fn max_nan(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

/// The fixed-point exponent for a unit: terms are `round(g * 2^s)`.
///
/// With |g| <= bound < 2^e and M micro-batches, |term| <= 2^(e+s) must stay below
/// 2^(62 - ceil_log2(M)), so s = 62 - ceil_log2(M) - e.
pub fn scale_exponent(bound: f32, micro_batches: u32) -> i32 {
    let bound = if bound.is_finite() && bound > 0.0 {
        bound
    } else {
        INITIAL_BOUND
    };
    let e = exponent_above(bound);
    SUM_BITS - ceil_log2(micro_batches.max(1)) - e
}

/// The bound to use next step given the agreed maximum of this one.
pub fn next_bound(max_abs: f32) -> f32 {
    if !max_abs.is_finite() || max_abs <= 0.0 {
        return INITIAL_BOUND;
    }
    (max_abs as f64 * f64::powi(2.0, HEADROOM_LOG2)).min(f32::MAX as f64) as f32
}

/// Adds `round(g * 2^s)` into `acc` element-wise and reports the largest |g| seen.
pub fn quantize_add(acc: &mut [i64], g: &[f32], s: i32, micro_batches: u32) -> QuantStats {
    debug_assert_eq!(acc.len(), g.len());
    let scale = f64::powi(2.0, s);
    let limit = f64::powi(2.0, SUM_BITS - ceil_log2(micro_batches.max(1)));
    let mut st = QuantStats::default();
    // Multiversioned so that `round` is inlined (SSE4.1 and later round in registers; the
    // x86-64 baseline calls the C library once per element). `round` is exactly specified, so
    // every version gives the same bits.
    quantize_add_kernel(Isa::best(), acc, g, (scale, limit), &mut st);
    st
}

multiversion!(fn quantize_add_kernel(
    acc: &mut [i64],
    g: &[f32],
    scale_limit: (f64, f64),
    st: &mut QuantStats,
) => quantize_add_body);

#[inline(always)]
fn quantize_add_body(acc: &mut [i64], g: &[f32], (scale, limit): (f64, f64), st: &mut QuantStats) {
    let mut max_abs = 0.0f32;
    let mut overflow = false;
    for (a, &x) in acc.iter_mut().zip(g) {
        max_abs = max_nan(max_abs, x.abs());
        // Scaling by a power of two is exact in f64, so only `round` rounds.
        let q = (x as f64 * scale).round();
        if q.abs() < limit {
            *a += q as i64;
        } else {
            overflow = true; // also catches NaN and inf
        }
    }
    *st = QuantStats { max_abs, overflow };
}

/// Factor that turns a fixed-point sum into the mean gradient, times the clip coefficient.
pub fn dequant_factor(s: i32, micro_batches: u32) -> f64 {
    1.0 / (f64::powi(2.0, s) * micro_batches.max(1) as f64)
}

/// Converts fixed-point sums to `f32` gradients: `(q * factor) as f32`, element by element.
pub fn dequantize(q: &[i64], factor: f64, out: &mut [f32]) {
    for (o, &x) in out.iter_mut().zip(q) {
        *o = (x as f64 * factor) as f32;
    }
}

/// Bits dropped before squaring so that the sum of squares fits an `i128`.
const SQUARE_SHIFT: u32 = 20;

/// Exact partial sum of squares of fixed-point sums (after dropping `SQUARE_SHIFT` low bits):
/// (2^42)^2 * 2^40 elements < 2^127, so any model below 10^12 parameters cannot overflow.
pub fn sum_squares(q: &[i64]) -> i128 {
    q.iter()
        .map(|&x| {
            let y = (x >> SQUARE_SHIFT) as i128;
            y * y
        })
        .sum()
}

/// Global gradient norm of the mean gradient, from the agreed per-unit exact sums of squares.
pub fn global_norm(per_unit_sum_squares: &[i128], exps: &[i32], micro_batches: u32) -> f64 {
    let m = micro_batches.max(1) as f64;
    per_unit_sum_squares
        .iter()
        .zip(exps)
        .map(|(&ss, &s)| {
            // (q >> k)^2 * 2^(2k) / (2^s M)^2
            ss as f64 * f64::powi(2.0, 2 * SQUARE_SHIFT as i32 - 2 * s) / (m * m)
        })
        .sum::<f64>()
        .sqrt()
}

/// Clip coefficient for global-norm clipping (1.0 when clipping is off or not needed).
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    if max_norm <= 0.0 || !norm.is_finite() {
        return 1.0;
    }
    (max_norm / (norm + 1e-6)).min(1.0)
}

fn ceil_log2(x: u32) -> i32 {
    (32 - (x.max(1) - 1).leading_zeros()) as i32
}

/// Smallest e with bound < 2^e.
fn exponent_above(bound: f32) -> i32 {
    let mut e = bound.log2().floor() as i32 + 1;
    while f64::powi(2.0, e) <= bound as f64 {
        e += 1;
    }
    while e > -126 && f64::powi(2.0, e - 1) > bound as f64 {
        e -= 1;
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ceil_log2_values() {
        assert_eq!(ceil_log2(1), 0);
        assert_eq!(ceil_log2(2), 1);
        assert_eq!(ceil_log2(3), 2);
        assert_eq!(ceil_log2(8), 3);
        assert_eq!(ceil_log2(9), 4);
    }

    #[test]
    fn exponent_bounds_value() {
        for b in [1e-30f32, 0.3, 1.0, 1.5, 2.0, 1000.0, 65536.0] {
            let e = exponent_above(b);
            assert!(
                (b as f64) < f64::powi(2.0, e) && f64::powi(2.0, e - 1) <= b as f64,
                "{b} {e}"
            );
        }
    }

    #[test]
    fn overflow_and_nan_are_flagged() {
        let s = scale_exponent(1.0, 4);
        let mut acc = vec![0i64; 3];
        assert!(!quantize_add(&mut acc, &[0.5, -1.0, 0.0], s, 4).overflow);
        assert!(quantize_add(&mut acc, &[3.0, 0.0, 0.0], s, 4).overflow);
        let st = quantize_add(&mut acc, &[f32::NAN, 0.0, 0.0], s, 4);
        assert!(st.overflow && st.max_abs.is_nan());
    }

    proptest! {
        #[test]
        fn sums_do_not_depend_on_grouping(
            grads in proptest::collection::vec(proptest::collection::vec(-10.0f32..10.0, 5), 1..9),
            split in 0usize..9,
        ) {
            let m = grads.len() as u32;
            let s = scale_exponent(16.0, m);
            let mut all = vec![0i64; 5];
            for g in &grads { prop_assert!(!quantize_add(&mut all, g, s, m).overflow); }
            // Two "ranks" accumulate disjoint subsets in reverse order, then add.
            let k = split.min(grads.len());
            let (mut a, mut b) = (vec![0i64; 5], vec![0i64; 5]);
            for g in grads[..k].iter().rev() { quantize_add(&mut a, g, s, m); }
            for g in grads[k..].iter().rev() { quantize_add(&mut b, g, s, m); }
            let sum: Vec<i64> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
            prop_assert_eq!(&sum, &all);
            // And the mean is close to the float mean.
            let mut out = vec![0f32; 5];
            dequantize(&all, dequant_factor(s, m), &mut out);
            for i in 0..5 {
                let mean: f64 = grads.iter().map(|g| g[i] as f64).sum::<f64>() / m as f64;
                prop_assert!((out[i] as f64 - mean).abs() <= 1e-5 * mean.abs().max(1.0));
            }
        }
    }

    #[test]
    fn norm_matches_float_norm() {
        let g = [3.0f32, -4.0, 0.0];
        let s = scale_exponent(8.0, 1);
        let mut acc = vec![0i64; 3];
        quantize_add(&mut acc, &g, s, 1);
        let n = global_norm(&[sum_squares(&acc)], &[s], 1);
        assert!((n - 5.0).abs() < 1e-9, "{n}");
        assert!((clip_coefficient(n, 1.0) - 0.2).abs() < 1e-6);
        assert_eq!(clip_coefficient(n, 0.0), 1.0);
    }
}
