//! Real soft-RoCE packets (tests/data/rxe-pair-sample.pcap) and MetaRoCE packets written to a
//! pcap and decoded by tshark / checked by the testbed's ICRC checker.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;

use metaroce::wire::icrc::{self, IpHeader};
use metaroce::wire::{
    self, AckEth, Bth, CloseEth, ConnectEth, ConnectKind, Headers, NakEth, Opcode, Packet, PathEth,
    Reth, SendEth, WriteEth, ROCEV2_UDP_PORT,
};

const SAMPLE: &[u8] = include_bytes!("data/rxe-pair-sample.pcap");

/// Minimal classic-pcap reader: (link type, frames). Microsecond or nanosecond magic,
/// either byte order.
fn read_pcap(d: &[u8]) -> (u32, Vec<&[u8]>) {
    let magic = u32::from_le_bytes(d[..4].try_into().unwrap());
    let le = match magic {
        0xa1b2_c3d4 | 0xa1b2_3c4d => true,
        0xd4c3_b2a1 | 0x4d3c_b2a1 => false,
        _ => panic!("not a classic pcap file"),
    };
    let u32_at = |off: usize| {
        let b: [u8; 4] = d[off..off + 4].try_into().unwrap();
        if le {
            u32::from_le_bytes(b)
        } else {
            u32::from_be_bytes(b)
        }
    };
    let linktype = u32_at(20);
    let mut frames = Vec::new();
    let mut off = 24;
    while off + 16 <= d.len() {
        let incl = u32_at(off + 8) as usize;
        frames.push(&d[off + 16..off + 16 + incl]);
        off += 16 + incl;
    }
    assert_eq!(off, d.len(), "trailing garbage in pcap");
    (linktype, frames)
}

/// Split an Ethernet/IPv4/UDP frame into (ip header, udp header, udp payload).
fn split_frame(f: &[u8]) -> (&[u8], &[u8], &[u8]) {
    assert_eq!(&f[12..14], &[0x08, 0x00], "IPv4 ethertype");
    let ip = &f[14..];
    assert_eq!(ip[0], 0x45, "IPv4 without options");
    assert_eq!(ip[9], 17, "UDP");
    let udp = &ip[20..28];
    let udp_len = u16::from_be_bytes([udp[4], udp[5]]) as usize;
    (&ip[..20], udp, &ip[28..20 + udp_len])
}

fn ipv4_of(ip: &[u8]) -> IpHeader {
    IpHeader::V4 {
        src: Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]),
        dst: Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]),
        id: u16::from_be_bytes([ip[4], ip[5]]),
        flags_frag: u16::from_be_bytes([ip[6], ip[7]]),
        ttl: ip[8],
        tos: ip[1],
    }
}

