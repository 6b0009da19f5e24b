//! Executes one training step on one rank: interprets the stage's phase program (see
//! `plan::schedule`) over the rank's state, the communicator and its micro-batches.
//!
//! The exact-reduction contract lives here: every micro-batch gradient is quantized with the
//! per-unit scale fixed by the plan's bounds; after backward, ranks agree (small all-reduce) on
//! losses, per-unit maxima, the overflow flag and the exact global norm. An overflowed first
//! attempt is redone with bounds from the agreed maxima, so a step takes at most two passes.
//!
//! Design: docs/sharding.md.

mod device;
mod device_pass;
mod eval;
mod program;
mod reduce;
pub mod work;

use crate::runtime::clock::Stopwatch;
use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::data::Dataset;
use crate::engine::ledger::Category;
use crate::engine::messages::{StepPlan, StepReport};
use crate::model::backend::{DeviceError, Precision};
use crate::model::gemm::round_bf16;
use crate::model::tie::Ties;
use crate::model::{Kept, MicroBatch};
use crate::plan::schedule::{phases, Phase};
use crate::plan::volume::Volume;
use crate::plan::Stage;
use crate::reduce::exact::{self, QuantStats};
use crate::reduce::{GradBuf, SumSquares};
use crate::runtime::step::comm::collectives;
use crate::runtime::step::comm::{Comm, CommError};
use crate::runtime::step::state::rank_state::RankState;
use crate::runtime::step::state::tier_io::TierIo;
use crate::runtime::transport::{Tag, TagKind, Transport};
use crate::wire::f32s::{decode_bf16_into, decode_f32_into, put_bf16s, put_f32s};

/// Per-run settings the step needs besides the plan.
#[derive(Clone, Debug)]
pub struct ExecConfig {
    pub micro_batch_size: usize,
    pub seq_len: usize,
    pub seed: u64,
    pub max_live_units: usize,
    /// Keep forward intermediates for the backward (`Model::forward_keep`).
    pub keep_activations: bool,
    /// Global-norm clipping threshold; 0 disables.
    pub grad_clip: f64,
    /// Fault injection: ranks that vanish halfway through a round between steps.
    pub round_kills: Vec<crate::config::RoundKill>,
    /// Counts unit passes for the progress line of long steps.
    pub progress: std::sync::Arc<crate::runtime::step::progress::RunProgress>,
    /// `Bf16`: the model sees every parameter rounded to bf16, and ZeRO-3 gathers them as bf16.
    pub precision: Precision,
    /// With a device, the buffers of each kind the device plan has room for
    /// (`plan::device::DevicePlan::param_buffers`): 2 copies ahead of compute, 1 waits.
    pub device_buffers: usize,
    /// The held-out data a step whose plan asks for it evaluates (`StepPlan::eval`).
    pub eval_data: Option<std::sync::Arc<Dataset>>,
}

impl ExecConfig {
    /// The run plan's executor settings with the memory plan's activation choice and the
    /// runtime's progress counters.
    pub fn new(
        settings: &crate::job::run_plan::ExecSettings,
        keep_activations: bool,
        device_buffers: usize,
        progress: std::sync::Arc<crate::runtime::step::progress::RunProgress>,
    ) -> Self {
        Self {
            micro_batch_size: settings.micro_batch_size,
            seq_len: settings.seq_len,
            seed: settings.seed,
            max_live_units: settings.max_live_units,
            keep_activations,
            grad_clip: settings.grad_clip,
            round_kills: settings.round_kills.clone(),
            progress,
            precision: settings.precision,
            device_buffers,
            eval_data: None,
        }
    }
}

/// A device's refusal as the step's error: the planner should have refused the run first.
fn device_error(e: DeviceError) -> CommError {
    CommError::Storage(format!("device: {e}"))
}

/// The most passes a step takes (the first may overflow the fixed-point range).
const MAX_ATTEMPTS: u8 = 2;

/// What every rank contributes to the agreement after backward.
#[derive(Serialize, Deserialize)]
struct AgreeMsg {
    losses: Vec<(u32, f32)>,
    max_abs: Vec<f32>,
    overflow: bool,
    sum_squares: Vec<SumSquares>,
}

/// The agreed outcome of a pass, identical on every rank.
struct Agreed {
    losses: Vec<f32>,
    max_abs: Vec<f32>,
    overflow: bool,
    non_finite: bool,
    norm: f64,
}

