//! The HELLO challenge–response: both sides prove they hold the pre-shared key by an
//! HMAC-SHA-256 over both sides' fresh nonces, each under its own label, so the key never
//! crosses the wire and no proof can be replayed on another connection or reflected back.

use crate::wire::NONCE_LEN;
use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

const SERVER_LABEL: &[u8] = b"gpuio-remoteio server proof v1";
const CLIENT_LABEL: &[u8] = b"gpuio-remoteio client proof v1";

/// What a key may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Reads only.
    ReadOnly,
    /// Reads and writes (where the export allows writes too).
    ReadWrite,
}

/// A pre-shared key: its public name, its secret, and its role.
#[derive(Clone)]
pub struct Key {
    /// The name a client sends in HELLO.
    pub id: String,
    /// The secret (at least 16 bytes).
    pub secret: Vec<u8>,
    /// What holders of the key may do.
    pub role: Role,
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Key")
            .field("id", &self.id)
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

/// Fresh random bytes from the operating system.
pub fn nonce() -> std::io::Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(n)
}

/// The MAC over `label`, `first`, `second` (`None` only if the key were refused, which HMAC
/// never does: it takes keys of any length).
fn mac(secret: &[u8], label: &[u8], first: &[u8], second: &[u8]) -> Option<HmacSha256> {
    let mut m = <HmacSha256 as Mac>::new_from_slice(secret).ok()?;
    m.update(label);
    m.update(first);
    m.update(second);
    Some(m)
}

/// The server's proof for a handshake.
pub fn server_proof(
    secret: &[u8],
    client_nonce: &[u8; NONCE_LEN],
    server_nonce: &[u8; NONCE_LEN],
) -> Option<[u8; NONCE_LEN]> {
    Some(
        mac(secret, SERVER_LABEL, client_nonce, server_nonce)?
            .finalize()
            .into_bytes()
            .into(),
    )
}

/// The client's proof for a handshake.
pub fn client_proof(
    secret: &[u8],
    client_nonce: &[u8; NONCE_LEN],
    server_nonce: &[u8; NONCE_LEN],
) -> Option<[u8; NONCE_LEN]> {
    Some(
        mac(secret, CLIENT_LABEL, server_nonce, client_nonce)?
            .finalize()
            .into_bytes()
            .into(),
    )
}

/// Whether `proof` is the client's proof for these nonces (compared in constant time).
pub fn check_client(
    secret: &[u8],
    client_nonce: &[u8; NONCE_LEN],
    server_nonce: &[u8; NONCE_LEN],
    proof: &[u8; NONCE_LEN],
) -> bool {
    mac(secret, CLIENT_LABEL, server_nonce, client_nonce)
        .is_some_and(|m| m.verify_slice(proof).is_ok())
}

/// Whether `proof` is the server's proof for these nonces (compared in constant time).
pub fn check_server(
    secret: &[u8],
    client_nonce: &[u8; NONCE_LEN],
    server_nonce: &[u8; NONCE_LEN],
    proof: &[u8; NONCE_LEN],
) -> bool {
    mac(secret, SERVER_LABEL, client_nonce, server_nonce)
        .is_some_and(|m| m.verify_slice(proof).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_the_key_both_nonces_and_the_side() {
        let (k, cn, sn) = (b"0123456789abcdef", [1u8; 32], [2u8; 32]);
        let c = client_proof(k, &cn, &sn).unwrap();
        assert!(check_client(k, &cn, &sn, &c));
        assert!(!check_client(b"0123456789abcdeX", &cn, &sn, &c));
        assert!(!check_client(k, &[3; 32], &sn, &c));
        assert!(!check_client(k, &cn, &[3; 32], &c));
        // A client proof is not a server proof (no reflection).
        assert!(!check_server(k, &cn, &sn, &c));
        assert!(check_server(
            k,
            &cn,
            &sn,
            &server_proof(k, &cn, &sn).unwrap()
        ));
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }
}
