//! The step cycle: starting a step (after a buddy backup when one is due, with whether its
//! update may be owed to the next step), collecting the ranks' reports, and the backup round.

use super::*;

impl Coordinator {
    pub(super) fn start_step(&mut self, now_ms: u64) -> Vec<Command> {
        if self.step >= self.job.steps {
            self.phase = Phase::Done;
            return vec![Command::Finish];
        }
        let mut changes: Vec<Change> = Vec::new();
        if self.script_applied.is_none_or(|s| self.step > s) {
            self.script_applied = Some(self.step);
            changes.extend(
                self.job
                    .script
                    .iter()
                    .filter(|c| c.step == self.step)
                    .map(|c| c.change.clone()),
            );
        }
        changes.append(&mut self.requested);
        if !changes.is_empty() {
            return self.change_membership(changes, now_ms);
        }
        self.aborted.clear();
        if self.backup_due() {
            self.phase = Phase::Replicating {
                started_ms: now_ms,
                waiting: self.map.members.iter().copied().collect(),
            };
            return vec![Command::Replicate {
                step: self.step,
                ranks: self.map.members.clone(),
            }];
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
            defer_update: !self.state_read_after_step(),
            eval: self.eval_due_at(self.step + 1),
        })]
    }

    /// Whether the ranks' state is read between the step about to run and the next one: the
    /// job's end, a snapshot, a scripted membership change or a buddy backup. (A snapshot asked
    /// for through the API, or a failure, cannot be foreseen: the ranks then settle what they
    /// owe when they read their state.)
    pub(super) fn state_read_after_step(&self) -> bool {
        let next = self.step + 1;
        next >= self.job.steps
            || self.snapshot_due_at(next)
            || self.job.script.iter().any(|c| c.step == next)
            || self.backup_due_at(next)
            || self.eval_due_at(next)
    }

    /// Whether the held-out data is evaluated once `done` steps have completed (every
    /// `eval_every` steps and after the last).
    fn eval_due_at(&self, done: u64) -> bool {
        self.job.eval_every.is_some_and(|every| {
            done == self.job.steps || (every > 0 && done.is_multiple_of(every))
        })
    }

    /// Whether a snapshot is due once `done` steps have completed (every `snapshot_every`
    /// steps and after the last).
    fn snapshot_due_at(&self, done: u64) -> bool {
        let every = self.job.snapshot_every;
        every > 0 && (done.is_multiple_of(every) || done == self.job.steps)
    }

    pub(super) fn on_report(&mut self, report: StepReport, now_ms: u64) -> Vec<Command> {
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
            lr: self.job.lr.lr_at(self.opt_step + 1),
            skipped: first.skipped,
            attempts: first.attempts,
            duration_ms: now_ms.saturating_sub(started_ms),
            eval_loss: (!first.eval_losses.is_empty()).then(|| mean_in_order(&first.eval_losses)),
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
        self.network_retries = 0;
        let mut out = vec![Command::StepCompleted(Box::new(record))];
        if self.snapshot_requested || self.snapshot_due_at(self.step) {
            self.snapshot_requested = false;
            out.push(Command::Snapshot(self.progress()));
        }
        out.extend(self.start_step(now_ms));
        out
    }

    pub(super) fn backup_due(&self) -> bool {
        self.backup_due_at(self.step)
    }

    /// Whether a buddy backup is due before step `step` under the current map.
    pub(super) fn backup_due_at(&self, step: u64) -> bool {
        let every = self.job.replicate_every;
        if !self.keeps_backups(self.map.world_size()) {
            return false;
        }
        match &self.backup {
            Some((epoch, p)) => *epoch != self.map.epoch || step >= p.step + every,
            None => true,
        }
    }

    pub(super) fn on_replicated(
        &mut self,
        rank: RankId,
        epoch: u64,
        step: u64,
        now_ms: u64,
    ) -> Vec<Command> {
        match &mut self.phase {
            Phase::Replicating { waiting, .. } => {
                if epoch != self.map.epoch || step != self.step {
                    return Vec::new();
                }
                waiting.remove(&rank);
                if !waiting.is_empty() {
                    return Vec::new();
                }
                self.backup = Some((self.map.epoch, self.progress()));
                self.start_step(now_ms)
            }
            Phase::Resharding {
                new,
                step: at,
                waiting,
                backing_up: true,
                ..
            } => {
                if epoch != new.epoch || step != *at {
                    return Vec::new();
                }
                waiting.remove(&rank);
                if !waiting.is_empty() {
                    return Vec::new();
                }
                self.commit(now_ms)
            }
            _ => Vec::new(),
        }
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
            && r.eval_losses
                .iter()
                .map(|x| x.to_bits())
                .eq(first.eval_losses.iter().map(|x| x.to_bits()))
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
