//! Delayed ACK (issue #13 P2, `TransportConfig::max_ack_delay`, RFC 9000 §13.2.1 /
//! RFC 9002 §5.3): the ACK of a lone in-order SEND waits up to `max_ack_delay` for a reply
//! to the same peer and then leaves right behind it; it reports how long it was held, and
//! the sender takes that out of its RTT sample. Anything else (a second packet, a WRITE)
//! is acknowledged at once.
//!
//! Sans-IO, virtual time (one-way delay 10 µs), the in-memory `metaroce::testing::Net`
//! recording what it carries.

use bytes::Bytes;
use metaroce::testing::Sent;
use metaroce::wire::{AckEth, Headers, Opcode, Packet};
use metaroce::{Access, ConnectionHandle, WcStatus, WriteRequest};
use std::time::{Duration, Instant};

type Net = metaroce::testing::Net;

const LIMIT: Duration = Duration::from_secs(2);

fn net(delay_a: Duration, delay_b: Duration) -> Net {
    let mut a = metaroce::testing::config(0, 7);
    a.transport.max_ack_delay = delay_a;
    let mut b = metaroce::testing::config(1, 7);
    b.transport.max_ack_delay = delay_b;
    let mut n = Net::with_configs(7, a, b);
    n.record = 100_000;
    n
}

fn received(net: &Net, i: usize, c: ConnectionHandle) -> usize {
    net.messages(i, c).get(&1).map_or(0, Vec::len)
}

/// (sent at, AckEth) of every non-keepalive MR_ACK endpoint `from` sent.
fn acks(net: &Net, from: usize) -> Vec<(Instant, AckEth)> {
    net.wire
        .iter()
        .filter(|s| s.from_ep == from)
        .filter_map(|s| match Packet::parse(&s.data).ok()?.headers {
            Headers::Ack(a) if a.flags & AckEth::FLAG_KEEPALIVE == 0 => Some((s.at, a)),
            _ => None,
        })
        .collect()
}

fn opcode(s: &Sent) -> Option<Opcode> {
    Packet::parse(&s.data).ok().map(|p| p.bth.opcode)
}

/// `rounds` 64-byte ping-pongs on stream 1; B answers each ping `think` after it arrived.
/// Returns when A has every echo.
fn ping_pong(
    net: &mut Net,
    a: ConnectionHandle,
    b: ConnectionHandle,
    rounds: usize,
    think: Duration,
) {
    ping_pong_sized(net, a, b, rounds, think, 64);
}

/// [`ping_pong`] with echoes of `echo_len` bytes.
fn ping_pong_sized(
    net: &mut Net,
    a: ConnectionHandle,
    b: ConnectionHandle,
    rounds: usize,
    think: Duration,
    echo_len: usize,
) {
    for k in 0..rounds {
        net.eps[0]
            .post_send(a, 1, k as u64, Bytes::from(vec![k as u8; 64]))
            .unwrap();
        assert!(net.run_until(LIMIT, |n| received(n, 1, b) > k), "ping {k}");
        net.run_for(think);
        net.eps[1]
            .post_send(
                b,
                1,
                1000 + k as u64,
                Bytes::from(vec![!(k as u8); echo_len]),
            )
            .unwrap();
        assert!(net.run_until(LIMIT, |n| received(n, 0, a) > k), "echo {k}");
    }
}

/// B answers every ping at once: each ACK of a ping leaves right behind the echo SEND,
/// in the same transmit batch (same virtual instant, next datagram), not ahead of it.
/// Fails on the old code, which sent the ACK first.
#[test]
fn the_ack_of_a_ping_rides_behind_the_echo() {
    let mut net = net(Duration::from_micros(100), Duration::from_micros(100));
    let (a, b) = net.connect();
    net.wire.clear();
    ping_pong(&mut net, a, b, 20, Duration::ZERO);
    assert!(net.run_until_idle(LIMIT));
    let from_b: Vec<&Sent> = net.wire.iter().filter(|s| s.from_ep == 1).collect();
    let mut behind = 0;
    for (k, s) in from_b.iter().enumerate() {
        if opcode(s) != Some(Opcode::MR_SEND) {
            continue;
        }
        let next = from_b.get(k + 1).expect("an ACK after the echo");
        assert_eq!(
            opcode(next),
            Some(Opcode::MR_ACK),
            "echo {k} not followed by its ACK"
        );
        assert_eq!(next.at, s.at, "the ACK left in another batch than the echo");
        behind += 1;
    }
    assert_eq!(behind, 20);
    // One ACK datagram per ping, none ahead of its echo.
    assert_eq!(acks(&net, 1).len(), 20);
    assert!(net
        .completions(0, a)
        .iter()
        .all(|wc| wc.status == WcStatus::Success));
    assert_eq!(net.completions(0, a).len(), 20);
}

