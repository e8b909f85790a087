//! Test harness for the property tests (`prop_*.rs`) and the named scenarios
//! (`scenarios.rs`).
//!
//! * [`Net`]: two endpoints (index 0 = A, 1 = B), a virtual clock and an in-memory network
//!   (extended copy of `tests/common/mod.rs`). Impairments are [`Rule`]s: a virtual-time
//!   window `[from, until)`, a [`Filter`] (direction, packet kind from BTH byte 0, path from
//!   the UDP source port, or any predicate over the parsed packet) and an [`Action`] (loss,
//!   burst loss of N consecutive matching packets, blackhole, duplication, extra delay,
//!   late copies, holding, capture for manual re-injection, CE marking). An endpoint can be
//!   restarted (replaced by a fresh `Endpoint` with the same address and another seed)
//!   while packets of its old incarnation are still in flight.
//! * [`Workload`]: memory regions with canary bytes on both endpoints, a schedule of
//!   operations ([`OpSpec`]: SENDs on streams, WRITEs and WRITEs with immediate, valid or
//!   not) posted from either side, and the checks every property and scenario asserts
//!   (exactly-once in-order delivery per stream, memory contents against a model, canaries,
//!   one completion per operation in posting order with the right status, immediates
//!   exactly once, liveness and quiescence).
//! * proptest strategies for operation schedules and impairment schedules, built from
//!   vectors of small structs so that they shrink to small, readable cases.
#![allow(dead_code)]

use bytes::Bytes;
use metaroce::wire::{Packet, Reth, SendEth, WriteEth};
use metaroce::{
    Access, ConnectionError, ConnectionHandle, EcnCodepoint, Endpoint, EndpointConfig, Event,
    MrKeys, PostError, Transmit, WcOpcode, WcStatus, WriteRequest,
};
use proptest::prelude::*;
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

// =======================================================================================
// Packets as the network sees them

/// Packet kind, from byte 0 of the UDP payload (the BTH opcode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// 0xC0 MR_CONNECT.
    Connect,
    /// 0xC1 MR_ACK.
    Ack,
    /// 0xC2 / 0xC3 / 0xC4: MR_SEND, MR_WRITE, MR_WRITE_WITH_IMMEDIATE.
    Data,
    /// 0xC5 MR_NAK.
    Nak,
    /// 0xC6 MR_CLOSE.
    Close,
    /// Anything else.
    Other,
}

impl Kind {
    pub fn of(byte0: u8) -> Kind {
        match byte0 {
            0xC0 => Kind::Connect,
            0xC1 => Kind::Ack,
            0xC2..=0xC4 => Kind::Data,
            0xC5 => Kind::Nak,
            0xC6 => Kind::Close,
            _ => Kind::Other,
        }
    }
}

/// What a rule's filter can look at: one datagram, parsed.
#[derive(Debug, Clone)]
pub struct PktInfo {
    /// Sending endpoint (0 = A, 1 = B).
    pub from: usize,
    pub kind: Kind,
    pub opcode: u8,
    /// UDP source port (the path's ECMP entropy).
    pub src_port: u16,
    /// Index of `src_port` in the sender's configured `source_ports`: the route the packet
    /// takes through the (ECMP) network. It is the packet's path id until the sender
    /// re-rolls a path to a spare port after repeated timeouts.
    pub path: Option<usize>,
    /// Path id carried in the packet (PathEth of data and NAKs, AckEth of ACKs).
    pub path_id: Option<u8>,
    pub dest_qp: u32,
    pub psn: u32,
    pub ack_req: bool,
    /// PathEth retransmit flag (data packets).
    pub retransmit: bool,
    pub send: Option<SendEth>,
    pub write: Option<(Reth, WriteEth, Option<u32>)>,
    pub payload_len: usize,
    /// Datagram length.
    pub len: usize,
}

impl PktInfo {
    fn parse(from: usize, src_port: u16, path: Option<usize>, data: &[u8]) -> PktInfo {
        let mut info = PktInfo {
            from,
            kind: Kind::of(data.first().copied().unwrap_or(0)),
            opcode: data.first().copied().unwrap_or(0),
            src_port,
            path,
            path_id: None,
            dest_qp: 0,
            psn: 0,
            ack_req: false,
            retransmit: false,
            send: None,
            write: None,
            payload_len: 0,
            len: data.len(),
        };
        if let Ok(p) = Packet::parse(data) {
            info.dest_qp = p.bth.dest_qp;
            info.psn = p.bth.psn;
            info.ack_req = p.bth.ack_req;
            info.payload_len = p.payload.len();
            match p.headers {
                metaroce::wire::Headers::Send { path, send } => {
                    info.retransmit = path.flags & 1 != 0;
                    info.path_id = Some(path.path_id);
                    info.send = Some(send);
                }
                metaroce::wire::Headers::Ack(a) => info.path_id = Some(a.path_id),
                metaroce::wire::Headers::Nak { path, .. } => info.path_id = Some(path.path_id),
                metaroce::wire::Headers::Write {
                    path,
                    reth,
                    write,
                    imm,
                } => {
                    info.retransmit = path.flags & 1 != 0;
                    info.path_id = Some(path.path_id);
                    info.write = Some((reth, write, imm));
                }
                _ => {}
            }
        }
        info
    }

    /// Whether this is the last segment of its message / WRITE.
    pub fn is_last_segment(&self) -> bool {
        if let Some(s) = &self.send {
            return s.offset as u64 + self.payload_len as u64 >= s.msg_len as u64;
        }
        if let Some((r, w, _)) = &self.write {
            return w.offset as u64 + self.payload_len as u64 >= r.dma_len as u64;
        }
        false
    }
}

/// A predicate over packets.
pub type Pred = Rc<dyn Fn(&PktInfo) -> bool>;

/// Which packets a rule applies to. Every field that is set must match.
#[derive(Clone, Default)]
pub struct Filter {
    /// Sending endpoint.
    pub from: Option<usize>,
    /// Packet kind.
    pub kind: Option<Kind>,
    /// Route: position of the UDP source port in the sender's configured port list (see
    /// [`PktInfo::path`]).
    pub path: Option<usize>,
    /// Anything else.
    pub pred: Option<Pred>,
}

impl fmt::Debug for Filter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Filter")
            .field("from", &self.from)
            .field("kind", &self.kind)
            .field("path", &self.path)
            .field("pred", &self.pred.as_ref().map(|_| "<fn>"))
            .finish()
    }
}

impl Filter {
    pub fn any() -> Filter {
        Filter::default()
    }
    /// Packets sent by endpoint `i`.
    pub fn from(mut self, i: usize) -> Filter {
        self.from = Some(i);
        self
    }
    pub fn kind(mut self, k: Kind) -> Filter {
        self.kind = Some(k);
        self
    }
    pub fn path(mut self, p: usize) -> Filter {
        self.path = Some(p);
        self
    }
    pub fn when(mut self, f: impl Fn(&PktInfo) -> bool + 'static) -> Filter {
        self.pred = Some(Rc::new(f));
        self
    }
    fn matches(&self, p: &PktInfo) -> bool {
        self.from.is_none_or(|f| f == p.from)
            && self.kind.is_none_or(|k| k == p.kind)
            && self.path.is_none_or(|x| Some(x) == p.path)
            && self.pred.as_ref().is_none_or(|f| f(p))
    }
}

/// What a rule does to a matching packet.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Action {
    /// Drop with this probability.
    Drop(f64),
    /// Drop the next `n` matching packets (burst loss), then nothing.
    Burst(u64),
    /// Drop everything.
    Blackhole,
    /// With this probability deliver `copies` extra copies (at the same time).
    Dup { prob: f64, copies: u32 },
    /// With this probability delay by `extra` more (reordering).
    Delay { prob: f64, extra: Duration },
    /// With this probability delay by a uniform random extra in `[0, max)`.
    Jitter { prob: f64, max: Duration },
    /// With this probability also deliver a copy `after` later (late duplicate); the
    /// original is delivered normally.
    Late { prob: f64, after: Duration },
    /// With this probability deliver the packet only `after` later (held back).
    Hold { prob: f64, after: Duration },
    /// Take the first `max` matching packets off the network and keep them in
    /// [`Net::captured`] for [`Net::inject`].
    Capture { max: usize },
    /// With this probability re-mark the packet CE (only ECN-capable ones).
    Ce(f64),
}

