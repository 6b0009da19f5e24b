//! `ezero checkpoint verify|inspect|export`, `ezero bench checkpoint`, and the checkpoint side of
//! `ezero train` and `ezero coordinator`: `--resume`/`--latest-valid`/`--init` before the run,
//! background saves and SIGTERM/SIGINT handling during it.
//!
//! A damaged, incomplete or incompatible checkpoint is bad input: one line naming the file and
//! what is wrong, exit code 2, and no training from partial state. A save that fails during a
//! run is a run failure (exit code 1 at the end; the run itself continues).
//!
//! Usage: README.md (Checkpoints).

mod saving;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::{Args, Subcommand};

use elastic_zero::checkpoint::bench::{bench_slowdown, bench_throughput};
use elastic_zero::checkpoint::compat::check_resume;
use elastic_zero::checkpoint::hf;
use elastic_zero::checkpoint::interchange::{consolidated_params, export, ExportOptions};
use elastic_zero::checkpoint::meta::data_sha256;
use elastic_zero::checkpoint::{
    load_latest_valid, load_path, read_manifest, store, verify, CheckpointError, CheckpointSource,
};
use elastic_zero::config::{ModelKind, TrainConfig};
use elastic_zero::job::optim_settings;
use elastic_zero::model::weights::WeightSource;
use elastic_zero::model::Model;
use elastic_zero::plan::RankId;
use elastic_zero::runtime::procs::state::StartState;

use super::{CliError, TrainArgs};

pub use saving::{stop_signal, SaveObserver, SavePlan, Saving, Stopped};

