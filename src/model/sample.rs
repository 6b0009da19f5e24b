//! Running a model end to end outside the training runtime: the forward chain through every
//! unit, and autoregressive sampling on top of it (for eyeballing what a checkpoint learned).
//!
//! Sampling is reproducible: its randomness comes only from a [`SplitMix64`] seeded by the
//! caller, and the model's forward is deterministic.

use super::ops::exp;
use super::rng::SplitMix64;
use super::tie::Ties;
use super::{MicroBatch, Model};

/// Logits `[batch, seq, vocab]` of `mb`: every unit's forward in order, `params[u]` being unit
/// `u`'s full flat buffer.
pub fn forward_logits(model: &dyn Model, params: &[Vec<f32>], mb: &MicroBatch) -> Vec<f32> {
    let ties = Ties::of(model).expect("the model's ties are checked when it is built");
    (0..params.len()).fold(Vec::new(), |x, unit| {
        model.forward(unit, &ties.view(unit, |u| &params[u]), &x, mb)
    })
}

/// Continues `prompt` by `new_tokens` tokens and returns only the new ones.
///
/// Each step re-runs the full forward (batch 1) on the last `min(len, max_seq)` tokens and draws
/// the next token from `softmax(logits / temperature)` of the last position; `temperature <= 0`
/// (or NaN) means greedy, ties going to the lowest id. An empty prompt gives no context to
/// condition on, so it yields no tokens.
///
/// # Panics
/// If `params` does not hold one buffer per unit, or `prompt` has ids `>= model.vocab()`.
pub fn generate(
    model: &dyn Model,
    params: &[Vec<f32>],
    prompt: &[u32],
    new_tokens: usize,
    temperature: f32,
    seed: u64,
) -> Vec<u32> {
    let s = Sampling {
        new_tokens,
        temperature,
        top_k: 0,
        seed,
        stop: None,
    };
    generate_recompute(model, params, prompt, s)
}

/// [`generate`] with every [`Sampling`] setting: the forward re-run on the context per token.
fn generate_recompute(
    model: &dyn Model,
    params: &[Vec<f32>],
    prompt: &[u32],
    s: Sampling,
) -> Vec<u32> {
    assert_eq!(
        params.len(),
        model.units().len(),
        "one parameter buffer per unit"
    );
    let (vocab, window) = (model.vocab(), model.max_seq());
    if prompt.is_empty() || window == 0 {
        return Vec::new();
    }
    let mut rng = SplitMix64::new(s.seed);
    let mut tokens = prompt.to_vec();
    for _ in 0..s.new_tokens {
        let ctx = &tokens[tokens.len() - tokens.len().min(window)..];
        let mb = MicroBatch {
            loss_mask: None,
            inputs: ctx.to_vec(),
            targets: vec![0; ctx.len()],
            batch: 1,
            seq: ctx.len(),
        };
        let mut logits = forward_logits(model, params, &mb).split_off((ctx.len() - 1) * vocab);
        let next = draw(&mut logits, &s, &mut rng);
        tokens.push(next);
        if Some(next) == s.stop {
            break;
        }
    }
    tokens.split_off(prompt.len())
}

/// How [`generate_cached`] samples.
#[derive(Clone, Copy, Debug)]
pub struct Sampling {
    pub new_tokens: usize,
    /// `<= 0` (or NaN): greedy.
    pub temperature: f32,
    /// Draw only among the `top_k` largest logits; 0 keeps them all.
    pub top_k: usize,
    pub seed: u64,
    /// Stop after emitting this token (the tokenizer's end of text).
    pub stop: Option<u32>,
}

