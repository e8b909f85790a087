//! RoCEv2 RC mode (qp.rs, host.rs) against forged, mutated and replayed packets with a
//! valid ICRC from the peer's address, and the edges a review found (2026-12-07): a QP
//! serving a long READ must still send its own requests, a stale lkey must not find a later
//! region, a READ must fit the PSN space, and stand-alone endpoints take keys from their
//! seed.

use metaroce::rocev2::{RecvWr, SendOp, SendWr};
use metaroce::testing::rc::*;
use metaroce::wire::{Opcode, Packet};
use metaroce::{Access, WcStatus};
use rand_core::{RngCore, SeedableRng};
use std::time::Duration;

fn wr(wr_id: u64, op: SendOp, lkey: u32, off: u64, len: u32) -> SendWr {
    SendWr {
        wr_id,
        op,
        lkey,
        local_offset: off,
        len,
        solicited: false,
    }
}

/// Mixed traffic in both directions with a fraction of packets mutated (random bytes in
/// the BTH and extension headers, opcode, length) and re-stamped with a valid ICRC, i.e.
/// what an on-path attacker or a buggy peer can send. Nothing may panic and nothing may be
/// written into a region that grants no remote access.
#[test]
fn mutated_packets_with_valid_icrc_never_panic() {
    let mut summary = std::collections::BTreeMap::new();
    for seed in 0..3000u64 {
        let mut n = Net::new(
            256,
            Some((seed as u32).wrapping_mul(0x9E37) & 0xFF_FFFF),
            None,
        );
        let src = n.a.register_mr(pattern(1, 8192), Access::LOCAL_WRITE);
        let res = n.a.register_mr(vec![0; 8192], Access::LOCAL_WRITE);
        let guard_a = n.a.register_mr(vec![0xAA; 4096], Access::LOCAL_WRITE);
        let tgt = n.b.register_mr(
            pattern(2, 8192),
            Access::LOCAL_WRITE
                | Access::REMOTE_WRITE
                | Access::REMOTE_READ
                | Access::REMOTE_ATOMIC,
        );
        let guard_b = n.b.register_mr(vec![0xBB; 4096], Access::LOCAL_WRITE);
        let rbuf = n.b.register_mr(vec![0; 8192], Access::LOCAL_WRITE);
        for i in 0..4 {
            n.b.post_recv(
                n.qb,
                RecvWr {
                    wr_id: 100 + i,
                    lkey: rbuf.lkey,
                    offset: i * 2048,
                    len: 2048,
                },
            )
            .unwrap();
        }
        let ops = [
            wr(1, SendOp::Send { imm: None }, src.lkey, 0, 1000),
            wr(
                2,
                SendOp::Write {
                    remote_addr: tgt.addr,
                    rkey: tgt.rkey,
                    imm: Some(7),
                },
                src.lkey,
                0,
                1500,
            ),
            wr(
                3,
                SendOp::Read {
                    remote_addr: tgt.addr + 2048,
                    rkey: tgt.rkey,
                },
                res.lkey,
                0,
                1300,
            ),
            wr(
                4,
                SendOp::FetchAdd {
                    remote_addr: tgt.addr + 4096,
                    rkey: tgt.rkey,
                    add: 1,
                },
                res.lkey,
                4096,
                8,
            ),
            wr(
                5,
                SendOp::CompareSwap {
                    remote_addr: tgt.addr + 4104,
                    rkey: tgt.rkey,
                    compare: 0,
                    swap: 9,
                },
                res.lkey,
                4104,
                8,
            ),
            wr(6, SendOp::Send { imm: Some(1) }, src.lkey, 0, 600),
        ];
        for w in ops {
            n.a.post_send(n.qa, w).unwrap();
        }
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
        n.run(
            Duration::from_secs(5),
            &mut |s| {
                let r = rng.next_u32();
                if r % 4 != 0 {
                    return false;
                }
                let mut udp = s.ip_packet[28..].to_vec();
                let body = udp.len() - 4;
                match (r >> 2) % 5 {
                    0 => {
                        // 1..3 random bytes of the headers (BTH + ext) changed.
                        for _ in 0..1 + (r >> 8) % 3 {
                            let at = rng.next_u32() as usize % body.min(44);
                            udp[at] ^= (rng.next_u32() % 255 + 1) as u8;
                        }
                    }
                    1 => {
                        // Another RC opcode, same bytes.
                        udp[0] = (rng.next_u32() % 0x15) as u8;
                    }
                    2 => {
                        // PSN moved a little.
                        let d = (rng.next_u32() % 9) as i32 - 4;
                        let psn = u32::from_be_bytes([0, udp[9], udp[10], udp[11]]);
                        let p = (psn as i32 + d) as u32 & 0xFF_FFFF;
                        udp[9..12].copy_from_slice(&p.to_be_bytes()[1..]);
                    }
                    3 => {
                        // Length changed by a multiple of 4.
                        let d = 4 * (1 + (rng.next_u32() % 64) as usize);
                        if r & (1 << 30) != 0 && udp.len() > d + 16 {
                            udp.drain(body - d..body);
                        } else {
                            let extra: Vec<u8> = (0..d).map(|i| i as u8).collect();
                            udp.splice(body..body, extra);
                        }
                    }
                    _ => {
                        // Pad count changed.
                        udp[1] = (udp[1] & !0x30) | (((rng.next_u32() % 4) as u8) << 4);
                    }
                }
                s.ip_packet = restamp(&s.ip_packet, udp).unwrap();
                false
            },
            &|_| false,
        );
        assert_eq!(
            n.a.mr_read(guard_a.lkey, 0, 4096).unwrap(),
            vec![0xAA; 4096],
            "seed {seed}"
        );
        assert_eq!(
            n.b.mr_read(guard_b.lkey, 0, 4096).unwrap(),
            vec![0xBB; 4096],
            "seed {seed}"
        );
        // Every send WR completed (with some status): nothing hangs.
        assert_eq!(
            n.completions_a().len(),
            6,
            "seed {seed}: {:?}",
            n.completions_a()
        );
        for c in n.completions_a() {
            *summary.entry(format!("{:?}", c.status)).or_insert(0) += 1;
        }
    }
    eprintln!("{summary:?}");
}

