//! `ezero bench gemm`: the model's matrix products per kernel path, beside torch.

use clap::Args;
use elastic_zero::bench::gemm::{
    model_shapes, peak_gflops, run, GemmBench, GemmResult, Kernel, Shape,
};
use elastic_zero::config::TrainConfig;
use elastic_zero::model::gemm::{Bf16Path, GemmPath};
use elastic_zero::model::Model;
use elastic_zero::summary::{median, TrainSummary};

use super::CliError;

/// `ezero bench gemm` flags. The default shape is `benches/compare_train.py`'s GPT.
#[derive(Args)]
pub struct BenchGemmArgs {
    #[arg(long, default_value_t = 256)]
    pub d_model: usize,
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    #[arg(long, default_value_t = 128)]
    pub seq_len: usize,
    /// Sequences per micro-batch (rows of the linear products: this times --seq-len).
    #[arg(long, default_value_t = 8)]
    pub micro_batch_size: usize,
    #[arg(long, default_value_t = 256)]
    pub vocab: usize,
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Seconds of timed work per measurement.
    #[arg(long, default_value_t = 0.5)]
    pub min_time_s: f64,
    /// A Python with torch (e.g. the peers' venv): adds torch's single-thread GEMM on the same
    /// shapes, in the same run.
    #[arg(long, env = "EZERO_TORCH_PYTHON")]
    pub torch_python: Option<String>,
    /// Only these shapes (comma-separated names, e.g. `qkv.fwd,fc1.dx`); default all.
    #[arg(long, value_delimiter = ',')]
    pub shapes: Vec<String>,
    /// Our kernel paths to time (comma-separated: avx512, avx2, portable); default every
    /// vector path this CPU has (the portable one, ~1 GFLOP/s without hardware FMA, only when
    /// there is none).
    #[arg(long, value_delimiter = ',')]
    pub paths: Vec<String>,
    /// Skip the `matrixmultiply` column.
    #[arg(long)]
    pub no_matrixmultiply: bool,
    /// `fp32`, or `bf16`: our bf16 GEMM (bf16 operands, f32 accumulation; `vdpbf16ps` where the
    /// CPU has AVX512_BF16, else the exact but slow portable emulation) beside torch's bf16
    /// matmul, and no `matrixmultiply`.
    #[arg(long, default_value = "fp32", value_parser = ["fp32", "bf16"])]
    pub precision: String,
}

pub fn run_bench(args: &BenchGemmArgs) -> Result<(), CliError> {
    check_sizes(args)?;
    let shapes = selected_shapes(args)?;
    let paths = selected_paths(args)?;
    let bf16 = args.precision == "bf16";
    let ours = compared_kernel(args, &paths, bf16);
    let mut kernels: Vec<Kernel> = if bf16 {
        vec![ours]
    } else {
        paths.iter().copied().map(Kernel::F32).collect()
    };
    if !bf16 && !args.no_matrixmultiply {
        kernels.push(Kernel::MatrixMultiply);
    }
    let b = GemmBench {
        shapes: shapes.clone(),
        rounds: args.rounds,
        min_time_s: args.min_time_s,
        torch_python: args.torch_python.clone(),
        kernels,
        torch_bf16: bf16,
    };
    let mut all: Vec<GemmResult> = Vec::new();
    run(&b, |r| {
        if let Ok(line) = serde_json::to_string(&r) {
            println!("{line}");
        }
        all.push(r);
    })
    .map_err(CliError::Failed)?;
    print_table(args.rounds, &shapes, &all, &ours.name(), bf16);
    Ok(())
}

fn check_sizes(args: &BenchGemmArgs) -> Result<(), CliError> {
    let sizes = [
        args.d_model,
        args.heads,
        args.seq_len,
        args.micro_batch_size,
        args.vocab,
    ];
    if sizes.contains(&0) || args.rounds == 0 || !args.d_model.is_multiple_of(args.heads) {
        return Err(CliError::Usage(
            "--d-model, --heads, --seq-len, --micro-batch-size, --vocab and --rounds must be at \
             least 1, and --heads must divide --d-model"
                .into(),
        ));
    }
    if !(args.min_time_s > 0.0 && args.min_time_s <= 60.0) {
        return Err(CliError::Usage("--min-time-s must be in (0, 60]".into()));
    }
    Ok(())
}

/// The model's products, narrowed to `--shapes` when given.
fn selected_shapes(args: &BenchGemmArgs) -> Result<Vec<Shape>, CliError> {
    let tokens = args.micro_batch_size * args.seq_len;
    let mut shapes = model_shapes(args.d_model, args.heads, args.seq_len, tokens, args.vocab);
    if !args.shapes.is_empty() {
        if let Some(bad) = args
            .shapes
            .iter()
            .find(|n| !shapes.iter().any(|s| &s.name == *n))
        {
            let names: Vec<_> = shapes.iter().map(|s| s.name.as_str()).collect();
            return Err(CliError::Usage(format!(
                "--shapes: no shape {bad:?}; the shapes are {}",
                names.join(",")
            )));
        }
        shapes.retain(|s| args.shapes.contains(&s.name));
    }
    Ok(shapes)
}