/// Continues `prompt` with the model's KV-cache decoder ([`Model::decoder`]), or, for a model
/// without one, by re-running the forward on the context (as [`generate`] does). Returns only the new
/// tokens; with a decoder it stops at the model's position table.
pub fn generate_cached(
    model: &dyn Model,
    params: &[Vec<f32>],
    prompt: &[u32],
    s: Sampling,
) -> Vec<u32> {
    let Some(mut dec) = model.decoder(params) else {
        return generate_recompute(model, params, prompt, s);
    };
    let mut rng = SplitMix64::new(s.seed);
    let mut out = Vec::new();
    // Learned positions end at the table: the context is the prompt's last `capacity` tokens.
    let ctx = &prompt[prompt.len() - prompt.len().min(dec.capacity())..];
    let Some(mut logits) = ctx.iter().map(|&t| dec.push(t)).last() else {
        return out;
    };
    while out.len() < s.new_tokens {
        let next = draw(&mut logits, &s, &mut rng);
        out.push(next);
        let full = dec.len() == dec.capacity();
        if out.len() == s.new_tokens || Some(next) == s.stop || full {
            break;
        }
        logits = dec.push(next);
    }
    out
}

/// The next token from the last position's `logits`: only the `top_k` largest compete (all
/// with 0), then [`pick`].
fn draw(logits: &mut [f32], s: &Sampling, rng: &mut SplitMix64) -> u32 {
    if s.top_k > 0 && s.top_k < logits.len() {
        let mut sorted = logits.to_vec();
        sorted.sort_unstable_by(|a, b| b.total_cmp(a));
        let kth = sorted[s.top_k - 1];
        logits
            .iter_mut()
            .filter(|v| **v < kth)
            .for_each(|v| *v = f32::NEG_INFINITY);
    }
    pick(logits, s.temperature, rng)
}

/// Index of the first largest logit (NaNs never win).
fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best
}

/// Draws from `softmax(logits / temperature)` by inverting the cumulative sum in id order.
fn pick(logits: &[f32], temperature: f32, rng: &mut SplitMix64) -> u32 {
    // The `as u32` casts are lossless: ids index a vocabulary of u32 token ids.
    let best = argmax(logits);
    if temperature.is_nan() || temperature <= 0.0 {
        return best as u32;
    }
    let (max, t) = (logits[best] as f64, temperature as f64);
    let weights: Vec<f64> = logits.iter().map(|&v| exp((v as f64 - max) / t)).collect();
    let total: f64 = weights.iter().filter(|w| !w.is_nan()).sum();
    let mut u = rng.next_f64() * total;
    for (i, &w) in weights.iter().enumerate().filter(|(_, &w)| w > 0.0) {
        if u < w {
            return i as u32;
        }
        u -= w;
    }
    best as u32 // only reachable through rounding at the very top of the range
}

/// Everything one forward and backward pass over a micro-batch computes: the loss, each
/// unit's parameter gradient (a tied parameter's summed over its uses, in its owner), each
/// unit's input and the gradient `backward` returned for it.
pub struct Step {
    pub loss: f32,
    pub logits: Vec<f32>,
    pub grads: Vec<Vec<f32>>,
    pub inputs: Vec<Vec<f32>>,
    pub input_grads: Vec<Vec<f32>>,
}

/// The forward through every unit's view ([`Ties::view`]), the loss and the backward, in f32,
/// on whole parameters: what one rank computes for one micro-batch, without quantization.
pub fn forward_backward(model: &dyn Model, params: &[Vec<f32>], mb: &MicroBatch) -> Step {
    let ties = Ties::of(model).expect("the model's ties are checked when it is built");
    let mut inputs = vec![Vec::new()];
    for u in 0..params.len() {
        let out = model.forward(u, &ties.view(u, |v| &params[v]), &inputs[u], mb);
        inputs.push(out);
    }
    let logits = inputs.pop().unwrap_or_default();
    let (loss, mut g) = model.loss(logits.clone(), mb);
    let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    let mut input_grads = vec![Vec::new(); params.len()];
    for u in (0..params.len()).rev() {
        let view = ties.view(u, |v| &params[v]);
        let mut gv = vec![0.0; view.len()];
        g = model.backward(u, &view, &inputs[u], &g, mb, &mut gv);
        // A tied parameter's gradient is the sum over its uses.
        for (t, r, part) in ties.borrowed_grads(u, &gv) {
            grads[t.owner][r]
                .iter_mut()
                .zip(part)
                .for_each(|(a, b)| *a += b);
        }
        let own = ties.own_grad(u, &gv);
        grads[u].iter_mut().zip(own).for_each(|(a, b)| *a += b);
        input_grads[u] = g.clone();
    }
    Step {
        loss,
        logits,
        grads,
        inputs,
        input_grads,
    }
}

