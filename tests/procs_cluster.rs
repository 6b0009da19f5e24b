//! Worker processes under a cluster's conventions: SIGTERM as a preemption notice (a graceful
//! drain at the next step boundary, or the abrupt path when the grace runs out), workers that
//! find their coordinator and rank hint in Slurm's or torchrun's variables, and the control
//! endpoint's operator token. Every wait has a deadline; no test asserts on durations.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::procs::{
    control_addr, coordinator, digest, flags_with, reference_digest, secrets, try_http_with,
    worker, Coordinator, Proc, DEADLINE, EZERO,
};
use crate::procs_elastic::{poll, signal, status};

/// A 3-worker job with a control endpoint on loopback; workers take `worker_flags`.
struct Job {
    coord: Proc,
    workers: Vec<Proc>,
    addr: String,
    _secrets: tempfile::TempDir,
}

impl Job {
    /// The coordinator's exit code (`None`: still running at `deadline`, then killed) and what
    /// it printed.
    fn coordinator_end(&mut self, deadline: Instant) -> (Option<i32>, String) {
        let code = self.coord.wait_until(deadline).and_then(|s| s.code());
        let out: Vec<String> = self.coord.rest();
        (code, out.join("\n"))
    }
}

fn start(flags: &[String], worker_flags: &[&str]) -> Job {
    let token = "test-token-cluster";
    let dir = secrets();
    let Coordinator { proc: coord, addr } = Coordinator::spawn(
        coordinator(3, token, dir.path())
            .args([
                "--control",
                "127.0.0.1:0",
                "--heartbeat-timeout-ms",
                "60000",
            ])
            .args(flags),
    );
    let workers = (0..3)
        .map(|i| {
            Proc::spawn(
                worker(&addr, token, dir.path())
                    .args(worker_flags)
                    .env("EZERO_RANK_HINT", i.to_string()),
            )
        })
        .collect();
    let control = control_addr(&coord.wait_for_line("control endpoint: "));
    Job {
        coord,
        workers,
        addr: control,
        _secrets: dir,
    }
}

/// Freezes worker `w` (SIGSTOP) at a moment `/status` says the job waits for it in `phase`;
/// thaws it and tries again otherwise. Returns the step it was frozen in.
fn freeze_in(job: &Job, w: usize, phase: &str) -> u64 {
    let pid = job.workers[w].id();
    for _ in 0..100 {
        signal(pid, "-STOP");
        // Frozen, the worker sends nothing more; two equal answers mean its last words arrived.
        let mut seen = status(&job.addr);
        loop {
            std::thread::sleep(Duration::from_millis(100));
            let again = status(&job.addr);
            if again["activity"] == seen["activity"] && again["awaiting"] == seen["awaiting"] {
                break;
            }
            seen = again;
        }
        let waits = seen["activity"]["phase"] == phase
            && seen["awaiting"]
                .as_array()
                .is_some_and(|a| a.iter().any(|r| r == w));
        if waits {
            return seen["activity"]["step"].as_u64().unwrap();
        }
        assert_eq!(seen["state"], "running", "the job ended first: {seen}");
        signal(pid, "-CONT");
        let step = seen["step"].as_u64();
        poll(&job.addr, "progress", |s| s["step"].as_u64() != step);
    }
    panic!("worker {w} was not caught in phase {phase} within 100 tries");
}

/// The job ends 0 with the fault-free digest and no rollback; worker 1 exits 0 having left
/// after its notice; the others finish.
fn assert_drained_without_rollback(mut job: Job, reference: &str) {
    let deadline = Instant::now() + DEADLINE;
    let code = job.workers[1].wait_until(deadline).and_then(|s| s.code());
    let w1: Vec<String> = job.workers[1].rest();
    assert_eq!(
        code,
        Some(0),
        "worker 1: {w1:?} {}",
        job.workers[1].stderr()
    );
    assert!(
        w1.iter()
            .any(|l| l.contains("left the job after step") && l.contains("after SIGTERM")),
        "{w1:?}"
    );
    let (code, out) = job.coordinator_end(deadline);
    assert_eq!(code, Some(0), "{out}\n{}", job.coord.stderr());
    assert!(out.contains("rank 1: notice (SIGTERM"), "{out}");
    assert!(out.contains("-> [0, 2], lost []"), "{out}");
    assert!(!out.contains("lost [1]"), "a rollback: {out}");
    assert_eq!(digest(&out).as_deref(), Some(reference), "{out}");
    for w in [0, 2] {
        let code = job.workers[w].wait_until(deadline).and_then(|s| s.code());
        assert_eq!(code, Some(0), "worker {w}: {}", job.workers[w].stderr());
    }
}

