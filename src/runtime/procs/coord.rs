//! The coordinator process: admits worker processes, hands each its rank, the shard map and its
//! peers' data addresses, then drives the unchanged coordinator actor with one `RankProxy` per
//! worker. A worker whose connection closes, or which stays silent past the heartbeat timeout,
//! is stopped as a proxy, which the coordinator actor sees as that rank failing (the proxy and
//! its connection's tasks: `conn.rs`).
//!
//! Every worker connection is mutual TLS against the cluster CA (ALPN `ezero-control/1`), with
//! the cluster token inside as defence in depth. Handshakes and hellos run concurrently, each
//! under a timeout: a peer without a cluster certificate is refused and logged, and never holds
//! up the admission of others (`admit.rs`).
//!
//! Workers that connect once the job has started (or say `standby` in their hello) are held as
//! standbys (`standby.rs`); a join takes one per new rank (`join.rs`).
//!
//! With `control` set it also serves the HTTP control endpoint of `ezero train --control` over
//! the same coordinator actor. A kill there is carried out by the worker itself: told over its
//! control connection, it ends its own process with SIGKILL halfway through the next step.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ractor::{Actor, ActorRef};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

use super::admit::{accept_standbys, admit, refuse_unfit, Door, Joined};
use super::conn::{start_proxy, ConnEnv, Inbox};
use super::control_plane::{
    read_msg, write_msg, DataPlane, ToCoord, ToWorker, Welcome, HELLO_FRAME_MAX_BYTES,
};
pub use super::error::ProcError;
use super::heartbeat::ProcsConfig;
use super::join::Joining;
pub use super::lead::Failover;
use super::lead::{identity, lead, Led, StandingNote, Stored};
use super::link::{write_loop, ControlReader, Links, Tasks, LINK_QUEUE_MAX};
use super::notice::{Notice, PendingDrains};
use super::planes::Endpoints;
use super::proxy::lock;
use super::standby::Lobby;
use super::state::{check_parts, parts, StartState};
use super::takeover::{gather, Expect};
use crate::config::{ConfigError, TrainConfig};
use crate::engine::coordinator::Refusal;
use crate::engine::coordinator::{Attached, Coordinator};
use crate::job::build_model;
use crate::job::run_plan::RunPlan;
use crate::net::tls::{ClusterTls, Protocol};
use crate::plan::{RankId, ShardMap, Stage};
use crate::runtime::actors::{
    BoundarySnapshot, ClusterEvent, Committer, CoordArgs, CoordMsg, CoordinatorActor, NewRank,
};
use crate::runtime::api::cluster::{Observer, TrainOutcome};
use crate::runtime::api::control::ControlError;
use crate::runtime::api::control::{ControlHandle, DataPlanes, Monitor, Workers};
use crate::runtime::api::http::{self, Holding, HttpLimits};
use crate::runtime::api::status::DrainCause;
use crate::runtime::clock::{Clock, SystemClock};
use crate::runtime::meta::Candidate;
use crate::runtime::step::elastic::snapshot::SnapshotSink;
use crate::runtime::transport::detached::Detached;

/// How long final messages get to leave before the process stops.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(2);

pub struct CoordinatorOptions {
    /// Where to accept workers (`host:port`; port 0 picks one). Nothing else is listened on.
    pub listen: String,
    /// Workers must present this token (inside TLS, as defence in depth).
    pub token: String,
    /// This process's cluster certificate and CA: workers must present a certificate of the
    /// same CA.
    pub tls: ClusterTls,
    pub procs: ProcsConfig,
    pub data_plane: DataPlane,
    /// Under `DataPlane::Ucx`: network devices UCX may use between hosts (`--ucx-net`).
    pub ucx_net: Option<String>,
    /// Serve the HTTP control endpoint here (`None`: off). Until every worker has joined it
    /// answers 503 `not_started`, saying how many have.
    pub control: Option<SocketAddr>,
    /// Let `POST /ranks/{id}/kill` through.
    pub allow_kill: bool,
    /// Who may change the job through the control endpoint (`None`: anyone on loopback, no
    /// one beyond it).
    pub control_access: Option<http::Access>,
    /// Start from this state (`--resume`, `--init`) instead of the model's initialisation.
    pub start: Option<StartState>,
    /// Emit a snapshot after every this many steps and after the last one (0: never unless
    /// asked).
    pub snapshot_every: u64,
    /// A snapshot at the next step boundary when its flag is set (a signal handler).
    pub boundary_snapshot: Option<BoundarySnapshot>,
    /// The observer keeps snapshots: `POST /checkpoint` is accepted.
    pub on_demand_snapshots: bool,
    /// Largest part of chunk states in one control frame (`state::STATE_PART_MAX_BYTES`).
    pub part_max_bytes: usize,
    /// The workers keep state on their tiers: snapshots stream into `snapshot_sink` when there
    /// is one. (Every run ends with the parameters' digest read a piece per worker at a time,
    /// not with every chunk gathered here.)
    pub state_on_tier: bool,
    /// Where snapshots stream when the state is on the tiers (see `ClusterSpec::snapshot_sink`).
    pub snapshot_sink: Option<Arc<dyn SnapshotSink>>,
    /// Keep the job's state in a metadata store, so that a standby coordinator can take it
    /// over (`--meta`); `None`: the job ends with this coordinator.
    pub failover: Option<Failover>,
}

