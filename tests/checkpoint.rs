//! Durable checkpoints through the `ezero` binary: resume at any world size and stage bit for
//! bit, crashes during a save, SIGTERM, corruption, and the safetensors round trip.

use std::path::{Path, PathBuf};
use std::process::Command;

use elastic_zero::checkpoint::interchange::{bf16_to_f32, f32_to_bf16};
use elastic_zero::checkpoint::{self, store, CheckpointMeta, SaveOptions};
use elastic_zero::config::{ModelKind, TrainConfig};
use elastic_zero::job::{build_dataset, build_model};
use elastic_zero::runtime::actors::Snapshot;
use elastic_zero::runtime::cluster::Observer;
use elastic_zero::runtime::{train, ClusterSpec, TrainOutcome};
use elastic_zero::summary::param_sha256;

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn sha(&self) -> String {
        self.stdout
            .lines()
            .find_map(|l| l.strip_prefix("param-sha256: "))
            .unwrap_or_else(|| panic!("no digest:\n{}\n{}", self.stdout, self.stderr))
            .to_string()
    }

    fn trained(&self) -> bool {
        self.stdout.lines().any(|l| l.starts_with("step "))
    }
}

fn ezero<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_ezero"))
        .args(args)
        .output()
        .expect("ezero runs");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
    }
}

/// `ezero train` with the tiny MLP and `extra` flags.
fn train_cli(extra: &[&str]) -> Run {
    let mut args = vec![
        "train",
        "--model",
        "mlp",
        "--layers",
        "1",
        "--d-model",
        "16",
        "--seq-len",
        "8",
        "--micro-batches",
        "4",
        "--micro-batch-size",
        "2",
        "--sample-tokens",
        "0",
        "--chunk-elems",
        "1000",
    ];
    args.extend_from_slice(extra);
    ezero(&args)
}

fn ok(r: &Run) -> &Run {
    assert_eq!(r.code, 0, "stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    r
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(checkpoint::manifest::checkpoint_dir_name(step))
}

/// Exit 2, one line naming `file` and containing `what`, and no training.
fn refused(r: &Run, file: &str, what: &str) {
    assert_eq!(r.code, 2, "stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    let err = r.stderr.trim();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains(file) && err.contains(what),
        "want `{file}` and `{what}` in: {err}"
    );
    assert!(
        !r.trained() && !r.stdout.contains("param-sha256"),
        "{}",
        r.stdout
    );
}

#[test]
fn resume_at_any_world_size_and_stage_is_bit_identical() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ck");
    let want = ok(&train_cli(&[
        "--steps", "6", "--ranks", "1", "--stage", "0",
    ]))
    .sha();
    let saved = train_cli(&[
        "--steps",
        "6",
        "--ranks",
        "4",
        "--stage",
        "3",
        "--save-dir",
        s(&root),
        "--save-every",
        "3",
    ]);
    assert_eq!(ok(&saved).sha(), want, "saving must not disturb training");
    assert!(
        saved.stdout.contains("checkpoint: saved"),
        "{}",
        saved.stdout
    );
    let at3 = step_dir(&root, 3);
    ok(&ezero(&["checkpoint", "verify", s(&at3)]));
    for ranks in ["1", "2", "3"] {
        for stage in ["1", "2", "3"] {
            // Only the world size and stage are given: the rest comes from the checkpoint.
            let r = ezero(&[
                "train",
                "--resume",
                s(&at3),
                "--ranks",
                ranks,
                "--stage",
                stage,
                "--save-every",
                "0",
            ]);
            assert!(ok(&r)
                .stdout
                .contains("at step 3 (saved by 4 ranks with ZeRO-3)"));
            assert_eq!(r.sha(), want, "resumed at {ranks} ranks, ZeRO-{stage}");
        }
    }
    // A save directory means its newest complete checkpoint (here the last step: nothing to do).
    let r = ezero(&[
        "train",
        "--resume",
        s(&root),
        "--ranks",
        "2",
        "--stage",
        "0",
    ]);
    assert!(ok(&r).stdout.contains("at step 6"));
    assert_eq!(r.sha(), want);
}

#[test]
fn sigterm_saves_at_the_next_step_boundary_and_the_run_resumes() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ck");
    let want = ok(&train_cli(&["--steps", "5", "--ranks", "2"])).sha();
    let r = train_cli(&[
        "--steps",
        "5",
        "--ranks",
        "3",
        "--stage",
        "2",
        "--save-dir",
        s(&root),
        "--signal-at",
        "2",
    ]);
    assert_eq!(r.code, 128 + 15, "{}\n{}", r.stdout, r.stderr);
    assert!(
        r.stdout.contains("stopped by SIGTERM after step 2"),
        "{}",
        r.stdout
    );
    assert!(!r.stdout.contains("param-sha256"));
    ok(&ezero(&["checkpoint", "verify", s(&step_dir(&root, 2))]));
    let resumed = ezero(&["train", "--resume", s(&root), "--ranks", "1"]);
    assert_eq!(ok(&resumed).sha(), want);
}

