//! The coordinator as a state machine: events in (with the current time), commands out.
//!
//! It sequences steps: hands every rank the same `StepPlan`, collects one `StepReport` per rank,
//! checks that the ranks agree, and either plans the next step or finishes. It never touches a
//! socket, a thread or the clock; the actor in `runtime` feeds it and executes its commands.

use std::collections::{BTreeMap, BTreeSet};

use crate::engine::messages::{StepPlan, StepReport};
use crate::optim::lr::LrSchedule;
use crate::plan::rebalance::{min_move_elems, rebalance};
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

/// A membership change the job script or an operator asks for, applied at a step boundary.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Change {
    /// The rank drains and leaves (a spot interruption notice).
    Leave(RankId),
    /// This many new ranks join (they take the next unused rank ids).
    Join(u32),
}

/// A change scheduled to take effect at the start of `step`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ScriptedChange {
    pub step: u64,
    pub change: Change,
}

/// Why an operator's request was refused. Nothing changed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("rank {rank} is not a member (members: {members:?})")]
    UnknownRank { rank: RankId, members: Vec<RankId> },
    #[error("that would leave {ranks} ranks, below the minimum of {min}")]
    BelowMin { ranks: usize, min: usize },
    #[error("that would make {ranks} ranks, above the maximum of {max}")]
    AboveMax { ranks: usize, max: usize },
    #[error("the run ends (after {steps} steps) before the next step boundary")]
    RunEnding { steps: u64 },
}

/// A world size outside [min_ranks, max_ranks].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WorldBound {
    #[error("that would leave {ranks} ranks, below the minimum of {min}")]
    BelowMin { ranks: usize, min: usize },
    #[error("that would make {ranks} ranks, above the maximum of {max}")]
    AboveMax { ranks: usize, max: usize },
}

impl From<WorldBound> for Refusal {
    fn from(b: WorldBound) -> Self {
        match b {
            WorldBound::BelowMin { ranks, min } => Refusal::BelowMin { ranks, min },
            WorldBound::AboveMax { ranks, max } => Refusal::AboveMax { ranks, max },
        }
    }
}

/// A completed membership change, for the progress view and the control API.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MembershipRecord {
    /// The step that runs first under the new membership.
    pub step: u64,
    pub epoch: u64,
    pub before: Vec<RankId>,
    pub after: Vec<RankId>,
    /// Elements whose owner changed (parameters of a chunk count once).
    pub moved_chunk_elems: usize,
    /// The lower bound on that for this change (`plan::rebalance::min_move_elems`).
    pub min_chunk_elems: usize,
    pub duration_ms: u64,
    /// For a recovery from an abrupt loss: the ranks lost and the step training rolled back to.
    pub lost: Vec<RankId>,
    pub rolled_back_to: Option<u64>,
    /// The rollback of a new leader taking the job over (`Coordinator::take_over`).
    #[serde(default)]
    pub takeover: bool,
}

impl MembershipRecord {
    /// A rollback that lost no rank and no coordinator: work whose frames the network lost,
    /// redone with the same ranks.
    pub fn is_network_retry(&self) -> bool {
        self.lost.is_empty() && self.rolled_back_to.is_some() && !self.takeover
    }
}

