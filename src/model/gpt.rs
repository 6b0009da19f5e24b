//! The GPT of the PyTorch reference (`../shared/peers/train_fsdp.py`, classes `Block` and
//! `GPT`), cut into ZeRO units: the embeddings, one unit per transformer block, and the head.
//!
//! Pre-LN blocks: `x + proj(attn(ln1(x)))`, then `x + fc2(gelu(fc1(ln2(x))))`; learned token and
//! position embeddings; final `ln_f` and an untied, bias-free LM head. Parameter names, shapes and
//! order follow the PyTorch `state_dict`, so checkpoints can be exported name by name.
//!
//! Activations between units are the hidden states `[batch, seq, d_model]`, row-major.
//! `backward` recomputes the unit's internals from its input (activation checkpointing at unit
//! granularity), so nothing is cached between calls and every call is a pure function.

use std::sync::Arc;

use super::attention::AttnShape;
use super::backend::{Backend, Cpu, GeluForm};
use super::layers::{LayerNorm, Linear};
use super::ops::{split_params, split_params_mut};
use super::rng::{init_unit_buffer, unit_spec, Init};
use super::tie::Tie;
use super::workspace::{carve, Scratch};
use super::{Decoder, Kept, MicroBatch, Model, UnitSpec};

/// Shape of a [`Gpt`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GptConfig {
    pub vocab: usize,
    /// Longest sequence (rows of the position embedding).
    pub seq_len: usize,
    pub d_model: usize,
    pub heads: usize,
    pub layers: usize,
    /// The MLP's GELU: `erf` (default, PyTorch's `nn.GELU()`) or `tanh` (GPT-2's `gelu_new`).
    #[serde(default)]
    pub gelu: GeluForm,
    /// The head's weight is the token embedding (`tok.weight`), as in GPT-2: the head unit
    /// borrows it (see [`super::tie`]) and owns only `ln_f`.
    #[serde(default)]
    pub tie_embeddings: bool,
}

impl GptConfig {
    /// The reference model of `train_fsdp.py`: 3,323,392 parameters.
    pub fn reference() -> Self {
        Self {
            vocab: 256,
            seq_len: 128,
            d_model: 256,
            heads: 4,
            layers: 4,
            gelu: GeluForm::Erf,
            tie_embeddings: false,
        }
    }

    /// Checks that every size is positive and that `heads` divides `d_model`.
    pub fn validate(&self) -> Result<(), String> {
        let sizes = [
            ("vocab", self.vocab),
            ("seq_len", self.seq_len),
            ("d_model", self.d_model),
            ("heads", self.heads),
            ("layers", self.layers),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(format!("GptConfig.{name} is 0; it must be at least 1"));
        }
        if self.vocab > 1 << 32 {
            return Err(format!(
                "GptConfig.vocab is {}; token ids are u32, so at most 2^32",
                self.vocab
            ));
        }
        if !self.d_model.is_multiple_of(self.heads) {
            let d = self.d_model;
            let mut divisors: Vec<usize> = (1..)
                .take_while(|h| h * h <= d)
                .filter(|h| d.is_multiple_of(*h))
                .flat_map(|h| [h, d / h])
                .collect();
            divisors.sort_unstable();
            divisors.dedup();
            return Err(format!(
                "GptConfig.heads ({}) must divide d_model ({d}); valid head counts: {divisors:?}",
                self.heads
            ));
        }
        Ok(())
    }
}

/// What a unit index refers to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum UnitKind {
    Embed,
    Block,
    Head,
}

/// Decoder-only transformer implementing [`Model`]; see the module docs for the architecture.
#[derive(Clone, Debug)]
pub struct Gpt {
    cfg: GptConfig,
    units: Vec<UnitSpec>,
    /// Init rule of every parameter of every unit, parallel to `units`.
    inits: Vec<Vec<Init>>,
    /// Where every kernel runs.
    be: Arc<dyn Backend>,
}