/// Where a coordinator listens.
#[derive(Clone, Copy, Debug)]
pub struct Listening {
    /// Workers join here.
    pub workers: SocketAddr,
    /// The HTTP control endpoint, if asked for.
    pub control: Option<SocketAddr>,
}

/// Runs one job with `cfg.ranks` worker processes; `on_listen` hears the bound addresses first.
/// With `failover`, it first stands by until elected, and takes over a job the store holds.
pub async fn run_coordinator(
    cfg: TrainConfig,
    mut opts: CoordinatorOptions,
    on_listen: impl FnOnce(Listening),
    mut observer: impl Observer,
) -> Result<TrainOutcome, ProcError> {
    let plan = check_job(&cfg, &opts)?;
    let (listener, control, at) = listen(&opts).await?;
    on_listen(at);
    let count = Arc::new(AtomicU32::new(0));
    let standing: StandingNote = Arc::default();
    let (ready, ready_rx) = tokio::sync::oneshot::channel();
    let held = control.map(|l| hold_control(l, &opts, cfg.ranks, &count, &standing, ready_rx));
    let acceptor = TlsAcceptor::from(opts.tls.server(Protocol::Control));
    let mut door = Door::new(listener, acceptor);
    let led = match opts.failover.as_ref() {
        Some(f) => Some(lead(f, &candidate(&cfg, f, at)?, &mut door, &standing).await?),
        None => None,
    };
    let clock: Arc<dyn Clock> = Arc::new(SystemClock::default());
    let term = led.as_ref().map_or(0, |l| l.term);
    let lobby = Arc::new(Lobby::new(Arc::clone(&clock), opts.procs, at.workers).under_term(term));
    let env = StartEnv {
        cfg: &cfg,
        plan: &plan,
        opts: &opts,
        led: led.as_ref(),
        clock,
        lobby: Arc::clone(&lobby),
    };
    let started = match led.as_ref().and_then(|l| l.stored.as_ref()) {
        Some(stored) => start_takeover(&env, stored, &mut door).await,
        None => start_fresh(&env, &mut door, &count).await,
    };
    let (mut run, initial) = match started {
        Ok(s) => s,
        Err(e) => {
            lobby.dismiss_all(false, &e.to_string());
            if let Some(led) = led {
                led.end(false, &e.to_string()).await;
            }
            return Err(e);
        }
    };
    // From now on every worker that connects is a standby, those still saying hello included.
    let lobby_tasks = vec![
        tokio::spawn(accept_standbys(
            door,
            opts.token.clone(),
            Arc::clone(&lobby),
        )),
        tokio::spawn(Arc::clone(&lobby).keep_alive()),
    ];
    // Every worker has its starting state: the coordinator need not hold it for the run.
    let reads = opts.start.take().map(|s| s.reads).unwrap_or_default();
    let (handle, mut monitor) = ControlHandle::for_processes(
        run.coordinator.clone(),
        initial,
        &cfg,
        opts.allow_kill,
        opts.on_demand_snapshots,
        Workers {
            standbys: lobby,
            planes: Arc::clone(&run.endpoints) as Arc<dyn DataPlanes>,
        },
    );
    if let (Some(led), Some(f)) = (led.as_ref(), opts.failover.as_ref()) {
        let failovers = led.stored.as_ref().map_or(0, |s| s.durable.failovers + 1);
        monitor.leads(&f.id, led.term, failovers, led.stored.is_some());
    }
    let _ = ready.send(());
    let server = serve_control(held, handle.clone(), access(&opts, at)).await;
    let mut result = run.drive(&handle, &mut observer, &mut monitor).await;
    if let Ok(outcome) = &mut result {
        outcome.resume_reads = reads;
    }
    for t in lobby_tasks {
        t.abort();
    }
    if let Some(why) = deposed(&mut run, led.as_ref(), &opts) {
        // Another leader drives the workers now: tell them nothing, write nothing.
        if let Some(led) = led {
            led.abandon();
        }
        return Err(ProcError::Deposed(why));
    }
    run.finish(&result).await;
    if let Some(led) = led {
        let reason = match &result {
            Ok(_) => "the job finished".to_string(),
            Err(e) => e.to_string(),
        };
        led.end(result.is_ok(), &reason).await;
    }
    if let Some(s) = server {
        s.abort();
    }
    result
}

