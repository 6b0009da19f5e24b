//! Resuming from a checkpoint on disk with each rank reading only what it owns.
//!
//! Opening a checkpoint reads and checks the manifest and each chunk file's length, nothing
//! more. Each rank then asks for the chunks it owns under the new map; the records covering
//! them are read with positioned reads, each checked against its CRC-32 before it is decoded.
//! A record that fails is an error naming the file and the chunk, so a damaged checkpoint never
//! becomes training state. Every record is covered by some rank, so a resume that completes has
//! checked every byte of state it uses; the cluster also checks the parameters' SHA-256 once all
//! ranks have read.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::codec::decode_chunk;
use super::error::{CheckpointError, IoContext};
use super::manifest::{ChunkEntry, Manifest};
use super::read::{check_len, check_record, read_manifest};
use super::store;
use crate::engine::coordinator::Progress;
use crate::plan::{ChunkId, ShardMap};
use crate::runtime::step::elastic::resume::{covering, recut, RankRead, ResumeSource};
use crate::runtime::step::state::rank_state::ChunkState;

/// A checkpoint opened for resuming: manifest checked, chunk data not yet read.
#[derive(Debug, Clone)]
pub struct CheckpointSource {
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// Saved chunk (unit, index) to (file position in the manifest, record entry).
    index: BTreeMap<ChunkId, (usize, ChunkEntry)>,
}

impl CheckpointSource {
    /// Opens the checkpoint `dir`: the manifest (its checksum and structure) and every listed
    /// file's presence and length. Reads no chunk data.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let manifest = read_manifest(dir)?;
        let mut index = BTreeMap::new();
        for (at, f) in manifest.files.iter().enumerate() {
            let path = dir.join(&f.name);
            let len = match std::fs::metadata(&path) {
                Ok(m) if m.is_file() => m.len(),
                _ => {
                    return Err(CheckpointError::corrupt(
                        &path,
                        "missing (listed in the manifest)",
                    ))
                }
            };
            check_len(&path, f, len)?;
            for c in &f.chunks {
                let id = ChunkId {
                    unit: c.unit,
                    index: c.index,
                };
                index.insert(id, (at, c.clone()));
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
            index,
        })
    }

    /// Resolves a user's path (a checkpoint or a save directory, see [`store::resolve`]) and
    /// opens it.
    pub fn open_path(path: &Path) -> Result<Self, CheckpointError> {
        Self::open(&store::resolve(path)?)
    }

    /// Reads the saved chunks `ids` (unit, index of the saved map), checking each record's CRC.
    /// Returns them sorted by (unit, index) and the bytes read.
    pub fn read_saved(
        &self,
        ids: &BTreeSet<ChunkId>,
    ) -> Result<(Vec<ChunkState>, u64), CheckpointError> {
        let mut by_file: BTreeMap<usize, Vec<&ChunkEntry>> = BTreeMap::new();
        for id in ids {
            let Some((file, entry)) = self.index.get(id) else {
                return Err(CheckpointError::corrupt(
                    &self.dir.join(super::manifest::MANIFEST_FILE),
                    format!("no file holds chunk {}/{}", id.unit, id.index),
                ));
            };
            by_file.entry(*file).or_default().push(entry);
        }
        let mut out = Vec::with_capacity(ids.len());
        let mut bytes_read = 0;
        for (file, entries) in by_file {
            let path = self.dir.join(&self.manifest.files[file].name);
            let handle = File::open(&path).at(&path, "open")?;
            for c in entries {
                let mut record = vec![0u8; c.bytes() as usize];
                handle
                    .read_exact_at(&mut record, c.offset)
                    .at(&path, "read")?;
                bytes_read += record.len() as u64;
                check_record(&path, c, crc32fast::hash(&record))?;
                out.push(decode_chunk(c, &record));
            }
        }
        out.sort_by_key(|c| (c.unit, c.index));
        Ok((out, bytes_read))
    }
}

impl ResumeSource for CheckpointSource {
    fn progress(&self) -> &Progress {
        &self.manifest.progress
    }

    fn saved_map(&self) -> &ShardMap {
        &self.manifest.shard_map
    }

    fn read(&self, wanted: &[ChunkId], chunk_elems: usize) -> Result<RankRead, String> {
        let old = &self.manifest.shard_map;
        let needed: BTreeSet<ChunkId> = wanted
            .iter()
            .flat_map(|c| {
                covering(old, chunk_elems, c.unit as usize, c.index as usize).map(|oi| ChunkId {
                    unit: c.unit,
                    index: oi as u32,
                })
            })
            .collect();
        let (saved, bytes_read) = self.read_saved(&needed).map_err(|e| e.to_string())?;
        let chunks = wanted
            .iter()
            .map(|c| {
                let (u, i) = (c.unit, c.index);
                recut(old, &saved, chunk_elems, u as usize, i as usize).ok_or_else(|| {
                    format!(
                        "{}: chunk {u}/{i} is not covered by the saved chunks",
                        self.dir.display()
                    )
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(RankRead { chunks, bytes_read })
    }

    fn param_sha256(&self) -> Option<&str> {
        Some(&self.manifest.param_sha256)
    }

    fn describe(&self) -> String {
        format!("checkpoint {}", self.dir.display())
    }
}
