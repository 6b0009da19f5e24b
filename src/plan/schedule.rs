//! The per-step schedule: which micro-batches each rank computes, and the ordered phases every
//! rank executes for a ZeRO stage.
//!
//! All ranks run the same phase list, so a rank only ever waits for data its peers send at the
//! same or an earlier phase; sends never block. That ordering argument is what makes the
//! collectives deadlock-free without a central sequencer per unit (the coordinator talks to ranks
//! once per step, not once per unit).

use std::ops::Range;

use serde::{Deserialize, Serialize};

use super::shard_map::RankId;

/// ZeRO stage, as the ZeRO paper defines what each rank holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Stage {
    /// Plain data parallel: everything replicated, gradients all-reduced.
    Zero0,
    /// Optimizer state sharded.
    Zero1,
    /// Optimizer state and gradients sharded.
    Zero2,
    /// Optimizer state, gradients and parameters sharded.
    Zero3,
}

impl Stage {
    pub fn from_u8(stage: u8) -> Option<Stage> {
        [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3]
            .get(stage as usize)
            .copied()
    }
}

/// One step of the phase program a rank executes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// Send my chunks of a unit's parameters to every peer (ZeRO-3; `pass` 0 forward, 1 backward).
    PostGather { unit: u32, pass: u8 },
    /// Receive the peers' chunks and assemble the unit's full parameters.
    WaitGather { unit: u32, pass: u8 },
    /// Run the unit forward on every local micro-batch (the last unit also takes the loss).
    Forward { unit: u32 },
    /// Run the unit backward on every local micro-batch, accumulating its gradient.
    Backward { unit: u32 },
    /// Drop a unit's gathered parameters.
    Free { unit: u32 },
    /// Send my partial sums of one unit's accumulated gradient to the owners of its chunks.
    ReduceScatterUnit { unit: u32 },
    /// Add the peers' partial sums into my chunks of the unit's gradient, then free the unit's
    /// accumulator. Placed one unit after its `ReduceScatterUnit`, so the peers' sums arrive
    /// while this rank computes the next unit's backward instead of while it waits.
    WaitReduceScatter { unit: u32 },
    /// Reduce-scatter the whole-model accumulator (stages 0 and 1).
    ReduceScatterAll,
    /// All-gather the reduced whole-model gradient (stage 0: completes the all-reduce).
    AllGatherGrads,
    /// Agree on loss, per-unit gradient maxima, overflow and the global norm (small all-reduce).
    Agree,
    /// Update my optimizer shards (stage 0: every chunk).
    Optimizer,
    /// All-gather updated parameters into every rank's full copy (stages 1 and 2).
    GatherParams,
}

/// The phase program for one step of `ranks` ranks. `max_live_units` bounds ZeRO-3's gathered
/// working set: the unit being computed plus `max_live_units - 1` prefetched ones. Each unit's
/// reduce-scatter is waited for after the next unit's backward, or right after its own with one
/// rank ([`waits_at_once`]) and in a step that updates each unit in the backward
/// (`updates_in_backward`, `tier::updates_in_backward`): there the update of a unit starts
/// when its sums are in, so waiting a unit later would start the last block's update after the
/// backward, with no compute left beside it.
pub fn phases(
    stage: Stage,
    units: u32,
    max_live_units: usize,
    ranks: usize,
    updates_in_backward: bool,
) -> Vec<Phase> {
    let lag = !waits_at_once(ranks) && !updates_in_backward;
    let mut p = Vec::new();
    let ahead = max_live_units.max(1) as u32 - 1;
    if stage == Stage::Zero3 {
        gathered_pass(&mut p, (0..units).collect(), ahead, 0, |p, u| {
            p.push(Phase::Forward { unit: u })
        });
        gathered_pass(&mut p, (0..units).rev().collect(), ahead, 1, |p, u| {
            p.push(Phase::Backward { unit: u });
        });
        // Reduce-scatter right after each backward (free the unit gradient early): move each
        // ReduceScatterUnit to just after its Free.
        let mut out = Vec::with_capacity(p.len() + units as usize);
        for ph in p {
            out.push(ph);
            if let Phase::Free { unit } = ph {
                if out
                    .iter()
                    .filter(|x| matches!(x, Phase::Free { unit: v } if *v == unit))
                    .count()
                    == 2
                {
                    out.push(Phase::ReduceScatterUnit { unit });
                }
            }
        }
        let mut out = reduce_scatter_waits(out, lag);
        out.extend([Phase::Agree, Phase::Optimizer]);
        return out;
    }
    p.extend((0..units).map(|u| Phase::Forward { unit: u }));
    for u in (0..units).rev() {
        p.push(Phase::Backward { unit: u });
        if stage == Stage::Zero2 {
            p.push(Phase::ReduceScatterUnit { unit: u });
        }
    }
    let mut p = reduce_scatter_waits(p, lag);
    match stage {
        Stage::Zero0 => p.extend([Phase::ReduceScatterAll, Phase::AllGatherGrads]),
        Stage::Zero1 => p.push(Phase::ReduceScatterAll),
        _ => {}
    }
    p.extend([Phase::Agree, Phase::Optimizer]);
    if matches!(stage, Stage::Zero1 | Stage::Zero2) {
        p.push(Phase::GatherParams);
    }
    p
}

