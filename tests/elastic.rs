//! Elastic membership: ranks leave and join while training runs; shards are rebalanced in place
//! and the final parameters equal those of a run with no change, bit for bit.

mod common;

use common::{run_cfg, small};
use elastic_zero::config::{At, ModelKind, TrainConfig};
use elastic_zero::summary::param_sha256;

fn at(value: u32, step: u64) -> At {
    At { value, step }
}

#[test]
fn leave_and_join_end_with_the_same_parameters_as_a_fixed_world() {
    let base = TrainConfig {
        steps: 6,
        ranks: 3,
        ..small(ModelKind::Gpt)
    };
    let want = param_sha256(&run_cfg(&base).unwrap().params);
    for stage in [0u8, 1, 2, 3] {
        for (leave, join) in [
            (vec![at(1, 2)], vec![]),
            (vec![], vec![at(2, 3)]),
            (vec![at(0, 1), at(3, 4)], vec![at(1, 2)]),
        ] {
            let cfg = TrainConfig {
                stage,
                leave: leave.clone(),
                join: join.clone(),
                ..base.clone()
            };
            let out = run_cfg(&cfg).unwrap();
            assert_eq!(
                param_sha256(&out.params),
                want,
                "stage {stage} leave {leave:?} join {join:?}"
            );
        }
    }
}

#[test]
fn rebalances_move_within_ten_percent_of_the_minimum() {
    use elastic_zero::engine::coordinator::MembershipRecord;
    use elastic_zero::job::{build_dataset, build_model};
    use elastic_zero::runtime::cluster::Observer;
    use elastic_zero::runtime::{train, ClusterSpec};

    #[derive(Default)]
    struct Log(Vec<MembershipRecord>);
    impl Observer for &mut Log {
        fn on_membership(&mut self, r: &MembershipRecord) {
            self.0.push(r.clone());
        }
    }
    let cfg = TrainConfig {
        steps: 5,
        ranks: 4,
        layers: 4,
        chunk_elems: 256,
        leave: vec![at(2, 1)],
        join: vec![at(1, 2), at(2, 3)],
        ..small(ModelKind::Gpt)
    };
    let spec = ClusterSpec {
        config: cfg.clone(),
        model: build_model(&cfg).unwrap(),
        data: build_dataset(&cfg).unwrap(),
        init_params: None,
        resume: None,
        snapshot_every: 0,
        panic_at: None,
    };
    let mut log = Log::default();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(train(spec, &mut log)).unwrap();
    let members: Vec<Vec<u32>> = log.0.iter().map(|r| r.after.clone()).collect();
    assert_eq!(
        members,
        vec![vec![0, 1, 3], vec![0, 1, 3, 4], vec![0, 1, 3, 4, 5, 6]]
    );
    for r in &log.0 {
        println!(
            "epoch {}: moved {} elements, minimum {}",
            r.epoch, r.moved_chunk_elems, r.min_chunk_elems
        );
        assert!(r.min_chunk_elems > 0);
        assert!(
            r.moved_chunk_elems as f64 <= 1.1 * r.min_chunk_elems as f64,
            "{r:?}"
        );
    }
}
