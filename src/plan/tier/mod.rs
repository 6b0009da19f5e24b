//! Tier placement: where each rank's shard state lives (RAM or the NVMe tier), how large the
//! staging buffers that stream it through RAM are, and whether the process fits the memory it may
//! use. Pure data and functions: `runtime::storage` carries a placement out, and the command line
//! runs [`place`] before it allocates anything, so a run that cannot fit is refused with numbers.
//!
//! What stays in RAM whatever the placement: the gradients (stage 0/1 whole-model accumulators,
//! stage 2/3 reduced shards), the full parameter copy of stages 0-2 (in fp32 training it is both
//! the master and the compute copy), one unit's gathered parameters per live unit, one unit's
//! backward scratch, the activations, and the staging buffers.
//!
//! Design: docs/memory-and-tier.md.

use serde::{Deserialize, Serialize};

pub use super::memory::gib;
use super::memory::{masters_in_shard, resident};
use super::schedule::Stage;

pub mod working;

/// A configured tier for one kind of state. `Auto` lets [`place`] choose the least offload that
/// fits; `Cpu` is ZeRO-Offload's host memory beside a device (the config reads it as `None`
/// with `--device`) and is refused without one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Offload {
    #[default]
    Auto,
    None,
    Nvme,
    Cpu,
}

impl Offload {
    pub fn name(self) -> &'static str {
        match self {
            Offload::Auto => "auto",
            Offload::None => "none",
            Offload::Nvme => "nvme",
            Offload::Cpu => "cpu",
        }
    }
}

impl std::str::FromStr for Offload {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Offload::Auto),
            "none" => Ok(Offload::None),
            "nvme" => Ok(Offload::Nvme),
            "cpu" => Ok(Offload::Cpu),
            other => Err(format!(
                "'{other}' is not a tier: use none, nvme, auto, or cpu (host memory, with --device)"
            )),
        }
    }
}

/// Where one kind of state lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    Ram,
    Nvme,
}

/// Where a rank's optimizer state (Adam m and v, SGD momentum), its parameter shard (stage 3)
/// and its reduced gradient shard (stages 2 and 3) live between the phases that use them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub optimizer: Tier,
    pub params: Tier,
    #[serde(default = "ram")]
    pub grads: Tier,
}

fn ram() -> Tier {
    Tier::Ram
}

impl Placement {
    pub const RAM: Placement = Placement {
        optimizer: Tier::Ram,
        params: Tier::Ram,
        grads: Tier::Ram,
    };

    pub fn any_nvme(&self) -> bool {
        self.optimizer == Tier::Nvme || self.params == Tier::Nvme || self.grads == Tier::Nvme
    }

    /// What a tier record holds per element under this placement at `stage`, for an optimizer
    /// with `state_per_param` values and compute parameters of `param_copy_bytes`. The
    /// parameter column holds the fp32 masters: stage 3's shard when the parameters are
    /// offloaded, and under bf16 at stages 0-2 the owned masters, which travel with the
    /// optimizer state. Gradients are on the tier only at stages 2-3, whatever the placement.
    pub fn kinds(&self, stage: Stage, state_per_param: u64, param_copy_bytes: u64) -> RecordKinds {
        let on = |t: Tier, n: u64| if t == Tier::Nvme { n as usize } else { 0 };
        let grads_tierable = matches!(stage, Stage::Zero2 | Stage::Zero3);
        let masters = match stage {
            Stage::Zero3 => self.params == Tier::Nvme,
            _ => masters_in_shard(stage, param_copy_bytes) && self.optimizer == Tier::Nvme,
        };
        RecordKinds {
            params: masters,
            state: on(self.optimizer, state_per_param),
            grads: if grads_tierable { on(self.grads, 1) } else { 0 },
        }
    }

