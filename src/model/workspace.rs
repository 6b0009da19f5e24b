//! Reused scratch memory for the models' intermediates.
//!
//! A block's backward needs a dozen activation-sized buffers. Allocating them fresh per op
//! cost ~10% of a step in zero-filling and page faults (glibc hands large blocks back to the OS,
//! and rank compute threads are short-lived). Instead every model call takes one arena from a
//! small process-wide pool, carves its buffers out of it, and puts it back.
//!
//! The arena is **not** cleared between uses, so every carved buffer must be fully written
//! before it is read; [`tests::stale_scratch_does_not_leak`] in `gpt.rs` runs the model on a
//! NaN-poisoned pool and checks that the bits do not change. Results therefore do not depend on
//! which arena a call gets or on what it held before.

use std::sync::Mutex;

/// Arenas kept for reuse; more concurrent callers than this allocate and drop their own. With
/// kept activations every block of every local micro-batch holds one arena from its forward
/// to its backward, so the pool must cover layers × micro-batches × ranks in this process plus
/// a few per computing rank (SmolLM2's 30 layers at 2 ranks overflowed 64, and every step
/// page-faulted ~2 GB of arenas afresh); it only ever holds as many as were live at once.
const POOL_MAX: usize = 1024;

static POOL: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());

/// One arena, returned to the pool on drop.
pub struct Scratch {
    buf: Vec<f32>,
}

impl Scratch {
    /// Takes an arena from the pool (or a new, empty one).
    pub fn take() -> Self {
        let buf = POOL
            .lock()
            .map(|mut pool| pool.pop())
            .ok()
            .flatten()
            .unwrap_or_default();
        Self { buf }
    }

    /// Elements the arena holds now.
    pub fn elems(&self) -> usize {
        self.buf.len()
    }

    /// `N` disjoint buffers of the given lengths, with unspecified contents.
    pub fn carve<const N: usize>(&mut self, lens: [usize; N]) -> [&mut [f32]; N] {
        let total: usize = lens.iter().sum();
        if self.buf.len() < total {
            // Growing zero-fills only the new part; it happens on the first calls only.
            self.buf.resize(total, 0.0);
        }
        carve(&mut self.buf, lens)
    }
}

/// `N` disjoint consecutive pieces of `buf` of the given lengths.
///
/// # Panics
/// If `buf` is shorter than their sum.
pub fn carve<const N: usize>(buf: &mut [f32], lens: [usize; N]) -> [&mut [f32]; N] {
    let total: usize = lens.iter().sum();
    let mut rest = &mut buf[..total];
    std::array::from_fn(|i| {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(lens[i]);
        rest = tail;
        head
    })
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        if let Ok(mut pool) = POOL.lock() {
            if pool.len() < POOL_MAX {
                pool.push(buf);
            }
        }
    }
}

/// Test hook: fills every pooled arena with `value` (to prove stale contents never leak).
#[cfg(test)]
pub fn poison_pool(value: f32) {
    let mut pool = POOL.lock().expect("pool lock");
    for buf in pool.iter_mut() {
        buf.fill(value);
    }
}
