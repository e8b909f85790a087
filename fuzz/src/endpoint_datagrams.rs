//! `endpoint_datagrams`: one endpoint (the *target*, 10.0.0.2) fed a sequence of datagrams
//! derived from the input, before any connection exists and after a real handshake with an
//! honest in-memory peer (10.0.0.1).
//!
//! The peer's genuine packets to the target are held in a queue; the input decides when
//! they are delivered, dropped, reordered or replayed, and can send mutated copies of them
//! (byte edits, then an optional ICRC re-stamp so that they pass the ICRC check), packets
//! forged from structured fields that reference the live state (QPNs, nonces, PSNs near the
//! real ones, the registered region's keys), or raw bytes, from a choice of source
//! addresses. Both endpoints post SENDs and WRITEs, the clock advances and timers fire.
//! The target's packets go to the peer at once.
//!
//! Checked: no panic; every datagram either endpoint emits parses and carries a valid ICRC;
//! a timer never stays due after `handle_timeout`; the work completions of every
//! connection come exactly once each, in posting order per stream and among one-sided
//! operations, with the posted opcode and length,
//! all of them before that connection's `ConnectionLost`; closing a connection completes
//! everything still pending.

use crate::util::{self, addr_of, ip_of, source_ports, LISTEN_PORT};
use arbitrary::Arbitrary;
use bytes::Bytes;
use metaroce::testing;
use metaroce::wire::{
    self, AckEth, AtomicAckEth, AtomicEth, Bth, CloseEth, ConnectEth, ConnectKind, Headers, NakEth,
    Opcode, Packet, PathEth, Reth, SendEth, Trailer, WriteEth, PSN_MASK,
};
use metaroce::{
    Access, AtomicOp, AtomicRequest, ConnectionHandle, EcnCodepoint, Endpoint, EndpointConfig,
    Event, MrKeys, ReadRequest, RecvRequest, WcOpcode, WriteRequest,
};
use std::collections::{HashMap, HashSet, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

/// Index of the honest peer and of the endpoint under test.
const PEER: usize = 0;
const TARGET: usize = 1;
/// Bounds that keep one run short.
const MAX_BEFORE: usize = 24;
const MAX_AFTER: usize = 192;
const MAX_QUEUE: usize = 2048;
const POOL: usize = 64;
const REGION: usize = 64 * 1024;
const MAX_OP_LEN: usize = 16 * 1024;
/// The destination regions allow everything a peer can do.
const DST_ACCESS: Access = Access(
    Access::LOCAL_WRITE.0
        | Access::REMOTE_WRITE.0
        | Access::REMOTE_READ.0
        | Access::REMOTE_ATOMIC.0,
);

/// The fuzz input.
#[derive(Arbitrary, Debug, Clone)]
pub struct Input {
    /// Whether the target opens the connection (else the peer does).
    pub target_is_client: bool,
    /// Seed of both endpoints' RNGs.
    pub seed: u8,
    /// Configuration variations of the target.
    pub tweaks: Tweaks,
    /// Datagrams and actions before the handshake.
    pub before: Vec<Action>,
    /// Datagrams and actions after it.
    pub after: Vec<Action>,
}

/// Configuration variations (bit flags and their parameters).
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct Tweaks {
    /// bit 0: no ICRC verification; bits 1+2: refuse incoming connections; bit 3: idle
    /// timeout; bit 4: small receive limits; bit 5: few connections; bit 6: PSNs start
    /// just below 2^24; bit 7: small send queue.
    pub flags: u8,
    /// Idle timeout in ms (bit 3).
    pub idle_ms: u8,
    /// Path MTU of the target: 256 << (x % 5).
    pub pmtu_sel: u8,
    /// Paths of the target: 1 + x % 8.
    pub paths: u8,
    /// Parameter of the small limits.
    pub limit: u8,
}

/// A time step: 0, or `x² × 10 µs` (up to 650 ms).
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct Time(pub u8);

impl Time {
    fn duration(self) -> Duration {
        Duration::from_micros(u64::from(self.0) * u64::from(self.0) * 10)
    }
}

/// How a datagram reaches the target.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct Meta {
    /// IP ECN bits (low 2).
    pub ecn: u8,
    /// Recompute the ICRC for the chosen source.
    pub restamp: bool,
    /// Pass the local address to `handle_datagram` (else `None`).
    pub local_known: bool,
    /// Time step before delivery.
    pub time: Time,
}

/// Source address of an injected datagram.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Src {
    /// The genuine packet's own source (or the peer's first path).
    Genuine,
    /// The peer's IP, one of its path ports.
    PeerPath(u8),
    /// The peer's IP and listening port.
    PeerListen,
    /// Another IPv4 host.
    Stranger(u8, u16),
    /// An IPv6 host (mixed address families with the target).
    V6(u16),
    /// The peer's IPv4 address as an IPv4-mapped IPv6 address.
    MappedPeer(u8),
}

/// A byte edit of a genuine packet.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Edit {
    /// XOR one byte.
    Xor { at: u16, v: u8 },
    /// Set one byte.
    Set { at: u16, v: u8 },
    /// Write a big-endian u32.
    SetU32 { at: u16, v: u32 },
    /// Keep only the first `len` bytes.
    Truncate { len: u16 },
    /// Append `n` bytes of `v`.
    Append { n: u8, v: u8 },
    /// Remove `n` bytes at `at`.
    Remove { at: u16, n: u8 },
}

/// A QPN to put in BTH.DestQP or a CONNECT field.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Qp {
    /// The target's i-th known connection.
    Target(u8),
    /// A QPN seen in a CONNECT packet.
    Seen(u8),
    /// Zero.
    Zero,
    /// Any.
    Raw(u32),
}

/// A PSN near the live ones.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Psn {
    /// The peer's next data PSN on a path, plus a delta.
    Peer(u8, i16),
    /// The target's next data PSN on a path, plus a delta.
    Target(u8, i16),
    /// Any.
    Raw(u32),
}

/// A connection nonce.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Nonce {
    /// One seen in a CONNECT packet.
    Seen(u8),
    /// Any.
    Raw(u64),
}

/// A length.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Len {
    /// Up to 64 KiB.
    Small(u16),
    /// Any.
    Raw(u32),
}

impl Len {
    fn get(self) -> u32 {
        match self {
            Len::Small(v) => u32::from(v),
            Len::Raw(v) => v,
        }
    }
}

