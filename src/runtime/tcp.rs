//! A TCP data plane between worker processes: the `Transport` ranks use when each runs in its
//! own process. One connection per ordered pair of peers (the sender dials), opened on first use;
//! a reader thread per accepted connection moves frames into the rank's inbox, so a sender never
//! waits on the receiving rank's compute.
//!
//! A connection starts with a hello carrying the cluster token and the sender's rank; a peer
//! with the wrong token is refused and counted. A data frame is a fixed header (version, tag,
//! epoch, step, sender, length, crc32) and the payload; a frame failing any check closes that
//! connection and is counted, never delivered.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use super::transport::{Frame, Tag, TagKind, Transport, TransportError};
use crate::plan::RankId;

pub const DATA_VERSION: u8 = 1;
/// Largest payload of one data frame.
pub const DATA_FRAME_MAX_BYTES: u32 = 1 << 30;
const HEADER_BYTES: usize = 36;
const HELLO_MAGIC: &[u8; 4] = b"EZD1";
const TOKEN_MAX_BYTES: usize = 256;
/// How long dialing a peer may take before it counts as unreachable.
const DIAL_TIMEOUT: Duration = Duration::from_secs(5);

/// Counted rejections on this endpoint.
#[derive(Default, Debug)]
pub struct DataStats {
    /// Connections refused for a bad hello (wrong token, garbage).
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
}

impl TcpListenerHandle {
    pub fn bind(addr: &str, token: &str) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let (inbox_tx, inbox_rx) = mpsc::channel();
        let stats = Arc::new(DataStats::default());
        let token: Arc<str> = token.into();
        let (tx, st, tk) = (inbox_tx.clone(), Arc::clone(&stats), Arc::clone(&token));
        std::thread::Builder::new()
            .name("data-accept".into())
            .spawn(move || accept_loop(listener, tx, st, tk))?;
        Ok(Self {
            addr,
            inbox_tx,
            inbox_rx,
            stats,
            token,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn into_transport(self, rank: RankId, peers: BTreeMap<RankId, SocketAddr>) -> TcpTransport {
        TcpTransport {
            rank,
            peers: peers
                .into_iter()
                .map(|(r, a)| (r, (a, Mutex::new(None))))
                .collect(),
            inbox_tx: self.inbox_tx,
            inbox_rx: self.inbox_rx,
            stats: self.stats,
            token: self.token,
        }
    }
}

fn accept_loop(listener: TcpListener, tx: Sender<Frame>, stats: Arc<DataStats>, token: Arc<str>) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let (tx, stats, token) = (tx.clone(), Arc::clone(&stats), Arc::clone(&token));
        let spawned = std::thread::Builder::new()
            .name("data-read".into())
            .spawn(move || read_loop(stream, tx, stats, &token));
        if spawned.is_err() {
            tracing::warn!("data plane: cannot start a reader thread; connection dropped");
        }
    }
}

fn read_loop(mut s: TcpStream, tx: Sender<Frame>, stats: Arc<DataStats>, token: &str) {
    let from = match read_hello(&mut s, token) {
        Ok(from) => from,
        Err(why) => {
            stats.refused_peers.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(peer = ?s.peer_addr().ok(), "data plane: refused a connection: {why}");
            return;
        }
    };
    loop {
        match read_frame(&mut s) {
            Ok(Some(frame)) if frame.from == from => {
                if tx.send(frame).is_err() {
                    return;
                }
            }
            Ok(Some(frame)) => {
                stats.rejected_frames.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    "data plane: rank {from} sent a frame claiming rank {}",
                    frame.from
                );
                return;
            }
            Ok(None) => return,
            Err(why) => {
                stats.rejected_frames.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("data plane: rejected a frame from rank {from}: {why}");
                return;
            }
        }
    }
}

fn read_hello(s: &mut TcpStream, token: &str) -> Result<RankId, String> {
    s.set_read_timeout(Some(DIAL_TIMEOUT))
        .map_err(|e| e.to_string())?;
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
    s.set_read_timeout(None).map_err(|e| e.to_string())?;
    Ok(from)
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
    h[32..36].copy_from_slice(&crc32fast::hash(&frame.payload).to_le_bytes());
    Ok(h)
}

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
    if crc32fast::hash(&payload) != u32_at(32) {
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
        },
        payload: Bytes::from(payload),
    }))
}

/// One rank's endpoint on the TCP data plane.
pub struct TcpTransport {
    rank: RankId,
    peers: BTreeMap<RankId, (SocketAddr, Mutex<Option<TcpStream>>)>,
    inbox_tx: Sender<Frame>,
    inbox_rx: Receiver<Frame>,
    stats: Arc<DataStats>,
    token: Arc<str>,
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
    pub fn interrupter(&self) -> Interrupter {
        Interrupter {
            tx: self.inbox_tx.clone(),
        }
    }