#[test]
fn a_crash_during_a_save_leaves_a_complete_checkpoint_that_resumes() {
    let want = ok(&train_cli(&["--steps", "6"])).sha();
    // (crash point during the save of step 4, the checkpoint a resume must then pick)
    let cases = [
        ("mid-file", 2),
        ("files-1", 2),
        ("files-3", 2),
        ("before-manifest", 2),
        ("manifest-tmp", 2),
        ("after-manifest", 4),
        ("retention", 4),
    ];
    for (point, survivor) in cases {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("ck");
        let crash = format!("4:{point}");
        let r = train_cli(&[
            "--steps",
            "6",
            "--ranks",
            "4",
            "--save-dir",
            s(&root),
            "--save-every",
            "2",
            "--keep-checkpoints",
            "1",
            "--checkpoint-crash",
            &crash,
        ]);
        assert!(
            r.code != 0 && !r.stdout.contains("param-sha256"),
            "{point}: {}",
            r.stdout
        );
        assert!(r.stderr.contains("aborting at"), "{point}: {}", r.stderr);
        let v = ezero(&["checkpoint", "verify", s(&root)]);
        assert!(
            ok(&v).stdout.contains(&format!("step {survivor},")),
            "{point}: {}",
            v.stdout
        );
        if survivor == 2 {
            let partial = ezero(&["checkpoint", "verify", s(&step_dir(&root, 4))]);
            refused(&partial, "step-00000004", "incomplete checkpoint");
        }
        let resumed = ezero(&[
            "train",
            "--resume",
            s(&root),
            "--ranks",
            "2",
            "--stage",
            "1",
        ]);
        assert!(
            ok(&resumed)
                .stdout
                .contains(&format!("at step {survivor} ")),
            "{point}"
        );
        assert_eq!(resumed.sha(), want, "{point}");
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn edit(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = std::fs::read(path).unwrap();
    f(&mut bytes);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn damaged_incomplete_or_foreign_checkpoints_are_refused_with_exit_2() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ck");
    let want = ok(&train_cli(&["--steps", "4"])).sha();
    ok(&train_cli(&[
        "--steps",
        "4",
        "--ranks",
        "4",
        "--save-dir",
        s(&root),
        "--save-every",
        "2",
    ]));
    let good = step_dir(&root, 4);
    type Damage = fn(&Path);
    let cases: Vec<(&str, Damage, &str, &str)> = vec![
        (
            "truncated",
            |d| edit(&d.join("rank-00001.bin"), |b| b.truncate(b.len() - 4)),
            "rank-00001.bin",
            "truncated",
        ),
        (
            "flipped",
            |d| {
                edit(&d.join("rank-00002.bin"), |b| {
                    let n = b.len() / 2;
                    b[n] ^= 0x10
                })
            },
            "rank-00002.bin",
            "checksum mismatch in chunk",
        ),
        (
            "missing-file",
            |d| std::fs::remove_file(d.join("rank-00000.bin")).unwrap(),
            "rank-00000.bin",
            "missing",
        ),
        (
            "manifest-edit",
            |d| {
                edit(&d.join("manifest.json"), |b| {
                    let text = String::from_utf8(b.clone()).unwrap().replacen(
                        "\"step\": 4",
                        "\"step\": 5",
                        1,
                    );
                    *b = text.into_bytes();
                })
            },
            "manifest.json",
            "manifest checksum mismatch",
        ),
        (
            "manifest-garbage",
            |d| edit(&d.join("manifest.json"), |b| b.truncate(b.len() / 2)),
            "manifest.json",
            "not a valid manifest",
        ),
        (
            "in-progress",
            |d| std::fs::rename(d.join("manifest.json"), d.join("manifest.json.tmp")).unwrap(),
            "step-00000004",
            "incomplete checkpoint",
        ),
    ];
    for (name, damage, file, what) in cases {
        let dir = t.path().join(name).join("step-00000004");
        copy_dir(&good, &dir);
        damage(&dir);
        refused(&ezero(&["checkpoint", "verify", s(&dir)]), file, what);
        refused(&ezero(&["train", "--resume", s(&dir)]), file, what);
        refused(
            &ezero(&[
                "checkpoint",
                "export",
                s(&dir),
                "--out",
                s(&t.path().join("x.safetensors")),
            ]),
            file,
            what,
        );
    }
    refused(
        &ezero(&["checkpoint", "verify", s(&t.path().join("nope"))]),
        "nope",
        "does not exist",
    );
    refused(
        &ezero(&["train", "--resume", s(&t.path().join("nope"))]),
        "nope",
        "does not exist",
    );
    // Sound checkpoints that do not fit the run.
    refused(
        &ezero(&["train", "--resume", s(&good), "--d-model", "32"]),
        "manifest.json",
        "another model",
    );
    refused(
        &ezero(&["train", "--resume", s(&good), "--steps", "8"]),
        "manifest.json",
        "`steps` is 4",
    );
    refused(
        &ezero(&["train", "--resume", s(&good), "--seed", "1"]),
        "manifest.json",
        "`seed`",
    );
    // The newest checkpoint damaged: refused, unless falling back is asked for.
    edit(&good.join("rank-00003.bin"), |b| b[0] ^= 1);
    refused(
        &ezero(&["train", "--resume", s(&root)]),
        "rank-00003.bin",
        "checksum mismatch",
    );
    let r = ezero(&[
        "train",
        "--resume",
        s(&root),
        "--latest-valid",
        "--ranks",
        "3",
    ]);
    assert!(ok(&r).stdout.contains("at step 2 "), "{}", r.stdout);
    assert!(
        r.stderr.contains("skipped") && r.stderr.contains("rank-00003.bin"),
        "{}",
        r.stderr
    );
    assert_eq!(r.sha(), want);
}

#[test]
fn inspect_reports_the_layout_and_retention_keeps_the_newest() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ck");
    let r = train_cli(&[
        "--steps",
        "5",
        "--ranks",
        "4",
        "--stage",
        "2",
        "--save-dir",
        s(&root),
        "--save-every",
        "1",
        "--keep-checkpoints",
        "2",
    ]);
    let sha = ok(&r).sha();
    let left: Vec<u64> = store::list(&root).unwrap().iter().map(|e| e.step).collect();
    assert_eq!(left, vec![4, 5]);
    let ins = ezero(&["checkpoint", "inspect", s(&root), "--json"]);
    let v: serde_json::Value = serde_json::from_str(ok(&ins).stdout.trim()).unwrap();
    assert_eq!(v["step"], 5);
    assert_eq!(
        (v["world_size"].as_u64(), v["stage"].as_u64()),
        (Some(4), Some(2))
    );
    assert_eq!(
        v["param_sha256"],
        sha.as_str(),
        "the last checkpoint holds the final model"
    );
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 4);
    let per_rank: u64 = ranks.iter().map(|r| r["bytes"].as_u64().unwrap()).sum();
    assert_eq!(per_rank, v["bytes"].as_u64().unwrap());
    assert_eq!(
        per_rank,
        12 * v["param_count"].as_u64().unwrap(),
        "params + Adam m and v"
    );
    let human = ok(&ezero(&["checkpoint", "inspect", s(&root)]))
        .stdout
        .clone();
    assert!(human.contains("saved by 4 ranks, ZeRO-2") && human.contains("rank 3: rank-00003.bin"));
    // A fresh run may not save over another run's checkpoints, and saving needs a directory.
    let fresh = train_cli(&["--steps", "2", "--save-dir", s(&root)]);
    refused(&fresh, "save_dir", "already holds checkpoints");
    refused(
        &train_cli(&["--steps", "2", "--save-every", "1"]),
        "save_every",
        "save_dir",
    );
}

