//! A bounded queue from async readers to a synchronous consumer. Readers wait for credit (in
//! KiB) before they queue a frame, so a consumer that falls behind stops the QUIC stream reads
//! and flow control pushes back on the sender; nothing grows without bound.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

/// Credit is counted in KiB so that one permit pool covers frames of any size.
const UNIT: usize = 1024;

pub(crate) struct Inbox<T> {
    state: Mutex<State<T>>,
    ready: Condvar,
    /// One credit pool per lane: bulk frames can never use up the credit control frames need.
    pools: [Semaphore; 2],
    pool_units: [usize; 2],
}

struct State<T> {
    items: VecDeque<(T, usize, u32)>,
    closed: bool,
}

/// Why a wait for an item ended without one.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PopError {
    Timeout,
    Closed,
}

impl<T> Inbox<T> {
    pub(crate) fn new(pool_bytes: [usize; 2]) -> Self {
        let units = pool_bytes.map(|b| (b / UNIT).max(1));
        Self {
            state: Mutex::new(State {
                items: VecDeque::new(),
                closed: false,
            }),
            ready: Condvar::new(),
            pools: units.map(Semaphore::new),
            pool_units: units,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `item` of `bytes` from `pool`, waiting for credit. Returns false if closed.
    pub(crate) async fn push(&self, pool: usize, bytes: usize, item: T) -> bool {
        // A frame larger than the whole pool takes the whole pool (the frame limit already
        // bounds it), so that it can still pass.
        let units = bytes.div_ceil(UNIT).clamp(1, self.pool_units[pool]) as u32;
        match self.pools[pool].acquire_many(units).await {
            Ok(p) => p.forget(),
            Err(_) => return false,
        }
        self.push_now(pool, units, item)
    }

    /// Queues without waiting for credit (items that must not block: local interrupts, events
    /// whose count is bounded by the caller).
    pub(crate) fn push_now(&self, pool: usize, units: u32, item: T) -> bool {
        let mut s = self.lock();
        if s.closed {
            return false;
        }
        s.items.push_back((item, pool, units));
        self.ready.notify_one();
        true
    }

    pub(crate) fn pop_timeout(&self, timeout: Duration) -> Result<T, PopError> {
        let deadline = Instant::now() + timeout;
        let mut s = self.lock();
        loop {
            if let Some((item, pool, units)) = s.items.pop_front() {
                drop(s);
                self.pools[pool].add_permits(units as usize);
                return Ok(item);
            }
            if s.closed {
                return Err(PopError::Closed);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(PopError::Timeout);
            }
            s = self
                .ready
                .wait_timeout(s, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.lock().items.len()
    }

    /// Wakes every waiter; later pushes are refused and pops fail once the queue is empty.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        for p in &self.pools {
            p.close();
        }
        self.ready.notify_all();
    }
}
