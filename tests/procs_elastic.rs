//! Ranks as processes, elastic: recovery from kill -9 inside a step, the HTTP control endpoint
//! of `ezero launch` (status, refused requests, kills, drains, snapshots), leaves and joins
//! (standbys that come later, joins without one). Every wait has a deadline; no test asserts on
//! wall-clock durations.

use crate::common;
use crate::procs::start_job_with;

use std::process::Command;
use std::time::{Duration, Instant};

use common::procs::{
    control_addr, coordinator, digest, flags_with, http, reference_digest, run, secrets, worker,
    Coordinator, Proc, DEADLINE, EZERO,
};

/// `GET /status`, once every worker has joined (503 `not_started` before).
pub fn status(addr: &str) -> serde_json::Value {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let (code, body) = http(addr, "GET", "/status");
        if code == 503 && body.contains("not_started") && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        assert_eq!(code, 200, "{body}");
        return serde_json::from_str(&body).expect("status is JSON");
    }
}

/// Polls `/status` until `done` holds for it, within the deadline.
pub fn poll(
    addr: &str,
    what: &str,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let s = status(addr);
        if done(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "{what} did not happen: {s}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill").args([sig, &pid.to_string()]).status();
    assert!(ok.is_ok_and(|s| s.success()), "kill {sig} {pid}");
}

/// kill -9 of a worker while a step runs: the survivors roll back to the buddy backup taken
/// before the step, finish the job, and end with the digest of the same run without the fault.
///
/// A loss between steps (during the buddy exchange that `--replicate-every 1` runs before
/// every step) still stops the run: the engine recovers only from losses inside a step (see
/// the README). So the test freezes worker 1 (SIGSTOP) and kills it only once `/status` says
/// that the step it is in waits for rank 1: frozen, rank 1 cannot answer it, so the SIGKILL
/// lands inside that step. Otherwise it thaws the worker and tries again at a later step.
#[test]
fn kill_9_of_a_worker_inside_a_step_is_recovered_with_the_fault_free_digest() {
    kill_9_inside_a_step_is_recovered("tcp");
}

/// The test above over data plane `transport`; `GET /status` names it for every pair.
pub fn kill_9_inside_a_step_is_recovered(transport: &str) {
    let flags = flags_with("mlp", 3, 300, &["--replicate-every", "1"]);
    let reference = reference_digest(3, &flags);
    // A long heartbeat timeout: a frozen worker must not be declared failed while it is frozen.
    let timing = [
        "--heartbeat-ms",
        "100",
        "--heartbeat-timeout-ms",
        "60000",
        "--control",
        "127.0.0.1:0",
        "--transport",
        transport,
    ];
    let mut job = start_job_with(&format!("chaos-{transport}"), &flags, &timing);
    let addr = control_addr(&job.coord.wait_for_line("control endpoint: "));
    let s = poll(&addr, "three completed steps", |s| {
        s["telemetry"]["steps_completed"].as_u64() >= Some(3)
    });
    let pairs = s["data_planes"]
        .as_array()
        .expect("data_planes in process mode");
    assert_eq!(pairs.len(), 3, "{s}");
    assert!(pairs.iter().all(|p| p["plane"] == transport), "{s}");
    let pid = job.workers[1].id();
    let waits_for_1 = |s: &serde_json::Value| {
        s["activity"]["phase"] == "running"
            && s["awaiting"]
                .as_array()
                .is_some_and(|a| a.iter().any(|r| r == 1))
    };
    let mut struck = None;
    for _ in 0..50 {
        signal(pid, "-STOP");
        // Frozen, rank 1 sends nothing more; two equal answers mean its last words arrived.
        let mut seen = status(&addr);
        loop {
            std::thread::sleep(Duration::from_millis(100));
            let again = status(&addr);
            if again["activity"] == seen["activity"] && again["awaiting"] == seen["awaiting"] {
                break;
            }
            seen = again;
        }
        if waits_for_1(&seen) {
            signal(pid, "-KILL");
            struck = Some(seen["activity"]["step"].as_u64().unwrap());
            break;
        }
        assert_eq!(seen["state"], "running", "the job ended first: {seen}");
        signal(pid, "-CONT");
        let step = seen["step"].as_u64();
        poll(&addr, "progress", |s| s["step"].as_u64() != step);
    }
    let struck = struck.expect("worker 1 was frozen inside a step within 50 tries");
    let deadline = Instant::now() + DEADLINE;
    let _ = job.workers[1].wait_until(deadline);
    let status = job.coord.exited_by(deadline);
    if status.is_none() {
        // A job that never finishes: say what the coordinator waits for and what every
        // process wrote, so that a rare hang can be understood from one CI log.
        let asked = common::procs::try_http(&addr, "GET", "/status");
        job.coord.kill().expect("SIGKILL the coordinator");
        let _ = job.coord.wait_until(Instant::now());
        let mut told = format!("killed inside step {struck}; /status: {asked:?}\n");
        for (i, w) in job.workers.iter_mut().enumerate() {
            let _ = w.wait_until(Instant::now());
            told += &format!("worker {i} stderr:\n{}\n", w.stderr());
        }
        let out: Vec<String> = job.coord.rest();
        panic!(
            "the coordinator did not exit within {DEADLINE:?}\n{told}coordinator stdout:\n{}\ncoordinator stderr:\n{}",
            out.join("\n"),
            job.coord.stderr()
        );
    }
    let rest: Vec<String> = job.coord.lines.iter().collect();
    let out = rest.join("\n");
    let err = job.coord.stderr();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{out}\n{err}");
    assert!(
        out.contains("ranks [0, 1, 2] -> [0, 2], lost [1]"),
        "killed inside step {struck}: {out}"
    );
    assert_eq!(digest(&out), Some(reference), "{out}");
    for (i, mut w) in job.workers.into_iter().enumerate() {
        if i == 1 {
            continue;
        }
        let code = w.wait_until(deadline).and_then(|s| s.code());
        assert_eq!(code, Some(0), "worker {i}: {}", w.stderr());
    }
}

