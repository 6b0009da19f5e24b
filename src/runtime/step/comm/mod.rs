//! A rank's communicator and the collectives the training step runs over it.
//!
//! Design: docs/sharding.md, docs/wire.md.

pub mod collectives;
pub mod communicator;

pub use communicator::{place_later, Comm, CommError, CommStats, Lend};
