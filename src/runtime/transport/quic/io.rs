//! The async half of the QUIC transport: dialling, accepting, and one reader and two writers
//! per connection, all on the transport's own tokio runtime.
//!
//! One connection per peer pair: the lower rank dials the higher. Each side opens two
//! unidirectional streams towards the other, a control stream (higher send priority) and a bulk
//! stream, and starts each with a hello naming its rank and lane. A frame whose `from` differs
//! from the stream's hello, a second hello, or any wire rejection closes the connection: a
//! byte stream that lost its framing cannot be trusted further.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use quinn::{Connection, Endpoint, RecvStream, VarInt};
use tokio::sync::{mpsc, watch};

use super::inbox::Inbox;
use super::stats::UdpTotals;
use crate::net::secrets::PEER_SERVER_NAME;
use crate::plan::RankId;
use crate::runtime::transport::Frame;
use crate::wire::{Lane, StreamDecoder, WireError, WireMsg, WireStats};

/// What the process layer hears from the transport besides rank frames.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ControlEvent {
    /// An opaque control message (`QuicControl::send_control`) from a peer.
    Message { from: RankId, payload: Bytes },
    /// A connection to `rank` is up (either side dialled).
    Connected(RankId),
    /// The connection to `rank` is gone or could not be made; `reason` says why.
    Lost { rank: RankId, reason: String },
}

/// Chunks taken from a stream per read.
const READ_BATCH: usize = 32;

/// QUIC application error codes we close connections with.
pub(crate) const CLOSE_BYE: u32 = 0;
pub(crate) const CLOSE_BAD_FRAME: u32 = 1;
pub(crate) const CLOSE_PROTOCOL: u32 = 2;

#[derive(Default)]
pub(crate) struct Counters {
    pub frames_sent: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub frames_received: AtomicU64,
    pub bytes_received: AtomicU64,
    pub refused_handshakes: AtomicU64,
    pub protocol_violations: AtomicU64,
    pub control_dropped: AtomicU64,
    /// Bytes handed to `send` that no writer has passed to quinn yet.
    pub queued_bytes: AtomicU64,
}

/// A lane's queue: messages with the wire bytes they count against `queued_bytes`.
/// A frame already encoded (by the sending thread, which also pays for its checksum, so the
/// transport's I/O thread only copies and encrypts), with its queued-bytes charge.
pub(crate) type Encoded = ([Bytes; 3], u64);
pub(crate) type LaneTx = mpsc::UnboundedSender<Encoded>;

pub(crate) struct Peer {
    pub rank: RankId,
    pub conn: watch::Sender<Option<Connection>>,
    /// The peer has proven it accepted us: the acceptor saw our certificate at the handshake;
    /// the dialler waits for the acceptor's hello, because a TLS 1.3 client finishes its
    /// handshake before the server has checked the client's certificate.
    pub ready: AtomicBool,
    pub lanes: Mutex<Option<[LaneTx; 2]>>,
    pub lost: Mutex<Option<String>>,
    /// The peer said goodbye: its loss is expected.
    pub quiet: AtomicBool,
    pub writers: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

pub(crate) struct Shared {
    pub rank: RankId,
    pub max_frame_bytes: u32,
    pub connect_timeout: Duration,
    pub control_queue: usize,
    pub endpoint: Endpoint,
    pub handle: tokio::runtime::Handle,
    pub data: Inbox<Frame>,
    pub control: Inbox<ControlEvent>,
    pub peers: Mutex<HashMap<RankId, Arc<Peer>>>,
    pub counters: Counters,
    pub wire: WireStats,
    pub closing: AtomicBool,
    /// quinn's counters of connections that have closed.
    pub retired: Mutex<UdpTotals>,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl Shared {
    pub(crate) fn peer(&self, rank: RankId) -> Option<Arc<Peer>> {
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&rank)
            .cloned()
    }