/// The datagrams endpoint `from` sent, grouped by the transmit (GSO batch) that carried
/// them, in sending order.
fn batches(net: &Net, from: usize) -> Vec<Vec<&Sent>> {
    let mut out: Vec<Vec<&Sent>> = Vec::new();
    for s in net.wire.iter().filter(|s| s.from_ep == from) {
        match out.last_mut() {
            Some(b) if b[0].batch == s.batch => b.push(s),
            _ => out.push(vec![s]),
        }
    }
    out
}

/// With GSO (issue #13, P2), the held ACK of a ping joins the echo in one transmit: one
/// datagram send instead of two, from the ACK's port (the path that carries the echo is
/// the one whose port that is). The same holds for A's ACK of an echo and A's next ping,
/// so a ping-pong costs one transmit per message. Fails on the code before the join,
/// which sent the ACK as a transmit of its own.
#[test]
fn the_ack_of_a_ping_joins_the_echo_in_one_batch() {
    let mut net = net(Duration::from_micros(100), Duration::from_micros(100));
    let (a, b) = net.connect();
    net.wire.clear();
    ping_pong(&mut net, a, b, 20, Duration::ZERO);
    assert!(net.run_until_idle(LIMIT));
    for (side, expect_joined) in [(1, 20), (0, 19)] {
        let mut joined = 0;
        for batch in batches(&net, side) {
            let ops: Vec<_> = batch.iter().map(|s| opcode(s)).collect();
            if ops.contains(&Some(Opcode::MR_SEND)) && batch.len() > 1 {
                assert_eq!(
                    ops,
                    [Some(Opcode::MR_SEND), Some(Opcode::MR_ACK)],
                    "side {side}: a joined batch is the message, then its ACK"
                );
                assert_eq!(batch[0].from, batch[1].from, "one source port per batch");
                joined += 1;
            }
        }
        assert_eq!(joined, expect_joined, "side {side}: joined batches");
    }
    // Every ping and echo arrived intact, every SEND completed Success.
    let got_b = &net.messages(1, b)[&1];
    let got_a = &net.messages(0, a)[&1];
    for k in 0..20 {
        assert_eq!(got_b[k].as_ref(), &vec![k as u8; 64][..]);
        assert_eq!(got_a[k].as_ref(), &vec![!(k as u8); 64][..]);
    }
    for (i, c) in [(0, a), (1, b)] {
        let wcs = net.completions(i, c);
        assert_eq!(wcs.len(), 20);
        assert!(wcs.iter().all(|wc| wc.status == WcStatus::Success));
        let st = net.eps[i].connection_stats(c).unwrap();
        assert!(st.paths.iter().all(|p| p.stats.retransmits == 0));
    }
}

/// An echo shorter than an ACK datagram (1 byte of payload) goes behind the ACK in the
/// batch: GSO lets only the last segment be shorter than the others.
#[test]
fn an_echo_shorter_than_the_ack_follows_it_in_the_batch() {
    let mut net = net(Duration::from_micros(100), Duration::from_micros(100));
    let (a, b) = net.connect();
    net.wire.clear();
    ping_pong_sized(&mut net, a, b, 8, Duration::ZERO, 1);
    assert!(net.run_until_idle(LIMIT));
    let joined: Vec<_> = batches(&net, 1)
        .into_iter()
        .filter(|b| b.len() > 1)
        .collect();
    assert_eq!(joined.len(), 8);
    for batch in joined {
        assert_eq!(opcode(batch[0]), Some(Opcode::MR_ACK));
        assert_eq!(opcode(batch[1]), Some(Opcode::MR_SEND));
        assert!(batch[1].data.len() < batch[0].data.len());
    }
    assert_eq!(net.messages(0, a)[&1].len(), 8);
    assert!(net.messages(0, a)[&1].iter().all(|m| m.len() == 1));
    assert!(net
        .completions(1, b)
        .iter()
        .all(|wc| wc.status == WcStatus::Success));
}

