//! The GGUF header: magic, version, metadata and tensor infos, read through a cursor that
//! checks every length against the bytes the file has left before it allocates, so a damaged
//! or hostile file is refused with a message rather than an out-of-memory abort.
//!
//! Layout (ggml `docs/gguf.md`, little-endian): `GGUF`, `u32 version`, `u64 tensor_count`,
//! `u64 kv_count`; each key/value as `string key, u32 type, value`; each tensor info as
//! `string name, u32 n_dims, u64 dims[n_dims], u32 type, u64 offset`; then zero padding up
//! to `general.alignment` (32 when absent), and the tensor data.

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use super::quant::{ggml_type_name, GgmlType, SUPPORTED};
use super::value::{GgufArray, GgufValue};
use crate::checkpoint::error::{CheckpointError, IoContext};

/// Refused beyond these: far past any real model, small enough that a bad count fails fast.
pub const TENSORS_MAX: u64 = 1 << 20;
pub const KVS_MAX: u64 = 1 << 20;
pub const STRING_BYTES_MAX: u64 = 1 << 20;
pub const ARRAY_LEN_MAX: u64 = 1 << 26;
pub const N_DIMS_MAX: u32 = 4;
/// Arrays of arrays occur (the spec allows them); deeper nesting than this is damage.
const ARRAY_DEPTH_MAX: usize = 4;
const ALIGNMENT_DEFAULT: u64 = 32;
/// Alignments past this are not padding any writer would choose.
const ALIGNMENT_MAX: u64 = 1 << 20;

/// One tensor's entry in the header.
#[derive(Debug, Clone)]
pub struct GgufTensorInfo {
    pub name: String,
    /// As the file stores them: innermost (fastest-varying) first.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// From the start of the data section.
    pub offset: u64,
    pub n_bytes: u64,
}

impl GgufTensorInfo {
    /// The shape in PyTorch order, outermost first.
    pub fn shape(&self) -> Vec<usize> {
        // Each dim is at most the element count, which `n_bytes` bounds by the file size.
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    pub fn n_elements(&self) -> usize {
        self.dims.iter().product::<u64>() as usize
    }
}

/// Everything before the tensor data.
#[derive(Debug)]
pub struct Header {
    pub version: u32,
    pub metadata: BTreeMap<String, GgufValue>,
    pub tensors: Vec<GgufTensorInfo>,
    /// Absolute file offset of the data section.
    pub data_offset: u64,
}

/// A byte cursor over the file that knows how much is left.
struct Cursor {
    inner: BufReader<File>,
    path: PathBuf,
    pos: u64,
    len: u64,
}

impl Cursor {
    fn bytes(&mut self, n: u64, what: &str) -> Result<Vec<u8>, CheckpointError> {
        self.need(n, what)?;
        let mut buf = vec![0u8; n as usize];
        self.inner.read_exact(&mut buf).at(&self.path, "read")?;
        self.pos += n;
        Ok(buf)
    }

    fn need(&self, n: u64, what: &str) -> Result<(), CheckpointError> {
        match self.len.checked_sub(self.pos) {
            Some(left) if left >= n => Ok(()),
            _ => Err(CheckpointError::corrupt(
                &self.path,
                format!(
                    "truncated GGUF: {what} needs {n} bytes at offset {}, but the file is {} bytes",
                    self.pos, self.len
                ),
            )),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], CheckpointError> {
        self.need(N as u64, what)?;
        let mut buf = [0u8; N];
        self.inner.read_exact(&mut buf).at(&self.path, "read")?;
        self.pos += N as u64;
        Ok(buf)
    }

    fn u32(&mut self, what: &str) -> Result<u32, CheckpointError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, CheckpointError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A GGUF string. Invalid UTF-8 is replaced rather than refused: llama.cpp treats strings
    /// as bytes, and one odd token must not make the weights unreadable.
    fn string(&mut self, what: &str) -> Result<String, CheckpointError> {
        let n = self.u64(what)?;
        if n > STRING_BYTES_MAX {
            return Err(self.bad(format!(
                "{what}: string of {n} bytes at offset {} (at most {STRING_BYTES_MAX})",
                self.pos - 8
            )));
        }
        let b = self.bytes(n, what)?;
        Ok(String::from_utf8(b).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into()))
    }

