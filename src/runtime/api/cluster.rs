//! Starting a cluster of in-process rank actors from Rust code, and driving it to the end.
//!
//! This is the library entry point for programs that embed the runtime: give it a validated
//! config, a model (any `Model`, including one defined outside this crate) and a dataset; get
//! back an event stream of finished steps and, at the end, the consolidated parameters.

use std::ops::Range;
use std::sync::Arc;

use ractor::{Actor, ActorRef};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::config::{ConfigError, NvmeFaultKind, TrainConfig};
use crate::data::Dataset;
use crate::engine::coordinator::{
    Change, Coordinator, JobSpec, MembershipRecord, Refusal, ScriptedChange, StepRecord,
};
use crate::job::{build_dataset, build_model, lr_schedule, optim_settings, plan_memory};
use crate::model::weights::{ModelInit, WeightSource};
use crate::model::Model;
use crate::plan::activations::ActivationChoice;
use crate::plan::tier::Fit;
use crate::plan::{ChunkId, RankId, ShardMap, Stage};
use crate::runtime::actors::RankMsg;
use crate::runtime::actors::{
    BoundarySnapshot, ClusterEvent, CoordArgs, CoordMsg, CoordinatorActor, NewRank, RankActor,
    RankArgs, RankFactory, RankSetup, Snapshot, Work,
};
use crate::runtime::alloc::available_memory_bytes;
use crate::runtime::clock::{every, Clock, SystemClock};

/// How often the coordinator looks at its deadlines, in the clock's milliseconds.
const TICK_MS: u64 = 200;
/// On a simulated clock the wall tick only backs up the clock's own (a day).
const SIMULATED_WALL_TICK_MS: u64 = 86_400_000;
use crate::runtime::step::comm::Comm;
use crate::runtime::step::elastic::resume::{read_owned_chunks, ResumeSource};
use crate::runtime::step::elastic::snapshot::SnapshotSink;
use crate::runtime::step::exec::ExecConfig;
use crate::runtime::step::progress::RunProgress;
use crate::runtime::step::state::rank_state::{ChunkState, RankState};
use crate::runtime::storage::{DirLock, Faults, TierSpec, UringConfig};
use crate::runtime::transport::local::{
    LocalEndpoint, LocalNetwork, NetCounts, NetFaults, NetTrace, Partition,
};

