//! What a long run is doing between the events it reports: how far initialisation has got and
//! how many unit passes the ranks have finished. A model that takes minutes to build or to step
//! (state streamed from the tier) would otherwise go silent; the CLI polls these counters for
//! its progress line. Counters only: nothing here changes what the run does.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct RunProgress {
    /// Units the ranks have built so far while starting, over all ranks of the process.
    init_units_done: AtomicU64,
    /// Units there are to build while starting (0 until the ranks start building).
    init_units_total: AtomicU64,
    /// Forward and backward unit passes finished by the process's ranks since the start.
    unit_passes: AtomicU64,
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

    pub fn unit_pass_done(&self) {
        self.unit_passes.fetch_add(1, Ordering::Relaxed);
    }

    pub fn read(&self) -> ProgressReading {
        ProgressReading {
            init_units_done: self.init_units_done.load(Ordering::Relaxed),
            init_units_total: self.init_units_total.load(Ordering::Relaxed),
            unit_passes: self.unit_passes.load(Ordering::Relaxed),
        }
    }
}
