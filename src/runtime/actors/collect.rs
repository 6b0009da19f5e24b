//! Collecting every chunk's state from the ranks (snapshots, consolidation, checkpoints).

use std::collections::BTreeMap;
use std::time::Duration;

use ractor::ActorRef;

use super::messages::RankMsg;
use crate::param_digest::ParamDigest;
use crate::plan::{RankId, ShardMap};
use crate::runtime::step::rank_state::ChunkState;
use crate::runtime::transport::Transport;

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

/// Parameters asked for in one request by [`digest_params`]: 16 MiB of fp32, so the digest of
/// any model holds at most this much at a time.
pub const DIGEST_PIECE_ELEMS: usize = 1 << 22;

/// The `param-sha256` of the parameters, read from their owners in canonical order: each run
/// of consecutive chunks with one owner in pieces of at most [`DIGEST_PIECE_ELEMS`].
pub async fn digest_params<T: Transport>(
    ranks: &[(RankId, ActorRef<RankMsg<T>>)],
    map: &ShardMap,
) -> Result<String, String> {
    let mut digest = ParamDigest::new();
    for (u, unit) in map.units.iter().enumerate() {
        let mut i = 0;
        while i < unit.owners.len() {
            let owner = unit.owners[i];
            let mut j = i + 1;
            while j < unit.owners.len() && unit.owners[j] == owner {
                j += 1;
            }
            let run = map.chunk_range(u, i).start..map.chunk_range(u, j - 1).end;
            let actor = ranks
                .iter()
                .find(|(r, _)| *r == owner)
                .map(|(_, a)| a)
                .ok_or_else(|| format!("unit {u}: its owner, rank {owner}, is not running"))?;
            let mut at = run.start;
            while at < run.end {
                let elems = at..(at + DIGEST_PIECE_ELEMS).min(run.end);
                let want = elems.len();
                let reply = actor
                    .call(
                        |reply| RankMsg::UnitParams {
                            unit: u,
                            elems: elems.clone(),
                            reply,
                        },
                        Some(Duration::from_secs(60)),
                    )
                    .await
                    .map_err(|e| format!("rank {owner}: {e}"))?;
                let ractor::rpc::CallResult::Success(piece) = reply else {
                    return Err(format!("rank {owner} did not answer"));
                };
                let piece = piece.map_err(|e| format!("rank {owner}: {e}"))?;
                if piece.len() != want {
                    return Err(format!(
                        "rank {owner} sent {} parameters of unit {u} for {want}",
                        piece.len()
                    ));
                }
                digest.update(&piece);
                at = elems.end;
            }
            i = j;
        }
    }
    Ok(digest.finish())
}
