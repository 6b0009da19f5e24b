//! Membership changes at step boundaries: spawning joiners, the reshard round (and the backup
//! round under the new map when backups are on), and the commit of the new epoch.

use super::*;

impl Coordinator {
    /// Applies changes at a step boundary: joiners are spawned first, then everyone reshards.
    pub(super) fn change_membership(&mut self, changes: Vec<Change>, now_ms: u64) -> Vec<Command> {
        let mut members = self.map.members.clone();
        let mut joiners = Vec::new();
        for c in changes {
            match c {
                Change::Leave(r) => members.retain(|&m| m != r),
                Change::Join(n) => {
                    for _ in 0..n {
                        joiners.push(self.next_rank);
                        self.next_rank += 1;
                    }
                }
            }
        }
        members.extend(&joiners);
        if let Err(e) = self.check_world(members.len()) {
            return self.fail(format!("membership change at step {}: {e}", self.step));
        }
        if joiners.is_empty() {
            return self.begin_reshard(members, now_ms);
        }
        self.phase = Phase::Spawning {
            started_ms: now_ms,
            waiting: joiners.iter().copied().collect(),
            next: members,
        };
        vec![Command::Spawn { ranks: joiners }]
    }

    /// The map for `members` planned from the committed one, under a fresh epoch.
    pub(super) fn plan_next(&mut self, members: &[RankId]) -> Result<ShardMap, String> {
        let (mut new, _) = rebalance(&self.map, members).map_err(|e| e.to_string())?;
        // Rank ids are never reused: a joiner outside this membership is gone for good.
        let committed = &self.map.hosts;
        self.joiner_hosts
            .retain(|r, _| members.contains(r) && !committed.contains_key(r));
        for (r, h) in &self.joiner_hosts {
            new.hosts.insert(*r, h.clone());
        }
        new.epoch = self.epoch_used + 1;
        self.epoch_used = new.epoch;
        Ok(new)
    }

    /// Whether a commit onto `new` takes a backup under it first.
    pub(super) fn backs_up(&self, new: &ShardMap) -> bool {
        self.keeps_backups(new.world_size())
    }

    /// Whether a world of `size` ranks keeps backups. A lone rank has no buddy, so its backup
    /// is only its own copy: worth taking when the job outlives its coordinator (a successor
    /// rolls the rank back to it), not for a rank loss, which a world of one cannot survive.
    pub(super) fn keeps_backups(&self, size: usize) -> bool {
        self.job.replicate_every > 0 && (size >= 2 || self.durable_key.is_some())
    }

    pub(super) fn begin_reshard(&mut self, members: Vec<RankId>, now_ms: u64) -> Vec<Command> {
        if members == self.map.members {
            return self.start_step(now_ms);
        }
        match self.plan_next(&members) {
            Ok(new) => {
                let waiting = self
                    .map
                    .members
                    .iter()
                    .chain(&new.members)
                    .copied()
                    .collect();
                self.aborted.clear();
                self.phase = Phase::Resharding {
                    started_ms: now_ms,
                    new: new.clone(),
                    step: self.step,
                    waiting,
                    backing_up: false,
                    rollback: None,
                };
                vec![Command::Reshard {
                    old: self.map.clone(),
                    new,
                    step: self.step,
                }]
            }
            Err(e) => self.fail(format!("cannot plan the new membership: {e}")),
        }
    }

    pub(super) fn on_spawned(
        &mut self,
        rank: RankId,
        host: Option<String>,
        now_ms: u64,
    ) -> Vec<Command> {
        // The membership to reshard onto once this was the last joiner to come up.
        let ready = match &mut self.phase {
            Phase::Spawning { waiting, next, .. } if waiting.contains(&rank) => {
                waiting.remove(&rank);
                waiting.is_empty().then(|| std::mem::take(next))
            }
            // Up already (a repeated report).
            Phase::Spawning { next, .. } if next.contains(&rank) => return Vec::new(),
            // A joiner of a change that was given up on holds nothing.
            _ if !self.map.is_member(rank) => return vec![Command::Retire { ranks: vec![rank] }],
            _ => return Vec::new(),
        };
        if let Some(h) = host {
            self.joiner_hosts.insert(rank, h);
        }
        match ready {
            Some(next) => self.begin_reshard(next, now_ms),
            None => Vec::new(),
        }
    }