/// Runs one step. Errors are expected failures (a peer timed out or the run is stopping).
pub fn run_step<T: Transport>(
    st: &mut RankState,
    comm: &mut Comm<T>,
    plan: &StepPlan,
    data: &Dataset,
    cfg: &ExecConfig,
    vanish_at: Option<usize>,
) -> Result<StepReport, CommError> {
    let started = Stopwatch::start();
    comm.begin_step(plan.epoch, plan.step);
    let io_before = st.tier_counters();
    let device_before = st.device.as_ref().map(|d| d.counters());
    let mbs = local_micro_batches(st, plan, data, cfg);
    let ranks = st.map.members.len();
    let in_backward = st.in_backward.is_some();
    let program = phases(
        st.stage,
        st.units() as u32,
        cfg.max_live_units,
        ranks,
        in_backward,
    );
    let (ties, terms) = gradient_terms(st, plan)?;
    let mut bounds = plan.grad_bounds.clone();
    let (mut compute_s, mut optimizer_s) = (0.0, 0.0);
    for attempt in 0..MAX_ATTEMPTS {
        let exps: Vec<i32> = bounds
            .iter()
            .zip(&terms)
            .map(|(&b, &t)| exact::scale_exponent(b, t))
            .collect();
        let mut pass = Pass::new(st, plan, &mbs, cfg, attempt, exps, (&ties, &terms));
        // An injected kill strikes halfway through the phase program.
        let stop = vanish_at.map(|p| p.min(program.len() / 2));
        let outcome = pass.run(comm, &program, stop);
        compute_s += pass.compute_s;
        optimizer_s += pass.optimizer_s;
        pass.release();
        let agreed = outcome?;
        let redo = agreed.overflow && !agreed.non_finite && attempt + 1 < MAX_ATTEMPTS;
        if redo {
            bounds = agreed
                .max_abs
                .iter()
                .map(|&m| exact::next_bound(m))
                .collect();
            continue;
        }
        let stats = comm.stats();
        let io = st.tier_counters();
        let eval_losses = match plan.eval {
            true => eval::evaluate(st, comm, plan, cfg)?,
            false => Vec::new(),
        };
        return Ok(StepReport {
            rank: st.rank,
            epoch: plan.epoch,
            step: plan.step,
            losses: agreed.losses,
            unit_max_abs: agreed.max_abs,
            grad_norm: agreed.norm,
            clip_coef: exact::clip_coefficient(agreed.norm, cfg.grad_clip),
            skipped: agreed.overflow,
            attempts: attempt as u32 + 1,
            sent: Volume {
                param_elems: stats.param_elems_sent,
                grad_elems: stats.grad_elems_sent,
            },
            bytes_sent: stats.bytes_sent,
            resident: st.ledger.resident(),
            peak_bytes: st.ledger.peak_total(),
            peak_gathered_bytes: st.ledger.peak_gathered(),
            stale_dropped: stats.stale_dropped + stats.duplicates_dropped,
            compute_s,
            optimizer_s,
            busy_s: started.elapsed().as_secs_f64(),
            tier_read_bytes: io.0 - io_before.0,
            tier_write_bytes: io.1 - io_before.1,
            io_wait_s: io.2 - io_before.2,
            tier_bytes: st.tier_bytes(),
            device: st
                .device
                .as_ref()
                .zip(device_before)
                .map(|(d, before)| d.counters().since(&before)),
            eval_losses,
        });
    }
    unreachable!("the last attempt always returns")
}

/// This rank's micro-batches of the step, with their indices in the global batch.
fn local_micro_batches(
    st: &RankState,
    plan: &StepPlan,
    data: &Dataset,
    cfg: &ExecConfig,
) -> Vec<(u32, MicroBatch)> {
    let local = plan.local_micro_batches(st.rank);
    local
        .map(|i| {
            (
                i,
                data.micro_batch(
                    cfg.seed,
                    plan.step,
                    i as u64,
                    cfg.micro_batch_size,
                    cfg.seq_len,
                ),
            )
        })
        .collect()
}

/// The model's tied parameters, and the gradient terms each unit's accumulator takes: the
/// step's micro-batches times the uses of a lent parameter, which fix the quantization scale.
fn gradient_terms(st: &RankState, plan: &StepPlan) -> Result<(Ties, Vec<u32>), CommError> {
    let ties = Ties::of(&*st.model).map_err(|what| CommError::Protocol {
        from: st.rank,
        what: format!("the model's tied parameters: {what}"),
    })?;
    let terms: Vec<u32> = ties
        .terms()
        .iter()
        .map(|t| t * plan.micro_batches)
        .collect();
    Ok((ties, terms))
}

