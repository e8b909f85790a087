//! Clean runs do not retransmit (issue #13: "no more than 1 retransmission per 10,000
//! packets" on a clean loopback). Two endpoints in memory, nothing lost, duplicated or
//! reordered, but timed like a loopback between two processes on one host: each endpoint
//! handles its datagrams one at a time at a finite rate (a receive queue builds up behind a
//! burst, as in a socket buffer), so the round trip grows with the data in flight, as it
//! does when a bulk transfer starts with a full initial window on 8 paths.
//!
//! The workload is `metaroce-perf write_bw -s 1048576` shaped: 1 MiB RDMA WRITEs, 128
//! outstanding, 8 paths, path MTU 4096, 128 MiB in all (32,768 data packets).

use metaroce::{Access, Endpoint, EndpointConfig, Event, WcStatus, WriteRequest};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

fn config(i: usize) -> EndpointConfig {
    let addr: SocketAddr = format!("127.0.0.{}:4791", i + 1).parse().unwrap();
    let mut c = EndpointConfig::new(addr, (0..32).map(|k| 0xC000 + k + 64 * i as u16).collect());
    c.seed = 11 + i as u64;
    c.transport.max_gso_segments = 16;
    c
}

/// One datagram on its way: handled by endpoint `to` at `at`.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Arrival {
    at: Reverse<Instant>,
    seq: Reverse<u64>,
    to: usize,
    port: u16,
    ecn: Option<u8>,
    data: Vec<u8>,
}

struct Stats {
    data_packets: u64,
    retransmits: u64,
    probes: u64,
    spurious_probes: u64,
    sack_losses: u64,
    elapsed: Duration,
}

/// The endpoint (its process) is not scheduled during `[k·period + phase, … + stall)`:
/// datagrams that would be handled then wait until it runs again.
fn scheduled(t: Instant, start: Instant, stall: Option<(Duration, Duration, Duration)>) -> Instant {
    let Some((period, len, phase)) = stall else {
        return t;
    };
    let since = (t - start + period - phase).as_nanos() % period.as_nanos();
    if since < len.as_nanos() {
        t + (len - Duration::from_nanos(since as u64))
    } else {
        t
    }
}

/// The in-memory network and the endpoints' receive queues.
struct Net {
    start: Instant,
    service: Duration,
    prop: Duration,
    stall: Option<(Duration, Duration)>,
    queue: BinaryHeap<Arrival>,
    /// When each endpoint is done with the datagrams queued to it so far.
    busy_until: [Instant; 2],
    seq: u64,
}

impl Net {
    /// Endpoint `i`'s descheduled times: (period, length, phase); the two ends at opposite
    /// phases.
    fn phase(&self, i: usize) -> Option<(Duration, Duration, Duration)> {
        self.stall.map(|(p, l)| (p, l, p / 2 * i as u32 + p / 3))
    }

    /// Everything endpoint `from` wants to send now, into the peer's receive queue (FIFO:
    /// each datagram is handled `service` after the one before it, and not while the peer
    /// is descheduled).
    fn send_all(&mut self, ep: &mut Endpoint, from: usize, now: Instant, buf: &mut Vec<u8>) {
        let to = 1 - from;
        while let Some(t) = ep.poll_transmit(now, buf) {
            let seg = t.segment_size.unwrap_or(t.size);
            for chunk in buf[..t.size].chunks(seg) {
                let ready = (now + self.prop).max(self.busy_until[to]);
                let at = scheduled(ready, self.start, self.phase(to)) + self.service;
                self.busy_until[to] = at;
                self.seq += 1;
                self.queue.push(Arrival {
                    at: Reverse(at),
                    seq: Reverse(self.seq),
                    to,
                    port: t.src_port,
                    ecn: t.ecn.map(|e| e.bits()),
                    data: chunk.to_vec(),
                });
            }
        }
    }
}

