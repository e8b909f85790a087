//! docs/PROTOCOL.md against the codec: the READ/atomic opcodes `0xC7..=0xCB`, their header
//! sizes and field offsets, the acceptance range `0xC0..=0xCB`, the `MR_COMPARE_SWAP` worked
//! example byte for byte, and a tshark decode of the BTH of every READ/atomic opcode.
//!
//! Every number asserted here is printed in docs/PROTOCOL.md; when one of these tests fails,
//! the document (or the codec) is wrong.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;

use metaroce::wire::icrc::{self, IpHeader};
use metaroce::wire::{
    self, AtomicAckEth, AtomicEth, Bth, Error, Headers, Opcode, Packet, PathEth, Reth, WriteEth,
    ROCEV2_UDP_PORT,
};

fn hex(s: &str) -> Vec<u8> {
    let digits: Vec<u8> = s
        .bytes()
        .filter(|c| c.is_ascii_hexdigit())
        .map(|c| (c as char).to_digit(16).unwrap() as u8)
        .collect();
    assert!(digits.len() % 2 == 0, "odd hex string");
    digits.chunks(2).map(|p| p[0] << 4 | p[1]).collect()
}

fn emit(bth: &Bth, headers: &Headers, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; wire::packet_len(headers, payload.len())];
    let n = wire::emit_packet(bth, headers, payload, &mut out).unwrap();
    assert_eq!(n, out.len());
    out
}

/// The PROTOCOL.md opcode table: name, header length from the BTH start (bytes).
#[test]
fn opcode_table_names_and_header_lengths() {
    let rows: [(u8, &str, usize); 12] = [
        (0xC0, "MR_CONNECT", 72),
        (0xC1, "MR_ACK", 60),
        (0xC2, "MR_SEND", 40),
        (0xC3, "MR_WRITE", 48),
        (0xC4, "MR_WRITE_WITH_IMMEDIATE", 52),
        (0xC5, "MR_NAK", 32),
        (0xC6, "MR_CLOSE", 28),
        (0xC7, "MR_READ_REQUEST", 48),
        (0xC8, "MR_READ_RESPONSE", 32),
        (0xC9, "MR_COMPARE_SWAP", 60),
        (0xCA, "MR_FETCH_ADD", 60),
        (0xCB, "MR_ATOMIC_RESPONSE", 40),
    ];
    for (op, name, len) in rows {
        let op = Opcode(op);
        assert!(op.is_metaroce() && op.is_known(), "{op}");
        assert_eq!(op.name(), name);
        assert_eq!(wire::header_len(op), Ok(len), "{name}");
    }
    // Extension headers never exceed 48 bytes (AckEth; PathEth + AtomicEth + WriteEth).
    assert_eq!(wire::header_len(Opcode::MR_COMPARE_SWAP).unwrap() - 12, 48);
    // Standard sizes the new layouts are built from.
    assert_eq!(
        (
            PathEth::LEN,
            Reth::LEN,
            WriteEth::LEN,
            AtomicEth::LEN,
            AtomicAckEth::LEN
        ),
        (12, 16, 8, 28, 8)
    );
}

/// "A receiver in MetaRoCE mode accepts only 0xC0–0xCB": every other opcode of the
/// MetaRoCE range is refused by the parser with `UnknownOpcode`.
#[test]
fn metaroce_range_defined_is_c0_to_cb() {
    for v in 0xC0..=0xFFu8 {
        let op = Opcode(v);
        assert!(op.is_metaroce());
        assert_eq!(op.is_known(), v <= 0xCB, "{op}");
        // A 76-byte datagram is long enough for every defined MetaRoCE header (≤ 72 + 4).
        let mut d = [0u8; 76];
        d[0] = v;
        d[2] = 0xFF;
        d[3] = 0xFF;
        d[12] = 1; // ConnectEth.kind = request (0 is BadField); harmless for the others
        match Packet::parse(&d) {
            Ok(p) => {
                assert!(v <= 0xCB, "0x{v:02x} parsed");
                assert_eq!(p.bth.opcode, op);
            }
            Err(e) => {
                assert!(v > 0xCB, "0x{v:02x}: {e}");
                assert_eq!(e, Error::UnknownOpcode(v));
            }
        }
    }
}

