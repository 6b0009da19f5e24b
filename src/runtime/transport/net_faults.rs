//! Seeded network misbehaviour for chaos runs of the in-process transport.
//!
//! Each endpoint draws the fate of every frame it sends from its own RNG stream (seed, rank), in
//! the order it sends them. A rank's sends follow its program order, so the same seed gives
//! every frame the same fate on every run, however the threads interleave.
//!
//! The faults model what a reliable, checksummed transport (QUIC with our wire codec) shows the
//! layers above it: a lost packet is retransmitted, so it arrives late; a damaged frame fails
//! its checksum, is rejected and counted, and the intact retransmission follows; links add
//! latency, and one slow rank adds it to everything it sends. A partition cuts the links between
//! two sides for a while; the transport keeps retrying, so what crosses the cut arrives when it
//! heals. A link that stays silent past the deadlines is not a network fault here: it is the loss
//! of a rank (`kill`), which the coordinator recovers from.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::model::rng::SplitMix64;
use crate::plan::RankId;
use crate::wire::frame::Tag;

/// What a chaos run does to frames. All rates are thousandths of frames; all zero (the default)
/// is a perfect network.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetFaults {
    pub seed: u64,
    /// Delivered twice.
    pub duplicate_per_mille: u32,
    /// Held back and delivered after the sender's next frame.
    pub reorder_per_mille: u32,
    /// First transmission lost: delivered `retransmit_ms` late.
    pub drop_per_mille: u32,
    /// Delivered with one flipped bit (rejected by the checksum), then intact `retransmit_ms`
    /// later.
    pub corrupt_per_mille: u32,
    /// Every frame is delayed by a uniform 0..=`delay_max_ms`.
    pub delay_max_ms: u64,
    /// How late a retransmission arrives.
    pub retransmit_ms: u64,
    /// A rank whose every frame is `slow_ms` late (a slow host or a congested link).
    pub slow_rank: Option<RankId>,
    pub slow_ms: u64,
    pub partition: Partition,
}

/// A network partition: `side` (a bitmask of ranks 0..64) against everyone else, over each
/// sender's frames numbered `from_frame .. from_frame + frames`. Counting a sender's own frames
/// rather than the clock keeps the cut at the same point of every rank's program on replay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Partition {
    pub side: u64,
    pub from_frame: u64,
    pub frames: u64,
    /// How long a frame across the cut waits for the link to heal.
    pub heal_ms: u64,
}

impl Partition {
    /// Ranks at or above 64 are ignored (the config refuses them).
    pub fn new(side: &[u32], from_frame: u64, frames: u64, heal_ms: u64) -> Self {
        Self {
            side: side.iter().filter(|&&r| r < 64).fold(0, |m, &r| m | 1 << r),
            from_frame,
            frames,
            heal_ms,
        }
    }

    fn on(&self) -> bool {
        self.side != 0 && self.frames > 0 && self.heal_ms > 0
    }

    /// Whether the `index`-th frame `from` sends to `to` crosses the cut while it is open.
    fn cuts(&self, from: RankId, to: RankId, index: u64) -> bool {
        let side = |r: RankId| r < 64 && self.side >> r & 1 == 1;
        self.on()
            && side(from) != side(to)
            && index >= self.from_frame
            && index - self.from_frame < self.frames
    }
}

impl NetFaults {
    /// Whether any fault is switched on.
    pub fn any(&self) -> bool {
        self.duplicate_per_mille
            + self.reorder_per_mille
            + self.drop_per_mille
            + self.corrupt_per_mille
            > 0
            || self.delay_max_ms > 0
            || (self.slow_rank.is_some() && self.slow_ms > 0)
            || self.partition.on()
    }

    /// Whether frames must carry a checksum (only when some will be damaged).
    pub fn checksums(&self) -> bool {
        self.corrupt_per_mille > 0
    }

    /// The fate of the `index`-th frame `from` sends (to `to`), drawn from its stream. Always
    /// draws the same number of values, so one fault's rate does not shift the others' draws.
    pub(crate) fn draw(&self, rng: &mut SplitMix64, from: RankId, to: RankId, index: u64) -> Fate {
        let mut roll = || rng.next_u64();
        let (dup, hold, drop, corrupt, delay, bit) =
            (roll(), roll(), roll(), roll(), roll(), roll());
        let per_mille = |r: u64, rate: u32| r % 1000 < rate as u64;
        let slow = if self.slow_rank == Some(from) {
            self.slow_ms
        } else {
            0
        };
        let cut = self.partition.cuts(from, to, index);
        let heal = if cut { self.partition.heal_ms } else { 0 };
        Fate {
            partitioned: cut,
            duplicate: per_mille(dup, self.duplicate_per_mille),
            hold: per_mille(hold, self.reorder_per_mille),
            lost_first: per_mille(drop, self.drop_per_mille),
            corrupt: per_mille(corrupt, self.corrupt_per_mille).then_some(bit),
            delay_ms: delay % (self.delay_max_ms + 1) + slow + heal,
        }
    }
}

/// What happens to one frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fate {
    /// Crossed an open partition (its delay includes the wait for the heal).
    pub partitioned: bool,
    pub duplicate: bool,
    pub hold: bool,
    pub lost_first: bool,
    /// Which bit to flip (modulo the frame's size), if the first copy is damaged.
    pub corrupt: Option<u64>,
    pub delay_ms: u64,
}