/// What the coordinator needs to know about the job.
#[derive(Clone, Debug)]
pub struct JobSpec {
    pub steps: u64,
    pub micro_batches: u32,
    pub lr: LrSchedule,
    /// A rank that has not reported progress (a finished unit pass or optimizer unit, a backup
    /// or reshard piece moved, or the end of its part) for this long while a step, backup or
    /// reshard runs fails the run; the start of the phase counts as progress. It measures
    /// silence, not length: a step that streams a large model from a slow disk runs as long as
    /// it needs while its ranks keep finishing units. Joiners coming up and a recovery waiting
    /// for the survivors still get this long in all.
    pub step_timeout_ms: u64,
    /// Gradient bound for the first step's exact-reduction scale.
    pub initial_grad_bound: f32,
    /// Take a snapshot after every this many steps and after the last one (0: only when
    /// asked).
    pub snapshot_every: u64,
    /// Membership changes at given steps (demos and tests; operators use `request`).
    pub script: Vec<ScriptedChange>,
    /// The world never shrinks below this many ranks.
    pub min_ranks: u32,
    /// Nor grows above this many.
    pub max_ranks: u32,
    /// Take a buddy backup at least every this many steps (0: no backups, so losing a rank
    /// stops the run).
    pub replicate_every: u64,
    /// Evaluate the held-out data after every this many steps and after the last one
    /// (`Some(0)`: only after the last; `None`: the run has no eval data).
    pub eval_every: Option<u64>,
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
    /// A rank finished some work within the running step, backup or reshard of (epoch, step)
    /// (a unit pass, an optimizer unit, a piece moved): it is alive and not stuck, however long
    /// the phase takes.
    Progress {
        rank: RankId,
        epoch: u64,
        step: u64,
        now_ms: u64,
    },
    /// The runtime held the ranks at a step boundary (a snapshot streamed off the tier) until
    /// now: the current phase's time starts over.
    Paused {
        now_ms: u64,
    },
    /// Snapshot at the next step boundary (a SIGTERM, an operator's request).
    SnapshotRequested,
    /// A rank the coordinator asked for is up and idle; `host` when the runtime knows where
    /// it runs (worker processes), so that buddy backups keep to other hosts.
    Spawned {
        rank: RankId,
        host: Option<String>,
        now_ms: u64,
    },
    /// A rank finished its part of a reshard and holds its new state.
    ReshardDone {
        rank: RankId,
        epoch: u64,
        now_ms: u64,
    },
    /// A rank is alive and idle but did not finish the step or round (a peer vanished, or it
    /// was interrupted).
    StepAborted {
        rank: RankId,
        reason: String,
        now_ms: u64,
    },
    /// A rank holds its backup for (epoch, step).
    ReplicateDone {
        rank: RankId,
        epoch: u64,
        step: u64,
        now_ms: u64,
    },
}

/// A finished step, as the coordinator saw it.
#[derive(Clone, Debug)]
pub struct StepRecord {
    pub step: u64,
    /// Mean of the micro-batch losses, summed in micro-batch order.
    pub loss: f64,
    pub grad_norm: f64,
    /// The learning rate the step's plan carried (its update's, unless it was skipped).
    pub lr: f32,
    pub skipped: bool,
    pub attempts: u32,
    pub duration_ms: u64,
    /// The held-out loss after this step's update (mean of the eval micro-batches' losses in
    /// order), when the step evaluated.
    pub eval_loss: Option<f64>,
    pub reports: Vec<StepReport>,
}

/// Outputs: what the runtime must do.
#[derive(Clone, Debug)]
pub enum Command {
    /// Store this durable state before carrying out the commands after it (only when
    /// `keep_durable` was called); a store that refuses it (this leader was deposed) ends this
    /// coordinator's part at once.
    Commit(Box<Durable>),
    RunStep(StepPlan),
    StepCompleted(Box<StepRecord>),
    /// Every rank is idle at a step boundary: capture every chunk's state with this progress
    /// before running the next step.
    Snapshot(Progress),
    /// Start rank actors with these ids (joiners, holding no state yet).
    Spawn {
        ranks: Vec<RankId>,
    },
    /// Every rank in `old.members` and `new.members` moves chunks to go from `old` to `new`.
    Reshard {
        old: ShardMap,
        new: ShardMap,
        step: u64,
    },
    /// Stop these ranks: they left and hold nothing anymore.
    Retire {
        ranks: Vec<RankId>,
    },
    /// These ranks (the members of the map they hold) take a backup before `step` (own copy
    /// plus buddy replicas).
    Replicate {
        step: u64,
        ranks: Vec<RankId>,
    },
    /// Wake these ranks from the abandoned (epoch, step): a peer is gone.
    Interrupt {
        ranks: Vec<RankId>,
        epoch: u64,
        step: u64,
    },
    /// Survivors (every live rank of `old` or `new`) roll back to their backups under `old`,
    /// taken before `step`, and rebuild onto `new` without `lost`.
    Restore {
        old: ShardMap,
        new: ShardMap,
        step: u64,
        lost: Vec<RankId>,
    },
    MembershipChanged(Box<MembershipRecord>),
    /// A joiner did not come up (no machine for it, or it failed while starting); the change
    /// goes on without it, and training does not stop for it.
    JoinFailed {
        rank: RankId,
        reason: String,
    },
    Finish,
    Abort {
        reason: String,
    },
}