/// Transient state of one pass over the phase program.
struct Pass<'a> {
    st: &'a mut RankState,
    plan: &'a StepPlan,
    mbs: &'a [(u32, MicroBatch)],
    cfg: &'a ExecConfig,
    attempt: u8,
    exps: Vec<i32>,
    /// The model's tied parameters, and the gradient terms each unit's accumulator takes (the
    /// micro-batches, times the uses of a lent parameter).
    ties: (&'a Ties, &'a [u32]),
    /// Values of each tie's parameter, copied at the owner's forward for the user.
    lent: BTreeMap<usize, Vec<f32>>,
    /// Accumulators of owner units that a user's backward started (stages 2-3).
    early_acc: BTreeMap<u32, GradBuf>,
    /// Input activation of each unit (index u >= 1) per local micro-batch.
    saved: Vec<Vec<Vec<f32>>>,
    /// What each unit's forward kept for its backward, per local micro-batch
    /// (`keep_activations`).
    kept: Vec<Vec<Option<Kept>>>,
    /// Gradient flowing backward, per local micro-batch.
    grad_out: Vec<Vec<f32>>,
    losses: Vec<(u32, f32)>,
    gathered: BTreeMap<u32, Vec<f32>>,
    /// Stage 3 with parameters on the tier: the shard read for a gather, until its wait.
    own: BTreeMap<u32, Vec<f32>>,
    /// Parameter shards read for the backward's gathers, kept for the units' updates in the
    /// backward (`TierUpdater::reuses_params`); with one rank the gathered unit is the shard
    /// and is kept at its `Free` (the units in `keep_at_free`).
    kept_params: BTreeMap<u32, Vec<f32>>,
    keep_at_free: BTreeSet<u32>,
    /// The last gathered buffer freed, for the next gather of its size: every gather writes
    /// all of it, and a fresh buffer costs page faults (0.1 s for 200 MiB) on the cores that
    /// compute.
    spare_gathered: Option<Vec<f32>>,
    /// Reads ahead and writes gradients beside compute, when the tier holds them.
    tier_io: Option<TierIo>,
    unit_acc: BTreeMap<u32, GradBuf>,
    stats: Vec<QuantStats>,
    agreed: Option<Agreed>,
    compute_s: f64,
    optimizer_s: f64,
    /// The rank's device, when it computes on one.
    dev: Option<device::OnDevice>,
    /// A held-out evaluation: the forward alone, and `Agree` agrees on the losses only.
    eval: bool,
}

impl<'a> Pass<'a> {
    fn new(
        st: &'a mut RankState,
        plan: &'a StepPlan,
        mbs: &'a [(u32, MicroBatch)],
        cfg: &'a ExecConfig,
        attempt: u8,
        exps: Vec<i32>,
        ties: (&'a Ties, &'a [u32]),
    ) -> Self {
        st.begin_backward_updates();
        if let Some(w) = &mut st.whole_grads {
            w.iter_mut().for_each(GradBuf::fill_zero);
        }
        Self::bare(st, plan, mbs, cfg, attempt, exps, ties)
    }

    /// A pass that starts no update: what the training pass and the evaluation share.
    fn bare(
        st: &'a mut RankState,
        plan: &'a StepPlan,
        mbs: &'a [(u32, MicroBatch)],
        cfg: &'a ExecConfig,
        attempt: u8,
        exps: Vec<i32>,
        ties: (&'a Ties, &'a [u32]),
    ) -> Self {
        let units = st.units();
        let dev = st
            .device
            .clone()
            .map(|d| device::OnDevice::new(d, cfg.device_buffers, cfg.precision));
        let mut tier_io = (st.params_on_tier() || st.grads_on_tier())
            .then(|| {
                st.tier_shared()
                    .map(|t| TierIo::new(t, st.owed.clone(), st.in_backward.clone()))
            })
            .flatten();
        // Updating in the backward, a rank waits for each reduce-scatter at once (see
        // `schedule::phases`) and holds one exact accumulator (8 bytes an element), which leaves
        // room for a second update's gradient (4), so the disk can go from one update to the
        // next without waiting for the rank's thread.
        if let Some(io) = tier_io.as_mut() {
            if st.in_backward.is_some() {
                io.allow_writes(2);
            }
        }
        Self {
            st,
            plan,
            mbs,
            cfg,
            attempt,
            exps,
            ties,
            lent: BTreeMap::new(),
            early_acc: BTreeMap::new(),
            saved: vec![Vec::new(); units],
            kept: (0..units).map(|_| Vec::new()).collect(),
            grad_out: vec![Vec::new(); mbs.len()],
            losses: Vec::new(),
            gathered: BTreeMap::new(),
            own: BTreeMap::new(),
            kept_params: BTreeMap::new(),
            keep_at_free: BTreeSet::new(),
            spare_gathered: None,
            tier_io,
            unit_acc: BTreeMap::new(),
            stats: vec![QuantStats::default(); units],
            agreed: None,
            compute_s: 0.0,
            optimizer_s: 0.0,
            dev,
            eval: false,
        }
    }

