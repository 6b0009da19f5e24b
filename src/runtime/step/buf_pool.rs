//! Unit-sized f32 buffers recycled within a step: stage 3's gathered units, the shards read off
//! the tier for them and the gradient shards handed to the tier's helpers.
//!
//! A buffer this large is its own `mmap` in glibc, so a fresh one costs a page fault and a
//! zeroed page every 4 KiB and goes back to the kernel when dropped: 0.12 s for 200 MiB here
//! against 0.02 s to overwrite one already mapped, 44 gathers and as many tier reads a step for
//! a 20-layer model. A buffer taken from the pool holds stale values; its user overwrites all
//! of it.
//!
//! Bounded: at most [`BufPool::new`]'s `spares` freed buffers are kept, one is reused only for
//! a length it fits closely (within a quarter), so a large unit's buffer (the embeddings) does
//! not stand in for a small one, and a miss frees the largest kept buffer before it allocates,
//! so buffers that fit nothing do not stay beside the ones in use. The pool lives for one step;
//! what it keeps is freed when the step returns.

use std::collections::VecDeque;
use std::sync::Mutex;

pub struct BufPool {
    spare: Mutex<VecDeque<Vec<f32>>>,
    spares: usize,
}

impl BufPool {
    /// A pool that keeps at most `spares` freed buffers.
    pub fn new(spares: usize) -> Self {
        Self {
            spare: Mutex::new(VecDeque::new()),
            spares,
        }
    }

    /// A buffer of `len` elements with unspecified values: a kept one whose capacity is
    /// `len` to `len + len / 4`, or a fresh one.
    pub fn take(&self, len: usize) -> Vec<f32> {
        let reused = {
            let mut spare = self.lock();
            let fits = |v: &Vec<f32>| (len..=len + len / 4).contains(&v.capacity());
            let best = (0..spare.len())
                .filter(|&i| fits(&spare[i]))
                .min_by_key(|&i| spare[i].capacity());
            if best.is_none() {
                // A miss allocates: first free the largest kept buffer, which fits nothing asked
                // for lately, so that misses do not pile buffers up beside the ones in use.
                let largest = (0..spare.len()).max_by_key(|&i| spare[i].capacity());
                drop(largest.and_then(|i| spare.remove(i)));
            }
            best.and_then(|i| spare.remove(i))
        };
        match reused {
            Some(mut v) => {
                // Within the capacity: no new pages, and only the part past the old length is
                // written here.
                v.resize(len, 0.0);
                v
            }
            None => vec![0f32; len],
        }
    }

    /// Keeps `v` for a later [`BufPool::take`], dropping the oldest kept buffer past the bound.
    pub fn give(&self, v: Vec<f32>) {
        if self.spares == 0 || v.capacity() == 0 {
            return;
        }
        let mut spare = self.lock();
        spare.push_back(v);
        while spare.len() > self.spares {
            spare.pop_front();
        }
    }

    /// Buffers kept now.
    pub fn kept(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Vec<f32>>> {
        self.spare.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuses_a_close_fit_and_nothing_else() {
        let pool = BufPool::new(2);
        let mut a = pool.take(1000);
        a.iter_mut().for_each(|x| *x = 7.0);
        let ptr = a.as_ptr();
        pool.give(a);
        // Shorter by less than a quarter: the same allocation, stale values and all.
        let b = pool.take(900);
        assert_eq!((b.as_ptr(), b.len()), (ptr, 900));
        assert!(b.iter().all(|&x| x == 7.0));
        pool.give(b);
        // A much smaller length gets a fresh buffer, and the miss frees the large one.
        let c = pool.take(100);
        assert_eq!((c.len(), c.capacity()), (100, 100));
        assert_eq!(pool.kept(), 0);
        pool.give(c);
        // Longer than the capacity: fresh.
        let d = pool.take(101);
        assert_eq!((d.len(), d.capacity()), (101, 101));
        assert_eq!(pool.kept(), 0);
    }

    #[test]
    fn keeps_at_most_its_bound_newest_first() {
        let pool = BufPool::new(2);
        let bufs: Vec<Vec<f32>> = (0..4).map(|_| pool.take(64)).collect();
        let ptrs: Vec<*const f32> = bufs.iter().map(|b| b.as_ptr()).collect();
        bufs.into_iter().for_each(|b| pool.give(b));
        assert_eq!(pool.kept(), 2);
        let kept: Vec<Vec<f32>> = (0..2).map(|_| pool.take(64)).collect();
        assert!(
            kept.iter().all(|v| ptrs[2..].contains(&v.as_ptr())),
            "the two newest are kept"
        );
        assert_eq!(pool.kept(), 0);
        let none = BufPool::new(0);
        none.give(vec![0.0; 8]);
        assert_eq!(none.kept(), 0);
    }
}
