//! Checkpoints with worker processes: `ezero launch` saves the same format as `ezero train`, a
//! run resumed under either continues bit for bit at another world size, `--init` starts both
//! from the same weights, and bad saved state is refused before any worker starts.

use crate::common;

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use common::ezero::{copy_dir, edit, ezero, ok, s, step_dir};
use common::procs::{
    coordinator, digest, flags_with, reference_digest, run, secrets, small, worker, Coordinator,
    Proc, DEADLINE, EZERO,
};

/// `ezero launch --nprocs N -- FLAGS`, which must succeed; its stdout.
fn launch(nprocs: u32, flags: &[String]) -> String {
    let (code, out, err) = run(Command::new(EZERO)
        .args(["launch", "--nprocs", &nprocs.to_string(), "--"])
        .args(flags));
    assert_eq!(code, 0, "launch {flags:?}:\n{out}\n{err}");
    out
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
}

/// Workers with state on their tiers: checkpoints stream from them a piece at a time into the
/// coordinator's save directory, verify, and resume in-process to the fault-free digest.
#[test]
fn a_launch_with_state_on_the_tier_streams_its_checkpoints() {
    let t = tempfile::tempdir().unwrap();
    let tier = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let want = reference_digest(2, &flags_with("gpt", 3, 4, &[]));
    let root = t.path().join("ck");
    let mut extra = vec!["--save-dir", s(&root), "--save-every", "2"];
    extra.extend(["--offload-optimizer", "nvme", "--offload-params", "nvme"]);
    extra.extend(["--nvme-dir", s(tier.path())]);
    let saved = launch(2, &flags_with("gpt", 3, 4, &extra));
    assert_eq!(
        saved.matches(", streamed from the tier").count(),
        2,
        "{saved}"
    );
    assert_eq!(digest(&saved).as_deref(), Some(want.as_str()), "{saved}");
    let at2 = step_dir(&root, 2);
    ok(&ezero(&["checkpoint", "verify", s(&at2)]));
    let resumed = ezero(&[
        "train",
        "--resume",
        s(&at2),
        "--ranks",
        "1",
        "--save-every",
        "0",
    ]);
    assert_eq!(ok(&resumed).sha(), want);
}

#[test]
fn a_launch_checkpoint_resumes_under_launch_and_train_and_the_reverse() {
    let t = tempfile::tempdir().unwrap();
    let want = reference_digest(2, &flags_with("mlp", 3, 4, &[]));

    // Two worker processes save at steps 2 and 4 of a 4-step run (a resumed run keeps the
    // checkpoint's step count: the schedule depends on it); saving must not disturb training.
    let root = t.path().join("launch-ck");
    let saved = launch(
        2,
        &flags_with("mlp", 3, 4, &["--save-dir", s(&root), "--save-every", "2"]),
    );
    assert_eq!(saved.matches("checkpoint: saved").count(), 2, "{saved}");
    assert_eq!(digest(&saved).as_deref(), Some(want.as_str()), "{saved}");
    let at2 = step_dir(&root, 2);
    ok(&ezero(&["checkpoint", "verify", s(&at2)]));
    // Resumed by two worker processes from step 2 to the end.
    let resumed = launch(2, &strings(&["--resume", s(&at2), "--save-every", "0"]));
    assert!(
        resumed.contains("at step 2 (saved by 2 ranks with ZeRO-3)"),
        "{resumed}"
    );
    assert!(
        resumed.contains("read each rank's owned chunks"),
        "{resumed}"
    );
    assert_eq!(
        digest(&resumed).as_deref(),
        Some(want.as_str()),
        "{resumed}"
    );

    // The same checkpoint under `ezero train`, with another world size and stage.
    let r = ezero(&[
        "train",
        "--resume",
        s(&at2),
        "--ranks",
        "3",
        "--stage",
        "1",
        "--save-every",
        "0",
    ]);
    assert_eq!(ok(&r).sha(), want, "train resumed a launch checkpoint");

    // And the reverse: saved by `ezero train` with three ranks at ZeRO-2, resumed by two
    // worker processes at ZeRO-1 (every worker then holds every chunk's parameters).
    let root = t.path().join("train-ck");
    let mut flags = flags_with("mlp", 2, 4, &["--save-dir", s(&root), "--save-every", "2"]);
    flags.splice(0..0, strings(&["train", "--ranks", "3"]));
    ok(&ezero(&flags));
    let resumed = launch(
        2,
        &strings(&[
            "--resume",
            s(&step_dir(&root, 2)),
            "--stage",
            "1",
            "--save-every",
            "0",
        ]),
    );
    assert_eq!(
        digest(&resumed).as_deref(),
        Some(want.as_str()),
        "{resumed}"
    );
}

