//! Collecting every chunk's state from the ranks (snapshots, consolidation, checkpoints).

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use ractor::ActorRef;

use super::messages::RankMsg;
use crate::engine::coordinator::Progress;
use crate::param_digest::ParamDigest;
use crate::plan::{RankId, ShardMap};
use crate::runtime::step::elastic::snapshot::SnapshotSink;
use crate::runtime::step::state::rank_state::ChunkState;
use crate::runtime::step::state::tier_reads::GROUP_ELEMS;
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

/// Every chunk's state in (unit, index) order, read from the owners a piece of at most
/// [`GROUP_ELEMS`] elements at a time. Owners' chunks interleave within a unit, but a rank's
/// chunks of a unit sit together in its shard, so each owner is read in its own pieces (one
/// pass through its records) and the pieces are merged: at most one piece per owner is held.
struct Merged<'a, T: Transport> {
    ranks: &'a [(RankId, ActorRef<RankMsg<T>>)],
    map: &'a ShardMap,
    params_only: bool,
    /// The next chunk due: (unit, index).
    next: (usize, usize),
    /// Per owner, its pieces of the current unit not yet asked for, and the chunks of the
    /// piece being merged.
    owners: BTreeMap<RankId, (VecDeque<Vec<usize>>, VecDeque<ChunkState>)>,
}

impl<'a, T: Transport> Merged<'a, T> {
    fn new(
        ranks: &'a [(RankId, ActorRef<RankMsg<T>>)],
        map: &'a ShardMap,
        params_only: bool,
    ) -> Self {
        Self {
            ranks,
            map,
            params_only,
            next: (0, 0),
            owners: BTreeMap::new(),
        }
    }

    /// The next chunk and its owner, `None` after the last.
    async fn next(&mut self) -> Result<Option<(RankId, ChunkState)>, String> {
        let map = self.map;
        while self.next.0 < map.units.len() && self.next.1 >= map.units[self.next.0].owners.len() {
            self.next = (self.next.0 + 1, 0);
            self.owners.clear();
        }
        let (u, i) = self.next;
        if u >= map.units.len() {
            return Ok(None);
        }
        if self.owners.is_empty() {
            for &r in &map.members {
                let pieces = map.owned_pieces_in(u, r, GROUP_ELEMS);
                self.owners.insert(r, (pieces.into(), VecDeque::new()));
            }
        }
        let owner = map.owner(u, i);
        let (pieces, queue) = self
            .owners
            .get_mut(&owner)
            .ok_or_else(|| format!("chunk {u}/{i}: its owner, rank {owner}, is not in the map"))?;
        if queue.is_empty() {
            let chunks = pieces
                .pop_front()
                .ok_or_else(|| format!("rank {owner}: no piece left for chunk {u}/{i}"))?;
            let want = chunks.len();
            let actor = actor_of(self.ranks, owner, u)?;
            let params_only = self.params_only;
            let reply = actor
                .call(
                    |reply| RankMsg::OwnedChunks {
                        unit: u,
                        chunks,
                        params_only,
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
                    "rank {owner} sent {} of {want} chunks",
                    piece.len()
                ));
            }
            queue.extend(piece);
        }
        let c = queue.pop_front().expect("a piece was just read");
        let n = map.chunk_range(u, i).len();
        if (c.unit as usize, c.index as usize) != (u, i) || c.params.len() != n {
            return Err(format!(
                "rank {owner} sent chunk {}/{} ({} values) where {u}/{i} ({n}) was due",
                c.unit,
                c.index,
                c.params.len()
            ));
        }
        self.next = (u, i + 1);
        Ok(Some((owner, c)))
    }
}

/// The `param-sha256` of the parameters, read from their owners in canonical order, a piece
/// per owner at a time (parameters only).
pub async fn digest_params<T: Transport>(
    ranks: &[(RankId, ActorRef<RankMsg<T>>)],
    map: &ShardMap,
) -> Result<String, String> {
    let mut digest = ParamDigest::new();
    let mut chunks = Merged::new(ranks, map, true);
    while let Some((_, c)) = chunks.next().await? {
        digest.update(&c.params);
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

/// Streams the snapshot of `progress` under `map` into `sink`: every chunk's state in (unit,
/// index) order ([`Merged`]: one piece per owner at a time), written on a thread of its own
/// while the next pieces are read. Besides the owners' pieces, one batch is queued and one is
/// being written. An error is a rank that did not answer; the sink's own failures come back as
/// [`Streamed::SaveFailed`].
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
    let mut chunks = Merged::new(ranks, map, false);
    // Consecutive chunks of one owner go to the writer together, at most a piece's elements
    // (the planner counts one batch queued and one being written).
    let mut batch: Option<(RankId, Vec<ChunkState>)> = None;
    let mut batch_elems = 0;
    let mut writer_gone = false;
    loop {
        let next = chunks.next().await?;
        let flush = match (&batch, &next) {
            (Some((o, _)), Some((owner, c))) => {
                o != owner || batch_elems + c.params.len() > GROUP_ELEMS
            }
            (Some(_), None) => true,
            (None, _) => false,
        };
        if flush {
            let b = batch.take();
            batch_elems = 0;
            if tx.send(b).await.is_err() {
                writer_gone = true; // it stopped on an error: it says which
                break;
            }
        }
        let Some((owner, c)) = next else { break };
        batch_elems += c.params.len();
        batch.get_or_insert_with(|| (owner, Vec::new())).1.push(c);
    }
    if !writer_gone {
        let _ = tx.send(None).await;
    }
    let res = done
        .await
        .unwrap_or_else(|_| Err("the snapshot stream's thread panicked".into()));
    let _ = writer.join();
    Ok(match res {
        Ok(()) => Streamed::Saved,
        Err(e) => Streamed::SaveFailed(e),
    })
}
