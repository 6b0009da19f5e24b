//! The state a job with worker processes starts from (`--resume`, `--init`), and how chunk
//! states cross a control connection.
//!
//! The coordinator process does what `Cluster::start` does in-process: it plans the new map (the
//! epoch after the saved one) and has each rank's owned chunks read by a thread of its own
//! (`read_owned_chunks`, so the same completeness and digest checks), all before a worker is
//! admitted. Damaged or unfitting saved state is thus refused before anything starts, and workers
//! need no access to the checkpoint's filesystem. Each worker is then sent only the chunks its
//! state is built from (`chunks_for`), in parts.
//!
//! Chunk states travel in parts of at most [`STATE_PART_MAX_BYTES`] (a chunk larger than that
//! goes alone), both to a worker at the start and from a worker when the coordinator collects
//! (snapshots, the final consolidation): no frame nears `CONTROL_FRAME_MAX_BYTES`, and a receiver
//! holds at most one part beyond what it keeps (the sender builds them one at a time).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::config::{ConfigError, TrainConfig};
use crate::engine::coordinator::Progress;
use crate::model::weights::WeightSource;
use crate::optim::{OptimState, OptimizerKind};
use crate::plan::{ChunkId, RankId, ShardMap, Stage};
use crate::runtime::step::elastic::resume::{read_owned_chunks, ResumeSource};
use crate::runtime::step::state::rank_state::ChunkState;
use crate::runtime::step::state::start_weights::{kept_chunks, read_chunks};

/// Default largest part of chunk states in one control frame, by the bytes of its values.
pub const STATE_PART_MAX_BYTES: usize = 32 << 20;
/// The most a part may be set to: far enough under `CONTROL_FRAME_MAX_BYTES` for the encoding.
pub const STATE_PART_LIMIT_BYTES: usize = 256 << 20;

/// Refuses a part size out of range, and chunks too large to cross a control connection in one
/// frame (a chunk is never split: it is the unit the shard map assigns).
pub fn check_parts(cfg: &TrainConfig, part_max_bytes: usize) -> Result<(), ConfigError> {
    if part_max_bytes == 0 || part_max_bytes > STATE_PART_LIMIT_BYTES {
        return Err(ConfigError::new(
            "state_part_max_bytes",
            format!("must be between 1 and {STATE_PART_LIMIT_BYTES}"),
        ));
    }
    // Parameters, and Adam's m and v: 12 bytes an element at most.
    let chunk_bytes = cfg.chunk_elems.saturating_mul(12);
    if chunk_bytes > STATE_PART_LIMIT_BYTES {
        return Err(ConfigError::new(
            "chunk_elems",
            format!(
                "with worker processes a chunk's state must fit one control frame: at most {} elements",
                STATE_PART_LIMIT_BYTES / 12
            ),
        ));
    }
    Ok(())
}

/// Where a process-mode job starts when it does not start from the model's initialisation.
pub struct StartState {
    /// The map for this run (members `0..ranks`).
    pub map: ShardMap,
    /// Where training stands: `Some` on a resume, `None` for new weights (`--init`).
    pub progress: Option<Progress>,
    /// Where each worker's chunks come from.
    pub chunks: StartChunks,
    /// On a resume: the bytes each rank's reader took from the saved state, by rank.
    pub reads: Vec<(RankId, u64)>,
}

/// The chunk states a process-mode job starts from.
pub enum StartChunks {
    /// Every chunk of the map, read from saved state before any worker was admitted.
    Saved(BTreeMap<ChunkId, ChunkState>),
    /// New weights with zeroed optimizer state, read for each worker while its start is sent:
    /// only the chunks that worker keeps, a unit at a time, so the coordinator never holds
    /// the whole model.
    Weights {
        source: Arc<dyn WeightSource>,
        optimizer: OptimizerKind,
    },
}

