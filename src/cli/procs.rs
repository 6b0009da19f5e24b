//! `ezero coordinator` and `ezero worker`: one job with each rank in its own process.
//!
//! The coordinator owns the job (the same train flags and config file as `ezero train`, with
//! `--ranks` the number of workers) and prints the same progress and final `param-sha256:`
//! line; workers only need the coordinator's address, the cluster token and the cluster's
//! secrets directory. Every connection between them is mutual TLS against the cluster CA.

use elastic_zero::runtime::clock::Stopwatch;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Args;

use elastic_zero::config::TrainConfig;
use elastic_zero::data::Dataset;
use elastic_zero::engine::coordinator::{MembershipRecord, StepRecord};
use elastic_zero::job::run_plan::StoragePlan;
use elastic_zero::job::{build_dataset, build_model, memory_demand};
use elastic_zero::model::{param_count, Model};
use elastic_zero::net::tls::ClusterTls;
use elastic_zero::net::{init_secrets, Identity};
use elastic_zero::plan::tier::{evaluate, Fit, Placement, MIN_TILE_ELEMS};
use elastic_zero::plan::RankId;
use elastic_zero::runtime::alloc::available_memory_bytes;
use elastic_zero::runtime::api::cluster::Observer;
use elastic_zero::runtime::api::http;
use elastic_zero::runtime::api::notice::Notice;
use elastic_zero::runtime::procs::control_plane::DataPlane;
use elastic_zero::runtime::procs::coord::{
    run_coordinator, CoordinatorOptions, Listening, ProcError,
};
use elastic_zero::runtime::procs::heartbeat::ProcsConfig;
use elastic_zero::runtime::procs::state::{check_parts, STATE_PART_MAX_BYTES};
use elastic_zero::runtime::procs::worker::{run_worker, WorkerOptions};
use elastic_zero::runtime::step::elastic::snapshot::SnapshotSink;
use elastic_zero::runtime::TrainOutcome;
use elastic_zero::summary::TrainSummary;

use super::checkpoint::{self, SaveObserver, SavePlan, Saving};
use super::scheduler;
use super::{CliError, TrainArgs};

/// Heartbeat and join timing, shared by `coordinator` and `launch`.
#[derive(Args, Clone, Default)]
pub struct ProcsArgs {
    /// Heartbeat interval on every control connection [default: 500].
    #[arg(long)]
    pub heartbeat_ms: Option<u64>,
    /// A process silent this long is declared failed [default: 5000].
    #[arg(long)]
    pub heartbeat_timeout_ms: Option<u64>,
    /// How long the coordinator waits for all workers to join [default: 60000].
    #[arg(long)]
    pub join_timeout_ms: Option<u64>,
    /// How long a rank joining the running job (`--join`, `POST /join`) waits for a standby
    /// worker (`ezero worker --join ADDR` started after the job) [default: 10000].
    #[arg(long)]
    pub join_wait_ms: Option<u64>,
}

impl ProcsArgs {
    pub fn resolve(&self) -> Result<ProcsConfig, CliError> {
        let d = ProcsConfig::default();
        let c = ProcsConfig {
            heartbeat_ms: self.heartbeat_ms.unwrap_or(d.heartbeat_ms),
            heartbeat_timeout_ms: self.heartbeat_timeout_ms.unwrap_or(d.heartbeat_timeout_ms),
            join_timeout_ms: self.join_timeout_ms.unwrap_or(d.join_timeout_ms),
            connect_timeout_ms: d.connect_timeout_ms,
            join_wait_ms: self.join_wait_ms.unwrap_or(d.join_wait_ms),
        };
        c.validate().map_err(|e| CliError::Usage(e.to_string()))?;
        Ok(c)
    }

    /// The flags again, for a child process.
    pub fn to_flags(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (name, v) in [
            ("--heartbeat-ms", self.heartbeat_ms),
            ("--heartbeat-timeout-ms", self.heartbeat_timeout_ms),
            ("--join-timeout-ms", self.join_timeout_ms),
            ("--join-wait-ms", self.join_wait_ms),
        ] {
            if let Some(v) = v {
                out.extend([name.to_string(), v.to_string()]);
            }
        }
        out
    }
}

