//! `UcxTransport` and `UcxPlane`: frames between engines, checked, lent and bounded.
use super::super::engine::EngineConfig;
use super::super::require_for_tests as require;
use super::*;
use crate::runtime::transport::test_frame;
use crate::wire::encode_split;
use bytes::Bytes;
use std::sync::atomic::Ordering;

fn frame(from: RankId, unit: u32, payload: Vec<u8>) -> Frame {
    test_frame(3, from, unit, payload)
}

fn plane(n: u32) -> Vec<UcxTransport> {
    plane_with(n, None)
}

fn plane_with(n: u32, inbox_bytes_max: Option<usize>) -> Vec<UcxTransport> {
    plane_of(n, |r| EngineConfig {
        inbox_bytes_max,
        ..EngineConfig::shared_memory(r)
    })
}

/// `n` engines with configs `cfg(r)`, each with a transport connected to all of them.
fn plane_of(n: u32, cfg: impl Fn(u32) -> EngineConfig) -> Vec<UcxTransport> {
    let engines: Vec<Arc<Engine>> = (0..n)
        .map(|r| Arc::new(Engine::start(cfg(r)).unwrap()))
        .collect();
    let peers: BTreeMap<RankId, Vec<u8>> = engines
        .iter()
        .map(|e| (e.id(), e.address().to_vec()))
        .collect();
    engines
        .into_iter()
        .map(|e| UcxTransport::connect(e.id(), e, &peers, 64 << 20).unwrap())
        .collect()
}

#[ignore = "needs libucx0 (apt-get install libucx0)"]
#[test]
fn frames_cross_between_three_ranks_and_to_self() {
    require();
    let mut t = plane(3);
    let big: Vec<u8> = (0..(8 << 20)).map(|i| (i % 251) as u8).collect();
    t[0].send(2, frame(0, 1, big.clone())).unwrap();
    t[1].send(2, frame(1, 2, b"small".to_vec())).unwrap();
    t[2].send(2, frame(2, 3, Vec::new())).unwrap();
    let mut got: Vec<Frame> = (0..3).map(|_| t[2].recv_timeout(10_000).unwrap()).collect();
    got.sort_by_key(|f| f.from);
    assert_eq!(got[0].payload, Bytes::from(big));
    assert_eq!((got[0].epoch, got[0].step, got[0].tag.unit), (3, 2, 1));
    assert_eq!(&got[1].payload[..], b"small");
    assert_eq!((got[2].from, got[2].tag.unit), (2, 3));
    assert!(matches!(
        t[2].recv_timeout(20),
        Err(TransportError::Timeout(20))
    ));
    assert!(matches!(
        t[0].send(9, frame(0, 0, Vec::new())),
        Err(TransportError::UnknownPeer(9))
    ));
    assert_eq!(t[2].stats().snapshot().total(), 0);
    // One encoding to several peers and to itself.
    let payload: Vec<u8> = (0..(3 << 20)).map(|i| (i % 241) as u8).collect();
    t[1].send_to_each(&[0, 1, 2], frame(1, 9, payload.clone()))
        .unwrap();
    for (r, t) in t.iter_mut().enumerate() {
        let f = t.recv_timeout(10_000).unwrap();
        assert_eq!((f.from, f.tag.unit), (1, 9));
        assert_eq!(f.payload, Bytes::from(payload.clone()), "rank {r}");
    }
}

#[ignore = "needs libucx0 (apt-get install libucx0)"]
#[test]
fn damaged_misattributed_and_oversize_frames_are_counted_and_dropped() {
    require();
    let mut t = plane(2);
    let good = encode_split(&WireMsg::Frame(frame(0, 1, vec![5; 100])));
    // A flipped payload byte fails the CRC.
    let mut damaged = good.1.to_vec();
    damaged[60] ^= 1;
    let damaged = (good.0.clone(), Bytes::from(damaged));
    // A well-formed frame that claims to come from rank 1, sent by rank 0.
    let forged = encode_split(&WireMsg::Frame(frame(1, 1, vec![5; 100])));
    // A length over the receiver's limit, in an otherwise valid prefix.
    let mut oversize = good.clone();
    oversize.0[1..5].copy_from_slice(&(128u32 << 20).to_le_bytes());
    for (around, payload) in [damaged, forged, oversize, good] {
        t[0].plane
            .engine
            .send_with_header(1, around, payload)
            .unwrap();
    }
    let f = t[1].recv_timeout(10_000).unwrap();
    assert_eq!((f.from, f.payload.len()), (0, 100));
    let c = t[1].stats().snapshot();
    assert_eq!((c.checksum, c.header, c.oversize), (1, 1, 1), "{c:?}");
    assert_eq!(t[1].stats().oversize.load(Ordering::Relaxed), 1);
    assert_eq!(
        t[1].plane.held_bytes(),
        0,
        "refused frames give their credit back"
    );
}

