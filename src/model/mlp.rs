//! A per-position (bigram-style) next-token model: embedding, residual GELU MLP layers, layernorm
//! and a linear head, with no interaction between positions.
//!
//! It exists for fast runtime tests: it has the same unit structure as the GPT (embedding unit,
//! one unit per layer, head unit), the same init and determinism rules, but costs a few small
//! matrix products per token and accepts sequences of any length.

use std::sync::Arc;

use super::backend::{Backend, Cpu, GeluForm};
use super::layers::{LayerNorm, Linear};
use super::ops::{split_params, split_params_mut};
use super::rng::{init_unit_buffer, unit_spec, Init};
use super::{MicroBatch, Model, UnitSpec};

/// Shape of an [`Mlp`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MlpConfig {
    pub vocab: usize,
    pub d_model: usize,
    /// Width of each layer's hidden GELU activation.
    pub hidden: usize,
    pub layers: usize,
}

impl MlpConfig {
    /// Checks that every size is positive and that token ids fit in `u32`.
    pub fn validate(&self) -> Result<(), String> {
        let sizes = [
            ("vocab", self.vocab),
            ("d_model", self.d_model),
            ("hidden", self.hidden),
            ("layers", self.layers),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(format!("MlpConfig.{name} is 0; it must be at least 1"));
        }
        if self.vocab > 1 << 32 {
            return Err(format!(
                "MlpConfig.vocab is {}; token ids are u32, so at most 2^32",
                self.vocab
            ));
        }
        Ok(())
    }
}

/// Per-position MLP language model implementing [`Model`].
#[derive(Clone, Debug)]
pub struct Mlp {
    cfg: MlpConfig,
    units: Vec<UnitSpec>,
    /// Init rule of every parameter of every unit, parallel to `units`.
    inits: Vec<Vec<Init>>,
    /// Where every kernel runs.
    be: Arc<dyn Backend>,
}

/// Lengths of a layer's parameters: fc1 weight and bias, fc2 weight and bias.
fn layer_lens(d: usize, hidden: usize) -> [usize; 4] {
    [hidden * d, hidden, d * hidden, d]
}

/// Lengths of the head's parameters: ln_f weight and bias, head weight and bias.
fn head_lens(d: usize, vocab: usize) -> [usize; 4] {
    [d, d, vocab * d, vocab]
}

impl Mlp {
    /// An MLP of shape `cfg` on the reference CPU backend.
    pub fn new(cfg: MlpConfig) -> Result<Self, String> {
        Self::with_backend(cfg, Arc::new(Cpu))
    }

    /// An MLP of shape `cfg` whose kernels run on `be`.
    pub fn with_backend(cfg: MlpConfig, be: Arc<dyn Backend>) -> Result<Self, String> {
        cfg.validate()?;
        let (v, d, hid) = (cfg.vocab, cfg.d_model, cfg.hidden);
        let mut all = vec![unit_spec(
            "embed".into(),
            vec![("tok.weight".into(), vec![v, d], Init::Normal)],
        )];
        all.extend((0..cfg.layers).map(|i| {
            let p = |name: &str| format!("layers.{i}.{name}");
            let params = vec![
                (p("fc1.weight"), vec![hid, d], Init::Normal),
                (p("fc1.bias"), vec![hid], Init::Zeros),
                (p("fc2.weight"), vec![d, hid], Init::Normal),
                (p("fc2.bias"), vec![d], Init::Zeros),
            ];
            unit_spec(format!("layers.{i}"), params)
        }));
        let head = vec![
            ("ln_f.weight".into(), vec![d], Init::Ones),
            ("ln_f.bias".into(), vec![d], Init::Zeros),
            ("head.weight".into(), vec![v, d], Init::Normal),
            ("head.bias".into(), vec![v], Init::Zeros),
        ];
        all.push(unit_spec("head".into(), head));
        let (units, inits) = all.into_iter().unzip();
        Ok(Self {
            cfg,
            units,
            inits,
            be,
        })
    }

    pub fn config(&self) -> &MlpConfig {
        &self.cfg
    }

    /// Validates the unit index, the buffers and the micro-batch.
    fn check(&self, unit: usize, params: &[f32], x: &[f32], mb: &MicroBatch) {
        let n_units = self.units.len();
        assert!(
            unit < n_units,
            "unit {unit} out of range: this MLP has {n_units} units"
        );
        assert_eq!(
            params.len(),
            self.units[unit].numel(),
            "unit {unit}: parameter buffer length"
        );
        assert_eq!(
            mb.inputs.len(),
            mb.batch * mb.seq,
            "micro-batch inputs length"
        );
        if unit != 0 {
            assert_eq!(
                x.len(),
                mb.batch * mb.seq * self.cfg.d_model,
                "unit {unit}: input length"
            );
        }
    }

