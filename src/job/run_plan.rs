//! The plan of a run: what its start derives from the validated config and the model, derived
//! once and in one place. The in-process cluster, the coordinator process and each worker
//! process read their settings from it; the runtime only adds what is its own (the network, the
//! locked tier directory, the progress counters).
//!
//! Pure data and functions: nothing here opens a file, reads the clock or names the runtime
//! (`LAYERS` in `tests/tidy.rs` keeps `job` below it). The memory the process may use comes in
//! as a number.

use std::path::PathBuf;

use super::{device_demand, lr_schedule, optim_settings, plan_memory};
use crate::config::{ConfigError, DeviceChoice, Faults, NvmeFault, RoundKill, TrainConfig};
use crate::engine::coordinator::{Change, JobSpec, ScriptedChange};
use crate::model::backend::Precision;
use crate::model::Model;
use crate::optim::OptimSettings;
use crate::plan::activations::ActivationChoice;
use crate::plan::device::{place_device, DevicePlan};
use crate::plan::tier::{Fit, FitError, Placement};
use crate::plan::{RankId, Stage};
use crate::reduce::ReduceMode;

/// What every process of a run derives alike from its config.
#[derive(Clone, Debug)]
pub struct RunPlan {
    pub stage: Stage,
    pub reduce: ReduceMode,
    pub precision: Precision,
    pub optim: OptimSettings,
    /// Initialisation and data seed.
    pub seed: u64,
    /// Deadline of any single receive inside a collective.
    pub collective_timeout_ms: u64,
    /// The coordinator engine's job, with the membership script.
    pub job: JobSpec,
    /// The step executor's settings.
    pub exec: ExecSettings,
    /// What the run injects; none of it changes the numbers.
    pub faults: Faults,
    /// (rank, step): the rank dies abruptly halfway through the step (`kill`).
    kills: Vec<(RankId, u64)>,
}

/// The step executor's settings (`runtime::step::exec::ExecConfig` without the runtime's
/// handles, and without whether activations are kept, which the memory plan decides).
#[derive(Clone, Debug, PartialEq)]
pub struct ExecSettings {
    pub micro_batch_size: usize,
    pub seq_len: usize,
    pub seed: u64,
    pub max_live_units: usize,
    /// Global-norm clipping threshold; 0 disables.
    pub grad_clip: f64,
    /// Fault injection: ranks that vanish halfway through a round between steps.
    pub round_kills: Vec<RoundKill>,
    pub precision: Precision,
}

impl RunPlan {
    /// The plan of a validated `cfg`; `snapshot_every` is the caller's (a run that saves, or an
    /// embedder that asks for snapshots).
    pub fn new(cfg: &TrainConfig, snapshot_every: u64) -> Result<RunPlan, ConfigError> {
        let stage = Stage::from_u8(cfg.stage).ok_or_else(|| {
            ConfigError::new("stage", format!("{} is not a ZeRO stage", cfg.stage))
        })?;
        Ok(RunPlan {
            stage,
            reduce: cfg.reduce,
            precision: cfg.precision,
            optim: optim_settings(cfg),
            seed: cfg.seed,
            collective_timeout_ms: cfg.collective_timeout_ms,
            job: job_spec(cfg, snapshot_every),
            exec: ExecSettings {
                micro_batch_size: cfg.micro_batch_size,
                seq_len: cfg.seq_len,
                seed: cfg.seed,
                max_live_units: cfg.max_live_units,
                grad_clip: cfg.grad_clip as f64,
                round_kills: cfg.faults.kill_during.clone(),
                precision: cfg.precision,
            },
            faults: cfg.faults.clone(),
            kills: cfg.kill.iter().map(|k| (k.value, k.step)).collect(),
        })
    }

    /// The step at which `rank` dies abruptly (`kill`), if any.
    pub fn kill_step(&self, rank: RankId) -> Option<u64> {
        self.kills.iter().find(|(r, _)| *r == rank).map(|(_, s)| *s)
    }

    /// Test hook: the step at which `rank`'s compute panics, if any.
    pub fn panic_step(&self, rank: RankId) -> Option<u64> {
        self.faults
            .panic_at
            .filter(|(r, _)| *r == rank)
            .map(|(_, s)| s)
    }
}

/// The coordinator engine's job description for a config.
fn job_spec(cfg: &TrainConfig, snapshot_every: u64) -> JobSpec {
    JobSpec {
        steps: cfg.steps,
        micro_batches: cfg.micro_batches,
        lr: lr_schedule(cfg),
        step_timeout_ms: cfg.collective_timeout_ms.saturating_mul(4),
        initial_grad_bound: cfg.initial_grad_bound,
        snapshot_every,
        script: membership_script(cfg),
        min_ranks: cfg.min_ranks,
        max_ranks: cfg.max_ranks,
        replicate_every: cfg.replicate_every,
        eval_every: cfg.eval_data.is_some().then_some(cfg.eval_every),
    }
}

/// The config's `leave` and `join` entries as the coordinator's script (kills are faults the
/// runtime injects, not membership requests).
fn membership_script(cfg: &TrainConfig) -> Vec<ScriptedChange> {
    let mut script: Vec<ScriptedChange> = cfg
        .leave
        .iter()
        .map(|a| ScriptedChange {
            step: a.step,
            change: Change::Leave(a.value),
        })
        .chain(cfg.join.iter().map(|a| ScriptedChange {
            step: a.step,
            change: Change::Join(a.value),
        }))
        .collect();
    script.sort_by_key(|c| c.step);
    script
}

