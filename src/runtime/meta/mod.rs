//! The metadata store seam: where the coordinators of one job elect their leader and where the
//! leader keeps the job's small durable state, so that a standby coordinator can take a running
//! job over when the leader dies.
//!
//! # The model
//!
//! A job has an id (`--job-id`) and a store (`--meta`, a [`MetaUrl`]). Every coordinator of the
//! job first calls [`MetaStore::open_job`] with the job's config digest and its own build: the
//! first registers them, the others must match (a job id reused by another config, or a
//! coordinator of another binary, is refused before it campaigns). Then it calls
//! [`MetaStore::campaign`], which resolves once it leads, with a [`Leadership`]:
//!
//! - `term` is the fencing token: strictly increasing across the job's leaders. Every command
//!   the leader sends carries it; every durable write is [`MetaStore::commit`]`(term, ..)`,
//!   which the store refuses ([`MetaError::Deposed`]) once another term leads, and then writes
//!   nothing.
//! - `lost` turns true when this process must stop leading: its lease expired, the store was
//!   unreachable for longer than the lease, or it was deposed. A leader steps down on its own
//!   clock, without waiting for the store to tell it (a partitioned leader cannot hear it).
//! - Dropping it gives leadership up as the death of the process would; [`MetaStore::resign`]
//!   is the clean exit, after which a standby leads at once.
//!
//! The durable state is opaque bytes (the engine serializes it): [`MetaStore::load`] returns
//! what the last commit wrote, whichever leader wrote it.
//!
//! # The three stores
//!
//! - `memory` ([`memory::MemoryStore`]): one process; the default, and tests. Clones of one
//!   `Arc` behave as a real election: campaigns queue in order, and a leadership ends when it
//!   is resigned, dropped or (a test hook, [`Leadership::stall`]) lets its lease lapse. It keeps
//!   no clock: nothing in it waits on time.
//! - `file:DIR` ([`dir::DirStore`]): one host. The lease is an exclusive `flock` on
//!   `DIR/leader.lock`, which the kernel releases when the process dies; `DIR/term` counts the
//!   leaders; every write is a temporary file, fsync and rename. A coordinator restarted on the
//!   same host picks the job up.
//! - `etcd://HOST:PORT[,HOST:PORT...]` ([`etcd::EtcdStore`]): many hosts. Keys live under
//!   `/ezero/jobs/<job-id>/`: `config` (digest and build, written if absent), `election`
//!   (etcd's election API under a lease kept alive by a task; the term is the leader key's
//!   create revision), `state` (written by a transaction conditioned on the leader key's create
//!   revision still being the term). `etcd-local` starts a throwaway `etcd` from PATH
//!   ([`local_etcd::spawn_local_etcd`]) for demos and tests.
//!
//! Imports: `crate::runtime::clock` and below; the process mode (`procs`) uses it.

pub mod dir;
pub mod etcd;
pub mod local_etcd;
pub mod memory;
pub mod url;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

pub use self::dir::DirStore;
pub use self::etcd::EtcdStore;
pub use self::local_etcd::{spawn_local_etcd, spawn_local_etcd_from, LocalEtcd};
pub use self::memory::MemoryStore;
pub use self::url::{MetaUrl, MetaUrlError};

/// What every store method returns: a boxed future, so that the trait is object safe.
pub type MetaFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A coordinator that campaigns; the leader's is stored as the election's value, so that
/// workers and standbys can find the leader through the store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Candidate {
    /// Names it in messages, e.g. `c1` or `host-pid`.
    pub id: String,
    pub pid: u32,
    /// Where workers attach.
    pub workers: SocketAddr,
    /// Its HTTP control endpoint, if it serves one.
    pub control: Option<SocketAddr>,
    /// Hex SHA-256 of the job's config.
    pub config_digest: String,
    /// The binary's identity (crate version and source hash).
    pub build: String,
}

