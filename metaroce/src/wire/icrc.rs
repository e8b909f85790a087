//! Invariant CRC (ICRC) of RoCEv2 packets. IBA Vol. 1 §7.8.1 (ICRC); RoCEv2 Annex A17
//! (which fields of the IP/UDP headers are covered).
//!
//! The ICRC is the standard CRC-32 (IEEE 802.3: reflected polynomial 0xEDB88320, initial
//! value 0xFFFFFFFF, final XOR 0xFFFFFFFF, as `crc32fast`) over:
//!
//! 1. 8 bytes of 0xFF (stand-in for the InfiniBand LRH);
//! 2. the IP header (IPv4 20 B without options, or IPv6 40 B) with its variant fields set to
//!    all ones: IPv4 TOS, TTL and header checksum; IPv6 traffic class, flow label and hop limit;
//! 3. the UDP header (8 B) with the checksum set to 0xFFFF;
//! 4. the BTH (12 B) with byte 4 (FECN, BECN, reserved) set to 0xFF;
//! 5. the rest of the UDP payload up to, not including, the 4 ICRC bytes (extension headers,
//!    payload and pad).
//!
//! The 32-bit result is carried **little-endian** in the last 4 bytes of the UDP payload.
//!
//! In UDP-socket mode metaroce cannot see or choose the real IP header, so both ends compute
//! the ICRC over [`IpHeader::synthesized`] (IPv4: ID 0, DF, TTL 64; the real addresses and
//! ports). Nothing here allocates.

use core::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::cursor::Writer;
use super::{Error, BTH_LEN, ICRC_LEN};

/// Size of an IPv4 header without options (20 bytes), RFC 791.
pub const IPV4_HEADER_LEN: usize = 20;
/// Size of the fixed IPv6 header (40 bytes), RFC 8200.
pub const IPV6_HEADER_LEN: usize = 40;
/// Size of the UDP header (8 bytes), RFC 768.
pub const UDP_HEADER_LEN: usize = 8;
/// IP protocol / next-header number of UDP (17).
pub const IPPROTO_UDP: u8 = 17;
/// IPv4 flags/fragment-offset value with only DF (don't fragment) set (0x4000).
pub const IPV4_FLAG_DF: u16 = 0x4000;
/// TTL / hop limit of a synthesized header (64). Masked in the ICRC, so only cosmetic.
pub const SYNTH_TTL: u8 = 64;

/// The network-layer facts the ICRC covers, described by the fields that are not masked
/// (plus the masked ones, for [`IpHeader::to_bytes`]). RoCEv2 Annex A17; RFC 791 / RFC 8200.
///
/// Lengths (IPv4 total length, IPv6 payload length), protocol 17 and, for IPv4, version 4 /
/// IHL 5 are derived and not stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpHeader {
    /// IPv4 header, 20 bytes, no options.
    V4 {
        /// Source address (covered).
        src: Ipv4Addr,
        /// Destination address (covered).
        dst: Ipv4Addr,
        /// Identification, 16 bits (covered).
        id: u16,
        /// Flags (3 bits) and fragment offset (13 bits), 16 bits (covered); e.g. 0x4000 = DF.
        flags_frag: u16,
        /// Time to live, 8 bits (masked).
        ttl: u8,
        /// Type of service (DSCP 6 bits | ECN 2 bits), 8 bits (masked).
        tos: u8,
    },
    /// IPv6 fixed header, 40 bytes, no extension headers.
    V6 {
        /// Source address (covered).
        src: Ipv6Addr,
        /// Destination address (covered).
        dst: Ipv6Addr,
        /// Traffic class (DSCP | ECN), 8 bits (masked).
        traffic_class: u8,
        /// Flow label, 20 bits (low bits of the `u32`; masked).
        flow_label: u32,
        /// Hop limit, 8 bits (masked).
        hop_limit: u8,
    },
}

