//! What one rank owns: its shards (master parameters, optimizer state, reduced gradients), the
//! full parameter copy where the stage keeps one, the whole-model gradient accumulator for
//! stages 0 and 1, and the memory ledger that accounts for all of it.
//!
//! Shards are indexed by the shard map, never by attributes on tensors: `UnitShard::chunks` lists
//! the chunk indices this rank holds for a unit, and the shard buffers are those chunks
//! concatenated in ascending order (which is also the all-gather wire layout).

use std::ops::Range;
use std::sync::Arc;

use crate::engine::ledger::{Category, Ledger};
use crate::model::{Model, UnitSpec};
use crate::optim::{self, AdamHyper, OptimState, OptimizerKind};
use crate::plan::{RankId, ShardMap, Stage};
use crate::reduce::{grad_buf, GradBuf, ReduceMode};

/// Optimizer choice and hyper-parameters for every shard of a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimSettings {
    pub kind: OptimizerKind,
    pub hyper: AdamHyper,
    pub threads: usize,
}

impl OptimSettings {
    /// Optimizer state elements per parameter (Adam: m and v).
    pub fn state_per_param(&self) -> u64 {
        match self.kind {
            OptimizerKind::AdamW | OptimizerKind::Adam => 2,
            OptimizerKind::Sgd { momentum, .. } if momentum != 0.0 => 1,
            OptimizerKind::Sgd { .. } => 0,
        }
    }

    /// One update of `p` with gradient `g` and state slices `m`, `v` (empty where unused).
    pub fn update(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], t: u64, lr: f32) {
        match self.kind {
            OptimizerKind::AdamW | OptimizerKind::Adam => {
                let hp = AdamHyper {
                    decoupled: self.kind == OptimizerKind::AdamW,
                    ..self.hyper
                };
                optim::adam_step(p, g, m, v, &hp, t, lr, self.threads);
            }
            OptimizerKind::Sgd { momentum, nesterov } => {
                let hp = optim::SgdHyper {
                    momentum,
                    nesterov,
                    weight_decay: self.hyper.weight_decay,
                };
                optim::sgd_step(p, g, m, &hp, t, lr, self.threads);
            }
        }
    }
}

/// This rank's slice of one unit.
pub struct UnitShard {
    /// Chunk indices held, ascending (owned chunks; every chunk for stage 0's optimizer state).
    pub chunks: Vec<usize>,
    /// The chunks' element ranges within the unit.
    pub ranges: Vec<Range<usize>>,
    /// Master parameters of the held chunks (stage 3 only; stages 0-2 use the full copy).
    pub params: Vec<f32>,
    pub opt: OptimState,
    /// Reduced gradient of the held chunks (stages 2 and 3).
    pub grads: Option<GradBuf>,
}

