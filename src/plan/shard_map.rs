//! The shard map: which rank owns which chunk of which unit, stamped with an epoch.
//!
//! Every unit's flat parameter buffer is cut into fixed-size chunks (`chunk_elems`; the last chunk
//! of a unit may be shorter). Ownership is per chunk, so that a later rebalance moves whole chunks
//! and nothing else. The map is plain data: tensors never carry shard attributes, they are indexed
//! by this map, and a new membership produces a new map with a larger epoch.

use std::collections::BTreeMap;
use std::ops::Range;

use serde::{Deserialize, Serialize};

/// A rank's identity. Stable for the life of the rank (a joiner takes the next unused id).
pub type RankId = u32;

/// Errors from building a shard map. All are caller mistakes, reported with what would be valid.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    #[error("the world has no ranks: at least one rank is needed")]
    NoRanks,
    #[error("rank {0} appears twice in the membership list")]
    DuplicateRank(RankId),
    #[error("chunk_elems is 0: it must be at least 1")]
    ZeroChunk,
}

/// One chunk: a contiguous range of one unit's flat buffer.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ChunkId {
    pub unit: u32,
    pub index: u32,
}

/// Chunks of one unit and their owners.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitChunks {
    pub numel: usize,
    pub owners: Vec<RankId>,
}

/// The versioned assignment of every chunk to exactly one member.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardMap {
    pub epoch: u64,
    pub chunk_elems: usize,
    /// Members, sorted ascending.
    pub members: Vec<RankId>,
    pub units: Vec<UnitChunks>,
    /// The host of each member, where known (worker processes): buddy backups go to another
    /// host when the hosts allow it (`plan::replica`). Empty in-process.
    #[serde(default)]
    pub hosts: BTreeMap<RankId, String>,
}

impl ShardMap {
    /// Plans a fresh map: chunks are visited in unit order and each goes to the member holding the
    /// fewest elements so far (ties to the lowest rank id). Greedy list scheduling keeps every
    /// member within one chunk of every other, even when units end in short tail chunks.
    ///
    /// ```
    /// use elastic_zero::plan::ShardMap;
    ///
    /// // Two units of 10 and 3 elements, cut into chunks of 4, over ranks 0 and 1.
    /// let map = ShardMap::plan(&[10, 3], &[0, 1], 4, 1).unwrap();
    /// assert_eq!(map.owned_elems(0) + map.owned_elems(1), 13);
    /// assert!(map.owned_elems(0).abs_diff(map.owned_elems(1)) <= 4);
    /// ```
    pub fn plan(
        unit_numels: &[usize],
        members: &[RankId],
        chunk_elems: usize,
        epoch: u64,
    ) -> Result<Self, PlanError> {
        let members = sorted_members(members)?;
        if chunk_elems == 0 {
            return Err(PlanError::ZeroChunk);
        }
        let mut load = vec![0usize; members.len()];
        let units = unit_numels
            .iter()
            .map(|&numel| {
                let owners = chunk_lengths(numel, chunk_elems)
                    .map(|len| {
                        let slot = least_loaded(&load);
                        load[slot] += len;
                        members[slot]
                    })
                    .collect();
                UnitChunks { numel, owners }
            })
            .collect();
        Ok(Self {
            epoch,
            chunk_elems,
            members,
            units,
            hosts: BTreeMap::new(),
        })
    }

    pub fn world_size(&self) -> usize {
        self.members.len()
    }

    pub fn total_elems(&self) -> usize {
        self.units.iter().map(|u| u.numel).sum()
    }

    /// Element range of chunk `index` within its unit's flat buffer.
    pub fn chunk_range(&self, unit: usize, index: usize) -> Range<usize> {
        let start = index * self.chunk_elems;
        start..(start + self.chunk_elems).min(self.units[unit].numel)
    }

    pub fn owner(&self, unit: usize, index: usize) -> RankId {
        self.units[unit].owners[index]
    }

