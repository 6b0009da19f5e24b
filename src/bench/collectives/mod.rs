//! Collective bandwidth over any `Transport`: all-gather, reduce-scatter, all-reduce and
//! broadcast, on f32 buffers. The gathers and reduce-scatters are the training step's own
//! (`runtime::step::comm::collectives`, direct sends to every peer); the all-reduce and the
//! broadcast, which training does not run, live here with their one-copy pulls over UCX.
//!
//! Definitions follow nccl-tests (and `../shared/peers/collectives.py`, the gloo baseline):
//! `bytes` is the largest buffer (all-gather output, reduce-scatter input, the all-reduce or
//! broadcast tensor); `algbw = bytes / t`; `busbw = algbw * (n-1)/n` for all-gather and
//! reduce-scatter, `* 2(n-1)/n` for all-reduce, `* 1` for broadcast; GB = 1e9 bytes. `t` is the
//! mean time per op of a back-to-back loop, the maximum over ranks.
//!
//! Design: docs/transports.md (pulls); results: BENCHMARKS.md.

mod all_reduce;
mod all_reduce_pull;
pub mod broadcast;
mod broadcast_pull;
mod pull_notice;

use std::time::Instant;

use bytes::Bytes;
use serde::Serialize;

use crate::plan::{RankId, ShardMap};
use crate::reduce::le::le_bytes_mut;
use crate::reduce::GradBuf;
use crate::runtime::step::comm::collectives::{
    all_gather_into, exchange_small, post_owned, reduce_scatter, wait_owned,
};
use crate::runtime::step::comm::{Comm, CommError};
use crate::runtime::transport::{Tag, TagKind, Transport};
use crate::wire::f32s::{decode_f32_into, encode_f32};
use all_reduce::all_reduce;
use broadcast::{broadcast, broadcast_into};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    AllGather,
    ReduceScatter,
    AllReduce,
    Broadcast,
}

pub const ALL_OPS: [Op; 4] = [
    Op::AllGather,
    Op::ReduceScatter,
    Op::AllReduce,
    Op::Broadcast,
];

impl Op {
    pub fn parse(s: &str) -> Option<Op> {
        Some(match s {
            "all_gather" => Op::AllGather,
            "reduce_scatter" => Op::ReduceScatter,
            "all_reduce" => Op::AllReduce,
            "broadcast" => Op::Broadcast,
            _ => return None,
        })
    }

    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllGather | Op::ReduceScatter => (n - 1.0) / n,
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::Broadcast => 1.0,
        }
    }
}

/// One measured op and size (one JSON line).
#[derive(Clone, Debug, Serialize)]
pub struct CollResult {
    pub op: Op,
    pub bytes: usize,
    pub time_s: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
    pub transport: String,
    pub nprocs: usize,
    /// `processes` (one OS process per rank) or `threads` (ranks as threads of one process).
    pub mode: String,
    pub iters: usize,
    /// CPU seconds used by all ranks during the timed loop, divided by its wall time (2.0 = two
    /// cores busy).
    pub cpu_util: f64,
}

/// Timed loop length for `bytes`: about 512 MiB per op, 3..=50 iterations.
pub fn default_iters(bytes: usize) -> usize {
    ((512usize << 20) / bytes.max(1)).clamp(3, 50)
}

/// CPU seconds this process has used (user + system), from /proc; 0 where unavailable.
pub fn process_cpu_s() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0);
    // USER_HZ is 100 on every Linux configuration we run on.
    (ticks(11) + ticks(12)) / 100.0
}

/// Tags are unique per (op run, iteration): the whole benchmark is one Comm step, because
/// `Comm::begin_step` drops frames that a faster rank already sent for the next step.
fn tag(kind: TagKind, run: u64, iter: usize) -> Tag {
    Tag {
        kind,
        attempt: 0,
        unit: (run as u32) << 12 | iter as u32,
        pass: 0,
        piece: 0,
    }
}

/// State for one op and size on one rank: buffers are allocated once, outside the timing.
struct Bufs {
    map: ShardMap,
    mine: Bytes,
    out: Vec<f32>,
    acc: GradBuf,
    /// Where an all-reduce's peers' partial sums land.
    scratch: Vec<u8>,
    root_payload: Bytes,
}

