//! Real etcd on loopback for the tests: one member (the runtime's own `spawn_local_etcd`) or a
//! cluster of three, each stopped (and its data removed) when dropped.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Whether `bin` is on PATH.
pub fn on_path(bin: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
}

/// Fails the test (never skips it) when etcd is missing.
pub fn require_etcd() {
    assert!(
        on_path("etcd"),
        "needs the etcd binary on PATH (Debian: apt-get install etcd-server; .ci/run installs it)"
    );
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A three-member etcd cluster on loopback.
pub struct Cluster {
    members: Vec<Option<Child>>,
    /// `127.0.0.1:PORT` of each member's client endpoint.
    pub clients: Vec<String>,
    _dir: tempfile::TempDir,
}

impl Cluster {
    pub fn start() -> Cluster {
        require_etcd();
        let dir = tempfile::tempdir().unwrap();
        let ports: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect();
        let members = ports
            .iter()
            .enumerate()
            .map(|(i, &(client, peer))| Some(member(dir.path(), i, client, peer, &initial)))
            .collect();
        let clients = ports
            .iter()
            .map(|(c, _)| format!("127.0.0.1:{c}"))
            .collect();
        let cluster = Cluster {
            members,
            clients,
            _dir: dir,
        };
        cluster.wait_healthy(Duration::from_secs(30));
        cluster
    }

    /// `etcd://A,B,C`.
    pub fn url(&self) -> String {
        format!("etcd://{}", self.clients.join(","))
    }

    /// kill -9 of member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Every member answers `GET /health` with `"health":"true"` (the cluster has a leader).
    fn wait_healthy(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.clients.iter().all(|c| healthy(c)) {
            assert!(
                Instant::now() < deadline,
                "the etcd cluster did not become healthy"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

fn healthy(addr: &str) -> bool {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let req = format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    let mut body = String::new();
    s.write_all(req.as_bytes()).is_ok()
        && s.read_to_string(&mut body).is_ok()
        && body.contains("\"health\":\"true\"")
}

fn member(dir: &Path, i: usize, client: u16, peer: u16, initial: &[String]) -> Child {
    let client_url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let log = std::fs::File::create(dir.join(format!("m{i}.log"))).unwrap();
    Command::new("etcd")
        .args(["--name", &format!("m{i}"), "--data-dir"])
        .arg(dir.join(format!("m{i}")))
        .args(["--listen-client-urls", &client_url])
        .args(["--advertise-client-urls", &client_url])
        .args(["--listen-peer-urls", &peer_url])
        .args(["--initial-advertise-peer-urls", &peer_url])
        .arg(format!("--initial-cluster={}", initial.join(",")))
        .args(["--initial-cluster-state", "new"])
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("etcd starts")
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}
