//! `--meta file:DIR`: the store in a directory, for the coordinators of one host.
//!
//! The lease is an exclusive `flock` on `DIR/leader.lock`: the kernel releases it when the
//! process dies, so a dead leader never blocks its successor and a living one never loses it.
//! `DIR/term` counts the leaders (each new leader writes the next number while holding the
//! lock); `DIR/leader.json` names the current one; `DIR/job.json` holds the job's registration
//! and `DIR/state` the last commit. Every write is a temporary file, fsync, rename and a fsync
//! of the directory, so a crash leaves the old file or the new one, never a torn one.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::{check_job, Candidate, Hold, Leader, Leadership, MetaError, MetaFuture, MetaStore};

/// How often a waiting campaign tries the lock again (a lock another process holds cannot
/// wake us, and a blocking `flock` could not be withdrawn when the campaign is dropped).
const POLL: Duration = Duration::from_millis(20);

pub struct DirStore {
    dir: PathBuf,
    job: String,
    /// The terms this handle leads, with their locks.
    held: Arc<Mutex<BTreeMap<u64, Arc<DirLease>>>>,
}

/// One leadership's lock: the open file that holds the `flock`, until released.
struct DirLease {
    file: Mutex<Option<File>>,
    lost: watch::Sender<bool>,
}

#[derive(Serialize, Deserialize)]
struct JobRecord {
    job: String,
    digest: String,
    build: String,
}

#[derive(Serialize, Deserialize)]
struct LeaderRecord {
    candidate: Candidate,
    term: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn io_err(path: &Path, detail: impl std::fmt::Display) -> MetaError {
    MetaError::Io {
        path: path.to_path_buf(),
        detail: detail.to_string(),
    }
}

/// Checks that `dir` exists, is a directory and takes new files.
pub fn check_meta_dir(dir: &Path) -> Result<(), MetaError> {
    let hint = "create it (mkdir -p) or name another directory with --meta file:DIR";
    let meta = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            return Err(io_err(dir, format!("does not exist: {hint}")))
        }
        Err(e) => return Err(io_err(dir, format!("cannot be read ({e}): {hint}"))),
    };
    if !meta.is_dir() {
        return Err(io_err(dir, format!("is not a directory: {hint}")));
    }
    let probe = dir.join(format!(".ezero-meta-probe-{}", std::process::id()));
    let made = File::create(&probe);
    let _ = std::fs::remove_file(&probe);
    made.map(drop).map_err(|e| {
        io_err(
            dir,
            format!("is not writable ({e}): make it writable for this user or name another directory with --meta file:DIR"),
        )
    })
}

/// Writes `bytes` to `path` so that readers see the old file or the new one.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), MetaError> {
    let tmp = tmp_path(path);
    let written = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        sync_parent(path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map_err(|e| io_err(path, format!("cannot be written: {e}")))
}

/// A name beside `path` that no other writer uses (handles in one process included).
fn tmp_path(path: &Path) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    path.with_file_name(format!(".{name}.tmp-{}-{n}", std::process::id()))
}

/// Makes a rename in `path`'s directory durable.
fn sync_parent(path: &Path) -> std::io::Result<()> {
    match path.parent() {
        Some(dir) => File::open(dir)?.sync_all(),
        None => Ok(()),
    }
}

/// The file's bytes, or `None` if it does not exist.
fn read_opt(path: &Path) -> Result<Option<Vec<u8>>, MetaError> {
    match std::fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(path, format!("cannot be read: {e}"))),
    }
}

fn parse_json<T: for<'de> Deserialize<'de>>(path: &Path, bytes: &[u8]) -> Result<T, MetaError> {
    serde_json::from_slice(bytes).map_err(|e| MetaError::Corrupt {
        detail: format!("{}: {e}", path.display()),
    })
}

/// `flock(op | LOCK_NB)`: whether it was granted.
fn try_flock(file: &File, op: i32) -> Result<bool, std::io::Error> {
    // SAFETY: flock on a file descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EWOULDBLOCK) | Some(libc::EINTR) => Ok(false),
        _ => Err(e),
    }
}

