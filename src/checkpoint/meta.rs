//! What a run tells the checkpoint writer once, at start: the config, the model's parameter
//! names and shapes, and the identity of the data. Each snapshot then only adds its progress and
//! chunks, so the writer thread never touches the model or the dataset.

use std::path::Path;

use sha2::{Digest, Sha256};

use super::error::{CheckpointError, IoContext};
use super::manifest::{
    optimizer_state_names, DataRecord, FileEntry, Manifest, OptimizerRecord, FORMAT, FORMAT_VERSION,
};
use crate::config::TrainConfig;
use crate::data::Dataset;
use crate::engine::coordinator::Progress;
use crate::model::{Model, UnitSpec};
use crate::plan::ShardMap;

/// The parts of every manifest of one run that do not change from save to save.
#[derive(Clone, Debug)]
pub struct CheckpointMeta {
    pub config: TrainConfig,
    pub units: Vec<UnitSpec>,
    pub data_source: String,
    /// SHA-256 of the data file (none for the embedded corpus).
    pub data_sha256: Option<String>,
}

impl CheckpointMeta {
    /// Reads the data file once to fingerprint it.
    pub fn new(
        config: &TrainConfig,
        model: &dyn Model,
        data: &Dataset,
    ) -> Result<Self, CheckpointError> {
        Ok(Self {
            config: config.clone(),
            units: model.units(),
            data_source: data.describe(),
            data_sha256: data_sha256(config)?,
        })
    }

    /// The manifest of the snapshot of `progress` under `map`, stored as `files`, whose
    /// parameters hash to `param_sha256`.
    pub fn manifest(
        &self,
        progress: &Progress,
        map: &ShardMap,
        files: Vec<FileEntry>,
        param_sha256: String,
    ) -> Manifest {
        let c = &self.config;
        Manifest {
            format: FORMAT.to_string(),
            version: FORMAT_VERSION,
            step: progress.step,
            progress: progress.clone(),
            epoch: map.epoch,
            world_size: map.members.len() as u32,
            stage: c.stage,
            created_unix_ms: crate::runtime::clock::unix_time().as_millis() as u64,
            config: c.clone(),
            optimizer: OptimizerRecord {
                kind: c.optimizer,
                lr: c.lr,
                warmup_steps: c.warmup_steps,
                min_lr_ratio: c.min_lr_ratio,
                beta1: c.beta1,
                beta2: c.beta2,
                eps: c.eps,
                weight_decay: c.weight_decay,
                momentum: c.momentum,
                grad_clip: c.grad_clip,
                opt_step: progress.opt_step,
                state: optimizer_state_names(c),
            },
            data: DataRecord {
                seed: c.seed,
                next_step: progress.step,
                source: self.data_source.clone(),
                sha256: self.data_sha256.clone(),
            },
            units: self.units.clone(),
            param_count: map.total_elems() as u64,
            param_sha256,
            shard_map: map.clone(),
            files,
            manifest_crc32: String::new(),
        }
    }
}

/// SHA-256 of the config's data file, if it names one.
pub fn data_sha256(config: &TrainConfig) -> Result<Option<String>, CheckpointError> {
    let Some(data) = config.data.as_deref() else {
        return Ok(None);
    };
    let sha = sha256_file(data)?;
    // Tokenized data is the pair: another tokenizer gives other ids from the same text.
    match config.tokenizer_path() {
        Some(t) => Ok(Some(format!("{sha}+tokenizer:{}", sha256_file(&t)?))),
        None => Ok(Some(sha)),
    }
}

fn sha256_file(path: &Path) -> Result<String, CheckpointError> {
    let bytes = std::fs::read(path).at(path, "read the data file")?;
    Ok(Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}