    /// The peer entry for `rank`, created (with its two writers) if new.
    pub(crate) fn peer_or_insert(self: &Arc<Self>, rank: RankId) -> (Arc<Peer>, bool) {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = peers.get(&rank) {
            return (Arc::clone(p), false);
        }
        let (ctl_tx, ctl_rx) = mpsc::unbounded_channel();
        let (bulk_tx, bulk_rx) = mpsc::unbounded_channel();
        let peer = Arc::new(Peer {
            rank,
            conn: watch::Sender::new(None),
            ready: AtomicBool::new(false),
            lanes: Mutex::new(Some([ctl_tx, bulk_tx])),
            lost: Mutex::new(None),
            quiet: AtomicBool::new(false),
            writers: Mutex::new(Vec::new()),
        });
        let w = [(Lane::Control, ctl_rx), (Lane::Bulk, bulk_rx)].map(|(lane, rx)| {
            self.handle
                .spawn(writer(Arc::clone(self), Arc::clone(&peer), lane, rx))
        });
        *peer.writers.lock().unwrap_or_else(|e| e.into_inner()) = w.into();
        peers.insert(rank, Arc::clone(&peer));
        (peer, true)
    }

    /// Queues a control event for the process layer; when the queue is full the event is
    /// dropped and counted (the process layer is not reading; heartbeats are periodic).
    pub(crate) fn event(&self, e: ControlEvent) {
        if self.control.len() >= self.control_queue {
            add(&self.counters.control_dropped, 1);
            return;
        }
        self.control.push_now(0, 0, e);
    }

    /// Marks `peer` as leaving cleanly, so that its loss is not logged as a warning.
    pub(crate) fn closing_peer(&self, peer: &Peer) {
        peer.quiet.store(true, Ordering::Relaxed);
    }

