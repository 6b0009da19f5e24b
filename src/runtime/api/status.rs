//! What an operator sees of a running job: the status document behind `GET /status`, the
//! Prometheus text behind `GET /metrics`, and the counters both are built from.
//!
//! The counters are fed from the cluster's event stream (steps, membership changes, the end of
//! the run); the live part (map, step, backups) comes from the coordinator's `CoordView`. Bytes
//! moved by a membership change are recomputed from the shard maps with the same pure functions
//! the ranks use (`rebalance`, `reshard::transfers`), so they are what actually travelled, not an
//! estimate. Nothing here does I/O.

use crate::model::backend::{DeviceCounters, DeviceKind};
use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;

use serde::Serialize;

use crate::engine::coordinator::{MembershipRecord, StepRecord};
use crate::plan::rebalance::rebalance;
use crate::plan::replica::holders;
use crate::plan::{RankId, ShardMap, Stage};
use crate::runtime::actors::{Activity, CoordView};
use crate::runtime::step::elastic::reshard::transfers;
use crate::runtime::step::state::rank_state::OptimSettings;

/// Membership changes kept for `/status` (older ones are counted, not listed).
pub const HISTORY_MAX: usize = 256;

/// How much state one parameter element carries when it moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateLayout {
    pub stage: Stage,
    /// Optimizer state elements per parameter (Adam: 2).
    pub state_per_param: u64,
    /// The fp32 masters live with the optimizer state (stage 3; every stage under bf16).
    pub masters_in_shard: bool,
}

impl StateLayout {
    pub fn new(stage: Stage, optim: &OptimSettings, param_copy_bytes: u64) -> Self {
        Self {
            stage,
            state_per_param: optim.state_per_param(),
            masters_in_shard: crate::plan::memory::masters_in_shard(stage, param_copy_bytes),
        }
    }

    /// Bytes of fp32 master parameters plus optimizer state per owned element.
    pub fn owned_bytes_per_elem(&self) -> u64 {
        4 * (1 + self.state_per_param)
    }
}

/// Payload bytes (fp32 parameters and optimizer state; no framing or checksums) that a reshard
/// from `old` to `new` sends, where `sender(unit, index)` holds each chunk's state.
pub fn reshard_payload_bytes(
    old: &ShardMap,
    new: &ShardMap,
    layout: StateLayout,
    sender: &dyn Fn(usize, usize) -> RankId,
) -> u64 {
    transfers(old, new, layout.stage, layout.masters_in_shard, sender)
        .values()
        .flatten()
        .map(|&(u, i, need)| {
            let len = old.chunk_range(u, i).len() as u64;
            let slots = u64::from(need.params) + u64::from(need.opt) * layout.state_per_param;
            4 * len * slots
        })
        .sum()
}

/// Follows the shard map through a run's membership records, to price each change in bytes.
pub struct MapTracker {
    map: ShardMap,
    layout: StateLayout,
}

impl MapTracker {
    pub fn new(map: ShardMap, layout: StateLayout) -> Self {
        Self { map, layout }
    }

    /// The payload bytes `rec` moved, or `None` if `rec` does not follow from the tracked map
    /// (the tracker then trusts the record's membership and reports no number).
    pub fn apply(&mut self, rec: &MembershipRecord) -> Option<u64> {
        let (new, _) = rebalance(&self.map, &rec.after).ok()?;
        let follows = rec.before == self.map.members && new.epoch == rec.epoch;
        let bytes = follows
            .then(|| {
                if rec.rolled_back_to.is_some() {
                    let holder = holders(&self.map, &rec.lost).ok()?;
                    Some(reshard_payload_bytes(&self.map, &new, self.layout, &holder))
                } else {
                    let owner = |u: usize, i: usize| self.map.owner(u, i);
                    Some(reshard_payload_bytes(&self.map, &new, self.layout, &owner))
                }
            })
            .flatten();
        self.map = new;
        bytes
    }
}

/// One completed membership change with its cost.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChangeRecord {
    #[serde(flatten)]
    pub record: MembershipRecord,
    /// What `MapTracker::apply` computed; `None` if it could not.
    pub moved_bytes: Option<u64>,
}

