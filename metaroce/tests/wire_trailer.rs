//! The authentication trailer (issue #9, docs/PROTOCOL.md "Authentication trailer"): kind in
//! BTH byte 8 bits 1:0 of MetaRoCE opcodes, 0 / 8 / 24 bytes between the pad and the ICRC,
//! covered by the ICRC; a worked example byte for byte.

use std::net::Ipv4Addr;

use metaroce::wire::icrc::{self, IpHeader};
use metaroce::wire::{
    self, Bth, Error, Headers, Opcode, Packet, PathEth, SendEth, Trailer, ROCEV2_UDP_PORT,
};
use proptest::prelude::*;

fn send_headers(len: u32) -> Headers {
    Headers::Send {
        path: PathEth::default(),
        send: SendEth {
            msg_len: len,
            ..Default::default()
        },
    }
}

fn emit(bth: &Bth, h: &Headers, payload: &[u8], t: &Trailer) -> Vec<u8> {
    let mut out = vec![0u8; wire::packet_len_with(h, payload.len(), t)];
    let n = wire::emit_packet_with(bth, h, payload, t, &mut out).unwrap();
    assert_eq!(n, out.len());
    out
}

fn hex(s: &str) -> Vec<u8> {
    let d: Vec<u8> = s
        .bytes()
        .filter(|c| c.is_ascii_hexdigit())
        .map(|c| (c as char).to_digit(16).unwrap() as u8)
        .collect();
    d.chunks(2).map(|p| p[0] << 4 | p[1]).collect()
}

/// The worked example of PROTOCOL.md: an MR_SEND of "hello" with token
/// 0x0123456789ABCDEF, byte for byte, and its ICRC.
#[test]
fn worked_example_token_trailer() {
    let mut bth = Bth::new(Opcode::MR_SEND, 0x12, 7);
    bth.ack_req = true;
    let h = Headers::Send {
        path: PathEth::default(),
        send: SendEth {
            stream_id: 0,
            msg_seq: 0,
            offset: 0,
            msg_len: 5,
        },
    };
    let t = Trailer::Token(0x0123_4567_89AB_CDEF);
    let mut p = emit(&bth, &h, b"hello", &t);
    assert_eq!(p.len(), 12 + 28 + 5 + 3 + 8 + 4);
    let want = hex("c2 30 ff ff 00 00 00 12 81 00 00 07
         00 00 00 00 00 00 00 00 00 00 00 00
         00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 05
         68 65 6c 6c 6f 00 00 00
         01 23 45 67 89 ab cd ef
         00 00 00 00");
    assert_eq!(p, want);
    let ip = IpHeader::synthesized(
        Ipv4Addr::new(10, 0, 0, 1).into(),
        Ipv4Addr::new(10, 0, 0, 2).into(),
    )
    .unwrap();
    icrc::stamp(&ip, 0xC000, ROCEV2_UDP_PORT, &mut p).unwrap();
    icrc::verify(&ip, 0xC000, ROCEV2_UDP_PORT, &p).unwrap();
    println!("ICRC bytes: {:02x?}", &p[p.len() - 4..]);
    // The ICRC covers the trailer: a flipped token bit is caught.
    let mut q = p.clone();
    q[52] ^= 0x01;
    assert!(icrc::verify(&ip, 0xC000, ROCEV2_UDP_PORT, &q).is_err());
    let parsed = Packet::parse(&p).unwrap();
    assert_eq!(parsed.payload, b"hello");
    assert_eq!(parsed.trailer, t);
    assert!(parsed.bth.ack_req);
    assert_eq!(parsed.bth.pad_count, 3);
}

#[test]
fn kind_three_is_bad_field_and_short_trailer_is_truncated() {
    let bth = Bth::new(Opcode::MR_SEND, 1, 1);
    let mut p = emit(&bth, &send_headers(4), b"abcd", &Trailer::None);
    p[8] |= 3;
    assert_eq!(Packet::parse(&p), Err(Error::BadField("BTH.trailer")));
    // Kind 2 (24 B) announced on a packet that has only 4 payload bytes after the headers.
    p[8] = (p[8] & !3) | 2;
    assert!(matches!(Packet::parse(&p), Err(Error::Truncated { .. })));
    // Kind 1 on the same packet: the 4 payload bytes + ICRC are not 8 bytes of trailer.
    p[8] = (p[8] & !3) | 1;
    assert!(matches!(Packet::parse(&p), Err(Error::Truncated { .. })));
}

#[test]
fn rocev2_opcodes_never_have_a_trailer() {
    let bth = Bth::new(Opcode::RC_SEND_ONLY, 1, 1);
    let mut out = vec![0u8; 64];
    assert_eq!(
        wire::emit_packet_with(
            &bth,
            &Headers::Rc {
                reth: None,
                aeth: None,
                atomic: None,
                atomic_ack: None,
                imm: None,
                ieth: None
            },
            b"abcd",
            &Trailer::Token(1),
            &mut out
        ),
        Err(Error::BadField("trailer on a RoCEv2 opcode"))
    );
}

#[test]
fn buffer_one_short_is_an_error() {
    let bth = Bth::new(Opcode::MR_SEND, 1, 1);
    let t = Trailer::Aead {
        key_phase: true,
        pn: 5,
        tag: [7; 16],
    };
    let h = send_headers(3);
    let n = wire::packet_len_with(&h, 3, &t);
    let mut out = vec![0u8; n - 1];
    assert!(matches!(
        wire::emit_packet_with(&bth, &h, b"abc", &t, &mut out),
        Err(Error::BufferTooSmall { .. })
    ));
}

fn trailer() -> impl Strategy<Value = Trailer> {
    prop_oneof![
        Just(Trailer::None),
        any::<u64>().prop_map(Trailer::Token),
        (any::<bool>(), 0..=Trailer::MAX_PN, any::<[u8; 16]>())
            .prop_map(|(key_phase, pn, tag)| Trailer::Aead { key_phase, pn, tag }),
    ]
}

proptest! {
    #[test]
    fn roundtrip(t in trailer(), payload in proptest::collection::vec(any::<u8>(), 0..64),
                 ack in any::<bool>(), psn in 0u32..1 << 24) {
        let mut bth = Bth::new(Opcode::MR_SEND, 9, psn);
        bth.ack_req = ack;
        let h = send_headers(payload.len() as u32);
        let p = emit(&bth, &h, &payload, &t);
        prop_assert_eq!(p.len(), 12 + 28 + payload.len() + wire::pad_for(payload.len()) + t.len() + 4);
        prop_assert_eq!(p[8] & 3, t.kind());
        prop_assert_eq!(p[8] & 0x7C, 0);
        let q = Packet::parse(&p).unwrap();
        prop_assert_eq!(q.trailer, t);
        prop_assert_eq!(q.payload, &payload[..]);
        prop_assert_eq!(q.bth.ack_req, ack);
        if let Some(w) = t.word() {
            let off = p.len() - 4 - t.len();
            prop_assert_eq!(&p[off..off + 8], &w[..]);
        }
    }
}