    fn tag(&self, kind: TagKind, unit: u32, pass: u8) -> Tag {
        Tag {
            kind,
            attempt: self.attempt,
            unit,
            pass,
            piece: 0,
        }
    }

    fn exec<T: Transport>(&mut self, comm: &mut Comm<T>, phase: Phase) -> Result<(), CommError> {
        match phase {
            Phase::PostGather { unit, pass } => self.post_gather(comm, unit, pass),
            Phase::WaitGather { unit, pass } => self.wait_gather(comm, unit, pass),
            Phase::Forward { unit } => {
                let mut done = Ok(());
                self.timed(|p| {
                    p.round_full(unit);
                    done = p.forward(unit as usize);
                    p.drop_rounded(unit);
                });
                done.map_err(device_error)?;
                self.unit_pass_done();
                Ok(())
            }
            Phase::Backward { unit } => {
                // The disk has nothing else to do during the backward when only the optimizer's
                // state is on the tier: the optimizer's first reads start now.
                self.st
                    .read_ahead_for_optimizer()
                    .map_err(|e| CommError::Storage(e.to_string()))?;
                let mut done = Ok(());
                self.timed(|p| {
                    p.round_full(unit);
                    done = p.backward(unit as usize);
                    p.drop_rounded(unit);
                });
                done.map_err(device_error)?;
                self.unit_pass_done();
                Ok(())
            }
            Phase::Free { unit } => {
                self.free_gathered(unit);
                Ok(())
            }
            Phase::ReduceScatterUnit { unit } => self.post_reduce_scatter(comm, unit),
            Phase::WaitReduceScatter { unit } => self.wait_reduce_scatter(comm, unit),
            Phase::ReduceScatterAll => self.reduce_scatter_all(comm),
            Phase::AllGatherGrads => self.all_gather_grads(comm),
            Phase::Agree => {
                self.finish_tier_io()?;
                match self.eval {
                    true => self.agree_eval(comm),
                    false => self.agree(comm),
                }
            }
            Phase::Optimizer if self.st.in_backward.is_some() => self.commit_backward_updates(),
            Phase::Optimizer => self.optimizer(),
            Phase::GatherParams => self.gather_params(comm),
        }
    }

    /// Sends this rank's chunks of `unit` to every peer for their gather of it.
    fn post_gather<T: Transport>(
        &mut self,
        comm: &mut Comm<T>,
        unit: u32,
        pass: u8,
    ) -> Result<(), CommError> {
        self.load_own_params(unit)?;
        let own = self
            .own
            .get(&unit)
            .unwrap_or(&self.st.shards[unit as usize].params);
        let precision = self.cfg.precision;
        let (elem_bytes, n) = (precision.param_bytes() as usize, own.len() as u64);
        // The payload is this rank's chunks of the unit, which `own` holds end to end.
        debug_assert_eq!(
            own.len(),
            self.st.map.owned_elems_in_unit(unit as usize, self.st.rank)
        );
        let encode = |r: std::ops::Range<usize>, out: &mut Vec<u8>| match precision {
            Precision::Fp32 => put_f32s(out, &own[r]),
            Precision::Bf16 => put_bf16s(out, &own[r]),
        };
        // From now on the peers' chunks of this unit are in flight to us: account for
        // them here, so the ledger shows the whole prefetched working set.
        let incoming = self.st.map.units[unit as usize].numel as u64 - n;
        self.st.ledger.alloc(Category::Gathered, 4 * incoming);
        let tag = self.tag(TagKind::Gather, unit, pass);
        let map = &self.st.map;
        collectives::post_own_encoded(comm, map, unit as usize, tag, elem_bytes, encode, true)
    }

