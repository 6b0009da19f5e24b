//! The runtime layer: ractor actors, threads and transports that execute what the plan and the
//! engines decide. Nothing below it (plan, engine, the numerics, wire) imports it; `checkpoint`,
//! `bench` and the `ezero` binary sit above it.
//!
//! One folder per part. Imports point down this list, never up:
//!
//! | part | what it owns |
//! |---|---|
//! | `clock`, `alloc` | the injected clock; the process's allocator setting |
//! | [`storage`] | the storage seam: the NVMe tier's files, direct I/O and io_uring |
//! | [`transport`] | the one network seam (`Transport`) and its implementations: in-process, simulated faults, TLS TCP, QUIC, UCX |
//! | [`step`] | one rank's step, in four parts: `comm`, `state`, `elastic`, `exec` |
//! | [`actors`] | the coordinator and rank actors and the messages they exchange |
//! | [`api`] | the embedder's and operator's surface: the cluster API, the control handle, status, HTTP |
//! | [`procs`] | worker processes: the coordinator and worker processes, their control plane, standbys, joins |
//!
//! `tests/tidy.rs` checks the order (its `LAYERS`); a new part takes a row here and there.
//!
//! Design: docs/layout.md.

pub mod actors;
pub mod alloc;
pub mod api;
pub mod clock;
pub mod meta;
pub mod procs;
pub mod step;
pub mod storage;
pub mod transport;

pub use api::cluster::{train, Cluster, ClusterError, ClusterSpec, TrainOutcome};
pub use api::control::{ControlError, ControlHandle};
pub use api::job::{ClusterBuilder, ElasticJob};
pub use api::status::{ChangeRecord, Status};
