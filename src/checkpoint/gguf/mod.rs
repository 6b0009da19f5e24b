//! GGUF files (llama.cpp's format) for Llama-family models: the header and metadata, the
//! model's shape, its tensors under Hugging Face names dequantized to f32, and a Hugging Face
//! `tokenizer.json` built from the vocabulary the file carries.
//!
//! What [`GgufFile::read_hf`] gives is what transformers' `from_pretrained(..., gguf_file=...)`
//! loads: f32 values (bit for bit those of ggml's reference dequantizer), PyTorch shapes, and
//! q/k rows back in the `rotate_half` order llama.cpp's converter had permuted.
//!
//! - [`parse`]: the header, every length bounded by the file's size;
//! - [`value`]: metadata values; [`quant`]: tensor types and dequantization;
//! - [`names`]: llama.cpp against Hugging Face tensor names, and the q/k permutation;
//! - [`llama`]: the model shape; [`tokenizer`]: `tokenizer.json`.
//!
//! Design: docs/models.md.

pub mod hf_view;
pub mod llama;
pub mod names;
pub mod parse;
pub mod quant;
pub mod tokenizer;
pub mod value;

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub use llama::GgufLlama;
pub use parse::GgufTensorInfo;
pub use quant::GgmlType;
pub use value::{GgufArray, GgufValue};

use super::error::{CheckpointError, IoContext};
use names::Permuted;

/// A tensor as [`GgufFile::read_hf`] gives it: PyTorch shape (outermost first), f32 values.
pub type HfTensor = (Vec<usize>, Vec<f32>);

/// An opened GGUF file: its header, parsed and checked. Tensor data is read on demand.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    version: u32,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<GgufTensorInfo>,
    by_name: HashMap<String, usize>,
    data_offset: u64,
    /// Open for positioned reads from any thread.
    file: File,
}

