//! Helpers for tests that run `ezero` processes (`train`, `launch`, `coordinator`, `worker`) on
//! 127.0.0.1. Every wait has a deadline, and a process a test drops is killed, so a failing test
//! leaves nothing running.
//!
//! The binary is the one Cargo built for this package: integration tests get its path at compile
//! time in `CARGO_BIN_EXE_ezero`.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub const EZERO: &str = env!("CARGO_BIN_EXE_ezero");
/// Generous bound for any one process-level test step on a loaded 2-core machine.
pub const DEADLINE: Duration = Duration::from_secs(120);

/// The first line `ezero coordinator` prints, before the address it listens on.
const LISTENING: &str = "ezero coordinator: listening on ";

/// The flags of `tests/common::small` (a 2-layer model, 3 steps).
pub fn small(model: &str, stage: u8) -> Vec<String> {
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

/// `small` with another step count and extra train flags.
pub fn flags_with(model: &str, stage: u8, steps: u64, extra: &[&str]) -> Vec<String> {
    let mut flags = small(model, stage);
    let at = flags.iter().position(|f| f == "--steps").unwrap() + 1;
    flags[at] = steps.to_string();
    flags.extend(extra.iter().map(|s| s.to_string()));
    flags
}

/// A fresh cluster CA in a temporary directory (removed when dropped), for `--secrets`.
pub fn secrets() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    elastic_zero::net::init_secrets(dir.path()).unwrap();
    dir
}

/// The digest in a run's `param-sha256: HEX` line.
pub fn digest(stdout: &str) -> Option<String> {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("param-sha256: "))
        .map(str::to_string)
}

/// `ezero` with the cluster token and the secrets directory a coordinator or worker reads.
pub fn ezero(token: &str, secrets: &Path) -> Command {
    let mut cmd = Command::new(EZERO);
    cmd.env("EZERO_CLUSTER_TOKEN", token)
        .env("EZERO_SECRETS_DIR", secrets);
    // A test run inside a scheduler's job must not hand its variables to the workers.
    for var in SCHEDULER_VARS {
        cmd.env_remove(var);
    }
    cmd
}

/// The variables `ezero worker` reads from Slurm, torchrun and Kubernetes.
pub const SCHEDULER_VARS: [&str; 10] = [
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "JOB_COMPLETION_INDEX",
    "EZERO_RANK_HINT",
];

/// `ezero coordinator` for `ranks` workers, listening on an ephemeral loopback port.
pub fn coordinator(ranks: u32, token: &str, secrets: &Path) -> Command {
    let mut cmd = ezero(token, secrets);
    cmd.args(["coordinator", "--listen", "127.0.0.1:0", "--ranks"])
        .arg(ranks.to_string());
    cmd
}

/// `ezero worker` joining the coordinator at `addr`.
pub fn worker(addr: &str, token: &str, secrets: &Path) -> Command {
    let mut cmd = ezero(token, secrets);
    cmd.args(["worker", "--join", addr]);
    cmd
}