fn one<T: Transport>(
    comm: &mut Comm<T>,
    op: Op,
    b: &mut Bufs,
    members: &[RankId],
    run: u64,
    iter: usize,
) -> Result<(), CommError> {
    let tag = |kind, iter| tag(kind, run, iter);
    let map = &b.map;
    match op {
        Op::AllGather => {
            let t = tag(TagKind::Gather, iter);
            let n = b.mine.len() as u64 / 4;
            let mine = &b.mine;
            let send = |c: &mut Comm<T>| post_owned(c, map, 0, t, || mine.clone(), n, true);
            // Received in place where the transport can (as a tensor would be).
            match le_bytes_mut(&mut b.out) {
                Some(out) => all_gather_into(comm, map, 0, t, 4, out, |c, _| send(c)),
                None => {
                    send(comm)?;
                    let out = &mut b.out;
                    wait_owned(comm, map, 0, t, 4, |r, bytes| {
                        decode_f32_into(bytes, &mut out[r])
                    })
                }
            }
        }
        Op::ReduceScatter => reduce_scatter(
            comm,
            map,
            0,
            tag(TagKind::ReduceScatter, iter),
            &mut b.acc,
            0,
        ),
        Op::AllReduce => all_reduce(
            comm,
            map,
            0,
            [
                tag(TagKind::ReduceScatter, iter),
                tag(TagKind::GatherGrads, iter),
            ],
            &mut b.acc,
            &mut b.scratch,
        ),
        Op::Broadcast => {
            // Receivers land the bytes in their tensor as they arrive, as a real broadcast
            // would; the root's tensor already holds them (gloo's root copies nothing either).
            let (root, t) = (members[0], tag(TagKind::Broadcast, iter));
            let payload = b.root_payload.clone();
            if let Some(out) = le_bytes_mut(&mut b.out) {
                return broadcast_into(comm, members, root, t, payload, out);
            }
            let out = &mut b.out;
            broadcast(
                comm,
                members,
                root,
                t,
                payload,
                out.len() * 4,
                |at, bytes| decode_f32_into(bytes, &mut out[at / 4..]),
            )
        }
    }
}

/// Runs `op` on `bytes` (a multiple of 4 * members) on this rank: `warmup` untimed and `iters`
/// timed iterations (at most 4000 in all). Every member calls this with the same arguments, in
/// the same order, with a distinct `run` per call (below 2^20) and the same `comm` step.
/// Returns (max over ranks of the mean seconds per op, sum over ranks of CPU seconds in the
/// timed loop, max wall).
pub fn run_op<T: Transport>(
    comm: &mut Comm<T>,
    members: &[RankId],
    op: Op,
    bytes: usize,
    warmup: usize,
    iters: usize,
    run: u64,
) -> Result<(f64, f64, f64), CommError> {
    let n = members.len();
    let numel = bytes / 4;
    let me = comm.rank();
    let map = ShardMap::plan(&[numel], members, numel.div_ceil(n).max(1), 0).map_err(|e| {
        CommError::Protocol {
            from: me,
            what: e.to_string(),
        }
    })?;
    let full: Vec<f32> = (0..numel).map(start_value).collect();
    let mut b = Bufs {
        mine: encode_f32(
            &full,
            map.owned_in_unit(0, me).map(|i| map.chunk_range(0, i)),
        ),
        out: vec![0.0; numel],
        acc: GradBuf::Fast(full.clone()),
        scratch: Vec::new(),
        root_payload: if me == members[0] {
            encode_f32(&full, std::iter::once(0..numel))
        } else {
            Bytes::new()
        },
        map,
    };
    drop(full);
    // Iteration numbers live in 12 bits of the tag.
    let (warmup, iters) = (warmup.min(95), iters.clamp(1, 4000));
    for i in 0..warmup {
        one(comm, op, &mut b, members, run, i)?;
    }
    crate::runtime::step::comm::collectives::barrier(comm, members, tag(TagKind::Barrier, run, 0))?;
    let cpu0 = process_cpu_s();
    let t0 = Instant::now();
    for i in warmup..warmup + iters {
        one(comm, op, &mut b, members, run, i)?;
    }
    // Every rank stops its clocks once all are done: a broadcast's root returns as soon as
    // its sends are queued, and its transport encrypts them afterwards, so without this its
    // CPU time would be counted over a window that misses most of the work.
    crate::runtime::step::comm::collectives::barrier(comm, members, tag(TagKind::Barrier, run, 1))?;
    let wall = t0.elapsed().as_secs_f64();
    let cpu = process_cpu_s() - cpu0;
    verify(op, &b, members, me, warmup + iters).map_err(|what| CommError::Protocol {
        from: me,
        what: format!("{op:?} of {bytes} bytes gave a wrong result: {what}"),
    })?;
    let mut mine = wall.to_le_bytes().to_vec();
    mine.extend_from_slice(&cpu.to_le_bytes());
    let all = exchange_small(
        comm,
        members,
        tag(TagKind::Agree, run, 0),
        Bytes::from(mine),
    )?;
    let (mut max_wall, mut cpu_sum) = (0f64, 0f64);
    for (_, b) in all {
        if b.len() == 16 {
            max_wall = max_wall.max(f64::from_le_bytes(b[..8].try_into().expect("8 bytes")));
            cpu_sum += f64::from_le_bytes(b[8..].try_into().expect("8 bytes"));
        }
    }
    Ok((max_wall / iters as f64, cpu_sum, max_wall))
}