/// Who leads, and under which term.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leader {
    pub candidate: Candidate,
    pub term: u64,
}

/// This process's leadership of a job, from [`MetaStore::campaign`].
pub struct Leadership {
    /// The fencing token: strictly increasing across the leaders of one job.
    pub term: u64,
    /// Turns true when this process no longer leads (lease expired, store unreachable past the
    /// lease, deposed, resigned). A closed channel means the same.
    pub lost: watch::Receiver<bool>,
    hold: Box<dyn Hold>,
}

/// What keeps a leadership alive: dropping it gives the leadership up as a dying process
/// would.
trait Hold: Send + Sync {
    /// Stops renewing the lease, as a process frozen past its lease (or cut off from the
    /// store) would; the lease then lapses as the store's kind of lease does.
    fn stall(&self);

    /// Whether the lease has run out on this process's clock, whether or not the task that
    /// renews it has run since (a process resumed after a freeze asks before it acts).
    fn expired(&self) -> bool {
        false
    }
}

impl Leadership {
    fn new(term: u64, lost: watch::Receiver<bool>, hold: Box<dyn Hold>) -> Self {
        Self { term, lost, hold }
    }

    /// Whether this leadership has ended.
    pub fn is_lost(&self) -> bool {
        *self.lost.borrow() || self.lost.has_changed().is_err() || self.hold.expired()
    }

    /// Resolves once this leadership has ended.
    pub async fn until_lost(&mut self) {
        // An error means the sender is gone, which also ends the leadership.
        let _ = self.lost.wait_for(|lost| *lost).await;
    }

    /// Tests and fault injection: stops renewing the lease without giving it up, as a
    /// process stopped past its lease would. `memory` and `file:` lose it at once (their
    /// leases are the process's life); `etcd` after the lease's TTL, on this process's clock.
    pub fn stall(&self) {
        self.hold.stall();
    }
}

impl std::fmt::Debug for Leadership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leadership")
            .field("term", &self.term)
            .field("lost", &self.is_lost())
            .finish()
    }
}

/// Why the store refused or failed. Each message is one line naming what and where.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MetaError {
    #[error("the metadata store at {endpoints} is unreachable: {detail}")]
    Unreachable { endpoints: String, detail: String },
    #[error("term {term} no longer leads the job ({}): nothing was written", current_term(*.current))]
    Deposed { term: u64, current: Option<u64> },
    #[error("job id {job} is already used by a job with config digest {found_digest} (this job's is {ours}): pass another --job-id, or the same config to resume that job")]
    JobConflict {
        job: String,
        found_digest: String,
        ours: String,
    },
    #[error("the job was registered by another ezero build ({found}; this is {ours}): run every coordinator of a job from the same binary, or start the job under a new --job-id")]
    BuildMismatch { found: String, ours: String },
    #[error("metadata directory {}: {detail}", .path.display())]
    Io { path: PathBuf, detail: String },
    #[error("the metadata store holds something unreadable: {detail}")]
    Corrupt { detail: String },
    #[error("job id {id:?} is not usable: {detail}")]
    BadJobId { id: String, detail: String },
}

fn current_term(current: Option<u64>) -> String {
    match current {
        Some(t) => format!("term {t} leads now"),
        None => "no leader now".to_string(),
    }
}

