//! Property tests: every header and every packet variant survives emit → parse, parsing
//! never panics, and truncations are always rejected by parse + ICRC check.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use metaroce::wire::icrc::{self, IpHeader};
use metaroce::wire::{
    self, AckEth, Aeth, AtomicAckEth, AtomicEth, Bth, CloseEth, ConnectEth, ConnectKind, Deth,
    Error, Headers, NakEth, Opcode, Packet, PathEth, Reth, SendEth, WriteEth, BTH_LEN, PSN_MASK,
};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------
// Expected opcode table, written from the RoCEv2 reference §4 independently of the crate.

#[derive(Clone, Copy, Debug, Default)]
struct Set {
    reth: bool,
    aeth: bool,
    atomic: bool,
    atomic_ack: bool,
    imm: bool,
    ieth: bool,
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Rc(Set),
    Ud(bool),
    Cnp,
    Connect,
    Ack,
    Send,
    Write(bool),
    Nak,
    Close,
    ReadRequest,
    ReadResponse,
    Atomic,
    AtomicResponse,
}

/// (opcode, kind, header length from BTH start)
fn table() -> Vec<(u8, Kind, usize)> {
    let n = Set::default();
    let imm = Set { imm: true, ..n };
    let reth = Set { reth: true, ..n };
    let aeth = Set { aeth: true, ..n };
    vec![
        (0x00, Kind::Rc(n), 12),
        (0x01, Kind::Rc(n), 12),
        (0x02, Kind::Rc(n), 12),
        (0x03, Kind::Rc(imm), 16),
        (0x04, Kind::Rc(n), 12),
        (0x05, Kind::Rc(imm), 16),
        (0x06, Kind::Rc(reth), 28),
        (0x07, Kind::Rc(n), 12),
        (0x08, Kind::Rc(n), 12),
        (0x09, Kind::Rc(imm), 16),
        (0x0A, Kind::Rc(reth), 28),
        (0x0B, Kind::Rc(Set { imm: true, ..reth }), 32),
        (0x0C, Kind::Rc(reth), 28),
        (0x0D, Kind::Rc(aeth), 16),
        (0x0E, Kind::Rc(n), 12),
        (0x0F, Kind::Rc(aeth), 16),
        (0x10, Kind::Rc(aeth), 16),
        (0x11, Kind::Rc(aeth), 16),
        (
            0x12,
            Kind::Rc(Set {
                atomic_ack: true,
                ..aeth
            }),
            24,
        ),
        (0x13, Kind::Rc(Set { atomic: true, ..n }), 40),
        (0x14, Kind::Rc(Set { atomic: true, ..n }), 40),
        (0x16, Kind::Rc(Set { ieth: true, ..n }), 16),
        (0x17, Kind::Rc(Set { ieth: true, ..n }), 16),
        (0x64, Kind::Ud(false), 20),
        (0x65, Kind::Ud(true), 24),
        (0x81, Kind::Cnp, 28),
        (0xC0, Kind::Connect, 72),
        (0xC1, Kind::Ack, 60),
        (0xC2, Kind::Send, 40),
        (0xC3, Kind::Write(false), 48),
        (0xC4, Kind::Write(true), 52),
        (0xC5, Kind::Nak, 32),
        (0xC6, Kind::Close, 28),
        (0xC7, Kind::ReadRequest, 48),
        (0xC8, Kind::ReadResponse, 32),
        (0xC9, Kind::Atomic, 60),
        (0xCA, Kind::Atomic, 60),
        (0xCB, Kind::AtomicResponse, 40),
    ]
}

