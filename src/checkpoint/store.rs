//! A save directory: the `step-*` checkpoints in it, which of them are complete, which one a
//! path given by a user means, and deleting old ones.
//!
//! A checkpoint is complete exactly when its `manifest.json` exists, because the manifest is
//! written last. Deletion therefore removes the manifest first (and syncs the directory), so a
//! crash halfway through deleting leaves an incomplete checkpoint, never a damaged one that
//! looks whole.

use std::fs::File;
use std::path::{Path, PathBuf};

use super::error::{CheckpointError, IoContext};
use super::manifest::{parse_checkpoint_dir_name, MANIFEST_FILE, TMP_SUFFIX};

/// One `step-*` directory of a save directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub step: u64,
    pub path: PathBuf,
    pub complete: bool,
}

/// Whether `dir` holds a manifest (its save finished).
pub fn is_complete(dir: &Path) -> bool {
    dir.join(MANIFEST_FILE).is_file()
}

/// The checkpoints in `root`, oldest first.
pub fn list(root: &Path) -> Result<Vec<Entry>, CheckpointError> {
    let mut out = Vec::new();
    for item in std::fs::read_dir(root).at(root, "list the save directory")? {
        let item = item.at(root, "list the save directory")?;
        let name = item.file_name();
        let Some(step) = name.to_str().and_then(parse_checkpoint_dir_name) else {
            continue;
        };
        let path = item.path();
        if path.is_dir() {
            out.push(Entry {
                step,
                complete: is_complete(&path),
                path,
            });
        }
    }
    out.sort_by_key(|e| e.step);
    Ok(out)
}

/// Why `dir`, which has no manifest, looks like an unfinished checkpoint (None if it does not).
fn unfinished(dir: &Path) -> Option<String> {
    let tmp = format!("{MANIFEST_FILE}{TMP_SUFFIX}");
    if dir.join(&tmp).is_file() {
        return Some(format!("no {MANIFEST_FILE}, only {tmp}"));
    }
    let named = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(parse_checkpoint_dir_name)
        .is_some();
    let has_chunks = std::fs::read_dir(dir).ok()?.flatten().any(|e| {
        let n = e.file_name();
        let n = n.to_string_lossy();
        n.starts_with("rank-") && (n.ends_with(".bin") || n.ends_with(".bin.tmp"))
    });
    (named || has_chunks).then(|| format!("no {MANIFEST_FILE}"))
}

/// The checkpoint a user's path means: a checkpoint directory itself (or its `manifest.json`),
/// or a save directory, meaning its newest complete checkpoint.
pub fn resolve(path: &Path) -> Result<PathBuf, CheckpointError> {
    let dir = existing_dir(path)?;
    if is_complete(&dir) {
        return Ok(dir);
    }
    if let Some(why) = unfinished(&dir) {
        return Err(CheckpointError::Incomplete { path: dir, why });
    }
    newest_complete(&dir)
}

fn existing_dir(path: &Path) -> Result<PathBuf, CheckpointError> {
    if !path.exists() {
        return Err(CheckpointError::NotFound {
            path: path.to_path_buf(),
        });
    }
    if path.is_file() && path.file_name().is_some_and(|n| n == MANIFEST_FILE) {
        if let Some(parent) = path.parent() {
            return Ok(parent.to_path_buf());
        }
    }
    if !path.is_dir() {
        return Err(CheckpointError::NotACheckpoint {
            path: path.to_path_buf(),
        });
    }
    Ok(path.to_path_buf())
}

fn newest_complete(root: &Path) -> Result<PathBuf, CheckpointError> {
    let entries = list(root)?;
    match entries.iter().rev().find(|e| e.complete) {
        Some(e) => Ok(e.path.clone()),
        None if entries.is_empty() => Err(CheckpointError::NotACheckpoint {
            path: root.to_path_buf(),
        }),
        None => Err(CheckpointError::NoneComplete {
            path: root.to_path_buf(),
            incomplete: entries.len(),
        }),
    }
}