#[test]
fn export_round_trips_through_safetensors_and_init_starts_from_it() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ck");
    let gpt = [
        "train",
        "--model",
        "gpt",
        "--layers",
        "1",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--seq-len",
        "8",
        "--micro-batches",
        "2",
        "--micro-batch-size",
        "2",
        "--sample-tokens",
        "0",
        "--chunk-elems",
        "500",
    ];
    let with = |extra: &[&str]| ezero(&[&gpt[..], extra].concat());
    ok(&with(&[
        "--steps",
        "3",
        "--ranks",
        "3",
        "--save-dir",
        s(&root),
        "--save-every",
        "3",
    ]));
    let loaded = checkpoint::load_path(&root).unwrap();
    let cfg = &loaded.manifest.config;
    let units = build_model(cfg).unwrap().units();
    let params =
        elastic_zero::runtime::cluster::consolidate(&loaded.snapshot.map, &loaded.snapshot.chunks);
    let fp32 = t.path().join("model.safetensors");
    let bf16 = t.path().join("half.safetensors");
    ok(&ezero(&[
        "checkpoint",
        "export",
        s(&root),
        "--out",
        s(&fp32),
    ]));
    ok(&ezero(&[
        "checkpoint",
        "export",
        s(&root),
        "--out",
        s(&bf16),
        "--bf16",
        "--with-optimizer",
    ]));

    // Read back with the safetensors crate: names, shapes and values.
    let bytes = std::fs::read(&fp32).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let half_bytes = std::fs::read(&bf16).unwrap();
    let half = safetensors::SafeTensors::deserialize(&half_bytes).unwrap();
    let opt_bytes = std::fs::read(t.path().join("half.optimizer.safetensors")).unwrap();
    let opt = safetensors::SafeTensors::deserialize(&opt_bytes).unwrap();
    let named: usize = units.iter().map(|u| u.params.len()).sum();
    assert_eq!((st.len(), half.len(), opt.len()), (named, named, 2 * named));
    let m = elastic_zero::runtime::cluster::consolidate(
        &loaded.snapshot.map,
        &loaded
            .snapshot
            .chunks
            .iter()
            .map(|c| elastic_zero::runtime::rank_state::ChunkState {
                params: c.m.clone(),
                ..c.clone()
            })
            .collect::<Vec<_>>(),
    );
    for (u, unit) in units.iter().enumerate() {
        let mut off = 0;
        for p in &unit.params {
            let want = &params[u][off..off + p.numel()];
            let t32 = st.tensor(&p.name).unwrap();
            assert_eq!(
                (t32.dtype(), t32.shape()),
                (safetensors::Dtype::F32, p.shape.as_slice())
            );
            let got: Vec<f32> = t32
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{}",
                p.name
            );
            let t16 = half.tensor(&p.name).unwrap();
            assert_eq!(t16.dtype(), safetensors::Dtype::BF16);
            for (b, w) in t16.data().chunks_exact(2).zip(want) {
                assert_eq!(u16::from_le_bytes([b[0], b[1]]), f32_to_bf16(*w));
                assert!((bf16_to_f32(f32_to_bf16(*w)) - w).abs() <= w.abs() / 128.0);
            }
            let tm = opt.tensor(&format!("{}.exp_avg", p.name)).unwrap();
            let got_m: Vec<f32> = tm
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            assert_eq!(got_m, m[u][off..off + p.numel()].to_vec());
            off += p.numel();
        }
    }

    // --init from the fp32 export reproduces the checkpoint's weights exactly.
    let r = with(&["--steps", "0", "--init", s(&fp32)]);
    assert_eq!(ok(&r).sha(), loaded.manifest.param_sha256);
    assert_eq!(param_sha256(&params), loaded.manifest.param_sha256);
    ok(&with(&["--steps", "2", "--init", s(&bf16)]));
    // Weights of another model are refused, naming the tensor.
    let mut wider = gpt.to_vec();
    wider[6] = "32"; // --d-model 32
    let other = ezero(&[&wider[..], &["--steps", "1", "--init", s(&fp32)]].concat());
    refused(&other, "model.safetensors", "has shape");
    refused(
        &with(&["--resume", s(&root), "--init", s(&fp32)]),
        "--init",
        "--resume",
    );

    // An independent reader: the Python safetensors package, when installed.
    let expect = serde_json::json!({
        "fp32": fp32, "bf16": bf16, "optimizer": t.path().join("half.optimizer.safetensors"),
        "param_sha256": loaded.manifest.param_sha256,
        "params": units.iter().flat_map(|u| u.params.iter().map(|p| (p.name.clone(), p.shape.clone()))).collect::<Vec<_>>(),
        "state": loaded.manifest.optimizer.state,
    });
    let expect_path = t.path().join("expect.json");
    std::fs::write(&expect_path, expect.to_string()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/checkpoint_safetensors.py");
    match Command::new("python3")
        .arg(&script)
        .arg(&expect_path)
        .output()
    {
        Ok(out) => {
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            eprintln!("python safetensors: {}", text.trim());
        }
        Err(e) => eprintln!("skipped the Python safetensors check: no python3 ({e})"),
    }
}

