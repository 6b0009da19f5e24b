//! Collectives over the chunked shard map, built on `Comm` point-to-point frames.
//!
//! All-gather: each owner sends the concatenation of its chunks of a unit (ascending chunk order)
//! to every peer; the receiver knows the map, so it can place every chunk. Reduce-scatter: each
//! rank sends, to each owner, its partial sums for that owner's chunks; the owner adds them in
//! ascending member order (which fixes the `fast` mode's float order at a given world size; the
//! `exact` mode does not care). Shards may be uneven: ranks owning nothing of a unit send and
//! receive nothing for it.

use std::ops::Range;

use bytes::Bytes;

use super::comm::{Comm, CommError};
use crate::plan::{RankId, ShardMap};
use crate::reduce::GradBuf;
use crate::runtime::transport::{Tag, Transport};

/// `members` without `me`: the ranks a one-to-all send goes to.
fn others(members: &[RankId], me: RankId) -> Vec<RankId> {
    members.iter().copied().filter(|&r| r != me).collect()
}

/// Sends this rank's chunks of `unit`, concatenated by `payload`, to every peer. The payload is
/// made only when someone receives it: a lone rank would encode a whole unit for nobody.
pub fn post_owned<T: Transport>(
    comm: &mut Comm<T>,
    map: &ShardMap,
    unit: usize,
    tag: Tag,
    payload: impl FnOnce() -> Bytes,
    elems: u64,
    is_param: bool,
) -> Result<(), CommError> {
    let me = comm.rank();
    let peers = others(&map.members, me);
    if map.owned_elems_in_unit(unit, me) == 0 || peers.is_empty() {
        return Ok(());
    }
    comm.send_to_each(&peers, tag, payload())?;
    let sent = elems * peers.len() as u64;
    if is_param {
        comm.count_elems(sent, 0);
    } else {
        comm.count_elems(0, sent);
    }
    Ok(())
}

/// Receives every peer's chunks of `unit` and hands each chunk to `place(range, bytes)`.
pub fn wait_owned<T: Transport>(
    comm: &mut Comm<T>,
    map: &ShardMap,
    unit: usize,
    tag: Tag,
    elem_bytes: usize,
    mut place: impl FnMut(Range<usize>, &[u8]),
) -> Result<(), CommError> {
    let me = comm.rank();
    for &peer in map.members.iter().filter(|&&r| r != me) {
        let expected = map.owned_elems_in_unit(unit, peer) * elem_bytes;
        if expected == 0 {
            continue;
        }
        let payload = comm.recv(peer, tag)?;
        if payload.len() != expected {
            return Err(CommError::Protocol {
                from: peer,
                what: format!("{tag:?}: {} bytes, expected {expected}", payload.len()),
            });
        }
        let mut at = 0;
        for i in map.owned_in_unit(unit, peer) {
            let r = map.chunk_range(unit, i);
            let n = r.len() * elem_bytes;
            place(r, &payload[at..at + n]);
            at += n;
        }
    }
    Ok(())
}

/// Reduce-scatter of one unit's accumulator `acc` (the unit's full length, at `base` within the
/// buffer). Afterwards the positions of the chunks this rank owns hold the sums over all ranks;
/// other positions are left as they were (this rank's own partials).
pub fn reduce_scatter<T: Transport>(
    comm: &mut Comm<T>,
    map: &ShardMap,
    unit: usize,
    tag: Tag,
    acc: &mut GradBuf,
    base: usize,
) -> Result<(), CommError> {
    post_reduce_scatter(comm, map, unit, tag, acc, base)?;
    wait_reduce_scatter(comm, map, unit, tag, acc, base)
}

