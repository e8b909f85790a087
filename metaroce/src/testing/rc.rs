//! The in-memory RC test network: two [`RcEndpoint`]s back to back with virtual time; every
//! packet is captured in [`Net::wire`], checked (ICRC over the exact IP header), and may be
//! dropped, changed or CE-marked by the test. The RoCEv2 conformance suite
//! (`tests/rc_conformance.rs`, docs/CONFORMANCE.md) runs on it.

pub use super::pattern;
use super::Impair;
use crate::rocev2::{
    Completion, ConnectAttrs, QpInit, RcConfig, RcEndpoint, RcEvent, SendOp, SendWr,
};
use crate::wire::{icrc, Headers, Packet};
use crate::Access;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

pub const A_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
pub const B_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2));

/// The IPv4 packet `orig` (as [`Net`] captures it: IPv4 header, UDP header, RoCEv2) rebuilt
/// around the UDP payload `udp`, with the same IP fields and ports and a fresh ICRC over
/// them: what a peer or an on-path attacker that changed the packet sends. `None` if `orig`
/// is shorter than its headers or `udp` too short to carry a BTH and an ICRC.
pub fn restamp(orig: &[u8], mut udp: Vec<u8>) -> Option<Vec<u8>> {
    let h = orig.get(..28)?;
    let ip = icrc::IpHeader::V4 {
        src: [h[12], h[13], h[14], h[15]].into(),
        dst: [h[16], h[17], h[18], h[19]].into(),
        id: u16::from_be_bytes([h[4], h[5]]),
        flags_frag: u16::from_be_bytes([h[6], h[7]]),
        ttl: h[8],
        tos: h[1],
    };
    let sport = u16::from_be_bytes([h[20], h[21]]);
    let dport = u16::from_be_bytes([h[22], h[23]]);
    icrc::stamp(&ip, sport, dport, &mut udp).ok()?;
    let t = crate::rocev2::RcTransmit {
        destination: std::net::SocketAddr::new(IpAddr::from([h[16], h[17], h[18], h[19]]), dport),
        src_port: sport,
        ip,
        ecn: None,
        size: udp.len(),
    };
    let mut out = Vec::new();
    t.write_ip_packet(&udp, &mut out).ok()?;
    Some(out)
}

/// A packet seen on the wire.
#[derive(Debug, Clone)]
pub struct Seen {
    pub from_a: bool,
    pub opcode: u8,
    pub psn: u32,
    pub syndrome: Option<u8>,
    pub ip_packet: Vec<u8>,
}

#[derive(Debug)]
pub struct Net {
    pub a: RcEndpoint,
    pub b: RcEndpoint,
    pub qa: u32,
    pub qb: u32,
    pub now: Instant,
    pub wire: Vec<Seen>,
    pub ev_a: Vec<RcEvent>,
    pub ev_b: Vec<RcEvent>,
}

/// The link of [`Net::run_link`], the same in both directions.
#[derive(Debug, Clone, Copy, Default)]
pub struct Link {
    /// Serialization rate of IP packet bytes; `None`: unlimited.
    pub bits_per_sec: Option<u64>,
    /// Propagation delay.
    pub one_way: Duration,
    /// Random loss, duplication and reordering.
    pub impair: Impair,
    /// Seed of the impairments' random draws.
    pub seed: u64,
}

pub fn seen(from_a: bool, ip_packet: Vec<u8>) -> Seen {
    let p = Packet::parse(&ip_packet[28..]).expect("own packets parse");
    let syndrome = match p.headers {
        Headers::Rc { aeth, .. } => aeth.map(|a| a.syndrome),
        _ => None,
    };
    // Every packet's ICRC verifies over the exact IP header sent.
    icrc::verify_raw(&ip_packet[..20], &ip_packet[20..28], &ip_packet[28..]).expect("icrc");
    Seen {
        from_a,
        opcode: p.bth.opcode.0,
        psn: p.bth.psn,
        syndrome,
        ip_packet,
    }
}

pub fn attrs(remote_ip: IpAddr, qpn: u32, psn: u32) -> ConnectAttrs {
    let mut a = ConnectAttrs::new(remote_ip, qpn, psn);
    a.timeout = 10; // ~4 ms
    a.retry_cnt = 3;
    a.max_rd_atomic = 4;
    a.max_dest_rd_atomic = 4;
    a
}

impl Net {
    pub fn new(mtu: u32, psn_a: Option<u32>, psn_b: Option<u32>) -> Net {
        Self::with(mtu, psn_a, psn_b, |_| {})
    }