#[test]
fn header_len_matches_reference_table() {
    let t = table();
    for op in 0..=255u8 {
        match t.iter().find(|e| e.0 == op) {
            Some(&(_, _, len)) => {
                assert_eq!(wire::header_len(Opcode(op)), Ok(len), "opcode {op:#04x}");
                assert!(Opcode(op).is_known());
                assert_ne!(Opcode(op).name(), "UNKNOWN");
            }
            None => {
                assert_eq!(
                    wire::header_len(Opcode(op)),
                    Err(Error::UnknownOpcode(op)),
                    "opcode {op:#04x}"
                );
                assert!(!Opcode(op).is_known());
                assert_eq!(Opcode(op).name(), "UNKNOWN");
            }
        }
    }
    assert_eq!(
        Opcode::RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE.name(),
        "RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE"
    );
    assert_eq!(
        Opcode::MR_WRITE_WITH_IMMEDIATE.name(),
        "MR_WRITE_WITH_IMMEDIATE"
    );
    assert_eq!(Opcode::CNP.to_string(), "CNP");
    assert_eq!(Opcode(0x20).to_string(), "UNKNOWN(0x20)");
    assert!(Opcode::MR_CONNECT.is_metaroce());
    assert!(!Opcode::CNP.is_metaroce());
}

// ---------------------------------------------------------------------------------------
// Strategies

fn u24() -> impl Strategy<Value = u32> {
    0..=PSN_MASK
}

fn reth() -> impl Strategy<Value = Reth> {
    (any::<u64>(), any::<u32>(), any::<u32>()).prop_map(|(va, rkey, dma_len)| Reth {
        va,
        rkey,
        dma_len,
    })
}
fn aeth() -> impl Strategy<Value = Aeth> {
    (any::<u8>(), u24()).prop_map(|(syndrome, msn)| Aeth { syndrome, msn })
}
fn atomic() -> impl Strategy<Value = AtomicEth> {
    (any::<u64>(), any::<u32>(), any::<u64>(), any::<u64>()).prop_map(
        |(va, rkey, swap_add, compare)| AtomicEth {
            va,
            rkey,
            swap_add,
            compare,
        },
    )
}
fn atomic_ack() -> impl Strategy<Value = AtomicAckEth> {
    any::<u64>().prop_map(|orig| AtomicAckEth { orig })
}
fn deth() -> impl Strategy<Value = Deth> {
    (any::<u32>(), u24()).prop_map(|(qkey, src_qp)| Deth { qkey, src_qp })
}
fn path() -> impl Strategy<Value = PathEth> {
    (any::<u8>(), any::<u8>(), any::<u32>(), u24()).prop_map(
        |(path_id, flags, timestamp, floor_psn)| PathEth {
            path_id,
            flags,
            timestamp,
            floor_psn,
            plane: 0,
        },
    )
}
fn send() -> impl Strategy<Value = SendEth> {
    any::<[u32; 4]>().prop_map(|[stream_id, msg_seq, offset, msg_len]| SendEth {
        stream_id,
        msg_seq,
        offset,
        msg_len,
    })
}
fn write() -> impl Strategy<Value = WriteEth> {
    any::<[u32; 2]>().prop_map(|[op_id, offset]| WriteEth { op_id, offset })
}
fn ack() -> impl Strategy<Value = AckEth> {
    (any::<[u8; 3]>(), any::<[u32; 3]>(), any::<[u8; 32]>()).prop_map(
        |([path_id, flags, window_grant], [echo_ts, ce_count, rate_hint], sack)| AckEth {
            path_id,
            flags,
            ack_delay: echo_ts as u16,
            echo_ts,
            ce_count,
            window_grant,
            // 24 bits on the wire.
            rate_hint: rate_hint & AckEth::MAX_RATE_HINT,
            sack,
        },
    )
}
/// Bytes 12–15 of an AckEth were one 32-bit rate hint before the window grant took byte
/// 12: an older peer's rate below 2^24 Mbit/s reads the same, with no grant; a grant and a
/// 24-bit rate come back as written; a rate too large for 24 bits is sent saturated.
#[test]
fn ack_window_grant_shares_the_old_rate_hint_word() {
    let mut b = [0u8; AckEth::LEN];
    b[12..16].copy_from_slice(&400_000u32.to_be_bytes());
    let a = AckEth::parse(&b).unwrap();
    assert_eq!((a.window_grant, a.rate_hint), (0, 400_000));

    let a = AckEth {
        window_grant: 16,
        rate_hint: 25_000,
        ..AckEth::default()
    };
    let mut out = [0u8; AckEth::LEN];
    a.emit(&mut out).unwrap();
    assert_eq!(&out[12..16], &[16, 0x00, 0x61, 0xA8]);
    assert_eq!(AckEth::parse(&out).unwrap(), a);

    let big = AckEth {
        rate_hint: u32::MAX,
        ..AckEth::default()
    };
    big.emit(&mut out).unwrap();
    let back = AckEth::parse(&out).unwrap();
    assert_eq!(
        (back.window_grant, back.rate_hint),
        (0, AckEth::MAX_RATE_HINT)
    );
}

