//! ACK bundles (issue #13, docs/PROTOCOL.md "ACK bundles"): a receive burst sprayed over
//! several paths is acknowledged by one `MR_ACK` datagram carrying one ACK block per path,
//! instead of one datagram per path; a malformed bundle applies none of its blocks.
//!
//! Sans-IO, virtual time, the in-memory `metaroce::testing::Net` recording what it carries.

use metaroce::wire::{icrc, AckEth, Headers, Packet};
use metaroce::{Access, EndpointConfig, MrKeys, WcStatus, WriteRequest};
use std::time::Duration;

type Net = metaroce::testing::Net;

fn config(i: usize, bundle: usize) -> EndpointConfig {
    let ip = format!("10.0.0.{}", i + 1);
    let mut c = EndpointConfig::new(
        format!("{ip}:4791").parse().unwrap(),
        (0..8).map(|k| 0xC000 + k + 16 * i as u16).collect(),
    );
    c.seed = 0xACB0 + i as u64;
    c.transport.max_gso_segments = 4;
    c.transport.pmtu = 1024;
    c.transport.paths = 8;
    c.transport.max_ack_bundle = bundle;
    c
}

fn net(bundle: usize) -> Net {
    let mut n = Net::with_configs(0, config(0, bundle), config(1, bundle));
    n.record = 200_000;
    n
}

