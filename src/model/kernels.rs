//! Elementwise `f32` kernels of the model (exp, GELU, softmax rows, fixed-lane sums), written so
//! that LLVM vectorises them and compiled for several instruction sets by `optim::multiversion`.
//!
//! Why the bits do not depend on the machine's vector width or on who calls them:
//! - only IEEE `+ - * / sqrt`, comparisons and bit operations, which are correctly rounded at
//!   every width; no libm, and FMA is never enabled (Rust does not contract `a * b + c` itself);
//! - every reduction runs over a fixed number of lanes ([`LANES`]) in a fixed order that depends
//!   only on the slice length, so AVX-512, AVX2 and SSE2 builds sum the same partial sums.

use crate::optim::{multiversion, Isa};

/// Lanes of every reduction in this file: element `i` always goes to partial sum `i % LANES`.
pub const LANES: usize = 16;

/// Folds the `LANES` partial sums in a fixed pairwise order.
#[inline(always)]
fn fold_lanes<T: Copy + std::ops::Add<Output = T>>(mut acc: [T; LANES]) -> T {
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for j in 0..w {
            acc[j] = acc[j] + acc[j + w];
        }
    }
    acc[0]
}

/// `Σ f(i)` for `i < n`, with element `i` in lane `i % LANES`; the shape every sum here uses.
#[inline(always)]
pub fn lane_sum<T: Copy + std::ops::Add<Output = T>>(
    n: usize,
    zero: T,
    f: impl Fn(usize) -> T,
) -> T {
    let mut acc = [zero; LANES];
    let full = n - n % LANES;
    let mut i = 0;
    while i < full {
        for (j, a) in acc.iter_mut().enumerate() {
            *a = *a + f(i + j);
        }
        i += LANES;
    }
    for (j, a) in acc.iter_mut().enumerate().take(n - full) {
        *a = *a + f(full + j);
    }
    fold_lanes(acc)
}

/// Largest element (`-inf` for an empty slice). `max` is exact, so any order gives the same
/// value; the lanes only let it vectorise.
#[inline(always)]
fn lane_max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let rem = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            acc[j] = acc[j].max(c[j]);
        }
    }
    for (a, &v) in acc.iter_mut().zip(rem) {
        *a = a.max(v);
    }
    acc.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

/// `e^x` in `f32` from arithmetic alone: Cody-Waite reduction `x = k ln2 + r`, `|r| <= ln2/2`
/// (plus rounding), then the degree-7 Taylor polynomial of `e^r` (truncation error below 6e-9
/// relative, so the result is within a few ulp). Below -87 it returns 0 (flushing results under
/// 1.6e-38 that would be subnormal); above 88 it saturates at `e^88`. Callers exponentiate
/// values <= 0 only. Branch-free except for selects, so loops over it vectorise.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    // ln 2 = LN2_HI + LN2_LO; LN2_HI (0.693145751953125) has 15 significant bits, so
    // k · LN2_HI is exact for |k| <= 2^9. Bit patterns, as decimal literals this exact trip clippy.
    const LN2_HI: f32 = f32::from_bits(0x3F31_7200);
    const LN2_LO: f32 = f32::from_bits(0x35BF_BE8E); // 1.4286068e-6
    const SHIFT: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer
    const C: [f32; 8] = [
        1.0,
        1.0,
        1.0 / 2.0,
        1.0 / 6.0,
        1.0 / 24.0,
        1.0 / 120.0,
        1.0 / 720.0,
        1.0 / 5_040.0,
    ];
    let xc = x.clamp(-87.0, 88.0);
    let shifted = xc * std::f32::consts::LOG2_E + SHIFT;
    let k = shifted - SHIFT;
    let r = (xc - k * LN2_HI) - k * LN2_LO;
    let p = C[0]
        + r * (C[1] + r * (C[2] + r * (C[3] + r * (C[4] + r * (C[5] + r * (C[6] + r * C[7]))))));
    let k_int = shifted.to_bits() as i32 - SHIFT.to_bits() as i32; // k, in [-126, 127]
    let y = p * f32::from_bits(((k_int + 127) << 23) as u32);
    if x < -87.0 {
        0.0
    } else {
        y
    }
}

/// `e^(-x²/2)` with relative error of a few ulp even where `x²/2` is large: `x` is split into
/// `hi` (12 significant bits, so `hi²` is exact) and `lo`, and `x² = hi² + lo (x + hi)`.
#[inline(always)]
fn exp_neg_half_sq(x: f32) -> f32 {
    let hi = f32::from_bits(x.to_bits() & 0xFFFF_F000);
    let lo = x - hi;
    exp_f32(-0.5 * (hi * hi)) * exp_f32(-0.5 * (lo * (x + hi)))
}