#[test]
fn init_starts_launch_and_train_from_the_same_weights() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ck");
    let mut flags = flags_with("mlp", 3, 2, &["--save-dir", s(&root), "--save-every", "2"]);
    flags.splice(0..0, strings(&["train", "--ranks", "2"]));
    ok(&ezero(&flags));
    let weights = t.path().join("w.safetensors");
    ok(&ezero(&[
        "checkpoint",
        "export",
        s(&root),
        "--out",
        s(&weights),
    ]));
    let init = flags_with("mlp", 3, 3, &["--init", s(&weights)]);
    let want = reference_digest(3, &init);
    let fresh = reference_digest(3, &flags_with("mlp", 3, 3, &[]));
    assert_ne!(
        want, fresh,
        "the weights must matter for this test to mean anything"
    );
    let got = launch(2, &init);
    assert_eq!(digest(&got).as_deref(), Some(want.as_str()), "{got}");
}

/// Exit 2 from `launch -- --resume DIR`, naming `what`, with no training and no digest.
fn refused_launch(dir: &Path, what: &str) {
    let (code, out, err) =
        run(Command::new(EZERO).args(["launch", "--nprocs", "2", "--", "--resume", s(dir)]));
    assert_eq!(code, 2, "stdout:\n{out}\nstderr:\n{err}");
    assert!(err.contains(what), "want `{what}` in: {err}");
    assert!(err.contains("--resume") || err.contains(s(dir)), "{err}");
    assert!(
        !out.contains("param-sha256") && !out.contains("step "),
        "{out}"
    );
    assert!(!out.contains("ezero worker"), "no worker may start: {out}");
}

#[test]
fn a_missing_or_damaged_checkpoint_is_refused_before_any_worker_starts() {
    let t = tempfile::tempdir().unwrap();
    refused_launch(&t.path().join("nothing-here"), "nothing-here");

    let root = t.path().join("ck");
    let mut flags = flags_with("mlp", 3, 2, &["--save-dir", s(&root), "--save-every", "2"]);
    flags.splice(0..0, strings(&["train", "--ranks", "2"]));
    ok(&ezero(&flags));
    let good = step_dir(&root, 2);

    // A flipped byte inside a chunk file: the manifest is intact, so only the coordinator's
    // per-rank reads catch it, before it listens for workers.
    let flipped = t.path().join("flipped");
    copy_dir(&good, &flipped);
    let chunk_file = std::fs::read_dir(&flipped)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap() != "manifest.json")
        .unwrap();
    edit(&chunk_file, |b| {
        let mid = b.len() / 2;
        b[mid] ^= 0x40;
    });
    let name = chunk_file
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    refused_launch(&flipped, &name);

    // A damaged manifest is refused by the launcher itself.
    let bad_manifest = t.path().join("bad-manifest");
    copy_dir(&good, &bad_manifest);
    edit(&bad_manifest.join("manifest.json"), |b| {
        b.truncate(b.len() / 2)
    });
    refused_launch(&bad_manifest, "manifest.json");
}

