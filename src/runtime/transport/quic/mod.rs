//! `Transport` over QUIC (quinn) with mutual TLS against the cluster CA.
//!
//! quinn is async; `Transport` is synchronous and called from rank threads. The transport owns
//! a small tokio runtime that runs the endpoint, and the two sides meet at bounded queues:
//! `send` hands the frame to the peer's writer task and returns at once (it never waits for
//! the receiver), `recv_timeout` waits on the inbox that reader tasks fill only as far as their
//! credit allows (`QuicConfig::recv_buffer_bytes`), so a slow consumer pushes back on senders
//! through QUIC flow control instead of growing memory.
//!
//! Lanes: frames of the small agreement collectives (`Agree`, `Barrier`, `Interrupt`) and all
//! control messages travel on each connection's control stream; everything else on its bulk
//! stream. Streams are independently flow-controlled and the control stream has the higher
//! send priority, so a multi-megabyte shard transfer never sits in front of a heartbeat.
//!
//! Design: docs/transports.md (QUIC).

mod config;
mod inbox;
mod io;
mod socket;
mod stats;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use quinn::{congestion, IdleTimeout, MtuDiscoveryConfig, VarInt};

use self::inbox::{Inbox, PopError};
pub use self::io::ControlEvent;
use self::io::{accept_loop, dial, Counters, Shared, CLOSE_BYE};
use self::socket::CappedSocket;
use crate::net::secrets::Identity;
use crate::net::socket::bind_udp;
use crate::net::tls;
use crate::plan::RankId;
use crate::runtime::transport::{Frame, Tag, TagKind, Transport, TransportError};
use crate::wire::{Lane, WireMsg, WireStats, CHECKSUM_BYTES, PREFIX_BYTES};

pub use self::config::{Congestion, QuicConfig, QuicConfigError};
pub use self::stats::{QuicPathStats, QuicStats, UdpTotals};

#[derive(Debug, thiserror::Error)]
pub enum QuicError {
    #[error(transparent)]
    Config(#[from] QuicConfigError),
    #[error("cannot bind {addr}: {what}")]
    Bind { addr: SocketAddr, what: String },
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error("cannot start the transport's runtime: {0}")]
    Runtime(String),
    #[error("not connected within {timeout_ms} ms to ranks {missing:?}")]
    NotConnected {
        missing: Vec<RankId>,
        timeout_ms: u64,
    },
    #[error("peer {rank} is lost: {reason}")]
    PeerLost { rank: RankId, reason: String },
}

/// One rank's QUIC endpoint. Owns the runtime; dropping it closes everything.
pub struct QuicTransport {
    shared: Arc<Shared>,
    runtime: Option<tokio::runtime::Runtime>,
    local_addr: SocketAddr,
    linger_ms: u64,
}

/// A cloneable handle for the process layer (heartbeats, membership, interrupts), usable from
/// threads other than the one that receives rank frames.
#[derive(Clone)]
pub struct QuicControl {
    shared: Arc<Shared>,
}

fn lane_of(tag: &Tag) -> Lane {
    match tag.kind {
        TagKind::Agree | TagKind::Barrier | TagKind::Interrupt => Lane::Control,
        _ => Lane::Bulk,
    }
}

impl QuicTransport {
    /// Binds `addr` (that address only) as `rank`, accepting peers certified by the cluster CA
    /// of `identity`.
    pub fn bind(
        rank: RankId,
        addr: SocketAddr,
        identity: &Identity,
        cfg: &QuicConfig,
    ) -> Result<Self, QuicError> {
        Self::bind_tls(rank, addr, &tls::ClusterTls::new(identity)?, cfg)
    }

