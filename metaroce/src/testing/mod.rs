//! One in-memory test network for the sans-IO core (feature `testing`).
//!
//! [`Net`] is two [`Endpoint`]s (index 0 = A, 1 = B) on a virtual clock, joined by a seeded,
//! impaired in-memory network, in the spirit of quinn-proto's test `Pair`. Time advances only
//! when the network asks for it: [`Net::step`] jumps to the next packet arrival or timer, so
//! a run is deterministic for a seed and costs no wall-clock time.
//!
//! Impairments come in two forms:
//! * [`Impair`]: independent random loss, duplication, reordering, CE marking and
//!   corruption (bit flips or truncation, ICRC not fixed) applied to every datagram, plus
//!   blackholes of everything or of one path; [`ImpairPhase`]s ([`Net::phases`]) change
//!   them over virtual time.
//! * [`Rule`]s ([`Net::add_rule`]): a virtual-time window `[from, until)`, a [`Filter`]
//!   (direction, packet kind from BTH byte 0, path from the UDP source port, or any
//!   predicate over the parsed packet [`PktInfo`]) and an [`Action`] (loss, burst loss,
//!   blackhole, duplication, extra delay, jitter, late copies, holding, capture, CE marking,
//!   corruption).
//!
//! Adversary tests capture packets ([`Action::Capture`], [`Net::captured`]), look at
//! everything sent ([`Net::wire`], [`Net::last_sent`]), and put packets of their own making on the wire
//! ([`Net::inject`], [`Net::inject_raw`]). An endpoint can be restarted ([`Net::restart`])
//! while packets of its old incarnation are still in flight.
//!
//! [`rc`] is the same idea for RoCEv2 RC queue pairs ([`crate::rocev2::RcEndpoint`]), whose
//! packets are whole IP packets with an ICRC.
//!
//! Nothing here is meant for production: the module panics on misuse (an endpoint that does
//! not build, a livelock of more than [`MAX_STEPS`] steps).
//!
//! # Example: a user's own scenario
//!
//! A SEND over a network that loses 5 % of the data packets A sends, checked for
//! exactly-once delivery:
//!
//! ```
//! use metaroce::testing::{pattern, Action, Filter, Kind, Net, Rule};
//! use std::time::Duration;
//!
//! let mut net = Net::new(7);
//! net.add_rule(Rule::always(Filter::any().from(0).kind(Kind::Data), Action::Drop(0.05)));
//! let (a, b) = net.connect();
//! let msg = pattern(1, 200_000);
//! net.eps[0].post_send(a, 0, 1, msg.clone().into()).unwrap();
//! assert!(net.run_until(Duration::from_secs(5), |n| !n.messages(1, b).is_empty()));
//! assert_eq!(&net.messages(1, b)[&0][0][..], &msg[..]);
//! ```
#![allow(missing_docs)]

pub mod rc;

use crate::wire::{AtomicEth, NakEth, Packet, Reth, SendEth, WriteEth};
use crate::{
    ConnectionError, ConnectionHandle, EcnCodepoint, Endpoint, EndpointConfig, Event, Transmit,
};
use bytes::Bytes;
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::rc::Rc;
use std::sync::{Arc, Mutex, Weak};
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
    /// Data the delivery layer acknowledges: 0xC2 / 0xC3 / 0xC4 MR_SEND, MR_WRITE,
    /// MR_WRITE_WITH_IMMEDIATE; 0xC7 / 0xC8 MR_READ_REQUEST, MR_READ_RESPONSE; 0xC9 / 0xCA /
    /// 0xCB MR_COMPARE_SWAP, MR_FETCH_ADD, MR_ATOMIC_RESPONSE.
    Data,
    /// 0xC5 MR_NAK.
    Nak,
    /// 0xC6 MR_CLOSE.
    Close,
    /// A standard RC opcode (0x00..=0x1F, IBA 9.2: RoCEv2 RC queue pairs on the endpoint).
    Rc,
    /// Anything else.
    Other,
}

