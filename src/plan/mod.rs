//! The plan layer: pure data and functions. Shard layout, step schedules, the memory model and
//! communication volumes. Nothing here touches threads, sockets, clocks or the runtime.
//!
//! Design: docs/sharding.md.

pub mod activations;
pub mod device;
pub mod memory;
pub mod rebalance;
pub mod replica;
pub mod schedule;
pub mod shard_map;
pub mod tier;
pub mod volume;

pub use schedule::{Phase, Stage};
pub use shard_map::{ChunkId, PlanError, RankId, ShardMap};
