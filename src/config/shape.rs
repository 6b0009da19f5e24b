//! The model and the world it is trained on: which model, its shape, the batch, the chunking.

use serde::{Deserialize, Serialize};

use super::{ConfigError, TrainConfig};

/// Which built-in model to train.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    Gpt,
    Mlp,
}

impl TrainConfig {
    /// The model's shape, the batch and the chunking: sizes that must be positive and heads
    /// that divide the width.
    pub(super) fn validate_shape(&self) -> Result<(), ConfigError> {
        let positive = |field: &str, v: usize| {
            if v == 0 {
                Err(ConfigError::new(field, "must be at least 1"))
            } else {
                Ok(())
            }
        };
        positive("layers", self.layers)?;
        positive("vocab", self.vocab)?;
        if self.max_positions != 0 && self.max_positions < self.seq_len {
            return Err(ConfigError::new(
                "max_positions",
                format!(
                    "{} positions cannot hold sequences of seq_len {}: lower seq_len to at most \
                     {0}",
                    self.max_positions, self.seq_len
                ),
            ));
        }
        positive("d_model", self.d_model)?;
        positive("seq_len", self.seq_len)?;
        positive("micro_batch_size", self.micro_batch_size)?;
        positive("chunk_elems", self.chunk_elems)?;
        positive("max_live_units", self.max_live_units)?;
        positive("optimizer_threads", self.optimizer_threads)?;
        if self.model != ModelKind::Gpt && (self.tie_embeddings || self.gelu != Default::default())
        {
            let key = if self.tie_embeddings {
                "tie_embeddings"
            } else {
                "gelu"
            };
            return Err(ConfigError::new(
                key,
                "applies to model = \"gpt\" only: remove it or use the GPT",
            ));
        }
        if self.model == ModelKind::Gpt
            && (self.heads == 0 || !self.d_model.is_multiple_of(self.heads))
        {
            return Err(ConfigError::new(
                "heads",
                format!(
                    "{} heads do not divide d_model {}: use a divisor of {}",
                    self.heads, self.d_model, self.d_model
                ),
            ));
        }
        if self.micro_batches == 0 {
            return Err(ConfigError::new("micro_batches", "must be at least 1"));
        }
        Ok(())
    }
}
