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
//! Beside them: [`config`] (the typed config), [`job`] (a config made into a model, dataset and
//! optimizer), [`reference`] (the single-process oracle, which imports nothing of the runtime it
//! checks), [`net`] (TLS identities, sockets) and [`wire`] (the frame and its wire format).
//!
//! [`checkpoint`] and [`bench`] sit above the runtime: the first saves, verifies and restores
//! what the runtime snapshots at step boundaries.
//!
//! `tests/tidy.rs` keeps the order: its `LAYERS` lists every part, bottom first, and a module
//! may import only its own part and the parts below it (docs/layout.md).
//!
//! Design: docs/layout.md (the parts and their order), and one page a part under docs/.

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
