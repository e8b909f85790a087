//! Malformed input: truncation at every length, bad pad counts, unknown opcodes, TVer ≠ 0,
//! undefined enum values, unaligned lengths, and emit-side misuse.

use metaroce::wire::{
    self, AckEth, Aeth, Bth, CloseEth, ConnectEth, ConnectKind, Deth, Error, Headers, NakEth,
    Opcode, Packet, PathEth, Reth, SendEth, WriteEth,
};

fn rc(reth: Option<Reth>, aeth: Option<Aeth>, imm: Option<u32>) -> Headers {
    Headers::Rc {
        reth,
        aeth,
        atomic: None,
        atomic_ack: None,
        imm,
        ieth: None,
    }
}

/// One valid header-only packet per header shape (payload 0).
fn samples() -> Vec<(Opcode, Headers)> {
    let path = PathEth {
        path_id: 1,
        flags: 0,
        timestamp: 5,
        floor_psn: 9,
        plane: 0,
    };
    let reth = Reth {
        va: 1,
        rkey: 2,
        dma_len: 3,
    };
    let connect = ConnectEth {
        kind: ConnectKind::Reject,
        version: 1,
        paths: 1,
        src_qpn: 1,
        dst_qpn: 2,
        pmtu: 4096,
        listen_port: 4791,
        init_psn: 3,
        nonce: 4,
        reason: 5,
        server_nonce: 6,
        flags: 0,
        cookie: [7; 16],
    };
    vec![
        (Opcode::RC_SEND_ONLY, rc(None, None, None)),
        (Opcode::RC_SEND_ONLY_WITH_IMMEDIATE, rc(None, None, Some(7))),
        (Opcode::RC_RDMA_READ_REQUEST, rc(Some(reth), None, None)),
        (
            Opcode::RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE,
            rc(Some(reth), None, Some(1)),
        ),
        (
            Opcode::RC_ACKNOWLEDGE,
            rc(
                None,
                Some(Aeth {
                    syndrome: Aeth::ACK_NO_CREDIT,
                    msn: 1,
                }),
                None,
            ),
        ),
        (
            Opcode::RC_ATOMIC_ACKNOWLEDGE,
            Headers::Rc {
                reth: None,
                aeth: Some(Aeth::default()),
                atomic: None,
                atomic_ack: Some(Default::default()),
                imm: None,
                ieth: None,
            },
        ),
        (
            Opcode::RC_FETCH_ADD,
            Headers::Rc {
                reth: None,
                aeth: None,
                atomic: Some(Default::default()),
                atomic_ack: None,
                imm: None,
                ieth: None,
            },
        ),
        (
            Opcode::RC_SEND_ONLY_WITH_INVALIDATE,
            Headers::Rc {
                reth: None,
                aeth: None,
                atomic: None,
                atomic_ack: None,
                imm: None,
                ieth: Some(0x55),
            },
        ),
        (
            Opcode::UD_SEND_ONLY,
            Headers::Ud {
                deth: Deth {
                    qkey: 0x8001_0000,
                    src_qp: 1,
                },
                imm: None,
            },
        ),
        (
            Opcode::UD_SEND_ONLY_WITH_IMMEDIATE,
            Headers::Ud {
                deth: Deth::default(),
                imm: Some(3),
            },
        ),
        (Opcode::CNP, Headers::Cnp),
        (Opcode::MR_CONNECT, Headers::Connect(connect)),
        (Opcode::MR_ACK, Headers::Ack(AckEth::default())),
        (
            Opcode::MR_SEND,
            Headers::Send {
                path,
                send: SendEth::default(),
            },
        ),
        (
            Opcode::MR_WRITE,
            Headers::Write {
                path,
                reth,
                write: WriteEth::default(),
                imm: None,
            },
        ),
        (
            Opcode::MR_WRITE_WITH_IMMEDIATE,
            Headers::Write {
                path,
                reth,
                write: WriteEth::default(),
                imm: Some(9),
            },
        ),
        (
            Opcode::MR_NAK,
            Headers::Nak {
                path,
                nak: NakEth {
                    syndrome: NakEth::INVALID_REQUEST,
                    flags: NakEth::FLAG_STREAM_REFUSED,
                    op_id: 1,
                },
            },
        ),
        (Opcode::MR_CLOSE, Headers::Close(CloseEth::default())),
    ]
}

fn emit(op: Opcode, h: &Headers, payload: &[u8]) -> Vec<u8> {
    let mut buf = vec![0u8; wire::packet_len(h, payload.len())];
    wire::emit_packet(&Bth::new(op, 0x12, 0x34), h, payload, &mut buf).unwrap();
    buf
}