/// Why this coordinator no longer leads, if it does not: a commit the store refused, or its
/// lease run out on its own clock (checked before it acts on how the run ended).
fn deposed(run: &mut Run, led: Option<&Led>, opts: &CoordinatorOptions) -> Option<String> {
    let lease = led.zip(opts.failover.as_ref());
    lease
        .and_then(|(l, f)| l.lease_lost(&f.id))
        .or_else(|| run.deposed.take())
}

/// Serves the control endpoint before the job starts until `ready`: a standby's status (who
/// leads), or 503 with how many workers have joined.
fn hold_control(
    l: TcpListener,
    opts: &CoordinatorOptions,
    world: u32,
    count: &Arc<AtomicU32>,
    standing: &StandingNote,
    ready: tokio::sync::oneshot::Receiver<()>,
) -> tokio::task::JoinHandle<TcpListener> {
    let (count, standing) = (Arc::clone(count), Arc::clone(standing));
    let why = move || {
        if let Some(holding) = lock(&standing).clone() {
            return holding;
        }
        let n = count.load(Ordering::Relaxed);
        Holding::NotStarted(format!(
            "the job has not started: {n} of {world} workers have joined"
        ))
    };
    let tls = opts.control_access.as_ref().and_then(|a| a.tls.clone());
    tokio::spawn(http::hold(l, HttpLimits::default(), tls, why, ready))
}

/// What starting a job (fresh or taken over) needs.
struct StartEnv<'a> {
    cfg: &'a TrainConfig,
    plan: &'a RunPlan,
    opts: &'a CoordinatorOptions,
    led: Option<&'a Led>,
    clock: Arc<dyn Clock>,
    lobby: Arc<Lobby>,
}

/// A started job and the map it started on.
type Started = (Run, ShardMap);

/// This coordinator in the election: its id and addresses, the config digest and the build.
fn candidate(cfg: &TrainConfig, f: &Failover, at: Listening) -> Result<Candidate, ProcError> {
    let (config_digest, build) = identity(cfg)?;
    Ok(Candidate {
        id: f.id.clone(),
        pid: std::process::id(),
        workers: at.workers,
        control: at.control,
        config_digest,
        build,
    })
}

/// A new job: admits `cfg.ranks` workers and welcomes them.
async fn start_fresh(
    env: &StartEnv<'_>,
    door: &mut Door,
    count: &AtomicU32,
) -> Result<Started, ProcError> {
    let (cfg, opts) = (env.cfg, env.opts);
    let deadline = Instant::now() + Duration::from_millis(opts.procs.join_timeout_ms);
    let mut joined = admit(
        door,
        cfg.ranks,
        &opts.token,
        opts.procs.join_timeout_ms,
        deadline,
        count,
        &env.lobby,
    )
    .await?;
    let model = build_model(cfg)?;
    refuse_unfit(cfg, model.as_ref(), &mut joined).await?;
    let map = initial_map(cfg, model.as_ref(), opts.start.as_ref(), &joined)?;
    let welcomed = Welcomed {
        map: map.clone(),
        joined,
        deadline,
    };
    let run = Run::start(env, welcomed).await?;
    Ok((run, map))
}

