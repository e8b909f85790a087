//! `wire_parse`: every parser on arbitrary bytes never panics; whatever parses survives an
//! emit / re-parse round trip unchanged; `icrc::stamp` and `icrc::verify` agree with each
//! other and with the raw-header variant, and a flipped covered bit is always detected.

use metaroce::wire::icrc::{self, IpHeader};
use metaroce::wire::{
    self, AckEth, Aeth, AtomicAckEth, AtomicEth, Bth, CloseEth, ConnectEth, Deth, Headers, NakEth,
    Opcode, Packet, PathEth, Reth, SendEth, WriteEth, BTH_LEN, ICRC_LEN, PSN_MASK,
};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Parse one fixed-size header from `b`; if it parses, emit it and check the re-parse is
/// equal and consumed exactly `LEN` bytes.
macro_rules! header_roundtrip {
    ($ty:ty, $b:expr) => {{
        if let Ok(h) = <$ty>::parse($b) {
            assert!(
                $b.len() >= <$ty>::LEN,
                "{} parsed from a short buffer",
                stringify!($ty)
            );
            let mut out = [0u8; <$ty>::LEN];
            h.emit(&mut out)
                .unwrap_or_else(|e| panic!("{} emit failed: {e}", stringify!($ty)));
            let again = <$ty>::parse(&out)
                .unwrap_or_else(|e| panic!("{} does not re-parse: {e}", stringify!($ty)));
            assert_eq!(again, h, "{} round trip", stringify!($ty));
            // Emitting into a buffer one byte short must fail, not panic.
            let mut short = [0u8; <$ty>::LEN];
            assert!(h.emit(&mut short[..<$ty>::LEN - 1]).is_err());
        }
    }};
}

fn headers_roundtrip(b: &[u8]) {
    header_roundtrip!(Reth, b);
    header_roundtrip!(Aeth, b);
    header_roundtrip!(AtomicEth, b);
    header_roundtrip!(AtomicAckEth, b);
    header_roundtrip!(Deth, b);
    header_roundtrip!(PathEth, b);
    header_roundtrip!(SendEth, b);
    header_roundtrip!(WriteEth, b);
    header_roundtrip!(AckEth, b);
    header_roundtrip!(NakEth, b);
    header_roundtrip!(ConnectEth, b);
    header_roundtrip!(CloseEth, b);
}

