//! A file of chunk records on the rank's tier: where a buddy backup goes when the rank's state
//! lives on the tier, so that the backup of a model larger than memory needs no copy of it in
//! RAM. Written once front to back through a bounded buffer, then read a record at a time by
//! position. Every record carries a CRC-32 of its header and values, checked on every read: a
//! damaged record is named and never returned. The file is removed when dropped (a backup lives
//! only as long as the run that took it).
//!
//! Buffered I/O, not the tier's O_DIRECT engine: the file is written once per backup and read
//! only after a loss, so the page cache's copy costs nothing the step waits for; the kernel
//! drops it under memory pressure.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::device::{IoError, Op};
use super::tier_file::TierError;

/// unit, index, three lengths (u32 each) and the CRC-32.
const RECORD_HEADER_BYTES: usize = 6 * 4;
/// The write buffer: the most this file holds in memory.
pub const CHUNK_FILE_BUFFER_BYTES: usize = 1 << 20;

/// Where one record is.
#[derive(Clone, Copy, Debug)]
struct Entry {
    offset: u64,
    lens: [u32; 3],
}

/// The values of one chunk: parameters and up to two optimizer values per parameter.
pub type ChunkValues = [Vec<f32>; 3];

/// A file of chunk records, written once, then read by (unit, index).
#[derive(Debug)]
pub struct ChunkFile {
    path: PathBuf,
    writer: Option<BufWriter<File>>,
    file: File,
    index: BTreeMap<(usize, usize), Entry>,
    len: u64,
}

impl ChunkFile {
    /// Creates (or truncates) the file at `path`, making its folder if it is missing.
    pub fn create(path: &Path) -> Result<Self, TierError> {
        let io_at = |at: &Path, e: std::io::Error| TierError::Io {
            path: at.to_path_buf(),
            op: Op::Write,
            offset: 0,
            len: 0,
            source: io_error(&e),
        };
        let io = |e| io_at(path, e);
        let file = super::folder::create_in(
            path,
            // The folder that could not be made is named, not the file.
            io_at,
            || {
                File::options()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(path)
                    .map_err(io)
            },
        )?;
        let writer =
            BufWriter::with_capacity(CHUNK_FILE_BUFFER_BYTES, file.try_clone().map_err(io)?);
        Ok(Self {
            path: path.to_path_buf(),
            writer: Some(writer),
            file,
            index: BTreeMap::new(),
            len: 0,
        })
    }

    /// Bytes written so far.
    pub fn bytes(&self) -> u64 {
        self.len
    }

    /// Chunks in the file.
    pub fn chunks(&self) -> usize {
        self.index.len()
    }

    /// Appends chunk (`unit`, `index`)'s values. A chunk appended twice keeps its last record.
    pub fn append(
        &mut self,
        unit: usize,
        index: usize,
        values: [&[f32]; 3],
    ) -> Result<(), TierError> {
        let offset = self.len;
        let mut head = [0u8; RECORD_HEADER_BYTES];
        let lens = values.map(|v| v.len() as u32);
        for (k, x) in [unit as u32, index as u32, lens[0], lens[1], lens[2]]
            .iter()
            .enumerate()
        {
            head[4 * k..4 * k + 4].copy_from_slice(&x.to_le_bytes());
        }
        let mut h = crc32fast::Hasher::new();
        h.update(&head[..20]);
        let mut body = Vec::with_capacity(4 * values.iter().map(|v| v.len()).sum::<usize>());
        for v in values {
            for x in v {
                body.extend_from_slice(&x.to_le_bytes());
            }
        }
        h.update(&body);
        head[20..].copy_from_slice(&h.finalize().to_le_bytes());
        let path = &self.path;
        let w = self.writer.as_mut().ok_or_else(|| {
            TierError::Helper(format!(
                "chunk file {}: appended after it was sealed",
                path.display()
            ))
        })?;
        let fail = |e: std::io::Error| TierError::Io {
            path: path.clone(),
            op: Op::Write,
            offset,
            len: RECORD_HEADER_BYTES + body.len(),
            source: io_error(&e),
        };
        w.write_all(&head).map_err(fail)?;
        w.write_all(&body).map_err(fail)?;
        self.index.insert((unit, index), Entry { offset, lens });
        self.len += (RECORD_HEADER_BYTES + body.len()) as u64;
        Ok(())
    }