/// A running job whose leader was lost: the workers re-attach and roll back to the committed
/// backup (`takeover.rs`).
async fn start_takeover(
    env: &StartEnv<'_>,
    stored: &Stored,
    door: &mut Door,
) -> Result<Started, ProcError> {
    let (opts, led) = (env.opts, env.led.expect("a takeover has a leader"));
    let f = opts.failover.as_ref().expect("a takeover has a store");
    let map = stored.durable.map.clone();
    println!(
        "coordinator {}: taking over job {} (committed backup before step {}); waiting up to {} ms for ranks {:?} to re-attach",
        f.id,
        f.job_id,
        stored.durable.backup.as_ref().map_or(0, |(_, p)| p.step),
        f.reattach_wait.as_millis(),
        map.members
    );
    let expect = Expect {
        token: &opts.token,
        term: led.term,
        members: &map.members,
        wait: f.reattach_wait,
        heartbeat: Duration::from_millis(opts.procs.heartbeat_ms.max(1)),
    };
    let back = gather(door, &expect, &env.lobby).await;
    let attached: Attached = back.iter().map(|r| (r.rank, r.busy)).collect();
    let engine =
        match Coordinator::take_over(env.plan.job.clone(), stored.durable.clone(), &attached) {
            Ok(engine) => engine,
            Err(why) => {
                for mut r in back {
                    let stop = ToWorker::Stop {
                        ok: false,
                        reason: why.0.clone(),
                    };
                    let _ =
                        tokio::time::timeout(FLUSH_TIMEOUT, write_msg(&mut r.writer, &stop)).await;
                }
                return Err(ProcError::Aborted(why.0));
            }
        };
    let endpoints = Arc::new(Endpoints::new(opts.data_plane));
    let mut sent = Sent {
        links: Arc::default(),
        writers: Vec::new(),
        readers: Vec::new(),
        control_ips: BTreeMap::new(),
    };
    for r in back {
        endpoints.record(r.rank, r.data_addr, r.ucx, r.peer.ip());
        sent.control_ips.insert(r.rank, r.peer.ip());
        let (tx, rx) = mpsc::channel(LINK_QUEUE_MAX);
        sent.writers.push(tokio::spawn(write_loop(r.writer, rx)));
        lock(&sent.links).insert(r.rank, tx);
        sent.readers.push((r.rank, r.reader));
    }
    let run = Run::launch(env, sent, endpoints, engine).await?;
    Ok((run, map))
}

/// The job's plan, once its config, its start state and the process settings are checked.
fn check_job(cfg: &TrainConfig, opts: &CoordinatorOptions) -> Result<RunPlan, ProcError> {
    cfg.validate()?;
    check_parts(cfg, opts.part_max_bytes)?;
    if let Some(start) = opts
        .start
        .as_ref()
        .filter(|s| s.map.world_size() != cfg.ranks as usize)
    {
        return Err(ProcError::Setup(format!(
            "the start state is planned for {} ranks, the job has {}",
            start.map.world_size(),
            cfg.ranks
        )));
    }
    opts.procs
        .validate()
        .map_err(|e| ConfigError::new(e.field, e.message))?;
    Ok(RunPlan::new(cfg, opts.snapshot_every)?)
}

/// Binds the workers' port and, if asked for, the control endpoint's.
async fn listen(
    opts: &CoordinatorOptions,
) -> Result<(TcpListener, Option<TcpListener>, Listening), ProcError> {
    let bound = |l: &TcpListener| {
        l.local_addr()
            .map_err(|e| ProcError::Setup(format!("cannot read the bound address: {e}")))
    };
    let listener = TcpListener::bind(&opts.listen)
        .await
        .map_err(|e| ProcError::Setup(format!("cannot listen on {}: {e}", opts.listen)))?;
    let control = match opts.control {
        Some(at) => Some(TcpListener::bind(at).await.map_err(|e| {
            ProcError::Setup(format!("cannot serve the control endpoint on {at}: {e}"))
        })?),
        None => None,
    };
    let at = Listening {
        workers: bound(&listener)?,
        control: control.as_ref().map(bound).transpose()?,
    };
    Ok((listener, control, at))
}

/// The shard map the job starts with: the start state's, or a fresh plan over the workers, with
/// the workers' hosts (buddy backups then go to another host where possible).
fn initial_map(
    cfg: &TrainConfig,
    model: &dyn crate::model::Model,
    start: Option<&StartState>,
    joined: &[Joined],
) -> Result<ShardMap, ProcError> {
    let mut map = match start {
        Some(start) => start.map.clone(),
        None => {
            let numels: Vec<usize> = model.units().iter().map(|u| u.numel()).collect();
            let members: Vec<RankId> = (0..cfg.ranks).collect();
            ShardMap::plan(&numels, &members, cfg.chunk_elems, 1)
                .map_err(|e| ProcError::Setup(e.to_string()))?
        }
    };
    map.hosts = joined
        .iter()
        .map(|j| (j.rank, j.peer.ip().to_string()))
        .collect();
    Ok(map)
}

/// Who may change the job through its endpoint: as configured, else nobody beyond loopback.
fn access(opts: &CoordinatorOptions, at: Listening) -> http::Access {
    opts.control_access.clone().unwrap_or_else(|| {
        let addr = at.control.unwrap_or_else(|| ([127, 0, 0, 1], 0).into());
        http::Access::new(addr, None, http::AuthScope::Writes)
    })
}

/// The control endpoint, served once the job has started (it answered 503 until then).
async fn serve_control(
    held: Option<tokio::task::JoinHandle<TcpListener>>,
    handle: ControlHandle,
    access: http::Access,
) -> Option<tokio::task::JoinHandle<()>> {
    match held?.await {
        Ok(listener) => Some(http::serve_on(
            listener,
            handle,
            HttpLimits::default(),
            access,
        )),
        // The job runs on without its endpoint rather than leave the workers hanging.
        Err(e) => {
            tracing::error!("the control endpoint stopped: {e}");
            None
        }
    }
}

