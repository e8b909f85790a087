//! Adversary tests for issue #9 item 3: no header field moves state before the packet is
//! known to be in window and consistent (floor PSN, ACK/SACK, timestamps, operation ids),
//! RTT samples only from ACKs that newly acknowledge something, and Success only for the
//! very operation the responder executed.
//!
//! Sans-IO, virtual time. Every forged packet is built by mutating a *captured genuine
//! datagram of the connection* (taken off the in-memory wire), changing fields with the
//! wire writers and recomputing the ICRC with `wire::icrc`: the forger models an attacker
//! who has seen the connection's packets (so it knows the QPN, the PSNs and any
//! per-connection token the packets carry) and injects from the peer's address.

use metaroce::testing::Sent;
use metaroce::wire::{icrc, AckEth, Bth, Headers, Packet};
use metaroce::{
    Access, ConnectionHandle, EndpointConfig, Event, MrKeys, ReadRequest, WcOpcode, WcStatus,
    WorkCompletion, WriteRequest,
};
use std::net::SocketAddr;
use std::time::Duration;

// =======================================================================================
// The test network: `metaroce::testing::Net` recording what it carries (bounded), with a
// drop hook; the test injects with `Net::inject_raw`.

type Net = metaroce::testing::Net;

fn config(i: usize) -> EndpointConfig {
    let ip = format!("10.0.0.{}", i + 1);
    let mut c = EndpointConfig::new(
        format!("{ip}:4791").parse().unwrap(),
        (0..8).map(|k| 0xC000 + k + 16 * i as u16).collect(),
    );
    c.seed = 0x5EC0_0000 + i as u64;
    c.transport.max_gso_segments = 4;
    c.transport.pmtu = 1024;
    c.transport.paths = 4;
    c
}

fn new_net() -> Net {
    net_with(config(0), config(1))
}

fn net_with(a: EndpointConfig, b: EndpointConfig) -> Net {
    let mut n = Net::with_configs(0, a, b);
    n.record = 200_000;
    n
}

/// Run until `done` holds or `limit` of virtual time from now passed.
fn run_within(net: &mut Net, limit: Duration, done: impl FnMut(&Net) -> bool) -> bool {
    let limit = net.elapsed() + limit;
    net.run_until(limit, done)
}

/// Every completion on endpoint `i`.
fn completions(net: &Net, i: usize) -> Vec<WorkCompletion> {
    net.events[i]
        .iter()
        .filter_map(|e| match e {
            Event::Completion { wc, .. } => Some(*wc),
            _ => None,
        })
        .collect()
}

/// Mutate a captured datagram in place: `f` changes the BTH and the extension headers,
/// which are written back with the wire writers over the original bytes (so the payload,
/// the pad and anything after it stay as they were), then the ICRC is recomputed.
fn forge(
    seen: &Sent,
    to: SocketAddr,
    f: impl FnOnce(&mut Bth, &mut Headers, &mut [u8]),
) -> Vec<u8> {
    let mut data = seen.data.clone();
    let (mut bth, mut hdrs, payload_at, payload_len) = {
        let p = Packet::parse(&data).unwrap();
        let at = 12 + p.headers.len();
        (p.bth, p.headers, at, p.payload.len())
    };
    f(
        &mut bth,
        &mut hdrs,
        &mut data[payload_at..payload_at + payload_len],
    );
    // `Bth::emit` writes BTH byte 8 bits 1:0 (the trailer kind) as 0: keep the captured
    // packet's trailer kind so its trailer (the connection's token) still parses.
    let trailer_kind = data[8] & 0x03;
    bth.emit(&mut data[..12]).unwrap();
    data[8] |= trailer_kind;
    hdrs.emit(&mut data[12..]).unwrap();
    let ip = icrc::IpHeader::synthesized(seen.from.ip(), to.ip()).unwrap();
    icrc::stamp(&ip, seen.from.port(), to.port(), &mut data).unwrap();
    data
}

fn srtts(net: &Net, i: usize, c: ConnectionHandle) -> Vec<Duration> {
    net.eps[i]
        .connection_stats(c)
        .unwrap()
        .paths
        .iter()
        .map(|p| p.srtt)
        .collect()
}

fn write_req(wr_id: u64, src: &MrKeys, dst: &MrKeys, off: u64, len: u32) -> WriteRequest {
    WriteRequest {
        wr_id,
        lkey: src.lkey,
        local_offset: off,
        len,
        remote_addr: dst.addr + off,
        rkey: dst.rkey,
        imm: None,
    }
}

/// A client region filled with a pattern and a zeroed server region.
fn regions(net: &mut Net, len: usize) -> (MrKeys, MrKeys) {
    let data = pattern(len);
    let src = net.eps[0].register_mr(data, Access::LOCAL_WRITE);
    let dst = net.eps[1].register_mr(
        vec![0; len],
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    );
    (src, dst)
}