fn nak() -> impl Strategy<Value = NakEth> {
    (any::<u8>(), any::<bool>(), any::<u32>()).prop_map(|(syndrome, refused, op_id)| NakEth {
        syndrome,
        flags: if refused {
            NakEth::FLAG_STREAM_REFUSED
        } else {
            0
        },
        op_id,
    })
}
fn connect() -> impl Strategy<Value = ConnectEth> {
    (
        prop_oneof![
            Just(ConnectKind::Request),
            Just(ConnectKind::Accept),
            Just(ConnectKind::Reject),
            Just(ConnectKind::Retry),
            Just(ConnectKind::Confirm)
        ],
        any::<u8>(),
        any::<u16>(),
        (u24(), u24(), u24()),
        any::<[u16; 3]>(),
        any::<[u64; 2]>(),
        any::<u32>(),
        any::<[u8; 16]>(),
    )
        .prop_map(
            |(
                kind,
                version,
                paths,
                (src_qpn, dst_qpn, init_psn),
                [pmtu, listen_port, flags],
                [nonce, server_nonce],
                reason,
                cookie,
            )| {
                ConnectEth {
                    kind,
                    version,
                    paths,
                    src_qpn,
                    dst_qpn,
                    pmtu,
                    listen_port,
                    init_psn,
                    nonce,
                    reason,
                    server_nonce,
                    flags,
                    cookie,
                }
            },
        )
}
fn close() -> impl Strategy<Value = CloseEth> {
    (any::<u32>(), any::<bool>(), any::<u16>(), any::<u64>()).prop_map(
        |(reason, ack, reply_port, nonce)| CloseEth {
            reason,
            flags: if ack { CloseEth::FLAG_ACK } else { 0 },
            reply_port,
            nonce,
        },
    )
}

/// Random values for every header; `build` picks the ones an opcode needs.
#[derive(Debug, Clone)]
struct Parts {
    reth: Reth,
    aeth: Aeth,
    atomic: AtomicEth,
    atomic_ack: AtomicAckEth,
    imm: u32,
    ieth: u32,
    deth: Deth,
    path: PathEth,
    send: SendEth,
    write: WriteEth,
    ack: AckEth,
    nak: NakEth,
    connect: ConnectEth,
    close: CloseEth,
}

fn parts() -> impl Strategy<Value = Parts> {
    (
        (
            reth(),
            aeth(),
            atomic(),
            atomic_ack(),
            any::<u32>(),
            any::<u32>(),
            deth(),
        ),
        (path(), send(), write(), ack(), nak(), connect(), close()),
    )
        .prop_map(
            |(
                (reth, aeth, atomic, atomic_ack, imm, ieth, deth),
                (path, send, write, ack, nak, connect, close),
            )| Parts {
                reth,
                aeth,
                atomic,
                atomic_ack,
                imm,
                ieth,
                deth,
                path,
                send,
                write,
                ack,
                nak,
                connect,
                close,
            },
        )
}

fn opt<T>(present: bool, v: T) -> Option<T> {
    if present {
        Some(v)
    } else {
        None
    }
}