#[derive(Subcommand)]
pub enum CheckpointCommand {
    /// Check every checksum and that every element is covered exactly once (exit 2 if not).
    Verify {
        /// A checkpoint directory, or a save directory (its newest complete checkpoint).
        dir: PathBuf,
        /// Print the result as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Show step, world size, stage, sizes and per-rank bytes (reads only the manifest).
    Inspect {
        /// A checkpoint directory, or a save directory (its newest complete checkpoint).
        dir: PathBuf,
        /// Print the manifest summary as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Write consolidated weights as safetensors (names = the model's parameter names), or with
    /// --format hf as a Hugging Face directory transformers loads (GPT-2, Llama or Qwen2).
    Export {
        /// A checkpoint directory, or a save directory (its newest complete checkpoint).
        dir: PathBuf,
        /// Output file, e.g. model.safetensors; with --format hf, a directory.
        #[arg(long)]
        out: PathBuf,
        /// `safetensors` (one file, our names) or `hf` (config.json, sharded safetensors with
        /// transformers' names and index, and the tokenizer files of the run's --init hf:DIR).
        #[arg(long, default_value = "safetensors", value_name = "safetensors|hf")]
        format: String,
        /// --format hf: the largest weight shard, in bytes [default: 2 GiB].
        #[arg(long, default_value_t = 2 << 30)]
        max_shard_bytes: u64,
        /// Round weights to bf16 instead of fp32.
        #[arg(long)]
        bf16: bool,
        /// Also write the Adam/SGD state (fp32) to <out stem>.optimizer.safetensors.
        #[arg(long)]
        with_optimizer: bool,
    },
}

/// `ezero bench checkpoint` flags.
#[derive(Args)]
pub struct BenchCheckpointArgs {
    /// Directory on the disk to measure (files are created and removed in it).
    #[arg(long)]
    pub dir: PathBuf,
    /// Parameters of the synthetic AdamW checkpoint (12 bytes each on disk).
    #[arg(long, default_value_t = 64 << 20)]
    pub params: usize,
    /// Ranks (chunk files written and read in parallel).
    #[arg(long, default_value_t = 4)]
    pub ranks: u32,
    /// Measurements of each kind.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Also time a load after dropping the page cache (needs root; affects the whole machine).
    #[arg(long)]
    pub cold: bool,
    /// Steps of the training-slowdown run (0 skips it).
    #[arg(long, default_value_t = 40)]
    pub train_steps: u64,
    /// Background save interval of the slowdown run.
    #[arg(long, default_value_t = 5)]
    pub save_every: u64,
    /// Interleaved rounds of the three slowdown runs.
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// GPT width and depth of the slowdown run.
    #[arg(long, default_value_t = 256)]
    pub d_model: usize,
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
}

fn usage(e: CheckpointError) -> CliError {
    CliError::Usage(e.to_string())
}

pub fn run(cmd: CheckpointCommand) -> Result<(), CliError> {
    match cmd {
        CheckpointCommand::Verify { dir, json } => {
            let r = verify(&dir).map_err(usage)?;
            if json {
                println!("{}", to_json(&r)?);
            } else {
                println!(
                    "ok: {}: step {}, {} chunk files, {} chunks, {} bytes; every checksum matches and \
                     each of the {} parameters is covered exactly once; param-sha256 {}",
                    r.dir.display(),
                    r.step,
                    r.files,
                    r.chunks,
                    r.bytes,
                    r.param_count,
                    r.param_sha256
                );
            }
            Ok(())
        }
        CheckpointCommand::Inspect { dir, json } => inspect(&dir, json),
        CheckpointCommand::Export {
            dir,
            out,
            format,
            max_shard_bytes,
            bf16,
            with_optimizer,
        } if format == "hf" => export_hf(&dir, &out, bf16, with_optimizer, max_shard_bytes),
        CheckpointCommand::Export { format, .. } if format != "safetensors" => Err(
            CliError::Usage(format!("--format {format}: use safetensors or hf")),
        ),
        CheckpointCommand::Export {
            dir,
            out,
            bf16,
            with_optimizer,
            ..
        } => {
            super::outputs::check_file("--out", &out)?;
            let loaded = load_path(&dir).map_err(usage)?;
            let r = export(
                &loaded,
                &out,
                ExportOptions {
                    bf16,
                    with_optimizer,
                },
            )
            .map_err(usage)?;
            println!(
                "exported {} step {}: {} tensors ({}) to {} ({} bytes){}",
                loaded.dir.display(),
                loaded.manifest.step,
                r.weight_tensors,
                if bf16 { "bf16" } else { "fp32" },
                r.weights.display(),
                r.weight_bytes,
                r.optimizer
                    .as_ref()
                    .map(|p| format!(
                        "; optimizer state: {} tensors to {}",
                        r.optimizer_tensors,
                        p.display()
                    ))
                    .unwrap_or_default()
            );
            Ok(())
        }
    }
}

/// `checkpoint export --format hf`.
fn export_hf(
    dir: &Path,
    out: &Path,
    bf16: bool,
    with_optimizer: bool,
    max_shard_bytes: u64,
) -> Result<(), CliError> {
    if with_optimizer {
        return Err(CliError::Usage(
            "--with-optimizer: a Hugging Face directory holds weights only; export the optimizer \
             state with --format safetensors"
                .into(),
        ));
    }
    super::outputs::check_dir("--out", out)?;
    let loaded = load_path(dir).map_err(usage)?;
    let cfg = &loaded.manifest.config;
    if cfg.model == ModelKind::Mlp {
        return Err(CliError::Usage(format!(
            "{}: an MLP has no Hugging Face form; GPT and Llama checkpoints export",
            loaded.dir.display(),
        )));
    }
    let params = consolidated_params(&loaded);
    let r = hf::export(
        cfg,
        &loaded.manifest.units,
        &params,
        out,
        bf16,
        max_shard_bytes,
    )
    .map_err(usage)?;
    println!(
        "exported {} step {} as {}: {} tensors ({}, {} bytes) and {} files to {}",
        loaded.dir.display(),
        loaded.manifest.step,
        r.family,
        r.tensors,
        if bf16 { "bf16" } else { "fp32" },
        r.weight_bytes,
        r.files.len(),
        out.display()
    );
    Ok(())
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<String, CliError> {
    serde_json::to_string(v).map_err(|e| CliError::Failed(e.to_string()))
}

/// What `inspect` shows, also as JSON.
#[derive(serde::Serialize)]
struct Inspection {
    dir: PathBuf,
    step: u64,
    opt_step: u64,
    epoch: u64,
    world_size: u32,
    stage: u8,
    chunk_elems: usize,
    model: String,
    units: usize,
    param_count: u64,
    optimizer: String,
    bytes: u64,
    ranks: Vec<RankBytes>,
    param_sha256: String,
    created_unix_ms: u64,
}

#[derive(serde::Serialize)]
struct RankBytes {
    rank: u32,
    file: String,
    chunks: usize,
    elems: u64,
    bytes: u64,
}

fn inspect(path: &Path, json: bool) -> Result<(), CliError> {
    let dir = store::resolve(path).map_err(usage)?;
    let m = read_manifest(&dir).map_err(usage)?;
    let c = &m.config;
    let ins = Inspection {
        dir: dir.clone(),
        step: m.step,
        opt_step: m.progress.opt_step,
        epoch: m.epoch,
        world_size: m.world_size,
        stage: m.stage,
        chunk_elems: m.shard_map.chunk_elems,
        model: match c.model {
            ModelKind::Gpt => format!(
                "gpt (layers {}, d_model {}, heads {}, seq_len {})",
                c.layers, c.d_model, c.heads, c.seq_len
            ),
            ModelKind::Llama => format!(
                "llama (layers {}, d_model {}, heads {}/{} kv, head_dim {}, ffn {}, positions {})",
                c.layers,
                c.d_model,
                c.heads,
                c.kv_heads(),
                c.head_dim(),
                c.ffn(),
                c.positions()
            ),
            ModelKind::Mlp => format!("mlp (layers {}, d_model {})", c.layers, c.d_model),
        },
        units: m.units.len(),
        param_count: m.param_count,
        optimizer: format!(
            "{} lr {:?} betas {:?}/{:?} eps {:?} weight_decay {:?}; state {}",
            serde_json::to_value(m.optimizer.kind)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default(),
            m.optimizer.lr,
            m.optimizer.beta1,
            m.optimizer.beta2,
            m.optimizer.eps,
            m.optimizer.weight_decay,
            if m.optimizer.state.is_empty() {
                "none".to_string()
            } else {
                m.optimizer.state.join(", ")
            }
        ),
        bytes: m.total_bytes(),
        ranks: m
            .files
            .iter()
            .map(|f| RankBytes {
                rank: f.rank,
                file: f.name.clone(),
                chunks: f.chunks.len(),
                elems: f.chunks.iter().map(|c| c.params).sum(),
                bytes: f.bytes,
            })
            .collect(),
        param_sha256: m.param_sha256.clone(),
        created_unix_ms: m.created_unix_ms,
    };
    if json {
        println!("{}", to_json(&ins)?);
        return Ok(());
    }
    println!("checkpoint {}", dir.display());
    println!(
        "  step {} (optimizer updates {}), shard-map epoch {}",
        ins.step, ins.opt_step, ins.epoch
    );
    println!(
        "  saved by {} ranks, ZeRO-{}, chunk_elems {}",
        ins.world_size, ins.stage, ins.chunk_elems
    );
    println!(
        "  model {}: {} parameters in {} units",
        ins.model, ins.param_count, ins.units
    );
    println!("  optimizer {}", ins.optimizer);
    println!(
        "  data {} (seed {}, next step {})",
        m.data.source, m.data.seed, m.data.next_step
    );
    println!("  {} bytes in {} chunk files:", ins.bytes, ins.ranks.len());
    for r in &ins.ranks {
        println!(
            "    rank {}: {} ({} chunks, {} parameters, {} bytes)",
            r.rank, r.file, r.chunks, r.elems, r.bytes
        );
    }
    println!("  param-sha256 {}", ins.param_sha256);
    Ok(())
}

pub fn run_bench(a: &BenchCheckpointArgs) -> Result<(), CliError> {
    if a.params == 0 || a.ranks == 0 {
        return Err(CliError::Usage(
            "--params and --ranks must be at least 1".into(),
        ));
    }
    let t =
        bench_throughput(&a.dir, a.params, a.ranks, a.repeats, a.cold).map_err(CliError::Failed)?;
    println!("{}", to_json(&t)?);
    if a.train_steps > 0 {
        let cfg = TrainConfig {
            d_model: a.d_model,
            layers: a.layers,
            steps: a.train_steps,
            sample_tokens: 0,
            save_dir: Some(a.dir.clone()),
            ..TrainConfig::default()
        };
        cfg.validate().map_err(|e| CliError::Usage(e.to_string()))?;
        let s = bench_slowdown(&cfg, a.save_every, a.rounds, &a.dir).map_err(CliError::Failed)?;
        println!("{}", to_json(&s)?);
    }
    Ok(())
}

/// The line a resumed run prints before its first step.
pub fn print_resumed(source: &CheckpointSource) {
    println!(
        "resumed from {} at step {} (saved by {} ranks with ZeRO-{})",
        source.dir.display(),
        source.manifest.step,
        source.manifest.world_size,
        source.manifest.stage
    );
}

/// What each rank read on a resume, as `rank R N B, ...`; `None` for a run that did not resume.
pub fn resume_reads(reads: &[(RankId, u64)]) -> Option<String> {
    let list: Vec<String> = reads
        .iter()
        .map(|(rank, bytes)| format!("rank {rank} {bytes} B"))
        .collect();
    (!list.is_empty()).then(|| list.join(", "))
}

/// The run's config and, with `--resume`, the verified checkpoint it continues from. A resumed
/// run's config is the checkpoint's, with `--config` and flags applied on top.
pub fn resolve_train(
    args: &TrainArgs,
) -> Result<(TrainConfig, Option<CheckpointSource>), CliError> {
    if args.latest_valid && args.resume.is_none() {
        return Err(CliError::Usage("--latest-valid needs --resume DIR".into()));
    }
    let Some(dir) = &args.resume else {
        let mut cfg = args.resolve().map_err(|e| CliError::Usage(e.to_string()))?;
        super::init::apply_pretrained_shape(args, &mut cfg)?;
        return Ok((cfg, None));
    };
    if args.init.is_some() {
        return Err(CliError::Usage(
            "--init and --resume exclude each other: --resume restores weights and optimizer state"
                .into(),
        ));
    }
    // Without --latest-valid only the manifest and file lengths are checked here; each rank
    // then reads and checks the records it owns before any step runs. Falling back needs to
    // know which checkpoint is whole, so --latest-valid verifies candidates in full first.
    let loaded = if args.latest_valid {
        let (l, skipped) = load_latest_valid(dir).map_err(usage)?;
        for e in skipped {
            eprintln!("note: --latest-valid skipped {e}");
        }
        CheckpointSource::open(&l.dir).map_err(usage)?
    } else {
        CheckpointSource::open_path(dir).map_err(usage)?
    };
    // Scripted membership changes before the checkpoint's step already happened: not replayed.
    let mut base = loaded.manifest.config.clone();
    let step = loaded.manifest.step;
    for list in [&mut base.leave, &mut base.join, &mut base.kill] {
        list.retain(|a| a.step >= step);
    }
    base.faults.kill_during.retain(|k| k.step >= step);
    // Where state lives belongs to the machine that resumes, not to the one that saved.
    base.clear_placement();
    let cfg = args
        .resolve_over(Some(&base))
        .map_err(|e| CliError::Usage(e.to_string()))?;
    Ok((cfg, Some(loaded)))
}

/// Refuses a checkpoint that cannot continue this run bit for bit.
pub fn check_compatible(
    loaded: &CheckpointSource,
    cfg: &TrainConfig,
    model: &dyn Model,
    reschedule: bool,
) -> Result<(), CliError> {
    let sha = data_sha256(cfg).map_err(usage)?;
    check_resume(
        &loaded.dir,
        &loaded.manifest,
        cfg,
        &model.units(),
        sha.as_deref(),
        reschedule,
    )
    .map_err(usage)
}

/// `--init`'s weights (see [`super::init`]), checked against the model but not yet read;
/// `None` without `--init`.
pub fn init_weights(
    args: &TrainArgs,
    model: &dyn Model,
) -> Result<Option<Arc<dyn WeightSource>>, CliError> {
    let Some(init) = args.init.as_deref() else {
        return Ok(None);
    };
    super::init::weights(&super::init::InitSource::of(init), &model.units()).map(Some)
}

/// The state a job with worker processes starts from: `--resume` (each rank's owned chunks,
/// read now by one thread per rank, so damaged state is refused before any process starts) or
/// `--init` (the file's weights, read for each worker as its start is sent); `None` for the
/// model's initialisation.
pub fn start_state(
    cfg: &TrainConfig,
    model: &dyn Model,
    resume: Option<&CheckpointSource>,
    init: Option<Arc<dyn WeightSource>>,
) -> Result<Option<StartState>, CliError> {
    let numels: Vec<usize> = model.units().iter().map(|u| u.numel()).collect();
    if let Some(src) = resume {
        return StartState::resume(src, &numels, cfg.ranks, cfg.chunk_elems)
            .map(Some)
            .map_err(|why| CliError::Usage(format!("--resume: {why}")));
    }
    init.map(|weights| {
        StartState::from_weights(
            weights,
            &numels,
            cfg.ranks,
            cfg.chunk_elems,
            optim_settings(cfg).kind,
        )
        .map_err(|why| CliError::Usage(format!("--init: {why}")))
    })
    .transpose()
}
