//! Two endpoints in memory, virtual clock, no sockets: delivery and WRITE integrity under
//! loss, reordering and duplication.

use bytes::Bytes;
use metaroce::testing::pattern;
use metaroce::testing::{Impair, Pair};
use metaroce::{Access, Event, WcOpcode, WcStatus, WriteRequest};
use std::collections::HashMap;
use std::time::Duration;

/// Post messages on several streams and check exactly-once, in-order delivery per stream
/// and one successful completion per message, in posting order per stream.
fn streams_case(seed: u64, impair: Impair, streams: u32, per_stream: u32) {
    let mut p = Pair::impaired(seed, impair);
    let (c, _s) = p.connect();
    let mut expect: HashMap<u32, Vec<Vec<u8>>> = HashMap::new();
    let mut wr = 0u64;
    for m in 0..per_stream {
        for st in 0..streams {
            let len = ((seed as usize + m as usize * 977 + st as usize * 131) % 5000)
                + (m as usize % 3) * 1024;
            let data = pattern(seed ^ (st as u64) << 32 ^ m as u64, len);
            expect.entry(st).or_default().push(data.clone());
            p.eps[0].post_send(c, st, wr, Bytes::from(data)).unwrap();
            wr += 1;
        }
    }
    let total = wr;
    let ok = p.run_until(Duration::from_secs(60), |p| {
        p.events[0]
            .iter()
            .filter(|e| matches!(e, Event::Completion { .. }))
            .count() as u64
            == total
            && p.events[1]
                .iter()
                .filter(|e| matches!(e, Event::Message { .. }))
                .count() as u64
                == total
    });
    assert!(
        ok,
        "seed {seed}: not everything completed; client events {}, server events {}",
        p.events[0].len(),
        p.events[1].len()
    );
    // Completions: once each, in posting order per stream (wr_id = m * streams + st),
    // all successful.
    let wcs: Vec<_> = p.events[0]
        .iter()
        .filter_map(|e| match e {
            Event::Completion { wc, .. } => Some(*wc),
            _ => None,
        })
        .collect();
    let mut next: HashMap<u64, u64> = HashMap::new();
    for wc in &wcs {
        let st = wc.wr_id % streams as u64;
        let want = next.entry(st).or_insert(st);
        assert_eq!(
            wc.wr_id, *want,
            "stream {st}: completions out of posting order"
        );
        *want += streams as u64;
        assert_eq!(wc.status, WcStatus::Success);
        assert_eq!(wc.opcode, WcOpcode::Send);
    }
    assert_eq!(wcs.len() as u64, total, "one completion per message");
    // Messages: exactly once and in order per stream.
    let mut got: HashMap<u32, Vec<Bytes>> = HashMap::new();
    for e in &p.events[1] {
        if let Event::Message { stream, data, .. } = e {
            got.entry(*stream).or_default().push(data.clone());
        }
    }
    for (st, msgs) in &expect {
        let g = &got[st];
        assert_eq!(g.len(), msgs.len(), "stream {st}: wrong message count");
        for (i, (a, b)) in g.iter().zip(msgs).enumerate() {
            assert_eq!(&a[..], &b[..], "stream {st} message {i} differs");
        }
    }
}

#[test]
fn messages_lossless() {
    streams_case(1, Impair::default(), 4, 20);
}

#[test]
fn messages_under_loss_reorder_duplication() {
    for seed in 0..6 {
        streams_case(
            seed,
            Impair {
                loss: 0.05,
                dup: 0.05,
                reorder: 0.1,
                ..Default::default()
            },
            5,
            15,
        );
    }
}

#[test]
fn messages_under_heavy_loss() {
    streams_case(
        7,
        Impair {
            loss: 0.25,
            ..Default::default()
        },
        3,
        10,
    );
}

#[test]
fn zero_length_messages_are_delivered() {
    let mut p = Pair::impaired(
        3,
        Impair {
            loss: 0.1,
            ..Default::default()
        },
    );
    let (c, _) = p.connect();
    for i in 0..10 {
        p.eps[0].post_send(c, 9, i, Bytes::new()).unwrap();
    }
    assert!(
        p.run_until(Duration::from_secs(10), |p| p.events[1].len() == 10
            && p.events[0].len() == 10)
    );
    assert!(p.events[1]
        .iter()
        .all(|e| matches!(e, Event::Message { data, stream: 9, .. } if data.is_empty())));
}

