//! A misbehaving network between worker processes, made of the harness's own proxies.
//!
//! The kernel's `tc netem` would be the first choice, but it is a module many kernels lack (this
//! machine's does: `tc qdisc add ... netem` answers "Specified qdisc kind is unknown"), and it
//! needs root and a network namespace per worker. So every worker's data plane and control
//! connection go through a proxy here: the worker listens on one port and advertises the
//! proxy's (`ezero worker --data-advertise`), and it joins the coordinator through another. The
//! harness then delays, holds (a partition that heals), swallows (a blackhole) or cuts what
//! crosses, per link. Over TCP a proxy learns which worker dialled from the kernel's socket
//! table (the source port's inode, found among the workers' descriptors); over UDP (QUIC) a
//! worker sends from the port it listens on.
//!
//! Every thread polls a stop flag at least every `POLL`, and `Proxy::stop` joins them all, so a
//! scenario leaves no thread behind.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::leaks::proc_net_port;

const POLL: Duration = Duration::from_millis(25);
const BUF_BYTES: usize = 64 << 10;
/// How long a "cut" keeps a UDP link dark: QUIC has no connection to reset, so the nearest
/// thing is a burst of loss it must recover from.
const UDP_CUT: Duration = Duration::from_millis(400);

/// One direction-agnostic link end: the data plane or the control connection of a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Link {
    /// Into worker N's data plane.
    Data(usize),
    /// Worker N's control connection to the coordinator.
    Control(usize),
    /// Coordinator N's connections to the metadata store (etcd).
    Meta(usize),
}

/// What a link does to bytes crossing it now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkState {
    Pass,
    /// Every read chunk (TCP) or datagram (UDP) waits this long.
    Delay(Duration),
    /// A partition: TCP bytes wait until it heals; UDP datagrams are lost.
    Hold,
    /// Everything is swallowed.
    Blackhole,
}

/// Counters of what the proxies did, for the soak's report.
#[derive(Default, Debug)]
pub struct NetCounts {
    pub bytes_passed: AtomicU64,
    pub chunks_delayed: AtomicU64,
    pub bytes_held: AtomicU64,
    pub bytes_swallowed: AtomicU64,
    pub connections_cut: AtomicU64,
    pub datagrams_dropped: AtomicU64,
}

/// The faults in force, shared by every proxy of a scenario. A state set for (sender, link)
/// wins over one set for the whole link (sender `None`).
#[derive(Default)]
pub struct Net {
    states: Mutex<HashMap<(Option<usize>, Link), LinkState>>,
    /// Per link: connections opened before this generation are cut.
    cuts: Mutex<HashMap<Link, (u64, Instant)>>,
    /// Worker index -> pid, to tell who dialled.
    pids: Mutex<HashMap<usize, u32>>,
    /// Worker index -> the UDP port its QUIC endpoint sends from.
    udp_ports: Mutex<HashMap<u16, usize>>,
    pub counts: NetCounts,
}

impl Net {
    pub fn set(&self, from: Option<usize>, link: Link, state: LinkState) {
        let mut s = self.states.lock().unwrap();
        if state == LinkState::Pass {
            s.remove(&(from, link));
        } else {
            s.insert((from, link), state);
        }
    }

    pub fn heal_all(&self) {
        self.states.lock().unwrap().clear();
    }

    fn state(&self, from: Option<usize>, link: Link) -> LinkState {
        let s = self.states.lock().unwrap();
        from.and_then(|f| s.get(&(Some(f), link)))
            .or_else(|| s.get(&(None, link)))
            .copied()
            .unwrap_or(LinkState::Pass)
    }

    /// Resets every connection into `link` (TCP), or darkens it briefly (UDP).
    pub fn cut(&self, link: Link) {
        let mut c = self.cuts.lock().unwrap();
        let e = c.entry(link).or_insert((0, Instant::now()));
        e.0 += 1;
        e.1 = Instant::now();
    }

    fn cut_gen(&self, link: Link) -> u64 {
        self.cuts.lock().unwrap().get(&link).map_or(0, |c| c.0)
    }

    fn udp_dark(&self, link: Link) -> bool {
        self.cuts
            .lock()
            .unwrap()
            .get(&link)
            .is_some_and(|c| c.1.elapsed() < UDP_CUT && c.0 > 0)
    }

