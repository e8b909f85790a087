//! A two-endpoint harness with a virtual clock and a seeded, impaired in-memory network.
#![allow(dead_code)]

use metaroce::{EcnCodepoint, Endpoint, EndpointConfig, Event, Transmit};
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, Default)]
pub struct Impair {
    /// Probability a datagram is dropped.
    pub loss: f64,
    /// Probability a datagram is delivered twice.
    pub dup: f64,
    /// Probability a datagram is delayed by an extra 0..5 one-way delays (reordering).
    pub reorder: f64,
    /// Probability a datagram is re-marked CE.
    pub ce: f64,
    /// Drop everything (blackhole).
    pub blackhole: bool,
    /// Drop everything sent from this UDP source port (one path blackholed).
    pub blackhole_port: Option<u16>,
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct InFlight {
    at: Reverse<Instant>,
    seq: Reverse<u64>,
    to: usize,
    from: SocketAddr,
    ecn: Option<u8>,
    data: Vec<u8>,
}

pub struct Pair {
    pub eps: [Endpoint; 2],
    pub addrs: [SocketAddr; 2],
    pub now: Instant,
    pub start: Instant,
    pub delay: Duration,
    pub impair: Impair,
    rng: Xoshiro256PlusPlus,
    queue: BinaryHeap<InFlight>,
    seq: u64,
    pub events: [Vec<Event>; 2],
    pub delivered: u64,
    pub dropped: u64,
}

pub fn config(i: usize, seed: u64) -> EndpointConfig {
    let ip = format!("10.0.0.{}", i + 1);
    let mut c = EndpointConfig::new(
        format!("{ip}:4791").parse().unwrap(),
        (0..16).map(|k| 0xC000 + k + 16 * i as u16).collect(),
    );
    c.seed = seed.wrapping_mul(31).wrapping_add(i as u64);
    c.transport.max_gso_segments = 4;
    c.transport.pmtu = 1024;
    c
}

impl Pair {
    pub fn new(seed: u64, impair: Impair) -> Pair {
        Self::with_configs(seed, impair, config(0, seed), config(1, seed))
    }

    pub fn with_configs(seed: u64, impair: Impair, a: EndpointConfig, b: EndpointConfig) -> Pair {
        let now = Instant::now();
        let addrs = [a.local_addr, b.local_addr];
        Pair {
            eps: [Endpoint::new(a).unwrap(), Endpoint::new(b).unwrap()],
            addrs,
            now,
            start: now,
            delay: Duration::from_micros(10),
            impair,
            rng: Xoshiro256PlusPlus::seed_from_u64(seed),
            queue: BinaryHeap::new(),
            seq: 0,
            events: [Vec::new(), Vec::new()],
            delivered: 0,
            dropped: 0,
        }
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && (self.rng.next_u64() as f64 / u64::MAX as f64) < p
    }

    fn enqueue(&mut self, from_idx: usize, t: &Transmit, data: &[u8]) {
        let to = self.addrs.iter().position(|a| *a == t.destination);
        let Some(to) = to else { return };
        let from = SocketAddr::new(self.addrs[from_idx].ip(), t.src_port);
        let seg = t.segment_size.unwrap_or(t.size);
        for chunk in data[..t.size].chunks(seg) {
            if self.impair.blackhole
                || self.impair.blackhole_port == Some(t.src_port)
                || self.chance(self.impair.loss)
            {
                self.dropped += 1;
                continue;
            }
            let copies = if self.chance(self.impair.dup) { 2 } else { 1 };
            for _ in 0..copies {
                let mut at = self.now + self.delay;
                if self.chance(self.impair.reorder) {
                    at += self.delay * (1 + (self.rng.next_u32() % 5));
                }
                let mut ecn = t.ecn.map(|e| e.bits());
                if ecn.is_some() && self.chance(self.impair.ce) {
                    ecn = Some(0b11);
                }
                self.seq += 1;
                self.queue.push(InFlight {
                    at: Reverse(at),
                    seq: Reverse(self.seq),
                    to,
                    from,
                    ecn,
                    data: chunk.to_vec(),
                });
            }
        }
    }

    /// Send everything both endpoints want to send, collect events.
    pub fn flush(&mut self) {
        let mut buf = Vec::with_capacity(1 << 16);
        loop {
            let mut any = false;
            for i in 0..2 {
                while let Some(t) = self.eps[i].poll_transmit(self.now, &mut buf) {
                    any = true;
                    let data = buf.clone();
                    self.enqueue(i, &t, &data);
                }
            }
            if !any {
                break;
            }
        }
        for i in 0..2 {
            while let Some(e) = self.eps[i].poll_event() {
                self.events[i].push(e);
            }
        }
    }

    /// Advance the virtual clock to the next packet arrival or timer and process it.
    /// Returns false when nothing is left to do.
    pub fn step(&mut self) -> bool {
        self.flush();
        let next_pkt = self.queue.peek().map(|p| p.at.0);
        let next_timer = [self.eps[0].poll_timeout(), self.eps[1].poll_timeout()]
            .into_iter()
            .flatten()
            .min();
        let next = match (next_pkt, next_timer) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) => return false,
        };
        if next > self.now {
            self.now = next;
        }
        while self.queue.peek().is_some_and(|p| p.at.0 <= self.now) {
            let p = self.queue.pop().unwrap();
            self.delivered += 1;
            let local = self.addrs[p.to].ip();
            self.eps[p.to].handle_datagram(
                self.now,
                p.from,
                Some(local),
                p.ecn.and_then(EcnCodepoint::from_bits),
                &p.data,
            );
        }
        for i in 0..2 {
            if self.eps[i].poll_timeout().is_some_and(|t| t <= self.now) {
                self.eps[i].handle_timeout(self.now);
            }
        }
        self.flush();
        true
    }

    /// Step until `done` holds or the virtual time limit passes; returns whether `done` held.
    pub fn run_until(&mut self, limit: Duration, mut done: impl FnMut(&Pair) -> bool) -> bool {
        while self.now - self.start < limit {
            if done(self) {
                return true;
            }
            if !self.step() {
                return done(self);
            }
        }
        done(self)
    }

    /// Connect endpoint 0 to endpoint 1; returns (client handle, server handle).
    pub fn connect(&mut self) -> (metaroce::ConnectionHandle, metaroce::ConnectionHandle) {
        let c = self.eps[0].connect(self.now, self.addrs[1], None).unwrap();
        let ok = self.run_until(Duration::from_secs(10), |p| {
            p.events[0]
                .iter()
                .any(|e| matches!(e, Event::Connected(h) if *h == c))
                && p.events[1].iter().any(|e| matches!(e, Event::Incoming(_)))
        });
        assert!(ok, "handshake did not complete: {:?}", self.events);
        let s = self.events[1]
            .iter()
            .find_map(|e| match e {
                Event::Incoming(h) => Some(*h),
                _ => None,
            })
            .unwrap();
        self.events[0].clear();
        self.events[1].clear();
        (c, s)
    }
}