/// A packet built from fields.
#[derive(Arbitrary, Debug, Clone)]
pub enum Forged {
    /// MR_CONNECT.
    Connect {
        qp: Qp,
        kind: u8,
        bad_version: bool,
        paths: u16,
        src_qpn: Qp,
        dst_qpn: Qp,
        pmtu_sel: u8,
        raw_port: Option<u16>,
        init_psn: u32,
        nonce: Nonce,
        reason: u32,
    },
    /// MR_ACK.
    Ack {
        qp: Qp,
        path: u8,
        cum: Psn,
        flags: u8,
        echo_ts: u32,
        ce_count: u32,
        window_grant: u8,
        rate_hint: u32,
        sack: [u8; 32],
    },
    /// MR_SEND.
    Send {
        qp: Qp,
        path: u8,
        psn: Psn,
        floor: Psn,
        flags: u8,
        stream: u8,
        msg_seq: u16,
        seg: u16,
        msg_len: Len,
        payload: Option<u16>,
    },
    /// MR_WRITE / MR_WRITE_WITH_IMMEDIATE.
    Write {
        qp: Qp,
        path: u8,
        psn: Psn,
        floor: Psn,
        imm: Option<u32>,
        own_region: bool,
        va_off: u32,
        rkey: Option<u32>,
        dma_len: Len,
        op_id: u16,
        seg: u16,
        payload: Option<u16>,
    },
    /// MR_NAK.
    Nak {
        qp: Qp,
        path: u8,
        psn: Psn,
        syndrome: u8,
        flags: u8,
        op_id: u32,
    },
    /// MR_CLOSE.
    Close { qp: Qp, nonce: Nonce, reason: u32 },
    /// MR_READ_REQUEST.
    ReadRequest {
        qp: Qp,
        path: u8,
        psn: Psn,
        floor: Psn,
        own_region: bool,
        va_off: u32,
        rkey: Option<u32>,
        len: Len,
        op_id: u16,
    },
    /// MR_READ_RESPONSE.
    ReadResponse {
        qp: Qp,
        path: u8,
        psn: Psn,
        floor: Psn,
        op_id: u16,
        seg: u16,
        len: u16,
    },
    /// MR_COMPARE_SWAP / MR_FETCH_ADD.
    Atomic {
        qp: Qp,
        path: u8,
        psn: Psn,
        floor: Psn,
        fetch_add: bool,
        own_region: bool,
        va_off: u32,
        rkey: Option<u32>,
        swap_add: u64,
        compare: u64,
        op_id: u16,
    },
    /// MR_ATOMIC_RESPONSE.
    AtomicResponse {
        qp: Qp,
        path: u8,
        psn: Psn,
        floor: Psn,
        op_id: u16,
        orig: u64,
    },
    /// Any opcode, header bytes as given.
    Other {
        op: u8,
        qp: Qp,
        psn: u32,
        body: Vec<u8>,
    },
}

/// One step of the run.
#[derive(Arbitrary, Debug, Clone)]
pub enum Action {
    /// Arbitrary bytes.
    Raw { data: Vec<u8>, src: Src, meta: Meta },
    /// A genuine peer packet (picked from recent ones) with byte edits.
    Mutate {
        pick: u8,
        edits: Vec<Edit>,
        src: Src,
        meta: Meta,
    },
    /// A packet built from fields.
    Forge {
        pkt: Forged,
        fill: u8,
        src: Src,
        meta: Meta,
    },
    /// Deliver the next `n` queued genuine packets.
    Deliver { n: u8 },
    /// Drop the next `n` queued genuine packets.
    Drop { n: u8 },
    /// Deliver the newest queued genuine packet (reordering).
    DeliverNewest,
    /// Deliver a recent genuine packet again, unchanged.
    Replay { pick: u8, ecn: u8 },
    /// The peer SENDs on a stream.
    PeerSend { stream: u8, len: u16 },
    /// The peer WRITEs into the target's region.
    PeerWrite {
        len: u16,
        offset: u16,
        imm: Option<u32>,
    },
    /// The target SENDs on a stream.
    TargetSend { pick: u8, stream: u8, len: u16 },
    /// The target WRITEs into the peer's region (`bad` picks a faulty variant).
    TargetWrite {
        pick: u8,
        len: u16,
        offset: u16,
        imm: Option<u32>,
        bad: u8,
    },
    /// One side posts a receive buffer on a stream (`target`: the target does).
    PostRecv {
        target: bool,
        pick: u8,
        stream: u8,
        len: u16,
        offset: u16,
    },
    /// One side READs from the other's region (`bad` picks a faulty variant).
    Read {
        target: bool,
        pick: u8,
        len: u16,
        offset: u16,
        bad: u8,
    },
    /// One side runs an atomic on the other's region (`bad` picks a faulty variant).
    Atomic {
        target: bool,
        pick: u8,
        fetch_add: bool,
        a: u64,
        b: u64,
        offset: u16,
        bad: u8,
    },
    /// Let time pass; fire due timers.
    Advance { time: Time },
    /// The target deregisters (and re-registers) its source or destination region.
    TargetReregister { dst: bool },
    /// The target closes one of its connections.
    TargetClose { pick: u8 },
    /// The peer closes its oldest connection.
    PeerClose,
    /// The peer opens another connection to the target.
    PeerConnect,
}

#[derive(Debug, Clone)]
struct Dgram {
    from: SocketAddr,
    ecn: Option<EcnCodepoint>,
    data: Vec<u8>,
}

#[derive(Debug, Clone, Copy)]
struct Expect {
    wr_id: u64,
    opcode: WcOpcode,
    len: u32,
    /// The stream of a SEND; `None` for a one-sided operation.
    stream: Option<u32>,
}

/// One connection's operations as posted, (wr_id, stream of a SEND), and the wr_ids of its
/// completions in the order they came.
#[derive(Debug, Default)]
struct Order {
    posted: Vec<(u64, Option<u32>)>,
    reported: Vec<u64>,
}

/// Posted operations of one endpoint and the completions owed for them.
#[derive(Debug, Default)]
struct Book {
    pending: HashMap<u32, VecDeque<Expect>>,
    /// Per connection: what `testing::check_completion_order` checks.
    order: HashMap<u32, Order>,
    /// Posted receives per (connection, stream), in posting order.
    recvs: HashMap<(u32, u32), VecDeque<u64>>,
    lost: HashSet<u32>,
}