    fn flags(&self) -> String {
        let mut f = Vec::new();
        if self.optimizer == Tier::Nvme {
            f.push("--offload-optimizer nvme");
        }
        if self.params == Tier::Nvme {
            f.push("--offload-params nvme");
        }
        if self.grads == Tier::Nvme {
            f.push("--offload-grads nvme");
        }
        f.join(" ")
    }
}

/// Which values a tier record holds, in order: the parameter (if on the tier), the optimizer's
/// state values (if on the tier), then the gradient (if on the tier). The gradient on the tier
/// is the `f32` mean, before clipping, in either reduction mode: the exact mode's 8-byte sums
/// are only needed until they are reduced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecordKinds {
    pub params: bool,
    /// Optimizer values on the tier per element (0, 1 or 2).
    pub state: usize,
    /// Gradient values on the tier per element (0 or 1).
    pub grads: usize,
}

impl RecordKinds {
    pub fn values(&self) -> usize {
        usize::from(self.params) + self.state + self.grads
    }

    /// Index of the first optimizer value within a record.
    pub fn state_at(&self) -> usize {
        usize::from(self.params)
    }

    /// Index of the gradient's first value (the values before it are the update's own state).
    pub fn grads_at(&self) -> usize {
        usize::from(self.params) + self.state
    }
}

/// Alignment of every tier record, staging buffer and I/O (safe for 512e and 4Kn devices).
pub const IO_ALIGN_BYTES: u64 = 4096;
/// Elements per tier record when memory allows: 1 MiB per stored value, the block size at which
/// direct I/O reached the disk's sequential bandwidth here (`ezero bench io`).
pub const DEFAULT_TILE_ELEMS: u64 = 1 << 18;
/// The smallest record the planner shrinks to (4 KiB per value, one aligned block).
pub const MIN_TILE_ELEMS: u64 = IO_ALIGN_BYTES / 4;
/// Staging buffers: two records read ahead, one being updated, one being written back.
pub const STAGING_BUFFERS: u64 = 4;
/// The most staging buffers a rank takes where the budget has room for more
/// ([`with_reads_ahead`]): 128 MiB a rank with m and v in records of 1 MiB a value, 192 MiB
/// with the gradient beside them.
pub const MAX_STAGING_BUFFERS: u64 = 64;
/// What the process needs besides the training state: code, thread stacks, the async runtime,
/// allocator slack (peak RSS of a 40K-parameter run on one rank was 18 MiB here; doubled).
pub const BASE_BYTES: u64 = 48 << 20;

/// What a run needs per rank, from the model, the shard map and the step settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Demand {
    pub stage: Stage,
    /// Ranks whose state this process holds (all of them for an in-process run).
    pub ranks_in_process: u64,
    pub total_elems: u64,
    /// Elements owned by the rank that owns the most.
    pub owned_elems: u64,
    pub largest_unit_elems: u64,
    /// Units of the model: the tier cuts each unit's shard into records of its own.
    pub units: u64,
    /// Elements of tied parameters (`model::tie`): the step holds a copy of them from the
    /// owner's forward to the user's backward, and the user computes on a view holding them.
    pub tied_elems: u64,
    /// Bytes per gradient element (8 for exact mode's fixed point, 4 for fast).
    pub grad_elem_bytes: u64,
    /// Optimizer values per parameter (Adam 2, SGD with momentum 1).
    pub state_per_param: u64,
    /// Bytes per element of the parameters the model computes with: 4 in fp32, 2 under bf16
    /// mixed precision (stages 0-2 then keep a bf16 full copy and owned fp32 masters).
    pub param_copy_bytes: u64,
    /// Stage 3: units whose gathered parameters may be live at once.
    pub max_live_units: u64,
    /// The compute's working set at its peak ([`working::compute_bytes`]).
    pub compute_bytes: u64,
    /// One rank's peak activation bytes (saved unit inputs plus one unit's intermediates).
    pub activation_bytes: u64,
    /// Buddy backups are taken (`replicate_every` > 0 with two or more ranks): each rank keeps
    /// a copy of what it holds and of its predecessor's owned state, in RAM whatever the
    /// placement.
    pub backups: bool,
    /// How checkpoints hold their snapshot while it is written.
    pub snapshots: Snapshots,
    /// Elements per chunk (`chunk_elems`): a streamed snapshot's piece is at least one chunk.
    pub chunk_elems: u64,
    /// Global-norm clipping is on (`grad_clip` > 0): no update can start before the step's
    /// norm is known, after the whole backward ([`updates_in_backward`]).
    pub clipping: bool,
}

