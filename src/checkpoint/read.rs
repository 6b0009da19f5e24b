//! Reading a checkpoint back, checking everything on the way: the manifest's own checksum and
//! structure, every chunk file's length and CRC-32, every chunk's CRC-32, and finally the
//! SHA-256 of the reassembled parameters against the one recorded at save time. A checkpoint
//! that fails any check is never turned into a [`Snapshot`], so training never starts from
//! partial state.
//!
//! Chunk files are read, checked and decoded in parallel, one thread per file (each saving
//! rank's file).

use std::path::{Path, PathBuf};

use super::codec::decode_chunk;
use super::error::{CheckpointError, IoContext};
use super::manifest::{crc_hex, ChunkEntry, FileEntry, Manifest, MANIFEST_FILE, TMP_SUFFIX};
use super::store;
use crate::param_digest::ParamDigest;
use crate::runtime::actors::Snapshot;
use crate::runtime::step::state::rank_state::ChunkState;

/// A checkpoint read and verified.
#[derive(Clone, Debug)]
pub struct Loaded {
    pub dir: PathBuf,
    pub manifest: Manifest,
    pub snapshot: Snapshot,
}

/// Reads and checks `dir/manifest.json` without reading any chunk data.
pub fn read_manifest(dir: &Path) -> Result<Manifest, CheckpointError> {
    if !dir.exists() {
        return Err(CheckpointError::NotFound {
            path: dir.to_path_buf(),
        });
    }
    let path = dir.join(MANIFEST_FILE);
    if !path.is_file() {
        let tmp = dir.join(format!("{MANIFEST_FILE}{TMP_SUFFIX}"));
        let why = if tmp.is_file() {
            format!("no {MANIFEST_FILE}, only {MANIFEST_FILE}{TMP_SUFFIX}")
        } else {
            format!("no {MANIFEST_FILE}")
        };
        return Err(CheckpointError::Incomplete {
            path: dir.to_path_buf(),
            why,
        });
    }
    let bytes = std::fs::read(&path).at(&path, "read")?;
    Manifest::decode(&path, &bytes)
}

/// Reads and verifies the checkpoint `dir` (a checkpoint directory, not a save directory).
///
/// First every chunk file is read whole, one thread per file. Then, in parallel, one thread per
/// file checks its CRCs and decodes its chunks while another hashes the parameters in canonical
/// order straight from the file bytes.
pub fn load(dir: &Path) -> Result<Loaded, CheckpointError> {
    let manifest = read_manifest(dir)?;
    let files = &manifest.files;
    let blobs = std::thread::scope(|s| {
        let readers: Vec<_> = files
            .iter()
            .map(|f| s.spawn(move || read_bytes(dir, f)))
            .collect();
        readers.into_iter().map(join).collect::<Result<Vec<_>, _>>()
    })?;
    let (per_file, sha) = std::thread::scope(|s| {
        let blobs = &blobs;
        let sha = s.spawn(move || params_sha256_of_records(files, blobs));
        let decoders: Vec<_> = files
            .iter()
            .zip(blobs)
            .map(|(f, bytes)| s.spawn(move || decode_file(&dir.join(&f.name), f, bytes)))
            .collect();
        let per_file: Vec<_> = decoders.into_iter().map(join).collect();
        (per_file, join(sha))
    });
    drop(blobs);
    let mut chunks = Vec::with_capacity(files.iter().map(|f| f.chunks.len()).sum());
    for r in per_file {
        chunks.extend(r?);
    }
    chunks.sort_by_key(|c| (c.unit, c.index));
    let sha = sha?;
    if sha != manifest.param_sha256 {
        return Err(CheckpointError::corrupt(
            &dir.join(MANIFEST_FILE),
            format!(
                "the parameters hash to {sha}, the manifest records {}: a chunk file was replaced",
                manifest.param_sha256
            ),
        ));
    }
    let snapshot = Snapshot {
        progress: manifest.progress.clone(),
        map: manifest.shard_map.clone(),
        chunks,
    };
    Ok(Loaded {
        dir: dir.to_path_buf(),
        manifest,
        snapshot,
    })
}

fn join<T>(
    h: std::thread::ScopedJoinHandle<'_, Result<T, CheckpointError>>,
) -> Result<T, CheckpointError> {
    h.join().unwrap_or_else(|_| {
        Err(CheckpointError::Writer(
            "a checkpoint reader thread panicked".into(),
        ))
    })
}