    /// A joiner that could not start leaves the change: the others still join, leavers still
    /// leave, unless the membership without it breaks the world-size bounds.
    pub(super) fn drop_joiner(
        &mut self,
        rank: RankId,
        reason: String,
        now_ms: u64,
    ) -> Vec<Command> {
        let Phase::Spawning { waiting, next, .. } = &mut self.phase else {
            return Vec::new();
        };
        if !waiting.remove(&rank) {
            return Vec::new();
        }
        next.retain(|&r| r != rank);
        let size = next.len();
        let ready = waiting.is_empty().then(|| std::mem::take(next));
        let step = self.step;
        let mut out = vec![Command::JoinFailed {
            rank,
            reason: reason.clone(),
        }];
        if let Err(e) = self.check_world(size) {
            out.extend(self.fail(format!(
                "rank {rank} could not join at step {step} ({reason}), and without it {e}"
            )));
        } else if let Some(next) = ready {
            out.extend(self.begin_reshard(next, now_ms));
        }
        out
    }

    pub(super) fn on_reshard_done(
        &mut self,
        rank: RankId,
        epoch: u64,
        now_ms: u64,
    ) -> Vec<Command> {
        let backs_up = match &self.phase {
            Phase::Resharding { new, .. } => self.backs_up(new),
            _ => return Vec::new(),
        };
        let Phase::Resharding {
            new,
            step,
            waiting,
            backing_up,
            ..
        } = &mut self.phase
        else {
            return Vec::new();
        };
        if epoch != new.epoch || *backing_up {
            return Vec::new();
        }
        waiting.remove(&rank);
        if !waiting.is_empty() {
            return Vec::new();
        }
        if !backs_up {
            return self.commit(now_ms);
        }
        // The backup under the new map is part of the change: until every member holds it,
        // a loss rolls back to the committed map's backup.
        *backing_up = true;
        *waiting = new.members.iter().copied().collect();
        vec![Command::Replicate {
            step: *step,
            ranks: new.members.clone(),
        }]
    }

    /// Every participant holds its state (and backup) under the new map: it becomes the map.
    pub(super) fn commit(&mut self, now_ms: u64) -> Vec<Command> {
        let Phase::Resharding {
            started_ms,
            new,
            backing_up,
            rollback,
            ..
        } = &mut self.phase
        else {
            return Vec::new();
        };
        let (started_ms, new, backing_up, rollback) =
            (*started_ms, new.clone(), *backing_up, rollback.take());
        let moved: usize = crate::plan::rebalance::diff(&self.map, &new)
            .iter()
            .map(|m| m.elems)
            .sum();
        let lost = rollback
            .as_ref()
            .map(|(_, l)| l.clone())
            .unwrap_or_default();
        let record = MembershipRecord {
            step: self.step,
            epoch: new.epoch,
            before: self.map.members.clone(),
            after: new.members.clone(),
            moved_chunk_elems: moved,
            min_chunk_elems: min_move_elems(&self.map, &new.members),
            duration_ms: now_ms.saturating_sub(started_ms),
            lost: lost.clone(),
            rolled_back_to: rollback.as_ref().map(|(p, _)| p.step),
            takeover: std::mem::take(&mut self.taking_over),
        };
        if let Some((p, _)) = rollback {
            self.step = p.step;
            self.opt_step = p.opt_step;
            self.bounds = p.grad_bounds;
        }
        // Lost ranks were retired when they were lost.
        let leavers: Vec<RankId> = self
            .map
            .members
            .iter()
            .copied()
            .filter(|r| !new.is_member(*r) && !lost.contains(r))
            .collect();
        self.map = new;
        if backing_up {
            self.backup = Some((self.map.epoch, self.progress()));
        }
        self.membership_log.push(record.clone());
        let mut out = Vec::new();
        if !leavers.is_empty() {
            out.push(Command::Retire { ranks: leavers });
        }
        out.push(Command::MembershipChanged(Box::new(record)));
        out.extend(self.start_step(now_ms));
        out
    }
}