/// How a checkpoint's snapshot is held while it is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Snapshots {
    /// No checkpoints are saved.
    None,
    /// Every chunk's state is gathered in RAM and written while training goes on.
    Whole,
    /// Gathered whole with state in RAM; with state on the tier, streamed from the owners a
    /// piece of [`SNAPSHOT_PIECE_ELEMS`] at a time while the ranks wait.
    StreamedOffTier,
}

/// Elements per piece of a streamed snapshot, and per group when chunk states are read off the
/// tier (1 Mi: 12 MiB of parameters and Adam's m and v).
pub const SNAPSHOT_PIECE_ELEMS: u64 = 1 << 20;

/// Pieces of a streamed snapshot in memory at once besides one per rank being merged (see
/// `runtime::actors::collect`): one queued for the writer and one being written.
const SNAPSHOT_PIECES: u64 = 2;

/// The buffer of each checkpoint file open while a snapshot streams (one per owner rank).
const SNAPSHOT_FILE_BUFFER_BYTES: u64 = 1 << 20;

/// Pieces of a backup on the tier in memory at once: the group being written to the local
/// copy or the batch being sent, its encoded parcel, the parcel received and its chunks, and
/// one more waiting on the link.
const BACKUP_PIECES: u64 = 5;

/// The write buffer of each backup file (`storage::chunk_file`).
const BACKUP_FILE_BUFFER_BYTES: u64 = 1 << 20;

/// The configured choices and the memory the process may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub optimizer: Offload,
    pub params: Offload,
    pub grads: Offload,
    /// Whether a tier directory is configured (`nvme_dir`): without one, `Auto` stays in RAM.
    pub has_nvme_dir: bool,
    pub budget: Budget,
    /// Elements per record when configured; otherwise the planner picks.
    pub tile_elems: Option<u64>,
}

/// The memory the process may use and where that figure came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Budget {
    /// `memory_max_bytes`.
    Configured(u64),
    /// A share of the memory available when the run started (see [`machine_budget`]).
    Machine(u64),
}

impl Budget {
    pub fn bytes(self) -> u64 {
        match self {
            Budget::Configured(b) | Budget::Machine(b) => b,
        }
    }
}

/// Without `memory_max_bytes`, a run may use 90% of the memory available at start (the smaller
/// of `MemAvailable` and the cgroup's remaining limit), leaving room for the page cache and
/// whatever else runs.
pub fn machine_budget(available_bytes: u64) -> Budget {
    Budget::Machine(available_bytes / 10 * 9)
}

/// Bytes by what holds them, for one rank (`staging` is per rank too).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankBytes {
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
    /// Gathered units, backward scratch and optimizer scratch at their peak.
    pub working: u64,
    pub activations: u64,
    pub staging: u64,
    /// Buddy backups: the copy of the rank's own state and of its predecessor's in RAM, or
    /// with a tier the pieces in flight while they are written to it.
    pub backup: u64,
    /// Bytes this rank keeps on the tier.
    pub tier: u64,
    /// Bytes of buddy backups in files beside the tier (the committed backup and a fresh one).
    #[serde(default)]
    pub backup_disk: u64,
}

impl RankBytes {
    pub fn ram(&self) -> u64 {
        self.params
            + self.grads
            + self.optimizer
            + self.working
            + self.activations
            + self.staging
            + self.backup
    }
}

