//! The manifest: the one file that makes a checkpoint directory a checkpoint.
//!
//! It is written last, so a directory without one is an interrupted or in-progress save. It
//! records everything a resume needs besides the chunk bytes (progress, shard map, config,
//! optimizer hyper-parameters, data position, the model's parameter names and shapes) and a
//! CRC-32 and byte length for every chunk file and every chunk in it, so a reader can verify a
//! whole file or only the chunks it reads. The manifest carries a CRC-32 of itself
//! (`manifest_crc32`, over the file's bytes with that field's value empty), so an edited or
//! damaged manifest is detected even when it still parses. A reader hashes the bytes as read,
//! never a re-serialization of what it parsed: a manifest written by an older build, which
//! lacks config keys added since (they take their defaults), must still check out.
//!
//! CRC-32 detects accidental damage (bit rot, truncation, a torn write), not tampering.

use std::collections::BTreeSet;
use std::ops::Range;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::CheckpointError;
use crate::config::{OptimizerChoice, TrainConfig};
use crate::engine::coordinator::Progress;
use crate::job::optim_settings;
use crate::model::UnitSpec;
use crate::optim::OptimState;
use crate::plan::{RankId, ShardMap};

/// `format` of every manifest this crate writes.
pub const FORMAT: &str = "elastic-zero-checkpoint";
/// Bumped on any change a reader of the previous version would misread.
pub const FORMAT_VERSION: u32 = 1;
/// The manifest's file name inside a checkpoint directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Suffix of files being written; renamed away once complete and synced.
pub const TMP_SUFFIX: &str = ".tmp";

/// `step-00000120`: the directory name of the checkpoint taken after `step` steps.
pub fn checkpoint_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// The step of a checkpoint directory name, if it is one.
pub fn parse_checkpoint_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// `rank-00003.bin`: the file holding the chunks rank 3 owned when the snapshot was taken.
pub fn rank_file_name(rank: RankId) -> String {
    format!("rank-{rank:05}.bin")
}

/// Optimizer kind and hyper-parameters of the saving run (also in `config`; repeated here so a
/// reader of the manifest alone, e.g. an exporter, needs nothing else).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerRecord {
    pub kind: OptimizerChoice,
    pub lr: f32,
    pub warmup_steps: u64,
    pub min_lr_ratio: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub momentum: f32,
    pub grad_clip: f32,
    /// Optimizer updates applied so far (Adam's bias-correction step).
    pub opt_step: u64,
    /// Per-parameter state vectors kept, e.g. `["exp_avg", "exp_avg_sq"]` for Adam.
    pub state: Vec<String>,
}

/// Where the data stream stands: micro-batches are pure functions of (seed, step, index), so the
/// seed and the next step are the whole position.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataRecord {
    pub seed: u64,
    pub next_step: u64,
    /// One line describing the source, e.g. `markov(seed 0): ...` or `text(path, N bytes)`.
    pub source: String,
    /// SHA-256 of the data file's bytes (absent for the embedded corpus).
    pub sha256: Option<String>,
}

/// One chunk record inside a chunk file: `params` f32 values, then `m`, then `v`, little-endian.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChunkEntry {
    pub unit: u32,
    pub index: u32,
    /// Byte offset of the record in its file.
    pub offset: u64,
    /// Element counts of the three vectors (`m` and `v` are 0 where the optimizer keeps none).
    pub params: u64,
    pub m: u64,
    pub v: u64,
    /// CRC-32 of the record's bytes, 8 lowercase hex digits.
    pub crc32: String,
}

impl ChunkEntry {
    pub fn bytes(&self) -> u64 {
        4 * (self.params + self.m + self.v)
    }
}

/// One chunk file: the chunks one rank owned, in (unit, index) order, back to back.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    pub name: String,
    pub rank: RankId,
    pub bytes: u64,
    /// CRC-32 of the whole file, 8 lowercase hex digits.
    pub crc32: String,
    pub chunks: Vec<ChunkEntry>,
}

