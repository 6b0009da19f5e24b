//! `ezero bench checkpoint`: how fast checkpoints save and load against what the disk can do,
//! and how much a background save slows training.
//!
//! The disk reference is `dd` with direct I/O (`oflag=direct` / `iflag=direct`, bypassing the
//! page cache) over the same number of bytes in the same directory, measured in the same run.
//! Saves are timed to the synced manifest (every file and the directory fsynced), loads include
//! every checksum and the parameter SHA-256. A cold load (page cache dropped first) needs root;
//! it is reported only when asked for and possible.

use crate::runtime::clock::Stopwatch;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Serialize;

use super::meta::CheckpointMeta;
use super::partial::CheckpointSource;
use super::read::load;
use super::write::{save, SaveOptions};
use super::writer::CheckpointWriter;
use crate::config::TrainConfig;
use crate::engine::coordinator::{Progress, StepRecord};
use crate::job::{build_dataset, build_model};
use crate::model::{ParamSpec, UnitSpec};
use crate::plan::ShardMap;
use crate::runtime::actors::Snapshot;
use crate::runtime::api::cluster::Observer;
use crate::runtime::step::elastic::resume::read_owned_chunks;
use crate::runtime::step::state::rank_state::ChunkState;
use crate::runtime::{train, ClusterSpec};
use crate::summary::median;

/// Save and load throughput against direct I/O.
#[derive(Clone, Debug, Serialize)]
pub struct ThroughputReport {
    pub dir: PathBuf,
    pub params: usize,
    pub ranks: u32,
    pub bytes: u64,
    pub dd_write_direct_mb_s: f64,
    pub dd_read_direct_mb_s: f64,
    /// Best of the repeats.
    pub save_mb_s: f64,
    pub load_warm_mb_s: f64,
    pub load_cold_mb_s: Option<f64>,
    /// A resume's read (page cache warm): each of `ranks` threads reads and checks only the
    /// records of the chunks it owns, at the saved world size.
    pub resume_read_warm_mb_s: f64,
}

/// A synthetic AdamW snapshot of `params` parameters in 4 units, sharded over `ranks`.
pub fn synthetic(
    params: usize,
    ranks: u32,
    chunk_elems: usize,
) -> Result<(CheckpointMeta, Snapshot), String> {
    let per = params.div_ceil(4);
    let numels: Vec<usize> = (0..4)
        .map(|u| per.min(params.saturating_sub(u * per)))
        .collect();
    let members: Vec<u32> = (0..ranks).collect();
    let map = ShardMap::plan(&numels, &members, chunk_elems, 1).map_err(|e| e.to_string())?;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 40) as f32) / (1u64 << 24) as f32 - 0.5
    };
    let mut chunks = Vec::new();
    for (u, unit) in map.units.iter().enumerate() {
        for i in 0..unit.owners.len() {
            let n = map.chunk_range(u, i).len();
            chunks.push(ChunkState {
                unit: u as u32,
                index: i as u32,
                params: (0..n).map(|_| next()).collect(),
                m: (0..n).map(|_| next()).collect(),
                v: (0..n).map(|_| next().abs()).collect(),
            });
        }
    }
    let units = numels
        .iter()
        .enumerate()
        .map(|(u, &n)| UnitSpec {
            name: format!("unit{u}"),
            params: vec![ParamSpec {
                name: format!("unit{u}.weight"),
                shape: vec![n],
            }],
        })
        .collect();
    let meta = CheckpointMeta {
        config: TrainConfig {
            ranks,
            chunk_elems,
            ..TrainConfig::default()
        },
        units,
        data_source: "synthetic".into(),
        data_sha256: None,
    };
    let snap = Snapshot {
        progress: Progress {
            step: 1,
            opt_step: 1,
            grad_bounds: vec![1.0; 4],
        },
        map,
        chunks,
    };
    Ok((meta, snap))
}

