//! One `metaroce::Endpoint` with a MetaRoCE connection to one peer and a standard RC queue
//! pair (RoCEv2 mode, carried over the endpoint's UDP datagrams) to another, at the same
//! time, over one memory-region table, on a lossy in-memory network with virtual time.

use metaroce::rocev2::{
    Completion, ConnectAttrs, QpInit, RcEvent, RcOpcode, RcWire, SendOp, SendWr,
};
use metaroce::testing::{pattern, Impair, Kind, Net};
use metaroce::{
    Access, ConnectionHandle, EcnCodepoint, Endpoint, EndpointConfig, Event, ReadRequest, WcOpcode,
    WcStatus, WorkCompletion, WriteRequest,
};
use std::net::SocketAddr;
use std::time::Duration;

fn config(i: usize, seed: u64) -> EndpointConfig {
    let mut c = EndpointConfig::new(
        format!("10.0.0.{}:4791", i + 1).parse().unwrap(),
        (0..8).map(|k| 0xC000 + k + 16 * i as u16).collect(),
    );
    c.seed = seed.wrapping_mul(31).wrapping_add(i as u64);
    c.transport.pmtu = 1024;
    c
}

/// N endpoints on the test network (`metaroce::testing::Net`: fixed 10 µs one-way delay,
/// seeded random loss; plus, when lossy, the 5th and 20th RC packet of every sender lost).
/// Datagrams arrive without ECN, except that with `ce_rc` every RC-opcode datagram arrives
/// CE-marked (a congested switch).
fn new_net(n: usize, seed: u64, loss: f64) -> Net {
    mixed_net(n, seed, loss, false)
}

fn mixed_net(n: usize, seed: u64, loss: f64, ce_rc: bool) -> Net {
    let cfgs: Vec<EndpointConfig> = (0..n).map(|i| config(i, seed)).collect();
    let mut net = Net::impaired_all(
        seed,
        Impair {
            loss,
            ..Impair::default()
        },
        cfgs,
    );
    let mut rc_sent = vec![0u64; n];
    net.drop_hook = Some(Box::new(move |i, d: &[u8]| {
        if d[0] > 0x14 {
            return false;
        }
        rc_sent[i] += 1;
        loss > 0.0 && matches!(rc_sent[i], 5 | 20)
    }));
    net.ecn_hook = Some(Box::new(move |d: &[u8], _| {
        (ce_rc && d[0] <= 0x14).then_some(EcnCodepoint::Ce)
    }));
    net
}

/// RC-opcode datagrams endpoint `i` sent.
fn rc_sent(net: &Net, i: usize) -> u64 {
    net.sent[i].get(&Kind::Rc).copied().unwrap_or(0)
}

fn meta_wcs(n: &Net, i: usize) -> Vec<(ConnectionHandle, WorkCompletion)> {
    n.events[i]
        .iter()
        .filter_map(|e| match e {
            Event::Completion { conn, wc } => Some((*conn, *wc)),
            _ => None,
        })
        .collect()
}

fn rc_wcs(n: &Net, i: usize) -> Vec<Completion> {
    n.events[i]
        .iter()
        .filter_map(|e| match e {
            Event::Rc(RcEvent::Completion(c)) => Some(*c),
            _ => None,
        })
        .collect()
}

fn rc_wr(wr_id: u64, op: SendOp, lkey: u32, local_offset: u64, len: u32) -> SendWr {
    SendWr {
        wr_id,
        op,
        lkey,
        local_offset,
        len,
        solicited: false,
    }
}

const A: usize = 0;
const B: usize = 1;
const C: usize = 2;
const HALF: usize = 48 * 1024;

