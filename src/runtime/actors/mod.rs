//! The actors: one rank actor per rank (`rank`), which runs each job on the rank's own thread,
//! and the coordinator actor (`coord`), which drives the `engine::coordinator` state machine and
//! carries out its commands. `messages` holds what they exchange, `events` what the cluster
//! reports to its driver, `collect` gathering every chunk's state.
//!
//! Imports: `step`, `transport` and `clock` below, and the engines they drive; never `api` or
//! `procs`.
//!
//! Design: docs/sharding.md, docs/elastic.md.

pub mod collect;
pub mod coord;
pub mod events;
pub mod messages;
pub mod rank;

pub use self::collect::collect_chunks;
pub use self::coord::{
    BoundarySnapshot, Committer, CoordArgs, CoordinatorActor, NewRank, RankFactory,
};
pub use self::events::ClusterEvent;
pub use self::messages::{Activity, CoordMsg, CoordView, RankMsg};
pub use self::rank::{RankActor, RankArgs};
pub use crate::runtime::step::elastic::snapshot::Snapshot;
pub use crate::runtime::step::exec::work::{RankSetup, Work};