impl DirStore {
    /// The store in `dir`, checked (exists, a directory, writable) before any work.
    pub fn open(dir: &Path, job: &str) -> Result<Self, MetaError> {
        check_meta_dir(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            job: job.to_string(),
            held: Arc::default(),
        })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn open_lock_file(&self) -> Result<File, MetaError> {
        let path = self.path("leader.lock");
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io_err(&path, format!("cannot be opened: {e}")))
    }

    /// The last term handed out (0 before the first leader).
    fn read_term(&self) -> Result<u64, MetaError> {
        let path = self.path("term");
        let Some(bytes) = read_opt(&path)? else {
            return Ok(0);
        };
        let text = String::from_utf8_lossy(&bytes);
        text.trim().parse().map_err(|_| MetaError::Corrupt {
            detail: format!(
                "{} holds {:?}, not a term number",
                path.display(),
                text.trim()
            ),
        })
    }

    /// Whether some process holds the leader lock now (a shared lock would be refused).
    fn lock_taken(&self) -> Result<bool, MetaError> {
        let file = self.open_lock_file()?;
        let granted = try_flock(&file, libc::LOCK_SH)
            .map_err(|e| io_err(&self.path("leader.lock"), format!("flock: {e}")))?;
        Ok(!granted)
    }

    /// Having just taken the lock on `file`: the next term, recorded, and the leadership.
    fn become_leader(&self, file: File, me: &Candidate) -> Result<Leadership, MetaError> {
        let term = self.read_term()? + 1;
        write_atomic(&self.path("term"), term.to_string().as_bytes())?;
        let record = LeaderRecord {
            candidate: me.clone(),
            term,
        };
        let json = serde_json::to_vec(&record).expect("a leader record serializes");
        write_atomic(&self.path("leader.json"), &json)?;
        let (tx, rx) = watch::channel(false);
        let lease = Arc::new(DirLease {
            file: Mutex::new(Some(file)),
            lost: tx,
        });
        lock(&self.held).insert(term, Arc::clone(&lease));
        let hold = DirHold {
            held: Arc::clone(&self.held),
            term,
            lease,
        };
        Ok(Leadership::new(term, rx, Box::new(hold)))
    }

    async fn campaign_inner(&self, me: &Candidate) -> Result<Leadership, MetaError> {
        let file = self.open_lock_file()?;
        loop {
            let granted = try_flock(&file, libc::LOCK_EX)
                .map_err(|e| io_err(&self.path("leader.lock"), format!("flock: {e}")))?;
            if granted {
                return self.become_leader(file, me);
            }
            tokio::time::sleep(POLL).await;
        }
    }

    fn leader_now(&self) -> Result<Option<Leader>, MetaError> {
        if !self.lock_taken()? {
            return Ok(None);
        }
        let path = self.path("leader.json");
        let Some(bytes) = read_opt(&path)? else {
            return Ok(None);
        };
        let record: LeaderRecord = parse_json(&path, &bytes)?;
        // Between a new leader taking the lock and naming itself, the record is its
        // predecessor's: the term file tells.
        if record.term != self.read_term()? {
            return Ok(None);
        }
        Ok(Some(Leader {
            candidate: record.candidate,
            term: record.term,
        }))
    }

    fn commit_now(&self, term: u64, state: &[u8]) -> Result<(), MetaError> {
        let holds = lock(&self.held)
            .get(&term)
            .is_some_and(|l| !*l.lost.borrow());
        let current = self.read_term()?;
        if !holds || current != term {
            let current = self.leader_now()?.map(|l| l.term);
            return Err(MetaError::Deposed { term, current });
        }
        write_atomic(&self.path("state"), state)
    }

    fn open_job_now(&self, digest: &str, build: &str) -> Result<(), MetaError> {
        let path = self.path("job.json");
        let record = JobRecord {
            job: self.job.clone(),
            digest: digest.to_string(),
            build: build.to_string(),
        };
        let json = serde_json::to_vec(&record).expect("a job record serializes");
        // Written aside and linked into place: the link fails if another registered first.
        let tmp = tmp_path(&path);
        std::fs::write(&tmp, &json).map_err(|e| io_err(&tmp, format!("cannot be written: {e}")))?;
        let linked = std::fs::hard_link(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => return sync_parent(&path).map_err(|e| io_err(&path, e)),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_err(&path, format!("cannot be written: {e}"))),
        }
        let bytes = read_opt(&path)?.unwrap_or_default();
        let found: JobRecord = parse_json(&path, &bytes)?;
        if found.job != self.job {
            let detail = format!(
                "holds job {:?}, not {:?}: give each job its own directory",
                found.job, self.job
            );
            return Err(io_err(&self.dir, detail));
        }
        check_job(&self.job, (&found.digest, &found.build), digest, build)
    }
}

struct DirHold {
    held: Arc<Mutex<BTreeMap<u64, Arc<DirLease>>>>,
    term: u64,
    lease: Arc<DirLease>,
}

impl DirHold {
    /// Closes the lock file (the kernel releases the lock), as the process's death would.
    fn release(&self) {
        lock(&self.held).remove(&self.term);
        drop(lock(&self.lease.file).take());
        self.lease.lost.send_replace(true);
    }
}

impl Hold for DirHold {
    fn stall(&self) {
        self.release();
    }
}

impl Drop for DirHold {
    fn drop(&mut self) {
        self.release();
    }
}

impl MetaStore for DirStore {
    fn open_job<'a>(
        &'a self,
        digest: &'a str,
        build: &'a str,
    ) -> MetaFuture<'a, Result<(), MetaError>> {
        Box::pin(async move { self.open_job_now(digest, build) })
    }

    fn campaign<'a>(
        &'a self,
        me: &'a Candidate,
        _ttl: Duration,
    ) -> MetaFuture<'a, Result<Leadership, MetaError>> {
        Box::pin(self.campaign_inner(me))
    }

    fn leader(&self) -> MetaFuture<'_, Result<Option<Leader>, MetaError>> {
        Box::pin(async move { self.leader_now() })
    }

    fn commit<'a>(&'a self, term: u64, state: &'a [u8]) -> MetaFuture<'a, Result<(), MetaError>> {
        Box::pin(async move { self.commit_now(term, state) })
    }

    fn load(&self) -> MetaFuture<'_, Result<Option<Vec<u8>>, MetaError>> {
        Box::pin(async move { read_opt(&self.path("state")) })
    }

    fn resign(&self, term: u64) -> MetaFuture<'_, Result<(), MetaError>> {
        Box::pin(async move {
            let lease = lock(&self.held).remove(&term);
            if let Some(lease) = lease {
                drop(lock(&lease.file).take());
                lease.lost.send_replace(true);
            }
            Ok(())
        })
    }
}
