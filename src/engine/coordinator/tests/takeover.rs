//! Durable state and takeovers: commits come before what depends on them, and a successor
//! rolls the re-attached ranks back to the committed backup without reusing an epoch.

use super::losses::{
    aborted, all, backed_up, interrupt_of, last_record, lost, replicated, report_at, resharded,
    restore_of,
};
use super::*;

/// A 3-rank job with backups every step, committing its durable state, through step 0 and its
/// backup; returns the commands of step 0's completion.
fn committing_through_step0(c: &mut Coordinator) -> Vec<Command> {
    c.keep_durable();
    assert_eq!(
        kinds(&c.handle(Event::Start { now_ms: 0 })),
        ["commit", "replicate"],
        "the job's state is in the store before anything runs"
    );
    let cmds = all(c, &[0, 1, 2], replicated(0, 0));
    assert_eq!(
        kinds(&cmds),
        ["commit", "run"],
        "the backup is stored first"
    );
    let Command::Commit(d) = &cmds[0] else {
        unreachable!()
    };
    assert_eq!(d.backup.as_ref().map(|(e, p)| (*e, p.step)), Some((0, 0)));
    all(c, &[0, 1, 2], |r| done(report_at(r, 0, 0), 1))
}

#[test]
fn the_durable_state_is_committed_before_the_commands_that_depend_on_it() {
    let map = ShardMap::plan(&[100], &[0, 1, 2], 10, 0).unwrap();
    let mut c = Coordinator::new(backed_up(3, Vec::new()), map.clone());
    let cmds = committing_through_step0(&mut c);
    assert_eq!(
        kinds(&cmds),
        ["done", "replicate"],
        "nothing durable changed"
    );
    let cmds = all(&mut c, &[0, 1, 2], replicated(0, 1));
    assert_eq!(kinds(&cmds), ["commit", "run"]);
    // Without `keep_durable` nothing is committed.
    let mut plain = Coordinator::new(backed_up(3, Vec::new()), map);
    plain.handle(Event::Start { now_ms: 0 });
    assert_eq!(
        kinds(&all(&mut plain, &[0, 1, 2], replicated(0, 0))),
        ["run"]
    );
}

#[test]
fn a_successor_rolls_the_reattached_ranks_back_and_drops_the_lost() {
    let map = ShardMap::plan(&[100], &[0, 1, 2], 10, 0).unwrap();
    let mut c = Coordinator::new(backed_up(4, Vec::new()), map.clone());
    committing_through_step0(&mut c);
    let cmds = all(&mut c, &[0, 1, 2], replicated(0, 1));
    let Command::Commit(durable) = &cmds[0] else {
        panic!("{:?}", kinds(&cmds))
    };
    // The leader dies in step 1: rank 1 is still in it, rank 0 finished it, rank 2 is gone.
    let attached: Attached = [(0, None), (1, Some((0, 1)))].into_iter().collect();
    let mut next = Coordinator::take_over(backed_up(4, Vec::new()), (**durable).clone(), &attached)
        .expect("the backup covers rank 2");
    next.keep_durable();
    assert_eq!(next.failovers(), 1);
    let cmds = next.handle(Event::Start { now_ms: 10 });
    assert_eq!(kinds(&cmds), ["commit", "retire", "interrupt"]);
    assert_eq!(interrupt_of(&cmds), (vec![1], 0, 1));
    let cmds = next.handle(aborted(1));
    assert_eq!(
        kinds(&cmds),
        ["commit", "restore"],
        "the new epoch is stored first"
    );
    let (old, new, step, lost_ranks) = restore_of(&cmds);
    assert_eq!((old, step, lost_ranks), (map, 1, vec![2]));
    assert_eq!(new.members, vec![0, 1]);
    assert_eq!(new.epoch, 1);
    let Command::Commit(d) = &cmds[0] else {
        unreachable!()
    };
    assert_eq!((d.epoch_used, d.failovers), (1, 1));
    assert!(all(&mut next, &[0, 1], resharded(1)).len() == 1);
    let cmds = all(&mut next, &[0, 1], replicated(1, 1));
    assert_eq!(kinds(&cmds), ["commit", "membership", "run"]);
    let Some(Command::RunStep(plan)) = cmds.last() else {
        unreachable!()
    };
    assert_eq!((plan.epoch, plan.step), (1, 1), "step 1 is replayed");
    assert_eq!(last_record(&next).lost, vec![2]);
}

