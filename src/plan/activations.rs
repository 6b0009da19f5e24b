//! Whether a block keeps its forward intermediates until its backward or recomputes them:
//! a pure decision from the memory the two choices need and the budget, made once before the
//! run (the same bits either way; keeping saves up to a third of the step's compute, less
//! where the step's time goes elsewhere).
//!
//! `auto` keeps them only when that costs at most [`KEEP_PREMIUM_MAX`] more memory than
//! recomputing: a fine-tune's activations at real sequence lengths can be several times its
//! state, and the memory a run takes by default should leave room for the OS, the page cache
//! and other work on the machine, not fill it because it is there.

use serde::{Deserialize, Serialize};

use super::tier::{Fit, FitError};

/// The most `auto` lets keeping activations add to the process's planned memory, as a
/// fraction of what the run needs when it recomputes them.
pub const KEEP_PREMIUM_MAX: f64 = 0.25;

/// The configured policy (`activation_checkpointing`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ActivationCheckpointing {
    /// Keep when keeping fits the budget without moving more state to the tier than
    /// recomputing would and adds at most `KEEP_PREMIUM_MAX` to the run's memory; recompute
    /// otherwise.
    #[default]
    Auto,
    /// Always recompute (checkpoint every block): the least memory.
    Always,
    /// Never recompute: keep every block's intermediates (`--keep-activations`).
    Never,
}

impl ActivationCheckpointing {
    pub fn name(self) -> &'static str {
        match self {
            ActivationCheckpointing::Auto => "auto",
            ActivationCheckpointing::Always => "always",
            ActivationCheckpointing::Never => "never",
        }
    }
}

impl std::str::FromStr for ActivationCheckpointing {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ActivationCheckpointing::Auto),
            "always" => Ok(ActivationCheckpointing::Always),
            "never" => Ok(ActivationCheckpointing::Never),
            other => Err(format!(
                "'{other}' is not an activation checkpointing policy: use auto, always or never"
            )),
        }
    }
}

/// What was decided and what each choice would have cost one rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActivationChoice {
    pub policy: ActivationCheckpointing,
    /// Whether blocks keep their intermediates.
    pub keep: bool,
    /// One rank's activation bytes when keeping, and when recomputing.
    pub kept_bytes: u64,
    pub recomputed_bytes: u64,
    /// Under `auto`, why it recomputes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute_reason: Option<RecomputeReason>,
}

/// Why `auto` recomputes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecomputeReason {
    /// Keeping would move state to the tier (or not fit at all).
    NeedsOffload,
    /// Keeping would add more than `KEEP_PREMIUM_MAX` to the run's memory.
    Premium,
}

impl ActivationChoice {
    /// `kept` or `recomputed` (the JSON summary's `activations`).
    pub fn outcome(&self) -> &'static str {
        if self.keep {
            "kept"
        } else {
            "recomputed"
        }
    }

    /// One line for the start of a run, e.g. `activations: kept (auto: keeping fits the
    /// budget), 37.5 MiB per rank; recomputing would need 6.0 MiB`.
    pub fn describe(&self) -> String {
        let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64);
        let (used, other, other_what) = if self.keep {
            (
                self.kept_bytes,
                self.recomputed_bytes,
                "recomputing would need",
            )
        } else {
            (self.recomputed_bytes, self.kept_bytes, "keeping would need")
        };
        let what = self.outcome();
        let why = match (self.policy, self.keep) {
            (ActivationCheckpointing::Auto, true) => "auto: keeping fits the budget",
            (ActivationCheckpointing::Auto, false) => match self.recompute_reason {
                Some(RecomputeReason::Premium) => {
                    "auto: keeping would add more than a quarter to the run's memory; --activation-checkpointing never keeps them"
                }
                _ => "auto: keeping does not fit the budget without more offload",
            },
            (ActivationCheckpointing::Always, _) => "activation_checkpointing = always",
            (ActivationCheckpointing::Never, _) => "activation_checkpointing = never",
        };
        format!(
            "activations: {what} ({why}), {} per rank; {other_what} {}",
            mib(used),
            mib(other)
        )
    }
}

