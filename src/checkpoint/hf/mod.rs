//! Hugging Face model directories in and out: `config.json` plus safetensors weights, single
//! or sharded, in the layout transformers' `from_pretrained` and `save_pretrained` use.
//!
//! - [`config`]: the family and shape from `config.json`, and the one to write.
//! - [`files`]: safetensors headers, tensor reads at their offsets, sharded writes.
//! - [`source`]: named tensors in, checked against our units, whatever holds them.
//! - [`gpt2`], [`llama`]: each family's names and layouts against our models'.
//! - [`tokenizer_files`]: the tokenizer and generation files a directory needs beside
//!   `tokenizer.json`, written where the source had none.
//!
//! GPT-2, Llama and Qwen2 are read; another `model_type` is refused naming the supported ones.
//!
//! Design: docs/models.md.

pub mod config;
pub mod files;
pub mod gpt2;
pub mod llama;
pub mod source;
pub mod tokenizer_files;

use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;

use super::error::{CheckpointError, IoContext};
use crate::config::TrainConfig;
use crate::model::UnitSpec;
use files::to_bytes;

/// Files that are not weights but belong with them: tokenizers and generation defaults.
pub const COMPANION_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
];

/// `--init hf:DIR`, or `--init DIR` naming a directory: the Hugging Face directory meant.
pub fn source_dir(init: &Path) -> Option<PathBuf> {
    let s = init.to_str()?;
    match s.strip_prefix("hf:") {
        Some(rest) => Some(PathBuf::from(rest)),
        None => init.is_dir().then(|| init.to_path_buf()),
    }
}

/// How `shape`'s family names its tensors; `prefixed`: with the base-model prefix
/// (`transformer.`, `model.`), as `save_pretrained` and our export write them.
pub fn naming(shape: &config::HfShape, prefixed: bool) -> Box<dyn source::Naming> {
    match shape {
        config::HfShape::Gpt2(_) => Box::new(gpt2::Gpt2Names { prefixed }),
        config::HfShape::Llama(l) => Box::new(llama::LlamaNames {
            prefixed,
            family: if l.qkv_bias { "Qwen2" } else { "Llama" },
        }),
    }
}

/// How `shape`'s family names its tensors in `src`: with the base-model prefix if any of
/// `src`'s names has it.
pub fn naming_of(
    shape: &config::HfShape,
    src: &dyn source::TensorSource,
) -> Box<dyn source::Naming> {
    let prefix = match shape {
        config::HfShape::Gpt2(_) => gpt2::PREFIX,
        config::HfShape::Llama(_) => llama::PREFIX,
    };
    naming(shape, src.names().iter().any(|k| k.starts_with(prefix)))
}

/// The weights of the model directory `dir` (its `config.json` says the family) for a model
/// of `units`: every name and shape checked now, values read by range when a rank asks.
pub fn weights(
    dir: &Path,
    units: &[UnitSpec],
) -> Result<source::NamedWeights<files::TensorDir>, CheckpointError> {
    let shape = config::read(dir)?;
    let td = files::TensorDir::open(dir)?;
    let naming = naming_of(&shape, &td);
    source::NamedWeights::open(td, &*naming, units)
}

/// Full parameters of every unit from the model directory `dir`.
pub fn import(dir: &Path, units: &[UnitSpec]) -> Result<Vec<Vec<f32>>, CheckpointError> {
    weights(dir, units)?.read_all()
}

/// What [`export`] wrote.
#[derive(Debug)]
pub struct HfExport {
    pub files: Vec<PathBuf>,
    pub weight_bytes: u64,
    /// The family it was written as (`gpt2`, `llama`, `qwen2`).
    pub family: String,
    pub tensors: usize,
}

/// Writes `params` of a model trained with `cfg` as a directory transformers loads (a GPT as
/// GPT-2, a Llama as Llama or, with q/k/v biases, Qwen2): `config.json`, the weights (f32, or
/// bf16 with `bf16`) in shards of at most `max_shard_bytes`, the source directory's tokenizer
/// and generation files, and those it lacks ([`tokenizer_files::complete`], with the source's
/// chat template or `chat_template`). Every file is mode 0644: the directory is for sharing.
pub fn export(
    cfg: &TrainConfig,
    units: &[UnitSpec],
    params: &[Vec<f32>],
    out: &Path,
    bf16: bool,
    max_shard_bytes: u64,
) -> Result<HfExport, CheckpointError> {
    export_with_template(cfg, units, params, out, bf16, max_shard_bytes, None)
}

/// [`export`], with the chat template to write where the source has none.
pub fn export_with_template(
    cfg: &TrainConfig,
    units: &[UnitSpec],
    params: &[Vec<f32>],
    out: &Path,
    bf16: bool,
    max_shard_bytes: u64,
    chat_template: Option<&str>,
) -> Result<HfExport, CheckpointError> {
    let shape = config::HfShape::of(cfg).ok_or_else(|| CheckpointError::Incompatible {
        path: out.to_path_buf(),
        what: format!("a {:?} model has no Hugging Face form", cfg.model),
    })?;
    let naming = naming(&shape, true);
    std::fs::create_dir_all(out).at(out, "create")?;
    let mut tensors = Vec::new();
    for t in source::export_tensors(&*naming, units, params) {
        let (name, shape, v) = t.map_err(|what| CheckpointError::Incompatible {
            path: out.to_path_buf(),
            what,
        })?;
        let bytes = to_bytes(&v, bf16);
        tensors.push(files::OutTensor { name, shape, bytes });
    }
    let count = tensors.len();
    let dtype = if bf16 { Dtype::BF16 } else { Dtype::F32 };
    let (mut written, weight_bytes) =
        files::write_checkpoint(out, tensors, dtype, max_shard_bytes)?;
    let mut json = shape.to_json(cfg.hf_dir.as_deref());
    // transformers 5 reads `dtype`, 4.x `torch_dtype`.
    for key in ["dtype", "torch_dtype"] {
        json.insert(key.into(), if bf16 { "bfloat16" } else { "float32" }.into());
    }
    let path = out.join("config.json");
    let text = serde_json::to_string_pretty(&json).expect("a JSON map serializes");
    std::fs::write(&path, text).at(&path, "write")?;
    written.push(path);
    if let Some(src) = &cfg.hf_dir {
        for f in COMPANION_FILES {
            let from = src.join(f);
            if from.is_file() {
                let to = out.join(f);
                std::fs::copy(&from, &to).at(&to, "copy")?;
                written.push(to);
            }
        }
    }
    let template = cfg
        .hf_dir
        .as_deref()
        .and_then(tokenizer_files::chat_template)
        .or(chat_template.map(String::from));
    for f in tokenizer_files::complete(out, &json, template.as_deref())? {
        if !written.contains(&f) {
            written.push(f);
        }
    }
    for f in &written {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o644)).at(f, "chmod")?;
    }
    Ok(HfExport {
        files: written,
        weight_bytes,
        tensors: count,
        family: json
            .get("model_type")
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default()
            .to_string(),
    })
}
