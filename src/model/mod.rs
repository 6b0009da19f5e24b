//! The model boundary: what the runtime needs to know about a model to shard and train it.
//!
//! A model is a chain of *units* (embedding, one per transformer block, the head). Each unit's
//! parameters are one flat `f32` buffer (its parameters concatenated in `UnitSpec::params` order),
//! which is what the shard planner cuts into chunks. The runtime supplies a unit's *full*
//! parameters (gathered for ZeRO-3) to `forward` and `backward`; the model never sees shards.
//!
//! Kernels run on the model's [`Backend`] (the compute seam, `backend/`); the built-in models
//! take one at construction and default to the CPU reference.
//!
//! Determinism contract (exact reduction relies on it): `forward`, `backward` and `loss` are pure
//! functions of their arguments, bit for bit, whichever thread or rank calls them. Implementations
//! must not use thread pools whose reduction order depends on the number of threads.
//!
//! Design: docs/models.md.

pub mod attention;
pub mod backend;
pub mod gemm;
pub mod gpt;
pub mod kernels;
pub mod layers;
pub mod llama;
pub mod mlp;
pub mod ops;
pub mod rng;
pub mod sample;
pub mod tie;
pub mod weights;
pub(crate) mod workspace;

use backend::Backend;

/// One named parameter inside a unit's flat buffer.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ParamSpec {
    /// Fully qualified name, e.g. `blocks.0.attn.qkv.weight` (used by checkpoint export).
    pub name: String,
    pub shape: Vec<usize>,
}

impl ParamSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A unit: the granularity at which ZeRO-3 gathers and frees parameters.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct UnitSpec {
    pub name: String,
    pub params: Vec<ParamSpec>,
}

impl UnitSpec {
    pub fn numel(&self) -> usize {
        self.params.iter().map(ParamSpec::numel).sum()
    }
}

/// One micro-batch of token ids, `batch` rows of `seq` tokens; `targets` are the next tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MicroBatch {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
    pub batch: usize,
    pub seq: usize,
    /// Which targets the loss counts (instruction data); `None`: every target, each weighing
    /// `1 / (batch * seq)` of the micro-batch's loss.
    pub loss_mask: Option<LossMask>,
}

/// The targets a masked micro-batch trains on, and the step's count that normalizes them.
///
/// The step's loss is the mean over the unmasked targets of all its micro-batches, so each
/// unmasked target weighs `micro_batches / step_tokens` in its micro-batch's loss: the runtime's
/// mean over the micro-batches then divides by `micro_batches` again. Both counts are pure
/// functions of the data and the step, so every rank computes the same weight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LossMask {
    /// One flag per target (`batch * seq`): true where the loss counts it.
    pub keep: Vec<bool>,
    /// Unmasked targets in the whole step (every micro-batch), at least 1.
    pub step_tokens: u64,
    /// Micro-batches in the step.
    pub micro_batches: u32,
}

impl LossMask {
    /// The weight of one unmasked target in its micro-batch's loss.
    pub fn weight(&self) -> f64 {
        f64::from(self.micro_batches) / self.step_tokens.max(1) as f64
    }
}

/// Intermediates a unit's forward kept for its backward (`Model::forward_keep`), opaque to the
/// runtime except for their size, which the memory ledger counts as activations.
pub struct Kept {
    pub bytes: u64,
    pub data: Box<dyn std::any::Any + Send>,
}

