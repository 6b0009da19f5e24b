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

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, SortOrder, SortTarget, Txn, TxnOp,
    TxnOpResponse,
};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;

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

/// A request that failed before reaching etcd: the connection to the member was refused or
/// broke, so it can be made again.
fn not_sent(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::TransportError(_) => true,
        etcd_client::Error::GRpcStatus(s) => s.code() == tonic::Code::Unavailable,
        _ => false,
    }
}

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
        let options = ConnectOptions::new().with_connect_timeout(CONNECT_TIMEOUT);
        let connecting = async {
            let mut client = Client::connect(endpoints, Some(options)).await?;
            client.status().await?;
            Ok::<_, etcd_client::Error>(client)
        };
        let client = match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(unreachable(one_line(&e))),
            Err(_) => return Err(unreachable(format!("no answer within {CONNECT_TIMEOUT:?}"))),
        };
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

    /// One request, bounded by [`REQUEST_TIMEOUT`]. `request` makes it on a client; a request
    /// that could not connect is made again (the client's balancer may have picked a member
    /// that is down, and nothing was sent), until the timeout.
    async fn rpc<T, F, Fut>(&self, mut request: F) -> Result<T, MetaError>
    where
        F: FnMut(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        let tries = async {
            loop {
                match request(self.client.clone()).await {
                    Err(e) if not_sent(&e) => tokio::time::sleep(RETRY).await,
                    done => return done,
                }
            }
        };
        match tokio::time::timeout(REQUEST_TIMEOUT, tries).await {
            Ok(r) => r.map_err(|e| self.unreachable(e)),
            Err(_) => Err(self.unreachable(format!("no answer within {REQUEST_TIMEOUT:?}"))),
        }
    }

    /// One transaction, made again if it could not reach a member.
    async fn txn(&self, txn: Txn) -> Result<etcd_client::TxnResponse, MetaError> {
        self.rpc(|c| {
            let txn = txn.clone();
            async move { c.kv_client().txn(txn).await }
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
        let txn = Txn::new()
            .when([Compare::version(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.clone(), json, None)])
            .or_else([TxnOp::get(key.clone(), None)]);
        let resp = self.txn(txn).await?;
        if resp.succeeded() {
            return Ok(());
        }
        let found = resp.op_responses().into_iter().find_map(|r| match r {
            TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.value().to_vec()),
            _ => None,
        });
        let found: JobRecord = parse_json(&key, &found.unwrap_or_default())?;
        check_job(&self.job, (&found.digest, &found.build), digest, build)
    }

    async fn leader_inner(&self) -> Result<Option<Leader>, MetaError> {
        let prefix = format!("{}/", self.key("election"));
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1);
        let resp = self
            .rpc(|c| {
                let (prefix, options) = (prefix.clone(), options.clone());
                async move { c.kv_client().get(prefix, Some(options)).await }
            })
            .await?;
        let Some(first) = resp.kvs().first() else {
            return Ok(None);
        };
        let candidate: Candidate = parse_json(&prefix, first.value())?;
        Ok(Some(Leader {
            candidate,
            term: first.create_revision() as u64,
        }))
    }

    async fn commit_inner(&self, term: u64, state: &[u8]) -> Result<(), MetaError> {
        let lease = lock(&self.held).get(&term).cloned();
        let Some(lease) = lease.filter(|l| !l.is_lost()) else {
            return Err(self.deposed(term).await);
        };
        let key = lock(&lease.key).clone();
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, term as i64)])
            .and_then([TxnOp::put(self.key("state"), state.to_vec(), None)]);
        let resp = self.txn(txn).await?;
        if resp.succeeded() {
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
                async move { c.kv_client().get(key, None).await }
            })
            .await?;
        Ok(resp.kvs().first().map(|kv| kv.value().to_vec()))
    }

    async fn resign_inner(&self, term: u64) -> Result<(), MetaError> {
        let lease = lock(&self.held).remove(&term);
        let Some(lease) = lease else { return Ok(()) };
        lease.end();
        // Revoking the lease deletes the election key: the next candidate leads at once.
        let id = lease.id;
        self.rpc(|mut c| async move { c.lease_revoke(id).await })
            .await
            .map(drop)
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

mod lease;

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
