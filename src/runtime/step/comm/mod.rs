//! A rank's communicator and the collectives the training step runs over it.

pub mod collectives;
pub mod communicator;

pub use communicator::{place_later, Comm, CommError, CommStats, Lend};
