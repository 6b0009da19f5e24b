//! The device tier on the simulated device (`--device sim`): the same bits as the host run,
//! device memory within its budget, and copy accounting that matches the plan.

use crate::common::{run_cfg, small, train_blocking};
use elastic_zero::config::{At, DeviceChoice, ModelKind, TrainConfig};
use elastic_zero::job::{build_model, device_demand};
use elastic_zero::model::backend::{DeviceCounters, Precision};
use elastic_zero::plan::device::{bytes_per_step, place_device};
use elastic_zero::runtime::{ClusterSpec, TrainOutcome};

fn on_sim(cfg: &TrainConfig, device_bytes: u64) -> TrainConfig {
    TrainConfig {
        device: DeviceChoice::Sim,
        device_memory_max_bytes: Some(device_bytes),
        ..cfg.clone()
    }
}

/// Every rank's device report of every step.
fn device_reports(out: &TrainOutcome) -> Vec<DeviceCounters> {
    out.records
        .iter()
        .flat_map(|r| &r.reports)
        .map(|r| r.device.expect("a rank on a device reports it"))
        .collect()
}

#[test]
fn the_simulated_device_trains_the_host_runs_bits_at_every_stage_world_size_and_precision() {
    for precision in [Precision::Fp32, Precision::Bf16] {
        for stage in [1, 2, 3] {
            for ranks in [1, 2, 3] {
                let cfg = TrainConfig {
                    ranks,
                    stage,
                    precision,
                    steps: 2,
                    ..small(ModelKind::Gpt)
                };
                let host = run_cfg(&cfg).unwrap();
                let dev = run_cfg(&on_sim(&cfg, 16 << 20)).unwrap();
                let what = format!("{precision:?} stage {stage}, {ranks} ranks");
                assert_eq!(dev.param_sha256, host.param_sha256, "{what}");
                let reports = device_reports(&dev);
                assert_eq!(reports.len(), (ranks as u64 * cfg.steps) as usize, "{what}");
                assert!(reports.iter().all(|d| d.h2d_bytes > 0 && d.d2h_bytes > 0));
                // Everything the step put on the device was freed by its end.
                assert!(reports.iter().all(|d| d.resident_bytes == 0), "{what}");
            }
        }
    }
}

#[test]
fn a_rank_leaving_and_one_joining_keep_the_host_runs_bits_on_the_device() {
    let cfg = TrainConfig {
        ranks: 3,
        stage: 3,
        steps: 4,
        leave: vec![At { value: 1, step: 2 }],
        join: vec![At { value: 1, step: 3 }],
        ..small(ModelKind::Gpt)
    };
    let host = run_cfg(&cfg).unwrap();
    let dev = run_cfg(&on_sim(&cfg, 16 << 20)).unwrap();
    assert_eq!(dev.param_sha256, host.param_sha256);
}

#[test]
fn a_model_eight_times_the_device_trains_within_its_budget() {
    let cfg = TrainConfig {
        ranks: 1,
        stage: 3,
        layers: 12,
        d_model: 64,
        max_live_units: 1,
        steps: 2,
        micro_batches: 2,
        micro_batch_size: 1,
        ..small(ModelKind::Gpt)
    };
    let model = build_model(&cfg).unwrap();
    let params: usize = model.units().iter().map(|u| u.numel()).sum();
    // fp32 parameters, Adam's m and v, and the exact gradient (8 bytes) on the host.
    let state_bytes = params as u64 * (4 + 8 + 8);
    let budget = state_bytes / 8;
    let dev = run_cfg(&on_sim(&cfg, budget)).unwrap();
    assert_eq!(dev.param_sha256, run_cfg(&cfg).unwrap().param_sha256);
    let peak = device_reports(&dev)
        .iter()
        .map(|d| d.peak_bytes)
        .max()
        .unwrap();
    assert!(
        peak > 0 && peak <= budget,
        "peak {peak} of a {budget}-byte device"
    );
}

