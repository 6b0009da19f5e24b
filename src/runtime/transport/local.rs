//! The in-process transport: ranks in one process exchange frames over channels. Payloads are
//! reference-counted `Bytes`, so an all-gather hands the same buffer to every peer without a copy.
//!
//! For chaos runs the network misbehaves as [`NetFaults`] says. Late frames (delays,
//! retransmissions) are handed to one postman thread that delivers each when it is due.
//!
//! Time is the network's [`Clock`]: when a late frame is due, and when a receive gives up. Under
//! a manual clock a run's delays and deadlines cost no wall time and replay; what the network
//! did can be kept as a trace of [`NetEvent`]s.

use std::collections::{BinaryHeap, HashMap};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex, Weak};

use super::net_faults::FaultSet;
pub use super::net_faults::{
    NetCounts, NetEvent, NetFaults, NetHappening, NetStats, NetTrace, Partition,
};
use crate::model::rng::{mix, SplitMix64};
use crate::plan::RankId;
use crate::runtime::clock::{Bell, Clock, SystemClock};
use crate::runtime::transport::{Frame, Tag, TagKind, Transport, TransportError};

/// A frame in an inbox, with the checksum the sender computed when damage is simulated (the
/// stand-in for the wire codec's checksum).
struct Parcel {
    frame: Frame,
    crc: Option<u32>,
}

impl Parcel {
    fn intact(&self) -> bool {
        self.crc.is_none_or(|c| c == frame_crc(&self.frame))
    }
}

fn frame_crc(f: &Frame) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for x in [
        f.epoch,
        f.step,
        f.from as u64,
        f.tag.unit as u64,
        f.tag.piece as u64,
    ] {
        h.update(&x.to_le_bytes());
    }
    h.update(&[f.tag.kind as u8, f.tag.attempt, f.tag.pass]);
    h.update(&f.payload);
    h.finalize()
}

/// The switchboard every local endpoint sends through.
pub struct LocalNetwork {
    inboxes: Mutex<HashMap<RankId, Inbox>>,
    faults: Option<NetFaults>,
    stats: NetStats,
    clock: Arc<dyn Clock>,
    /// Late parcels, and whether the postman still works; its bell rings on each change.
    mail: Mutex<Mail>,
    mail_bell: Arc<Bell>,
    trace: Option<Arc<NetTrace>>,
}

/// Where a rank's frames go, and the bell its receive sleeps on.
struct Inbox {
    tx: Sender<Parcel>,
    bell: Arc<Bell>,
}

#[derive(Default)]
struct Mail {
    due: BinaryHeap<Due>,
    closed: bool,
}

/// A parcel the postman delivers at `at_ms` on the network's clock; `seq` keeps equal times in
/// sending order.
struct Due {
    at_ms: u64,
    seq: u64,
    to: RankId,
    parcel: Parcel,
}

impl PartialEq for Due {
    fn eq(&self, o: &Self) -> bool {
        (self.at_ms, self.seq) == (o.at_ms, o.seq)
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Due {
    // Reversed: the heap pops the earliest.
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (o.at_ms, o.seq).cmp(&(self.at_ms, self.seq))
    }
}

impl LocalNetwork {
    /// A perfect network on the wall clock.
    pub fn new() -> Arc<Self> {
        Self::on_clock(None, SystemClock::shared(), None)
    }

    /// A network on the wall clock whose endpoints misbehave as `faults` says.
    pub fn with_faults(faults: NetFaults) -> Arc<Self> {
        Self::on_clock(Some(faults), SystemClock::shared(), None)
    }

    /// A network that keeps time by `clock`, misbehaves as `faults` says (perfect for `None`
    /// or faults all off) and, given a `trace`, records there what it does.
    pub fn on_clock(
        faults: Option<NetFaults>,
        clock: Arc<dyn Clock>,
        trace: Option<Arc<NetTrace>>,
    ) -> Arc<Self> {
        let faults = faults.filter(NetFaults::any);
        let net = Arc::new(Self {
            inboxes: Mutex::default(),
            faults,
            stats: NetStats::default(),
            clock: Arc::clone(&clock),
            mail: Mutex::default(),
            mail_bell: Bell::courier(),
            trace,
        });
        // Spawned once the network exists: the postman's first look must find it.
        if faults.is_some() {
            let (me, bell) = (Arc::downgrade(&net), Arc::clone(&net.mail_bell));
            std::thread::Builder::new()
                .name("ezero-postman".into())
                .spawn(move || postman(me, bell, clock))
                .expect("spawn the postman thread");
        }
        net
    }

