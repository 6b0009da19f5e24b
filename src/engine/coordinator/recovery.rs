//! Losses: a rank that aborted or vanished, in any phase, and the rollback onto the survivors.

use std::collections::BTreeSet;

use super::*;

impl Coordinator {
    pub(super) fn on_aborted(&mut self, rank: RankId, reason: String, now_ms: u64) -> Vec<Command> {
        match &mut self.phase {
            // Alive but stuck on a vanished peer: wait for the failure itself (or the deadline).
            Phase::Running { .. } | Phase::Resharding { .. } | Phase::Replicating { .. } => {
                self.aborted.insert(rank);
                Vec::new()
            }
            Phase::Recovering { waiting, .. } => {
                waiting.remove(&rank);
                self.try_restore(now_ms)
            }
            _ => self.fail(format!("rank {rank} aborted outside a step: {reason}")),
        }
    }

    /// A rank is gone, in any phase. The unfinished step or round is abandoned; with a backup
    /// that still covers every chunk of the committed map, the survivors roll back to it and
    /// rebuild onto the membership the round aimed at, less the lost ranks. Otherwise stop and
    /// say what was lost.
    pub(super) fn on_failure(&mut self, rank: RankId, reason: String, now_ms: u64) -> Vec<Command> {
        let known = match &self.phase {
            Phase::Recovering { lost, .. } => lost.contains(&rank),
            Phase::Resharding {
                rollback: Some((_, lost)),
                ..
            } => lost.contains(&rank),
            _ => false,
        };
        if known || self.timed_out_joiners.contains(&rank) {
            return Vec::new(); // already lost and retired, or never joined
        }
        let step = self.step;
        let fail_plain =
            |c: &mut Self| c.fail(format!("rank {rank} failed at step {step}: {reason}"));
        // What the abandoned work aimed at, who is still busy in it, and the round's
        // (epoch, step) to interrupt them in.
        let (mut lost, target, busy, round): (BTreeSet<RankId>, Vec<RankId>, Vec<RankId>, _) =
            match &self.phase {
                Phase::Running { .. } => {
                    if !self.map.is_member(rank) {
                        return fail_plain(self);
                    }
                    let busy = self
                        .map
                        .members
                        .iter()
                        .copied()
                        .filter(|r| !self.reports.contains_key(r) && !self.aborted.contains(r))
                        .collect();
                    (
                        BTreeSet::new(),
                        self.map.members.clone(),
                        busy,
                        Some((self.map.epoch, self.step)),
                    )
                }
                Phase::Replicating { waiting, .. } => {
                    if !self.map.is_member(rank) {
                        return fail_plain(self);
                    }
                    let busy = waiting.difference(&self.aborted).copied().collect();
                    (
                        BTreeSet::new(),
                        self.map.members.clone(),
                        busy,
                        Some((self.map.epoch, self.step)),
                    )
                }
                Phase::Resharding {
                    new,
                    step,
                    waiting,
                    rollback,
                    ..
                } => {
                    if !self.map.is_member(rank) && !new.is_member(rank) {
                        return fail_plain(self);
                    }
                    let lost: BTreeSet<RankId> = rollback
                        .as_ref()
                        .map(|(_, l)| l.iter().copied().collect())
                        .unwrap_or_default();
                    let busy = waiting.difference(&self.aborted).copied().collect();
                    (lost, new.members.clone(), busy, Some((new.epoch, *step)))
                }
                // Joiners are coming up and members are idle; a joiner that cannot start is
                // not a loss but a failed change.
                Phase::Spawning { waiting, next, .. } => {
                    if waiting.contains(&rank) {
                        return self.drop_joiner(rank, reason, now_ms);
                    }
                    if !self.map.is_member(rank) {
                        return fail_plain(self);
                    }
                    let target = next
                        .iter()
                        .copied()
                        .filter(|r| !waiting.contains(r))
                        .collect();
                    (BTreeSet::new(), target, Vec::new(), None)
                }
                Phase::Recovering { lost, target, .. } => {
                    // A leaver still to send its chunks counts too.
                    if !self.map.is_member(rank) && !target.contains(&rank) {
                        return fail_plain(self);
                    }
                    (lost.clone(), target.clone(), Vec::new(), None)
                }
                Phase::Idle | Phase::Done | Phase::Failed => return fail_plain(self),
            };
        let (started_ms, mut waiting) = match &self.phase {
            Phase::Recovering {
                started_ms,
                waiting,
                ..
            } => (*started_ms, waiting.clone()),
            _ => (now_ms, busy.iter().copied().collect::<BTreeSet<_>>()),
        };
        lost.insert(rank);
        waiting.remove(&rank);
        let target: Vec<RankId> = target.into_iter().filter(|r| !lost.contains(r)).collect();
        let lost_list: Vec<RankId> = lost.iter().copied().collect();
        let Some((epoch, _)) = &self.backup else {
            return self.fail(format!(
                "rank {rank} failed at step {}: {reason}; no in-memory backup exists (replicate_every is 0 or the world has one rank): resume from your newest checkpoint",
                self.step
            ));
        };
        if *epoch != self.map.epoch {
            return self.fail(format!(
                "rank {rank} failed at step {}: {reason}; the backup predates the current shard map",
                self.step
            ));
        }
        // Only members of the committed map hold backups; a lost joiner held nothing.
        let lost_members: Vec<RankId> = lost_list
            .iter()
            .copied()
            .filter(|r| self.map.is_member(*r))
            .collect();
        let missing = crate::plan::replica::holders(&self.map, &lost_members).err();
        if let Some(missing) = missing {
            return self.fail(format!(
                "ranks {lost_list:?} are lost at step {} ({reason}); chunks {missing:?} (unit/index) had no other copy. Resume from your newest checkpoint",
                self.step
            ));
        }
        if let Err(e) = self.check_world(target.len()) {
            return self.fail(format!(
                "ranks {lost_list:?} are lost at step {}: {e}",
                self.step
            ));
        }
        let mut out = vec![Command::Retire { ranks: vec![rank] }];
        if let Some((epoch, step)) = round {
            let ranks: Vec<RankId> = waiting.iter().copied().collect();
            if !ranks.is_empty() {
                out.push(Command::Interrupt { ranks, epoch, step });
            }
        }
        self.phase = Phase::Recovering {
            started_ms,
            lost,
            waiting,
            target,
        };
        out.extend(self.try_restore(now_ms));
        out
    }