/// `ezero coordinator` flags.
#[derive(Args)]
pub struct CoordinatorArgs {
    /// Accept workers on this address only (host:port; port 0 picks a free one and prints it).
    #[arg(long, env = "EZERO_LISTEN", required_unless_present = "init_secrets")]
    pub listen: Option<String>,
    /// Make a fresh cluster CA in DIR (for `--secrets DIR` here and on every worker) and exit.
    #[arg(long, value_name = "DIR")]
    pub init_secrets: Option<PathBuf>,
    /// The cluster's secrets directory (its CA, or this process's `coordinator.pem` and key):
    /// every worker connection is mutual TLS against that CA. Required.
    #[arg(long, env = "EZERO_SECRETS_DIR", value_name = "DIR")]
    pub secrets: Option<PathBuf>,
    /// Data plane between workers [default: tcp]: tcp or quic, both mutual TLS against the
    /// cluster CA, or ucx: shared memory between the workers confirmed to run on one host as
    /// one user, TLS TCP between the others.
    #[arg(long, value_parser = parse_data_plane)]
    pub transport: Option<DataPlane>,
    /// With --transport ucx: also use UCX over these network devices (e.g. eth1 or mlx5_0:1,
    /// comma-separated: TCP or RDMA) between workers on different hosts. NOT ENCRYPTED: only
    /// for networks you trust, as with NCCL or gloo [default: shared memory only, TLS TCP
    /// between hosts].
    #[arg(long, value_name = "DEVICES")]
    pub ucx_net: Option<String>,
    /// File holding the cluster token workers must present (or set EZERO_CLUSTER_TOKEN).
    #[arg(long, env = "EZERO_CLUSTER_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// With --control: serve HTTPS with this coordinator's cluster certificate (check it with
    /// the cluster CA: `curl --cacert DIR/ca.pem --resolve ezero-peer:PORT:HOST
    /// https://ezero-peer:PORT/status`) [default: plain HTTP].
    #[arg(long, requires = "control")]
    pub control_tls: bool,
    #[command(flatten)]
    pub procs: ProcsArgs,
    #[command(flatten)]
    pub failover: super::failover::FailoverArgs,
    #[command(flatten)]
    pub train: TrainArgs,
}

/// `ezero worker` flags.
#[derive(Args)]
pub struct WorkerArgs {
    /// The coordinator's address (host:port), or every coordinator's of a job kept in a
    /// metadata store, comma-separated (the worker joins the one that leads and re-attaches
    /// to the next leader when it is lost) [default: from the scheduler: MASTER_ADDR and
    /// MASTER_PORT (torchrun, PyTorchJob), or the first host of SLURM_JOB_NODELIST with
    /// MASTER_PORT or 29500].
    #[arg(long, env = "EZERO_COORDINATOR")]
    pub join: Option<String>,
    /// The rank this worker would like; the coordinator gives the lowest free one otherwise
    /// [default: from the scheduler: SLURM_PROCID, RANK, or JOB_COMPLETION_INDEX].
    #[arg(long, env = "EZERO_RANK_HINT")]
    pub rank_hint: Option<u32>,
    /// After a SIGTERM (a pod eviction, a spot preemption notice), how long to wait for the
    /// graceful leave at the next step boundary before leaving at once (the job then recovers
    /// this rank from buddy backups); keep it under the scheduler's grace (Kubernetes: 30 s)
    /// [default: 25].
    #[arg(long, env = "EZERO_DRAIN_GRACE_S", value_parser = parse_grace_s)]
    pub drain_grace_s: Option<f64>,
    /// Where to accept peers' data connections (ip:port; port 0 picks one).
    #[arg(long, env = "EZERO_DATA_ADDR", default_value = "127.0.0.1:0")]
    pub data_listen: String,
    /// The address peers dial to reach this worker's data plane, when it differs from the one
    /// it listens on (NAT, a port forward, a proxy); ip:port. Default: the bound address.
    #[arg(long, env = "EZERO_DATA_ADVERTISE")]
    pub data_advertise: Option<String>,
    /// The cluster's secrets directory (its CA, or this worker's `rank-HINT.pem` and key, or
    /// `worker.pem` without --rank-hint): every connection is mutual TLS against that CA.
    /// Required.
    #[arg(long, env = "EZERO_SECRETS_DIR", value_name = "DIR")]
    pub secrets: Option<PathBuf>,
    /// File holding the cluster token (or set EZERO_CLUSTER_TOKEN).
    #[arg(long, env = "EZERO_CLUSTER_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Keep trying an unanswering coordinator this long [default: 10000].
    #[arg(long)]
    pub connect_timeout_ms: Option<u64>,
    /// Only join as a new rank of the running job (a standby until a join takes it), never as
    /// one of its initial ranks. A worker that connects after the job started is one anyway.
    #[arg(long, env = "EZERO_STANDBY")]
    pub standby: bool,
    /// When the coordinator of a job kept in a metadata store is lost, how long to look for
    /// the next leader among --join's addresses before stopping [default: 30000].
    #[arg(long, env = "EZERO_LEADER_WAIT_MS")]
    pub leader_wait_ms: Option<u64>,
}

