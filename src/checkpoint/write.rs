//! Saving one snapshot as a checkpoint directory, so that a crash at any point leaves every
//! earlier checkpoint intact and never leaves a damaged checkpoint that looks complete.
//!
//! The order on disk:
//! 1. create `ROOT/step-N/` (after deleting a same-named one, manifest first) and sync `ROOT`;
//! 2. one chunk file per owner rank, written in parallel threads: each goes to `NAME.tmp`, is
//!    synced, then renamed to `NAME`;
//! 3. sync `step-N/`; write `manifest.json.tmp`, sync it, rename it to `manifest.json` (from
//!    here on the checkpoint is complete), sync `step-N/` again;
//! 4. retention: delete complete checkpoints beyond the newest `keep`, and older leftovers of
//!    interrupted saves.
//!
//! [`CrashPoint`] aborts the process at named points of this sequence; the crash tests use it
//! through `ezero train`'s test hook `EZERO_TEST_HOOK_CHECKPOINT_CRASH`.

use crate::runtime::clock::Stopwatch;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::codec::encode_chunk;
use super::error::{CheckpointError, IoContext};
use super::manifest::{
    checkpoint_dir_name, crc_hex, rank_file_name, ChunkEntry, FileEntry, MANIFEST_FILE, TMP_SUFFIX,
};
use super::meta::CheckpointMeta;
use super::store;
use crate::engine::coordinator::Progress;
use crate::plan::{RankId, ShardMap};
use crate::runtime::actors::Snapshot;
use crate::runtime::step::state::rank_state::ChunkState;

/// A point of the save sequence at which a crash test aborts the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashPoint {
    /// Half of the first chunk file's records are in its temporary file.
    MidFile,
    /// This many chunk files are renamed into place (others may be half written).
    AfterFiles(usize),
    /// Every chunk file is in place; no manifest yet.
    BeforeManifest,
    /// `manifest.json.tmp` is written and synced but not renamed.
    ManifestTmp,
    /// `manifest.json` is in place (the checkpoint is complete); retention has not run.
    AfterManifest,
    /// Retention deleted the first old checkpoint's manifest but not its directory.
    Retention,
}

impl FromStr for CrashPoint {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "mid-file" => CrashPoint::MidFile,
            "before-manifest" => CrashPoint::BeforeManifest,
            "manifest-tmp" => CrashPoint::ManifestTmp,
            "after-manifest" => CrashPoint::AfterManifest,
            "retention" => CrashPoint::Retention,
            _ => match s.strip_prefix("files-").map(str::parse) {
                Some(Ok(n)) => CrashPoint::AfterFiles(n),
                _ => {
                    return Err(format!(
                        "unknown crash point `{s}`: use mid-file, files-N, before-manifest, \
                         manifest-tmp, after-manifest or retention"
                    ))
                }
            },
        })
    }
}

/// How saves are done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SaveOptions {
    /// Complete checkpoints to keep in the save directory (0 keeps all).
    pub keep: usize,
    /// Crash tests only: abort the process at this point of the save of this step.
    pub crash: Option<(u64, CrashPoint)>,
}

/// What one save did.
#[derive(Clone, Debug, PartialEq)]
pub struct SaveReport {
    pub dir: PathBuf,
    pub step: u64,
    /// Bytes of chunk data written (the manifest excluded).
    pub bytes: u64,
    pub files: usize,
    /// From the start of the save to the synced manifest (retention excluded).
    pub write_s: f64,
    /// Checkpoints deleted by retention.
    pub removed: Vec<PathBuf>,
    /// Streamed off the tier while training waited (else written from a snapshot in RAM
    /// while training went on).
    pub streamed: bool,
}

impl SaveReport {
    pub fn mb_per_s(&self) -> f64 {
        self.bytes as f64 / 1e6 / self.write_s.max(1e-9)
    }
}

/// Writes `snap` as `root/step-N/` (see the module docs for the order), then applies retention.
pub fn save(
    root: &Path,
    meta: &CheckpointMeta,
    snap: &Snapshot,
    opts: &SaveOptions,
) -> Result<SaveReport, CheckpointError> {
    let started = Stopwatch::start();
    let groups = group_by_owner(snap)?;
    let crash = opts.crash_at(snap.progress.step);
    let dir = create_dir(root, snap.progress.step)?;
    let done = AtomicUsize::new(0);
    let (files, param_sha256) = std::thread::scope(|s| {
        let sha = s.spawn(|| params_sha256(&snap.chunks));
        let writers: Vec<_> = groups
            .iter()
            .enumerate()
            .map(|(k, (&rank, chunks))| {
                let (dir, done) = (&dir, &done);
                let mid_file = k == 0 && crash == Some(CrashPoint::MidFile);
                s.spawn(move || {
                    let mut file = RankFile::create(dir, rank)?;
                    for (k, c) in chunks.iter().enumerate() {
                        file.push(c)?;
                        if mid_file && k + 1 == (chunks.len() / 2).max(1) {
                            file.crash_mid_file();
                        }
                    }
                    file.finish(crash, done)
                })
            })
            .collect();
        let files: Result<Vec<FileEntry>, CheckpointError> = writers
            .into_iter()
            .map(|w| {
                w.join().unwrap_or_else(|_| {
                    Err(CheckpointError::Writer("a file writer panicked".into()))
                })
            })
            .collect();
        let sha = sha
            .join()
            .map_err(|_| CheckpointError::Writer("the hashing thread panicked".into()));
        Ok::<_, CheckpointError>((files?, sha?))
    })?;
    let saved = Saved {
        progress: &snap.progress,
        map: &snap.map,
        files,
        param_sha256,
    };
    commit(root, &dir, meta, saved, opts, started)
}