/// An impairment: `action` on packets matching `filter` sent in `[from, until)` (virtual
/// time since the start of the run).
#[derive(Debug, Clone)]
pub struct Rule {
    pub from: Duration,
    pub until: Duration,
    pub filter: Filter,
    pub action: Action,
}

impl Rule {
    pub fn always(filter: Filter, action: Action) -> Rule {
        Rule {
            from: Duration::ZERO,
            until: Duration::MAX,
            filter,
            action,
        }
    }
    pub fn between(from: Duration, until: Duration, filter: Filter, action: Action) -> Rule {
        Rule {
            from,
            until,
            filter,
            action,
        }
    }
}

#[derive(Debug)]
struct RuleState {
    rule: Rule,
    /// Matching packets seen.
    hits: u64,
    /// Packets the action changed (dropped, duplicated, delayed, captured, marked).
    acted: u64,
}

/// A packet taken off the network by [`Action::Capture`].
#[derive(Debug, Clone)]
pub struct Captured {
    pub at: Instant,
    pub to: usize,
    pub from: SocketAddr,
    pub ecn: Option<u8>,
    pub data: Vec<u8>,
    pub info: PktInfo,
    pub rule: usize,
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

// =======================================================================================
// The network

/// Endpoint configuration used by the harness: 8 paths, PMTU 1024, GSO batches of 4.
pub fn config(i: usize, seed: u64) -> EndpointConfig {
    let ip = format!("10.0.0.{}", i + 1);
    let mut c = EndpointConfig::new(
        format!("{ip}:4791").parse().unwrap(),
        (0..8).map(|k| 0xC000 + k + 16 * i as u16).collect(),
    );
    c.seed = seed.wrapping_mul(31).wrapping_add(i as u64);
    c.transport.max_gso_segments = 4;
    c.transport.pmtu = 1024;
    c
}

/// Most steps a run may take before the harness declares a livelock.
pub const MAX_STEPS: u64 = 5_000_000;

/// Two endpoints, a virtual clock, an impaired in-memory network.
pub struct Net {
    pub eps: [Endpoint; 2],
    pub configs: [EndpointConfig; 2],
    pub addrs: [SocketAddr; 2],
    pub now: Instant,
    pub start: Instant,
    /// One-way delay of every packet.
    pub delay: Duration,
    rules: Vec<RuleState>,
    rng: Xoshiro256PlusPlus,
    queue: BinaryHeap<InFlight>,
    seq: u64,
    /// Events of the current incarnation of each endpoint, in order.
    pub events: [Vec<Event>; 2],
    /// Virtual time of each event in `events`.
    pub event_times: [Vec<Instant>; 2],
    /// Events of earlier incarnations (one vector per restart).
    pub old_events: [Vec<Vec<Event>>; 2],
    pub captured: Vec<Captured>,
    /// Datagrams handed to an endpoint.
    pub delivered: u64,
    /// Datagrams dropped by rules (captures included).
    pub dropped: u64,
    /// Datagrams sent, by sender and kind.
    pub sent: [HashMap<Kind, u64>; 2],
    pub steps: u64,
}

impl Net {
    pub fn new(seed: u64) -> Net {
        Self::with_configs(seed, config(0, seed), config(1, seed))
    }

    pub fn with_configs(seed: u64, a: EndpointConfig, b: EndpointConfig) -> Net {
        let now = Instant::now();
        let addrs = [a.local_addr, b.local_addr];
        Net {
            eps: [
                Endpoint::new(a.clone()).unwrap(),
                Endpoint::new(b.clone()).unwrap(),
            ],
            configs: [a, b],
            addrs,
            now,
            start: now,
            delay: Duration::from_micros(10),
            rules: Vec::new(),
            rng: Xoshiro256PlusPlus::seed_from_u64(seed ^ 0x5EED_0F7E_5700),
            queue: BinaryHeap::new(),
            seq: 0,
            events: [Vec::new(), Vec::new()],
            event_times: [Vec::new(), Vec::new()],
            old_events: [Vec::new(), Vec::new()],
            captured: Vec::new(),
            delivered: 0,
            dropped: 0,
            sent: [HashMap::new(), HashMap::new()],
            steps: 0,
        }
    }

    /// Virtual time since the start.
    pub fn elapsed(&self) -> Duration {
        self.now - self.start
    }

    /// Add an impairment rule; returns its index (for [`hits`](Self::hits)).
    pub fn add_rule(&mut self, r: Rule) -> usize {
        self.rules.push(RuleState {
            rule: r,
            hits: 0,
            acted: 0,
        });
        self.rules.len() - 1
    }

    /// Remove every rule.
    pub fn clear_rules(&mut self) {
        self.rules.clear();
    }

    /// (matching packets, packets acted on) of rule `i`.
    pub fn hits(&self, i: usize) -> (u64, u64) {
        (self.rules[i].hits, self.rules[i].acted)
    }

    fn chance(&mut self, p: f64) -> bool {
        p >= 1.0 || (p > 0.0 && (self.rng.next_u64() as f64 / u64::MAX as f64) < p)
    }

    fn path_of(&self, i: usize, port: u16) -> Option<usize> {
        self.configs[i].source_ports.iter().position(|&p| p == port)
    }

    fn push(&mut self, at: Instant, to: usize, from: SocketAddr, ecn: Option<u8>, data: Vec<u8>) {
        self.seq += 1;
        self.queue.push(InFlight {
            at: Reverse(at),
            seq: Reverse(self.seq),
            to,
            from,
            ecn,
            data,
        });
    }

    fn enqueue(&mut self, from_idx: usize, t: &Transmit, data: &[u8]) {
        let Some(to) = self.addrs.iter().position(|a| *a == t.destination) else {
            return;
        };
        let from = SocketAddr::new(self.addrs[from_idx].ip(), t.src_port);
        let path = self.path_of(from_idx, t.src_port);
        let seg = t.segment_size.unwrap_or(t.size).max(1);
        let rel = self.elapsed();
        for chunk in data[..t.size].chunks(seg) {
            let info = PktInfo::parse(from_idx, t.src_port, path, chunk);
            *self.sent[from_idx].entry(info.kind).or_default() += 1;
            let mut drop = false;
            let mut capture = None;
            let mut extra_copies = 0u32;
            let mut extra = Duration::ZERO;
            let mut late: Vec<Duration> = Vec::new();
            let mut hold: Option<Duration> = None;
            let mut ce = false;
            for ri in 0..self.rules.len() {
                let (from_t, until_t) = (self.rules[ri].rule.from, self.rules[ri].rule.until);
                if rel < from_t || rel >= until_t || !self.rules[ri].rule.filter.matches(&info) {
                    continue;
                }
                self.rules[ri].hits += 1;
                let acted = match self.rules[ri].rule.action {
                    Action::Drop(p) => {
                        let d = self.chance(p);
                        drop |= d;
                        d
                    }
                    Action::Burst(n) => {
                        let d = self.rules[ri].acted < n;
                        drop |= d;
                        d
                    }
                    Action::Blackhole => {
                        drop = true;
                        true
                    }
                    Action::Dup { prob, copies } => {
                        let d = self.chance(prob);
                        if d {
                            extra_copies += copies;
                        }
                        d
                    }
                    Action::Delay { prob, extra: e } => {
                        let d = self.chance(prob);
                        if d {
                            extra += e;
                        }
                        d
                    }
                    Action::Jitter { prob, max } => {
                        let d = self.chance(prob);
                        if d && !max.is_zero() {
                            let r = self.rng.next_u64() % max.as_nanos().max(1) as u64;
                            extra += Duration::from_nanos(r);
                        }
                        d
                    }
                    Action::Late { prob, after } => {
                        let d = self.chance(prob);
                        if d {
                            late.push(after);
                        }
                        d
                    }
                    Action::Hold { prob, after } => {
                        let d = self.chance(prob);
                        if d {
                            hold = Some(hold.map_or(after, |h: Duration| h.max(after)));
                        }
                        d
                    }
                    Action::Capture { max } => {
                        let d = capture.is_none() && (self.rules[ri].acted as usize) < max;
                        if d {
                            capture = Some(ri);
                        }
                        d
                    }
                    Action::Ce(p) => {
                        let d = t.ecn.is_some() && self.chance(p);
                        ce |= d;
                        d
                    }
                };
                if acted {
                    self.rules[ri].acted += 1;
                }
            }
            let mut ecn = t.ecn.map(|e| e.bits());
            if ce {
                ecn = Some(0b11);
            }
            if let Some(rule) = capture {
                self.dropped += 1;
                self.captured.push(Captured {
                    at: self.now,
                    to,
                    from,
                    ecn,
                    data: chunk.to_vec(),
                    info,
                    rule,
                });
                continue;
            }
            if drop {
                self.dropped += 1;
                continue;
            }
            let base = self.now + self.delay + extra;
            let first = match hold {
                Some(h) => base + h,
                None => base,
            };
            for _ in 0..=extra_copies {
                self.push(first, to, from, ecn, chunk.to_vec());
            }
            for l in late {
                self.push(base + l, to, from, ecn, chunk.to_vec());
            }
        }
    }