/// A model the runtime can train with any ZeRO stage.
///
/// Activations between units are flat `f32` buffers whose layout is the model's business. The
/// first unit receives an empty `x` and reads `mb.inputs`; the last unit's output is the logits,
/// `[batch, seq, vocab()]` row-major, and goes to `loss`.
pub trait Model: Send + Sync + 'static {
    /// Units in execution order, with their parameter shapes.
    fn units(&self) -> Vec<UnitSpec>;

    /// Initial parameters of `unit` (length `units()[unit].numel()`), a pure function of `seed`.
    fn init_unit(&self, unit: usize, seed: u64) -> Vec<f32>;

    /// Incremental decoding with a KV cache over the full parameters of every unit, if the
    /// model has one (generation falls back to re-running the forward on the whole context).
    fn decoder<'a>(&'a self, params: &'a [Vec<f32>]) -> Option<Box<dyn Decoder + 'a>> {
        let _ = params;
        None
    }

    /// Parameters that a later unit uses too (tied weights, see [`tie`]). `params` of the
    /// forward and backward calls below is the unit's *view*: its own full parameters followed by
    /// the ones it borrows, in this order; `grad_params` has the view's layout. Default: none.
    fn ties(&self) -> Vec<tie::Tie> {
        Vec::new()
    }

    /// Runs `unit` forward on input activation `x` with the unit's full parameters.
    fn forward(&self, unit: usize, params: &[f32], x: &[f32], mb: &MicroBatch) -> Vec<f32>;

    /// Backward of `unit`: given the input `x` it was run on and the gradient of the loss with
    /// respect to its output, *adds* the parameter gradient into `grad_params` (same layout as
    /// `params`) and returns the gradient with respect to `x` (empty for the first unit).
    /// Implementations recompute whatever forward intermediates they need from `x`
    /// (activation checkpointing at unit granularity).
    fn backward(
        &self,
        unit: usize,
        params: &[f32],
        x: &[f32],
        grad_out: &[f32],
        mb: &MicroBatch,
        grad_params: &mut [f32],
    ) -> Vec<f32>;

    /// `forward`, also returning what `backward_kept` needs so that it does not recompute the
    /// forward (`keep_activations`: memory for time). The output must equal `forward`'s bit for
    /// bit. The default keeps nothing.
    fn forward_keep(
        &self,
        unit: usize,
        params: &[f32],
        x: &[f32],
        mb: &MicroBatch,
    ) -> (Vec<f32>, Option<Kept>) {
        (self.forward(unit, params, x, mb), None)
    }

    /// `backward` given what `forward_keep` kept for this unit and micro-batch (`None`: it kept
    /// nothing). Must give the same bits as `backward`. The default recomputes.
    #[allow(clippy::too_many_arguments)]
    fn backward_kept(
        &self,
        unit: usize,
        params: &[f32],
        x: &[f32],
        kept: Option<Kept>,
        grad_out: &[f32],
        mb: &MicroBatch,
        grad_params: &mut [f32],
    ) -> Vec<f32> {
        let _ = kept;
        self.backward(unit, params, x, grad_out, mb, grad_params)
    }

    /// Mean cross-entropy (nats per token) of the last unit's output, and its gradient, which
    /// may reuse `out`'s buffer (the logits are the largest activation of a language model).
    fn loss(&self, out: Vec<f32>, mb: &MicroBatch) -> (f32, Vec<f32>);

    /// Vocabulary size of the token ids the model consumes (for data validation and sampling).
    fn vocab(&self) -> usize;

    /// Longest sequence the model accepts (`usize::MAX` if unbounded).
    fn max_seq(&self) -> usize;

    /// Floating-point operations of the matrix products of one forward pass over `tokens`
    /// tokens in sequences of `seq` (2 per multiply-add; attention over its whole `seq × seq`
    /// square, as PaLM's model FLOPs count it), or `None` if the model does not say. Model FLOPs
    /// utilisation counts three times this per step (the forward and the backward's two
    /// products), never a recomputed forward.
    fn forward_flops(&self, tokens: u64, seq: u64) -> Option<u64> {
        let _ = (tokens, seq);
        None
    }

    /// Where the model's kernels run; the runtime updates the model's shards with it too
    /// ([`Backend::optimizer_update`]). The default is the reference CPU backend.
    fn backend(&self) -> &dyn Backend {
        &backend::CPU
    }
}

/// A model's decoding state for generation: feed tokens one at a time, get the next-token
/// logits.
pub trait Decoder {
    /// Tokens fed so far.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The most tokens it can hold (the model's position table).
    fn capacity(&self) -> usize;
    /// Feeds `token` at position `len()` and returns the logits for the token after it.
    fn push(&mut self, token: u32) -> Vec<f32>;
}

/// Mean cross-entropy of logits `out` (`[rows, vocab]`) against the micro-batch's targets, and
/// its gradient in `out`'s buffer, on `be`: the loss of every built-in language model.
pub(crate) fn lm_loss(
    be: &dyn Backend,
    vocab: usize,
    mut out: Vec<f32>,
    mb: &MicroBatch,
) -> (f32, Vec<f32>) {
    assert_eq!(
        mb.targets.len(),
        mb.batch * mb.seq,
        "micro-batch targets length"
    );
    let loss = match &mb.loss_mask {
        None => be.cross_entropy(&mut out, &mb.targets, vocab),
        // Masked targets are rare enough (instruction data) that the CPU kernel serves every
        // backend: the logits are host memory here.
        Some(mask) => crate::model::ops::masked_cross_entropy_in_place(
            &mut out,
            &mb.targets,
            &mask.keep,
            vocab,
            mask.weight(),
        ) as f32,
    };
    (loss, out)
}

/// Total parameter count of a list of units.
pub fn param_count(units: &[UnitSpec]) -> usize {
    units.iter().map(UnitSpec::numel).sum()
}
