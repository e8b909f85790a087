//! Receive flow control with backpressure through the protocol (issue #10, item 4):
//! `explicit_consume`, `max_stream_recv_bytes`, flow-control RNR NAKs. Virtual time.

use bytes::Bytes;
use metaroce::testing::{pair_config as config, Action, Filter, Impair, Pair, Rule};
use metaroce::{Event, WcStatus};
use std::time::Duration;

const MIB: u64 = 1 << 20;
const STREAM_LIMIT: u64 = 4 * MIB;
const CONN_LIMIT: u64 = 16 * MIB;

fn pair(seed: u64, impair: Impair) -> Pair {
    pair_with(seed, impair, |_| {})
}

/// [`pair`], with `receiver` applied to B's config last.
fn pair_with(
    seed: u64,
    impair: Impair,
    receiver: impl FnOnce(&mut metaroce::EndpointConfig),
) -> Pair {
    let (a, b) = configs(seed, receiver);
    Pair::impaired_with_configs(seed, impair, a, b)
}

/// The configs of [`pair_with`].
fn configs(
    seed: u64,
    receiver: impl FnOnce(&mut metaroce::EndpointConfig),
) -> (metaroce::EndpointConfig, metaroce::EndpointConfig) {
    let mut a = config(0, seed);
    let mut b = config(1, seed);
    for c in [&mut a, &mut b] {
        c.transport.pmtu = 4096;
        c.transport.explicit_consume = true;
        c.transport.max_stream_recv_bytes = STREAM_LIMIT;
        c.transport.max_recv_buffer_bytes = CONN_LIMIT;
    }
    receiver(&mut b);
    (a, b)
}

/// Message `i` of a run: 1 MiB whose first byte is `i % 251`.
fn messages(n: usize) -> Vec<Bytes> {
    let base = Bytes::from(
        (0..MIB as usize + n)
            .map(|j| (j % 251) as u8)
            .collect::<Vec<_>>(),
    );
    (0..n).map(|i| base.slice(i..i + MIB as usize)).collect()
}

#[test]
fn one_gib_to_an_unread_stream_stays_bounded_then_arrives_in_order() {
    let mut p = pair(31, Impair::default());
    let (a, b) = p.connect();
    let n = 1024; // 1 GiB
    for (i, m) in messages(n).into_iter().enumerate() {
        p.eps[0].post_send(a, 1, i as u64, m).unwrap();
    }
    assert_eq!(p.eps[0].stream_send_pending(a, 1), n as u64 * MIB);
    // Nobody reads for 200 ms of virtual time.
    let t0 = p.now;
    let d0 = p.delivered;
    let mut peak = 0;
    while p.now - t0 < Duration::from_millis(200) {
        assert!(p.step());
        let s = p.eps[1].connection_stats(b).unwrap().recv;
        peak = peak.max(s.buffered_bytes);
    }
    let s = p.eps[1].connection_stats(b).unwrap().recv;
    let delivered_msgs = p.events[1]
        .iter()
        .filter(|e| matches!(e, Event::Message { .. }))
        .count();
    let pending = p.eps[0].stream_send_pending(a, 1);
    println!(
        "unread stream, 200 ms: peak buffered {peak} B (limit {STREAM_LIMIT} B), {delivered_msgs} messages handed out, \
         {} flow-control RNR NAKs, {} datagrams on the wire, sender pending {pending} B",
        s.flow_rnr_naks,
        p.delivered - d0
    );
    // Bounded: a stream holds at most 2 x max_stream_recv_bytes + one message (+128 B
    // bookkeeping per message), documented on `max_stream_recv_bytes`.
    let bound = 2 * STREAM_LIMIT + MIB + 128 * 16;
    assert!(peak <= bound, "peak {peak} > {bound}");
    assert!(s.flow_rnr_naks > 0);
    assert_eq!(s.no_buffer_drops, 0, "flow control must not drop");
    // The sender waits: nothing failed, most is still pending.
    assert!(p.events[0].iter().all(|e| match e {
        Event::Completion { wc, .. } => wc.status == WcStatus::Success,
        Event::ConnectionLost { .. } => false,
        _ => true,
    }));
    assert!(pending >= (n as u64) * MIB - bound);
    // The reader starts: consume each message as it is handed out.
    let mut got = 0usize;
    let mut bytes = 0u64;
    let t1 = p.now;
    loop {
        for e in std::mem::take(&mut p.events[1]) {
            if let Event::Message { stream, data, .. } = e {
                assert_eq!(stream, 1);
                assert_eq!(data.len() as u64, MIB);
                assert_eq!(data[0], (got % 251) as u8, "message {got} out of order");
                got += 1;
                bytes += data.len() as u64;
                p.eps[1].stream_consumed(b, 1, data.len() as u64);
            }
        }
        if got == n || !p.step() || p.now - t1 > Duration::from_secs(120) {
            break;
        }
    }
    println!(
        "after the reader started: {got} messages, {bytes} B in {:?}",
        p.now - t1
    );
    assert_eq!(got, n);
    assert_eq!(bytes, n as u64 * MIB);
    p.run_until(p.now - p.start + Duration::from_millis(50), |p| {
        p.eps[0].stream_send_pending(a, 1) == 0
    });
    assert_eq!(p.eps[0].stream_send_pending(a, 1), 0);
    let st = p.eps[1].connection_stats(b).unwrap().recv;
    assert_eq!(st.unconsumed_bytes, 0);
    assert_eq!(st.buffered_bytes, 0);
}

