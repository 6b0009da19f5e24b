//! The step's tier I/O beside its compute. With stage 3's parameters on the tier, the next
//! unit's shard is read on a helper thread while the current unit computes; with gradients on
//! the tier, a unit's reduced shard is written on a helper thread while the backward goes on.
//! Where the unit's optimizer update is owed to this forward (`owed.rs`), the read ahead is that
//! update, which yields the updated shard. Where the update runs in the backward
//! (`plan::tier::updates_in_backward`), the helper that would write a unit's gradient shard
//! runs its update instead, into the unit's other copy.
//! At most one read and one write are in flight (a shard of each in RAM besides the step's
//! own buffers, which the planner counts), or two updates where the update runs in the
//! backward, whose step waits for each reduce-scatter at once and so holds a single exact
//! accumulator, which leaves room for the second shard; every helper is joined before the
//! step's optimizer touches the tier and before the step returns, so no I/O outlives the step.
//! Helpers take the file through [`SharedTier`], which lets a parameter read go before updates
//! and gradient writes that have not started yet.

use crate::runtime::clock::Stopwatch;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::runtime::step::state::offload::{self, TierUpdater};
use crate::runtime::step::state::owed::{Owed, OwedStep};
use crate::runtime::step::state::tier_reads::read_ahead_for_optimizer;
use crate::runtime::storage::tier_file::beside_compute;
use crate::runtime::storage::{TierError, TierFile};

type Read = JoinHandle<Result<Vec<f32>, TierError>>;

pub struct TierIo {
    tier: SharedTier,
    owed: Option<Arc<Owed>>,
    in_backward: Option<Arc<TierUpdater>>,
    /// The unit whose parameter shard is being read, whether the read is its owed update, and
    /// the reader.
    read: Option<(usize, bool, Read)>,
    /// Gradient writes or updates in flight, oldest first.
    writes: VecDeque<JoinHandle<Result<(), TierError>>>,
    /// How many may be in flight ([`TierIo::allow_writes`]).
    max_writes: usize,
    /// Time the rank's thread waited for helpers, not yet added to the tier's
    /// `TierStats::wait_s`: that takes the file's lock, which a running update holds, so a
    /// join of a helper that has finished would wait for the next one too. Added when
    /// everything is joined ([`TierIo::finish`]).
    waited_s: f64,
}

/// The rank's tier file as the step's helpers share it. The backward waits on the read of the
/// unit it differentiates next, while an update only has to finish within the step, and with
/// one rank two of them may be queued: a read behind them held up the compute for two updates
/// (0.7 s each at 1B parameters) while nothing waited on them. So a read counts itself while
/// it waits for the file ([`SharedTier::for_read`]), and updates and gradient writes start only
/// when no read waits ([`SharedTier::after_reads`]). At most one read is in flight (and the
/// rank's own when it has none), so that wait ends.
#[derive(Clone)]
struct SharedTier {
    file: Arc<Mutex<TierFile>>,
    reads_waiting: Arc<AtomicUsize>,
}

impl SharedTier {
    fn new(file: Arc<Mutex<TierFile>>) -> Self {
        Self {
            file,
            reads_waiting: Arc::default(),
        }
    }

    /// The file, for a read the step's compute will wait on.
    fn for_read(&self) -> MutexGuard<'_, TierFile> {
        self.reads_waiting.fetch_add(1, Ordering::AcqRel);
        let g = self.lock();
        self.reads_waiting.fetch_sub(1, Ordering::AcqRel);
        g
    }

    /// The file, for an update or a gradient write: after any read waiting for it.
    fn after_reads(&self) -> MutexGuard<'_, TierFile> {
        while self.reads_waiting.load(Ordering::Acquire) > 0 {
            std::thread::sleep(READ_FIRST_POLL);
        }
        self.lock()
    }

    /// The file, in turn with whoever else wants it.
    fn lock(&self) -> MutexGuard<'_, TierFile> {
        self.file.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// How often an update waiting for reads to go first looks again (a read takes 0.1 s or more).
const READ_FIRST_POLL: std::time::Duration = std::time::Duration::from_micros(200);

/// Unit `u`'s parameter shard: read, or made by running its owed update.
fn load(
    tier: &SharedTier,
    owed: Option<(&Owed, OwedStep)>,
    u: usize,
    len: usize,
) -> Result<Vec<f32>, TierError> {
    let mut t = tier.for_read();
    match owed {
        Some((o, step)) => {
            let mut out = vec![0f32; len];
            o.apply(&mut t, u, step, &mut out)?;
            Ok(out)
        }
        None => offload::read_unit_params(&mut t, u, len),
    }
}

/// Waits for a helper, adding the wait to `waited_s`. A helper thread that died is an I/O
/// failure of this rank, not a panic of the step.
fn join<T>(waited_s: &mut f64, h: JoinHandle<Result<T, TierError>>) -> Result<T, TierError> {
    let t0 = Stopwatch::start();
    let out = h
        .join()
        .unwrap_or_else(|_| Err(TierError::Helper("a tier I/O thread panicked".into())));
    *waited_s += t0.elapsed().as_secs_f64();
    out
}

