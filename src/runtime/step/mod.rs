//! One rank's step and what the rank owns, in four parts whose imports point one way:
//!
//! | part | what it owns |
//! |---|---|
//! | [`comm`] | the communicator (frame matching, deadlines, bounds, frames in pieces) and the training collectives over it |
//! | [`state`] | a rank's shards: chunk state, the full copy, the NVMe tier's reads and writes, owed updates, start weights |
//! | [`elastic`] | what moves when membership changes: reshards, buddy replicas, parcels, snapshots and resume sources |
//! | [`exec`] | the step executor and the work a rank's thread runs |
//!
//! `comm` and `state` know nothing of each other; `elastic` builds on both; `exec` on all three.
//! [`progress`] (counters the CLI and the coordinator read) is below them all.
//!
//! Everything here runs on a rank's own OS thread and is synchronous; it knows nothing of
//! actors. Imports: the transport seam below it (`runtime::transport`), and `plan`, `engine`
//! (messages, the memory ledger, progress), `model`, `optim`, `reduce`, `data`, `config` and
//! `wire`. Never `actors`, `api` or `procs`. `tests/tidy.rs` checks the order (its `LAYERS`).
//!
//! Design: docs/sharding.md.

pub mod comm;
pub mod elastic;
pub mod exec;
pub mod progress;
pub mod state;
