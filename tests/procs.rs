//! Ranks as processes: `ezero launch`, `ezero coordinator` and `ezero worker` on 127.0.0.1.
//! Bit-for-bit parity with the in-process run, failure detection (kill -9, a silent process),
//! and clear errors. Every wait has a deadline; no test asserts on wall-clock durations.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use elastic_zero::runtime::control_plane::ToCoord;

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

/// A fresh cluster CA in a temporary directory (removed when dropped), for `--secrets`.
fn secrets() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    elastic_zero::net::init_secrets(dir.path()).unwrap();
    dir
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

/// A coordinator and three workers.
struct Job {
    coord: Child,
    coord_lines: mpsc::Receiver<String>,
    coord_err: mpsc::Receiver<String>,
    workers: Vec<(Child, mpsc::Receiver<String>)>,
    _secrets: tempfile::TempDir,
}

/// `small` with another step count and extra train flags.
fn flags_with(model: &str, stage: u8, steps: u64, extra: &[&str]) -> Vec<String> {
    let mut flags = small(model, stage);
    let at = flags.iter().position(|f| f == "--steps").unwrap() + 1;
    flags[at] = steps.to_string();
    flags.extend(extra.iter().map(|s| s.to_string()));
    flags
}

/// Fast heartbeats and no in-memory backups, training long enough that a fault lands mid-run.
fn start_job(port_hint: &str) -> Job {
    let flags = flags_with("mlp", 3, 1_000_000, &["--replicate-every", "0"]);
    let timing = ["--heartbeat-ms", "100", "--heartbeat-timeout-ms", "1000"];
    start_job_with(port_hint, &flags, &timing)
}

fn start_job_with(port_hint: &str, flags: &[String], coord_flags: &[&str]) -> Job {
    let token = format!("test-token-{port_hint}");
    let dir = secrets();
    let mut coord = Command::new(EZERO)
        .args(["coordinator", "--listen", "127.0.0.1:0", "--ranks", "3"])
        .args(coord_flags)
        .args(flags)
        .env("EZERO_CLUSTER_TOKEN", &token)
        .env("EZERO_SECRETS_DIR", dir.path())
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
                .env("EZERO_SECRETS_DIR", dir.path())
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
        _secrets: dir,
    }
}

