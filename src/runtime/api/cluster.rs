//! Starting a cluster of in-process rank actors from Rust code, and driving it to the end.
//!
//! This is the library entry point for programs that embed the runtime: give it a validated
//! config, a model (any `Model`, including one defined outside this crate) and a dataset; get
//! back an event stream of finished steps and, at the end, the consolidated parameters.

use std::ops::Range;
use std::sync::Arc;

use ractor::{Actor, ActorRef};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::notice::Notice;
use crate::config::{ConfigError, Faults, TrainConfig};
use crate::data::Dataset;
use crate::engine::coordinator::{Change, Coordinator, MembershipRecord, Refusal, StepRecord};
use crate::job::run_plan::{RunPlan, StoragePlan};
use crate::job::{build_dataset, build_model};
use crate::model::weights::{ModelInit, WeightSource};
use crate::model::Model;
use crate::plan::activations::ActivationChoice;
use crate::plan::device::DevicePlan;
use crate::plan::tier::Fit;
use crate::plan::{ChunkId, RankId, ShardMap};
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
use crate::runtime::step::elastic::resume::{read_owned_chunks, Restored, ResumeSource};
use crate::runtime::step::elastic::snapshot::SnapshotSink;
use crate::runtime::step::exec::ExecConfig;
use crate::runtime::step::progress::RunProgress;
use crate::runtime::step::state::rank_state::{ChunkState, RankState, StartFrom};
use crate::runtime::storage::{DirLock, TierSpec};
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
    /// Whether the run ends by gathering the consolidated parameters into
    /// [`TrainOutcome::params`] (a copy of every chunk's state in this process). Without it
    /// the run ends with only the digest, read from the owners a bounded piece at a time,
    /// so a model whose state fills the memory ends within it. State on the tier is never
    /// gathered.
    pub keep_params: bool,
}

impl ClusterSpec {
    /// The built-in model and dataset the config names, from scratch.
    pub fn from_config(config: TrainConfig) -> Result<Self, ConfigError> {
        Ok(Self::new(
            build_model(&config)?,
            build_dataset(&config)?,
            config,
        ))
    }

    /// Your own model and data, from the model's initialisation, no snapshots; set the other
    /// fields to change that (faults are the config's).
    pub fn new(model: Arc<dyn Model>, data: Arc<Dataset>, config: TrainConfig) -> Self {
        Self {
            config,
            model,
            data,
            init: None,
            resume: None,
            snapshot_every: 0,
            boundary_snapshot: None,
            progress: Arc::default(),
            snapshot_sink: None,
            clock: SystemClock::shared(),
            net_trace: None,
            keep_params: true,
        }
    }
}

/// The result of a finished run.
pub struct TrainOutcome {
    pub records: Vec<StepRecord>,
    /// Consolidated fp32 parameters per unit; empty when the planner put state on the tier
    /// (the model may not fit in memory) or the spec did not ask to keep them
    /// ([`ClusterSpec::keep_params`]), so use `param_sha256` to compare runs.
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
    device: Option<DevicePlan>,
    /// [`ClusterSpec::keep_params`].
    keep_params: bool,
    /// Held while the run uses its tier directory.
    _tier_lock: Option<DirLock>,
}