#[derive(Clone, Debug, PartialEq)]
enum Phase {
    Idle,
    Running {
        started_ms: u64,
    },
    /// Waiting for joiners to come up before a reshard.
    Spawning {
        started_ms: u64,
        waiting: BTreeSet<RankId>,
        next: Vec<RankId>,
    },
    /// A reshard round (a membership change, or a recovery when `rollback` holds the backup's
    /// progress and the lost ranks), then, when backups are on, a backup round under `new`.
    /// The new epoch commits only after both, so a loss at any point in either leaves the
    /// committed map and its backup intact. `waiting`: participants yet to report this part.
    Resharding {
        started_ms: u64,
        new: ShardMap,
        /// The step the round runs at (the rollback step for a recovery).
        step: u64,
        waiting: BTreeSet<RankId>,
        backing_up: bool,
        rollback: Option<(Progress, Vec<RankId>)>,
    },
    /// Waiting for every member's backup.
    Replicating {
        started_ms: u64,
        waiting: BTreeSet<RankId>,
    },
    /// Ranks were lost: waiting for the survivors to be idle, then rebuilding onto `target`.
    Recovering {
        started_ms: u64,
        lost: BTreeSet<RankId>,
        waiting: BTreeSet<RankId>,
        /// The membership after recovery: the one the abandoned round aimed at, without `lost`.
        target: Vec<RankId>,
    },
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
    /// When each rank last reported progress (a unit, a piece moved) in the current work.
    heard_ms: BTreeMap<RankId, u64>,
    /// Operator requests waiting for the next step boundary.
    requested: Vec<Change>,
    /// Rank ids handed out so far (joiners take the next ones).
    next_rank: RankId,
    /// Hosts of joiners that came up, until a committed map holds them (or they are dropped).
    joiner_hosts: BTreeMap<RankId, String>,
    /// Joiners dropped because their change timed out: the runtime may still report them
    /// failing, which is no loss.
    timed_out_joiners: BTreeSet<RankId>,
    membership_log: Vec<MembershipRecord>,
    /// Scripted changes of steps up to this one were already applied (a recovery may fold a
    /// change into its reshard and then replay the steps before it).
    script_applied: Option<u64>,
    /// The highest epoch any round used, committed or abandoned: each new round takes the next,
    /// so frames of an abandoned round are stale for every later one.
    epoch_used: u64,
    /// The newest complete backup: its epoch and progress.
    backup: Option<(u64, Progress)>,
    /// Ranks that reported an aborted step or round in the current one: alive and idle.
    aborted: BTreeSet<RankId>,
    /// Rollbacks in a row after every rank gave up on its peers with none lost (frames lost on
    /// the network); a completed step resets it.
    network_retries: u32,
    /// The durable state as last committed, when commits are kept (`keep_durable`).
    durable_key: Option<durable::DurableKey>,
    /// Leaders that took the job over, this one included if it did.
    failovers: u64,
    /// A takeover that starts with `Event::Start`.
    takeover: Option<durable::PendingTakeover>,
    /// The rollback in progress is a takeover's (for its membership record).
    taking_over: bool,
}