fn build(kind: Kind, p: &Parts) -> Headers {
    match kind {
        Kind::Rc(s) => Headers::Rc {
            reth: opt(s.reth, p.reth),
            aeth: opt(s.aeth, p.aeth),
            atomic: opt(s.atomic, p.atomic),
            atomic_ack: opt(s.atomic_ack, p.atomic_ack),
            imm: opt(s.imm, p.imm),
            ieth: opt(s.ieth, p.ieth),
        },
        Kind::Ud(imm) => Headers::Ud {
            deth: p.deth,
            imm: opt(imm, p.imm),
        },
        Kind::Cnp => Headers::Cnp,
        Kind::Connect => Headers::Connect(p.connect),
        Kind::Ack => Headers::Ack(p.ack),
        Kind::Send => Headers::Send {
            path: p.path,
            send: p.send,
        },
        Kind::Write(imm) => Headers::Write {
            path: p.path,
            reth: p.reth,
            write: p.write,
            imm: opt(imm, p.imm),
        },
        Kind::Nak => Headers::Nak {
            path: p.path,
            nak: p.nak,
        },
        Kind::Close => Headers::Close(p.close),
        Kind::ReadRequest => Headers::ReadRequest {
            path: p.path,
            reth: p.reth,
            op: p.write,
        },
        Kind::ReadResponse => Headers::ReadResponse {
            path: p.path,
            op: p.write,
        },
        Kind::Atomic => Headers::Atomic {
            path: p.path,
            atomic: p.atomic,
            op: p.write,
        },
        Kind::AtomicResponse => Headers::AtomicResponse {
            path: p.path,
            op: p.write,
            ack: p.atomic_ack,
        },
    }
}

fn entry() -> impl Strategy<Value = (u8, Kind, usize)> {
    proptest::sample::select(table())
}

fn bth_for(op: u8) -> impl Strategy<Value = Bth> {
    (any::<[bool; 5]>(), 0u8..4, any::<u16>(), u24(), u24()).prop_map(
        move |([solicited, mig_req, fecn, becn, ack_req], pad_count, pkey, dest_qp, psn)| Bth {
            opcode: Opcode(op),
            solicited,
            mig_req,
            pad_count,
            tver: 0,
            pkey,
            fecn,
            becn,
            dest_qp,
            ack_req,
            psn,
        },
    )
}

/// A valid packet: (bth, headers, payload).
fn packet() -> impl Strategy<Value = (Bth, Headers, Vec<u8>)> {
    (entry(), parts(), prop::collection::vec(any::<u8>(), 0..600)).prop_flat_map(
        |((op, kind, _), parts, payload)| {
            let headers = build(kind, &parts);
            bth_for(op).prop_map(move |bth| (bth, headers, payload.clone()))
        },
    )
}

fn ip_header() -> impl Strategy<Value = IpHeader> {
    prop_oneof![
        (any::<[u8; 4]>(), any::<[u8; 4]>()).prop_map(|(a, b)| IpHeader::synthesized(
            IpAddr::V4(Ipv4Addr::from(a)),
            IpAddr::V4(Ipv4Addr::from(b))
        )
        .unwrap()),
        (
            any::<[u8; 4]>(),
            any::<[u8; 4]>(),
            any::<u16>(),
            any::<u16>(),
            any::<u8>(),
            any::<u8>()
        )
            .prop_map(|(a, b, id, flags_frag, ttl, tos)| IpHeader::V4 {
                src: Ipv4Addr::from(a),
                dst: Ipv4Addr::from(b),
                id,
                flags_frag,
                ttl,
                tos
            }),
        (
            any::<[u8; 16]>(),
            any::<[u8; 16]>(),
            any::<u8>(),
            0u32..(1 << 20),
            any::<u8>()
        )
            .prop_map(
                |(a, b, traffic_class, flow_label, hop_limit)| IpHeader::V6 {
                    src: Ipv6Addr::from(a),
                    dst: Ipv6Addr::from(b),
                    traffic_class,
                    flow_label,
                    hop_limit
                }
            ),
    ]
}

fn emit(bth: &Bth, headers: &Headers, payload: &[u8]) -> Vec<u8> {
    let mut buf = vec![0u8; wire::packet_len(headers, payload.len())];
    let n = wire::emit_packet(bth, headers, payload, &mut buf).unwrap();
    assert_eq!(n, buf.len());
    buf
}

// ---------------------------------------------------------------------------------------
// Per-header round trips

