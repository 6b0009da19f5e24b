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
    /// loss).
    pub compute_s_per_step: f64,
    /// Median over steps of the seconds of the optimizer update.
    pub optimizer_s_per_step: f64,
    /// Median over steps of the rest of the rank's step: sending and waiting on collectives
    /// (gathers, reduce-scatters, the agreement round) and on its tier.
    pub collectives_s_per_step: f64,
    /// Median over steps of the step's wall time outside the rank's own work: the
    /// coordinator's round trip (plan out, reports in) and idling for slower ranks' reports.
    pub outside_s_per_step: f64,
}

/// Where one step's time went, as shares of its wall time averaged over ranks.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepBreakdown {
    pub compute: f64,
    pub collectives: f64,
    pub optimizer: f64,
    /// Coordinator round trip and idle.
    pub outside: f64,
}

impl StepBreakdown {
    pub fn of(record: &StepRecord) -> Self {
        let wall = record.duration_ms as f64 / 1e3;
        let n = record.reports.len() as f64;
        if wall <= 0.0 || n == 0.0 {
            return Self::default();
        }
        let mut b = Self::default();
        for r in &record.reports {
            let p = split(r, wall);
            b.compute += p[0] / wall / n;
            b.collectives += p[1] / wall / n;
            b.optimizer += p[2] / wall / n;
            b.outside += p[3] / wall / n;
        }
        b
    }

    /// `compute 81% collectives 9% optimizer 4% coordinator+idle 6%`.
    pub fn describe(&self) -> String {
        let pct = |x: f64| (x * 100.0).round();
        format!(
            "compute {}% collectives {}% optimizer {}% coordinator+idle {}%",
            pct(self.compute),
            pct(self.collectives),
            pct(self.optimizer),
            pct(self.outside)
        )
    }
}

/// One rank's step as [compute, collectives, optimizer, outside] seconds of a step that took
/// `wall` on the coordinator. Clamped at 0: the coordinator's wall is whole milliseconds.
fn split(r: &crate::engine::messages::StepReport, wall: f64) -> [f64; 4] {
    let busy = r.busy_s.max(r.compute_s + r.optimizer_s);
    [
        r.compute_s,
        (busy - r.compute_s - r.optimizer_s).max(0.0),
        r.optimizer_s,
        (wall - busy).max(0.0),
    ]
}

/// One held-out evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EvalPoint {
    /// Steps completed when it ran.
    pub step: u64,
    pub loss: f64,
    pub perplexity: f64,
}

impl EvalPoint {
    /// The evaluations among `records`, in order.
    pub fn of(records: &[crate::engine::coordinator::StepRecord]) -> Vec<EvalPoint> {
        records
            .iter()
            .filter_map(|r| {
                r.eval_loss.map(|loss| EvalPoint {
                    step: r.step + 1,
                    loss,
                    perplexity: loss.exp(),
                })
            })
            .collect()
    }
}

/// The `--json` summary of a run.
#[derive(Debug, Clone, Serialize)]
pub struct TrainSummary {
    /// The held-out loss (`--eval-data`) of the trained model and its perplexity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_perplexity: Option<f64>,
    /// Every evaluation of the run (`--eval-every`, and the one after the last step).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub eval: Vec<EvalPoint>,
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
    /// Median over steps of the longest time any rank's step was held up by its tier (I/O
    /// running beside compute on a helper thread does not count).
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
    /// What the memory planner expected this process to need at its peak (the banner's
    /// `memory: about ...`), to compare with `peak_rss_training_bytes`.
    #[serde(default)]
    pub planned_memory_bytes: u64,
    /// `kept` or `recomputed`: what the activation policy chose for this process's ranks
    /// (empty where each worker process chooses for itself).
    #[serde(default)]
    pub activations: String,
    /// `fp32` or `bf16` (the config's `precision`), and the backend the model computed on
    /// (`cpu`, `cpu-bf16`).
    #[serde(default)]
    pub precision: String,
    #[serde(default)]
    pub backend: String,
    /// Model FLOPs of one step: three times the forward's matrix products over the global
    /// batch (`Model::forward_flops`; a recomputed forward is not counted). 0 when the model
    /// does not say.
    #[serde(default)]
    pub model_flops_per_step: u64,
    /// `model_flops_per_step / step_time_median_s`, in GFLOP/s.
    #[serde(default)]
    pub model_gflops_per_s: f64,
    /// One thread's GEMM GFLOP/s on the model's largest linear product, measured after
    /// training in the same process (`bench::gemm::peak_gflops`); 0 when not measured.
    #[serde(default)]
    pub gemm_peak_gflops: f64,
    /// Model FLOPs utilisation: `model_gflops_per_s / (gemm_peak_gflops × compute threads)`,
    /// where the compute threads are the ranks, at most the CPUs the process may use.
    #[serde(default)]
    pub mfu: f64,
    /// The device the model computed on and what went on there (`null` on the host CPU).
    #[serde(default)]
    pub device: Option<DeviceSummary>,
}

