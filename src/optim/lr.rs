//! Learning-rate schedule: linear warm-up, then cosine decay to a floor.
//!
//! The learning rate is a pure function of the step number, computed in `f64` and rounded to
//! `f32` once, so every rank (whatever the world size) feeds the optimizer the same bits.

use serde::{Deserialize, Serialize};

/// Linear warm-up from 0 to `base_lr` over `warmup_steps`, then cosine decay to
/// `base_lr * min_lr_ratio` at `total_steps`, constant at that floor afterwards.
///
/// Steps are the optimizer's 1-based `t`. Special cases:
/// - `warmup_steps == 0`: no warm-up, step 1 already runs at `base_lr` (or on the cosine).
/// - `total_steps == 0`: cosine decay off; `base_lr` after warm-up. With `warmup_steps == 0` as
///   well (the [`Default`], apart from `base_lr`) the schedule is constant.
/// - `0 < total_steps <= warmup_steps`: nothing left to decay over; the floor after warm-up.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LrSchedule {
    pub base_lr: f32,
    pub warmup_steps: u64,
    pub total_steps: u64,
    /// Floor as a fraction of `base_lr` (0.1 is the usual GPT choice).
    pub min_lr_ratio: f64,
}

impl Default for LrSchedule {
    fn default() -> Self {
        Self {
            base_lr: 1e-3,
            warmup_steps: 0,
            total_steps: 0,
            min_lr_ratio: 0.1,
        }
    }
}

impl LrSchedule {
    /// A schedule that always returns `lr`.
    pub fn constant(lr: f32) -> Self {
        Self {
            base_lr: lr,
            ..Self::default()
        }
    }

    /// The learning rate for 1-based step `step`.
    pub fn lr_at(&self, step: u64) -> f32 {
        let base = f64::from(self.base_lr);
        if step < self.warmup_steps {
            return (base * step as f64 / self.warmup_steps as f64) as f32;
        }
        if self.total_steps == 0 {
            return self.base_lr;
        }
        let min_lr = base * self.min_lr_ratio;
        if self.total_steps <= self.warmup_steps {
            return min_lr as f32;
        }
        let span = (self.total_steps - self.warmup_steps) as f64;
        let progress = ((step - self.warmup_steps) as f64 / span).min(1.0);
        let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        (min_lr + (base - min_lr) * cosine) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_shape() {
        let s = LrSchedule {
            base_lr: 1e-3,
            warmup_steps: 10,
            total_steps: 110,
            min_lr_ratio: 0.1,
        };
        // Linear ramp from 0: step k of the warm-up runs at k/10 of the base.
        assert_eq!(s.lr_at(0), 0.0);
        assert!((s.lr_at(1) - 1e-4).abs() < 1e-10);
        assert!((s.lr_at(5) - 5e-4).abs() < 1e-10);
        assert_eq!(s.lr_at(10), 1e-3);
        // Half-way through the decay the cosine is at the midpoint of base and floor.
        assert!((s.lr_at(60) - 5.5e-4).abs() < 1e-9);
        assert!((s.lr_at(110) - 1e-4).abs() < 1e-10);
        assert_eq!(s.lr_at(110), s.lr_at(10_000));
        let lrs: Vec<f32> = (0..=120).map(|t| s.lr_at(t)).collect();
        assert!(lrs[..=10].windows(2).all(|w| w[0] < w[1]), "warm-up rises");
        assert!(lrs[10..].windows(2).all(|w| w[0] >= w[1]), "decay falls");
        assert!(lrs.iter().all(|&lr| (0.0..=1e-3).contains(&lr)));
    }

    #[test]
    fn special_cases() {
        let c = LrSchedule::constant(3e-4);
        assert!([1, 2, 1000, u64::MAX].iter().all(|&t| c.lr_at(t) == 3e-4));

        let warm_only = LrSchedule {
            warmup_steps: 4,
            ..LrSchedule::constant(1.0)
        };
        assert_eq!(
            (1..=6).map(|t| warm_only.lr_at(t)).collect::<Vec<_>>(),
            [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
        );

        let no_warmup = LrSchedule {
            base_lr: 1.0,
            warmup_steps: 0,
            total_steps: 100,
            min_lr_ratio: 0.0,
        };
        assert!(no_warmup.lr_at(1) < 1.0 && no_warmup.lr_at(1) > 0.999);
        assert_eq!(no_warmup.lr_at(100), 0.0);

        let degenerate = LrSchedule {
            base_lr: 1.0,
            warmup_steps: 10,
            total_steps: 5,
            min_lr_ratio: 0.5,
        };
        assert_eq!(degenerate.lr_at(9), 0.9);
        assert_eq!(degenerate.lr_at(10), 0.5);
    }
}
