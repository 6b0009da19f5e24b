//! Where a resumed run's state comes from. A source is read per rank: each rank asks only for the
//! chunks it owns under the new shard map, so a checkpoint on disk is read once in total, spread
//! over the ranks, rather than once per rank or whole by one reader.
//!
//! The new map may differ from the saved one in world size, stage and chunk size. Chunks are
//! re-cut by element range: a new chunk is assembled from the saved chunks that cover the same
//! elements of the same unit, so what a rank reads depends only on which elements it owns.

use std::collections::BTreeMap;

use crate::engine::coordinator::Progress;
use crate::plan::{ChunkId, RankId, ShardMap};
use crate::runtime::step::elastic::snapshot::Snapshot;
use crate::runtime::step::state::rank_state::ChunkState;

/// What one rank's read produced.
#[derive(Debug, Clone, Default)]
pub struct RankRead {
    /// The new map's chunks asked for, in the order asked.
    pub chunks: Vec<ChunkState>,
    /// Bytes this read took from storage (0 for an in-memory source).
    pub bytes_read: u64,
}

/// Saved state a cluster can resume from.
pub trait ResumeSource: Send + Sync {
    /// Where training stands in the saved state.
    fn progress(&self) -> &Progress;
    /// The shard map the state was saved under.
    fn saved_map(&self) -> &ShardMap;
    /// The states of the new chunks `wanted`, cut with `chunk_elems` elements per chunk. Fails
    /// with a message naming what is missing or damaged; never returns partial state.
    fn read(&self, wanted: &[ChunkId], chunk_elems: usize) -> Result<RankRead, String>;
    /// SHA-256 of all parameters in canonical order, when the source recorded one. A resume
    /// that read every chunk checks it: it does not depend on the chunk size.
    fn param_sha256(&self) -> Option<&str> {
        None
    }
    /// For messages: where the state comes from.
    fn describe(&self) -> String;
}

impl ResumeSource for Snapshot {
    fn progress(&self) -> &Progress {
        &self.progress
    }

    fn saved_map(&self) -> &ShardMap {
        &self.map
    }

    fn read(&self, wanted: &[ChunkId], chunk_elems: usize) -> Result<RankRead, String> {
        let chunks = wanted
            .iter()
            .map(|c| {
                let (u, i) = (c.unit as usize, c.index as usize);
                recut(&self.map, &self.chunks, chunk_elems, u, i)
                    .ok_or_else(|| format!("the snapshot has no state for chunk {u}/{i}"))
            })
            .collect::<Result<_, _>>()?;
        Ok(RankRead {
            chunks,
            bytes_read: 0,
        })
    }

    fn describe(&self) -> String {
        format!("an in-memory snapshot at step {}", self.progress.step)
    }
}

impl From<Snapshot> for std::sync::Arc<dyn ResumeSource> {
    fn from(snapshot: Snapshot) -> Self {
        std::sync::Arc::new(snapshot)
    }
}

/// The saved chunks (of `old`, by (unit, index)) that hold the elements of new chunk `i` of
/// unit `u` when chunks have `chunk_elems` elements. Empty when the chunk does not exist.
pub fn covering(
    old: &ShardMap,
    chunk_elems: usize,
    u: usize,
    i: usize,
) -> std::ops::RangeInclusive<usize> {
    let Some((start, end)) = new_range(old, chunk_elems, u, i) else {
        #[allow(clippy::reversed_empty_ranges)]
        return 1..=0;
    };
    start / old.chunk_elems..=(end - 1) / old.chunk_elems
}

fn new_range(old: &ShardMap, chunk_elems: usize, u: usize, i: usize) -> Option<(usize, usize)> {
    let numel = old.units.get(u)?.numel;
    let start = i.checked_mul(chunk_elems)?;
    let end = start.checked_add(chunk_elems)?.min(numel);
    (start < end).then_some((start, end))
}

/// New chunk `i` of unit `u` cut out of `saved` (chunks of `old`, sorted by (unit, index); only
/// those [`covering`] it need be present). `None` when the chunk does not exist or a covering
/// saved chunk is missing or too short.
pub fn recut(
    old: &ShardMap,
    saved: &[ChunkState],
    chunk_elems: usize,
    u: usize,
    i: usize,
) -> Option<ChunkState> {
    let (start, end) = new_range(old, chunk_elems, u, i)?;
    let (mut params, mut m, mut v) = (Vec::new(), Vec::new(), Vec::new());
    for oi in covering(old, chunk_elems, u, i) {
        let at = saved
            .binary_search_by_key(&(u as u32, oi as u32), |c| (c.unit, c.index))
            .ok()?;
        let c = &saved[at];
        let base = oi * old.chunk_elems;
        let (lo, hi) = (
            start.max(base) - base,
            end.min(base + c.params.len()) - base,
        );
        params.extend_from_slice(c.params.get(lo..hi)?);
        if !c.m.is_empty() {
            m.extend_from_slice(c.m.get(lo..hi)?);
        }
        if !c.v.is_empty() {
            v.extend_from_slice(c.v.get(lo..hi)?);
        }
    }
    Some(ChunkState {
        unit: u as u32,
        index: i as u32,
        params,
        m,
        v,
    })
}