impl Kind {
    pub fn of(byte0: u8) -> Kind {
        match byte0 {
            0xC0 => Kind::Connect,
            0xC1 => Kind::Ack,
            0xC2..=0xC4 | 0xC7..=0xCB => Kind::Data,
            0xC5 => Kind::Nak,
            0xC6 => Kind::Close,
            0x00..=0x1F => Kind::Rc,
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
    /// READ request: RETH and the operation id.
    pub read_req: Option<(Reth, WriteEth)>,
    /// READ response: the READ's operation id and the packet's offset.
    pub read_resp: Option<WriteEth>,
    /// Atomic request (compare-and-swap or fetch-and-add, see `opcode`).
    pub atomic: Option<(AtomicEth, WriteEth)>,
    /// Atomic response: the atomic's operation id and the original value.
    pub atomic_resp: Option<(WriteEth, u64)>,
    /// NAK: syndrome and operation id (stream id for SENDs).
    pub nak: Option<NakEth>,
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
            read_req: None,
            read_resp: None,
            atomic: None,
            atomic_resp: None,
            nak: None,
            payload_len: 0,
            len: data.len(),
        };
        if let Ok(p) = Packet::parse(data) {
            info.dest_qp = p.bth.dest_qp;
            info.psn = p.bth.psn;
            info.ack_req = p.bth.ack_req;
            info.payload_len = p.payload.len();
            match p.headers {
                crate::wire::Headers::Send { path, send } => {
                    info.retransmit = path.flags & 1 != 0;
                    info.path_id = Some(path.path_id);
                    info.send = Some(send);
                }
                crate::wire::Headers::Ack(a) => info.path_id = Some(a.path_id),
                crate::wire::Headers::Nak { path, nak } => {
                    info.path_id = Some(path.path_id);
                    info.nak = Some(nak);
                }
                crate::wire::Headers::Write {
                    path,
                    reth,
                    write,
                    imm,
                } => {
                    info.retransmit = path.flags & 1 != 0;
                    info.path_id = Some(path.path_id);
                    info.write = Some((reth, write, imm));
                }
                crate::wire::Headers::ReadRequest { path, reth, op } => {
                    info.retransmit = path.flags & 1 != 0;
                    info.path_id = Some(path.path_id);
                    info.read_req = Some((reth, op));
                }
                crate::wire::Headers::ReadResponse { path, op } => {
                    info.retransmit = path.flags & 1 != 0;
                    info.path_id = Some(path.path_id);
                    info.read_resp = Some(op);
                }
                crate::wire::Headers::Atomic { path, atomic, op } => {
                    info.retransmit = path.flags & 1 != 0;
                    info.path_id = Some(path.path_id);
                    info.atomic = Some((atomic, op));
                }
                crate::wire::Headers::AtomicResponse { path, op, ack } => {
                    info.retransmit = path.flags & 1 != 0;
                    info.path_id = Some(path.path_id);
                    info.atomic_resp = Some((op, ack.orig));
                }
                _ => {}
            }
        }
        info
    }

    /// Whether this is the last segment of its message / WRITE / READ response (the sender
    /// asks for an ACK on last segments only).
    pub fn is_last_segment(&self) -> bool {
        if self.read_resp.is_some() {
            return self.ack_req;
        }
        if let Some(s) = &self.send {
            return s.offset as u64 + self.payload_len as u64 >= s.msg_len as u64;
        }
        if let Some((r, w, _)) = &self.write {
            return w.offset as u64 + self.payload_len as u64 >= r.dma_len as u64;
        }
        false
    }
}

/// The two-endpoint network under its quinn-style name.
pub type Pair = Net;

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
    /// With this probability flip one random bit of the datagram (corruption; the
    /// receiver's ICRC check should catch it).
    Corrupt(f64),
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

/// Independent random impairments applied to every datagram before the [`Rule`]s (the
/// simple form; see [`Net::impaired`]). Probabilities are per datagram (per GSO segment).
#[derive(Debug, Clone, Copy, Default)]
pub struct Impair {
    /// Probability a datagram is dropped.
    pub loss: f64,
    /// Probability a datagram is delivered twice.
    pub dup: f64,
    /// Probability a datagram is delayed by an extra 1..=5 one-way delays (reordering).
    pub reorder: f64,
    /// Probability a datagram (an ECN-capable one) is re-marked CE.
    pub ce: f64,
    /// Drop everything (blackhole).
    pub blackhole: bool,
    /// Drop everything sent from this UDP source port (one path blackholed).
    pub blackhole_port: Option<u16>,
    /// A reordered datagram is delayed by 1..=`reorder_slots` extra one-way delays; 0
    /// means 5.
    pub reorder_slots: u32,
    /// Probability a datagram (each copy) is corrupted and its ICRC left as it was: with
    /// probability 1/5 truncated to a random multiple of 4 bytes shorter than a quarter of
    /// its length, otherwise 1 to 3 random bytes XORed with a random non-zero value. The
    /// receiver must count and drop it.
    pub corrupt: f64,
}

/// A phase of simple impairments: `impair` applies to datagrams sent in the virtual-time
/// window `[from, until)` since the start of the run, instead of [`Net::impair`]. See
/// [`Net::phases`].
#[derive(Debug, Clone, Copy)]
pub struct ImpairPhase {
    pub from: Duration,
    pub until: Duration,
    pub impair: Impair,
}

/// A datagram as sent, recorded by [`Net::record`] in [`Net::wire`].
#[derive(Debug, Clone)]
pub struct Sent {
    /// Virtual time it was sent.
    pub at: Instant,
    /// Sending endpoint.
    pub from_ep: usize,
    /// Source address (IP of the sender, UDP source port of the path).
    pub from: SocketAddr,
    /// Receiving endpoint.
    pub to: usize,
    /// Which `poll_transmit` result of the sender carried it (counted over the whole
    /// net): the datagrams of one GSO batch share it.
    pub batch: u64,
    pub data: Vec<u8>,
}