macro_rules! header_roundtrip {
    ($name:ident, $ty:ty, $strat:expr) => {
        proptest! {
            #[test]
            fn $name(h in $strat) {
                let mut buf = [0u8; <$ty>::LEN + 3];
                h.emit(&mut buf).unwrap();
                prop_assert_eq!(<$ty>::parse(&buf).unwrap(), h);
                prop_assert_eq!(<$ty>::parse(&buf[..<$ty>::LEN]).unwrap(), h);
                // Too short: typed errors, never a panic.
                for n in 0..<$ty>::LEN {
                    prop_assert_eq!(
                        h.emit(&mut buf[..n]),
                        Err(Error::BufferTooSmall { needed: <$ty>::LEN, got: n })
                    );
                    prop_assert_eq!(
                        <$ty>::parse(&buf[..n]),
                        Err(Error::Truncated { needed: <$ty>::LEN, got: n })
                    );
                }
            }
        }
    };
}

header_roundtrip!(roundtrip_reth, Reth, reth());
header_roundtrip!(roundtrip_aeth, Aeth, aeth());
header_roundtrip!(roundtrip_atomic_eth, AtomicEth, atomic());
header_roundtrip!(roundtrip_atomic_ack_eth, AtomicAckEth, atomic_ack());
header_roundtrip!(roundtrip_deth, Deth, deth());
header_roundtrip!(roundtrip_path_eth, PathEth, path());
header_roundtrip!(roundtrip_send_eth, SendEth, send());
header_roundtrip!(roundtrip_write_eth, WriteEth, write());
header_roundtrip!(roundtrip_ack_eth, AckEth, ack());
header_roundtrip!(roundtrip_nak_eth, NakEth, nak());
header_roundtrip!(roundtrip_connect_eth, ConnectEth, connect());
header_roundtrip!(roundtrip_close_eth, CloseEth, close());
header_roundtrip!(
    roundtrip_bth,
    Bth,
    entry().prop_flat_map(|(op, _, _)| bth_for(op))
);

#[test]
fn header_sizes() {
    assert_eq!(Bth::LEN, 12);
    assert_eq!(Reth::LEN, 16);
    assert_eq!(Aeth::LEN, 4);
    assert_eq!(AtomicEth::LEN, 28);
    assert_eq!(AtomicAckEth::LEN, 8);
    assert_eq!(Deth::LEN, 8);
    assert_eq!(PathEth::LEN, 12);
    assert_eq!(SendEth::LEN, 16);
    assert_eq!(WriteEth::LEN, 8);
    assert_eq!(AckEth::LEN, 48);
    assert_eq!(NakEth::LEN, 8);
    assert_eq!(ConnectEth::LEN, 60);
    assert_eq!(CloseEth::LEN, 16);
}

// ---------------------------------------------------------------------------------------
// Whole packets