/// A has a MetaRoCE connection to B and an RC QP (over UDP) to C. A's one region `shared`
/// (registered once) is written by B through MetaRoCE and by C through the RC QP, then read
/// back crosswise: B READs what C wrote, C READs what B wrote. A's one source region goes to
/// both peers with the same lkey. Every byte is checked, under loss.
fn mixed(seed: u64, loss: f64) -> Net {
    let mut net = new_net(3, seed, loss);
    let remote = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let shared = net.eps[A].register_mr(vec![0; 2 * HALF], remote);
    let a_src = net.eps[A].register_mr(pattern(1, HALF), Access::LOCAL_WRITE);
    let b_src = net.eps[B].register_mr(pattern(2, HALF), Access::LOCAL_WRITE);
    let b_dst = net.eps[B].register_mr(vec![0; 2 * HALF], remote);
    let c_src = net.eps[C].register_mr(pattern(3, HALF), Access::LOCAL_WRITE);
    let c_dst = net.eps[C].register_mr(vec![0; 2 * HALF], remote);

    // MetaRoCE: A -> B.
    let now = net.now;
    let ab = net.eps[A].connect(now, net.addrs[B], None).unwrap();
    assert!(net.run_until(Duration::from_secs(1), |n| n.eps[A].is_established(ab)));
    let ba = net.events[B]
        .iter()
        .find_map(|e| match e {
            Event::Incoming(h) => Some(*h),
            _ => None,
        })
        .expect("B accepted");

    // RC QP: A <-> C, carried over the endpoints' UDP datagrams; QPN/PSN exchanged "out of
    // band" (here: directly).
    let init = QpInit {
        access: Access::REMOTE_WRITE | Access::REMOTE_READ,
        ..QpInit::default()
    };
    let qa = net.eps[A].rc().create_qp(init).unwrap();
    let qc = net.eps[C].rc().create_qp(init).unwrap();
    let attrs = |ip, qpn, psn| {
        let mut a = ConnectAttrs::new(ip, qpn, psn);
        a.timeout = 10; // 4.2 ms
        a.max_rd_atomic = 4;
        a.max_dest_rd_atomic = 4;
        a
    };
    let (ip_a, ip_c) = (net.addrs[A].ip(), net.addrs[C].ip());
    let wire_c = RcWire::Udp {
        peer: net.addrs[C],
        local_ip: None,
    };
    let wire_a = RcWire::Udp {
        peer: net.addrs[A],
        local_ip: None,
    };
    net.eps[A]
        .rc()
        .connect_qp(qa.qpn, attrs(ip_c, qc.qpn, qc.psn), wire_c)
        .unwrap();
    net.eps[C]
        .rc()
        .connect_qp(qc.qpn, attrs(ip_a, qa.qpn, qa.psn), wire_a)
        .unwrap();

    // Phase 1: B and C write into A's one region; A writes its one source region to both.
    let w = |wr_id, lkey, len: usize, remote_addr, rkey| WriteRequest {
        wr_id,
        lkey,
        local_offset: 0,
        len: len as u32,
        remote_addr,
        rkey,
        imm: None,
    };
    net.eps[B]
        .post_write(ba, w(1, b_src.lkey, HALF, shared.addr, shared.rkey))
        .unwrap();
    net.eps[A]
        .post_write(ab, w(2, a_src.lkey, HALF, b_dst.addr, b_dst.rkey))
        .unwrap();
    let op = |remote_addr, rkey| SendOp::Write {
        remote_addr,
        rkey,
        imm: None,
    };
    let c_to_a = op(shared.addr + HALF as u64, shared.rkey);
    net.eps[C]
        .rc()
        .post_send(qc.qpn, rc_wr(3, c_to_a, c_src.lkey, 0, HALF as u32))
        .unwrap();
    net.eps[A]
        .rc()
        .post_send(
            qa.qpn,
            rc_wr(4, op(c_dst.addr, c_dst.rkey), a_src.lkey, 0, HALF as u32),
        )
        .unwrap();
    let ok = net.run_until(Duration::from_secs(20), |n| {
        meta_wcs(n, B).len() == 1
            && meta_wcs(n, A).len() == 1
            && rc_wcs(n, C).len() == 1
            && rc_wcs(n, A).len() == 1
    });
    assert!(ok, "phase 1 did not complete");
    for (_, wc) in meta_wcs(&net, A).iter().chain(&meta_wcs(&net, B)) {
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        assert_eq!(wc.opcode, WcOpcode::RdmaWrite);
    }
    for c in rc_wcs(&net, A).iter().chain(&rc_wcs(&net, C)) {
        assert_eq!(c.status, WcStatus::Success, "{c:?}");
        assert_eq!(c.opcode, RcOpcode::RdmaWrite);
    }
    let a_shared = net.eps[A].mr_read(shared.lkey, 0, 2 * HALF as u64).unwrap();
    assert_eq!(
        &a_shared[..HALF],
        &pattern(2, HALF)[..],
        "B's WRITE (MetaRoCE)"
    );
    assert_eq!(&a_shared[HALF..], &pattern(3, HALF)[..], "C's WRITE (RC)");
    let b_got = net.eps[B].mr_read(b_dst.lkey, 0, HALF as u64).unwrap();
    assert_eq!(b_got, &pattern(1, HALF)[..], "A's WRITE to B (MetaRoCE)");
    let c_got = net.eps[C].mr_read(c_dst.lkey, 0, HALF as u64).unwrap();
    assert_eq!(c_got, &pattern(1, HALF)[..], "A's WRITE to C (RC)");

    // Phase 2: crosswise READs of A's region: B reads C's half, C reads B's half.
    net.eps[B]
        .post_read(
            ba,
            ReadRequest {
                wr_id: 5,
                lkey: b_dst.lkey,
                local_offset: HALF as u64,
                len: HALF as u32,
                remote_addr: shared.addr + HALF as u64,
                rkey: shared.rkey,
            },
        )
        .unwrap();
    let read = SendOp::Read {
        remote_addr: shared.addr,
        rkey: shared.rkey,
    };
    net.eps[C]
        .rc()
        .post_send(qc.qpn, rc_wr(6, read, c_dst.lkey, HALF as u64, HALF as u32))
        .unwrap();
    let ok = net.run_until(Duration::from_secs(40), |n| {
        meta_wcs(n, B).len() == 2 && rc_wcs(n, C).len() == 2
    });
    assert!(ok, "phase 2 did not complete");
    let (_, wc) = meta_wcs(&net, B)[1];
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::Success));
    let c = rc_wcs(&net, C)[1];
    assert_eq!(
        (c.wr_id, c.status, c.opcode),
        (6, WcStatus::Success, RcOpcode::RdmaRead)
    );
    let b_read = net.eps[B]
        .mr_read(b_dst.lkey, HALF as u64, HALF as u64)
        .unwrap();
    assert_eq!(b_read, &pattern(3, HALF)[..], "B READ what C wrote");
    let c_read = net.eps[C]
        .mr_read(c_dst.lkey, HALF as u64, HALF as u64)
        .unwrap();
    assert_eq!(c_read, &pattern(2, HALF)[..], "C READ what B wrote");

    // Dispatch: RC packets reached the RC side, nothing was left unhandled or failed ICRC.
    for i in [A, B, C] {
        let s = net.eps[i].stats();
        assert_eq!(
            (s.unsupported, s.bad_icrc, s.malformed),
            (0, 0, 0),
            "ep {i}: {s:?}"
        );
        let r = net.eps[i].rc_stats();
        assert_eq!((r.rx_bad_icrc, r.rx_malformed), (0, 0), "ep {i}: {r:?}");
    }
    assert_eq!(rc_sent(&net, B), 0, "B has no RC QP");
    assert!(rc_sent(&net, A) > 0 && rc_sent(&net, C) > 0);
    assert!(net.eps[A].rc_stats().rx_packets > 0 && net.eps[C].rc_stats().rx_packets > 0);
    net
}

