//! Settings of the QUIC transport, validated once. Defaults are safe on any network; the
//! loopback-tuned values measured (docs/benchmark-history.md, collectives over QUIC) are noted
//! per field.

use crate::wire::{DEFAULT_MAX_FRAME_BYTES, MAX_HEADER_BYTES};

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QuicConfig {
    /// Hard limit on one frame's payload; larger frames are refused on send and on receive
    /// [default: 256 MiB].
    pub max_frame_bytes: u32,
    /// Received bytes that may wait for the consumer before reads stop and flow control pushes
    /// back on senders; bulk frames share this, control frames get a separate 1/16th
    /// [default: 512 MiB; at least max_frame_bytes].
    pub recv_buffer_bytes: u64,
    /// Control events (messages, peer up/down) held for the process layer; older ones beyond
    /// this are dropped and counted [default: 4096].
    pub control_queue: usize,
    /// UDP socket SO_RCVBUF and SO_SNDBUF; 0 keeps the kernel default (about 208 KiB, which
    /// drops packets under bulk load) [default: 4 MiB].
    pub socket_buffer_bytes: usize,
    /// MTU before path discovery; a value above the path's real MTU stalls the handshake, so
    /// the default is QUIC's minimum. Loopback runs use 16000 [default: 1200].
    pub initial_mtu: u16,
    /// Largest UDP payload accepted and the upper bound of MTU discovery (quinn's default 1472
    /// caps it at Ethernet). Segmented sends carry at most 65507 bytes, so larger datagrams
    /// mean fewer per system call (10 up to 6550 bytes) [default: 4000; loopback 16000].
    pub max_udp_payload_bytes: u16,
    /// Generic segmentation offload: several packets per syscall [default: true].
    pub gso: bool,
    /// Per-stream flow-control window; the connection's receive and send windows are twice
    /// it. 64 MiB was no faster on loopback, where the CPU is the limit [default: 16 MiB;
    /// loopback 2 MiB].
    pub stream_window_bytes: u64,
    /// Congestion controller; NewReno and BBR were no faster on loopback [default: cubic].
    pub congestion: Congestion,
    /// The controller's window before the first ack, and after an idle period; 0 takes
    /// RFC 9002's for `initial_mtu` (14720 bytes up to MTU 7360, then 2 packets) [default: 0].
    pub initial_window_bytes: u64,
    /// Giving up on reaching a peer [default: 10000].
    pub connect_timeout_ms: u64,
    /// A connection with no packets for this long is closed (keep-alives go every third of
    /// it) [default: 10000].
    pub idle_timeout_ms: u64,
    /// On drop, how long to wait for peers to acknowledge what is still queued [default: 2000].
    pub linger_ms: u64,
    /// Threads of the transport's own tokio runtime; 2 was no faster on 2 shared cores
    /// [default: 1].
    pub io_threads: usize,
}

/// Datagram size on loopback (see `QuicConfig::loopback`).
pub const LOOPBACK_MTU: u16 = 16_000;

impl Default for QuicConfig {
    fn default() -> Self {
        Self {
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            recv_buffer_bytes: 2 * DEFAULT_MAX_FRAME_BYTES as u64,
            control_queue: 4096,
            socket_buffer_bytes: 4 << 20,
            initial_mtu: 1200,
            max_udp_payload_bytes: 4000,
            gso: true,
            stream_window_bytes: 16 << 20,
            congestion: Congestion::Cubic,
            initial_window_bytes: 0,
            connect_timeout_ms: 10_000,
            idle_timeout_ms: 10_000,
            linger_ms: 2000,
            io_threads: 1,
        }
    }
}

/// The QUIC congestion controllers quinn offers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Congestion {
    #[default]
    Cubic,
    NewReno,
    Bbr,
}

impl Congestion {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "cubic" => Some(Self::Cubic),
            "new_reno" | "newreno" => Some(Self::NewReno),
            "bbr" => Some(Self::Bbr),
            _ => None,
        }
    }
}

/// A setting out of range: names the field and what is valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("quic.{field}: {what}")]
pub struct QuicConfigError {
    pub field: &'static str,
    pub what: String,
}

impl QuicConfig {
    /// The loopback tuning measured in docs/benchmark-history.md (collectives over QUIC):
    /// - 16000-byte datagrams from the start (loopback's MTU is 65536). Per-packet work in quinn
    ///   and the kernel is a large share of QUIC's CPU: 4× fewer packets than at 4000 gave
    ///   1.25–1.37× the busbw.
    /// - A 2 MiB stream window. On loopback the receiver's socket buffer is the only queue, and
    ///   16 MiB in flight overflowed it whenever the receiver was descheduled (thousands of
    ///   losses a run, each a congestion event); 2 MiB lost none, at the same busbw.
    pub fn loopback() -> Self {
        Self {
            initial_mtu: LOOPBACK_MTU,
            max_udp_payload_bytes: LOOPBACK_MTU,
            stream_window_bytes: 2 << 20,
            ..Self::default()
        }
    }

    /// `loopback()` for a loopback address, else the defaults.
    pub fn for_bind(addr: std::net::SocketAddr) -> Self {
        if addr.ip().is_loopback() {
            Self::loopback()
        } else {
            Self::default()
        }
    }

    pub fn validate(&self) -> Result<(), QuicConfigError> {
        let bad = |field, what: String| Err(QuicConfigError { field, what });
        if self.max_frame_bytes == 0 || self.max_frame_bytes > u32::MAX - MAX_HEADER_BYTES as u32 {
            return bad("max_frame_bytes", "must be between 1 and 4 GiB - 64".into());
        }
        if self.recv_buffer_bytes < self.max_frame_bytes as u64 {
            return bad(
                "recv_buffer_bytes",
                format!(
                    "must be at least max_frame_bytes ({})",
                    self.max_frame_bytes
                ),
            );
        }
        if self.control_queue == 0 {
            return bad("control_queue", "must be at least 1".into());
        }
        if !(1200..=65527).contains(&self.max_udp_payload_bytes) {
            return bad("max_udp_payload_bytes", "must be in 1200..=65527".into());
        }
        if self.initial_mtu < 1200 || self.initial_mtu > self.max_udp_payload_bytes {
            return bad(
                "initial_mtu",
                "must be in 1200..=max_udp_payload_bytes".into(),
            );
        }
        if !(64 << 10..=1 << 30).contains(&self.stream_window_bytes) {
            return bad("stream_window_bytes", "must be in 64 KiB..=1 GiB".into());
        }
        if self.initial_window_bytes > 1 << 30 {
            return bad("initial_window_bytes", "must be at most 1 GiB".into());
        }
        if self.connect_timeout_ms == 0 || self.idle_timeout_ms < 30 {
            return bad(
                "idle_timeout_ms",
                "connect_timeout_ms must be at least 1 and idle_timeout_ms at least 30".into(),
            );
        }
        if !(1..=64).contains(&self.io_threads) {
            return bad("io_threads", "must be in 1..=64".into());
        }
        Ok(())
    }
}
