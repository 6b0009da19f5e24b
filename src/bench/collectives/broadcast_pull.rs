//! Broadcast by pulling, to members that can read the root's memory (processes on one host,
//! [`SharedMemory::peer_memory`](crate::runtime::transport::SharedMemory::peer_memory)): each
//! such member reads the root's payload straight into its tensor. A byte moves with one copy,
//! made by the kernel on the receiver's core, where the staged path copies it twice (the root
//! into its slot, the receiver out of it): with two processes on 2 vCPUs those two copies bound
//! the staged path (docs/benchmark-history.md, the UCX broadcast).
//!
//! Frames, all of this step, from the root to each puller: *where* (piece 0: the payload's
//! address and length), then *sums* (piece 1: the CRC-32 of each 1 MiB block), sent once the
//! root has taken them, so that receivers read while the root sums; from each receiver,
//! *done* once it has read and checked every block. The root's payload is immutable (`Bytes`)
//! and the root holds it until every receiver said *done*; a root that gave up earlier (its
//! deadline, a peer gone) may free it while a receiver still reads, which the checksums catch:
//! a block that fails its checksum is the root's protocol error.

use std::sync::OnceLock;

use bytes::Bytes;

use super::pull_notice::{blocks, check, crc32, done_tag, Where, PULL_BLOCK_BYTES};
use crate::plan::RankId;
use crate::runtime::step::comm::{Comm, CommError};
use crate::runtime::transport::{PeerMemory, Tag, Transport};

/// The pieces of a pulled broadcast's tag: where the payload lies, then its blocks' checksums.
const WHERE: u32 = 0;
const SUMS: u32 = 1;

/// The root's half: names where `payload` lies to `pullers`, then its blocks' checksums once
/// they are taken (the receivers read meanwhile), and waits (within one deadline) until each
/// receiver has read it all.
pub(super) fn send_pulled<T: Transport>(
    comm: &mut Comm<T>,
    tag: Tag,
    pullers: &[RankId],
    payload: &Bytes,
) -> Result<(), CommError> {
    if pullers.is_empty() {
        return Ok(());
    }
    let deadline = comm.deadline();
    let (at, len) = (payload.as_ptr() as u64, payload.len());
    comm.send_to_each(pullers, tag.piece(WHERE), Where::encode(at, len, &[]))?;
    // The transport's thread sends the notice; let it run before the checksums take this
    // core. Without the yield the notice left 0.2-3 ms late (with 2 processes on 2 vCPUs it
    // waited for this thread's time slice), with it 0.2 ms.
    std::thread::yield_now();
    let crcs: Vec<u32> = blocks(len).map(|r| crc32(&payload[r])).collect();
    comm.send_to_each(pullers, tag.piece(SUMS), Where::encode(at, len, &crcs))?;
    for &p in pullers {
        comm.recv_until(p, done_tag(tag), deadline)?;
    }
    Ok(())
}

/// Where a receiver's pulled blocks go: straight into its tensor, or through a block of
/// scratch to a callback (`place(byte offset, bytes)`) that decodes them.
pub(super) enum Landing<'a, P: FnMut(usize, &[u8])> {
    Into(&'a mut [u8]),
    Place(P),
}