impl Job {
    /// The coordinator's next stdout line starting with `prefix` (earlier ones are skipped).
    fn wait_for_line(&self, prefix: &str) -> String {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.coord_lines.recv_timeout(left).expect("the line comes");
            if line.starts_with(prefix) {
                return line;
            }
        }
    }

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
    let dir = secrets();
    let (code, _, err) = run(Command::new(EZERO)
        .env("EZERO_SECRETS_DIR", dir.path())
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
    let dir = secrets();
    let mut coord = Command::new(EZERO)
        .args(["coordinator", "--listen", "127.0.0.1:0", "--ranks", "1"])
        .args(["--join-timeout-ms", "100000"])
        .args(small("mlp", 1))
        .env("EZERO_CLUSTER_TOKEN", "right")
        .env("EZERO_SECRETS_DIR", dir.path())
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
        .env("EZERO_SECRETS_DIR", dir.path())
        .env("EZERO_CLUSTER_TOKEN", "wrong"));
    let _ = coord.kill();
    let _ = coord.wait();
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
    };
    let frame = elastic_zero::runtime::control_plane::encode(&hello).unwrap();
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
    let mut coord = Command::new(EZERO)
        .args(["coordinator", "--listen", "127.0.0.1:0", "--ranks", "1"])
        .args(small("mlp", 1))
        .env("EZERO_CLUSTER_TOKEN", "t")
        .env("EZERO_SECRETS_DIR", dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let coord_err = collect(coord.stderr.take());
    let (tx, lines) = mpsc::channel();
    let stdout = coord.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let first = lines.recv_timeout(DEADLINE).expect("the address line");
    let addr = first
        .strip_prefix("ezero coordinator: listening on ")
        .expect("the address line")
        .to_string();
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
    let (code, _, werr) = run(Command::new(EZERO)
        .args(["worker", "--join", &addr])
        .env("EZERO_CLUSTER_TOKEN", "t")
        .env("EZERO_SECRETS_DIR", dir.path()));
    let status = wait_until(&mut coord, Instant::now() + DEADLINE);
    let err = coord_err.recv().unwrap_or_default();
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
    let mut coord = Command::new(EZERO)
        .args(["coordinator", "--listen", "127.0.0.1:0", "--ranks", "2"])
        .args(["--control", "127.0.0.1:0"])
        .args(small("mlp", 1))
        .env("EZERO_CLUSTER_TOKEN", "t")
        .env("EZERO_SECRETS_DIR", dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Keep reading stdout alive until the request is answered: a closed pipe would kill the
    // coordinator at its next line.
    let mut lines = BufReader::new(coord.stdout.take().unwrap()).lines();
    let line = lines
        .by_ref()
        .map_while(Result::ok)
        .find(|l| l.starts_with("control endpoint: "));
    let answer = line.map(|l| http(&control_addr(&l), "GET", "/status"));
    drop(lines);
    let _ = coord.kill();
    let _ = coord.wait();
    let (code, body) = answer.expect("the coordinator prints its endpoint");
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

// ---- Recovery from kill -9 and the HTTP control endpoint in process mode ----

/// One HTTP/1.1 request to the control endpoint; (status, body).
fn http(addr: &str, method: &str, target: &str) -> (u16, String) {
    let mut sock = std::net::TcpStream::connect(addr).expect("the endpoint accepts");
    sock.set_read_timeout(Some(DEADLINE)).unwrap();
    let req = format!("{method} {target} HTTP/1.1\r\nHost: test\r\nContent-Length: 0\r\n\r\n");
    std::io::Write::write_all(&mut sock, req.as_bytes()).unwrap();
    let mut text = String::new();
    sock.read_to_string(&mut text).expect("an answer");
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    (status, body.to_string())
}

/// `GET /status`, once every worker has joined (503 `not_started` before).
fn status(addr: &str) -> serde_json::Value {
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

/// The address in a `control endpoint: http://ADDR (...)` line.
fn control_addr(line: &str) -> String {
    line.strip_prefix("control endpoint: http://")
        .and_then(|rest| rest.split_whitespace().next())
        .expect("control endpoint line")
        .to_string()
}

/// Polls `/status` until `done` holds for it, within the deadline.
fn poll(addr: &str, what: &str, done: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
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

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill").args([sig, &pid.to_string()]).status();
    assert!(ok.is_ok_and(|s| s.success()), "kill {sig} {pid}");
}

fn reference_digest(ranks: u32, flags: &[String]) -> String {
    let (code, out, err) = run(Command::new(EZERO)
        .arg("train")
        .args(["--ranks", &ranks.to_string()])
        .args(flags));
    assert_eq!(code, 0, "train: {err}");
    digest(&out).expect("train prints a digest")
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
    ];
    let mut job = start_job_with("chaos", &flags, &timing);
    let addr = control_addr(&job.wait_for_line("control endpoint: "));
    poll(&addr, "three completed steps", |s| {
        s["telemetry"]["steps_completed"].as_u64() >= Some(3)
    });
    let pid = job.workers[1].0.id();
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
    let _ = job.workers[1].0.wait();
    let deadline = Instant::now() + DEADLINE;
    let status = wait_until(&mut job.coord, deadline);
    let rest: Vec<String> = job.coord_lines.iter().collect();
    let out = rest.join("\n");
    let err = job.coord_err.recv().unwrap_or_default();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{out}\n{err}");
    assert!(
        out.contains("ranks [0, 1, 2] -> [0, 2], lost [1]"),
        "killed inside step {struck}: {out}"
    );
    assert_eq!(digest(&out), Some(reference), "{out}");
    for (i, (mut w, werr)) in job.workers.into_iter().enumerate() {
        if i == 1 {
            continue;
        }
        let code = wait_until(&mut w, deadline).and_then(|s| s.code());
        assert_eq!(
            code,
            Some(0),
            "worker {i}: {}",
            werr.recv().unwrap_or_default()
        );
    }
}

/// `ezero launch --control`: status and metrics, refusals that change nothing, a kill that the
/// job recovers from and a drain, all over HTTP; the digest is the fault-free in-process one.
#[test]
fn launch_control_endpoint_reports_refuses_kills_and_drains() {
    let flags = flags_with("mlp", 3, 600, &["--replicate-every", "1"]);
    let reference = reference_digest(3, &flags);
    let mut launch = Command::new(EZERO)
        .args(["launch", "--nprocs", "3", "--control", "127.0.0.1:0"])
        .arg("--control-allow-kill")
        .arg("--")
        .args(&flags)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("launch starts");
    let (tx, lines) = mpsc::channel();
    let stdout = launch.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let err = collect(launch.stderr.take());
    let mut seen = Vec::new();
    let addr = loop {
        let line = lines.recv_timeout(DEADLINE).expect("the endpoint line");
        seen.push(line.clone());
        if line.starts_with("control endpoint: ") {
            break control_addr(&line);
        }
    };

    let s = status(&addr);
    assert_eq!(s["members"], serde_json::json!([0, 1, 2]), "{s}");
    assert_eq!(s["steps"], 600, "{s}");
    let (code, metrics) = http(&addr, "GET", "/metrics");
    assert_eq!(code, 200);
    assert!(metrics.contains("\nezero_members 3\n"), "{metrics}");

    // Bad input: a clear 4xx or 501, and nothing changes.
    for (method, target, code, error) in [
        ("POST", "/ranks/7/kill", 404, "unknown_rank"),
        ("POST", "/ranks/7/drain", 404, "unknown_rank"),
        ("POST", "/ranks/x/kill", 400, "bad_rank"),
        ("GET", "/ranks/1/kill", 405, "method_not_allowed"),
        ("POST", "/join?count=1", 501, "not_supported"),
        ("POST", "/checkpoint", 501, "not_supported"),
    ] {
        let (got, body) = http(&addr, method, target);
        assert_eq!(got, code, "{method} {target}: {body}");
        let body: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["error"], error, "{method} {target}: {body}");
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

    let status = wait_until(&mut launch, Instant::now() + DEADLINE);
    seen.extend(lines.iter());
    let out = seen.join("\n");
    let err = err.recv().unwrap_or_default();
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
