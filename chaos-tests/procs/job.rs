//! Runs one scenario for real: a coordinator and worker processes, every connection through
//! the harness's proxies, the faults at their steps, then the checks (the digest or the
//! documented stop, every process reaped, nothing left bound or on disk).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::net::{tcp_proxy, udp_proxy, Link, LinkState, Net, Proxy};
use super::scenario::{pair_positions, During, Expect, Scenario, What, CHUNK_ELEMS};
use crate::common::procs::{control_addr, digest, try_http, EZERO};

/// Heartbeats and timeouts of every scenario: a frozen or unreachable worker is declared failed
/// after `HEARTBEAT_TIMEOUT_MS`, after its peers gave up on it (`COLLECTIVE_TIMEOUT_MS`) and well
/// before a step counts as stuck (4 x the collective timeout).
const HEARTBEAT_MS: u64 = 100;
const HEARTBEAT_TIMEOUT_MS: u64 = 1500;
const COLLECTIVE_TIMEOUT_MS: u64 = 1000;
/// The whole scenario, start to last process reaped.
const SCENARIO_DEADLINE: Duration = Duration::from_secs(240);
/// One awaited change (a recovery, a join, a drain).
const CHANGE_DEADLINE: Duration = Duration::from_secs(60);

/// What one scenario did.
#[derive(Debug, Default, serde::Serialize)]
pub struct Outcome {
    pub seed: u64,
    /// Why the scenario failed; `None` when every check passed.
    pub failure: Option<String>,
    /// The observed order of events, with milliseconds since the start.
    pub events: Vec<String>,
    /// Faults struck, by kind.
    pub injected: BTreeMap<String, u64>,
    /// Faults not struck: the run ended first, or nothing could take them.
    pub skipped: u64,
    pub recoveries: u64,
    pub rebalances: u64,
    /// Rollbacks with the same ranks after every rank gave up on its peers.
    pub network_retries: u64,
    /// The run ended with the documented stop (as the scenario expected).
    pub documented_stop: bool,
    /// The coordinator's resident memory at the first step and at the last status read, KiB.
    pub coord_rss_kib: (u64, u64),
    pub net: BTreeMap<String, u64>,
    pub wall_ms: u64,
}

/// A child process whose output is collected as it comes; dropping it kills and reaps it.
struct Child {
    child: std::process::Child,
    out: Arc<Mutex<Vec<String>>>,
    err: Arc<Mutex<String>>,
    readers: Vec<JoinHandle<()>>,
    status: Option<ExitStatus>,
}

