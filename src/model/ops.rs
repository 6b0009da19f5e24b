//! The CPU implementations of the models' operations, each forward with its backward on flat
//! row-major `f32` buffers, plus the helpers that cut a unit's flat parameter buffer into named
//! pieces. Models reach them through their backend (`backend::Cpu` runs these); the layers that
//! combine them are in `layers.rs`.
//!
//! Everything here is a pure function of its arguments, bit for bit, so that ranks that recompute
//! the same unit agree exactly (see the determinism contract in `model/mod.rs`):
//! - matrix products go through our single-threaded `gemm`, where every output element is one
//!   chain of FMAs along k whatever the kernel path (see `model/gemm`);
//! - every other reduction (layernorm statistics, softmax sums, cross-entropy) runs over a fixed
//!   number of lanes in a fixed order (`kernels::lane_sum`), in `f64` where it sums many terms;
//!   bias and embedding gradients add row after row;
//! - `exp` (softmax, cross-entropy, GELU) is our own polynomial, not the C library's, so it gives
//!   the same bits on every host; outside GEMM, Rust never fuses `a * b + c` into an FMA on its own, and
//!   the multiversioned elementwise kernels never enable FMA.
//!
//! The `*_into` forms write into caller-provided buffers (the models carve them from a reused
//! `workspace::Scratch`); the allocating forms wrap them for tests and simple callers.

use super::kernels::{
    cross_entropy_kernel, gelu_into, gelu_with_derivative_into, lane_sum,
    masked_cross_entropy_kernel,
};
use crate::optim::{multiversion, Isa};

pub(super) use super::gemm::{gemm, Layout};

// ---------------------------------------------------------------------------------------------
// Matrix products
// ---------------------------------------------------------------------------------------------

pub(super) fn check_len(what: &str, got: usize, want: usize) {
    assert_eq!(got, want, "{what}: length {got}, expected {want}");
}

/// Checks that row-major operands have exactly their shapes' lengths, then multiplies.
fn product(what: &str, a: &[f32], la: Layout, b: &[f32], lb: Layout, c: &mut [f32], acc: bool) {
    let lc = Layout::row_major(la.rows, lb.cols);
    let want = [la.rows * la.cols, lb.rows * lb.cols, lc.rows * lc.cols];
    assert_eq!(
        [a.len(), b.len(), c.len()],
        want,
        "{what}: lengths of A, B, C"
    );
    gemm(a, la, b, lb, c, lc, acc);
}

/// `C[m,n] (+)= A[m,k] · B[k,n]`: adds into `c` when `acc`, overwrites it otherwise.
pub fn matmul(a: &[f32], b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize, acc: bool) {
    let (la, lb) = (Layout::row_major(m, k), Layout::row_major(k, n));
    product("matmul", a, la, b, lb, c, acc);
}

/// `C[m,n] (+)= A[m,k] · B[n,k]ᵀ`.
pub fn matmul_nt(a: &[f32], b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize, acc: bool) {
    let (la, lb) = (
        Layout::row_major(m, k),
        Layout::row_major(n, k).transposed(),
    );
    product("matmul_nt", a, la, b, lb, c, acc);
}

/// `C[m,n] (+)= A[k,m]ᵀ · B[k,n]`.
pub fn matmul_tn(a: &[f32], b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize, acc: bool) {
    let (la, lb) = (
        Layout::row_major(k, m).transposed(),
        Layout::row_major(k, n),
    );
    product("matmul_tn", a, la, b, lb, c, acc);
}

