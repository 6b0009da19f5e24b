//! Llama tensor names: llama.cpp's (`blk.N.attn_q.weight`) against Hugging Face's
//! (`model.layers.N.self_attn.q_proj.weight`), after llama.cpp `gguf-py/gguf/tensor_mapping.py`.

/// Top-level tensors: (GGUF stem, HF stem, position in HF order).
const GLOBAL: &[(&str, &str, usize)] = &[
    ("token_embd", "model.embed_tokens", 0),
    ("output_norm", "model.norm", 2),
    ("output", "lm_head", 3),
];

/// Per-block tensors, in the order transformers lists a decoder layer's parameters.
const BLOCK: &[(&str, &str)] = &[
    ("attn_norm", "input_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("ffn_norm", "post_attention_layernorm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
];

/// Which q/k permutation a tensor carries (llama.cpp reorders the rows of these two).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Permuted {
    No,
    Query,
    Key,
}

fn split_suffix(name: &str) -> Option<(&str, &str)> {
    let (stem, suffix) = name.rsplit_once('.')?;
    matches!(suffix, "weight" | "bias").then_some((stem, suffix))
}

/// The HF name of a GGUF tensor and a key that sorts names into transformers' order, or None
/// for tensors Llama does not have in HF form (e.g. `rope_freqs`).
pub fn to_hf(gguf: &str) -> Option<(String, (usize, usize, usize, String))> {
    let (stem, suffix) = split_suffix(gguf)?;
    if let Some(&(_, hf, pos)) = GLOBAL.iter().find(|(g, _, _)| *g == stem) {
        return Some((format!("{hf}.{suffix}"), (pos, 0, 0, suffix.into())));
    }
    let rest = stem.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let slot = BLOCK.iter().position(|(g, _)| *g == part)?;
    let hf = format!("model.layers.{layer}.{}.{suffix}", BLOCK[slot].1);
    Some((hf, (1, layer, slot, suffix.into())))
}

/// The GGUF name of an HF tensor name, and whether its rows carry llama.cpp's permutation.
pub fn to_gguf(hf: &str) -> Option<(String, Permuted)> {
    let (stem, suffix) = split_suffix(hf)?;
    if let Some(&(g, _, _)) = GLOBAL.iter().find(|(_, h, _)| *h == stem) {
        return Some((format!("{g}.{suffix}"), Permuted::No));
    }
    let rest = stem.strip_prefix("model.layers.")?;
    let (layer, part) = rest.split_once('.')?;
    // Canonical decimal only, so `model.layers.01.…` is not an alias of layer 1.
    if layer.parse::<usize>().ok()?.to_string() != layer {
        return None;
    }
    let &(g, _) = BLOCK.iter().find(|(_, h)| *h == part)?;
    let permuted = match g {
        "attn_q" => Permuted::Query,
        "attn_k" => Permuted::Key,
        _ => Permuted::No,
    };
    Some((format!("blk.{layer}.{g}.{suffix}"), permuted))
}

/// Undoes llama.cpp's q/k row permutation on a `[rows, cols]` matrix (or a bias, `cols` = 1)
/// with `n` heads: `w.reshape(n, rows/n/2, 2, cols).swapaxes(1, 2).reshape(rows, cols)`.
/// llama.cpp interleaves each head's two rotary halves for its pairwise RoPE; HF's
/// `rotate_half` wants them as two contiguous halves again.
pub fn unpermute(w: &[f32], rows: usize, cols: usize, n: usize) -> Vec<f32> {
    let per_head = rows / n;
    let half = per_head / 2;
    let mut out = vec![0f32; w.len()];
    for r in 0..rows {
        let (h, within) = (r / per_head, r % per_head);
        let (a, b) = (within / half, within % half);
        let src = h * per_head + b * 2 + a;
        out[r * cols..(r + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for g in [
            "token_embd.weight",
            "output.weight",
            "blk.12.attn_k.weight",
            "blk.0.ffn_down.weight",
        ] {
            let (hf, _) = to_hf(g).unwrap();
            assert_eq!(to_gguf(&hf).unwrap().0, g);
        }
        assert_eq!(
            to_gguf("model.layers.3.self_attn.q_proj.weight").unwrap().1,
            Permuted::Query
        );
        assert!(to_hf("rope_freqs.weight").is_none());
        assert!(to_gguf("model.layers.01.mlp.up_proj.weight").is_none());
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp's permute: reshape(n, 2, rows/n/2, cols).swapaxes(1, 2).
        let (rows, cols, n) = (8, 3, 2);
        let w: Vec<f32> = (0..rows * cols).map(|x| x as f32).collect();
        let half = rows / n / 2;
        let mut permuted = vec![0f32; w.len()];
        for h in 0..n {
            for i in 0..half {
                for j in 0..2 {
                    let dst = h * rows / n + i * 2 + j;
                    let src = h * rows / n + j * half + i;
                    permuted[dst * cols..(dst + 1) * cols]
                        .copy_from_slice(&w[src * cols..(src + 1) * cols]);
                }
            }
        }
        assert_eq!(unpermute(&permuted, rows, cols, n), w);
    }
}
