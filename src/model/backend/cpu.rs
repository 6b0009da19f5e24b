//! The reference backends: the crate's own CPU kernels (`model/ops`, `model/attention`,
//! `model/gemm`, `optim`), single-threaded per call except the optimizer's fixed split. `Cpu`
//! multiplies in f32; `CpuBf16` is the same except that every matrix product (the linear
//! layers' and attention's) takes bf16 operands with f32 accumulation (`gemm_bf16`).

use super::Backend;
use crate::model::attention::{
    attention_backward_from_probs, attention_forward_into, attention_forward_keep, AttnShape,
};
use crate::model::gemm::{gemm, gemm_bf16, Layout, Product};
use crate::model::kernels::{gelu_form_into, silu_into, GeluForm};
use crate::model::ops::{self, RopeTable};
use crate::optim::OptimSettings;

/// The CPU backend. Every kernel picks its instruction set at run time (`EZERO_GEMM` forces the
/// GEMM path) and gives the same bits on every path, so ranks on different CPUs agree.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cpu;

impl Backend for Cpu {
    fn name(&self) -> &str {
        "cpu"
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
        gemm(a, la, b, lb, c, lc, acc);
    }

    fn layer_norm_forward(
        &self,
        x: &[f32],
        weight: &[f32],
        bias: &[f32],
        y: &mut [f32],
        stats: &mut [f32],
    ) {
        ops::layer_norm_forward(x, weight, bias, y, stats);
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
        ops::layer_norm_backward(x, stats, dy, weight, grad_weight, grad_bias, dx);
    }

    fn gelu(&self, form: GeluForm, x: &[f32], y: &mut [f32], dydx: Option<&mut [f32]>) {
        gelu_form_into(form, x, y, dydx);
    }

    fn rms_norm_forward(
        &self,
        x: &[f32],
        weight: &[f32],
        eps: f64,
        y: &mut [f32],
        inv: &mut [f32],
    ) {
        ops::rms_norm_forward(x, weight, eps, y, inv);
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
        ops::rms_norm_backward(x, inv, dy, weight, grad_weight, dx);
    }

    fn silu(&self, x: &[f32], y: &mut [f32], dydx: Option<&mut [f32]>) {
        silu_into(x, y, dydx);
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
        ops::rope_rotate(x, width, seq, pos0, table, inverse);
    }

    fn attention_forward(
        &self,
        qkv: &[f32],
        s: AttnShape,
        y: &mut [f32],
        probs: &mut [f32],
        keep: bool,
    ) {
        if keep {
            attention_forward_keep(gemm, qkv, s, y, probs);
        } else {
            attention_forward_into(gemm, qkv, s, y, probs);
        }
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
        attention_backward_from_probs(gemm, qkv, probs, dy, s, dqkv, dp);
    }

    fn cross_entropy(&self, logits: &mut [f32], targets: &[u32], vocab: usize) -> f32 {
        ops::cross_entropy_in_place(logits, targets, vocab)
    }

    fn embedding_forward(&self, table: &[f32], ids: &[u32], y: &mut [f32]) {
        ops::embedding_forward_into(table, ids, row_width(y.len(), ids.len()), y);
    }

    fn embedding_backward(&self, ids: &[u32], dy: &[f32], grad_table: &mut [f32]) {
        ops::embedding_backward(ids, dy, row_width(dy.len(), ids.len()), grad_table);
    }

    fn add(&self, acc: &mut [f32], x: &[f32]) {
        ops::add_assign(acc, x);
    }

    fn mul(&self, acc: &mut [f32], x: &[f32]) {
        ops::mul_assign(acc, x);
    }

    fn broadcast_rows(&self, row: &[f32], y: &mut [f32]) {
        ops::broadcast_rows(row, y);
    }

    fn sum_rows(&self, x: &[f32], acc: &mut [f32]) {
        ops::sum_rows(x, acc);
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
        settings.update(p, g, m, v, t, lr);
    }
}

/// Width of the rows of an embedding call: `len / ids` (any positive width when there are no
/// ids, which moves nothing).
fn row_width(len: usize, ids: usize) -> usize {
    if ids == 0 {
        return 1;
    }
    assert!(
        len.is_multiple_of(ids) && len > 0,
        "embedding: {len} values for {ids} ids"
    );
    len / ids
}

/// The CPU backend under bf16 mixed precision: [`Cpu`] with every matrix product in bf16
/// (operands rounded to bf16, f32 accumulation, `vdpbf16ps` where the CPU has AVX512_BF16).
/// Everything else, the optimizer included, stays f32.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuBf16;

impl CpuBf16 {
    const MM: Product = gemm_bf16;
}

impl Backend for CpuBf16 {
    fn name(&self) -> &str {
        "cpu-bf16"
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
        Self::MM(a, la, b, lb, c, lc, acc);
    }

    fn layer_norm_forward(
        &self,
        x: &[f32],
        weight: &[f32],
        bias: &[f32],
        y: &mut [f32],
        stats: &mut [f32],
    ) {
        Cpu.layer_norm_forward(x, weight, bias, y, stats);
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
        Cpu.layer_norm_backward(x, stats, dy, weight, grad_weight, grad_bias, dx);
    }

    fn gelu(&self, form: GeluForm, x: &[f32], y: &mut [f32], dydx: Option<&mut [f32]>) {
        Cpu.gelu(form, x, y, dydx);
    }

    fn rms_norm_forward(
        &self,
        x: &[f32],
        weight: &[f32],
        eps: f64,
        y: &mut [f32],
        inv: &mut [f32],
    ) {
        Cpu.rms_norm_forward(x, weight, eps, y, inv);
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
        Cpu.rms_norm_backward(x, inv, dy, weight, grad_weight, dx);
    }

    fn silu(&self, x: &[f32], y: &mut [f32], dydx: Option<&mut [f32]>) {
        Cpu.silu(x, y, dydx);
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
        Cpu.rope(x, width, seq, pos0, table, inverse);
    }

    fn attention_forward(
        &self,
        qkv: &[f32],
        s: AttnShape,
        y: &mut [f32],
        probs: &mut [f32],
        keep: bool,
    ) {
        if keep {
            attention_forward_keep(Self::MM, qkv, s, y, probs);
        } else {
            attention_forward_into(Self::MM, qkv, s, y, probs);
        }
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
        attention_backward_from_probs(Self::MM, qkv, probs, dy, s, dqkv, dp);
    }

    fn cross_entropy(&self, logits: &mut [f32], targets: &[u32], vocab: usize) -> f32 {
        Cpu.cross_entropy(logits, targets, vocab)
    }

    fn embedding_forward(&self, table: &[f32], ids: &[u32], y: &mut [f32]) {
        Cpu.embedding_forward(table, ids, y);
    }

    fn embedding_backward(&self, ids: &[u32], dy: &[f32], grad_table: &mut [f32]) {
        Cpu.embedding_backward(ids, dy, grad_table);
    }

    fn add(&self, acc: &mut [f32], x: &[f32]) {
        Cpu.add(acc, x);
    }

    fn mul(&self, acc: &mut [f32], x: &[f32]) {
        Cpu.mul(acc, x);
    }

    fn broadcast_rows(&self, row: &[f32], y: &mut [f32]) {
        Cpu.broadcast_rows(row, y);
    }

    fn sum_rows(&self, x: &[f32], acc: &mut [f32]) {
        Cpu.sum_rows(x, acc);
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
        Cpu.optimizer_update(settings, p, g, m, v, t, lr);
    }
}