    /// Deliver captured packet `i` (again) `after` from now.
    pub fn inject(&mut self, i: usize, after: Duration) {
        let c = self.captured[i].clone();
        self.push(self.now + after, c.to, c.from, c.ecn, c.data);
    }

    /// Deliver raw bytes to endpoint `to` as if sent from `from`, `after` from now.
    pub fn inject_raw(&mut self, to: usize, from: SocketAddr, data: Vec<u8>, after: Duration) {
        self.push(self.now + after, to, from, None, data);
    }

    /// Packets in flight.
    pub fn in_flight(&self) -> usize {
        self.queue.len()
    }

    /// Replace endpoint `i` by a fresh one with the same configuration and address but the
    /// given seed. Packets in flight stay in flight and reach the new incarnation.
    pub fn restart(&mut self, i: usize, seed: u64) {
        let mut cfg = self.configs[i].clone();
        cfg.seed = seed;
        self.eps[i] = Endpoint::new(cfg.clone()).unwrap();
        self.configs[i] = cfg;
        let old = std::mem::take(&mut self.events[i]);
        self.event_times[i].clear();
        self.old_events[i].push(old);
    }

    /// Send everything both endpoints want to send, collect events.
    pub fn flush(&mut self) {
        let mut buf = Vec::with_capacity(1 << 16);
        loop {
            let mut any = false;
            for i in 0..2 {
                while let Some(t) = self.eps[i].poll_transmit(self.now, &mut buf) {
                    any = true;
                    let data = std::mem::take(&mut buf);
                    self.enqueue(i, &t, &data);
                    buf = data;
                }
            }
            if !any {
                break;
            }
        }
        for i in 0..2 {
            while let Some(e) = self.eps[i].poll_event() {
                self.events[i].push(e);
                self.event_times[i].push(self.now);
            }
        }
    }

