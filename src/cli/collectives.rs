//! `ezero bench collectives`: collective bandwidth over the local, TCP, QUIC or UCX transport.
//!
//! `--transport quic` (the default mode) starts `--nprocs` child `ezero` processes on loopback,
//! one rank each, with certificates from a throwaway cluster CA: the honest setup, with
//! encryption and the kernel's UDP path in every byte. `--threads` runs the ranks as threads of
//! this process instead (each with its own endpoint), labelled `"mode": "threads"`.
//! `--transport ucx` starts child processes too, talking over UCX shared memory (the
//! transports a job's UCX plane uses between workers on one host).
//!
//! Children talk to the parent over their stdin/stdout: each prints `ADDR <rank> <addr>` once
//! bound (a UCX worker address in hex), the parent answers with every rank's address on one
//! line, and rank 0 prints the JSON result lines, which the parent passes through.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use clap::Args;

use elastic_zero::bench::collectives::{default_iters, result, run_op, Op, ALL_OPS};
use elastic_zero::net::tls::ClusterTls;
use elastic_zero::net::{init_secrets, ClusterCa, Identity};
use elastic_zero::plan::RankId;
use elastic_zero::runtime::step::comm::Comm;
use elastic_zero::runtime::transport::local::LocalNetwork;
use elastic_zero::runtime::transport::quic::{Congestion, QuicConfig, QuicTransport};
use elastic_zero::runtime::transport::tcp::TcpListenerHandle;
use elastic_zero::runtime::transport::Transport;

use super::CliError;

#[derive(Args, Clone)]
pub struct CollectivesArgs {
    /// local|quic|tcp|ucx (tcp: the TCP data plane, mutual TLS, ranks as threads of this
    /// process; ucx: UCX shared memory between child processes).
    #[arg(long, default_value = "quic")]
    pub transport: String,
    /// Ranks (processes for quic, threads for local).
    #[arg(long, default_value_t = 2)]
    pub nprocs: usize,
    /// Total sizes, comma-separated, with optional K/M/G (binary) suffix [e.g. 1M,16M,64M].
    #[arg(long, default_value = "1M,16M,64M")]
    pub bytes: String,
    /// Ops, comma-separated: all_gather, reduce_scatter, all_reduce, broadcast, or all.
    #[arg(long, default_value = "all")]
    pub ops: String,
    /// Timed iterations per op and size (0: about 512 MiB of buffer, 3..=50).
    #[arg(long, default_value_t = 0)]
    pub iters: usize,
    /// quic: run the ranks as threads of this process instead of child processes.
    #[arg(long)]
    pub threads: bool,
    /// tcp: without TLS, to measure what encryption costs (jobs always use TLS).
    #[arg(long)]
    pub plaintext: bool,
    /// quic: the initial MTU (1200..=max).
    #[arg(long, default_value_t = QuicConfig::loopback().initial_mtu)]
    pub initial_mtu: u16,
    /// quic: UDP socket buffers in bytes (0 = kernel default).
    #[arg(long, default_value_t = 4 << 20)]
    pub socket_buffer_bytes: usize,
    /// quic: disable generic segmentation offload.
    #[arg(long)]
    pub no_gso: bool,
    /// quic: the largest UDP payload (upper bound of MTU discovery).
    #[arg(long, default_value_t = QuicConfig::loopback().max_udp_payload_bytes)]
    pub max_udp_payload_bytes: u16,
    /// quic: per-stream flow-control window in bytes (connection windows are twice it).
    #[arg(long, default_value_t = QuicConfig::loopback().stream_window_bytes)]
    pub stream_window_bytes: u64,
    /// quic: congestion controller (cubic, new_reno, bbr).
    #[arg(long, default_value = "cubic")]
    pub congestion: String,
    /// quic: the congestion controller's initial window in bytes (0: quinn's default).
    #[arg(long, default_value_t = 0)]
    pub initial_window_bytes: u64,
    /// quic: threads of each rank's transport runtime.
    #[arg(long, default_value_t = QuicConfig::default().io_threads)]
    pub io_threads: usize,
    /// quic: each rank prints its paths (rtt, cwnd, mtu, losses, UDP bytes) to stderr at the end.
    #[arg(long)]
    pub path_stats: bool,
    /// Deadline for any one collective, in ms.
    #[arg(long, default_value_t = 120_000)]
    pub timeout_ms: u64,
    /// Only measure the single-core AES-128-GCM and AES-256-GCM seal/open rates (one line each).
    #[arg(long)]
    pub aead: bool,
    /// A worker process's parent's secrets directory, from [`WORKER_SECRETS`]: the worker's
    /// settings are environment variables, not flags, so a mistyped flag is never pointed at
    /// them.
    #[arg(skip)]
    pub secrets: Option<PathBuf>,
}