    /// Chunk indices of `unit` owned by `rank`, ascending.
    pub fn owned_in_unit(&self, unit: usize, rank: RankId) -> impl Iterator<Item = usize> + '_ {
        let owners = &self.units[unit].owners;
        (0..owners.len()).filter(move |&i| owners[i] == rank)
    }

    /// `rank`'s chunks of `unit`, in index order, cut into pieces of at most `max_elems`
    /// elements (a larger chunk is a piece of its own). A rank's chunks of a unit lie next to
    /// each other in its shard whatever their indices, so a piece is one read of its state.
    pub fn owned_pieces_in(&self, unit: usize, rank: RankId, max_elems: usize) -> Vec<Vec<usize>> {
        let mut out: Vec<Vec<usize>> = Vec::new();
        let mut elems = 0;
        for i in self.owned_in_unit(unit, rank) {
            let n = self.chunk_range(unit, i).len();
            match out.last_mut() {
                Some(piece) if elems + n <= max_elems => {
                    piece.push(i);
                    elems += n;
                }
                _ => {
                    out.push(vec![i]);
                    elems = n;
                }
            }
        }
        out
    }

    /// [`ShardMap::owned_pieces_in`] of every unit, in (unit, index) order: (unit, indices).
    pub fn owned_pieces(&self, rank: RankId, max_elems: usize) -> Vec<(usize, Vec<usize>)> {
        (0..self.units.len())
            .flat_map(|u| {
                self.owned_pieces_in(u, rank, max_elems)
                    .into_iter()
                    .map(move |p| (u, p))
            })
            .collect()
    }

    /// [`ShardMap::owned_pieces`] gathered into batches of at most `max_elems` elements
    /// (a piece larger than that is a batch of its own): one message each when the pieces of a
    /// small model would otherwise cost one round trip per unit.
    pub fn owned_batches(&self, rank: RankId, max_elems: usize) -> Vec<Vec<(usize, Vec<usize>)>> {
        let mut out: Vec<Vec<(usize, Vec<usize>)>> = Vec::new();
        let mut elems = 0;
        for (u, p) in self.owned_pieces(rank, max_elems) {
            let n: usize = p.iter().map(|&i| self.chunk_range(u, i).len()).sum();
            match out.last_mut() {
                Some(batch) if elems + n <= max_elems => {
                    batch.push((u, p));
                    elems += n;
                }
                _ => {
                    out.push(vec![(u, p)]);
                    elems = n;
                }
            }
        }
        out
    }

    /// All chunks owned by `rank`, in (unit, index) order.
    pub fn owned_chunks(&self, rank: RankId) -> Vec<ChunkId> {
        (0..self.units.len())
            .flat_map(|u| {
                self.owned_in_unit(u, rank).map(move |i| ChunkId {
                    unit: u as u32,
                    index: i as u32,
                })
            })
            .collect()
    }

    /// Elements of `unit` owned by `rank`.
    pub fn owned_elems_in_unit(&self, unit: usize, rank: RankId) -> usize {
        self.owned_in_unit(unit, rank)
            .map(|i| self.chunk_range(unit, i).len())
            .sum()
    }

    /// Elements owned by `rank` across all units.
    pub fn owned_elems(&self, rank: RankId) -> usize {
        (0..self.units.len())
            .map(|u| self.owned_elems_in_unit(u, rank))
            .sum()
    }

    pub fn is_member(&self, rank: RankId) -> bool {
        self.members.binary_search(&rank).is_ok()
    }

    /// Checks the invariant every epoch must satisfy: each chunk has exactly one owner and that
    /// owner is a member. (Exactly one is structural: `owners` has one entry per chunk.)
    pub fn check(&self) -> Result<(), String> {
        for (u, unit) in self.units.iter().enumerate() {
            let expected = chunk_lengths(unit.numel, self.chunk_elems).count();
            if unit.owners.len() != expected {
                return Err(format!(
                    "unit {u}: {} owners for {expected} chunks",
                    unit.owners.len()
                ));
            }
            if let Some(bad) = unit.owners.iter().find(|r| !self.is_member(**r)) {
                return Err(format!("unit {u}: chunk owned by non-member rank {bad}"));
            }
        }
        Ok(())
    }
}

/// Lengths of the chunks a unit of `numel` elements is cut into (none for an empty unit).
pub fn chunk_lengths(numel: usize, chunk_elems: usize) -> impl Iterator<Item = usize> {
    let n = numel.div_ceil(chunk_elems);
    (0..n).map(move |i| chunk_elems.min(numel - i * chunk_elems))
}

/// Chunk ranges (ascending, disjoint) as one range when each starts where the one before ended:
/// a rank's chunks of a unit that are one run of its elements (`0..0` for none).
pub fn one_run(spans: &[Range<usize>]) -> Option<Range<usize>> {
    let Some(first) = spans.first() else {
        return Some(0..0);
    };
    let mut end = first.end;
    for r in &spans[1..] {
        if r.start != end {
            return None;
        }
        end = r.end;
    }
    Some(first.start..end)
}

pub(crate) fn sorted_members(members: &[RankId]) -> Result<Vec<RankId>, PlanError> {
    if members.is_empty() {
        return Err(PlanError::NoRanks);
    }
    let mut sorted = members.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(PlanError::DuplicateRank(w[0]));
    }
    Ok(sorted)
}

