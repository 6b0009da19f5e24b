//! What each rank holds and sends, measured by the runtime, against the ZeRO formulas.

use crate::common;

use common::{run_cfg, small};
use elastic_zero::config::{ModelKind, TrainConfig};
use elastic_zero::job::build_model;
use elastic_zero::model::backend::Precision;
use elastic_zero::plan::memory::resident;
use elastic_zero::plan::volume::{param_elem_bytes, per_step};
use elastic_zero::plan::{ShardMap, Stage};
use elastic_zero::reduce::ReduceMode;
use elastic_zero::runtime::transport::FRAME_HEADER_BYTES;

fn map_for(cfg: &TrainConfig) -> (ShardMap, Vec<usize>) {
    let numels: Vec<usize> = build_model(cfg)
        .unwrap()
        .units()
        .iter()
        .map(|u| u.numel())
        .collect();
    let members: Vec<u32> = (0..cfg.ranks).collect();
    (
        ShardMap::plan(&numels, &members, cfg.chunk_elems, 1).unwrap(),
        numels,
    )
}

#[test]
fn resident_memory_matches_the_stage_formulas() {
    for reduce in [ReduceMode::Exact, ReduceMode::Fast] {
        for stage in 0..=3u8 {
            let cfg = TrainConfig {
                ranks: 4,
                stage,
                reduce,
                ..small(ModelKind::Gpt)
            };
            let (map, numels) = map_for(&cfg);
            let psi: u64 = numels.iter().sum::<usize>() as u64;
            let out = run_cfg(&cfg).unwrap();
            let st = Stage::from_u8(stage).unwrap();
            for r in &out.records.last().unwrap().reports {
                let owned = map.owned_elems(r.rank) as u64;
                let want = resident(st, psi, owned, reduce.elem_bytes() as u64, 2, 4);
                assert_eq!(r.resident, want, "stage {stage} {reduce:?} rank {}", r.rank);
                // Sharded state is within one chunk of an even split.
                let even = psi as f64 / 4.0;
                assert!(
                    (owned as f64 - even).abs() <= cfg.chunk_elems as f64,
                    "rank {} owns {owned}",
                    r.rank
                );
            }
        }
    }
}

#[test]
fn stage3_holds_at_most_the_units_it_may_keep_live() {
    let mut peaks = Vec::new();
    for max_live_units in [1usize, 2, 3] {
        let cfg = TrainConfig {
            ranks: 3,
            stage: 3,
            max_live_units,
            layers: 4,
            ..small(ModelKind::Gpt)
        };
        let (_, numels) = map_for(&cfg);
        let mut sizes: Vec<u64> = numels.iter().map(|&n| 4 * n as u64).collect();
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        // Gathered bytes (assembled plus in flight to this rank) never exceed the
        // `max_live_units` largest units.
        let bound: u64 = sizes.iter().take(max_live_units).sum();
        let out = run_cfg(&cfg).unwrap();
        let peak = out
            .records
            .iter()
            .flat_map(|r| &r.reports)
            .map(|r| r.peak_gathered_bytes)
            .max()
            .unwrap();
        assert!(
            peak <= bound,
            "live {max_live_units}: peak {peak} > bound {bound}"
        );
        peaks.push(peak);
    }
    // Prefetching really holds more: one live unit is less than two, two less than three.
    assert!(peaks[0] < peaks[1] && peaks[1] < peaks[2], "{peaks:?}");
}

#[test]
fn bytes_sent_match_2psi_and_3psi_plus_stated_overhead() {
    for reduce in [ReduceMode::Exact, ReduceMode::Fast] {
        for stage in 0..=3u8 {
            let cfg = TrainConfig {
                ranks: 3,
                stage,
                reduce,
                ..small(ModelKind::Gpt)
            };
            let (map, numels) = map_for(&cfg);
            let psi: u64 = numels.iter().sum::<usize>() as u64;
            let st = Stage::from_u8(stage).unwrap();
            let out = run_cfg(&cfg).unwrap();
            let mut total_elems = 0u64;
            for rec in &out.records {
                for r in &rec.reports {
                    let want = per_step(&map, st, r.rank);
                    assert_eq!(
                        r.sent, want,
                        "stage {stage} rank {} step {}",
                        r.rank, rec.step
                    );
                    total_elems += r.sent.elems();
                    // Overhead: a header per frame and the agreement message, never more than
                    // this bound: (units * 3 + 2) frames to each peer plus 4 KiB of agreement.
                    let data = want.bytes(4, reduce.elem_bytes() as u64);
                    let frames_bound = (numels.len() as u64 * 3 + 2) * 2;
                    let overhead = r.bytes_sent - data;
                    assert!(
                        overhead <= frames_bound * FRAME_HEADER_BYTES + 2 * 4096,
                        "overhead {overhead}"
                    );
                }
            }
            // Summed over ranks: (N-1) x Psi per collective; 2 collectives for stages 0-2, 3 for 3.
            let per_step_total = total_elems / out.records.len() as u64;
            let collectives = if stage == 3 { 3 } else { 2 };
            assert_eq!(per_step_total, collectives * 2 * psi, "stage {stage}");
        }
    }
}