/// `ezero coordinator` (with `coord_flags`) and `nprocs` workers, which must all succeed; the
/// coordinator's stdout.
fn coordinated(nprocs: u32, hooks: &[(&str, &str)], flags: &[String]) -> String {
    let token = "test-token-parts";
    let dir = secrets();
    let Coordinator {
        proc: mut coord,
        addr,
    } = Coordinator::spawn(
        coordinator(nprocs, token, dir.path())
            .envs(hooks.iter().copied())
            .args(flags),
    );
    let mut workers: Vec<Proc> = (0..nprocs)
        .map(|i| {
            Proc::spawn(worker(&addr, token, dir.path()).env("EZERO_RANK_HINT", i.to_string()))
        })
        .collect();
    let deadline = Instant::now() + DEADLINE;
    let status = coord.wait_until(deadline);
    let out: Vec<String> = coord.lines.iter().collect();
    let out = out.join("\n");
    assert!(
        status.is_some_and(|s| s.success()),
        "coordinator {status:?}:\n{out}\n{}",
        coord.stderr()
    );
    for (i, w) in workers.iter_mut().enumerate() {
        let status = w.wait_until(deadline);
        assert!(
            status.is_some_and(|s| s.success()),
            "worker {i}: {}",
            w.stderr()
        );
    }
    out
}

/// A part size far below a rank's state (two ranks own about 200 KB of Adam state each here),
/// so the saved and the resumed state cross the control connections in many parts, each chunk
/// (12 KB with Adam, 4 KB of parameters alone) in a part of at most two.
#[test]
fn state_sent_in_many_small_parts_arrives_whole() {
    let t = tempfile::tempdir().unwrap();
    let want = reference_digest(2, &flags_with("mlp", 3, 4, &[]));
    let parts = [("EZERO_TEST_HOOK_STATE_PART_MAX_BYTES", "25000")];
    let root = t.path().join("ck");
    let saved = coordinated(
        2,
        &parts,
        &flags_with("mlp", 3, 4, &["--save-dir", s(&root), "--save-every", "2"]),
    );
    assert_eq!(digest(&saved).as_deref(), Some(want.as_str()), "{saved}");
    let at2 = step_dir(&root, 2);
    ok(&ezero(&["checkpoint", "verify", s(&at2)]));
    // Three workers at ZeRO-1: each is sent every chunk's parameters and its own chunks' state.
    let resumed = coordinated(
        3,
        &parts,
        &strings(&["--resume", s(&at2), "--stage", "1", "--save-every", "0"]),
    );
    assert_eq!(
        digest(&resumed).as_deref(),
        Some(want.as_str()),
        "{resumed}"
    );

    let (code, _, err) = run(coordinator(2, "t", t.path())
        .env("EZERO_TEST_HOOK_STATE_PART_MAX_BYTES", "0")
        .args(small("mlp", 3)));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("state_part_max_bytes"), "{err}");
}

#[test]
fn sigterm_to_launch_saves_at_the_next_step_boundary() {
    use std::io::{BufRead, BufReader};
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ck");
    let mut child = Command::new(EZERO)
        .args(["launch", "--nprocs", "2", "--"])
        .args(flags_with("mlp", 3, 2000, &["--save-dir", s(&root)]))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // A step line: training is under way.
    let started = Instant::now();
    assert!(lines.any(|l| l.unwrap().starts_with("step ")));
    assert!(started.elapsed() < DEADLINE);
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    // The launcher passes the signal on: the coordinator saves, stops its workers and exits,
    // and so does the launcher. One that did not would finish all 2000 steps, exit 0 and save
    // nothing (no --save-every).
    let rest: Vec<String> = lines.map(Result::unwrap).collect();
    let status = child.wait().unwrap();
    assert_ne!(status.code(), Some(0), "{rest:?}");
    assert!(
        rest.iter()
            .any(|l| l.starts_with("stopped by SIGTERM after step")
                && l.ends_with(&format!(
                    "resume with: ezero launch --nprocs 2 -- --resume {}",
                    root.display()
                ))),
        "{rest:?}"
    );
    let v = ezero(&["checkpoint", "verify", s(&root)]);
    assert!(ok(&v).stdout.starts_with("ok: "));
}
