//! All-reduce of one unit's accumulator, with its reduce-scatter and all-gather pipelined by
//! piece: a piece of this rank's sums goes out as soon as every peer's partial sums of it are
//! in, so the gather overlaps the rest of the reduce-scatter.

use super::all_reduce_pull::all_reduce_pulled;
use crate::plan::{RankId, ShardMap};
use crate::reduce::{GradBuf, ReduceMode};
use crate::runtime::step::comm::collectives::{
    member_runs, others, post_owned_with, post_reduce_scatter, split_runs, wait_owned,
    wait_reduce_scatter,
};
use crate::runtime::step::comm::{place_later, Comm, CommError, Lend};
use crate::runtime::transport::{AddFn, Tag, Transport};
use crate::wire::frame::pieces;

/// All-reduce of one unit's accumulator `acc` (the unit's full length): afterwards every
/// position holds the sum over all members, each chunk's sum made by its owner in member order
/// as [`reduce_scatter`] makes it, so the result is bit for bit that of a reduce-scatter
/// followed by an all-gather of the sums.
///
/// The two halves are pipelined by piece: each piece of this rank's chunks goes out to the
/// peers as soon as every peer's partial sums of it have been added, so the gather runs while
/// the reduce-scatter's later pieces still come. Where the transport can read every peer's
/// memory (UCX on one host) each rank pulls what it needs straight out of the peers'
/// accumulators instead ([`all_reduce_pulled`]). When every member's chunks of the unit are one
/// run, both halves land in place where the transport can (UCX): the peers' partial sums in
/// `scratch` (grown to (members − 1) × this rank's bytes, kept by the caller for the next
/// call), the peers' sums straight in `acc`. Otherwise the two halves run one after the other.
/// `tags`: the reduce-scatter's and the gather's. On an error `acc` holds an unspecified mix
/// of partial and total sums (partial sums may have been added in place).
pub fn all_reduce<T: Transport>(
    comm: &mut Comm<T>,
    map: &ShardMap,
    unit: usize,
    tags: [Tag; 2],
    acc: &mut GradBuf,
    scratch: &mut Vec<u8>,
) -> Result<(), CommError> {
    let me = comm.rank();
    let (mode, eb) = (acc.mode(), acc.elem_bytes());
    let runs = member_runs(map, unit, eb);
    let (Some(runs), Some(bytes)) = (runs, acc.le_bytes_mut()) else {
        return one_after_the_other(comm, map, unit, tags, acc);
    };
    // Disjoint borrows of the accumulator: this rank's sums, and each peer's run to gather.
    let (mine, mut gather) = split_runs(bytes, runs, me);
    let peers = others(&map.members, me);
    if comm.can_pull_all(&peers) {
        return all_reduce_pulled(comm, tags, mode, eb, &peers, mine, &mut gather);
    }
    let n = mine.len();
    // Peers' partial sums of my chunks are added into my sums as they arrive where the order
    // of the additions cannot change them (fixed-point sums, or a single peer's), else they
    // land in `scratch` and are added in member order; their sums go to their runs of `acc`.
    // One pointer per buffer, taken once; none of them is reborrowed while lent.
    let adding = matches!(mode, ReduceMode::Exact) || peers.len() == 1;
    if !adding {
        scratch.resize(scratch.len().max(n * peers.len()), 0);
    }
    let (mine_at, partials) = (mine.as_mut_ptr(), scratch.as_mut_ptr());
    let mut loans: Vec<Lend> = Vec::new();
    if n > 0 {
        for (k, &p) in peers.iter().enumerate() {
            loans.push(match adding {
                true => (p, tags[0], mine_at, n, Some(addition(mode))),
                // SAFETY: `scratch` holds `n` bytes for each peer.
                false => (p, tags[0], unsafe { partials.add(k * n) }, n, None),
            });
        }
    }
    let gather_from = loans.len();
    loans.extend(
        gather
            .iter_mut()
            .map(|(p, d)| (*p, tags[1], d.as_mut_ptr(), d.len(), None)),
    );
    let pipeline = Pipeline {
        tags,
        mode,
        eb,
        peers: &peers,
        mine_at,
        n,
        adding,
        loans: &loans,
        gather_from,
    };
    // SAFETY: the lent memory (`scratch`'s and the peers' runs of `acc`, borrowed by `gather`
    // until the end) outlives the call; `Pipeline::run` says how it reads what is lent.
    unsafe { pipeline.run(comm)? };
    drop(gather);
    Ok(())
}

