//! The compute seam: the built-in models run every kernel, and the runtime every optimizer
//! update, on the model's backend.

use std::sync::Arc;

use crate::common::{run_cfg, small, train_blocking};
use elastic_zero::config::{ModelKind, TrainConfig};
use elastic_zero::job::{build_dataset, build_model_on};
use elastic_zero::model::backend::{Counting, Cpu, Op};
use elastic_zero::runtime::ClusterSpec;
use elastic_zero::summary::param_sha256;

#[test]
fn the_built_in_models_train_through_their_backend_with_the_same_bits() {
    for kind in [ModelKind::Mlp, ModelKind::Gpt, ModelKind::Llama] {
        for stage in [1, 3] {
            let cfg = TrainConfig {
                ranks: 2,
                stage,
                ..small(kind)
            };
            let want = param_sha256(&run_cfg(&cfg).unwrap().params);
            let be = Arc::new(Counting::new(Cpu));
            let model = build_model_on(&cfg, be.clone()).unwrap();
            let data = build_dataset(&cfg).unwrap();
            let out = train_blocking(ClusterSpec::new(model, data, cfg.clone()), ()).unwrap();
            assert_eq!(param_sha256(&out.params), want, "{kind:?} stage {stage}");
            // The MLP has no attention; everything else each model needs went through `be`.
            let llama_only = [Op::RmsNormForward, Op::RmsNormBackward, Op::Silu, Op::Rope];
            let unused = match kind {
                ModelKind::Mlp => [
                    &llama_only[..],
                    &[Op::AttentionForward, Op::AttentionBackward],
                ]
                .concat(),
                ModelKind::Gpt => llama_only.to_vec(),
                ModelKind::Llama => vec![Op::LayerNormForward, Op::LayerNormBackward, Op::Gelu],
            };
            assert_eq!(be.never_called(), unused, "{kind:?} stage {stage}");
            // Every step updates every unit's shard on every rank that owns a piece of it.
            let units = (cfg.layers + 2) as u64;
            assert!(
                be.calls(Op::OptimizerUpdate) >= cfg.steps * units,
                "{kind:?}: {} optimizer updates",
                be.calls(Op::OptimizerUpdate)
            );
        }
    }
}

#[test]
fn the_gpts_products_are_all_on_its_backend() {
    // One step recomputing activations runs every block's products four times (the forward,
    // its recomputation and the backward's two) and the head's three times; attention skips
    // its masked upper triangle. So the multiply-adds counted are at least three times the
    // linear layers' and at most four times the whole forward's.
    let cfg = TrainConfig {
        ranks: 1,
        steps: 1,
        ..small(ModelKind::Gpt)
    };
    let be = Arc::new(Counting::new(Cpu));
    let model = build_model_on(&cfg, be.clone()).unwrap();
    let data = build_dataset(&cfg).unwrap();
    let tokens = cfg.micro_batches as u64 * cfg.micro_batch_size as u64 * cfg.seq_len as u64;
    let forward_macs = model.forward_flops(tokens, cfg.seq_len as u64).unwrap() / 2;
    let (d, l, v) = (cfg.d_model as u64, cfg.layers as u64, 256u64);
    let linear_macs = tokens * (l * 12 * d * d + d * v);
    train_blocking(ClusterSpec::new(model, data, cfg), ()).unwrap();
    let macs = be.gemm_macs();
    assert!(
        macs >= 3 * linear_macs && macs <= 4 * forward_macs,
        "{macs} multiply-adds; linear layers {linear_macs}, forward {forward_macs}"
    );
}