#[test]
fn bf16_halves_parameter_bytes_and_keeps_the_papers_mixed_precision_memory() {
    // Under bf16 every parameter gather carries 2 bytes a parameter (stage 3's before use,
    // stages 1-2's after the update). Between steps stages 0-2 keep a bf16 full copy (2Ψ) and
    // the fp32 masters of their own chunks with Adam's m and v (12 bytes an owned parameter):
    // the ZeRO paper's mixed-precision figures with our gradient width.
    for stage in 0..=3u8 {
        let cfg = TrainConfig {
            ranks: 3,
            stage,
            precision: Precision::Bf16,
            ..small(ModelKind::Gpt)
        };
        let (map, numels) = map_for(&cfg);
        let psi: u64 = numels.iter().sum::<usize>() as u64;
        let st = Stage::from_u8(stage).unwrap();
        let out = run_cfg(&cfg).unwrap();
        let param_bytes = param_elem_bytes(st, Precision::Bf16.param_bytes());
        assert_eq!(param_bytes, 2);
        let g = cfg.reduce.elem_bytes() as u64;
        for rec in &out.records {
            for r in &rec.reports {
                let want = per_step(&map, st, r.rank);
                assert_eq!(r.sent, want, "stage {stage} rank {}", r.rank);
                let data = want.bytes(param_bytes, g);
                let frames_bound = (numels.len() as u64 * 3 + 2) * 2;
                let overhead = r.bytes_sent.checked_sub(data).unwrap_or_else(|| {
                    panic!("stage {stage}: sent {} < data {data}", r.bytes_sent)
                });
                assert!(
                    overhead <= frames_bound * FRAME_HEADER_BYTES + 2 * 4096,
                    "stage {stage} overhead {overhead}"
                );
                let owned = map.owned_elems(r.rank) as u64;
                assert_eq!(
                    r.resident,
                    resident(st, psi, owned, g, 2, 2),
                    "stage {stage}"
                );
                let (params, optimizer, grads) = match stage {
                    0 => (2 * psi, 12 * psi, g * psi),
                    1 => (2 * psi, 12 * owned, g * psi),
                    2 => (2 * psi, 12 * owned, 4 * owned),
                    _ => (4 * owned, 8 * owned, 4 * owned),
                };
                let got = (r.resident.params, r.resident.optimizer, r.resident.grads);
                assert_eq!(got, (params, optimizer, grads), "stage {stage}");
            }
        }
        // Summed over ranks and per step, with N - 1 = 2: stage 3 (2·2 + g)·Ψ·(N-1) bytes of
        // data, stages 1-2 (2 + g)·Ψ·(N-1) (fp32 would be (4 + g)), stage 0 2g·Ψ·(N-1).
        let steps = out.records.len() as u64;
        let data: u64 = out
            .records
            .iter()
            .flat_map(|r| &r.reports)
            .map(|r| r.sent.bytes(2, g))
            .sum();
        let want = match stage {
            0 => 2 * g,
            1 | 2 => 2 + g,
            _ => 2 * 2 + g,
        };
        assert_eq!(data / steps, want * psi * 2, "stage {stage}");
    }
}

#[test]
fn the_process_peak_is_the_ledgers_peak_plus_the_runtime() {
    // One 50M-parameter block (1.6 GB of state and working set) in a process of its own, two
    // steps (the second is the first with Adam's m and v resident). Its VmHWM while training
    // must be the ledger's peak plus what any run of the binary holds (code, thread stacks:
    // about 40-60 MiB here), not more: freed heap left resident after building the rank's
    // state out of 8192-element chunk states would be 360 MiB here.
    let t = tempfile::tempdir().unwrap();
    let json = t.path().join("summary.json");
    let r = common::ezero::ezero(&[
        "train",
        "--layers",
        "1",
        "--d-model",
        "2048",
        "--heads",
        "16",
        "--seq-len",
        "32",
        "--micro-batches",
        "1",
        "--micro-batch-size",
        "1",
        "--ranks",
        "1",
        "--stage",
        "3",
        "--steps",
        "2",
        "--sample-tokens",
        "0",
        "--json",
        common::ezero::s(&json),
    ]);
    common::ezero::ok(&r);
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rss = summary["peak_rss_training_bytes"].as_u64().unwrap();
    let ledger = summary["ranks"][0]["peak_bytes"].as_u64().unwrap();
    let runtime_bytes = 96 << 20;
    assert!(
        rss <= ledger + runtime_bytes,
        "VmHWM {rss} B is {} MiB over the ledger's peak {ledger} B (allowed: {} MiB)",
        (rss.saturating_sub(ledger)) >> 20,
        runtime_bytes >> 20
    );
}
