//! Configuration of endpoints and connections. Every limit the core enforces on untrusted
//! input is a field here, with its unit and default.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

/// An invalid configuration value, from a `validate` function
/// ([`TransportConfig::validate`], [`CongestionConfig::validate`],
/// [`ProtectionConfig::validate`](crate::crypto::ProtectionConfig::validate),
/// [`Endpoint::new`](crate::Endpoint::new)): which field, and the rule it breaks with the
/// value found. `Display` is `"{field} {rule}"`, e.g.
/// `paths must be in 1..=256, got 0`.
///
/// ```
/// let mut t = metaroce::TransportConfig::default();
/// t.pmtu = 1000;
/// let e = t.validate().unwrap_err();
/// assert_eq!(e.field(), "pmtu");
/// assert_eq!(e.to_string(), "pmtu must be 256, 512, 1024, 2048 or 4096, got 1000");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    field: &'static str,
    rule: String,
}

impl ConfigError {
    /// An error for `field` (its path from the checked struct, as written in Rust:
    /// `pmtu`, `congestion.max_window`, `packet_protection.replay_window`) breaking `rule`
    /// (`"must be at least 1"`, `"must be in 1..=256, got 0"`).
    pub fn new(field: &'static str, rule: impl Into<String>) -> ConfigError {
        ConfigError {
            field,
            rule: rule.into(),
        }
    }

    /// The field, e.g. `"congestion.max_window"`.
    pub fn field(&self) -> &'static str {
        self.field
    }

    /// The rule it breaks, with the value found, e.g. `"must be at most 255 packets, got 300"`.
    pub fn rule(&self) -> &str {
        &self.rule
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.field, self.rule)
    }
}

impl std::error::Error for ConfigError {}

fn bad(field: &'static str, rule: impl Into<String>) -> Result<(), ConfigError> {
    Err(ConfigError::new(field, rule))
}

/// Configuration of an [`Endpoint`](crate::Endpoint): its addresses and the defaults for
/// the connections it makes or accepts.
#[derive(Debug, Clone)]
pub struct EndpointConfig {
    /// The address peers send to: IP and listening UDP port. Its IP is also the source
    /// address the ICRC pseudo-header uses unless a connection learns a better one.
    pub local_addr: SocketAddr,
    /// Local UDP source ports, one per path, in path order (ECMP entropy). A connection
    /// uses at most this many paths. Must not be empty.
    pub source_ports: Vec<u16>,
    /// Seed of the endpoint's *reproducible* RNG: QPNs and initial PSNs. Same seeds and
    /// same inputs give the same outputs. Default: the constant `0x6d65_7461_726f_6365`
    /// (deterministic for the simulator and tests).
    ///
    /// **Real deployments must set this and [`secret_seed`](Self::secret_seed) from the
    /// operating system's randomness** (`metaroce-tokio` and `metaroce-perf` do by default).
    pub seed: u64,
    /// Seed (32 bytes) of the endpoint's *secret* RNG: connection nonces (and so the
    /// per-connection tokens), the retry-cookie key, rkeys and region addresses (issue #9).
    /// `None` (the default) derives it from [`seed`](Self::seed): deterministic and **not
    /// secret** — fine for the simulator and tests, never for a network an attacker can
    /// reach. **Real deployments must fill it from the OS** (e.g. the `getrandom` crate);
    /// `metaroce-tokio` always does. Two incarnations of an endpoint must not share it.
    pub secret_seed: Option<[u8; 32]>,
    /// Whether connection requests from peers are accepted. Default `true`.
    pub accept_incoming: bool,
    /// Most connections at once; requests beyond it are rejected. Default 65 536.
    pub max_connections: usize,
    /// Let the application decide on each connection request: with `true`, an accepted
    /// request creates the connection but holds it — [`Event::Incoming`](crate::Event::Incoming)
    /// is reported and nothing is sent to the peer (not even the CONNECT Accept) until
    /// [`Endpoint::accept_incoming`](crate::Endpoint::accept_incoming), or the request is
    /// answered with a CONNECT Reject carrying the application's code by
    /// [`Endpoint::refuse_incoming`](crate::Endpoint::refuse_incoming). Default `false`
    /// (accepted at once).
    pub manual_accept: bool,
    /// First PSN of every path of every connection this endpoint makes or accepts; `None`
    /// (the default) draws a random one per connection from the seeded RNG. Set it to test
    /// PSN wrap-around at 2^24 (e.g. `Some(0xFF_FFF0)`).
    pub initial_psn: Option<u32>,
    /// When a connection Request must first prove, with a retry cookie, that its sender
    /// receives at its address (stateless handshake, RFC 9000 §8.1 in spirit). Default
    /// [`RetryPolicy::Always`].
    pub retry: RetryPolicy,
    /// Lifetime of a retry cookie: cookies are MACs over a time bucket of this length and
    /// are accepted in their bucket and the next one (so for 1 to 2 lifetimes). Default 10 s.
    pub retry_cookie_lifetime: Duration,
    /// Most accepted connections that have not yet heard from their client (half-open).
    /// A Request that finds the table full evicts the half-open connection that arrived
    /// first, if that one is at least `handshake_interval` old: it ends with
    /// `HandshakeTimeout`, and its client, if it had the Accept and the connection is not
    /// AEAD, gets an MR_CLOSE with code 1 (`EndpointStats::half_open_evicted`). So a flood
    /// of Requests from many sources that never confirm (one IPv6 host owns a /64 of
    /// addresses) cannot lock other clients out: each half-open connection has at least
    /// a handshake interval, and otherwise the time the flood takes to send this many
    /// Requests, to finish its round trip (with `manual_accept`, also the application's
    /// accept; RFC 4987 §3.4, recycling the oldest half-open TCB). Refusing new Requests
    /// instead, as before 2026-12-06, locked every other client out while such a flood
    /// lasted. A Request that finds `max_connections` reached gets Reject reason 2
    /// (connection limit). One that would evict a younger entry (a flood of more than this
    /// many Requests per handshake interval: 40,960/s with the defaults) gets reason 2 with
    /// `FLAG_TRY_AGAIN`, and its client sends it again on its handshake timer: each attempt
    /// lands on a freed slot with a probability of about the turnover over the flood rate,
    /// so a flood ten times faster than that still fails some connects after
    /// `handshake_attempts`. At least 1; default 4096.
    pub max_half_open: usize,
    /// Most half-open connections from one source address (IPv4-mapped IPv6 addresses
    /// count as IPv4). Further Requests from that address get Reject reason 5
    /// ([`ConnectEth::REASON_SOURCE_LIMIT`](crate::wire::ConnectEth::REASON_SOURCE_LIMIT))
    /// until some of its connections are confirmed or expire; a client that gets it sends
    /// its Request again on the handshake timer and fails (with that Reject) only when its
    /// `handshake_attempts` run out. A host that completes the retry-cookie round trip from
    /// its own address and never confirms can then hold at most this many of the
    /// `max_half_open` slots, not all of them (found by an attacker's trial: one host at
    /// 6,000 Requests/s locked every other client out). A legitimate connection is
    /// half-open for one round trip (with `manual_accept`, also until the application
    /// accepts it), so a host opening more connections than this at once waits a
    /// handshake interval for some of them. Many attacking addresses together (an IPv6
    /// host owns many) are answered by evicting the oldest half-open connection
    /// ([`max_half_open`](Self::max_half_open)); a source at this limit evicts nothing.
    /// At least 1; default 64.
    pub max_half_open_per_source: usize,
    /// Most bytes of messages delivered to the application and not yet consumed
    /// (`TransportConfig::explicit_consume`; each message counted with 128 bytes of
    /// bookkeeping), over all connections of the endpoint together. While they are at or
    /// above it, every new SEND message into a library-owned buffer, on any connection, is
    /// refused with a flow-control RNR NAK (the sender waits and retries; counted in
    /// `RecvStats::memory_rnr_naks`) until the application consumes. Each connection is
    /// bounded by its own budgets too ([`TransportConfig::max_recv_buffer_bytes`]), but a
    /// peer can open many connections and fill streams nobody reads: without this the
    /// total grew with their number (a new user's trial: 512 MiB per connection). Only
    /// reads lower the count, so an application that reads what it is given is never held
    /// back by it; one that leaves streams unread holds every peer back once it is reached.
    /// Messages still being reassembled count against [`max_reassembly_bytes`](Self::max_reassembly_bytes)
    /// instead. Without `explicit_consume` delivered bytes belong to the application and
    /// this does nothing. At least 1 (`Endpoint::new` refuses 0); default 4 GiB.
    pub max_unread_recv_bytes: u64,
    /// Most bytes of SEND messages being reassembled into library-owned buffers (first
    /// packet arrived, not yet delivered; each message counted at its full length plus 128
    /// bytes of bookkeeping from its first packet), over all connections of the endpoint
    /// together. Each connection is bounded by its own budget
    /// ([`TransportConfig::max_recv_buffer_bytes`]), but a peer can open many connections
    /// and start messages it never finishes: without this the total grew with their number
    /// (2.25 GiB per connection with the defaults).
    ///
    /// A packet of a new message that would take the total over this is refused with a
    /// flow-control RNR NAK (the sender waits and retries without limit; counted in
    /// `RecvStats::reassembly_rnr_naks`), except for the next message due on its stream:
    /// that one also comes in while the total stays within twice this, or when the total
    /// is at most this (one message as large as `max_message_size`). Such a message needs
    /// only its own packets to complete, so every stream makes progress however messages
    /// further ahead use the cap; a single cap without that exception deadlocked after one
    /// lost packet. The endpoint thus holds at most `max(2 × this, this +
    /// max_message_size + 128)` bytes of messages being reassembled (4 GiB with the
    /// defaults), plus one small message per connection (below).
    ///
    /// While a message beyond this is in progress (one of `max_message_size`, or many
    /// started on many connections), new messages further ahead on their streams wait, and
    /// next-due ones wait too once the total is over twice this, except one small message
    /// per connection ([`reassembly_floor_bytes`](Self::reassembly_floor_bytes)).
    ///
    /// **A peer can hold this cap.** A message is charged at its full length from its first
    /// packet, so a peer that starts messages and never finishes them holds it with a few
    /// packets: the first packets of two maximum-size messages reach twice the cap (a
    /// review's test: another connection's 1000-byte messages then waited for good when
    /// larger than the floor). Other peers' larger messages then wait (flow-control RNR
    /// NAKs) for as long as that peer keeps its connections alive; no timeout ends such a
    /// message, since none can tell it from a slow honest one. What the cap buys is
    /// bounded memory under honest overload (many peers sending large messages at once: an
    /// incast is held to about twice the cap instead of a budget per connection) and under
    /// a flood of connections. A service that takes messages from peers it does not trust
    /// should lower `max_message_size`, so that the cap holds many messages, and
    /// `max_connections`. At least 1 (`Endpoint::new` refuses 0); default 2 GiB.
    pub max_reassembly_bytes: u64,
    /// Next-due messages of at most this many bytes get in beyond
    /// [`max_reassembly_bytes`](Self::max_reassembly_bytes), one per connection at a time,
    /// so that small messages (requests, control) of every connection keep flowing
    /// whichever peer holds the cap. This adds at most this plus 128 bytes per connection
    /// to the bound above (about 4 GiB at `max_connections` 65,536). 0 turns it off;
    /// default 64 KiB.
    pub reassembly_floor_bytes: u64,
    /// Most handshake replies (Retry, Reject, unsolicited CLOSE) queued for sending at
    /// once; more are dropped (the peer retries). Default 1024.
    pub max_control_queue: usize,
    /// QPN residue class of this endpoint: every QPN it allocates for its connections is
    /// `≡ qpn_residue (mod qpn_modulus)`. A sharded host (`metaroce-tokio`'s
    /// `Config::shards`) runs one endpoint per shard on one UDP port and steers each
    /// datagram to a shard by `DestQP mod shards` (a reuseport program in the kernel), so
    /// each shard's endpoint must own its residue class. Default `1` (every QPN; the
    /// allocation is then exactly as without sharding, draw for draw). Must be in
    /// `1..=65536`.
    pub qpn_modulus: u32,
    /// See [`qpn_modulus`](Self::qpn_modulus); must be `< qpn_modulus`. Default 0.
    pub qpn_residue: u32,
    /// Transport parameters of every connection.
    pub transport: TransportConfig,
}

