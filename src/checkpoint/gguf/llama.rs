//! A Llama model's shape from GGUF metadata (llama.cpp's `llama.*` keys), checked against the
//! embedding tensor so that a shape which disagrees with the weights is refused here, not
//! discovered as a slice-length panic later.

use super::value::GgufValue;
use super::GgufFile;
use crate::checkpoint::error::CheckpointError;

/// The architectures whose shape is read here.
const SUPPORTED: &str = "llama";
/// llama.cpp's default when `llama.rope.freq_base` is absent.
const ROPE_THETA_DEFAULT: f64 = 10_000.0;

/// What a Llama decoder needs to be built, in Hugging Face `LlamaConfig` terms.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufLlama {
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub context_length: usize,
    /// No `output.weight`: the head reuses the embedding.
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
}

/// A value GGUF stores as f32, as the decimal it was written from: the converter wrote
/// `rms_norm_eps = 1e-05` from `config.json`, and the f32 nearest 1e-5 reads back as
/// 9.99999974e-6. The shortest decimal that round-trips the f32 recovers 1e-5, which is what
/// `config.json` says; an f64 value is taken as it is.
fn decimal(v: &GgufValue) -> Option<f64> {
    match *v {
        GgufValue::F32(x) => x.to_string().parse().ok(),
        _ => v.as_f64(),
    }
}

pub fn shape(file: &GgufFile) -> Result<GgufLlama, CheckpointError> {
    let bad = |what: String| CheckpointError::incompatible(file.path(), what);
    let arch = file.metadata("general.architecture").ok_or_else(|| {
        bad(format!(
            "no general.architecture in the metadata (supported: {SUPPORTED})"
        ))
    })?;
    if arch.as_str() != Some("llama") {
        let named = arch
            .as_str()
            .map_or_else(|| format!("{arch:?}"), |s| format!("{s:?}"));
        return Err(bad(format!(
            "general.architecture is {named}, which is not read (supported: {SUPPORTED})"
        )));
    }
    let count = |key: &str| -> Result<Option<usize>, CheckpointError> {
        let Some(v) = file.metadata(key) else {
            return Ok(None);
        };
        match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
            Some(n) if n > 0 => Ok(Some(n)),
            _ => Err(bad(format!(
                "{key} is {v:?}: expected a positive integer (a per-layer array is not read)"
            ))),
        }
    };
    let required = |key: &str| count(key)?.ok_or_else(|| bad(format!("{key} is missing")));
    let float = |key: &str| -> Result<Option<f64>, CheckpointError> {
        let Some(v) = file.metadata(key) else {
            return Ok(None);
        };
        match decimal(v) {
            Some(x) if x.is_finite() && x > 0.0 => Ok(Some(x)),
            _ => Err(bad(format!("{key} is {v:?}: expected a positive number"))),
        }
    };
    let hidden = required("llama.embedding_length")?;
    let heads = required("llama.attention.head_count")?;
    let kv_heads = count("llama.attention.head_count_kv")?.unwrap_or(heads);
    let head_dim = match count("llama.attention.key_length")? {
        Some(d) => d,
        None if hidden.is_multiple_of(heads) => hidden / heads,
        None => {
            return Err(bad(format!(
                "llama.embedding_length {hidden} is not a multiple of llama.attention.head_count \
                 {heads}, and llama.attention.key_length is absent"
            )))
        }
    };
    if !heads.is_multiple_of(kv_heads) || !head_dim.is_multiple_of(2) {
        return Err(bad(format!(
            "{heads} heads, {kv_heads} kv heads, head_dim {head_dim}: the heads must be a \
             multiple of the kv heads, and head_dim even (RoPE rotates pairs)"
        )));
    }
    if let Some(rot) = count("llama.rope.dimension_count")? {
        if rot != head_dim {
            return Err(bad(format!(
                "llama.rope.dimension_count {rot} differs from head_dim {head_dim}: partial \
                 rotary embeddings are not supported"
            )));
        }
    }
    let vocab = embedding_rows(file, hidden)?;
    if let Some(v) = count("llama.vocab_size")? {
        if v != vocab {
            return Err(bad(format!(
                "llama.vocab_size {v} differs from token_embd.weight's {vocab} rows"
            )));
        }
    }
    let token_id = |key: &str| -> Result<Option<u32>, CheckpointError> {
        file.metadata(key)
            .map(|v| {
                v.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| bad(format!("{key} is {v:?}: expected a token id")))
            })
            .transpose()
    };
    Ok(GgufLlama {
        vocab,
        hidden,
        intermediate: required("llama.feed_forward_length")?,
        layers: required("llama.block_count")?,
        heads,
        kv_heads,
        head_dim,
        rope_theta: float("llama.rope.freq_base")?.unwrap_or(ROPE_THETA_DEFAULT),
        rms_norm_eps: float("llama.attention.layer_norm_rms_epsilon")?
            .ok_or_else(|| bad("llama.attention.layer_norm_rms_epsilon is missing".into()))?,
        context_length: required("llama.context_length")?,
        tie_word_embeddings: file.tensor("output.weight").is_none(),
        bos_token_id: token_id("tokenizer.ggml.bos_token_id")?,
        eos_token_id: token_id("tokenizer.ggml.eos_token_id")?,
    })
}

/// The vocabulary is what the embedding holds: `tokenizer.ggml.tokens` may be shorter (padded
/// embeddings), and `llama.vocab_size` is optional.
fn embedding_rows(file: &GgufFile, hidden: usize) -> Result<usize, CheckpointError> {
    let Some(t) = file.tensor("token_embd.weight") else {
        return Err(CheckpointError::incompatible(
            file.path(),
            "no token_embd.weight tensor: not a complete Llama model",
        ));
    };
    match t.shape()[..] {
        [rows, cols] if cols == hidden && rows > 0 => Ok(rows),
        ref s => Err(CheckpointError::incompatible(
            file.path(),
            format!("token_embd.weight has shape {s:?}, expected [vocab, {hidden}]"),
        )),
    }
}