/// `(Φ(x), e^(-x²/2))`: the standard normal CDF and the unnormalised density, in `f32`.
///
/// `Φ(x) = erfc(-x/√2) / 2` with the Chebyshev fit `erfcc` of Numerical Recipes in C (2nd ed.,
/// §6.2): `erfc(z) = t · e^(-z² + P(t))`, `t = 1/(1 + z/2)`, fractional error below 1.2e-7 for
/// every `z >= 0`. Going through `erfc` keeps the relative accuracy of the left tail, where GELU
/// is `x · Φ(x)` with `Φ` tiny. `e^(-z²)` is `e^(-x²/2)`, computed from `x` itself (exact) so its
/// error does not grow with `x²`; the backward reuses it for the density `φ`.
#[inline(always)]
pub fn normal_cdf_and_density(x: f32) -> (f32, f32) {
    let z = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -1.265_512_2
        + t * (1.000_023_7
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_204
                                + t * (1.488_515_8 + t * (-0.822_152_2 + t * 0.170_872_77))))))));
    let gauss = exp_neg_half_sq(x);
    let half_erfc = 0.5 * t * gauss * exp_f32(poly);
    let cdf = if x >= 0.0 { 1.0 - half_erfc } else { half_erfc };
    (cdf, gauss)
}

/// `1/√(2π)`, the normal density's constant.
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// GELU `x · Φ(x)` (exact, erf form: PyTorch's `nn.GELU()` default) and, if wanted, its
/// derivative `Φ(x) + x φ(x)`. Forward and backward both come from here, so the backward's
/// recomputed output has the forward's bits.
#[inline(always)]
fn gelu_body(x: &[f32], y: &mut [f32]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o = v * normal_cdf_and_density(v).0;
    }
}

#[inline(always)]
fn gelu_deriv_body(x: &[f32], y: &mut [f32], dydx: &mut [f32]) {
    for ((o, d), &v) in y.iter_mut().zip(dydx.iter_mut()).zip(x) {
        let (cdf, gauss) = normal_cdf_and_density(v);
        *o = v * cdf;
        *d = cdf + v * (gauss * INV_SQRT_2PI);
    }
}

multiversion!(fn gelu_kernel(x: &[f32], y: &mut [f32]) => gelu_body);
multiversion!(fn gelu_deriv_kernel(x: &[f32], y: &mut [f32], dydx: &mut [f32]) => gelu_deriv_body);

/// `y = gelu(x)`.
pub fn gelu_into(x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "gelu: input and output lengths");
    gelu_kernel(Isa::best(), x, y);
}

/// `y = gelu(x)`, `dydx = gelu'(x)`.
pub fn gelu_with_derivative_into(x: &[f32], y: &mut [f32], dydx: &mut [f32]) {
    assert!(
        x.len() == y.len() && x.len() == dydx.len(),
        "gelu: input and output lengths"
    );
    gelu_deriv_kernel(Isa::best(), x, y, dydx);
}

/// Which GELU a model uses: the exact erf form (PyTorch's `nn.GELU()`, our GPT) or the tanh
/// approximation (`gelu_new` of GPT-2 and `gelu_pytorch_tanh`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GeluForm {
    #[default]
    Erf,
    Tanh,
}

impl std::str::FromStr for GeluForm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "erf" => Ok(Self::Erf),
            "tanh" | "gelu_new" => Ok(Self::Tanh),
            _ => Err(format!("unknown GELU `{s}`: use erf or tanh")),
        }
    }
}

/// `sqrt(2/π)`, the tanh form's constant.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// `(σ(2u), du/dx)` for the tanh form, `u = sqrt(2/π)(x + 0.044715 x³)`:
/// `0.5 (1 + tanh u) = σ(2u)`, computed from `e^(-|2u|)` so that only non-positive values are
/// exponentiated and the left tail keeps its relative accuracy.
#[inline(always)]
fn tanh_gate(x: f32) -> (f32, f32) {
    let x2 = x * x;
    let z = 2.0 * SQRT_2_OVER_PI * (x + 0.044_715 * x2 * x);
    let e = exp_f32(-z.abs());
    let s = if z >= 0.0 {
        1.0 / (1.0 + e)
    } else {
        e / (1.0 + e)
    };
    (s, SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044_715 * x2))
}