/// Model-level test harness shared by the GPT and MLP tests: chained backward, whole-model
/// gradient checks, determinism checks and a tiny Adam loop.
#[cfg(test)]
pub(crate) mod test_util {
    use super::super::rng::test_util::{bits, check_grad, randn};
    use super::super::rng::{mix, SplitMix64};
    use super::super::tie::Ties;
    use super::super::{MicroBatch, Model};
    use super::forward_logits;
    use std::sync::Arc;

    /// A micro-batch of `batch` rows of `seq` tokens from a fixed pseudo-random stream.
    pub fn batch_of(vocab: usize, batch: usize, seq: usize, seed: u64) -> MicroBatch {
        let mut rng = SplitMix64::new(seed);
        let toks: Vec<u32> = (0..batch * (seq + 1))
            .map(|_| (rng.next_u64() % vocab as u64) as u32)
            .collect();
        let rows = toks.chunks(seq + 1);
        MicroBatch {
            loss_mask: None,
            inputs: rows.clone().flat_map(|r| r[..seq].to_vec()).collect(),
            targets: rows.flat_map(|r| r[1..].to_vec()).collect(),
            batch,
            seq,
        }
    }

    /// Initial parameters plus N(0, std) noise, so that no gradient term is negligible.
    pub fn perturbed(model: &dyn Model, seed: u64, std: f64) -> Vec<Vec<f32>> {
        (0..model.units().len())
            .map(|u| {
                let p = model.init_unit(u, seed);
                let noise = randn(p.len(), mix(seed, !(u as u64)), std);
                p.iter().zip(&noise).map(|(a, b)| a + b).collect()
            })
            .collect()
    }

    /// Mean cross-entropy in f64: finite differences of `Model::loss`'s f32 result would be
    /// dominated by its rounding (an ulp of 2.4 over 2·eps = 0.02 is already 1e-5).
    fn loss_f64(model: &dyn Model, logits: &[f32], mb: &MicroBatch) -> f64 {
        let rows = logits.chunks_exact(model.vocab()).zip(&mb.targets);
        let kept = |i: usize| mb.loss_mask.as_ref().is_none_or(|m| m.keep[i]);
        let total: f64 = rows
            .enumerate()
            .filter(|&(i, _)| kept(i))
            .map(|(_, (row, &t))| {
                let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
                let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
                max + sum.ln() - row[t as usize] as f64
            })
            .sum();
        match &mb.loss_mask {
            // Only the kept rows count, each weighing what the masked loss gives it.
            Some(m) => total * m.weight(),
            None => total / mb.targets.len().max(1) as f64,
        }
    }

    pub fn loss(model: &dyn Model, params: &[Vec<f32>], mb: &MicroBatch) -> f64 {
        loss_f64(model, &forward_logits(model, params, mb), mb)
    }

    /// Loss from unit `from` onwards, given that unit's input.
    fn loss_from(
        model: &dyn Model,
        params: &[Vec<f32>],
        from: usize,
        x: &[f32],
        mb: &MicroBatch,
    ) -> f64 {
        let ties = Ties::of(model).expect("valid ties");
        let mut x = x.to_vec();
        for u in from..params.len() {
            x = model.forward(u, &ties.view(u, |v| &params[v]), &x, mb);
        }
        loss_f64(model, &x, mb)
    }

    pub use super::Step;

    /// [`forward_backward`](super::forward_backward), with its f32 loss checked against the
    /// f64 one.
    pub fn step(model: &dyn Model, params: &[Vec<f32>], mb: &MicroBatch) -> Step {
        let s = super::forward_backward(model, params, mb);
        assert!(
            (s.loss as f64 - loss_f64(model, &s.logits, mb)).abs() < 1e-5,
            "loss value"
        );
        s
    }

