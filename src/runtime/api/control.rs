//! The control API for programs that embed the runtime: a cloneable handle to drain, kill,
//! join, snapshot and inspect a job while it trains, and the `Monitor` that keeps the counters
//! behind `status()` and `/metrics` from the run's events. The in-process job (`job.rs`) and the
//! HTTP endpoint (`http.rs`) are layers over the handle.
//!
//! With worker processes (`procs::coord`) the process coordinator drives the run itself and
//! feeds a `Monitor`; its handle (`ControlHandle::for_processes`) refuses a join unless enough
//! standby workers are connected (`ControlError::NoStandby`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ractor::rpc::CallResult;
use ractor::{ActorRef, RpcReplyPort};
use tokio::sync::broadcast;

use super::history::{EventKind, History};
use super::status::{
    ChangeRecord, DrainCause, LeaderStatus, MapTracker, PlanePair, RunState, StateLayout, Status,
    Telemetry,
};
use crate::config::TrainConfig;
use crate::engine::coordinator::{Change, Refusal};
use crate::job::optim_settings;
use crate::plan::{RankId, ShardMap, Stage};
use crate::runtime::actors::CoordView;
use crate::runtime::actors::{ClusterEvent, CoordMsg};
use crate::runtime::clock::Stopwatch;
use crate::runtime::transport::detached::Detached;
use crate::runtime::transport::local::LocalEndpoint;
use crate::runtime::transport::Transport;

/// How long a control call waits for the coordinator.
pub const CONTROL_DEADLINE_MS: u64 = 5_000;
/// Membership changes a slow `subscribe` receiver may fall behind by before it loses the oldest.
pub const SUBSCRIBE_CAPACITY: usize = 64;

/// Why a control request was not carried out. Nothing changed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(transparent)]
    Refused(#[from] Refusal),
    #[error("kill is disabled for this job (enable it with --control-allow-kill or ClusterBuilder::allow_kill)")]
    KillDisabled,
    #[error("nothing would keep an on-demand checkpoint: start the job with --save-dir (or ClusterBuilder::on_demand_snapshots)")]
    NoSnapshotSink,
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("the run has ended")]
    Ended,
    #[error("the coordinator did not answer: {0}")]
    Unavailable(String),
    /// A join with worker processes needs a standby worker per new rank, and too few are
    /// connected (the message says how many, and how to start one).
    #[error("{0}")]
    NoStandby(String),
}

impl ControlError {
    /// The HTTP status that reports this error.
    pub fn http_status(&self) -> u16 {
        match self {
            ControlError::Refused(Refusal::UnknownRank { .. }) => 404,
            ControlError::Refused(_)
            | ControlError::NoSnapshotSink
            | ControlError::Ended
            | ControlError::NoStandby(_) => 409,
            ControlError::KillDisabled => 403,
            ControlError::BadRequest(_) => 400,
            ControlError::Unavailable(_) => 503,
        }
    }

    /// A stable machine-readable name.
    pub fn code(&self) -> &'static str {
        match self {
            ControlError::Refused(Refusal::UnknownRank { .. }) => "unknown_rank",
            ControlError::Refused(Refusal::BelowMin { .. }) => "below_min_ranks",
            ControlError::Refused(Refusal::AboveMax { .. }) => "above_max_ranks",
            ControlError::Refused(Refusal::RunEnding { .. }) => "run_ending",
            ControlError::KillDisabled => "kill_disabled",
            ControlError::NoSnapshotSink => "no_save_dir",
            ControlError::BadRequest(_) => "bad_request",
            ControlError::Ended => "run_ended",
            ControlError::Unavailable(_) => "unavailable",
            ControlError::NoStandby(_) => "no_standby",
        }
    }
}

/// Worker processes waiting to join (process mode): a join takes one per new rank.
pub trait Standbys: Send + Sync {
    /// Promises `count` connected standbys to a join request, or says why not (how many are
    /// connected, how to start one).
    fn reserve(&self, count: u32) -> Result<(), String>;
    /// Gives back promises of a request the coordinator refused.
    fn release(&self, count: u32);
    /// Standbys connected now.
    fn connected(&self) -> usize;
}

/// Which data plane each pair of worker processes uses (process mode).
pub trait DataPlanes: Send + Sync {
    /// Every pair of `members` with the plane it uses.
    fn pairs(&self, members: &[RankId]) -> Vec<PlanePair>;
}