impl TierIo {
    pub fn new(
        tier: Arc<Mutex<TierFile>>,
        owed: Option<Arc<Owed>>,
        in_backward: Option<Arc<TierUpdater>>,
    ) -> Self {
        Self {
            tier: SharedTier::new(tier),
            owed,
            in_backward,
            read: None,
            writes: VecDeque::new(),
            max_writes: 1,
            waited_s: 0.0,
        }
    }

    /// Unit `u`'s owed update, taken to be run now.
    fn take_owed(&self, u: usize) -> Option<OwedStep> {
        self.owed.as_ref().and_then(|o| o.take(u))
    }

    /// Puts back an update [`TierIo::take_owed`] took for a helper that did not start.
    fn give_back(&self, u: usize, step: Option<OwedStep>) {
        if let (Some(o), Some(step)) = (&self.owed, step) {
            o.give_back(u, step);
        }
    }

    /// Starts reading unit `u`'s parameter shard (`len` elements), unless a read is in flight.
    pub fn prefetch_params(&mut self, u: usize, len: usize) {
        if self.read.is_some() {
            return;
        }
        let (tier, owed) = (self.tier.clone(), self.owed.clone());
        let step = self.take_owed(u);
        let h = std::thread::Builder::new()
            .name("ezero-tier-read".into())
            .spawn(move || {
                beside_compute(|| {
                    let t0 = Stopwatch::start();
                    let res = load(&tier, owed.as_deref().zip(step), u, len);
                    let ms = t0.elapsed().as_secs_f64() * 1e3;
                    tracing::trace!(unit = u, ms, "read ahead");
                    res
                })
            });
        match h {
            Ok(h) => self.read = Some((u, step.is_some(), h)),
            // Without a thread the shard is read (and the update run) when it is needed, as
            // without prefetch.
            Err(_) => self.give_back(u, step),
        }
    }

    /// Whether unit `u`'s shard is being read ahead and the read has not finished.
    pub fn reading(&self, u: usize) -> bool {
        matches!(&self.read, Some((p, _, h)) if *p == u && !h.is_finished())
    }