/// A receiver's half: reads the `len` bytes from `root` block by block as soon as the root
/// names where they lie, lands each, checks them all against the checksums the root sends
/// meanwhile, and tells the root it is done. `members`: how many take part (they share this
/// host's cores). Blocks are placed before the checksums arrive: on an error the tensor (or
/// what was placed) holds an unspecified mix of old and new bytes, as on the staged path.
pub(super) fn recv_pulled<T: Transport, P: FnMut(usize, &[u8])>(
    comm: &mut Comm<T>,
    tag: Tag,
    root: RankId,
    len: usize,
    members: usize,
    landing: Landing<'_, P>,
) -> Result<(), CommError> {
    let deadline = comm.deadline();
    let named = comm.recv_until(root, tag.piece(WHERE), deadline)?;
    let at = Where::parse(root, &named, len, 0)?.at;
    let memory = comm.peer_memory(root)?;
    let read = match landing {
        Landing::Into(dest) => {
            debug_assert_eq!(
                dest.len(),
                len,
                "a broadcast lands in a tensor of its length"
            );
            if len >= SPLIT_MIN_BYTES && cores() >= members {
                read_in_two(&*memory, at, dest)?
            } else {
                read_blocks(&*memory, at, dest)?
            }
        }
        Landing::Place(mut place) => {
            let mut read = Vec::with_capacity(len.div_ceil(PULL_BLOCK_BYTES));
            let mut scratch = Vec::new();
            for r in blocks(len) {
                scratch.resize(r.len(), 0);
                read.extend(read_blocks(
                    &*memory,
                    at.saturating_add(r.start as u64),
                    &mut scratch,
                )?);
                place(r.start, &scratch);
            }
            read
        }
    };
    let sums = comm.recv_until(root, tag.piece(SUMS), deadline)?;
    let sums = Where::parse(root, &sums, len, read.len())?;
    if sums.at != at {
        return Err(CommError::Protocol {
            from: root,
            what: format!(
                "its broadcast's checksums name bytes at {:#x}, its notice at {at:#x}",
                sums.at
            ),
        });
    }
    for (i, (&got, &want)) in read.iter().zip(&sums.crcs).enumerate() {
        check(root, "broadcast bytes", i, got, want)?;
    }
    comm.send(root, done_tag(tag), Bytes::new())
}

/// Broadcasts at least this large are read by two threads where the host has a core for each
/// member: one reader leaves the root's core idle once the root has summed its payload
/// (64 MiB over 2 processes on 2 vCPUs: docs/benchmark-history.md, the UCX broadcast).
const SPLIT_MIN_BYTES: usize = 8 << 20;

/// The cores this process may run on (read once: it looks at cgroup files).
fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Reads `dest.len()` bytes at `at` of `memory` into `dest` on this thread and a scoped
/// helper, each a run of whole blocks; the checksums of every block, in order.
fn read_in_two(memory: &dyn PeerMemory, at: u64, dest: &mut [u8]) -> Result<Vec<u32>, CommError> {
    let half = dest.len().div_ceil(PULL_BLOCK_BYTES) / 2 * PULL_BLOCK_BYTES;
    let (head, tail) = dest.split_at_mut(half);
    std::thread::scope(|s| {
        let helper = s.spawn(|| read_blocks(memory, at.saturating_add(half as u64), tail));
        let mut read = read_blocks(memory, at, head)?;
        read.extend(helper.join().expect("a broadcast reader does not panic")?);
        Ok(read)
    })
}

/// Reads `dest.len()` bytes at `at` of `memory` into `dest` block by block, taking each
/// block's checksum while it is in cache; the checksums, in order.
fn read_blocks(memory: &dyn PeerMemory, at: u64, dest: &mut [u8]) -> Result<Vec<u32>, CommError> {
    let mut read = Vec::with_capacity(dest.len().div_ceil(PULL_BLOCK_BYTES));
    for r in blocks(dest.len()) {
        let d = &mut dest[r.clone()];
        // Saturating: an address near the top fails the read, not this rank.
        memory.read(at.saturating_add(r.start as u64), d)?;
        read.push(crc32(d));
    }
    Ok(read)
}

/// The members of a broadcast from `root` that read its memory, and those it sends to: a pair
/// pulls where the transport says it can on this side (it says so on both, see
/// [`SharedMemory::can_pull`](crate::runtime::transport::SharedMemory::can_pull)).
pub(super) fn split_pullers<T: Transport>(
    comm: &Comm<T>,
    receivers: Vec<RankId>,
) -> (Vec<RankId>, Vec<RankId>) {
    receivers.into_iter().partition(|&p| comm.can_pull(p))
}

#[cfg(all(test, feature = "ucx"))]
mod tests {
    use super::super::broadcast::{broadcast, broadcast_into};
    use super::*;
    use crate::runtime::transport::ucx::transports_for_tests;
    use crate::runtime::transport::{SharedMemory, TagKind};

    fn tag() -> Tag {
        Tag {
            kind: TagKind::Broadcast,
            attempt: 0,
            unit: 0,
            pass: 0,
            piece: 0,
        }
    }

