//! Safetensors files as Hugging Face lays them out in a model directory: one
//! `model.safetensors`, or shards `model-0000k-of-0000n.safetensors` named by
//! `model.safetensors.index.json`.
//!
//! Reading parses each file's header and reads a tensor's bytes at its offsets when asked, so
//! only one tensor (plus what the caller keeps) is in memory at a time, never a whole shard.
//! Writing splits tensors into shards of at most `max_shard_bytes` (a larger tensor gets a
//! shard of its own) with the `{"format": "pt"}` metadata transformers requires.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use safetensors::tensor::{Dtype, TensorView};
use serde::Deserialize;

use super::super::error::{CheckpointError, IoContext};
use crate::wire::f32s::{decode_bf16_into, get_f32s};

/// The single-file checkpoint's name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The sharded checkpoint's index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The largest safetensors header we parse (the format's own reference reader caps it at 100 MB).
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// Element types a checkpoint may store; every one is read as f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StDtype {
    F32,
    F16,
    Bf16,
}

impl StDtype {
    fn parse(s: &str) -> Option<Self> {
        match s {
            "F32" => Some(Self::F32),
            "F16" => Some(Self::F16),
            "BF16" => Some(Self::Bf16),
            _ => None,
        }
    }

    fn bytes(self) -> u64 {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
        }
    }
}

/// Where one tensor's bytes are.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub file: PathBuf,
    /// `None`: a type we do not read (named when the tensor is asked for).
    pub dtype: Option<StDtype>,
    pub dtype_name: String,
    pub shape: Vec<usize>,
    /// Absolute byte offset of the data in `file`, and its length.
    pub start: u64,
    pub len: u64,
}

/// Every tensor of a model directory, by name.
#[derive(Debug)]
pub struct TensorDir {
    pub dir: PathBuf,
    /// What was opened (the directory, or the one file), for messages.
    pub origin: PathBuf,
    pub tensors: BTreeMap<String, TensorInfo>,
    /// Each file, open for positioned reads from any thread (ranks read their ranges at once).
    open: HashMap<PathBuf, File>,
    /// Bytes of tensor data read so far.
    bytes_read: AtomicU64,
}

#[derive(Deserialize)]
struct RawInfo {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: [u64; 2],
}

#[derive(Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

