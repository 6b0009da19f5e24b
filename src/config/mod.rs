//! Typed training configuration, validated once.
//!
//! The same keys come from a TOML file (`--config FILE`) and from command-line flags (flags win).
//! Units are in the names (`chunk_elems`, `collective_timeout_ms`). Unknown keys are errors, not
//! silently ignored, because a misspelt key in a training config is a silent wrong run.
//!
//! The keys are one flat table, so `TrainConfig` is one struct; the concepts it covers each
//! have a file with their types and checks: the model's shape (`shape`), the optimizer and its
//! schedule (`optim`), the membership script (`membership`), where state lives (`offload`),
//! fault injection (`faults`, the one field that groups its keys), and what a bad value gets
//! (`error`).
//!
//! Usage: README.md (Flags).

mod device;
mod error;
mod faults;
mod membership;
mod offload;
mod optim;
mod shape;
#[cfg(test)]
mod tests;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use self::device::DeviceChoice;
use self::error::toml_error;
pub use self::error::ConfigError;
pub use self::faults::Faults;
pub use self::membership::{At, Round, RoundKill};
pub use self::offload::{parse_bytes, NvmeFault, NvmeFaultKind};
pub use self::optim::OptimizerChoice;
pub use self::shape::ModelKind;
use crate::data::DataFormat;
use crate::model::backend::{GeluForm, Precision};
use crate::plan::activations::ActivationCheckpointing;
use crate::plan::tier::Offload;
use crate::reduce::ReduceMode;

/// The RoPE base of Llama 1 and 2.
pub const DEFAULT_ROPE_THETA: f64 = 10_000.0;
/// The RMSNorm epsilon of Llama 1 and SmolLM2.
pub const DEFAULT_NORM_EPS: f64 = 1e-5;

fn is_zero(v: &usize) -> bool {
    *v == 0
}

fn is_default_theta(v: &f64) -> bool {
    *v == DEFAULT_ROPE_THETA
}

fn is_default_eps(v: &f64) -> bool {
    *v == DEFAULT_NORM_EPS
}

