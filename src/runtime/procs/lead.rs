//! Leading a job whose state outlives its coordinator: the coordinator registers the job in
//! the metadata store, stands by until it wins the election (telling workers that reach it who
//! leads), then leads under its term. Its lease is watched: a leader that can no longer renew
//! it (partitioned from the store, or frozen past its TTL) stops at once, writing nothing and
//! telling the workers nothing, since another leader may already drive them. The engine's
//! durable state is committed under the term (`StoreCommitter`); a deposed leader's commit
//! fails and it stops commanding.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::admit::Door;
use super::control_plane::{write_msg, ToWorker};
use super::error::ProcError;
use super::proxy::lock;
use crate::config::TrainConfig;
use crate::engine::coordinator::Durable;
use crate::runtime::actors::Committer;
use crate::runtime::api::http::Holding;
use crate::runtime::meta::{Candidate, Leader, Leadership, MetaStore};

/// How long a standby may take to tell a worker who leads.
const NOT_LEADER_TIMEOUT: Duration = Duration::from_secs(2);

/// A coordinator of a job kept in a metadata store (`--meta`).
pub struct Failover {
    pub store: Arc<dyn MetaStore>,
    /// This coordinator's name in the election (`--coordinator-id`).
    pub id: String,
    /// The job's key in the store (`--job-id`), for messages.
    pub job_id: String,
    /// The lease's time to live: a leader that cannot renew it within this long steps down.
    pub lease_ttl: Duration,
    /// How long a new leader waits for the workers to re-attach before it counts the missing
    /// ones as lost.
    pub reattach_wait: Duration,
}

/// What the store holds for a job (JSON, readable with `etcdctl get`): the engine's durable
/// state, and how the job ended once it has.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Stored {
    pub durable: Durable,
    pub ended: Option<Ended>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Ended {
    pub ok: bool,
    pub reason: String,
}

/// This coordinator leads: its term, what the store held for the job, and its commits.
pub(super) struct Led {
    pub(super) term: u64,
    pub(super) stored: Option<Stored>,
    pub(super) committer: Arc<StoreCommitter>,
    lease: JoinHandle<()>,
    /// Held for as long as this coordinator leads: dropping it gives the leadership up.
    _leadership: Leadership,
}

/// What the control endpoint answers while this coordinator stands by (see
/// [`Holding::StandingBy`](crate::runtime::api::http::Holding)).
pub(super) type StandingNote = Arc<Mutex<Option<Holding>>>;

/// The job's config digest and this binary's identity: coordinators of one job must agree on
/// both before they campaign.
pub(super) fn identity(cfg: &TrainConfig) -> Result<(String, String), ProcError> {
    let json = serde_json::to_vec(cfg).map_err(|e| ProcError::Setup(e.to_string()))?;
    let digest = hex(&Sha256::digest(&json));
    let exe = std::env::current_exe()
        .and_then(std::fs::read)
        .map(|b| hex(&Sha256::digest(&b))[..16].to_string())
        .unwrap_or_else(|_| "unknown".into());
    Ok((
        digest,
        format!("ezero {} ({exe})", env!("CARGO_PKG_VERSION")),
    ))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Registers the job, stands by until `me` wins the election, then reads the job's state.
pub(super) async fn lead(
    f: &Failover,
    me: &Candidate,
    door: &mut Door,
    standing: &StandingNote,
) -> Result<Led, ProcError> {
    let store = &f.store;
    store
        .open_job(&me.config_digest, &me.build)
        .await
        .map_err(|e| ProcError::Meta(format!("job {}: {e}", f.job_id)))?;
    let stood_by = store.leader().await.ok().flatten().is_some();
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| ProcError::Setup(format!("cannot watch for SIGTERM: {e}")))?;
    let won = tokio::select! {
        won = store.campaign(me, f.lease_ttl) => won,
        () = answer_not_leader(door, Arc::clone(store)) => unreachable!("serves until dropped"),
        () = stand_by(f, me, standing) => unreachable!("watches until dropped"),
        _ = sigterm.recv() => {
            return Err(ProcError::Aborted(format!(
                "coordinator {} was stopped by SIGTERM while standing by", me.id
            )));
        }
    };
    let leadership =
        won.map_err(|e| ProcError::Meta(format!("job {}: campaigning: {e}", f.job_id)))?;
    let term = leadership.term;
    *lock(standing) = None;
    let stored = match store.load().await {
        Ok(Some(bytes)) => Some(serde_json::from_slice::<Stored>(&bytes).map_err(|e| {
            ProcError::Meta(format!(
                "job {}: the stored state is not one this binary reads ({e}); use a new --job-id",
                f.job_id
            ))
        })?),
        Ok(None) => None,
        Err(e) => {
            return Err(ProcError::Meta(format!(
                "job {}: reading its state: {e}",
                f.job_id
            )))
        }
    };
    if let Some(ended) = stored.as_ref().and_then(|s| s.ended.as_ref()) {
        if stood_by {
            let _ = store.resign(term).await;
            return Err(ProcError::Outlived(format!(
                "coordinator {}: job {} {} under another coordinator ({}); nothing left to lead",
                me.id,
                f.job_id,
                if ended.ok { "finished" } else { "stopped" },
                ended.reason
            )));
        }
        return Err(ProcError::Meta(format!(
            "job {} already {} ({}): start it under a new --job-id",
            f.job_id,
            if ended.ok { "finished" } else { "stopped" },
            ended.reason
        )));
    }
    println!(
        "coordinator {} (pid {}) leads the job from term {term}",
        me.id, me.pid
    );
    let lease = watch_lease(leadership.lost.clone(), me.id.clone(), term);
    let committer = Arc::new(StoreCommitter {
        store: Arc::clone(store),
        term,
        last: Mutex::new(stored.as_ref().map(|s| s.durable.clone())),
    });
    Ok(Led {
        term,
        stored,
        committer,
        lease,
        _leadership: leadership,
    })
}