#[test]
fn an_unread_stream_does_not_block_the_others() {
    let mut p = pair(32, Impair::default());
    let (a, b) = p.connect();
    for (i, m) in messages(64).into_iter().enumerate() {
        p.eps[0].post_send(a, 1, i as u64, m).unwrap();
    }
    for (i, m) in messages(32).into_iter().enumerate() {
        p.eps[0].post_send(a, 2, 1000 + i as u64, m).unwrap();
    }
    let t0 = p.now;
    let mut got2 = 0;
    while p.now - t0 < Duration::from_secs(5) && got2 < 32 {
        if !p.step() {
            break;
        }
        for e in std::mem::take(&mut p.events[1]) {
            if let Event::Message {
                stream: 2, data, ..
            } = e
            {
                got2 += 1;
                p.eps[1].stream_consumed(b, 2, data.len() as u64);
            }
        }
    }
    println!(
        "stream 2: {got2} messages in {:?} beside an unread stream",
        p.now - t0
    );
    assert_eq!(got2, 32);
    let s = p.eps[1].connection_stats(b).unwrap().recv;
    assert!(
        s.buffered_bytes <= 2 * STREAM_LIMIT + MIB + 128 * 64,
        "{}",
        s.buffered_bytes
    );
}

#[test]
fn unconsumed_bytes_are_released_by_consumption() {
    let mut p = pair(33, Impair::default());
    let (a, b) = p.connect();
    p.eps[0]
        .post_send(a, 3, 1, Bytes::from(vec![5; 1000]))
        .unwrap();
    p.eps[0].post_send(a, 3, 2, Bytes::new()).unwrap();
    p.run_until(p.now - p.start + Duration::from_millis(10), |_| false);
    let s = p.eps[1].connection_stats(b).unwrap().recv;
    assert_eq!(s.unconsumed_bytes, 1000 + 128 + 128);
    p.eps[1].stream_consumed(b, 3, 400);
    assert_eq!(
        p.eps[1].connection_stats(b).unwrap().recv.unconsumed_bytes,
        600 + 256
    );
    // The rest, and the empty message after it.
    p.eps[1].stream_consumed(b, 3, 600);
    assert_eq!(
        p.eps[1].connection_stats(b).unwrap().recv.unconsumed_bytes,
        0
    );
    // More than was delivered: ignored.
    p.eps[1].stream_consumed(b, 3, 1 << 40);
    p.eps[1].stream_consumed(b, 99, 1);
    assert_eq!(p.eps[1].connection_stats(b).unwrap().recv.buffered_bytes, 0);
}

/// The limits of the slow-reader tests: 4 KiB path MTU, `explicit_consume`, 256 KiB per
/// stream.
fn slow_reader_limits(c: &mut metaroce::EndpointConfig) {
    c.transport.pmtu = 4096;
    c.transport.explicit_consume = true;
    c.transport.max_stream_recv_bytes = 256 << 10;
}

/// A posts `n` messages of 64 KiB on stream 1 of `(a, b)`; B reads like a slow reader,
/// consuming what it got once every `every` of virtual time. Every message must arrive
/// within 60 s of virtual time.
fn slow_reader_receives_all(
    p: &mut Pair,
    (a, b): (metaroce::ConnectionHandle, metaroce::ConnectionHandle),
    seed: u64,
    n: usize,
    every: Duration,
) {
    for i in 0..n {
        p.eps[0]
            .post_send(a, 1, i as u64, Bytes::from(vec![i as u8; 64 << 10]))
            .unwrap();
    }
    let (mut seen, mut owed, mut got) = (0usize, 0u64, 0usize);
    let mut next_consume = p.now;
    let limit = p.now + Duration::from_secs(60);
    while got < n && p.now < limit {
        if !p.step() {
            break;
        }
        for e in &p.events[1][seen..] {
            if let Event::Message { data, .. } = e {
                owed += data.len() as u64;
                got += 1;
            }
        }
        seen = p.events[1].len();
        if p.now >= next_consume && owed > 0 {
            p.eps[1].stream_consumed(b, 1, owed);
            owed = 0;
            next_consume = p.now + every;
        }
    }
    let st = p.eps[1].connection_stats(b).unwrap().recv;
    assert_eq!(
        got,
        n,
        "seed {seed}: {got} of {n} messages after {:?} (flow RNR NAKs {})",
        p.now - p.start,
        st.flow_rnr_naks
    );
}

