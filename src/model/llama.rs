//! The Llama family as transformers' `modeling_llama.py` computes it (and Qwen2, which adds
//! biases to the q/k/v projections), cut into ZeRO units: the token embedding, one unit per
//! decoder layer, and the head (final norm and LM head).
//!
//! A layer is `h = x + o(attn(rope(q(n1(x))), rope(k(n1(x))), v(n1(x))))`, then
//! `h + down(silu(gate(n2(h))) · up(n2(h)))`, with RMSNorm `n1`, `n2` (eps from the config),
//! rotary embeddings in the rotate-half convention and grouped-query attention: key/value head
//! `j` serves query heads `j·g … j·g+g−1`, `g = heads / kv_heads`. No position table: RoPE is
//! computed, so the longest sequence is the config's `max_positions`. Bias-free except Qwen2's
//! q/k/v.
//!
//! Parameter names are transformers' own (`model.layers.0.self_attn.q_proj.weight`), in its
//! `state_dict` order, so a Hugging Face checkpoint maps name for name with no transposes.
//! With `tie_embeddings` the head borrows `model.embed_tokens.weight` (see [`super::tie`]).
//!
//! The attention kernel takes a fused `[q | k | v]` buffer with as many key/value heads as
//! query heads; the layer builds it by repeating each key/value head over its group after RoPE,
//! and the backward sums the group's gradients back, in a fixed order.

use std::sync::Arc;

use super::attention::AttnShape;
use super::backend::{Backend, Cpu};
use super::layers::Linear;
use super::ops::{split_params, split_params_mut, RopeTable};
use super::rng::{init_unit_buffer, unit_spec, Init};
use super::tie::Tie;
use super::workspace::{carve, Scratch};
use super::{Decoder, Kept, MicroBatch, Model, UnitSpec};

/// Shape of a [`Llama`].
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LlamaConfig {
    pub vocab: usize,
    /// Longest sequence (`max_position_embeddings`): the RoPE table's length.
    pub max_positions: usize,
    /// `hidden_size`.
    pub d_model: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (`num_key_value_heads`); divides `heads`.
    pub kv_heads: usize,
    /// Width of one head; `heads · head_dim` need not equal `d_model`.
    pub head_dim: usize,
    /// The MLP's inner width (`intermediate_size`).
    pub ffn: usize,
    pub layers: usize,
    /// RoPE base (`rope_theta`).
    pub rope_theta: f64,
    /// RMSNorm epsilon (`rms_norm_eps`).
    pub norm_eps: f64,
    /// Biases on the q/k/v projections (Qwen2).
    pub qkv_bias: bool,
    /// The LM head is the token embedding (`tie_word_embeddings`).
    pub tie_embeddings: bool,
}

