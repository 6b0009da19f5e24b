//! The coordinator's state machine driven by hand: events in, commands out, no actors.

use super::*;
use crate::plan::memory::Resident;
use crate::plan::volume::Volume;

mod losses;
mod takeover;

fn job(steps: u64) -> JobSpec {
    JobSpec {
        steps,
        micro_batches: 4,
        lr: LrSchedule {
            base_lr: 1e-3,
            warmup_steps: 0,
            total_steps: 0,
            min_lr_ratio: 1.0,
        },
        step_timeout_ms: 1000,
        initial_grad_bound: exact::INITIAL_BOUND,
        snapshot_every: 0,
        script: Vec::new(),
        min_ranks: 1,
        max_ranks: 64,
        replicate_every: 0,
        eval_every: None,
    }
}

fn report(rank: RankId, step: u64) -> StepReport {
    StepReport {
        rank,
        epoch: 0,
        step,
        losses: vec![1.0, 2.0, 3.0, 4.0],
        unit_max_abs: vec![0.5],
        grad_norm: 1.0,
        clip_coef: 1.0,
        skipped: false,
        attempts: 1,
        sent: Volume::default(),
        bytes_sent: 0,
        resident: Resident::default(),
        peak_bytes: 0,
        peak_gathered_bytes: 0,
        stale_dropped: 0,
        compute_s: 0.0,
        optimizer_s: 0.0,
        busy_s: 0.0,
        tier_read_bytes: 0,
        tier_write_bytes: 0,
        io_wait_s: 0.0,
        tier_bytes: 0,
        device: None,
        eval_losses: Vec::new(),
    }
}

fn done(r: StepReport, now_ms: u64) -> Event {
    Event::StepDone {
        report: Box::new(r),
        now_ms,
    }
}

#[test]
fn runs_steps_in_order_and_finishes() {
    let map = ShardMap::plan(&[10], &[0, 1], 4, 0).unwrap();
    let mut c = Coordinator::new(job(2), map);
    let cmds = c.handle(Event::Start { now_ms: 0 });
    let Command::RunStep(plan) = &cmds[0] else {
        panic!("{cmds:?}")
    };
    assert_eq!((plan.step, plan.opt_step), (0, 1));
    assert!(c.handle(done(report(0, 0), 5)).is_empty());
    // A duplicate or stale report changes nothing.
    assert!(c.handle(done(report(0, 0), 6)).is_empty());
    let cmds = c.handle(done(report(1, 0), 10));
    let Command::StepCompleted(rec) = &cmds[0] else {
        panic!("{cmds:?}")
    };
    assert_eq!(rec.loss, 2.5);
    assert_eq!(rec.duration_ms, 10);
    let Command::RunStep(plan) = &cmds[1] else {
        panic!("{cmds:?}")
    };
    assert_eq!(plan.grad_bounds, vec![exact::next_bound(0.5)]);
    c.handle(done(report(0, 1), 20));
    let cmds = c.handle(done(report(1, 1), 30));
    assert!(matches!(cmds.last(), Some(Command::Finish)));
    assert!(c.is_finished());
}

/// Evaluations fall after every `eval_every` steps and after the last; such a step owes no
/// update to the next (the ranks read their parameters right after it), and the record carries
/// the mean of the agreed eval losses.
#[test]
fn evaluations_are_planned_every_n_steps_and_after_the_last() {
    let map = ShardMap::plan(&[10], &[0], 4, 0).unwrap();
    let spec = JobSpec {
        eval_every: Some(2),
        ..job(5)
    };
    let mut c = Coordinator::new(spec, map);
    let mut cmds = c.handle(Event::Start { now_ms: 0 });
    let mut planned = Vec::new();
    for step in 0..5 {
        let Some(Command::RunStep(plan)) = cmds.last() else {
            panic!("{cmds:?}")
        };
        assert!(!plan.eval || !plan.defer_update, "step {step}");
        planned.push(plan.eval);
        let r = StepReport {
            eval_losses: if plan.eval {
                vec![1.0, 2.0, 3.0, 5.0]
            } else {
                Vec::new()
            },
            ..report(0, step)
        };
        cmds = c.handle(done(r, 10 * step + 5));
        let Command::StepCompleted(rec) = &cmds[0] else {
            panic!("{cmds:?}")
        };
        assert_eq!(rec.eval_loss, plan_eval_loss(planned[step as usize]));
    }
    assert_eq!(planned, [false, true, false, true, true]);
    let spec = JobSpec {
        eval_every: Some(0),
        ..job(3)
    };
    let mut c = Coordinator::new(spec, ShardMap::plan(&[10], &[0], 4, 0).unwrap());
    let cmds = c.handle(Event::Start { now_ms: 0 });
    assert!(matches!(&cmds[0], Command::RunStep(p) if !p.eval));
}

fn plan_eval_loss(evaluated: bool) -> Option<f64> {
    evaluated.then_some(2.75)
}