/// The program of a held-out evaluation after a step's update: the forward alone (at stage 3
/// gathering a unit at a time, as the step's forward does, `max_live_units` at once), then the
/// agreement on the losses.
pub fn eval_phases(stage: Stage, units: u32, max_live_units: usize) -> Vec<Phase> {
    let mut p = Vec::new();
    if stage == Stage::Zero3 {
        let ahead = max_live_units.max(1) as u32 - 1;
        gathered_pass(&mut p, (0..units).collect(), ahead, 0, |p, u| {
            p.push(Phase::Forward { unit: u })
        });
    } else {
        p.extend((0..units).map(|u| Phase::Forward { unit: u }));
    }
    p.push(Phase::Agree);
    p
}

/// Whether a step of `ranks` ranks waits for each unit's reduce-scatter right after posting it.
/// With one rank a reduce-scatter moves nothing, so there is nothing to overlap: one exact
/// accumulator is live instead of two, and the reduced shard is handed on (to the optimizer's
/// tier I/O) a unit earlier.
pub fn waits_at_once(ranks: usize) -> bool {
    ranks <= 1
}

/// Inserts each unit's `WaitReduceScatter`: with `lag`, right after the next unit's
/// `ReduceScatterUnit`, and the last one at the end (at most two unit accumulators are live,
/// and a rank waits for a unit's sums only after a whole further backward); without, right
/// after its own.
fn reduce_scatter_waits(p: Vec<Phase>, lag: bool) -> Vec<Phase> {
    let mut out = Vec::with_capacity(p.len() * 2);
    let mut pending = None;
    for ph in p {
        out.push(ph);
        if let Phase::ReduceScatterUnit { unit } = ph {
            if !lag {
                out.push(Phase::WaitReduceScatter { unit });
            } else if let Some(prev) = pending.replace(unit) {
                out.push(Phase::WaitReduceScatter { unit: prev });
            }
        }
    }
    out.extend(pending.map(|unit| Phase::WaitReduceScatter { unit }));
    out
}

/// A pass over `order` where each unit is gathered before `compute` and freed after it, with up
/// to `ahead` later units' gathers posted early (prefetch).
fn gathered_pass(
    p: &mut Vec<Phase>,
    order: Vec<u32>,
    ahead: u32,
    pass: u8,
    compute: impl Fn(&mut Vec<Phase>, u32),
) {
    let mut posted = 0usize;
    for i in 0..order.len() {
        while posted < order.len() && posted <= i + ahead as usize {
            p.push(Phase::PostGather {
                unit: order[posted],
                pass,
            });
            posted += 1;
        }
        let u = order[i];
        p.push(Phase::WaitGather { unit: u, pass });
        compute(p, u);
        p.push(Phase::Free { unit: u });
    }
}

/// Micro-batch indices each member computes: contiguous, balanced blocks in member order. Any
/// assignment gives the same reduced gradient in exact mode; this one only balances work.
pub fn assign_micro_batches(members: &[RankId], micro_batches: u32) -> Vec<(RankId, Range<u32>)> {
    let n = members.len() as u64;
    members
        .iter()
        .enumerate()
        .map(|(i, &r)| {
            let lo = (i as u64 * micro_batches as u64 / n) as u32;
            let hi = ((i as u64 + 1) * micro_batches as u64 / n) as u32;
            (r, lo..hi)
        })
        .collect()
}

