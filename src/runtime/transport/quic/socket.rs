//! The UDP socket as quinn sees it, with segmentation offload kept inside the kernel's limit.
//!
//! quinn batches up to 10 datagrams into one `sendmsg` with UDP_SEGMENT, whatever their size.
//! The kernel refuses a batch whose payload passes 65507 bytes (one IPv4 datagram's worth):
//! with MTUs above about 6500 every full batch failed, quinn-udp then turned segmentation
//! offload off for good, and the lost batches made MTU discovery fall back to 1200. This
//! wrapper tells quinn how many segments of the largest allowed MTU fit.

use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};

/// Largest UDP payload of one IPv4 datagram (65535 less the IP and UDP headers); a segmented
/// send may not carry more in total.
pub const MAX_GSO_PAYLOAD_BYTES: usize = 65_507;

/// Segments of `max_udp_payload_bytes` that fit in one segmented send (at least 1).
pub fn gso_segments_for(max_udp_payload_bytes: u16) -> usize {
    (MAX_GSO_PAYLOAD_BYTES / usize::from(max_udp_payload_bytes.max(1))).max(1)
}

/// quinn's socket with `max_transmit_segments` capped; everything else is passed through.
pub struct CappedSocket {
    inner: Arc<dyn AsyncUdpSocket>,
    max_segments: usize,
}

impl CappedSocket {
    pub fn new(inner: Arc<dyn AsyncUdpSocket>, max_udp_payload_bytes: u16) -> Self {
        Self {
            inner,
            max_segments: gso_segments_for(max_udp_payload_bytes),
        }
    }
}

impl fmt::Debug for CappedSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CappedSocket")
            .field("max_segments", &self.max_segments)
            .finish_non_exhaustive()
    }
}

impl AsyncUdpSocket for CappedSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        Arc::clone(&self.inner).create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        self.inner.try_send(transmit)
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments().min(self.max_segments)
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_stay_within_one_ipv4_datagram() {
        for mtu in [
            1200u16, 1472, 4000, 6500, 9000, 16_000, 32_000, 65_507, 65_527,
        ] {
            let n = gso_segments_for(mtu);
            assert!(n >= 1);
            assert!(
                n == 1 || n * usize::from(mtu) <= MAX_GSO_PAYLOAD_BYTES,
                "{mtu}: {n}"
            );
        }
        assert_eq!(gso_segments_for(9000), 7);
        assert_eq!(gso_segments_for(16_000), 4);
    }
}
