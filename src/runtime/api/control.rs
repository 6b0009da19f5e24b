//! The control API for programs that embed the runtime: a builder that starts a cluster
//! in-process, a cloneable handle to drain, kill, join, snapshot and inspect it while it
//! trains, and the event stream. The HTTP endpoint (`http.rs`) is a thin layer over the handle.
//!
//! A task (the pump) owns the cluster: it reads the coordinator's events, keeps the counters
//! behind `status()` and `/metrics`, forwards every event to the job's stream, and at the end
//! consolidates the parameters and shuts the actors down.
//!
//! With worker processes (`proc_coord.rs`) the process coordinator drives the run itself and
//! feeds a `Monitor`; its handle (`ControlHandle::for_processes`) refuses a join unless enough
//! standby workers are connected (`ControlError::NoStandby`).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ractor::rpc::CallResult;
use ractor::{ActorRef, RpcReplyPort};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::{broadcast, oneshot};
use tokio::task::JoinHandle;

use super::actors::{ClusterEvent, CoordMsg};
use super::cluster::{optim_settings, Cluster, ClusterError, ClusterSpec, Observer, TrainOutcome};
use super::coord_actor::CoordView;
use super::http::{self, HttpLimits};
use super::local::LocalEndpoint;
use super::proxy::Detached;
use super::status::{ChangeRecord, MapTracker, RunState, StateLayout, Status, Telemetry};
use super::transport::Transport;
use crate::config::TrainConfig;
use crate::engine::coordinator::{Change, Refusal};
use crate::plan::{RankId, ShardMap, Stage};

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

/// What the pump and every handle share.
struct Shared {
    telemetry: Mutex<Telemetry>,
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
    /// Where joins find their worker processes (process mode only).
    standbys: Option<Arc<dyn Standbys>>,
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