/// Default `--leader-wait-ms`.
const LEADER_WAIT_MS_DEFAULT: u64 = 30_000;

/// The cluster token from a file or `EZERO_CLUSTER_TOKEN`.
fn token(file: Option<&PathBuf>) -> Result<String, CliError> {
    let token = match file {
        Some(p) => std::fs::read_to_string(p)
            .map_err(|e| CliError::Usage(format!("--token-file {}: {e}", p.display())))?
            .trim()
            .to_string(),
        None => std::env::var("EZERO_CLUSTER_TOKEN").unwrap_or_default(),
    };
    if token.is_empty() || token.len() > 256 {
        return Err(CliError::Usage(
            "cluster token: set EZERO_CLUSTER_TOKEN or --token-file to 1-256 bytes (ezero launch makes one)"
                .into(),
        ));
    }
    Ok(token)
}

/// This process's TLS configs from the cluster's secrets directory, as `name`; a missing or
/// unusable directory is a usage error saying what to pass.
pub fn cluster_tls(dir: Option<&PathBuf>, name: &str) -> Result<ClusterTls, CliError> {
    let Some(dir) = dir else {
        return Err(CliError::Usage(
            "every connection is mutual TLS: pass the cluster's secrets directory with --secrets DIR or EZERO_SECRETS_DIR (make one with `ezero coordinator --init-secrets DIR`)".into(),
        ));
    };
    let bad = |e: String| CliError::Usage(format!("--secrets {}: {e}", dir.display()));
    let id = Identity::from_dir(dir, name).map_err(|e| bad(e.to_string()))?;
    ClusterTls::new(&id).map_err(|e| bad(e.to_string()))
}

/// Train flags the process runtime does not support yet, as a usage error naming the flag.
pub fn check_train_args(args: &TrainArgs, cfg: &TrainConfig) -> Result<(), CliError> {
    if let Some(hook) = args.test_hooks.first_set() {
        return Err(CliError::Usage(format!(
            "the test hook {hook} is not supported with worker processes yet (use ezero train)"
        )));
    }
    check_parts(cfg, STATE_PART_MAX_BYTES).map_err(|e| CliError::Usage(e.to_string()))
}

fn runtime() -> Result<tokio::runtime::Runtime, CliError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| CliError::Failed(format!("cannot start the tokio runtime: {e}")))
}

pub fn parse_data_plane(s: &str) -> Result<DataPlane, String> {
    match s {
        "quic" => Ok(DataPlane::Quic),
        "tcp" => Ok(DataPlane::Tcp),
        "ucx" if cfg!(feature = "ucx") => Ok(DataPlane::Ucx),
        "ucx" => Err(elastic_zero::runtime::transport::NO_UCX_BUILD.into()),
        _ => Err(format!("unknown transport `{s}`: use tcp, quic or ucx")),
    }
}