/// Without GSO (`max_gso_segments = 1`) the held ACK still rides right behind the echo,
/// as a datagram of its own.
#[test]
fn without_gso_the_held_ack_is_a_datagram_of_its_own() {
    let [ca, cb] = [0, 1].map(|i| {
        let mut c = metaroce::testing::config(i, 7);
        c.transport.max_ack_delay = Duration::from_micros(100);
        c.transport.max_gso_segments = 1;
        c
    });
    let mut net = Net::with_configs(7, ca, cb);
    net.record = 100_000;
    let (a, b) = net.connect();
    net.wire.clear();
    ping_pong(&mut net, a, b, 10, Duration::ZERO);
    assert!(net.run_until_idle(LIMIT));
    assert!(batches(&net, 1).iter().all(|b| b.len() == 1));
    assert_eq!(acks(&net, 1).len(), 10);
}

/// B thinks 50 µs before it answers: the ACK waits for the echo and reports 50 µs of ACK
/// delay; A's RTT estimate stays the network's 20 µs (it subtracts the delay).
#[test]
fn a_held_ack_reports_its_delay_and_the_rtt_excludes_it() {
    let mut net = net(Duration::from_micros(100), Duration::from_micros(100));
    let (a, b) = net.connect();
    net.wire.clear();
    ping_pong(&mut net, a, b, 16, Duration::from_micros(50));
    let held: Vec<u16> = acks(&net, 1).iter().map(|(_, e)| e.ack_delay).collect();
    assert_eq!(held.len(), 16, "{held:?}");
    assert!(held.iter().all(|&d| d == 50), "ACK delays {held:?}");
    let st = net.eps[0].connection_stats(a).unwrap();
    // The pings and echoes join their ACKs, so they stay on the path pair they started
    // on (`the_ack_of_a_ping_joins_the_echo_in_one_batch`): the paths that carried them.
    let used: Vec<_> = st
        .paths
        .iter()
        .filter(|p| p.stats.packets_acked > 0)
        .collect();
    assert!(!used.is_empty());
    for p in used {
        let srtt = p.srtt;
        assert!(
            srtt <= Duration::from_micros(25),
            "path {}: SRTT {srtt:?} includes the ACK delay",
            p.id
        );
        assert_eq!(p.stats.probes, 0, "path {}: probes", p.id);
    }
}

/// Nobody answers: the ACK leaves alone after exactly `max_ack_delay`, with that delay
/// in it, and the SEND completes Success; no probe fires meanwhile.
#[test]
fn an_unanswered_send_is_acknowledged_after_max_ack_delay() {
    let mut net = net(Duration::from_micros(300), Duration::from_micros(300));
    let (a, b) = net.connect();
    net.wire.clear();
    net.eps[0]
        .post_send(a, 1, 1, Bytes::from_static(b"hello"))
        .unwrap();
    assert!(net.run_until(LIMIT, |n| received(n, 1, b) == 1));
    let arrived = net.now;
    assert!(net.run_until(LIMIT, |n| !n.completions(0, a).is_empty()));
    let acks = acks(&net, 1);
    assert_eq!(acks.len(), 1);
    assert_eq!(acks[0].0 - arrived, Duration::from_micros(300));
    assert_eq!(acks[0].1.ack_delay, 300);
    assert_eq!(net.completions(0, a)[0].status, WcStatus::Success);
    let st = net.eps[0].connection_stats(a).unwrap();
    assert!(st.paths.iter().all(|p| p.stats.probes == 0));
}

