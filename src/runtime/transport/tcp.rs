//! A TCP data plane between worker processes: the `Transport` ranks use when each runs in its
//! own process. One connection per ordered pair of peers (the sender dials), opened on first use;
//! a reader thread per accepted connection moves frames into the rank's inbox, so a sender never
//! waits on the receiving rank's compute.
//!
//! Every connection is mutual TLS against the cluster CA (ALPN `ezero-data/1`): the dialer
//! presents its cluster certificate and checks the listener's. Inside TLS, a connection starts
//! with a hello carrying the cluster token (defence in depth) and the sender's rank. A failed
//! handshake (another CA, no certificate, not TLS) or a bad hello is refused, logged with the
//! peer's address and counted; it happens on the connection's own thread, under a timeout, so
//! it never holds up the accept loop. A data frame is a fixed header (version, tag, epoch, step,
//! sender, length, crc32) and the payload; a frame failing any check closes that connection and
//! is counted, never delivered.

use std::collections::BTreeMap;
use std::io::{BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use rustls::{ClientConnection, ServerConnection, StreamOwned};

use crate::net::tls::{check_alpn, peer_server_name, ClusterTls, Protocol};
use crate::plan::RankId;
use crate::runtime::transport::{recv_inbox, Frame, Tag, TagKind, Transport, TransportError};
use crate::wire::crc32_of;

/// 2: the header carries the tag's piece number (collectives' payloads travel in pieces), and
/// its checksum covers the header as well as the payload.
pub const DATA_VERSION: u8 = 2;
/// Largest payload of one data frame.
pub const DATA_FRAME_MAX_BYTES: u32 = 1 << 30;
const HEADER_BYTES: usize = 40;
const HELLO_MAGIC: &[u8; 4] = b"EZD1";
const TOKEN_MAX_BYTES: usize = 256;
/// How long dialing a peer (TCP connect, then each read or write of the TLS handshake and the
/// hello) may take before it counts as unreachable, or, on the accepting side, as refused.
const DIAL_TIMEOUT: Duration = Duration::from_secs(5);
/// Received bytes read from the socket per syscall: rustls alone reads 4 KiB at a time.
const READ_BUFFER_BYTES: usize = 256 << 10;

/// Counted rejections on this endpoint.
#[derive(Default, Debug)]
pub struct DataStats {
    /// Connections refused: failed TLS handshake (another CA, no certificate, another
    /// protocol, not TLS) or a bad hello (wrong token, garbage).
    pub refused_peers: AtomicU64,
    /// Frames rejected for a bad version, size, tag or checksum.
    pub rejected_frames: AtomicU64,
}

/// A bound data-plane listener; accepting starts at once, so peers that learn of it early can
/// already connect. Becomes a `TcpTransport` once the rank and its peers are known.
pub struct TcpListenerHandle {
    addr: SocketAddr,
    inbox_tx: Sender<Frame>,
    inbox_rx: Receiver<Frame>,
    stats: Arc<DataStats>,
    token: Arc<str>,
    security: Security,
}

/// How a connection is secured. Jobs always use TLS; plaintext exists only so that
/// `ezero bench collectives --plaintext` can show what encryption costs.
#[derive(Clone, Debug)]
enum Security {
    Tls(ClusterTls),
    Plaintext,
}

/// Where a connection's bytes go: a TLS stream, or (benchmark only) the bare socket.
type Writer = Box<dyn Write + Send>;

/// A dialled connection: what frames are written to, and the socket underneath, to ask the
/// kernel whether the peer has closed it.
struct Conn {
    out: Writer,
    sock: TcpStream,
}

/// Whether the kernel says this connection is no longer established: the peer closed it (its
/// reader failed a check, its process restarted, a middlebox reset it). Writing there would
/// lose the frame without an error, so the sender redials instead.
fn peer_closed(sock: &TcpStream) -> bool {
    /// `TCP_ESTABLISHED` of the kernel's TCP states (include/net/tcp_states.h).
    const TCP_ESTABLISHED: u8 = 1;
    use std::os::fd::AsRawFd;
    // SAFETY: `info` is a plain C struct the kernel fills; `len` holds its size.
    unsafe {
        let mut info: libc::tcp_info = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        let rc = libc::getsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        );
        rc == 0 && info.tcpi_state != TCP_ESTABLISHED
    }
}
type Reader = Box<dyn Read + Send>;