fn kinds(cmds: &[Command]) -> Vec<&'static str> {
    cmds.iter()
        .map(|c| match c {
            Command::Commit(_) => "commit",
            Command::RunStep(_) => "run",
            Command::StepCompleted(_) => "done",
            Command::Snapshot(_) => "snap",
            Command::Spawn { .. } => "spawn",
            Command::Reshard { .. } => "reshard",
            Command::Retire { .. } => "retire",
            Command::MembershipChanged(_) => "membership",
            Command::JoinFailed { .. } => "join_failed",
            Command::Replicate { .. } => "replicate",
            Command::Interrupt { .. } => "interrupt",
            Command::Restore { .. } => "restore",
            Command::Finish => "finish",
            Command::Abort { .. } => "abort",
        })
        .collect()
}

fn resharded(rank: RankId, epoch: u64, now_ms: u64) -> Event {
    Event::ReshardDone {
        rank,
        epoch,
        now_ms,
    }
}

fn spawned(rank: RankId, now_ms: u64) -> Event {
    Event::Spawned {
        rank,
        host: None,
        now_ms,
    }
}

#[test]
fn scripted_leave_and_join_reshard_at_step_boundaries() {
    let map = ShardMap::plan(&[100], &[0, 1, 2], 10, 0).unwrap();
    let script = vec![
        ScriptedChange {
            step: 1,
            change: Change::Leave(1),
        },
        ScriptedChange {
            step: 2,
            change: Change::Join(2),
        },
    ];
    let mut c = Coordinator::new(JobSpec { script, ..job(3) }, map);
    c.handle(Event::Start { now_ms: 0 });
    for r in 0..2 {
        assert!(c.handle(done(report(r, 0), 1)).is_empty());
    }
    let cmds = c.handle(done(report(2, 0), 2));
    assert_eq!(kinds(&cmds), ["done", "reshard"]);
    let Command::Reshard { new, .. } = &cmds[1] else {
        unreachable!()
    };
    assert_eq!((new.epoch, new.members.clone()), (1, vec![0, 2]));
    // Every participant, the leaver included, must report before the epoch commits.
    assert!(c.handle(resharded(0, 1, 3)).is_empty());
    assert!(c.handle(resharded(2, 0, 3)).is_empty(), "stale epoch");
    assert!(c.handle(resharded(2, 1, 3)).is_empty());
    let cmds = c.handle(resharded(1, 1, 4));
    assert_eq!(kinds(&cmds), ["retire", "membership", "run"]);
    let Command::RunStep(plan) = &cmds[2] else {
        unreachable!()
    };
    assert_eq!((plan.epoch, plan.step, plan.assignment.len()), (1, 1, 2));
    let mut r0 = report(0, 1);
    r0.epoch = 1;
    let mut r2 = report(2, 1);
    r2.epoch = 1;
    c.handle(done(r0, 5));
    let cmds = c.handle(done(r2, 6));
    assert_eq!(kinds(&cmds), ["done", "spawn"]);
    let Command::Spawn { ranks } = &cmds[1] else {
        unreachable!()
    };
    assert_eq!(ranks, &vec![3, 4], "joiners take the next unused ids");
    assert!(c.handle(spawned(3, 7)).is_empty());
    assert_eq!(kinds(&c.handle(spawned(4, 7))), ["reshard"]);
    for r in [0, 2, 3] {
        assert!(c.handle(resharded(r, 2, 8)).is_empty());
    }
    assert_eq!(kinds(&c.handle(resharded(4, 2, 9))), ["membership", "run"]);
    assert_eq!(c.map().members, vec![0, 2, 3, 4]);
    assert_eq!(c.membership_log().len(), 2);
}

#[test]
fn operator_requests_are_checked_and_refused_without_effect() {
    let map = ShardMap::plan(&[100], &[0, 1], 10, 1).unwrap();
    let mut c = Coordinator::new(
        JobSpec {
            min_ranks: 2,
            max_ranks: 3,
            ..job(3)
        },
        map,
    );
    assert!(matches!(
        c.request(Change::Leave(9)),
        Err(Refusal::UnknownRank { rank: 9, .. })
    ));
    assert!(c
        .request(Change::Leave(1))
        .unwrap_err()
        .to_string()
        .contains("minimum"));
    assert!(matches!(
        c.request(Change::Join(2)),
        Err(Refusal::AboveMax { ranks: 4, max: 3 })
    ));
    assert!(matches!(
        c.check_loss(&[1]),
        Err(Refusal::BelowMin { ranks: 1, min: 2 })
    ));
    c.request(Change::Join(1)).unwrap();
    assert!(
        matches!(c.request(Change::Join(1)), Err(Refusal::AboveMax { .. })),
        "queued requests count"
    );
    c.check_loss(&[1]).unwrap();
}

