//! Ranks as processes: `ezero launch`, `ezero coordinator` and `ezero worker` on 127.0.0.1.
//! Bit-for-bit parity with the in-process run, failure detection (kill -9, a silent process),
//! and clear errors. Every wait has a deadline; no test asserts on wall-clock durations.

use crate::common;

use std::io::Read;
use std::process::Command;
use std::time::Instant;

use common::procs::{
    control_addr, coordinator, digest, flags_with, http, reference_digest, run, secrets, small,
    worker, Coordinator, Proc, DEADLINE, EZERO,
};
use elastic_zero::runtime::procs::control_plane::ToCoord;

#[test]
fn launch_gives_the_in_process_digest_with_2_and_3_processes() {
    for (nprocs, stage, model) in [(2, 1, "mlp"), (3, 1, "gpt"), (2, 3, "gpt"), (3, 3, "mlp")] {
        let flags = small(model, stage);
        let reference = reference_digest(nprocs as u32, &flags);
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
        // All on this host: an automatic compute_threads shares its cores among them.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = format!(", {} compute threads", (cores / nprocs).max(1));
        assert_eq!(out.matches(&threads).count(), nprocs, "{threads}: {out}");
    }
}

/// Workers with everything on their tiers (each under `worker-R/` of the one `--nvme-dir`): the
/// run ends with the parameters' digest read from the workers a piece at a time (the
/// coordinator gathers no chunks) and equals the in-process run's.
#[test]
fn launch_with_state_on_the_tier_gives_the_in_process_digest() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let flags = small("gpt", 3);
    let reference = reference_digest(2, &flags);
    let tier = ["--offload-optimizer", "nvme", "--offload-params", "nvme"];
    let (code, out, err) = run(Command::new(EZERO)
        .args(["launch", "--nprocs", "2", "--"])
        .args(&flags)
        .args(tier)
        .args(["--offload-grads", "nvme", "--nvme-record-elems", "1024"])
        .args(["--nvme-dir", dir.path().to_str().unwrap()]));
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(digest(&out).as_deref(), Some(reference.as_str()), "{out}");
}

/// A model of tens of trillions of parameters is refused by the coordinator with the numbers,
/// as `ezero train` refuses it: from what the workers said they have free, before it plans
/// billions of chunks (which ran past the deadline), and every worker is told why.
#[test]
fn launch_refuses_a_model_that_cannot_fit_before_planning_it() {
    let (code, out, err) = run(Command::new(EZERO)
        .args(["launch", "--nprocs", "2", "--"])
        .args(["--d-model", "131072", "--layers", "200"]));
    assert_ne!(code, 0, "{out}\n{err}");
    assert_ne!(code, -1, "still running at the deadline: {out}\n{err}");
    let all = format!("{out}\n{err}");
    assert!(
        all.contains("the model cannot fit on rank") && all.contains("parameters 76800.78 GiB"),
        "{all}"
    );
    assert_eq!(
        all.matches("the coordinator refused this worker").count(),
        2,
        "{all}"
    );
    assert!(!all.contains("param-sha256"), "{all}");
}

/// A coordinator and three workers.
pub struct Job {
    pub coord: Proc,
    pub workers: Vec<Proc>,
    _secrets: tempfile::TempDir,
}

/// Fast heartbeats and no in-memory backups, training long enough that a fault lands mid-run.
pub fn start_job(port_hint: &str) -> Job {
    start_job_over(port_hint, "tcp")
}

/// [`start_job`] over data plane `transport`.
pub fn start_job_over(port_hint: &str, transport: &str) -> Job {
    let flags = flags_with("mlp", 3, 1_000_000, &["--replicate-every", "0"]);
    let timing = [
        "--heartbeat-ms",
        "100",
        "--heartbeat-timeout-ms",
        "1000",
        "--transport",
        transport,
    ];
    start_job_with(port_hint, &flags, &timing)
}

pub fn start_job_with(port_hint: &str, flags: &[String], coord_flags: &[&str]) -> Job {
    let token = format!("test-token-{port_hint}");
    let dir = secrets();
    let Coordinator { proc: coord, addr } = Coordinator::spawn(
        coordinator(3, &token, dir.path())
            .args(coord_flags)
            .args(flags),
    );
    let workers = (0..3)
        .map(|i| {
            Proc::spawn(worker(&addr, &token, dir.path()).env("EZERO_RANK_HINT", i.to_string()))
        })
        .collect();
    Job {
        coord,
        workers,
        _secrets: dir,
    }
}

