//! A deterministic, position-addressable byte pattern: byte `i` of stream `seed` is
//! [`byte_at`]`(seed, i)`. Tests and benchmarks fill buffers with it (never zeros: zeros hide
//! unwritten output), and any sub-range can be checked on its own. `kernels/pattern.cu`
//! computes the same bytes on the GPU.

/// SplitMix64's finaliser: a fast 64-bit mixing function.
#[inline]
pub fn mix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The 8-byte pattern word `k` of stream `seed`.
#[inline]
pub fn word_at(seed: u64, k: u64) -> u64 {
    mix64(seed ^ k.wrapping_mul(0xD6E8_FEB8_6659_FD93))
}

/// Byte `i` of stream `seed`.
#[inline]
pub fn byte_at(seed: u64, i: u64) -> u8 {
    (word_at(seed, i / 8) >> (8 * (i % 8))) as u8
}

/// Fills `out` with bytes `first..first+out.len()` of stream `seed`.
pub fn fill(out: &mut [u8], first: u64, seed: u64) {
    let mut i = first;
    let mut rest = out;
    // Unaligned head, byte by byte, until the pattern index is word-aligned.
    while !i.is_multiple_of(8) && !rest.is_empty() {
        rest[0] = byte_at(seed, i);
        rest = &mut rest[1..];
        i = i.wrapping_add(1);
    }
    let mut words = rest.chunks_exact_mut(8);
    for chunk in &mut words {
        chunk.copy_from_slice(&word_at(seed, i / 8).to_le_bytes());
        i = i.wrapping_add(8);
    }
    for b in words.into_remainder() {
        *b = byte_at(seed, i);
        i = i.wrapping_add(1);
    }
}

/// Where `data` first differs from bytes `first..` of stream `seed`.
pub fn first_deviation(data: &[u8], first: u64, seed: u64) -> Option<usize> {
    const BLOCK: usize = 64 * 1024;
    let mut expect = vec![0u8; BLOCK.min(data.len())];
    for (n, chunk) in data.chunks(BLOCK).enumerate() {
        let e = &mut expect[..chunk.len()];
        fill(e, first.wrapping_add((n * BLOCK) as u64), seed);
        if let Some(i) = first_mismatch(chunk, e) {
            return Some(n * BLOCK + i);
        }
    }
    None
}

/// The first index where `a` and `b` differ (over their common length).
pub fn first_mismatch(a: &[u8], b: &[u8]) -> Option<usize> {
    const BLOCK: usize = 4096;
    let n = a.len().min(b.len());
    // Compare in blocks (fast slice equality), then locate the byte inside the bad block.
    let mut off = 0;
    while off < n {
        let end = (off + BLOCK).min(n);
        if a[off..end] != b[off..end] {
            return (off..end).find(|&i| a[i] != b[i]);
        }
        off = end;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn pattern_is_not_trivial() {
        let mut v = vec![0u8; 4096];
        fill(&mut v, 0, 1);
        let zeros = v.iter().filter(|&&b| b == 0).count();
        assert!(zeros < 64, "{zeros} zero bytes in 4 KiB of pattern");
        let mut w = vec![0u8; 4096];
        fill(&mut w, 0, 2);
        assert_ne!(v, w);
    }

    proptest! {
        #[test]
        fn any_subrange_matches_byte_at(first in 0u64..1_000_000, len in 0usize..300, seed: u64) {
            let mut v = vec![0u8; len];
            fill(&mut v, first, seed);
            for (i, b) in v.iter().enumerate() {
                prop_assert_eq!(*b, byte_at(seed, first + i as u64));
            }
            prop_assert_eq!(first_deviation(&v, first, seed), None);
            if len > 0 {
                let k = len / 2;
                v[k] ^= 0x5a;
                prop_assert_eq!(first_deviation(&v, first, seed), Some(k));
            }
        }
    }
}