/// Lengths of a block's 12 parameters, in `UnitSpec` order.
fn block_lens(d: usize) -> [usize; 12] {
    let (ln, qkv, proj) = ([d, d], [3 * d * d, 3 * d], [d * d, d]);
    let (fc1, fc2) = ([4 * d * d, 4 * d], [4 * d * d, d]);
    let [a, b, c, e, f, g] = [ln, qkv, proj, ln, fc1, fc2];
    [
        a[0], a[1], b[0], b[1], c[0], c[1], e[0], e[1], f[0], f[1], g[0], g[1],
    ]
}

/// Lengths of the head unit's parameters: ln_f weight and bias, head weight.
fn head_lens(d: usize, vocab: usize) -> [usize; 3] {
    [d, d, vocab * d]
}

fn layer_norm(prefix: &str, d: usize) -> [(String, Vec<usize>, Init); 2] {
    [
        (format!("{prefix}.weight"), vec![d], Init::Ones),
        (format!("{prefix}.bias"), vec![d], Init::Zeros),
    ]
}

fn linear(prefix: &str, d_out: usize, d_in: usize) -> [(String, Vec<usize>, Init); 2] {
    [
        (format!("{prefix}.weight"), vec![d_out, d_in], Init::Normal),
        (format!("{prefix}.bias"), vec![d_out], Init::Zeros),
    ]
}

fn block_unit(i: usize, d: usize) -> (UnitSpec, Vec<Init>) {
    let p = |name: &str| format!("blocks.{i}.{name}");
    let params = [
        layer_norm(&p("ln1"), d),
        linear(&p("qkv"), 3 * d, d),
        linear(&p("proj"), d, d),
        layer_norm(&p("ln2"), d),
        linear(&p("fc1"), 4 * d, d),
        linear(&p("fc2"), d, 4 * d),
    ];
    unit_spec(
        format!("blocks.{i}"),
        params.into_iter().flatten().collect(),
    )
}

impl Gpt {
    /// A GPT of shape `cfg` on the reference CPU backend.
    pub fn new(cfg: GptConfig) -> Result<Self, String> {
        Self::with_backend(cfg, Arc::new(Cpu))
    }

    /// A GPT of shape `cfg` whose kernels run on `be`.
    pub fn with_backend(cfg: GptConfig, be: Arc<dyn Backend>) -> Result<Self, String> {
        cfg.validate()?;
        let (d, v) = (cfg.d_model, cfg.vocab);
        let mut all = vec![unit_spec(
            "embed".into(),
            vec![
                ("tok.weight".into(), vec![v, d], Init::Normal),
                ("pos.weight".into(), vec![cfg.seq_len, d], Init::Normal),
            ],
        )];
        all.extend((0..cfg.layers).map(|i| block_unit(i, d)));
        let mut head: Vec<_> = layer_norm("ln_f", d).into();
        if !cfg.tie_embeddings {
            head.push(("head.weight".into(), vec![v, d], Init::Normal));
        }
        all.push(unit_spec("head".into(), head));
        let (units, inits) = all.into_iter().unzip();
        Ok(Self {
            cfg,
            units,
            inits,
            be,
        })
    }

    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    fn block<'a>(&'a self, params: &'a [f32], d: usize) -> Block<'a> {
        Block::new(&*self.be, params, d, self.cfg.gelu)
    }

    /// What `unit` is; panics on an index past the head.
    fn kind(&self, unit: usize) -> UnitKind {
        let n_units = self.units.len();
        assert!(
            unit < n_units,
            "unit {unit} out of range: this GPT has {n_units} units"
        );
        match unit {
            0 => UnitKind::Embed,
            u if u <= self.cfg.layers => UnitKind::Block,
            _ => UnitKind::Head,
        }
    }