    pub fn with(
        mtu: u32,
        psn_a: Option<u32>,
        psn_b: Option<u32>,
        tweak: impl Fn(&mut ConnectAttrs),
    ) -> Net {
        Self::with_cfg(mtu, psn_a, psn_b, tweak, |_| {})
    }

    /// Like [`Net::with`], with both endpoints' `RcConfig` tweaked too.
    pub fn with_cfg(
        mtu: u32,
        psn_a: Option<u32>,
        psn_b: Option<u32>,
        tweak: impl Fn(&mut ConnectAttrs),
        tweak_cfg: impl Fn(&mut RcConfig),
    ) -> Net {
        let mut ca = RcConfig::new(A_IP);
        ca.seed = 1;
        tweak_cfg(&mut ca);
        let mut cb = RcConfig::new(B_IP);
        cb.seed = 2;
        tweak_cfg(&mut cb);
        let mut a = RcEndpoint::new(ca).unwrap();
        let mut b = RcEndpoint::new(cb).unwrap();
        let acc = Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
        let ia = a
            .create_qp(QpInit {
                initial_psn: psn_a,
                access: acc,
                ..Default::default()
            })
            .unwrap();
        let ib = b
            .create_qp(QpInit {
                initial_psn: psn_b,
                access: acc,
                ..Default::default()
            })
            .unwrap();
        let mut at_a = attrs(B_IP, ib.qpn, ib.psn);
        at_a.path_mtu = mtu;
        tweak(&mut at_a);
        let mut at_b = attrs(A_IP, ia.qpn, ia.psn);
        at_b.path_mtu = mtu;
        tweak(&mut at_b);
        a.connect_qp(ia.qpn, at_a).unwrap();
        b.connect_qp(ib.qpn, at_b).unwrap();
        Net {
            a,
            b,
            qa: ia.qpn,
            qb: ib.qpn,
            now: Instant::now(),
            wire: Vec::new(),
            ev_a: Vec::new(),
            ev_b: Vec::new(),
        }
    }

    /// Move packets and fire timers until `done` holds or nothing is left to do (or the
    /// virtual clock passed `limit`). `drop` decides, per packet, whether the link loses it.
    pub fn run(
        &mut self,
        limit: Duration,
        drop: &mut dyn FnMut(&mut Seen) -> bool,
        done: &dyn Fn(&Net) -> bool,
    ) {
        let end = self.now + limit;
        let mut buf = Vec::new();
        for _ in 0..1_000_000 {
            let mut moved = false;
            for from_a in [true, false] {
                loop {
                    let (src, _) = if from_a {
                        (&mut self.a, &mut self.b)
                    } else {
                        (&mut self.b, &mut self.a)
                    };
                    let Some(t) = src.poll_transmit(self.now, &mut buf) else {
                        break;
                    };
                    assert_eq!(t.destination.port(), 4791);
                    let mut pkt = Vec::new();
                    t.write_ip_packet(&buf[..t.size], &mut pkt).unwrap();
                    let mut s = seen(from_a, pkt);
                    let lost = drop(&mut s);
                    let bytes = s.ip_packet.clone();
                    self.wire.push(s);
                    moved = true;
                    if !lost {
                        let dst = if from_a { &mut self.b } else { &mut self.a };
                        dst.handle_ip_packet(self.now, &bytes);
                    }
                }
            }
            self.collect_events();
            if done(self) {
                return;
            }
            if !moved && !self.advance([], end) {
                return;
            }
        }
        panic!("no quiescence");
    }

