//! The UDP socket under a QUIC endpoint. quinn leaves the kernel's default buffers (about
//! 208 KiB), which overflow under bulk transfer on loopback and lose thousands of packets; we
//! build the socket ourselves and ask for larger ones.

use std::net::{SocketAddr, UdpSocket};

use socket2::{Domain, Protocol, Socket, Type};

/// A UDP socket bound to exactly `addr`, with send and receive buffers of `buffer_bytes`
/// (the kernel may cap them at `net.core.{r,w}mem_max`; the granted sizes are returned).
pub fn bind_udp(
    addr: SocketAddr,
    buffer_bytes: usize,
) -> std::io::Result<(UdpSocket, SocketBuffers)> {
    let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    if addr.is_ipv6() {
        // Bind to the given address only, never to the IPv4 side as well.
        s.set_only_v6(true)?;
    }
    if buffer_bytes > 0 {
        s.set_recv_buffer_size(buffer_bytes)?;
        s.set_send_buffer_size(buffer_bytes)?;
    }
    s.bind(&addr.into())?;
    let got = SocketBuffers {
        recv_bytes: s.recv_buffer_size()?,
        send_bytes: s.send_buffer_size()?,
    };
    Ok((s.into(), got))
}

/// Buffer sizes the kernel granted (Linux reports twice the requested value, for bookkeeping).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SocketBuffers {
    pub recv_bytes: usize,
    pub send_bytes: usize,
}
