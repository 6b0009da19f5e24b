//! The NVMe tier: optimizer state and stage 3's parameter shards offloaded to disk train bit for
//! bit like the in-RAM run, through elastic changes, losses and resumes; damaged or failing
//! tier files stop the rank (and the run, without backups) with a message naming the file; a
//! run that cannot fit, or whose tier directory cannot be used, is refused before it allocates.

use std::path::{Path, PathBuf};

use crate::common;

use common::ezero::{ezero, ok, refused, s, step_dir, train_cli};
use common::{run_cfg, small};
use elastic_zero::config::{At, Faults, ModelKind, TrainConfig};
use elastic_zero::engine::coordinator::StepRecord;
use elastic_zero::plan::tier::Offload;
use elastic_zero::runtime::api::cluster::Observer;
use elastic_zero::runtime::ClusterSpec;

/// A tier directory on the build's disk (the temp dir may be tmpfs, which the tier refuses).
pub(crate) fn tier_dir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// `base` with optimizer state (and, when asked, stage 3's parameters and stage 2-3's
/// gradients) on the tier in `dir`, in records of 1024 elements so that every unit spans
/// several records and chunks straddle them.
pub(crate) fn offloaded(base: &TrainConfig, dir: &Path, params: bool, grads: bool) -> TrainConfig {
    let on = |b: bool| if b { Offload::Nvme } else { Offload::None };
    TrainConfig {
        offload_optimizer: Offload::Nvme,
        offload_params: on(params),
        offload_grads: on(grads),
        nvme_dir: Some(dir.to_path_buf()),
        nvme_record_elems: Some(1024),
        ..base.clone()
    }
}

/// The run's digest. With state on the tier the digest is read piece by piece from the ranks
/// and nothing is consolidated; in RAM it is the consolidated parameters' digest.
pub(crate) fn sha(cfg: &TrainConfig) -> String {
    let out = run_cfg(cfg).unwrap_or_else(|e| panic!("{e}"));
    let on_tier =
        [cfg.offload_optimizer, cfg.offload_params, cfg.offload_grads].contains(&Offload::Nvme);
    assert_eq!(out.params.is_empty(), on_tier, "consolidated only in RAM");
    out.param_sha256
}

