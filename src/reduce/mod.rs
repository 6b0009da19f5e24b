//! Gradient reduction numerics: exact 64-bit fixed point and the plain `f32` fast path.
//! Pure functions and buffers; the runtime's collectives move the bytes.
//!
//! Design: docs/exact-reduction.md.

pub mod exact;
pub mod grad_buf;
pub mod le;

pub use grad_buf::{GradBuf, ReduceMode, SumSquares};