#[test]
fn truncated_at_every_length() {
    for (op, h) in samples() {
        let full = emit(op, &h, &[]);
        let need = wire::header_len(op).unwrap() + 4;
        assert_eq!(full.len(), need);
        assert!(Packet::parse(&full).is_ok(), "{op}");
        for k in 0..full.len() {
            let e = Packet::parse(&full[..k]).unwrap_err();
            let needed = if k < 16 { 16 } else { need };
            assert_eq!(e, Error::Truncated { needed, got: k }, "{op} cut at {k}");
        }
        // Headers::parse on short extension-header slices.
        let ext = &full[12..full.len() - 4];
        for k in 0..ext.len() {
            assert_eq!(
                Headers::parse(op, &ext[..k]),
                Err(Error::Truncated {
                    needed: ext.len(),
                    got: k
                }),
                "{op} headers cut at {k}"
            );
        }
    }
    // A payload-bearing packet cut below its headers.
    let p = emit(Opcode::MR_SEND, &samples()[13].1, &[1; 100]);
    for k in 16..44 {
        assert!(matches!(
            Packet::parse(&p[..k]),
            Err(Error::Truncated { needed: 44, .. })
        ));
    }
}

#[test]
fn bth_parse_truncated() {
    let full = emit(Opcode::RC_SEND_ONLY, &samples()[0].1, &[]);
    for k in 0..12 {
        assert_eq!(
            Bth::parse(&full[..k]),
            Err(Error::Truncated { needed: 12, got: k })
        );
    }
}

#[test]
fn pad_count_larger_than_payload() {
    for (op, h) in samples() {
        let mut b = emit(op, &h, &[]);
        for pad in 1..=3u8 {
            b[1] = (b[1] & 0xCF) | (pad << 4);
            assert_eq!(Packet::parse(&b), Err(Error::BadPadCount), "{op} pad {pad}");
        }
    }
    // 4 bytes of payload area: any pad count 0..=3 is fine, payload shrinks accordingly.
    let mut b = emit(Opcode::RC_SEND_ONLY, &samples()[0].1, &[1, 2, 3, 4]);
    for pad in 0..=3u8 {
        b[1] = (b[1] & 0xCF) | (pad << 4);
        let p = Packet::parse(&b).unwrap();
        assert_eq!(p.payload.len(), 4 - usize::from(pad));
    }
    // Non-zero pad bytes are accepted.
    let mut b = emit(Opcode::RC_SEND_ONLY, &samples()[0].1, b"hello");
    assert_eq!(b[1] & 0x30, 0x30);
    b[17] = 0xEE;
    b[19] = 0xEE;
    assert_eq!(Packet::parse(&b).unwrap().payload, b"hello");
}

#[test]
fn unknown_opcodes() {
    let base = emit(Opcode::MR_ACK, &Headers::Ack(AckEth::default()), &[]);
    for op in [
        0x15u8, 0x18, 0x1C, 0x1D, 0x1F, 0x20, 0x24, 0x2B, 0x40, 0x5F, 0x60, 0x63, 0x66, 0x80, 0x82,
        0xA0, 0xBF, 0xCC, 0xE0, 0xFF,
    ] {
        let mut b = base.clone();
        b[0] = op;
        assert_eq!(Packet::parse(&b), Err(Error::UnknownOpcode(op)), "{op:#x}");
        assert_eq!(
            Headers::parse(Opcode(op), &b[12..]),
            Err(Error::UnknownOpcode(op))
        );
        assert_eq!(wire::header_len(Opcode(op)), Err(Error::UnknownOpcode(op)));
        // Emitting one is refused too.
        let mut out = [0u8; 128];
        assert_eq!(
            wire::emit_packet(&Bth::new(Opcode(op), 1, 1), &Headers::Cnp, &[], &mut out),
            Err(Error::UnknownOpcode(op))
        );
    }
}

#[test]
fn tver_not_zero() {
    for (op, h) in samples() {
        let mut b = emit(op, &h, &[]);
        for tver in 1..=15u8 {
            b[1] = (b[1] & 0xF0) | tver;
            assert_eq!(Packet::parse(&b), Err(Error::UnsupportedTver(tver)));
            assert_eq!(Bth::parse(&b), Err(Error::UnsupportedTver(tver)));
        }
    }
    // TVer is checked before the opcode.
    let mut b = emit(Opcode::CNP, &Headers::Cnp, &[]);
    b[0] = 0xFF;
    b[1] = 0x01;
    assert_eq!(Packet::parse(&b), Err(Error::UnsupportedTver(1)));
}

#[test]
fn unaligned_length() {
    let b = emit(Opcode::RC_SEND_ONLY, &samples()[0].1, &[0; 8]);
    for extra in 1..4 {
        let mut c = b.clone();
        c.extend(std::iter::repeat_n(0, extra));
        assert_eq!(Packet::parse(&c), Err(Error::BadLength));
    }
}