    fn bad(&self, what: String) -> CheckpointError {
        CheckpointError::corrupt(&self.path, what)
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<GgufValue, CheckpointError> {
        Ok(match ty {
            0 => GgufValue::U8(self.array::<1>(key)?[0]),
            1 => GgufValue::I8(self.array::<1>(key)?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(key)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(key)?)),
            4 => GgufValue::U32(self.u32(key)?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(key)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(key)?)),
            7 => GgufValue::Bool(self.array::<1>(key)?[0] != 0),
            8 => GgufValue::String(self.string(key)?),
            9 => GgufValue::Array(self.array_value(key, depth)?),
            10 => GgufValue::U64(self.u64(key)?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(key)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(key)?)),
            other => {
                return Err(self.bad(format!(
                    "metadata {key:?}: unknown value type {other} (GGUF has 0 to 12)"
                )))
            }
        })
    }

    fn array_value(&mut self, key: &str, depth: usize) -> Result<GgufArray, CheckpointError> {
        if depth >= ARRAY_DEPTH_MAX {
            return Err(self.bad(format!(
                "metadata {key:?}: arrays nested deeper than {ARRAY_DEPTH_MAX}"
            )));
        }
        let ty = self.u32(key)?;
        let n = self.u64(key)?;
        // Every element takes at least one byte, so the count is also bounded by what is left.
        let left = self.len.saturating_sub(self.pos);
        if n > ARRAY_LEN_MAX || n > left {
            return Err(self.bad(format!(
                "metadata {key:?}: array of {n} elements at offset {} (at most {ARRAY_LEN_MAX}, \
                 and {left} bytes are left in the file)",
                self.pos - 12
            )));
        }
        let n = n as usize;
        macro_rules! fixed {
            ($variant:ident, $t:ty) => {{
                let raw = self.bytes((n * std::mem::size_of::<$t>()) as u64, key)?;
                let it = raw.chunks_exact(std::mem::size_of::<$t>());
                GgufArray::$variant(
                    it.map(|c| <$t>::from_le_bytes(c.try_into().unwrap_or_default()))
                        .collect(),
                )
            }};
        }
        Ok(match ty {
            0 => GgufArray::U8(self.bytes(n as u64, key)?),
            1 => fixed!(I8, i8),
            2 => fixed!(U16, u16),
            3 => fixed!(I16, i16),
            4 => fixed!(U32, u32),
            5 => fixed!(I32, i32),
            6 => fixed!(F32, f32),
            7 => GgufArray::Bool(self.bytes(n as u64, key)?.iter().map(|&b| b != 0).collect()),
            8 => GgufArray::String((0..n).map(|_| self.string(key)).collect::<Result<_, _>>()?),
            9 => GgufArray::Array(
                (0..n)
                    .map(|_| self.array_value(key, depth + 1))
                    .collect::<Result<_, _>>()?,
            ),
            10 => fixed!(U64, u64),
            11 => fixed!(I64, i64),
            12 => fixed!(F64, f64),
            other => {
                return Err(self.bad(format!(
                    "metadata {key:?}: unknown array element type {other} (GGUF has 0 to 12)"
                )))
            }
        })
    }
}

