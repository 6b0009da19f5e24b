//! QUIC transport on loopback: collectives give the same bytes as in-process, control and bulk
//! lanes both deliver, a peer with a foreign certificate is refused, damaged or spoofed frames
//! are rejected and counted, and a lost peer is reported. Every wait has a deadline.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;

use elastic_zero::bench::collectives::broadcast::broadcast;
use elastic_zero::net::{ClusterCa, Identity};
use elastic_zero::plan::RankId;
use elastic_zero::runtime::step::comm::collectives::{barrier, exchange_small};
use elastic_zero::runtime::step::comm::Comm;
use elastic_zero::runtime::transport::quic::{ControlEvent, QuicConfig, QuicTransport};
use elastic_zero::runtime::transport::{Frame, Tag, TagKind, Transport, TransportError};

const WAIT_MS: u64 = 20_000;

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn cfg() -> QuicConfig {
    QuicConfig {
        connect_timeout_ms: WAIT_MS,
        idle_timeout_ms: 3_000,
        recv_buffer_bytes: 64 << 20,
        max_frame_bytes: 32 << 20,
        ..QuicConfig::loopback()
    }
}

/// `n` connected transports of one cluster.
fn cluster(n: u32) -> Vec<QuicTransport> {
    cluster_with(n, &cfg())
}

/// `n` connected transports of one cluster, with settings `c`.
fn cluster_with(n: u32, c: &QuicConfig) -> Vec<QuicTransport> {
    let ca = ClusterCa::generate("test CA").unwrap();
    let ts: Vec<QuicTransport> = (0..n)
        .map(|r| {
            let id = ca.issue(&format!("rank-{r}")).unwrap();
            QuicTransport::bind(r, loopback(), &id, c).unwrap()
        })
        .collect();
    let addrs: Vec<(RankId, SocketAddr)> = ts.iter().map(|t| (t.rank(), t.local_addr())).collect();
    for t in &ts {
        t.add_peers(&addrs);
    }
    let ranks: Vec<RankId> = (0..n).collect();
    for t in &ts {
        t.wait_connected(&ranks, WAIT_MS).unwrap();
    }
    ts
}

/// A frame of rank 0 in step 1 carrying a copy of `payload`.
fn bulk_from_0(tag: Tag, payload: &[u8]) -> Frame {
    Frame {
        epoch: 0,
        step: 1,
        from: 0,
        tag,
        payload: Bytes::copy_from_slice(payload),
    }
}

fn tag(kind: TagKind, unit: u32) -> Tag {
    Tag {
        kind,
        attempt: 0,
        unit,
        pass: 0,
        piece: 0,
    }
}

#[test]
fn collectives_over_quic_deliver_every_byte() {
    let ts = cluster(3);
    let members: Vec<RankId> = vec![0, 1, 2];
    let handles: Vec<_> = ts
        .into_iter()
        .map(|t| {
            let members = members.clone();
            std::thread::spawn(move || {
                let r = t.rank();
                let mut comm = Comm::new(t, WAIT_MS);
                comm.begin_step(0, 1);
                // 5 MiB and a bit from the root: two pieces, many packets, several
                // flow-control windows' worth.
                let big: Vec<u8> = (0..(5usize << 20) + 4100)
                    .map(|i| (i * 7 + 3) as u8)
                    .collect();
                let mine = if r == 1 {
                    Bytes::from(big.clone())
                } else {
                    Bytes::new()
                };
                let mut got = if r == 1 {
                    big.clone()
                } else {
                    vec![0; big.len()]
                };
                broadcast(
                    &mut comm,
                    &members,
                    1,
                    tag(TagKind::Broadcast, 0),
                    mine,
                    big.len(),
                    |at, b| got[at..at + b.len()].copy_from_slice(b),
                )
                .unwrap();
                assert!(got == big, "rank {r} holds the root's bytes");
                let all = exchange_small(
                    &mut comm,
                    &members,
                    tag(TagKind::Agree, 0),
                    Bytes::from(vec![r as u8; 5]),
                )
                .unwrap();
                for (peer, b) in &all {
                    assert_eq!(&b[..], &[*peer as u8; 5]);
                }
                barrier(&mut comm, &members, tag(TagKind::Barrier, 0)).unwrap();
                comm.stats()
            })
        })
        .collect();
    for h in handles {
        let s = h.join().unwrap();
        assert_eq!(s.stale_dropped + s.duplicates_dropped, 0);
    }
}