#[inline(always)]
fn gelu_tanh_body(x: &[f32], y: &mut [f32]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o = v * tanh_gate(v).0;
    }
}

/// `y = x σ(2u)`, `dy/dx = σ(2u) + x σ(2u)(1 − σ(2u)) · 2 du/dx`.
#[inline(always)]
fn gelu_tanh_deriv_body(x: &[f32], y: &mut [f32], dydx: &mut [f32]) {
    for ((o, d), &v) in y.iter_mut().zip(dydx.iter_mut()).zip(x) {
        let (s, du) = tanh_gate(v);
        *o = v * s;
        *d = s + v * (s * (1.0 - s)) * (2.0 * du);
    }
}

multiversion!(fn gelu_tanh_kernel(x: &[f32], y: &mut [f32]) => gelu_tanh_body);
multiversion!(fn gelu_tanh_deriv_kernel(x: &[f32], y: &mut [f32], dydx: &mut [f32]) => gelu_tanh_deriv_body);

/// `y = gelu(x)` of `form`; with `dydx`, its derivative too (the same `y` bits).
pub fn gelu_form_into(form: GeluForm, x: &[f32], y: &mut [f32], dydx: Option<&mut [f32]>) {
    match (form, dydx) {
        (GeluForm::Erf, Some(d)) => gelu_with_derivative_into(x, y, d),
        (GeluForm::Erf, None) => gelu_into(x, y),
        (GeluForm::Tanh, Some(d)) => {
            assert!(
                x.len() == y.len() && x.len() == d.len(),
                "gelu: input and output lengths"
            );
            gelu_tanh_deriv_kernel(Isa::best(), x, y, d)
        }
        (GeluForm::Tanh, None) => {
            assert_eq!(x.len(), y.len(), "gelu: input and output lengths");
            gelu_tanh_kernel(Isa::best(), x, y)
        }
    }
}

/// `σ(x)` from `e^(-|x|)`, so only non-positive values are exponentiated and neither tail
/// overflows.
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    let e = exp_f32(-x.abs());
    if x >= 0.0 {
        1.0 / (1.0 + e)
    } else {
        e / (1.0 + e)
    }
}

#[inline(always)]
fn silu_body(x: &[f32], y: &mut [f32]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o = v * sigmoid(v);
    }
}

/// `y = x σ(x)`, `dy/dx = σ(x) (1 + x (1 − σ(x)))`.
#[inline(always)]
fn silu_deriv_body(x: &[f32], y: &mut [f32], dydx: &mut [f32]) {
    for ((o, d), &v) in y.iter_mut().zip(dydx.iter_mut()).zip(x) {
        let s = sigmoid(v);
        *o = v * s;
        *d = s * (1.0 + v * (1.0 - s));
    }
}

multiversion!(fn silu_kernel(x: &[f32], y: &mut [f32]) => silu_body);
multiversion!(fn silu_deriv_kernel(x: &[f32], y: &mut [f32], dydx: &mut [f32]) => silu_deriv_body);

/// SiLU (`swish`, Llama's MLP gate) into `y`; with `dydx`, its derivative too (the same `y`
/// bits).
pub fn silu_into(x: &[f32], y: &mut [f32], dydx: Option<&mut [f32]>) {
    assert_eq!(x.len(), y.len(), "silu: input and output lengths");
    match dydx {
        Some(d) => {
            assert_eq!(x.len(), d.len(), "silu: derivative length");
            silu_deriv_kernel(Isa::best(), x, y, d)
        }
        None => silu_kernel(Isa::best(), x, y),
    }
}

/// Causal softmax of rows `r0..r1` of a row-major `[t, t]` score block `p`, in place: row `i`
/// has live entries `0..=i`, which become `softmax(scale · s)`; entries `i+1..r1` become 0 (the
/// causal-block gemms read up to column `r1`); later columns are neither read nor written.
#[inline(always)]
fn softmax_rows_body(p: &mut [f32], t: usize, r0: usize, r1: usize, scale: f32) {
    for i in r0..r1 {
        let (live, masked) = p[i * t..i * t + r1].split_at_mut(i + 1);
        for s in live.iter_mut() {
            *s *= scale;
        }
        let max = lane_max(live);
        for s in live.iter_mut() {
            *s = exp_f32(*s - max);
        }
        let sum = lane_sum(live.len(), 0.0f32, |j| live[j]);
        let inv = 1.0 / sum;
        for s in live.iter_mut() {
            *s *= inv;
        }
        masked.fill(0.0);
    }
}