impl ChangeRecord {
    pub fn is_recovery(&self) -> bool {
        self.record.rolled_back_to.is_some()
    }
}

/// Whether the run goes on.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(tag = "state", content = "reason", rename_all = "snake_case")]
pub enum RunState {
    #[default]
    Running,
    Finished,
    Failed(String),
}

/// Counters accumulated from the event stream.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Telemetry {
    pub run: RunState,
    pub steps_completed: u64,
    pub step_ms_last: Option<u64>,
    pub step_ms_sum: u64,
    pub loss_last: Option<f64>,
    /// The learning rate of the newest completed step.
    pub lr_last: Option<f32>,
    /// The newest held-out evaluation: its loss, perplexity and the steps completed then.
    pub eval_last: Option<EvalLast>,
    /// Graceful changes (leaves, joins) and recoveries from abrupt losses.
    pub rebalances: u64,
    pub recoveries: u64,
    pub recovery_ms_last: Option<u64>,
    /// Steps run again after rollbacks.
    pub replayed_steps: u64,
    pub moved_bytes_last: Option<u64>,
    pub moved_bytes_total: u64,
    pub moved_elems_total: u64,
    pub min_elems_total: u64,
    pub snapshots: u64,
    /// Joiners that did not come up (the change went on without them).
    pub failed_joins: u64,
    /// Drains granted, by who asked.
    pub drains: Drains,
    /// The newest `HISTORY_MAX` changes, oldest first.
    pub history: VecDeque<ChangeRecord>,
    /// Each rank's NVMe tier in the newest completed step.
    pub tiers: BTreeMap<RankId, TierLast>,
    /// Each rank's device in the newest completed step (`--device`).
    pub devices: BTreeMap<RankId, DeviceCounters>,
    /// With a metadata store (`--meta`): who leads the job and its failovers.
    pub leader: Option<LeaderStatus>,
    /// A takeover's start (seconds on the run's stopwatch), until its first completed step.
    pub takeover_since_s: Option<f64>,
}

/// The coordinator that leads a job kept in a metadata store.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LeaderStatus {
    /// Its `--coordinator-id`.
    pub coordinator: String,
    /// Its term, the fencing token its commands carry.
    pub term: u64,
    /// Leaders that took the job over so far (this one included if it did).
    pub failovers: u64,
    /// This leader's takeover: from its election to the first step completed after it.
    pub failover_seconds_last: Option<f64>,
}

/// A held-out evaluation (`--eval-data`, `--eval-every`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct EvalLast {
    /// Steps completed when it ran (1-based).
    pub step: u64,
    pub loss: f64,
    pub perplexity: f64,
}

/// Who asked a rank to drain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrainCause {
    /// An operator or orchestrator: `POST /ranks/{id}/drain`, `ControlHandle::drain`.
    Operator,
    /// The worker itself, given notice by a signal (SIGTERM: a pod eviction, a spot
    /// preemption).
    Signal,
}

/// Drains granted, by cause, and how long the newest notice took to become a departure.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Drains {
    pub operator: u64,
    pub signal: u64,
    /// Seconds from a worker's notice to the membership change that let it go.
    pub seconds_last: Option<f64>,
}

impl Drains {
    pub fn granted(&mut self, cause: DrainCause) {
        match cause {
            DrainCause::Operator => self.operator += 1,
            DrainCause::Signal => self.signal += 1,
        }
    }
}

/// One rank's NVMe tier in the newest completed step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct TierLast {
    /// Bytes of its tier file.
    pub bytes: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub io_wait_s: f64,
    /// Read and written bytes over the step's duration.
    pub read_bytes_per_s: f64,
    pub write_bytes_per_s: f64,
}

