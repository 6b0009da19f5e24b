//! `ezero launch --nprocs N -- <train flags>`: a coordinator and N worker processes on this
//! machine, their output streamed into one view (the coordinator's lines as they are, each
//! worker's prefixed with its launch index), and the coordinator's exit code as ours. With
//! `--join COUNT@STEP` it also starts COUNT standby workers per join, which the scripted joins
//! take.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use clap::{Args, Parser};

use std::path::PathBuf;

use elastic_zero::runtime::procs::control_plane::DataPlane;

use super::launch_coords::{wait_coordinators, wait_for_addresses, LaunchMeta};
use super::procs::{check_train_args, parse_data_plane, ProcsArgs};
use super::{CliError, TrainArgs};

/// `ezero launch` flags.
#[derive(Args)]
pub struct LaunchArgs {
    /// Worker processes (one rank each).
    #[arg(long)]
    pub nprocs: u32,
    /// Where the coordinator accepts workers (host:port; port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Serve the HTTP control endpoint on the coordinator (GET /status, GET /metrics,
    /// POST /ranks/{id}/drain, POST /ranks/{id}/kill with --control-allow-kill); port 0 picks
    /// a free one and prints it. Off unless given.
    #[arg(long, value_name = "ADDR", value_parser = super::parse_control_addr)]
    pub control: Option<std::net::SocketAddr>,
    /// With --control: allow POST /ranks/{id}/kill (the worker ends its own process with
    /// SIGKILL halfway through the next step; for tests and demos).
    #[arg(long, requires = "control")]
    pub control_allow_kill: bool,
    /// With --control: serve HTTPS with the coordinator's cluster certificate (see `ezero
    /// coordinator --help`) [default: plain HTTP].
    #[arg(long, requires = "control")]
    pub control_tls: bool,
    /// Data plane between workers [default: tcp]: tcp, quic, or ucx (shared memory between
    /// the workers, which a launch runs on this machine). Every connection of the launch
    /// (control, TCP and QUIC data) is mutual TLS with a CA made for this launch.
    #[arg(long, value_parser = parse_data_plane)]
    pub transport: Option<DataPlane>,
    /// With --transport ucx: UCX over these network devices too (see `ezero coordinator
    /// --help`; a launch's workers share this host, so it matters only to standbys joining
    /// from other hosts). NOT ENCRYPTED.
    #[arg(long, value_name = "DEVICES")]
    pub ucx_net: Option<String>,
    /// Use this secrets directory (an operator's CA) instead of a fresh CA made for this launch.
    #[arg(long, value_name = "DIR")]
    pub secrets: Option<PathBuf>,
    /// Start this many coordinators: one leads, the others stand by and take the job over
    /// when the leader is lost, with nothing lost (each gets its own control port, counting up
    /// from --control's when that is not 0) [default: 1].
    #[arg(long, default_value_t = 1)]
    pub coordinators: u32,
    /// Where the coordinators keep the job's state (`ezero coordinator --meta`): `file:DIR`,
    /// `etcd://HOST:PORT[,...]`, or `etcd-local` (a throwaway etcd this launch starts; the
    /// `etcd` binary must be on PATH) [default: with --coordinators above 1, a fresh directory
    /// removed at the end; else none].
    #[arg(long, value_name = "URL")]
    pub meta: Option<String>,
    /// The job's name in the metadata store [default: launch-PID].
    #[arg(long)]
    pub job_id: Option<String>,
    /// The leading coordinator's lease (`ezero coordinator --lease-ttl-ms`) [default: 3000].
    #[arg(long)]
    pub lease_ttl_ms: Option<u64>,
    /// How long a new leader waits for the workers to re-attach (`ezero coordinator
    /// --reattach-wait-ms`) [default: 5000].
    #[arg(long)]
    pub reattach_wait_ms: Option<u64>,
    #[command(flatten)]
    pub procs: ProcsArgs,
    /// Train flags, as for `ezero train` (after `--`).
    #[arg(last = true)]
    pub train: Vec<String>,
}

/// Parses the train flags after `--` exactly as `ezero train` would.
#[derive(Parser)]
#[command(name = "ezero launch --")]
struct TrainFlags {
    #[command(flatten)]
    args: TrainArgs,
}

