//! The optimizer a run uses, with its hyper-parameters and threads, as one value every shard of
//! the run is updated with.

use super::{adam_step, sgd_step, AdamHyper, OptimizerKind, SgdHyper};

/// Optimizer choice and hyper-parameters for every shard of a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimSettings {
    pub kind: OptimizerKind,
    pub hyper: AdamHyper,
    pub threads: usize,
}

impl OptimSettings {
    /// Optimizer state elements per parameter (Adam: m and v).
    pub fn state_per_param(&self) -> u64 {
        match self.kind {
            OptimizerKind::AdamW | OptimizerKind::Adam => 2,
            OptimizerKind::Sgd { momentum, .. } if momentum != 0.0 => 1,
            OptimizerKind::Sgd { .. } => 0,
        }
    }

    /// One update of `p` with gradient `g` and state slices `m`, `v` (empty where unused).
    pub fn update(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], t: u64, lr: f32) {
        match self.kind {
            OptimizerKind::AdamW | OptimizerKind::Adam => {
                let hp = AdamHyper {
                    decoupled: self.kind == OptimizerKind::AdamW,
                    ..self.hyper
                };
                adam_step(p, g, m, v, &hp, t, lr, self.threads);
            }
            OptimizerKind::Sgd { momentum, nesterov } => {
                let hp = SgdHyper {
                    momentum,
                    nesterov,
                    weight_decay: self.hyper.weight_decay,
                };
                sgd_step(p, g, m, &hp, t, lr, self.threads);
            }
        }
    }
}
