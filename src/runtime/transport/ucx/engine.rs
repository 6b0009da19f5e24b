//! One UCP context and worker per engine, owned by one OS thread (a UCP worker in
//! `UCS_THREAD_MODE_SINGLE` may only be touched by its thread).
//!
//! The thread drains its command queue, progresses the worker until nothing moves, hands
//! received messages to the bounded inbox, then arms the worker and sleeps on its event fd for
//! at most [`IDLE_POLL_MS`]. Other threads queue commands and wake it with `ucp_worker_signal`
//! (safe from any thread). Buffers are owned: a send's bytes and header live in a box that the
//! completion frees; a rendezvous receive lands in a buffer the thread allocates at the size the
//! sender announced, after checking it against the limit.
//!
//! Received payloads hold receive credit (`credit`) until the consumer gives it back with
//! [`Engine::release`]; rendezvous payloads beyond it wait in the senders' memory. While the
//! inbox is full (a count of messages) the thread stops progressing as well.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::address::join_address;
pub use super::config::{valid_net_devices, EngineConfig, EngineCounts, Inbound};
use super::credit::Credit;
use super::lent::{Loan, LEND_MIN_BYTES};
use super::ring::{Ring, Staged};
use super::shm::Segment;
pub use super::thread::HEADER_MAX_BYTES;
use super::thread::{lock_pids, run, Cmd, Pids, Waker};
use super::{library, sys, UcxError};
use crate::runtime::transport::AddFn;

/// How long [`Engine::pid_of`] waits for a peer's word that it mapped this engine's segment.
const ATTACH_WAIT: Duration = Duration::from_secs(1);

/// A UCP worker on its own thread.
pub struct Engine {
    id: u32,
    address: Vec<u8>,
    commands: SyncSender<Cmd>,
    /// Behind a lock so that the engine is `Sync` (one reader in practice: its transport).
    inbox: Mutex<Receiver<Inbound>>,
    waker: Waker,
    counts: Arc<Mutex<EngineCounts>>,
    credit: Arc<Credit>,
    max_message_bytes: usize,
    /// Peers with an endpoint (a send to another is refused at once).
    peers: Mutex<std::collections::BTreeSet<u32>>,
    /// This engine's staging ring, if staging is on.
    ring: Option<Arc<Ring>>,
    /// Whether the thread holds staged payloads back for loans.
    holding: Arc<AtomicBool>,
    /// The process behind each peer whose staging segment the thread attached.
    pids: Pids,
    /// [`EngineConfig::pulls`].
    pulls: bool,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Opens libucp, makes the context and worker on a new thread, and returns once the
    /// worker's address is known.
    pub fn start(cfg: EngineConfig) -> Result<Self, UcxError> {
        let ucp = library()?;
        let (commands, rx) = mpsc::sync_channel(cfg.queue_max.max(1));
        let (inbox_tx, inbox) = mpsc::sync_channel(cfg.inbox_max.max(1));
        let (ready_tx, ready) = mpsc::sync_channel(1);
        let waker: Waker = Arc::default();
        let counts: Arc<Mutex<EngineCounts>> = Arc::default();
        let credit = Arc::new(Credit::new(cfg.inbox_bytes()));
        let ring = (cfg.staging_slots > 0)
            .then(|| Segment::create(cfg.staging_slots, cfg.staging_slot_bytes))
            .and_then(|made| {
                made.map_err(|e| {
                    tracing::warn!("ucx: no staging segment ({e}); payloads go through UCX alone")
                })
                .ok()
            })
            .map(|segment| Arc::new(Ring::new(segment)));
        let holding: Arc<AtomicBool> = Arc::default();
        let pids: Pids = Arc::default();
        let thread_ring = (ring.clone(), Arc::clone(&holding), Arc::clone(&pids));
        let (thread_waker, thread_counts, thread_cfg, thread_credit) = (
            Arc::clone(&waker),
            Arc::clone(&counts),
            cfg.clone(),
            Arc::clone(&credit),
        );
        let thread = std::thread::Builder::new()
            .name(format!("ucx-engine-{}", cfg.id))
            .spawn(move || {
                run(
                    ucp,
                    thread_cfg,
                    rx,
                    inbox_tx,
                    ready_tx,
                    thread_waker,
                    thread_counts,
                    thread_credit,
                    thread_ring,
                )
            })
            .map_err(|e| UcxError::Call {
                call: "spawning the engine thread",
                status: e.to_string(),
            })?;
        let worker = ready.recv().map_err(|_| UcxError::Stopped)??;
        let staging = ring.as_ref().map(|r| *r.segment().descriptor());
        Ok(Self {
            id: cfg.id,
            address: join_address(&worker, staging.as_ref()),
            commands,
            inbox: Mutex::new(inbox),
            waker,
            counts,
            credit,
            max_message_bytes: cfg.max_message_bytes,
            peers: Mutex::default(),
            ring,
            holding,
            pids,
            pulls: cfg.pulls,
            thread: Some(thread),
        })
    }