/// What the pump and every handle share.
struct Shared {
    telemetry: Mutex<Telemetry>,
    /// Steps and events for `/history`, timed from `started`.
    history: Mutex<History>,
    started: Stopwatch,
    /// The coordinator's last view, kept once the run is over and the actors are gone.
    final_view: Mutex<Option<CoordView>>,
    changes: broadcast::Sender<ChangeRecord>,
    /// An operator asked for a snapshot that the driver has not handed out yet.
    snapshot_wanted: AtomicBool,
}

impl Shared {
    fn telemetry(&self) -> MutexGuard<'_, Telemetry> {
        // Only the pump writes, field by field; a panic mid-update leaves plain counters.
        self.telemetry.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn history(&self) -> MutexGuard<'_, History> {
        self.history.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn final_view(&self) -> MutexGuard<'_, Option<CoordView>> {
        self.final_view.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The coordinator actor a handle talks to.
#[derive(Clone)]
enum CoordRef {
    /// In-process ranks.
    Local(ActorRef<CoordMsg<LocalEndpoint>>),
    /// Worker processes behind proxies.
    Procs(ActorRef<CoordMsg<Detached>>),
}

/// Calls the coordinator actor whichever transport it runs on.
macro_rules! ask {
    ($handle:expr, $port:ident => $msg:expr) => {
        match &$handle.coordinator {
            CoordRef::Local(a) => call_actor(a, |$port| $msg).await,
            CoordRef::Procs(a) => call_actor(a, |$port| $msg).await,
        }
    };
}

/// Operates a running job. Cheap to clone; every method may be called from any task while the
/// run proceeds.
#[derive(Clone)]
pub struct ControlHandle {
    coordinator: CoordRef,
    shared: Arc<Shared>,
    layout: StateLayout,
    allow_kill: bool,
    snapshots: bool,
    /// Process mode only.
    workers: Option<Workers>,
}

/// What a handle on a process coordinator reaches besides the actor.
#[derive(Clone)]
pub struct Workers {
    /// Where joins find their worker processes.
    pub standbys: Arc<dyn Standbys>,
    pub planes: Arc<dyn DataPlanes>,
}

/// Feeds a handle's counters from the run's events: the in-process pump and the process
/// coordinator both drive one.
pub struct Monitor {
    shared: Arc<Shared>,
    tracker: MapTracker,
}

impl Monitor {
    /// Whether a snapshot that just arrived is the one `request_snapshot` asked for (it then
    /// goes to `Observer::on_requested_snapshot`); answers true once per request.
    pub fn requested_snapshot(&self) -> bool {
        self.shared.snapshot_wanted.swap(false, Ordering::SeqCst)
    }

    /// This coordinator leads a job kept in a metadata store, under `term`; `took_over`: it
    /// continues a job another leader ran, and its takeover lasts until its first step.
    pub fn leads(&self, coordinator: &str, term: u64, failovers: u64, took_over: bool) {
        let mut t = self.shared.telemetry();
        t.leader = Some(LeaderStatus {
            coordinator: coordinator.to_string(),
            term,
            failovers,
            failover_seconds_last: None,
        });
        t.takeover_since_s = took_over.then(|| self.shared.started.secs());
    }

    /// Counts one event; membership changes are priced and published to `subscribe`rs.
    pub fn observe(&mut self, event: &ClusterEvent) {
        match event {
            ClusterEvent::Step(rec) => {
                let t = self.shared.started.secs();
                {
                    let mut tel = self.shared.telemetry();
                    tel.on_step(rec);
                    if let Some(since) = tel.takeover_since_s.take() {
                        if let Some(l) = tel.leader.as_mut() {
                            l.failover_seconds_last = Some(t - since);
                        }
                    }
                }
                self.shared.history().on_step(rec, t);
            }
            ClusterEvent::Membership(rec) => {
                let change = ChangeRecord {
                    moved_bytes: self.tracker.apply(rec),
                    record: (**rec).clone(),
                };
                self.shared.telemetry().on_change(change.clone());
                let t = self.shared.started.secs();
                self.shared.history().on_change(&change, t);
                // No subscriber is no error.
                let _ = self.shared.changes.send(change);
            }
            ClusterEvent::Snapshot(_) | ClusterEvent::SnapshotStreamed { .. } => {
                self.shared.telemetry().on_snapshot()
            }
            ClusterEvent::JoinFailed { rank, reason } => {
                self.shared.telemetry().failed_joins += 1;
                let t = self.shared.started.secs();
                let detail = format!("rank {rank} did not join: {reason}");
                self.shared
                    .history()
                    .on_event(EventKind::FailedJoin, detail, t);
            }
            ClusterEvent::Finished | ClusterEvent::Aborted(_) | ClusterEvent::Deposed(_) => {}
        }
    }

