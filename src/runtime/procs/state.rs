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

use crate::config::{ConfigError, TrainConfig};
use crate::engine::coordinator::Progress;
use crate::optim::{OptimState, OptimizerKind};
use crate::plan::{ChunkId, RankId, ShardMap, Stage};
use crate::runtime::step::rank_state::ChunkState;
use crate::runtime::step::resume::{read_owned_chunks, ResumeSource};

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
#[derive(Debug, Clone)]
pub struct StartState {
    /// The map for this run (members `0..ranks`).
    pub map: ShardMap,
    /// Where training stands: `Some` on a resume, `None` for new weights (`--init`).
    pub progress: Option<Progress>,
    /// Every chunk of `map`.
    pub chunks: BTreeMap<ChunkId, ChunkState>,
    /// On a resume: the bytes each rank's reader took from the saved state, by rank.
    pub reads: Vec<(RankId, u64)>,
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
            chunks: restored.chunks,
            reads: restored.per_rank,
        })
    }

    /// Full parameters per unit (`--init`) as chunks with zeroed optimizer state.
    pub fn from_params(
        params: &[Vec<f32>],
        ranks: u32,
        chunk_elems: usize,
        optimizer: OptimizerKind,
    ) -> Result<Self, String> {
        let numels: Vec<usize> = params.iter().map(Vec::len).collect();
        let members: Vec<RankId> = (0..ranks).collect();
        let map = ShardMap::plan(&numels, &members, chunk_elems, 1).map_err(|e| e.to_string())?;
        let probe = OptimState::new(optimizer, 1);
        let zeros = |keep: bool, n: usize| if keep { vec![0f32; n] } else { Vec::new() };
        let mut chunks = BTreeMap::new();
        for (u, unit) in map.units.iter().enumerate() {
            for i in 0..unit.owners.len() {
                let r = map.chunk_range(u, i);
                let n = r.len();
                let id = ChunkId {
                    unit: u as u32,
                    index: i as u32,
                };
                let state = ChunkState {
                    unit: u as u32,
                    index: i as u32,
                    params: params[u][r].to_vec(),
                    m: zeros(!probe.m.is_empty(), n),
                    v: zeros(!probe.v.is_empty(), n),
                };
                chunks.insert(id, state);
            }
        }
        Ok(Self {
            map,
            progress: None,
            chunks,
            reads: Vec::new(),
        })
    }

    /// The chunk states `rank`'s state is built from under `stage`, in (unit, index) order:
    /// stage 3 keeps only its own chunks; stages 1 and 2 hold every chunk's parameters and the
    /// optimizer state of their own; stage 0 holds everything.
    pub fn chunks_for(&self, rank: RankId, stage: Stage) -> impl Iterator<Item = ChunkState> + '_ {
        let owned = move |id: &ChunkId| self.map.owner(id.unit as usize, id.index as usize) == rank;
        self.chunks
            .iter()
            .filter_map(move |(id, c)| match (stage, owned(id)) {
                (_, true) | (Stage::Zero0, false) => Some(c.clone()),
                (Stage::Zero3, false) => None,
                (_, false) => Some(ChunkState {
                    m: Vec::new(),
                    v: Vec::new(),
                    unit: c.unit,
                    index: c.index,
                    params: c.params.clone(),
                }),
            })
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
        let s = StartState::from_params(&params, 2, 4, OptimizerKind::AdamW).unwrap();
        let total = s.chunks.len();
        let owned = |r: RankId| s.map.owned_chunks(r).len();
        for rank in 0..2 {
            let z3: Vec<_> = s.chunks_for(rank, Stage::Zero3).collect();
            assert_eq!(z3.len(), owned(rank));
            assert!(z3.iter().all(|c| c.m.len() == c.params.len()));
            let z1: Vec<_> = s.chunks_for(rank, Stage::Zero1).collect();
            assert_eq!(z1.len(), total);
            let with_state = z1.iter().filter(|c| !c.m.is_empty()).count();
            assert_eq!(with_state, owned(rank));
            let z0: Vec<_> = s.chunks_for(rank, Stage::Zero0).collect();
            assert!(z0.iter().all(|c| c.v.len() == c.params.len()));
        }
    }
}
