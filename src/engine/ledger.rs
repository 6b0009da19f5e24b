//! A rank's memory ledger: every buffer the rank allocates is recorded here by category, so that
//! what a rank holds can be compared with the ZeRO formulas and reported per step.
//!
//! It is an account, not an allocator: the runtime calls `alloc`/`free` where it creates and
//! drops buffers. Keeping it explicit makes the stage 3 working-set bound checkable.

use serde::{Deserialize, Serialize};

use crate::plan::memory::Resident;

/// What a buffer is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Category {
    /// Parameters held between steps (full copy for stages 0-2, the shard for stage 3).
    Params,
    /// Gradients held between steps (accumulator or reduced shard).
    Grads,
    /// Optimizer state (Adam m and v, SGD momentum).
    Optimizer,
    /// ZeRO-3 parameters gathered for the unit being computed (and prefetched ones).
    Gathered,
    /// Saved unit inputs (activation checkpoints) and loss gradients.
    Activations,
    /// Per-unit gradient accumulators and scratch freed within the step.
    Transient,
}

const CATEGORIES: usize = 6;

/// Bytes per category, current and the peak of the total.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ledger {
    current: [u64; CATEGORIES],
    peak_total: u64,
    peak_gathered: u64,
}

impl Ledger {
    pub fn alloc(&mut self, cat: Category, bytes: u64) {
        self.current[cat as usize] += bytes;
        self.peak_total = self.peak_total.max(self.total());
        if cat == Category::Gathered {
            self.peak_gathered = self.peak_gathered.max(self.current[cat as usize]);
        }
    }

    pub fn free(&mut self, cat: Category, bytes: u64) {
        let c = &mut self.current[cat as usize];
        debug_assert!(*c >= bytes, "ledger underflow in {cat:?}");
        *c = c.saturating_sub(bytes);
    }

    pub fn get(&self, cat: Category) -> u64 {
        self.current[cat as usize]
    }

    pub fn total(&self) -> u64 {
        self.current.iter().sum()
    }

    pub fn peak_total(&self) -> u64 {
        self.peak_total
    }

    pub fn peak_gathered(&self) -> u64 {
        self.peak_gathered
    }

    /// What is held between steps, in the memory model's categories.
    pub fn resident(&self) -> Resident {
        Resident {
            params: self.get(Category::Params),
            grads: self.get(Category::Grads),
            optimizer: self.get(Category::Optimizer),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracks_current_and_peak() {
        let mut l = Ledger::default();
        l.alloc(Category::Params, 100);
        l.alloc(Category::Gathered, 50);
        l.free(Category::Gathered, 50);
        l.alloc(Category::Gathered, 30);
        assert_eq!(l.total(), 130);
        assert_eq!(l.peak_total(), 150);
        assert_eq!(l.peak_gathered(), 50);
        assert_eq!(l.resident().params, 100);
    }
}
