//! Micro-benchmarks of the runtime's hot kernels, as library functions (the CLI drives them).
//!
//! Results, and how to run them: BENCHMARKS.md.

pub mod adam;
pub mod collectives;
pub mod gemm;
pub mod io;
