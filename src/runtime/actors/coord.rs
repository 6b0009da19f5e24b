//! The coordinator actor: feeds the `engine::coordinator` state machine with messages and the
//! time, and carries out the commands it returns (hand out step plans, spawn and retire ranks,
//! start reshards, take snapshots, report events).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, ActorStatus, SupervisionEvent};
use tokio::sync::mpsc::UnboundedSender;

use super::collect::{collect_chunks, digest_params, stream_snapshot, Streamed};
use super::events::ClusterEvent;
use super::messages::{Activity, CoordMsg, CoordView, RankMsg};
use super::rank::{RankActor, RankArgs};
use crate::engine::coordinator::{Command, Coordinator, Durable, Event, Progress, Refusal};
use crate::engine::messages::{StepPlan, StepReport};
use crate::plan::{RankId, ShardMap};
use crate::runtime::clock::Clock;
use crate::runtime::step::elastic::snapshot::{Snapshot, SnapshotSink};
use crate::runtime::step::progress::{Beat, RunProgress};
use crate::runtime::transport::Transport;

/// Starts a new rank (a joiner): the arguments of its rank actor (its endpoint, shared setup, no
/// state), or `Later` where the runtime starts it itself, or a reason it cannot.
pub type RankFactory<T> =
    Box<dyn Fn(RankId, ActorRef<CoordMsg<T>>) -> Result<NewRank<T>, String> + Send + Sync>;

/// A snapshot at the next step boundary on demand from outside the actor system: a signal
/// handler sets `flag` (the CLI's SIGTERM/SIGINT), and the coordinator actor asks its engine for
/// a snapshot when the next step report arrives, so the boundary that step ends at takes it.
/// Cheaper than a snapshot at every boundary just in case: with worker processes each snapshot
/// carries the whole training state over the control connections.
#[derive(Clone, Debug, Default)]
pub struct BoundarySnapshot {
    pub flag: Arc<AtomicBool>,
    /// Test hook: raise a real SIGTERM as the first report of this step (0-based) arrives, so
    /// that the snapshot it asks for is the one at the end of this step.
    pub raise_sigterm_at: Option<u64>,
}

/// How a joiner comes up.
pub enum NewRank<T: Transport> {
    /// The coordinator actor spawns a rank actor with these arguments.
    Args(Box<RankArgs<T>>),
    /// The runtime starts it (a worker process takes some time to come up) and answers with
    /// `CoordMsg::Joined`; the coordinator actor keeps handling messages meanwhile.
    Later,
}

pub struct CoordArgs<T: Transport> {
    pub engine: Coordinator,
    pub events: UnboundedSender<ClusterEvent>,
    pub clock: Arc<dyn Clock>,
    pub tick_ms: u64,
    /// Called when the run aborts, to unblock ranks waiting on peers (closes the network).
    pub on_abort: Box<dyn Fn() + Send + Sync>,
    /// Called when a rank is retired (disconnects it from the network), with the steps
    /// completed when it left.
    pub on_retire: Box<dyn Fn(RankId, u64) + Send + Sync>,
    /// Wakes a rank from the abandoned (epoch, step).
    pub on_interrupt: Box<dyn Fn(RankId, u64, u64) + Send + Sync>,
    pub factory: RankFactory<T>,
    pub boundary_snapshot: Option<BoundarySnapshot>,
    /// Where this process's ranks record their beats, read at every tick. Worker processes
    /// send `CoordMsg::Progress` instead.
    pub progress: Option<Arc<RunProgress>>,
    /// Where the engine's durable state is committed (a metadata store, under this leader's
    /// term); `None`: the job does not outlive this coordinator.
    pub committer: Option<Arc<dyn Committer>>,
}

/// Stores the coordinator's durable state, conditioned on this leader still leading.
pub trait Committer: Send + Sync {
    /// `Err`: the state was not stored (this leader was deposed, or the store is gone), and
    /// this coordinator must stop commanding at once.
    fn commit<'a>(
        &'a self,
        state: &'a Durable,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send + 'a>>;
}

