//! What an engine is set up with and what it reports: its configuration, the messages and
//! events it delivers, and its counters of refused and failed operations.

use bytes::Bytes;

/// How an engine is set up.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// This engine's id, carried in every message's header so the receiver knows the sender.
    pub id: u32,
    /// UCX transports (`UCX_TLS`), set in code so that the environment does not choose them.
    pub transports: String,
    /// The largest message taken, in bytes; a larger one is refused by the receiver (counted).
    pub max_message_bytes: usize,
    /// Commands queued for the thread at most.
    pub queue_max: usize,
    /// Received messages held at most before the thread stops progressing.
    pub inbox_max: usize,
    /// Bytes of received payloads held at most before the consumer gives them back
    /// ([`super::engine::Engine::release`]); rendezvous payloads beyond it wait in the
    /// sender's memory. `None`: twice `max_message_bytes`.
    pub inbox_bytes_max: Option<usize>,
    /// Network devices UCX may use (`UCX_NET_DEVICES`; `None`: shared memory only). Traffic
    /// on them is not encrypted.
    pub net_devices: Option<String>,
    /// Slots in this engine's staging segment (0: no staging, every payload goes through UCX's
    /// rendezvous): payloads for peers on this host are written there once and copied out by
    /// the receiver (`ring`).
    pub staging_slots: u32,
    /// Bytes per staging slot: payloads larger than this go through UCX's rendezvous.
    pub staging_slot_bytes: u32,
    /// Whether the consumer may read the memory of a peer whose staging segment it attached
    /// (`UcxPlane::peer_memory`, for the all-reduce's and broadcast's one-copy paths). On by
    /// default; off, every
    /// payload goes through the slots or UCX.
    pub pulls: bool,
}

impl EngineConfig {
    /// Shared memory only (SysV or POSIX segments, CMA zero copy, loopback), 256 MiB messages.
    pub fn shared_memory(id: u32) -> Self {
        Self {
            id,
            transports: "sysv,posix,cma,self".into(),
            max_message_bytes: crate::wire::DEFAULT_MAX_FRAME_BYTES as usize,
            queue_max: 1024,
            inbox_max: 1024,
            inbox_bytes_max: None,
            net_devices: None,
            staging_slots: 4,
            staging_slot_bytes: crate::wire::frame::PIECE_BYTES as u32,
            pulls: true,
        }
    }

    /// The receive credit, in bytes.
    pub fn inbox_bytes(&self) -> usize {
        self.inbox_bytes_max
            .unwrap_or(self.max_message_bytes.saturating_mul(2))
    }

    /// Shared memory, and TCP or RDMA (`rc`, `ud`, `dc` where present) on `devices` (e.g.
    /// `eth1` or `mlx5_0:1`), unencrypted: for networks the operator trusts.
    pub fn with_network(id: u32, devices: &str) -> Self {
        Self {
            transports: "sysv,posix,cma,self,tcp,rc,ud,dc".into(),
            net_devices: Some(devices.to_string()),
            ..Self::shared_memory(id)
        }
    }
}

/// Whether `devices` is a list UCX can take (`eth1`, `mlx5_0:1,eth2`): names of letters,
/// digits and `_ . : -`, comma-separated.
pub fn valid_net_devices(devices: &str) -> bool {
    !devices.is_empty()
        && devices.split(',').all(|d| {
            !d.is_empty()
                && d.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_.:-".contains(c))
        })
}

/// What arrives.
#[derive(Debug, PartialEq, Eq)]
pub enum Inbound {
    /// A message from engine `from`: its small header and its payload.
    Message {
        from: u32,
        header: Vec<u8>,
        bytes: Bytes,
        /// The payload's CRC-32, when the engine took it while copying the payload.
        crc: Option<u32>,
    },
    /// A message from engine `from` whose payload went into a lent buffer: `len` bytes at
    /// `at`, for the loan of `batch`; `ok` is false when the receive failed (the bytes there
    /// are not the message's). Either way the engine no longer writes there.
    Placed {
        from: u32,
        header: Vec<u8>,
        batch: u64,
        at: usize,
        len: usize,
        ok: bool,
        /// As for `Message`.
        crc: Option<u32>,
    },
    /// UCX reported that the endpoint to `peer` failed; it is closed.
    PeerLost { peer: u32, why: String },
}

/// Counters of what the engine refused or lost, and of the messages received into lent memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineCounts {
    /// Rendezvous or staged messages whose receive went straight into memory a consumer lent.
    pub lent: u64,
    /// Payloads copied out of a peer's staging segment.
    pub staged: u64,
    /// Of the lent ones, payloads added into the lent memory rather than written there.
    pub added: u64,
    /// Messages over `max_message_bytes` or with a malformed header, dropped.
    pub refused: u64,
    /// Sends or receives that completed with an error.
    pub failed: u64,
    /// Reads of a peer's memory (`UcxPlane::peer_memory`), and the bytes they copied.
    pub pulls: u64,
    pub pulled_bytes: u64,
}