/// Everything about a checkpoint except the chunk bytes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// Steps completed (the next step to run); also `progress.step`.
    pub step: u64,
    pub progress: Progress,
    /// The shard map's epoch when the snapshot was taken.
    pub epoch: u64,
    pub world_size: u32,
    pub stage: u8,
    pub created_unix_ms: u64,
    pub config: TrainConfig,
    pub optimizer: OptimizerRecord,
    pub data: DataRecord,
    /// The model's units with their parameter names and shapes, in canonical order.
    pub units: Vec<UnitSpec>,
    pub param_count: u64,
    /// SHA-256 of the consolidated fp32 parameters (as `ezero train` prints it).
    pub param_sha256: String,
    pub shard_map: ShardMap,
    pub files: Vec<FileEntry>,
    /// CRC-32 of the manifest file's bytes with this field's value empty (`""`).
    pub manifest_crc32: String,
}

/// 8 lowercase hex digits.
pub fn crc_hex(crc: u32) -> String {
    format!("{crc:08x}")
}

/// The state vectors an optimizer keeps per parameter, by their PyTorch names.
pub fn optimizer_state_names(cfg: &TrainConfig) -> Vec<String> {
    let probe = OptimState::new(optim_settings(cfg).kind, 1);
    let names: &[&str] = match (probe.m.is_empty(), probe.v.is_empty()) {
        (false, false) => &["exp_avg", "exp_avg_sq"],
        (false, true) => &["momentum_buffer"],
        _ => &[],
    };
    names.iter().map(|s| s.to_string()).collect()
}

impl Manifest {
    /// The manifest as written: pretty JSON with `manifest_crc32` filled in. It is serialized
    /// once with the field empty, hashed, and the checksum is put between the field's quotes:
    /// the reader cuts the value out of the same span (`own_crc_span`) and hashes the rest.
    pub fn encode(&self) -> Result<Vec<u8>, serde_json::Error> {
        let mut body = self.clone();
        body.manifest_crc32 = String::new();
        let mut bytes = serde_json::to_vec_pretty(&body)?;
        bytes.push(b'\n');
        let at = own_crc_span(&bytes)
            .expect("serde writes manifest_crc32 as a plain top-level string")
            .start;
        let crc = crc_hex(crc32fast::hash(&bytes));
        bytes.splice(at..at, crc.into_bytes());
        Ok(bytes)
    }