/// When the server answers a connection Request with a Retry (cookie) instead of creating
/// state. MetaRoCE extension, docs/PROTOCOL.md "Connection set-up".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryPolicy {
    /// Every Request must carry a valid cookie (one extra round trip per connection). The
    /// default: the server then holds no per-peer state and sends nothing larger than it
    /// received for any unvalidated address, so a flood of forged Requests costs it
    /// nothing and it cannot be used as a reflector; the cost, one RTT at set-up, is small
    /// next to the connection's lifetime.
    Always,
    /// Demand cookies only once this many connections (established or half-open) exist.
    AboveLoad(usize),
    /// Never demand cookies: state on the first Request (the pre-issue-#9 behaviour).
    Never,
}

impl EndpointConfig {
    /// A configuration with the given addresses and default transport parameters.
    ///
    /// The default `seed` is a documented constant and `secret_seed` is `None` (derived
    /// from `seed`): deterministic, right for the simulator and tests, and **wrong for any
    /// real deployment** — set both from the operating system's randomness there (as
    /// `metaroce-tokio` does), or every endpoint has the same QPNs, nonces and memory keys.
    pub fn new(local_addr: SocketAddr, source_ports: Vec<u16>) -> Self {
        Self {
            local_addr,
            source_ports,
            seed: 0x6d65_7461_726f_6365,
            accept_incoming: true,
            max_connections: 65_536,
            manual_accept: false,
            initial_psn: None,
            secret_seed: None,
            retry: RetryPolicy::Always,
            retry_cookie_lifetime: Duration::from_secs(10),
            max_half_open: 4096,
            max_half_open_per_source: 64,
            max_unread_recv_bytes: 4 << 30,
            max_reassembly_bytes: 2 << 30,
            reassembly_floor_bytes: 64 << 10,
            max_control_queue: 1024,
            qpn_modulus: 1,
            qpn_residue: 0,
            transport: TransportConfig::default(),
        }
    }
}

