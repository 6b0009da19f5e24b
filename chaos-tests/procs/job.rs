//! Runs one scenario for real: a coordinator and worker processes, every connection through
//! the harness's proxies, the faults at their steps, then the checks (the digest or the
//! documented stop, every process reaped, nothing left bound or on disk).

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::child::Child;
use super::net::{tcp_proxy, udp_proxy, Link, Net, Proxy};
use super::scenario::{Expect, Scenario, CHUNK_ELEMS};
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
pub(crate) const CHANGE_DEADLINE: Duration = Duration::from_secs(60);

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

/// How a worker's process must end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum End {
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

/// How a coordinator's process must end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CoordEnd {
    /// With the job: the one that finishes it exits 0 with the digest (or 1 with the
    /// documented stop); a standby exits 0 once the job has ended.
    WithJob,
    /// `kill -9`.
    Killed,
    /// Frozen past its lease or cut off from the store: exits 1, its lease lost, printing no
    /// digest.
    Deposed,
}

/// One of the job's coordinators.
pub(crate) struct Coord {
    pub(crate) proc: Child,
    addr: SocketAddr,
    control: String,
    pub(crate) end: CoordEnd,
    /// Stopped by the harness now: not asked for its status (it would not answer).
    pub(crate) frozen: bool,
}

pub(crate) struct Worker {
    pub(crate) proc: Child,
    pub(crate) rank: Option<u32>,
    proxies: Vec<Proxy>,
    pub(crate) end: End,
}

/// A scenario's running job and what the harness saw of it.
pub(crate) struct Run<'a> {
    pub(crate) sc: &'a Scenario,
    dir: PathBuf,
    secrets: PathBuf,
    token: String,
    pub(crate) net: Arc<Net>,
    pub(crate) coords: Vec<Coord>,
    /// The coordinator that answered `/status` last: asked first.
    pub(crate) leader: std::cell::Cell<usize>,
    /// The coordinators' store and the proxies in front of it (several coordinators only).
    etcd: Option<elastic_zero::runtime::meta::LocalEtcd>,
    meta_proxies: Vec<Proxy>,
    pub(crate) workers: Vec<Worker>,
    start: Instant,
    out: Outcome,
    ports: Vec<u16>,
}

/// A free loopback port (TCP or UDP), released for the worker to bind.
///
/// Taken below the kernel's ephemeral range and never handed out twice by this process: a
/// port from `bind(:0)` that is released again can be given to the next `bind(:0)` (one of
/// the proxies' sockets, another worker's probe) before the worker binds it, and the worker
/// then stops at start-up with the address in use.
fn free_port(udp: bool) -> Result<u16, String> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let (low, high) = below_ephemeral();
    let span = u32::from(high - low);
    // Test binaries run one after another and may overlap in TIME_WAIT; start each at its own
    // offset.
    let offset = std::process::id() % span;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = low + ((offset + n) % span) as u16;
        let addr = ("127.0.0.1", port);
        let free = if udp {
            UdpSocket::bind(addr).is_ok()
        } else {
            TcpListener::bind(addr).is_ok()
        };
        if free {
            return Ok(port);
        }
    }
    Err(format!("no free port in {low}..{high}"))
}