    /// Drops the gathered copy of `unit`, keeping it where the backward's update reuses it.
    fn free_gathered(&mut self, unit: u32) {
        if let Some(buf) = self.gathered.remove(&unit) {
            self.st
                .ledger
                .free(Category::Gathered, 4 * buf.len() as u64);
            if self.keep_at_free.remove(&unit) {
                self.kept_params.insert(unit, buf);
            } else if !self.st.params_on_tier() {
                // With parameters on the tier a one-rank gather is the shard read off the disk,
                // and a spare would only hold memory.
                self.spare_gathered = Some(buf);
            }
        }
    }

    /// The backward ran every unit's update; the step is agreed, so they count.
    fn commit_backward_updates(&mut self) -> Result<(), CommError> {
        let done = self
            .st
            .commit_backward_updates()
            .map_err(|e| CommError::Storage(e.to_string()));
        let (rank, epoch, step) = (self.st.rank, self.plan.epoch, self.plan.step);
        (0..self.st.units()).for_each(|_| self.cfg.progress.beat(rank, epoch, step));
        done
    }

    /// The optimizer over every owned chunk, with the agreed clipping.
    fn optimizer(&mut self) -> Result<(), CommError> {
        let a = self.agreed.as_ref().expect("Optimizer follows Agree");
        let clip = exact::clip_coefficient(a.norm, self.cfg.grad_clip);
        let (exps, m) = (self.exps.clone(), self.plan.micro_batches);
        let (progress, rank) = (&self.cfg.progress, self.st.rank);
        let (epoch, step) = (self.plan.epoch, self.plan.step);
        let t0 = Stopwatch::start();
        let done = self
            .st
            .apply_optimizer(
                &exps,
                m,
                clip,
                self.plan.opt_step,
                self.plan.lr,
                self.plan.defer_update,
                &mut || progress.beat(rank, epoch, step),
            )
            .map_err(|e| CommError::Storage(e.to_string()));
        self.optimizer_s += t0.elapsed().as_secs_f64();
        done
    }

    fn unit_pass_done(&self) {
        let (rank, epoch, step) = (self.st.rank, self.plan.epoch, self.plan.step);
        self.cfg.progress.unit_pass_done(rank, epoch, step);
    }

    fn timed(&mut self, f: impl FnOnce(&mut Self)) {
        let t0 = Stopwatch::start();
        f(self);
        self.compute_s += t0.elapsed().as_secs_f64();
    }

    fn wait_gather<T: Transport>(
        &mut self,
        comm: &mut Comm<T>,
        unit: u32,
        pass: u8,
    ) -> Result<(), CommError> {
        let u = unit as usize;
        let numel = self.st.map.units[u].numel;
        self.load_own_params(unit)?;
        let own = self.own.remove(&unit);
        let shard = &self.st.shards[u];
        let whole = shard.is_whole_unit(numel);
        // The backward's gather read the shard its update in the backward needs.
        let keep = pass == 1
            && self
                .st
                .in_backward
                .as_ref()
                .is_some_and(|u| u.reuses_params());
        let mut full = match own {
            // A rank holding the whole unit (one rank) read the unit itself off the tier: no
            // second buffer and no copy (a fresh 200 MiB buffer costs 0.1 s of page faults).
            Some(own) if whole => {
                if keep {
                    self.keep_at_free.insert(unit);
                }
                own
            }
            own => {
                // Every element is written below: the rank's own chunks here, the peers'
                // chunks by the gather.
                let mut full = match self.spare_gathered.take() {
                    Some(v) if v.len() == numel => v,
                    _ => vec![0f32; numel],
                };
                let src = own.as_deref().unwrap_or(&shard.params);
                let mut off = 0;
                for r in &shard.ranges {
                    full[r.clone()].copy_from_slice(&src[off..off + r.len()]);
                    off += r.len();
                }
                if let (true, Some(own)) = (keep, own) {
                    self.kept_params.insert(unit, own);
                }
                full
            }
        };
        self.st
            .ledger
            .alloc(Category::Gathered, 4 * shard.len() as u64);
        let tag = self.tag(TagKind::Gather, unit, pass);
        let precision = self.cfg.precision;
        if precision == Precision::Bf16 {
            // This rank's own chunks, as the peers receive them.
            for r in &shard.ranges {
                full[r.clone()].iter_mut().for_each(|x| *x = round_bf16(*x));
            }
        }
        let elem_bytes = precision.param_bytes() as usize;
        let res =
            collectives::wait_owned(
                comm,
                &self.st.map,
                u,
                tag,
                elem_bytes,
                |r, b| match precision {
                    Precision::Fp32 => decode_f32_into(b, &mut full[r]),
                    Precision::Bf16 => decode_bf16_into(b, &mut full[r]),
                },
            );
        self.gathered.insert(unit, full);
        res
    }