impl Job {
    /// After rank 1 was hit: the coordinator and the other workers exit within the deadline,
    /// non-zero, naming rank 1.
    pub fn assert_rank_1_reported(mut self, expect: &str) {
        let deadline = Instant::now() + DEADLINE;
        let status = self.coord.wait_until(deadline);
        let err = self.coord.stderr();
        let status = status.expect("the coordinator exits in time (it did not: killed)");
        assert_eq!(status.code(), Some(1), "{err}");
        assert!(err.contains("rank 1"), "{err}");
        assert!(err.contains(expect), "{err}");
        assert!(err.contains("not saved"), "{err}");
        for (i, mut w) in self.workers.into_iter().enumerate() {
            if i == 1 {
                // Killed already, or stopped and never coming back: dropping it kills it.
                continue;
            }
            let status = w.wait_until(deadline);
            let werr = w.stderr();
            let status = status.expect("a surviving worker exits in time (it did not: killed)");
            assert_eq!(status.code(), Some(1), "worker {i}: {werr}");
            assert!(werr.contains("rank 1"), "worker {i}: {werr}");
        }
    }
}

#[test]
fn kill_9_of_a_worker_mid_run_is_reported_and_the_others_exit() {
    let mut job = start_job("kill");
    job.coord.wait_for_line("step ");
    job.workers[1].kill().expect("SIGKILL worker 1");
    job.assert_rank_1_reported("control connection lost");
}

#[test]
fn a_silent_worker_is_declared_failed_after_the_heartbeat_timeout() {
    let job = start_job("stop");
    job.coord.wait_for_line("step ");
    let pid = job.workers[1].id().to_string();
    let stopped = Command::new("kill").args(["-STOP", &pid]).status();
    assert!(stopped.is_ok_and(|s| s.success()), "kill -STOP works here");
    // Its socket stays open: only the missing heartbeats can reveal it.
    job.assert_rank_1_reported("heartbeat_timeout_ms");
}

#[test]
fn an_unanswering_coordinator_is_a_clear_error() {
    // Port 1 on loopback: nothing listens there.
    let dir = secrets();
    let (code, _, err) =
        run(worker("127.0.0.1:1", "t", dir.path()).args(["--connect-timeout-ms", "300"]));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("cannot reach the coordinator at 127.0.0.1:1"),
        "{err}"
    );
}

#[test]
fn a_worker_with_the_wrong_token_is_refused() {
    let dir = secrets();
    let coord = Coordinator::spawn(
        coordinator(1, "right", dir.path())
            .args(["--join-timeout-ms", "100000"])
            .args(small("mlp", 1)),
    );
    let (code, _, err) = run(&mut worker(&coord.addr, "wrong", dir.path()));
    drop(coord);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("refused") && err.contains("token"), "{err}");
}

/// A TLS client of the control port: completes what it can of the handshake with `config` and
/// sends a hello with the right token; true when the coordinator answered anything.
fn control_client(addr: &str, config: rustls::ClientConfig) -> bool {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).expect("the coordinator accepts");
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    let name = rustls::pki_types::ServerName::try_from("ezero-peer").unwrap();
    let mut conn = rustls::ClientConnection::new(std::sync::Arc::new(config), name).unwrap();
    while conn.is_handshaking() {
        if conn.complete_io(&mut s).is_err() {
            return false;
        }
    }
    let mut tls = rustls::StreamOwned::new(conn, s);
    let hello = ToCoord::Hello {
        token: "t".into(),
        rank_hint: None,
        standby: false,
        available_memory_bytes: None,
    };
    let frame = elastic_zero::runtime::procs::control_plane::encode(&hello).unwrap();
    if tls.write_all(&frame).and_then(|_| tls.flush()).is_err() {
        return false;
    }
    let mut got = [0u8; 1];
    matches!(tls.read(&mut got), Ok(1))
}

