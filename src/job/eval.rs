//! Held-out evaluation: the mean loss of the trained model on fixed windows of the eval data,
//! the same windows at every evaluation, so losses of different runs and steps compare.

use crate::config::TrainConfig;
use crate::data::Dataset;
use crate::model::sample::forward_logits;
use crate::model::{MicroBatch, Model};

/// The data coordinates of the eval windows: a step no run reaches, so they are fixed.
pub const EVAL_STEP: u64 = u64::MAX;

/// A held-out loss.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvalResult {
    /// Mean cross-entropy per token, nats.
    pub loss: f64,
    /// `exp(loss)`.
    pub perplexity: f64,
    /// Windows of `seq_len` tokens evaluated.
    pub windows: usize,
}

/// The eval micro-batches of a run of `cfg`: one global batch's worth of windows
/// (`micro_batches` of `micro_batch_size` rows), at positions fixed by the seed alone.
pub fn eval_batches(cfg: &TrainConfig, data: &Dataset) -> Vec<MicroBatch> {
    (0..u64::from(cfg.micro_batches))
        .map(|i| data.micro_batch(cfg.seed, EVAL_STEP, i, cfg.micro_batch_size, cfg.seq_len))
        .collect()
}

/// The mean loss of `model` with full `params` on the eval windows, through the model's own
/// forward and loss (the computation every training step's forward makes), averaged over the
/// micro-batches in order.
pub fn evaluate(
    model: &dyn Model,
    params: &[Vec<f32>],
    cfg: &TrainConfig,
    data: &Dataset,
) -> EvalResult {
    let batches = eval_batches(cfg, data);
    let total: f64 = batches
        .iter()
        .map(|mb| f64::from(model.loss(forward_logits(model, params, mb), mb).0))
        .sum();
    let loss = total / batches.len().max(1) as f64;
    EvalResult {
        loss,
        perplexity: loss.exp(),
        windows: batches.iter().map(|mb| mb.batch).sum(),
    }
}