    /// Validates the unit index, its buffers and the micro-batch; returns the unit's kind and
    /// the attention shape of the micro-batch.
    fn check(
        &self,
        unit: usize,
        params: &[f32],
        x: &[f32],
        mb: &MicroBatch,
    ) -> (UnitKind, AttnShape) {
        let kind = self.kind(unit);
        let borrowed = match kind {
            UnitKind::Head if self.cfg.tie_embeddings => self.cfg.vocab * self.cfg.d_model,
            _ => 0,
        };
        let want = self.units[unit].numel() + borrowed;
        assert_eq!(params.len(), want, "unit {unit}: parameter buffer length");
        assert!(
            mb.seq <= self.cfg.seq_len,
            "micro-batch seq {} exceeds the model's seq_len {}",
            mb.seq,
            self.cfg.seq_len
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
        (
            kind,
            AttnShape::new(mb.batch, mb.seq, self.cfg.d_model, self.cfg.heads),
        )
    }

    fn embed_forward(&self, params: &[f32], mb: &MicroBatch) -> Vec<f32> {
        let d = self.cfg.d_model;
        let [tok, pos] = split_params(params, [self.cfg.vocab * d, self.cfg.seq_len * d]);
        let mut h = vec![0.0; mb.inputs.len() * d];
        self.be.embedding_forward(tok, &mb.inputs, &mut h);
        let pos = &pos[..mb.seq * d];
        // `max(1)`: with seq 0 there are no rows, and chunk lengths must be positive.
        for row in h.chunks_exact_mut(pos.len().max(1)) {
            self.be.add(row, pos);
        }
        h
    }

    fn embed_backward(&self, dout: &[f32], mb: &MicroBatch, grads: &mut [f32]) {
        let d = self.cfg.d_model;
        let [g_tok, g_pos] = split_params_mut(grads, [self.cfg.vocab * d, self.cfg.seq_len * d]);
        self.be.embedding_backward(&mb.inputs, dout, g_tok);
        let g_pos = &mut g_pos[..mb.seq * d];
        if !g_pos.is_empty() {
            self.be.sum_rows(dout, g_pos);
        }
    }

    fn head_parts<'a>(&'a self, params: &'a [f32]) -> (LayerNorm<'a>, Linear<'a>) {
        let (d, v) = (self.cfg.d_model, self.cfg.vocab);
        let [w, b, head] = split_params(params, head_lens(d, v));
        let be = &*self.be;
        (LayerNorm::new(be, w, b), Linear::new(be, head, None, d, v))
    }

    fn head_forward(&self, params: &[f32], x: &[f32]) -> Vec<f32> {
        let (ln_f, head) = self.head_parts(params);
        let rows = x.len() / self.cfg.d_model;
        let mut ws = Scratch::take();
        let [st, h] = ws.carve([2 * rows, x.len()]);
        ln_f.forward_into(x, h, st);
        let mut logits = vec![0.0; rows * self.cfg.vocab];
        head.forward_into(h, &mut logits);
        logits
    }

    fn head_backward(
        &self,
        params: &[f32],
        x: &[f32],
        dout: &[f32],
        grads: &mut [f32],
    ) -> Vec<f32> {
        let (ln_f, head) = self.head_parts(params);
        let [g_w, g_b, g_head] =
            split_params_mut(grads, head_lens(self.cfg.d_model, self.cfg.vocab));
        let rows = x.len() / self.cfg.d_model;
        let mut ws = Scratch::take();
        let [st, h, dh] = ws.carve([2 * rows, x.len(), x.len()]);
        ln_f.forward_into(x, h, st);
        head.backward_into(h, dout, g_head, None, dh);
        let mut dx = vec![0.0; x.len()];
        ln_f.backward_into(x, st, dh, g_w, g_b, &mut dx);
        dx
    }
}

/// Views of one transformer block's parameters.
struct Block<'a> {
    be: &'a dyn Backend,
    gelu: GeluForm,
    ln1: LayerNorm<'a>,
    qkv: Linear<'a>,
    proj: Linear<'a>,
    ln2: LayerNorm<'a>,
    fc1: Linear<'a>,
    fc2: Linear<'a>,
}

impl<'a> Block<'a> {
    fn new(be: &'a dyn Backend, params: &'a [f32], d: usize, gelu: GeluForm) -> Self {
        let [ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b] =
            split_params(params, block_lens(d));
        let lin = |weight, bias, d_in, d_out| Linear::new(be, weight, Some(bias), d_in, d_out);
        Self {
            be,
            gelu,
            ln1: LayerNorm::new(be, ln1_w, ln1_b),
            qkv: lin(qkv_w, qkv_b, d, 3 * d),
            proj: lin(proj_w, proj_b, d, d),
            ln2: LayerNorm::new(be, ln2_w, ln2_b),
            fc1: lin(fc1_w, fc1_b, d, 4 * d),
            fc2: lin(fc2_w, fc2_b, 4 * d, d),
        }
    }

