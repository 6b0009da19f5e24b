//! `Transport` over a UCX [`Engine`]: each frame is one active message in our wire format
//! (version, lengths, epoch, step, tag, CRC-32), checked on arrival exactly as the TCP and QUIC
//! planes check theirs; a frame that fails a check is counted in [`WireStats`] and dropped,
//! and so is one whose `from` is not the engine that sent it.
//!
//! Worker addresses come from outside (the control plane, once it carries them; tests pass
//! them directly): this module never listens.

use std::collections::BTreeMap;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::engine::{Engine, Inbound};
use super::UcxError;
use crate::plan::RankId;
use crate::runtime::transport::{Frame, Transport, TransportError};
use crate::wire::{decode, encode_to_vec, WireMsg, WireStats};

/// A rank's endpoint on the UCX plane.
pub struct UcxTransport {
    rank: RankId,
    engine: Arc<Engine>,
    max_frame_bytes: u32,
    stats: Arc<WireStats>,
    /// Frames a rank sends itself skip UCX.
    loopback: (Sender<Frame>, Receiver<Frame>),
}

impl UcxTransport {
    /// A transport for `rank` over `engine` (whose id must be `rank`), connected to every peer
    /// in `peers` (rank → worker address).
    pub fn connect(
        rank: RankId,
        engine: Arc<Engine>,
        peers: &BTreeMap<RankId, Vec<u8>>,
        max_frame_bytes: u32,
    ) -> Result<Self, UcxError> {
        assert_eq!(engine.id(), rank, "the engine speaks for this rank");
        for (&peer, address) in peers.iter().filter(|(&p, _)| p != rank) {
            engine.connect(peer, address.clone())?;
        }
        Ok(Self {
            rank,
            engine,
            max_frame_bytes,
            stats: Arc::default(),
            loopback: mpsc::channel(),
        })
    }

    /// What arriving frames were refused for.
    pub fn stats(&self) -> &Arc<WireStats> {
        &self.stats
    }

    /// Checks one message from engine `from`: a whole frame of ours, from that rank.
    fn accept(&self, from: u32, bytes: &[u8]) -> Option<Frame> {
        match decode(bytes, self.max_frame_bytes) {
            Ok((WireMsg::Frame(f), used)) if used == bytes.len() && f.from == from => Some(f),
            Ok(_) => {
                // Trailing bytes, another message kind, or a frame claiming another sender.
                self.stats
                    .header
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                None
            }
            Err(e) => {
                self.stats.count(&e);
                None
            }
        }
    }
}

impl Transport for UcxTransport {
    fn rank(&self) -> RankId {
        self.rank
    }

    fn send(&self, to: RankId, frame: Frame) -> Result<(), TransportError> {
        if to == self.rank {
            return self
                .loopback
                .0
                .send(frame)
                .map_err(|_| TransportError::Closed);
        }
        let bytes = encode_to_vec(&WireMsg::Frame(frame));
        self.engine.send(to, bytes).map_err(|e| match e {
            UcxError::Stopped => TransportError::Closed,
            _ => TransportError::UnknownPeer(to),
        })
    }