    /// Finishes the read in flight of a unit other than the one wanted: a plain read nobody
    /// asks for any more is dropped, but a failed update left the unit's state half written,
    /// which must stop the step.
    fn drop_read(&mut self) -> Result<(), TierError> {
        match self.read.take() {
            Some((_, true, h)) => join(&mut self.waited_s, h).map(drop),
            Some((_, false, h)) => {
                drop(join(&mut self.waited_s, h));
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Unit `u`'s parameter shard: the prefetched one, or read now.
    pub fn params(&mut self, u: usize, len: usize) -> Result<Vec<f32>, TierError> {
        if let Some((_, _, h)) = self.read.take_if(|(p, _, _)| *p == u) {
            return join(&mut self.waited_s, h);
        }
        // A read of another unit is finished first: one reader of the file at a time.
        self.drop_read()?;
        let step = self.take_owed(u);
        load(&self.tier, self.owed.as_deref().zip(step), u, len)
    }

    /// Lets `n` gradient writes or updates be in flight (at least one): with a second queued
    /// behind the running one, the disk does not wait for the rank's thread between them.
    pub fn allow_writes(&mut self, n: usize) {
        self.max_writes = n.max(1);
    }

    /// Waits for the oldest writes or updates until another may start; the first error.
    pub fn make_room(&mut self) -> Result<(), TierError> {
        self.join_writes(self.max_writes - 1)
    }

    /// Waits for the oldest writes or updates until `keep` are left in flight; the first error.
    fn join_writes(&mut self, keep: usize) -> Result<(), TierError> {
        let mut res = Ok(());
        while self.writes.len() > keep {
            let h = self
                .writes
                .pop_front()
                .expect("the queue is longer than keep");
            res = res.and(join(&mut self.waited_s, h));
        }
        res
    }

    /// Starts writing unit `u`'s mean gradient shard, once there is room ([`TierIo::make_room`])
    /// (whose error, if any, is returned instead).
    pub fn write_grads(&mut self, u: usize, g: Vec<f32>) -> Result<(), TierError> {
        self.make_room()?;
        let (tier, owed) = (self.tier.clone(), self.owed.clone());
        // An update still owed reads the gradient about to be overwritten: it runs first.
        let step = self.take_owed(u);
        let h = std::thread::Builder::new()
            .name("ezero-tier-write".into())
            .spawn(move || {
                beside_compute(|| {
                    let mut t = tier.after_reads();
                    let owes = owed.is_some();
                    if let (Some(o), Some(step)) = (owed, step) {
                        o.apply(&mut t, u, step, &mut [])?;
                    }
                    offload::spill_grads(&mut t, u, &g)?;
                    if !owes {
                        // The optimizer phase reads this unit's records next: its gradient is
                        // there now, and the disk is otherwise idle until the phase.
                        let recs = t.layout.unit_records(u);
                        read_ahead_for_optimizer(&mut t, recs)?;
                    }
                    Ok(())
                })
            });
        match h {
            Ok(h) => {
                self.writes.push_back(h);
                Ok(())
            }
            Err(e) => {
                self.give_back(u, step);
                Err(TierError::Helper(format!(
                    "cannot start a tier I/O thread: {e}"
                )))
            }
        }
    }

    /// Starts unit `u`'s update from its mean gradient shard `g` (and its parameter shard, if
    /// the step kept it) with Adam's `t` and learning rate `lr`, into the unit's other copy,
    /// once there is room ([`TierIo::make_room`]) (whose error, if any, is returned instead).
    pub fn update_in_backward(
        &mut self,
        u: usize,
        (g, params): (Vec<f32>, Option<Vec<f32>>),
        t: u64,
        lr: f32,
    ) -> Result<(), TierError> {
        self.make_room()?;
        let tier = self.tier.clone();
        let updater = self.in_backward.clone().ok_or_else(|| {
            TierError::Helper("this rank's updates do not run in the backward".into())
        })?;
        let h = std::thread::Builder::new()
            .name("ezero-tier-update".into())
            .spawn(move || {
                beside_compute(|| {
                    let t0 = Stopwatch::start();
                    let mut tier = tier.after_reads();
                    let locked_ms = t0.elapsed().as_secs_f64() * 1e3;
                    let params = params.as_deref().unwrap_or(&[]);
                    let res = updater.update_into_next(&mut tier, u, t, lr, &g, params);
                    let ms = t0.elapsed().as_secs_f64() * 1e3;
                    tracing::trace!(unit = u, locked_ms, ms, "update in the backward");
                    res
                })
            })
            .map_err(|e| TierError::Helper(format!("cannot start a tier I/O thread: {e}")))?;
        self.writes.push_back(h);
        Ok(())
    }

    /// Waits for everything in flight; the first write error, if any (a read nobody asked
    /// for is dropped).
    pub fn finish(&mut self) -> Result<(), TierError> {
        let read = self.drop_read();
        let res = self.join_writes(0).and(read);
        let waited = std::mem::take(&mut self.waited_s);
        if waited > 0.0 {
            self.tier.lock().add_wait(waited);
        }
        res
    }
}

impl Drop for TierIo {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    use super::*;
    use crate::runtime::storage::device::MemDevice;
    use crate::runtime::storage::{RecordKinds, TierLayout};

    fn tier() -> Arc<Mutex<TierFile>> {
        let kinds = RecordKinds {
            params: true,
            state: 2,
            grads: 1,
        };
        let layout = TierLayout::new(vec![4096, 4096], 1024, kinds);
        let file = TierFile::create(Path::new("mem"), Box::new(MemDevice::new()), layout, 4)
            .expect("a tier file in memory");
        Arc::new(Mutex::new(file))
    }

    #[test]
    fn taking_a_finished_helper_needs_no_file_lock() {
        let t = tier();
        let mut io = TierIo::new(Arc::clone(&t), None, None);
        io.write_grads(0, vec![0.5; 4096])
            .expect("the write starts");
        while !io.writes.front().is_some_and(JoinHandle::is_finished) {
            std::thread::yield_now();
        }
        // Another thread holds the file, as a running update would; making room takes the
        // finished write without it. (Before, the join took the lock and waited here.)
        let held = t.lock().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            s.spawn(move || tx.send(io.make_room()).expect("the test waits"));
            // A liveness bound, not a speed one: a regression would wait forever.
            let got = rx.recv_timeout(Duration::from_secs(60));
            drop(held);
            let res = got.expect("making room waited for the file's lock");
            assert!(res.is_ok(), "{res:?}");
        });
        assert_eq!(t.lock().unwrap().stats.write_bytes, 4 * 4096);
    }

    #[test]
    fn updates_and_gradient_writes_start_after_a_waiting_read() {
        let t = SharedTier::new(tier());
        t.reads_waiting.store(1, Ordering::Release);
        let started = AtomicBool::new(false);
        std::thread::scope(|s| {
            let w = s.spawn(|| {
                let _file = t.after_reads();
                started.store(true, Ordering::Release);
            });
            // However long it is given, it does not start while the read waits.
            std::thread::sleep(Duration::from_millis(50));
            assert!(!started.load(Ordering::Acquire));
            t.reads_waiting.store(0, Ordering::Release);
            w.join().expect("the writer");
        });
        assert!(started.load(Ordering::Acquire));
        // A read does not wait for updates queued behind it, and counts itself only while it
        // waits.
        let r = t.for_read();
        assert_eq!(t.reads_waiting.load(Ordering::Acquire), 0);
        drop(r);
    }
}