#[test]
fn a_successor_never_reuses_an_epoch_its_predecessor_handed_out() {
    let map = ShardMap::plan(&[100], &[0, 1], 10, 0).unwrap();
    let mut c = Coordinator::new(backed_up(4, Vec::new()), map);
    c.keep_durable();
    c.handle(Event::Start { now_ms: 0 });
    let cmds = all(&mut c, &[0, 1], replicated(0, 0));
    let Command::Commit(durable) = &cmds[0] else {
        panic!("{:?}", kinds(&cmds))
    };
    let durable = Durable {
        epoch_used: 7,
        ..(**durable).clone()
    };
    let attached: Attached = [(0, None), (1, None)].into_iter().collect();
    let mut next = Coordinator::take_over(backed_up(4, Vec::new()), durable, &attached).unwrap();
    let cmds = next.handle(Event::Start { now_ms: 0 });
    let (_, new, step, lost_ranks) = restore_of(&cmds);
    assert_eq!((new.epoch, step, lost_ranks), (8, 0, Vec::new()));
}

#[test]
fn a_takeover_without_a_covering_backup_is_refused() {
    let map = ShardMap::plan(&[100], &[0, 1], 10, 0).unwrap();
    let c = Coordinator::new(backed_up(4, Vec::new()), map);
    let attached: Attached = [(0, None), (1, None)].into_iter().collect();
    let err = Coordinator::take_over(backed_up(4, Vec::new()), c.durable(), &attached)
        .err()
        .expect("no backup yet");
    assert!(err.0.contains("no buddy backup"), "{err}");
    // Both ranks of a 2-rank job gone: nobody holds their chunks.
    let mut c = Coordinator::new(
        backed_up(4, Vec::new()),
        ShardMap::plan(&[100], &[0, 1], 10, 0).unwrap(),
    );
    c.handle(Event::Start { now_ms: 0 });
    all(&mut c, &[0, 1], replicated(0, 0));
    let err = Coordinator::take_over(backed_up(4, Vec::new()), c.durable(), &Attached::new())
        .err()
        .expect("nothing re-attached");
    assert!(err.0.contains("had no other copy"), "{err}");
}

/// A world shrunk to one rank still leaves a successor a backup to roll back to (the rank's own
/// copy) when the job outlives its coordinator; without a store it takes none.
#[test]
fn a_lone_rank_keeps_a_backup_a_successor_can_roll_back_to() {
    let map = ShardMap::plan(&[100], &[0, 1], 10, 0).unwrap();
    let mut c = Coordinator::new(backed_up(4, Vec::new()), map);
    c.keep_durable();
    c.handle(Event::Start { now_ms: 0 });
    all(&mut c, &[0, 1], replicated(0, 0));
    all(&mut c, &[0, 1], |r| done(report_at(r, 0, 0), 1));
    all(&mut c, &[0, 1], replicated(0, 1));
    // Rank 1 is lost in step 1: rank 0 alone rebuilds, backs itself up, and the map and its
    // backup are committed together.
    assert_eq!(kinds(&c.handle(lost(1))), ["retire", "interrupt"]);
    let (_, new, _, _) = restore_of(&c.handle(aborted(0)));
    assert_eq!(new.members, vec![0]);
    let cmds = all(&mut c, &[0], resharded(new.epoch));
    assert_eq!(kinds(&cmds), ["replicate"], "a lone rank backs itself up");
    let cmds = all(&mut c, &[0], replicated(new.epoch, 1));
    let Command::Commit(durable) = &cmds[0] else {
        panic!("{:?}", kinds(&cmds))
    };
    assert_eq!(durable.map.members, vec![0]);
    assert_eq!(
        durable.backup.as_ref().map(|(e, p)| (*e, p.step)),
        Some((new.epoch, 1)),
        "the backup is under the map it is stored with"
    );
    // The leader dies with rank 0 in step 1: the successor rolls it back to its own copy.
    let attached: Attached = [(0, Some((new.epoch, 1)))].into_iter().collect();
    let mut next = Coordinator::take_over(backed_up(4, Vec::new()), (**durable).clone(), &attached)
        .expect("the lone rank's own backup");
    let cmds = next.handle(Event::Start { now_ms: 10 });
    assert_eq!(interrupt_of(&cmds), (vec![0], new.epoch, 1));
    let cmds = next.handle(aborted(0));
    let (_, again, step, lost_ranks) = restore_of(&cmds);
    assert_eq!((again.members, step, lost_ranks), (vec![0], 1, Vec::new()));
    // Without a store, a lone rank takes no backup: nothing could use it.
    let mut plain = Coordinator::new(
        backed_up(4, Vec::new()),
        ShardMap::plan(&[100], &[0], 10, 0).unwrap(),
    );
    assert_eq!(kinds(&plain.handle(Event::Start { now_ms: 0 })), ["run"]);
}