    /// A worker given notice left `seconds` after its notice arrived.
    pub fn drained(&self, seconds: f64) {
        self.shared.telemetry().drains.seconds_last = Some(seconds);
        let t = self.shared.started.secs();
        let detail = format!("a worker given notice left {seconds:.1} s after it");
        self.shared.history().on_event(EventKind::Drain, detail, t);
    }

    /// The run ended: keep the coordinator's last view for `status()` (the actors go next).
    pub fn ended(&self, view: Option<CoordView>, result: Result<(), String>) {
        if view.is_some() {
            *self.shared.final_view() = view;
        }
        self.shared.telemetry().run = match result {
            Ok(()) => RunState::Finished,
            Err(e) => RunState::Failed(e),
        };
    }
}

fn new_shared(tokens_per_step: u64) -> Arc<Shared> {
    let (changes, _) = broadcast::channel(SUBSCRIBE_CAPACITY);
    Arc::new(Shared {
        telemetry: Mutex::new(Telemetry::default()),
        history: Mutex::new(History::new(tokens_per_step)),
        started: Stopwatch::start(),
        final_view: Mutex::new(None),
        changes,
        snapshot_wanted: AtomicBool::new(false),
    })
}

impl ControlHandle {
    /// A spot notice: `rank` leaves gracefully at the next step boundary, its chunks moved to
    /// the others. Refused (nothing changes) for a non-member or below `min_ranks`.
    pub async fn drain(&self, rank: RankId) -> Result<(), ControlError> {
        self.drain_for(rank, DrainCause::Operator).await
    }

    /// [`ControlHandle::drain`], counted under `cause` (`/metrics`: `ezero_drains_total`).
    pub async fn drain_for(&self, rank: RankId, cause: DrainCause) -> Result<(), ControlError> {
        self.request(Change::Leave(rank)).await?;
        self.shared.telemetry().drains.granted(cause);
        let t = self.shared.started.secs();
        let who = match cause {
            DrainCause::Operator => "the operator",
            DrainCause::Signal => "its own notice",
        };
        let detail = format!("rank {rank} drains at the next step boundary (asked by {who})");
        self.shared.history().on_event(EventKind::Drain, detail, t);
        Ok(())
    }

    /// A handle on a process coordinator's actor (see `procs::coord`), and the monitor that
    /// the coordinator feeds with the run's events. `map` is the initial shard map; joins take
    /// their workers from `workers.standbys`.
    /// `snapshots`: the coordinator's observer keeps snapshots, so `request_snapshot` is
    /// accepted; the process coordinator hands the one it asks for to
    /// `Observer::on_requested_snapshot` (`Monitor::requested_snapshot`).
    pub fn for_processes(
        coordinator: ActorRef<CoordMsg<Detached>>,
        map: ShardMap,
        config: &TrainConfig,
        allow_kill: bool,
        snapshots: bool,
        workers: Workers,
    ) -> (ControlHandle, Monitor) {
        let layout = (layout_of(config), config.tokens_per_step() as u64);
        let coordinator = CoordRef::Procs(coordinator);
        let workers = Some(workers);
        Self::with_monitor(coordinator, map, layout, allow_kill, snapshots, workers)
    }

    /// A handle on an in-process coordinator actor, and the monitor its pump feeds.
    pub(crate) fn in_process(
        coordinator: ActorRef<CoordMsg<LocalEndpoint>>,
        map: ShardMap,
        layout: (StateLayout, u64),
        allow_kill: bool,
        snapshots: bool,
    ) -> (ControlHandle, Monitor) {
        let coordinator = CoordRef::Local(coordinator);
        Self::with_monitor(coordinator, map, layout, allow_kill, snapshots, None)
    }

    fn with_monitor(
        coordinator: CoordRef,
        map: ShardMap,
        (layout, tokens_per_step): (StateLayout, u64),
        allow_kill: bool,
        snapshots: bool,
        workers: Option<Workers>,
    ) -> (ControlHandle, Monitor) {
        let shared = new_shared(tokens_per_step);
        let handle = ControlHandle {
            coordinator,
            shared: Arc::clone(&shared),
            layout,
            allow_kill,
            snapshots,
            workers,
        };
        let monitor = Monitor {
            shared,
            tracker: MapTracker::new(map, layout),
        };
        (handle, monitor)
    }

    /// Whether a snapshot that just arrived is the one `request_snapshot` asked for; answers
    /// true once per request (see `Monitor::requested_snapshot`).
    pub(crate) fn requested_snapshot(&self) -> bool {
        self.shared.snapshot_wanted.swap(false, Ordering::SeqCst)
    }