impl Book {
    fn posted(&mut self, h: ConnectionHandle, e: Expect) {
        self.pending.entry(h.0).or_default().push_back(e);
        self.order
            .entry(h.0)
            .or_default()
            .posted
            .push((e.wr_id, e.stream));
    }

    fn outstanding(&self, h: ConnectionHandle) -> usize {
        self.pending.get(&h.0).map_or(0, VecDeque::len)
            + self
                .recvs
                .iter()
                .filter(|((c, _), _)| *c == h.0)
                .map(|(_, q)| q.len())
                .sum::<usize>()
    }

    fn on_event(&mut self, who: &str, ev: &Event) {
        match ev {
            Event::Completion { conn, wc } => {
                let q = self.pending.entry(conn.0).or_default();
                let Some(i) = q.iter().position(|e| e.wr_id == wc.wr_id) else {
                    panic!("{who}: completion {wc:?} on {conn} with nothing outstanding (duplicate or unknown wr_id)");
                };
                let e = q[i];
                q.remove(i);
                let o = self.order.entry(conn.0).or_default();
                o.reported.push(wc.wr_id);
                if let Err(err) = testing::check_completion_order(&o.posted, &o.reported) {
                    panic!("{who}: on {conn}: {err}");
                }
                assert_eq!(wc.opcode, e.opcode, "{who}: wrong opcode in {wc:?}");
                assert_eq!(wc.byte_len, e.len, "{who}: wrong byte_len in {wc:?}");
            }
            Event::RecvCompletion { conn, stream, wc } => {
                let q = self.recvs.entry((conn.0, *stream)).or_default();
                let Some(id) = q.pop_front() else {
                    panic!("{who}: receive completion {wc:?} on {conn} stream {stream} with no receive posted");
                };
                assert_eq!(
                    wc.wr_id, id,
                    "{who}: receive completion out of posting order on {conn} stream {stream}: {wc:?}"
                );
                assert_eq!(
                    wc.opcode,
                    WcOpcode::Recv,
                    "{who}: receive completion opcode {wc:?}"
                );
            }
            Event::ConnectionLost { conn, .. } => {
                assert_eq!(
                    self.outstanding(*conn),
                    0,
                    "{who}: {conn} lost with operations or receives not completed: {:?} {:?}",
                    self.pending.get(&conn.0),
                    self.recvs
                        .iter()
                        .filter(|((c, _), q)| *c == conn.0 && !q.is_empty())
                        .collect::<Vec<_>>()
                );
                assert!(self.lost.insert(conn.0), "{who}: {conn} lost twice");
            }
            Event::Connected(h) | Event::Incoming(h) => {
                // A QPN may be reused by a later connection.
                self.lost.remove(&h.0);
                assert_eq!(
                    self.outstanding(*h),
                    0,
                    "{who}: new {h} inherits operations"
                );
            }
            _ => {}
        }
    }
}

struct World {
    eps: [Endpoint; 2],
    now: Instant,
    buf: Vec<u8>,
    to_target: VecDeque<Dgram>,
    pool: Vec<Dgram>,
    pool_next: usize,
    books: [Book; 2],
    /// Connections of each side, in the order they appeared.
    conns: [Vec<ConnectionHandle>; 2],
    qpns_seen: Vec<u32>,
    nonces_seen: Vec<u64>,
    /// Next data PSN per path, as seen on the wire: [peer→target, target→peer].
    next_psn: [[u32; 8]; 2],
    src: [MrKeys; 2],
    dst: [MrKeys; 2],
    next_wr: u64,
    check_timer_spin: bool,
}

fn target_config(seed: u64, t: &Tweaks) -> EndpointConfig {
    let mut c = util::config(TARGET, seed);
    let f = t.flags;
    c.transport.verify_icrc = f & 0x01 == 0;
    c.accept_incoming = f & 0x06 != 0x06;
    if f & 0x08 != 0 {
        c.transport.idle_timeout = Some(Duration::from_millis(u64::from(t.idle_ms) + 1));
    }
    if f & 0x10 != 0 {
        let l = u32::from(t.limit);
        c.transport.max_stream_window = 1 + l % 8;
        c.transport.max_streams = 1 + l % 4;
        c.transport.max_recv_buffer_bytes = 2048 * u64::from(1 + l % 8);
        c.transport.max_message_size = 1 << (8 + l % 12);
    }
    if f & 0x20 != 0 {
        c.max_connections = 1 + usize::from(t.limit % 3);
    }
    if f & 0x40 != 0 {
        c.initial_psn = Some(PSN_MASK - 3);
    }
    if f & 0x80 != 0 {
        c.transport.max_outstanding_ops = 1 + usize::from(t.limit % 4);
    }
    c.transport.pmtu = 256 << (t.pmtu_sel % 5);
    c.transport.paths = 1 + u16::from(t.paths % 8);
    c
}

impl World {
    fn new(input: &Input) -> World {
        let seed = u64::from(input.seed);
        let mut pc = util::config(PEER, seed);
        if input.tweaks.flags & 0x40 != 0 {
            pc.initial_psn = Some(PSN_MASK - 1);
        }
        let tc = target_config(seed, &input.tweaks);
        let mut eps = [
            Endpoint::new(pc).expect("peer config"),
            Endpoint::new(tc).expect("target config"),
        ];
        let mut src = Vec::new();
        let mut dst = Vec::new();
        for (i, ep) in eps.iter_mut().enumerate() {
            src.push(ep.register_mr(util::pattern(i as u64, REGION), Access::LOCAL_WRITE));
            dst.push(ep.register_mr(vec![0; REGION], DST_ACCESS));
        }
        World {
            eps,
            now: Instant::now(),
            buf: Vec::with_capacity(1 << 16),
            to_target: VecDeque::new(),
            pool: Vec::new(),
            pool_next: 0,
            books: [Book::default(), Book::default()],
            conns: [Vec::new(), Vec::new()],
            qpns_seen: Vec::new(),
            nonces_seen: Vec::new(),
            next_psn: [[0; 8]; 2],
            src: [src[0], src[1]],
            dst: [dst[0], dst[1]],
            next_wr: 0,
            // Known core bug "idle-timer-spin" (fuzz/README.md): with an idle timeout and
            // operations pending, the idle timer stays due after handle_timeout.
            check_timer_spin: input.tweaks.flags & 0x08 == 0 || !util::tolerate("idle-timer-spin"),
        }
    }