impl Child {
    fn spawn(cmd: &mut Command) -> Result<Child, String> {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {EZERO}: {e}"))?;
        let out: Arc<Mutex<Vec<String>>> = Arc::default();
        let err: Arc<Mutex<String>> = Arc::default();
        let (o, stdout) = (out.clone(), child.stdout.take().unwrap());
        let (e, mut stderr) = (err.clone(), child.stderr.take().unwrap());
        let readers = vec![
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    o.lock().unwrap().push(line);
                }
            }),
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = stderr.read_to_string(&mut s);
                *e.lock().unwrap() = s;
            }),
        ];
        Ok(Child {
            child,
            out,
            err,
            readers,
            status: None,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn stdout(&self) -> Vec<String> {
        self.out.lock().unwrap().clone()
    }

    fn stderr(&self) -> String {
        self.err.lock().unwrap().clone()
    }

    /// The first stdout line starting with `prefix`, waiting until `deadline`.
    fn line(&mut self, prefix: &str, deadline: Instant) -> Option<String> {
        loop {
            if let Some(l) = self.stdout().into_iter().find(|l| l.starts_with(prefix)) {
                return Some(l);
            }
            if Instant::now() >= deadline || self.exited().is_some() {
                return self.stdout().into_iter().find(|l| l.starts_with(prefix));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn exited(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    /// Waits for the exit until `deadline`; `None` if it was still running (it is then
    /// thawed and killed).
    fn wait(&mut self, deadline: Instant) -> Option<ExitStatus> {
        loop {
            if let Some(s) = self.exited() {
                self.join_readers();
                return Some(s);
            }
            if Instant::now() >= deadline {
                self.reap();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn signal(&self, sig: i32) {
        // Invariant: the pid is our child's and it has not been reaped yet.
        unsafe { libc::kill(self.pid() as i32, sig) };
    }

    fn reap(&mut self) {
        if self.exited().is_none() {
            self.signal(libc::SIGCONT);
            let _ = self.child.kill();
            self.status = self.child.wait().ok();
        }
        self.join_readers();
    }

    fn join_readers(&mut self) {
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.reap();
    }
}

/// How a worker's process must end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// With the job: 0 when the job succeeded.
    WithJob,
    /// `kill -9`.
    Killed,
    /// Declared failed (frozen, or its control link went dark): non-zero, never 0.
    Refused,
    /// Drained: 0.
    Left,
    /// A standby no join took yet: the job may end before it is needed (0), or close on it
    /// while it connects (non-zero); either way it must exit.
    Standby,
}

struct Worker {
    proc: Child,
    rank: Option<u32>,
    proxies: Vec<Proxy>,
    end: End,
}

/// A scenario's running job and what the harness saw of it.
struct Run<'a> {
    sc: &'a Scenario,
    dir: PathBuf,
    secrets: PathBuf,
    token: String,
    net: Arc<Net>,
    coord: Child,
    coord_addr: SocketAddr,
    control: String,
    workers: Vec<Worker>,
    start: Instant,
    out: Outcome,
    ports: Vec<u16>,
}

/// A free loopback port (TCP or UDP), released for the worker to bind.
fn free_port(udp: bool) -> Result<u16, String> {
    let port = if udp {
        UdpSocket::bind("127.0.0.1:0").and_then(|s| s.local_addr())
    } else {
        TcpListener::bind("127.0.0.1:0").and_then(|s| s.local_addr())
    };
    port.map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

/// The train flags of a scenario (for the coordinator and the fault-free reference alike).
pub fn train_flags(sc: &Scenario) -> Vec<String> {
    let s = |x: &str| x.to_string();
    vec![
        s("--model"),
        sc.model.clone(),
        s("--layers"),
        s("2"),
        s("--d-model"),
        s("32"),
        s("--heads"),
        s("4"),
        s("--seq-len"),
        s("16"),
        s("--micro-batches"),
        sc.micro_batches.to_string(),
        s("--micro-batch-size"),
        s("2"),
        s("--steps"),
        sc.steps.to_string(),
        s("--chunk-elems"),
        CHUNK_ELEMS.to_string(),
        s("--warmup-steps"),
        s("1"),
        s("--sample-tokens"),
        s("0"),
        s("--reduce"),
        s("exact"),
        s("--stage"),
        sc.stage.to_string(),
        s("--seed"),
        sc.seed.to_string(),
        s("--replicate-every"),
        if sc.backups { s("1") } else { s("0") },
        s("--collective-timeout-ms"),
        COLLECTIVE_TIMEOUT_MS.to_string(),
    ]
}

/// The digest of the same job in one process without faults (exact reduction makes it the
/// same at every world size).
pub fn reference_digest(sc: &Scenario) -> Result<String, String> {
    let out = Command::new(EZERO)
        .args(["train", "--ranks", &sc.workers.to_string()])
        .args(train_flags(sc))
        .output()
        .map_err(|e| format!("cannot run the reference: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    digest(&text).ok_or_else(|| {
        format!(
            "the fault-free reference run printed no digest: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

impl Run<'_> {
    fn note(&mut self, what: String) {
        let ms = self.start.elapsed().as_millis();
        self.out.events.push(format!("{ms:>6} ms  {what}"));
    }

    fn status(&self) -> Option<Value> {
        match try_http(&self.control, "GET", "/status") {
            Ok((200, body)) => serde_json::from_str(&body).ok(),
            _ => None,
        }
    }

    fn coord_rss_kib(&self) -> Option<u64> {
        let text = std::fs::read_to_string(format!("/proc/{}/status", self.coord.pid())).ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
    }

    /// Polls `/status` until `done` holds; `None` once the job has ended or at the deadline.
    fn until(&mut self, deadline: Duration, done: impl Fn(&Value) -> bool) -> Option<Value> {
        let until = Instant::now() + deadline;
        while Instant::now() < until {
            // 503 until every worker has joined; nothing once the coordinator is gone.
            let Some(s) = self.status() else {
                if self.coord.exited().is_some() {
                    return None;
                }
                std::thread::sleep(Duration::from_millis(15));
                continue;
            };
            if let Some(kib) = self.coord_rss_kib() {
                self.out.coord_rss_kib.1 = kib;
            }
            if s["state"] != "running" {
                return None;
            }
            if done(&s) {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(15));
        }
        None
    }

    fn members(s: &Value) -> Vec<u32> {
        s["members"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|m| m.as_u64())
                    .map(|m| m as u32)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The worker process holding `rank` (learned from its `ezero worker: rank R of W` line,
    /// waiting a little for one that was just taken by a join).
    fn worker_of(&mut self, rank: u32) -> Option<usize> {
        let now = Instant::now();
        self.find_worker(rank, now)
            .or_else(|| self.find_worker(rank, now + Duration::from_secs(3)))
    }

    fn find_worker(&mut self, rank: u32, deadline: Instant) -> Option<usize> {
        for (i, w) in self.workers.iter_mut().enumerate() {
            if w.rank.is_none() && matches!(w.end, End::WithJob | End::Standby) {
                let line = w.proc.line("ezero worker: rank ", deadline);
                w.rank = line.and_then(|l| {
                    l.strip_prefix("ezero worker: rank ")?
                        .split_whitespace()
                        .next()?
                        .parse()
                        .ok()
                });
            }
            if w.rank == Some(rank) {
                return Some(i);
            }
        }
        None
    }

    fn spawn_worker(&mut self, hint: Option<usize>, standby: bool) -> Result<usize, String> {
        let idx = self.workers.len();
        let quic = self.sc.transport == "quic";
        let data_port = free_port(quic)?;
        let upstream: SocketAddr = ([127, 0, 0, 1], data_port).into();
        let data = if quic {
            udp_proxy(Link::Data(idx), upstream, self.net.clone())
        } else {
            tcp_proxy(Link::Data(idx), upstream, self.net.clone())
        }
        .map_err(|e| format!("data proxy: {e}"))?;
        let control = tcp_proxy(Link::Control(idx), self.coord_addr, self.net.clone())
            .map_err(|e| format!("control proxy: {e}"))?;
        let mut cmd = Command::new(EZERO);
        cmd.env("EZERO_CLUSTER_TOKEN", &self.token)
            .env("TMPDIR", self.dir.join("tmp"))
            .args(["worker", "--join", &control.addr.to_string()])
            .args(["--data-listen", &upstream.to_string()])
            .args(["--data-advertise", &data.addr.to_string()])
            .arg("--secrets")
            .arg(&self.secrets);
        if let Some(h) = hint {
            cmd.args(["--rank-hint", &h.to_string()]);
        }
        if standby {
            cmd.arg("--standby");
        }
        let proc = Child::spawn(&mut cmd)?;
        self.net
            .register(idx, proc.pid(), quic.then_some(data_port));
        self.ports.push(data_port);
        self.workers.push(Worker {
            proc,
            rank: None,
            proxies: vec![data, control],
            end: End::WithJob,
        });
        Ok(idx)
    }

    /// The member a pick strikes now, and its worker.
    fn victim(&mut self, pick: u32) -> Option<(u32, usize)> {
        let s = self.status()?;
        let members = Self::members(&s);
        if members.len() < 2 {
            return None;
        }
        let rank = members[pick as usize % members.len()];
        Some((rank, self.worker_of(rank)?))
    }

    fn gone(&mut self, rank: u32) -> Option<Value> {
        self.until(CHANGE_DEADLINE, |s| !Self::members(s).contains(&rank))
    }

    fn strike(&mut self, what: &What) -> Result<bool, String> {
        match *what {
            What::Kill { pick, during } => {
                let Some((rank, w)) = self.victim(pick) else {
                    return Ok(false);
                };
                let phase = match during {
                    During::Anytime => None,
                    During::Step => Some("running"),
                    During::Backup => Some("replicating"),
                };
                let landed = match phase {
                    None => {
                        self.workers[w].proc.signal(libc::SIGKILL);
                        "anytime".to_string()
                    }
                    Some(p) => self.kill_during(rank, w, p),
                };
                self.workers[w].end = End::Killed;
                self.note(format!("kill -9 worker {w} (rank {rank}), {landed}"));
                if self.gone(rank).is_some() {
                    self.note(format!("rank {rank} is out of the members"));
                }
            }
            What::KillPair { a, b } => {
                let Some(s) = self.status() else {
                    return Ok(false);
                };
                let members = Self::members(&s);
                let Some((x, y)) = pair_positions(members.len(), a, b) else {
                    return Ok(false);
                };
                let ranks = [members[x], members[y]];
                let mut hit = Vec::new();
                for r in ranks {
                    let Some(w) = self.worker_of(r) else {
                        return Ok(false);
                    };
                    hit.push(w);
                }
                for &w in &hit {
                    self.workers[w].proc.signal(libc::SIGKILL);
                    self.workers[w].end = End::Killed;
                }
                self.note(format!("kill -9 workers {hit:?} (ranks {ranks:?}) at once"));
                let out = self.until(CHANGE_DEADLINE, |s| {
                    let m = Self::members(s);
                    !m.contains(&ranks[0]) && !m.contains(&ranks[1])
                });
                if out.is_some() {
                    self.note(format!("ranks {ranks:?} are out of the members"));
                }
            }
            What::Freeze { pick } => {
                let Some((rank, w)) = self.victim(pick) else {
                    return Ok(false);
                };
                self.workers[w].proc.signal(libc::SIGSTOP);
                self.workers[w].end = End::Refused;
                self.note(format!("SIGSTOP worker {w} (rank {rank})"));
                let out = self.gone(rank);
                self.note(format!(
                    "rank {rank} {} the members; SIGCONT",
                    if out.is_some() { "left" } else { "never left" }
                ));
                self.workers[w].proc.signal(libc::SIGCONT);
            }
            What::ControlBlackhole { pick } => {
                let Some((rank, w)) = self.victim(pick) else {
                    return Ok(false);
                };
                self.net.set(None, Link::Control(w), LinkState::Blackhole);
                self.workers[w].end = End::Refused;
                self.note(format!(
                    "control link of worker {w} (rank {rank}) goes dark"
                ));
                if self.gone(rank).is_some() {
                    self.note(format!("rank {rank} is out of the members"));
                }
            }
            What::Join { count } => {
                let before = match self.status() {
                    Some(s) => Self::members(&s).len(),
                    None => return Ok(false),
                };
                let Some(spawned) = self.start_standbys(count)? else {
                    return Ok(false);
                };
                if !self.post_join(count) {
                    return Ok(false);
                }
                let want = before + count as usize;
                if self
                    .until(CHANGE_DEADLINE, |s| Self::members(s).len() >= want)
                    .is_some()
                {
                    self.note(format!("{count} joined"));
                    for w in spawned {
                        self.workers[w].end = End::WithJob;
                    }
                }
            }
            What::KillMidReshard { pick } => {
                let Some((rank, w)) = self.victim(pick) else {
                    return Ok(false);
                };
                let Some(spawned) = self.start_standbys(1)? else {
                    return Ok(false);
                };
                let joiner = spawned[0];
                // What the joiner receives is held (TCP) or slowed (QUIC: held datagrams are
                // lost, and the joiner could not even connect), so the reshard admitting it
                // lasts while the victim is struck.
                let slow = if self.sc.transport == "quic" {
                    LinkState::Delay(Duration::from_millis(3))
                } else {
                    LinkState::Hold
                };
                self.net.set(None, Link::Data(joiner), slow);
                if !self.post_join(1) {
                    self.net.set(None, Link::Data(joiner), LinkState::Pass);
                    return Ok(false);
                }
                let seen = self.until(Duration::from_secs(10), |s| {
                    s["activity"]["phase"] == "resharding"
                });
                self.workers[w].proc.signal(libc::SIGKILL);
                self.workers[w].end = End::Killed;
                self.note(format!(
                    "kill -9 worker {w} (rank {rank}) {}",
                    if seen.is_some() {
                        "during the reshard admitting a joiner"
                    } else {
                        "(no reshard seen: struck anytime)"
                    }
                ));
                std::thread::sleep(Duration::from_millis(100));
                self.net.set(None, Link::Data(joiner), LinkState::Pass);
                if let Some(s) = self.gone(rank) {
                    self.note(format!("rank {rank} is out of the members"));
                    // A joiner that survives still joins (README, "Losses between steps").
                    let members = Self::members(&s);
                    let joined = members.iter().any(|&r| self.worker_of(r) == Some(joiner));
                    if joined {
                        self.workers[joiner].end = End::WithJob;
                    }
                }
            }
            What::Drain { pick } => {
                let Some((rank, w)) = self.victim(pick) else {
                    return Ok(false);
                };
                let Ok((code, body)) =
                    try_http(&self.control, "POST", &format!("/ranks/{rank}/drain"))
                else {
                    return Ok(false); // the job ended
                };
                self.note(format!("POST /ranks/{rank}/drain: {code} {body}"));
                if code != 202 {
                    return Ok(false);
                }
                self.workers[w].end = End::Left;
                if self.gone(rank).is_some() {
                    self.note(format!("rank {rank} left"));
                }
            }
            What::Delay { pick, ms, for_ms } => {
                let Some((rank, w)) = self.victim(pick) else {
                    return Ok(false);
                };
                let link = Link::Data(w);
                self.net
                    .set(None, link, LinkState::Delay(Duration::from_millis(ms)));
                self.note(format!(
                    "data into rank {rank} delayed {ms} ms for {for_ms} ms"
                ));
                std::thread::sleep(Duration::from_millis(for_ms));
                self.net.set(None, link, LinkState::Pass);
            }
            What::Cut { pick } => {
                let Some((rank, w)) = self.victim(pick) else {
                    return Ok(false);
                };
                self.net.cut(Link::Data(w));
                self.note(format!("data connections into rank {rank} cut"));
            }
            What::Blackhole { pick } => {
                let Some((rank, w)) = self.victim(pick) else {
                    return Ok(false);
                };
                self.net.set(None, Link::Data(w), LinkState::Blackhole);
                self.net.set(None, Link::Control(w), LinkState::Blackhole);
                for other in (0..self.workers.len()).filter(|&o| o != w) {
                    self.net
                        .set(Some(w), Link::Data(other), LinkState::Blackhole);
                }
                self.workers[w].end = End::Refused;
                self.note(format!("worker {w} (rank {rank}) drops off the network"));
                if self.gone(rank).is_some() {
                    self.note(format!("rank {rank} is out of the members"));
                }
            }
            What::Partition { side, for_ms } => {
                let Some(s) = self.status() else {
                    return Ok(false);
                };
                let members = Self::members(&s);
                let mut a = Vec::new();
                let mut b = Vec::new();
                for (i, &r) in members.iter().enumerate() {
                    let Some(w) = self.worker_of(r) else { continue };
                    if side >> (i % 32) & 1 == 1 {
                        a.push(w)
                    } else {
                        b.push(w)
                    }
                }
                if a.is_empty() || b.is_empty() {
                    return Ok(false);
                }
                let pairs: Vec<(usize, usize)> = a
                    .iter()
                    .flat_map(|&x| b.iter().flat_map(move |&y| [(x, y), (y, x)]))
                    .collect();
                for &(from, to) in &pairs {
                    self.net.set(Some(from), Link::Data(to), LinkState::Hold);
                }
                self.note(format!("partition workers {a:?} | {b:?} for {for_ms} ms"));
                std::thread::sleep(Duration::from_millis(for_ms));
                for &(from, to) in &pairs {
                    self.net.set(Some(from), Link::Data(to), LinkState::Pass);
                }
                self.note("partition healed".into());
            }
        }
        Ok(true)
    }

    /// Starts `count` standby workers and waits until the coordinator holds them; `None` if it
    /// never did (the job ended).
    fn start_standbys(&mut self, count: u32) -> Result<Option<Vec<usize>>, String> {
        let mut spawned = Vec::new();
        for _ in 0..count {
            let w = self.spawn_worker(None, true)?;
            self.workers[w].end = End::Standby;
            spawned.push(w);
        }
        let c = u64::from(count);
        let held = self.until(CHANGE_DEADLINE, |s| s["standbys"].as_u64() >= Some(c));
        Ok(held.map(|_| spawned))
    }

    /// `POST /join?count=N`; whether it was accepted.
    fn post_join(&mut self, count: u32) -> bool {
        let Ok((code, body)) = try_http(&self.control, "POST", &format!("/join?count={count}"))
        else {
            return false; // the job ended
        };
        self.note(format!("POST /join?count={count}: {code} {body}"));
        code == 202
    }

    /// Freezes the victim until `/status` shows `phase` waiting for it, then `kill -9`; thaws
    /// and tries a later moment otherwise. Falls back to a kill wherever it is after 30 tries.
    fn kill_during(&mut self, rank: u32, w: usize, phase: &str) -> String {
        for attempt in 0..30 {
            self.workers[w].proc.signal(libc::SIGSTOP);
            // Frozen, the victim sends nothing more: two equal answers mean its last words
            // have arrived.
            let mut seen = self.status();
            loop {
                std::thread::sleep(Duration::from_millis(60));
                let again = self.status();
                let same = |a: &Option<Value>, b: &Option<Value>| match (a, b) {
                    (Some(a), Some(b)) => {
                        a["activity"] == b["activity"] && a["awaiting"] == b["awaiting"]
                    }
                    _ => true,
                };
                if same(&seen, &again) {
                    break;
                }
                seen = again;
            }
            let Some(s) = seen else { break };
            let waits = s["awaiting"]
                .as_array()
                .is_some_and(|a| a.iter().any(|r| r.as_u64() == Some(rank.into())));
            if s["activity"]["phase"] == phase && waits {
                self.workers[w].proc.signal(libc::SIGKILL);
                return format!("during {phase} {} (try {attempt})", s["activity"]["step"]);
            }
            self.workers[w].proc.signal(libc::SIGCONT);
            let step = s["step"].as_u64();
            let _ = self.until(Duration::from_secs(10), |s| s["step"].as_u64() != step);
            std::thread::sleep(Duration::from_millis(attempt * 7 % 40));
        }
        self.workers[w].proc.signal(libc::SIGKILL);
        format!("not caught during {phase} in 30 tries: struck anytime")
    }
}

/// Runs `sc` under `root` (a fresh folder); it must end as `expect` says (`reference` is the
/// fault-free digest).
pub fn run(sc: &Scenario, reference: &str, root: &Path, expect: &Expect) -> Outcome {
    let start = Instant::now();
    let mut outcome = match run_inner(sc, reference, root, start, expect) {
        Ok(o) => o,
        Err(e) => Outcome {
            seed: sc.seed,
            failure: Some(e),
            ..Outcome::default()
        },
    };
    outcome.wall_ms = start.elapsed().as_millis() as u64;
    outcome
}

fn run_inner(
    sc: &Scenario,
    reference: &str,
    root: &Path,
    start: Instant,
    expect: &Expect,
) -> Result<Outcome, String> {
    let dir = root.join(format!("seed-{}", sc.seed));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("tmp")).map_err(|e| format!("{}: {e}", dir.display()))?;
    let secrets = dir.join("secrets");
    elastic_zero::net::init_secrets(&secrets).map_err(|e| format!("secrets: {e}"))?;
    let token = format!("chaos-{}", sc.seed);
    let mut coord = Child::spawn(
        Command::new(EZERO)
            .env("EZERO_CLUSTER_TOKEN", &token)
            .env("TMPDIR", dir.join("tmp"))
            .args([
                "coordinator",
                "--listen",
                "127.0.0.1:0",
                "--control",
                "127.0.0.1:0",
            ])
            .args([
                "--ranks",
                &sc.workers.to_string(),
                "--transport",
                &sc.transport,
            ])
            .args(["--heartbeat-ms", &HEARTBEAT_MS.to_string()])
            .args(["--heartbeat-timeout-ms", &HEARTBEAT_TIMEOUT_MS.to_string()])
            .arg("--secrets")
            .arg(&secrets)
            .args(train_flags(sc)),
    )?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let listening = coord
        .line("ezero coordinator: listening on ", deadline)
        .ok_or_else(|| format!("the coordinator did not start: {}", coord.stderr()))?;
    let coord_addr: SocketAddr = listening
        .trim_start_matches("ezero coordinator: listening on ")
        .parse()
        .map_err(|e| format!("{listening}: {e}"))?;
    let mut run = Run {
        sc,
        dir: dir.clone(),
        secrets: secrets.clone(),
        token,
        net: Arc::new(Net::default()),
        coord,
        coord_addr,
        control: String::new(),
        workers: Vec::new(),
        start,
        out: Outcome {
            seed: sc.seed,
            ..Outcome::default()
        },
        ports: vec![coord_addr.port()],
    };
    let result = drive(&mut run, reference, expect);
    let finish = finish(&mut run, *expect == Expect::Digest);
    let mut out = std::mem::take(&mut run.out);
    out.failure = result.err().or(finish.err());
    for (k, v) in [
        ("bytes_passed", &run.net.counts.bytes_passed),
        ("chunks_delayed", &run.net.counts.chunks_delayed),
        ("bytes_held", &run.net.counts.bytes_held),
        ("bytes_swallowed", &run.net.counts.bytes_swallowed),
        ("connections_cut", &run.net.counts.connections_cut),
        ("datagrams_dropped", &run.net.counts.datagrams_dropped),
    ] {
        out.net.insert(k.into(), v.load(Ordering::Relaxed));
    }
    drop(run);
    if out.failure.is_none() {
        out.failure = super::leaks::check(&dir, &secrets).err();
    }
    if out.failure.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(out)
}

/// Starts the workers, strikes every fault, and checks how the job ended.
fn drive(run: &mut Run, reference: &str, expect: &Expect) -> Result<(), String> {
    for i in 0..run.sc.workers {
        run.spawn_worker(Some(i), false)?;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let line = run
        .coord
        .line("control endpoint: ", deadline)
        .ok_or_else(|| format!("no control endpoint: {}", run.coord.stderr()))?;
    run.control = control_addr(&line);
    let first = run.until(CHANGE_DEADLINE, |s| s["step"].as_u64() >= Some(1));
    if first.is_none() {
        let out = run.coord.stdout();
        return Err(format!(
            "no step seen running: stdout ends {:?}; stderr ends {:?}",
            &out[out.len().saturating_sub(3)..],
            run.coord.stderr().lines().last().unwrap_or("")
        ));
    }
    run.out.coord_rss_kib.0 = run.coord_rss_kib().unwrap_or(0);
    run.note("step 1 reached".into());
    for f in &run.sc.faults {
        let at = f.at_step;
        let Some(s) = run.until(CHANGE_DEADLINE, |s| s["step"].as_u64() >= Some(at)) else {
            run.note(format!(
                "run ended before step {at}: {} not struck",
                f.what.kind()
            ));
            run.out.skipped += 1;
            continue;
        };
        run.note(format!(
            "step {} epoch {}: {}",
            s["step"],
            s["epoch"],
            f.what.kind()
        ));
        if run.strike(&f.what)? {
            *run.out.injected.entry(f.what.kind().into()).or_default() += 1;
        } else {
            run.note(format!(
                "{} not struck (too few members or refused)",
                f.what.kind()
            ));
            run.out.skipped += 1;
        }
    }
    if let Some(s) = run.status() {
        run.out.recoveries = s["telemetry"]["recoveries"].as_u64().unwrap_or(0);
        run.out.rebalances = s["telemetry"]["rebalances"].as_u64().unwrap_or(0);
    }
    let code = run
        .coord
        .wait(Instant::now() + SCENARIO_DEADLINE.saturating_sub(run.start.elapsed()))
        .ok_or("the coordinator did not exit in time (killed)")?
        .code();
    run.net.heal_all();
    let stdout = run.coord.stdout().join("\n");
    let stderr = run.coord.stderr();
    run.out.network_retries = stdout
        .matches("retried after frames were lost on the network")
        .count() as u64;
    run.note(format!("coordinator exited {code:?}"));
    // What the coordinator saw, in its order: membership changes and retries.
    for l in stdout
        .lines()
        .filter(|l| l.starts_with("membership") || l.starts_with("rank "))
    {
        run.out.events.push(format!("          coordinator: {l}"));
    }
    let lines: Vec<&str> = stderr.lines().collect();
    let last_err = lines[lines.len().saturating_sub(4)..].join(" | ");
    match expect {
        Expect::Digest => {
            if code != Some(0) {
                return Err(format!("the coordinator exited {code:?}: {last_err}"));
            }
            let got = digest(&stdout);
            if got.as_deref() != Some(reference) {
                return Err(format!(
                    "param-sha256 {got:?}, the fault-free run's is {reference}"
                ));
            }
        }
        Expect::Stop(text) => {
            if code != Some(1) || !stderr.contains(text) {
                return Err(format!(
                    "expected the documented stop ({text:?}); the coordinator exited {code:?}: {last_err}"
                ));
            }
            run.out.documented_stop = true;
        }
    }
    Ok(())
}

/// Reaps every worker within the deadline, checks each ended as it should, and stops the
/// proxies.
fn finish(run: &mut Run, job_ok: bool) -> Result<(), String> {
    run.net.heal_all();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut problems = Vec::new();
    for (i, w) in run.workers.iter_mut().enumerate() {
        w.proc.signal(libc::SIGCONT);
        let status = w.proc.wait(deadline);
        let code = status.and_then(|s| s.code());
        let ok = match (w.end, status) {
            (_, None) => false,
            (End::Killed, Some(_)) => true,
            (End::Refused, Some(_)) => code.is_some_and(|c| c != 0),
            (End::Left, Some(_)) => code == Some(0),
            (End::Standby, Some(_)) => true,
            (End::WithJob, Some(_)) => !job_ok || code == Some(0),
        };
        if !ok {
            let err = w.proc.stderr();
            problems.push(format!(
                "worker {i} (rank {:?}, {:?}) ended {:?}: {}",
                w.rank,
                w.end,
                status.map(|s| s.to_string()),
                err.lines().last().unwrap_or("")
            ));
        }
        for p in w.proxies.drain(..) {
            p.stop();
        }
    }
    run.coord.reap();
    let ports = run.ports.clone();
    super::leaks::ports_free(&ports)
        .map_err(|e| problems.push(e))
        .ok();
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}
