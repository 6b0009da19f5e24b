//! Frame codec: round trips, and every kind of damaged input is a typed rejection, never a
//! panic or a wrong frame.

use bytes::Bytes;
use proptest::prelude::*;

use elastic_zero::runtime::transport::{Frame, Tag, TagKind};
use elastic_zero::wire::{
    check_split_in_place, crc32_of, decode, decode_split, encode_split, encode_to_vec,
    frame_around, frame_head, Lane, StreamDecoder, WireError, WireMsg, WireStats, WIRE_VERSION,
};

const MAX: u32 = 1 << 16;

const KINDS: [TagKind; 10] = [
    TagKind::Gather,
    TagKind::ReduceScatter,
    TagKind::GatherGrads,
    TagKind::GatherParams,
    TagKind::Agree,
    TagKind::Reshard,
    TagKind::Replica,
    TagKind::Interrupt,
    TagKind::Broadcast,
    TagKind::Barrier,
];

fn arb_msg() -> impl Strategy<Value = WireMsg> {
    let frame = (
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        0..KINDS.len(),
        any::<u8>(),
        any::<u32>(),
        any::<u8>(),
        proptest::collection::vec(any::<u8>(), 0..2048),
    )
        .prop_map(|(epoch, step, from, k, attempt, unit, pass, p)| {
            WireMsg::Frame(Frame {
                epoch,
                step,
                from,
                tag: Tag {
                    kind: KINDS[k],
                    attempt,
                    unit,
                    pass,
                    piece: 0,
                },
                payload: Bytes::from(p),
            })
        });
    prop_oneof![
        frame,
        (any::<u32>(), any::<bool>()).prop_map(|(rank, b)| WireMsg::Hello {
            rank,
            lane: if b { Lane::Bulk } else { Lane::Control }
        }),
        (any::<u32>(), proptest::collection::vec(any::<u8>(), 0..512)).prop_map(|(from, p)| {
            WireMsg::Control {
                from,
                payload: Bytes::from(p),
            }
        }),
    ]
}

/// Messages compared through their debug form (Frame has no PartialEq).
fn same(a: &WireMsg, b: &WireMsg) -> bool {
    format!("{a:?}") == format!("{b:?}")
}