/// The admitted workers, about to be welcomed into the job.
struct Welcomed {
    map: ShardMap,
    joined: Vec<Joined>,
    deadline: Instant,
}

/// A started job: the coordinator actor, its proxies and the connection tasks.
struct Run {
    coordinator: ActorRef<CoordMsg<Detached>>,
    events: mpsc::UnboundedReceiver<ClusterEvent>,
    links: Links,
    writers: Tasks,
    tasks: Tasks,
    lobby: Arc<Lobby>,
    endpoints: Arc<Endpoints>,
    /// Workers' notices (`ToCoord::Leave`), from their connection tasks.
    notices: mpsc::UnboundedReceiver<Notice>,
    drains: PendingDrains,
    clock: Arc<dyn Clock>,
    /// Set when the store refused a commit: another leader took over.
    deposed: Option<String>,
}

/// The workers once each has its welcome and its starting state: their links, writer tasks
/// and readers, and the addresses their control connections came from.
struct Sent {
    links: Links,
    writers: Vec<tokio::task::JoinHandle<()>>,
    readers: Vec<(RankId, ControlReader)>,
    control_ips: BTreeMap<RankId, IpAddr>,
}

impl Run {
    /// Welcomes the admitted workers, meets their data planes and starts the job.
    async fn start(env: &StartEnv<'_>, w: Welcomed) -> Result<Run, ProcError> {
        let (cfg, plan, opts) = (env.cfg, env.plan, env.opts);
        let config_json =
            serde_json::to_string(cfg).map_err(|e| ProcError::Setup(e.to_string()))?;
        let wait = w
            .deadline
            .max(Instant::now() + Duration::from_millis(opts.procs.join_timeout_ms));
        let mut sent = welcome_all(env, &w.map, w.joined, &config_json, wait).await?;
        let endpoints = Arc::new(Endpoints::new(opts.data_plane));
        meet_peers(&mut sent, &endpoints, wait).await?;
        let engine = match opts.start.as_ref().and_then(|s| s.progress.clone()) {
            Some(progress) => Coordinator::resume(plan.job.clone(), w.map, progress),
            None => Coordinator::new(plan.job.clone(), w.map),
        };
        Run::launch(env, sent, endpoints, engine).await
    }

    /// Starts the coordinator actor on `engine` over the workers' connections, with a proxy
    /// per worker and the join task.
    async fn launch(
        env: &StartEnv<'_>,
        sent: Sent,
        endpoints: Arc<Endpoints>,
        mut engine: Coordinator,
    ) -> Result<Run, ProcError> {
        let (opts, procs) = (env.opts, env.opts.procs);
        let config_json =
            serde_json::to_string(env.cfg).map_err(|e| ProcError::Setup(e.to_string()))?;
        let committer = env
            .led
            .map(|l| Arc::clone(&l.committer) as Arc<dyn Committer>);
        if committer.is_some() {
            engine.keep_durable();
        }
        let (tx, events) = mpsc::unbounded_channel();
        let (join_tx, join_rx) = mpsc::unbounded_channel();
        let mut args = coord_args(opts, engine, &sent.links, tx, join_tx);
        args.clock = Arc::clone(&env.clock);
        args.committer = committer;
        let (coordinator, _) = Actor::spawn(None, CoordinatorActor::<Detached>::default(), args)
            .await
            .map_err(|e| ProcError::Setup(e.to_string()))?;
        let tasks: Tasks = Arc::default();
        let (notice_tx, notices) = mpsc::unbounded_channel();
        let mut ranks = Vec::new();
        for (rank, reader) in sent.readers {
            let link = lock(&sent.links).get(&rank).cloned();
            let Some(link) = link else { continue };
            let env = ConnEnv {
                coordinator: &coordinator,
                clock: &env.clock,
                procs,
                tasks: &tasks,
                notices: &notice_tx,
            };
            let proxy = start_proxy(rank, link, Inbox::Stream(reader), env)
                .await
                .map_err(ProcError::Setup)?;
            ranks.push((rank, proxy));
        }
        let writers: Tasks = Arc::new(Mutex::new(sent.writers));
        let joining = Joining {
            config_json,
            data_plane: opts.data_plane,
            ucx_net: opts.ucx_net.clone(),
            procs,
            part_max_bytes: opts.part_max_bytes as u64,
            lobby: Arc::clone(&env.lobby),
            links: Arc::clone(&sent.links),
            endpoints: Arc::clone(&endpoints),
            coordinator: coordinator.clone(),
            clock: Arc::clone(&env.clock),
            tasks: Arc::clone(&tasks),
            writers: Arc::clone(&writers),
            notices: notice_tx,
            joined: Default::default(),
            term: env.led.map_or(0, |l| l.term),
        };
        lock(&tasks).push(tokio::spawn(joining.serve(join_rx)));
        if let Some(sink) = opts.snapshot_sink.as_ref().filter(|_| opts.state_on_tier) {
            let _ = coordinator.cast(CoordMsg::StreamSnapshots(Arc::clone(sink)));
        }
        let _ = coordinator.cast(CoordMsg::Start { ranks });
        Ok(Run {
            coordinator,
            events,
            links: sent.links,
            writers,
            tasks,
            lobby: Arc::clone(&env.lobby),
            endpoints,
            notices,
            drains: PendingDrains::default(),
            clock: Arc::clone(&env.clock),
            deposed: None,
        })
    }

