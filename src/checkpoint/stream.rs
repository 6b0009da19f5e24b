//! Saving a snapshot that does not fit in memory: the runtime streams it from the owners a
//! bounded piece at a time (`runtime::step::snapshot::SnapshotSink`) while the ranks wait at
//! the step boundary, and this writes each piece into its owner's chunk file as it arrives.
//!
//! The directory, the files and the manifest are those of [`save`](super::save), in the same
//! order with the same crash points: every owner's file is written to `NAME.tmp`, all are
//! synced and renamed once the last chunk has arrived, then the manifest commits the
//! checkpoint. The parameters' digest is computed on the way, since the chunks arrive in
//! (unit, index) order. A save that fails or is abandoned removes its directory (it has no
//! manifest, so it never looked complete) and every earlier checkpoint stays as it was.

use crate::runtime::clock::Stopwatch;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicUsize;
use std::sync::mpsc::Sender;
use std::sync::Arc;

use super::error::CheckpointError;
use super::manifest::MANIFEST_FILE;
use super::meta::CheckpointMeta;
use super::store;
use super::write::{check_chunk, commit, create_dir, CrashPoint, RankFile, Saved};
use super::{SaveOptions, SaveReport};
use crate::engine::coordinator::Progress;
use crate::param_digest::ParamDigest;
use crate::plan::{RankId, ShardMap};
use crate::runtime::step::elastic::snapshot::{SnapshotSink, SnapshotStream};
use crate::runtime::step::state::rank_state::ChunkState;

/// Saves streamed snapshots under `root`; each save's outcome goes to `results` (the caller
/// reports them as it does the background writer's).
pub struct CheckpointSink {
    root: PathBuf,
    meta: Arc<CheckpointMeta>,
    opts: SaveOptions,
    results: Sender<Result<SaveReport, CheckpointError>>,
}

impl CheckpointSink {
    pub fn new(
        root: PathBuf,
        meta: CheckpointMeta,
        opts: SaveOptions,
        results: Sender<Result<SaveReport, CheckpointError>>,
    ) -> Self {
        Self {
            root,
            meta: Arc::new(meta),
            opts,
            results,
        }
    }
}

impl SnapshotSink for CheckpointSink {
    fn begin(
        &self,
        progress: &Progress,
        map: &ShardMap,
    ) -> Result<Box<dyn SnapshotStream>, String> {
        let started = Stopwatch::start();
        let dir = match create_dir(&self.root, progress.step) {
            Ok(d) => d,
            Err(e) => {
                let msg = e.to_string();
                let _ = self.results.send(Err(e));
                return Err(msg);
            }
        };
        let crash = self.opts.crash_at(progress.step);
        // Crash tests stop halfway through the first owner's file, as `save` does.
        let mid_file = (crash == Some(CrashPoint::MidFile))
            .then(|| {
                map.members
                    .iter()
                    .copied()
                    .find(|&r| !map.owned_chunks(r).is_empty())
            })
            .flatten()
            .map(|r| (r, (map.owned_chunks(r).len() / 2).max(1)));
        Ok(Box::new(OpenSave {
            root: self.root.clone(),
            dir,
            meta: Arc::clone(&self.meta),
            opts: self.opts,
            results: self.results.clone(),
            progress: progress.clone(),
            map: map.clone(),
            files: BTreeMap::new(),
            digest: Some(ParamDigest::new()),
            next: (0, 0),
            started,
            mid_file,
            ended: false,
        }))
    }
}

/// One save in progress.
struct OpenSave {
    root: PathBuf,
    dir: PathBuf,
    meta: Arc<CheckpointMeta>,
    opts: SaveOptions,
    results: Sender<Result<SaveReport, CheckpointError>>,
    progress: Progress,
    map: ShardMap,
    files: BTreeMap<RankId, RankFile>,
    digest: Option<ParamDigest>,
    /// The (unit, index) the next chunk must have.
    next: (usize, usize),
    started: Stopwatch,
    mid_file: Option<(RankId, usize)>,
    /// Committed or failed (and reported).
    ended: bool,
}

impl OpenSave {
    fn take(&mut self, owner: RankId, c: &ChunkState) -> Result<(), CheckpointError> {
        let (u, i) = self.next;
        if (c.unit as usize, c.index as usize) != (u, i) {
            return Err(CheckpointError::BadSnapshot(format!(
                "chunk {}/{} arrived where {u}/{i} was due",
                c.unit, c.index
            )));
        }
        let expected = check_chunk(&self.map, c)?;
        if expected != owner {
            return Err(CheckpointError::BadSnapshot(format!(
                "chunk {u}/{i} came from rank {owner}; its owner is rank {expected}"
            )));
        }
        self.next = if i + 1 < self.map.units[u].owners.len() {
            (u, i + 1)
        } else {
            (u + 1, 0)
        };
        if let Some(d) = self.digest.as_mut() {
            d.update(&c.params);
        }
        let file = match self.files.entry(owner) {
            std::collections::btree_map::Entry::Occupied(f) => f.into_mut(),
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(RankFile::create(&self.dir, owner)?)
            }
        };
        file.push(c)?;
        if self.mid_file == Some((owner, file.records())) {
            file.crash_mid_file();
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<SaveReport, CheckpointError> {
        if self.next.0 < self.map.units.len() {
            let (u, i) = self.next;
            return Err(CheckpointError::BadSnapshot(format!(
                "the stream ended before chunk {u}/{i}"
            )));
        }
        let crash = self.opts.crash_at(self.progress.step);
        let done = AtomicUsize::new(0);
        let mut files = Vec::new();
        for (_, f) in std::mem::take(&mut self.files) {
            files.push(f.finish(crash, &done)?);
        }
        let saved = Saved {
            progress: &self.progress,
            map: &self.map,
            files,
            param_sha256: self
                .digest
                .take()
                .map(ParamDigest::finish)
                .unwrap_or_default(),
        };
        commit(
            &self.root,
            &self.dir,
            &self.meta,
            saved,
            &self.opts,
            self.started,
        )
    }

    /// Reports `e` and, unless its manifest is in place (retention failed after the commit),
    /// removes what this save wrote: it never looked complete, and a full disk gets its space
    /// back.
    fn fail(&mut self, e: CheckpointError) -> String {
        let msg = e.to_string();
        if !self.ended {
            self.ended = true;
            self.files.clear();
            if !self.dir.join(MANIFEST_FILE).exists() {
                let _ = store::remove_checkpoint(&self.dir);
            }
            let _ = self.results.send(Err(e));
        }
        msg
    }
}

impl SnapshotStream for OpenSave {
    fn push(&mut self, owner: RankId, chunks: Vec<ChunkState>) -> Result<(), String> {
        for c in &chunks {
            if let Err(e) = self.take(owner, c) {
                return Err(self.fail(e));
            }
        }
        Ok(())
    }

    fn commit(mut self: Box<Self>) -> Result<(), String> {
        match self.finish() {
            Ok(report) => {
                self.ended = true;
                let report = SaveReport {
                    streamed: true,
                    ..report
                };
                let _ = self.results.send(Ok(report));
                Ok(())
            }
            Err(e) => Err(self.fail(e)),
        }
    }
}

impl Drop for OpenSave {
    fn drop(&mut self) {
        if !self.ended {
            let step = self.progress.step;
            self.fail(CheckpointError::Writer(format!(
                "the save of step {step} was abandoned before its last chunk (a rank did not answer)"
            )));
        }
    }
}
