//! GPT-2's tensor names and layouts against our GPT's (`model::gpt`).
//!
//! The architectures are the same; transformers stores `c_attn`, `c_proj` and `c_fc` as
//! `Conv1D`, whose weight is `[in, out]`, the transpose of our `[out, in]` Linear, and the
//! hub's checkpoints name tensors without the `transformer.` prefix that `save_pretrained`
//! writes. With tied embeddings there is no `lm_head.weight`: our head borrows `tok.weight`.

use super::source::Naming;

/// The base-model prefix `save_pretrained` writes (the hub's own files have none).
pub const PREFIX: &str = "transformer.";

/// Buffers of old checkpoints that are not parameters (transformers PR #24113).
const STALE_BUFFERS: &[&str] = &[".attn.bias", ".attn.masked_bias"];

/// transformers' name of our parameter `ours` (without the `transformer.` prefix), and whether
/// the stored tensor is the transpose of ours; `None` for a name GPT-2 does not have.
pub fn hf_name(ours: &str) -> Option<(String, bool)> {
    let fixed = match ours {
        "tok.weight" => Some("wte.weight"),
        "pos.weight" => Some("wpe.weight"),
        "ln_f.weight" => Some("ln_f.weight"),
        "ln_f.bias" => Some("ln_f.bias"),
        "head.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = fixed {
        return Some((n.to_string(), false));
    }
    let rest = ours.strip_prefix("blocks.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, kind) = rest.split_once('.')?;
    let hf_module = match module {
        "ln1" => "ln_1",
        "ln2" => "ln_2",
        "qkv" => "attn.c_attn",
        "proj" => "attn.c_proj",
        "fc1" => "mlp.c_fc",
        "fc2" => "mlp.c_proj",
        _ => return None,
    };
    let conv = !module.starts_with("ln");
    Some((
        format!("h.{layer}.{hf_module}.{kind}"),
        conv && kind == "weight",
    ))
}

/// Where a name of transformers' sits in the checkpoint: `lm_head` is never prefixed.
fn stored_name(hf: &str, prefixed: bool) -> String {
    match prefixed && !hf.starts_with("lm_head.") {
        true => format!("{PREFIX}{hf}"),
        false => hf.to_string(),
    }
}

/// GPT-2's names, with or without the `transformer.` prefix (the hub's files have none,
/// `save_pretrained` writes it).
pub struct Gpt2Names {
    pub prefixed: bool,
}

impl Naming for Gpt2Names {
    fn family(&self) -> &str {
        "GPT-2"
    }

    fn stored(&self, ours: &str) -> Option<(String, bool)> {
        hf_name(ours).map(|(n, t)| (stored_name(&n, self.prefixed), t))
    }

    /// The stale attention buffers, and a tied checkpoint's `lm_head.weight`.
    fn ignorable(&self, stored: &str) -> bool {
        STALE_BUFFERS.iter().any(|s| stored.ends_with(s)) || stored == "lm_head.weight"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_with_the_conv1d_transposes() {
        assert_eq!(hf_name("tok.weight"), Some(("wte.weight".into(), false)));
        assert_eq!(
            hf_name("blocks.11.qkv.weight"),
            Some(("h.11.attn.c_attn.weight".into(), true))
        );
        assert_eq!(
            hf_name("blocks.0.fc2.bias"),
            Some(("h.0.mlp.c_proj.bias".into(), false))
        );
        assert_eq!(
            hf_name("blocks.3.ln2.weight"),
            Some(("h.3.ln_2.weight".into(), false))
        );
        assert_eq!(hf_name("blocks.3.mystery.weight"), None);
        assert_eq!(stored_name("lm_head.weight", true), "lm_head.weight");
        assert_eq!(stored_name("wte.weight", true), "transformer.wte.weight");
        assert_eq!(
            super::super::source::transpose(&[1., 2., 3., 4., 5., 6.], 2, 3),
            vec![1., 4., 2., 5., 3., 6.]
        );
    }
}
