//! Evaluation during training and the live view of a run: `--eval-every` gives, after the steps
//! it names, the loss `job::eval::evaluate` computes on the parameters of that step (gathered
//! a unit at a time at stage 3, off the tier when the state lives there, and in worker
//! processes), without changing the training bits; `GET /history` and the page at `GET /`.

use std::path::Path;

use crate::common;

use common::ezero::{ezero, ok, refused, s};
use common::{small, train_blocking};
use elastic_zero::config::{At, ModelKind, TrainConfig};
use elastic_zero::engine::coordinator::StepRecord;
use elastic_zero::runtime::api::cluster::{consolidate, Observer};
use elastic_zero::runtime::step::elastic::snapshot::Snapshot;
use elastic_zero::runtime::{Cluster, ClusterSpec};

const EVAL_TEXT: &str = "a lazy dog sleeps; the fox runs on and on. ";

fn eval_file(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("eval.txt");
    std::fs::write(&p, EVAL_TEXT.repeat(12)).unwrap();
    p
}

/// A 2-layer GPT on 2 ranks that evaluates every 2 of 5 steps (and after the last).
fn config(stage: u8, eval: &Path) -> TrainConfig {
    TrainConfig {
        stage,
        ranks: 2,
        steps: 5,
        eval_data: Some(eval.to_path_buf()),
        eval_every: 2,
        ..small(ModelKind::Gpt)
    }
}

/// Keeps every step record and every snapshot's consolidated parameters (by steps done).
#[derive(Default)]
struct Keep {
    records: Vec<StepRecord>,
    params: Vec<(u64, Vec<Vec<f32>>)>,
}

impl Observer for &mut Keep {
    fn on_step(&mut self, rec: &StepRecord) {
        self.records.push(rec.clone());
    }

    fn on_snapshot(&mut self, snap: Snapshot) {
        let done = snap.progress.step;
        self.params
            .push((done, consolidate(&snap.map, &snap.chunks)));
    }
}

/// The eval losses of a run, by steps done.
fn evals(records: &[StepRecord]) -> Vec<(u64, f64)> {
    records
        .iter()
        .filter_map(|r| r.eval_loss.map(|l| (r.step + 1, l)))
        .collect()
}

/// At every stage (stage 3 gathering a unit at a time, one unit live at once): the eval loss
/// after steps 2, 4 and 5 is, bit for bit, `job::eval::evaluate` on the parameters of the
/// snapshot at that step; and the final parameters are those of the run without evaluation.
#[test]
fn eval_every_n_steps_is_the_oracle_loss_and_changes_no_training_bit() {
    use elastic_zero::job::{build_eval_dataset, build_model, eval::evaluate};
    let t = tempfile::tempdir().unwrap();
    let eval = eval_file(t.path());
    for (stage, live) in [(0u8, 2usize), (2, 2), (3, 1), (3, 2)] {
        let cfg = TrainConfig {
            max_live_units: live,
            ..config(stage, &eval)
        };
        let mut spec = ClusterSpec::from_config(cfg.clone()).unwrap();
        spec.snapshot_every = 2;
        let mut keep = Keep::default();
        let out = train_blocking(spec, &mut keep).unwrap();
        let got = evals(&keep.records);
        assert_eq!(
            got.iter().map(|e| e.0).collect::<Vec<_>>(),
            [2, 4, 5],
            "stage {stage}"
        );
        let model = build_model(&cfg).unwrap();
        let data = build_eval_dataset(&cfg).unwrap().unwrap();
        for (done, loss) in &got {
            let (_, params) = keep.params.iter().find(|(s, _)| s == done).unwrap();
            let want = evaluate(model.as_ref(), params, &cfg, &data);
            assert_eq!(
                loss.to_bits(),
                want.loss.to_bits(),
                "stage {stage} live {live} after step {done}: {loss} vs {}",
                want.loss
            );
        }
        let plain = TrainConfig {
            eval_data: None,
            eval_every: 0,
            ..cfg.clone()
        };
        let base = common::run_cfg(&plain).unwrap();
        assert_eq!(out.param_sha256, base.param_sha256, "stage {stage}");
        assert!(base.records.iter().all(|r| r.eval_loss.is_none()));
    }
}