/// Applies `policy`: `place(activation_bytes)` plans the run with that much activation memory
/// per rank. `auto` keeps only when the plan with kept activations succeeds with the same
/// placement as the plan that recomputes, so keeping never pushes state to the disk, and
/// needs at most `KEEP_PREMIUM_MAX` more of the process's memory.
pub fn choose(
    policy: ActivationCheckpointing,
    kept_bytes: u64,
    recomputed_bytes: u64,
    place: impl Fn(u64) -> Result<Fit, FitError>,
) -> Result<(Fit, ActivationChoice), FitError> {
    let choice = |keep, recompute_reason| ActivationChoice {
        policy,
        keep,
        kept_bytes,
        recomputed_bytes,
        recompute_reason,
    };
    match policy {
        ActivationCheckpointing::Never => Ok((place(kept_bytes)?, choice(true, None))),
        ActivationCheckpointing::Always => Ok((place(recomputed_bytes)?, choice(false, None))),
        ActivationCheckpointing::Auto => {
            // Recomputing needs the least memory: if that does not fit, nothing does.
            let recompute = place(recomputed_bytes)?;
            let ceiling = recompute.process_bytes as f64 * (1.0 + KEEP_PREMIUM_MAX);
            match place(kept_bytes) {
                Ok(keep) if keep.placement != recompute.placement => Ok((
                    recompute,
                    choice(false, Some(RecomputeReason::NeedsOffload)),
                )),
                Ok(keep) if keep.process_bytes as f64 > ceiling => {
                    Ok((recompute, choice(false, Some(RecomputeReason::Premium))))
                }
                Ok(keep) => Ok((keep, choice(true, None))),
                Err(_) => Ok((
                    recompute,
                    choice(false, Some(RecomputeReason::NeedsOffload)),
                )),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::tier::{Placement, RankBytes, Tier};

    /// A stand-in planner: state `base` bytes plus the activations must fit `budget`; past it,
    /// the optimizer state (`opt` bytes) goes to the disk if that makes it fit.
    fn planner(base: u64, opt: u64, budget: u64) -> impl Fn(u64) -> Result<Fit, FitError> {
        move |act| {
            let fit = |placement, bytes| Fit {
                placement,
                tile_elems: 0,
                staging_buffers: 0,
                per_rank: RankBytes {
                    activations: act,
                    ..RankBytes::default()
                },
                snapshot_bytes: 0,
                process_bytes: bytes,
                update_in_backward: false,
                update_reuses_params: false,
            };
            if base + act <= budget {
                Ok(fit(Placement::RAM, base + act))
            } else if base - opt + act <= budget {
                let p = Placement {
                    optimizer: Tier::Nvme,
                    ..Placement::RAM
                };
                Ok(fit(p, base - opt + act))
            } else {
                Err(FitError::DoesNotFit(format!("needs {}", base - opt + act)))
            }
        }
    }

    #[test]
    fn auto_keeps_when_keeping_fits_the_budget() {
        let (fit, c) = choose(
            ActivationCheckpointing::Auto,
            200,
            100,
            planner(500, 200, 1000),
        )
        .expect("fits");
        assert!(c.keep);
        assert_eq!(fit.per_rank.activations, 200);
        assert_eq!(fit.placement, Placement::RAM);
        assert!(c.describe().contains("kept (auto"), "{}", c.describe());
    }

    #[test]
    fn auto_recomputes_when_keeping_would_need_the_disk() {
        // 500 + 600 > 1000 in RAM, but 300 + 600 fits with the optimizer on the disk, while
        // recomputing fits in RAM: recompute rather than move state.
        let (fit, c) = choose(
            ActivationCheckpointing::Auto,
            600,
            100,
            planner(500, 200, 1000),
        )
        .expect("fits");
        assert!(!c.keep);
        assert_eq!(fit.placement, Placement::RAM);
        assert_eq!(fit.per_rank.activations, 100);
        assert!(c.describe().contains("does not fit"), "{}", c.describe());
    }

    #[test]
    fn auto_recomputes_when_keeping_does_not_fit_at_all() {
        let (_, c) = choose(
            ActivationCheckpointing::Auto,
            5000,
            100,
            planner(500, 200, 1000),
        )
        .expect("fits");
        assert!(!c.keep);
    }

    #[test]
    fn auto_keeps_on_the_disk_when_recomputing_needs_the_disk_too() {
        // Neither fits in RAM; both fit with the optimizer on the disk: same placement, keep.
        let (fit, c) = choose(
            ActivationCheckpointing::Auto,
            150,
            100,
            planner(950, 200, 1000),
        )
        .expect("fits");
        assert!(c.keep);
        assert_eq!(fit.placement.optimizer, Tier::Nvme);
    }

    #[test]
    fn the_budget_moves_the_choice() {
        // The same run at growing budgets: recompute, then keep from the point keeping fits.
        let keeps: Vec<bool> = [550, 600, 649, 650, 5000]
            .iter()
            .map(|&budget| {
                choose(
                    ActivationCheckpointing::Auto,
                    150,
                    50,
                    planner(500, 0, budget),
                )
                .expect("fits")
                .1
                .keep
            })
            .collect();
        assert_eq!(keeps, [false, false, false, true, true]);
    }

    #[test]
    fn auto_recomputes_when_keeping_costs_more_than_a_quarter_more_memory() {
        // 500 + 126 > 1.25 x (500 + 0): recompute though keeping fits; 125 is the edge.
        let keep = |kept| {
            choose(
                ActivationCheckpointing::Auto,
                kept,
                0,
                planner(500, 0, 10_000),
            )
            .expect("fits")
            .1
        };
        assert!(keep(125).keep);
        let c = keep(126);
        assert!(!c.keep);
        assert_eq!(c.recompute_reason, Some(RecomputeReason::Premium));
        assert!(
            c.describe().contains("more than a quarter"),
            "{}",
            c.describe()
        );
        // Never still keeps, whatever it costs.
        assert!(
            choose(
                ActivationCheckpointing::Never,
                5000,
                0,
                planner(500, 0, 10_000)
            )
            .unwrap()
            .1
            .keep
        );
    }

    #[test]
    fn fixed_policies_are_obeyed_or_refused() {
        let p = || planner(500, 200, 1000);
        assert!(
            choose(ActivationCheckpointing::Never, 300, 100, p())
                .unwrap()
                .1
                .keep
        );
        assert!(
            !choose(ActivationCheckpointing::Always, 300, 100, p())
                .unwrap()
                .1
                .keep
        );
        // `never` is not quietly overridden when keeping cannot fit.
        assert!(choose(ActivationCheckpointing::Never, 5000, 100, p()).is_err());
        // Nothing fits: auto refuses like the planner.
        assert!(choose(ActivationCheckpointing::Auto, 5000, 5000, p()).is_err());
    }

    #[test]
    fn policies_parse() {
        for p in [
            ActivationCheckpointing::Auto,
            ActivationCheckpointing::Always,
            ActivationCheckpointing::Never,
        ] {
            assert_eq!(p.name().parse::<ActivationCheckpointing>(), Ok(p));
        }
        let err = "sometimes".parse::<ActivationCheckpointing>().unwrap_err();
        assert!(err.contains("auto, always or never"), "{err}");
    }
}