/// How long the coordinator has to print its address.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(30);

pub fn run(a: &LaunchArgs) -> Result<(), CliError> {
    let args = train_args(a)?;
    // With --resume the config is the checkpoint's: checked here too, so that a missing or
    // damaged checkpoint is refused before any process starts.
    let (cfg, _) = super::checkpoint::resolve_train(&args)?;
    check_train_args(&args, &cfg)?;
    let procs = a.procs.resolve()?;
    let token = new_token();
    let transport = a.transport.unwrap_or(DataPlane::Tcp);
    // A malformed argument is reported whether or not libucx is here. The coordinator says
    // that UCX over a network is not encrypted.
    super::procs::check_ucx_net(transport, a.ucx_net.as_deref(), false)?;
    super::procs::check_data_plane(transport)?;
    let secrets = match &a.secrets {
        Some(dir) => Secrets {
            dir: dir.clone(),
            ours: false,
        },
        None => Secrets::fresh(&token)?,
    };
    let exe = std::env::current_exe()
        .map_err(|e| CliError::Failed(format!("cannot find the ezero binary: {e}")))?;
    let meta = LaunchMeta::prepare(a)?;
    let (lines_tx, lines) = mpsc::channel::<Line>();
    let mut coords = Vec::new();
    for i in 0..a.coordinators {
        let each = Each {
            index: i,
            meta: meta.as_ref(),
        };
        let mut coord = match spawn_coordinator(a, &exe, transport, &secrets, &token, each) {
            Ok(c) => c,
            Err(e) => {
                kill_all(&mut coords);
                return Err(e);
            }
        };
        relay(&mut coord, None, &lines_tx);
        coords.push(coord);
    }
    let addr = match wait_for_addresses(&mut coords, &lines, LISTEN_TIMEOUT) {
        Ok(addrs) => addrs.join(","),
        Err(why) => {
            let codes = kill_all(&mut coords);
            drain(&lines);
            return Err(match codes.contains(&Some(2)) {
                true => CliError::Usage(why),
                false => CliError::Failed(why),
            });
        }
    };
    // Scripted joins find their worker processes waiting as standbys.
    let standbys: u32 = cfg.join.iter().map(|j| j.value).sum();
    let workers = Workers {
        exe: &exe,
        addr: &addr,
        secrets: &secrets,
        token: &token,
    };
    let mut workers = workers.spawn(a.nprocs, standbys, &lines_tx);
    drop(lines_tx);
    // SIGTERM or SIGINT to the launcher is passed on to the coordinator as SIGTERM: with
    // --save-dir it saves at the next step boundary and stops, as `ezero train` does, and a
    // second signal stops it at once; without, it stops at once. The workers then see its
    // connection close and exit, so nothing is left running.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        let _ = signal_hook::flag::register(sig, Arc::clone(&stop));
    }
    let coord_status = wait_coordinators(&mut coords, &lines, &stop);
    // The coordinator told every worker to stop; a worker that has not stopped within the
    // heartbeat timeout (plus slack) is killed and reported.
    let grace = Duration::from_millis(procs.heartbeat_timeout_ms) + Duration::from_secs(5);
    let stuck = reap_workers(&mut workers, &lines, grace);
    drain(&lines);
    if !stuck.is_empty() {
        eprintln!(
            "ezero launch: workers {stuck:?} had not exited {} ms after the coordinator; killed",
            grace.as_millis()
        );
    }
    drop(meta);
    launch_outcome(coord_status, stuck.is_empty())
}

/// Kills every coordinator started so far; their exit codes.
fn kill_all(coords: &mut [Child]) -> Vec<Option<i32>> {
    coords
        .iter_mut()
        .map(|c| {
            let _ = c.kill();
            c.wait().ok().and_then(|s| s.code())
        })
        .collect()
}

/// Which of the launch's coordinators is started, and the store they share.
struct Each<'a> {
    index: u32,
    meta: Option<&'a LaunchMeta>,
}