    /// When something happens next (a packet arrives or a timer fires).
    pub fn next_event(&self) -> Option<Instant> {
        let next_pkt = self.queue.peek().map(|p| p.at.0);
        let next_timer = [self.eps[0].poll_timeout(), self.eps[1].poll_timeout()]
            .into_iter()
            .flatten()
            .min();
        match (next_pkt, next_timer) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn process_now(&mut self) {
        self.steps += 1;
        assert!(
            self.steps < MAX_STEPS,
            "livelock: {} steps at virtual time {:?}",
            self.steps,
            self.elapsed()
        );
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
    }

    /// Advance the virtual clock to the next packet arrival or timer and process it.
    /// Returns false when nothing is left to do.
    pub fn step(&mut self) -> bool {
        self.flush();
        let Some(next) = self.next_event() else {
            return false;
        };
        if next > self.now {
            self.now = next;
        }
        self.process_now();
        true
    }

    /// Process everything due up to `t` (virtual, absolute), then set the clock to `t`.
    pub fn advance_to(&mut self, t: Instant) {
        self.flush();
        while let Some(next) = self.next_event() {
            if next > t {
                break;
            }
            if next > self.now {
                self.now = next;
            }
            self.process_now();
        }
        if t > self.now {
            self.now = t;
        }
    }

    /// Advance the clock by `d`.
    pub fn run_for(&mut self, d: Duration) {
        let t = self.now + d;
        self.advance_to(t);
    }

    /// Step until `done` holds or the virtual time since the start passes `limit`;
    /// returns whether `done` held.
    pub fn run_until(&mut self, limit: Duration, mut done: impl FnMut(&Net) -> bool) -> bool {
        loop {
            self.flush();
            if done(self) {
                return true;
            }
            let Some(next) = self.next_event() else {
                return done(self);
            };
            if next - self.start > limit {
                self.advance_to(self.start + limit);
                return done(self);
            }
            self.step();
        }
    }

    /// Run until nothing is in flight and no timer is armed, within `limit` of virtual
    /// time from now; returns whether the network went quiet.
    pub fn run_until_idle(&mut self, limit: Duration) -> bool {
        let end = self.now + limit;
        loop {
            self.flush();
            let Some(next) = self.next_event() else {
                return true;
            };
            if next > end {
                return false;
            }
            self.step();
        }
    }

    /// Connect A to B; returns (A's handle, B's handle), or `None` if the handshake did not
    /// complete within `limit` (virtual time from the start).
    pub fn try_connect(&mut self, limit: Duration) -> Option<(ConnectionHandle, ConnectionHandle)> {
        let n1 = self.events[1].len();
        let c = self.eps[0].connect(self.now, self.addrs[1], None).unwrap();
        let server = |n: &Net| {
            n.events[1][n1..].iter().find_map(|e| match e {
                Event::Incoming(h) => Some(*h),
                _ => None,
            })
        };
        let ok = self.run_until(limit, |n| {
            n.events[0]
                .iter()
                .any(|e| matches!(e, Event::Connected(h) if *h == c))
                && server(n).is_some()
        });
        ok.then(|| (c, server(self).unwrap()))
    }

    /// Connect A to B; panics if the handshake does not complete in 10 s. Clears the
    /// event logs.
    pub fn connect(&mut self) -> (ConnectionHandle, ConnectionHandle) {
        let limit = self.elapsed() + Duration::from_secs(10);
        let r = self.try_connect(limit);
        let (c, s) = r.unwrap_or_else(|| panic!("handshake did not complete: {:?}", self.events));
        for i in 0..2 {
            self.events[i].clear();
            self.event_times[i].clear();
        }
        (c, s)
    }

    /// Completions reported on endpoint `i` for `conn`.
    pub fn completions(&self, i: usize, conn: ConnectionHandle) -> Vec<metaroce::WorkCompletion> {
        self.events[i]
            .iter()
            .filter_map(|e| match e {
                Event::Completion { conn: c, wc } if *c == conn => Some(*wc),
                _ => None,
            })
            .collect()
    }

    /// Why `conn` on endpoint `i` ended, if it did.
    pub fn lost(&self, i: usize, conn: ConnectionHandle) -> Option<ConnectionError> {
        self.events[i].iter().find_map(|e| match e {
            Event::ConnectionLost { conn: c, reason } if *c == conn => Some(*reason),
            _ => None,
        })
    }

    /// Messages received on endpoint `i`, per stream, in order.
    pub fn messages(&self, i: usize, conn: ConnectionHandle) -> BTreeMap<u32, Vec<Bytes>> {
        let mut m: BTreeMap<u32, Vec<Bytes>> = BTreeMap::new();
        for e in &self.events[i] {
            if let Event::Message {
                conn: c,
                stream,
                data,
            } = e
            {
                if *c == conn {
                    m.entry(*stream).or_default().push(data.clone());
                }
            }
        }
        m
    }

    /// Immediates reported on endpoint `i`: (imm, byte_len) in order.
    pub fn immediates(&self, i: usize, conn: ConnectionHandle) -> Vec<(u32, u32)> {
        self.events[i]
            .iter()
            .filter_map(|e| match e {
                Event::WriteWithImm {
                    conn: c,
                    imm,
                    byte_len,
                } if *c == conn => Some((*imm, *byte_len)),
                _ => None,
            })
            .collect()
    }
}

/// Deterministic bytes for a seed (xorshift).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

// =======================================================================================
// Workload: regions with canaries, operations, the model and the checks

/// Bytes of the local source region of each endpoint.
pub const SRC_LEN: u32 = 64 * 1024;
/// Canary bytes before and after the target area of the writable region.
pub const GUARD: u32 = 512;
/// Bytes of the target area of the writable region.
pub const AREA: u32 = 32 * 1024;
/// Bytes of the region without REMOTE_WRITE.
pub const RO_LEN: u32 = 4096;
/// Largest SEND and WRITE the generators make.
pub const MAX_OP_LEN: u32 = 20_000;

/// Canary byte `i` of region `which` on endpoint `side`.
pub fn canary(side: usize, which: u8, i: usize) -> u8 {
    (i as u8).wrapping_mul(31) ^ 0xA5 ^ which.wrapping_mul(17) ^ (side as u8 * 0x3C)
}

/// The regions each endpoint registers.
#[derive(Debug, Clone, Copy)]
pub struct Regions {
    /// Local source of WRITEs (LOCAL_WRITE only).
    pub src: MrKeys,
    /// Target of valid WRITEs (LOCAL_WRITE | REMOTE_WRITE): GUARD canary bytes, AREA, GUARD.
    pub rw: MrKeys,
    /// A region without REMOTE_WRITE (LOCAL_WRITE | REMOTE_READ), all canary.
    pub ro: MrKeys,
}

impl Regions {
    pub fn register(ep: &mut Endpoint, side: usize) -> Regions {
        let src = pattern(0x5_0c0 + side as u64, SRC_LEN as usize);
        let rw: Vec<u8> = (0..(2 * GUARD + AREA) as usize)
            .map(|i| canary(side, 1, i))
            .collect();
        let ro: Vec<u8> = (0..RO_LEN as usize).map(|i| canary(side, 2, i)).collect();
        Regions {
            src: ep.register_mr(src, Access::LOCAL_WRITE),
            rw: ep.register_mr(rw, Access::LOCAL_WRITE | Access::REMOTE_WRITE),
            ro: ep.register_mr(ro, Access::LOCAL_WRITE | Access::REMOTE_READ),
        }
    }
}

/// Where a WRITE goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Inside the target area of the peer's writable region: valid.
    Area,
    /// An rkey no region has.
    BadRkey,
    /// The writable region's rkey with another variant byte (a stale key).
    StaleRkey,
    /// Crossing the end of the writable region.
    PastEnd,
    /// Starting one byte before the writable region.
    BeforeStart,
    /// Inside the region without REMOTE_WRITE.
    NoRemoteWrite,
}

/// One operation of a schedule.
#[derive(Debug, Clone, PartialEq)]
pub enum OpKind {
    /// SEND of `len` bytes on `stream`.
    Send { stream: u32, len: u32 },
    /// RDMA WRITE (with immediate if `imm`) of `len` bytes from `src_off` in the local
    /// source region to `target` (`dst_off` inside the target area, modulo what fits).
    Write {
        target: Target,
        dst_off: u32,
        src_off: u32,
        len: u32,
        imm: bool,
    },
}

/// An operation posted by endpoint `side` after waiting `gap_us` of virtual time (and, if
/// `fence`, until every earlier operation of that side completed).
#[derive(Debug, Clone, PartialEq)]
pub struct OpSpec {
    pub side: usize,
    pub gap_us: u32,
    pub fence: bool,
    pub kind: OpKind,
}

impl OpSpec {
    pub fn send(side: usize, stream: u32, len: u32) -> OpSpec {
        OpSpec {
            side,
            gap_us: 0,
            fence: false,
            kind: OpKind::Send { stream, len },
        }
    }
    pub fn write(side: usize, target: Target, dst_off: u32, len: u32, imm: bool) -> OpSpec {
        OpSpec {
            side,
            gap_us: 0,
            fence: false,
            kind: OpKind::Write {
                target,
                dst_off,
                src_off: dst_off.wrapping_mul(7).wrapping_add(len),
                len,
                imm,
            },
        }
    }
    /// Take a WRITE's source bytes from offset `off` of the local source region.
    pub fn src(mut self, off: u32) -> OpSpec {
        if let OpKind::Write { src_off, .. } = &mut self.kind {
            *src_off = off;
        }
        self
    }
    pub fn fenced(mut self) -> OpSpec {
        self.fence = true;
        self
    }
    pub fn after_us(mut self, us: u32) -> OpSpec {
        self.gap_us = us;
        self
    }
}

/// A posted operation as the model sees it.
#[derive(Debug, Clone)]
pub struct Posted {
    pub wr_id: u64,
    pub spec: OpSpec,
    /// For SENDs: the message bytes.
    pub data: Option<Bytes>,
    /// For WRITEs: the request.
    pub write: Option<WriteRequest>,
    /// Whether the responder must accept it (zero-length WRITEs are never checked).
    pub valid: bool,
    /// Every earlier operation of this side had completed when this one was posted.
    pub fenced: bool,
    pub posted_at: Duration,
}

impl Posted {
    pub fn len(&self) -> u32 {
        match self.spec.kind {
            OpKind::Send { len, .. } | OpKind::Write { len, .. } => len,
        }
    }
    pub fn opcode(&self) -> WcOpcode {
        match self.spec.kind {
            OpKind::Send { .. } => WcOpcode::Send,
            OpKind::Write { imm: false, .. } => WcOpcode::RdmaWrite,
            OpKind::Write { imm: true, .. } => WcOpcode::RdmaWriteWithImm,
        }
    }
    pub fn expected(&self) -> WcStatus {
        if self.valid {
            WcStatus::Success
        } else {
            WcStatus::RemoteAccessError
        }
    }
}

/// Immediate value of the WRITE with `wr_id` (unique per operation).
pub fn imm_of(wr_id: u64) -> u32 {
    0x1000_0000 | wr_id as u32
}

/// Two endpoints with regions and one connection, a schedule of operations, the model.
pub struct Workload {
    pub net: Net,
    pub regions: [Regions; 2],
    /// The connection handle on each side (A's, B's).
    pub conns: [ConnectionHandle; 2],
    pub posted: [Vec<Posted>; 2],
    /// Posts refused because the connection was already gone.
    pub refused: [Vec<OpSpec>; 2],
    next_wr: u64,
    /// Whether the connection may fail (the schedule blackholes long enough).
    pub allow_failure: bool,
    /// Whether a close is part of the schedule.
    pub closed_by: Option<usize>,
    /// Virtual time (since the start) at which the connection was up.
    pub t0: Duration,
    /// Whether packets for unknown connections are expected (stale traffic after a
    /// restart).
    pub stale_expected: bool,
    /// Packets beyond the SACK window a scenario forged, per receiving side.
    pub forged_beyond_window: [u64; 2],
}

impl Workload {
    /// Regions on both sides, then connect. Returns `None` if the handshake failed (only
    /// acceptable under a schedule that allows failure).
    pub fn start(mut net: Net, connect_limit: Duration) -> Option<Workload> {
        let regions = [
            Regions::register(&mut net.eps[0], 0),
            Regions::register(&mut net.eps[1], 1),
        ];
        let (c, s) = net.try_connect(connect_limit)?;
        Some(Self::resume(net, regions, [c, s], 0))
    }

    /// A workload over an existing network, regions and connection (e.g. a new connection
    /// after a restart); `first_wr` is the first wr_id it uses.
    pub fn resume(
        net: Net,
        regions: [Regions; 2],
        conns: [ConnectionHandle; 2],
        first_wr: u64,
    ) -> Workload {
        let t0 = net.elapsed();
        Workload {
            net,
            regions,
            conns,
            posted: [Vec::new(), Vec::new()],
            refused: [Vec::new(), Vec::new()],
            next_wr: first_wr,
            allow_failure: false,
            closed_by: None,
            t0,
            stale_expected: false,
            forged_beyond_window: [0, 0],
        }
    }

