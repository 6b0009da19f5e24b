//! The compute's working set at its peak: what a rank holds beside its resident state while
//! it runs a unit's forward or backward, found by walking the units in the schedule's order
//! rather than adding each kind's largest size, which counts at once buffers that are never
//! live together (a tied LM's embedding is both the largest gathered unit and the largest
//! accumulator, but not at the same moment as the head's view of it).

use crate::plan::Stage;

/// One unit as the working set sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitSize {
    /// Parameters the unit owns.
    pub own_elems: u64,
    /// What its forward and backward compute on: its own parameters and those it borrows from
    /// an earlier unit (`model::tie`).
    pub view_elems: u64,
}

/// A tied parameter: `elems` of unit `owner`'s parameters that unit `user` also computes with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TieSize {
    pub owner: usize,
    pub user: usize,
    pub elems: u64,
}

/// What decides the working set besides the units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepShape {
    pub stage: Stage,
    /// Bytes per gradient accumulator element (8 exact, 4 fast).
    pub grad_elem_bytes: u64,
    /// Bytes per element of the parameters the model computes with (4 fp32, 2 bf16).
    pub param_copy_bytes: u64,
    /// Stage 3: units gathered at once (the one computing and those prefetched).
    pub max_live_units: u64,
}

/// Peak bytes of the working set: the largest of the forward's and the backward's, unit by
/// unit. At each unit of the backward a rank holds the gathered units of the prefetch window,
/// the f32 gradient of one micro-batch for the unit's view, the accumulators of this unit and
/// of the one after it (stages 2-3 wait for a unit's reduce-scatter only after the next
/// unit's backward), an owner's accumulator from its user's backward to its own, and the
/// copy of a tied parameter from the owner's forward to the user's backward.
pub fn compute_bytes(units: &[UnitSize], ties: &[TieSize], s: StepShape) -> u64 {
    let n = units.len();
    if n == 0 {
        return 0;
    }
    // Stage 3 gathers units; under bf16 at stages 0-2 a unit is widened for its pass.
    let gathers = s.stage == Stage::Zero3 || s.param_copy_bytes < 4;
    let live = (s.max_live_units.max(1) as usize).min(n);
    let sharded_grads = matches!(s.stage, Stage::Zero2 | Stage::Zero3);
    let gathered = |i: usize, backward: bool| -> u64 {
        if !gathers {
            return 0;
        }
        let window = match backward {
            true => i.saturating_sub(live - 1)..=i,
            false => i..=(i + live - 1).min(n - 1),
        };
        4 * window.map(|j| units[j].view_elems).sum::<u64>()
    };
    let lent = |i: usize, backward: bool| -> u64 {
        let held = |t: &&TieSize| match backward {
            true => t.user == i,
            false => t.owner <= i && i <= t.user,
        };
        4 * ties.iter().filter(held).map(|t| t.elems).sum::<u64>()
    };
    let forward = (0..n).map(|i| gathered(i, false) + lent(i, false));
    let backward = (0..n).map(|i| {
        let accumulators = match sharded_grads {
            true => s.grad_elem_bytes * accumulator_elems(units, ties, i),
            // Stages 0-1 accumulate into their resident whole-model gradients; one unit's
            // worth is kept as a margin.
            false => s.grad_elem_bytes * units[i].own_elems,
        };
        gathered(i, true) + lent(i, true) + 4 * units[i].view_elems + accumulators
    });
    forward.chain(backward).max().unwrap_or(0)
}

/// Stages 2-3: accumulator elements live during unit `i`'s backward.
fn accumulator_elems(units: &[UnitSize], ties: &[TieSize], i: usize) -> u64 {
    let lagged = units.get(i + 1).map_or(0, |u| u.own_elems);
    // An owner's accumulator opens at its user's backward (the user adds the tied part) and
    // stays until the owner's own backward has been reduced.
    let owners: u64 = ties
        .iter()
        .filter(|t| t.owner < i && i <= t.user)
        .map(|t| units[t.owner].own_elems)
        .sum();
    units[i].own_elems + lagged + owners
}

/// `count` units of `elems` each, untied: the planner's tests.
#[cfg(test)]
pub fn uniform(count: u64, elems: u64) -> Vec<UnitSize> {
    (0..count)
        .map(|_| UnitSize {
            own_elems: elems,
            view_elems: elems,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(stage: Stage) -> StepShape {
        StepShape {
            stage,
            grad_elem_bytes: 8,
            param_copy_bytes: 4,
            max_live_units: 2,
        }
    }

    #[test]
    fn uniform_units_hold_two_gathered_two_accumulators_and_a_micro_batch_gradient() {
        let units = uniform(10, 1000);
        assert_eq!(
            compute_bytes(&units, &[], shape(Stage::Zero3)),
            (8 + 16 + 4) * 1000
        );
        // Stage 1: no gathers, one accumulator's margin and the micro-batch gradient.
        assert_eq!(
            compute_bytes(&units, &[], shape(Stage::Zero1)),
            (8 + 4) * 1000
        );
    }

    /// A tied LM: a large embedding (0), small blocks, a head (last) that borrows the
    /// embedding's table.
    fn tied_lm() -> (Vec<UnitSize>, Vec<TieSize>) {
        let (table, block) = (1000, 100);
        let mut units = vec![UnitSize {
            own_elems: table + 10,
            view_elems: table + 10,
        }];
        units.extend(uniform(4, block));
        units.push(UnitSize {
            own_elems: 1,
            view_elems: 1 + table,
        });
        let ties = vec![TieSize {
            owner: 0,
            user: 5,
            elems: table,
        }];
        (units, ties)
    }

    #[test]
    fn a_tied_lm_counts_the_embedding_once_where_it_is_live() {
        let (units, ties) = tied_lm();
        let got = compute_bytes(&units, &ties, shape(Stage::Zero3));
        // The head's backward: its view and the last block gathered (4 x (1001 + 100)), the
        // lent copy (4 x 1000), its micro-batch gradient (4 x 1001), its own accumulator and
        // the owner's (8 x (1 + 1010)).
        let head = 4 * (1001 + 100) + 4 * 1000 + 4 * 1001 + 8 * (1 + 1010);
        // The embedding's backward: it and block 1 (4 x 1110 gathered, 8 x 1110 accumulated)
        // and its micro-batch gradient: less.
        let embedding = 4 * 1110 + 4 * 1010 + 8 * 1110;
        assert!(head > embedding);
        assert_eq!(got, head);
        // Adding each kind's largest size would count the embedding three times more.
        let naive = 4 * 2 * 1011 + (2 * 8 + 4) * 1011 + 8 * 1000 + 8 * 1011;
        assert!(got < naive, "{got} vs {naive}");
    }

    #[test]
    fn the_owner_accumulator_is_live_between_the_users_backward_and_its_own() {
        let (units, ties) = tied_lm();
        assert_eq!(accumulator_elems(&units, &ties, 3), 100 + 100 + 1010);
        assert_eq!(accumulator_elems(&units, &ties, 5), 1 + 1010);
        // Block 1: its lagged successor and the owner (unit 0, next in the backward).
        assert_eq!(accumulator_elems(&units, &ties, 1), 100 + 100 + 1010);
        // The owner itself: counted once.
        assert_eq!(accumulator_elems(&units, &ties, 0), 1010 + 100);
    }
}
