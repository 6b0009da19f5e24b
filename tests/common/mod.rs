//! Shared helpers for the integration tests.
#![allow(dead_code)]

pub mod etcd;
pub mod ezero;
pub mod procs;

use elastic_zero::config::{ModelKind, TrainConfig};
use elastic_zero::runtime::api::cluster::Observer;
use elastic_zero::runtime::{train, ClusterError, ClusterSpec, TrainOutcome};

/// A small, fast config: a 2-layer MLP (or GPT) that trains a few steps in well under a second.
/// A small job of `model`. The Llama is the family's every feature at once: grouped-query
/// attention (4 heads over 2), Qwen2's q/k/v biases and a tied head.
pub fn small(model: ModelKind) -> TrainConfig {
    let llama = model == ModelKind::Llama;
    TrainConfig {
        model,
        kv_heads: if llama { 2 } else { 0 },
        ffn: if llama { 48 } else { 0 },
        qkv_bias: llama,
        tie_embeddings: llama,
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
    let mut cfg = cfg.clone();
    cfg.faults.panic_at = panic_at;
    let spec = ClusterSpec::from_config(cfg).expect("valid config");
    train_blocking(spec, ())
}

/// Runs `spec` to the end on a 2-thread tokio runtime, feeding `observer`.
pub fn train_blocking(
    spec: ClusterSpec,
    observer: impl Observer,
) -> Result<TrainOutcome, ClusterError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(train(spec, observer))
}
