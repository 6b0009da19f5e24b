//! What one rank owns: its shards (master parameters, optimizer state, reduced gradients), the
//! full parameter copy where the stage keeps one, the whole-model gradient accumulator for
//! stages 0 and 1, and the memory ledger that accounts for all of it.
//!
//! Where the fp32 masters live: in the shard at stage 3, and at every stage under bf16 mixed
//! precision (stages 0-2 then keep a bf16 full copy, `full_copy.rs`); in fp32 training at stages
//! 0-2 the full copy is the master.
//!
//! Shards are indexed by the shard map, never by attributes on tensors: `UnitShard::chunks` lists
//! the chunk indices this rank holds for a unit, and the shard buffers are those chunks
//! concatenated in ascending order (which is also the all-gather wire layout).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::engine::ledger::{Category, Ledger};
use crate::job::run_plan::RunPlan;
use crate::model::backend::Precision;
use crate::model::weights::WeightSource;
use crate::model::{Model, UnitSpec};
pub use crate::optim::OptimSettings;
use crate::optim::OptimState;
use crate::plan::memory::masters_in_shard;
use crate::plan::shard_map::one_run;
use crate::plan::{RankId, ShardMap, Stage};
use crate::reduce::{grad_buf, GradBuf, ReduceMode};
use crate::runtime::storage::{RecordKinds, TierError, TierFile, TierLayout, TierSpec};

use crate::runtime::step::state::full_copy::FullCopy;
use crate::runtime::step::state::offload;
use crate::runtime::step::state::owed::{Owed, OwedStep};
use crate::runtime::step::state::start_weights::{kept_chunks, read_chunks};

/// This rank's slice of one unit.
pub struct UnitShard {
    /// Chunk indices held, ascending (owned chunks; every chunk for stage 0's optimizer state).
    pub chunks: Vec<usize>,
    /// The chunks' element ranges within the unit.
    pub ranges: Vec<Range<usize>>,
    /// fp32 master parameters of the held chunks where the masters live in the shard (stage 3,
    /// and every stage under bf16); empty otherwise (the full copy is the master) or when they
    /// are on the tier.
    pub params: Vec<f32>,
    pub opt: OptimState,
    /// Reduced mean gradient of the held chunks as f32 (stages 2 and 3), before clipping: made
    /// from the exact sums when the unit's reduce-scatter completes, with its partial sum of
    /// squares beside it ([`RankState::grad_ss`]), so the accumulator's 8 bytes an element
    /// live only while the unit is reduced.
    pub grads: Option<Vec<f32>>,
}