pub struct CoordState<T: Transport> {
    engine: Coordinator,
    ranks: BTreeMap<RankId, ActorRef<RankMsg<T>>>,
    events: UnboundedSender<ClusterEvent>,
    clock: Arc<dyn Clock>,
    tick_ms: u64,
    on_abort: Box<dyn Fn() + Send + Sync>,
    on_retire: Box<dyn Fn(RankId, u64) + Send + Sync>,
    on_interrupt: Box<dyn Fn(RankId, u64, u64) + Send + Sync>,
    factory: RankFactory<T>,
    boundary_snapshot: Option<BoundarySnapshot>,
    /// Operator kills waiting for the next step to start.
    pending_kills: Vec<RankId>,
    activity: Activity,
    awaiting: BTreeSet<RankId>,
    progress: Option<Arc<RunProgress>>,
    /// The beats already passed on to the engine.
    beats_seen: BTreeMap<RankId, Beat>,
    /// Where snapshots stream to, when they are not collected whole.
    snapshot_sink: Option<Arc<dyn SnapshotSink>>,
    committer: Option<Arc<dyn Committer>>,
    /// A commit was refused: nothing more is carried out.
    deposed: bool,
}

impl<T: Transport> CoordState<T> {
    fn view(&self) -> CoordView {
        let job = self.engine.job();
        CoordView {
            map: self.engine.map().clone(),
            step: self.engine.step(),
            steps: job.steps,
            min_ranks: job.min_ranks,
            max_ranks: job.max_ranks,
            finished: self.engine.is_finished(),
            backup_step: self.engine.backup_step(),
            pending_kills: self.pending_kills.clone(),
            activity: self.activity,
            awaiting: self.awaiting.iter().copied().collect(),
        }
    }

    /// Records a new activity and the ranks it waits for.
    fn begin(&mut self, activity: Activity, ranks: impl IntoIterator<Item = RankId>) {
        self.activity = activity;
        self.awaiting = ranks.into_iter().collect();
    }

    /// Live ranks that are members of `old` or `new`: those a reshard or a restore involves.
    fn in_either(&self, old: &ShardMap, new: &ShardMap) -> Vec<RankId> {
        self.ranks
            .keys()
            .copied()
            .filter(|r| old.is_member(*r) || new.is_member(*r))
            .collect()
    }

    /// A rank answered the current activity (done, aborted or failed).
    fn answered(&mut self, rank: RankId) {
        self.awaiting.remove(&rank);
    }

    fn kill(&mut self, rank: RankId) -> Result<(), Refusal> {
        if self.pending_kills.contains(&rank) {
            return Ok(());
        }
        let mut lost = self.pending_kills.clone();
        lost.push(rank);
        self.engine.check_loss(&lost)?;
        self.pending_kills.push(rank);
        Ok(())
    }

    fn rank_list(&self) -> Vec<(RankId, ActorRef<RankMsg<T>>)> {
        self.ranks.iter().map(|(r, a)| (*r, a.clone())).collect()
    }

    /// Feeds one event and carries out every command that follows from it.
    async fn feed(&mut self, me: &ActorRef<CoordMsg<T>>, event: Event) {
        if self.deposed {
            return;
        }
        let mut queue: VecDeque<Command> = self.engine.handle(event).into();
        while let Some(cmd) = queue.pop_front() {
            if self.deposed {
                return;
            }
            let follow_up = self.execute(me, cmd).await;
            for ev in follow_up {
                queue.extend(self.engine.handle(ev));
            }
        }
    }