struct Plan {
    sizes: Vec<usize>,
    ops: Vec<Op>,
}

fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mult) = match s.chars().last()? {
        'K' | 'k' => (&s[..s.len() - 1], 1 << 10),
        'M' | 'm' => (&s[..s.len() - 1], 1 << 20),
        'G' | 'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mult)
}

fn plan(a: &CollectivesArgs) -> Result<Plan, CliError> {
    let usage = |m: String| Err(CliError::Usage(m));
    if !matches!(a.transport.as_str(), "local" | "quic" | "tcp" | "ucx") {
        return usage(format!(
            "--transport: `{}` is not local, quic, tcp or ucx",
            a.transport
        ));
    }
    if a.transport == "ucx" {
        if !cfg!(feature = "ucx") {
            return usage(elastic_zero::runtime::transport::NO_UCX_BUILD.into());
        }
        if a.threads {
            return usage("--threads is for --transport quic only".into());
        }
    }
    if a.plaintext && a.transport != "tcp" {
        return usage("--plaintext is for --transport tcp only".into());
    }
    if !(2..=64).contains(&a.nprocs) {
        return usage("--nprocs must be in 2..=64".into());
    }
    let mut sizes = Vec::new();
    for s in a.bytes.split(',') {
        let align = 4 * a.nprocs;
        match parse_size(s) {
            Some(b) if b >= align && b <= 4 << 30 => sizes.push(b / align * align),
            _ => {
                return usage(format!(
                    "--bytes: `{s}` must be a size from {align} bytes to 4G (e.g. 16M)"
                ))
            }
        }
    }
    let ops = if a.ops == "all" {
        ALL_OPS.to_vec()
    } else {
        let mut v = Vec::new();
        for s in a.ops.split(',') {
            match Op::parse(s.trim()) {
                Some(op) => v.push(op),
                None => {
                    return usage(format!(
                    "--ops: `{s}` is not all_gather, reduce_scatter, all_reduce, broadcast or all"
                ))
                }
            }
        }
        v
    };
    Ok(Plan { sizes, ops })
}

fn quic_config(a: &CollectivesArgs) -> Result<QuicConfig, CliError> {
    let largest = plan(a)?.sizes.into_iter().max().unwrap_or(0) as u64;
    let c = QuicConfig {
        initial_mtu: a.initial_mtu,
        max_udp_payload_bytes: a.max_udp_payload_bytes,
        socket_buffer_bytes: a.socket_buffer_bytes,
        gso: !a.no_gso,
        max_frame_bytes: (largest + 1024).min(u32::MAX as u64 / 2) as u32,
        recv_buffer_bytes: (2 * largest + 2048).max(64 << 20),
        connect_timeout_ms: 30_000,
        stream_window_bytes: a.stream_window_bytes,
        congestion: Congestion::parse(&a.congestion).ok_or_else(|| {
            CliError::Usage(format!(
                "--congestion: `{}` is not cubic, new_reno or bbr",
                a.congestion
            ))
        })?,
        initial_window_bytes: a.initial_window_bytes,
        io_threads: a.io_threads,
        ..QuicConfig::default()
    };
    c.validate().map_err(|e| CliError::Usage(e.to_string()))?;
    Ok(c)
}