/// `ezero launch --control`: status and metrics, refusals that change nothing, a kill that the
/// job recovers from and a drain, all over HTTP; the digest is the fault-free in-process one.
#[test]
fn launch_control_endpoint_reports_refuses_kills_and_drains() {
    let flags = flags_with("mlp", 3, 600, &["--replicate-every", "1"]);
    let reference = reference_digest(3, &flags);
    let mut launch = Proc::spawn(
        Command::new(EZERO)
            .args(["launch", "--nprocs", "3", "--control", "127.0.0.1:0"])
            .arg("--control-allow-kill")
            .arg("--")
            .args(&flags),
    );
    let mut seen = launch.lines_until("control endpoint: ");
    let addr = control_addr(seen.last().unwrap());

    let s = status(&addr);
    assert_eq!(s["members"], serde_json::json!([0, 1, 2]), "{s}");
    assert_eq!(s["steps"], 600, "{s}");
    let (code, metrics) = http(&addr, "GET", "/metrics");
    assert_eq!(code, 200);
    assert!(metrics.contains("\nezero_members 3\n"), "{metrics}");

    // Bad input: a clear 4xx, and nothing changes.
    for (method, target, code, error) in [
        ("POST", "/ranks/7/kill", 404, "unknown_rank"),
        ("POST", "/ranks/7/drain", 404, "unknown_rank"),
        ("POST", "/ranks/x/kill", 400, "bad_rank"),
        ("GET", "/ranks/1/kill", 405, "method_not_allowed"),
        // No standby worker is connected: a join cannot take one.
        ("POST", "/join?count=1", 409, "no_standby"),
        // No --save-dir: nothing would keep it.
        ("POST", "/checkpoint", 409, "no_save_dir"),
    ] {
        let (got, body) = http(&addr, method, target);
        assert_eq!(got, code, "{method} {target}: {body}");
        let body: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["error"], error, "{method} {target}: {body}");
        if error == "no_standby" {
            let m = body["message"].as_str().unwrap();
            assert!(
                m.contains("0 connected") && m.contains("ezero worker --join "),
                "{m}"
            );
        }
    }
    let s = status(&addr);
    assert_eq!(s["members"], serde_json::json!([0, 1, 2]), "{s}");
    assert_eq!(s["epoch"], 1, "{s}");
    assert_eq!(s["pending_kills"], serde_json::json!([]), "{s}");

    let (code, body) = http(&addr, "POST", "/ranks/1/kill");
    assert_eq!(code, 202, "{body}");
    let s = poll(&addr, "the recovery", |s| s["telemetry"]["recoveries"] == 1);
    assert_eq!(s["members"], serde_json::json!([0, 2]), "{s}");
    let (code, body) = http(&addr, "POST", "/ranks/2/drain");
    assert_eq!(code, 202, "{body}");
    let s = poll(&addr, "the drain", |s| s["telemetry"]["rebalances"] == 1);
    assert_eq!(s["members"], serde_json::json!([0]), "{s}");

    let status = launch.wait_until(Instant::now() + DEADLINE);
    seen.extend(launch.lines.iter());
    let out = seen.join("\n");
    let err = launch.stderr();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{out}\n{err}");
    assert!(
        out.contains("[worker 2] ezero worker: rank 2: left the job"),
        "{out}"
    );
    assert_eq!(digest(&out), Some(reference), "{out}");
}