/// Transport parameters of a connection (delivery and semantic layers).
#[derive(Debug, Clone)]
pub struct TransportConfig {
    /// Paths (UDP source ports) to spray over; the connection uses
    /// `min(this, peer's, source ports available)`. Default 8.
    pub paths: u16,
    /// Path MTU: payload bytes per data packet, a power of two in 256..=4096 (IBA path
    /// MTU values). Negotiated down to the peer's. Default 4096. [`validate`](Self::validate)
    /// refuses other values; one set later through `Endpoint::transport_config_mut`, which
    /// does not validate, is rounded down to the largest IBA value not above it (256 at
    /// least).
    pub pmtu: u32,
    /// Largest message (SEND) or WRITE accepted, in bytes; at most 2^31 (IBA). Default 2^31.
    pub max_message_size: u64,
    /// Receive memory budget per connection in bytes: library-owned buffers of SEND
    /// messages being reassembled or waiting for in-order delivery. A packet of a new
    /// message that would exceed it is refused with a flow-control RNR NAK (the sender
    /// waits the RNR timer and retries, without limit; docs/PROTOCOL.md, "Receive flow
    /// control"),
    /// except for the next message due on its stream, so that every stream can always make
    /// progress: such messages share a second reserve of the same size, and one of them may
    /// always come in when that reserve is empty. Each message counts 128 bytes of
    /// bookkeeping on top of its length, so many tiny or empty messages cannot pile up
    /// either. A connection thus holds at most this plus `max(this, max_message_size + 128)`
    /// bytes of buffers; of them, the bytes delivered and not yet consumed count, over all
    /// connections, against [`EndpointConfig::max_unread_recv_bytes`]. Default 256 MiB.
    pub max_recv_buffer_bytes: u64,
    /// Receive flow control driven by the application (for drivers that feed bounded
    /// per-stream queues, e.g. `metaroce-tokio`). When `true`, the bytes of a message handed
    /// out in [`Event::Message`](crate::Event::Message) stay charged against
    /// `max_stream_recv_bytes` and `max_recv_buffer_bytes` — also on streams the
    /// application never reads — until the application reports them consumed with
    /// [`Endpoint::stream_consumed`](crate::Endpoint::stream_consumed). A new message that
    /// does not fit is refused with a flow-control RNR NAK (syndrome `0x40 | min_rnr_timer`,
    /// docs/PROTOCOL.md, "Receive flow control") instead of being dropped: the sender waits
    /// the RNR timer (0.64 ms by default) and retries, without limit and without counting it
    /// against `rnr_retry`, and sends no new message on that stream meanwhile; nothing is
    /// dropped and the sender's SENDs do not fail. When `false` (the default), bytes are
    /// released when the message is handed out (the application owns them from then on)
    /// and only reassembly buffers count. With it on, WRITE-with-immediate notifications
    /// count too: the driver must also call
    /// [`Endpoint::immediates_consumed`](crate::Endpoint::immediates_consumed) as the
    /// application takes them, or the peer's WRITEs with immediate wait once
    /// `max_unconsumed_immediates` are outstanding.
    pub explicit_consume: bool,
    /// With `explicit_consume`: most bytes one stream holds in library-owned buffers
    /// (messages delivered and not yet consumed, plus messages being reassembled or waiting
    /// for in-order delivery, each counted with 128 bytes of bookkeeping). A message that
    /// would exceed it waits (flow-control RNR), except when the stream holds nothing — so a
    /// message larger than the limit can still come in — and except that the next message
    /// due on the stream is checked against the delivered, unconsumed bytes only (so later
    /// messages being reassembled cannot block it). A stream thus holds at most
    /// 2 × this + one message. Default 16 MiB: about the bandwidth-delay product of
    /// 100 Gbit/s over a 1 ms path, enough to keep one stream at line rate, small enough
    /// that 16 unread streams fill only the default 256 MiB connection budget.
    pub max_stream_recv_bytes: u64,
    /// How far ahead of the next in-order message a stream accepts messages, in messages
    /// (0 acts as 1: the next message due is always accepted). A SEND packet of a message
    /// further ahead is refused with a flow-control RNR NAK, never acknowledged: the
    /// sender waits and re-sends it, so the peers' windows need not match. Default 1024.
    pub max_stream_window: u32,
    /// Most streams one connection keeps state for at once, per direction: a new stream
    /// beyond it is refused. Its SEND fails with `RemoteInvalidRequest` at the sender (NAK
    /// 0x61 with `NakEth::FLAG_STREAM_REFUSED`), later SENDs on it with `WrFlushError`,
    /// and the sender's stream abort ([`STREAM_CODE_REFUSED`](crate::STREAM_CODE_REFUSED))
    /// lets this side record the id as closed; nothing of the stream is delivered. A
    /// stream stops counting once it is over in that direction and the connection forgot
    /// it (its end acknowledged, or delivered and consumed; see
    /// [`Event::StreamClosed`](crate::Event::StreamClosed)), so a connection may open any
    /// number of streams over its life, this many at a time, and refusals do not use
    /// anything up. It also bounds the ranges of closed stream ids kept per direction, at
    /// `2 × max_streams + 1` (ids of one side, opened in order, merge into one range; a
    /// peer that skips ids can fragment them until ended streams are kept instead of
    /// forgotten). Default 65 536. See docs/PROTOCOL.md, "Refused streams".
    pub max_streams: u32,
    /// Most posted operations (SENDs, WRITEs, READs, atomics) not yet completed per
    /// connection; more
    /// are refused with [`PostError::SendQueueFull`](crate::PostError::SendQueueFull).
    /// Default 65 536.
    pub max_outstanding_ops: usize,
    /// Time between retransmissions of a connection request. Default 100 ms.
    pub handshake_interval: Duration,
    /// Connection requests sent before the attempt fails. Default 20.
    pub handshake_attempts: u32,
    /// Retransmission timeouts in a row without any acknowledged progress after which a
    /// path is retired; when every path is retired the connection fails and its operations
    /// complete with `RetryExceeded` (IBA `retry_cnt`, but per path). Each path backs off
    /// exponentially from its own RTO (SRTT + 4 RTTVAR, at least `min_rto`) up to
    /// `max_rto`; the sum over 12 timeouts from a 1 ms RTO is about 3 s, but paths that
    /// re-roll (`path_reroll_timeouts`) and probe, tail-loss probes, and RTOs above
    /// `min_rto` stretch it: measured, a connection with operations outstanding fails
    /// about 4.5 s after the network dies in the in-memory harness (tests/liveness.rs) and
    /// 5.8–7.3 s over loopback UDP (issue #10). `idle_timeout` (default 10 s) bounds it in
    /// every case: a connection that hears nothing for that long fails with
    /// `IdleTimeout`, outstanding operations or not. Default 12.
    pub retry_count: u32,
    /// Timeouts in a row without progress after which a path moves to a new UDP source
    /// port (new ECMP entropy) that no other path of the connection uses, and probes it
    /// with one packet at a time; progress makes it active again. Repeats every this many
    /// timeouts until `retry_count`. 0 disables re-rolling. Default 3.
    pub path_reroll_timeouts: u32,
    /// Re-roll a path at a retransmission timeout — from its first one on, not only every
    /// `path_reroll_timeouts` — when another path of the connection has had a packet
    /// acknowledged that was sent after this path's newest outstanding packet (its
    /// tail-loss probe): the network delivers, only this path's route is silent, as in the
    /// blackhole a failed link is until routing converges. Its packets are resent on the
    /// other paths anyway (every timed-out packet is); the path moves to a new source port
    /// on its own plane and probes it with one packet at a time, so it is back as soon as
    /// that route works (a whole failed plane is still found by the plane logic). A
    /// connection with one path, or whose paths all went silent, keeps the
    /// `path_reroll_timeouts` rule. Default `false`: it cuts the time a single WRITE loses to
    /// a blackholed path by half (tests/sim_path_blackhole.rs), but on the 128-host ring
    /// all-reduce with a failed spine link it did not help (docs/RESULTS.md (f)) unless
    /// `path_reroll_resets_backoff` is on too (72.6 → 40.8 ms).
    pub path_reroll_on_first_timeout: bool,
    /// Hold the first RTO of a path in a row while the peer is silent on every path
    /// (nothing heard since the path's probe, every other live path waiting since before
    /// it), or acknowledges nothing sent after the path's oldest outstanding packet on any
    /// path while every other live path waits too (a receive queue that has not reached
    /// the packets): the packets stay outstanding and one more probe goes out, as QUIC's
    /// probe timeout (RFC 9002 §6.2.4), instead of declaring the window lost
    /// (docs/PROTOCOL.md, "Timers, per path"). A host stall of the peer, or a queue that
    /// grows past the RTO, then costs no retransmitted window. Default `true`.
    pub hold_silent_rto: bool,
    /// Hold the first RTO of a path in a row, as `hold_silent_rto` does, when nothing
    /// shows a loss (nothing sent after the path's oldest outstanding packet has been
    /// acknowledged on any path) and every other live path waits for the peer or is idle,
    /// with at least one idle path that has an RTT sample: keepalives then ask up to 4
    /// such idle paths, smallest SRTT first, whether the peer is alive. A valid ACK on
    /// another path echoing a time at or after the question (the answer, or anything the
    /// peer acknowledged since) while the path's packets are still unacknowledged (the peer
    /// alive, this path not) fires the RTO one SRTT of the path after it, counted once: a
    /// dead path's packets move about one round trip of an idle path plus one SRTT later
    /// than without the question (in
    /// `loss_timers::a_held_rto_that_an_idle_path_answers_moves_the_packets`, 40 µs for 1
    /// to 3 dead paths of 2 to 8). If every asked path crosses the failure too, nothing
    /// answers and the packets move at the doubled RTO. No answer because the peer's host
    /// stalled costs no window sent again, only the hold's probe: issue #13, a single connection's 64 B WRITEs on loopback resent
    /// a window of about 65 packets at every peer stall longer than an RTO, because idle
    /// paths beside the busy ones kept `hold_silent_rto` from applying. Counted in
    /// `PathStats::asked_rtos` and `PathStats::refuted_holds`. Default `true`.
    pub ask_idle_path: bool,
    /// How many RTOs of a path in a row are held while the path has no RTT sample yet,
    /// no packet sent after its oldest outstanding one has been acknowledged on any path,
    /// and no other path known to work (with an RTT sample) is idle: each such timeout
    /// came from `initial_rtt` (a guess, not a measurement; RFC 6298 §2 does not trust an
    /// RTO taken before the first sample either) and nothing shows a loss. The packets
    /// stay outstanding and one more probe goes out, as for `hold_silent_rto`; the
    /// back-off doubles the next RTO. The timeout that re-rolls the path
    /// (`path_reroll_timeouts`) or retires it (`retry_count`) is never held, nor one after
    /// an RTO of the path that was not such a hold. A connection's first window then
    /// survives a first RTT far above `initial_rtt`: issue #13, 8 connections starting at
    /// once on a loaded host queued 6–11 ms at the receiver, and every RTO resent a path's
    /// window of 33 packets. The cost: a path dead from its first packet that carries the
    /// last packets of the connection's first message (nothing sent after them on other
    /// paths) moves them at the first RTO not held: with the defaults the third, about
    /// 11.5 ms after the send instead of 2.5 ms (test
    /// `loss_timers::a_path_dead_from_its_first_packet_costs_at_most_the_held_timeouts`).
    /// 0 disables. Default 2.
    pub unmeasured_rto_holds: u32,
    /// When a path is re-rolled after timeouts while another path of the connection has
    /// had a packet acknowledged that was sent after this path's newest outstanding one
    /// (the network delivers, only this route is silent), restart its timeout back-off:
    /// the next RTO on the new, untried route is the path's base RTO, not 2^n of it. The
    /// count of timeouts in a row carries on (the path is still retired after
    /// `retry_count`), and a connection whose paths all went silent keeps backing off.
    /// Without it, the one packet a re-rolled path probes with (real data that other work
    /// may wait for) is held 8, 16, 32 … RTOs whenever the new route is dead too, which a
    /// re-roll is with the probability the failed link has in the ECMP hash. See
    /// docs/RESULTS.md (f), "A failed spine link". Default false.
    pub path_reroll_resets_backoff: bool,
    /// ECMP collision handling, in the spirit of PLB (Protective Load Balancing, SIGCOMM
    /// 2022): paths that hash onto one bottleneck link split it, so a connection whose
    /// ports leave a link unused runs slower, and every path sees queueing, so congestion
    /// alone does not tell. A path whose acknowledged packets over a measuring interval
    /// stay below this many thousandths of the connection's fastest path's, for
    /// `rebalance_rounds` intervals in a row while the connection is window-limited (it
    /// always had data to send) and no path timed out, moves to a new UDP source port that
    /// no path uses (new ECMP entropy; the re-roll generation moves the peer's ACKs too).
    /// Unlike a timeout re-roll the path keeps its window; it sends nothing new until its
    /// outstanding packets are settled, so that the new route cannot overtake the old one.
    /// One path (the slowest) moves per interval; after the n-th move 2^(n/2) intervals
    /// (at most 64) are not counted; at most `rebalance_max_rerolls` moves. With three
    /// paths on one link against two on another the ratio is 667‰, with two against one
    /// 500‰; the default sits above both and below the noise of paths sharing links
    /// equally. Needs spare source ports (more ports than paths). 0 disables it.
    /// Default 750. Measured in docs/RESULTS.md §1.
    pub rebalance_ratio_permille: u32,
    /// Length of one measuring interval of ECMP collision handling, in smoothed RTTs (the
    /// largest of the connection's paths). Default 4.
    pub rebalance_interval_rtts: u32,
    /// Packets the fastest path must have acknowledged before a measuring interval ends
    /// (it is extended until then), so that slow or short transfers are not judged on a
    /// handful of packets. Default 64.
    pub rebalance_min_packets: u32,
    /// Measuring intervals in a row a path must be slow before it is moved. Default 2.
    pub rebalance_rounds: u32,
    /// Most paths a connection moves for ECMP collision handling over its lifetime, so
    /// that a network it cannot balance does not make it churn. Default 32.
    pub rebalance_max_rerolls: u32,
    /// RTT assumed before the first sample. Default 500 µs.
    pub initial_rtt: Duration,
    /// Lower bound of the retransmission timeout. Default 1 ms (tokio's timer granularity).
    pub min_rto: Duration,
    /// Upper bound of the retransmission timeout, after exponential back-off; must be
    /// positive. Default 1 s.
    pub max_rto: Duration,
    /// Packet threshold of loss detection: a PSN trailing the highest acknowledged PSN of
    /// its path by more than this many packets is declared lost at once, whatever the
    /// time-based rule (RACK, RFC 8985, see docs/PROTOCOL.md "Loss detection") says.
    /// Default 0: off, loss detection is time-based only.
    pub reorder_threshold: u32,
    /// Most packets one GSO batch may carry (set by the I/O backend). Default 1.
    pub max_gso_segments: usize,
    /// Most paths one `MR_ACK` datagram acknowledges (an *ACK bundle*, docs/PROTOCOL.md
    /// "ACK bundles"): when several paths of the same plane have an ACK due at once (a
    /// receive batch sprayed over them), the receiver sends one datagram of up to this many
    /// ACK blocks instead of one datagram per path, from the answer port of the path it
    /// names first (rotating, so the reverse routes of all paths keep being used). 1 = one
    /// path per ACK, as peers without bundles expect; at most 28 (the datagram then stays
    /// under 1,500 bytes). Default 8.
    pub max_ack_bundle: usize,
    /// Longest time a receiver holds the ACK of a lone SEND packet (delayed ACK, as QUIC's
    /// `max_ack_delay`, RFC 9000 §13.2.1): when an `MR_SEND` packet arrives in order, with no
    /// CE mark, as the only packet the connection has not acknowledged yet, its ACK waits up
    /// to this long for data going back to the same peer (a reply) and then leaves right
    /// behind that data packet, in the same transmit batch (with GSO, in the same
    /// [`Transmit`](crate::Transmit), the reply taking the path whose source port the ACK
    /// leaves from: docs/PROTOCOL.md "Delayed ACK"); otherwise it leaves when the
    /// time is up. Any further packet, a gap, a CE mark, a WRITE, READ or atomic packet makes
    /// every ACK due at once, so bulk transfers and one-sided operations are not delayed.
    /// The ACK reports how long it was held (AckEth bytes 2–3, docs/PROTOCOL.md
    /// "AckEth"), and the receiver of the ACK subtracts that from its RTT sample
    /// (RFC 9002 §5.3); this side adds its own `max_ack_delay` to its tail-loss probe
    /// timeout, so both ends should use the same value. A SEND's completion (Success) comes
    /// at most this much later for a message nobody answers — measured by the driver's
    /// timer, which may be coarser (tokio's resolves 1 ms: about 1.2 ms for the default),
    /// unless the application says it has no reply
    /// ([`Endpoint::release_held_ack`](crate::Endpoint::release_held_ack); metaroce-tokio
    /// calls it when a stream's reader goes back to waiting). `Duration::ZERO` = never
    /// hold an ACK (as before). Default 100 µs; at most 10 ms.
    pub max_ack_delay: Duration,
    /// Verify the ICRC of received packets when the addresses it covers are known.
    /// Default `true`.
    pub verify_icrc: bool,
    /// Silence from the peer after which an established connection is closed with
    /// [`ConnectionError::IdleTimeout`](crate::ConnectionError::IdleTimeout) and its
    /// pending operations are flushed (`WrFlushError`), whether or not operations are
    /// outstanding: every packet from the peer (ACKs, NAKs, data, answers to keepalives)
    /// counts as heard. `None` keeps a silent connection forever.
    ///
    /// Default 10 s. In a data centre a live peer answers within microseconds to
    /// milliseconds; 10 s rides out a switch reboot, a link flap with routing
    /// reconvergence (typically < 1 s) or a long GC/scheduling pause of the peer process,
    /// and still reports a dead peer (process killed, host down, cable pulled) to the
    /// application within seconds instead of never. With `keepalive_interval` (default
    /// 3 s) three keepalives go out before the timeout, so two lost in a row do not close
    /// a live connection. Connections with operations outstanding usually fail earlier,
    /// with `RetryExceeded` after `retry_count` retransmission timeouts.
    pub idle_timeout: Option<Duration>,
    /// Silence from the peer after which a keepalive is sent, and then again every this
    /// long while the silence lasts: an `MR_ACK` with AckEth flags bit 1 set
    /// (docs/PROTOCOL.md, "Keepalive") that the peer answers with an ACK at once. It keeps
    /// an idle connection from reaching `idle_timeout` while the peer is alive and tells a
    /// dead peer from an idle one. Keepalives rotate over the connection's paths, so they
    /// exercise every path. `None` sends none (then an idle connection with a live but
    /// silent peer is closed after `idle_timeout`). Default 3 s (a third of the default
    /// idle timeout, see there). A value not shorter than `idle_timeout` is taken as
    /// `idle_timeout / 3` (so lowering only the idle timeout keeps keepalives working).
    /// Must not be zero.
    pub keepalive_interval: Option<Duration>,
    /// How long a graceful close ([`Endpoint::close_with`](crate::Endpoint::close_with))
    /// lets operations already posted drain before the rest are flushed
    /// (`WrFlushError`) and the close is sent. Default 2 s: at any data-centre rate a
    /// connection's full window (4 MiB by default) drains in milliseconds, and 2 s still
    /// covers many retransmission timeouts of loss; a close should not hold an
    /// application up for longer than a human notices, and it stays well below
    /// `idle_timeout`. Operations larger than rate × 2 s (e.g. a 2 GiB WRITE below
    /// 8 Gbit/s) need a larger value or a wait for their completions before closing.
    pub close_timeout: Duration,
    /// How many times an `MR_CLOSE` is sent before the closing side gives up waiting for
    /// the peer's answer (an `MR_CLOSE` with the ACK flag). The first copy goes out at
    /// once, the next after the connection's largest path RTO (at least `min_rto`),
    /// doubling each time: with the defaults and a dead peer the record of the close is
    /// freed after about 31 RTOs. Default 5.
    pub close_attempts: u32,
    /// Most RDMA READs and atomics a connection has outstanding as requester, and most
    /// READ/atomic responses it queues as responder (IBA `max_rd_atomic` /
    /// `max_dest_rd_atomic`); requests beyond it wait (requester) or, at the responder, are
    /// refused with an RNR NAK, not executed, and re-sent by the requester after the RNR
    /// time without limit (a request that was already executed is acknowledged instead).
    /// Default 16.
    pub max_rd_atomic: u32,
    /// Most one-sided operation ids (WRITE, READ, atomic) the responder tracks per
    /// connection above its floor of finished ids: WRITEs in progress plus finished ids
    /// above the first unfinished one. It also bounds the records of refused op ids (the
    /// oldest is forgotten first; a request re-sent after its record was forgotten is taken
    /// for an executed one). A packet of a new op id beyond it is not taken until the
    /// floor moves: a WRITE packet is dropped unacknowledged, a READ/atomic request gets an
    /// RNR NAK (the op id at the floor is always admitted, so the oldest operation can
    /// finish). The segment bitmaps of WRITEs in progress (one bit per path-MTU segment)
    /// take at most this × 512 bytes; a new WRITE that would exceed that waits the same way.
    /// It also bounds the records of refused SEND messages ahead of their stream's next
    /// one (kept so that in-order delivery skips them): beyond it such a message is NAKed
    /// but not recorded. And it bounds the records of streams refused for want of
    /// `max_streams` room, kept until the sender's abort comes so that a late copy of a
    /// refused SEND is not delivered (the oldest is forgotten first: a late copy of its
    /// stream is then taken as new). A requester's op ids in flight span at most its
    /// `max_outstanding_ops`, so an honest peer with `max_outstanding_ops` at most this
    /// value never meets the bound; it limits the memory a peer's scattered op ids can take
    /// (tens of bytes per id).
    /// Default 65 536.
    pub max_tracked_ops: u32,
    /// Most immediates of WRITEs with immediate a responder holds back (the WRITE_WITH_IMM
    /// fence, see docs/PROTOCOL.md "RDMA WRITE"): the immediate of op id *k* is reported
    /// only when every op id before *k* of the connection is finished (executed, refused
    /// or aborted), so a WRITE with immediate whose data has landed waits while an earlier
    /// WRITE is still incomplete. With this many held, the packet that would complete
    /// another such WRITE is dropped unacknowledged (not placed; the requester re-sends it,
    /// as for a full receive window); the WRITE at the floor of finished op ids is always
    /// taken, so the oldest operation always finishes. Each held immediate takes tens of
    /// bytes. Default 4096; 0 holds none (every WRITE with immediate then completes only
    /// once it is the oldest unfinished operation).
    pub max_held_immediates: u32,
    /// With `explicit_consume`: most WRITE-with-immediate notifications
    /// ([`Event::WriteWithImm`](crate::Event::WriteWithImm)) the application has been
    /// given and not yet consumed ([`Endpoint::immediates_consumed`](crate::Endpoint::immediates_consumed)),
    /// held and released ones included. When that many are outstanding, the packet that
    /// would complete another WRITE with immediate gets a flow-control RNR NAK before it
    /// is placed (IBA: a WRITE with immediate consumes a receive, and finds none), so the
    /// requester waits an RNR timer and re-sends it, without limit and without failing;
    /// its earlier packets land, and its immediate is reported once there is room. The
    /// oldest unfinished operation is checked against the consumed count only (so
    /// immediates held behind it cannot block it), which lets at most
    /// `max_unconsumed_immediates + min(max_unconsumed_immediates, max_held_immediates)`
    /// notifications be outstanding. Default 4096 (8 bytes each in `metaroce-tokio`'s
    /// queue: 32 KiB); at least 1. Without `explicit_consume` it is not enforced.
    pub max_unconsumed_immediates: u32,
    /// How many times a SEND refused with RNR NAK (no receive posted) is retried before it
    /// completes with `RnrRetryExceeded`; 7 means forever (IBA `rnr_retry`). Default 7.
    pub rnr_retry: u8,
    /// RNR timer code this endpoint puts in its RNR NAKs: how long the sender waits before
    /// retrying (IBA `min_rnr_timer`, RoCEv2 reference §3.1: 12 = 0.64 ms). Default 12.
    pub min_rnr_timer: u8,
    /// Every stream requires receives posted with `post_recv`: a SEND finding none is
    /// refused with an RNR NAK. When `false` (the default), a stream uses posted receives
    /// only once the application has posted one on it, and library-owned buffers otherwise.
    pub require_posted_receives: bool,
    /// Rate this endpoint grants each sender, returned in every ACK (MetaRoCE receiver
    /// rate hint), in Mbit/s; 0 means no limit. Used when `recv_capacity_mbps` is 0.
    /// ACKs carry it in 24 bits: above 16,777,215 (about 16.8 Tbit/s) it is sent as that.
    /// Default 0.
    pub advertised_rate_mbps: u32,
    /// Receiver-driven fair share: this endpoint's inbound capacity in Mbit/s. When non-zero,
    /// every ACK grants its sender `recv_capacity_mbps / n`, where n is the number of
    /// connections that delivered data or were established within the last
    /// `fair_share_window` (plus the active senders of the endpoints sharing the capacity,
    /// `Endpoint::set_other_shard_senders`: the other shards of a sharded host), and the handshake (Request / Accept) carries the same grant;
    /// senders cap their connection window to the grant × their minimum RTT (see
    /// `conn::cc::connection_window`), their blind first window included. So an incast
    /// whose senders the receiver knows, or which opens new connections, settles in one or
    /// two round trips; senders on connections idle for longer than `fair_share_window`
    /// are learned only from their first data (docs/RESULTS.md, "Simulator experiments",
    /// (a)). 0 disables it. Default 0.
    pub recv_capacity_mbps: u32,
    /// How recently a connection must have delivered data, or have been established, to
    /// count as an active sender for the fair share (so an idle new connection takes a
    /// share for at most this long). Default 1 ms.
    pub fair_share_window: Duration,
    /// Bytes of receive socket buffer that the datagrams of every connection of this
    /// endpoint share (Linux: `SO_RCVBUF` as `getsockopt` reports it, the kernel's limit on
    /// queued skb truesize). When non-zero, every ACK grants its sender a window
    /// ([`AckEth::window_grant`](crate::wire::AckEth::window_grant)) of half of it divided
    /// by the active senders (counted as for `recv_capacity_mbps`, over
    /// `fair_share_window`, this endpoint's own connections only: each shard of a sharded
    /// host has its own socket), in whole packets of the connection's path MTU, at least
    /// 8 packets and at most 2,040. Senders cap their connection window to it. Half,
    /// because a datagram costs the buffer more than its payload (a 4 KiB datagram is
    /// charged about 8 KiB of skb). So the senders together have about as much in flight
    /// as the receiver's socket holds, whether or not its host runs it at the time: what
    /// TCP does with its receive window (RFC 9293 §3.8.6), for the one buffer all
    /// connections share. About: a new connection's blind first window
    /// (`initial_connection_window`), the 8-packet floor times many senders and tail-loss
    /// probes may go beyond it, and a sender keeps its last grant until its next ACK. The
    /// count of senders is held for `window_grant_hold`. 0 disables it. Default 0;
    /// `metaroce-tokio` sets it from its socket.
    pub socket_recv_buffer: u64,
    /// How long the window grant stays divided among the most active senders counted: the
    /// count may fall at once (a receiver that read nothing for longer than
    /// `fair_share_window`, because its host did not run it, counts no sender at all), but
    /// the grant grows back only after the smaller count has lasted this long. Else the
    /// first sender heard after such a gap would be granted the whole buffer, the next
    /// half of it, and so on, until their next ACKs. Default 20 ms.
    pub window_grant_hold: Duration,
    /// Planes of a multi-plane fabric this endpoint is attached to, 1..=8 (MetaRoCE "paths
    /// grouped by plane"). The plane of a local UDP source port is `port mod planes`: a
    /// deployment makes that true by sending each source port through the matching local
    /// interface or source address (one NIC port per plane; e.g. a driver that picks the
    /// interface by source port, or one IP address per plane with source ports allocated so
    /// that `port mod planes` is the plane's index; the simulator's
    /// `UplinkPolicy::SourcePort` does exactly this). With more than one plane, a
    /// connection spreads its paths evenly over the planes, tells the peer each path's plane
    /// (PathEth byte 8, bits 2:0) so that ACKs come back on the same plane, re-rolls a failed
    /// path onto a healthy plane, treats a plane whose paths all timed out as down (its
    /// paths move to the other planes at once), and probes a down plane again every
    /// `plane_retry_interval`. 1 (the default) disables all of this.
    pub planes: u16,
    /// How long a plane found down is avoided before one path is moved back onto it to
    /// probe it (and, if that path makes progress, the paths are spread over all planes
    /// again). Default 10 ms.
    pub plane_retry_interval: Duration,
    /// Congestion control parameters.
    pub congestion: CongestionConfig,
    /// Optional AES-GCM packet protection ([`crate::crypto`], in the spirit of PSP): with a
    /// key, every connection asks for (client) or requires (server) protection in its
    /// handshake (`ConnectEth` flags bit 0), and a peer that does not agree is rejected
    /// (reason [`REJECT_PROTECTION_MISMATCH`](crate::conn::REJECT_PROTECTION_MISMATCH)):
    /// there is no silent downgrade. Both ends must hold the same key. Default `None`.
    pub packet_protection: Option<crate::crypto::ProtectionConfig>,
}

