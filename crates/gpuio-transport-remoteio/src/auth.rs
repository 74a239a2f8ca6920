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

/// The most characters zxcvbn judges: it ignores the rest of a longer input (a bound on its
/// cost), so only a secret's first characters are credited.
const JUDGED_CHARS: usize = 100;

/// The characters of a piece zxcvbn judges on its own. Its count of guesses saturates at
/// 2^64, past which it cannot tell a better split from a worse one; a piece this short never
/// gets there (10^16 guesses at most, its price for 16 characters of no pattern). Its cost
/// grows with the square of the length (every substring, under every leetspeak table): a
/// hundred characters of leetspeak symbols take 0.7 s whole, 0.2 s in pieces.
const PIECE_CHARS: usize = 16;

/// An estimate of the entropy of `secret` in bits: the lower of two upper estimates. One is
/// its length times the Shannon entropy of its byte distribution (a repeated character, a short
/// word or a short phrase scores far less than random bytes). The other is the zxcvbn
/// estimator's, which knows keyboard and alphabet walks, repeats, dictionary words, names,
/// dates and their leetspeak: the sum over the 16-character pieces of the first 100
/// characters, a repeated base counted once. Walks and words that cross a piece's edge are
/// still seen in part on either side.
/// Random hex of 64 characters (what [`generate_secret`] makes) scores about 200. A secret
/// that is not UTF-8 has its printable ASCII runs judged so, its other bytes 8 bits each. Not a proof of a good secret: a phrase no
/// dictionary holds can still be guessable (use [`generate_secret`]).
pub fn secret_strength(secret: &[u8]) -> f64 {
    shannon_bits(secret).min(pattern_bits(secret))
}

/// Length times the Shannon entropy of the byte distribution, in bits.
fn shannon_bits(secret: &[u8]) -> f64 {
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
    // An empty sum is -0.0, which prints as "-0".
    (per_byte * n).max(0.0) + 0.0
}

/// zxcvbn's estimate in bits of the secret's first [`JUDGED_CHARS`] characters. A secret that
/// is not UTF-8 was made by a program, not typed: only its runs of printable ASCII can hold a
/// person's walks and words, and those are judged so; each other byte counts 8 bits (zxcvbn
/// would credit it as a decimal digit, refusing 32 random bytes).
fn pattern_bits(secret: &[u8]) -> f64 {
    let Ok(text) = std::str::from_utf8(secret) else {
        let judged = &secret[..secret.len().min(JUDGED_CHARS)];
        let text_runs = judged
            .split(|b| !(b' '..=b'~').contains(b))
            .filter(|run| !run.is_empty());
        let (run_bits, run_len) = text_runs.fold((0.0, 0), |(bits, len), run| {
            let chars: Vec<char> = run.iter().map(|&b| char::from(b)).collect();
            (bits + text_bits(&chars), len + run.len())
        });
        return run_bits + 8.0 * (judged.len() - run_len) as f64;
    };
    text_bits(&text.chars().take(JUDGED_CHARS).collect::<Vec<_>>())
}

/// zxcvbn's estimate in bits of `chars`: the sum over its [`PIECE_CHARS`]-character pieces,
/// a repeated base counted once (zxcvbn sees repeats too, but not across pieces, nor once the
/// base alone is past its 2^64 ceiling).
fn text_bits(chars: &[char]) -> f64 {
    if chars.is_empty() {
        return 0.0;
    }
    let base = &chars[..period(chars)];
    let repeats = (chars.len() as f64 / base.len() as f64).log2();
    let pieces: f64 = base
        .chunks(PIECE_CHARS)
        .map(|piece| {
            let guesses = zxcvbn::zxcvbn(&piece.iter().collect::<String>(), &[]).guesses();
            (guesses.max(1) as f64).log2()
        })
        .sum();
    repeats + pieces
}