    /// The process behind `peer`, for reading its memory, if each side mapped the other's
    /// staging segment: then it runs on this host as this user, its segment carried the nonce
    /// its authenticated address named, and it reads ours too. Both sides must agree on that
    /// (a collective either pulls or stages, on every member alike), so a peer whose segment
    /// is mapped here but whose word that it mapped ours has not come yet is waited for, up to
    /// [`ATTACH_WAIT`]: it sends it when it connects to us, before any collective.
    pub fn pid_of(&self, peer: u32) -> Option<i32> {
        if !self.pulls {
            return None;
        }
        let pid = lock_pids(&self.pids).get(&peer).copied()?;
        let until = Instant::now() + ATTACH_WAIT;
        while !self.stages_to(peer) {
            if Instant::now() >= until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Some(pid)
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    /// The worker's address and this engine's staging segment, for peers to connect with (an
    /// opaque blob of a few hundred bytes).
    pub fn address(&self) -> &[u8] {
        &self.address
    }

    /// Opens an endpoint to `peer` at `address` (a peer engine's [`Engine::address`]).
    pub fn connect(&self, peer: u32, address: Vec<u8>) -> Result<(), UcxError> {
        let (done, answer) = mpsc::sync_channel(1);
        self.submit(Cmd::Connect {
            peer,
            address,
            done,
        })?;
        answer.recv().map_err(|_| UcxError::Stopped)??;
        self.peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(peer);
        Ok(())
    }

    /// Queues `bytes` for `peer`; waits only while the command queue is full.
    pub fn send(&self, peer: u32, bytes: Vec<u8>) -> Result<(), UcxError> {
        self.send_with_header(peer, Vec::new(), Bytes::from(bytes))
    }

    /// Queues one message for `peer`: a small `header` (at most [`HEADER_MAX_BYTES`]) and a
    /// `payload` sent from where it lies. Above the eager size the receiver reads the payload
    /// straight from this process's memory (CMA) into the buffer it hands out, so it is copied
    /// once, and one payload can go to several peers. (A payload in pieces would not be: UCX
    /// moves an I/O vector through bounce buffers.)
    pub fn send_with_header(
        &self,
        peer: u32,
        header: Vec<u8>,
        payload: Bytes,
    ) -> Result<(), UcxError> {
        if payload.len() > self.max_message_bytes || header.len() > HEADER_MAX_BYTES {
            return Err(UcxError::TooLarge {
                len: payload.len().max(header.len()),
                max: if header.len() > HEADER_MAX_BYTES {
                    HEADER_MAX_BYTES
                } else {
                    self.max_message_bytes
                },
            });
        }
        if !self
            .peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&peer)
        {
            return Err(UcxError::NoPeer(peer));
        }
        self.submit(Cmd::Send {
            peer,
            header,
            payload,
        })
    }

    /// A staging slot for a `len`-byte payload to every one of `to` (peers that mapped this
    /// engine's segment; none of them repeated), if one is free within the ring's short wait;
    /// `None`: send it with [`Engine::send_with_header`].
    pub fn stage(&self, to: &[u32], len: usize) -> Option<Staged<'_>> {
        if len < LEND_MIN_BYTES || len > self.max_message_bytes {
            return None;
        }
        // Receivers keeping its slots while they wait for loans let them go when told.
        let tell = |holders: Vec<u32>| {
            let _ = self.submit(Cmd::SendStarved { to: holders });
        };
        self.ring.as_ref()?.take(to, len, tell)
    }