    /// Executes one command; returns the events it produced.
    async fn execute(&mut self, me: &ActorRef<CoordMsg<T>>, cmd: Command) -> Vec<Event> {
        match cmd {
            Command::Commit(state) => self.commit(&state).await,
            Command::RunStep(plan) => self.run_step(plan),
            Command::Snapshot(progress) => return self.snapshot(progress).await,
            Command::Spawn { ranks } => return self.spawn(me, ranks).await,
            Command::Reshard { old, new, step } => {
                let told = self.in_either(&old, &new);
                self.begin(Activity::Resharding { step }, told.iter().copied());
                for a in told.iter().filter_map(|r| self.ranks.get(r)) {
                    let _ = a.cast(RankMsg::Reshard {
                        old: Box::new(old.clone()),
                        new: Box::new(new.clone()),
                        step,
                    });
                }
            }
            Command::Retire { ranks } => {
                for r in ranks {
                    if let Some(a) = self.ranks.remove(&r) {
                        a.stop(Some("left the job".into()));
                    }
                    (self.on_retire)(r, self.engine.step());
                }
            }
            Command::Replicate { step, ranks } => {
                self.begin(Activity::Replicating { step }, ranks.iter().copied());
                for r in ranks {
                    if let Some(a) = self.ranks.get(&r) {
                        let _ = a.cast(RankMsg::Replicate { step });
                    }
                }
            }
            Command::Interrupt { ranks, epoch, step } => {
                for r in ranks {
                    (self.on_interrupt)(r, epoch, step);
                }
            }
            Command::Restore {
                old,
                new,
                step,
                lost,
            } => self.restore(old, new, step, lost),
            Command::MembershipChanged(rec) => {
                let _ = self.events.send(ClusterEvent::Membership(rec));
            }
            Command::StepCompleted(rec) => {
                let _ = self.events.send(ClusterEvent::Step(rec));
            }
            // The event is the report (the CLI prints it); the join task of worker processes
            // has logged the cause already.
            Command::JoinFailed { rank, reason } => {
                let _ = self.events.send(ClusterEvent::JoinFailed { rank, reason });
            }
            Command::Finish => {
                self.begin(Activity::Finished, []);
                let _ = self.events.send(ClusterEvent::Finished);
            }
            Command::Abort { reason } => {
                self.begin(Activity::Failed, []);
                (self.on_abort)();
                let _ = self.events.send(ClusterEvent::Aborted(reason));
            }
        }
        Vec::new()
    }

    /// Stores the durable state before anything that depends on it goes out; a refusal
    /// deposes this coordinator: it commands nothing more, and its runtime steps down.
    async fn commit(&mut self, state: &Durable) {
        let Some(committer) = self.committer.clone() else {
            return;
        };
        if let Err(why) = committer.commit(state).await {
            self.deposed = true;
            self.begin(Activity::Failed, []);
            let _ = self.events.send(ClusterEvent::Deposed(why));
        }
    }

    /// Hands every rank the step's plan, after the operator's kills waiting for it.
    fn run_step(&mut self, plan: StepPlan) {
        // Told before the step on the same mailbox, so the rank dies inside this step.
        for rank in std::mem::take(&mut self.pending_kills) {
            if let Some(a) = self
                .ranks
                .get(&rank)
                .filter(|_| self.engine.map().is_member(rank))
            {
                let _ = a.cast(RankMsg::KillAt(plan.step));
            }
        }
        for r in self.ranks.values() {
            let _ = r.cast(RankMsg::RunStep(Box::new(plan.clone())));
        }
        let members = self.engine.map().members.clone();
        self.begin(Activity::Running { step: plan.step }, members);
    }

    /// Rolls back onto `new` from the backups taken under `old`, without the `lost` ranks.
    fn restore(&mut self, old: ShardMap, new: ShardMap, step: u64, lost: Vec<RankId>) {
        // Lost ranks were retired; every other rank of either map takes part.
        let told = self.in_either(&old, &new);
        self.begin(Activity::Restoring { step }, told.iter().copied());
        for a in told.iter().filter_map(|r| self.ranks.get(r)) {
            let _ = a.cast(RankMsg::Restore {
                old: Box::new(old.clone()),
                new: Box::new(new.clone()),
                step,
                lost: lost.clone(),
            });
        }
    }

    /// Takes a snapshot at this boundary: streamed to the sink where there is one, else
    /// collected whole and sent as an event.
    async fn snapshot(&mut self, progress: Progress) -> Vec<Event> {
        // Ranks are idle between steps, so their chunks are consistent.
        let map = self.engine.map().clone();
        if let Some(sink) = self.snapshot_sink.clone() {
            return self.stream_snapshot(&map, progress, &*sink).await;
        }
        match collect_chunks(&self.rank_list(), &map).await {
            Ok(chunks) => {
                let snap = Snapshot {
                    progress,
                    map,
                    chunks,
                };
                let _ = self.events.send(ClusterEvent::Snapshot(Box::new(snap)));
                Vec::new()
            }
            Err(e) => {
                let reason = format!("snapshot failed: {e}");
                vec![Event::RankFailed {
                    rank: u32::MAX,
                    reason,
                    now_ms: self.clock.now_ms(),
                }]
            }
        }
    }