#[test]
fn rxe_sample_parses_verifies_and_reemits_byte_exact() {
    let (linktype, frames) = read_pcap(SAMPLE);
    assert_eq!(linktype, 1, "Ethernet");
    assert_eq!(frames.len(), 32);
    let mut seen = std::collections::BTreeMap::<&'static str, usize>::new();
    for (i, f) in frames.iter().enumerate() {
        let (ip, udp, payload) = split_frame(f);
        let sport = u16::from_be_bytes([udp[0], udp[1]]);
        let dport = u16::from_be_bytes([udp[2], udp[3]]);
        assert_eq!(dport, ROCEV2_UDP_PORT);

        let p = Packet::parse(payload).unwrap_or_else(|e| panic!("frame {}: {e}", i + 1));
        *seen.entry(p.bth.opcode.name()).or_default() += 1;

        // ICRC from the raw captured headers.
        let body = &payload[..payload.len() - 4];
        let crc = icrc::compute_raw(ip, udp, body).unwrap();
        assert_eq!(crc.to_le_bytes(), p.icrc, "frame {}", i + 1);
        icrc::verify_raw(ip, udp, payload).unwrap();

        // The same from a structured IpHeader, which also reproduces the header bytes.
        let h = ipv4_of(ip);
        icrc::verify(&h, sport, dport, payload).unwrap();
        let mut ipbuf = [0u8; 20];
        h.to_bytes(u16::from_be_bytes([udp[4], udp[5]]), &mut ipbuf)
            .unwrap();
        assert_eq!(&ipbuf[..], ip, "frame {} IP header", i + 1);

        // Re-emit and stamp: byte-identical to the capture.
        assert_eq!(wire::packet_len(&p.headers, p.payload.len()), payload.len());
        let mut out = vec![0xAAu8; payload.len() + 7];
        let n = wire::emit_packet(&p.bth, &p.headers, p.payload, &mut out).unwrap();
        assert_eq!(n, payload.len());
        icrc::stamp(&h, sport, dport, &mut out[..n]).unwrap();
        assert_eq!(&out[..n], payload, "frame {} re-emitted", i + 1);
        assert!(out[n..].iter().all(|&b| b == 0xAA), "wrote past the packet");
    }
    assert_eq!(seen.get("RC_SEND_ONLY"), Some(&6));
    assert_eq!(seen.get("RC_ACKNOWLEDGE"), Some(&10));
    assert_eq!(seen.get("RC_SEND_FIRST"), Some(&4));
    assert_eq!(seen.get("RC_SEND_MIDDLE"), Some(&4));
    assert_eq!(seen.get("RC_SEND_LAST"), Some(&4));
    assert_eq!(seen.get("UD_SEND_ONLY"), Some(&4));
}

