//! Small, deterministic versions of the simulator experiments (`examples/sim_*.rs`,
//! docs/RESULTS.md "Simulator experiments"): the properties they show, asserted on virtual
//! time so they cannot drift silently.
//!
//! Run with `cargo test -p metaroce --features sim --test sim_experiments`.
#![cfg(feature = "sim")]

use metaroce::sim::{
    Action, HostId, LinkConfig, Location, PlaneShape, Sim, SimConfig, TraceKind, UplinkPolicy, GBPS,
};
use metaroce::testing::pattern;
use metaroce::wire::Opcode;
use metaroce::{Access, ConnectionHandle, Event, WriteRequest};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

fn link(gbps: u64) -> LinkConfig {
    LinkConfig::new(gbps * GBPS, Duration::from_micros(1))
        .with_queue_limit(4 << 20)
        .with_ecn_threshold(100_000)
}

fn connect_all(sim: &mut Sim, pairs: &[(HostId, HostId)]) -> Vec<ConnectionHandle> {
    let conns: Vec<_> = pairs
        .iter()
        .map(|&(s, d)| sim.connect_endpoints(s, d).unwrap())
        .collect();
    sim.run_while(|s| {
        s.elapsed() < Duration::from_millis(50)
            && pairs
                .iter()
                .zip(&conns)
                .any(|(&(h, _), &c)| !s.endpoint(h).is_established(c))
    });
    conns
}

