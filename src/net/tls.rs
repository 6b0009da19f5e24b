//! The cluster's mutual-TLS configs, built once per process and shared by every connection
//! kind: QUIC data plane, TCP data plane and the coordinator's control connections. Both sides
//! present a cluster certificate and verify the other's against the cluster CA only (no system
//! roots). TLS 1.3, ring provider.
//!
//! Each connection kind has its own ALPN id, and a server refuses a client that offers another
//! or none: a data-plane client cannot talk to the control port, nor the other way round.

use std::sync::Arc;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::ServerName;

use super::secrets::{Identity, PEER_SERVER_NAME};

/// The connection kinds of a cluster; each speaks its own ALPN id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// The QUIC data plane between workers.
    Quic,
    /// The TCP data plane between workers.
    Data,
    /// A worker's control connection to the coordinator.
    Control,
}

impl Protocol {
    pub fn alpn(self) -> &'static [u8] {
        match self {
            Self::Quic => ALPN,
            Self::Data => b"ezero-data/1",
            Self::Control => b"ezero-control/1",
        }
    }
}

/// ALPN id of the QUIC data plane: a peer speaking anything else fails the handshake.
pub const ALPN: &[u8] = b"ezero/1";

#[derive(Debug, thiserror::Error)]
#[error("TLS setup failed: {0}")]
pub struct TlsError(pub String);

fn err(e: impl std::fmt::Display) -> TlsError {
    TlsError(e.to_string())
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(id: &Identity) -> Result<Arc<RootCertStore>, TlsError> {
    let mut r = RootCertStore::empty();
    r.add(id.ca.clone()).map_err(err)?;
    Ok(Arc::new(r))
}

/// One process's TLS configs, per protocol; cheap to clone.
#[derive(Clone)]
pub struct ClusterTls {
    /// Indexed by `Protocol as usize`.
    servers: [Arc<ServerConfig>; 3],
    clients: [Arc<ClientConfig>; 3],
    https: Arc<ServerConfig>,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterTls")
    }
}

impl ClusterTls {
    const PROTOCOLS: [Protocol; 3] = [Protocol::Quic, Protocol::Data, Protocol::Control];

    /// Verifies and loads `id` once; every config shares its certificate, key and CA.
    pub fn new(id: &Identity) -> Result<Self, TlsError> {
        let (server, client) = (server_base(id)?, client_base(id)?);
        let https = Arc::new(https_server(id)?);
        Ok(Self {
            https,
            servers: Self::PROTOCOLS.map(|p| {
                let mut c = server.clone();
                c.alpn_protocols = vec![p.alpn().to_vec()];
                Arc::new(c)
            }),
            clients: Self::PROTOCOLS.map(|p| {
                let mut c = client.clone();
                c.alpn_protocols = vec![p.alpn().to_vec()];
                Arc::new(c)
            }),
        })
    }

    /// Server side of `p`: requires a client certificate from the cluster CA.
    pub fn server(&self, p: Protocol) -> Arc<ServerConfig> {
        Arc::clone(&self.servers[p as usize])
    }

    /// Client side of `p`: verifies the server against the cluster CA, presents our cert.
    pub fn client(&self, p: Protocol) -> Arc<ClientConfig> {
        Arc::clone(&self.clients[p as usize])
    }

    /// The HTTPS control endpoint's server side: this process's cluster certificate, which
    /// operators check against the cluster CA; no client certificate (the operator token
    /// authorizes), ALPN `http/1.1`.
    pub fn https_server(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.https)
    }

    pub fn quic_server(&self) -> Result<Arc<QuicServerConfig>, TlsError> {
        let c = QuicServerConfig::try_from(self.server(Protocol::Quic)).map_err(err)?;
        Ok(Arc::new(c))
    }

    pub fn quic_client(&self) -> Result<Arc<QuicClientConfig>, TlsError> {
        let c = QuicClientConfig::try_from(self.client(Protocol::Quic)).map_err(err)?;
        Ok(Arc::new(c))
    }
}

/// The name every client checks (trust comes from the CA, not from the name).
pub fn peer_server_name() -> ServerName<'static> {
    // Invariant: a constant, valid DNS name.
    ServerName::try_from(PEER_SERVER_NAME).expect("a valid DNS name")
}

/// Why a completed handshake is still refused: the client negotiated another protocol (or
/// none; a rustls server lets a client that offers no ALPN through).
pub fn check_alpn(got: Option<&[u8]>, want: Protocol) -> Result<(), String> {
    if got == Some(want.alpn()) {
        return Ok(());
    }
    Err(format!(
        "the client did not negotiate {}",
        String::from_utf8_lossy(want.alpn())
    ))
}

fn server_base(id: &Identity) -> Result<ServerConfig, TlsError> {
    let verifier = WebPkiClientVerifier::builder_with_provider(roots(id)?, provider())
        .build()
        .map_err(err)?;
    let mut c = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![id.cert.clone()], id.key.clone_key())
        .map_err(err)?;
    // Data-plane dialers only write: tickets they never read would pile up unread, and
    // connections are long-lived, so resumption buys nothing.
    c.send_tls13_tickets = 0;
    Ok(c)
}

fn https_server(id: &Identity) -> Result<ServerConfig, TlsError> {
    let mut c = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(err)?
        .with_no_client_auth()
        .with_single_cert(vec![id.cert.clone()], id.key.clone_key())
        .map_err(err)?;
    c.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(c)
}

fn client_base(id: &Identity) -> Result<ClientConfig, TlsError> {
    let mut c = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(err)?
        .with_root_certificates(roots(id)?)
        .with_client_auth_cert(vec![id.cert.clone()], id.key.clone_key())
        .map_err(err)?;
    c.resumption = rustls::client::Resumption::disabled();
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::ClusterCa;

    #[test]
    fn each_protocol_has_its_own_alpn() {
        let ca = ClusterCa::generate("t").unwrap();
        let tls = ClusterTls::new(&ca.issue("x").unwrap()).unwrap();
        let ps = [Protocol::Quic, Protocol::Data, Protocol::Control];
        for p in ps {
            assert_eq!(tls.server(p).alpn_protocols, vec![p.alpn().to_vec()]);
            assert_eq!(tls.client(p).alpn_protocols, vec![p.alpn().to_vec()]);
            for q in ps {
                assert_eq!(check_alpn(Some(q.alpn()), p).is_ok(), p == q);
            }
            assert!(check_alpn(None, p).is_err());
        }
    }
}
