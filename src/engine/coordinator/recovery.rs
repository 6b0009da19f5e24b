//! Losses: a rank that aborted or vanished, in any phase, and the rollback onto the survivors.

use std::collections::BTreeSet;

use super::*;

/// What abandoned work aimed at: the ranks already lost in it, its target membership, who is
/// still busy in it, and the round's (epoch, step) to interrupt them in.
struct Abandoned {
    lost: BTreeSet<RankId>,
    target: Vec<RankId>,
    busy: Vec<RankId>,
    round: Option<(u64, u64)>,
}

/// How a loss meets the work in progress.
enum Loss {
    /// The work is abandoned and rebuilt from the backup.
    Abandons(Abandoned),
    /// A joiner that could not start: a failed change, not a loss.
    Joiner(RankId),
    /// Nothing to roll back onto: the run stops.
    Fatal,
}

impl Coordinator {
    pub(super) fn on_aborted(&mut self, rank: RankId, reason: String, now_ms: u64) -> Vec<Command> {
        match &mut self.phase {
            // Alive but stuck on a peer: wait for the failure itself (or the deadline), unless
            // every rank still in the work gave up and none is lost.
            Phase::Running { .. } | Phase::Resharding { .. } | Phase::Replicating { .. } => {
                self.aborted.insert(rank);
                if self.all_gave_up() {
                    return self.retry_after_cut(rank, reason, now_ms);
                }
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
        self.roll_back(Some(rank), reason, now_ms)
    }

    /// Whether every rank the running step or round waits for has aborted, so nothing more
    /// will arrive: with no rank lost, the frames they wait for were lost between live ranks.
    fn all_gave_up(&self) -> bool {
        let waiting: Vec<RankId> = match &self.phase {
            Phase::Running { .. } => self
                .map
                .members
                .iter()
                .copied()
                .filter(|r| !self.reports.contains_key(r))
                .collect(),
            Phase::Replicating { waiting, .. } | Phase::Resharding { waiting, .. } => {
                waiting.iter().copied().collect()
            }
            _ => return false,
        };
        !waiting.is_empty() && waiting.iter().all(|r| self.aborted.contains(r))
    }

    /// Every rank of the step or round gave up waiting on a peer, yet none is lost: a cut
    /// connection or a blackholed link lost frames between live ranks, which no transport
    /// retransmits across a new connection. The work is abandoned and redone from the
    /// committed backup, with the same ranks, under a fresh epoch (late frames of the cut
    /// work are then stale). At most `MAX_NETWORK_RETRIES` in a row: a link that never comes
    /// back stops the run, naming what the ranks reported.
    fn retry_after_cut(&mut self, rank: RankId, reason: String, now_ms: u64) -> Vec<Command> {
        self.network_retries += 1;
        let step = self.step;
        if self.network_retries > MAX_NETWORK_RETRIES {
            return self.fail(format!(
                "the ranks at step {step} gave up on each other {MAX_NETWORK_RETRIES} times in a row \
                 without losing a rank (the last: rank {rank}: {reason}): frames between live \
                 workers keep getting lost; check the network between them (firewall, MTU, a \
                 link that drops connections)"
            ));
        }
        self.roll_back(None, format!("rank {rank}: {reason}"), now_ms)
    }

    /// Abandons the unfinished step or round, adding `failed` (when a rank is gone) to the
    /// lost ranks, and rebuilds from the committed backup onto the membership the work aimed
    /// at, less the lost ranks.
    fn roll_back(&mut self, failed: Option<RankId>, reason: String, now_ms: u64) -> Vec<Command> {
        let step = self.step;
        let who = match failed {
            Some(rank) => format!("rank {rank} failed"),
            None => "the ranks gave up on each other".to_string(),
        };
        let Abandoned {
            mut lost,
            target,
            busy,
            round,
        } = match self.abandoned_work(failed) {
            Loss::Abandons(work) => work,
            Loss::Joiner(rank) => return self.drop_joiner(rank, reason, now_ms),
            Loss::Fatal => return self.fail(format!("{who} at step {step}: {reason}")),
        };
        let (started_ms, mut waiting) = match &self.phase {
            Phase::Recovering {
                started_ms,
                waiting,
                ..
            } => (*started_ms, waiting.clone()),
            _ => (now_ms, busy.iter().copied().collect::<BTreeSet<_>>()),
        };
        if let Some(rank) = failed {
            lost.insert(rank);
            waiting.remove(&rank);
        }
        let target: Vec<RankId> = target.into_iter().filter(|r| !lost.contains(r)).collect();
        if let Some(why) = self.unrestorable(&who, &reason, &lost, target.len()) {
            return self.fail(why);
        }
        let mut out: Vec<Command> = failed
            .map(|rank| Command::Retire { ranks: vec![rank] })
            .into_iter()
            .collect();
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

    /// How the loss of `failed` (or, with `None`, the cut between live ranks) meets the work
    /// in progress: what that work aimed at, or why nothing can be rolled back.
    fn abandoned_work(&self, failed: Option<RankId>) -> Loss {
        let is_member = |m: &ShardMap| failed.is_none_or(|r| m.is_member(r));
        let committed_round = || Some((self.map.epoch, self.step));
        match &self.phase {
            Phase::Running { .. } => {
                if !is_member(&self.map) {
                    return Loss::Fatal;
                }
                let busy = self
                    .map
                    .members
                    .iter()
                    .copied()
                    .filter(|r| !self.reports.contains_key(r) && !self.aborted.contains(r))
                    .collect();
                Loss::Abandons(Abandoned {
                    lost: BTreeSet::new(),
                    target: self.map.members.clone(),
                    busy,
                    round: committed_round(),
                })
            }
            Phase::Replicating { waiting, .. } => {
                if !is_member(&self.map) {
                    return Loss::Fatal;
                }
                Loss::Abandons(Abandoned {
                    lost: BTreeSet::new(),
                    target: self.map.members.clone(),
                    busy: waiting.difference(&self.aborted).copied().collect(),
                    round: committed_round(),
                })
            }
            Phase::Resharding {
                new,
                step,
                waiting,
                rollback,
                ..
            } => {
                if !is_member(&self.map) && !is_member(new) {
                    return Loss::Fatal;
                }
                Loss::Abandons(Abandoned {
                    lost: rollback
                        .as_ref()
                        .map(|(_, l)| l.iter().copied().collect())
                        .unwrap_or_default(),
                    target: new.members.clone(),
                    busy: waiting.difference(&self.aborted).copied().collect(),
                    round: Some((new.epoch, *step)),
                })
            }
            // Joiners are coming up and members are idle; a joiner that cannot start is
            // not a loss but a failed change.
            Phase::Spawning { waiting, next, .. } => match failed {
                Some(rank) if waiting.contains(&rank) => Loss::Joiner(rank),
                Some(rank) if self.map.is_member(rank) => Loss::Abandons(Abandoned {
                    lost: BTreeSet::new(),
                    target: next
                        .iter()
                        .copied()
                        .filter(|r| !waiting.contains(r))
                        .collect(),
                    busy: Vec::new(),
                    round: None,
                }),
                _ => Loss::Fatal,
            },
            // A leaver still to send its chunks counts too.
            Phase::Recovering { lost, target, .. } => match failed {
                Some(rank) if self.map.is_member(rank) || target.contains(&rank) => {
                    Loss::Abandons(Abandoned {
                        lost: lost.clone(),
                        target: target.clone(),
                        busy: Vec::new(),
                        round: None,
                    })
                }
                _ => Loss::Fatal,
            },
            Phase::Idle | Phase::Done | Phase::Failed => Loss::Fatal,
        }
    }

    /// Why the committed backup cannot rebuild the run without the `lost` ranks onto
    /// `target_len` ranks, or `None` when it can.
    pub(super) fn unrestorable(
        &self,
        who: &str,
        reason: &str,
        lost: &BTreeSet<RankId>,
        target_len: usize,
    ) -> Option<String> {
        let lost_list: Vec<RankId> = lost.iter().copied().collect();
        let Some((epoch, _)) = &self.backup else {
            return Some(format!(
                "{who} at step {}: {reason}; no in-memory backup exists (replicate_every is 0 or the world has one rank): resume from your newest checkpoint",
                self.step
            ));
        };
        if *epoch != self.map.epoch {
            return Some(format!(
                "{who} at step {}: {reason}; the backup predates the current shard map",
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
            return Some(format!(
                "ranks {lost_list:?} are lost at step {} ({reason}); chunks {missing:?} (unit/index) had no other copy. Resume from your newest checkpoint",
                self.step
            ));
        }
        if let Err(e) = self.check_world(target_len) {
            return Some(format!(
                "ranks {lost_list:?} are lost at step {}: {e}",
                self.step
            ));
        }
        None
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