impl Cluster {
    /// Plans the shard map, builds every rank's state and starts the actors (not the run).
    pub async fn start(spec: ClusterSpec) -> Result<Cluster, ClusterError> {
        let cfg = &spec.config;
        cfg.validate()?;
        let plan = RunPlan::new(cfg, spec.snapshot_every)?;
        // The memory check first: a model that cannot fit is refused before its chunks are
        // planned (billions of them for tens of trillions of parameters).
        let available = available_memory_bytes().unwrap_or(u64::MAX / 2);
        let streamed = spec.snapshot_sink.is_some();
        let ranks = u64::from(cfg.ranks);
        let storage = StoragePlan::new(cfg, spec.model.as_ref(), ranks, streamed, available)
            .map_err(|e| ClusterError::Memory(e.to_string()))?;
        let (tier, tier_lock) = match &storage.tier {
            Some(t) => {
                let (tier, lock) =
                    TierSpec::for_plan(t).map_err(|e| ClusterError::Memory(e.to_string()))?;
                (Some(Arc::new(tier)), Some(lock))
            }
            None => (None, None),
        };
        let numels: Vec<usize> = spec.model.units().iter().map(|u| u.numel()).collect();
        let members: Vec<RankId> = (0..cfg.ranks).collect();
        let epoch = spec
            .resume
            .as_ref()
            .map_or(1, |src| src.saved_map().epoch + 1);
        let map = ShardMap::plan(&numels, &members, cfg.chunk_elems, epoch)
            .map_err(|e| ClusterError::Spawn(e.to_string()))?;
        let restored = read_resume(spec.resume.as_ref(), &map, &numels).await?;
        spec.progress.init_started(ranks * numels.len() as u64);
        let net = LocalNetwork::on_clock(
            Some(net_faults(&plan.faults, plan.seed)),
            Arc::clone(&spec.clock),
            spec.net_trace.clone(),
        );
        let eval = crate::job::build_eval_dataset(cfg)?;
        let setup = rank_setup(&spec, &plan, &storage, tier.clone(), &net, eval);
        let (tx, events) = unbounded_channel();
        let args = coord_args(&spec, &plan, map.clone(), &setup, &net, tx);
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
        if let Some(sink) = spec.snapshot_sink.as_ref().filter(|_| tier.is_some()) {
            let _ = coordinator.cast(CoordMsg::StreamSnapshots(Arc::clone(sink)));
        }
        let start = RankStart {
            spec: &spec,
            plan: &plan,
            map: &map,
            setup: &setup,
            net: &net,
            coordinator: &coordinator,
            tier: tier.as_deref(),
        };
        let mut ranks = Vec::new();
        for &rank in &members {
            ranks.push((rank, start.spawn(rank, restored.as_ref()).await?));
        }
        Ok(Cluster {
            coordinator,
            ranks,
            events,
            net,
            map,
            resume_reads: restored.map(|r| r.per_rank).unwrap_or_default(),
            fit: storage.fit,
            activations: storage.activations,
            device: storage.device,
            keep_params: spec.keep_params,
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

    /// What lives on each rank's device and what a step moves, with a device.
    pub fn device_plan(&self) -> Option<&DevicePlan> {
        self.device.as_ref()
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

    /// The outcome of a run that finished: consolidated parameters when the state is in RAM
    /// and the spec keeps them; otherwise only the digest, read piece by piece, so that the end
    /// of the run stays within the memory the planner allowed.
    pub(crate) async fn outcome(
        &self,
        records: Vec<StepRecord>,
    ) -> Result<TrainOutcome, ClusterError> {
        let (params, param_sha256) = if self.fit.placement.any_nvme() || !self.keep_params {
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

/// On a resume: the chunks every rank owns under `map`, read from the saved state on a blocking
/// thread; refused if the state belongs to another model.
async fn read_resume(
    resume: Option<&Arc<dyn ResumeSource>>,
    map: &ShardMap,
    numels: &[usize],
) -> Result<Option<Restored>, ClusterError> {
    let Some(src) = resume else {
        return Ok(None);
    };
    let old: Vec<usize> = src.saved_map().units.iter().map(|u| u.numel).collect();
    if old != numels {
        return Err(ClusterError::Resume(format!(
            "{}: its units have sizes {old:?}, this model's are {numels:?}: it belongs to another model",
            src.describe()
        )));
    }
    let (src, map) = (Arc::clone(src), map.clone());
    let read = tokio::task::spawn_blocking(move || read_owned_chunks(&*src, &map));
    let read = read
        .await
        .map_err(|e| ClusterError::Resume(format!("a resume reader thread failed: {e}")))?;
    read.map(Some).map_err(ClusterError::Resume)
}

/// The fault keys of the plan as the in-process network's faults.
fn net_faults(f: &Faults, seed: u64) -> NetFaults {
    NetFaults {
        seed,
        duplicate_per_mille: f.net_duplicate_per_mille,
        reorder_per_mille: f.net_reorder_per_mille,
        drop_per_mille: f.net_drop_per_mille,
        corrupt_per_mille: f.net_corrupt_per_mille,
        delay_max_ms: f.net_delay_max_ms,
        retransmit_ms: f.net_retransmit_ms,
        slow_rank: f.net_slow_rank,
        slow_ms: f.net_slow_ms,
        partition: Partition::new(
            &f.net_partition_ranks,
            f.net_partition_from_frame,
            f.net_partition_frames,
            f.net_partition_ms,
        ),
    }
}

/// What every rank actor of the run shares.
fn rank_setup(
    spec: &ClusterSpec,
    plan: &RunPlan,
    storage: &StoragePlan,
    tier: Option<Arc<TierSpec>>,
    net: &Arc<LocalNetwork>,
    eval: Option<Arc<Dataset>>,
) -> Arc<RankSetup> {
    let net = Arc::clone(net);
    Arc::new(RankSetup {
        stage: plan.stage,
        mode: plan.reduce,
        model: Arc::clone(&spec.model),
        optim: plan.optim,
        data: Arc::clone(&spec.data),
        exec: ExecConfig {
            eval_data: eval,
            ..ExecConfig::new(
                &plan.exec,
                storage.activations.keep,
                storage.device_buffers(),
                Arc::clone(&spec.progress),
            )
        },
        storage: tier,
        disconnect: Box::new(move |r| net.kill(r)),
    })
}

/// The coordinator actor's arguments: the engine (fresh or resumed), the network's hooks and
/// the factory that brings joiners up on it.
fn coord_args(
    spec: &ClusterSpec,
    plan: &RunPlan,
    map: ShardMap,
    setup: &Arc<RankSetup>,
    net: &Arc<LocalNetwork>,
    events: UnboundedSender<ClusterEvent>,
) -> CoordArgs<LocalEndpoint> {
    let (abort_net, retire_net, join_net, interrupt_net) = (
        Arc::clone(net),
        Arc::clone(net),
        Arc::clone(net),
        Arc::clone(net),
    );
    let (join_setup, timeout_ms, joiners) =
        (Arc::clone(setup), plan.collective_timeout_ms, plan.clone());
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
            kill_at_step: joiners.kill_step(rank),
        })))
    });
    let job = plan.job.clone();
    let progress = Arc::clone(&spec.progress);
    CoordArgs {
        engine: match &spec.resume {
            Some(src) => Coordinator::resume(job, map, src.progress().clone()),
            None => Coordinator::new(job, map),
        },
        events,
        clock: Arc::clone(&spec.clock),
        // A simulated clock ticks the coordinator itself (`Cluster::start`), at times that
        // replay.
        tick_ms: if spec.clock.simulated() {
            SIMULATED_WALL_TICK_MS
        } else {
            TICK_MS
        },
        on_abort: Box::new(move || abort_net.close()),
        on_retire: Box::new(move |r, _| {
            retire_net.kill(r);
            progress.forget(r);
        }),
        on_interrupt: Box::new(move |r, epoch, step| interrupt_net.interrupt(r, epoch, step)),
        factory,
        // The test hook rides on the boundary snapshot the signal asks for.
        boundary_snapshot: spec.boundary_snapshot.clone().map(|b| BoundarySnapshot {
            raise_sigterm_at: plan.faults.raise_sigterm_at,
            ..b
        }),
        progress: Some(Arc::clone(&spec.progress)),
        committer: None,
    }
}

/// What starting each of the run's first ranks needs.
struct RankStart<'a> {
    spec: &'a ClusterSpec,
    plan: &'a RunPlan,
    map: &'a ShardMap,
    setup: &'a Arc<RankSetup>,
    net: &'a Arc<LocalNetwork>,
    coordinator: &'a ActorRef<CoordMsg<LocalEndpoint>>,
    tier: Option<&'a TierSpec>,
}