/// `--ucx-net` only with `--transport ucx`, naming devices UCX can take; with `warn`, says
/// that it is not encrypted.
pub fn check_ucx_net(plane: DataPlane, devices: Option<&str>, warn: bool) -> Result<(), CliError> {
    let Some(devices) = devices else {
        return Ok(());
    };
    if plane != DataPlane::Ucx {
        return Err(CliError::Usage(
            "--ucx-net is for --transport ucx only".into(),
        ));
    }
    #[cfg(feature = "ucx")]
    if !elastic_zero::runtime::transport::ucx::engine::valid_net_devices(devices) {
        return Err(CliError::Usage(format!(
            "--ucx-net `{devices}`: give device names separated by commas (e.g. eth1 or mlx5_0:1,eth2)"
        )));
    }
    if warn {
        eprintln!(
            "warning: --ucx-net {devices}: data between workers on different hosts goes over UCX unencrypted"
        );
    }
    Ok(())
}

/// Under `--transport ucx`, that libucx can be loaded here (exit 2 with what to install before
/// any process starts; the workers of a launch run on this machine).
pub fn check_data_plane(plane: DataPlane) -> Result<(), CliError> {
    #[cfg(feature = "ucx")]
    if plane == DataPlane::Ucx {
        elastic_zero::runtime::transport::ucx::library()
            .map_err(|e| CliError::Usage(format!("--transport ucx: {e}")))?;
    }
    let _ = plane;
    Ok(())
}

/// `--init-secrets DIR`: a new cluster CA, and what to do with it.
fn write_secrets(dir: &Path) -> Result<(), CliError> {
    init_secrets(dir).map_err(|e| CliError::Failed(format!("--init-secrets: {e}")))?;
    println!(
        "cluster CA written to {}; give the coordinator and every worker --secrets {}",
        dir.display(),
        dir.display()
    );
    Ok(())
}

/// The data plane `--transport` names, with `--ucx-net` checked: the arguments first, so a
/// malformed one is reported whether or not libucx is here.
fn checked_data_plane(args: &CoordinatorArgs) -> Result<DataPlane, CliError> {
    let plane = args.transport.unwrap_or(DataPlane::Tcp);
    check_ucx_net(plane, args.ucx_net.as_deref(), false)?;
    check_data_plane(plane)?;
    check_ucx_net(plane, args.ucx_net.as_deref(), true)?;
    Ok(plane)
}

/// The largest part of the starting state a worker is sent, checked against the config.
fn checked_part_max(args: &CoordinatorArgs, cfg: &TrainConfig) -> Result<usize, CliError> {
    let part_max_bytes = args
        .train
        .test_hooks
        .state_part_max_bytes
        .unwrap_or(STATE_PART_MAX_BYTES);
    check_parts(cfg, part_max_bytes).map_err(|e| CliError::Usage(e.to_string()))?;
    Ok(part_max_bytes)
}

/// The model and the training data; the eval data is read once too, so that bad eval data is
/// refused before any worker starts.
fn model_and_data(cfg: &TrainConfig) -> Result<(Arc<dyn Model>, Arc<Dataset>), CliError> {
    let usage = |e: &dyn std::fmt::Display| CliError::Usage(e.to_string());
    let model = build_model(cfg).map_err(|e| usage(&e))?;
    let data = build_dataset(cfg).map_err(|e| usage(&e))?;
    elastic_zero::job::build_eval_dataset(cfg).map_err(|e| usage(&e))?;
    Ok((model, data))
}