impl LlamaConfig {
    /// Checks sizes, the head grouping and the RoPE and norm constants.
    pub fn validate(&self) -> Result<(), String> {
        let sizes = [
            ("vocab", self.vocab),
            ("max_positions", self.max_positions),
            ("d_model", self.d_model),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("ffn", self.ffn),
            ("layers", self.layers),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(format!("LlamaConfig.{name} is 0; it must be at least 1"));
        }
        if self.vocab > 1 << 32 {
            return Err(format!(
                "LlamaConfig.vocab is {}; token ids are u32, so at most 2^32",
                self.vocab
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(format!(
                "LlamaConfig.kv_heads ({}) must divide heads ({})",
                self.kv_heads, self.heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "LlamaConfig.head_dim ({}) must be even: RoPE rotates pairs",
                self.head_dim
            ));
        }
        if !(self.rope_theta > 1.0 && self.rope_theta.is_finite()) {
            return Err(format!(
                "LlamaConfig.rope_theta ({}) must be a finite base above 1",
                self.rope_theta
            ));
        }
        if !(self.norm_eps > 0.0 && self.norm_eps < 1.0) {
            return Err(format!(
                "LlamaConfig.norm_eps ({}) must be in (0, 1)",
                self.norm_eps
            ));
        }
        Ok(())
    }

    /// Query width `heads · head_dim`.
    fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Key (and value) width `kv_heads · head_dim`.
    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Lengths of a layer's 12 parameter slots in unit order; the bias slots are 0 without
    /// `qkv_bias`.
    fn layer_lens(&self) -> [usize; 12] {
        let (d, q, kv, f) = (self.d_model, self.q_width(), self.kv_width(), self.ffn);
        let bias = |n: usize| if self.qkv_bias { n } else { 0 };
        [
            q * d,
            bias(q),
            kv * d,
            bias(kv),
            kv * d,
            bias(kv),
            d * q,
            f * d,
            f * d,
            d * f,
            d,
            d,
        ]
    }
}

/// What a unit index refers to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum UnitKind {
    Embed,
    Layer,
    Head,
}

/// A Llama-family decoder implementing [`Model`]; see the module docs.
#[derive(Clone, Debug)]
pub struct Llama {
    cfg: LlamaConfig,
    units: Vec<UnitSpec>,
    inits: Vec<Vec<Init>>,
    rope: Arc<RopeTable>,
    be: Arc<dyn Backend>,
}

fn layer_unit(i: usize, c: &LlamaConfig) -> (UnitSpec, Vec<Init>) {
    let p = |name: &str| format!("model.layers.{i}.{name}");
    let (d, q, kv, f) = (c.d_model, c.q_width(), c.kv_width(), c.ffn);
    let mut params = Vec::new();
    for (proj, out) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
        params.push((
            p(&format!("self_attn.{proj}.weight")),
            vec![out, d],
            Init::Normal,
        ));
        if c.qkv_bias {
            params.push((p(&format!("self_attn.{proj}.bias")), vec![out], Init::Zeros));
        }
    }
    params.extend([
        (p("self_attn.o_proj.weight"), vec![d, q], Init::Normal),
        (p("mlp.gate_proj.weight"), vec![f, d], Init::Normal),
        (p("mlp.up_proj.weight"), vec![f, d], Init::Normal),
        (p("mlp.down_proj.weight"), vec![d, f], Init::Normal),
        (p("input_layernorm.weight"), vec![d], Init::Ones),
        (p("post_attention_layernorm.weight"), vec![d], Init::Ones),
    ]);
    unit_spec(format!("model.layers.{i}"), params)
}

impl Llama {
    /// A Llama of shape `cfg` on the reference CPU backend.
    pub fn new(cfg: LlamaConfig) -> Result<Self, String> {
        Self::with_backend(cfg, Arc::new(Cpu))
    }