    fn layer<'a>(&'a self, params: &'a [f32]) -> (Linear<'a>, Linear<'a>) {
        let (d, hid) = (self.cfg.d_model, self.cfg.hidden);
        let [w1, b1, w2, b2] = split_params(params, layer_lens(d, hid));
        let be = &*self.be;
        (
            Linear::new(be, w1, Some(b1), d, hid),
            Linear::new(be, w2, Some(b2), hid, d),
        )
    }

    fn head<'a>(&'a self, params: &'a [f32]) -> (LayerNorm<'a>, Linear<'a>) {
        let (d, v) = (self.cfg.d_model, self.cfg.vocab);
        let [w, b, hw, hb] = split_params(params, head_lens(d, v));
        let be = &*self.be;
        (
            LayerNorm::new(be, w, b),
            Linear::new(be, hw, Some(hb), d, v),
        )
    }

    fn layer_backward(
        &self,
        params: &[f32],
        x: &[f32],
        dout: &[f32],
        grads: &mut [f32],
    ) -> Vec<f32> {
        let (fc1, fc2) = self.layer(params);
        let [g_w1, g_b1, g_w2, g_b2] =
            split_params_mut(grads, layer_lens(self.cfg.d_model, self.cfg.hidden));
        let f = fc1.forward(x);
        let (mut g, mut g_deriv) = (vec![0.0; f.len()], vec![0.0; f.len()]);
        self.be.gelu(GeluForm::Erf, &f, &mut g, Some(&mut g_deriv));
        let mut df = fc2.backward(&g, dout, g_w2, Some(g_b2));
        self.be.mul(&mut df, &g_deriv);
        let mut dx = fc1.backward(x, &df, g_w1, Some(g_b1));
        self.be.add(&mut dx, dout);
        dx
    }

    fn head_backward(
        &self,
        params: &[f32],
        x: &[f32],
        dout: &[f32],
        grads: &mut [f32],
    ) -> Vec<f32> {
        let (ln_f, head) = self.head(params);
        let [g_w, g_b, g_hw, g_hb] =
            split_params_mut(grads, head_lens(self.cfg.d_model, self.cfg.vocab));
        let h = ln_f.forward(x);
        let dh = head.backward(&h, dout, g_hw, Some(g_hb));
        ln_f.backward(x, &dh, g_w, g_b)
    }
}

/// # Panics
/// On inputs that break the contract: a unit index out of range, buffers of the wrong length, or
/// a token id or target `>= vocab`.
impl Model for Mlp {
    fn units(&self) -> Vec<UnitSpec> {
        self.units.clone()
    }

    fn init_unit(&self, unit: usize, seed: u64) -> Vec<f32> {
        let n_units = self.units.len();
        assert!(
            unit < n_units,
            "unit {unit} out of range: this MLP has {n_units} units"
        );
        init_unit_buffer(&self.units[unit], &self.inits[unit], seed, unit)
    }

    fn forward(&self, unit: usize, params: &[f32], x: &[f32], mb: &MicroBatch) -> Vec<f32> {
        self.check(unit, params, x, mb);
        if unit == 0 {
            let mut h = vec![0.0; mb.inputs.len() * self.cfg.d_model];
            self.be.embedding_forward(params, &mb.inputs, &mut h);
            h
        } else if unit <= self.cfg.layers {
            let (fc1, fc2) = self.layer(params);
            let f = fc1.forward(x);
            let mut g = vec![0.0; f.len()];
            self.be.gelu(GeluForm::Erf, &f, &mut g, None);
            let mut out = fc2.forward(&g);
            self.be.add(&mut out, x);
            out
        } else {
            let (ln_f, head) = self.head(params);
            head.forward(&ln_f.forward(x))
        }
    }

    fn backward(
        &self,
        unit: usize,
        params: &[f32],
        x: &[f32],
        grad_out: &[f32],
        mb: &MicroBatch,
        grad_params: &mut [f32],
    ) -> Vec<f32> {
        self.check(unit, params, x, mb);
        assert_eq!(
            grad_params.len(),
            params.len(),
            "unit {unit}: gradient buffer length"
        );
        let is_head = unit == self.cfg.layers + 1;
        let out_width = if is_head {
            self.cfg.vocab
        } else {
            self.cfg.d_model
        };
        assert_eq!(
            grad_out.len(),
            mb.batch * mb.seq * out_width,
            "unit {unit}: grad_out length"
        );
        if unit == 0 {
            self.be
                .embedding_backward(&mb.inputs, grad_out, grad_params);
            Vec::new()
        } else if is_head {
            self.head_backward(params, x, grad_out, grad_params)
        } else {
            self.layer_backward(params, x, grad_out, grad_params)
        }
    }