/// A cheap 64-bit digest of the input, to pick addresses, ports and bit positions.
fn digest(data: &[u8]) -> u64 {
    let mut h = 0xCBF2_9CE4_8422_2325u64;
    for &b in data {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

/// The IP headers used for the ICRC checks: a synthesized IPv4 and IPv6 pair and a
/// non-synthesized IPv4 header (other ID / flags / TTL / TOS).
fn ip_headers(h: u64) -> [IpHeader; 3] {
    let a = Ipv4Addr::from((h as u32) | 1);
    let b = Ipv4Addr::from(((h >> 32) as u32) | 2);
    let a6 = Ipv6Addr::from(((h as u128) << 64) | 0xfd00);
    let b6 = Ipv6Addr::from(((h.rotate_left(17) as u128) << 64) | 0xfd01);
    let v4 = IpHeader::synthesized(IpAddr::V4(a), IpAddr::V4(b)).expect("v4 pair");
    let v6 = IpHeader::synthesized(IpAddr::V6(a6), IpAddr::V6(b6)).expect("v6 pair");
    let raw4 = IpHeader::V4 {
        src: b,
        dst: a,
        id: (h >> 8) as u16,
        flags_frag: (h >> 24) as u16 & 0x7FFF,
        ttl: (h >> 40) as u8,
        tos: (h >> 48) as u8,
    };
    [v4, v6, raw4]
}

/// stamp then verify agree; the raw-header variant agrees; a flipped covered bit fails.
fn icrc_checks(pkt: &[u8], h: u64) {
    if pkt.len() < BTH_LEN + ICRC_LEN || pkt.len() > 1400 * 8 {
        return;
    }
    let sport = 0xC000 | (h as u16 & 0x3FFF);
    let dport = wire::ROCEV2_UDP_PORT;
    for ip in ip_headers(h) {
        let mut p = pkt.to_vec();
        icrc::stamp(&ip, sport, dport, &mut p).expect("stamp of a packet that fits UDP");
        icrc::verify(&ip, sport, dport, &p).expect("verify right after stamp");
        assert_eq!(&p[..p.len() - ICRC_LEN], &pkt[..pkt.len() - ICRC_LEN]);
        let value = icrc::compute(&ip, sport, dport, &p[..p.len() - ICRC_LEN]);
        assert_eq!(value.to_le_bytes(), p[p.len() - ICRC_LEN..]);
        // The same ICRC from the serialized headers.
        let udp_len = (icrc::UDP_HEADER_LEN + p.len()) as u16;
        let mut iph = [0u8; icrc::IPV6_HEADER_LEN];
        let n = ip
            .to_bytes(udp_len, &mut iph)
            .expect("IP header serializes");
        let udp = icrc::udp_header(sport, dport, p.len()).expect("UDP header");
        icrc::verify_raw(&iph[..n], &udp, &p).expect("verify_raw agrees with stamp");
        // Any flipped bit outside the masked BTH byte 4 must be caught.
        let pos = (h >> 3) as usize % p.len();
        if pos != 4 {
            p[pos] ^= 1 << (h % 8);
            assert!(
                icrc::verify(&ip, sport, dport, &p).is_err(),
                "ICRC missed a flipped bit at byte {pos}"
            );
        }
        // Port and address changes are covered too.
        let mut q = pkt.to_vec();
        icrc::stamp(&ip, sport, dport, &mut q).expect("stamp");
        assert!(icrc::verify(&ip, sport ^ 1, dport, &q).is_err());
    }
}

fn packet_checks(data: &[u8], p: &Packet<'_>, h: u64) {
    let hdr = wire::header_len(p.bth.opcode).expect("a parsed opcode is known");
    assert!(p.bth.opcode.is_known());
    assert_eq!(hdr, BTH_LEN + p.headers.len(), "header_len vs Headers::len");
    assert!(p.headers.matches_opcode(p.bth.opcode));
    let pad = usize::from(p.bth.pad_count);
    assert_eq!(
        data.len(),
        hdr + p.payload.len() + pad + p.trailer.len() + ICRC_LEN,
        "sizes of a parsed packet"
    );
    if !p.bth.opcode.is_metaroce() {
        assert!(p.trailer.is_empty(), "trailer on a RoCEv2 opcode");
    }
    assert_eq!(p.payload, &data[hdr..hdr + p.payload.len()]);
    assert_eq!(p.icrc, data[data.len() - ICRC_LEN..]);
    if hdr.is_multiple_of(4) && p.trailer.len().is_multiple_of(4) {
        // Length and headers are multiples of 4, so the pad is the canonical one.
        assert_eq!(pad, wire::pad_for(p.payload.len()));
    }

    // Emit what was parsed and parse it again.
    let total = wire::packet_len_with(&p.headers, p.payload.len(), &p.trailer);
    let mut out = vec![0xA5u8; total + 7];
    let n = wire::emit_packet_with(&p.bth, &p.headers, p.payload, &p.trailer, &mut out)
        .unwrap_or_else(|e| panic!("emit of a parsed packet failed: {e}: {p:?}"));
    assert_eq!(n, total);
    assert!(
        out[n..].iter().all(|&b| b == 0xA5),
        "emit wrote past its length"
    );
    assert!(
        wire::emit_packet_with(&p.bth, &p.headers, p.payload, &p.trailer, &mut out[..n - 1])
            .is_err()
    );
    let q = Packet::parse(&out[..n])
        .unwrap_or_else(|e| panic!("emitted packet does not parse: {e}: {p:?}"));
    let mut expect_bth = p.bth;
    expect_bth.pad_count = wire::pad_for(p.payload.len()) as u8;
    assert_eq!(q.bth, expect_bth, "BTH round trip");
    assert_eq!(q.headers, p.headers, "headers round trip");
    assert_eq!(q.payload, p.payload, "payload round trip");
    assert_eq!(q.trailer, p.trailer, "trailer round trip");
    assert_eq!(q.icrc, [0; ICRC_LEN], "emit leaves the ICRC zero");
    // Emitting the re-parsed packet gives the same bytes (canonical form).
    let mut again = vec![0u8; n];
    wire::emit_packet_with(&q.bth, &q.headers, q.payload, &q.trailer, &mut again).expect("re-emit");
    assert_eq!(again, out[..n], "emit is not canonical");
    // Headers emitted alone parse back with the same opcode.
    let mut hb = vec![0u8; p.headers.len()];
    assert_eq!(
        p.headers.emit(&mut hb).expect("headers emit"),
        p.headers.len()
    );
    assert_eq!(
        Headers::parse(p.bth.opcode, &hb).expect("headers re-parse"),
        p.headers
    );

    icrc_checks(&out[..n], h);
    // Stamping keeps the packet parseable and equal.
    let mut stamped = out[..n].to_vec();
    if let Ok(ip) = IpHeader::synthesized(
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)),
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)),
    ) {
        icrc::stamp(&ip, 0xC000, wire::ROCEV2_UDP_PORT, &mut stamped).expect("stamp");
        let s = Packet::parse(&stamped).expect("stamped packet parses");
        assert_eq!(
            (s.bth, s.headers, s.payload, s.trailer),
            (q.bth, q.headers, q.payload, q.trailer)
        );
    }
}