    /// A Llama of shape `cfg` whose kernels run on `be`.
    pub fn with_backend(cfg: LlamaConfig, be: Arc<dyn Backend>) -> Result<Self, String> {
        cfg.validate()?;
        let (d, v) = (cfg.d_model, cfg.vocab);
        let mut all = vec![unit_spec(
            "model.embed_tokens".into(),
            vec![("model.embed_tokens.weight".into(), vec![v, d], Init::Normal)],
        )];
        all.extend((0..cfg.layers).map(|i| layer_unit(i, &cfg)));
        let mut head = vec![("model.norm.weight".into(), vec![d], Init::Ones)];
        if !cfg.tie_embeddings {
            head.push(("lm_head.weight".into(), vec![v, d], Init::Normal));
        }
        all.push(unit_spec("head".into(), head));
        let (units, inits) = all.into_iter().unzip();
        let rope = Arc::new(RopeTable::new(
            cfg.rope_theta,
            cfg.head_dim,
            cfg.max_positions,
        ));
        Ok(Self {
            cfg,
            units,
            inits,
            rope,
            be,
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    fn layer<'a>(&'a self, params: &'a [f32]) -> Layer<'a> {
        Layer::new(self, params)
    }

    fn kind(&self, unit: usize) -> UnitKind {
        let n = self.units.len();
        assert!(
            unit < n,
            "unit {unit} out of range: this Llama has {n} units"
        );
        match unit {
            0 => UnitKind::Embed,
            u if u <= self.cfg.layers => UnitKind::Layer,
            _ => UnitKind::Head,
        }
    }

    /// Validates the unit index, its buffers and the micro-batch.
    fn check(&self, unit: usize, params: &[f32], x: &[f32], mb: &MicroBatch) -> (UnitKind, Shape) {
        let kind = self.kind(unit);
        let borrowed = match kind {
            UnitKind::Head if self.cfg.tie_embeddings => self.cfg.vocab * self.cfg.d_model,
            _ => 0,
        };
        assert_eq!(
            params.len(),
            self.units[unit].numel() + borrowed,
            "unit {unit}: parameter buffer length"
        );
        assert!(
            mb.seq <= self.cfg.max_positions,
            "micro-batch seq {} exceeds the model's max_positions {}",
            mb.seq,
            self.cfg.max_positions
        );
        assert_eq!(
            mb.inputs.len(),
            mb.batch * mb.seq,
            "micro-batch inputs length"
        );
        if let Some(&t) = mb.inputs.iter().find(|&&t| t as usize >= self.cfg.vocab) {
            panic!("token id {t} out of range for vocab {}", self.cfg.vocab);
        }
        if unit != 0 {
            assert_eq!(
                x.len(),
                mb.batch * mb.seq * self.cfg.d_model,
                "unit {unit}: input length"
            );
        }
        (kind, Shape::new(&self.cfg, mb))
    }

    fn head_weight<'a>(&self, params: &'a [f32]) -> (&'a [f32], &'a [f32]) {
        params.split_at(self.cfg.d_model)
    }

    fn head_forward(&self, params: &[f32], x: &[f32]) -> Vec<f32> {
        let (d, v) = (self.cfg.d_model, self.cfg.vocab);
        let (norm, w) = self.head_weight(params);
        let rows = x.len() / d;
        let mut ws = Scratch::take();
        let [inv, h] = ws.carve([rows, x.len()]);
        self.be.rms_norm_forward(x, norm, self.cfg.norm_eps, h, inv);
        let mut logits = vec![0.0; rows * v];
        Linear::new(&*self.be, w, None, d, v).forward_into(h, &mut logits);
        logits
    }

    fn head_backward(
        &self,
        params: &[f32],
        x: &[f32],
        dout: &[f32],
        grads: &mut [f32],
    ) -> Vec<f32> {
        let (d, v) = (self.cfg.d_model, self.cfg.vocab);
        let (norm, w) = self.head_weight(params);
        let (g_norm, g_w) = grads.split_at_mut(d);
        let rows = x.len() / d;
        let mut ws = Scratch::take();
        let [inv, h, dh] = ws.carve([rows, x.len(), x.len()]);
        self.be.rms_norm_forward(x, norm, self.cfg.norm_eps, h, inv);
        Linear::new(&*self.be, w, None, d, v).backward_into(h, dout, g_w, None, dh);
        let mut dx = vec![0.0; x.len()];
        self.be.rms_norm_backward(x, inv, dh, norm, g_norm, &mut dx);
        dx
    }
}

/// The sizes of one micro-batch through a layer.
#[derive(Clone, Copy, Debug)]
struct Shape {
    rows: usize,
    d: usize,
    q: usize,
    kv: usize,
    ffn: usize,
    /// The attention kernel's view: query width, every head with its own (repeated) k and v.
    attn: AttnShape,
}

impl Shape {
    fn new(c: &LlamaConfig, mb: &MicroBatch) -> Self {
        Self {
            rows: mb.batch * mb.seq,
            d: c.d_model,
            q: c.q_width(),
            kv: c.kv_width(),
            ffn: c.ffn,
            attn: AttnShape::new(mb.batch, mb.seq, c.q_width(), c.heads),
        }
    }
}

/// Views of one decoder layer's parameters.
struct Layer<'a> {
    m: &'a Llama,
    q: Linear<'a>,
    k: Linear<'a>,
    v: Linear<'a>,
    o: Linear<'a>,
    gate: Linear<'a>,
    up: Linear<'a>,
    down: Linear<'a>,
    norm1: &'a [f32],
    norm2: &'a [f32],
}

/// A present bias slot, `None` for an empty one.
fn some(b: &[f32]) -> Option<&[f32]> {
    (!b.is_empty()).then_some(b)
}

fn some_mut(b: &mut [f32]) -> Option<&mut [f32]> {
    (!b.is_empty()).then_some(b)
}

impl<'a> Layer<'a> {
    fn new(m: &'a Llama, params: &'a [f32]) -> Self {
        let c = &m.cfg;
        let [qw, qb, kw, kb, vw, vb, ow, gw, uw, dw, n1, n2] = split_params(params, c.layer_lens());
        let be = &*m.be;
        let (d, q, kv, f) = (c.d_model, c.q_width(), c.kv_width(), c.ffn);
        Self {
            m,
            q: Linear::new(be, qw, some(qb), d, q),
            k: Linear::new(be, kw, some(kb), d, kv),
            v: Linear::new(be, vw, some(vb), d, kv),
            o: Linear::new(be, ow, None, q, d),
            gate: Linear::new(be, gw, None, d, f),
            up: Linear::new(be, uw, None, d, f),
            down: Linear::new(be, dw, None, f, d),
            norm1: n1,
            norm2: n2,
        }
    }

    fn be(&self) -> &'a dyn Backend {
        &*self.m.be
    }