#[test]
fn requests_the_run_would_end_before_are_refused() {
    let map = ShardMap::plan(&[100], &[0, 1], 10, 1).unwrap();
    let mut c = Coordinator::new(job(2), map);
    // Before the first step, step 0's boundary is ahead.
    c.request(Change::Join(1)).unwrap();
    let mut c = Coordinator::new(job(1), ShardMap::plan(&[100], &[0, 1], 10, 1).unwrap());
    c.handle(Event::Start { now_ms: 0 });
    // Running the last step: no boundary is left, so the change could never happen.
    assert_eq!(
        c.request(Change::Leave(1)),
        Err(Refusal::RunEnding { steps: 1 })
    );
    assert_eq!(c.check_loss(&[1]), Err(Refusal::RunEnding { steps: 1 }));
    // The request itself is checked first.
    assert!(matches!(
        c.request(Change::Leave(7)),
        Err(Refusal::UnknownRank { rank: 7, .. })
    ));
}

#[test]
fn snapshots_come_at_step_boundaries_before_the_next_step() {
    let map = ShardMap::plan(&[10], &[0], 4, 0).unwrap();
    let mut c = Coordinator::new(
        JobSpec {
            snapshot_every: 2,
            ..job(5)
        },
        map,
    );
    c.handle(Event::Start { now_ms: 0 });
    assert_eq!(kinds(&c.handle(done(report(0, 0), 1))), ["done", "run"]);
    let cmds = c.handle(done(report(0, 1), 2));
    assert_eq!(kinds(&cmds), ["done", "snap", "run"]);
    let Command::Snapshot(p) = &cmds[1] else {
        unreachable!()
    };
    assert_eq!((p.step, p.opt_step), (2, 2));
    c.handle(Event::SnapshotRequested);
    assert_eq!(
        kinds(&c.handle(done(report(0, 2), 3))),
        ["done", "snap", "run"]
    );
}

#[test]
fn timeout_names_missing_ranks() {
    let map = ShardMap::plan(&[10], &[0, 1, 2], 4, 0).unwrap();
    let mut c = Coordinator::new(job(5), map);
    c.handle(Event::Start { now_ms: 0 });
    c.handle(done(report(1, 0), 5));
    assert!(c.handle(Event::Tick { now_ms: 500 }).is_empty());
    let cmds = c.handle(Event::Tick { now_ms: 2000 });
    let Command::Abort { reason } = &cmds[0] else {
        panic!("{cmds:?}")
    };
    assert!(reason.contains("[0, 2]"), "{reason}");
}

#[test]
fn progress_keeps_a_long_step_alive_and_names_the_silent_rank() {
    let map = ShardMap::plan(&[10], &[0, 1], 4, 0).unwrap();
    let epoch = map.epoch;
    let mut c = Coordinator::new(job(5), map);
    c.handle(Event::Start { now_ms: 0 });
    let beat = |rank, step, now_ms| Event::Progress {
        rank,
        epoch,
        step,
        now_ms,
    };
    // Both ranks keep finishing units: the step runs far past step_timeout_ms (1000).
    for t in (800..=4000).step_by(800) {
        c.handle(beat(0, 0, t));
        c.handle(beat(1, 0, t));
        assert!(
            c.handle(Event::Tick { now_ms: t + 100 }).is_empty(),
            "at {t}"
        );
    }
    // Rank 1 goes quiet; a beat for another step or epoch does not count for it.
    c.handle(beat(0, 0, 4800));
    c.handle(beat(1, 7, 4800));
    c.handle(Event::Progress {
        rank: 1,
        epoch: epoch + 1,
        step: 0,
        now_ms: 4800,
    });
    assert!(c.handle(Event::Tick { now_ms: 4900 }).is_empty());
    let cmds = c.handle(Event::Tick { now_ms: 5100 });
    let Command::Abort { reason } = &cmds[0] else {
        panic!("{cmds:?}")
    };
    assert!(reason.contains("ranks [1]"), "{reason}");
    assert!(reason.contains("no progress"), "{reason}");
}

#[test]
fn disagreeing_ranks_abort() {
    let map = ShardMap::plan(&[10], &[0, 1], 4, 0).unwrap();
    let mut c = Coordinator::new(job(5), map);
    c.handle(Event::Start { now_ms: 0 });
    c.handle(done(report(0, 0), 1));
    let mut r = report(1, 0);
    r.grad_norm = 2.0;
    assert!(matches!(c.handle(done(r, 2))[0], Command::Abort { .. }));
}

#[test]
fn failure_aborts_with_the_rank() {
    let map = ShardMap::plan(&[10], &[0, 1], 4, 0).unwrap();
    let mut c = Coordinator::new(job(5), map);
    c.handle(Event::Start { now_ms: 0 });
    let cmds = c.handle(Event::RankFailed {
        rank: 1,
        reason: "boom".into(),
        now_ms: 3,
    });
    let Command::Abort { reason } = &cmds[0] else {
        panic!()
    };
    assert!(reason.contains("rank 1") && reason.contains("boom"));
}