/// The target: never panics except on a broken invariant.
pub fn run(data: &[u8]) {
    let h = digest(data);

    // Every fixed-size header, at the start of the input and right after a BTH.
    headers_roundtrip(data);
    headers_roundtrip(data.get(BTH_LEN..).unwrap_or(&[]));

    // BTH alone.
    if let Ok(bth) = Bth::parse(data) {
        assert_eq!(bth.tver, 0);
        let mut out = [0u8; BTH_LEN];
        bth.emit(&mut out).expect("BTH emit");
        assert_eq!(Bth::parse(&out).expect("BTH re-parse"), bth);
        assert_eq!(out[0], data[0]);
        assert_eq!(&out[2..4], &data[2..4]);
        assert_eq!(out[5..8], data[5..8]);
        assert_eq!(out[9..12], data[9..12]);
    }

    // The extension headers of whatever opcode the first byte names.
    if let Some((&op, rest)) = data.split_first() {
        let op = Opcode(op);
        let known = wire::header_len(op);
        assert_eq!(known.is_ok(), op.is_known());
        let _ = (op.name(), op.transport(), op.is_metaroce(), op.to_string());
        if let Ok(hs) = Headers::parse(op, rest) {
            assert!(hs.matches_opcode(op));
            assert_eq!(known.ok(), Some(BTH_LEN + hs.len()));
            let mut out = vec![0u8; hs.len()];
            assert_eq!(hs.emit(&mut out).expect("headers emit"), hs.len());
            assert_eq!(Headers::parse(op, &out).expect("headers re-parse"), hs);
        }
    }

    // The whole packet.
    match Packet::parse(data) {
        Ok(p) => packet_checks(data, &p, h),
        Err(e) => {
            let _ = e.to_string();
        }
    }

    // stamp/verify on the raw input, whatever it is.
    icrc_checks(data, h.rotate_left(7));

    // PSN arithmetic on values from the input.
    let a = (h as u32) & PSN_MASK;
    let b = ((h >> 24) as u32) & PSN_MASK;
    let d = wire::psn_diff(a, b);
    assert!(d > -(1 << 23) && d <= 1 << 23);
    assert_eq!(wire::psn_add(b, d as u32), a);
    assert_eq!(wire::psn_diff(a, a), 0);
}