    pub fn register(&self, worker: usize, pid: u32, udp_port: Option<u16>) {
        self.pids.lock().unwrap().insert(worker, pid);
        if let Some(p) = udp_port {
            self.udp_ports.lock().unwrap().insert(p, worker);
        }
    }

    /// Which registered worker owns the local TCP socket on `port` connected to `to_port`.
    fn tcp_owner(&self, port: u16, to_port: u16) -> Option<usize> {
        let inode = socket_inode(port, to_port)?;
        let needle = format!("socket:[{inode}]");
        let pids = self.pids.lock().unwrap().clone();
        pids.into_iter().find_map(|(w, pid)| {
            let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
            fds.flatten()
                .any(|fd| {
                    std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy() == needle)
                })
                .then_some(w)
        })
    }

    fn udp_owner(&self, port: u16) -> Option<usize> {
        self.udp_ports.lock().unwrap().get(&port).copied()
    }
}

/// The inode of the TCP socket from local `port` to remote `to_port`, from /proc/net/tcp{,6}.
fn socket_inode(port: u16, to_port: u16) -> Option<u64> {
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().find_map(|f| {
        let text = std::fs::read_to_string(f).ok()?;
        text.lines().skip(1).find_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            (cols.len() > 9
                && proc_net_port(cols[1]) == Some(port)
                && proc_net_port(cols[2]) == Some(to_port))
            .then(|| cols[9].parse().ok())
            .flatten()
        })
    })
}

/// A running proxy; `stop` ends and joins every thread it started.
pub struct Proxy {
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Proxy {
    pub fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        // Threads may add pumps while we join: take until none is left.
        loop {
            let batch: Vec<JoinHandle<()>> = std::mem::take(&mut *self.threads.lock().unwrap());
            if batch.is_empty() {
                break;
            }
            for t in batch {
                let _ = t.join();
            }
        }
    }
}

/// A TCP proxy on a fresh loopback port forwarding to `upstream`, as `link`.
pub fn tcp_proxy(link: Link, upstream: SocketAddr, net: Arc<Net>) -> std::io::Result<Proxy> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
    let (s, t) = (stop.clone(), threads.clone());
    let accept = std::thread::spawn(move || {
        while !s.load(Ordering::SeqCst) {
            match listener.accept() {
                Ok((client, peer)) => {
                    let _ = client.set_nonblocking(false);
                    let Ok(server) = TcpStream::connect_timeout(&upstream, Duration::from_secs(2))
                    else {
                        continue; // the worker is gone: the dialler sees a closed connection
                    };
                    let from = match link {
                        Link::Data(_) => net.tcp_owner(peer.port(), addr.port()),
                        Link::Control(w) => Some(w),
                        Link::Meta(_) => None,
                    };
                    let gen = net.cut_gen(link);
                    for (a, b) in [(&client, &server), (&server, &client)] {
                        let (Ok(a), Ok(b)) = (a.try_clone(), b.try_clone()) else {
                            continue;
                        };
                        let (net, s) = (net.clone(), s.clone());
                        let h = std::thread::spawn(move || pump(a, b, from, link, gen, &net, &s));
                        t.lock().unwrap().push(h);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(POLL),
                Err(_) => std::thread::sleep(POLL),
            }
        }
    });
    threads.lock().unwrap().push(accept);
    Ok(Proxy {
        addr,
        stop,
        threads,
    })
}

/// Moves bytes from `a` to `b` through the link's faults until either end closes, the link is
/// cut, or the proxy stops.
fn pump(
    mut a: TcpStream,
    mut b: TcpStream,
    from: Option<usize>,
    link: Link,
    gen: u64,
    net: &Net,
    stop: &AtomicBool,
) {
    let _ = a.set_read_timeout(Some(POLL));
    let _ = b.set_write_timeout(Some(POLL));
    let mut buf = vec![0u8; BUF_BYTES];
    let over = || stop.load(Ordering::SeqCst) || net.cut_gen(link) != gen;
    'read: while !over() {
        let n = match a.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(_) => break,
        };
        let mut held = false;
        loop {
            if over() {
                break 'read;
            }
            match net.state(from, link) {
                LinkState::Pass => break,
                LinkState::Delay(d) => {
                    net.counts.chunks_delayed.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(d);
                    break;
                }
                LinkState::Hold => {
                    if !held {
                        held = true;
                        net.counts.bytes_held.fetch_add(n as u64, Ordering::Relaxed);
                    }
                    std::thread::sleep(POLL);
                }
                LinkState::Blackhole => {
                    net.counts
                        .bytes_swallowed
                        .fetch_add(n as u64, Ordering::Relaxed);
                    continue 'read;
                }
            }
        }
        let mut at = 0;
        while at < n {
            if over() {
                break 'read;
            }
            match b.write(&buf[at..n]) {
                Ok(0) => break 'read,
                Ok(k) => at += k,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(_) => break 'read,
            }
        }
        net.counts
            .bytes_passed
            .fetch_add(n as u64, Ordering::Relaxed);
    }
    if net.cut_gen(link) != gen {
        net.counts.connections_cut.fetch_add(1, Ordering::Relaxed);
        let _ = a.shutdown(Shutdown::Both);
    }
    let _ = b.shutdown(Shutdown::Both);
}

