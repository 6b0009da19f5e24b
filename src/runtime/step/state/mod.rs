//! What a rank owns of the model's training state: its chunks (parameters, gradients, optimizer
//! moments, masters), the full copy stages 0-2 keep, the NVMe tier's reads and writes, the
//! updates a tier still owes, and the weights a rank starts from.
//!
//! Design: docs/memory-and-tier.md.

pub mod full_copy;
pub mod offload;
pub mod owed;
pub mod rank_state;
pub mod start_weights;
pub mod tier_io;
pub mod tier_reads;
