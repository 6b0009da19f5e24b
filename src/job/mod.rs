//! Turning a validated config into what a run trains: the model, the dataset, the optimizer and
//! its learning-rate schedule, the memory plan, and the run's plan (`run_plan`) that every
//! process of the run starts from.

pub mod eval;
pub mod run_plan;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::{ConfigError, DeviceChoice, ModelKind, OptimizerChoice, TrainConfig};
use crate::data::chat::ChatTemplate;
use crate::data::instruct::{self, InstructSetup};
use crate::data::{markov::MarkovSource, sources, text::TextData, DataError, DataFormat};
use crate::data::{Dataset, InstructData, TokenData};
use crate::model::backend::Backend;
use crate::model::gpt::{Gpt, GptConfig};
use crate::model::llama::{Llama, LlamaConfig};
use crate::model::mlp::{Mlp, MlpConfig};
use crate::model::tie::Ties;
use crate::model::Model;
use crate::optim::{AdamHyper, LrSchedule, OptimSettings, OptimizerKind};
use crate::plan::activations::{choose, ActivationCheckpointing, ActivationChoice};
use crate::plan::device::{place_device, DeviceDemand};
use crate::plan::tier::working::{self, StepShape, TieSize, UnitSize};
use crate::plan::tier::{machine_budget, place, Budget, Demand, Fit, FitError, Limits, Snapshots};
use crate::plan::{ShardMap, Stage};

/// The built-in model the config names, on the CPU backend of its `precision` (with the
/// simulated device of `device = "sim"`).
pub fn build_model(cfg: &TrainConfig) -> Result<Arc<dyn Model>, ConfigError> {
    build_model_on(cfg, cfg.backend())
}

/// The model the config names, its kernels running on `be`.
pub fn build_model_on(
    cfg: &TrainConfig,
    be: Arc<dyn Backend>,
) -> Result<Arc<dyn Model>, ConfigError> {
    let model = build_unchecked(cfg, be)?;
    Ties::of(&*model).map_err(|e| ConfigError::new("model", e))?;
    Ok(model)
}

fn build_unchecked(cfg: &TrainConfig, be: Arc<dyn Backend>) -> Result<Arc<dyn Model>, ConfigError> {
    // A process runs one job's model: its products take the job's thread count.
    crate::model::gemm::set_threads(compute_threads(cfg));
    match cfg.model {
        ModelKind::Gpt => Gpt::with_backend(
            GptConfig {
                vocab: cfg.vocab,
                seq_len: cfg.positions(),
                d_model: cfg.d_model,
                heads: cfg.heads,
                layers: cfg.layers,
                gelu: cfg.gelu,
                tie_embeddings: cfg.tie_embeddings,
            },
            be,
        )
        .map(|m| Arc::new(m) as Arc<dyn Model>)
        .map_err(|e| ConfigError::new("model", e)),
        ModelKind::Llama => Llama::with_backend(
            LlamaConfig {
                vocab: cfg.vocab,
                max_positions: cfg.positions(),
                d_model: cfg.d_model,
                heads: cfg.heads,
                kv_heads: cfg.kv_heads(),
                head_dim: cfg.head_dim(),
                ffn: cfg.ffn(),
                layers: cfg.layers,
                rope_theta: cfg.rope_theta,
                norm_eps: cfg.norm_eps,
                qkv_bias: cfg.qkv_bias,
                tie_embeddings: cfg.tie_embeddings,
            },
            be,
        )
        .map(|m| Arc::new(m) as Arc<dyn Model>)
        .map_err(|e| ConfigError::new("model", e)),
        ModelKind::Mlp => Mlp::with_backend(
            MlpConfig {
                vocab: cfg.vocab,
                d_model: cfg.d_model,
                hidden: 4 * cfg.d_model,
                layers: cfg.layers,
            },
            be,
        )
        .map(|m| Arc::new(m) as Arc<dyn Model>)
        .map_err(|e| ConfigError::new("model", e)),
    }
}