/// The [`param_digest`](crate::param_digest) of every chunk in `chunks`, hashed in (unit,
/// index) order: the digest of the consolidated parameters when every chunk of a map is present.
pub fn params_sha256(chunks: &BTreeMap<ChunkId, ChunkState>) -> String {
    crate::param_digest::param_sha256(chunks.values().map(|c| c.params.as_slice()))
}

/// Every chunk of the new map, each read by the rank that owns it (one thread per rank, as
/// separate processes would), checked for completeness and, where the source recorded one,
/// against the saved parameters' digest.
pub struct Restored {
    /// Every chunk of the new map.
    pub chunks: BTreeMap<ChunkId, ChunkState>,
    /// Bytes each rank read, by rank.
    pub per_rank: Vec<(RankId, u64)>,
}

pub fn read_owned_chunks(src: &dyn ResumeSource, map: &ShardMap) -> Result<Restored, String> {
    let reads: Vec<_> = std::thread::scope(|s| {
        let readers: Vec<_> = map
            .members
            .iter()
            .map(|&rank| {
                let wanted = map.owned_chunks(rank);
                (rank, s.spawn(move || src.read(&wanted, map.chunk_elems)))
            })
            .collect();
        readers
            .into_iter()
            .map(|(rank, h)| {
                let read = h
                    .join()
                    .unwrap_or_else(|_| Err("the reader thread panicked".into()));
                (rank, read)
            })
            .collect()
    });
    let mut chunks = BTreeMap::new();
    let mut per_rank = Vec::new();
    for (rank, read) in reads {
        let read = read.map_err(|e| format!("rank {rank}: {e}"))?;
        per_rank.push((rank, read.bytes_read));
        for c in read.chunks {
            let id = ChunkId {
                unit: c.unit,
                index: c.index,
            };
            chunks.insert(id, c);
        }
    }
    let total: usize = map.units.iter().map(|u| u.owners.len()).sum();
    if chunks.len() != total {
        return Err(format!(
            "{}: {} of {total} chunks were read",
            src.describe(),
            chunks.len()
        ));
    }
    if let Some(want) = src.param_sha256() {
        let got = params_sha256(&chunks);
        if got != want {
            return Err(format!(
                "{}: the parameters read hash to {got}, the saved digest is {want}",
                src.describe()
            ));
        }
    }
    Ok(Restored { chunks, per_rank })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(u: usize, i: usize) -> ChunkId {
        ChunkId {
            unit: u as u32,
            index: i as u32,
        }
    }

    fn snapshot(numels: &[usize], chunk_elems: usize) -> Snapshot {
        let map = ShardMap::plan(numels, &[0, 1, 2], chunk_elems, 3).unwrap();
        let mut chunks = Vec::new();
        for (u, unit) in map.units.iter().enumerate() {
            for i in 0..unit.owners.len() {
                let r = map.chunk_range(u, i);
                let val = |k: usize, off: f32| (u * 1000 + k) as f32 + off;
                chunks.push(ChunkState {
                    unit: u as u32,
                    index: i as u32,
                    params: r.clone().map(|k| val(k, 0.0)).collect(),
                    m: r.clone().map(|k| val(k, 0.25)).collect(),
                    v: r.map(|k| val(k, 0.5)).collect(),
                });
            }
        }
        Snapshot {
            progress: Progress {
                step: 0,
                opt_step: 0,
                grad_bounds: vec![1.0; numels.len()],
            },
            map,
            chunks,
        }
    }

    #[test]
    fn recut_chunks_hold_the_same_elements_under_any_chunk_size() {
        let snap = snapshot(&[10, 7, 0, 33], 4);
        for chunk_elems in [1, 3, 4, 5, 64] {
            let new = ShardMap::plan(&[10, 7, 0, 33], &[0, 1], chunk_elems, 4).unwrap();
            for (u, unit) in new.units.iter().enumerate() {
                let ids: Vec<ChunkId> = (0..unit.owners.len()).map(|i| id(u, i)).collect();
                let got = snap.read(&ids, chunk_elems).unwrap().chunks;
                for (i, c) in got.iter().enumerate() {
                    let r = new.chunk_range(u, i);
                    let want: Vec<f32> = r.clone().map(|k| (u * 1000 + k) as f32).collect();
                    assert_eq!(c.params, want, "unit {u} chunk {i} at {chunk_elems}");
                    assert_eq!(c.v[0], want[0] + 0.5);
                }
            }
        }
    }

    #[test]
    fn a_chunk_that_does_not_exist_is_an_error_not_an_empty_state() {
        let snap = snapshot(&[10], 4);
        let err = snap.read(&[id(0, 9)], 4).unwrap_err();
        assert!(err.contains("chunk 0/9"), "{err}");
        assert!(snap.read(&[id(5, 0)], 4).is_err());
    }

    #[test]
    fn the_digest_does_not_depend_on_the_chunk_size() {
        let snap = snapshot(&[10, 7, 33], 4);
        let digest = |chunk_elems: usize| {
            let new = ShardMap::plan(&[10, 7, 33], &[0], chunk_elems, 4).unwrap();
            let mut all = BTreeMap::new();
            for (u, unit) in new.units.iter().enumerate() {
                for i in 0..unit.owners.len() {
                    let c = recut(&snap.map, &snap.chunks, chunk_elems, u, i).unwrap();
                    all.insert(id(u, i), c);
                }
            }
            params_sha256(&all)
        };
        assert_eq!(digest(3), digest(4));
        assert_eq!(digest(3), digest(100));
    }
}