/// The train flags after `--`, parsed as `ezero train` would and checked against the launch's
/// own flags; `--ranks` becomes `--nprocs`.
fn train_args(a: &LaunchArgs) -> Result<TrainArgs, CliError> {
    if a.nprocs == 0 || a.nprocs > 1024 {
        return Err(CliError::Usage(
            "--nprocs must be between 1 and 1024".into(),
        ));
    }
    let flags = TrainFlags::try_parse_from(
        std::iter::once("ezero launch --".to_string()).chain(a.train.iter().cloned()),
    )
    .map_err(|e| {
        let text = e.to_string();
        CliError::Usage(text.lines().next().unwrap_or("bad train flags").to_string())
    })?;
    if let Some(r) = flags.args.ranks.filter(|r| *r != a.nprocs) {
        return Err(CliError::Usage(format!(
            "--ranks {r} disagrees with --nprocs {}: leave --ranks out",
            a.nprocs
        )));
    }
    if a.control.is_some() && flags.args.control.is_some() {
        return Err(CliError::Usage(
            "--control is given twice (before and after --): give it once".into(),
        ));
    }
    let mut args = flags.args;
    args.ranks = Some(a.nprocs);
    Ok(args)
}

/// Starts `ezero coordinator` with the launch's flags and the train flags, its output piped.
fn spawn_coordinator(
    a: &LaunchArgs,
    exe: &std::path::Path,
    transport: DataPlane,
    secrets: &Secrets,
    token: &str,
    each: Each<'_>,
) -> Result<Child, CliError> {
    // Each coordinator serves its own endpoint: a fixed port counts up.
    let control = a.control.map(|mut c| {
        if c.port() != 0 {
            c.set_port(c.port().saturating_add(each.index as u16));
        }
        c
    });
    let meta = each.meta.map(|m| m.flags.clone()).unwrap_or_default();
    let id = each
        .meta
        .map(|_| vec!["--coordinator-id".to_string(), format!("c{}", each.index)])
        .unwrap_or_default();
    Command::new(exe)
        .arg("coordinator")
        .args(["--listen", &a.listen, "--ranks", &a.nprocs.to_string()])
        .args(meta)
        .args(id)
        .args(
            control
                .iter()
                .flat_map(|c| ["--control".to_string(), c.to_string()]),
        )
        .args(a.control_allow_kill.then_some("--control-allow-kill"))
        .args(a.control_tls.then_some("--control-tls"))
        .args(["--transport", transport.name()])
        .args(
            a.ucx_net
                .iter()
                .flat_map(|d| ["--ucx-net".to_string(), d.clone()]),
        )
        .args(a.procs.to_flags())
        .arg("--secrets")
        .arg(&secrets.dir)
        .args(&a.train)
        .env("EZERO_CLUSTER_TOKEN", token)
        .env_remove("EZERO_CLUSTER_TOKEN_FILE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| CliError::Failed(format!("cannot start the coordinator: {e}")))
}

/// What every `ezero worker` of the launch is started with.
struct Workers<'a> {
    exe: &'a std::path::Path,
    addr: &'a str,
    secrets: &'a Secrets,
    token: &'a str,
}

impl Workers<'_> {
    /// Starts `nprocs` workers (each hinted its launch index as its rank) and `standbys` more,
    /// relaying their output; stops at the first that cannot start.
    fn spawn(&self, nprocs: u32, standbys: u32, lines_tx: &mpsc::Sender<Line>) -> Vec<Child> {
        let mut workers = Vec::new();
        for i in 0..nprocs + standbys {
            let mut cmd = Command::new(self.exe);
            cmd.args(["worker", "--join", self.addr]);
            if i < nprocs {
                cmd.env("EZERO_RANK_HINT", i.to_string());
            } else {
                cmd.arg("--standby");
            }
            let child = cmd
                .arg("--secrets")
                .arg(&self.secrets.dir)
                .env("EZERO_CLUSTER_TOKEN", self.token)
                .env_remove("EZERO_CLUSTER_TOKEN_FILE")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn();
            match child {
                Ok(mut c) => {
                    relay(&mut c, Some(i), lines_tx);
                    workers.push(c);
                }
                Err(e) => {
                    eprintln!("ezero launch: cannot start worker {i}: {e}");
                    break;
                }
            }
        }
        workers
    }
}