/// Every op and size on one rank; rank 0 prints the lines.
fn run_rank<T: Transport>(
    t: T,
    members: &[RankId],
    a: &CollectivesArgs,
    mode: &str,
    report: &dyn Fn(),
) -> Result<(), CliError> {
    let p = plan(a)?;
    let rank = t.rank();
    let mut comm = Comm::new(t, a.timeout_ms);
    comm.begin_step(0, 0);
    let mut run = 0;
    for &bytes in &p.sizes {
        for &op in &p.ops {
            let iters = if a.iters == 0 {
                default_iters(bytes)
            } else {
                a.iters
            };
            let (time_s, cpu, wall) = run_op(&mut comm, members, op, bytes, 1, iters, run)
                .map_err(|e| {
                    CliError::Failed(format!("rank {rank}: {op:?} of {bytes} bytes: {e}"))
                })?;
            run += 1;
            if rank == members[0] {
                // Threads of one process share its CPU counter: count it once.
                let cpu = if mode == "threads" {
                    cpu / members.len() as f64
                } else {
                    cpu
                };
                let r = result(
                    op,
                    bytes,
                    time_s,
                    cpu,
                    wall,
                    if a.plaintext {
                        "tcp-plaintext"
                    } else {
                        &a.transport
                    },
                    members.len(),
                    mode,
                    iters,
                );
                let line =
                    serde_json::to_string(&r).map_err(|e| CliError::Failed(e.to_string()))?;
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{line}");
                let _ = out.flush();
            }
        }
    }
    comm.flush();
    report();
    Ok(())
}

/// The rank a benchmark's worker process runs as, set by its parent.
const WORKER_RANK: &str = "EZERO_BENCH_WORKER_RANK";
/// The parent's secrets directory, for a worker process.
const WORKER_SECRETS: &str = "EZERO_BENCH_WORKER_SECRETS";