impl IpHeader {
    /// The header metaroce synthesizes for UDP-socket transport and pcap output: IPv4 ID 0,
    /// DF set, TTL 64, TOS 0 (masked anyway); IPv6 traffic class 0, flow label 0, hop limit 64.
    ///
    /// IPv4-mapped IPv6 addresses (`::ffff:a.b.c.d`, as a dual-stack socket reports IPv4
    /// peers) are converted to IPv4 first, because such a datagram travels as IPv4 and the
    /// peer sees plain IPv4 addresses.
    ///
    /// Errors: [`Error::BadField`]`("IpHeader: mixed address families")` when one address is
    /// IPv4 and the other a non-mapped IPv6 address.
    pub fn synthesized(src: IpAddr, dst: IpAddr) -> Result<IpHeader, Error> {
        match (canonical(src), canonical(dst)) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => Ok(IpHeader::V4 {
                src,
                dst,
                id: 0,
                flags_frag: IPV4_FLAG_DF,
                ttl: SYNTH_TTL,
                tos: 0,
            }),
            (IpAddr::V6(src), IpAddr::V6(dst)) => Ok(IpHeader::V6 {
                src,
                dst,
                traffic_class: 0,
                flow_label: 0,
                hop_limit: SYNTH_TTL,
            }),
            _ => Err(Error::BadField("IpHeader: mixed address families")),
        }
    }

    /// Size of the serialized header in bytes: 20 (IPv4) or 40 (IPv6).
    pub fn header_len(&self) -> usize {
        match self {
            IpHeader::V4 { .. } => IPV4_HEADER_LEN,
            IpHeader::V6 { .. } => IPV6_HEADER_LEN,
        }
    }

    /// Source address.
    pub fn src(&self) -> IpAddr {
        match *self {
            IpHeader::V4 { src, .. } => IpAddr::V4(src),
            IpHeader::V6 { src, .. } => IpAddr::V6(src),
        }
    }

    /// Destination address.
    pub fn dst(&self) -> IpAddr {
        match *self {
            IpHeader::V4 { dst, .. } => IpAddr::V4(dst),
            IpHeader::V6 { dst, .. } => IpAddr::V6(dst),
        }
    }

    /// Serialize the real IP header bytes (20 or 40) for a UDP datagram whose UDP length
    /// field is `udp_len` (8-byte UDP header + UDP payload), with a correct IPv4 header
    /// checksum (RFC 791) and protocol / next header 17. Returns the bytes written.
    ///
    /// Errors: [`Error::BufferTooSmall`] if `out` is too short; [`Error::BadLength`] if
    /// `udp_len` < 8 or the IPv4 total length (20 + `udp_len`) exceeds 65535.
    pub fn to_bytes(&self, udp_len: u16, out: &mut [u8]) -> Result<usize, Error> {
        if usize::from(udp_len) < UDP_HEADER_LEN {
            return Err(Error::BadLength);
        }
        match *self {
            IpHeader::V4 { .. } => {
                let total = u16::try_from(IPV4_HEADER_LEN + usize::from(udp_len))
                    .map_err(|_| Error::BadLength)?;
                let mut w = Writer::with_len(out, IPV4_HEADER_LEN)?;
                w.bytes(&self.v4_bytes(total))?;
                Ok(IPV4_HEADER_LEN)
            }
            IpHeader::V6 { .. } => {
                let mut w = Writer::with_len(out, IPV6_HEADER_LEN)?;
                w.bytes(&self.v6_bytes(udp_len))?;
                Ok(IPV6_HEADER_LEN)
            }
        }
    }

    /// IPv4 header with checksum for total length `total`; zeros if this is IPv6.
    fn v4_bytes(&self, total: u16) -> [u8; IPV4_HEADER_LEN] {
        let mut h = [0u8; IPV4_HEADER_LEN];
        if let IpHeader::V4 {
            src,
            dst,
            id,
            flags_frag,
            ttl,
            tos,
        } = *self
        {
            let [t0, t1] = total.to_be_bytes();
            let [i0, i1] = id.to_be_bytes();
            let [f0, f1] = flags_frag.to_be_bytes();
            let [s0, s1, s2, s3] = src.octets();
            let [d0, d1, d2, d3] = dst.octets();
            h = [
                0x45,
                tos,
                t0,
                t1,
                i0,
                i1,
                f0,
                f1,
                ttl,
                IPPROTO_UDP,
                0,
                0,
                s0,
                s1,
                s2,
                s3,
                d0,
                d1,
                d2,
                d3,
            ];
            let [c0, c1] = ipv4_checksum(&h).to_be_bytes();
            h[10] = c0;
            h[11] = c1;
        }
        h
    }

    /// IPv6 header for payload length `payload_len`; zeros if this is IPv4.
    fn v6_bytes(&self, payload_len: u16) -> [u8; IPV6_HEADER_LEN] {
        let mut h = [0u8; IPV6_HEADER_LEN];
        if let IpHeader::V6 {
            src,
            dst,
            traffic_class,
            flow_label,
            hop_limit,
        } = *self
        {
            let first =
                (6u32 << 28) | (u32::from(traffic_class) << 20) | (flow_label & 0x000F_FFFF);
            let [p0, p1] = payload_len.to_be_bytes();
            let (s, d) = (src.octets(), dst.octets());
            let fields = first
                .to_be_bytes()
                .into_iter()
                .chain([p0, p1, IPPROTO_UDP, hop_limit])
                .chain(s)
                .chain(d);
            for (slot, v) in h.iter_mut().zip(fields) {
                *slot = v;
            }
        }
        h
    }
}

