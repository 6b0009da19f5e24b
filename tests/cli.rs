//! The `ezero` binary: bad input, failures, the JSON summary and the default job.

use std::process::Command;

fn ezero() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ezero"))
}

/// Runs `ezero train` with `args`; returns (exit code, stdout, stderr).
fn train(args: &[&str]) -> (i32, String, String) {
    train_hooked(args, None)
}

/// `train` with a test hook (`EZERO_TEST_HOOK_*`, see `src/cli/test_hooks.rs`) set.
fn train_hooked(args: &[&str], hook: Option<(&str, &str)>) -> (i32, String, String) {
    let mut cmd = ezero();
    if let Some((name, value)) = hook {
        cmd.env(name, value);
    }
    let out = cmd.arg("train").args(args).output().expect("ezero runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

const SMALL: &[&str] = &[
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
    "--steps",
    "2",
    "--sample-tokens",
    "0",
];

#[test]
fn bad_input_is_one_line_exit_2_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let short = dir.path().join("short.txt");
    std::fs::write(&short, "tiny").unwrap();
    let unknown = dir.path().join("bad.toml");
    std::fs::write(&unknown, "ranks = 2\nbogus_key = 1\n").unwrap();
    let fp16 = dir.path().join("fp16.toml");
    std::fs::write(&fp16, "ranks = 2\nprecision = \"fp16\"\n").unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["--stage".into(), "4".into()], "stage"),
        (vec!["--ranks".into(), "0".into()], "ranks"),
        (
            vec![
                "--model".into(),
                "gpt".into(),
                "--d-model".into(),
                "30".into(),
                "--heads".into(),
                "4".into(),
            ],
            "heads",
        ),
        (
            vec!["--data".into(), "/nonexistent/corpus.txt".into()],
            "data",
        ),
        (
            vec![
                "--data".into(),
                short.display().to_string(),
                "--seq-len".into(),
                "8".into(),
            ],
            "data",
        ),
        (
            vec!["--config".into(), unknown.display().to_string()],
            "bogus_key",
        ),
        (
            vec!["--config".into(), fp16.display().to_string()],
            "`precision`: ",
        ),
    ];
    for (extra, field) in cases {
        let mut args: Vec<String> = vec!["--json".into(), json.display().to_string()];
        args.extend(extra.clone());
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, _, err) = train(&refs);
        assert_eq!(code, 2, "{extra:?}: {err}");
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 1, "{extra:?}: {err}");
        assert!(lines[0].contains(field), "{extra:?}: {err}");
        assert!(!err.contains("panicked"));
        assert!(!json.exists(), "{extra:?} left a JSON file");
    }
}

#[test]
fn a_panicking_rank_is_recovered_from_or_stops_the_run_with_a_clear_error() {
    // With buddy backups (on by default when a fault is injected) the lost rank's state survives: training goes on and
    // ends where a run without the fault ends.
    let plain = [
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
        "--steps",
        "3",
        "--sample-tokens",
        "0",
        "--ranks",
        "3",
    ];
    let (code, want, err) = train(&plain);
    assert_eq!(code, 0, "{err}");
    let mut faulty = plain.to_vec();
    let panic_at = Some(("EZERO_TEST_HOOK_PANIC_AT", "1@1"));
    let (code, out, err) = train_hooked(&faulty, panic_at);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("lost ranks [1]"), "{out}");
    assert_eq!(out.lines().last(), want.lines().last());
    // Without backups the run stops, names the rank and says what to do.
    faulty.extend(["--replicate-every", "0"]);
    let (code, _, err) = train_hooked(&faulty, panic_at);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("rank 1") && err.contains("panicked") && err.contains("checkpoint"),
        "{err}"
    );
}

/// In one process buddy backups cost two copies of each rank's state and survive only the loss
/// of a rank actor, so by default they are on only when the run can lose one alone; an
/// explicit flag always wins. The banner says which and why.
#[test]
fn in_process_backups_are_on_by_default_only_when_a_rank_can_be_lost_alone() {
    let with = |extra: &[&str]| {
        let args: Vec<&str> = SMALL
            .iter()
            .chain(["--ranks", "3"].iter())
            .chain(extra)
            .copied()
            .collect();
        let (code, out, err) = train(&args);
        assert_eq!(code, 0, "{extra:?}: {out}\n{err}");
        out
    };
    let plain = with(&[]);
    assert!(plain.contains("buddy backups: off"), "{plain}");
    assert!(
        !plain
            .lines()
            .any(|l| l.starts_with("memory:") && l.contains("buddy backups")),
        "{plain}"
    );
    let killed = with(&["--kill", "1@1"]);
    assert!(killed.contains("buddy backups: on"), "{killed}");
    assert!(killed.contains("lost ranks [1]"), "{killed}");
    // The same bits as the run without the loss.
    assert_eq!(plain.lines().last(), killed.lines().last());
    // An explicit choice is not second-guessed, and the banner says nothing of a default.
    let asked = with(&["--replicate-every", "1"]);
    assert!(!asked.contains("buddy backups: "), "{asked}");
    assert!(
        asked
            .lines()
            .any(|l| l.starts_with("memory:") && l.contains("buddy backups")),
        "{asked}"
    );
}

