//! Snapshots taken at a step boundary resume bit for bit at any world size, stage and chunk
//! size: the in-memory mechanism under checkpoints and resharding.

mod common;

use common::{run_cfg, small, train_blocking};
use elastic_zero::config::{ModelKind, TrainConfig};
use elastic_zero::engine::coordinator::StepRecord;
use elastic_zero::runtime::actors::Snapshot;
use elastic_zero::runtime::cluster::Observer;
use elastic_zero::runtime::{ClusterSpec, TrainOutcome};
use elastic_zero::summary::param_sha256;

#[derive(Default)]
struct Keep(Vec<Snapshot>);

impl Observer for &mut Keep {
    fn on_snapshot(&mut self, s: Snapshot) {
        self.0.push(s);
    }
}

fn run(
    cfg: &TrainConfig,
    resume: Option<Snapshot>,
    snapshot_every: u64,
    keep: &mut Keep,
) -> TrainOutcome {
    let spec = ClusterSpec {
        resume,
        snapshot_every,
        ..ClusterSpec::from_config(cfg.clone()).unwrap()
    };
    train_blocking(spec, keep).unwrap()
}

#[test]
fn resume_at_any_world_size_stage_and_chunk_size_is_bit_identical() {
    let base = TrainConfig {
        steps: 6,
        ranks: 4,
        stage: 3,
        ..small(ModelKind::Gpt)
    };
    let want = param_sha256(&run_cfg(&base).unwrap().params);
    let mut keep = Keep::default();
    let out = run(&base, None, 3, &mut keep);
    assert_eq!(
        param_sha256(&out.params),
        want,
        "snapshots must not disturb training"
    );
    assert_eq!(
        keep.0.iter().map(|s| s.progress.step).collect::<Vec<_>>(),
        vec![3, 6]
    );
    let snap = keep.0.remove(0);
    for (ranks, stage, chunk_elems) in [(1, 1, 1000), (2, 2, 333), (3, 3, 4096), (2, 0, 1000)] {
        let cfg = TrainConfig {
            ranks,
            stage,
            chunk_elems,
            ..base.clone()
        };
        let resumed = run(&cfg, Some(snap.clone()), 0, &mut Keep::default());
        assert_eq!(
            resumed.records.first().map(|r: &StepRecord| r.step),
            Some(3)
        );
        assert_eq!(
            param_sha256(&resumed.params),
            want,
            "ranks {ranks} stage {stage} chunk {chunk_elems}"
        );
    }
}

#[test]
fn a_snapshot_of_another_model_is_refused() {
    let base = TrainConfig {
        steps: 2,
        ranks: 2,
        ..small(ModelKind::Mlp)
    };
    let mut keep = Keep::default();
    run(&base, None, 2, &mut keep);
    let other = TrainConfig {
        d_model: 16,
        ..base
    };
    let spec = ClusterSpec {
        resume: keep.0.pop(),
        ..ClusterSpec::from_config(other).unwrap()
    };
    let err = train_blocking(spec, ()).err().expect("must refuse");
    assert!(err.to_string().contains("another model"), "{err}");
}