/// Ports the kernel never picks for `bind(:0)`: the 12k below its ephemeral range
/// (`/proc/sys/net/ipv4/ip_local_port_range`, 32768 by default), above the privileged ones.
fn below_ephemeral() -> (u16, u16) {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let high = low.max(2048);
    (high.saturating_sub(12_000).max(1024), high)
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
    pub(crate) fn note(&mut self, what: String) {
        let ms = self.start.elapsed().as_millis();
        self.out.events.push(format!("{ms:>6} ms  {what}"));
    }

    /// The leader's `/status`: the coordinator that answered last is asked first, then the
    /// others (a standby answers with `"role": "standby"`, a dead one not at all).
    pub(crate) fn status(&self) -> Option<Value> {
        let first = self.leader.get();
        let order = std::iter::once(first).chain((0..self.coords.len()).filter(|&i| i != first));
        for i in order {
            let c = &self.coords[i];
            if c.frozen || c.end == CoordEnd::Killed || c.control.is_empty() {
                continue;
            }
            let Ok((200, body)) = try_http(&c.control, "GET", "/status") else {
                continue;
            };
            let status: Option<Value> = serde_json::from_str(&body).ok();
            if status.as_ref().is_some_and(|s| s["role"] != "standby") {
                self.leader.set(i);
                return status;
            }
        }
        None
    }

    /// The control endpoint of the coordinator that leads (as far as the harness knows).
    pub(crate) fn control(&self) -> String {
        self.coords[self.leader.get()].control.clone()
    }

    fn coord_rss_kib(&self) -> Option<u64> {
        super::leaks::rss_kib(&self.coords[self.leader.get()].proc.pid().to_string())
    }

    /// Whether every coordinator has exited.
    fn coordinators_gone(&mut self) -> bool {
        self.coords.iter_mut().all(|c| c.proc.exited().is_some())
    }

    /// Polls `/status` until `done` holds; `None` once the job has ended or at the deadline.
    pub(crate) fn until(
        &mut self,
        deadline: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> Option<Value> {
        let until = Instant::now() + deadline;
        while Instant::now() < until {
            // 503 until every worker has joined; nothing once the coordinator is gone.
            let Some(s) = self.status() else {
                if self.coordinators_gone() {
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

    pub(crate) fn members(s: &Value) -> Vec<u32> {
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
    pub(crate) fn worker_of(&mut self, rank: u32) -> Option<usize> {
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

    pub(crate) fn spawn_worker(
        &mut self,
        hint: Option<usize>,
        standby: bool,
    ) -> Result<usize, String> {
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
        let mut proxies = vec![data];
        let mut join = Vec::new();
        for c in &self.coords {
            let control = tcp_proxy(Link::Control(idx), c.addr, self.net.clone())
                .map_err(|e| format!("control proxy: {e}"))?;
            join.push(control.addr.to_string());
            proxies.push(control);
        }
        let data_addr = proxies[0].addr;
        let mut cmd = Command::new(EZERO);
        cmd.env("EZERO_CLUSTER_TOKEN", &self.token)
            .env("TMPDIR", self.dir.join("tmp"))
            .env("EZERO_LEADER_WAIT_MS", "20000")
            .args(["worker", "--join", &join.join(",")])
            .args(["--data-listen", &upstream.to_string()])
            .args(["--data-advertise", &data_addr.to_string()])
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
            proxies,
            end: End::WithJob,
        });
        Ok(idx)
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
    let net = Arc::new(Net::default());
    let (coords, etcd, meta_proxies) = start_coordinators(sc, &dir, &secrets, &token, &net)?;
    let ports = coords.iter().map(|c| c.addr.port()).collect();
    let mut run = Run {
        sc,
        dir: dir.clone(),
        secrets: secrets.clone(),
        token,
        net,
        coords,
        leader: std::cell::Cell::new(0),
        etcd,
        meta_proxies,
        workers: Vec::new(),
        start,
        out: Outcome {
            seed: sc.seed,
            ..Outcome::default()
        },
        ports,
    };
    let result = drive(&mut run, reference, expect);
    let finish = finish(&mut run, *expect == Expect::Digest);
    let mut out = std::mem::take(&mut run.out);
    // A job that failed shows why its workers stopped too: "rank 1 failed before it was
    // bound" alone does not say that rank 1 could not bind its address.
    out.failure = match (result, finish) {
        (Err(job), Err(workers)) => Some(format!("{job}; {workers}")),
        (r, f) => r.err().or(f.err()),
    };
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

type Started = (
    Vec<Coord>,
    Option<elastic_zero::runtime::meta::LocalEtcd>,
    Vec<Proxy>,
);

/// Starts the scenario's coordinators; with more than one, a local etcd they reach through
/// proxies of the harness (`Link::Meta`), short leases and a takeover wait of a few heartbeat
/// timeouts.
fn start_coordinators(
    sc: &Scenario,
    dir: &Path,
    secrets: &Path,
    token: &str,
    net: &Arc<Net>,
) -> Result<Started, String> {
    let (mut etcd, mut proxies) = (None, Vec::new());
    if sc.coordinators > 1 {
        let etcd_dir = dir.join("etcd");
        std::fs::create_dir_all(&etcd_dir).map_err(|e| format!("{}: {e}", etcd_dir.display()))?;
        let local = elastic_zero::runtime::meta::spawn_local_etcd(&etcd_dir)
            .map_err(|e| format!("the local etcd: {e}"))?;
        let endpoint = local.endpoints()[0]
            .trim_start_matches("http://")
            .to_string();
        etcd = Some((
            local,
            endpoint.parse::<SocketAddr>().map_err(|e| e.to_string())?,
        ));
    }
    let mut coords = Vec::new();
    for i in 0..sc.coordinators {
        let mut cmd = Command::new(EZERO);
        cmd.env("EZERO_CLUSTER_TOKEN", token)
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
            .arg(secrets);
        if let Some((_, upstream)) = &etcd {
            let proxy = tcp_proxy(Link::Meta(i), *upstream, net.clone())
                .map_err(|e| format!("store proxy: {e}"))?;
            cmd.args(["--meta", &format!("etcd://{}", proxy.addr)])
                .args(["--job-id", &format!("chaos-{}", sc.seed)])
                .args(["--coordinator-id", &format!("c{i}")])
                .args(["--lease-ttl-ms", "1000", "--reattach-wait-ms", "3000"]);
            proxies.push(proxy);
        }
        let mut proc = Child::spawn(cmd.args(train_flags(sc)))?;
        let deadline = Instant::now() + Duration::from_secs(30);
        let listening = proc
            .line("ezero coordinator: listening on ", deadline)
            .ok_or_else(|| format!("coordinator {i} did not start: {}", proc.stderr()))?;
        let addr: SocketAddr = listening
            .trim_start_matches("ezero coordinator: listening on ")
            .parse()
            .map_err(|e| format!("{listening}: {e}"))?;
        coords.push(Coord {
            proc,
            addr,
            control: String::new(),
            end: CoordEnd::WithJob,
            frozen: false,
        });
    }
    Ok((coords, etcd.map(|(l, _)| l), proxies))
}

/// Starts the workers, strikes every fault, and checks how the job ended.
fn drive(run: &mut Run, reference: &str, expect: &Expect) -> Result<(), String> {
    for i in 0..run.sc.workers {
        run.spawn_worker(Some(i), false)?;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    for c in &mut run.coords {
        let line = c
            .proc
            .line("control endpoint: ", deadline)
            .ok_or_else(|| format!("no control endpoint: {}", c.proc.stderr()))?;
        c.control = control_addr(&line);
    }
    let first = run.until(CHANGE_DEADLINE, |s| s["step"].as_u64() >= Some(1));
    if first.is_none() {
        let c = &run.coords[run.leader.get()];
        let out = c.proc.stdout();
        return Err(format!(
            "no step seen running: stdout ends {:?}; stderr ends {:?}",
            &out[out.len().saturating_sub(3)..],
            c.proc.stderr().lines().last().unwrap_or("")
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
    judge_end(run, reference, expect)
}

/// Waits for every coordinator to exit and checks how each did, and how the job ended.
fn judge_end(run: &mut Run, reference: &str, expect: &Expect) -> Result<(), String> {
    let deadline = Instant::now() + SCENARIO_DEADLINE.saturating_sub(run.start.elapsed());
    let mut ends = Vec::new();
    for c in &mut run.coords {
        c.proc.signal(libc::SIGCONT);
        ends.push(c.proc.wait(deadline).map(|s| s.code()));
    }
    run.net.heal_all();
    let texts: Vec<(String, String)> = run
        .coords
        .iter()
        .map(|c| (c.proc.stdout().join("\n"), c.proc.stderr()))
        .collect();
    check_coordinators(run, &ends, &texts)?;
    // The coordinator that ended the job: the one that printed the digest, or the last one
    // the job had that exited non-zero.
    let last = run.coords.len() - 1;
    let finisher = texts
        .iter()
        .position(|(out, _)| digest(out).is_some())
        .or_else(|| {
            (0..=last)
                .rev()
                .find(|&i| run.coords[i].end == CoordEnd::WithJob && ends[i] != Some(Some(0)))
        })
        .unwrap_or(run.leader.get());
    let code = ends[finisher].ok_or("the coordinator did not exit in time (killed)")?;
    let (stdout, stderr) = &texts[finisher];
    run.out.network_retries = texts
        .iter()
        .map(|(out, _)| {
            out.matches("retried after frames were lost on the network")
                .count() as u64
        })
        .sum();
    run.note(format!("coordinator {finisher} exited {code:?}"));
    // What the coordinators saw, in their order: elections, membership changes and retries.
    for (i, (out, _)) in texts.iter().enumerate() {
        for l in out.lines().filter(|l| {
            l.starts_with("membership") || l.starts_with("rank ") || l.contains("leads the job")
        }) {
            run.out
                .events
                .push(format!("          coordinator {i}: {l}"));
        }
    }
    let lines: Vec<&str> = stderr.lines().collect();
    let last_err = lines[lines.len().saturating_sub(4)..].join(" | ");
    match expect {
        Expect::Digest => {
            if code != Some(0) {
                return Err(format!("the coordinator exited {code:?}: {last_err}"));
            }
            let got = digest(stdout);
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

/// Every coordinator exited, and as it should: a deposed one non-zero, saying its lease was
/// lost, with no digest; a standby 0 once the job had ended; a killed one any way.
fn check_coordinators(
    run: &Run,
    ends: &[Option<Option<i32>>],
    texts: &[(String, String)],
) -> Result<(), String> {
    let mut problems = Vec::new();
    for (i, c) in run.coords.iter().enumerate() {
        let (out, err) = &texts[i];
        let Some(code) = ends[i] else {
            problems.push(format!("coordinator {i} did not exit in time (killed)"));
            continue;
        };
        let ok = match c.end {
            CoordEnd::Killed => true,
            CoordEnd::Deposed => {
                code.is_some_and(|c| c != 0)
                    && digest(out).is_none()
                    && err.contains("lost its lease on the metadata store")
            }
            // The finisher's code is checked against the expectation.
            CoordEnd::WithJob => digest(out).is_some() || code.is_some(),
        };
        if !ok {
            let last = err.lines().last().unwrap_or("");
            problems.push(format!(
                "coordinator {i} ({:?}) exited {code:?}: {last}",
                c.end
            ));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
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
    for c in &mut run.coords {
        c.proc.reap();
    }
    for p in run.meta_proxies.drain(..) {
        p.stop();
    }
    // The store goes with the job; its data directory is not the processes' TMPDIR.
    run.etcd = None;
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
