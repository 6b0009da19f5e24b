//! The coordinator as a state machine: events in (with the current time), commands out.
//!
//! It sequences steps: hands every rank the same `StepPlan`, collects one `StepReport` per rank,
//! checks that the ranks agree, and either plans the next step or finishes. It never touches a
//! socket, a thread or the clock; the actor in `runtime` feeds it and executes its commands.

use std::collections::BTreeMap;

use crate::engine::messages::{StepPlan, StepReport};
use crate::optim::lr::LrSchedule;
use crate::plan::schedule::assign_micro_batches;
use crate::plan::{RankId, ShardMap};
use crate::reduce::exact;

/// Where a job stands between steps: enough, with every chunk's state, to resume bit for bit.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Progress {
    /// The next step to run (steps completed so far).
    pub step: u64,
    /// Optimizer updates applied so far (skipped steps do not count).
    pub opt_step: u64,
    /// Per-unit gradient bounds for the next step's exact-reduction scale.
    pub grad_bounds: Vec<f32>,
}

/// What the coordinator needs to know about the job.
#[derive(Clone, Debug)]
pub struct JobSpec {
    pub steps: u64,
    pub micro_batches: u32,
    pub lr: LrSchedule,
    /// A step that has not completed this long after it started fails the run.
    pub step_timeout_ms: u64,
    /// Gradient bound for the first step's exact-reduction scale.
    pub initial_grad_bound: f32,
    /// Take a snapshot after every this many steps (0: only when asked).
    pub snapshot_every: u64,
}

/// Inputs to the state machine.
#[derive(Clone, Debug)]
pub enum Event {
    /// All ranks are up: start the first step.
    Start {
        now_ms: u64,
    },
    StepDone {
        report: Box<StepReport>,
        now_ms: u64,
    },
    /// A rank could not finish (its compute failed, it panicked, or it vanished).
    RankFailed {
        rank: RankId,
        reason: String,
        now_ms: u64,
    },
    Tick {
        now_ms: u64,
    },
    /// Snapshot at the next step boundary (a SIGTERM, an operator's request).
    SnapshotRequested,
}

/// A finished step, as the coordinator saw it.
#[derive(Clone, Debug)]
pub struct StepRecord {
    pub step: u64,
    /// Mean of the micro-batch losses, summed in micro-batch order.
    pub loss: f64,
    pub grad_norm: f64,
    pub skipped: bool,
    pub attempts: u32,
    pub duration_ms: u64,
    pub reports: Vec<StepReport>,
}

/// Outputs: what the runtime must do.
#[derive(Clone, Debug)]
pub enum Command {
    RunStep(StepPlan),
    StepCompleted(Box<StepRecord>),
    /// Every rank is idle at a step boundary: capture every chunk's state with this progress
    /// before running the next step.
    Snapshot(Progress),
    Finish,
    Abort {
        reason: String,
    },
}

#[derive(Clone, Debug, PartialEq)]
enum Phase {
    Idle,
    Running { started_ms: u64 },
    Done,
    Failed,
}

/// Step sequencing for one job on one epoch's shard map.
pub struct Coordinator {
    job: JobSpec,
    map: ShardMap,
    step: u64,
    opt_step: u64,
    bounds: Vec<f32>,
    phase: Phase,
    reports: BTreeMap<RankId, StepReport>,
    snapshot_requested: bool,
}

impl Coordinator {
    pub fn new(job: JobSpec, map: ShardMap) -> Self {
        let progress = Progress {
            step: 0,
            opt_step: 0,
            grad_bounds: vec![job.initial_grad_bound; map.units.len()],
        };
        Self::resume(job, map, progress)
    }

    /// A coordinator that continues a job from `progress` (a restored snapshot).
    pub fn resume(job: JobSpec, map: ShardMap, progress: Progress) -> Self {
        Self {
            job,
            map,
            step: progress.step,
            opt_step: progress.opt_step,
            bounds: progress.grad_bounds,
            phase: Phase::Idle,
            reports: BTreeMap::new(),
            snapshot_requested: false,
        }
    }

    pub fn progress(&self) -> Progress {
        Progress {
            step: self.step,
            opt_step: self.opt_step,
            grad_bounds: self.bounds.clone(),
        }
    }

    pub fn map(&self) -> &ShardMap {
        &self.map
    }

    pub fn step(&self) -> u64 {
        self.step
    }

    pub fn is_finished(&self) -> bool {
        matches!(self.phase, Phase::Done | Phase::Failed)
    }

    pub fn handle(&mut self, event: Event) -> Vec<Command> {
        if self.is_finished() {
            return Vec::new();
        }
        match event {
            Event::Start { now_ms } => self.start_step(now_ms),
            Event::StepDone { report, now_ms } => self.on_report(*report, now_ms),
            Event::RankFailed { rank, reason, .. } => self.fail(format!(
                "rank {rank} failed at step {}: {reason}",
                self.step
            )),
            Event::Tick { now_ms } => self.on_tick(now_ms),
            Event::SnapshotRequested => {
                self.snapshot_requested = true;
                Vec::new()
            }
        }
    }