impl SaveOptions {
    /// The crash point of the save of `step`, if a crash test asked for one.
    pub(super) fn crash_at(&self, step: u64) -> Option<CrashPoint> {
        self.crash.filter(|(s, _)| *s == step).map(|(_, p)| p)
    }
}

/// Creates `root/step-N/` (deleting a same-named one first) and syncs `root`.
pub(super) fn create_dir(root: &Path, step: u64) -> Result<PathBuf, CheckpointError> {
    std::fs::create_dir_all(root).at(root, "create the save directory")?;
    let dir = root.join(checkpoint_dir_name(step));
    if dir.exists() {
        store::remove_checkpoint(&dir)?;
    }
    std::fs::create_dir(&dir).at(&dir, "create the checkpoint directory")?;
    store::sync_dir(root)?;
    Ok(dir)
}

/// What a save wrote before its manifest.
pub(super) struct Saved<'a> {
    pub progress: &'a Progress,
    pub map: &'a ShardMap,
    pub files: Vec<FileEntry>,
    pub param_sha256: String,
}

/// Every chunk file is in place under `dir`: sync, write the manifest (the commit), then apply
/// retention.
pub(super) fn commit(
    root: &Path,
    dir: &Path,
    meta: &CheckpointMeta,
    saved: Saved,
    opts: &SaveOptions,
    started: Stopwatch,
) -> Result<SaveReport, CheckpointError> {
    let step = saved.progress.step;
    let crash = opts.crash_at(step);
    crash_if(crash, CrashPoint::BeforeManifest);
    store::sync_dir(dir)?;
    let manifest = meta.manifest(saved.progress, saved.map, saved.files, saved.param_sha256);
    let manifest_path = dir.join(MANIFEST_FILE);
    // The same checks a reader makes, before anything claims the checkpoint is complete.
    manifest
        .check_structure(&manifest_path)
        .map_err(|e| CheckpointError::BadSnapshot(e.to_string()))?;
    let bytes = manifest
        .encode()
        .map_err(|e| CheckpointError::BadSnapshot(format!("cannot serialize the manifest: {e}")))?;
    write_synced(&tmp_path(&manifest_path), &bytes)?;
    crash_if(crash, CrashPoint::ManifestTmp);
    std::fs::rename(tmp_path(&manifest_path), &manifest_path)
        .at(&manifest_path, "rename into place")?;
    store::sync_dir(dir)?;
    let write_s = started.elapsed().as_secs_f64();
    crash_if(crash, CrashPoint::AfterManifest);
    let removed = store::retain(root, opts.keep, step, &|| {
        crash_if(crash, CrashPoint::Retention)
    })?;
    Ok(SaveReport {
        dir: dir.to_path_buf(),
        step,
        bytes: manifest.total_bytes(),
        files: manifest.files.len(),
        write_s,
        removed,
        streamed: false,
    })
}

/// The snapshot's chunks grouped by their owner under the snapshot's map, after checking that
/// every chunk exists in the map with the right length.
fn group_by_owner(snap: &Snapshot) -> Result<BTreeMap<RankId, Vec<&ChunkState>>, CheckpointError> {
    let mut groups: BTreeMap<RankId, Vec<&ChunkState>> = BTreeMap::new();
    for c in &snap.chunks {
        let owner = check_chunk(&snap.map, c)?;
        groups.entry(owner).or_default().push(c);
    }
    Ok(groups)
}

/// `c`'s owner under `map`, after checking that `c` is a chunk of `map` with the right number
/// of values.
pub(super) fn check_chunk(map: &ShardMap, c: &ChunkState) -> Result<RankId, CheckpointError> {
    let (u, i) = (c.unit as usize, c.index as usize);
    if u >= map.units.len() || i >= map.units[u].owners.len() {
        return Err(CheckpointError::BadSnapshot(format!(
            "chunk {u}/{i} is not in the shard map"
        )));
    }
    let n = map.chunk_range(u, i).len();
    let state_ok = |v: &[f32]| v.is_empty() || v.len() == n;
    if c.params.len() != n || !state_ok(&c.m) || !state_ok(&c.v) {
        return Err(CheckpointError::BadSnapshot(format!(
            "chunk {u}/{i} has {}/{}/{} params/m/v values for {n} elements",
            c.params.len(),
            c.m.len(),
            c.v.len()
        )));
    }
    Ok(map.owner(u, i))
}

