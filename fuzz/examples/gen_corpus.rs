//! Writes seed inputs into `fuzz/corpus/<target>/`, each named by the SHA-1 of its content
//! (as libFuzzer names corpus files):
//!
//! * `wire_parse`: every distinct MetaRoCE packet (CONNECT request/accept/reject, ACK,
//!   SEND, WRITE, WRITE with immediate, NAK, CLOSE) captured from a real exchange between
//!   two in-memory endpoints, plus one synthesized packet for every opcode the parser
//!   knows (RoCEv2 RC/UD/CNP and MetaRoCE).
//! * `endpoint_datagrams`, `pair_impaired`: a few deterministic pseudo-random inputs that
//!   decode into rich schedules.
//!
//! `cargo run --example gen_corpus [-- <fuzz dir>]` (default: this crate's directory).
//! The soft-RoCE packets of the testbed pcap are added by `tools/pcap_to_corpus.py`.

use bytes::Bytes;
use metaroce::wire::{self, icrc, Opcode, Packet};
use metaroce::{Access, AtomicOp, AtomicRequest, Endpoint, Event, ReadRequest, WriteRequest};
use metaroce_fuzz::util::{self, addr_of, ip_of};
use metaroce_fuzz::{aead_open, decode, endpoint_datagrams, pair_impaired};
use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// SHA-1 (FIPS 180-4), for libFuzzer-style file names.
fn sha1_hex(data: &[u8]) -> String {
    let mut h: [u32; 5] = [
        0x6745_2301,
        0xEFCD_AB89,
        0x98BA_DCFE,
        0x1032_5476,
        0xC3D2_E1F0,
    ];
    let mut msg = data.to_vec();
    let bits = (data.len() as u64).wrapping_mul(8);
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&bits.to_be_bytes());
    for block in msg.chunks_exact(64) {
        let mut w = [0u32; 80];
        for (i, word) in block.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
        }
        for i in 16..80 {
            w[i] = (w[i - 3] ^ w[i - 8] ^ w[i - 14] ^ w[i - 16]).rotate_left(1);
        }
        let [mut a, mut b, mut c, mut d, mut e] = h;
        for (i, &wi) in w.iter().enumerate() {
            let (f, k) = match i / 20 {
                0 => ((b & c) | (!b & d), 0x5A82_7999),
                1 => (b ^ c ^ d, 0x6ED9_EBA1),
                2 => ((b & c) | (b & d) | (c & d), 0x8F1B_BCDC),
                _ => (b ^ c ^ d, 0xCA62_C1D6),
            };
            let t = a
                .rotate_left(5)
                .wrapping_add(f)
                .wrapping_add(e)
                .wrapping_add(k)
                .wrapping_add(wi);
            e = d;
            d = c;
            c = b.rotate_left(30);
            b = a;
            a = t;
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d, e]) {
            *x = x.wrapping_add(y);
        }
    }
    h.iter().map(|x| format!("{x:08x}")).collect()
}

fn write_all(dir: &Path, inputs: &[Vec<u8>]) -> usize {
    std::fs::create_dir_all(dir).expect("create corpus dir");
    let mut n = 0;
    for d in inputs {
        let p = dir.join(sha1_hex(d));
        if !p.exists() {
            std::fs::write(&p, d).expect("write corpus file");
            n += 1;
        }
    }
    n
}

/// Three endpoints in memory, FIFO delivery, virtual clock; every datagram is kept.
struct Net {
    eps: Vec<Endpoint>,
    now: Instant,
    queue: VecDeque<(usize, SocketAddr, Vec<u8>)>,
    captured: Vec<Vec<u8>>,
    events: Vec<Vec<Event>>,
}

impl Net {
    fn run(&mut self, dur: Duration) {
        let end = self.now + dur;
        let mut buf = Vec::new();
        loop {
            for i in 0..self.eps.len() {
                while let Some(t) = self.eps[i].poll_transmit(self.now, &mut buf) {
                    for seg in util::segments(&t, &buf) {
                        self.captured.push(seg.to_vec());
                        if let Some(to) = (0..3).find(|&j| addr_of(j) == t.destination) {
                            let from = SocketAddr::new(ip_of(i), t.src_port);
                            self.queue.push_back((to, from, seg.to_vec()));
                        }
                    }
                }
                while let Some(e) = self.eps[i].poll_event() {
                    self.events[i].push(e);
                }
            }
            if let Some((to, from, d)) = self.queue.pop_front() {
                self.eps[to].handle_datagram(self.now, from, Some(ip_of(to)), None, &d);
                continue;
            }
            let Some(t) = self.eps.iter().filter_map(Endpoint::poll_timeout).min() else {
                break;
            };
            if t > end {
                break;
            }
            self.now = self.now.max(t);
            for ep in &mut self.eps {
                if ep.poll_timeout().is_some_and(|x| x <= self.now) {
                    ep.handle_timeout(self.now);
                }
            }
        }
    }
}