    /// Stage 3 with parameters on the tier: reads this rank's shard of `unit` into `own`
    /// (once per gather; the wait takes it), prefetched if it was the unit read ahead.
    fn load_own_params(&mut self, unit: u32) -> Result<(), CommError> {
        if self.st.params_on_tier() && !self.own.contains_key(&unit) {
            let len = self.st.shards[unit as usize].len();
            let io = self.tier_io.as_mut().expect("a tier holds the parameters");
            let own = io
                .params(unit as usize, len)
                .map_err(|e| CommError::Storage(e.to_string()))?;
            self.own.insert(unit, own);
        }
        Ok(())
    }

    /// Starts reading the shard of the next unit `rest` gathers while this one computes.
    fn read_ahead(&mut self, rest: &[Phase]) {
        if !self.st.params_on_tier() {
            return;
        }
        let next = rest.iter().find_map(|p| match p {
            Phase::PostGather { unit, .. } => Some(*unit as usize),
            _ => None,
        });
        if let (Some(u), Some(io)) = (next, self.tier_io.as_mut()) {
            io.prefetch_params(u, self.st.shards[u].len());
        }
    }

    /// Waits for the gradient writes in flight: the optimizer reads them back.
    fn finish_tier_io(&mut self) -> Result<(), CommError> {
        match self.tier_io.as_mut() {
            Some(io) => io.finish().map_err(|e| CommError::Storage(e.to_string())),
            None => Ok(()),
        }
    }

    /// The parameters the model computes `u` with: the gathered unit at stage 3, the rank's
    /// full copy at stages 0-2 (its bf16 rounding under mixed precision, see `round_full`).
    fn params(&self, u: usize) -> &[f32] {
        match (self.gathered.get(&(u as u32)), self.st.stage) {
            (Some(g), _) => g,
            (None, Stage::Zero3) => panic!("unit {u} computed before its gather"),
            (None, _) => self.st.full[u]
                .f32s()
                .unwrap_or_else(|| panic!("unit {u}'s bf16 copy computed before it was widened")),
        }
    }

    /// Stages 0-2 under bf16: the unit's bf16 full copy widened to f32 for one forward or
    /// backward (the model computes on f32 slices holding bf16 values); the model sees the same
    /// values as from a stage-3 bf16 gather.
    fn round_full(&mut self, unit: u32) {
        if self.cfg.precision != Precision::Bf16 || self.st.stage == Stage::Zero3 {
            return;
        }
        let full = &self.st.full[unit as usize];
        let rounded: Vec<f32> = full.values(0..full.len());
        self.st
            .ledger
            .alloc(Category::Gathered, 4 * rounded.len() as u64);
        self.gathered.insert(unit, rounded);
    }

    /// Frees what [`round_full`](Self::round_full) made.
    fn drop_rounded(&mut self, unit: u32) {
        if self.st.stage == Stage::Zero3 {
            return;
        }
        if let Some(buf) = self.gathered.remove(&unit) {
            self.st
                .ledger
                .free(Category::Gathered, 4 * buf.len() as u64);
        }
    }