    /// Connection counters of side `i` (`None` once the connection is gone).
    pub fn stats(&self, i: usize) -> Option<metaroce::ConnectionStats> {
        self.net.eps[i].connection_stats(self.conns[i])
    }

    /// Sum of a path counter over side `i`'s paths.
    pub fn path_sum(&self, i: usize, f: impl Fn(&metaroce::PathStats) -> u64) -> u64 {
        self.stats(i)
            .map_or(0, |s| s.paths.iter().map(|p| f(&p.stats)).sum())
    }

    /// Statuses of side `i`'s completions, in order.
    pub fn statuses(&self, i: usize) -> Vec<WcStatus> {
        self.net
            .completions(i, self.conns[i])
            .iter()
            .map(|w| w.status)
            .collect()
    }

    /// Operations of `side` posted and not yet completed.
    pub fn pending(&self, side: usize) -> usize {
        self.posted[side].len() - self.net.completions(side, self.conns[side]).len()
    }

    /// Whether every posted operation has completed on both sides.
    pub fn all_done(&self) -> bool {
        self.pending(0) == 0 && self.pending(1) == 0
    }

    /// Build the request for a WRITE spec (source side `side`).
    pub fn write_request(&self, side: usize, wr_id: u64, kind: &OpKind) -> (WriteRequest, bool) {
        let OpKind::Write {
            target,
            dst_off,
            src_off,
            len,
            imm,
        } = *kind
        else {
            unreachable!()
        };
        let peer = &self.regions[1 - side];
        let len = len.min(AREA);
        let src_off = src_off % (SRC_LEN - len + 1);
        let area_off = (dst_off % (AREA - len + 1)) as u64;
        let in_area = peer.rw.addr + GUARD as u64 + area_off;
        let (remote_addr, rkey) = match target {
            Target::Area => (in_area, peer.rw.rkey),
            Target::BadRkey => (in_area, 0x00AB_CD00 | 0x11),
            Target::StaleRkey => (in_area, peer.rw.rkey ^ 0x80),
            Target::PastEnd => (
                peer.rw.addr + peer.rw.len - (len as u64 / 2).min(peer.rw.len),
                peer.rw.rkey,
            ),
            Target::BeforeStart => (peer.rw.addr - 1, peer.rw.rkey),
            Target::NoRemoteWrite => (
                peer.ro.addr + (dst_off % (RO_LEN - len.min(RO_LEN) + 1)) as u64,
                peer.ro.rkey,
            ),
        };
        let valid = len == 0 || target == Target::Area;
        (
            WriteRequest {
                wr_id,
                lkey: self.regions[side].src.lkey,
                local_offset: src_off as u64,
                len,
                remote_addr,
                rkey,
                imm: imm.then(|| imm_of(wr_id)),
            },
            valid,
        )
    }

    /// Post one operation now. A refusal because the connection is gone is recorded; any
    /// other refusal is an error.
    pub fn post(&mut self, spec: OpSpec) -> Result<(), String> {
        let side = spec.side;
        let wr_id = self.next_wr;
        let fenced = self.pending(side) == 0;
        let conn = self.conns[side];
        let mut posted = Posted {
            wr_id,
            spec: spec.clone(),
            data: None,
            write: None,
            valid: true,
            fenced,
            posted_at: self.net.elapsed(),
        };
        let r = match &spec.kind {
            OpKind::Send { stream, len } => {
                let data = Bytes::from(pattern(wr_id ^ 0xD47A << 20, *len as usize));
                posted.data = Some(data.clone());
                self.net.eps[side].post_send(conn, *stream, wr_id, data)
            }
            k @ OpKind::Write { .. } => {
                let (req, valid) = self.write_request(side, wr_id, k);
                posted.write = Some(req);
                posted.valid = valid;
                self.net.eps[side].post_write(conn, req)
            }
        };
        match r {
            Ok(()) => {
                self.next_wr += 1;
                self.posted[side].push(posted);
                Ok(())
            }
            Err(PostError::UnknownConnection) if self.net.lost(side, conn).is_some() => {
                self.refused[side].push(spec);
                Ok(())
            }
            Err(e) => Err(format!("post of {spec:?} refused: {e:?}")),
        }
    }

    /// Post a schedule: wait each op's gap (and fence), then post it.
    pub fn post_all(&mut self, ops: &[OpSpec], fence_limit: Duration) -> Result<(), String> {
        for op in ops {
            if op.gap_us > 0 {
                self.net.run_for(Duration::from_micros(op.gap_us as u64));
            }
            if op.fence {
                let side = op.side;
                let limit = self.net.elapsed() + fence_limit;
                self.net.run_until(limit, |n| {
                    self.posted[side].len() == n.completions(side, self.conns[side]).len()
                });
            }
            self.post(op.clone())?;
        }
        Ok(())
    }

    /// Run until every operation completed (within `limit` of virtual time from the start)
    /// and then until the network is quiet (within `quiet` more). Liveness check.
    pub fn finish(&mut self, limit: Duration, quiet: Duration) -> Result<(), String> {
        let conns = self.conns;
        let counts = [self.posted[0].len(), self.posted[1].len()];
        let done = self.net.run_until(limit, |n| {
            (0..2).all(|i| n.completions(i, conns[i]).len() == counts[i])
        });
        if !done {
            return Err(format!(
                "liveness: not every operation completed by {:?} (stopped at {:?}): posted {:?}, completed [{}, {}], lost [{:?}, {:?}]",
                limit,
                self.net.elapsed(),
                counts,
                self.net.completions(0, conns[0]).len(),
                self.net.completions(1, conns[1]).len(),
                self.net.lost(0, conns[0]),
                self.net.lost(1, conns[1]),
            ));
        }
        if !self.net.run_until_idle(quiet) {
            return Err(format!(
                "liveness: the network did not go quiet within {quiet:?} after the last completion (in flight {}, timers {:?} {:?})",
                self.net.in_flight(),
                self.net.eps[0].poll_timeout().map(|t| t - self.net.now),
                self.net.eps[1].poll_timeout().map(|t| t - self.net.now),
            ));
        }
        Ok(())
    }

    // ---- checks ----

    /// Every check below.
    pub fn check_all(&self) -> Result<(), String> {
        self.check_completions()?;
        self.check_streams()?;
        self.check_immediates()?;
        self.check_memory()?;
        self.check_endpoint_stats()?;
        Ok(())
    }

    /// One completion per posted operation, in posting order, with the right opcode, length
    /// and status; error statuses only in the patterns a failure or close allows; the
    /// ConnectionLost event (if any) after the last completion.
    pub fn check_completions(&self) -> Result<(), String> {
        for side in 0..2 {
            let conn = self.conns[side];
            let wcs = self.net.completions(side, conn);
            let posted = &self.posted[side];
            if wcs.len() != posted.len() {
                return Err(format!(
                    "side {side}: {} completions for {} operations",
                    wcs.len(),
                    posted.len()
                ));
            }
            for (wc, p) in wcs.iter().zip(posted) {
                if wc.wr_id != p.wr_id {
                    return Err(format!(
                        "side {side}: completion for wr {} where wr {} was due (posting order): {:?}",
                        wc.wr_id,
                        p.wr_id,
                        wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>()
                    ));
                }
                if wc.opcode != p.opcode() || wc.byte_len != p.len() {
                    return Err(format!("side {side}: wr {}: {wc:?} for {p:?}", p.wr_id));
                }
            }
            let lost = self.net.lost(side, conn);
            let n_lost = self.net.events[side]
                .iter()
                .filter(|e| matches!(e, Event::ConnectionLost { conn: c, .. } if *c == conn))
                .count();
            if n_lost > 1 {
                return Err(format!("side {side}: {n_lost} ConnectionLost events"));
            }
            if let Some(pos) = self.net.events[side]
                .iter()
                .position(|e| matches!(e, Event::ConnectionLost { conn: c, .. } if *c == conn))
            {
                if self.net.events[side][pos + 1..]
                    .iter()
                    .any(|e| matches!(e, Event::Completion { conn: c, .. } if *c == conn))
                {
                    return Err(format!("side {side}: a completion after ConnectionLost"));
                }
            }
            let statuses: Vec<WcStatus> = wcs.iter().map(|w| w.status).collect();
            let expected: Vec<WcStatus> = posted.iter().map(Posted::expected).collect();
            match lost {
                None => {
                    if statuses != expected {
                        return Err(format!(
                            "side {side}: statuses {statuses:?}, expected {expected:?}"
                        ));
                    }
                }
                Some(ConnectionError::RetryExceeded) => {
                    if !self.allow_failure {
                        return Err(format!(
                            "side {side}: connection failed (RetryExceeded) under a schedule without a long outage; statuses {statuses:?}"
                        ));
                    }
                    check_error_pattern(side, &statuses, &expected, WcStatus::RetryExceeded)?;
                }
                Some(r @ (ConnectionError::LocallyClosed | ConnectionError::ClosedByPeer)) => {
                    let by = if r == ConnectionError::LocallyClosed {
                        side
                    } else {
                        1 - side
                    };
                    if self.closed_by != Some(by) {
                        return Err(format!("side {side}: unexpected {r:?}"));
                    }
                    check_error_pattern(side, &statuses, &expected, WcStatus::WrFlushError)?;
                }
                Some(r) => return Err(format!("side {side}: connection lost: {r:?}")),
            }
        }
        Ok(())
    }

