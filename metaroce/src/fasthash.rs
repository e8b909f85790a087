//! The hasher of the core's hash maps: a few multiplications per key instead of SipHash.
//!
//! The maps it serves are keyed by small integers (QPNs, operation ids, stream ids, rkeys,
//! nonces) and are looked up on every packet, where SipHash-1-3 cost about 7 % of the
//! per-packet path (issue #13). Each 8-byte word of the key is mixed with a folded 64×64 →
//! 128-bit multiply (the high and low halves XORed, as in foldhash / wyhash), so every key
//! bit reaches the high bits the SwissTable control bytes use and the low bits its index
//! uses.
//!
//! The hasher's state can be keyed ([`FastState::keyed`]): the key is XORed into the
//! initial state, so which keys collide depends on it. Maps whose keys a peer (or an
//! off-path sender of connection requests) chooses — stream ids, operation ids, peer QPNs,
//! connection nonces — must be keyed with a secret: with the fixed default state anyone can
//! compute, offline, tens of thousands of stream ids that fall into one bucket chain and
//! make every lookup a walk of it (a helper measured 8.7 µs per lookup instead of 22 ns
//! over 65,210 such ids). The core keys its tables from the endpoint's secret seed
//! (`EndpointConfig::secret_seed`, so they stay reproducible in tests and the simulator);
//! the layers above use [`FastState::random`]. Like foldhash's seeded mode, this is not a
//! PRF: it stops precomputed collisions, and every such map is also bounded by a
//! configuration limit. The default state (key 0) serves maps keyed by values this side
//! chooses (its own QPNs, rkeys, operation ids). No code depends on iteration order.
//!
//! It is public so that the layers above the core (`metaroce-tokio`'s connection, stream
//! and waiter tables, looked up once per delivered message or completion) use the same
//! hasher under the same rule: small integer keys, tables bounded by a configured limit.
//! Do not use it for maps keyed by unbounded peer-chosen data.

use std::hash::{BuildHasher, Hasher};

/// `HashMap` with [`FastState`].
pub type HashMap<K, V> = std::collections::HashMap<K, V, FastState>;
/// `HashSet` with [`FastState`].
pub type HashSet<T> = std::collections::HashSet<T, FastState>;

const K0: u64 = 0x243f_6a88_85a3_08d3; // π digits: fixed, odd multipliers
const K1: u64 = 0x1319_8a2e_0370_7345;

#[inline(always)]
fn fold(a: u64, b: u64) -> u64 {
    let p = u128::from(a).wrapping_mul(u128::from(b));
    (p as u64) ^ ((p >> 64) as u64)
}

/// Builds [`FastHasher`]s: the key (0 by `Default`) is XORed into their initial state.
#[derive(Clone, Copy, Default)]
pub struct FastState {
    key: u64,
}

impl std::fmt::Debug for FastState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key is a secret.
        f.write_str("FastState(..)")
    }
}

impl FastState {
    /// A state keyed with `key`, which should be secret and random: which keys collide
    /// depends on it (see the module docs).
    pub const fn keyed(key: u64) -> FastState {
        FastState { key }
    }

    /// A state keyed from the standard library's per-process random keys (one `SipHash` of
    /// a counter, no system call after the first on a thread): for tables outside the
    /// deterministic core. Each call gives a different key.
    pub fn random() -> FastState {
        FastState::keyed(std::hash::RandomState::new().hash_one(K0))
    }
}

impl BuildHasher for FastState {
    type Hasher = FastHasher;
    #[inline]
    fn build_hasher(&self) -> FastHasher {
        FastHasher { h: K1 ^ self.key }
    }
}

/// The hasher of [`FastState`].
#[derive(Debug, Clone, Copy)]
pub struct FastHasher {
    h: u64,
}

impl Hasher for FastHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.write_u64(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.write_u64(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 59));
        }
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.write_u64(u64::from(i));
    }
    #[inline]
    fn write_u16(&mut self, i: u16) {
        self.write_u64(u64::from(i));
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.write_u64(u64::from(i));
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.h = fold(self.h ^ i, K0);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.write_u64(i as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        fold(self.h, K1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_small_keys_spread_over_high_and_low_bits() {
        let s = FastState::default();
        let hs: Vec<u64> = (0u32..4096).map(|k| s.hash_one(k)).collect();
        let low: std::collections::HashSet<u64> = hs.iter().map(|h| h & 0xFFF).collect();
        let high: std::collections::HashSet<u64> = hs.iter().map(|h| h >> 57).collect();
        // 4096 keys into 4096 low-bit buckets: a random function fills about 63 %.
        assert!(low.len() > 2300, "low bits poorly spread: {}", low.len());
        assert_eq!(high.len(), 128, "top 7 bits (control bytes) not all used");
        let mut m: HashMap<(u64, u32), u32> = HashMap::default();
        for k in 0..1000u32 {
            m.insert((u64::from(k) << 32, k), k);
        }
        assert!((0..1000u32).all(|k| m[&(u64::from(k) << 32, k)] == k));
    }

    /// Keys that share a bucket chain under one key are spread under another: a set of
    /// stream ids whose hashes agree in their low 12 bits (the bucket index of a table of
    /// 4,096) under the default state mostly do not under a random key.
    #[test]
    fn a_key_changes_which_keys_collide() {
        let fixed = FastState::default();
        let colliding: Vec<u32> = (0u32..2_000_000)
            .filter(|&k| fixed.hash_one(k) & 0xFFF == 0)
            .take(200)
            .collect();
        assert_eq!(colliding.len(), 200);
        for keyed in [FastState::keyed(0x9e37_79b9_7f4a_7c15), FastState::random()] {
            let buckets: std::collections::BTreeSet<u64> = colliding
                .iter()
                .map(|&k| keyed.hash_one(k) & 0xFFF)
                .collect();
            // 200 keys into 4,096 buckets at random: about 195 distinct.
            assert!(
                buckets.len() > 150,
                "still colliding: {} buckets",
                buckets.len()
            );
        }
    }
}