/// Runs to completion within the deadline; (code, stdout, stderr). The code is -1 when the
/// process was killed at the deadline.
pub fn run(cmd: &mut Command) -> (i32, String, String) {
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

/// The digest of `ezero train --ranks RANKS FLAGS` (the in-process run), which must succeed.
pub fn reference_digest(ranks: u32, flags: &[String]) -> String {
    let (code, out, err) = run(Command::new(EZERO)
        .arg("train")
        .args(["--ranks", &ranks.to_string()])
        .args(flags));
    assert_eq!(code, 0, "train: {err}");
    digest(&out).expect("train prints a digest")
}

/// All of `r`, as one string once it closes.
pub fn collect(r: Option<impl Read + Send + 'static>) -> mpsc::Receiver<String> {
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

/// `r` line by line as the lines come. Reading goes on until `r` closes, so the writer never
/// sees a closed pipe.
fn lines(r: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    rx
}

/// Waits for `child` until `deadline`; kills it and returns `None` past it.
pub fn wait_until(child: &mut Child, deadline: Instant) -> Option<ExitStatus> {
    let exited = exited_by(child, deadline);
    if exited.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    exited
}

/// Waits for `child` until `deadline`; `None` (and still running) past it.
pub fn exited_by(child: &mut Child, deadline: Instant) -> Option<ExitStatus> {
    loop {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A running `ezero` process: its stdout line by line, its stderr whole. Dropping it kills the
/// process (a no-op once it has exited), so a failed assertion leaves no process running.
pub struct Proc {
    child: Child,
    /// Stdout lines as they come; disconnected once the process closed stdout.
    pub lines: mpsc::Receiver<String>,
    err: mpsc::Receiver<String>,
}

impl Proc {
    pub fn spawn(cmd: &mut Command) -> Proc {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("ezero starts");
        let out = lines(child.stdout.take().unwrap());
        let err = collect(child.stderr.take());
        Proc {
            child,
            lines: out,
            err,
        }
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL.
    pub fn kill(&mut self) -> std::io::Result<()> {
        self.child.kill()
    }

    /// The exit status, or `None` when the process was still running at `deadline` (it is
    /// killed then).
    pub fn wait_until(&mut self, deadline: Instant) -> Option<ExitStatus> {
        wait_until(&mut self.child, deadline)
    }

    /// The exit status, or `None` when the process is still running at `deadline` (it is left
    /// running, e.g. to ask it what it waits for).
    pub fn exited_by(&mut self, deadline: Instant) -> Option<ExitStatus> {
        exited_by(&mut self.child, deadline)
    }

    /// All of stderr; blocks until the process has closed it. Empty when called twice.
    pub fn stderr(&self) -> String {
        self.err.recv().unwrap_or_default()
    }

    /// Stdout lines up to and including the next one that starts with `prefix`, within the
    /// deadline.
    pub fn lines_until(&self, prefix: &str) -> Vec<String> {
        let deadline = Instant::now() + DEADLINE;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.lines.recv_timeout(left).unwrap_or_else(|e| {
                panic!("no stdout line starting with {prefix:?} ({e}); before it: {seen:?}")
            });
            let found = line.starts_with(prefix);
            seen.push(line);
            if found {
                return seen;
            }
        }
    }

    /// The stdout lines not read yet, up to the end of stdout: for a process that has exited,
    /// whose last lines may still be on their way from the reading thread (`try_iter` would
    /// miss them).
    pub fn rest(&self) -> Vec<String> {
        let mut lines = Vec::new();
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(10)) {
            lines.push(l);
        }
        lines
    }

    /// The next stdout line that starts with `prefix` (earlier ones are skipped).
    pub fn wait_for_line(&self, prefix: &str) -> String {
        self.lines_until(prefix).pop().unwrap()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A coordinator that has printed the address it listens on.
pub struct Coordinator {
    pub proc: Proc,
    pub addr: String,
}

impl Coordinator {
    /// Starts `cmd` (see [`coordinator`]) and reads its address from its first line.
    pub fn spawn(cmd: &mut Command) -> Coordinator {
        let proc = Proc::spawn(cmd);
        let first = proc
            .lines
            .recv_timeout(DEADLINE)
            .expect("the coordinator prints its address");
        let addr = first
            .strip_prefix(LISTENING)
            .unwrap_or_else(|| panic!("the address line, not {first:?}"))
            .to_string();
        Coordinator { proc, addr }
    }
}

/// One HTTP/1.1 request to a control endpoint; (status, body), or why there was no answer.
pub fn try_http(addr: &str, method: &str, target: &str) -> Result<(u16, String), String> {
    try_http_with(addr, method, target, "")
}

/// [`try_http`] with extra header lines (each ending in `\r\n`).
pub fn try_http_with(
    addr: &str,
    method: &str,
    target: &str,
    headers: &str,
) -> Result<(u16, String), String> {
    let mut sock = std::net::TcpStream::connect(addr).map_err(|e| format!("{addr}: {e}"))?;
    sock.set_read_timeout(Some(DEADLINE))
        .map_err(|e| e.to_string())?;
    let req =
        format!("{method} {target} HTTP/1.1\r\nHost: test\r\n{headers}Content-Length: 0\r\n\r\n");
    std::io::Write::write_all(&mut sock, req.as_bytes()).map_err(|e| e.to_string())?;
    let mut text = String::new();
    sock.read_to_string(&mut text).map_err(|e| e.to_string())?;
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status line in {text:?}"))?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    Ok((status, body.to_string()))
}

/// One HTTP/1.1 request to a control endpoint, which must answer; (status, body).
pub fn http(addr: &str, method: &str, target: &str) -> (u16, String) {
    try_http(addr, method, target).expect("the endpoint answers")
}

/// The address in a `control endpoint: http://ADDR (...)` line.
pub fn control_addr(line: &str) -> String {
    line.strip_prefix("control endpoint: http://")
        .and_then(|rest| rest.split_whitespace().next())
        .expect("control endpoint line")
        .to_string()
}
