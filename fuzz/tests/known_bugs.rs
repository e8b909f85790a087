//! Deterministic reproducers of core bugs found by fuzzing, kept as regression tests: each
//! asserts the correct behaviour (see the table in fuzz/README.md).

use bytes::Bytes;
use metaroce::wire::{self, Headers, Opcode, Packet};
use metaroce::{Access, Endpoint, Event, ReadRequest, WcOpcode};
use metaroce_fuzz::util::{self, addr_of, ip_of};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Two endpoints; `drop` decides which datagrams (by sender and packet) are lost.
struct Two {
    eps: [Endpoint; 2],
    now: Instant,
    events: [Vec<Event>; 2],
}

impl Two {
    fn new() -> Two {
        Two {
            eps: [
                Endpoint::new(util::config(0, 1)).unwrap(),
                Endpoint::new(util::config(1, 1)).unwrap(),
            ],
            now: Instant::now(),
            events: [Vec::new(), Vec::new()],
        }
    }

    /// Exchange packets until quiet, firing timers up to `dur` of virtual time.
    fn run(&mut self, dur: Duration, mut drop: impl FnMut(usize, &Packet<'_>) -> bool) {
        let end = self.now + dur;
        let mut buf = Vec::new();
        loop {
            let mut moved = false;
            for i in 0..2 {
                while let Some(t) = self.eps[i].poll_transmit(self.now, &mut buf) {
                    moved = true;
                    let segs: Vec<Vec<u8>> = util::segments(&t, &buf).map(<[u8]>::to_vec).collect();
                    for seg in segs {
                        if drop(i, &Packet::parse(&seg).unwrap()) || t.destination != addr_of(1 - i)
                        {
                            continue;
                        }
                        let from = SocketAddr::new(ip_of(i), t.src_port);
                        let to = 1 - i;
                        self.eps[to].handle_datagram(self.now, from, Some(ip_of(to)), t.ecn, &seg);
                    }
                }
                while let Some(e) = self.eps[i].poll_event() {
                    self.events[i].push(e);
                }
            }
            if moved {
                continue;
            }
            let Some(t) = self.eps.iter().filter_map(Endpoint::poll_timeout).min() else {
                return;
            };
            if t > end {
                return;
            }
            self.now = self.now.max(t);
            for ep in &mut self.eps {
                if ep.poll_timeout().is_some_and(|x| x <= self.now) {
                    ep.handle_timeout(self.now);
                }
            }
        }
    }
}

/// `rd-atomic-hang` (conn/send.rs `SendQueue::on_acked`): a READ completes with its
/// response, not with the request's ACK, yet once the request is ACKed nothing is
/// outstanding on any path and no timer waits for the response. Here the responder
/// acknowledges the request, then closes the connection normally; its best-effort CLOSE is
/// lost (one lost packet). The requester's READ must eventually complete (in error) —
/// instead it stays pending forever, `poll_timeout()` is `None`, and every operation posted
/// after it among the one-sided operations, and every SEND posted after it, is stuck
/// behind it (completions come in posting order per stream and among one-sided operations,
/// a SEND after the one-sided operations posted before it).
#[test]
fn read_completes_when_responder_vanishes_after_acking_the_request() {
    let mut p = Two::new();
    let c = p.eps[0].connect(p.now, addr_of(1), None).unwrap();
    p.run(Duration::from_secs(1), |_, _| false);
    let s = p.events[1]
        .iter()
        .find_map(|e| match e {
            Event::Incoming(h) => Some(*h),
            _ => None,
        })
        .expect("connected");
    let land = p.eps[0].register_mr(vec![0; 4096], Access::LOCAL_WRITE);
    let src = p.eps[1].register_mr(vec![7; 4096], Access::LOCAL_WRITE | Access::REMOTE_READ);
    let req = ReadRequest {
        wr_id: 1,
        lkey: land.lkey,
        local_offset: 0,
        len: 100,
        remote_addr: src.addr,
        rkey: src.rkey,
    };
    p.eps[0].post_read(c, req).unwrap();
    // The request arrives and is ACKed; the response is lost (once).
    p.run(Duration::from_micros(1), |from, pkt| {
        from == 1 && pkt.bth.opcode == Opcode::MR_READ_RESPONSE
    });
    // The responder closes; its CLOSE is lost.
    p.eps[1].close(p.now, s);
    p.run(Duration::from_secs(120), |from, pkt| {
        from == 1 && pkt.bth.opcode == Opcode::MR_CLOSE
    });
    let done = p.events[0].iter().any(|e| {
        matches!(e, Event::Completion { wc, .. } if wc.wr_id == 1 && wc.opcode == WcOpcode::RdmaRead)
    });
    assert!(
        done,
        "READ still pending after 120 s of virtual time; requester's next timeout: {:?}",
        p.eps[0].poll_timeout()
    );
}

/// `send-len-mismatch` (conn/recv.rs `RecvState::on_send`): the packets of one message are
/// checked against each other by segment count only. A packet whose `msg_len` differs from
/// the one that created the message but gives the same segment count passes, and its
/// payload is copied to `offset..offset + len` of a buffer sized by the first `msg_len`:
/// with a library-owned buffer that index is out of range and the endpoint panics (a
/// remote crash from one well-formed packet with a valid ICRC); with a posted receive the
/// bytes land past the end of the posted buffer, in whatever follows it in the region.
/// Here: segment 0 of a genuine 1500-byte SEND (pmtu 1024, 2 segments), then segment 1
/// re-encoded with `msg_len` 2048 (still 2 segments) and a full 1024-byte payload.
#[test]
fn send_segment_with_a_different_length_is_refused_not_a_panic() {
    let mut p = Two::new();
    let c = p.eps[0].connect(p.now, addr_of(1), None).unwrap();
    p.run(Duration::from_secs(1), |_, _| false);
    p.eps[0]
        .post_send(c, 3, 1, Bytes::from(vec![0xAB; 1500]))
        .unwrap();
    // Capture A's data packets instead of delivering them.
    let mut data = Vec::new();
    let mut buf = Vec::new();
    while let Some(t) = p.eps[0].poll_transmit(p.now, &mut buf) {
        for seg in util::segments(&t, &buf) {
            data.push((t.src_port, seg.to_vec()));
        }
    }
    assert_eq!(
        data.len(),
        2,
        "a 1500-byte message is 2 packets at pmtu 1024"
    );
    let from = |port| SocketAddr::new(ip_of(0), port);
    // Segment 0, genuine.
    p.eps[1].handle_datagram(p.now, from(data[0].0), Some(ip_of(1)), None, &data[0].1);
    // Segment 1, claiming a 2048-byte message.
    let (port, seg1) = &data[1];
    let pkt = Packet::parse(seg1).unwrap();
    let Headers::Send { path, mut send } = pkt.headers else {
        panic!("not a SEND: {:?}", pkt.headers)
    };
    assert_eq!(send.offset, 1024);
    send.msg_len = 2048;
    let hdrs = Headers::Send { path, send };
    let payload = vec![0xCD; 1024];
    let t = pkt.trailer;
    let mut forged = vec![0u8; wire::packet_len_with(&hdrs, payload.len(), &t)];
    wire::emit_packet_with(&pkt.bth, &hdrs, &payload, &t, &mut forged).unwrap();
    assert!(util::restamp(
        &mut forged,
        ip_of(0),
        ip_of(1),
        *port,
        util::LISTEN_PORT
    ));
    // Must be refused (NAK / drop) — at f43d60e it panics: range end index 2048 out of
    // range for slice of length 1500.
    p.eps[1].handle_datagram(p.now, from(*port), Some(ip_of(1)), None, &forged);
    let mut buf = Vec::new();
    while p.eps[1].poll_transmit(p.now, &mut buf).is_some() {}
}

/// `idle-timer-spin` (conn/mod.rs `Connection::next_timeout` / `handle_timeout`): with an
/// idle timeout configured, `next_timeout` offers `last_heard + idle` whenever the
/// connection is established, but `handle_timeout` only acts on it when nothing is
/// pending. With an operation pending and a silent peer, the idle deadline stays in the
/// past after `handle_timeout(now)`, so `poll_timeout()` keeps returning a time <= now and
/// an event loop that sleeps until `poll_timeout()` spins.
#[test]
fn no_timer_is_due_right_after_handle_timeout_with_idle_timeout() {
    let mut p = Two::new();
    p.eps[0].transport_config_mut().idle_timeout = Some(Duration::from_millis(5));
    let c = p.eps[0].connect(p.now, addr_of(1), None).unwrap();
    p.run(Duration::from_micros(100), |_, _| false);
    p.eps[0]
        .post_send(c, 0, 1, Bytes::from_static(b"into the void"))
        .unwrap();
    // The peer is gone: nothing from endpoint 0 arrives any more.
    let mut spins = 0;
    let end = p.now + Duration::from_millis(200);
    let mut buf = Vec::new();
    while p.now < end {
        while p.eps[0].poll_transmit(p.now, &mut buf).is_some() {}
        let Some(t) = p.eps[0].poll_timeout() else {
            break;
        };
        if t <= p.now {
            spins += 1;
            assert!(
                spins < 1000,
                "poll_timeout() stays <= now after handle_timeout: busy loop"
            );
        }
        p.now = p.now.max(t);
        p.eps[0].handle_timeout(p.now);
    }
}