fn pattern(len: usize) -> Vec<u8> {
    metaroce::testing::pattern(7, len)
}

fn data_psn(p: &Packet<'_>) -> Option<(u8, u32)> {
    match &p.headers {
        Headers::Write { path, .. }
        | Headers::Send { path, .. }
        | Headers::ReadRequest { path, .. }
        | Headers::ReadResponse { path, .. }
        | Headers::Atomic { path, .. }
        | Headers::AtomicResponse { path, .. } => Some((path.path_id, p.bth.psn)),
        _ => None,
    }
}

// =======================================================================================
// 1. Floor PSN

/// The case: one forged packet whose own PSN is out of window but whose floor is
/// ahead. Before the fix its floor was applied before its PSN was checked: the next real
/// packets of the path were counted as duplicates (never placed, yet acknowledged) and the
/// path went through RTOs and re-rolls. After: the packet is dropped and counted, nothing
/// changes.
#[test]
fn forged_floor_out_of_window_moves_nothing() {
    let mut net = new_net();
    let (c, s) = net.connect();
    let (src, dst) = regions(&mut net, 256 * 1024);
    net.eps[0]
        .post_write(c, write_req(1, &src, &dst, 0, 64 * 1024))
        .unwrap();
    run_within(&mut net, Duration::from_secs(1), |n| {
        !completions(n, 0).is_empty()
    });
    assert_eq!(completions(&net, 0)[0].status, WcStatus::Success);
    // A genuine WRITE packet of path 0, captured.
    let g = net
        .last_sent(0, |p| data_psn(p).is_some_and(|(id, _)| id == 0))
        .unwrap();
    let (_, last_psn) = data_psn(&Packet::parse(&g.data).unwrap()).unwrap();
    let dup_before = net.eps[1].connection_stats(s).unwrap().duplicate_packets;
    // Own PSN far out of window, floor 100 PSNs ahead of the receiver's window.
    let forged = forge(&g, net.addrs[1], |bth, h, _| {
        bth.psn = (last_psn + 5000) & 0xFF_FFFF;
        if let Headers::Write { path, .. } = h {
            path.floor_psn = (last_psn + 101) & 0xFF_FFFF;
        }
    });
    net.inject_raw(1, g.from, forged, Duration::ZERO);
    // A second forgery: own PSN in window, floor ahead of its own PSN.
    let forged2 = forge(&g, net.addrs[1], |bth, h, _| {
        bth.psn = (last_psn + 2) & 0xFF_FFFF;
        if let Headers::Write { path, .. } = h {
            path.floor_psn = (last_psn + 120) & 0xFF_FFFF;
        }
    });
    net.inject_raw(1, g.from, forged2, Duration::from_micros(1));
    net.run_for(Duration::from_millis(1));
    // 40+ real packets on every path.
    net.eps[0]
        .post_write(c, write_req(2, &src, &dst, 64 * 1024, 192 * 1024))
        .unwrap();
    run_within(&mut net, Duration::from_secs(5), |n| {
        completions(n, 0).len() == 2
    });
    let wcs = completions(&net, 0);
    assert_eq!(wcs.len(), 2, "{wcs:?}");
    assert_eq!(wcs[1].status, WcStatus::Success);
    assert!(
        net.eps[1].mr_read(dst.lkey, 0, 256 * 1024).unwrap() == pattern(256 * 1024)[..],
        "bytes acknowledged but not placed"
    );
    let cs = net.eps[0].connection_stats(c).unwrap();
    let ss = net.eps[1].connection_stats(s).unwrap();
    println!(
        "receiver: dup {} oow {} bad_floor {}",
        ss.duplicate_packets, ss.out_of_window_packets, ss.bad_floor_packets
    );
    assert_eq!(
        ss.duplicate_packets, dup_before,
        "real packets taken as duplicates"
    );
    assert_eq!(
        (ss.out_of_window_packets, ss.bad_floor_packets),
        (1, 1),
        "{ss:?}"
    );
    for p in &cs.paths {
        assert_eq!(
            (p.stats.rtos, p.stats.rerolls, p.stats.retransmits),
            (0, 0, 0),
            "path {} disturbed: {:?}",
            p.id,
            p.stats
        );
    }
}

// =======================================================================================
// 2. ACK / SACK validation, 3. RTT samples

fn is_ack(p: &Packet<'_>) -> bool {
    matches!(p.headers, Headers::Ack(_))
}

/// Highest PSN endpoint `ep` sent on path `path_id` so far (from the capture).
fn last_sent_psn(net: &Net, ep: usize, path_id: u8) -> u32 {
    let g = net
        .last_sent(ep, |p| data_psn(p).is_some_and(|(id, _)| id == path_id))
        .unwrap();
    data_psn(&Packet::parse(&g.data).unwrap()).unwrap().1
}

