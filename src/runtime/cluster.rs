//! Starting a cluster of in-process rank actors from Rust code, and driving it to the end.
//!
//! This is the library entry point for programs that embed the runtime: give it a validated
//! config, a model (any `Model`, including one defined outside this crate) and a dataset; get
//! back an event stream of finished steps and, at the end, the consolidated parameters.

use std::collections::BTreeMap;
use std::sync::Arc;

use ractor::{Actor, ActorRef};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::actors::{
    ClusterEvent, CoordArgs, CoordMsg, CoordinatorActor, RankActor, RankArgs, RankMsg, Work,
};
use super::clock::SystemClock;
use super::comm::Comm;
use super::local::{LocalEndpoint, LocalNetwork};
use super::rank_state::{OptimSettings, RankState};
use super::step::ExecConfig;
use crate::config::{OptimizerChoice, TrainConfig};
use crate::data::Dataset;
use crate::engine::coordinator::{Coordinator, JobSpec, StepRecord};
use crate::model::Model;
use crate::optim::{AdamHyper, LrSchedule, OptimizerKind};
use crate::plan::{RankId, ShardMap, Stage};

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
}

/// Everything needed to start a cluster.
pub struct ClusterSpec {
    pub config: TrainConfig,
    pub model: Arc<dyn Model>,
    pub data: Arc<Dataset>,
    /// Start from these full parameters instead of the model's initialisation.
    pub init_params: Option<Vec<Vec<f32>>>,
    /// Fault injection for tests: (rank, step) whose compute panics.
    pub panic_at: Option<(RankId, u64)>,
}

/// The result of a finished run.
pub struct TrainOutcome {
    pub records: Vec<StepRecord>,
    /// Consolidated fp32 parameters per unit.
    pub params: Vec<Vec<f32>>,
}

/// A running cluster of rank actors and a coordinator on the in-process transport.
pub struct Cluster {
    coordinator: ActorRef<CoordMsg<LocalEndpoint>>,
    ranks: Vec<(RankId, ActorRef<RankMsg<LocalEndpoint>>)>,
    events: UnboundedReceiver<ClusterEvent>,
    net: Arc<LocalNetwork>,
    map: ShardMap,
}

/// Optimizer settings from a config.
pub fn optim_settings(cfg: &TrainConfig) -> OptimSettings {
    let kind = match cfg.optimizer {
        OptimizerChoice::Adamw => OptimizerKind::AdamW,
        OptimizerChoice::Adam => OptimizerKind::Adam,
        OptimizerChoice::Sgd => OptimizerKind::Sgd {
            momentum: cfg.momentum as f64,
            nesterov: false,
        },
    };
    let hyper = AdamHyper {
        lr: cfg.lr,
        beta1: cfg.beta1 as f64,
        beta2: cfg.beta2 as f64,
        eps: cfg.eps as f64,
        weight_decay: cfg.weight_decay as f64,
        decoupled: kind == OptimizerKind::AdamW,
    };
    OptimSettings {
        kind,
        hyper,
        threads: cfg.optimizer_threads,
    }
}

/// The learning-rate schedule of a config.
pub fn lr_schedule(cfg: &TrainConfig) -> LrSchedule {
    LrSchedule {
        base_lr: cfg.lr,
        warmup_steps: cfg.warmup_steps,
        total_steps: if cfg.min_lr_ratio >= 1.0 {
            0
        } else {
            cfg.steps
        },
        min_lr_ratio: cfg.min_lr_ratio as f64,
    }
}