#[test]
fn json_summary_has_the_documented_fields() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("s.json");
    let mut args = SMALL.to_vec();
    let j = json.display().to_string();
    args.extend(["--ranks", "2", "--json", &j]);
    let (code, out, err) = train(&args);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for key in [
        "param_count",
        "final_loss",
        "step_time_median_s",
        "tokens_per_s",
        "ranks",
        "param_sha256",
    ] {
        assert!(v.get(key).is_some(), "missing {key}");
    }
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    for r in ranks {
        for key in ["rank", "peak_bytes", "bytes_sent_per_step"] {
            assert!(r.get(key).is_some(), "missing ranks[].{key}");
        }
        for key in ["params", "grads", "optimizer"] {
            assert!(
                r["resident_bytes"][key].as_u64().unwrap() > 0,
                "resident_bytes.{key}"
            );
        }
        // Where the rank's step went: measured, so positive where the rank did that work.
        let secs = |k: &str| {
            r[k].as_f64()
                .unwrap_or_else(|| panic!("missing ranks[].{k}"))
        };
        assert!(secs("compute_s_per_step") > 0.0);
        assert!(secs("optimizer_s_per_step") > 0.0);
        assert!(secs("collectives_s_per_step") >= 0.0);
        assert!(secs("outside_s_per_step") >= 0.0);
        let parts = secs("compute_s_per_step")
            + secs("optimizer_s_per_step")
            + secs("collectives_s_per_step");
        assert!(parts > 0.0);
    }
    // Model FLOPs utilisation is the model's to count: the MLP does not, so it is 0; the GPT's
    // is checked in `mfu_is_reported_for_the_gpt`.
    assert_eq!(v["model_flops_per_step"], 0);
    let step = out
        .lines()
        .find(|l| l.starts_with("step "))
        .expect("a progress line");
    for part in [
        "[compute ",
        "% collectives ",
        "% optimizer ",
        "% coordinator+idle ",
    ] {
        assert!(step.contains(part), "{step}");
    }
    let last = out.lines().last().unwrap();
    assert_eq!(
        last,
        format!("param-sha256: {}", v["param_sha256"].as_str().unwrap())
    );
    assert_eq!(last.len(), "param-sha256: ".len() + 64);
}

#[test]
fn config_file_and_flags_agree_and_flags_win() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("job.toml");
    std::fs::write(&cfg, "model = \"mlp\"\nlayers = 1\nd_model = 16\nseq_len = 8\nmicro_batches = 4\nmicro_batch_size = 2\nsteps = 2\nsample_tokens = 0\nranks = 1\n").unwrap();
    let c = cfg.display().to_string();
    let (code, from_file, err) = train(&["--config", &c, "--ranks", "3", "--stage", "1"]);
    assert_eq!(code, 0, "{err}");
    let (_, from_flags, _) = train(
        &SMALL
            .iter()
            .copied()
            .chain(["--ranks", "3", "--stage", "1"])
            .collect::<Vec<_>>(),
    );
    assert_eq!(from_file.lines().last(), from_flags.lines().last());
    assert!(from_file.contains("on 3 rank actors"));
}

#[test]
fn the_default_job_trains_and_its_loss_falls() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("default.json");
    let j = json.display().to_string();
    let (code, out, err) = train(&["--json", &j]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("ZeRO-3 on 4 rank actors"), "{out}");
    assert!(out.contains("sample: "), "{out}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let losses: Vec<f64> = v["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let floor = v["entropy_floor_nats"].as_f64().unwrap();
    let first = losses[0];
    let last = *losses.last().unwrap();
    // From ln(256) = 5.55 towards the source's entropy rate: most of the gap must close.
    assert!(first > 5.0, "first loss {first}");
    assert!(
        last < floor + 0.25 * (first - floor),
        "loss {first} -> {last}, floor {floor}"
    );
}

/// `bench collectives --transport tcp` runs every op over the TCP data plane (mutual TLS, or
/// without it with `--plaintext`, labelled so) and reports each.
#[test]
fn bench_collectives_over_tcp_reports_every_op() {
    for (extra, label) in [(&[][..], "tcp"), (&["--plaintext"][..], "tcp-plaintext")] {
        let out = ezero()
            .args([
                "bench",
                "collectives",
                "--transport",
                "tcp",
                "--nprocs",
                "2",
            ])
            .args(["--bytes", "64K", "--iters", "2"])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        let ops: Vec<String> = text
            .lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                assert_eq!(v["transport"], label);
                assert!(v["busbw_gbps"].as_f64().unwrap() > 0.0);
                v["op"].as_str().unwrap().to_string()
            })
            .collect();
        assert_eq!(
            ops,
            ["all_gather", "reduce_scatter", "all_reduce", "broadcast"]
        );
    }
}

