//! A worker process: one rank. It joins the coordinator, builds its rank from the welcome (rank,
//! config, shard map, peers' data addresses), runs the unchanged rank actor behind a
//! `CoordProxy`, and executes what arrives until the coordinator says stop, the rank fails, or
//! the coordinator goes silent past the heartbeat timeout.
//!
//! A worker that connects once the job has started is held as a standby (heartbeating) until a
//! join takes it: its welcome then names a rank outside the committed map, which starts with
//! no state and receives its chunks in the reshard that admits it. Members hear of a joiner's
//! data address while they run (`ToWorker::AddPeer`).
//!
//! Both its connections are mutual TLS against the cluster CA: the control connection to the
//! coordinator (it checks the coordinator's certificate and presents its own) and the data plane
//! to its peers.
//!
//! Design: docs/processes.md.

mod data_plane;
mod leave;
mod reattach;

use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorRef};
use tokio::io::{ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;

#[cfg(feature = "ucx")]
use super::control_plane::UcxBound;
use super::control_plane::{
    read_msg, write_msg, DataPlane, ToCoord, ToWorker, Welcome, CONTROL_FRAME_MAX_BYTES,
};
#[cfg(feature = "ucx")]
use data_plane::start_ucx;
use data_plane::{bind_quic, bind_tcp, exchange, peer, tcp_transport, Bound, Peer};
use leave::{LeaveEvent, Leaving};
use reattach::{coordinator_list, Reattach, Relay};

use super::error::ProcError;
use super::heartbeat::{Liveness, ProcsConfig};
use super::link::LINK_QUEUE_MAX;
#[cfg(feature = "ucx")]
use super::planes::{host_identity, user_id};
use super::proxy::{CoordProxy, CoordProxyArgs, WorkerEnd};
use super::state::{parts, STATE_PART_LIMIT_BYTES};
use crate::config::TrainConfig;
use crate::job::run_plan::{RunPlan, StoragePlan};
use crate::job::{build_dataset, build_model, compute_threads_for};
use crate::model::weights::ModelInit;
use crate::net::tls::{check_alpn, peer_server_name, ClusterTls, Protocol};
use crate::plan::activations::ActivationChoice;
use crate::plan::RankId;
use crate::runtime::actors::{RankActor, RankArgs, RankMsg, RankSetup, Work};
use crate::runtime::clock::{Clock, SystemClock};
use crate::runtime::step::comm::Comm;
use crate::runtime::step::exec::ExecConfig;
use crate::runtime::step::progress::RunProgress;
use crate::runtime::step::state::rank_state::{ChunkState, RankState, StartFrom};
use crate::runtime::storage::TierSpec;
#[cfg(feature = "ucx")]
use crate::runtime::transport::tcp::DATA_FRAME_MAX_BYTES;
#[cfg(feature = "ucx")]
use crate::runtime::transport::ucx::mixed::MixedTransport;
use crate::runtime::transport::Transport;
#[cfg(not(feature = "ucx"))]
use crate::runtime::transport::NO_UCX_BUILD;

/// The control connection to the coordinator, after the TLS handshake.
type ControlStream = tokio_rustls::client::TlsStream<TcpStream>;
type ControlReader = ReadHalf<ControlStream>;

pub struct WorkerOptions {
    /// The coordinator's `host:port`, or several, comma-separated: the job's coordinators, of
    /// which one leads (a standby answers with `NotLeader` and the next is tried).
    pub join: String,
    pub token: String,
    pub rank_hint: Option<RankId>,
    /// Only join as a new rank of the running job (see `ToCoord::Hello`).
    pub standby: bool,
    /// Where to accept peers' data connections (`ip:port`; port 0 picks one).
    pub data_listen: String,
    /// What peers dial instead of the bound address (NAT, a port forward, a proxy).
    pub data_advertise: Option<SocketAddr>,
    /// This process's cluster certificate and CA, for every connection it makes or accepts.
    pub tls: ClusterTls,
    /// Only `connect_timeout_ms` and `join_timeout_ms` are used before the welcome; the
    /// coordinator's heartbeat settings apply after it.
    pub procs: ProcsConfig,
    /// After a SIGTERM, how long to wait for the drain at the next step boundary before
    /// leaving abruptly (Kubernetes gives 30 s by default, GKE and Azure spot notices ~30 s).
    pub drain_grace: Duration,
    /// After losing a coordinator of a job kept in a metadata store, how long to look for the
    /// next leader among `join`'s addresses before stopping.
    pub leader_wait: Duration,
}

/// How a worker's job ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerOutcome {
    /// `None`: a standby the job ended without needing.
    pub rank: Option<RankId>,
    /// The coordinator's stop was a success (job finished or this rank left).
    pub ok: bool,
    pub reason: String,
    /// Under `--transport ucx`: which peers went over UCX and what arrived that way.
    pub data_plane: Option<String>,
    /// Given notice (SIGTERM): how long after it the job let this worker go.
    pub noticed: Option<Duration>,
}