fn bad(path: &Path, what: impl Into<String>) -> CheckpointError {
    CheckpointError::Safetensors {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

impl TensorDir {
    /// Opens `dir`'s safetensors checkpoint: the index and its shards if there is an index,
    /// else `model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let index = dir.join(INDEX_FILE);
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).at(&index, "read")?;
            let idx: Index = serde_json::from_str(&text)
                .map_err(|e| bad(&index, format!("not a safetensors index: {e}")))?;
            let mut names: Vec<&String> = idx.weight_map.values().collect();
            names.sort();
            names.dedup();
            for n in &names {
                if n.contains('/') || n.contains("..") {
                    return Err(bad(
                        &index,
                        format!("shard name `{n}` leaves the directory"),
                    ));
                }
            }
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if dir.join(SINGLE_FILE).exists() {
            vec![dir.join(SINGLE_FILE)]
        } else {
            return Err(bad(
                dir,
                format!("has neither {SINGLE_FILE} nor {INDEX_FILE}: no safetensors weights"),
            ));
        };
        Self::of_files(dir, files)
    }

    /// One safetensors file by its path.
    pub fn open_file(path: &Path) -> Result<Self, CheckpointError> {
        let dir = path.parent().unwrap_or(Path::new("."));
        let mut td = Self::of_files(dir, vec![path.to_path_buf()])?;
        td.origin = path.to_path_buf();
        Ok(td)
    }

    fn of_files(dir: &Path, files: Vec<PathBuf>) -> Result<Self, CheckpointError> {
        let mut tensors = BTreeMap::new();
        let mut open = HashMap::new();
        for f in files {
            for (name, info) in read_header(&f)? {
                if tensors.insert(name.clone(), info).is_some() {
                    return Err(bad(&f, format!("tensor `{name}` is in two shards")));
                }
            }
            let file = File::open(&f).at(&f, "open")?;
            open.insert(f, file);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            origin: dir.to_path_buf(),
            tensors,
            open,
            bytes_read: AtomicU64::new(0),
        })
    }

    /// Bytes of tensor data read since the directory was opened.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    /// Reads elements `range` of tensor `name` (stored row-major order) as f32: only those
    /// elements' bytes.
    pub fn read_range(&self, name: &str, range: Range<usize>) -> Result<Vec<f32>, CheckpointError> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| bad(&self.origin, format!("has no tensor `{name}`")))?;
        let dtype = info.dtype.ok_or_else(|| {
            bad(
                &info.file,
                format!(
                    "tensor `{name}` is {}; only F32, F16 and BF16 can be read",
                    info.dtype_name
                ),
            )
        })?;
        let elem = dtype.bytes();
        let numel = info.len / elem;
        if range.start > range.end || range.end as u64 > numel {
            return Err(bad(
                &info.file,
                format!(
                    "elements {}..{} of tensor `{name}` are past its {numel}",
                    range.start, range.end
                ),
            ));
        }
        let mut bytes = vec![0u8; range.len() * elem as usize];
        let file = self
            .open
            .get(&info.file)
            .ok_or_else(|| bad(&info.file, "was not opened with the directory".to_string()))?;
        file.read_exact_at(&mut bytes, info.start + range.start as u64 * elem)
            .at(&info.file, "read")?;
        self.bytes_read
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(match dtype {
            StDtype::F32 => get_f32s(&bytes),
            StDtype::Bf16 => {
                let mut out = vec![0f32; bytes.len() / 2];
                decode_bf16_into(&bytes, &mut out);
                out
            }
            StDtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]])))
                .collect(),
        })
    }
}

/// Parses `path`'s header: 8 bytes of little-endian length, then that much JSON.
fn read_header(path: &Path) -> Result<Vec<(String, TensorInfo)>, CheckpointError> {
    let f = File::open(path).at(path, "open")?;
    let file_len = f.metadata().at(path, "stat")?.len();
    let mut len = [0u8; 8];
    f.read_exact_at(&mut len, 0)
        .map_err(|_| bad(path, "shorter than a safetensors header"))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER_BYTES || 8 + n > file_len {
        return Err(bad(
            path,
            format!("header of {n} bytes does not fit the file"),
        ));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact_at(&mut header, 8).at(path, "read")?;
    let mut raw: HashMap<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|e| bad(path, format!("not a safetensors header: {e}")))?;
    raw.remove("__metadata__");
    let data_start = 8 + n;
    let mut out = Vec::with_capacity(raw.len());
    for (name, v) in raw {
        let r: RawInfo =
            serde_json::from_value(v).map_err(|e| bad(path, format!("tensor `{name}`: {e}")))?;
        let dtype = StDtype::parse(&r.dtype);
        let [b, e] = r.data_offsets;
        let numel: u64 = r.shape.iter().map(|&d| d as u64).product();
        let elem = dtype.map_or(0, StDtype::bytes);
        if e < b || data_start + e > file_len || (dtype.is_some() && e - b != numel * elem) {
            return Err(bad(
                path,
                format!(
                    "tensor `{name}`: offsets {b}..{e} do not hold {:?} of {} in a file of {file_len} bytes",
                    r.shape, r.dtype
                ),
            ));
        }
        out.push((
            name,
            TensorInfo {
                file: path.to_path_buf(),
                dtype,
                dtype_name: r.dtype,
                shape: r.shape,
                start: data_start + b,
                len: e - b,
            },
        ));
    }
    Ok(out)
}