    /// Copies `q` and every key/value head, repeated over its group, into the fused
    /// `[rows, 3·q]` buffer the attention kernel reads.
    fn fuse(&self, s: Shape, q: &[f32], k: &[f32], v: &[f32], qkv: &mut [f32]) {
        let (hd, group) = (self.m.cfg.head_dim, self.m.cfg.heads / self.m.cfg.kv_heads);
        for r in 0..s.rows {
            let out = &mut qkv[r * 3 * s.q..(r + 1) * 3 * s.q];
            out[..s.q].copy_from_slice(&q[r * s.q..(r + 1) * s.q]);
            for (part, src) in [(1, k), (2, v)] {
                let src = &src[r * s.kv..(r + 1) * s.kv];
                for (h, dst) in out[part * s.q..(part + 1) * s.q]
                    .chunks_exact_mut(hd)
                    .enumerate()
                {
                    let j = h / group;
                    dst.copy_from_slice(&src[j * hd..(j + 1) * hd]);
                }
            }
        }
    }

    /// The fused gradient back to compact `dq`, `dk`, `dv`: each key/value head's gradient is
    /// the sum over the query heads of its group, added in head order.
    fn unfuse(&self, s: Shape, dqkv: &[f32], dq: &mut [f32], dk: &mut [f32], dv: &mut [f32]) {
        let (hd, group) = (self.m.cfg.head_dim, self.m.cfg.heads / self.m.cfg.kv_heads);
        let be = self.be();
        for r in 0..s.rows {
            let src = &dqkv[r * 3 * s.q..(r + 1) * 3 * s.q];
            dq[r * s.q..(r + 1) * s.q].copy_from_slice(&src[..s.q]);
            for (part, dst) in [(1, &mut *dk), (2, &mut *dv)] {
                let heads = &src[part * s.q..(part + 1) * s.q];
                let dst = &mut dst[r * s.kv..(r + 1) * s.kv];
                for (j, out) in dst.chunks_exact_mut(hd).enumerate() {
                    let first = j * group;
                    out.copy_from_slice(&heads[first * hd..(first + 1) * hd]);
                    for h in first + 1..first + group {
                        be.add(out, &heads[h * hd..(h + 1) * hd]);
                    }
                }
            }
        }
    }

    /// The forward up to the MLP's product `m`, into `a`.
    fn forward_acts(&self, x: &[f32], s: Shape, a: &mut Acts) {
        let (be, c) = (self.be(), &self.m.cfg);
        let rope = &*self.m.rope;
        be.rms_norm_forward(x, self.norm1, c.norm_eps, a.h1, a.inv1);
        self.q.forward_into(a.h1, a.q);
        self.k.forward_into(a.h1, a.k);
        self.v.forward_into(a.h1, a.v);
        let seq = s.attn.seq;
        be.rope(a.q, s.q, seq, 0, rope, false);
        be.rope(a.k, s.kv, seq, 0, rope, false);
        self.fuse(s, a.q, a.k, a.v, a.qkv);
        be.attention_forward(a.qkv, s.attn, a.att, a.probs, a.keep);
        self.o.forward_into(a.att, a.x2);
        be.add(a.x2, x);
        be.rms_norm_forward(a.x2, self.norm2, c.norm_eps, a.h2, a.inv2);
        self.gate.forward_into(a.h2, a.gate);
        self.up.forward_into(a.h2, a.up);
        let deriv = a.keep.then_some(&mut *a.silu_deriv);
        be.silu(a.gate, a.silu, deriv);
        a.m.copy_from_slice(a.silu);
        be.mul(a.m, a.up);
    }

    /// The layer's output, computed in a pooled arena laid out by [`Acts`] for `keep`; the
    /// arena is returned with it.
    fn forward_in_arena(&self, x: &[f32], s: Shape, keep: bool) -> (Vec<f32>, Scratch) {
        let mut ws = Scratch::take();
        let [buf] = ws.carve([Acts::len(s, keep)]);
        let mut a = Acts::carve(buf, s, keep);
        self.forward_acts(x, s, &mut a);
        let mut out = vec![0.0; x.len()];
        self.down.forward_into(a.m, &mut out);
        self.be().add(&mut out, a.x2);
        (out, ws)
    }

    /// Recomputes the forward from `x` (nothing was kept), then runs the backward.
    fn backward(&self, x: &[f32], dout: &[f32], s: Shape, grads: &mut [f32]) -> Vec<f32> {
        let mut ws = Scratch::take();
        let [buf] = ws.carve([Acts::len(s, true)]);
        let mut a = Acts::carve(buf, s, true);
        self.forward_acts(x, s, &mut a);
        self.backward_acts(x, dout, s, grads, a)
    }