/// One rank's chunk file while it is written: `NAME.tmp` through a 1 MiB buffer, with each
/// record's CRC as it goes.
pub(super) struct RankFile {
    rank: RankId,
    name: String,
    path: PathBuf,
    tmp: PathBuf,
    w: BufWriter<File>,
    record: Vec<u8>,
    whole: crc32fast::Hasher,
    entries: Vec<ChunkEntry>,
    offset: u64,
}

impl RankFile {
    pub(super) fn create(dir: &Path, rank: RankId) -> Result<Self, CheckpointError> {
        let name = rank_file_name(rank);
        let path = dir.join(&name);
        let tmp = tmp_path(&path);
        let file = File::create(&tmp).at(&tmp, "create")?;
        Ok(Self {
            rank,
            name,
            path,
            tmp,
            w: BufWriter::with_capacity(1 << 20, file),
            record: Vec::new(),
            whole: crc32fast::Hasher::new(),
            entries: Vec::new(),
            offset: 0,
        })
    }

    /// Appends `c`'s record.
    pub(super) fn push(&mut self, c: &ChunkState) -> Result<(), CheckpointError> {
        self.record.clear();
        encode_chunk(c, &mut self.record);
        let mut h = crc32fast::Hasher::new();
        h.update(&self.record);
        self.whole.combine(&h);
        self.w.write_all(&self.record).at(&self.tmp, "write")?;
        self.entries.push(ChunkEntry {
            unit: c.unit,
            index: c.index,
            offset: self.offset,
            params: c.params.len() as u64,
            m: c.m.len() as u64,
            v: c.v.len() as u64,
            crc32: crc_hex(h.finalize()),
        });
        self.offset += self.record.len() as u64;
        Ok(())
    }

    /// Records so far.
    pub(super) fn records(&self) -> usize {
        self.entries.len()
    }

    /// Crash tests: flush what was written and abort at [`CrashPoint::MidFile`].
    pub(super) fn crash_mid_file(&mut self) -> ! {
        let _ = self.w.flush();
        abort(CrashPoint::MidFile)
    }

    /// Syncs the file and renames it into place; `done` counts the files renamed so far (a
    /// crash test may stop after some of them).
    pub(super) fn finish(
        self,
        crash: Option<CrashPoint>,
        done: &AtomicUsize,
    ) -> Result<FileEntry, CheckpointError> {
        let file = self
            .w
            .into_inner()
            .map_err(|e| e.into_error())
            .at(&self.tmp, "write")?;
        file.sync_all().at(&self.tmp, "sync")?;
        drop(file);
        std::fs::rename(&self.tmp, &self.path).at(&self.path, "rename into place")?;
        let n = done.fetch_add(1, Ordering::SeqCst) + 1;
        if crash == Some(CrashPoint::AfterFiles(n)) {
            abort(CrashPoint::AfterFiles(n));
        }
        Ok(FileEntry {
            name: self.name,
            rank: self.rank,
            bytes: self.offset,
            crc32: crc_hex(self.whole.finalize()),
            chunks: self.entries,
        })
    }
}

/// The [`param_digest`](crate::param_digest) of `chunks`, which are in (unit, index) order (as a
/// [`Snapshot`]'s are): the digest of the consolidated model, without consolidating it.
pub fn params_sha256(chunks: &[ChunkState]) -> String {
    debug_assert!(
        chunks.is_sorted_by_key(|c| (c.unit, c.index)),
        "chunks out of (unit, index) order would hash another digest"
    );
    crate::param_digest::param_sha256(chunks.iter().map(|c| c.params.as_slice()))
}

/// `path` + `.tmp`.
pub fn tmp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(TMP_SUFFIX);
    PathBuf::from(s)
}

/// Writes `bytes` to `path` and syncs the file (not its directory).
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut f = File::create(path).at(path, "create")?;
    f.write_all(bytes).at(path, "write")?;
    f.sync_all().at(path, "sync")
}

fn crash_if(crash: Option<CrashPoint>, at: CrashPoint) {
    if crash == Some(at) {
        abort(at);
    }
}

fn abort(at: CrashPoint) -> ! {
    eprintln!("checkpoint crash test: aborting at {at:?}");
    std::process::abort()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crash_points_parse() {
        assert_eq!("files-2".parse(), Ok(CrashPoint::AfterFiles(2)));
        assert_eq!("retention".parse(), Ok(CrashPoint::Retention));
        assert!("files-x".parse::<CrashPoint>().is_err());
    }
}
