//! Helpers shared by the targets: addresses and configurations of the two in-memory
//! endpoints, a tiny deterministic RNG, data patterns, GSO splitting and ICRC stamping.

use metaroce::wire::icrc::{self, IpHeader};
use metaroce::wire::{self, Packet};
use metaroce::{EndpointConfig, Transmit};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

/// The RoCEv2 port every endpoint listens on.
pub const LISTEN_PORT: u16 = wire::ROCEV2_UDP_PORT;

/// IP of in-memory endpoint `i` (10.0.0.1, 10.0.0.2, ...).
pub fn ip_of(i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, i as u8 + 1))
}

/// Listening address of in-memory endpoint `i`.
pub fn addr_of(i: usize) -> SocketAddr {
    SocketAddr::new(ip_of(i), LISTEN_PORT)
}

/// The 8 UDP source ports (paths) of endpoint `i`; disjoint between endpoints.
pub fn source_ports(i: usize) -> Vec<u16> {
    (0..8u16).map(|k| 0xC000 + 16 * i as u16 + k).collect()
}

/// Configuration of endpoint `i`: 8 paths, a 1024-byte path MTU and GSO batches of up to
/// 4 packets (as in the core's own two-endpoint tests), RNG seeded from `seed`.
pub fn config(i: usize, seed: u64) -> EndpointConfig {
    let mut c = EndpointConfig::new(addr_of(i), source_ports(i));
    c.seed = seed ^ (0x9E37_79B9_7F4A_7C15u64.wrapping_mul(i as u64 + 1));
    c.transport.pmtu = 1024;
    c.transport.max_gso_segments = 4;
    c
}

/// SplitMix64: small, fast, deterministic; good enough for impairment draws.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x6A09_E667_F3BC_C909)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`0` when `n == 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

/// `len` pseudo-random bytes determined by `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut r = Rng::new(seed);
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        v.extend_from_slice(&r.next_u64().to_le_bytes());
    }
    v.truncate(len);
    v
}

/// The datagrams of a transmit: one, or the GSO segments packed in `buf`.
pub fn segments<'a>(t: &Transmit, buf: &'a [u8]) -> std::slice::Chunks<'a, u8> {
    let size = t.size.min(buf.len());
    let seg = t.segment_size.unwrap_or(size).max(1);
    buf[..size].chunks(seg)
}

/// Recompute the ICRC of `pkt` for a datagram `src` -> `dst` from port `sport` to port
/// `dport`, as a receiver at `dst` checks it. Returns `false` when it cannot (mixed address
/// families, too short).
pub fn restamp(pkt: &mut [u8], src: IpAddr, dst: IpAddr, sport: u16, dport: u16) -> bool {
    match IpHeader::synthesized(src, dst) {
        Ok(ip) => icrc::stamp(&ip, sport, dport, pkt).is_ok(),
        Err(_) => false,
    }
}

/// Check a datagram an endpoint at `local` emitted towards `dest` from port `sport`: it
/// parses, and its ICRC verifies whenever the addresses allow one to be computed.
pub fn check_emitted(pkt: &[u8], local: IpAddr, dest: SocketAddr, sport: u16) {
    if let Err(e) = Packet::parse(pkt) {
        panic!(
            "endpoint {local} emitted an unparsable packet to {dest}: {e}: {:02x?}",
            pkt
        );
    }
    if let Ok(ip) = IpHeader::synthesized(local, dest.ip()) {
        if let Err(e) = icrc::verify(&ip, sport, dest.port(), pkt) {
            panic!("endpoint {local} emitted a packet to {dest} with a bad ICRC: {e}");
        }
    }
}

/// Whether `METAROCE_FUZZ_TRACE` is set: the targets then print a one-line summary of each
/// run to stderr (for looking at what inputs do; never set while fuzzing).
pub fn trace() -> bool {
    static T: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *T.get_or_init(|| std::env::var_os("METAROCE_FUZZ_TRACE").is_some())
}

/// Whether the known core bug `id` is tolerated in this run: `METAROCE_FUZZ_KNOWN_BUGS` is a
/// comma-separated list of ids (see fuzz/README.md, "Known bugs"). Empty by default: every
/// check is strict. Only for keeping a long campaign productive while a fix is pending.
pub fn tolerate(id: &str) -> bool {
    static T: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        std::env::var("METAROCE_FUZZ_KNOWN_BUGS")
            .unwrap_or_default()
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect()
    })
    .iter()
    .any(|x| x == id)
}