    fn forward(&mut self, u: usize) -> Result<(), DeviceError> {
        self.lend(u);
        let last = u + 1 == self.st.units();
        let view = self.borrowing_view(u);
        self.params_to_device(u, view.as_deref(), u + 1)?;
        let (outs, kept, losses) = self.on_params(u, view.as_deref(), |params| {
            let mut outs = Vec::with_capacity(self.mbs.len());
            let mut kept = Vec::with_capacity(self.mbs.len());
            let mut losses = Vec::new();
            for (j, (idx, mb)) in self.mbs.iter().enumerate() {
                let x: &[f32] = if u == 0 { &[] } else { &self.saved[u][j] };
                let out = if self.cfg.keep_activations {
                    let (out, k) = self.st.model.forward_keep(u, params, x, mb);
                    kept.push(k);
                    out
                } else {
                    self.st.model.forward(u, params, x, mb)
                };
                if last {
                    let (loss, g) = self.st.model.loss(out, mb);
                    losses.push((*idx, loss));
                    outs.push(g);
                } else {
                    outs.push(out);
                }
            }
            (outs, kept, losses)
        });
        self.losses.extend(losses);
        self.drop_view(view);
        let kept_bytes: u64 = kept.iter().flatten().map(|k| k.bytes).sum();
        let bytes = 4 * outs.iter().map(Vec::len).sum::<usize>() as u64 + kept_bytes;
        self.st.ledger.alloc(Category::Activations, bytes);
        if let Some(d) = &mut self.dev {
            d.free_params(u as u32);
            d.reserve_acts(u as u32, bytes)?;
        }
        self.kept[u] = kept;
        if last {
            self.grad_out = outs;
        } else {
            self.saved[u + 1] = outs;
        }
        Ok(())
    }

    fn backward(&mut self, u: usize) -> Result<(), DeviceError> {
        let numel = self.st.map.units[u].numel;
        let mode = self.st.mode;
        let mut acc = match &mut self.st.whole_grads {
            Some(w) => std::mem::replace(&mut w[u], GradBuf::zeros(mode, 0)),
            None => match self.early_acc.remove(&(u as u32)) {
                Some(acc) => acc,
                None => {
                    self.st
                        .ledger
                        .alloc(Category::Transient, (mode.elem_bytes() * numel) as u64);
                    GradBuf::zeros(mode, numel)
                }
            },
        };
        let view = self.borrowing_view(u);
        let view_len = view.as_ref().map_or(numel, Vec::len);
        self.params_to_device(u, view.as_deref(), u.wrapping_sub(1))?;
        // On a device each micro-batch's gradient is a device buffer of its own.
        let mut gp = vec![0f32; if self.dev.is_some() { 0 } else { view_len }];
        self.st
            .ledger
            .alloc(Category::Transient, 4 * view_len as u64);
        let mut kept = std::mem::take(&mut self.kept[u]).into_iter();
        for j in 0..self.mbs.len() {
            let k = kept.next().flatten();
            let kept_bytes = k.as_ref().map_or(0, |k| k.bytes);
            let gx = match self.dev.is_some() {
                true => self.backward_on_device(u, j, view_len, k)?,
                false => {
                    gp.fill(0.0);
                    let x: &[f32] = if u == 0 { &[] } else { &self.saved[u][j] };
                    let params = view.as_deref().unwrap_or_else(|| self.params(u));
                    let (dy, mb) = (&self.grad_out[j], &self.mbs[j].1);
                    let gx = self
                        .st
                        .model
                        .backward_kept(u, params, x, k, dy, mb, &mut gp);
                    self.take_grad(u, &mut acc, &gp);
                    gx
                }
            };
            self.st.ledger.free(Category::Activations, kept_bytes);
            // A gradient in flight lands while the next micro-batch computes.
            self.take_device_grads(u, &mut acc, false);
            let old = std::mem::replace(&mut self.grad_out[j], gx);
            let freed = old.len() as i64 - self.grad_out[j].len() as i64;
            self.adjust_activations(freed);
        }
        self.take_device_grads(u, &mut acc, true);
        if let Some(d) = &mut self.dev {
            d.free_params(u as u32);
            d.free_acts(u as u32);
        }
        self.st
            .ledger
            .free(Category::Transient, 4 * view_len as u64);
        self.drop_view(view);
        self.unlend(u);
        let saved = std::mem::take(&mut self.saved[u]);
        self.adjust_activations(saved.iter().map(Vec::len).sum::<usize>() as i64);
        match &mut self.st.whole_grads {
            Some(w) => w[u] = acc,
            None => {
                self.unit_acc.insert(u as u32, acc);
            }
        }
        Ok(())
    }

    /// Quantizes one micro-batch's gradient of `u`'s view into `acc` (and the owners' of what
    /// it borrows), exactly.
    fn take_grad(&mut self, u: usize, acc: &mut GradBuf, gp: &[f32]) {
        let (s, m) = (self.exps[u], self.ties.1[u]);
        let own = self.ties.0.own_grad(u, gp);
        self.stats[u] = self.stats[u].merge(acc.accumulate(0, own, s, m));
        self.give_back_grads(u, gp);
    }