impl UnitShard {
    pub fn len(&self) -> usize {
        self.ranges.iter().map(Range::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the held chunks are the whole unit of `numel` elements, in order: the shard is
    /// then laid out as the unit is (one rank holds every chunk of every unit).
    pub fn is_whole_unit(&self, numel: usize) -> bool {
        one_run(&self.ranges) == Some(0..numel)
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
    /// What the model computes with, which decides where the masters live.
    pub precision: Precision,
    /// Full parameters per unit (stages 0-2); empty for stage 3.
    pub full: Vec<FullCopy>,
    pub shards: Vec<UnitShard>,
    /// Whole-model gradient accumulator per unit (stages 0 and 1).
    pub whole_grads: Option<Vec<GradBuf>>,
    pub ledger: Ledger,
    /// The tier file holding what the placement moved out of RAM (`shards[u].params` and
    /// `shards[u].opt` are then empty). A shared mutex so that `&self` readers (chunk moves)
    /// can do I/O and the step can read ahead and write gradients on helper threads while it
    /// computes; the step joins those before it returns.
    pub tier: Option<Arc<Mutex<TierFile>>>,
    /// What the tier holds (fixed when the file is made), readable without its lock.
    kinds: RecordKinds,
    /// Stages 2-3: each unit's partial sum of squares of its reduced gradient shard, taken from
    /// the exact sums when the shard was made (what `Agree` needs; with gradients on the tier,
    /// without reading them back).
    pub grad_ss: Vec<crate::reduce::SumSquares>,
    /// With everything of stage 3 on the tier, the optimizer updates owed to the next forward
    /// (`owed.rs`); `None` where the update runs in the optimizer phase.
    pub owed: Option<Arc<Owed>>,
    /// With everything of stage 3 on the tier and clipping off, what runs each unit's update
    /// in the backward (`plan::tier::updates_in_backward`); `None` otherwise.
    pub in_backward: Option<Arc<offload::TierUpdater>>,
    /// The accelerator this rank computes on, opened from the model's backend (none on the
    /// CPU backend): the step puts each unit's parameters on it and takes the gradients off.
    pub device: Option<Arc<dyn crate::model::backend::Device>>,
}

/// One chunk's complete training state: master parameters and optimizer state. This is the
/// unit that checkpoints store and that rebalancing moves between ranks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChunkState {
    pub unit: u32,
    pub index: u32,
    pub params: Vec<f32>,
    /// Adam m or SGD momentum (empty when the optimizer keeps none).
    pub m: Vec<f32>,
    /// Adam v (empty for SGD).
    pub v: Vec<f32>,
}

/// Where a rank being built gets chunk states from: `None` means the chunk is unavailable.
pub type ChunkSource<'a> = dyn Fn(usize, usize) -> Option<ChunkState> + 'a;

/// What a rank's state starts from.
pub enum StartFrom<'a> {
    /// Starting weights (given ones, or the model's initialisation) with fresh optimizer state.
    Weights(&'a dyn WeightSource),
    /// Saved chunk states: a checkpoint read for a resume, or the parts a coordinator sent.
    Chunks(&'a ChunkSource<'a>),
}

/// Why a rank's starting state could not be built.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("restoring its state: {0}")]
    Restore(String),
    #[error("building its state: {0}")]
    Build(String),
}

impl RankState {
    /// How every rank of a run starts, in-process or in a worker process: its state for `map`,
    /// fresh or restored, under the run plan's stage, reduction, optimizer and precision.
    pub fn start(
        rank: RankId,
        plan: &RunPlan,
        model: &Arc<dyn Model>,
        map: &ShardMap,
        storage: Option<&TierSpec>,
        from: StartFrom<'_>,
    ) -> Result<Self, StartError> {
        let (stage, mode, optim, precision) = (plan.stage, plan.reduce, plan.optim, plan.precision);
        let model = Arc::clone(model);
        match from {
            StartFrom::Weights(weights) => Self::from_full_params(
                rank,
                stage,
                mode,
                model,
                map.clone(),
                optim,
                precision,
                weights,
                storage,
            )
            .map_err(StartError::Build),
            StartFrom::Chunks(source) => Self::from_chunks(
                rank,
                stage,
                mode,
                model,
                map.clone(),
                optim,
                precision,
                source,
                storage,
            )
            .map_err(StartError::Restore),
        }
    }

    /// Builds the rank's state from starting weights with fresh optimizer state. The chunks
    /// the rank keeps are read unit by unit, each unit's in one request of coalesced ranges:
    /// under stage 3 only the rank's own chunks are read, and no more than one unit's worth is
    /// held beyond the state being built.
    #[allow(clippy::too_many_arguments)]
    pub fn from_full_params(
        rank: RankId,
        stage: Stage,
        mode: ReduceMode,
        model: Arc<dyn Model>,
        map: ShardMap,
        optim: OptimSettings,
        precision: Precision,
        weights: &dyn WeightSource,
        storage: Option<&TierSpec>,
    ) -> Result<Self, String> {
        let probe = OptimState::new(optim.kind, 1);
        // The chunks read of the unit being built, taken as they are used.
        type Current = Option<(usize, BTreeMap<usize, Vec<f32>>)>;
        let current: std::cell::RefCell<Current> = Default::default();
        let failed: std::cell::RefCell<Option<String>> = Default::default();
        let fresh = |u: usize, i: usize| {
            let mut cur = current.borrow_mut();
            if cur.as_ref().map(|c| c.0) != Some(u) {
                let read = if u < map.units.len() {
                    read_chunks(weights, &map, u, &kept_chunks(&map, u, rank, stage))
                } else {
                    Err(format!("unit {u} is not in the map"))
                };
                match read {
                    Ok(chunks) => *cur = Some((u, chunks)),
                    Err(e) => {
                        *failed.borrow_mut() = Some(e);
                        return None;
                    }
                }
            }
            let params = cur.as_mut()?.1.remove(&i)?;
            let zeros = |keep: bool| {
                if keep {
                    vec![0f32; params.len()]
                } else {
                    Vec::new()
                }
            };
            Some(ChunkState {
                unit: u as u32,
                index: i as u32,
                m: zeros(!probe.m.is_empty()),
                v: zeros(!probe.v.is_empty()),
                params,
            })
        };
        Self::from_chunks(
            rank,
            stage,
            mode,
            model,
            map.clone(),
            optim,
            precision,
            &fresh,
            storage,
        )
        .map_err(|e| match failed.take() {
            Some(why) => format!("reading {}: {why}", weights.describe()),
            None => e,
        })
    }

