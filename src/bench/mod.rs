//! Micro-benchmarks of the runtime's hot kernels, as library functions (the CLI drives them).

pub mod adam;
pub mod collectives;
pub mod gemm;
pub mod io;
