//! Causal multi-head self-attention on the fused `qkv` projection, computed per (batch row,
//! head) with strided gemms that skip the masked upper triangle. The products go through the
//! `Product` the backend passes (the f32 GEMM, or the bf16 one under mixed precision).
//!
//! Rows are processed in blocks of [`BLOCK`] queries: block `r0..r1` only needs keys `0..r1`,
//! so the score, `P·V`, `dP` and `dQ` products cover the causal lower triangle plus the diagonal
//! blocks (about 5/8 of the square at seq 128), and the `dV`/`dK` products are cut the same way
//! by columns. Every (batch row, head) is computed alone, in the same order, by the same code on
//! every rank, so the result is a pure function of the inputs; the blocking depends only on the
//! sequence length.

use super::gemm::Product;
use super::kernels::{softmax_backward_rows, softmax_rows};
use super::ops::{check_len, gemm, Layout};
use crate::optim::Isa;

/// Queries per causal block.
const BLOCK: usize = 32;

/// `(start, end)` of each block of `BLOCK` rows (the last one shorter) in `0..t`.
fn blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t)
        .step_by(BLOCK)
        .map(move |r0| (r0, (r0 + BLOCK).min(t)))
}

/// Shape of a causal self-attention call. Its input is the fused `qkv` projection
/// `[batch, seq, 3·d_model]` (q, k, v blocks in that order along the last axis, each split into
/// `heads` contiguous head slices, as PyTorch's `split(C, dim=2)` + `view(B, T, h, C/h)`); its
/// output is `[batch, seq, d_model]` with heads concatenated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub batch: usize,
    pub seq: usize,
    pub d_model: usize,
    pub heads: usize,
}

impl AttnShape {
    pub fn new(batch: usize, seq: usize, d_model: usize, heads: usize) -> Self {
        Self {
            batch,
            seq,
            d_model,
            heads,
        }
    }

    fn head_dim(&self) -> usize {
        assert!(
            self.heads > 0 && self.d_model.is_multiple_of(self.heads),
            "attention: heads {} must divide d_model {}",
            self.heads,
            self.d_model
        );
        self.d_model / self.heads
    }

    /// SDPA's default scale, 1/sqrt(head_dim).
    fn scale(&self) -> f32 {
        1.0 / (self.head_dim() as f32).sqrt()
    }

    /// Length of the probabilities of every (batch row, head): `batch · heads · seq²`.
    pub fn probs_len(&self) -> usize {
        self.batch * self.heads * self.seq * self.seq
    }

    /// The q, k and v matrices `[seq, head_dim]` of (batch row `b`, head `h`) inside `qkv`.
    fn qkv_views(&self, b: usize, h: usize) -> [Layout; 3] {
        let (d, hd) = (self.d_model, self.head_dim());
        let row0 = b * self.seq * 3 * d + h * hd;
        std::array::from_fn(|part| Layout::strided(row0 + part * d, self.seq, hd, 3 * d))
    }

    /// The `[seq, head_dim]` output block of (batch row `b`, head `h`).
    fn out_view(&self, b: usize, h: usize) -> Layout {
        let (d, hd) = (self.d_model, self.head_dim());
        Layout::strided(b * self.seq * d + h * hd, self.seq, hd, d)
    }

    fn check(&self, qkv: &[f32]) {
        check_len(
            "attention qkv",
            qkv.len(),
            self.batch * self.seq * 3 * self.d_model,
        );
    }
}

/// Rows `r0..r1` of a strided matrix.
fn rows(l: Layout, r0: usize, r1: usize) -> Layout {
    Layout {
        offset: l.offset + r0 * l.row_stride,
        rows: r1 - r0,
        ..l
    }
}

/// The `[r1 - r0, c1 - c0]` window of a row-major `[t, t]` matrix.
fn window(t: usize, r0: usize, r1: usize, c0: usize, c1: usize) -> Layout {
    Layout::strided(r0 * t + c0, r1 - r0, c1 - c0, t)
}

/// Causal `P = softmax(scale · q kᵀ)` of one (batch row, head) into the `[t, t]` block `p`.
/// Only the lower triangle and the diagonal blocks are written (masked entries there are 0);
/// entries right of a row's block are left as they were and never read.
fn causal_probs(
    mm: Product,
    isa: Isa,
    qkv: &[f32],
    q: Layout,
    k: Layout,
    scale: f32,
    p: &mut [f32],
) {
    let t = q.rows;
    for (r0, r1) in blocks(t) {
        let keys = Layout { rows: r1, ..k }.transposed();
        mm(
            qkv,
            rows(q, r0, r1),
            qkv,
            keys,
            p,
            window(t, r0, r1, 0, r1),
            false,
        );
        softmax_rows(isa, p, t, r0, r1, scale);
    }
}

/// `y[b, :, h] = P v` for every (batch row, head); stores every head's `P` in `probs`
/// (`[batch, heads, t, t]`) when given, for the backward, or uses `probs` as a `[t, t]` scratch.
fn forward_impl(
    mm: Product,
    qkv: &[f32],
    s: AttnShape,
    y: &mut [f32],
    probs: &mut [f32],
    keep: bool,
) {
    s.check(qkv);
    check_len("attention output", y.len(), s.batch * s.seq * s.d_model);
    let (t, scale, isa) = (s.seq, s.scale(), Isa::best());
    let per_head = t * t;
    let need = if keep { s.probs_len() } else { per_head };
    assert!(
        probs.len() >= need,
        "attention: probability buffer too short"
    );
    for b in 0..s.batch {
        for h in 0..s.heads {
            let [q, k, v] = s.qkv_views(b, h);
            let slot = if keep { b * s.heads + h } else { 0 };
            let p = &mut probs[slot * per_head..(slot + 1) * per_head];
            causal_probs(mm, isa, qkv, q, k, scale, p);
            let out = s.out_view(b, h);
            for (r0, r1) in blocks(t) {
                let vals = Layout { rows: r1, ..v };
                let pw = window(t, r0, r1, 0, r1);
                mm(p, pw, qkv, vals, y, rows(out, r0, r1), false); // y = P v
            }
        }
    }
}