    /// Finite-difference check of every parameter of every unit and of every unit's input
    /// gradient, through the loss.
    pub fn check_model_gradients(
        model: &dyn Model,
        params: &[Vec<f32>],
        mb: &MicroBatch,
        eps: f32,
        tol: f64,
    ) {
        let s = step(model, params, mb);
        for u in 0..params.len() {
            let f = |p: &[f32]| {
                let mut q = params.to_vec();
                q[u] = p.to_vec();
                loss(model, &q, mb)
            };
            check_grad(
                &format!("unit {u} params"),
                &params[u],
                &s.grads[u],
                eps,
                tol,
                &f,
            );
            if u > 0 {
                let f = |x: &[f32]| loss_from(model, params, u, x, mb);
                check_grad(
                    &format!("unit {u} input"),
                    &s.inputs[u],
                    &s.input_grads[u],
                    eps,
                    tol,
                    &f,
                );
            }
        }
    }

    /// Bit patterns of everything a step computes.
    pub fn fingerprint(model: &dyn Model, params: &[Vec<f32>], mb: &MicroBatch) -> Vec<Vec<u32>> {
        let s = step(model, params, mb);
        let all = [vec![vec![s.loss]], s.grads, s.inputs, s.input_grads].concat();
        all.iter().map(|v| bits(v)).collect()
    }

    /// Forward, loss and backward give identical bits when repeated and on another thread.
    pub fn assert_deterministic(model: Arc<dyn Model>, params: Vec<Vec<f32>>, mb: MicroBatch) {
        let first = fingerprint(&*model, &params, &mb);
        assert_eq!(first, fingerprint(&*model, &params, &mb), "repeat differs");
        let other = std::thread::spawn(move || fingerprint(&*model, &params, &mb));
        assert!(
            other.join().map(|f| f == first).unwrap_or(false),
            "thread differs"
        );
    }

    /// The model (10-token vocabulary, positions for 16) learns the digits of pi, which repeat
    /// with period 8: after a 1 comes 4 or 5, so it must attend to earlier tokens (or
    /// positions). 100 Adam steps from the seed-1 init take the loss from ln 10 below 0.1.
    pub fn assert_learns_pi_digits(model: &dyn Model) {
        let digits = [3u32, 1, 4, 1, 5, 9, 2, 6];
        let batch = |step: usize| {
            let (b, t) = (4, 16);
            let tok = |r: usize, i: usize| digits[(step * 3 + r * 5 + i) % digits.len()];
            MicroBatch {
                loss_mask: None,
                inputs: (0..b * t).map(|k| tok(k / t, k % t)).collect(),
                targets: (0..b * t).map(|k| tok(k / t, k % t + 1)).collect(),
                batch: b,
                seq: t,
            }
        };
        let mut params: Vec<Vec<f32>> = (0..model.units().len())
            .map(|u| model.init_unit(u, 1))
            .collect();
        let losses = train(model, &mut params, 100, 3e-3, batch);
        let (first, last) = (losses[0], losses[losses.len() - 1]);
        assert!((first - 10f32.ln()).abs() < 0.1, "initial loss {first}");
        assert!(last < 0.1, "loss only fell from {first} to {last}");
    }

    /// Plain Adam (no weight decay) for `steps` steps on `batch(step)`; returns each step's loss.
    pub fn train(
        model: &dyn Model,
        params: &mut [Vec<f32>],
        steps: usize,
        lr: f32,
        batch: impl Fn(usize) -> MicroBatch,
    ) -> Vec<f32> {
        let (b1, b2, eps) = (0.9f32, 0.999f32, 1e-8f32);
        let mut m: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
        let mut v = m.clone();
        let mut losses = Vec::new();
        for t in 1..=steps {
            let s = step(model, params, &batch(t));
            losses.push(s.loss);
            let (c1, c2) = (1.0 - b1.powi(t as i32), 1.0 - b2.powi(t as i32));
            for u in 0..params.len() {
                for i in 0..params[u].len() {
                    let g = s.grads[u][i];
                    m[u][i] = b1 * m[u][i] + (1.0 - b1) * g;
                    v[u][i] = b2 * v[u][i] + (1.0 - b2) * g * g;
                    params[u][i] -= lr * (m[u][i] / c1) / ((v[u][i] / c2).sqrt() + eps);
                }
            }
        }
        losses
    }
}