impl Telemetry {
    pub fn on_step(&mut self, rec: &StepRecord) {
        self.steps_completed += 1;
        self.step_ms_last = Some(rec.duration_ms);
        self.step_ms_sum += rec.duration_ms;
        self.loss_last = Some(rec.loss);
        self.lr_last = Some(rec.lr);
        if let Some(loss) = rec.eval_loss {
            self.eval_last = Some(EvalLast {
                step: rec.step + 1,
                loss,
                perplexity: loss.exp(),
            });
        }
        let secs = (rec.duration_ms.max(1)) as f64 / 1e3;
        self.devices = rec
            .reports
            .iter()
            .filter_map(|r| r.device.map(|d| (r.rank, d)))
            .collect();
        self.tiers = rec
            .reports
            .iter()
            .filter(|r| r.tier_bytes > 0)
            .map(|r| {
                let t = TierLast {
                    bytes: r.tier_bytes,
                    read_bytes: r.tier_read_bytes,
                    write_bytes: r.tier_write_bytes,
                    io_wait_s: r.io_wait_s,
                    read_bytes_per_s: r.tier_read_bytes as f64 / secs,
                    write_bytes_per_s: r.tier_write_bytes as f64 / secs,
                };
                (r.rank, t)
            })
            .collect();
    }

    pub fn on_change(&mut self, change: ChangeRecord) {
        let rec = &change.record;
        if let Some(back) = rec.rolled_back_to {
            self.recoveries += 1;
            self.recovery_ms_last = Some(rec.duration_ms);
            // `step` is the step the failure struck; training resumes at `back`.
            self.replayed_steps += rec.step.saturating_sub(back);
        } else {
            self.rebalances += 1;
        }
        self.moved_bytes_last = change.moved_bytes;
        self.moved_bytes_total += change.moved_bytes.unwrap_or(0);
        self.moved_elems_total += rec.moved_chunk_elems as u64;
        self.min_elems_total += rec.min_chunk_elems as u64;
        if self.history.len() == HISTORY_MAX {
            self.history.pop_front();
        }
        self.history.push_back(change);
    }

    pub fn on_snapshot(&mut self) {
        self.snapshots += 1;
    }
}

/// One member's share of the training state.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RankShare {
    pub rank: RankId,
    pub chunks: usize,
    pub owned_elems: u64,
    /// fp32 master parameters plus optimizer state of the owned chunks.
    pub owned_state_bytes: u64,
    /// Where it runs, when known (worker processes): buddy backups go to other hosts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Its NVMe tier in the newest completed step (absent with all state in RAM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<TierLast>,
    /// Its device in the newest completed step: bytes up and down and the compute's wait on
    /// copies in the step, its peak and what it holds by kind (absent without a device).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<DeviceCounters>,
}

/// The document behind `GET /status`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Status {
    #[serde(flatten)]
    pub run: RunState,
    pub epoch: u64,
    /// The next step to run (steps completed, after any rollback).
    pub step: u64,
    pub steps: u64,
    pub members: Vec<RankId>,
    pub min_ranks: u32,
    pub max_ranks: u32,
    pub shards: Vec<RankShare>,
    /// The step before which the newest complete buddy backup was taken.
    pub backup_step: Option<u64>,
    /// Steps a loss now would replay (step minus backup step); `None` without a backup.
    pub replica_lag_steps: Option<u64>,
    /// Operator kills that strike when the next step starts.
    pub pending_kills: Vec<RankId>,
    /// What the ranks were last told to do: `{"phase": "running", "step": 4}`, ...
    pub activity: Activity,
    /// Ranks that have not answered `activity` yet.
    pub awaiting: Vec<RankId>,
    pub telemetry: TelemetrySummary,
    /// Membership changes and recoveries, oldest first.
    pub membership: Vec<ChangeRecord>,
    /// With worker processes: standby workers connected, which joins can take (absent
    /// in-process).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub standbys: Option<usize>,
    /// With worker processes: the data plane each pair of members uses (`ucx`, `tcp` or
    /// `quic`; absent in-process).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_planes: Option<Vec<PlanePair>>,
    /// With a metadata store: the leading coordinator, its term and the failovers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leader: Option<LeaderStatus>,
}

/// The data plane between two members.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PlanePair {
    pub ranks: [RankId; 2],
    pub plane: String,
}

