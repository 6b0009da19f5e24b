//! Worker processes over the UCX data plane (`--transport ucx`): the in-process digest at 2 and
//! 3 processes and stages 1 and 3, with joins and leaves, kill -9 recovered from buddy backups,
//! and a stop naming the rank without them. Each worker's last line says which peers it reached
//! over UCX and what arrived that way, so a run that quietly fell back to TCP fails.
//!
//! They need libucx0, so they are ignored by plain `cargo test`; `cargo test --
//! --include-ignored` (what `.ci/run` runs) fails them if it is missing.

use crate::common;
use crate::procs::start_job_over;
use crate::procs_elastic::kill_9_inside_a_step_is_recovered;

use std::process::Command;

use common::procs::{digest, flags_with, reference_digest, run, small, EZERO};
use elastic_zero::runtime::transport::ucx;

fn require() {
    if let Err(e) = ucx::library() {
        panic!("this test needs libucx0 (apt-get install libucx0): {e}");
    }
}

/// `ezero launch --transport ucx --nprocs N -- FLAGS`: (code, stdout, stderr).
fn launch_ucx(nprocs: u32, flags: &[String]) -> (i32, String, String) {
    let n = nprocs.to_string();
    run(Command::new(EZERO)
        .args(["launch", "--transport", "ucx", "--nprocs", &n, "--"])
        .args(flags))
}

/// Every worker reached every other over UCX and received frames that way; how many payloads
/// each copied out of its peers' staging slots.
fn assert_all_over_ucx(out: &str, nprocs: u32) -> Vec<u64> {
    let mut staged = Vec::new();
    for r in 0..nprocs {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("[worker {r}] ezero worker: data plane: ")))
            .unwrap_or_else(|| panic!("worker {r} reports its data plane: {out}"));
        let others: Vec<String> = (0..nprocs)
            .filter(|&p| p != r)
            .map(|p| p.to_string())
            .collect();
        assert!(
            line.contains(&format!("ucx to ranks [{}]", others.join(", "))),
            "{line}"
        );
        let frames: u64 = line
            .split_once(" (")
            .and_then(|(_, rest)| rest.split_once(" frames"))
            .and_then(|(n, _)| n.parse().ok())
            .unwrap_or_else(|| panic!("a frame count: {line}"));
        assert!(frames > 0, "{line}");
        staged.push(
            line.split_once(" MiB received, ")
                .and_then(|(_, rest)| rest.split_once(" payloads from peers' staging slots"))
                .and_then(|(n, _)| n.parse().ok())
                .unwrap_or_else(|| panic!("a staged count: {line}")),
        );
    }
    staged
}

#[ignore = "needs libucx0 (apt-get install libucx0)"]
#[test]
fn launch_over_ucx_gives_the_in_process_digest_at_2_and_3_processes() {
    require();
    for (nprocs, stage, model) in [(2, 1, "gpt"), (3, 1, "mlp"), (2, 3, "mlp"), (3, 3, "gpt")] {
        let flags = small(model, stage);
        let reference = reference_digest(nprocs, &flags);
        let (code, out, err) = launch_ucx(nprocs, &flags);
        let case = format!("{nprocs} processes, stage {stage}, {model}");
        assert_eq!(code, 0, "{case}: {out}\n{err}");
        assert_eq!(digest(&out), Some(reference), "{case}: {out}");
        assert_all_over_ucx(&out, nprocs);
    }
}

/// Payloads of 64 KiB and more go through the senders' shared-memory staging slots, mapped
/// across processes (the tiny models above send none that large), with the same digest.
#[ignore = "needs libucx0 (apt-get install libucx0)"]
#[test]
fn launch_over_ucx_stages_large_payloads_with_the_in_process_digest() {
    require();
    let mut flags = small("gpt", 3);
    let at = flags.iter().position(|f| f == "--d-model").unwrap() + 1;
    flags[at] = "256".into();
    let reference = reference_digest(2, &flags);
    let (code, out, err) = launch_ucx(2, &flags);
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(digest(&out), Some(reference), "{out}");
    let staged = assert_all_over_ucx(&out, 2);
    assert!(staged.iter().all(|&n| n > 0), "{staged:?}: {out}");
}