    fn start_step(&mut self, now_ms: u64) -> Vec<Command> {
        if self.step >= self.job.steps {
            self.phase = Phase::Done;
            return vec![Command::Finish];
        }
        self.phase = Phase::Running { started_ms: now_ms };
        self.reports.clear();
        vec![Command::RunStep(StepPlan {
            epoch: self.map.epoch,
            step: self.step,
            assignment: assign_micro_batches(&self.map.members, self.job.micro_batches),
            micro_batches: self.job.micro_batches,
            lr: self.job.lr.lr_at(self.opt_step + 1),
            opt_step: self.opt_step + 1,
            grad_bounds: self.bounds.clone(),
        })]
    }

    fn on_report(&mut self, report: StepReport, now_ms: u64) -> Vec<Command> {
        let Phase::Running { started_ms } = self.phase else {
            return Vec::new();
        };
        if report.step != self.step || report.epoch != self.map.epoch {
            return Vec::new(); // stale: a report from an earlier step or epoch
        }
        if !self.map.is_member(report.rank) {
            return Vec::new();
        }
        self.reports.insert(report.rank, report);
        if self.reports.len() < self.map.world_size() {
            return Vec::new();
        }
        let reports: Vec<StepReport> = std::mem::take(&mut self.reports).into_values().collect();
        if let Some(reason) = disagreement(&reports) {
            return self.fail(format!("ranks disagree at step {}: {reason}", self.step));
        }
        let first = &reports[0];
        let loss = mean_in_order(&first.losses);
        let record = StepRecord {
            step: self.step,
            loss,
            grad_norm: first.grad_norm,
            skipped: first.skipped,
            attempts: first.attempts,
            duration_ms: now_ms.saturating_sub(started_ms),
            reports: reports.clone(),
        };
        if !first.skipped {
            self.opt_step += 1;
        }
        self.bounds = first
            .unit_max_abs
            .iter()
            .map(|&m| exact::next_bound(m))
            .collect();
        self.step += 1;
        let mut out = vec![Command::StepCompleted(Box::new(record))];
        let every = self.job.snapshot_every;
        if self.snapshot_requested || (every > 0 && self.step % every == 0) {
            self.snapshot_requested = false;
            out.push(Command::Snapshot(self.progress()));
        }
        out.extend(self.start_step(now_ms));
        out
    }

    fn on_tick(&mut self, now_ms: u64) -> Vec<Command> {
        match self.phase {
            Phase::Running { started_ms }
                if now_ms.saturating_sub(started_ms) > self.job.step_timeout_ms =>
            {
                let missing: Vec<RankId> = self
                    .map
                    .members
                    .iter()
                    .copied()
                    .filter(|r| !self.reports.contains_key(r))
                    .collect();
                self.fail(format!(
                    "step {} did not complete within {} ms; no report from ranks {missing:?}",
                    self.step, self.job.step_timeout_ms
                ))
            }
            _ => Vec::new(),
        }
    }

    fn fail(&mut self, reason: String) -> Vec<Command> {
        self.phase = Phase::Failed;
        vec![Command::Abort { reason }]
    }
}

/// Ranks must agree on everything that was agreed inside the step; a mismatch is a bug.
fn disagreement(reports: &[StepReport]) -> Option<String> {
    let first = &reports[0];
    reports.iter().skip(1).find_map(|r| {
        let same = r
            .losses
            .iter()
            .map(|x| x.to_bits())
            .eq(first.losses.iter().map(|x| x.to_bits()))
            && r.unit_max_abs
                .iter()
                .map(|x| x.to_bits())
                .eq(first.unit_max_abs.iter().map(|x| x.to_bits()))
            && r.skipped == first.skipped
            && r.grad_norm.to_bits() == first.grad_norm.to_bits();
        (!same).then(|| {
            format!(
                "rank {} and rank {} report different agreed values",
                first.rank, r.rank
            )
        })
    })
}