/// Joins, runs the rank, returns when the job ends for this worker. `on_welcome` hears the rank,
/// the world size and the threads its products take, once assigned.
pub async fn run_worker(
    opts: WorkerOptions,
    on_welcome: impl FnOnce(RankId, u32, usize),
) -> Result<WorkerOutcome, ProcError> {
    let Contact { reader, link, got } = first_contact(&opts).await?;
    let epoch = match &got {
        Ok(w) => w.map.epoch,
        Err(_) => 0,
    };
    let (link, relay) = Relay::start(link, epoch);
    let result = match got {
        Ok(welcome) => {
            let cfg = welcome_config(&welcome);
            let threads = cfg.as_ref().map_or(0, |c| c.compute_threads);
            on_welcome(welcome.rank, welcome.world, threads);
            match cfg {
                Ok(cfg) => run_rank(welcome, cfg, &link, &relay, reader, &opts).await,
                Err(e) => Err(e),
            }
        }
        Err(standby_end) => Ok(standby_end),
    };
    // Let the last reports (a failure, a collect reply) leave before the process ends.
    let _ = link.try_send(None);
    drop(link);
    let _ = tokio::time::timeout(Duration::from_secs(2), relay.flushed()).await;
    result
}

/// The connection to the coordinator that leads, its writer queue, and its welcome (or how
/// the job ended for a standby it never needed).
struct Contact {
    reader: ControlReader,
    link: mpsc::Sender<Option<ToCoord>>,
    got: Result<Welcome, WorkerOutcome>,
}