/// The counters of `Telemetry` without the history (which `Status` lists once).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TelemetrySummary {
    pub steps_completed: u64,
    pub step_ms_last: Option<u64>,
    pub step_ms_sum: u64,
    pub loss_last: Option<f64>,
    pub lr_last: Option<f32>,
    pub eval_last: Option<EvalLast>,
    pub rebalances: u64,
    pub recoveries: u64,
    pub recovery_ms_last: Option<u64>,
    pub replayed_steps: u64,
    pub moved_bytes_last: Option<u64>,
    pub moved_bytes_total: u64,
    pub moved_elems_total: u64,
    pub min_elems_total: u64,
    pub snapshots: u64,
    pub failed_joins: u64,
    pub drains: Drains,
}

impl Status {
    pub fn build(view: &CoordView, t: &Telemetry, layout: StateLayout) -> Self {
        let map = &view.map;
        let shards = map
            .members
            .iter()
            .map(|&rank| {
                let owned = map.owned_elems(rank) as u64;
                RankShare {
                    rank,
                    chunks: map.owned_chunks(rank).len(),
                    owned_elems: owned,
                    owned_state_bytes: owned * layout.owned_bytes_per_elem(),
                    host: map.hosts.get(&rank).cloned(),
                    tier: t.tiers.get(&rank).copied(),
                    device: t.devices.get(&rank).copied(),
                }
            })
            .collect();
        Self {
            run: t.run.clone(),
            epoch: map.epoch,
            step: view.step,
            steps: view.steps,
            members: map.members.clone(),
            min_ranks: view.min_ranks,
            max_ranks: view.max_ranks,
            shards,
            backup_step: view.backup_step,
            replica_lag_steps: view.backup_step.map(|b| view.step.saturating_sub(b)),
            pending_kills: view.pending_kills.clone(),
            activity: view.activity,
            awaiting: view.awaiting.clone(),
            telemetry: TelemetrySummary {
                steps_completed: t.steps_completed,
                step_ms_last: t.step_ms_last,
                step_ms_sum: t.step_ms_sum,
                loss_last: t.loss_last,
                lr_last: t.lr_last,
                eval_last: t.eval_last,
                rebalances: t.rebalances,
                recoveries: t.recoveries,
                recovery_ms_last: t.recovery_ms_last,
                replayed_steps: t.replayed_steps,
                moved_bytes_last: t.moved_bytes_last,
                moved_bytes_total: t.moved_bytes_total,
                moved_elems_total: t.moved_elems_total,
                min_elems_total: t.min_elems_total,
                snapshots: t.snapshots,
                failed_joins: t.failed_joins,
                drains: t.drains,
            },
            membership: t.history.iter().cloned().collect(),
            standbys: None,
            data_planes: None,
            leader: t.leader.clone(),
        }
    }

    /// Prometheus text exposition format (version 0.0.4).
    pub fn prometheus(&self) -> String {
        let mut out = String::new();
        self.progress_metrics(&mut out);
        self.change_metrics(&mut out);
        self.rank_metrics(&mut out);
        self.device_metrics(&mut out);
        out
    }

    /// Whether the run goes on, where it is, and how long its steps take.
    fn progress_metrics(&self, out: &mut String) {
        let t = &self.telemetry;
        let running = matches!(self.run, RunState::Running);
        metric(
            out,
            "ezero_up",
            "gauge",
            "1 while the run goes on.",
            u8::from(running).to_string(),
        );
        metric(
            out,
            "ezero_epoch",
            "gauge",
            "Shard-map epoch.",
            self.epoch.to_string(),
        );
        metric(
            out,
            "ezero_step",
            "gauge",
            "Next step to run.",
            self.step.to_string(),
        );
        metric(
            out,
            "ezero_members",
            "gauge",
            "Ranks in the job.",
            self.members.len().to_string(),
        );
        metric(
            out,
            "ezero_steps_completed_total",
            "counter",
            "Steps completed, replays included.",
            t.steps_completed.to_string(),
        );
        metric(
            out,
            "ezero_step_seconds_last",
            "gauge",
            "Duration of the newest completed step.",
            secs(t.step_ms_last.unwrap_or(0)),
        );
        metric(
            out,
            "ezero_step_seconds_sum",
            "counter",
            "Total duration of completed steps.",
            secs(t.step_ms_sum),
        );
        self.learning_metrics(out);
    }

