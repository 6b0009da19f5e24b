//! The in-process transport: ranks in one process exchange frames over channels. Payloads are
//! reference-counted `Bytes`, so an all-gather hands the same buffer to every peer without a copy.

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::transport::{Frame, Tag, TagKind, Transport, TransportError};
use crate::model::rng::{mix, SplitMix64};
use crate::plan::RankId;

/// Seeded network misbehaviour for chaos runs: each endpoint duplicates and reorders its
/// outgoing frames from its own RNG stream (seed, rank), so a seed replays exactly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetFaults {
    pub seed: u64,
    /// Chance per frame, in thousandths, that it is delivered twice.
    pub duplicate_per_mille: u32,
    /// Chance per frame, in thousandths, that it is held back and delivered after the next one.
    pub reorder_per_mille: u32,
}

/// The switchboard every local endpoint sends through.
#[derive(Default)]
pub struct LocalNetwork {
    inboxes: Mutex<HashMap<RankId, Sender<Frame>>>,
    faults: Option<NetFaults>,
}

impl LocalNetwork {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// A network whose endpoints duplicate and reorder frames as `faults` says.
    pub fn with_faults(faults: NetFaults) -> Arc<Self> {
        Arc::new(Self {
            faults: Some(faults),
            ..Self::default()
        })
    }

    /// Creates the endpoint of `rank` (replacing any previous one).
    pub fn endpoint(self: &Arc<Self>, rank: RankId) -> LocalEndpoint {
        let (tx, rx) = mpsc::channel();
        self.lock().insert(rank, tx);
        let chaos = self.faults.map(|f| {
            Mutex::new(Chaos {
                faults: f,
                rng: SplitMix64::new(mix(f.seed, rank as u64)),
                held: Vec::new(),
            })
        });
        LocalEndpoint {
            rank,
            net: Arc::clone(self),
            rx,
            chaos,
        }
    }

    /// Disconnects `rank`: its pending receive fails with `Closed`, sends to it fail.
    pub fn kill(&self, rank: RankId) {
        self.lock().remove(&rank);
    }

    /// Wakes `rank` from any receive in (epoch, step) with `CommError::Interrupted`: that step is
    /// abandoned. Later steps and epochs ignore it as stale.
    pub fn interrupt(&self, rank: RankId, epoch: u64, step: u64) {
        if let Some(tx) = self.lock().get(&rank) {
            let tag = Tag {
                kind: TagKind::Interrupt,
                attempt: 0,
                unit: 0,
                pass: 0,
            };
            let _ = tx.send(Frame {
                epoch,
                step,
                from: RankId::MAX,
                tag,
                payload: bytes::Bytes::new(),
            });
        }
    }

    /// Disconnects everyone (used when a run aborts, so that no rank stays blocked).
    pub fn close(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RankId, Sender<Frame>>> {
        // A poisoned lock only means another thread panicked while inserting or removing a
        // sender; the map itself is always consistent.
        self.inboxes.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One rank's end of the local network.
pub struct LocalEndpoint {
    rank: RankId,
    net: Arc<LocalNetwork>,
    rx: Receiver<Frame>,
    chaos: Option<Mutex<Chaos>>,
}

struct Chaos {
    faults: NetFaults,
    rng: SplitMix64,
    held: Vec<(RankId, Frame)>,
}

impl LocalEndpoint {
    fn deliver(&self, to: RankId, frame: Frame) -> Result<(), TransportError> {
        let tx = self
            .net
            .lock()
            .get(&to)
            .cloned()
            .ok_or(TransportError::UnknownPeer(to))?;
        tx.send(frame).map_err(|_| TransportError::UnknownPeer(to))
    }

    fn release_held(&self, chaos: &mut Chaos) {
        for (to, f) in chaos.held.drain(..) {
            // The peer may have gone meanwhile; a lost frame to a dead rank is no error here.
            let _ = self.deliver(to, f);
        }
    }
}

impl Transport for LocalEndpoint {
    fn rank(&self) -> RankId {
        self.rank
    }

    fn send(&self, to: RankId, frame: Frame) -> Result<(), TransportError> {
        let Some(chaos) = &self.chaos else {
            return self.deliver(to, frame);
        };
        let mut c = chaos.lock().unwrap_or_else(|e| e.into_inner());
        let (dup, hold) = (c.rng.next_u64() % 1000, c.rng.next_u64() % 1000);
        if hold < c.faults.reorder_per_mille as u64 && c.held.is_empty() {
            c.held.push((to, frame));
            return Ok(());
        }
        let res = self.deliver(to, frame.clone());
        if res.is_ok() && dup < c.faults.duplicate_per_mille as u64 {
            let _ = self.deliver(to, frame);
        }
        self.release_held(&mut c);
        res
    }

    fn flush(&self) {
        if let Some(chaos) = &self.chaos {
            let mut c = chaos.lock().unwrap_or_else(|e| e.into_inner());
            self.release_held(&mut c);
        }
    }

    fn recv_timeout(&mut self, timeout_ms: u64) -> Result<Frame, TransportError> {
        self.flush();
        if !self.net.lock().contains_key(&self.rank) {
            return Err(TransportError::Closed);
        }
        match self.rx.recv_timeout(Duration::from_millis(timeout_ms)) {
            Ok(f) => Ok(f),
            Err(RecvTimeoutError::Timeout) => {
                if self.net.lock().contains_key(&self.rank) {
                    Err(TransportError::Timeout(timeout_ms))
                } else {
                    Err(TransportError::Closed)
                }
            }
            Err(RecvTimeoutError::Disconnected) => Err(TransportError::Closed),
        }
    }
}
