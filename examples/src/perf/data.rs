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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_seed_dependent() {
        assert_eq!(random_bytes(1, 13), random_bytes(1, 13));
        assert_ne!(random_bytes(1, 16), random_bytes(2, 16));
        assert_eq!(&random_bytes(1, 20)[..13], &random_bytes(1, 13)[..]);
    }
}