    /// Parses and checks a manifest file's bytes: JSON shape, its own checksum, the format and
    /// version, and that its parts agree with each other (see [`Manifest::check_structure`]).
    pub fn decode(path: &Path, bytes: &[u8]) -> Result<Manifest, CheckpointError> {
        let m: Manifest = serde_json::from_slice(bytes)
            .map_err(|e| CheckpointError::corrupt(path, format!("not a valid manifest: {e}")))?;
        if m.format != FORMAT {
            return Err(CheckpointError::corrupt(
                path,
                format!("format is `{}`, expected `{FORMAT}`", m.format),
            ));
        }
        if m.version != FORMAT_VERSION {
            return Err(CheckpointError::corrupt(
                path,
                format!(
                    "format version {} is not supported (this build reads version {FORMAT_VERSION})",
                    m.version
                ),
            ));
        }
        let value = own_crc_span(bytes).ok_or_else(|| {
            CheckpointError::corrupt(
                path,
                "cannot find the `manifest_crc32` value in the file's top-level object: the \
                 manifest was edited or damaged; restore it or resume from another checkpoint",
            )
        })?;
        // Exactly the bytes the writer hashed: the file with the value between the quotes cut out.
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&bytes[..value.start]);
        hasher.update(&bytes[value.end..]);
        let want = crc_hex(hasher.finalize());
        if m.manifest_crc32 != want {
            return Err(CheckpointError::corrupt(
                path,
                format!(
                    "manifest checksum mismatch (manifest_crc32 says {}, the file hashes to {want}): \
                     the manifest was edited or damaged; restore it or resume from another checkpoint",
                    m.manifest_crc32
                ),
            ));
        }
        m.check_structure(path)?;
        Ok(m)
    }

    /// Checks that the parts of a manifest agree: the units match the shard map, every chunk of
    /// the map appears exactly once with the right length (so every element of every unit is
    /// covered exactly once), each chunk sits in its owner's file, and each file's records are
    /// back to back from offset 0 to its recorded length.
    pub fn check_structure(&self, path: &Path) -> Result<(), CheckpointError> {
        self.check_header()
            .and_then(|()| self.check_units())
            .and_then(|()| self.check_files())
            .map_err(|what| CheckpointError::corrupt(path, what))
    }

    /// The step, the epoch, the world and the unit count agree with the shard map and progress.
    fn check_header(&self) -> Result<(), String> {
        let map = &self.shard_map;
        if self.step != self.progress.step {
            return Err(format!(
                "step {} disagrees with progress.step {}",
                self.step, self.progress.step
            ));
        }
        if map.chunk_elems == 0 {
            return Err("shard_map.chunk_elems is 0".into());
        }
        if self.epoch != map.epoch || self.world_size as usize != map.members.len() {
            return Err("epoch or world_size disagree with the shard map".into());
        }
        if self.units.len() != map.units.len() || self.progress.grad_bounds.len() != map.units.len()
        {
            return Err(format!(
                "{} units, {} in the shard map, {} gradient bounds",
                self.units.len(),
                map.units.len(),
                self.progress.grad_bounds.len()
            ));
        }
        Ok(())
    }

    /// Each unit's size and chunks match the shard map, and the map covers `param_count`.
    fn check_units(&self) -> Result<(), String> {
        let map = &self.shard_map;
        for (u, (spec, unit)) in self.units.iter().zip(&map.units).enumerate() {
            if spec.numel() != unit.numel {
                return Err(format!(
                    "unit {u} (`{}`) has {} parameters but the shard map gives it {}",
                    spec.name,
                    spec.numel(),
                    unit.numel
                ));
            }
            if unit.owners.len() != unit.numel.div_ceil(map.chunk_elems) {
                return Err(format!("unit {u} has a wrong number of chunks"));
            }
            if let Some(r) = unit.owners.iter().find(|r| !map.members.contains(r)) {
                return Err(format!("unit {u} has a chunk owned by non-member rank {r}"));
            }
        }
        let total: usize = map.total_elems();
        if self.param_count != total as u64 {
            return Err(format!(
                "param_count {} but the shard map covers {total}",
                self.param_count
            ));
        }
        Ok(())
    }

    /// Every chunk of the map is in exactly one file, its owner's, with the right lengths.
    fn check_files(&self) -> Result<(), String> {
        let map = &self.shard_map;
        let state = optimizer_state_names(&self.config).len();
        let mut seen = BTreeSet::new();
        let mut names = BTreeSet::new();
        for f in &self.files {
            if f.name != rank_file_name(f.rank) || !names.insert(f.name.clone()) {
                return Err(format!(
                    "unexpected or repeated chunk file name `{}`",
                    f.name
                ));
            }
            self.check_records(f, state, &mut seen)?;
        }
        let chunks: usize = map.units.iter().map(|u| u.owners.len()).sum();
        if seen.len() != chunks {
            let missing = map
                .units
                .iter()
                .enumerate()
                .flat_map(|(u, unit)| (0..unit.owners.len()).map(move |i| (u, i)))
                .find(|k| !seen.contains(k));
            return Err(format!(
                "{} of {chunks} chunks are listed; chunk {:?} (unit, index) is missing",
                seen.len(),
                missing.unwrap_or_default()
            ));
        }
        Ok(())
    }

    /// `f`'s chunks are the map's, each seen once, owned by `f`'s rank, with `state` optimizer
    /// values each, back to back from offset 0 to the file's recorded length.
    fn check_records(
        &self,
        f: &FileEntry,
        state: usize,
        seen: &mut BTreeSet<(usize, usize)>,
    ) -> Result<(), String> {
        let map = &self.shard_map;
        let mut offset = 0u64;
        for c in &f.chunks {
            let (u, i) = (c.unit as usize, c.index as usize);
            if u >= map.units.len() || i >= map.units[u].owners.len() {
                return Err(format!(
                    "{} lists chunk {u}/{i}, which the shard map does not have",
                    f.name
                ));
            }
            if !seen.insert((u, i)) {
                return Err(format!("chunk {u}/{i} appears more than once"));
            }
            if map.owner(u, i) != f.rank {
                return Err(format!(
                    "chunk {u}/{i} is in {} but the shard map gives it to rank {}",
                    f.name,
                    map.owner(u, i)
                ));
            }
            let n = map.chunk_range(u, i).len() as u64;
            let want_m = if state >= 1 { n } else { 0 };
            let want_v = if state >= 2 { n } else { 0 };
            if (c.params, c.m, c.v) != (n, want_m, want_v) {
                return Err(format!(
                    "chunk {u}/{i} records {}/{}/{} params/m/v elements, expected {n}/{want_m}/{want_v}",
                    c.params, c.m, c.v
                ));
            }
            if c.offset != offset {
                return Err(format!(
                    "chunk {u}/{i} in {} starts at byte {}, expected {offset}",
                    f.name, c.offset
                ));
            }
            offset += c.bytes();
        }
        if offset != f.bytes {
            return Err(format!(
                "{} records {} bytes but its chunks add up to {offset}",
                f.name, f.bytes
            ));
        }
        Ok(())
    }

    /// Total bytes of every chunk file.
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.bytes).sum()
    }
}