    /// Remember QPNs, nonces and data PSNs seen in a genuine packet.
    fn learn(&mut self, dir: usize, pkt: &[u8]) {
        let Ok(p) = Packet::parse(pkt) else { return };
        match p.headers {
            Headers::Connect(c) => {
                if self.qpns_seen.len() < 32 {
                    self.qpns_seen.push(c.src_qpn);
                }
                if !self.nonces_seen.contains(&c.nonce) && self.nonces_seen.len() < 32 {
                    self.nonces_seen.push(c.nonce);
                }
            }
            Headers::Send { path, .. }
            | Headers::Write { path, .. }
            | Headers::ReadRequest { path, .. }
            | Headers::ReadResponse { path, .. }
            | Headers::Atomic { path, .. }
            | Headers::AtomicResponse { path, .. } => {
                self.next_psn[dir][usize::from(path.path_id % 8)] = wire::psn_add(p.bth.psn, 1);
            }
            _ => {}
        }
    }

    fn drain_events(&mut self) {
        for i in 0..2 {
            let who = if i == TARGET { "target" } else { "peer" };
            while let Some(ev) = self.eps[i].poll_event() {
                self.books[i].on_event(who, &ev);
                match ev {
                    Event::Connected(h) | Event::Incoming(h)
                        if !self.conns[i].contains(&h) && self.conns[i].len() < 64 =>
                    {
                        self.conns[i].push(h);
                    }
                    Event::Message { data, .. } => {
                        assert!(
                            data.len() as u64 <= self.eps[i].config().transport.max_message_size
                        );
                    }
                    _ => {}
                }
            }
        }
    }

    /// Move output: the target's to the peer at once, the peer's into the held queue.
    fn settle(&mut self) {
        for _round in 0..64 {
            let mut moved = false;
            let mut n = 0;
            while let Some(t) = self.eps[TARGET].poll_transmit(self.now, &mut self.buf) {
                n += 1;
                assert!(n < 100_000, "target: poll_transmit never returns None");
                moved = true;
                let segs: Vec<Vec<u8>> =
                    util::segments(&t, &self.buf).map(<[u8]>::to_vec).collect();
                for seg in segs {
                    util::check_emitted(&seg, ip_of(TARGET), t.destination, t.src_port);
                    self.learn(1, &seg);
                    if t.destination == addr_of(PEER) {
                        let from = SocketAddr::new(ip_of(TARGET), t.src_port);
                        self.eps[PEER].handle_datagram(
                            self.now,
                            from,
                            Some(ip_of(PEER)),
                            t.ecn,
                            &seg,
                        );
                    }
                }
            }
            let mut n = 0;
            while let Some(t) = self.eps[PEER].poll_transmit(self.now, &mut self.buf) {
                n += 1;
                assert!(n < 100_000, "peer: poll_transmit never returns None");
                moved = true;
                let segs: Vec<Vec<u8>> =
                    util::segments(&t, &self.buf).map(<[u8]>::to_vec).collect();
                for seg in segs {
                    util::check_emitted(&seg, ip_of(PEER), t.destination, t.src_port);
                    if t.destination != addr_of(TARGET) {
                        continue;
                    }
                    self.learn(0, &seg);
                    let d = Dgram {
                        from: SocketAddr::new(ip_of(PEER), t.src_port),
                        ecn: t.ecn,
                        data: seg,
                    };
                    if self.pool.len() < POOL {
                        self.pool.push(d.clone());
                    } else {
                        self.pool[self.pool_next % POOL] = d.clone();
                    }
                    self.pool_next += 1;
                    if self.to_target.len() >= MAX_QUEUE {
                        self.to_target.pop_front();
                    }
                    self.to_target.push_back(d);
                }
            }
            self.drain_events();
            if !moved {
                break;
            }
        }
    }

    fn advance(&mut self, dt: Duration) {
        self.now += dt;
        for i in 0..2 {
            if self.eps[i].poll_timeout().is_some_and(|t| t <= self.now) {
                self.eps[i].handle_timeout(self.now);
                if self.check_timer_spin {
                    if let Some(t) = self.eps[i].poll_timeout() {
                        assert!(
                            t > self.now,
                            "endpoint {i}: timer still due right after handle_timeout ({:?} <= now)",
                            self.now - t
                        );
                    }
                }
            }
        }
        self.settle();
    }

