//! What a finished run reports: the parameter digest and the JSON summary.

use serde::Serialize;

use crate::engine::coordinator::StepRecord;
use crate::plan::memory::Resident;

/// The [`param_digest`](crate::param_digest) of the consolidated parameters, one buffer per
/// unit. Equal digests mean bit-identical models.
pub fn param_sha256(params: &[Vec<f32>]) -> String {
    crate::param_digest::param_sha256(params.iter().map(Vec::as_slice))
}

/// Per-rank figures in the JSON summary.
#[derive(Debug, Clone, Serialize)]
pub struct RankSummary {
    pub rank: u32,
    /// Bytes held between steps, by category.
    pub resident_bytes: Resident,
    /// Largest total the rank's ledger reached.
    pub peak_bytes: u64,
    /// Median over steps of all bytes sent (data, control messages and frame headers).
    pub bytes_sent_per_step: u64,
    /// Median over steps of parameter and gradient elements sent.
    pub elems_sent_per_step: u64,
    /// Median over steps of the seconds the rank spent in model compute (forward, backward and
    /// loss); the rest of its step went to communication, the optimizer and waiting for peers.
    pub compute_s_per_step: f64,
}

/// The `--json` summary of a run.
#[derive(Debug, Clone, Serialize)]
pub struct TrainSummary {
    pub param_count: usize,
    pub stage: u8,
    pub world_size: u32,
    pub reduce: String,
    pub steps: u64,
    pub final_loss: f64,
    pub first_loss: f64,
    pub entropy_floor_nats: Option<f64>,
    pub step_time_median_s: f64,
    pub tokens_per_s: f64,
    pub skipped_steps: u64,
    pub redone_steps: u64,
    pub param_sha256: String,
    pub ranks: Vec<RankSummary>,
    pub losses: Vec<f64>,
    /// Where optimizer state and stage 3's parameters lived: `ram` or `nvme` each.
    #[serde(default)]
    pub offload_optimizer: String,
    #[serde(default)]
    pub offload_params: String,
    #[serde(default)]
    pub offload_grads: String,
    /// Median over steps of the bytes all ranks read from and wrote to their NVMe tiers.
    #[serde(default)]
    pub nvme_read_bytes_per_step: u64,
    #[serde(default)]
    pub nvme_write_bytes_per_step: u64,
    /// Median over steps of the longest time any rank waited for its tier.
    #[serde(default)]
    pub io_wait_s_per_step: f64,
    /// The process's peak resident set (VmHWM) when the summary was written, which includes
    /// consolidating the trained parameters in this process.
    #[serde(default)]
    pub peak_rss_bytes: u64,
    /// The peak resident set after the last step, before that consolidation (0 when not
    /// measured): what training itself needed.
    #[serde(default)]
    pub peak_rss_training_bytes: u64,
    /// `kept` or `recomputed`: what the activation policy chose for this process's ranks
    /// (empty where each worker process chooses for itself).
    #[serde(default)]
    pub activations: String,
}

/// Median of a list (0 for an empty one).
pub fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// Per-rank summaries from the step records (ranks in id order).
pub fn rank_summaries(records: &[StepRecord]) -> Vec<RankSummary> {
    let Some(last) = records.last() else {
        return Vec::new();
    };
    last.reports
        .iter()
        .map(|r| {
            let of = |f: &dyn Fn(&crate::engine::messages::StepReport) -> f64| {
                let xs: Vec<f64> = records
                    .iter()
                    .flat_map(|rec| rec.reports.iter().filter(|x| x.rank == r.rank).map(f))
                    .collect();
                median(xs)
            };
            RankSummary {
                rank: r.rank,
                resident_bytes: r.resident,
                peak_bytes: r.peak_bytes,
                bytes_sent_per_step: of(&|x| x.bytes_sent as f64) as u64,
                elems_sent_per_step: of(&|x| x.sent.elems() as f64) as u64,
                compute_s_per_step: of(&|x| x.compute_s),
            }
        })
        .collect()
}
