//! The plane's side of the loans (memory a rank lends for the frames it expects): the current
//! batch, how many of its loans are still open, and the frames that landed in one until the
//! rank claims them. The engine's side, matching messages to loans, is `lent`.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use crate::plan::RankId;
use crate::runtime::transport::{Frame, Tag};

/// How long ending a batch of loans waits for the receives already matched. They complete or
/// fail within UCX's keepalive (1 s) even when the sender dies; past this the engine is broken,
/// and the process stops rather than hand back memory the engine may still write.
pub(super) const LOANS_DRAIN_MAX: Duration = Duration::from_secs(60);

/// Buffers lent for frames the rank expects: one batch at a time, the rank's current one.
#[derive(Default)]
pub(super) struct Lending {
    pub(super) state: Mutex<LendState>,
    pub(super) settled: Condvar,
}

#[derive(Default)]
pub(super) struct LendState {
    pub(super) batch: u64,
    /// Loans of the batch opened so far, and those not yet placed, failed or withdrawn.
    pub(super) opened: usize,
    pub(super) open: usize,
    /// Loans were made since the engine was last told to stop keeping messages for them.
    pub(super) engine_waits: bool,
    /// Frames whose payload landed in a loan and passed every check, until the rank claims
    /// them: (from, epoch, step, tag) → batch.
    pub(super) placed: HashMap<(RankId, u64, u64, Tag), u64>,
}

impl Lending {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, LendState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One loan of `batch` is settled: placed as the frame `placed` names (kept for the rank to
    /// claim), or failed.
    pub(super) fn settle(&self, batch: u64, placed: Option<&Frame>) {
        let mut st = self.lock();
        if let Some(f) = placed {
            st.placed.insert((f.from, f.epoch, f.step, f.tag), batch);
        }
        if st.batch == batch {
            st.open = st.open.saturating_sub(1);
            self.settled.notify_all();
        }
    }
}