pub fn run(a: &CollectivesArgs) -> Result<(), CliError> {
    plan(a)?;
    if a.aead {
        for aes_256 in [false, true] {
            let r = elastic_zero::bench::collectives::bench_aead(aes_256, 16_000, 1 << 30);
            println!(
                "{}",
                serde_json::to_string(&r).map_err(|e| CliError::Failed(e.to_string()))?
            );
        }
        return Ok(());
    }
    if let Some(rank) = std::env::var(WORKER_RANK).ok().filter(|v| !v.is_empty()) {
        let rank = rank
            .parse()
            .map_err(|_| CliError::Usage(format!("{WORKER_RANK}={rank}: expected a rank")))?;
        let secrets = std::env::var_os(WORKER_SECRETS).map(PathBuf::from);
        return worker(
            rank,
            &CollectivesArgs {
                secrets,
                ..a.clone()
            },
        );
    }
    let members: Vec<RankId> = (0..a.nprocs as u32).collect();
    if a.transport == "local" {
        let net = LocalNetwork::new();
        let eps: Vec<_> = members.iter().map(|&r| net.endpoint(r)).collect();
        return run_threads(eps, &members, a, "threads");
    }
    if a.transport == "tcp" {
        return run_tcp(&members, a);
    }
    if a.transport == "ucx" {
        #[cfg(feature = "ucx")]
        elastic_zero::runtime::transport::ucx::library()
            .map_err(|e| CliError::Usage(format!("--transport ucx: {e}")))?;
        return spawn_children(a, None);
    }

    let cfg = quic_config(a)?;
    let nanos = elastic_zero::runtime::clock::unix_time().subsec_nanos();
    let dir = std::env::temp_dir().join(format!("ezero-bench-{}-{nanos}", std::process::id()));
    let ca = init_secrets(&dir).map_err(|e| CliError::Failed(e.to_string()))?;
    let res = run_quic(a, &members, &cfg, &ca, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    res
}

fn run_quic(
    a: &CollectivesArgs,
    members: &[RankId],
    cfg: &QuicConfig,
    ca: &elastic_zero::net::ClusterCa,
    dir: &std::path::Path,
) -> Result<(), CliError> {
    if a.threads {
        let mut ts = Vec::new();
        for &r in members {
            let id = ca
                .issue(&format!("rank-{r}"))
                .map_err(|e| CliError::Failed(e.to_string()))?;
            let t = QuicTransport::bind(r, loopback(), &id, cfg)
                .map_err(|e| CliError::Failed(e.to_string()))?;
            ts.push(t);
        }
        let addrs: Vec<_> = ts.iter().map(|t| (t.rank(), t.local_addr())).collect();
        for t in &ts {
            t.add_peers(&addrs);
        }
        for t in &ts {
            t.wait_connected(members, cfg.connect_timeout_ms)
                .map_err(|e| CliError::Failed(e.to_string()))?;
        }
        return run_threads(ts, members, a, "threads");
    }
    spawn_children(a, Some(dir))
}

/// The TCP data plane (mutual TLS as in a job, or `--plaintext`; one connection per peer
/// pair), ranks as threads: with `--plaintext`, the reference for what encryption and QUIC
/// cost per byte.
fn run_tcp(members: &[RankId], a: &CollectivesArgs) -> Result<(), CliError> {
    let token = "ezero-bench-collectives";
    let ca = ClusterCa::generate("ezero bench CA").map_err(|e| CliError::Failed(e.to_string()))?;
    let mut listeners = Vec::new();
    for &r in members {
        let bound = if a.plaintext {
            TcpListenerHandle::bind_plaintext_for_bench("127.0.0.1:0", token)
        } else {
            let id = ca
                .issue(&format!("rank-{r}"))
                .map_err(|e| CliError::Failed(e.to_string()))?;
            let tls = ClusterTls::new(&id).map_err(|e| CliError::Failed(e.to_string()))?;
            TcpListenerHandle::bind("127.0.0.1:0", token, &tls)
        };
        listeners.push(bound.map_err(|e| CliError::Failed(format!("tcp bind: {e}")))?);
    }
    let addrs: BTreeMap<RankId, SocketAddr> = members
        .iter()
        .zip(&listeners)
        .map(|(&r, l)| (r, l.local_addr()))
        .collect();
    let ts: Vec<_> = members
        .iter()
        .zip(listeners)
        .map(|(&r, l)| {
            let peers = addrs.clone().into_iter().filter(|(p, _)| *p != r).collect();
            l.into_transport(r, peers)
        })
        .collect();
    run_threads(ts, members, a, "threads")
}

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn run_threads<T: Transport>(
    eps: Vec<T>,
    members: &[RankId],
    a: &CollectivesArgs,
    mode: &str,
) -> Result<(), CliError> {
    let hs: Vec<_> = eps
        .into_iter()
        .map(|t| {
            let (members, a, mode) = (members.to_vec(), a.clone(), mode.to_string());
            std::thread::spawn(move || run_rank(t, &members, &a, &mode, &|| ()))
        })
        .collect();
    let mut first_err = None;
    for h in hs {
        let r = h
            .join()
            .unwrap_or_else(|_| Err(CliError::Failed("a rank thread panicked".into())));
        if let (Err(e), None) = (r, &first_err) {
            first_err = Some(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// One child process per rank; `secrets`: the CA directory the QUIC children take their
/// certificates from.
fn spawn_children(a: &CollectivesArgs, secrets: Option<&std::path::Path>) -> Result<(), CliError> {
    let exe = std::env::current_exe().map_err(|e| CliError::Failed(e.to_string()))?;
    let fail = |m: String| CliError::Failed(m);
    let mut children = Vec::new();
    for r in 0..a.nprocs {
        let mut cmd = Command::new(&exe);
        cmd.args(["bench", "collectives", "--transport", &a.transport])
            .args([
                "--nprocs",
                &a.nprocs.to_string(),
                "--bytes",
                &a.bytes,
                "--ops",
                &a.ops,
            ])
            .args(["--iters", &a.iters.to_string()])
            .args(["--initial-mtu", &a.initial_mtu.to_string()])
            .args([
                "--max-udp-payload-bytes",
                &a.max_udp_payload_bytes.to_string(),
            ])
            .args(["--socket-buffer-bytes", &a.socket_buffer_bytes.to_string()])
            .args(["--timeout-ms", &a.timeout_ms.to_string()])
            .args(["--stream-window-bytes", &a.stream_window_bytes.to_string()])
            .args(["--congestion", &a.congestion])
            .args([
                "--initial-window-bytes",
                &a.initial_window_bytes.to_string(),
            ])
            .args(["--io-threads", &a.io_threads.to_string()])
            .env(WORKER_RANK, r.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if let Some(dir) = secrets {
            cmd.env(WORKER_SECRETS, dir);
        }
        if a.no_gso {
            cmd.arg("--no-gso");
        }
        if a.path_stats {
            cmd.arg("--path-stats");
        }
        children.push(
            cmd.spawn()
                .map_err(|e| fail(format!("spawning rank {r}: {e}")))?,
        );
    }
    let result = drive_children(&mut children);
    if result.is_err() {
        for c in &mut children {
            let _ = c.kill();
        }
    }
    let mut failed = Vec::new();
    for (r, c) in children.iter_mut().enumerate() {
        match c.wait() {
            Ok(s) if s.success() => {}
            Ok(s) => failed.push(format!("rank {r} exited with {s}")),
            Err(e) => failed.push(format!("rank {r}: {e}")),
        }
    }
    result?;
    if failed.is_empty() {
        Ok(())
    } else {
        Err(fail(failed.join("; ")))
    }
}

fn drive_children(children: &mut [std::process::Child]) -> Result<(), CliError> {
    let fail = |m: String| CliError::Failed(m);
    let mut readers = Vec::new();
    let mut addrs = Vec::new();
    for (r, c) in children.iter_mut().enumerate() {
        let mut out = BufReader::new(c.stdout.take().ok_or_else(|| fail("no stdout".into()))?);
        let mut line = String::new();
        out.read_line(&mut line)
            .map_err(|e| fail(format!("rank {r}: {e}")))?;
        let addr = line
            .strip_prefix(&format!("ADDR {r} "))
            .ok_or_else(|| {
                fail(format!(
                    "rank {r} did not report its address (got `{}`)",
                    line.trim()
                ))
            })?
            .trim()
            .to_string();
        addrs.push(format!("{r}={addr}"));
        readers.push(out);
    }
    let all = addrs.join(",");
    for (r, c) in children.iter_mut().enumerate() {
        let mut stdin = c.stdin.take().ok_or_else(|| fail("no stdin".into()))?;
        writeln!(stdin, "{all}").map_err(|e| fail(format!("rank {r}: {e}")))?;
    }
    // Rank 0's lines are the results; other ranks print nothing more. A thread passes them
    // through while this one watches for a rank that fails, so that the others are stopped
    // instead of waiting out their collective deadline.
    let rank0 = readers.remove(0);
    let pass = std::thread::spawn(move || {
        let stdout = std::io::stdout();
        for l in rank0.lines().map_while(Result::ok) {
            let mut o = stdout.lock();
            let _ = writeln!(o, "{l}");
            let _ = o.flush();
        }
    });
    let mut running = vec![true; children.len()];
    while running.iter().any(|&r| r) {
        for (r, c) in children.iter_mut().enumerate() {
            if !running[r] {
                continue;
            }
            match c.try_wait() {
                Ok(None) => {}
                Ok(Some(s)) if s.success() => running[r] = false,
                Ok(Some(s)) => return Err(fail(format!("rank {r} exited with {s}"))),
                Err(e) => return Err(fail(format!("rank {r}: {e}"))),
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = pass.join();
    Ok(())
}

/// The peer list a child reads on stdin: `rank=address,...`.
fn read_peers<A>(
    rank: u32,
    parse: impl Fn(&str) -> Option<A>,
) -> Result<Vec<(RankId, A)>, CliError> {
    let fail = |m: String| CliError::Failed(format!("rank {rank}: {m}"));
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .map_err(|e| fail(e.to_string()))?;
    let mut peers = Vec::new();
    for item in line.trim().split(',') {
        let parsed = item
            .split_once('=')
            .and_then(|(r, ad)| Some((r.parse::<u32>().ok()?, parse(ad)?)));
        peers.push(parsed.ok_or_else(|| fail(format!("bad peer list entry `{item}`")))?);
    }
    Ok(peers)
}

/// A child rank over UCX shared memory.
#[cfg(feature = "ucx")]
fn ucx_worker(rank: u32, a: &CollectivesArgs) -> Result<(), CliError> {
    use elastic_zero::runtime::transport::ucx::engine::{Engine, EngineConfig};
    use elastic_zero::runtime::transport::ucx::transport::UcxTransport;
    let fail = |m: String| CliError::Failed(format!("rank {rank}: {m}"));
    let largest = plan(a)?.sizes.into_iter().max().unwrap_or(0);
    let cfg = EngineConfig {
        max_message_bytes: largest + (64 << 10),
        ..EngineConfig::shared_memory(rank)
    };
    let engine = Engine::start(cfg).map_err(|e| fail(e.to_string()))?;
    let hex: String = engine
        .address()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    println!("ADDR {rank} {hex}");
    let peers = read_peers(rank, |h| {
        (0..h.len() / 2)
            .map(|i| u8::from_str_radix(h.get(2 * i..2 * i + 2)?, 16).ok())
            .collect::<Option<Vec<u8>>>()
    })?;
    let members: Vec<RankId> = peers.iter().map(|p| p.0).collect();
    let peers: BTreeMap<RankId, Vec<u8>> = peers.into_iter().collect();
    let max_frame = u32::try_from(largest + 1024).unwrap_or(u32::MAX);
    let t = UcxTransport::connect(rank, std::sync::Arc::new(engine), &peers, max_frame)
        .map_err(|e| fail(e.to_string()))?;
    // Dropping the transport at the end waits for this rank's sends to complete.
    run_rank(t, &members, a, "processes", &|| ())
}

fn worker(rank: u32, a: &CollectivesArgs) -> Result<(), CliError> {
    #[cfg(feature = "ucx")]
    if a.transport == "ucx" {
        return ucx_worker(rank, a);
    }
    let fail = |m: String| CliError::Failed(format!("rank {rank}: {m}"));
    let dir = a
        .secrets
        .as_ref()
        .ok_or_else(|| fail("--secrets is required".into()))?;
    let id = Identity::from_dir(dir, &format!("rank-{rank}")).map_err(|e| fail(e.to_string()))?;
    let cfg = quic_config(a)?;
    let t = QuicTransport::bind(rank, loopback(), &id, &cfg).map_err(|e| fail(e.to_string()))?;
    println!("ADDR {rank} {}", t.local_addr());
    let peers = read_peers(rank, |ad| ad.parse::<SocketAddr>().ok())?;
    let members: Vec<RankId> = peers.iter().map(|p| p.0).collect();
    t.add_peers(&peers);
    t.wait_connected(&members, cfg.connect_timeout_ms)
        .map_err(|e| fail(e.to_string()))?;
    let ctl = t.control();
    let report = || {
        if a.path_stats {
            let paths = serde_json::to_string(&ctl.paths()).unwrap_or_default();
            eprintln!("PATHS {rank} {paths}");
        }
    };
    // Dropping the transport at the end lingers until peers have every byte.
    run_rank(t, &members, a, "processes", &report)
}
