//! Secret randomness and the MACs of connection identity (issue #9).
//!
//! Two sources of randomness feed an endpoint:
//! * the *reproducible* RNG, seeded by [`EndpointConfig::seed`](crate::EndpointConfig::seed):
//!   QPNs and initial PSNs (a test may want them repeatable);
//! * the *secret* RNG, seeded by [`EndpointConfig::secret_seed`](crate::EndpointConfig::secret_seed):
//!   connection nonces, the retry-cookie key, rkeys and region addresses. It is HMAC-SHA256
//!   in counter mode (`block i = HMAC(seed, "metaroce rng" || i)`), so its outputs do not
//!   reveal its state or each other.
//!
//! Connection tokens are derived from the 128-bit identity (client nonce, server nonce):
//! `token_dir = first 8 bytes of HMAC-SHA256(key = client_nonce || server_nonce, "metaroce token " || dir)`,
//! `dir` = `"c2s"` or `"s2c"` (docs/PROTOCOL.md, "Connection identity and tokens").

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::net::{IpAddr, SocketAddr};

type HmacSha256 = Hmac<Sha256>;

fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    // HMAC accepts keys of any length, so `new_from_slice` cannot fail.
    let mut m = match HmacSha256::new_from_slice(key) {
        Ok(m) => m,
        Err(_) => return [0; 32],
    };
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// A deterministic cryptographic RNG (HMAC-SHA256 in counter mode) over a 32-byte seed.
#[derive(Clone)]
pub(crate) struct SecretRng {
    key: [u8; 32],
    counter: u64,
    buf: [u8; 32],
    pos: usize,
}

impl std::fmt::Debug for SecretRng {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretRng(..)")
    }
}

impl SecretRng {
    pub(crate) fn new(seed: [u8; 32]) -> Self {
        Self {
            key: seed,
            counter: 0,
            buf: [0; 32],
            pos: 32,
        }
    }

    /// The secret seed used when the configuration gives none: derived from the
    /// reproducible seed (deterministic, NOT secret; see `EndpointConfig::secret_seed`).
    pub(crate) fn default_seed(seed: u64) -> [u8; 32] {
        hmac(b"metaroce default secret seed", &[&seed.to_be_bytes()])
    }

    /// A secret value derived from the seed for `label`, without drawing from the stream
    /// (`HMAC(seed, "metaroce derive " || label)`): the other outputs do not change.
    pub(crate) fn derive_u64(&self, label: &[u8]) -> u64 {
        let b = hmac(&self.key, &[b"metaroce derive ", label]);
        u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        self.fill(&mut b);
        u64::from_be_bytes(b)
    }

    pub(crate) fn next_u32(&mut self) -> u32 {
        let mut b = [0u8; 4];
        self.fill(&mut b);
        u32::from_be_bytes(b)
    }

    pub(crate) fn fill(&mut self, out: &mut [u8]) {
        for o in out {
            if self.pos == 32 {
                self.buf = hmac(&self.key, &[b"metaroce rng", &self.counter.to_be_bytes()]);
                self.counter = self.counter.wrapping_add(1);
                self.pos = 0;
            }
            *o = self.buf[self.pos];
            self.pos += 1;
        }
    }
}

/// `(token_c2s, token_s2c)` of the connection whose identity is (`client_nonce`,
/// `server_nonce`).
pub(crate) fn tokens(client_nonce: u64, server_nonce: u64) -> (u64, u64) {
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&client_nonce.to_be_bytes());
    key[8..].copy_from_slice(&server_nonce.to_be_bytes());
    let t = |dir: &[u8]| {
        let h = hmac(&key, &[b"metaroce token ", dir]);
        let mut w = [0u8; 8];
        w.copy_from_slice(&h[..8]);
        u64::from_be_bytes(w)
    };
    (t(b"c2s"), t(b"s2c"))
}

/// The 16-byte retry cookie for a Request from `peer` (source IP, listen port) with this
/// client nonce and client QPN, in time bucket `bucket`: HMAC-SHA256 under the endpoint's
/// cookie key, truncated to 128 bits.
pub(crate) fn cookie(
    key: &[u8; 32],
    peer: SocketAddr,
    nonce: u64,
    src_qpn: u32,
    bucket: u64,
) -> [u8; 16] {
    let ip = match peer.ip() {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    };
    let h = hmac(
        key,
        &[
            b"metaroce cookie",
            &ip,
            &peer.port().to_be_bytes(),
            &nonce.to_be_bytes(),
            &src_qpn.to_be_bytes(),
            &bucket.to_be_bytes(),
        ],
    );
    let mut c = [0u8; 16];
    c.copy_from_slice(&h[..16]);
    c
}

/// Constant-time equality of two 64-bit values.
pub(crate) fn ct_eq_u64(a: u64, b: u64) -> bool {
    use subtle::ConstantTimeEq;
    a.ct_eq(&b).into()
}

/// Constant-time equality of two byte strings of the same length.
pub(crate) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.ct_eq(b).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_is_deterministic_and_seed_dependent() {
        let mut a = SecretRng::new([1; 32]);
        let mut b = SecretRng::new([1; 32]);
        let mut c = SecretRng::new([2; 32]);
        let xa: Vec<u64> = (0..10).map(|_| a.next_u64()).collect();
        let xb: Vec<u64> = (0..10).map(|_| b.next_u64()).collect();
        let xc: Vec<u64> = (0..10).map(|_| c.next_u64()).collect();
        assert_eq!(xa, xb);
        assert_ne!(xa, xc);
        assert_eq!(
            xa.iter().collect::<std::collections::HashSet<_>>().len(),
            10
        );
    }

    #[test]
    fn tokens_differ_per_direction_and_identity() {
        let (a, b) = tokens(1, 2);
        assert_ne!(a, b);
        assert_ne!(tokens(1, 3), (a, b));
        assert_ne!(tokens(2, 1), (a, b));
    }

    #[test]
    fn cookie_binds_every_input() {
        let k = [7; 32];
        let p: SocketAddr = "10.0.0.1:4791".parse().unwrap();
        let c = cookie(&k, p, 1, 2, 3);
        assert_ne!(cookie(&k, "10.0.0.2:4791".parse().unwrap(), 1, 2, 3), c);
        assert_ne!(cookie(&k, "10.0.0.1:4792".parse().unwrap(), 1, 2, 3), c);
        assert_ne!(cookie(&k, p, 9, 2, 3), c);
        assert_ne!(cookie(&k, p, 1, 9, 3), c);
        assert_ne!(cookie(&k, p, 1, 2, 4), c);
        assert_ne!(cookie(&[8; 32], p, 1, 2, 3), c);
        assert!(ct_eq(&c, &cookie(&k, p, 1, 2, 3)));
    }
}