    fn loss(&self, out: Vec<f32>, mb: &MicroBatch) -> (f32, Vec<f32>) {
        super::lm_loss(&*self.be, self.cfg.vocab, out, mb)
    }

    fn backend(&self) -> &dyn Backend {
        &*self.be
    }

    fn vocab(&self) -> usize {
        self.cfg.vocab
    }

    fn max_seq(&self) -> usize {
        usize::MAX
    }
}

#[cfg(test)]
mod tests {
    use super::super::param_count;
    use super::super::sample::test_util::{
        assert_deterministic, check_model_gradients, perturbed, step, train,
    };
    use super::*;
    use std::sync::Arc;

    fn tiny() -> Mlp {
        Mlp::new(MlpConfig {
            vocab: 7,
            d_model: 6,
            hidden: 10,
            layers: 2,
        })
        .expect("valid config")
    }

    /// `batch` rows of `seq` tokens following the bigram rule `next = (3·tok + 1) mod vocab`.
    fn bigram_batch(vocab: u32, batch: usize, seq: usize, start: u32) -> MicroBatch {
        let mut inputs = Vec::new();
        let mut tok = start % vocab;
        for _ in 0..batch * seq + 1 {
            inputs.push(tok);
            tok = (3 * tok + 1) % vocab;
        }
        let targets = inputs[1..].to_vec();
        inputs.pop();
        MicroBatch {
            loss_mask: None,
            inputs,
            targets,
            batch,
            seq,
        }
    }

    #[test]
    fn units_and_shapes() {
        let mlp = tiny();
        let units = mlp.units();
        let names: Vec<&str> = units.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names, ["embed", "layers.0", "layers.1", "head"]);
        let pnames: Vec<&str> = units[2].params.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            pnames,
            [
                "layers.1.fc1.weight",
                "layers.1.fc1.bias",
                "layers.1.fc2.weight",
                "layers.1.fc2.bias"
            ]
        );
        assert_eq!(units[3].params[2].shape, [7, 6]);
        assert_eq!(
            param_count(&units),
            7 * 6 + 2 * (10 * 6 + 10 + 6 * 10 + 6) + (6 + 6 + 7 * 6 + 7)
        );
        assert_eq!(mlp.max_seq(), usize::MAX);
        let err = Mlp::new(MlpConfig {
            hidden: 0,
            ..mlp.config().clone()
        })
        .expect_err("zero hidden");
        assert!(
            err.contains("hidden") && err.contains("at least 1"),
            "{err}"
        );
    }

    #[test]
    fn init_is_pure_per_unit() {
        let mlp = tiny();
        assert_eq!(mlp.init_unit(1, 3), mlp.init_unit(1, 3));
        assert_ne!(mlp.init_unit(1, 3), mlp.init_unit(2, 3));
        let head = mlp.init_unit(3, 3);
        assert!(head[..6].iter().all(|&v| v == 1.0) && head[6..12].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn gradients_match_finite_differences() {
        let mlp = tiny();
        let params = perturbed(&mlp, 2, 0.3);
        check_model_gradients(&mlp, &params, &bigram_batch(7, 2, 3, 1), 1e-2, 1e-2);
    }

    #[test]
    fn empty_micro_batches_give_zero_loss_and_gradients() {
        let mlp = tiny();
        let params = perturbed(&mlp, 2, 0.3);
        for (batch, seq) in [(0, 5), (2, 0)] {
            let mb = MicroBatch {
                loss_mask: None,
                inputs: vec![],
                targets: vec![],
                batch,
                seq,
            };
            let s = step(&mlp, &params, &mb);
            assert_eq!(s.loss, 0.0);
            assert!(s.grads.iter().flatten().all(|&g| g == 0.0));
        }
    }

    #[test]
    fn deterministic_across_calls_and_threads() {
        let mlp = tiny();
        let params = perturbed(&mlp, 2, 0.3);
        assert_deterministic(Arc::new(mlp), params, bigram_batch(7, 3, 50, 2));
    }

    #[test]
    fn loss_falls_on_a_bigram_rule() {
        let mlp = Mlp::new(MlpConfig {
            vocab: 16,
            d_model: 16,
            hidden: 32,
            layers: 1,
        })
        .expect("valid config");
        let mut params: Vec<Vec<f32>> = (0..3).map(|u| mlp.init_unit(u, 1)).collect();
        let losses = train(&mlp, &mut params, 100, 1e-2, |s| {
            bigram_batch(16, 4, 8, s as u32)
        });
        let (first, last) = (losses[0], losses[losses.len() - 1]);
        assert!((first - 16f32.ln()).abs() < 0.1, "initial loss {first}");
        assert!(last < 0.1, "loss only fell from {first} to {last}");
    }
}
