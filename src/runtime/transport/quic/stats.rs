//! What a QUIC transport counts: frames and bytes it moved, what it refused, and what quinn
//! put on the wire.

use crate::plan::RankId;
use crate::wire::WireCounts;

/// Counters of one transport since it was bound.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct QuicStats {
    pub frames_sent: u64,
    /// Wire bytes, framing included.
    pub bytes_sent: u64,
    pub frames_received: u64,
    pub bytes_received: u64,
    /// Connections refused during the handshake (bad certificate, wrong protocol, timeout).
    pub refused_handshakes: u64,
    /// Frames from a rank other than the stream's, missing or repeated hellos.
    pub protocol_violations: u64,
    /// Control events dropped because the process layer did not drain them.
    pub control_dropped: u64,
    /// Frames rejected by the decoder, by reason.
    pub rejected: WireCounts,
    /// What quinn put on and took off the wire (UDP payload bytes: QUIC headers, encryption
    /// tags, acks and retransmissions included), over open and closed connections.
    pub udp: UdpTotals,
}

/// quinn's per-connection counters, summed over connections.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct UdpTotals {
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub datagrams_sent: u64,
    /// Send system calls; fewer than datagrams when segmentation offload batches them.
    pub send_calls: u64,
    pub lost_packets: u64,
    pub congestion_events: u64,
}

impl UdpTotals {
    pub(crate) fn of(s: &quinn::ConnectionStats) -> Self {
        Self {
            bytes_sent: s.udp_tx.bytes,
            bytes_received: s.udp_rx.bytes,
            datagrams_sent: s.udp_tx.datagrams,
            send_calls: s.udp_tx.ios,
            lost_packets: s.path.lost_packets,
            congestion_events: s.path.congestion_events,
        }
    }

    pub(crate) fn add(&mut self, o: &Self) {
        self.bytes_sent += o.bytes_sent;
        self.bytes_received += o.bytes_received;
        self.datagrams_sent += o.datagrams_sent;
        self.send_calls += o.send_calls;
        self.lost_packets += o.lost_packets;
        self.congestion_events += o.congestion_events;
    }
}

/// The path to one peer right now (for diagnosing throughput).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct QuicPathStats {
    pub peer: RankId,
    pub rtt_us: u64,
    pub min_rtt_us: u64,
    pub cwnd_bytes: u64,
    pub mtu_bytes: u16,
    pub udp: UdpTotals,
}