impl TcpListenerHandle {
    /// Binds `addr` (that address only); peers must present a certificate of the cluster CA
    /// behind `tls` and the cluster `token`.
    pub fn bind(addr: &str, token: &str, tls: &ClusterTls) -> std::io::Result<Self> {
        Self::bind_with(addr, token, Security::Tls(tls.clone()))
    }

    /// Without TLS: for measuring what encryption costs, never for a job.
    pub fn bind_plaintext_for_bench(addr: &str, token: &str) -> std::io::Result<Self> {
        Self::bind_with(addr, token, Security::Plaintext)
    }

    fn bind_with(addr: &str, token: &str, security: Security) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let (inbox_tx, inbox_rx) = mpsc::channel();
        let stats = Arc::new(DataStats::default());
        let token: Arc<str> = token.into();
        let accepting = Accepting {
            tx: inbox_tx.clone(),
            stats: Arc::clone(&stats),
            token: Arc::clone(&token),
            security: security.clone(),
        };
        std::thread::Builder::new()
            .name("data-accept".into())
            .spawn(move || accept_loop(listener, accepting))?;
        Ok(Self {
            addr,
            inbox_tx,
            inbox_rx,
            stats,
            token,
            security,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn into_transport(self, rank: RankId, peers: BTreeMap<RankId, SocketAddr>) -> TcpTransport {
        let book = PeerBook::default();
        for (r, a) in peers {
            book.add(r, a);
        }
        TcpTransport {
            rank,
            peers: book,
            inbox_tx: self.inbox_tx,
            inbox_rx: self.inbox_rx,
            stats: self.stats,
            token: self.token,
            security: self.security,
            send_stall: None,
        }
    }
}

/// What every reader thread of one listener shares.
#[derive(Clone)]
struct Accepting {
    tx: Sender<Frame>,
    stats: Arc<DataStats>,
    token: Arc<str>,
    security: Security,
}

fn accept_loop(listener: TcpListener, a: Accepting) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let a = a.clone();
        // The handshake runs on the connection's thread: a slow or hostile peer holds up only
        // its own connection.
        let spawned = std::thread::Builder::new()
            .name("data-read".into())
            .spawn(move || read_loop(stream, a));
        if spawned.is_err() {
            tracing::warn!("data plane: cannot start a reader thread; connection dropped");
        }
    }
}

fn read_loop(s: TcpStream, a: Accepting) {
    let peer = s.peer_addr().ok();
    let (from, mut r) = match accept(s, &a.security, &a.token) {
        Ok(ok) => ok,
        Err(why) => {
            a.stats.refused_peers.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(?peer, "data plane: refused a connection: {why}");
            return;
        }
    };
    loop {
        match read_frame(&mut r) {
            Ok(Some(frame)) if frame.from == from => {
                if a.tx.send(frame).is_err() {
                    return;
                }
            }
            Ok(Some(frame)) => {
                a.stats.rejected_frames.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    "data plane: rank {from} sent a frame claiming rank {}",
                    frame.from
                );
                return;
            }
            Ok(None) => return,
            Err(why) => {
                a.stats.rejected_frames.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("data plane: rejected a frame from rank {from}: {why}");
                return;
            }
        }
    }
}

/// The socket under a TLS stream on the receiving side: reads are buffered (fewer syscalls
/// than rustls's 4 KiB reads), writes (handshake and alerts only) go straight through.
struct BufferedSocket(BufReader<TcpStream>);

impl Read for BufferedSocket {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for BufferedSocket {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.get_mut().write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.get_mut().flush()
    }
}

fn set_timeouts(s: &TcpStream, t: Option<Duration>) -> std::io::Result<()> {
    s.set_read_timeout(t)?;
    s.set_write_timeout(t)
}