    /// Builds the rank's state for `map` from chunk states. A rank reads the optimizer state of
    /// the chunks it owns (every chunk for stage 0) and the parameters of the chunks it keeps
    /// (every chunk for stages 0-2, which hold a full copy; its own for stage 3). With a tier,
    /// what the placement moves out of RAM is written there unit by unit. Where the masters
    /// live in the shard, the owned chunks' parameters must be their fp32 masters; the others'
    /// only feed the bf16 copy.
    #[allow(clippy::too_many_arguments)]
    pub fn from_chunks(
        rank: RankId,
        stage: Stage,
        mode: ReduceMode,
        model: Arc<dyn Model>,
        map: ShardMap,
        optim: OptimSettings,
        precision: Precision,
        source: &ChunkSource<'_>,
        storage: Option<&TierSpec>,
    ) -> Result<Self, String> {
        let specs = model.units();
        if specs.len() != map.units.len()
            || specs
                .iter()
                .zip(&map.units)
                .any(|(s, u)| s.numel() != u.numel)
        {
            return Err("the shard map was planned for a different model".into());
        }
        let mut tier =
            open_tier(rank, stage, &map, optim, precision, storage).map_err(|e| e.to_string())?;
        let build = UnitBuild {
            rank,
            stage,
            map: &map,
            optim,
            precision,
            masters_in_shard: masters_in_shard(stage, precision.param_bytes()),
            // Updated in the backward, a unit's gradient shard lives only until its update.
            grads_leave_ram: tier
                .as_ref()
                .is_some_and(|t| t.layout.kinds.grads > 0 || t.two_copies()),
        };
        let mut ledger = Ledger::default();
        let mut shards = Vec::with_capacity(specs.len());
        let mut full = Vec::with_capacity(specs.len());
        for u in 0..map.units.len() {
            let (shard, copy) = build.unit(u, source, tier.as_mut(), &mut ledger)?;
            shards.push(shard);
            full.push(copy);
        }
        let whole_grads = matches!(stage, Stage::Zero0 | Stage::Zero1).then(|| {
            map.units
                .iter()
                .map(|u| GradBuf::zeros(mode, u.numel))
                .collect::<Vec<_>>()
        });
        if let Some(w) = &whole_grads {
            ledger.alloc(Category::Grads, w.iter().map(|g| g.bytes() as u64).sum());
        }
        // The chunk states taken apart above were small heap blocks; without this the heap
        // keeps their pages for the whole run (0.36 GB at d_model 2048, two layers, one rank).
        crate::runtime::alloc::release_free_memory();
        let (owed, in_backward) = tier_updates(
            &model,
            &shards,
            stage,
            optim,
            precision,
            tier.as_ref(),
            storage,
        );
        let device = model.backend().open_device();
        Ok(Self {
            rank,
            stage,
            mode,
            model,
            specs,
            grad_ss: vec![crate::reduce::SumSquares::zero(mode); map.units.len()],
            map,
            optim,
            precision,
            full,
            shards,
            whole_grads,
            ledger,
            kinds: tier
                .as_ref()
                .map_or(RecordKinds::default(), |t| t.layout.kinds),
            tier: tier.map(|t| Arc::new(Mutex::new(t))),
            owed,
            in_backward,
            device,
        })
    }

