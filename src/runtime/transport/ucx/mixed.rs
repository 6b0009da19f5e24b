//! Mixed planes: UCX shared memory to the peers on this rank's host, TLS TCP to the others.
//! Which peer goes which way is decided outside (the coordinator, per pair); this transport
//! only routes. Every frame lands in the TCP plane's inbox, so one receive waits on both. It
//! offers the `SharedMemory` capability, which serves only the peers routed over UCX: the
//! others get no staged sends, loans or pulls.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use super::engine::Engine;
use super::transport::UcxPlane;
use super::UcxError;
use crate::plan::RankId;
use crate::runtime::transport::tcp::TcpTransport;
use crate::runtime::transport::{
    AddFn, Frame, PeerMemory, SharedMemory, Tag, Transport, TransportError,
};
use crate::wire::WireStats;

/// TCP to every peer not reached over UCX.
pub struct MixedTransport {
    tcp: TcpTransport,
    routes: UcxRoutes,
}

/// The peers reached over UCX. Shared, so that a rank joining a running job can be added while
/// the rank actor owns the transport.
#[derive(Clone)]
pub struct UcxRoutes {
    ucx: Arc<UcxPlane>,
    peers: Arc<Mutex<BTreeSet<RankId>>>,
}

impl UcxRoutes {
    /// Reaches `peer` over UCX at its worker `address` from now on.
    pub fn add(&self, peer: RankId, address: Vec<u8>) -> Result<(), UcxError> {
        self.ucx.connect(peer, address)?;
        self.lock().insert(peer);
        Ok(())
    }

    /// Whether `peer` is reached over UCX.
    pub fn contains(&self, peer: RankId) -> bool {
        self.lock().contains(&peer)
    }

