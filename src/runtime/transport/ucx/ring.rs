//! The sending side of staged payloads: a ring of slots in this process's shared segment.
//!
//! A rank takes a free slot, writes a payload into it (encoding and checksumming it there, so
//! it is written once), and the engine sends each receiver a small notice naming the slot; a
//! receiver copies the payload out of its read-only mapping, checksumming it in cache, and
//! answers "freed". A slot is reused once every receiver freed it (or was lost). This replaces
//! UCX's rendezvous between processes on one host, whose receiver reads the sender's memory
//! through the kernel (CMA) and checks the CRC in a second pass.
//!
//! Sends never wait long: with no slot free within [`SLOT_WAIT`], the payload goes the other
//! way (UCX active messages), and until some slot is freed again the ring is not waited on.
//! Only peers that attached this segment (they said so, naming its nonce) are staged to.

use std::collections::BTreeSet;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::shm::Segment;

/// How long a send waits for a free slot before it goes the other way: a receiver draining
/// the ring frees a 4 MiB slot in well under this.
pub const SLOT_WAIT: Duration = Duration::from_millis(5);

/// A slot's bookkeeping.
#[derive(Debug, Default)]
struct Slot {
    /// Bumped each time the slot is taken: a "freed" for an older use is ignored.
    generation: u64,
    /// Receivers that have not freed it yet.
    holders: BTreeSet<u32>,
    /// Taken by a rank that has not handed it to the engine yet.
    writing: bool,
}

impl Slot {
    fn free(&self) -> bool {
        !self.writing && self.holders.is_empty()
    }
}

/// The slots' state.
#[derive(Debug, Default)]
pub struct Slots {
    slot: Vec<Slot>,
    /// Peers that attached this segment.
    ready: BTreeSet<u32>,
    /// A wait for a slot timed out and none was freed since: do not wait again.
    starved: bool,
}

impl Slots {
    pub fn new(n: usize) -> Self {
        Self {
            slot: (0..n).map(|_| Slot::default()).collect(),
            ..Self::default()
        }
    }

    /// Takes a free slot for `to` (all ready, none repeated): its index and generation.
    fn take(&mut self, to: &[u32]) -> Option<(usize, u64)> {
        if to.is_empty() || !to.iter().all(|p| self.ready.contains(p)) {
            return None;
        }
        let i = self.slot.iter().position(Slot::free)?;
        let s = &mut self.slot[i];
        s.generation += 1;
        s.writing = true;
        s.holders = to.iter().copied().collect();
        Some((i, s.generation))
    }

    /// Whether every slot is taken.
    fn full(&self) -> bool {
        !self.slot.iter().any(Slot::free)
    }

    /// The receivers holding slots.
    fn holders(&self) -> Vec<u32> {
        let all: BTreeSet<u32> = self
            .slot
            .iter()
            .flat_map(|s| s.holders.iter().copied())
            .collect();
        all.into_iter().collect()
    }

    /// The rank handed slot `i` to the engine (or gave up on it: `sent` false).
    fn written(&mut self, i: usize, sent: bool) -> bool {
        let s = &mut self.slot[i];
        s.writing = false;
        if !sent {
            s.holders.clear();
        }
        s.free()
    }

    /// `peer` freed slot `i` of `generation`; whether the slot became free.
    pub fn release(&mut self, i: usize, generation: u64, peer: u32) -> bool {
        match self.slot.get_mut(i) {
            Some(s) if s.generation == generation => s.holders.remove(&peer) && s.free(),
            _ => false,
        }
    }

    /// `peer` is gone (or will never read): what it held is freed.
    pub fn peer_lost(&mut self, peer: u32) -> bool {
        self.ready.remove(&peer);
        let mut any = false;
        for s in &mut self.slot {
            any |= s.holders.remove(&peer) && s.free();
        }
        any
    }

    /// `peer` attached the segment.
    pub fn peer_ready(&mut self, peer: u32) {
        self.ready.insert(peer);
    }

    /// Whether payloads to `peer` are staged.
    pub fn is_ready(&self, peer: u32) -> bool {
        self.ready.contains(&peer)
    }
}

/// The ring: the segment and its slots' state, shared by the ranks' threads and the engine's.
pub struct Ring {
    segment: Segment,
    slots: Mutex<Slots>,
    freed: Condvar,
}

/// A slot taken by a sender: written through [`Staged::bytes`], then handed to the engine or
/// dropped (which frees it).
pub struct Staged<'a> {
    ring: &'a Ring,
    pub slot: usize,
    pub generation: u64,
    len: usize,
    handed: bool,
}