/// A placement that fits, with its staging buffers and the memory it is expected to need.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fit {
    pub placement: Placement,
    pub tile_elems: u64,
    pub staging_buffers: u64,
    pub per_rank: RankBytes,
    /// A checkpoint's snapshot of every chunk's state, held while it is written.
    pub snapshot_bytes: u64,
    /// Expected peak of the whole process.
    pub process_bytes: u64,
    /// Each unit's optimizer update runs in the backward ([`updates_in_backward`]).
    #[serde(default)]
    pub update_in_backward: bool,
    /// The update in the backward takes the parameter shard read for the unit's backward
    /// gather, kept until then, instead of reading it off the tier again: 4 bytes a parameter
    /// less read a step, for two more shards in RAM. Only where the budget has room for them.
    #[serde(default)]
    pub update_reuses_params: bool,
}

/// Why a run cannot start. Each says what to change.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FitError {
    #[error("'{key} = \"cpu\"' means host memory beside a device: without one (--device sim) all state already lives in RAM; add --device sim, or use \"nvme\" (with nvme_dir), \"none\" or \"auto\"")]
    CpuReserved { key: &'static str },
    #[error("'offload_params = \"nvme\"' needs ZeRO stage 3 (stages 0-2 keep a full parameter copy for compute); use --stage 3, or offload the optimizer only")]
    ParamsNeedStage3,
    #[error("'offload_grads = \"nvme\"' needs ZeRO stage 2 or 3 (stages 0-1 accumulate whole-model gradients in RAM); use --stage 2 or 3")]
    GradsNeedStage2,
    #[error("offloading to nvme needs a directory for the tier: set --nvme-dir DIR (nvme_dir)")]
    NoNvmeDir,
    #[error("{0}")]
    DoesNotFit(String),
    #[error("{0}")]
    Device(#[from] super::device::DeviceFitError),
}

impl FitError {
    /// The config key to change.
    pub fn key(&self) -> &'static str {
        match self {
            FitError::CpuReserved { key } => key,
            FitError::ParamsNeedStage3 => "offload_params",
            FitError::GradsNeedStage2 => "offload_grads",
            FitError::NoNvmeDir => "nvme_dir",
            FitError::DoesNotFit(_) => "memory_max_bytes",
            FitError::Device(_) => "device_memory_max_bytes",
        }
    }
}

/// Whether the configured tiers make sense together at `stage`, before any memory is counted
/// (config validation and [`place`] both ask).
pub fn check_choices(
    stage: Stage,
    optimizer: Offload,
    params: Offload,
    grads: Offload,
    has_nvme_dir: bool,
) -> Result<(), FitError> {
    for (key, o) in [
        ("offload_optimizer", optimizer),
        ("offload_params", params),
        ("offload_grads", grads),
    ] {
        if o == Offload::Cpu {
            return Err(FitError::CpuReserved { key });
        }
    }
    if params == Offload::Nvme && stage != Stage::Zero3 {
        return Err(FitError::ParamsNeedStage3);
    }
    if grads == Offload::Nvme && matches!(stage, Stage::Zero0 | Stage::Zero1) {
        return Err(FitError::GradsNeedStage2);
    }
    if [optimizer, params, grads].contains(&Offload::Nvme) && !has_nvme_dir {
        return Err(FitError::NoNvmeDir);
    }
    Ok(())
}