    /// Like `run`, over a [`Link`]: each direction serializes its packets at
    /// `link.bits_per_sec` (IP packet bytes; `None`: no limit) and delivers them
    /// `link.one_way` later, applying `link.impair`'s independent loss, duplication and
    /// reordering (a reordered copy arrives 1..=`reorder_slots` (0: 5) extra one-way delays
    /// late; the other fields of [`Impair`] are ignored), drawn from `link.seed`. With a
    /// rate, an endpoint is asked for its next packet only when its link is idle (a NIC
    /// sending at line rate), so queued responses stay at the responder. `drop` decides,
    /// per packet, whether the link loses it too. Every packet sent is recorded in `wire`,
    /// once. Virtual time advances to the next delivery, idle link or timer.
    pub fn run_link(
        &mut self,
        link: Link,
        limit: Duration,
        drop: &mut dyn FnMut(&Seen) -> bool,
        done: &dyn Fn(&Net) -> bool,
    ) {
        use rand_core::{RngCore, SeedableRng};
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        fn pick(rng: &mut impl RngCore, p: f64) -> bool {
            p > 0.0 && (rng.next_u64() as f64 / u64::MAX as f64) < p
        }
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(link.seed);
        let imp = link.impair;
        let slots = u64::from(if imp.reorder_slots == 0 {
            5
        } else {
            imp.reorder_slots
        });
        let end = self.now + limit;
        let mut buf = Vec::new();
        // Per direction (index 0: A to B, 1: B to A): when the link is next free.
        let mut free = [self.now; 2];
        // (arrival, order sent, to B, packet): a min-heap on arrival, FIFO among ties.
        type InFlight = Reverse<(Instant, u64, bool, Vec<u8>)>;
        let mut flight: BinaryHeap<InFlight> = BinaryHeap::new();
        let mut order = 0u64;
        for _ in 0..10_000_000 {
            let mut moved = false;
            for (d, from_a) in [(0usize, true), (1, false)] {
                while free[d] <= self.now {
                    let src = if from_a { &mut self.a } else { &mut self.b };
                    let Some(t) = src.poll_transmit(self.now, &mut buf) else {
                        break;
                    };
                    let mut pkt = Vec::new();
                    t.write_ip_packet(&buf[..t.size], &mut pkt).unwrap();
                    let sent = match link.bits_per_sec {
                        Some(bps) => {
                            let ns = pkt.len() as u64 * 8 * 1_000_000_000 / bps;
                            free[d] = free[d].max(self.now) + Duration::from_nanos(ns);
                            free[d]
                        }
                        None => self.now,
                    };
                    let s = seen(from_a, pkt);
                    moved = true;
                    if !drop(&s) && !pick(&mut rng, imp.loss) {
                        let copies = if pick(&mut rng, imp.dup) { 2 } else { 1 };
                        for _ in 0..copies {
                            let mut at = sent + link.one_way;
                            if pick(&mut rng, imp.reorder) {
                                at += link.one_way * (1 + rng.next_u64() % slots) as u32;
                            }
                            order += 1;
                            flight.push(Reverse((at, order, from_a, s.ip_packet.clone())));
                        }
                    }
                    self.wire.push(s);
                }
            }
            while flight.peek().is_some_and(|Reverse(f)| f.0 <= self.now) {
                let Reverse((_, _, to_b, pkt)) = flight.pop().unwrap();
                let dst = if to_b { &mut self.b } else { &mut self.a };
                dst.handle_ip_packet(self.now, &pkt);
                moved = true;
            }
            self.collect_events();
            if done(self) {
                return;
            }
            if !moved {
                let links = [
                    flight.peek().map(|Reverse(f)| f.0),
                    (free[0] > self.now).then_some(free[0]),
                    (free[1] > self.now).then_some(free[1]),
                ];
                if !self.advance(links, end) {
                    return;
                }
            }
        }
        panic!("no quiescence");
    }

    /// Move both sides' events into `ev_a` / `ev_b`.
    fn collect_events(&mut self) {
        while let Some(e) = self.a.poll_event() {
            self.ev_a.push(e);
        }
        while let Some(e) = self.b.poll_event() {
            self.ev_b.push(e);
        }
    }

    /// Set the clock to the earliest of both sides' timers and the instants in `also`
    /// and fire the timers; `false` (nothing changed) when none is due by `end`.
    fn advance<const N: usize>(&mut self, also: [Option<Instant>; N], end: Instant) -> bool {
        let next = [self.a.poll_timeout(), self.b.poll_timeout()]
            .into_iter()
            .chain(also)
            .flatten()
            .min();
        match next {
            Some(t) if t <= end => {
                self.now = self.now.max(t);
                self.a.handle_timeout(self.now);
                self.b.handle_timeout(self.now);
                true
            }
            _ => false,
        }
    }

    pub fn run_all(&mut self) {
        self.run(Duration::from_secs(60), &mut |_| false, &|_| false);
    }

    pub fn completions_a(&self) -> Vec<Completion> {
        comps(&self.ev_a)
    }
    pub fn completions_b(&self) -> Vec<Completion> {
        comps(&self.ev_b)
    }
}

pub fn comps(ev: &[RcEvent]) -> Vec<Completion> {
    ev.iter()
        .filter_map(|e| match e {
            RcEvent::Completion(c) => Some(*c),
            _ => None,
        })
        .collect()
}

pub fn send(wr_id: u64, lkey: u32, off: u64, len: u32, imm: Option<u32>) -> SendWr {
    SendWr {
        wr_id,
        op: SendOp::Send { imm },
        lkey,
        local_offset: off,
        len,
        solicited: false,
    }
}
