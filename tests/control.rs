//! The control API end to end: the HTTP endpoint on 127.0.0.1:0 over a real cluster, and the
//! Rust handle it is a thin layer over. Drains and kills end with the same parameters as a run
//! without them; refusals are JSON errors with a 4xx status and change nothing.

use crate::common;

use common::small;
use elastic_zero::config::{ModelKind, TrainConfig};
use elastic_zero::runtime::actors::ClusterEvent;
use elastic_zero::runtime::{Cluster, ClusterSpec, ControlError, ElasticJob, TrainOutcome};
use elastic_zero::summary::param_sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn config(steps: u64, ranks: u32) -> TrainConfig {
    TrainConfig {
        steps,
        ranks,
        ..small(ModelKind::Mlp)
    }
}

/// The final parameters' digest of `cfg` run without any control request.
async fn baseline(cfg: &TrainConfig) -> String {
    let spec = ClusterSpec::from_config(cfg.clone()).unwrap();
    param_sha256(&elastic_zero::runtime::train(spec, ()).await.unwrap().params)
}

/// One request, one answer: (status, body).
async fn http(job: &ElasticJob, method: &str, target: &str) -> (u16, String) {
    let addr = job.control_addr().expect("the endpoint is on");
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("{method} {target} HTTP/1.1\r\nHost: test\r\nContent-Length: 0\r\n\r\n");
    sock.write_all(req.as_bytes()).await.unwrap();
    let mut text = String::new();
    sock.read_to_string(&mut text).await.unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("a complete response");
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, body.to_string())
}

async fn json(job: &ElasticJob, method: &str, target: &str) -> (u16, serde_json::Value) {
    let (status, body) = http(job, method, target).await;
    (status, serde_json::from_str(&body).expect("a JSON body"))
}

async fn start(cfg: &TrainConfig, allow_kill: bool, paused: bool) -> ElasticJob {
    let spec = ClusterSpec::from_config(cfg.clone()).unwrap();
    Cluster::builder(spec)
        .control_addr("127.0.0.1:0".parse().unwrap())
        .allow_kill(allow_kill)
        .paused(paused)
        .start()
        .await
        .unwrap()
}

/// Runs the job to the end, returning the outcome and every membership change seen.
async fn finish(
    mut job: ElasticJob,
) -> (
    TrainOutcome,
    Vec<elastic_zero::engine::coordinator::MembershipRecord>,
) {
    job.run();
    let mut changes = Vec::new();
    while let Some(ev) = job.next_event().await {
        match ev {
            ClusterEvent::Membership(m) => changes.push(*m),
            ClusterEvent::Finished => break,
            ClusterEvent::Aborted(why) => panic!("the run stopped: {why}"),
            _ => {}
        }
    }
    (job.finish().await.unwrap(), changes)
}

/// Reads the Prometheus text format strictly: every sample line is `name{labels} value`.
fn samples(text: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (name, value) = l.rsplit_once(' ').expect("name value");
            let value: f64 = value.parse().expect("a number");
            assert!(
                name.chars().next().is_some_and(|c| c.is_ascii_alphabetic()),
                "bad metric name in `{l}`"
            );
            (name.to_string(), value)
        })
        .collect()
}

