//! Rebalancing: a new shard map for a new membership that moves as few chunks as possible.
//!
//! Chunks of members that stay keep their owner unless balance requires otherwise; chunks of
//! departed members go to the least-loaded survivors; joiners take chunks from the most-loaded
//! members until every member is within one chunk of every other. The result is a pure function
//! of the old map and the new membership, so every rank and the coordinator compute the same one.

use serde::{Deserialize, Serialize};

use super::shard_map::{sorted_members, PlanError, RankId, ShardMap};

/// One chunk changing owner.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Move {
    pub unit: u32,
    pub index: u32,
    pub from: RankId,
    pub to: RankId,
    pub elems: usize,
}

/// The new map (epoch + 1) and the moves that turn `old` into it, in (unit, index) order.
pub fn rebalance(old: &ShardMap, members: &[RankId]) -> Result<(ShardMap, Vec<Move>), PlanError> {
    let members = sorted_members(members)?;
    let mut map = ShardMap {
        epoch: old.epoch + 1,
        members: members.clone(),
        ..old.clone()
    };
    map.hosts.retain(|r, _| members.binary_search(r).is_ok());
    let slot = |r: RankId| members.binary_search(&r).ok();
    let mut load = vec![0usize; members.len()];
    let mut orphans = Vec::new();
    for (u, unit) in old.units.iter().enumerate() {
        for (i, &owner) in unit.owners.iter().enumerate() {
            match slot(owner) {
                Some(s) => load[s] += old.chunk_range(u, i).len(),
                None => orphans.push((u, i)),
            }
        }
    }
    for (u, i) in orphans {
        let s = least(&load);
        load[s] += old.chunk_range(u, i).len();
        map.units[u].owners[i] = members[s];
    }
    // Even out: move chunks from the most to the least loaded member while that narrows the gap
    // and the gap exceeds one chunk. Each move strictly reduces the sum of squared loads, so the
    // loop ends; the count bound is a guard, not the expected exit.
    let total_chunks: usize = map.units.iter().map(|u| u.owners.len()).sum();
    for _ in 0..=total_chunks {
        let (hi, lo) = (most(&load), least(&load));
        let gap = load[hi] - load[lo];
        if gap <= map.chunk_elems {
            break;
        }
        // The largest chunk of `hi` that still narrows the gap, last in (unit, index) order.
        let pick = chunks_of(&map, members[hi])
            .filter(|&(_, _, len)| len > 0 && len < gap)
            .max_by_key(|&(u, i, len)| (len, u, i));
        let Some((u, i, len)) = pick else { break };
        map.units[u].owners[i] = members[lo];
        load[hi] -= len;
        load[lo] += len;
    }
    let moves = diff(old, &map);
    Ok((map, moves))
}

/// Chunks whose owner differs between two maps of the same model.
pub fn diff(old: &ShardMap, new: &ShardMap) -> Vec<Move> {
    let mut moves = Vec::new();
    for (u, (a, b)) in old.units.iter().zip(&new.units).enumerate() {
        for (i, (&from, &to)) in a.owners.iter().zip(&b.owners).enumerate() {
            if from != to {
                moves.push(Move {
                    unit: u as u32,
                    index: i as u32,
                    from,
                    to,
                    elems: new.chunk_range(u, i).len(),
                });
            }
        }
    }
    moves
}

/// A lower bound on the elements any rebalance to `members` must move: every chunk of a
/// departed member, and enough for each member to reach the balanced floor (average minus one
/// chunk) from what it already owns.
pub fn min_move_elems(old: &ShardMap, members: &[RankId]) -> usize {
    let total = old.total_elems();
    let orphaned: usize = old
        .members
        .iter()
        .filter(|r| !members.contains(r))
        .map(|&r| old.owned_elems(r))
        .sum();
    let floor = (total / members.len().max(1)).saturating_sub(old.chunk_elems);
    let deficit: usize = members
        .iter()
        .map(|&r| {
            floor.saturating_sub(if old.is_member(r) {
                old.owned_elems(r)
            } else {
                0
            })
        })
        .sum();
    orphaned.max(deficit)
}

fn chunks_of(map: &ShardMap, rank: RankId) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    (0..map.units.len()).flat_map(move |u| {
        map.owned_in_unit(u, rank)
            .map(move |i| (u, i, map.chunk_range(u, i).len()))
    })
}

fn least(load: &[usize]) -> usize {
    let min = load.iter().copied().min().unwrap_or(0);
    load.iter().position(|&l| l == min).unwrap_or(0)
}

fn most(load: &[usize]) -> usize {
    let max = load.iter().copied().max().unwrap_or(0);
    load.iter().position(|&l| l == max).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn balanced(map: &ShardMap) -> bool {
        let loads: Vec<usize> = map.members.iter().map(|&r| map.owned_elems(r)).collect();
        loads.iter().max().unwrap() - loads.iter().min().unwrap() <= map.chunk_elems
    }

    #[test]
    fn a_leave_moves_only_the_leavers_chunks() {
        let old = ShardMap::plan(&[10_000, 7_000, 3_000], &[0, 1, 2, 3], 100, 1).unwrap();
        let (new, moves) = rebalance(&old, &[0, 1, 3]).unwrap();
        assert_eq!(new.epoch, 2);
        new.check().unwrap();
        assert!(balanced(&new));
        assert!(moves.iter().all(|m| m.from == 2));
        let moved: usize = moves.iter().map(|m| m.elems).sum();
        assert_eq!(moved, old.owned_elems(2));
        assert_eq!(moved, min_move_elems(&old, &[0, 1, 3]));
    }

    #[test]
    fn a_join_moves_about_one_share_to_the_joiner() {
        let old = ShardMap::plan(&[10_000, 7_000, 3_000], &[0, 1, 2], 100, 1).unwrap();
        let (new, moves) = rebalance(&old, &[0, 1, 2, 3]).unwrap();
        assert!(balanced(&new));
        assert!(moves.iter().all(|m| m.to == 3));
        let moved: usize = moves.iter().map(|m| m.elems).sum();
        let min = min_move_elems(&old, &[0, 1, 2, 3]);
        assert!(
            moved as f64 <= 1.1 * min as f64 + 100.0,
            "moved {moved} min {min}"
        );
    }

    proptest! {
        #[test]
        fn any_membership_change_gives_a_valid_balanced_map(
            numels in proptest::collection::vec(0usize..500, 1..8),
            old_world in 1u32..7,
            keep_mask in 0u32..128,
            joins in 0u32..4,
            chunk in 1usize..40,
        ) {
            let old_members: Vec<RankId> = (0..old_world).collect();
            let old = ShardMap::plan(&numels, &old_members, chunk, 3).unwrap();
            let mut members: Vec<RankId> = old_members.iter().copied().filter(|r| keep_mask & (1 << r) != 0).collect();
            members.extend(old_world..old_world + joins);
            prop_assume!(!members.is_empty());
            let (new, moves) = rebalance(&old, &members).unwrap();
            new.check().unwrap();
            prop_assert!(balanced(&new));
            prop_assert_eq!(new.epoch, old.epoch + 1);
            // Moves are exactly the owner changes, and no chunk of a staying member moves
            // unless balance needed it.
            prop_assert_eq!(&moves, &diff(&old, &new));
            let moved: usize = moves.iter().map(|m| m.elems).sum();
            prop_assert!(moved >= min_move_elems(&old, &members));
            prop_assert_eq!(rebalance(&old, &members).unwrap(), (new, moves));
        }
    }
}
