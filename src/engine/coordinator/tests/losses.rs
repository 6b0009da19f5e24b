//! Losses in any phase: the abandoned round is dropped and the run recovers from the committed
//! map's backup, or stops naming the chunks nobody holds; joiners that fail, slow backups and
//! rounds every rank gave up on.

use super::*;

pub(super) fn backed_up(steps: u64, script: Vec<ScriptedChange>) -> JobSpec {
    JobSpec {
        replicate_every: 1,
        eval_every: None,
        script,
        ..job(steps)
    }
}

pub(super) fn report_at(rank: RankId, epoch: u64, step: u64) -> StepReport {
    StepReport {
        epoch,
        ..report(rank, step)
    }
}

/// Feeds every rank's event and returns the commands of the last one (earlier ones must be
/// empty: the phase waits for everyone).
pub(super) fn all(
    c: &mut Coordinator,
    ranks: &[RankId],
    ev: impl Fn(RankId) -> Event,
) -> Vec<Command> {
    let (last, rest) = ranks.split_last().unwrap();
    for &r in rest {
        let out = c.handle(ev(r));
        assert!(out.is_empty(), "rank {r}: {:?}", kinds(&out));
    }
    c.handle(ev(*last))
}

pub(super) fn replicated(epoch: u64, step: u64) -> impl Fn(RankId) -> Event {
    move |rank| Event::ReplicateDone {
        rank,
        epoch,
        step,
        now_ms: 1,
    }
}

pub(super) fn resharded(epoch: u64) -> impl Fn(RankId) -> Event {
    move |rank| Event::ReshardDone {
        rank,
        epoch,
        now_ms: 2,
    }
}

pub(super) fn aborted(rank: RankId) -> Event {
    Event::StepAborted {
        rank,
        reason: "interrupted".into(),
        now_ms: 3,
    }
}

pub(super) fn lost(rank: RankId) -> Event {
    Event::RankFailed {
        rank,
        reason: "vanished".into(),
        now_ms: 3,
    }
}

/// Starts `c` on `members` (epoch 0) and completes step 0 with its backup.
fn through_step0(c: &mut Coordinator, members: &[RankId]) -> Vec<Command> {
    assert_eq!(kinds(&c.handle(Event::Start { now_ms: 0 })), ["replicate"]);
    assert_eq!(kinds(&all(c, members, replicated(0, 0))), ["run"]);
    all(c, members, |r| done(report_at(r, 0, 0), 1))
}

pub(super) fn restore_of(cmds: &[Command]) -> (ShardMap, ShardMap, u64, Vec<RankId>) {
    match cmds.last() {
        Some(Command::Restore {
            old,
            new,
            step,
            lost,
        }) => (old.clone(), new.clone(), *step, lost.clone()),
        _ => panic!("{:?}", kinds(cmds)),
    }
}