/// A forged ACK whose cumulative PSN acknowledges PSNs the path never sent is dropped and
/// counted: it completes nothing, moves no window and takes no RTT sample (before the fix
/// the RTT sample was taken before the check: a stale echoed timestamp raised SRTT by the
/// age of the captured ACK). SACK bits for PSNs never sent are ignored and counted.
#[test]
fn forged_ack_for_unsent_psns_is_dropped() {
    let mut net = new_net();
    let (c, _s) = net.connect();
    let (src, dst) = regions(&mut net, 128 * 1024);
    net.eps[0]
        .post_write(c, write_req(1, &src, &dst, 0, 64 * 1024))
        .unwrap();
    run_within(&mut net, Duration::from_secs(1), |n| {
        !completions(n, 0).is_empty()
    });
    let ack = net
        .last_sent(
            1,
            |p| matches!(&p.headers, Headers::Ack(a) if a.path_id == 0),
        )
        .unwrap();
    let srtt0 = srtts(&net, 0, c);
    // Let time pass, so that the captured ACK's echoed timestamp is 20 ms old.
    net.run_for(Duration::from_millis(20));
    // The server's ACKs are lost from now on: the client's next WRITE stays outstanding.
    net.drop_hook = Some(Box::new(|from, d| from == 1 && d[0] == 0xC1));
    net.eps[0]
        .post_write(c, write_req(2, &src, &dst, 64 * 1024, 16 * 1024))
        .unwrap();
    net.run_for(Duration::from_micros(15));
    let next = (last_sent_psn(&net, 0, 0) + 1) & 0xFF_FFFF;
    let acks_before = net.eps[0].connection_stats(c).unwrap().acks_received;
    // The captured ACK may be a bundle (docs/PROTOCOL.md "ACK bundles"): the forgeries
    // clear its BUNDLE flag, so only the AckEth under test is applied (the genuine blocks
    // of other paths would count as ACKs received).
    let unbundle = |h: &mut Headers| {
        if let Headers::Ack(a) = h {
            a.flags &= !AckEth::FLAG_BUNDLE;
        }
    };
    // (a) cumulative PSN beyond what was sent: acknowledges everything; and it grants the
    // smallest window and rate, which must not be taken from a dropped ACK either.
    let f1 = forge(&ack, net.addrs[0], |bth, h, _| {
        bth.psn = (next + 10) & 0xFF_FFFF;
        unbundle(h);
        if let Headers::Ack(a) = h {
            a.window_grant = 1;
            a.rate_hint = 1;
        }
    });
    // (b) cumulative PSN valid, a SACK bit for a PSN never sent.
    let f2 = forge(&ack, net.addrs[0], |bth, h, _| {
        bth.psn = (next + 0xFF_FFFF - 3) & 0xFF_FFFF;
        unbundle(h);
        if let Headers::Ack(a) = h {
            a.sack = [0; 32];
            a.sack_set(3 + 5);
        }
    });
    net.inject_raw(0, ack.from, f1, Duration::ZERO);
    net.step();
    let cs = net.eps[0].connection_stats(c).unwrap();
    assert_eq!(
        (cs.peer_window_grant, cs.peer_rate_hint_mbps),
        (0, 0),
        "a dropped ACK's grants were applied"
    );
    net.inject_raw(0, ack.from, f2, Duration::ZERO);
    net.step();
    net.flush();
    assert!(
        completions(&net, 0).len() == 1,
        "a forged ACK completed a WRITE: {:?}",
        completions(&net, 0)
    );
    let cs = net.eps[0].connection_stats(c).unwrap();
    assert_eq!(cs.paths[0].srtt, srtt0[0], "SRTT moved by a forged ACK");
    // (a) dropped whole; (b) processed without its SACK bit for a PSN never sent (its
    // cumulative PSN is one the path did send: an on-path attacker can always forge that).
    assert_eq!(
        cs.acks_received,
        acks_before + 1,
        "forged ACK (a) counted as an ACK"
    );
    assert_eq!((cs.bad_acks, cs.acks_ignoring_unsent), (1, 1), "{cs:?}");
    // The real ACKs come back: the WRITE completes and its bytes are there.
    net.drop_hook = None;
    run_within(&mut net, Duration::from_secs(5), |n| {
        completions(n, 0).len() == 2
    });
    assert_eq!(completions(&net, 0)[1].status, WcStatus::Success);
    assert!(
        net.eps[1].mr_read(dst.lkey, 0, 80 * 1024).unwrap() == pattern(80 * 1024)[..],
        "bytes differ"
    );
}