/// A QP is both responder and requester. B READs a long region from A over a slow link
/// while A has one WRITE to B outstanding whose only packet was lost. A's READ responses
/// went before its own requests (`poll_packet`: responses first), so A's retransmission of
/// the WRITE waited behind the whole READ response stream, while each expiry of A's ACK
/// timer spent one unit of `retry_cnt` with nothing resent: the WRITE completed
/// `RetryExceeded` (QP to ERROR, and B's READ with it) with one copy ever sent (found by
/// review). Now READ response data and requests take turns, and an expiry with nothing
/// resent since the last go-back spends no retry.
#[test]
fn a_qp_serving_a_long_read_still_sends_its_own_requests() {
    let mut n = Net::new(1024, None, None); // ACK timeout 4.19 ms, retry_cnt 3
    const LEN: usize = 4 << 20; // 4096 READ response packets: ~86 ms at 400 Mbit/s
    let big =
        n.a.register_mr(pattern(3, LEN), Access::LOCAL_WRITE | Access::REMOTE_READ);
    let res = n.b.register_mr(vec![0; LEN], Access::LOCAL_WRITE);
    let src = n.a.register_mr(pattern(9, 64), Access::LOCAL_WRITE);
    let sink =
        n.b.register_mr(vec![0; 64], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    // B: READ of LEN bytes from A.
    n.b.post_send(
        n.qb,
        wr(
            1,
            SendOp::Read {
                remote_addr: big.addr,
                rkey: big.rkey,
            },
            res.lkey,
            0,
            LEN as u32,
        ),
    )
    .unwrap();
    // A: one small WRITE to B.
    n.a.post_send(
        n.qa,
        wr(
            2,
            SendOp::Write {
                remote_addr: sink.addr,
                rkey: sink.rkey,
                imm: None,
            },
            src.lkey,
            0,
            64,
        ),
    )
    .unwrap();
    let mut lost = false;
    n.run_link(
        Link {
            bits_per_sec: Some(400_000_000),
            one_way: Duration::from_micros(5),
            ..Link::default()
        },
        Duration::from_secs(10),
        // The WRITE's first transmission is lost (one packet, once).
        &mut |s| {
            if s.from_a && s.opcode == 0x0A && !lost {
                lost = true;
                return true;
            }
            false
        },
        &|n| !n.completions_a().is_empty() && !n.completions_b().is_empty(),
    );
    let ca = n.completions_a();
    let cb = n.completions_b();
    let st = n.a.qp_stats(n.qa).unwrap();
    let resent = n
        .wire
        .iter()
        .filter(|s| s.from_a && s.opcode == 0x0A)
        .count();
    // The resent WRITE went out between READ responses, not after all 4,096 of them.
    let (mut writes, mut before) = (0, 0);
    for s in n.wire.iter().filter(|s| s.from_a) {
        if s.opcode == 0x0A {
            writes += 1;
            if writes == 2 {
                break;
            }
        } else if (0x0D..=0x0F).contains(&s.opcode) {
            before += 1;
        }
    }
    eprintln!(
        "A: {ca:?}\nB: {cb:?}\nA stats: {st:?}\nWRITE packets sent by A: {resent}, READ \
         responses before the second: {before}"
    );
    assert!(
        before < 2048,
        "the resent WRITE waited behind {before} READ responses"
    );
    assert_eq!(ca.len(), 1);
    assert_eq!(
        ca[0].status,
        WcStatus::Success,
        "A's WRITE failed after {} timeouts with {} copies of it ever sent",
        st.timeouts,
        resent
    );
}

/// An ACK timer that expires while the requests a go-back rewound are still unsent (held
/// by this QP's READ responses or its rate limiter) times no response to anything: it
/// spends no retry and is re-armed. Here A's WRITE is sent once and lost; the first expiry
/// goes back (one retry); A then sends nothing while the timer expires five more times
/// (`retry_cnt` is 3): no `RetryExceeded`, and the WRITE is the next packet out.
#[test]
fn timer_expiries_with_nothing_resent_spend_no_retry() {
    let mut n = Net::new(1024, None, None);
    let src = n.a.register_mr(pattern(9, 64), Access::LOCAL_WRITE);
    let sink =
        n.b.register_mr(vec![0; 64], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let w = SendOp::Write {
        remote_addr: sink.addr,
        rkey: sink.rkey,
        imm: None,
    };
    n.a.post_send(n.qa, wr(2, w, src.lkey, 0, 64)).unwrap();
    let mut buf = Vec::new();
    assert!(
        n.a.poll_transmit(n.now, &mut buf).is_some(),
        "the WRITE, lost"
    );
    for _ in 0..6 {
        n.now += Duration::from_millis(50);
        n.a.handle_timeout(n.now);
    }
    let st = n.a.qp_stats(n.qa).unwrap();
    assert!(n.completions_a().is_empty(), "{:?}", n.completions_a());
    assert_eq!(st.timeouts, 1, "{st:?}");
    let t = n.a.poll_transmit(n.now, &mut buf).expect("the WRITE again");
    let p = Packet::parse(&buf[..t.size]).unwrap();
    assert_eq!(p.bth.opcode, Opcode::RC_RDMA_WRITE_ONLY);
}

/// IBA allows a 2^31-byte READ; at PMTU 256 it takes 2^23 PSNs, half the PSN space: its
/// own first response (PSN = high_psn - 2^23) then compared as a PSN never sent and was
/// dropped, and a retry of it compared as ahead at the responder, so it never completed
/// (found by review). Such a READ is refused at post; the longest one that fits (2^23 -
/// 129 packets with `max_unacked_psns` 128) is accepted and its first response lands.
/// The regions are calloc'ed and touched only at their start.
#[test]
fn a_read_must_fit_half_the_psn_space() {
    let mut n = Net::new(256, None, None);
    const LEN: usize = 1 << 31;
    let tgt =
        n.b.register_mr(vec![0; LEN], Access::LOCAL_WRITE | Access::REMOTE_READ);
    n.b.mr_write(tgt.lkey, 0, &pattern(5, 256)).unwrap();
    let res = n.a.register_mr(vec![0; LEN], Access::LOCAL_WRITE);
    let read = |len: u32| {
        wr(
            1,
            SendOp::Read {
                remote_addr: tgt.addr,
                rkey: tgt.rkey,
            },
            res.lkey,
            0,
            len,
        )
    };
    assert!(matches!(
        n.a.post_send(n.qa, read(1 << 31)),
        Err(metaroce::rocev2::RcError::Invalid(_))
    ));
    let longest = ((1u32 << 23) - 129) * 256;
    n.a.post_send(n.qa, read(longest)).unwrap();
    // Step by hand: the READ request to B, B's first response (FIRST, 256 bytes) to A.
    let mut buf = Vec::new();
    let t = n.a.poll_transmit(n.now, &mut buf).unwrap();
    let mut req = Vec::new();
    t.write_ip_packet(&buf[..t.size], &mut req).unwrap();
    n.b.handle_ip_packet(n.now, &req);
    let t = n.b.poll_transmit(n.now, &mut buf).unwrap();
    let mut first = Vec::new();
    t.write_ip_packet(&buf[..t.size], &mut first).unwrap();
    let p = Packet::parse(&first[28..]).unwrap();
    assert_eq!(p.bth.opcode, Opcode::RC_RDMA_READ_RESPONSE_FIRST);
    n.a.handle_ip_packet(n.now, &first);
    assert!(
        n.a.mr_read(res.lkey, 0, 256).unwrap() == pattern(5, 256),
        "the READ's first response (PSN {:#x}) was dropped by the requester",
        p.bth.psn
    );
}

/// A stand-alone RC endpoint's rkeys and region addresses come from its seed: with
/// `RcConfig::new`'s fixed key seed every endpoint handed out the same first rkey and
/// address (and, with the fixed seed, the same QPN and PSN: metaroce-tokio replaces that
/// seed with one from the OS, see its `rocev2` tests). Equal seeds still give equal keys
/// (the core is deterministic).
#[test]
fn stand_alone_rc_keys_follow_the_seed() {
    use metaroce::rocev2::{QpInit, RcConfig, RcEndpoint};
    let ep = |ip: &str, seed: u64| {
        let mut c = RcConfig::new(ip.parse().unwrap());
        c.seed = seed;
        let mut e = RcEndpoint::new(c).unwrap();
        let q = e.create_qp(QpInit::default()).unwrap();
        let m = e.register_mr(vec![0; 4096], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        (q.qpn, q.psn, m.rkey, m.addr)
    };
    let (x, y) = (ep("10.1.1.1", 1), ep("192.168.7.9", 2));
    assert!(
        x.0 != y.0 && x.1 != y.1 && x.2 != y.2 && x.3 != y.3,
        "{x:x?} {y:x?}"
    );
    assert_eq!(ep("10.1.1.1", 1), x);
}

/// A region deregistered while a receive WR still names its lkey: the SEND that arrives
/// must not land in a region registered later. With lkeys of slot index and an 8-bit
/// generation, the 256th registration of the freed slot got the old lkey and the SEND
/// landed there, completing `Success` (found by review). lkeys are not reissued now: the
/// receive fails instead.
#[test]
fn a_stale_lkey_of_a_posted_receive_never_reaches_a_later_region() {
    let mut n = Net::new(1024, None, None);
    let src = n.a.register_mr(pattern(4, 64), Access::LOCAL_WRITE);
    let old = n.b.register_mr(vec![0; 64], Access::LOCAL_WRITE);
    n.b.post_recv(
        n.qb,
        RecvWr {
            wr_id: 1,
            lkey: old.lkey,
            offset: 0,
            len: 64,
        },
    )
    .unwrap();
    n.b.deregister_mr(old.lkey).unwrap();
    // Registrations that reuse the freed slot; one that got the old lkey is kept.
    let mut other = None;
    for _ in 0..300 {
        let k = n.b.register_mr(vec![0x11; 64], Access::LOCAL_WRITE);
        if k.lkey == old.lkey {
            other = Some(k);
            break;
        }
        n.b.deregister_mr(k.lkey).unwrap();
    }
    let other = other.unwrap_or_else(|| n.b.register_mr(vec![0x11; 64], Access::LOCAL_WRITE));
    n.a.post_send(n.qa, send(9, src.lkey, 0, 64, None)).unwrap();
    n.run_all();
    let cb = n.completions_b();
    eprintln!("B: {cb:?}\nA: {:?}", n.completions_a());
    assert!(cb.iter().all(|c| c.status != WcStatus::Success), "{cb:?}");
    assert!(n
        .completions_a()
        .iter()
        .all(|c| c.status != WcStatus::Success));
    assert!(
        n.b.mr_read(other.lkey, 0, 64).unwrap() != pattern(4, 64),
        "the SEND landed in a region that was never posted as a receive buffer ({:?})",
        cb
    );
}