#[cfg(test)]
mod tests {
    use super::super::backend::GeluForm;
    use super::super::gpt::{Gpt, GptConfig};
    use super::super::mlp::{Mlp, MlpConfig};
    use super::test_util::{perturbed, train};
    use super::*;

    #[test]
    fn sampling_follows_softmax_and_greedy_takes_first_max() {
        let logits = [0.0f32, 2f32.ln(), 3f32.ln(), f32::NEG_INFINITY];
        let mut rng = SplitMix64::new(1);
        let mut counts = [0usize; 4];
        for _ in 0..60_000 {
            counts[pick(&logits, 1.0, &mut rng) as usize] += 1;
        }
        for (c, want) in counts.iter().zip([1.0 / 6.0, 2.0 / 6.0, 3.0 / 6.0, 0.0]) {
            assert!((*c as f64 / 60_000.0 - want).abs() < 0.01, "{counts:?}");
        }
        assert_eq!(pick(&[1.0, 3.0, 3.0, f32::NAN], 0.0, &mut rng), 1);
        assert_eq!(pick(&[f32::NAN, 0.5, 0.2], -1.0, &mut rng), 1);
    }

    #[test]
    fn generation_is_reproducible_and_windowed() {
        let cfg = GptConfig {
            vocab: 11,
            seq_len: 5,
            d_model: 8,
            heads: 2,
            layers: 2,
            gelu: GeluForm::Erf,
            tie_embeddings: false,
        };
        let gpt = Gpt::new(cfg).expect("valid config");
        let params = perturbed(&gpt, 4, 0.5);
        let prompt = [1u32, 2, 3, 4, 5, 6, 7]; // longer than seq_len: only the last 5 are seen
        let a = generate(&gpt, &params, &prompt, 6, 1.0, 9);
        assert_eq!(a.len(), 6);
        assert!(a.iter().all(|&t| t < 11));
        assert_eq!(a, generate(&gpt, &params, &prompt, 6, 1.0, 9));
        let greedy = generate(&gpt, &params, &prompt, 1, 0.0, 0);
        let mb = MicroBatch {
            loss_mask: None,
            inputs: prompt[2..].to_vec(),
            targets: vec![0; 5],
            batch: 1,
            seq: 5,
        };
        let logits = forward_logits(&gpt, &params, &mb);
        assert_eq!(greedy, [argmax(&logits[4 * 11..]) as u32]);
        assert!(generate(&gpt, &params, &[], 3, 1.0, 0).is_empty());
    }

    #[test]
    fn trained_model_continues_its_pattern() {
        let mlp = Mlp::new(MlpConfig {
            vocab: 8,
            d_model: 16,
            hidden: 32,
            layers: 1,
        })
        .expect("valid config");
        let mut params: Vec<Vec<f32>> = (0..3).map(|u| mlp.init_unit(u, 1)).collect();
        let batch = |s: usize| {
            let inputs: Vec<u32> = (0..32).map(|i| ((s + i) % 8) as u32).collect();
            let targets = inputs.iter().map(|t| (t + 1) % 8).collect();
            MicroBatch {
                loss_mask: None,
                inputs,
                targets,
                batch: 4,
                seq: 8,
            }
        };
        train(&mlp, &mut params, 100, 1e-2, batch);
        assert_eq!(generate(&mlp, &params, &[5], 6, 0.0, 0), [6, 7, 0, 1, 2, 3]);
    }
}