/// Chooses the least offload (optimizer first, then stage 3's parameters) and the largest
/// staging records that keep the process under the budget, or says why none does.
pub fn place(d: &Demand, lim: &Limits) -> Result<Fit, FitError> {
    check_choices(
        d.stage,
        lim.optimizer,
        lim.params,
        lim.grads,
        lim.has_nvme_dir,
    )?;
    let allowed = |p: &Placement| {
        let ok = |o: Offload, t: Tier| match o {
            Offload::None => t == Tier::Ram,
            Offload::Nvme => t == Tier::Nvme,
            Offload::Auto => t == Tier::Ram || lim.has_nvme_dir,
            Offload::Cpu => false,
        };
        ok(lim.optimizer, p.optimizer) && ok(lim.params, p.params) && ok(lim.grads, p.grads)
    };
    let candidates = candidates(d.stage);
    let budget = lim.budget.bytes();
    for p in candidates.iter().filter(|p| allowed(p)) {
        let fit = match lim.tile_elems {
            Some(t) => fit_tile(d, *p, t, budget),
            None => fit_largest_tile(d, *p, budget),
        };
        if let Some(fit) = fit {
            return Ok(fit);
        }
    }
    Err(FitError::DoesNotFit(refusal(d, lim, &candidates, &allowed)))
}

/// Every placement the stage allows, from least to most offload: the optimizer state first (the
/// most bytes, touched once a step), then stage 3's parameters (read twice a step), then the
/// gradients (a write and a read a step); placements that keep the optimizer in RAM come last,
/// for runs that ask for them.
fn candidates(stage: Stage) -> Vec<Placement> {
    let (r, n) = (Tier::Ram, Tier::Nvme);
    [
        (r, r, r),
        (n, r, r),
        (n, n, r),
        (n, r, n),
        (n, n, n),
        (r, n, r),
        (r, r, n),
        (r, n, n),
    ]
    .into_iter()
    .map(|(optimizer, params, grads)| Placement {
        optimizer,
        params,
        grads,
    })
    .filter(|p| p.params == r || stage == Stage::Zero3)
    .filter(|p| p.grads == r || matches!(stage, Stage::Zero2 | Stage::Zero3))
    .collect()
}

/// The largest power-of-two record between the minimum and the default that fits, if any.
fn fit_largest_tile(d: &Demand, p: Placement, budget: u64) -> Option<Fit> {
    // No record larger than the largest unit needs.
    let mut tile =
        DEFAULT_TILE_ELEMS.min(d.largest_unit_elems.max(MIN_TILE_ELEMS).next_power_of_two());
    loop {
        if let Some(fit) = fit_tile(d, p, tile, budget) {
            return Some(fit);
        }
        if !p.any_nvme() || tile <= MIN_TILE_ELEMS {
            return None;
        }
        tile /= 2;
    }
}

/// Placement `p` with records of `tile_elems` within `budget`: with the update in the
/// backward reusing the gathered parameters where that fits, else without.
fn fit_tile(d: &Demand, p: Placement, tile_elems: u64, budget: u64) -> Option<Fit> {
    [true, false]
        .into_iter()
        .map(|reuse| evaluate_with(d, p, tile_elems, reuse))
        .find(|f| f.process_bytes <= budget)
        .map(|f| with_reads_ahead(d, f, budget))
}

/// `f` with more staging buffers where the tier holds the optimizer's state (and perhaps the
/// gradients) but not the parameters, and the budget has room: one per record of the rank's optimizer phase (and the phase's own
/// [`STAGING_BUFFERS`]), at most [`MAX_STAGING_BUFFERS`], taking at most a quarter of what the
/// budget leaves, so a run near its budget is planned as before. The step starts the phase's
/// reads into them during the backward (`TierFile::read_ahead`), while the disk has little
/// else to do; with the parameters on the tier their reads are the forward's and the
/// backward's.
pub fn with_reads_ahead(d: &Demand, f: Fit, budget: u64) -> Fit {
    let kinds = f
        .placement
        .kinds(d.stage, d.state_per_param, d.param_copy_bytes);
    if !f.placement.any_nvme() || kinds.params || f.update_in_backward || f.staging_buffers == 0 {
        return f;
    }
    let record = f.per_rank.staging / f.staging_buffers;
    // Each unit's shard starts a record of its own.
    let records = d.owned_elems.div_ceil(f.tile_elems.max(1)) + d.units;
    let wanted = (records + STAGING_BUFFERS).min(MAX_STAGING_BUFFERS);
    let ranks = d.ranks_in_process.max(1);
    let room = budget.saturating_sub(f.process_bytes) / 4 / ranks;
    let extra = wanted
        .saturating_sub(f.staging_buffers)
        .min(room / record.max(1));
    let mut f = f;
    f.staging_buffers += extra;
    f.per_rank.staging += extra * record;
    f.process_bytes += ranks * extra * record;
    f
}