    fn forward(&self, x: &[f32], s: AttnShape) -> Vec<f32> {
        self.forward_in_arena(x, s, Keep::OutputOnly).0
    }

    /// Recomputes the forward from `x` (activation checkpointing: nothing was kept between
    /// calls), keeping what the backward reads, then runs the backward.
    fn backward(&self, x: &[f32], dout: &[f32], s: AttnShape, grads: &mut [f32]) -> Vec<f32> {
        let rd = x.len();
        let mut ws = Scratch::take();
        let keep = Keep::ForBackward;
        let [acts, dh, dx2, dp] = ws.carve([Acts::len(rd, s, keep), rd, rd, s.seq * s.seq]);
        let mut a = Acts::carve(acts, rd, s, keep);
        self.forward_acts(x, s, &mut a);
        self.backward_acts(x, dout, s, grads, a, [dh, dx2, dp])
    }

    /// The forward up to the MLP's activation, into `a`: with [`Keep::ForBackward`], everything
    /// the backward reads.
    fn forward_acts(&self, x: &[f32], s: AttnShape, a: &mut Acts) {
        self.ln1.forward_into(x, a.h1, a.st1);
        self.qkv.forward_into(a.h1, a.qkv);
        let keep = a.keep == Keep::ForBackward;
        self.be.attention_forward(a.qkv, s, a.att, a.probs, keep);
        self.proj.forward_into(a.att, a.x2);
        self.be.add(a.x2, x);
        let st2 = match a.keep {
            Keep::ForBackward => &mut *a.st2,
            // ln1's statistics are dead once ln1 has run.
            Keep::OutputOnly => &mut *a.st1,
        };
        self.ln2.forward_into(a.x2, a.h2, st2);
        self.fc1.forward_into(a.h2, a.f);
        let deriv = keep.then_some(&mut *a.g_deriv);
        self.be.gelu(self.gelu, a.f, a.g, deriv);
    }

    /// The forward with its activations kept (`keep_activations`): the output equals
    /// `forward`'s, and `backward_acts` can run on the kept arena without recomputing. The
    /// activations live in a pooled scratch arena rather than a fresh buffer: a fresh ~17 MiB
    /// per block per micro-batch was zero-filled and page-faulted in every step.
    fn forward_keep(&self, x: &[f32], s: AttnShape) -> (Vec<f32>, Scratch) {
        self.forward_in_arena(x, s, Keep::ForBackward)
    }

    /// The block's output, computed in a pooled arena laid out by [`Acts`] for `keep`; the
    /// arena is returned with it.
    fn forward_in_arena(&self, x: &[f32], s: AttnShape, keep: Keep) -> (Vec<f32>, Scratch) {
        let rd = x.len();
        let mut ws = Scratch::take();
        let [acts] = ws.carve([Acts::len(rd, s, keep)]);
        let mut a = Acts::carve(acts, rd, s, keep);
        self.forward_acts(x, s, &mut a);
        let mut out = vec![0.0; rd];
        self.fc2.forward_into(a.g, &mut out);
        self.be.add(&mut out, a.x2);
        (out, ws)
    }