/// The value every element starts from (the benchmark's tensor).
fn start_value(i: usize) -> f32 {
    (i % 1024) as f32
}

/// Checks, after `rounds` runs of `op`, that this rank holds what the op should have left it:
/// bandwidth measured over wrong bytes must not be reported. All-gather and broadcast: every
/// received element is the sender's. All-reduce: every rank starts from the same tensor, so
/// each round turns every element `v` into `v` plus the others' `v` in member order (the
/// owner's `fast`-mode sum), the same float operations here. Reduce-scatter leaves partial
/// sums that depend on the rounds' interleaving, and is not checked.
fn verify(op: Op, b: &Bufs, members: &[RankId], me: RankId, rounds: usize) -> Result<(), String> {
    let wrong =
        |i: usize, got: f32, want: f32| Err(format!("element {i} is {got}, expected {want}"));
    match op {
        Op::AllGather => {
            for &peer in members.iter().filter(|&&r| r != me) {
                for c in b.map.owned_in_unit(0, peer) {
                    for i in b.map.chunk_range(0, c) {
                        if b.out[i].to_bits() != start_value(i).to_bits() {
                            return wrong(i, b.out[i], start_value(i));
                        }
                    }
                }
            }
        }
        Op::Broadcast if me != members[0] => {
            for (i, &v) in b.out.iter().enumerate() {
                if v.to_bits() != start_value(i).to_bits() {
                    return wrong(i, v, start_value(i));
                }
            }
        }
        Op::AllReduce => {
            let GradBuf::Fast(acc) = &b.acc else {
                return Err("the benchmark reduces in fast mode".into());
            };
            let want: Vec<f32> = (0..1024)
                .map(|i| {
                    (0..rounds).fold(start_value(i), |v, _| {
                        (1..members.len()).fold(v, |sum, _| sum + v)
                    })
                })
                .collect();
            for (i, &v) in acc.iter().enumerate() {
                if v.to_bits() != want[i % 1024].to_bits() {
                    return wrong(i, v, want[i % 1024]);
                }
            }
        }
        Op::Broadcast | Op::ReduceScatter => {}
    }
    Ok(())
}

/// Builds the JSON record from `run_op`'s numbers.
#[allow(clippy::too_many_arguments)]
pub fn result(
    op: Op,
    bytes: usize,
    time_s: f64,
    cpu_s: f64,
    wall_s: f64,
    transport: &str,
    nprocs: usize,
    mode: &str,
    iters: usize,
) -> CollResult {
    let algbw = bytes as f64 / time_s / 1e9;
    CollResult {
        op,
        bytes,
        time_s,
        algbw_gbps: algbw,
        busbw_gbps: algbw * op.bus_factor(nprocs),
        transport: transport.into(),
        nprocs,
        mode: mode.into(),
        iters,
        cpu_util: if wall_s > 0.0 { cpu_s / wall_s } else { 0.0 },
    }
}