/// The shortest `p` such that `chars` is its first `p` characters repeated (the last time
/// perhaps in part), at least twice; else its length.
fn period(chars: &[char]) -> usize {
    (1..=chars.len() / 2)
        .find(|&p| chars[p..].iter().zip(chars).all(|(a, b)| a == b))
        .unwrap_or(chars.len())
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

    /// Secrets of at least 32 bytes that the byte-distribution floor alone scored past 128
    /// bits (so they were accepted), though a guesser tries their patterns early.
    const PATTERNED: [&str; 12] = [
        "qwertyuiopasdfghjklzxcvbnmQWERTYUIOPASDFGHJKLZXCVBNM1234567890",
        "qwertyuiopasdfghjklzxcvbnm1234567890!@#$%^&*()QWERTYUIOPASDFGHJKLZXCVBNM",
        "1qaz2wsx3edc4rfv5tgb6yhn7ujm8ik,9ol.0p;/",
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
        "zyxwvutsrqponmlkjihgfedcbaZYXWVUTSRQPONMLKJIHGFEDCBA9876543210",
        "correcthorsebatterystaplecorrecthorsebatterystaple",
        "monkey dragon monkey dragon monkey dragon monkey dragon",
        "correcthorsebatterystaplecorrecthorsebatterystaplecorrecthorsebatterystaplecorrecthorse",
        "C0rr3ct-H0rs3-B4tt3ry-St4pl3-2024!",
        "1l0v3myd0gsp0tv3rymuch4ndf0r3v3r!",
        "Th3Qu1ckBr0wnF0xJump5Ov3rTh3L4zyD0g!",
        "4@8({[<3&6|!1|7+%$5_4@8({[<3&6|!1|7+%$5_4@8({[<3&6|!1|7+%$5_4@8({[<3&6|!1|7+%$5_",
    ];

    #[test]
    fn walks_repeats_and_leetspeak_are_refused() {
        for weak in PATTERNED {
            assert!(weak.len() >= MIN_SECRET_LEN, "{weak}");
            assert!(shannon_bits(weak.as_bytes()) >= MIN_SECRET_BITS, "{weak}");
            let e = check_secret("k", weak.as_bytes()).unwrap_err();
            assert!(
                e.contains("too weak") && e.contains("gpuio agent keygen"),
                "{e}"
            );
            // Not text (one byte that is not UTF-8) is no way around it.
            let mut bytes = weak.as_bytes().to_vec();
            bytes.push(0xff);
            assert!(check_secret("k", &bytes).is_err(), "{weak}");
        }
        // Repeated words, with few distinct bytes, the floor refused already.
        assert!(check_secret("k", b"passwordpasswordpasswordpassword").is_err());
        assert!(check_secret("k", b"P@ssw0rd!P@ssw0rd!P@ssw0rd!P@ssw0rd!").is_err());
    }

    #[test]
    fn generated_and_random_secrets_pass() {
        for _ in 0..100 {
            let generated = generate_secret().unwrap();
            let bits = secret_strength(generated.as_bytes());
            assert!(bits >= 160.0, "{generated}: {bits}");
        }
        // 32 random bytes, not text (as `head -c 32 /dev/urandom` makes): 256 bits.
        let mut random = [0u8; 32];
        getrandom::fill(&mut random).unwrap();
        random[0] = 0xff;
        assert!(check_secret("k", &random).is_ok(), "{random:?}");
        // Random base64 of 256 bits.
        assert!(check_secret("k", b"q7Vd2Xh/ZkR0c9pLwE3uYt8Nf1sGmJaB4oHiKxCeW5M=").is_ok());
    }

    #[test]
    fn the_estimate_is_quick_for_long_and_awkward_secrets() {
        // Leetspeak characters, no period: zxcvbn tries every substitution table on them.
        let mut x = 7u32;
        let l33t: String = (0..200)
            .map(|_| {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                b"4@8({[<3&6|!1|7+%$5021"[(x >> 16) as usize % 22] as char
            })
            .collect();
        let long = generate_secret().unwrap().repeat(1 << 14);
        for secret in [l33t.as_bytes(), long.as_bytes(), &[b'a'; 1 << 20][..]] {
            let start = std::time::Instant::now();
            let _ = check_secret("k", secret);
            assert!(
                start.elapsed() < std::time::Duration::from_secs(2),
                "{:?}",
                start.elapsed()
            );
        }
    }

    #[test]
    fn an_empty_secret_scores_zero_bits_not_minus_zero() {
        assert_eq!(secret_strength(b"").to_bits(), 0f64.to_bits());
        let e = check_secret("k", b"").unwrap_err();
        assert!(e.contains("about 0 bits") && !e.contains("-0"), "{e}");
    }
}
