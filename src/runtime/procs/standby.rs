//! Standby workers: worker processes that connected (TLS and token checked as at startup) while
//! the job needs no new rank. The coordinator holds them, heartbeating both ways, until a join
//! takes one; a standby that disconnects or goes silent is dropped. Their number is bounded.
//!
//! A join request (`POST /join`) is accepted only when enough standbys are connected that no
//! earlier accepted request counts on: `Promises` keeps that count.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::control_plane::{read_msg, ToCoord, ToWorker, WireError, CONTROL_FRAME_MAX_BYTES};
use super::heartbeat::{Liveness, ProcsConfig};
use super::link::{write_loop, ControlReader, ControlWriter, LINK_QUEUE_MAX};
use super::proxy::lock;
use crate::runtime::api::control::Standbys;
use crate::runtime::clock::Clock;

/// Most standby workers held at once; more are refused with a reason.
pub const MAX_STANDBYS: usize = 64;

/// Messages from a worker's connection, read by a task of their own (reading a frame is not
/// cancellation-safe, so nothing waits on it in a `select!`).
pub type Inbox = mpsc::Receiver<Result<ToCoord, WireError>>;

/// A connected worker with no rank yet.
pub struct Standby {
    pub peer: SocketAddr,
    pub link: mpsc::Sender<Option<ToWorker>>,
    pub writer: JoinHandle<()>,
    pub inbox: Inbox,
    live: Liveness,
}

impl Standby {
    /// Drains what arrived; false when the connection is gone or has been silent too long.
    fn alive(&mut self, now_ms: u64) -> bool {
        loop {
            match self.inbox.try_recv() {
                Ok(Ok(_)) => self.live.observe(now_ms),
                Ok(Err(_)) | Err(mpsc::error::TryRecvError::Disconnected) => return false,
                Err(mpsc::error::TryRecvError::Empty) => break,
            }
        }
        self.live.silent(now_ms).is_none()
    }

    /// Tells the worker it is not needed after all.
    pub fn dismiss(self, ok: bool, reason: String) {
        let _ = self.link.try_send(Some(ToWorker::Stop { ok, reason }));
        let _ = self.link.try_send(None);
    }
}

/// Standbys promised to accepted join requests that have not taken theirs yet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Promises {
    reserved: usize,
}

/// Too few standbys for a join request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shortage {
    pub wanted: usize,
    pub connected: usize,
    pub reserved: usize,
}

impl Promises {
    /// Promises `wanted` of the `connected` standbys, or says how many are short.
    pub fn reserve(&mut self, connected: usize, wanted: usize) -> Result<(), Shortage> {
        if connected < self.reserved + wanted {
            return Err(Shortage {
                wanted,
                connected,
                reserved: self.reserved,
            });
        }
        self.reserved += wanted;
        Ok(())
    }

    /// A promise given back (the coordinator refused the request).
    pub fn release(&mut self, n: usize) {
        self.reserved = self.reserved.saturating_sub(n);
    }

    /// A join took a standby: it keeps one promise, if any was made (a scripted join makes
    /// none).
    pub fn taken(&mut self) {
        self.release(1);
    }
}

#[derive(Default)]
struct Pool {
    waiting: VecDeque<Standby>,
    promises: Promises,
}

/// The coordinator's standby workers.
pub struct Lobby {
    pool: Mutex<Pool>,
    arrived: Notify,
    clock: Arc<dyn Clock>,
    procs: ProcsConfig,
    /// Where workers connect, for error messages.
    workers_addr: SocketAddr,
    /// `Welcome::term`, told to standbys too (they look for the next leader when this one is
    /// lost).
    term: u64,
}

impl Lobby {
    pub fn new(clock: Arc<dyn Clock>, procs: ProcsConfig, workers_addr: SocketAddr) -> Self {
        Self {
            pool: Mutex::default(),
            arrived: Notify::new(),
            clock,
            procs,
            workers_addr,
            term: 0,
        }
    }

    /// A lobby of the leader of `term` (a job kept in a metadata store).
    pub fn under_term(mut self, term: u64) -> Self {
        self.term = term;
        self
    }

    pub fn workers_addr(&self) -> SocketAddr {
        self.workers_addr
    }

    /// Holds an authenticated worker as a standby, or refuses it when the lobby is full.
    pub fn hold(&self, peer: SocketAddr, reader: ControlReader, writer: ControlWriter) {
        let (link, rx) = mpsc::channel(LINK_QUEUE_MAX);
        let full = lock(&self.pool).waiting.len() >= MAX_STANDBYS;
        let writer = tokio::spawn(write_loop(writer, rx));
        if full {
            let reason = format!("the job already holds {MAX_STANDBYS} standby workers");
            tracing::warn!("refused a standby from {peer}: {reason}");
            let _ = link.try_send(Some(ToWorker::Refused { reason }));
            let _ = link.try_send(None);
            return;
        }
        let _ = link.try_send(Some(ToWorker::Standby {
            heartbeat_ms: self.procs.heartbeat_ms,
            heartbeat_timeout_ms: self.procs.heartbeat_timeout_ms,
            term: self.term,
        }));
        let standby = Standby {
            peer,
            link,
            writer,
            inbox: pump(reader),
            live: Liveness::new(self.clock.now_ms(), self.procs.heartbeat_timeout_ms),
        };
        tracing::info!("holding a standby worker from {peer}");
        lock(&self.pool).waiting.push_back(standby);
        self.arrived.notify_waiters();
    }