fn write_case(seed: u64, impair: Impair) {
    let mut p = Pair::impaired(seed, impair);
    let (c, _s) = p.connect();
    let len = 300_000usize;
    let src = pattern(seed, len);
    let local = p.eps[0].register_mr(src.clone(), Access::LOCAL_WRITE);
    let remote = p.eps[1].register_mr(
        vec![0; len + 4096],
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
    );
    // Several WRITEs of different sizes, the last ones with immediate data.
    let chunks = [
        (0usize, 100_000usize, None),
        (100_000, 1, None),
        (100_001, 99_999, Some(7u32)),
        (200_000, 100_000, Some(8)),
    ];
    for (i, &(off, n, imm)) in chunks.iter().enumerate() {
        p.eps[0]
            .post_write(
                c,
                WriteRequest {
                    wr_id: i as u64,
                    lkey: local.lkey,
                    local_offset: off as u64,
                    len: n as u32,
                    remote_addr: remote.addr + off as u64,
                    rkey: remote.rkey,
                    imm,
                },
            )
            .unwrap();
    }
    let ok = p.run_until(Duration::from_secs(60), |p| {
        p.events[0]
            .iter()
            .filter(|e| matches!(e, Event::Completion { .. }))
            .count()
            == chunks.len()
    });
    assert!(ok, "seed {seed}: WRITEs did not complete");
    for (i, e) in p.events[0].iter().enumerate() {
        match e {
            Event::Completion { wc, .. } => {
                assert_eq!(wc.wr_id, i as u64);
                assert_eq!(wc.status, WcStatus::Success);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    // Let late duplicates drain, then check memory and immediate completions.
    p.run_until(Duration::from_millis(50) + (p.now - p.start), |_| false);
    let dst = p.eps[1]
        .mr_read(remote.lkey, 0, (len + 4096) as u64)
        .unwrap();
    assert_eq!(&dst[..len], &src[..], "seed {seed}: WRITE data differs");
    assert!(
        dst[len..].iter().all(|&b| b == 0),
        "bytes written outside the target range"
    );
    let imms: Vec<_> = p.events[1]
        .iter()
        .filter_map(|e| match e {
            Event::WriteWithImm { imm, byte_len, .. } => Some((*imm, *byte_len)),
            _ => None,
        })
        .collect();
    let mut sorted = imms.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        vec![(7, 99_999), (8, 100_000)],
        "immediates must be reported exactly once each"
    );
}

#[test]
fn write_lossless() {
    write_case(11, Impair::default());
}

#[test]
fn write_under_loss_reorder_duplication() {
    for seed in 20..25 {
        write_case(
            seed,
            Impair {
                loss: 0.05,
                dup: 0.05,
                reorder: 0.1,
                ..Default::default()
            },
        );
    }
}

#[test]
fn write_access_violations_get_nak_and_write_nothing() {
    let mut p = Pair::impaired(
        5,
        Impair {
            loss: 0.05,
            ..Default::default()
        },
    );
    let (c, _) = p.connect();
    let src = pattern(5, 8192);
    let local = p.eps[0].register_mr(src, Access::LOCAL_WRITE);
    let good = p.eps[1].register_mr(vec![0; 8192], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let ro = p.eps[1].register_mr(vec![0; 8192], Access::LOCAL_WRITE | Access::REMOTE_READ);
    let cases = [
        ("wrong rkey", good.addr, good.rkey ^ 0x100, 4096u32),
        ("out of bounds", good.addr + 4096, good.rkey, 8192),
        ("before the region", good.addr - 1, good.rkey, 16),
        ("no REMOTE_WRITE", ro.addr, ro.rkey, 4096),
    ];
    for (i, (_, addr, rkey, len)) in cases.iter().enumerate() {
        let req = WriteRequest {
            wr_id: i as u64,
            lkey: local.lkey,
            local_offset: 0,
            len: *len,
            remote_addr: *addr,
            rkey: *rkey,
            imm: Some(1),
        };
        p.eps[0].post_write(c, req).unwrap();
    }
    // A good WRITE after the bad ones still works: errors are per operation.
    let req = WriteRequest {
        wr_id: 99,
        lkey: local.lkey,
        local_offset: 0,
        len: 100,
        remote_addr: good.addr,
        rkey: good.rkey,
        imm: None,
    };
    p.eps[0].post_write(c, req).unwrap();
    assert!(p.run_until(Duration::from_secs(30), |p| p.events[0].len()
        == cases.len() + 1));
    for (i, e) in p.events[0].iter().enumerate() {
        let Event::Completion { wc, .. } = e else {
            panic!("unexpected {e:?}")
        };
        if i < cases.len() {
            assert_eq!(
                wc.status,
                WcStatus::RemoteAccessError,
                "case {}",
                cases[i].0
            );
        } else {
            assert_eq!(wc.status, WcStatus::Success);
        }
    }
    let g = p.eps[1].mr_read(good.lkey, 0, 8192).unwrap();
    assert!(
        g[100..].iter().all(|&b| b == 0),
        "a refused WRITE wrote bytes"
    );
    assert!(p.eps[1]
        .mr_read(ro.lkey, 0, 8192)
        .unwrap()
        .iter()
        .all(|&b| b == 0));
    assert!(!p.events[1]
        .iter()
        .any(|e| matches!(e, Event::WriteWithImm { .. })));
}

#[test]
fn handshake_survives_loss_and_duplication() {
    for seed in 0..10 {
        let mut p = Pair::impaired(
            seed,
            Impair {
                loss: 0.3,
                dup: 0.3,
                ..Default::default()
            },
        );
        let (c, s) = p.connect();
        assert!(p.eps[0].is_established(c));
        assert!(p.eps[1].is_established(s));
        assert_eq!(
            p.eps[1].connections().count(),
            1,
            "a duplicated request must not create a second connection"
        );
    }
}

#[test]
fn blackhole_exhausts_retries_and_flushes() {
    let mut p = Pair::impaired(9, Impair::default());
    let (c, _) = p.connect();
    p.impair.blackhole = true;
    for i in 0..3 {
        p.eps[0]
            .post_send(c, 0, i, Bytes::from(vec![1u8; 5000]))
            .unwrap();
    }
    let ok = p.run_until(Duration::from_secs(120), |p| {
        p.events[0]
            .iter()
            .any(|e| matches!(e, Event::ConnectionLost { .. }))
    });
    assert!(ok, "connection did not fail: {:?}", p.events[0]);
    let statuses: Vec<_> = p.events[0]
        .iter()
        .filter_map(|e| match e {
            Event::Completion { wc, .. } => Some(wc.status),
            _ => None,
        })
        .collect();
    assert_eq!(
        statuses,
        vec![
            WcStatus::RetryExceeded,
            WcStatus::WrFlushError,
            WcStatus::WrFlushError
        ]
    );
    assert!(matches!(
        p.events[0].last(),
        Some(Event::ConnectionLost {
            reason: metaroce::ConnectionError::RetryExceeded,
            ..
        })
    ));
}

#[test]
fn ecn_marks_shrink_the_window_and_are_counted() {
    let mut p = Pair::impaired(
        4,
        Impair {
            ce: 0.2,
            ..Default::default()
        },
    );
    let (c, _) = p.connect();
    for i in 0..200 {
        p.eps[0]
            .post_send(c, 0, i, Bytes::from(vec![0u8; 8000]))
            .unwrap();
    }
    assert!(p.run_until(Duration::from_secs(30), |p| p.events[0].len() == 200));
    let st = p.eps[0].connection_stats(c).unwrap();
    let marks: u64 = st.paths.iter().map(|x| x.stats.ecn_marks).sum();
    assert!(marks > 0, "CE marks were not echoed");
    let max_window = st.paths.iter().map(|x| x.window).max().unwrap();
    assert!(max_window < 255, "windows did not react to CE marks");
}

#[test]
fn traffic_is_sprayed_over_every_path() {
    let mut p = Pair::impaired(2, Impair::default());
    let (c, _) = p.connect();
    for i in 0..100 {
        p.eps[0]
            .post_send(c, 0, i, Bytes::from(vec![0u8; 16384]))
            .unwrap();
    }
    assert!(p.run_until(Duration::from_secs(10), |p| p.events[0].len() == 100));
    let st = p.eps[0].connection_stats(c).unwrap();
    assert_eq!(st.paths.len(), 8);
    for path in &st.paths {
        assert!(
            path.stats.packets_sent > 50,
            "path {} carried only {} packets",
            path.id,
            path.stats.packets_sent
        );
    }
}

#[test]
fn garbage_datagrams_are_counted_not_fatal() {
    let mut p = Pair::impaired(8, Impair::default());
    let (c, _) = p.connect();
    let from = "10.0.0.1:49152".parse().unwrap();
    let mut x = 1u64;
    for n in 0..2000usize {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut d = pattern(x, n % 200);
        if n % 2 == 0 && d.len() > 12 {
            d[0] = 0xC0 + (n % 8) as u8; // MetaRoCE opcodes with random headers
            d[1] = 0;
        }
        p.eps[1].handle_datagram(p.now, from, None, None, &d);
    }
    assert!(
        p.eps[1].stats().malformed
            + p.eps[1].stats().bad_icrc
            + p.eps[1].stats().unknown_connection
            > 0
    );
    p.eps[0]
        .post_send(c, 0, 0, Bytes::from_static(b"still alive"))
        .unwrap();
    assert!(p.run_until(Duration::from_secs(5), |p| p.events[1]
        .iter()
        .any(|e| matches!(e, Event::Message { .. }))));
}

#[test]
fn psn_wraps_at_2_pow_24_without_loss_of_data() {
    let mut a = metaroce::testing::pair_config(0, 12);
    let mut b = metaroce::testing::pair_config(1, 12);
    a.initial_psn = Some(0xFF_FFF0);
    b.initial_psn = Some(0xFF_FFF0);
    let mut p = Pair::impaired_with_configs(
        12,
        Impair {
            loss: 0.05,
            reorder: 0.05,
            ..Default::default()
        },
        a,
        b,
    );
    let (c, _) = p.connect();
    let msgs: Vec<Vec<u8>> = (0..200).map(|i| pattern(i, 3000 + i as usize)).collect();
    for (i, m) in msgs.iter().enumerate() {
        p.eps[0]
            .post_send(c, 1, i as u64, Bytes::from(m.clone()))
            .unwrap();
    }
    assert!(p.run_until(Duration::from_secs(30), |p| p.events[1].len() == msgs.len()));
    let st = p.eps[0].connection_stats(c).unwrap();
    assert!(
        st.paths.iter().all(|x| x.stats.packets_sent > 16),
        "every path must cross the wrap: {:?}",
        st.paths
            .iter()
            .map(|x| x.stats.packets_sent)
            .collect::<Vec<_>>()
    );
    for (e, m) in p.events[1].iter().zip(&msgs) {
        let Event::Message { data, .. } = e else {
            panic!()
        };
        assert_eq!(&data[..], &m[..]);
    }
}

#[test]
fn blackholed_path_is_rerolled_to_a_new_source_port_and_recovers() {
    let mut p = Pair::impaired(
        21,
        Impair {
            blackhole_port: Some(0xC000),
            ..Default::default()
        },
    );
    let (c, _) = p.connect();
    let msgs: Vec<Vec<u8>> = (0..400).map(|i| pattern(i, 6000)).collect();
    for (i, m) in msgs.iter().enumerate() {
        p.eps[0]
            .post_send(c, 0, i as u64, Bytes::from(m.clone()))
            .unwrap();
    }
    assert!(p.run_until(Duration::from_secs(60), |p| p.events[1].len() == msgs.len()));
    for (e, m) in p.events[1].iter().zip(&msgs) {
        let Event::Message { data, .. } = e else {
            panic!("{e:?}")
        };
        assert_eq!(&data[..], &m[..]);
    }
    // Keep traffic flowing so the re-rolled path proves itself.
    for i in 0..200u64 {
        p.eps[0]
            .post_send(c, 0, 1000 + i, Bytes::from(vec![1u8; 6000]))
            .unwrap();
    }
    let active = |p: &Pair| {
        p.eps[0].connection_stats(c).unwrap().paths[0].state == metaroce::PathState::Active
    };
    assert!(
        p.run_until(Duration::from_secs(60), |p| p.events[1].len() == 600
            && active(p))
    );
    let st = p.eps[0].connection_stats(c).unwrap();
    let p0 = st.paths[0];
    assert!(p0.stats.rerolls >= 1, "path 0 was never re-rolled: {p0:?}");
    assert_ne!(p0.src_port, 0xC000, "path 0 still on the blackholed port");
    assert_eq!(p0.state, metaroce::PathState::Active, "{p0:?}");
    assert!(st
        .paths
        .iter()
        .all(|x| x.state == metaroce::PathState::Active));
}

#[test]
fn receiver_fair_share_caps_the_sender() {
    let a = metaroce::testing::pair_config(0, 30);
    let mut b = metaroce::testing::pair_config(1, 30);
    b.transport.recv_capacity_mbps = 400;
    let mut p = Pair::impaired_with_configs(30, Impair::default(), a, b);
    p.delay = Duration::from_micros(50);
    let (c, s) = p.connect();
    let total = 4_000_000usize;
    let start = p.now;
    for i in 0..40u64 {
        p.eps[0]
            .post_send(c, 0, i, Bytes::from(vec![3u8; total / 40]))
            .unwrap();
    }
    assert!(p.run_until(Duration::from_secs(30), |p| p.events[1].len() == 40));
    let elapsed = (p.now - start).as_secs_f64();
    let st = p.eps[0].connection_stats(c).unwrap();
    assert_eq!(st.peer_rate_hint_mbps, 400);
    assert_eq!(p.eps[1].connection_stats(s).unwrap().granted_rate_mbps, 400);
    // 4 MB at 400 Mbit/s takes at least ~80 ms; without the grant it takes a few ms here.
    let mbps = total as f64 * 8.0 / elapsed / 1e6;
    assert!(
        mbps < 400.0 * 1.25,
        "sender ignored the grant: {mbps:.0} Mbit/s"
    );
    assert!(
        mbps > 400.0 * 0.5,
        "sender far below the grant: {mbps:.0} Mbit/s"
    );
}

/// Most packets connection `c` of endpoint 0 has in flight (over all paths) while `n`
/// messages of 200 KB each go to endpoint 1 (`SEND`s, one per stream turn), with its
/// window grant as the sender last heard it.
fn most_in_flight(p: &mut Pair, conns: &[metaroce::ConnectionHandle], n: u64) -> (u32, Vec<u32>) {
    for i in 0..n {
        for &c in conns {
            p.eps[0]
                .post_send(c, 0, i, Bytes::from(vec![5u8; 200_000]))
                .unwrap();
        }
    }
    let want = conns.len() * n as usize;
    let mut most = 0;
    let done = p.run_until(Duration::from_secs(30), |p| {
        for &c in conns {
            let st = p.eps[0].connection_stats(c).unwrap();
            most = most.max(st.paths.iter().map(|x| x.in_flight).sum::<u32>());
        }
        p.events[1].len() >= want
    });
    assert!(done, "the messages were not delivered");
    let grants = conns
        .iter()
        .map(|&c| p.eps[0].connection_stats(c).unwrap().peer_window_grant)
        .collect();
    (most, grants)
}

/// The receiver window grant (`socket_recv_buffer`): a receiver with 256 KiB of socket
/// buffer grants its one active sender half of it, 128 packets of 1 KiB, and the sender
/// never has more in flight; two active senders get 64 each. Without it the same transfer
/// has far more in flight (the control, so this test can fail).
#[test]
fn receiver_window_grant_caps_packets_in_flight() {
    let run = |buffer: u64, conns: usize| {
        let a = metaroce::testing::pair_config(0, 32);
        let mut b = metaroce::testing::pair_config(1, 32);
        b.transport.socket_recv_buffer = buffer;
        b.transport.fair_share_window = Duration::from_secs(10);
        let mut p = Pair::impaired_with_configs(32, Impair::default(), a, b);
        p.delay = Duration::from_micros(50);
        let mut hs = Vec::new();
        for _ in 0..conns {
            let (c, s) = p.connect();
            hs.push((c, s));
        }
        let cs: Vec<_> = hs.iter().map(|&(c, _)| c).collect();
        let (most, grants) = most_in_flight(&mut p, &cs, 20);
        let granted: Vec<u32> = hs
            .iter()
            .map(|&(_, s)| p.eps[1].connection_stats(s).unwrap().granted_window)
            .collect();
        (most, grants, granted)
    };
    let (free, grants, granted) = run(0, 1);
    assert_eq!((grants, granted), (vec![0], vec![0]), "no buffer, no grant");
    assert!(free > 256, "the control never had much in flight: {free}");

    let (most, grants, granted) = run(256 << 10, 1);
    assert_eq!((grants, granted), (vec![128], vec![128]));
    assert!(most <= 128, "{most} packets in flight under a grant of 128");
    assert!(most >= 96, "the sender stayed far below its grant: {most}");

    let (most, grants, granted) = run(256 << 10, 2);
    assert_eq!((grants, granted), (vec![64, 64], vec![64, 64]));
    assert!(most <= 64, "{most} packets in flight under a grant of 64");
}

/// A receiver that reads nothing for longer than `fair_share_window` (its host did not run
/// it) counts no active sender when it comes back. The window grant must not then hand the
/// first sender heard the whole buffer: it stays divided among the most senders counted
/// within `window_grant_hold`. Four senders at 32 packets each (256 KiB of buffer, 1 KiB
/// packets) keep at most 32 through a 1.5 ms gap in delivery; with no hold (the control)
/// the first ones heard after the gap are granted more.
#[test]
fn window_grant_survives_a_gap_in_delivery() {
    use metaroce::testing::{Action, Filter, Rule};
    let run = |hold: Duration| {
        let a = metaroce::testing::pair_config(0, 33);
        let mut b = metaroce::testing::pair_config(1, 33);
        b.transport.socket_recv_buffer = 256 << 10;
        b.transport.window_grant_hold = hold;
        let mut p = Pair::with_configs(33, a, b);
        p.delay = Duration::from_micros(50);
        let hs: Vec<_> = (0..4).map(|_| p.connect()).collect();
        for i in 0..200u64 {
            for &(c, _) in &hs {
                p.eps[0]
                    .post_send(c, 0, i, Bytes::from(vec![5u8; 200_000]))
                    .unwrap();
            }
        }
        p.run_for(Duration::from_millis(5));
        let steady: Vec<u32> = hs
            .iter()
            .map(|&(c, _)| p.eps[0].connection_stats(c).unwrap().peer_window_grant)
            .collect();
        assert_eq!(steady, vec![32; 4], "four senders share 128 packets");
        // Every data packet to the receiver is held back 1.5 ms (a little more for each
        // connection in turn): for the receiver, no sender is active any more.
        let gap = Duration::from_micros(1500);
        let t = p.elapsed();
        for (k, &(_, s)) in hs.iter().enumerate() {
            let qpn = s.0;
            p.add_rule(Rule::between(
                t,
                t + gap,
                Filter::any().from(0).when(move |i| i.dest_qp == qpn),
                Action::Hold {
                    prob: 1.0,
                    after: gap + Duration::from_micros(30 * k as u64),
                },
            ));
        }
        let mut most = 0;
        let end = p.now + Duration::from_millis(10);
        while p.now < end && p.step() {
            for &(c, _) in &hs {
                most = most.max(p.eps[0].connection_stats(c).unwrap().peer_window_grant);
            }
        }
        most
    };
    assert!(
        run(Duration::ZERO) > 32,
        "the control never inflated a grant"
    );
    let most = run(Duration::from_millis(20));
    assert_eq!(
        most, 32,
        "a sender was granted {most} packets after the gap"
    );
}

/// A sharded receiver: the other shards' active senders (`set_other_shard_senders`) count
/// in this endpoint's fair share, so the shards together grant no more than the capacity;
/// `fair_share_senders` reports this endpoint's own count, which a driver publishes.
#[test]
fn fair_share_counts_the_other_shards_senders() {
    let a = metaroce::testing::pair_config(0, 31);
    let mut b = metaroce::testing::pair_config(1, 31);
    b.transport.recv_capacity_mbps = 400;
    b.transport.fair_share_window = Duration::from_secs(10);
    let mut p = Pair::impaired_with_configs(31, Impair::default(), a, b);
    let (c, s) = p.connect();
    assert_eq!(p.eps[1].fair_share_senders(p.now), 1);
    p.eps[1].set_other_shard_senders(3);
    p.eps[0]
        .post_send(c, 0, 1, Bytes::from(vec![1u8; 10_000]))
        .unwrap();
    assert!(p.run_until(Duration::from_secs(5), |p| !p.completions(0, c).is_empty()));
    assert_eq!(p.eps[1].fair_share_senders(p.now), 1, "its own count only");
    assert_eq!(p.eps[1].connection_stats(s).unwrap().granted_rate_mbps, 100);
    assert_eq!(
        p.eps[0].connection_stats(c).unwrap().peer_rate_hint_mbps,
        100
    );
    // The other shards' senders went idle: the whole capacity again.
    p.eps[1].set_other_shard_senders(0);
    p.eps[0]
        .post_send(c, 0, 2, Bytes::from(vec![2u8; 10_000]))
        .unwrap();
    assert!(p.run_until(Duration::from_secs(10), |p| p.completions(0, c).len() == 2));
    assert_eq!(p.eps[1].connection_stats(s).unwrap().granted_rate_mbps, 400);
    assert_eq!(
        p.eps[0].connection_stats(c).unwrap().peer_rate_hint_mbps,
        400
    );
}

/// `Endpoint::transport_config_mut` changes the transport defaults without validating
/// them. A server whose path MTU was set to 1000 bytes that way runs its connections at
/// 512, the largest IBA path MTU below it, and the client agrees to 512; messages of several
/// segments arrive intact both ways (the core's segment arithmetic needs a power of two:
/// with 1000 it counted 636 segments for 4 KiB).
#[test]
fn a_path_mtu_set_after_binding_is_rounded_down_to_an_iba_value() {
    let mut p = Pair::new(41);
    p.eps[1].transport_config_mut().pmtu = 1000;
    let (c, s) = p.connect();
    assert_eq!(p.eps[0].connection_stats(c).unwrap().pmtu, 512);
    assert_eq!(p.eps[1].connection_stats(s).unwrap().pmtu, 512);
    let (a, b) = (pattern(1, 4096), pattern(2, 3001));
    p.eps[0].post_send(c, 0, 1, Bytes::from(a.clone())).unwrap();
    p.eps[1].post_send(s, 0, 2, Bytes::from(b.clone())).unwrap();
    let done = |p: &Pair| {
        [0, 1].iter().all(|&i| {
            p.events[i].iter().any(
                |e| matches!(e, Event::Completion { wc, .. } if wc.status == WcStatus::Success),
            ) && p.events[i]
                .iter()
                .any(|e| matches!(e, Event::Message { .. }))
        })
    };
    assert!(p.run_until(Duration::from_secs(10), done));
    assert_eq!(p.messages(1, s)[&0], vec![Bytes::from(a)]);
    assert_eq!(p.messages(0, c)[&0], vec![Bytes::from(b)]);
}

/// `testing::check_completion_order`, which the harness and the fuzz checkers use, accepts
/// the orders docs/PROTOCOL.md "Completions" allows and refuses the others.
#[test]
fn the_completion_order_checker_follows_the_rule() {
    use metaroce::testing::check_completion_order as check;
    // wr 0: SEND on 1, wr 1: WRITE, wr 2: SEND on 2, wr 3: SEND on 1, wr 4: READ.
    let posted = [
        (0, Some(1)),
        (1, None),
        (2, Some(2)),
        (3, Some(1)),
        (4, None),
    ];
    assert!(check(&posted, &[0, 1, 2, 3, 4]).is_ok());
    assert!(
        check(&posted, &[1, 4, 2, 0, 3]).is_ok(),
        "streams and one-sided apart"
    );
    assert!(check(&posted, &[1, 2]).is_ok(), "a prefix");
    assert!(check(&posted, &[3, 0]).is_err(), "stream 1 out of order");
    assert!(check(&posted, &[4, 1]).is_err(), "one-sided out of order");
    assert!(
        check(&posted, &[2, 1]).is_err(),
        "a SEND before an earlier WRITE"
    );
    assert!(check(&posted, &[0, 0]).is_err(), "twice");
    assert!(check(&posted, &[9]).is_err(), "never posted");
}