/// Why a run did not finish.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("invalid configuration: {0}")]
    Config(#[from] crate::config::ConfigError),
    #[error("could not start the actors: {0}")]
    Spawn(String),
    #[error("the run stopped: {0}")]
    Aborted(String),
    #[error("consolidating parameters failed: {0}")]
    Collect(String),
    #[error("request refused: {0}")]
    Refused(#[from] Refusal),
    #[error("the coordinator did not answer: {0}")]
    Unavailable(String),
    /// The saved state could not be read or does not fit this run; nothing was started.
    #[error("cannot resume: {0}")]
    Resume(String),
    /// The run does not fit the memory it may use, or its tier directory cannot be used;
    /// nothing was allocated.
    #[error("{0}")]
    Memory(String),
}

/// Everything needed to start a cluster.
pub struct ClusterSpec {
    pub config: TrainConfig,
    pub model: Arc<dyn Model>,
    pub data: Arc<Dataset>,
    /// Start from these weights instead of the model's initialisation (a `Vec<Vec<f32>>` of
    /// full parameters per unit, or a checkpoint read a piece at a time). Each rank reads the
    /// chunks it keeps: under stage 3 only its own.
    pub init: Option<Arc<dyn WeightSource>>,
    /// Continue from saved state (any world size, stage or chunk size); wins over
    /// `init`. Each rank reads only the chunks it owns under the new map.
    pub resume: Option<Arc<dyn ResumeSource>>,
    /// Emit a snapshot after every this many steps and after the last one (0: never unless
    /// asked).
    pub snapshot_every: u64,
    /// Fault injection for tests: (rank, step) whose compute panics.
    pub panic_at: Option<(RankId, u64)>,
    /// A snapshot at the next step boundary when its flag is set (a signal handler).
    pub boundary_snapshot: Option<BoundarySnapshot>,
    /// Counters a caller may poll for a progress line while the ranks build their state or a
    /// long step runs.
    pub progress: Arc<RunProgress>,
    /// Where snapshots go when the planner puts state on the tier: streamed from the owners a
    /// bounded piece at a time while the ranks wait at the step boundary
    /// ([`Observer::on_snapshot_streamed`]), so that saving a model larger than memory needs
    /// no copy of it in RAM. Without a sink (or with state in RAM) snapshots are gathered
    /// whole ([`Observer::on_snapshot`]), and the planner counts that.
    pub snapshot_sink: Option<Arc<dyn SnapshotSink>>,
    /// What the ranks' deadlines, the in-process network's delays and the coordinator read:
    /// the wall, or a [`crate::runtime::clock::ManualClock`] that replays a seeded run.
    pub clock: Arc<dyn Clock>,
    /// Where the in-process network records what it does (chaos replays), if anywhere.
    pub net_trace: Option<Arc<NetTrace>>,
}

impl ClusterSpec {
    /// The built-in model and dataset the config names, from scratch, with no fault injection.
    pub fn from_config(config: TrainConfig) -> Result<Self, ConfigError> {
        Ok(Self::new(
            build_model(&config)?,
            build_dataset(&config)?,
            config,
        ))
    }

    /// Your own model and data, from the model's initialisation, no snapshots, no fault
    /// injection; set the other fields to change that.
    pub fn new(model: Arc<dyn Model>, data: Arc<Dataset>, config: TrainConfig) -> Self {
        Self {
            config,
            model,
            data,
            init: None,
            resume: None,
            snapshot_every: 0,
            panic_at: None,
            boundary_snapshot: None,
            progress: Arc::default(),
            snapshot_sink: None,
            clock: SystemClock::shared(),
            net_trace: None,
        }
    }
}

/// The result of a finished run.
pub struct TrainOutcome {
    pub records: Vec<StepRecord>,
    /// Consolidated fp32 parameters per unit; empty when the planner put state on the tier
    /// (the model may not fit in memory), so use `param_sha256` to compare runs.
    pub params: Vec<Vec<f32>>,
    /// The final parameters' digest (`param-sha256`), always present.
    pub param_sha256: String,
    /// On a resume: bytes each rank read from the saved state, by rank.
    pub resume_reads: Vec<(RankId, u64)>,
    /// What the in-process network did (all zero unless faults were injected).
    pub net: NetCounts,
}

/// A running cluster of rank actors and a coordinator on the in-process transport.
pub struct Cluster {
    coordinator: ActorRef<CoordMsg<LocalEndpoint>>,
    ranks: Vec<(RankId, ActorRef<RankMsg<LocalEndpoint>>)>,
    events: UnboundedReceiver<ClusterEvent>,
    net: Arc<LocalNetwork>,
    map: ShardMap,
    resume_reads: Vec<(RankId, u64)>,
    fit: Fit,
    activations: ActivationChoice,
    /// Held while the run uses its tier directory.
    _tier_lock: Option<DirLock>,
}

/// The memory plan of a run and, when state goes to the tier, its checked and locked directory.
pub struct PreparedStorage {
    pub fit: Fit,
    pub activations: ActivationChoice,
    pub tier: Option<(TierSpec, DirLock)>,
}

/// Plans where the state of `ranks_in_process` ranks goes and, if anything goes to the tier,
/// checks and locks its directory. Runs before anything is allocated.
pub fn prepare_storage(
    cfg: &TrainConfig,
    model: &dyn Model,
    ranks_in_process: u64,
    streamed_snapshots: bool,
) -> Result<PreparedStorage, ClusterError> {
    let available = available_memory_bytes().unwrap_or(u64::MAX / 2);
    let (fit, activations) =
        plan_memory(cfg, model, ranks_in_process, streamed_snapshots, available)
            .map_err(|e| ClusterError::Memory(e.to_string()))?;
    if !fit.placement.any_nvme() {
        return Ok(PreparedStorage {
            fit,
            activations,
            tier: None,
        });
    }
    let dir = cfg
        .nvme_dir
        .as_deref()
        .expect("the planner offloads only with nvme_dir");
    // During a reshard a rank's old and new tier files coexist; backups have files beside them.
    let need = ranks_in_process * (2 * fit.per_rank.tier + fit.per_rank.backup_disk);
    let uring = UringConfig {
        queue_depth: cfg.nvme_queue_depth,
        block_bytes: cfg.nvme_block_bytes as usize,
        direct: !cfg.nvme_buffered,
    };
    let (spec, lock) = TierSpec::for_run(
        dir,
        fit.placement,
        fit.tile_elems as usize,
        fit.staging_buffers as usize,
        uring,
        need,
    )
    .map_err(|e| ClusterError::Memory(e.to_string()))?;
    let spec = TierSpec {
        update_in_backward: fit.update_in_backward,
        update_reuses_params: fit.update_reuses_params,
        faults: cfg.nvme_fault.map(|f| {
            let faults = match f.kind {
                NvmeFaultKind::FailWrites { errno, after_bytes } => Faults {
                    fail_after_write_bytes: Some(after_bytes),
                    errno,
                    ..Faults::default()
                },
                NvmeFaultKind::SlowReads { ms } => Faults {
                    read_delay_ms: ms,
                    ..Faults::default()
                },
            };
            (f.rank, faults)
        }),
        ..spec
    };
    Ok(PreparedStorage {
        fit,
        activations,
        tier: Some((spec, lock)),
    })
}

/// The config's fault-injection keys as the in-process network's faults.
pub fn net_faults(cfg: &TrainConfig) -> NetFaults {
    NetFaults {
        seed: cfg.seed,
        duplicate_per_mille: cfg.net_duplicate_per_mille,
        reorder_per_mille: cfg.net_reorder_per_mille,
        drop_per_mille: cfg.net_drop_per_mille,
        corrupt_per_mille: cfg.net_corrupt_per_mille,
        delay_max_ms: cfg.net_delay_max_ms,
        retransmit_ms: cfg.net_retransmit_ms,
        slow_rank: cfg.net_slow_rank,
        slow_ms: cfg.net_slow_ms,
        partition: Partition::new(
            &cfg.net_partition_ranks,
            cfg.net_partition_from_frame,
            cfg.net_partition_frames,
            cfg.net_partition_ms,
        ),
    }
}

/// The coordinator engine's job description for a config.
pub fn job_spec(cfg: &TrainConfig, snapshot_every: u64) -> JobSpec {
    JobSpec {
        steps: cfg.steps,
        micro_batches: cfg.micro_batches,
        lr: lr_schedule(cfg),
        step_timeout_ms: cfg.collective_timeout_ms.saturating_mul(4),
        initial_grad_bound: cfg.initial_grad_bound,
        snapshot_every,
        script: membership_script(cfg),
        min_ranks: cfg.min_ranks,
        max_ranks: cfg.max_ranks,
        replicate_every: cfg.replicate_every,
    }
}

/// Per-step execution settings of a config, with the memory planner's activation choice.
pub fn exec_config(cfg: &TrainConfig, activations: &ActivationChoice) -> ExecConfig {
    ExecConfig {
        micro_batch_size: cfg.micro_batch_size,
        seq_len: cfg.seq_len,
        seed: cfg.seed,
        max_live_units: cfg.max_live_units,
        keep_activations: activations.keep,
        grad_clip: cfg.grad_clip as f64,
        round_kills: cfg.kill_during.clone(),
        progress: Arc::default(),
        precision: cfg.precision,
    }
}

impl Cluster {
    /// Plans the shard map, builds every rank's state and starts the actors (not the run).
    pub async fn start(spec: ClusterSpec) -> Result<Cluster, ClusterError> {
        let cfg = &spec.config;
        cfg.validate()?;
        let stage = Stage::from_u8(cfg.stage).expect("validated stage");
        let units = spec.model.units();
        let numels: Vec<usize> = units.iter().map(|u| u.numel()).collect();
        let members: Vec<RankId> = (0..cfg.ranks).collect();
        let epoch = spec
            .resume
            .as_ref()
            .map_or(1, |src| src.saved_map().epoch + 1);
        // The memory check first: a model that cannot fit is refused before its chunks are
        // planned (billions of them for tens of trillions of parameters).
        let streamed = spec.snapshot_sink.is_some();
        let PreparedStorage {
            fit,
            activations,
            tier,
        } = prepare_storage(cfg, spec.model.as_ref(), u64::from(cfg.ranks), streamed)?;
        let map = ShardMap::plan(&numels, &members, cfg.chunk_elems, epoch)
            .map_err(|e| ClusterError::Spawn(e.to_string()))?;
        let (storage, tier_lock) = match tier {
            Some((spec, lock)) => (Some(Arc::new(spec)), Some(lock)),
            None => (None, None),
        };
        let restored = match &spec.resume {
            Some(src) => {
                let old: Vec<usize> = src.saved_map().units.iter().map(|u| u.numel).collect();
                if old != numels {
                    return Err(ClusterError::Resume(format!(
                        "{}: its units have sizes {old:?}, this model's are {numels:?}: it belongs to another model",
                        src.describe()
                    )));
                }
                let (src, map) = (Arc::clone(src), map.clone());
                let read = tokio::task::spawn_blocking(move || read_owned_chunks(&*src, &map));
                let read = read.await.map_err(|e| {
                    ClusterError::Resume(format!("a resume reader thread failed: {e}"))
                })?;
                Some(read.map_err(ClusterError::Resume)?)
            }
            None => None,
        };
        // Given weights, or the model's initialisation made unit by unit as each rank builds
        // its state (so the whole model is never in RAM at once).
        let progress = Arc::clone(&spec.progress);
        progress.init_started(u64::from(cfg.ranks) * numels.len() as u64);
        let weights = CountedWeights {
            inner: spec.init.clone().unwrap_or_else(|| {
                Arc::new(ModelInit {
                    model: Arc::clone(&spec.model),
                    seed: cfg.seed,
                })
            }),
            progress,
        };
        let net = LocalNetwork::on_clock(
            Some(net_faults(cfg)),
            Arc::clone(&spec.clock),
            spec.net_trace.clone(),
        );
        let (tx, events) = unbounded_channel();
        let job = job_spec(cfg, spec.snapshot_every);
        let optim = optim_settings(cfg);
        let setup = Arc::new(RankSetup {
            stage,
            mode: cfg.reduce,
            model: Arc::clone(&spec.model),
            optim,
            data: Arc::clone(&spec.data),
            exec: ExecConfig {
                progress: Arc::clone(&spec.progress),
                ..exec_config(cfg, &activations)
            },
            storage: storage.clone(),
            disconnect: {
                let net = Arc::clone(&net);
                Box::new(move |r| net.kill(r))
            },
        });
        let (abort_net, retire_net, join_net) =
            (Arc::clone(&net), Arc::clone(&net), Arc::clone(&net));
        let (join_setup, timeout_ms, kills) = (
            Arc::clone(&setup),
            cfg.collective_timeout_ms,
            cfg.kill.clone(),
        );
        let factory: RankFactory<LocalEndpoint> = Box::new(move |rank, coordinator| {
            Ok(NewRank::Args(Box::new(RankArgs {
                rank,
                work: Work::new(
                    None,
                    Comm::on_clock(join_net.endpoint(rank), timeout_ms, join_net.clock()),
                ),
                coordinator,
                setup: Arc::clone(&join_setup),
                panic_at_step: None,
                kill_at_step: kills.iter().find(|k| k.value == rank).map(|k| k.step),
            })))
        });
        let args = CoordArgs {
            engine: match &spec.resume {
                Some(src) => Coordinator::resume(job, map.clone(), src.progress().clone()),
                None => Coordinator::new(job, map.clone()),
            },
            events: tx,
            clock: Arc::clone(&spec.clock),
            // A simulated clock ticks the coordinator itself (below), at times that replay.
            tick_ms: if spec.clock.simulated() {
                SIMULATED_WALL_TICK_MS
            } else {
                TICK_MS
            },
            on_abort: Box::new(move || abort_net.close()),
            on_retire: {
                let progress = Arc::clone(&spec.progress);
                Box::new(move |r| {
                    retire_net.kill(r);
                    progress.forget(r);
                })
            },
            on_interrupt: {
                let net = Arc::clone(&net);
                Box::new(move |r, epoch, step| net.interrupt(r, epoch, step))
            },
            factory,
            boundary_snapshot: spec.boundary_snapshot.clone(),
            progress: Some(Arc::clone(&spec.progress)),
        };
        let (coordinator, _) =
            Actor::spawn(None, CoordinatorActor::<LocalEndpoint>::default(), args)
                .await
                .map_err(|e| ClusterError::Spawn(e.to_string()))?;
        if spec.clock.simulated() {
            let c = coordinator.clone();
            every(Arc::clone(&spec.clock), TICK_MS, move || {
                c.cast(CoordMsg::Tick).is_ok()
            });
        }
        if let Some(sink) = spec
            .snapshot_sink
            .as_ref()
            .filter(|_| fit.placement.any_nvme())
        {
            let _ = coordinator.cast(CoordMsg::StreamSnapshots(Arc::clone(sink)));
        }
        let mut ranks = Vec::new();
        for &rank in &members {
            let state = match &restored {
                Some(restored) => {
                    let source = |u: usize, i: usize| {
                        let id = ChunkId {
                            unit: u as u32,
                            index: i as u32,
                        };
                        restored.chunks.get(&id).cloned()
                    };
                    RankState::from_chunks(
                        rank,
                        stage,
                        cfg.reduce,
                        Arc::clone(&spec.model),
                        map.clone(),
                        optim,
                        cfg.precision,
                        &source,
                        storage.as_deref(),
                    )
                    .map_err(|e| ClusterError::Spawn(format!("restoring rank {rank}: {e}")))?
                }
                None => RankState::from_full_params(
                    rank,
                    stage,
                    cfg.reduce,
                    Arc::clone(&spec.model),
                    map.clone(),
                    optim,
                    cfg.precision,
                    &weights,
                    storage.as_deref(),
                )
                .map_err(|e| ClusterError::Spawn(format!("building rank {rank}: {e}")))?,
            };
            let args = RankArgs {
                rank,
                work: Work::new(
                    Some(state),
                    Comm::on_clock(net.endpoint(rank), cfg.collective_timeout_ms, net.clock()),
                ),
                coordinator: coordinator.clone(),
                setup: Arc::clone(&setup),
                panic_at_step: spec.panic_at.filter(|(r, _)| *r == rank).map(|(_, s)| s),
                kill_at_step: cfg.kill.iter().find(|k| k.value == rank).map(|k| k.step),
            };
            let (actor, _) = Actor::spawn_linked(
                None,
                RankActor::<LocalEndpoint>::default(),
                args,
                coordinator.get_cell(),
            )
            .await
            .map_err(|e| ClusterError::Spawn(e.to_string()))?;
            ranks.push((rank, actor));
        }
        Ok(Cluster {
            coordinator,
            ranks,
            events,
            net,
            map,
            resume_reads: restored.map(|r| r.per_rank).unwrap_or_default(),
            fit,
            activations,
            _tier_lock: tier_lock,
        })
    }

    /// The coordinator actor, for the control handle.
    pub(crate) fn coordinator(&self) -> &ActorRef<CoordMsg<LocalEndpoint>> {
        &self.coordinator
    }

    pub fn shard_map(&self) -> &ShardMap {
        &self.map
    }

    /// What the in-process network has done so far (all zero unless faults were injected).
    pub fn net_counts(&self) -> NetCounts {
        self.net.counts()
    }

    /// Where the ranks' state was placed (RAM or the tier) and the memory that needs.
    pub fn memory_plan(&self) -> &Fit {
        &self.fit
    }

    /// Whether blocks keep their activations, and what either choice costs a rank.
    pub fn activation_plan(&self) -> &ActivationChoice {
        &self.activations
    }

    /// On a resume: the bytes each rank read from the saved state (empty otherwise).
    pub fn resume_reads(&self) -> &[(RankId, u64)] {
        &self.resume_reads
    }

    /// Starts the first step.
    pub fn run(&self) {
        let _ = self.coordinator.cast(CoordMsg::Start {
            ranks: self.ranks.clone(),
        });
    }

    /// The next event, or `None` once the coordinator is gone.
    pub async fn next_event(&mut self) -> Option<ClusterEvent> {
        self.events.recv().await
    }

    /// The shard map in force and the state of every chunk, gathered from its owner, in (unit,
    /// index) order. Call it between steps (after `Finished`).
    pub async fn collect_chunks(&self) -> Result<(ShardMap, Vec<ChunkState>), ClusterError> {
        self.gather_from_ranks(CoordMsg::Collect, 120).await
    }

    /// Asks the coordinator for something it gathers from the ranks; its failure, a silent
    /// coordinator and a missed deadline are all `ClusterError::Collect`.
    async fn gather_from_ranks<R: Send + 'static>(
        &self,
        msg: impl FnOnce(ractor::RpcReplyPort<Result<R, String>>) -> CoordMsg<LocalEndpoint>,
        deadline_s: u64,
    ) -> Result<R, ClusterError> {
        match self
            .coordinator
            .call(msg, Some(std::time::Duration::from_secs(deadline_s)))
            .await
        {
            Ok(ractor::rpc::CallResult::Success(r)) => r.map_err(ClusterError::Collect),
            Ok(_) => Err(ClusterError::Collect(
                "the coordinator did not answer".into(),
            )),
            Err(e) => Err(ClusterError::Collect(e.to_string())),
        }
    }

    /// Consolidated full parameters per unit.
    pub async fn collect_params(&self) -> Result<Vec<Vec<f32>>, ClusterError> {
        let (map, chunks) = self.collect_chunks().await?;
        Ok(consolidate(&map, &chunks))
    }

    /// The parameters' `param-sha256`, read from their owners in bounded pieces (nothing is
    /// consolidated). Call it between steps.
    pub async fn param_digest(&self) -> Result<String, ClusterError> {
        self.gather_from_ranks(CoordMsg::Digest, 600).await
    }

    /// The outcome of a run that finished: consolidated parameters when the state is in RAM;
    /// with state on the tier only the digest, read piece by piece, so that the end of the run
    /// stays within the memory the planner allowed.
    pub(crate) async fn outcome(
        &self,
        records: Vec<StepRecord>,
    ) -> Result<TrainOutcome, ClusterError> {
        let (params, param_sha256) = if self.fit.placement.any_nvme() {
            (Vec::new(), self.param_digest().await?)
        } else {
            let params = self.collect_params().await?;
            let sha = crate::param_digest::param_sha256(params.iter().map(Vec::as_slice));
            (params, sha)
        };
        Ok(TrainOutcome {
            records,
            params,
            param_sha256,
            resume_reads: self.resume_reads.clone(),
            net: self.net_counts(),
        })
    }

    /// Asks for a membership change at the next step boundary (refused with a reason if it
    /// names an unknown rank or leaves the world outside its bounds; nothing changes then).
    pub async fn request(&self, change: Change) -> Result<(), ClusterError> {
        match self
            .coordinator
            .call(
                |p| CoordMsg::Request(change, p),
                Some(std::time::Duration::from_secs(10)),
            )
            .await
        {
            Ok(ractor::rpc::CallResult::Success(r)) => r.map_err(ClusterError::Refused),
            Ok(_) => Err(ClusterError::Unavailable("no answer within 10 s".into())),
            Err(e) => Err(ClusterError::Unavailable(e.to_string())),
        }
    }

    /// Stops every actor and closes the network. Waits (bounded) for the ranks to exit, so
    /// that their state is dropped when this returns: their tier files removed and the
    /// `nvme_dir` free for the next run.
    pub async fn shutdown(self) {
        self.net.close();
        self.coordinator
            .stop_children_and_wait(None, Some(std::time::Duration::from_secs(5)))
            .await;
        let _ = self
            .coordinator
            .stop_and_wait(None, Some(std::time::Duration::from_secs(5)))
            .await;
    }
}

