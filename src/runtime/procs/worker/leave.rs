//! A worker given notice: the first SIGTERM (a pod eviction, a spot preemption) asks the
//! coordinator to drain this rank at the next step boundary; a second one, or a grace that runs
//! out first, ends the process at once, and the job recovers the rank from its buddy backups as
//! it would after `kill -9`.

use std::time::Duration;

use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::time::Instant;

use crate::runtime::procs::error::ProcError;

/// What a signal made of the worker's course.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum LeaveEvent {
    /// The first SIGTERM: ask to be drained.
    Notice,
    /// Leave now, for this reason.
    Abrupt(String),
}

/// The SIGTERM handler of a running rank, and its grace once notice came.
pub(super) struct Leaving {
    term: Signal,
    grace: Duration,
    noticed: Option<Instant>,
}

impl Leaving {
    /// Takes over SIGTERM for this process (its default action, death, would take the abrupt
    /// path at once).
    pub fn install(grace: Duration) -> Result<Self, ProcError> {
        let term = signal(SignalKind::terminate())
            .map_err(|e| ProcError::Setup(format!("cannot install the SIGTERM handler: {e}")))?;
        Ok(Self {
            term,
            grace,
            noticed: None,
        })
    }

    pub fn grace(&self) -> Duration {
        self.grace
    }

    /// Time since the notice, if one came.
    pub fn since_notice(&self) -> Option<Duration> {
        self.noticed.map(|t| t.elapsed())
    }

    /// The next signal event; pending while none comes.
    pub async fn next(&mut self) -> LeaveEvent {
        let grace_end = self.noticed.map(|t| t + self.grace);
        tokio::select! {
            _ = self.term.recv() => {
                if self.noticed.is_some() {
                    return LeaveEvent::Abrupt("a second SIGTERM".into());
                }
                self.noticed = Some(Instant::now());
                LeaveEvent::Notice
            }
            _ = tokio::time::sleep_until(grace_end.unwrap_or_else(Instant::now)), if grace_end.is_some() => {
                LeaveEvent::Abrupt(format!(
                    "no step boundary within the drain grace of {} s (--drain-grace-s)",
                    self.grace.as_secs_f64()
                ))
            }
        }
    }
}
