//! Command-line parsing and the commands themselves. Usage errors (bad flags, bad config, bad
//! data) exit with code 2 and one line naming the field; run failures exit with code 1.
//!
//! Usage: README.md.

mod backups;
mod checkpoint;
mod collectives;
mod control_access;
mod failover;
mod gemm;
mod generate;
mod init;
mod launch;
mod launch_coords;
mod metrics_log;
mod outputs;
mod procs;
mod scheduler;
mod test_hooks;
mod ticker;
mod train;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use elastic_zero::config::{
    parse_bytes, At, ConfigError, DeviceChoice, ModelKind, OptimizerChoice, RoundKill, TrainConfig,
};
use elastic_zero::data::DataFormat;
use elastic_zero::model::backend::{GeluForm, Precision};
use elastic_zero::plan::activations::ActivationCheckpointing;
use elastic_zero::plan::tier::Offload;
use elastic_zero::reduce::ReduceMode;

#[derive(Parser)]
#[command(
    name = "ezero",
    version,
    about = "ZeRO-sharded data-parallel training that survives ranks coming and going"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Train a model with ZeRO stage 0-3 across in-process rank actors.
    Train(Box<TrainArgs>),
    /// Micro-benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Continue a prompt with a pretrained model (`hf:DIR` of GPT-2, Llama or Qwen2, or
    /// `gguf:FILE`) or a checkpoint (KV cache).
    Generate(Box<generate::GenerateArgs>),
    /// Verify, inspect or export a checkpoint.
    #[command(subcommand)]
    Checkpoint(checkpoint::CheckpointCommand),
    /// Run a job's coordinator process: admit `--ranks` workers, then drive the training.
    Coordinator(Box<procs::CoordinatorArgs>),
    /// Run one rank as a worker process of the coordinator at `--join`.
    Worker(procs::WorkerArgs),
    /// Start a coordinator and N worker processes on this machine and show their progress.
    Launch(launch::LaunchArgs),
}

#[derive(Subcommand)]
pub enum BenchCommand {
    /// AdamW step throughput on a flat fp32 shard vs this machine's memory bandwidth (one JSON line).
    Adam {
        /// Elements in the shard.
        #[arg(long, default_value_t = 16 << 20)]
        numel: usize,
        /// Threads for the step (and for the bandwidth reference).
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// Seconds of timed work per measurement.
        #[arg(long, default_value_t = 2.0)]
        min_time_s: f64,
    },
    /// Checkpoint save/load throughput vs the disk's direct-I/O bandwidth, and the training
    /// slowdown while background saves run (JSON lines).
    Checkpoint(Box<checkpoint::BenchCheckpointArgs>),
    /// The NVMe tier's I/O engine: sequential direct-I/O write and read GB/s beside fio (or dd)
    /// on the same file system, in the same run (JSON lines, then the medians).
    Io {
        /// Directory on the file system to measure (where --nvme-dir would point).
        #[arg(long)]
        dir: PathBuf,
        /// Bytes written and read per measurement.
        #[arg(long, default_value = "2GiB", value_parser = parse_bytes)]
        size: u64,
        /// Bytes per I/O request.
        #[arg(long, default_value = "1MiB", value_parser = parse_bytes)]
        block: u64,
        /// Requests in flight (the tier's default, `nvme_queue_depth`).
        #[arg(long, default_value_t = 32)]
        queue_depth: u32,
        #[arg(long, default_value_t = 3)]
        rounds: u32,
    },
    /// All-gather, reduce-scatter, all-reduce and broadcast bandwidth over the local or QUIC
    /// transport (JSON lines, nccl-tests definitions).
    Collectives(Box<collectives::CollectivesArgs>),
    /// The model's matrix products: GFLOP/s per kernel path beside matrixmultiply and (with
    /// --torch-python) PyTorch's single-thread GEMM, same shapes, same run.
    Gemm(Box<gemm::BenchGemmArgs>),
}

