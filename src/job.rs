//! Turning a validated config into what a run trains: the model, the dataset, the optimizer and
//! its learning-rate schedule.

use std::sync::Arc;

use crate::config::{ConfigError, ModelKind, OptimizerChoice, TrainConfig};
use crate::data::{markov::MarkovSource, text::TextData, Dataset};
use crate::model::gpt::{Gpt, GptConfig};
use crate::model::mlp::{Mlp, MlpConfig};
use crate::model::Model;
use crate::optim::{AdamHyper, LrSchedule, OptimSettings, OptimizerKind};

/// Byte-level vocabulary of every built-in model.
pub const VOCAB: usize = 256;

/// The built-in model the config names.
pub fn build_model(cfg: &TrainConfig) -> Result<Arc<dyn Model>, ConfigError> {
    match cfg.model {
        ModelKind::Gpt => Gpt::new(GptConfig {
            vocab: VOCAB,
            seq_len: cfg.seq_len,
            d_model: cfg.d_model,
            heads: cfg.heads,
            layers: cfg.layers,
        })
        .map(|m| Arc::new(m) as Arc<dyn Model>)
        .map_err(|e| ConfigError::new("model", e)),
        ModelKind::Mlp => Mlp::new(MlpConfig {
            vocab: VOCAB,
            d_model: cfg.d_model,
            hidden: 4 * cfg.d_model,
            layers: cfg.layers,
        })
        .map(|m| Arc::new(m) as Arc<dyn Model>)
        .map_err(|e| ConfigError::new("model", e)),
    }
}

/// The dataset the config names: a text file, or the embedded Markov corpus.
pub fn build_dataset(cfg: &TrainConfig) -> Result<Arc<Dataset>, ConfigError> {
    let data = match &cfg.data {
        Some(path) => Dataset::Text(
            TextData::load(path).map_err(|e| ConfigError::new("data", e.to_string()))?,
        ),
        None => Dataset::Markov(MarkovSource::new(cfg.seed)),
    };
    data.validate(cfg.seq_len)
        .map_err(|e| ConfigError::new("data", e.to_string()))?;
    Ok(Arc::new(data))
}

/// Optimizer settings from a config.
pub fn optim_settings(cfg: &TrainConfig) -> OptimSettings {
    let kind = match cfg.optimizer {
        OptimizerChoice::Adamw => OptimizerKind::AdamW,
        OptimizerChoice::Adam => OptimizerKind::Adam,
        OptimizerChoice::Sgd => OptimizerKind::Sgd {
            momentum: cfg.momentum as f64,
            nesterov: false,
        },
    };
    let hyper = AdamHyper {
        lr: cfg.lr,
        beta1: cfg.beta1 as f64,
        beta2: cfg.beta2 as f64,
        eps: cfg.eps as f64,
        weight_decay: cfg.weight_decay as f64,
        decoupled: kind == OptimizerKind::AdamW,
    };
    OptimSettings {
        kind,
        hyper,
        threads: cfg.optimizer_threads,
    }
}

/// The learning-rate schedule of a config.
pub fn lr_schedule(cfg: &TrainConfig) -> LrSchedule {
    LrSchedule {
        base_lr: cfg.lr,
        warmup_steps: cfg.warmup_steps,
        total_steps: if cfg.min_lr_ratio >= 1.0 {
            0
        } else {
            cfg.steps
        },
        min_lr_ratio: cfg.min_lr_ratio as f64,
    }
}