/// The tier leaves nothing behind but its lock file.
pub(crate) fn assert_clean(dir: &Path) {
    let left: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().is_some_and(|n| n != ".ezero.lock"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn offload_matches_ram_at_every_stage_and_world_size() {
    let dir = tier_dir();
    for model in [ModelKind::Gpt, ModelKind::Llama, ModelKind::Mlp] {
        let base = TrainConfig {
            steps: 3,
            ..small(model)
        };
        let want = sha(&TrainConfig {
            ranks: 1,
            ..base.clone()
        });
        for ranks in 1..=3 {
            for stage in 0..=3u8 {
                let cfg = TrainConfig {
                    ranks,
                    stage,
                    ..base.clone()
                };
                let combos: &[(bool, bool)] = match stage {
                    0 | 1 => &[(false, false)],
                    2 => &[(false, false), (false, true)],
                    _ => &[(false, false), (true, false), (true, true)],
                };
                for &(params, grads) in combos {
                    let got = sha(&offloaded(&cfg, dir.path(), params, grads));
                    assert_eq!(
                        got, want,
                        "{model:?} ranks {ranks} stage {stage} params {params} grads {grads}"
                    );
                }
            }
        }
    }
    assert_clean(dir.path());
}

#[test]
fn sgd_and_fast_reduction_offload_too() {
    let dir = tier_dir();
    let base = TrainConfig {
        ranks: 2,
        optimizer: elastic_zero::config::OptimizerChoice::Sgd,
        reduce: elastic_zero::reduce::ReduceMode::Fast,
        ..small(ModelKind::Gpt)
    };
    let want = sha(&base);
    assert_eq!(sha(&offloaded(&base, dir.path(), true, true)), want);
    // Parameters and gradients on the tier with the optimizer state in RAM.
    let cfg = TrainConfig {
        offload_optimizer: Offload::None,
        ..offloaded(&base, dir.path(), true, true)
    };
    assert_eq!(sha(&cfg), want);
}

pub(crate) fn at(value: u32, step: u64) -> At {
    At { value, step }
}

#[test]
fn leave_join_and_kill_move_offloaded_state_and_lose_nothing() {
    let dir = tier_dir();
    let base = TrainConfig {
        steps: 6,
        ranks: 3,
        ..small(ModelKind::Gpt)
    };
    let want = sha(&base);
    for stage in [1u8, 3] {
        for (leave, join, kill) in [
            (vec![at(1, 2)], vec![], vec![]),
            (vec![], vec![at(2, 3)], vec![]),
            (vec![], vec![], vec![at(2, 4)]),
        ] {
            let cfg = TrainConfig {
                stage,
                leave,
                join,
                kill,
                ..base.clone()
            };
            let got = sha(&offloaded(&cfg, dir.path(), stage == 3, stage == 3));
            assert_eq!(got, want, "stage {stage}: {cfg:?}");
        }
    }
    assert_clean(dir.path());
}

/// Records how many chunk elements each membership change moved.
#[derive(Default)]
struct Moves(Vec<usize>);

impl Observer for &mut Moves {
    fn on_membership(&mut self, r: &elastic_zero::engine::coordinator::MembershipRecord) {
        self.0.push(r.moved_chunk_elems);
    }
}

/// A reshard of offloaded state larger than one piece (GROUP_ELEMS, 1 Mi elements) moves it
/// piece by piece into a file on the receiver's tier, and ends with the fixed world's digest:
/// a leave at 2 ranks hands the leaver's half (1.6M elements) to one rank, then a join takes
/// half back. Stage 3 with everything on the tier, and stage 2 under bf16 with the owned
/// masters on the tier beside m and v.
#[test]
fn a_reshard_larger_than_a_piece_streams_through_the_tier() {
    let dir = tier_dir();
    for (stage, precision) in [(3u8, "fp32"), (2, "bf16")] {
        let base = TrainConfig {
            d_model: 256,
            layers: 4,
            heads: 4,
            seq_len: 16,
            micro_batches: 2,
            micro_batch_size: 1,
            chunk_elems: 65536,
            steps: 4,
            ranks: 2,
            stage,
            precision: precision.parse().unwrap(),
            ..small(ModelKind::Gpt)
        };
        let want = sha(&base);
        let cfg = TrainConfig {
            leave: vec![at(1, 1)],
            join: vec![at(2, 2)],
            ..offloaded(&base, dir.path(), stage == 3, false)
        };
        let mut moves = Moves::default();
        let out = common::train_blocking(ClusterSpec::from_config(cfg).unwrap(), &mut moves)
            .unwrap_or_else(|e| panic!("stage {stage}: {e}"));
        assert_eq!(out.param_sha256, want, "stage {stage} {precision}");
        assert_eq!(moves.0.len(), 2, "{:?}", moves.0);
        assert!(moves.0.iter().all(|&m| m > 1 << 20), "{:?}", moves.0);
    }
    assert_clean(dir.path());
}

/// Lists the buddy backups' files on the tier after each step.
#[derive(Default)]
struct BackupFiles {
    dir: PathBuf,
    seen: Vec<(u64, Vec<String>)>,
}

impl Observer for &mut BackupFiles {
    fn on_step(&mut self, rec: &StepRecord) {
        let mut names = Vec::new();
        for rank in std::fs::read_dir(&self.dir).unwrap() {
            let rank = rank.unwrap().path();
            if rank.is_dir() {
                for f in std::fs::read_dir(&rank).unwrap() {
                    let name = f.unwrap().file_name().to_string_lossy().into_owned();
                    if name.starts_with("backup-") {
                        names.push(name);
                    }
                }
            }
        }
        names.sort();
        self.seen.push((rec.step, names));
    }
}

/// With state on the tier, each rank's backup (its own state and its predecessor's replica)
/// is a pair of files beside its tier file, not a copy in RAM, and a kill restores from them.
#[test]
fn buddy_backups_of_offloaded_state_are_files_on_the_tier() {
    let dir = tier_dir();
    let base = TrainConfig {
        steps: 5,
        ranks: 3,
        stage: 3,
        ..small(ModelKind::Gpt)
    };
    let want = sha(&base);
    let cfg = TrainConfig {
        kill: vec![at(1, 3)],
        ..offloaded(&base, dir.path(), true, true)
    };
    let mut files = BackupFiles {
        dir: dir.path().to_path_buf(),
        ..Default::default()
    };
    let out = common::train_blocking(ClusterSpec::from_config(cfg).unwrap(), &mut files).unwrap();
    assert_eq!(out.param_sha256, want);
    // After the first step, the backup taken before it: three ranks, each with a local copy
    // and a held replica (the next backup may be on its way already).
    let (step, first) = &files.seen[0];
    assert_eq!(*step, 0);
    let before_0: Vec<&String> = first
        .iter()
        .filter(|n| n.starts_with("backup-e1-s0-"))
        .collect();
    assert_eq!(before_0.len(), 6, "{first:?}");
    assert_eq!(
        before_0
            .iter()
            .filter(|n| n.ends_with("-local.bin"))
            .count(),
        3
    );
    assert_eq!(
        before_0.iter().filter(|n| n.ends_with("-held.bin")).count(),
        3
    );
    assert_clean(dir.path());
}

#[test]
fn a_checkpoint_resumes_into_the_tier_at_another_world_size() {
    let t = tempfile::tempdir().unwrap();
    let dir = tier_dir();
    let root = t.path().join("ck");
    let want = ok(&train_cli(&["--steps", "6", "--ranks", "1"])).sha();
    let tier = ["--offload-optimizer", "nvme", "--nvme-dir", s(dir.path())];
    let mut args = vec!["--steps", "6", "--ranks", "2", "--stage", "3"];
    args.extend(["--save-dir", s(&root), "--save-every", "3"]);
    args.extend(tier);
    args.extend(["--offload-params", "nvme", "--offload-grads", "nvme"]);
    let saved = train_cli(&args);
    assert_eq!(ok(&saved).sha(), want);
    // Written from the tier a piece at a time, not gathered whole in RAM.
    assert_eq!(
        saved.stdout.matches(", streamed from the tier").count(),
        2,
        "{}",
        saved.stdout
    );
    let at3 = step_dir(&root, 3);
    ok(&ezero(&["checkpoint", "verify", s(&at3)]));
    let mut args = vec!["train", "--resume", s(&at3), "--ranks", "3", "--stage", "1"];
    args.extend(["--save-every", "0"]);
    args.extend(tier);
    let r = ezero(&args);
    assert_eq!(ok(&r).sha(), want);
    assert!(r.stdout.contains("on the tier"), "{}", r.stdout);
}

/// Damages every tier file of `rank` after `step` (the next read of any record that was not
/// rewritten in between fails its CRC check).
struct Damage {
    dir: PathBuf,
    rank: u32,
    step: u64,
    /// Once: a rollback replays the step.
    done: bool,
    /// Ranks the run declared lost.
    lost: Vec<u32>,
}

impl Observer for &mut Damage {
    fn on_step(&mut self, rec: &StepRecord) {
        if rec.step != self.step || self.done {
            return;
        }
        use std::os::unix::fs::OpenOptionsExt;
        self.done = true;
        let folder = self.dir.join(format!("rank-{}", self.rank));
        for f in std::fs::read_dir(folder).unwrap() {
            let path = f.unwrap().path();
            // The state's tier files, not the backups beside them (which come and go).
            if !path
                .file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("state-")
            {
                continue;
            }
            let len = std::fs::metadata(&path).unwrap().len() as usize;
            assert_eq!(
                len % 4096,
                0,
                "tier files are whole blocks: {}",
                path.display()
            );
            // In place, as a failing disk would: never shorter than the engine expects. With
            // O_DIRECT like the engine: a buffered write racing the engine's direct writes
            // leaves dirty pages the kernel cannot invalidate, and it then reports EIO on the
            // file (seen on CI) instead of the damage the test means.
            let f = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(&path)
                .unwrap();
            let junk = vec![0x5a_u8; len + 4096];
            let start = junk.as_ptr().align_offset(4096);
            std::os::unix::fs::FileExt::write_all_at(&f, &junk[start..start + len], 0).unwrap();
        }
    }

    fn on_membership(&mut self, r: &elastic_zero::engine::coordinator::MembershipRecord) {
        self.lost.extend(&r.lost);
    }
}

#[test]
fn a_damaged_tier_file_is_caught_and_never_applied() {
    let dir = tier_dir();
    let base = TrainConfig {
        steps: 5,
        ranks: 2,
        stage: 3,
        ..small(ModelKind::Gpt)
    };
    let want = sha(&base);
    // Without backups the run stops, naming the file and the check that failed.
    let cfg = TrainConfig {
        replicate_every: 0,
        ..offloaded(&base, dir.path(), true, true)
    };
    let damage = Damage {
        dir: dir.path().to_path_buf(),
        rank: 1,
        step: 1,
        done: false,
        lost: Vec::new(),
    };
    let spec = ClusterSpec::from_config(cfg).unwrap();
    let mut damage = damage;
    let err = common::train_blocking(spec, &mut damage)
        .err()
        .expect("the run stops")
        .to_string();
    assert!(err.contains("fails its CRC check"), "{err}");
    assert!(err.contains("rank-1"), "{err}");
    // With backups the rank counts as lost and its buddy's copy restores it: nothing is lost.
    let cfg = offloaded(&base, dir.path(), true, true);
    let damage = Damage {
        dir: dir.path().to_path_buf(),
        rank: 1,
        step: 1,
        done: false,
        lost: Vec::new(),
    };
    let spec = ClusterSpec::from_config(cfg).unwrap();
    let mut damage = damage;
    let out = common::train_blocking(spec, &mut damage).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(out.param_sha256, want);
    assert_eq!(
        damage.lost,
        vec![1],
        "the damaged rank, not its buddy, is lost"
    );
    assert_clean(dir.path());
}

#[test]
fn a_failing_disk_stops_the_run_cleanly_or_loses_the_rank() {
    let dir = tier_dir();
    let base = TrainConfig {
        steps: 5,
        ranks: 2,
        stage: 3,
        ..small(ModelKind::Gpt)
    };
    assert_failing_disks_stop_or_recover(&base, dir.path());
    assert_clean(dir.path());
}

/// `base` (two ranks or more) with everything on the tier in `dir` and an injected EIO on rank
/// 1's disk, then an ENOSPC on rank 0's: without backups the run stops naming the error and the
/// directory; with them the survivor takes the rank's state over and the run ends with `base`'s
/// digest in RAM.
pub(crate) fn assert_failing_disks_stop_or_recover(base: &TrainConfig, dir: &Path) {
    let want = sha(base);
    for (fault, what) in [
        ("1:eio@600KiB", "I/O error (EIO)"),
        ("0:enospc@700KiB", "no space left on the device"),
    ] {
        let cfg = TrainConfig {
            faults: Faults {
                nvme_fault: Some(fault.parse().unwrap()),
                ..Faults::default()
            },
            ..offloaded(base, dir, true, true)
        };
        let err = run_cfg(&TrainConfig {
            replicate_every: 0,
            ..cfg.clone()
        })
        .err()
        .expect("the run stops")
        .to_string();
        assert!(err.contains(what), "{fault}: {err}");
        assert!(err.contains(&s(dir).to_string()), "{fault}: {err}");
        // With backups, the survivor takes the rank's state over.
        assert_eq!(sha(&cfg), want, "{fault}");
    }
}

/// The tier's disk fills up mid-run (an injected ENOSPC on rank 0's tier file, after the step-2
/// checkpoint was streamed off the tier): the run stops naming the file and pointing at the
/// newest checkpoint, which is complete and resumes to the fault-free run's parameters.
#[test]
fn a_full_disk_mid_run_stops_it_and_the_newest_checkpoint_resumes() {
    let t = tempfile::tempdir().unwrap();
    let dir = tier_dir();
    let root = t.path().join("ck");
    let model = [
        "--model",
        "gpt",
        "--layers",
        "2",
        "--d-model",
        "32",
        "--heads",
        "4",
        "--seq-len",
        "16",
        "--micro-batches",
        "4",
        "--micro-batch-size",
        "2",
        "--sample-tokens",
        "0",
    ];
    let mut tier = vec!["--ranks", "2", "--stage", "3", "--replicate-every", "0"];
    tier.extend(["--offload-optimizer", "nvme", "--offload-params", "nvme"]);
    tier.extend(["--offload-grads", "nvme", "--nvme-dir", s(dir.path())]);
    tier.extend(["--nvme-record-elems", "1024"]);
    let run = |extra: &[&str]| {
        let mut args = vec!["train"];
        args.extend(model);
        args.extend(&tier);
        args.extend(extra);
        ezero(&args)
    };
    let want = ok(&run(&["--steps", "6"])).sha();
    // Rank 0 writes about 0.25 MiB of tier as it starts and 0.32 MiB a step here: 1200 KiB
    // falls in step 3, between the checkpoints of steps 2 and 4.
    let config = t.path().join("fault.toml");
    std::fs::write(&config, "nvme_fault = \"0:enospc@1200KiB\"\n").unwrap();
    let mut args = vec!["--steps", "6", "--save-dir", s(&root), "--save-every", "2"];
    args.extend(["--config", s(&config)]);
    let r = run(&args);
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("no space left on the device (ENOSPC)")
            && r.stderr.contains(&format!("{}/rank-0/", s(dir.path())))
            && r.stderr.contains("resume from your newest checkpoint"),
        "{}",
        r.stderr
    );
    let v = ezero(&["checkpoint", "verify", s(&root)]);
    assert!(ok(&v).stdout.contains("step 2,"), "{}", v.stdout);
    assert!(!step_dir(&root, 4).exists(), "{}", r.stdout);
    let resumed = run(&["--steps", "6", "--resume", s(&root)]);
    assert!(
        ok(&resumed).stdout.contains("at step 2 "),
        "{}",
        resumed.stdout
    );
    assert_eq!(resumed.sha(), want);
    assert_clean(dir.path());
}

#[test]
fn bad_tier_settings_are_refused_before_training() {
    let dir = tier_dir();
    let d = s(dir.path());
    let cases: Vec<(Vec<&str>, &str, &str)> = vec![
        (
            vec![
                "--offload-optimizer",
                "nvme",
                "--nvme-dir",
                "/nonexistent/tier",
            ],
            "/nonexistent/tier",
            "does not exist",
        ),
        (
            vec!["--offload-optimizer", "nvme"],
            "nvme_dir",
            "set --nvme-dir DIR",
        ),
        (
            vec!["--offload-params", "nvme", "--stage", "2", "--nvme-dir", d],
            "offload_params",
            "needs ZeRO stage 3",
        ),
        (
            vec!["--offload-optimizer", "cpu"],
            "offload_optimizer",
            "means host memory beside a device",
        ),
        (
            vec!["--memory-max", "1MiB"],
            "memory_max_bytes",
            "below the 64 MiB",
        ),
    ];
    for (args, file, what) in cases {
        refused(&train_cli(&args), file, what);
    }
    let r = ezero(&[
        "train",
        "--d-model",
        "512",
        "--layers",
        "4",
        "--memory-max",
        "64MiB",
    ]);
    refused(&r, "may use 64.0 MiB (memory_max_bytes)", "the run needs");
    // Tens of trillions of parameters (five billion chunks): refused with the numbers, not
    // after planning every chunk first.
    let r = ezero(&["train", "--d-model", "131072", "--layers", "200"]);
    refused(&r, "parameters 38400.39 GiB", "the run needs");
    if Path::new("/dev/shm").is_dir() {
        let shm = tempfile::tempdir_in("/dev/shm").unwrap();
        let r = train_cli(&["--offload-optimizer", "nvme", "--nvme-dir", s(shm.path())]);
        if r.code == 2 && r.stderr.contains("tmpfs") {
            refused(&r, s(shm.path()), "is on tmpfs or ramfs");
        }
    }
    // A directory another run is using.
    let _held = elastic_zero::runtime::storage::lock_dir(dir.path()).unwrap();
    let r = train_cli(&["--offload-optimizer", "nvme", "--nvme-dir", d]);
    refused(&r, d, "in use by another run");
}

#[test]
fn a_model_that_cannot_fit_is_refused_at_once_with_what_would_fit() {
    // 3.2 billion parameters: about 51 GB of fp32 state and Adam, refused before any of it is
    // allocated.
    let big = [
        "--d-model",
        "4096",
        "--layers",
        "16",
        "--heads",
        "32",
        "--memory-max",
        "8GiB",
    ];
    let r = ezero(&[&["train"][..], &big[..]].concat());
    refused(&r, "needs", "--offload-optimizer nvme");
    assert!(
        r.stderr.contains("may use 8.00 GiB (memory_max_bytes)"),
        "{}",
        r.stderr
    );
}

#[test]
fn state_eight_times_the_process_peak_trains() {
    // 50.6M parameters, everything on the tier, in a process of its own so that its VmHWM is
    // this run's alone: parameters, Adam m and v are 12 bytes a parameter (607 MB), and the
    // process must peak at under an eighth of that while it trains. The page cache does not
    // count: the tier uses O_DIRECT.
    let dir = tier_dir();
    let t = tempfile::tempdir().unwrap();
    let json = t.path().join("summary.json");
    let r = ezero(&[
        "train",
        "--d-model",
        "256",
        "--layers",
        "64",
        "--heads",
        "4",
        "--seq-len",
        "16",
        "--micro-batches",
        "1",
        "--micro-batch-size",
        "1",
        "--ranks",
        "1",
        "--stage",
        "3",
        // Three steps: the middle one owes its update to the next forward, as every step but
        // the last does in a longer run (the median is that step's).
        "--steps",
        "3",
        "--sample-tokens",
        "0",
        "--offload-optimizer",
        "nvme",
        "--offload-params",
        "nvme",
        "--offload-grads",
        "nvme",
        "--nvme-dir",
        s(dir.path()),
        "--nvme-record-elems",
        "65536",
        // The least memory: without a budget, auto would keep activations (they fit the
        // machine), which is not what this run measures.
        "--activation-checkpointing",
        "always",
        "--json",
        s(&json),
    ]);
    ok(&r);
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(summary["activations"], "recomputed");
    let params = summary["param_count"].as_u64().unwrap();
    let peak = summary["peak_rss_training_bytes"].as_u64().unwrap();
    let state = 12 * params;
    assert!(peak > 0);
    assert!(
        state >= 8 * peak,
        "state {state} bytes, training peak {peak} bytes: only {:.1}x",
        state as f64 / peak as f64
    );
    // It moved what the schedule says, per parameter. The median step runs the previous step's
    // owed update in its forward (p, m, v and the f32 mean gradient read, p, m, v written back),
    // which gives the gather its parameters, then reads p again in the backward and writes the
    // gradient: 20 bytes read and 16 written, not the exact accumulator's 8-byte sums (24 and
    // 20), nor the 24 read of a separate optimizer phase after a forward that reads p too.
    let read = summary["nvme_read_bytes_per_step"].as_u64().unwrap();
    let written = summary["nvme_write_bytes_per_step"].as_u64().unwrap();
    assert!(
        (20 * params..22 * params).contains(&read) && (16 * params..18 * params).contains(&written),
        "{read} {written} for {params} parameters"
    );
    assert_clean(dir.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_metrics_show_each_ranks_tier() {
    use elastic_zero::runtime::actors::ClusterEvent;
    use elastic_zero::runtime::Cluster;
    let dir = tier_dir();
    let base = TrainConfig {
        ranks: 2,
        stage: 3,
        ..small(ModelKind::Gpt)
    };
    let cfg = offloaded(&base, dir.path(), true, true);
    let spec = ClusterSpec::from_config(cfg).unwrap();
    let mut job = Cluster::builder(spec).start().await.unwrap();
    let handle = job.handle();
    job.run();
    while let Some(ev) = job.next_event().await {
        match ev {
            ClusterEvent::Finished => break,
            ClusterEvent::Aborted(why) => panic!("the run stopped: {why}"),
            _ => {}
        }
    }
    let status = handle.status().await.unwrap();
    job.finish().await.unwrap();
    for s in &status.shards {
        let t = s.tier.expect("every rank has a tier");
        // p, m, v and the f32 mean gradient: 16 bytes an owned element, in whole blocks. A
        // step reads p twice (forward, backward), then p, m, v and g, and writes g, p, m, v.
        assert!(t.bytes >= 16 * s.owned_elems, "{t:?}");
        assert!(
            t.read_bytes >= 24 * s.owned_elems && t.write_bytes >= 16 * s.owned_elems,
            "{t:?} {}",
            s.owned_elems
        );
        assert!(t.read_bytes_per_s > 0.0 && t.io_wait_s >= 0.0);
    }
    let text = status.prometheus();
    for r in 0..2 {
        assert!(
            text.contains(&format!("ezero_rank_tier_bytes{{rank=\"{r}\"}} ")),
            "{text}"
        );
    }
    assert!(text.contains("# TYPE ezero_rank_tier_read_bytes_per_second gauge"));
}

/// Tied embeddings with state on the tier and through a leave, a join and a kill: the owner's
/// accumulator takes the head's gradient wherever the embedding's chunks live.
#[test]
fn tied_embeddings_offload_and_move_like_any_other_parameter() {
    let dir = tier_dir();
    let base = TrainConfig {
        steps: 5,
        ranks: 3,
        tie_embeddings: true,
        ..small(ModelKind::Gpt)
    };
    let want = sha(&TrainConfig {
        ranks: 1,
        ..base.clone()
    });
    for stage in [1u8, 2, 3] {
        let got = sha(&offloaded(
            &TrainConfig {
                stage,
                ..base.clone()
            },
            dir.path(),
            stage == 3,
            stage >= 2,
        ));
        assert_eq!(got, want, "stage {stage} offloaded");
    }
    for (leave, join, kill) in [
        (vec![at(1, 2)], vec![], vec![]),
        (vec![], vec![at(2, 3)], vec![]),
        (vec![], vec![], vec![at(2, 4)]),
    ] {
        let cfg = TrainConfig {
            leave,
            join,
            kill,
            ..base.clone()
        };
        assert_eq!(sha(&cfg), want, "{cfg:?}");
        assert_eq!(
            sha(&offloaded(&cfg, dir.path(), true, true)),
            want,
            "{cfg:?} offloaded"
        );
    }
    assert_clean(dir.path());
}
