//! All-reduce by pulling, for members whose memory the transport can read (processes on one host,
//! [`SharedMemory::peer_memory`](crate::runtime::transport::SharedMemory::peer_memory)): each rank
//! reads its peers' partial sums of its run straight out of their accumulators and adds them in
//! member order, then reads each peer's sums straight into its own accumulator. A byte moves with
//! one copy, made by the kernel, where the staged path copies it twice (into the sender's slot, out
//! of it) and lands partial sums in scratch before adding them: on 2 vCPUs with 4 processes the
//! copies are the cost.
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

use super::pull_notice::{blocks, check, crc32, done_tag, Where, PULL_BLOCK_BYTES};
use crate::plan::RankId;
use crate::reduce::ReduceMode;
use crate::runtime::step::comm::{Comm, CommError};
use crate::runtime::transport::{Tag, Transport};

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
    let done = done_tag(ag);
    for (p, run) in gather.iter() {
        let crcs: Vec<u32> = blocks(run.len()).map(|r| crc32(&run[r])).collect();
        comm.send(*p, rs, Where::encode(run.as_ptr() as u64, run.len(), &crcs))?;
        comm.count_elems(0, (run.len() / elem_bytes) as u64);
    }
    let n = mine.len();
    if n > 0 {
        // Each peer's notice, and its memory (looked up once, not per block).
        let mut from = Vec::with_capacity(peers.len());
        for &k in peers {
            let msg = comm.recv_until(k, rs, deadline)?;
            let w = Where::parse(k, &msg, n, blocks(n).count())?;
            from.push((k, w, comm.peer_memory(k)?));
        }
        let mut pulled = vec![0u8; PULL_BLOCK_BYTES.min(n)];
        for (i, r) in blocks(n).enumerate() {
            let block = &mut mine[r.clone()];
            for (k, w, memory) in &from {
                let s = &mut pulled[..r.len()];
                // Saturating: a peer's address near the top fails the pull, not this rank.
                memory.read(w.at.saturating_add(r.start as u64), s)?;
                check(*k, "partial sums", i, crc32(s), w.crcs[i])?;
                mode.add_encoded_into(block, s);
            }
            let sums = Where::encode(block.as_ptr() as u64, r.len(), &[crc32(block)]);
            comm.send_to_each(peers, ag.piece(i as u32), sums)?;
        }
        comm.count_elems(0, (n / elem_bytes * peers.len()) as u64);
    }
    for (k, run) in gather.iter_mut() {
        let memory = comm.peer_memory(*k)?;
        for (j, r) in blocks(run.len()).enumerate() {
            let msg = comm.recv_until(*k, ag.piece(j as u32), deadline)?;
            let w = Where::parse(*k, &msg, r.len(), 1)?;
            let d = &mut run[r];
            memory.read(w.at, d)?;
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
