//! `--meta etcd://HOST:PORT[,HOST:PORT...]`: the store in an etcd cluster, for coordinators on
//! many hosts.
//!
//! Keys under `/ezero/jobs/<job-id>/`: `config` (the registration, written by a transaction
//! only if absent), `election/<lease>` (etcd's election API: the candidate with the oldest key
//! leads; its key's create revision is the term, so terms strictly increase), `state` (written
//! by a transaction conditioned on the leader key's create revision still being the term: a
//! key that expired or was resigned has none, so a deposed leader's write fails).
//!
//! Each campaign holds a lease of its own, kept alive by a task. That task also watches the
//! lease on this process's clock: when no keepalive has been acknowledged for the lease's TTL
//! (measured from when the acknowledged request was sent, so never later than etcd expires the
//! lease) it ends the leadership itself; a leader cut off from etcd hears nothing from it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use self::client::{not_sent, Client};
use self::proto::etcdserverpb::{response_op, TxnRequest, TxnResponse};
use super::local_etcd::LocalEtcd;
use super::{
    check_job, Candidate, Leader, Leadership, MetaError, MetaFuture, MetaStore, CONNECT_TIMEOUT,
};
use crate::runtime::clock::{Clock, SystemClock};

/// How long one request (not a campaign, which waits for its turn) may take before the store
/// counts as unreachable.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Between two tries of a request that could not connect.
const RETRY: Duration = Duration::from_millis(50);

pub struct EtcdStore {
    client: Client,
    /// The endpoints, for messages.
    endpoints: String,
    job: String,
    clock: Arc<dyn Clock>,
    /// The terms this handle leads, with their leases.
    held: Arc<Mutex<BTreeMap<u64, Arc<EtcdLease>>>>,
    /// A local etcd started for this store, stopped with it.
    _local: Option<LocalEtcd>,
}

/// One campaign's lease and the task that keeps it alive.
struct EtcdLease {
    id: i64,
    /// The election key, once it leads.
    key: Mutex<Vec<u8>>,
    lost: watch::Sender<bool>,
    /// Test hook: stop renewing (see [`Leadership::stall`]).
    stalled: AtomicBool,
    /// When the newest acknowledged renewal was sent, on `clock`; the lease runs out `ttl_ms`
    /// after it.
    acked_ms: AtomicU64,
    ttl_ms: u64,
    clock: Arc<dyn Clock>,
    keeper: Mutex<Option<JoinHandle<()>>>,
}

#[derive(Serialize, Deserialize)]
struct JobRecord {
    digest: String,
    build: String,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl EtcdLease {
    /// Ends the leadership locally: no more keepalives, `lost` fires.
    fn end(&self) {
        if let Some(task) = lock(&self.keeper).take() {
            task.abort();
        }
        self.lost.send_replace(true);
    }

    fn is_lost(&self) -> bool {
        *self.lost.borrow() || self.expired()
    }

    fn expired(&self) -> bool {
        let acked = self.acked_ms.load(Ordering::SeqCst);
        self.clock.now_ms().saturating_sub(acked) >= self.ttl_ms
    }
}

impl EtcdStore {
    /// Connects to `endpoints` (`http://HOST:PORT` each) and checks that one answers within
    /// [`CONNECT_TIMEOUT`].
    pub async fn connect(endpoints: &[String], job: &str) -> Result<Self, MetaError> {
        let names = endpoints
            .iter()
            .map(|e| e.strip_prefix("http://").unwrap_or(e))
            .collect::<Vec<_>>()
            .join(",");
        let unreachable = |detail: String| MetaError::Unreachable {
            endpoints: format!("etcd at {names}"),
            detail,
        };
        let client = Client::new(endpoints, CONNECT_TIMEOUT).map_err(unreachable)?;
        match tokio::time::timeout(CONNECT_TIMEOUT, client.status()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(unreachable(one_line(&e))),
            Err(_) => return Err(unreachable(format!("no answer within {CONNECT_TIMEOUT:?}"))),
        }
        Ok(Self {
            client,
            endpoints: format!("etcd at {names}"),
            job: job.to_string(),
            clock: SystemClock::shared(),
            held: Arc::default(),
            _local: None,
        })
    }

    /// Decides lease expiry on `clock` instead of the wall.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Keeps `local` running as long as this store.
    pub fn keeping(mut self, local: LocalEtcd) -> Self {
        self._local = Some(local);
        self
    }

    fn key(&self, name: &str) -> String {
        format!("/ezero/jobs/{}/{name}", self.job)
    }

    fn unreachable(&self, e: impl std::fmt::Display) -> MetaError {
        MetaError::Unreachable {
            endpoints: self.endpoints.clone(),
            detail: one_line(&e),
        }
    }

