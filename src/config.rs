//! Typed training configuration, validated once.
//!
//! The same keys come from a TOML file (`--config FILE`) and from command-line flags (flags win).
//! Units are in the names (`chunk_elems`, `collective_timeout_ms`). Unknown keys are errors, not
//! silently ignored, because a misspelt key in a training config is a silent wrong run.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::reduce::ReduceMode;

/// Which built-in model to train.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    Gpt,
    Mlp,
}

/// Which optimizer updates the shards.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerChoice {
    /// Adam with decoupled weight decay (default).
    Adamw,
    /// Adam with L2 weight decay added to the gradient.
    Adam,
    /// SGD with momentum (`momentum`) and L2 weight decay.
    Sgd,
}

/// `VALUE@STEP`, e.g. a rank id or a count and the step it applies at (`--leave 2@5`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct At {
    pub value: u32,
    pub step: u64,
}

impl std::str::FromStr for At {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (v, st) = s
            .split_once('@')
            .ok_or_else(|| format!("`{s}` is not VALUE@STEP (e.g. 2@5)"))?;
        Ok(At {
            value: v
                .trim()
                .parse()
                .map_err(|_| format!("`{v}` in `{s}` is not a whole number"))?,
            step: st
                .trim()
                .parse()
                .map_err(|_| format!("`{st}` in `{s}` is not a step number"))?,
        })
    }
}

impl Serialize for At {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{}@{}", self.value, self.step))
    }
}

impl<'de> Deserialize<'de> for At {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A round between steps, where an injected kill can strike (`--kill-during`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Round {
    /// The chunk moves of a membership change (`--leave`, `--join`).
    Reshard,
    /// A buddy backup (every `replicate_every` steps, and after each reshard).
    Replicate,
    /// The rebuild from backups after a loss (its STEP is the step rolled back to).
    Restore,
}

impl Round {
    const ALL: [Round; 3] = [Round::Reshard, Round::Replicate, Round::Restore];

    /// The round's name in `RANK@STEP:ROUND`.
    fn name(self) -> &'static str {
        match self {
            Round::Reshard => "reshard",
            Round::Replicate => "replicate",
            Round::Restore => "restore",
        }
    }
}

/// `RANK@STEP:ROUND`: the rank vanishes halfway through its part of the first such round
/// before STEP, e.g. `2@5:reshard`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RoundKill {
    pub rank: u32,
    pub step: u64,
    pub round: Round,
}

impl std::str::FromStr for RoundKill {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (at, round) = s
            .split_once(':')
            .ok_or_else(|| format!("`{s}` is not RANK@STEP:ROUND (e.g. 2@5:reshard)"))?;
        let at: At = at.parse()?;
        let round = round.trim();
        let round = Round::ALL
            .into_iter()
            .find(|r| r.name() == round)
            .ok_or_else(|| format!("`{round}` in `{s}` is not reshard, replicate or restore"))?;
        Ok(RoundKill {
            rank: at.value,
            step: at.step,
            round,
        })
    }
}

impl std::fmt::Display for RoundKill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}:{}", self.rank, self.step, self.round.name())
    }
}

