//! Updates owed to the next forward (`runtime/step/owed.rs`): stage 3 with everything on the
//! tier runs each unit's update when the next forward gathers it. Nothing about when an update
//! runs may change a bit; the same runs with the parameters in RAM (whose update runs in the
//! optimizer phase) check the other schedule against the same digests.

use crate::common;

use common::small;
use elastic_zero::config::{Faults, ModelKind, TrainConfig};
use elastic_zero::runtime::actors::ClusterEvent;
use elastic_zero::runtime::step::state::rank_state::ChunkState;
use elastic_zero::runtime::{Cluster, ClusterSpec};

use crate::offload::{
    assert_clean, assert_failing_disks_stop_or_recover, at, offloaded, sha, tier_dir,
};

/// `base` at 1, 2 and 3 ranks: fixed; with backups before steps 0, 2 and 4 and a kill in step 3
/// (after step 2, whose update may be owed, rolled back to a backup); with a leave and a join.
fn elastic_cases(base: &TrainConfig) -> Vec<TrainConfig> {
    [
        (1, 0, vec![], vec![], vec![]),
        (2, 0, vec![], vec![], vec![]),
        (3, 2, vec![], vec![], vec![at(2, 3)]),
        (3, 3, vec![at(1, 2)], vec![at(3, 4)], vec![]),
    ]
    .into_iter()
    .map(|(ranks, replicate_every, leave, join, kill)| TrainConfig {
        ranks,
        replicate_every,
        leave,
        join,
        kill,
        ..base.clone()
    })
    .collect()
}

/// Stage 3 with everything on the tier owes each step's update to the next forward, unless the
/// state is read before it (a backup, a scripted change, the end). Owed or not, through a kill
/// that strikes while updates are owed (rolled back to a backup), a leave and a join, the run
/// ends with the fixed world's digest, as does the same run with the parameters in RAM.
#[test]
fn updates_owed_to_the_next_forward_change_no_bits() {
    let dir = tier_dir();
    let base = TrainConfig {
        steps: 6,
        stage: 3,
        ..small(ModelKind::Gpt)
    };
    let want = sha(&base);
    for cfg in elastic_cases(&base) {
        for params in [true, false] {
            let got = sha(&offloaded(&cfg, dir.path(), params, true));
            assert_eq!(got, want, "parameters on the tier: {params}, {cfg:?}");
        }
    }
    assert_clean(dir.path());
}

/// With clipping off, stage 3 with everything on the tier runs each unit's update in the
/// backward, as soon as its gradient shard is reduced, into a second copy of its records that
/// becomes its state when the step is agreed. The first step's exact reduction overflows its
/// guessed bounds and is redone (the first pass's updates are dropped); a kill mid-step rolls
/// back to a backup; a leave and a join reshard. Each run ends with the RAM run's digest.
#[test]
fn updates_in_the_backward_change_no_bits() {
    let dir = tier_dir();
    let base = TrainConfig {
        steps: 6,
        stage: 3,
        grad_clip: 0.0,
        // Too small for the first step's gradients: its first pass overflows.
        initial_grad_bound: 1e-6,
        ..small(ModelKind::Gpt)
    };
    let want = sha(&base);
    for case in elastic_cases(&base) {
        let cfg = offloaded(&case, dir.path(), true, true);
        let out = common::run_cfg(&cfg).unwrap();
        assert_eq!(out.param_sha256, want, "{cfg:?}");
        if cfg.ranks == 1 {
            assert_eq!(out.records[0].attempts, 2, "step 0 was redone");
            // The tier holds p, m and v twice and no gradient: 6 values an element against
            // the 4 of the schedule that updates after the backward.
            let clipped = common::run_cfg(&TrainConfig {
                grad_clip: 1.0,
                ..cfg.clone()
            })
            .unwrap();
            let bytes =
                |o: &elastic_zero::runtime::TrainOutcome| o.records[0].reports[0].tier_bytes;
            assert_eq!(2 * bytes(&out), 3 * bytes(&clipped));
            // The update takes the parameters the backward's gather read: a step reads p
            // (forward), p (backward's gather), m and v, four values a record, against the
            // clipped schedule's p, m, v and g (the owed update in the forward) and p again.
            let read =
                |o: &elastic_zero::runtime::TrainOutcome| o.records[1].reports[0].tier_read_bytes;
            assert_eq!(5 * read(&out), 4 * read(&clipped));
        }
    }
    // A disk failing under an update in the backward stops the run naming the file; with
    // backups the survivor takes the rank's state over and the run ends with the same digest.
    let two = TrainConfig {
        ranks: 2,
        steps: 5,
        ..base.clone()
    };
    assert_failing_disks_stop_or_recover(&two, dir.path());
    assert_clean(dir.path());
}