impl Default for TransportConfig {
    fn default() -> Self {
        Self {
            paths: 8,
            pmtu: 4096,
            max_message_size: 1 << 31,
            max_recv_buffer_bytes: 256 << 20,
            explicit_consume: false,
            max_stream_recv_bytes: 16 << 20,
            max_stream_window: 1024,
            max_streams: 65_536,
            max_outstanding_ops: 65_536,
            handshake_interval: Duration::from_millis(100),
            handshake_attempts: 20,
            retry_count: 12,
            path_reroll_timeouts: 3,
            path_reroll_on_first_timeout: false,
            hold_silent_rto: true,
            ask_idle_path: true,
            unmeasured_rto_holds: 2,
            path_reroll_resets_backoff: false,
            rebalance_ratio_permille: 750,
            rebalance_interval_rtts: 4,
            rebalance_min_packets: 64,
            rebalance_rounds: 2,
            rebalance_max_rerolls: 32,
            initial_rtt: Duration::from_micros(500),
            min_rto: Duration::from_millis(1),
            max_rto: Duration::from_secs(1),
            reorder_threshold: 0,
            max_gso_segments: 1,
            max_ack_bundle: 8,
            max_ack_delay: Duration::from_micros(100),
            verify_icrc: true,
            idle_timeout: Some(Duration::from_secs(10)),
            keepalive_interval: Some(Duration::from_secs(3)),
            close_timeout: Duration::from_secs(2),
            close_attempts: 5,
            advertised_rate_mbps: 0,
            recv_capacity_mbps: 0,
            fair_share_window: Duration::from_millis(1),
            socket_recv_buffer: 0,
            window_grant_hold: Duration::from_millis(20),
            max_rd_atomic: 16,
            max_tracked_ops: 65_536,
            max_held_immediates: 4096,
            max_unconsumed_immediates: 4096,
            rnr_retry: 7,
            min_rnr_timer: 12,
            require_posted_receives: false,
            planes: 1,
            plane_retry_interval: Duration::from_millis(10),
            congestion: CongestionConfig::default(),
            packet_protection: None,
        }
    }
}

