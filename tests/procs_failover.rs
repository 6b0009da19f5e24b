//! The coordinator may die too: `ezero launch --coordinators 2` keeps the job's state in a
//! metadata store, and when the leading coordinator is killed (kill -9, mid-run) the standby
//! takes over, the workers re-attach without restarting, and the run ends with the fault-free
//! `param-sha256`. Bad store input is refused with one line and exit code 2 before anything
//! starts. Every wait has a deadline.

use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::procs::{digest, flags_with, reference_digest, run, secrets, Proc, DEADLINE, EZERO};

/// `ezero launch` with `coordinators` coordinators on `meta`, short leases and fast
/// heartbeats; `flags` are the train flags.
fn launch(coordinators: u32, flags: &[String], meta: &str, control: Option<u16>) -> Command {
    let mut cmd = Command::new(EZERO);
    cmd.args(["launch", "--nprocs", "3", "--coordinators"])
        .arg(coordinators.to_string());
    if let Some(port) = control {
        cmd.arg("--control").arg(format!("127.0.0.1:{port}"));
    }
    cmd.args(["--meta", meta, "--job-id", "failover-test"])
        .args(["--lease-ttl-ms", "1000", "--reattach-wait-ms", "4000"])
        .args(["--heartbeat-ms", "100", "--heartbeat-timeout-ms", "2000"])
        .arg("--")
        .args(flags);
    for var in common::procs::SCHEDULER_VARS {
        cmd.env_remove(var);
    }
    cmd
}

/// The pid in `coordinator c0 (pid P) leads the job from term T`.
fn leader_pid(line: &str) -> u32 {
    let after = line.split("(pid ").nth(1).expect("a pid");
    after[..after.find(')').unwrap()].parse().unwrap()
}

fn is_election(line: &str) -> bool {
    line.starts_with("coordinator ") && line.contains("leads the job from term")
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) has no memory effects; the pid is a process the launch started.
    unsafe {
        libc::kill(pid as i32, sig);
    }
}

/// The launch's worker processes (its children whose command line says `worker`).
fn workers_of(launch: u32) -> Vec<u32> {
    let children = std::fs::read_to_string(format!("/proc/{launch}/task/{launch}/children"))
        .expect("/proc lists a process's children");
    children
        .split_whitespace()
        .filter_map(|p| p.parse::<u32>().ok())
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| c.split(|&b| b == 0).any(|a| a == b"worker"))
        })
        .collect()
}

/// What happens to the leader once the job has run a few steps under it.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// kill -9.
    Kill,
    /// kill -9 of the leader and of a worker at once.
    KillWithWorker,
    /// kill -9, then kill -9 of the next leader as soon as it is elected (mid-takeover).
    KillTwice,
    /// SIGSTOP past its lease; SIGCONT once another leads: it must exit without leading.
    Stop,
    /// A drain through the leader's control endpoint, and kill -9 of the leader right after:
    /// the reshard is under way, or committed and not yet carried out.
    KillMidReshard,
}

/// Two free loopback ports in a row (the launch's coordinators serve their control endpoints
/// on consecutive ports): the first.
fn two_free_ports() -> u16 {
    loop {
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = a.local_addr().unwrap().port();
        if port < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
}

/// N in `coordinator cN (pid P) leads ...`.
fn leader_index(line: &str) -> u16 {
    let id = line["coordinator c".len()..]
        .split_whitespace()
        .next()
        .unwrap();
    id.parse().unwrap()
}

/// Reads lines into `seen` until one satisfies `want`; `what` names it for the failure.
fn until(job: &Proc, seen: &mut Vec<String>, what: &str, want: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(line) = job.lines.recv_timeout(left) else {
            panic!("no {what} within {DEADLINE:?}: {}", seen.join("\n"));
        };
        seen.push(line.clone());
        if want(&line) {
            return line;
        }
    }
}

/// The standby's control endpoint (`port`) says who leads (`GET /status`: 200) and refuses
/// the rest (503 `standby`): only the leader acts on the job.
fn standby_answers(port: u16, leader: u32) {
    let addr = format!("127.0.0.1:{port}");
    let (code, body) = common::procs::http(&addr, "GET", "/status");
    assert_eq!(code, 200, "{body}");
    let status: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(status["role"], "standby", "{body}");
    assert_eq!(status["leader"]["pid"], leader, "{body}");
    let (code, body) = common::procs::http(&addr, "POST", "/ranks/2/drain");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("\"standby\""), "{body}");
}