/// With the state on the NVMe tier (stage 3's parameter shards read off it for the gathers,
/// as the forward reads them) the eval losses are the in-RAM run's, bit for bit.
#[test]
fn eval_with_state_on_the_tier_is_the_in_ram_eval() {
    let t = tempfile::tempdir().unwrap();
    let eval = eval_file(t.path());
    let dir = crate::offload::tier_dir();
    let cfg = config(3, &eval);
    let ram = common::run_cfg(&cfg).unwrap();
    let tier = common::run_cfg(&crate::offload::offloaded(&cfg, dir.path(), true, true)).unwrap();
    assert_eq!(evals(&ram.records).len(), 3);
    assert_eq!(evals(&tier.records), evals(&ram.records));
    assert_eq!(tier.param_sha256, ram.param_sha256);
}

/// Through a membership change (rank 1 leaves after step 2, a rank joins after step 3) the
/// evaluation follows the members and gives the losses of the run without the changes.
#[test]
fn eval_follows_membership_changes() {
    let t = tempfile::tempdir().unwrap();
    let eval = eval_file(t.path());
    let cfg = config(3, &eval);
    let changed = TrainConfig {
        leave: vec![At { step: 2, value: 1 }],
        join: vec![At { step: 3, value: 2 }],
        ..cfg.clone()
    };
    let a = common::run_cfg(&cfg).unwrap();
    let b = common::run_cfg(&changed).unwrap();
    assert_eq!(evals(&b.records), evals(&a.records));
    assert_eq!(b.param_sha256, a.param_sha256);
}