/// The dataset the config names: its files (see `data::sources`) as bytes, tokens or
/// instruction records, or the embedded Markov corpus.
pub fn build_dataset(cfg: &TrainConfig) -> Result<Arc<Dataset>, ConfigError> {
    let err = |e: DataError| ConfigError::new("data", e.to_string());
    let data = match (&cfg.data, cfg.tokenizer_path()) {
        (Some(spec), Some(tok)) => token_dataset(cfg, &sources::resolve(spec).map_err(err)?, &tok)?,
        (Some(spec), None) => {
            let files = sources::resolve(spec).map_err(err)?;
            if let Some(dir) = &cfg.hf_dir {
                return Err(ConfigError::new(
                    "tokenizer",
                    format!(
                        "{} has no tokenizer.json, and the model's ids are not bytes: pass                          --tokenizer FILE",
                        dir.display()
                    ),
                ));
            }
            // Bytes of JSON would train the model on the records' syntax.
            if let Some(path) = files
                .iter()
                .find(|f| cfg.data_format.resolve(f) == DataFormat::Jsonl)
            {
                return Err(ConfigError::new(
                    "data_format",
                    format!(
                        "{} is JSON Lines, and without a tokenizer the model reads bytes: pass                          --tokenizer FILE (or --init a model with one) to train on its records,                          or --data-format text to train on the file's bytes as they are",
                        path.display()
                    ),
                ));
            }
            Dataset::Text(TextData::load_files(&files).map_err(err)?)
        }
        (None, _) => Dataset::Markov(MarkovSource::new(cfg.seed)),
    };
    data.validate(cfg.seq_len)
        .map_err(|e| ConfigError::new("data", e.to_string()))?;
    if data.vocab() > cfg.vocab {
        return Err(ConfigError::new(
            "vocab",
            format!(
                "the data's ids reach {} but the model embeds only {} ids: use a tokenizer that \
                 matches the model, or a model with at least {} tokens",
                data.vocab() - 1,
                cfg.vocab,
                data.vocab()
            ),
        ));
    }
    Ok(Arc::new(data))
}

/// `files` under the tokenizer `tok`: a corpus of text (files and `text` records, packed), or
/// instruction records (any chat or prompt/completion record; see `data::instruct`).
fn token_dataset(cfg: &TrainConfig, files: &[PathBuf], tok: &Path) -> Result<Dataset, ConfigError> {
    let err = |e: DataError| ConfigError::new("data", e.to_string());
    let jsonl = |f: &Path| cfg.data_format.resolve(f) == DataFormat::Jsonl;
    let records = instruct::read_records(files, jsonl).map_err(err)?;
    if records.iter().all(|r| r.record.is_text()) {
        let cache = cfg.token_cache();
        let t = TokenData::load_files(files, cfg.data_format, tok, cache.as_deref());
        return Ok(Dataset::Tokens(t.map_err(err)?));
    }
    let tokenizer = tokenizers::Tokenizer::from_file(tok).map_err(|e| {
        ConfigError::new(
            "tokenizer",
            format!("{}: not a tokenizer.json: {e}", tok.display()),
        )
    })?;
    // The chat template sits beside the tokenizer, in the model's directory.
    let config = match &cfg.hf_dir {
        Some(dir) if cfg.tokenizer.is_none() => dir.join("tokenizer_config.json"),
        _ => tok.with_file_name("tokenizer_config.json"),
    };
    let template = ChatTemplate::from_tokenizer_config(&config)
        .map_err(|e| ConfigError::new("tokenizer", e))?;
    let setup = InstructSetup {
        tokenizer: &tokenizer,
        template: template.as_ref(),
        template_looked_at: &config,
        micro_batches: cfg.micro_batches,
        describe: sources::describe(files),
    };
    Ok(Dataset::Instruct(
        InstructData::new(&records, &setup).map_err(err)?,
    ))
}