    /// The backward from the forward's activations `a`, which it overwrites once each is dead.
    /// `tmp` is scratch: two activation-sized buffers and one of `seq²`.
    fn backward_acts(
        &self,
        x: &[f32],
        dout: &[f32],
        s: AttnShape,
        grads: &mut [f32],
        a: Acts,
        tmp: [&mut [f32]; 3],
    ) -> Vec<f32> {
        assert_eq!(
            a.keep,
            Keep::ForBackward,
            "the backward needs the activations a forward kept"
        );
        let [g_ln1_w, g_ln1_b, g_qkv_w, g_qkv_b, g_proj_w, g_proj_b, g_ln2_w, g_ln2_b, g_fc1_w, g_fc1_b, g_fc2_w, g_fc2_b] =
            split_params_mut(grads, block_lens(s.d_model));
        let [dh, dx2, dp] = tmp;
        let rd = x.len();
        // MLP half: out = x2 + fc2(gelu(fc1(ln2(x2)))). The pre-activation `f` is dead now.
        let df = a.f;
        self.fc2
            .backward_into(a.g, dout, g_fc2_w, Some(g_fc2_b), df);
        self.be.mul(df, a.g_deriv);
        let dh2 = &mut *dh;
        self.fc1
            .backward_into(a.h2, df, g_fc1_w, Some(g_fc1_b), dh2);
        self.ln2
            .backward_into(a.x2, a.st2, dh2, g_ln2_w, g_ln2_b, dx2);
        self.be.add(dx2, dout);
        // Attention half: x2 = x + proj(attn(qkv(ln1(x)))). `h2` and `df` are dead now.
        let datt = a.h2;
        self.proj
            .backward_into(a.att, dx2, g_proj_w, Some(g_proj_b), datt);
        let dqkv = &mut df[..3 * rd];
        self.be
            .attention_backward(a.qkv, a.probs, datt, s, dqkv, dp);
        let dh1 = dh;
        self.qkv
            .backward_into(a.h1, dqkv, g_qkv_w, Some(g_qkv_b), dh1);
        let mut dx = vec![0.0; rd];
        self.ln1
            .backward_into(x, a.st1, dh1, g_ln1_w, g_ln1_b, &mut dx);
        self.be.add(&mut dx, dx2);
        dx
    }
}

/// What a block's forward keeps in its [`Acts`] arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Keep {
    /// Everything `backward_acts` reads: both layer norms' statistics, every head's attention
    /// probabilities and the GELU derivative.
    ForBackward,
    /// Only what the output needs: the second layer norm reuses the first one's statistics, the
    /// GELU derivative is not computed (its buffer is empty) and attention holds one head's
    /// probabilities at a time. The buffers before `probs` sit at the same offsets either way.
    OutputOnly,
}

/// A block's forward intermediates, carved from one buffer: the one statement of the block's
/// activation layout, for the plain forward and for the one that keeps its activations.
struct Acts<'b> {
    keep: Keep,
    st1: &'b mut [f32],
    st2: &'b mut [f32],
    h1: &'b mut [f32],
    qkv: &'b mut [f32],
    att: &'b mut [f32],
    x2: &'b mut [f32],
    h2: &'b mut [f32],
    f: &'b mut [f32],
    g: &'b mut [f32],
    g_deriv: &'b mut [f32],
    probs: &'b mut [f32],
}

impl<'b> Acts<'b> {
    fn lens(rd: usize, s: AttnShape, keep: Keep) -> [usize; 11] {
        let rows = rd / s.d_model;
        let (st2, g_deriv, probs) = match keep {
            Keep::ForBackward => (2 * rows, 4 * rd, s.probs_len()),
            Keep::OutputOnly => (0, 0, s.seq * s.seq),
        };
        [
            2 * rows,
            st2,
            rd,
            3 * rd,
            rd,
            rd,
            rd,
            4 * rd,
            4 * rd,
            g_deriv,
            probs,
        ]
    }

    fn len(rd: usize, s: AttnShape, keep: Keep) -> usize {
        Self::lens(rd, s, keep).iter().sum()
    }

    fn carve(buf: &'b mut [f32], rd: usize, s: AttnShape, keep: Keep) -> Self {
        let [st1, st2, h1, qkv, att, x2, h2, f, g, g_deriv, probs] =
            carve(buf, Self::lens(rd, s, keep));
        Self {
            keep,
            st1,
            st2,
            h1,
            qkv,
            att,
            x2,
            h2,
            f,
            g,
            g_deriv,
            probs,
        }
    }
}

/// # Panics
/// On inputs that break the contract: a unit index out of range, buffers of the wrong length, a
/// micro-batch longer than `seq_len`, or a token id or target `>= vocab`.
impl Model for Gpt {
    fn units(&self) -> Vec<UnitSpec> {
        self.units.clone()
    }

    fn decoder<'a>(&'a self, params: &'a [Vec<f32>]) -> Option<Box<dyn Decoder + 'a>> {
        Some(Box::new(decode::GptDecoder::new(self, params)))
    }

    fn ties(&self) -> Vec<Tie> {
        Tie::head_on_embedding(self.cfg.tie_embeddings, self.cfg.layers)
    }