/// Datagrams of a real exchange covering every MetaRoCE packet kind.
fn genuine_packets() -> Vec<Vec<u8>> {
    let mut refuse = util::config(2, 3);
    refuse.accept_incoming = false;
    let mut net = Net {
        eps: vec![
            Endpoint::new(util::config(0, 1)).expect("config"),
            Endpoint::new(util::config(1, 2)).expect("config"),
            Endpoint::new(refuse).expect("config"),
        ],
        now: Instant::now(),
        queue: VecDeque::new(),
        captured: Vec::new(),
        events: vec![Vec::new(), Vec::new(), Vec::new()],
    };
    let c = net.eps[0]
        .connect(net.now, addr_of(1), None)
        .expect("connect");
    net.run(Duration::from_secs(1));
    let s = net.events[1]
        .iter()
        .find_map(|e| match e {
            Event::Incoming(h) => Some(*h),
            _ => None,
        })
        .expect("accepted");
    let src = net.eps[0].register_mr(util::pattern(1, 8192), Access::LOCAL_WRITE);
    let dst = net.eps[1].register_mr(
        vec![0; 8192],
        Access(
            Access::LOCAL_WRITE.0
                | Access::REMOTE_WRITE.0
                | Access::REMOTE_READ.0
                | Access::REMOTE_ATOMIC.0,
        ),
    );
    for (i, len) in [0usize, 5, 100, 3000].into_iter().enumerate() {
        let data = Bytes::from(util::pattern(i as u64, len));
        net.eps[0]
            .post_send(c, i as u32 % 2, i as u64, data)
            .expect("send");
    }
    net.eps[1]
        .post_send(s, 0, 9, Bytes::from_static(b"reply"))
        .expect("send");
    let write = |wr_id, len: u32, off: u64, imm, rkey| WriteRequest {
        wr_id,
        lkey: src.lkey,
        local_offset: off,
        len,
        remote_addr: dst.addr + off,
        rkey,
        imm,
    };
    for req in [
        write(10, 2000, 0, None, dst.rkey),
        write(11, 500, 4096, Some(0xABCD), dst.rkey),
        write(12, 64, 0, None, dst.rkey ^ 0x100), // refused: NAK
    ] {
        net.eps[0].post_write(c, req).expect("write");
    }
    net.run(Duration::from_secs(1));
    let land = net.eps[0].register_mr(vec![0; 8192], Access::LOCAL_WRITE);
    let read = ReadRequest {
        wr_id: 20,
        lkey: land.lkey,
        local_offset: 0,
        len: 1500,
        remote_addr: dst.addr,
        rkey: dst.rkey,
    };
    net.eps[0].post_read(c, read).expect("read");
    for (i, op) in [
        AtomicOp::FetchAdd { add: 5 },
        AtomicOp::CompareSwap {
            compare: 5,
            swap: 7,
        },
    ]
    .into_iter()
    .enumerate()
    {
        let req = AtomicRequest {
            wr_id: 21 + i as u64,
            lkey: land.lkey,
            local_offset: 4096,
            remote_addr: dst.addr + 8,
            rkey: dst.rkey,
            op,
        };
        net.eps[0].post_atomic(c, req).expect("atomic");
    }
    net.run(Duration::from_secs(1));
    net.eps[0].close(net.now, c);
    net.run(Duration::from_millis(10));
    let _ = net.eps[0].connect(net.now, addr_of(2), None); // rejected
    net.run(Duration::from_millis(10));
    // Up to 4 distinct packets per (opcode, length).
    let mut by_kind: BTreeMap<(u8, usize), Vec<Vec<u8>>> = BTreeMap::new();
    for p in net.captured {
        let v = by_kind.entry((p[0], p.len())).or_default();
        if v.len() < 4 && !v.contains(&p) {
            v.push(p);
        }
    }
    let mut ops: Vec<u8> = by_kind.keys().map(|k| k.0).collect();
    ops.dedup();
    eprintln!(
        "captured opcodes: {:?}",
        ops.iter().map(|&o| Opcode(o).name()).collect::<Vec<_>>()
    );
    by_kind.into_values().flatten().collect()
}