/// The receiving application read the message and has no reply
/// (`Endpoint::release_held_ack`): the held ACK leaves at once, not after `max_ack_delay`
/// (10 ms here), and reports only the time it was held. Releasing when nothing is held
/// does nothing.
#[test]
fn a_held_ack_released_by_the_application_leaves_at_once() {
    let mut net = net(Duration::from_millis(10), Duration::from_millis(10));
    let (a, b) = net.connect();
    net.wire.clear();
    assert!(!net.eps[1].release_held_ack(b), "nothing held yet");
    net.eps[0]
        .post_send(a, 1, 1, Bytes::from_static(b"hello"))
        .unwrap();
    assert!(net.run_until(LIMIT, |n| received(n, 1, b) == 1));
    let arrived = net.now;
    assert!(net.eps[1].release_held_ack(b));
    assert!(net.run_until(LIMIT, |n| !n.completions(0, a).is_empty()));
    let acks = acks(&net, 1);
    assert_eq!(acks.len(), 1);
    assert!(
        acks[0].0 - arrived < Duration::from_millis(1),
        "{:?}",
        acks[0].0 - arrived
    );
    assert!(acks[0].1.ack_delay < 1000, "{}", acks[0].1.ack_delay);
    assert!(net.now - arrived < Duration::from_millis(1));
    assert_eq!(net.completions(0, a)[0].status, WcStatus::Success);
    let st = net.eps[1].connection_stats(b).unwrap();
    assert_eq!(st.held_acks_released, 1);
    assert!(!net.eps[1].release_held_ack(b));
}

/// `max_ack_delay = 0`: every ACK leaves when its packet arrives, ahead of any reply.
#[test]
fn zero_max_ack_delay_acknowledges_at_once() {
    let mut net = net(Duration::ZERO, Duration::ZERO);
    let (a, b) = net.connect();
    net.wire.clear();
    ping_pong(&mut net, a, b, 4, Duration::from_micros(50));
    let from_b: Vec<&Sent> = net.wire.iter().filter(|s| s.from_ep == 1).collect();
    // ACK, then (50 µs later) the echo, every round.
    for pair in from_b.chunks(2) {
        assert_eq!(opcode(pair[0]), Some(Opcode::MR_ACK));
        assert_eq!(opcode(pair[1]), Some(Opcode::MR_SEND));
        assert_eq!(pair[1].at - pair[0].at, Duration::from_micros(50));
    }
    assert!(acks(&net, 1).iter().all(|(_, e)| e.ack_delay == 0));
}

/// A WRITE's ACK is never held (its completion is the operation's latency), and neither
/// is the ACK of a second SEND packet arriving before the first was acknowledged.
#[test]
fn writes_and_bursts_are_acknowledged_at_once() {
    let mut net = net(Duration::from_millis(5), Duration::from_millis(5));
    let (a, b) = net.connect();
    let src = net.eps[0].register_mr(vec![5; 4096], Access::LOCAL_WRITE);
    let dst = net.eps[1].register_mr(vec![0; 4096], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    net.wire.clear();
    net.eps[0]
        .post_write(
            a,
            WriteRequest {
                wr_id: 1,
                lkey: src.lkey,
                local_offset: 0,
                len: 512,
                remote_addr: dst.addr,
                rkey: dst.rkey,
                imm: None,
            },
        )
        .unwrap();
    let t0 = net.now;
    assert!(net.run_until(LIMIT, |n| !n.completions(0, a).is_empty()));
    // Out and back: 20 µs, not 5 ms.
    assert_eq!(net.now - t0, Duration::from_micros(20));
    // Two SENDs at once: the second packet makes the ACK due at once.
    net.wire.clear();
    for k in 0..2 {
        net.eps[0]
            .post_send(a, 1, 10 + k, Bytes::from_static(b"burst"))
            .unwrap();
    }
    let t0 = net.now;
    assert!(net.run_until(LIMIT, |n| n.completions(0, a).len() == 3));
    assert!(
        net.now - t0 < Duration::from_micros(100),
        "{:?}",
        net.now - t0
    );
    assert_eq!(received(&net, 1, b), 2);
}
