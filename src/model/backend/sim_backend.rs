//! The backend of `--device sim`: the CPU kernels, and a simulated device for each rank that
//! opens one (ranks in one process are one accelerator each).

use std::sync::Arc;

use super::device::Device;
use super::sim::{SimDevice, SimSpec};
use super::{Backend, GeluForm};
use crate::model::attention::AttnShape;
use crate::model::gemm::Layout;
use crate::model::ops::RopeTable;
use crate::optim::OptimSettings;

/// CPU kernels with a simulated device: bit for bit the host run's arithmetic.
#[derive(Debug)]
pub struct SimBackend {
    kernels: Arc<dyn Backend>,
    spec: SimSpec,
}

impl SimBackend {
    pub fn new(kernels: Arc<dyn Backend>, spec: SimSpec) -> Self {
        Self { kernels, spec }
    }

    pub fn spec(&self) -> SimSpec {
        self.spec
    }
}

impl Backend for SimBackend {
    fn name(&self) -> &str {
        self.kernels.name()
    }

    fn open_device(&self) -> Option<Arc<dyn Device>> {
        Some(Arc::new(SimDevice::new(self.spec)))
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
        self.kernels.gemm(a, la, b, lb, c, lc, acc);
    }

    fn layer_norm_forward(
        &self,
        x: &[f32],
        weight: &[f32],
        bias: &[f32],
        y: &mut [f32],
        stats: &mut [f32],
    ) {
        self.kernels.layer_norm_forward(x, weight, bias, y, stats);
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
        self.kernels
            .layer_norm_backward(x, stats, dy, weight, grad_weight, grad_bias, dx);
    }

    fn gelu(&self, form: GeluForm, x: &[f32], y: &mut [f32], dydx: Option<&mut [f32]>) {
        self.kernels.gelu(form, x, y, dydx);
    }

    fn rms_norm_forward(
        &self,
        x: &[f32],
        weight: &[f32],
        eps: f64,
        y: &mut [f32],
        inv: &mut [f32],
    ) {
        self.kernels.rms_norm_forward(x, weight, eps, y, inv);
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
        self.kernels
            .rms_norm_backward(x, inv, dy, weight, grad_weight, dx);
    }

    fn silu(&self, x: &[f32], y: &mut [f32], dydx: Option<&mut [f32]>) {
        self.kernels.silu(x, y, dydx);
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
        self.kernels.rope(x, width, seq, pos0, table, inverse);
    }

    fn attention_forward(
        &self,
        qkv: &[f32],
        s: AttnShape,
        y: &mut [f32],
        probs: &mut [f32],
        keep: bool,
    ) {
        self.kernels.attention_forward(qkv, s, y, probs, keep);
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
        self.kernels.attention_backward(qkv, probs, dy, s, dqkv, dp);
    }

    fn cross_entropy(&self, logits: &mut [f32], targets: &[u32], vocab: usize) -> f32 {
        self.kernels.cross_entropy(logits, targets, vocab)
    }

    fn embedding_forward(&self, table: &[f32], ids: &[u32], y: &mut [f32]) {
        self.kernels.embedding_forward(table, ids, y);
    }

    fn embedding_backward(&self, ids: &[u32], dy: &[f32], grad_table: &mut [f32]) {
        self.kernels.embedding_backward(ids, dy, grad_table);
    }

    fn add(&self, acc: &mut [f32], x: &[f32]) {
        self.kernels.add(acc, x);
    }

    fn mul(&self, acc: &mut [f32], x: &[f32]) {
        self.kernels.mul(acc, x);
    }

    fn broadcast_rows(&self, row: &[f32], y: &mut [f32]) {
        self.kernels.broadcast_rows(row, y);
    }

    fn sum_rows(&self, x: &[f32], acc: &mut [f32]) {
        self.kernels.sum_rows(x, acc);
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
        self.kernels.optimizer_update(settings, p, g, m, v, t, lr);
    }
}
