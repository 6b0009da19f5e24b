//! A worker's notice: given SIGTERM (a pod eviction, a spot preemption), a worker process asks
//! to be drained at the next step boundary instead of vanishing.

use crate::plan::RankId;

/// A worker's notice, as the coordinator received it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notice {
    pub rank: RankId,
    /// What gave notice (`SIGTERM`).
    pub cause: String,
    /// How long the worker waits for its drain before it exits anyway.
    pub grace_ms: u64,
    /// When the notice arrived, on the coordinator's clock.
    pub at_ms: u64,
}