/// SIGTERM to a worker inside a step and inside a buddy backup: it leaves at the next step
/// boundary through the drain path (no rollback, nothing replayed), exits 0, and the job ends
/// with the fault-free digest; `/metrics` counts a drain caused by a signal.
#[test]
fn sigterm_drains_a_worker_at_the_next_boundary_inside_a_step_and_a_backup() {
    let flags = flags_with("mlp", 3, 300, &["--replicate-every", "1"]);
    let reference = reference_digest(3, &flags);
    for phase in ["running", "replicating"] {
        let job = start(&flags, &[]);
        poll(&job.addr, "two steps", |s| {
            s["telemetry"]["steps_completed"].as_u64() >= Some(2)
        });
        freeze_in(&job, 1, phase);
        let pid = job.workers[1].id();
        signal(pid, "-TERM");
        signal(pid, "-CONT");
        // The membership comes from the coordinator, the drain's timing from the driver that
        // reads its events: wait for both.
        let s = poll(&job.addr, "the drain", |s| {
            s["members"] == serde_json::json!([0, 2])
                && s["telemetry"]["drains"]["seconds_last"].is_number()
        });
        assert_eq!(s["telemetry"]["drains"]["signal"], 1, "{phase}: {s}");
        assert_eq!(s["telemetry"]["recoveries"], 0, "{phase}: {s}");
        let (code, metrics) = crate::common::procs::http(&job.addr, "GET", "/metrics");
        assert_eq!(code, 200);
        assert!(
            metrics.contains("ezero_drains_total{cause=\"signal\"} 1"),
            "{metrics}"
        );
        assert!(metrics.contains("ezero_drain_seconds_last "), "{metrics}");
        assert_drained_without_rollback(job, &reference);
    }
}

/// SIGTERM while an operator's drain reshards the job: both leave gracefully, one after the
/// other, and the digest is the fault-free one.
#[test]
fn sigterm_during_a_reshard_is_a_second_graceful_leave() {
    let flags = flags_with("mlp", 3, 300, &["--replicate-every", "1"]);
    let reference = reference_digest(3, &flags);
    let mut job = start(&flags, &[]);
    poll(&job.addr, "two steps", |s| {
        s["telemetry"]["steps_completed"].as_u64() >= Some(2)
    });
    let (code, body) = crate::common::procs::http(&job.addr, "POST", "/ranks/2/drain");
    assert_eq!(code, 202, "{body}");
    // The notice lands while the operator's change is pending or resharding.
    signal(job.workers[1].id(), "-TERM");
    let deadline = Instant::now() + DEADLINE;
    let (code, out) = job.coordinator_end(deadline);
    assert_eq!(code, Some(0), "{out}\n{}", job.coord.stderr());
    assert!(
        !out.contains("lost [1]") && !out.contains("lost [2]"),
        "{out}"
    );
    assert!(out.contains("rank 1: notice (SIGTERM"), "{out}");
    assert_eq!(digest(&out).as_deref(), Some(reference.as_str()), "{out}");
    for w in [1, 2] {
        let code = job.workers[w].wait_until(deadline).and_then(|s| s.code());
        assert_eq!(code, Some(0), "worker {w}: {}", job.workers[w].stderr());
    }
}

/// A grace too short to reach a step boundary: the worker leaves at once (exit 143) and the
/// job recovers it from the buddy backups, still with the fault-free digest.
#[test]
fn sigterm_with_a_grace_too_short_takes_the_abrupt_path() {
    let flags = flags_with("mlp", 3, 300, &["--replicate-every", "1"]);
    let reference = reference_digest(3, &flags);
    let mut job = start(&flags, &["--drain-grace-s", "0.001"]);
    poll(&job.addr, "two steps", |s| {
        s["telemetry"]["steps_completed"].as_u64() >= Some(2)
    });
    // Frozen inside a step, the worker cannot reach a boundary within a millisecond of waking.
    freeze_in(&job, 1, "running");
    let pid = job.workers[1].id();
    signal(pid, "-TERM");
    signal(pid, "-CONT");
    let deadline = Instant::now() + DEADLINE;
    let code = job.workers[1].wait_until(deadline).and_then(|s| s.code());
    let err = job.workers[1].stderr();
    assert_eq!(code, Some(143), "{err}");
    assert!(err.contains("drain grace"), "{err}");
    let (code, out) = job.coordinator_end(deadline);
    assert_eq!(code, Some(0), "{out}\n{}", job.coord.stderr());
    assert!(out.contains("lost [1]"), "{out}");
    assert_eq!(digest(&out).as_deref(), Some(reference.as_str()), "{out}");
}