    /// Which peers go over UCX and what arrived that way, for a worker's last line.
    pub fn describe(&self) -> String {
        let peers: Vec<String> = self.lock().iter().map(|r| r.to_string()).collect();
        let got = self.ucx.received();
        format!(
            "ucx to ranks [{}] ({} frames, {:.1} MiB received, {} payloads from peers' staging slots), tls tcp to the others",
            peers.join(", "),
            got.frames.load(std::sync::atomic::Ordering::Relaxed),
            got.bytes.load(std::sync::atomic::Ordering::Relaxed) as f64 / (1 << 20) as f64,
            self.ucx.engine_counts().staged,
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<RankId>> {
        self.peers.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl MixedTransport {
    /// `tcp`'s rank, with UCX over `engine` beside it (no peer routed over UCX yet).
    pub fn new(
        tcp: TcpTransport,
        engine: Arc<Engine>,
        max_frame_bytes: u32,
    ) -> Result<Self, UcxError> {
        let ucx = Arc::new(UcxPlane::start(
            tcp.rank(),
            engine,
            max_frame_bytes,
            tcp.inbox_sender(),
        )?);
        let routes = UcxRoutes {
            ucx,
            peers: Arc::default(),
        };
        Ok(Self { tcp, routes })
    }

    pub fn routes(&self) -> UcxRoutes {
        self.routes.clone()
    }

    /// What frames arriving over UCX were refused for.
    pub fn ucx_stats(&self) -> &Arc<WireStats> {
        self.routes.ucx.stats()
    }

    /// Sends `frame` to each of `to` in the given order, as the trait asks: runs of UCX peers
    /// share one encoding (with the payload's checksum where the sender has it).
    fn send_summed(
        &self,
        to: &[RankId],
        frame: Frame,
        payload_crc: Option<u32>,
    ) -> Result<(), TransportError> {
        let mut run: Vec<RankId> = Vec::new();
        for &r in to {
            if self.routes.contains(r) {
                run.push(r);
                continue;
            }
            if !run.is_empty() {
                let run = std::mem::take(&mut run);
                self.routes
                    .ucx
                    .send_to_each(&run, frame.clone(), payload_crc)?;
            }
            self.tcp.send(r, frame.clone())?;
        }
        if run.is_empty() {
            Ok(())
        } else {
            self.routes.ucx.send_to_each(&run, frame, payload_crc)
        }
    }
}

impl Transport for MixedTransport {
    fn rank(&self) -> RankId {
        self.tcp.rank()
    }

    fn send(&self, to: RankId, frame: Frame) -> Result<(), TransportError> {
        if self.routes.contains(to) {
            self.routes.ucx.send_to_each(&[to], frame, None)
        } else {
            self.tcp.send(to, frame)
        }
    }

    fn send_to_each(&self, to: &[RankId], frame: Frame) -> Result<(), TransportError> {
        self.send_summed(to, frame, None)
    }

    fn recv_timeout(&mut self, timeout_ms: u64) -> Result<Frame, TransportError> {
        self.routes.ucx.before_wait();
        let f = self.tcp.recv_timeout(timeout_ms)?;
        self.routes.ucx.taken(&f);
        Ok(f)
    }

    fn flush(&self) {
        self.tcp.flush()
    }

    fn shared_memory(&self) -> Option<&dyn SharedMemory> {
        Some(self)
    }
}

/// Shared memory with the peers routed over UCX; the peers over TCP get none of it.
impl SharedMemory for MixedTransport {
    fn send_to_each_summed(
        &self,
        to: &[RankId],
        frame: Frame,
        payload_crc: u32,
    ) -> Result<(), TransportError> {
        self.send_summed(to, frame, Some(payload_crc))
    }

    fn send_to_each_staged(
        &self,
        to: &[RankId],
        frame: &Frame,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> u32,
    ) -> Result<bool, TransportError> {
        let me = self.tcp.rank();
        if to.iter().any(|&r| r == me || !self.routes.contains(r)) {
            return Ok(false);
        }
        self.routes.ucx.send_written(to, frame, len, fill)
    }

    unsafe fn lend(
        &self,
        from: RankId,
        at_step: (u64, u64),
        tag: Tag,
        memory: (*mut u8, usize),
        add: Option<AddFn>,
    ) -> bool {
        // SAFETY: the trait's contract (`shared_memory`'s loans) is the plane's. Peers over
        // TCP get no loans.
        self.routes.contains(from)
            && unsafe { self.routes.ucx.lend(from, at_step, tag, memory, add) }
    }

    fn end_loans(&self) {
        self.routes.ucx.end_loans()
    }

    fn fetch_unlent(&self) {
        self.routes.ucx.fetch_unlent()
    }

    fn was_placed(&self, frame: &Frame) -> bool {
        self.routes.ucx.was_placed(frame)
    }

    fn can_pull(&self, from: RankId) -> bool {
        self.routes.contains(from) && self.routes.ucx.can_pull(from)
    }

    fn peer_memory(&self, from: RankId) -> Result<Arc<dyn PeerMemory>, TransportError> {
        if !self.routes.contains(from) {
            return Err(TransportError::Pull {
                from,
                what: "it is reached over TCP, not shared memory".into(),
            });
        }
        self.routes.ucx.peer_memory(from)
    }
}

#[cfg(test)]
mod tests {
    use super::super::engine::EngineConfig;
    use super::super::require_for_tests as require;
    use super::*;
    use crate::net::tls::ClusterTls;
    use crate::net::ClusterCa;
    use crate::runtime::transport::tcp::TcpListenerHandle;
    use crate::runtime::transport::test_frame;

    fn frame(from: RankId, unit: u32, payload: Vec<u8>) -> Frame {
        test_frame(1, from, unit, payload)
    }

    /// Ranks 0 and 1 share a host (UCX both ways); rank 2 reaches both over TCP only.
    #[ignore = "needs libucx0 (apt-get install libucx0)"]
    #[test]
    fn peers_on_the_host_go_over_ucx_the_others_over_tcp_into_one_inbox() {
        require();
        let ca = ClusterCa::generate("t").unwrap();
        let listeners: Vec<TcpListenerHandle> = (0..3)
            .map(|r| {
                let tls = ClusterTls::new(&ca.issue(&format!("rank-{r}")).unwrap()).unwrap();
                TcpListenerHandle::bind("127.0.0.1:0", "t", &tls).unwrap()
            })
            .collect();
        let addrs: std::collections::BTreeMap<RankId, _> = listeners
            .iter()
            .enumerate()
            .map(|(r, l)| (r as RankId, l.local_addr()))
            .collect();
        let mut t: Vec<MixedTransport> = listeners
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                let engine =
                    Arc::new(Engine::start(EngineConfig::shared_memory(r as u32)).unwrap());
                MixedTransport::new(
                    l.into_transport(r as RankId, addrs.clone()),
                    engine,
                    64 << 20,
                )
                .unwrap()
            })
            .collect();
        let (a0, a1) = (
            t[0].routes.ucx.engine_address().to_vec(),
            t[1].routes.ucx.engine_address().to_vec(),
        );
        t[0].routes().add(1, a1).unwrap();
        t[1].routes().add(0, a0).unwrap();
        assert!(t[0].routes().contains(1) && !t[0].routes().contains(2));
        let big: Vec<u8> = (0..(5 << 20)).map(|i| (i % 249) as u8).collect();
        // 0 → {1 (ucx), 2 (tcp), 0 (itself)}, and 2 → 1 over TCP.
        t[0].send_to_each(&[1, 2, 0], frame(0, 4, big.clone()))
            .unwrap();
        t[2].send(1, frame(2, 5, b"tcp".to_vec())).unwrap();
        let mut at1: Vec<Frame> = (0..2).map(|_| t[1].recv_timeout(10_000).unwrap()).collect();
        at1.sort_by_key(|f| f.from);
        assert_eq!((at1[0].tag.unit, &at1[0].payload[..]), (4, &big[..]));
        assert_eq!((at1[1].tag.unit, &at1[1].payload[..]), (5, &b"tcp"[..]));
        for r in [0, 2] {
            let f = t[r].recv_timeout(10_000).unwrap();
            assert_eq!((f.from, &f.payload[..]), (0, &big[..]), "rank {r}");
        }
        assert_eq!(t[1].ucx_stats().snapshot().total(), 0);
        // What came over UCX gave its receive credit back; TCP's frames took none.
        for (r, t) in t.iter().enumerate() {
            assert_eq!(t.routes.ucx.held_bytes(), 0, "rank {r}");
        }
        assert!(matches!(
            t[1].recv_timeout(20),
            Err(TransportError::Timeout(20))
        ));
    }
}