/// Says hello to the coordinators of `--join` in turn until the one that leads answers (a
/// standby coordinator answers `NotLeader`), within join_timeout_ms. With one address, that
/// coordinator may start after us: it is dialled until connect_timeout_ms.
async fn first_contact(opts: &WorkerOptions) -> Result<Contact, ProcError> {
    let list = coordinator_list(&opts.join);
    if list.is_empty() {
        return Err(ProcError::Setup(
            "--join names no coordinator address".into(),
        ));
    }
    let mut deadline = Instant::now() + Duration::from_millis(opts.procs.join_timeout_ms);
    let mut last = String::new();
    for addr in list.iter().cycle() {
        let dial_ms = match list.len() {
            1 => opts.procs.connect_timeout_ms,
            _ => 1_000,
        };
        match hello(addr, dial_ms, opts).await {
            Ok(Some(contact)) => return Ok(contact),
            Ok(None) => last = format!("{addr} stands by and does not lead"),
            Err(ProcError::Aborted(e)) if e == LOST_AS_STANDBY => {
                deadline = Instant::now() + opts.leader_wait;
                last = e;
            }
            Err(e) if list.len() == 1 => return Err(e),
            Err(e) => last = e.to_string(),
        }
        if Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(ProcError::Setup(format!(
        "no coordinator of {} led the job within join_timeout_ms ({} ms); last: {last}",
        opts.join, opts.procs.join_timeout_ms
    )))
}

/// Dials `addr`, says hello and waits for the welcome; `None` when that coordinator does not
/// lead.
async fn hello(
    addr: &str,
    dial_ms: u64,
    opts: &WorkerOptions,
) -> Result<Option<Contact>, ProcError> {
    let stream = connect(addr, dial_ms).await?;
    let _ = stream.set_nodelay(true);
    let stream = handshake(stream, opts, addr).await?;
    let (mut reader, mut writer) = tokio::io::split(stream);
    let hello = ToCoord::Hello {
        token: opts.token.clone(),
        rank_hint: opts.rank_hint,
        standby: opts.standby,
        available_memory_bytes: crate::runtime::alloc::available_memory_bytes(),
    };
    write_msg(&mut writer, &hello)
        .await
        .map_err(|e| ProcError::Setup(format!("coordinator at {addr}: {e}")))?;
    let (link, rx) = mpsc::channel(LINK_QUEUE_MAX);
    tokio::spawn(write_loop(writer, rx));
    match await_welcome(&mut reader, &link, opts, addr).await? {
        Welcomed::Rank(w) => Ok(Some(Contact {
            reader,
            link,
            got: Ok(*w),
        })),
        Welcomed::Ended(end) => Ok(Some(Contact {
            reader,
            link,
            got: Err(end),
        })),
        Welcomed::NotLeader => Ok(None),
        Welcomed::Lost => Err(ProcError::Aborted(LOST_AS_STANDBY.into())),
    }
}

/// Why a standby looks for the next leader.
const LOST_AS_STANDBY: &str = "the coordinator holding this standby was lost";

/// What a hello came to.
enum Welcomed {
    Rank(Box<Welcome>),
    /// A standby the job ended without needing.
    Ended(WorkerOutcome),
    /// That coordinator stands by.
    NotLeader,
    /// A standby lost the leader of a job kept in a store: look for the next one.
    Lost,
}

/// The welcome, after a wait as a standby if the coordinator holds this worker as one; or how
/// the job ended for a standby it never needed.
async fn await_welcome(
    reader: &mut ControlReader,
    link: &mpsc::Sender<Option<ToCoord>>,
    opts: &WorkerOptions,
    addr: &str,
) -> Result<Welcomed, ProcError> {
    let mut wait_ms = opts.procs.join_timeout_ms;
    let mut beat: Option<tokio::task::JoinHandle<()>> = None;
    let mut kept = false;
    let got = loop {
        match next(reader, wait_ms, addr).await {
            Ok(ToWorker::Welcome(w)) => break Ok(Welcomed::Rank(w)),
            Ok(ToWorker::NotLeader { .. }) => break Ok(Welcomed::NotLeader),
            // A standby of a job kept in a store outlives its coordinator too.
            Err(e) if kept => {
                println!("ezero worker: standby: lost the coordinator at {addr} ({e}); looking for the next leader");
                break Ok(Welcomed::Lost);
            }
            Ok(ToWorker::Standby {
                heartbeat_ms,
                heartbeat_timeout_ms,
                term,
            }) => {
                kept = term > 0;
                println!(
                    "ezero worker: connected to {addr} as a standby; waiting for a join to take it"
                );
                // The coordinator heartbeats its standbys, so silence means it is gone.
                wait_ms = heartbeat_timeout_ms;
                let link = link.clone();
                beat.get_or_insert_with(|| {
                    tokio::spawn(async move {
                        let period = Duration::from_millis(heartbeat_ms.max(1));
                        let mut every = tokio::time::interval(period);
                        loop {
                            every.tick().await;
                            if link.send(Some(ToCoord::Heartbeat)).await.is_err() {
                                return;
                            }
                        }
                    })
                });
            }
            Ok(ToWorker::Heartbeat) => {}
            Ok(ToWorker::Stop { ok, reason }) => {
                break Ok(Welcomed::Ended(WorkerOutcome {
                    rank: None,
                    ok,
                    reason,
                    data_plane: None,
                    noticed: None,
                }))
            }
            Ok(ToWorker::Refused { reason }) => {
                break Err(ProcError::Setup(format!(
                    "the coordinator refused this worker: {reason}"
                )))
            }
            Ok(other) => {
                break Err(ProcError::Setup(format!(
                    "the coordinator sent {} before a welcome",
                    other.kind()
                )))
            }
            Err(e) => break Err(e),
        }
    };
    if let Some(b) = beat {
        b.abort();
    }
    got
}

/// What a worker runs its rank with once welcomed: the job's config (checked), its plan, and the
/// starting state the coordinator sent (on a restore).
struct Job {
    welcome: Welcome,
    cfg: TrainConfig,
    plan: RunPlan,
    start: Option<Vec<ChunkState>>,
}

/// Binds the data plane the welcome names, meets the peers and runs the rank of `cfg` (the
/// welcome's config, checked).
async fn run_rank(
    welcome: Welcome,
    cfg: TrainConfig,
    link: &mpsc::Sender<Option<ToCoord>>,
    relay: &Relay,
    mut reader: ControlReader,
    opts: &WorkerOptions,
) -> Result<WorkerOutcome, ProcError> {
    let start = if welcome.restore {
        let join_ms = opts.procs.join_timeout_ms;
        Some(receive_start(&mut reader, join_ms, &opts.join).await?)
    } else {
        None
    };
    // The worker's share of the job; the coordinator asks for snapshots itself.
    let plan = RunPlan::new(&cfg, 0)?;
    let job = Job {
        welcome,
        cfg,
        plan,
        start,
    };
    match job.welcome.data_plane {
        DataPlane::Tcp => over_tcp(job, link, relay, reader, opts).await,
        #[cfg(feature = "ucx")]
        DataPlane::Ucx => over_ucx(job, link, relay, reader, opts).await,
        #[cfg(not(feature = "ucx"))]
        DataPlane::Ucx => Err(ProcError::Setup(NO_UCX_BUILD.into())),
        DataPlane::Quic => over_quic(job, link, relay, reader, opts).await,
    }
}

/// The rank over mutual-TLS TCP to every peer.
async fn over_tcp(
    job: Job,
    link: &mpsc::Sender<Option<ToCoord>>,
    relay: &Relay,
    mut reader: ControlReader,
    opts: &WorkerOptions,
) -> Result<WorkerOutcome, ProcError> {
    let join_ms = opts.procs.join_timeout_ms;
    let data = bind_tcp(opts)?;
    let (peers, bound) =
        exchange(data.local_addr(), None, link, &mut reader, join_ms, opts).await?;
    let transport = tcp_transport(data, &job.welcome, &job.cfg, &peers);
    let interrupter = transport.interrupter();
    let book = transport.peer_book();
    let hooks = Hooks {
        interrupt: Box::new(move |e, s| interrupter.interrupt(e, s)),
        add_peer: Box::new(move |p| book.add(p.rank, p.addr)),
    };
    let up = Up { link, relay, bound };
    serve(job, transport, hooks, up, reader, opts).await
}

/// The rank over UCX to the peers it can reach that way (shared memory on this host, or the
/// `--ucx-net` devices), TLS TCP to the others.
#[cfg(feature = "ucx")]
async fn over_ucx(
    job: Job,
    link: &mpsc::Sender<Option<ToCoord>>,
    relay: &Relay,
    mut reader: ControlReader,
    opts: &WorkerOptions,
) -> Result<WorkerOutcome, ProcError> {
    let join_ms = opts.procs.join_timeout_ms;
    let welcome = &job.welcome;
    let data = bind_tcp(opts)?;
    let engine = start_ucx(welcome.rank, welcome.ucx_net.as_deref())?;
    let ucx = UcxBound {
        address: engine.address().to_vec(),
        host: host_identity(),
        uid: user_id(),
        net: welcome.ucx_net.is_some(),
    };
    let bound = data.local_addr();
    let (peers, told) = exchange(bound, Some(ucx), link, &mut reader, join_ms, opts).await?;
    let tcp = tcp_transport(data, welcome, &job.cfg, &peers);
    let (interrupter, book) = (tcp.interrupter(), tcp.peer_book());
    let transport = MixedTransport::new(tcp, engine, DATA_FRAME_MAX_BYTES)
        .map_err(|e| ProcError::Setup(format!("rank {}: {e}", welcome.rank)))?;
    let routes = transport.routes();
    for p in peers.into_iter().filter(|p| p.rank != welcome.rank) {
        if let Some(address) = p.ucx {
            routes.add(p.rank, address).map_err(|e| {
                ProcError::Setup(format!(
                    "rank {}: UCX to rank {}: {e}",
                    welcome.rank, p.rank
                ))
            })?;
        }
    }
    let report = routes.clone();
    let hooks = Hooks {
        interrupt: Box::new(move |e, s| interrupter.interrupt(e, s)),
        add_peer: Box::new(move |p| {
            book.add(p.rank, p.addr);
            if let Some(address) = p.ucx {
                // The pair falls back to nothing: the joiner's collectives time out
                // and the coordinator drops it from its change.
                if let Err(e) = routes.add(p.rank, address) {
                    tracing::warn!("UCX to joining rank {}: {e}", p.rank);
                }
            }
        }),
    };
    let up = Up {
        link,
        relay,
        bound: told,
    };
    let mut outcome = serve(job, transport, hooks, up, reader, opts).await?;
    outcome.data_plane = Some(report.describe());
    Ok(outcome)
}

/// The rank over QUIC, every peer connected before the first step.
async fn over_quic(
    job: Job,
    link: &mpsc::Sender<Option<ToCoord>>,
    relay: &Relay,
    mut reader: ControlReader,
    opts: &WorkerOptions,
) -> Result<WorkerOutcome, ProcError> {
    let join_ms = opts.procs.join_timeout_ms;
    let welcome = &job.welcome;
    let q = bind_quic(welcome, opts)?;
    let (peers, bound) = exchange(q.local_addr(), None, link, &mut reader, join_ms, opts).await?;
    let peers: Vec<(RankId, SocketAddr)> = peers.iter().map(|p| (p.rank, p.addr)).collect();
    q.add_peers(&peers);
    let ranks: Vec<RankId> = peers.iter().map(|(r, _)| *r).collect();
    // A dialled peer learns who we are from our first stream: open it now, so that
    // both sides see the connection before the first step.
    let control = q.control();
    for &r in ranks.iter().filter(|r| **r > welcome.rank) {
        let _ = control.send_control(r, bytes::Bytes::from_static(b"hello"));
    }
    // A joiner not up within step_timeout_ms is dropped from its change by the
    // coordinator: waiting longer for its peers would only keep a dead process around.
    let wait_ms = if welcome.map.is_member(welcome.rank) {
        join_ms
    } else {
        join_ms.min(job.plan.job.step_timeout_ms)
    };
    tokio::task::block_in_place(|| q.wait_connected(&ranks, wait_ms))
        .map_err(|e| ProcError::Setup(format!("rank {}: {e}", welcome.rank)))?;
    let (control, joins) = (q.control(), q.control());
    let me = welcome.rank;
    let hooks = Hooks {
        interrupt: Box::new(move |e, s| control.interrupt(e, s)),
        // The lower rank dials; the joiner learns who we are from our first stream.
        add_peer: Box::new(move |p| {
            let r = p.rank;
            joins.add_peers(&[(r, p.addr)]);
            if r > me {
                let _ = joins.send_control(r, bytes::Bytes::from_static(b"hello"));
            }
        }),
    };
    let up = Up { link, relay, bound };
    serve(job, q, hooks, up, reader, opts).await
}

/// The next message from the coordinator within `timeout_ms`.
async fn next(
    reader: &mut ControlReader,
    timeout_ms: u64,
    addr: &str,
) -> Result<ToWorker, ProcError> {
    tokio::time::timeout(
        Duration::from_millis(timeout_ms),
        read_msg::<_, ToWorker>(reader, CONTROL_FRAME_MAX_BYTES),
    )
    .await
    .map_err(|_| {
        ProcError::Setup(format!(
            "the coordinator at {addr} did not answer within join_timeout_ms ({timeout_ms} ms)"
        ))
    })?
    .map_err(|e| ProcError::Setup(format!("coordinator at {addr}: {e}")))
}

/// The chunk states this rank starts from, sent in parts after the welcome.
async fn receive_start(
    reader: &mut ControlReader,
    timeout_ms: u64,
    addr: &str,
) -> Result<Vec<ChunkState>, ProcError> {
    let mut chunks = Vec::new();
    loop {
        match next(reader, timeout_ms, addr).await? {
            ToWorker::StatePart { chunks: part, last } => {
                chunks.extend(part);
                if last {
                    return Ok(chunks);
                }
            }
            other => {
                return Err(ProcError::Setup(format!(
                    "the coordinator sent {} while sending this rank's starting state",
                    other.kind()
                )))
            }
        }
    }
}

/// Dials until the coordinator answers or `timeout_ms` passes (it may start after us).
async fn connect(addr: &str, timeout_ms: u64) -> Result<TcpStream, ProcError> {
    let target: SocketAddr = addr
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| {
            ProcError::Setup(format!(
                "coordinator address `{addr}` is not a reachable host:port"
            ))
        })?;
    let deadline = Instant::now() + Duration::from_millis(timeout_ms);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let err = match tokio::time::timeout(left, TcpStream::connect(target)).await {
            Ok(Ok(s)) => return Ok(s),
            Ok(Err(e)) => e.to_string(),
            Err(_) => "no answer".to_string(),
        };
        if Instant::now() + Duration::from_millis(200) >= deadline {
            return Err(ProcError::Setup(format!(
                "cannot reach the coordinator at {addr} within connect_timeout_ms ({timeout_ms} ms): {err}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The TLS handshake with the coordinator: it must show a certificate of our cluster CA, and
/// we show ours.
async fn handshake(
    stream: TcpStream,
    opts: &WorkerOptions,
    addr: &str,
) -> Result<ControlStream, ProcError> {
    let connector = TlsConnector::from(opts.tls.client(Protocol::Control));
    let tls = tokio::time::timeout(
        Duration::from_millis(opts.procs.connect_timeout_ms),
        connector.connect(peer_server_name(), stream),
    )
    .await
    .map_err(|_| ProcError::Setup(format!("no TLS handshake with the coordinator at {addr} within connect_timeout_ms")))?
    .map_err(|e| {
        ProcError::Setup(format!(
            "TLS handshake with the coordinator at {addr} failed: {e} (do both use the same cluster CA in --secrets?)"
        ))
    })?;
    check_alpn(tls.get_ref().1.alpn_protocol(), Protocol::Control).map_err(|e| {
        ProcError::Setup(format!(
            "coordinator at {addr}: {e}; is this its worker port?"
        ))
    })?;
    Ok(tls)
}

async fn write_loop(mut w: WriteHalf<ControlStream>, mut rx: mpsc::Receiver<Option<ToCoord>>) {
    while let Some(Some(msg)) = rx.recv().await {
        if write_msg(&mut w, &msg).await.is_err() {
            return;
        }
    }
}

/// A collect's chunks in parts, each frame well under the frame limit; the reply ends it.
async fn send_parts(
    link: &mpsc::Sender<Option<ToCoord>>,
    id: u64,
    chunks: Vec<ChunkState>,
    part_max_bytes: usize,
) {
    for (chunks, last) in parts(chunks, part_max_bytes) {
        let msg = if last {
            ToCoord::CollectReply { id, chunks }
        } else {
            ToCoord::CollectPart { id, chunks }
        };
        if link.send(Some(msg)).await.is_err() {
            return;
        }
    }
}

/// The worker's way to its coordinator: the relay's queue, the relay, and where peers reach
/// this worker (said again to a new leader).
struct Up<'a> {
    link: &'a mpsc::Sender<Option<ToCoord>>,
    relay: &'a Relay,
    bound: Bound,
}

/// Builds the rank from the welcome and runs it until the job ends for this worker. When the
/// job outlives its coordinator (the welcome carries a term), losing the coordinator makes the
/// worker re-attach to the next leader instead of stopping.
async fn serve<T: Transport>(
    job: Job,
    transport: T,
    hooks: Hooks,
    up: Up<'_>,
    reader: ControlReader,
    opts: &WorkerOptions,
) -> Result<WorkerOutcome, ProcError> {
    let Up { link, relay, bound } = up;
    let rank = job.welcome.rank;
    let procs = job.welcome.procs;
    let part_max_bytes = (job.welcome.part_max_bytes as usize).clamp(1, STATE_PART_LIMIT_BYTES);
    let mut reattach = (job.welcome.term > 0).then(|| Reattach {
        rank,
        coordinators: coordinator_list(&opts.join),
        leader_wait: opts.leader_wait,
        heartbeat_timeout_ms: procs.heartbeat_timeout_ms,
        term_seen: job.welcome.term,
        data_addr: bound.data_addr.clone(),
        ucx: bound.ucx.clone(),
        at: None,
    });
    let (rank_actor, mut ended, progress) = start_rank(job, transport, link).await?;
    let mut leaving = Leaving::install(opts.drain_grace)?;
    let mut beat_sent = None;
    let _ = link.try_send(Some(ToCoord::Ready));
    let clock = SystemClock::default();
    // Until the coordinator's first message after `Ready` (it waits for the slowest worker),
    // silence is bounded by the join timeout; from then on by the heartbeat timeout.
    let mut live = Liveness::new(clock.now_ms(), procs.join_timeout_ms);
    let mut every = tokio::time::interval(Duration::from_millis(procs.heartbeat_ms));
    let (mut inbox, mut read_task) = read_in_task(reader);
    let outcome = loop {
        let lost = tokio::select! {
            Some(msg) = inbox.recv() => match msg {
                Ok(msg) => {
                    live.observe(clock.now_ms());
                    live.set_timeout(procs.heartbeat_timeout_ms);
                    if let ToWorker::Command(cmd) = &msg {
                        relay.began(cmd);
                    }
                    if let Some(out) = execute(msg, rank, &rank_actor, &hooks, link, part_max_bytes) {
                        break Ok(out);
                    }
                    continue;
                }
                Err(e) => e.to_string(),
            },
            Some(WorkerEnd::RankFailed(reason)) = ended.recv() => {
                break Err(ProcError::Aborted(format!("rank {rank} failed: {reason}")));
            }
            event = leaving.next() => {
                on_signal(event, rank, &leaving, link);
                continue;
            }
            _ = every.tick() => {
                let _ = link.try_send(Some(ToCoord::Heartbeat));
                // The coordinator's step timeout measures silence: tell it the step moves.
                let beat = progress.beats().get(&rank).copied();
                if let Some(b) = beat.filter(|b| beat_sent != Some(*b)) {
                    let sent = link.try_send(Some(ToCoord::Progress { epoch: b.epoch, step: b.step }));
                    if sent.is_ok() {
                        beat_sent = Some(b);
                    }
                }
                match live.silent(clock.now_ms()) {
                    Some(ms) => format!(
                        "silent for {ms} ms, heartbeat_timeout_ms is {}",
                        procs.heartbeat_timeout_ms
                    ),
                    None => continue,
                }
            }
        };
        read_task.abort();
        let Some(r) = reattach.as_mut() else {
            break Err(ProcError::Aborted(format!(
                "rank {rank}: lost the coordinator ({lost})"
            )));
        };
        match r.run(relay, &*hooks.interrupt, opts, &lost).await {
            Ok(reader) => {
                (inbox, read_task) = read_in_task(reader);
                live = Liveness::new(clock.now_ms(), procs.heartbeat_timeout_ms);
                beat_sent = None;
            }
            Err(e) => break Err(e),
        }
    };
    // The rank actor is left running: the process ends next, and stopping it here could block
    // on a step that waits for a peer.
    read_task.abort();
    outcome.map(|o| WorkerOutcome {
        noticed: leaving.since_notice(),
        ..o
    })
}

/// The coordinator's messages, read by a task of their own: reading a frame is not
/// cancellation-safe, so nothing waits on it in a `select!`.
fn read_in_task(
    mut reader: ControlReader,
) -> (
    mpsc::Receiver<Result<ToWorker, super::control_plane::WireError>>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, rx) = mpsc::channel(LINK_QUEUE_MAX);
    let task = tokio::spawn(async move {
        loop {
            let msg = read_msg::<_, ToWorker>(&mut reader, CONTROL_FRAME_MAX_BYTES).await;
            let failed = msg.is_err();
            if tx.send(msg).await.is_err() || failed {
                return;
            }
        }
    });
    (rx, task)
}

/// The first SIGTERM asks the coordinator for a drain; a second one, or the grace running out,
/// ends the process now (exit status 143, as the signal's default action gives).
fn on_signal(
    event: LeaveEvent,
    rank: RankId,
    leaving: &Leaving,
    link: &mpsc::Sender<Option<ToCoord>>,
) {
    match event {
        LeaveEvent::Notice => {
            let grace_ms = leaving.grace().as_millis() as u64;
            let notice = ToCoord::Leave {
                cause: "SIGTERM".into(),
                grace_ms,
            };
            let _ = link.try_send(Some(notice));
            println!(
                "ezero worker: rank {rank}: SIGTERM: leaving at the next step boundary (grace {:.0} s; a second SIGTERM leaves at once)",
                leaving.grace().as_secs_f64()
            );
        }
        LeaveEvent::Abrupt(why) => {
            eprintln!(
                "ezero worker: rank {rank}: {why}: leaving now; the job recovers this rank's shards from its buddy backups"
            );
            std::process::exit(143);
        }
    }
}

/// Carries out one coordinator message; `Some` when it ends the job for this worker.
fn execute<T: Transport>(
    msg: ToWorker,
    rank: RankId,
    rank_actor: &ActorRef<RankMsg<T>>,
    hooks: &Hooks,
    link: &mpsc::Sender<Option<ToCoord>>,
    part_max_bytes: usize,
) -> Option<WorkerOutcome> {
    match msg {
        ToWorker::Command(cmd) => {
            let _ = rank_actor.cast(cmd.into_msg());
        }
        ToWorker::Collect { id } => {
            let (actor, link) = (rank_actor.clone(), link.clone());
            tokio::spawn(async move {
                let reply = actor
                    .call(RankMsg::Collect, Some(Duration::from_secs(60)))
                    .await;
                if let Ok(ractor::rpc::CallResult::Success(chunks)) = reply {
                    send_parts(&link, id, chunks, part_max_bytes).await;
                }
            });
        }
        ToWorker::OwnedChunks {
            id,
            unit,
            chunks,
            params_only,
        } => {
            let (actor, link) = (rank_actor.clone(), link.clone());
            tokio::spawn(async move {
                let reply = actor
                    .call(
                        |reply| RankMsg::OwnedChunks {
                            unit,
                            chunks,
                            params_only,
                            reply,
                        },
                        Some(Duration::from_secs(60)),
                    )
                    .await;
                let piece = match reply {
                    Ok(ractor::rpc::CallResult::Success(r)) => r,
                    Ok(_) => Err("the rank did not answer".into()),
                    Err(e) => Err(e.to_string()),
                };
                match piece {
                    Ok(chunks) => send_parts(&link, id, chunks, part_max_bytes).await,
                    Err(reason) => {
                        let _ = link.send(Some(ToCoord::CollectFailed { id, reason })).await;
                    }
                }
            });
        }
        ToWorker::Interrupt { epoch, step } => (hooks.interrupt)(epoch, step),
        ToWorker::AddPeer(p) => match peer(p) {
            Ok(p) => (hooks.add_peer)(p),
            Err(e) => tracing::warn!("{e}; ignored"),
        },
        ToWorker::Heartbeat
        | ToWorker::NotLeader { .. }
        | ToWorker::Attached { .. }
        | ToWorker::Welcome(_)
        | ToWorker::StatePart { .. }
        | ToWorker::Peers { .. }
        | ToWorker::Standby { .. }
        | ToWorker::Refused { .. } => {}
        ToWorker::Stop { ok, reason } => {
            return Some(WorkerOutcome {
                rank: Some(rank),
                ok,
                reason,
                data_plane: None,
                noticed: None,
            })
        }
    }
    None
}

/// The data plane's side doors, for the coordinator's messages the rank actor does not handle.
struct Hooks {
    /// Wakes the rank from an abandoned (epoch, step).
    interrupt: Box<dyn Fn(u64, u64) + Send + Sync>,
    /// Makes a rank that joined the running job reachable at its data address.
    add_peer: Box<dyn Fn(Peer) + Send + Sync>,
}

/// A worker process's tier: its own folder (`worker-RANK`) under the configured directory, so
/// workers sharing a disk never share a file or a lock. The lock is held until the process
/// exits, which is when the rank's state is gone anyway.
fn worker_storage(
    cfg: &TrainConfig,
    model: &dyn crate::model::Model,
    rank: RankId,
) -> Result<(Option<Arc<TierSpec>>, ActivationChoice, usize), ProcError> {
    let available = crate::runtime::alloc::available_memory_bytes().unwrap_or(u64::MAX / 2);
    let plan = StoragePlan::new(cfg, model, 1, false, available)
        .map_err(|e| ProcError::Setup(e.to_string()))?;
    let buffers = plan.device_buffers();
    let Some(mut tier) = plan.tier else {
        return Ok((None, plan.activations, buffers));
    };
    let own = tier.dir.join(format!("worker-{rank}"));
    if tier.dir.is_dir() {
        std::fs::create_dir_all(&own).map_err(|e| {
            ProcError::Setup(format!("creating the tier folder {}: {e}", own.display()))
        })?;
    }
    tier.dir = own;
    let (spec, lock) = TierSpec::for_plan(&tier).map_err(|e| ProcError::Setup(e.to_string()))?;
    std::mem::forget(lock);
    Ok((Some(Arc::new(spec)), plan.activations, buffers))
}

/// The job's config as the coordinator sent it, checked.
fn welcome_config(welcome: &Welcome) -> Result<TrainConfig, ProcError> {
    let mut cfg: TrainConfig = serde_json::from_str(&welcome.config_json)
        .map_err(|e| ProcError::Setup(format!("the coordinator sent an unreadable config: {e}")))?;
    cfg.validate()?;
    // The job's rank count says nothing of this host: the coordinator counted who shares it.
    cfg.compute_threads = compute_threads_for(cfg.compute_threads, welcome.ranks_on_host);
    Ok(cfg)
}

/// The rank's actor, its end, and where it counts its progress.
type Started<T> = (
    ActorRef<RankMsg<T>>,
    mpsc::UnboundedReceiver<WorkerEnd>,
    Arc<RunProgress>,
);

async fn start_rank<T: Transport>(
    job: Job,
    transport: T,
    link: &mpsc::Sender<Option<ToCoord>>,
) -> Result<Started<T>, ProcError> {
    let Job {
        welcome,
        cfg,
        plan,
        start,
    } = job;
    let rank = welcome.rank;
    let model = build_model(&cfg)?;
    let dataset = build_dataset(&cfg)?;
    let eval = crate::job::build_eval_dataset(&cfg)?;
    let (storage, activations, device_buffers) = worker_storage(&cfg, model.as_ref(), rank)?;
    // A joiner (not in the committed map) holds nothing until its reshard.
    let state = if welcome.map.is_member(rank) {
        let restored: Option<BTreeMap<(u32, u32), ChunkState>> =
            start.map(|chunks| chunks.into_iter().map(|c| ((c.unit, c.index), c)).collect());
        let source = |u: usize, i: usize| {
            let chunks = restored.as_ref()?;
            chunks.get(&(u as u32, i as u32)).cloned()
        };
        let weights = ModelInit {
            model: Arc::clone(&model),
            seed: plan.seed,
        };
        let from = match &restored {
            Some(_) => StartFrom::Chunks(&source),
            None => StartFrom::Weights(&weights),
        };
        let state = RankState::start(rank, &plan, &model, &welcome.map, storage.as_deref(), from)
            .map_err(|e| ProcError::Setup(format!("rank {rank}: {e}")))?;
        Some(state)
    } else {
        None
    };
    let progress = Arc::new(RunProgress::default());
    let setup = Arc::new(RankSetup {
        stage: plan.stage,
        mode: plan.reduce,
        model,
        optim: plan.optim,
        data: dataset,
        exec: ExecConfig {
            eval_data: eval,
            ..ExecConfig::new(
                &plan.exec,
                activations.keep,
                device_buffers,
                Arc::clone(&progress),
            )
        },
        storage,
        // An injected kill (`--kill`, or an operator's `POST /ranks/{id}/kill`) ends this
        // process with SIGKILL, as `kill -9` would: no goodbye, the kernel closes its sockets.
        disconnect: Box::new(|r| {
            eprintln!("rank {r}: injected kill, exiting");
            let _ = signal_hook::low_level::raise(signal_hook::consts::SIGKILL);
            std::process::exit(137)
        }),
    });
    let (ended_tx, ended) = mpsc::unbounded_channel();
    let proxy_args = CoordProxyArgs {
        rank,
        link: link.clone(),
        ended: ended_tx,
    };
    let (proxy, _) = Actor::spawn(None, CoordProxy::<T>::default(), proxy_args)
        .await
        .map_err(|e| ProcError::Setup(e.to_string()))?;
    let args = RankArgs {
        rank,
        work: Work::new(state, Comm::new(transport, plan.collective_timeout_ms)),
        coordinator: proxy.clone(),
        setup,
        panic_at_step: None,
        kill_at_step: plan.kill_step(rank),
    };
    let (actor, _) = Actor::spawn_linked(None, RankActor::<T>::default(), args, proxy.get_cell())
        .await
        .map_err(|e| ProcError::Setup(e.to_string()))?;
    Ok((actor, ended, progress))
}
