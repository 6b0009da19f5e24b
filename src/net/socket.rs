//! The UDP socket under a QUIC endpoint. quinn leaves the kernel's default buffers (about
//! 208 KiB), which overflow under bulk transfer on loopback and lose thousands of packets; we
//! build the socket ourselves and ask for larger ones.

use std::net::{SocketAddr, UdpSocket};

use socket2::{Domain, Protocol, Socket, Type};

/// A UDP socket bound to exactly `addr`, with send and receive buffers of `buffer_bytes`
/// (the kernel may cap them at `net.core.{r,w}mem_max`).
pub fn bind_udp(addr: SocketAddr, buffer_bytes: usize) -> std::io::Result<UdpSocket> {
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
    Ok(s.into())
}