impl RankStart<'_> {
    /// Builds `rank`'s state (restored, given weights, or the model's initialisation made unit
    /// by unit, so the whole model is never in RAM at once) and spawns its actor.
    async fn spawn(
        &self,
        rank: RankId,
        restored: Option<&Restored>,
    ) -> Result<ActorRef<RankMsg<LocalEndpoint>>, ClusterError> {
        let spec = self.spec;
        let weights = CountedWeights {
            inner: spec.init.clone().unwrap_or_else(|| {
                Arc::new(ModelInit {
                    model: Arc::clone(&spec.model),
                    seed: self.plan.seed,
                })
            }),
            progress: Arc::clone(&spec.progress),
        };
        let source = |u: usize, i: usize| {
            let id = ChunkId {
                unit: u as u32,
                index: i as u32,
            };
            restored.and_then(|r| r.chunks.get(&id).cloned())
        };
        let from = match restored {
            Some(_) => StartFrom::Chunks(&source),
            None => StartFrom::Weights(&weights),
        };
        let state = RankState::start(rank, self.plan, &spec.model, self.map, self.tier, from)
            .map_err(|e| ClusterError::Spawn(format!("rank {rank}: {e}")))?;
        let args = RankArgs {
            rank,
            work: Work::new(
                Some(state),
                Comm::on_clock(
                    self.net.endpoint(rank),
                    self.plan.collective_timeout_ms,
                    self.net.clock(),
                ),
            ),
            coordinator: self.coordinator.clone(),
            setup: Arc::clone(self.setup),
            panic_at_step: self.plan.panic_step(rank),
            kill_at_step: self.plan.kill_step(rank),
        };
        let (actor, _) = Actor::spawn_linked(
            None,
            RankActor::<LocalEndpoint>::default(),
            args,
            self.coordinator.get_cell(),
        )
        .await
        .map_err(|e| ClusterError::Spawn(e.to_string()))?;
        Ok(actor)
    }
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
    /// A worker process was given notice (SIGTERM) and asked to leave: `granted` is the drain
    /// at the next step boundary, or why it was refused.
    fn on_notice(&mut self, _notice: &Notice, _granted: &Result<(), String>) {}
    /// The job should stop (a notice the job cannot grant without falling below `min_ranks`):
    /// answer true to stop at the next step boundary yourself (after saving a checkpoint), or
    /// false to have the runtime stop it now.
    fn stop_at_boundary(&mut self, _why: &str) -> bool {
        false
    }
    /// Polled after every event: `Some(why)` stops the job there (a signal, a stop after the
    /// checkpoint `stop_at_boundary` promised).
    fn stop_requested(&mut self) -> Option<String> {
        None
    }
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
            Some(ClusterEvent::Aborted(reason) | ClusterEvent::Deposed(reason)) => {
                break Err(ClusterError::Aborted(reason))
            }
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