fn client_config(
    roots: &[rustls::pki_types::CertificateDer<'static>],
    id: Option<&elastic_zero::net::Identity>,
    alpn: &[u8],
) -> rustls::ClientConfig {
    let mut r = rustls::RootCertStore::empty();
    for c in roots {
        r.add(c.clone()).unwrap();
    }
    let b = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_root_certificates(r);
    let mut c = match id {
        Some(id) => b
            .with_client_auth_cert(vec![id.cert.clone()], id.key.clone_key())
            .unwrap(),
        None => b.with_no_client_auth(),
    };
    c.alpn_protocols = vec![alpn.to_vec()];
    c
}

/// The control port refuses (and logs) clients without a certificate of the cluster CA, or
/// speaking another protocol, and still admits a real worker: the job runs to the end.
#[test]
fn the_control_port_refuses_peers_without_a_cluster_certificate() {
    use elastic_zero::net::{ClusterCa, Identity};
    let dir = secrets();
    let Coordinator {
        proc: mut coord,
        addr,
    } = Coordinator::spawn(coordinator(1, "t", dir.path()).args(small("mlp", 1)));
    let ca_pem = dir.path().join("ca.pem");
    let cluster_ca = {
        use rustls::pki_types::pem::PemObject;
        rustls::pki_types::CertificateDer::from_pem_file(&ca_pem).unwrap()
    };
    let foreign = ClusterCa::generate("someone else").unwrap();
    let stolen = foreign.issue("rank-0").unwrap();
    let member = Identity::from_dir(dir.path(), "rank-0").unwrap();
    let refused = [
        // A certificate from another CA (trusting the cluster's public CA cert).
        client_config(
            std::slice::from_ref(&cluster_ca),
            Some(&stolen),
            b"ezero-control/1",
        ),
        // No client certificate.
        client_config(std::slice::from_ref(&cluster_ca), None, b"ezero-control/1"),
        // A cluster certificate on the data plane's protocol.
        client_config(
            std::slice::from_ref(&cluster_ca),
            Some(&member),
            b"ezero-data/1",
        ),
    ];
    let answered: Vec<bool> = refused
        .into_iter()
        .map(|c| control_client(&addr, c))
        .collect();
    // A real worker still joins, and the job finishes.
    let (code, _, werr) = run(&mut worker(&addr, "t", dir.path()));
    let status = coord.wait_until(Instant::now() + DEADLINE);
    let err = coord.stderr();
    assert_eq!(answered, [false, false, false], "{err}");
    assert_eq!(code, 0, "worker: {werr}");
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{err}");
    let refusals = err.matches("refused a connection from").count();
    assert_eq!(refusals, 3, "{err}");
    assert!(err.contains("TLS handshake failed"), "{err}");
}

/// Without a secrets directory a process does not start: one line, exit 2, saying what to pass.
#[test]
fn a_missing_secrets_directory_is_a_usage_error() {
    for args in [
        &["coordinator", "--listen", "127.0.0.1:0", "--ranks", "1"][..],
        &["worker", "--join", "127.0.0.1:1"][..],
    ] {
        let (code, _, err) = run(Command::new(EZERO)
            .args(args)
            .env("EZERO_CLUSTER_TOKEN", "t")
            .env_remove("EZERO_SECRETS_DIR"));
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains("--secrets DIR"), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
    }
}

#[test]
fn the_endpoint_answers_503_until_every_worker_has_joined() {
    let dir = secrets();
    let coord = Coordinator::spawn(
        coordinator(2, "t", dir.path())
            .args(["--control", "127.0.0.1:0"])
            .args(small("mlp", 1)),
    );
    // `Proc` reads stdout until the coordinator exits, so it never writes to a closed pipe.
    let line = coord.proc.wait_for_line("control endpoint: ");
    let (code, body) = http(&control_addr(&line), "GET", "/status");
    drop(coord);
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains("not_started") && body.contains("0 of 2 workers"),
        "{body}"
    );
}

#[test]
fn bad_launch_input_is_one_line_exit_2() {
    let cases: &[(&[&str], &str)] = &[
        (&["launch", "--nprocs", "0", "--"], "--nprocs"),
        (
            &["launch", "--nprocs", "2", "--", "--ranks", "3"],
            "--ranks",
        ),
        (
            &["launch", "--nprocs", "2", "--join-wait-ms", "0", "--"],
            "join_wait_ms",
        ),
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
        (
            &[
                "launch",
                "--nprocs",
                "2",
                "--control",
                "127.0.0.1:0",
                "--",
                "--control",
                "127.0.0.1:0",
            ],
            "--control is given twice",
        ),
    ];
    for (args, field) in cases {
        let (code, _, err) = run(Command::new(EZERO).args(*args));
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(field), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
    }
    // Flag syntax errors come from the argument parser, with its usage hint after the line.
    let syntax: &[&[&str]] = &[
        &["launch", "--nprocs", "2", "--control", "nope", "--"],
        &["launch", "--nprocs", "2", "--control-allow-kill", "--"],
    ];
    for args in syntax {
        let (code, _, err) = run(Command::new(EZERO).args(*args));
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains("--control"), "{args:?}: {err}");
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

/// Units far larger than a piece (a 512-wide block: 3.1M parameters, so each owner's share
/// moves as 2 pieces in the gathers and 3 in the exact reduce-scatter), over the TLS TCP and
/// QUIC planes: the same digest as in-process, where pieces are never encoded.
#[test]
fn launch_with_payloads_of_several_pieces_gives_the_in_process_digest() {
    let mut flags = small("gpt", 3);
    for (key, value) in [
        ("--d-model", "512"),
        ("--layers", "1"),
        ("--heads", "8"),
        ("--micro-batches", "2"),
        ("--steps", "2"),
        ("--chunk-elems", "262144"),
    ] {
        let at = flags
            .iter()
            .position(|f| f == key)
            .expect("a flag of small()");
        flags[at + 1] = value.into();
    }
    let reference = reference_digest(2, &flags);
    for transport in ["tcp", "quic"] {
        let (code, out, err) = run(Command::new(EZERO)
            .args(["launch", "--transport", transport, "--nprocs", "2", "--"])
            .args(&flags));
        assert_eq!(code, 0, "{transport}: {out}\n{err}");
        assert_eq!(digest(&out), Some(reference.clone()), "{transport}: {out}");
    }
}

/// QUIC data plane (mutual TLS between workers): same digest.
#[test]
fn launch_over_quic_gives_the_in_process_digest() {
    let flags = small("mlp", 3);
    let reference = reference_digest(3, &flags);
    let (code, out, err) = run(Command::new(EZERO)
        .args(["launch", "--transport", "quic", "--nprocs", "3", "--"])
        .args(&flags));
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(digest(&out), Some(reference));
}