/// `ezero train` flags. Every flag overrides the same key of `--config FILE`.
// Negative numbers are values, so `--lr -1` gets the range check's message, not clap's
// "unexpected argument".
#[derive(Args, Default)]
#[command(allow_negative_numbers = true)]
pub struct TrainArgs {
    /// TOML file with any of the keys below (snake_case); flags override it [default: none].
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// In-process rank actors [default: 4].
    #[arg(long)]
    pub ranks: Option<u32>,
    /// ZeRO stage 0|1|2|3 [default: 3].
    #[arg(long)]
    pub stage: Option<u8>,
    /// gpt|llama|mlp [default: gpt].
    #[arg(long, value_parser = parse_model)]
    pub model: Option<ModelKind>,
    /// Transformer blocks (GPT, Llama) or hidden layers (MLP) [default: 2].
    #[arg(long)]
    pub layers: Option<usize>,
    /// Model width [default: 128].
    #[arg(long)]
    pub d_model: Option<usize>,
    /// Attention heads; must divide --d-model [default: 4].
    #[arg(long)]
    pub heads: Option<usize>,
    /// Token ids the model embeds and predicts; at least the data's (256 for bytes)
    /// [default: 256, or the --init model's].
    #[arg(long)]
    pub vocab: Option<usize>,
    /// GPT and Llama: the LM head's weight is the token embedding (GPT-2's tying)
    /// [default: off].
    #[arg(long)]
    pub tie_embeddings: bool,
    /// Llama: key/value heads (grouped-query attention) [default: --heads].
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Llama: width of one head [default: d_model / heads].
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// Llama: the SwiGLU MLP's inner width [default: 8·d_model/3 rounded up to 64].
    #[arg(long)]
    pub ffn: Option<usize>,
    /// Llama: RoPE base θ [default: 10000].
    #[arg(long)]
    pub rope_theta: Option<f64>,
    /// Llama: RMSNorm epsilon [default: 1e-5].
    #[arg(long)]
    pub norm_eps: Option<f64>,
    /// Llama: biases on the q/k/v projections (Qwen2) [default: off].
    #[arg(long)]
    pub qkv_bias: bool,
    /// GPT: the MLP's GELU, erf or tanh (GPT-2's gelu_new) [default: erf].
    #[arg(long, value_name = "erf|tanh")]
    pub gelu: Option<GeluForm>,
    /// Tokens per training sequence [default: 64].
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Micro-batches per global step (the global batch; independent of --ranks) [default: 8].
    #[arg(long)]
    pub micro_batches: Option<u32>,
    /// Sequences per micro-batch [default: 4].
    #[arg(long)]
    pub micro_batch_size: Option<usize>,
    /// Optimizer steps to run; with --resume, the total to reach (longer or shorter than the
    /// saved run's) [default: 150].
    #[arg(long)]
    pub steps: Option<u64>,
    /// Seed of the initialisation and of the data order [default: 0].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Peak learning rate, above 0 [default: 3e-3].
    #[arg(long)]
    pub lr: Option<f32>,
    /// Linear warm-up steps before the schedule (--lr-schedule) [default: 10].
    #[arg(long)]
    pub warmup_steps: Option<u64>,
    /// After warm-up: `cosine` decay to lr x min_lr_ratio (0.1) at the last step, or
    /// `constant` lr (the schedule that lets --resume lengthen a run bit for bit)
    /// [default: cosine].
    #[arg(long, value_name = "cosine|constant", value_parser = parse_lr_schedule)]
    pub lr_schedule: Option<f32>,
    /// With --resume: accept a new learning-rate schedule (--lr, --warmup-steps,
    /// --lr-schedule, or --steps under a cosine schedule) for the remaining steps
    /// [default: off: a resumed run keeps the saved schedule].
    #[arg(long, requires = "resume")]
    pub reschedule: bool,
    /// adamw|adam|sgd [default: adamw].
    #[arg(long, value_parser = parse_optimizer)]
    pub optimizer: Option<OptimizerChoice>,
    /// Weight decay: decoupled for AdamW, L2 for Adam and SGD [default: 0.1].
    #[arg(long)]
    pub weight_decay: Option<f32>,
    /// Global gradient-norm clip; 0 disables [default: 1.0].
    #[arg(long)]
    pub grad_clip: Option<f32>,
    /// exact|fast gradient reduction [default: exact].
    #[arg(long, value_parser = parse_reduce)]
    pub reduce: Option<ReduceMode>,
    /// Train on these files (their bytes, or their tokens under --tokenizer) instead of the
    /// embedded Markov corpus: a file, a directory (its files sorted by name), a glob (its
    /// matches sorted), or several of them, by repeating the flag or in one comma-separated
    /// list, read in the order given. JSON Lines of `messages` or `prompt`/`completion` records
    /// train on the answers only: one record per row, cut to --seq-len + 1 tokens and padded
    /// (masked); a record with no answer token in that window is refused (README, "Instruction
    /// tuning") [default: the embedded corpus].
    #[arg(long, value_name = "FILE|DIR|GLOB[,...]")]
    pub data: Vec<PathBuf>,
    /// Write a JSON summary to this file at the end; its directory must exist [default: none].
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Held-out data, read like --data: its loss and perplexity on fixed windows (one global
    /// batch's worth) with the trained model at the end, in the output and the JSON summary
    /// [default: none].
    #[arg(long, value_name = "FILE|DIR|GLOB[,...]")]
    pub eval_data: Vec<PathBuf>,
    /// With --eval-data: evaluate every N steps as well as after the last, with the current
    /// parameters (0: only after the last) [default: 0].
    #[arg(long, value_name = "N")]
    pub eval_every: Option<u64>,
    /// Append one JSON line per step: step, loss, lr, grad_norm, tokens_per_s, step_s,
    /// members, skipped [default: none].
    #[arg(long, value_name = "FILE.jsonl")]
    pub metrics_file: Option<PathBuf>,
    /// Elements per shard chunk [default: 8192].
    #[arg(long)]
    pub chunk_elems: Option<usize>,
    /// ZeRO-3: units whose full parameters may be live at once [default: 2].
    #[arg(long)]
    pub max_live_units: Option<usize>,
    /// Recompute each block's forward in its backward (`always`), keep its intermediates from
    /// the forward (`never`), or keep them when the memory planner says they fit the budget
    /// (--memory-max, else 90% of the memory available) without more offload (`auto`). Same
    /// result either way [default: auto].
    #[arg(long, value_name = "auto|always|never")]
    pub activation_checkpointing: Option<ActivationCheckpointing>,
    /// Same as --activation-checkpointing never [default: off].
    #[arg(long)]
    pub keep_activations: bool,
    /// `fp32`, or `bf16` mixed precision: bf16 parameters (gathered as bf16 at stage 3) and bf16
    /// matrix-product operands with f32 accumulation; master weights, Adam state and the exact
    /// gradient reduction stay fp32 [default: fp32].
    #[arg(long, value_name = "fp32|bf16")]
    pub precision: Option<Precision>,
    /// Deadline of any single receive inside a collective, in milliseconds [default: 30000].
    #[arg(long)]
    pub collective_timeout_ms: Option<u64>,
    /// Threads of each rank's optimizer step [default: 1].
    #[arg(long)]
    pub optimizer_threads: Option<usize>,
    /// Threads each rank's matrix products use; 0: the cores over the ranks [default: 0].
    #[arg(long)]
    pub compute_threads: Option<usize>,
    /// Tokens to sample from the trained GPT or Llama at the end; 0 skips [default: 160].
    #[arg(long)]
    pub sample_tokens: Option<usize>,
    /// A rank drains and leaves at the start of a step: RANK@STEP (repeatable) [default: none].
    #[arg(long, value_name = "RANK@STEP")]
    pub leave: Vec<At>,
    /// New ranks join at the start of a step: COUNT@STEP (repeatable; they take the next ids)
    /// [default: none].
    #[arg(long, value_name = "COUNT@STEP")]
    pub join: Vec<At>,
    /// Buddy backups at least every this many steps (0: off; a lost rank then stops the run)
    /// [default: 1 for worker processes; in one process (`ezero train`) 1 only when the run can
    /// lose a rank actor alone (--kill, --kill-during, --control-allow-kill, network faults),
    /// else 0: a process dies whole, with its backups].
    #[arg(long)]
    pub replicate_every: Option<u64>,
    /// The world never shrinks below this many ranks [default: 1].
    #[arg(long)]
    pub min_ranks: Option<u32>,
    /// The world never grows beyond this many ranks [default: 64].
    #[arg(long)]
    pub max_ranks: Option<u32>,
    /// Save checkpoints under this directory (step-N subdirectories), created if missing
    /// [default: none].
    #[arg(long)]
    pub save_dir: Option<PathBuf>,
    /// Save after every K steps and after the last; 0: only on SIGTERM/SIGINT [default: 0].
    #[arg(long)]
    pub save_every: Option<u64>,
    /// Complete checkpoints to keep, newest first; 0 keeps all [default: 3].
    #[arg(long)]
    pub keep_checkpoints: Option<usize>,
    /// Continue from a checkpoint (or a save directory's newest complete one), at any --ranks
    /// and --stage, to --steps; its config is the base that --config and flags override
    /// [default: none].
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// With --resume: if the checkpoint fails verification, fall back to the newest older one
    /// that passes [default: off].
    #[arg(long)]
    pub latest_valid: bool,
    /// Tokenize --data with this tokenizer.json [default: the --init model's tokenizer.json;
    /// without one, bytes].
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// --data layout: auto (.jsonl/.json are JSON Lines of `text`, `messages` or
    /// `prompt`/`completion` records), text or jsonl [default: auto].
    #[arg(long, value_name = "auto|text|jsonl")]
    pub data_format: Option<DataFormat>,
    /// Start from pretrained weights (fresh optimizer state): `hf:DIR` (or a directory), a
    /// Hugging Face GPT-2, Llama or Qwen2 directory whose config.json sets the model's shape;
    /// `gguf:FILE` (or a file starting with the GGUF magic), a llama.cpp Llama-family file;
    /// or a safetensors file of our parameter names (`checkpoint export`) [default: none].
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Serve the HTTP control endpoint (GET /status, GET /metrics, POST /ranks/{id}/drain,
    /// POST /join, POST /checkpoint) on this address, e.g. 127.0.0.1:7070 [default: off].
    /// `ezero coordinator` serves it from the coordinator process (a join there takes standby
    /// workers).
    #[arg(long, value_name = "ADDR", value_parser = parse_control_addr)]
    pub control: Option<std::net::SocketAddr>,
    /// With --control: allow POST /ranks/{id}/kill (abrupt loss, for tests and demos)
    /// [default: off].
    #[arg(long, requires = "control")]
    pub control_allow_kill: bool,
    /// With --control: a file holding the operator token that drain, kill, join and checkpoint
    /// requests must carry (`Authorization: Bearer TOKEN`); without one, an endpoint beyond
    /// loopback refuses every change. EZERO_CONTROL_TOKEN may hold the token itself
    /// [default: none].
    #[arg(long, env = "EZERO_CONTROL_TOKEN_FILE", value_name = "FILE")]
    pub control_token_file: Option<PathBuf>,
    /// With --control: which requests need the operator token: writes (drain, kill, join,
    /// checkpoint) or all (GET /status and /metrics too) [default: writes].
    #[arg(long, value_name = "SCOPE", value_parser = control_access::parse_auth_scope)]
    pub control_auth: Option<elastic_zero::runtime::api::http::AuthScope>,
    /// Where optimizer state lives: none|nvme|auto [default: auto: RAM unless the run does not
    /// fit --memory-max, then the tier if --nvme-dir is set].
    #[arg(long, value_name = "TIER")]
    pub offload_optimizer: Option<Offload>,
    /// Stage 3: where each rank's parameter shard lives: none|nvme|auto [default: auto].
    #[arg(long, value_name = "TIER")]
    pub offload_params: Option<Offload>,
    /// Stages 2-3: where each rank's reduced gradient shard waits for the optimizer:
    /// none|nvme|auto [default: auto].
    #[arg(long, value_name = "TIER")]
    pub offload_grads: Option<Offload>,
    /// Directory of the NVMe tier (each rank gets a subfolder with one file). Needs direct I/O
    /// [default: none].
    #[arg(long, value_name = "DIR")]
    pub nvme_dir: Option<PathBuf>,
    /// Buffered I/O on the tier, for file systems without O_DIRECT (the page cache then counts)
    /// [default: off].
    #[arg(long)]
    pub nvme_buffered: bool,
    /// Elements per tier record (multiple of 1024) [default: the planner's choice, at most
    /// 262144].
    #[arg(long, value_name = "N")]
    pub nvme_record_elems: Option<u64>,
    /// The most memory the process may use, e.g. 2GiB [default: 90% of what is available].
    #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
    pub memory_max: Option<u64>,
    /// The accelerator the kernels run on: none (the host CPU) or sim (the simulated device:
    /// CPU kernels, its own memory, a modeled host link) [default: none].
    #[arg(long, value_name = "DEVICE")]
    pub device: Option<DeviceChoice>,
    /// The device's memory, e.g. 2GiB: no allocation on it goes past this; a run whose unit
    /// does not fit is refused before training [default: unset; needed with --device].
    #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
    pub device_memory_max: Option<u64>,
    /// The simulated device's host link in GB/s each way [default: 25, PCIe 4.0 x16].
    #[arg(long, value_name = "GBPS")]
    pub sim_link_gbps: Option<f64>,
    #[command(flatten, next_help_heading = "Fault injection")]
    pub faults: FaultArgs,
    /// Test hooks from the environment (`test_hooks.rs`): no flag sets them.
    #[arg(skip)]
    pub test_hooks: test_hooks::TestHooks,
}

/// The faults a fault-injection run asks for (the config's fault section; its network and tier
/// faults are config keys only).
#[derive(Args, Default)]
pub struct FaultArgs {
    /// A rank dies abruptly halfway through a step: RANK@STEP (repeatable) [default: none].
    #[arg(long, value_name = "RANK@STEP")]
    pub kill: Vec<At>,
    /// A rank dies abruptly halfway through a round between steps: RANK@STEP:ROUND, ROUND one
    /// of reshard, replicate, restore (repeatable) [default: none].
    #[arg(long, value_name = "RANK@STEP:ROUND")]
    pub kill_during: Vec<RoundKill>,
}

fn parse_control_addr(s: &str) -> Result<std::net::SocketAddr, String> {
    s.parse().map_err(|_| {
        format!("`{s}` is not an IP:PORT address (e.g. 127.0.0.1:7070; port 0 picks one)")
    })
}

fn parse_model(s: &str) -> Result<ModelKind, String> {
    s.parse()
}

/// `--lr-schedule` as the `min_lr_ratio` it sets: 1 holds lr constant after warm-up.
fn parse_lr_schedule(s: &str) -> Result<f32, String> {
    match s {
        "cosine" => Ok(TrainConfig::default().min_lr_ratio),
        "constant" => Ok(1.0),
        _ => Err(format!("unknown schedule `{s}`: use cosine or constant")),
    }
}

fn parse_optimizer(s: &str) -> Result<OptimizerChoice, String> {
    match s {
        "adamw" => Ok(OptimizerChoice::Adamw),
        "adam" => Ok(OptimizerChoice::Adam),
        "sgd" => Ok(OptimizerChoice::Sgd),
        _ => Err(format!("unknown optimizer `{s}`: use adamw, adam or sgd")),
    }
}

fn parse_reduce(s: &str) -> Result<ReduceMode, String> {
    match s {
        "exact" => Ok(ReduceMode::Exact),
        "fast" => Ok(ReduceMode::Fast),
        _ => Err(format!("unknown reduction `{s}`: use exact or fast")),
    }
}

impl TrainArgs {
    /// The config file (if any) with every given flag applied on top, validated.
    pub fn resolve(&self) -> Result<TrainConfig, ConfigError> {
        self.resolve_over(None)
    }

    /// Like [`TrainArgs::resolve`], over `base` (a checkpoint's config) instead of the defaults.
    pub fn resolve_over(&self, base: Option<&TrainConfig>) -> Result<TrainConfig, ConfigError> {
        let mut c = self.config_file(base)?;
        self.apply_run_flags(&mut c);
        self.apply_model_flags(&mut c);
        self.test_hooks.apply(&mut c);
        c.validate()?;
        Ok(c)
    }

    /// `--config FILE` over `base` (or the defaults), or `base` alone without one.
    fn config_file(&self, base: Option<&TrainConfig>) -> Result<TrainConfig, ConfigError> {
        match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    ConfigError::new("config", format!("cannot read {}: {e}", path.display()))
                })?;
                let parsed = match base {
                    Some(b) => TrainConfig::from_toml_over(b, &text),
                    None => TrainConfig::from_toml(&text),
                };
                // Name the file: the message has the key and the line.
                parsed.map_err(|e| {
                    ConfigError::new(&e.field, format!("{}: {}", path.display(), e.message))
                })
            }
            None => Ok(base.cloned().unwrap_or_default()),
        }
    }

    /// The flags of the run: its size, schedule, placement, membership and faults.
    fn apply_run_flags(&self, c: &mut TrainConfig) {
        macro_rules! set {
            ($($f:ident),*) => {$( if let Some(v) = &self.$f { c.$f = v.clone(); } )*};
        }
        set!(
            ranks,
            stage,
            model,
            layers,
            d_model,
            heads,
            vocab,
            seq_len,
            micro_batches,
            micro_batch_size,
            steps,
            seed,
            lr,
            warmup_steps,
            optimizer,
            weight_decay,
            grad_clip,
            reduce,
            chunk_elems,
            max_live_units,
            collective_timeout_ms,
            optimizer_threads,
            compute_threads,
            sample_tokens,
            save_every,
            keep_checkpoints,
            replicate_every,
            min_ranks,
            max_ranks,
            offload_optimizer,
            offload_params,
            offload_grads
        );
        if self.nvme_dir.is_some() {
            c.nvme_dir = self.nvme_dir.clone();
        }
        if self.nvme_buffered {
            c.nvme_buffered = true;
        }
        if self.nvme_record_elems.is_some() {
            c.nvme_record_elems = self.nvme_record_elems;
        }
        if self.memory_max.is_some() {
            c.memory_max_bytes = self.memory_max;
        }
        if let Some(d) = self.device {
            c.device = d;
        }
        if self.device_memory_max.is_some() {
            c.device_memory_max_bytes = self.device_memory_max;
        }
        if let Some(g) = self.sim_link_gbps {
            c.sim_link_gbps = g;
        }
        if let Some(p) = self.activation_checkpointing {
            c.activation_checkpointing = p;
        }
        if self.keep_activations {
            c.keep_activations = true;
        }
        if self.save_dir.is_some() {
            c.save_dir = self.save_dir.clone();
        }
        if let Some(r) = self.lr_schedule {
            c.min_lr_ratio = r;
        }
        for (flag, list) in [
            (&self.leave, &mut c.leave),
            (&self.join, &mut c.join),
            (&self.faults.kill, &mut c.kill),
        ] {
            if !flag.is_empty() {
                list.clone_from(flag);
            }
        }
        if !self.faults.kill_during.is_empty() {
            c.faults.kill_during.clone_from(&self.faults.kill_during);
        }
        if let Some(spec) = join_data_items(&self.data) {
            c.data = Some(spec);
        }
        if self.json.is_some() {
            c.json = self.json.clone();
        }
        if let Some(spec) = join_data_items(&self.eval_data) {
            c.eval_data = Some(spec);
        }
        if let Some(n) = self.eval_every {
            c.eval_every = n;
        }
        if self.metrics_file.is_some() {
            c.metrics_file = self.metrics_file.clone();
        }
    }

    /// The flags of the model's shape and arithmetic, and of its data's tokens.
    fn apply_model_flags(&self, c: &mut TrainConfig) {
        if self.tie_embeddings {
            c.tie_embeddings = true;
        }
        if let Some(v) = self.kv_heads {
            c.kv_heads = v;
        }
        if let Some(v) = self.head_dim {
            c.head_dim = v;
        }
        if let Some(v) = self.ffn {
            c.ffn = v;
        }
        if let Some(v) = self.rope_theta {
            c.rope_theta = v;
        }
        if let Some(v) = self.norm_eps {
            c.norm_eps = v;
        }
        if self.qkv_bias {
            c.qkv_bias = true;
        }
        if let Some(t) = &self.tokenizer {
            c.tokenizer = Some(t.clone());
        }
        if let Some(f) = self.data_format {
            c.data_format = f;
        }
        if let Some(g) = self.gelu {
            c.gelu = g;
        }
        if let Some(p) = self.precision {
            c.precision = p;
        }
    }
}

