//! One actor per rank. It owns the rank's state and runs each step (and each reshard) on its own
//! OS thread, so a handler never blocks and the actor stays responsive.
//!
//! Expected failures (a collective timed out, the run is stopping) come back to the coordinator
//! as `RankFailed` messages. A panic in the compute is unexpected: the actor then fails, and
//! supervision tells the coordinator.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::messages::{CoordMsg, RankMsg};
use crate::config::{Round, RoundKill};
use crate::engine::messages::{StepPlan, StepReport};
use crate::plan::replica::holders;
use crate::plan::{RankId, ShardMap};
use crate::runtime::step::comm::CommError;
use crate::runtime::step::elastic::replica::{replicate, Backup};
use crate::runtime::step::elastic::reshard::Reshard;
use crate::runtime::step::exec::run_step;
use crate::runtime::step::exec::work::{RankSetup, Work};
use crate::runtime::step::state::rank_state::{ChunkState, RankState};
use crate::runtime::transport::Transport;

pub struct RankArgs<T: Transport> {
    pub rank: RankId,
    pub work: Work<T>,
    pub coordinator: ActorRef<CoordMsg<T>>,
    pub setup: Arc<RankSetup>,
    /// Fault injection for tests: the compute panics at this step.
    pub panic_at_step: Option<u64>,
    /// Fault injection: the rank vanishes halfway through this step.
    pub kill_at_step: Option<u64>,
}

pub struct RankSlot<T: Transport> {
    rank: RankId,
    work: Option<Work<T>>,
    coordinator: ActorRef<CoordMsg<T>>,
    setup: Arc<RankSetup>,
    panic_at_step: Option<u64>,
    kill_at_step: Option<u64>,
}

pub struct RankActor<T: Transport>(std::marker::PhantomData<fn() -> T>);

impl<T: Transport> Default for RankActor<T> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<T: Transport> RankSlot<T> {
    /// Takes the work out for a job on the worker thread, or reports that the rank is busy.
    fn take_work(&mut self, what: &str) -> Option<Work<T>> {
        let work = self.work.take();
        if work.is_none() {
            // A command while one is running is a coordinator bug; report it, don't die.
            let reason = format!("received {what} while busy");
            let _ = self.coordinator.cast(CoordMsg::RankFailed {
                rank: self.rank,
                reason,
            });
        }
        work
    }

    fn report(&self, msg: CoordMsg<T>) {
        let _ = self.coordinator.cast(msg);
    }
}

/// The rounds a rank runs on its worker thread: each takes the work out, runs, and hands it
/// back in a `*Finished` message.
impl<T: Transport> RankSlot<T> {
    /// One training step.
    fn start_step(&mut self, me: ActorRef<RankMsg<T>>, plan: StepPlan) -> std::io::Result<()> {
        let (setup, rank) = (Arc::clone(&self.setup), self.rank);
        let Some(mut work) = self.take_work(&format!("step {}", plan.step)) else {
            return Ok(());
        };
        // The coordinator runs a step only once the backup before it is complete.
        if work
            .fresh
            .as_ref()
            .is_some_and(|f| (f.epoch, f.step) == (plan.epoch, plan.step))
        {
            work.backup = work.fresh.take();
        }
        let panic_at = self.panic_at_step;
        // An injected kill stops the rank halfway through the step's phases.
        let vanish_at = (self.kill_at_step == Some(plan.step)).then_some(usize::MAX / 2);
        on_thread(me, format!("rank-{rank}-step"), move || {
            if panic_at == Some(plan.step) {
                panic!(
                    "injected fault: rank compute panicked at step {}",
                    plan.step
                );
            }
            let res = match work.state.as_mut() {
                Some(st) => run_step(
                    st,
                    &mut work.comm,
                    &plan,
                    &setup.data,
                    &setup.exec,
                    vanish_at,
                ),
                None => Err(CommError::Protocol {
                    from: rank,
                    what: "asked to train before receiving state".into(),
                }),
            };
            // A rank doomed in this step dies even if a peer's death interrupted it
            // before it reached the kill point.
            if vanish_at.is_some() && res.is_err() {
                (setup.disconnect)(rank);
                return RankMsg::ComputePanicked(format!(
                    "rank {rank} vanished during step {} (injected kill)",
                    plan.step
                ));
            }
            work.comm.flush();
            RankMsg::StepFinished(Box::new(work), res.map(Box::new))
        })
    }