    /// Whether payloads staged by peers wait for loans now: a consumer about to wait with no
    /// loan open calls [`Engine::fetch_now`] first.
    pub fn holds_staged(&self) -> bool {
        self.holding.load(Ordering::Relaxed)
    }

    /// Whether payloads to `peer` can be staged: it mapped this engine's segment.
    pub fn stages_to(&self, peer: u32) -> bool {
        self.ring.as_ref().is_some_and(|r| r.lock().is_ready(peer))
    }

    /// Tells each of `to` that `staged` holds the payload of the message whose small header
    /// is `header`; they copy it out and free the slot. A peer without an endpoint is refused
    /// here, and the slot freed.
    pub fn send_staged(
        &self,
        to: &[u32],
        staged: Staged<'_>,
        header: Vec<u8>,
    ) -> Result<(), UcxError> {
        if header.len() > HEADER_MAX_BYTES {
            return Err(UcxError::TooLarge {
                len: header.len(),
                max: HEADER_MAX_BYTES,
            });
        }
        {
            let peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(&p) = to.iter().find(|p| !peers.contains(p)) {
                return Err(UcxError::NoPeer(p));
            }
        }
        self.submit(Cmd::SendStaged {
            to: to.to_vec(),
            slot: staged.slot,
            generation: staged.generation,
            len: staged.len(),
            header,
        })?;
        staged.handed();
        Ok(())
    }

    /// Lends `len` bytes at `at` for the next rendezvous message from `from` whose header
    /// starts with `key` and whose payload is `len` bytes (see `lent`): the payload lands
    /// there (or, with `add`, is added into it), and an [`Inbound::Placed`] says so.
    ///
    /// # Safety
    /// The memory is borrowed as [`crate::runtime::transport::shared_memory`]'s loans section
    /// says; at this level the loan ends once [`Engine::end_loans`] for `batch` has returned
    /// and an [`Inbound::Placed`] has come for every loan of the batch it did not count as
    /// withdrawn (`UcxPlane::end_loans` waits for both).
    pub unsafe fn lend(
        &self,
        batch: u64,
        from: u32,
        key: Vec<u8>,
        (at, len): (*mut u8, usize),
        add: Option<AddFn>,
    ) -> Result<(), UcxError> {
        self.submit(Cmd::Lend(Loan {
            batch,
            from,
            key,
            at: at as usize,
            len,
            add,
        }))
    }

    /// Withdraws the loans of `batch` no message has matched; how many there were.
    pub fn end_loans(&self, batch: u64) -> Result<usize, UcxError> {
        let (done, answer) = mpsc::sync_channel(1);
        self.submit(Cmd::EndLoans { batch, done })?;
        answer.recv().map_err(|_| UcxError::Stopped)
    }

    /// Fetches waiting rendezvous messages now instead of keeping them for loans (the
    /// consumer is about to wait for frames it lent nothing for).
    pub fn fetch_now(&self) -> Result<(), UcxError> {
        self.submit(Cmd::FetchNow)
    }

    /// The next message or event, waiting at most `timeout`. A message holds its payload's
    /// length of receive credit until [`Engine::release`].
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Inbound, RecvTimeoutError> {
        self.inbox
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .recv_timeout(timeout)
    }

    /// Gives back the receive credit of a message's `bytes` (its payload's length) once the
    /// consumer has taken it: every received message holds credit until then.
    pub fn release(&self, bytes: usize) {
        if self.credit.give(bytes) {
            wake(&self.waker);
        }
    }

    /// Bytes of received payloads not released yet.
    pub fn held_bytes(&self) -> usize {
        self.credit.held_bytes()
    }