/// The held-out data of `eval_data`, read as `data` is (same format and tokenizer); `None`
/// without it.
pub fn build_eval_dataset(cfg: &TrainConfig) -> Result<Option<Arc<Dataset>>, ConfigError> {
    let Some(path) = &cfg.eval_data else {
        return Ok(None);
    };
    let as_data = TrainConfig {
        data: Some(path.clone()),
        ..cfg.clone()
    };
    build_dataset(&as_data)
        .map(Some)
        .map_err(|e| ConfigError::new("eval_data", e.message))
}

/// Threads a rank's matrix products use: `compute_threads`, or with 0 the cores over the
/// ranks (in one process all of them share its host; a worker process resolves the setting
/// first, over the ranks the coordinator counted on its host, see `compute_threads_for`).
pub fn compute_threads(cfg: &TrainConfig) -> usize {
    compute_threads_for(cfg.compute_threads, cfg.ranks)
}

/// `requested` threads, or with 0 this machine's cores over `ranks_here` ranks sharing them
/// (at least 1).
pub fn compute_threads_for(requested: usize, ranks_here: u32) -> usize {
    match requested {
        0 => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (cores / ranks_here.max(1) as usize).max(1)
        }
        n => n,
    }
}

/// Optimizer settings from a config.
pub fn optim_settings(cfg: &TrainConfig) -> OptimSettings {
    let kind = match cfg.optimizer {
        OptimizerChoice::Adamw => OptimizerKind::AdamW,
        OptimizerChoice::Adam => OptimizerKind::Adam,
        OptimizerChoice::Sgd => OptimizerKind::Sgd {
            momentum: cfg.momentum as f64,
            nesterov: false,
        },
    };
    let hyper = AdamHyper {
        lr: cfg.lr,
        beta1: cfg.beta1 as f64,
        beta2: cfg.beta2 as f64,
        eps: cfg.eps as f64,
        weight_decay: cfg.weight_decay as f64,
        decoupled: kind == OptimizerKind::AdamW,
    };
    OptimSettings {
        kind,
        hyper,
        threads: cfg.optimizer_threads,
    }
}

/// The learning-rate schedule of a config.
pub fn lr_schedule(cfg: &TrainConfig) -> LrSchedule {
    LrSchedule {
        base_lr: cfg.lr,
        warmup_steps: cfg.warmup_steps,
        total_steps: if cfg.min_lr_ratio >= 1.0 {
            0
        } else {
            cfg.steps
        },
        min_lr_ratio: cfg.min_lr_ratio as f64,
    }
}

/// Chunks past which [`memory_demand`] bounds the largest owned share instead of planning it:
/// the plan would take gigabytes and minutes before the memory check could refuse the run.
const PLAN_CHUNKS_MAX: usize = 1 << 24;