/// The sending half of `reduce_scatter`: every peer gets my partial sums of the chunks it owns.
/// Sends never block, so the receiving half can run later (after more compute).
pub fn post_reduce_scatter<T: Transport>(
    comm: &mut Comm<T>,
    map: &ShardMap,
    unit: usize,
    tag: Tag,
    acc: &GradBuf,
    base: usize,
) -> Result<(), CommError> {
    let me = comm.rank();
    for &owner in map.members.iter().filter(|&&r| r != me) {
        let ranges: Vec<Range<usize>> = map
            .owned_in_unit(unit, owner)
            .map(|i| map.chunk_range(unit, i))
            .collect();
        let elems: usize = ranges.iter().map(Range::len).sum();
        if elems == 0 {
            continue;
        }
        let mut payload = Vec::with_capacity(elems * acc.bytes() / acc.len().max(1));
        for r in ranges {
            payload.extend(acc.encode(base + r.start..base + r.end));
        }
        comm.send(owner, tag, Bytes::from(payload))?;
        comm.count_elems(0, elems as u64);
    }
    Ok(())
}

/// The receiving half of `reduce_scatter`: adds every peer's partial sums into the chunks this
/// rank owns, in member order (so `fast` mode's `f32` sums do not depend on arrival order).
pub fn wait_reduce_scatter<T: Transport>(
    comm: &mut Comm<T>,
    map: &ShardMap,
    unit: usize,
    tag: Tag,
    acc: &mut GradBuf,
    base: usize,
) -> Result<(), CommError> {
    let me = comm.rank();
    let mine: Vec<Range<usize>> = map
        .owned_in_unit(unit, me)
        .map(|i| map.chunk_range(unit, i))
        .collect();
    let elems: usize = mine.iter().map(Range::len).sum();
    if elems == 0 {
        return Ok(());
    }
    let elem_bytes = acc.bytes() / acc.len().max(1);
    for &peer in map.members.iter().filter(|&&r| r != me) {
        let payload = comm.recv(peer, tag)?;
        if payload.len() != elems * elem_bytes {
            return Err(CommError::Protocol {
                from: peer,
                what: format!(
                    "{tag:?}: {} bytes, expected {}",
                    payload.len(),
                    elems * elem_bytes
                ),
            });
        }
        let mut at = 0;
        for r in &mine {
            let n = r.len() * elem_bytes;
            // Length was checked above, so this cannot fail.
            acc.add_encoded(base + r.start, &payload[at..at + n]);
            at += n;
        }
    }
    Ok(())
}

/// Broadcast: `root` sends `payload` (ignored elsewhere) to every member; every member returns
/// the root's bytes. The same `Bytes` goes to every peer, so the in-process transport copies
/// nothing.
pub fn broadcast<T: Transport>(
    comm: &mut Comm<T>,
    members: &[RankId],
    root: RankId,
    tag: Tag,
    payload: Bytes,
) -> Result<Bytes, CommError> {
    let me = comm.rank();
    if me == root {
        comm.send_to_each(&others(members, me), tag, payload.clone())?;
        Ok(payload)
    } else {
        comm.recv(root, tag)
    }
}

/// Barrier: returns once every member has reached it (or fails with the member that did not
/// arrive before the deadline).
pub fn barrier<T: Transport>(
    comm: &mut Comm<T>,
    members: &[RankId],
    tag: Tag,
) -> Result<(), CommError> {
    exchange_small(comm, members, tag, Bytes::new()).map(|_| ())
}