    fn payload(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 % 251) as u8).collect()
    }

    /// Over UCX (three engines in this process) both receivers read the root's payload out of
    /// its memory, one into its tensor and one through `place`: every byte arrives, nothing is
    /// staged, and the root returns only once both are done.
    #[ignore = "needs libucx0 (apt-get install libucx0)"]
    #[test]
    fn a_broadcast_over_ucx_is_pulled_from_the_roots_memory() {
        let (engines, eps) = transports_for_tests(3);
        let len = 3 * PULL_BLOCK_BYTES + 77;
        let want = payload(len);
        let handles: Vec<_> = eps
            .into_iter()
            .enumerate()
            .map(|(r, ep)| {
                let want = want.clone();
                std::thread::spawn(move || {
                    let mut comm = Comm::new(ep, 20_000);
                    comm.begin_step(1, 0);
                    let members = [0, 1, 2];
                    match r {
                        0 => {
                            let root = Bytes::from(want);
                            broadcast(&mut comm, &members, 0, tag(), root, len, |_, _| {}).unwrap()
                        }
                        1 => {
                            let mut got = vec![0u8; len];
                            broadcast_into(&mut comm, &members, 0, tag(), Bytes::new(), &mut got)
                                .unwrap();
                            assert!(got == want, "rank 1 holds the root's bytes");
                        }
                        _ => {
                            let mut got = vec![0u8; len];
                            let place =
                                |at: usize, b: &[u8]| got[at..at + b.len()].copy_from_slice(b);
                            broadcast(&mut comm, &members, 0, tag(), Bytes::new(), len, place)
                                .unwrap();
                            assert!(got == want, "rank 2 holds the root's bytes");
                        }
                    }
                })
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().unwrap());
        for e in &engines[1..] {
            let c = e.counts();
            assert_eq!(c.pulled_bytes, len as u64, "{c:?}");
            assert_eq!(c.staged + c.lent, 0, "nothing staged: {c:?}");
        }
    }

    /// Two readers split a payload at a block boundary and give every block's checksum in
    /// order, whatever the length's remainder.
    #[ignore = "needs libucx0 (apt-get install libucx0)"]
    #[test]
    fn two_readers_land_every_block_and_its_checksum() {
        let (_engines, eps) = transports_for_tests(2);
        for len in [
            SPLIT_MIN_BYTES + 5,
            2 * PULL_BLOCK_BYTES,
            PULL_BLOCK_BYTES - 3,
        ] {
            let want = payload(len);
            let memory = eps[1].peer_memory(0).unwrap();
            let mut got = vec![0u8; len];
            let crcs = read_in_two(&*memory, want.as_ptr() as u64, &mut got).unwrap();
            assert!(got == want, "{len} bytes");
            let expect: Vec<u32> = blocks(len).map(|r| crc32(&want[r])).collect();
            assert_eq!(crcs, expect, "{len} bytes");
        }
    }

    /// A root whose checksums do not match what it named, or that names other bytes in its
    /// checksums than in its notice, fails the receiver with the root's protocol error, and
    /// the receiver does not say it is done.
    #[ignore = "needs libucx0 (apt-get install libucx0)"]
    #[test]
    fn a_root_whose_checksums_differ_is_refused() {
        let (_engines, mut eps) = transports_for_tests(2);
        let receiver = eps.pop().unwrap();
        let mut root = Comm::new(eps.pop().unwrap(), 5_000);
        let mut comm = Comm::new(receiver, 5_000);
        let len = 2 * PULL_BLOCK_BYTES + 9;
        let bytes = payload(len);
        let at = bytes.as_ptr() as u64;
        let mut good: Vec<u32> = blocks(len).map(|r| crc32(&bytes[r])).collect();
        let other_at = Where::encode(at + 1, len, &good);
        good[1] ^= 1;
        for (step, sums) in [(0, Where::encode(at, len, &good)), (1, other_at)] {
            root.begin_step(1, step);
            comm.begin_step(1, step);
            root.send(1, tag().piece(WHERE), Where::encode(at, len, &[]))
                .unwrap();
            root.send(1, tag().piece(SUMS), sums).unwrap();
            let mut got = vec![0u8; len];
            let e = recv_pulled(
                &mut comm,
                tag(),
                0,
                len,
                2,
                Landing::Into::<fn(usize, &[u8])>(&mut got),
            )
            .unwrap_err();
            assert!(matches!(e, CommError::Protocol { from: 0, .. }), "{e:?}");
            let none = root.recv_until(1, done_tag(tag()), root.deadline_in(50));
            assert!(none.is_err(), "no done after a refused broadcast");
        }
    }
}
