//! Receive credit: how many bytes of arrived messages this process holds that its consumer has
//! not given back yet (the engine's inbox, the plane's delivery, the rank's inbox), against a
//! budget.
//!
//! A rendezvous message is only announced when it arrives; its payload stays in the sender's
//! memory until the receiver fetches it. The engine thread fetches announced payloads in order
//! of arrival while the budget allows and leaves the rest waiting (UCX keeps the sender's
//! request open), so a rank that is busy computing does not collect an unbounded backlog.
//! The engine keeps progressing while it waits for credit: its own sends, eager messages and
//! failures are never held up by what its consumer has not taken yet (stopping progress
//! instead could deadlock two ranks that send to each other). An eager message (a few KiB) is
//! already in the engine's memory when it is seen, so it is counted but never refused.
//!
//! A payload larger than the whole budget still passes, alone: the frame limit bounds it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

pub(super) struct Credit {
    budget_bytes: usize,
    held_bytes: AtomicUsize,
    /// Set by the engine thread while a payload waits for credit: a consumer giving credit back
    /// then wakes it (otherwise it would notice only at its next idle poll).
    starved: AtomicBool,
}

impl Credit {
    pub(super) fn new(budget_bytes: usize) -> Self {
        Self {
            budget_bytes: budget_bytes.max(1),
            held_bytes: AtomicUsize::new(0),
            starved: AtomicBool::new(false),
        }
    }

    /// Takes `len` bytes if the budget allows them, or if nothing is held. Engine thread only
    /// (it alone adds, so a concurrent give can only make the check conservative).
    pub(super) fn try_take(&self, len: usize) -> bool {
        let held = self.held_bytes.load(Ordering::Acquire);
        if held == 0 || held + len <= self.budget_bytes {
            self.held_bytes.fetch_add(len, Ordering::AcqRel);
            true
        } else {
            false
        }
    }

    /// Takes `len` bytes whatever the budget: an eager message that has already arrived.
    pub(super) fn force(&self, len: usize) {
        self.held_bytes.fetch_add(len, Ordering::AcqRel);
    }

    /// Marks the engine thread as waiting for credit; it tries again after this (a give that
    /// came just before would not have woken it).
    pub(super) fn starve(&self) {
        self.starved.store(true, Ordering::Release);
    }

    /// Gives `len` bytes back; true if the engine thread waits for credit and must be woken.
    pub(super) fn give(&self, len: usize) -> bool {
        let before = self
            .held_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                Some(h.saturating_sub(len))
            })
            .unwrap_or(0);
        debug_assert!(before >= len, "credit given back twice ({len} of {before})");
        self.starved.swap(false, Ordering::AcqRel)
    }

    pub(super) fn held_bytes(&self) -> usize {
        self.held_bytes.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_holds_except_for_one_message_alone() {
        let c = Credit::new(100);
        assert!(c.try_take(60));
        assert!(c.try_take(40));
        assert!(!c.try_take(1), "at the budget");
        c.force(10);
        assert_eq!(c.held_bytes(), 110, "eager bytes count beyond it");
        c.starve();
        assert!(c.give(110), "a starved engine is woken");
        assert!(!c.give(0), "once");
        assert!(c.try_take(500), "larger than the budget, alone");
        assert!(!c.try_take(1));
        assert!(!c.give(500));
        assert_eq!(c.held_bytes(), 0);
    }
}