    /// Whatever this rank holds of chunk (unit, index): its parameters (always, for stages 0-2;
    /// if held, for stage 3) and its optimizer state if the rank keeps it (empty otherwise).
    /// A tier read that fails is logged and the chunk counts as not held; use
    /// [`RankState::try_chunk_state`] to see the error.
    pub fn chunk_state(&self, unit: usize, index: usize) -> Option<ChunkState> {
        self.try_chunk_state(unit, index).unwrap_or_else(|e| {
            tracing::error!(rank = self.rank, "{e}");
            None
        })
    }

    /// Like [`RankState::chunk_state`], with the tier's errors.
    pub fn try_chunk_state(
        &self,
        unit: usize,
        index: usize,
    ) -> Result<Option<ChunkState>, TierError> {
        let Some(shard) = self.shards.get(unit) else {
            return Ok(None);
        };
        let Some(r) = self
            .map
            .units
            .get(unit)
            .filter(|u| index < u.owners.len())
            .map(|_| self.map.chunk_range(unit, index))
        else {
            return Ok(None);
        };
        let at = shard.chunks.iter().position(|&c| c == index);
        let off = at.map(|a| shard.ranges[..a].iter().map(Range::len).sum::<usize>());
        if let (Some(t), Some(_)) = (&self.tier, off) {
            // In the shard: what lives on the tier is read from it (tier_reads.rs).
            let mut out = Vec::new();
            self.tiered_chunks(t, unit, false, &|c| c == index, false, &mut |group| {
                out.extend(group);
                Ok(())
            })?;
            return Ok(out.pop());
        }
        // Owned chunks give their masters; stages 0-2 give the others from the full copy.
        let params = match (self.masters_in_shard(), off) {
            (true, Some(off)) => shard.params[off..off + r.len()].to_vec(),
            _ if self.stage == Stage::Zero3 => return Ok(None),
            _ => self.full[unit].values(r.clone()),
        };
        let slice = |v: &[f32]| match off {
            Some(off) if !v.is_empty() => v[off..off + r.len()].to_vec(),
            _ => Vec::new(),
        };
        Ok(Some(ChunkState {
            unit: unit as u32,
            index: index as u32,
            params,
            m: slice(&shard.opt.m),
            v: slice(&shard.opt.v),
        }))
    }

    /// The complete state of every chunk this rank owns under the map.
    pub fn owned_chunk_states(&self) -> Result<Vec<ChunkState>, TierError> {
        let mut out = Vec::new();
        if let Some(t) = &self.tier {
            for u in 0..self.shards.len() {
                self.tiered_in_unit(t, u, true, &mut out)?;
            }
            return Ok(out);
        }
        for c in self.map.owned_chunks(self.rank) {
            out.extend(self.try_chunk_state(c.unit as usize, c.index as usize)?);
        }
        Ok(out)
    }

    pub fn units(&self) -> usize {
        self.specs.len()
    }

    /// Applies the optimizer to every held chunk, with the mean gradient over micro-batches
    /// times the clip coefficient; with `defer` and a placement that allows it, owes the updates
    /// to the next forward instead (`owed.rs`). `unit_done` is called as each unit's update
    /// finishes (the step's progress).
    #[allow(clippy::too_many_arguments)]
    pub fn apply_optimizer(
        &mut self,
        exps: &[i32],
        micro_batches: u32,
        clip_coef: f64,
        t: u64,
        lr: f32,
        defer: bool,
        unit_done: &mut dyn FnMut(),
    ) -> Result<(), TierError> {
        if let (Some(owed), Some(tier)) = (&self.owed, &self.tier) {
            // Normally the forward has run them all; an aborted pass may have left some.
            owed.settle(tier)?;
            if defer {
                owed.owe(OwedStep { t, lr, clip_coef });
                (0..self.specs.len()).for_each(|_| unit_done());
                return Ok(());
            }
        }
        // With a tier, one stream of reads and writes runs through every unit's records.
        let mut stream = offload::UpdateStream::default();
        let result = self.update_units(
            &mut stream,
            exps,
            micro_batches,
            clip_coef,
            t,
            lr,
            unit_done,
        );
        let finished = match self.tier.as_ref() {
            Some(tier) => stream.finish(&mut tier.lock().unwrap_or_else(|p| p.into_inner())),
            None => Ok(()),
        };
        result.and(finished)
    }

