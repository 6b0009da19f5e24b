//! Turning a validated config into the model and dataset a run trains.

use std::sync::Arc;

use crate::config::{ConfigError, ModelKind, TrainConfig};
use crate::data::{markov::MarkovSource, text::TextData, Dataset};
use crate::model::gpt::{Gpt, GptConfig};
use crate::model::mlp::{Mlp, MlpConfig};
use crate::model::Model;

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