/// The config's `leave` and `join` entries as the coordinator's script (kills are faults the
/// runtime injects, not membership requests).
pub fn membership_script(cfg: &TrainConfig) -> Vec<ScriptedChange> {
    let mut script: Vec<ScriptedChange> = cfg
        .leave
        .iter()
        .map(|a| ScriptedChange {
            step: a.step,
            change: Change::Leave(a.value),
        })
        .chain(cfg.join.iter().map(|a| ScriptedChange {
            step: a.step,
            change: Change::Join(a.value),
        }))
        .collect();
    script.sort_by_key(|c| c.step);
    script
}

/// Receives a run's events as `train` drives it.
pub trait Observer {
    fn on_step(&mut self, _record: &StepRecord) {}
    /// A snapshot taken at a step boundary (training has moved on; it is yours to keep).
    fn on_snapshot(&mut self, _snapshot: Snapshot) {}
    /// The membership changed and the shards were rebalanced in place.
    fn on_membership(&mut self, _record: &MembershipRecord) {}
    /// The same change with the bytes it moved (`ElasticJob::drive` calls this one).
    fn on_change(&mut self, change: &super::status::ChangeRecord) {
        self.on_membership(&change.record)
    }
    /// A snapshot an operator asked for (`ControlHandle::request_snapshot`): keep it.
    fn on_requested_snapshot(&mut self, snapshot: Snapshot) {
        self.on_snapshot(snapshot)
    }
    /// A snapshot (due or requested) was streamed into `ClusterSpec::snapshot_sink` before
    /// training went on; `saved` is the sink's outcome.
    fn on_snapshot_streamed(&mut self, _step: u64, _saved: &Result<(), String>) {}
    /// A joiner did not come up (no standby worker, or it failed while starting); the change
    /// went on without it.
    fn on_join_failed(&mut self, _rank: RankId, _reason: &str) {}
}