/// The byte range of the top-level `manifest_crc32` string's contents (between its quotes) in
/// a manifest file that parsed as JSON, or `None` if the key is not spelled out plainly there.
/// Strings are skipped whole, so the name inside a value or a nested object never matches.
fn own_crc_span(bytes: &[u8]) -> Option<Range<usize>> {
    const KEY: &[u8] = b"\"manifest_crc32\"";
    let skip_ws = |mut i: usize| {
        while bytes.get(i).is_some_and(|b| b.is_ascii_whitespace()) {
            i += 1;
        }
        i
    };
    // The index just past the string that opens at `i`.
    let string_end = |mut i: usize| {
        i += 1;
        while i < bytes.len() {
            match bytes[i] {
                b'\\' => i += 2,
                b'"' => return Some(i + 1),
                _ => i += 1,
            }
        }
        None
    };
    let mut depth = 0usize;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth = depth.checked_sub(1)?,
            b'"' => {
                let end = string_end(i)?;
                let after = skip_ws(end);
                if depth == 1 && &bytes[i..end] == KEY && bytes.get(after) == Some(&b':') {
                    let open = skip_ws(after + 1);
                    if bytes.get(open) != Some(&b'"') {
                        return None;
                    }
                    return Some(open + 1..string_end(open)? - 1);
                }
                i = end;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        assert_eq!(checkpoint_dir_name(120), "step-00000120");
        assert_eq!(parse_checkpoint_dir_name("step-00000120"), Some(120));
        assert_eq!(parse_checkpoint_dir_name("step-"), None);
        assert_eq!(parse_checkpoint_dir_name("step-12.tmp"), None);
        assert_eq!(parse_checkpoint_dir_name("stop-1"), None);
        assert_eq!(rank_file_name(3), "rank-00003.bin");
    }

    #[test]
    fn own_crc_span_finds_only_the_top_level_key() {
        let text = r#"{"a": {"manifest_crc32": "nested"}, "b": ["manifest_crc32"],
            "c": "\"manifest_crc32\": \"in a string\"", "manifest_crc32" : "0badf00d", "d": 1}"#;
        let span = own_crc_span(text.as_bytes()).unwrap();
        assert_eq!(&text[span], "0badf00d");
        let blank = r#"{"manifest_crc32": ""}"#;
        assert_eq!(own_crc_span(blank.as_bytes()), Some(20..20));
        for missing in [
            r#"{"a": {"manifest_crc32": "x"}}"#,
            r#"{"manifest_crc32": 7}"#,
            "{",
        ] {
            assert_eq!(own_crc_span(missing.as_bytes()), None, "{missing}");
        }
    }

    #[test]
    fn optimizer_state_names_follow_the_optimizer() {
        let mut cfg = TrainConfig::default();
        assert_eq!(optimizer_state_names(&cfg), ["exp_avg", "exp_avg_sq"]);
        cfg.optimizer = OptimizerChoice::Sgd;
        assert_eq!(optimizer_state_names(&cfg), ["momentum_buffer"]);
        cfg.momentum = 0.0;
        assert!(optimizer_state_names(&cfg).is_empty());
    }
}
