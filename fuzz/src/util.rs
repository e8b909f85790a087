//! Helpers shared by the targets: addresses and configurations of the two in-memory
//! endpoints, data patterns (from `metaroce::testing`), GSO splitting and ICRC stamping.

use metaroce::wire;
use metaroce::wire::icrc::{self, IpHeader};
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

/// `len` deterministic bytes for `seed` ([`metaroce::testing::pattern`]).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    metaroce::testing::pattern(seed, len)
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
/// parses, and its ICRC verifies whenever the addresses allow one to be computed (the
/// check of [`metaroce::testing::check_emitted`]).
pub fn check_emitted(pkt: &[u8], local: IpAddr, dest: SocketAddr, sport: u16) {
    metaroce::testing::check_emitted(pkt, local, dest, sport);
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