    /// `count` new ranks join at the next step boundary (they take the next unused ids). With
    /// worker processes each takes a standby worker: refused, changing nothing, unless `count`
    /// are connected and not promised to an earlier request.
    pub async fn join(&self, count: u32) -> Result<(), ControlError> {
        if count == 0 {
            return Err(ControlError::BadRequest(
                "join count must be at least 1".into(),
            ));
        }
        let Some(standbys) = self.workers.as_ref().map(|w| &w.standbys) else {
            return self.request(Change::Join(count)).await;
        };
        standbys.reserve(count).map_err(ControlError::NoStandby)?;
        let res = self.request(Change::Join(count)).await;
        if res.is_err() {
            standbys.release(count);
        }
        res
    }

    async fn request(&self, change: Change) -> Result<(), ControlError> {
        ask!(self, p => CoordMsg::Request(change, p))?.map_err(Into::into)
    }

    /// Fault injection for tests and demos: `rank` vanishes halfway through the next step that
    /// starts, and the survivors recover from buddy backups. Refused unless the job allows it.
    pub async fn kill(&self, rank: RankId) -> Result<(), ControlError> {
        if !self.allow_kill {
            return Err(ControlError::KillDisabled);
        }
        ask!(self, p => CoordMsg::Kill(rank, p))?.map_err(Into::into)
    }

    /// Asks for a snapshot at the next step boundary; it arrives as `ClusterEvent::Snapshot`
    /// (the CLI writes it under `--save-dir`).
    pub async fn request_snapshot(&self) -> Result<(), ControlError> {
        if !self.snapshots {
            return Err(ControlError::NoSnapshotSink);
        }
        if self.shared.telemetry().run != RunState::Running {
            return Err(ControlError::Ended);
        }
        self.shared.snapshot_wanted.store(true, Ordering::SeqCst);
        let sent = match &self.coordinator {
            CoordRef::Local(a) => a.cast(CoordMsg::SnapshotNow).is_ok(),
            CoordRef::Procs(a) => a.cast(CoordMsg::SnapshotNow).is_ok(),
        };
        sent.then_some(()).ok_or(ControlError::Ended)
    }

    /// Where the run stands (also after it ended).
    pub async fn status(&self) -> Result<Status, ControlError> {
        let kept = self.shared.final_view().clone();
        let view = match kept {
            Some(v) => v,
            None => ask!(self, p => CoordMsg::View(p))?,
        };
        let mut status = Status::build(&view, &self.shared.telemetry(), self.layout);
        if let Some(w) = &self.workers {
            status.standbys = Some(w.standbys.connected());
            status.data_planes = Some(w.planes.pairs(&view.map.members));
        }
        Ok(status)
    }

    /// The run's recent steps and events (`GET /history`).
    pub fn history(&self) -> History {
        self.shared.history().clone()
    }

    /// `status()` in the Prometheus text format.
    pub async fn metrics(&self) -> Result<String, ControlError> {
        Ok(self.status().await?.prometheus())
    }

    /// Every membership change and recovery from now on. A receiver that falls more than
    /// `SUBSCRIBE_CAPACITY` changes behind loses the oldest (`RecvError::Lagged`).
    pub fn subscribe(&self) -> broadcast::Receiver<ChangeRecord> {
        self.shared.changes.subscribe()
    }
}

async fn call_actor<T: Transport, R: Send + 'static>(
    coordinator: &ActorRef<CoordMsg<T>>,
    msg: impl FnOnce(RpcReplyPort<R>) -> CoordMsg<T>,
) -> Result<R, ControlError> {
    let deadline = Duration::from_millis(CONTROL_DEADLINE_MS);
    match coordinator.call(msg, Some(deadline)).await {
        Ok(CallResult::Success(r)) => Ok(r),
        Ok(CallResult::Timeout) => Err(ControlError::Unavailable(format!(
            "no answer within {CONTROL_DEADLINE_MS} ms"
        ))),
        Ok(CallResult::SenderError) | Err(_) => Err(ControlError::Ended),
    }
}

/// How much state each element carries under `config` (for bytes moved and owned).
pub(crate) fn layout_of(config: &TrainConfig) -> StateLayout {
    // A config is validated before any cluster starts, so the stage is in 0..=3.
    let stage = Stage::from_u8(config.stage).unwrap_or(Stage::Zero3);
    StateLayout::new(
        stage,
        &optim_settings(config),
        config.precision.param_bytes(),
    )
}