/// Ignores every event.
impl Observer for () {}

impl<F: FnMut(&StepRecord)> Observer for F {
    fn on_step(&mut self, record: &StepRecord) {
        self(record)
    }
}

/// Runs a whole job: starts the cluster, feeds every event to `observer`, and returns the
/// records and consolidated parameters, or the reason the run stopped.
pub async fn train(
    spec: ClusterSpec,
    observer: impl Observer,
) -> Result<TrainOutcome, ClusterError> {
    drive(Cluster::start(spec).await?, observer).await
}

/// Runs a started cluster's whole job (see [`train`]); for callers that need the cluster
/// started, and its saved state read, before they commit to anything else.
pub async fn drive(
    mut cluster: Cluster,
    mut observer: impl Observer,
) -> Result<TrainOutcome, ClusterError> {
    cluster.run();
    let mut records = Vec::new();
    let result = loop {
        match cluster.next_event().await {
            Some(ClusterEvent::Step(rec)) => {
                observer.on_step(&rec);
                records.push(*rec);
            }
            Some(ClusterEvent::Snapshot(snap)) => observer.on_snapshot(*snap),
            Some(ClusterEvent::SnapshotStreamed { step, saved }) => {
                observer.on_snapshot_streamed(step, &saved)
            }
            Some(ClusterEvent::Membership(rec)) => observer.on_membership(&rec),
            Some(ClusterEvent::JoinFailed { rank, reason }) => {
                observer.on_join_failed(rank, &reason)
            }
            Some(ClusterEvent::Finished) => break Ok(()),
            Some(ClusterEvent::Aborted(reason)) => break Err(ClusterError::Aborted(reason)),
            None => break Err(ClusterError::Aborted("the coordinator stopped".into())),
        }
    };
    let outcome = match result {
        Ok(()) => cluster.outcome(records).await,
        Err(e) => Err(e),
    };
    cluster.shutdown().await;
    outcome
}

/// Full parameters per unit from every chunk's state.
pub fn consolidate(map: &ShardMap, chunks: &[ChunkState]) -> Vec<Vec<f32>> {
    let mut out: Vec<Vec<f32>> = map.units.iter().map(|u| vec![0f32; u.numel]).collect();
    for c in chunks {
        let r = map.chunk_range(c.unit as usize, c.index as usize);
        out[c.unit as usize][r].copy_from_slice(&c.params);
    }
    out
}

/// A weight source that counts each unit a rank reads, for the progress line.
struct CountedWeights {
    inner: Arc<dyn WeightSource>,
    progress: Arc<RunProgress>,
}

impl WeightSource for CountedWeights {
    fn read(&self, unit: usize, ranges: &[Range<usize>]) -> Result<Vec<Vec<f32>>, String> {
        let read = self.inner.read(unit, ranges);
        self.progress.init_unit_built();
        read
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}