fn bth(op: Opcode, psn: u32) -> Bth {
    Bth::new(op, 0x00AB_CDEF, psn)
}

const PATH: PathEth = PathEth {
    path_id: 0x05,
    flags: 0x31, // generation 3, retransmission
    timestamp: 0x1122_3344,
    floor_psn: 0x00AA_BBCC,
    plane: 0,
};

/// PathEth bytes as PROTOCOL.md lays them out (offsets 12..24 from the BTH start).
const PATH_BYTES: &str = "05 31 0000 11223344 00 aabbcc";

/// Field offsets of MR_READ_REQUEST as documented: PathEth 12–23, RETH 24–39, WriteEth 40–47.
#[test]
fn read_request_layout() {
    let h = Headers::ReadRequest {
        path: PATH,
        reth: Reth {
            va: 0x0102_0304_0506_0708,
            rkey: 0x0A0B_0C0D,
            dma_len: 0x0001_0000,
        },
        op: WriteEth {
            op_id: 0x1718_191A,
            offset: 0,
        },
    };
    let p = emit(&bth(Opcode::MR_READ_REQUEST, 0x000123), &h, &[]);
    assert_eq!(p.len(), 48 + 4);
    assert_eq!(p[0], 0xC7);
    assert_eq!(p[12..24], hex(PATH_BYTES)[..]);
    assert_eq!(p[24..32], hex("0102030405060708")[..], "RETH VA");
    assert_eq!(p[32..36], hex("0a0b0c0d")[..], "RETH R_Key");
    assert_eq!(p[36..40], hex("00010000")[..], "RETH DMA length");
    assert_eq!(p[40..44], hex("1718191a")[..], "WriteEth op id");
    assert_eq!(p[44..48], hex("00000000")[..], "WriteEth offset");
    assert_eq!(Packet::parse(&p).unwrap().headers, h);
}

/// MR_READ_RESPONSE: PathEth 12–23, WriteEth 24–31, payload from 32 (padded to 4 bytes).
#[test]
fn read_response_layout() {
    let h = Headers::ReadResponse {
        path: PATH,
        op: WriteEth {
            op_id: 0x1718_191A,
            offset: 0x0000_1000,
        },
    };
    let p = emit(&bth(Opcode::MR_READ_RESPONSE, 0x000124), &h, b"abcde");
    assert_eq!(p.len(), 32 + 5 + 3 + 4);
    assert_eq!(p[0], 0xC8);
    assert_eq!(p[1] >> 4 & 3, 3, "PadCnt");
    assert_eq!(p[12..24], hex(PATH_BYTES)[..]);
    assert_eq!(p[24..28], hex("1718191a")[..], "WriteEth op id");
    assert_eq!(p[28..32], hex("00001000")[..], "WriteEth offset");
    assert_eq!(&p[32..37], b"abcde");
    let parsed = Packet::parse(&p).unwrap();
    assert_eq!(parsed.headers, h);
    assert_eq!(parsed.payload, b"abcde");
}

/// MR_COMPARE_SWAP / MR_FETCH_ADD: PathEth 12–23, AtomicEth 24–51 (VA 24–31, R_Key 32–35,
/// swap/add 36–43, compare 44–51), WriteEth 52–59.
#[test]
fn atomic_layout() {
    for op in [Opcode::MR_COMPARE_SWAP, Opcode::MR_FETCH_ADD] {
        let h = Headers::Atomic {
            path: PATH,
            atomic: AtomicEth {
                va: 0x0102_0304_0506_0708,
                rkey: 0x0A0B_0C0D,
                swap_add: 0x2122_2324_2526_2728,
                compare: 0x3132_3334_3536_3738,
            },
            op: WriteEth {
                op_id: 0x1718_191A,
                offset: 0,
            },
        };
        let p = emit(&bth(op, 0x000125), &h, &[]);
        assert_eq!(p.len(), 60 + 4);
        assert_eq!(p[0], op.0);
        assert_eq!(p[12..24], hex(PATH_BYTES)[..]);
        assert_eq!(p[24..32], hex("0102030405060708")[..], "AtomicEth VA");
        assert_eq!(p[32..36], hex("0a0b0c0d")[..], "AtomicEth R_Key");
        assert_eq!(p[36..44], hex("2122232425262728")[..], "swap/add");
        assert_eq!(p[44..52], hex("3132333435363738")[..], "compare");
        assert_eq!(p[52..56], hex("1718191a")[..], "WriteEth op id");
        assert_eq!(p[56..60], hex("00000000")[..], "WriteEth offset");
        assert_eq!(Packet::parse(&p).unwrap().headers, h);
    }
}