#[test]
fn a_device_too_small_is_refused_before_training_with_the_size_that_fits() {
    let cfg = on_sim(
        &TrainConfig {
            ranks: 1,
            ..small(ModelKind::Gpt)
        },
        1 << 20,
    );
    let cfg = TrainConfig {
        d_model: 256,
        ..cfg
    };
    let err = run_cfg(&cfg).err().expect("refused").to_string();
    assert!(err.contains("--device-memory-max"), "{err}");
}

#[test]
fn copies_and_waits_add_up_to_the_plan() {
    for (stage, precision) in [(3, Precision::Bf16), (1, Precision::Fp32)] {
        let cfg = on_sim(
            &TrainConfig {
                ranks: 2,
                stage,
                precision,
                steps: 2,
                // A slow link, so that copies take time the step can hide or wait for.
                sim_link_gbps: 0.05,
                ..small(ModelKind::Gpt)
            },
            16 << 20,
        );
        let out = run_cfg(&cfg).unwrap();
        let model = build_model(&cfg).unwrap();
        let d = device_demand(&cfg, model.as_ref(), 0);
        let plan = place_device(&d, 16 << 20).unwrap();
        let (h2d, d2h) = bytes_per_step(&d);
        assert_eq!(
            (plan.h2d_bytes_per_step, plan.d2h_bytes_per_step),
            (h2d, d2h)
        );
        for rec in &out.records {
            assert_eq!(rec.attempts, 1, "no overflow redo in this run");
            for r in &rec.reports {
                let dev = r.device.unwrap();
                // Three micro-batches a rank: the plan's per-step bytes exactly.
                assert_eq!((dev.h2d_bytes, dev.d2h_bytes), (h2d, d2h), "stage {stage}");
                assert!(dev.copy_wait_s >= 0.0 && dev.copy_wait_s <= r.busy_s);
                assert!(dev.link_busy_s <= r.busy_s + 0.05);
                let link_s = (h2d + d2h) as f64 / (cfg.sim_link_gbps * 1e9);
                assert!(
                    dev.link_busy_s >= link_s * 0.99,
                    "the link moved at its rate"
                );
            }
        }
    }
}

