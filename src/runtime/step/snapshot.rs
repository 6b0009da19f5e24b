//! Every chunk's state at a step boundary: what checkpoints save and a run resumes from.

use super::rank_state::ChunkState;
use crate::engine::coordinator::Progress;
use crate::plan::ShardMap;

/// Every chunk's state at a step boundary, with the progress needed to resume from it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Snapshot {
    pub progress: Progress,
    pub map: ShardMap,
    /// One entry per chunk, in (unit, index) order.
    pub chunks: Vec<ChunkState>,
}