/// `acc[i] += x[i]` (residual connections).
pub fn add_assign(acc: &mut [f32], x: &[f32]) {
    check_len("add_assign", x.len(), acc.len());
    for (a, &b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}

/// `acc[i] *= x[i]`.
pub fn mul_assign(acc: &mut [f32], x: &[f32]) {
    check_len("mul_assign", x.len(), acc.len());
    for (a, &b) in acc.iter_mut().zip(x) {
        *a *= b;
    }
}

// ---------------------------------------------------------------------------------------------
// Bias rows (a linear layer's bias and its gradient)
// ---------------------------------------------------------------------------------------------

/// Every row of `y` (rows of `row.len()`) set to `row`.
pub fn broadcast_rows(row: &[f32], y: &mut [f32]) {
    assert!(
        !row.is_empty() && y.len().is_multiple_of(row.len()),
        "broadcast_rows: output not a multiple of the row"
    );
    for r in y.chunks_exact_mut(row.len()) {
        r.copy_from_slice(row);
    }
}

/// `acc += Σ rows of x`, row after row.
pub fn sum_rows(x: &[f32], acc: &mut [f32]) {
    assert!(
        !acc.is_empty() && x.len().is_multiple_of(acc.len()),
        "sum_rows: input not a multiple of the row"
    );
    for r in x.chunks_exact(acc.len()) {
        add_assign(acc, r);
    }
}

// ---------------------------------------------------------------------------------------------
// LayerNorm
// ---------------------------------------------------------------------------------------------

/// PyTorch's `nn.LayerNorm` default epsilon.
pub const LN_EPS: f64 = 1e-5;

/// Mean and 1/std of one row; two passes in f64 (fixed lanes) so the variance does not cancel.
#[inline(always)]
fn row_stats(row: &[f32]) -> (f32, f32) {
    let n = row.len() as f64;
    let mean = lane_sum(row.len(), 0.0f64, |i| row[i] as f64) / n;
    let var = lane_sum(row.len(), 0.0f64, |i| {
        let c = row[i] as f64 - mean;
        c * c
    }) / n;
    (mean as f32, (1.0 / (var + LN_EPS).sqrt()) as f32)
}

#[inline(always)]
fn ln_forward_body(x: &[f32], w: &[f32], b: &[f32], y: &mut [f32], stats: &mut [f32]) {
    let d = w.len();
    for ((xr, yr), st) in x
        .chunks_exact(d)
        .zip(y.chunks_exact_mut(d))
        .zip(stats.chunks_exact_mut(2))
    {
        let (mean, rstd) = row_stats(xr);
        (st[0], st[1]) = (mean, rstd);
        for i in 0..d {
            yr[i] = (xr[i] - mean) * rstd * w[i] + b[i];
        }
    }
}

#[inline(always)]
fn ln_backward_body(
    x: &[f32],
    stats: &[f32],
    dy: &[f32],
    w: &[f32],
    grads: (&mut [f32], &mut [f32]),
    dx: &mut [f32],
) {
    let (grad_weight, grad_bias) = grads;
    let d = w.len();
    for (((xr, dyr), dxr), st) in x
        .chunks_exact(d)
        .zip(dy.chunks_exact(d))
        .zip(dx.chunks_exact_mut(d))
        .zip(stats.chunks_exact(2))
    {
        let (mean, rstd) = (st[0], st[1]);
        let xhat = |i: usize| (xr[i] - mean) * rstd;
        for i in 0..d {
            grad_weight[i] += dyr[i] * xhat(i);
            grad_bias[i] += dyr[i];
        }
        let sum_g = lane_sum(d, 0.0f64, |i| (dyr[i] * w[i]) as f64);
        let sum_gx = lane_sum(d, 0.0f64, |i| (dyr[i] * w[i]) as f64 * xhat(i) as f64);
        // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)): the two mean terms are the
        // gradient flowing through the row mean and the row variance.
        let (mg, mgx) = ((sum_g / d as f64) as f32, (sum_gx / d as f64) as f32);
        for i in 0..d {
            dxr[i] = rstd * (dyr[i] * w[i] - mg - xhat(i) * mgx);
        }
    }
}

multiversion!(fn ln_forward_kernel(
    x: &[f32],
    w: &[f32],
    b: &[f32],
    y: &mut [f32],
    stats: &mut [f32],
) => ln_forward_body);
multiversion!(fn ln_backward_kernel(
    x: &[f32],
    stats: &[f32],
    dy: &[f32],
    w: &[f32],
    grads: (&mut [f32], &mut [f32]),
    dx: &mut [f32],
) => ln_backward_body);

/// Row width of a layer norm over `weight`; checks `bias`, `x` and `stats` against it.
fn ln_dim(x: &[f32], weight: &[f32], bias: &[f32], stats: &[f32]) -> usize {
    let d = weight.len();
    check_len("layernorm bias", bias.len(), d);
    assert!(
        d > 0 && x.len().is_multiple_of(d),
        "layernorm input not a multiple of {d}"
    );
    check_len("layernorm stats", stats.len(), 2 * (x.len() / d));
    d
}

/// Layer norm over the last dimension (`weight.len()`), biased variance like PyTorch's
/// `nn.LayerNorm`: `y` (overwritten) and the row statistics (mean, 1/std per row) into `stats`
/// (`2 · rows`), which the backward reads instead of recomputing them.
pub fn layer_norm_forward(
    x: &[f32],
    weight: &[f32],
    bias: &[f32],
    y: &mut [f32],
    stats: &mut [f32],
) {
    ln_dim(x, weight, bias, stats);
    check_len("layernorm output", y.len(), x.len());
    ln_forward_kernel(Isa::best(), x, weight, bias, y, stats);
}

/// Adds the weight and bias gradients and writes `dL/dx` into `dx` (overwritten), given the
/// `stats` that [`layer_norm_forward`] wrote for this `x`.
pub fn layer_norm_backward(
    x: &[f32],
    stats: &[f32],
    dy: &[f32],
    weight: &[f32],
    grad_weight: &mut [f32],
    grad_bias: &mut [f32],
    dx: &mut [f32],
) {
    let d = weight.len();
    check_len("layernorm dy", dy.len(), x.len());
    check_len("layernorm dx", dx.len(), x.len());
    check_len("layernorm grad weight", grad_weight.len(), d);
    check_len("layernorm grad bias", grad_bias.len(), d);
    assert!(
        d > 0 && x.len().is_multiple_of(d),
        "layernorm input not a multiple of {d}"
    );
    check_len("layernorm stats", stats.len(), 2 * (x.len() / d));
    ln_backward_kernel(
        Isa::best(),
        x,
        stats,
        dy,
        weight,
        (grad_weight, grad_bias),
        dx,
    );
}

// ---------------------------------------------------------------------------------------------
// exp (f64, for sampling) and GELU
// ---------------------------------------------------------------------------------------------

/// `1/n!` for n = 0..=9: the Taylor coefficients of `e^r`.
const INV_FACTORIAL: [f64; 10] = [
    1.0,
    1.0,
    1.0 / 2.0,
    1.0 / 6.0,
    1.0 / 24.0,
    1.0 / 120.0,
    1.0 / 720.0,
    1.0 / 5_040.0,
    1.0 / 40_320.0,
    1.0 / 362_880.0,
];

/// `e^x` in f64 from arithmetic alone (the sampler's temperature softmax; the training ops use
/// the `f32` [`exp_f32`](super::kernels::exp_f32)): no libm, so the bits are the same on every
/// machine whatever its C library. Cody-Waite reduction `x = k ln2 + r`, `|r| <= ln2/2`, then a
/// degree-9 Taylor polynomial: relative error below 1e-11. Below -708 (where `e^x` stops being a
/// normal f64) it returns 0; above 709 it saturates at `e^709`.
#[inline(always)]
pub fn exp(x: f64) -> f64 {
    const LN2_HI: f64 = 0.693_147_180_369_123_8; // ln 2 to 32 bits: k · LN2_HI is exact
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    const SHIFT: f64 = 6_755_399_441_055_744.0; // 1.5 · 2^52: adding it rounds to an integer
    let xc = x.clamp(-708.0, 709.0);
    let shifted = xc * std::f64::consts::LOG2_E + SHIFT;
    let k = shifted - SHIFT;
    let r = (xc - k * LN2_HI) - k * LN2_LO;
    let p = INV_FACTORIAL.iter().rev().fold(0.0, |p, &c| p * r + c);
    let k_int = shifted.to_bits() as i64 - SHIFT.to_bits() as i64; // k, in [-1022, 1023]
    let y = p * f64::from_bits(((k_int + 1023) << 52) as u64);
    if x < -708.0 {
        0.0
    } else {
        y
    }
}

/// GELU, exact erf form (PyTorch's `nn.GELU()` default), in `f32`; see `kernels.rs`.
pub fn gelu_forward(x: &[f32]) -> Vec<f32> {
    let mut y = vec![0.0; x.len()];
    gelu_into(x, &mut y);
    y
}

/// GELU output and its derivative `Φ(x) + x φ(x)` in one pass, for backward's recomputation;
/// the output has exactly [`gelu_forward`]'s bits.
pub fn gelu_with_derivative(x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (mut y, mut dydx) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    gelu_with_derivative_into(x, &mut y, &mut dydx);
    (y, dydx)
}

/// `dL/dx` of GELU given its input and `dL/dy`.
pub fn gelu_backward(x: &[f32], dy: &[f32]) -> Vec<f32> {
    check_len("gelu dy", dy.len(), x.len());
    let (_, deriv) = gelu_with_derivative(x);
    deriv.iter().zip(dy).map(|(&g, &d)| g * d).collect()
}

// ---------------------------------------------------------------------------------------------
// Embedding and loss
// ---------------------------------------------------------------------------------------------

fn check_ids(what: &str, ids: &[u32], bound: usize) {
    if let Some((pos, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= bound) {
        panic!("{what}: id {id} at position {pos} is out of range (must be < {bound})");
    }
}

/// Rows `table[ids[i]]` of a `[rows, d]` table into `y` (`ids.len() · d`).
pub fn embedding_forward_into(table: &[f32], ids: &[u32], d: usize, y: &mut [f32]) {
    assert!(
        d > 0 && table.len().is_multiple_of(d),
        "embedding table not a multiple of {d}"
    );
    check_len("embedding output", y.len(), ids.len() * d);
    check_ids("embedding", ids, table.len() / d);
    for (&id, row) in ids.iter().zip(y.chunks_exact_mut(d)) {
        row.copy_from_slice(&table[id as usize * d..(id as usize + 1) * d]);
    }
}

/// Rows `table[ids[i]]` of a `[rows, d]` table, concatenated.
pub fn embedding_forward(table: &[f32], ids: &[u32], d: usize) -> Vec<f32> {
    let mut y = vec![0.0; ids.len() * d];
    embedding_forward_into(table, ids, d, &mut y);
    y
}

/// Adds `dy` rows into `grad_table[ids[i]]`, in position order (fixed summation order for
/// repeated ids).
pub fn embedding_backward(ids: &[u32], dy: &[f32], d: usize, grad_table: &mut [f32]) {
    assert!(
        d > 0 && grad_table.len().is_multiple_of(d),
        "embedding grad not a multiple of {d}"
    );
    check_len("embedding dy", dy.len(), ids.len() * d);
    check_ids("embedding", ids, grad_table.len() / d);
    for (&id, row) in ids.iter().zip(dy.chunks_exact(d)) {
        add_assign(&mut grad_table[id as usize * d..(id as usize + 1) * d], row);
    }
}

/// Mean softmax cross-entropy (nats) of `logits: [n, vocab]` against `targets: [n]`; the
/// logits are overwritten with its gradient with respect to them (a language model's logits
/// are its largest activation, so the gradient takes their place). Zero rows give loss 0.
///
/// # Panics
/// If a target is `>= vocab` or the lengths disagree.
pub fn cross_entropy_in_place(logits: &mut [f32], targets: &[u32], vocab: usize) -> f32 {
    check_len("cross_entropy logits", logits.len(), targets.len() * vocab);
    check_ids("cross_entropy target", targets, vocab);
    if targets.is_empty() {
        return 0.0;
    }
    let mut total = 0.0f64;
    cross_entropy_kernel(Isa::best(), logits, targets, vocab, &mut total);
    (total / targets.len() as f64) as f32
}

/// Cross-entropy of the rows `keep` marks, each weighing `weight`: returns their summed loss
/// times `weight`, and overwrites the logits with its gradient (zero on the dropped rows). With
/// every row kept and `weight = 1 / n` it is [`cross_entropy_in_place`], bit for bit.
///
/// # Panics
/// If a kept target is `>= vocab` or the lengths disagree.
pub fn masked_cross_entropy_in_place(
    logits: &mut [f32],
    targets: &[u32],
    keep: &[bool],
    vocab: usize,
    weight: f64,
) -> f64 {
    check_len("cross_entropy logits", logits.len(), targets.len() * vocab);
    check_len("cross_entropy mask", keep.len(), targets.len());
    check_ids("cross_entropy target", targets, vocab);
    let mut total = 0.0f64;
    masked_cross_entropy_kernel(
        Isa::best(),
        logits,
        targets,
        keep,
        vocab,
        weight,
        &mut total,
    );
    total
}

/// [`cross_entropy_in_place`] on a copy: the loss and the gradient (empty for zero rows).
pub fn cross_entropy(logits: &[f32], targets: &[u32], vocab: usize) -> (f32, Vec<f32>) {
    let mut grad = logits.to_vec();
    let loss = cross_entropy_in_place(&mut grad, targets, vocab);
    (loss, grad)
}

// ---------------------------------------------------------------------------------------------
// Unit buffers
// ---------------------------------------------------------------------------------------------

/// Cuts a unit's flat buffer into its `N` parameters, in order.
///
/// # Panics
/// If the lengths do not add up to `buf.len()` (a caller passing another unit's buffer).
pub fn split_params<const N: usize>(buf: &[f32], lens: [usize; N]) -> [&[f32]; N] {
    check_len("unit buffer", buf.len(), lens.iter().sum());
    let mut rest = buf;
    std::array::from_fn(|i| {
        let (head, tail) = rest.split_at(lens[i]);
        rest = tail;
        head
    })
}

/// Mutable twin of [`split_params`], for gradient buffers.
pub fn split_params_mut<const N: usize>(buf: &mut [f32], lens: [usize; N]) -> [&mut [f32]; N] {
    check_len("unit grad buffer", buf.len(), lens.iter().sum());
    let mut rest = buf;
    std::array::from_fn(|i| {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(lens[i]);
        rest = tail;
        head
    })
}

mod rms_norm;
mod rope;

pub use rms_norm::{rms_norm_backward, rms_norm_forward};
pub use rope::{rope_rotate, RopeTable};

#[cfg(test)]
mod tests;