/// How many times in a row the ranks may give up on each other, with no rank lost, before the
/// run stops: each time costs a rollback to the backup and one collective timeout, so a few
/// ride out a dropped connection or a short partition, and a link that stays dead is reported.
pub const MAX_NETWORK_RETRIES: u32 = 4;

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
        let next_rank = map.members.iter().max().map_or(0, |m| m + 1);
        let epoch_used = map.epoch;
        Self {
            job,
            map,
            step: progress.step,
            opt_step: progress.opt_step,
            bounds: progress.grad_bounds,
            phase: Phase::Idle,
            reports: BTreeMap::new(),
            snapshot_requested: false,
            heard_ms: BTreeMap::new(),
            requested: Vec::new(),
            next_rank,
            joiner_hosts: BTreeMap::new(),
            timed_out_joiners: BTreeSet::new(),
            script_applied: None,
            epoch_used,
            backup: None,
            aborted: BTreeSet::new(),
            network_retries: 0,
            membership_log: Vec::new(),
            durable_key: None,
            failovers: 0,
            takeover: None,
            taking_over: false,
        }
    }

    /// Membership changes completed so far.
    pub fn membership_log(&self) -> &[MembershipRecord] {
        &self.membership_log
    }

    /// Queues an operator's change for the next step boundary, or refuses it (nothing changes).
    pub fn request(&mut self, change: Change) -> Result<(), Refusal> {
        let mut members = self.planned_members();
        match &change {
            Change::Leave(rank) => {
                if !members.contains(rank) {
                    return Err(Refusal::UnknownRank {
                        rank: *rank,
                        members: self.map.members.clone(),
                    });
                }
                members.retain(|r| r != rank);
            }
            Change::Join(n) => members.extend((0..*n).map(|i| u32::MAX - i)),
        }
        self.check_world(members.len()).map_err(Refusal::from)?;
        self.check_boundary_ahead()?;
        self.requested.push(change);
        Ok(())
    }

    /// Whether losing `lost` (ranks an operator is about to kill) is covered: every one is a
    /// member after the queued changes and enough ranks survive. Changes nothing.
    pub fn check_loss(&self, lost: &[RankId]) -> Result<(), Refusal> {
        let mut members = self.planned_members();
        for rank in lost {
            if !members.contains(rank) {
                return Err(Refusal::UnknownRank {
                    rank: *rank,
                    members: self.map.members.clone(),
                });
            }
            members.retain(|r| r != rank);
        }
        self.check_world(members.len()).map_err(Refusal::from)?;
        self.check_boundary_ahead()
    }

    /// Requests take effect at the next step boundary; refuse them when the run ends first, so
    /// that an accepted request always happens.
    fn check_boundary_ahead(&self) -> Result<(), Refusal> {
        let next = match self.phase {
            Phase::Running { .. } => self.step + 1,
            Phase::Done | Phase::Failed => self.job.steps,
            _ => self.step,
        };
        if next >= self.job.steps {
            return Err(Refusal::RunEnding {
                steps: self.job.steps,
            });
        }
        Ok(())
    }

    fn check_world(&self, n: usize) -> Result<(), WorldBound> {
        let min = self.job.min_ranks.max(1) as usize;
        if n < min {
            return Err(WorldBound::BelowMin { ranks: n, min });
        }
        if n > self.job.max_ranks as usize {
            return Err(WorldBound::AboveMax {
                ranks: n,
                max: self.job.max_ranks as usize,
            });
        }
        Ok(())
    }

    /// Members after the already-requested changes.
    fn planned_members(&self) -> Vec<RankId> {
        let mut m = self.map.members.clone();
        for c in &self.requested {
            match c {
                Change::Leave(r) => m.retain(|x| x != r),
                Change::Join(n) => m.extend((0..*n).map(|i| u32::MAX - 1000 - i)),
            }
        }
        m
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

    /// The step before which the newest complete buddy backup was taken, if any.
    pub fn backup_step(&self) -> Option<u64> {
        self.backup.as_ref().map(|(_, p)| p.step)
    }

    /// The job this coordinator runs.
    pub fn job(&self) -> &JobSpec {
        &self.job
    }

    pub fn is_finished(&self) -> bool {
        matches!(self.phase, Phase::Done | Phase::Failed)
    }

    pub fn handle(&mut self, event: Event) -> Vec<Command> {
        if self.is_finished() {
            return Vec::new();
        }
        let out = self.dispatch(event);
        self.commit_first(out)
    }

    fn dispatch(&mut self, event: Event) -> Vec<Command> {
        if let Phase::Recovering { waiting, .. } = &mut self.phase {
            // A rank that finished its part of the abandoned work anyway is idle too.
            let idle = match &event {
                Event::StepDone { report, .. } => Some(report.rank),
                Event::ReshardDone { rank, .. } | Event::ReplicateDone { rank, .. } => Some(*rank),
                _ => None,
            };
            if let Some(rank) = idle {
                let now_ms = event_time(&event);
                waiting.remove(&rank);
                return self.try_restore(now_ms);
            }
        }
        match event {
            Event::Start { now_ms } => match self.takeover.take() {
                Some(pending) => self.start_takeover(pending, now_ms),
                None => self.start_step(now_ms),
            },
            Event::StepDone { report, now_ms } => self.on_report(*report, now_ms),
            Event::RankFailed {
                rank,
                reason,
                now_ms,
            } => self.on_failure(rank, reason, now_ms),
            Event::StepAborted {
                rank,
                reason,
                now_ms,
            } => self.on_aborted(rank, reason, now_ms),
            Event::ReplicateDone {
                rank,
                epoch,
                step,
                now_ms,
            } => self.on_replicated(rank, epoch, step, now_ms),
            Event::Tick { now_ms } => self.on_tick(now_ms),
            Event::Progress {
                rank,
                epoch,
                step,
                now_ms,
            } => {
                // Work on an abandoned step or round, or under an old map, says nothing about
                // this one.
                let current = match &self.phase {
                    Phase::Running { .. } | Phase::Replicating { .. } => {
                        (epoch, step) == (self.map.epoch, self.step)
                    }
                    Phase::Resharding { new, step: at, .. } => (epoch, step) == (new.epoch, *at),
                    _ => false,
                };
                if current {
                    self.heard_ms.insert(rank, now_ms);
                }
                Vec::new()
            }
            Event::Paused { now_ms } => {
                // The ranks waited on the runtime (a snapshot streamed off the tier): that
                // time is not theirs.
                match &mut self.phase {
                    Phase::Running { started_ms }
                    | Phase::Replicating { started_ms, .. }
                    | Phase::Resharding { started_ms, .. } => *started_ms = now_ms,
                    _ => {}
                }
                Vec::new()
            }
            Event::SnapshotRequested => {
                self.snapshot_requested = true;
                Vec::new()
            }
            Event::Spawned { rank, host, now_ms } => self.on_spawned(rank, host, now_ms),
            Event::ReshardDone {
                rank,
                epoch,
                now_ms,
            } => self.on_reshard_done(rank, epoch, now_ms),
        }
    }

    fn on_tick(&mut self, now_ms: u64) -> Vec<Command> {
        match self.phase {
            Phase::Running { started_ms } => {
                let unreported = self
                    .map
                    .members
                    .iter()
                    .filter(|r| !self.reports.contains_key(r));
                let stuck = self.silent(unreported, started_ms, now_ms);
                if stuck.is_empty() {
                    return Vec::new();
                }
                self.fail(format!(
                    "step {} made no progress on ranks {stuck:?} for {} ms (step_timeout_ms, \
                     4 x collective_timeout_ms; each finished unit pass or optimizer unit \
                     counts as progress)",
                    self.step, self.job.step_timeout_ms
                ))
            }
            Phase::Spawning {
                started_ms,
                ref waiting,
                ..
            } if now_ms.saturating_sub(started_ms) > self.job.step_timeout_ms => {
                let reason = format!(
                    "it did not come up within step_timeout_ms ({} ms)",
                    self.job.step_timeout_ms
                );
                let late: Vec<RankId> = waiting.iter().copied().collect();
                self.timed_out_joiners.extend(&late);
                let mut out = Vec::new();
                for rank in late {
                    out.extend(self.drop_joiner(rank, reason.clone(), now_ms));
                }
                out
            }
            // Reshards and backups of state on a slow disk take as long as they need while their
            // ranks keep moving pieces; waiting for survivors to go idle has no pieces to show.
            Phase::Resharding {
                started_ms,
                ref waiting,
                ..
            }
            | Phase::Replicating {
                started_ms,
                ref waiting,
            } => {
                let stuck = self.silent(waiting.iter(), started_ms, now_ms);
                if stuck.is_empty() {
                    return Vec::new();
                }
                self.fail(format!(
                    "membership change before step {} made no progress on ranks {stuck:?} for {} ms (step_timeout_ms)",
                    self.step, self.job.step_timeout_ms
                ))
            }
            Phase::Recovering { started_ms, .. }
                if now_ms.saturating_sub(started_ms) > self.job.step_timeout_ms =>
            {
                self.fail(format!(
                    "membership change before step {} did not complete within {} ms",
                    self.step, self.job.step_timeout_ms
                ))
            }
            _ => Vec::new(),
        }
    }

    /// The `ranks` silent for longer than `step_timeout_ms` in a phase that started at
    /// `started_ms`: since their last progress in this phase, or since it started.
    fn silent<'a>(
        &self,
        ranks: impl Iterator<Item = &'a RankId>,
        started_ms: u64,
        now_ms: u64,
    ) -> Vec<RankId> {
        let silent_ms = |r: &RankId| {
            let heard = self.heard_ms.get(r).copied().unwrap_or(0);
            now_ms.saturating_sub(heard.max(started_ms))
        };
        ranks
            .filter(|r| silent_ms(r) > self.job.step_timeout_ms)
            .copied()
            .collect()
    }

    fn fail(&mut self, reason: String) -> Vec<Command> {
        self.phase = Phase::Failed;
        vec![Command::Abort { reason }]
    }
}

fn event_time(e: &Event) -> u64 {
    match e {
        Event::Start { now_ms }
        | Event::StepDone { now_ms, .. }
        | Event::RankFailed { now_ms, .. }
        | Event::Tick { now_ms }
        | Event::Progress { now_ms, .. }
        | Event::Paused { now_ms }
        | Event::Spawned { now_ms, .. }
        | Event::ReshardDone { now_ms, .. }
        | Event::StepAborted { now_ms, .. }
        | Event::ReplicateDone { now_ms, .. } => *now_ms,
        Event::SnapshotRequested => 0,
    }
}

pub use durable::{Attached, Durable, TakeoverRefused};
pub use steps::mean_in_order;

mod durable;
mod membership;
mod recovery;
mod steps;
#[cfg(test)]
mod tests;