/// Flow control under duplication and reordering (duplicate and late flow-control RNR
/// NAKs, spurious copies of a probe): a slow reader that consumes every 2 ms of virtual
/// time still receives every message; the sender's flow-control wait must never lose its
/// probe. Many seeds.
#[test]
fn a_slow_reader_under_duplication_and_reordering_receives_everything() {
    for seed in 0..12u64 {
        let mut a = config(0, 300 + seed);
        let mut b = config(1, 300 + seed);
        for c in [&mut a, &mut b] {
            slow_reader_limits(c);
        }
        let impair = Impair {
            dup: 0.3,
            reorder: 0.3,
            loss: 0.02,
            ..Impair::default()
        };
        let mut p = Pair::impaired_with_configs(300 + seed, impair, a, b);
        let (a, b) = p.connect();
        slow_reader_receives_all(&mut p, (a, b), seed, 64, Duration::from_millis(2));
    }
}

/// Every flow-control RNR NAK also arrives a second time 5 ms later (a late duplicate,
/// after the 0.64 ms RNR wait ended, when the segment may be the stream's probe): the late
/// copy is stale and must not cost the stream its probe, or every refused segment would
/// stay parked with nothing to wake it (a stall). A guard written while hunting the
/// `backpressure` stall: it passes (the path layer drops a NAK for a PSN no longer
/// outstanding before it reaches the flow-control wait).
#[test]
fn a_late_duplicate_flow_rnr_nak_does_not_lose_the_probe() {
    use metaroce::testing::{config as net_config, Action, Filter, Kind, Net, Rule};
    for seed in 0..6u64 {
        let mut a = net_config(0, 400 + seed);
        let mut b = net_config(1, 400 + seed);
        for c in [&mut a, &mut b] {
            slow_reader_limits(c);
        }
        let mut p = Net::with_configs(400 + seed, a, b);
        let (a, b) = p.connect();
        p.add_rule(Rule::always(
            Filter::any().from(1).kind(Kind::Nak),
            Action::Late {
                prob: 1.0,
                after: Duration::from_millis(5),
            },
        ));
        slow_reader_receives_all(&mut p, (a, b), seed, 48, Duration::from_millis(3));
    }
}

/// Without `explicit_consume`, a receive budget far below one message (`max_recv_buffer_bytes`
/// = 1: one next-due message at a time, through the reserve) and messages of several streams
/// in flight under jitter: every message arrives and the connection stays up. The receiver
/// used to drop the packets of the messages it had no room for silently, so while a long
/// message reassembled, the paths carrying the others took retransmission timeouts until
/// every path failed (RetryExceeded, prop_ops regression); now they get flow-control RNR NAKs.
/// With those, a segment refused while another copy of it was in flight and then taken
/// through that copy used to hold its stream's flow-control wait forever.
#[test]
fn a_tiny_library_buffer_refuses_with_rnr_and_every_stream_completes() {
    use metaroce::testing::{config as net_config, Action, Filter, Net, Rule};
    let mut naks = 0;
    for seed in 0..12u64 {
        let mut a = net_config(0, 700 + seed);
        let mut b = net_config(1, 700 + seed);
        for c in [&mut a, &mut b] {
            c.transport.pmtu = 256;
            c.transport.max_recv_buffer_bytes = 1;
        }
        let mut p = Net::with_configs(700 + seed, a, b);
        let (a, b) = p.connect();
        p.add_rule(Rule::always(
            Filter::any(),
            Action::Jitter {
                prob: 0.4,
                max: Duration::from_millis(2),
            },
        ));
        let lens = [16882usize, 56, 7654, 1027, 16622, 2048, 1001, 0];
        for (i, &len) in lens.iter().enumerate() {
            p.eps[0]
                .post_send(a, i as u32 % 5, i as u64, Bytes::from(vec![i as u8; len]))
                .unwrap();
        }
        let limit = p.elapsed() + Duration::from_secs(30);
        let n = lens.len();
        let done = p.run_until(limit, |n2| n2.completions(0, a).len() == n);
        let wcs = p.completions(0, a);
        let got = p.events[1]
            .iter()
            .filter(|e| matches!(e, Event::Message { .. }))
            .count();
        assert!(
            done && wcs.iter().all(|w| w.status == WcStatus::Success),
            "seed {seed}: {} of {n} SENDs completed ({:?}), {got} messages delivered, lost {:?}",
            wcs.len(),
            wcs.iter().map(|w| w.status).collect::<Vec<_>>(),
            p.lost(0, a)
        );
        assert_eq!(got, n, "seed {seed}");
        naks += p.eps[1].connection_stats(b).unwrap().recv.no_buffer_drops;
    }
    println!("refusals for lack of buffer over 12 seeds: {naks}");
    assert!(
        naks > 0,
        "the budget never refused anything: the test tests nothing"
    );
}