    fn init_unit(&self, unit: usize, seed: u64) -> Vec<f32> {
        let _ = self.kind(unit); // the range check
        init_unit_buffer(&self.units[unit], &self.inits[unit], seed, unit)
    }

    fn forward(&self, unit: usize, params: &[f32], x: &[f32], mb: &MicroBatch) -> Vec<f32> {
        let (kind, s) = self.check(unit, params, x, mb);
        match kind {
            UnitKind::Embed => self.embed_forward(params, mb),
            UnitKind::Block => self.block(params, s.d_model).forward(x, s),
            UnitKind::Head => self.head_forward(params, x),
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
        let (kind, s) = self.check(unit, params, x, mb);
        assert_eq!(
            grad_params.len(),
            params.len(),
            "unit {unit}: gradient buffer length"
        );
        let out_width = match kind {
            UnitKind::Head => self.cfg.vocab,
            _ => self.cfg.d_model,
        };
        assert_eq!(
            grad_out.len(),
            mb.batch * mb.seq * out_width,
            "unit {unit}: grad_out length"
        );
        match kind {
            UnitKind::Embed => {
                self.embed_backward(grad_out, mb, grad_params);
                Vec::new()
            }
            UnitKind::Block => self
                .block(params, s.d_model)
                .backward(x, grad_out, s, grad_params),
            UnitKind::Head => self.head_backward(params, x, grad_out, grad_params),
        }
    }

    /// Blocks keep their activations; the embedding and the head have little to recompute.
    fn forward_keep(
        &self,
        unit: usize,
        params: &[f32],
        x: &[f32],
        mb: &MicroBatch,
    ) -> (Vec<f32>, Option<Kept>) {
        let (kind, s) = self.check(unit, params, x, mb);
        if kind != UnitKind::Block {
            return (self.forward(unit, params, x, mb), None);
        }
        let (out, acts) = self.block(params, s.d_model).forward_keep(x, s);
        let kept = Kept {
            bytes: 4 * Acts::len(x.len(), s, Keep::ForBackward) as u64,
            data: Box::new(acts),
        };
        (out, Some(kept))
    }

    fn backward_kept(
        &self,
        unit: usize,
        params: &[f32],
        x: &[f32],
        kept: Option<Kept>,
        grad_out: &[f32],
        mb: &MicroBatch,
        grad_params: &mut [f32],
    ) -> Vec<f32> {
        let mut kept_ws = match kept.map(|k| k.data.downcast::<Scratch>()) {
            Some(Ok(ws)) => ws,
            // Nothing kept (or not ours): recompute.
            _ => return self.backward(unit, params, x, grad_out, mb, grad_params),
        };
        let (kind, s) = self.check(unit, params, x, mb);
        let rd = x.len();
        assert!(
            kind == UnitKind::Block && kept_ws.elems() >= Acts::len(rd, s, Keep::ForBackward),
            "unit {unit}: kept activations do not fit this call"
        );
        let [acts] = kept_ws.carve([Acts::len(rd, s, Keep::ForBackward)]);
        assert_eq!(grad_out.len(), rd, "unit {unit}: grad_out length");
        assert_eq!(
            grad_params.len(),
            params.len(),
            "unit {unit}: gradient buffer length"
        );
        let mut ws = Scratch::take();
        let [dh, dx2, dp] = ws.carve([rd, rd, s.seq * s.seq]);
        let a = Acts::carve(acts, rd, s, Keep::ForBackward);
        self.block(params, s.d_model)
            .backward_acts(x, grad_out, s, grad_params, a, [dh, dx2, dp])
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
        self.cfg.seq_len
    }

    fn forward_flops(&self, tokens: u64, seq: u64) -> Option<u64> {
        let (d, v, l) = (
            self.cfg.d_model as u64,
            self.cfg.vocab as u64,
            self.cfg.layers as u64,
        );
        // Per token: qkv (d x 3d), proj (d x d), fc1 (d x 4d), fc2 (4d x d) in every block,
        // q kᵀ and P v (seq x d each) in every block, and the head (d x vocab).
        let per_token = 2 * l * (12 * d * d + 2 * seq * d) + 2 * d * v;
        Some(per_token * tokens)
    }
}

mod decode;
#[cfg(test)]
mod tests;
