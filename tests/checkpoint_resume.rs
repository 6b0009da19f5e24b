//! Checkpoints through the `ezero` binary and the Rust API resume bit for bit: at any world
//! size and stage, after SIGTERM, after a crash during a save, and after membership changes.

use crate::common;

use std::process::Command;

use common::ezero::{ezero, ok, refused, s, step_dir, train_cli, train_cli_hooked};
use common::train_blocking;
use elastic_zero::checkpoint::{self, CheckpointMeta, SaveOptions};
use elastic_zero::config::{ModelKind, TrainConfig};
use elastic_zero::job::{build_dataset, build_model};
use elastic_zero::runtime::actors::Snapshot;
use elastic_zero::runtime::api::cluster::Observer;
use elastic_zero::runtime::{ClusterSpec, TrainOutcome};
use elastic_zero::summary::param_sha256;

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

/// Flags that put the optimizer state on a tier in `dir`.
fn optimizer_on_tier(dir: &std::path::Path) -> [&str; 4] {
    ["--offload-optimizer", "nvme", "--nvme-dir", s(dir)]
}

/// From a snapshot in RAM and streamed off the tier alike.
#[test]
fn sigterm_saves_at_the_next_step_boundary_and_the_run_resumes() {
    let want = ok(&train_cli(&["--steps", "5", "--ranks", "2"])).sha();
    for tier in [false, true] {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("ck");
        let tier_dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let mut args = vec!["--steps", "5", "--ranks", "3", "--stage", "2"];
        args.extend(["--save-dir", s(&root)]);
        if tier {
            args.extend(optimizer_on_tier(tier_dir.path()));
        }
        let r = train_cli_hooked(&args, Some(("EZERO_TEST_HOOK_SIGTERM_AT", "2")));
        assert_eq!(r.code, 128 + 15, "{}\n{}", r.stdout, r.stderr);
        assert!(
            r.stdout.contains("stopped by SIGTERM after step 2"),
            "{}",
            r.stdout
        );
        assert_eq!(
            r.stdout.contains(", streamed from the tier"),
            tier,
            "{}",
            r.stdout
        );
        assert!(!r.stdout.contains("param-sha256"));
        ok(&ezero(&["checkpoint", "verify", s(&step_dir(&root, 2))]));
        let resumed = ezero(&["train", "--resume", s(&root), "--ranks", "1"]);
        assert_eq!(ok(&resumed).sha(), want, "tier: {tier}");
    }
}

/// At every crash point of the save sequence, for saves written from a snapshot in RAM and for
/// saves streamed off the tier while the ranks wait.
#[test]
fn a_crash_during_a_save_leaves_a_complete_checkpoint_that_resumes() {
    let want = ok(&train_cli(&["--steps", "6"])).sha();
    for tier in [false, true] {
        crash_during_saves(&want, tier);
    }
}

fn crash_during_saves(want: &str, tier: bool) {
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
        // The tier must be on a real disk (the temp dir may be tmpfs, which it refuses).
        let tier_dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let mut args = vec![
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
        ];
        if tier {
            args.extend(optimizer_on_tier(tier_dir.path()));
        }
        let r = train_cli_hooked(&args, Some(("EZERO_TEST_HOOK_CHECKPOINT_CRASH", &crash)));
        let point = format!("{point} (tier: {tier})");
        assert!(
            r.code != 0 && !r.stdout.contains("param-sha256"),
            "{point}: {}",
            r.stdout
        );
        assert_eq!(
            r.stdout.contains(", streamed from the tier"),
            tier,
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
        resume: resume.map(Into::into),
        snapshot_every: every,
        ..ClusterSpec::from_config(cfg.clone()).unwrap()
    };
    train_blocking(spec, keep).unwrap()
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
