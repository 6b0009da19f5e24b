//! What the coordinator and the ranks tell each other once per step.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::plan::memory::Resident;
use crate::plan::volume::Volume;
use crate::plan::RankId;

/// The coordinator's instruction for one step, identical for every rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepPlan {
    pub epoch: u64,
    pub step: u64,
    /// Micro-batch indices per member; together they cover `0..micro_batches` exactly once.
    pub assignment: Vec<(RankId, Range<u32>)>,
    pub micro_batches: u32,
    /// Learning rate for this step's update.
    pub lr: f32,
    /// 1-based optimizer step count if this step's update is applied (bias correction).
    pub opt_step: u64,
    /// Per-unit bound on |gradient| that fixes the exact-reduction scale.
    pub grad_bounds: Vec<f32>,
    /// The update may be owed to the next step's forward (where a rank's placement allows it,
    /// `runtime::step::owed`): false when something reads the ranks' state before the next
    /// step (the job's end, a snapshot, a backup, a scripted change), so that the update's
    /// cost is this step's.
    #[serde(default)]
    pub defer_update: bool,
    /// After the update, evaluate the held-out data with the new parameters
    /// (`StepReport::eval_losses`).
    #[serde(default)]
    pub eval: bool,
}

impl StepPlan {
    pub fn local_micro_batches(&self, rank: RankId) -> Range<u32> {
        self.assignment
            .iter()
            .find(|(r, _)| *r == rank)
            .map(|(_, m)| m.clone())
            .unwrap_or(0..0)
    }
}

/// A rank's account of a finished step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepReport {
    pub rank: RankId,
    pub epoch: u64,
    pub step: u64,
    /// Loss of every micro-batch of the step (agreed, so every rank reports all of them).
    pub losses: Vec<f32>,
    /// Agreed per-unit max |gradient| over all micro-batches (the next step's bounds).
    pub unit_max_abs: Vec<f32>,
    pub grad_norm: f64,
    pub clip_coef: f64,
    /// The update was skipped because a gradient was not finite.
    pub skipped: bool,
    /// Passes needed (2 when the first overflowed the fixed-point range).
    pub attempts: u32,
    /// Data this rank sent (parameter and gradient elements), measured.
    pub sent: Volume,
    /// All bytes this rank sent including control messages and frame headers, measured.
    pub bytes_sent: u64,
    pub resident: Resident,
    pub peak_bytes: u64,
    pub peak_gathered_bytes: u64,
    /// Frames dropped for carrying an old epoch or step.
    pub stale_dropped: u64,
    /// Seconds of forward/backward compute on this rank.
    pub compute_s: f64,
    /// Seconds of the optimizer update (including its tier I/O when state is offloaded).
    #[serde(default)]
    pub optimizer_s: f64,
    /// Seconds from the step's start on this rank to its report: compute, optimizer, and the
    /// rest, which is waiting on collectives (and on the tier).
    #[serde(default)]
    pub busy_s: f64,
    /// Bytes this rank read from and wrote to its NVMe tier in the step.
    #[serde(default)]
    pub tier_read_bytes: u64,
    #[serde(default)]
    pub tier_write_bytes: u64,
    /// Seconds the rank waited for its tier in the step.
    #[serde(default)]
    pub io_wait_s: f64,
    /// Bytes of the rank's tier file (0 with all state in RAM).
    #[serde(default)]
    pub tier_bytes: u64,
    /// On a device: what crossed the link this step each way, the compute's wait on copies
    /// this step, and the device's bytes (peak since the rank's device was opened, and
    /// resident by kind at the step's end).
    #[serde(default)]
    pub device: Option<crate::model::backend::DeviceCounters>,
    /// With `StepPlan::eval`: the loss of every eval micro-batch under the updated parameters
    /// (agreed, so every rank reports all of them); empty otherwise.
    #[serde(default)]
    pub eval_losses: Vec<f32>,
}