/// One thing the network did, at a time on its clock: what a replay compares. Ordered by time,
/// then rank, so a trace sorted after the run reads the same however the threads interleaved.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct NetEvent {
    pub at_ms: u64,
    /// The sender of a frame; the receiver of a rejection or a timeout; the rank lost.
    pub rank: RankId,
    pub what: NetHappening,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum NetHappening {
    /// The sender's `index`-th frame, to `to` in (`epoch`, `step`), met a fault: its first
    /// intact copy is due at `due_ms`.
    Faulted {
        to: RankId,
        index: u64,
        epoch: u64,
        step: u64,
        tag: Tag,
        due_ms: u64,
        faults: FaultSet,
    },
    /// A damaged copy failed its checksum at the receiver.
    Rejected,
    /// A receive's deadline passed with nothing for it.
    TimedOut,
    /// The rank was disconnected (lost, retired, or the run closed).
    Lost,
}

/// Which faults struck one frame.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct FaultSet {
    pub delayed: bool,
    pub retransmitted: bool,
    pub corrupted: bool,
    pub duplicated: bool,
    pub reordered: bool,
    pub partitioned: bool,
}

/// Where a network keeps its [`NetEvent`]s when asked to (chaos replays).
#[derive(Debug, Default)]
pub struct NetTrace(Mutex<Vec<NetEvent>>);

impl NetTrace {
    pub fn push(&self, e: NetEvent) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(e);
    }

    /// The events so far, in time order (then by rank and what happened).
    pub fn sorted(&self) -> Vec<NetEvent> {
        let mut v = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        v.sort();
        v
    }
}

/// Counts of what the network did, for reports and for tests that must see a fault happen.
#[derive(Debug, Default)]
pub struct NetStats {
    pub duplicated: AtomicU64,
    pub reordered: AtomicU64,
    pub retransmitted: AtomicU64,
    pub corrupted: AtomicU64,
    /// Frames a receiver rejected because their checksum failed (never applied).
    pub rejected: AtomicU64,
    pub delayed: AtomicU64,
    /// Frames that waited for a partition to heal.
    pub partitioned: AtomicU64,
}

/// A copy of [`NetStats`] at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct NetCounts {
    pub duplicated: u64,
    pub reordered: u64,
    pub retransmitted: u64,
    pub corrupted: u64,
    pub rejected: u64,
    pub delayed: u64,
    pub partitioned: u64,
}

impl NetStats {
    pub fn counts(&self) -> NetCounts {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        NetCounts {
            duplicated: get(&self.duplicated),
            reordered: get(&self.reordered),
            retransmitted: get(&self.retransmitted),
            corrupted: get(&self.corrupted),
            rejected: get(&self.rejected),
            delayed: get(&self.delayed),
            partitioned: get(&self.partitioned),
        }
    }

    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fates_follow_the_rates_and_replay_from_the_seed() {
        let f = NetFaults {
            seed: 7,
            drop_per_mille: 100,
            corrupt_per_mille: 50,
            delay_max_ms: 3,
            slow_rank: Some(2),
            slow_ms: 10,
            ..NetFaults::default()
        };
        let draw = |from| {
            let mut rng = SplitMix64::new(11);
            (0..10_000)
                .map(|i| f.draw(&mut rng, from, 0, i))
                .collect::<Vec<_>>()
        };
        let a = draw(1);
        assert_eq!(a, draw(1), "the same stream gives the same fates");
        let lost = a.iter().filter(|x| x.lost_first).count();
        let bad = a.iter().filter(|x| x.corrupt.is_some()).count();
        assert!((800..1200).contains(&lost), "{lost}");
        assert!((350..650).contains(&bad), "{bad}");
        assert!(a.iter().all(|x| x.delay_ms <= 3 && !x.duplicate && !x.hold));
        assert!(draw(2).iter().all(|x| (10..=13).contains(&x.delay_ms)));
        assert!(f.any() && f.checksums() && !NetFaults::default().any());
    }

    #[test]
    fn a_partition_delays_only_frames_across_the_cut_inside_its_window() {
        let f = NetFaults {
            partition: Partition::new(&[0, 2], 10, 5, 40),
            ..NetFaults::default()
        };
        assert!(f.any());
        let mut rng = SplitMix64::new(3);
        let mut fate = |from, to, i| f.draw(&mut rng, from, to, i);
        // Across the cut, inside the window: waits for the heal.
        for (from, to) in [(0, 1), (1, 0), (2, 3), (3, 2)] {
            for i in 10..15 {
                let x = fate(from, to, i);
                assert!(x.partitioned && x.delay_ms == 40, "{from}->{to} #{i}");
            }
        }
        // Same side, or outside the window: untouched.
        for (from, to, i) in [(0, 2, 12), (1, 3, 12), (0, 1, 9), (0, 1, 15)] {
            let x = fate(from, to, i);
            assert!(!x.partitioned && x.delay_ms == 0, "{from}->{to} #{i}");
        }
        assert!(!Partition::new(&[1], 0, 0, 40).on());
    }
}