impl Led {
    /// Why this coordinator must not act on what it saw: its lease ran out (on its own clock:
    /// a process resumed after a freeze may see it before the lease watcher runs).
    pub(super) fn lease_lost(&self, id: &str) -> Option<String> {
        self._leadership
            .is_lost()
            .then(|| lease_lost(id, self.term))
    }

    /// The job is over under this leader: the store says how it ended (so that no standby
    /// takes it over), and the leadership is given up.
    pub(super) async fn end(self, ok: bool, reason: &str) {
        self.lease.abort();
        if let Err(e) = self.committer.end(ok, reason).await {
            eprintln!("recording the job's end in the metadata store failed: {e}");
        }
        let _ = self.committer.store.resign(self.term).await;
    }

    /// Another leader took over: this one only stops watching its lease.
    pub(super) fn abandon(self) {
        self.lease.abort();
    }
}

/// Ends the process the moment the lease is lost: another coordinator may lead already, and
/// this one must not command the workers one more time.
fn watch_lease(mut lost: watch::Receiver<bool>, id: String, term: u64) -> JoinHandle<()> {
    tokio::spawn(async move {
        while !*lost.borrow() {
            if lost.changed().await.is_err() {
                break;
            }
        }
        eprintln!("{}", lease_lost(&id, term));
        std::process::exit(1);
    })
}

fn lease_lost(id: &str, term: u64) -> String {
    format!(
        "coordinator {id}: lost its lease on the metadata store (term {term}): another \
         coordinator may lead the job now, so this one stops without writing anything"
    )
}

/// Keeps what a standby's control endpoint answers current: who leads, read again every
/// third of the lease (a failover elsewhere changes it). Says so on stdout at each change.
async fn stand_by(f: &Failover, me: &Candidate, standing: &StandingNote) {
    let every = (f.lease_ttl / 3).max(Duration::from_millis(100));
    let mut named = None;
    loop {
        if let Ok(Some(l)) = f.store.leader().await {
            // Its own key leads just before its campaign returns.
            let itself = l.candidate.id == me.id && l.candidate.pid == me.pid;
            if named != Some(l.term) && !itself {
                named = Some(l.term);
                let (note, status) = standing_by(f, me, &l);
                println!("{note}");
                *lock(standing) = Some(Holding::StandingBy { note, status });
            }
        }
        tokio::time::sleep(every).await;
    }
}

/// A standby's line while `l` leads, and its `/status`.
fn standing_by(f: &Failover, me: &Candidate, l: &Leader) -> (String, serde_json::Value) {
    let c = &l.candidate;
    let control = c.control.map(|a| format!("http://{a}"));
    let note = format!(
        "coordinator {} stands by: coordinator {} (pid {}) leads job {} from term {} (workers at {}{})",
        me.id,
        c.id,
        c.pid,
        f.job_id,
        l.term,
        c.workers,
        control
            .as_ref()
            .map(|c| format!(", control endpoint {c}"))
            .unwrap_or_default()
    );
    let status = serde_json::json!({
        "role": "standby",
        "coordinator": me.id,
        "job_id": f.job_id,
        "leader": {
            "coordinator": c.id,
            "pid": c.pid,
            "term": l.term,
            "workers": c.workers.to_string(),
            "control": control,
        },
        "message": note,
    });
    (note, status)
}

/// Tells every worker that reaches this standby coordinator who leads (`NotLeader`). The
/// answers are tasks of their own, so that each is sent in full even when this coordinator is
/// elected meanwhile; greetings in progress stay in `door` for the leader's admission.
async fn answer_not_leader(door: &mut Door, store: Arc<dyn MetaStore>) {
    loop {
        let mut g = door.next_greeted().await;
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            let leader = store
                .leader()
                .await
                .ok()
                .flatten()
                .map(|l| l.candidate.workers.to_string());
            let _ = tokio::time::timeout(
                NOT_LEADER_TIMEOUT,
                write_msg(&mut g.writer, &ToWorker::NotLeader { leader }),
            )
            .await;
        });
    }
}

/// Commits the engine's durable state under this leader's term.
pub(super) struct StoreCommitter {
    store: Arc<dyn MetaStore>,
    term: u64,
    /// The last state committed, for the record of the job's end.
    last: Mutex<Option<Durable>>,
}

impl StoreCommitter {
    async fn write(&self, stored: &Stored) -> Result<(), String> {
        let bytes = serde_json::to_vec(stored).map_err(|e| e.to_string())?;
        self.store.commit(self.term, &bytes).await.map_err(|e| {
            format!(
                "the metadata store refused the commit of term {}: {e}; another coordinator leads the job",
                self.term
            )
        })
    }

    async fn end(&self, ok: bool, reason: &str) -> Result<(), String> {
        let Some(durable) = lock(&self.last).clone() else {
            return Ok(());
        };
        let ended = Some(Ended {
            ok,
            reason: reason.to_string(),
        });
        self.write(&Stored { durable, ended }).await
    }
}

impl Committer for StoreCommitter {
    fn commit<'a>(
        &'a self,
        state: &'a Durable,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send + 'a>> {
        Box::pin(async move {
            let stored = Stored {
                durable: state.clone(),
                ended: None,
            };
            self.write(&stored).await?;
            *lock(&self.last) = Some(state.clone());
            Ok(())
        })
    }
}