impl TransportConfig {
    /// The keepalive interval in force: `keepalive_interval`, or `idle_timeout / 3` if that
    /// is not shorter than the idle timeout.
    pub fn effective_keepalive(&self) -> Option<Duration> {
        let k = self.keepalive_interval?;
        match self.idle_timeout {
            Some(i) if k >= i => Some((i / 3).max(Duration::from_micros(1))),
            _ => Some(k),
        }
    }

    /// Check the values.
    ///
    /// # Errors
    /// The first [`ConfigError`] found: the field (nested ones as `congestion.max_window`,
    /// `packet_protection.replay_window`) and the rule it breaks.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.paths == 0 || self.paths > 256 {
            return bad("paths", format!("must be in 1..=256, got {}", self.paths));
        }
        if !(256..=4096).contains(&self.pmtu) || !self.pmtu.is_power_of_two() {
            return bad(
                "pmtu",
                format!("must be 256, 512, 1024, 2048 or 4096, got {}", self.pmtu),
            );
        }
        if self.max_message_size == 0 || self.max_message_size > 1 << 31 {
            return bad(
                "max_message_size",
                format!("must be in 1..=2^31 bytes, got {}", self.max_message_size),
            );
        }
        if self.max_gso_segments == 0 {
            return bad("max_gso_segments", "must be at least 1");
        }
        if !(1..=28).contains(&self.max_ack_bundle) {
            return bad(
                "max_ack_bundle",
                format!("must be in 1..=28 paths, got {}", self.max_ack_bundle),
            );
        }
        if self.max_ack_delay > Duration::from_millis(10) {
            return bad(
                "max_ack_delay",
                format!("must be at most 10 ms, got {:?}", self.max_ack_delay),
            );
        }
        if self.max_rto.is_zero() {
            return bad(
                "max_rto",
                "must be positive (a zero RTO re-arms a loss timer at the time it fired)",
            );
        }
        if self.min_rto > self.max_rto {
            return bad(
                "min_rto",
                format!(
                    "must not exceed max_rto, got {:?} > {:?}",
                    self.min_rto, self.max_rto
                ),
            );
        }
        if self.max_rd_atomic == 0 {
            return bad("max_rd_atomic", "must be at least 1");
        }
        if self.max_tracked_ops == 0 {
            return bad("max_tracked_ops", "must be at least 1");
        }
        if self.max_unconsumed_immediates == 0 {
            return bad("max_unconsumed_immediates", "must be at least 1");
        }
        if self.rnr_retry > 7 {
            return bad(
                "rnr_retry",
                format!("must be in 0..=7 (7 = forever), got {}", self.rnr_retry),
            );
        }
        if self.min_rnr_timer > 31 {
            return bad(
                "min_rnr_timer",
                format!(
                    "must be an IBA RNR timer code in 0..=31, got {}",
                    self.min_rnr_timer
                ),
            );
        }
        if !(1..=8).contains(&self.planes) {
            return bad("planes", format!("must be in 1..=8, got {}", self.planes));
        }
        if self.max_stream_recv_bytes == 0 {
            return bad("max_stream_recv_bytes", "must be at least 1");
        }
        if self.max_recv_buffer_bytes == 0 {
            return bad("max_recv_buffer_bytes", "must be at least 1");
        }
        if self.close_attempts == 0 {
            return bad("close_attempts", "must be at least 1");
        }
        if self.idle_timeout.is_some_and(|t| t.is_zero()) {
            // Every connection would time out before its handshake completed (found by a
            // new user's trial: accepted, and then nothing could connect).
            return bad(
                "idle_timeout",
                "must not be zero (use None for no idle timeout)",
            );
        }
        if self.keepalive_interval.is_some_and(|k| k.is_zero()) {
            return bad(
                "keepalive_interval",
                "must not be zero (use None for no keepalive)",
            );
        }
        if self.handshake_attempts == 0 {
            return bad("handshake_attempts", "must be at least 1");
        }
        if self.rebalance_ratio_permille > 1000 {
            return bad(
                "rebalance_ratio_permille",
                format!("must be in 0..=1000, got {}", self.rebalance_ratio_permille),
            );
        }
        if let Some(p) = &self.packet_protection {
            p.validate()?;
        }
        self.congestion.validate()
    }
}

