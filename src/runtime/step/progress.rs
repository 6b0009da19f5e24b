//! What a long run is doing between the events it reports: how far initialisation has got and
//! how many unit passes the ranks have finished. A model that takes minutes to build or to step
//! (state streamed from the tier) would otherwise go silent; the CLI polls these counters for
//! its progress line. The coordinator reads each rank's beat to tell a long step from a stuck
//! one (its step timeout measures silence, not length).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::plan::RankId;

#[derive(Debug, Default)]
pub struct RunProgress {
    /// Units the ranks have built so far while starting, over all ranks of the process.
    init_units_done: AtomicU64,
    /// Units there are to build while starting (0 until the ranks start building).
    init_units_total: AtomicU64,
    /// Forward and backward unit passes finished by the process's ranks since the start.
    unit_passes: AtomicU64,
    /// Each rank's latest work within a step.
    beats: Mutex<BTreeMap<RankId, Beat>>,
}

/// How far a rank has got within one step: units finished (forward, backward and optimizer)
/// in step `step` of epoch `epoch`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Beat {
    pub epoch: u64,
    pub step: u64,
    pub units: u64,
}

/// One reading of [`RunProgress`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProgressReading {
    pub init_units_done: u64,
    pub init_units_total: u64,
    pub unit_passes: u64,
}

impl RunProgress {
    pub fn init_started(&self, total_units: u64) {
        self.init_units_total.store(total_units, Ordering::Relaxed);
    }

    pub fn init_unit_built(&self) {
        self.init_units_done.fetch_add(1, Ordering::Relaxed);
    }

    /// A forward or backward unit pass of `rank` in (epoch, step) finished.
    pub fn unit_pass_done(&self, rank: RankId, epoch: u64, step: u64) {
        self.unit_passes.fetch_add(1, Ordering::Relaxed);
        self.beat(rank, epoch, step);
    }

    /// An optimizer unit of `rank` in (epoch, step) finished: progress for the coordinator,
    /// not a unit pass on the progress line.
    pub fn beat(&self, rank: RankId, epoch: u64, step: u64) {
        let mut beats = self.beats.lock().unwrap_or_else(|p| p.into_inner());
        let b = beats.entry(rank).or_default();
        if (b.epoch, b.step) != (epoch, step) {
            *b = Beat {
                epoch,
                step,
                units: 0,
            };
        }
        b.units += 1;
    }

    /// Every rank's latest beat.
    pub fn beats(&self) -> BTreeMap<RankId, Beat> {
        self.beats.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Forgets a rank that left, so the map stays as small as the world.
    pub fn forget(&self, rank: RankId) {
        self.beats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&rank);
    }

    pub fn read(&self) -> ProgressReading {
        ProgressReading {
            init_units_done: self.init_units_done.load(Ordering::Relaxed),
            init_units_total: self.init_units_total.load(Ordering::Relaxed),
            unit_passes: self.unit_passes.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_beat_counts_units_within_its_step_and_starts_over_at_the_next() {
        let p = RunProgress::default();
        p.unit_pass_done(0, 1, 5);
        p.unit_pass_done(0, 1, 5);
        p.beat(0, 1, 5);
        p.unit_pass_done(1, 1, 5);
        let b = p.beats();
        assert_eq!(
            b[&0],
            Beat {
                epoch: 1,
                step: 5,
                units: 3
            }
        );
        assert_eq!(b[&1].units, 1);
        p.unit_pass_done(0, 1, 6);
        assert_eq!(p.beats()[&0].units, 1);
        // The optimizer's beats are not unit passes on the progress line.
        assert_eq!(p.read().unit_passes, 4);
        p.forget(1);
        assert!(!p.beats().contains_key(&1));
    }
}