#[test]
fn metaroce_connection_and_rc_qp_share_one_region_lossless() {
    let mut net = mixed(7, 0.0);
    assert_eq!(net.dropped, 0);
    let rc = rc_wcs(&net, A)[0].qpn;
    let st = net.eps[A].rc().qp_stats(rc).unwrap();
    assert_eq!(st.retransmitted, 0);
}

#[test]
fn metaroce_connection_and_rc_qp_share_one_region_under_loss() {
    for seed in [1, 2, 3] {
        let mut net = mixed(seed, 0.02);
        assert!(net.dropped > 0);
        // The RC side recovered by go-back-N: sequence NAKs and/or timeouts, packets resent.
        let qa = rc_wcs(&net, A)[0].qpn;
        let qc = rc_wcs(&net, C)[0].qpn;
        let sa = net.eps[A].rc().qp_stats(qa).unwrap();
        let sc = net.eps[C].rc().qp_stats(qc).unwrap();
        assert!(
            sa.retransmitted + sc.retransmitted > 0,
            "seed {seed}: no RC retransmission: {sa:?} {sc:?}"
        );
        assert!(
            sa.seq_naks_sent + sc.seq_naks_sent + sa.timeouts + sc.timeouts > 0,
            "seed {seed}: {sa:?} {sc:?}"
        );
    }
}