impl StartState {
    /// Reads `src` for a run of `ranks` ranks over units of `numels` elements cut into chunks of
    /// `chunk_elems`; each rank's owned chunks by a thread of its own.
    pub fn resume(
        src: &dyn ResumeSource,
        numels: &[usize],
        ranks: u32,
        chunk_elems: usize,
    ) -> Result<Self, String> {
        let old: Vec<usize> = src.saved_map().units.iter().map(|u| u.numel).collect();
        if old != numels {
            return Err(format!(
                "{}: its units have sizes {old:?}, this model's are {numels:?}: it belongs to another model",
                src.describe()
            ));
        }
        let members: Vec<RankId> = (0..ranks).collect();
        let epoch = src.saved_map().epoch + 1;
        let map =
            ShardMap::plan(numels, &members, chunk_elems, epoch).map_err(|e| e.to_string())?;
        let restored = read_owned_chunks(src, &map)?;
        Ok(Self {
            map,
            progress: Some(src.progress().clone()),
            chunks: StartChunks::Saved(restored.chunks),
            reads: restored.per_rank,
        })
    }

    /// New weights (`--init`) for units of `numels` elements, with zeroed optimizer state.
    /// Nothing is read until a worker's chunks are asked for.
    pub fn from_weights(
        source: Arc<dyn WeightSource>,
        numels: &[usize],
        ranks: u32,
        chunk_elems: usize,
        optimizer: OptimizerKind,
    ) -> Result<Self, String> {
        let members: Vec<RankId> = (0..ranks).collect();
        let map = ShardMap::plan(numels, &members, chunk_elems, 1).map_err(|e| e.to_string())?;
        Ok(Self {
            map,
            progress: None,
            chunks: StartChunks::Weights { source, optimizer },
            reads: Vec::new(),
        })
    }

    /// The chunk states `rank`'s state is built from under `stage`, in (unit, index) order:
    /// stage 3 keeps only its own chunks; stages 1 and 2 hold every chunk's parameters and the
    /// optimizer state of their own; stage 0 holds everything. New weights are read here, a
    /// unit at a time; a read that fails ends the sequence with its error.
    pub fn chunks_for(
        &self,
        rank: RankId,
        stage: Stage,
    ) -> Box<dyn Iterator<Item = Result<ChunkState, String>> + '_> {
        let map = &self.map;
        let keeps_state =
            move |u: usize, i: usize| stage == Stage::Zero0 || map.owner(u, i) == rank;
        match &self.chunks {
            StartChunks::Saved(chunks) => Box::new(chunks.iter().filter_map(move |(id, c)| {
                let (u, i) = (id.unit as usize, id.index as usize);
                match (stage, keeps_state(u, i)) {
                    (_, true) => Some(Ok(c.clone())),
                    (Stage::Zero3, false) => None,
                    (_, false) => Some(Ok(ChunkState {
                        m: Vec::new(),
                        v: Vec::new(),
                        unit: c.unit,
                        index: c.index,
                        params: c.params.clone(),
                    })),
                }
            })),
            StartChunks::Weights { source, optimizer } => {
                let probe = OptimState::new(*optimizer, 1);
                let (with_m, with_v) = (!probe.m.is_empty(), !probe.v.is_empty());
                Box::new((0..map.units.len()).flat_map(move |u| {
                    let kept = kept_chunks(map, u, rank, stage);
                    let read = read_chunks(&**source, map, u, &kept)
                        .map_err(|e| format!("reading {}: {e}", source.describe()));
                    let states: Vec<Result<ChunkState, String>> = match read {
                        Err(e) => vec![Err(e)],
                        Ok(read) => read
                            .into_iter()
                            .map(|(i, params)| {
                                let keep = keeps_state(u, i);
                                let zeros = |on: bool| match on && keep {
                                    true => vec![0f32; params.len()],
                                    false => Vec::new(),
                                };
                                Ok(ChunkState {
                                    unit: u as u32,
                                    index: i as u32,
                                    m: zeros(with_m),
                                    v: zeros(with_v),
                                    params,
                                })
                            })
                            .collect(),
                    };
                    states
                }))
            }
        }
    }
}

/// The bytes of a chunk state's values.
pub fn chunk_bytes(c: &ChunkState) -> usize {
    4 * (c.params.len() + c.m.len() + c.v.len())
}

