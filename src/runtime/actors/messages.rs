//! What the coordinator and rank actors send each other. The two message types refer to each
//! other (a rank holds its coordinator's address and the coordinator its ranks'), so they live
//! together here, below both actors.

use ractor::{ActorRef, RpcReplyPort};

use crate::engine::coordinator::{Change, Refusal};
use crate::engine::messages::{StepPlan, StepReport};
use crate::plan::{RankId, ShardMap};
use crate::runtime::step::comm::CommError;
use crate::runtime::step::exec::work::Work;
use crate::runtime::step::state::rank_state::ChunkState;
use crate::runtime::transport::Transport;

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
    ReshardDone {
        rank: RankId,
        epoch: u64,
    },
    /// Alive and idle, but the step or round did not finish (a peer vanished or it was
    /// interrupted).
    StepAborted {
        rank: RankId,
        reason: String,
    },
    ReplicateDone {
        rank: RankId,
        epoch: u64,
        step: u64,
    },
    Tick,
    /// From now on, snapshots stream into this sink instead of being collected whole (the
    /// runtime sends it when state lives on the tier).
    StreamSnapshots(std::sync::Arc<dyn crate::runtime::step::elastic::snapshot::SnapshotSink>),
    /// A rank finished a unit within (epoch, step) (worker processes; the coordinator reads
    /// in-process ranks' beats itself).
    Progress {
        rank: RankId,
        epoch: u64,
        step: u64,
    },
    /// Take a snapshot at the next step boundary.
    SnapshotNow,
    /// An operator's membership change, applied at the next step boundary or refused.
    Request(Change, RpcReplyPort<Result<(), Refusal>>),
    /// Fault injection for tests and demos: the rank vanishes halfway through the next step
    /// that starts (as `--kill` does), or the request is refused.
    Kill(RankId, RpcReplyPort<Result<(), Refusal>>),
    /// Where the run stands, for the control API.
    View(RpcReplyPort<CoordView>),
    /// Every chunk's state and the map (between steps, e.g. after `Finished`).
    Collect(RpcReplyPort<Result<(ShardMap, Vec<ChunkState>), String>>),
    /// The `param-sha256` of the parameters, read from their owners one bounded piece at a
    /// time (between steps); nothing is consolidated.
    Digest(RpcReplyPort<Result<String, String>>),
    /// A joiner the factory answered `NewRank::Later` for: its actor (linked to this one), or
    /// why it could not start.
    Joined {
        rank: RankId,
        started: Result<ActorRef<RankMsg<T>>, String>,
        /// Where it runs, when known.
        host: Option<String>,
    },
}

pub enum RankMsg<T: Transport> {
    RunStep(Box<StepPlan>),
    StepFinished(Box<Work<T>>, Result<Box<StepReport>, CommError>),
    /// Move chunks from `old` to `new` (the rank may be leaving, staying or joining).
    Reshard {
        old: Box<ShardMap>,
        new: Box<ShardMap>,
        step: u64,
    },
    ReshardFinished(Box<Work<T>>, Result<u64, CommError>),
    /// Roll back to the backup taken under `old`, without the `lost` ranks, onto `new`.
    Restore {
        old: Box<ShardMap>,
        new: Box<ShardMap>,
        step: u64,
        lost: Vec<RankId>,
    },
    /// Take a backup before step `step` (local copy plus replicas with the buddy).
    Replicate {
        step: u64,
    },
    ReplicateFinished(Box<Work<T>>, Result<(u64, u64), CommError>),
    ComputePanicked(String),
    /// Fault injection from the control API: vanish halfway through step `.0`.
    KillAt(u64),
    /// The state of every chunk this rank owns (consolidation, checkpoints).
    Collect(RpcReplyPort<Vec<ChunkState>>),
    /// The state of chunks `chunks` (ascending indices) of unit `unit`, all owned by this rank;
    /// with `params_only`, without optimizer state: streamed snapshots and the end-of-run
    /// digest read state on the tier piece by piece. In-process ranks only.
    OwnedChunks {
        unit: usize,
        chunks: Vec<usize>,
        params_only: bool,
        reply: RpcReplyPort<Result<Vec<ChunkState>, String>>,
    },
}

/// The coordinator's view of the run at one instant (see `control::Status`).
#[derive(Clone, Debug)]
pub struct CoordView {
    pub map: ShardMap,
    /// The next step to run.
    pub step: u64,
    pub steps: u64,
    pub min_ranks: u32,
    pub max_ranks: u32,
    pub finished: bool,
    /// The step before which the newest complete buddy backup was taken.
    pub backup_step: Option<u64>,
    pub pending_kills: Vec<RankId>,
    /// What the ranks were last told to do.
    pub activity: Activity,
    /// Ranks that were told and have not answered yet (sorted).
    pub awaiting: Vec<RankId>,
}

/// What the ranks were last told to do, as the coordinator actor sent it. A rank listed in
/// `CoordView::awaiting` has not answered, so the activity cannot end before it does (or
/// fails): an operator, or a test, can tell a loss inside a step from one between steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "phase", rename_all = "snake_case")]
pub enum Activity {
    #[default]
    Starting,
    /// Training step `step`.
    Running {
        step: u64,
    },
    /// Taking the buddy backup before step `step`.
    Replicating {
        step: u64,
    },
    /// Moving chunks for a membership change before step `step`.
    Resharding {
        step: u64,
    },
    /// Rolling back to the backup before step `step` after a loss.
    Restoring {
        step: u64,
    },
    Finished,
    Failed,
}