/// The most units whose gathered parameters are held at once in a phase program (posted gathers
/// count from `PostGather` until their `Free`: their bytes are in flight to us).
pub fn peak_live_units(phases: &[Phase]) -> usize {
    let mut live = 0usize;
    let mut peak = 0usize;
    for ph in phases {
        match ph {
            Phase::PostGather { .. } => {
                live += 1;
                peak = peak.max(live);
            }
            Phase::Free { .. } => live -= 1,
            _ => {}
        }
    }
    peak
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(p: &[Phase], f: impl Fn(&Phase) -> bool) -> usize {
        p.iter().filter(|x| f(x)).count()
    }

    #[test]
    fn stage3_gathers_twice_and_scatters_once_per_unit() {
        for live in 1..4 {
            let p = phases(Stage::Zero3, 5, live, 2, false);
            assert_eq!(count(&p, |x| matches!(x, Phase::PostGather { .. })), 10);
            assert_eq!(count(&p, |x| matches!(x, Phase::WaitGather { .. })), 10);
            assert_eq!(
                count(&p, |x| matches!(x, Phase::ReduceScatterUnit { .. })),
                5
            );
            assert_eq!(peak_live_units(&p), live.min(5));
            // Every wait follows its post; every compute sits between its wait and free.
            for (i, ph) in p.iter().enumerate() {
                if let Phase::WaitGather { unit, pass } = ph {
                    assert!(p[..i].contains(&Phase::PostGather {
                        unit: *unit,
                        pass: *pass
                    }));
                }
                if let Phase::ReduceScatterUnit { unit } = ph {
                    assert!(p[..i].contains(&Phase::Backward { unit: *unit }));
                }
            }
        }
    }

    /// Each unit's reduce-scatter is posted once and completed once, later, before `Agree`;
    /// no more than two accumulators are ever live; and all ranks wait only for sends that come
    /// earlier in the same program.
    #[test]
    fn reduce_scatter_waits_lag_one_unit() {
        for (stage, units) in [(Stage::Zero2, 1), (Stage::Zero2, 4), (Stage::Zero3, 5)] {
            let p = phases(stage, units, 2, 2, false);
            let agree = p.iter().position(|x| *x == Phase::Agree).unwrap();
            let mut live = 0usize;
            for u in 0..units {
                let post = p
                    .iter()
                    .position(|x| *x == Phase::ReduceScatterUnit { unit: u });
                let wait = p
                    .iter()
                    .position(|x| *x == Phase::WaitReduceScatter { unit: u });
                let (post, wait) = (post.unwrap(), wait.unwrap());
                assert!(post < wait && wait < agree, "{stage:?} unit {u}");
                assert_eq!(count(&p, |x| *x == Phase::WaitReduceScatter { unit: u }), 1);
            }
            for ph in &p {
                match ph {
                    Phase::ReduceScatterUnit { .. } => live += 1,
                    Phase::WaitReduceScatter { .. } => live -= 1,
                    _ => {}
                }
                assert!(live <= 2, "{stage:?}: {live} accumulators live");
            }
            assert_eq!(live, 0);
            // A unit's wait comes after the next unit's backward has run (the overlap).
            if units > 1 {
                let first_wait = p
                    .iter()
                    .position(|x| matches!(x, Phase::WaitReduceScatter { .. }))
                    .unwrap();
                let backwards = count(&p[..first_wait], |x| matches!(x, Phase::Backward { .. }));
                assert_eq!(backwards, 2, "{stage:?}");
            }
        }
    }

    /// With one rank there is nothing to overlap: each wait follows its post, one accumulator
    /// is live, and only the waits moved.
    #[test]
    fn one_rank_waits_for_each_reduce_scatter_at_once() {
        for (stage, units) in [(Stage::Zero2, 4), (Stage::Zero3, 5)] {
            let (one, many) = (
                phases(stage, units, 2, 1, false),
                phases(stage, units, 2, 2, false),
            );
            for (i, ph) in one.iter().enumerate() {
                if let Phase::ReduceScatterUnit { unit } = ph {
                    assert_eq!(one[i + 1], Phase::WaitReduceScatter { unit: *unit });
                }
            }
            let others = |p: &[Phase]| -> Vec<Phase> {
                p.iter()
                    .copied()
                    .filter(|x| !matches!(x, Phase::WaitReduceScatter { .. }))
                    .collect()
            };
            assert_eq!(others(&one), others(&many), "{stage:?}");
            assert_eq!(one.len(), many.len());
            // Updating in the backward, any number of ranks waits at once.
            assert_eq!(phases(stage, units, 2, 2, true), one);
        }
    }

    #[test]
    fn stages_0_to_2_shapes() {
        let p0 = phases(Stage::Zero0, 3, 2, 2, false);
        assert!(p0.contains(&Phase::AllGatherGrads) && !p0.contains(&Phase::GatherParams));
        let p1 = phases(Stage::Zero1, 3, 2, 2, false);
        assert!(p1.contains(&Phase::ReduceScatterAll) && p1.contains(&Phase::GatherParams));
        let p2 = phases(Stage::Zero2, 3, 2, 2, false);
        assert_eq!(
            count(&p2, |x| matches!(x, Phase::ReduceScatterUnit { .. })),
            3
        );
        assert_eq!(peak_live_units(&p2), 0);
    }

    #[test]
    fn micro_batches_cover_exactly_once() {
        for n in 1..7u32 {
            for m in 0..20u32 {
                let members: Vec<RankId> = (0..n).collect();
                let a = assign_micro_batches(&members, m);
                let mut next = 0;
                for (_, r) in &a {
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, m);
                let sizes: Vec<u32> = a.iter().map(|(_, r)| r.len() as u32).collect();
                assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
            }
        }
    }

    #[test]
    fn eval_program_is_the_forward_alone_with_bounded_gathers() {
        for live in 1..4 {
            let p = eval_phases(Stage::Zero3, 6, live);
            assert_eq!(peak_live_units(&p), live);
            assert_eq!(count(&p, |x| matches!(x, Phase::Forward { .. })), 6);
            assert_eq!(count(&p, |x| matches!(x, Phase::Backward { .. })), 0);
            assert_eq!(count(&p, |x| matches!(x, Phase::Optimizer)), 0);
            assert_eq!(p.last(), Some(&Phase::Agree));
        }
        let p = eval_phases(Stage::Zero2, 4, 2);
        assert_eq!(count(&p, |x| matches!(x, Phase::PostGather { .. })), 0);
        assert_eq!(p.len(), 5);
    }
}
