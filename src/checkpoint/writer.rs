//! The background writer: saves snapshots on its own thread so training continues while the
//! bytes go to disk.
//!
//! The snapshot is already an in-memory copy taken at a step boundary, so the only stall
//! training sees is that copy. The queue holds one snapshot besides the one being written:
//! if saves are requested faster than the disk takes them, `submit` blocks its caller (not the
//! ranks) until the writer catches up, which bounds memory to two snapshots.

use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::thread::JoinHandle;

use super::error::CheckpointError;
use super::meta::CheckpointMeta;
use super::write::{save, SaveOptions, SaveReport};
use crate::runtime::actors::Snapshot;

enum Job {
    Save(Box<Snapshot>),
    /// Answered once every earlier job is done.
    Flush(SyncSender<()>),
}

/// A thread that saves snapshots into one save directory, in the order submitted.
pub struct CheckpointWriter {
    jobs: Option<SyncSender<Job>>,
    results: Receiver<Result<SaveReport, CheckpointError>>,
    thread: Option<JoinHandle<()>>,
}

impl CheckpointWriter {
    /// Starts the writer thread for checkpoints under `root`.
    pub fn spawn(
        root: PathBuf,
        meta: CheckpointMeta,
        opts: SaveOptions,
    ) -> Result<Self, CheckpointError> {
        let (jobs, rx) = sync_channel::<Job>(1);
        let (tx, results) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("checkpoint-writer".into())
            .spawn(move || {
                for job in rx {
                    match job {
                        Job::Save(snap) => {
                            if tx.send(save(&root, &meta, &snap, &opts)).is_err() {
                                return;
                            }
                        }
                        Job::Flush(done) => {
                            let _ = done.send(());
                        }
                    }
                }
            })
            .map_err(|e| CheckpointError::Writer(format!("cannot start: {e}")))?;
        Ok(Self {
            jobs: Some(jobs),
            results,
            thread: Some(thread),
        })
    }

    /// Queues a snapshot; blocks while another one is already waiting.
    pub fn submit(&self, snap: Snapshot) -> Result<(), CheckpointError> {
        self.send(Job::Save(Box::new(snap)))
    }

    /// Waits until every submitted snapshot is saved (or failed).
    pub fn flush(&self) -> Result<(), CheckpointError> {
        let (tx, rx) = sync_channel(1);
        self.send(Job::Flush(tx))?;
        rx.recv()
            .map_err(|_| CheckpointError::Writer("stopped before flushing".into()))
    }

    fn send(&self, job: Job) -> Result<(), CheckpointError> {
        self.jobs
            .as_ref()
            .ok_or_else(|| CheckpointError::Writer("already finished".into()))?
            .send(job)
            .map_err(|_| CheckpointError::Writer("the writer thread is gone".into()))
    }

    /// Results of the saves finished since the last call, without waiting.
    pub fn poll(&self) -> Vec<Result<SaveReport, CheckpointError>> {
        self.results.try_iter().collect()
    }

    /// Waits for every queued save, stops the thread, and returns the results not yet polled.
    pub fn finish(mut self) -> Vec<Result<SaveReport, CheckpointError>> {
        self.jobs = None;
        let mut out = Vec::new();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                out.push(Err(CheckpointError::Writer(
                    "the writer thread panicked".into(),
                )));
            }
        }
        out.splice(0..0, self.results.try_iter());
        out
    }
}

impl Drop for CheckpointWriter {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
