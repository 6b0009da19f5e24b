//! `--meta memory`: the store in this process's memory. Clones of one `Arc<MemoryStore>` behave
//! as one real election: campaigns lead in the order they began, one at a time, and a
//! leadership ends when resigned, dropped or stalled. Nothing here waits on time.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{watch, Notify};

use super::{check_job, Candidate, Hold, Leader, Leadership, MetaError, MetaFuture, MetaStore};

pub struct MemoryStore {
    job: String,
    shared: Arc<Shared>,
}

struct Shared {
    inner: Mutex<Inner>,
    /// Rung whenever the leader or the queue changes, for the campaigns that wait.
    changed: Notify,
}

#[derive(Default)]
struct Inner {
    /// The registered config digest and build.
    job: Option<(String, String)>,
    /// The last term handed out.
    term: u64,
    leader: Option<Held>,
    /// Tickets of the campaigns waiting, lowest first.
    queue: BTreeSet<u64>,
    next_ticket: u64,
    state: Option<Vec<u8>>,
}

struct Held {
    candidate: Candidate,
    term: u64,
    lost: watch::Sender<bool>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding it leaves plain data behind, still consistent.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends the leadership of `term`, if it still leads, and lets the next campaign lead.
    fn release(&self, term: u64) {
        let mut st = self.lock();
        if st.leader.as_ref().is_some_and(|h| h.term == term) {
            if let Some(held) = st.leader.take() {
                held.lost.send_replace(true);
            }
            drop(st);
            self.changed.notify_waiters();
        }
    }
}

impl MemoryStore {
    pub fn new(job: &str) -> Self {
        Self {
            job: job.to_string(),
            shared: Arc::new(Shared {
                inner: Mutex::default(),
                changed: Notify::new(),
            }),
        }
    }

    /// Leads now if the queue's head is `ticket` and nobody leads.
    fn try_lead(&self, ticket: u64, me: &Candidate) -> Option<Leadership> {
        let mut st = self.shared.lock();
        if st.leader.is_some() || st.queue.first() != Some(&ticket) {
            return None;
        }
        st.queue.remove(&ticket);
        st.term += 1;
        let term = st.term;
        let (tx, rx) = watch::channel(false);
        st.leader = Some(Held {
            candidate: me.clone(),
            term,
            lost: tx,
        });
        let hold = MemoryHold {
            shared: Arc::clone(&self.shared),
            term,
        };
        Some(Leadership::new(term, rx, Box::new(hold)))
    }

    async fn campaign_inner(&self, me: &Candidate) -> Leadership {
        let ticket = {
            let mut st = self.shared.lock();
            st.next_ticket += 1;
            let t = st.next_ticket;
            st.queue.insert(t);
            t
        };
        let _queued = Queued {
            shared: &self.shared,
            ticket,
        };
        loop {
            // Registered before looking, so that a release between the look and the wait
            // still wakes this campaign.
            let notified = self.shared.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(l) = self.try_lead(ticket, me) {
                return l;
            }
            notified.await;
        }
    }
}

/// A campaign's place in the queue; a campaign dropped before it leads gives its place up.
struct Queued<'a> {
    shared: &'a Shared,
    ticket: u64,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        let removed = self.shared.lock().queue.remove(&self.ticket);
        if removed {
            self.shared.changed.notify_waiters();
        }
    }
}

struct MemoryHold {
    shared: Arc<Shared>,
    term: u64,
}

impl Hold for MemoryHold {
    fn stall(&self) {
        self.shared.release(self.term);
    }
}

impl Drop for MemoryHold {
    fn drop(&mut self) {
        self.shared.release(self.term);
    }
}

impl MetaStore for MemoryStore {
    fn open_job<'a>(
        &'a self,
        digest: &'a str,
        build: &'a str,
    ) -> MetaFuture<'a, Result<(), MetaError>> {
        Box::pin(async move {
            let mut st = self.shared.lock();
            let (found_digest, found_build) = st
                .job
                .get_or_insert_with(|| (digest.to_string(), build.to_string()));
            check_job(&self.job, (found_digest, found_build), digest, build)
        })
    }

    fn campaign<'a>(
        &'a self,
        me: &'a Candidate,
        _ttl: Duration,
    ) -> MetaFuture<'a, Result<Leadership, MetaError>> {
        Box::pin(async move { Ok(self.campaign_inner(me).await) })
    }

    fn leader(&self) -> MetaFuture<'_, Result<Option<Leader>, MetaError>> {
        Box::pin(async move {
            let st = self.shared.lock();
            Ok(st.leader.as_ref().map(|h| Leader {
                candidate: h.candidate.clone(),
                term: h.term,
            }))
        })
    }

    fn commit<'a>(&'a self, term: u64, state: &'a [u8]) -> MetaFuture<'a, Result<(), MetaError>> {
        Box::pin(async move {
            let mut st = self.shared.lock();
            let current = st.leader.as_ref().map(|h| h.term);
            if current != Some(term) {
                return Err(MetaError::Deposed { term, current });
            }
            st.state = Some(state.to_vec());
            Ok(())
        })
    }

    fn load(&self) -> MetaFuture<'_, Result<Option<Vec<u8>>, MetaError>> {
        Box::pin(async move { Ok(self.shared.lock().state.clone()) })
    }

    fn resign(&self, term: u64) -> MetaFuture<'_, Result<(), MetaError>> {
        Box::pin(async move {
            self.shared.release(term);
            Ok(())
        })
    }
}