impl Serialize for RoundKill {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for RoundKill {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A configuration error: which field, and what would be valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid `{field}`: {message}")]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

impl ConfigError {
    pub fn new(field: &str, message: impl Into<String>) -> Self {
        Self {
            field: field.to_string(),
            message: message.into(),
        }
    }
}

/// Everything a training run needs. Defaults are the `ezero train` demo job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Number of in-process rank actors (default 4).
    pub ranks: u32,
    /// ZeRO stage 0-3 (default 3).
    pub stage: u8,
    /// `gpt` or `mlp` (default gpt).
    pub model: ModelKind,
    /// Transformer blocks (GPT) or hidden layers (MLP) (default 2).
    pub layers: usize,
    /// Model width (default 128).
    pub d_model: usize,
    /// Attention heads; must divide `d_model` (default 4).
    pub heads: usize,
    /// Tokens per sequence (default 64).
    pub seq_len: usize,
    /// Micro-batches per global step; the global batch never depends on the world size
    /// (default 8).
    pub micro_batches: u32,
    /// Sequences per micro-batch (default 4).
    pub micro_batch_size: usize,
    /// Optimizer steps to run (default 150).
    pub steps: u64,
    /// Seed for initialisation and data (default 0).
    pub seed: u64,
    /// Peak learning rate (default 3e-3).
    pub lr: f32,
    /// Linear warm-up steps before cosine decay (default 10).
    pub warmup_steps: u64,
    /// Cosine decays to `lr * min_lr_ratio` at the last step; 1.0 keeps lr constant
    /// (default 0.1).
    pub min_lr_ratio: f32,
    /// `adamw`, `adam` or `sgd` (default adamw).
    pub optimizer: OptimizerChoice,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Weight decay (decoupled for AdamW, L2 for Adam and SGD) (default 0.1).
    pub weight_decay: f32,
    /// SGD momentum (default 0.9).
    pub momentum: f32,
    /// Global gradient-norm clipping threshold; 0 disables (default 1.0).
    pub grad_clip: f32,
    /// `exact` (bit-identical across world sizes, default) or `fast`.
    pub reduce: ReduceMode,
    /// Train on this file's bytes instead of the embedded Markov corpus.
    pub data: Option<PathBuf>,
    /// Write a JSON summary here.
    pub json: Option<PathBuf>,
    /// Elements per shard chunk: the unit of ownership and of rebalancing (default 8192).
    pub chunk_elems: usize,
    /// ZeRO-3: units whose full parameters may be live at once (current + prefetched) (default 2).
    pub max_live_units: usize,
    /// Keep each unit's forward intermediates until its backward instead of recomputing them
    /// from the unit's input (memory for time; the same bits either way) (default false).
    pub keep_activations: bool,
    /// Deadline for any single receive inside a collective (default 30000).
    pub collective_timeout_ms: u64,
    /// Bound on |gradient| for the first step's fixed-point scale; later steps derive it from the
    /// previous step. A step whose gradients exceed it is redone once (default 65536).
    pub initial_grad_bound: f32,
    /// Threads for the optimizer step on each rank (default 1).
    pub optimizer_threads: usize,
    /// Tokens to sample from the trained model at the end (GPT only; default 160).
    pub sample_tokens: usize,
    /// Ranks that drain and leave at the start of a step (`RANK@STEP`).
    pub leave: Vec<At>,
    /// New ranks that join at the start of a step (`COUNT@STEP`); they take the next unused ids.
    pub join: Vec<At>,
    /// Ranks that die abruptly during a step (`RANK@STEP`).
    pub kill: Vec<At>,
    /// Fault injection: ranks that die abruptly halfway through a round between steps
    /// (`RANK@STEP:ROUND`, ROUND one of reshard, replicate, restore).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub kill_during: Vec<RoundKill>,
    /// The world never shrinks below this many ranks (default 1).
    pub min_ranks: u32,
    /// Nor grows beyond this many (default 64).
    pub max_ranks: u32,
    /// Buddy backups of every rank's state at least every this many steps; 0 turns them off,
    /// and then losing a rank stops the run (default 1).
    pub replicate_every: u64,
    /// Directory to save checkpoints in (`step-N/` subdirectories); none: no checkpoints.
    pub save_dir: Option<PathBuf>,
    /// Save a checkpoint after every this many steps and after the last step; 0 saves only on
    /// SIGTERM or SIGINT (default 0). Needs `save_dir`.
    pub save_every: u64,
    /// Complete checkpoints kept in `save_dir`, newest first; 0 keeps all (default 3).
    pub keep_checkpoints: usize,
    /// Fault injection: thousandths of frames the in-process network delivers twice (default 0).
    pub net_duplicate_per_mille: u32,
    /// Fault injection: thousandths of frames it holds back behind the next one (default 0).
    pub net_reorder_per_mille: u32,
    /// Fault injection: thousandths of frames whose first transmission is lost, so they arrive
    /// `net_retransmit_ms` late, as over a reliable transport (default 0).
    pub net_drop_per_mille: u32,
    /// Fault injection: thousandths of frames delivered with a flipped bit; the receiver's
    /// checksum rejects and counts them, and the retransmission follows (default 0).
    pub net_corrupt_per_mille: u32,
    /// Fault injection: every frame is delayed by a uniform 0..=this many ms (default 0).
    pub net_delay_max_ms: u64,
    /// Fault injection: how late a retransmitted frame arrives (default 5).
    pub net_retransmit_ms: u64,
    /// Fault injection: a rank whose every frame is `net_slow_ms` late (default none).
    pub net_slow_rank: Option<u32>,
    /// Fault injection: the extra latency of `net_slow_rank`'s frames (default 0).
    pub net_slow_ms: u64,
    /// Fault injection: the ranks on one side of a network partition (default none). While it
    /// lasts, frames between the two sides wait `net_partition_ms` for the link to heal.
    pub net_partition_ranks: Vec<u32>,
    /// Fault injection: the partition covers each rank's sends numbered
    /// `net_partition_from_frame ..` (counted per sender, so a seed replays it exactly)
    /// (default 0).
    pub net_partition_from_frame: u64,
    /// Fault injection: how many of each rank's sends the partition covers (default 0).
    pub net_partition_frames: u64,
    /// Fault injection: how long a frame across the partition waits (default 0).
    pub net_partition_ms: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            ranks: 4,
            stage: 3,
            model: ModelKind::Gpt,
            layers: 2,
            d_model: 128,
            heads: 4,
            seq_len: 64,
            micro_batches: 8,
            micro_batch_size: 4,
            steps: 150,
            seed: 0,
            lr: 3e-3,
            warmup_steps: 10,
            min_lr_ratio: 0.1,
            optimizer: OptimizerChoice::Adamw,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            momentum: 0.9,
            grad_clip: 1.0,
            reduce: ReduceMode::Exact,
            data: None,
            json: None,
            chunk_elems: 8192,
            max_live_units: 2,
            keep_activations: false,
            collective_timeout_ms: 30_000,
            initial_grad_bound: 65536.0,
            optimizer_threads: 1,
            sample_tokens: 160,
            leave: Vec::new(),
            join: Vec::new(),
            kill: Vec::new(),
            kill_during: Vec::new(),
            min_ranks: 1,
            max_ranks: 64,
            replicate_every: 1,
            save_dir: None,
            save_every: 0,
            keep_checkpoints: 3,
            net_duplicate_per_mille: 0,
            net_reorder_per_mille: 0,
            net_drop_per_mille: 0,
            net_corrupt_per_mille: 0,
            net_delay_max_ms: 0,
            net_retransmit_ms: 5,
            net_slow_rank: None,
            net_slow_ms: 0,
            net_partition_ranks: Vec::new(),
            net_partition_from_frame: 0,
            net_partition_frames: 0,
            net_partition_ms: 0,
        }
    }
}

