//! `cargo bench --bench elastic`: what elasticity costs, measured on in-process clusters.
//!
//! 1. Time from a leave or a kill to the next completed step, next to a full restart from a
//!    checkpoint of the same state (what TorchElastic does: a new process loads the checkpoint
//!    and runs its first step).
//! 2. Bytes moved by a few membership changes, next to the minimum for each change.
//! 3. The cost per step of buddy replication every K = 1 and K = 10 steps, next to none.
//!
//! Times are wall-clock instants at which this process receives the cluster's events. Prints
//! Markdown tables and, with `--json FILE`, writes every raw measurement. `--rounds N` (default
//! 3) repeats each measurement, alternating the order of the variants; tables give the median
//! and the min-max.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Instant;

use elastic_zero::config::{At, ModelKind, TrainConfig};
use elastic_zero::runtime::actors::ClusterEvent;
use elastic_zero::runtime::{ChangeRecord, Cluster, ClusterSpec};
use serde_json::{json, Value};

/// The step at whose start a leave or join takes effect, or during which a kill strikes.
const AT: u64 = 6;

fn base() -> TrainConfig {
    TrainConfig {
        model: ModelKind::Gpt,
        layers: 4,
        d_model: 128,
        heads: 4,
        seq_len: 64,
        micro_batches: 8,
        micro_batch_size: 2,
        ranks: 4,
        stage: 3,
        chunk_elems: 4096,
        sample_tokens: 0,
        steps: AT + 3,
        ..TrainConfig::default()
    }
}

/// The same job as `base()` for the command line.
fn cli_args(cfg: &TrainConfig) -> Vec<String> {
    let mut a: Vec<String> = vec!["train".into()];
    for (k, v) in [
        ("--model", "gpt".to_string()),
        ("--layers", cfg.layers.to_string()),
        ("--d-model", cfg.d_model.to_string()),
        ("--heads", cfg.heads.to_string()),
        ("--seq-len", cfg.seq_len.to_string()),
        ("--micro-batches", cfg.micro_batches.to_string()),
        ("--micro-batch-size", cfg.micro_batch_size.to_string()),
        ("--ranks", cfg.ranks.to_string()),
        ("--stage", cfg.stage.to_string()),
        ("--chunk-elems", cfg.chunk_elems.to_string()),
        ("--sample-tokens", "0".to_string()),
    ] {
        a.push(k.into());
        a.push(v);
    }
    a
}

/// One run: the instant each step's record arrived, and every change with its cost.
struct Trace {
    steps: Vec<(u64, f64)>,
    changes: Vec<(f64, ChangeRecord)>,
}

async fn trace(cfg: TrainConfig) -> Trace {
    let spec = ClusterSpec::from_config(cfg).expect("valid config");
    let mut job = Cluster::builder(spec).start().await.expect("starts");
    let mut changes_rx = job.handle().subscribe();
    let t0 = Instant::now();
    let (mut steps, mut changes) = (Vec::new(), Vec::new());
    while let Some(ev) = job.next_event().await {
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        match ev {
            ClusterEvent::Step(r) => steps.push((r.step, ms)),
            ClusterEvent::Membership(_) => {
                changes.push((ms, changes_rx.recv().await.expect("published")))
            }
            ClusterEvent::Finished => break,
            ClusterEvent::Aborted(why) => panic!("run stopped: {why}"),
            ClusterEvent::JoinFailed { rank, reason } => panic!("rank {rank}: {reason}"),
            _ => {}
        }
    }
    job.finish().await.expect("finishes");
    Trace { steps, changes }
}

fn at(value: u32, step: u64) -> At {
    At { value, step }
}

/// Milliseconds from the end of step AT-1 to the first completion of step AT, and the median
/// gap between completions before the change (a normal step, replication included).
fn gap_to_next_step(t: &Trace) -> (f64, f64) {
    let end_of = |s: u64| t.steps.iter().rev().find(|(x, _)| *x == s).map(|p| p.1);
    let before = end_of(AT - 1).expect("step AT-1 ran");
    let after = end_of(AT).expect("step AT ran");
    let normal: Vec<f64> = (2..AT)
        .filter_map(|s| Some(end_of(s)? - end_of(s - 1)?))
        .collect();
    (after - before, median(&normal))
}

