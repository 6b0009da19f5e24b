//! Who backs up whom: each member's buddy is the next member in id order (wrapping), and holds
//! copies of the chunks that member owns. Pure functions of the shard map.

use super::shard_map::{RankId, ShardMap};

/// The member after `rank` in id order (wrapping), or `None` in a world of one.
pub fn buddy(map: &ShardMap, rank: RankId) -> Option<RankId> {
    let n = map.members.len();
    let at = map.members.iter().position(|&m| m == rank)?;
    (n > 1).then(|| map.members[(at + 1) % n])
}

/// The member before `rank` in id order (wrapping): the one whose chunks `rank` holds.
pub fn predecessor(map: &ShardMap, rank: RankId) -> Option<RankId> {
    let n = map.members.len();
    let at = map.members.iter().position(|&m| m == rank)?;
    (n > 1).then(|| map.members[(at + n - 1) % n])
}

/// For a rollback after losing `lost`: who holds each chunk's backup (its owner, or the owner's
/// buddy), or the chunks nobody holds.
pub fn holders<'a>(
    map: &'a ShardMap,
    lost: &'a [RankId],
) -> Result<impl Fn(usize, usize) -> RankId + 'a, Vec<(usize, usize)>> {
    let alive = |r: RankId| !lost.contains(&r);
    let holder = move |u: usize, i: usize| -> Option<RankId> {
        let o = map.owner(u, i);
        if alive(o) {
            Some(o)
        } else {
            buddy(map, o).filter(|&b| alive(b))
        }
    };
    let missing: Vec<(usize, usize)> = (0..map.units.len())
        .flat_map(|u| (0..map.units[u].owners.len()).map(move |i| (u, i)))
        .filter(|&(u, i)| holder(u, i).is_none())
        .collect();
    if missing.is_empty() {
        Ok(move |u, i| holder(u, i).expect("every chunk has a live holder"))
    } else {
        Err(missing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buddies_form_a_ring_and_holders_cover_single_losses() {
        let map = ShardMap::plan(&[40], &[0, 2, 5], 4, 1).unwrap();
        assert_eq!(buddy(&map, 0), Some(2));
        assert_eq!(buddy(&map, 5), Some(0));
        assert_eq!(predecessor(&map, 0), Some(5));
        let h = holders(&map, &[2]).ok().unwrap();
        for i in map.owned_in_unit(0, 2) {
            assert_eq!(h(0, i), 5, "rank 2's buddy holds its chunks");
        }
        // A rank and its buddy together: their chunks are lost, and named.
        let missing = holders(&map, &[2, 5]).err().unwrap();
        assert_eq!(missing.len(), map.owned_in_unit(0, 2).count());
        let solo = ShardMap::plan(&[8], &[3], 4, 1).unwrap();
        assert!(holders(&solo, &[3]).is_err());
    }
}
