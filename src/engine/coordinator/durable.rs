//! What survives the coordinator: the durable state it commits to the metadata store, and the
//! takeover of a running job by a new leader from that state.
//!
//! The state is small (the committed map, the newest complete backup, the epochs and rank ids
//! handed out, accepted requests); the parameters and their backups live in the ranks. It is
//! committed write-ahead: when an event changes it, `handle` puts `Command::Commit` first among
//! the commands that follow, so the runtime stores it before any rank hears of the change. A
//! rank therefore never drops the backup the store names (it drops its previous backup only
//! when a step runs after the new one, and that step is commanded after the commit), and a
//! new leader never reuses an epoch a dead one handed out.
//!
//! A takeover is a recovery: the new leader rolls every rank that re-attached back to the
//! committed backup and rebuilds onto the committed membership less the ranks that did not come
//! back, exactly as after a rank loss; the steps since the backup are replayed.

use std::collections::{BTreeMap, BTreeSet};

use super::*;

/// The coordinator's state a successor needs to continue the job bit for bit.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Durable {
    /// The committed shard map.
    pub map: ShardMap,
    /// The newest complete buddy backup: its epoch and the progress it was taken at.
    pub backup: Option<(u64, Progress)>,
    /// The highest epoch any round used, committed or not.
    pub epoch_used: u64,
    /// The next rank id a joiner gets.
    pub next_rank: RankId,
    /// Scripted changes of steps up to this one were applied.
    pub script_applied: Option<u64>,
    /// Operator requests accepted and not yet applied.
    pub requested: Vec<Change>,
    /// Leaders that took the job over so far.
    pub failovers: u64,
}

/// What a re-attached rank was doing when its leader went: idle, or busy in (epoch, step).
pub type Attached = BTreeMap<RankId, Option<(u64, u64)>>;

/// Why a successor cannot continue the job from the committed state.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TakeoverRefused(pub String);

/// A takeover waiting for `Event::Start`: the ranks that did not come back, and the ranks busy
/// in work of the old leader's, to interrupt.
#[derive(Clone, Debug)]
pub(super) struct PendingTakeover {
    lost: Vec<RankId>,
    busy: Vec<(RankId, u64, u64)>,
}

/// The parts of the durable state whose change calls for a commit (the script position moves
/// every step and is committed with the next change).
pub(super) type DurableKey = (u64, Option<(u64, u64)>, u64, RankId, usize, u64);

impl Coordinator {
    /// From now on, every change of the durable state is committed first (`Command::Commit`),
    /// starting with the state as it is, at the next event.
    pub fn keep_durable(&mut self) {
        self.durable_key = Some((u64::MAX, None, u64::MAX, RankId::MAX, usize::MAX, u64::MAX));
    }

    /// The state a successor takes over from.
    pub fn durable(&self) -> Durable {
        Durable {
            map: self.map.clone(),
            backup: self.backup.clone(),
            epoch_used: self.epoch_used,
            next_rank: self.next_rank,
            script_applied: self.script_applied,
            requested: self.requested.clone(),
            failovers: self.failovers,
        }
    }

    /// Leaders that took this job over before this one (and this one, if it did).
    pub fn failovers(&self) -> u64 {
        self.failovers
    }

    pub(super) fn current_key(&self) -> DurableKey {
        (
            self.map.epoch,
            self.backup.as_ref().map(|(e, p)| (*e, p.step)),
            self.epoch_used,
            self.next_rank,
            self.requested.len(),
            self.failovers,
        )
    }

    /// Puts a commit first among `out` when the durable state changed since the last one.
    pub(super) fn commit_first(&mut self, mut out: Vec<Command>) -> Vec<Command> {
        let Some(last) = self.durable_key else {
            return out;
        };
        let now = self.current_key();
        if now != last {
            self.durable_key = Some(now);
            out.insert(0, Command::Commit(Box::new(self.durable())));
        }
        out
    }

    /// A leader taking over a running job from its committed state, with the ranks that
    /// re-attached. Nothing happens until `Event::Start`: then the ranks that did not come back
    /// are retired, the busy ones interrupted, and every re-attached member rolls back to the
    /// committed backup and rebuilds onto the committed membership without the lost ones.
    /// Refused when the backup cannot cover the lost ranks or the world would break its bounds.
    pub fn take_over(
        job: JobSpec,
        durable: Durable,
        attached: &Attached,
    ) -> Result<Self, TakeoverRefused> {
        let Some((backup_epoch, progress)) = durable.backup.clone() else {
            return Err(TakeoverRefused(
                "the job's committed state holds no buddy backup (replicate_every is 0 or the \
                 world has one rank), so the ranks cannot be rolled back to a common step: \
                 resume from your newest checkpoint"
                    .into(),
            ));
        };
        let mut c = Self::resume(job, durable.map.clone(), progress);
        c.backup = Some((backup_epoch, c.progress()));
        c.epoch_used = durable.epoch_used.max(durable.map.epoch);
        c.next_rank = durable.next_rank;
        c.script_applied = durable.script_applied;
        c.requested = durable.requested;
        c.failovers = durable.failovers + 1;
        let lost: BTreeSet<RankId> = c
            .map
            .members
            .iter()
            .copied()
            .filter(|r| !attached.contains_key(r))
            .collect();
        let target: Vec<RankId> = c
            .map
            .members
            .iter()
            .copied()
            .filter(|r| !lost.contains(r))
            .collect();
        let who = format!("the coordinator was lost and ranks {lost:?} did not re-attach");
        if let Some(why) = c.unrestorable(&who, "taking over", &lost, target.len()) {
            return Err(TakeoverRefused(why));
        }
        let busy: Vec<(RankId, u64, u64)> = attached
            .iter()
            .filter(|(r, _)| c.map.is_member(**r))
            .filter_map(|(r, b)| b.map(|(e, s)| (*r, e, s)))
            .collect();
        c.phase = Phase::Recovering {
            started_ms: 0,
            lost: lost.clone(),
            waiting: busy.iter().map(|(r, _, _)| *r).collect(),
            target,
        };
        c.takeover = Some(PendingTakeover {
            lost: lost.into_iter().collect(),
            busy,
        });
        Ok(c)
    }

    /// `Event::Start` of a takeover: retire the lost, interrupt the busy, restore when idle.
    pub(super) fn start_takeover(&mut self, pending: PendingTakeover, now_ms: u64) -> Vec<Command> {
        if let Phase::Recovering { started_ms, .. } = &mut self.phase {
            *started_ms = now_ms;
        }
        self.taking_over = true;
        let mut out = Vec::new();
        if !pending.lost.is_empty() {
            out.push(Command::Retire {
                ranks: pending.lost,
            });
        }
        let mut rounds: BTreeMap<(u64, u64), Vec<RankId>> = BTreeMap::new();
        for (rank, epoch, step) in pending.busy {
            rounds.entry((epoch, step)).or_default().push(rank);
        }
        for ((epoch, step), ranks) in rounds {
            out.push(Command::Interrupt { ranks, epoch, step });
        }
        out.extend(self.try_restore(now_ms));
        out
    }
}