fn sample(all: &[(String, f64)], name: &str) -> f64 {
    all.iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no {name}"))
        .1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_metrics_describe_the_run() {
    let cfg = config(4, 3);
    let job = start(&cfg, false, true).await;
    let (code, status) = json(&job, "GET", "/status").await;
    assert_eq!(code, 200);
    assert_eq!(status["state"], "running");
    assert_eq!(status["epoch"], 1);
    assert_eq!(status["step"], 0);
    assert_eq!(status["members"], serde_json::json!([0, 1, 2]));
    let shards = status["shards"].as_array().unwrap();
    assert_eq!(shards.len(), 3);
    let owned: u64 = shards
        .iter()
        .map(|s| s["owned_elems"].as_u64().unwrap())
        .sum();
    let handle = job.handle();
    let (_, first) = handle.status().await.map(|s| (s.epoch, s)).unwrap();
    let total: u64 = first.shards.iter().map(|s| s.owned_elems).sum();
    assert_eq!(owned, total);
    assert!(owned > 0);
    // AdamW: parameters plus two moments, 4 bytes each.
    assert!(shards
        .iter()
        .all(|s| s["owned_state_bytes"].as_u64() == Some(12 * s["owned_elems"].as_u64().unwrap())));

    let (code, text) = http(&job, "GET", "/metrics").await;
    assert_eq!(code, 200);
    let m = samples(&text);
    assert_eq!(sample(&m, "ezero_members"), 3.0);
    assert_eq!(sample(&m, "ezero_epoch"), 1.0);
    assert_eq!(sample(&m, "ezero_up"), 1.0);
    assert_eq!(sample(&m, "ezero_recoveries_total"), 0.0);
    for r in 0..3 {
        let name = format!("ezero_rank_owned_bytes{{rank=\"{r}\"}}");
        assert_eq!(sample(&m, &name) as u64, first.shards[r].owned_state_bytes);
    }

    let (out, changes) = finish(job).await;
    assert!(changes.is_empty());
    assert_eq!(out.records.len(), 4);
    // The handle outlives the run and reports its end.
    let end = handle.status().await.unwrap();
    assert_eq!(end.step, 4);
    assert_eq!(end.telemetry.steps_completed, 4);
    assert_eq!(
        end.replica_lag_steps,
        Some(1),
        "the last backup was taken before step 3"
    );
    assert!(matches!(
        end.run,
        elastic_zero::runtime::api::status::RunState::Finished
    ));
    let text = end.prometheus();
    assert_eq!(sample(&samples(&text), "ezero_up"), 0.0);
    assert_eq!(sample(&samples(&text), "ezero_step"), 4.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_before_the_first_step_leaves_and_ends_with_the_same_parameters() {
    let cfg = config(4, 3);
    let want = baseline(&cfg).await;
    let job = start(&cfg, false, true).await;
    let (code, body) = json(&job, "POST", "/ranks/1/drain").await;
    assert_eq!(code, 202, "{body}");
    assert_eq!(body["rank"], 1);
    let mut sub = job.handle().subscribe();
    let handle = job.handle();
    let (out, changes) = finish(job).await;
    assert_eq!(param_sha256(&out.params), want);
    assert_eq!(changes.len(), 1);
    assert_eq!(
        (changes[0].before.clone(), changes[0].after.clone()),
        (vec![0, 1, 2], vec![0, 2])
    );
    let costed = sub.try_recv().expect("the change was published");
    assert!(costed.moved_bytes.is_some_and(|b| b > 0));
    let end = handle.status().await.unwrap();
    assert_eq!(end.members, vec![0, 2]);
    assert_eq!(end.telemetry.rebalances, 1);
    assert_eq!(end.telemetry.moved_bytes_total, costed.moved_bytes.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_mid_run_leaves_at_a_step_boundary_with_the_same_parameters() {
    // Enough steps that the drain, sent once step 0 is done, lands before the run ends.
    let cfg = config(30, 3);
    let want = baseline(&cfg).await;
    let mut job = start(&cfg, false, false).await;
    loop {
        match job.next_event().await.unwrap() {
            ClusterEvent::Step(_) => break,
            ClusterEvent::Aborted(why) => panic!("{why}"),
            _ => {}
        }
    }
    let (code, body) = json(&job, "POST", "/ranks/2/drain").await;
    assert_eq!(code, 202, "{body}");
    let (out, changes) = finish(job).await;
    assert_eq!(param_sha256(&out.params), want);
    assert_eq!(changes.len(), 1);
    assert!(changes[0].step >= 1, "not before step 1: {:?}", changes[0]);
    assert_eq!(changes[0].after, vec![0, 1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_json_errors_and_change_nothing() {
    let cfg = TrainConfig {
        min_ranks: 2,
        max_ranks: 3,
        ..config(3, 2)
    };
    let want = baseline(&cfg).await;
    let job = start(&cfg, false, true).await;
    for (method, target, code, error) in [
        ("POST", "/ranks/7/drain", 404, "unknown_rank"),
        ("POST", "/ranks/1/drain", 409, "below_min_ranks"),
        ("POST", "/join?count=2", 409, "above_max_ranks"),
        ("POST", "/ranks/1/kill", 403, "kill_disabled"),
        ("POST", "/checkpoint", 409, "no_save_dir"),
        ("POST", "/ranks/x/drain", 400, "bad_rank"),
        ("POST", "/join?count=0", 400, "bad_count"),
        ("GET", "/ranks/1/drain", 405, "method_not_allowed"),
        ("GET", "/nowhere", 404, "not_found"),
    ] {
        let (got, body) = json(&job, method, target).await;
        assert_eq!(
            (got, body["error"].as_str()),
            (code, Some(error)),
            "{method} {target}: {body}"
        );
        assert!(!body["message"].as_str().unwrap().is_empty());
    }
    // The handle refuses the same way, typed.
    let handle = job.handle();
    assert!(matches!(
        handle.drain(9).await,
        Err(ControlError::Refused(
            elastic_zero::engine::coordinator::Refusal::UnknownRank { rank: 9, .. }
        ))
    ));
    assert!(matches!(
        handle.kill(0).await,
        Err(ControlError::KillDisabled)
    ));
    let status = handle.status().await.unwrap();
    assert_eq!(status.members, vec![0, 1]);
    let (out, changes) = finish(job).await;
    assert!(changes.is_empty());
    assert_eq!(param_sha256(&out.params), want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowed_kill_is_recovered_from_buddy_backups_with_the_same_parameters() {
    let cfg = config(4, 3);
    let want = baseline(&cfg).await;
    let job = start(&cfg, true, true).await;
    let (code, body) = json(&job, "POST", "/ranks/9/kill").await;
    assert_eq!(code, 404, "{body}");
    let (code, body) = json(&job, "POST", "/ranks/1/kill").await;
    assert_eq!(code, 202, "{body}");
    let handle = job.handle();
    assert_eq!(handle.status().await.unwrap().pending_kills, vec![1]);
    let (out, changes) = finish(job).await;
    assert_eq!(param_sha256(&out.params), want);
    assert_eq!(changes.len(), 1);
    assert_eq!(changes[0].lost, vec![1]);
    assert_eq!(changes[0].rolled_back_to, Some(0));
    let end = handle.status().await.unwrap();
    assert_eq!(end.telemetry.recoveries, 1);
    assert_eq!(end.membership.len(), 1);
    assert!(end.membership[0].is_recovery());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joins_over_the_handle_and_snapshots_on_demand() {
    let cfg = config(4, 2);
    let want = baseline(&cfg).await;
    let spec = ClusterSpec::from_config(cfg.clone()).unwrap();
    let mut job = Cluster::builder(spec)
        .on_demand_snapshots(true)
        .paused(true)
        .start()
        .await
        .unwrap();
    assert!(job.control_addr().is_none());
    let handle = job.handle();
    assert!(matches!(
        handle.join(0).await,
        Err(ControlError::BadRequest(_))
    ));
    handle.join(2).await.unwrap();
    handle.request_snapshot().await.unwrap();
    job.run();
    let (mut snapshots, mut joined) = (Vec::new(), Vec::new());
    while let Some(ev) = job.next_event().await {
        match ev {
            ClusterEvent::Snapshot(s) => snapshots.push(s.progress.step),
            ClusterEvent::Membership(m) => joined = m.after.clone(),
            ClusterEvent::Finished => break,
            ClusterEvent::Aborted(why) => panic!("{why}"),
            ClusterEvent::JoinFailed { rank, reason } => panic!("rank {rank}: {reason}"),
            _ => {}
        }
    }
    assert_eq!(joined, vec![0, 1, 2, 3]);
    assert_eq!(
        snapshots,
        vec![1],
        "one snapshot, at the first step boundary"
    );
    let out = job.finish().await.unwrap();
    assert_eq!(param_sha256(&out.params), want);
    // After the end, requests are refused rather than lost.
    assert!(handle.drain(0).await.is_err());
}

mod cli {
    //! The same endpoint behind `ezero train --control`.

    use std::io::{BufRead, BufReader, Read, Write};
    use std::process::{Child, Command, Stdio};

    const JOB: &[&str] = &[
        "train",
        "--model",
        "mlp",
        "--layers",
        "2",
        "--d-model",
        "16",
        "--seq-len",
        "8",
        "--micro-batches",
        "6",
        "--micro-batch-size",
        "2",
        "--ranks",
        "3",
        // Enough steps that a request sent as training starts lands before the end.
        "--steps",
        "40",
        "--sample-tokens",
        "0",
    ];

    fn ezero(extra: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_ezero"));
        c.args(JOB).args(extra);
        c
    }

    fn sha(stdout: &str) -> String {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix("param-sha256: "))
            .expect("a digest")
            .to_string()
    }

    /// Starts the job and reads stdout up to the endpoint line: (child, stdout, address).
    // The child is handed back and `rest` waits for it.
    #[allow(clippy::zombie_processes)]
    fn spawn(extra: &[&str]) -> (Child, BufReader<std::process::ChildStdout>, String) {
        let mut child = ezero(extra).stdout(Stdio::piped()).spawn().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0, "no endpoint line");
            if let Some(rest) = line.strip_prefix("control endpoint: http://") {
                let addr = rest.split_whitespace().next().unwrap().to_string();
                return (child, out, addr);
            }
        }
    }

    fn post(addr: &str, target: &str) -> (u16, String) {
        let mut sock = std::net::TcpStream::connect(addr).unwrap();
        write!(sock, "POST {target} HTTP/1.1\r\nHost: t\r\n\r\n").unwrap();
        let mut text = String::new();
        sock.read_to_string(&mut text).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        (
            head.split(' ').nth(1).unwrap().parse().unwrap(),
            body.into(),
        )
    }

    fn rest(mut child: Child, mut out: BufReader<std::process::ChildStdout>) -> String {
        let mut text = String::new();
        out.read_to_string(&mut text).unwrap();
        assert!(child.wait().unwrap().success(), "{text}");
        text
    }

    #[test]
    fn a_drain_over_http_shows_in_the_progress_view_and_keeps_the_digest() {
        let plain = ezero(&[]).output().unwrap();
        assert!(plain.status.success());
        let want = sha(&String::from_utf8_lossy(&plain.stdout));
        let (child, out, addr) = spawn(&["--control", "127.0.0.1:0"]);
        assert_eq!(
            post(&addr, "/ranks/1/kill").0,
            403,
            "kill needs --control-allow-kill"
        );
        let (code, body) = post(&addr, "/ranks/1/drain");
        assert_eq!(code, 202, "{body}");
        let text = rest(child, out);
        assert!(
            text.lines().any(|l| l.starts_with("membership at step")
                && l.contains("ranks [0, 1, 2] -> [0, 2]")
                && l.contains("KiB")),
            "{text}"
        );
        assert_eq!(sha(&text), want);
    }

    #[test]
    fn post_checkpoint_saves_without_save_every() {
        let dir = tempfile::tempdir().unwrap();
        let save = dir.path().to_str().unwrap();
        let (child, out, addr) = spawn(&["--control", "127.0.0.1:0", "--save-dir", save]);
        let (code, body) = post(&addr, "/checkpoint");
        assert_eq!(code, 202, "{body}");
        rest(child, out);
        let saved: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("step-"))
            .collect();
        assert_eq!(saved.len(), 1, "{saved:?}");
    }

    #[test]
    fn bad_control_flags_are_usage_errors() {
        for args in [
            &["--control", "localhost"][..],
            &["--control-allow-kill"][..],
        ] {
            let out = ezero(args).output().unwrap();
            assert_eq!(out.status.code(), Some(2), "{args:?}");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains("--control"), "{err}");
        }
    }
}