/// The receiver's `max_stream_window` (2 or 3 messages) is far below the sender's (the
/// default 1024); 32 messages of one stream are posted at once, under loss, duplication and
/// reordering, and the reader posts its receives only after 5 s (`require_posted_receives`;
/// the sender's `rnr_retry` = 7, retry forever): the head messages get RNR NAKs, the ones
/// further ahead wait outside the window. Those are refused with a flow-control RNR NAK and
/// the sender waits, one probe per RNR timer: every SEND completes Success, every message
/// lands in its receive with its bytes, no SEND completes Success before its receive did,
/// and the wait costs the sender a bounded number of packets. The receiver used to drop
/// them without a word, and the sender kept re-sending them: up to 36 578 packets sent
/// while it waited, against 7 347 now (mostly the head message's own RNR retries, one per
/// RNR timer). (The probe of a stream's
/// flow-control wait used to be parked, never re-sent, when it came back from a plain RNR
/// wait: the stream stalled for good once the receives came.)
#[test]
fn a_smaller_receiver_stream_window_refuses_with_rnr_and_every_message_completes() {
    use metaroce::{Access, RecvRequest};
    const SLOT: u64 = 8192;
    let (mut refusals, mut most_sent) = (0, 0);
    for seed in 0..8u64 {
        let mut a = config(0, 900 + seed);
        let mut b = config(1, 900 + seed);
        for c in [&mut a, &mut b] {
            c.transport.pmtu = 1024;
        }
        a.transport.rnr_retry = 7;
        b.transport.max_stream_window = 2 + seed as u32 % 2;
        b.transport.require_posted_receives = true;
        let impair = Impair {
            loss: 0.02,
            dup: 0.1,
            reorder: 0.2,
            ..Impair::default()
        };
        let mut p = Pair::impaired_with_configs(900 + seed, impair, a, b);
        let (a, b) = p.connect();
        let n = 32usize;
        let buf = p.eps[1].register_mr(vec![0; n * SLOT as usize], Access::LOCAL_WRITE);
        let sent: Vec<Vec<u8>> = (0..n)
            .map(|i| metaroce::testing::pattern(seed * 1000 + i as u64, 1 + i * 997 % 5000))
            .collect();
        for (i, m) in sent.iter().enumerate() {
            p.eps[0]
                .post_send(a, 7, i as u64, Bytes::from(m.clone()))
                .unwrap();
        }
        let sent_by_a = |p: &Pair| -> u64 {
            let st = p.eps[0].connection_stats(a).unwrap();
            st.paths.iter().map(|q| q.stats.packets_sent).sum()
        };
        let post_at = p.now + Duration::from_secs(5);
        let limit = p.now + Duration::from_secs(60);
        let (mut received, mut seen, mut done, mut waited) = (0usize, [0usize; 2], 0usize, None);
        while done < n && p.now < limit {
            if !p.step() {
                break;
            }
            for e in &p.events[1][seen[1]..] {
                if let Event::RecvCompletion { stream: 7, wc, .. } = e {
                    assert_eq!(wc.status, WcStatus::Success, "seed {seed}: {wc:?}");
                    assert_eq!(wc.wr_id as usize, received, "seed {seed}: out of order");
                    assert_eq!(wc.byte_len as usize, sent[received].len(), "seed {seed}");
                    received += 1;
                }
            }
            // Checked after every step: a SEND reported Success has its message received.
            for e in &p.events[0][seen[0]..] {
                if let Event::Completion { wc, .. } = e {
                    done += 1;
                    assert!(
                        wc.status != WcStatus::Success || (wc.wr_id as usize) < received,
                        "seed {seed}: SEND {} completed Success, {received} receives completed",
                        wc.wr_id
                    );
                }
            }
            seen = [p.events[0].len(), p.events[1].len()];
            if waited.is_none() && p.now >= post_at {
                waited = Some(sent_by_a(&p));
                for i in 0..n as u64 {
                    let r = RecvRequest {
                        wr_id: i,
                        lkey: buf.lkey,
                        offset: i * SLOT,
                        len: SLOT as u32,
                    };
                    p.eps[1].post_recv(b, 7, r).unwrap();
                }
            }
        }
        let wcs = p.completions(0, a);
        let st = p.eps[1].connection_stats(b).unwrap().recv;
        assert!(
            wcs.len() == n && wcs.iter().all(|w| w.status == WcStatus::Success),
            "seed {seed}: {} of {n} SENDs completed ({:?}), {received} receives completed, \
             lost {:?}, {} stream-window refusals",
            wcs.len(),
            wcs.iter().map(|w| w.status).collect::<Vec<_>>(),
            p.lost(0, a),
            st.stream_window_naks
        );
        assert_eq!(received, n, "seed {seed}");
        for (i, m) in sent.iter().enumerate() {
            let got = p.eps[1]
                .mr_read(buf.lkey, i as u64 * SLOT, m.len() as u64)
                .unwrap();
            assert!(got == *m, "seed {seed}: message {i} bytes differ");
        }
        refusals += st.stream_window_naks;
        most_sent = most_sent.max(waited.unwrap_or(u64::MAX));
    }
    println!(
        "stream-window refusals over 8 seeds: {refusals}; most packets the sender sent in the \
         5 s before the receives were posted: {most_sent}"
    );
    assert!(
        refusals > 0,
        "the stream window never refused anything: the test tests nothing"
    );
    // The wait is paced by the RNR timer, not by retransmission timeouts.
    assert!(
        most_sent < 15_000,
        "{most_sent} packets sent while the receiver waited"
    );
}

