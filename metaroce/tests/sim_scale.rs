//! `metaroce::sim` at scale: hundreds of concurrent connections per endpoint, with loss so
//! that the timers (tail-loss probes, retransmission timeouts) carry part of the recovery;
//! the receiver's fair share among hundreds of senders.
//!
//! Run with `cargo test -p metaroce --features sim --release --test sim_scale`.
#![cfg(feature = "sim")]

use metaroce::sim::{HostId, Impairments, LinkConfig, Sim, SimConfig, GBPS};
use metaroce::testing::pattern;
use metaroce::{Access, ConnectionHandle, Event, MrKeys, WcStatus, WriteRequest};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

fn link() -> LinkConfig {
    LinkConfig::new(100 * GBPS, Duration::from_micros(1))
        .with_queue_limit(1 << 20)
        .with_ecn_threshold(200_000)
}

struct Flow {
    src: usize,
    dst: usize,
    conn: ConnectionHandle,
    src_offset: u64,
    dst_offset: u64,
}

/// Every connection was established; post one WRITE of `len` bytes on each flow, run
/// until all completed (at most `limit` of simulated time). Returns each flow's completion
/// status in order.
fn write_all(
    sim: &mut Sim,
    hosts: &[HostId],
    src: &[MrKeys],
    dst: &[MrKeys],
    flows: &[Flow],
    len: u32,
    limit: Duration,
) -> Vec<Option<WcStatus>> {
    for (i, f) in flows.iter().enumerate() {
        sim.endpoint_mut(hosts[f.src])
            .post_write(
                f.conn,
                WriteRequest {
                    wr_id: i as u64,
                    lkey: src[f.src].lkey,
                    local_offset: f.src_offset,
                    len,
                    remote_addr: dst[f.dst].addr + f.dst_offset,
                    rkey: dst[f.dst].rkey,
                    imm: None,
                },
            )
            .unwrap();
    }
    let done: Rc<RefCell<Vec<Option<WcStatus>>>> = Rc::new(RefCell::new(vec![None; flows.len()]));
    let d = done.clone();
    sim.set_event_handler(move |_, ev| {
        if let Event::Completion { wc, .. } = ev {
            d.borrow_mut()[wc.wr_id as usize] = Some(wc.status);
        }
        true
    });
    let t0 = sim.elapsed();
    sim.run_while(|s| s.elapsed() - t0 < limit && done.borrow().iter().any(|x| x.is_none()));
    sim.clear_event_handler();
    let out = done.borrow().clone();
    out
}

/// 16 hosts (4 leaves × 4, 2 spines); every host opens 4 connections to every other host:
/// 960 connections, 120 per endpoint (60 outgoing, 60 accepted), all with a 16 KiB WRITE
/// in flight at once, over fabric links that lose 0.5% of packets. Every WRITE completes
/// and lands exactly in its slot; timers fired (the losses of last packets are only found
/// by them).
#[test]
fn nine_hundred_sixty_connections_with_loss_all_writes_land() {
    let mut sim = Sim::new(SimConfig::with_seed(7));
    let lossy = link().with_impairments(Impairments {
        loss: 0.005,
        ..Impairments::default()
    });
    let hosts = sim.leaf_spine(4, 2, 4, link(), lossy).hosts;
    let n = hosts.len();
    let cpp = 4usize;
    let len = 16u32 << 10;
    let stride = 1021u64;
    let slots = (n * cpp) as u64;
    let mut src = Vec::new();
    let mut dst = Vec::new();
    for (i, &h) in hosts.iter().enumerate() {
        let ep = sim.endpoint_mut(h);
        let src_len = u64::from(len) + stride * slots;
        src.push(ep.register_mr(pattern(i as u64 + 1, src_len as usize), Access::LOCAL_WRITE));
        dst.push(ep.register_mr(
            vec![0; (slots * u64::from(len)) as usize],
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        ));
    }
    let mut flows = Vec::new();
    for i in 0..n {
        for j in (0..n).filter(|&j| j != i) {
            for k in 0..cpp {
                flows.push(Flow {
                    src: i,
                    dst: j,
                    conn: sim.connect_endpoints(hosts[i], hosts[j]).unwrap(),
                    src_offset: stride * (j * cpp + k) as u64,
                    dst_offset: (i * cpp + k) as u64 * u64::from(len),
                });
            }
        }
    }
    assert_eq!(flows.len(), 960);
    let per_host = ((n - 1) * cpp) as u64;
    sim.run_while(|s| {
        // A lost handshake packet is sent again after `handshake_interval` (100 ms).
        s.elapsed() < Duration::from_secs(1)
            && hosts.iter().any(|&h| s.host_stats(h).connected < per_host)
    });
    for &h in &hosts {
        assert_eq!(sim.host_stats(h).connected, per_host);
        assert_eq!(sim.endpoint(h).connections().count(), 2 * per_host as usize);
    }
    let timeouts_before = sim.stats().timeouts;
    let status = write_all(
        &mut sim,
        &hosts,
        &src,
        &dst,
        &flows,
        len,
        Duration::from_secs(2),
    );
    for (f, st) in flows.iter().zip(&status) {
        assert_eq!(
            *st,
            Some(WcStatus::Success),
            "{}->{} {}",
            f.src,
            f.dst,
            f.conn
        );
        let expect = sim
            .endpoint(hosts[f.src])
            .mr_read(src[f.src].lkey, f.src_offset, u64::from(len))
            .unwrap();
        let got = sim
            .endpoint(hosts[f.dst])
            .mr_read(dst[f.dst].lkey, f.dst_offset, u64::from(len))
            .unwrap();
        assert!(got == expect, "wrong bytes from {} at {}", f.src, f.dst);
    }
    let (mut retx, mut probes) = (0, 0);
    for &h in &hosts {
        let ep = sim.endpoint(h);
        for c in ep.connections() {
            for p in ep.connection_stats(c).unwrap().paths {
                retx += p.stats.retransmits;
                probes += p.stats.probes;
            }
        }
    }
    assert!(
        sim.stats().packets_dropped > 0,
        "the lossy links lost nothing"
    );
    assert!(
        retx > 0 && probes > 0,
        "retransmits {retx}, probes {probes}"
    );
    assert!(sim.stats().timeouts > timeouts_before);
    // Nothing left to do: once the last ACKs have settled, no endpoint asks for a timer
    // before the idle timeout (if any) and none has anything to send.
    sim.run_for(Duration::from_millis(5));
    let now = sim.now();
    let mut buf = Vec::new();
    for &h in &hosts {
        let ep = sim.endpoint_mut(h);
        assert!(ep.poll_transmit(now, &mut buf).is_none());
        if let Some(t) = ep.poll_timeout() {
            assert!(t > now, "a timer in the past was left armed");
        }
    }
}