    /// The clock this network keeps time by.
    pub fn clock(&self) -> Arc<dyn Clock> {
        Arc::clone(&self.clock)
    }

    /// What the network has done so far.
    pub fn counts(&self) -> NetCounts {
        self.stats.counts()
    }

    /// Creates the endpoint of `rank` (replacing any previous one).
    pub fn endpoint(self: &Arc<Self>, rank: RankId) -> LocalEndpoint {
        let (tx, rx) = mpsc::channel();
        let bell = Bell::new();
        let inbox = Inbox {
            tx,
            bell: Arc::clone(&bell),
        };
        if let Some(old) = self.lock().insert(rank, inbox) {
            old.bell.ring();
        }
        let chaos = self.faults.map(|f| {
            Mutex::new(Chaos {
                faults: f,
                rng: SplitMix64::new(mix(f.seed, rank as u64)),
                held: Vec::new(),
                seq: 0,
                sent: 0,
            })
        });
        LocalEndpoint {
            rank,
            net: Arc::clone(self),
            rx,
            bell,
            chaos,
        }
    }

    /// Disconnects `rank`: its pending receive fails with `Closed`, sends to it fail.
    pub fn kill(&self, rank: RankId) {
        let gone = self.lock().remove(&rank);
        if let Some(inbox) = gone {
            self.note(rank, NetHappening::Lost);
            inbox.bell.ring();
        }
    }

    fn note(&self, rank: RankId, what: NetHappening) {
        if let Some(t) = &self.trace {
            let at_ms = self.clock.now_ms();
            t.push(NetEvent { at_ms, rank, what });
        }
    }

    /// Wakes `rank` from any receive in (epoch, step) with `CommError::Interrupted`: that step is
    /// abandoned. Later steps and epochs ignore it as stale.
    pub fn interrupt(&self, rank: RankId, epoch: u64, step: u64) {
        let tag = Tag {
            kind: TagKind::Interrupt,
            attempt: 0,
            unit: 0,
            pass: 0,
            piece: 0,
        };
        let frame = Frame {
            epoch,
            step,
            from: RankId::MAX,
            tag,
            payload: bytes::Bytes::new(),
        };
        let _ = self.deliver(rank, Parcel { frame, crc: None });
    }

    /// Disconnects everyone (used when a run aborts, so that no rank stays blocked), and stops
    /// the postman with whatever it still holds.
    pub fn close(&self) {
        let gone: Vec<Inbox> = self.lock().drain().map(|(_, inbox)| inbox).collect();
        for inbox in gone {
            inbox.bell.ring();
        }
        self.close_mail();
    }

    fn close_mail(&self) {
        let mut mail = self.mail.lock().unwrap_or_else(|e| e.into_inner());
        mail.closed = true;
        mail.due.clear();
        drop(mail);
        self.mail_bell.ring();
    }

    fn deliver(&self, to: RankId, parcel: Parcel) -> Result<(), TransportError> {
        let (tx, bell) = self
            .lock()
            .get(&to)
            .map(|i| (i.tx.clone(), Arc::clone(&i.bell)))
            .ok_or(TransportError::UnknownPeer(to))?;
        tx.send(parcel)
            .map_err(|_| TransportError::UnknownPeer(to))?;
        bell.ring();
        Ok(())
    }

    fn is_up(&self, rank: RankId) -> bool {
        self.lock().contains_key(&rank)
    }

    /// Hands `parcel` to the postman for delivery at its due time.
    fn post(&self, due: Due) {
        let mut mail = self.mail.lock().unwrap_or_else(|e| e.into_inner());
        if !mail.closed {
            mail.due.push(due);
            drop(mail);
            self.mail_bell.ring();
        }
    }