/// One packet for every opcode the parser knows, built from patterned header bytes.
fn synthesized_packets() -> Vec<Vec<u8>> {
    let ip = icrc::IpHeader::synthesized(ip_of(0), ip_of(1)).expect("v4");
    let mut out = Vec::new();
    for op in 0..=255u8 {
        let Ok(hdr) = wire::header_len(Opcode(op)) else {
            continue;
        };
        for payload in [0usize, 13] {
            let mut p = util::pattern(u64::from(op), hdr + payload);
            p[0] = op;
            p[1] = 0; // TVer 0, pad fixed below
            if let Some(b) = p.get_mut(wire::BTH_LEN) {
                *b = 1 + *b % 3; // a valid ConnectEth kind, harmless elsewhere
            }
            let pad = wire::pad_for(payload);
            p[1] = (pad as u8) << 4;
            p.resize(p.len() + pad + wire::ICRC_LEN, 0);
            let Ok(pkt) = Packet::parse(&p) else {
                eprintln!("opcode {op:#04x}: synthesized packet does not parse");
                continue;
            };
            // Canonical form, with a valid ICRC.
            let t = pkt.trailer;
            let mut q = vec![0u8; wire::packet_len_with(&pkt.headers, pkt.payload.len(), &t)];
            let n = wire::emit_packet_with(&pkt.bth, &pkt.headers, pkt.payload, &t, &mut q)
                .expect("emit");
            q.truncate(n);
            icrc::stamp(&ip, 0xC000, wire::ROCEV2_UDP_PORT, &mut q).expect("stamp");
            out.push(q);
        }
    }
    out
}

/// Pseudo-random inputs that decode into the richest schedules.
fn structured_seeds<T>(count: usize, score: impl Fn(&T) -> usize) -> Vec<Vec<u8>>
where
    T: for<'a> arbitrary::Arbitrary<'a>,
{
    let mut cands: Vec<(usize, Vec<u8>)> = (0..400u64)
        .map(|i| util::pattern(0xF022 + i, 128 + (i as usize * 37) % 1500))
        .filter_map(|d| decode::<T>(&d).map(|t| (score(&t), d.clone())))
        .collect();
    cands.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.len().cmp(&b.1.len())));
    cands.into_iter().take(count).map(|c| c.1).collect()
}

fn main() {
    let dir = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    let corpus = dir.join("corpus");

    let mut wire_inputs = genuine_packets();
    wire_inputs.extend(synthesized_packets());
    let n = write_all(&corpus.join("wire_parse"), &wire_inputs);
    eprintln!("wire_parse: {n} new of {}", wire_inputs.len());

    let ep = structured_seeds::<endpoint_datagrams::Input>(8, |i| {
        use endpoint_datagrams::Action as A;
        let kinds: std::collections::BTreeSet<_> = i
            .after
            .iter()
            .take(64)
            .map(|a| match a {
                A::Forge { .. } => 0,
                A::Mutate { .. } => 1,
                A::Deliver { .. } => 2,
                A::PeerSend { .. } | A::PeerWrite { .. } => 3,
                A::TargetSend { .. } | A::TargetWrite { .. } => 4,
                A::Advance { .. } => 5,
                _ => 6,
            })
            .collect();
        kinds.len() * 100 + i.after.len().min(64)
    });
    let n = write_all(&corpus.join("endpoint_datagrams"), &ep);
    eprintln!("endpoint_datagrams: {n} new of {}", ep.len());

    let pair = structured_seeds::<pair_impaired::Input>(8, |i| {
        let ops = i.ops.len().min(24);
        let phases = i.phases.len().min(8);
        ops.min(10) * 10 + phases.min(4)
    });
    let n = write_all(&corpus.join("pair_impaired"), &pair);
    eprintln!("pair_impaired: {n} new of {}", pair.len());

    let aead = structured_seeds::<aead_open::Input>(8, |i| {
        use aead_open::{Direct as D, WireStep as W};
        let d: std::collections::BTreeSet<_> = i
            .direct
            .iter()
            .take(64)
            .map(|a| match a {
                D::Seal(_) => 0,
                D::Genuine(_) => 1,
                D::Mutate(..) | D::Truncate(..) | D::Word(..) => 2,
                D::KeyUpdate | D::Reply => 3,
                D::Raw(_) => 4,
            })
            .collect();
        let w: std::collections::BTreeSet<_> = i
            .wire
            .iter()
            .take(64)
            .map(|a| match a {
                W::Send(_) => 0,
                W::Mutate(..) | W::Replay(_) => 1,
                W::Run(_) => 2,
                W::KeyUpdate(_) => 3,
                W::Raw(_) => 4,
            })
            .collect();
        (d.len() + w.len()) * 100 + i.wire.len().min(64)
    });
    let n = write_all(&corpus.join("aead_open"), &aead);
    eprintln!("aead_open: {n} new of {}", aead.len());

    // Self-check of the hash against a known vector.
    assert_eq!(sha1_hex(b"abc"), "a9993e364706816aba3e25717850c26c9cd0d89d");
}
