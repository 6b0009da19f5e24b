//! A backend that counts the calls going through it and hands them to another backend: the
//! seam's test double. A model that trains the same bits on `Counting<Cpu>` as on `Cpu`, with
//! every operation it needs counted, cannot be computing around its backend.

use std::sync::atomic::{AtomicU64, Ordering};

use super::Backend;
use crate::model::attention::AttnShape;
use crate::model::gemm::Layout;
use crate::model::kernels::GeluForm;
use crate::model::ops::RopeTable;
use crate::optim::OptimSettings;

/// The operations of [`Backend`], one per method.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Op {
    Gemm,
    LayerNormForward,
    LayerNormBackward,
    Gelu,
    RmsNormForward,
    RmsNormBackward,
    Silu,
    Rope,
    AttentionForward,
    AttentionBackward,
    CrossEntropy,
    EmbeddingForward,
    EmbeddingBackward,
    Add,
    Mul,
    BroadcastRows,
    SumRows,
    OptimizerUpdate,
}

impl Op {
    pub const ALL: [Op; 18] = [
        Op::Gemm,
        Op::LayerNormForward,
        Op::LayerNormBackward,
        Op::Gelu,
        Op::RmsNormForward,
        Op::RmsNormBackward,
        Op::Silu,
        Op::Rope,
        Op::AttentionForward,
        Op::AttentionBackward,
        Op::CrossEntropy,
        Op::EmbeddingForward,
        Op::EmbeddingBackward,
        Op::Add,
        Op::Mul,
        Op::BroadcastRows,
        Op::SumRows,
        Op::OptimizerUpdate,
    ];
}

/// Counts every call by [`Op`], and the multiply-adds of the GEMMs, then calls `inner`.
#[derive(Debug, Default)]
pub struct Counting<B> {
    inner: B,
    calls: [AtomicU64; Op::ALL.len()],
    gemm_macs: AtomicU64,
}

impl<B: Backend> Counting<B> {
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            calls: Default::default(),
            gemm_macs: AtomicU64::new(0),
        }
    }

    /// Calls of `op` so far.
    pub fn calls(&self, op: Op) -> u64 {
        self.calls[op as usize].load(Ordering::Relaxed)
    }

    /// Multiply-adds of every GEMM so far (`m · k · n` each).
    pub fn gemm_macs(&self) -> u64 {
        self.gemm_macs.load(Ordering::Relaxed)
    }

    /// The operations never called so far.
    pub fn never_called(&self) -> Vec<Op> {
        Op::ALL
            .into_iter()
            .filter(|&op| self.calls(op) == 0)
            .collect()
    }

    fn count(&self, op: Op) -> &B {
        self.calls[op as usize].fetch_add(1, Ordering::Relaxed);
        &self.inner
    }
}

impl<B: Backend> Backend for Counting<B> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn open_device(&self) -> Option<std::sync::Arc<dyn super::Device>> {
        self.inner.open_device()
    }

    fn gemm(
        &self,
        a: &[f32],
        la: Layout,
        b: &[f32],
        lb: Layout,
        c: &mut [f32],
        lc: Layout,
        acc: bool,
    ) {
        let macs = (lc.rows * lc.cols * la.cols) as u64;
        self.gemm_macs.fetch_add(macs, Ordering::Relaxed);
        self.count(Op::Gemm).gemm(a, la, b, lb, c, lc, acc);
    }

    fn layer_norm_forward(
        &self,
        x: &[f32],
        weight: &[f32],
        bias: &[f32],
        y: &mut [f32],
        stats: &mut [f32],
    ) {
        self.count(Op::LayerNormForward)
            .layer_norm_forward(x, weight, bias, y, stats);
    }

    fn layer_norm_backward(
        &self,
        x: &[f32],
        stats: &[f32],
        dy: &[f32],
        weight: &[f32],
        grad_weight: &mut [f32],
        grad_bias: &mut [f32],
        dx: &mut [f32],
    ) {
        self.count(Op::LayerNormBackward).layer_norm_backward(
            x,
            stats,
            dy,
            weight,
            grad_weight,
            grad_bias,
            dx,
        );
    }

    fn gelu(&self, form: GeluForm, x: &[f32], y: &mut [f32], dydx: Option<&mut [f32]>) {
        self.count(Op::Gelu).gelu(form, x, y, dydx);
    }

    fn rms_norm_forward(
        &self,
        x: &[f32],
        weight: &[f32],
        eps: f64,
        y: &mut [f32],
        inv: &mut [f32],
    ) {
        self.count(Op::RmsNormForward)
            .rms_norm_forward(x, weight, eps, y, inv);
    }

    fn rms_norm_backward(
        &self,
        x: &[f32],
        inv: &[f32],
        dy: &[f32],
        weight: &[f32],
        grad_weight: &mut [f32],
        dx: &mut [f32],
    ) {
        self.count(Op::RmsNormBackward)
            .rms_norm_backward(x, inv, dy, weight, grad_weight, dx);
    }

    fn silu(&self, x: &[f32], y: &mut [f32], dydx: Option<&mut [f32]>) {
        self.count(Op::Silu).silu(x, y, dydx);
    }

    fn rope(
        &self,
        x: &mut [f32],
        width: usize,
        seq: usize,
        pos0: usize,
        table: &RopeTable,
        inverse: bool,
    ) {
        self.count(Op::Rope)
            .rope(x, width, seq, pos0, table, inverse);
    }

    fn attention_forward(
        &self,
        qkv: &[f32],
        s: AttnShape,
        y: &mut [f32],
        probs: &mut [f32],
        keep: bool,
    ) {
        self.count(Op::AttentionForward)
            .attention_forward(qkv, s, y, probs, keep);
    }

    fn attention_backward(
        &self,
        qkv: &[f32],
        probs: &[f32],
        dy: &[f32],
        s: AttnShape,
        dqkv: &mut [f32],
        dp: &mut [f32],
    ) {
        self.count(Op::AttentionBackward)
            .attention_backward(qkv, probs, dy, s, dqkv, dp);
    }

    fn cross_entropy(&self, logits: &mut [f32], targets: &[u32], vocab: usize) -> f32 {
        self.count(Op::CrossEntropy)
            .cross_entropy(logits, targets, vocab)
    }

    fn embedding_forward(&self, table: &[f32], ids: &[u32], y: &mut [f32]) {
        self.count(Op::EmbeddingForward)
            .embedding_forward(table, ids, y);
    }

    fn embedding_backward(&self, ids: &[u32], dy: &[f32], grad_table: &mut [f32]) {
        self.count(Op::EmbeddingBackward)
            .embedding_backward(ids, dy, grad_table);
    }

    fn add(&self, acc: &mut [f32], x: &[f32]) {
        self.count(Op::Add).add(acc, x);
    }

    fn mul(&self, acc: &mut [f32], x: &[f32]) {
        self.count(Op::Mul).mul(acc, x);
    }

    fn broadcast_rows(&self, row: &[f32], y: &mut [f32]) {
        self.count(Op::BroadcastRows).broadcast_rows(row, y);
    }

    fn sum_rows(&self, x: &[f32], acc: &mut [f32]) {
        self.count(Op::SumRows).sum_rows(x, acc);
    }

    fn optimizer_update(
        &self,
        settings: &OptimSettings,
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        t: u64,
        lr: f32,
    ) {
        self.count(Op::OptimizerUpdate)
            .optimizer_update(settings, p, g, m, v, t, lr);
    }
}
