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

use crate::plan::shard_map::one_run;
use crate::plan::{RankId, ShardMap};
use crate::reduce::GradBuf;
use crate::runtime::step::comm::{Comm, CommError};
use crate::runtime::transport::{Tag, Transport};

/// `members` without `me`: the ranks a one-to-all send goes to.
pub fn others(members: &[RankId], me: RankId) -> Vec<RankId> {
    members.iter().copied().filter(|&r| r != me).collect()
}

/// The element ranges that bytes `bytes` of the concatenation of `spans` (element ranges, in
/// order, `elem_bytes` each) cover. Piece boundaries are multiples of every element width, so a
/// piece never splits an element.
fn sub_spans(
    spans: &[Range<usize>],
    elem_bytes: usize,
    bytes: Range<usize>,
) -> impl Iterator<Item = Range<usize>> + '_ {
    let (lo, hi) = (bytes.start / elem_bytes, bytes.end / elem_bytes);
    let mut at = 0;
    spans.iter().filter_map(move |r| {
        let (s, e) = (at, at + r.len());
        at = e;
        let (a, b) = (s.max(lo), e.min(hi));
        (a < b).then(|| r.start + (a - s)..r.start + (b - s))
    })
}

/// The ranges of `owner`'s chunks of `unit`, in ascending chunk order (the order of its payload).
fn owned_spans(map: &ShardMap, unit: usize, owner: RankId) -> Vec<Range<usize>> {
    map.owned_in_unit(unit, owner)
        .map(|i| map.chunk_range(unit, i))
        .collect()
}

/// Appends bytes `bytes` of the payload made of `spans` to `out`: `encode(range, out)` appends
/// the encoding of each element range they cover.
fn encode_bytes(
    spans: &[Range<usize>],
    elem_bytes: usize,
    bytes: Range<usize>,
    out: &mut Vec<u8>,
    mut encode: impl FnMut(Range<usize>, &mut Vec<u8>),
) {
    for r in sub_spans(spans, elem_bytes, bytes) {
        encode(r, out);
    }
}

/// Hands the piece `bytes`, at byte `offset` of the payload made of `spans`, to
/// `place(range, bytes)` one element range at a time.
fn place_piece(
    spans: &[Range<usize>],
    elem_bytes: usize,
    offset: usize,
    bytes: &[u8],
    mut place: impl FnMut(Range<usize>, &[u8]),
) {
    let mut at = 0;
    for r in sub_spans(spans, elem_bytes, offset..offset + bytes.len()) {
        let n = r.len() * elem_bytes;
        place(r, &bytes[at..at + n]);
        at += n;
    }
}

/// Sends this rank's chunks of `unit`, concatenated by `payload`, to every peer, in pieces. The
/// payload is made only when someone receives it: a lone rank would encode a whole unit for
/// nobody.
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
    comm.send_pieces(&peers, tag, payload())?;
    count_owned(comm, elems * peers.len() as u64, is_param);
    Ok(())
}

/// `post_owned` with the payload encoded piece by piece: `encode(range, out)` appends the
/// encoding of elements `range` of `unit` (`elem_bytes` each) to `out`.
#[allow(clippy::too_many_arguments)]
pub fn post_owned_with<T: Transport>(
    comm: &mut Comm<T>,
    map: &ShardMap,
    unit: usize,
    tag: Tag,
    elem_bytes: usize,
    mut encode: impl FnMut(Range<usize>, &mut Vec<u8>),
    is_param: bool,
) -> Result<(), CommError> {
    let spans = owned_spans(map, unit, comm.rank());
    // The payload's elements `elems`, counted as one "byte" each, through the spans they cover.
    let encode = |elems, out: &mut Vec<u8>| encode_bytes(&spans, 1, elems, out, &mut encode);
    post_own_encoded(comm, map, unit, tag, elem_bytes, encode, is_param)
}