#[test]
fn control_messages_and_peer_events_arrive() {
    let mut ts = cluster(2);
    let (c0, c1) = (ts[0].control(), ts[1].control());
    c0.send_control(1, Bytes::from_static(b"heartbeat"))
        .unwrap();
    let deadline = Instant::now() + Duration::from_millis(WAIT_MS);
    let mut got = None;
    while Instant::now() < deadline && got.is_none() {
        if let Ok(ControlEvent::Message { from, payload }) = c1.recv_control_timeout(100) {
            got = Some((from, payload));
        }
    }
    assert_eq!(got, Some((0, Bytes::from_static(b"heartbeat"))));
    assert_eq!(c0.connected(), vec![1]);

    // Rank 1 goes away without a goodbye: rank 0 hears it within the idle timeout (3 s).
    let t1 = ts.pop().unwrap();
    drop(t1);
    let mut lost = None;
    while Instant::now() < deadline && lost.is_none() {
        if let Ok(ControlEvent::Lost { rank, reason }) = c0.recv_control_timeout(100) {
            lost = Some((rank, reason));
        }
    }
    let (rank, _) = lost.expect("rank 0 must learn that rank 1 is gone");
    assert_eq!(rank, 1);
    let f = Frame {
        epoch: 0,
        step: 0,
        from: 0,
        tag: tag(TagKind::Gather, 0),
        payload: Bytes::new(),
    };
    assert_eq!(ts[0].send(1, f), Err(TransportError::UnknownPeer(1)));
}

#[test]
fn a_peer_with_a_foreign_certificate_is_refused() {
    let ca = ClusterCa::generate("cluster").unwrap();
    let foreign = ClusterCa::generate("someone else").unwrap();
    let server = QuicTransport::bind(1, loopback(), &ca.issue("rank-1").unwrap(), &cfg()).unwrap();
    // The intruder trusts the cluster CA (it knows the public cert) but its own certificate is
    // signed by another CA.
    let mut stolen = foreign.issue("rank-0").unwrap();
    stolen.ca = ca.cert().clone();
    let intruder = QuicTransport::bind(0, loopback(), &stolen, &cfg()).unwrap();
    intruder.add_peers(&[(1, server.local_addr())]);
    server.add_peers(&[(0, intruder.local_addr())]);
    let err = intruder.wait_connected(&[1], WAIT_MS).unwrap_err();
    assert!(
        err.to_string().contains("lost"),
        "expected a refusal, got {err}"
    );
    // The server refused the handshake and never registered rank 0.
    let deadline = Instant::now() + Duration::from_millis(WAIT_MS);
    while server.stats().refused_handshakes == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(server.stats().refused_handshakes, 1);
    assert!(server.control().connected().is_empty());
    assert_eq!(server.stats().frames_received, 0);

    // The other direction: a server with a foreign certificate is refused by a cluster client.
    let fake_server = QuicTransport::bind(3, loopback(), &stolen, &cfg()).unwrap();
    let client = QuicTransport::bind(2, loopback(), &ca.issue("rank-2").unwrap(), &cfg()).unwrap();
    client.add_peers(&[(3, fake_server.local_addr())]);
    assert!(client.wait_connected(&[3], WAIT_MS).is_err());
    assert_eq!(client.stats().refused_handshakes, 1);
}

#[test]
fn a_frame_claiming_another_sender_is_rejected() {
    let mut ts = cluster(2);
    let spoofed = Frame {
        epoch: 0,
        step: 0,
        from: 7,
        tag: tag(TagKind::Gather, 0),
        payload: Bytes::from_static(b"evil"),
    };
    ts[0].send(1, spoofed).unwrap();
    let deadline = Instant::now() + Duration::from_millis(WAIT_MS);
    while ts[1].stats().protocol_violations == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(ts[1].stats().protocol_violations, 1);
    assert_eq!(
        ts[1].recv_timeout(50).unwrap_err(),
        TransportError::Timeout(50)
    );
}

/// A raw quinn client with a valid certificate writes a damaged frame: the receiver counts it
/// and closes the connection; nothing reaches the inbox.
#[test]
fn damaged_bytes_on_a_stream_are_counted_and_dropped() {
    use elastic_zero::wire::{encode_to_vec, Lane, WireMsg};
    let ca = ClusterCa::generate("cluster").unwrap();
    let mut server =
        QuicTransport::bind(1, loopback(), &ca.issue("rank-1").unwrap(), &cfg()).unwrap();
    let id: Identity = ca.issue("rank-0").unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let addr = server.local_addr();
    rt.block_on(async move {
        let mut ep = quinn::Endpoint::client(loopback()).unwrap();
        ep.set_default_client_config(quinn::ClientConfig::new(
            elastic_zero::net::tls::ClusterTls::new(&id)
                .unwrap()
                .quic_client()
                .unwrap(),
        ));
        let conn = ep.connect(addr, "ezero-peer").unwrap().await.unwrap();
        let mut s = conn.open_uni().await.unwrap();
        let mut bytes = encode_to_vec(&WireMsg::Hello {
            rank: 0,
            lane: Lane::Bulk,
        });
        let mut frame = encode_to_vec(&WireMsg::Frame(Frame {
            epoch: 0,
            step: 0,
            from: 0,
            tag: tag(TagKind::Gather, 0),
            payload: Bytes::from(vec![1u8; 100]),
        }));
        let n = frame.len();
        frame[n - 10] ^= 0xff; // a payload byte: the checksum no longer matches
        bytes.extend_from_slice(&frame);
        s.write_all(&bytes).await.unwrap();
        let _ = s.finish();
        let closed = tokio::time::timeout(Duration::from_millis(WAIT_MS), conn.closed()).await;
        assert!(closed.is_ok(), "the server must close the connection");
    });
    assert_eq!(server.stats().rejected.checksum, 1);
    assert_eq!(
        server.recv_timeout(50).unwrap_err(),
        TransportError::Timeout(50)
    );
}