    pub fn counts(&self) -> EngineCounts {
        *self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a pull of `bytes` from a peer's memory (made by the consumer, not this thread).
    pub fn count_pull(&self, bytes: usize) {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        c.pulls += 1;
        c.pulled_bytes += bytes as u64;
    }

    fn submit(&self, cmd: Cmd) -> Result<(), UcxError> {
        self.commands.send(cmd).map_err(|_| UcxError::Stopped)?;
        wake(&self.waker);
        Ok(())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.commands.send(Cmd::Stop);
        wake(&self.waker);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn wake(waker: &Waker) {
    let w = waker.lock().unwrap_or_else(|p| p.into_inner());
    if let (Some(worker), Ok(ucp)) = (*w, library()) {
        // SAFETY: the worker is alive while the waker holds it (the thread clears it under this
        // lock before destroying the worker); ucp_worker_signal is safe from any thread.
        unsafe { (ucp.ucp_worker_signal)(worker as sys::ucp_worker_h) };
    }
}

#[cfg(test)]
mod tests {
    use super::super::require_for_tests as require;
    use super::*;
    use std::time::Instant;

    fn pair() -> (Engine, Engine) {
        require();
        let a = Engine::start(EngineConfig::shared_memory(0)).unwrap();
        let b = Engine::start(EngineConfig::shared_memory(1)).unwrap();
        a.connect(1, b.address().to_vec()).unwrap();
        b.connect(0, a.address().to_vec()).unwrap();
        (a, b)
    }

    fn next(e: &Engine) -> Inbound {
        e.recv_timeout(Duration::from_secs(10)).expect("a message")
    }

    #[ignore = "needs libucx0 (apt-get install libucx0)"]
    #[test]
    fn messages_of_every_protocol_arrive_whole_and_in_order() {
        let (a, b) = pair();
        // Eager short, eager copy, and rendezvous into a buffer the receiver allocates.
        let sizes = [0usize, 90, 5000, 1 << 20, 16 << 20];
        for (k, &n) in sizes.iter().enumerate() {
            let bytes: Vec<u8> = (0..n).map(|i| (i * 31 + k) as u8).collect();
            a.send(1, bytes).unwrap();
        }
        for (k, &n) in sizes.iter().enumerate() {
            let want: Vec<u8> = (0..n).map(|i| (i * 31 + k) as u8).collect();
            assert_eq!(
                next(&b),
                Inbound::Message {
                    from: 0,
                    header: Vec::new(),
                    bytes: want.into(),
                    crc: None,
                },
                "size {n}"
            );
        }
        b.send(0, b"back".to_vec()).unwrap();
        assert_eq!(
            next(&a),
            Inbound::Message {
                from: 1,
                header: Vec::new(),
                bytes: Bytes::from_static(b"back"),
                crc: None,
            }
        );
        assert_eq!(b.counts(), EngineCounts::default());
    }

    #[ignore = "needs libucx0 (apt-get install libucx0)"]
    #[test]
    fn a_header_arrives_with_its_payload_and_an_oversize_one_is_refused() {
        let (a, b) = pair();
        for n in [0usize, 5000, 16 << 20] {
            let payload: Vec<u8> = (0..n).map(|i| (i * 7) as u8).collect();
            let header = vec![n as u8; 40];
            a.send_with_header(1, header.clone(), payload.clone().into())
                .unwrap();
            assert_eq!(
                next(&b),
                Inbound::Message {
                    from: 0,
                    header,
                    bytes: payload.into(),
                    crc: None,
                },
                "payload of {n} bytes"
            );
        }
        assert!(matches!(
            a.send_with_header(1, vec![0; HEADER_MAX_BYTES + 1], Bytes::new()),
            Err(UcxError::TooLarge { .. })
        ));
        assert_eq!(b.counts(), EngineCounts::default());
    }

    /// A lent buffer receives its message in place: lent before the message comes, or after
    /// it was announced while the engine kept it for a loan; a loan nothing matched is
    /// counted as withdrawn, and the next message nobody lent for arrives as usual.
    #[ignore = "needs libucx0 (apt-get install libucx0)"]
    #[test]
    fn a_lent_buffer_receives_its_message_in_place() {
        let (a, b) = pair();
        const N: usize = 3 << 20;
        let body = |k: u8| -> Vec<u8> { (0..N).map(|i| (i * 13) as u8 ^ k).collect() };
        let mut first = vec![0u8; N];
        let mut second = vec![0u8; N];
        // SAFETY: both buffers outlive the loans: batch 1 ends, and its one message is
        // placed, before either is read; batch 2's below likewise.
        unsafe { b.lend(1, 0, b"one".to_vec(), (first.as_mut_ptr(), N), None) }.unwrap();
        a.send_with_header(1, b"one+".to_vec(), body(1).into())
            .unwrap();
        let placed = next(&b);
        assert_eq!(
            placed,
            Inbound::Placed {
                from: 0,
                header: b"one+".to_vec(),
                batch: 1,
                at: first.as_ptr() as usize,
                len: N,
                ok: true,
                crc: None,
            }
        );
        assert_eq!(b.end_loans(1).unwrap(), 0, "its one loan was matched");
        assert!(first == body(1));
        // A loan that nothing will match keeps batch 2 open, so the engine keeps the next
        // message back; the loan made for it afterwards still gets it.
        unsafe { b.lend(2, 0, b"never".to_vec(), (first.as_mut_ptr(), N), None) }.unwrap();
        a.send_with_header(1, b"two+".to_vec(), body(2).into())
            .unwrap();
        std::thread::sleep(Duration::from_millis(100));
        unsafe { b.lend(2, 0, b"two".to_vec(), (second.as_mut_ptr(), N), None) }.unwrap();
        assert!(matches!(
            next(&b),
            Inbound::Placed {
                batch: 2,
                ok: true,
                ..
            }
        ));
        assert_eq!(
            b.end_loans(2).unwrap(),
            1,
            "the unmatched loan is withdrawn"
        );
        assert!(second == body(2));
        assert!(first == body(1), "a withdrawn loan's memory is untouched");
        // No loan: a message arrives in a buffer of the engine's.
        b.fetch_now().unwrap();
        a.send_with_header(1, b"three".to_vec(), body(3).into())
            .unwrap();
        let Inbound::Message { bytes, .. } = next(&b) else {
            panic!("an ordinary message")
        };
        assert!(bytes == body(3));
        b.release(N);
        let lent = EngineCounts {
            lent: 2,
            ..EngineCounts::default()
        };
        assert_eq!(b.counts(), lent, "two messages received into loans");
    }

    /// `--ucx-net`: UCX over TCP alone (here on loopback), as between hosts.
    #[ignore = "needs libucx0 (apt-get install libucx0)"]
    #[test]
    fn engines_talk_over_a_declared_network_device() {
        require();
        let net = |id| EngineConfig {
            transports: "tcp".into(),
            ..EngineConfig::with_network(id, "lo")
        };
        let a = Engine::start(net(0)).unwrap();
        let b = Engine::start(net(1)).unwrap();
        a.connect(1, b.address().to_vec()).unwrap();
        b.connect(0, a.address().to_vec()).unwrap();
        let payload: Vec<u8> = (0..(2 << 20)).map(|i| (i % 239) as u8).collect();
        a.send(1, payload.clone()).unwrap();
        assert_eq!(
            next(&b),
            Inbound::Message {
                from: 0,
                header: Vec::new(),
                bytes: payload.into(),
                crc: None,
            }
        );
        assert!(valid_net_devices("eth1,mlx5_0:1"));
        for bad in ["", "eth1,", "eth 1", "a\0b", "lo;rm"] {
            assert!(!valid_net_devices(bad), "{bad:?}");
        }
    }

    /// The peer process of [`a_peer_process_echoes_and_its_death_is_reported`]: run as this
    /// test binary with `EZERO_UCX_PEER=1`; reads the parent's address (hex) on stdin, prints
    /// its own, echoes one message, then waits to be killed.
    #[test]
    #[ignore = "the child process of a_peer_process_echoes_and_its_death_is_reported; does nothing alone"]
    fn ucx_peer_process() {
        if std::env::var("EZERO_UCX_PEER").is_err() {
            return;
        }
        let e = Engine::start(EngineConfig::shared_memory(1)).unwrap();
        println!("address {}", hex(e.address()));
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).unwrap();
        e.connect(0, unhex(line.trim())).unwrap();
        let Inbound::Message { bytes, .. } = next(&e) else {
            panic!("expected a message")
        };
        e.send(0, bytes.iter().rev().copied().collect()).unwrap();
        std::thread::sleep(Duration::from_secs(60));
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len() / 2)
            .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
            .collect()
    }

    #[ignore = "needs libucx0 (apt-get install libucx0)"]
    #[test]
    fn a_peer_process_echoes_and_its_death_is_reported() {
        use std::io::{BufRead, Write};
        if std::env::var("EZERO_UCX_PEER").is_ok() {
            return;
        }
        require();
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "--ignored",
                "runtime::transport::ucx::engine::tests::ucx_peer_process",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env("EZERO_UCX_PEER", "1")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let address = loop {
            let mut line = String::new();
            assert!(out.read_line(&mut line).unwrap() > 0, "the peer exited");
            // libtest may have printed the test's name on the same line.
            if let Some((_, a)) = line.trim().split_once("address ") {
                break unhex(a);
            }
        };
        let e = Engine::start(EngineConfig::shared_memory(0)).unwrap();
        e.connect(1, address).unwrap();
        let mut stdin = child.stdin.take().unwrap();
        writeln!(stdin, "{}", hex(e.address())).unwrap();
        let msg: Vec<u8> = (0..(4u32 << 20)).map(|i| (i % 253) as u8).collect();
        e.send(1, msg.clone()).unwrap();
        let back = next(&e);
        assert_eq!(
            back,
            Inbound::Message {
                from: 1,
                header: Vec::new(),
                bytes: msg.iter().rev().copied().collect::<Vec<u8>>().into(),
                crc: None,
            }
        );
        // kill -9: the endpoint's failure is reported, within a few keepalive rounds.
        child.kill().unwrap();
        child.wait().unwrap();
        let started = Instant::now();
        match e.recv_timeout(Duration::from_secs(30)) {
            Ok(Inbound::PeerLost { peer: 1, why }) => {
                eprintln!("peer loss reported after {:?}: {why}", started.elapsed())
            }
            other => panic!("expected the peer's loss, got {other:?}"),
        }
        // The failed endpoint is closed: a send to that peer counts as failed at once (it
        // is not left pending on a dead process), and the engine goes on serving others.
        let failed = e.counts().failed;
        let closed = Instant::now() + Duration::from_secs(10);
        while e.counts().failed == failed {
            assert!(
                Instant::now() < closed,
                "a send to the dead peer never failed"
            );
            e.send(1, vec![1u8; 1 << 20]).unwrap();
            std::thread::sleep(Duration::from_millis(20));
        }
        let c = Engine::start(EngineConfig::shared_memory(2)).unwrap();
        e.connect(2, c.address().to_vec()).unwrap();
        e.send(2, b"still here".to_vec()).unwrap();
        assert_eq!(
            next(&c),
            Inbound::Message {
                from: 0,
                header: Vec::new(),
                bytes: b"still here".to_vec().into(),
                crc: None,
            }
        );
    }

    #[ignore = "needs libucx0 (apt-get install libucx0)"]
    #[test]
    fn oversize_messages_are_refused_by_the_sender_and_the_receiver() {
        require();
        let a = Engine::start(EngineConfig::shared_memory(0)).unwrap();
        let b = Engine::start(EngineConfig {
            max_message_bytes: 1 << 16,
            ..EngineConfig::shared_memory(1)
        })
        .unwrap();
        a.connect(1, b.address().to_vec()).unwrap();
        // The receiver's limit: counted and dropped, and what follows still arrives.
        a.send(1, vec![7u8; 1 << 20]).unwrap();
        a.send(1, vec![1u8; 10]).unwrap();
        assert_eq!(
            next(&b),
            Inbound::Message {
                from: 0,
                header: Vec::new(),
                bytes: vec![1u8; 10].into(),
                crc: None,
            }
        );
        assert_eq!(b.counts().refused, 1);
        // The sender's own limit.
        let small = Engine::start(EngineConfig {
            max_message_bytes: 8,
            ..EngineConfig::shared_memory(2)
        })
        .unwrap();
        assert!(matches!(
            small.send(1, vec![0; 9]),
            Err(UcxError::TooLarge { len: 9, max: 8 })
        ));
    }
}