/// Runs a three-worker job under `coordinators` coordinators on `meta`, applies `fault` to
/// the leader mid-run, and checks the job ends with rc 0 and the fault-free digest.
fn leader_fault(meta: &str, coordinators: u32, fault: Fault) -> String {
    let flags = flags_with("mlp", 3, 800, &["--replicate-every", "1"]);
    let reference = reference_digest(3, &flags);
    let control = (coordinators == 2).then(two_free_ports);
    let mut job = Proc::spawn(&mut launch(coordinators, &flags, meta, control));
    let mut seen = Vec::new();
    let elected = until(&job, &mut seen, "election", is_election);
    let leader = leader_pid(&elected);
    // Two progress lines (one every tenth of the run) under it: the fault lands mid-run.
    for _ in 0..2 {
        until(&job, &mut seen, "step", |l| l.starts_with("step "));
    }
    if let Some(base) = control {
        standby_answers(base + 1 - leader_index(&elected), leader);
    }
    match fault {
        Fault::Kill => signal(leader, libc::SIGKILL),
        Fault::KillWithWorker => {
            let worker = *workers_of(job.id()).first().expect("a worker");
            signal(leader, libc::SIGKILL);
            signal(worker, libc::SIGKILL);
        }
        Fault::KillTwice => {
            signal(leader, libc::SIGKILL);
            let next = leader_pid(&until(&job, &mut seen, "second election", is_election));
            signal(next, libc::SIGKILL);
        }
        Fault::Stop => {
            signal(leader, libc::SIGSTOP);
            until(&job, &mut seen, "second election", is_election);
            signal(leader, libc::SIGCONT);
        }
        Fault::KillMidReshard => {
            let port = control.unwrap() + leader_index(&elected);
            let (code, body) =
                common::procs::http(&format!("127.0.0.1:{port}"), "POST", "/ranks/2/drain");
            assert_eq!(code, 202, "{body}");
            signal(leader, libc::SIGKILL);
        }
    }
    let status = job.wait_until(Instant::now() + DEADLINE);
    seen.extend(job.rest());
    let out = seen.join("\n");
    let err = job.stderr();
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(0),
        "{fault:?}: {out}\n{err}"
    );
    let elections: Vec<&String> = seen.iter().filter(|l| is_election(l)).collect();
    let want = if matches!(fault, Fault::KillTwice) {
        3
    } else {
        2
    };
    assert_eq!(elections.len(), want, "{fault:?}: {out}");
    assert!(
        elections[1..].iter().all(|e| leader_pid(e) != leader),
        "{out}"
    );
    assert_eq!(digest(&out), Some(reference), "{fault:?}: {out}\n{err}");
    out + "\n" + &err
}

#[test]
fn kill_9_of_the_leading_coordinator_on_a_file_store_loses_nothing() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = leader_fault(&format!("file:{}", dir.path().display()), 2, Fault::Kill);
    assert_eq!(out.matches("re-attached to the leader").count(), 3, "{out}");
}

#[test]
#[ignore = "needs etcd on PATH (apt-get install etcd-server; bash .ci/run installs it)"]
fn kill_9_of_the_leading_coordinator_on_etcd_loses_nothing() {
    common::etcd::require_etcd();
    let out = leader_fault("etcd-local", 2, Fault::Kill);
    assert_eq!(out.matches("re-attached to the leader").count(), 3, "{out}");
}

/// The leader and a worker die together: the new leader re-admits the two that re-attach and
/// recovers the third's shards from their backups.
#[test]
#[ignore = "needs etcd on PATH (apt-get install etcd-server; bash .ci/run installs it)"]
fn the_leader_and_a_worker_lost_together_lose_nothing() {
    common::etcd::require_etcd();
    let out = leader_fault("etcd-local", 2, Fault::KillWithWorker);
    assert_eq!(out.matches("re-attached to the leader").count(), 2, "{out}");
}

/// The leader dies while a drain reshards the job: the new leader carries the job on from the
/// committed map (the drain done or not) and the bits are the fault-free run's.
#[test]
#[ignore = "needs etcd on PATH (apt-get install etcd-server; bash .ci/run installs it)"]
fn kill_9_of_the_leader_mid_reshard_loses_nothing() {
    common::etcd::require_etcd();
    leader_fault("etcd-local", 2, Fault::KillMidReshard);
}

/// The second leader dies as soon as it is elected, inside its takeover: the third takes over.
#[test]
#[ignore = "needs etcd on PATH (apt-get install etcd-server; bash .ci/run installs it)"]
fn a_second_failover_during_the_first_loses_nothing() {
    common::etcd::require_etcd();
    leader_fault("etcd-local", 3, Fault::KillTwice);
}

/// A leader frozen past its lease (SIGSTOP) is replaced; resumed (SIGCONT), it finds its lease
/// lost and exits without commanding or writing anything: the job ends with the fault-free
/// digest under the new leader.
#[test]
#[ignore = "needs etcd on PATH (apt-get install etcd-server; bash .ci/run installs it)"]
fn a_leader_stopped_past_its_lease_steps_down_when_resumed() {
    common::etcd::require_etcd();
    let out = leader_fault("etcd-local", 2, Fault::Stop);
    assert!(
        out.contains("lost its lease on the metadata store"),
        "{out}"
    );
}

