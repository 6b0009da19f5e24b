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
pub const SUPPORTED: &[&str] = &["gpt2", "llama", "qwen2"];

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
            positions: cfg.positions(),
            d_model: cfg.d_model,
            layers: cfg.layers,
            heads: cfg.heads,
            gelu: cfg.gelu,
            tied: cfg.tie_embeddings,
        }
    }
}

/// The shape of a Llama-family checkpoint (`LlamaConfig`, or `Qwen2Config` with `qkv_bias`).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaShape {
    pub vocab: usize,
    pub positions: usize,
    pub d_model: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub rope_theta: f64,
    pub norm_eps: f64,
    /// Qwen2: biases on the q/k/v projections.
    pub qkv_bias: bool,
    pub tied: bool,
}

/// A checkpoint's family and shape.
#[derive(Clone, Debug, PartialEq)]
pub enum HfShape {
    Gpt2(Gpt2Shape),
    Llama(LlamaShape),
}

impl HfShape {
    /// Sets the model keys of `cfg` to this shape, `dir` being where it came from.
    pub fn apply(&self, cfg: &mut TrainConfig, dir: &Path) {
        match self {
            Self::Gpt2(g) => g.apply(cfg, dir),
            Self::Llama(l) => {
                cfg.model = ModelKind::Llama;
                cfg.vocab = l.vocab;
                cfg.max_positions = l.positions;
                cfg.d_model = l.d_model;
                cfg.layers = l.layers;
                cfg.heads = l.heads;
                cfg.kv_heads = l.kv_heads;
                cfg.head_dim = l.head_dim;
                cfg.ffn = l.ffn;
                cfg.rope_theta = l.rope_theta;
                cfg.norm_eps = l.norm_eps;
                cfg.qkv_bias = l.qkv_bias;
                cfg.tie_embeddings = l.tied;
                cfg.hf_dir = Some(dir.to_path_buf());
            }
        }
    }

    /// The shape of a run's model, `None` for one with no Hugging Face form (the MLP).
    pub fn of(cfg: &TrainConfig) -> Option<Self> {
        match cfg.model {
            ModelKind::Gpt => Some(Self::Gpt2(Gpt2Shape::of(cfg))),
            ModelKind::Llama => Some(Self::Llama(LlamaShape {
                vocab: cfg.vocab,
                positions: cfg.positions(),
                d_model: cfg.d_model,
                layers: cfg.layers,
                heads: cfg.heads,
                kv_heads: cfg.kv_heads(),
                head_dim: cfg.head_dim(),
                ffn: cfg.ffn(),
                rope_theta: cfg.rope_theta,
                norm_eps: cfg.norm_eps,
                qkv_bias: cfg.qkv_bias,
                tied: cfg.tie_embeddings,
            })),
            ModelKind::Mlp => None,
        }
    }

    /// The model this shape builds.
    pub fn model(&self) -> ModelKind {
        match self {
            Self::Gpt2(_) => ModelKind::Gpt,
            Self::Llama(_) => ModelKind::Llama,
        }
    }

    /// `(layers, d_model, heads)`, which shape flags may not contradict.
    pub fn layers_width_heads(&self) -> (usize, usize, usize) {
        match self {
            Self::Gpt2(g) => (g.layers, g.d_model, g.heads),
            Self::Llama(l) => (l.layers, l.d_model, l.heads),
        }
    }

    /// The longest sequence the checkpoint's model takes.
    pub fn positions(&self) -> usize {
        match self {
            Self::Gpt2(g) => g.positions,
            Self::Llama(l) => l.positions,
        }
    }

