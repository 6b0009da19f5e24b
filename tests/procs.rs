//! Ranks as processes: `ezero launch`, `ezero coordinator` and `ezero worker` on 127.0.0.1.
//! Bit-for-bit parity with the in-process run, failure detection (kill -9, a silent process),
//! and clear errors. Every wait has a deadline; no test asserts on wall-clock durations.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const EZERO: &str = env!("CARGO_BIN_EXE_ezero");
/// Generous bound for any one process-level test step on a loaded 2-core machine.
const DEADLINE: Duration = Duration::from_secs(120);

/// The flags of `tests/common::small` (a 2-layer model, 3 steps).
fn small(model: &str, stage: u8) -> Vec<String> {
    [
        "--model",
        model,
        "--layers",
        "2",
        "--d-model",
        "32",
        "--heads",
        "4",
        "--seq-len",
        "16",
        "--micro-batches",
        "6",
        "--micro-batch-size",
        "2",
        "--steps",
        "3",
        "--chunk-elems",
        "1000",
        "--warmup-steps",
        "1",
        "--sample-tokens",
        "0",
        "--reduce",
        "exact",
        "--stage",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([stage.to_string()])
    .collect()
}

fn digest(stdout: &str) -> Option<String> {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("param-sha256: "))
        .map(str::to_string)
}

/// Runs to completion within the deadline; (code, stdout, stderr).
fn run(cmd: &mut Command) -> (i32, String, String) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ezero starts");
    let (out, err) = (collect(child.stdout.take()), collect(child.stderr.take()));
    let status = wait_until(&mut child, Instant::now() + DEADLINE);
    let code = status.and_then(|s| s.code()).unwrap_or(-1);
    (
        code,
        out.recv().unwrap_or_default(),
        err.recv().unwrap_or_default(),
    )
}

fn collect(r: Option<impl Read + Send + 'static>) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(mut r) = r {
            let _ = r.read_to_string(&mut s);
        }
        let _ = tx.send(s);
    });
    rx
}

/// Waits for `child` until `deadline`; kills it and returns `None` past it.
fn wait_until(child: &mut Child, deadline: Instant) -> Option<ExitStatus> {
    loop {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn launch_gives_the_in_process_digest_with_2_and_3_processes() {
    for (nprocs, stage, model) in [(2, 1, "mlp"), (3, 1, "gpt"), (2, 3, "gpt"), (3, 3, "mlp")] {
        let flags = small(model, stage);
        let (code, out, err) = run(Command::new(EZERO)
            .arg("train")
            .args(["--ranks", &nprocs.to_string()])
            .args(&flags));
        assert_eq!(code, 0, "train: {err}");
        let reference = digest(&out).expect("train prints a digest");
        let (code, out, err) = run(Command::new(EZERO)
            .args(["launch", "--nprocs", &nprocs.to_string(), "--"])
            .args(&flags));
        assert_eq!(code, 0, "launch {nprocs} stage {stage}: {out}\n{err}");
        assert_eq!(
            digest(&out).as_deref(),
            Some(reference.as_str()),
            "launch --nprocs {nprocs} stage {stage} {model}: {out}"
        );
        // Every worker reported the clean end of the job.
        let finished = out.matches("the job finished").count();
        assert_eq!(finished, nprocs, "{out}");
    }
}

/// A coordinator and three workers with fast heartbeats and no in-memory backups, training
/// long enough that a fault lands mid-run.
struct Job {
    coord: Child,
    coord_lines: mpsc::Receiver<String>,
    coord_err: mpsc::Receiver<String>,
    workers: Vec<(Child, mpsc::Receiver<String>)>,
}

fn start_job(port_hint: &str) -> Job {
    let token = format!("test-token-{port_hint}");
    let mut flags = small("mlp", 3);
    let steps = flags.iter().position(|f| f == "--steps").unwrap() + 1;
    flags[steps] = "1000000".into();
    let mut coord = Command::new(EZERO)
        .args(["coordinator", "--listen", "127.0.0.1:0", "--ranks", "3"])
        .args(["--heartbeat-ms", "100", "--heartbeat-timeout-ms", "1000"])
        .args(["--replicate-every", "0"])
        .args(&flags)
        .env("EZERO_CLUSTER_TOKEN", &token)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("coordinator starts");
    let (tx, coord_lines) = mpsc::channel();
    let stdout = coord.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let coord_err = collect(coord.stderr.take());
    let first = coord_lines
        .recv_timeout(DEADLINE)
        .expect("coordinator prints its address");
    let addr = first
        .strip_prefix("ezero coordinator: listening on ")
        .expect("address line")
        .to_string();
    let workers = (0..3)
        .map(|i| {
            let mut w = Command::new(EZERO)
                .args(["worker", "--join", &addr])
                .env("EZERO_RANK_HINT", i.to_string())
                .env("EZERO_CLUSTER_TOKEN", &token)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("worker starts");
            let err = collect(w.stderr.take());
            (w, err)
        })
        .collect();
    Job {
        coord,
        coord_lines,
        coord_err,
        workers,
    }
}

impl Job {
    /// Blocks until the coordinator has reported a finished step.
    fn wait_for_a_step(&self) {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .coord_lines
                .recv_timeout(left)
                .expect("a step completes");
            if line.starts_with("step ") {
                return;
            }
        }
    }

    /// After rank 1 was hit: the coordinator and the other workers exit within the deadline,
    /// non-zero, naming rank 1.
    fn assert_rank_1_reported(mut self, expect: &str) {
        let deadline = Instant::now() + DEADLINE;
        let status = wait_until(&mut self.coord, deadline);
        let err = self.coord_err.recv().unwrap_or_default();
        let status = status.expect("the coordinator exits in time (it did not: killed)");
        assert_eq!(status.code(), Some(1), "{err}");
        assert!(err.contains("rank 1"), "{err}");
        assert!(err.contains(expect), "{err}");
        assert!(err.contains("not saved"), "{err}");
        for (i, (mut w, werr)) in self.workers.into_iter().enumerate() {
            if i == 1 {
                // Killed already, or stopped and never coming back.
                let _ = w.kill();
                let _ = w.wait();
                continue;
            }
            let status = wait_until(&mut w, deadline);
            let werr = werr.recv().unwrap_or_default();
            let status = status.expect("a surviving worker exits in time (it did not: killed)");
            assert_eq!(status.code(), Some(1), "worker {i}: {werr}");
            assert!(werr.contains("rank 1"), "worker {i}: {werr}");
        }
    }
}

#[test]
fn kill_9_of_a_worker_mid_run_is_reported_and_the_others_exit() {
    let mut job = start_job("kill");
    job.wait_for_a_step();
    job.workers[1].0.kill().expect("SIGKILL worker 1");
    job.assert_rank_1_reported("control connection lost");
}

#[test]
fn a_silent_worker_is_declared_failed_after_the_heartbeat_timeout() {
    let job = start_job("stop");
    job.wait_for_a_step();
    let pid = job.workers[1].0.id().to_string();
    let stopped = Command::new("kill").args(["-STOP", &pid]).status();
    assert!(stopped.is_ok_and(|s| s.success()), "kill -STOP works here");
    // Its socket stays open: only the missing heartbeats can reveal it.
    job.assert_rank_1_reported("heartbeat_timeout_ms");
}

#[test]
fn an_unanswering_coordinator_is_a_clear_error() {
    // Port 1 on loopback: nothing listens there.
    let (code, _, err) = run(Command::new(EZERO)
        .args([
            "worker",
            "--join",
            "127.0.0.1:1",
            "--connect-timeout-ms",
            "300",
        ])
        .env("EZERO_CLUSTER_TOKEN", "t"));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("cannot reach the coordinator at 127.0.0.1:1"),
        "{err}"
    );
}