/// Workers started with only Slurm's variables, or only torchrun's, find the coordinator and
/// their rank hints there and train the job to the in-process digest; a flag that contradicts
/// the scheduler is refused, naming both values, before anything connects.
#[test]
fn workers_start_from_slurm_or_torchrun_variables() {
    let flags = flags_with("mlp", 2, 3, &[]);
    let reference = reference_digest(2, &flags);
    let token = "test-token-sched";
    let dir = secrets();
    for scheduler in ["slurm", "torchrun"] {
        let Coordinator {
            proc: mut coord,
            addr,
        } = Coordinator::spawn(coordinator(2, token, dir.path()).args(&flags));
        let (host, port) = addr.rsplit_once(':').unwrap();
        let mut workers: Vec<Proc> = (0..2)
            .map(|i| {
                let mut cmd = crate::common::procs::ezero(token, dir.path());
                cmd.arg("worker").env("MASTER_PORT", port);
                if scheduler == "slurm" {
                    cmd.env("SLURM_PROCID", i.to_string())
                        .env("SLURM_NTASKS", "2")
                        .env("SLURM_JOB_NODELIST", host);
                } else {
                    cmd.env("RANK", i.to_string())
                        .env("WORLD_SIZE", "2")
                        .env("MASTER_ADDR", host);
                }
                Proc::spawn(&mut cmd)
            })
            .collect();
        let deadline = Instant::now() + DEADLINE;
        let code = coord.wait_until(deadline).and_then(|s| s.code());
        let out: Vec<String> = coord.rest();
        assert_eq!(code, Some(0), "{scheduler}: {out:?} {}", coord.stderr());
        assert_eq!(digest(&out.join("\n")).as_deref(), Some(reference.as_str()));
        for (i, w) in workers.iter_mut().enumerate() {
            let code = w.wait_until(deadline).and_then(|s| s.code());
            let lines: Vec<String> = w.rest();
            assert_eq!(code, Some(0), "{scheduler} worker {i}: {}", w.stderr());
            let name = if scheduler == "slurm" {
                "from Slurm"
            } else {
                "from torchrun"
            };
            let first = &lines[0];
            assert!(first.contains(name), "{first}");
            assert!(first.contains(&format!("rank hint {i}")), "{first}");
        }
    }
    let (code, _, err) = crate::common::procs::run(
        crate::common::procs::ezero(token, dir.path())
            .args(["worker", "--rank-hint", "2"])
            .env("SLURM_PROCID", "1")
            .env("SLURM_JOB_NODELIST", "127.0.0.1"),
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("is 2") && err.contains("rank 1"), "{err}");
}

/// On a non-loopback address every mutating request needs the operator token: without it, with
/// a wrong one or a malformed header, 401 and nothing changes (and the attempt is logged with
/// its address); reads stay open; with the token the drain is accepted.
#[test]
fn the_control_endpoint_beyond_loopback_needs_the_operator_token() {
    let flags = flags_with("mlp", 3, 400, &[]);
    let token_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(token_file.path(), "operator-secret\n").unwrap();
    let mut launch = Proc::spawn(
        Command::new(EZERO)
            .args(["launch", "--nprocs", "3", "--control", "0.0.0.0:0"])
            .env("EZERO_CONTROL_TOKEN_FILE", token_file.path())
            .arg("--")
            .args(&flags),
    );
    let line = launch.wait_for_line("control endpoint: ");
    let port = control_addr(&line).rsplit_once(':').unwrap().1.to_string();
    let addr = format!("127.0.0.1:{port}");
    poll(&addr, "a step", |s| {
        s["telemetry"]["steps_completed"].as_u64() >= Some(1)
    });
    for header in [
        "",
        "Authorization: Bearer wrong\r\n",
        "Authorization: operator-secret\r\n",
        "Authorization: Bearer\r\n",
    ] {
        let (code, body) = try_http_with(&addr, "POST", "/ranks/1/drain", header).unwrap();
        assert_eq!(code, 401, "{header:?}: {body}");
        let (code, body) = try_http_with(&addr, "POST", "/checkpoint", header).unwrap();
        assert_eq!(code, 401, "{header:?}: {body}");
    }
    let s = status(&addr);
    assert_eq!(s["members"], serde_json::json!([0, 1, 2]), "{s}");
    assert_eq!(s["epoch"], 1, "{s}");
    let good = "Authorization: Bearer operator-secret\r\n";
    let (code, body) = try_http_with(&addr, "POST", "/ranks/1/drain", good).unwrap();
    assert_eq!(code, 202, "{body}");
    poll(&addr, "the drain", |s| {
        s["members"] == serde_json::json!([0, 2])
    });
    let code = launch
        .wait_until(Instant::now() + DEADLINE)
        .and_then(|s| s.code());
    let err = launch.stderr();
    assert_eq!(code, Some(0), "{err}");
    assert!(
        err.contains("refused POST /ranks/1/drain from 127.0.0.1"),
        "{err}"
    );
}