/// A hook over every datagram about to be delivered: `(net, to, from, datagram)`. It runs
/// before the datagram reaches endpoint `to` and may deliver datagrams of its own with
/// [`Net::deliver`]. See [`Net::deliver_hook`].
pub type DeliverHook = Box<dyn FnMut(&mut Net, usize, SocketAddr, &[u8])>;

/// A hook that chooses the ECN codepoint a datagram is delivered with: `(datagram, codepoint
/// it was sent with) -> codepoint delivered`. See [`Net::ecn_hook`].
pub type EcnHook = Box<dyn FnMut(&[u8], Option<EcnCodepoint>) -> Option<EcnCodepoint>>;

type Filt<'a> = &'a mut dyn FnMut(usize, &[u8]) -> bool;

/// A hook over every datagram an endpoint sends: `(sender, datagram)`; returning `true`
/// drops it. See [`Net::drop_hook`].
pub type DropHook = Box<dyn FnMut(usize, &[u8]) -> bool>;

// =======================================================================================
// The network

/// Endpoint configuration for [`Net::impaired`]: endpoint `i` at `10.0.0.{i+1}:4791`, 16
/// paths (UDP source ports `0xC000 + 16 i ..`), PMTU 1024, GSO batches of 4; keepalive and
/// idle timeout stay at their defaults.
pub fn pair_config(i: usize, seed: u64) -> EndpointConfig {
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

/// Endpoint configuration for [`Net::new`]: 8 paths, PMTU 1024, GSO batches of 4, and no
/// keepalive or idle timeout.
pub fn config(i: usize, seed: u64) -> EndpointConfig {
    let ip = format!("10.0.0.{}", i + 1);
    let mut c = EndpointConfig::new(
        format!("{ip}:4791").parse().unwrap(),
        (0..8).map(|k| 0xC000 + k + 16 * i as u16).collect(),
    );
    c.seed = seed.wrapping_mul(31).wrapping_add(i as u64);
    c.transport.max_gso_segments = 4;
    c.transport.pmtu = 1024;
    // The properties check that the network goes quiet once the work is done; keepalives
    // (on by default since issue #10) never let an open connection go quiet, and the idle
    // timeout would end connections during long outages that the properties expect to
    // end in RetryExceeded. Liveness has its own tests (tests/liveness.rs).
    c.transport.keepalive_interval = None;
    c.transport.idle_timeout = None;
    c
}

/// Most steps a run may take before the harness declares a livelock.
pub const MAX_STEPS: u64 = 5_000_000;

/// Two endpoints, a virtual clock, an impaired in-memory network.
pub struct Net {
    pub eps: Vec<Endpoint>,
    pub configs: Vec<EndpointConfig>,
    pub addrs: Vec<SocketAddr>,
    pub now: Instant,
    pub start: Instant,
    /// One-way delay of every packet.
    pub delay: Duration,
    rules: Vec<RuleState>,
    rng: Xoshiro256PlusPlus,
    queue: BinaryHeap<InFlight>,
    seq: u64,
    /// Events of the current incarnation of each endpoint, in order.
    pub events: Vec<Vec<Event>>,
    /// Virtual time of each event in `events`.
    pub event_times: Vec<Vec<Instant>>,
    /// Events of earlier incarnations (one vector per restart).
    pub old_events: Vec<Vec<Vec<Event>>>,
    pub captured: Vec<Captured>,
    /// Datagrams handed to an endpoint.
    pub delivered: u64,
    /// Datagrams handed to each endpoint (by index).
    pub delivered_to: Vec<u64>,
    /// Datagrams dropped by rules (captures included).
    pub dropped: u64,
    /// Datagrams sent, by sender and kind.
    pub sent: Vec<HashMap<Kind, u64>>,
    pub steps: u64,
    /// Memory to copy the moment a completion (or receive completion) with this wr_id is
    /// polled from endpoint `i`: key `(i, wr_id)`, value `(lkey, offset, len)`. Events are
    /// polled after every datagram and timer, so the copy shows memory as the application
    /// sees it when the completion is reported.
    pub snap_on: HashMap<(usize, u64), (u32, u64, u64)>,
    /// The copies, by `(i, wr_id)`, with the virtual time since the start.
    pub snaps: HashMap<(usize, u64), (Duration, Vec<u8>)>,
    /// Memory to copy the moment an `Event::WriteWithImm` is polled from endpoint `i`:
    /// `(i, lkey, offset, len)`; the copies go to `imm_snaps` as `(imm, memory)`.
    pub snap_on_imm: Option<(usize, u32, u64, u64)>,
    pub imm_snaps: Vec<(u32, Vec<u8>)>,
    /// The counters of every connection of endpoint `i` as of the last datagram or timer:
    /// they stay readable after the connection ended.
    pub last_stats: Vec<HashMap<ConnectionHandle, crate::ConnectionStats>>,
    /// The simple impairments; they apply (instead of the rules) when the net was made with
    /// [`Net::impaired`].
    pub impair: Impair,
    /// Phases of simple impairments (nets made with [`Net::impaired`] and friends): the first
    /// phase whose window holds the send time applies instead of [`Net::impair`].
    pub phases: Vec<ImpairPhase>,
    impaired: bool,
    /// Check every datagram an endpoint emits (each GSO segment): it parses as a packet and,
    /// when the two addresses are of one family, its ICRC verifies; panics otherwise.
    /// Default off.
    pub check_emitted: bool,
    /// Check the timer contract after every `handle_timeout`: `poll_timeout` is then `None`
    /// or later than now; panics otherwise. Default off.
    pub check_timers: bool,
    /// Record at most this many sent datagrams in [`Net::wire`] (default 0: none).
    pub record: usize,
    /// Ask the endpoints with [`Endpoint::poll_transmit_lent`] (gather send) and assemble
    /// each datagram from the buffer and the [`LendingRegion`] it names, as an I/O layer
    /// with an I/O vector send does; a transmit whose region is gone is dropped. Default
    /// off (`poll_transmit`).
    pub gather: bool,
    /// Payload bytes sent from lent regions while [`Net::gather`] was set.
    pub lent_bytes: u64,
    /// The recorded datagrams, in sending order.
    pub wire: Vec<Sent>,
    /// Transmits (`poll_transmit` results, a GSO batch counting once) the endpoints sent.
    pub batches: u64,
    /// Called on every datagram sent, before any impairment; `true` drops it.
    pub drop_hook: Option<DropHook>,
    /// Keep the datagrams [`Net::drop_hook`] dropped in [`Net::held`] (default off).
    pub keep_held: bool,
    /// The datagrams the drop hook dropped while `keep_held` was set, in sending order
    /// (deliver them later with [`Net::deliver`] or [`Net::inject_raw`]).
    pub held: Vec<Sent>,
    /// Called on every datagram about to be delivered.
    pub deliver_hook: Option<DeliverHook>,
    /// Rewrites the ECN codepoint of every datagram delivered from the queue (a marking or
    /// bleaching switch); `None`: delivered as sent (after the CE rules).
    pub ecn_hook: Option<EcnHook>,
    /// Link rate of each direction in bit/s (datagram bytes plus 66 bytes of Ethernet, IP
    /// and UDP framing): a datagram leaves when the sender's link is free and takes its
    /// serialization time, then the one-way `delay`. `None` (the default): no rate limit,
    /// every datagram leaves at once.
    pub rate_bps: Option<u64>,
    link_free: Vec<Instant>,
    /// Whether to log every delivered datagram in [`Net::delivered_log`].
    pub log_delivered: bool,
    /// Every datagram delivered while [`Net::log_delivered`] was set: `(to, from, bytes)`.
    pub delivered_log: Vec<(usize, SocketAddr, Vec<u8>)>,
}

impl fmt::Debug for Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Net")
            .field("addrs", &self.addrs)
            .field("elapsed", &self.elapsed())
            .field("in_flight", &self.queue.len())
            .field("delivered", &self.delivered)
            .field("dropped", &self.dropped)
            .finish_non_exhaustive()
    }
}