/// The collectives benchmark over UCX (payloads lent into the receivers' buffers, in pieces,
/// from several peers at once) checks every result it times: a wrong byte fails the run. Each
/// rank's share is a 4 MiB piece and one of 20 KiB, sent by rendezvous but too short to lend
/// for: the engine kept it back for loans while the others' were open, and the all-gather
/// waited for it until its deadline.
#[ignore = "needs libucx0 (apt-get install libucx0)"]
#[test]
fn collectives_over_ucx_land_the_right_bytes() {
    require();
    let (code, out, err) = run(Command::new(EZERO).args([
        "bench",
        "collectives",
        "--transport",
        "ucx",
        "--nprocs",
        "3",
        "--bytes",
        "12644352",
        "--iters",
        "3",
    ]));
    assert_eq!(code, 0, "{out}\n{err}");
    for op in ["all_gather", "reduce_scatter", "all_reduce", "broadcast"] {
        assert!(out.contains(&format!("\"op\":\"{op}\"")), "{op}: {out}");
    }
}

/// A leave moves the leaver's chunks peer to peer over UCX; a joiner is reached over UCX by
/// the members (`AddPeer`) and reaches them (its peer list).
#[ignore = "needs libucx0 (apt-get install libucx0)"]
#[test]
fn leave_and_join_over_ucx_give_the_in_process_digest() {
    require();
    for (nprocs, extra) in [(3, ["--leave", "1@1"]), (2, ["--join", "1@3"])] {
        let flags = flags_with("mlp", 3, 5, &extra);
        let reference = reference_digest(nprocs, &flags_with("mlp", 3, 5, &[]));
        let (code, out, err) = launch_ucx(nprocs, &flags);
        let case = format!("{nprocs} processes {extra:?}");
        assert_eq!(code, 0, "{case}: {out}\n{err}");
        assert_eq!(digest(&out), Some(reference), "{case}: {out}");
        if extra[0] == "--join" {
            assert!(out.contains("ranks [0, 1] -> [0, 1, 2]"), "{out}");
            assert_all_over_ucx(&out, 3);
        } else {
            assert!(out.contains("left the job"), "{out}");
        }
    }
}

#[ignore = "needs libucx0 (apt-get install libucx0)"]
#[test]
fn kill_9_over_ucx_is_recovered_from_buddy_backups_with_the_fault_free_digest() {
    require();
    kill_9_inside_a_step_is_recovered("ucx");
}

/// Without backups the job cannot recover: it stops, naming the killed rank.
#[ignore = "needs libucx0 (apt-get install libucx0)"]
#[test]
fn kill_9_over_ucx_without_backups_stops_naming_the_rank() {
    require();
    let mut job = start_job_over("ucx-kill", "ucx");
    job.coord.wait_for_line("step ");
    job.workers[1].kill().expect("SIGKILL worker 1");
    job.assert_rank_1_reported("control connection lost");
}

/// libucx missing at run time (here: another library name asked for): one line saying what to
/// install, exit 2, before any process starts; the same from `ezero coordinator`.
#[test]
fn a_missing_libucx_is_one_line_exit_2() {
    for args in [
        vec!["launch", "--transport", "ucx", "--nprocs", "2", "--"],
        vec![
            "coordinator",
            "--listen",
            "127.0.0.1:0",
            "--transport",
            "ucx",
        ],
    ] {
        let (code, out, err) = run(Command::new(EZERO)
            .args(&args)
            .args(["--steps", "1"])
            .env(ucx::LIBRARY_ENV, "libucp-not-installed.so.0"));
        assert_eq!(code, 2, "{args:?}: {out}\n{err}");
        assert!(err.contains("apt install libucx0"), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
}

/// `--ucx-net`: refused without `--transport ucx` or with a malformed device list (exit 2,
/// one line); with it, the workers' UCX may also use the device (here loopback), the coordinator
/// warns that such traffic is unencrypted, and the digest is unchanged.
#[ignore = "needs libucx0 (apt-get install libucx0)"]
#[test]
fn ucx_net_is_checked_warned_about_and_keeps_the_digest() {
    for (transport, devices, says) in [
        ("tcp", "eth0", "for --transport ucx only"),
        ("ucx", "eth 0", "device names separated by commas"),
        ("ucx", "eth0,", "device names separated by commas"),
    ] {
        let (code, out, err) = run(Command::new(EZERO).args([
            "launch",
            "--transport",
            transport,
            "--ucx-net",
            devices,
            "--nprocs",
            "2",
            "--",
            "--steps",
            "1",
        ]));
        assert_eq!(code, 2, "{transport} {devices}: {out}\n{err}");
        assert!(err.contains(says), "{err}");
    }
    require();
    let flags = small("gpt", 3);
    let reference = reference_digest(2, &flags);
    let (code, out, err) = run(Command::new(EZERO)
        .args([
            "launch",
            "--transport",
            "ucx",
            "--ucx-net",
            "lo",
            "--nprocs",
            "2",
            "--",
        ])
        .args(&flags));
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(err.contains("unencrypted"), "{err}");
    assert_eq!(digest(&out), Some(reference), "{out}");
    assert_all_over_ucx(&out, 2);
}
