//! Frames whose payload is staged in the sender's shared segment (`ring`, `thread::staged`):
//! they arrive whole, in loans or not, checked like every other frame, and the slots are
//! reused.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::super::engine::{Engine, EngineConfig};
use super::super::transports_for_tests;
use super::UcxTransport;
use crate::plan::RankId;
use crate::runtime::transport::{test_frame, Frame, SharedMemory, Transport, TransportError};

fn body(k: usize, n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 13 + k) as u8).collect()
}

/// Waits until every engine stages to every other (they mapped each other's segments).
fn wait_attached(engines: &[Arc<Engine>]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    for a in engines {
        for b in engines.iter().filter(|b| b.id() != a.id()) {
            while !a.stages_to(b.id()) {
                assert!(
                    Instant::now() < deadline,
                    "{} never mapped {}",
                    b.id(),
                    a.id()
                );
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

/// Stages `payload` as the payload of `f` to `to`, retrying while no slot is free (the ring's
/// wait is short by design); `crc_xor` damages the checksum the sender reports.
fn stage(t: &UcxTransport, to: &[RankId], f: &Frame, payload: &[u8], crc_xor: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let sent = t
            .send_to_each_staged(to, f, payload.len(), &mut |dst| {
                dst.copy_from_slice(payload);
                crate::wire::crc32_of(&[payload]) ^ crc_xor
            })
            .unwrap();
        if sent {
            return;
        }
        assert!(Instant::now() < deadline, "no slot was freed");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// `n` engines made with `cfg(rank)` and a `UcxTransport` on each, connected to all, taking
/// frames of at most `max_frame(rank)` bytes.
fn transports_with(
    n: u32,
    cfg: impl Fn(u32) -> EngineConfig,
    max_frame: impl Fn(u32) -> u32,
) -> (Vec<Arc<Engine>>, Vec<UcxTransport>) {
    let engines: Vec<Arc<Engine>> = (0..n)
        .map(|r| Arc::new(Engine::start(cfg(r)).unwrap()))
        .collect();
    let peers: BTreeMap<RankId, Vec<u8>> = engines
        .iter()
        .map(|e| (e.id(), e.address().to_vec()))
        .collect();
    let t = engines
        .iter()
        .map(|e| UcxTransport::connect(e.id(), Arc::clone(e), &peers, max_frame(e.id())).unwrap())
        .collect();
    (engines, t)
}

#[ignore = "needs libucx0 (apt-get install libucx0)"]
#[test]
fn staged_payloads_reach_every_receiver_and_the_slots_are_reused() {
    let (engines, mut t) = transports_for_tests(3);
    wait_attached(&engines);
    const MIB: usize = 1 << 20;
    // One slot read by two receivers.
    let f = test_frame(3, 0, 1, Bytes::new());
    stage(&t[0], &[1, 2], &f, &body(1, 3 * MIB), 0);
    for r in [1, 2] {
        let got = t[r].recv_timeout(10_000).unwrap();
        assert_eq!((got.from, got.tag), (0, f.tag));
        assert_eq!(got.payload, Bytes::from(body(1, 3 * MIB)), "rank {r}");
        assert_eq!(engines[r].counts().staged, 1);
    }
    // Three times as many payloads as slots, the receiver not reading meanwhile: its engine
    // copies them out as they come and frees each slot.
    for k in 0..12u32 {
        let f = test_frame(3, 0, 10 + k, Bytes::new());
        stage(&t[0], &[1], &f, &body(k as usize, MIB), 0);
    }
    let mut units: Vec<u32> = (0..12)
        .map(|_| {
            let f = t[1].recv_timeout(10_000).unwrap();
            let k = f.tag.unit - 10;
            assert_eq!(f.payload, Bytes::from(body(k as usize, MIB)), "payload {k}");
            f.tag.unit
        })
        .collect();
    units.sort_unstable();
    assert_eq!(units, (10..22).collect::<Vec<u32>>());
    assert_eq!(engines[1].counts().staged, 13);
    assert_eq!(t[1].stats().snapshot().total(), 0);
    assert_eq!(
        t[1].plane.held_bytes(),
        0,
        "taken frames gave their credit back"
    );
    // Not staged: to itself (its inbox takes the frame with its payload), or too small to be
    // worth a slot, or larger than one.
    let mut never = |dst: &mut [u8]| -> u32 { panic!("wrote {} bytes", dst.len()) };
    assert!(!t[0]
        .send_to_each_staged(&[0, 1], &f, MIB, &mut never)
        .unwrap());
    assert!(!t[0]
        .send_to_each_staged(&[1], &f, 1000, &mut never)
        .unwrap());
    assert!(!t[0]
        .send_to_each_staged(&[1], &f, 5 * MIB, &mut never)
        .unwrap());
}

#[ignore = "needs libucx0 (apt-get install libucx0)"]
#[test]
fn a_staged_payload_lands_in_its_loan_and_damage_is_caught() {
    let (engines, mut t) = transports_for_tests(2);
    wait_attached(&engines);
    const N: usize = 2 << 20;
    let mut buf = vec![0u8; N];
    let f = test_frame(3, 0, 1, Bytes::new());
    // SAFETY (each loan below): `buf` is not touched until `end_loans` returns.
    assert!(unsafe { t[1].lend(0, (f.epoch, f.step), f.tag, (buf.as_mut_ptr(), N), None) });
    stage(&t[0], &[1], &f, &body(1, N), 0);
    let got = t[1].recv_timeout(10_000).unwrap();
    assert!(got.payload.is_empty() && t[1].was_placed(&got));
    t[1].end_loans();
    assert!(buf == body(1, N));
    assert_eq!(engines[1].counts().lent, 1);

    // A payload that does not match the checksum its notice carries: counted, never placed,
    // and its slot is freed all the same.
    let f = test_frame(3, 0, 2, Bytes::new());
    assert!(unsafe { t[1].lend(0, (f.epoch, f.step), f.tag, (buf.as_mut_ptr(), N), None) });
    stage(&t[0], &[1], &f, &body(2, N), 1);
    assert!(matches!(
        t[1].recv_timeout(500),
        Err(TransportError::Timeout(500))
    ));
    t[1].end_loans();
    // Not lent: the same check.
    stage(
        &t[0],
        &[1],
        &test_frame(3, 0, 3, Bytes::new()),
        &body(3, N),
        1 << 7,
    );
    assert!(matches!(
        t[1].recv_timeout(500),
        Err(TransportError::Timeout(500))
    ));
    assert_eq!(t[1].stats().snapshot().checksum, 2);
    for k in 0..8 {
        stage(
            &t[0],
            &[1],
            &test_frame(3, 0, 4 + k, Bytes::new()),
            &body(4, N),
            0,
        );
        assert_eq!(t[1].recv_timeout(10_000).unwrap().payload.len(), N);
    }
    assert_eq!(t[1].plane.held_bytes(), 0);
}

#[ignore = "needs libucx0 (apt-get install libucx0)"]
#[test]
fn a_staged_frame_over_the_receivers_limit_is_counted_and_dropped() {
    super::super::require_for_tests();
    // The receiver takes frames of at most 1 MiB.
    let max_frame = |r| if r == 1 { 1 << 20 } else { 64 << 20 };
    let (engines, mut t) = transports_with(2, EngineConfig::shared_memory, max_frame);
    wait_attached(&engines);
    stage(
        &t[0],
        &[1],
        &test_frame(3, 0, 1, Bytes::new()),
        &body(1, 2 << 20),
        0,
    );
    stage(
        &t[0],
        &[1],
        &test_frame(3, 0, 2, Bytes::new()),
        &body(2, 1 << 19),
        0,
    );
    let got = t[1].recv_timeout(10_000).unwrap();
    assert_eq!((got.tag.unit, got.payload.len()), (2, 1 << 19));
    assert_eq!(t[1].stats().oversize.load(Ordering::Relaxed), 1);
    assert_eq!(t[1].plane.held_bytes(), 0);
}

/// Two engines, rank 0's without a staging segment (what it sends goes by rendezvous), once
/// rank 0 has mapped rank 1's.
fn one_without_staging() -> (Vec<Arc<Engine>>, Vec<UcxTransport>) {
    let cfg = |r| EngineConfig {
        staging_slots: if r == 0 { 0 } else { 4 },
        ..EngineConfig::shared_memory(r)
    };
    let (engines, t) = transports_with(2, cfg, |_| 64 << 20);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !engines[1].stages_to(0) {
        assert!(
            Instant::now() < deadline,
            "rank 0 never mapped rank 1's segment"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    (engines, t)
}

#[ignore = "needs libucx0 (apt-get install libucx0)"]
#[test]
fn an_engine_without_staging_sends_through_ucx() {
    super::super::require_for_tests();
    let (engines, mut t) = one_without_staging();
    let f = test_frame(3, 0, 1, Bytes::new());
    let mut never = |dst: &mut [u8]| -> u32 { panic!("wrote {} bytes", dst.len()) };
    assert!(!engines[0].stages_to(1));
    assert!(!t[0]
        .send_to_each_staged(&[1], &f, 1 << 20, &mut never)
        .unwrap());
    // The other way it stages, and both ways frames arrive.
    stage(
        &t[1],
        &[0],
        &test_frame(3, 1, 1, Bytes::new()),
        &body(1, 1 << 20),
        0,
    );
    assert_eq!(t[0].recv_timeout(10_000).unwrap().payload, body(1, 1 << 20));
    assert_eq!(engines[0].counts().staged, 1);
}

/// Bytes added with wrapping: an addition whose order does not matter.
fn add_bytes(dst: &mut [u8], src: &[u8]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = d.wrapping_add(*s);
    }
}

/// Memory lent to add into receives the sum of what was there and the payload, whether the
/// payload was staged (added straight from the sender's slot) or came by rendezvous (received
/// whole, then added); both are checked as any other frame.
#[ignore = "needs libucx0 (apt-get install libucx0)"]
#[test]
fn a_payload_lent_to_add_is_added_whichever_way_it_came() {
    super::super::require_for_tests();
    let (engines, mut t) = one_without_staging();
    const N: usize = 3 << 20;
    let want = |k: usize| -> Vec<u8> {
        body(100, N)
            .iter()
            .zip(body(k, N))
            .map(|(a, b)| a.wrapping_add(b))
            .collect()
    };
    for (k, (from, to)) in [(0usize, 1usize), (1, 0)].into_iter().enumerate() {
        let mut buf = body(100, N);
        let f = test_frame(3, from as RankId, 1, Bytes::new());
        // SAFETY: `buf` is not touched until `end_loans` returns.
        let lent = unsafe {
            t[to].lend(
                from as RankId,
                (f.epoch, f.step),
                f.tag,
                (buf.as_mut_ptr(), N),
                Some(add_bytes),
            )
        };
        assert!(lent);
        if from == 0 {
            t[0].send(1, test_frame(3, 0, 1, body(k, N))).unwrap();
        } else {
            stage(&t[1], &[0], &f, &body(k, N), 0);
        }
        let got = t[to].recv_timeout(10_000).unwrap();
        assert!(
            got.payload.is_empty() && t[to].was_placed(&got),
            "rank {to}"
        );
        t[to].end_loans();
        assert!(buf == want(k), "rank {to}: the payload was added");
        let c = engines[to].counts();
        assert_eq!((c.added, c.staged), (1, from as u64), "rank {to}");
    }
}

/// A receiver that stops reading holds the sender's slots, and the sender's frames then go by
/// UCX's rendezvous; once it reads again the slots come back. (A receiver that dies gives them
/// back when UCX reports its endpoint failed: `ring`'s tests, and the kill -9 tests over UCX.)
#[ignore = "needs libucx0 (apt-get install libucx0)"]
#[test]
fn a_receiver_that_stops_reading_holds_slots_until_it_reads() {
    super::super::require_for_tests();
    // Rank 1 takes one payload beyond its 1-byte credit, then nothing until it reads.
    let cfg = |r| EngineConfig {
        inbox_bytes_max: (r == 1).then_some(1),
        ..EngineConfig::shared_memory(r)
    };
    let (engines, mut t) = transports_with(3, cfg, |_| 64 << 20);
    wait_attached(&engines);
    const MIB: usize = 1 << 20;
    let f = |unit| test_frame(3, 0, unit, Bytes::new());
    // One payload copied out, four held in their slots: the ring is full.
    for k in 0..5 {
        stage(&t[0], &[1], &f(k), &body(k as usize, MIB), 0);
    }
    let mut never = |dst: &mut [u8]| -> u32 { panic!("wrote {} bytes", dst.len()) };
    assert!(!t[0]
        .send_to_each_staged(&[2], &f(9), MIB, &mut never)
        .unwrap());
    // Its frames still go, through UCX's rendezvous.
    t[0].send(2, test_frame(3, 0, 10, body(10, MIB))).unwrap();
    assert_eq!(t[2].recv_timeout(10_000).unwrap().payload, body(10, MIB));
    assert_eq!(engines[2].counts().staged, 0);
    // Rank 1 reads: its credit comes back, its engine copies the rest out and frees them.
    let mut units: Vec<u32> = (0..5)
        .map(|_| t[1].recv_timeout(10_000).unwrap().tag.unit)
        .collect();
    units.sort_unstable();
    assert_eq!(units, vec![0, 1, 2, 3, 4]);
    stage(&t[0], &[2], &f(11), &body(11, MIB), 0);
    assert_eq!(t[2].recv_timeout(10_000).unwrap().payload, body(11, MIB));
    assert_eq!(engines[2].counts().staged, 1);
}