fn regions(net: &mut Net, len: usize) -> (MrKeys, MrKeys) {
    let src = net.eps[0].register_mr(metaroce::testing::pattern(3, len), Access::LOCAL_WRITE);
    let dst = net.eps[1].register_mr(vec![0; len], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    (src, dst)
}

fn write(wr_id: u64, src: &MrKeys, dst: &MrKeys, off: u64, len: u32) -> WriteRequest {
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

/// Per recorded `MR_ACK` datagram from endpoint 1 (keepalives excluded): how many paths
/// it acknowledges (1 + the ACK blocks in its payload) and which path ids.
fn server_acks(net: &Net) -> Vec<Vec<u8>> {
    net.wire
        .iter()
        .filter(|s| s.from_ep == 1)
        .filter_map(|s| {
            let p = Packet::parse(&s.data).ok()?;
            let Headers::Ack(a) = p.headers else {
                return None;
            };
            if a.flags & AckEth::FLAG_KEEPALIVE != 0 {
                return None;
            }
            let mut ids = vec![a.path_id];
            if a.flags & AckEth::FLAG_BUNDLE != 0 {
                assert_eq!(p.payload.len() % AckEth::BLOCK_LEN, 0, "bundle payload");
                for b in p.payload.chunks_exact(AckEth::BLOCK_LEN) {
                    ids.push(AckEth::parse_block(b).unwrap().1.path_id);
                }
            } else {
                assert!(p.payload.is_empty(), "unbundled ACK with a payload");
            }
            Some(ids)
        })
        .collect()
}

/// Run 32 WRITEs of 16 KiB (512 packets sprayed over 8 paths) to completion; returns the
/// ACK datagrams the server sent.
fn bulk(net: &mut Net) -> Vec<Vec<u8>> {
    let (c, _s) = net.connect();
    let len = 512 * 1024;
    let (src, dst) = regions(net, len);
    for k in 0..32u64 {
        net.eps[0]
            .post_write(c, write(k, &src, &dst, k * 16384, 16384))
            .unwrap();
    }
    assert!(net.run_until(Duration::from_secs(5), |n| n.completions(0, c).len() == 32));
    assert!(net
        .completions(0, c)
        .iter()
        .all(|wc| wc.status == WcStatus::Success));
    assert!(
        net.eps[1].mr_read(dst.lkey, 0, len as u64).unwrap()
            == metaroce::testing::pattern(3, len)[..],
        "bytes differ"
    );
    let cs = net.eps[0].connection_stats(c).unwrap();
    let retx: u64 = cs.paths.iter().map(|p| p.stats.retransmits).sum();
    assert_eq!(retx, 0, "retransmissions on a lossless network");
    let ss = net.eps[1].connection_stats(_s).unwrap();
    let acks = server_acks(net);
    let blocks: usize = acks.iter().map(Vec::len).sum();
    assert_eq!(ss.ack_datagrams_sent as usize, acks.len(), "{ss:?}");
    assert_eq!(ss.acks_sent as usize, blocks, "{ss:?}");
    // Every block sent is applied by the client, none is refused.
    assert_eq!(cs.acks_received, ss.acks_sent, "{cs:?}");
    assert_eq!(cs.bad_acks, 0);
    acks
}

/// With bundles (the default, 8), a burst over 8 paths is acknowledged by datagrams that
/// each name several paths, never one path twice; with `max_ack_bundle = 1` every ACK
/// names one path and carries no payload (the wire before bundles). The same transfer
/// needs fewer ACK datagrams with bundles. (Fails without bundling: no datagram names more
/// than one path.)
#[test]
fn sprayed_burst_is_acknowledged_by_bundles() {
    let bundled = bulk(&mut net(8));
    let single = bulk(&mut net(1));
    let max = bundled.iter().map(Vec::len).max().unwrap();
    let multi = bundled.iter().filter(|ids| ids.len() > 1).count();
    println!(
        "ACK datagrams: {} bundled (largest {max} paths, {multi} with more than one), {} single",
        bundled.len(),
        single.len()
    );
    assert!(max > 1 && max <= 8, "largest bundle {max}");
    for ids in &bundled {
        let mut s = ids.clone();
        s.sort();
        s.dedup();
        assert_eq!(s.len(), ids.len(), "a path twice in one bundle: {ids:?}");
    }
    assert!(single.iter().all(|ids| ids.len() == 1));
    assert!(
        bundled.len() < single.len(),
        "bundles did not save ACK datagrams: {} vs {}",
        bundled.len(),
        single.len()
    );
}

/// A bundle whose blocks are malformed (here: one flagged KEEPALIVE) applies none of its
/// blocks and is counted once in `bad_acks`; its first AckEth, a complete ACK by itself,
/// still counts. A forged block cannot smuggle a keepalive or a nested bundle.
#[test]
fn malformed_bundle_applies_no_block() {
    let mut net = net(8);
    bulk(&mut net);
    let c = net.eps[0].connections().next().unwrap();
    let seen = net
        .wire
        .iter()
        .rev()
        .find(|s| {
            s.from_ep == 1
                && Packet::parse(&s.data).is_ok_and(
                    |p| matches!(p.headers, Headers::Ack(a) if a.flags & AckEth::FLAG_BUNDLE != 0),
                )
        })
        .cloned()
        .expect("no bundle captured");
    let before = net.eps[0].connection_stats(c).unwrap();
    // Byte 1 of the first block's AckEth (4 bytes of cumulative PSN, then path id, flags).
    let mut data = seen.data.clone();
    let at = 12 + AckEth::LEN + 5;
    data[at] |= AckEth::FLAG_KEEPALIVE;
    let ip = icrc::IpHeader::synthesized(seen.from.ip(), net.addrs[0].ip()).unwrap();
    icrc::stamp(&ip, seen.from.port(), net.addrs[0].port(), &mut data).unwrap();
    net.inject_raw(0, seen.from, data, Duration::ZERO);
    net.step();
    let after = net.eps[0].connection_stats(c).unwrap();
    assert_eq!(after.bad_acks, before.bad_acks + 1, "{after:?}");
    assert_eq!(
        after.acks_received,
        before.acks_received + 1,
        "blocks of a malformed bundle were applied"
    );
    // The genuine bundle, replayed: every block is a duplicate ACK, applied harmlessly.
    net.inject_raw(0, seen.from, seen.data.clone(), Duration::ZERO);
    net.step();
    let replay = net.eps[0].connection_stats(c).unwrap();
    assert_eq!(replay.bad_acks, after.bad_acks);
    assert!(net.lost(0, c).is_none());
}