    /// The newest step's training loss and learning rate, and the newest held-out loss; each
    /// only once there is one.
    fn learning_metrics(&self, out: &mut String) {
        let t = &self.telemetry;
        let gauges = [
            (
                "ezero_train_loss",
                "Training loss of the newest completed step (nats per token).",
                t.loss_last,
            ),
            (
                "ezero_learning_rate",
                "Learning rate of the newest completed step.",
                t.lr_last.map(f64::from),
            ),
            (
                "ezero_eval_loss",
                "Held-out loss of the newest evaluation (nats per token).",
                t.eval_last.map(|e| e.loss),
            ),
            (
                "ezero_eval_step",
                "Steps completed at the newest evaluation.",
                t.eval_last.map(|e| e.step as f64),
            ),
        ];
        for (name, help, value) in gauges {
            if let Some(v) = value {
                metric(out, name, "gauge", help, v.to_string());
            }
        }
    }

    /// Membership changes and recoveries: how many, how long, and what they moved.
    fn change_metrics(&self, out: &mut String) {
        if let Some(l) = &self.leader {
            leader_metrics(out, l);
        }
        let t = &self.telemetry;
        metric(
            out,
            "ezero_rebalances_total",
            "counter",
            "Graceful membership changes (leaves, joins).",
            t.rebalances.to_string(),
        );
        metric(
            out,
            "ezero_failed_joins_total",
            "counter",
            "Joiners that did not come up; their change went on without them.",
            t.failed_joins.to_string(),
        );
        metric(
            out,
            "ezero_recoveries_total",
            "counter",
            "Recoveries from abrupt rank loss.",
            t.recoveries.to_string(),
        );
        metric(
            out,
            "ezero_recovery_seconds_last",
            "gauge",
            "Duration of the newest recovery (loss detected to state rebuilt).",
            secs(t.recovery_ms_last.unwrap_or(0)),
        );
        metric(
            out,
            "ezero_replayed_steps_total",
            "counter",
            "Steps run again after rollbacks.",
            t.replayed_steps.to_string(),
        );
        metric(
            out,
            "ezero_rebalance_moved_bytes_last",
            "gauge",
            "Payload bytes moved by the newest membership change.",
            t.moved_bytes_last.unwrap_or(0).to_string(),
        );
        metric(
            out,
            "ezero_rebalance_moved_bytes_total",
            "counter",
            "Payload bytes moved by all membership changes.",
            t.moved_bytes_total.to_string(),
        );
        metric(
            out,
            "ezero_rebalance_moved_elems_total",
            "counter",
            "Chunk elements whose owner changed.",
            t.moved_elems_total.to_string(),
        );
        metric(
            out,
            "ezero_rebalance_min_elems_total",
            "counter",
            "Lower bound on elements that had to change owner.",
            t.min_elems_total.to_string(),
        );
        self.drain_metrics(out);
        if let Some(lag) = self.replica_lag_steps {
            metric(
                out,
                "ezero_replica_lag_steps",
                "gauge",
                "Steps since the newest complete buddy backup.",
                lag.to_string(),
            );
        }
    }

    /// Drains by cause, and the newest notice's time to leave.
    fn drain_metrics(&self, out: &mut String) {
        let d = &self.telemetry.drains;
        let _ = write!(
            out,
            "# HELP ezero_drains_total Ranks drained gracefully, by who asked (operator: the control API; signal: the worker's own SIGTERM).\n# TYPE ezero_drains_total counter\nezero_drains_total{{cause=\"operator\"}} {}\nezero_drains_total{{cause=\"signal\"}} {}\n",
            d.operator, d.signal
        );
        if let Some(s) = d.seconds_last {
            metric(
                out,
                "ezero_drain_seconds_last",
                "gauge",
                "Seconds from the newest worker notice (SIGTERM) to the change that let it leave.",
                format!("{s:.3}"),
            );
        }
    }

