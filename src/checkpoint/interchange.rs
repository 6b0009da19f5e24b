//! Interchange with the rest of the ecosystem through safetensors files: exporting a checkpoint
//! as consolidated weights (fp32, or bf16), optionally with a second file of optimizer state,
//! and importing weights to start a run from (`ezero train --init`).
//!
//! Tensor names are the model's `ParamSpec` names (`blocks.0.attn.qkv.weight`), shapes its
//! shapes, so any safetensors reader sees ordinary named tensors. Optimizer state uses
//! PyTorch's per-parameter names as suffixes (`<name>.exp_avg`, `<name>.exp_avg_sq`,
//! `<name>.momentum_buffer`) and is always fp32, because rounding Adam's second moment changes
//! the next update.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};

use super::error::{CheckpointError, IoContext};
pub use super::hf::files::{bf16_to_f32, f32_to_bf16};
use super::hf::files::{to_bytes, TensorDir};
use super::hf::source::{NamedWeights, Naming};
use super::read::Loaded;
use super::write::{tmp_path, write_synced};
use crate::model::UnitSpec;
use crate::runtime::step::state::rank_state::ChunkState;

/// How to export.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExportOptions {
    /// Round weights to bf16 (nearest even) instead of writing fp32.
    pub bf16: bool,
    /// Also write the optimizer state to [`optimizer_path`]`(out)`.
    pub with_optimizer: bool,
}

/// What an export wrote.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ExportReport {
    pub weights: PathBuf,
    pub weight_tensors: usize,
    pub weight_bytes: u64,
    pub optimizer: Option<PathBuf>,
    pub optimizer_tensors: usize,
}

/// `model.safetensors` → `model.optimizer.safetensors` (same directory).
pub fn optimizer_path(out: &Path) -> PathBuf {
    let stem = out
        .file_stem()
        .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
    out.with_file_name(format!("{stem}.optimizer.safetensors"))
}

/// Every unit's full parameters from a loaded checkpoint.
pub fn consolidated_params(loaded: &Loaded) -> Vec<Vec<f32>> {
    consolidate(loaded, |c| &c.params)
}

/// One vector of every chunk (params, m or v), consolidated per unit.
fn consolidate(loaded: &Loaded, field: fn(&ChunkState) -> &[f32]) -> Vec<Vec<f32>> {
    let map = &loaded.snapshot.map;
    let mut out: Vec<Vec<f32>> = map.units.iter().map(|u| vec![0f32; u.numel]).collect();
    for c in &loaded.snapshot.chunks {
        let r = map.chunk_range(c.unit as usize, c.index as usize);
        out[c.unit as usize][r].copy_from_slice(field(c));
    }
    out
}