/// The case: a duplicate ACK that arrives 20 ms late must not raise SRTT (it
/// newly acknowledges nothing: RFC 6298 §3, Karn).
#[test]
fn late_duplicate_ack_takes_no_rtt_sample() {
    let mut net = new_net();
    let (c, _s) = net.connect();
    let (src, dst) = regions(&mut net, 64 * 1024);
    net.eps[0]
        .post_write(c, write_req(1, &src, &dst, 0, 64 * 1024))
        .unwrap();
    run_within(&mut net, Duration::from_secs(1), |n| {
        !completions(n, 0).is_empty()
    });
    net.run_for(Duration::from_millis(1));
    let before = srtts(&net, 0, c);
    let acks: Vec<Sent> = net
        .wire
        .iter()
        .filter(|s| s.from_ep == 1 && Packet::parse(&s.data).is_ok_and(|p| is_ack(&p)))
        .cloned()
        .collect();
    assert!(!acks.is_empty());
    for a in &acks {
        net.inject_raw(0, a.from, a.data.clone(), Duration::from_millis(20));
    }
    net.run_for(Duration::from_millis(25));
    let after = srtts(&net, 0, c);
    println!("SRTT before {before:?} after {after:?}");
    assert_eq!(before, after, "a duplicate ACK moved SRTT");
}

/// The case: a duplicate data packet with an old timestamp was echoed back and
/// raised the sender's SRTT by its age. Timestamps are echoed only for packets that
/// advanced the receiver's state; the sender ignores an echo older than the packets the
/// ACK newly acknowledges.
#[test]
fn replayed_data_packet_timestamp_is_not_echoed() {
    let mut net = new_net();
    let (c, s) = net.connect();
    let (src, dst) = regions(&mut net, 64 * 1024);
    net.eps[0]
        .post_write(c, write_req(1, &src, &dst, 0, 64 * 1024))
        .unwrap();
    run_within(&mut net, Duration::from_secs(1), |n| {
        !completions(n, 0).is_empty()
    });
    let before = srtts(&net, 0, c);
    let datas: Vec<Sent> = net
        .wire
        .iter()
        .filter(|s| s.from_ep == 0 && Packet::parse(&s.data).is_ok_and(|p| data_psn(&p).is_some()))
        .cloned()
        .collect();
    // Replayed 50 ms later, unchanged (any token they carry is still valid).
    for d in datas.iter().take(8) {
        net.inject_raw(1, d.from, d.data.clone(), Duration::from_millis(50));
    }
    net.run_for(Duration::from_millis(60));
    let after = srtts(&net, 0, c);
    println!("SRTT before {before:?} after {after:?}");
    assert_eq!(
        before, after,
        "a replayed data packet's timestamp moved SRTT"
    );
    // And the same with fresh traffic interleaved: samples stay near the real RTT.
    net.eps[0]
        .post_write(c, write_req(2, &src, &dst, 0, 64 * 1024))
        .unwrap();
    for d in datas.iter().take(8) {
        net.inject_raw(1, d.from, d.data.clone(), Duration::from_micros(5));
    }
    run_within(&mut net, Duration::from_secs(1), |n| {
        completions(n, 0).len() == 2
    });
    let later = srtts(&net, 0, c);
    println!("SRTT with replays during a transfer: {later:?}");
    for s in later {
        assert!(s < Duration::from_millis(5), "SRTT {s:?}");
    }
    assert!(
        net.eps[1].mr_read(dst.lkey, 0, 64 * 1024).unwrap() == pattern(64 * 1024)[..],
        "bytes differ"
    );
    let _ = s;
}

// =======================================================================================
// 5. Operation ids, 6. Success only for that very operation

fn write_pkt(p: &Packet<'_>) -> bool {
    matches!(p.headers, Headers::Write { .. })
}

/// The case: a forged WRITE that reuses the client's next operation id. Before the
/// fix the client's real WRITE with that id was acknowledged as a duplicate of the forged
/// one and reported Success, yet none of its bytes landed. Now the responder remembers
/// what it executed under each op id; the real WRITE's parameters differ, so it is refused
/// (NAK, counted) and the client reports an error status, never Success.
#[test]
fn op_id_collision_never_reports_success_without_delivery() {
    let mut net = new_net();
    let (c, s) = net.connect();
    let (src, dst) = regions(&mut net, 64 * 1024);
    // op id 0: a genuine one-packet WRITE, captured.
    net.eps[0]
        .post_write(c, write_req(1, &src, &dst, 0, 1024))
        .unwrap();
    run_within(&mut net, Duration::from_secs(1), |n| {
        !completions(n, 0).is_empty()
    });
    let g = net.last_sent(0, write_pkt).unwrap();
    let next_psn = (last_sent_psn(&net, 0, 0) + 1) & 0xFF_FFFF;
    // The forgery: op id 1 (the client's next), another address, 0xEE bytes, an in-window
    // PSN the client has not used yet.
    let forged = forge(&g, net.addrs[1], |bth, h, payload| {
        bth.psn = (next_psn + 50) & 0xFF_FFFF;
        if let Headers::Write {
            path, reth, write, ..
        } = h
        {
            path.path_id = 0;
            reth.va = dst.addr + 60 * 1024;
            write.op_id = 1;
        }
        payload.fill(0xEE);
    });
    net.inject_raw(1, g.from, forged, Duration::ZERO);
    net.run_for(Duration::from_micros(50));
    // The real op id 1: 4 KiB at offset 4096.
    net.eps[0]
        .post_write(c, write_req(2, &src, &dst, 4096, 4096))
        .unwrap();
    run_within(&mut net, Duration::from_secs(5), |n| {
        completions(n, 0).len() == 2
    });
    let wcs = completions(&net, 0);
    assert_eq!(wcs.len(), 2, "{wcs:?}");
    let landed = net.eps[1].mr_read(dst.lkey, 4096, 4096).unwrap() == pattern(8192)[4096..];
    let forged_bytes = net.eps[1]
        .mr_read(dst.lkey, 60 * 1024, 1024)
        .unwrap()
        .iter()
        .filter(|&&b| b == 0xEE)
        .count();
    println!(
        "real WRITE: {:?}, its bytes landed: {landed}; forged bytes in the region: {forged_bytes}",
        wcs[1].status
    );
    assert!(
        wcs[1].status != WcStatus::Success || landed,
        "Success without delivery: {:?}",
        wcs[1]
    );
    assert_ne!(wcs[1].status, WcStatus::Success);
    let ss = net.eps[1].connection_stats(s).unwrap();
    assert!(ss.recv.op_mismatches >= 1, "{:?}", ss.recv);
}