    /// One series per rank: its tier's traffic (where it has a tier) and the state it owns.
    fn rank_metrics(&self, out: &mut String) {
        let tiers: Vec<(RankId, TierLast)> = self
            .shards
            .iter()
            .filter_map(|s| s.tier.map(|t| (s.rank, t)))
            .collect();
        type Field = fn(&TierLast) -> String;
        let tier_metrics: [(&str, &str, Field); 4] = [
            (
                "ezero_rank_tier_bytes",
                "Bytes of a rank's NVMe tier file.",
                |t| t.bytes.to_string(),
            ),
            (
                "ezero_rank_tier_read_bytes_per_second",
                "A rank's tier reads over the newest step's duration.",
                |t| format!("{:.0}", t.read_bytes_per_s),
            ),
            (
                "ezero_rank_tier_write_bytes_per_second",
                "A rank's tier writes over the newest step's duration.",
                |t| format!("{:.0}", t.write_bytes_per_s),
            ),
            (
                "ezero_rank_tier_wait_seconds_last",
                "Seconds a rank waited for its tier in the newest step.",
                |t| format!("{:.6}", t.io_wait_s),
            ),
        ];
        for (name, help, value) in tier_metrics.iter().filter(|_| !tiers.is_empty()) {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for (rank, t) in &tiers {
                let _ = writeln!(out, "{name}{{rank=\"{rank}\"}} {}", value(t));
            }
        }
        out.push_str("# HELP ezero_rank_owned_bytes fp32 parameters and optimizer state a rank owns.\n# TYPE ezero_rank_owned_bytes gauge\n");
        for s in &self.shards {
            let _ = writeln!(
                out,
                "ezero_rank_owned_bytes{{rank=\"{}\"}} {}",
                s.rank, s.owned_state_bytes
            );
        }
    }
}

/// One metric without labels, with its help and type lines.
impl Status {
    /// One series per rank on a device: its memory and its link in the newest step.
    fn device_metrics(&self, out: &mut String) {
        let devs: Vec<(RankId, DeviceCounters)> = self
            .shards
            .iter()
            .filter_map(|s| s.device.map(|d| (s.rank, d)))
            .collect();
        type Field = fn(&DeviceCounters) -> String;
        let series: [(&str, &str, Field); 6] = [
            (
                "ezero_rank_device_peak_bytes",
                "The most device memory a rank held at once.",
                |d| d.peak_bytes.to_string(),
            ),
            (
                "ezero_rank_device_capacity_bytes",
                "A rank's device memory budget (--device-memory-max).",
                |d| d.capacity_bytes.to_string(),
            ),
            (
                "ezero_rank_device_h2d_bytes_last",
                "Bytes a rank copied host to device in the newest step.",
                |d| d.h2d_bytes.to_string(),
            ),
            (
                "ezero_rank_device_d2h_bytes_last",
                "Bytes a rank copied device to host in the newest step.",
                |d| d.d2h_bytes.to_string(),
            ),
            (
                "ezero_rank_device_copy_wait_seconds_last",
                "Seconds a rank's compute waited on copies in the newest step.",
                |d| format!("{:.6}", d.copy_wait_s),
            ),
            (
                "ezero_rank_device_link_busy_seconds_last",
                "Seconds a rank's host link was busy in the newest step.",
                |d| format!("{:.6}", d.link_busy_s),
            ),
        ];
        for (name, help, value) in series.iter().filter(|_| !devs.is_empty()) {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for (rank, d) in &devs {
                let _ = writeln!(out, "{name}{{rank=\"{rank}\"}} {}", value(d));
            }
        }
        if devs.is_empty() {
            return;
        }
        // Parameters and gradients stream through the device a unit at a time, so what it
        // holds at a step's end is nothing; the peak of each kind is what the budget bounds.
        let name = "ezero_rank_device_kind_peak_bytes";
        let _ = writeln!(
            out,
            "# HELP {name} The most device bytes of one kind (params, grads, activations) a rank held at once.\n# TYPE {name} gauge"
        );
        for (rank, d) in &devs {
            for kind in DeviceKind::ALL {
                let _ = writeln!(
                    out,
                    "{name}{{rank=\"{rank}\",kind=\"{}\"}} {}",
                    kind.name(),
                    d.peak(kind)
                );
            }
        }
    }
}

fn metric(out: &mut String, name: &str, kind: &str, help: &str, value: String) {
    // Writing to a String cannot fail.
    let _ = write!(
        out,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
    );
}