/// Parameters of the default congestion controller: ECN- and delay-driven AIMD with a
/// window per path and a cap per connection (MetaRoCE §"congestion control from both
/// sides"), capped further by the receiver's rate hint.
#[derive(Debug, Clone)]
pub struct CongestionConfig {
    /// Which controller runs on each path. Default [`CongestionAlgorithm::Aimd`].
    pub algorithm: CongestionAlgorithm,
    /// Initial window of each path, in packets. Default 32.
    pub initial_window: u32,
    /// Smallest window of a path, in packets. Default 2.
    pub min_window: u32,
    /// Largest window of a path, in packets; at most 255 so that a path's packets in
    /// flight always fit the 256-packet SACK bitmap. Default 255.
    pub max_window: u32,
    /// Largest window of the whole connection (sum over paths), in packets. Default 1024
    /// (4 MiB at a 4096-byte path MTU: about a Linux socket buffer, so a burst does not
    /// overflow the receiver's socket).
    pub max_connection_window: u32,
    /// Largest window of the whole connection (sum over paths), in packets, until the
    /// first ACK arrives: the blind first round trip of a new connection, before any RTT
    /// sample, congestion signal or receiver grant exists. An N-to-1 incast puts
    /// N × this into the receiver's port queue before anyone can react, so it should be
    /// about one bandwidth-delay product of a single link (32 × 4 KiB = 128 KiB is
    /// 100 Gbit/s × 10 µs). After the first ACK the per-path windows, `max_connection_window`
    /// and the receiver's grant apply. Default 32.
    pub initial_connection_window: u32,
    /// Additive increase, in packets per round trip per path. Default 2.0.
    pub additive_increase: f64,
    /// Multiplicative decrease applied once per round trip when ACKs echo CE marks:
    /// `window *= 1 - ecn_beta * marked_fraction` (DCTCP-style). Default 0.5.
    pub ecn_beta: f64,
    /// Multiplicative factor applied once per round trip on loss. Default 0.8.
    pub loss_beta: f64,
    /// Queueing delay above the path's minimum RTT that counts as congestion; `None`
    /// disables the delay signal. Default 2 ms: well above scheduling noise, well below
    /// the delay of a full socket buffer or switch queue.
    pub delay_target: Option<Duration>,
    /// Multiplicative factor applied once per round trip when the delay target is exceeded.
    /// Default 0.9.
    pub delay_beta: f64,
}