/// Round-to-nearest-even conversion of an f32 to bf16 bits (NaN stays NaN).
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// The f32 with the same value as bf16 bits `h` (exact).
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// `values` as little-endian f32 bytes, or rounded to bf16 (`f32_to_bf16`).
pub fn to_bytes(values: &[f32], bf16: bool) -> Vec<u8> {
    if bf16 {
        values
            .iter()
            .flat_map(|&x| f32_to_bf16(x).to_le_bytes())
            .collect()
    } else {
        values.iter().flat_map(|x| x.to_le_bytes()).collect()
    }
}

/// IEEE half to f32 (exact: every f16 is an f32).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        // Subnormal: value man · 2^-24.
        (0, m) => {
            let v = m as f32 * f32::powi(2.0, -24);
            return if sign != 0 { -v } else { v };
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// A tensor to write: name, shape and its little-endian bytes of `dtype`.
pub struct OutTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// Writes `tensors` into `dir` as `model.safetensors`, or as shards of at most
/// `max_shard_bytes` plus the index. Returns the files written and the total data bytes.
pub fn write_checkpoint(
    dir: &Path,
    tensors: Vec<OutTensor>,
    dtype: Dtype,
    max_shard_bytes: u64,
) -> Result<(Vec<PathBuf>, u64), CheckpointError> {
    let mut shards: Vec<Vec<OutTensor>> = vec![Vec::new()];
    let mut size = 0u64;
    let total: u64 = tensors.iter().map(|t| t.bytes.len() as u64).sum();
    for t in tensors {
        let n = t.bytes.len() as u64;
        let last = shards.last_mut().expect("one shard at least");
        if !last.is_empty() && size + n > max_shard_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        size += n;
        shards.last_mut().expect("one shard at least").push(t);
    }
    let count = shards.len();
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let mut files = Vec::new();
    let mut weight_map = BTreeMap::new();
    for (k, shard) in shards.into_iter().enumerate() {
        let name = match count {
            1 => SINGLE_FILE.to_string(),
            _ => format!("model-{:05}-of-{count:05}.safetensors", k + 1),
        };
        let path = dir.join(&name);
        let views = shard
            .iter()
            .map(|t| {
                weight_map.insert(t.name.clone(), name.clone());
                TensorView::new(dtype, t.shape.clone(), &t.bytes).map(|v| (t.name.clone(), v))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad(&path, e.to_string()))?;
        safetensors::serialize_to_file(views, Some(meta.clone()), &path)
            .map_err(|e| bad(&path, e.to_string()))?;
        files.push(path);
    }
    if count > 1 {
        let index = serde_json::json!({
            "metadata": {"total_size": total},
            "weight_map": weight_map,
        });
        let path = dir.join(INDEX_FILE);
        let text = serde_json::to_string_pretty(&index).expect("a JSON value serializes");
        std::fs::write(&path, text).at(&path, "write")?;
        files.push(path);
    }
    Ok((files, total))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::hf::source::TensorSource;

    #[test]
    fn f16_converts_exactly() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_to_f32(0x0001), f32::powi(2.0, -24));
        assert_eq!(f16_to_f32(0x8001), -f32::powi(2.0, -24));
        assert_eq!(f16_to_f32(0x3555), 0.333_251_95);
        assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
        assert!(f16_to_f32(0x7e00).is_nan());
        assert_eq!(f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn shards_round_trip_through_the_index() {
        let dir = tempfile::tempdir().unwrap();
        let t = |name: &str, n: usize| OutTensor {
            name: name.into(),
            shape: vec![n],
            bytes: (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect(),
        };
        let (files, total) = write_checkpoint(
            dir.path(),
            vec![t("a", 10), t("b", 30), t("c", 5)],
            Dtype::F32,
            100,
        )
        .unwrap();
        assert_eq!(total, 180);
        assert_eq!(files.len(), 4, "{files:?}"); // a | b | c, and the index
        let td = TensorDir::open(dir.path()).unwrap();
        assert_eq!(td.read_f32("b").unwrap()[29], 29.0);
        assert_eq!(td.tensors["c"].shape, vec![5]);
        assert!(td
            .read_f32("d")
            .unwrap_err()
            .to_string()
            .contains("no tensor `d`"));
    }
}