    /// At an owner's forward: copies the parameters it lends out of its full parameters, for
    /// the users that run after it has been freed.
    fn lend(&mut self, owner: usize) {
        let lent: Vec<_> = self.ties.0.lent_by(owner).collect();
        for (i, r) in lent {
            if !self.lent.contains_key(&i) {
                let copy = self.params(owner)[r].to_vec();
                self.st
                    .ledger
                    .alloc(Category::Gathered, 4 * copy.len() as u64);
                self.lent.insert(i, copy);
            }
        }
    }

    /// After a user's backward: the lent copies it borrowed are dead.
    fn unlend(&mut self, user: usize) {
        let borrowed: Vec<_> = self.ties.0.borrowed_by(user).map(|(i, ..)| i).collect();
        for i in borrowed {
            if let Some(copy) = self.lent.remove(&i) {
                self.st
                    .ledger
                    .free(Category::Gathered, 4 * copy.len() as u64);
            }
        }
    }

    /// The view of a unit that borrows tied parameters (its own, then the lent copies);
    /// `None` for a unit that borrows nothing, which computes on its parameters in place.
    fn borrowing_view(&mut self, u: usize) -> Option<Vec<f32>> {
        let lent = &self.lent;
        let view = self.ties.0.view_of(u, self.params(u), |i, _, _| {
            lent.get(&i).expect("the owner's forward lent it")
        });
        let std::borrow::Cow::Owned(v) = view else {
            return None;
        };
        self.st
            .ledger
            .alloc(Category::Transient, 4 * v.len() as u64);
        Some(v)
    }

    fn drop_view(&mut self, view: Option<Vec<f32>>) {
        if let Some(v) = view {
            self.st.ledger.free(Category::Transient, 4 * v.len() as u64);
        }
    }

    /// Adds the gradient a user computed for the parameters it borrows (the tail of its view
    /// gradient) into the owners' accumulators, exactly: the owners' backward comes later.
    fn give_back_grads(&mut self, user: usize, view_grad: &[f32]) {
        let ties = self.ties.0;
        for (t, r, part) in ties.borrowed_grads(user, view_grad) {
            let (s, m) = (self.exps[t.owner], self.ties.1[t.owner]);
            let mode = self.st.mode;
            let acc = match &mut self.st.whole_grads {
                Some(w) => &mut w[t.owner],
                None => {
                    let numel = self.st.map.units[t.owner].numel;
                    let ledger = &mut self.st.ledger;
                    self.early_acc.entry(t.owner as u32).or_insert_with(|| {
                        ledger.alloc(Category::Transient, (mode.elem_bytes() * numel) as u64);
                        GradBuf::zeros(mode, numel)
                    })
                }
            };
            let stats = acc.accumulate(r.start, part, s, m);
            self.stats[t.owner] = self.stats[t.owner].merge(stats);
        }
    }

    /// Activation bytes changed by `freed_elems` (negative: grew).
    fn adjust_activations(&mut self, freed_elems: i64) {
        if freed_elems >= 0 {
            self.st
                .ledger
                .free(Category::Activations, 4 * freed_elems as u64);
        } else {
            self.st
                .ledger
                .alloc(Category::Activations, 4 * (-freed_elems) as u64);
        }
    }

    /// Returns every transient buffer to the ledger and the device (also after a failed pass).
    fn release(mut self) {
        if let Some(d) = &mut self.dev {
            d.release();
        }
        let act: usize = self.saved.iter().flatten().map(Vec::len).sum::<usize>()
            + self.grad_out.iter().map(Vec::len).sum::<usize>();
        let kept: u64 = self.kept.iter().flatten().flatten().map(|k| k.bytes).sum();
        self.st
            .ledger
            .free(Category::Activations, 4 * act as u64 + kept);
        for buf in self.gathered.values() {
            self.st
                .ledger
                .free(Category::Gathered, 4 * buf.len() as u64);
        }
        for acc in self.unit_acc.values().chain(self.early_acc.values()) {
            self.st.ledger.free(Category::Transient, acc.bytes() as u64);
        }
        for copy in self.lent.values() {
            self.st
                .ledger
                .free(Category::Gathered, 4 * copy.len() as u64);
        }
    }
}
