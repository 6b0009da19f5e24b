//! elastic-zero: ZeRO-sharded data-parallel training that keeps going when ranks come and go.
//!
//! Layers, with imports pointing one way:
//! - [`plan`]: pure data and functions (shard map, schedules, memory model, volumes);
//! - [`engine`]: state machines that take events and the time and emit commands (no I/O);
//! - [`runtime`]: ractor actors, threads and transports that execute those commands.
//!
//! Leaf numerics the runtime and the oracle share: [`model`] (the model boundary and the built-in
//! GPT and MLP), [`optim`] (Adam, AdamW, SGD on flat shards), [`reduce`] (exact fixed-point
//! reduction), [`data`] (micro-batches as pure functions of seed, step and index),
//! [`param_digest`] (the `param-sha256` every layer compares).
//!
//! [`checkpoint`] sits above the runtime: it saves, verifies and restores what the runtime
//! snapshots at step boundaries.

pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod engine;
pub mod job;
pub mod model;
pub mod net;
pub mod optim;
pub mod param_digest;
pub mod plan;
pub mod reduce;
pub mod reference;
pub mod runtime;
pub mod summary;
pub mod wire;