/// Named tensors of one per-unit vector: (name + suffix, shape, values). In bounds: each unit's
/// buffer has the unit's numel (`Manifest::check_structure` matched the units to the map).
fn named<'a>(
    units: &'a [UnitSpec],
    flat: &'a [Vec<f32>],
    suffix: &'a str,
) -> impl Iterator<Item = (String, Vec<usize>, &'a [f32])> + 'a {
    units.iter().zip(flat).flat_map(move |(u, buf)| {
        let mut off = 0;
        u.params.iter().map(move |p| {
            let n = p.numel();
            off += n;
            (
                format!("{}{suffix}", p.name),
                p.shape.clone(),
                &buf[off - n..off],
            )
        })
    })
}

/// Serializes named tensors and writes them atomically (temporary file, sync, rename).
fn write_tensors(
    path: &Path,
    tensors: Vec<(String, Vec<usize>, Vec<u8>)>,
    dtype: Dtype,
    metadata: HashMap<String, String>,
) -> Result<u64, CheckpointError> {
    let err = |e: safetensors::SafeTensorError| CheckpointError::Safetensors {
        path: path.to_path_buf(),
        what: e.to_string(),
    };
    let views = tensors
        .iter()
        .map(|(n, shape, bytes)| Ok((n.clone(), TensorView::new(dtype, shape.clone(), bytes)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()
        .map_err(err)?;
    let bytes = safetensors::serialize(views, Some(metadata)).map_err(err)?;
    let tmp = tmp_path(path);
    write_synced(&tmp, &bytes)?;
    std::fs::rename(&tmp, path).at(path, "rename into place")?;
    Ok(bytes.len() as u64)
}

/// Writes `loaded`'s consolidated weights to `out`, and with `with_optimizer` its optimizer
/// state next to it.
pub fn export(
    loaded: &Loaded,
    out: &Path,
    opts: ExportOptions,
) -> Result<ExportReport, CheckpointError> {
    let m = &loaded.manifest;
    let mut meta: HashMap<String, String> = [
        ("format", "pt".to_string()),
        ("producer", "elastic-zero".to_string()),
        ("step", m.step.to_string()),
        ("opt_step", m.progress.opt_step.to_string()),
        ("fp32_param_sha256", m.param_sha256.clone()),
        ("dtype", if opts.bf16 { "bf16" } else { "fp32" }.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let params = consolidate(loaded, |c| &c.params);
    let tensors: Vec<_> = named(&m.units, &params, "")
        .map(|(n, s, v)| (n, s, to_bytes(v, opts.bf16)))
        .collect();
    let weight_tensors = tensors.len();
    let dtype = if opts.bf16 { Dtype::BF16 } else { Dtype::F32 };
    let weight_bytes = write_tensors(out, tensors, dtype, meta.clone())?;
    let mut report = ExportReport {
        weights: out.to_path_buf(),
        weight_tensors,
        weight_bytes,
        optimizer: None,
        optimizer_tensors: 0,
    };
    if opts.with_optimizer {
        let o = &m.optimizer;
        meta.insert("dtype".into(), "fp32".into());
        meta.insert(
            "optimizer".into(),
            serde_json::to_string(o).unwrap_or_default(),
        );
        let m_all = consolidate(loaded, |c| &c.m);
        let v_all = consolidate(loaded, |c| &c.v);
        let mut tensors = Vec::new();
        for (k, name) in o.state.iter().enumerate() {
            let flat = if k == 0 { &m_all } else { &v_all };
            let suffix = format!(".{name}");
            tensors
                .extend(named(&m.units, flat, &suffix).map(|(n, s, v)| (n, s, to_bytes(v, false))));
        }
        let path = optimizer_path(out);
        report.optimizer_tensors = tensors.len();
        write_tensors(&path, tensors, Dtype::F32, meta)?;
        report.optimizer = Some(path);
    }
    Ok(report)
}

/// Our own parameter names: a file `checkpoint export` wrote stores each parameter under its
/// name, in our layout.
struct OwnNames;

impl Naming for OwnNames {
    fn family(&self) -> &str {
        "model"
    }

    fn stored(&self, ours: &str) -> Option<(String, bool)> {
        Some((ours.to_string(), false))
    }

    fn ignorable(&self, _: &str) -> bool {
        false
    }
}

/// The weights of a model with `units` in a safetensors file whose tensors are named as the
/// model's parameters (fp32, fp16 or bf16): every parameter must be there with its shape, and
/// nothing else may be. Values are read by range when a rank asks.
pub fn weights(
    path: &Path,
    units: &[UnitSpec],
) -> Result<NamedWeights<TensorDir>, CheckpointError> {
    NamedWeights::open(TensorDir::open_file(path)?, &OwnNames, units)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is exactly halfway between two bf16 values: ties go to even.
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80); // rounds up to infinity
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(bf16_to_f32(f32_to_bf16(-2.5)), -2.5);
    }

    #[test]
    fn optimizer_file_sits_beside_the_weights() {
        assert_eq!(
            optimizer_path(Path::new("out/model.safetensors")),
            Path::new("out/model.optimizer.safetensors")
        );
    }
}