/// The accepting side of a connection: TLS handshake, then the hello, each step bounded by
/// `DIAL_TIMEOUT`. The peer's rank and the stream to read its frames from, or why it is refused.
fn accept(s: TcpStream, security: &Security, token: &str) -> Result<(RankId, Reader), String> {
    set_timeouts(&s, Some(DIAL_TIMEOUT)).map_err(|e| e.to_string())?;
    match security {
        Security::Plaintext => {
            let mut r = BufReader::with_capacity(READ_BUFFER_BYTES, s);
            let from = read_hello(&mut r, token)?;
            set_timeouts(r.get_ref(), None).map_err(|e| e.to_string())?;
            Ok((from, Box::new(r)))
        }
        Security::Tls(tls) => {
            let mut conn =
                ServerConnection::new(tls.server(Protocol::Data)).map_err(|e| e.to_string())?;
            let mut sock = BufferedSocket(BufReader::with_capacity(READ_BUFFER_BYTES, s));
            while conn.is_handshaking() {
                conn.complete_io(&mut sock)
                    .map_err(|e| format!("TLS handshake failed: {e}"))?;
            }
            check_alpn(conn.alpn_protocol(), Protocol::Data)?;
            let mut stream = StreamOwned::new(conn, sock);
            let from = read_hello(&mut stream, token)?;
            set_timeouts(stream.sock.0.get_ref(), None).map_err(|e| e.to_string())?;
            Ok((from, Box::new(stream)))
        }
    }
}

fn read_hello(s: &mut impl Read, token: &str) -> Result<RankId, String> {
    let mut head = [0u8; 10];
    s.read_exact(&mut head).map_err(|e| e.to_string())?;
    if &head[..4] != HELLO_MAGIC {
        return Err("not an ezero data connection".into());
    }
    let n = u16::from_le_bytes([head[4], head[5]]) as usize;
    let from = u32::from_le_bytes([head[6], head[7], head[8], head[9]]);
    if n > TOKEN_MAX_BYTES {
        return Err(format!("token of {n} bytes"));
    }
    let mut got = vec![0u8; n];
    s.read_exact(&mut got).map_err(|e| e.to_string())?;
    if got != token.as_bytes() {
        return Err("wrong cluster token".into());
    }
    Ok(from)
}

/// Dials `addr`: TCP, the TLS handshake (checking the peer's certificate against the cluster
/// CA) and the hello, each bounded by `DIAL_TIMEOUT`.
fn dial(
    addr: SocketAddr,
    security: &Security,
    token: &str,
    rank: RankId,
    send_stall: Option<Duration>,
) -> std::io::Result<Conn> {
    let mut s = TcpStream::connect_timeout(&addr, DIAL_TIMEOUT)?;
    s.set_nodelay(true)?;
    set_timeouts(&s, Some(DIAL_TIMEOUT))?;
    let mut out: Writer = match security {
        Security::Plaintext => Box::new(s.try_clone()?),
        Security::Tls(tls) => {
            let mut conn = ClientConnection::new(tls.client(Protocol::Data), peer_server_name())
                .map_err(std::io::Error::other)?;
            while conn.is_handshaking() {
                conn.complete_io(&mut s)?;
            }
            check_alpn(conn.alpn_protocol(), Protocol::Data).map_err(std::io::Error::other)?;
            Box::new(StreamOwned::new(conn, s.try_clone()?))
        }
    };
    out.write_all(&hello(token, rank))?;
    // Sends block while the peer's window is full, up to `send_stall` without progress.
    s.set_read_timeout(None)?;
    s.set_write_timeout(send_stall)?;
    Ok(Conn { out, sock: s })
}

fn hello(token: &str, from: RankId) -> Vec<u8> {
    let mut out = HELLO_MAGIC.to_vec();
    out.extend_from_slice(&(token.len() as u16).to_le_bytes());
    out.extend_from_slice(&from.to_le_bytes());
    out.extend_from_slice(token.as_bytes());
    out
}

fn tag_kind(b: u8) -> Option<TagKind> {
    use TagKind::*;
    [
        Gather,
        ReduceScatter,
        GatherGrads,
        GatherParams,
        Agree,
        Reshard,
        Replica,
        Interrupt,
        Broadcast,
        Barrier,
    ]
    .into_iter()
    .find(|k| *k as u8 == b)
}

/// The header of `frame`; the payload follows it on the wire.
pub fn encode_header(frame: &Frame) -> Result<[u8; HEADER_BYTES], TransportError> {
    let len = u32::try_from(frame.payload.len())
        .ok()
        .filter(|l| *l <= DATA_FRAME_MAX_BYTES)
        .ok_or(TransportError::Closed)?;
    let mut h = [0u8; HEADER_BYTES];
    h[0] = DATA_VERSION;
    h[1] = frame.tag.kind as u8;
    h[2] = frame.tag.attempt;
    h[3] = frame.tag.pass;
    h[4..8].copy_from_slice(&frame.tag.unit.to_le_bytes());
    h[8..16].copy_from_slice(&frame.epoch.to_le_bytes());
    h[16..24].copy_from_slice(&frame.step.to_le_bytes());
    h[24..28].copy_from_slice(&frame.from.to_le_bytes());
    h[28..32].copy_from_slice(&len.to_le_bytes());
    h[32..36].copy_from_slice(&frame.tag.piece.to_le_bytes());
    let crc = crc32_of(&[&h[..CHECKED_HEADER_BYTES], &frame.payload]);
    h[CHECKED_HEADER_BYTES..].copy_from_slice(&crc.to_le_bytes());
    Ok(h)
}