    #[allow(clippy::too_many_arguments)]
    fn update_units(
        &mut self,
        stream: &mut offload::UpdateStream,
        exps: &[i32],
        micro_batches: u32,
        clip_coef: f64,
        t: u64,
        lr: f32,
        unit_done: &mut dyn FnMut(),
    ) -> Result<(), TierError> {
        let settings = self.optim;
        let model = Arc::clone(&self.model);
        let be = model.backend();
        let masters_in_shard = self.masters_in_shard();
        for u in 0..self.specs.len() {
            let factor = grad_buf::mean_factor(self.mode, exps[u], micro_batches);
            let grads_on_tier = self.grads_on_tier();
            let shard = &mut self.shards[u];
            // Stages 2-3 keep the shard's f32 mean, which is clipped where it lies (the next
            // reduce-scatter rewrites all of it) and put back after the update; stages 0-1
            // widen their owned ranges of the whole-model accumulators into a buffer of the
            // step; with gradients on the tier the update reads them there.
            let (mut g, transient) = match (shard.grads.take(), &self.whole_grads) {
                (Some(sg), _) => (sg, 0),
                (None, _) if grads_on_tier => (Vec::new(), 0),
                (None, Some(w)) => {
                    let mut g = vec![0f32; shard.len()];
                    let mut off = 0;
                    for r in &shard.ranges {
                        w[u].to_f32(r.clone(), factor, &mut g[off..off + r.len()]);
                        off += r.len();
                    }
                    let bytes = 4 * g.len() as u64;
                    (g, bytes)
                }
                (None, None) => unreachable!("every stage keeps gradients somewhere"),
            };
            let kept_shard = matches!(self.stage, Stage::Zero2 | Stage::Zero3) && !grads_on_tier;
            self.ledger.alloc(Category::Transient, transient);
            grad_buf::apply_clip(&mut g, clip_coef);
            let res = if let Some(tier) = self.tier.as_ref() {
                let mut tier = tier.lock().unwrap_or_else(|p| p.into_inner());
                let args = offload::StepArgs {
                    be,
                    settings,
                    masters_in_shard,
                    t,
                    lr,
                    g: &g,
                    clip_coef,
                    next_copy: false,
                };
                let parts = offload::ShardParts {
                    ranges: &shard.ranges,
                    params: &mut shard.params,
                    m: &mut shard.opt.m,
                    v: &mut shard.opt.v,
                    params_in: &[],
                    params_out: &mut [],
                };
                offload::update_unit(&mut tier, stream, u, parts, &mut self.full[u], &args)
            } else {
                let mut off = 0;
                for r in &shard.ranges {
                    let n = r.len();
                    // Masters in the shard are updated there (and a bf16 full copy refreshed
                    // from them); otherwise the fp32 full copy is updated in place, chunk by
                    // chunk. The optimizer is elementwise, so where it is cut changes no bits.
                    let m = sub(&mut shard.opt.m, off, n);
                    let v = sub(&mut shard.opt.v, off, n);
                    let g = &g[off..off + n];
                    if masters_in_shard {
                        let p = &mut shard.params[off..off + n];
                        be.optimizer_update(&settings, p, g, m, v, t, lr);
                        if !self.full[u].is_empty() {
                            self.full[u].set_from_masters(r.clone(), p);
                        }
                    } else {
                        let p = &mut self.full[u]
                            .f32s_mut()
                            .expect("a full copy without masters beside it is fp32")[r.clone()];
                        be.optimizer_update(&settings, p, g, m, v, t, lr);
                    }
                    off += n;
                }
                Ok(())
            };
            if kept_shard {
                shard.grads = Some(g);
            }
            self.ledger.free(Category::Transient, transient);
            res?;
            unit_done();
        }
        Ok(())
    }