/// Reads and checks the header of `path`.
pub fn read_header(path: &Path) -> Result<Header, CheckpointError> {
    let file = File::open(path).at(path, "open")?;
    let len = file.metadata().at(path, "stat")?.len();
    let mut c = Cursor {
        inner: BufReader::with_capacity(1 << 16, file),
        path: path.to_path_buf(),
        pos: 0,
        len,
    };
    let magic: [u8; 4] = c.array("the magic")?;
    if &magic != b"GGUF" {
        return Err(CheckpointError::incompatible(
            path,
            format!("not a GGUF file: it starts with {magic:02x?}, not \"GGUF\" (47 47 55 46)"),
        ));
    }
    let version = c.u32("the version")?;
    if version != 2 && version != 3 {
        let hint = if version.swap_bytes() <= 3 {
            " (a big-endian file?)"
        } else {
            ""
        };
        return Err(CheckpointError::incompatible(
            path,
            format!("GGUF version {version}{hint} is not read (supported: 2 and 3)"),
        ));
    }
    let n_tensors = c.u64("the tensor count")?;
    let n_kvs = c.u64("the metadata count")?;
    if n_tensors > TENSORS_MAX || n_kvs > KVS_MAX {
        return Err(c.bad(format!(
            "{n_tensors} tensors and {n_kvs} metadata entries (at most {TENSORS_MAX} each)"
        )));
    }
    let mut metadata = BTreeMap::new();
    for i in 0..n_kvs {
        let key = c.string(&format!("metadata key {i}"))?;
        let ty = c.u32(&key)?;
        let v = c.value(ty, &key, 0)?;
        if metadata.insert(key.clone(), v).is_some() {
            return Err(c.bad(format!("metadata key {key:?} appears twice")));
        }
    }
    let mut infos = Vec::new();
    let mut names = HashSet::new();
    for i in 0..n_tensors {
        let info = tensor_info(&mut c, i)?;
        if !names.insert(info.0.clone()) {
            return Err(c.bad(format!("tensor {:?} appears twice", info.0)));
        }
        infos.push(info);
    }
    let alignment = alignment(&metadata).map_err(|what| c.bad(what))?;
    let data_offset = c.pos.div_ceil(alignment) * alignment;
    let tensors = infos
        .into_iter()
        .map(|(name, dims, ty, offset)| {
            check_tensor(path, len, data_offset, alignment, name, dims, ty, offset)
        })
        .collect::<Result<_, _>>()?;
    Ok(Header {
        version,
        metadata,
        tensors,
        data_offset,
    })
}

type RawInfo = (String, Vec<u64>, u32, u64);

fn tensor_info(c: &mut Cursor, i: u64) -> Result<RawInfo, CheckpointError> {
    let name = c.string(&format!("tensor {i}'s name"))?;
    let n_dims = c.u32(&name)?;
    if n_dims == 0 || n_dims > N_DIMS_MAX {
        return Err(c.bad(format!(
            "tensor {name:?} has {n_dims} dimensions (GGUF allows 1 to {N_DIMS_MAX})"
        )));
    }
    let dims = (0..n_dims)
        .map(|_| c.u64(&name))
        .collect::<Result<Vec<_>, _>>()?;
    let ty = c.u32(&name)?;
    let offset = c.u64(&name)?;
    Ok((name, dims, ty, offset))
}

fn alignment(metadata: &BTreeMap<String, GgufValue>) -> Result<u64, String> {
    let Some(v) = metadata.get("general.alignment") else {
        return Ok(ALIGNMENT_DEFAULT);
    };
    match v.as_u64() {
        Some(a) if a.is_power_of_two() && a <= ALIGNMENT_MAX => Ok(a),
        _ => Err(format!(
            "general.alignment is {v:?}: it must be a power of two up to {ALIGNMENT_MAX}"
        )),
    }
}

/// The tensor's type is one read here, and its bytes lie whole inside the file.
#[allow(clippy::too_many_arguments)]
fn check_tensor(
    path: &Path,
    file_len: u64,
    data_offset: u64,
    alignment: u64,
    name: String,
    dims: Vec<u64>,
    ty: u32,
    offset: u64,
) -> Result<GgufTensorInfo, CheckpointError> {
    let ty = GgmlType::from_u32(ty).map_err(|n| {
        CheckpointError::incompatible(
            path,
            format!(
                "tensor {name:?} has type {} ({n}), which is not read (supported: {SUPPORTED})",
                ggml_type_name(n)
            ),
        )
    })?;
    let n_bytes = ty.n_bytes(&dims).map_err(|why| {
        CheckpointError::corrupt(path, format!("tensor {name:?} ({}): {why}", ty.name()))
    })?;
    let end = data_offset
        .checked_add(offset)
        .and_then(|s| s.checked_add(n_bytes));
    if !offset.is_multiple_of(alignment) || end.is_none_or(|e| e > file_len) {
        return Err(CheckpointError::corrupt(
            path,
            format!(
                "tensor {name:?} ({} {dims:?}, {n_bytes} bytes at data offset {offset}) lies past the \
                 end of the file ({file_len} bytes, data from {data_offset}) or off the {alignment}-byte \
                 alignment: the file is truncated or damaged",
                ty.name()
            ),
        ));
    }
    Ok(GgufTensorInfo {
        name,
        dims,
        ty,
        offset,
        n_bytes,
    })
}
