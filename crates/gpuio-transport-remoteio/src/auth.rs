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
    /// The secret (an agent takes it only if it passes [`check_secret`]: at least
    /// [`MIN_SECRET_LEN`] bytes and [`MIN_SECRET_BITS`] bits).
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

/// The shortest secret an agent takes, in bytes.
pub const MIN_SECRET_LEN: usize = 32;

/// The least entropy an agent's secret must show, in bits (by [`secret_strength`]).
pub const MIN_SECRET_BITS: f64 = 128.0;

/// A new secret: 32 bytes from the operating system's generator (256 bits), as 64 hex
/// characters, the form `gpuio agent keygen` writes.
pub fn generate_secret() -> std::io::Result<String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// An upper estimate of the entropy of `secret` in bits: its length times the Shannon entropy
/// of its byte distribution. Random hex of 32 characters scores about 128; a repeated
/// character, a short word or a short phrase scores far less. It cannot see that a long
/// phrase is from a dictionary: it is a floor against the worst secrets, not a proof of a
/// good one (use [`generate_secret`]).
pub fn secret_strength(secret: &[u8]) -> f64 {
    let mut counts = [0usize; 256];
    for &b in secret {
        counts[b as usize] += 1;
    }
    let n = secret.len() as f64;
    let per_byte: f64 = counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / n;
            -p * p.log2()
        })
        .sum();
    per_byte * n
}

/// Whether `secret` is strong enough for an agent to accept: at least [`MIN_SECRET_LEN`]
/// bytes and [`MIN_SECRET_BITS`] by [`secret_strength`]. The error says what to do.
pub fn check_secret(key_id: &str, secret: &[u8]) -> Result<(), String> {
    let bits = secret_strength(secret);
    if secret.len() < MIN_SECRET_LEN || bits < MIN_SECRET_BITS {
        return Err(format!(
            "the secret of key {key_id:?} is too weak ({} bytes, about {bits:.0} bits; at least \
             {MIN_SECRET_LEN} bytes and {MIN_SECRET_BITS:.0} bits are required, since a \
             recorded handshake lets its guesses be tested offline): make one with \
             `gpuio agent keygen`",
            secret.len()
        ));
    }
    Ok(())
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

    #[test]
    fn weak_secrets_are_refused_and_generated_ones_pass() {
        let generated = generate_secret().unwrap();
        assert_eq!(generated.len(), 64);
        assert!(generated.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(generated, generate_secret().unwrap());
        assert!(check_secret("k", generated.as_bytes()).is_ok());
        for weak in [
            &b"correcthorsebatt"[..],                         // 16 characters: too short
            &[b'a'; 64][..],                                  // long, but one symbol
            &b"abababababababababababababababababababab"[..], // two symbols
            &b"multinode test key of 32 bytes!"[..],
        ] {
            let e = check_secret("k", weak).unwrap_err();
            assert!(e.contains("gpuio agent keygen"), "{e}");
        }
    }
}
