//! One actor per rank. It owns the rank's state and runs each step (and each reshard) on its own
//! OS thread, so a handler never blocks and the actor stays responsive.
//!
//! Expected failures (a collective timed out, the run is stopping) come back to the coordinator
//! as `RankFailed` messages. A panic in the compute is unexpected: the actor then fails, and
//! supervision tells the coordinator.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use super::comm::{Comm, CommError};
use super::coord_actor::CoordMsg;
use super::rank_state::{ChunkState, OptimSettings, RankState};
use super::reshard::Reshard;
use super::step::{run_step, ExecConfig};
use super::transport::Transport;
use crate::data::Dataset;
use crate::engine::messages::{StepPlan, StepReport};
use crate::model::Model;
use crate::plan::{RankId, ShardMap, Stage};
use crate::reduce::ReduceMode;

/// A rank's state (none yet for a joiner) and its communicator, moved to the worker thread.
pub struct Work<T: Transport> {
    pub state: Option<RankState>,
    pub comm: Comm<T>,
}

/// What every rank of a run shares, so that a joiner can build its state.
pub struct RankSetup {
    pub stage: Stage,
    pub mode: ReduceMode,
    pub model: Arc<dyn Model>,
    pub optim: OptimSettings,
    pub data: Arc<Dataset>,
    pub exec: ExecConfig,
}

pub enum RankMsg<T: Transport> {
    RunStep(Box<StepPlan>),
    StepFinished(Box<Work<T>>, Result<Box<StepReport>, CommError>),
    /// Move chunks from `old` to `new` (the rank may be leaving, staying or joining).
    Reshard {
        old: Box<ShardMap>,
        new: Box<ShardMap>,
        step: u64,
    },
    ReshardFinished(Box<Work<T>>, Result<u64, CommError>),
    ComputePanicked(String),
    /// The state of every chunk this rank owns (consolidation, checkpoints).
    Collect(RpcReplyPort<Vec<ChunkState>>),
}

pub struct RankArgs<T: Transport> {
    pub rank: RankId,
    pub work: Work<T>,
    pub coordinator: ActorRef<CoordMsg<T>>,
    pub setup: Arc<RankSetup>,
    /// Fault injection for tests: the compute panics at this step.
    pub panic_at_step: Option<u64>,
}

pub struct RankSlot<T: Transport> {
    rank: RankId,
    work: Option<Work<T>>,
    coordinator: ActorRef<CoordMsg<T>>,
    setup: Arc<RankSetup>,
    panic_at_step: Option<u64>,
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
        })
    }

    async fn handle(
        &self,
        me: ActorRef<Self::Msg>,
        msg: RankMsg<T>,
        slot: &mut RankSlot<T>,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RankMsg::RunStep(plan) => {
                let Some(mut work) = slot.take_work(&format!("step {}", plan.step)) else {
                    return Ok(());
                };
                let (setup, panic_at, rank) =
                    (Arc::clone(&slot.setup), slot.panic_at_step, slot.rank);
                on_thread(me, format!("rank-{rank}-step"), move || {
                    if panic_at == Some(plan.step) {
                        panic!(
                            "injected fault: rank compute panicked at step {}",
                            plan.step
                        );
                    }
                    let res = match work.state.as_mut() {
                        Some(st) => run_step(st, &mut work.comm, &plan, &setup.data, &setup.exec),
                        None => Err(CommError::Protocol {
                            from: rank,
                            what: "asked to train before receiving state".into(),
                        }),
                    };
                    RankMsg::StepFinished(Box::new(work), res.map(Box::new))
                })?;
            }
            RankMsg::StepFinished(work, result) => {
                slot.work = Some(*work);
                slot.report(match result {
                    Ok(report) => CoordMsg::StepDone(report),
                    Err(e) => CoordMsg::RankFailed {
                        rank: slot.rank,
                        reason: e.to_string(),
                    },
                });
            }
            RankMsg::Reshard { old, new, step } => {
                let Some(mut work) = slot.take_work("a reshard") else {
                    return Ok(());
                };
                let (setup, rank) = (Arc::clone(&slot.setup), slot.rank);
                on_thread(me, format!("rank-{rank}-reshard"), move || {
                    let job = Reshard {
                        old: &old,
                        new: &new,
                        stage: setup.stage,
                        mode: setup.mode,
                        model: Arc::clone(&setup.model),
                        optim: setup.optim,
                        step,
                    };
                    let res = job
                        .run(rank, work.state.as_ref(), &mut work.comm)
                        .map(|state| {
                            work.state = state;
                            new.epoch
                        });
                    RankMsg::ReshardFinished(Box::new(work), res)
                })?;
            }
            RankMsg::ReshardFinished(work, result) => {
                slot.work = Some(*work);
                slot.report(match result {
                    Ok(epoch) => CoordMsg::ReshardDone {
                        rank: slot.rank,
                        epoch,
                    },
                    Err(e) => CoordMsg::RankFailed {
                        rank: slot.rank,
                        reason: format!("reshard: {e}"),
                    },
                });
            }
            RankMsg::ComputePanicked(text) => {
                return Err(format!("rank {} compute panicked: {text}", slot.rank).into());
            }
            RankMsg::Collect(reply) => {
                let chunks = slot
                    .work
                    .as_ref()
                    .and_then(|w| w.state.as_ref())
                    .map(|s| s.owned_chunk_states())
                    .unwrap_or_default();
                let _ = reply.send(chunks);
            }
        }
        Ok(())
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".to_string())
}
