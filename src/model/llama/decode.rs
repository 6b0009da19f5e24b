//! Incremental decoding with a KV cache for the Llama family: each new token runs the layers on
//! its own row, rotated at its position, with attention over the keys (already rotated) and
//! values cached for the tokens before it. The cache holds `kv_heads` heads, not `heads`: the
//! grouped-query saving applies to decoding memory too.

use super::super::{Decoder, Model};
use super::{Layer, Llama};
use crate::model::attention::attend_cached;
use crate::model::layers::Linear;

/// A Llama's decoding state: its parameters and every layer's cached keys and values.
pub(super) struct LlamaDecoder<'a> {
    m: &'a Llama,
    params: &'a [Vec<f32>],
    /// Per layer: keys and values `[pos, kv_heads · head_dim]`.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    pos: usize,
}

impl<'a> LlamaDecoder<'a> {
    pub(super) fn new(m: &'a Llama, params: &'a [Vec<f32>]) -> Self {
        assert_eq!(params.len(), m.units.len(), "one parameter buffer per unit");
        let layers = m.cfg.layers;
        Self {
            m,
            params,
            keys: vec![Vec::new(); layers],
            values: vec![Vec::new(); layers],
            pos: 0,
        }
    }

    /// One layer on the row `x` at position `self.pos`, in place.
    fn layer(&mut self, layer: usize, x: &mut [f32]) {
        let m = self.m;
        let c = &m.cfg;
        let l = Layer::new(m, &self.params[1 + layer]);
        let be = m.backend();
        let (d, hd, group) = (c.d_model, c.head_dim, c.heads / c.kv_heads);
        let (qw, kvw) = (c.q_width(), c.kv_width());
        let mut inv = [0f32; 1];
        let mut h = vec![0f32; d];
        be.rms_norm_forward(x, l.norm1, c.norm_eps, &mut h, &mut inv);
        let (mut q, mut k, mut v) = (vec![0f32; qw], vec![0f32; kvw], vec![0f32; kvw]);
        l.q.forward_into(&h, &mut q);
        l.k.forward_into(&h, &mut k);
        l.v.forward_into(&h, &mut v);
        be.rope(&mut q, qw, 0, self.pos, &m.rope, false);
        be.rope(&mut k, kvw, 0, self.pos, &m.rope, false);
        self.keys[layer].extend_from_slice(&k);
        self.values[layer].extend_from_slice(&v);
        let (keys, values) = (&self.keys[layer], &self.values[layer]);
        let mut att = vec![0f32; qw];
        for head in 0..c.heads {
            let (q, out) = (
                &q[head * hd..(head + 1) * hd],
                &mut att[head * hd..(head + 1) * hd],
            );
            // Query head `head` reads its group's key/value head.
            attend_cached(q, keys, values, kvw, (head / group) * hd, out);
        }
        let mut y = vec![0f32; d];
        l.o.forward_into(&att, &mut y);
        be.add(x, &y);
        be.rms_norm_forward(x, l.norm2, c.norm_eps, &mut h, &mut inv);
        let (mut g, mut u) = (vec![0f32; c.ffn], vec![0f32; c.ffn]);
        l.gate.forward_into(&h, &mut g);
        l.up.forward_into(&h, &mut u);
        let mut s = vec![0f32; c.ffn];
        be.silu(&g, &mut s, None);
        be.mul(&mut s, &u);
        l.down.forward_into(&s, &mut y);
        be.add(x, &y);
    }
}

impl Decoder for LlamaDecoder<'_> {
    fn len(&self) -> usize {
        self.pos
    }

    fn capacity(&self) -> usize {
        self.m.cfg.max_positions
    }

    fn push(&mut self, token: u32) -> Vec<f32> {
        let m = self.m;
        let (d, v) = (m.cfg.d_model, m.cfg.vocab);
        assert!(self.pos < self.capacity(), "decoding past max_positions");
        assert!(
            (token as usize) < v,
            "token {token} beyond the vocabulary {v}"
        );
        let table = &self.params[0];
        let t = token as usize;
        let mut x: Vec<f32> = table[t * d..(t + 1) * d].to_vec();
        for layer in 0..m.cfg.layers {
            self.layer(layer, &mut x);
        }
        let own = &self.params[m.units.len() - 1];
        let (norm, w) = own.split_at(d);
        let w = match m.cfg.tie_embeddings {
            true => &table[..],
            false => w,
        };
        let mut inv = [0f32; 1];
        let mut h = vec![0f32; d];
        m.backend()
            .rms_norm_forward(&x, norm, m.cfg.norm_eps, &mut h, &mut inv);
        let mut logits = vec![0f32; v];
        Linear::new(m.backend(), w, None, d, v).forward_into(&h, &mut logits);
        self.pos += 1;
        logits
    }
}
