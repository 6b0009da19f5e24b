//! What moves when membership changes: the reshard that moves chunks to a new map, the buddy
//! replicas that cover an abrupt loss, the parcels both travel in, the snapshots checkpoints
//! save, and the sources a rank resumes from.
//!
//! Design: docs/elastic.md.

pub mod chunk_set;
pub mod parcel;
pub mod replica;
pub mod reshard;
pub mod resume;
pub mod snapshot;