/// Header bytes the checksum covers: all but the checksum itself, which comes last. A damaged
/// tag, epoch, step, sender or length is caught like damaged data (TLS already protects them in
/// transit; this catches the rest, as the wire codec of the other planes does).
const CHECKED_HEADER_BYTES: usize = HEADER_BYTES - 4;

/// Reads one frame; `Ok(None)` when the peer closed the connection between frames.
pub fn read_frame(r: &mut impl Read) -> Result<Option<Frame>, String> {
    let mut h = [0u8; HEADER_BYTES];
    match r.read_exact(&mut h) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.to_string()),
    }
    let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    let u64_at = |i: usize| (u32_at(i) as u64) | ((u32_at(i + 4) as u64) << 32);
    if h[0] != DATA_VERSION {
        return Err(format!("version {}, expected {DATA_VERSION}", h[0]));
    }
    let kind = tag_kind(h[1]).ok_or_else(|| format!("unknown tag kind {}", h[1]))?;
    if kind == TagKind::Interrupt {
        return Err("peers may not send interrupts".into());
    }
    let len = u32_at(28);
    if len > DATA_FRAME_MAX_BYTES {
        return Err(format!(
            "payload of {len} bytes exceeds {DATA_FRAME_MAX_BYTES}"
        ));
    }
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload).map_err(|e| e.to_string())?;
    if crc32_of(&[&h[..CHECKED_HEADER_BYTES], &payload]) != u32_at(CHECKED_HEADER_BYTES) {
        return Err("checksum mismatch".into());
    }
    Ok(Some(Frame {
        epoch: u64_at(8),
        step: u64_at(16),
        from: u32_at(24),
        tag: Tag {
            kind,
            attempt: h[2],
            unit: u32_at(4),
            pass: h[3],
            piece: u32_at(32),
        },
        payload: Bytes::from(payload),
    }))
}

/// A peer's address and this rank's connection to it (dialled on first use).
type PeerLink = Arc<(SocketAddr, Mutex<Option<Conn>>)>;

/// The ranks a transport can send to. Shared, so that a rank joining a running job can be added
/// while the rank actor owns the transport.
#[derive(Clone, Default)]
pub struct PeerBook(Arc<Mutex<BTreeMap<RankId, PeerLink>>>);

impl PeerBook {
    /// Makes `rank` reachable at `addr`; a rank already known keeps its address and connection.
    pub fn add(&self, rank: RankId, addr: SocketAddr) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(rank)
            .or_insert_with(|| Arc::new((addr, Mutex::new(None))));
    }

    fn get(&self, rank: RankId) -> Option<PeerLink> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&rank)
            .cloned()
    }
}

/// One rank's endpoint on the TCP data plane.
pub struct TcpTransport {
    rank: RankId,
    peers: PeerBook,
    inbox_tx: Sender<Frame>,
    inbox_rx: Receiver<Frame>,
    stats: Arc<DataStats>,
    token: Arc<str>,
    security: Security,
    /// How long one write may move no byte before the send fails (`None`: no limit).
    send_stall: Option<Duration>,
}

/// Wakes a rank from its current receive: the runtime's side door into the inbox.
#[derive(Clone)]
pub struct Interrupter {
    tx: Sender<Frame>,
}

impl Interrupter {
    /// The receiver abandons (epoch, step) with `CommError::Interrupted`.
    pub fn interrupt(&self, epoch: u64, step: u64) {
        let tag = Tag {
            kind: TagKind::Interrupt,
            attempt: 0,
            unit: 0,
            pass: 0,
            piece: 0,
        };
        let _ = self.tx.send(Frame {
            epoch,
            step,
            from: RankId::MAX,
            tag,
            payload: Bytes::new(),
        });
    }
}

