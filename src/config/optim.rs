//! The optimizer and its learning-rate schedule.

use serde::{Deserialize, Serialize};

use super::{ConfigError, TrainConfig};

/// Which optimizer updates the shards.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerChoice {
    /// Adam with decoupled weight decay (default).
    Adamw,
    /// Adam with L2 weight decay added to the gradient.
    Adam,
    /// SGD with momentum (`momentum`) and L2 weight decay.
    Sgd,
}

impl TrainConfig {
    /// Learning rate, schedule, optimizer hyper-parameters, clipping and the first step's
    /// gradient bound.
    pub(super) fn validate_optimizer(&self) -> Result<(), ConfigError> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(ConfigError::new("lr", "must be a positive finite number"));
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return Err(ConfigError::new("min_lr_ratio", "must be within [0, 1]"));
        }
        for (field, b) in [
            ("beta1", self.beta1),
            ("beta2", self.beta2),
            ("momentum", self.momentum),
        ] {
            if !(0.0..1.0).contains(&b) {
                return Err(ConfigError::new(field, "must be within [0, 1)"));
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(ConfigError::new("eps", "must be a positive finite number"));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(ConfigError::new("weight_decay", "must be 0 or positive"));
        }
        if !(self.grad_clip.is_finite() && self.grad_clip >= 0.0) {
            return Err(ConfigError::new("grad_clip", "must be 0 (off) or positive"));
        }
        if !(self.initial_grad_bound.is_finite() && self.initial_grad_bound > 0.0) {
            return Err(ConfigError::new(
                "initial_grad_bound",
                "must be a positive finite number",
            ));
        }
        Ok(())
    }
}