/// `a`, with an IPv4-mapped IPv6 address (`::ffff:a.b.c.d`, what a dual-stack socket
/// reports for an IPv4 peer) as the IPv4 address it maps.
pub(crate) fn canonical(a: IpAddr) -> IpAddr {
    match a {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

/// RFC 791 header checksum of a 20-byte header whose checksum field is zero.
fn ipv4_checksum(h: &[u8; IPV4_HEADER_LEN]) -> u16 {
    let mut sum: u32 = 0;
    for pair in h.chunks_exact(2) {
        let mut word = [0u8; 2];
        for (d, s) in word.iter_mut().zip(pair) {
            *d = *s;
        }
        sum += u32::from(u16::from_be_bytes(word));
    }
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    !(sum as u16)
}

fn mask_v4(h: &mut [u8; IPV4_HEADER_LEN]) {
    h[1] = 0xFF; // TOS
    h[8] = 0xFF; // TTL
    h[10] = 0xFF; // header checksum
    h[11] = 0xFF;
}

fn mask_v6(h: &mut [u8; IPV6_HEADER_LEN]) {
    // Version nibble stays; traffic class and flow label become all ones.
    h[0] |= 0x0F;
    h[1] = 0xFF;
    h[2] = 0xFF;
    h[3] = 0xFF;
    h[7] = 0xFF; // hop limit
}

/// The 8-byte UDP header (RFC 768) for a UDP payload of `udp_payload_len` bytes:
/// source port, destination port, length = 8 + `udp_payload_len`, checksum 0 (as RoCEv2
/// senders transmit it). Errors: [`Error::BadLength`] if the length exceeds 65535.
pub fn udp_header(sport: u16, dport: u16, udp_payload_len: usize) -> Result<[u8; 8], Error> {
    let len = UDP_HEADER_LEN
        .checked_add(udp_payload_len)
        .and_then(|l| u16::try_from(l).ok())
        .ok_or(Error::BadLength)?;
    let [s0, s1] = sport.to_be_bytes();
    let [d0, d1] = dport.to_be_bytes();
    let [l0, l1] = len.to_be_bytes();
    Ok([s0, s1, d0, d1, l0, l1, 0, 0])
}

/// Feed the masked BTH and the rest of the UDP payload (without ICRC) into `h`.
fn hash_transport(h: &mut crc32fast::Hasher, udp_payload_wo_icrc: &[u8]) {
    let split = udp_payload_wo_icrc.len().min(BTH_LEN);
    let (bth, rest) = udp_payload_wo_icrc.split_at(split);
    let mut masked = [0u8; BTH_LEN];
    for (d, s) in masked.iter_mut().zip(bth) {
        *d = *s;
    }
    if let Some(b4) = masked.get_mut(4) {
        *b4 = 0xFF;
    }
    h.update(masked.get(..split).unwrap_or(&[]));
    h.update(rest);
}

const LRH_STANDIN: [u8; 8] = [0xFF; 8];

/// A fresh CRC-32 hasher: a copy of one made once per process. `crc32fast::Hasher::new`
/// detects the CPU's features (PCLMULQDQ) on every call, about 40 instructions, twice per
/// packet (issue #13); the copy carries the detected implementation.
#[inline]
fn hasher() -> crc32fast::Hasher {
    static TEMPLATE: std::sync::OnceLock<crc32fast::Hasher> = std::sync::OnceLock::new();
    TEMPLATE.get_or_init(crc32fast::Hasher::new).clone()
}

/// ICRC over masked IP header + masked UDP header (`sport`, `dport`, length = 8 +
/// `udp_payload_wo_icrc.len()` + 4) + masked BTH + the rest, where `udp_payload_wo_icrc` is
/// the UDP payload **without** its trailing 4 ICRC bytes. Returns the CRC value; it goes on
/// the wire as `value.to_le_bytes()`. IBA Vol. 1 §7.8.1, RoCEv2 Annex A17.
///
/// Length fields wrap modulo 2^16 if the payload is impossibly long for UDP; [`stamp`] and
/// [`verify`] reject such lengths instead.
pub fn compute(ip: &IpHeader, sport: u16, dport: u16, udp_payload_wo_icrc: &[u8]) -> u32 {
    let udp_len = (UDP_HEADER_LEN + ICRC_LEN).wrapping_add(udp_payload_wo_icrc.len()) as u16;
    let split = udp_payload_wo_icrc.len().min(BTH_LEN);
    let (bth, rest) = udp_payload_wo_icrc.split_at(split);
    let mut buf = [0u8; ICRC_BLOCK];
    let n = masked_prefix(&mut buf, ip, sport, dport, udp_len, bth);
    let mut h = hasher();
    if let Some(tail) = buf.get_mut(n..n + rest.len()) {
        tail.copy_from_slice(rest);
        h.update(&buf[..n + rest.len()]);
    } else {
        h.update(&buf[..n]);
        h.update(rest);
    }
    h.finalize()
}

/// [`compute`] for a packet whose bytes lie in three places (gather send,
/// [`crate::Lent`]): `head` (BTH and extension headers, at least the BTH), then
/// `payload_len` bytes that `payload` feeds into the hasher it is given (in order, all of
/// them), then `tail` (pad and trailer, **without** the ICRC). The same value as
/// [`compute`] over `head ++ payload ++ tail`.
pub(crate) fn compute_parts(
    ip: &IpHeader,
    sport: u16,
    dport: u16,
    head: &[u8],
    payload_len: usize,
    payload: impl FnOnce(&mut crc32fast::Hasher),
    tail: &[u8],
) -> u32 {
    let total = head.len() + payload_len + tail.len();
    let udp_len = (UDP_HEADER_LEN + ICRC_LEN).wrapping_add(total) as u16;
    let split = head.len().min(BTH_LEN);
    let (bth, rest) = head.split_at(split);
    let mut buf = [0u8; ICRC_BLOCK];
    let n = masked_prefix(&mut buf, ip, sport, dport, udp_len, bth);
    let mut h = hasher();
    if let Some(t) = buf.get_mut(n..n + rest.len()) {
        t.copy_from_slice(rest);
        h.update(&buf[..n + rest.len()]);
    } else {
        h.update(&buf[..n]);
        h.update(rest);
    }
    payload(&mut h);
    h.update(tail);
    h.finalize()
}

/// The masked pseudo-header block [`compute`] starts from: the LRH stand-in, the masked IP
/// header written directly in its masked form (no IPv4 checksum to compute, it is masked),
/// the masked UDP header and the masked `bth` (up to 12 bytes), written at the start of
/// `buf`; returns how many bytes of the block that is. One contiguous block, hashed in as
/// few `update` calls as possible (issue #13: the per-call overhead of crc32fast dominated
/// short packets). The caller owns the block, so it is not copied on return.
#[inline(always)]
fn masked_prefix(
    buf: &mut [u8; ICRC_BLOCK],
    ip: &IpHeader,
    sport: u16,
    dport: u16,
    udp_len: u16,
    bth: &[u8],
) -> usize {
    let [s0, s1] = sport.to_be_bytes();
    let [d0, d1] = dport.to_be_bytes();
    let [l0, l1] = udp_len.to_be_bytes();
    buf[..8].copy_from_slice(&LRH_STANDIN);
    let mut n = 8;
    match *ip {
        IpHeader::V4 {
            src,
            dst,
            id,
            flags_frag,
            ..
        } => {
            let [t0, t1] = udp_len.wrapping_add(IPV4_HEADER_LEN as u16).to_be_bytes();
            let [i0, i1] = id.to_be_bytes();
            let [f0, f1] = flags_frag.to_be_bytes();
            let fixed = [
                0x45,
                0xFF,
                t0,
                t1,
                i0,
                i1,
                f0,
                f1,
                0xFF,
                IPPROTO_UDP,
                0xFF,
                0xFF,
            ];
            buf[n..n + 12].copy_from_slice(&fixed);
            buf[n + 12..n + 16].copy_from_slice(&src.octets());
            buf[n + 16..n + 20].copy_from_slice(&dst.octets());
            n += IPV4_HEADER_LEN;
        }
        IpHeader::V6 { src, dst, .. } => {
            let fixed = [0x6F, 0xFF, 0xFF, 0xFF, l0, l1, IPPROTO_UDP, 0xFF];
            buf[n..n + 8].copy_from_slice(&fixed);
            buf[n + 8..n + 24].copy_from_slice(&src.octets());
            buf[n + 24..n + 40].copy_from_slice(&dst.octets());
            n += IPV6_HEADER_LEN;
        }
    }
    buf[n..n + 8].copy_from_slice(&[s0, s1, d0, d1, l0, l1, 0xFF, 0xFF]);
    n += UDP_HEADER_LEN;
    let split = bth.len().min(BTH_LEN);
    let bth = &bth[..split];
    buf[n..n + split].copy_from_slice(bth);
    if split > 4 {
        buf[n + 4] = 0xFF;
    }
    n += split;
    n
}

/// Stack block of [`compute`]: the longest prefix (8 + 40 + 8 + 12 = 68 bytes) plus short
/// packets' rest.
const ICRC_BLOCK: usize = 256;

/// Same as [`compute`], from raw header bytes as captured: a 20-byte IPv4 header (version 4,
/// IHL 5) or a 40-byte IPv6 header, and the 8-byte UDP header. The headers are used as given
/// (length fields are not cross-checked against the payload).
///
/// Errors: [`Error::BadLength`] for other header sizes; [`Error::BadField`] for an IP
/// version other than 4/6 or IPv4 options (IHL ≠ 5).
pub fn compute_raw(
    ip_header: &[u8],
    udp_header: &[u8],
    udp_payload_wo_icrc: &[u8],
) -> Result<u32, Error> {
    let udp = <[u8; UDP_HEADER_LEN]>::try_from(udp_header).map_err(|_| Error::BadLength)?;
    let version = ip_header.first().map(|b| b >> 4);
    let mut buf = [0u8; IPV6_HEADER_LEN];
    let n = match version {
        Some(4) => {
            let mut h =
                <[u8; IPV4_HEADER_LEN]>::try_from(ip_header).map_err(|_| Error::BadLength)?;
            if h[0] & 0x0F != 5 {
                return Err(Error::BadField("IPv4 header with options (IHL != 5)"));
            }
            mask_v4(&mut h);
            for (d, s) in buf.iter_mut().zip(h) {
                *d = s;
            }
            IPV4_HEADER_LEN
        }
        Some(6) => {
            let mut h =
                <[u8; IPV6_HEADER_LEN]>::try_from(ip_header).map_err(|_| Error::BadLength)?;
            mask_v6(&mut h);
            buf = h;
            IPV6_HEADER_LEN
        }
        Some(_) => return Err(Error::BadField("IP version")),
        None => return Err(Error::BadLength),
    };
    let mut udp_masked = udp;
    udp_masked[6] = 0xFF;
    udp_masked[7] = 0xFF;
    let mut h = crc32fast::Hasher::new();
    h.update(&LRH_STANDIN);
    h.update(buf.get(..n).unwrap_or(&[]));
    h.update(&udp_masked);
    hash_transport(&mut h, udp_payload_wo_icrc);
    Ok(h.finalize())
}

/// Split a UDP payload into (everything before the ICRC, the ICRC bytes), after checking it
/// holds at least a BTH and an ICRC (16 bytes) and fits in a UDP datagram over `ip`.
fn split_icrc(ip: Option<&IpHeader>, udp_payload_len: usize) -> Result<usize, Error> {
    let min = BTH_LEN + ICRC_LEN;
    if udp_payload_len < min {
        return Err(Error::Truncated {
            needed: min,
            got: udp_payload_len,
        });
    }
    let ip_len = ip.map_or(0, |h| match h {
        IpHeader::V4 { .. } => IPV4_HEADER_LEN,
        IpHeader::V6 { .. } => 0,
    });
    if ip_len + UDP_HEADER_LEN + udp_payload_len > usize::from(u16::MAX) {
        return Err(Error::BadLength);
    }
    Ok(udp_payload_len - ICRC_LEN)
}

/// Compute the ICRC of `udp_payload` (a whole UDP payload, BTH … ICRC) and write it into its
/// last 4 bytes, little-endian (RoCEv2 Annex A17).
///
/// Errors: [`Error::Truncated`] if `udp_payload` is shorter than 16 bytes (BTH + ICRC);
/// [`Error::BadLength`] if the datagram would not fit the 16-bit IP/UDP length fields.
pub fn stamp(ip: &IpHeader, sport: u16, dport: u16, udp_payload: &mut [u8]) -> Result<(), Error> {
    let body = split_icrc(Some(ip), udp_payload.len())?;
    let (head, tail) = udp_payload.split_at_mut(body);
    let crc = compute(ip, sport, dport, head);
    for (d, s) in tail.iter_mut().zip(crc.to_le_bytes()) {
        *d = s;
    }
    Ok(())
}

/// Check the last 4 bytes of `udp_payload` against the ICRC computed over the rest.
///
/// Errors: [`Error::BadIcrc`] on mismatch (`expected` = computed value, `found` = the
/// received bytes read little-endian); [`Error::Truncated`] / [`Error::BadLength`] as for
/// [`stamp`].
pub fn verify(ip: &IpHeader, sport: u16, dport: u16, udp_payload: &[u8]) -> Result<(), Error> {
    let body = split_icrc(Some(ip), udp_payload.len())?;
    let (head, tail) = udp_payload.split_at(body);
    check(compute(ip, sport, dport, head), tail)
}

/// [`verify`] from raw captured header bytes (see [`compute_raw`]).
pub fn verify_raw(ip_header: &[u8], udp_header: &[u8], udp_payload: &[u8]) -> Result<(), Error> {
    let body = split_icrc(None, udp_payload.len())?;
    let (head, tail) = udp_payload.split_at(body);
    check(compute_raw(ip_header, udp_header, head)?, tail)
}

fn check(expected: u32, tail: &[u8]) -> Result<(), Error> {
    let found = u32::from_le_bytes(<[u8; ICRC_LEN]>::try_from(tail).map_err(|_| Error::BadLength)?);
    if found == expected {
        Ok(())
    } else {
        Err(Error::BadIcrc { expected, found })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-block [`compute`] agrees with [`compute_raw`] (which masks the real header
    /// bytes [`IpHeader::to_bytes`] writes) for both address families, all payload sizes
    /// around the block boundary and payloads shorter than a BTH.
    #[test]
    fn compute_matches_raw_headers() {
        let v4 = IpHeader::V4 {
            src: Ipv4Addr::new(10, 1, 2, 3),
            dst: Ipv4Addr::new(192, 168, 7, 9),
            id: 0x1234,
            flags_frag: IPV4_FLAG_DF,
            ttl: 3,
            tos: 0x2e,
        };
        let v6 = IpHeader::V6 {
            src: "fd00::1:2".parse().unwrap(),
            dst: "fe80::99".parse().unwrap(),
            traffic_class: 0xb8,
            flow_label: 0xabcde,
            hop_limit: 5,
        };
        let data: Vec<u8> = (0..1200u32).map(|i| (i * 37 + 11) as u8).collect();
        for ip in [v4, v6] {
            for len in (0..40).chain(150..260).chain([1000, 1200]) {
                let body = &data[..len];
                let udp_len = (UDP_HEADER_LEN + len + ICRC_LEN) as u16;
                let mut iph = [0u8; IPV6_HEADER_LEN];
                let n = ip.to_bytes(udp_len, &mut iph).unwrap();
                let [l0, l1] = udp_len.to_be_bytes();
                let udp = [0xC0, 0x01, 0x12, 0xB7, l0, l1, 0x5a, 0x5a];
                assert_eq!(
                    compute(&ip, 0xC001, 4791, body),
                    compute_raw(&iph[..n], &udp, body).unwrap(),
                    "{ip:?} len {len}"
                );
            }
        }
    }
}
