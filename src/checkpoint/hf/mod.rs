//! Hugging Face model directories in and out: `config.json` plus safetensors weights, single
//! or sharded, in the layout transformers' `from_pretrained` and `save_pretrained` use.
//!
//! - [`config`]: the family and shape from `config.json`, and the one to write.
//! - [`files`]: safetensors headers, tensor reads at their offsets, sharded writes.
//! - [`gpt2`]: GPT-2's names and layouts against our GPT's.
//!
//! Only GPT-2 is read so far; another `model_type` is refused naming the supported ones.

pub mod config;
pub mod files;
pub mod gpt2;

use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;

use super::error::{CheckpointError, IoContext};
use super::interchange::to_bytes;
use crate::config::TrainConfig;
use crate::model::UnitSpec;

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

/// Refuses a GGUF file (by its magic, whatever its name): it is not read yet, and reading it
/// as safetensors would only say that it is not one.
pub fn refuse_gguf(path: &Path) -> Result<(), CheckpointError> {
    let mut magic = [0u8; 4];
    let is_gguf = std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok()
        && &magic == b"GGUF";
    match is_gguf {
        true => Err(CheckpointError::Incompatible {
            path: path.to_path_buf(),
            what: "is a GGUF file, which is not read yet: convert it to a Hugging Face \
                   directory (transformers: from_pretrained(dir, gguf_file=...) then \
                   save_pretrained) and pass --init hf:DIR"
                .into(),
        }),
        false => Ok(()),
    }
}

/// Full parameters of every unit from the GPT-2 directory `dir`.
pub fn import_gpt2(dir: &Path, units: &[UnitSpec]) -> Result<Vec<Vec<f32>>, CheckpointError> {
    gpt2::import(&files::TensorDir::open(dir)?, units)
}

/// What [`export_gpt2`] wrote.
#[derive(Debug)]
pub struct HfExport {
    pub files: Vec<PathBuf>,
    pub weight_bytes: u64,
    pub tensors: usize,
}

/// Writes `params` of a GPT trained with `cfg` as a GPT-2 directory transformers loads:
/// `config.json`, the weights (f32, or bf16 with `bf16`) in shards of at most
/// `max_shard_bytes`, and the source directory's tokenizer and generation files if it has them.
pub fn export_gpt2(
    cfg: &TrainConfig,
    units: &[UnitSpec],
    params: &[Vec<f32>],
    out: &Path,
    bf16: bool,
    max_shard_bytes: u64,
) -> Result<HfExport, CheckpointError> {
    std::fs::create_dir_all(out).at(out, "create")?;
    let mut tensors = Vec::new();
    for t in gpt2::export_tensors(units, params) {
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
    let shape = config::Gpt2Shape::of(cfg);
    let mut json = config::gpt2_json(&shape, cfg.hf_dir.as_deref());
    json.insert(
        "dtype".into(),
        if bf16 { "bfloat16" } else { "float32" }.into(),
    );
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
    Ok(HfExport {
        files: written,
        weight_bytes,
        tensors: count,
    })
}