/// All members with data for a small all-reduce, in ascending order, including this rank's own
/// payload at its position: every rank then combines the same list in the same order.
pub fn exchange_small<T: Transport>(
    comm: &mut Comm<T>,
    members: &[RankId],
    tag: Tag,
    mine: Bytes,
) -> Result<Vec<(RankId, Bytes)>, CommError> {
    let me = comm.rank();
    for &peer in members.iter().filter(|&&r| r != me) {
        comm.send(peer, tag, mine.clone())?;
    }
    let mut out = Vec::with_capacity(members.len());
    for &peer in members {
        if peer == me {
            out.push((me, mine.clone()));
        } else {
            out.push((peer, comm.recv(peer, tag)?));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reduce::ReduceMode;
    use crate::runtime::transport::local::LocalNetwork;
    use crate::runtime::transport::TagKind;
    use crate::wire::f32s::{decode_f32_into, encode_f32};

    #[test]
    fn gather_and_reduce_scatter_on_uneven_shards() {
        let map = ShardMap::plan(&[11], &[0, 1, 2], 2, 0).unwrap();
        let net = LocalNetwork::new();
        let full: Vec<f32> = (0..11).map(|x| x as f32).collect();
        // Every endpoint exists before any rank sends.
        let mut eps: Vec<_> = (0..3u32).map(|r| net.endpoint(r)).collect();
        let handles: Vec<_> = (0..3u32)
            .map(|r| {
                let (map, full) = (map.clone(), full.clone());
                let ep = eps.remove(0);
                std::thread::spawn(move || {
                    let mut comm = Comm::new(ep, 5000);
                    comm.begin_step(0, 0);
                    let tag = Tag {
                        kind: TagKind::Gather,
                        attempt: 0,
                        unit: 0,
                        pass: 0,
                    };
                    let mine = encode_f32(
                        &full,
                        map.owned_in_unit(0, r).map(|i| map.chunk_range(0, i)),
                    );
                    let n = map.owned_elems_in_unit(0, r) as u64;
                    post_owned(&mut comm, &map, 0, tag, || mine, n, true).unwrap();
                    let mut out = vec![-1f32; 11];
                    for i in map.owned_in_unit(0, r) {
                        let rg = map.chunk_range(0, i);
                        out[rg.clone()].copy_from_slice(&full[rg]);
                    }
                    wait_owned(&mut comm, &map, 0, tag, 4, |rg, b| {
                        decode_f32_into(b, &mut out[rg])
                    })
                    .unwrap();
                    assert_eq!(out, full);
                    // Every rank contributes (rank + 1) to each element.
                    let mut acc = GradBuf::zeros(ReduceMode::Exact, 11);
                    if let GradBuf::Exact(v) = &mut acc {
                        v.fill(r as i64 + 1);
                    }
                    let tag = Tag {
                        kind: TagKind::ReduceScatter,
                        ..tag
                    };
                    reduce_scatter(&mut comm, &map, 0, tag, &mut acc, 0).unwrap();
                    let GradBuf::Exact(v) = acc else {
                        unreachable!()
                    };
                    for i in map.owned_in_unit(0, r) {
                        assert!(v[map.chunk_range(0, i)].iter().all(|&x| x == 6));
                    }
                    comm.stats()
                })
            })
            .collect();
        let total: u64 = handles
            .into_iter()
            .map(|h| h.join().unwrap().param_elems_sent)
            .sum();
        assert_eq!(total, 11 * 2); // each element sent to the 2 other ranks once
    }

    #[test]
    fn broadcast_and_barrier_reach_every_member() {
        let net = LocalNetwork::new();
        let members = [0u32, 3, 5];
        let mut eps: Vec<_> = members.iter().map(|&r| net.endpoint(r)).collect();
        let handles: Vec<_> = members
            .iter()
            .map(|&r| {
                let ep = eps.remove(0);
                std::thread::spawn(move || {
                    let mut comm = Comm::new(ep, 5000);
                    comm.begin_step(1, 7);
                    let tag = |kind| Tag {
                        kind,
                        attempt: 0,
                        unit: 0,
                        pass: 0,
                    };
                    let mine = Bytes::from(vec![r as u8; 3]);
                    let got =
                        broadcast(&mut comm, &members, 3, tag(TagKind::Broadcast), mine).unwrap();
                    barrier(&mut comm, &members, tag(TagKind::Barrier)).unwrap();
                    got
                })
            })
            .collect();
        for h in handles {
            assert_eq!(&h.join().unwrap()[..], &[3, 3, 3]);
        }
    }
}