    async fn drive(
        &mut self,
        handle: &ControlHandle,
        observer: &mut impl Observer,
        monitor: &mut Monitor,
    ) -> Result<TrainOutcome, ProcError> {
        let mut records = Vec::new();
        let end = self.events(handle, observer, monitor, &mut records).await;
        // Keep the coordinator's last word for `GET /status` before the actors go.
        let view = self
            .coordinator
            .call(CoordMsg::View, Some(Duration::from_secs(5)))
            .await;
        let view = match view {
            Ok(ractor::rpc::CallResult::Success(v)) => Some(v),
            _ => None,
        };
        let end = end.map_err(ProcError::Aborted);
        monitor.ended(view, end.as_ref().map(|_| ()).map_err(|e| e.to_string()));
        end?;
        // The parameters are read a bounded piece per worker at a time for their digest, never
        // gathered whole here: a run's end stays within the memory its workers were planned for
        // (nothing of a coordinated run reads the consolidated parameters).
        let reply = self
            .coordinator
            .call(CoordMsg::Digest, Some(Duration::from_secs(3600)))
            .await;
        let param_sha256 = match reply {
            Ok(ractor::rpc::CallResult::Success(r)) => r.map_err(ProcError::Collect)?,
            Ok(_) => return Err(ProcError::Collect("the coordinator did not answer".into())),
            Err(e) => return Err(ProcError::Collect(e.to_string())),
        };
        Ok(TrainOutcome {
            records,
            param_sha256,
            params: Vec::new(),
            // Filled in by the caller, which holds the start state; faults are not injected
            // into real links.
            resume_reads: Vec::new(),
            net: Default::default(),
        })
    }

    /// Feeds the run's events to `observer` and `monitor`, and answers workers' notices, until
    /// the job finishes (`Ok`) or stops (`Err`, why).
    async fn events(
        &mut self,
        handle: &ControlHandle,
        observer: &mut impl Observer,
        monitor: &mut Monitor,
        records: &mut Vec<crate::engine::coordinator::StepRecord>,
    ) -> Result<(), String> {
        loop {
            let event = tokio::select! {
                event = self.events.recv() => event,
                Some(notice) = self.notices.recv() => {
                    self.on_notice(notice, handle, observer).await?;
                    continue;
                }
            };
            let Some(event) = event else {
                return Err("the coordinator stopped".to_string());
            };
            monitor.observe(&event);
            match event {
                ClusterEvent::Step(rec) => {
                    observer.on_step(&rec);
                    records.push(*rec);
                }
                ClusterEvent::Snapshot(snap) if monitor.requested_snapshot() => {
                    observer.on_requested_snapshot(*snap)
                }
                ClusterEvent::Snapshot(snap) => observer.on_snapshot(*snap),
                ClusterEvent::SnapshotStreamed { step, saved } => {
                    observer.on_snapshot_streamed(step, &saved)
                }
                ClusterEvent::Membership(rec) => {
                    for (_, seconds) in self.drains.on_change(&rec, self.clock.now_ms()) {
                        monitor.drained(seconds);
                    }
                    observer.on_membership(&rec)
                }
                ClusterEvent::JoinFailed { rank, reason } => observer.on_join_failed(rank, &reason),
                ClusterEvent::Finished => return Ok(()),
                ClusterEvent::Aborted(reason) => return Err(reason),
                ClusterEvent::Deposed(reason) => {
                    self.deposed = Some(reason.clone());
                    return Err(reason);
                }
            }
            if let Some(why) = observer.stop_requested() {
                return Err(why);
            }
        }
    }

