//! `metaroce::sim`: two hosts through one switch — connections, streams, RDMA WRITE; link
//! rate, delay, queue limit, ECN and impairments; determinism of the trace.
//!
//! Run with `cargo test -p metaroce --features sim`.
#![cfg(feature = "sim")]

use bytes::Bytes;
use metaroce::sim::{
    Action, GilbertElliott, HostId, Impairments, LinkConfig, LinkPair, Sim, SimConfig, TraceEvent,
    TraceKind, GBPS,
};
use metaroce::testing::pattern;
use metaroce::{Access, ConnectionHandle, Event, WcOpcode, WcStatus, WriteRequest};
use std::cell::RefCell;
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::rc::Rc;
use std::time::Duration;

struct TwoHosts {
    sim: Sim,
    a: HostId,
    b: HostId,
    /// a ↔ switch.
    a_link: LinkPair,
    /// b ↔ switch (`forward` is b → switch, `reverse` switch → b).
    b_link: LinkPair,
}

/// Two hosts on one switch; `b`'s link is `b_link`, `a`'s is `a_link`.
fn two_hosts(seed: u64, a_link: LinkConfig, b_link: LinkConfig) -> TwoHosts {
    let mut sim = Sim::new(SimConfig::with_seed(seed));
    let sw = sim.add_switch();
    let a = sim.add_host();
    let b = sim.add_host();
    let a_link = sim.connect(a, sw, a_link);
    let b_link = sim.connect(b, sw, b_link);
    TwoHosts {
        sim,
        a,
        b,
        a_link,
        b_link,
    }
}

fn fast_link() -> LinkConfig {
    LinkConfig::new(100 * GBPS, Duration::from_micros(1))
}

