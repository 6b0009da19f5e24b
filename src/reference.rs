//! The oracle: a plain single-process trainer with no actors, no sharding and no communication.
//!
//! Every sharded, elastic or faulted run in exact mode must end with the same parameters as this
//! loop, bit for bit. It shares only the pure numerics with the runtime (the model, exact
//! quantization, the optimizer kernels), and runs them the simplest way: all micro-batches in
//! index order, whole-unit optimizer calls.

use crate::config::TrainConfig;
use crate::data::Dataset;
use crate::engine::coordinator::mean_in_order;
use crate::job::{lr_schedule, optim_settings};
use crate::model::backend::Precision;
use crate::model::gemm::round_bf16;
use crate::model::tie::Ties;
use crate::model::Model;
use crate::optim::OptimState;
use crate::reduce::exact::{self, QuantStats};
use crate::reduce::{grad_buf, GradBuf, SumSquares};

/// Parameters and per-step losses of a reference run.
pub struct ReferenceOutcome {
    pub params: Vec<Vec<f32>>,
    pub losses: Vec<f64>,
}

/// Trains `cfg.steps` steps on one thread and returns the final parameters.
pub fn train_reference(
    cfg: &TrainConfig,
    model: &dyn Model,
    data: &Dataset,
    init: Option<Vec<Vec<f32>>>,
) -> ReferenceOutcome {
    let units = model.units().len();
    let mut params: Vec<Vec<f32>> =
        init.unwrap_or_else(|| (0..units).map(|u| model.init_unit(u, cfg.seed)).collect());
    let settings = optim_settings(cfg);
    let lr = lr_schedule(cfg);
    let mut opt: Vec<OptimState> = params
        .iter()
        .map(|p| OptimState::new(settings.kind, p.len()))
        .collect();
    let m = cfg.micro_batches;
    let ties = Ties::of(model).expect("the model's ties are checked when it is built");
    let terms = ties.terms();
    let mut bounds = vec![cfg.initial_grad_bound; units];
    let mut opt_step = 0u64;
    let mut losses = Vec::new();
    for step in 0..cfg.steps {
        let mut attempt = 0;
        let (grads, stats, exps, step_losses) = loop {
            let exps: Vec<i32> = bounds
                .iter()
                .zip(&terms)
                .map(|(&b, &t)| exact::scale_exponent(b, m * t))
                .collect();
            let (grads, stats, l) = accumulate(cfg, model, &ties, data, &params, &exps, step);
            let overflow = stats.iter().any(|s| s.overflow);
            let finite = stats.iter().all(|s| s.max_abs.is_finite());
            if overflow && finite && attempt == 0 {
                bounds = stats.iter().map(|s| exact::next_bound(s.max_abs)).collect();
                attempt += 1;
                continue;
            }
            break (grads, stats, exps, l);
        };
        losses.push(mean_in_order(&step_losses));
        if !stats.iter().any(|s| s.overflow) {
            let ss: Vec<SumSquares> = grads.iter().map(|g| g.sum_squares(0..g.len())).collect();
            let norm = grad_buf::global_norm(cfg.reduce, &ss, &exps, m);
            let clip = exact::clip_coefficient(norm, cfg.grad_clip as f64);
            opt_step += 1;
            let lr_now = lr.lr_at(opt_step);
            for u in 0..units {
                let mut g = vec![0f32; grads[u].len()];
                grads[u].to_f32(
                    0..g.len(),
                    grad_buf::mean_factor(cfg.reduce, exps[u], m),
                    &mut g,
                );
                grad_buf::apply_clip(&mut g, clip);
                let st = &mut opt[u];
                let (p, m, v) = (&mut params[u], &mut st.m, &mut st.v);
                let be = model.backend();
                be.optimizer_update(&settings, p, &g, m, v, opt_step, lr_now);
            }
        }
        bounds = stats.iter().map(|s| exact::next_bound(s.max_abs)).collect();
    }
    ReferenceOutcome { params, losses }
}

/// Forward and backward of every micro-batch of `step`, accumulated per unit.
fn accumulate(
    cfg: &TrainConfig,
    model: &dyn Model,
    ties: &Ties,
    data: &Dataset,
    params: &[Vec<f32>],
    exps: &[i32],
    step: u64,
) -> (Vec<GradBuf>, Vec<QuantStats>, Vec<f32>) {
    let units = params.len();
    let m = cfg.micro_batches;
    let terms = ties.terms();
    let mut grads: Vec<GradBuf> = params
        .iter()
        .map(|p| GradBuf::zeros(cfg.reduce, p.len()))
        .collect();
    let mut stats = vec![QuantStats::default(); units];
    let mut losses = Vec::new();
    // Under bf16 mixed precision the model computes with the parameters rounded to bf16.
    let rounded: Vec<Vec<f32>>;
    let params = match cfg.precision {
        Precision::Fp32 => params,
        Precision::Bf16 => {
            rounded = params
                .iter()
                .map(|p| p.iter().map(|&x| round_bf16(x)).collect())
                .collect();
            &rounded[..]
        }
    };
    for i in 0..m {
        let mb = data.micro_batch(cfg.seed, step, i as u64, cfg.micro_batch_size, cfg.seq_len);
        let mut inputs: Vec<Vec<f32>> = vec![Vec::new()];
        for u in 0..units {
            let view = ties.view(u, |v| &params[v]);
            let out = model.forward(u, &view, &inputs[u], &mb);
            inputs.push(out);
        }
        let logits = inputs.pop().unwrap_or_default();
        let (loss, mut g) = model.loss(logits, &mb);
        losses.push(loss);
        for u in (0..units).rev() {
            let view = ties.view(u, |v| &params[v]);
            let mut gp = vec![0f32; view.len()];
            g = model.backward(u, &view, &inputs[u], &g, &mb, &mut gp);
            for (t, r, part) in ties.borrowed_grads(u, &gp) {
                let o = t.owner;
                let st = grads[o].accumulate(r.start, part, exps[o], m * terms[o]);
                stats[o] = stats[o].merge(st);
            }
            let own = ties.own_grad(u, &gp);
            stats[u] = stats[u].merge(grads[u].accumulate(0, own, exps[u], m * terms[u]));
        }
    }
    (grads, stats, losses)
}
