//! Optional TLS for RemoteIO connections (rustls, the ring provider). The agent presents a
//! certificate chain; clients verify it against the CA certificates they trust. The HELLO
//! handshake still authenticates the key inside the encrypted channel.

use crate::{RemoteIoError, Result};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::path::Path;
use std::sync::Arc;

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls_error(what: &str, e: impl std::fmt::Display) -> RemoteIoError {
    RemoteIoError::InvalidArgument(format!("TLS {what}: {e}"))
}

fn certificates(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| tls_error(what, e))?;
    if certs.is_empty() {
        return Err(tls_error(what, "no certificate in the PEM data"));
    }
    Ok(certs)
}

/// The largest certificate or CA file taken, in bytes: system CA bundles are a few hundred KiB.
pub const MAX_CERT_FILE_BYTES: u64 = 4 << 20;

/// The largest private key file taken, in bytes (an 8192-bit RSA key is under 7 KiB of PEM).
pub const MAX_KEY_FILE_BYTES: u64 = 64 << 10;

/// A PEM file, read only if it is a small regular file (a FIFO would hang the reader, a device
/// such as `/dev/zero` fill its memory); private keys only if private to their owner.
fn read(path: &Path, what: &str, kind: &str, cap: u64, private: bool) -> Result<Vec<u8>> {
    crate::files::read_small_file(path, cap, kind, private)
        .map_err(|e| tls_error(what, format!("{}: {e}", path.display())))
}

/// The agent's side: its certificate chain and private key.
#[derive(Clone)]
pub struct TlsServer {
    pub(crate) config: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for TlsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsServer")
    }
}

impl TlsServer {
    /// From PEM data: the certificate chain (leaf first) and its private key.
    pub fn from_pem(cert_chain: &[u8], key: &[u8]) -> Result<Self> {
        let certs = certificates(cert_chain, "certificate chain")?;
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| tls_error("private key", e))?;
        let config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error("versions", e))?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(|e| tls_error("certificate", e))?;
        Ok(Self {
            config: Arc::new(config),
        })
    }

    /// From PEM files: regular files of at most [`MAX_CERT_FILE_BYTES`] and
    /// [`MAX_KEY_FILE_BYTES`], the key readable and writable by its owner only (mode 0600).
    pub fn from_pem_files(cert_chain: &Path, key: &Path) -> Result<Self> {
        Self::from_pem(
            &read(
                cert_chain,
                "certificate chain",
                "TLS certificate files",
                MAX_CERT_FILE_BYTES,
                false,
            )?,
            &read(
                key,
                "private key",
                "TLS private keys",
                MAX_KEY_FILE_BYTES,
                true,
            )?,
        )
    }
}

/// The client's side: the CA certificates it trusts.
#[derive(Clone)]
pub struct TlsClient {
    pub(crate) config: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsClient")
    }
}

impl TlsClient {
    /// Trusting the CA certificates in this PEM data.
    pub fn from_ca_pem(ca: &[u8]) -> Result<Self> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in certificates(ca, "CA certificates")? {
            roots
                .add(cert)
                .map_err(|e| tls_error("CA certificate", e))?;
        }
        let config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error("versions", e))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Self {
            config: Arc::new(config),
        })
    }

    /// Trusting the CA certificates in this PEM file, a regular file of at most
    /// [`MAX_CERT_FILE_BYTES`].
    pub fn from_ca_pem_file(ca: &Path) -> Result<Self> {
        Self::from_ca_pem(&read(
            ca,
            "CA certificates",
            "TLS CA files",
            MAX_CERT_FILE_BYTES,
            false,
        )?)
    }

    /// A client session for the agent named `name` (a DNS name or an IP address, as its
    /// certificate names it).
    pub(crate) fn session(&self, name: &str) -> Result<rustls::ClientConnection> {
        let name = ServerName::try_from(name.to_string())
            .map_err(|e| tls_error("server name", format!("{name:?}: {e}")))?;
        rustls::ClientConnection::new(self.config.clone(), name)
            .map_err(|e| tls_error("session", e))
    }
}
