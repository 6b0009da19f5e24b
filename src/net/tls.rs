//! Mutual-TLS configs for quinn: both sides present a cluster certificate and verify the
//! other's against the cluster CA only (no system roots). TLS 1.3, ring provider.

use std::sync::Arc;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;

use super::secrets::Identity;

/// ALPN protocol id: a peer speaking anything else fails the handshake.
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

/// Server side: requires a client certificate from the cluster CA.
pub fn server_crypto(id: &Identity) -> Result<Arc<QuicServerConfig>, TlsError> {
    let verifier = WebPkiClientVerifier::builder_with_provider(roots(id)?, provider())
        .build()
        .map_err(err)?;
    let mut c = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![id.cert.clone()], id.key.clone_key())
        .map_err(err)?;
    c.alpn_protocols = vec![ALPN.to_vec()];
    Ok(Arc::new(QuicServerConfig::try_from(c).map_err(err)?))
}

/// Client side: verifies the server against the cluster CA and presents our certificate.
pub fn client_crypto(id: &Identity) -> Result<Arc<QuicClientConfig>, TlsError> {
    let mut c = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(err)?
        .with_root_certificates(roots(id)?)
        .with_client_auth_cert(vec![id.cert.clone()], id.key.clone_key())
        .map_err(err)?;
    c.alpn_protocols = vec![ALPN.to_vec()];
    Ok(Arc::new(QuicClientConfig::try_from(c).map_err(err)?))
}