pub fn run_coordinator_cmd(args: &CoordinatorArgs) -> Result<(), CliError> {
    if let Some(dir) = &args.init_secrets {
        return write_secrets(dir);
    }
    let Some(listen) = &args.listen else {
        return Err(CliError::Usage("--listen is required".into()));
    };
    let (cfg, resume) = checkpoint::resolve_train(&args.train)?;
    super::outputs::check_train(&cfg)?;
    check_train_args(&args.train, &cfg)?;
    let part_max_bytes = checked_part_max(args, &cfg)?;
    let procs = args.procs.resolve()?;
    let data_plane = checked_data_plane(args)?;
    let token = token(args.token_file.as_ref())?;
    let tls = cluster_tls(args.secrets.as_ref(), "coordinator")?;
    let (model, data) = model_and_data(&cfg)?;
    if let Some(source) = &resume {
        checkpoint::check_compatible(source, &cfg, model.as_ref(), args.train.reschedule)?;
    }
    let init = checkpoint::init_weights(&args.train, model.as_ref())?;
    // Read before the save directory is made: damaged saved state changes nothing.
    let start = checkpoint::start_state(&cfg, model.as_ref(), resume.as_ref(), init)?;
    let resumed_from = resume.as_ref().map(|l| l.dir.clone());
    let boundary = Saving::boundary_snapshot();
    let (saving, snapshot_sink) = coordinator_saving(
        &cfg,
        model.as_ref(),
        &data,
        args,
        resumed_from.as_deref(),
        &boundary,
    )?;
    let psi = param_count(&model.units());
    let floor = data.entropy_floor_nats();
    let fit = one_rank_fit(&cfg, model.as_ref());
    let control_access = coordinator_access(args, &tls)?;
    let failover = args.failover.resolve()?;
    let mut opts = CoordinatorOptions {
        listen: listen.clone(),
        token,
        tls,
        procs,
        data_plane,
        ucx_net: args.ucx_net.clone(),
        control: args.train.control,
        allow_kill: args.train.control_allow_kill,
        control_access,
        start,
        // Only when a save is due: each snapshot carries the whole state over the control
        // connections; a signal asks for its own through `boundary_snapshot`.
        snapshot_every: if saving.is_some() { cfg.save_every } else { 0 },
        boundary_snapshot: saving.is_some().then_some(boundary),
        on_demand_snapshots: saving.is_some(),
        part_max_bytes,
        state_on_tier: fit.placement.any_nvme(),
        snapshot_sink,
        failover: None,
    };
    let started = Stopwatch::start();
    let mut lines = StepLines::new(&cfg, floor)?;
    let save_dir = cfg.save_dir.clone().filter(|_| saving.is_some());
    let banner = Banner {
        cfg: &cfg,
        psi,
        data: data.describe(),
        allow_kill: args.train.control_allow_kill,
        resume: resume.as_ref(),
    };
    // Without a save directory a signal still stops the job in order: the workers are told.
    let signal = saving.is_none().then(checkpoint::stop_signal).transpose()?;
    let mut observer = SaveObserver::new(&mut lines, saving);
    observer.signal = signal;
    let on_listen = |at: Listening| banner.print(at);
    let outcome = runtime()?.block_on(async {
        if let Some(spec) = failover {
            opts.failover = Some(spec.open().await?);
        }
        Ok::<_, CliError>(run_coordinator(cfg.clone(), opts, on_listen, &mut observer).await)
    })?;
    let stopped = observer.stopped().cloned();
    let saved = observer.saving.take().map_or(Ok(()), Saving::finish);
    let outcome = match (outcome, stopped) {
        (Ok(o), _) => o,
        (Err(ProcError::Outlived(why)), _) => {
            println!("{why}");
            return Ok(());
        }
        (Err(_), Some(stopped)) => exit_stopped(&stopped, saved),
        (Err(e), None) => return Err(failure(e, lines.last_step, save_dir.as_deref())),
    };
    saved?;
    let wall_s = started.elapsed().as_secs_f64();
    let records = &outcome.records;
    let mut summary =
        super::train::summarize(&cfg, psi, floor, records, &outcome.param_sha256, &fit);
    report(&cfg, &outcome, &mut summary, wall_s)
}

/// Who may change the job through the control endpoint, and whether it speaks TLS.
fn coordinator_access(
    args: &CoordinatorArgs,
    tls: &ClusterTls,
) -> Result<Option<http::Access>, CliError> {
    let Some(addr) = args.train.control else {
        return Ok(None);
    };
    let access = super::control_access::control_access(&args.train, addr)?;
    Ok(Some(http::Access {
        tls: args.control_tls.then(|| tls.https_server()),
        ..access
    }))
}

/// A run stopped early (a signal, a notice the job could not grant): its line and exit code,
/// after any failed save is reported.
fn exit_stopped(stopped: &checkpoint::Stopped, saved: Result<(), CliError>) -> ! {
    if let Err(CliError::Failed(e) | CliError::Usage(e)) = saved {
        eprintln!("error: {e}");
    }
    stopped.exit()
}

/// Where snapshots stream when the state is on the tiers.
type Sink = std::sync::Arc<dyn SnapshotSink>;