    /// As `bind`, with the process's TLS configs already built.
    pub fn bind_tls(
        rank: RankId,
        addr: SocketAddr,
        tls: &tls::ClusterTls,
        cfg: &QuicConfig,
    ) -> Result<Self, QuicError> {
        cfg.validate()?;
        let bind_err = |what: String| QuicError::Bind { addr, what };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.io_threads)
            .thread_name(format!("ezero-quic-{rank}"))
            .enable_all()
            .build()
            .map_err(|e| QuicError::Runtime(e.to_string()))?;
        let socket =
            bind_udp(addr, cfg.socket_buffer_bytes).map_err(|e| bind_err(e.to_string()))?;
        let transport = Arc::new(transport_config(cfg)?);
        let mut server = quinn::ServerConfig::with_crypto(tls.quic_server()?);
        server.transport_config(Arc::clone(&transport));
        server.migration(false);
        let mut client = quinn::ClientConfig::new(tls.quic_client()?);
        client.transport_config(transport);
        let mut ep_cfg = quinn::EndpointConfig::default();
        ep_cfg
            .max_udp_payload_size(cfg.max_udp_payload_bytes)
            .map_err(|e| bind_err(e.to_string()))?;
        let endpoint = {
            let _guard = runtime.enter();
            let rt = Arc::new(quinn::TokioRuntime);
            let socket = quinn::Runtime::wrap_udp_socket(&*rt, socket)
                .map_err(|e| bind_err(e.to_string()))?;
            let socket = Arc::new(CappedSocket::new(socket, cfg.max_udp_payload_bytes));
            quinn::Endpoint::new_with_abstract_socket(ep_cfg, Some(server), socket, rt)
                .map_err(|e| bind_err(e.to_string()))?
        };
        let mut endpoint = endpoint;
        endpoint.set_default_client_config(client);
        let local_addr = endpoint.local_addr().map_err(|e| bind_err(e.to_string()))?;
        let control_pool = (cfg.recv_buffer_bytes / 16).max(1 << 20) as usize;
        let shared = Arc::new(Shared {
            rank,
            max_frame_bytes: cfg.max_frame_bytes,
            connect_timeout: Duration::from_millis(cfg.connect_timeout_ms),
            control_queue: cfg.control_queue,
            endpoint,
            handle: runtime.handle().clone(),
            data: Inbox::new([control_pool, cfg.recv_buffer_bytes as usize]),
            control: Inbox::new([1 << 20, 1 << 20]),
            peers: Mutex::new(Default::default()),
            counters: Counters::default(),
            wire: WireStats::default(),
            closing: Default::default(),
            retired: Default::default(),
        });
        runtime.spawn(accept_loop(Arc::clone(&shared)));
        Ok(Self {
            shared,
            runtime: Some(runtime),
            local_addr,
            linger_ms: cfg.linger_ms,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn control(&self) -> QuicControl {
        QuicControl {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Makes `peers` known. This rank dials those with a higher rank; lower ranks dial it.
    /// Returns at once; `wait_connected` waits for the connections.
    pub fn add_peers(&self, peers: &[(RankId, SocketAddr)]) {
        self.control().add_peers(peers)
    }

    /// Waits until every rank in `ranks` is connected, or one is lost, or the timeout passes.
    pub fn wait_connected(&self, ranks: &[RankId], timeout_ms: u64) -> Result<(), QuicError> {
        let deadline = Instant::now() + Duration::from_millis(timeout_ms);
        loop {
            let mut missing = Vec::new();
            for &r in ranks.iter().filter(|&&r| r != self.shared.rank) {
                match self.shared.peer(r) {
                    Some(p) => {
                        if let Some(reason) =
                            p.lost.lock().unwrap_or_else(|e| e.into_inner()).clone()
                        {
                            return Err(QuicError::PeerLost { rank: r, reason });
                        }
                        if !p.ready.load(Ordering::Acquire) {
                            missing.push(r);
                        }
                    }
                    None => missing.push(r),
                }
            }
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(QuicError::NotConnected {
                    missing,
                    timeout_ms,
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn stats(&self) -> QuicStats {
        self.control().stats()
    }

    /// Sends what is queued, waits (at most `timeout_ms`) until peers have it, and closes.
    /// Dropping the transport does the same with `QuicConfig::linger_ms`.
    pub fn shutdown(mut self, timeout_ms: u64) {
        self.linger_ms = timeout_ms;
    }

    fn close_gracefully(&mut self) {
        let deadline = Instant::now() + Duration::from_millis(self.linger_ms);
        let s = &self.shared;
        // Totals for the operator (process mode has no other place that sees them): what the
        // rank handed to the transport and what quinn put on the wire for it.
        let st = self.stats();
        tracing::info!(
            rank = s.rank,
            frames_sent = st.frames_sent,
            frame_bytes_sent = st.bytes_sent,
            udp_bytes_sent = st.udp.bytes_sent,
            udp_bytes_received = st.udp.bytes_received,
            udp_datagrams_sent = st.udp.datagrams_sent,
            lost_packets = st.udp.lost_packets,
            "quic transport totals"
        );
        s.closing.store(true, Ordering::Relaxed);
        let writers: Vec<_> = {
            let peers = s.peers.lock().unwrap_or_else(|e| e.into_inner());
            peers
                .values()
                .flat_map(|p| {
                    // Dropping the senders lets each writer finish its stream after the queue.
                    p.lanes.lock().unwrap_or_else(|e| e.into_inner()).take();
                    std::mem::take(&mut *p.writers.lock().unwrap_or_else(|e| e.into_inner()))
                })
                .collect()
        };
        // Blocking on our runtime is not allowed inside another one (an actor dropping the
        // transport): there, close at once without lingering.
        let nested = tokio::runtime::Handle::try_current().is_ok();
        if nested {
            s.endpoint.close(VarInt::from_u32(CLOSE_BYE), b"bye");
        }
        if let Some(rt) = self.runtime.as_ref().filter(|_| !nested) {
            let left = deadline.saturating_duration_since(Instant::now());
            // Timers need the runtime's context: build them inside `block_on`.
            rt.block_on(async {
                let _ = tokio::time::timeout(left, async {
                    for w in writers {
                        let _ = w.await;
                    }
                })
                .await;
            });
            s.endpoint.close(VarInt::from_u32(CLOSE_BYE), b"bye");
            let left = deadline.saturating_duration_since(Instant::now());
            let ep = s.endpoint.clone();
            rt.block_on(async {
                let _ = tokio::time::timeout(left, ep.wait_idle()).await;
            });
        }
        s.data.close();
        s.control.close();
        if let Some(rt) = self.runtime.take() {
            // Waiting for the runtime's tasks is not allowed inside another runtime (the
            // transport is often dropped by an actor); there, let them finish in the background.
            if tokio::runtime::Handle::try_current().is_ok() {
                rt.shutdown_background();
            } else {
                rt.shutdown_timeout(Duration::from_millis(200));
            }
        }
    }
}

impl Drop for QuicTransport {
    /// Lingers (at most `linger_ms`) until peers have everything queued, then closes.
    fn drop(&mut self) {
        self.close_gracefully();
    }
}

fn transport_config(cfg: &QuicConfig) -> Result<quinn::TransportConfig, QuicConfigError> {
    let bad = |field, e: &dyn std::fmt::Display| QuicConfigError {
        field,
        what: e.to_string(),
    };
    let window =
        VarInt::from_u64(cfg.stream_window_bytes).map_err(|e| bad("stream_window_bytes", &e))?;
    let idle = IdleTimeout::try_from(Duration::from_millis(cfg.idle_timeout_ms))
        .map_err(|e| bad("idle_timeout_ms", &e))?;
    let mut t = quinn::TransportConfig::default();
    t.max_concurrent_bidi_streams(0u32.into())
        .max_concurrent_uni_streams(4u32.into())
        .stream_receive_window(window)
        .receive_window(VarInt::from_u64(2 * cfg.stream_window_bytes).unwrap_or(VarInt::MAX))
        .send_window(2 * cfg.stream_window_bytes)
        .initial_mtu(cfg.initial_mtu)
        .enable_segmentation_offload(cfg.gso)
        .max_idle_timeout(Some(idle))
        .keep_alive_interval(Some(Duration::from_millis(cfg.idle_timeout_ms / 3)));
    // quinn's default window (12000 bytes) is sized for 1200-byte packets: with a larger
    // initial MTU the first packet never fits and the handshake stalls. Use RFC 9002's
    // formula for the initial MTU instead.
    let iw = match cfg.initial_window_bytes {
        0 => rfc9002_initial_window(cfg.initial_mtu),
        n => n,
    };
    t.congestion_controller_factory(match cfg.congestion {
        Congestion::Cubic => {
            let mut c = congestion::CubicConfig::default();
            c.initial_window(iw);
            Arc::new(c) as Arc<dyn congestion::ControllerFactory + Send + Sync>
        }
        Congestion::NewReno => {
            let mut c = congestion::NewRenoConfig::default();
            c.initial_window(iw);
            Arc::new(c)
        }
        Congestion::Bbr => {
            let mut c = congestion::BbrConfig::default();
            c.initial_window(iw);
            Arc::new(c)
        }
    });
    let mut mtu = MtuDiscoveryConfig::default();
    mtu.upper_bound(cfg.max_udp_payload_bytes);
    t.mtu_discovery_config(Some(mtu));
    Ok(t)
}

/// RFC 9002 §7.2: min(10 × max_datagram_size, max(14720, 2 × max_datagram_size)).
fn rfc9002_initial_window(mtu: u16) -> u64 {
    let d = u64::from(mtu);
    (10 * d).min(14_720u64.max(2 * d))
}

impl QuicControl {
    pub fn rank(&self) -> RankId {
        self.shared.rank
    }

    pub fn add_peers(&self, peers: &[(RankId, SocketAddr)]) {
        let s = &self.shared;
        for &(rank, addr) in peers.iter().filter(|(r, _)| *r != s.rank) {
            let (peer, new) = s.peer_or_insert(rank);
            if new && s.rank < rank {
                s.handle.spawn(dial(Arc::clone(s), peer, addr));
            }
        }
    }

    /// Queues `msg` for `to`'s lane; never waits for the receiver.
    fn queue(
        &self,
        to: RankId,
        lane: Lane,
        msg: WireMsg,
        payload: usize,
    ) -> Result<(), TransportError> {
        self.check_size(to, payload)?;
        // Checksummed here, on the sending thread, not on the transport's I/O thread.
        self.queue_encoded(to, lane, crate::wire::encode(&msg), payload)
    }

    fn check_size(&self, to: RankId, payload: usize) -> Result<(), TransportError> {
        let s = &self.shared;
        if payload > s.max_frame_bytes as usize {
            tracing::error!(
                rank = s.rank,
                to,
                "frame of {payload} bytes exceeds max_frame_bytes {}",
                s.max_frame_bytes
            );
            return Err(TransportError::UnknownPeer(to));
        }
        Ok(())
    }

    /// Queues an encoded frame (its chunks are shared, not copied) for `to`'s lane.
    fn queue_encoded(
        &self,
        to: RankId,
        lane: Lane,
        chunks: [Bytes; 3],
        payload: usize,
    ) -> Result<(), TransportError> {
        let s = &self.shared;
        let peer = s.peer(to).ok_or(TransportError::UnknownPeer(to))?;
        if peer
            .lost
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
        {
            return Err(TransportError::UnknownPeer(to));
        }
        let lanes = peer.lanes.lock().unwrap_or_else(|e| e.into_inner());
        let tx = lanes.as_ref().ok_or(TransportError::Closed)?;
        let wire = (payload + PREFIX_BYTES + CHECKSUM_BYTES + 32) as u64;
        s.counters.queued_bytes.fetch_add(wire, Ordering::Relaxed);
        if tx[lane as usize].send((chunks, wire)).is_err() {
            s.counters.queued_bytes.fetch_sub(wire, Ordering::Relaxed);
            return Err(TransportError::UnknownPeer(to));
        }
        s.counters.frames_sent.fetch_add(1, Ordering::Relaxed);
        s.counters.bytes_sent.fetch_add(wire, Ordering::Relaxed);
        Ok(())
    }

    /// An opaque message to `to` on the control lane (heartbeats, membership).
    pub fn send_control(&self, to: RankId, payload: Bytes) -> Result<(), TransportError> {
        let n = payload.len();
        let msg = WireMsg::Control {
            from: self.shared.rank,
            payload,
        };
        self.queue(to, Lane::Control, msg, n)
    }

    /// The next control event, waiting at most `timeout_ms`.
    pub fn recv_control_timeout(&self, timeout_ms: u64) -> Result<ControlEvent, TransportError> {
        match self
            .shared
            .control
            .pop_timeout(Duration::from_millis(timeout_ms))
        {
            Ok(e) => Ok(e),
            Err(PopError::Timeout) => Err(TransportError::Timeout(timeout_ms)),
            Err(PopError::Closed) => Err(TransportError::Closed),
        }
    }

    /// Wakes this rank's receive in (epoch, step) with an interrupt (see `LocalNetwork`).
    pub fn interrupt(&self, epoch: u64, step: u64) {
        let tag = Tag {
            kind: TagKind::Interrupt,
            attempt: 0,
            unit: 0,
            pass: 0,
            piece: 0,
        };
        self.shared.data.push_now(
            0,
            0,
            Frame {
                epoch,
                step,
                from: RankId::MAX,
                tag,
                payload: Bytes::new(),
            },
        );
    }

    /// Closes the connection to `rank` (e.g. the coordinator declared it failed).
    pub fn disconnect(&self, rank: RankId, reason: &str) {
        if let Some(p) = self.shared.peer(rank) {
            if let Some(c) = p.conn.borrow().as_ref() {
                c.close(VarInt::from_u32(CLOSE_BYE), reason.as_bytes());
            }
            self.shared.mark_lost(&p, reason.to_string());
        }
    }

    /// Ranks currently connected.
    pub fn connected(&self) -> Vec<RankId> {
        let peers = self.shared.peers.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<RankId> = peers
            .values()
            .filter(|p| {
                p.ready.load(Ordering::Acquire)
                    && p.lost.lock().unwrap_or_else(|e| e.into_inner()).is_none()
            })
            .map(|p| p.rank)
            .collect();
        v.sort_unstable();
        v
    }

    pub fn stats(&self) -> QuicStats {
        let c = &self.shared.counters;
        let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        QuicStats {
            frames_sent: g(&c.frames_sent),
            bytes_sent: g(&c.bytes_sent),
            frames_received: g(&c.frames_received),
            bytes_received: g(&c.bytes_received),
            refused_handshakes: g(&c.refused_handshakes),
            protocol_violations: g(&c.protocol_violations),
            control_dropped: g(&c.control_dropped),
            rejected: self.shared.wire.snapshot(),
            udp: self.udp_totals(),
        }
    }

    fn open_connections(&self) -> Vec<(RankId, quinn::Connection)> {
        let peers = self.shared.peers.lock().unwrap_or_else(|e| e.into_inner());
        peers
            .values()
            .filter_map(|p| Some((p.rank, p.conn.borrow().clone()?)))
            .filter(|(_, c)| c.close_reason().is_none())
            .collect()
    }

    fn udp_totals(&self) -> UdpTotals {
        let mut t = *self
            .shared
            .retired
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for (_, c) in self.open_connections() {
            t.add(&UdpTotals::of(&c.stats()));
        }
        t
    }

    /// Each open connection's path, by peer rank.
    pub fn paths(&self) -> Vec<QuicPathStats> {
        let mut v: Vec<_> = self
            .open_connections()
            .into_iter()
            .map(|(peer, c)| {
                let s = c.stats();
                QuicPathStats {
                    peer,
                    rtt_us: s.path.rtt.as_micros() as u64,
                    min_rtt_us: s.path.min_rtt.as_micros() as u64,
                    cwnd_bytes: s.path.cwnd,
                    mtu_bytes: s.path.current_mtu,
                    udp: UdpTotals::of(&s),
                }
            })
            .collect();
        v.sort_by_key(|p| p.peer);
        v
    }
}

impl Transport for QuicTransport {
    fn rank(&self) -> RankId {
        self.shared.rank
    }

    fn send(&self, to: RankId, frame: Frame) -> Result<(), TransportError> {
        self.send_to_each(std::slice::from_ref(&to), frame)
    }

    fn send_to_each(&self, to: &[RankId], frame: Frame) -> Result<(), TransportError> {
        let (lane, n) = (lane_of(&frame.tag), frame.payload.len());
        let ctl = self.control();
        // Encoded and checksummed once, for the first peer, and shared by the rest: the header
        // names no receiver. A frame to this rank never touches the wire.
        let mut encoded: Option<[Bytes; 3]> = None;
        for &r in to {
            if r == self.shared.rank {
                self.shared.data.push_now(0, 0, frame.clone());
                continue;
            }
            let chunks = match &encoded {
                Some(c) => c.clone(),
                None => {
                    ctl.check_size(r, n)?;
                    encoded
                        .insert(crate::wire::encode(&WireMsg::Frame(frame.clone())))
                        .clone()
                }
            };
            ctl.queue_encoded(r, lane, chunks, n)?;
        }
        Ok(())
    }

    fn recv_timeout(&mut self, timeout_ms: u64) -> Result<Frame, TransportError> {
        match self
            .shared
            .data
            .pop_timeout(Duration::from_millis(timeout_ms))
        {
            Ok(f) => Ok(f),
            Err(PopError::Timeout) => Err(TransportError::Timeout(timeout_ms)),
            Err(PopError::Closed) => Err(TransportError::Closed),
        }
    }
}