/// `--leave` with worker processes: the leaver's chunks move peer to peer over the data plane,
/// it exits 0, and the digest equals the in-process run's.
#[test]
fn launch_with_leave_gives_the_in_process_digest() {
    for (model, stage, leave) in [("mlp", 3, "1@1"), ("gpt", 1, "0@2")] {
        let flags = flags_with(model, stage, 3, &["--leave", leave]);
        let reference = reference_digest(3, &flags);
        let (code, out, err) = run(Command::new(EZERO)
            .args(["launch", "--nprocs", "3", "--"])
            .args(&flags));
        assert_eq!(code, 0, "{model} stage {stage}: {out}\n{err}");
        assert!(out.contains("left the job"), "{out}");
        assert_eq!(
            digest(&out),
            Some(reference),
            "{model} stage {stage}: {out}"
        );
    }
}

/// `--join` with worker processes: the launcher starts a standby worker per joining rank, the
/// scripted join takes them at the step boundary, the reshard moves their chunks to them over
/// the data plane (TCP, and QUIC in the second case; two joiners, which must reach each other,
/// in the third), and the digest equals the in-process run's, with the join and without it.
#[test]
fn launch_with_join_gives_the_in_process_digest() {
    let cases = [
        ("mlp", 3, "tcp", 1),
        ("gpt", 1, "quic", 1),
        ("mlp", 3, "quic", 2),
    ];
    for (model, stage, transport, count) in cases {
        let plain = flags_with(model, stage, 5, &[]);
        let join = format!("{count}@3");
        let flags = flags_with(model, stage, 5, &["--join", &join]);
        let reference = reference_digest(2, &plain);
        assert_eq!(
            reference_digest(2, &flags),
            reference,
            "bitwise across membership"
        );
        let (code, out, err) = run(Command::new(EZERO)
            .args(["launch", "--nprocs", "2", "--transport", transport, "--"])
            .args(&flags));
        let case = format!("{model} stage {stage} {transport} --join {join}");
        assert_eq!(code, 0, "{case}: {out}\n{err}");
        let after: Vec<u32> = (0..2 + count).collect();
        assert!(
            out.contains(&format!("ranks [0, 1] -> {after:?}")),
            "{case}: {out}"
        );
        for r in 2..2 + count {
            let line = format!("ezero worker: rank {r} of {}", r + 1);
            assert!(out.contains(&line), "{case}: {out}");
        }
        let finished = out.matches("the job finished").count();
        assert_eq!(finished, 2 + count as usize, "{case}: {out}");
        assert_eq!(digest(&out), Some(reference), "{case}: {out}");
    }
}

/// The spot-instance story by hand: a coordinator and 2 workers start a job; a third worker
/// started later is held as a standby; `POST /join` admits it at the next step boundary without
/// a restart, and the job ends with the digest of the 2-rank run.
#[test]
fn a_worker_started_later_joins_through_the_endpoint() {
    let flags = flags_with("mlp", 3, 600, &[]);
    let reference = reference_digest(2, &flags);
    let (token, dir) = ("join-token", secrets());
    let Coordinator {
        proc: mut coord,
        addr,
    } = Coordinator::spawn(
        coordinator(2, token, dir.path())
            .args(["--control", "127.0.0.1:0"])
            .args(&flags),
    );
    let control = control_addr(&coord.wait_for_line("control endpoint: "));
    let workers: Vec<Proc> = (0..2)
        .map(|i| {
            Proc::spawn(worker(&addr, token, dir.path()).env("EZERO_RANK_HINT", i.to_string()))
        })
        .collect();
    let s = status(&control);
    assert_eq!(s["members"], serde_json::json!([0, 1]), "{s}");
    assert_eq!(s["standbys"], 0, "{s}");
    let mut late = Proc::spawn(&mut worker(&addr, token, dir.path()));
    late.wait_for_line("ezero worker: connected to ");
    poll(&control, "the standby", |s| s["standbys"] == 1);
    let (code, body) = http(&control, "POST", "/join?count=1");
    assert_eq!(code, 202, "{body}");
    // The one standby is promised: a second join is refused and changes nothing.
    let (code, body) = http(&control, "POST", "/join?count=1");
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("no_standby"), "{body}");
    let s = poll(&control, "the join", |s| {
        s["members"] == serde_json::json!([0, 1, 2]) && s["telemetry"]["rebalances"] == 1
    });
    assert_eq!(s["standbys"], 0, "{s}");
    // The joiner's host is in the map like the others' (buddy placement uses it).
    let hosts: Vec<&serde_json::Value> = (0..3).map(|r| &s["shards"][r]["host"]).collect();
    assert!(hosts.iter().all(|h| *h == "127.0.0.1"), "{s}");
    late.wait_for_line("ezero worker: rank 2 of 3");
    let status = coord.wait_until(Instant::now() + DEADLINE);
    let out: Vec<String> = coord.lines.iter().collect();
    let out = out.join("\n");
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(0),
        "{out}\n{}",
        coord.stderr()
    );
    assert_eq!(digest(&out), Some(reference), "{out}");
    let status = late.wait_until(Instant::now() + DEADLINE);
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{}", late.stderr());
    drop(workers);
}