/// Register `data` at `a`, a zeroed region at `b`, post one WRITE of all of it; returns
/// (lkey of the target region at b, time the write was posted).
fn post_write(
    sim: &mut Sim,
    a: HostId,
    b: HostId,
    conn: ConnectionHandle,
    data: Vec<u8>,
    wr_id: u64,
) -> u32 {
    let len = data.len();
    let src = sim.endpoint_mut(a).register_mr(data, Access::LOCAL_WRITE);
    let dst = sim
        .endpoint_mut(b)
        .register_mr(vec![0; len], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    sim.endpoint_mut(a)
        .post_write(
            conn,
            WriteRequest {
                wr_id,
                lkey: src.lkey,
                local_offset: 0,
                len: len as u32,
                remote_addr: dst.addr,
                rkey: dst.rkey,
                imm: None,
            },
        )
        .unwrap();
    dst.lkey
}

/// Run until `host` has `n` successful completions, at most `limit` of simulated time.
fn wait_completions(sim: &mut Sim, host: HostId, n: u64, limit: Duration) {
    let deadline = sim.elapsed() + limit;
    sim.run_while(|s| s.host_stats(host).completions < n && s.elapsed() < deadline);
    let st = sim.host_stats(host);
    assert_eq!(
        st.completions, n,
        "only {} of {n} completions after {:?} (errors {}): {:?}",
        st.completions, limit, st.completion_errors, sim
    );
}

#[test]
fn connection_streams_and_write_through_one_switch() {
    let TwoHosts { mut sim, a, b, .. } = two_hosts(1, fast_link(), fast_link());
    let (c, s) = sim
        .connect_and_wait(a, b, Duration::from_millis(10))
        .expect("connection");
    assert!(sim.endpoint(a).is_established(c));
    assert!(sim.endpoint(b).is_established(s));
    assert_eq!(sim.host_stats(a).connected, 1);
    assert_eq!(sim.host_stats(b).incoming, 1);

    // Messages on four streams, of varied sizes.
    let mut expect: HashMap<u32, Vec<Vec<u8>>> = HashMap::new();
    let mut wr = 0;
    for m in 0..12 {
        for st in 0..4u32 {
            let data = pattern(wr, (m * 3001 + st as usize * 777) % 20_000);
            expect.entry(st).or_default().push(data.clone());
            sim.endpoint_mut(a)
                .post_send(c, st, wr, Bytes::from(data))
                .unwrap();
            wr += 1;
        }
    }
    // And an RDMA WRITE of 1 MiB + 5 bytes.
    let data = pattern(99, (1 << 20) + 5);
    let dst = post_write(&mut sim, a, b, c, data.clone(), wr);
    wait_completions(&mut sim, a, wr + 1, Duration::from_millis(100));

    // Completions, all successful (in posting order here: one stream, and the WRITE,
    // posted last, completes last).
    let wcs: Vec<_> = sim
        .drain_events(a)
        .filter_map(|e| match e.event {
            Event::Completion { wc, .. } => Some(wc),
            _ => None,
        })
        .collect();
    assert_eq!(wcs.len() as u64, wr + 1);
    for (i, wc) in wcs.iter().enumerate() {
        assert_eq!(wc.wr_id, i as u64);
        assert_eq!(wc.status, WcStatus::Success);
    }
    assert_eq!(wcs.last().unwrap().opcode, WcOpcode::RdmaWrite);

    // Messages: once each, in order per stream, bytes equal.
    let mut got: HashMap<u32, Vec<Bytes>> = HashMap::new();
    for e in sim.drain_events(b) {
        if let Event::Message { stream, data, conn } = e.event {
            assert_eq!(conn, s);
            got.entry(stream).or_default().push(data);
        }
    }
    for (st, msgs) in &expect {
        let g = &got[st];
        assert_eq!(g.len(), msgs.len(), "stream {st}");
        for (x, y) in g.iter().zip(msgs) {
            assert_eq!(&x[..], &y[..], "stream {st}");
        }
    }
    // The WRITE landed.
    let landed = sim.endpoint(b).mr_read(dst, 0, data.len() as u64).unwrap();
    assert!(landed == data[..], "WRITE bytes differ");
    assert_eq!(sim.endpoint(b).stats().bad_icrc, 0);
    assert!(sim.stats().events > 0);
    assert_eq!(sim.stats().packets_dropped, 0);
}

/// Goodput of a bulk WRITE over a 10 Gbit/s bottleneck: at most the rate, at least 70% of
/// it; the RTT is at least the propagation delay.
#[test]
fn bottleneck_rate_and_delay_are_respected() {
    let delay = Duration::from_micros(5);
    let bottleneck = LinkConfig::new(10 * GBPS, delay).with_queue_limit(4 << 20);
    let TwoHosts { mut sim, a, b, .. } =
        two_hosts(2, LinkConfig::new(100 * GBPS, delay), bottleneck);
    let (c, _) = sim
        .connect_and_wait(a, b, Duration::from_millis(10))
        .unwrap();
    let len = 32 << 20;
    let data = pattern(2, len);
    let t0 = sim.elapsed();
    let dst = post_write(&mut sim, a, b, c, data.clone(), 0);
    wait_completions(&mut sim, a, 1, Duration::from_secs(1));
    let t = sim.elapsed() - t0;
    let goodput = len as f64 * 8.0 / t.as_secs_f64();
    println!("goodput {:.2} Gbit/s in {t:?}", goodput / 1e9);
    assert!(
        goodput <= 10e9,
        "goodput {goodput} above the bottleneck rate"
    );
    assert!(
        goodput >= 7e9,
        "goodput {goodput} below 70% of the bottleneck"
    );
    assert!(sim.endpoint(b).mr_read(dst, 0, len as u64).unwrap() == data[..]);
    let st = sim.endpoint(a).connection_stats(c).unwrap();
    for p in &st.paths {
        let min = p.min_rtt.expect("rtt sample");
        assert!(
            min >= 4 * delay,
            "path {} min RTT {min:?} < 4 × {delay:?}",
            p.id
        );
    }
}

/// A small queue at the bottleneck drops packets; the transport recovers and every byte
/// lands.
#[test]
fn queue_limit_drops_and_transport_recovers() {
    let delay = Duration::from_micros(2);
    let bottleneck = LinkConfig::new(10 * GBPS, delay).with_queue_limit(64 << 10);
    let TwoHosts {
        mut sim,
        a,
        b,
        a_link,
        b_link,
    } = two_hosts(3, LinkConfig::new(100 * GBPS, delay), bottleneck);
    let (c, _) = sim
        .connect_and_wait(a, b, Duration::from_millis(10))
        .unwrap();
    let len = 8 << 20;
    let data = pattern(3, len);
    let dst = post_write(&mut sim, a, b, c, data.clone(), 0);
    wait_completions(&mut sim, a, 1, Duration::from_secs(2));
    let ls = sim.link_stats(b_link.reverse);
    println!("{ls:?}");
    assert!(ls.drops.queue_full > 0, "no tail drops: {ls:?}");
    assert!(ls.max_queue_bytes <= 64 << 10);
    assert!(ls.avg_queue_bytes > 0.0 && ls.avg_queue_bytes <= ls.max_queue_bytes as f64);
    let st = sim.endpoint(a).connection_stats(c).unwrap();
    let retx: u64 = st.paths.iter().map(|p| p.stats.retransmits).sum();
    assert!(retx > 0, "drops but no retransmissions");
    // The sender's NIC never drops, and backpressure keeps its queue within the NIC limit
    // plus one packet.
    let nic = sim.link_stats(a_link.forward);
    let limit = sim.config().nic_queue_bytes.unwrap();
    assert_eq!(nic.drops.total(), 0);
    assert!(nic.max_queue_bytes <= limit + 4200, "{nic:?}");
    assert!(sim.endpoint(b).mr_read(dst, 0, len as u64).unwrap() == data[..]);
}

/// The ECN threshold marks CE; the receiver echoes the marks and the sender counts them.
#[test]
fn ecn_threshold_marks_and_sender_sees_marks() {
    let delay = Duration::from_micros(2);
    let bottleneck = LinkConfig::new(10 * GBPS, delay)
        .with_queue_limit(4 << 20)
        .with_ecn_threshold(100_000);
    let TwoHosts {
        mut sim,
        a,
        b,
        b_link,
        ..
    } = two_hosts(4, LinkConfig::new(100 * GBPS, delay), bottleneck);
    let (c, _) = sim
        .connect_and_wait(a, b, Duration::from_millis(10))
        .unwrap();
    post_write(&mut sim, a, b, c, pattern(4, 8 << 20), 0);
    wait_completions(&mut sim, a, 1, Duration::from_secs(1));
    let ls = sim.link_stats(b_link.reverse);
    assert!(ls.ce_marks > 0, "no CE marks: {ls:?}");
    assert_eq!(ls.drops.total(), 0);
    let st = sim.endpoint(a).connection_stats(c).unwrap();
    let marks: u64 = st.paths.iter().map(|p| p.stats.ecn_marks).sum();
    assert!(marks > 0, "sender saw no ECN marks");
    let srv = sim.endpoint(b).connections().next().unwrap();
    assert!(sim.endpoint(b).connection_stats(srv).unwrap().ce_received > 0);
}

/// Loss, burst loss, duplication, reordering and corruption on a link: every impairment
/// happens, the ICRC catches the corruption, and the data still lands intact.
#[test]
fn impairments_are_applied_and_survived() {
    let delay = Duration::from_micros(2);
    let impaired = LinkConfig::new(40 * GBPS, delay).with_impairments(Impairments {
        loss: 0.01,
        burst: Some(GilbertElliott {
            p_good_to_bad: 0.002,
            p_bad_to_good: 0.3,
            loss_good: 0.0,
            loss_bad: 0.9,
        }),
        duplicate: 0.01,
        reorder: 0.05,
        reorder_delay: Duration::from_micros(20),
        corrupt: 0.01,
        blackhole: false,
    });
    let TwoHosts {
        mut sim,
        a,
        b,
        b_link,
        ..
    } = two_hosts(5, LinkConfig::new(100 * GBPS, delay), impaired);
    let (c, _) = sim
        .connect_and_wait(a, b, Duration::from_millis(50))
        .unwrap();
    let len = 8 << 20;
    let data = pattern(5, len);
    let dst = post_write(&mut sim, a, b, c, data.clone(), 0);
    wait_completions(&mut sim, a, 1, Duration::from_secs(5));
    let ls = sim.link_stats(b_link.reverse);
    println!("{ls:?}");
    assert!(ls.drops.random_loss > 0);
    assert!(ls.drops.burst_loss > 0);
    assert!(ls.duplicated > 0);
    assert!(ls.reordered > 0);
    assert!(ls.corrupted > 0);
    assert!(
        sim.endpoint(b).stats().bad_icrc > 0,
        "corruption not caught"
    );
    assert!(sim.endpoint(b).mr_read(dst, 0, len as u64).unwrap() == data[..]);
}

/// The only link to `b` goes down for 3 ms mid-transfer, then comes back: the transfer
/// stalls and then completes.
#[test]
fn scheduled_link_down_and_up() {
    let TwoHosts {
        mut sim,
        a,
        b,
        b_link,
        ..
    } = two_hosts(
        6,
        fast_link(),
        LinkConfig::new(10 * GBPS, Duration::from_micros(1)),
    );
    let (c, _) = sim
        .connect_and_wait(a, b, Duration::from_millis(10))
        .unwrap();
    let len = 16 << 20;
    let data = pattern(6, len);
    let t0 = sim.elapsed();
    let dst = post_write(&mut sim, a, b, c, data.clone(), 0);
    let down = t0 + Duration::from_millis(5);
    sim.schedule(down, Action::LinkDown(b_link.reverse));
    sim.schedule(
        down + Duration::from_millis(3),
        Action::LinkUp(b_link.reverse),
    );
    sim.run_until(down + Duration::from_millis(1));
    assert!(!sim.link_info(b_link.reverse).up);
    wait_completions(&mut sim, a, 1, Duration::from_secs(2));
    let ls = sim.link_stats(b_link.reverse);
    assert!(ls.drops.link_down > 0, "{ls:?}");
    assert!(sim.link_info(b_link.reverse).up);
    assert!(sim.endpoint(b).mr_read(dst, 0, len as u64).unwrap() == data[..]);
    // 16 MiB at 10 Gbit/s takes 13.4 ms; the outage adds to that.
    assert!(sim.elapsed() - t0 > Duration::from_millis(16));
}

/// An event handler reacts at once: each completion posts the next message (closed loop).
#[test]
fn event_handler_posts_work() {
    let TwoHosts { mut sim, a, b, .. } = two_hosts(7, fast_link(), fast_link());
    let (c, _) = sim
        .connect_and_wait(a, b, Duration::from_millis(10))
        .unwrap();
    let total = 50u64;
    let done = Rc::new(RefCell::new(Vec::new()));
    let log = done.clone();
    sim.set_event_handler(move |ctx, ev| match ev {
        Event::Completion { conn, wc } if ctx.host == a => {
            log.borrow_mut().push(ctx.time);
            if wc.wr_id + 1 < total {
                ctx.endpoint
                    .post_send(*conn, 0, wc.wr_id + 1, Bytes::from(vec![1u8; 10_000]))
                    .unwrap();
            }
            true
        }
        _ => false,
    });
    sim.endpoint_mut(a)
        .post_send(c, 0, 0, Bytes::from(vec![1u8; 10_000]))
        .unwrap();
    sim.run_while(|s| s.host_stats(b).messages < total && s.elapsed() < Duration::from_secs(1));
    assert_eq!(sim.host_stats(b).messages, total);
    sim.run_for(Duration::from_millis(1));
    let times = done.borrow();
    assert_eq!(times.len() as u64, total);
    assert!(times.windows(2).all(|w| w[0] < w[1]), "one at a time");
    // The handler consumed the completions; the messages are queued at b.
    assert!(sim
        .events(a)
        .iter()
        .all(|e| !matches!(e.event, Event::Completion { .. })));
    assert_eq!(
        sim.events(b)
            .iter()
            .filter(|e| matches!(e.event, Event::Message { .. }))
            .count() as u64,
        total
    );
}

/// Runs an impaired transfer with a trace hook; returns (hash of the trace, its length,
/// whether the kinds of events expected were seen).
fn traced_run(seed: u64) -> (u64, u64) {
    let link = LinkConfig::new(25 * GBPS, Duration::from_micros(2))
        .with_queue_limit(128 << 10)
        .with_ecn_threshold(32 << 10)
        .with_impairments(Impairments {
            loss: 0.02,
            reorder: 0.05,
            reorder_delay: Duration::from_micros(10),
            duplicate: 0.01,
            ..Default::default()
        });
    let mut sim = Sim::new(SimConfig::with_seed(seed));
    let t = sim.leaf_spine(2, 2, 2, link.clone(), link);
    let state = Rc::new(RefCell::new((DefaultHasher::new(), 0u64, [false; 4])));
    let st = state.clone();
    sim.set_trace(move |e: &TraceEvent| {
        let mut s = st.borrow_mut();
        e.hash(&mut s.0);
        s.1 += 1;
        let k = match e.kind {
            TraceKind::Enqueue => 0,
            TraceKind::Dequeue => 1,
            TraceKind::Drop(_) => 2,
            TraceKind::Deliver => 3,
            _ => return,
        };
        s.2[k] = true;
    });
    let conns: Vec<_> = (0..4)
        .map(|i| {
            sim.connect_endpoints(t.hosts[i], t.hosts[(i + 2) % 4])
                .unwrap()
        })
        .collect();
    sim.run_while(|s| {
        s.elapsed() < Duration::from_millis(200)
            && conns
                .iter()
                .enumerate()
                .any(|(i, &c)| !s.endpoint(t.hosts[i]).is_established(c))
    });
    for (i, &c) in conns.iter().enumerate() {
        for m in 0..20 {
            sim.endpoint_mut(t.hosts[i])
                .post_send(c, m % 3, m as u64, Bytes::from(pattern(m as u64, 30_000)))
                .unwrap();
        }
    }
    sim.run_while(|s| {
        s.elapsed() < Duration::from_secs(2)
            && t.hosts.iter().any(|&h| s.host_stats(h).completions < 20)
    });
    for &h in &t.hosts {
        assert_eq!(sim.host_stats(h).completions, 20, "seed {seed}");
    }
    let s = state.borrow();
    assert!(s.2.iter().all(|&x| x), "missing trace kinds: {:?}", s.2);
    let mut h = s.0.clone();
    sim.stats().events.hash(&mut h);
    (h.finish(), s.1)
}

#[test]
fn same_seed_same_trace_different_seed_different_trace() {
    let a = traced_run(42);
    let b = traced_run(42);
    assert_eq!(a, b, "same seed, different traces");
    let c = traced_run(43);
    assert_ne!(a.0, c.0, "different seeds, same trace");
}

/// Tracing adds dequeue events but does not change what happens.
#[test]
fn tracing_does_not_change_the_outcome() {
    let run = |trace: bool| {
        let link = LinkConfig::new(10 * GBPS, Duration::from_micros(1))
            .with_queue_limit(64 << 10)
            .with_impairments(Impairments {
                loss: 0.01,
                ..Default::default()
            });
        let TwoHosts { mut sim, a, b, .. } = two_hosts(8, link.clone(), link);
        let n = Rc::new(RefCell::new(0u64));
        if trace {
            let n = n.clone();
            sim.set_trace(move |_| *n.borrow_mut() += 1);
        }
        let (c, _) = sim
            .connect_and_wait(a, b, Duration::from_millis(10))
            .unwrap();
        post_write(&mut sim, a, b, c, pattern(8, 4 << 20), 0);
        wait_completions(&mut sim, a, 1, Duration::from_secs(1));
        let n = *n.borrow();
        (
            sim.elapsed(),
            sim.host_stats(b),
            sim.stats().packets_dropped,
            n,
        )
    };
    let (t1, h1, d1, n1) = run(false);
    let (t2, h2, d2, n2) = run(true);
    assert_eq!((t1, h1, d1), (t2, h2, d2));
    assert_eq!(n1, 0);
    assert!(n2 > 0);
}