/// Where the coordinators of one job elect their leader and keep its durable state. See the
/// module docs for the model.
pub trait MetaStore: Send + Sync {
    /// Registers the job's config digest and build under the job id, or checks they match the
    /// registered ones ([`MetaError::JobConflict`], [`MetaError::BuildMismatch`]). Called
    /// before campaigning.
    fn open_job<'a>(
        &'a self,
        digest: &'a str,
        build: &'a str,
    ) -> MetaFuture<'a, Result<(), MetaError>>;

    /// Campaigns under a lease of `ttl`; resolves once `me` leads. Dropping the future
    /// withdraws the candidacy.
    fn campaign<'a>(
        &'a self,
        me: &'a Candidate,
        ttl: Duration,
    ) -> MetaFuture<'a, Result<Leadership, MetaError>>;

    /// Who leads now, if anyone.
    fn leader(&self) -> MetaFuture<'_, Result<Option<Leader>, MetaError>>;

    /// Writes the durable state iff `term` still leads and this handle holds it;
    /// [`MetaError::Deposed`] otherwise, and then nothing is written.
    fn commit<'a>(&'a self, term: u64, state: &'a [u8]) -> MetaFuture<'a, Result<(), MetaError>>;

    /// The last committed durable state, if any.
    fn load(&self) -> MetaFuture<'_, Result<Option<Vec<u8>>, MetaError>>;

    /// Gives up the leadership of `term` (a clean exit), so that a standby takes over at once.
    /// A term this handle no longer leads has nothing to give up: `Ok`.
    fn resign(&self, term: u64) -> MetaFuture<'_, Result<(), MetaError>>;
}

/// The registered (digest, build) against this coordinator's; the config first, since a
/// different config is a different job whatever the binary.
fn check_job(
    job: &str,
    (found_digest, found_build): (&str, &str),
    digest: &str,
    build: &str,
) -> Result<(), MetaError> {
    if found_digest != digest {
        return Err(MetaError::JobConflict {
            job: job.to_string(),
            found_digest: found_digest.to_string(),
            ours: digest.to_string(),
        });
    }
    if found_build != build {
        return Err(MetaError::BuildMismatch {
            found: found_build.to_string(),
            ours: build.to_string(),
        });
    }
    Ok(())
}

/// How long a store waits for an endpoint to answer at start.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The job id names a key prefix and a file: letters, digits, `.`, `_` and `-`, at most 128.
pub fn check_job_id(id: &str) -> Result<(), MetaError> {
    let bad = |detail: &str| MetaError::BadJobId {
        id: id.to_string(),
        detail: detail.to_string(),
    };
    if id.is_empty() || id.len() > 128 {
        return Err(bad("it must have 1 to 128 characters"));
    }
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if !id.chars().all(ok) || id.starts_with('.') {
        return Err(bad(
            "use letters, digits, '.', '_' and '-' only, not starting with '.'",
        ));
    }
    Ok(())
}

/// Opens the store `url` names for the job `job_id`: checks a directory, connects to etcd
/// (unreachable within [`CONNECT_TIMEOUT`]: [`MetaError::Unreachable`]), or starts a local
/// etcd, which then lives as long as the store.
pub async fn open(url: &MetaUrl, job_id: &str) -> Result<Arc<dyn MetaStore>, MetaError> {
    check_job_id(job_id)?;
    Ok(match url {
        MetaUrl::Memory => Arc::new(MemoryStore::new(job_id)),
        MetaUrl::Dir(dir) => Arc::new(DirStore::open(dir, job_id)?),
        MetaUrl::Etcd { endpoints } => Arc::new(EtcdStore::connect(endpoints, job_id).await?),
        MetaUrl::EtcdLocal => {
            // Starting it waits on the process, off the runtime's threads.
            let local = tokio::task::spawn_blocking(local_etcd::spawn_local_etcd_temp)
                .await
                .map_err(|e| MetaError::Unreachable {
                    endpoints: "a local etcd".into(),
                    detail: format!("starting it failed: {e}"),
                })??;
            let store = EtcdStore::connect(&local.endpoints(), job_id).await?;
            Arc::new(store.keeping(local))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_ids_are_checked() {
        for good in ["job", "my-job_2.a", "A", &"x".repeat(128)] {
            assert_eq!(check_job_id(good), Ok(()), "{good}");
        }
        for bad in ["", ".hidden", "a/b", "a b", "../x", "é", &"x".repeat(129)] {
            let e = check_job_id(bad).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("job id {bad:?} is not usable")),
                "{e}"
            );
        }
    }
}