    /// The backward from the forward's activations `a`.
    fn backward_acts(
        &self,
        x: &[f32],
        dout: &[f32],
        s: Shape,
        grads: &mut [f32],
        a: Acts,
    ) -> Vec<f32> {
        assert!(a.keep, "the backward needs the activations a forward kept");
        let (be, c) = (self.be(), &self.m.cfg);
        let [g_qw, g_qb, g_kw, g_kb, g_vw, g_vb, g_ow, g_gate, g_up, g_down, g_n1, g_n2] =
            split_params_mut(grads, c.layer_lens());
        let (rows, d) = (s.rows, s.d);
        let mut ws = Scratch::take();
        let [dm, dup, dh, tmp, dx2, datt, dqkv, dq, dk, dv, dp] = ws.carve([
            rows * s.ffn,
            rows * s.ffn,
            rows * d,
            rows * d,
            rows * d,
            rows * s.q,
            3 * rows * s.q,
            rows * s.q,
            rows * s.kv,
            rows * s.kv,
            s.attn.seq * s.attn.seq,
        ]);
        // MLP half: out = x2 + down(silu(gate) · up).
        self.down.backward_into(a.m, dout, g_down, None, dm);
        dup.copy_from_slice(dm);
        be.mul(dup, a.silu);
        be.mul(dm, a.up);
        be.mul(dm, a.silu_deriv);
        self.gate.backward_into(a.h2, dm, g_gate, None, dh);
        self.up.backward_into(a.h2, dup, g_up, None, tmp);
        be.add(dh, tmp);
        be.rms_norm_backward(a.x2, a.inv2, dh, self.norm2, g_n2, dx2);
        be.add(dx2, dout);
        // Attention half: x2 = x + o(attn(...)).
        self.o.backward_into(a.att, dx2, g_ow, None, datt);
        be.attention_backward(a.qkv, a.probs, datt, s.attn, dqkv, dp);
        self.unfuse(s, dqkv, dq, dk, dv);
        let (rope, seq) = (&*self.m.rope, s.attn.seq);
        be.rope(dq, s.q, seq, 0, rope, true);
        be.rope(dk, s.kv, seq, 0, rope, true);
        self.q.backward_into(a.h1, dq, g_qw, some_mut(g_qb), dh);
        self.k.backward_into(a.h1, dk, g_kw, some_mut(g_kb), tmp);
        be.add(dh, tmp);
        self.v.backward_into(a.h1, dv, g_vw, some_mut(g_vb), tmp);
        be.add(dh, tmp);
        let mut dx = vec![0.0; x.len()];
        be.rms_norm_backward(x, a.inv1, dh, self.norm1, g_n1, &mut dx);
        be.add(&mut dx, dx2);
        dx
    }
}

/// A layer's forward intermediates, carved from one buffer. Without `keep`, attention holds
/// one head's probabilities at a time and the SiLU derivative is not computed.
struct Acts<'b> {
    keep: bool,
    inv1: &'b mut [f32],
    h1: &'b mut [f32],
    q: &'b mut [f32],
    k: &'b mut [f32],
    v: &'b mut [f32],
    qkv: &'b mut [f32],
    att: &'b mut [f32],
    x2: &'b mut [f32],
    inv2: &'b mut [f32],
    h2: &'b mut [f32],
    gate: &'b mut [f32],
    up: &'b mut [f32],
    silu: &'b mut [f32],
    silu_deriv: &'b mut [f32],
    m: &'b mut [f32],
    probs: &'b mut [f32],
}

impl<'b> Acts<'b> {
    fn lens(s: Shape, keep: bool) -> [usize; 16] {
        let (r, d, f) = (s.rows, s.d, s.ffn);
        let (deriv, probs) = match keep {
            true => (r * f, s.attn.probs_len()),
            false => (0, s.attn.seq * s.attn.seq),
        };
        [
            r,
            r * d,
            r * s.q,
            r * s.kv,
            r * s.kv,
            3 * r * s.q,
            r * s.q,
            r * d,
            r,
            r * d,
            r * f,
            r * f,
            r * f,
            deriv,
            r * f,
            probs,
        ]
    }

    fn len(s: Shape, keep: bool) -> usize {
        Self::lens(s, keep).iter().sum()
    }

