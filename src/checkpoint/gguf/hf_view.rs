//! A GGUF file seen as a Hugging Face model: its tensors as a [`TensorSource`] under
//! transformers' names, its shape as a `config.json` would give it, and the non-weight files
//! (`config.json`, `tokenizer.json`, `generation_config.json`) written into a directory, so a
//! run that starts from GGUF tokenizes, exports and generates exactly as one that starts from
//! the equivalent Hugging Face directory.

use std::ops::Range;
use std::path::Path;

use super::{GgufFile, GgufLlama};
use crate::checkpoint::error::{CheckpointError, IoContext};
use crate::checkpoint::hf::config::{llama_json, LlamaShape};
use crate::checkpoint::hf::llama::LlamaNames;
use crate::checkpoint::hf::source::{NamedWeights, TensorSource};
use crate::model::UnitSpec;

/// GGUF files name tensors as transformers' Llama does, with the `model.` prefix.
const NAMES: LlamaNames = LlamaNames {
    prefixed: true,
    family: "Llama (GGUF)",
};

impl TensorSource for GgufFile {
    fn origin(&self) -> &Path {
        self.path()
    }

    fn names(&self) -> Vec<String> {
        self.hf_names()
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let (gguf, _) = super::names::to_gguf(name)?;
        self.tensor(&gguf).map(|t| t.shape())
    }

    fn read_range(&self, name: &str, range: Range<usize>) -> Result<Vec<f32>, CheckpointError> {
        self.read_hf_range(name, range)?.ok_or_else(|| {
            CheckpointError::incompatible(self.path(), format!("has no tensor for `{name}`"))
        })
    }
}

impl GgufLlama {
    /// The shape a `config.json` of this model would give.
    pub fn hf_shape(&self) -> LlamaShape {
        LlamaShape {
            vocab: self.vocab,
            positions: self.context_length,
            d_model: self.hidden,
            layers: self.layers,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            ffn: self.intermediate,
            rope_theta: self.rope_theta,
            norm_eps: self.rms_norm_eps,
            qkv_bias: false,
            tied: self.tie_word_embeddings,
        }
    }
}

impl GgufFile {
    /// Every unit's full parameters (dequantized to f32) for a model of `units`.
    pub fn import(&self, units: &[UnitSpec]) -> Result<Vec<Vec<f32>>, CheckpointError> {
        NamedWeights::open(self, &NAMES, units)?.read_all()
    }

    /// The weights of a model of `units` (names and shapes checked now), read by range when
    /// asked.
    pub fn weights(self, units: &[UnitSpec]) -> Result<NamedWeights<GgufFile>, CheckpointError> {
        NamedWeights::open(self, &NAMES, units)
    }

    /// Writes `config.json`, `tokenizer.json`, `generation_config.json`,
    /// `tokenizer_config.json` (with the file's chat template) and `special_tokens_map.json`
    /// for this model into `dir` (created if needed).
    pub fn write_hf_companions(&self, dir: &Path) -> Result<(), CheckpointError> {
        let shape = self.llama_shape()?;
        std::fs::create_dir_all(dir).at(dir, "create")?;
        let mut cfg = llama_json(&shape.hf_shape(), None);
        let mut generation = serde_json::Map::new();
        for (key, id) in [
            ("bos_token_id", shape.bos_token_id),
            ("eos_token_id", shape.eos_token_id),
        ] {
            if let Some(id) = id {
                cfg.insert(key.into(), id.into());
                generation.insert(key.into(), id.into());
            }
        }
        let write = |name: &str, v: &serde_json::Map<String, serde_json::Value>| {
            let path = dir.join(name);
            let text = serde_json::to_string_pretty(v).expect("a JSON map serializes");
            std::fs::write(&path, text).at(&path, "write")
        };
        write("config.json", &cfg)?;
        write("generation_config.json", &generation)?;
        self.write_tokenizer_json(&dir.join("tokenizer.json"))?;
        let template = self
            .metadata("tokenizer.chat_template")
            .and_then(|v| v.as_str());
        crate::checkpoint::hf::tokenizer_files::complete(dir, &cfg, template).map(drop)
    }
}