    fn source(&self, s: Src, genuine: Option<SocketAddr>) -> SocketAddr {
        let peer_port = |k: u8| source_ports(PEER)[usize::from(k % 8)];
        match s {
            Src::Genuine => genuine.unwrap_or(SocketAddr::new(ip_of(PEER), peer_port(0))),
            Src::PeerPath(k) => SocketAddr::new(ip_of(PEER), peer_port(k)),
            Src::PeerListen => SocketAddr::new(ip_of(PEER), LISTEN_PORT),
            Src::Stranger(a, port) => SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 1, a)), port),
            Src::V6(port) => {
                SocketAddr::new(IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1)), port)
            }
            Src::MappedPeer(k) => {
                let IpAddr::V4(v4) = ip_of(PEER) else {
                    unreachable!()
                };
                SocketAddr::new(IpAddr::V6(v4.to_ipv6_mapped()), peer_port(k))
            }
        }
    }

    /// Hand one datagram to the target and let everything settle.
    fn inject(&mut self, from: SocketAddr, mut data: Vec<u8>, meta: Meta) {
        self.advance(meta.time.duration());
        if meta.restamp {
            util::restamp(
                &mut data,
                from.ip(),
                ip_of(TARGET),
                from.port(),
                LISTEN_PORT,
            );
        }
        let local = meta.local_known.then(|| ip_of(TARGET));
        let ecn = EcnCodepoint::from_bits(meta.ecn);
        self.eps[TARGET].handle_datagram(self.now, from, local, ecn, &data);
        self.settle();
    }

    fn deliver(&mut self, d: Dgram) {
        self.eps[TARGET].handle_datagram(self.now, d.from, Some(ip_of(TARGET)), d.ecn, &d.data);
        self.settle();
    }

    fn qp(&self, q: Qp) -> u32 {
        match q {
            Qp::Target(i) => pick(&self.conns[TARGET], i).map_or(0, |h| h.0),
            Qp::Seen(i) => pick(&self.qpns_seen, i).copied().unwrap_or(1),
            Qp::Zero => 0,
            Qp::Raw(v) => v,
        }
    }

    fn psn(&self, p: Psn) -> u32 {
        match p {
            Psn::Peer(path, d) => {
                wire::psn_add(self.next_psn[0][usize::from(path % 8)], d as i32 as u32)
            }
            Psn::Target(path, d) => {
                wire::psn_add(self.next_psn[1][usize::from(path % 8)], d as i32 as u32)
            }
            Psn::Raw(v) => v,
        }
    }

    fn nonce(&self, n: Nonce) -> u64 {
        match n {
            Nonce::Seen(i) => pick(&self.nonces_seen, i).copied().unwrap_or(0),
            Nonce::Raw(v) => v,
        }
    }

    fn path_eth(&self, path: u8, floor: Psn) -> PathEth {
        PathEth {
            path_id: path,
            flags: 0,
            timestamp: 0,
            floor_psn: self.psn(floor),
            plane: 0,
        }
    }

    /// Path MTU of the connection a forged packet addresses (1024 if unknown).
    fn pmtu_of(&self, qpn: u32) -> u32 {
        self.eps[TARGET]
            .connection_stats(ConnectionHandle(qpn))
            .map_or(1024, |s| s.pmtu)
            .max(1)
    }

    fn forge(&self, f: &Forged, fill: u8) -> Vec<u8> {
        let payload_for = |len: u32, off: u32, pmtu: u32, explicit: Option<u16>| -> Vec<u8> {
            let n = match explicit {
                Some(n) => usize::from(n) % 4400,
                None => len.saturating_sub(off).min(pmtu) as usize,
            };
            vec![fill; n]
        };
        let (bth, hdrs, payload) = match *f {
            Forged::Connect {
                qp,
                kind,
                bad_version,
                paths,
                src_qpn,
                dst_qpn,
                pmtu_sel,
                raw_port,
                init_psn,
                nonce,
                reason,
            } => {
                let kind = match kind % 5 {
                    0 => ConnectKind::Request,
                    1 => ConnectKind::Accept,
                    2 => ConnectKind::Reject,
                    3 => ConnectKind::Retry,
                    _ => ConnectKind::Confirm,
                };
                let pmtu = if pmtu_sel >= 0xF0 {
                    u16::from(pmtu_sel) * 17
                } else {
                    256 << (pmtu_sel % 5)
                };
                let h = Headers::Connect(ConnectEth {
                    kind,
                    version: if bad_version { 1 } else { ConnectEth::VERSION },
                    paths,
                    src_qpn: self.qp(src_qpn),
                    dst_qpn: self.qp(dst_qpn),
                    pmtu,
                    listen_port: raw_port.unwrap_or(LISTEN_PORT),
                    init_psn,
                    nonce: self.nonce(nonce),
                    reason,
                    server_nonce: self.nonce(nonce).rotate_left(17),
                    flags: 0,
                    cookie: [0; 16],
                });
                (Bth::new(Opcode::MR_CONNECT, self.qp(qp), 0), h, Vec::new())
            }
            Forged::Ack {
                qp,
                path,
                cum,
                flags,
                echo_ts,
                ce_count,
                window_grant,
                rate_hint,
                sack,
            } => {
                let h = Headers::Ack(AckEth {
                    path_id: path,
                    flags,
                    ack_delay: 0,
                    echo_ts,
                    ce_count,
                    window_grant,
                    rate_hint,
                    sack,
                });
                let cum = self.psn(cum);
                (Bth::new(Opcode::MR_ACK, self.qp(qp), cum), h, Vec::new())
            }
            Forged::Send {
                qp,
                path,
                psn,
                floor,
                flags,
                stream,
                msg_seq,
                seg,
                msg_len,
                payload,
            } => {
                let qpn = self.qp(qp);
                let pmtu = self.pmtu_of(qpn);
                let len = msg_len.get();
                let offset = u32::from(seg).wrapping_mul(pmtu);
                let h = Headers::Send {
                    path: PathEth {
                        path_id: path,
                        flags,
                        timestamp: 0,
                        floor_psn: self.psn(floor),
                        plane: 0,
                    },
                    send: SendEth {
                        stream_id: u32::from(stream),
                        msg_seq: u32::from(msg_seq),
                        offset,
                        msg_len: len,
                    },
                };
                let mut bth = Bth::new(Opcode::MR_SEND, qpn, self.psn(psn));
                bth.ack_req = true;
                (bth, h, payload_for(len, offset, pmtu, payload))
            }
            Forged::Write {
                qp,
                path,
                psn,
                floor,
                imm,
                own_region,
                va_off,
                rkey,
                dma_len,
                op_id,
                seg,
                payload,
            } => {
                let qpn = self.qp(qp);
                let pmtu = self.pmtu_of(qpn);
                let len = dma_len.get();
                let offset = u32::from(seg).wrapping_mul(pmtu);
                let region = self.dst[TARGET];
                let va = if own_region {
                    region
                        .addr
                        .wrapping_add(u64::from(va_off % (REGION as u32 + 64)))
                } else {
                    u64::from(va_off) << 8
                };
                let h = Headers::Write {
                    path: PathEth {
                        path_id: path,
                        flags: 0,
                        timestamp: 0,
                        floor_psn: self.psn(floor),
                        plane: 0,
                    },
                    reth: Reth {
                        va,
                        rkey: rkey.unwrap_or(region.rkey),
                        dma_len: len,
                    },
                    write: WriteEth {
                        op_id: u32::from(op_id),
                        offset,
                    },
                    imm,
                };
                let op = if imm.is_some() {
                    Opcode::MR_WRITE_WITH_IMMEDIATE
                } else {
                    Opcode::MR_WRITE
                };
                let bth = Bth::new(op, qpn, self.psn(psn));
                (bth, h, payload_for(len, offset, pmtu, payload))
            }
            Forged::Nak {
                qp,
                path,
                psn,
                syndrome,
                flags,
                op_id,
            } => {
                let h = Headers::Nak {
                    path: PathEth {
                        path_id: path,
                        ..PathEth::default()
                    },
                    nak: NakEth {
                        syndrome,
                        flags,
                        op_id,
                    },
                };
                (
                    Bth::new(Opcode::MR_NAK, self.qp(qp), self.psn(psn)),
                    h,
                    Vec::new(),
                )
            }
            Forged::Close { qp, nonce, reason } => {
                let h = Headers::Close(CloseEth {
                    reason,
                    flags: (reason >> 31) as u8,
                    reply_port: 4791,
                    nonce: self.nonce(nonce),
                });
                (Bth::new(Opcode::MR_CLOSE, self.qp(qp), 0), h, Vec::new())
            }
            Forged::ReadRequest {
                qp,
                path,
                psn,
                floor,
                own_region,
                va_off,
                rkey,
                len,
                op_id,
            } => {
                let region = self.dst[TARGET];
                let va = if own_region {
                    region
                        .addr
                        .wrapping_add(u64::from(va_off % (REGION as u32 + 64)))
                } else {
                    u64::from(va_off) << 8
                };
                let h = Headers::ReadRequest {
                    path: self.path_eth(path, floor),
                    reth: Reth {
                        va,
                        rkey: rkey.unwrap_or(region.rkey),
                        dma_len: len.get(),
                    },
                    op: WriteEth {
                        op_id: u32::from(op_id),
                        offset: 0,
                    },
                };
                let bth = Bth::new(Opcode::MR_READ_REQUEST, self.qp(qp), self.psn(psn));
                (bth, h, Vec::new())
            }
            Forged::ReadResponse {
                qp,
                path,
                psn,
                floor,
                op_id,
                seg,
                len,
            } => {
                let qpn = self.qp(qp);
                let pmtu = self.pmtu_of(qpn);
                let h = Headers::ReadResponse {
                    path: self.path_eth(path, floor),
                    op: WriteEth {
                        op_id: u32::from(op_id),
                        offset: u32::from(seg).wrapping_mul(pmtu),
                    },
                };
                let bth = Bth::new(Opcode::MR_READ_RESPONSE, qpn, self.psn(psn));
                (bth, h, vec![fill; usize::from(len) % 4400])
            }
            Forged::Atomic {
                qp,
                path,
                psn,
                floor,
                fetch_add,
                own_region,
                va_off,
                rkey,
                swap_add,
                compare,
                op_id,
            } => {
                let region = self.dst[TARGET];
                let va = if own_region {
                    region
                        .addr
                        .wrapping_add(u64::from(va_off % (REGION as u32 + 64)))
                } else {
                    u64::from(va_off) << 3
                };
                let h = Headers::Atomic {
                    path: self.path_eth(path, floor),
                    atomic: AtomicEth {
                        va,
                        rkey: rkey.unwrap_or(region.rkey),
                        swap_add,
                        compare,
                    },
                    op: WriteEth {
                        op_id: u32::from(op_id),
                        offset: 0,
                    },
                };
                let op = if fetch_add {
                    Opcode::MR_FETCH_ADD
                } else {
                    Opcode::MR_COMPARE_SWAP
                };
                (Bth::new(op, self.qp(qp), self.psn(psn)), h, Vec::new())
            }
            Forged::AtomicResponse {
                qp,
                path,
                psn,
                floor,
                op_id,
                orig,
            } => {
                let h = Headers::AtomicResponse {
                    path: self.path_eth(path, floor),
                    op: WriteEth {
                        op_id: u32::from(op_id),
                        offset: 0,
                    },
                    ack: AtomicAckEth { orig },
                };
                let bth = Bth::new(Opcode::MR_ATOMIC_RESPONSE, self.qp(qp), self.psn(psn));
                (bth, h, Vec::new())
            }
            Forged::Other {
                op,
                qp,
                psn,
                ref body,
            } => {
                let mut v = vec![0u8; wire::BTH_LEN];
                let _ = Bth::new(Opcode(op), self.qp(qp), psn).emit(&mut v);
                v.extend_from_slice(&body[..body.len().min(4400)]);
                let pad = wire::pad_for(v.len());
                v[1] |= (pad as u8) << 4;
                v.resize(v.len() + pad + wire::ICRC_LEN, 0);
                return v;
            }
        };
        // An on-path forger: packets for a live connection carry its real token (so the
        // fuzzer reaches the connection logic); others carry none. The odd `fill` values
        // flip the token, which must always be refused.
        let trailer = if bth.opcode == Opcode::MR_CONNECT {
            Trailer::None
        } else {
            match self.eps[TARGET].connection_tokens(ConnectionHandle(bth.dest_qp)) {
                Some((_, rx)) if fill % 7 != 3 => Trailer::Token(rx),
                Some((_, rx)) => Trailer::Token(!rx),
                None => Trailer::Token(u64::from(fill)),
            }
        };
        let mut out = vec![0u8; wire::packet_len_with(&hdrs, payload.len(), &trailer)];
        match wire::emit_packet_with(&bth, &hdrs, &payload, &trailer, &mut out) {
            Ok(n) => {
                out.truncate(n);
                out
            }
            Err(e) => panic!("emit of a well-typed forged packet failed: {e}"),
        }
    }

    fn post_send(&mut self, side: usize, pick_conn: u8, stream: u8, len: u16) {
        let Some(&h) = pick(&self.conns[side], pick_conn) else {
            return;
        };
        let len = usize::from(len) % (MAX_OP_LEN + 1);
        let wr_id = self.next_wr;
        self.next_wr += 1;
        let data = Bytes::from(util::pattern(wr_id, len));
        if self.eps[side]
            .post_send(h, u32::from(stream % 8), wr_id, data)
            .is_ok()
        {
            self.books[side].posted(
                h,
                Expect {
                    wr_id,
                    opcode: WcOpcode::Send,
                    len: len as u32,
                    stream: Some(u32::from(stream % 8)),
                },
            );
        }
        self.settle();
    }

    #[allow(clippy::too_many_arguments)]
    fn post_write(
        &mut self,
        side: usize,
        pick_conn: u8,
        len: u16,
        offset: u16,
        imm: Option<u32>,
        bad: u8,
    ) {
        let Some(&h) = pick(&self.conns[side], pick_conn) else {
            return;
        };
        let other = 1 - side;
        let len = u32::from(len) % (MAX_OP_LEN as u32 + 1);
        let remote = self.dst[other];
        let mut req = WriteRequest {
            wr_id: self.next_wr,
            lkey: self.src[side].lkey,
            local_offset: u64::from(offset) % (REGION as u64 - u64::from(len) + 1),
            len,
            remote_addr: remote.addr + u64::from(offset) % (REGION as u64 - u64::from(len) + 1),
            rkey: remote.rkey,
            imm,
        };
        match bad % 8 {
            1 => req.rkey ^= 0x100,
            2 => req.remote_addr = remote.addr + REGION as u64 - u64::from(len / 2),
            3 => req.remote_addr = remote.addr.wrapping_sub(1),
            4 => req.local_offset = REGION as u64, // refused at post time
            _ => {}
        }
        self.next_wr += 1;
        if self.eps[side].post_write(h, req).is_ok() {
            let opcode = if imm.is_some() {
                WcOpcode::RdmaWriteWithImm
            } else {
                WcOpcode::RdmaWrite
            };
            self.books[side].posted(
                h,
                Expect {
                    wr_id: req.wr_id,
                    opcode,
                    len,
                    stream: None,
                },
            );
        }
        self.settle();
    }

    fn post_recv(&mut self, side: usize, pick_conn: u8, stream: u8, len: u16, offset: u16) {
        let Some(&h) = pick(&self.conns[side], pick_conn) else {
            return;
        };
        let wr_id = self.next_wr;
        self.next_wr += 1;
        let len = u32::from(len) % (MAX_OP_LEN as u32 + 1);
        let req = RecvRequest {
            wr_id,
            lkey: self.dst[side].lkey,
            offset: u64::from(offset) % (REGION as u64 - u64::from(len) + 1),
            len,
        };
        let stream = u32::from(stream % 8);
        if self.eps[side].post_recv(h, stream, req).is_ok() {
            self.books[side]
                .recvs
                .entry((h.0, stream))
                .or_default()
                .push_back(wr_id);
        }
        self.settle();
    }

    fn post_read(&mut self, side: usize, pick_conn: u8, len: u16, offset: u16, bad: u8) {
        let Some(&h) = pick(&self.conns[side], pick_conn) else {
            return;
        };
        let other = 1 - side;
        let len = u32::from(len) % (MAX_OP_LEN as u32 + 1);
        let remote = self.dst[other];
        let off = u64::from(offset) % (REGION as u64 - u64::from(len) + 1);
        let mut req = ReadRequest {
            wr_id: self.next_wr,
            lkey: self.dst[side].lkey,
            local_offset: off,
            len,
            remote_addr: remote.addr + off,
            rkey: remote.rkey,
        };
        match bad % 8 {
            1 => req.rkey ^= 0x100,
            2 => req.remote_addr = remote.addr + REGION as u64 - u64::from(len / 2),
            3 => req.rkey = self.src[other].rkey, // no REMOTE_READ there
            _ => {}
        }
        self.next_wr += 1;
        if self.eps[side].post_read(h, req).is_ok() {
            self.books[side].posted(
                h,
                Expect {
                    wr_id: req.wr_id,
                    opcode: WcOpcode::RdmaRead,
                    len,
                    stream: None,
                },
            );
        }
        self.settle();
    }

    #[allow(clippy::too_many_arguments)]
    fn post_atomic(
        &mut self,
        side: usize,
        pick_conn: u8,
        fetch_add: bool,
        a: u64,
        b: u64,
        offset: u16,
        bad: u8,
    ) {
        let Some(&h) = pick(&self.conns[side], pick_conn) else {
            return;
        };
        let other = 1 - side;
        let remote = self.dst[other];
        let off = (u64::from(offset) % (REGION as u64 / 8)) * 8;
        let op = if fetch_add {
            AtomicOp::FetchAdd { add: a }
        } else {
            AtomicOp::CompareSwap {
                compare: a,
                swap: b,
            }
        };
        let mut req = AtomicRequest {
            wr_id: self.next_wr,
            lkey: self.dst[side].lkey,
            local_offset: off,
            remote_addr: remote.addr + off,
            rkey: remote.rkey,
            op,
        };
        match bad % 8 {
            1 => req.rkey ^= 0x100,
            2 => req.remote_addr += 3, // misaligned
            3 => req.remote_addr = remote.addr + REGION as u64 - 4,
            _ => {}
        }
        self.next_wr += 1;
        if self.eps[side].post_atomic(h, req).is_ok() {
            let opcode = if fetch_add {
                WcOpcode::FetchAdd
            } else {
                WcOpcode::CompSwap
            };
            self.books[side].posted(
                h,
                Expect {
                    wr_id: req.wr_id,
                    opcode,
                    len: 8,
                    stream: None,
                },
            );
        }
        self.settle();
    }

    fn step(&mut self, a: &Action) {
        match a {
            Action::Raw { data, src, meta } => {
                let from = self.source(*src, None);
                let data = data[..data.len().min(4400)].to_vec();
                self.inject(from, data, *meta);
            }
            Action::Mutate {
                pick: p,
                edits,
                src,
                meta,
            } => {
                let Some(d) = pick(&self.pool, *p).cloned() else {
                    return;
                };
                let mut data = d.data;
                for e in edits.iter().take(16) {
                    apply_edit(&mut data, *e);
                }
                let from = self.source(*src, Some(d.from));
                self.inject(from, data, *meta);
            }
            Action::Forge {
                pkt,
                fill,
                src,
                meta,
            } => {
                let data = self.forge(pkt, *fill);
                let from = self.source(*src, None);
                self.inject(from, data, *meta);
            }
            Action::Deliver { n } => {
                for _ in 0..*n % 32 + 1 {
                    let Some(d) = self.to_target.pop_front() else {
                        break;
                    };
                    self.deliver(d);
                }
            }
            Action::Drop { n } => {
                for _ in 0..*n % 32 + 1 {
                    self.to_target.pop_front();
                }
            }
            Action::DeliverNewest => {
                if let Some(d) = self.to_target.pop_back() {
                    self.deliver(d);
                }
            }
            Action::Replay { pick: p, ecn } => {
                if let Some(mut d) = pick(&self.pool, *p).cloned() {
                    d.ecn = EcnCodepoint::from_bits(*ecn);
                    self.deliver(d);
                }
            }
            Action::PeerSend { stream, len } => self.post_send(PEER, 0, *stream, *len),
            Action::PeerWrite { len, offset, imm } => {
                self.post_write(PEER, 0, *len, *offset, *imm, 0)
            }
            Action::TargetSend { pick, stream, len } => {
                self.post_send(TARGET, *pick, *stream, *len)
            }
            Action::TargetWrite {
                pick,
                len,
                offset,
                imm,
                bad,
            } => self.post_write(TARGET, *pick, *len, *offset, *imm, *bad),
            Action::PostRecv {
                target,
                pick,
                stream,
                len,
                offset,
            } => self.post_recv(usize::from(*target), *pick, *stream, *len, *offset),
            Action::Read {
                target,
                pick,
                len,
                offset,
                bad,
            } => self.post_read(usize::from(*target), *pick, *len, *offset, *bad),
            Action::Atomic {
                target,
                pick,
                fetch_add,
                a,
                b,
                offset,
                bad,
            } => self.post_atomic(
                usize::from(*target),
                *pick,
                *fetch_add,
                *a,
                *b,
                *offset,
                *bad,
            ),
            Action::Advance { time } => self.advance(time.duration()),
            Action::TargetReregister { dst } => {
                let ep = &mut self.eps[TARGET];
                if *dst {
                    ep.deregister_mr(self.dst[TARGET].lkey);
                    self.dst[TARGET] = ep.register_mr(vec![0; REGION], DST_ACCESS);
                } else {
                    ep.deregister_mr(self.src[TARGET].lkey);
                    self.src[TARGET] =
                        ep.register_mr(util::pattern(7, REGION), Access::LOCAL_WRITE);
                }
                self.settle();
            }
            Action::TargetClose { pick: p } => {
                if let Some(&h) = pick(&self.conns[TARGET], *p) {
                    self.close(TARGET, h);
                }
            }
            Action::PeerClose => {
                if let Some(&h) = self.conns[PEER].first() {
                    self.close(PEER, h);
                }
            }
            Action::PeerConnect => {
                if self.conns[PEER].len() < 4 {
                    let _ = self.eps[PEER].connect(self.now, addr_of(TARGET), None);
                    self.settle();
                }
            }
        }
    }

    fn close(&mut self, side: usize, h: ConnectionHandle) {
        let existed = self.eps[side].peer_addr(h).is_some();
        self.eps[side].close(self.now, h);
        self.settle();
        assert_eq!(
            self.books[side].outstanding(h),
            0,
            "side {side}: close({h}) left operations without completion"
        );
        if existed {
            assert!(
                self.books[side].lost.contains(&h.0),
                "side {side}: close({h}) reported no ConnectionLost"
            );
        }
        assert!(self.eps[side].peer_addr(h).is_none());
    }

    /// Connect the two endpoints, delivering everything in order.
    fn handshake(&mut self, target_is_client: bool) {
        let (client, server) = if target_is_client {
            (TARGET, PEER)
        } else {
            (PEER, TARGET)
        };
        if self.eps[client]
            .connect(self.now, addr_of(server), None)
            .is_err()
        {
            return;
        }
        self.settle();
        for _ in 0..8 {
            while let Some(d) = self.to_target.pop_front() {
                self.deliver(d);
            }
            if self.conns[PEER].len() + self.conns[TARGET].len() >= 2 {
                break;
            }
            self.advance(Duration::from_millis(1));
        }
    }
}

