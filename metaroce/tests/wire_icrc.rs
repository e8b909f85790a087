//! ICRC test vectors (RoCEv2 reference §5.3), IP header synthesis and PSN helpers.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use metaroce::wire::icrc::{self, IpHeader};
use metaroce::wire::{self, Error, Packet, ROCEV2_UDP_PORT};

fn hex(s: &str) -> Vec<u8> {
    let digits: Vec<u8> = s
        .bytes()
        .filter(|c| c.is_ascii_hexdigit())
        .map(|c| (c as char).to_digit(16).unwrap() as u8)
        .collect();
    assert!(digits.len() % 2 == 0, "odd hex string");
    digits.chunks(2).map(|p| p[0] << 4 | p[1]).collect()
}

/// One vector: bytes from the IP header on, including the 4 ICRC bytes at the end.
struct Vector {
    name: &'static str,
    frame: &'static str,
    icrc: &'static str,
}

const VECTORS: &[Vector] = &[
    Vector {
        name: "RC SEND_ONLY hello",
        frame: "45020034 12344000 4011a72f c0a80001 c0a80002 c00012b7 00200000
                0430ffff 00000011 80000064 68656c6c 6f000000",
        icrc: "a473a9b6",
    },
    Vector {
        name: "RC READ_REQUEST",
        frame: "4502003c 12344000 4011a727 c0a80001 c0a80002 c00012b7 00280000 0c00ffff
                00000011 80000067 00007f00 00002000 00001234 00001000",
        icrc: "360b164c",
    },
    Vector {
        name: "RC ACKNOWLEDGE",
        frame: "45020030 12344000 4011a733 c0a80001 c0a80002 c00012b7 001c0000 1100ffff
                00000022 00000064 1f000005",
        icrc: "63c848fb",
    },
    Vector {
        name: "RC NAK PSN sequence error",
        frame: "45020030 12344000 4011a733 c0a80001 c0a80002 c00012b7 001c0000 1100ffff
                00000022 00000068 60000005",
        icrc: "a895e40d",
    },
    Vector {
        name: "IPv6 RC SEND_ONLY",
        frame: "60212345 00201140 fe800000 00000000 00000000 00000001 fe800000 00000000
                00000000 00000002 c00012b7 00200000 0400ffff 00000011 80ffffff 61626364
                65666768",
        icrc: "344cdb79",
    },
];

/// (ip header, udp header, udp payload without ICRC, expected wire ICRC bytes)
fn split(v: &Vector) -> (Vec<u8>, Vec<u8>, Vec<u8>, [u8; 4]) {
    let f = hex(v.frame);
    let ip_len = if f[0] >> 4 == 6 { 40 } else { 20 };
    let icrc: [u8; 4] = hex(v.icrc).try_into().unwrap();
    (
        f[..ip_len].to_vec(),
        f[ip_len..ip_len + 8].to_vec(),
        f[ip_len + 8..].to_vec(),
        icrc,
    )
}

/// The `IpHeader` describing a captured header (test-side decoder, independent of the crate).
fn ip_header_of(ip: &[u8]) -> IpHeader {
    if ip[0] >> 4 == 4 {
        IpHeader::V4 {
            src: Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]),
            dst: Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]),
            id: u16::from_be_bytes([ip[4], ip[5]]),
            flags_frag: u16::from_be_bytes([ip[6], ip[7]]),
            ttl: ip[8],
            tos: ip[1],
        }
    } else {
        let first = u32::from_be_bytes([ip[0], ip[1], ip[2], ip[3]]);
        IpHeader::V6 {
            src: Ipv6Addr::from(<[u8; 16]>::try_from(&ip[8..24]).unwrap()),
            dst: Ipv6Addr::from(<[u8; 16]>::try_from(&ip[24..40]).unwrap()),
            traffic_class: (first >> 20) as u8,
            flow_label: first & 0xF_FFFF,
            hop_limit: ip[7],
        }
    }
}

#[test]
fn reference_vectors_compute_raw() {
    for v in VECTORS {
        let (ip, udp, body, want) = split(v);
        let got = icrc::compute_raw(&ip, &udp, &body).unwrap();
        assert_eq!(got.to_le_bytes(), want, "{}", v.name);
        let mut whole = body.clone();
        whole.extend_from_slice(&want);
        icrc::verify_raw(&ip, &udp, &whole).unwrap();
    }
}