/// A UDP proxy (for QUIC) on a fresh loopback port forwarding to `upstream`, as `link`. Each
/// sender gets its own upstream socket, so replies find their way back.
pub fn udp_proxy(link: Link, upstream: SocketAddr, net: Arc<Net>) -> std::io::Result<Proxy> {
    let front = UdpSocket::bind("127.0.0.1:0")?;
    front.set_read_timeout(Some(POLL))?;
    let addr = front.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
    let (s, t) = (stop.clone(), threads.clone());
    let main = std::thread::spawn(move || {
        let mut sessions: HashMap<SocketAddr, UdpSocket> = HashMap::new();
        let mut buf = vec![0u8; 65_536];
        while !s.load(Ordering::SeqCst) {
            let Ok((n, peer)) = front.recv_from(&mut buf) else {
                continue;
            };
            let from = net.udp_owner(peer.port());
            let up = match sessions.entry(peer) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(v) => {
                    let Some(up) = udp_session(&front, peer, upstream, from, link, &net, &s, &t)
                    else {
                        continue;
                    };
                    v.insert(up)
                }
            };
            if deliver(&net, from, link) {
                let _ = up.send(&buf[..n]);
            }
        }
    });
    threads.lock().unwrap().push(main);
    Ok(Proxy {
        addr,
        stop,
        threads,
    })
}

/// A socket towards `upstream` for datagrams from `peer`, and a thread carrying the replies
/// back to it through the link's faults.
#[allow(clippy::too_many_arguments)]
fn udp_session(
    front: &UdpSocket,
    peer: SocketAddr,
    upstream: SocketAddr,
    from: Option<usize>,
    link: Link,
    net: &Arc<Net>,
    stop: &Arc<AtomicBool>,
    threads: &Mutex<Vec<JoinHandle<()>>>,
) -> Option<UdpSocket> {
    let up = UdpSocket::bind("127.0.0.1:0").ok()?;
    up.connect(upstream).ok()?;
    up.set_read_timeout(Some(POLL)).ok()?;
    let (back, reply) = (front.try_clone().ok()?, up.try_clone().ok()?);
    let (net, stop) = (net.clone(), stop.clone());
    let h = std::thread::spawn(move || {
        let mut buf = vec![0u8; 65_536];
        while !stop.load(Ordering::SeqCst) {
            if let Ok(n) = reply.recv(&mut buf) {
                if deliver(&net, from, link) {
                    let _ = back.send_to(&buf[..n], peer);
                }
            }
        }
    });
    threads.lock().unwrap().push(h);
    Some(up)
}

/// Whether one datagram crosses now (after its delay).
fn deliver(net: &Net, from: Option<usize>, link: Link) -> bool {
    if net.udp_dark(link) {
        net.counts.datagrams_dropped.fetch_add(1, Ordering::Relaxed);
        return false;
    }
    match net.state(from, link) {
        LinkState::Pass => {}
        LinkState::Delay(d) => {
            net.counts.chunks_delayed.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(d);
        }
        LinkState::Hold | LinkState::Blackhole => {
            net.counts.datagrams_dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
    }
    true
}

/// Whether this kernel can emulate links itself (`tc qdisc ... netem` in a scratch network
/// namespace): `Err` says what is missing. The harness uses its proxies either way; this is
/// printed so a reader knows which faults came from where.
pub fn probe_netem() -> Result<(), String> {
    let out = std::process::Command::new("unshare")
        .args([
            "-n",
            "sh",
            "-c",
            "ip link set lo up && tc qdisc add dev lo root netem delay 1ms",
        ])
        .output()
        .map_err(|e| format!("cannot run unshare: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}
