//! The hasher of the core's hash maps: a few multiplications per key instead of SipHash.
//!
//! The maps it serves are keyed by small integers (QPNs, operation ids, stream ids, rkeys,
//! nonces) and are looked up on every packet, where SipHash-1-3 cost about 7 % of the
//! per-packet path (issue #13). Each 8-byte word of the key is mixed with a folded 64×64 →
//! 128-bit multiply (the high and low halves XORed, as in foldhash / wyhash), so every key
//! bit reaches the high bits the SwissTable control bytes use and the low bits its index
//! uses.
//!
//! It is not a keyed PRF: keys the network chooses could be made to collide. Every map
//! whose size the peer can drive is bounded by a configuration limit (outstanding
//! operations, streams, responder state), so a collision attack costs at most a linear probe
//! over a bounded table — the same bound the limits give to every other per-packet cost. The
//! state is fixed (no per-process random seed), so iteration order, like everything else
//! in the core, is the same on every run; no code depends on it.
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

/// Builds [`FastHasher`]s (zero-sized; `Default`).
#[derive(Debug, Clone, Copy, Default)]
pub struct FastState;

impl BuildHasher for FastState {
    type Hasher = FastHasher;
    #[inline]
    fn build_hasher(&self) -> FastHasher {
        FastHasher { h: K1 }
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
        let s = FastState;
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
}