pub enum CliError {
    /// Bad input: exit code 2.
    Usage(String),
    /// The run itself failed: exit code 1.
    Failed(String),
}

pub fn run(cli: Cli) -> Result<(), CliError> {
    // Checked before any work: a mistyped path must not silently run another one.
    elastic_zero::model::gemm::GemmPath::from_env().map_err(CliError::Usage)?;
    match cli.command {
        Command::Train(mut args) => {
            args.test_hooks = test_hooks::TestHooks::from_env()?;
            train::run(&args)
        }
        Command::Checkpoint(cmd) => checkpoint::run(cmd),
        Command::Generate(args) => generate::run(&args),
        Command::Coordinator(mut args) => {
            args.train.test_hooks = test_hooks::TestHooks::from_env()?;
            procs::run_coordinator_cmd(&args)
        }
        Command::Worker(args) => procs::run_worker_cmd(&args),
        Command::Launch(args) => launch::run(&args),
        Command::Bench(BenchCommand::Checkpoint(args)) => checkpoint::run_bench(&args),
        Command::Bench(BenchCommand::Collectives(args)) => collectives::run(&args),
        Command::Bench(BenchCommand::Gemm(args)) => gemm::run_bench(&args),
        Command::Bench(BenchCommand::Io {
            dir,
            size,
            block,
            queue_depth,
            rounds,
        }) => bench_io(dir, size, block, queue_depth, rounds),
        Command::Bench(BenchCommand::Adam {
            numel,
            threads,
            min_time_s,
        }) => {
            if numel == 0 || threads == 0 {
                return Err(CliError::Usage(
                    "--numel and --threads must be at least 1".into(),
                ));
            }
            let r = elastic_zero::bench::adam::bench_adam(numel, threads, min_time_s);
            println!(
                "{}",
                serde_json::to_string(&r).map_err(|e| CliError::Failed(e.to_string()))?
            );
            Ok(())
        }
    }
}