impl Net {
    pub fn new(seed: u64) -> Net {
        Self::with_configs(seed, config(0, seed), config(1, seed))
    }

    /// Two endpoints with the given configurations.
    pub fn with_configs(seed: u64, a: EndpointConfig, b: EndpointConfig) -> Net {
        Self::with_all_configs(seed, vec![a, b])
    }

    /// One endpoint per configuration (index = position), all on the one network; a
    /// datagram goes to the endpoint whose `local_addr` is its destination.
    ///
    /// # Panics
    /// If an endpoint cannot be built from its configuration.
    pub fn with_all_configs(seed: u64, cfgs: Vec<EndpointConfig>) -> Net {
        let now = Instant::now();
        let n = cfgs.len();
        let addrs = cfgs.iter().map(|c| c.local_addr).collect();
        Net {
            eps: cfgs
                .iter()
                .map(|c| Endpoint::new(c.clone()).unwrap())
                .collect(),
            configs: cfgs,
            addrs,
            now,
            start: now,
            delay: Duration::from_micros(10),
            rules: Vec::new(),
            rng: Xoshiro256PlusPlus::seed_from_u64(seed ^ 0x5EED_0F7E_5700),
            queue: BinaryHeap::new(),
            seq: 0,
            events: vec![Vec::new(); n],
            event_times: vec![Vec::new(); n],
            old_events: vec![Vec::new(); n],
            captured: Vec::new(),
            delivered: 0,
            delivered_to: vec![0; n],
            dropped: 0,
            sent: vec![HashMap::new(); n],
            steps: 0,
            snap_on: HashMap::new(),
            snaps: HashMap::new(),
            snap_on_imm: None,
            imm_snaps: Vec::new(),
            last_stats: vec![HashMap::new(); n],
            impair: Impair::default(),
            phases: Vec::new(),
            impaired: false,
            check_emitted: false,
            check_timers: false,
            record: 0,
            gather: false,
            lent_bytes: 0,
            wire: Vec::new(),
            batches: 0,
            drop_hook: None,
            deliver_hook: None,
            ecn_hook: None,
            keep_held: false,
            held: Vec::new(),
            rate_bps: None,
            link_free: vec![now; n],
            log_delivered: false,
            delivered_log: Vec::new(),
        }
    }