    /// Messages: per stream, what the receiver got is exactly what was sent, in order, each
    /// once — or, if the sender's connection ended, a prefix of it that contains every
    /// message whose SEND completed successfully.
    pub fn check_streams(&self) -> Result<(), String> {
        for side in 0..2 {
            let rx = 1 - side;
            let got = self.net.messages(rx, self.conns[rx]);
            let wcs = self.net.completions(side, self.conns[side]);
            let ended = self.net.lost(side, self.conns[side]).is_some()
                || self.net.lost(rx, self.conns[rx]).is_some();
            let mut sent: BTreeMap<u32, Vec<(Bytes, WcStatus)>> = BTreeMap::new();
            for (p, wc) in self.posted[side].iter().zip(wcs.iter()) {
                if let OpKind::Send { stream, .. } = p.spec.kind {
                    sent.entry(stream)
                        .or_default()
                        .push((p.data.clone().unwrap(), wc.status));
                }
            }
            for st in got.keys() {
                if !sent.contains_key(st) {
                    return Err(format!("side {rx}: message on stream {st} nobody sent"));
                }
            }
            for (st, msgs) in &sent {
                let empty = Vec::new();
                let g = got.get(st).unwrap_or(&empty);
                if g.len() > msgs.len() {
                    return Err(format!(
                        "stream {st} ({side}->{rx}): {} messages delivered, {} sent (duplicate delivery)",
                        g.len(),
                        msgs.len()
                    ));
                }
                for (i, (a, (b, _))) in g.iter().zip(msgs).enumerate() {
                    if a != b {
                        return Err(format!(
                            "stream {st} ({side}->{rx}): message {i} differs (len {} vs {}){}",
                            a.len(),
                            b.len(),
                            if msgs.iter().any(|(m, _)| m == a) {
                                " — it equals another message of the stream (order/duplicate)"
                            } else {
                                ""
                            }
                        ));
                    }
                }
                let must = msgs
                    .iter()
                    .rposition(|(_, s)| *s == WcStatus::Success)
                    .map_or(0, |i| i + 1);
                if g.len() < must {
                    return Err(format!(
                        "stream {st} ({side}->{rx}): {} messages delivered but {must} completed successfully",
                        g.len()
                    ));
                }
                if !ended && g.len() != msgs.len() {
                    return Err(format!(
                        "stream {st} ({side}->{rx}): {} of {} messages delivered",
                        g.len(),
                        msgs.len()
                    ));
                }
            }
        }
        Ok(())
    }

    /// Immediates: exactly once per successful WRITE with immediate, never for a refused
    /// one, at most once for one that failed with the connection; right length.
    pub fn check_immediates(&self) -> Result<(), String> {
        for side in 0..2 {
            let rx = 1 - side;
            let imms = self.net.immediates(rx, self.conns[rx]);
            let wcs = self.net.completions(side, self.conns[side]);
            let mut count: HashMap<u32, (u32, usize)> = HashMap::new();
            for (imm, len) in &imms {
                let e = count.entry(*imm).or_insert((*len, 0));
                e.1 += 1;
            }
            for (p, wc) in self.posted[side].iter().zip(wcs.iter()) {
                let OpKind::Write { imm: true, .. } = p.spec.kind else {
                    continue;
                };
                let n = count.remove(&imm_of(p.wr_id));
                let times = n.map_or(0, |x| x.1);
                if let Some((len, _)) = n {
                    if len != p.len() {
                        return Err(format!("wr {}: immediate with byte_len {len}", p.wr_id));
                    }
                }
                let ok = match wc.status {
                    WcStatus::Success => times == 1,
                    WcStatus::RemoteAccessError => times == 0,
                    WcStatus::RetryExceeded | WcStatus::WrFlushError => times <= p.valid as usize,
                    _ => false,
                };
                if !ok {
                    return Err(format!(
                        "wr {} ({side}->{rx}, {:?}, valid {}): immediate reported {times} times",
                        p.wr_id, wc.status, p.valid
                    ));
                }
            }
            if !count.is_empty() {
                return Err(format!(
                    "side {rx}: immediates nobody sent: {:?}",
                    count.keys()
                ));
            }
        }
        Ok(())
    }

    /// Memory: each byte of every writable region holds a value some allowed WRITE put
    /// there (the last WRITE posted after everything before it completed wins; overlapping
    /// WRITEs in flight together may leave either's bytes; a WRITE that failed with the
    /// connection may have landed partly); canaries around the target area, the region
    /// without REMOTE_WRITE and the local sources are untouched; refused WRITEs wrote nothing.
    pub fn check_memory(&self) -> Result<(), String> {
        for rx in 0..2 {
            let side = 1 - rx;
            let regs = &self.regions[rx];
            let wcs = self.net.completions(side, self.conns[side]);
            let src = self.net.eps[side]
                .mr_read(self.regions[side].src.lkey, 0, SRC_LEN as u64)
                .map_err(|e| format!("{e}"))?;
            let want_src = pattern(0x5_0c0 + side as u64, SRC_LEN as usize);
            if src != &want_src[..] {
                return Err(format!("side {side}: the local source region changed"));
            }
            // Candidate writers per byte of the rw region: None = canary.
            let n = (2 * GUARD + AREA) as usize;
            let mut cand: Vec<Vec<Option<usize>>> = vec![vec![None]; n];
            for (i, (p, wc)) in self.posted[side].iter().zip(wcs.iter()).enumerate() {
                let Some(req) = p.write else { continue };
                if req.len == 0 {
                    continue;
                }
                let landed = match wc.status {
                    WcStatus::Success => true,
                    WcStatus::RemoteAccessError => false,
                    _ => p.valid,
                };
                if !landed {
                    continue;
                }
                let off = (req.remote_addr - regs.rw.addr) as usize;
                for c in &mut cand[off..off + req.len as usize] {
                    if p.fenced && wc.status == WcStatus::Success {
                        c.clear();
                    }
                    c.push(Some(i));
                }
            }
            let mem = self.net.eps[rx]
                .mr_read(regs.rw.lkey, 0, n as u64)
                .map_err(|e| format!("{e}"))?;
            for (b, &v) in mem.iter().enumerate() {
                let ok = cand[b].iter().any(|c| match c {
                    None => v == canary(rx, 1, b),
                    Some(i) => {
                        let req = self.posted[side][*i].write.unwrap();
                        let off = (req.remote_addr - regs.rw.addr) as usize;
                        v == want_src[req.local_offset as usize + b - off]
                    }
                });
                if !ok {
                    let zone = if b < GUARD as usize || b >= (GUARD + AREA) as usize {
                        "canary guard"
                    } else {
                        "target area"
                    };
                    return Err(format!(
                        "side {rx}: rw region byte {b} ({zone}) = {v:#04x}, allowed writers {:?} (wr ids {:?})",
                        cand[b],
                        cand[b]
                            .iter()
                            .map(|c| c.map(|i| self.posted[side][i].wr_id))
                            .collect::<Vec<_>>()
                    ));
                }
            }
            let ro = self.net.eps[rx]
                .mr_read(regs.ro.lkey, 0, RO_LEN as u64)
                .map_err(|e| format!("{e}"))?;
            if let Some(b) = (0..RO_LEN as usize).find(|&b| ro[b] != canary(rx, 2, b)) {
                return Err(format!(
                    "side {rx}: region without REMOTE_WRITE changed at byte {b}"
                ));
            }
        }
        Ok(())
    }