/// The reduce-scatter, then the gather of the sums: for a unit whose members' chunks are not
/// one run each (nothing to lend as a whole), or an accumulator with no byte view.
fn one_after_the_other<T: Transport>(
    comm: &mut Comm<T>,
    map: &ShardMap,
    unit: usize,
    [rs, ag]: [Tag; 2],
    acc: &mut GradBuf,
) -> Result<(), CommError> {
    let eb = acc.elem_bytes();
    post_reduce_scatter(comm, map, unit, rs, acc, 0)?;
    wait_reduce_scatter(comm, map, unit, rs, acc, 0)?;
    let a = &*acc;
    post_owned_with(
        comm,
        map,
        unit,
        ag,
        eb,
        |r, out| a.encode_into(r, out),
        false,
    )?;
    wait_owned(comm, map, unit, ag, eb, |r, b| {
        acc.set_encoded(r.start, b);
    })
}

/// One pipelined all-reduce over lent memory: this rank's `n` bytes of sums at `mine_at`,
/// `loans[..gather_from]` for the peers' partial sums of them, `loans[gather_from..]` for the
/// peers' sums of their own runs.
struct Pipeline<'a> {
    tags: [Tag; 2],
    mode: ReduceMode,
    eb: usize,
    peers: &'a [RankId],
    mine_at: *mut u8,
    n: usize,
    adding: bool,
    loans: &'a [Lend],
    gather_from: usize,
}

impl Pipeline<'_> {
    /// # Safety
    /// Every loan's memory stays valid until this returns. The body reads a piece of a
    /// partial-sums loan only once `recv_piece` said it landed. It also reads each peer's run
    /// of `acc` (this rank's partial sums of it) while that run is lent for the peer's sums: a
    /// piece of it is read before its reduce-scatter frame goes, and the peer sends its sums
    /// of that piece only once it has that frame (and every other member's), so the read is
    /// over before anything lands there.
    unsafe fn run<T: Transport>(&self, comm: &mut Comm<T>) -> Result<(), CommError> {
        let gathers = &self.loans[self.gather_from..];
        let mut later = Vec::new();
        comm.lent(self.loans, |c, any_lent| {
            let deadline = c.deadline();
            // This rank's partial sums go out once every loan is open: the peers' arrive
            // meanwhile and land in place (staged payloads do not wait for a late loan).
            for &(p, _, at, len, _) in gathers.iter().filter(|l| l.3 > 0) {
                let run = std::slice::from_raw_parts(at, len);
                let rs = self.tags[0];
                c.send_pieces_encoded(&[p], rs, len, |b, out| out.extend_from_slice(&run[b]))?;
                c.count_elems(0, (len / self.eb) as u64);
            }
            // A rank owning nothing of the unit gets no partial sums (`pieces(0)` is one
            // empty piece).
            let n = self.n;
            for (i, r) in pieces(n)
                .take(if n > 0 { usize::MAX } else { 0 })
                .enumerate()
            {
                self.sum_piece(c, i, r.clone(), deadline)?;
                // Every loan of this piece has landed or was never matched: nothing but this
                // rank writes it now.
                let sums: &[u8] = std::slice::from_raw_parts(self.mine_at.add(r.start), r.len());
                c.send_encoded(
                    self.peers,
                    self.tags[1].piece(i as u32),
                    r.clone(),
                    |b, out| out.extend_from_slice(&sums[b.start - r.start..b.end - r.start]),
                )?;
            }
            if n > 0 {
                c.count_elems(0, (n / self.eb * self.peers.len()) as u64);
            }
            c.recv_all_lent(gathers, any_lent, deadline, &mut later)
        })?;
        place_later(gathers, later);
        Ok(())
    }

    /// Adds every peer's partial sums of piece `i` (bytes `r` of this rank's sums) into it, in
    /// member order: those that landed in `scratch` and those that came with their frame.
    ///
    /// # Safety
    /// As [`Pipeline::run`]; the piece is read and written through the pointer lent, since the
    /// transport may be adding into later pieces meanwhile.
    unsafe fn sum_piece<T: Transport>(
        &self,
        c: &mut Comm<T>,
        i: usize,
        r: std::ops::Range<usize>,
        deadline: crate::runtime::clock::Deadline,
    ) -> Result<(), CommError> {
        let piece = || std::slice::from_raw_parts_mut(self.mine_at.add(r.start), r.len());
        let mut unlent = Vec::new();
        for (k, &p) in self.peers.iter().enumerate() {
            match c.recv_piece(p, self.tags[0], i, self.n, deadline)? {
                None if self.adding => {}
                None => {
                    let at = self.loans[k].2.add(r.start);
                    let landed = std::slice::from_raw_parts(at, r.len());
                    self.mode.add_encoded_into(piece(), landed);
                }
                Some(b) if self.adding => unlent.push(b),
                Some(b) => self.mode.add_encoded_into(piece(), &b),
            }
        }
        for b in unlent {
            self.mode.add_encoded_into(piece(), &b);
        }
        Ok(())
    }
}

