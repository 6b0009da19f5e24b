//! The model and the world it is trained on: which model, its shape, the batch, the chunking.

use serde::{Deserialize, Serialize};

use super::{ConfigError, TrainConfig};

/// Which built-in model to train.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    Gpt,
    /// The Llama family (Llama, Qwen2, SmolLM2): RMSNorm, RoPE, SwiGLU, grouped-query
    /// attention.
    Llama,
    Mlp,
}

impl ModelKind {
    /// Its name in configs and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Gpt => "gpt",
            Self::Llama => "llama",
            Self::Mlp => "mlp",
        }
    }
}

impl std::str::FromStr for ModelKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        [Self::Gpt, Self::Llama, Self::Mlp]
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown model `{s}`: use gpt, llama or mlp"))
    }
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
        self.validate_family_keys()?;
        if self.model != ModelKind::Mlp && self.heads == 0 {
            return Err(ConfigError::new("heads", "must be at least 1"));
        }
        if self.model == ModelKind::Llama {
            self.validate_llama()?;
        }
        if self.model == ModelKind::Gpt && !self.d_model.is_multiple_of(self.heads) {
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

impl TrainConfig {
    /// Longest sequence the model accepts: `max_positions`, or `seq_len` when it is 0.
    pub fn positions(&self) -> usize {
        match self.max_positions {
            0 => self.seq_len,
            p => p,
        }
    }

    /// Llama: key/value heads (`kv_heads`, or `heads`).
    pub fn kv_heads(&self) -> usize {
        match self.kv_heads {
            0 => self.heads,
            k => k,
        }
    }

    /// Llama: one head's width (`head_dim`, or `d_model / heads`).
    pub fn head_dim(&self) -> usize {
        match self.head_dim {
            0 => self.d_model / self.heads.max(1),
            h => h,
        }
    }

    /// Llama: the MLP's inner width (`ffn`, or `8·d_model/3` rounded up to a multiple of 64).
    pub fn ffn(&self) -> usize {
        match self.ffn {
            0 => (8 * self.d_model).div_ceil(3).div_ceil(64) * 64,
            f => f,
        }
    }

    /// Keys of one family set for another are refused rather than ignored.
    fn validate_family_keys(&self) -> Result<(), ConfigError> {
        let (gpt, llama) = (self.model == ModelKind::Gpt, self.model == ModelKind::Llama);
        let only = |key: &str, models: &str| {
            Err(ConfigError::new(
                key,
                format!("applies to model = {models} only: remove it or change the model"),
            ))
        };
        if self.tie_embeddings && !(gpt || llama) {
            return only("tie_embeddings", "\"gpt\" or \"llama\"");
        }
        if self.gelu != Default::default() && !gpt {
            return only("gelu", "\"gpt\"");
        }
        let llama_keys = [
            ("kv_heads", self.kv_heads != 0),
            ("head_dim", self.head_dim != 0),
            ("ffn", self.ffn != 0),
            ("rope_theta", self.rope_theta != super::DEFAULT_ROPE_THETA),
            ("norm_eps", self.norm_eps != super::DEFAULT_NORM_EPS),
            ("qkv_bias", self.qkv_bias),
        ];
        match llama_keys.iter().find(|(_, set)| *set) {
            Some((key, _)) if !llama => only(key, "\"llama\""),
            _ => Ok(()),
        }
    }

    /// The head grouping and constants of a Llama.
    fn validate_llama(&self) -> Result<(), ConfigError> {
        let kv = self.kv_heads();
        if !self.heads.is_multiple_of(kv) {
            return Err(ConfigError::new(
                "kv_heads",
                format!("{kv} key/value heads do not divide {} heads", self.heads),
            ));
        }
        if self.head_dim == 0 && !self.d_model.is_multiple_of(self.heads) {
            return Err(ConfigError::new(
                "heads",
                format!(
                    "{} heads do not divide d_model {}: set head_dim, or use a divisor",
                    self.heads, self.d_model
                ),
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(ConfigError::new(
                "head_dim",
                format!("{} is odd; RoPE rotates pairs", self.head_dim()),
            ));
        }
        if !(self.rope_theta > 1.0 && self.rope_theta.is_finite()) {
            return Err(ConfigError::new(
                "rope_theta",
                "must be a finite base above 1",
            ));
        }
        if !(self.norm_eps > 0.0 && self.norm_eps < 1.0) {
            return Err(ConfigError::new("norm_eps", "must be in (0, 1)"));
        }
        Ok(())
    }
}