/// The checkpoints to try, in order, when falling back is allowed: the one `path` means (even
/// if incomplete), then every older complete checkpoint beside it, newest first.
pub fn fallback_candidates(path: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let dir = existing_dir(path)?;
    let (first, root, below) = if is_complete(&dir) || unfinished(&dir).is_some() {
        let step = dir
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(parse_checkpoint_dir_name);
        let root = dir.parent().map(Path::to_path_buf);
        (Some(dir.clone()), root, step)
    } else {
        newest_complete(&dir)?;
        (None, Some(dir.clone()), None)
    };
    let mut out: Vec<PathBuf> = first.into_iter().collect();
    if let Some(root) = root {
        if let Ok(entries) = list(&root) {
            out.extend(
                entries
                    .into_iter()
                    .rev()
                    .filter(|e| e.complete && below.is_none_or(|s| e.step < s))
                    .map(|e| e.path),
            );
        }
    }
    Ok(out)
}

/// Syncs a directory, making the creations, renames and deletions in it durable.
pub fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .at(dir, "sync the directory")
}

/// Deletes a checkpoint directory: manifest first (synced), then the rest.
pub fn remove_checkpoint(dir: &Path) -> Result<(), CheckpointError> {
    remove_manifest(dir)?;
    remove_rest(dir)
}

fn remove_manifest(dir: &Path) -> Result<(), CheckpointError> {
    let manifest = dir.join(MANIFEST_FILE);
    if manifest.exists() {
        std::fs::remove_file(&manifest).at(&manifest, "delete")?;
        sync_dir(dir)?;
    }
    Ok(())
}

fn remove_rest(dir: &Path) -> Result<(), CheckpointError> {
    std::fs::remove_dir_all(dir).at(dir, "delete")?;
    if let Some(parent) = dir.parent() {
        sync_dir(parent)?;
    }
    Ok(())
}

/// After the checkpoint of `newest_step` is complete: keeps the newest `keep` complete
/// checkpoints (all of them if `keep` is 0) and deletes the leftovers of interrupted saves older
/// than `newest_step`. `between` runs after the first manifest is deleted (a crash-test hook).
/// Returns the deleted directories.
pub fn retain(
    root: &Path,
    keep: usize,
    newest_step: u64,
    between: &dyn Fn(),
) -> Result<Vec<PathBuf>, CheckpointError> {
    let entries = list(root)?;
    let complete: Vec<&Entry> = entries.iter().filter(|e| e.complete).collect();
    let drop_complete = if keep == 0 {
        0
    } else {
        complete.len().saturating_sub(keep)
    };
    let mut doomed: Vec<&Entry> = complete.into_iter().take(drop_complete).collect();
    doomed.extend(
        entries
            .iter()
            .filter(|e| !e.complete && e.step < newest_step),
    );
    let mut removed = Vec::new();
    for (k, e) in doomed.into_iter().enumerate() {
        remove_manifest(&e.path)?;
        if k == 0 {
            between();
        }
        remove_rest(&e.path)?;
        removed.push(e.path.clone());
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mk(root: &Path, step: u64, complete: bool) -> PathBuf {
        let d = root.join(super::super::manifest::checkpoint_dir_name(step));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("rank-00000.bin"), b"x").unwrap();
        if complete {
            std::fs::write(d.join(MANIFEST_FILE), b"{}").unwrap();
        }
        d
    }

    #[test]
    fn resolve_picks_the_newest_complete_checkpoint() {
        let t = tempfile::tempdir().unwrap();
        mk(t.path(), 2, true);
        let newest = mk(t.path(), 4, true);
        let partial = mk(t.path(), 6, false);
        assert_eq!(resolve(t.path()).unwrap(), newest);
        assert!(matches!(
            resolve(&partial),
            Err(CheckpointError::Incomplete { .. })
        ));
        assert!(matches!(
            resolve(&t.path().join("nope")),
            Err(CheckpointError::NotFound { .. })
        ));
        let cands = fallback_candidates(&partial).unwrap();
        assert_eq!(cands.len(), 3);
        assert_eq!(cands[0], partial);
        assert_eq!(cands[1], newest);
    }

    #[test]
    fn retain_keeps_the_newest_and_clears_older_leftovers() {
        let t = tempfile::tempdir().unwrap();
        for s in [1, 2, 3] {
            mk(t.path(), s, true);
        }
        mk(t.path(), 4, false);
        mk(t.path(), 5, true);
        mk(t.path(), 6, false);
        let removed = retain(t.path(), 2, 5, &|| {}).unwrap();
        assert_eq!(removed.len(), 3);
        let left: Vec<(u64, bool)> = list(t.path())
            .unwrap()
            .iter()
            .map(|e| (e.step, e.complete))
            .collect();
        assert_eq!(left, vec![(3, true), (5, true), (6, false)]);
    }
}