/// Whether each unit's optimizer update runs during the backward, as soon as the unit's
/// gradient shard is reduced, instead of after the backward (owed to the next forward).
///
/// Only at stage 3 with everything on the tier and clipping off: the update then needs nothing
/// the rest of the backward produces (the clip coefficient is 1), so its disk traffic overlaps
/// the backward's compute and the gradient never goes to the tier. The step's outcome (an
/// overflowed exact reduction is redone, a non-finite gradient skips the step) is known only
/// after the backward, so the updated parameters, m and v go to a second copy of each record
/// that becomes the state when the step is agreed: the tier holds p, m and v twice and no
/// gradients. With clipping on the update needs the global norm, so it waits for the backward.
pub fn updates_in_backward(stage: Stage, p: Placement, clipping: bool) -> bool {
    stage == Stage::Zero3
        && !clipping
        && p.params == Tier::Nvme
        && p.optimizer == Tier::Nvme
        && p.grads == Tier::Nvme
}

/// What placement `p` with records of `tile_elems` needs (the least: an update in the backward
/// reads its parameters again).
pub fn evaluate(d: &Demand, p: Placement, tile_elems: u64) -> Fit {
    evaluate_with(d, p, tile_elems, false)
}

/// [`evaluate`], the update in the backward reusing the gathered parameters with `reuse`.
pub fn evaluate_with(d: &Demand, p: Placement, tile_elems: u64, reuse: bool) -> Fit {
    let held = resident(
        d.stage,
        d.total_elems,
        d.owned_elems,
        d.grad_elem_bytes,
        d.state_per_param,
        d.param_copy_bytes,
    );
    let in_backward = updates_in_backward(d.stage, p, d.clipping);
    // Reused by the update: the shard read for a unit's backward gather stays until its update
    // is done, two at a time (one unit's update running while the next unit computes, or the
    // two updates queued behind each other).
    // fp32 only: under bf16 the gathered unit holds the rounded values, not the masters.
    let reuse = in_backward && reuse && d.param_copy_bytes == 4;
    let working = d.compute_bytes + tier_read_bytes(d, p, reuse);
    let mut kinds = p.kinds(d.stage, d.state_per_param, d.param_copy_bytes);
    if in_backward {
        kinds.grads = 0;
    }
    let values = kinds.values() as u64;
    let staging = if p.any_nvme() {
        STAGING_BUFFERS * round_up(4 * tile_elems * values, IO_ALIGN_BYTES)
    } else {
        0
    };
    // Each kind of state is either in RAM or on the tier.
    let split = |t: Tier, bytes: u64| {
        if t == Tier::Nvme {
            (0, bytes)
        } else {
            (bytes, 0)
        }
    };
    let (params, tier_params) = split(p.params, held.params);
    let (grads, tier_grads) = split(p.grads, held.grads);
    let (optimizer, tier_opt) = split(p.optimizer, held.optimizer);
    // Updated in the backward: two copies of p, m and v, and the gradients never stored.
    let tier = match in_backward {
        true => 2 * (tier_params + tier_opt),
        false => tier_params + tier_grads + tier_opt,
    };
    let (backup, backup_disk) = backup_bytes(d, p);
    let per_rank = RankBytes {
        params,
        grads,
        optimizer,
        working,
        activations: d.activation_bytes,
        staging,
        backup,
        tier,
        backup_disk,
    };
    let snapshot_bytes = snapshot_bytes(d, p);
    Fit {
        placement: p,
        tile_elems,
        staging_buffers: if p.any_nvme() { STAGING_BUFFERS } else { 0 },
        per_rank,
        snapshot_bytes,
        process_bytes: BASE_BYTES + d.ranks_in_process * per_rank.ram() + snapshot_bytes,
        update_in_backward: in_backward,
        update_reuses_params: reuse,
    }
}

