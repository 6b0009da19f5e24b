//! All-reduce by pulling, for members whose memory the transport can read (processes on one
//! host, [`Transport::pull`]): each rank reads its peers' partial sums of its run straight out
//! of their accumulators and adds them in member order, then reads each peer's sums straight
//! into its own accumulator. A byte moves with one copy, made by the kernel, where the staged
//! path copies it twice (into the sender's slot, out of it) and lands partial sums in scratch
//! before adding them: on 2 vCPUs with 4 processes the copies are the cost.
//!
//! The frames are small and of this step: where the memory is and its checksums.
//! - *partials* (`rs`): to each peer that owns a run, where this rank's partial sums of that
//!   run lie, with the CRC-32 of each piece;
//! - *sums* (`ag`, piece `i`): to every peer, once piece `i` of this rank's run is summed,
//!   where it lies and its CRC-32;
//! - *done* (a barrier tag): to each peer whose sums this rank read: it reads no more of that
//!   peer's memory.
//!
//! Why the memory read is stable: a rank overwrites its copy of a peer's partial sums (its run
//! of its accumulator that the peer reads) only with the sums the peer announced, and a peer
//! announces a piece's sums only once it has read every member's partial sums of that piece.
//! A rank's own sums are read by every peer until each has said *done*; it returns only then.
//! What a pull reads is checked against the checksum its owner sent, so memory that changed
//! anyway (a peer that returned early after an error) fails the collective; it never reads
//! this process's memory.

use bytes::Bytes;

use super::comm::{Comm, CommError};
use crate::plan::RankId;
use crate::reduce::ReduceMode;
use crate::runtime::transport::{Tag, TagKind, Transport};
use crate::wire::crc32_of;

/// Bytes pulled at a time: each block is checksummed and added while it is in cache (1 MiB
/// pulls beat 64 KiB ones by 1.3-1.6x here: each `process_vm_readv` pins the pages it reads),
/// and each block of sums is announced on its own.
const PULL_BLOCK_BYTES: usize = 1 << 20;

/// All-reduce over pulls: `mine` is this rank's run of the accumulator (summed here), `gather`
/// each peer's run (this rank's partial sums of it, then the peer's sums). `peers`: the other
/// members in member order, the order of the additions. Bit for bit the staged path's result.
pub(super) fn all_reduce_pulled<T: Transport>(
    comm: &mut Comm<T>,
    [rs, ag]: [Tag; 2],
    mode: ReduceMode,
    elem_bytes: usize,
    peers: &[RankId],
    mine: &mut [u8],
    gather: &mut [(RankId, &mut [u8])],
) -> Result<(), CommError> {
    let deadline = comm.deadline();
    let done = Tag {
        kind: TagKind::Barrier,
        piece: u32::MAX,
        ..ag
    };
    for (p, run) in gather.iter() {
        let crcs: Vec<u32> = blocks(run.len()).map(|r| crc32(&run[r])).collect();
        comm.send(*p, rs, Where::encode(run.as_ptr() as u64, run.len(), &crcs))?;
        comm.count_elems(0, (run.len() / elem_bytes) as u64);
    }
    let n = mine.len();
    if n > 0 {
        let mut from = Vec::with_capacity(peers.len());
        for &k in peers {
            let msg = comm.recv_until(k, rs, deadline)?;
            from.push((k, Where::parse(k, &msg, n, blocks(n).count())?));
        }
        let mut pulled = vec![0u8; PULL_BLOCK_BYTES.min(n)];
        for (i, r) in blocks(n).enumerate() {
            let block = &mut mine[r.clone()];
            for (k, w) in &from {
                let s = &mut pulled[..r.len()];
                // Saturating: a peer's address near the top fails the pull, not this rank.
                comm.pull(*k, w.at.saturating_add(r.start as u64), s)?;
                check(*k, "partial sums", i, crc32(s), w.crcs[i])?;
                mode.add_encoded_into(block, s);
            }
            let sums = Where::encode(block.as_ptr() as u64, r.len(), &[crc32(block)]);
            comm.send_to_each(peers, ag.piece(i as u32), sums)?;
        }
        comm.count_elems(0, (n / elem_bytes * peers.len()) as u64);
    }
    for (k, run) in gather.iter_mut() {
        for (j, r) in blocks(run.len()).enumerate() {
            let msg = comm.recv_until(*k, ag.piece(j as u32), deadline)?;
            let w = Where::parse(*k, &msg, r.len(), 1)?;
            let d = &mut run[r];
            comm.pull(*k, w.at, d)?;
            check(*k, "sums", j, crc32(d), w.crcs[0])?;
        }
        comm.send(*k, done, Bytes::new())?;
    }
    if n > 0 {
        for &k in peers {
            comm.recv_until(k, done, deadline)?;
        }
    }
    Ok(())
}