    /// Heartbeats every standby and drops those that are gone or silent.
    pub fn sweep(&self) {
        let now = self.clock.now_ms();
        let mut pool = lock(&self.pool);
        pool.waiting.retain_mut(|s| {
            let _ = s.link.try_send(Some(ToWorker::Heartbeat));
            let alive = s.alive(now);
            if !alive {
                tracing::info!("dropped the standby worker from {}: gone or silent", s.peer);
            }
            alive
        });
    }

    /// The oldest live standby, waiting for one until `deadline`.
    pub async fn take(&self, deadline: Instant) -> Option<Standby> {
        loop {
            // Registered before looking, so an arrival in between is not missed.
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            {
                let now = self.clock.now_ms();
                let mut pool = lock(&self.pool);
                while let Some(mut s) = pool.waiting.pop_front() {
                    if s.alive(now) {
                        pool.promises.taken();
                        return Some(s);
                    }
                }
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                return None;
            }
        }
    }

    /// Heartbeats standbys until the task is aborted.
    pub async fn keep_alive(self: Arc<Self>) {
        let mut every = tokio::time::interval(Duration::from_millis(self.procs.heartbeat_ms));
        loop {
            every.tick().await;
            self.sweep();
        }
    }

    /// Tells every standby the job is over for it.
    pub fn dismiss_all(&self, ok: bool, reason: &str) -> Vec<JoinHandle<()>> {
        let waiting = std::mem::take(&mut lock(&self.pool).waiting);
        waiting
            .into_iter()
            .map(|s| {
                let Standby { link, writer, .. } = s;
                let _ = link.try_send(Some(ToWorker::Stop {
                    ok,
                    reason: reason.to_string(),
                }));
                let _ = link.try_send(None);
                writer
            })
            .collect()
    }
}

impl Standbys for Lobby {
    fn reserve(&self, count: u32) -> Result<(), String> {
        self.sweep();
        let mut pool = lock(&self.pool);
        let connected = pool.waiting.len();
        pool.promises
            .reserve(connected, count as usize)
            .map_err(|s| shortage_message(s, self.workers_addr))
    }

    fn release(&self, count: u32) {
        lock(&self.pool).promises.release(count as usize);
    }

    fn connected(&self) -> usize {
        lock(&self.pool).waiting.len()
    }
}

/// Why a join cannot be accepted now, and what to do.
fn shortage_message(s: Shortage, addr: SocketAddr) -> String {
    let promised = if s.reserved > 0 {
        format!(" ({} promised to earlier join requests)", s.reserved)
    } else {
        String::new()
    };
    format!(
        "{} new ranks need {} standby workers; {} connected{promised}: start `ezero worker --join {addr}` (same cluster secrets and token) on each new machine, then retry",
        s.wanted,
        s.wanted,
        s.connected,
    )
}

/// Reads `reader` into a channel until the connection fails (the failure is the last item).
pub fn pump(mut reader: ControlReader) -> Inbox {
    let (tx, rx) = mpsc::channel(LINK_QUEUE_MAX);
    tokio::spawn(async move {
        loop {
            let msg = read_msg::<_, ToCoord>(&mut reader, CONTROL_FRAME_MAX_BYTES).await;
            let failed = msg.is_err();
            if tx.send(msg).await.is_err() || failed {
                return;
            }
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn promises_never_count_a_standby_twice() {
        let mut p = Promises::default();
        assert_eq!(p.reserve(1, 1), Ok(()));
        // The one standby is promised: a second request is short by one.
        assert_eq!(
            p.reserve(1, 1),
            Err(Shortage {
                wanted: 1,
                connected: 1,
                reserved: 1
            })
        );
        assert_eq!(p.reserve(3, 2), Ok(()));
        p.taken();
        p.release(1);
        assert_eq!(p, Promises { reserved: 1 });
        // A scripted join takes standbys without promises: the count never goes below zero.
        p.taken();
        p.taken();
        assert_eq!(p, Promises::default());
        assert!(p.reserve(0, 1).is_err());
    }

    #[test]
    fn a_shortage_says_how_many_are_connected_and_how_to_add_one() {
        let addr: SocketAddr = "10.0.0.1:7000".parse().unwrap();
        let m = shortage_message(
            Shortage {
                wanted: 2,
                connected: 1,
                reserved: 1,
            },
            addr,
        );
        assert!(m.contains("1 connected (1 promised"), "{m}");
        assert!(m.contains("ezero worker --join 10.0.0.1:7000"), "{m}");
    }
}