fn bench_io(
    dir: PathBuf,
    size: u64,
    block: u64,
    queue_depth: u32,
    rounds: u32,
) -> Result<(), CliError> {
    if block < 4096 || !block.is_multiple_of(4096) || block > 64 << 20 {
        return Err(CliError::Usage(format!(
            "--block {block}: use a multiple of 4096 between 4 KiB and 64 MiB"
        )));
    }
    if size < block || queue_depth == 0 || rounds == 0 {
        return Err(CliError::Usage(
            "--size must be at least --block, and --queue-depth and --rounds at least 1".into(),
        ));
    }
    elastic_zero::runtime::storage::check_dir(&dir, size, false)
        .map_err(|e| CliError::Usage(e.to_string()))?;
    let b = elastic_zero::bench::io::IoBench {
        dir,
        bytes: size / block * block,
        block_bytes: block as usize,
        queue_depth,
        rounds,
    };
    let mut all = Vec::new();
    elastic_zero::bench::io::run(&b, |r| {
        if let Ok(line) = serde_json::to_string(&r) {
            println!("{line}");
        }
        all.push(r);
    })
    .map_err(CliError::Failed)?;
    for op in ["write", "read"] {
        let med = |ours: bool| {
            let xs: Vec<f64> = all
                .iter()
                .filter(|r| r.op == op && (r.tool == "ezero") == ours)
                .map(|r| r.gb_per_s)
                .collect();
            elastic_zero::summary::median(xs)
        };
        let tool = all
            .iter()
            .find(|r| r.tool != "ezero")
            .map_or("?", |r| r.tool.as_str());
        println!(
            "{op}: ezero {:.2} GB/s, {tool} {:.2} GB/s, ratio {:.2} (medians of {rounds})",
            med(true),
            med(false),
            med(true) / med(false)
        );
    }
    Ok(())
}

/// Repeated data flags as the one comma-separated list the config holds (`data::sources`).
fn join_data_items(items: &[PathBuf]) -> Option<PathBuf> {
    let texts: Vec<String> = items.iter().map(|p| p.display().to_string()).collect();
    (!texts.is_empty()).then(|| PathBuf::from(texts.join(",")))
}