/// What a run of `cfg` needs per rank, for the memory planner (`plan::tier`), with
/// `ranks_in_process` ranks' state in this process (all of them for `ezero train`, one for a
/// worker process). `streamed_snapshots`: the runtime streams snapshots off the tier (an
/// in-process run with a snapshot sink) rather than gathering them whole.
pub fn memory_demand(
    cfg: &TrainConfig,
    model: &dyn Model,
    ranks_in_process: u64,
    streamed_snapshots: bool,
) -> Demand {
    let numels: Vec<usize> = model.units().iter().map(|u| u.numel()).collect();
    let members: Vec<u32> = (0..cfg.ranks).collect();
    let total: usize = numels.iter().sum();
    let chunk = cfg.chunk_elems.max(1);
    let chunks: usize = numels.iter().map(|n| n.div_ceil(chunk)).sum();
    let owned = if chunks <= PLAN_CHUNKS_MAX {
        ShardMap::plan(&numels, &members, cfg.chunk_elems, 0)
            .map(|m| members.iter().map(|&r| m.owned_elems(r)).max().unwrap_or(0))
            .unwrap_or(total)
    } else {
        // Each chunk goes to the least-loaded member, so none owns more than the mean and one
        // chunk: a bound, without planning billions of chunks for a run that cannot fit.
        (total.div_ceil(members.len().max(1)) + chunk).min(total)
    };
    let stage = Stage::from_u8(cfg.stage).unwrap_or(Stage::Zero3);
    let shape = StepShape {
        stage,
        grad_elem_bytes: cfg.reduce.elem_bytes() as u64,
        param_copy_bytes: cfg.precision.param_bytes(),
        max_live_units: cfg.max_live_units as u64,
    };
    let (sizes, ties) = unit_sizes(model);
    Demand {
        compute_bytes: working::compute_bytes(&sizes, &ties, shape),
        stage,
        ranks_in_process,
        total_elems: numels.iter().sum::<usize>() as u64,
        owned_elems: owned as u64,
        largest_unit_elems: numels.iter().copied().max().unwrap_or(0) as u64,
        units: numels.len() as u64,
        tied_elems: Ties::of(model)
            .map(|t| (0..numels.len()).map(|u| t.borrowed_len(u)).sum::<usize>())
            .unwrap_or(0) as u64,
        grad_elem_bytes: cfg.reduce.elem_bytes() as u64,
        state_per_param: optim_settings(cfg).state_per_param(),
        param_copy_bytes: cfg.precision.param_bytes(),
        max_live_units: cfg.max_live_units as u64,
        // The least the policy allows; `plan_memory` settles auto.
        activation_bytes: activation_bytes(
            cfg,
            numels.len(),
            cfg.activation_policy() == ActivationCheckpointing::Never,
        ),
        backups: cfg.replicate_every > 0 && cfg.ranks >= 2,
        snapshots: match (&cfg.save_dir, streamed_snapshots) {
            (None, _) => Snapshots::None,
            (Some(_), false) => Snapshots::Whole,
            (Some(_), true) => Snapshots::StreamedOffTier,
        },
        chunk_elems: cfg.chunk_elems as u64,
        clipping: cfg.grad_clip > 0.0,
    }
}

/// The model's units and ties as the working set's walk sees them.
fn unit_sizes(model: &dyn Model) -> (Vec<UnitSize>, Vec<TieSize>) {
    let ties = Ties::of(model).unwrap_or_default();
    let sizes = model
        .units()
        .iter()
        .enumerate()
        .map(|(u, spec)| UnitSize {
            own_elems: spec.numel() as u64,
            view_elems: (spec.numel() + ties.borrowed_len(u)) as u64,
        })
        .collect();
    let tied = model
        .ties()
        .iter()
        .enumerate()
        .map(|(u, t)| TieSize {
            owner: t.owner,
            user: t.user,
            elems: ties
                .borrowed_by(t.user)
                .find(|(i, _, _)| *i == u)
                .map_or(0, |(_, _, r)| r.len()) as u64,
        })
        .collect();
    (sizes, tied)
}

/// What the device tier (`plan::device`) needs to know about a run of `cfg` whose ranks hold
/// `activation_bytes` of activations.
pub fn device_demand(cfg: &TrainConfig, model: &dyn Model, activation_bytes: u64) -> DeviceDemand {
    let units = model.units();
    let borrowed = |u: usize| Ties::of(model).map_or(0, |t| t.borrowed_len(u));
    DeviceDemand {
        unit_view_elems: (0..units.len())
            .map(|u| (units[u].numel() + borrowed(u)) as u64)
            .collect(),
        param_link_bytes: cfg.precision.param_bytes(),
        local_micro_batches: cfg.micro_batches.div_ceil(cfg.ranks.max(1)) as u64,
        activation_bytes,
    }
}