    pub fn stats(&self) -> Arc<DataStats> {
        Arc::clone(&self.stats)
    }

    fn write(
        &self,
        conn: &mut Option<TcpStream>,
        addr: SocketAddr,
        frame: &Frame,
    ) -> std::io::Result<()> {
        if conn.is_none() {
            let mut s = TcpStream::connect_timeout(&addr, DIAL_TIMEOUT)?;
            s.set_nodelay(true)?;
            s.write_all(&hello(&self.token, self.rank))?;
            *conn = Some(s);
        }
        // Invariant: set just above when it was empty.
        let s = conn.as_mut().expect("connected");
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
        let (addr, conn) = self.peers.get(&to).ok_or(TransportError::UnknownPeer(to))?;
        let mut conn = conn.lock().unwrap_or_else(|e| e.into_inner());
        self.write(&mut conn, *addr, &frame).map_err(|e| {
            tracing::debug!("data plane: send to rank {to} failed: {e}");
            // Drop the broken connection; a later send redials.
            *conn = None;
            TransportError::UnknownPeer(to)
        })
    }

    fn recv_timeout(&mut self, timeout_ms: u64) -> Result<Frame, TransportError> {
        match self
            .inbox_rx
            .recv_timeout(Duration::from_millis(timeout_ms))
        {
            Ok(f) => Ok(f),
            Err(RecvTimeoutError::Timeout) => Err(TransportError::Timeout(timeout_ms)),
            Err(RecvTimeoutError::Disconnected) => Err(TransportError::Closed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(from: RankId, unit: u32, payload: &'static [u8]) -> Frame {
        Frame {
            epoch: 1,
            step: 2,
            from,
            tag: Tag {
                kind: TagKind::Gather,
                attempt: 0,
                unit,
                pass: 1,
            },
            payload: Bytes::from_static(payload),
        }
    }

    #[test]
    fn frames_cross_between_two_endpoints() {
        let (a, b) = (
            TcpListenerHandle::bind("127.0.0.1:0", "t").unwrap(),
            TcpListenerHandle::bind("127.0.0.1:0", "t").unwrap(),
        );
        let peers: BTreeMap<_, _> = [(0, a.local_addr()), (1, b.local_addr())].into();
        let a = a.into_transport(0, peers.clone());
        let mut b = b.into_transport(1, peers);
        a.send(1, frame(0, 5, b"hello")).unwrap();
        let got = b.recv_timeout(5_000).unwrap();
        assert_eq!(
            (got.from, got.tag.unit, &got.payload[..]),
            (0, 5, &b"hello"[..])
        );
        b.interrupter().interrupt(1, 2);
        assert_eq!(b.recv_timeout(5_000).unwrap().tag.kind, TagKind::Interrupt);
        assert!(matches!(
            b.recv_timeout(10),
            Err(TransportError::Timeout(10))
        ));
    }

    #[test]
    fn a_peer_with_the_wrong_token_is_refused_and_counted() {
        let b = TcpListenerHandle::bind("127.0.0.1:0", "right").unwrap();
        let wrong = TcpListenerHandle::bind("127.0.0.1:0", "wrong").unwrap();
        let peers: BTreeMap<_, _> = [(0, wrong.local_addr()), (1, b.local_addr())].into();
        let wrong = wrong.into_transport(0, peers.clone());
        let mut b = b.into_transport(1, peers);
        // The write may succeed (the kernel buffers it) but nothing is delivered.
        let _ = wrong.send(1, frame(0, 1, b"x"));
        assert!(matches!(
            b.recv_timeout(300),
            Err(TransportError::Timeout(_))
        ));
        assert_eq!(b.stats().refused_peers.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn corrupt_frames_are_rejected_never_delivered() {
        let f = frame(3, 9, b"payload");
        let mut wire = encode_header(&f).unwrap().to_vec();
        wire.extend_from_slice(&f.payload);
        assert_eq!(read_frame(&mut &wire[..]).unwrap().unwrap().tag.unit, 9);
        for (at, what) in [(0, "version"), (1, "tag kind"), (40, "checksum")] {
            let mut bad = wire.clone();
            bad[at] ^= 0x7f;
            let err = read_frame(&mut &bad[..]).unwrap_err();
            assert!(err.contains(what), "{err}");
        }
        let mut huge = wire.clone();
        huge[28..32].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(read_frame(&mut &huge[..]).unwrap_err().contains("exceeds"));
        // A payload cut short is an error; a clean end between frames is not.
        assert!(read_frame(&mut &wire[..40]).is_err());
        assert!(read_frame(&mut &wire[..0]).unwrap().is_none());
    }
}