    /// Moves chunks from `old` to `new`, reading this rank's current state.
    fn start_reshard(
        &mut self,
        me: ActorRef<RankMsg<T>>,
        old: Box<ShardMap>,
        new: Box<ShardMap>,
        step: u64,
    ) -> std::io::Result<()> {
        let (setup, rank) = (Arc::clone(&self.setup), self.rank);
        let Some(mut work) = self.take_work("a reshard") else {
            return Ok(());
        };
        let vanish = dooms(&setup, rank, step, Round::Reshard);
        on_thread(me, format!("rank-{rank}-reshard"), move || {
            let owner = |u: usize, i: usize| old.owner(u, i);
            let current = work.state.take();
            let reader = current.as_ref().map(|s| s.cached_chunks());
            let base = |u: usize, i: usize| reader.as_ref().and_then(|r| r.get(u, i));
            let res = reshard_job(&setup, &owner, &old, &new, step, vanish).run(
                rank,
                &base,
                &mut work.comm,
            );
            if vanish {
                return vanished(&setup, rank, "reshard", step);
            }
            let res = match res {
                Ok(state) => {
                    work.state = state;
                    Ok(new.epoch)
                }
                Err(e) => {
                    work.state = current;
                    Err(e)
                }
            };
            work.comm.flush();
            RankMsg::ReshardFinished(Box::new(work), res)
        })
    }

    /// Rolls back to the backups taken under `old` and reshards them, without the `lost`
    /// ranks, onto `new`.
    fn start_restore(
        &mut self,
        me: ActorRef<RankMsg<T>>,
        old: Box<ShardMap>,
        new: Box<ShardMap>,
        step: u64,
        lost: Vec<RankId>,
    ) -> std::io::Result<()> {
        let (setup, rank) = (Arc::clone(&self.setup), self.rank);
        let Some(mut work) = self.take_work("a restore") else {
            return Ok(());
        };
        let vanish = dooms(&setup, rank, step, Round::Restore);
        on_thread(me, format!("rank-{rank}-restore"), move || {
            // A joiner holds nothing; every other rank rolls back to its backup under
            // `old` (its current state may be half-way into an abandoned round).
            let backup = match old.is_member(rank) {
                true => work.backup_at(old.epoch, step).cloned(),
                false => Some(Backup::default()),
            };
            let res = match (backup, holders(&old, &lost)) {
                (Some(backup), Ok(holder)) => {
                    let base = |u: usize, i: usize| backup.chunk(u, i);
                    reshard_job(&setup, &holder, &old, &new, step, vanish).run(
                        rank,
                        &base,
                        &mut work.comm,
                    )
                }
                (None, Ok(_)) => Err(CommError::Protocol {
                    from: rank,
                    what: format!("no backup under epoch {} before step {step}", old.epoch),
                }),
                (_, Err(missing)) => Err(CommError::Protocol {
                    from: rank,
                    what: format!("chunks {missing:?} have no live copy"),
                }),
            };
            if vanish {
                return vanished(&setup, rank, "restore", step);
            }
            let res = res.map(|state| {
                work.state = state;
                new.epoch
            });
            work.comm.flush();
            RankMsg::ReshardFinished(Box::new(work), res)
        })
    }

    /// Takes a backup before step `step` (a local copy plus replicas with the buddy).
    fn start_replicate(&mut self, me: ActorRef<RankMsg<T>>, step: u64) -> std::io::Result<()> {
        let (setup, rank) = (Arc::clone(&self.setup), self.rank);
        let Some(mut work) = self.take_work("a replication") else {
            return Ok(());
        };
        let vanish = dooms(&setup, rank, step, Round::Replicate);
        on_thread(me, format!("rank-{rank}-replicate"), move || {
            let res = match work.state.as_ref() {
                Some(st) => replicate(st, &mut work.comm, step, vanish, &setup.exec.progress),
                None => Err(CommError::Protocol {
                    from: rank,
                    what: "no state to replicate".into(),
                }),
            };
            if vanish {
                return vanished(&setup, rank, "replicate", step);
            }
            let res = res.map(|b| {
                let done = (b.epoch, b.step);
                work.fresh = Some(b);
                done
            });
            work.comm.flush();
            RankMsg::ReplicateFinished(Box::new(work), res)
        })
    }

    fn step_finished(&mut self, work: Work<T>, result: Result<Box<StepReport>, CommError>) {
        let rank = self.rank;
        self.work = Some(work);
        self.report(match result {
            Ok(report) => CoordMsg::StepDone(report),
            // The rank's tier failed: its state cannot be trusted, so it is lost (its
            // buddy's backup, if any, restores it elsewhere).
            Err(e @ CommError::Storage(_)) => {
                (self.setup.disconnect)(rank);
                CoordMsg::RankFailed {
                    rank,
                    reason: e.to_string(),
                }
            }
            // Expected: a peer vanished or the step was abandoned. The rank is alive and
            // idle; the coordinator decides what happens next.
            Err(e) => CoordMsg::StepAborted {
                rank,
                reason: e.to_string(),
            },
        });
    }

    /// The rank's state, while no round has it on the worker thread.
    fn state(&self) -> Option<&RankState> {
        self.work.as_ref().and_then(|w| w.state.as_ref())
    }

    /// Every chunk this rank owns, or none when it holds no state or cannot read it.
    fn owned_chunk_states(&self) -> Vec<ChunkState> {
        self.state()
            .map(|s| {
                s.owned_chunk_states().unwrap_or_else(|e| {
                    tracing::error!(rank = self.rank, "collecting: {e}");
                    Vec::new()
                })
            })
            .unwrap_or_default()
    }
}