/// One receiver with `recv_capacity_mbps` = 100,000 and 240 concurrent senders (15 hosts ×
/// 16 connections): while all of them deliver, every ACK grants each sender an equal part,
/// 100,000 / 240 = 416 Mbit/s; all WRITEs complete with the right bytes.
#[test]
fn fair_share_among_two_hundred_forty_senders() {
    let mut sim = Sim::new(SimConfig::with_seed(3));
    sim.set_host_config(|h, cfg| {
        if h.index() == 0 {
            cfg.transport.recv_capacity_mbps = 100_000;
        }
    });
    let hosts = sim.leaf_spine(2, 2, 8, link(), link()).hosts;
    let sink = 0usize;
    let per_sender = 16usize;
    let len = 64u32 << 10;
    let senders = hosts.len() - 1;
    let mut src = Vec::new();
    let mut dst = Vec::new();
    for (i, &h) in hosts.iter().enumerate() {
        let ep = sim.endpoint_mut(h);
        src.push(ep.register_mr(
            pattern(100 + i as u64, (len as usize) * per_sender),
            Access::LOCAL_WRITE,
        ));
        let dlen = if i == sink {
            (hosts.len() * per_sender) as u64 * u64::from(len)
        } else {
            8
        };
        dst.push(ep.register_mr(
            vec![0; dlen as usize],
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        ));
    }
    let mut flows = Vec::new();
    for i in (0..hosts.len()).filter(|&i| i != sink) {
        for k in 0..per_sender {
            flows.push(Flow {
                src: i,
                dst: sink,
                conn: sim.connect_endpoints(hosts[i], hosts[sink]).unwrap(),
                src_offset: (k as u64) * u64::from(len),
                dst_offset: (i * per_sender + k) as u64 * u64::from(len),
            });
        }
    }
    let n_flows = flows.len();
    assert_eq!(n_flows, senders * per_sender);
    sim.run_while(|s| {
        s.elapsed() < Duration::from_millis(100)
            && s.hosts().map(|h| s.host_stats(h).connected).sum::<u64>() < n_flows as u64
    });
    // Post everything, then look at the grant part-way through.
    for (i, f) in flows.iter().enumerate() {
        sim.endpoint_mut(hosts[f.src])
            .post_write(
                f.conn,
                WriteRequest {
                    wr_id: i as u64,
                    lkey: src[f.src].lkey,
                    local_offset: f.src_offset,
                    len,
                    remote_addr: dst[f.dst].addr + f.dst_offset,
                    rkey: dst[f.dst].rkey,
                    imm: None,
                },
            )
            .unwrap();
    }
    sim.run_for(Duration::from_micros(300));
    let ep = sim.endpoint(hosts[sink]);
    let expect = 100_000 / n_flows as u32;
    let mut grants: Vec<u32> = ep
        .connections()
        .map(|c| ep.connection_stats(c).unwrap().granted_rate_mbps)
        .collect();
    grants.sort_unstable();
    grants.dedup();
    assert_eq!(grants, vec![expect], "grant with {n_flows} active senders");
    // Senders hear it.
    let heard = flows
        .iter()
        .filter(|f| {
            sim.endpoint(hosts[f.src])
                .connection_stats(f.conn)
                .unwrap()
                .peer_rate_hint_mbps
                == expect
        })
        .count();
    assert!(heard > n_flows / 2, "only {heard} senders heard the grant");
    // Work completions are counted in the host stats whether or not anyone drains them.
    let completions = |s: &Sim| -> u64 { s.hosts().map(|h| s.host_stats(h).completions).sum() };
    sim.run_while(|s| s.elapsed() < Duration::from_secs(2) && completions(s) < n_flows as u64);
    for f in &flows {
        let expect = sim
            .endpoint(hosts[f.src])
            .mr_read(src[f.src].lkey, f.src_offset, u64::from(len))
            .unwrap();
        let got = sim
            .endpoint(hosts[f.dst])
            .mr_read(dst[f.dst].lkey, f.dst_offset, u64::from(len))
            .unwrap();
        assert!(got == expect, "wrong bytes from {}", f.src);
    }
    let completions = completions(&sim);
    assert_eq!(completions, n_flows as u64);
}