    /// No malformed or bad-ICRC packets (the network never corrupts); no packet for an
    /// unknown connection unless a connection ended; one connection per side.
    pub fn check_endpoint_stats(&self) -> Result<(), String> {
        let ended = (0..2).any(|i| self.net.lost(i, self.conns[i]).is_some());
        for i in 0..2 {
            let s = self.net.eps[i].stats();
            if s.malformed != 0 || s.bad_icrc != 0 || s.unsupported != 0 {
                return Err(format!("side {i}: {s:?}"));
            }
            if !ended && !self.stale_expected && s.unknown_connection != 0 {
                return Err(format!(
                    "side {i}: packets for unknown connections while both ends were up: {s:?}"
                ));
            }
            // Every data packet carries its path's floor, at most 254 PSNs behind it, and
            // the receiver applies the floor before classifying: a conforming sender never
            // lands beyond the 256-packet window.
            if let Some(st) = self.stats(i) {
                if st.out_of_window_packets != self.forged_beyond_window[i] {
                    return Err(format!(
                        "side {i}: {} packets beyond the SACK window",
                        st.out_of_window_packets
                    ));
                }
            }
            let n = self.net.eps[i].connections().count();
            if n > 1 && !self.stale_expected {
                return Err(format!("side {i}: {n} connections"));
            }
        }
        Ok(())
    }
}

/// Statuses after a connection ended: the expected statuses up to the first operation that
/// was still pending, which gets `first`; every later one either its expected status (it
/// had finished) or `WrFlushError`.
fn check_error_pattern(
    side: usize,
    statuses: &[WcStatus],
    expected: &[WcStatus],
    first: WcStatus,
) -> Result<(), String> {
    let Some(k) = statuses.iter().zip(expected).position(|(a, b)| a != b) else {
        return Ok(());
    };
    let bad = || {
        Err(format!(
            "side {side}: statuses {statuses:?} after the connection ended (expected {expected:?}, first error {first:?})"
        ))
    };
    if statuses[k] != first {
        return bad();
    }
    for (a, b) in statuses[k + 1..].iter().zip(&expected[k + 1..]) {
        if a != b && *a != WcStatus::WrFlushError {
            return bad();
        }
    }
    Ok(())
}

// =======================================================================================
// proptest strategies

/// How many cases a property runs: `PROPTEST_CASES` if set, else `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Message / WRITE lengths: zero, tiny, around the path MTU (1024), multi-packet.
pub fn op_len() -> impl Strategy<Value = u32> {
    prop_oneof![
        1 => Just(0u32),
        2 => 1u32..=64,
        2 => 1000u32..=1100,
        1 => Just(2048u32),
        3 => 1u32..=MAX_OP_LEN,
    ]
}

pub fn target() -> impl Strategy<Value = Target> {
    prop_oneof![
        12 => Just(Target::Area),
        1 => Just(Target::BadRkey),
        1 => Just(Target::StaleRkey),
        1 => Just(Target::PastEnd),
        1 => Just(Target::BeforeStart),
        1 => Just(Target::NoRemoteWrite),
    ]
}

pub fn op_kind(streams: u32) -> impl Strategy<Value = OpKind> {
    prop_oneof![
        (0..streams, op_len()).prop_map(|(stream, len)| OpKind::Send { stream, len }),
        (target(), 0..AREA, 0..SRC_LEN, op_len(), any::<bool>()).prop_map(
            |(target, dst_off, src_off, len, imm)| OpKind::Write {
                target,
                dst_off,
                src_off,
                len,
                imm,
            }
        ),
    ]
}

/// One operation; `sides` = 1 posts from A only, 2 from both.
pub fn op_spec(sides: usize, streams: u32) -> impl Strategy<Value = OpSpec> {
    (
        0..sides,
        prop_oneof![3 => Just(0u32), 1 => 1u32..2000],
        prop::bool::weighted(0.1),
        op_kind(streams),
    )
        .prop_map(|(side, gap_us, fence, kind)| OpSpec {
            side,
            gap_us,
            fence,
            kind,
        })
}

/// Direction of an impairment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirSel {
    AtoB,
    BtoA,
    Both,
}

/// Packet kinds an impairment phase targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KindSel {
    Any,
    Data,
    Ack,
}

/// An impairment in a schedule, in small integers so that it shrinks and prints well.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ActSpec {
    /// Loss, percent.
    Loss(u8),
    /// Burst loss of this many consecutive matching packets.
    Burst(u16),
    /// Duplication, percent.
    Dup(u8),
    /// Reordering: percent delayed, by up to this many µs.
    Reorder(u8, u16),
    /// Late copies: percent, delivered this many ms later.
    Late(u8, u16),
    /// CE marks, percent.
    Ce(u8),
    /// Blackhole.
    Blackhole,
}

/// One phase of an impairment schedule: from `start_us` for `len_us` (virtual µs after the
/// connection is up), `act` on packets matching `dir`, `kind`, `path`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Phase {
    pub start_us: u32,
    pub len_us: u32,
    pub dir: DirSel,
    pub kind: KindSel,
    pub path: Option<u8>,
    pub act: ActSpec,
}

impl Phase {
    /// The rules this phase adds, with times offset by `t0` (the start of the workload).
    pub fn rules(&self, t0: Duration) -> Vec<Rule> {
        let from = t0 + Duration::from_micros(self.start_us as u64);
        let until = from + Duration::from_micros(self.len_us as u64);
        let dirs: &[usize] = match self.dir {
            DirSel::AtoB => &[0],
            DirSel::BtoA => &[1],
            DirSel::Both => &[0, 1],
        };
        let pct = |p: u8| p as f64 / 100.0;
        let action = match self.act {
            ActSpec::Loss(p) => Action::Drop(pct(p)),
            ActSpec::Burst(n) => Action::Burst(n as u64),
            ActSpec::Dup(p) => Action::Dup {
                prob: pct(p),
                copies: 1,
            },
            ActSpec::Reorder(p, us) => Action::Jitter {
                prob: pct(p),
                max: Duration::from_micros(us as u64),
            },
            ActSpec::Late(p, ms) => Action::Late {
                prob: pct(p),
                after: Duration::from_millis(ms as u64),
            },
            ActSpec::Ce(p) => Action::Ce(pct(p)),
            ActSpec::Blackhole => Action::Blackhole,
        };
        dirs.iter()
            .map(|&d| {
                let mut f = Filter::any().from(d);
                f.kind = match self.kind {
                    KindSel::Any => None,
                    KindSel::Data => Some(Kind::Data),
                    KindSel::Ack => Some(Kind::Ack),
                };
                f.path = self.path.map(|p| p as usize);
                Rule::between(from, until, f, action)
            })
            .collect()
    }
}

/// Longest blackhole phase of a benign schedule (µs).
pub const MAX_BENIGN_BLACKHOLE_US: u32 = 20_000;

/// Impairments that never add up to an outage long enough to exhaust the retry budget:
/// loss up to 25 %, bursts up to 64 packets, blackholes up to 20 ms.
pub fn benign_act() -> impl Strategy<Value = ActSpec> {
    prop_oneof![
        4 => (1u8..=25).prop_map(ActSpec::Loss),
        2 => (1u16..=64).prop_map(ActSpec::Burst),
        2 => (1u8..=50).prop_map(ActSpec::Dup),
        3 => (1u8..=50, 10u16..=3000).prop_map(|(p, us)| ActSpec::Reorder(p, us)),
        2 => (1u8..=20, 1u16..=100).prop_map(|(p, ms)| ActSpec::Late(p, ms)),
        1 => (1u8..=50).prop_map(ActSpec::Ce),
        1 => Just(ActSpec::Blackhole),
    ]
}

