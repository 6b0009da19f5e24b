//! Reading a model's full parameters from named tensors, whatever holds them (a safetensors
//! directory, a GGUF file) and however a family names and lays them out.
//!
//! A family supplies [`Naming`]: the stored name of each of our parameters and whether it is
//! stored transposed. The import checks every tensor's shape against our unit's (naming the
//! tensor when it is missing or wrong) and refuses tensors the model would silently drop,
//! except those the family says are not parameters.

use std::collections::BTreeSet;
use std::path::Path;

use super::super::error::CheckpointError;
use super::files::TensorDir;
use crate::model::UnitSpec;

/// Named tensors a checkpoint holds, read one at a time.
pub trait TensorSource {
    /// Where they are, for messages.
    fn origin(&self) -> &Path;
    /// Every tensor's name.
    fn names(&self) -> Vec<String>;
    /// A tensor's shape as stored (PyTorch order), if there is one by that name.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    /// A tensor's values as f32, in stored row-major order.
    fn read_f32(&self, name: &str) -> Result<Vec<f32>, CheckpointError>;
}

impl TensorSource for TensorDir {
    fn origin(&self) -> &Path {
        &self.dir
    }

    fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.tensors.get(name).map(|t| t.shape.clone())
    }

    fn read_f32(&self, name: &str) -> Result<Vec<f32>, CheckpointError> {
        TensorDir::read_f32(self, name)
    }
}

/// How a family stores our parameters.
pub trait Naming {
    /// The family, for messages (`GPT-2`).
    fn family(&self) -> &str;
    /// The stored name of our parameter `ours`, and whether it is stored transposed; `None`
    /// for a name the family does not have.
    fn stored(&self, ours: &str) -> Option<(String, bool)>;
    /// Tensors a checkpoint may hold that are not our parameters (stale buffers, the tied
    /// head's duplicate).
    fn ignorable(&self, stored: &str) -> bool;
}

/// `[rows, cols]` row-major into `[cols, rows]`.
pub fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; v.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = v[r * cols + c];
        }
    }
    out
}

/// Every unit's full parameters from `src`, named and laid out by `naming`.
pub fn import(
    src: &dyn TensorSource,
    naming: &dyn Naming,
    units: &[UnitSpec],
) -> Result<Vec<Vec<f32>>, CheckpointError> {
    let bad = |what: String| CheckpointError::Incompatible {
        path: src.origin().to_path_buf(),
        what,
    };
    let mut unused: BTreeSet<String> = src.names().into_iter().collect();
    let mut out = Vec::with_capacity(units.len());
    for u in units {
        let mut buf = Vec::with_capacity(u.numel());
        for p in &u.params {
            let (name, transposed) = naming.stored(&p.name).ok_or_else(|| {
                bad(format!(
                    "our parameter `{}` has no {} name",
                    p.name,
                    naming.family()
                ))
            })?;
            let want: Vec<usize> = match transposed {
                true => p.shape.iter().rev().copied().collect(),
                false => p.shape.clone(),
            };
            let shape = src.shape(&name).ok_or_else(|| {
                bad(format!(
                    "has no tensor `{name}` (the model needs shape {want:?})"
                ))
            })?;
            if shape != want {
                return Err(bad(format!(
                    "tensor `{name}` has shape {shape:?}; this model needs {want:?}"
                )));
            }
            let v = src.read_f32(&name)?;
            match transposed {
                true => buf.extend(transpose(&v, want[0], want[1])),
                false => buf.extend(v),
            }
            unused.remove(&name);
        }
        out.push(buf);
    }
    unused.retain(|n| !naming.ignorable(n));
    if let Some(extra) = unused.iter().next() {
        return Err(bad(format!(
            "tensor `{extra}` is not a parameter of this {} ({} such tensors)",
            naming.family(),
            unused.len()
        )));
    }
    Ok(out)
}

/// The stored name, shape and values of each of our parameters, in unit order, for export.
pub fn export_tensors<'a>(
    naming: &'a dyn Naming,
    units: &'a [UnitSpec],
    params: &'a [Vec<f32>],
) -> impl Iterator<Item = Result<(String, Vec<usize>, Vec<f32>), String>> + 'a {
    units.iter().zip(params).flat_map(move |(u, buf)| {
        let mut off = 0;
        u.params.iter().map(move |p| {
            let n = p.numel();
            let v = &buf[off..off + n];
            off += n;
            let (name, transposed) = naming
                .stored(&p.name)
                .ok_or_else(|| format!("parameter `{}` has no {} name", p.name, naming.family()))?;
            Ok(match transposed {
                true => (
                    name,
                    vec![p.shape[1], p.shape[0]],
                    transpose(v, p.shape[0], p.shape[1]),
                ),
                false => (name, p.shape.clone(), v.to_vec()),
            })
        })
    })
}