/// Figures of the stream-window refusal when the sender's pipeline is far deeper than the
/// receiver's window (16 messages) and packets are reordered: every SEND completes Success
/// and every message arrives in order; printed: the virtual time and the refusals (each a
/// data packet re-sent and a NAK). A guard and a figure, it passes with the old silent drop
/// too: there congestion control, taking the drops for loss, kept the pipeline shallow.
#[test]
fn a_deep_pipeline_into_a_small_stream_window_completes() {
    for (n, len) in [(5000usize, 64usize), (3000, 3000)] {
        let a = config(0, 5);
        let mut b = config(1, 5);
        b.transport.max_stream_window = 16;
        let impair = Impair {
            reorder: 0.3,
            ..Impair::default()
        };
        let mut p = Pair::impaired_with_configs(5, impair, a, b);
        let (a, b) = p.connect();
        for i in 0..n {
            let m = Bytes::from(metaroce::testing::pattern(i as u64, len));
            p.eps[0].post_send(a, 1, i as u64, m).unwrap();
        }
        let t0 = p.now;
        let limit = p.elapsed() + Duration::from_secs(60);
        p.run_until(limit, |q| q.completions(0, a).len() == n);
        let wcs = p.completions(0, a);
        assert!(
            wcs.len() == n && wcs.iter().all(|w| w.status == WcStatus::Success),
            "{} of {n} SENDs completed, lost {:?}",
            wcs.len(),
            p.lost(0, a)
        );
        let got = p.messages(1, b).remove(&1).unwrap_or_default();
        assert_eq!(got.len(), n);
        assert!(got
            .iter()
            .enumerate()
            .all(|(i, m)| m[..] == metaroce::testing::pattern(i as u64, len)[..]));
        let st = p.eps[1].connection_stats(b).unwrap().recv;
        println!(
            "{n} x {len} B into a 16-message stream window, 30 % reordering: done in {:?} \
             (virtual), {} stream-window refusals",
            p.now - t0,
            st.stream_window_naks
        );
    }
}

/// [`pair`] with B's endpoint cap on delivered, unread bytes (`max_unread_recv_bytes`).
fn capped_pair(seed: u64, impair: Impair, cap: u64) -> Pair {
    pair_with(seed, impair, |b| b.max_unread_recv_bytes = cap)
}

/// The endpoint caps delivered, unread bytes over all its connections
/// (`max_unread_recv_bytes`, here 3 MiB): two connections send 8 messages of 1 MiB each
/// on a stream B does not read. Without the cap B held 6 MiB unread (each connection
/// within its own budgets), and more with more connections (a new user's trial: 512 MiB
/// per connection); with it new messages stop at the cap on both connections (memory RNR
/// NAKs; peak 4 MiB, as messages admitted before the cap was reached still complete), and
/// once B reads, all 16 arrive in order, none failed.
#[test]
fn the_endpoint_caps_unread_bytes_over_all_connections() {
    let cap = 3 * MIB;
    let mut p = capped_pair(41, Impair::default(), cap);
    let (a1, b1) = p.connect();
    let (a2, b2) = p.connect();
    let n = 8;
    for (i, m) in messages(n).into_iter().enumerate() {
        p.eps[0].post_send(a1, 1, i as u64, m.clone()).unwrap();
        p.eps[0].post_send(a2, 1, 100 + i as u64, m).unwrap();
    }
    let unread = |p: &Pair| {
        let s1 = p.eps[1].connection_stats(b1).unwrap().recv;
        let s2 = p.eps[1].connection_stats(b2).unwrap().recv;
        (
            s1.unconsumed_bytes + s2.unconsumed_bytes,
            s1.memory_rnr_naks + s2.memory_rnr_naks,
        )
    };
    let t0 = p.now;
    let mut peak = 0;
    while p.now - t0 < Duration::from_millis(200) {
        assert!(p.step());
        peak = peak.max(unread(&p).0);
    }
    let rnrs = unread(&p).1;
    println!("two unread connections: peak {peak} B unread (cap {cap} B), {rnrs} memory RNR NAKs");
    // Messages already admitted when the cap is reached still complete: at most one per
    // connection beyond it here.
    assert!(peak <= cap + 2 * (MIB + 128), "peak {peak}");
    assert!(rnrs > 0);
    let mut got = [Vec::new(), Vec::new()];
    let t1 = p.now;
    while got[0].len() + got[1].len() < 2 * n && p.now - t1 < Duration::from_secs(60) {
        if !p.step() {
            break;
        }
        for e in std::mem::take(&mut p.events[1]) {
            if let Event::Message { conn, data, .. } = e {
                got[usize::from(conn != b1)].push(data[0]);
                p.eps[1].stream_consumed(conn, 1, data.len() as u64);
            }
        }
    }
    let want: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
    assert_eq!(got[0], want);
    assert_eq!(got[1], want);
    assert!(p.events[0].iter().all(|e| match e {
        Event::Completion { wc, .. } => wc.status == WcStatus::Success,
        Event::ConnectionLost { .. } => false,
        _ => true,
    }));
}