pub fn phase() -> impl Strategy<Value = Phase> {
    (
        prop_oneof![2 => Just(0u32), 3 => 0u32..5_000, 1 => 0u32..50_000],
        prop_oneof![3 => 100u32..20_000, 1 => 20_000u32..200_000],
        prop_oneof![Just(DirSel::AtoB), Just(DirSel::BtoA), Just(DirSel::Both)],
        prop_oneof![
            2 => Just(KindSel::Any),
            1 => Just(KindSel::Data),
            1 => Just(KindSel::Ack)
        ],
        prop::option::weighted(0.3, 0u8..8),
        benign_act(),
    )
        .prop_map(|(start_us, len_us, dir, kind, path, act)| Phase {
            start_us,
            // Blackholes stay short: a benign schedule never exhausts the retry budget.
            len_us: if act == ActSpec::Blackhole {
                len_us.min(MAX_BENIGN_BLACKHOLE_US)
            } else {
                len_us
            },
            dir,
            kind,
            path,
            act,
        })
}

/// A long total outage (both directions, every path): `start_us` after the workload starts,
/// lasting `len_ms`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outage {
    pub start_us: u32,
    pub len_ms: u32,
}

impl Outage {
    pub fn rules(&self, t0: Duration) -> Vec<Rule> {
        let from = t0 + Duration::from_micros(self.start_us as u64);
        let until = from + Duration::from_millis(self.len_ms as u64);
        vec![Rule::between(from, until, Filter::any(), Action::Blackhole)]
    }
}

/// Transport parameters: mostly the harness defaults, sometimes small path MTUs, one or
/// two paths, no GSO, a tiny receive budget or stream window.
pub fn tuning() -> impl Strategy<Value = Tuning> {
    let pmtu = prop_oneof![3 => Just(1024u32), 1 => Just(256u32), 1 => Just(4096u32)];
    let paths = prop_oneof![3 => Just(8u16), 1 => Just(1u16), 1 => Just(2u16)];
    prop_oneof![
        2 => Just(Tuning::default()),
        1 => (
            [pmtu.clone(), pmtu],
            [paths.clone(), paths],
            prop_oneof![Just(1usize), Just(4usize)],
            prop_oneof![2 => Just(256u64 << 20), 1 => 1u64..=65_536],
            prop_oneof![2 => Just(1024u32), 1 => 1u32..=4],
        )
            .prop_map(|(pmtu, paths, gso, recv_buffer, stream_window)| Tuning {
                pmtu,
                paths,
                gso,
                recv_buffer,
                stream_window,
            }),
    ]
}

// =======================================================================================
// A whole run: configuration, impairment schedule, operations, checks

/// Everything a property run needs; shrinks field by field.
#[derive(Debug, Clone)]
pub struct Schedule {
    pub seed: u64,
    /// First PSN of every path on both sides (`None`: random).
    pub initial_psn: Option<u32>,
    /// Whether the impairment phases also apply to the handshake (times then count from
    /// the very start instead of from the end of the handshake).
    pub impair_handshake: bool,
    pub ops: Vec<OpSpec>,
    pub phases: Vec<Phase>,
    /// A long total outage (makes connection failure acceptable).
    pub outage: Option<Outage>,
    /// Close the connection from `side` just before operation `index` is posted (or after
    /// the last one).
    pub close: Option<(usize, usize)>,
    /// Transport parameters other than the harness defaults.
    pub tuning: Tuning,
}

/// Transport parameters a schedule may vary (per endpoint where it matters).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tuning {
    /// Path MTU of A and B.
    pub pmtu: [u32; 2],
    /// Paths of A and B (the connection uses the smaller).
    pub paths: [u16; 2],
    /// GSO batch size of both.
    pub gso: usize,
    /// Receive buffer budget of both, bytes.
    pub recv_buffer: u64,
    /// Stream window of both, messages.
    pub stream_window: u32,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            pmtu: [1024, 1024],
            paths: [8, 8],
            gso: 4,
            recv_buffer: 256 << 20,
            stream_window: 1024,
        }
    }
}

impl Tuning {
    pub fn apply(&self, i: usize, c: &mut EndpointConfig) {
        c.transport.pmtu = self.pmtu[i];
        c.transport.paths = self.paths[i];
        c.transport.max_gso_segments = self.gso;
        c.transport.max_recv_buffer_bytes = self.recv_buffer;
        c.transport.max_stream_window = self.stream_window;
    }
}

impl Schedule {
    pub fn new(seed: u64, ops: Vec<OpSpec>) -> Schedule {
        Schedule {
            seed,
            initial_psn: None,
            impair_handshake: false,
            ops,
            phases: Vec::new(),
            outage: None,
            close: None,
            tuning: Tuning::default(),
        }
    }
}

/// Run a schedule and every check. Returns the workload for further checks.
pub fn run_schedule(s: &Schedule) -> Result<Workload, String> {
    let mut a = config(0, s.seed);
    let mut b = config(1, s.seed);
    a.initial_psn = s.initial_psn;
    b.initial_psn = s.initial_psn;
    s.tuning.apply(0, &mut a);
    s.tuning.apply(1, &mut b);
    let mut net = Net::with_configs(s.seed, a, b);
    if s.impair_handshake {
        for p in &s.phases {
            for r in p.rules(Duration::ZERO) {
                net.add_rule(r);
            }
        }
    }
    let mut w = Workload::start(net, Duration::from_secs(10))
        .ok_or_else(|| "handshake did not complete within 10 s".to_string())?;
    let t0 = w.net.elapsed();
    if !s.impair_handshake {
        for p in &s.phases {
            for r in p.rules(t0) {
                w.net.add_rule(r);
            }
        }
    }
    if let Some(o) = &s.outage {
        for r in o.rules(t0) {
            w.net.add_rule(r);
        }
        w.allow_failure = true;
    }
    for (i, op) in s.ops.iter().enumerate() {
        if let Some((side, at)) = s.close {
            if at == i && w.closed_by.is_none() {
                close(&mut w, side);
            }
        }
        w.post_all(std::slice::from_ref(op), Duration::from_secs(5))?;
    }
    if let Some((side, _)) = s.close {
        if w.closed_by.is_none() {
            close(&mut w, side);
        }
    }
    let limit = w.net.elapsed()
        + if w.allow_failure {
            Duration::from_secs(120)
        } else {
            Duration::from_secs(30)
        };
    w.finish(limit, Duration::from_secs(5))?;
    if let Err(e) = w.check_all() {
        if std::env::var_os("HARNESS_DUMP").is_some() {
            dump(&w);
        }
        return Err(e);
    }
    Ok(w)
}

/// Close the workload's connection from `side` now.
pub fn close(w: &mut Workload, side: usize) {
    let now = w.net.now;
    w.net.eps[side].close(now, w.conns[side]);
    w.net.flush();
    w.closed_by = Some(side);
    // The peer may never hear of it (best effort): its pending operations then fail
    // with RetryExceeded.
    w.allow_failure = true;
}

/// Debug aid: print the events of a workload.
pub fn dump(w: &Workload) {
    for i in 0..2 {
        for (e, t) in w.net.events[i].iter().zip(&w.net.event_times[i]) {
            eprintln!("  [{i}] {:>10.3?} {e:?}", *t - w.net.start);
        }
    }
}

/// Re-emit a captured packet with its BTH and headers edited, ICRC re-stamped for the
/// addresses of the harness (as if `from` sent it to `to`).
pub fn forge(
    c: &Captured,
    to: SocketAddr,
    edit: impl FnOnce(&mut metaroce::wire::Bth, &mut metaroce::wire::Headers),
) -> Vec<u8> {
    let p = Packet::parse(&c.data).expect("captured packet parses");
    let (mut bth, mut hdrs) = (p.bth, p.headers);
    edit(&mut bth, &mut hdrs);
    let mut out = vec![0u8; metaroce::wire::packet_len(&hdrs, p.payload.len())];
    metaroce::wire::emit_packet(&bth, &hdrs, p.payload, &mut out).unwrap();
    let ip = metaroce::wire::icrc::IpHeader::synthesized(c.from.ip(), to.ip()).unwrap();
    metaroce::wire::icrc::stamp(&ip, c.from.port(), to.port(), &mut out).unwrap();
    out
}