/// The [`param_digest`](crate::param_digest) of the parameters in (unit, index) order, hashed
/// straight from the records' bytes (the little-endian fp32 values it is defined on).
fn params_sha256_of_records(
    files: &[FileEntry],
    blobs: &[Vec<u8>],
) -> Result<String, CheckpointError> {
    let mut parts: Vec<(u32, u32, &[u8])> = files
        .iter()
        .zip(blobs)
        .flat_map(|(f, bytes)| {
            f.chunks.iter().map(move |c| {
                // In bounds: `read_bytes` checked the length that `check_structure` tiled.
                let at = c.offset as usize;
                (c.unit, c.index, &bytes[at..at + 4 * c.params as usize])
            })
        })
        .collect();
    parts.sort_by_key(|p| (p.0, p.1));
    let mut d = ParamDigest::new();
    for (_, _, bytes) in parts {
        d.update_le_bytes(bytes);
    }
    Ok(d.finish())
}

/// Resolves a user's path (see [`store::resolve`]) and loads it.
pub fn load_path(path: &Path) -> Result<Loaded, CheckpointError> {
    load(&store::resolve(path)?)
}

/// Loads the checkpoint `path` means, or, if it fails verification, the newest older complete
/// checkpoint that passes. Returns it with the failures skipped on the way (path and reason).
pub fn load_latest_valid(path: &Path) -> Result<(Loaded, Vec<CheckpointError>), CheckpointError> {
    let mut skipped = Vec::new();
    for dir in store::fallback_candidates(path)? {
        match load(&dir) {
            Ok(l) => return Ok((l, skipped)),
            Err(e) => skipped.push(e),
        }
    }
    Err(skipped
        .pop()
        .unwrap_or_else(|| CheckpointError::NotACheckpoint {
            path: path.to_path_buf(),
        }))
}

/// Refuses a chunk file whose length `len` is not the one the manifest records.
pub(crate) fn check_len(path: &Path, f: &FileEntry, len: u64) -> Result<(), CheckpointError> {
    if len == f.bytes {
        return Ok(());
    }
    let what = if len < f.bytes {
        "truncated"
    } else {
        "longer than recorded"
    };
    Err(CheckpointError::corrupt(
        path,
        format!("{what}: {len} bytes, the manifest records {}", f.bytes),
    ))
}

/// One chunk file read whole, its length checked against the manifest.
fn read_bytes(dir: &Path, f: &FileEntry) -> Result<Vec<u8>, CheckpointError> {
    let path = dir.join(&f.name);
    if !path.is_file() {
        return Err(CheckpointError::corrupt(
            &path,
            "missing (listed in the manifest)",
        ));
    }
    let bytes = std::fs::read(&path).at(&path, "read")?;
    check_len(&path, f, bytes.len() as u64)?;
    Ok(bytes)
}

/// The chunks of one file's bytes, after checking every chunk's CRC and the file's.
fn decode_file(
    path: &Path,
    f: &FileEntry,
    bytes: &[u8],
) -> Result<Vec<ChunkState>, CheckpointError> {
    let mut out = Vec::with_capacity(f.chunks.len());
    let mut whole = crc32fast::Hasher::new();
    for c in &f.chunks {
        // In bounds: `check_structure` made the records tile the file's recorded length.
        let record = &bytes[c.offset as usize..(c.offset + c.bytes()) as usize];
        let mut h = crc32fast::Hasher::new();
        h.update(record);
        whole.combine(&h);
        check_record(path, c, h.finalize())?;
        out.push(decode_chunk(c, record));
    }
    let crc = crc_hex(whole.finalize());
    if crc != f.crc32 {
        return Err(CheckpointError::corrupt(
            path,
            format!(
                "file checksum mismatch: CRC-32 {crc}, the manifest records {}",
                f.crc32
            ),
        ));
    }
    Ok(out)
}

/// Refuses a chunk record whose CRC-32 (`crc`) is not the one the manifest records for it.
pub(crate) fn check_record(path: &Path, c: &ChunkEntry, crc: u32) -> Result<(), CheckpointError> {
    let crc = crc_hex(crc);
    if crc == c.crc32 {
        return Ok(());
    }
    Err(CheckpointError::corrupt(
        path,
        format!(
            "checksum mismatch in chunk {}/{} (bytes {}..{}): CRC-32 {crc}, the manifest records {}",
            c.unit,
            c.index,
            c.offset,
            c.offset + c.bytes(),
            c.crc32
        ),
    ))
}

/// What `verify` found, for `ezero checkpoint verify`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct VerifyReport {
    pub dir: PathBuf,
    pub step: u64,
    pub files: usize,
    pub chunks: usize,
    pub bytes: u64,
    pub param_count: u64,
    pub param_sha256: String,
}