    fn carve(buf: &'b mut [f32], s: Shape, keep: bool) -> Self {
        let [inv1, h1, q, k, v, qkv, att, x2, inv2, h2, gate, up, silu, silu_deriv, m, probs] =
            carve(buf, Self::lens(s, keep));
        Self {
            keep,
            inv1,
            h1,
            q,
            k,
            v,
            qkv,
            att,
            x2,
            inv2,
            h2,
            gate,
            up,
            silu,
            silu_deriv,
            m,
            probs,
        }
    }
}

/// # Panics
/// On inputs that break the contract: a unit index out of range, buffers of the wrong length, a
/// micro-batch longer than `max_positions`, or a token id or target `>= vocab`.
impl Model for Llama {
    fn units(&self) -> Vec<UnitSpec> {
        self.units.clone()
    }

    fn decoder<'a>(&'a self, params: &'a [Vec<f32>]) -> Option<Box<dyn Decoder + 'a>> {
        Some(Box::new(decode::LlamaDecoder::new(self, params)))
    }

    fn ties(&self) -> Vec<Tie> {
        Tie::head_on_embedding(self.cfg.tie_embeddings, self.cfg.layers)
    }

    fn init_unit(&self, unit: usize, seed: u64) -> Vec<f32> {
        let _ = self.kind(unit);
        init_unit_buffer(&self.units[unit], &self.inits[unit], seed, unit)
    }

    fn forward(&self, unit: usize, params: &[f32], x: &[f32], mb: &MicroBatch) -> Vec<f32> {
        let (kind, s) = self.check(unit, params, x, mb);
        match kind {
            UnitKind::Embed => {
                let mut h = vec![0.0; mb.inputs.len() * self.cfg.d_model];
                self.be.embedding_forward(params, &mb.inputs, &mut h);
                h
            }
            UnitKind::Layer => self.layer(params).forward_in_arena(x, s, false).0,
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
        let width = match kind {
            UnitKind::Head => self.cfg.vocab,
            _ => self.cfg.d_model,
        };
        assert_eq!(
            grad_out.len(),
            s.rows * width,
            "unit {unit}: grad_out length"
        );
        match kind {
            UnitKind::Embed => {
                self.be
                    .embedding_backward(&mb.inputs, grad_out, grad_params);
                Vec::new()
            }
            UnitKind::Layer => self.layer(params).backward(x, grad_out, s, grad_params),
            UnitKind::Head => self.head_backward(params, x, grad_out, grad_params),
        }
    }

    /// Layers keep their activations; the embedding and the head have little to recompute.
    fn forward_keep(
        &self,
        unit: usize,
        params: &[f32],
        x: &[f32],
        mb: &MicroBatch,
    ) -> (Vec<f32>, Option<Kept>) {
        let (kind, s) = self.check(unit, params, x, mb);
        if kind != UnitKind::Layer {
            return (self.forward(unit, params, x, mb), None);
        }
        let (out, acts) = self.layer(params).forward_in_arena(x, s, true);
        let kept = Kept {
            bytes: 4 * Acts::len(s, true) as u64,
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
            _ => return self.backward(unit, params, x, grad_out, mb, grad_params),
        };
        let (kind, s) = self.check(unit, params, x, mb);
        let len = Acts::len(s, true);
        assert!(
            kind == UnitKind::Layer && kept_ws.elems() >= len,
            "unit {unit}: kept activations do not fit this call"
        );
        assert_eq!(grad_out.len(), x.len(), "unit {unit}: grad_out length");
        assert_eq!(
            grad_params.len(),
            params.len(),
            "unit {unit}: gradient buffer length"
        );
        let [buf] = kept_ws.carve([len]);
        let a = Acts::carve(buf, s, true);
        self.layer(params)
            .backward_acts(x, grad_out, s, grad_params, a)
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
        self.cfg.max_positions
    }

    fn forward_flops(&self, tokens: u64, seq: u64) -> Option<u64> {
        let c = &self.cfg;
        let (d, q, kv, f) = (
            c.d_model as u64,
            c.q_width() as u64,
            c.kv_width() as u64,
            c.ffn as u64,
        );
        // Per token and layer: q, k, v, o, gate, up, down, plus q kᵀ and P v over `seq` keys
        // at the query width; then the head.
        let per_layer = d * q + 2 * d * kv + q * d + 3 * d * f + 2 * seq * q;
        let per_token = 2 * c.layers as u64 * per_layer + 2 * d * c.vocab as u64;
        Some(per_token * tokens)
    }
}

mod decode;
#[cfg(test)]
mod tests;
