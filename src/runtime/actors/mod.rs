//! What the actors share: the events a cluster reports, snapshots, and collecting chunk states.
//! The actors themselves live in `rank_actor.rs` and `coord_actor.rs`.

use std::collections::BTreeMap;
use std::time::Duration;

use ractor::ActorRef;

use super::rank_actor::RankMsg;
use super::rank_state::ChunkState;
use super::transport::Transport;
use crate::engine::coordinator::{MembershipRecord, Progress, StepRecord};
use crate::plan::{RankId, ShardMap};

pub use super::coord_actor::{
    BoundarySnapshot, CoordArgs, CoordMsg, CoordinatorActor, NewRank, RankFactory,
};
pub use super::rank_actor::{RankActor, RankArgs, RankSetup, Work};

/// Every chunk's state at a step boundary, with the progress needed to resume from it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Snapshot {
    pub progress: Progress,
    pub map: ShardMap,
    /// One entry per chunk, in (unit, index) order.
    pub chunks: Vec<ChunkState>,
}

/// What the cluster reports to whoever drives it. Embedders match it with a wildcard arm:
/// events may be added.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum ClusterEvent {
    Step(Box<StepRecord>),
    /// Taken at a step boundary; training has already moved on (write it in the background).
    Snapshot(Box<Snapshot>),
    /// The membership changed and the shards were rebalanced in place.
    Membership(Box<MembershipRecord>),
    /// A joiner did not come up; training goes on without it.
    JoinFailed {
        rank: RankId,
        reason: String,
    },
    Finished,
    Aborted(String),
}

/// Asks every rank for the chunks it owns and checks that each chunk arrives exactly once.
pub async fn collect_chunks<T: Transport>(
    ranks: &[(RankId, ActorRef<RankMsg<T>>)],
    map: &ShardMap,
) -> Result<Vec<ChunkState>, String> {
    let mut all = BTreeMap::new();
    for (rank, actor) in ranks.iter().filter(|(r, _)| map.is_member(*r)) {
        let reply = actor
            .call(RankMsg::Collect, Some(Duration::from_secs(60)))
            .await
            .map_err(|e| format!("rank {rank}: {e}"))?;
        let ractor::rpc::CallResult::Success(chunks) = reply else {
            return Err(format!("rank {rank} did not answer"));
        };
        for c in chunks {
            let (u, i) = (c.unit as usize, c.index as usize);
            if u >= map.units.len() || i >= map.units[u].owners.len() {
                return Err(format!("rank {rank} sent unknown chunk {u}/{i}"));
            }
            if c.params.len() != map.chunk_range(u, i).len() || all.insert((u, i), c).is_some() {
                return Err(format!(
                    "chunk {u}/{i} from rank {rank} is wrong or repeated"
                ));
            }
        }
    }
    let total: usize = map.units.iter().map(|u| u.owners.len()).sum();
    if all.len() != total {
        return Err(format!("{} of {total} chunks arrived", all.len()));
    }
    Ok(all.into_values().collect())
}