/// Post a WRITE of `pattern(i as u64, len)` per pair (wr_id = `wr_id`); returns the target lkeys.
fn post_all(
    sim: &mut Sim,
    pairs: &[(HostId, HostId)],
    conns: &[ConnectionHandle],
    len: usize,
    wr_id: u64,
) -> Vec<u32> {
    pairs
        .iter()
        .zip(conns)
        .enumerate()
        .map(|(i, (&(s, d), &c))| {
            let src = sim
                .endpoint_mut(s)
                .register_mr(pattern(i as u64, len), Access::LOCAL_WRITE);
            let dst = sim
                .endpoint_mut(d)
                .register_mr(vec![0; len], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
            let req = WriteRequest {
                wr_id,
                lkey: src.lkey,
                local_offset: 0,
                len: len as u32,
                remote_addr: dst.addr,
                rkey: dst.rkey,
                imm: None,
            };
            sim.endpoint_mut(s).post_write(c, req).unwrap();
            dst.lkey
        })
        .collect()
}

fn completed(sim: &Sim, h: HostId, wr_id: u64) -> Option<Duration> {
    sim.events(h).iter().find_map(|e| match &e.event {
        Event::Completion { wc, .. } if wc.wr_id == wr_id => Some(e.time),
        _ => None,
    })
}

fn jain(x: &[f64]) -> f64 {
    let s: f64 = x.iter().sum();
    let s2: f64 = x.iter().map(|v| v * v).sum();
    if s2 == 0.0 {
        1.0
    } else {
        s * s / (x.len() as f64 * s2)
    }
}

struct IncastWave {
    /// Jain's index of the senders' windows at the end of each RTT until the first sender
    /// finished.
    window_jain: Vec<f64>,
    /// Jain's index of per-sender goodput at the sink over the first `k` RTTs, for k = 1..
    cumulative_jain: Vec<f64>,
    peak_queue: u64,
}

/// 16-to-1 incast (sink alone on its leaf, 100 Gbit/s host links, 400 Gbit/s fabric), two
/// waves 100 µs apart; returns what the second (warm) wave measured.
fn incast(fair_share: bool) -> IncastWave {
    const N: usize = 16;
    let mut sim = Sim::new(SimConfig::with_seed(3));
    sim.set_host_config(move |_, cfg| {
        if fair_share {
            cfg.transport.recv_capacity_mbps = 100_000;
        }
    });
    let t = sim.leaf_spine(2, 2, N, link(100), link(400));
    let sink = t.hosts[0];
    let senders: Vec<HostId> = t.hosts[N..2 * N].to_vec();
    let pairs: Vec<_> = senders.iter().map(|&s| (s, sink)).collect();
    let conns = connect_all(&mut sim, &pairs);
    let len = 512 << 10;
    // Wave 1 (cold): the receiver learns its senders.
    let lkeys = post_all(&mut sim, &pairs, &conns, len, 1);
    sim.run_while(|s| {
        s.elapsed() < Duration::from_secs(1)
            && senders.iter().any(|&h| completed(s, h, 1).is_none())
    });
    for (i, &k) in lkeys.iter().enumerate() {
        assert_eq!(
            sim.endpoint(sink).mr_read(k, 0, len as u64).unwrap(),
            &pattern(i as u64, len)[..]
        );
    }
    sim.run_for(Duration::from_micros(100));

    // Wave 2 (warm), measured.
    let rtt = Duration::from_micros(9);
    let start = sim.elapsed();
    let index: HashMap<_, _> = senders
        .iter()
        .enumerate()
        .map(|(i, &h)| (sim.ip(h), i))
        .collect();
    let bins: Rc<RefCell<Vec<Vec<f64>>>> = Rc::default();
    let peak = Rc::new(RefCell::new(0u64));
    let sink_down = t.host_links[0].reverse;
    {
        let (bins, peak) = (bins.clone(), peak.clone());
        sim.set_trace(move |e| match (e.kind, e.location) {
            (TraceKind::Deliver, Location::Host(h)) if h == sink => {
                if let (Some(Opcode::MR_WRITE), Some(&i)) = (e.opcode, index.get(e.flow.src.ip())) {
                    let k = ((e.time - start).as_nanos() / rtt.as_nanos()) as usize;
                    let mut b = bins.borrow_mut();
                    while b.len() <= k {
                        b.push(vec![0.0; N]);
                    }
                    b[k][i] += f64::from(e.len);
                }
            }
            (TraceKind::Enqueue, Location::Link(l)) if l == sink_down => {
                let mut p = peak.borrow_mut();
                *p = (*p).max(e.queue_bytes);
            }
            _ => {}
        });
    }
    let lkeys = post_all(&mut sim, &pairs, &conns, len, 2);
    let mut window_jain = Vec::new();
    let mut first_done = None;
    let mut tick = 0;
    while senders.iter().any(|&h| completed(&sim, h, 2).is_none()) {
        assert!(
            sim.elapsed() < start + Duration::from_secs(1),
            "incast stuck"
        );
        tick += 1;
        sim.run_until(start + rtt * tick);
        if first_done.is_none() {
            first_done = senders.iter().find_map(|&h| completed(&sim, h, 2));
        }
        if first_done.is_none() {
            let w: Vec<f64> = senders
                .iter()
                .zip(&conns)
                .map(|(&h, &c)| f64::from(sim.endpoint(h).connection_stats(c).unwrap().send_window))
                .collect();
            window_jain.push(jain(&w));
        }
    }
    sim.clear_trace();
    for (i, &k) in lkeys.iter().enumerate() {
        assert_eq!(
            sim.endpoint(sink).mr_read(k, 0, len as u64).unwrap(),
            &pattern(i as u64, len)[..],
            "sender {i}'s data"
        );
    }
    let bins = bins.borrow();
    let horizon = ((first_done.unwrap() - start).as_nanos() / rtt.as_nanos()) as usize;
    let mut sum = vec![0.0; N];
    let cumulative_jain = bins[..horizon.min(bins.len())]
        .iter()
        .map(|b| {
            for (x, y) in sum.iter_mut().zip(b) {
                *x += y;
            }
            jain(&sum)
        })
        .collect();
    let peak_queue = *peak.borrow();
    IncastWave {
        window_jain,
        cumulative_jain,
        peak_queue,
    }
}

/// Receiver-driven fair share on a 16-to-1 incast whose senders the receiver knows: every
/// sender's window is equal from the first round trip, goodput is fair (Jain >= 0.95) over
/// the first few round trips, and the sink's queue stays a fraction of what AIMD alone
/// builds on the same fabric.
#[test]
fn incast_fair_share_is_fair_within_round_trips() {
    let fair = incast(true);
    let aimd = incast(false);
    assert!(
        fair.window_jain.iter().all(|&j| j >= 0.95),
        "windows unequal: {:?}",
        fair.window_jain
    );
    // Bin k holds about 27 packets for 16 senders: fairness is visible from a few bins on.
    let settled = fair
        .cumulative_jain
        .iter()
        .position(|&j| j >= 0.95)
        .expect("goodput never fair");
    assert!(
        settled <= 4 && fair.cumulative_jain[settled..].iter().all(|&j| j >= 0.95),
        "goodput Jain by RTT: {:?}",
        fair.cumulative_jain
    );
    assert!(
        fair.peak_queue * 4 < aimd.peak_queue,
        "fair share peak queue {} B vs AIMD alone {} B",
        fair.peak_queue,
        aimd.peak_queue
    );
}

/// Cold start: 32 senders open new connections to one sink at the same instant and post a
/// WRITE the moment each is established. Returns the Jain index of the senders' windows at
/// the end of each RTT (from the first establishment until the first completion), the
/// sink's peak queue and the packets dropped anywhere.
fn cold_incast(fair_share: bool) -> (Vec<f64>, u64, u64) {
    const N: usize = 32;
    let mut sim = Sim::new(SimConfig::with_seed(5));
    sim.set_host_config(move |_, cfg| {
        if fair_share {
            cfg.transport.recv_capacity_mbps = 100_000;
        }
    });
    let t = sim.leaf_spine(3, 2, 16, link(100), link(400));
    let sink = t.hosts[0];
    let senders: Vec<HostId> = t.hosts[16..16 + N].to_vec();
    let len = 256 << 10;
    let mut reqs = HashMap::new();
    let mut lkeys = Vec::new();
    for (i, &s) in senders.iter().enumerate() {
        let src = sim
            .endpoint_mut(s)
            .register_mr(pattern(i as u64, len), Access::LOCAL_WRITE);
        let dst = sim
            .endpoint_mut(sink)
            .register_mr(vec![0; len], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        lkeys.push(dst.lkey);
        let req = WriteRequest {
            wr_id: 1,
            lkey: src.lkey,
            local_offset: 0,
            len: len as u32,
            remote_addr: dst.addr,
            rkey: dst.rkey,
            imm: None,
        };
        reqs.insert(s, req);
    }
    let conns: Vec<_> = senders
        .iter()
        .map(|&s| sim.connect_endpoints(s, sink).unwrap())
        .collect();
    let posted = Rc::new(RefCell::new(0usize));
    let p = posted.clone();
    sim.set_event_handler(move |ctx, ev| {
        if let Event::Connected(c) = ev {
            if let Some(req) = reqs.remove(&ctx.host) {
                ctx.endpoint.post_write(*c, req).unwrap();
                *p.borrow_mut() += 1;
            }
        }
        false
    });
    let peak = Rc::new(RefCell::new(0u64));
    let sink_down = t.host_links[0].reverse;
    {
        let peak = peak.clone();
        sim.set_trace(move |e| {
            if let (TraceKind::Enqueue, Location::Link(l)) = (e.kind, e.location) {
                if l == sink_down {
                    let mut p = peak.borrow_mut();
                    *p = (*p).max(e.queue_bytes);
                }
            }
        });
    }
    sim.run_while(|s| *posted.borrow() == 0 && s.elapsed() < Duration::from_millis(10));
    let rtt = Duration::from_micros(9);
    let start = sim.elapsed();
    let mut window_jain = Vec::new();
    let mut tick = 0;
    while senders.iter().any(|&h| completed(&sim, h, 1).is_none()) {
        assert!(
            sim.elapsed() < start + Duration::from_secs(1),
            "incast stuck"
        );
        tick += 1;
        sim.run_until(start + rtt * tick);
        if senders.iter().all(|&h| completed(&sim, h, 1).is_none()) {
            let w: Vec<f64> = senders
                .iter()
                .zip(&conns)
                .map(|(&h, &c)| f64::from(sim.endpoint(h).connection_stats(c).unwrap().send_window))
                .collect();
            window_jain.push(jain(&w));
        }
    }
    sim.clear_trace();
    sim.clear_event_handler();
    for (i, &k) in lkeys.iter().enumerate() {
        assert_eq!(
            sim.endpoint(sink).mr_read(k, 0, len as u64).unwrap(),
            &pattern(i as u64, len)[..],
            "sender {i}'s data"
        );
    }
    let drops = sim.links().map(|l| sim.link_stats(l).drops.total()).sum();
    let peak_queue = *peak.borrow();
    (window_jain, peak_queue, drops)
}

/// Senders announced ahead of their data: in a cold 32-to-1 incast of new connections,
/// the receiver counts each connection from its establishment and the Accept carries the
/// grant, so the senders' windows are equal (Jain >= 0.95) from the second round trip on,
/// and the blind first round trip stays far below what AIMD alone dumps into the sink.
#[test]
fn cold_incast_windows_equal_within_two_round_trips() {
    let (fair, fair_peak, fair_drops) = cold_incast(true);
    let (_, aimd_peak, _) = cold_incast(false);
    assert!(fair.len() > 10, "too few round trips measured: {fair:?}");
    assert!(
        fair[1..].iter().all(|&j| j >= 0.95),
        "window Jain by RTT: {fair:?}"
    );
    assert_eq!(fair_drops, 0);
    assert!(
        fair_peak * 4 < aimd_peak,
        "fair share peak queue {fair_peak} B vs AIMD alone {aimd_peak} B"
    );
}

/// Aggregate goodput (4096 data bytes per WRITE packet delivered) between 20 % and 80 % of
/// the first completion, in Gbit/s, of a permutation on 2 leaves × 4 hosts and 4 spines.
fn permutation(paths: u16) -> f64 {
    let mut sim = Sim::new(SimConfig::with_seed(5));
    sim.set_host_config(move |_, cfg| cfg.transport.paths = paths);
    let t = sim.leaf_spine(2, 4, 4, link(100), link(100));
    let pairs: Vec<_> = (0..8).map(|k| (t.hosts[k], t.hosts[(k + 4) % 8])).collect();
    let conns = connect_all(&mut sim, &pairs);
    let delivered: Rc<RefCell<Vec<(Duration, u32)>>> = Rc::default();
    {
        let d = delivered.clone();
        sim.set_trace(move |e| {
            if let (TraceKind::Deliver, Some(Opcode::MR_WRITE)) = (e.kind, e.opcode) {
                d.borrow_mut().push((e.time, e.len.min(4096)));
            }
        });
    }
    let start = sim.elapsed();
    let len = 2 << 20;
    let lkeys = post_all(&mut sim, &pairs, &conns, len, 1);
    sim.run_while(|s| {
        s.elapsed() < start + Duration::from_secs(1)
            && pairs.iter().any(|&(h, _)| completed(s, h, 1).is_none())
    });
    sim.clear_trace();
    for (i, (&k, &(_, d))) in lkeys.iter().zip(&pairs).enumerate() {
        assert_eq!(
            sim.endpoint(d).mr_read(k, 0, len as u64).unwrap(),
            &pattern(i as u64, len)[..]
        );
    }
    let first = pairs
        .iter()
        .filter_map(|&(h, _)| completed(&sim, h, 1))
        .min()
        .unwrap()
        - start;
    let (a, b) = (start + first.mul_f64(0.2), start + first.mul_f64(0.8));
    let bytes: u64 = delivered
        .borrow()
        .iter()
        .filter(|(t, _)| *t >= a && *t < b)
        .map(|&(_, l)| u64::from(l))
        .sum();
    bytes as f64 * 8.0 / (b - a).as_secs_f64() / 1e9
}

/// Spraying over 8 paths fills most of a leaf-spine's bisection on permutation traffic,
/// where a single path per connection loses to ECMP collisions.
#[test]
fn permutation_spraying_beats_a_single_path() {
    let bisection = 8.0 * 100.0;
    let one = permutation(1);
    let eight = permutation(8);
    assert!(
        eight >= 0.85 * bisection,
        "8 paths: {eight:.0} Gbit/s of {bisection}"
    );
    assert!(
        eight > 1.2 * one,
        "8 paths {eight:.0} Gbit/s vs 1 path {one:.0} Gbit/s"
    );
}

/// Two single-switch planes, paths grouped by plane: a plane that fails in the middle of a
/// transfer loses its paths to the other plane (no error, right data), and gets them back
/// once it is up again and a probe got through.
#[test]
fn plane_failure_moves_paths_and_they_come_back() {
    let mut sim = Sim::new(SimConfig {
        uplink_policy: UplinkPolicy::SourcePort,
        ..SimConfig::with_seed(11)
    });
    sim.set_host_config(|_, cfg| {
        cfg.transport.paths = 8;
        cfg.transport.planes = 2;
        cfg.transport.min_rto = Duration::from_micros(200);
        cfg.transport.plane_retry_interval = Duration::from_micros(300);
    });
    let mp = sim.multi_plane(2, 2, PlaneShape::SingleSwitch, link(100), link(100));
    let (a, b) = (mp.hosts[0], mp.hosts[1]);
    let conns = connect_all(&mut sim, &[(a, b)]);
    let c = conns[0];
    let on_plane = |sim: &Sim, plane: u16| {
        sim.endpoint(a)
            .connection_stats(c)
            .unwrap()
            .paths
            .iter()
            .filter(|p| !p.failed && p.src_port % 2 == plane)
            .count()
    };
    assert_eq!(
        (on_plane(&sim, 0), on_plane(&sim, 1)),
        (4, 4),
        "spread evenly"
    );
    let len = 24 << 20;
    let lkeys = post_all(&mut sim, &[(a, b)], &conns, len, 1);
    let t0 = sim.elapsed();
    for l in mp.planes[1].all_links() {
        sim.schedule(t0 + Duration::from_micros(300), Action::LinkDown(l));
        sim.schedule(t0 + Duration::from_micros(1300), Action::LinkUp(l));
    }
    let mut min_on_failed = usize::MAX;
    let mut max_on_failed_after = 0;
    while completed(&sim, a, 1).is_none() {
        assert!(
            sim.elapsed() < t0 + Duration::from_secs(1),
            "transfer stuck"
        );
        sim.run_for(Duration::from_micros(20));
        let t = sim.elapsed() - t0;
        if t > Duration::from_micros(300) && t < Duration::from_micros(1300) {
            min_on_failed = min_on_failed.min(on_plane(&sim, 1));
        }
        if t > Duration::from_micros(1300) {
            max_on_failed_after = max_on_failed_after.max(on_plane(&sim, 1));
        }
    }
    assert_eq!(sim.host_stats(a).completion_errors, 0);
    assert_eq!(sim.host_stats(a).connections_lost, 0);
    assert_eq!(
        sim.endpoint(b).mr_read(lkeys[0], 0, len as u64).unwrap(),
        &pattern(0_u64, len)[..]
    );
    assert_eq!(min_on_failed, 0, "paths left the failed plane");
    assert!(
        max_on_failed_after >= 3,
        "paths went back to the plane once it was up ({max_on_failed_after})"
    );
}

/// SENDs on a connection whose paths span two planes: every message arrives once, in order,
/// on every stream. The plane travels in PathEth byte 8; a plane in the flags byte would
/// collide with the stream-abort flag (bit 1) and kill streams on plane 1.
#[test]
fn sends_over_two_planes_are_all_delivered() {
    let mut sim = Sim::new(SimConfig {
        uplink_policy: UplinkPolicy::SourcePort,
        ..SimConfig::with_seed(5)
    });
    sim.set_host_config(|_, cfg| {
        cfg.transport.paths = 4;
        cfg.transport.planes = 2;
    });
    let mp = sim.multi_plane(2, 2, PlaneShape::SingleSwitch, link(100), link(100));
    let (a, b) = (mp.hosts[0], mp.hosts[1]);
    let c = connect_all(&mut sim, &[(a, b)])[0];
    let (streams, per_stream) = (3u32, 40u64);
    for k in 0..per_stream {
        for s in 0..streams {
            let msg = pattern(
                ((s as usize) * 1000 + k as usize) as u64,
                1000 + 3000 * (k as usize % 4),
            );
            let wr_id = u64::from(s) * per_stream + k;
            sim.endpoint_mut(a)
                .post_send(c, s, wr_id, msg.into())
                .unwrap();
        }
    }
    sim.run_while(|s| {
        s.elapsed() < Duration::from_millis(100)
            && s.events(a)
                .iter()
                .filter(|e| matches!(e.event, Event::Completion { .. }))
                .count()
                < (streams as u64 * per_stream) as usize
    });
    let mut got: HashMap<u32, Vec<Vec<u8>>> = HashMap::new();
    for e in sim.events(b) {
        if let Event::Message { stream, data, .. } = &e.event {
            got.entry(*stream).or_default().push(data.to_vec());
        }
    }
    for s in 0..streams {
        let want: Vec<Vec<u8>> = (0..per_stream)
            .map(|k| {
                pattern(
                    ((s as usize) * 1000 + k as usize) as u64,
                    1000 + 3000 * (k as usize % 4),
                )
            })
            .collect();
        assert_eq!(got.get(&s), Some(&want), "stream {s}");
    }
    let ok = sim
        .events(a)
        .iter()
        .filter(|e| {
            matches!(&e.event, Event::Completion { wc, .. } if wc.status == metaroce::WcStatus::Success)
        })
        .count();
    assert_eq!(ok, (streams as u64 * per_stream) as usize);
    let stats = sim.endpoint(a).connection_stats(c).unwrap();
    for plane in 0..2 {
        assert!(
            stats.paths.iter().any(|p| p.src_port % 2 == plane),
            "a path on plane {plane}"
        );
    }
}
