//! One rank's step and what the rank owns: its chunk state, the communicator and the collectives
//! over it, the step executor, resharding, buddy replicas and the sources a rank resumes from.
//!
//! Everything here runs on a rank's own OS thread and is synchronous; it knows nothing of
//! actors. Imports: the transport seam below it (`runtime::transport`), and `plan`, `engine`
//! (messages, the memory ledger, progress), `model`, `optim`, `reduce`, `data`, `config` and
//! `wire`. Never `actors`, `api` or `procs`.

pub mod all_reduce;
mod all_reduce_pull;
mod broadcast_pull;
pub mod chunk_set;
pub mod collectives;
pub mod comm;
pub mod exec;
pub mod full_copy;
pub mod offload;
pub mod owed;
pub mod parcel;
pub mod progress;
mod pull_notice;
pub mod rank_state;
pub mod replica;
pub mod reshard;
pub mod resume;
pub mod snapshot;
pub mod start_weights;
pub mod tier_io;
pub mod tier_reads;
pub mod work;