/// `post_owned` of a payload encoded piece by piece from this rank's chunks of `unit` laid end
/// to end: `encode(range, out)` appends the encoding of the payload's elements `range`
/// (`elem_bytes` each) to `out`. Where the transport takes a checksum, it is taken while each
/// block is in cache, and no buffer holds the whole payload.
pub fn post_own_encoded<T: Transport>(
    comm: &mut Comm<T>,
    map: &ShardMap,
    unit: usize,
    tag: Tag,
    elem_bytes: usize,
    mut encode: impl FnMut(Range<usize>, &mut Vec<u8>),
    is_param: bool,
) -> Result<(), CommError> {
    let me = comm.rank();
    let peers = others(&map.members, me);
    let elems = map.owned_elems_in_unit(unit, me);
    if elems == 0 || peers.is_empty() {
        return Ok(());
    }
    // Piece and block boundaries are multiples of every element width.
    comm.send_pieces_encoded(&peers, tag, elems * elem_bytes, |bytes, out| {
        encode(bytes.start / elem_bytes..bytes.end / elem_bytes, out)
    })?;
    count_owned(comm, (elems * peers.len()) as u64, is_param);
    Ok(())
}

fn count_owned<T: Transport>(comm: &mut Comm<T>, sent: u64, is_param: bool) {
    if is_param {
        comm.count_elems(sent, 0);
    } else {
        comm.count_elems(0, sent);
    }
}

/// Receives every peer's chunks of `unit` and hands each piece of a chunk to
/// `place(range, bytes)` (a chunk larger than a piece arrives in several).
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
        recv_spans(
            comm,
            peer,
            tag,
            &owned_spans(map, unit, peer),
            elem_bytes,
            &mut place,
        )?;
    }
    Ok(())
}

/// Receives `peer`'s payload made of element ranges `spans` and hands each piece of a range to
/// `place(range, bytes)`.
fn recv_spans<T: Transport>(
    comm: &mut Comm<T>,
    peer: RankId,
    tag: Tag,
    spans: &[Range<usize>],
    elem_bytes: usize,
    mut place: impl FnMut(Range<usize>, &[u8]),
) -> Result<(), CommError> {
    let expected = spans.iter().map(Range::len).sum::<usize>() * elem_bytes;
    if expected == 0 {
        return Ok(());
    }
    comm.recv_pieces(peer, tag, expected, |off, bytes| {
        place_piece(spans, elem_bytes, off, bytes, &mut place)
    })
}

/// `wait_owned` into `dest`, the unit's elements encoded back to back (`elem_bytes` each, in
/// the wire's byte order): a peer whose chunks of the unit are one run of elements sends
/// exactly the bytes of that run, so its payload is received straight into `dest` where the
/// transport can (UCX lends the memory; no copy after the transfer). Other peers' pieces are
/// copied in chunk by chunk.
pub fn wait_owned_into<T: Transport>(
    comm: &mut Comm<T>,
    map: &ShardMap,
    unit: usize,
    tag: Tag,
    elem_bytes: usize,
    dest: &mut [u8],
) -> Result<(), CommError> {
    let me = comm.rank();
    for &peer in map.members.iter().filter(|&&r| r != me) {
        let spans = owned_spans(map, unit, peer);
        match one_run(&spans) {
            Some(run) if !run.is_empty() => {
                let bytes = run.start * elem_bytes..run.end * elem_bytes;
                comm.recv_pieces_into(peer, tag, &mut dest[bytes])?;
            }
            Some(_) => {}
            None => recv_spans(comm, peer, tag, &spans, elem_bytes, |r, b| {
                dest[r.start * elem_bytes..r.end * elem_bytes].copy_from_slice(b)
            })?,
        }
    }
    Ok(())
}

/// All-gather of `unit` into `dest`, the unit's elements encoded back to back (`elem_bytes`
/// each, in the wire's byte order): every peer's chunks land in `dest`, and `send(comm, mine)`
/// sends this rank's (`mine`: its bytes in `dest`, `None` when some member's chunks are not
/// one run of elements). When every member's chunks are one run, a peer's payload is exactly the bytes
/// of its run, so the receives are lent before `send` runs and the payloads land in place
/// where the transport can (UCX: no copy after the transfer, even for a peer that sends at
/// once). Otherwise the pieces are copied in as they come.
pub fn all_gather_into<T: Transport>(
    comm: &mut Comm<T>,
    map: &ShardMap,
    unit: usize,
    tag: Tag,
    elem_bytes: usize,
    dest: &mut [u8],
    send: impl FnOnce(&mut Comm<T>, Option<&[u8]>) -> Result<(), CommError>,
) -> Result<(), CommError> {
    let Some(runs) = member_runs(map, unit, elem_bytes) else {
        send(comm, None)?;
        return wait_owned_into(comm, map, unit, tag, elem_bytes, dest);
    };
    let (mine, dests) = split_runs(dest, runs, comm.rank());
    comm.recv_pieces_into_after(tag, dests, |c| send(c, Some(mine)))
}