/// Forward into `y: [batch, seq, d_model]`, using `scratch` (at least `seq²`) for `P`.
pub fn attention_forward_into(
    mm: Product,
    qkv: &[f32],
    s: AttnShape,
    y: &mut [f32],
    scratch: &mut [f32],
) {
    forward_impl(mm, qkv, s, y, scratch, false);
}

/// Forward into `y`, keeping every head's `P` in `probs` (`s.probs_len()`) for
/// [`attention_backward_from_probs`].
pub fn attention_forward_keep(
    mm: Product,
    qkv: &[f32],
    s: AttnShape,
    y: &mut [f32],
    probs: &mut [f32],
) {
    forward_impl(mm, qkv, s, y, probs, true);
}

/// `dL/dqkv` into `dqkv` (fully overwritten) given the forward input, the `P` kept by
/// [`attention_forward_keep`] and `dL/dy`; `dp` is a scratch of at least `seq²`.
pub fn attention_backward_from_probs(
    mm: Product,
    qkv: &[f32],
    probs: &[f32],
    dy: &[f32],
    s: AttnShape,
    dqkv: &mut [f32],
    dp: &mut [f32],
) {
    s.check(qkv);
    check_len("attention dy", dy.len(), s.batch * s.seq * s.d_model);
    check_len("attention dqkv", dqkv.len(), qkv.len());
    check_len("attention probs", probs.len(), s.probs_len());
    let (t, scale, isa) = (s.seq, s.scale(), Isa::best());
    let per_head = t * t;
    assert!(dp.len() >= per_head, "attention: dP scratch too short");
    let dp = &mut dp[..per_head];
    for b in 0..s.batch {
        for h in 0..s.heads {
            let [q, k, v] = s.qkv_views(b, h);
            let dyv = s.out_view(b, h);
            let slot = b * s.heads + h;
            let p = &probs[slot * per_head..(slot + 1) * per_head];
            for (r0, r1) in blocks(t) {
                // dP = dY vᵀ (live blocks), then dS in place.
                let vals = Layout { rows: r1, ..v }.transposed();
                mm(
                    dy,
                    rows(dyv, r0, r1),
                    qkv,
                    vals,
                    dp,
                    window(t, r0, r1, 0, r1),
                    false,
                );
                softmax_backward_rows(isa, p, dp, t, r0, r1, scale);
            }
            for (c0, c1) in blocks(t) {
                // Keys c0..c1 are seen by queries c0..t only.
                let pt = window(t, c0, t, c0, c1).transposed();
                mm(p, pt, dy, rows(dyv, c0, t), dqkv, rows(v, c0, c1), false); // dv = Pᵀ dY
                mm(dp, pt, qkv, rows(q, c0, t), dqkv, rows(k, c0, c1), false);
                // dk = dSᵀ q
            }
            for (r0, r1) in blocks(t) {
                let keys = Layout { rows: r1, ..k };
                let dsw = window(t, r0, r1, 0, r1);
                mm(dp, dsw, qkv, keys, dqkv, rows(q, r0, r1), false); // dq = dS k
            }
        }
    }
}

/// One query row's attention over cached keys and values (incremental decoding): `q` is one
/// head (`head_dim` wide); the head's key and value of position `t` are
/// `keys[t·stride + offset..][..head_dim]` (likewise `values`), for every cached position;
/// the softmax-weighted sum of the values goes to `out`. Scaled by 1/sqrt(head_dim) like the
/// full forward; summed in position order (not the blocked order of the full forward, so equal
/// to it up to rounding).
pub(crate) fn attend_cached(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    stride: usize,
    offset: usize,
    out: &mut [f32],
) {
    let hd = q.len();
    let n = keys.len() / stride;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut p = vec![0f32; n];
    let mut max = f32::NEG_INFINITY;
    for (t, pt) in p.iter_mut().enumerate() {
        let k = &keys[t * stride + offset..][..hd];
        *pt = scale * q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>();
        max = max.max(*pt);
    }
    let mut sum = 0.0;
    for pt in p.iter_mut() {
        *pt = (*pt - max).exp();
        sum += *pt;
    }
    out.fill(0.0);
    for (t, pt) in p.iter().enumerate() {
        let v = &values[t * stride + offset..][..hd];
        for (o, vv) in out.iter_mut().zip(v) {
            *o += pt / sum * vv;
        }
    }
}

/// Allocating forward (tests and simple callers).
pub fn attention_forward(qkv: &[f32], s: AttnShape) -> Vec<f32> {
    let mut y = vec![0.0; s.batch * s.seq * s.d_model];
    let mut p = vec![0.0; s.seq * s.seq];
    attention_forward_into(gemm, qkv, s, &mut y, &mut p);
    y
}

/// `dL/dqkv` given the forward input `qkv` and `dL/dy`, recomputing `P`.
pub fn attention_backward(qkv: &[f32], dy: &[f32], s: AttnShape) -> Vec<f32> {
    let mut y = vec![0.0; s.batch * s.seq * s.d_model];
    let mut probs = vec![0.0; s.probs_len()];
    attention_forward_keep(gemm, qkv, s, &mut y, &mut probs);
    let mut dqkv = vec![0.0; qkv.len()];
    let mut dp = vec![0.0; s.seq * s.seq];
    attention_backward_from_probs(gemm, qkv, &probs, dy, s, &mut dqkv, &mut dp);
    dqkv
}