/// Feeds `bytes` to a stream decoder in chunks of the given sizes; all frames, or the error.
fn stream(bytes: &[u8], cuts: &[usize]) -> Result<Vec<WireMsg>, WireError> {
    let mut dec = StreamDecoder::new(MAX);
    let mut out = Vec::new();
    let (mut at, mut i) = (0, 0);
    while at < bytes.len() {
        let n = cuts.get(i).copied().unwrap_or(bytes.len()).max(1);
        i += 1;
        let mut chunk = Bytes::copy_from_slice(&bytes[at..(at + n).min(bytes.len())]);
        at += chunk.len();
        while !chunk.is_empty() {
            if let Some(m) = dec.next(&mut chunk)? {
                out.push(m);
            }
        }
    }
    dec.finish()?;
    Ok(out)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn round_trips_one_shot_and_streamed(
        msgs in proptest::collection::vec(arb_msg(), 1..6),
        cuts in proptest::collection::vec(1usize..300, 0..40),
    ) {
        let mut all = Vec::new();
        for m in &msgs {
            let bytes = encode_to_vec(m);
            let (back, used) = decode(&bytes, MAX).unwrap();
            prop_assert_eq!(used, bytes.len());
            prop_assert!(same(m, &back));
            let (around, payload) = encode_split(m);
            prop_assert_eq!(around.len() + payload.len(), bytes.len());
            prop_assert!(same(m, &decode_split(&around, payload, MAX, None).unwrap()));
            all.extend_from_slice(&bytes);
        }
        let got = stream(&all, &cuts).unwrap();
        prop_assert_eq!(got.len(), msgs.len());
        for (a, b) in msgs.iter().zip(&got) {
            prop_assert!(same(a, b));
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512),
                                   cuts in proptest::collection::vec(1usize..64, 0..16)) {
        let _ = decode(&bytes, MAX);
        let _ = stream(&bytes, &cuts);
    }

    /// Any single corrupted byte is caught: the checksum covers every byte before it, and a
    /// damaged checksum no longer matches. The stream decoder sums each piece as it arrives,
    /// so it is fed in arbitrary pieces too.
    #[test]
    fn a_flipped_byte_is_rejected(
        m in arb_msg(),
        at in any::<prop::sample::Index>(),
        x in 1u8..=255,
        cuts in proptest::collection::vec(1usize..64, 0..24),
    ) {
        let mut bytes = encode_to_vec(&m);
        let i = at.index(bytes.len());
        bytes[i] ^= x;
        prop_assert!(decode(&bytes, MAX).is_err());
        prop_assert!(stream(&bytes, &[]).is_err());
        prop_assert!(stream(&bytes, &cuts).is_err());
    }

    /// The same for a message in two pieces (the UCX plane): a flipped byte in either piece, a
    /// piece cut short or grown, is refused.
    #[test]
    fn a_damaged_split_message_is_rejected(
        m in arb_msg(),
        at in any::<prop::sample::Index>(),
        x in 1u8..=255,
        grow in any::<bool>(),
    ) {
        let (around, payload) = encode_split(&m);
        let i = at.index(around.len() + payload.len());
        let (mut a, mut p) = (around.clone(), payload.to_vec());
        if i < a.len() { a[i] ^= x } else { p[i - a.len()] ^= x }
        // The receiver reads the payload for its checksum, or took it as the payload landed
        // (a payload staged in shared memory): refused either way.
        let landed_crc = crc32_of(&[&p]);
        prop_assert!(decode_split(&a, Bytes::from(p.clone()), MAX, None).is_err());
        prop_assert!(decode_split(&a, Bytes::from(p), MAX, Some(landed_crc)).is_err());
        let (mut a, mut p) = (around.clone(), payload.to_vec());
        if grow { p.push(0) } else if p.pop().is_none() { a = around[..around.len() - 1].to_vec() }
        let landed_crc = crc32_of(&[&p]);
        prop_assert!(decode_split(&a, Bytes::from(p.clone()), MAX, None).is_err());
        prop_assert!(decode_split(&a, Bytes::from(p), MAX, Some(landed_crc)).is_err());
    }

    /// A frame's prefix and header are known before it arrives (what a receiver that lends a
    /// buffer matches on), and the payload checked where it landed passes exactly when the
    /// message decodes: a flipped byte anywhere is refused there too.
    #[test]
    fn a_frame_is_known_by_its_head_and_checked_in_place(
        m in arb_msg(),
        at in any::<prop::sample::Index>(),
        x in 1u8..=255,
    ) {
        let (around, payload) = encode_split(&m);
        if let WireMsg::Frame(f) = &m {
            let head = frame_head(f.epoch, f.step, f.from, f.tag, f.payload.len());
            prop_assert_eq!(&around[..around.len() - 4], &head[..]);
            // Another length or tag gives another head.
            let other = frame_head(f.epoch, f.step, f.from, f.tag, f.payload.len() + 1);
            prop_assert!(!around.starts_with(&other));
            // A sender that writes the payload elsewhere (a staging slot) and sums it as it
            // writes puts the same bytes around it.
            let crc = crc32_of(&[&payload]);
            prop_assert_eq!(&frame_around(f, payload.len(), crc), &around);
            match check_split_in_place(&around, &payload, MAX, Some(crc)) {
                Ok(WireMsg::Frame(g)) => {
                    prop_assert_eq!((g.epoch, g.step, g.from, g.tag), (f.epoch, f.step, f.from, f.tag));
                    prop_assert!(g.payload.is_empty());
                }
                other => prop_assert!(false, "{:?}", other),
            }
        }
        let i = at.index(around.len() + payload.len());
        let (mut a, mut p) = (around.clone(), payload.to_vec());
        if i < a.len() { a[i] ^= x } else { p[i - a.len()] ^= x }
        prop_assert!(check_split_in_place(&a, &p, MAX, None).is_err());
        prop_assert!(check_split_in_place(&a, &p, MAX, Some(crc32_of(&[&p]))).is_err());
    }

    /// A corrupted header with a valid checksum (a buggy or hostile peer, not line noise) is
    /// either refused or decodes to a message that re-encodes to exactly those bytes.
    #[test]
    fn resealed_header_mutations_fail_or_decode_canonically(
        m in arb_msg(), at in 6usize..40, x in 1u8..=255,
    ) {
        let mut bytes = encode_to_vec(&m);
        let h = bytes[5] as usize;
        let i = 6 + at % h;
        bytes[i] ^= x;
        reseal(&mut bytes);
        if let Ok((back, used)) = decode(&bytes, MAX) {
            prop_assert_eq!(encode_to_vec(&back), &bytes[..used]);
        }
    }

    #[test]
    fn every_truncation_is_reported(m in arb_msg(), at in any::<prop::sample::Index>()) {
        let bytes = encode_to_vec(&m);
        let cut = at.index(bytes.len());
        let is_truncated = matches!(decode(&bytes[..cut], MAX), Err(WireError::Truncated { .. }));
        prop_assert!(is_truncated);
        let is_truncated = matches!(stream(&bytes[..cut], &[]), Err(WireError::Truncated { .. }));
        prop_assert!(is_truncated || cut == 0);
    }
}

fn frame(kind: TagKind, payload: Vec<u8>) -> WireMsg {
    WireMsg::Frame(Frame {
        epoch: 1,
        step: 2,
        from: 3,
        tag: Tag {
            kind,
            attempt: 0,
            unit: 4,
            pass: 0,
            piece: 0,
        },
        payload: Bytes::from(payload),
    })
}