    /// Whether the fp32 masters live in the shards (stage 3, and every stage under bf16) rather
    /// than in the full copy.
    pub fn masters_in_shard(&self) -> bool {
        masters_in_shard(self.stage, self.precision.param_bytes())
    }

    /// What this rank keeps on its tier (nothing without one).
    pub fn tier_kinds(&self) -> RecordKinds {
        self.kinds
    }

    /// Bytes of this rank's tier file (0 without one).
    pub fn tier_bytes(&self) -> u64 {
        self.tier.as_ref().map_or(0, |t| {
            t.lock().unwrap_or_else(|p| p.into_inner()).file_bytes()
        })
    }

    /// Starts a pass of a step whose updates run in the backward: what an earlier pass (redone,
    /// skipped or abandoned) wrote to the other copies is forgotten.
    pub fn begin_backward_updates(&self) {
        if let (Some(_), Some(t)) = (&self.in_backward, &self.tier) {
            t.lock().unwrap_or_else(|p| p.into_inner()).drop_next();
        }
    }

    /// The step is agreed: every unit's update, run in the backward, becomes its state. Every
    /// unit must have been updated (an error otherwise, with nothing committed).
    pub fn commit_backward_updates(&self) -> Result<(), TierError> {
        let Some(t) = &self.tier else {
            return Ok(());
        };
        let mut t = t.lock().unwrap_or_else(|p| p.into_inner());
        let units = t.layout.unit_lens.len();
        let staged = t.staged_units();
        if staged != units {
            t.drop_next();
            return Err(TierError::Helper(format!(
                "{staged} of {units} units were updated in the backward; the step's updates were not applied"
            )));
        }
        t.commit_next();
        Ok(())
    }

    /// Whether the reduced gradient shards live on the tier (stages 2-3 with `offload_grads`).
    pub fn grads_on_tier(&self) -> bool {
        self.tier_kinds().grads > 0
    }

    /// The tier file, for I/O that runs beside compute (the step's prefetch and gradient
    /// writes); `None` without a tier.
    pub fn tier_shared(&self) -> Option<Arc<Mutex<TierFile>>> {
        self.tier.clone()
    }

    /// The folder of this rank's tier file (none without a tier).
    pub fn tier_dir(&self) -> Option<std::path::PathBuf> {
        let t = self.tier.as_ref()?;
        let t = t.lock().unwrap_or_else(|p| p.into_inner());
        t.path().parent().map(std::path::Path::to_path_buf)
    }

    /// Whether the parameter shard lives on the tier (stage 3 with `offload_params`).
    pub fn params_on_tier(&self) -> bool {
        self.tier_kinds().params
    }
}

/// Whether the optimizer updates are owed to the next forward (`owed.rs`): at stage 3 with the
/// parameters, all the optimizer's state and the gradients on the tier, so that an update
/// touches nothing in RAM and the forward's read of the parameters can be the update's.
/// What building each unit's shard of a rank's state needs.
struct UnitBuild<'a> {
    rank: RankId,
    stage: Stage,
    map: &'a ShardMap,
    optim: OptimSettings,
    precision: Precision,
    masters_in_shard: bool,
    grads_leave_ram: bool,
}

