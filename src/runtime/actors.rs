//! The ractor actors: a coordinator that drives the `engine::coordinator` state machine, and one
//! actor per rank that owns the rank's state and runs each step off the tokio threads.
//!
//! A rank actor never blocks in a handler: a step runs on its own OS thread, which hands the
//! state back with a message when done. Expected failures (a collective timed out, the run is
//! stopping) come back as `RankFailed` events. A panic in the compute is unexpected: the rank
//! actor then fails, and supervision tells the coordinator, which stops the run with the reason.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tokio::sync::mpsc::UnboundedSender;

use super::clock::Clock;
use super::comm::{Comm, CommError};
use super::rank_state::{ChunkState, RankState};
use super::step::{run_step, ExecConfig};
use super::transport::Transport;
use crate::data::Dataset;
use crate::engine::coordinator::{Command, Coordinator, Event, Progress, StepRecord};
use crate::engine::messages::{StepPlan, StepReport};
use crate::plan::{RankId, ShardMap};

/// Every chunk's state at a step boundary, with the progress needed to resume from it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Snapshot {
    pub progress: Progress,
    pub map: ShardMap,
    /// One entry per chunk, in (unit, index) order.
    pub chunks: Vec<ChunkState>,
}

/// What the cluster reports to whoever drives it.
#[derive(Debug, Clone)]
pub enum ClusterEvent {
    Step(Box<StepRecord>),
    /// Taken at a step boundary; training has already moved on (write it in the background).
    Snapshot(Box<Snapshot>),
    Finished,
    Aborted(String),
}

/// Asks every rank for the chunks it owns and checks that each chunk arrives exactly once.
pub async fn collect_chunks<T: Transport>(
    ranks: &[(RankId, ActorRef<RankMsg<T>>)],
    map: &ShardMap,
) -> Result<Vec<ChunkState>, String> {
    let mut all = BTreeMap::new();
    for (rank, actor) in ranks {
        let reply = actor
            .call(RankMsg::Collect, Some(Duration::from_secs(60)))
            .await
            .map_err(|e| format!("rank {rank}: {e}"))?;
        let ractor::rpc::CallResult::Success(chunks) = reply else {
            return Err(format!("rank {rank} did not answer"));
        };
        for c in chunks {
            let (u, i) = (c.unit as usize, c.index as usize);
            if u >= map.units.len() || i >= map.units[u].owners.len() {
                return Err(format!("rank {rank} sent unknown chunk {u}/{i}"));
            }
            if c.params.len() != map.chunk_range(u, i).len() || all.insert((u, i), c).is_some() {
                return Err(format!(
                    "chunk {u}/{i} from rank {rank} is wrong or repeated"
                ));
            }
        }
    }
    let total: usize = map.units.iter().map(|u| u.owners.len()).sum();
    if all.len() != total {
        return Err(format!("{} of {total} chunks arrived", all.len()));
    }
    Ok(all.into_values().collect())
}

/// One rank's owned state plus its communicator, moved to the compute thread for each step.
pub struct Work<T: Transport> {
    pub state: RankState,
    pub comm: Comm<T>,
}

pub enum RankMsg<T: Transport> {
    RunStep(Box<StepPlan>),
    StepFinished(Box<Work<T>>, Result<Box<StepReport>, CommError>),
    ComputePanicked(String),
    /// The state of every chunk this rank owns (consolidation, checkpoints).
    Collect(RpcReplyPort<Vec<ChunkState>>),
}

pub struct RankArgs<T: Transport> {
    pub work: Work<T>,
    pub coordinator: ActorRef<CoordMsg<T>>,
    pub data: Arc<Dataset>,
    pub exec: ExecConfig,
    /// Fault injection for tests: the compute panics at this step.
    pub panic_at_step: Option<u64>,
}