/// `service`: time an endpoint takes per datagram it handles; `prop`: one-way delay;
/// `stall`: (period, length) of the times each endpoint is not scheduled, if any.
fn run(
    total_bytes: u64,
    service: Duration,
    prop: Duration,
    stall: Option<(Duration, Duration)>,
) -> Stats {
    let (a, b) = (config(0), config(1));
    let addrs = [a.local_addr, b.local_addr];
    let mut eps = [Endpoint::new(a).unwrap(), Endpoint::new(b).unwrap()];
    let start = Instant::now();
    let mut now = start;
    let mut net = Net {
        start,
        service,
        prop,
        stall,
        queue: BinaryHeap::new(),
        busy_until: [now; 2],
        seq: 0,
    };
    let mut buf = Vec::with_capacity(1 << 17);
    let msg = 1u32 << 20;
    let depth = 128u64;
    let n_msgs = total_bytes / msg as u64;
    let c = eps[0].connect(now, addrs[1], None).unwrap();
    let local = eps[0].register_mr(vec![7; msg as usize], Access::LOCAL_WRITE);
    let remote = eps[1].register_mr(
        vec![0; msg as usize],
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
    );
    let (mut posted, mut completed) = (0u64, 0u64);
    let mut established = false;
    loop {
        for (i, ep) in eps.iter_mut().enumerate() {
            net.send_all(ep, i, now, &mut buf);
        }
        while let Some(e) = eps[0].poll_event() {
            match e {
                Event::Connected(_) => established = true,
                Event::Completion { wc, .. } => {
                    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                    completed += 1;
                }
                Event::ConnectionLost { .. } => panic!("connection lost: {e:?}"),
                _ => {}
            }
        }
        while eps[1].poll_event().is_some() {}
        if completed == n_msgs {
            break;
        }
        if established && posted < n_msgs && posted < completed + depth {
            while posted < n_msgs && posted < completed + depth {
                let req = WriteRequest {
                    wr_id: posted,
                    lkey: local.lkey,
                    local_offset: 0,
                    len: msg,
                    remote_addr: remote.addr,
                    rkey: remote.rkey,
                    imm: None,
                };
                eps[0].post_write(c, req).unwrap();
                posted += 1;
            }
            net.send_all(&mut eps[0], 0, now, &mut buf);
        }
        // A descheduled endpoint runs its timers too only once it is scheduled again.
        let next_timer = eps
            .iter()
            .enumerate()
            .filter_map(|(i, e)| Some(scheduled(e.poll_timeout()?.max(now), start, net.phase(i))))
            .min();
        let next_pkt = net.queue.peek().map(|p| p.at.0);
        let next = match (next_pkt, next_timer) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b).expect("nothing left to do"),
        };
        assert!(next - start < Duration::from_secs(120), "stuck");
        now = now.max(next);
        while net.queue.peek().is_some_and(|p| p.at.0 <= now) {
            let p = net.queue.pop().unwrap();
            let from = SocketAddr::new(addrs[1 - p.to].ip(), p.port);
            let ecn = p.ecn.and_then(metaroce::EcnCodepoint::from_bits);
            eps[p.to].handle_datagram(now, from, Some(addrs[p.to].ip()), ecn, &p.data);
        }
        for (i, ep) in eps.iter_mut().enumerate() {
            let due = ep.poll_timeout().is_some_and(|t| t <= now);
            if due && scheduled(now, start, net.phase(i)) == now {
                ep.handle_timeout(now);
            }
        }
    }
    let s = eps[0].connection_stats(c).unwrap();
    let sum = |f: fn(&metaroce::PathStats) -> u64| s.paths.iter().map(|p| f(&p.stats)).sum();
    Stats {
        data_packets: sum(|p| p.packets_sent),
        retransmits: sum(|p| p.retransmits),
        probes: sum(|p| p.probes),
        spurious_probes: sum(|p| p.spurious_probes),
        sack_losses: sum(|p| p.sack_losses),
        elapsed: now - start,
    }
}

#[test]
fn clean_bulk_write_retransmits_at_most_one_per_10k_packets() {
    let ms = Duration::from_millis;
    let cases = [
        (1_000u64, 5u64, None),
        (2_500, 5, None),
        (6_000, 2, None),
        (400, 20, None),
        // A loaded host: each process is descheduled for 2 ms every 20 ms.
        (2_500, 5, Some((ms(20), ms(2)))),
        (1_000, 5, Some((ms(7), ms(1)))),
    ];
    for (service_ns, prop_us, stall) in cases {
        let s = run(
            128 << 20,
            Duration::from_nanos(service_ns),
            Duration::from_micros(prop_us),
            stall,
        );
        println!(
            "service {service_ns} ns/datagram, one-way {prop_us} µs, stalls {stall:?}: {} data packets, {} retransmitted ({} probes, {} found spurious, {} SACK losses) in {:?} virtual",
            s.data_packets, s.retransmits, s.probes, s.spurious_probes, s.sack_losses, s.elapsed
        );
        assert!(
            s.retransmits * 10_000 <= s.data_packets,
            "clean run (service {service_ns} ns, one-way {prop_us} µs, stalls {stall:?}): {} retransmissions over {} data packets",
            s.retransmits,
            s.data_packets
        );
    }
}