impl TcpTransport {
    /// Fails a send whose write moves no byte for `stall` (the peer stopped reading: frozen,
    /// or its link blackholed) instead of blocking the rank; the connection is dropped and the
    /// next send redials. A peer that reads slowly still makes every write progress.
    pub fn with_send_stall_timeout(mut self, stall: Duration) -> Self {
        self.send_stall = Some(stall);
        self
    }

    pub fn interrupter(&self) -> Interrupter {
        Interrupter {
            tx: self.inbox_tx.clone(),
        }
    }

    pub fn stats(&self) -> Arc<DataStats> {
        Arc::clone(&self.stats)
    }

    /// A way into this rank's inbox for another plane's frames (UCX beside TCP), which then
    /// arrive through `recv_timeout` with TCP's.
    pub fn inbox_sender(&self) -> Sender<Frame> {
        self.inbox_tx.clone()
    }

    /// The peers this endpoint sends to, for adding a joiner while a rank actor owns it.
    pub fn peer_book(&self) -> PeerBook {
        self.peers.clone()
    }

    fn write(
        &self,
        conn: &mut Option<Conn>,
        addr: SocketAddr,
        frame: &Frame,
    ) -> std::io::Result<()> {
        if conn.is_none() {
            *conn = Some(dial(
                addr,
                &self.security,
                &self.token,
                self.rank,
                self.send_stall,
            )?);
        }
        // Invariant: set just above when it was empty.
        let s = &mut conn.as_mut().expect("connected").out;
        let header =
            encode_header(frame).map_err(|_| std::io::Error::other("frame over the size limit"))?;
        s.write_all(&header)?;
        s.write_all(&frame.payload)
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> RankId {
        self.rank
    }

    fn send(&self, to: RankId, frame: Frame) -> Result<(), TransportError> {
        if to == self.rank {
            return self
                .inbox_tx
                .send(frame)
                .map_err(|_| TransportError::Closed);
        }
        let link = self.peers.get(to).ok_or(TransportError::UnknownPeer(to))?;
        let (addr, conn) = &*link;
        let mut conn = conn.lock().unwrap_or_else(|e| e.into_inner());
        if conn.as_ref().is_some_and(|c| peer_closed(&c.sock)) {
            *conn = None;
        }
        let reused = conn.is_some();
        let failed = |conn: &mut Option<Conn>, e: std::io::Error| {
            tracing::debug!("data plane: send to rank {to} failed: {e}");
            // A later send redials.
            *conn = None;
            TransportError::UnknownPeer(to)
        };
        match self.write(&mut conn, *addr, &frame) {
            Ok(()) => Ok(()),
            // A connection that broke under the write (reset, cut, stalled) is redialled once
            // and the frame sent again whole: the receiver dropped the partial copy with the
            // old connection, and drops a duplicate by its tag. A fresh dial that failed is
            // not tried again at once: the peer is unreachable now.
            Err(e) if reused => {
                tracing::debug!("data plane: send to rank {to} broke ({e}); redialling");
                *conn = None;
                self.write(&mut conn, *addr, &frame)
                    .map_err(|e| failed(&mut conn, e))
            }
            Err(e) => Err(failed(&mut conn, e)),
        }
    }

    fn recv_timeout(&mut self, timeout_ms: u64) -> Result<Frame, TransportError> {
        recv_inbox(&self.inbox_rx, timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::ClusterCa;
    use crate::runtime::transport::test_frame;

    fn frame(from: RankId, unit: u32, payload: &'static [u8]) -> Frame {
        test_frame(1, from, unit, payload)
    }

    fn cluster_tls(ca: &ClusterCa, name: &str) -> ClusterTls {
        ClusterTls::new(&ca.issue(name).unwrap()).unwrap()
    }

    /// Waits (bounded) until `b` has refused `n` connections.
    fn wait_refused(b: &TcpTransport, n: u64) -> u64 {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let count = || b.stats().refused_peers.load(Ordering::Relaxed);
        while count() < n && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        count()
    }

    #[test]
    fn frames_cross_between_two_endpoints() {
        let ca = ClusterCa::generate("t").unwrap();
        let (a, b) = (
            TcpListenerHandle::bind("127.0.0.1:0", "t", &cluster_tls(&ca, "rank-0")).unwrap(),
            TcpListenerHandle::bind("127.0.0.1:0", "t", &cluster_tls(&ca, "rank-1")).unwrap(),
        );
        let peers: BTreeMap<_, _> = [(0, a.local_addr()), (1, b.local_addr())].into();
        let a = a.into_transport(0, peers.clone());
        let mut b = b.into_transport(1, peers);
        a.send(1, frame(0, 5, b"hello")).unwrap();
        let big = vec![7u8; 3 << 20];
        let mut f = frame(0, 6, b"");
        f.payload = Bytes::from(big.clone());
        a.send(1, f).unwrap();
        a.send(1, frame(0, 7, b"")).unwrap();
        let got = b.recv_timeout(5_000).unwrap();
        assert_eq!(
            (got.from, got.tag.unit, &got.payload[..]),
            (0, 5, &b"hello"[..])
        );
        let got = b.recv_timeout(5_000).unwrap();
        assert_eq!((got.tag.unit, &got.payload[..]), (6, &big[..]));
        let got = b.recv_timeout(5_000).unwrap();
        assert_eq!((got.tag.unit, got.payload.len()), (7, 0));
        b.interrupter().interrupt(1, 2);
        assert_eq!(b.recv_timeout(5_000).unwrap().tag.kind, TagKind::Interrupt);
        assert!(matches!(
            b.recv_timeout(10),
            Err(TransportError::Timeout(10))
        ));
        assert_eq!(b.stats().refused_peers.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_joiner_added_to_the_peer_book_is_reachable_both_ways() {
        let ca = ClusterCa::generate("t").unwrap();
        let (a, j) = (
            TcpListenerHandle::bind("127.0.0.1:0", "t", &cluster_tls(&ca, "rank-0")).unwrap(),
            TcpListenerHandle::bind("127.0.0.1:0", "t", &cluster_tls(&ca, "worker")).unwrap(),
        );
        let (a_addr, j_addr) = (a.local_addr(), j.local_addr());
        let mut a = a.into_transport(0, [(0, a_addr)].into());
        let mut j = j.into_transport(1, [(0, a_addr), (1, j_addr)].into());
        assert!(matches!(
            a.send(1, frame(0, 1, b"early")),
            Err(TransportError::UnknownPeer(1))
        ));
        a.peer_book().add(1, j_addr);
        a.send(1, frame(0, 2, b"to joiner")).unwrap();
        j.send(0, frame(1, 3, b"from joiner")).unwrap();
        let got = j.recv_timeout(5_000).unwrap();
        assert_eq!((got.from, &got.payload[..]), (0, &b"to joiner"[..]));
        let got = a.recv_timeout(5_000).unwrap();
        assert_eq!((got.from, &got.payload[..]), (1, &b"from joiner"[..]));
    }

    #[test]
    fn a_peer_with_the_wrong_token_is_refused_and_counted() {
        let ca = ClusterCa::generate("t").unwrap();
        let b = TcpListenerHandle::bind("127.0.0.1:0", "right", &cluster_tls(&ca, "b")).unwrap();
        let wrong =
            TcpListenerHandle::bind("127.0.0.1:0", "wrong", &cluster_tls(&ca, "w")).unwrap();
        let peers: BTreeMap<_, _> = [(0, wrong.local_addr()), (1, b.local_addr())].into();
        let wrong = wrong.into_transport(0, peers.clone());
        let mut b = b.into_transport(1, peers);
        // The write may succeed (the kernel buffers it) but nothing is delivered.
        let _ = wrong.send(1, frame(0, 1, b"x"));
        assert_eq!(wait_refused(&b, 1), 1);
        assert!(matches!(
            b.recv_timeout(300),
            Err(TransportError::Timeout(_))
        ));
    }

    /// Dials `addr` with `config`, completes what it can of the handshake and writes a hello
    /// and a frame; errors are ignored (the listener decides).
    fn raw_tls_client(addr: SocketAddr, config: Arc<rustls::ClientConfig>) {
        let Ok(mut s) = TcpStream::connect(addr) else {
            return;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let mut conn = ClientConnection::new(config, peer_server_name()).unwrap();
        while conn.is_handshaking() {
            if conn.complete_io(&mut s).is_err() {
                return;
            }
        }
        let mut tls = StreamOwned::new(conn, s);
        let f = frame(0, 1, b"intruder");
        let _ = tls.write_all(&hello("t", 0));
        let _ = tls.write_all(&encode_header(&f).unwrap());
        let _ = tls.write_all(&f.payload);
        let _ = tls.flush();
    }

    #[test]
    fn peers_without_a_cluster_certificate_are_refused_and_counted() {
        let ca = ClusterCa::generate("cluster").unwrap();
        let foreign = ClusterCa::generate("someone else").unwrap();
        let b = TcpListenerHandle::bind("127.0.0.1:0", "t", &cluster_tls(&ca, "b")).unwrap();
        let addr = b.local_addr();
        let mut b = b.into_transport(1, BTreeMap::new());
        let good = TcpListenerHandle::bind("127.0.0.1:0", "t", &cluster_tls(&ca, "a")).unwrap();
        let good = good.into_transport(0, [(1, addr)].into());
        // A member of the cluster gets through: the refusals below are not a broken listener.
        good.send(1, frame(0, 1, b"member")).unwrap();
        assert_eq!(&b.recv_timeout(20_000).unwrap().payload[..], b"member");

        // 1. A certificate from another CA (the intruder knows the cluster CA's public cert).
        let mut stolen = foreign.issue("rank-0").unwrap();
        stolen.ca = ca.cert().clone();
        let intruder =
            TcpListenerHandle::bind("127.0.0.1:0", "t", &ClusterTls::new(&stolen).unwrap())
                .unwrap()
                .into_transport(0, [(1, addr)].into());
        let _ = intruder.send(1, frame(0, 1, b"foreign"));
        // 2. No client certificate at all.
        let no_cert = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates({
            let mut r = rustls::RootCertStore::empty();
            r.add(ca.cert().clone()).unwrap();
            r
        })
        .with_no_client_auth();
        let mut no_cert = no_cert;
        no_cert.alpn_protocols = vec![Protocol::Data.alpn().to_vec()];
        raw_tls_client(addr, Arc::new(no_cert));
        // 3. A cluster certificate, but the control protocol's ALPN.
        raw_tls_client(addr, cluster_tls(&ca, "c").client(Protocol::Control));
        // 4. No TLS: the plaintext hello of the bench-only mode.
        let plain = TcpListenerHandle::bind_plaintext_for_bench("127.0.0.1:0", "t")
            .unwrap()
            .into_transport(0, [(1, addr)].into());
        let _ = plain.send(1, frame(0, 1, b"plaintext"));

        assert_eq!(wait_refused(&b, 4), 4);
        assert!(matches!(
            b.recv_timeout(300),
            Err(TransportError::Timeout(_))
        ));
        assert_eq!(b.stats().rejected_frames.load(Ordering::Relaxed), 0);
        // The listener still accepts members after the refusals.
        let again = TcpListenerHandle::bind("127.0.0.1:0", "t", &cluster_tls(&ca, "d")).unwrap();
        let again = again.into_transport(0, [(1, addr)].into());
        again.send(1, frame(0, 2, b"still here")).unwrap();
        assert_eq!(&b.recv_timeout(20_000).unwrap().payload[..], b"still here");
    }

    #[test]
    fn corrupt_frames_are_rejected_never_delivered() {
        let mut f = frame(3, 9, b"payload");
        f.tag = f.tag.piece(70_000);
        let mut wire = encode_header(&f).unwrap().to_vec();
        wire.extend_from_slice(&f.payload);
        let back = read_frame(&mut &wire[..]).unwrap().unwrap();
        assert_eq!((back.tag, back.from, back.epoch), (f.tag, 3, f.epoch));
        let damaged = [
            (0, "version"),
            (1, "tag kind"),
            (2, "checksum"),  // attempt
            (9, "checksum"),  // epoch
            (25, "checksum"), // sender
            (33, "checksum"), // piece
            (HEADER_BYTES + 2, "checksum"),
        ];
        for (at, what) in damaged {
            let mut bad = wire.clone();
            bad[at] ^= 0x7f;
            let err = read_frame(&mut &bad[..]).unwrap_err();
            assert!(err.contains(what), "{err}");
        }
        let mut huge = wire.clone();
        huge[28..32].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(read_frame(&mut &huge[..]).unwrap_err().contains("exceeds"));
        // A payload cut short is an error; a clean end between frames is not.
        assert!(read_frame(&mut &wire[..HEADER_BYTES + 3]).is_err());
        assert!(read_frame(&mut &wire[..0]).unwrap().is_none());
    }
}