    /// One request made on a client, made again while it could not reach a member
    /// ([`Self::retried`]), bounded by [`REQUEST_TIMEOUT`].
    async fn rpc<T, F, Fut>(&self, request: F) -> Result<T, MetaError>
    where
        F: FnMut(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, tonic::Status>>,
    {
        match tokio::time::timeout(REQUEST_TIMEOUT, self.retried(request)).await {
            Ok(r) => r.map_err(|e| self.unreachable(e)),
            Err(_) => Err(self.unreachable(format!("no answer within {REQUEST_TIMEOUT:?}"))),
        }
    }

    /// `request` made on a client, and made again while it could not reach a member (the
    /// client's balancer may have picked one that is down, and nothing was sent). Unbounded:
    /// callers bound it.
    async fn retried<T, F, Fut>(&self, mut request: F) -> Result<T, tonic::Status>
    where
        F: FnMut(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, tonic::Status>>,
    {
        loop {
            match request(self.client.clone()).await {
                Err(e) if not_sent(&e) => tokio::time::sleep(RETRY).await,
                done => return done,
            }
        }
    }

    /// One transaction, made again if it could not reach a member.
    async fn txn(&self, txn: TxnRequest) -> Result<TxnResponse, MetaError> {
        self.rpc(|c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await
    }

    async fn open_job_inner(&self, digest: &str, build: &str) -> Result<(), MetaError> {
        let key = self.key("config");
        let record = JobRecord {
            digest: digest.to_string(),
            build: build.to_string(),
        };
        let json = serde_json::to_vec(&record).expect("a job record serializes");
        let txn = TxnRequest {
            compare: vec![client::version_is(key.as_bytes(), 0)],
            success: vec![client::put(key.as_bytes(), json)],
            failure: vec![client::get(key.as_bytes())],
        };
        let resp = self.txn(txn).await?;
        if resp.succeeded {
            return Ok(());
        }
        let found = resp.responses.into_iter().find_map(|r| match r.response {
            Some(response_op::Response::ResponseRange(g)) => g.kvs.into_iter().next(),
            _ => None,
        });
        let found = found.map(|kv| kv.value);
        let found: JobRecord = parse_json(&key, &found.unwrap_or_default())?;
        check_job(&self.job, (&found.digest, &found.build), digest, build)
    }

    async fn leader_inner(&self) -> Result<Option<Leader>, MetaError> {
        let prefix = format!("{}/", self.key("election"));
        let resp = self
            .rpc(|c| {
                let prefix = prefix.clone();
                async move { c.get(prefix.as_bytes(), true, 1).await }
            })
            .await?;
        let Some(first) = resp.kvs.first() else {
            return Ok(None);
        };
        let candidate: Candidate = parse_json(&prefix, &first.value)?;
        Ok(Some(Leader {
            candidate,
            term: first.create_revision as u64,
        }))
    }

    async fn commit_inner(&self, term: u64, state: &[u8]) -> Result<(), MetaError> {
        let lease = lock(&self.held).get(&term).cloned();
        let Some(lease) = lease.filter(|l| !l.is_lost()) else {
            return Err(self.deposed(term).await);
        };
        let key = lock(&lease.key).clone();
        let txn = TxnRequest {
            compare: vec![client::created_at(&key, term as i64)],
            success: vec![client::put(self.key("state").as_bytes(), state.to_vec())],
            failure: Vec::new(),
        };
        let resp = self.txn(txn).await?;
        if resp.succeeded {
            return Ok(());
        }
        // The key is gone (expired, resigned, deleted): this term leads no more.
        lock(&self.held).remove(&term);
        lease.end();
        Err(self.deposed(term).await)
    }

    async fn deposed(&self, term: u64) -> MetaError {
        let current = self.leader_inner().await.ok().flatten().map(|l| l.term);
        MetaError::Deposed { term, current }
    }

    async fn load_inner(&self) -> Result<Option<Vec<u8>>, MetaError> {
        let key = self.key("state");
        let resp = self
            .rpc(|c| {
                let key = key.clone();
                async move { c.get(key.as_bytes(), false, 0).await }
            })
            .await?;
        Ok(resp.kvs.into_iter().next().map(|kv| kv.value))
    }

    async fn resign_inner(&self, term: u64) -> Result<(), MetaError> {
        let lease = lock(&self.held).remove(&term);
        let Some(lease) = lease else { return Ok(()) };
        lease.end();
        // Revoking the lease deletes the election key: the next candidate leads at once.
        let id = lease.id;
        self.rpc(|c| async move { c.lease_revoke(id).await }).await
    }
}

fn one_line(e: &impl std::fmt::Display) -> String {
    e.to_string().replace('\n', " ")
}

fn parse_json<T: for<'de> Deserialize<'de>>(key: &str, bytes: &[u8]) -> Result<T, MetaError> {
    serde_json::from_slice(bytes).map_err(|e| MetaError::Corrupt {
        detail: format!("etcd key {key}: {e}"),
    })
}

mod client;
mod lease;
mod proto;

impl MetaStore for EtcdStore {
    fn open_job<'a>(
        &'a self,
        digest: &'a str,
        build: &'a str,
    ) -> MetaFuture<'a, Result<(), MetaError>> {
        Box::pin(self.open_job_inner(digest, build))
    }

    fn campaign<'a>(
        &'a self,
        me: &'a Candidate,
        ttl: Duration,
    ) -> MetaFuture<'a, Result<Leadership, MetaError>> {
        Box::pin(self.campaign_inner(me, ttl))
    }

    fn leader(&self) -> MetaFuture<'_, Result<Option<Leader>, MetaError>> {
        Box::pin(self.leader_inner())
    }

    fn commit<'a>(&'a self, term: u64, state: &'a [u8]) -> MetaFuture<'a, Result<(), MetaError>> {
        Box::pin(self.commit_inner(term, state))
    }

    fn load(&self) -> MetaFuture<'_, Result<Option<Vec<u8>>, MetaError>> {
        Box::pin(self.load_inner())
    }

    fn resign(&self, term: u64) -> MetaFuture<'_, Result<(), MetaError>> {
        Box::pin(self.resign_inner(term))
    }
}