/// Saving for a coordinated run (with `--save-dir`), and where snapshots stream when the state
/// is on the tiers; a stop after a signal's checkpoint is left to the driver, which tells the
/// workers.
fn coordinator_saving(
    cfg: &TrainConfig,
    model: &dyn Model,
    data: &elastic_zero::data::Dataset,
    args: &CoordinatorArgs,
    resumed_from: Option<&Path>,
    boundary: &elastic_zero::runtime::actors::BoundarySnapshot,
) -> Result<(Option<Saving>, Option<Sink>), CliError> {
    let save_plan = SavePlan::new(cfg, model, data, &args.train)?;
    let snapshot_sink = save_plan.as_ref().map(SavePlan::sink);
    let saving = save_plan
        .map(|p| p.start(cfg, resumed_from, boundary))
        .transpose()?
        .map(|s| {
            s.resume_with(format!("ezero launch --nprocs {} -- --resume", cfg.ranks))
                .stop_through_driver()
        });
    Ok((saving, snapshot_sink))
}

/// The end of a coordinated run: the summary line, what a resume read, the JSON summary and
/// the digest.
fn report(
    cfg: &TrainConfig,
    outcome: &TrainOutcome,
    summary: &mut TrainSummary,
    wall_s: f64,
) -> Result<(), CliError> {
    println!(
        "done: {} steps in {:.1} s, loss {:.4} -> {:.4}, median step {:.3} s, {:.0} tokens/s",
        cfg.steps,
        wall_s,
        summary.first_loss,
        summary.final_loss,
        summary.step_time_median_s,
        summary.tokens_per_s
    );
    if let Some(reads) = checkpoint::resume_reads(&outcome.resume_reads) {
        println!(
            "  resume: the coordinator read each rank's owned chunks ({reads}) and sent each worker the chunks its state is built from"
        );
    }
    super::train::report_eval(cfg, summary);
    if let Some(path) = &cfg.json {
        super::train::write_json_atomically(path, summary)?;
    }
    println!("param-sha256: {}", summary.param_sha256);
    Ok(())
}

/// One rank's memory plan on this machine, for the summary and to know whether the workers
/// keep state on their tiers: each worker plans its own placement, and where one rank does not
/// fit here, the workers' hosts may still have room (they refuse the run if not).
fn one_rank_fit(cfg: &TrainConfig, model: &dyn Model) -> Fit {
    let available = available_memory_bytes().unwrap_or(u64::MAX / 2);
    StoragePlan::new(cfg, model, 1, false, available)
        .map(|p| p.fit)
        .unwrap_or_else(|_| {
            evaluate(
                &memory_demand(cfg, model, 1, false),
                Placement::RAM,
                MIN_TILE_ELEMS,
            )
        })
}

/// What the coordinator prints once it listens: where, and the job.
struct Banner<'a> {
    cfg: &'a TrainConfig,
    psi: usize,
    data: String,
    allow_kill: bool,
    resume: Option<&'a elastic_zero::checkpoint::CheckpointSource>,
}

impl Banner<'_> {
    fn print(&self, at: Listening) {
        // `ezero launch` reads this line to learn the address; keep its shape.
        println!("ezero coordinator: listening on {}", at.workers);
        if let Some(addr) = at.control {
            // The same line as `ezero train --control`: scripts read it to find a :0 port.
            println!(
                "control endpoint: http://{addr} (GET /status, GET /metrics, POST /ranks/{{id}}/drain{}, POST /join?count=N with standby workers; 503 until every worker has joined)",
                if self.allow_kill { ", POST /ranks/{id}/kill" } else { "" }
            );
        }
        println!(
            "ezero coordinator: ZeRO-{} with {} worker processes, {} parameters, data: {}",
            self.cfg.stage, self.cfg.ranks, self.psi, self.data
        );
        if let Some(l) = self.resume {
            checkpoint::print_resumed(l);
        }
    }
}