/// A payload lent a buffer lands there and is checked there: the frame comes with an empty
/// payload that `was_placed` recognises once. A damaged payload in a loan is counted and
/// never reported placed, and a frame that came before its loan arrives as usual.
#[ignore = "needs libucx0 (apt-get install libucx0)"]
#[test]
fn a_lent_payload_lands_in_place_and_is_checked_there() {
    require();
    const N: usize = 2 << 20;
    let mut t = plane(2);
    let body = |k: usize| -> Vec<u8> { (0..N).map(|i| (i * 3 + k) as u8).collect() };
    let mut buf = vec![0u8; N];
    let f = frame(0, 1, body(1));
    let at_step = (f.epoch, f.step);
    // SAFETY (each loan below): `buf` is not touched until `end_loans` returns.
    assert!(unsafe { t[1].lend(0, at_step, f.tag, (buf.as_mut_ptr(), N), None) });
    t[0].send(1, f.clone()).unwrap();
    let got = t[1].recv_timeout(10_000).unwrap();
    assert_eq!((got.from, got.tag, got.payload.len()), (0, f.tag, 0));
    assert!(t[1].was_placed(&got));
    assert!(!t[1].was_placed(&got), "claimed once");
    t[1].end_loans();
    assert!(buf == body(1));
    assert_eq!(
        t[1].plane.received().bytes.load(Ordering::Relaxed),
        N as u64
    );

    // The right header with a damaged payload.
    let f = frame(0, 2, body(2));
    let (around, payload) = encode_split(&WireMsg::Frame(f.clone()));
    let mut damaged = payload.to_vec();
    damaged[N / 2] ^= 0x10;
    assert!(unsafe { t[1].lend(0, at_step, f.tag, (buf.as_mut_ptr(), N), None) });
    t[0].plane
        .engine
        .send_with_header(1, around, damaged.into())
        .unwrap();
    assert!(matches!(
        t[1].recv_timeout(500),
        Err(TransportError::Timeout(500))
    ));
    t[1].end_loans();
    assert_eq!(t[1].stats().snapshot().checksum, 1);

    // Sent and fetched before any loan: it comes with its payload.
    let f = frame(0, 3, body(3));
    t[0].send(1, f.clone()).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while t[1].plane.held_bytes() < N && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(unsafe { t[1].lend(0, at_step, f.tag, (buf.as_mut_ptr(), N), None) });
    let got = t[1].recv_timeout(10_000).unwrap();
    assert!(!t[1].was_placed(&got));
    assert_eq!(got.payload, Bytes::from(body(3)));
    t[1].end_loans();
    // Below the size worth a loan, or from itself: not lent.
    let small = unsafe { t[1].lend(0, at_step, f.tag, (buf.as_mut_ptr(), 100), None) };
    let own = unsafe { t[1].lend(1, at_step, f.tag, (buf.as_mut_ptr(), N), None) };
    assert!(!small && !own);
    t[1].end_loans();
    assert_eq!(t[1].plane.held_bytes(), 0);
}