/// An application that reads everything it is given is never stalled by the cap on
/// unread bytes, whatever the network does: a tight cap (one message and a half), loss,
/// duplication and reordering, two connections, three streams each. Every message
/// arrives. (A cap on reassembly buffers, tried first, deadlocked here: messages behind a
/// lost one filled it, and the lost one was refused for good.)
#[test]
fn a_reader_that_reads_is_never_stalled_by_the_unread_cap() {
    let mut capped = 0;
    for seed in 0..6 {
        let mut p = capped_pair(100 + seed, lossy(), 384 << 10);
        let bs = read_everything_sent(&mut p, seed);
        for b in bs {
            capped += p.eps[1].connection_stats(b).unwrap().recv.memory_rnr_naks;
        }
    }
    assert!(
        capped > 0,
        "the cap must be reached for the test to mean anything"
    );
}

/// 3 % loss, 1 % duplication, 5 % reordering.
fn lossy() -> Impair {
    Impair {
        loss: 0.03,
        dup: 0.01,
        reorder: 0.05,
        ..Impair::default()
    }
}

/// Two new connections each send 12 messages of 256 KiB over three streams; B reads
/// every message as it arrives (and reports it consumed). Asserts that all arrive within
/// 60 s, in order on their streams; returns B's two connections.
fn read_everything_sent(p: &mut Pair, seed: u64) -> [metaroce::ConnectionHandle; 2] {
    let (a1, b1) = p.connect();
    let (a2, b2) = p.connect();
    let n = 12u64;
    for i in 0..n {
        for (k, a) in [a1, a2].into_iter().enumerate() {
            let m = Bytes::from(vec![i as u8; 256 << 10]);
            p.eps[0]
                .post_send(a, (i % 3) as u32, 1000 * k as u64 + i, m)
                .unwrap();
        }
    }
    let mut next = std::collections::HashMap::new();
    let mut got = 0;
    let limit = p.now + Duration::from_secs(60);
    while got < 2 * n && p.now < limit {
        if !p.step() {
            break;
        }
        for e in std::mem::take(&mut p.events[1]) {
            if let Event::Message {
                conn, stream, data, ..
            } = e
            {
                let want = next.entry((conn, stream)).or_insert(u64::from(stream));
                assert_eq!(u64::from(data[0]), *want, "seed {seed}: order");
                *want += 3;
                got += 1;
                p.eps[1].stream_consumed(conn, stream, data.len() as u64);
            }
        }
    }
    assert_eq!(got, 2 * n, "seed {seed}: {got} messages");
    [b1, b2]
}

/// B's endpoint cap on messages being reassembled (`max_reassembly_bytes`) and, unless
/// `explicit`, no receive flow control.
fn reassembly_cap(cap: u64, explicit: bool) -> impl FnOnce(&mut metaroce::EndpointConfig) {
    move |b| {
        b.max_reassembly_bytes = cap;
        b.transport.explicit_consume = explicit;
    }
}

/// B's bytes of messages being reassembled on connections `bs`, and the RNR NAKs its
/// reassembly cap sent there.
fn reassembly(p: &Pair, bs: &[metaroce::ConnectionHandle]) -> (u64, u64) {
    bs.iter().fold((0, 0), |(bytes, naks), &b| {
        let r = p.eps[1].connection_stats(b).unwrap().recv;
        (
            bytes + r.buffered_bytes - r.unconsumed_bytes,
            naks + r.reassembly_rnr_naks,
        )
    })
}

/// A peer that starts messages and never finishes them cannot make the receiver hold more
/// than the endpoint's reassembly cap allows, however many connections it opens: four
/// connections each start eight 1 MiB messages on eight streams (every one the next due
/// on its stream, so each connection's own budget lets all of them in) and their last
/// packets never arrive. Without the cap B held all 32 MiB (an attacker's trial:
/// 2.25 GiB per connection with the defaults); with a 4 MiB cap it holds at most twice
/// that, and refuses the rest with RNR NAKs.
#[test]
fn messages_never_finished_are_capped_over_all_connections() {
    let cap = 4 * MIB;
    for capped in [false, true] {
        let (a, b) = configs(7, reassembly_cap(if capped { cap } else { 1 << 40 }, false));
        // Not `impaired_with_configs`: its network applies no rules.
        let mut p = Pair::with_configs(7, a, b);
        let conns: Vec<_> = (0..4).map(|_| p.connect()).collect();
        p.add_rule(Rule::always(
            Filter::any()
                .from(0)
                .when(|i| i.send.is_some() && i.is_last_segment()),
            Action::Blackhole,
        ));
        for &(a, _) in &conns {
            for (s, m) in messages(8).into_iter().enumerate() {
                p.eps[0].post_send(a, s as u32, s as u64, m).unwrap();
            }
        }
        let bs: Vec<_> = conns.iter().map(|&(_, b)| b).collect();
        let t0 = p.now;
        let mut peak = 0;
        while p.now - t0 < Duration::from_millis(300) {
            if !p.step() {
                break;
            }
            peak = peak.max(reassembly(&p, &bs).0);
        }
        let naks = reassembly(&p, &bs).1;
        println!("capped {capped}: peak {peak} B being reassembled, {naks} reassembly RNR NAKs");
        if capped {
            assert!(peak <= 2 * cap, "peak {peak}");
            assert!(peak >= cap, "peak {peak}: the cap was not reached");
            assert!(naks > 0);
        } else {
            assert_eq!(peak, 32 * (MIB + 128));
            assert_eq!(naks, 0);
        }
    }
}

