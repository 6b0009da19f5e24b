//! The compute seam: every kernel a model runs, behind one interface.
//!
//! The built-in models (and models written outside the crate, see `examples/custom_model.rs`)
//! never call a kernel directly; they call their [`Backend`], and the runtime updates shards
//! with the model's backend too ([`Backend::optimizer_update`]). [`Cpu`] is the reference
//! implementation, [`Counting`] wraps any backend and counts what goes through it (tests use it
//! to prove that nothing goes around the seam).
//!
//! The contract every implementation keeps is the one exact reduction relies on (see
//! `model/mod.rs`): each method is a pure function of its arguments, bit for bit, whichever thread
//! or rank calls it. A backend that reorders a sum must not be mixed with another backend in one
//! run: ranks would disagree.
//!
//! The operations take host slices. A backend with an accelerator also opens a [`Device`]
//! ([`Backend::open_device`], an optional capability: the CPU backend has none): device buffers
//! under a hard capacity, copies each way on a copy queue, and events compute waits on. The step
//! puts a unit's parameters on the device before its kernels run and takes its gradients off
//! after (`runtime::step::exec`), and the kernels read and write device memory through
//! [`Device::with_view`]; [`SimBackend`] is the reference (CPU kernels, a simulated device).
//! Models only name operations, whichever backend runs them.
//!
//! Design: docs/models.md (the compute seam).

mod counting;
mod cpu;
pub mod device;
pub mod sim;
mod sim_backend;

pub use counting::{Counting, Op};
pub use cpu::{Cpu, CpuBf16};
pub use device::{Device, DeviceBuffer, DeviceCounters, DeviceError, DeviceKind, Event, HostData};
pub use sim::{SimDevice, SimSpec};
pub use sim_backend::SimBackend;

use std::fmt;
use std::sync::Arc;

use super::attention::AttnShape;
use super::gemm::Layout;
pub use super::kernels::GeluForm;
use super::ops::RopeTable;
use crate::optim::OptimSettings;

/// The operations a model's forward, backward and loss are made of, and the optimizer update.
///
/// Lengths are checked by the implementation; a mismatch is a bug in the caller and panics with
/// the operation's name.
pub trait Backend: Send + Sync + fmt::Debug {
    /// A short name for logs and the JSON summary (`cpu`).
    fn name(&self) -> &str;

    /// A fresh handle on this backend's accelerator for one rank, if it has one. The default,
    /// and the CPU backend: none (its buffers are host memory and nothing is copied).
    fn open_device(&self) -> Option<Arc<dyn Device>> {
        None
    }

    /// `C (+)= op(A) · op(B)` over the windows `la`, `lb`, `lc` (see [`Layout`]): adds into `c`
    /// when `acc`, overwrites it otherwise.
    #[allow(clippy::too_many_arguments)] // three operands with their layouts, and the mode
    fn gemm(
        &self,
        a: &[f32],
        la: Layout,
        b: &[f32],
        lb: Layout,
        c: &mut [f32],
        lc: Layout,
        acc: bool,
    );

    /// Layer norm over rows of `weight.len()`: `y` (overwritten) and each row's mean and 1/std
    /// into `stats` (`2 · rows`).
    fn layer_norm_forward(
        &self,
        x: &[f32],
        weight: &[f32],
        bias: &[f32],
        y: &mut [f32],
        stats: &mut [f32],
    );

    /// Adds the weight and bias gradients, writes `dL/dx` into `dx` (overwritten), given the
    /// `stats` the forward wrote for this `x`.
    #[allow(clippy::too_many_arguments)] // the forward's inputs, dy, and three outputs
    fn layer_norm_backward(
        &self,
        x: &[f32],
        stats: &[f32],
        dy: &[f32],
        weight: &[f32],
        grad_weight: &mut [f32],
        grad_bias: &mut [f32],
        dx: &mut [f32],
    );

    /// GELU of `form` into `y`; with `dydx`, its derivative too (the same `y` bits).
    fn gelu(&self, form: GeluForm, x: &[f32], y: &mut [f32], dydx: Option<&mut [f32]>);

    /// RMSNorm over rows of `weight.len()` with `eps` inside the root: `y` (overwritten) and
    /// each row's 1/rms into `inv` (`rows`).
    fn rms_norm_forward(&self, x: &[f32], weight: &[f32], eps: f64, y: &mut [f32], inv: &mut [f32]);