impl GgufFile {
    /// Parses the header, metadata and tensor infos (not the data). Refuses a file that is not
    /// GGUF v2 or v3, counts and lengths past the bounds in [`parse`], tensors of an
    /// unsupported type, and tensors whose bytes would lie past the end of the file.
    pub fn open(path: &Path) -> Result<Self, CheckpointError> {
        if !path.exists() {
            return Err(CheckpointError::NotFound {
                path: path.to_path_buf(),
            });
        }
        let h = parse::read_header(path)?;
        let by_name = h
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(Self {
            path: path.to_path_buf(),
            version: h.version,
            metadata: h.metadata,
            tensors: h.tensors,
            by_name,
            data_offset: h.data_offset,
            file: File::open(path).at(path, "open")?,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    /// Absolute offset of the tensor data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    pub fn metadata(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// Every tensor, in file order, under its GGUF name.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// One tensor's info by its GGUF name (`blk.0.attn_q.weight`).
    pub fn tensor(&self, gguf_name: &str) -> Option<&GgufTensorInfo> {
        self.by_name.get(gguf_name).map(|&i| &self.tensors[i])
    }

    /// The Llama shape from the metadata; another `general.architecture` is refused.
    pub fn llama_shape(&self) -> Result<GgufLlama, CheckpointError> {
        llama::shape(self)
    }

    /// The Hugging Face names of the tensors present, in transformers' order (embedding,
    /// layers, final norm, `lm_head` when the file has `output.weight`). Tensors without an
    /// HF counterpart (e.g. `rope_freqs.weight`) are left out.
    pub fn hf_names(&self) -> Vec<String> {
        let mut named: Vec<_> = self
            .tensors
            .iter()
            .filter_map(|t| names::to_hf(&t.name))
            .collect();
        named.sort_by(|a, b| a.1.cmp(&b.1));
        named.into_iter().map(|(n, _)| n).collect()
    }

    /// One tensor by its Hugging Face name: its PyTorch shape (outermost first) and its values
    /// as f32, q/k permutation undone. `Ok(None)` when the file has no such tensor. Reads only
    /// that tensor's bytes.
    pub fn read_hf(&self, hf_name: &str) -> Result<Option<HfTensor>, CheckpointError> {
        let Some(info) = names::to_gguf(hf_name).and_then(|(g, _)| self.tensor(&g)) else {
            return Ok(None);
        };
        let shape = info.shape();
        let values = self.read_hf_range(hf_name, 0..info.n_elements())?;
        Ok(values.map(|v| (shape, v)))
    }

    /// Elements `range` (PyTorch row-major order) of a tensor by its Hugging Face name, q/k
    /// permutation undone; `Ok(None)` when the file has no such tensor. Reads only the rows
    /// holding them (a q/k tensor's rows are permuted within each head, so its whole heads),
    /// since quantization blocks lie within rows; a vector is read whole.
    pub fn read_hf_range(
        &self,
        hf_name: &str,
        range: Range<usize>,
    ) -> Result<Option<Vec<f32>>, CheckpointError> {
        let Some((gguf_name, permuted)) = names::to_gguf(hf_name) else {
            return Ok(None);
        };
        let Some(info) = self.tensor(&gguf_name) else {
            return Ok(None);
        };
        let numel = info.n_elements();
        if range.start > range.end || range.end > numel {
            return Err(CheckpointError::incompatible(
                &self.path,
                format!(
                    "elements {}..{} of tensor {gguf_name:?} are past its {numel}",
                    range.start, range.end
                ),
            ));
        }
        let shape = info.shape();
        let (rows, cols) = match shape.len() {
            0 | 1 => (1, numel),
            _ => (shape[0], numel / shape[0].max(1)),
        };
        if numel == 0 || range.is_empty() {
            return Ok(Some(Vec::new()));
        }
        let per_head = match permuted {
            Permuted::No => 1,
            Permuted::Query | Permuted::Key => {
                let key = match permuted {
                    Permuted::Query => "llama.attention.head_count",
                    _ => "llama.attention.head_count_kv",
                };
                let n = self.heads(key, permuted)?;
                if n == 0 || shape.len() < 2 || !rows.is_multiple_of(2 * n) {
                    return Err(CheckpointError::incompatible(
                        &self.path,
                        format!(
                            "tensor {gguf_name:?} has {rows} rows, not a whole number of \
                             rotary pairs for {n} heads ({key})"
                        ),
                    ));
                }
                rows / n
            }
        };
        let first = range.start / cols / per_head * per_head;
        let end = (range.end.div_ceil(cols)).div_ceil(per_head) * per_head;
        // Whole rows are whole blocks (ggml quantizes along rows), so rows divide the bytes.
        let row_bytes = info.n_bytes / rows as u64;
        let mut bytes = vec![0u8; ((end - first) as u64 * row_bytes) as usize];
        self.file
            .read_exact_at(
                &mut bytes,
                self.data_offset + info.offset + first as u64 * row_bytes,
            )
            .at(&self.path, "read")?;
        let mut values = vec![0f32; (end - first) * cols];
        quant::dequantize(info.ty, &bytes, &mut values);
        if per_head > 1 {
            values = names::unpermute(&values, end - first, cols, (end - first) / per_head);
        }
        let base = first * cols;
        Ok(Some(values[range.start - base..range.end - base].to_vec()))
    }

    /// The head count that shapes a q or k permutation; k falls back to q's count, as
    /// llama.cpp does when `head_count_kv` is absent.
    fn heads(&self, key: &str, permuted: Permuted) -> Result<usize, CheckpointError> {
        let v = self.metadata(key).or_else(|| match permuted {
            Permuted::Key => self.metadata("llama.attention.head_count"),
            _ => None,
        });
        v.and_then(GgufValue::as_u64)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| {
                CheckpointError::incompatible(
                    &self.path,
                    format!("{key} is missing or not an integer, and q/k rows cannot be un-permuted without it"),
                )
            })
    }

    /// Writes a Hugging Face `tokenizer.json` built from the byte-level BPE vocabulary in the
    /// metadata, checked to load with the `tokenizers` crate before it is written.
    pub fn write_tokenizer_json(&self, path: &Path) -> Result<(), CheckpointError> {
        tokenizer::write(self, path)
    }
}
