//! Bring your own model: a model defined outside the crate, trained with ZeRO-3 across rank
//! actors, and checked bit for bit against the single-process oracle.
//!
//! The model is a bigram language model with a low-rank factorisation, split into two units:
//! `embed` (a [vocab, rank] table) and `out` (a [rank, vocab] matrix plus bias). Each unit's
//! parameters are one flat buffer; the runtime gathers, frees and shards them.
//!
//! Run: `cargo run --release --example custom_model`

use std::sync::Arc;

use elastic_zero::config::TrainConfig;
use elastic_zero::data::{markov::MarkovSource, Dataset};
use elastic_zero::model::{MicroBatch, Model, ParamSpec, UnitSpec};
use elastic_zero::reference::train_reference;
use elastic_zero::runtime::{train, ClusterSpec};
use elastic_zero::summary::param_sha256;

const VOCAB: usize = 256;
const RANK: usize = 16;

struct LowRankBigram;

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
            0 => mb
                .inputs
                .iter()
                .flat_map(|&t| p[t as usize * RANK..][..RANK].iter().copied())
                .collect(),
            _ => {
                let (w, b) = p.split_at(RANK * VOCAB);
                let mut out = vec![0f32; n * VOCAB];
                for t in 0..n {
                    let row = &mut out[t * VOCAB..][..VOCAB];
                    row.copy_from_slice(b);
                    for k in 0..RANK {
                        let xk = x[t * RANK + k];
                        for (o, &wv) in row.iter_mut().zip(&w[k * VOCAB..][..VOCAB]) {
                            *o += xk * wv;
                        }
                    }
                }
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
                for (t, &tok) in mb.inputs.iter().enumerate() {
                    for k in 0..RANK {
                        gp[tok as usize * RANK + k] += g[t * RANK + k];
                    }
                }
                Vec::new()
            }
            _ => {
                let (w, _) = p.split_at(RANK * VOCAB);
                let (gw, gb) = gp.split_at_mut(RANK * VOCAB);
                let mut gx = vec![0f32; n * RANK];
                for t in 0..n {
                    let gr = &g[t * VOCAB..][..VOCAB];
                    for (a, &v) in gb.iter_mut().zip(gr) {
                        *a += v;
                    }
                    for k in 0..RANK {
                        let xk = x[t * RANK + k];
                        let wrow = &w[k * VOCAB..][..VOCAB];
                        let mut acc = 0f32;
                        for ((gwv, &gv), &wv) in
                            gw[k * VOCAB..][..VOCAB].iter_mut().zip(gr).zip(wrow)
                        {
                            *gwv += xk * gv;
                            acc += gv * wv;
                        }
                        gx[t * RANK + k] = acc;
                    }
                }
                gx
            }
        }
    }

    fn loss(&self, logits: &[f32], mb: &MicroBatch) -> (f32, Vec<f32>) {
        let n = Self::tokens(mb);
        let mut grad = vec![0f32; logits.len()];
        let mut total = 0f64;
        for t in 0..n {
            let row = &logits[t * VOCAB..][..VOCAB];
            let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let sum: f64 = row.iter().map(|&v| ((v - max) as f64).exp()).sum();
            let target = mb.targets[t] as usize;
            total += sum.ln() - (row[target] - max) as f64;
            for (j, gv) in grad[t * VOCAB..][..VOCAB].iter_mut().enumerate() {
                let prob = (((row[j] - max) as f64).exp() / sum) as f32;
                *gv = (prob - if j == target { 1.0 } else { 0.0 }) / n as f32;
            }
        }
        ((total / n as f64) as f32, grad)
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
    let model: Arc<dyn Model> = Arc::new(LowRankBigram);
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
    Ok(())
}