/// MR_ATOMIC_RESPONSE: PathEth 12–23, WriteEth 24–31, AtomicAckEth 32–39.
#[test]
fn atomic_response_layout() {
    let h = Headers::AtomicResponse {
        path: PATH,
        op: WriteEth {
            op_id: 0x1718_191A,
            offset: 0,
        },
        ack: AtomicAckEth {
            orig: 0x4142_4344_4546_4748,
        },
    };
    let p = emit(&bth(Opcode::MR_ATOMIC_RESPONSE, 0x000126), &h, &[]);
    assert_eq!(p.len(), 40 + 4);
    assert_eq!(p[0], 0xCB);
    assert_eq!(p[12..24], hex(PATH_BYTES)[..]);
    assert_eq!(p[24..28], hex("1718191a")[..], "WriteEth op id");
    assert_eq!(p[28..32], hex("00000000")[..], "WriteEth offset");
    assert_eq!(p[32..40], hex("4142434445464748")[..], "original value");
    assert_eq!(Packet::parse(&p).unwrap().headers, h);
}

/// The headers must match the opcode: a READ request's headers under the atomic opcode (or
/// the reverse) are refused on emit.
#[test]
fn headers_must_match_opcode() {
    let read = Headers::ReadRequest {
        path: PATH,
        reth: Reth::default(),
        op: WriteEth::default(),
    };
    let atomic = Headers::Atomic {
        path: PATH,
        atomic: AtomicEth::default(),
        op: WriteEth::default(),
    };
    let mut out = [0u8; 128];
    for (op, h) in [
        (Opcode::MR_COMPARE_SWAP, read),
        (Opcode::MR_WRITE, read),
        (Opcode::MR_READ_REQUEST, atomic),
        (Opcode::MR_ATOMIC_RESPONSE, atomic),
    ] {
        assert_eq!(
            wire::emit_packet(&bth(op, 0), &h, &[], &mut out),
            Err(Error::BadField("headers do not match opcode")),
            "{op}"
        );
    }
}