/// What reading and writing the tier keeps in RAM beside compute: shards read ahead, reduced
/// shards being written, and (with `reuse`) the gathered shards an update in the backward keeps.
fn tier_read_bytes(d: &Demand, p: Placement, reuse: bool) -> u64 {
    let unit = d.largest_unit_elems;
    // Parameters on the tier: the shard read for a gather and the next one read ahead.
    // Gradients on the tier: the reduced shard's f32 mean, made from the accumulator, then
    // written beside compute while the next unit's accumulator fills.
    // In u128: a unit of billions of elements times a share of trillions passes u64.
    let shard = (u128::from(unit) * u128::from(d.owned_elems))
        .div_ceil(u128::from(d.total_elems.max(1))) as u64;
    let overlap = match (p.params, p.grads) {
        (Tier::Nvme, Tier::Nvme) => (8 + 4) * shard,
        (Tier::Nvme, _) => 8 * shard,
        (_, Tier::Nvme) => 4 * shard,
        _ => 0,
    };
    let kept_params = if reuse { 8 * shard } else { 0 };
    overlap + kept_params
}

/// A chunk's fp32 parameters with their optimizer state.
fn chunk_state_bytes(d: &Demand, elems: u64) -> u64 {
    4 * elems * (1 + d.state_per_param)
}

/// Buddy backups' (RAM, disk) bytes per rank. With a tier they go to files beside it, a piece
/// at a time; without one, they are whole copies in RAM.
fn backup_bytes(d: &Demand, p: Placement) -> (u64, u64) {
    let piece_bytes = chunk_state_bytes(d, SNAPSHOT_PIECE_ELEMS.max(d.chunk_elems));
    // The local half holds every parameter this rank keeps as an fp32 chunk state (a bf16 copy
    // widened) and its optimizer state; the other half its predecessor's owned state.
    let held_params = match d.stage {
        Stage::Zero3 => d.owned_elems,
        _ => d.total_elems,
    };
    let state_elems = match d.stage {
        Stage::Zero0 => d.total_elems,
        _ => d.owned_elems,
    };
    let backup_state =
        4 * held_params + 4 * d.state_per_param * state_elems + chunk_state_bytes(d, d.owned_elems);
    match (d.backups, p.any_nvme()) {
        (false, _) => (0, 0),
        (true, false) => (backup_state, 0),
        (true, true) => (
            (BACKUP_PIECES * piece_bytes).min(backup_state) + 2 * BACKUP_FILE_BUFFER_BYTES,
            2 * backup_state,
        ),
    }
}

/// A checkpoint's RAM while it is written: streamed off the tier a piece at a time when there is
/// one, else a whole copy.
fn snapshot_bytes(d: &Demand, p: Placement) -> u64 {
    match d.snapshots {
        Snapshots::None => 0,
        Snapshots::StreamedOffTier if p.any_nvme() => {
            let piece = SNAPSHOT_PIECE_ELEMS.max(d.chunk_elems).min(d.total_elems);
            (SNAPSHOT_PIECES + d.ranks_in_process) * chunk_state_bytes(d, piece)
                + d.ranks_in_process * SNAPSHOT_FILE_BUFFER_BYTES
        }
        Snapshots::Whole | Snapshots::StreamedOffTier => chunk_state_bytes(d, d.total_elems),
    }
}