/// The congestion controllers behind [`CongestionController`](crate::conn::cc::CongestionController),
/// selectable per endpoint so they can be compared on the same network.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum CongestionAlgorithm {
    /// The MetaRoCE default: ECN- and delay-driven AIMD ([`Aimd`](crate::conn::cc::Aimd)),
    /// using the fields of [`CongestionConfig`].
    Aimd,
    /// Swift-like delay targeting ([`Swift`](crate::conn::cc::Swift), Kumar et al.,
    /// SIGCOMM 2020): additive increase below `target`, a decrease proportional to the
    /// excess delay above it (at most `max_decrease` per RTT).
    Swift {
        /// Target RTT (base RTT plus allowed queueing).
        target: std::time::Duration,
        /// Additive increase in packets per RTT.
        additive_increase: f64,
        /// Scale of the delay-proportional decrease.
        beta: f64,
        /// Largest multiplicative decrease per RTT (0..1).
        max_decrease: f64,
    },
    /// DCQCN (Zhu et al., SIGCOMM 2015), rate-based: CE echoes act as CNPs (at most one per
    /// `cnp_interval`), cutting the rate by `alpha/2`; fast recovery, additive and hyper
    /// increase every `rate_timer`. The rate is turned into a window as rate × SRTT.
    Dcqcn {
        /// Line rate and initial rate, in Mbit/s.
        line_rate_mbps: u32,
        /// Additive increase step R_AI, in Mbit/s.
        rate_ai_mbps: u32,
        /// Hyper increase step R_HAI, in Mbit/s.
        rate_hai_mbps: u32,
        /// Alpha gain g (DCQCN default 1/256).
        g: f64,
        /// Minimum time between two rate cuts (CNP interval), DCQCN default 50 µs.
        cnp_interval: std::time::Duration,
        /// Rate increase timer, DCQCN default 55 µs.
        rate_timer: std::time::Duration,
    },
}