pub struct RankSlot<T: Transport> {
    rank: RankId,
    work: Option<Work<T>>,
    coordinator: ActorRef<CoordMsg<T>>,
    data: Arc<Dataset>,
    exec: ExecConfig,
    panic_at_step: Option<u64>,
}

pub struct RankActor<T: Transport>(std::marker::PhantomData<fn() -> T>);

impl<T: Transport> Default for RankActor<T> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
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
            rank: args.work.state.rank,
            work: Some(args.work),
            coordinator: args.coordinator,
            data: args.data,
            exec: args.exec,
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
                let Some(mut work) = slot.work.take() else {
                    // A plan while a step is running is a coordinator bug; report, don't die.
                    let reason = format!("received step {} while busy", plan.step);
                    let _ = slot.coordinator.cast(CoordMsg::RankFailed {
                        rank: slot.rank,
                        reason,
                    });
                    return Ok(());
                };
                let (data, exec, panic_at) = (
                    Arc::clone(&slot.data),
                    slot.exec.clone(),
                    slot.panic_at_step,
                );
                std::thread::Builder::new()
                    .name(format!("rank-{}-step", slot.rank))
                    .spawn(move || {
                        let res = std::panic::catch_unwind(AssertUnwindSafe(|| {
                            if panic_at == Some(plan.step) {
                                panic!(
                                    "injected fault: rank compute panicked at step {}",
                                    plan.step
                                );
                            }
                            run_step(&mut work.state, &mut work.comm, &plan, &data, &exec)
                        }));
                        let msg = match res {
                            Ok(r) => RankMsg::StepFinished(Box::new(work), r.map(Box::new)),
                            Err(p) => RankMsg::ComputePanicked(panic_text(&p)),
                        };
                        let _ = me.cast(msg);
                    })?;
            }
            RankMsg::StepFinished(work, result) => {
                slot.work = Some(*work);
                let msg = match result {
                    Ok(report) => CoordMsg::StepDone(report),
                    Err(e) => CoordMsg::RankFailed {
                        rank: slot.rank,
                        reason: e.to_string(),
                    },
                };
                let _ = slot.coordinator.cast(msg);
            }
            RankMsg::ComputePanicked(text) => {
                return Err(format!("rank {} compute panicked: {text}", slot.rank).into());
            }
            RankMsg::Collect(reply) => {
                let chunks = slot
                    .work
                    .as_ref()
                    .map(|w| w.state.owned_chunk_states())
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

/// Messages to the coordinator. Expected failures arrive as `RankFailed`, never as errors.
pub enum CoordMsg<T: Transport> {
    Start {
        ranks: Vec<(RankId, ActorRef<RankMsg<T>>)>,
    },
    StepDone(Box<StepReport>),
    RankFailed {
        rank: RankId,
        reason: String,
    },
    Tick,
    /// Take a snapshot at the next step boundary.
    SnapshotNow,
}

pub struct CoordArgs {
    pub engine: Coordinator,
    pub events: UnboundedSender<ClusterEvent>,
    pub clock: Arc<dyn Clock>,
    pub tick_ms: u64,
    /// Called when the run aborts, to unblock ranks waiting on peers (closes the network).
    pub on_abort: Box<dyn Fn() + Send + Sync>,
}

pub struct CoordState<T: Transport> {
    engine: Coordinator,
    ranks: BTreeMap<RankId, ActorRef<RankMsg<T>>>,
    events: UnboundedSender<ClusterEvent>,
    clock: Arc<dyn Clock>,
    tick_ms: u64,
    on_abort: Box<dyn Fn() + Send + Sync>,
}

impl<T: Transport> CoordState<T> {
    async fn feed(&mut self, event: Event) {
        let mut queue: std::collections::VecDeque<Command> = self.engine.handle(event).into();
        while let Some(cmd) = queue.pop_front() {
            match cmd {
                Command::Snapshot(progress) => {
                    // Ranks are idle between steps, so their chunks are consistent.
                    let ranks: Vec<_> = self.ranks.iter().map(|(r, a)| (*r, a.clone())).collect();
                    let map = self.engine.map().clone();
                    match collect_chunks(&ranks, &map).await {
                        Ok(chunks) => {
                            let snap = Snapshot {
                                progress,
                                map,
                                chunks,
                            };
                            let _ = self.events.send(ClusterEvent::Snapshot(Box::new(snap)));
                        }
                        Err(e) => {
                            let reason = format!("snapshot failed: {e}");
                            queue = self
                                .engine
                                .handle(Event::RankFailed {
                                    rank: u32::MAX,
                                    reason,
                                    now_ms: self.clock.now_ms(),
                                })
                                .into();
                        }
                    }
                }
                Command::RunStep(plan) => {
                    for r in self.ranks.values() {
                        let _ = r.cast(RankMsg::RunStep(Box::new(plan.clone())));
                    }
                }
                Command::StepCompleted(rec) => {
                    let _ = self.events.send(ClusterEvent::Step(rec));
                }
                Command::Finish => {
                    let _ = self.events.send(ClusterEvent::Finished);
                }
                Command::Abort { reason } => {
                    (self.on_abort)();
                    let _ = self.events.send(ClusterEvent::Aborted(reason));
                }
            }
        }
    }
}

pub struct CoordinatorActor<T: Transport>(std::marker::PhantomData<fn() -> T>);

impl<T: Transport> Default for CoordinatorActor<T> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<T: Transport> Actor for CoordinatorActor<T> {
    type Msg = CoordMsg<T>;
    type State = CoordState<T>;
    type Arguments = CoordArgs;

    async fn pre_start(
        &self,
        _me: ActorRef<Self::Msg>,
        args: CoordArgs,
    ) -> Result<CoordState<T>, ActorProcessingErr> {
        Ok(CoordState {
            engine: args.engine,
            ranks: BTreeMap::new(),
            events: args.events,
            clock: args.clock,
            tick_ms: args.tick_ms,
            on_abort: args.on_abort,
        })
    }

    async fn handle(
        &self,
        me: ActorRef<Self::Msg>,
        msg: CoordMsg<T>,
        st: &mut CoordState<T>,
    ) -> Result<(), ActorProcessingErr> {
        let now_ms = st.clock.now_ms();
        match msg {
            CoordMsg::Start { ranks } => {
                st.ranks = ranks.into_iter().collect();
                me.send_interval(Duration::from_millis(st.tick_ms), || CoordMsg::Tick);
                st.feed(Event::Start { now_ms }).await
            }
            CoordMsg::StepDone(report) => st.feed(Event::StepDone { report, now_ms }).await,
            CoordMsg::RankFailed { rank, reason } => {
                st.feed(Event::RankFailed {
                    rank,
                    reason,
                    now_ms,
                })
                .await
            }
            CoordMsg::Tick => st.feed(Event::Tick { now_ms }).await,
            CoordMsg::SnapshotNow => st.feed(Event::SnapshotRequested).await,
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _me: ActorRef<Self::Msg>,
        evt: SupervisionEvent,
        st: &mut CoordState<T>,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, reason) = match evt {
            SupervisionEvent::ActorFailed(cell, err) => (cell, err.to_string()),
            SupervisionEvent::ActorTerminated(cell, _, why) => (
                cell,
                why.unwrap_or_else(|| "rank actor stopped".to_string()),
            ),
            _ => return Ok(()),
        };
        let id = cell.get_id();
        if let Some(rank) = st
            .ranks
            .iter()
            .find(|(_, a)| a.get_id() == id)
            .map(|(r, _)| *r)
        {
            if !st.engine.is_finished() {
                let now_ms = st.clock.now_ms();
                st.feed(Event::RankFailed {
                    rank,
                    reason,
                    now_ms,
                })
                .await;
            }
        }
        Ok(())
    }
}
