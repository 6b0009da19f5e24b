//! `--init`: the weights a run (or `ezero generate`) starts from, and for a pretrained model
//! the shape that comes with them.
//!
//! - `hf:DIR` or a directory: a Hugging Face model directory (`config.json` + safetensors);
//! - `gguf:FILE` or any file starting with the GGUF magic: a llama.cpp file of the Llama
//!   family, dequantized to f32. Its `config.json`, `tokenizer.json` and
//!   `generation_config.json` are written once into a directory under the token cache (keyed
//!   by the SHA-256 of the file's header), which then serves as the run's `hf_dir`:
//!   tokenizing, export and generation work as from a Hugging Face directory;
//! - anything else: a safetensors file of our own parameter names (`checkpoint export`).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use elastic_zero::checkpoint::gguf::GgufFile;
use elastic_zero::checkpoint::hf::{self, config::HfShape};
use elastic_zero::checkpoint::interchange;
use elastic_zero::config::TrainConfig;
use elastic_zero::model::weights::WeightSource;
use elastic_zero::model::UnitSpec;

use super::{CliError, TrainArgs};

fn usage(e: impl std::fmt::Display) -> CliError {
    CliError::Usage(e.to_string())
}

/// Where `--init` points.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InitSource {
    Hf(PathBuf),
    Gguf(PathBuf),
    Safetensors(PathBuf),
}

impl InitSource {
    pub fn of(init: &Path) -> Self {
        if let Some(rest) = init.to_str().and_then(|s| s.strip_prefix("gguf:")) {
            return Self::Gguf(PathBuf::from(rest));
        }
        if let Some(dir) = hf::source_dir(init) {
            return Self::Hf(dir);
        }
        let mut magic = [0u8; 4];
        let gguf = std::fs::File::open(init)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
            && &magic == b"GGUF";
        match gguf {
            true => Self::Gguf(init.to_path_buf()),
            false => Self::Safetensors(init.to_path_buf()),
        }
    }
}

/// A pretrained model's shape, the directory of its non-weight files, and the file that
/// says so (for messages).
pub struct Pretrained {
    pub shape: HfShape,
    pub dir: PathBuf,
    pub config_file: PathBuf,
}

/// The shape and companion directory of a pretrained `src`; `None` for our own safetensors.
/// `cache` is where a GGUF file's companion files go.
pub fn pretrained(src: &InitSource, cache: Option<&Path>) -> Result<Option<Pretrained>, CliError> {
    match src {
        InitSource::Hf(dir) => Ok(Some(Pretrained {
            shape: hf::config::read(dir).map_err(usage)?,
            dir: dir.clone(),
            config_file: dir.join("config.json"),
        })),
        InitSource::Gguf(path) => {
            let f = GgufFile::open(path).map_err(usage)?;
            let shape = HfShape::Llama(f.llama_shape().map_err(usage)?.hf_shape());
            let dir = gguf_companions(&f, cache)?;
            Ok(Some(Pretrained {
                shape,
                dir,
                config_file: path.clone(),
            }))
        }
        InitSource::Safetensors(_) => Ok(None),
    }
}

/// The directory holding `f`'s `config.json`, `tokenizer.json` and `generation_config.json`,
/// written on first use (to a temporary name, then renamed, so a concurrent run never reads a
/// half-written one).
fn gguf_companions(f: &GgufFile, cache: Option<&Path>) -> Result<PathBuf, CliError> {
    let root = cache.ok_or_else(|| {
        usage(format!(
            "{}: no cache directory for the GGUF file's tokenizer and config (neither \
             XDG_CACHE_HOME nor HOME is set): set token_cache_dir",
            f.path().display()
        ))
    })?;
    // The companions derive from the header alone (metadata and tensor infos), so that is
    // what keys them: hashing the weights too would read the whole file at every start.
    let file =
        std::fs::File::open(f.path()).map_err(|e| usage(format!("{}: {e}", f.path().display())))?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file.take(f.data_offset()), &mut hasher)
        .map_err(|e| usage(format!("{}: {e}", f.path().display())))?;
    let key: String = hasher.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let dir = root.join(format!("gguf-{key}"));
    let complete = |d: &Path| {
        ["tokenizer.json", "config.json", "tokenizer_config.json"]
            .iter()
            .all(|f| d.join(f).is_file())
    };
    if complete(&dir) {
        return Ok(dir);
    }
    let tmp = root.join(format!("gguf-{key}.tmp-{}", std::process::id()));
    f.write_hf_companions(&tmp).map_err(usage)?;
    // A directory of an older layout lacks files: they are added (same content for the rest).
    if dir.is_dir() {
        for e in std::fs::read_dir(&tmp).map_err(|e| usage(format!("{}: {e}", tmp.display())))? {
            let e = e.map_err(|e| usage(format!("{}: {e}", tmp.display())))?;
            let to = dir.join(e.file_name());
            if !to.is_file() {
                std::fs::rename(e.path(), &to)
                    .map_err(|e| usage(format!("{}: {e}", to.display())))?;
            }
        }
        let _ = std::fs::remove_dir_all(&tmp);
        return Ok(dir);
    }
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        // Another run finished first: theirs is the same content.
        Err(_) if dir.join("tokenizer.json").is_file() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(e) => Err(usage(format!("{}: {e}", dir.display()))),
    }
}