#[test]
fn reference_vectors_compute_with_ip_header() {
    for v in VECTORS {
        let (ip, udp, body, want) = split(v);
        let h = ip_header_of(&ip);
        let sport = u16::from_be_bytes([udp[0], udp[1]]);
        let dport = u16::from_be_bytes([udp[2], udp[3]]);
        assert_eq!(dport, ROCEV2_UDP_PORT);
        let got = icrc::compute(&h, sport, dport, &body);
        assert_eq!(got.to_le_bytes(), want, "{}", v.name);

        // stamp / verify on the whole UDP payload.
        let mut whole = body.clone();
        whole.extend_from_slice(&[0; 4]);
        icrc::stamp(&h, sport, dport, &mut whole).unwrap();
        assert_eq!(&whole[whole.len() - 4..], &want, "{}", v.name);
        icrc::verify(&h, sport, dport, &whole).unwrap();

        // The vectors parse as packets and carry the expected ICRC bytes.
        let p = Packet::parse(&whole).unwrap();
        assert_eq!(p.icrc, want);
        assert_eq!(p.icrc_value(), got);

        // to_bytes reproduces the captured header exactly (incl. the IPv4 checksum).
        let udp_len = u16::from_be_bytes([udp[4], udp[5]]);
        assert_eq!(usize::from(udp_len), 8 + whole.len());
        let mut buf = [0u8; 40];
        let n = h.to_bytes(udp_len, &mut buf).unwrap();
        assert_eq!(&buf[..n], &ip[..], "{}", v.name);
    }
}

#[test]
fn hello_vector_fields() {
    let (_, _, body, _) = split(&VECTORS[0]);
    let mut whole = body;
    whole.extend_from_slice(&[0xa4, 0x73, 0xa9, 0xb6]);
    let p = Packet::parse(&whole).unwrap();
    assert_eq!(p.bth.opcode, wire::Opcode::RC_SEND_ONLY);
    assert_eq!(p.bth.pad_count, 3);
    assert_eq!(p.bth.dest_qp, 0x11);
    assert!(p.bth.ack_req);
    assert_eq!(p.bth.psn, 100);
    assert_eq!(p.payload, b"hello");
    assert_eq!(p.icrc_value(), 0xB6A9_73A4);
}

#[test]
fn masked_fields_do_not_change_the_icrc() {
    let (ip, udp, body, want) = split(&VECTORS[0]);
    // TOS, TTL, IPv4 checksum, UDP checksum and BTH byte 4 are masked.
    for (which, off) in [("ip", 1usize), ("ip", 8), ("ip", 10), ("ip", 11)] {
        let mut ip2 = ip.clone();
        ip2[off] ^= 0x5a;
        assert_eq!(
            icrc::compute_raw(&ip2, &udp, &body).unwrap().to_le_bytes(),
            want,
            "{which}[{off}]"
        );
    }
    let mut udp2 = udp.clone();
    udp2[6] = 0x12;
    udp2[7] = 0x34;
    assert_eq!(
        icrc::compute_raw(&ip, &udp2, &body).unwrap().to_le_bytes(),
        want
    );
    let mut body2 = body.clone();
    body2[4] = 0xC0; // FECN + BECN
    assert_eq!(
        icrc::compute_raw(&ip, &udp, &body2).unwrap().to_le_bytes(),
        want
    );
    // ... and a covered field does.
    let mut ip3 = ip.clone();
    ip3[5] ^= 1; // IPv4 ID
    assert_ne!(
        icrc::compute_raw(&ip3, &udp, &body).unwrap().to_le_bytes(),
        want
    );
}

#[test]
fn verify_reports_mismatch() {
    let (ip, udp, body, want) = split(&VECTORS[2]);
    let h = ip_header_of(&ip);
    let sport = u16::from_be_bytes([udp[0], udp[1]]);
    let mut whole = body;
    whole.extend_from_slice(&want);
    whole[14] ^= 0x01; // MSN byte
    match icrc::verify(&h, sport, ROCEV2_UDP_PORT, &whole) {
        Err(Error::BadIcrc { found, expected }) => {
            assert_eq!(found, u32::from_le_bytes(want));
            assert_ne!(expected, found);
        }
        other => panic!("expected BadIcrc, got {other:?}"),
    }
    assert!(matches!(
        icrc::verify_raw(&ip, &udp, &whole),
        Err(Error::BadIcrc { .. })
    ));
}