/// Everything a training run needs. Defaults are the `ezero train` demo job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Number of in-process rank actors (default 4).
    pub ranks: u32,
    /// ZeRO stage 0-3 (default 3).
    pub stage: u8,
    /// `gpt`, `llama` or `mlp` (default gpt).
    pub model: ModelKind,
    /// Transformer blocks (GPT) or hidden layers (MLP) (default 2).
    pub layers: usize,
    /// Model width (default 128).
    pub d_model: usize,
    /// Attention heads; must divide `d_model` (default 4).
    pub heads: usize,
    /// Token ids the model embeds and predicts (default 256: the built-in byte-level data).
    pub vocab: usize,
    /// GPT: rows of the position embedding, the longest sequence the model accepts; 0 means
    /// `seq_len` (default 0).
    pub max_positions: usize,
    /// The Hugging Face model directory the run started from (`--init hf:DIR`): its
    /// `config.json` set the shape above, and `checkpoint export --format hf` copies its
    /// tokenizer files (default none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hf_dir: Option<PathBuf>,
    /// GPT: the LM head's weight is the token embedding, as in GPT-2 (default false).
    pub tie_embeddings: bool,
    /// GPT: the MLP's GELU, `erf` (PyTorch's `nn.GELU()`) or `tanh` (GPT-2's `gelu_new`)
    /// (default erf).
    pub gelu: GeluForm,
    /// Llama: key/value heads (grouped-query attention); 0 means `heads` (default 0).
    #[serde(skip_serializing_if = "is_zero")]
    pub kv_heads: usize,
    /// Llama: width of one attention head; 0 means `d_model / heads` (default 0).
    #[serde(skip_serializing_if = "is_zero")]
    pub head_dim: usize,
    /// Llama: the SwiGLU MLP's inner width; 0 means `8 · d_model / 3` rounded up to a
    /// multiple of 64 (default 0).
    #[serde(skip_serializing_if = "is_zero")]
    pub ffn: usize,
    /// Llama: the RoPE base θ (default 10000).
    #[serde(skip_serializing_if = "is_default_theta")]
    pub rope_theta: f64,
    /// Llama: the RMSNorm epsilon (default 1e-5).
    #[serde(skip_serializing_if = "is_default_eps")]
    pub norm_eps: f64,
    /// Llama: biases on the q/k/v projections, as in Qwen2 (default false).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub qkv_bias: bool,
    /// Tokens per sequence (default 64).
    pub seq_len: usize,
    /// Micro-batches per global step; the global batch never depends on the world size
    /// (default 8).
    pub micro_batches: u32,
    /// Sequences per micro-batch (default 4).
    pub micro_batch_size: usize,
    /// Optimizer steps to run (default 150).
    pub steps: u64,
    /// Seed for initialisation and data (default 0).
    pub seed: u64,
    /// Peak learning rate (default 3e-3).
    pub lr: f32,
    /// Linear warm-up steps before cosine decay (default 10).
    pub warmup_steps: u64,
    /// Cosine decays to `lr * min_lr_ratio` at the last step; 1.0 keeps lr constant
    /// (default 0.1).
    pub min_lr_ratio: f32,
    /// `adamw`, `adam` or `sgd` (default adamw).
    pub optimizer: OptimizerChoice,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Weight decay (decoupled for AdamW, L2 for Adam and SGD) (default 0.1).
    pub weight_decay: f32,
    /// SGD momentum (default 0.9).
    pub momentum: f32,
    /// Global gradient-norm clipping threshold; 0 disables (default 1.0).
    pub grad_clip: f32,
    /// `exact` (bit-identical across world sizes, default) or `fast`.
    pub reduce: ReduceMode,
    /// Train on these files instead of the embedded Markov corpus: a file, directory, glob, or a
    /// comma-separated list of them, read in order (`data::sources`).
    pub data: Option<PathBuf>,
    /// Tokenize `data` with this `tokenizer.json` (default: the `hf_dir`'s, if it has one;
    /// without either, `data` is read as bytes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// `auto` (`.jsonl`/`.json` are JSON Lines with a `text` field, anything else text),
    /// `text` or `jsonl` (default auto).
    pub data_format: DataFormat,
    /// Where tokenized corpora are cached (default `$XDG_CACHE_HOME/elastic-zero/tokens`, or
    /// `~/.cache/elastic-zero/tokens`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_cache_dir: Option<PathBuf>,
    /// Write a JSON summary here.
    pub json: Option<PathBuf>,
    /// Held-out data (same formats and tokenizer as `data`): its loss and perplexity on fixed
    /// windows, after the last step and every `eval_every` steps (default none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_data: Option<PathBuf>,
    /// Evaluate `eval_data` every this many steps as well as at the end (0: only at the end;
    /// default 0).
    #[serde(default)]
    pub eval_every: u64,
    /// Append one JSON line per step here: step, loss, lr, grad norm, tokens/s, step seconds,
    /// members (default none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_file: Option<PathBuf>,
    /// Elements per shard chunk: the unit of ownership and of rebalancing (default 8192).
    pub chunk_elems: usize,
    /// ZeRO-3: units whose full parameters may be live at once (current + prefetched) (default 2).
    pub max_live_units: usize,
    /// Whether blocks recompute their forward intermediates in the backward (`always`), keep
    /// them from the forward (`never`), or keep them when the memory planner says they fit the
    /// budget without more offload (`auto`). The same bits either way (default auto).
    pub activation_checkpointing: ActivationCheckpointing,
    /// Older spelling of `activation_checkpointing = "never"` (default false).
    pub keep_activations: bool,
    /// `fp32`, or `bf16` mixed precision: the model computes with bf16 parameters and bf16
    /// matrix-product operands (f32 accumulation), ZeRO-3 gathers parameters as bf16, and the
    /// master weights, optimizer state and exact gradient reduction stay as in fp32 (default
    /// fp32).
    pub precision: Precision,
    /// Deadline for any single receive inside a collective (default 30000).
    pub collective_timeout_ms: u64,
    /// Bound on |gradient| for the first step's fixed-point scale; later steps derive it from the
    /// previous step. A step whose gradients exceed it is redone once (default 65536).
    pub initial_grad_bound: f32,
    /// Threads for the optimizer step on each rank (default 1).
    pub optimizer_threads: usize,
    /// Threads each rank's large matrix products use, cutting C into row blocks; the bits are
    /// the same for any count. 0 (the default): the machine's cores over `ranks`, at least 1,
    /// so a run with fewer ranks than cores (one rank streaming a model from the tier) gives
    /// the spare cores to its products, and one with a rank per core keeps one thread a rank.
    /// A worker process divides its host's cores by the workers the coordinator saw connect
    /// from its address instead of by `ranks`.
    pub compute_threads: usize,
    /// Tokens to sample from the trained model at the end (GPT and Llama; default 160).
    pub sample_tokens: usize,
    /// Ranks that drain and leave at the start of a step (`RANK@STEP`).
    pub leave: Vec<At>,
    /// New ranks that join at the start of a step (`COUNT@STEP`); they take the next unused ids.
    pub join: Vec<At>,
    /// Ranks that die abruptly during a step (`RANK@STEP`).
    pub kill: Vec<At>,
    /// The world never shrinks below this many ranks (default 1).
    pub min_ranks: u32,
    /// Nor grows beyond this many (default 64).
    pub max_ranks: u32,
    /// Buddy backups of every rank's state at least every this many steps; 0 turns them off,
    /// and then losing a rank stops the run (default 1).
    pub replicate_every: u64,
    /// Directory to save checkpoints in (`step-N/` subdirectories); none: no checkpoints.
    pub save_dir: Option<PathBuf>,
    /// Save a checkpoint after every this many steps and after the last step; 0 saves only on
    /// SIGTERM or SIGINT (default 0). Needs `save_dir`.
    pub save_every: u64,
    /// Complete checkpoints kept in `save_dir`, newest first; 0 keeps all (default 3).
    pub keep_checkpoints: usize,
    /// Where Adam m and v (SGD momentum) live: `none` (RAM), `nvme` (the tier under `nvme_dir`)
    /// or `auto`: RAM unless the run does not fit `memory_max_bytes`, then the tier if
    /// `nvme_dir` is set (default auto).
    pub offload_optimizer: Offload,
    /// Stage 3: where the rank's parameter shard lives, like `offload_optimizer` (default auto).
    pub offload_params: Offload,
    /// Stages 2-3: where the rank's reduced gradient shard waits between backward and the
    /// optimizer, like `offload_optimizer` (default auto).
    pub offload_grads: Offload,
    /// Directory of the NVMe tier; each rank uses its own subfolder and one file in it. Must
    /// support direct I/O (tmpfs does not) unless `nvme_buffered` (default none).
    pub nvme_dir: Option<PathBuf>,
    /// Use buffered I/O on the tier instead of O_DIRECT, for file systems without direct I/O
    /// (page cache then counts against memory) (default false).
    pub nvme_buffered: bool,
    /// I/O requests in flight per rank (default 32).
    pub nvme_queue_depth: u32,
    /// Bytes per I/O request, a multiple of 4096 (default 1048576).
    pub nvme_block_bytes: u64,
    /// Elements per tier record (a multiple of 1024); unset: the planner picks the largest
    /// that fits, at most 262144 (1 MiB per stored value) (default unset).
    pub nvme_record_elems: Option<u64>,
    /// The most memory the process may use; the planner picks the least offload that fits or
    /// refuses before training (default: 90% of the memory available at start).
    pub memory_max_bytes: Option<u64>,
    /// The accelerator the kernels run on: `none` (the host CPU) or `sim`, the simulated device
    /// (default none).
    pub device: DeviceChoice,
    /// The device's memory: no allocation on it goes past this (needed with a device; default
    /// unset).
    pub device_memory_max_bytes: Option<u64>,
    /// The simulated device's host link, GB/s each way (default 25, a PCIe 4.0 x16 link).
    pub sim_link_gbps: f64,
    /// Fault injection (`faults.rs`): its keys sit at the top level of the file, beside these.
    #[serde(flatten)]
    pub faults: Faults,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            ranks: 4,
            stage: 3,
            model: ModelKind::Gpt,
            layers: 2,
            d_model: 128,
            heads: 4,
            vocab: 256,
            max_positions: 0,
            hf_dir: None,
            tie_embeddings: false,
            gelu: GeluForm::Erf,
            kv_heads: 0,
            head_dim: 0,
            ffn: 0,
            rope_theta: DEFAULT_ROPE_THETA,
            norm_eps: DEFAULT_NORM_EPS,
            qkv_bias: false,
            tokenizer: None,
            data_format: DataFormat::Auto,
            token_cache_dir: None,
            seq_len: 64,
            micro_batches: 8,
            micro_batch_size: 4,
            steps: 150,
            seed: 0,
            lr: 3e-3,
            warmup_steps: 10,
            min_lr_ratio: 0.1,
            optimizer: OptimizerChoice::Adamw,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            momentum: 0.9,
            grad_clip: 1.0,
            reduce: ReduceMode::Exact,
            data: None,
            json: None,
            eval_data: None,
            eval_every: 0,
            metrics_file: None,
            chunk_elems: 8192,
            max_live_units: 2,
            activation_checkpointing: ActivationCheckpointing::Auto,
            precision: Precision::Fp32,
            keep_activations: false,
            collective_timeout_ms: 30_000,
            initial_grad_bound: 65536.0,
            optimizer_threads: 1,
            compute_threads: 0,
            sample_tokens: 160,
            leave: Vec::new(),
            join: Vec::new(),
            kill: Vec::new(),
            min_ranks: 1,
            max_ranks: 64,
            replicate_every: 1,
            save_dir: None,
            save_every: 0,
            keep_checkpoints: 3,
            offload_optimizer: Offload::Auto,
            offload_params: Offload::Auto,
            offload_grads: Offload::Auto,
            nvme_dir: None,
            nvme_buffered: false,
            nvme_queue_depth: 32,
            nvme_block_bytes: 1 << 20,
            memory_max_bytes: None,
            nvme_record_elems: None,
            device: DeviceChoice::None,
            device_memory_max_bytes: None,
            sim_link_gbps: 25.0,
            faults: Faults::default(),
        }
    }
}