impl CongestionAlgorithm {
    /// Swift with parameters suited to a datacenter fabric: 50 µs target, 1 packet per RTT,
    /// beta 0.8, at most halving per RTT.
    pub fn swift_default() -> Self {
        CongestionAlgorithm::Swift {
            target: std::time::Duration::from_micros(50),
            additive_increase: 1.0,
            beta: 0.8,
            max_decrease: 0.5,
        }
    }

    /// DCQCN with the paper's defaults on a 100 Gbit/s line.
    pub fn dcqcn_default() -> Self {
        CongestionAlgorithm::Dcqcn {
            line_rate_mbps: 100_000,
            rate_ai_mbps: 40,
            rate_hai_mbps: 100,
            g: 1.0 / 256.0,
            cnp_interval: std::time::Duration::from_micros(50),
            rate_timer: std::time::Duration::from_micros(55),
        }
    }
}

impl Default for CongestionConfig {
    fn default() -> Self {
        Self {
            algorithm: CongestionAlgorithm::Aimd,
            initial_window: 32,
            min_window: 2,
            max_window: 255,
            max_connection_window: 1024,
            initial_connection_window: 32,
            additive_increase: 2.0,
            ecn_beta: 0.5,
            loss_beta: 0.8,
            delay_target: Some(Duration::from_millis(2)),
            delay_beta: 0.9,
        }
    }
}

impl CongestionConfig {
    /// Check the values.
    ///
    /// # Errors
    /// The first [`ConfigError`] found; fields are named as seen from
    /// [`TransportConfig`] (`congestion.max_window`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.min_window == 0 || self.min_window > self.max_window {
            return bad(
                "congestion.min_window",
                format!(
                    "must be in 1..=max_window ({}), got {}",
                    self.max_window, self.min_window
                ),
            );
        }
        if self.max_window > 255 {
            return bad(
                "congestion.max_window",
                format!("must be at most 255 packets, got {}", self.max_window),
            );
        }
        if self.initial_connection_window == 0 {
            return bad("congestion.initial_connection_window", "must be at least 1");
        }
        if !(self.min_window..=self.max_window).contains(&self.initial_window) {
            return bad(
                "congestion.initial_window",
                format!(
                    "must be in min_window..=max_window ({}..={}), got {}",
                    self.min_window, self.max_window, self.initial_window
                ),
            );
        }
        for (name, v) in [
            ("congestion.ecn_beta", self.ecn_beta),
            ("congestion.loss_beta", self.loss_beta),
            ("congestion.delay_beta", self.delay_beta),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return bad(name, format!("must be in 0..=1, got {v}"));
            }
        }
        if self.additive_increase.is_nan() || self.additive_increase <= 0.0 {
            return bad(
                "congestion.additive_increase",
                format!("must be positive, got {}", self.additive_increase),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each check names its field and states the rule with the value found.
    #[test]
    fn validate_names_the_field_and_the_rule() {
        let base = TransportConfig::default();
        assert_eq!(base.validate(), Ok(()));
        type Case = (fn(&mut TransportConfig), &'static str, &'static str);
        let cases: [Case; 10] = [
            (|t| t.paths = 0, "paths", "must be in 1..=256, got 0"),
            (
                |t| t.idle_timeout = Some(Duration::ZERO),
                "idle_timeout",
                "must not be zero (use None for no idle timeout)",
            ),
            (
                |t| {
                    t.min_rto = Duration::ZERO;
                    t.max_rto = Duration::ZERO;
                },
                "max_rto",
                "must be positive (a zero RTO re-arms a loss timer at the time it fired)",
            ),
            (
                |t| t.pmtu = 1000,
                "pmtu",
                "must be 256, 512, 1024, 2048 or 4096, got 1000",
            ),
            (
                |t| t.rnr_retry = 9,
                "rnr_retry",
                "must be in 0..=7 (7 = forever), got 9",
            ),
            (
                |t| t.min_rnr_timer = 40,
                "min_rnr_timer",
                "must be an IBA RNR timer code in 0..=31, got 40",
            ),
            (
                |t| t.max_recv_buffer_bytes = 0,
                "max_recv_buffer_bytes",
                "must be at least 1",
            ),
            (
                |t| t.max_unconsumed_immediates = 0,
                "max_unconsumed_immediates",
                "must be at least 1",
            ),
            (
                |t| t.congestion.max_window = 300,
                "congestion.max_window",
                "must be at most 255 packets, got 300",
            ),
            (
                |t| t.congestion.loss_beta = 1.5,
                "congestion.loss_beta",
                "must be in 0..=1, got 1.5",
            ),
        ];
        for (set, field, rule) in cases {
            let mut t = base.clone();
            set(&mut t);
            let e = t.validate().unwrap_err();
            assert_eq!((e.field(), e.rule()), (field, rule));
            assert_eq!(e.to_string(), format!("{field} {rule}"));
        }
    }
}