/// In place `dP → dS = scale · P ⊙ (dP - rowsum(P ⊙ dP))` over rows `r0..r1` of `[t, t]`
/// blocks, live entries only; masked entries `i+1..r1` become 0 like `P`'s.
#[inline(always)]
fn softmax_backward_rows_body(
    p: &[f32],
    dp: &mut [f32],
    t: usize,
    r0: usize,
    r1: usize,
    scale: f32,
) {
    for i in r0..r1 {
        let pr = &p[i * t..i * t + i + 1];
        let (dr, masked) = dp[i * t..i * t + r1].split_at_mut(i + 1);
        let dot = lane_sum(pr.len(), 0.0f32, |j| pr[j] * dr[j]);
        for (d, &pv) in dr.iter_mut().zip(pr) {
            *d = scale * pv * (*d - dot);
        }
        masked.fill(0.0);
    }
}

multiversion!(pub(crate) fn softmax_rows(p: &mut [f32], t: usize, r0: usize, r1: usize, scale: f32) => softmax_rows_body);
multiversion!(pub(crate) fn softmax_backward_rows(
    p: &[f32],
    dp: &mut [f32],
    t: usize,
    r0: usize,
    r1: usize,
    scale: f32,
) => softmax_backward_rows_body);

/// Cross-entropy of `logits: [n, vocab]` rows against `targets`: writes `softmax(row) / n - onehot / n`
/// into `grad` and returns the summed per-row loss `Σ (max + ln Σ e^(v - max) - row[t])` in f64.
/// One row of logits becomes its gradient `weight * (softmax - onehot(t))` in place; returns
/// the row's loss, unweighted. What the loss needs of the row is read before it is overwritten.
#[inline(always)]
fn softmax_row(g: &mut [f32], t: usize, vocab: usize, weight: f64) -> f64 {
    let max = lane_max(g);
    let target = g[t];
    for gv in g.iter_mut() {
        *gv = exp_f32(*gv - max);
    }
    let sum = lane_sum(vocab, 0.0f64, |j| g[j] as f64);
    let factor = (weight / sum) as f32;
    for gv in g.iter_mut() {
        *gv *= factor;
    }
    g[t] -= weight as f32;
    max as f64 + sum.ln() - target as f64
}

#[inline(always)]
fn cross_entropy_body(logits: &mut [f32], targets: &[u32], vocab: usize, total: &mut f64) {
    let inv_n = 1.0 / targets.len() as f64;
    let mut sum_loss = 0.0f64;
    for (g, &t) in logits.chunks_exact_mut(vocab).zip(targets) {
        sum_loss += softmax_row(g, t as usize, vocab, inv_n);
    }
    *total = sum_loss;
}

multiversion!(pub(crate) fn cross_entropy_kernel(
    logits: &mut [f32],
    targets: &[u32],
    vocab: usize,
    total: &mut f64,
) => cross_entropy_body);

/// [`cross_entropy_body`] with a weight per row: kept rows get `weight * (softmax - onehot)`
/// (the arithmetic of the unmasked body with `weight` for `1 / n`, so an all-kept mask with
/// weight `1 / n` gives its bits), dropped rows a zero gradient; `total` is the kept rows' summed
/// loss times `weight`.
#[inline(always)]
fn masked_cross_entropy_body(
    logits: &mut [f32],
    targets: &[u32],
    keep: &[bool],
    vocab: usize,
    weight: f64,
    total: &mut f64,
) {
    let mut sum_loss = 0.0f64;
    for ((g, &t), &kept) in logits.chunks_exact_mut(vocab).zip(targets).zip(keep) {
        if !kept {
            g.fill(0.0);
            continue;
        }
        sum_loss += softmax_row(g, t as usize, vocab, weight);
    }
    *total = sum_loss * weight;
}

