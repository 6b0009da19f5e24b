//! A cluster is one trust domain: a cluster CA signs one certificate per process, and every
//! connection is mutual TLS against that CA.
//!
//! A secrets directory holds `ca.pem` (the CA certificate) and either `ca.key.pem` (the CA key:
//! processes then issue themselves a fresh certificate at start) or, for an operator-run CA that
//! keeps its key elsewhere, `NAME.pem` + `NAME.key.pem` per process. `init_secrets` makes the
//! first kind. Private keys are written with mode 0600.

use std::io::Write;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// The DNS name every cluster certificate carries and every client checks; trust comes from the
/// CA, not from the name.
pub const PEER_SERVER_NAME: &str = "ezero-peer";
pub const CA_CERT_FILE: &str = "ca.pem";
pub const CA_KEY_FILE: &str = "ca.key.pem";

#[derive(Debug, thiserror::Error)]
pub enum SecretsError {
    #[error("{path}: {what}")]
    File { path: PathBuf, what: String },
    #[error("certificate generation failed: {0}")]
    Generate(String),
    #[error(
        "secrets directory {0} has neither {CA_KEY_FILE} nor a certificate and key for this process"
    )]
    NoIdentity(PathBuf),
}

fn gen_err(e: rcgen::Error) -> SecretsError {
    SecretsError::Generate(e.to_string())
}

fn file_err(path: &Path, e: impl std::fmt::Display) -> SecretsError {
    SecretsError::File {
        path: path.to_path_buf(),
        what: e.to_string(),
    }
}

/// The cluster CA, able to issue process certificates.
pub struct ClusterCa {
    cert: CertificateDer<'static>,
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl ClusterCa {
    /// A fresh CA named `name` (shown in logs and certificates only).
    pub fn generate(name: &str) -> Result<Self, SecretsError> {
        let mut p = CertificateParams::new(Vec::<String>::new()).map_err(gen_err)?;
        p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().map_err(gen_err)?;
        let cert = p.self_signed(&key).map_err(gen_err)?;
        Ok(Self {
            cert: cert.der().clone(),
            cert_pem: cert.pem(),
            issuer: Issuer::new(p, key),
        })
    }

    /// Loads `ca.pem` and `ca.key.pem` from `dir` (ours or an operator's CA).
    pub fn load(dir: &Path) -> Result<Self, SecretsError> {
        let (cp, kp) = (dir.join(CA_CERT_FILE), dir.join(CA_KEY_FILE));
        let cert_pem = std::fs::read_to_string(&cp).map_err(|e| file_err(&cp, e))?;
        let key_pem = std::fs::read_to_string(&kp).map_err(|e| file_err(&kp, e))?;
        let key = KeyPair::from_pem(&key_pem).map_err(|e| file_err(&kp, e))?;
        let cert =
            CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|e| file_err(&cp, e))?;
        let issuer = Issuer::from_ca_cert_pem(&cert_pem, key).map_err(|e| file_err(&cp, e))?;
        Ok(Self {
            cert,
            cert_pem,
            issuer,
        })
    }

    /// Writes `ca.pem` and `ca.key.pem` into `dir` (created if missing); refuses to overwrite.
    pub fn save(&self, dir: &Path) -> Result<(), SecretsError> {
        std::fs::create_dir_all(dir).map_err(|e| file_err(dir, e))?;
        write_new(&dir.join(CA_CERT_FILE), self.cert_pem.as_bytes(), 0o644)?;
        write_new(
            &dir.join(CA_KEY_FILE),
            self.issuer.key().serialize_pem().as_bytes(),
            0o600,
        )
    }

    pub fn cert(&self) -> &CertificateDer<'static> {
        &self.cert
    }

    /// A certificate for one process, valid as both TLS client and server within the cluster.
    pub fn issue(&self, name: &str) -> Result<Identity, SecretsError> {
        let mut p = CertificateParams::new(vec![PEER_SERVER_NAME.to_string(), name.to_string()])
            .map_err(gen_err)?;
        p.distinguished_name.push(DnType::CommonName, name);
        p.use_authority_key_identifier_extension = true;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().map_err(gen_err)?;
        let cert = p.signed_by(&key, &self.issuer).map_err(gen_err)?;
        Ok(Identity {
            ca: self.cert.clone(),
            cert: cert.der().clone(),
            key: PrivatePkcs8KeyDer::from(key.serialize_der()).into(),
        })
    }
}

/// What one process presents and trusts: its certificate and key, and the cluster CA.
pub struct Identity {
    pub ca: CertificateDer<'static>,
    pub cert: CertificateDer<'static>,
    pub key: PrivateKeyDer<'static>,
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Self {
            ca: self.ca.clone(),
            cert: self.cert.clone(),
            key: self.key.clone_key(),
        }
    }
}

impl Identity {
    /// This process's identity from a secrets directory: `NAME.pem` + `NAME.key.pem` if the
    /// operator issued them, else a fresh certificate from the CA key in the directory.
    pub fn from_dir(dir: &Path, name: &str) -> Result<Self, SecretsError> {
        let (cp, kp) = (
            dir.join(format!("{name}.pem")),
            dir.join(format!("{name}.key.pem")),
        );
        if cp.exists() && kp.exists() {
            let ca_path = dir.join(CA_CERT_FILE);
            let ca = CertificateDer::from_pem_file(&ca_path).map_err(|e| file_err(&ca_path, e))?;
            let cert = CertificateDer::from_pem_file(&cp).map_err(|e| file_err(&cp, e))?;
            let key = PrivateKeyDer::from_pem_file(&kp).map_err(|e| file_err(&kp, e))?;
            return Ok(Self { ca, cert, key });
        }
        if !dir.join(CA_KEY_FILE).exists() {
            return Err(SecretsError::NoIdentity(dir.to_path_buf()));
        }
        ClusterCa::load(dir)?.issue(name)
    }
}

/// `ezero coordinator --init-secrets DIR`: a fresh cluster CA in `DIR` (which must not already
/// hold one). Hand the directory to every process of the cluster, over a channel you trust.
pub fn init_secrets(dir: &Path) -> Result<ClusterCa, SecretsError> {
    let ca = ClusterCa::generate("elastic-zero cluster CA")?;
    ca.save(dir)?;
    Ok(ca)
}

fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<(), SecretsError> {
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, mode);
    #[cfg(not(unix))]
    let _ = mode;
    let mut f = o.open(path).map_err(|e| file_err(path, e))?;
    f.write_all(bytes).map_err(|e| file_err(path, e))?;
    f.sync_all().map_err(|e| file_err(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_load_and_issue_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let ca = init_secrets(dir.path()).unwrap();
        assert!(init_secrets(dir.path()).is_err(), "must not overwrite a CA");
        let id = Identity::from_dir(dir.path(), "worker-0").unwrap();
        assert_eq!(id.ca, *ca.cert());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let m = std::fs::metadata(dir.path().join(CA_KEY_FILE)).unwrap();
            assert_eq!(m.permissions().mode() & 0o777, 0o600);
        }
        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(
            Identity::from_dir(empty.path(), "x"),
            Err(SecretsError::NoIdentity(_))
        ));
    }
}