/// A rank that does not look at its inbox holds at most its receive credit; the rest waits
/// in the senders' memory and arrives whole once the rank reads.
#[ignore = "needs libucx0 (apt-get install libucx0)"]
#[test]
fn a_busy_rank_holds_at_most_its_receive_credit() {
    require();
    const MIB: usize = 1 << 20;
    let mut t = plane_with(3, Some(4 * MIB));
    let body = |k: usize, n: usize| -> Vec<u8> { (0..n).map(|i| (i * 7 + k) as u8).collect() };
    for k in 0..12 {
        t[0].send(2, frame(0, k as u32, body(k, MIB))).unwrap();
    }
    // The other sender is not held up by the backlog: its small frames arrive too.
    t[1].send(2, frame(1, 100, b"small".to_vec())).unwrap();
    // Wait until the receiver has fetched what its credit allows: no room for another
    // 1 MiB frame. The small frame is eager and takes credit whenever it lands, so
    // before the fourth large one the rank holds 3 MiB and 5 bytes, after it 4 MiB and 5.
    let full = |held: usize| held + MIB > 4 * MIB;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !full(t[2].plane.held_bytes()) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(200));
    let held = t[2].plane.held_bytes();
    assert!(
        full(held) && held <= 4 * MIB + 5,
        "12 MiB sent, {held} bytes held against a 4 MiB credit"
    );
    let mut from0 = Vec::new();
    for _ in 0..13 {
        let f = t[2].recv_timeout(10_000).unwrap();
        if f.from == 0 {
            from0.push(f);
        } else {
            assert_eq!(&f.payload[..], b"small");
        }
    }
    // Rendezvous receives may complete out of order; frames are matched by tag.
    from0.sort_by_key(|f| f.tag.unit);
    for (k, f) in from0.iter().enumerate() {
        assert_eq!(f.tag.unit, k as u32);
        assert_eq!(f.payload, Bytes::from(body(k, MIB)), "frame {k}");
    }
    drop(from0);
    assert_eq!(
        t[2].plane.held_bytes(),
        0,
        "every frame taken gave its credit back"
    );
    // A frame larger than the whole credit passes, alone.
    t[0].send(2, frame(0, 50, body(50, 6 * MIB))).unwrap();
    t[0].send(2, frame(0, 51, body(51, MIB))).unwrap();
    let f = t[2].recv_timeout(10_000).unwrap();
    assert_eq!(f.payload, Bytes::from(body(50, 6 * MIB)));
    assert_eq!(t[2].recv_timeout(10_000).unwrap().tag.unit, 51);
    assert_eq!(t[2].plane.held_bytes(), 0);
}

/// Two ranks that each send the other many times their credit before reading anything:
/// neither engine stops for its full credit, so each can read everything the other sent
/// while the other is still not reading.
#[ignore = "needs libucx0 (apt-get install libucx0)"]
#[test]
fn ranks_sending_past_each_others_credit_do_not_deadlock() {
    require();
    const MIB: usize = 1 << 20;
    let mut t = plane_with(2, Some(2 * MIB));
    for k in 0..10u32 {
        t[0].send(1, frame(0, k, vec![k as u8; MIB])).unwrap();
        t[1].send(0, frame(1, k, vec![100 + k as u8; MIB])).unwrap();
    }
    for (me, other) in [(0usize, 1u32), (1, 0)] {
        let mut units: Vec<u32> = (0..10)
            .map(|_| {
                let f = t[me].recv_timeout(10_000).expect("no deadlock");
                assert_eq!(f.from, other);
                assert_eq!(f.payload.len(), MIB);
                f.tag.unit
            })
            .collect();
        units.sort_unstable();
        assert_eq!(units, (0..10).collect::<Vec<u32>>(), "rank {me}");
        assert_eq!(t[me].plane.held_bytes(), 0);
    }
}

/// A pull copies the bytes a peer named (the engines share this process, so its memory is
/// ours); memory the peer does not have is an error, not a fault; a plane with pulls off
/// refuses every pull.
#[ignore = "needs libucx0 (apt-get install libucx0)"]
#[test]
fn a_pull_reads_what_the_peer_named_and_refuses_what_it_does_not_have() {
    require();
    let ts = plane(2);
    assert!(ts[0].can_pull(1) && ts[1].can_pull(0));
    assert!(!ts[0].can_pull(7), "no such peer");
    let theirs: Vec<u8> = (0..3 << 20).map(|i| (i * 31 % 251) as u8).collect();
    let mut got = vec![0u8; theirs.len()];
    let memory = ts[0].peer_memory(1).unwrap();
    memory.read(theirs.as_ptr() as u64, &mut got).unwrap();
    assert!(got == theirs);
    assert_eq!(ts[0].plane.engine_counts().pulled_bytes, 3 << 20);
    for at in [8u64, u64::MAX - 4] {
        let e = memory.read(at, &mut got[..64]).unwrap_err();
        assert!(matches!(e, TransportError::Pull { from: 1, .. }), "{e:?}");
    }
    let e = ts[0]
        .peer_memory(7)
        .err()
        .expect("no memory for an unknown peer");
    assert!(matches!(e, TransportError::Pull { from: 7, .. }), "{e:?}");
    let off = plane_of(2, |r| EngineConfig {
        pulls: false,
        ..EngineConfig::shared_memory(r)
    });
    assert!(!off[0].can_pull(1));
    assert!(off[0].peer_memory(1).is_err());
}
