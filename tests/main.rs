//! The integration tests, one module per file, built as one test binary (`integration`).
//!
//! One binary instead of one per file: each binary links the whole crate and instantiates the
//! generic runtime code it calls again, and with fifteen of them that was most of a clean test
//! build's CPU time. Run one file's tests with `cargo test --test integration FILE::`, e.g.
//! `cargo test --test integration procs::`. The chaos harness stays a binary of its own
//! (`cargo test --test chaos`).

mod common;

mod accounting;
mod backend;
mod bitwise;
mod checkpoint_integrity;
mod checkpoint_resume;
mod checkpoint_tools;
mod cli;
mod cluster_examples;
mod control;
mod device;
mod elastic;
mod finetune;
mod gguf;
mod hf;
mod hf_llama;
mod instruct;
mod meta;
mod mixed_precision;
mod observe;
mod offload;
mod offload_owed;
mod procs;
mod procs_checkpoint;
mod procs_cluster;
mod procs_elastic;
mod procs_failover;
#[cfg(feature = "ucx")]
mod procs_ucx;
mod quic;
mod resume;
mod tidy;
mod wire;