/// A malformed URL, a missing directory, an unreachable etcd and a missing job id: one line
/// each, exit code 2, before anything starts.
#[test]
fn bad_store_input_is_one_line_exit_2() {
    let dir = secrets();
    let flags = flags_with("mlp", 1, 3, &[]);
    let cases: [(&[&str], &str); 4] = [
        (
            &["--meta", "zk://127.0.0.1:2181", "--job-id", "j"],
            "--meta",
        ),
        (
            &[
                "--meta",
                "file:/nonexistent-ezero-dir/meta",
                "--job-id",
                "j",
            ],
            "/nonexistent-ezero-dir/meta",
        ),
        (
            &["--meta", "etcd://127.0.0.1:1", "--job-id", "j"],
            "127.0.0.1:1",
        ),
        (&["--meta", "file:/tmp"], "--job-id"),
    ];
    for (meta, names) in cases {
        let started = Instant::now();
        let (code, out, err) = run(common::procs::coordinator(2, "t", dir.path())
            .args(meta)
            .args(&flags));
        assert_eq!(code, 2, "{meta:?}: {out}\n{err}");
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{meta:?}: one line: {err}");
        assert!(lines[0].contains(names), "{meta:?}: {err}");
        assert!(started.elapsed() < Duration::from_secs(60), "{meta:?}");
    }
}

/// A job id already used by a job with another config is refused, naming the digest found.
#[test]
fn a_job_id_of_another_config_is_refused() {
    let store = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let meta = format!("file:{}", store.path().display());
    let dir = secrets();
    let first = flags_with("mlp", 1, 3, &[]);
    // The first coordinator registers the job and waits for its workers.
    let mut c = common::procs::Coordinator::spawn(
        common::procs::coordinator(2, "t", dir.path())
            .args([
                "--meta",
                &meta,
                "--job-id",
                "shared",
                "--join-timeout-ms",
                "60000",
            ])
            .args(&first),
    );
    let _ = c.proc.wait_for_line("coordinator ");
    c.proc.kill().unwrap();
    let _ = c.proc.wait_until(Instant::now() + DEADLINE);
    let other = flags_with("mlp", 1, 4, &[]);
    let (code, out, err) = run(common::procs::coordinator(2, "t", dir.path())
        .args(["--meta", &meta, "--job-id", "shared"])
        .args(&other));
    assert_eq!(code, 2, "{out}\n{err}");
    assert!(err.contains("shared") && err.contains("digest"), "{err}");
}

/// `--meta file:DIR` on one host: the only coordinator is killed and started again on the same
/// address; the workers wait for it (`--leader-wait-ms`), re-attach, and the job ends with the
/// fault-free digest.
#[test]
fn a_coordinator_restarted_on_a_file_store_picks_the_job_up() {
    let store = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let meta = format!("file:{}", store.path().display());
    let dir = secrets();
    let flags = flags_with("mlp", 3, 800, &["--replicate-every", "1"]);
    let reference = reference_digest(3, &flags);
    // The first coordinator takes a port of its own and the second is started on it: a port
    // reserved and released beforehand may be handed to another test's process meanwhile.
    let coordinator = |addr: &str| {
        let mut cmd = common::procs::ezero("t", dir.path());
        cmd.args(["coordinator", "--listen", addr, "--ranks", "3"])
            .args(["--meta", &meta, "--job-id", "restarted"])
            .args(["--lease-ttl-ms", "1000", "--reattach-wait-ms", "10000"])
            .args(["--heartbeat-ms", "100", "--heartbeat-timeout-ms", "2000"])
            .args(&flags);
        cmd
    };
    let common::procs::Coordinator {
        proc: mut first,
        addr,
    } = common::procs::Coordinator::spawn(&mut coordinator("127.0.0.1:0"));
    let workers: Vec<Proc> = (0..3)
        .map(|i| {
            Proc::spawn(
                common::procs::worker(&addr, "t", dir.path())
                    .env("EZERO_RANK_HINT", i.to_string())
                    .env("EZERO_LEADER_WAIT_MS", "60000"),
            )
        })
        .collect();
    let mut seen = Vec::new();
    let steps = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        until(&first, &mut seen, "election", is_election);
        for _ in 0..2 {
            until(&first, &mut seen, "step", |l| l.starts_with("step "));
        }
    }));
    if steps.is_err() {
        let err = first.stderr();
        let workers: Vec<String> = workers.iter().map(|w| w.stderr()).collect();
        panic!("the first coordinator ran no steps: {err}\nworkers: {workers:?}");
    }
    first.kill().unwrap();
    let _ = first.wait_until(Instant::now() + DEADLINE);
    let mut second = Proc::spawn(&mut coordinator(&addr));
    let status = second.wait_until(Instant::now() + DEADLINE);
    let out = second.rest().join("\n");
    let err = second.stderr();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{out}\n{err}");
    assert!(out.contains("taking over job restarted"), "{out}");
    assert_eq!(digest(&out), Some(reference), "{out}\n{err}");
    for mut w in workers {
        let status = w.wait_until(Instant::now() + DEADLINE);
        let lines = w.rest();
        assert_eq!(status.and_then(|s| s.code()), Some(0), "{lines:?}");
        assert!(
            lines
                .iter()
                .any(|l| l.contains("re-attached to the leader")),
            "{lines:?}"
        );
    }
}