    /// Adds the weight gradient and writes `dL/dx` into `dx` (overwritten), given the `inv` the
    /// forward wrote for this `x`.
    fn rms_norm_backward(
        &self,
        x: &[f32],
        inv: &[f32],
        dy: &[f32],
        weight: &[f32],
        grad_weight: &mut [f32],
        dx: &mut [f32],
    );

    /// SiLU into `y`; with `dydx`, its derivative too (the same `y` bits).
    fn silu(&self, x: &[f32], y: &mut [f32], dydx: Option<&mut [f32]>);

    /// Rotary embedding of every head of every row of `x` (rows of `width`) in place, by the
    /// angles of `table`: row `r` at position `r % seq`, or `pos0 + r` when `seq` is 0. With
    /// `inverse`, the opposite rotation (the backward).
    fn rope(
        &self,
        x: &mut [f32],
        width: usize,
        seq: usize,
        pos0: usize,
        table: &RopeTable,
        inverse: bool,
    );

    /// Causal self-attention on the fused `qkv` projection into `y`. With `keep`, every head's
    /// probabilities go to `probs` (`s.probs_len()`) for [`attention_backward`]; without, `probs`
    /// is scratch of at least `seq²`.
    ///
    /// [`attention_backward`]: Backend::attention_backward
    fn attention_forward(
        &self,
        qkv: &[f32],
        s: AttnShape,
        y: &mut [f32],
        probs: &mut [f32],
        keep: bool,
    );

    /// `dL/dqkv` (overwritten) from the kept probabilities and `dL/dy`; `dp` is scratch of at
    /// least `seq²`.
    fn attention_backward(
        &self,
        qkv: &[f32],
        probs: &[f32],
        dy: &[f32],
        s: AttnShape,
        dqkv: &mut [f32],
        dp: &mut [f32],
    );

    /// Mean softmax cross-entropy of `logits: [n, vocab]` against `targets`; the logits are
    /// overwritten with its gradient. Zero rows give 0.
    fn cross_entropy(&self, logits: &mut [f32], targets: &[u32], vocab: usize) -> f32;

    /// Rows `table[ids[i]]` of a `[rows, y.len() / ids.len()]` table into `y`.
    fn embedding_forward(&self, table: &[f32], ids: &[u32], y: &mut [f32]);

    /// Adds row `i` of `dy` into row `ids[i]` of `grad_table`, in position order.
    fn embedding_backward(&self, ids: &[u32], dy: &[f32], grad_table: &mut [f32]);

    /// `acc[i] += x[i]` (residual connections, gradient sums).
    fn add(&self, acc: &mut [f32], x: &[f32]);

    /// `acc[i] *= x[i]` (the chain rule through an elementwise function).
    fn mul(&self, acc: &mut [f32], x: &[f32]);

    /// Every row of `y` (rows of `row.len()`) set to `row` (a bias before a product adds in).
    fn broadcast_rows(&self, row: &[f32], y: &mut [f32]);

    /// `acc += Σ rows of x`, row after row (a bias gradient).
    fn sum_rows(&self, x: &[f32], acc: &mut [f32]);

    /// One optimizer update of a shard: parameters `p` with gradient `g`, state `m`, `v` (empty
    /// where the optimizer keeps none), 1-based step `t`, learning rate `lr`.
    #[allow(clippy::too_many_arguments)] // the four arrays plus the step's inputs
    fn optimizer_update(
        &self,
        settings: &OptimSettings,
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        t: u64,
        lr: f32,
    );
}

/// The reference CPU backend, for models and callers that do not choose one.
pub static CPU: Cpu = Cpu;

/// The arithmetic of the model's compute: what `precision` in the config chooses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in f32.
    #[default]
    Fp32,
    /// Mixed precision: the model computes with bf16 parameters (ZeRO-3 gathers them as bf16)
    /// and bf16 matrix-product operands, accumulating in f32; master weights, optimizer state
    /// and the exact gradient reduction stay as in f32 training.
    Bf16,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
        }
    }

    /// Bytes of one parameter as the model sees it (and as ZeRO-3 gathers it).
    pub fn param_bytes(self) -> u64 {
        match self {
            Precision::Fp32 => 4,
            Precision::Bf16 => 2,
        }
    }

    /// The CPU backend of this precision.
    pub fn cpu_backend(self) -> Arc<dyn Backend> {
        match self {
            Precision::Fp32 => Arc::new(Cpu),
            Precision::Bf16 => Arc::new(CpuBf16),
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fp32" => Ok(Precision::Fp32),
            "bf16" => Ok(Precision::Bf16),
            other => Err(format!("'{other}' is not a precision: use fp32 or bf16")),
        }
    }
}