    /// Takes the parcels due by now; `Err` once the network closed. Also says when the next
    /// one is due.
    fn take_due(&self) -> Result<(Vec<Due>, Option<u64>), ()> {
        let now = self.clock.now_ms();
        let mut mail = self.mail.lock().unwrap_or_else(|e| e.into_inner());
        if mail.closed {
            return Err(());
        }
        let mut ready = Vec::new();
        while mail.due.peek().is_some_and(|d| d.at_ms <= now) {
            ready.extend(mail.due.pop());
        }
        Ok((ready, mail.due.peek().map(|d| d.at_ms)))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RankId, Inbox>> {
        // A poisoned lock only means another thread panicked while inserting or removing a
        // sender; the map itself is always consistent.
        self.inboxes.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for LocalNetwork {
    fn drop(&mut self) {
        // Lets the postman, asleep on the clock, see that it is done.
        self.close_mail();
    }
}

/// Delivers late parcels when they are due, sleeping on the network's clock between. Ends
/// when the network closes or is dropped.
fn postman(net: Weak<LocalNetwork>, bell: Arc<Bell>, clock: Arc<dyn Clock>) {
    loop {
        let seen = bell.ticket();
        let next = {
            let Some(net) = net.upgrade() else { return };
            let Ok((ready, next)) = net.take_due() else {
                return;
            };
            for due in ready {
                // The peer may have gone meanwhile; a late frame to a dead rank is lost with it.
                let _ = net.deliver(due.to, due.parcel);
            }
            next
        };
        clock.sleep(&bell, seen, next);
    }
}

/// One rank's end of the local network.
pub struct LocalEndpoint {
    rank: RankId,
    net: Arc<LocalNetwork>,
    rx: Receiver<Parcel>,
    bell: Arc<Bell>,
    chaos: Option<Mutex<Chaos>>,
}

struct Chaos {
    faults: NetFaults,
    rng: SplitMix64,
    held: Vec<(RankId, Parcel)>,
    seq: u64,
    /// Frames this endpoint has sent: the partition window counts them.
    sent: u64,
}

impl LocalEndpoint {
    fn release_held(&self, chaos: &mut Chaos) {
        for (to, p) in chaos.held.drain(..) {
            // The peer may have gone meanwhile; a lost frame to a dead rank is no error here.
            let _ = self.net.deliver(to, p);
        }
    }

    /// Sends `frame` through the faults its fate draws.
    fn send_faulty(&self, c: &mut Chaos, to: RankId, frame: Frame) -> Result<(), TransportError> {
        if !self.net.is_up(to) {
            return Err(TransportError::UnknownPeer(to));
        }
        let index = c.sent;
        let fate = c.faults.draw(&mut c.rng, self.rank, to, index);
        c.sent += 1;
        let stats = &self.net.stats;
        if fate.partitioned {
            NetStats::bump(&stats.partitioned);
        }
        let crc = c.faults.checksums().then(|| frame_crc(&frame));
        let now = self.net.clock.now_ms();
        let later = |c: &mut Chaos, ms: u64, parcel: Parcel| {
            c.seq += 1;
            self.net.post(Due {
                at_ms: now + ms,
                seq: c.seq,
                to,
                parcel,
            });
        };
        let mut first_ms = fate.delay_ms;
        if let Some(bit) = fate.corrupt {
            NetStats::bump(&stats.corrupted);
            let damaged = Parcel {
                frame: damage(&frame, bit),
                crc,
            };
            if first_ms == 0 {
                let _ = self.net.deliver(to, damaged);
            } else {
                later(c, first_ms, damaged);
            }
            first_ms += c.faults.retransmit_ms.max(1);
            NetStats::bump(&stats.retransmitted);
        } else if fate.lost_first {
            first_ms += c.faults.retransmit_ms.max(1);
            NetStats::bump(&stats.retransmitted);
        }
        if fate.duplicate {
            NetStats::bump(&stats.duplicated);
        }
        let held = first_ms == 0 && fate.hold && c.held.is_empty();
        let faults = FaultSet {
            delayed: first_ms > 0,
            retransmitted: fate.corrupt.is_some() || fate.lost_first,
            corrupted: fate.corrupt.is_some(),
            duplicated: fate.duplicate,
            reordered: held,
            partitioned: fate.partitioned,
        };
        if faults != FaultSet::default() {
            let what = NetHappening::Faulted {
                to,
                index,
                epoch: frame.epoch,
                step: frame.step,
                tag: frame.tag,
                due_ms: now + first_ms,
                faults,
            };
            self.net.note(self.rank, what);
        }
        let copies = if fate.duplicate { 2 } else { 1 };
        if first_ms > 0 {
            NetStats::bump(&stats.delayed);
            for _ in 0..copies {
                later(
                    c,
                    first_ms,
                    Parcel {
                        frame: frame.clone(),
                        crc,
                    },
                );
            }
            return Ok(());
        }
        if held {
            NetStats::bump(&stats.reordered);
            c.held.push((to, Parcel { frame, crc }));
            return Ok(());
        }
        let res = self.net.deliver(
            to,
            Parcel {
                frame: frame.clone(),
                crc,
            },
        );
        if res.is_ok() && fate.duplicate {
            let _ = self.net.deliver(to, Parcel { frame, crc });
        }
        self.release_held(c);
        res
    }
}

/// `frame` with one bit flipped: in the payload when it has one, else in the header.
fn damage(frame: &Frame, bit: u64) -> Frame {
    let mut f = frame.clone();
    if f.payload.is_empty() {
        f.step ^= 1 << (bit % 64);
    } else {
        let mut bytes = f.payload.to_vec();
        let at = (bit / 8) as usize % bytes.len();
        bytes[at] ^= 1 << (bit % 8);
        f.payload = bytes.into();
    }
    f
}

impl Transport for LocalEndpoint {
    fn rank(&self) -> RankId {
        self.rank
    }

    fn send(&self, to: RankId, frame: Frame) -> Result<(), TransportError> {
        let Some(chaos) = &self.chaos else {
            return self.net.deliver(to, Parcel { frame, crc: None });
        };
        let mut c = chaos.lock().unwrap_or_else(|e| e.into_inner());
        self.send_faulty(&mut c, to, frame)
    }

    fn flush(&self) {
        if let Some(chaos) = &self.chaos {
            let mut c = chaos.lock().unwrap_or_else(|e| e.into_inner());
            self.release_held(&mut c);
        }
    }

    fn recv_timeout(&mut self, timeout_ms: u64) -> Result<Frame, TransportError> {
        self.flush();
        let clock = &self.net.clock;
        let deadline = clock.now_ms() + timeout_ms;
        // Bounded by the deadline: each rejected frame only shortens the wait that is left.
        loop {
            if !self.net.is_up(self.rank) {
                return Err(TransportError::Closed);
            }
            let seen = self.bell.ticket();
            match self.rx.try_recv() {
                Ok(p) if p.intact() => return Ok(p.frame),
                Ok(_) => {
                    NetStats::bump(&self.net.stats.rejected);
                    self.net.note(self.rank, NetHappening::Rejected);
                    continue;
                }
                Err(TryRecvError::Disconnected) => return Err(TransportError::Closed),
                Err(TryRecvError::Empty) => {}
            }
            if clock.now_ms() >= deadline {
                return if self.net.is_up(self.rank) {
                    self.net.note(self.rank, NetHappening::TimedOut);
                    Err(TransportError::Timeout(timeout_ms))
                } else {
                    Err(TransportError::Closed)
                };
            }
            clock.sleep(&self.bell, seen, Some(deadline));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(step: u64, payload: &[u8]) -> Frame {
        Frame {
            epoch: 1,
            step,
            from: 0,
            tag: Tag {
                kind: TagKind::Gather,
                attempt: 0,
                unit: 3,
                pass: 0,
                piece: 0,
            },
            payload: bytes::Bytes::copy_from_slice(payload),
        }
    }

    #[test]
    fn damaged_frames_are_rejected_and_their_retransmissions_arrive_intact() {
        let net = LocalNetwork::with_faults(NetFaults {
            seed: 5,
            corrupt_per_mille: 500,
            drop_per_mille: 200,
            delay_max_ms: 2,
            retransmit_ms: 3,
            ..NetFaults::default()
        });
        let a = net.endpoint(0);
        let mut b = net.endpoint(1);
        for s in 0..200u64 {
            a.send(1, frame(s, &s.to_le_bytes())).unwrap();
        }
        let mut got: Vec<u64> = (0..200)
            .map(|_| b.recv_timeout(5_000).expect("every frame arrives").step)
            .collect();
        got.sort_unstable();
        assert_eq!(
            got,
            (0..200).collect::<Vec<_>>(),
            "each frame exactly once, intact"
        );
        let n = net.counts();
        assert!(n.corrupted > 50 && n.rejected == n.corrupted, "{n:?}");
        assert!(n.retransmitted >= n.corrupted, "{n:?}");
        assert!(matches!(
            b.recv_timeout(20),
            Err(TransportError::Timeout(20))
        ));
    }

    #[test]
    fn a_closed_network_stops_the_postman_and_wakes_receivers() {
        let net = LocalNetwork::with_faults(NetFaults {
            seed: 1,
            delay_max_ms: 1000,
            ..NetFaults::default()
        });
        let a = net.endpoint(0);
        let mut b = net.endpoint(1);
        a.send(1, frame(0, b"x")).unwrap();
        net.close();
        assert_eq!(b.recv_timeout(50).unwrap_err(), TransportError::Closed);
        assert_eq!(
            a.send(1, frame(1, b"y")),
            Err(TransportError::UnknownPeer(1))
        );
    }
}