    pub(super) fn try_restore(&mut self, now_ms: u64) -> Vec<Command> {
        let Phase::Recovering {
            started_ms,
            lost,
            waiting,
            target,
        } = &self.phase
        else {
            return Vec::new();
        };
        if !waiting.is_empty() {
            return Vec::new();
        }
        let (started_ms, lost, target) = (
            *started_ms,
            lost.iter().copied().collect::<Vec<_>>(),
            target.clone(),
        );
        let _ = now_ms;
        let Some((_, progress)) = self.backup.clone() else {
            return self.fail("recovery without a backup".into());
        };
        match self.plan_next(&target) {
            Ok(new) => {
                // Every live rank of either map takes part: old members (a leaver too) send
                // what they hold, new members (a joiner too) receive.
                let waiting: BTreeSet<RankId> = self
                    .map
                    .members
                    .iter()
                    .chain(&new.members)
                    .copied()
                    .filter(|r| !lost.contains(r))
                    .collect();
                let step = progress.step;
                self.aborted.clear();
                self.phase = Phase::Resharding {
                    started_ms,
                    new: new.clone(),
                    step,
                    waiting,
                    backing_up: false,
                    rollback: Some((progress, lost.clone())),
                };
                vec![Command::Restore {
                    old: self.map.clone(),
                    new,
                    step,
                    lost,
                }]
            }
            Err(e) => self.fail(format!("cannot plan the survivors' shard map: {e}")),
        }
    }
}