/// `--paths`, or every vector path this CPU has (the portable one only when there is none).
fn selected_paths(args: &BenchGemmArgs) -> Result<Vec<GemmPath>, CliError> {
    if args.paths.is_empty() {
        let mut v: Vec<GemmPath> = GemmPath::available().into_iter().rev().collect();
        if v.len() > 1 {
            v.retain(|p| *p != GemmPath::Portable);
        }
        return Ok(v);
    }
    let parsed: Result<Vec<GemmPath>, String> =
        args.paths.iter().map(|p| GemmPath::parse(p)).collect();
    parsed.map_err(|e| CliError::Usage(format!("--paths: {}", e.replace("EZERO_GEMM=", ""))))
}

/// The kernel the ratio column compares: the path training uses, or the first one timed when
/// --paths leaves it out.
fn compared_kernel(args: &BenchGemmArgs, paths: &[GemmPath], bf16: bool) -> Kernel {
    if bf16 {
        // The bf16 paths follow the f32 one forced: `portable` runs the portable emulation.
        let forced_portable = paths.contains(&GemmPath::Portable) && !args.paths.is_empty();
        let path = if forced_portable {
            Bf16Path::Portable
        } else {
            Bf16Path::current()
        };
        Kernel::Bf16(path)
    } else {
        let path = paths
            .iter()
            .copied()
            .find(|p| *p == GemmPath::current())
            .or(paths.first().copied())
            .unwrap_or_else(GemmPath::current);
        Kernel::F32(path)
    }
}

/// The medians per shape and kernel, the ours/torch ratio, and the time-weighted total.
fn print_table(rounds: u32, shapes: &[Shape], all: &[GemmResult], ours_name: &str, bf16: bool) {
    let mut kernels: Vec<String> = Vec::new();
    for r in all {
        if !kernels.contains(&r.kernel) {
            kernels.push(r.kernel.clone());
        }
    }
    let med = |shape: &str, kernel: &str| {
        let xs = all
            .iter()
            .filter(|r| r.shape == shape && r.kernel == kernel)
            .map(|r| r.gflops)
            .collect();
        median(xs)
    };
    let torch_name = if bf16 { "torch-bf16" } else { "torch" };
    println!(
        "\nGFLOP/s, median of {} rounds, one thread (ezero's path in use: {}; ours/torch: {})",
        rounds,
        GemmPath::current().name(),
        ours_name
    );
    let mut head = format!(
        "{:<10} {:>5} {:>5} {:>5} {:>4}",
        "shape", "m", "k", "n", "form"
    );
    for k in &kernels {
        head += &format!(" {k:>15}");
    }
    let torch = kernels.iter().any(|k| k == torch_name);
    if torch {
        head += &format!(" {:>12}", "ours/torch");
    }
    println!("{head}");
    let (mut flops, mut ours_s, mut torch_s) = (0.0, 0.0, 0.0);
    for s in shapes {
        let form = serde_json::to_string(&s.form)
            .unwrap_or_default()
            .replace('"', "");
        let mut line = format!(
            "{:<10} {:>5} {:>5} {:>5} {:>4}",
            s.name, s.m, s.k, s.n, form
        );
        for k in &kernels {
            line += &format!(" {:>15.1}", med(&s.name, k));
        }
        let (o, t) = (med(&s.name, ours_name), med(&s.name, torch_name));
        if torch {
            line += &format!(" {:>12.2}", o / t);
        }
        println!("{line}");
        flops += s.flops();
        ours_s += s.flops() / (o * 1e9);
        torch_s += s.flops() / (t * 1e9);
    }
    // Time-weighted over the shapes: what a step made of exactly these products would see.
    let mut total = format!(
        "all shapes (time-weighted): ours {:.1} GFLOP/s",
        flops / ours_s / 1e9
    );
    if torch {
        total += &format!(
            ", torch {:.1} GFLOP/s, ours/torch {:.2}",
            flops / torch_s / 1e9,
            torch_s / ours_s
        );
    }
    println!("{total}");
}

/// Seconds of GEMM timed for the MFU's peak, after training (so training is not disturbed).
const PEAK_TIME_S: f64 = 0.5;

/// Fills the summary's model FLOPs and MFU (measuring the GEMM peak now), and returns the line
/// to print; `None` when the model does not count its FLOPs or no step was timed.
pub(super) fn add_mfu(
    s: &mut TrainSummary,
    model: &dyn Model,
    cfg: &TrainConfig,
) -> Option<String> {
    let tokens = cfg.tokens_per_step() as u64;
    let forward = model.forward_flops(tokens, cfg.seq_len as u64)?;
    if s.step_time_median_s <= 0.0 {
        return None;
    }
    let mb_tokens = cfg.micro_batch_size * cfg.seq_len;
    s.model_flops_per_step = 3 * forward;
    s.model_gflops_per_s = s.model_flops_per_step as f64 / s.step_time_median_s / 1e9;
    s.gemm_peak_gflops = peak_gflops(cfg.d_model, mb_tokens, PEAK_TIME_S);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (cfg.ranks as usize).min(cpus);
    s.mfu = s.model_gflops_per_s / (s.gemm_peak_gflops * threads as f64);
    Some(format!(
        "model FLOPs: {:.2} GFLOP a step, {:.1} GFLOP/s; MFU {:.2} against {} thread(s) x {:.1} GFLOP/s \
         (GEMM peak on this CPU's {} path, measured now)",
        s.model_flops_per_step as f64 / 1e9,
        s.model_gflops_per_s,
        s.mfu,
        threads,
        s.gemm_peak_gflops,
        GemmPath::current().name()
    ))
}