/// `chunks` in order, cut lazily into parts of at most `max_bytes` (a larger chunk is a part of
/// its own), each with whether it is the last. Always at least one part, so that an empty list is
/// still an answer.
pub fn parts<I: IntoIterator<Item = ChunkState>>(
    chunks: I,
    max_bytes: usize,
) -> Parts<I::IntoIter> {
    Parts {
        chunks: chunks.into_iter().peekable(),
        max_bytes,
        started: false,
    }
}

pub struct Parts<I: Iterator<Item = ChunkState>> {
    chunks: std::iter::Peekable<I>,
    max_bytes: usize,
    started: bool,
}

impl<I: Iterator<Item = ChunkState>> Iterator for Parts<I> {
    /// A part and whether it is the last.
    type Item = (Vec<ChunkState>, bool);

    fn next(&mut self) -> Option<Self::Item> {
        if self.started && self.chunks.peek().is_none() {
            return None;
        }
        self.started = true;
        let (mut part, mut bytes) = (Vec::new(), 0);
        while let Some(c) = self
            .chunks
            .next_if(|c| part.is_empty() || bytes + chunk_bytes(c) <= self.max_bytes)
        {
            bytes += chunk_bytes(&c);
            part.push(c);
        }
        let last = self.chunks.peek().is_none();
        Some((part, last))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(unit: u32, index: u32, n: usize) -> ChunkState {
        ChunkState {
            unit,
            index,
            params: vec![1.0; n],
            m: vec![0.0; n],
            v: vec![0.0; n],
        }
    }

    #[test]
    fn parts_keep_order_and_stay_within_the_budget_unless_one_chunk_exceeds_it() {
        let chunks: Vec<ChunkState> = (0..7).map(|i| chunk(0, i, 10)).collect();
        // 120 bytes a chunk: two fit in 250 bytes.
        let got: Vec<_> = parts(chunks.clone(), 250).collect();
        let shape: Vec<_> = got.iter().map(|(p, last)| (p.len(), *last)).collect();
        assert_eq!(shape, [(2, false), (2, false), (2, false), (1, true)]);
        let back: Vec<ChunkState> = got.into_iter().flat_map(|(p, _)| p).collect();
        assert_eq!(back, chunks);
        assert_eq!(
            parts(chunks, 100).count(),
            7,
            "a chunk over the budget goes alone"
        );
        let empty: Vec<_> = parts(Vec::new(), 100).collect();
        assert_eq!(empty, vec![(Vec::new(), true)]);
    }

    #[test]
    fn each_stage_gets_what_its_state_is_built_from() {
        let params = vec![vec![0.5f32; 10], vec![0.25f32; 7]];
        let s = StartState::from_weights(
            Arc::new(params.clone()),
            &[10, 7],
            2,
            4,
            OptimizerKind::AdamW,
        )
        .unwrap();
        let total = s.map.units.iter().map(|u| u.owners.len()).sum::<usize>();
        let owned = |r: RankId| s.map.owned_chunks(r).len();
        let chunks = |rank, stage| -> Vec<ChunkState> {
            s.chunks_for(rank, stage).map(Result::unwrap).collect()
        };
        for rank in 0..2 {
            let z3 = chunks(rank, Stage::Zero3);
            assert_eq!(z3.len(), owned(rank));
            assert!(z3.iter().all(|c| c.m.len() == c.params.len()));
            let z1 = chunks(rank, Stage::Zero1);
            assert_eq!(z1.len(), total);
            let with_state = z1.iter().filter(|c| !c.m.is_empty()).count();
            assert_eq!(with_state, owned(rank));
            for c in &z1 {
                let r = s.map.chunk_range(c.unit as usize, c.index as usize);
                assert_eq!(c.params[..], params[c.unit as usize][r]);
            }
            let z0 = chunks(rank, Stage::Zero0);
            assert!(z0.iter().all(|c| c.v.len() == c.params.len()));
        }
        // A read that fails ends the sequence with the source's error.
        let short = StartState::from_weights(
            Arc::new(vec![vec![0f32; 10]]),
            &[10, 7],
            2,
            4,
            OptimizerKind::AdamW,
        )
        .unwrap();
        let err = short
            .chunks_for(0, Stage::Zero3)
            .find_map(Result::err)
            .unwrap();
        assert!(err.contains("no such unit"), "{err}");
    }
}