proptest! {
    #[test]
    fn packet_roundtrip((bth, headers, payload) in packet(), ip in ip_header(), sport: u16, dport: u16) {
        prop_assert!(headers.matches_opcode(bth.opcode));
        let mut buf = emit(&bth, &headers, &payload);
        let hdr = wire::header_len(bth.opcode).unwrap();
        prop_assert_eq!(hdr, BTH_LEN + headers.len());
        prop_assert_eq!(buf.len() % 4, 0);

        let p = Packet::parse(&buf).unwrap();
        let mut want = bth;
        want.pad_count = wire::pad_for(payload.len()) as u8;
        prop_assert_eq!(p.bth, want);
        prop_assert_eq!(p.headers, headers);
        prop_assert_eq!(p.payload, &payload[..]);
        prop_assert_eq!(p.icrc, [0u8; 4]);
        // Headers::parse on the bytes after the BTH agrees.
        prop_assert_eq!(Headers::parse(bth.opcode, &buf[BTH_LEN..]).unwrap(), headers);
        // Pad bytes are zero.
        let pad_start = hdr + payload.len();
        prop_assert!(buf[pad_start..buf.len() - 4].iter().all(|&b| b == 0));

        icrc::stamp(&ip, sport, dport, &mut buf).unwrap();
        icrc::verify(&ip, sport, dport, &buf).unwrap();
        let p2 = Packet::parse(&buf).unwrap();
        prop_assert_eq!(p2.icrc_value(), icrc::compute(&ip, sport, dport, &buf[..buf.len() - 4]));

        // The raw-header path gives the same ICRC as the structured one.
        let udp = icrc::udp_header(sport, dport, buf.len()).unwrap();
        let mut iph = [0u8; 40];
        let n = ip.to_bytes(u16::from_be_bytes([udp[4], udp[5]]), &mut iph).unwrap();
        icrc::verify_raw(&iph[..n], &udp, &buf).unwrap();
    }

    #[test]
    fn icrc_detects_any_bit_flip_outside_masked_bth_byte(
        (bth, headers, payload) in packet(),
        ip in ip_header(),
        sport: u16,
        idx: prop::sample::Index,
        bit in 0u8..8,
    ) {
        let mut buf = emit(&bth, &headers, &payload);
        icrc::stamp(&ip, sport, wire::ROCEV2_UDP_PORT, &mut buf).unwrap();
        let i = idx.index(buf.len());
        buf[i] ^= 1 << bit;
        let r = icrc::verify(&ip, sport, wire::ROCEV2_UDP_PORT, &buf);
        if i == 4 {
            prop_assert_eq!(r, Ok(())); // FECN / BECN / reserved byte is masked
        } else {
            prop_assert!(matches!(r, Err(Error::BadIcrc { .. })), "{:?}", r);
        }
    }

    #[test]
    fn truncations_are_rejected((bth, headers, payload) in packet(), ip in ip_header(), sport: u16) {
        let mut buf = emit(&bth, &headers, &payload);
        icrc::stamp(&ip, sport, wire::ROCEV2_UDP_PORT, &mut buf).unwrap();
        let hdr = wire::header_len(bth.opcode).unwrap();
        for k in 0..buf.len() {
            let cut = &buf[..k];
            match Packet::parse(cut) {
                Ok(p) => {
                    // Only possible when the cut still looks like a whole packet; the
                    // lengths must then be self-consistent ...
                    prop_assert!(k >= hdr + 4 && k % 4 == 0);
                    prop_assert_eq!(p.payload.len() + hdr + usize::from(p.bth.pad_count) + 4, k);
                }
                Err(e) => {
                    if k < hdr + 4 {
                        prop_assert!(matches!(e, Error::Truncated { .. }), "{:?}", e);
                    }
                }
            }
            // ... and the ICRC check rejects every truncation.
            prop_assert!(icrc::verify(&ip, sport, wire::ROCEV2_UDP_PORT, cut).is_err(), "k={}", k);
        }
        prop_assert!(Packet::parse(&buf).is_ok());
    }

    #[test]
    fn parse_never_panics_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = Packet::parse(&bytes);
        let _ = Bth::parse(&bytes);
        if let Some(&op) = bytes.first() {
            let _ = Headers::parse(Opcode(op), &bytes);
        }
        let _ = icrc::compute_raw(&bytes[..bytes.len().min(20)], &bytes[..bytes.len().min(8)], &bytes);
        let _ = icrc::verify_raw(&bytes[..bytes.len().min(40)], &bytes[..bytes.len().min(8)], &bytes);
        let ip = IpHeader::synthesized("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap()).unwrap();
        let _ = icrc::verify(&ip, 1, 2, &bytes);
        let _ = icrc::compute(&ip, 1, 2, &bytes);
    }

    #[test]
    fn parse_never_panics_on_plausible_bytes(
        (op, _, _) in entry(),
        b1 in any::<u8>(),
        mut bytes in prop::collection::vec(any::<u8>(), 12..160),
    ) {
        // Valid opcode and TVer 0 so parsing goes past the BTH.
        bytes[0] = op;
        bytes[1] = b1 & 0xF0;
        let _ = Packet::parse(&bytes);
        let aligned = bytes.len() & !3;
        if let Ok(p) = Packet::parse(&bytes[..aligned]) {
            prop_assert_eq!(p.bth.opcode, Opcode(op));
            // A parsed packet (trailer included) re-emits to the same length.
            let mut out = vec![0u8; aligned];
            let n = wire::emit_packet_with(&p.bth, &p.headers, p.payload, &p.trailer, &mut out)
                .unwrap();
            prop_assert_eq!(n, aligned);
            let q = Packet::parse(&out).unwrap();
            prop_assert_eq!(q.headers, p.headers);
            prop_assert_eq!(q.trailer, p.trailer);
        }
    }

    #[test]
    fn emit_into_short_buffer_is_an_error((bth, headers, payload) in packet(), short in 0usize..64) {
        let len = wire::packet_len(&headers, payload.len());
        let n = len.saturating_sub(short + 1);
        let mut buf = vec![0u8; n];
        prop_assert_eq!(
            wire::emit_packet(&bth, &headers, &payload, &mut buf),
            Err(Error::BufferTooSmall { needed: len, got: n })
        );
    }

    #[test]
    fn psn_diff_inverts_psn_add(a in u24(), n in 0u32..=(1 << 23)) {
        prop_assert_eq!(wire::psn_diff(wire::psn_add(a, n), a), n as i32);
        if n > 0 && n < (1 << 23) {
            prop_assert_eq!(wire::psn_diff(a, wire::psn_add(a, n)), -(n as i32));
        }
    }
}