    async fn stream_snapshot(
        &mut self,
        map: &ShardMap,
        progress: Progress,
        sink: &dyn SnapshotSink,
    ) -> Vec<Event> {
        // The ranks wait at this boundary until the snapshot is on disk.
        let step = progress.step;
        match stream_snapshot(&self.rank_list(), map, &progress, sink).await {
            Ok(streamed) => {
                let saved = match streamed {
                    Streamed::Saved => Ok(()),
                    Streamed::SaveFailed(e) => Err(e),
                };
                let _ = self
                    .events
                    .send(ClusterEvent::SnapshotStreamed { step, saved });
                // The ranks waited for the stream; the next phase's time starts now.
                vec![Event::Paused {
                    now_ms: self.clock.now_ms(),
                }]
            }
            Err(e) => vec![Event::RankFailed {
                rank: u32::MAX,
                reason: format!("snapshot failed: {e}"),
                now_ms: self.clock.now_ms(),
            }],
        }
    }

    /// Starts the joiners the factory can start here; the others come up as `Joined`.
    async fn spawn(&mut self, me: &ActorRef<CoordMsg<T>>, ranks: Vec<RankId>) -> Vec<Event> {
        let mut out = Vec::new();
        for rank in ranks {
            let args = match (self.factory)(rank, me.clone()) {
                Ok(NewRank::Args(args)) => *args,
                Ok(NewRank::Later) => continue,
                Err(reason) => {
                    out.push(Event::RankFailed {
                        rank,
                        reason: format!("could not start: {reason}"),
                        now_ms: self.clock.now_ms(),
                    });
                    continue;
                }
            };
            match Actor::spawn_linked(None, RankActor::<T>::default(), args, me.get_cell()).await {
                Ok((actor, _)) => {
                    self.ranks.insert(rank, actor);
                    out.push(Event::Spawned {
                        rank,
                        host: None,
                        now_ms: self.clock.now_ms(),
                    });
                }
                Err(e) => out.push(Event::RankFailed {
                    rank,
                    reason: format!("could not start: {e}"),
                    now_ms: self.clock.now_ms(),
                }),
            }
        }
        out
    }
}

/// What the coordinator actor does with each message family: rank answers and beats become
/// engine events; queries are answered from the engine and the ranks.
impl<T: Transport> CoordState<T> {
    /// A rank answered the current activity: it no longer holds the engine up.
    async fn rank_answered(&mut self, me: &ActorRef<CoordMsg<T>>, rank: RankId, event: Event) {
        self.answered(rank);
        self.feed(me, event).await
    }

    /// A step report, which may first ask for a snapshot at the boundary it ends at.
    async fn step_done(
        &mut self,
        me: &ActorRef<CoordMsg<T>>,
        report: Box<StepReport>,
        now_ms: u64,
    ) {
        self.answered(report.rank);
        if let Some(b) = &mut self.boundary_snapshot {
            if b.raise_sigterm_at == Some(report.step) {
                b.raise_sigterm_at = None;
                // The handler runs in this thread before raise returns: the flag is set.
                let _ = signal_hook::low_level::raise(signal_hook::consts::SIGTERM);
            }
            if b.flag.swap(false, Ordering::SeqCst) {
                self.feed(me, Event::SnapshotRequested).await;
            }
        }
        self.feed(me, Event::StepDone { report, now_ms }).await
    }

    /// The clock's tick, after the beats recorded since the last one.
    async fn tick(&mut self, me: &ActorRef<CoordMsg<T>>, now_ms: u64) {
        let beats = self
            .progress
            .as_ref()
            .map(|p| p.beats())
            .unwrap_or_default();
        for (rank, beat) in beats {
            if self.beats_seen.insert(rank, beat) != Some(beat) {
                let (epoch, step) = (beat.epoch, beat.step);
                let e = Event::Progress {
                    rank,
                    epoch,
                    step,
                    now_ms,
                };
                self.feed(me, e).await;
            }
        }
        self.feed(me, Event::Tick { now_ms }).await
    }