impl UnitBuild<'_> {
    /// Unit `u`'s shard and full copy from its chunk states, spilled to the tier where the
    /// placement says, and counted in `ledger`.
    fn unit(
        &self,
        u: usize,
        source: &ChunkSource<'_>,
        tier: Option<&mut TierFile>,
        ledger: &mut Ledger,
    ) -> Result<(UnitShard, FullCopy), String> {
        let (map, stage) = (self.map, self.stage);
        let all: Vec<usize> = (0..map.units[u].owners.len()).collect();
        let chunks: Vec<usize> = if stage == Stage::Zero0 {
            all.clone()
        } else {
            map.owned_in_unit(u, self.rank).collect()
        };
        let by_index = self.kept_states(u, source)?;
        let ranges: Vec<Range<usize>> = chunks.iter().map(|&i| map.chunk_range(u, i)).collect();
        let len: usize = ranges.iter().map(Range::len).sum();
        let mut opt = owned_optimizer_state(self.optim, u, &chunks, &ranges, &by_index)?;
        // Concatenated into buffers of the exact size: collecting a flat map grows by
        // doubling and would keep up to twice the unit's bytes.
        let concat = |ids: &[usize], n: usize| {
            let mut out = Vec::with_capacity(n);
            ids.iter()
                .for_each(|i| out.extend_from_slice(&by_index[i].params));
            out
        };
        let full = if stage != Stage::Zero3 {
            let values = concat(&all, map.units[u].numel);
            FullCopy::from_values(values, self.precision == Precision::Bf16)
        } else {
            FullCopy::default()
        };
        let mut shard_params = if self.masters_in_shard {
            concat(&chunks, len)
        } else {
            Vec::new()
        };
        if let Some(t) = tier {
            offload::spill_unit(t, u, &shard_params, &opt.m, &opt.v).map_err(|e| e.to_string())?;
            if t.layout.kinds.params {
                shard_params = Vec::new();
            }
            if t.layout.kinds.state > 0 {
                opt = OptimState {
                    m: Vec::new(),
                    v: Vec::new(),
                };
            }
        }
        let grads = (matches!(stage, Stage::Zero2 | Stage::Zero3) && !self.grads_leave_ram)
            .then(|| vec![0f32; len]);
        // Stage 3's shard is its parameters; the owned masters beside a full copy count
        // with the optimizer state they are updated with (the paper's 12 bytes for Adam).
        let masters = 4 * shard_params.len() as u64;
        let (params_bytes, masters_as_opt) = match stage {
            Stage::Zero3 => (masters, 0),
            _ => (0, masters),
        };
        ledger.alloc(Category::Params, params_bytes + full.bytes());
        ledger.alloc(Category::Optimizer, opt.bytes() as u64 + masters_as_opt);
        ledger.alloc(
            Category::Grads,
            grads.as_ref().map_or(0, |g| 4 * g.len() as u64),
        );
        let shard = UnitShard {
            chunks,
            ranges,
            params: shard_params,
            opt,
            grads,
        };
        Ok((shard, full))
    }

    /// The states of the chunks of unit `u` this rank keeps, by index, each of its map's size.
    fn kept_states(
        &self,
        u: usize,
        source: &ChunkSource<'_>,
    ) -> Result<BTreeMap<usize, ChunkState>, String> {
        let map = self.map;
        let mut by_index = BTreeMap::new();
        for i in kept_chunks(map, u, self.rank, self.stage) {
            let c = source(u, i).ok_or_else(|| format!("chunk {u}/{i} is not available"))?;
            if c.params.len() != map.chunk_range(u, i).len() {
                return Err(format!(
                    "chunk {u}/{i} has {} parameters, expected {}",
                    c.params.len(),
                    map.chunk_range(u, i).len()
                ));
            }
            by_index.insert(i, c);
        }
        Ok(by_index)
    }
}

/// The optimizer state of unit `u`'s owned `chunks` (at `ranges`), concatenated in order.
fn owned_optimizer_state(
    optim: OptimSettings,
    u: usize,
    chunks: &[usize],
    ranges: &[Range<usize>],
    by_index: &BTreeMap<usize, ChunkState>,
) -> Result<OptimState, String> {
    let len: usize = ranges.iter().map(Range::len).sum();
    let mut opt = OptimState::new(optim.kind, len);
    let mut off = 0;
    for (&i, r) in chunks.iter().zip(ranges) {
        let c = &by_index[&i];
        copy_state(&mut opt.m, off, &c.m, r.len()).map_err(|e| format!("chunk {u}/{i} m: {e}"))?;
        copy_state(&mut opt.v, off, &c.v, r.len()).map_err(|e| format!("chunk {u}/{i} v: {e}"))?;
        off += r.len();
    }
    Ok(opt)
}

