//! bf16 mixed precision at stages 0-2: ranks keep a bf16 full copy and the fp32 masters of the
//! chunks they own (the paper's layout), so the masters must travel wherever ownership moves.
//! Every path that moves them (leave, join, kill and rollback, the tier, a snapshot resumed at
//! another stage and world size, worker processes) must end with the fixed-world digest.

use crate::common;

use std::path::Path;
use std::process::Command;

use common::procs::{digest, flags_with, reference_digest, run, EZERO};
use common::{run_cfg, small, train_blocking};
use elastic_zero::config::{At, ModelKind, TrainConfig};
use elastic_zero::model::backend::Precision;
use elastic_zero::plan::tier::Offload;
use elastic_zero::runtime::actors::Snapshot;
use elastic_zero::runtime::api::cluster::Observer;
use elastic_zero::runtime::ClusterSpec;

fn at(value: u32, step: u64) -> At {
    At { value, step }
}

fn base() -> TrainConfig {
    TrainConfig {
        steps: 6,
        ranks: 3,
        precision: Precision::Bf16,
        ..small(ModelKind::Gpt)
    }
}

fn sha(cfg: &TrainConfig) -> String {
    run_cfg(cfg)
        .unwrap_or_else(|e| panic!("{cfg:?}: {e}"))
        .param_sha256
}

/// `cfg` with its optimizer state (and under bf16 at stages 0-2 the owned masters) on a tier.
fn on_tier(cfg: &TrainConfig, dir: &Path) -> TrainConfig {
    TrainConfig {
        offload_optimizer: Offload::Nvme,
        nvme_dir: Some(dir.to_path_buf()),
        nvme_record_elems: Some(1024),
        ..cfg.clone()
    }
}

#[test]
fn bf16_masters_move_with_leave_join_and_kill_in_ram_and_on_the_tier() {
    let want = sha(&base());
    let fp32 = sha(&TrainConfig {
        precision: Precision::Fp32,
        ..base()
    });
    assert_ne!(want, fp32);
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    for stage in [0u8, 1, 2] {
        for (leave, join, kill) in [
            (vec![at(1, 2)], vec![], vec![]),
            (vec![], vec![at(2, 3)], vec![]),
            (vec![at(0, 1)], vec![at(1, 3)], vec![at(2, 4)]),
        ] {
            let cfg = TrainConfig {
                stage,
                leave,
                join,
                kill,
                replicate_every: 1,
                ..base()
            };
            assert_eq!(sha(&cfg), want, "stage {stage}: {cfg:?}");
            if stage > 0 {
                let tiered = on_tier(&cfg, dir.path());
                assert_eq!(sha(&tiered), want, "on the tier, stage {stage}: {cfg:?}");
            }
        }
    }
}

#[derive(Default)]
struct Keep(Vec<Snapshot>);

impl Observer for &mut Keep {
    fn on_snapshot(&mut self, s: Snapshot) {
        self.0.push(s);
    }
}

#[test]
fn a_bf16_snapshot_holds_the_masters_and_resumes_at_any_stage_and_world_size() {
    let want = sha(&base());
    for saved_stage in [1u8, 2] {
        let cfg = TrainConfig {
            stage: saved_stage,
            ..base()
        };
        let mut keep = Keep::default();
        let spec = ClusterSpec {
            snapshot_every: 3,
            ..ClusterSpec::from_config(cfg.clone()).unwrap()
        };
        let out = train_blocking(spec, &mut keep).unwrap();
        assert_eq!(out.param_sha256, want, "saving must not disturb training");
        let at3 = keep.0.first().cloned().expect("a snapshot at step 3");
        // The snapshot's parameters are the fp32 masters, not their bf16 copies.
        let bf16_only = at3
            .chunks
            .iter()
            .all(|c| c.params.iter().all(|x| x.to_bits() & 0xffff == 0));
        assert!(!bf16_only, "the snapshot holds bf16-rounded parameters");
        for (ranks, stage) in [(1, 0), (2, 1), (4, 2), (2, 3)] {
            let spec = ClusterSpec {
                resume: Some(at3.clone().into()),
                ..ClusterSpec::from_config(TrainConfig {
                    ranks,
                    stage,
                    ..cfg.clone()
                })
                .unwrap()
            };
            let got = train_blocking(spec, ()).unwrap().param_sha256;
            assert_eq!(
                got, want,
                "saved at stage {saved_stage}, resumed at {ranks} ranks stage {stage}"
            );
        }
    }
}

#[test]
fn bf16_worker_processes_give_the_in_process_digest() {
    for (stage, extra) in [(1u8, vec!["--leave", "1@1"]), (2, vec![])] {
        let mut extra = extra;
        extra.extend(["--precision", "bf16"]);
        let flags = flags_with("gpt", stage, 3, &extra);
        let reference = reference_digest(3, &flags);
        let (code, out, err) = run(Command::new(EZERO)
            .args(["launch", "--nprocs", "3", "--"])
            .args(&flags));
        assert_eq!(code, 0, "stage {stage}: {out}\n{err}");
        assert_eq!(digest(&out), Some(reference), "stage {stage}: {out}");
    }
}
