//! Reading a model's full parameters from named tensors, whatever holds them (a safetensors
//! directory, a GGUF file) and however a family names and lays them out.
//!
//! A family supplies [`Naming`]: the stored name of each of our parameters and whether it is
//! stored transposed. The import checks every tensor's shape against our unit's (naming the
//! tensor when it is missing or wrong) and refuses tensors the model would silently drop,
//! except those the family says are not parameters.

use std::collections::BTreeSet;
use std::ops::Range;
use std::path::Path;

use super::super::error::CheckpointError;
use super::files::TensorDir;
use crate::model::weights::WeightSource;
use crate::model::UnitSpec;

/// Named tensors a checkpoint holds, read a tensor or a piece of one at a time.
pub trait TensorSource {
    /// Where they are, for messages.
    fn origin(&self) -> &Path;
    /// Every tensor's name.
    fn names(&self) -> Vec<String>;
    /// A tensor's shape as stored (PyTorch order), if there is one by that name.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    /// Elements `range` of a tensor in stored row-major order, as f32. Reads little more than
    /// those elements' bytes (a whole quantization block or row at the ends).
    fn read_range(&self, name: &str, range: Range<usize>) -> Result<Vec<f32>, CheckpointError>;
    /// A whole tensor's values as f32, in stored row-major order.
    fn read_f32(&self, name: &str) -> Result<Vec<f32>, CheckpointError> {
        let n = self.shape(name).map_or(0, |s| s.iter().product());
        self.read_range(name, 0..n)
    }
}

impl TensorSource for TensorDir {
    fn origin(&self) -> &Path {
        &self.origin
    }

    fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.tensors.get(name).map(|t| t.shape.clone())
    }

    fn read_range(&self, name: &str, range: Range<usize>) -> Result<Vec<f32>, CheckpointError> {
        TensorDir::read_range(self, name, range)
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

/// One of our parameters where a checkpoint stores it.
#[derive(Debug)]
struct Placed {
    stored: String,
    /// Stored as the transpose of our `[rows, cols]`.
    transposed: bool,
    /// Our shape.
    shape: Vec<usize>,
    /// Where it starts in its unit's flat buffer.
    offset: usize,
}

impl Placed {
    fn span(&self) -> Range<usize> {
        self.offset..self.offset + self.shape.iter().product::<usize>()
    }
}

/// A model's weights in a checkpoint of named tensors: every name and shape checked when
/// opened, values read when a rank asks for a unit's ranges. A parameter stored as it is
/// laid out here is read by byte range; one stored transposed (GPT-2's `Conv1D`) is read
/// whole, once per request, since a range of ours is strided across all of its rows.
#[derive(Debug)]
pub struct NamedWeights<S> {
    src: S,
    units: Vec<Vec<Placed>>,
}

impl<S: TensorSource> NamedWeights<S> {
    /// Checks that `src` holds every parameter of `units` under `naming`'s name with the
    /// right shape, and nothing the model would silently drop; names the first tensor that is
    /// missing, of the wrong shape, or left over.
    pub fn open(src: S, naming: &dyn Naming, units: &[UnitSpec]) -> Result<Self, CheckpointError> {
        let bad = |what: String| CheckpointError::Incompatible {
            path: src.origin().to_path_buf(),
            what,
        };
        let mut unused: BTreeSet<String> = src.names().into_iter().collect();
        let mut placed = Vec::with_capacity(units.len());
        for u in units {
            let mut offset = 0;
            let mut here = Vec::with_capacity(u.params.len());
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
                unused.remove(&name);
                here.push(Placed {
                    stored: name,
                    transposed: transposed && p.shape.len() == 2,
                    shape: p.shape.clone(),
                    offset,
                });
                offset += p.numel();
            }
            placed.push(here);
        }
        unused.retain(|n| !naming.ignorable(n));
        if let Some(extra) = unused.iter().next() {
            return Err(bad(format!(
                "tensor `{extra}` is not a parameter of this {} ({} such tensors)",
                naming.family(),
                unused.len()
            )));
        }
        Ok(Self { src, units: placed })
    }

    /// The tensors themselves.
    pub fn source(&self) -> &S {
        &self.src
    }

    /// Elements `ranges` (sorted, disjoint) of unit `unit`'s flat parameters.
    pub fn read_ranges(
        &self,
        unit: usize,
        ranges: &[Range<usize>],
    ) -> Result<Vec<Vec<f32>>, CheckpointError> {
        let bad = |what: String| CheckpointError::Incompatible {
            path: self.src.origin().to_path_buf(),
            what,
        };
        let params = self
            .units
            .get(unit)
            .ok_or_else(|| bad(format!("the model has no unit {unit}")))?;
        let numel = params.last().map_or(0, |p| p.span().end);
        if let Some(r) = ranges.iter().find(|r| r.start > r.end || r.end > numel) {
            return Err(bad(format!(
                "elements {}..{} are past unit {unit}'s {numel}",
                r.start, r.end
            )));
        }
        let mut out: Vec<Vec<f32>> = ranges.iter().map(|r| Vec::with_capacity(r.len())).collect();
        for p in params {
            let span = p.span();
            // The pieces of `ranges` inside this parameter, in its own coordinates.
            let pieces: Vec<(usize, Range<usize>)> = ranges
                .iter()
                .enumerate()
                .filter(|(_, r)| r.start < span.end && span.start < r.end)
                .map(|(k, r)| {
                    let (a, b) = (r.start.max(span.start), r.end.min(span.end));
                    (k, a - span.start..b - span.start)
                })
                .collect();
            if pieces.is_empty() {
                continue;
            }
            if p.transposed {
                let (rows, cols) = (p.shape[1], p.shape[0]);
                let whole = transpose(&self.src.read_f32(&p.stored)?, rows, cols);
                for (k, local) in pieces {
                    out[k].extend_from_slice(&whole[local]);
                }
            } else {
                for (k, local) in pieces {
                    out[k].extend(self.src.read_range(&p.stored, local)?);
                }
            }
        }
        Ok(out)
    }

    /// Every unit's full parameters.
    pub fn read_all(&self) -> Result<Vec<Vec<f32>>, CheckpointError> {
        (0..self.units.len())
            .map(|u| {
                let n = self.units[u].last().map_or(0, |p| p.span().end);
                let whole = 0..n;
                Ok(self.read_ranges(u, std::slice::from_ref(&whole))?.remove(0))
            })
            .collect()
    }
}

impl<S: TensorSource + Send + Sync> WeightSource for NamedWeights<S> {
    fn read(&self, unit: usize, ranges: &[Range<usize>]) -> Result<Vec<Vec<f32>>, String> {
        self.read_ranges(unit, ranges).map_err(|e| e.to_string())
    }

    fn describe(&self) -> String {
        self.src.origin().display().to_string()
    }
}

/// Every unit's full parameters from `src`, named and laid out by `naming`.
pub fn import(
    src: &dyn TensorSource,
    naming: &dyn Naming,
    units: &[UnitSpec],
) -> Result<Vec<Vec<f32>>, CheckpointError> {
    NamedWeights::open(src, naming, units)?.read_all()
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

impl<T: TensorSource + ?Sized> TensorSource for &T {
    fn origin(&self) -> &Path {
        (**self).origin()
    }

    fn names(&self) -> Vec<String> {
        (**self).names()
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        (**self).shape(name)
    }

    fn read_range(&self, name: &str, range: Range<usize>) -> Result<Vec<f32>, CheckpointError> {
        (**self).read_range(name, range)
    }
}