    /// Two endpoints with [`pair_config`] (16 paths, keepalive and idle timeout as the
    /// defaults have them) over a network with the simple impairments `impair`.
    pub fn impaired(seed: u64, impair: Impair) -> Net {
        Self::impaired_with_configs(seed, impair, pair_config(0, seed), pair_config(1, seed))
    }

    /// One endpoint per configuration on a network with the simple impairments `impair`.
    pub fn impaired_all(seed: u64, impair: Impair, cfgs: Vec<EndpointConfig>) -> Net {
        let mut n = Self::with_all_configs(seed, cfgs);
        n.rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        n.impair = impair;
        n.impaired = true;
        n
    }

    /// [`Net::impaired`] with the given configurations.
    pub fn impaired_with_configs(
        seed: u64,
        impair: Impair,
        a: EndpointConfig,
        b: EndpointConfig,
    ) -> Net {
        let mut n = Self::with_configs(seed, a, b);
        n.rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        n.impair = impair;
        n.impaired = true;
        n
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

    fn enqueue(&mut self, from_idx: usize, t: &Transmit, data: &[u8], filter: Filt<'_>) {
        let Some(to) = self.addrs.iter().position(|a| *a == t.destination) else {
            return;
        };
        let from = SocketAddr::new(self.addrs[from_idx].ip(), t.src_port);
        let path = self.path_of(from_idx, t.src_port);
        let seg = t.segment_size.unwrap_or(t.size).max(1);
        self.batches += 1;
        let rel = self.elapsed();
        for chunk in data[..t.size].chunks(seg) {
            if self.check_emitted {
                self.check_segment(from_idx, t, chunk);
            }
            let info = PktInfo::parse(from_idx, t.src_port, path, chunk);
            *self.sent[from_idx].entry(info.kind).or_default() += 1;
            if self.wire.len() < self.record {
                self.wire.push(Sent {
                    at: self.now,
                    from_ep: from_idx,
                    from,
                    to,
                    batch: self.batches,
                    data: chunk.to_vec(),
                });
            }
            if self.drop_hook.as_mut().is_some_and(|h| h(from_idx, chunk)) {
                self.dropped += 1;
                if self.keep_held {
                    self.held.push(Sent {
                        at: self.now,
                        from_ep: from_idx,
                        from,
                        to,
                        batch: self.batches,
                        data: chunk.to_vec(),
                    });
                }
                continue;
            }
            if filter(from_idx, chunk) {
                self.dropped += 1;
                continue;
            }
            let depart = self.departure(from_idx, chunk.len());
            if self.impaired {
                self.enqueue_impaired(depart, to, from, t, chunk);
                continue;
            }
            let mut drop = false;
            let mut capture = None;
            let mut extra_copies = 0u32;
            let mut extra = Duration::ZERO;
            let mut late: Vec<Duration> = Vec::new();
            let mut hold: Option<Duration> = None;
            let mut ce = false;
            let mut corrupt: Vec<usize> = Vec::new();
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
                    Action::Corrupt(p) => {
                        let d = !chunk.is_empty() && self.chance(p);
                        if d {
                            let bit = self.rng.next_u64() % (chunk.len() as u64 * 8);
                            corrupt.push(bit as usize);
                        }
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
            let mut chunk = chunk.to_vec();
            for bit in corrupt {
                chunk[bit / 8] ^= 1 << (bit % 8);
            }
            let chunk = &chunk[..];
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
            let base = depart + self.delay + extra;
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

    /// The simple impairments ([`Impair`]), drawn in a fixed order per datagram: loss, then
    /// duplication, then per copy reordering and CE marking.
    /// When a datagram of `len` bytes sent now by endpoint `i` has left its link.
    fn departure(&mut self, i: usize, len: usize) -> Instant {
        let Some(rate) = self.rate_bps.filter(|&r| r > 0) else {
            return self.now;
        };
        let bits = (len as u64 + 66) * 8;
        let ser = Duration::from_nanos(bits.saturating_mul(1_000_000_000) / rate);
        let at = self.link_free[i].max(self.now) + ser;
        self.link_free[i] = at;
        at
    }

    /// Panic unless `chunk`, one datagram endpoint `i` emitted in `t`, parses and carries a
    /// valid ICRC (see [`Net::check_emitted`]).
    fn check_segment(&self, i: usize, t: &Transmit, chunk: &[u8]) {
        check_emitted(chunk, self.addrs[i].ip(), t.destination, t.src_port);
    }

    /// The simple impairments in effect for a datagram sent now.
    fn impair_now(&self) -> Impair {
        let rel = self.elapsed();
        self.phases
            .iter()
            .find(|p| p.from <= rel && rel < p.until)
            .map_or(self.impair, |p| p.impair)
    }

    /// Corrupt `d` as [`Impair::corrupt`] describes.
    fn corrupt_bytes(&mut self, d: &mut Vec<u8>) {
        if d.is_empty() {
            return;
        }
        if d.len() > 4 && self.draw(0.2) {
            let keep = (self.rng.next_u64() % (d.len() as u64 / 4)) as usize * 4;
            d.truncate(keep);
            return;
        }
        for _ in 0..1 + self.rng.next_u64() % 3 {
            let i = (self.rng.next_u64() % d.len() as u64) as usize;
            d[i] ^= 1 + (self.rng.next_u64() % 255) as u8;
        }
    }

    fn enqueue_impaired(
        &mut self,
        depart: Instant,
        to: usize,
        from: SocketAddr,
        t: &Transmit,
        chunk: &[u8],
    ) {
        let imp = self.impair_now();
        if imp.blackhole || imp.blackhole_port == Some(t.src_port) || self.draw(imp.loss) {
            self.dropped += 1;
            return;
        }
        let copies = if self.draw(imp.dup) { 2 } else { 1 };
        for _ in 0..copies {
            let mut at = depart + self.delay;
            if self.draw(imp.reorder) {
                let slots = if imp.reorder_slots == 0 {
                    5
                } else {
                    imp.reorder_slots
                };
                at += self.delay * (1 + (self.rng.next_u32() % slots));
            }
            let mut ecn = t.ecn.map(|e| e.bits());
            if ecn.is_some() && self.draw(imp.ce) {
                ecn = Some(0b11);
            }
            let mut data = chunk.to_vec();
            if self.draw(imp.corrupt) {
                self.corrupt_bytes(&mut data);
            }
            self.push(at, to, from, ecn, data);
        }
    }

    /// `true` with probability `p` (one draw whenever `p > 0`).
    fn draw(&mut self, p: f64) -> bool {
        p > 0.0 && (self.rng.next_u64() as f64 / u64::MAX as f64) < p
    }

    /// The last recorded datagram ([`Net::record`]) sent by endpoint `from_ep` that parses
    /// and satisfies `f`.
    pub fn last_sent(&self, from_ep: usize, f: impl Fn(&Packet<'_>) -> bool) -> Option<Sent> {
        self.wire
            .iter()
            .rev()
            .filter(|s| s.from_ep == from_ep)
            .find(|s| Packet::parse(&s.data).is_ok_and(|p| f(&p)))
            .cloned()
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

    /// Hand `data` to endpoint `to` now, as if it came from `from` (no ECN), and collect
    /// the events it causes.
    pub fn deliver(&mut self, to: usize, from: SocketAddr, data: &[u8]) {
        self.delivered_to[to] += 1;
        let local = self.addrs[to].ip();
        self.eps[to].handle_datagram(self.now, from, Some(local), None, data);
        self.collect_events(to);
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

    /// Replace endpoint `i` by a fresh one built from `cfg` (same address expected). Packets
    /// in flight stay in flight and reach the new incarnation.
    ///
    /// # Panics
    /// If the endpoint cannot be built from `cfg`.
    pub fn restart_with(&mut self, i: usize, cfg: EndpointConfig) {
        self.eps[i] = Endpoint::new(cfg.clone()).unwrap();
        self.configs[i] = cfg;
        let old = std::mem::take(&mut self.events[i]);
        self.event_times[i].clear();
        self.old_events[i].push(old);
    }

    /// Send everything both endpoints want to send, collect events.
    pub fn flush(&mut self) {
        self.flush_with(&mut |_, _| false);
    }

    fn flush_with(&mut self, filter: Filt<'_>) {
        let mut buf = Vec::with_capacity(1 << 16);
        let mut lent = crate::Lent::new();
        let mut whole = Vec::new();
        loop {
            let mut any = false;
            for i in 0..self.eps.len() {
                let mut n = 0u32;
                loop {
                    let t = if self.gather {
                        self.eps[i].poll_transmit_lent(self.now, &mut buf, &mut lent)
                    } else {
                        self.eps[i].poll_transmit(self.now, &mut buf)
                    };
                    let Some(t) = t else { break };
                    n += 1;
                    assert!(
                        n < 1_000_000,
                        "endpoint {i}: poll_transmit never returns None"
                    );
                    any = true;
                    if self.gather && !lent.is_empty() {
                        if LendingRegion::assemble(&lent, &buf, &mut whole) {
                            assert_eq!(whole.len(), t.size, "lent transmit size");
                            self.lent_bytes += lent.bytes() as u64;
                            let data = std::mem::take(&mut whole);
                            self.enqueue(i, &t, &data, filter);
                            whole = data;
                        }
                        continue;
                    }
                    let data = std::mem::take(&mut buf);
                    self.enqueue(i, &t, &data, filter);
                    buf = data;
                }
            }
            if !any {
                break;
            }
        }
        for i in 0..self.eps.len() {
            self.collect_events(i);
        }
    }

    /// Poll the events of endpoint `i` (and take the snapshots they call for).
    fn collect_events(&mut self, i: usize) {
        let conns: Vec<ConnectionHandle> = self.eps[i].connections().collect();
        for c in conns {
            if let Some(s) = self.eps[i].connection_stats(c) {
                self.last_stats[i].insert(c, s);
            }
        }
        while let Some(e) = self.eps[i].poll_event() {
            if let Event::Completion { wc, .. } | Event::RecvCompletion { wc, .. } = &e {
                if let Some(&(lkey, off, len)) = self.snap_on.get(&(i, wc.wr_id)) {
                    let mem = self.eps[i].mr_read(lkey, off, len).unwrap_or_default();
                    self.snaps.insert((i, wc.wr_id), (self.elapsed(), mem));
                }
            }
            if let (Event::WriteWithImm { imm, .. }, Some((side, lkey, off, len))) =
                (&e, self.snap_on_imm)
            {
                if side == i {
                    let mem = self.eps[i].mr_read(lkey, off, len).unwrap_or_default();
                    self.imm_snaps.push((*imm, mem));
                }
            }
            self.events[i].push(e);
            self.event_times[i].push(self.now);
        }
    }

    /// When something happens next (a packet arrives or a timer fires).
    pub fn next_event(&self) -> Option<Instant> {
        let next_pkt = self.queue.peek().map(|p| p.at.0);
        let next_timer = self.eps.iter().filter_map(Endpoint::poll_timeout).min();
        match (next_pkt, next_timer) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn process_now(&mut self) {
        self.process_now_with(&mut |_, _| false);
    }

    fn process_now_with(&mut self, filter: Filt<'_>) {
        self.steps += 1;
        assert!(
            self.steps < MAX_STEPS,
            "livelock: {} steps at virtual time {:?}",
            self.steps,
            self.elapsed()
        );
        while self.queue.peek().is_some_and(|p| p.at.0 <= self.now) {
            let p = self.queue.pop().unwrap();
            if let Some(mut hook) = self.deliver_hook.take() {
                hook(self, p.to, p.from, &p.data);
                if self.deliver_hook.is_none() {
                    self.deliver_hook = Some(hook);
                }
            }
            if self.log_delivered {
                self.delivered_log.push((p.to, p.from, p.data.clone()));
            }
            self.delivered += 1;
            self.delivered_to[p.to] += 1;
            let local = self.addrs[p.to].ip();
            let mut ecn = p.ecn.and_then(EcnCodepoint::from_bits);
            if let Some(h) = self.ecn_hook.as_mut() {
                ecn = h(&p.data, ecn);
            }
            self.eps[p.to].handle_datagram(self.now, p.from, Some(local), ecn, &p.data);
            self.collect_events(p.to);
        }
        for i in 0..self.eps.len() {
            if self.eps[i].poll_timeout().is_some_and(|t| t <= self.now) {
                self.eps[i].handle_timeout(self.now);
                if self.check_timers {
                    if let Some(t) = self.eps[i].poll_timeout() {
                        assert!(
                            t > self.now,
                            "endpoint {i}: timer still due right after handle_timeout at {:?}",
                            self.elapsed()
                        );
                    }
                }
                self.collect_events(i);
            }
        }
        self.flush_with(filter);
    }

    /// Exchange datagrams and fire timers until nothing is due within `d` of virtual time
    /// from now, then set the clock to the end of that window (or leave it where the network
    /// went quiet). `drop(sender, datagram)` decides which datagrams sent meanwhile are lost
    /// (after [`Net::drop_hook`]; the datagram is still recorded). Returns whether the
    /// network went quiet (no packet in flight, no timer armed).
    pub fn run_dropping(
        &mut self,
        d: Duration,
        mut drop: impl FnMut(usize, &[u8]) -> bool,
    ) -> bool {
        let end = self.now + d;
        loop {
            self.flush_with(&mut drop);
            let Some(next) = self.next_event() else {
                return true;
            };
            if next > end {
                self.now = self.now.max(end);
                return false;
            }
            if next > self.now {
                self.now = next;
            }
            self.process_now_with(&mut drop);
        }
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
        for i in 0..self.eps.len() {
            self.events[i].clear();
            self.event_times[i].clear();
        }
        (c, s)
    }

    /// Completions reported on endpoint `i` for `conn`.
    pub fn completions(&self, i: usize, conn: ConnectionHandle) -> Vec<crate::WorkCompletion> {
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
            Event::ConnectionLost { conn: c, reason } if *c == conn => Some(reason.clone()),
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

    /// Receive completions reported on endpoint `i` for `conn`: (stream, completion), in
    /// order.
    pub fn recv_completions(
        &self,
        i: usize,
        conn: ConnectionHandle,
    ) -> Vec<(u32, crate::WorkCompletion)> {
        self.events[i]
            .iter()
            .filter_map(|e| match e {
                Event::RecvCompletion {
                    conn: c,
                    stream,
                    wc,
                } if *c == conn => Some((*stream, *wc)),
                _ => None,
            })
            .collect()
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

/// Check one datagram an endpoint at IP `local` emitted towards `dest` from UDP source port
/// `src_port` (one GSO segment): it parses as a packet ([`Packet::parse`]) and, when `local`
/// and `dest` are of one address family, its ICRC (RoCEv2 annex A17.8, over the synthesized
/// IP header) verifies.
///
/// # Panics
/// If either check fails, with the reason and the datagram.
pub fn check_emitted(pkt: &[u8], local: IpAddr, dest: SocketAddr, src_port: u16) {
    use crate::wire::icrc::{self, IpHeader};
    if let Err(e) = Packet::parse(pkt) {
        panic!("endpoint {local} emitted an unparsable packet to {dest}: {e}: {pkt:02x?}");
    }
    if let Ok(ip) = IpHeader::synthesized(local, dest.ip()) {
        if let Err(e) = icrc::verify(&ip, src_port, dest.port(), pkt) {
            panic!("endpoint {local} emitted a packet to {dest} with a bad ICRC: {e}");
        }
    }
}

/// Check the order a connection's completions were reported in against the rule of
/// docs/PROTOCOL.md, "Completions": a stream's SENDs in posting order, the one-sided
/// operations (WRITEs, READs, atomics) in posting order among themselves, a SEND only after
/// every one-sided operation posted before it, and each operation at most once.
///
/// `posted`: the operations in posting order, each as (`wr_id`, `Some(stream)` for a SEND,
/// `None` for a one-sided operation); `wr_id`s unique. `reported`: the `wr_id`s of the
/// completions in the order they were reported (a prefix of the operations may be missing
/// from the end of each class: only the order is checked). `Err` describes the first
/// violation. O(n log n).
pub fn check_completion_order(
    posted: &[(u64, Option<u32>)],
    reported: &[u64],
) -> Result<(), String> {
    let index: std::collections::HashMap<u64, usize> = posted
        .iter()
        .enumerate()
        .map(|(i, &(wr_id, _))| (wr_id, i))
        .collect();
    let one_sided: Vec<usize> = (0..posted.len())
        .filter(|&i| posted[i].1.is_none())
        .collect();
    let mut last: std::collections::HashMap<Option<u32>, usize> = std::collections::HashMap::new();
    let mut one_sided_done = 0;
    for &wr_id in reported {
        let Some(&i) = index.get(&wr_id) else {
            return Err(format!("completion of wr {wr_id}, which was not posted"));
        };
        let class = posted[i].1;
        if last.get(&class).is_some_and(|&l| l >= i) {
            return Err(format!(
                "completion of wr {wr_id} out of posting order within its {}: {reported:?}",
                class.map_or("one-sided operations".to_string(), |s| format!(
                    "stream {s}"
                ))
            ));
        }
        last.insert(class, i);
        if class.is_none() {
            one_sided_done += 1;
        } else if one_sided.partition_point(|&j| j < i) > one_sided_done {
            return Err(format!(
                "SEND wr {wr_id} reported before a one-sided operation posted before it: \
                 {reported:?}"
            ));
        }
    }
    Ok(())
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

/// Test memory that lends its bytes for gather send ([`RegionMemory::lend`]): a vector
/// behind a shared lock, lent through a weak reference as an I/O layer would. Register it
/// with [`Endpoint::register_mr_memory`]; [`Net::gather`] assembles its transmits.
pub struct LendingRegion {
    bytes: Arc<Mutex<Vec<u8>>>,
    handle: crate::LendHandle,
}

impl fmt::Debug for LendingRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LendingRegion").finish_non_exhaustive()
    }
}

impl LendingRegion {
    /// A region over `bytes`.
    pub fn new(bytes: Vec<u8>) -> Self {
        let bytes = Arc::new(Mutex::new(bytes));
        let handle: crate::LendHandle = Arc::new(Arc::downgrade(&bytes));
        LendingRegion { bytes, handle }
    }

    /// The shared bytes (write them to change the region under the endpoint).
    pub fn bytes(&self) -> Arc<Mutex<Vec<u8>>> {
        self.bytes.clone()
    }

    /// Assemble a lent transmit into `out`; `false` if its region is gone or not a
    /// `LendingRegion`, or a span does not fit.
    pub fn assemble(lent: &crate::Lent, buf: &[u8], out: &mut Vec<u8>) -> bool {
        let Some(mem) = lent
            .memory()
            .and_then(|m| m.downcast_ref::<Weak<Mutex<Vec<u8>>>>())
            .and_then(Weak::upgrade)
        else {
            return false;
        };
        let g = mem.lock().unwrap_or_else(|e| e.into_inner());
        lent.assemble(buf, &g, out)
    }
}

impl crate::RegionMemory for LendingRegion {
    fn len(&self) -> usize {
        self.bytes.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
    fn read_at(&self, offset: usize, dst: &mut [u8]) {
        let g = self.bytes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = g.get(offset..offset.saturating_add(dst.len())) {
            dst.copy_from_slice(s);
        }
    }
    fn write_at(&mut self, offset: usize, src: &[u8]) {
        let mut g = self.bytes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = g.get_mut(offset..offset.saturating_add(src.len())) {
            d.copy_from_slice(src);
        }
    }
    fn lend(&self) -> Option<crate::LendHandle> {
        Some(self.handle.clone())
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
        self
    }
}
