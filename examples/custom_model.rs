//! Bring your own model: a model defined outside the crate, trained with ZeRO-3 across rank
//! actors, and checked bit for bit against the single-process oracle.
//!
//! The model is a bigram language model with a low-rank factorisation, split into two units:
//! `embed` (a [vocab, rank] table) and `out` (a [rank, vocab] matrix plus bias). Each unit's
//! parameters are one flat buffer; the runtime gathers, frees and shards them. Its kernels run on
//! a compute backend (`model::backend`), here the CPU reference wrapped in a call counter.
//!
//! Run: `cargo run --release --example custom_model`

use std::sync::Arc;

use elastic_zero::config::TrainConfig;
use elastic_zero::data::{markov::MarkovSource, Dataset};
use elastic_zero::model::backend::{Backend, Counting, Cpu, Op};
use elastic_zero::model::gemm::Layout;
use elastic_zero::model::{MicroBatch, Model, ParamSpec, UnitSpec};
use elastic_zero::reference::train_reference;
use elastic_zero::runtime::{train, ClusterSpec};
use elastic_zero::summary::param_sha256;

const VOCAB: usize = 256;
const RANK: usize = 16;

/// The model and the backend its kernels run on (the runtime's optimizer uses it too).
struct LowRankBigram {
    be: Arc<dyn Backend>,
}

impl LowRankBigram {
    fn tokens(mb: &MicroBatch) -> usize {
        mb.batch * mb.seq
    }
}

impl Model for LowRankBigram {
    fn units(&self) -> Vec<UnitSpec> {
        vec![
            UnitSpec {
                name: "embed".into(),
                params: vec![ParamSpec {
                    name: "embed.weight".into(),
                    shape: vec![VOCAB, RANK],
                }],
            },
            UnitSpec {
                name: "out".into(),
                params: vec![
                    ParamSpec {
                        name: "out.weight".into(),
                        shape: vec![RANK, VOCAB],
                    },
                    ParamSpec {
                        name: "out.bias".into(),
                        shape: vec![VOCAB],
                    },
                ],
            },
        ]
    }

    fn init_unit(&self, unit: usize, seed: u64) -> Vec<f32> {
        // A deterministic pseudo-random init: a pure function of (seed, unit, index).
        let n = self.units()[unit].numel();
        (0..n)
            .map(|i| {
                let mut x =
                    seed ^ ((unit as u64) << 32) ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                x ^= x >> 31;
                x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
                x ^= x >> 29;
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
            })
            .collect()
    }

    fn forward(&self, unit: usize, p: &[f32], x: &[f32], mb: &MicroBatch) -> Vec<f32> {
        let n = Self::tokens(mb);
        match unit {
            0 => {
                let mut h = vec![0f32; n * RANK];
                self.be.embedding_forward(p, &mb.inputs, &mut h);
                h
            }
            _ => {
                // logits = x · W + b, with x: [n, RANK], W: [RANK, VOCAB].
                let (w, b) = p.split_at(RANK * VOCAB);
                let mut out = vec![0f32; n * VOCAB];
                self.be.broadcast_rows(b, &mut out);
                let (lx, lw) = (Layout::row_major(n, RANK), Layout::row_major(RANK, VOCAB));
                let lo = Layout::row_major(n, VOCAB);
                self.be.gemm(x, lx, w, lw, &mut out, lo, true);
                out
            }
        }
    }

    fn backward(
        &self,
        unit: usize,
        p: &[f32],
        x: &[f32],
        g: &[f32],
        mb: &MicroBatch,
        gp: &mut [f32],
    ) -> Vec<f32> {
        let n = Self::tokens(mb);
        match unit {
            0 => {
                self.be.embedding_backward(&mb.inputs, g, gp);
                Vec::new()
            }
            _ => {
                let (w, _) = p.split_at(RANK * VOCAB);
                let (gw, gb) = gp.split_at_mut(RANK * VOCAB);
                self.be.sum_rows(g, gb);
                // dW += xᵀ · g, dx = g · Wᵀ.
                let (lx, lg) = (Layout::row_major(n, RANK), Layout::row_major(n, VOCAB));
                let lw = Layout::row_major(RANK, VOCAB);
                self.be.gemm(x, lx.transposed(), g, lg, gw, lw, true);
                let mut gx = vec![0f32; n * RANK];
                self.be.gemm(g, lg, w, lw.transposed(), &mut gx, lx, false);
                gx
            }
        }
    }

    fn loss(&self, mut logits: Vec<f32>, mb: &MicroBatch) -> (f32, Vec<f32>) {
        // The logits' buffer becomes their gradient.
        let loss = self.be.cross_entropy(&mut logits, &mb.targets, VOCAB);
        (loss, logits)
    }

    fn backend(&self) -> &dyn Backend {
        &*self.be
    }

    fn vocab(&self) -> usize {
        VOCAB
    }

    fn max_seq(&self) -> usize {
        usize::MAX
    }
}

fn main() -> anyhow::Result<()> {
    let cfg = TrainConfig {
        ranks: 3,
        stage: 3,
        steps: 30,
        seq_len: 32,
        micro_batches: 6,
        chunk_elems: 512,
        ..TrainConfig::default()
    };
    // The CPU reference backend, wrapped to count what the model and the optimizer ask of it.
    let be = Arc::new(Counting::new(Cpu));
    let model: Arc<dyn Model> = Arc::new(LowRankBigram { be: be.clone() });
    let data = Arc::new(Dataset::Markov(MarkovSource::new(cfg.seed)));
    let spec = ClusterSpec::new(model.clone(), data.clone(), cfg.clone());
    let rt = tokio::runtime::Runtime::new()?;
    let out = rt.block_on(train(
        spec,
        |rec: &elastic_zero::engine::coordinator::StepRecord| {
            if rec.step.is_multiple_of(5) {
                println!("step {:>3}  loss {:.4}", rec.step, rec.loss);
            }
        },
    ))?;
    let sharded = param_sha256(&out.params);
    let oracle = param_sha256(&train_reference(&cfg, model.as_ref(), &data, None).params);
    println!("ZeRO-3 on 3 ranks: {sharded}\nsingle process:    {oracle}");
    anyhow::ensure!(
        sharded == oracle,
        "the sharded run diverged from the oracle"
    );
    println!("bit-identical");
    let calls: Vec<String> = Op::ALL
        .into_iter()
        .filter(|&op| be.calls(op) > 0)
        .map(|op| format!("{op:?} {}", be.calls(op)))
        .collect();
    println!("backend calls: {}", calls.join(", "));
    anyhow::ensure!(
        be.calls(Op::Gemm) > 0 && be.calls(Op::OptimizerUpdate) > 0,
        "the model's products and the optimizer must run on its backend"
    );
    Ok(())
}