fn secs(ms: u64) -> String {
    format!("{:.3}", ms as f64 / 1e3)
}

/// The leader's term and the job's failovers (only for a job kept in a metadata store).
fn leader_metrics(out: &mut String, l: &LeaderStatus) {
    metric(
        out,
        "ezero_leader_term",
        "gauge",
        "Term of the coordinator that leads the job (its fencing token).",
        l.term.to_string(),
    );
    metric(
        out,
        "ezero_failovers_total",
        "counter",
        "Coordinators that took the job over after its leader was lost.",
        l.failovers.to_string(),
    );
    if let Some(s) = l.failover_seconds_last {
        metric(
            out,
            "ezero_failover_seconds_last",
            "gauge",
            "This leader's takeover: its election to the first step completed after it.",
            s.to_string(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::rebalance::diff;

    fn layout(stage: Stage) -> StateLayout {
        StateLayout {
            stage,
            state_per_param: 2,
            masters_in_shard: stage == Stage::Zero3,
        }
    }

    fn record(old: &ShardMap, after: &[RankId], lost: &[RankId]) -> MembershipRecord {
        let (new, _) = rebalance(old, after).unwrap();
        MembershipRecord {
            step: 5,
            epoch: new.epoch,
            before: old.members.clone(),
            after: new.members.clone(),
            moved_chunk_elems: diff(old, &new).iter().map(|m| m.elems).sum(),
            min_chunk_elems: 0,
            duration_ms: 7,
            lost: lost.to_vec(),
            rolled_back_to: (!lost.is_empty()).then_some(4),
            takeover: false,
        }
    }

    #[test]
    fn a_zero3_leave_moves_parameters_and_both_moments_of_the_moved_chunks() {
        let old = ShardMap::plan(&[1000, 600], &[0, 1, 2], 100, 1).unwrap();
        let rec = record(&old, &[0, 2], &[]);
        let mut t = MapTracker::new(old.clone(), layout(Stage::Zero3));
        assert_eq!(t.apply(&rec), Some(12 * rec.moved_chunk_elems as u64));
        // Stages 1-2: the survivors hold every parameter already; only the moments travel.
        let mut t = MapTracker::new(old, layout(Stage::Zero1));
        assert_eq!(t.apply(&rec), Some(8 * rec.moved_chunk_elems as u64));
    }

    #[test]
    fn a_record_that_does_not_follow_the_tracked_map_has_no_price() {
        let old = ShardMap::plan(&[1000], &[0, 1, 2], 100, 1).unwrap();
        let mut rec = record(&old, &[0, 2], &[]);
        rec.epoch += 1;
        let mut t = MapTracker::new(old, layout(Stage::Zero3));
        assert_eq!(t.apply(&rec), None);
    }

    #[test]
    fn recoveries_are_priced_from_the_buddies_and_counted_apart() {
        let old = ShardMap::plan(&[1000], &[0, 1, 2], 100, 1).unwrap();
        let rec = record(&old, &[0, 2], &[1]);
        let mut tracker = MapTracker::new(old, layout(Stage::Zero3));
        let bytes = tracker.apply(&rec);
        assert!(bytes.is_some_and(|b| b > 0));
        let mut t = Telemetry::default();
        t.on_change(ChangeRecord {
            record: rec,
            moved_bytes: bytes,
        });
        assert_eq!((t.recoveries, t.rebalances, t.replayed_steps), (1, 0, 1));
        assert_eq!(t.recovery_ms_last, Some(7));
        assert_eq!(t.moved_bytes_total, bytes.unwrap());
    }

    #[test]
    fn history_is_bounded() {
        let old = ShardMap::plan(&[100], &[0, 1], 10, 1).unwrap();
        let rec = record(&old, &[0], &[]);
        let mut t = Telemetry::default();
        for _ in 0..HISTORY_MAX + 3 {
            t.on_change(ChangeRecord {
                record: rec.clone(),
                moved_bytes: Some(1),
            });
        }
        assert_eq!(t.history.len(), HISTORY_MAX);
        assert_eq!(t.rebalances, HISTORY_MAX as u64 + 3);
    }
}
