//! The coordinator may die too: `ezero launch --coordinators 2` keeps the job's state in a
//! metadata store, and when the leading coordinator is killed (kill -9, mid-run) the standby
//! takes over, the workers re-attach without restarting, and the run ends with the fault-free
//! `param-sha256`. Bad store input is refused with one line and exit code 2 before anything
//! starts. Every wait has a deadline.

use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::procs::{digest, flags_with, reference_digest, run, secrets, Proc, DEADLINE, EZERO};

/// `ezero launch` with two coordinators on a fresh store directory, short leases and fast
/// heartbeats; `flags` are the train flags.
fn launch_two(flags: &[String], meta: &str) -> Command {
    let mut cmd = Command::new(EZERO);
    cmd.args(["launch", "--nprocs", "3", "--coordinators", "2"])
        .args(["--meta", meta, "--job-id", "failover-test"])
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

const LEADS: &str = "coordinator c";

fn kill_9_of_the_leader_mid_run(meta: &str) {
    let flags = flags_with("mlp", 3, 2000, &["--replicate-every", "1"]);
    let reference = reference_digest(3, &flags);
    let job = Proc::spawn(&mut launch_two(&flags, meta));
    let mut seen = Vec::new();
    let deadline = Instant::now() + DEADLINE;
    // The first election, then a few steps under it.
    let leader = loop {
        let line = job.lines.recv_timeout(DEADLINE).expect("the launch prints");
        seen.push(line.clone());
        if line.starts_with(LEADS) && line.contains("leads the job from term") {
            break leader_pid(&line);
        }
        assert!(Instant::now() < deadline, "no election: {seen:?}");
    };
    // Two progress lines (one every tenth of the run) under it: the kill lands mid-run.
    let mut steps = 0;
    while steps < 2 {
        let line = job.lines.recv_timeout(DEADLINE).expect("steps run");
        steps += usize::from(line.starts_with("step "));
        seen.push(line);
    }
    // SAFETY: kill(2) has no memory effects; the pid is the leader the launch started.
    unsafe {
        libc::kill(leader as i32, libc::SIGKILL);
    }
    let mut job = job;
    let status = job.wait_until(Instant::now() + DEADLINE);
    seen.extend(job.lines.try_iter());
    let out = seen.join("\n");
    let err = job.stderr();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{out}\n{err}");
    let elections: Vec<&String> = seen
        .iter()
        .filter(|l| l.contains("leads the job from term"))
        .collect();
    assert_eq!(elections.len(), 2, "one election, then the takeover: {out}");
    assert_ne!(leader_pid(elections[1]), leader, "{out}");
    assert_eq!(
        out.matches("re-attached to the leader").count(),
        3,
        "every worker re-attached: {out}\n{err}"
    );
    assert_eq!(digest(&out), Some(reference), "{out}\n{err}");
}

#[test]
fn kill_9_of_the_leading_coordinator_on_a_file_store_loses_nothing() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    kill_9_of_the_leader_mid_run(&format!("file:{}", dir.path().display()));
}

#[test]
fn kill_9_of_the_leading_coordinator_on_etcd_loses_nothing() {
    assert!(
        which("etcd"),
        "needs the etcd binary on PATH (Debian: apt-get install etcd-server; .ci/run installs it)"
    );
    kill_9_of_the_leader_mid_run("etcd-local");
}

fn which(bin: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
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