/// The run's failure, naming what was lost with it.
fn failure(e: ProcError, last_step: Option<u64>, save_dir: Option<&Path>) -> CliError {
    match e {
        ProcError::Config(c) => CliError::Usage(c.to_string()),
        ProcError::Setup(s) => CliError::Failed(s),
        ProcError::Meta(s) => CliError::Usage(s),
        ProcError::Deposed(_) => CliError::Failed(e.to_string()),
        other => {
            let lost = match (last_step, save_dir) {
                (Some(s), Some(dir)) => format!(
                    "not saved: the state after step {} lived only in the workers; continue from the newest checkpoint with --resume {}",
                    s + 1,
                    dir.display()
                ),
                (Some(s), None) => format!(
                    "not saved: the parameters and optimizer state after step {} lived only in the workers and are lost (no --save-dir was given)",
                    s + 1
                ),
                (None, _) => "not saved: no step had completed".to_string(),
            };
            CliError::Failed(format!("{other}\n{lost}"))
        }
    }
}

/// Prints step lines as `ezero train` does.
struct StepLines<'a> {
    cfg: &'a TrainConfig,
    floor: Option<f64>,
    last_step: Option<u64>,
    /// `--metrics-file`, written by the coordinator as each step ends.
    metrics: Option<super::metrics_log::MetricsLog>,
    /// A membership change was printed: the next step's line is printed too, so that the
    /// output shows training going on after it.
    changed: bool,
}

impl<'a> StepLines<'a> {
    fn new(cfg: &'a TrainConfig, floor: Option<f64>) -> Result<Self, CliError> {
        Ok(Self {
            cfg,
            floor,
            last_step: None,
            metrics: super::metrics_log::MetricsLog::open(cfg)?,
            changed: false,
        })
    }
}

impl Observer for &mut StepLines<'_> {
    fn on_step(&mut self, rec: &StepRecord) {
        self.last_step = Some(rec.step);
        let cfg = self.cfg;
        let log_every = (cfg.steps / 10).max(1);
        let due = rec.step.is_multiple_of(log_every) || rec.step + 1 == cfg.steps;
        let tps = cfg.tokens_per_step() as f64 / (rec.duration_ms.max(1) as f64 / 1e3);
        if due || rec.eval_loss.is_some() || std::mem::take(&mut self.changed) {
            println!("{}", super::train::step_line(cfg, rec, self.floor, tps));
        }
        if let Some(Err(e)) = self.metrics.as_ref().map(|m| m.record(cfg, rec, tps)) {
            println!("{e}");
        }
    }

    fn on_membership(&mut self, m: &MembershipRecord) {
        self.changed = true;
        let retry = match m.rolled_back_to {
            _ if m.is_network_retry() => ", retried after frames were lost on the network".into(),
            Some(step) if m.takeover => {
                format!(", taken over by a new coordinator: rolled back to step {step}")
            }
            _ => String::new(),
        };
        println!(
            "membership epoch {}: ranks {:?} -> {:?}, lost {:?}{retry}",
            m.epoch, m.before, m.after, m.lost
        );
    }

    fn on_join_failed(&mut self, rank: RankId, reason: &str) {
        println!("{}", super::train::join_failed_line(rank, reason));
    }

    fn on_notice(&mut self, n: &Notice, granted: &Result<(), String>) {
        match granted {
            Ok(()) => println!(
                "rank {}: notice ({}, grace {:.0} s): it leaves at the next step boundary",
                n.rank,
                n.cause,
                n.grace_ms as f64 / 1e3
            ),
            Err(why) => println!("rank {}: notice ({}) refused: {why}", n.rank, n.cause),
        }
    }
}

pub fn run_worker_cmd(args: &WorkerArgs) -> Result<(), CliError> {
    let result = worker_cmd(args);
    // Exit here: the rank's threads and transport may still wait on peers, and the job is over.
    let code = match &result {
        Ok(()) => 0,
        Err(CliError::Usage(m)) => {
            eprintln!("error: {m}");
            2
        }
        Err(CliError::Failed(m)) => {
            eprintln!("error: {m}");
            1
        }
    };
    std::process::exit(code)
}

/// `--drain-grace-s`: seconds, positive and at most an hour.
fn parse_grace_s(s: &str) -> Result<f64, String> {
    s.parse::<f64>()
        .ok()
        .filter(|g| g.is_finite() && *g > 0.0 && *g <= 3600.0)
        .ok_or_else(|| format!("`{s}` is not a grace in seconds (more than 0, at most 3600)"))
}