/// `POST /checkpoint` with worker processes: the coordinator collects the state at the next
/// step boundary and writes it whatever `--save-every` says (here none); it verifies.
#[test]
fn launch_writes_a_checkpoint_on_request() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ck");
    let flags = flags_with("mlp", 3, 600, &["--save-dir", root.to_str().unwrap()]);
    let mut launch = Proc::spawn(
        Command::new(EZERO)
            .args(["launch", "--nprocs", "2", "--control", "127.0.0.1:0", "--"])
            .args(&flags),
    );
    let mut seen = launch.lines_until("control endpoint: ");
    let addr = control_addr(seen.last().unwrap());
    // Once the workers have joined and training runs.
    let s = poll(&addr, "a step", |s| s["step"].as_u64() > Some(0));
    let (code, body) = http(&addr, "POST", "/checkpoint");
    assert_eq!(code, 202, "{body}");
    let requested_at = s["step"].as_u64().unwrap();
    let status = launch.wait_until(Instant::now() + DEADLINE);
    seen.extend(launch.lines.iter());
    let out = seen.join("\n");
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(0),
        "{out}\n{}",
        launch.stderr()
    );
    let saved: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    assert_eq!(saved.len(), 1, "only the requested one: {saved:?}\n{out}");
    let step: u64 = saved[0]["step-".len()..].parse().unwrap();
    assert!(
        step > requested_at && step < 600,
        "{step} after {requested_at}"
    );
    let (code, vout, verr) = run(Command::new(EZERO)
        .args(["checkpoint", "verify"])
        .arg(root.join(&saved[0])));
    assert_eq!(code, 0, "{vout}{verr}");
}

/// A scripted join with no standby worker connected: the joining rank waits `--join-wait-ms`,
/// then the change is dropped with the reason and what to start, and training goes on with
/// the ranks it has, to the same parameters as a run without the join.
#[test]
fn a_join_without_a_standby_is_dropped_and_training_goes_on() {
    let (token, dir) = ("no-standby", secrets());
    let reference = reference_digest(2, &flags_with("mlp", 1, 3, &[]));
    let mut coord = Coordinator::spawn(
        coordinator(2, token, dir.path())
            .args(["--join-wait-ms", "200"])
            .args(flags_with("mlp", 1, 3, &["--join", "1@1"])),
    );
    let mut workers: Vec<Proc> = (0..2)
        .map(|i| {
            Proc::spawn(
                worker(&coord.addr, token, dir.path()).env("EZERO_RANK_HINT", i.to_string()),
            )
        })
        .collect();
    let deadline = Instant::now() + DEADLINE;
    let status = coord.proc.wait_until(deadline);
    let out: Vec<String> = coord.proc.lines.iter().collect();
    let out = out.join("\n");
    let err = coord.proc.stderr();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{out}\n{err}");
    assert!(
        out.contains("rank 2 did not join, training goes on without it: could not start: no standby worker connected within join_wait_ms (200 ms)")
            && out.contains("ezero worker --join "),
        "{out}"
    );
    assert_eq!(digest(&out), Some(reference), "{out}");
    for (i, w) in workers.iter_mut().enumerate() {
        let status = w.wait_until(deadline);
        assert_eq!(
            status.and_then(|s| s.code()),
            Some(0),
            "worker {i}: {}",
            w.stderr()
        );
    }
}

/// A joiner that later leaves is no peer of the next joiner (over QUIC a joiner waits until
/// every peer it was given has connected, so a stale one would fail the second join), and the
/// digest still equals the in-process run's.
#[test]
fn a_joiner_that_left_is_not_a_peer_of_the_next_joiner() {
    let script = ["--join", "1@2", "--leave", "2@3", "--join", "1@4"];
    let flags = flags_with("mlp", 3, 6, &script);
    let reference = reference_digest(2, &flags);
    let (code, out, err) = run(Command::new(EZERO)
        .args(["launch", "--nprocs", "2", "--transport", "quic", "--"])
        .args(&flags));
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("ezero worker: rank 2: left the job"), "{out}");
    assert!(out.contains("ranks [0, 1] -> [0, 1, 3]"), "{out}");
    assert_eq!(digest(&out), Some(reference), "{out}");
}
