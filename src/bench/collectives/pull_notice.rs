//! The frames of the collectives that pull (`all_reduce_pull`, `broadcast_pull`): a rank
//! names where bytes lie in its memory and their checksums; a peer reads them through
//! [`SharedMemory::peer_memory`](crate::runtime::transport::SharedMemory::peer_memory), checks
//! what it read (`transport::shared_memory` says why it must), and says *done* once it reads no
//! more of that memory, so that the owner may change or free it.

use bytes::Bytes;

use crate::plan::RankId;
use crate::runtime::step::comm::CommError;
use crate::runtime::transport::{Tag, TagKind};
use crate::wire::crc32_of;

/// Bytes pulled at a time: each block is checksummed (and added) while it is in cache (1 MiB
/// pulls beat 64 KiB ones by 1.3-1.6x here: each `process_vm_readv` pins the pages it reads),
/// and each block is announced on its own.
pub(super) const PULL_BLOCK_BYTES: usize = 1 << 20;

/// The tag of the *done* frame of a pulling collective whose frames use `tag`: a barrier tag
/// no piece of a payload uses.
pub(super) fn done_tag(tag: Tag) -> Tag {
    Tag {
        kind: TagKind::Barrier,
        piece: u32::MAX,
        ..tag
    }
}

/// The blocks of a `len`-byte run: each is announced, pulled and checked on its own, so that
/// a peer reads one block while the next is prepared.
pub(super) fn blocks(len: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..len.div_ceil(PULL_BLOCK_BYTES))
        .map(move |i| i * PULL_BLOCK_BYTES..((i + 1) * PULL_BLOCK_BYTES).min(len))
}

pub(super) fn crc32(b: &[u8]) -> u32 {
    crc32_of(&[b])
}

pub(super) fn check(
    from: RankId,
    what: &str,
    piece: usize,
    got: u32,
    want: u32,
) -> Result<(), CommError> {
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
pub(super) struct Where {
    pub(super) at: u64,
    pub(super) crcs: Vec<u32>,
}

impl Where {
    pub(super) fn encode(at: u64, len: usize, crcs: &[u32]) -> Bytes {
        let mut b = Vec::with_capacity(16 + 4 * crcs.len());
        b.extend_from_slice(&at.to_le_bytes());
        b.extend_from_slice(&(len as u64).to_le_bytes());
        crcs.iter()
            .for_each(|c| b.extend_from_slice(&c.to_le_bytes()));
        Bytes::from(b)
    }

    /// A frame from `from` naming `len` bytes in `crcs` pieces, or the protocol error it is.
    pub(super) fn parse(
        from: RankId,
        msg: &[u8],
        len: usize,
        crcs: usize,
    ) -> Result<Self, CommError> {
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