/// Single-core throughput of an AEAD that QUIC may use for every packet (rustls with ring
/// negotiates AES-256-GCM; AES-128-GCM for comparison), sealing and opening `packet_bytes`
/// records: the floor of the CPU cost of encryption per byte moved, for comparing with
/// `cpu_util`.
#[derive(Clone, Debug, Serialize)]
pub struct AeadBench {
    pub op: &'static str,
    pub packet_bytes: usize,
    pub seal_gbps: f64,
    pub open_gbps: f64,
}

pub fn bench_aead(aes_256: bool, packet_bytes: usize, total_bytes: usize) -> AeadBench {
    use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM, AES_256_GCM};
    let (alg, op) = match aes_256 {
        true => (&AES_256_GCM, "aead_aes256gcm"),
        false => (&AES_128_GCM, "aead_aes128gcm"),
    };
    let key_bytes = [7u8; 32];
    let key = LessSafeKey::new(
        UnboundKey::new(alg, &key_bytes[..alg.key_len()]).expect("key of the AEAD's length"),
    );
    let packets = (total_bytes / packet_bytes).max(1);
    let mut bufs: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; packet_bytes]).collect();
    let mut tags = Vec::with_capacity(bufs.len());
    let nonce = |i: usize| {
        let mut n = [0u8; 12];
        n[4..].copy_from_slice(&(i as u64).to_be_bytes());
        Nonce::assume_unique_for_key(n)
    };
    let t0 = Instant::now();
    for i in 0..packets {
        let b = &mut bufs[i % 64];
        let tag = key
            .seal_in_place_separate_tag(nonce(i), Aad::empty(), b)
            .expect("in-memory seal");
        if i + 64 >= packets {
            tags.push((i, tag));
        }
    }
    let seal = t0.elapsed().as_secs_f64();
    // Open the last 64 sealed packets over and over (each open needs a valid tag); the copy
    // into the scratch buffer is a memcpy, an order of magnitude cheaper than the cipher.
    let mut scratch = Vec::with_capacity(packet_bytes + 16);
    let t0 = Instant::now();
    let mut opened = 0;
    while opened < packets {
        for (i, tag) in &tags {
            scratch.clear();
            scratch.extend_from_slice(&bufs[i % 64]);
            scratch.extend_from_slice(tag.as_ref());
            let ok = key
                .open_in_place(nonce(*i), Aad::empty(), &mut scratch)
                .is_ok();
            assert!(ok, "a freshly sealed packet opens");
            opened += 1;
        }
    }
    let open = t0.elapsed().as_secs_f64();
    let gb = |n: usize, t: f64| (n * packet_bytes) as f64 / t / 1e9;
    AeadBench {
        op,
        packet_bytes,
        seal_gbps: gb(packets, seal),
        open_gbps: gb(opened, open),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::transport::local::LocalNetwork;

    /// Every op completes over the local transport, and `run_op` checked each result.
    #[test]
    fn every_op_runs_on_three_local_ranks() {
        let net = LocalNetwork::new();
        let members = [0u32, 1, 2];
        let mut eps: Vec<_> = members.iter().map(|&r| net.endpoint(r)).collect();
        let hs: Vec<_> = members
            .iter()
            .map(|_| {
                let ep = eps.remove(0);
                std::thread::spawn(move || {
                    let mut comm = Comm::new(ep, 10_000);
                    comm.begin_step(0, 0);
                    for (s, op) in ALL_OPS.into_iter().enumerate() {
                        let (t, _, _) =
                            run_op(&mut comm, &members, op, 4 * 3 * 100, 1, 2, s as u64).unwrap();
                        assert!(t > 0.0);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        let r = result(
            Op::AllReduce,
            1000,
            1e-6,
            0.0,
            1.0,
            "local",
            4,
            "threads",
            1,
        );
        assert!((r.busbw_gbps - r.algbw_gbps * 1.5).abs() < 1e-9);
    }
}