/// Each member's chunks of `unit` as one run of bytes (`elem_bytes` an element), the
/// non-empty ones in ascending order; `None` when some member's chunks are not one run.
pub fn member_runs(
    map: &ShardMap,
    unit: usize,
    elem_bytes: usize,
) -> Option<Vec<(RankId, Range<usize>)>> {
    let mut runs: Vec<(RankId, Range<usize>)> = map
        .members
        .iter()
        .map(|&r| {
            one_run(&owned_spans(map, unit, r))
                .map(|run| (r, run.start * elem_bytes..run.end * elem_bytes))
        })
        .collect::<Option<_>>()?;
    runs.retain(|(_, r)| !r.is_empty());
    runs.sort_by_key(|(_, r)| r.start);
    Some(runs)
}

/// Disjoint borrows of `buf` by [`member_runs`]' `runs`: `me`'s run (empty if it has none),
/// and each other member's.
pub fn split_runs(
    buf: &mut [u8],
    runs: Vec<(RankId, Range<usize>)>,
    me: RankId,
) -> (&mut [u8], Vec<(RankId, &mut [u8])>) {
    let (mut rest, mut at) = (buf, 0);
    let (mut mine, mut others): (&mut [u8], Vec<(RankId, &mut [u8])>) = (&mut [], Vec::new());
    for (r, run) in runs {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(run.start - at);
        let (this, tail) = tail.split_at_mut(run.len());
        (rest, at) = (tail, run.end);
        if r == me {
            mine = this;
        } else {
            others.push((r, this));
        }
    }
    (mine, others)
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

/// The sending half of `reduce_scatter`: every peer gets my partial sums of the chunks it owns,
/// encoded piece by piece. Sends never block, so the receiving half can run later (after more
/// compute).
pub fn post_reduce_scatter<T: Transport>(
    comm: &mut Comm<T>,
    map: &ShardMap,
    unit: usize,
    tag: Tag,
    acc: &GradBuf,
    base: usize,
) -> Result<(), CommError> {
    let me = comm.rank();
    let eb = acc.elem_bytes();
    for &owner in map.members.iter().filter(|&&r| r != me) {
        let spans = owned_spans(map, unit, owner);
        let elems: usize = spans.iter().map(Range::len).sum();
        if elems == 0 {
            continue;
        }
        comm.send_pieces_encoded(&[owner], tag, elems * eb, |bytes, out| {
            encode_bytes(&spans, eb, bytes, out, |r, out| {
                acc.encode_into(base + r.start..base + r.end, out)
            })
        })?;
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
    let mine = owned_spans(map, unit, me);
    let elems: usize = mine.iter().map(Range::len).sum();
    if elems == 0 {
        return Ok(());
    }
    let eb = acc.elem_bytes();
    for &peer in map.members.iter().filter(|&&r| r != me) {
        comm.recv_pieces(peer, tag, elems * eb, |off, bytes| {
            place_piece(&mine, eb, off, bytes, |r, b| {
                // Lengths were checked by `recv_pieces`, so this cannot fail.
                acc.add_encoded(base + r.start, b);
            })
        })?;
    }
    Ok(())
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
    use crate::wire::frame::PIECE_BYTES;

    /// The tag of unit 0's first try, first pass.
    fn tag(kind: TagKind) -> Tag {
        Tag {
            kind,
            attempt: 0,
            unit: 0,
            pass: 0,
            piece: 0,
        }
    }

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
                        piece: 0,
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
    fn sub_spans_cover_a_piece_across_chunk_boundaries() {
        let spans = [10..14, 20..21, 30..36];
        let got = |b: Range<usize>| sub_spans(&spans, 4, b).collect::<Vec<_>>();
        assert_eq!(got(0..44), vec![10..14, 20..21, 30..36]);
        assert_eq!(got(8..24), vec![12..14, 20..21, 30..31]);
        assert_eq!(got(20..28), vec![30..32]);
        assert_eq!(got(44..44), Vec::<Range<usize>>::new());
    }

    /// Units far larger than a piece, on uneven shards whose chunk boundaries fall inside
    /// pieces: the gather places every element and the reduce-scatter sums every one, in both
    /// reduction modes, and the bytes go as pieces (more frames than chunks).
    #[test]
    fn collectives_in_pieces_on_uneven_chunks() {
        collectives_in_pieces_over(LocalNetwork::new());
    }

    /// The same over a network that duplicates, reorders, loses (late retransmission) and
    /// damages frames: pieces are matched by number, so a late or doubled piece is neither
    /// applied twice nor in the wrong place, and a damaged one never.
    #[test]
    fn collectives_in_pieces_survive_a_misbehaving_network() {
        use crate::runtime::transport::local::NetFaults;
        let net = LocalNetwork::with_faults(NetFaults {
            seed: 7,
            duplicate_per_mille: 200,
            reorder_per_mille: 200,
            drop_per_mille: 100,
            corrupt_per_mille: 100,
            delay_max_ms: 2,
            retransmit_ms: 20,
            ..NetFaults::default()
        });
        collectives_in_pieces_over(net.clone());
        let c = net.counts();
        assert!(
            c.corrupted > 0 && c.duplicated > 0 && c.reordered > 0,
            "{c:?}"
        );
        assert_eq!(
            c.rejected, c.corrupted,
            "every damaged piece was caught: {c:?}"
        );
    }

    fn collectives_in_pieces_over(net: std::sync::Arc<LocalNetwork>) {
        let numel = 5 * PIECE_BYTES / 4 + 12_345;
        // Chunks of a size that no piece boundary divides.
        let map = ShardMap::plan(&[numel], &[0, 1, 2], 700_001, 0).unwrap();
        let mut eps: Vec<_> = (0..3u32).map(|r| net.endpoint(r)).collect();
        let handles: Vec<_> = (0..3u32)
            .map(|r| {
                let map = map.clone();
                let ep = eps.remove(0);
                std::thread::spawn(move || {
                    let mut comm = Comm::new(ep, 20_000);
                    comm.begin_step(0, 0);
                    let full: Vec<f32> = (0..numel).map(|x| (x % 9973) as f32).collect();
                    let mut out = vec![-1f32; numel];
                    for i in map.owned_in_unit(0, r) {
                        let rg = map.chunk_range(0, i);
                        out[rg.clone()].copy_from_slice(&full[rg]);
                    }
                    let t = tag(TagKind::Gather);
                    post_owned_with(
                        &mut comm,
                        &map,
                        0,
                        t,
                        4,
                        |rg, o| crate::wire::f32s::put_f32s(o, &full[rg]),
                        true,
                    )
                    .unwrap();
                    wait_owned(&mut comm, &map, 0, t, 4, |rg, b| {
                        decode_f32_into(b, &mut out[rg])
                    })
                    .unwrap();
                    assert!(out == full, "rank {r} gathered every element");
                    for mode in [ReduceMode::Exact, ReduceMode::Fast] {
                        let mut acc = GradBuf::zeros(mode, numel + 3);
                        match &mut acc {
                            GradBuf::Exact(v) => v.fill(r as i64 + 1),
                            GradBuf::Fast(v) => v.fill(r as f32 + 1.0),
                        }
                        let t = Tag {
                            unit: mode as u32,
                            ..tag(TagKind::ReduceScatter)
                        };
                        reduce_scatter(&mut comm, &map, 0, t, &mut acc, 3).unwrap();
                        for i in map.owned_in_unit(0, r) {
                            let rg = map.chunk_range(0, i);
                            let ok = match &acc {
                                GradBuf::Exact(v) => {
                                    v[3 + rg.start..3 + rg.end].iter().all(|&x| x == 6)
                                }
                                GradBuf::Fast(v) => {
                                    v[3 + rg.start..3 + rg.end].iter().all(|&x| x == 6.0)
                                }
                            };
                            assert!(ok, "rank {r} chunk {i} holds the sum ({mode:?})");
                        }
                    }
                    comm.stats().frames_sent
                })
            })
            .collect();
        for h in handles {
            // Each rank owns about 1.7 M elements: 2 pieces of f32 to each of 2 peers, then
            // about 3 (exact) and 2 (fast) pieces of partial sums to each owner.
            assert!(h.join().unwrap() >= 4 + 2 * 3 + 2 * 2);
        }
    }
}
