//! Incremental decoding with a KV cache: each new token runs the blocks on its own row, with
//! attention over the keys and values cached for the tokens before it, so generating `n`
//! tokens costs `n` single-row passes instead of `n` passes over the whole context.
//!
//! The cache holds every block's keys and values for the positions so far
//! (`2 · layers · positions · d_model` floats) and is bounded by the position table: a GPT
//! with learned positions cannot see past `seq_len`, so decoding stops there.

use super::super::{Decoder, Model};
use super::{Gpt, UnitKind};
use crate::model::attention::attend_cached;
use crate::model::layers::{LayerNorm, Linear};
use crate::model::ops::split_params;

/// A GPT's decoding state: its parameters and the cached keys and values.
pub(super) struct GptDecoder<'a> {
    gpt: &'a Gpt,
    params: &'a [Vec<f32>],
    /// Per block: keys and values `[pos, d_model]`, appended as tokens arrive.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    pos: usize,
}

impl<'a> GptDecoder<'a> {
    pub(super) fn new(gpt: &'a Gpt, params: &'a [Vec<f32>]) -> Self {
        assert_eq!(
            params.len(),
            gpt.units.len(),
            "one parameter buffer per unit"
        );
        let layers = gpt.cfg.layers;
        Self {
            gpt,
            params,
            keys: vec![Vec::new(); layers],
            values: vec![Vec::new(); layers],
            pos: 0,
        }
    }

    /// One block on the row `x` at position `self.pos`, in place.
    fn block(&mut self, layer: usize, x: &mut [f32]) {
        let gpt = self.gpt;
        let (d, h) = (gpt.cfg.d_model, gpt.cfg.heads);
        let b = gpt.block(&self.params[1 + layer], d);
        let be = gpt.backend();
        let mut st = [0f32; 2];
        let mut hn = vec![0f32; d];
        b.ln1.forward_into(x, &mut hn, &mut st);
        let mut qkv = vec![0f32; 3 * d];
        b.qkv.forward_into(&hn, &mut qkv);
        self.keys[layer].extend_from_slice(&qkv[d..2 * d]);
        self.values[layer].extend_from_slice(&qkv[2 * d..]);
        let (keys, values) = (&self.keys[layer], &self.values[layer]);
        let hd = d / h;
        let mut att = vec![0f32; d];
        for head in 0..h {
            let (q, out) = (
                &qkv[head * hd..(head + 1) * hd],
                &mut att[head * hd..(head + 1) * hd],
            );
            attend_cached(q, keys, values, d, head * hd, out);
        }
        let mut y = vec![0f32; d];
        b.proj.forward_into(&att, &mut y);
        be.add(x, &y);
        b.ln2.forward_into(x, &mut hn, &mut st);
        let mut f = vec![0f32; 4 * d];
        b.fc1.forward_into(&hn, &mut f);
        let mut g = vec![0f32; 4 * d];
        be.gelu(gpt.cfg.gelu, &f, &mut g, None);
        b.fc2.forward_into(&g, &mut y);
        be.add(x, &y);
    }
}

impl Decoder for GptDecoder<'_> {
    fn len(&self) -> usize {
        self.pos
    }

    fn capacity(&self) -> usize {
        self.gpt.cfg.seq_len
    }

    fn push(&mut self, token: u32) -> Vec<f32> {
        let gpt = self.gpt;
        let (d, v) = (gpt.cfg.d_model, gpt.cfg.vocab);
        assert!(
            self.pos < self.capacity(),
            "decoding past the position table"
        );
        assert!(
            (token as usize) < v,
            "token {token} beyond the vocabulary {v}"
        );
        let [tok, pos] = split_params(&self.params[0], [v * d, gpt.cfg.seq_len * d]);
        let t = token as usize;
        let mut x: Vec<f32> = tok[t * d..(t + 1) * d].to_vec();
        gpt.backend()
            .add(&mut x, &pos[self.pos * d..(self.pos + 1) * d]);
        for layer in 0..gpt.cfg.layers {
            self.block(layer, &mut x);
        }
        let head_unit = gpt.units.len() - 1;
        debug_assert!(gpt.kind(head_unit) == UnitKind::Head);
        let own = &self.params[head_unit];
        let [w, b] = split_params(&own[..2 * d], [d, d]);
        let head_w = match gpt.cfg.tie_embeddings {
            true => tok,
            false => &own[2 * d..],
        };
        let mut st = [0f32; 2];
        let mut hn = vec![0f32; d];
        LayerNorm::new(gpt.backend(), w, b).forward_into(&x, &mut hn, &mut st);
        let mut logits = vec![0f32; v];
        Linear::new(gpt.backend(), head_w, None, d, v).forward_into(&hn, &mut logits);
        self.pos += 1;
        logits
    }
}