/// `auto` keeps activations when they fit the budget (and, at this size, add less than a
/// quarter to the memory) and recomputes when only recomputing fits, says which at start,
/// and trains to the same bits either way; `always` and `--keep-activations` together are
/// refused.
#[test]
fn activation_checkpointing_auto_follows_the_budget() {
    let base = [
        "--layers",
        "2",
        "--d-model",
        "256",
        "--heads",
        "2",
        "--seq-len",
        "64",
        "--ranks",
        "2",
        "--micro-batches",
        "2",
        "--micro-batch-size",
        "1",
        "--steps",
        "2",
        "--sample-tokens",
        "0",
    ];
    let run = |extra: &[&str]| {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let (code, out, err) = train(&args);
        assert_eq!(code, 0, "{out}\n{err}");
        out
    };
    let line = |out: &str, prefix: &str| -> String {
        out.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} line in\n{out}"))
            .to_string()
    };
    let mib_after = |l: &str, key: &str| -> f64 {
        let rest = &l[l.find(key).unwrap_or_else(|| panic!("{key:?} in {l}")) + key.len()..];
        rest.trim_start()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let digest = |out: &str| line(out, "param-sha256: ");

    let kept = run(&[]);
    let act = line(&kept, "activations: ");
    assert!(act.starts_with("activations: kept (auto"), "{act}");
    let (keep_mib, recompute_mib) = (
        mib_after(&act, "),"),
        mib_after(&act, "recomputing would need"),
    );
    assert!(keep_mib > recompute_mib, "{act}");
    let total_mib = mib_after(&line(&kept, "memory: "), "about");
    // A budget halfway between what recomputing and keeping need for the 2 ranks.
    let budget_mib = total_mib - (keep_mib - recompute_mib);
    let budget = format!("{}KiB", (budget_mib * 1024.0) as u64);
    let recomputed = run(&["--memory-max", &budget]);
    let act = line(&recomputed, "activations: ");
    assert!(act.starts_with("activations: recomputed (auto"), "{act}");
    assert!(line(&recomputed, "memory: ").contains("all state in RAM"));
    assert_eq!(digest(&recomputed), digest(&kept));

    let forced = run(&["--activation-checkpointing", "always"]);
    assert!(
        line(&forced, "activations: ").contains("recomputed (activation_checkpointing = always)")
    );
    let (code, _, err) = train(&["--activation-checkpointing", "always", "--keep-activations"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("keep_activations"), "{err}");
}

/// The GPT counts its FLOPs: the summary's model FLOPs are three forwards' worth (checked
/// against the formula), and MFU is their rate over the GEMM peak measured in the same run.
#[test]
fn mfu_is_reported_for_the_gpt() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("s.json");
    let j = json.display().to_string();
    let (code, out, err) = train(&[
        "--layers",
        "2",
        "--d-model",
        "64",
        "--heads",
        "2",
        "--seq-len",
        "32",
        "--ranks",
        "2",
        "--micro-batches",
        "2",
        "--micro-batch-size",
        "2",
        "--steps",
        "6",
        "--sample-tokens",
        "0",
        "--json",
        &j,
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let (d, l, s, vocab, tokens) = (64u64, 2u64, 32u64, 256u64, 2 * 2 * 32u64);
    let forward = tokens * (2 * l * (12 * d * d + 2 * s * d) + 2 * d * vocab);
    assert_eq!(v["model_flops_per_step"].as_u64(), Some(3 * forward));
    let (rate, peak, mfu) = (
        v["model_gflops_per_s"].as_f64().unwrap(),
        v["gemm_peak_gflops"].as_f64().unwrap(),
        v["mfu"].as_f64().unwrap(),
    );
    assert!(rate > 0.0 && peak > 0.0 && mfu > 0.0, "{rate} {peak} {mfu}");
    let step = v["step_time_median_s"].as_f64().unwrap();
    assert!((rate - 3.0 * forward as f64 / step / 1e9).abs() <= 1e-9 * rate.max(1.0));
    assert!(
        out.contains("model FLOPs: ") && out.contains("MFU "),
        "{out}"
    );
}

/// A build without the `ucx` feature says how to get it.
#[cfg(not(feature = "ucx"))]
#[test]
fn transport_ucx_without_the_feature_says_how_to_build_it() {
    let out = ezero()
        .args(["launch", "--transport", "ucx", "--nprocs", "2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("`ucx` cargo feature"), "{err}");
}
