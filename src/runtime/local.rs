//! The in-process transport: ranks in one process exchange frames over channels. Payloads are
//! reference-counted `Bytes`, so an all-gather hands the same buffer to every peer without a copy.

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::transport::{Frame, Tag, TagKind, Transport, TransportError};
use crate::plan::RankId;

/// The switchboard every local endpoint sends through.
#[derive(Default)]
pub struct LocalNetwork {
    inboxes: Mutex<HashMap<RankId, Sender<Frame>>>,
}

impl LocalNetwork {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Creates the endpoint of `rank` (replacing any previous one).
    pub fn endpoint(self: &Arc<Self>, rank: RankId) -> LocalEndpoint {
        let (tx, rx) = mpsc::channel();
        self.lock().insert(rank, tx);
        LocalEndpoint {
            rank,
            net: Arc::clone(self),
            rx,
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
}

impl Transport for LocalEndpoint {
    fn rank(&self) -> RankId {
        self.rank
    }

    fn send(&self, to: RankId, frame: Frame) -> Result<(), TransportError> {
        let tx = self
            .net
            .lock()
            .get(&to)
            .cloned()
            .ok_or(TransportError::UnknownPeer(to))?;
        tx.send(frame).map_err(|_| TransportError::UnknownPeer(to))
    }

    fn recv_timeout(&mut self, timeout_ms: u64) -> Result<Frame, TransportError> {
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
