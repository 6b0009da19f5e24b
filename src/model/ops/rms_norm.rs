//! RMSNorm (Llama's `LlamaRMSNorm`): `y = w · x / sqrt(mean(x²) + eps)` per row, no mean
//! subtraction and no bias. The row statistic is summed in f64 over fixed lanes like the layer
//! norm's, so it is a pure function of the row whatever the instruction set.

use super::super::kernels::lane_sum;
use super::check_len;
use crate::optim::{multiversion, Isa};

/// 1/rms of one row: `1 / sqrt(mean(x²) + eps)`.
#[inline(always)]
fn inv_rms(row: &[f32], eps: f64) -> f32 {
    let ms = lane_sum(row.len(), 0.0f64, |i| {
        let v = row[i] as f64;
        v * v
    }) / row.len() as f64;
    (1.0 / (ms + eps).sqrt()) as f32
}

#[inline(always)]
fn rms_forward_body(x: &[f32], w: &[f32], eps: f64, y: &mut [f32], inv: &mut [f32]) {
    let d = w.len();
    for ((xr, yr), r) in x
        .chunks_exact(d)
        .zip(y.chunks_exact_mut(d))
        .zip(inv.iter_mut())
    {
        *r = inv_rms(xr, eps);
        // transformers normalises first, then scales: (x · r) · w.
        for i in 0..d {
            yr[i] = w[i] * (xr[i] * *r);
        }
    }
}

#[inline(always)]
fn rms_backward_body(
    x: &[f32],
    inv: &[f32],
    dy: &[f32],
    w: &[f32],
    grad_weight: &mut [f32],
    dx: &mut [f32],
) {
    let d = w.len();
    for (((xr, dyr), dxr), &r) in x
        .chunks_exact(d)
        .zip(dy.chunks_exact(d))
        .zip(dx.chunks_exact_mut(d))
        .zip(inv)
    {
        for i in 0..d {
            grad_weight[i] += dyr[i] * (xr[i] * r);
        }
        // dx = r · (g − n · mean(g · n)) with n = x·r, g = dy·w: the second term is the
        // gradient through the row's rms.
        let sum_gn = lane_sum(d, 0.0f64, |i| (dyr[i] * w[i]) as f64 * (xr[i] * r) as f64);
        let m = (sum_gn / d as f64) as f32;
        for i in 0..d {
            dxr[i] = r * (dyr[i] * w[i] - (xr[i] * r) * m);
        }
    }
}

multiversion!(fn rms_forward_kernel(
    x: &[f32],
    w: &[f32],
    eps: f64,
    y: &mut [f32],
    inv: &mut [f32],
) => rms_forward_body);
multiversion!(fn rms_backward_kernel(
    x: &[f32],
    inv: &[f32],
    dy: &[f32],
    w: &[f32],
    grad_weight: &mut [f32],
    dx: &mut [f32],
) => rms_backward_body);

fn rows(x: &[f32], weight: &[f32], inv: &[f32]) -> usize {
    let d = weight.len();
    assert!(
        d > 0 && x.len().is_multiple_of(d),
        "rmsnorm input not a multiple of {d}"
    );
    check_len("rmsnorm stats", inv.len(), x.len() / d);
    x.len() / d
}

/// RMSNorm over rows of `weight.len()`: `y` (overwritten) and each row's 1/rms into `inv`
/// (`rows`), which the backward reads.
pub fn rms_norm_forward(x: &[f32], weight: &[f32], eps: f64, y: &mut [f32], inv: &mut [f32]) {
    rows(x, weight, inv);
    check_len("rmsnorm output", y.len(), x.len());
    rms_forward_kernel(Isa::best(), x, weight, eps, y, inv);
}

/// Adds the weight gradient and writes `dL/dx` into `dx` (overwritten), given the `inv` that
/// [`rms_norm_forward`] wrote for this `x`.
pub fn rms_norm_backward(
    x: &[f32],
    inv: &[f32],
    dy: &[f32],
    weight: &[f32],
    grad_weight: &mut [f32],
    dx: &mut [f32],
) {
    rows(x, weight, inv);
    check_len("rmsnorm dy", dy.len(), x.len());
    check_len("rmsnorm dx", dx.len(), x.len());
    check_len("rmsnorm grad weight", grad_weight.len(), weight.len());
    rms_backward_kernel(Isa::best(), x, inv, dy, weight, grad_weight, dx);
}
