//! Every chunk's state at a step boundary: what checkpoints save and a run resumes from.

use crate::engine::coordinator::Progress;
use crate::plan::ShardMap;
use crate::runtime::step::state::rank_state::ChunkState;

/// Every chunk's state at a step boundary, with the progress needed to resume from it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Snapshot {
    pub progress: Progress,
    pub map: ShardMap,
    /// One entry per chunk, in (unit, index) order.
    pub chunks: Vec<ChunkState>,
}

/// Where a snapshot goes when it is streamed instead of collected: with state on the tier, a
/// whole snapshot would not fit in memory, so the coordinator reads it from the owners a
/// bounded piece at a time, while the ranks wait at the step boundary, and hands each piece
/// to a stream opened here (the checkpoint writer implements it).
pub trait SnapshotSink: Send + Sync {
    /// Opens the stream of the snapshot of `progress` under `map`. An error means this save
    /// failed (the sink reports it); training goes on.
    fn begin(&self, progress: &Progress, map: &ShardMap)
        -> Result<Box<dyn SnapshotStream>, String>;
}

/// One streamed snapshot. Its chunks arrive in (unit, index) order, each exactly once, in
/// pieces that come from one owner.
pub trait SnapshotStream: Send {
    /// Takes the next piece. An error ends this save (the stream reports it when dropped).
    fn push(&mut self, owner: crate::plan::RankId, chunks: Vec<ChunkState>) -> Result<(), String>;
    /// Every chunk was pushed: make the snapshot durable. An error means this save failed.
    fn commit(self: Box<Self>) -> Result<(), String>;
}