/// Where the state of one process's ranks goes: the memory plan, whether blocks keep their
/// activations, and the tier to open if anything goes there.
#[derive(Clone, Debug)]
pub struct StoragePlan {
    pub fit: Fit,
    pub activations: ActivationChoice,
    pub tier: Option<TierPlan>,
    /// What lives on each rank's device, with one (`device`).
    pub device: Option<DevicePlan>,
}

/// The tier a process opens: its directory, what it holds, its I/O settings and the room it
/// needs. The runtime checks and locks the directory.
#[derive(Clone, Debug, PartialEq)]
pub struct TierPlan {
    pub dir: PathBuf,
    pub placement: Placement,
    pub tile_elems: usize,
    pub staging_buffers: usize,
    /// I/O requests in flight per rank.
    pub queue_depth: u32,
    /// Bytes per I/O request.
    pub block_bytes: usize,
    /// O_DIRECT, or buffered I/O (`nvme_buffered`).
    pub direct: bool,
    /// Free space the directory must have.
    pub need_bytes: u64,
    /// `Fit::update_in_backward`.
    pub update_in_backward: bool,
    /// `Fit::update_reuses_params`.
    pub update_reuses_params: bool,
    /// Fault injection in front of one rank's device (`nvme_fault`).
    pub fault: Option<NvmeFault>,
}

impl StoragePlan {
    /// Plans where the state of `ranks_in_process` ranks goes in `available_bytes` (used when
    /// `memory_max_bytes` is not set); `streamed_snapshots`: the runtime streams snapshots off
    /// the tier rather than gathering them whole. Refuses a run that cannot fit.
    pub fn new(
        cfg: &TrainConfig,
        model: &dyn Model,
        ranks_in_process: u64,
        streamed_snapshots: bool,
        available_bytes: u64,
    ) -> Result<StoragePlan, FitError> {
        let (fit, activations) = plan_memory(
            cfg,
            model,
            ranks_in_process,
            streamed_snapshots,
            available_bytes,
        )?;
        let tier = match (&cfg.nvme_dir, fit.placement.any_nvme()) {
            (Some(dir), true) => Some(TierPlan {
                dir: dir.clone(),
                placement: fit.placement,
                tile_elems: fit.tile_elems as usize,
                staging_buffers: fit.staging_buffers as usize,
                queue_depth: cfg.nvme_queue_depth,
                block_bytes: cfg.nvme_block_bytes as usize,
                direct: !cfg.nvme_buffered,
                // During a reshard a rank's old and new tier files coexist; backups have files
                // beside them.
                need_bytes: ranks_in_process * (2 * fit.per_rank.tier + fit.per_rank.backup_disk),
                update_in_backward: fit.update_in_backward,
                update_reuses_params: fit.update_reuses_params,
                fault: cfg.faults.nvme_fault,
            }),
            // The planner offloads only with a directory.
            (None, true) => return Err(FitError::NoNvmeDir),
            (_, false) => None,
        };
        let device = match cfg.device {
            DeviceChoice::None => None,
            DeviceChoice::Sim => Some(place_device(
                &device_demand(
                    cfg,
                    model,
                    if activations.keep {
                        activations.kept_bytes
                    } else {
                        activations.recomputed_bytes
                    },
                ),
                cfg.device_memory_max_bytes.unwrap_or(0),
            )?),
        };
        Ok(StoragePlan {
            fit,
            activations,
            tier,
            device,
        })
    }

    /// Buffers of each kind the step keeps on the device (`ExecConfig::device_buffers`).
    pub fn device_buffers(&self) -> usize {
        self.device.map_or(1, |d| d.param_buffers as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::At;

    #[test]
    fn the_script_is_leaves_and_joins_in_step_order_and_kills_stay_faults() {
        let cfg = TrainConfig {
            leave: vec![At { value: 1, step: 5 }],
            join: vec![At { value: 2, step: 3 }],
            kill: vec![At { value: 3, step: 4 }],
            ..TrainConfig::default()
        };
        let plan = RunPlan::new(&cfg, 7).unwrap();
        let steps: Vec<u64> = plan.job.script.iter().map(|c| c.step).collect();
        assert_eq!(steps, [3, 5]);
        assert_eq!(plan.job.snapshot_every, 7);
        assert_eq!(plan.job.step_timeout_ms, 4 * cfg.collective_timeout_ms);
        assert_eq!((plan.kill_step(3), plan.kill_step(1)), (Some(4), None));
    }

    #[test]
    fn test_hooks_reach_only_the_rank_they_name() {
        let mut cfg = TrainConfig::default();
        cfg.faults.panic_at = Some((1, 2));
        let plan = RunPlan::new(&cfg, 0).unwrap();
        assert_eq!((plan.panic_step(1), plan.panic_step(0)), (Some(2), None));
    }

    #[test]
    fn state_in_ram_opens_no_tier() {
        let cfg = TrainConfig::default();
        let model = crate::job::build_model(&cfg).unwrap();
        let plan = StoragePlan::new(&cfg, model.as_ref(), 4, false, u64::MAX / 2).unwrap();
        assert!(plan.tier.is_none() && !plan.fit.placement.any_nvme());
    }
}
