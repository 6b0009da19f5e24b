//! The flags that keep a job's state in a metadata store (`ezero coordinator --meta`), so that
//! a standby coordinator takes the job over when the leader is lost.

use std::time::Duration;

use clap::Args;

use elastic_zero::runtime::meta::{self, MetaUrl};
use elastic_zero::runtime::procs::coord::Failover;

use super::CliError;

/// Default lease of the leading coordinator.
pub const LEASE_TTL_MS_DEFAULT: u64 = 3_000;
/// Default wait of a new leader for the workers to re-attach.
pub const REATTACH_WAIT_MS_DEFAULT: u64 = 5_000;

/// `ezero coordinator` flags of a job that outlives its coordinator.
#[derive(Args, Clone, Default)]
pub struct FailoverArgs {
    /// Keep the job's state in a metadata store, so that a standby coordinator (another
    /// `ezero coordinator` with the same flags and --job-id) takes the job over when this one
    /// is lost: `file:DIR` (coordinators on one host), `etcd://HOST:PORT[,HOST:PORT...]`, or
    /// `memory` (nothing outlives this process) [default: memory].
    #[arg(long, env = "EZERO_META", value_name = "URL")]
    pub meta: Option<String>,
    /// The job's name in the metadata store (the prefix of its keys); required with --meta
    /// file: or etcd://. Every coordinator of one job gives the same id; a finished job's id is
    /// not reused.
    #[arg(long, env = "EZERO_JOB_ID")]
    pub job_id: Option<String>,
    /// This coordinator's name in the election [default: HOSTNAME-PID].
    #[arg(long)]
    pub coordinator_id: Option<String>,
    /// The leader's lease in the store: a leader that cannot renew it for this long stops,
    /// and a standby takes over once it lapses [default: 3000].
    #[arg(long)]
    pub lease_ttl_ms: Option<u64>,
    /// How long a new leader waits for the workers to re-attach before it counts the missing
    /// ones as lost [default: 5000].
    #[arg(long)]
    pub reattach_wait_ms: Option<u64>,
}

/// The parsed flags, before the store is opened (that needs the runtime).
pub struct FailoverSpec {
    url: MetaUrl,
    job_id: String,
    id: String,
    lease_ttl: Duration,
    reattach_wait: Duration,
}

impl FailoverArgs {
    /// `None` for the default in-memory store: the job ends with this coordinator.
    pub fn resolve(&self) -> Result<Option<FailoverSpec>, CliError> {
        let url: MetaUrl = match &self.meta {
            None => return Ok(None),
            Some(m) => m
                .parse()
                .map_err(|e: meta::MetaUrlError| CliError::Usage(e.to_string()))?,
        };
        match url {
            MetaUrl::Memory => return Ok(None),
            MetaUrl::EtcdLocal => {
                return Err(CliError::Usage(
                    "--meta etcd-local is for `ezero launch` (it starts a throwaway etcd); give \
                     `ezero coordinator` the etcd endpoints: --meta etcd://HOST:PORT"
                        .into(),
                ))
            }
            _ => {}
        }
        let job_id = self.job_id.clone().ok_or_else(|| {
            CliError::Usage(
                "--meta needs --job-id NAME: the job's name in the store, the same for every \
                 coordinator of the job"
                    .into(),
            )
        })?;
        meta::check_job_id(&job_id).map_err(|e| CliError::Usage(format!("--job-id: {e}")))?;
        let ms = |v: Option<u64>, d: u64, flag: &str| match v.unwrap_or(d) {
            0 => Err(CliError::Usage(format!("{flag} must be at least 1"))),
            v => Ok(Duration::from_millis(v)),
        };
        Ok(Some(FailoverSpec {
            url,
            job_id,
            id: self.coordinator_id.clone().unwrap_or_else(default_id),
            lease_ttl: ms(self.lease_ttl_ms, LEASE_TTL_MS_DEFAULT, "--lease-ttl-ms")?,
            reattach_wait: ms(
                self.reattach_wait_ms,
                REATTACH_WAIT_MS_DEFAULT,
                "--reattach-wait-ms",
            )?,
        }))
    }
}

impl FailoverSpec {
    /// Opens the store (inside the runtime the coordinator runs on): an unreachable store or
    /// an unusable directory is refused here, before anything starts.
    pub async fn open(self) -> Result<Failover, CliError> {
        let store = meta::open(&self.url, &self.job_id)
            .await
            .map_err(|e| CliError::Usage(format!("--meta: {e}")))?;
        Ok(Failover {
            store,
            id: self.id,
            job_id: self.job_id,
            lease_ttl: self.lease_ttl,
            reattach_wait: self.reattach_wait,
        })
    }
}

fn default_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into());
    format!("{host}-{}", std::process::id())
}
