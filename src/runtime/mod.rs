//! The runtime layer: ractor actors, threads and transports that execute what the plan and the
//! engines decide. Nothing above this layer imports it.
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
//! `tests/tidy.rs` checks the order.

pub mod actors;
pub mod alloc;
pub mod api;
pub mod clock;
pub mod procs;
pub mod step;
pub mod transport;

pub use api::cluster::{train, Cluster, ClusterError, ClusterSpec, TrainOutcome};
pub use api::control::{ControlError, ControlHandle};
pub use api::job::{ClusterBuilder, ElasticJob};
pub use api::status::{ChangeRecord, Status};