/// The reassembly cap never stalls a stream for good, whatever the network does: a tight
/// cap (one message and a half), loss, duplication and reordering, two connections with
/// three streams each, with and without receive flow control. Messages further ahead on
/// their streams fill the cap while the next one due is lost; that one still comes in
/// (a single cap with no exception for it deadlocked here). Every message arrives, in
/// order on its stream.
#[test]
fn the_reassembly_cap_never_stalls_a_stream() {
    let mut capped = 0;
    for seed in 0..6 {
        let explicit = seed % 2 == 0;
        let mut p = pair_with(200 + seed, lossy(), reassembly_cap(384 << 10, explicit));
        let bs = read_everything_sent(&mut p, seed);
        capped += reassembly(&p, &bs).1;
    }
    assert!(
        capped > 0,
        "the cap must be reached for the test to mean anything"
    );
}

/// What the reassembly cap is for under honest load: an incast. Eight connections each
/// send two 4 MiB messages at once (on two streams, so each connection's own budget lets
/// both in). Without the cap B held 32 MiB at its peak (half of the 64 MiB in flight);
/// with an 8 MiB cap, 12 MiB (at most twice the cap), and every message still arrives.
#[test]
fn an_incast_is_held_to_the_reassembly_cap() {
    let cap = 8 * MIB;
    for capped in [false, true] {
        let (a, b) = configs(
            21,
            reassembly_cap(if capped { cap } else { 1 << 40 }, false),
        );
        let mut p = Pair::with_configs(21, a, b);
        let conns: Vec<_> = (0..8).map(|_| p.connect()).collect();
        let big = Bytes::from(vec![5u8; (4 * MIB) as usize]);
        for &(a, _) in &conns {
            for s in 0..2 {
                p.eps[0].post_send(a, s, u64::from(s), big.clone()).unwrap();
            }
        }
        let bs: Vec<_> = conns.iter().map(|&(_, b)| b).collect();
        let (mut peak, mut got) = (0, 0);
        let limit = p.now + Duration::from_secs(10);
        while got < 16 && p.now < limit {
            if !p.step() {
                break;
            }
            peak = peak.max(reassembly(&p, &bs).0);
            got += std::mem::take(&mut p.events[1])
                .iter()
                .filter(|e| matches!(e, Event::Message { data, .. } if data.len() == big.len()))
                .count();
        }
        let naks = reassembly(&p, &bs).1;
        println!("incast, capped {capped}: peak {peak} B being reassembled, {naks} RNR NAKs");
        assert_eq!(got, 16, "capped {capped}");
        if capped {
            assert!(peak <= 2 * cap, "peak {peak}");
            assert!(naks > 0);
        } else {
            assert!(peak > 3 * cap, "peak {peak}");
        }
    }
}