    /// A worker's notice: the drain it asks for, or, where the job cannot lose it (below
    /// `min_ranks`), the job's stop (`Err`, now, or at the next boundary if the observer saves
    /// first).
    async fn on_notice(
        &mut self,
        notice: Notice,
        handle: &ControlHandle,
        observer: &mut impl Observer,
    ) -> Result<(), String> {
        let granted = handle.drain_for(notice.rank, DrainCause::Signal).await;
        if granted.is_ok() {
            self.drains.granted(&notice);
        }
        observer.on_notice(
            &notice,
            &granted.as_ref().map(|_| ()).map_err(|e| e.to_string()),
        );
        if let Err(ControlError::Refused(Refusal::BelowMin { min, .. })) = granted {
            let why = format!(
                "rank {} was given notice ({}) and the job cannot go on without it (min_ranks is {min}): stopped at a step boundary",
                notice.rank, notice.cause
            );
            if !observer.stop_at_boundary(&why) {
                return Err(why);
            }
        }
        Ok(())
    }

    /// Tells every worker the outcome, lets the messages leave, and stops the actors.
    async fn finish(self, result: &Result<TrainOutcome, ProcError>) {
        let (ok, reason) = match result {
            Ok(_) => (true, "the job finished".to_string()),
            Err(e) => (false, e.to_string()),
        };
        for t in lock(&self.tasks).iter() {
            t.abort();
        }
        let mut writers = std::mem::take(&mut *lock(&self.writers));
        let standby_end = if ok {
            "the job finished before a join needed this standby"
        } else {
            "the job stopped before a join needed this standby"
        };
        writers.extend(self.lobby.dismiss_all(ok, standby_end));
        let links: Vec<_> = std::mem::take(&mut *lock(&self.links))
            .into_values()
            .collect();
        for l in &links {
            let stop = ToWorker::Stop {
                ok,
                reason: reason.clone(),
            };
            let _ = l.try_send(Some(stop));
            let _ = l.try_send(None);
        }
        drop(links);
        let _ = tokio::time::timeout(FLUSH_TIMEOUT, async {
            for w in writers {
                let _ = w.await;
            }
        })
        .await;
        self.coordinator.stop_children(None);
        let _ = self
            .coordinator
            .stop_and_wait(None, Some(Duration::from_secs(5)))
            .await;
    }
}

/// Welcomes every admitted worker and sends each its starting state, by `wait`; then each
/// connection's writer task takes over.
async fn welcome_all(
    env: &StartEnv<'_>,
    map: &ShardMap,
    joined: Vec<Joined>,
    config_json: &str,
    wait: Instant,
) -> Result<Sent, ProcError> {
    let (cfg, plan, opts) = (env.cfg, env.plan, env.opts);
    let term = env.led.map_or(0, |l| l.term);
    let mut sent = Sent {
        links: Arc::default(),
        writers: Vec::new(),
        readers: Vec::new(),
        control_ips: joined.iter().map(|j| (j.rank, j.peer.ip())).collect(),
    };
    for mut j in joined {
        let welcome = Welcome {
            rank: j.rank,
            config_json: config_json.to_string(),
            map: map.clone(),
            world: cfg.ranks,
            data_plane: opts.data_plane,
            ucx_net: opts.ucx_net.clone(),
            procs: opts.procs,
            restore: opts.start.is_some(),
            part_max_bytes: opts.part_max_bytes as u64,
            ranks_on_host: sent
                .control_ips
                .values()
                .filter(|&&ip| ip == j.peer.ip())
                .count() as u32,
            term,
        };
        let welcome = ToWorker::Welcome(Box::new(welcome));
        tokio::time::timeout_at(wait, send_start(&mut j, welcome, opts, plan.stage))
            .await
            .map_err(|_| {
                ProcError::Setup(format!(
                    "rank {} did not take its starting state within join_timeout_ms",
                    j.rank
                ))
            })??;
        let (tx, rx) = mpsc::channel(LINK_QUEUE_MAX);
        sent.writers.push(tokio::spawn(write_loop(j.writer, rx)));
        lock(&sent.links).insert(j.rank, tx);
        sent.readers.push((j.rank, j.reader));
    }
    Ok(sent)
}

/// Hears every worker's data address, tells each its peers', and waits for all to be ready.
async fn meet_peers(
    sent: &mut Sent,
    endpoints: &Endpoints,
    wait: Instant,
) -> Result<(), ProcError> {
    for (rank, reader) in &mut sent.readers {
        match expect(*rank, reader, wait, "bound").await? {
            ToCoord::Bound { data_addr, ucx } if data_addr.parse::<SocketAddr>().is_ok() => {
                endpoints.record(*rank, data_addr, ucx, sent.control_ips[rank]);
            }
            other => {
                return Err(ProcError::Setup(format!(
                    "rank {rank} sent {} instead of its data address",
                    other.kind()
                )))
            }
        }
    }
    let ranks: Vec<RankId> = sent.readers.iter().map(|(r, _)| *r).collect();
    for (&r, l) in lock(&sent.links).iter() {
        let _ = l.try_send(Some(ToWorker::Peers {
            peers: endpoints.peers_for(r, ranks.iter().copied()),
        }));
    }
    for (rank, reader) in &mut sent.readers {
        match expect(*rank, reader, wait, "ready").await? {
            ToCoord::Ready => {}
            other => {
                return Err(ProcError::Setup(format!(
                    "rank {rank} sent {} instead of ready",
                    other.kind()
                )))
            }
        }
    }
    Ok(())
}

