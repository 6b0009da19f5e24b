//! Whether a checkpoint may resume a run with a given config and model.
//!
//! Resuming continues the saved run bit for bit, so every setting that decides the numbers must
//! be the saved one. The settings that only decide *how* the same numbers are computed or
//! reported may change: that is what makes a checkpoint loadable at any world size and stage.
//! Any config key not in [`MAY_CHANGE`] must match, so a key added later is protected by default.
//!
//! The run's length is not among the numbers of the steps already run: `steps` may change where
//! the learning rate of every step does not depend on it (a constant schedule after warm-up),
//! and the schedule's keys ([`SCHEDULE`]) may change when the resumed run asks for a new
//! schedule explicitly (`--reschedule`).

use std::path::Path;

use super::error::CheckpointError;
use super::manifest::{Manifest, MANIFEST_FILE};
use crate::config::TrainConfig;
use crate::model::UnitSpec;

/// Config keys a resumed run may set differently from the saved run.
pub const MAY_CHANGE: &[&str] = &[
    "ranks",
    "stage",
    "chunk_elems",
    "max_live_units",
    "keep_activations",
    "activation_checkpointing",
    "collective_timeout_ms",
    "optimizer_threads",
    "compute_threads",
    "sample_tokens",
    "json",
    // What is measured and logged beside the run changes none of its numbers.
    "eval_data",
    "eval_every",
    "metrics_file",
    "save_dir",
    "save_every",
    "keep_checkpoints",
    // The path may differ; the file's bytes may not (compared by SHA-256 below).
    "data",
    // Membership (scripted changes, faults, bounds, backups) never changes the numbers.
    "leave",
    "join",
    "kill",
    // Kills inside a reshard, backup or restore round: the survivors redo it from committed
    // state (tests/elastic.rs checks the result is the fault-free one).
    "kill_during",
    "min_ranks",
    "max_ranks",
    "replicate_every",
    // Fault injection in the in-process network never changes the numbers either.
    "net_duplicate_per_mille",
    "net_reorder_per_mille",
    "net_drop_per_mille",
    "net_corrupt_per_mille",
    "net_delay_max_ms",
    "net_retransmit_ms",
    "net_slow_rank",
    "net_slow_ms",
    "net_partition_ranks",
    "net_partition_from_frame",
    "net_partition_frames",
    "net_partition_ms",
    // Where state lives (RAM or the NVMe tier) and how it is streamed change no bits
    // (tests/offload.rs); they belong to the machine that runs.
    "offload_optimizer",
    "offload_params",
    "offload_grads",
    "nvme_dir",
    "nvme_buffered",
    "nvme_queue_depth",
    "nvme_block_bytes",
    "nvme_record_elems",
    "memory_max_bytes",
    // The device computes with the host's kernels and reduces exactly on the host
    // (tests/device.rs).
    "device",
    "device_memory_max_bytes",
    "sim_link_gbps",
    "nvme_fault",
];

/// The learning-rate schedule's keys: a resumed run changes them only with `reschedule`.
pub const SCHEDULE: &[&str] = &["lr", "warmup_steps", "min_lr_ratio", "steps"];

/// Refuses, naming every difference that decides the numbers, unless `manifest` can resume a
/// run of `cfg` on a model with `units` over data whose file hashes to `data_sha256`;
/// `reschedule`: the run asks for a new learning-rate schedule.
pub fn check_resume(
    dir: &Path,
    manifest: &Manifest,
    cfg: &TrainConfig,
    units: &[UnitSpec],
    data_sha256: Option<&str>,
    reschedule: bool,
) -> Result<(), CheckpointError> {
    let path = dir.join(MANIFEST_FILE);
    check_units(&path, &manifest.units, units)?;
    check_config(&path, &manifest.config, cfg, reschedule)?;
    // Equal: nothing left to run, the checkpoint's parameters are the result.
    if cfg.steps < manifest.step {
        return Err(CheckpointError::incompatible(
            &path,
            format!(
                "`steps` is {} but the checkpoint is already at step {}: give --steps at least \
                 that, the total the resumed run reaches",
                cfg.steps, manifest.step
            ),
        ));
    }
    if manifest.data.sha256.as_deref() != data_sha256 {
        let show = |s: Option<&str>| {
            s.map_or("the embedded corpus".to_string(), |h| {
                format!("a file with SHA-256 {h}")
            })
        };
        return Err(CheckpointError::incompatible(
            &path,
            format!(
                "the checkpoint was trained on {}, this run reads {}",
                show(manifest.data.sha256.as_deref()),
                show(data_sha256)
            ),
        ));
    }
    Ok(())
}