/// A peer can hold the reassembly cap with two packets (found by review): the first
/// packets of two messages as large as the cap, never finished, on two connections, put
/// the total at twice the cap, and a third connection's messages further than the floor
/// wait while those live. Its small messages (at most `reassembly_floor_bytes`, 64 KiB)
/// still come in, one at a time: 16 of 16 here. Without the floor they waited too (0 of
/// 16 in 2 s; the review saw 0 of 16 in 30 s). The larger message shows what is left: it
/// waits.
#[test]
fn a_peer_holding_the_reassembly_cap_does_not_stop_small_messages() {
    let cap = 4 * MIB;
    let (mut a, b) = configs(11, reassembly_cap(cap, false));
    // The holder never gives up on its messages.
    a.transport.retry_count = u32::MAX;
    let mut p = Pair::with_configs(11, a, b);
    let (a1, b1) = p.connect();
    let (a2, b2) = p.connect();
    let (a3, b3) = p.connect();
    // Only the first packet of each large message reaches B.
    p.add_rule(Rule::always(
        Filter::any().from(0).when(|i| {
            i.send
                .is_some_and(|s| u64::from(s.msg_len) >= 3 * MIB && s.offset > 0)
        }),
        Action::Blackhole,
    ));
    p.eps[0]
        .post_send(a1, 0, 1, Bytes::from(vec![1u8; cap as usize]))
        .unwrap();
    p.run_for(Duration::from_millis(5));
    p.eps[0]
        .post_send(a2, 0, 2, Bytes::from(vec![2u8; cap as usize - 256]))
        .unwrap();
    p.run_for(Duration::from_millis(5));
    assert_eq!(
        reassembly(&p, &[b1, b2]).0,
        2 * cap,
        "two packets hold twice the cap"
    );
    for i in 0..16u64 {
        p.eps[0]
            .post_send(
                a3,
                (i % 4) as u32,
                100 + i,
                Bytes::from(vec![i as u8; 1000]),
            )
            .unwrap();
    }
    // Larger than the floor, on a stream of its own.
    p.eps[0]
        .post_send(a3, 9, 200, Bytes::from(vec![9u8; 128 << 10]))
        .unwrap();
    let (mut small, mut large) = (0, 0);
    let t0 = p.now;
    while p.now - t0 < Duration::from_secs(2) {
        if !p.step() {
            break;
        }
        for e in std::mem::take(&mut p.events[1]) {
            if let Event::Message { conn, data, .. } = e {
                if conn == b3 {
                    if data.len() == 1000 {
                        small += 1;
                    } else {
                        large += 1;
                    }
                }
            }
        }
    }
    let st = p.eps[1].connection_stats(b3).unwrap().recv;
    println!(
        "cap held: {small} of 16 small messages, {large} of 1 larger one, {} RNR NAKs",
        st.reassembly_rnr_naks
    );
    assert_eq!(small, 16);
    assert_eq!(large, 0, "the larger message waits while the cap is held");
    assert!(st.reassembly_rnr_naks > 0);
}

/// A READ from a peer that holds one of our streams in a flow-control wait, with 60,000
/// SENDs queued behind that stream (review, 2026-12-07): every READ response packet is
/// found past the blocked cursor. The READ completes, and once the reader consumes, every
/// SEND arrives in order. (Each `peek` walked the whole send queue then: the READ took
/// 2.46 s in release, against 73 ms with nothing queued; 59 ms since the scan
/// resumes where it stopped. `send::tests::peek_past_a_flow_blocked_stream_walks_the_
/// queue_once` bounds the walk; times here are printed, not asserted.)
#[test]
fn a_read_behind_a_flow_blocked_stream_of_60_000_sends_completes() {
    let mut p = pair_with(11, Impair::default(), |b| {
        b.transport.max_stream_recv_bytes = 64 << 10;
        b.transport.max_recv_buffer_bytes = MIB;
    });
    let (a, b) = p.connect();
    let n_sends = 60_000u64;
    for i in 0..n_sends {
        p.eps[0]
            .post_send(a, 1, i, Bytes::from(vec![(i % 251) as u8; 64]))
            .unwrap();
    }
    // The stream fills B's 64 KiB and waits on flow control.
    let t = p.elapsed() + Duration::from_millis(20);
    p.run_until(t, |_| false);
    let len = 32usize << 20;
    let remote = p.eps[0].register_mr(vec![3u8; len], metaroce::Access::REMOTE_READ);
    let local = p.eps[1].register_mr(vec![0; len], metaroce::Access::LOCAL_WRITE);
    let req = metaroce::ReadRequest {
        wr_id: u64::MAX,
        lkey: local.lkey,
        local_offset: 0,
        len: len as u32,
        remote_addr: remote.addr,
        rkey: remote.rkey,
    };
    p.eps[1].post_read(b, req).unwrap();
    let wall = std::time::Instant::now();
    let read_done = |p: &Pair| {
        p.events[1]
            .iter()
            .any(|e| matches!(e, Event::Completion { wc, .. } if wc.wr_id == u64::MAX))
    };
    let limit = p.elapsed() + Duration::from_secs(30);
    assert!(p.run_until(limit, read_done), "READ never completed");
    println!(
        "32 MiB READ behind {n_sends} waiting SENDs: {:?} of CPU",
        wall.elapsed()
    );
    let wc = p
        .completions(1, b)
        .into_iter()
        .find(|w| w.wr_id == u64::MAX)
        .unwrap();
    assert_eq!(wc.status, WcStatus::Success);
    let got = p.eps[1].mr_read(local.lkey, 0, len as u64).unwrap();
    assert!(got.iter().all(|&x| x == 3), "the READ's bytes");
    // Now B reads: every SEND arrives, in order.
    let mut next = 0u64;
    let t0 = p.now;
    while next < n_sends && p.now - t0 < Duration::from_secs(60) {
        if !p.step() {
            break;
        }
        for e in std::mem::take(&mut p.events[1]) {
            if let Event::Message {
                stream: 1, data, ..
            } = e
            {
                assert_eq!(data[0], (next % 251) as u8, "message {next} out of order");
                next += 1;
                p.eps[1].stream_consumed(b, 1, data.len() as u64);
            }
        }
    }
    assert_eq!(next, n_sends);
}