/// The device tier of a run (`--device`): its budget, the plan, and what the simulator counted.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceSummary {
    /// `sim`.
    pub kind: String,
    pub memory_max_bytes: u64,
    /// Where state lived (`plan::device::DevicePlan::describe`).
    pub placement: String,
    /// The most device bytes any rank held at once, in all and by kind.
    pub peak_bytes: u64,
    pub peak_params_bytes: u64,
    pub peak_grads_bytes: u64,
    pub peak_activations_bytes: u64,
    /// The device peak the plan allowed for.
    pub planned_bytes: u64,
    /// Median over steps of the bytes all ranks moved host → device and device → host.
    pub h2d_bytes_per_step: u64,
    pub d2h_bytes_per_step: u64,
    /// What the plan predicts a step moves each way, for all ranks.
    pub planned_h2d_bytes_per_step: u64,
    pub planned_d2h_bytes_per_step: u64,
    /// Median over steps of the longest time any rank's compute waited on a copy.
    pub copy_wait_s_per_step: f64,
    /// Median over steps of the longest time any rank's link was busy.
    pub link_busy_s_per_step: f64,
}

impl DeviceSummary {
    /// What `records` show of a run on `kind` planned as `plan` for `ranks` ranks; the first
    /// `warm` steps are left out of the medians.
    pub fn of(
        kind: &str,
        plan: &crate::plan::device::DevicePlan,
        ranks: u64,
        records: &[StepRecord],
        warm: usize,
    ) -> Self {
        let devs = || {
            records
                .iter()
                .flat_map(|r| &r.reports)
                .filter_map(|r| r.device)
        };
        let peak = |f: fn(&crate::model::backend::DeviceCounters) -> u64| {
            devs().map(|d| f(&d)).max().unwrap_or(0)
        };
        let per_step = |f: &dyn Fn(&crate::model::backend::DeviceCounters) -> f64, max: bool| {
            median(
                records
                    .iter()
                    .skip(warm)
                    .map(|r| {
                        let xs = r.reports.iter().filter_map(|r| r.device).map(|d| f(&d));
                        if max {
                            xs.fold(0.0, f64::max)
                        } else {
                            xs.sum()
                        }
                    })
                    .collect(),
            )
        };
        DeviceSummary {
            kind: kind.to_string(),
            memory_max_bytes: plan.capacity_bytes,
            placement: plan.describe(),
            peak_bytes: peak(|d| d.peak_bytes),
            peak_params_bytes: peak(|d| d.peak_params_bytes),
            peak_grads_bytes: peak(|d| d.peak_grads_bytes),
            peak_activations_bytes: peak(|d| d.peak_activations_bytes),
            planned_bytes: plan.device_bytes(),
            h2d_bytes_per_step: per_step(&|d| d.h2d_bytes as f64, false) as u64,
            d2h_bytes_per_step: per_step(&|d| d.d2h_bytes as f64, false) as u64,
            planned_h2d_bytes_per_step: ranks * plan.h2d_bytes_per_step,
            planned_d2h_bytes_per_step: ranks * plan.d2h_bytes_per_step,
            copy_wait_s_per_step: per_step(&|d| d.copy_wait_s, true),
            link_busy_s_per_step: per_step(&|d| d.link_busy_s, true),
        }
    }
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
            let part = |i: usize| {
                let xs: Vec<f64> = records
                    .iter()
                    .flat_map(|rec| {
                        let wall = rec.duration_ms as f64 / 1e3;
                        rec.reports
                            .iter()
                            .filter(|x| x.rank == r.rank)
                            .map(move |x| split(x, wall)[i])
                    })
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
                optimizer_s_per_step: part(2),
                collectives_s_per_step: part(1),
                outside_s_per_step: part(3),
            }
        })
        .collect()
}