    pub(crate) fn mark_lost(&self, peer: &Peer, reason: String) {
        let mut lost = peer.lost.lock().unwrap_or_else(|e| e.into_inner());
        if lost.is_none() {
            if !self.closing.load(Ordering::Relaxed) && !peer.quiet.load(Ordering::Relaxed) {
                tracing::warn!(rank = self.rank, peer = peer.rank, "peer lost: {reason}");
            }
            *lost = Some(reason.clone());
            self.event(ControlEvent::Lost {
                rank: peer.rank,
                reason,
            });
        }
    }
}

/// Writes one lane's queue to its stream once the connection exists.
async fn writer(
    shared: Arc<Shared>,
    peer: Arc<Peer>,
    lane: Lane,
    mut rx: mpsc::UnboundedReceiver<Encoded>,
) {
    let mut conn_rx = peer.conn.subscribe();
    let conn = match conn_rx.wait_for(Option::is_some).await {
        Ok(c) => c.clone(),
        Err(_) => None,
    };
    let Some(conn) = conn else {
        return drain(&shared, &mut rx).await;
    };
    let mut s = match conn.open_uni().await {
        Ok(s) => s,
        Err(e) => {
            shared.mark_lost(&peer, format!("cannot open a stream: {e}"));
            return drain(&shared, &mut rx).await;
        }
    };
    // Control outranks bulk when both have data queued in quinn.
    let _ = s.set_priority(if lane == Lane::Control { 1 } else { 0 });
    let hello = WireMsg::Hello {
        rank: shared.rank,
        lane,
    };
    let mut chunks = crate::wire::encode(&hello);
    if let Err(e) = s.write_all_chunks(&mut chunks).await {
        shared.mark_lost(&peer, format!("write failed: {e}"));
        return drain(&shared, &mut rx).await;
    }
    while let Some((mut chunks, n)) = rx.recv().await {
        let res = s.write_all_chunks(&mut chunks).await;
        shared.counters.queued_bytes.fetch_sub(n, Ordering::Relaxed);
        if let Err(e) = res {
            shared.mark_lost(&peer, format!("write failed: {e}"));
            return drain(&shared, &mut rx).await;
        }
    }
    // The sender side was closed (shutdown): finish the stream and wait until the peer has
    // everything, so that closing the connection afterwards loses nothing.
    if s.finish().is_ok() {
        let _ = s.stopped().await;
    }
}

/// Drops what a dead writer still holds, keeping the queued-bytes count right.
async fn drain(shared: &Shared, rx: &mut mpsc::UnboundedReceiver<Encoded>) {
    rx.close();
    while let Some((_, n)) = rx.recv().await {
        shared.counters.queued_bytes.fetch_sub(n, Ordering::Relaxed);
    }
}

/// Dials `peer` at `addr` until it answers or the connect timeout passes (it may not be
/// listening yet).
pub(crate) async fn dial(shared: Arc<Shared>, peer: Arc<Peer>, addr: SocketAddr) {
    let deadline = tokio::time::Instant::now() + shared.connect_timeout;
    let mut last = String::from("no attempt");
    while tokio::time::Instant::now() < deadline && !shared.closing.load(Ordering::Relaxed) {
        let connecting = match shared.endpoint.connect(addr, PEER_SERVER_NAME) {
            Ok(c) => c,
            Err(e) => {
                last = e.to_string();
                break;
            }
        };
        match tokio::time::timeout_at(deadline, connecting).await {
            Ok(Ok(conn)) => {
                // send_replace stores the value even before any writer has subscribed.
                peer.conn.send_replace(Some(conn.clone()));
                shared
                    .handle
                    .spawn(serve(Arc::clone(&shared), conn.clone(), Some(peer.rank)));
                watch_closed(shared, peer, conn).await;
                return;
            }
            Ok(Err(e)) => {
                last = e.to_string();
                // A certificate or protocol refusal will not change on retry.
                if matches!(
                    e,
                    quinn::ConnectionError::TransportError(_)
                        | quinn::ConnectionError::ConnectionClosed(_)
                        | quinn::ConnectionError::ApplicationClosed(_)
                ) {
                    tracing::warn!(rank = shared.rank, peer = peer.rank, %addr, "refused: {e}");
                    add(&shared.counters.refused_handshakes, 1);
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(_) => {
                last = format!("no answer within {} ms", shared.connect_timeout.as_millis());
                break;
            }
        }
    }
    shared.mark_lost(&peer, format!("cannot connect to {addr}: {last}"));
}

/// Waits for the connection to end and reports it, unless it was already replaced.
async fn watch_closed(shared: Arc<Shared>, peer: Arc<Peer>, conn: Connection) {
    let why = conn.closed().await;
    shared
        .retired
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .add(&UdpTotals::of(&conn.stats()));
    let current = peer.conn.borrow().as_ref().map(Connection::stable_id);
    if current == Some(conn.stable_id()) {
        // A peer that said goodbye is no failure worth a warning, but it is still gone.
        let bye = matches!(&why, quinn::ConnectionError::ApplicationClosed(c)
            if c.error_code == VarInt::from_u32(CLOSE_BYE));
        if bye {
            tracing::info!(
                rank = shared.rank,
                peer = peer.rank,
                "peer closed the connection"
            );
            shared.closing_peer(&peer);
        }
        shared.mark_lost(&peer, format!("connection closed: {why}"));
    }
}

/// Accepts connections until the endpoint closes. Handshakes that fail (a peer without a
/// certificate from the cluster CA, for one) are logged and counted.
pub(crate) async fn accept_loop(shared: Arc<Shared>) {
    while let Some(incoming) = shared.endpoint.accept().await {
        let shared = Arc::clone(&shared);
        let remote = incoming.remote_address();
        let h = shared.handle.clone();
        h.spawn(async move {
            let connecting = match incoming.accept() {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(rank = shared.rank, %remote, "refused a connection: {e}");
                    add(&shared.counters.refused_handshakes, 1);
                    return;
                }
            };
            match tokio::time::timeout(shared.connect_timeout, connecting).await {
                Ok(Ok(conn)) => serve(shared, conn, None).await,
                Ok(Err(e)) => {
                    tracing::warn!(rank = shared.rank, %remote, "refused a connection: {e}");
                    add(&shared.counters.refused_handshakes, 1);
                }
                Err(_) => {
                    tracing::warn!(rank = shared.rank, %remote, "handshake timed out");
                    add(&shared.counters.refused_handshakes, 1);
                }
            }
        });
    }
}

/// Reads every stream the peer opens on `conn`.
async fn serve(shared: Arc<Shared>, conn: Connection, dialled: Option<RankId>) {
    while let Ok(stream) = conn.accept_uni().await {
        shared.handle.spawn(read_stream(
            Arc::clone(&shared),
            conn.clone(),
            stream,
            dialled,
        ));
    }
}

fn violation(shared: &Shared, conn: &Connection, code: u32, what: String) {
    tracing::warn!(rank = shared.rank, remote = %conn.remote_address(), "closing: {what}");
    conn.close(VarInt::from_u32(code), what.as_bytes());
}

async fn read_stream(
    shared: Arc<Shared>,
    conn: Connection,
    mut stream: RecvStream,
    dialled: Option<RankId>,
) {
    let mut dec = StreamDecoder::new(shared.max_frame_bytes);
    let mut who: Option<(RankId, Lane)> = None;
    // Several chunks per read: each read takes the connection's lock and a wake-up, and a
    // chunk is one packet's worth (a few KiB) under bulk load.
    let mut bufs: [Bytes; READ_BATCH] = Default::default();
    loop {
        let n = match stream.read_chunks(&mut bufs).await {
            Ok(Some(n)) => n,
            Ok(None) => {
                if let Err(e) = dec.finish() {
                    reject(&shared, &conn, e);
                }
                return;
            }
            Err(_) => return, // the connection ended; its watcher reports it
        };
        for chunk in bufs.iter_mut().take(n) {
            let mut chunk = std::mem::take(chunk);
            add(&shared.counters.bytes_received, chunk.len() as u64);
            while !chunk.is_empty() {
                let msg = match dec.next(&mut chunk) {
                    Ok(Some(m)) => m,
                    Ok(None) => continue,
                    Err(e) => return reject(&shared, &conn, e),
                };
                match (msg, who) {
                    (WireMsg::Hello { rank, lane }, None) => {
                        if dialled.is_some_and(|d| d != rank) {
                            add(&shared.counters.protocol_violations, 1);
                            let what = format!("dialled rank {dialled:?} but it says it is {rank}");
                            return violation(&shared, &conn, CLOSE_PROTOCOL, what);
                        }
                        who = Some((rank, lane));
                        match dialled {
                            None => register(&shared, rank, &conn),
                            Some(_) => accepted_us(&shared, rank),
                        }
                    }
                    (WireMsg::Frame(f), Some((rank, lane))) if f.from == rank => {
                        add(&shared.counters.frames_received, 1);
                        if !shared.data.push(lane as usize, f.payload.len(), f).await {
                            return;
                        }
                    }
                    (WireMsg::Control { from, payload }, Some((rank, _))) if from == rank => {
                        shared.event(ControlEvent::Message { from, payload });
                    }
                    (m, w) => {
                        add(&shared.counters.protocol_violations, 1);
                        let what = match w {
                            None => "a stream must start with a hello".to_string(),
                            Some((r, _)) => format!("rank {r} sent {}", describe(&m)),
                        };
                        return violation(&shared, &conn, CLOSE_PROTOCOL, what);
                    }
                }
            }
        }
    }
}

fn describe(m: &WireMsg) -> String {
    match m {
        WireMsg::Hello { .. } => "a second hello".into(),
        WireMsg::Frame(f) => format!("a frame claiming to be from rank {}", f.from),
        WireMsg::Control { from, .. } => format!("a control message claiming rank {from}"),
    }
}

fn reject(shared: &Shared, conn: &Connection, e: WireError) {
    shared.wire.count(&e);
    violation(
        shared,
        conn,
        CLOSE_BAD_FRAME,
        format!("rejected frame: {e}"),
    );
}

/// An accepted connection said who it is: it becomes that rank's connection.
fn register(shared: &Arc<Shared>, rank: RankId, conn: &Connection) {
    let (peer, _) = shared.peer_or_insert(rank);
    let same = peer.conn.borrow().as_ref().map(Connection::stable_id) == Some(conn.stable_id());
    if same {
        return; // the second stream's hello
    }
    *peer.lost.lock().unwrap_or_else(|e| e.into_inner()) = None;
    // send_replace stores the value even before any writer has subscribed.
    peer.conn.send_replace(Some(conn.clone()));
    peer.ready.store(true, Ordering::Release);
    shared.event(ControlEvent::Connected(rank));
    shared
        .handle
        .spawn(watch_closed(Arc::clone(shared), peer, conn.clone()));
}

/// The rank we dialled said hello: it checked our certificate and registered us.
fn accepted_us(shared: &Shared, rank: RankId) {
    if let Some(peer) = shared.peer(rank) {
        if !peer.ready.swap(true, Ordering::AcqRel) {
            shared.event(ControlEvent::Connected(rank));
        }
    }
}