#[test]
fn a_worker_with_the_wrong_token_is_refused() {
    let mut coord = Command::new(EZERO)
        .args(["coordinator", "--listen", "127.0.0.1:0", "--ranks", "1"])
        .args(["--join-timeout-ms", "100000"])
        .args(small("mlp", 1))
        .env("EZERO_CLUSTER_TOKEN", "right")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(coord.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let addr = first
        .strip_prefix("ezero coordinator: listening on ")
        .unwrap();
    let (code, _, err) = run(Command::new(EZERO)
        .args(["worker", "--join", addr])
        .env("EZERO_CLUSTER_TOKEN", "wrong"));
    let _ = coord.kill();
    let _ = coord.wait();
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("refused") && err.contains("token"), "{err}");
}

#[test]
fn bad_launch_input_is_one_line_exit_2() {
    let cases: &[(&[&str], &str)] = &[
        (&["launch", "--nprocs", "0", "--"], "--nprocs"),
        (
            &["launch", "--nprocs", "2", "--", "--ranks", "3"],
            "--ranks",
        ),
        (&["launch", "--nprocs", "2", "--", "--join", "1@2"], "join"),
        (&["launch", "--nprocs", "2", "--", "--stage", "7"], "stage"),
        (
            &[
                "launch",
                "--nprocs",
                "2",
                "--heartbeat-ms",
                "100",
                "--heartbeat-timeout-ms",
                "150",
                "--",
            ],
            "heartbeat_timeout_ms",
        ),
    ];
    for (args, field) in cases {
        let (code, _, err) = run(Command::new(EZERO).args(*args));
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(field), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
    }
}

#[test]
fn init_secrets_makes_a_cluster_ca_once() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca");
    let (code, out, err) = run(Command::new(EZERO)
        .args(["coordinator", "--init-secrets"])
        .arg(&ca));
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("cluster CA written"), "{out}");
    assert!(ca.join("ca.pem").exists());
    // A second run must not overwrite the CA.
    let (code, _, err) = run(Command::new(EZERO)
        .args(["coordinator", "--init-secrets"])
        .arg(&ca));
    assert_eq!(code, 1, "{err}");
}

/// QUIC data plane (mutual TLS between workers): same digest.
#[test]
fn launch_over_quic_gives_the_in_process_digest() {
    let flags = small("mlp", 3);
    let (code, out, err) = run(Command::new(EZERO)
        .arg("train")
        .args(["--ranks", "3"])
        .args(&flags));
    assert_eq!(code, 0, "{err}");
    let reference = digest(&out).unwrap();
    let (code, out, err) = run(Command::new(EZERO)
        .args(["launch", "--transport", "quic", "--nprocs", "3", "--"])
        .args(&flags));
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(digest(&out), Some(reference));
}
