//! Why a process-mode run (coordinator or worker) did not finish.

use crate::config::ConfigError;

/// Why a process-mode run did not finish.
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Could not listen, workers did not join, a coordinator did not answer.
    #[error("{0}")]
    Setup(String),
    #[error("the run stopped: {0}")]
    Aborted(String),
    #[error("consolidating parameters failed: {0}")]
    Collect(String),
}