#[test]
fn sack_bitmap_layout() {
    let mut a = AckEth::default();
    assert!(a.sack_set(0));
    assert!(a.sack_set(7));
    assert!(a.sack_set(8));
    assert!(a.sack_set(255));
    assert!(!a.sack_set(256));
    assert_eq!(a.sack[0], 0b1000_0001);
    assert_eq!(a.sack[1], 0b1000_0000);
    assert_eq!(a.sack[31], 0b0000_0001);
    assert!(a.sack_get(0) && a.sack_get(7) && a.sack_get(8) && a.sack_get(255));
    assert!(!a.sack_get(1) && !a.sack_get(256) && !a.sack_get(usize::MAX));
    let mut buf = [0u8; AckEth::LEN];
    a.emit(&mut buf).unwrap();
    assert_eq!(buf[16], 0x81);
    assert_eq!(buf[17], 0x80);
    assert_eq!(buf[47], 0x01);
}

#[test]
fn pad_and_len() {
    assert_eq!(
        (0..8).map(wire::pad_for).collect::<Vec<_>>(),
        [0, 3, 2, 1, 0, 3, 2, 1]
    );
    let h = Headers::Cnp;
    assert_eq!(wire::packet_len(&h, 0), 32);
    assert_eq!(wire::packet_len(&h, 5), 40);
    assert_eq!(wire::packet_len(&h, usize::MAX), usize::MAX);
    let rc = Headers::Rc {
        reth: None,
        aeth: None,
        atomic: None,
        atomic_ack: None,
        imm: None,
        ieth: None,
    };
    assert!(rc.is_empty());
    assert_eq!(rc.len(), 0);
}

#[test]
fn bth_new_and_masks() {
    let b = Bth::new(Opcode::MR_SEND, 0x1AB_CDEF, 0xFF12_3456);
    assert_eq!(b.pkey, 0xFFFF);
    assert_eq!(b.dest_qp, 0xAB_CDEF);
    assert_eq!(b.psn, 0x12_3456);
    assert!(!b.solicited && !b.mig_req && !b.fecn && !b.becn && !b.ack_req);
    assert_eq!((b.pad_count, b.tver), (0, 0));
    let mut raw = Bth {
        dest_qp: 0xFFFF_FFFF,
        psn: 0x0100_0001,
        ..b
    };
    raw.pad_count = 7;
    let mut buf = [0u8; 12];
    raw.emit(&mut buf).unwrap();
    assert_eq!(
        buf,
        [0xC2, 0x30, 0xFF, 0xFF, 0, 0xFF, 0xFF, 0xFF, 0, 0, 0, 1]
    );
    // CNP as in the reference: BECN set.
    let mut cnp = Bth::new(Opcode::CNP, 0x11, 0);
    cnp.becn = true;
    cnp.emit(&mut buf).unwrap();
    assert_eq!(buf, [0x81, 0, 0xFF, 0xFF, 0x40, 0, 0, 0x11, 0, 0, 0, 0]);
    assert_eq!(Bth::parse(&buf).unwrap(), cnp);
}
