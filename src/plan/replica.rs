//! Who backs up whom: the members form a ring, each member's buddy is the next one on it
//! (wrapping) and holds copies of the chunks that member owns. Pure functions of the shard map.
//!
//! The ring is id order, unless the map knows the members' hosts and there are several: then it
//! deals the members out host by host (the largest host first), so that a buddy sits on another
//! host wherever the numbers allow and losing one host loses no chunk's last copy.

use std::collections::BTreeMap;

use super::shard_map::{RankId, ShardMap};

/// The backup ring: every member once, each backed up by the next.
pub fn ring(map: &ShardMap) -> Vec<RankId> {
    let m = &map.members;
    let host = |r: &RankId| map.hosts.get(r);
    if m.iter().any(|r| host(r).is_none()) {
        return m.clone();
    }
    let mut by_host: BTreeMap<&String, Vec<RankId>> = BTreeMap::new();
    for r in m {
        by_host.entry(&map.hosts[r]).or_default().push(*r);
    }
    if by_host.len() < 2 {
        return m.clone();
    }
    let mut groups: Vec<Vec<RankId>> = by_host.into_values().collect();
    // Largest host first (ties: the host name order kept by the stable sort).
    groups.sort_by_key(|g| std::cmp::Reverse(g.len()));
    let rounds = groups[0].len();
    (0..rounds)
        .flat_map(|i| groups.iter().filter_map(move |g| g.get(i).copied()))
        .collect()
}

/// The member `ahead` places after `rank` on `ring` (wrapping), or `None` in a world of one.
fn neighbour(ring: &[RankId], rank: RankId, ahead: usize) -> Option<RankId> {
    let n = ring.len();
    let at = ring.iter().position(|&m| m == rank)?;
    (n > 1).then(|| ring[(at + ahead) % n])
}

/// The member after `rank` on the ring, or `None` in a world of one.
pub fn buddy(map: &ShardMap, rank: RankId) -> Option<RankId> {
    neighbour(&ring(map), rank, 1)
}

/// The member before `rank` on the ring: the one whose chunks `rank` holds.
pub fn predecessor(map: &ShardMap, rank: RankId) -> Option<RankId> {
    let ring = ring(map);
    neighbour(&ring, rank, ring.len().saturating_sub(1))
}

/// For a rollback after losing `lost`: who holds each chunk's backup (its owner, or the owner's
/// buddy), or the chunks nobody holds.
pub fn holders<'a>(
    map: &'a ShardMap,
    lost: &'a [RankId],
) -> Result<impl Fn(usize, usize) -> RankId + 'a, Vec<(usize, usize)>> {
    let alive = |r: RankId| !lost.contains(&r);
    // The ring once, not once per chunk.
    let ring = ring(map);
    let holder = move |u: usize, i: usize| -> Option<RankId> {
        let o = map.owner(u, i);
        if alive(o) {
            Some(o)
        } else {
            neighbour(&ring, o, 1).filter(|&b| alive(b))
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

    /// With hosts known, buddies sit on other hosts, so losing a whole host loses nothing; in
    /// id order the same loss would.
    #[test]
    fn buddies_go_to_other_hosts_when_hosts_are_known() {
        let mut map = ShardMap::plan(&[64], &[0, 1, 2, 3, 4], 4, 1).unwrap();
        assert!(holders(&map, &[0, 1]).is_err(), "id order: 1 backs up 0");
        for (r, h) in [(0, "a"), (1, "a"), (2, "b"), (3, "b"), (4, "a")] {
            map.hosts.insert(r, h.to_string());
        }
        assert_eq!(ring(&map), vec![0, 2, 1, 3, 4]);
        for r in [0, 1, 2, 3] {
            let b = buddy(&map, r).unwrap();
            assert_ne!(map.hosts[&r], map.hosts[&b], "rank {r} -> {b}");
            assert_eq!(predecessor(&map, b), Some(r));
        }
        // Host b goes: every chunk keeps a copy. (Host a holds 3 of 5, so one a->a pair is
        // unavoidable: 4 backs up to 0.)
        assert!(holders(&map, &[2, 3]).is_ok());
        assert_eq!(buddy(&map, 4), Some(0));
        // One host, or a member of unknown host: id order.
        let mut one = map.clone();
        one.hosts.values_mut().for_each(|h| *h = "a".into());
        assert_eq!(ring(&one), vec![0, 1, 2, 3, 4]);
        map.hosts.remove(&4);
        assert_eq!(ring(&map), vec![0, 1, 2, 3, 4]);
    }

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
