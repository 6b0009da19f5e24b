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
    /// The metadata store cannot be used as given (an unreachable store, a job id of another
    /// config, a directory that cannot be written): refused before anything starts.
    #[error("{0}")]
    Meta(String),
    /// Another coordinator took the job over: this one commanded nothing more and told the
    /// workers nothing (they follow the new leader).
    #[error("this coordinator no longer leads the job: {0}")]
    Deposed(String),
    /// A standby coordinator outlived the job it stood by for: nothing is left to lead.
    #[error("{0}")]
    Outlived(String),
}