/// An op id far ahead of the responder's floor of finished operations is not executed:
/// the packet is dropped unacknowledged and counted (before the fix any op id ahead of the
/// floor was executed). 0 forged bytes land.
#[test]
fn op_id_far_ahead_of_the_floor_is_not_executed() {
    let mut a = config(0);
    let mut b = config(1);
    a.transport.max_tracked_ops = 1024;
    b.transport.max_tracked_ops = 1024;
    let mut net = net_with(a, b);
    let (c, s) = net.connect();
    let (src, dst) = regions(&mut net, 64 * 1024);
    net.eps[0]
        .post_write(c, write_req(1, &src, &dst, 0, 1024))
        .unwrap();
    run_within(&mut net, Duration::from_secs(1), |n| {
        !completions(n, 0).is_empty()
    });
    let g = net.last_sent(0, write_pkt).unwrap();
    let next_psn = (last_sent_psn(&net, 0, 0) + 1) & 0xFF_FFFF;
    for (k, id) in [5000u32, 1_000_000, 0x7FFF_FFFF].into_iter().enumerate() {
        let forged = forge(&g, net.addrs[1], |bth, h, payload| {
            bth.psn = (next_psn + 10 + k as u32) & 0xFF_FFFF;
            if let Headers::Write {
                path, reth, write, ..
            } = h
            {
                path.path_id = 0;
                reth.va = dst.addr + 32 * 1024;
                write.op_id = id;
            }
            payload.fill(0xEE);
        });
        net.inject_raw(1, g.from, forged, Duration::ZERO);
    }
    net.run_for(Duration::from_millis(1));
    let mut expect = vec![0u8; 64 * 1024];
    expect[..1024].copy_from_slice(&pattern(1024));
    assert!(
        net.eps[1].mr_read(dst.lkey, 0, 64 * 1024).unwrap() == expect[..],
        "forged bytes landed"
    );
    let ss = net.eps[1].connection_stats(s).unwrap();
    assert!(ss.recv.op_id_out_of_window >= 3, "{:?}", ss.recv);
    // Honest traffic carries on.
    net.eps[0]
        .post_write(c, write_req(2, &src, &dst, 0, 16 * 1024))
        .unwrap();
    run_within(&mut net, Duration::from_secs(5), |n| {
        completions(n, 0).len() == 2
    });
    assert_eq!(completions(&net, 0)[1].status, WcStatus::Success);
}

