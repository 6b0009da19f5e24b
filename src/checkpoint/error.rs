//! The checkpoint layer's typed errors. Every message names the file or directory and what is
//! wrong with it, because what an operator does next (delete it, fall back, fix a flag) depends
//! on which file it was.

use std::path::{Path, PathBuf};

/// Why a checkpoint could not be saved, found, verified, loaded or exported.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{}: does not exist", path.display())]
    NotFound { path: PathBuf },
    #[error(
        "{}: neither a checkpoint (no manifest.json) nor a save directory (no step-* checkpoints in it)",
        path.display()
    )]
    NotACheckpoint { path: PathBuf },
    #[error(
        "{}: incomplete checkpoint ({why}): it is still being written, or its save was interrupted",
        path.display()
    )]
    Incomplete { path: PathBuf, why: String },
    #[error(
        "{}: no complete checkpoint in this save directory ({incomplete} incomplete)",
        path.display()
    )]
    NoneComplete { path: PathBuf, incomplete: usize },
    /// The bytes on disk are not what the manifest says (or the manifest itself is damaged).
    #[error("{}: {what}", path.display())]
    Corrupt { path: PathBuf, what: String },
    /// A sound checkpoint that does not fit this run (another model, other settings).
    #[error("{}: {what}", path.display())]
    Incompatible { path: PathBuf, what: String },
    /// A snapshot handed to `save` that does not match its own shard map (a caller bug).
    #[error("the snapshot is inconsistent: {0}")]
    BadSnapshot(String),
    #[error("{}: cannot {op}: {source}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {what}", path.display())]
    Safetensors { path: PathBuf, what: String },
    /// The background writer stopped without reporting (it panicked).
    #[error("the checkpoint writer thread stopped unexpectedly: {0}")]
    Writer(String),
}

impl CheckpointError {
    pub(crate) fn corrupt(path: &Path, what: impl Into<String>) -> Self {
        Self::Corrupt {
            path: path.to_path_buf(),
            what: what.into(),
        }
    }

    pub(crate) fn incompatible(path: &Path, what: impl Into<String>) -> Self {
        Self::Incompatible {
            path: path.to_path_buf(),
            what: what.into(),
        }
    }
}

/// `io::Result` to a `CheckpointError` naming the path and the operation.
pub(crate) trait IoContext<T> {
    fn at(self, path: &Path, op: &'static str) -> Result<T, CheckpointError>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn at(self, path: &Path, op: &'static str) -> Result<T, CheckpointError> {
        self.map_err(|source| CheckpointError::Io {
            path: path.to_path_buf(),
            op,
            source,
        })
    }
}