#[test]
fn the_cli_reports_the_device_and_refuses_one_too_small_with_exit_2() {
    use crate::common::ezero::ezero;
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("s.json");
    let small = [
        "train",
        "--layers",
        "2",
        "--d-model",
        "32",
        "--seq-len",
        "16",
        "--steps",
        "2",
        "--ranks",
        "2",
        "--sample-tokens",
        "0",
        "--device",
        "sim",
    ];
    let j = json.display().to_string();
    let run = ezero(&[&small[..], &["--device-memory-max", "16MiB", "--json", &j]].concat());
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(
        run.stdout.contains("host: masters+optimizer"),
        "{}",
        run.stdout
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let d = &v["device"];
    assert_eq!(d["kind"], "sim");
    let peak = d["peak_bytes"].as_u64().unwrap();
    assert!(peak > 0 && peak <= 16 << 20);
    assert_eq!(d["h2d_bytes_per_step"], d["planned_h2d_bytes_per_step"]);
    assert_eq!(d["d2h_bytes_per_step"], d["planned_d2h_bytes_per_step"]);
    let host = ezero(&small[..13]);
    assert_eq!(run.sha(), host.sha());
    let tiny = ezero(
        &[
            &small[..],
            &["--device-memory-max", "1MiB", "--micro-batch-size", "32"],
        ]
        .concat(),
    );
    crate::common::ezero::refused(&tiny, "--device-memory-max", "device cannot hold");
}

#[test]
fn the_device_keeps_the_host_runs_bits_with_state_on_the_nvme_tier() {
    use crate::offload::{offloaded, tier_dir};
    for (stage, params, grads) in [(2, false, false), (3, true, true)] {
        let dir = tier_dir();
        let cfg = offloaded(
            &TrainConfig {
                ranks: 2,
                stage,
                steps: 2,
                grad_clip: 0.0,
                ..small(ModelKind::Gpt)
            },
            dir.path(),
            params,
            grads,
        );
        let host = run_cfg(&cfg).unwrap();
        let dev = run_cfg(&on_sim(&cfg, 16 << 20)).unwrap();
        assert_eq!(dev.param_sha256, host.param_sha256, "stage {stage}");
        assert!(device_reports(&dev).iter().all(|d| d.h2d_bytes > 0));
    }
}

#[test]
fn a_killed_rank_is_recovered_with_the_host_runs_bits_on_the_device() {
    let cfg = TrainConfig {
        ranks: 3,
        stage: 3,
        steps: 4,
        kill: vec![At { value: 2, step: 2 }],
        ..small(ModelKind::Gpt)
    };
    let host = run_cfg(&cfg).unwrap();
    let dev = run_cfg(&on_sim(&cfg, 16 << 20)).unwrap();
    assert_eq!(dev.param_sha256, host.param_sha256);
}

#[derive(Default)]
struct Snapshots(Vec<elastic_zero::runtime::actors::Snapshot>);

impl elastic_zero::runtime::api::cluster::Observer for &mut Snapshots {
    fn on_snapshot(&mut self, s: elastic_zero::runtime::actors::Snapshot) {
        self.0.push(s);
    }
}

#[test]
fn a_host_runs_snapshot_resumes_on_devices_at_another_world_size_with_the_same_bits() {
    use crate::common::train_blocking;
    use elastic_zero::runtime::ClusterSpec;
    let base = TrainConfig {
        steps: 4,
        ranks: 2,
        stage: 3,
        ..small(ModelKind::Gpt)
    };
    let mut snaps = Snapshots::default();
    let spec = ClusterSpec {
        snapshot_every: 2,
        ..ClusterSpec::from_config(base.clone()).unwrap()
    };
    let want = train_blocking(spec, &mut snaps).unwrap().param_sha256;
    let snap = snaps.0.remove(0);
    assert_eq!(snap.progress.step, 2);
    let cfg = on_sim(&TrainConfig { ranks: 3, ..base }, 16 << 20);
    let spec = ClusterSpec {
        resume: Some(snap.into()),
        ..ClusterSpec::from_config(cfg).unwrap()
    };
    let resumed = train_blocking(spec, &mut Snapshots::default()).unwrap();
    assert_eq!(resumed.records.first().map(|r| r.step), Some(2));
    assert!(device_reports(&resumed).iter().all(|d| d.h2d_bytes > 0));
    assert_eq!(resumed.param_sha256, want);
}

#[test]
fn offload_cpu_means_host_memory_beside_a_device() {
    use elastic_zero::plan::tier::Offload;
    let cfg = TrainConfig {
        ranks: 1,
        steps: 1,
        offload_optimizer: Offload::Cpu,
        ..small(ModelKind::Gpt)
    };
    let refused = run_cfg(&cfg).err().expect("refused without a device");
    assert!(refused.to_string().contains("--device sim"), "{refused}");
    let want = run_cfg(&TrainConfig {
        offload_optimizer: Offload::None,
        ..cfg.clone()
    })
    .unwrap();
    let dev = run_cfg(&on_sim(&cfg, 16 << 20)).unwrap();
    assert_eq!(dev.param_sha256, want.param_sha256);
}

#[test]
fn a_run_that_does_not_keep_its_parameters_ends_with_the_same_digest_read_piece_by_piece() {
    // State in RAM, several ranks and chunks: the digest read from the owners a piece at a time
    // must be the digest of the consolidated parameters, on the host and on the device.
    for device in [false, true] {
        let base = TrainConfig {
            ranks: 3,
            stage: 3,
            steps: 2,
            ..small(ModelKind::Gpt)
        };
        let cfg = if device {
            on_sim(&base, 16 << 20)
        } else {
            base
        };
        let kept = run_cfg(&cfg).unwrap();
        assert!(!kept.params.is_empty(), "kept by default");
        let spec = ClusterSpec {
            keep_params: false,
            ..ClusterSpec::from_config(cfg).unwrap()
        };
        let digest_only = train_blocking(spec, ()).unwrap();
        assert!(digest_only.params.is_empty(), "nothing gathered");
        assert_eq!(
            digest_only.param_sha256, kept.param_sha256,
            "device {device}"
        );
        let consolidated = elastic_zero::summary::param_sha256(&kept.params);
        assert_eq!(consolidated, kept.param_sha256);
    }
}