/// A notice the job cannot grant (the drain would leave fewer than `--min-ranks`): the job
/// stops at the next step boundary with a checkpoint, as on the coordinator's own SIGTERM; the
/// worker given notice exits 0, and the checkpoint resumes.
#[test]
fn a_notice_below_min_ranks_stops_the_job_with_a_checkpoint() {
    let save = tempfile::tempdir().unwrap();
    let dir = save.path().join("ckpt");
    let flags = flags_with(
        "mlp",
        3,
        300,
        &["--min-ranks", "3", "--save-dir", dir.to_str().unwrap()],
    );
    let mut job = start(&flags, &[]);
    poll(&job.addr, "two steps", |s| {
        s["telemetry"]["steps_completed"].as_u64() >= Some(2)
    });
    signal(job.workers[1].id(), "-TERM");
    let deadline = Instant::now() + DEADLINE;
    let (code, out) = job.coordinator_end(deadline);
    assert_eq!(code, Some(143), "{out}\n{}", job.coord.stderr());
    assert!(out.contains("rank 1: notice (SIGTERM) refused"), "{out}");
    assert!(out.contains("min_ranks is 3"), "{out}");
    assert!(out.contains("checkpoint: saved"), "{out}");
    assert!(out.contains("resume with: ezero launch"), "{out}");
    let code = job.workers[1].wait_until(deadline).and_then(|s| s.code());
    assert_eq!(code, Some(0), "worker 1: {}", job.workers[1].stderr());
    let has_checkpoint = std::fs::read_dir(&dir).unwrap().any(|e| {
        e.unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with("step-")
    });
    assert!(has_checkpoint, "{out}");
}

/// The coordinator given SIGTERM without a save directory stops the job in order: every
/// worker is told why and exits, and the coordinator exits 143 saying nothing was saved.
#[test]
fn sigterm_to_a_coordinator_without_a_save_dir_stops_the_workers_in_order() {
    let flags = flags_with("mlp", 3, 300, &[]);
    let mut job = start(&flags, &[]);
    poll(&job.addr, "two steps", |s| {
        s["telemetry"]["steps_completed"].as_u64() >= Some(2)
    });
    signal(job.coord.id(), "-TERM");
    let deadline = Instant::now() + DEADLINE;
    let (code, out) = job.coordinator_end(deadline);
    assert_eq!(code, Some(143), "{out}\n{}", job.coord.stderr());
    assert!(
        out.lines()
            .any(|l| l.starts_with("stopped by SIGTERM after step")
                && l.contains("not saved (no --save-dir)")),
        "{out}"
    );
    for (i, w) in job.workers.iter_mut().enumerate() {
        let code = w.wait_until(deadline).and_then(|s| s.code());
        let err = w.stderr();
        assert_eq!(code, Some(1), "worker {i}: {err}");
        assert!(err.contains("stopped by SIGTERM"), "worker {i}: {err}");
        assert!(!err.contains("lost the coordinator"), "worker {i}: {err}");
    }
}

/// `--control-tls`: the endpoint speaks HTTPS with the coordinator's cluster certificate, which
/// a client checks against the cluster CA; plain HTTP gets no answer there.
#[test]
fn the_control_endpoint_serves_https_with_the_cluster_certificate() {
    use elastic_zero::net::tls::{peer_server_name, ClusterTls, Protocol};
    let flags = flags_with("mlp", 3, 300, &[]);
    let dir = secrets();
    let mut launch = Proc::spawn(
        Command::new(EZERO)
            .args(["launch", "--nprocs", "3", "--control", "127.0.0.1:0"])
            .args(["--control-tls", "--secrets"])
            .arg(dir.path())
            .arg("--")
            .args(&flags),
    );
    let addr = control_addr(&launch.wait_for_line("control endpoint: "));
    let id = elastic_zero::net::Identity::from_dir(dir.path(), "operator").unwrap();
    let mut client = (*ClusterTls::new(&id).unwrap().client(Protocol::Control)).clone();
    client.alpn_protocols = vec![b"http/1.1".to_vec()];
    let get_status = || -> String {
        let conn =
            rustls::ClientConnection::new(std::sync::Arc::new(client.clone()), peer_server_name())
                .unwrap();
        let sock = std::net::TcpStream::connect(&addr).unwrap();
        let mut tls = rustls::StreamOwned::new(conn, sock);
        let req = "GET /status HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n";
        std::io::Write::write_all(&mut tls, req.as_bytes()).unwrap();
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut tls, &mut text);
        text
    };
    let deadline = Instant::now() + DEADLINE;
    let answer = loop {
        let text = get_status();
        if !text.contains(" 503 ") || Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    assert!(answer.contains("\"members\""), "{answer}");
    let plain = crate::common::procs::try_http(&addr, "GET", "/status");
    assert!(plain.is_err(), "plain HTTP answered: {plain:?}");
    let code = launch
        .wait_until(Instant::now() + DEADLINE)
        .and_then(|s| s.code());
    assert_eq!(code, Some(0), "{}", launch.stderr());
}