/// A READ response must answer a READ request this side sent, with the request's length
/// and offsets: a forged response for a READ still waiting to be sent (behind
/// `max_rd_atomic`) is dropped, and the READ completes with the responder's real bytes.
#[test]
fn forged_read_response_for_unsent_read_is_dropped() {
    let mut a = config(0);
    a.transport.max_rd_atomic = 1;
    let mut net = net_with(a, config(1));
    let (c, _s) = net.connect();
    let dst_data: Vec<u8> = (0..8192).map(|i| (i % 251) as u8).collect();
    let remote = net.eps[1].register_mr(dst_data.clone(), Access::REMOTE_READ);
    let local = net.eps[0].register_mr(vec![0; 8192], Access::LOCAL_WRITE);
    let read = |wr_id: u64, off: u64| ReadRequest {
        wr_id,
        lkey: local.lkey,
        local_offset: off,
        len: 1024,
        remote_addr: remote.addr + off,
        rkey: remote.rkey,
    };
    // op id 0: a genuine READ, its response captured.
    net.eps[0].post_read(c, read(1, 0)).unwrap();
    run_within(&mut net, Duration::from_secs(1), |n| {
        !completions(n, 0).is_empty()
    });
    let g = net
        .last_sent(1, |p| matches!(p.headers, Headers::ReadResponse { .. }))
        .unwrap();
    let next_psn = (last_sent_psn(&net, 1, 0) + 1) & 0xFF_FFFF;
    // op id 1 is sent and held up (the client's data is lost for a while); op id 2 waits
    // behind it (max_rd_atomic 1), not sent.
    net.drop_hook = Some(Box::new(|from, d| from == 0 && d[0] == 0xC7));
    net.eps[0].post_read(c, read(2, 1024)).unwrap();
    net.eps[0].post_read(c, read(3, 2048)).unwrap();
    net.run_for(Duration::from_micros(20));
    let forged = forge(&g, net.addrs[0], |bth, h, payload| {
        bth.psn = (next_psn + 3) & 0xFF_FFFF;
        if let Headers::ReadResponse { path, op } = h {
            path.path_id = 0;
            op.op_id = 2;
        }
        payload.fill(0xEE);
    });
    net.inject_raw(0, g.from, forged, Duration::ZERO);
    net.run_for(Duration::from_micros(20));
    net.drop_hook = None;
    run_within(&mut net, Duration::from_secs(5), |n| {
        completions(n, 0).len() == 3
    });
    let wcs = completions(&net, 0);
    assert_eq!(wcs.len(), 3, "{wcs:?}");
    assert!(wcs
        .iter()
        .all(|w| w.status == WcStatus::Success && w.opcode == WcOpcode::RdmaRead));
    assert!(
        net.eps[0].mr_read(local.lkey, 0, 3072).unwrap() == dst_data[..3072],
        "forged READ response bytes landed"
    );
}

// =======================================================================================
// Targeted injection: known QPN, valid ICRC, in-window PSNs

/// Copies of genuine packets (an executed WRITE's) re-sent under PSNs inside the receiver's
/// window that the sender has not used yet. Before the fix the receiver marked those PSNs;
/// when the sender's real packets came with them they were taken for duplicates — never
/// placed, yet acknowledged — so the real WRITE reported Success without its bytes; and the
/// SACK bits for PSNs the sender had not sent yet made it drop every ACK of the path. Now a
/// packet whose PSN was already received still goes to the (idempotent) semantic layer,
/// and SACK bits for PSNs never sent are ignored: the WRITE completes with every byte, the
/// paths see no timeout.
#[test]
fn in_window_injection_never_preempts_real_packets() {
    let mut net = new_net();
    let (c, s) = net.connect();
    let (src, dst) = regions(&mut net, 256 * 1024);
    net.eps[0]
        .post_write(c, write_req(1, &src, &dst, 0, 32 * 1024))
        .unwrap();
    run_within(&mut net, Duration::from_secs(1), |n| {
        !completions(n, 0).is_empty()
    });
    let mut forged = Vec::new();
    assert!(net
        .last_sent(0, |p| data_psn(p).is_some_and(|(id, _)| id == 3))
        .is_some());
    for path in 0..4u8 {
        let Some(g) = net.last_sent(0, |p| data_psn(p).is_some_and(|(id, _)| id == path)) else {
            continue;
        };
        let next = (last_sent_psn(&net, 0, path) + 1) & 0xFF_FFFF;
        for ahead in [0u32, 3, 17, 100, 200] {
            forged.push((
                g.from,
                forge(&g, net.addrs[1], |bth, _, _| {
                    bth.psn = (next + ahead) & 0xFF_FFFF
                }),
            ));
        }
    }
    for (from, f) in forged {
        net.inject_raw(1, from, f, Duration::ZERO);
    }
    net.run_for(Duration::from_micros(30));
    let bad_before = net.eps[0].connection_stats(c).unwrap().bad_acks;
    net.eps[0]
        .post_write(c, write_req(2, &src, &dst, 32 * 1024, 224 * 1024))
        .unwrap();
    run_within(&mut net, Duration::from_secs(5), |n| {
        completions(n, 0).len() == 2
    });
    let wcs = completions(&net, 0);
    assert_eq!(wcs.len(), 2, "{wcs:?}");
    let landed = net.eps[1].mr_read(dst.lkey, 0, 256 * 1024).unwrap() == pattern(256 * 1024)[..];
    println!("WRITE {:?}, bytes landed: {landed}", wcs[1].status);
    assert!(
        wcs[1].status != WcStatus::Success || landed,
        "Success without delivery"
    );
    assert_eq!(wcs[1].status, WcStatus::Success);
    let cs = net.eps[0].connection_stats(c).unwrap();
    let ss = net.eps[1].connection_stats(s).unwrap();
    println!(
        "sender: bad_acks {} ignored_sack {}; receiver dups {}",
        cs.bad_acks - bad_before,
        cs.acks_ignoring_unsent,
        ss.duplicate_packets
    );
    for p in &cs.paths {
        assert_eq!(p.stats.rtos, 0, "path {} timed out: {:?}", p.id, p.stats);
    }
}