#[derive(Default)]
struct Keep(Vec<Snapshot>);

impl Observer for &mut Keep {
    fn on_snapshot(&mut self, s: Snapshot) {
        self.0.push(s);
    }
}

fn run_lib(
    cfg: &TrainConfig,
    resume: Option<Snapshot>,
    every: u64,
    keep: &mut Keep,
) -> TrainOutcome {
    let spec = ClusterSpec {
        config: cfg.clone(),
        model: build_model(cfg).unwrap(),
        data: build_dataset(cfg).unwrap(),
        init_params: None,
        resume: resume.map(Into::into),
        snapshot_every: every,
        panic_at: None,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(train(spec, keep)).unwrap()
}

#[test]
fn the_rust_api_saves_in_the_background_and_loads_at_another_stage_and_chunk_size() {
    let cfg = TrainConfig {
        model: ModelKind::Gpt,
        layers: 1,
        d_model: 16,
        heads: 2,
        seq_len: 8,
        micro_batches: 3,
        micro_batch_size: 2,
        steps: 4,
        chunk_elems: 700,
        sample_tokens: 0,
        ranks: 3,
        stage: 3,
        ..TrainConfig::default()
    };
    let mut keep = Keep::default();
    let want = param_sha256(&run_lib(&cfg, None, 2, &mut keep).params);
    let t = tempfile::tempdir().unwrap();
    let model = build_model(&cfg).unwrap();
    let meta = CheckpointMeta::new(&cfg, model.as_ref(), &build_dataset(&cfg).unwrap()).unwrap();
    let writer =
        checkpoint::CheckpointWriter::spawn(t.path().to_path_buf(), meta, SaveOptions::default())
            .unwrap();
    for snap in keep.0.clone() {
        writer.submit(snap).unwrap();
    }
    let reports: Vec<_> = writer.finish().into_iter().map(Result::unwrap).collect();
    assert_eq!(
        reports.iter().map(|r| r.step).collect::<Vec<_>>(),
        vec![2, 4]
    );
    let loaded = checkpoint::load(&reports[0].dir).unwrap();
    assert_eq!(
        loaded.snapshot, keep.0[0],
        "a load returns the snapshot saved, bit for bit"
    );
    let other = TrainConfig {
        ranks: 2,
        stage: 0,
        chunk_elems: 64,
        ..cfg.clone()
    };
    let out = run_lib(&other, Some(loaded.snapshot), 0, &mut Keep::default());
    assert_eq!(param_sha256(&out.params), want);
}

#[test]
fn an_external_sigterm_mid_run_leaves_a_verified_checkpoint() {
    use std::io::{BufRead, BufReader};
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ck");
    let mut child = Command::new(env!("CARGO_BIN_EXE_ezero"))
        .args([
            "train",
            "--model",
            "mlp",
            "--layers",
            "1",
            "--d-model",
            "16",
            "--seq-len",
            "8",
            "--micro-batches",
            "2",
            "--micro-batch-size",
            "1",
            "--sample-tokens",
            "0",
            "--steps",
            "1000000",
            "--ranks",
            "2",
            "--save-dir",
            s(&root),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // The first progress line: training is under way.
    assert!(lines.any(|l| l.unwrap().starts_with("step ")));
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let rest: Vec<String> = lines.map(Result::unwrap).collect();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(128 + 15), "{rest:?}");
    assert!(
        rest.iter()
            .any(|l| l.starts_with("stopped by SIGTERM after step")),
        "{rest:?}"
    );
    let v = ezero(&["checkpoint", "verify", s(&root)]);
    assert!(ok(&v).stdout.starts_with("ok: "));
}

#[test]
fn a_checkpoint_taken_after_membership_changes_resumes_bit_for_bit() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ck");
    let want = ok(&train_cli(&["--steps", "6", "--ranks", "2"])).sha();
    // Rank 1 leaves at step 2 and two ranks join at step 3: the step-4 checkpoint is saved by
    // ranks {0, 2, 3, 4} under a later shard-map epoch.
    let r = train_cli(&[
        "--steps",
        "6",
        "--ranks",
        "3",
        "--leave",
        "1@2",
        "--join",
        "2@3",
        "--save-dir",
        s(&root),
        "--save-every",
        "4",
    ]);
    assert_eq!(ok(&r).sha(), want);
    let ins = ezero(&["checkpoint", "inspect", s(&step_dir(&root, 4)), "--json"]);
    let v: serde_json::Value = serde_json::from_str(ok(&ins).stdout.trim()).unwrap();
    let ranks: Vec<u64> = v["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["rank"].as_u64().unwrap())
        .collect();
    assert_eq!(ranks, vec![0, 2, 3, 4]);
    assert!(v["epoch"].as_u64().unwrap() > 1);
    for (ranks, stage) in [("1", "3"), ("5", "2")] {
        let resumed = ezero(&[
            "train",
            "--resume",
            s(&step_dir(&root, 4)),
            "--ranks",
            ranks,
            "--stage",
            stage,
            "--save-every",
            "0",
        ]);
        assert_eq!(ok(&resumed).sha(), want, "{ranks} ranks, ZeRO-{stage}");
    }
}
