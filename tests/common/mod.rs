//! Shared helpers for the integration tests.
#![allow(dead_code)]

use elastic_zero::config::{ModelKind, TrainConfig};
use elastic_zero::job::{build_dataset, build_model};
use elastic_zero::runtime::{train, ClusterError, ClusterSpec, TrainOutcome};

/// A small, fast config: a 2-layer MLP (or GPT) that trains a few steps in well under a second.
pub fn small(model: ModelKind) -> TrainConfig {
    TrainConfig {
        model,
        layers: 2,
        d_model: 32,
        heads: 4,
        seq_len: 16,
        micro_batches: 6,
        micro_batch_size: 2,
        steps: 3,
        chunk_elems: 1000,
        warmup_steps: 1,
        sample_tokens: 0,
        ..TrainConfig::default()
    }
}

pub fn run_cfg(cfg: &TrainConfig) -> Result<TrainOutcome, ClusterError> {
    run_with(cfg, None)
}

pub fn run_with(
    cfg: &TrainConfig,
    panic_at: Option<(u32, u64)>,
) -> Result<TrainOutcome, ClusterError> {
    let model = build_model(cfg).expect("valid model");
    let data = build_dataset(cfg).expect("valid data");
    let spec = ClusterSpec {
        config: cfg.clone(),
        model,
        data,
        init_params: None,
        resume: None,
        snapshot_every: 0,
        panic_at,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(train(spec, ()))
}