/// Loads `path` (resolved as by `--resume`) and reports what was checked.
pub fn verify(path: &Path) -> Result<VerifyReport, CheckpointError> {
    let l = load_path(path)?;
    Ok(VerifyReport {
        step: l.manifest.step,
        files: l.manifest.files.len(),
        chunks: l.snapshot.chunks.len(),
        bytes: l.manifest.total_bytes(),
        param_count: l.manifest.param_count,
        param_sha256: l.manifest.param_sha256.clone(),
        dir: l.dir,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use sha2::{Digest, Sha256};

    use super::super::codec::encode_chunk;
    use super::*;
    use crate::plan::{ChunkId, ShardMap};
    use crate::runtime::api::cluster::consolidate;

    /// Parameters with the bit patterns a careless digest could fold together: both zeros,
    /// subnormals, infinities and NaNs with different payloads.
    fn awkward_params(numels: &[usize]) -> Vec<Vec<f32>> {
        let special = [
            -0.0,
            0.0,
            f32::MIN_POSITIVE / 4.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::from_bits(0x7fc0_0001),
            f32::from_bits(0xffc0_0002),
            1.0 + f32::EPSILON,
        ];
        numels
            .iter()
            .enumerate()
            .map(|(u, &n)| {
                (0..n)
                    .map(|k| match k % 11 {
                        j if j < special.len() => special[(j + u) % special.len()],
                        _ => (u * 1000 + k) as f32 * 0.37,
                    })
                    .collect()
            })
            .collect()
    }

    /// The digest as the README defines it, written out independently of the crate's code:
    /// SHA-256 of every unit's flat fp32 buffer, units in order, little-endian, as lowercase hex.
    fn spec_digest(params: &[Vec<f32>]) -> String {
        let bytes: Vec<u8> = params
            .iter()
            .flatten()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Each owner rank's chunk file as `save` lays it out (records with their optimizer state,
    /// so that offsets matter), listed in reverse rank order so the reader has to sort.
    fn files_of(map: &ShardMap, chunks: &[ChunkState]) -> (Vec<FileEntry>, Vec<Vec<u8>>) {
        let mut files = Vec::new();
        let mut blobs = Vec::new();
        for &rank in map.members.iter().rev() {
            let mut bytes = Vec::new();
            let mut entries = Vec::new();
            for id in map.owned_chunks(rank) {
                let c = chunks
                    .iter()
                    .find(|c| (c.unit, c.index) == (id.unit, id.index))
                    .unwrap();
                let offset = bytes.len() as u64;
                encode_chunk(c, &mut bytes);
                entries.push(ChunkEntry {
                    unit: c.unit,
                    index: c.index,
                    offset,
                    params: c.params.len() as u64,
                    m: c.m.len() as u64,
                    v: c.v.len() as u64,
                    crc32: String::new(),
                });
            }
            files.push(FileEntry {
                name: format!("rank-{rank}"),
                rank,
                bytes: bytes.len() as u64,
                crc32: String::new(),
                chunks: entries,
            });
            blobs.push(bytes);
        }
        (files, blobs)
    }

    /// Every place that computes `param-sha256` (the run summary, the resume check, the save and
    /// the load) gives the same digest for the same parameters, whatever the chunking.
    #[test]
    fn every_param_sha256_path_gives_the_same_digest() {
        let numels = [10, 0, 7, 33, 1];
        let params = awkward_params(&numels);
        let want = spec_digest(&params);
        for chunk_elems in [1, 3, 4, 100] {
            let map = ShardMap::plan(&numels, &[0, 1, 2], chunk_elems, 1).unwrap();
            let mut chunks = Vec::new();
            for (u, unit) in map.units.iter().enumerate() {
                for i in 0..unit.owners.len() {
                    let p = params[u][map.chunk_range(u, i)].to_vec();
                    chunks.push(ChunkState {
                        unit: u as u32,
                        index: i as u32,
                        m: p.iter().map(|x| x * 0.5).collect(),
                        v: vec![0.25; p.len()],
                        params: p,
                    });
                }
            }
            let by_id: BTreeMap<ChunkId, ChunkState> = chunks
                .iter()
                .map(|c| {
                    let id = ChunkId {
                        unit: c.unit,
                        index: c.index,
                    };
                    (id, c.clone())
                })
                .collect();
            let (files, blobs) = files_of(&map, &chunks);
            let got = [
                (
                    "summary",
                    crate::summary::param_sha256(&consolidate(&map, &chunks)),
                ),
                (
                    "resume",
                    crate::runtime::step::elastic::resume::params_sha256(&by_id),
                ),
                ("save", super::super::write::params_sha256(&chunks)),
                ("load", params_sha256_of_records(&files, &blobs).unwrap()),
            ];
            for (path, digest) in got {
                assert_eq!(digest, want, "{path}, chunk_elems {chunk_elems}");
            }
        }
        let mut flipped = params.clone();
        flipped[3][5] = f32::from_bits(flipped[3][5].to_bits() ^ 1);
        assert_ne!(crate::summary::param_sha256(&flipped), want);
    }
}
