//! Elastic membership: ranks leave and join while training runs; shards are rebalanced in place
//! and the final parameters equal those of a run with no change, bit for bit.

use crate::common;

use common::{run_cfg, small};
use elastic_zero::config::{At, Faults, ModelKind, TrainConfig};
use elastic_zero::summary::param_sha256;

fn at(value: u32, step: u64) -> At {
    At { value, step }
}

/// Runs `cfg` and returns the outcome with every membership change.
fn run_logged(
    cfg: &TrainConfig,
) -> Result<
    (
        elastic_zero::runtime::TrainOutcome,
        Vec<elastic_zero::engine::coordinator::MembershipRecord>,
    ),
    String,
> {
    use elastic_zero::engine::coordinator::MembershipRecord;
    use elastic_zero::runtime::api::cluster::Observer;
    use elastic_zero::runtime::ClusterSpec;
    struct Log(Vec<MembershipRecord>);
    impl Observer for &mut Log {
        fn on_membership(&mut self, r: &MembershipRecord) {
            self.0.push(r.clone());
        }
    }
    let spec = ClusterSpec::from_config(cfg.clone()).unwrap();
    let mut log = Log(Vec::new());
    let out = common::train_blocking(spec, &mut log).map_err(|e| e.to_string())?;
    Ok((out, log.0))
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
    let cfg = TrainConfig {
        steps: 5,
        ranks: 4,
        layers: 4,
        chunk_elems: 256,
        leave: vec![at(2, 1)],
        join: vec![at(1, 2), at(2, 3)],
        ..small(ModelKind::Gpt)
    };
    let (_, log) = run_logged(&cfg).unwrap();
    let members: Vec<Vec<u32>> = log.iter().map(|r| r.after.clone()).collect();
    assert_eq!(
        members,
        vec![vec![0, 1, 3], vec![0, 1, 3, 4], vec![0, 1, 3, 4, 5, 6]]
    );
    for r in &log {
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

#[test]
fn an_abrupt_loss_rolls_back_to_the_buddy_backup_and_loses_nothing() {
    let base = TrainConfig {
        steps: 6,
        ranks: 3,
        ..small(ModelKind::Gpt)
    };
    let want = param_sha256(&run_cfg(&base).unwrap().params);
    for stage in [0u8, 1, 2, 3] {
        for (kill, replicate_every) in [
            (vec![at(1, 2)], 1),
            (vec![at(2, 4)], 2),
            (vec![at(0, 0)], 3),
        ] {
            let cfg = TrainConfig {
                stage,
                kill: kill.clone(),
                replicate_every,
                ..base.clone()
            };
            let (out, log) =
                run_logged(&cfg).unwrap_or_else(|e| panic!("stage {stage} kill {kill:?}: {e}"));
            assert_eq!(
                param_sha256(&out.params),
                want,
                "stage {stage} kill {kill:?} every {replicate_every}"
            );
            // The loss really happened, and training rolled back to the newest backup.
            assert_eq!(log.len(), 1, "{log:?}");
            assert_eq!(log[0].lost, vec![kill[0].value]);
            let step = kill[0].step;
            assert_eq!(log[0].rolled_back_to, Some(step - step % replicate_every));
        }
    }
}

#[test]
fn kills_combined_with_leaves_and_joins_still_match() {
    let base = TrainConfig {
        steps: 7,
        ranks: 4,
        ..small(ModelKind::Mlp)
    };
    let want = param_sha256(&run_cfg(&base).unwrap().params);
    let cfg = TrainConfig {
        stage: 3,
        leave: vec![at(3, 1)],
        join: vec![at(2, 3)],
        kill: vec![at(0, 2), at(4, 5)],
        ..base
    };
    let (out, log) = run_logged(&cfg).unwrap();
    assert_eq!(param_sha256(&out.params), want);
    let lost: Vec<Vec<u32>> = log.iter().map(|r| r.lost.clone()).collect();
    assert_eq!(lost, vec![vec![], vec![0], vec![], vec![4]], "{log:?}");
}

/// The Llama (tied head, grouped-query attention, q/k/v biases) through the same events.
#[test]
fn a_llama_through_leave_join_and_kill_matches_a_fixed_world() {
    let base = TrainConfig {
        steps: 6,
        ranks: 4,
        ..small(ModelKind::Llama)
    };
    let want = param_sha256(&run_cfg(&base).unwrap().params);
    for stage in [1u8, 3] {
        let cfg = TrainConfig {
            stage,
            leave: vec![at(3, 1)],
            join: vec![at(2, 3)],
            kill: vec![at(0, 2), at(4, 4)],
            ..base.clone()
        };
        let (out, log) = run_logged(&cfg).unwrap();
        assert_eq!(param_sha256(&out.params), want, "stage {stage}");
        let lost: Vec<Vec<u32>> = log.iter().map(|r| r.lost.clone()).collect();
        assert_eq!(lost, vec![vec![], vec![0], vec![], vec![4]], "{log:?}");
    }
}

#[test]
fn losses_without_a_live_copy_stop_the_run_and_say_so() {
    let base = TrainConfig {
        steps: 4,
        ranks: 3,
        stage: 3,
        ..small(ModelKind::Mlp)
    };
    let no_backup = TrainConfig {
        kill: vec![at(1, 1)],
        replicate_every: 0,
        ..base.clone()
    };
    let err = run_cfg(&no_backup).err().expect("must stop").to_string();
    assert!(
        err.contains("rank 1") && err.contains("checkpoint"),
        "{err}"
    );
    // Rank 1 and its buddy, rank 2, die in the same step: rank 1's chunks have no copy left.
    let both = TrainConfig {
        kill: vec![at(1, 2), at(2, 2)],
        ..base
    };
    let err = run_cfg(&both).err().expect("must stop").to_string();
    assert!(
        err.contains("no other copy") && err.contains("checkpoint"),
        "{err}"
    );
}

fn round_kill(s: &str) -> elastic_zero::config::RoundKill {
    s.parse().unwrap()
}

/// A rank struck in the middle of a round between steps, and what the run must end with.
struct MidRound {
    leave: Vec<At>,
    join: Vec<At>,
    /// Killed mid-step.
    kill: Vec<At>,
    /// Killed mid-round (`RANK@STEP:ROUND`).
    during: Vec<&'static str>,
    /// The members after the last change.
    after: Vec<u32>,
    lost: Vec<u32>,
    rolled_back_to: u64,
}

fn mid_round_cases() -> Vec<MidRound> {
    vec![
        // A staying member dies while the leave's chunks move: one reshard does both.
        MidRound {
            leave: vec![at(1, 2)],
            join: vec![],
            kill: vec![],
            during: vec!["2@2:reshard"],
            after: vec![0, 3],
            lost: vec![2],
            rolled_back_to: 1,
        },
        // The leaver itself dies halfway through handing over its chunks.
        MidRound {
            leave: vec![at(1, 2)],
            join: vec![],
            kill: vec![],
            during: vec!["1@2:reshard"],
            after: vec![0, 2, 3],
            lost: vec![1],
            rolled_back_to: 1,
        },
        // The joiner dies while receiving: the run goes on without it.
        MidRound {
            leave: vec![],
            join: vec![at(1, 2)],
            kill: vec![],
            during: vec!["4@2:reshard"],
            after: vec![0, 1, 2, 3],
            lost: vec![4],
            rolled_back_to: 1,
        },
        // A member dies in the backup that commits the join.
        MidRound {
            leave: vec![],
            join: vec![at(1, 2)],
            kill: vec![],
            during: vec!["0@2:replicate"],
            after: vec![1, 2, 3, 4],
            lost: vec![0],
            rolled_back_to: 1,
        },
        // A member dies in a periodic backup.
        MidRound {
            leave: vec![],
            join: vec![],
            kill: vec![],
            during: vec!["3@2:replicate"],
            after: vec![0, 1, 2],
            lost: vec![3],
            rolled_back_to: 1,
        },
        // A second rank dies while the survivors restore from the first loss.
        MidRound {
            leave: vec![],
            join: vec![],
            kill: vec![at(1, 2)],
            during: vec!["3@2:restore"],
            after: vec![0, 2],
            lost: vec![1, 3],
            rolled_back_to: 2,
        },
    ]
}

/// A rank vanishes in the middle of a round between steps: the reshard of a leave or a join,
/// the backup that commits a change, a periodic backup, or the restore of an earlier loss. The
/// round is abandoned, the survivors rebuild from the committed map's backups, and the result
/// is bit-identical to the run without faults.
#[test]
fn a_loss_mid_reshard_mid_backup_or_mid_restore_loses_nothing() {
    let base = TrainConfig {
        steps: 5,
        ranks: 4,
        collective_timeout_ms: 10_000,
        ..small(ModelKind::Mlp)
    };
    let want = param_sha256(&run_cfg(&base).unwrap().params);
    let cases = mid_round_cases();
    for stage in [1u8, 2, 3] {
        for case in &cases {
            let during = &case.during;
            let cfg = TrainConfig {
                stage,
                leave: case.leave.clone(),
                join: case.join.clone(),
                kill: case.kill.clone(),
                faults: Faults {
                    kill_during: during.iter().map(|s| round_kill(s)).collect(),
                    ..Faults::default()
                },
                ..base.clone()
            };
            let what = format!("stage {stage} kill during {during:?}");
            let (out, log) = run_logged(&cfg).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(param_sha256(&out.params), want, "{what}");
            let rec = log.last().unwrap_or_else(|| panic!("{what}: no change"));
            assert_eq!(
                (&rec.after, &rec.lost, rec.rolled_back_to),
                (&case.after, &case.lost, Some(case.rolled_back_to)),
                "{what}: {log:?}"
            );
        }
    }
}

#[test]
fn a_loss_mid_reshard_that_leaves_chunks_without_a_copy_stops_the_run() {
    let cfg = TrainConfig {
        steps: 4,
        ranks: 4,
        stage: 3,
        leave: vec![at(0, 2)],
        // Rank 1 and its buddy, rank 2, die while rank 0's chunks move.
        faults: Faults {
            kill_during: vec![round_kill("1@2:reshard"), round_kill("2@2:reshard")],
            ..Faults::default()
        },
        ..small(ModelKind::Mlp)
    };
    let err = run_cfg(&cfg).err().expect("must stop").to_string();
    assert!(
        err.contains("no other copy") && err.contains("checkpoint"),
        "{err}"
    );
}

/// The step timeout measures silence, not length: a step that takes several times
/// `step_timeout_ms` (4 x `collective_timeout_ms`) because a slow rank delays every frame still
/// finishes, because every rank keeps finishing units, and it ends with the same parameters.
#[test]
fn a_step_longer_than_the_step_timeout_finishes_while_its_ranks_make_progress() {
    let base = TrainConfig {
        layers: 28,
        micro_batches: 2,
        steps: 1,
        stage: 3,
        ranks: 2,
        max_live_units: 1,
        collective_timeout_ms: 500,
        ..small(ModelKind::Gpt)
    };
    let want = run_cfg(&base).unwrap().param_sha256;
    let slow = TrainConfig {
        faults: Faults {
            net_slow_rank: Some(1),
            net_slow_ms: 125,
            ..Faults::default()
        },
        ..base.clone()
    };
    let out = run_cfg(&slow).unwrap();
    let step_timeout_ms = 4 * base.collective_timeout_ms;
    let took_ms = out.records[0].duration_ms;
    assert!(
        took_ms > step_timeout_ms,
        "the step took {took_ms} ms, not longer than the step timeout {step_timeout_ms} ms: the test shows nothing"
    );
    assert_eq!(out.param_sha256, want);
}