/// Per-step execution settings of a config.
pub fn exec_config(cfg: &TrainConfig) -> ExecConfig {
    ExecConfig {
        micro_batch_size: cfg.micro_batch_size,
        seq_len: cfg.seq_len,
        seed: cfg.seed,
        max_live_units: cfg.max_live_units,
        grad_clip: cfg.grad_clip as f64,
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
        let map = ShardMap::plan(&numels, &members, cfg.chunk_elems, 1)
            .map_err(|e| ClusterError::Spawn(e.to_string()))?;
        let params: Vec<Vec<f32>> = match &spec.init_params {
            Some(p) => p.clone(),
            None => (0..units.len())
                .map(|u| spec.model.init_unit(u, cfg.seed))
                .collect(),
        };
        let net = LocalNetwork::new();
        let (tx, events) = unbounded_channel();
        let job = JobSpec {
            steps: cfg.steps,
            micro_batches: cfg.micro_batches,
            lr: lr_schedule(cfg),
            step_timeout_ms: cfg.collective_timeout_ms.saturating_mul(4),
            initial_grad_bound: cfg.initial_grad_bound,
        };
        let abort_net = Arc::clone(&net);
        let args = CoordArgs {
            engine: Coordinator::new(job, map.clone()),
            events: tx,
            clock: Arc::new(SystemClock::default()),
            tick_ms: 200,
            on_abort: Box::new(move || abort_net.close()),
        };
        let (coordinator, _) =
            Actor::spawn(None, CoordinatorActor::<LocalEndpoint>::default(), args)
                .await
                .map_err(|e| ClusterError::Spawn(e.to_string()))?;
        let optim = optim_settings(cfg);
        let mut ranks = Vec::new();
        for &rank in &members {
            let state = RankState::from_full_params(
                rank,
                stage,
                cfg.reduce,
                Arc::clone(&spec.model),
                map.clone(),
                optim,
                &params,
            );
            let work = Work {
                state,
                comm: Comm::new(net.endpoint(rank), cfg.collective_timeout_ms),
            };
            let args = RankArgs {
                work,
                coordinator: coordinator.clone(),
                data: Arc::clone(&spec.data),
                exec: exec_config(cfg),
                panic_at_step: spec.panic_at.filter(|(r, _)| *r == rank).map(|(_, s)| s),
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
        })
    }

    pub fn shard_map(&self) -> &ShardMap {
        &self.map
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

    /// Gathers every rank's owned master chunks into full parameters per unit, checking that
    /// every chunk arrives exactly once.
    pub async fn collect_params(&self) -> Result<Vec<Vec<f32>>, ClusterError> {
        let mut out: Vec<Vec<f32>> = self.map.units.iter().map(|u| vec![0f32; u.numel]).collect();
        let mut seen = BTreeMap::new();
        for (rank, actor) in &self.ranks {
            let chunks = actor
                .call(RankMsg::Collect, Some(std::time::Duration::from_secs(60)))
                .await
                .map_err(|e| ClusterError::Collect(format!("rank {rank}: {e}")))?;
            let ractor::rpc::CallResult::Success(chunks) = chunks else {
                return Err(ClusterError::Collect(format!("rank {rank} did not answer")));
            };
            for (u, i, vals) in chunks {
                let r = self.map.chunk_range(u, i);
                if vals.len() != r.len() || seen.insert((u, i), *rank).is_some() {
                    return Err(ClusterError::Collect(format!(
                        "chunk {u}/{i} from rank {rank} is wrong or repeated"
                    )));
                }
                out[u][r].copy_from_slice(&vals);
            }
        }
        let total: usize = self.map.units.iter().map(|u| u.owners.len()).sum();
        if seen.len() != total {
            return Err(ClusterError::Collect(format!(
                "{} of {total} chunks arrived",
                seen.len()
            )));
        }
        Ok(out)
    }

    /// Stops every actor and closes the network.
    pub async fn shutdown(self) {
        self.net.close();
        for (_, a) in &self.ranks {
            a.stop(None);
        }
        let _ = self
            .coordinator
            .stop_and_wait(None, Some(std::time::Duration::from_secs(5)))
            .await;
    }
}

/// Runs a whole job: starts the cluster, feeds every finished step to `on_step`, and returns
/// the records and consolidated parameters, or the reason the run stopped.
pub async fn train(
    spec: ClusterSpec,
    mut on_step: impl FnMut(&StepRecord),
) -> Result<TrainOutcome, ClusterError> {
    let mut cluster = Cluster::start(spec).await?;
    cluster.run();
    let mut records = Vec::new();
    let result = loop {
        match cluster.next_event().await {
            Some(ClusterEvent::Step(rec)) => {
                on_step(&rec);
                records.push(*rec);
            }
            Some(ClusterEvent::Finished) => break Ok(()),
            Some(ClusterEvent::Aborted(reason)) => break Err(ClusterError::Aborted(reason)),
            None => break Err(ClusterError::Aborted("the coordinator stopped".into())),
        }
    };
    let outcome = match result {
        Ok(()) => cluster
            .collect_params()
            .await
            .map(|params| TrainOutcome { records, params }),
        Err(e) => Err(e),
    };
    cluster.shutdown().await;
    outcome
}