fn pick<T>(v: &[T], i: u8) -> Option<&T> {
    if v.is_empty() {
        None
    } else {
        v.get(usize::from(i) % v.len())
    }
}

fn apply_edit(d: &mut Vec<u8>, e: Edit) {
    let at = |x: u16, len: usize| if len == 0 { 0 } else { usize::from(x) % len };
    match e {
        Edit::Xor { at: a, v } => {
            if !d.is_empty() {
                let i = at(a, d.len());
                d[i] ^= v;
            }
        }
        Edit::Set { at: a, v } => {
            if !d.is_empty() {
                let i = at(a, d.len());
                d[i] = v;
            }
        }
        Edit::SetU32 { at: a, v } => {
            if d.len() >= 4 {
                let i = at(a, d.len() - 3);
                d[i..i + 4].copy_from_slice(&v.to_be_bytes());
            }
        }
        Edit::Truncate { len } => d.truncate(usize::from(len)),
        Edit::Append { n, v } => d.extend(std::iter::repeat_n(v, usize::from(n))),
        Edit::Remove { at: a, n } => {
            if !d.is_empty() {
                let i = at(a, d.len());
                let end = (i + usize::from(n)).min(d.len());
                d.drain(i..end);
            }
        }
    }
}

/// The target.
pub fn run(input: &Input) {
    let mut w = World::new(input);
    for a in input.before.iter().take(MAX_BEFORE) {
        w.step(a);
    }
    w.handshake(input.target_is_client);
    let connected = [w.conns[PEER].len(), w.conns[TARGET].len()];
    for a in input.after.iter().take(MAX_AFTER) {
        w.step(a);
    }
    if util::trace() {
        let st = w.eps[TARGET].stats();
        let cs: Vec<_> = w.eps[TARGET]
            .connections()
            .filter_map(|h| w.eps[TARGET].connection_stats(h))
            .map(|s| {
                (
                    s.data_packets_received,
                    s.recv.messages,
                    s.recv.naks,
                    s.acks_received,
                )
            })
            .collect();
        eprintln!(
            "endpoint_datagrams: before {} after {} actions; conns after handshake {connected:?}, now {:?}; target {st:?}; per conn (data, msgs, naks, acks) {cs:?}",
            input.before.len().min(MAX_BEFORE),
            input.after.len().min(MAX_AFTER),
            [w.conns[PEER].len(), w.conns[TARGET].len()],
        );
    }
    // Closing every connection completes everything still outstanding, on both sides.
    for side in [TARGET, PEER] {
        let handles: Vec<ConnectionHandle> = w.eps[side].connections().collect();
        for h in handles {
            w.close(side, h);
        }
        assert_eq!(w.eps[side].connections().count(), 0);
        for (h, q) in &w.books[side].pending {
            assert!(
                q.is_empty(),
                "side {side}: qp {h:#x} has operations never completed: {q:?}"
            );
        }
        for (k, q) in &w.books[side].recvs {
            assert!(
                q.is_empty(),
                "side {side}: {k:?} has receives never completed: {q:?}"
            );
        }
    }
}