/// The coordinator actor's arguments over the workers' links: the engine (fresh or resumed)
/// and the hooks that reach a worker, or, for a joiner, the join task.
fn coord_args(
    opts: &CoordinatorOptions,
    engine: Coordinator,
    links: &Links,
    events: mpsc::UnboundedSender<ClusterEvent>,
    join_tx: mpsc::UnboundedSender<RankId>,
) -> CoordArgs<Detached> {
    let interrupt = Arc::clone(links);
    let retired = Arc::clone(links);
    CoordArgs::<Detached> {
        engine,
        events,
        clock: Arc::new(SystemClock::default()),
        tick_ms: 200,
        // The driver tells every worker why when it sees the abort event.
        on_abort: Box::new(|| {}),
        // The worker's link goes with its stop, so that a later joiner is not told to
        // expect it as a peer.
        on_retire: Box::new(move |r, steps| {
            if let Some(l) = lock(&retired).remove(&r) {
                let _ = l.try_send(Some(ToWorker::Stop {
                    ok: true,
                    reason: format!("left the job after step {steps}"),
                }));
                let _ = l.try_send(None);
            }
        }),
        on_interrupt: Box::new(move |r, epoch, step| {
            if let Some(l) = lock(&interrupt).get(&r) {
                let _ = l.try_send(Some(ToWorker::Interrupt { epoch, step }));
            }
        }),
        // A joiner is a standby worker process: the join task brings it up and answers
        // with `CoordMsg::Joined`, so the coordinator actor never waits on a process.
        factory: Box::new(move |rank, _| {
            join_tx
                .send(rank)
                .map(|_| NewRank::Later)
                .map_err(|_| "the join task has stopped".to_string())
        }),
        boundary_snapshot: opts.boundary_snapshot.clone(),
        // Workers report their progress over their control connections.
        progress: None,
        committer: None,
    }
}

/// Writes the welcome and, with a start state, the chunks `j`'s rank is built from, in parts
/// (one part in memory at a time), before the connection's writer task takes over.
async fn send_start(
    j: &mut Joined,
    welcome: ToWorker,
    opts: &CoordinatorOptions,
    stage: Stage,
) -> Result<(), ProcError> {
    let rank = j.rank;
    let failed = |e: super::control_plane::WireError| {
        ProcError::Setup(format!("rank {rank}: sending its start failed: {e}"))
    };
    write_msg(&mut j.writer, &welcome).await.map_err(failed)?;
    let Some(start) = &opts.start else {
        return Ok(());
    };
    // New weights are read here, a unit at a time; a failed read stops the parts and the job.
    let unreadable = std::cell::RefCell::new(None);
    let chunks = start
        .chunks_for(rank, stage)
        .map_while(|c| c.map_err(|e| *unreadable.borrow_mut() = Some(e)).ok());
    let unread = || {
        let e = unreadable.borrow_mut().take()?;
        Some(ProcError::Setup(format!(
            "rank {rank}: its starting weights: {e}"
        )))
    };
    for (chunks, last) in parts(chunks, opts.part_max_bytes) {
        // A part cut short by a failed read is not sent.
        if let Some(e) = unread() {
            return Err(e);
        }
        let part = ToWorker::StatePart { chunks, last };
        write_msg(&mut j.writer, &part).await.map_err(failed)?;
    }
    unread().map_or(Ok(()), Err)
}

/// The next setup message from `rank`, or why none came.
async fn expect(
    rank: RankId,
    reader: &mut ControlReader,
    deadline: Instant,
    what: &str,
) -> Result<ToCoord, ProcError> {
    match tokio::time::timeout_at(
        deadline,
        read_msg::<_, ToCoord>(reader, HELLO_FRAME_MAX_BYTES),
    )
    .await
    {
        Ok(Ok(msg)) => Ok(msg),
        Ok(Err(e)) => Err(ProcError::Setup(format!(
            "rank {rank} failed before it was {what}: {e}"
        ))),
        Err(_) => Err(ProcError::Setup(format!(
            "rank {rank} was not {what} within join_timeout_ms"
        ))),
    }
}