    /// Every record is written: flushes the buffer, after which the file is only read.
    pub fn seal(&mut self) -> Result<(), TierError> {
        if let Some(mut w) = self.writer.take() {
            w.flush().map_err(|e| TierError::Io {
                path: self.path.clone(),
                op: Op::Write,
                offset: self.len,
                len: 0,
                source: io_error(&e),
            })?;
        }
        Ok(())
    }

    /// Chunk (`unit`, `index`)'s values, `None` if the file has no record of it. The file must
    /// be sealed.
    pub fn read(&self, unit: usize, index: usize) -> Result<Option<ChunkValues>, TierError> {
        let Some(e) = self.index.get(&(unit, index)).copied() else {
            return Ok(None);
        };
        if self.writer.is_some() {
            return Err(TierError::Helper(format!(
                "chunk file {}: read before it was sealed",
                self.path.display()
            )));
        }
        let values: usize = e.lens.iter().map(|&l| l as usize).sum();
        let mut buf = vec![0u8; RECORD_HEADER_BYTES + 4 * values];
        self.file
            .read_exact_at(&mut buf, e.offset)
            .map_err(|err| TierError::Io {
                path: self.path.clone(),
                op: Op::Read,
                offset: e.offset,
                len: buf.len(),
                source: io_error(&err),
            })?;
        let word = |at: usize| u32::from_le_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]);
        let mut h = crc32fast::Hasher::new();
        h.update(&buf[..20]);
        h.update(&buf[RECORD_HEADER_BYTES..]);
        let same_head = [word(0), word(4), word(8), word(12), word(16)]
            == [unit as u32, index as u32, e.lens[0], e.lens[1], e.lens[2]];
        if !same_head || h.finalize() != word(20) {
            return Err(TierError::Corrupt {
                path: self.path.clone(),
                offset: e.offset,
                unit,
            });
        }
        let mut at = RECORD_HEADER_BYTES;
        let values = e.lens.map(|l| {
            let v: Vec<f32> = buf[at..at + 4 * l as usize]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            at += 4 * l as usize;
            v
        });
        Ok(Some(values))
    }
}

impl Drop for ChunkFile {
    fn drop(&mut self) {
        self.writer = None;
        super::folder::remove_with_folder(&self.path);
    }
}

fn io_error(e: &std::io::Error) -> IoError {
    match e.raw_os_error() {
        Some(errno) => IoError::from_errno(errno),
        None => IoError::Os(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_read_back_by_chunk_and_damage_is_caught() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("backup.bin");
        let mut f = ChunkFile::create(&path).unwrap();
        f.append(0, 1, [&[1.0, 2.0], &[3.0, 4.0], &[5.0, 6.0]])
            .unwrap();
        f.append(2, 0, [&[7.0], &[], &[]]).unwrap();
        assert!(f.read(0, 1).is_err(), "reads wait for the seal");
        f.seal().unwrap();
        assert_eq!(
            f.read(0, 1).unwrap(),
            Some([vec![1.0, 2.0], vec![3.0, 4.0], vec![5.0, 6.0]])
        );
        assert_eq!(f.read(2, 0).unwrap(), Some([vec![7.0], vec![], vec![]]));
        assert_eq!(f.read(1, 0).unwrap(), None);
        assert_eq!(f.chunks(), 2);
        // One flipped byte in the second record's values.
        let at = f.bytes() - 2;
        let raw = File::options().write(true).open(&path).unwrap();
        raw.write_all_at(&[0xff], at).unwrap();
        let err = f.read(2, 0).unwrap_err().to_string();
        assert!(err.contains("CRC") && err.contains("backup.bin"), "{err}");
        assert!(f.read(0, 1).unwrap().is_some());
        let other = dir.path().join("state.bin");
        std::fs::write(&other, b"x").unwrap();
        drop(f);
        assert!(!path.exists(), "removed with its backup");
        assert!(other.exists(), "a folder with other files stays");
    }
}
