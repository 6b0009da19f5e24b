//! Network plumbing below the QUIC transport: the cluster's certificates and TLS configs, and
//! the tuned UDP socket. No protocol logic lives here.
//!
//! Design: docs/transports.md (one trust domain).

pub mod secrets;
pub mod socket;
pub mod tls;

pub use secrets::{init_secrets, ClusterCa, Identity, SecretsError};