/// Every congestion controller carries a multi-frame bulk transfer intact, and quinn's wire
/// counters see at least the payload (plus QUIC's own overhead) leave and arrive.
#[test]
fn each_congestion_controller_delivers_and_wire_bytes_are_counted() {
    use elastic_zero::runtime::transport::quic::Congestion;
    for (congestion, initial_window_bytes) in [
        (Congestion::Cubic, 0),
        (Congestion::NewReno, 1 << 20),
        (Congestion::Bbr, 0),
    ] {
        let c = QuicConfig {
            congestion,
            initial_window_bytes,
            ..cfg()
        };
        let mut ts = cluster_with(2, &c);
        // Two large frames: the second lands in the first's allocation if it was dropped.
        let payload: Vec<u8> = (0..2usize << 20).map(|i| (i * 13 + 1) as u8).collect();
        for unit in 0..2 {
            let frame = bulk_from_0(tag(TagKind::Gather, unit), &payload);
            ts[0].send(1, frame).unwrap();
            let got = ts[1].recv_timeout(WAIT_MS).unwrap();
            assert_eq!(got.tag.unit, unit, "{congestion:?}");
            assert!(
                got.payload[..] == payload[..],
                "{congestion:?}: bytes differ"
            );
        }
        let (sent, received) = (ts[0].stats().udp, ts[1].stats().udp);
        assert!(
            sent.bytes_sent > 2 * payload.len() as u64,
            "{congestion:?}: {sent:?}"
        );
        assert!(
            received.bytes_received > 2 * payload.len() as u64,
            "{received:?}"
        );
        assert!(sent.datagrams_sent >= sent.send_calls && sent.send_calls > 0);
        let paths = ts[0].control().paths();
        assert_eq!(paths.len(), 1);
        assert_eq!(paths[0].peer, 1);
    }
}

#[test]
fn an_initial_window_above_one_gib_is_refused() {
    let c = QuicConfig {
        initial_window_bytes: (1 << 30) + 1,
        ..cfg()
    };
    let e = c.validate().unwrap_err();
    assert_eq!(e.field, "initial_window_bytes");
}

/// Datagrams far above Ethernet's MTU work end to end on loopback. Before, quinn's initial
/// congestion window (12000 bytes) could not hold one 16000-byte packet, so the handshake never
/// completed; and above about 6500 bytes quinn's 10-datagram segmented sends passed the
/// kernel's 64 KiB limit, which turned segmentation offload off and made MTU discovery fall
/// back to 1200.
#[test]
fn large_datagrams_connect_keep_their_mtu_and_stay_segmented() {
    for mtu in [16_000u16, 32_000] {
        let c = QuicConfig {
            initial_mtu: mtu,
            max_udp_payload_bytes: mtu,
            ..cfg()
        };
        let mut ts = cluster_with(2, &c);
        let payload: Vec<u8> = (0..8usize << 20).map(|i| (i * 31 + 5) as u8).collect();
        let frame = bulk_from_0(tag(TagKind::Gather, 0), &payload);
        ts[0].send(1, frame).unwrap();
        let got = ts[1].recv_timeout(WAIT_MS).unwrap();
        assert!(got.payload[..] == payload[..], "mtu {mtu}: bytes differ");
        let path = ts[0].control().paths()[0];
        assert_eq!(path.mtu_bytes, mtu, "{path:?}");
        // Several datagrams per send call: segmentation offload is still on.
        assert!(
            path.udp.datagrams_sent > path.udp.send_calls,
            "mtu {mtu}: {path:?}"
        );
        // No datagram above the size: at most this many carried the payload.
        assert!(
            path.udp.datagrams_sent >= (payload.len() / usize::from(mtu)) as u64,
            "{path:?}"
        );
    }
}

/// One frame to several ranks (a broadcast root's or an all-gather's send) is encoded once and
/// reaches each of them, this rank included, whole.
#[test]
fn send_to_each_reaches_every_rank_once() {
    let mut ts = cluster(3);
    let payload: Vec<u8> = (0..1usize << 20).map(|i| (i * 11 + 7) as u8).collect();
    let frame = bulk_from_0(tag(TagKind::Broadcast, 4), &payload);
    ts[0].send_to_each(&[1, 0, 2], frame).unwrap();
    assert_eq!(ts[0].stats().frames_sent, 2, "the self-send stays local");
    for t in ts.iter_mut() {
        let got = t.recv_timeout(WAIT_MS).unwrap();
        assert_eq!((got.from, got.tag.unit), (0, 4));
        assert!(
            got.payload[..] == payload[..],
            "rank {}: bytes differ",
            t.rank()
        );
        assert!(matches!(
            t.recv_timeout(200),
            Err(TransportError::Timeout(_))
        ));
    }
}