/// The MR_COMPARE_SWAP worked example of docs/PROTOCOL.md, byte for byte (the ICRC and the
/// IPv4 checksum were computed independently with Python's zlib.crc32 over the masked input
/// printed in the document).
#[test]
fn protocol_md_compare_swap_example() {
    // AckReq 0: metaroce sets AckReq on the packet that ends an operation's data, and an
    // atomic request carries none (see PROTOCOL.md, BTH).
    let bth = Bth::new(Opcode::MR_COMPARE_SWAP, 0x000102, 0x000011);
    let headers = Headers::Atomic {
        path: PathEth {
            path_id: 1,
            flags: 0,
            timestamp: 123_456,
            floor_psn: 0x11,
            plane: 0,
        },
        atomic: AtomicEth {
            va: 0x0000_7f00_0000_1000,
            rkey: 0x0000_1234,
            swap_add: 2,
            compare: 1,
        },
        op: WriteEth {
            op_id: 3,
            offset: 0,
        },
    };
    let mut udp_payload = emit(&bth, &headers, &[]);
    assert_eq!(udp_payload.len(), 64);
    let ip =
        IpHeader::synthesized("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap()).unwrap();
    icrc::stamp(&ip, 49152, ROCEV2_UDP_PORT, &mut udp_payload).unwrap();
    assert_eq!(
        udp_payload,
        hex("c900ffff 00000102 00000011
             01000000 0001e240 00000011
             00007f00 00001000 00001234 00000000 00000002 00000000 00000001
             00000003 00000000
             e8dfdb15")
    );
    let p = Packet::parse(&udp_payload).unwrap();
    assert_eq!(p.headers, headers);
    assert_eq!(p.icrc_value(), 0x15DB_DFE8);

    // On the wire the request carries ECT(0) in the TOS byte (masked in the ICRC).
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
    on_wire.to_bytes(72, &mut iph).unwrap();
    assert_eq!(
        iph.to_vec(),
        hex("4502005c 00004000 4011268d 0a000001 0a000002")
    );
    assert_eq!(
        icrc::udp_header(49152, ROCEV2_UDP_PORT, udp_payload.len())
            .unwrap()
            .to_vec(),
        hex("c00012b7 00480000")
    );

    // The CRC input the document prints: its tail is the packet with BTH byte 4 masked, and
    // a CRC-32 written here (not the codec's) over it gives the packet's ICRC.
    let crc_input = hex(
        "ffffffff ffffffff 45ff005c 00004000 ff11ffff 0a000001 0a000002 c00012b7
         0048ffff c900ffff ff000102 00000011 01000000 0001e240 00000011 00007f00
         00001000 00001234 00000000 00000002 00000000 00000001 00000003 00000000",
    );
    assert_eq!(crc_input.len(), 96);
    let mut masked = udp_payload[..udp_payload.len() - 4].to_vec();
    masked[4] = 0xFF;
    assert_eq!(crc_input[36..], masked[..]);
    assert_eq!(crc32(&crc_input), p.icrc_value());
}

/// Bitwise CRC-32 (reflected polynomial 0xEDB88320, init and final XOR 0xFFFFFFFF), as
/// PROTOCOL.md defines the ICRC; deliberately independent of `wire::icrc`.
fn crc32(data: &[u8]) -> u32 {
    let mut crc = 0xFFFF_FFFFu32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn read_atomic_packets() -> Vec<(Bth, Headers, Vec<u8>)> {
    let reth = Reth {
        va: 0x7f00_0000_1000,
        rkey: 0x1234,
        dma_len: 3000,
    };
    let atomic = AtomicEth {
        va: 0x7f00_0000_2000,
        rkey: 0x1234,
        swap_add: 2,
        compare: 1,
    };
    let op = WriteEth {
        op_id: 9,
        offset: 0,
    };
    let b = |o: Opcode, qp: u32, psn: u32| Bth::new(o, qp, psn);
    vec![
        (
            b(Opcode::MR_READ_REQUEST, 0x202, 0x1000),
            Headers::ReadRequest {
                path: PATH,
                reth,
                op,
            },
            vec![],
        ),
        (
            b(Opcode::MR_READ_RESPONSE, 0x101, 0x2000),
            Headers::ReadResponse {
                path: PATH,
                op: WriteEth {
                    op_id: 9,
                    offset: 2048,
                },
            },
            vec![0x5a; 950],
        ),
        (
            b(Opcode::MR_COMPARE_SWAP, 0x202, 0x1001),
            Headers::Atomic {
                path: PATH,
                atomic,
                op: WriteEth { op_id: 10, ..op },
            },
            vec![],
        ),
        (
            b(Opcode::MR_FETCH_ADD, 0x202, 0x1002),
            Headers::Atomic {
                path: PATH,
                atomic,
                op: WriteEth { op_id: 11, ..op },
            },
            vec![],
        ),
        (
            b(Opcode::MR_ATOMIC_RESPONSE, 0x101, 0x2001),
            Headers::AtomicResponse {
                path: PATH,
                op: WriteEth { op_id: 10, ..op },
                ack: AtomicAckEth { orig: 1 },
            },
            vec![],
        ),
    ]
}

fn on_path(cmd: &str) -> bool {
    Command::new(cmd)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn temp_pcap(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    std::env::temp_dir().join(format!(
        "metaroce-protodoc-{tag}-{}-{nanos}.pcap",
        std::process::id()
    ))
}

/// Classic pcap (microseconds, little-endian), Ethernet link type.
fn write_pcap(path: &Path, frames: &[Vec<u8>]) {
    let mut d = Vec::new();
    d.extend_from_slice(&0xa1b2_c3d4u32.to_le_bytes());
    d.extend_from_slice(&2u16.to_le_bytes());
    d.extend_from_slice(&4u16.to_le_bytes());
    for v in [0u32, 0, 65535, 1] {
        d.extend_from_slice(&v.to_le_bytes());
    }
    for (i, f) in frames.iter().enumerate() {
        let len = f.len() as u32;
        for v in [1_700_000_000u32, i as u32, len, len] {
            d.extend_from_slice(&v.to_le_bytes());
        }
        d.extend_from_slice(f);
    }
    std::fs::write(path, d).unwrap();
}

/// tshark prints decimal or 0x-prefixed hex depending on the field's display base.
fn parse_num(s: &str) -> u64 {
    let s = s.trim();
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).unwrap(),
        None => s.parse().unwrap_or_else(|_| panic!("not a number: {s:?}")),
    }
}

/// PROTOCOL.md, "Decoding with tshark": RoCEv2 tooling decodes the BTH of the READ/atomic
/// opcodes too (opcode, DestQP, PSN, PadCnt); the ICRC is checked by the testbed checker when
/// it is present.
#[test]
fn read_atomic_pcap_decodes_bth_in_tshark() {
    let ip =
        IpHeader::synthesized("127.0.0.1".parse().unwrap(), "127.0.0.2".parse().unwrap()).unwrap();
    let sport = 0xC123;
    let mut frames = Vec::new();
    let mut expect = Vec::new();
    for (bth, headers, payload) in read_atomic_packets() {
        let mut udp_payload = emit(&bth, &headers, &payload);
        icrc::stamp(&ip, sport, ROCEV2_UDP_PORT, &mut udp_payload).unwrap();
        let udp = icrc::udp_header(sport, ROCEV2_UDP_PORT, udp_payload.len()).unwrap();
        let mut iph = [0u8; 20];
        ip.to_bytes(u16::from_be_bytes([udp[4], udp[5]]), &mut iph)
            .unwrap();
        icrc::verify_raw(&iph, &udp, &udp_payload).unwrap();
        let mut frame = vec![2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 0x08, 0x00];
        frame.extend_from_slice(&iph);
        frame.extend_from_slice(&udp);
        frame.extend_from_slice(&udp_payload);
        frames.push(frame);
        let pad = u64::from(wire::pad_for(payload.len()) as u8);
        expect.push((
            u64::from(bth.opcode.0),
            u64::from(bth.dest_qp),
            u64::from(bth.psn),
            pad,
        ));
    }
    let path = temp_pcap("rdma");
    write_pcap(&path, &frames);

    if on_path("tshark") {
        let out = Command::new("tshark")
            .arg("-r")
            .arg(&path)
            .args(["-T", "fields", "-E", "separator=/t"])
            .args(["-e", "infiniband.bth.opcode"])
            .args(["-e", "infiniband.bth.destqp"])
            .args(["-e", "infiniband.bth.psn"])
            .args(["-e", "infiniband.bth.padcnt"])
            .output()
            .expect("run tshark");
        assert!(
            out.status.success(),
            "tshark failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), expect.len(), "tshark output:\n{text}");
        for (line, &(op, qp, psn, pad)) in lines.iter().zip(&expect) {
            let cols: Vec<&str> = line.split('\t').collect();
            assert_eq!(cols.len(), 4, "line {line:?}");
            assert_eq!(parse_num(cols[0]), op, "opcode in {line:?}");
            assert_eq!(parse_num(cols[1]), qp, "destqp in {line:?}");
            assert_eq!(parse_num(cols[2]), psn, "psn in {line:?}");
            assert_eq!(parse_num(cols[3]), pad, "padcnt in {line:?}");
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
    // Set METAROCE_PROTODOC_PCAP_OUT=/some/file.pcap to keep a copy for inspection.
    if let Some(keep) = std::env::var_os("METAROCE_PROTODOC_PCAP_OUT") {
        std::fs::copy(&path, keep).unwrap();
    }
    let _ = std::fs::remove_file(&path);
}