/// The blocks of a `len`-byte run: each is pulled, checked, added and announced on its own,
/// so that a peer reads a block's sums while the next is summed.
fn blocks(len: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..len.div_ceil(PULL_BLOCK_BYTES))
        .map(move |i| i * PULL_BLOCK_BYTES..((i + 1) * PULL_BLOCK_BYTES).min(len))
}

fn crc32(b: &[u8]) -> u32 {
    crc32_of(&[b])
}

fn check(from: RankId, what: &str, piece: usize, got: u32, want: u32) -> Result<(), CommError> {
    if got == want {
        return Ok(());
    }
    Err(CommError::Protocol {
        from,
        what: format!(
            "its {what} of piece {piece} read from its memory fail their checksum ({got:#010x}, announced {want:#010x}): the memory changed while it was read"
        ),
    })
}

/// Where a peer's bytes lie in its memory, and the CRC-32 of each piece of them.
struct Where {
    at: u64,
    crcs: Vec<u32>,
}

impl Where {
    fn encode(at: u64, len: usize, crcs: &[u32]) -> Bytes {
        let mut b = Vec::with_capacity(16 + 4 * crcs.len());
        b.extend_from_slice(&at.to_le_bytes());
        b.extend_from_slice(&(len as u64).to_le_bytes());
        crcs.iter()
            .for_each(|c| b.extend_from_slice(&c.to_le_bytes()));
        Bytes::from(b)
    }

    /// A frame from `from` naming `len` bytes in `crcs` pieces, or the protocol error it is.
    fn parse(from: RankId, msg: &[u8], len: usize, crcs: usize) -> Result<Self, CommError> {
        let bad = |what: String| CommError::Protocol { from, what };
        if msg.len() != 16 + 4 * crcs {
            return Err(bad(format!(
                "a pull notice of {} bytes where {} were due",
                msg.len(),
                16 + 4 * crcs
            )));
        }
        let u64_at = |i: usize| u64::from_le_bytes(msg[i..i + 8].try_into().expect("checked"));
        let (at, named) = (u64_at(0), u64_at(8));
        if named != len as u64 {
            return Err(bad(format!(
                "a pull notice of {named} bytes where {len} were due"
            )));
        }
        let crcs = msg[16..]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        Ok(Self { at, crcs })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A notice names its bytes and checksums; one of another length, or naming another
    /// length, is the sender's protocol error, not a read.
    #[test]
    fn a_notice_is_taken_only_as_the_protocol_says() {
        let msg = Where::encode(0x7000_1000, 3 << 20, &[1, 2, 3]);
        let w = Where::parse(4, &msg, 3 << 20, 3).unwrap();
        assert_eq!((w.at, w.crcs), (0x7000_1000, vec![1, 2, 3]));
        let protocol =
            |r: Result<Where, CommError>| matches!(r, Err(CommError::Protocol { from: 4, .. }));
        assert!(
            protocol(Where::parse(4, &msg, 3 << 20, 2)),
            "too many checksums"
        );
        assert!(
            protocol(Where::parse(4, &msg, 2 << 20, 3)),
            "another length named"
        );
        assert!(
            protocol(Where::parse(4, &msg[..20], 3 << 20, 3)),
            "cut short"
        );
        assert!(protocol(Where::parse(4, &[], 0, 0)), "empty");
        assert!(check(4, "sums", 0, 7, 7).is_ok());
        assert!(matches!(
            check(4, "sums", 0, 7, 8),
            Err(CommError::Protocol { from: 4, .. })
        ));
    }
}