    /// The `config.json` to write (see [`gpt2_json`], [`llama_json`]).
    pub fn to_json(&self, source: Option<&Path>) -> Map<String, Value> {
        match self {
            Self::Gpt2(g) => gpt2_json(g, source),
            Self::Llama(l) => llama_json(l, source),
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

/// Reads `dir/config.json`: a family we read, or a refusal naming it and the ones we read.
pub fn read(dir: &Path) -> Result<HfShape, CheckpointError> {
    let (path, m) = read_json(dir)?;
    let model_type = m.get("model_type").and_then(Value::as_str).unwrap_or("");
    match model_type {
        "gpt2" => read_gpt2(&path, &m).map(HfShape::Gpt2),
        "llama" => read_llama(&path, &m, false).map(HfShape::Llama),
        "qwen2" => read_llama(&path, &m, true).map(HfShape::Llama),
        _ => {
            let arch = m
                .get("architectures")
                .and_then(|a| a.get(0))
                .and_then(Value::as_str)
                .unwrap_or("none");
            Err(bad(
                &path,
                format!(
                    "model_type \"{model_type}\" (architecture {arch}) is not supported; \
                     supported: {}",
                    SUPPORTED.join(", ")
                ),
            ))
        }
    }
}

/// A positive integer under the first of `keys` present.
fn size(path: &Path, m: &Map<String, Value>, keys: &[&str]) -> Result<usize, CheckpointError> {
    keys.iter()
        .find_map(|k| m.get(*k).and_then(Value::as_u64))
        .filter(|&v| v > 0)
        .map(|v| v as usize)
        .ok_or_else(|| {
            bad(
                path,
                format!("key `{}`: missing or not a positive integer", keys[0]),
            )
        })
}

/// A GPT-2 `config.json`.
fn read_gpt2(path: &Path, m: &Map<String, Value>) -> Result<Gpt2Shape, CheckpointError> {
    let path = path.to_path_buf();
    let size = |keys: &[&str]| size(&path, m, keys);
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

/// A Llama or (`qwen2`) Qwen2 `config.json`. Settings that change the arithmetic in ways we
/// do not implement (scaled RoPE, biases outside q/k/v, sliding windows, another activation)
/// are refused by key.
fn read_llama(
    path: &Path,
    m: &Map<String, Value>,
    qwen2: bool,
) -> Result<LlamaShape, CheckpointError> {
    let size = |keys: &[&str]| size(path, m, keys);
    let refuse =
        |key: &str, v: &Value, why: &str| Err(bad(path, format!("key `{key}` = {v}: {why}")));
    let d_model = size(&["hidden_size"])?;
    let heads = size(&["num_attention_heads"])?;
    let kv_heads = match m.get("num_key_value_heads") {
        None | Some(Value::Null) => heads,
        Some(_) => size(&["num_key_value_heads"])?,
    };
    let head_dim = match m.get("head_dim") {
        None | Some(Value::Null) if d_model.is_multiple_of(heads) => d_model / heads,
        None | Some(Value::Null) => {
            return Err(bad(
                path,
                format!("num_attention_heads {heads} does not divide hidden_size {d_model} and there is no head_dim"),
            ))
        }
        Some(_) => size(&["head_dim"])?,
    };
    if let Some(v) = m.get("hidden_act").filter(|v| v.as_str() != Some("silu")) {
        return refuse("hidden_act", v, "only silu (SwiGLU) is supported");
    }
    for key in ["mlp_bias", "use_sliding_window"] {
        if let Some(v) = m.get(key).filter(|v| v.as_bool() == Some(true)) {
            return refuse(key, v, "not supported");
        }
    }
    if let Some(v) = m
        .get("attention_bias")
        .filter(|v| v.as_bool() == Some(true))
    {
        return refuse(
            "attention_bias",
            v,
            "Llama's attention_bias also biases o_proj, which is not supported (Qwen2's q/k/v biases are)",
        );
    }
    // v5 keeps RoPE settings in `rope_parameters`; older files have top-level `rope_theta`
    // and `rope_scaling`.
    let rope = m.get("rope_parameters").and_then(Value::as_object);
    let theta = rope
        .and_then(|r| r.get("rope_theta"))
        .or_else(|| m.get("rope_theta"))
        .map(|v| v.as_f64().filter(|t| *t > 1.0).ok_or(v));
    let rope_theta = match theta {
        None => 10_000.0,
        Some(Ok(t)) => t,
        Some(Err(v)) => return refuse("rope_theta", v, "must be a number above 1"),
    };
    let scaling = rope
        .map(|r| r.get("rope_type").or_else(|| r.get("type")))
        .unwrap_or_else(|| {
            m.get("rope_scaling")
                .and_then(|s| s.get("rope_type").or_else(|| s.get("type")))
        });
    if let Some(v) = scaling.filter(|v| !v.is_null() && v.as_str() != Some("default")) {
        return refuse("rope_type", v, "only unscaled (default) RoPE is supported");
    }
    let norm_eps = match m.get("rms_norm_eps") {
        None => 1e-6,
        Some(v) => match v.as_f64().filter(|e| *e > 0.0 && *e < 1.0) {
            Some(e) => e,
            None => return refuse("rms_norm_eps", v, "must be in (0, 1)"),
        },
    };
    Ok(LlamaShape {
        vocab: size(&["vocab_size"])?,
        positions: size(&["max_position_embeddings"])?,
        d_model,
        layers: size(&["num_hidden_layers"])?,
        heads,
        kv_heads,
        head_dim,
        ffn: size(&["intermediate_size"])?,
        rope_theta,
        norm_eps,
        qkv_bias: qwen2,
        tied: m
            .get("tie_word_embeddings")
            .and_then(Value::as_bool)
            .unwrap_or(false),
    })
}

/// The `config.json` for a Llama-family `shape`: Qwen2 when it has q/k/v biases, else Llama;
/// the source directory's keys carry over when it is the same family.
pub fn llama_json(shape: &LlamaShape, source: Option<&Path>) -> Map<String, Value> {
    let (model_type, arch) = match shape.qkv_bias {
        true => ("qwen2", "Qwen2ForCausalLM"),
        false => ("llama", "LlamaForCausalLM"),
    };
    let mut m = source
        .and_then(|d| read_json(d).ok())
        .map(|(_, m)| m)
        .filter(|m| m.get("model_type").and_then(Value::as_str) == Some(model_type))
        .unwrap_or_default();
    m.remove("rope_theta");
    m.remove("rope_scaling");
    let mut set = |k: &str, v: Value| {
        m.insert(k.to_string(), v);
    };
    set("architectures", serde_json::json!([arch]));
    set("model_type", model_type.into());
    set("vocab_size", shape.vocab.into());
    set("max_position_embeddings", shape.positions.into());
    set("hidden_size", shape.d_model.into());
    set("intermediate_size", shape.ffn.into());
    set("num_hidden_layers", shape.layers.into());
    set("num_attention_heads", shape.heads.into());
    set("num_key_value_heads", shape.kv_heads.into());
    set("head_dim", shape.head_dim.into());
    set("hidden_act", "silu".into());
    set("rms_norm_eps", shape.norm_eps.into());
    set(
        "rope_parameters",
        serde_json::json!({"rope_type": "default", "rope_theta": shape.rope_theta}),
    );
    // transformers 4.x reads only the top-level key and takes 10000 without it.
    set("rope_theta", shape.rope_theta.into());
    set("tie_word_embeddings", shape.tied.into());
    if !shape.qkv_bias {
        set("attention_bias", false.into());
        set("mlp_bias", false.into());
    }
    set("dtype", "float32".into());
    m
}