/// MB/s of one `dd` run moving `bytes` with direct I/O (`write` from /dev/zero into `file`, or
/// read `file` into /dev/null).
fn dd_direct(file: &Path, bytes: u64, write: bool) -> Result<f64, String> {
    let bs: u64 = 4 << 20;
    let count = bytes.div_ceil(bs).max(1);
    let f = file.display();
    let args: Vec<String> = if write {
        vec![
            "if=/dev/zero".into(),
            format!("of={f}"),
            "bs=4M".into(),
            format!("count={count}"),
            "oflag=direct".into(),
            "conv=fsync".into(),
        ]
    } else {
        vec![
            format!("if={f}"),
            "of=/dev/null".into(),
            "bs=4M".into(),
            "iflag=direct".into(),
        ]
    };
    let t = Stopwatch::start();
    let out = Command::new("dd")
        .args(&args)
        .output()
        .map_err(|e| format!("cannot run dd: {e}"))?;
    let s = t.elapsed().as_secs_f64();
    if !out.status.success() {
        return Err(format!(
            "dd {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok((count * bs) as f64 / 1e6 / s)
}

/// Drops the page cache (root only); false if not permitted.
fn drop_caches() -> bool {
    Command::new("sync").status().is_ok_and(|s| s.success())
        && std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// Saves and loads a synthetic snapshot `repeats` times in `dir`; the disk reference first.
pub fn bench_throughput(
    dir: &Path,
    params: usize,
    ranks: u32,
    repeats: usize,
    cold: bool,
) -> Result<ThroughputReport, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let (meta, snap) = synthetic(params, ranks, 1 << 16)?;
    let bytes = 12 * params as u64;
    let dd_file = dir.join("dd-direct.bin");
    let dd_write = dd_direct(&dd_file, bytes, true)?;
    let dd_read = dd_direct(&dd_file, bytes, false)?;
    let _ = std::fs::remove_file(&dd_file);
    let root = dir.join("bench-ckpt");
    let opts = SaveOptions {
        keep: 1,
        crash: None,
    };
    let (mut save_best, mut load_best, mut cold_best) = (0f64, 0f64, None::<f64>);
    let mut resume_best = 0f64;
    for _ in 0..repeats.max(1) {
        let _ = std::fs::remove_dir_all(&root);
        let r = save(&root, &meta, &snap, &opts).map_err(|e| e.to_string())?;
        save_best = save_best.max(r.mb_per_s());
        let t = Stopwatch::start();
        load(&r.dir).map_err(|e| e.to_string())?;
        load_best = load_best.max(r.bytes as f64 / 1e6 / t.elapsed().as_secs_f64());
        let t = Stopwatch::start();
        let source = CheckpointSource::open(&r.dir).map_err(|e| e.to_string())?;
        let map = ShardMap::plan(
            &source
                .manifest
                .shard_map
                .units
                .iter()
                .map(|u| u.numel)
                .collect::<Vec<_>>(),
            &(0..ranks).collect::<Vec<_>>(),
            source.manifest.shard_map.chunk_elems,
            2,
        )
        .map_err(|e| e.to_string())?;
        read_owned_chunks(&source, &map)?;
        resume_best = resume_best.max(r.bytes as f64 / 1e6 / t.elapsed().as_secs_f64());
        if cold && drop_caches() {
            let t = Stopwatch::start();
            load(&r.dir).map_err(|e| e.to_string())?;
            let mbs = r.bytes as f64 / 1e6 / t.elapsed().as_secs_f64();
            cold_best = Some(cold_best.map_or(mbs, |b: f64| b.max(mbs)));
        }
    }
    let _ = std::fs::remove_dir_all(&root);
    Ok(ThroughputReport {
        dir: dir.to_path_buf(),
        params,
        ranks,
        bytes,
        dd_write_direct_mb_s: dd_write,
        dd_read_direct_mb_s: dd_read,
        save_mb_s: save_best,
        load_warm_mb_s: load_best,
        load_cold_mb_s: cold_best,
        resume_read_warm_mb_s: resume_best,
    })
}

/// Training step times with and without checkpointing.
#[derive(Clone, Debug, Serialize)]
pub struct SlowdownReport {
    pub params: usize,
    pub checkpoint_bytes: u64,
    pub steps: u64,
    pub save_every: u64,
    pub rounds: usize,
    /// No snapshots at all.
    pub baseline_step_median_s: f64,
    /// A snapshot after every step (what `--save-dir` does, for SIGTERM), none written.
    pub snapshot_every_step_median_s: f64,
    /// Snapshots every step and a background save every `save_every` steps: steps that ran while
    /// a save was in flight, and all steps.
    pub during_save_step_median_s: f64,
    pub saving_run_step_median_s: f64,
    pub save_write_median_s: f64,
}

struct Timed<'a> {
    durations: Vec<(u64, f64, bool)>,
    writer: Option<&'a CheckpointWriter>,
    save_every: u64,
    in_flight: usize,
    writes: Vec<f64>,
}

impl Observer for &mut Timed<'_> {
    fn on_step(&mut self, r: &StepRecord) {
        // A save submitted at the previous boundary and not yet reported ran during this step.
        let overlapped = self.in_flight > 0;
        if let Some(w) = self.writer {
            for res in w.poll() {
                self.in_flight = self.in_flight.saturating_sub(1);
                if let Ok(rep) = res {
                    self.writes.push(rep.write_s);
                }
            }
        }
        self.durations
            .push((r.step, r.duration_ms as f64 / 1e3, overlapped));
    }

    fn on_snapshot(&mut self, s: crate::runtime::actors::Snapshot) {
        if let Some(w) = self.writer {
            if self.save_every > 0
                && s.progress.step.is_multiple_of(self.save_every)
                && w.submit(s).is_ok()
            {
                self.in_flight += 1;
            }
        }
    }
}

/// Trains `cfg` three ways (no snapshots; a snapshot every step; and saving every `save_every`
/// steps in the background under `dir`), `rounds` times each, interleaved, and compares step
/// times (the first 2 steps of each run dropped).
pub fn bench_slowdown(
    cfg: &TrainConfig,
    save_every: u64,
    rounds: usize,
    dir: &Path,
) -> Result<SlowdownReport, String> {
    let model = build_model(cfg).map_err(|e| e.to_string())?;
    let data = build_dataset(cfg).map_err(|e| e.to_string())?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let run = |snapshot_every: u64, timed: &mut Timed| {
        let spec = ClusterSpec {
            config: cfg.clone(),
            model: model.clone(),
            data: data.clone(),
            init: None,
            resume: None,
            snapshot_every,
            boundary_snapshot: None,
            progress: Default::default(),
            snapshot_sink: None,
            clock: crate::runtime::clock::SystemClock::shared(),
            net_trace: None,
            keep_params: false,
        };
        rt.block_on(train(spec, timed))
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let fresh = |writer| Timed {
        durations: Vec::new(),
        writer,
        save_every,
        in_flight: 0,
        writes: Vec::new(),
    };
    let med = |t: &Timed, f: &dyn Fn(bool) -> bool| {
        median(
            t.durations
                .iter()
                .filter(|d| d.0 >= 2 && f(d.2))
                .map(|d| d.1)
                .collect(),
        )
    };
    let meta = CheckpointMeta::new(cfg, model.as_ref(), &data).map_err(|e| e.to_string())?;
    let root = dir.join("bench-train");
    let _ = std::fs::remove_dir_all(&root);
    let writer = CheckpointWriter::spawn(
        root.clone(),
        meta,
        SaveOptions {
            keep: 2,
            crash: None,
        },
    )
    .map_err(|e| e.to_string())?;
    let (mut base, mut every, mut saving) = (fresh(None), fresh(None), fresh(Some(&writer)));
    // Interleaved, so that load from elsewhere on the machine hits the three alike.
    for _ in 0..rounds.max(1) {
        run(0, &mut base)?;
        run(1, &mut every)?;
        run(1, &mut saving)?;
    }
    let (mut writes, during, all) = (
        saving.writes.clone(),
        med(&saving, &|busy| busy),
        med(&saving, &|_| true),
    );
    let (base_med, every_med) = (med(&base, &|_| true), med(&every, &|_| true));
    drop(saving);
    for r in writer.finish() {
        writes.push(r.map_err(|e| e.to_string())?.write_s);
    }
    let _ = std::fs::remove_dir_all(&root);
    let params = crate::model::param_count(&model.units());
    Ok(SlowdownReport {
        params,
        checkpoint_bytes: 12 * params as u64,
        steps: cfg.steps,
        save_every,
        rounds,
        baseline_step_median_s: base_med,
        snapshot_every_step_median_s: every_med,
        during_save_step_median_s: during,
        saving_run_step_median_s: all,
        save_write_median_s: median(writes),
    })
}