    /// Counts one event; membership changes are priced and published to `subscribe`rs.
    pub fn observe(&mut self, event: &ClusterEvent) {
        match event {
            ClusterEvent::Step(rec) => self.shared.telemetry().on_step(rec),
            ClusterEvent::Membership(rec) => {
                let change = ChangeRecord {
                    moved_bytes: self.tracker.apply(rec),
                    record: (**rec).clone(),
                };
                self.shared.telemetry().on_change(change.clone());
                // No subscriber is no error.
                let _ = self.shared.changes.send(change);
            }
            ClusterEvent::Snapshot(_) => self.shared.telemetry().on_snapshot(),
            ClusterEvent::JoinFailed { .. } => self.shared.telemetry().failed_joins += 1,
            ClusterEvent::Finished | ClusterEvent::Aborted(_) => {}
        }
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

fn new_shared() -> Arc<Shared> {
    let (changes, _) = broadcast::channel(SUBSCRIBE_CAPACITY);
    Arc::new(Shared {
        telemetry: Mutex::new(Telemetry::default()),
        final_view: Mutex::new(None),
        changes,
        snapshot_wanted: AtomicBool::new(false),
    })
}

impl ControlHandle {
    /// A spot notice: `rank` leaves gracefully at the next step boundary, its chunks moved to
    /// the others. Refused (nothing changes) for a non-member or below `min_ranks`.
    pub async fn drain(&self, rank: RankId) -> Result<(), ControlError> {
        self.request(Change::Leave(rank)).await
    }

    /// A handle on a process coordinator's actor (see `proc_coord.rs`), and the monitor that
    /// the coordinator feeds with the run's events. `map` is the initial shard map; joins take
    /// their workers from `standbys`.
    /// `snapshots`: the coordinator's observer keeps snapshots, so `request_snapshot` is
    /// accepted; the process coordinator hands the one it asks for to
    /// `Observer::on_requested_snapshot` (`Monitor::requested_snapshot`).
    pub fn for_processes(
        coordinator: ActorRef<CoordMsg<Detached>>,
        map: ShardMap,
        config: &TrainConfig,
        allow_kill: bool,
        snapshots: bool,
        standbys: Arc<dyn Standbys>,
    ) -> (ControlHandle, Monitor) {
        let shared = new_shared();
        let layout = layout_of(config);
        let handle = ControlHandle {
            coordinator: CoordRef::Procs(coordinator),
            shared: Arc::clone(&shared),
            layout,
            allow_kill,
            snapshots,
            standbys: Some(standbys),
        };
        let monitor = Monitor {
            shared,
            tracker: MapTracker::new(map, layout),
        };
        (handle, monitor)
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
        let Some(standbys) = &self.standbys else {
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
        status.standbys = self.standbys.as_ref().map(|s| s.connected());
        Ok(status)
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

/// What a builder starts from.
enum Source {
    Spec(Box<ClusterSpec>),
    /// Already started (its saved state read), with the layout of its config.
    Started(Box<Cluster>, StateLayout),
}

/// Starts a cluster in-process with the control API. See `Cluster::builder`.
pub struct ClusterBuilder {
    source: Source,
    control_addr: Option<SocketAddr>,
    http_limits: HttpLimits,
    allow_kill: bool,
    snapshots: bool,
    paused: bool,
}

impl Cluster {
    /// A builder for a job with a control handle, an event stream and, optionally, an HTTP
    /// control endpoint.
    ///
    /// ```no_run
    /// # async fn demo() -> anyhow::Result<()> {
    /// use elastic_zero::config::TrainConfig;
    /// use elastic_zero::runtime::{Cluster, ClusterSpec};
    /// let spec = ClusterSpec::from_config(TrainConfig { ranks: 4, ..TrainConfig::default() })?;
    /// let job = Cluster::builder(spec).start().await?;
    /// job.handle().drain(2).await?; // a spot notice for rank 2
    /// let outcome = job.finish().await?;
    /// # Ok(()) }
    /// ```
    pub fn builder(spec: ClusterSpec) -> ClusterBuilder {
        ClusterBuilder::with_source(Source::Spec(Box::new(spec)))
    }
}

impl ClusterBuilder {
    /// A builder over a cluster already started from `config` (e.g. once its saved state was
    /// read and checked); `start` then starts its run.
    pub fn for_started(cluster: Cluster, config: &TrainConfig) -> ClusterBuilder {
        ClusterBuilder::with_source(Source::Started(Box::new(cluster), layout_of(config)))
    }

    fn with_source(source: Source) -> ClusterBuilder {
        ClusterBuilder {
            source,
            control_addr: None,
            http_limits: HttpLimits::default(),
            allow_kill: false,
            snapshots: false,
            paused: false,
        }
    }

    /// Serve the HTTP control endpoint on this address (port 0 picks a free one; see
    /// `ElasticJob::control_addr`).
    pub fn control_addr(mut self, addr: SocketAddr) -> Self {
        self.control_addr = Some(addr);
        self
    }

    pub fn http_limits(mut self, limits: HttpLimits) -> Self {
        self.http_limits = limits;
        self
    }

    /// Let `kill` (and `POST /ranks/{id}/kill`) inject abrupt rank losses. Off by default.
    pub fn allow_kill(mut self, allow: bool) -> Self {
        self.allow_kill = allow;
        self
    }

    /// Say that the event stream's consumer keeps snapshots, so `request_snapshot` (and
    /// `POST /checkpoint`) are accepted. Off by default.
    pub fn on_demand_snapshots(mut self, keep: bool) -> Self {
        self.snapshots = keep;
        self
    }

    /// Start the actors and the endpoint but not training: requests made before
    /// `ElasticJob::run` apply at step 0. Off by default.
    pub fn paused(mut self, paused: bool) -> Self {
        self.paused = paused;
        self
    }

    /// Starts the actors, the pump and the endpoint, and (unless paused) the first step.
    pub async fn start(self) -> Result<ElasticJob, ClusterError> {
        let (cluster, layout) = match self.source {
            Source::Spec(spec) => {
                let layout = layout_of(&spec.config);
                (Cluster::start(*spec).await?, layout)
            }
            Source::Started(cluster, layout) => (*cluster, layout),
        };
        let shared = new_shared();
        let handle = ControlHandle {
            coordinator: CoordRef::Local(cluster.coordinator().clone()),
            shared: Arc::clone(&shared),
            layout,
            allow_kill: self.allow_kill,
            snapshots: self.snapshots,
            standbys: None,
        };
        let server = match self.control_addr {
            Some(addr) => {
                let served = http::serve(addr, handle.clone(), self.http_limits).await;
                match served {
                    Ok(s) => Some(s),
                    Err(e) => {
                        cluster.shutdown().await;
                        return Err(ClusterError::Spawn(format!(
                            "cannot serve the control endpoint on {addr}: {e}"
                        )));
                    }
                }
            }
            None => None,
        };
        let monitor = Monitor {
            tracker: MapTracker::new(cluster.shard_map().clone(), layout),
            shared,
        };
        let (tx, events) = unbounded_channel();
        let (done_tx, outcome) = oneshot::channel();
        let (go, go_rx) = oneshot::channel();
        // Subscribed before the run starts, so `drive` prices every change, even one that
        // completes before it is called.
        let changes = handle.subscribe();
        let pump = tokio::spawn(pump(cluster, monitor, tx, done_tx, go_rx));
        let mut job = ElasticJob {
            handle,
            events,
            outcome,
            control_addr: server.as_ref().map(|s| s.0),
            server: server.map(|s| s.1),
            pump,
            go: Some(go),
            changes: Some(changes),
        };
        if !self.paused {
            job.run();
        }
        Ok(job)
    }
}

/// A job started by `ClusterBuilder::start`, training until it finishes or fails.
pub struct ElasticJob {
    handle: ControlHandle,
    events: UnboundedReceiver<ClusterEvent>,
    outcome: oneshot::Receiver<Result<TrainOutcome, ClusterError>>,
    control_addr: Option<SocketAddr>,
    server: Option<JoinHandle<()>>,
    pump: JoinHandle<()>,
    /// Starts training (see `ClusterBuilder::paused`); `None` once sent.
    go: Option<oneshot::Sender<()>>,
    /// Changes since the start, for `drive`.
    changes: Option<broadcast::Receiver<ChangeRecord>>,
}

impl ElasticJob {
    /// Starts training if the job was built paused; does nothing otherwise.
    pub fn run(&mut self) {
        if let Some(go) = self.go.take() {
            // The pump only goes away after the run, so it is listening.
            let _ = go.send(());
        }
    }

    pub fn handle(&self) -> ControlHandle {
        self.handle.clone()
    }

    /// The address the HTTP endpoint listens on, if it was asked for.
    pub fn control_addr(&self) -> Option<SocketAddr> {
        self.control_addr
    }

    /// The next event; `None` after `Finished` or `Aborted` has been delivered. A paused job
    /// sends none until `run`.
    pub async fn next_event(&mut self) -> Option<ClusterEvent> {
        self.events.recv().await
    }

    /// Waits for the end of the run (events not read are dropped) and returns every step's
    /// record and the consolidated parameters.
    pub async fn finish(mut self) -> Result<TrainOutcome, ClusterError> {
        self.run();
        let outcome = (&mut self.outcome)
            .await
            .unwrap_or_else(|_| Err(ClusterError::Aborted("the cluster task stopped".into())));
        self.stop_server();
        let _ = (&mut self.pump).await;
        outcome
    }

    /// Feeds every event to `observer` until the run ends, then returns as `finish` does.
    /// Membership changes arrive with their cost (`Observer::on_change`); the first snapshot
    /// after `request_snapshot` arrives as `Observer::on_requested_snapshot`.
    pub async fn drive(
        mut self,
        mut observer: impl Observer,
    ) -> Result<TrainOutcome, ClusterError> {
        let mut changes = match self.changes.take() {
            Some(c) => c,
            None => self.handle.subscribe(),
        };
        self.run();
        while let Some(event) = self.next_event().await {
            match event {
                ClusterEvent::Step(rec) => observer.on_step(&rec),
                ClusterEvent::Snapshot(snap) => {
                    if self
                        .handle
                        .shared
                        .snapshot_wanted
                        .swap(false, Ordering::SeqCst)
                    {
                        observer.on_requested_snapshot(*snap)
                    } else {
                        observer.on_snapshot(*snap)
                    }
                }
                ClusterEvent::Membership(rec) => {
                    // The pump publishes each change before it forwards the event.
                    let mut costed = None;
                    while let Ok(c) = changes.try_recv() {
                        if c.record == *rec {
                            costed = Some(c);
                            break;
                        }
                    }
                    match costed {
                        Some(c) => observer.on_change(&c),
                        None => observer.on_membership(&rec),
                    }
                }
                ClusterEvent::JoinFailed { rank, reason } => observer.on_join_failed(rank, &reason),
                ClusterEvent::Finished | ClusterEvent::Aborted(_) => break,
            }
        }
        self.finish().await
    }

    fn stop_server(&mut self) {
        if let Some(s) = self.server.take() {
            s.abort();
        }
    }
}

impl Drop for ElasticJob {
    fn drop(&mut self) {
        self.stop_server();
    }
}

/// How much state each element carries under `config` (for bytes moved and owned).
fn layout_of(config: &TrainConfig) -> StateLayout {
    // A config is validated before any cluster starts, so the stage is in 0..=3.
    let stage = Stage::from_u8(config.stage).unwrap_or(Stage::Zero3);
    StateLayout::new(stage, &optim_settings(config))
}

/// Owns the cluster: keeps the counters, forwards events, and finishes the run.
async fn pump(
    mut cluster: Cluster,
    mut monitor: Monitor,
    tx: UnboundedSender<ClusterEvent>,
    done: oneshot::Sender<Result<TrainOutcome, ClusterError>>,
    go: oneshot::Receiver<()>,
) {
    if go.await.is_err() {
        // The job was dropped before it ran.
        cluster.shutdown().await;
        return;
    }
    cluster.run();
    let mut records = Vec::new();
    let end = loop {
        let Some(event) = cluster.next_event().await else {
            break Err(ClusterError::Aborted("the coordinator stopped".into()));
        };
        monitor.observe(&event);
        let end = match &event {
            ClusterEvent::Step(rec) => {
                records.push((**rec).clone());
                None
            }
            ClusterEvent::Membership(_)
            | ClusterEvent::Snapshot(_)
            | ClusterEvent::JoinFailed { .. } => None,
            ClusterEvent::Finished => Some(Ok(())),
            ClusterEvent::Aborted(reason) => Some(Err(ClusterError::Aborted(reason.clone()))),
        };
        if let Some(end) = end {
            // Keep the coordinator's last word for `status()` before the actors go.
            let view = cluster
                .coordinator()
                .call(
                    CoordMsg::View,
                    Some(Duration::from_millis(CONTROL_DEADLINE_MS)),
                )
                .await;
            let view = match view {
                Ok(CallResult::Success(v)) => Some(v),
                _ => None,
            };
            monitor.ended(view, end.as_ref().map(|_| ()).map_err(|e| e.to_string()));
            let _ = tx.send(event);
            break end;
        }
        // The job may have stopped reading its events; that is its choice.
        let _ = tx.send(event);
    };
    let outcome = match end {
        Ok(()) => cluster.collect_params().await.map(|params| TrainOutcome {
            records,
            params,
            resume_reads: cluster.resume_reads().to_vec(),
            net: cluster.net_counts(),
        }),
        Err(e) => Err(e),
    };
    cluster.shutdown().await;
    let _ = done.send(outcome);
}
