//! The one injected clock. Engines take the time as an argument; the runtime reads it here, so a
//! simulation can substitute its own.

use std::time::Instant;

pub trait Clock: Send + Sync + 'static {
    /// Milliseconds since an arbitrary fixed origin; never decreases.
    fn now_ms(&self) -> u64;
}

/// Wall-clock time since construction.
pub struct SystemClock {
    origin: Instant,
}

impl Default for SystemClock {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
        }
    }
}

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }
}