/// The CLI: the progress line and the JSON summary carry every evaluation; `--eval-every`
/// without `--eval-data` is refused before training.
#[test]
fn the_cli_reports_every_evaluation() {
    let t = tempfile::tempdir().unwrap();
    let eval = eval_file(t.path());
    let (json, log) = (t.path().join("run.json"), t.path().join("log.jsonl"));
    let r = ezero(&[
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
        "--steps",
        "4",
        "--ranks",
        "2",
        "--stage",
        "3",
        "--sample-tokens",
        "0",
        "--eval-data",
        s(&eval),
        "--eval-every",
        "3",
        "--json",
        s(&json),
        "--metrics-file",
        s(&log),
    ]);
    ok(&r);
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let history = summary["eval"].as_array().unwrap();
    let steps: Vec<u64> = history
        .iter()
        .map(|e| e["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [3, 4]);
    let last = history[1]["loss"].as_f64().unwrap();
    assert_eq!(summary["eval_loss"].as_f64(), Some(last));
    let ppl = history[0]["perplexity"].as_f64().unwrap();
    assert!((ppl - history[0]["loss"].as_f64().unwrap().exp()).abs() < 1e-9 * ppl);
    let lines: Vec<&str> = r.stdout.lines().filter(|l| l.contains(" eval ")).collect();
    assert!(
        lines.iter().any(|l| l.starts_with("step     3/4")),
        "{}",
        r.stdout
    );
    let records: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(records[0]["eval_loss"].is_null());
    assert_eq!(records[3]["eval_loss"].as_f64(), Some(last));
    let r = ezero(&["train", "--steps", "2", "--eval-every", "2"]);
    refused(&r, "eval_every", "needs eval_data");
}

/// `ezero launch`: the workers evaluate as the in-process ranks do, with the same losses.
#[test]
fn launch_evaluates_as_the_in_process_run() {
    let t = tempfile::tempdir().unwrap();
    let eval = eval_file(t.path());
    let flags = [
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
        "--steps",
        "3",
        "--stage",
        "3",
        "--sample-tokens",
        "0",
        "--eval-every",
        "2",
        "--eval-data",
        s(&eval),
    ];
    let (ours, our_log) = (t.path().join("in.json"), t.path().join("in.jsonl"));
    let mut args = vec!["train", "--ranks", "2", "--json", s(&ours)];
    args.extend(["--metrics-file", s(&our_log)]);
    args.extend(flags);
    ok(&ezero(&args));
    let (theirs, their_log) = (t.path().join("launch.json"), t.path().join("launch.jsonl"));
    let mut args = vec!["launch", "--nprocs", "2", "--", "--json", s(&theirs)];
    args.extend(["--metrics-file", s(&their_log)]);
    args.extend(flags);
    let r = ezero(&args);
    ok(&r);
    assert!(r.stdout.contains("eval: loss"), "{}", r.stdout);
    let read = |p: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    let (a, b) = (read(&ours), read(&theirs));
    assert_eq!(a["eval"].as_array().unwrap().len(), 2);
    assert_eq!(a["eval"], b["eval"]);
    assert_eq!(a["param_sha256"], b["param_sha256"]);
    // The coordinator writes the run log as the in-process run does: one record a step, the
    // same losses, learning rates and evaluations (times differ).
    let records = |p: &Path| -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(p).unwrap();
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let (ra, rb) = (records(&our_log), records(&their_log));
    assert_eq!(ra.len(), 3);
    assert_eq!(ra.len(), rb.len());
    for (x, y) in ra.iter().zip(&rb) {
        for key in ["step", "loss", "lr", "grad_norm", "members", "eval_loss"] {
            assert_eq!(x[key], y[key], "{key}: {x} vs {y}");
        }
    }
}

/// `GET /history` over a run with a membership change: one point per step with its loss,
/// learning rate, throughput, members and epoch, the eval losses where it evaluated, and the
/// change as an event; `GET /` serves the page that reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_and_page_over_http() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let t = tempfile::tempdir().unwrap();
    let eval = eval_file(t.path());
    let cfg = TrainConfig {
        ranks: 3,
        steps: 4,
        leave: vec![At { step: 2, value: 2 }],
        ..config(2, &eval)
    };
    let spec = ClusterSpec::from_config(cfg.clone()).unwrap();
    let mut job = Cluster::builder(spec)
        .control_addr("127.0.0.1:0".parse().unwrap())
        .start()
        .await
        .unwrap();
    let addr = job.control_addr().unwrap();
    job.run();
    while let Some(ev) = job.next_event().await {
        match ev {
            elastic_zero::runtime::actors::ClusterEvent::Finished => break,
            elastic_zero::runtime::actors::ClusterEvent::Aborted(why) => panic!("{why}"),
            _ => {}
        }
    }
    let get = |target: &'static str| async move {
        let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!("GET {target} HTTP/1.1\r\nHost: test\r\n\r\n");
        sock.write_all(req.as_bytes()).await.unwrap();
        let mut text = String::new();
        sock.read_to_string(&mut text).await.unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        (head.to_string(), body.to_string())
    };
    let (head, body) = get("/history").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let h: serde_json::Value = serde_json::from_str(&body).unwrap();
    let steps = h["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 4);
    let members: Vec<u64> = steps
        .iter()
        .map(|p| p["members"].as_u64().unwrap())
        .collect();
    assert_eq!(members, [3, 3, 2, 2]);
    let schedule = elastic_zero::job::lr_schedule(&cfg);
    for (i, p) in steps.iter().enumerate() {
        assert_eq!(p["step"], i as u64 + 1);
        assert_eq!(
            p["lr"].as_f64().unwrap() as f32,
            schedule.lr_at(i as u64 + 1)
        );
        assert!(p["loss"].as_f64().unwrap() > 0.0 && p["tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(p["grad_norm"].as_f64().unwrap() > 0.0 && p["step_s"].as_f64().is_some());
        assert!(p["t_s"].as_f64().unwrap() >= 0.0);
    }
    assert!(steps[2]["epoch"].as_u64() > steps[1]["epoch"].as_u64());
    let evaluated: Vec<u64> = steps
        .iter()
        .filter(|p| p["eval_loss"].is_f64())
        .map(|p| p["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evaluated, [2, 4]);
    let events = h["events"].as_array().unwrap();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["kind"], "membership");
    assert_eq!(events[0]["after"], serde_json::json!([0, 1]));
    assert_eq!(h["steps_max"], 10_000);
    let (head, page) = get("/").await;
    assert!(head.contains("Content-Type: text/html"), "{head}");
    assert!(page.contains("/history"));
    let (_, metrics) = get("/metrics").await;
    for name in [
        "ezero_train_loss ",
        "ezero_learning_rate ",
        "ezero_eval_loss ",
    ] {
        assert!(metrics.contains(name), "{name}: {metrics}");
    }
    let (_, status) = get("/status").await;
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["telemetry"]["eval_last"]["step"], 4);
    job.finish().await.unwrap();
}