    /// A joiner the runtime started itself is up, or could not come up.
    async fn joined(
        &mut self,
        me: &ActorRef<CoordMsg<T>>,
        rank: RankId,
        started: Result<ActorRef<RankMsg<T>>, String>,
        host: Option<String>,
        now_ms: u64,
    ) {
        // A rank that stopped before this message arrived is not up.
        let started = started.and_then(|a| match a.get_status() {
            ActorStatus::Stopping | ActorStatus::Stopped => {
                Err("it stopped while coming up".to_string())
            }
            _ => Ok(a),
        });
        let event = match started {
            Ok(actor) => {
                self.ranks.insert(rank, actor);
                Event::Spawned { rank, host, now_ms }
            }
            Err(reason) => Event::RankFailed {
                rank,
                reason: format!("could not start: {reason}"),
                now_ms,
            },
        };
        self.feed(me, event).await
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
    type Arguments = CoordArgs<T>;

    async fn pre_start(
        &self,
        _me: ActorRef<Self::Msg>,
        args: CoordArgs<T>,
    ) -> Result<CoordState<T>, ActorProcessingErr> {
        Ok(CoordState {
            engine: args.engine,
            ranks: BTreeMap::new(),
            events: args.events,
            clock: args.clock,
            tick_ms: args.tick_ms,
            on_abort: args.on_abort,
            on_retire: args.on_retire,
            on_interrupt: args.on_interrupt,
            factory: args.factory,
            boundary_snapshot: args.boundary_snapshot,
            pending_kills: Vec::new(),
            activity: Activity::Starting,
            awaiting: BTreeSet::new(),
            progress: args.progress,
            beats_seen: BTreeMap::new(),
            snapshot_sink: None,
            committer: args.committer,
            deposed: false,
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
                st.feed(&me, Event::Start { now_ms }).await
            }
            CoordMsg::StepDone(report) => st.step_done(&me, report, now_ms).await,
            CoordMsg::RankFailed { rank, reason } => {
                let e = Event::RankFailed {
                    rank,
                    reason,
                    now_ms,
                };
                st.rank_answered(&me, rank, e).await
            }
            CoordMsg::ReshardDone { rank, epoch } => {
                let e = Event::ReshardDone {
                    rank,
                    epoch,
                    now_ms,
                };
                st.rank_answered(&me, rank, e).await
            }
            CoordMsg::StepAborted { rank, reason } => {
                let e = Event::StepAborted {
                    rank,
                    reason,
                    now_ms,
                };
                st.rank_answered(&me, rank, e).await
            }
            CoordMsg::ReplicateDone { rank, epoch, step } => {
                let e = Event::ReplicateDone {
                    rank,
                    epoch,
                    step,
                    now_ms,
                };
                st.rank_answered(&me, rank, e).await
            }
            CoordMsg::Tick => st.tick(&me, now_ms).await,
            CoordMsg::Progress { rank, epoch, step } => {
                let e = Event::Progress {
                    rank,
                    epoch,
                    step,
                    now_ms,
                };
                st.feed(&me, e).await
            }
            CoordMsg::StreamSnapshots(sink) => st.snapshot_sink = Some(sink),
            CoordMsg::SnapshotNow => st.feed(&me, Event::SnapshotRequested).await,
            CoordMsg::Request(change, reply) => {
                let _ = reply.send(st.engine.request(change));
            }
            CoordMsg::Kill(rank, reply) => {
                let _ = reply.send(st.kill(rank));
            }
            CoordMsg::View(reply) => {
                let _ = reply.send(st.view());
            }
            CoordMsg::Collect(reply) => {
                let map = st.engine.map().clone();
                let res = collect_chunks(&st.rank_list(), &map)
                    .await
                    .map(|c| (map, c));
                let _ = reply.send(res);
            }
            CoordMsg::Digest(reply) => {
                let map = st.engine.map().clone();
                let _ = reply.send(digest_params(&st.rank_list(), &map).await);
            }
            CoordMsg::Joined {
                rank,
                started,
                host,
            } => st.joined(&me, rank, started, host, now_ms).await,
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        me: ActorRef<Self::Msg>,
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
        // Retired ranks were removed from `ranks` before they stopped, so they are not failures.
        if let Some(rank) = st
            .ranks
            .iter()
            .find(|(_, a)| a.get_id() == id)
            .map(|(r, _)| *r)
        {
            if !st.engine.is_finished() {
                st.answered(rank);
                let now_ms = st.clock.now_ms();
                st.feed(
                    &me,
                    Event::RankFailed {
                        rank,
                        reason,
                        now_ms,
                    },
                )
                .await;
            }
        }
        Ok(())
    }
}