multiversion!(pub(crate) fn masked_cross_entropy_kernel(
    logits: &mut [f32],
    targets: &[u32],
    keep: &[bool],
    vocab: usize,
    weight: f64,
    total: &mut f64,
) => masked_cross_entropy_body);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_f32_is_accurate() {
        let mut worst = 0.0f64;
        for i in -87_000..88_000 {
            let x = i as f32 / 1000.0 + 0.0003;
            let want = (x as f64).exp();
            worst = worst.max((exp_f32(x) as f64 / want - 1.0).abs());
        }
        assert!(worst < 4e-7, "worst relative error {worst:e}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!((exp_f32(-87.5), exp_f32(f32::NEG_INFINITY)), (0.0, 0.0));
        assert!(exp_f32(f32::NAN).is_nan());
    }

    #[test]
    fn normal_cdf_keeps_relative_accuracy_in_the_tail() {
        // Φ(x) from CPython: 0.5 * math.erfc(-x / math.sqrt(2)).
        let cases = [
            (-9.0, 1.1285884059538324e-19),
            (-6.0, 9.865876450376946e-10),
            (-3.0, 0.0013498980316301),
            (-1.0, 0.15865525393145707),
            (-0.1, 0.460172162722971),
            (0.0, 0.5),
            (0.3, 0.6179114221889527),
            (2.0, 0.9772498680518208),
        ];
        for (x, want) in cases {
            let (got, gauss) = normal_cdf_and_density(x);
            let rel = (got as f64 - want).abs() / want;
            assert!(rel < 5e-7, "Φ({x}) = {got}, want {want} (rel {rel:e})");
            let g_want = (-(x as f64).powi(2) / 2.0).exp();
            let rel = (gauss as f64 - g_want).abs() / g_want;
            assert!(rel < 5e-7, "e^(-x²/2) at {x}: {gauss} vs {g_want}");
        }
    }

    /// GPT-2's `gelu_new` written out in f64: `0.5 x (1 + tanh(sqrt(2/π)(x + 0.044715 x³)))`.
    #[test]
    fn tanh_gelu_matches_its_definition() {
        let x: Vec<f32> = (0..4001).map(|i| (i as f32 - 2000.0) * 0.005).collect();
        let (mut y, mut d) = (vec![0.0; x.len()], vec![0.0; x.len()]);
        gelu_form_into(GeluForm::Tanh, &x, &mut y, Some(&mut d));
        for ((&xv, &yv), &dv) in x.iter().zip(&y).zip(&d) {
            let v = xv as f64;
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let u = c * (v + 0.044715 * v * v * v);
            let want = 0.5 * v * (1.0 + u.tanh());
            let dwant = 0.5 * (1.0 + u.tanh())
                + 0.5 * v * (1.0 - u.tanh().powi(2)) * c * (1.0 + 3.0 * 0.044715 * v * v);
            assert!(
                (yv as f64 - want).abs() <= 2e-6 * (1.0 + want.abs()),
                "{xv}: {yv} vs {want}"
            );
            assert!(
                (dv as f64 - dwant).abs() <= 2e-6 * (1.0 + dwant.abs()),
                "{xv}: {dv} vs {dwant}"
            );
        }
    }

    #[test]
    fn kernels_agree_bit_for_bit_across_instruction_sets() {
        let n = 2000;
        let x: Vec<f32> = (0..n).map(|i| (i as f32 - 1000.0) * 0.0093).collect();
        let run = |isa: Isa| {
            let (mut y, mut y2, mut d) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            gelu_kernel(isa, &x, &mut y);
            gelu_deriv_kernel(isa, &x, &mut y2, &mut d);
            assert_eq!(y, y2, "forward and recompute must agree");
            let (mut yt, mut yt2, mut dt) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            gelu_tanh_kernel(isa, &x, &mut yt);
            gelu_tanh_deriv_kernel(isa, &x, &mut yt2, &mut dt);
            assert_eq!(yt, yt2, "tanh form: forward and recompute must agree");
            let t = 37;
            let mut p: Vec<f32> = x[..t * t].to_vec();
            softmax_rows(isa, &mut p, t, 0, t, 0.7);
            let mut dp: Vec<f32> = x[1..=t * t].to_vec();
            softmax_backward_rows(isa, &p, &mut dp, t, 0, t, 0.7);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            [
                bits(&y),
                bits(&d),
                bits(&p),
                bits(&dp),
                bits(&yt),
                bits(&dt),
            ]
        };
        let want = run(Isa::Portable);
        for isa in Isa::available() {
            assert_eq!(run(isa), want, "{isa:?}");
        }
    }

    #[test]
    fn lane_sum_order_is_fixed_by_length() {
        // 17 elements: lanes 0 gets elements 0 and 16, the rest one each.
        let x: Vec<f32> = (0..17).map(|i| 1.0 + i as f32 * 1e-7).collect();
        let want = {
            let mut acc: Vec<f32> = x[..16].to_vec();
            acc[0] += x[16];
            let mut w = 16;
            while w > 1 {
                w /= 2;
                for j in 0..w {
                    acc[j] += acc[j + w];
                }
            }
            acc[0]
        };
        assert_eq!(lane_sum(17, 0.0f32, |i| x[i]).to_bits(), want.to_bits());
        assert_eq!(lane_sum(0, 0.0f32, |i| x[i]), 0.0);
    }
}