/// A new process resumes the checkpoint saved after step AT on `ranks` ranks: milliseconds from
/// spawn to the progress line of its first step, and to its exit (after the remaining steps).
fn restart(cfg: &TrainConfig, ckpt: &std::path::Path, ranks: u32) -> (f64, f64) {
    let mut args = cli_args(&TrainConfig {
        ranks,
        ..cfg.clone()
    });
    args.extend([
        "--resume".to_string(),
        ckpt.join(format!("step-{AT:08}")).display().to_string(),
    ]);
    let t0 = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ezero"))
        .args(&args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("ezero starts");
    let out = BufReader::new(child.stdout.take().expect("piped"));
    let mark = format!("{}/{}", AT + 1, cfg.steps);
    let mut first = None;
    for line in out.lines() {
        let line = line.expect("utf-8");
        if first.is_none() && line.trim_start().starts_with("step") && line.contains(&mark) {
            first = Some(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    assert!(child.wait().expect("exits").success(), "the restart failed");
    (
        first.expect("the restart ran its step"),
        t0.elapsed().as_secs_f64() * 1e3,
    )
}

/// Saves the state after step AT (and after the last step) with the command line, as a restart
/// would find it. The schedule depends on `steps`, so this run has the same `steps`.
fn save_checkpoint(cfg: &TrainConfig, dir: &std::path::Path) {
    let mut args = cli_args(cfg);
    args.extend(
        [
            "--steps",
            &cfg.steps.to_string(),
            "--save-dir",
            &dir.display().to_string(),
            "--save-every",
            &AT.to_string(),
        ]
        .map(String::from),
    );
    let ok = Command::new(env!("CARGO_BIN_EXE_ezero"))
        .args(&args)
        .stdout(Stdio::null())
        .status()
        .expect("ezero runs")
        .success();
    assert!(ok, "saving the checkpoint failed");
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn cell(xs: &[f64]) -> String {
    let lo = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{:.0} ({:.0}–{:.0})", median(xs), lo, hi)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let rounds: usize = flag("--rounds").map_or(3, |r| r.parse().expect("--rounds N"));
    let json_out = flag("--json");
    let cfg = base();
    let mut raw = Vec::new();
    time_to_next_step(&cfg, rounds, &mut raw).await;
    bytes_moved(&cfg, &mut raw).await;
    replication_cost(&cfg, rounds, &mut raw).await;
    if let Some(path) = json_out {
        let text = serde_json::to_string_pretty(&raw).expect("serialisable");
        std::fs::write(&path, text).expect("write --json");
        println!("\nraw measurements: {path}");
    }
}

/// Leave, kill or join to the next completed step, against a restart from a checkpoint.
async fn time_to_next_step(cfg: &TrainConfig, rounds: usize, raw: &mut Vec<Value>) {
    let ckpt = tempfile::tempdir().expect("temp dir");
    save_checkpoint(cfg, ckpt.path());
    let scenarios: [(&str, TrainConfig); 3] = [
        (
            "leave 1 of 4",
            TrainConfig {
                leave: vec![at(1, AT)],
                ..cfg.clone()
            },
        ),
        (
            "kill 1 of 4",
            TrainConfig {
                kill: vec![at(1, AT)],
                ..cfg.clone()
            },
        ),
        (
            "join 1 to 4",
            TrainConfig {
                join: vec![at(1, AT)],
                ..cfg.clone()
            },
        ),
    ];
    let mut rows = Vec::new();
    for (name, scenario) in &scenarios {
        let (mut gaps, mut normals, mut changes, mut restarts, mut restart_exits) =
            (vec![], vec![], vec![], vec![], vec![]);
        for round in 0..rounds {
            let ranks_after = if name.starts_with("join") { 5 } else { 3 };
            // Alternate which goes first. The restart blocks this thread, not the workers.
            let (t, (first, exit)) = if round % 2 == 0 {
                let t = trace(scenario.clone()).await;
                (t, restart(cfg, ckpt.path(), ranks_after))
            } else {
                let r = restart(cfg, ckpt.path(), ranks_after);
                (trace(scenario.clone()).await, r)
            };
            let (gap, normal) = gap_to_next_step(&t);
            let change = t.changes.first().expect("one change").1.clone();
            raw.push(json!({"bench": "to_next_step", "scenario": name, "round": round,
                "gap_ms": gap, "normal_step_ms": normal, "change_ms": change.record.duration_ms,
                "moved_bytes": change.moved_bytes, "restart_first_step_ms": first, "restart_exit_ms": exit}));
            gaps.push(gap);
            normals.push(normal);
            changes.push(change.record.duration_ms as f64);
            restarts.push(first);
            restart_exits.push(exit);
        }
        rows.push(format!(
            "| {name} | {} | {} | {} | {} | {} | {:.1}× |",
            cell(&gaps),
            cell(&normals),
            cell(&changes),
            cell(&restarts),
            cell(&restart_exits),
            median(&restarts) / median(&gaps)
        ));
    }
    println!("\n### Time to the next completed step (ms; median (min–max) of {rounds} rounds)\n");
    println!("| change at step {AT} | in place: end of step {} → end of step {AT} | normal step gap | change itself (reshard / recovery) | restart: spawn → first step done | restart: spawn → exit ({} more steps) | restart / in place |", AT - 1, cfg.steps - AT);
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!("{r}");
    }
}

/// Chunk elements and bytes a membership change moves, against the least it could.
async fn bytes_moved(cfg: &TrainConfig, raw: &mut Vec<Value>) {
    println!("\n### Bytes moved by a membership change\n");
    println!("| change | chunk elements moved | minimum | moved / minimum | payload bytes moved | state bytes total |");
    println!("|---|---:|---:|---:|---:|---:|");
    let total_state: u64 = {
        let model = elastic_zero::job::build_model(cfg).expect("model");
        12 * elastic_zero::model::param_count(&model.units()) as u64
    };
    for (name, c) in [
        (
            "4 → 3 (leave)",
            TrainConfig {
                leave: vec![at(1, 2)],
                ..cfg.clone()
            },
        ),
        (
            "4 → 3 (kill, recovery)",
            TrainConfig {
                kill: vec![at(1, 2)],
                ..cfg.clone()
            },
        ),
        (
            "4 → 5 (join)",
            TrainConfig {
                join: vec![at(1, 2)],
                ..cfg.clone()
            },
        ),
        (
            "8 → 6 (2 leave)",
            TrainConfig {
                ranks: 8,
                leave: vec![at(2, 2), at(5, 2)],
                ..cfg.clone()
            },
        ),
        (
            "4 → 8 (4 join)",
            TrainConfig {
                join: vec![at(4, 2)],
                ..cfg.clone()
            },
        ),
    ] {
        let t = trace(TrainConfig { steps: 3, ..c }).await;
        let ch = &t.changes.first().expect("one change").1;
        let r = &ch.record;
        raw.push(json!({"bench": "bytes_moved", "change": name, "moved_elems": r.moved_chunk_elems,
            "min_elems": r.min_chunk_elems, "moved_bytes": ch.moved_bytes, "total_state_bytes": total_state}));
        println!(
            "| {name} | {} | {} | {:.3} | {} | {} |",
            r.moved_chunk_elems,
            r.min_chunk_elems,
            r.moved_chunk_elems as f64 / r.min_chunk_elems.max(1) as f64,
            ch.moved_bytes.map_or("?".into(), |b| b.to_string()),
            total_state
        );
    }
}

/// The mean step with buddy replication off, every step, and every tenth step.
async fn replication_cost(cfg: &TrainConfig, rounds: usize, raw: &mut Vec<Value>) {
    let steps = 21;
    let ks = [0u64, 1, 10];
    let mut per_k: Vec<Vec<f64>> = vec![Vec::new(); ks.len()];
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..ks.len()).collect();
        order.rotate_left(round % ks.len());
        for i in order {
            let t = trace(TrainConfig {
                steps,
                replicate_every: ks[i],
                ..cfg.clone()
            })
            .await;
            // Mean gap between completions of steps 1..steps (the first step's start is not
            // observed); replication runs inside these gaps.
            let first = t.steps.first().expect("steps ran").1;
            let last = t.steps.last().expect("steps ran").1;
            let mean = (last - first) / (t.steps.len() - 1) as f64;
            raw.push(
                json!({"bench": "replication", "k": ks[i], "round": round, "mean_step_ms": mean}),
            );
            per_k[i].push(mean);
        }
    }
    println!("\n### Buddy replication cost (mean ms per step over steps 1–{}; median (min–max) of {rounds} rounds)\n", steps - 1);
    println!("| replicate_every | mean step | vs none |");
    println!("|---:|---:|---:|");
    let none = median(&per_k[0]);
    for (i, k) in ks.iter().enumerate() {
        let m = median(&per_k[i]);
        println!(
            "| {} | {} | {:+.1}% |",
            if *k == 0 {
                "0 (off)".to_string()
            } else {
                k.to_string()
            },
            cell(&per_k[i]),
            (m / none - 1.0) * 100.0
        );
    }
}