/// `mode`'s addition of encoded sums, for a transport to add a payload into lent memory.
fn addition(mode: ReduceMode) -> AddFn {
    match mode {
        ReduceMode::Exact => |d, s| ReduceMode::Exact.add_encoded_into(d, s),
        ReduceMode::Fast => |d, s| ReduceMode::Fast.add_encoded_into(d, s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reduce::ReduceMode;
    use crate::runtime::transport::local::LocalNetwork;
    use crate::runtime::transport::TagKind;
    use crate::wire::frame::PIECE_BYTES;

    /// `all_reduce` gives, bit for bit, the owner-order sums that a reduce-scatter then a
    /// gather gives: pipelined on runs of several pieces, one half after the other on
    /// interleaved chunks, with a member that owns nothing, in both modes, twice with one
    /// scratch, and over a network that duplicates, reorders, loses and damages frames.
    #[test]
    fn all_reduce_is_the_owner_order_sums_bit_for_bit() {
        let piece_elems = PIECE_BYTES / 4;
        // (numel, chunk): one run each of 2 pieces (f32) or 3 (i64); interleaved chunks; a
        // member with nothing (4 elements in chunks of 2 over 3 ranks).
        let runs = 3 * (piece_elems * 3 / 2) + 7;
        for (numel, chunk) in [(runs, runs.div_ceil(3)), (100_003, 7_001), (4, 2)] {
            let map = ShardMap::plan(&[numel], &[0, 1, 2], chunk, 0).unwrap();
            let net = LocalNetwork::new();
            check_all_reduce((0..3).map(|r| net.endpoint(r)).collect(), &map);
        }
        use crate::runtime::transport::local::NetFaults;
        let net = LocalNetwork::with_faults(NetFaults {
            seed: 11,
            duplicate_per_mille: 200,
            reorder_per_mille: 200,
            drop_per_mille: 100,
            corrupt_per_mille: 100,
            delay_max_ms: 2,
            retransmit_ms: 20,
            ..NetFaults::default()
        });
        let map = ShardMap::plan(&[runs], &[0, 1, 2], runs.div_ceil(3), 0).unwrap();
        check_all_reduce((0..3).map(|r| net.endpoint(r)).collect(), &map);
        let c = net.counts();
        assert!(c.corrupted > 0 && c.rejected == c.corrupted, "{c:?}");
    }

    /// The same over the UCX plane (engines in this process), pulling: each rank reads the
    /// peers' partial sums and sums out of their accumulators, with the same bits, at 3 and 2
    /// members, over runs of several pieces and blocks.
    #[cfg(feature = "ucx")]
    #[ignore = "needs libucx0 (apt-get install libucx0)"]
    #[test]
    fn all_reduce_over_ucx_pulls_from_peers_memory_with_the_same_bits() {
        use crate::runtime::transport::ucx::transports_for_tests;
        for (n, numel) in [
            (3u32, 3 * (PIECE_BYTES / 4 + 5120)),
            (2, 2 * PIECE_BYTES / 3 + 11),
        ] {
            let (engines, eps) = transports_for_tests(n);
            let members: Vec<u32> = (0..n).collect();
            let map = ShardMap::plan(&[numel], &members, numel.div_ceil(n as usize), 0).unwrap();
            check_all_reduce(eps, &map);
            for e in &engines {
                let c = e.counts();
                assert!(c.pulls > 0 && c.pulled_bytes > 0, "{n} members: {c:?}");
                assert_eq!(c.staged + c.lent, 0, "{n} members: nothing staged: {c:?}");
            }
        }
    }

    /// The same over the UCX plane with pulls off (three engines in this process): the peers'
    /// partial sums and sums are received into lent memory while the pipeline runs, with the
    /// same bits. Each rank's run is a 4 MiB piece and one of 20 KiB: too short to lend for
    /// but sent by rendezvous, which the engine kept back for loans, so the wait for it ran to
    /// the deadline.
    #[cfg(feature = "ucx")]
    #[ignore = "needs libucx0 (apt-get install libucx0)"]
    #[test]
    fn all_reduce_over_ucx_lands_in_place_with_the_same_bits() {
        use crate::runtime::transport::ucx::engine::EngineConfig;
        use crate::runtime::transport::ucx::transports_for_tests_with;
        let no_pulls = |r| EngineConfig {
            pulls: false,
            ..EngineConfig::shared_memory(r)
        };
        let (engines, eps) = transports_for_tests_with(3, no_pulls);
        let numel = 3 * (PIECE_BYTES / 4 + 5120);
        let map = ShardMap::plan(&[numel], &[0, 1, 2], numel.div_ceil(3), 0).unwrap();
        check_all_reduce(eps, &map);
        let lent: u64 = engines.iter().map(|e| e.counts().lent).sum();
        assert!(lent > 0, "some pieces landed in lent memory");
        // Staged in shared memory: fixed-point partial sums added in place as they arrive
        // (any order gives the same sums); with two members, f32 ones too (one peer each).
        let staged: u64 = engines.iter().map(|e| e.counts().staged).sum();
        assert!(staged > 0, "payloads went through the staging segments");
        let (engines, eps) = transports_for_tests_with(2, no_pulls);
        let numel = 2 * (3 * PIECE_BYTES / 8 + 77);
        let map = ShardMap::plan(&[numel], &[0, 1], numel.div_ceil(2), 0).unwrap();
        check_all_reduce(eps, &map);
        assert!(engines.iter().all(|e| e.counts().staged > 0));
        assert!(
            engines.iter().all(|e| e.counts().added > 0),
            "partial sums added in place"
        );
    }

    /// Rank `r`'s addend for element `i`: large terms of both signs beside small ones, so that
    /// summing in another order changes the `f32` bits.
    fn addend(mode: ReduceMode, r: u32, i: usize) -> GradBuf {
        let small = ((i * 7919) % 1000) as f32 * 1e-3;
        match mode {
            ReduceMode::Fast => GradBuf::Fast(vec![match r {
                0 => 1e7 + small,
                1 => -1e7 + 3.0 * small,
                _ => 0.5 * small + 0.25,
            }]),
            ReduceMode::Exact => GradBuf::Exact(vec![
                (i as i64 * 1_000_003 + r as i64).wrapping_mul(0x9E37_79B9_7F4A_7C15u64 as i64)
            ]),
        }
    }

    /// The sums `all_reduce` must leave: each chunk's owner's addend, then the others' in
    /// member order.
    fn owner_order_sums(map: &ShardMap, inputs: &[GradBuf]) -> GradBuf {
        let mut out = inputs[0].clone();
        for &o in &map.members {
            for c in map.owned_in_unit(0, o) {
                let rg = map.chunk_range(0, c);
                out.copy_from(rg.start, &inputs[o as usize], rg.clone());
                for &p in map.members.iter().filter(|&&p| p != o) {
                    let mut b = Vec::new();
                    inputs[p as usize].encode_into(rg.clone(), &mut b);
                    assert!(out.add_encoded(rg.start, &b));
                }
            }
        }
        out
    }

    /// Runs `all_reduce` twice in each mode on one thread per endpoint (ranks 0.. in order)
    /// over unit 0 of `map`, and checks every rank's result against [`owner_order_sums`].
    pub(crate) fn check_all_reduce<T: Transport + Send + 'static>(eps: Vec<T>, map: &ShardMap) {
        let numel = map.total_elems();
        let n = eps.len();
        let mut want = Vec::new();
        let mut inputs = Vec::new();
        for (m, mode) in [ReduceMode::Fast, ReduceMode::Exact]
            .into_iter()
            .enumerate()
        {
            let ins: Vec<GradBuf> = (0..n as u32)
                .map(|r| {
                    let mut g = GradBuf::zeros(mode, numel);
                    for i in 0..numel {
                        g.copy_from(i, &addend(mode, r, i), 0..1);
                    }
                    g
                })
                .collect();
            let once = owner_order_sums(map, &ins);
            let twice = owner_order_sums(map, &vec![once.clone(); n]);
            want.push((m, once, twice));
            inputs.push(ins);
        }
        let handles: Vec<_> = eps
            .into_iter()
            .enumerate()
            .map(|(r, ep)| {
                let map = map.clone();
                let mine: Vec<GradBuf> = inputs.iter().map(|ins| ins[r].clone()).collect();
                std::thread::spawn(move || {
                    let mut comm = Comm::new(ep, 20_000);
                    comm.begin_step(0, 0);
                    let mut scratch = Vec::new();
                    let mut got = Vec::new();
                    for (m, mut acc) in mine.into_iter().enumerate() {
                        let mut rounds = Vec::new();
                        for round in 0..2u32 {
                            let t = |kind| Tag {
                                kind,
                                attempt: 0,
                                unit: 2 * m as u32 + round,
                                pass: 0,
                                piece: 0,
                            };
                            let tags = [t(TagKind::ReduceScatter), t(TagKind::GatherGrads)];
                            all_reduce(&mut comm, &map, 0, tags, &mut acc, &mut scratch).unwrap();
                            rounds.push(acc.clone());
                        }
                        got.push(rounds);
                    }
                    // A frame the faulty network holds back goes once the rank sends or waits
                    // again: the last one must not stay held when the thread ends.
                    comm.flush();
                    got
                })
            })
            .collect();
        for (r, h) in handles.into_iter().enumerate() {
            let got = h.join().unwrap();
            for (m, once, twice) in &want {
                assert!(got[*m][0] == *once, "rank {r}, mode {m}: the first sums");
                assert!(got[*m][1] == *twice, "rank {r}, mode {m}: the second sums");
            }
        }
    }
}