/// Re-seals a frame after editing it, so that only the edited field is wrong.
fn reseal(bytes: &mut [u8]) {
    let n = bytes.len() - 4;
    let sum = crc32fast::hash(&bytes[..n]);
    bytes[n..].copy_from_slice(&sum.to_le_bytes());
}

#[test]
fn oversize_length_is_rejected_before_the_body_arrives() {
    let bytes = encode_to_vec(&frame(TagKind::Gather, vec![7; 1000]));
    assert!(matches!(
        decode(&bytes, 100),
        Err(WireError::Oversize { len, max }) if len > 1000 && max == 164
    ));
    // A prefix claiming 4 GiB: the stream decoder refuses after 6 bytes, allocating nothing.
    let mut dec = StreamDecoder::new(MAX);
    let mut prefix = Bytes::from(vec![WIRE_VERSION, 0xff, 0xff, 0xff, 0xff, 20]);
    assert!(matches!(
        dec.next(&mut prefix),
        Err(WireError::Oversize { .. })
    ));
}

#[test]
fn wrong_version_unknown_kind_and_bad_checksum_are_typed() {
    let good = encode_to_vec(&frame(TagKind::Barrier, vec![]));
    let mut v = good.clone();
    v[0] = 9;
    assert_eq!(decode(&v, MAX).unwrap_err(), WireError::Version { got: 9 });

    // The tag kind byte is the header's 6th field; find it by encoding two kinds and diffing.
    let other = encode_to_vec(&frame(TagKind::Gather, vec![]));
    let at = good.iter().zip(&other).position(|(a, b)| a != b).unwrap();
    let mut k = good.clone();
    k[at] = 200;
    reseal(&mut k);
    assert_eq!(decode(&k, MAX).unwrap_err(), WireError::UnknownTagKind(200));

    let mut c = good.clone();
    let n = c.len();
    c[n - 1] ^= 1;
    assert!(matches!(decode(&c, MAX), Err(WireError::Checksum { .. })));

    let stats = WireStats::default();
    for e in [
        decode(&v, MAX).unwrap_err(),
        decode(&k, MAX).unwrap_err(),
        decode(&c, MAX).unwrap_err(),
    ] {
        stats.count(&e);
    }
    let s = stats.snapshot();
    assert_eq!(
        (s.version, s.unknown_kind, s.checksum, s.total()),
        (1, 1, 1, 3)
    );
}

#[test]
fn hello_with_a_payload_is_rejected() {
    let mut bytes = encode_to_vec(&WireMsg::Hello {
        rank: 1,
        lane: Lane::Bulk,
    });
    // Grow the body by one payload byte and fix up the length and checksum.
    let body = u32::from_le_bytes(bytes[1..5].try_into().unwrap()) + 1;
    bytes[1..5].copy_from_slice(&body.to_le_bytes());
    let n = bytes.len() - 4;
    bytes.insert(n, 0xab);
    reseal(&mut bytes);
    assert!(matches!(
        decode(&bytes, MAX),
        Err(WireError::UnexpectedPayload {
            kind: "hello",
            len: 1
        })
    ));
}

fn big_frame(fill: u8) -> WireMsg {
    WireMsg::Frame(Frame {
        epoch: 1,
        step: 2,
        from: 3,
        tag: Tag {
            kind: TagKind::Gather,
            attempt: 0,
            unit: 0,
            pass: 0,
            piece: 0,
        },
        payload: Bytes::from(vec![fill; 3 << 20]),
    })
}

fn payload_of(m: WireMsg) -> Bytes {
    match m {
        WireMsg::Frame(f) => f.payload,
        other => panic!("expected a frame, got {other:?}"),
    }
}

/// Large frames reuse an earlier large frame's allocation once it was dropped, and never while
/// it is still held (a held frame keeps its bytes).
#[test]
fn large_frames_reuse_a_dropped_allocation_only() {
    let mut dec = StreamDecoder::new(8 << 20);
    let mut next = |fill: u8| {
        let mut b = Bytes::from(encode_to_vec(&big_frame(fill)));
        let m = dec.next(&mut b).expect("decodes").expect("complete");
        assert!(b.is_empty());
        payload_of(m)
    };
    let first = next(1);
    let second = next(2);
    let third = next(3);
    let held = [first.as_ptr(), second.as_ptr(), third.as_ptr()];
    assert!(held[0] != held[1] && held[1] != held[2] && held[0] != held[2]);
    assert!(first.iter().all(|&x| x == 1));
    assert!(second.iter().all(|&x| x == 2));
    let third_ptr = third.as_ptr();
    drop(third);
    let fourth = next(4);
    assert_eq!(
        fourth.as_ptr(),
        third_ptr,
        "the dropped allocation is reused"
    );
    assert!(fourth.iter().all(|&x| x == 4));
    assert!(
        second.iter().all(|&x| x == 2),
        "a held frame is never overwritten"
    );
}