pub(super) fn interrupt_of(cmds: &[Command]) -> (Vec<RankId>, u64, u64) {
    cmds.iter()
        .find_map(|c| match c {
            Command::Interrupt { ranks, epoch, step } => Some((ranks.clone(), *epoch, *step)),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{:?}", kinds(cmds)))
}

pub(super) fn last_record(c: &Coordinator) -> &MembershipRecord {
    c.membership_log().last().unwrap()
}

#[test]
fn a_loss_mid_reshard_of_a_leave_rolls_back_and_still_applies_the_leave() {
    let map = ShardMap::plan(&[100], &[0, 1, 2, 3], 10, 0).unwrap();
    let leave = ScriptedChange {
        step: 1,
        change: Change::Leave(1),
    };
    let mut c = Coordinator::new(backed_up(3, vec![leave]), map.clone());
    let cmds = through_step0(&mut c, &[0, 1, 2, 3]);
    assert_eq!(kinds(&cmds), ["done", "reshard"]);
    assert!(c.handle(resharded(1)(0)).is_empty());
    // Rank 2 vanishes while the others still move chunks.
    let cmds = c.handle(lost(2));
    assert_eq!(kinds(&cmds), ["retire", "interrupt"]);
    assert_eq!(interrupt_of(&cmds), (vec![1, 3], 1, 1));
    assert!(c.handle(aborted(1)).is_empty());
    // Rank 3 finished its part despite the interrupt: it is idle all the same.
    let cmds = c.handle(resharded(1)(3));
    let (old, new, step, lost_ranks) = restore_of(&cmds);
    assert_eq!(old, map, "from the committed map");
    assert_eq!(step, 0, "to the committed backup");
    assert_eq!(lost_ranks, vec![2]);
    assert_eq!(new.members, vec![0, 3], "the leave still happens");
    assert_eq!(new.epoch, 2, "a fresh epoch: the abandoned round used 1");
    // The leaver is alive and sends what it holds.
    assert!(all(&mut c, &[0, 1], resharded(2)).is_empty());
    let cmds = c.handle(resharded(2)(3));
    let [Command::Replicate { step: 0, ranks }] = &cmds[..] else {
        panic!("{:?}", kinds(&cmds))
    };
    assert_eq!(ranks, &vec![0, 3]);
    let cmds = all(&mut c, &[0, 3], replicated(2, 0));
    assert_eq!(kinds(&cmds), ["retire", "membership", "run"]);
    let Command::Retire { ranks } = &cmds[0] else {
        unreachable!()
    };
    assert_eq!(ranks, &vec![1], "the leaver; rank 2 was retired when lost");
    let rec = last_record(&c);
    assert_eq!(
        (rec.lost.clone(), rec.rolled_back_to, rec.after.clone()),
        (vec![2], Some(0), vec![0, 3])
    );
    assert_eq!((c.step(), c.backup_step()), (0, Some(0)));
}

#[test]
fn a_joiner_lost_mid_reshard_is_dropped_and_a_member_lost_mid_backup_is_recovered() {
    let map = ShardMap::plan(&[100], &[0, 1], 10, 0).unwrap();
    let join = ScriptedChange {
        step: 1,
        change: Change::Join(1),
    };
    let mut c = Coordinator::new(backed_up(3, vec![join]), map.clone());
    assert_eq!(kinds(&through_step0(&mut c, &[0, 1])), ["done", "spawn"]);
    assert_eq!(
        kinds(&c.handle(Event::Spawned {
            rank: 2,
            host: None,
            now_ms: 1
        })),
        ["reshard"]
    );
    let cmds = c.handle(lost(2));
    assert_eq!(interrupt_of(&cmds), (vec![0, 1], 1, 1));
    c.handle(aborted(0));
    let (_, new, step, lost_ranks) = restore_of(&c.handle(aborted(1)));
    assert_eq!((new.members.clone(), new.epoch, step), (vec![0, 1], 2, 0));
    assert_eq!(lost_ranks, vec![2]);
    all(&mut c, &[0, 1], resharded(2));
    assert_eq!(
        kinds(&all(&mut c, &[0, 1], replicated(2, 0))),
        ["membership", "run"]
    );
    assert_eq!(last_record(&c).lost, vec![2]);

    // Again with a join at step 1: this time a member dies during the backup that commits
    // the new map, after the joiner already took its share.
    let join = ScriptedChange {
        step: 1,
        change: Change::Join(1),
    };
    let mut c = Coordinator::new(backed_up(3, vec![join]), map.clone());
    through_step0(&mut c, &[0, 1]);
    c.handle(Event::Spawned {
        rank: 2,
        host: None,
        now_ms: 1,
    });
    assert_eq!(kinds(&all(&mut c, &[0, 1, 2], resharded(1))), ["replicate"]);
    assert!(c.handle(replicated(1, 1)(2)).is_empty());
    let cmds = c.handle(lost(0));
    assert_eq!(interrupt_of(&cmds), (vec![1], 1, 1));
    let (old, new, step, _) = restore_of(&c.handle(aborted(1)));
    assert_eq!((old.epoch, new.epoch, step), (0, 2, 0));
    assert_eq!(new.members, vec![1, 2], "the joiner stays, rank 0 is gone");
    all(&mut c, &[1, 2], resharded(2));
    all(&mut c, &[1, 2], replicated(2, 0));
    assert_eq!(c.map().members, vec![1, 2]);
    assert_eq!(c.map().epoch, 2);
}

#[test]
fn a_loss_mid_backup_rolls_back_to_the_previous_backup() {
    let map = ShardMap::plan(&[100], &[0, 1, 2], 10, 0).unwrap();
    let mut c = Coordinator::new(backed_up(3, Vec::new()), map.clone());
    assert_eq!(
        kinds(&through_step0(&mut c, &[0, 1, 2])),
        ["done", "replicate"]
    );
    assert!(c.handle(replicated(0, 1)(0)).is_empty());
    let cmds = c.handle(lost(2));
    assert_eq!(kinds(&cmds), ["retire", "interrupt"]);
    assert_eq!(interrupt_of(&cmds), (vec![1], 0, 1));
    let (old, new, step, _) = restore_of(&c.handle(aborted(1)));
    assert_eq!((old.epoch, new.epoch, step), (0, 1, 0));
    assert_eq!(new.members, vec![0, 1]);
}

#[test]
fn a_loss_mid_recovery_restarts_it_without_the_new_loss_or_stops_naming_chunks() {
    let map = ShardMap::plan(&[100], &[0, 1, 2, 3], 10, 0).unwrap();
    let start = |c: &mut Coordinator| {
        through_step0(c, &[0, 1, 2, 3]);
        all(c, &[0, 1, 2, 3], replicated(0, 1));
        let cmds = c.handle(lost(1));
        assert_eq!(interrupt_of(&cmds), (vec![0, 2, 3], 0, 1));
        all(c, &[0, 2, 3], aborted);
        // One restore participant finishes before the next loss.
        assert!(c.handle(resharded(1)(0)).is_empty());
    };
    let mut c = Coordinator::new(backed_up(3, Vec::new()), map.clone());
    start(&mut c);
    // Rank 3 vanishes during the restore: rank 1's buddy (2) and rank 3's buddy (0) live.
    let cmds = c.handle(lost(3));
    assert_eq!(interrupt_of(&cmds), (vec![2], 1, 1));
    let (old, new, step, lost_ranks) = restore_of(&c.handle(aborted(2)));
    assert_eq!((old.epoch, new.epoch, step), (0, 2, 1));
    assert_eq!((new.members.clone(), lost_ranks), (vec![0, 2], vec![1, 3]));
    all(&mut c, &[0, 2], resharded(2));
    all(&mut c, &[0, 2], replicated(2, 1));
    assert_eq!(last_record(&c).lost, vec![1, 3]);

    // Rank 2 instead: rank 1 and its buddy are both gone, so rank 1's chunks are lost.
    let mut c = Coordinator::new(backed_up(3, Vec::new()), map.clone());
    start(&mut c);
    let cmds = c.handle(lost(2));
    let Some(Command::Abort { reason }) = cmds.last() else {
        panic!("{:?}", kinds(&cmds))
    };
    let rank1: Vec<usize> = map.owned_in_unit(0, 1).collect();
    assert!(
        reason.contains("no other copy") && reason.contains(&format!("(0, {})", rank1[0])),
        "{reason}"
    );
    assert!(c.is_finished());
}

fn failed(rank: RankId, reason: &str) -> Event {
    Event::RankFailed {
        rank,
        reason: reason.into(),
        now_ms: 2,
    }
}

/// Step 0 without backups.
fn plain_step0(c: &mut Coordinator, members: &[RankId]) -> Vec<Command> {
    assert_eq!(kinds(&c.handle(Event::Start { now_ms: 0 })), ["run"]);
    all(c, members, |r| done(report_at(r, 0, 0), 1))
}

#[test]
fn a_joiner_that_cannot_start_is_dropped_and_training_goes_on() {
    let map = ShardMap::plan(&[100], &[0, 1], 10, 0).unwrap();
    let join = |n| ScriptedChange {
        step: 1,
        change: Change::Join(n),
    };
    // The only joiner: the step runs on the same members and map, nothing is resharded.
    let mut c = Coordinator::new(
        JobSpec {
            script: vec![join(1)],
            ..job(2)
        },
        map.clone(),
    );
    assert_eq!(kinds(&plain_step0(&mut c, &[0, 1])), ["done", "spawn"]);
    let cmds = c.handle(failed(2, "could not start: no standby worker"));
    assert_eq!(kinds(&cmds), ["join_failed", "run"]);
    let Command::JoinFailed { rank: 2, reason } = &cmds[0] else {
        panic!("{cmds:?}")
    };
    assert!(reason.contains("no standby worker"), "{reason}");
    let Command::RunStep(plan) = &cmds[1] else {
        unreachable!()
    };
    assert_eq!(
        (plan.epoch, plan.step),
        (0, 1),
        "the committed map, the next step"
    );
    assert!(c.membership_log().is_empty());
    // A joiner that comes up after all holds nothing and is retired.
    assert_eq!(
        kinds(&c.handle(Event::Spawned {
            rank: 2,
            host: None,
            now_ms: 3
        })),
        ["retire"]
    );

    // Two joiners, one fails: the other still joins; the failed id is not handed out again.
    let mut c = Coordinator::new(
        JobSpec {
            script: vec![join(2)],
            ..job(2)
        },
        map.clone(),
    );
    plain_step0(&mut c, &[0, 1]);
    assert_eq!(kinds(&c.handle(failed(3, "gone"))), ["join_failed"]);
    assert_eq!(
        kinds(&c.handle(Event::Spawned {
            rank: 2,
            host: None,
            now_ms: 3
        })),
        ["reshard"]
    );
    assert_eq!(
        kinds(&all(&mut c, &[0, 1, 2], resharded(1))),
        ["membership", "run"]
    );
    assert_eq!(c.map().members, vec![0, 1, 2]);

    // A joiner that never answers is dropped when the change times out.
    let mut c = Coordinator::new(
        JobSpec {
            script: vec![join(1)],
            ..job(2)
        },
        map.clone(),
    );
    plain_step0(&mut c, &[0, 1]);
    assert!(c.handle(Event::Tick { now_ms: 500 }).is_empty());
    let cmds = c.handle(Event::Tick { now_ms: 5000 });
    assert_eq!(kinds(&cmds), ["join_failed", "run"]);
    let Command::JoinFailed { reason, .. } = &cmds[0] else {
        unreachable!()
    };
    assert!(reason.contains("step_timeout_ms (1000 ms)"), "{reason}");
    // Its start failing after all is no loss.
    assert!(c.handle(failed(2, "gave up")).is_empty());
}

#[test]
fn a_failed_joiner_that_was_to_replace_a_leaver_stops_the_run_at_the_minimum() {
    let map = ShardMap::plan(&[100], &[0, 1], 10, 0).unwrap();
    let script = vec![
        ScriptedChange {
            step: 1,
            change: Change::Leave(1),
        },
        ScriptedChange {
            step: 1,
            change: Change::Join(1),
        },
    ];
    let spec = JobSpec {
        script,
        min_ranks: 2,
        ..job(2)
    };
    let mut c = Coordinator::new(spec, map);
    assert_eq!(kinds(&plain_step0(&mut c, &[0, 1])), ["done", "spawn"]);
    let cmds = c.handle(failed(2, "no standby worker"));
    assert_eq!(kinds(&cmds), ["join_failed", "abort"]);
    let Command::Abort { reason } = &cmds[1] else {
        unreachable!()
    };
    assert!(
        reason.contains("rank 2 could not join at step 1 (no standby worker)")
            && reason.contains("below the minimum of 2"),
        "{reason}"
    );
}

#[test]
fn a_joiner_brings_its_host_into_the_map() {
    let mut map = ShardMap::plan(&[100], &[0, 1], 10, 0).unwrap();
    map.hosts.insert(0, "a".into());
    map.hosts.insert(1, "b".into());
    let script = vec![ScriptedChange {
        step: 1,
        change: Change::Join(2),
    }];
    let mut c = Coordinator::new(JobSpec { script, ..job(3) }, map);
    plain_step0(&mut c, &[0, 1]);
    c.handle(Event::Spawned {
        rank: 2,
        host: Some("a".into()),
        now_ms: 2,
    });
    let cmds = c.handle(Event::Spawned {
        rank: 3,
        host: Some("c".into()),
        now_ms: 2,
    });
    let [Command::Reshard { new, .. }] = &cmds[..] else {
        panic!("{:?}", kinds(&cmds))
    };
    let hosts: Vec<(RankId, &str)> = new.hosts.iter().map(|(r, h)| (*r, h.as_str())).collect();
    assert_eq!(hosts, [(0, "a"), (1, "b"), (2, "a"), (3, "c")]);
    // Buddies keep to other hosts: rank 0's buddy is not rank 2, on the same host.
    assert_ne!(crate::plan::replica::buddy(new, 0), Some(2));
    assert_eq!(
        kinds(&all(&mut c, &[0, 1, 2, 3], resharded(1))),
        ["membership", "run"]
    );
    assert_eq!(&c.map().hosts, &new.hosts, "committed with the hosts");
}

/// A backup of state on a slow disk runs past step_timeout_ms while its ranks move pieces; the
/// rank that stops is named. A pause (a snapshot streamed at the boundary) restarts the clock.
#[test]
fn a_long_backup_lives_on_progress_and_a_pause_is_not_counted() {
    let map = ShardMap::plan(&[100], &[0, 1], 10, 0).unwrap();
    let epoch = map.epoch;
    let mut c = Coordinator::new(backed_up(3, Vec::new()), map);
    let cmds = c.handle(Event::Start { now_ms: 0 });
    assert_eq!(kinds(&cmds), ["replicate"]);
    let beat = |rank, now_ms| Event::Progress {
        rank,
        epoch,
        step: 0,
        now_ms,
    };
    for t in (900..=3600).step_by(900) {
        c.handle(beat(0, t));
        c.handle(beat(1, t));
        assert!(
            c.handle(Event::Tick { now_ms: t + 50 }).is_empty(),
            "at {t}"
        );
    }
    c.handle(beat(0, 4500));
    let cmds = c.handle(Event::Tick { now_ms: 4700 });
    let Command::Abort { reason } = &cmds[0] else {
        panic!("{cmds:?}")
    };
    assert!(reason.contains("no progress on ranks [1]"), "{reason}");

    // A pause restarts the phase's clock: silence is counted from it.
    let map = ShardMap::plan(&[100], &[0, 1], 10, 0).unwrap();
    let mut c = Coordinator::new(job(3), map);
    c.handle(Event::Start { now_ms: 0 });
    c.handle(Event::Paused { now_ms: 5000 });
    assert!(c.handle(Event::Tick { now_ms: 5900 }).is_empty());
    assert!(!c.handle(Event::Tick { now_ms: 6100 }).is_empty());
}

/// Every rank of a step gives up on its peers and none is lost (a dropped connection lost
/// frames between live workers): the step is redone from the backup with the same ranks under a
/// fresh epoch; a link that stays dead stops the run after `MAX_NETWORK_RETRIES` in a row, and a
/// completed step resets the count.
#[test]
fn a_step_every_rank_gave_up_on_is_redone_from_the_backup_with_the_same_ranks() {
    let map = ShardMap::plan(&[100], &[0, 1, 2], 10, 0).unwrap();
    let mut c = Coordinator::new(backed_up(4, vec![]), map.clone());
    assert_eq!(
        kinds(&through_step0(&mut c, &[0, 1, 2])),
        ["done", "replicate"]
    );
    assert_eq!(kinds(&all(&mut c, &[0, 1, 2], replicated(0, 1))), ["run"]);
    // Rank 2 finished the step; 0 and 1 timed out waiting for each other.
    assert!(c.handle(done(report_at(2, 0, 1), 2)).is_empty());
    assert!(c.handle(aborted(0)).is_empty(), "rank 1 may still deliver");
    let cmds = c.handle(aborted(1));
    assert!(!kinds(&cmds).contains(&"retire"), "{:?}", kinds(&cmds));
    assert!(!kinds(&cmds).contains(&"interrupt"), "nobody is still busy");
    let (old, new, step, lost_ranks) = restore_of(&cmds);
    assert_eq!((old, step, lost_ranks), (map, 1, vec![]));
    assert_eq!(new.members, vec![0, 1, 2], "the same ranks");
    assert_eq!(
        new.epoch, 1,
        "a fresh epoch: late frames of the cut step are stale"
    );
    let cmds = all(&mut c, &[0, 1, 2], resharded(1));
    assert_eq!(kinds(&cmds), ["replicate"]);
    let cmds = all(&mut c, &[0, 1, 2], replicated(1, 1));
    assert_eq!(kinds(&cmds), ["membership", "run"]);
    let rec = last_record(&c);
    assert_eq!((rec.lost.clone(), rec.rolled_back_to), (vec![], Some(1)));

    // A dead link: every retry is cut again, until the run stops saying so.
    let mut epoch = 1;
    for retry in 2..=MAX_NETWORK_RETRIES + 1 {
        let cmds = all(&mut c, &[0, 1, 2], aborted);
        if retry > MAX_NETWORK_RETRIES {
            let [Command::Abort { reason }] = &cmds[..] else {
                panic!("{:?}", kinds(&cmds))
            };
            assert!(
                reason.contains("gave up on each other 4 times in a row"),
                "{reason}"
            );
            assert!(reason.contains("check the network"), "{reason}");
            break;
        }
        let (_, new, step, lost_ranks) = restore_of(&cmds);
        assert_eq!((new.epoch, step, lost_ranks), (epoch + 1, 1, vec![]));
        epoch += 1;
        all(&mut c, &[0, 1, 2], resharded(epoch));
        let cmds = all(&mut c, &[0, 1, 2], replicated(epoch, 1));
        assert_eq!(kinds(&cmds), ["membership", "run"]);
    }
    let retries = c.membership_log().iter().filter(|r| r.is_network_retry());
    assert_eq!(retries.count(), MAX_NETWORK_RETRIES as usize);
}

/// A backup round every rank gave up on is redone the same way; without backups there is
/// nothing to roll back to and the run stops, saying what to resume from.
#[test]
fn a_cut_backup_round_is_redone_and_without_backups_a_cut_step_stops() {
    let map = ShardMap::plan(&[100], &[0, 1], 10, 0).unwrap();
    let mut c = Coordinator::new(backed_up(3, vec![]), map.clone());
    assert_eq!(
        kinds(&through_step0(&mut c, &[0, 1])),
        ["done", "replicate"]
    );
    let cmds = all(&mut c, &[0, 1], aborted);
    let (_, new, step, lost_ranks) = restore_of(&cmds);
    assert_eq!(
        (new.members.clone(), step, lost_ranks),
        (vec![0, 1], 0, vec![])
    );

    let mut c = Coordinator::new(job(3), map);
    assert_eq!(kinds(&c.handle(Event::Start { now_ms: 0 })), ["run"]);
    let cmds = all(&mut c, &[0, 1], aborted);
    let [Command::Abort { reason }] = &cmds[..] else {
        panic!("{:?}", kinds(&cmds))
    };
    assert!(
        reason.starts_with("the ranks gave up on each other at step 0"),
        "{reason}"
    );
    assert!(reason.contains("no in-memory backup exists"), "{reason}");
}
