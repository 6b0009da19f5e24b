//! A throwaway single-member etcd on loopback (`--meta etcd-local`, demos and tests): started
//! from PATH with its data in a directory of ours, stopped when dropped.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{MetaError, MetaUrl};
use crate::runtime::clock::{Deadline, SystemClock};

/// How long a fresh etcd may take to answer its health check.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// Between two health checks.
const POLL: Duration = Duration::from_millis(50);

/// A running local etcd; dropping it kills the process (and removes its directory if it made
/// it).
pub struct LocalEtcd {
    child: Child,
    client: SocketAddr,
    data_dir: PathBuf,
    /// A directory made for it alone, removed when it stops.
    owned_dir: Option<PathBuf>,
}

impl LocalEtcd {
    /// The client endpoint, as [`MetaUrl::Etcd`] holds it.
    pub fn endpoints(&self) -> Vec<String> {
        vec![format!("http://{}", self.client)]
    }

    /// `etcd://127.0.0.1:PORT`, for the coordinators this etcd serves.
    pub fn url(&self) -> MetaUrl {
        MetaUrl::Etcd {
            endpoints: self.endpoints(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(dir) = &self.owned_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A loopback port nobody listens on now.
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

fn io_err(path: &Path, detail: impl std::fmt::Display) -> MetaError {
    MetaError::Io {
        path: path.to_path_buf(),
        detail: detail.to_string(),
    }
}

/// How often a start that failed (another process took a port we picked) is tried again.
const START_TRIES: usize = 3;

/// Starts `etcd` from PATH on free loopback ports with its data under `dir` (which must exist),
/// and waits until it reports itself healthy.
pub fn spawn_local_etcd(dir: &Path) -> Result<LocalEtcd, MetaError> {
    spawn_local_etcd_from(Path::new("etcd"), dir)
}

/// [`spawn_local_etcd`] with the etcd binary at `etcd` (a name looked up on PATH, or a path).
pub fn spawn_local_etcd_from(etcd: &Path, dir: &Path) -> Result<LocalEtcd, MetaError> {
    let mut tries = 0;
    loop {
        tries += 1;
        match spawn_once(etcd, dir) {
            Err(MetaError::Unreachable { detail, .. })
                if detail.contains("exited at start") && tries < START_TRIES =>
            {
                let _ = std::fs::remove_dir_all(dir.join("etcd-data"));
            }
            done => return done,
        }
    }
}

fn spawn_once(etcd: &Path, dir: &Path) -> Result<LocalEtcd, MetaError> {
    let (client, peer) = match (free_port(), free_port()) {
        (Ok(c), Ok(p)) => (c, p),
        (Err(e), _) | (_, Err(e)) => return Err(io_err(dir, format!("no free port: {e}"))),
    };
    let data_dir = dir.join("etcd-data");
    let log_path = dir.join("etcd.log");
    let log = std::fs::File::create(&log_path)
        .map_err(|e| io_err(&log_path, format!("cannot be written: {e}")))?;
    let log2 = log.try_clone().map_err(|e| io_err(&log_path, e))?;
    let client_url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let child = Command::new(etcd)
        .args(["--name", "ezero-local", "--data-dir"])
        .arg(&data_dir)
        .args(["--listen-client-urls", &client_url])
        .args(["--advertise-client-urls", &client_url])
        .args(["--listen-peer-urls", &peer_url])
        .args(["--initial-advertise-peer-urls", &peer_url])
        .arg(format!("--initial-cluster=ezero-local={peer_url}"))
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .spawn()
        .map_err(|e| spawn_error(etcd, dir, e))?;
    let mut etcd = LocalEtcd {
        child,
        client: SocketAddr::from((Ipv4Addr::LOCALHOST, client)),
        data_dir,
        owned_dir: None,
    };
    wait_healthy(&mut etcd, &log_path)?;
    Ok(etcd)
}

fn spawn_error(etcd: &Path, dir: &Path, e: std::io::Error) -> MetaError {
    if e.kind() == std::io::ErrorKind::NotFound {
        return MetaError::Unreachable {
            endpoints: "a local etcd".into(),
            detail: format!("{} is not on PATH: install etcd (apt-get install etcd-server) or pass --meta etcd://HOST:PORT of a running etcd", etcd.display()),
        };
    }
    io_err(dir, format!("etcd could not be started: {e}"))
}

/// `spawn_local_etcd` in a fresh directory under the system's temporary folder, removed when
/// it stops.
pub(super) fn spawn_local_etcd_temp() -> Result<LocalEtcd, MetaError> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("ezero-etcd-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| io_err(&dir, format!("cannot be made: {e}")))?;
    match spawn_local_etcd(&dir) {
        Ok(mut etcd) => {
            etcd.owned_dir = Some(dir);
            Ok(etcd)
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            Err(e)
        }
    }
}

/// Polls etcd's `/health` until it answers healthy, the process exits, or [`START_TIMEOUT`].
fn wait_healthy(etcd: &mut LocalEtcd, log: &Path) -> Result<(), MetaError> {
    let clock = SystemClock::default();
    let deadline = Deadline::after(&clock, START_TIMEOUT.as_millis() as u64);
    let failed = |detail: String| MetaError::Unreachable {
        endpoints: format!("the local etcd at {}", etcd.client),
        detail: format!("{detail} (its log: {})", log.display()),
    };
    loop {
        if let Ok(Some(status)) = etcd.child.try_wait() {
            return Err(failed(format!("etcd exited at start ({status})")));
        }
        if healthy(etcd.client) {
            return Ok(());
        }
        if deadline.left_ms(&clock) == 0 {
            return Err(failed(format!("not healthy within {START_TIMEOUT:?}")));
        }
        std::thread::sleep(POLL);
    }
}

/// Whether `GET /health` answers `"health":"true"`.
fn healthy(addr: SocketAddr) -> bool {
    let ask = || -> std::io::Result<String> {
        let mut s = TcpStream::connect_timeout(&addr, POLL * 4)?;
        s.set_read_timeout(Some(POLL * 10))?;
        let request = format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n");
        s.write_all(request.as_bytes())?;
        let mut answer = String::new();
        s.read_to_string(&mut answer)?;
        Ok(answer)
    };
    ask().is_ok_and(|a| a.replace(' ', "").contains("\"health\":\"true\""))
}
