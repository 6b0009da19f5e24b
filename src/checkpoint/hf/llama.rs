//! The Llama family's tensor names against our `model::llama`: the same names and layouts
//! (our Llama uses transformers' `state_dict` names), with or without the `model.` prefix of a
//! `*ForCausalLM` checkpoint.

use super::source::Naming;

/// The base-model prefix of a `*ForCausalLM` checkpoint; our names carry it.
pub const PREFIX: &str = "model.";

/// Llama/Qwen2 names; `prefixed`: the checkpoint spells `model.layers…` (every
/// `save_pretrained` of a causal LM does), else the bare `layers…` of a `LlamaModel`.
pub struct LlamaNames {
    pub prefixed: bool,
    pub family: &'static str,
}

impl Naming for LlamaNames {
    fn family(&self) -> &str {
        self.family
    }

    fn stored(&self, ours: &str) -> Option<(String, bool)> {
        let known = ours.starts_with(PREFIX) || ours == "lm_head.weight";
        let name = match (self.prefixed, ours.strip_prefix(PREFIX)) {
            (false, Some(bare)) => bare.to_string(),
            _ => ours.to_string(),
        };
        known.then_some((name, false))
    }

    /// Old checkpoints' RoPE buffers, and a tied checkpoint that saved the head anyway.
    fn ignorable(&self, stored: &str) -> bool {
        stored.ends_with("rotary_emb.inv_freq") || stored == "lm_head.weight"
    }
}
