//! Collecting every chunk's state from the ranks (snapshots, consolidation, checkpoints).

use std::collections::BTreeMap;
use std::time::Duration;

use ractor::ActorRef;

use super::messages::RankMsg;
use crate::engine::coordinator::Progress;
use crate::param_digest::ParamDigest;
use crate::plan::{RankId, ShardMap};
use crate::runtime::step::rank_state::ChunkState;
use crate::runtime::step::snapshot::SnapshotSink;
use crate::runtime::step::tier_reads::GROUP_ELEMS;
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
    for u in 0..map.units.len() {
        for (owner, chunks) in map.owner_runs(u) {
            let run =
                map.chunk_range(u, chunks.start).start..map.chunk_range(u, chunks.end - 1).end;
            let actor = actor_of(ranks, owner, u)?;
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
        }
    }
    Ok(digest.finish())
}

fn actor_of<T: Transport>(
    ranks: &[(RankId, ActorRef<RankMsg<T>>)],
    owner: RankId,
    u: usize,
) -> Result<&ActorRef<RankMsg<T>>, String> {
    ranks
        .iter()
        .find(|(r, _)| *r == owner)
        .map(|(_, a)| a)
        .ok_or_else(|| format!("unit {u}: its owner, rank {owner}, is not running"))
}

/// What became of a streamed snapshot when its ranks all answered.
#[derive(Debug, PartialEq, Eq)]
pub enum Streamed {
    Saved,
    /// The sink refused or failed it (and reported why); training goes on.
    SaveFailed(String),
}

/// Streams the snapshot of `progress` under `map` into `sink`: every chunk's state, read from
/// its owner in (unit, index) order a piece of at most [`GROUP_ELEMS`] elements at a time (one
/// chunk if larger), written on a thread of its own while the next piece is read. At most
/// three pieces are in memory: one being read, one queued, one being written. An error is a
/// rank that did not answer; the sink's own failures come back as [`Streamed::SaveFailed`].
pub async fn stream_snapshot<T: Transport>(
    ranks: &[(RankId, ActorRef<RankMsg<T>>)],
    map: &ShardMap,
    progress: &Progress,
    sink: &dyn SnapshotSink,
) -> Result<Streamed, String> {
    let mut stream = match sink.begin(progress, map) {
        Ok(s) => s,
        Err(e) => return Ok(Streamed::SaveFailed(e)),
    };
    // `None` says every piece was sent; a channel closed without it abandons the save.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Option<(RankId, Vec<ChunkState>)>>(1);
    let (done_tx, done) = tokio::sync::oneshot::channel();
    let writer = std::thread::Builder::new()
        .name("snapshot-stream".into())
        .spawn(move || {
            let res = loop {
                match rx.blocking_recv() {
                    Some(Some((owner, chunks))) => {
                        if let Err(e) = stream.push(owner, chunks) {
                            break Err(e);
                        }
                    }
                    Some(None) => break stream.commit(),
                    None => break Err("abandoned: a rank did not answer".into()),
                }
            };
            let _ = done_tx.send(res);
        })
        .map_err(|e| format!("cannot start the snapshot stream's thread: {e}"))?;
    'units: for u in 0..map.units.len() {
        for (owner, run) in map.owner_runs(u) {
            let actor = actor_of(ranks, owner, u)?;
            for chunks in map.pieces(u, run, GROUP_ELEMS) {
                let reply = actor
                    .call(
                        |reply| RankMsg::OwnedChunks {
                            unit: u,
                            chunks: chunks.clone(),
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
                if tx.send(Some((owner, piece))).await.is_err() {
                    break 'units; // the writer stopped on an error: it says which
                }
            }
        }
    }
    let _ = tx.send(None).await;
    let res = done
        .await
        .unwrap_or_else(|_| Err("the snapshot stream's thread panicked".into()));
    let _ = writer.join();
    Ok(match res {
        Ok(()) => Streamed::Saved,
        Err(e) => Streamed::SaveFailed(e),
    })
}