// =======================================================================================
// The in-window rule against honest traffic

/// A path whose data is lost for a while (its packets and probes never arrive, so the
/// sender gives up on more PSNs than the receiver's 256-packet window) must still come back
/// once the loss ends: the receiver's window is then behind the sender's floor by more than
/// a window, and the sender's packets must not be dropped as out of window forever. (The
/// receiver resynchronizes on two consistent packets ahead of its window after the path was
/// quiet for `min_rto`, see `PathRx::check`.)
#[test]
fn path_recovers_after_losing_more_than_a_window() {
    let mut a = config(0);
    a.transport.path_reroll_timeouts = 0;
    a.transport.retry_count = 1000;
    a.transport.min_rto = Duration::from_millis(1);
    a.transport.max_rto = Duration::from_millis(1);
    let mut net = net_with(a, config(1));
    let (c, s) = net.connect();
    let (src, dst) = regions(&mut net, 64 << 10);
    // Path 0's data is lost for the first 400 ms (about 190 RTOs, each followed by a probe
    // and a few packets of a minimal window: more PSNs than the receiver's window).
    let until = net.now + Duration::from_millis(400);
    let clock = std::rc::Rc::new(std::cell::Cell::new(net.now));
    let ck = clock.clone();
    net.drop_hook = Some(Box::new(move |from, d| {
        from == 0
            && ck.get() < until
            && Packet::parse(d).is_ok_and(|p| data_psn(&p).is_some_and(|(id, _)| id == 0))
    }));
    // WRITEs back to back until 50 ms after the loss ended.
    let mut posted = 0;
    while net.now < until + Duration::from_millis(50) {
        clock.set(net.now);
        if completions(&net, 0).len() == posted {
            net.eps[0]
                .post_write(c, write_req(posted as u64, &src, &dst, 0, 64 << 10))
                .unwrap();
            posted += 1;
        }
        if !net.step() {
            break;
        }
    }
    let p0_mid = net.eps[0].connection_stats(c).unwrap().paths[0];
    let _ = &p0_mid;
    run_within(&mut net, Duration::from_secs(10), |n| {
        completions(n, 0).len() == posted
    });
    let wcs = completions(&net, 0);
    let cs = net.eps[0].connection_stats(c).unwrap();
    let ss = net.eps[1].connection_stats(s).unwrap();
    let p0 = cs.paths[0];
    println!(
        "{posted} WRITEs; path 0: {:?} sent {} acked {} rtos {} (50 ms after the loss: sent {}); receiver oow {}",
        p0.state,
        p0.stats.packets_sent,
        p0.stats.packets_acked,
        p0.stats.rtos,
        p0_mid.stats.packets_sent,
        ss.out_of_window_packets,
    );
    assert_eq!(wcs.len(), posted);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    assert!(
        net.eps[1].mr_read(dst.lkey, 0, 64 << 10).unwrap() == pattern(64 << 10)[..],
        "bytes differ"
    );
    assert_eq!(p0.state, metaroce::PathState::Active, "{p0:?}");
    assert!(p0.stats.packets_acked > 0, "{p0:?}");
}