/// An estimate of one rank's activation memory at its peak: every unit's saved input for the
/// rank's micro-batches, each micro-batch's logits (which the loss turns into their gradient
/// in place), and one unit's intermediates while it is recomputed and differentiated (every
/// unit's when `keep`). Within a few percent of the measured peak RSS on GPT-2 124M and
/// SmolLM2-135M at seq 256 (BENCHMARKS.md).
fn activation_bytes(cfg: &TrainConfig, units: usize, keep: bool) -> u64 {
    let local_mbs = cfg.micro_batches.div_ceil(cfg.ranks.max(1)) as u64;
    let tokens = (cfg.micro_batch_size * cfg.seq_len) as u64;
    let d = cfg.d_model as u64;
    let saved = units as u64 * local_mbs * tokens * d * 4;
    let logits = local_mbs * tokens * cfg.vocab as u64 * 4;
    let per_token = match cfg.model {
        // Q, K, V, attention output, two norms, residuals and the 4d MLP before and after
        // its activation: about 16 d.
        ModelKind::Gpt | ModelKind::Mlp => 16 * d,
        // Three d-wide (norms, residual), compact q/k/v, the fused q|k|v with repeated kv
        // heads and the attention output (5 q-wide), and the SwiGLU's gate, up, SiLU, its
        // derivative and the product (5 ffn-wide).
        ModelKind::Llama => {
            let (q, kv) = (
                (cfg.heads * cfg.head_dim()) as u64,
                (cfg.kv_heads() * cfg.head_dim()) as u64,
            );
            3 * d + 6 * q + 2 * kv + 5 * cfg.ffn() as u64
        }
    };
    // Plus the seq x seq attention weights per head.
    let per_unit = tokens * (per_token + (cfg.heads * cfg.seq_len) as u64) * 4;
    // One unit's intermediates (every unit's, per micro-batch, when kept) and the gradients
    // of the one being differentiated, about as large.
    let kept = if keep {
        per_unit * units as u64 * local_mbs + per_unit
    } else {
        2 * per_unit
    };
    saved + logits + kept
}

/// Where the run's state goes, whether blocks keep their activations, and how much memory it
/// needs; or why it cannot run in `available_bytes` (the machine's, used when
/// `memory_max_bytes` is not set). The arguments are [`memory_demand`]'s.
pub fn plan_memory(
    cfg: &TrainConfig,
    model: &dyn Model,
    ranks_in_process: u64,
    streamed_snapshots: bool,
    available_bytes: u64,
) -> Result<(Fit, ActivationChoice), FitError> {
    let demand = memory_demand(cfg, model, ranks_in_process, streamed_snapshots);
    let limits = Limits {
        optimizer: cfg.offload_choice(cfg.offload_optimizer),
        params: cfg.offload_choice(cfg.offload_params),
        grads: cfg.offload_choice(cfg.offload_grads),
        has_nvme_dir: cfg.nvme_dir.is_some(),
        budget: match cfg.memory_max_bytes {
            Some(b) => Budget::Configured(b),
            None => machine_budget(available_bytes),
        },
        tile_elems: cfg.nvme_record_elems,
    };
    let units = model.units().len();
    choose(
        cfg.activation_policy(),
        activation_bytes(cfg, units, true),
        activation_bytes(cfg, units, false),
        |activation_bytes| {
            let fit = place(
                &Demand {
                    activation_bytes,
                    ..demand
                },
                &limits,
            )?;
            // With a device the activations live there too: keeping them must fit it.
            if cfg.device != DeviceChoice::None {
                let d = device_demand(cfg, model, activation_bytes);
                place_device(&d, cfg.device_memory_max_bytes.unwrap_or(0))?;
            }
            Ok(fit)
        },
    )
}

#[cfg(test)]
mod tests {
    use super::compute_threads_for;

    #[test]
    fn automatic_compute_threads_share_this_machines_cores_among_the_ranks_on_it() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(compute_threads_for(3, 64), 3, "an explicit count is kept");
        assert_eq!(compute_threads_for(0, 1), cores);
        assert_eq!(
            compute_threads_for(0, 0),
            cores,
            "no count means this rank alone"
        );
        assert_eq!(compute_threads_for(0, cores as u32 * 4), 1, "at least one");
        if cores >= 2 {
            assert_eq!(compute_threads_for(0, 2), cores / 2);
        }
    }
}