    fn recv_timeout(&mut self, timeout_ms: u64) -> Result<Frame, TransportError> {
        let deadline = Instant::now() + Duration::from_millis(timeout_ms);
        loop {
            if let Ok(f) = self.loopback.1.try_recv() {
                return Ok(f);
            }
            // Short waits, so that a frame sent to ourselves is not held behind a long one.
            let left = deadline.saturating_duration_since(Instant::now());
            match self.engine.recv_timeout(left.min(Duration::from_millis(5))) {
                Ok(Inbound::Message { from, bytes }) => {
                    if let Some(f) = self.accept(from, &bytes) {
                        return Ok(f);
                    }
                }
                // The collective waiting on that peer fails at its deadline; the control plane's
                // heartbeats decide membership.
                Ok(Inbound::PeerLost { peer, why }) => {
                    tracing::warn!("ucx: the endpoint to rank {peer} failed: {why}");
                }
                Err(RecvTimeoutError::Disconnected) => return Err(TransportError::Closed),
                Err(RecvTimeoutError::Timeout) => {}
            }
            if Instant::now() >= deadline {
                return Err(TransportError::Timeout(timeout_ms));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::available_for_tests as available;
    use super::super::engine::EngineConfig;
    use super::*;
    use crate::runtime::transport::{Tag, TagKind};
    use bytes::Bytes;
    use std::sync::atomic::Ordering;

    fn frame(from: RankId, unit: u32, payload: Vec<u8>) -> Frame {
        Frame {
            epoch: 3,
            step: 7,
            from,
            tag: Tag {
                kind: TagKind::Gather,
                attempt: 0,
                unit,
                pass: 1,
            },
            payload: Bytes::from(payload),
        }
    }

    fn plane(n: u32) -> Vec<UcxTransport> {
        let engines: Vec<Arc<Engine>> = (0..n)
            .map(|r| Arc::new(Engine::start(EngineConfig::shared_memory(r)).unwrap()))
            .collect();
        let peers: BTreeMap<RankId, Vec<u8>> = engines
            .iter()
            .map(|e| (e.id(), e.address().to_vec()))
            .collect();
        engines
            .into_iter()
            .map(|e| UcxTransport::connect(e.id(), e, &peers, 64 << 20).unwrap())
            .collect()
    }

    #[test]
    fn frames_cross_between_three_ranks_and_to_self() {
        if !available() {
            return;
        }
        let mut t = plane(3);
        let big: Vec<u8> = (0..(8 << 20)).map(|i| (i % 251) as u8).collect();
        t[0].send(2, frame(0, 1, big.clone())).unwrap();
        t[1].send(2, frame(1, 2, b"small".to_vec())).unwrap();
        t[2].send(2, frame(2, 3, Vec::new())).unwrap();
        let mut got: Vec<Frame> = (0..3).map(|_| t[2].recv_timeout(10_000).unwrap()).collect();
        got.sort_by_key(|f| f.from);
        assert_eq!(got[0].payload, Bytes::from(big));
        assert_eq!((got[0].epoch, got[0].step, got[0].tag.unit), (3, 7, 1));
        assert_eq!(&got[1].payload[..], b"small");
        assert_eq!((got[2].from, got[2].tag.unit), (2, 3));
        assert!(matches!(
            t[2].recv_timeout(20),
            Err(TransportError::Timeout(20))
        ));
        assert!(matches!(
            t[0].send(9, frame(0, 0, Vec::new())),
            Err(TransportError::UnknownPeer(9))
        ));
        assert_eq!(t[2].stats().snapshot().total(), 0);
    }

    #[test]
    fn damaged_misattributed_and_oversize_frames_are_counted_and_dropped() {
        if !available() {
            return;
        }
        let mut t = plane(2);
        let good = encode_to_vec(&WireMsg::Frame(frame(0, 1, vec![5; 100])));
        // A flipped payload byte fails the CRC.
        let mut damaged = good.clone();
        damaged[60] ^= 1;
        // A well-formed frame that claims to come from rank 1, sent by rank 0.
        let forged = encode_to_vec(&WireMsg::Frame(frame(1, 1, vec![5; 100])));
        // A length over the receiver's limit, in an otherwise valid prefix.
        let mut oversize = good.clone();
        oversize[1..5].copy_from_slice(&(128u32 << 20).to_le_bytes());
        for bytes in [damaged, forged, oversize, good] {
            t[0].engine.send(1, bytes).unwrap();
        }
        let f = t[1].recv_timeout(10_000).unwrap();
        assert_eq!((f.from, f.payload.len()), (0, 100));
        let c = t[1].stats().snapshot();
        assert_eq!((c.checksum, c.header, c.oversize), (1, 1, 1), "{c:?}");
        assert_eq!(t[1].stats().oversize.load(Ordering::Relaxed), 1);
    }
}
