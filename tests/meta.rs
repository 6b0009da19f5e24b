//! The metadata store seam: the same election and fencing semantics from the in-memory store,
//! a directory and a real etcd (one member, and a three-member cluster losing a member). Each
//! "coordinator" is a handle of its own (a clone of the in-memory store, a second open of the
//! directory, a second etcd connection), as separate processes would hold.

use crate::common;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use elastic_zero::runtime::meta::{
    self, spawn_local_etcd, Candidate, DirStore, EtcdStore, MemoryStore, MetaError, MetaStore,
    MetaUrl,
};

const TTL: Duration = Duration::from_millis(1000);
/// The default lease (`--lease-ttl-ms`).
const CLUSTER_TTL: Duration = Duration::from_millis(3000);

fn candidate(id: &str) -> Candidate {
    Candidate {
        id: id.into(),
        pid: 1,
        workers: "127.0.0.1:1".parse().unwrap(),
        control: None,
        config_digest: "d".into(),
        build: "b".into(),
    }
}

/// Whether `f` is still pending after `wait`.
async fn pending_after<F: Future>(f: F, wait: Duration) -> bool {
    tokio::time::timeout(wait, f).await.is_err()
}

/// What every store must do; `open` makes a new handle on the same job.
async fn same_semantics<F, Fut>(open: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<dyn MetaStore>>,
{
    let (a, b) = (open().await, open().await);
    // Registration: the first wins, the same config passes, another config or build is refused.
    a.open_job("d", "b").await.unwrap();
    b.open_job("d", "b").await.unwrap();
    let conflict = b.open_job("other", "b").await.unwrap_err();
    assert!(
        matches!(conflict, MetaError::JobConflict { .. }),
        "{conflict}"
    );
    assert!(conflict.to_string().contains("digest d"), "{conflict}");
    let build = b.open_job("d", "other").await.unwrap_err();
    assert!(matches!(build, MetaError::BuildMismatch { .. }), "{build}");

    // One leads; the other waits.
    let (ca, cb) = (candidate("a"), candidate("b"));
    let lead_a = a.campaign(&ca, TTL).await.unwrap();
    assert!(pending_after(b.campaign(&cb, TTL), Duration::from_millis(300)).await);
    let leader = b.leader().await.unwrap().expect("a leads");
    assert_eq!(
        (leader.candidate.id.as_str(), leader.term),
        ("a", lead_a.term)
    );
    assert_eq!(a.load().await.unwrap(), None);
    a.commit(lead_a.term, b"one").await.unwrap();
    assert_eq!(b.load().await.unwrap().as_deref(), Some(&b"one"[..]));

    // A clean resignation hands over at once, under a greater term; the old term is fenced.
    let term_a = lead_a.term;
    a.resign(term_a).await.unwrap();
    let lead_b = tokio::time::timeout(Duration::from_secs(10), b.campaign(&cb, TTL))
        .await
        .expect("b leads once a resigns")
        .unwrap();
    assert!(lead_b.term > term_a, "{} after {term_a}", lead_b.term);
    let refused = a.commit(term_a, b"stale").await.unwrap_err();
    assert!(matches!(refused, MetaError::Deposed { .. }), "{refused}");
    assert_eq!(a.load().await.unwrap().as_deref(), Some(&b"one"[..]));
    b.commit(lead_b.term, b"two").await.unwrap();

    // A leader that stops renewing (a process frozen past its lease) loses the lead on its
    // own clock; the next leader's term is greater again and the stalled one's writes fail.
    let waiting = {
        let a = Arc::clone(&a);
        tokio::spawn(async move { a.campaign(&candidate("a"), TTL).await })
    };
    let mut lead_b = lead_b;
    lead_b.stall();
    tokio::time::timeout(Duration::from_secs(10), lead_b.until_lost())
        .await
        .expect("a stalled leadership ends within its lease");
    let lead_a = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .expect("a leads after b's lease lapsed")
        .unwrap()
        .unwrap();
    assert!(lead_a.term > lead_b.term);
    let refused = b.commit(lead_b.term, b"stale").await.unwrap_err();
    assert!(matches!(refused, MetaError::Deposed { .. }), "{refused}");
    assert_eq!(a.load().await.unwrap().as_deref(), Some(&b"two"[..]));

    // Dropping the leadership (the process died) also hands over.
    let waiting = {
        let b = Arc::clone(&b);
        tokio::spawn(async move { b.campaign(&candidate("b"), TTL).await })
    };
    drop(lead_a);
    let lead_b = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .expect("b leads after a's leadership was dropped")
        .unwrap()
        .unwrap();
    assert!(!lead_b.is_lost());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_store_elects_and_fences() {
    let store = Arc::new(MemoryStore::new("job"));
    same_semantics(|| {
        let s = Arc::clone(&store);
        async move { s as Arc<dyn MetaStore> }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_directory_store_elects_and_fences() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    same_semantics(|| {
        let p = path.clone();
        async move { Arc::new(DirStore::open(&p, "job").unwrap()) as Arc<dyn MetaStore> }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd on PATH (apt-get install etcd-server; bash .ci/run installs it)"]
async fn etcd_elects_and_fences() {
    common::etcd::require_etcd();
    let dir = tempfile::tempdir().unwrap();
    let etcd = spawn_local_etcd(dir.path()).unwrap();
    let endpoints = etcd.endpoints();
    same_semantics(|| {
        let e = endpoints.clone();
        async move { Arc::new(EtcdStore::connect(&e, "job").await.unwrap()) as Arc<dyn MetaStore> }
    })
    .await;
}

/// The directory store refuses a missing or unwritable directory before anything starts.
#[test]
fn a_directory_that_cannot_be_written_is_refused() {
    let e = DirStore::open(std::path::Path::new("/nonexistent-ezero/meta"), "job")
        .err()
        .expect("a missing directory is refused");
    assert!(e.to_string().contains("/nonexistent-ezero/meta"), "{e}");
}

/// etcd that nobody serves: one error naming the endpoints, within the connect timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_etcd_is_named() {
    let started = std::time::Instant::now();
    let url: MetaUrl = "etcd://127.0.0.1:1".parse().unwrap();
    let e = meta::open(&url, "job")
        .await
        .err()
        .expect("nothing listens");
    assert!(matches!(e, MetaError::Unreachable { .. }), "{e}");
    assert!(e.to_string().contains("127.0.0.1:1"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(10));
}

/// A three-member cluster losing one member keeps its quorum: the leader keeps its lead and
/// commits, and a new campaign still resolves once it resigns. The lease is the default's 3 s:
/// when the member lost was etcd's own leader, etcd elects another (about a second) while the
/// keepalives wait, and a lease must outlast that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd on PATH (apt-get install etcd-server; bash .ci/run installs it)"]
async fn a_three_member_etcd_survives_losing_a_member() {
    let mut cluster = common::etcd::Cluster::start();
    let url: MetaUrl = cluster.url().parse().unwrap();
    let (a, b) = (
        meta::open(&url, "job").await.unwrap(),
        meta::open(&url, "job").await.unwrap(),
    );
    a.open_job("d", "b").await.unwrap();
    let lead = a.campaign(&candidate("a"), CLUSTER_TTL).await.unwrap();
    a.commit(lead.term, b"before").await.unwrap();
    cluster.kill(0);
    // Several lease periods pass: the keepalives reach the members still up.
    tokio::time::sleep(CLUSTER_TTL * 2).await;
    assert!(
        !lead.is_lost(),
        "the lease lapsed with two of three members up"
    );
    a.commit(lead.term, b"after").await.unwrap();
    assert_eq!(b.load().await.unwrap().as_deref(), Some(&b"after"[..]));
    a.resign(lead.term).await.unwrap();
    let next = tokio::time::timeout(
        Duration::from_secs(10),
        b.campaign(&candidate("b"), CLUSTER_TTL),
    )
    .await
    .expect("b leads")
    .unwrap();
    assert!(next.term > lead.term);
}