impl UnitShard {
    pub fn len(&self) -> usize {
        self.ranges.iter().map(Range::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

pub struct RankState {
    pub rank: RankId,
    pub stage: Stage,
    pub mode: ReduceMode,
    pub model: Arc<dyn Model>,
    pub specs: Vec<UnitSpec>,
    pub map: ShardMap,
    pub optim: OptimSettings,
    /// Full parameters per unit (stages 0-2); empty vectors for stage 3.
    pub full: Vec<Vec<f32>>,
    pub shards: Vec<UnitShard>,
    /// Whole-model gradient accumulator per unit (stages 0 and 1).
    pub whole_grads: Option<Vec<GradBuf>>,
    pub ledger: Ledger,
}

impl RankState {
    /// Builds the rank's state from the model's initial parameters (a pure function of `seed`).
    pub fn init(
        rank: RankId,
        stage: Stage,
        mode: ReduceMode,
        model: Arc<dyn Model>,
        map: ShardMap,
        optim: OptimSettings,
        seed: u64,
    ) -> Self {
        let specs = model.units();
        let init: Vec<Vec<f32>> = (0..specs.len()).map(|u| model.init_unit(u, seed)).collect();
        Self::from_full_params(rank, stage, mode, model, map, optim, &init)
    }

    /// Builds the rank's state from given full parameters (initial or restored).
    pub fn from_full_params(
        rank: RankId,
        stage: Stage,
        mode: ReduceMode,
        model: Arc<dyn Model>,
        map: ShardMap,
        optim: OptimSettings,
        params: &[Vec<f32>],
    ) -> Self {
        let specs = model.units();
        let mut ledger = Ledger::default();
        let mut shards = Vec::with_capacity(specs.len());
        for (u, p) in params.iter().enumerate() {
            let chunks: Vec<usize> = if stage == Stage::Zero0 {
                (0..map.units[u].owners.len()).collect()
            } else {
                map.owned_in_unit(u, rank).collect()
            };
            let ranges: Vec<Range<usize>> = chunks.iter().map(|&i| map.chunk_range(u, i)).collect();
            let len: usize = ranges.iter().map(Range::len).sum();
            let shard_params = if stage == Stage::Zero3 {
                ranges
                    .iter()
                    .flat_map(|r| p[r.clone()].iter().copied())
                    .collect()
            } else {
                Vec::new()
            };
            let grads =
                matches!(stage, Stage::Zero2 | Stage::Zero3).then(|| GradBuf::zeros(mode, len));
            let opt = OptimState::new(optim.kind, len);
            ledger.alloc(Category::Params, 4 * shard_params.len() as u64);
            ledger.alloc(Category::Optimizer, opt.bytes() as u64);
            ledger.alloc(
                Category::Grads,
                grads.as_ref().map_or(0, |g| g.bytes() as u64),
            );
            shards.push(UnitShard {
                chunks,
                ranges,
                params: shard_params,
                opt,
                grads,
            });
        }
        let full: Vec<Vec<f32>> = if stage == Stage::Zero3 {
            vec![Vec::new(); specs.len()]
        } else {
            params.to_vec()
        };
        ledger.alloc(
            Category::Params,
            4 * full.iter().map(Vec::len).sum::<usize>() as u64,
        );
        let whole_grads = matches!(stage, Stage::Zero0 | Stage::Zero1).then(|| {
            params
                .iter()
                .map(|p| GradBuf::zeros(mode, p.len()))
                .collect::<Vec<_>>()
        });
        if let Some(w) = &whole_grads {
            ledger.alloc(Category::Grads, w.iter().map(|g| g.bytes() as u64).sum());
        }
        Self {
            rank,
            stage,
            mode,
            model,
            specs,
            map,
            optim,
            full,
            shards,
            whole_grads,
            ledger,
        }
    }

    pub fn units(&self) -> usize {
        self.specs.len()
    }

    /// The chunks of `unit` this rank owns under the map, with the master parameter values.
    pub fn owned_params(&self, unit: usize) -> Vec<(usize, Vec<f32>)> {
        self.map
            .owned_in_unit(unit, self.rank)
            .map(|i| {
                let r = self.map.chunk_range(unit, i);
                let vals = if self.stage == Stage::Zero3 {
                    let s = &self.shards[unit];
                    let at = s
                        .chunks
                        .iter()
                        .position(|&c| c == i)
                        .expect("owned chunk is held");
                    let off: usize = s.ranges[..at].iter().map(Range::len).sum();
                    s.params[off..off + r.len()].to_vec()
                } else {
                    self.full[unit][r].to_vec()
                };
                (i, vals)
            })
            .collect()
    }

    /// Applies the optimizer to every held chunk, with gradients scaled by `factor`
    /// (mean over micro-batches times the clip coefficient).
    pub fn apply_optimizer(
        &mut self,
        exps: &[i32],
        micro_batches: u32,
        clip_coef: f64,
        t: u64,
        lr: f32,
    ) {
        let settings = self.optim;
        for u in 0..self.specs.len() {
            let factor = grad_buf::mean_factor(self.mode, exps[u], micro_batches, clip_coef);
            let shard = &mut self.shards[u];
            let len = shard.len();
            let mut g = vec![0f32; len];
            self.ledger.alloc(Category::Transient, 4 * len as u64);
            let mut off = 0;
            for r in &shard.ranges {
                let out = &mut g[off..off + r.len()];
                match (&shard.grads, &self.whole_grads) {
                    (Some(sg), _) => sg.to_f32(off..off + r.len(), factor, out),
                    (None, Some(w)) => w[u].to_f32(r.clone(), factor, out),
                    (None, None) => unreachable!("every stage keeps gradients somewhere"),
                }
                off += r.len();
            }
            let mut off = 0;
            for r in &shard.ranges {
                let n = r.len();
                // Stage 3 updates its shard; stages 0-2 update the full copy in place, chunk by
                // chunk. The optimizer is elementwise, so where it is cut changes no bits.
                let p = if self.stage == Stage::Zero3 {
                    &mut shard.params[off..off + n]
                } else {
                    &mut self.full[u][r.clone()]
                };
                let m = sub(&mut shard.opt.m, off, n);
                let v = sub(&mut shard.opt.v, off, n);
                settings.update(p, &g[off..off + n], m, v, t, lr);
                off += n;
            }
            self.ledger.free(Category::Transient, 4 * len as u64);
        }
    }
}

/// `v[off..off + n]`, or an empty slice for state this optimizer does not keep.
fn sub(v: &mut [f32], off: usize, n: usize) -> &mut [f32] {
    if v.is_empty() {
        v
    } else {
        &mut v[off..off + n]
    }
}
