//! Seeded pseudo-random test data.

/// SplitMix64 step: a fast generator good enough for test patterns.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Mixes a stream number into a seed, so that different users of one `--seed` draw
/// unrelated sequences.
pub fn derive_seed(seed: u64, stream: u64) -> u64 {
    let mut s = seed ^ stream.wrapping_mul(0xd6e8_feb8_6659_fd93);
    splitmix64(&mut s)
}

/// `len` pseudo-random bytes from `seed`.
pub fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let mut state = seed;
    let mut chunks = v.chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&splitmix64(&mut state).to_le_bytes());
    }
    let rest = chunks.into_remainder();
    let last = splitmix64(&mut state).to_le_bytes();
    rest.copy_from_slice(&last[..rest.len()]);
    v
}

/// Variants of a message pattern: message `i` of a latency test is the window
/// `pattern[i % VARIANTS ..][..size]` of a buffer of `size + VARIANTS` random bytes, so
/// consecutive messages differ and any of them can be checked without storing it.
pub const VARIANTS: u64 = 251;

/// The pattern buffer of a latency test: `size + VARIANTS` random bytes.
pub fn pattern(seed: u64, size: u64) -> Vec<u8> {
    random_bytes(seed, (size + VARIANTS) as usize)
}

/// Offset of message `i` in its pattern buffer.
pub fn window(i: u64) -> u64 {
    i % VARIANTS
}

/// Seed of the pattern the client writes in a write_lat round of data seed `seed`.
pub fn client_pattern_seed(seed: u64) -> u64 {
    derive_seed(seed, 1)
}

/// Seed of the pattern the server writes back in a write_lat round.
pub fn server_pattern_seed(seed: u64) -> u64 {
    derive_seed(seed, 2)
}

/// Initial value of the atomic_lat counter.
pub fn atomic_initial(seed: u64) -> u64 {
    derive_seed(seed, 3)
}

/// The addend of atomic_lat operation `i`: a non-zero 32-bit value.
pub fn atomic_add(seed: u64, i: u64) -> u64 {
    (derive_seed(seed ^ 0xa70d_1c5e_ed00_0000, i) >> 32) | 1
}

/// Calls `f` with consecutive chunks of `random_bytes(seed, len)`, at most `chunk` bytes
/// each (`chunk` is rounded up to a multiple of 8), without building the whole buffer.
pub fn random_chunks<E>(
    seed: u64,
    len: u64,
    chunk: usize,
    mut f: impl FnMut(&[u8]) -> Result<(), E>,
) -> Result<(), E> {
    let chunk = chunk.max(8).next_multiple_of(8);
    let mut state = seed;
    let mut buf = vec![0u8; chunk];
    let mut left = len;
    while left > 0 {
        let n = (left.min(chunk as u64)) as usize;
        for c in buf[..n.next_multiple_of(8)].chunks_exact_mut(8) {
            c.copy_from_slice(&splitmix64(&mut state).to_le_bytes());
        }
        f(&buf[..n])?;
        left -= n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_match_the_whole() {
        for len in [0u64, 1, 7, 8, 9, 100, 4099] {
            let mut v = Vec::new();
            random_chunks::<()>(5, len, 16, |c| {
                v.extend_from_slice(c);
                Ok(())
            })
            .unwrap();
            assert_eq!(v, random_bytes(5, len as usize), "len {len}");
        }
    }

    #[test]
    fn deterministic_and_seed_dependent() {
        assert_eq!(random_bytes(1, 13), random_bytes(1, 13));
        assert_ne!(random_bytes(1, 16), random_bytes(2, 16));
        assert_eq!(&random_bytes(1, 20)[..13], &random_bytes(1, 13)[..]);
    }
}