/// Default `--drain-grace-s`: under Kubernetes' 30 s `terminationGracePeriodSeconds`.
const DRAIN_GRACE_S_DEFAULT: f64 = 25.0;

/// The coordinator and rank hint from the flags, else from the scheduler's variables; says
/// which it used.
fn where_to_join(args: &WorkerArgs) -> Result<scheduler::Resolved, CliError> {
    let explicit = scheduler::Explicit {
        join: args.join.clone(),
        rank_hint: args.rank_hint,
    };
    let env = |k: &str| std::env::var(k).ok();
    let r = scheduler::resolve(&explicit, &env).map_err(CliError::Usage)?;
    println!(
        "ezero worker: coordinator {}, rank hint {}, from {}",
        r.join,
        r.rank_hint
            .map_or_else(|| "none".to_string(), |h| h.to_string()),
        r.source
    );
    Ok(r)
}

fn worker_cmd(args: &WorkerArgs) -> Result<(), CliError> {
    let token = token(args.token_file.as_ref())?;
    let place = where_to_join(args)?;
    let name = place
        .rank_hint
        .map_or_else(|| "worker".to_string(), |r| format!("rank-{r}"));
    let tls = cluster_tls(args.secrets.as_ref(), &name)?;
    let d = ProcsConfig::default();
    let procs = ProcsConfig {
        connect_timeout_ms: args.connect_timeout_ms.unwrap_or(d.connect_timeout_ms),
        ..d
    };
    procs
        .validate()
        .map_err(|e| CliError::Usage(e.to_string()))?;
    let data_advertise = args
        .data_advertise
        .as_deref()
        .map(|a| {
            a.parse().map_err(|_| {
                CliError::Usage(format!(
                    "--data-advertise {a:?}: expected ip:port, the address peers dial to reach this worker"
                ))
            })
        })
        .transpose()?;
    let grace_s = args.drain_grace_s.unwrap_or(DRAIN_GRACE_S_DEFAULT);
    let opts = WorkerOptions {
        join: place.join.clone(),
        token,
        rank_hint: place.rank_hint,
        standby: args.standby,
        data_listen: args.data_listen.clone(),
        data_advertise,
        tls,
        procs,
        drain_grace: std::time::Duration::from_secs_f64(grace_s),
        leader_wait: std::time::Duration::from_millis(
            args.leader_wait_ms.unwrap_or(LEADER_WAIT_MS_DEFAULT).max(1),
        ),
    };
    let scheduler_world = place.world;
    let on_welcome = move |rank, world, threads| {
        println!("ezero worker: rank {rank} of {world}, {threads} compute threads");
        if scheduler_world.is_some_and(|w| w != world) {
            println!(
                "ezero worker: note: the scheduler started {} workers; the job has {world} ranks (the coordinator's --ranks decides; the others wait as standbys)",
                scheduler_world.unwrap_or(0)
            );
        }
    };
    // A standby never taken by a join has no rank.
    let who =
        |rank: Option<u32>| rank.map_or_else(|| "standby".to_string(), |r| format!("rank {r}"));
    let outcome = runtime()?.block_on(run_worker(opts, on_welcome));
    if let Some(plane) = outcome.as_ref().ok().and_then(|o| o.data_plane.as_ref()) {
        println!("ezero worker: data plane: {plane}");
    }
    match outcome {
        // Given notice, the worker's work is done however the job went on.
        Ok(out) if out.noticed.is_some() => {
            let after = out.noticed.unwrap_or_default().as_secs_f64();
            println!(
                "ezero worker: {}: {} ({after:.1} s after SIGTERM)",
                who(out.rank),
                out.reason
            );
            Ok(())
        }
        Ok(out) if out.ok => {
            println!("ezero worker: {}: {}", who(out.rank), out.reason);
            Ok(())
        }
        Ok(out) => Err(CliError::Failed(format!(
            "{}: stopped by the coordinator: {}",
            who(out.rank),
            out.reason
        ))),
        Err(ProcError::Config(c)) => Err(CliError::Usage(c.to_string())),
        Err(e) => Err(CliError::Failed(e.to_string())),
    }
}
