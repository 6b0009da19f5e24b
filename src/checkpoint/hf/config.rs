//! A Hugging Face model's `config.json`: which family it is and the shape it gives our model.
//!
//! Only what changes the arithmetic is read; a setting we do not implement is refused with its
//! key rather than trained differently from what transformers computes.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::super::error::{CheckpointError, IoContext};
use crate::config::{ModelKind, TrainConfig};
use crate::model::backend::GeluForm;

/// Families we read, for the refusal of any other.
pub const SUPPORTED: &[&str] = &["gpt2"];

/// The shape of a GPT-2 checkpoint (`GPT2Config`).
#[derive(Clone, Debug, PartialEq)]
pub struct Gpt2Shape {
    pub vocab: usize,
    pub positions: usize,
    pub d_model: usize,
    pub layers: usize,
    pub heads: usize,
    pub gelu: GeluForm,
    pub tied: bool,
}

impl Gpt2Shape {
    /// Sets the model keys of `cfg` to this shape, `dir` being where it came from.
    pub fn apply(&self, cfg: &mut TrainConfig, dir: &Path) {
        cfg.model = ModelKind::Gpt;
        cfg.vocab = self.vocab;
        cfg.max_positions = self.positions;
        cfg.d_model = self.d_model;
        cfg.layers = self.layers;
        cfg.heads = self.heads;
        cfg.gelu = self.gelu;
        cfg.tie_embeddings = self.tied;
        cfg.hf_dir = Some(dir.to_path_buf());
    }

    /// The shape of a run's GPT.
    pub fn of(cfg: &TrainConfig) -> Self {
        Self {
            vocab: cfg.vocab,
            positions: match cfg.max_positions {
                0 => cfg.seq_len,
                p => p,
            },
            d_model: cfg.d_model,
            layers: cfg.layers,
            heads: cfg.heads,
            gelu: cfg.gelu,
            tied: cfg.tie_embeddings,
        }
    }
}

fn bad(path: &Path, what: impl Into<String>) -> CheckpointError {
    CheckpointError::Incompatible {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

/// `dir/config.json` as a JSON object.
pub fn read_json(dir: &Path) -> Result<(PathBuf, Map<String, Value>), CheckpointError> {
    let path = dir.join("config.json");
    if !path.exists() {
        return Err(bad(
            dir,
            "no config.json: not a Hugging Face model directory (save_pretrained writes one)",
        ));
    }
    let text = std::fs::read_to_string(&path).at(&path, "read")?;
    match serde_json::from_str(&text) {
        Ok(Value::Object(m)) => Ok((path, m)),
        Ok(_) => Err(bad(&path, "is not a JSON object")),
        Err(e) => Err(bad(&path, format!("is not valid JSON: {e}"))),
    }
}

/// Reads `dir/config.json`: a GPT-2, or a refusal naming the family and the ones we read.
pub fn read_gpt2(dir: &Path) -> Result<Gpt2Shape, CheckpointError> {
    let (path, m) = read_json(dir)?;
    let model_type = m.get("model_type").and_then(Value::as_str).unwrap_or("");
    if model_type != "gpt2" {
        let arch = m
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .unwrap_or("none");
        return Err(bad(
            &path,
            format!(
                "model_type \"{model_type}\" (architecture {arch}) is not supported; supported: {}",
                SUPPORTED.join(", ")
            ),
        ));
    }
    let size = |keys: &[&str]| -> Result<usize, CheckpointError> {
        keys.iter()
            .find_map(|k| m.get(*k).and_then(Value::as_u64))
            .filter(|&v| v > 0)
            .map(|v| v as usize)
            .ok_or_else(|| {
                bad(
                    &path,
                    format!("key `{}`: missing or not a positive integer", keys[0]),
                )
            })
    };
    let d_model = size(&["n_embd", "hidden_size"])?;
    let heads = size(&["n_head", "num_attention_heads"])?;
    if !d_model.is_multiple_of(heads) {
        return Err(bad(
            &path,
            format!("n_head {heads} does not divide n_embd {d_model}"),
        ));
    }
    if let Some(inner) = m.get("n_inner").and_then(Value::as_u64) {
        if inner as usize != 4 * d_model {
            return Err(bad(
                &path,
                format!(
                    "key `n_inner` = {inner}: only 4 x n_embd ({}) is supported",
                    4 * d_model
                ),
            ));
        }
    }
    let gelu = match m.get("activation_function").and_then(Value::as_str) {
        None | Some("gelu_new") | Some("gelu_pytorch_tanh") => GeluForm::Tanh,
        Some("gelu") => GeluForm::Erf,
        Some(other) => {
            return Err(bad(
                &path,
                format!(
                    "key `activation_function` = \"{other}\": supported are gelu_new, \
                     gelu_pytorch_tanh and gelu"
                ),
            ))
        }
    };
    let eps = m
        .get("layer_norm_epsilon")
        .and_then(Value::as_f64)
        .unwrap_or(1e-5);
    if eps != 1e-5 {
        return Err(bad(
            &path,
            format!("key `layer_norm_epsilon` = {eps}: only 1e-5 (GPT-2's) is supported"),
        ));
    }
    for key in ["scale_attn_by_inverse_layer_idx"] {
        if m.get(key).and_then(Value::as_bool) == Some(true) {
            return Err(bad(&path, format!("key `{key}` = true is not supported")));
        }
    }
    if m.get("scale_attn_weights").and_then(Value::as_bool) == Some(false) {
        return Err(bad(
            &path,
            "key `scale_attn_weights` = false is not supported",
        ));
    }
    Ok(Gpt2Shape {
        vocab: size(&["vocab_size"])?,
        positions: size(&["n_positions", "max_position_embeddings", "n_ctx"])?,
        d_model,
        layers: size(&["n_layer", "num_hidden_layers"])?,
        heads,
        gelu,
        tied: m
            .get("tie_word_embeddings")
            .and_then(Value::as_bool)
            .unwrap_or(true),
    })
}

/// The `config.json` to write for `shape`: the source directory's, if it is a GPT-2 one (so its
/// token ids and generation defaults carry over), with the shape keys set.
pub fn gpt2_json(shape: &Gpt2Shape, source: Option<&Path>) -> Map<String, Value> {
    let mut m = source
        .and_then(|d| read_json(d).ok())
        .map(|(_, m)| m)
        .filter(|m| m.get("model_type").and_then(Value::as_str) == Some("gpt2"))
        .unwrap_or_default();
    let mut set = |k: &str, v: Value| {
        m.insert(k.to_string(), v);
    };
    set("architectures", serde_json::json!(["GPT2LMHeadModel"]));
    set("model_type", "gpt2".into());
    set("vocab_size", shape.vocab.into());
    set("n_positions", shape.positions.into());
    set("n_embd", shape.d_model.into());
    set("n_layer", shape.layers.into());
    set("n_head", shape.heads.into());
    set("n_inner", Value::Null);
    set(
        "activation_function",
        match shape.gelu {
            GeluForm::Tanh => "gelu_new",
            GeluForm::Erf => "gelu",
        }
        .into(),
    );
    set("layer_norm_epsilon", 1e-5.into());
    set("tie_word_embeddings", shape.tied.into());
    set("scale_attn_weights", true.into());
    set("scale_attn_by_inverse_layer_idx", false.into());
    set("dtype", "float32".into());
    m
}