/// The model's parameters must have the saved names and shapes, in the saved order.
pub fn check_units(
    path: &Path,
    saved: &[UnitSpec],
    here: &[UnitSpec],
) -> Result<(), CheckpointError> {
    let flat = |units: &[UnitSpec]| -> Vec<(String, Vec<usize>)> {
        units
            .iter()
            .flat_map(|u| u.params.iter().map(|p| (p.name.clone(), p.shape.clone())))
            .collect()
    };
    let (a, b) = (flat(saved), flat(here));
    for (k, (s, h)) in a.iter().zip(&b).enumerate() {
        if s != h {
            return Err(CheckpointError::incompatible(
                path,
                format!(
                    "the checkpoint belongs to another model: parameter {k} is `{}` {:?} in the checkpoint, `{}` {:?} in this model",
                    s.0, s.1, h.0, h.1
                ),
            ));
        }
    }
    if a.len() != b.len() || saved.len() != here.len() {
        return Err(CheckpointError::incompatible(
            path,
            format!(
                "the checkpoint belongs to another model: {} parameters in {} units, this model has {} in {}",
                a.len(),
                saved.len(),
                b.len(),
                here.len()
            ),
        ));
    }
    Ok(())
}

fn check_config(
    path: &Path,
    saved: &TrainConfig,
    here: &TrainConfig,
    reschedule: bool,
) -> Result<(), CheckpointError> {
    let as_map = |c: &TrainConfig| match serde_json::to_value(c) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        _ => Err(CheckpointError::incompatible(
            path,
            "cannot compare configs",
        )),
    };
    let (a, b) = (as_map(saved)?, as_map(here)?);
    // Under a constant schedule no step's learning rate depends on the run's length.
    let constant = saved.min_lr_ratio >= 1.0 && here.min_lr_ratio >= 1.0;
    let mut refused = Vec::new();
    let mut schedule_refused = false;
    for (key, was) in &a {
        let now = b.get(key).unwrap_or(&serde_json::Value::Null);
        if was == now || MAY_CHANGE.contains(&key.as_str()) {
            continue;
        }
        if SCHEDULE.contains(&key.as_str()) {
            if reschedule || (key == "steps" && constant) {
                continue;
            }
            schedule_refused = true;
        }
        refused.push(format!("`{key}` is {was} in the checkpoint but {now} here"));
    }
    if refused.is_empty() {
        return Ok(());
    }
    Err(CheckpointError::incompatible(
        path,
        format!(
            "{}: a resumed run keeps what decides the model, the data order and the learning \
             rate of its steps{}",
            refused.join(", "),
            if schedule_refused {
                "; to continue under a new learning-rate schedule pass --reschedule (a \
                 constant schedule, --lr-schedule constant, may change --steps without it)"
            } else {
                ""
            }
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_listed_keys_may_change() {
        let p = Path::new("ck/manifest.json");
        let saved = TrainConfig::default();
        let ok = TrainConfig {
            ranks: 1,
            stage: 1,
            chunk_elems: 7,
            ..saved.clone()
        };
        check_config(p, &saved, &ok, false).unwrap();
        // A run saved with an injected kill may resume with another or none (a resume drops
        // kills of steps already run).
        let killed = TrainConfig {
            faults: crate::config::Faults {
                kill_during: vec!["1@2:reshard".parse().unwrap()],
                ..Default::default()
            },
            ..saved.clone()
        };
        for other in [vec![], vec!["0@9:restore".parse().unwrap()]] {
            let here = TrainConfig {
                faults: crate::config::Faults {
                    kill_during: other,
                    ..Default::default()
                },
                ..saved.clone()
            };
            check_config(p, &killed, &here, false).unwrap();
        }
        let bad = TrainConfig {
            steps: saved.steps + 1,
            ..saved.clone()
        };
        let err = check_config(p, &saved, &bad, false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`steps`") && err.contains("--reschedule"),
            "{err}"
        );
        check_config(p, &saved, &bad, true).unwrap();
    }

    #[test]
    fn a_constant_schedule_may_change_its_length_and_only_differences_are_named() {
        let p = Path::new("ck/manifest.json");
        let saved = TrainConfig {
            min_lr_ratio: 1.0,
            ..TrainConfig::default()
        };
        let longer = TrainConfig {
            steps: saved.steps * 2,
            ..saved.clone()
        };
        check_config(p, &saved, &longer, false).unwrap();
        let other = TrainConfig {
            seed: 7,
            d_model: 64,
            lr: 1e-4,
            ..longer
        };
        let err = check_config(p, &saved, &other, false)
            .unwrap_err()
            .to_string();
        for key in ["`seed`", "`d_model`", "`lr`", "--reschedule"] {
            assert!(err.contains(key), "{key} in {err}");
        }
        assert!(
            !err.contains("`steps`") && !err.contains("chunk_elems"),
            "{err}"
        );
        let err = check_config(p, &saved, &other, true)
            .unwrap_err()
            .to_string();
        assert!(!err.contains("`lr`") && err.contains("`seed`"), "{err}");
    }
}