/// Where the tier's placement runs updates outside the optimizer phase: the updates owed to
/// the next forward, and the updater that runs each unit's in the backward.
fn tier_updates(
    model: &Arc<dyn Model>,
    shards: &[UnitShard],
    stage: Stage,
    optim: OptimSettings,
    precision: Precision,
    tier: Option<&TierFile>,
    storage: Option<&TierSpec>,
) -> (Option<Arc<Owed>>, Option<Arc<offload::TierUpdater>>) {
    let updater = || {
        let ranges = shards.iter().map(|s| s.ranges.clone()).collect();
        offload::TierUpdater::new(Arc::clone(model), optim, ranges)
    };
    let owed = tier
        .filter(|t| defers_update(stage, t.layout.kinds, optim))
        .map(|_| Arc::new(Owed::new(Arc::new(updater()))));
    // Under bf16 the gathered unit holds rounded values, not the masters the update needs.
    let reuses_params =
        storage.is_some_and(|s| s.update_reuses_params) && precision == Precision::Fp32;
    let in_backward = tier
        .filter(|t| t.two_copies())
        .map(|_| Arc::new(updater().reusing_params(reuses_params)));
    (owed, in_backward)
}

fn defers_update(stage: Stage, kinds: RecordKinds, optim: OptimSettings) -> bool {
    stage == Stage::Zero3
        && kinds.params
        && kinds.grads > 0
        && kinds.state as u64 == optim.state_per_param()
}

/// The tier file for this rank's state under `map`, if the placement puts anything there.
fn open_tier(
    rank: RankId,
    stage: Stage,
    map: &ShardMap,
    optim: OptimSettings,
    precision: Precision,
    storage: Option<&TierSpec>,
) -> Result<Option<TierFile>, TierError> {
    let Some(spec) = storage else {
        return Ok(None);
    };
    let mut kinds = spec
        .placement
        .kinds(stage, optim.state_per_param(), precision.param_bytes());
    if kinds.values() == 0 {
        return Ok(None);
    }
    if spec.update_in_backward {
        // Each unit's gradient shard goes straight into its update (`TierUpdater`).
        kinds.grads = 0;
    }
    let lens = (0..map.units.len())
        .map(|u| {
            if stage == Stage::Zero0 {
                map.units[u].numel
            } else {
                map.owned_elems_in_unit(u, rank)
            }
        })
        .collect();
    let layout = TierLayout::new(lens, spec.tile_elems, kinds);
    spec.open(rank, map.epoch, layout).map(Some)
}

/// Copies a chunk's optimizer state into the shard buffer at `off` (both empty if unused).
fn copy_state(dst: &mut [f32], off: usize, src: &[f32], n: usize) -> Result<(), String> {
    match (dst.is_empty(), src.len()) {
        (true, 0) => Ok(()),
        (false, len) if len == n => {
            dst[off..off + n].copy_from_slice(src);
            Ok(())
        }
        (_, len) => Err(format!(
            "{len} values where {} were expected",
            if dst.is_empty() { 0 } else { n }
        )),
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

impl RankState {
    /// Bytes read from and written to the tier and seconds spent waiting on it, so far.
    pub fn tier_counters(&self) -> (u64, u64, f64) {
        self.tier.as_ref().map_or((0, 0, 0.0), |t| {
            let t = t.lock().unwrap_or_else(|p| p.into_inner());
            (t.stats.read_bytes, t.stats.write_bytes, t.stats.wait_s)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(ranges: &[Range<usize>]) -> UnitShard {
        UnitShard {
            chunks: (0..ranges.len()).collect(),
            ranges: ranges.to_vec(),
            params: Vec::new(),
            opt: OptimState::default(),
            grads: None,
        }
    }

    #[test]
    fn a_shard_of_every_chunk_in_order_is_the_whole_unit() {
        assert!(shard(&[0..4, 4..8, 8..10]).is_whole_unit(10));
        assert!(shard(&[Range { start: 0, end: 10 }]).is_whole_unit(10));
        // A chunk missing, out of order, or the unit longer than the chunks.
        assert!(!shard(&[0..4, 8..10]).is_whole_unit(10));
        assert!(!shard(&[4..8, 0..4, 8..10]).is_whole_unit(10));
        assert!(!shard(&[0..4, 4..8]).is_whole_unit(10));
        assert!(!shard(&[]).is_whole_unit(10));
    }
}
