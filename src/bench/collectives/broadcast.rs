//! Broadcast: the root's payload to every member, in pieces, or pulled from the root's memory
//! where a member can read it (UCX on one host). The training step does not broadcast; the
//! collective benchmark (`ezero collectives`) measures it against gloo's.

use bytes::Bytes;

use super::broadcast_pull::{recv_pulled, send_pulled, split_pullers, Landing};
use crate::plan::RankId;
use crate::runtime::step::comm::collectives::others;
use crate::runtime::step::comm::{Comm, CommError};
use crate::runtime::transport::{Tag, Transport};

/// Broadcast: `root` sends its `len`-byte `payload` (ignored elsewhere) to every member, in
/// pieces; every other member hands each piece to `place(byte offset, bytes)` as it arrives (the
/// root's own buffer already holds the bytes). The same pieces go to every peer, so the
/// in-process transport copies nothing. Members that can read the root's memory (UCX on one
/// host) pull the bytes instead (`broadcast_pull`), and the root returns once they have.
pub fn broadcast<T: Transport>(
    comm: &mut Comm<T>,
    members: &[RankId],
    root: RankId,
    tag: Tag,
    payload: Bytes,
    len: usize,
    place: impl FnMut(usize, &[u8]),
) -> Result<(), CommError> {
    let me = comm.rank();
    if me == root {
        if payload.len() != len {
            return Err(CommError::Protocol {
                from: me,
                what: format!(
                    "broadcast root holds {} bytes, expected {len}",
                    payload.len()
                ),
            });
        }
        let (pullers, staged) = split_pullers(comm, others(members, me));
        comm.send_pieces(&staged, tag, payload.clone())?;
        send_pulled(comm, tag, &pullers, &payload)
    } else if comm.can_pull(root) {
        recv_pulled(comm, tag, root, len, members.len(), Landing::Place(place))
    } else {
        comm.recv_pieces(root, tag, len, place)
    }
}

/// `broadcast` into `dest` (every member's, exactly the payload's length): receivers get the
/// pieces straight into it where the transport can (see `Comm::recv_pieces_into`), or pull
/// them into it; the root's `dest` is left alone (its `payload` already holds the bytes).
pub fn broadcast_into<T: Transport>(
    comm: &mut Comm<T>,
    members: &[RankId],
    root: RankId,
    tag: Tag,
    payload: Bytes,
    dest: &mut [u8],
) -> Result<(), CommError> {
    let me = comm.rank();
    if me == root {
        broadcast(comm, members, root, tag, payload, dest.len(), |_, _| {})
    } else if comm.can_pull(root) {
        let (len, n) = (dest.len(), members.len());
        recv_pulled(
            comm,
            tag,
            root,
            len,
            n,
            Landing::Into::<fn(usize, &[u8])>(dest),
        )
    } else {
        comm.recv_pieces_into(root, tag, dest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::step::comm::collectives::barrier;
    use crate::runtime::transport::local::LocalNetwork;
    use crate::runtime::transport::TagKind;
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
                    // Three and a half pieces, so the last piece is short.
                    let len = 3 * PIECE_BYTES + PIECE_BYTES / 2;
                    let mine: Vec<u8> = (0..len).map(|i| (i % 251) as u8 ^ r as u8).collect();
                    let mut got = if r == 3 { mine.clone() } else { vec![0; len] };
                    broadcast(
                        &mut comm,
                        &members,
                        3,
                        tag(TagKind::Broadcast),
                        Bytes::from(mine),
                        len,
                        |at, b| got[at..at + b.len()].copy_from_slice(b),
                    )
                    .unwrap();
                    barrier(&mut comm, &members, tag(TagKind::Barrier)).unwrap();
                    (got, comm.stats().frames_sent)
                })
            })
            .collect();
        let want: Vec<u8> = (0..3 * PIECE_BYTES + PIECE_BYTES / 2)
            .map(|i| (i % 251) as u8 ^ 3)
            .collect();
        for (h, r) in handles.into_iter().zip(members) {
            let (got, frames) = h.join().unwrap();
            assert!(got == want, "rank {r} holds the root's bytes");
            // Four pieces to each of two peers, then the barrier's two.
            assert_eq!(frames, if r == 3 { 8 + 2 } else { 2 });
        }
    }

    /// A collective's payload of several pieces arrives whole: each piece's number crosses in
    /// the header (without it, the second piece looked like a copy of the first and the
    /// receiver waited for it until its deadline).
    #[test]
    fn a_payload_in_pieces_arrives_whole_over_tcp() {
        use crate::net::ClusterCa;
        use crate::runtime::transport::tcp::TcpListenerHandle;
        use crate::runtime::transport::test_frame;
        use std::collections::BTreeMap;
        let cluster_tls = |ca: &ClusterCa, name: &str| {
            crate::net::tls::ClusterTls::new(&ca.issue(name).unwrap()).unwrap()
        };
        let ca = ClusterCa::generate("t").unwrap();
        let (a, b) = (
            TcpListenerHandle::bind("127.0.0.1:0", "t", &cluster_tls(&ca, "rank-0")).unwrap(),
            TcpListenerHandle::bind("127.0.0.1:0", "t", &cluster_tls(&ca, "rank-1")).unwrap(),
        );
        let peers: BTreeMap<_, _> = [(0, a.local_addr()), (1, b.local_addr())].into();
        let (a, b) = (
            a.into_transport(0, peers.clone()),
            b.into_transport(1, peers),
        );
        let len = 2 * PIECE_BYTES + 1000;
        let want: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
        let tag = test_frame(1, 0, 4, &b""[..]).tag;
        let (mut ca, mut cb) = (Comm::new(a, 10_000), Comm::new(b, 10_000));
        ca.begin_step(1, 0);
        cb.begin_step(1, 0);
        let root = Bytes::from(want.clone());
        broadcast(&mut ca, &[0, 1], 0, tag, root, len, |_, _| {}).unwrap();
        let mut got = vec![0u8; len];
        broadcast(&mut cb, &[0, 1], 0, tag, Bytes::new(), len, |at, b| {
            got[at..at + b.len()].copy_from_slice(b)
        })
        .unwrap();
        assert!(got == want, "the receiver holds the root's bytes");
    }
}