fn refusal(
    d: &Demand,
    lim: &Limits,
    candidates: &[Placement],
    allowed: &dyn Fn(&Placement) -> bool,
) -> String {
    let budget = lim.budget;
    let chosen = candidates
        .iter()
        .filter(|p| allowed(p))
        .map(|p| evaluate(d, *p, MIN_TILE_ELEMS))
        .min_by_key(|f| f.process_bytes)
        .unwrap_or_else(|| evaluate(d, Placement::RAM, MIN_TILE_ELEMS));
    let r = chosen.per_rank;
    let per = if d.ranks_in_process > 1 {
        format!(" for {} ranks in this process", d.ranks_in_process)
    } else {
        String::new()
    };
    let mut msg = format!(
        "the run needs {}{per} (per rank: parameters {}, gradients {}, optimizer state {}, working set and activations {}) but may use {}",
        gib(chosen.process_bytes),
        gib(r.params),
        gib(r.grads),
        gib(r.optimizer),
        gib(r.working + r.activations + r.staging),
        match budget {
            Budget::Configured(b) => format!("{} (memory_max_bytes)", gib(b)),
            Budget::Machine(b) => format!("{} (90% of the memory available)", gib(b)),
        }
    );
    if r.backup > 0 {
        msg += &format!(
            "; buddy backups hold {} per rank in RAM, or go to files beside the tier when state is offloaded (--replicate-every 0 turns them off; a lost rank then stops the run)",
            gib(r.backup)
        );
    }
    if chosen.snapshot_bytes > 0 {
        msg += &format!(
            "; a checkpoint holds {} in RAM while it is written (saving needs that memory)",
            gib(chosen.snapshot_bytes)
        );
    }
    msg += &what_would_fit(d, lim, candidates);
    msg
}

/// The placement that needs least, whether or not the configuration allows it; if even that does
/// not fit with backups, the same without them (and `true`).
fn least_needed(d: &Demand, budget: Budget, candidates: &[Placement]) -> (Fit, bool) {
    let least = |d: &Demand| {
        candidates
            .iter()
            .map(|p| evaluate(d, *p, MIN_TILE_ELEMS))
            .min_by_key(|f| f.process_bytes)
            .expect("there is always the all-RAM placement")
    };
    let mut best = least(d);
    let mut no_backups = false;
    if best.process_bytes > budget.bytes() && d.backups {
        let without = least(&Demand {
            backups: false,
            ..*d
        });
        if without.process_bytes <= budget.bytes() {
            (best, no_backups) = (without, true);
        }
    }
    (best, no_backups)
}

/// What the refusal suggests: the flags that would fit the run, or the memory it needs at least.
fn what_would_fit(d: &Demand, lim: &Limits, candidates: &[Placement]) -> String {
    let budget = lim.budget;
    let (best, no_backups) = least_needed(d, budget, candidates);
    if best.process_bytes <= budget.bytes() {
        let dir = if lim.has_nvme_dir || !best.placement.any_nvme() {
            ""
        } else {
            " --nvme-dir DIR"
        };
        let flags = [
            no_backups.then(|| "--replicate-every 0".to_string()),
            best.placement.any_nvme().then(|| best.placement.flags()),
        ]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(" ");
        format!("; {flags}{dir} would fit it in {}", gib(best.process_bytes))
    } else {
        let how = if best.placement.any_nvme() {
            best.placement.flags()
        } else {
            "all in RAM".into()
        };
        let mut msg = match budget {
            Budget::Configured(_) => format!(
                "; the least any placement needs is {} ({how}): raise --memory-max to at least {}",
                gib(best.process_bytes),
                gib(best.process_bytes)
            ),
            Budget::Machine(_) => format!(
                "; even the least any placement needs ({}, {how}) is more than this machine has",
                gib(best.process_bytes)
            ),
        };
        if best.per_rank.grads > best.per_rank.ram() / 2 {
            msg +=
                ", or spread the ranks over processes (ezero launch), since stage 0-1 gradients stay in RAM";
        }
        msg
    }
}

fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

#[cfg(test)]
mod tests;
