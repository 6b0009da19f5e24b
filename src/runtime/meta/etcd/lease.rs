//! One campaign's lease: granted, kept alive by a task that also times it out on this process's
//! clock, and given back when the campaign or its leadership ends.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::watch;

use super::client::{Client, KeepAlive};
use super::proto::v3electionpb::LeaderKey;
use super::{EtcdLease, EtcdStore};
use crate::runtime::clock::Clock;
use crate::runtime::meta::{Candidate, Hold, Leadership, MetaError};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// How often the keeper renews: a third of the TTL, so that one lost renewal still leaves time
/// for the next.
fn period(ttl_ms: u64) -> Duration {
    Duration::from_millis((ttl_ms / 3).max(50))
}

impl EtcdStore {
    pub(super) async fn campaign_inner(
        &self,
        me: &Candidate,
        ttl: Duration,
    ) -> Result<Leadership, MetaError> {
        let value = serde_json::to_vec(me).expect("a candidate serializes");
        let (lease, ttl_ms) = self.grant(ttl).await?;
        // Until it leads, dropping the campaign gives the lease back.
        let mut pending = Pending {
            lease: Some(Arc::clone(&lease)),
            client: self.client.clone(),
        };
        let mut lost = lease.lost.subscribe();
        let resp = tokio::select! {
            r = self.campaign_tries(value, lease.id) => r?,
            _ = lost.wait_for(|l| *l) => {
                let detail = format!("the campaign's lease lapsed: no keepalive was acknowledged within its {ttl_ms} ms");
                return Err(self.unreachable(detail));
            }
        };
        let Some(key) = resp else {
            let detail = "etcd's campaign answer names no leader key".to_string();
            return Err(MetaError::Corrupt { detail });
        };
        let term = key.rev as u64;
        *lock(&lease.key) = key.key;
        lock(&self.held).insert(term, Arc::clone(&lease));
        pending.lease = None;
        let hold = EtcdHold {
            held: Arc::clone(&self.held),
            term,
            lease: Arc::clone(&lease),
            client: self.client.clone(),
        };
        Ok(Leadership::new(
            term,
            lease.lost.subscribe(),
            Box::new(hold),
        ))
    }

    /// etcd's campaign for the election key of `lease`, made again while it could not reach a
    /// member. Making it again is safe: the key is named by the lease, and etcd resumes a
    /// campaign whose key exists. Not bounded by a request timeout: a campaign waits for its
    /// turn; the lease watch in the caller bounds it.
    async fn campaign_tries(
        &self,
        value: Vec<u8>,
        lease: i64,
    ) -> Result<Option<LeaderKey>, MetaError> {
        let name = self.key("election");
        self.retried(|c| {
            let (name, value) = (name.clone(), value.clone());
            async move { c.campaign(name.as_bytes(), &value, lease).await }
        })
        .await
        .map_err(|e| self.unreachable(e))
    }

    /// A lease of `ttl` (whole seconds, at least 1, for etcd) with its keeper running; and the
    /// TTL the keeper times it out by.
    async fn grant(&self, ttl: Duration) -> Result<(Arc<EtcdLease>, u64), MetaError> {
        let want_ms = (ttl.as_millis() as u64).max(1);
        let secs = want_ms.div_ceil(1000) as i64;
        let sent_ms = self.clock.now_ms();
        let (id, granted_s) = self
            .rpc(|c| async move { c.lease_grant(secs).await })
            .await?;
        // etcd raises a TTL under its minimum: expire by the shorter of the two.
        let ttl_ms = want_ms.min(granted_s.max(0) as u64 * 1000);
        let (tx, _) = watch::channel(false);
        let lease = Arc::new(EtcdLease {
            id,
            key: Mutex::default(),
            lost: tx,
            stalled: AtomicBool::new(false),
            acked_ms: AtomicU64::new(sent_ms),
            ttl_ms,
            clock: Arc::clone(&self.clock),
            keeper: Mutex::new(None),
        });
        let keeper = Keeper {
            client: self.client.clone(),
            lease: Arc::downgrade(&lease),
            clock: Arc::clone(&self.clock),
            ttl_ms,
        };
        *lock(&lease.keeper) = Some(tokio::spawn(keeper.run(sent_ms)));
        Ok((lease, ttl_ms))
    }
}

/// Gives `lease` back without waiting: the keeper stops and etcd is asked to revoke it.
fn give_back(client: &Client, lease: &EtcdLease) {
    lease.end();
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        let (client, id) = (client.clone(), lease.id);
        rt.spawn(async move {
            let revoke = client.lease_revoke(id);
            let _ = tokio::time::timeout(super::REQUEST_TIMEOUT, revoke).await;
        });
    }
}

/// A campaign that has not led yet.
struct Pending {
    lease: Option<Arc<EtcdLease>>,
    client: Client,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            give_back(&self.client, &lease);
        }
    }
}

struct EtcdHold {
    held: Arc<Mutex<std::collections::BTreeMap<u64, Arc<EtcdLease>>>>,
    term: u64,
    lease: Arc<EtcdLease>,
    client: Client,
}

impl Hold for EtcdHold {
    fn stall(&self) {
        self.lease.stalled.store(true, Ordering::SeqCst);
    }

    fn expired(&self) -> bool {
        self.lease.expired()
    }
}

impl Drop for EtcdHold {
    fn drop(&mut self) {
        lock(&self.held).remove(&self.term);
        give_back(&self.client, &self.lease);
    }
}

/// The task that keeps one lease alive and times it out.
struct Keeper {
    client: Client,
    lease: Weak<EtcdLease>,
    clock: Arc<dyn Clock>,
    ttl_ms: u64,
}

enum Renewal {
    Acked,
    /// etcd no longer has the lease.
    Gone,
    Failed,
}

impl Keeper {
    /// Renews every [`period`] until the lease is gone, dropped, or unacknowledged for its TTL
    /// since the last acknowledged renewal was sent (`acked_ms`, on the clock).
    async fn run(self, mut acked_ms: u64) {
        let mut stream = None;
        loop {
            tokio::time::sleep(period(self.ttl_ms)).await;
            let Some(lease) = self.lease.upgrade() else {
                return;
            };
            if !lease.stalled.load(Ordering::SeqCst) {
                let sent_ms = self.clock.now_ms();
                match self.renew(lease.id, &mut stream).await {
                    Renewal::Acked => {
                        acked_ms = sent_ms;
                        lease.acked_ms.store(sent_ms, Ordering::SeqCst);
                    }
                    Renewal::Gone => {
                        lease.lost.send_replace(true);
                        return;
                    }
                    Renewal::Failed => stream = None,
                }
            }
            if self.clock.now_ms().saturating_sub(acked_ms) >= self.ttl_ms {
                lease.lost.send_replace(true);
                return;
            }
        }
    }

    /// One keepalive, bounded by the renewal period; opens the stream first if it has none.
    async fn renew(&self, id: i64, stream: &mut Option<KeepAlive>) -> Renewal {
        let attempt = async {
            let Some(open) = stream.as_mut() else {
                let (opened, ttl) = self.client.keep_alive(id).await?;
                *stream = Some(opened);
                return Ok(ttl);
            };
            open.renew().await
        };
        match tokio::time::timeout(period(self.ttl_ms), attempt).await {
            Ok(Ok(Some(ttl))) if ttl > 0 => Renewal::Acked,
            // etcd answers a renewal of a lease it no longer has with a TTL of 0.
            Ok(Ok(Some(_))) => Renewal::Gone,
            _ => Renewal::Failed,
        }
    }
}