#[test]
fn connect_kind_must_be_defined() {
    let (op, h) = samples()
        .into_iter()
        .find(|s| s.0 == Opcode::MR_CONNECT)
        .unwrap();
    let mut b = emit(op, &h, &[]);
    for kind in [0u8, 6, 0x80, 0xFF] {
        b[12] = kind;
        assert_eq!(
            Packet::parse(&b),
            Err(Error::BadField("ConnectEth.kind")),
            "{kind}"
        );
    }
    assert_eq!(ConnectKind::try_from(2), Ok(ConnectKind::Accept));
    assert!(ConnectKind::try_from(9).is_err());
}

#[test]
fn reserved_bits_are_ignored() {
    let (op, h) = samples()
        .into_iter()
        .find(|s| s.0 == Opcode::MR_NAK)
        .unwrap();
    let mut b = emit(op, &h, &[]);
    b[4] |= 0x3F; // BTH resv6
    b[8] |= 0x7C; // BTH reserved bits 6:2 (bits 1:0 are the MetaRoCE trailer kind)
    b[12 + 2] = 0xAA; // PathEth reserved
    b[12 + 8] = 0xA8; // PathEth byte 8: reserved bits 7:3 (bits 2:0 carry the plane)
    b[24 + 1] |= 0xFE; // NakEth flags: reserved bits 7:1
    b[24 + 2] = 0xAA; // NakEth reserved
    let p = Packet::parse(&b).unwrap();
    assert_eq!(p.headers, h);
    assert!(!p.bth.fecn && !p.bth.becn && !p.bth.ack_req);
    // CNP reserved bytes too; on a non-MetaRoCE opcode BTH byte 8 bits 6:0 are all reserved.
    let mut c = emit(Opcode::CNP, &Headers::Cnp, &[]);
    c[12..28].fill(0x5A);
    c[8] |= 0x7F;
    assert_eq!(Packet::parse(&c).unwrap().headers, Headers::Cnp);
}

#[test]
fn emit_refuses_headers_that_do_not_match_the_opcode() {
    let s = samples();
    let mut out = [0u8; 256];
    for (op, _) in &s {
        for (op2, h2) in &s {
            let ok = op == op2 || (h2.matches_opcode(*op)); // e.g. several RC opcodes share a shape
            let r = wire::emit_packet(&Bth::new(*op, 1, 2), h2, &[], &mut out);
            if ok {
                assert!(r.is_ok(), "{op} with headers of {op2}");
            } else {
                assert_eq!(
                    r,
                    Err(Error::BadField("headers do not match opcode")),
                    "{op} with headers of {op2}"
                );
            }
        }
    }
    // MR_WRITE with an immediate, and MR_WRITE_WITH_IMMEDIATE without one.
    let (_, w) = s.iter().find(|x| x.0 == Opcode::MR_WRITE).unwrap();
    assert!(!w.matches_opcode(Opcode::MR_WRITE_WITH_IMMEDIATE));
    // Unrelated RC opcodes with the bare-BTH shape do share it.
    assert!(s[0].1.matches_opcode(Opcode::RC_SEND_FIRST));
    assert!(!s[0].1.matches_opcode(Opcode::RC_SEND_ONLY_WITH_IMMEDIATE));
}

#[test]
fn emit_into_every_short_buffer() {
    for (op, h) in samples() {
        let payload = [7u8; 5];
        let len = wire::packet_len(&h, payload.len());
        for n in 0..len {
            let mut out = vec![0u8; n];
            assert_eq!(
                wire::emit_packet(&Bth::new(op, 1, 2), &h, &payload, &mut out),
                Err(Error::BufferTooSmall {
                    needed: len,
                    got: n
                }),
                "{op} into {n}"
            );
        }
        for n in 0..h.len() {
            let mut out = vec![0u8; n];
            assert_eq!(
                h.emit(&mut out),
                Err(Error::BufferTooSmall {
                    needed: h.len(),
                    got: n
                })
            );
        }
        let mut small = [0u8; 11];
        assert!(matches!(
            Bth::new(op, 1, 2).emit(&mut small),
            Err(Error::BufferTooSmall {
                needed: 12,
                got: 11
            })
        ));
    }
}

#[test]
fn errors_display() {
    let all = [
        Error::Truncated { needed: 16, got: 3 },
        Error::UnsupportedTver(2),
        Error::UnknownOpcode(0x15),
        Error::BadPadCount,
        Error::BadLength,
        Error::BufferTooSmall { needed: 8, got: 1 },
        Error::BadIcrc {
            expected: 1,
            found: 2,
        },
        Error::BadField("x"),
    ];
    for e in all {
        let s = e.to_string();
        assert!(!s.is_empty());
        let _: &dyn std::error::Error = &e;
    }
    assert_eq!(
        Error::UnknownOpcode(0x15).to_string(),
        "unknown or unsupported opcode 0x15"
    );
}