/// The question of a held RTO (`TransportConfig::ask_idle_path`) is answered only by a
/// valid ACK. The peer's ACKs are lost from some point on; a one-packet WRITE then times
/// out on its path while the other path is idle, so the RTO is held and keepalives ask the
/// idle path. An attacker who saw the keepalive forges the peer's answer on the idle path,
/// echoing the keepalive's timestamp, but with a cumulative PSN the path never sent: the
/// ACK is dropped and the hold stands. The control: the same forgery with the PSN the path
/// last had acknowledged answers the question, as any valid ACK does (in token mode an
/// attacker can forge that too, as it can any ACK; AEAD protection stops it).
#[test]
fn an_invalid_ack_does_not_answer_the_question_of_a_held_rto() {
    for valid in [false, true] {
        let (mut a, mut b) = (config(0), config(1));
        for t in [&mut a.transport, &mut b.transport] {
            t.paths = 2;
            t.max_ack_delay = Duration::ZERO;
        }
        let mut net = net_with(a, b);
        let (c, _s) = net.connect();
        let (src, dst) = regions(&mut net, 128 * 1024);
        net.eps[0]
            .post_write(c, write_req(1, &src, &dst, 0, 16 * 1024))
            .unwrap();
        assert!(run_within(&mut net, Duration::from_secs(1), |n| {
            !completions(n, 0).is_empty()
        }));
        net.drop_hook = Some(Box::new(|from, d| from == 1 && d[0] == 0xC1));
        net.eps[0]
            .post_write(c, write_req(2, &src, &dst, 64 * 1024, 512))
            .unwrap();
        let stats = |n: &Net| n.eps[0].connection_stats(c).unwrap();
        assert!(run_within(&mut net, Duration::from_secs(1), |n| {
            stats(n).paths.iter().any(|p| p.stats.asked_rtos > 0)
        }));
        let holder = stats(&net)
            .paths
            .iter()
            .position(|p| p.stats.asked_rtos > 0)
            .unwrap();
        let idle = 1 - holder as u8;
        let keepalive = net
            .last_sent(0, |p| {
                matches!(&p.headers, Headers::Ack(a) if a.flags & AckEth::FLAG_KEEPALIVE != 0 && a.path_id == idle)
            })
            .expect("a keepalive asked the idle path");
        let echo = match Packet::parse(&keepalive.data).unwrap().headers {
            Headers::Ack(a) => a.echo_ts,
            _ => unreachable!(),
        };
        // Any ACK of the peer's, made an ACK of the idle path: cumulative up to the path's
        // last data packet (all acknowledged), or 100 PSNs beyond it (never sent).
        let ack = net
            .last_sent(
                1,
                |p| matches!(&p.headers, Headers::Ack(a) if a.flags & AckEth::FLAG_KEEPALIVE == 0),
            )
            .unwrap();
        let last = last_sent_psn(&net, 0, idle);
        let forged = forge(&ack, net.addrs[0], |bth, h, _| {
            bth.psn = if valid {
                last
            } else {
                (last + 100) & 0xFF_FFFF
            };
            if let Headers::Ack(a) = h {
                a.flags &= !AckEth::FLAG_BUNDLE;
                a.path_id = idle;
                a.sack = [0; 32];
                a.echo_ts = echo;
            }
        });
        let bad_before = stats(&net).bad_acks;
        net.inject_raw(0, ack.from, forged, Duration::ZERO);
        net.run_for(Duration::from_micros(300));
        let st = stats(&net);
        let refuted: u64 = st.paths.iter().map(|p| p.stats.refuted_holds).sum();
        if valid {
            assert_eq!(refuted, 1, "the control: a valid ACK answers: {st:?}");
        } else {
            assert_eq!(
                st.bad_acks,
                bad_before + 1,
                "the forgery was dropped: {st:?}"
            );
            assert_eq!(refuted, 0, "an invalid ACK answered the question: {st:?}");
            let lost: u64 = st.paths.iter().map(|p| p.stats.timeout_losses).sum();
            assert_eq!(lost, 0, "{st:?}");
        }
    }
}

// =======================================================================================
// 7. Answer ports

/// A very late copy of a data packet (its PSN far behind the path's window: dropped as a
/// duplicate) carrying another re-roll generation moves nothing: the path's ACKs keep
/// leaving from the port of the generation its new packets carry. Before the fix the
/// generation and plane were taken from every packet that passed the window check, before
/// the very-late drop, so such a packet (delayed on the route the sender left, or
/// replayed) sent the path's answers back onto that route until the next new packet.
#[test]
fn very_late_packet_does_not_move_the_answer_port() {
    let mut net = new_net();
    let (c, _s) = net.connect();
    let (src, dst) = regions(&mut net, 64 * 1024);
    net.eps[0]
        .post_write(c, write_req(1, &src, &dst, 0, 40 * 1024))
        .unwrap();
    run_within(&mut net, Duration::from_secs(1), |n| {
        !completions(n, 0).is_empty()
    });
    let seen = net
        .last_sent(0, |p| data_psn(p) == Some((0, p.bth.psn)))
        .expect("a data packet on path 0");
    let to: SocketAddr = "10.0.0.2:4791".parse().unwrap();
    let generation = |g: u8| {
        move |bth: &mut Bth, h: &mut Headers, _: &mut [u8]| {
            if let Headers::Write { path, .. } = h {
                path.flags = (path.flags & 0x0F) | (g << 4);
                path.floor_psn = bth.psn;
            }
        }
    };
    // A copy in the window (a recent duplicate: acknowledged), of the generation the
    // path uses, and a very late copy, 1000 PSNs behind, of generation 5.
    let dup = forge(&seen, to, generation(0));
    let late = forge(&seen, to, |bth, h, p| {
        bth.psn = metaroce::wire::psn_add(bth.psn, (1 << 24) - 1000);
        generation(5)(bth, h, p)
    });
    net.wire.clear();
    net.inject_raw(1, seen.from, dup, Duration::ZERO);
    net.inject_raw(1, seen.from, late, Duration::ZERO);
    net.run_for(Duration::from_millis(1));
    let ports: Vec<u16> = net
        .wire
        .iter()
        .filter(|d| d.from_ep == 1)
        .filter(|d| {
            matches!(Packet::parse(&d.data).map(|p| p.headers),
                Ok(Headers::Ack(a)) if a.path_id == 0)
        })
        .map(|d| d.from.port())
        .collect();
    let port = net.eps[1].config().source_ports[0];
    assert!(!ports.is_empty(), "no ACK of path 0");
    assert!(
        ports.iter().all(|&p| p == port),
        "path 0's ACKs left from {ports:x?}, not {port:x}: the late packet moved the port"
    );
}