#[test]
fn compute_raw_rejects_bad_headers() {
    let (ip, udp, body, _) = split(&VECTORS[0]);
    assert_eq!(
        icrc::compute_raw(&ip[..19], &udp, &body),
        Err(Error::BadLength)
    );
    assert_eq!(
        icrc::compute_raw(&ip, &udp[..7], &body),
        Err(Error::BadLength)
    );
    assert_eq!(icrc::compute_raw(&[], &udp, &body), Err(Error::BadLength));
    let mut opts = ip.clone();
    opts[0] = 0x46;
    opts.extend_from_slice(&[0; 4]);
    assert!(matches!(
        icrc::compute_raw(&opts, &udp, &body),
        Err(Error::BadLength | Error::BadField(_))
    ));
    let mut v5 = ip.clone();
    v5[0] = 0x55;
    assert!(matches!(
        icrc::compute_raw(&v5, &udp, &body),
        Err(Error::BadField(_))
    ));
}

#[test]
fn stamp_and_verify_need_bth_and_icrc() {
    let h =
        IpHeader::synthesized("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap()).unwrap();
    for n in 0..16 {
        let mut b = vec![0u8; n];
        assert!(matches!(
            icrc::stamp(&h, 1, 2, &mut b),
            Err(Error::Truncated { needed: 16, .. })
        ));
        assert!(matches!(
            icrc::verify(&h, 1, 2, &b),
            Err(Error::Truncated { needed: 16, .. })
        ));
    }
    let mut big = vec![0u8; 65536 - 28];
    assert_eq!(icrc::stamp(&h, 1, 2, &mut big), Err(Error::BadLength));
    let mut ok = vec![0u8; 65536 - 28 - 4];
    icrc::stamp(&h, 1, 2, &mut ok).unwrap();
    icrc::verify(&h, 1, 2, &ok).unwrap();
}

#[test]
fn synthesized_headers() {
    let a: IpAddr = "192.168.0.1".parse().unwrap();
    let b: IpAddr = "192.168.0.2".parse().unwrap();
    let h = IpHeader::synthesized(a, b).unwrap();
    assert_eq!(
        h,
        IpHeader::V4 {
            src: Ipv4Addr::new(192, 168, 0, 1),
            dst: Ipv4Addr::new(192, 168, 0, 2),
            id: 0,
            flags_frag: 0x4000,
            ttl: 64,
            tos: 0,
        }
    );
    let mut buf = [0u8; 20];
    assert_eq!(h.to_bytes(32, &mut buf).unwrap(), 20);
    assert_eq!(
        buf.to_vec(),
        hex("45000034 00004000 4011b965 c0a80001 c0a80002")
    );

    // IPv4-mapped IPv6 addresses become IPv4.
    let m: IpAddr = "::ffff:192.168.0.1".parse().unwrap();
    assert_eq!(IpHeader::synthesized(m, b).unwrap(), h);

    let x: IpAddr = "fe80::1".parse().unwrap();
    let y: IpAddr = "fe80::2".parse().unwrap();
    let h6 = IpHeader::synthesized(x, y).unwrap();
    assert_eq!(
        h6,
        IpHeader::V6 {
            src: "fe80::1".parse().unwrap(),
            dst: "fe80::2".parse().unwrap(),
            traffic_class: 0,
            flow_label: 0,
            hop_limit: 64,
        }
    );
    assert_eq!(h6.header_len(), 40);
    assert_eq!(h6.src(), x);
    assert_eq!(h6.dst(), y);
    let mut buf6 = [0u8; 40];
    assert_eq!(h6.to_bytes(32, &mut buf6).unwrap(), 40);
    assert_eq!(&buf6[..8], &hex("60000000 00201140")[..]);

    assert!(matches!(
        IpHeader::synthesized(a, x),
        Err(Error::BadField(_))
    ));
    assert!(matches!(
        IpHeader::synthesized(y, b),
        Err(Error::BadField(_))
    ));
}

#[test]
fn to_bytes_errors() {
    let h = IpHeader::synthesized("1.2.3.4".parse().unwrap(), "5.6.7.8".parse().unwrap()).unwrap();
    let mut small = [0u8; 19];
    assert_eq!(
        h.to_bytes(100, &mut small),
        Err(Error::BufferTooSmall {
            needed: 20,
            got: 19
        })
    );
    let mut buf = [0u8; 20];
    assert_eq!(h.to_bytes(7, &mut buf), Err(Error::BadLength));
    assert_eq!(h.to_bytes(65535 - 19, &mut buf), Err(Error::BadLength));
    assert!(h.to_bytes(65535 - 20, &mut buf).is_ok());
}

#[test]
fn udp_header_bytes() {
    assert_eq!(
        icrc::udp_header(0xc000, 4791, 24).unwrap().to_vec(),
        hex("c00012b7 00200000")
    );
    assert_eq!(icrc::udp_header(1, 2, 65535 - 8 + 1), Err(Error::BadLength));
}

#[test]
fn psn_helpers() {
    use wire::{psn_add, psn_diff, PSN_MASK};
    assert_eq!(psn_add(0xFF_FFFF, 1), 0);
    assert_eq!(psn_add(0xFF_FFFE, 5), 3);
    assert_eq!(psn_add(5, 0), 5);
    assert_eq!(psn_add(0, PSN_MASK), PSN_MASK);
    assert_eq!(psn_diff(3, 0xFF_FFFE), 5);
    assert_eq!(psn_diff(0xFF_FFFE, 3), -5);
    assert_eq!(psn_diff(7, 7), 0);
    assert_eq!(psn_diff(1 << 23, 0), 1 << 23);
    assert_eq!(psn_diff(0, 1 << 23), 1 << 23);
    assert_eq!(psn_diff((1 << 23) + 1, 0), -((1 << 23) - 1));
    for a in [0u32, 1, 0x7F_FFFF, 0x80_0000, 0xFF_FFFF, 0x12_3456] {
        for n in [0u32, 1, 100, 0x7F_FFFF, 0x80_0000] {
            let b = psn_add(a, n);
            assert_eq!(psn_diff(b, a), n as i32, "a={a:#x} n={n:#x}");
        }
    }
}

/// The worked example of docs/PROTOCOL.md, byte for byte (built independently in Python with
/// zlib and checked with the testbed's check_icrc_pcap.py).
#[test]
fn protocol_md_worked_example() {
    use wire::{Bth, Headers, Opcode, PathEth, SendEth};
    let mut bth = Bth::new(Opcode::MR_SEND, 0x000102, 0x000010);
    bth.ack_req = true;
    let headers = Headers::Send {
        path: PathEth {
            path_id: 0,
            flags: 0,
            timestamp: 123_456,
            floor_psn: 0x10,
            plane: 0,
        },
        send: SendEth {
            stream_id: 1,
            msg_seq: 0,
            offset: 0,
            msg_len: 5,
        },
    };
    let mut udp_payload = vec![0u8; wire::packet_len(&headers, 5)];
    assert_eq!(udp_payload.len(), 52);
    wire::emit_packet(&bth, &headers, b"hello", &mut udp_payload).unwrap();
    let ip =
        IpHeader::synthesized("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap()).unwrap();
    icrc::stamp(&ip, 49152, ROCEV2_UDP_PORT, &mut udp_payload).unwrap();
    assert_eq!(
        udp_payload,
        hex(
            "c230ffff 00000102 80000010 00000000 0001e240 00000010 00000001 00000000
             00000000 00000005 68656c6c 6f000000 1548cd02"
        )
    );
    // On the wire the data packet carries ECT(0) in the TOS byte; TOS is masked in the ICRC.
    let on_wire = IpHeader::V4 {
        src: Ipv4Addr::new(10, 0, 0, 1),
        dst: Ipv4Addr::new(10, 0, 0, 2),
        id: 0,
        flags_frag: 0x4000,
        ttl: 64,
        tos: 0x02,
    };
    icrc::verify(&on_wire, 49152, ROCEV2_UDP_PORT, &udp_payload).unwrap();
    let mut iph = [0u8; 20];
    on_wire.to_bytes(60, &mut iph).unwrap();
    assert_eq!(
        iph.to_vec(),
        hex("45020050 00004000 40112699 0a000001 0a000002")
    );
    assert_eq!(
        icrc::udp_header(49152, ROCEV2_UDP_PORT, udp_payload.len())
            .unwrap()
            .to_vec(),
        hex("c00012b7 003c0000")
    );
}