fn least_loaded(load: &[usize]) -> usize {
    // `load` is never empty: members were checked non-empty above.
    let min = *load.iter().min().expect("non-empty membership");
    load.iter().position(|&l| l == min).expect("min is present")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn one_run_joins_ranges_that_follow_each_other() {
        assert_eq!(one_run(&[2..4, 4..8, 8..9]), Some(2..9));
        assert_eq!(one_run(&[Range { start: 3, end: 5 }]), Some(3..5));
        assert_eq!(one_run(&[]), Some(0..0));
        assert_eq!(one_run(&[0..4, 5..8]), None, "a gap");
        assert_eq!(one_run(&[4..8, 0..4]), None, "out of order");
    }

    fn owned_counts(map: &ShardMap) -> Vec<usize> {
        map.members.iter().map(|&r| map.owned_elems(r)).collect()
    }

    #[test]
    fn owned_pieces_cover_each_ranks_chunks_once_within_the_bound() {
        let map = ShardMap::plan(&[100, 37, 0, 64], &[0, 1, 2], 8, 1).unwrap();
        for &r in &map.members {
            let pieces = map.owned_pieces(r, 20);
            let mut seen = Vec::new();
            for (u, p) in &pieces {
                let elems: usize = p.iter().map(|&i| map.chunk_range(*u, i).len()).sum();
                assert!(elems <= 20 || p.len() == 1, "{u}/{p:?}");
                for &i in p {
                    assert_eq!(map.owner(*u, i), r);
                    seen.push(ChunkId {
                        unit: *u as u32,
                        index: i as u32,
                    });
                }
            }
            assert_eq!(seen, map.owned_chunks(r));
            // Batches keep the pieces' order and bound, across units.
            let batches = map.owned_batches(r, 20);
            let flat: Vec<_> = batches.iter().flatten().cloned().collect();
            assert_eq!(flat, pieces);
            for b in &batches {
                let elems: usize = b
                    .iter()
                    .flat_map(|(u, p)| p.iter().map(|&i| map.chunk_range(*u, i).len()))
                    .sum();
                assert!(elems <= 20 || b.len() == 1, "{b:?}");
            }
        }
        // A chunk larger than the bound is a piece of its own.
        assert!(map.owned_pieces_in(0, 0, 1).iter().all(|p| p.len() == 1));
        assert_eq!(map.owned_batches(0, usize::MAX).len(), 1);
    }

    #[test]
    fn one_rank_owns_everything() {
        let map = ShardMap::plan(&[10, 0, 7], &[0], 4, 1).unwrap();
        assert_eq!(map.owned_elems(0), 17);
        assert_eq!(map.units[1].owners.len(), 0);
        map.check().unwrap();
    }

    #[test]
    fn units_smaller_than_world() {
        let map = ShardMap::plan(&[3], &[0, 1, 2, 3], 4, 1).unwrap();
        assert_eq!(owned_counts(&map), vec![3, 0, 0, 0]);
    }

    #[test]
    fn rejects_bad_input() {
        assert_eq!(ShardMap::plan(&[1], &[], 4, 0), Err(PlanError::NoRanks));
        assert_eq!(
            ShardMap::plan(&[1], &[2, 2], 4, 0),
            Err(PlanError::DuplicateRank(2))
        );
        assert_eq!(ShardMap::plan(&[1], &[0], 0, 0), Err(PlanError::ZeroChunk));
    }

    #[test]
    fn short_tail_chunks_do_not_pile_up_on_one_rank() {
        // Each unit is one full chunk plus one element: round-robin would give rank 1 only tails.
        let map = ShardMap::plan(&[5; 8], &[0, 1], 4, 0).unwrap();
        let c = owned_counts(&map);
        assert!(c[0].abs_diff(c[1]) <= 4, "{c:?}");
    }

    proptest! {
        #[test]
        fn every_element_has_one_owner_and_shards_balance(
            numels in proptest::collection::vec(0usize..300, 0..12),
            world in 1u32..9,
            chunk in 1usize..64,
        ) {
            let members: Vec<RankId> = (0..world).map(|r| r * 3 + 1).collect();
            let map = ShardMap::plan(&numels, &members, chunk, 7).unwrap();
            map.check().unwrap();
            // Exactly one owner per element: per-unit owned ranges tile the unit.
            for (u, &n) in numels.iter().enumerate() {
                let mut covered = vec![0u8; n];
                for &r in &members {
                    for i in map.owned_in_unit(u, r) {
                        for e in map.chunk_range(u, i) { covered[e] += 1; }
                    }
                }
                prop_assert!(covered.iter().all(|&c| c == 1));
            }
            let c = owned_counts(&map);
            let (lo, hi) = (c.iter().min().unwrap(), c.iter().max().unwrap());
            prop_assert!(hi - lo <= chunk, "{c:?} chunk {chunk}");
            prop_assert_eq!(c.iter().sum::<usize>(), numels.iter().sum::<usize>());
            // Same inputs, same map; member order does not matter.
            let mut rev = members.clone();
            rev.reverse();
            prop_assert_eq!(&map, &ShardMap::plan(&numels, &rev, chunk, 7).unwrap());
        }
    }
}