/// A snapshot an operator asks for lands after a step whose updates are owed (the coordinator
/// plans for the snapshots, backups and changes it knows of, not for this one). Reading the
/// state runs what is owed first, so the snapshot is what a run in RAM snapshots at the same
/// step, and the run ends with the RAM run's digest; likewise with only the optimizer state and
/// gradients on the tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_nobody_planned_reads_the_owed_updates() {
    let dir = tier_dir();
    let base = TrainConfig {
        steps: 3,
        stage: 3,
        ranks: 2,
        replicate_every: 0,
        ..small(ModelKind::Gpt)
    };
    let mut runs: Vec<(String, Vec<ChunkState>, String)> = Vec::new();
    for params in [None, Some(true), Some(false)] {
        let cfg = match params {
            None => base.clone(),
            Some(p) => offloaded(&base, dir.path(), p, true),
        };
        let spec = ClusterSpec::from_config(cfg).unwrap();
        let mut job = Cluster::builder(spec)
            .on_demand_snapshots(true)
            .paused(true)
            .start()
            .await
            .unwrap();
        job.handle().request_snapshot().await.unwrap();
        job.run();
        let mut snaps = Vec::new();
        while let Some(ev) = job.next_event().await {
            match ev {
                ClusterEvent::Snapshot(s) => snaps.push(*s),
                ClusterEvent::Finished => break,
                ClusterEvent::Aborted(why) => panic!("{params:?}: {why}"),
                _ => {}
            }
        }
        let out = job.finish().await.unwrap();
        assert_eq!(snaps.len(), 1, "{params:?}");
        let snap = snaps.pop().unwrap();
        assert_eq!(
            snap.progress.step, 1,
            "{params:?}: at the first step boundary"
        );
        runs.push((format!("{params:?}"), snap.chunks, out.param_sha256));
    }
    let (_, want_chunks, want_sha) = &runs[0];
    assert!(
        want_chunks.iter().any(|c| !c.m.is_empty()),
        "with Adam state"
    );
    for (what, chunks, sha) in &runs[1..] {
        assert_eq!(chunks.len(), want_chunks.len(), "{what}");
        for (got, want) in chunks.iter().zip(want_chunks) {
            assert_eq!(got, want, "{what}: chunk {}/{}", want.unit, want.index);
        }
        assert_eq!(sha, want_sha, "{what}");
    }
    assert_clean(dir.path());
}

/// A slow disk (every read on rank 1's tier held 5 ms, far longer than a small unit's compute):
/// a gather whose shard is still being read is posted after the next unit's compute instead of
/// before it, and the optimizer's reads start during the backward. Neither may change a bit, at
/// any placement, or leave a rank waiting on another.
#[test]
fn a_slow_disk_changes_when_reads_land_and_no_bits() {
    let dir = tier_dir();
    let base = TrainConfig {
        steps: 3,
        ranks: 2,
        stage: 3,
        replicate_every: 0,
        ..small(ModelKind::Gpt)
    };
    let want = sha(&base);
    for (params, grads) in [(false, false), (false, true), (true, true)] {
        let cfg = TrainConfig {
            faults: Faults {
                nvme_fault: Some("1:slow@5".parse().unwrap()),
                ..Faults::default()
            },
            // One record a unit: a read a unit, not a read every 1024 elements.
            nvme_record_elems: None,
            ..offloaded(&base, dir.path(), params, grads)
        };
        assert_eq!(sha(&cfg), want, "params {params} grads {grads}");
    }
    assert_clean(dir.path());
}
