//! Worker processes: the coordinator process and the worker processes, the control plane
//! between them (framed messages, heartbeats), the proxies that let the unchanged actors talk
//! across processes, standbys and joins, and the start state sent to each worker.
//!
//! The top of the runtime: it may import every other part (`api`, `actors`, `step`,
//! `transport`); nothing in the runtime imports it.
//!
//! Design: docs/processes.md.

mod admit;
mod conn;
pub mod control_plane;
pub mod coord;
pub mod error;
pub mod heartbeat;
mod join;
pub mod lead;
mod link;
pub mod notice;
pub mod planes;
pub mod proxy;
mod standby;
pub mod state;
mod takeover;
pub mod worker;