impl TrainConfig {
    /// Parses a TOML config file's text; unknown keys and wrong types are errors.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(toml_error)
    }

    /// Parses a TOML config file's text over `base`: keys the file sets replace `base`'s, the
    /// others keep `base`'s values (a resumed run starts from the checkpoint's config).
    pub fn from_toml_over(base: &TrainConfig, text: &str) -> Result<Self, ConfigError> {
        let file: toml::Table = toml::from_str(text).map_err(toml_error)?;
        let mut merged =
            toml::Table::try_from(base).map_err(|e| ConfigError::new("config", e.to_string()))?;
        merged.extend(file);
        toml::Value::Table(merged).try_into().map_err(toml_error)
    }

    /// Checks every field once; the runtime trusts a validated config.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = |field: &str, v: usize| {
            if v == 0 {
                Err(ConfigError::new(field, "must be at least 1"))
            } else {
                Ok(())
            }
        };
        if self.ranks == 0 {
            return Err(ConfigError::new(
                "ranks",
                "0 ranks: use 1 or more rank actors",
            ));
        }
        if self.ranks > 256 {
            return Err(ConfigError::new(
                "ranks",
                "at most 256 in-process ranks are supported",
            ));
        }
        if self.stage > 3 {
            return Err(ConfigError::new(
                "stage",
                format!("{} is not a ZeRO stage: use 0, 1, 2 or 3", self.stage),
            ));
        }
        positive("layers", self.layers)?;
        positive("d_model", self.d_model)?;
        positive("seq_len", self.seq_len)?;
        positive("micro_batch_size", self.micro_batch_size)?;
        positive("chunk_elems", self.chunk_elems)?;
        positive("max_live_units", self.max_live_units)?;
        positive("optimizer_threads", self.optimizer_threads)?;
        if self.model == ModelKind::Gpt && (self.heads == 0 || self.d_model % self.heads != 0) {
            return Err(ConfigError::new(
                "heads",
                format!(
                    "{} heads do not divide d_model {}: use a divisor of {}",
                    self.heads, self.d_model, self.d_model
                ),
            ));
        }
        if self.micro_batches == 0 {
            return Err(ConfigError::new("micro_batches", "must be at least 1"));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(ConfigError::new("lr", "must be a positive finite number"));
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return Err(ConfigError::new("min_lr_ratio", "must be within [0, 1]"));
        }
        for (field, b) in [
            ("beta1", self.beta1),
            ("beta2", self.beta2),
            ("momentum", self.momentum),
        ] {
            if !(0.0..1.0).contains(&b) {
                return Err(ConfigError::new(field, "must be within [0, 1)"));
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(ConfigError::new("eps", "must be a positive finite number"));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(ConfigError::new("weight_decay", "must be 0 or positive"));
        }
        if !(self.grad_clip.is_finite() && self.grad_clip >= 0.0) {
            return Err(ConfigError::new("grad_clip", "must be 0 (off) or positive"));
        }
        if !(self.initial_grad_bound.is_finite() && self.initial_grad_bound > 0.0) {
            return Err(ConfigError::new(
                "initial_grad_bound",
                "must be a positive finite number",
            ));
        }
        for (field, rate) in [
            ("net_duplicate_per_mille", self.net_duplicate_per_mille),
            ("net_reorder_per_mille", self.net_reorder_per_mille),
            ("net_drop_per_mille", self.net_drop_per_mille),
            ("net_corrupt_per_mille", self.net_corrupt_per_mille),
        ] {
            if rate > 1000 {
                return Err(ConfigError::new(
                    field,
                    "fault rates are thousandths: 0 to 1000",
                ));
            }
        }
        // Injected latency far beyond the collective deadline would only turn into timeouts.
        for (field, ms) in [
            ("net_delay_max_ms", self.net_delay_max_ms),
            ("net_retransmit_ms", self.net_retransmit_ms),
            ("net_slow_ms", self.net_slow_ms),
            ("net_partition_ms", self.net_partition_ms),
        ] {
            if ms > self.collective_timeout_ms / 4 {
                return Err(ConfigError::new(
                    field,
                    format!(
                        "{ms} ms is more than a quarter of collective_timeout_ms ({}): lower it or raise the timeout",
                        self.collective_timeout_ms
                    ),
                ));
            }
        }
        self.validate_partition()?;
        if self.collective_timeout_ms == 0 {
            return Err(ConfigError::new(
                "collective_timeout_ms",
                "must be at least 1",
            ));
        }
        self.validate_membership()?;
        if let Some(k) = self.kill_during.iter().find(|k| k.step >= self.steps) {
            return Err(ConfigError::new(
                "kill_during",
                format!("{k}: the run has only {} steps", self.steps),
            ));
        }
        if self.save_every > 0 && self.save_dir.is_none() {
            return Err(ConfigError::new(
                "save_every",
                "saving every N steps needs save_dir (--save-dir DIR)",
            ));
        }
        if let Some(path) = &self.data {
            if !path.is_file() {
                return Err(ConfigError::new(
                    "data",
                    format!("{} does not exist or is not a file", path.display()),
                ));
            }
        }
        Ok(())
    }

    /// Plays the membership script forward and refuses one that names a rank that is not a
    /// member at that step, leaves the world outside [min_ranks, max_ranks], or acts after the
    /// last step.
    fn validate_partition(&self) -> Result<(), ConfigError> {
        let r = &self.net_partition_ranks;
        if let Some(&big) = r.iter().find(|&&x| x >= 64) {
            return Err(ConfigError::new(
                "net_partition_ranks",
                format!("rank {big}: the simulated partition takes ranks 0 to 63"),
            ));
        }
        let on = !r.is_empty() || self.net_partition_frames > 0 || self.net_partition_ms > 0;
        if on && (r.is_empty() || self.net_partition_frames == 0 || self.net_partition_ms == 0) {
            return Err(ConfigError::new(
                "net_partition_ranks",
                "a partition needs net_partition_ranks (one side), net_partition_frames and net_partition_ms, all non-empty/non-zero",
            ));
        }
        Ok(())
    }

    fn validate_membership(&self) -> Result<(), ConfigError> {
        if self.min_ranks == 0 || self.min_ranks > self.max_ranks {
            return Err(ConfigError::new(
                "min_ranks",
                "must be at least 1 and at most max_ranks",
            ));
        }
        if self.ranks > self.max_ranks {
            return Err(ConfigError::new(
                "ranks",
                format!("{} exceeds max_ranks {}", self.ranks, self.max_ranks),
            ));
        }
        let mut members: Vec<u32> = (0..self.ranks).collect();
        let mut next = self.ranks;
        let mut steps: Vec<u64> = self
            .leave
            .iter()
            .chain(&self.join)
            .chain(&self.kill)
            .map(|a| a.step)
            .collect();
        steps.sort_unstable();
        steps.dedup();
        for step in steps {
            let field = |f: &str, a: &At, why: String| {
                ConfigError::new(f, format!("{}@{}: {why}", a.value, a.step))
            };
            for a in self
                .leave
                .iter()
                .chain(&self.kill)
                .filter(|a| a.step == step)
            {
                let f = if self.leave.contains(a) {
                    "leave"
                } else {
                    "kill"
                };
                if a.step >= self.steps {
                    return Err(field(
                        f,
                        a,
                        format!("the run has only {} steps", self.steps),
                    ));
                }
                if !members.contains(&a.value) {
                    return Err(field(
                        f,
                        a,
                        format!(
                            "rank {} is not a member then (members: {members:?})",
                            a.value
                        ),
                    ));
                }
                members.retain(|&m| m != a.value);
            }
            for a in self.join.iter().filter(|a| a.step == step) {
                if a.step >= self.steps {
                    return Err(field(
                        "join",
                        a,
                        format!("the run has only {} steps", self.steps),
                    ));
                }
                members.extend(next..next + a.value);
                next += a.value;
            }
            if members.len() < self.min_ranks as usize {
                return Err(ConfigError::new(
                    "leave",
                    format!(
                        "at step {step} the world would shrink to {} ranks, below min_ranks {}",
                        members.len(),
                        self.min_ranks
                    ),
                ));
            }
            if members.len() > self.max_ranks as usize {
                return Err(ConfigError::new(
                    "join",
                    format!(
                        "at step {step} the world would grow to {} ranks, above max_ranks {}",
                        members.len(),
                        self.max_ranks
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Tokens in one global batch.
    pub fn tokens_per_step(&self) -> usize {
        self.micro_batches as usize * self.micro_batch_size * self.seq_len
    }
}

fn toml_error(e: toml::de::Error) -> ConfigError {
    let msg = e.message().to_string();
    let field = unknown_field(&msg).unwrap_or_else(|| "config".to_string());
    ConfigError::new(&field, msg.replace('\n', " "))
}

fn unknown_field(msg: &str) -> Option<String> {
    let rest = msg.split("unknown field `").nth(1)?;
    Some(rest.split('`').next()?.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid() {
        TrainConfig::default().validate().unwrap();
    }

    #[test]
    fn unknown_key_names_the_key() {
        let err = TrainConfig::from_toml("ranks = 2\nstagee = 3\n").unwrap_err();
        assert_eq!(err.field, "stagee");
    }

    #[test]
    fn toml_round_trip_and_partial_files() {
        let cfg = TrainConfig::from_toml("stage = 1\nmodel = \"mlp\"\nreduce = \"fast\"").unwrap();
        assert_eq!(
            (cfg.stage, cfg.model, cfg.reduce),
            (1, ModelKind::Mlp, ReduceMode::Fast)
        );
        assert_eq!(cfg.ranks, TrainConfig::default().ranks);
    }

    #[test]
    fn bad_values_name_the_field() {
        let bad = |f: fn(&mut TrainConfig)| {
            let mut c = TrainConfig::default();
            f(&mut c);
            c.validate().unwrap_err().field
        };
        assert_eq!(bad(|c| c.stage = 4), "stage");
        assert_eq!(bad(|c| c.ranks = 0), "ranks");
        assert_eq!(bad(|c| c.heads = 3), "heads");
        assert_eq!(bad(|c| c.data = Some("/nonexistent/file".into())), "data");
        assert_eq!(bad(|c| c.micro_batches = 0), "micro_batches");
        assert_eq!(bad(|c| c.save_every = 5), "save_every");
        assert_eq!(bad(|c| c.leave = vec!["7@1".parse().unwrap()]), "leave");
        assert_eq!(bad(|c| c.leave = vec!["1@500".parse().unwrap()]), "leave");
        assert_eq!(
            bad(|c| {
                c.max_ranks = 5;
                c.join = vec!["2@3".parse().unwrap()]
            }),
            "join"
        );
        assert_eq!(
            bad(|c| {
                c.min_ranks = 4;
                c.kill = vec!["0@3".parse().unwrap()]
            }),
            "leave"
        );
        assert_eq!(
            bad(|c| c.net_partition_ranks = vec![1]),
            "net_partition_ranks"
        );
        assert_eq!(
            bad(|c| {
                c.net_partition_ranks = vec![64];
                c.net_partition_frames = 10;
                c.net_partition_ms = 2;
            }),
            "net_partition_ranks"
        );
        assert_eq!(
            bad(|c| {
                c.net_partition_ranks = vec![1];
                c.net_partition_frames = 10;
                c.net_partition_ms = 60_000;
            }),
            "net_partition_ms"
        );
    }

    #[test]
    fn a_file_over_a_base_keeps_the_base_where_silent() {
        let base = TrainConfig {
            d_model: 16,
            lr: 1.25e-3,
            save_dir: Some("ck".into()),
            leave: vec![At { value: 1, step: 3 }],
            ..TrainConfig::default()
        };
        let c = TrainConfig::from_toml_over(&base, "ranks = 2\n").unwrap();
        assert_eq!(
            c,
            TrainConfig {
                ranks: 2,
                ..base.clone()
            }
        );
        let err = TrainConfig::from_toml_over(&base, "bogus = 1\n").unwrap_err();
        assert_eq!(err.field, "bogus");
    }

    #[test]
    fn membership_script_parses_from_toml() {
        let c = TrainConfig::from_toml("leave = [\"1@3\"]\njoin = [\"2@5\"]\n").unwrap();
        assert_eq!(c.leave, vec![At { value: 1, step: 3 }]);
        assert_eq!(c.join, vec![At { value: 2, step: 5 }]);
        c.validate().unwrap();
        // A joiner (rank 4) may leave later.
        let c = TrainConfig {
            leave: vec![At { value: 4, step: 7 }],
            ..c
        };
        c.validate().unwrap();
    }
}