/// Waits up to `grace` for every worker, printing their output; kills those still running and
/// returns their launch indices.
fn reap_workers(
    workers: &mut [Child],
    lines: &mpsc::Receiver<Line>,
    grace: Duration,
) -> Vec<usize> {
    let deadline = Instant::now() + grace;
    let mut stuck = Vec::new();
    for (i, w) in workers.iter_mut().enumerate() {
        if wait_printing(w, lines, Some(deadline), None).is_none() {
            let _ = w.kill();
            let _ = w.wait();
            stuck.push(i);
        }
    }
    stuck
}

/// The launch's result: the coordinator's exit code, and a failure if a worker had to be killed.
fn launch_outcome(coord_status: Option<ExitStatus>, none_stuck: bool) -> Result<(), CliError> {
    match coord_status.and_then(|s| s.code()) {
        Some(0) if none_stuck => Ok(()),
        Some(2) => Err(CliError::Usage(
            "the coordinator refused the job (see above)".into(),
        )),
        Some(code) => Err(CliError::Failed(format!(
            "the coordinator exited with code {code}"
        ))),
        None => Err(CliError::Failed(
            "the coordinator was killed by a signal".into(),
        )),
    }
}

/// A line of a child's output: (worker index or `None` for the coordinator, stderr?, text).
pub(super) type Line = (Option<u32>, bool, String);

/// Forwards a child's stdout and stderr line by line into `tx`.
fn relay(child: &mut Child, who: Option<u32>, tx: &mpsc::Sender<Line>) {
    fn pump(r: impl Read + Send + 'static, who: Option<u32>, err: bool, tx: mpsc::Sender<Line>) {
        std::thread::spawn(move || {
            for line in BufReader::new(r).lines().map_while(Result::ok) {
                if tx.send((who, err, line)).is_err() {
                    return;
                }
            }
        });
    }
    if let Some(out) = child.stdout.take() {
        pump(out, who, false, tx.clone());
    }
    if let Some(err) = child.stderr.take() {
        pump(err, who, true, tx.clone());
    }
}

pub(super) fn print((who, err, text): Line) {
    let line = match who {
        None => text,
        Some(i) => format!("[worker {i}] {text}"),
    };
    if err {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
}

/// Prints output while waiting for `child` to exit (until `deadline`, if any).
/// Each time `stop` is set (a signal to us), the child gets a SIGTERM.
fn wait_printing(
    child: &mut Child,
    lines: &mpsc::Receiver<Line>,
    deadline: Option<Instant>,
    stop: Option<&AtomicBool>,
) -> Option<ExitStatus> {
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if stop.is_some_and(|s| s.swap(false, Ordering::Relaxed)) {
            terminate(child);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return None;
        }
        if let Ok(line) = lines.recv_timeout(Duration::from_millis(50)) {
            print(line);
        }
    }
}

/// Sends SIGTERM to `child` (a no-op once it has exited and been reaped).
pub(super) fn terminate(child: &Child) {
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: kill(2) has no memory effects; the pid is our own unreaped child's.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
    }
}

/// Prints what is left once every child has exited (the pumps end at EOF), for a bounded time.
fn drain(lines: &mpsc::Receiver<Line>) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while let Ok(line) = lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        print(line);
    }
}

/// The cluster's secrets directory; a fresh one made for this launch is removed at the end.
struct Secrets {
    dir: PathBuf,
    ours: bool,
}

impl Secrets {
    fn fresh(token: &str) -> Result<Self, CliError> {
        let dir = std::env::temp_dir().join(format!(
            "ezero-launch-{}-{}",
            std::process::id(),
            &token[..8]
        ));
        elastic_zero::net::init_secrets(&dir)
            .map_err(|e| CliError::Failed(format!("cannot make the cluster CA: {e}")))?;
        Ok(Self { dir, ours: true })
    }
}

impl Drop for Secrets {
    fn drop(&mut self) {
        if self.ours {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A fresh cluster token: 128 random bits from the OS, hex.
fn new_token() -> String {
    let mut bytes = [0u8; 16];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if read.is_err() {
        // No /dev/urandom: fall back to time and pid, hashed (unguessable enough for a launch
        // whose processes all run on this machine).
        use sha2::Digest;
        let seed = format!("{:?}{}", std::time::SystemTime::now(), std::process::id());
        bytes.copy_from_slice(&sha2::Sha256::digest(seed.as_bytes())[..16]);
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