/// Runs `job` on a named thread; a panic becomes a `ComputePanicked` message.
fn on_thread<T: Transport>(
    me: ActorRef<RankMsg<T>>,
    name: String,
    job: impl FnOnce() -> RankMsg<T> + Send + 'static,
) -> std::io::Result<()> {
    std::thread::Builder::new().name(name).spawn(move || {
        let msg = std::panic::catch_unwind(AssertUnwindSafe(job))
            .unwrap_or_else(|p| RankMsg::ComputePanicked(panic_text(&p)));
        let _ = me.cast(msg);
    })?;
    Ok(())
}

impl<T: Transport> Actor for RankActor<T> {
    type Msg = RankMsg<T>;
    type State = RankSlot<T>;
    type Arguments = RankArgs<T>;

    async fn pre_start(
        &self,
        _me: ActorRef<Self::Msg>,
        args: RankArgs<T>,
    ) -> Result<RankSlot<T>, ActorProcessingErr> {
        Ok(RankSlot {
            rank: args.rank,
            work: Some(args.work),
            coordinator: args.coordinator,
            setup: args.setup,
            panic_at_step: args.panic_at_step,
            kill_at_step: args.kill_at_step,
        })
    }

    async fn handle(
        &self,
        me: ActorRef<Self::Msg>,
        msg: RankMsg<T>,
        slot: &mut RankSlot<T>,
    ) -> Result<(), ActorProcessingErr> {
        let rank = slot.rank;
        match msg {
            RankMsg::RunStep(plan) => slot.start_step(me, *plan)?,
            RankMsg::Reshard { old, new, step } => slot.start_reshard(me, old, new, step)?,
            RankMsg::Restore {
                old,
                new,
                step,
                lost,
            } => slot.start_restore(me, old, new, step, lost)?,
            RankMsg::Replicate { step } => slot.start_replicate(me, step)?,
            RankMsg::StepFinished(work, result) => slot.step_finished(*work, result),
            RankMsg::ReshardFinished(work, result) => {
                slot.work = Some(*work);
                slot.report(match result {
                    Ok(epoch) => CoordMsg::ReshardDone { rank, epoch },
                    Err(e) => round_failed(rank, "reshard", e),
                });
            }
            RankMsg::ReplicateFinished(work, result) => {
                slot.work = Some(*work);
                slot.report(match result {
                    Ok((epoch, step)) => CoordMsg::ReplicateDone { rank, epoch, step },
                    Err(e) => round_failed(rank, "replication", e),
                });
            }
            RankMsg::KillAt(step) => slot.kill_at_step = Some(step),
            RankMsg::ComputePanicked(text) => {
                return Err(format!("rank {rank} compute panicked: {text}").into());
            }
            RankMsg::Collect(reply) => {
                let _ = reply.send(slot.owned_chunk_states());
            }
            RankMsg::OwnedChunks {
                unit,
                chunks,
                params_only,
                reply,
            } => {
                let res = match slot.state() {
                    Some(s) => s.owned_chunks_in(unit, &chunks, params_only),
                    None => Err(format!("rank {rank} holds no state")),
                };
                let _ = reply.send(res);
            }
        }
        Ok(())
    }
}

/// A round that a vanished peer (or the coordinator's interrupt) cut short leaves this rank
/// alive and idle with its committed state; anything else means its state cannot be trusted,
/// so it counts as lost.
fn round_failed<T: Transport>(rank: RankId, what: &str, e: CommError) -> CoordMsg<T> {
    match e {
        CommError::Interrupted | CommError::PeerGone(_) | CommError::Timeout { .. } => {
            CoordMsg::StepAborted {
                rank,
                reason: format!("{what}: {e}"),
            }
        }
        _ => CoordMsg::RankFailed {
            rank,
            reason: format!("{what}: {e}"),
        },
    }
}

/// Whether an injected kill strikes this rank in this round.
fn dooms(setup: &RankSetup, rank: RankId, step: u64, round: Round) -> bool {
    setup
        .exec
        .round_kills
        .contains(&RoundKill { rank, step, round })
}

/// The rank disconnects and its actor dies, as a killed process would.
fn vanished<T: Transport>(setup: &RankSetup, rank: RankId, what: &str, step: u64) -> RankMsg<T> {
    (setup.disconnect)(rank);
    RankMsg::ComputePanicked(format!(
        "rank {rank} vanished during the {what} before step {step} (injected kill)"
    ))
}

fn reshard_job<'a>(
    setup: &'a RankSetup,
    sender: &'a dyn Fn(usize, usize) -> RankId,
    old: &'a ShardMap,
    new: &'a ShardMap,
    step: u64,
    vanish: bool,
) -> Reshard<'a> {
    Reshard {
        sender,
        old,
        new,
        stage: setup.stage,
        mode: setup.mode,
        model: Arc::clone(&setup.model),
        optim: setup.optim,
        precision: setup.exec.precision,
        storage: setup.storage.as_deref(),
        step,
        vanish,
        progress: &setup.exec.progress,
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".to_string())
}
