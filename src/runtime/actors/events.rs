//! What a cluster reports to whoever drives it.

use crate::engine::coordinator::{MembershipRecord, StepRecord};
use crate::plan::RankId;
use crate::runtime::step::elastic::snapshot::Snapshot;

/// What the cluster reports to whoever drives it. Embedders match it with a wildcard arm:
/// events may be added.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum ClusterEvent {
    Step(Box<StepRecord>),
    /// Taken at a step boundary; training has already moved on (write it in the background).
    Snapshot(Box<Snapshot>),
    /// A snapshot was streamed into the snapshot sink before training went on (state on the
    /// tier); `saved` is the sink's outcome (`Err`: this save failed, training goes on).
    SnapshotStreamed {
        step: u64,
        saved: Result<(), String>,
    },
    /// The membership changed and the shards were rebalanced in place.
    Membership(Box<MembershipRecord>),
    /// A joiner did not come up; training goes on without it.
    JoinFailed {
        rank: RankId,
        reason: String,
    },
    Finished,
    Aborted(String),
    /// The metadata store refused this coordinator's commit: another leader took the job
    /// over. This coordinator commands nothing more and must not tell the ranks to stop.
    Deposed(String),
}
