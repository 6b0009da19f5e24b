//! The runtime layer: ractor actors, threads and transports that execute what the plan and the
//! engines decide. Nothing below it (plan, engine, the numerics, wire) imports it; `checkpoint`,
//! `bench` and the `ezero` binary sit above it.
//!
//! One folder per part. Imports point down this list, never up:
//!
//! | part | what it owns |
//! |---|---|
//! | `clock`, `alloc` | the injected clock; the process's allocator setting |
//! | [`transport`] | the one network seam (`Transport`) and its implementations: in-process, simulated faults, TCP, QUIC |
//! | [`step`] | one rank's step: what a rank owns, the communicator, collectives, the executor, resharding, replicas, resume sources |
//! | [`actors`] | the coordinator and rank actors and the messages they exchange |
//! | [`api`] | the embedder's and operator's surface: the cluster API, the control handle, status, HTTP |
//! | [`procs`] | worker processes: the coordinator and worker processes, their control plane, standbys, joins |
//!
//! `tests/tidy.rs` checks the order (its `LAYERS`). A new part takes a row here and there: a
//! storage tier for offloaded shards would sit beside `transport` (the storage seam, below
//! `step`), a UCX transport under `transport/`, GPU buffers behind a cargo feature.

pub mod actors;
pub mod alloc;
pub mod api;
pub mod clock;
pub mod procs;
pub mod step;
pub mod storage;
pub mod transport;

pub use api::cluster::{train, Cluster, ClusterError, ClusterSpec, TrainOutcome};
pub use api::control::{ControlError, ControlHandle};
pub use api::job::{ClusterBuilder, ElasticJob};
pub use api::status::{ChangeRecord, Status};

// The paths before the runtime had folders, kept for embedders; each resolves to where its
// items moved.

#[deprecated(note = "moved to `runtime::api::cluster`")]
pub mod cluster {
    pub use super::api::cluster::*;
}
#[deprecated(note = "moved to `runtime::api::control` (the handle) and `runtime::api::job`")]
pub mod control {
    pub use super::api::control::*;
    pub use super::api::job::*;
}
#[deprecated(note = "moved to `runtime::api::status`")]
pub mod status {
    pub use super::api::status::*;
}
#[deprecated(note = "moved to `runtime::api::http`")]
pub mod http {
    pub use super::api::http::*;
}
#[deprecated(note = "moved to `runtime::actors::coord` and `runtime::actors::messages`")]
pub mod coord_actor {
    pub use super::actors::coord::*;
    pub use super::actors::messages::{Activity, CoordMsg, CoordView};
}
#[deprecated(
    note = "moved to `runtime::actors::rank`, `runtime::actors::messages` and `runtime::step::work`"
)]
pub mod rank_actor {
    pub use super::actors::messages::RankMsg;
    pub use super::actors::rank::*;
    pub use super::step::work::{RankSetup, Work};
}
#[deprecated(note = "moved to `runtime::step::comm`")]
pub mod comm {
    pub use super::step::comm::*;
}
#[deprecated(note = "moved to `runtime::step::collectives` (and the f32 layout to `wire::f32s`)")]
pub mod collectives {
    pub use super::step::collectives::*;
    pub use crate::wire::f32s::{decode_f32_into, encode_f32};
}
#[deprecated(note = "moved to `runtime::step::rank_state`")]
pub mod rank_state {
    pub use super::step::rank_state::*;
}
#[deprecated(note = "moved to `runtime::step::replica`")]
pub mod replica {
    pub use super::step::replica::*;
}
#[deprecated(note = "moved to `runtime::step::reshard`")]
pub mod reshard {
    pub use super::step::reshard::*;
}
#[deprecated(note = "moved to `runtime::step::resume`")]
pub mod resume {
    pub use super::step::resume::*;
}
#[deprecated(note = "moved to `runtime::transport::local`")]
pub mod local {
    pub use super::transport::local::*;
}
#[deprecated(note = "moved to `runtime::transport::net_faults`")]
pub mod net_faults {
    pub use super::transport::net_faults::*;
}
#[deprecated(note = "moved to `runtime::transport::tcp`")]
pub mod tcp {
    pub use super::transport::tcp::*;
}
#[deprecated(note = "moved to `runtime::transport::quic`")]
pub mod quic {
    pub use super::transport::quic::*;
}
#[deprecated(note = "moved to `runtime::procs::control_plane`")]
pub mod control_plane {
    pub use super::procs::control_plane::*;
}
#[deprecated(note = "moved to `runtime::procs::heartbeat`")]
pub mod heartbeat {
    pub use super::procs::heartbeat::*;
}
#[deprecated(
    note = "moved to `runtime::procs::proxy` (and `Detached` to `runtime::transport::detached`)"
)]
pub mod proxy {
    pub use super::procs::proxy::*;
    pub use super::transport::detached::Detached;
}
#[deprecated(note = "moved to `runtime::procs::coord`")]
pub mod proc_coord {
    pub use super::procs::coord::*;
}
#[deprecated(note = "moved to `runtime::procs::state`")]
pub mod proc_state {
    pub use super::procs::state::*;
}
#[deprecated(note = "moved to `runtime::procs::worker`")]
pub mod proc_worker {
    pub use super::procs::worker::*;
}

#[cfg(test)]
#[allow(deprecated)]
mod old_paths {
    use std::any::TypeId;

    fn same<A: 'static, B: 'static>() -> bool {
        TypeId::of::<A>() == TypeId::of::<B>()
    }

    #[test]
    fn the_old_paths_name_the_moved_items() {
        use super::transport::local::LocalEndpoint as L;
        assert!(same::<
            super::cluster::ClusterSpec,
            super::api::cluster::ClusterSpec,
        >());
        assert!(same::<
            super::control::ClusterBuilder,
            super::api::job::ClusterBuilder,
        >());
        assert!(same::<
            super::control::ControlHandle,
            super::api::control::ControlHandle,
        >());
        assert!(same::<super::status::RunState, super::api::status::RunState>());
        assert!(same::<
            super::coord_actor::CoordMsg<L>,
            super::actors::CoordMsg<L>,
        >());
        assert!(same::<
            super::rank_actor::RankMsg<L>,
            super::actors::RankMsg<L>,
        >());
        assert!(same::<super::rank_actor::Work<L>, super::step::work::Work<L>>());
        assert!(same::<super::comm::Comm<L>, super::step::comm::Comm<L>>());
        assert!(same::<
            super::rank_state::ChunkState,
            super::step::rank_state::ChunkState,
        >());
        assert!(same::<
            super::local::NetCounts,
            super::transport::net_faults::NetCounts,
        >());
        assert!(same::<
            super::quic::QuicConfig,
            super::transport::quic::QuicConfig,
        >());
        assert!(same::<
            super::proxy::Detached,
            super::transport::detached::Detached,
        >());
        assert!(same::<
            super::proc_coord::ProcError,
            super::procs::error::ProcError,
        >());
        assert!(same::<
            super::proc_state::StartState,
            super::procs::state::StartState,
        >());
    }
}