#[test]
fn rxe_sample_header_details() {
    let (_, frames) = read_pcap(SAMPLE);
    // Frame 2: ACK, syndrome 0x1f, MSN 1.
    let (_, _, payload) = split_frame(frames[1]);
    let p = Packet::parse(payload).unwrap();
    assert_eq!(p.bth.opcode, Opcode::RC_ACKNOWLEDGE);
    match p.headers {
        Headers::Rc { aeth: Some(a), .. } => {
            assert_eq!(a.syndrome, 0x1f);
            assert_eq!(a.msn, 1);
        }
        other => panic!("{other:?}"),
    }
    assert!(p.payload.is_empty());
    // Frame 29: UD SEND_ONLY, Q_Key 0x11111111, source QP 0x13, 256-byte payload.
    let (_, _, payload) = split_frame(frames[28]);
    let p = Packet::parse(payload).unwrap();
    assert_eq!(p.bth.opcode, Opcode::UD_SEND_ONLY);
    match p.headers {
        Headers::Ud { deth, imm: None } => {
            assert_eq!(deth.qkey, 0x1111_1111);
            assert_eq!(deth.src_qp, 0x13);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(p.payload.len(), 256);
    assert!(p.payload.iter().all(|&b| b == 0x7b));
}

// ---------------------------------------------------------------------------------------
// MetaRoCE packets → pcap → tshark / check_icrc_pcap.py

struct Built {
    frame: Vec<u8>,
    opcode: u8,
    dest_qp: u32,
    psn: u32,
}

fn metaroce_packets() -> Vec<(Bth, Headers, Vec<u8>)> {
    let path = PathEth {
        path_id: 2,
        flags: PathEth::FLAG_RETRANSMIT,
        timestamp: 0xDEAD_BEEF,
        floor_psn: 0x10,
        plane: 0,
    };
    let connect = ConnectEth {
        kind: ConnectKind::Request,
        version: ConnectEth::VERSION,
        paths: 4,
        src_qpn: 0x00_0101,
        dst_qpn: 0,
        pmtu: 1024,
        listen_port: 50000,
        init_psn: 0x00_1000,
        nonce: 0x0123_4567_89AB_CDEF,
        reason: 0,
        server_nonce: 0,
        flags: 0,
        cookie: [0; 16],
    };
    let mut ack = AckEth {
        path_id: 2,
        flags: AckEth::FLAG_ECE,
        ack_delay: 0,
        echo_ts: 0xDEAD_BEEF,
        ce_count: 3,
        window_grant: 0,
        rate_hint: 10_000,
        sack: [0; 32],
    };
    ack.sack_set(0);
    ack.sack_set(9);
    let reth = Reth {
        va: 0x7f00_0000_1000,
        rkey: 0x1234,
        dma_len: 3000,
    };
    let bth = |op: Opcode, qp: u32, psn: u32, ack_req: bool| {
        let mut b = Bth::new(op, qp, psn);
        b.ack_req = ack_req;
        b
    };
    vec![
        (
            bth(Opcode::MR_CONNECT, 0, 0, false),
            Headers::Connect(connect),
            vec![],
        ),
        (
            bth(Opcode::MR_CONNECT, 0x101, 0, false),
            Headers::Connect(ConnectEth {
                kind: ConnectKind::Accept,
                src_qpn: 0x202,
                dst_qpn: 0x101,
                paths: 2,
                ..connect
            }),
            vec![],
        ),
        (
            bth(Opcode::MR_SEND, 0x202, 0x1000, true),
            Headers::Send {
                path,
                send: SendEth {
                    stream_id: 1,
                    msg_seq: 0,
                    offset: 0,
                    msg_len: 11,
                },
            },
            b"hello world".to_vec(),
        ),
        (
            bth(Opcode::MR_WRITE, 0x202, 0x1001, false),
            Headers::Write {
                path,
                reth,
                write: WriteEth {
                    op_id: 7,
                    offset: 1024,
                },
                imm: None,
            },
            vec![0x5a; 1024],
        ),
        (
            bth(Opcode::MR_WRITE_WITH_IMMEDIATE, 0x202, 0x1002, true),
            Headers::Write {
                path,
                reth,
                write: WriteEth {
                    op_id: 7,
                    offset: 2048,
                },
                imm: Some(0xCAFE_F00D),
            },
            vec![0xa5; 952],
        ),
        (
            bth(Opcode::MR_ACK, 0x101, 0x1002, false),
            Headers::Ack(ack),
            vec![],
        ),
        (
            bth(Opcode::MR_NAK, 0x101, 0x1001, false),
            Headers::Nak {
                path,
                nak: NakEth {
                    syndrome: NakEth::REMOTE_ACCESS_ERROR,
                    flags: 0,
                    op_id: 7,
                },
            },
            vec![],
        ),
        (
            bth(Opcode::MR_CLOSE, 0x202, 0, false),
            Headers::Close(CloseEth {
                reason: CloseEth::REASON_NORMAL,
                flags: 0,
                reply_port: 4791,
                nonce: 0x0123_4567_89AB_CDEF,
            }),
            vec![],
        ),
    ]
}

fn build_frames() -> Vec<Built> {
    let src = "127.0.0.1".parse().unwrap();
    let dst = "127.0.0.2".parse().unwrap();
    let ip = IpHeader::synthesized(src, dst).unwrap();
    let sport = 0xC123;
    let mut out = Vec::new();
    for (bth, headers, payload) in metaroce_packets() {
        let len = wire::packet_len(&headers, payload.len());
        let mut udp_payload = vec![0u8; len];
        wire::emit_packet(&bth, &headers, &payload, &mut udp_payload).unwrap();
        icrc::stamp(&ip, sport, ROCEV2_UDP_PORT, &mut udp_payload).unwrap();
        // The packet parses back to what was emitted.
        let p = Packet::parse(&udp_payload).unwrap();
        assert_eq!(p.headers, headers);
        assert_eq!(p.payload, &payload[..]);
        icrc::verify(&ip, sport, ROCEV2_UDP_PORT, &udp_payload).unwrap();

        let udp = icrc::udp_header(sport, ROCEV2_UDP_PORT, len).unwrap();
        let mut iph = [0u8; 20];
        ip.to_bytes(u16::from_be_bytes([udp[4], udp[5]]), &mut iph)
            .unwrap();
        let mut frame = Vec::new();
        frame.extend_from_slice(&[2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 0x08, 0x00]);
        frame.extend_from_slice(&iph);
        frame.extend_from_slice(&udp);
        frame.extend_from_slice(&udp_payload);
        out.push(Built {
            frame,
            opcode: bth.opcode.0,
            dest_qp: bth.dest_qp,
            psn: bth.psn,
        });
    }
    out
}

fn write_pcap(path: &Path, frames: &[Built]) {
    let mut d = Vec::new();
    d.extend_from_slice(&0xa1b2_c3d4u32.to_le_bytes());
    d.extend_from_slice(&2u16.to_le_bytes());
    d.extend_from_slice(&4u16.to_le_bytes());
    for v in [0u32, 0, 65535, 1] {
        d.extend_from_slice(&v.to_le_bytes());
    }
    for (i, f) in frames.iter().enumerate() {
        let len = f.frame.len() as u32;
        for v in [1_700_000_000u32, i as u32, len, len] {
            d.extend_from_slice(&v.to_le_bytes());
        }
        d.extend_from_slice(&f.frame);
    }
    std::fs::write(path, d).unwrap();
}

fn temp_pcap(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    std::env::temp_dir().join(format!(
        "metaroce-wire-{tag}-{}-{nanos}.pcap",
        std::process::id()
    ))
}

fn on_path(cmd: &str) -> bool {
    Command::new(cmd)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

#[test]
fn metaroce_pcap_decodes_in_tshark_and_icrc_checks() {
    let frames = build_frames();
    let path = temp_pcap("mr");
    write_pcap(&path, &frames);

    // Our own reader gets the same packets back.
    let bytes = std::fs::read(&path).unwrap();
    let (_, back) = read_pcap(&bytes);
    assert_eq!(back.len(), frames.len());
    for (f, b) in frames.iter().zip(&back) {
        let (ip, udp, payload) = split_frame(b);
        icrc::verify_raw(ip, udp, payload).unwrap();
        assert_eq!(&f.frame[..], *b);
    }

    if on_path("tshark") {
        let out = Command::new("tshark")
            .arg("-r")
            .arg(&path)
            .args(["-T", "fields", "-E", "separator=/t"])
            .args(["-e", "infiniband.bth.opcode"])
            .args(["-e", "infiniband.bth.destqp"])
            .args(["-e", "infiniband.bth.psn"])
            .output()
            .expect("run tshark");
        assert!(
            out.status.success(),
            "tshark failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), frames.len(), "tshark output:\n{text}");
        for (line, f) in lines.iter().zip(&frames) {
            let cols: Vec<&str> = line.split('\t').collect();
            assert_eq!(cols.len(), 3, "line {line:?}");
            assert_eq!(
                parse_num(cols[0]),
                u64::from(f.opcode),
                "opcode in {line:?}"
            );
            assert_eq!(
                parse_num(cols[1]),
                u64::from(f.dest_qp),
                "destqp in {line:?}"
            );
            assert_eq!(parse_num(cols[2]), u64::from(f.psn), "psn in {line:?}");
        }
    } else {
        eprintln!("SKIP: tshark not on PATH; tshark decode check skipped");
    }

    let checker =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/testbed/check_icrc_pcap.py");
    if checker.exists() && on_path("python3") {
        let out = Command::new("python3")
            .arg(&checker)
            .arg(&path)
            .output()
            .expect("run check_icrc_pcap.py");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "check_icrc_pcap.py failed:\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.contains(&format!("{} RoCEv2 packets, 0 with bad ICRC", frames.len())),
            "{text}"
        );
    } else {
        eprintln!(
            "SKIP: {} or python3 not found; external ICRC check skipped",
            checker.display()
        );
    }
    // Set METAROCE_WIRE_PCAP_OUT=/some/file.pcap to keep a copy for inspection.
    if let Some(keep) = std::env::var_os("METAROCE_WIRE_PCAP_OUT") {
        std::fs::copy(&path, keep).unwrap();
    }
    let _ = std::fs::remove_file(&path);
}

/// tshark prints decimal or 0x-prefixed hex depending on the field's display base.
fn parse_num(s: &str) -> u64 {
    let s = s.trim();
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).unwrap(),
        None => s.parse().unwrap_or_else(|_| panic!("not a number: {s:?}")),
    }
}
