//! The step's tier I/O beside its compute. With stage 3's parameters on the tier, the next
//! unit's shard is read on a helper thread while the current unit computes; with gradients on
//! the tier, a unit's reduced shard is written on a helper thread while the backward goes on.
//! At most one read and one write are in flight (a shard of each in RAM besides the step's
//! own buffers, which the planner counts), and every helper is joined before the step's optimizer touches the tier and
//! before the step returns, so no I/O outlives the step.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::offload;
use crate::runtime::storage::{TierError, TierFile};

type Read = JoinHandle<Result<Vec<f32>, TierError>>;

pub struct TierIo {
    tier: Arc<Mutex<TierFile>>,
    /// The unit whose parameter shard is being read, and the reader.
    read: Option<(usize, Read)>,
    write: Option<JoinHandle<Result<(), TierError>>>,
}

fn lock(t: &Mutex<TierFile>) -> std::sync::MutexGuard<'_, TierFile> {
    t.lock().unwrap_or_else(|p| p.into_inner())
}

/// A helper thread that died is an I/O failure of this rank, not a panic of the step.
fn join<T>(h: JoinHandle<Result<T, TierError>>) -> Result<T, TierError> {
    h.join()
        .unwrap_or_else(|_| Err(TierError::Helper("a tier I/O thread panicked".into())))
}

impl TierIo {
    pub fn new(tier: Arc<Mutex<TierFile>>) -> Self {
        Self {
            tier,
            read: None,
            write: None,
        }
    }

    /// Starts reading unit `u`'s parameter shard (`len` elements), unless a read is in flight.
    pub fn prefetch_params(&mut self, u: usize, len: usize) {
        if self.read.is_some() {
            return;
        }
        let tier = Arc::clone(&self.tier);
        let h = std::thread::Builder::new()
            .name("ezero-tier-read".into())
            .spawn(move || offload::read_unit_params(&mut lock(&tier), u, len));
        // Without a thread the shard is read when it is needed, as without prefetch.
        if let Ok(h) = h {
            self.read = Some((u, h));
        }
    }

    /// Unit `u`'s parameter shard: the prefetched one, or read now.
    pub fn params(&mut self, u: usize, len: usize) -> Result<Vec<f32>, TierError> {
        match self.read.take() {
            Some((p, h)) if p == u => return join(h),
            // A read of another unit is finished first: one reader of the file at a time.
            Some((_, h)) => drop(join(h)),
            None => {}
        }
        offload::read_unit_params(&mut lock(&self.tier), u, len)
    }

    /// Waits for the gradient write in flight, if any.
    pub fn wait_write(&mut self) -> Result<(), TierError> {
        match self.write.take() {
            Some(h) => join(h),
            None => Ok(()),
        }
    }

    /// Starts writing unit `u`'s mean gradient shard, after the previous write finishes
    /// (whose error, if any, is returned instead).
    pub fn write_grads(&mut self, u: usize, g: Vec<f32>) -> Result<(), TierError> {
        self.wait_write()?;
        let tier = Arc::clone(&self.tier);
        let h = std::thread::Builder::new()
            .name("ezero-tier-write".into())
            .spawn(move || offload::spill_grads(&mut lock(&tier), u, &g));
        match h {
            Ok(h) => {
                self.write = Some(h);
                Ok(())
            }
            Err(e) => Err(TierError::Helper(format!(
                "cannot start a tier I/O thread: {e}"
            ))),
        }
    }

    /// Waits for everything in flight; the first write error, if any (a read nobody asked
    /// for is dropped).
    pub fn finish(&mut self) -> Result<(), TierError> {
        if let Some((_, h)) = self.read.take() {
            drop(join(h));
        }
        self.wait_write()
    }
}

impl Drop for TierIo {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}