impl TrainConfig {
    /// Parses a TOML config file's text; unknown keys and wrong types are errors.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| toml_error(e, text))
    }

    /// Parses a TOML config file's text over `base`: keys the file sets replace `base`'s, the
    /// others keep `base`'s values (a resumed run starts from the checkpoint's config).
    pub fn from_toml_over(base: &TrainConfig, text: &str) -> Result<Self, ConfigError> {
        let file: toml::Table = toml::from_str(text).map_err(|e| toml_error(e, text))?;
        let mut merged =
            toml::Table::try_from(base).map_err(|e| ConfigError::new("config", e.to_string()))?;
        merged.extend(file);
        toml::Value::Table(merged)
            .try_into()
            .map_err(|e| toml_error(e, text))
    }

    /// The activation policy in effect (`keep_activations` is `never`).
    pub fn activation_policy(&self) -> ActivationCheckpointing {
        if self.keep_activations {
            ActivationCheckpointing::Never
        } else {
            self.activation_checkpointing
        }
    }

    /// Checks every field once; the runtime trusts a validated config. The checks of each
    /// concept live with it: the model's shape (`shape.rs`), the optimizer and its
    /// schedule (`optim.rs`), fault injection (`faults.rs`), the membership script
    /// (`membership.rs`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.ranks == 0 {
            return Err(ConfigError::new(
                "ranks",
                "0 ranks: use 1 or more rank actors",
            ));
        }
        if self.ranks > 256 {
            return Err(ConfigError::new(
                "ranks",
                "at most 256 in-process ranks are supported",
            ));
        }
        if self.stage > 3 {
            return Err(ConfigError::new(
                "stage",
                format!("{} is not a ZeRO stage: use 0, 1, 2 or 3", self.stage),
            ));
        }
        self.validate_shape()?;
        self.validate_optimizer()?;
        self.validate_faults()?;
        if self.keep_activations && self.activation_checkpointing == ActivationCheckpointing::Always
        {
            return Err(ConfigError::new(
                "keep_activations",
                "keep_activations asks never to recompute, activation_checkpointing = \"always\" \
                 always to: drop one (keep_activations means activation_checkpointing = \"never\")",
            ));
        }
        if self.collective_timeout_ms == 0 {
            return Err(ConfigError::new(
                "collective_timeout_ms",
                "must be at least 1",
            ));
        }
        self.validate_membership()?;
        self.validate_offload()?;
        self.validate_device()?;
        if self.save_every > 0 && self.save_dir.is_none() {
            return Err(ConfigError::new(
                "save_every",
                "saving every N steps needs save_dir (--save-dir DIR)",
            ));
        }
        if self.eval_every > 0 && self.eval_data.is_none() {
            return Err(ConfigError::new(
                "eval_every",
                "evaluating every N steps needs eval_data (--eval-data FILE)",
            ));
        }
        for (field, spec) in [("data", &self.data), ("eval_data", &self.eval_data)] {
            if let Some(spec) = spec {
                crate::data::sources::resolve(spec)
                    .map_err(|e| ConfigError::new(field, e.to_string()))?;
            }
        }
        Ok(())
    }

    /// The tokenizer `data` is read with: `tokenizer`, else the `hf_dir`'s `tokenizer.json`.
    pub fn tokenizer_path(&self) -> Option<PathBuf> {
        self.tokenizer.clone().or_else(|| {
            let t = self.hf_dir.as_ref()?.join("tokenizer.json");
            t.is_file().then_some(t)
        })
    }

    /// Where tokenized corpora are cached (see `token_cache_dir`).
    pub fn token_cache(&self) -> Option<PathBuf> {
        self.token_cache_dir.clone().or_else(|| {
            let base = std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
            Some(base.join("elastic-zero").join("tokens"))
        })
    }

    /// Tokens in one global batch.
    pub fn tokens_per_step(&self) -> usize {
        self.micro_batches as usize * self.micro_batch_size * self.seq_len
    }
}