impl Staged<'_> {
    /// The slot's first `len` bytes, this sender's alone until it is handed over.
    pub fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the slot is taken (`writing`) by this handle only, and no receiver was told
        // of it yet; `len` is within the slot (checked when taken).
        unsafe { std::slice::from_raw_parts_mut(self.ring.segment.slot(self.slot), self.len) }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The notices are queued: the slot is the receivers' until they free it.
    pub fn handed(mut self) {
        self.handed = true;
        self.ring.written(self.slot, true);
    }
}

impl Drop for Staged<'_> {
    fn drop(&mut self) {
        if !self.handed {
            self.ring.written(self.slot, false);
        }
    }
}

impl Ring {
    pub fn new(segment: Segment) -> Self {
        let n = segment.descriptor().slots as usize;
        Self {
            segment,
            slots: Mutex::new(Slots::new(n)),
            freed: Condvar::new(),
        }
    }

    pub fn segment(&self) -> &Segment {
        &self.segment
    }

    pub fn slot_bytes(&self) -> usize {
        self.segment.descriptor().slot_bytes as usize
    }

    pub fn lock(&self) -> MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A free slot for a `len`-byte payload to every one of `to`, waiting at most
    /// [`SLOT_WAIT`] (not at all while the ring is starved); `None`: send it the other way.
    /// Before it waits, `on_full` gets the receivers holding slots (to tell them).
    pub fn take(
        &self,
        to: &[u32],
        len: usize,
        on_full: impl FnOnce(Vec<u32>),
    ) -> Option<Staged<'_>> {
        if len > self.slot_bytes() {
            return None;
        }
        let mut st = self.lock();
        let deadline = Instant::now() + SLOT_WAIT;
        let mut on_full = Some(on_full);
        loop {
            if let Some((slot, generation)) = st.take(to) {
                return Some(Staged {
                    ring: self,
                    slot,
                    generation,
                    len,
                    handed: false,
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let ready = to.iter().all(|p| st.ready.contains(p));
            if st.starved || !ready || left.is_zero() {
                st.starved |= ready && left.is_zero();
                return None;
            }
            if st.full() {
                if let Some(tell) = on_full.take() {
                    // Not under the lock: the engine thread takes it to free slots.
                    let holders = st.holders();
                    drop(st);
                    tell(holders);
                    st = self.lock();
                    continue;
                }
            }
            st = self
                .freed
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn written(&self, slot: usize, sent: bool) {
        if self.lock().written(slot, sent) {
            self.freed.notify_all();
        }
    }

    /// Applies `f` to the slots' state; wakes waiting senders if it freed a slot.
    pub fn update(&self, f: impl FnOnce(&mut Slots) -> bool) {
        let mut st = self.lock();
        if f(&mut st) {
            st.starved = false;
            drop(st);
            self.freed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_reused_once_every_receiver_freed_it_or_was_lost() {
        let mut s = Slots::new(2);
        assert_eq!(s.take(&[1]), None, "no peer attached yet");
        s.peer_ready(1);
        s.peer_ready(2);
        assert_eq!(s.take(&[1, 3]), None, "peer 3 did not attach");
        let (a, ga) = s.take(&[1, 2]).unwrap();
        assert!(!s.full());
        let (b, gb) = s.take(&[1]).unwrap();
        assert_ne!(a, b);
        assert!(s.full());
        assert_eq!(s.holders(), vec![1, 2]);
        assert_eq!(s.take(&[1]), None, "both taken");
        // Not free while written, even if every receiver freed it (a stale or forged notice).
        assert!(!s.release(b, gb, 1));
        assert!(
            s.written(b, true),
            "freed before it was handed over: free once it is"
        );
        assert!(!s.written(a, true));
        assert!(!s.release(a, ga, 1));
        assert!(!s.release(a, ga + 1, 2), "another generation");
        assert!(!s.release(a, ga, 3), "not a holder");
        assert!(!s.release(a, ga, 1), "freed twice");
        assert!(s.release(a, ga, 2));
        let (c, gc) = s.take(&[2]).unwrap();
        assert_eq!((c, gc), (a, ga + 1));
        s.written(c, true);
        // A lost receiver frees what it held and is no longer staged to.
        assert!(s.peer_lost(2));
        assert_eq!(s.take(&[2]), None);
        // A slot given up before its notices went is free again.
        let (d, _) = s.take(&[1]).unwrap();
        assert!(s.written(d, false));
    }
}