/// `--init` of a pretrained model: its shape and companion directory go into `cfg`; a shape
/// flag that says otherwise is refused rather than silently overridden.
pub fn apply_pretrained_shape(args: &TrainArgs, cfg: &mut TrainConfig) -> Result<(), CliError> {
    let Some(init) = args.init.as_deref() else {
        return Ok(());
    };
    let Some(p) = pretrained(&InitSource::of(init), cfg.token_cache().as_deref())? else {
        return Ok(());
    };
    let from = p.config_file.display();
    let (layers, d_model, heads) = p.shape.layers_width_heads();
    let clash = |flag: &str, ours: Option<usize>, theirs: usize| match ours {
        Some(v) if v != theirs => Err(CliError::Usage(format!(
            "--{flag} {v} contradicts {from} ({theirs}): drop the flag, the checkpoint sets it"
        ))),
        _ => Ok(()),
    };
    clash("layers", args.layers, layers)?;
    clash("d-model", args.d_model, d_model)?;
    clash("heads", args.heads, heads)?;
    let vocab = match &p.shape {
        HfShape::Gpt2(g) => g.vocab,
        HfShape::Llama(l) => l.vocab,
    };
    clash("vocab", args.vocab, vocab)?;
    let family = p.shape.model();
    if let Some(m) = args.model.filter(|&m| m != family) {
        return Err(CliError::Usage(format!(
            "--model {} contradicts {from}: that checkpoint is a {}",
            m.name(),
            family.name()
        )));
    }
    p.shape.apply(cfg, &p.dir);
    cfg.validate()
        .map_err(|e| CliError::Usage(format!("with {from}: {e}")))
}

/// `src`'s weights for a model of `units`: names and shapes checked now (a mismatch is refused
/// before anything starts), values read by range as each rank builds its state.
pub fn weights(src: &InitSource, units: &[UnitSpec]) -> Result<Arc<dyn WeightSource>, CliError> {
    Ok(match src {
        InitSource::Hf(dir) => Arc::new(hf::weights(dir, units).map_err(usage)?),
        InitSource::Gguf(path) => Arc::new(
            GgufFile::open(path)
                .and_then(|f| f.weights(units))
                .map_err(usage)?,
        ),
        InitSource::Safetensors(path) => {
            check_own_safetensors(path)?;
            Arc::new(interchange::weights(path, units).map_err(usage)?)
        }
    })
}

/// Refuses a file that is not a safetensors file of our names before its header is parsed:
/// another file's first bytes would be read as a header length, and a Hugging Face export's
/// weights file has transformers' names, which only its directory's `config.json` maps.
fn check_own_safetensors(path: &Path) -> Result<(), CliError> {
    let shown = path.display();
    let mut head = [0u8; 9];
    let len = std::fs::metadata(path)
        .map_err(|e| usage(format!("--init {shown}: {e}")))?
        .len();
    let read = std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut head));
    let header_len = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
    if read.is_err() || head[8] != b'{' || header_len > len.saturating_sub(8) {
        return Err(usage(format!(
            "--init {shown}: not a safetensors or GGUF file; pass a safetensors file of \
             `checkpoint export`, gguf:FILE, or hf:DIR (a Hugging Face model directory)"
        )));
    }
    let names = hf::files::TensorDir::open_file(path)
        .map(|td| hf::source::TensorSource::names(&td))
        .map_err(usage)?;
    let theirs = names.iter().find(|n| {
        ["model.", "transformer.", "lm_head.", "h.", "wte."]
            .iter()
            .any(|p| n.starts_with(p))
    });
    if let Some(name) = theirs {
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
        return Err(usage(format!(
            "--init {shown}: transformers' tensor names (`{name}`), a Hugging Face model's \
             weights: pass its directory, --init hf:{}",
            dir.map_or("DIR".into(), |d| d.display().to_string())
        )));
    }
    Ok(())
}

/// Every unit's full parameters from `src` (`ezero generate` holds the whole model).
pub fn import(src: &InitSource, units: &[UnitSpec]) -> Result<Vec<Vec<f32>>, CliError> {
    let w = weights(src, units)?;
    units
        .iter()
        .enumerate()
        .map(|(u, spec)| w.read_unit(u, spec.numel()).map_err(usage))
        .collect()
}
