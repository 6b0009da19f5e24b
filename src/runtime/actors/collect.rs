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

/// The `param-sha256` of the parameters, read from each chunk's owner in canonical (unit,
/// index) order, in pieces of at most [`DIGEST_PIECE_ELEMS`].
pub async fn digest_params<T: Transport>(
    ranks: &[(RankId, ActorRef<RankMsg<T>>)],
    map: &ShardMap,
) -> Result<String, String> {
    let mut digest = ParamDigest::new();
    for (u, unit) in map.units.iter().enumerate() {
        for (i, &owner) in unit.owners.iter().enumerate() {
            let actor = ranks
                .iter()
                .find(|(r, _)| *r == owner)
                .map(|(_, a)| a)
                .ok_or_else(|| format!("chunk {u}/{i}: its owner, rank {owner}, is not running"))?;
            let len = map.chunk_range(u, i).len();
            let mut at = 0;
            while at < len {
                let elems = at..(at + DIGEST_PIECE_ELEMS).min(len);
                let want = elems.len();
                let reply = actor
                    .call(
                        |reply| RankMsg::ChunkParams {
                            unit: u,
                            index: i,
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
                        "rank {owner} sent {} parameters of chunk {u}/{i} for {want}",
                        piece.len()
                    ));
                }
                digest.update(&piece);
                at = elems.end;
            }
        }
    }
    Ok(digest.finish())
}