/// Mean in index order, so the reported loss is the same whatever the world size.
pub fn mean_in_order(xs: &[f32]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.iter().map(|&x| x as f64).sum::<f64>() / xs.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::memory::Resident;
    use crate::plan::volume::Volume;

    fn job(steps: u64) -> JobSpec {
        JobSpec {
            steps,
            micro_batches: 4,
            lr: LrSchedule {
                base_lr: 1e-3,
                warmup_steps: 0,
                total_steps: 0,
                min_lr_ratio: 1.0,
            },
            step_timeout_ms: 1000,
            initial_grad_bound: exact::INITIAL_BOUND,
            snapshot_every: 0,
        }
    }

    fn report(rank: RankId, step: u64) -> StepReport {
        StepReport {
            rank,
            epoch: 0,
            step,
            losses: vec![1.0, 2.0, 3.0, 4.0],
            unit_max_abs: vec![0.5],
            grad_norm: 1.0,
            clip_coef: 1.0,
            skipped: false,
            attempts: 1,
            sent: Volume::default(),
            bytes_sent: 0,
            resident: Resident::default(),
            peak_bytes: 0,
            peak_gathered_bytes: 0,
            stale_dropped: 0,
            compute_s: 0.0,
        }
    }

    fn done(r: StepReport, now_ms: u64) -> Event {
        Event::StepDone {
            report: Box::new(r),
            now_ms,
        }
    }

    #[test]
    fn runs_steps_in_order_and_finishes() {
        let map = ShardMap::plan(&[10], &[0, 1], 4, 0).unwrap();
        let mut c = Coordinator::new(job(2), map);
        let cmds = c.handle(Event::Start { now_ms: 0 });
        let Command::RunStep(plan) = &cmds[0] else {
            panic!("{cmds:?}")
        };
        assert_eq!((plan.step, plan.opt_step), (0, 1));
        assert!(c.handle(done(report(0, 0), 5)).is_empty());
        // A duplicate or stale report changes nothing.
        assert!(c.handle(done(report(0, 0), 6)).is_empty());
        let cmds = c.handle(done(report(1, 0), 10));
        let Command::StepCompleted(rec) = &cmds[0] else {
            panic!("{cmds:?}")
        };
        assert_eq!(rec.loss, 2.5);
        assert_eq!(rec.duration_ms, 10);
        let Command::RunStep(plan) = &cmds[1] else {
            panic!("{cmds:?}")
        };
        assert_eq!(plan.grad_bounds, vec![exact::next_bound(0.5)]);
        c.handle(done(report(0, 1), 20));
        let cmds = c.handle(done(report(1, 1), 30));
        assert!(matches!(cmds.last(), Some(Command::Finish)));
        assert!(c.is_finished());
    }

    #[test]
    fn snapshots_come_at_step_boundaries_before_the_next_step() {
        let map = ShardMap::plan(&[10], &[0], 4, 0).unwrap();
        let mut c = Coordinator::new(
            JobSpec {
                snapshot_every: 2,
                ..job(5)
            },
            map,
        );
        c.handle(Event::Start { now_ms: 0 });
        let kinds = |cmds: &[Command]| {
            cmds.iter()
                .map(|c| match c {
                    Command::RunStep(_) => "run",
                    Command::StepCompleted(_) => "done",
                    Command::Snapshot(_) => "snap",
                    Command::Finish => "finish",
                    Command::Abort { .. } => "abort",
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(kinds(&c.handle(done(report(0, 0), 1))), ["done", "run"]);
        let cmds = c.handle(done(report(0, 1), 2));
        assert_eq!(kinds(&cmds), ["done", "snap", "run"]);
        let Command::Snapshot(p) = &cmds[1] else {
            unreachable!()
        };
        assert_eq!((p.step, p.opt_step), (2, 2));
        c.handle(Event::SnapshotRequested);
        assert_eq!(
            kinds(&c.handle(done(report(0, 2), 3))),
            ["done", "snap", "run"]
        );
    }

    #[test]
    fn timeout_names_missing_ranks() {
        let map = ShardMap::plan(&[10], &[0, 1, 2], 4, 0).unwrap();
        let mut c = Coordinator::new(job(5), map);
        c.handle(Event::Start { now_ms: 0 });
        c.handle(done(report(1, 0), 5));
        assert!(c.handle(Event::Tick { now_ms: 500 }).is_empty());
        let cmds = c.handle(Event::Tick { now_ms: 2000 });
        let Command::Abort { reason } = &cmds[0] else {
            panic!("{cmds:?}")
        };
        assert!(reason.contains("[0, 2]"), "{reason}");
    }

    #[test]
    fn disagreeing_ranks_abort() {
        let map = ShardMap::plan(&[10], &[0, 1], 4, 0).unwrap();
        let mut c = Coordinator::new(job(5), map);
        c.handle(Event::Start { now_ms: 0 });
        c.handle(done(report(0, 0), 1));
        let mut r = report(1, 0);
        r.grad_norm = 2.0;
        assert!(matches!(c.handle(done(r, 2))[0], Command::Abort { .. }));
    }

    #[test]
    fn failure_aborts_with_the_rank() {
        let map = ShardMap::plan(&[10], &[0, 1], 4, 0).unwrap();
        let mut c = Coordinator::new(job(5), map);
        c.handle(Event::Start { now_ms: 0 });
        let cmds = c.handle(Event::RankFailed {
            rank: 1,
            reason: "boom".into(),
            now_ms: 3,
        });
        let Command::Abort { reason } = &cmds[0] else {
            panic!()
        };
        assert!(reason.contains("rank 1") && reason.contains("boom"));
    }
}