/// RcWire::Udp's peer must be the QP's remote IP; an unspecified local IP is refused.
#[test]
fn udp_wire_checks_addresses() {
    let mut ep = Endpoint::new(EndpointConfig::new(
        "0.0.0.0:4791".parse().unwrap(),
        vec![50000],
    ))
    .unwrap();
    let q = ep.rc().create_qp(QpInit::default()).unwrap();
    let attrs = ConnectAttrs::new("10.0.0.2".parse().unwrap(), 0x22, 1);
    let other: SocketAddr = "10.0.0.3:4791".parse().unwrap();
    let wire = |peer, local_ip| RcWire::Udp { peer, local_ip };
    let e = ep.rc().connect_qp(q.qpn, attrs, wire(other, None));
    assert!(e.is_err());
    let peer: SocketAddr = "10.0.0.2:4791".parse().unwrap();
    let e = ep.rc().connect_qp(q.qpn, attrs, wire(peer, None));
    assert!(e.is_err(), "unspecified local IP accepted");
    let local = Some("10.0.0.1".parse().unwrap());
    ep.rc().connect_qp(q.qpn, attrs, wire(peer, local)).unwrap();
    assert_eq!(ep.rc().qp_wire(q.qpn), Some(wire(peer, local)));
}

/// RoCEv2 Annex A17.9 on a `metaroce::Endpoint`: an RC QP (carried over UDP) that receives
/// CE-marked packets sends CNPs, and the peer endpoint routes a CNP whose DestQP is one of
/// its RC QPs to that QP's reaction point (not to the MetaRoCE side).
#[test]
fn rc_qp_on_an_endpoint_answers_ce_with_cnps_routed_to_the_qp() {
    let mut net = mixed_net(2, 7, 0.0, true);
    let len = 256 * 1024;
    let remote = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let dst = net.eps[A].register_mr(vec![0; len], remote);
    let src = net.eps[B].register_mr(pattern(5, len), Access::LOCAL_WRITE);
    let init = QpInit {
        access: Access::REMOTE_WRITE,
        ..QpInit::default()
    };
    let qa = net.eps[A].rc().create_qp(init).unwrap();
    let qb = net.eps[B].rc().create_qp(init).unwrap();
    let attrs = |ip, qpn, psn| {
        let mut a = ConnectAttrs::new(ip, qpn, psn);
        a.timeout = 14;
        a
    };
    let (ip_a, ip_b) = (net.addrs[A].ip(), net.addrs[B].ip());
    let (addr_a, addr_b) = (net.addrs[A], net.addrs[B]);
    net.eps[A]
        .rc()
        .connect_qp(
            qa.qpn,
            attrs(ip_b, qb.qpn, qb.psn),
            RcWire::Udp {
                peer: addr_b,
                local_ip: None,
            },
        )
        .unwrap();
    net.eps[B]
        .rc()
        .connect_qp(
            qb.qpn,
            attrs(ip_a, qa.qpn, qa.psn),
            RcWire::Udp {
                peer: addr_a,
                local_ip: None,
            },
        )
        .unwrap();
    let op = SendOp::Write {
        remote_addr: dst.addr,
        rkey: dst.rkey,
        imm: None,
    };
    net.eps[B]
        .rc()
        .post_send(qb.qpn, rc_wr(1, op, src.lkey, 0, len as u32))
        .unwrap();
    assert!(net.run_until(Duration::from_secs(10), |n| !rc_wcs(n, B).is_empty()));
    assert_eq!(rc_wcs(&net, B)[0].status, WcStatus::Success);
    assert_eq!(
        net.eps[A].mr_read(dst.lkey, 0, len as u64).unwrap(),
        &pattern(5, len)[..]
    );
    let sa = net.eps[A].rc().qp_stats(qa.qpn).unwrap();
    let sb = net.eps[B].rc().qp_stats(qb.qpn).unwrap();
    assert_eq!(sa.ce_received, 256);
    assert!(sa.cnps_sent >= 1);
    assert_eq!(
        sb.cnps_received, sa.cnps_sent,
        "every CNP reached the RC QP"
    );
}
