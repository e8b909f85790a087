//! A deterministic discrete-event network simulator that drives real [`Endpoint`]s.
//!
//! Enabled by the `sim` cargo feature. A [`Sim`] holds **hosts** (each runs one
//! [`Endpoint`] listening on `ip:4791`), **switches** and **links**, a virtual clock, a
//! seeded RNG and an event queue. Packets are the endpoints' real datagrams: the simulator
//! serializes them onto links, queues them, marks, drops, corrupts, duplicates and reorders
//! them, routes them through switches with ECMP, and hands them to the destination endpoint
//! with [`Endpoint::handle_datagram`]. Everything is a function of the seed and of what the
//! caller does, so a run can be repeated exactly (the same seed gives the same trace).
//!
//! ```
//! use metaroce::sim::{LinkConfig, Sim, SimConfig, GBPS};
//! use metaroce::{Access, WriteRequest};
//! use std::time::Duration;
//!
//! let mut sim = Sim::new(SimConfig::default());
//! let switch = sim.add_switch();
//! let link = LinkConfig::new(100 * GBPS, Duration::from_micros(1));
//! let (a, b) = (sim.add_host(), sim.add_host());
//! sim.connect(a, switch, link.clone());
//! sim.connect(b, switch, link);
//!
//! let (conn, _) = sim.connect_and_wait(a, b, Duration::from_millis(10)).unwrap();
//! let src = sim.endpoint_mut(a).register_mr(vec![7; 65536], Access::LOCAL_WRITE);
//! let dst = sim
//!     .endpoint_mut(b)
//!     .register_mr(vec![0; 65536], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
//! let write = WriteRequest {
//!     wr_id: 1, lkey: src.lkey, local_offset: 0, len: 65536,
//!     remote_addr: dst.addr, rkey: dst.rkey, imm: None,
//! };
//! sim.endpoint_mut(a).post_write(conn, write).unwrap();
//! sim.run_while(|s| s.host_stats(a).completions == 0);
//! assert!(sim.endpoint(b).mr_read(dst.lkey, 0, 65536).unwrap().iter().all(|&x| x == 7));
//! println!("done after {:?}", sim.elapsed());
//! ```
//!
//! ## Time
//!
//! The clock starts at an [`Instant`] captured once by [`Sim::new`] ([`Sim::start`]) and
//! advances only through events; internally it counts picoseconds, so serialization at
//! 100 Gbit/s and above is exact. The endpoints see `start + elapsed` truncated to whole
//! nanoseconds. The core only uses differences of instants, so runs are deterministic.
//! Times given to and reported by the simulator ([`Sim::elapsed`], [`Sim::run_until`],
//! [`Sim::schedule`], [`HostEvent::time`], [`TraceEvent::time`]) are [`Duration`]s since
//! the start.
//!
//! ## Driving the endpoints
//!
//! The simulator follows the core's driving contract: after every datagram it delivers,
//! every timer it fires and every application call made through [`Sim::endpoint_mut`] or
//! [`Sim::connect_endpoints`], it takes transmits from [`Endpoint::poll_transmit`]
//! (splitting GSO batches by `segment_size`; a transmit's ECN codepoint goes into each
//! packet) and puts the packets on the host's uplink, drains [`Endpoint::poll_event`] into
//! the host's event queue (or passes the events to the handler set with
//! [`Sim::set_event_handler`]) and schedules [`Endpoint::handle_timeout`] for the time
//! [`Endpoint::poll_timeout`] asks for.
//!
//! RC queue pairs of the endpoint ([`Endpoint::rc`], RoCEv2 mode) connected with
//! [`crate::rocev2::RcWire::Native`] are driven the same way: after the datagrams the host
//! takes their packets from [`Endpoint::poll_rc_transmit`] (from the QP's own UDP source
//! port, so ECMP and the uplink choice pin a QP to one route and one plane) and delivers
//! them with [`Endpoint::handle_ip_packet`] as whole IPv4 packets rebuilt from the
//! addresses, ports, ECN field (CE if a switch marked it) and the IPv4 ID the sender's ICRC
//! covers, so the receiver verifies the ICRC as over a raw-IP socket. See
//! [`collective::Transport::Rc`].
//!
//! Like a real driver, a host applies backpressure: it takes transmits only while its NIC
//! queue (the uplink's queue) holds less than [`SimConfig::nic_queue_bytes`], and comes
//! back for more when the queue has drained to half of that, so the transport's packets
//! wait in the transport rather than in front of the wire. Received datagrams are handed
//! over one by one as they arrive, or in batches with [`SimConfig::rx_coalesce`].
//!
//! Application work is posted between steps: `sim.endpoint_mut(host)` returns the
//! endpoint and marks the host for servicing before the next event. Run the simulation with
//! [`Sim::step`], [`Sim::run_until`], [`Sim::run_for`] or [`Sim::run_while`].
//!
//! ## Network model
//!
//! * **Links** are unidirectional and created in pairs by [`Sim::connect`]. Each has a rate,
//!   a propagation delay, a FIFO queue with a tail-drop limit and an ECN marking threshold
//!   (at switch egress ports; a host's NIC queue never drops or marks), and impairments:
//!   random and Gilbert–Elliott loss, duplication, reordering, corruption, blackholing; and
//!   it can be taken down and up at scheduled times ([`Action`]). See [`LinkConfig`].
//!   A packet of `len` UDP payload bytes occupies a link for
//!   `8 · (len + wire_overhead_bytes) / rate` after the packets queued ahead of it.
//! * **Switches** forward by destination IP along shortest paths (fewest hops), computed
//!   when the topology is first run. Among equal-cost next hops a switch picks by a hash of
//!   the UDP 5-tuple (source IP, destination IP, source port, destination port, protocol 17)
//!   salted per switch, so each source port — each MetaRoCE path — follows one route, and
//!   `n` paths cover on average `k·(1 − (1 − 1/k)^n)` of `k` next hops. Use [`Sim::route`]
//!   to see where a given 5-tuple goes.
//! * **Failures**: routes are not recomputed by themselves. A packet routed to a link that
//!   is down is dropped ([`DropReason::LinkDown`]), which is the failure a multipath
//!   transport has to survive; schedule [`Action::RecomputeRoutes`] to model routing
//!   convergence (routes then avoid links that are down; blackholed links still look up).
//! * **Hosts** do not forward. A host with several uplinks (multi-plane) picks one per packet
//!   by [`SimConfig::uplink_policy`]: by default `hash(5-tuple) % uplinks`, so different
//!   source ports spread over the planes.
//!
//! ## Observing
//!
//! [`Sim::link_stats`] (packets, bytes, drops by reason, CE marks, maximum and
//! time-averaged queue), [`Sim::host_stats`] (bytes delivered, completions, messages),
//! [`Sim::stats`] (events processed), [`Endpoint::connection_stats`] (retransmissions, per
//! path counters) through [`Sim::endpoint`], and a packet-level trace hook
//! ([`Sim::set_trace`]). Flow completion times: note [`Sim::elapsed`] when posting an
//! operation; its [`Event::Completion`] arrives in a [`HostEvent`] stamped with the time.
//!
//! ## Cost
//!
//! One event per packet per hop (plus one per packet per hop while a trace hook is set), a
//! binary heap ordered by (time, sequence number), packet buffers recycled through a slab
//! (a single-datagram transmit is moved into the packet, not copied): the simulator
//! allocates nothing per event in steady state, and its work per event does not depend on
//! the number of hosts. The endpoint's own work per call — `poll_transmit`,
//! `poll_timeout`, `handle_timeout` — is logarithmic in its number of connections (see
//! [`Endpoint`]), so thousands of concurrent connections simulate at about the speed of a
//! few; [`SimConfig::rx_coalesce`] trades receive latency for fewer calls.

pub mod collective;
mod link;
mod routing;
mod topology;
mod trace;

pub use link::{DropStats, GilbertElliott, Impairments, LinkConfig, LinkStats, GBPS};
pub use topology::{FatTree, LeafSpine, MultiPlane, Plane, PlaneShape};
pub use trace::{DropReason, Flow, Location, TraceEvent, TraceKind};

use crate::{ConnectionHandle, EcnCodepoint, Endpoint, EndpointConfig, Event, PostError, WcStatus};
use link::{chance, Link};
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use routing::{flow_hash, mix64, pick, RouteTable};
use std::cmp::Ordering;
use std::collections::{BTreeSet, BinaryHeap, HashMap, VecDeque};
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::{Duration, Instant};

pub(crate) const PS_PER_SEC: u64 = 1_000_000_000_000;
const PS_PER_NS: u64 = 1_000;

/// UDP port every simulated endpoint listens on (RoCEv2, 4791).
pub const LISTEN_PORT: u16 = crate::wire::ROCEV2_UDP_PORT;

/// First UDP source port of the default endpoint configuration; path `i` uses
/// `SOURCE_PORT_BASE + i`.
pub const SOURCE_PORT_BASE: u16 = 0xC000;

/// A host of a [`Sim`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostId(u32);

/// A switch of a [`Sim`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SwitchId(u32);

/// One direction of a link of a [`Sim`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LinkId(u32);

impl HostId {
    /// Index of the host in creation order (0-based).
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl SwitchId {
    /// Index of the switch in creation order (0-based).
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl LinkId {
    /// Index of the link direction in creation order (0-based).
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// A host or a switch: an end of a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NodeId {
    /// A host.
    Host(HostId),
    /// A switch.
    Switch(SwitchId),
}

impl From<HostId> for NodeId {
    fn from(h: HostId) -> Self {
        NodeId::Host(h)
    }
}

impl From<SwitchId> for NodeId {
    fn from(s: SwitchId) -> Self {
        NodeId::Switch(s)
    }
}

/// The two directions of a link made by [`Sim::connect`]`(a, b, …)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LinkPair {
    /// From `a` to `b`.
    pub forward: LinkId,
    /// From `b` to `a`.
    pub reverse: LinkId,
}

impl LinkPair {
    /// Both directions.
    pub fn both(self) -> [LinkId; 2] {
        [self.forward, self.reverse]
    }
}

/// How a host with several uplinks picks the uplink of a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum UplinkPolicy {
    /// `hash(5-tuple) % uplinks`, salted per host: each source port sticks to one uplink;
    /// `n` paths cover on average `P·(1 − (1 − 1/P)^n)` of `P` planes.
    #[default]
    FlowHash,
    /// `source port % uplinks`: consecutive source ports (paths) go round-robin over the
    /// planes, like a NIC that pins each path to a plane.
    SourcePort,
}

/// Simulation-wide settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    /// Seed of every random decision: per-link impairment RNGs, ECMP salts of switches and
    /// hosts, and the endpoints' seeds. Default 1.
    pub seed: u64,
    /// Bytes a packet occupies on a link beyond its UDP payload, for serialization and
    /// queue accounting: Ethernet header and FCS (18), IPv4 (20), UDP (8), preamble and
    /// inter-frame gap (20). Default 66.
    pub wire_overhead_bytes: u32,
    /// Number of UDP source ports (paths) in the default endpoint configuration:
    /// `SOURCE_PORT_BASE..SOURCE_PORT_BASE + n`. A connection uses
    /// `min(transport.paths, n)` of them. Default 256.
    pub source_ports: u16,
    /// Uplink choice of multi-homed hosts. Default [`UplinkPolicy::FlowHash`].
    pub uplink_policy: UplinkPolicy,
    /// Transmit backpressure of hosts, in wire bytes: a host takes packets from its
    /// endpoint ([`Endpoint::poll_transmit`]) only while one of its uplink queues holds less
    /// than this, and is woken to take more when that queue has drained to half of it —
    /// like a NIC ring or a socket buffer that makes the driver wait. Packets not taken
    /// wait inside the endpoint, where the transport can still reorder, retransmit or pace
    /// them, and are timestamped when they really leave. `None`: take everything at once
    /// (the queue then grows by a whole window at a time). A host with several uplinks takes
    /// packets while any of them has room; a packet hashed to a full one still joins it.
    /// Default 64 KiB.
    pub nic_queue_bytes: Option<u64>,
    /// Receive batching (NIC interrupt moderation, `recvmmsg` batches): datagrams reaching a
    /// host wait until this long after the first of a batch arrived, then are handed to the
    /// endpoint together, followed by one round of transmits, events and timer. Zero (the
    /// default) hands each datagram over when it arrives. A non-zero value adds up to that
    /// much receive latency and saves endpoint work per datagram.
    pub rx_coalesce: Duration,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            seed: 1,
            wire_overhead_bytes: 66,
            source_ports: 256,
            uplink_policy: UplinkPolicy::FlowHash,
            nic_queue_bytes: Some(64 << 10),
            rx_coalesce: Duration::ZERO,
        }
    }
}

impl SimConfig {
    /// The default configuration with another seed.
    pub fn with_seed(seed: u64) -> Self {
        Self {
            seed,
            ..Self::default()
        }
    }
}

/// A change to the network, applied at a scheduled time by [`Sim::schedule`] or at once by
/// [`Sim::apply`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Take the link down: its queue and the packets on its wire are lost, and packets sent
    /// to it are dropped, until [`Action::LinkUp`]. Routes keep using it until
    /// [`Action::RecomputeRoutes`].
    LinkDown(LinkId),
    /// Bring the link up again.
    LinkUp(LinkId),
    /// Turn the link's blackhole on or off ([`Impairments::blackhole`]).
    Blackhole(LinkId, bool),
    /// Recompute every switch's routes over the links that are up (routing convergence).
    RecomputeRoutes,
}

/// An endpoint event, stamped with the simulated time it was reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostEvent {
    /// Time since the start of the simulation.
    pub time: Duration,
    /// The event.
    pub event: Event,
}

/// Counters of one host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostStats {
    /// Datagrams the endpoint sent.
    pub packets_sent: u64,
    /// UDP payload bytes the endpoint sent.
    pub bytes_sent: u64,
    /// Datagrams delivered to the endpoint.
    pub packets_received: u64,
    /// UDP payload bytes delivered to the endpoint.
    pub bytes_received: u64,
    /// Connections this host requested that were established ([`Event::Connected`]).
    pub connected: u64,
    /// Connections accepted ([`Event::Incoming`]).
    pub incoming: u64,
    /// Connections lost ([`Event::ConnectionLost`]).
    pub connections_lost: u64,
    /// Successful work completions (MetaRoCE connections and RC QPs, [`Event::Rc`]).
    pub completions: u64,
    /// Bytes of the successful work completions (`byte_len`).
    pub completed_bytes: u64,
    /// Work completions with an error status.
    pub completion_errors: u64,
    /// Messages received ([`Event::Message`]).
    pub messages: u64,
    /// Bytes of the messages received.
    pub message_bytes: u64,
    /// WRITE-with-immediate notifications ([`Event::WriteWithImm`], and RC receive
    /// completions of opcode `RecvRdmaWithImm`).
    pub writes_with_imm: u64,
}

impl HostStats {
    fn record(&mut self, ev: &Event) {
        match ev {
            Event::Connected(_) => self.connected += 1,
            Event::Incoming(_) => self.incoming += 1,
            Event::ConnectionLost { .. } => self.connections_lost += 1,
            Event::Completion { wc, .. } => {
                if wc.status == WcStatus::Success {
                    self.completions += 1;
                    self.completed_bytes += u64::from(wc.byte_len);
                } else {
                    self.completion_errors += 1;
                }
            }
            Event::Message { data, .. } => {
                self.messages += 1;
                self.message_bytes += data.len() as u64;
            }
            Event::WriteWithImm { .. } => self.writes_with_imm += 1,
            Event::Rc(crate::rocev2::RcEvent::Completion(c)) => {
                if c.status == WcStatus::Success {
                    self.completions += 1;
                    self.completed_bytes += u64::from(c.byte_len);
                    if c.opcode == crate::rocev2::RcOpcode::RecvRdmaWithImm {
                        self.writes_with_imm += 1;
                    }
                } else {
                    self.completion_errors += 1;
                }
            }
            // Events added to the core later are not counted.
            #[allow(unreachable_patterns)]
            _ => {}
        }
    }
}

/// Simulation-wide counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Events processed (packet arrivals, timers, scheduled actions, trace-only dequeues),
    /// including superseded timer events.
    pub events: u64,
    /// Timer events that were superseded by an earlier timer and did nothing.
    pub stale_timers: u64,
    /// Times an endpoint's `handle_timeout` was called.
    pub timeouts: u64,
    /// Datagrams the endpoints sent (duplicates made by links not included).
    pub packets_sent: u64,
    /// Datagrams delivered to endpoints.
    pub packets_delivered: u64,
    /// Packets dropped anywhere, for any reason.
    pub packets_dropped: u64,
    /// Packets dropped for lack of a route (unknown destination IP, unreachable from a
    /// switch, or a host without uplinks).
    pub no_route: u64,
    /// Packets dropped because nothing listens on their destination port.
    pub port_unreachable: u64,
    /// Transmits dropped because their destination is not IPv4.
    pub not_ipv4: u64,
    /// Most packets alive at once (queued, on a wire or being delivered).
    pub max_packets_alive: u64,
    /// Most events pending at once.
    pub max_pending_events: u64,
}

/// What an event handler ([`Sim::set_event_handler`]) gets besides the event.
#[derive(Debug)]
pub struct HostContext<'a> {
    /// The host whose endpoint reported the event.
    pub host: HostId,
    /// Time since the start of the simulation.
    pub time: Duration,
    /// The current instant, for calls into the endpoint.
    pub now: Instant,
    /// The host's endpoint: the handler may post work (it is sent before the simulation
    /// goes on).
    pub endpoint: &'a mut Endpoint,
}

/// Where a link goes, and whether it is up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkInfo {
    /// Sending end.
    pub from: NodeId,
    /// Receiving end.
    pub to: NodeId,
    /// The opposite direction.
    pub reverse: LinkId,
    /// Whether the link is up (see [`Action::LinkDown`]).
    pub up: bool,
}

type EventHandler = Box<dyn FnMut(&mut HostContext<'_>, &Event) -> bool>;
type TraceHook = Box<dyn FnMut(&TraceEvent)>;
type HostConfigHook = Box<dyn FnMut(HostId, &mut EndpointConfig)>;

/// Hasher for IPv4 addresses as `u32` keys (a multiplicative hash: cheap, and the map is
/// never iterated, so its order does not matter).
#[derive(Default)]
struct IpHasher(u64);

impl Hasher for IpHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn write_u32(&mut self, x: u32) {
        self.0 = mix64(u64::from(x));
    }
}

type IpMap = HashMap<u32, u32, BuildHasherDefault<IpHasher>>;

struct Host {
    ip: u32,
    port: u16,
    endpoint: Endpoint,
    uplinks: Vec<LinkId>,
    salt: u64,
    /// Time of the pending timer event, in ps, and its generation.
    timer_at: Option<u64>,
    timer_generation: u32,
    dirty: bool,
    /// A transmit wake-up is scheduled (the NIC queue was full).
    tx_wakeup: bool,
    /// Datagrams waiting for the receive batch to be handed over.
    rx_batch: Vec<u32>,
    events: VecDeque<HostEvent>,
    stats: HostStats,
}

struct Switch {
    salt: u64,
    routes: RouteTable,
}

#[derive(Default)]
struct Packet {
    data: Vec<u8>,
    src_ip: u32,
    dst_ip: u32,
    src_port: u16,
    dst_port: u16,
    dst_host: u32,
    ecn: Option<EcnCodepoint>,
    hash: u64,
    /// A native RoCEv2 packet of an RC QP ([`crate::rocev2::RcWire::Native`]): the IPv4
    /// Identification its ICRC was computed over. It is handed to the destination as a
    /// whole IP packet ([`Endpoint::handle_ip_packet`]) rebuilt from this, the addresses,
    /// the ports and the ECN field. `None`: an ordinary datagram.
    rc_ip_id: Option<u16>,
    /// Generation of the link the packet is on when it was queued.
    generation: u32,
}

impl Packet {
    fn flow(&self) -> Flow {
        Flow {
            src: SocketAddrV4::new(Ipv4Addr::from(self.src_ip), self.src_port),
            dst: SocketAddrV4::new(Ipv4Addr::from(self.dst_ip), self.dst_port),
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum EvKind {
    /// The packet reached the far end of the link.
    Arrive { link: u32, pkt: u32 },
    /// A packet a host sent to itself.
    Local { pkt: u32 },
    /// A host's timer.
    Timer { host: u32, generation: u32 },
    /// A scheduled [`Action`].
    Action(u32),
    /// A host's NIC queue has drained: take more packets from the endpoint.
    TxReady { host: u32 },
    /// Hand a host's receive batch to its endpoint.
    RxFlush { host: u32 },
    /// Trace only: the packet finished serializing onto the link.
    Dequeue { link: u32, pkt: u32 },
}

#[derive(Debug, Clone, Copy)]
struct Ev {
    time: u64,
    seq: u64,
    kind: EvKind,
}

impl PartialEq for Ev {
    fn eq(&self, other: &Self) -> bool {
        self.time == other.time && self.seq == other.seq
    }
}

impl Eq for Ev {}

impl PartialOrd for Ev {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Ev {
    /// Reversed, so that the max-heap pops the earliest event (ties: first scheduled).
    fn cmp(&self, other: &Self) -> Ordering {
        (other.time, other.seq).cmp(&(self.time, self.seq))
    }
}

fn duration_ps(d: Duration) -> u64 {
    u64::try_from(d.as_nanos())
        .unwrap_or(u64::MAX)
        .saturating_mul(PS_PER_NS)
}

/// The simulator: hosts running endpoints, switches, links, a virtual clock and an event
/// queue. See the [module documentation](self).
pub struct Sim {
    cfg: SimConfig,
    start: Instant,
    /// Current time, ps since `start`.
    now: u64,
    seq: u64,
    heap: BinaryHeap<Ev>,
    hosts: Vec<Host>,
    switches: Vec<Switch>,
    links: Vec<Link>,
    ip_to_host: IpMap,
    next_ip: u32,
    packets: Vec<Packet>,
    free_packets: Vec<u32>,
    actions: Vec<Action>,
    dirty: Vec<u32>,
    routes_dirty: bool,
    buf: Vec<u8>,
    /// Scratch buffer for the IP packets of native RoCEv2 deliveries.
    rc_rx_buf: Vec<u8>,
    host_config: Option<HostConfigHook>,
    handler: Option<EventHandler>,
    trace: Option<TraceHook>,
    stats: SimStats,
}

impl fmt::Debug for Sim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sim")
            .field("config", &self.cfg)
            .field("elapsed", &self.elapsed())
            .field("hosts", &self.hosts.len())
            .field("switches", &self.switches.len())
            .field("links", &self.links.len())
            .field("pending_events", &self.heap.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl Sim {
    /// An empty network at time zero.
    pub fn new(cfg: SimConfig) -> Self {
        Self {
            cfg,
            start: Instant::now(),
            now: 0,
            seq: 0,
            heap: BinaryHeap::new(),
            hosts: Vec::new(),
            switches: Vec::new(),
            links: Vec::new(),
            ip_to_host: IpMap::default(),
            next_ip: u32::from(Ipv4Addr::new(10, 0, 0, 1)),
            packets: Vec::new(),
            free_packets: Vec::new(),
            actions: Vec::new(),
            dirty: Vec::new(),
            routes_dirty: true,
            buf: Vec::with_capacity(1 << 16),
            rc_rx_buf: Vec::new(),
            host_config: None,
            handler: None,
            trace: None,
            stats: SimStats::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }

    // ---- building ----

    /// Set a hook that adjusts the endpoint configuration of every host created from now on
    /// by [`add_host`](Self::add_host), [`add_host_at`](Self::add_host_at) and the topology
    /// builders (e.g. `cfg.transport.paths = 4`). It gets the default configuration (see
    /// [`default_endpoint_config`](Self::default_endpoint_config)).
    pub fn set_host_config(&mut self, hook: impl FnMut(HostId, &mut EndpointConfig) + 'static) {
        self.host_config = Some(Box::new(hook));
    }

    /// The endpoint configuration a host with address `ip` and index `host` gets before the
    /// [`set_host_config`](Self::set_host_config) hook: `local_addr = ip:4791`,
    /// [`SimConfig::source_ports`] source ports from [`SOURCE_PORT_BASE`], a seed derived
    /// from the simulation seed and the host index, default transport parameters.
    pub fn default_endpoint_config(&self, host: HostId, ip: Ipv4Addr) -> EndpointConfig {
        let ports = (0..self.cfg.source_ports)
            .map(|i| SOURCE_PORT_BASE.wrapping_add(i))
            .collect();
        let mut cfg = EndpointConfig::new(SocketAddr::new(IpAddr::V4(ip), LISTEN_PORT), ports);
        cfg.seed = mix64(self.cfg.seed ^ 0x656e_6470_6f69_6e74 ^ u64::from(host.0) << 20);
        cfg
    }

    /// Add a host with the next free address (10.0.0.1, 10.0.0.2, …).
    pub fn add_host(&mut self) -> HostId {
        let ip = loop {
            let ip = self.next_ip;
            self.next_ip = self.next_ip.wrapping_add(1);
            if !self.ip_to_host.contains_key(&ip) {
                break ip;
            }
        };
        self.add_host_at(Ipv4Addr::from(ip))
    }

    /// Add a host with address `ip`.
    ///
    /// # Panics
    /// If the address is taken, or the hook makes an invalid configuration.
    pub fn add_host_at(&mut self, ip: Ipv4Addr) -> HostId {
        let id = HostId(self.hosts.len() as u32);
        let mut cfg = self.default_endpoint_config(id, ip);
        if let Some(hook) = self.host_config.as_mut() {
            hook(id, &mut cfg);
        }
        self.add_host_with_config(cfg)
    }

    /// Add a host running an endpoint with exactly this configuration (no hook); its
    /// address is `cfg.local_addr`.
    ///
    /// # Panics
    /// If `local_addr` is not a specified IPv4 address, the address is taken, or the
    /// configuration is invalid.
    pub fn add_host_with_config(&mut self, cfg: EndpointConfig) -> HostId {
        let IpAddr::V4(ip) = cfg.local_addr.ip() else {
            panic!("sim hosts need an IPv4 local_addr, got {}", cfg.local_addr);
        };
        assert!(
            !ip.is_unspecified(),
            "sim hosts need a specified local_addr"
        );
        let ip = u32::from(ip);
        let id = HostId(self.hosts.len() as u32);
        assert!(
            self.ip_to_host.insert(ip, id.0).is_none(),
            "address {} is used by two hosts",
            Ipv4Addr::from(ip)
        );
        let port = cfg.local_addr.port();
        let endpoint = match Endpoint::new(cfg) {
            Ok(e) => e,
            Err(e) => panic!("invalid endpoint configuration: {e}"),
        };
        self.hosts.push(Host {
            ip,
            port,
            endpoint,
            uplinks: Vec::new(),
            salt: mix64(self.cfg.seed ^ 0x686f_7374 ^ (u64::from(id.0) << 32)),
            timer_at: None,
            timer_generation: 0,
            dirty: false,
            tx_wakeup: false,
            rx_batch: Vec::new(),
            events: VecDeque::new(),
            stats: HostStats::default(),
        });
        self.routes_dirty = true;
        id
    }

    /// Add a switch.
    pub fn add_switch(&mut self) -> SwitchId {
        let id = SwitchId(self.switches.len() as u32);
        self.switches.push(Switch {
            salt: mix64(self.cfg.seed.rotate_left(17) ^ 0x7377_6974_6368 ^ u64::from(id.0)),
            routes: RouteTable::default(),
        });
        self.routes_dirty = true;
        id
    }

    /// Connect `a` and `b` with a link in each direction, both configured as `cfg`.
    ///
    /// # Panics
    /// If `a == b`, or a node does not exist.
    pub fn connect(
        &mut self,
        a: impl Into<NodeId>,
        b: impl Into<NodeId>,
        cfg: LinkConfig,
    ) -> LinkPair {
        let reverse = cfg.clone();
        self.connect_asymmetric(a, b, cfg, reverse)
    }

    /// Connect `a` and `b` with a link `a → b` configured as `forward` and a link `b → a`
    /// configured as `reverse`.
    ///
    /// # Panics
    /// If `a == b`, or a node does not exist.
    pub fn connect_asymmetric(
        &mut self,
        a: impl Into<NodeId>,
        b: impl Into<NodeId>,
        forward: LinkConfig,
        reverse: LinkConfig,
    ) -> LinkPair {
        let (a, b) = (a.into(), b.into());
        assert_ne!(a, b, "a link needs two different ends");
        for n in [a, b] {
            let ok = match n {
                NodeId::Host(h) => h.index() < self.hosts.len(),
                NodeId::Switch(s) => s.index() < self.switches.len(),
            };
            assert!(ok, "no such node: {n:?}");
        }
        let f = self.links.len() as u32;
        let r = f + 1;
        for (i, from, to, cfg, rev) in [(f, a, b, forward, r), (r, b, a, reverse, f)] {
            let rng = Xoshiro256PlusPlus::seed_from_u64(
                mix64(self.cfg.seed ^ 0x6c69_6e6b) ^ u64::from(i),
            );
            self.links.push(Link::new(from, to, rev, cfg, rng));
            if let NodeId::Host(h) = from {
                self.hosts[h.index()].uplinks.push(LinkId(i));
            }
        }
        self.routes_dirty = true;
        LinkPair {
            forward: LinkId(f),
            reverse: LinkId(r),
        }
    }

    // ---- inspecting ----

    /// Time since the start of the simulation.
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.now / PS_PER_NS)
    }

    /// The current instant, as the endpoints see it: [`start`](Self::start) plus
    /// [`elapsed`](Self::elapsed).
    pub fn now(&self) -> Instant {
        self.start + self.elapsed()
    }

    /// The instant the simulation started at.
    pub fn start(&self) -> Instant {
        self.start
    }

    /// Every host, in creation order.
    pub fn hosts(&self) -> impl ExactSizeIterator<Item = HostId> + '_ {
        (0..self.hosts.len() as u32).map(HostId)
    }

    /// Every link direction, in creation order.
    pub fn links(&self) -> impl ExactSizeIterator<Item = LinkId> + '_ {
        (0..self.links.len() as u32).map(LinkId)
    }

    /// Number of switches.
    pub fn switch_count(&self) -> usize {
        self.switches.len()
    }

    /// Number of link directions.
    pub fn link_count(&self) -> usize {
        self.links.len()
    }

    /// The IPv4 address of a host.
    pub fn ip(&self, host: HostId) -> Ipv4Addr {
        Ipv4Addr::from(self.hosts[host.index()].ip)
    }

    /// The address a host's endpoint listens on (`ip:4791` by default): what peers connect
    /// to.
    pub fn addr(&self, host: HostId) -> SocketAddr {
        self.hosts[host.index()].endpoint.config().local_addr
    }

    /// The host with this address.
    pub fn host_by_ip(&self, ip: Ipv4Addr) -> Option<HostId> {
        self.ip_to_host.get(&u32::from(ip)).map(|&h| HostId(h))
    }

    /// The links leaving a host, in the order they were connected (uplink `i` of a
    /// multi-plane host goes to plane `i`).
    pub fn uplinks(&self, host: HostId) -> &[LinkId] {
        &self.hosts[host.index()].uplinks
    }

    /// Ends and state of a link.
    pub fn link_info(&self, link: LinkId) -> LinkInfo {
        let l = &self.links[link.index()];
        LinkInfo {
            from: l.from,
            to: l.to,
            reverse: LinkId(l.reverse),
            up: l.up,
        }
    }

    /// A link's configuration.
    pub fn link_config(&self, link: LinkId) -> &LinkConfig {
        &self.links[link.index()].cfg
    }

    /// Change a link's configuration; takes effect for packets entering the link (rate,
    /// queue, ECN, duplication, reordering, blackhole) or arriving over it (loss,
    /// corruption) from now on.
    pub fn link_config_mut(&mut self, link: LinkId) -> &mut LinkConfig {
        &mut self.links[link.index()].cfg
    }

    /// A link's counters, with the queue averaged up to now.
    pub fn link_stats(&self, link: LinkId) -> LinkStats {
        self.links[link.index()].stats_at(self.now)
    }

    /// Wire bytes queued on a link now (including the rest of the packet being serialized).
    pub fn queue_bytes(&self, link: LinkId) -> u64 {
        self.links[link.index()].backlog_bytes(self.now)
    }

    /// A host's counters.
    pub fn host_stats(&self, host: HostId) -> HostStats {
        self.hosts[host.index()].stats
    }

    /// Simulation-wide counters.
    pub fn stats(&self) -> SimStats {
        self.stats
    }

    /// A host's endpoint, to read state and statistics.
    pub fn endpoint(&self, host: HostId) -> &Endpoint {
        &self.hosts[host.index()].endpoint
    }

    /// A host's endpoint, to post work (`connect`, `register_mr`, `post_send`, `post_write`,
    /// `close`, …; pass [`now`](Self::now) where a time is needed). The host is serviced
    /// (its transmits sent, its timer rescheduled) before the next event is processed.
    pub fn endpoint_mut(&mut self, host: HostId) -> &mut Endpoint {
        let h = &mut self.hosts[host.index()];
        if !h.dirty {
            h.dirty = true;
            self.dirty.push(host.0);
        }
        &mut h.endpoint
    }

    /// Events the host's endpoint reported (and the event handler did not consume), oldest
    /// first.
    pub fn events(&self, host: HostId) -> &VecDeque<HostEvent> {
        &self.hosts[host.index()].events
    }

    /// Take the host's queued events, oldest first.
    pub fn drain_events(
        &mut self,
        host: HostId,
    ) -> std::collections::vec_deque::Drain<'_, HostEvent> {
        self.hosts[host.index()].events.drain(..)
    }

    /// Set a handler that sees every endpoint event as it is reported, with the endpoint,
    /// so it can react at once (e.g. post the next operation when one completes). It returns
    /// whether it consumed the event; events it does not consume go to the host's queue
    /// ([`events`](Self::events)).
    pub fn set_event_handler(
        &mut self,
        handler: impl FnMut(&mut HostContext<'_>, &Event) -> bool + 'static,
    ) {
        self.handler = Some(Box::new(handler));
    }

    /// Remove the event handler.
    pub fn clear_event_handler(&mut self) {
        self.handler = None;
    }

    /// Set a hook that receives every packet-level [`TraceEvent`], in time order. While it is
    /// set, each packet also costs a dequeue event per hop; the simulation's outcome does
    /// not depend on whether a hook is set.
    pub fn set_trace(&mut self, hook: impl FnMut(&TraceEvent) + 'static) {
        self.trace = Some(Box::new(hook));
    }

    /// Remove the trace hook.
    pub fn clear_trace(&mut self) {
        self.trace = None;
    }

    // ---- applications ----

    /// Start a connection from host `from` to host `to`'s listening address.
    pub fn connect_endpoints(
        &mut self,
        from: HostId,
        to: HostId,
    ) -> Result<ConnectionHandle, PostError> {
        let now = self.now();
        let addr = self.addr(to);
        self.endpoint_mut(from).connect(now, addr, None)
    }

    /// Connect `from` to `to` and run the simulation until both ends are established, at
    /// most `timeout` of simulated time. Returns (the client's handle at `from`, the
    /// server's handle at `to`), or `None` if the connection could not be made in time.
    /// Other traffic progresses meanwhile.
    pub fn connect_and_wait(
        &mut self,
        from: HostId,
        to: HostId,
        timeout: Duration,
    ) -> Option<(ConnectionHandle, ConnectionHandle)> {
        let before: BTreeSet<ConnectionHandle> = self.endpoint(to).connections().collect();
        let client = self.connect_endpoints(from, to).ok()?;
        let deadline = self.elapsed() + timeout;
        self.run_while(|s| {
            let ep = s.endpoint(from);
            ep.peer_addr(client).is_some() && !ep.is_established(client) && s.elapsed() < deadline
        });
        if !self.endpoint(from).is_established(client) {
            return None;
        }
        let peer = SocketAddr::new(IpAddr::V4(self.ip(from)), self.addr(from).port());
        let ep = self.endpoint(to);
        let server = ep
            .connections()
            .find(|c| !before.contains(c) && ep.peer_addr(*c) == Some(peer))?;
        Some((client, server))
    }

    // ---- running ----

    /// Schedule `action` at `at` (time since the start; a past time means now).
    pub fn schedule(&mut self, at: Duration, action: Action) {
        let idx = self.actions.len() as u32;
        self.actions.push(action);
        let t = duration_ps(at).max(self.now);
        self.push(t, EvKind::Action(idx));
    }

    /// Apply `action` now.
    pub fn apply(&mut self, action: Action) {
        match action {
            Action::LinkDown(l) => {
                let now = self.now;
                let link = &mut self.links[l.index()];
                if link.up {
                    link.up = false;
                    link.flush(now);
                }
            }
            Action::LinkUp(l) => self.links[l.index()].up = true,
            Action::Blackhole(l, on) => self.links[l.index()].cfg.impairments.blackhole = on,
            Action::RecomputeRoutes => self.compute_routes(),
        }
    }

    /// The links a packet with this 5-tuple from `src` to `dst` would take now (ignoring
    /// impairments and whether links are up), or `None` if it would be dropped for lack of
    /// a route. Recomputes routes first if the topology changed.
    pub fn route(
        &mut self,
        src: HostId,
        dst: HostId,
        src_port: u16,
        dst_port: u16,
    ) -> Option<Vec<LinkId>> {
        if self.routes_dirty {
            self.compute_routes();
        }
        let (s, d) = (&self.hosts[src.index()], &self.hosts[dst.index()]);
        let hash = flow_hash(s.ip, d.ip, src_port, dst_port);
        let mut link = self.uplink(src.index(), hash, src_port)?;
        let mut path = vec![link];
        loop {
            match self.links[link.index()].to {
                NodeId::Host(h) => return (h == dst).then_some(path),
                NodeId::Switch(sw) => {
                    let sw = &self.switches[sw.index()];
                    let hops = sw.routes.next_hops(dst.index());
                    if hops.is_empty() || path.len() > self.links.len() {
                        return None;
                    }
                    link = LinkId(hops[pick(hash, sw.salt, hops.len())]);
                    path.push(link);
                }
            }
        }
    }

    /// Process the next event (servicing hosts whose endpoints were touched first). Returns
    /// `false` if there was nothing left to do.
    pub fn step(&mut self) -> bool {
        self.prepare();
        let Some(ev) = self.heap.pop() else {
            return false;
        };
        self.now = self.now.max(ev.time);
        self.stats.events += 1;
        match ev.kind {
            EvKind::Arrive { link, pkt } => self.on_arrive(link, pkt),
            EvKind::Local { pkt } => {
                let dst = self.packets[pkt as usize].dst_host as usize;
                self.hand_over(dst, pkt);
                self.service(dst, self.now);
            }
            EvKind::Timer { host, generation } => self.on_timer(host as usize, generation),
            EvKind::Action(i) => self.apply(self.actions[i as usize]),
            EvKind::TxReady { host } => {
                self.hosts[host as usize].tx_wakeup = false;
                self.service(host as usize, self.now);
            }
            EvKind::RxFlush { host } => self.flush_rx(host as usize),
            EvKind::Dequeue { link, pkt } => self.on_dequeue(link, pkt),
        }
        true
    }

    /// Process every event up to and including time `t` (since the start), then advance the
    /// clock to `t`.
    pub fn run_until(&mut self, t: Duration) {
        let limit = duration_ps(t);
        loop {
            self.prepare();
            match self.heap.peek() {
                Some(ev) if ev.time <= limit => {
                    self.step();
                }
                _ => break,
            }
        }
        self.now = self.now.max(limit);
    }

    /// Run for `d` of simulated time.
    pub fn run_for(&mut self, d: Duration) {
        self.run_until(self.elapsed() + d);
    }

    /// Process events while `cond` holds (it is checked before each event). Returns `true`
    /// when `cond` became false, `false` when the simulation ran out of events first
    /// (everything idle). Bound the simulated time inside `cond`, e.g.
    /// `s.elapsed() < limit && …`.
    pub fn run_while(&mut self, mut cond: impl FnMut(&Sim) -> bool) -> bool {
        loop {
            if !cond(self) {
                return true;
            }
            if !self.step() {
                return !cond(self);
            }
        }
    }

    // ---- internals ----

    #[inline]
    fn push(&mut self, time: u64, kind: EvKind) {
        self.seq += 1;
        self.heap.push(Ev {
            time,
            seq: self.seq,
            kind,
        });
        let n = self.heap.len() as u64;
        if n > self.stats.max_pending_events {
            self.stats.max_pending_events = n;
        }
    }

    fn instant_ps(&self, ps: u64) -> Instant {
        self.start + Duration::from_nanos(ps / PS_PER_NS)
    }

    fn to_ps(&self, t: Instant) -> u64 {
        duration_ps(t.saturating_duration_since(self.start))
    }

    fn prepare(&mut self) {
        if self.routes_dirty {
            self.compute_routes();
        }
        while let Some(h) = self.dirty.pop() {
            self.hosts[h as usize].dirty = false;
            self.service(h as usize, self.now);
        }
    }

    fn compute_routes(&mut self) {
        let tables = routing::compute(self.hosts.len(), self.switches.len(), &self.links);
        for (s, t) in self.switches.iter_mut().zip(tables) {
            s.routes = t;
        }
        self.routes_dirty = false;
    }

    fn alloc_packet(&mut self) -> u32 {
        if let Some(i) = self.free_packets.pop() {
            return i;
        }
        self.packets.push(Packet::default());
        let n = self.packets.len() as u64;
        if n > self.stats.max_packets_alive {
            self.stats.max_packets_alive = n;
        }
        (n - 1) as u32
    }

    fn trace_packet(&mut self, kind: TraceKind, location: Location, pkt: u32, queue_bytes: u64) {
        if let Some(hook) = self.trace.as_mut() {
            let p = &self.packets[pkt as usize];
            let (opcode, psn) = trace::bth_fields(&p.data);
            hook(&TraceEvent {
                time: Duration::from_nanos(self.now / PS_PER_NS),
                kind,
                location,
                len: p.data.len() as u32,
                queue_bytes,
                flow: p.flow(),
                ecn: p.ecn,
                opcode,
                psn,
            });
        }
    }

    fn drop_packet(&mut self, pkt: u32, reason: DropReason, location: Location, queue: u64) {
        self.stats.packets_dropped += 1;
        self.trace_packet(TraceKind::Drop(reason), location, pkt, queue);
        self.free_packets.push(pkt);
    }

    /// Drain a host's endpoint: transmits, events (through the handler, which may post more
    /// work), then its timer, which must not be earlier than `timer_not_before`.
    fn service(&mut self, host: usize, timer_not_before: u64) {
        let now = self.instant_ps(self.now);
        let mut buf = std::mem::take(&mut self.buf);
        loop {
            while self.nic_has_room(host) {
                let Some(t) = self.hosts[host].endpoint.poll_transmit(now, &mut buf) else {
                    break;
                };
                self.inject(host, &t, &mut buf, None);
            }
            // RC QPs (RoCEv2 mode) of the endpoint: native RoCEv2 packets from the QP's own
            // UDP source port. Nothing to do (and no state touched) when it has none.
            while self.nic_has_room(host) {
                let Some(t) = self.hosts[host].endpoint.poll_rc_transmit(now, &mut buf) else {
                    break;
                };
                let ip_id = match t.ip {
                    crate::wire::icrc::IpHeader::V4 { id, .. } => id,
                    crate::wire::icrc::IpHeader::V6 { .. } => 0,
                };
                let t = crate::Transmit {
                    destination: t.destination,
                    src_port: t.src_port,
                    ecn: t.ecn,
                    size: t.size,
                    segment_size: None,
                };
                self.inject(host, &t, &mut buf, Some(ip_id));
            }
            if !self.drain_events_of(host, now) {
                break;
            }
        }
        self.buf = buf;
        if !self.nic_has_room(host) {
            self.schedule_tx_wakeup(host);
        }
        self.arm_timer(host, timer_not_before);
    }

    /// Whether the host may take another transmit from its endpoint (see
    /// [`SimConfig::nic_queue_bytes`]).
    fn nic_has_room(&self, host: usize) -> bool {
        let Some(limit) = self.cfg.nic_queue_bytes else {
            return true;
        };
        let ups = &self.hosts[host].uplinks;
        ups.is_empty()
            || ups
                .iter()
                .any(|l| self.links[l.index()].backlog_bytes(self.now) < limit)
    }

    /// Wake the host when its emptiest uplink queue has drained to half the NIC limit.
    fn schedule_tx_wakeup(&mut self, host: usize) {
        let h = &self.hosts[host];
        if h.tx_wakeup {
            return;
        }
        let half = self.cfg.nic_queue_bytes.unwrap_or(0) / 2;
        let at = h
            .uplinks
            .iter()
            .map(|l| {
                let link = &self.links[l.index()];
                link.busy_until.saturating_sub(link.serialization_ps(half))
            })
            .min()
            .unwrap_or(self.now)
            .max(self.now + 1);
        self.hosts[host].tx_wakeup = true;
        self.push(at, EvKind::TxReady { host: host as u32 });
    }

    /// Queue or hand the host's events to the handler; whether the handler saw any.
    fn drain_events_of(&mut self, host: usize, now: Instant) -> bool {
        let time = Duration::from_nanos(self.now / PS_PER_NS);
        let h = &mut self.hosts[host];
        let mut handled = false;
        while let Some(event) = h.endpoint.poll_event() {
            h.stats.record(&event);
            if let Some(handler) = self.handler.as_mut() {
                handled = true;
                let mut ctx = HostContext {
                    host: HostId(host as u32),
                    time,
                    now,
                    endpoint: &mut h.endpoint,
                };
                if handler(&mut ctx, &event) {
                    continue;
                }
            }
            h.events.push_back(HostEvent { time, event });
        }
        handled
    }

    fn arm_timer(&mut self, host: usize, not_before: u64) {
        let Some(t) = self.hosts[host].endpoint.poll_timeout() else {
            return;
        };
        let at = self.to_ps(t).max(not_before);
        let h = &mut self.hosts[host];
        if h.timer_at.is_some_and(|x| x <= at) {
            return;
        }
        h.timer_at = Some(at);
        h.timer_generation = h.timer_generation.wrapping_add(1);
        let generation = h.timer_generation;
        self.push(
            at,
            EvKind::Timer {
                host: host as u32,
                generation,
            },
        );
    }

    fn on_timer(&mut self, host: usize, generation: u32) {
        let h = &mut self.hosts[host];
        if generation != h.timer_generation || h.timer_at != Some(self.now) {
            self.stats.stale_timers += 1;
            return;
        }
        h.timer_at = None;
        let due = h.endpoint.poll_timeout().map(|t| self.to_ps(t));
        match due {
            Some(d) if d <= self.now => {
                self.stats.timeouts += 1;
                let now = self.instant_ps(self.now);
                self.hosts[host].endpoint.handle_timeout(now);
                // A timer still due right after handle_timeout would spin at this instant;
                // it waits at least a nanosecond.
                self.service(host, self.now + PS_PER_NS);
            }
            _ => self.arm_timer(host, self.now),
        }
    }

    /// The uplink of host `host` for a packet with flow hash `hash` and source port `port`.
    fn uplink(&self, host: usize, hash: u64, port: u16) -> Option<LinkId> {
        let h = &self.hosts[host];
        match h.uplinks.len() {
            0 => None,
            1 => Some(h.uplinks[0]),
            n => Some(match self.cfg.uplink_policy {
                UplinkPolicy::FlowHash => h.uplinks[pick(hash, h.salt, n)],
                UplinkPolicy::SourcePort => h.uplinks[port as usize % n],
            }),
        }
    }

    /// Put the datagrams of transmit `t` (in `buf`) on the host's uplink; `rc_ip_id`: a
    /// native RoCEv2 packet and its IPv4 Identification ([`Packet::rc_ip_id`]).
    fn inject(
        &mut self,
        host: usize,
        t: &crate::Transmit,
        buf: &mut Vec<u8>,
        rc_ip_id: Option<u16>,
    ) {
        let len = t.size.min(buf.len());
        let seg = match t.segment_size {
            Some(s) if s > 0 && s < len => s,
            _ => len,
        };
        if len == 0 {
            return;
        }
        let SocketAddr::V4(dst) = t.destination else {
            let n = len.div_ceil(seg) as u64;
            self.stats.not_ipv4 += n;
            self.stats.packets_dropped += n;
            return;
        };
        let src_ip = self.hosts[host].ip;
        let dst_ip = u32::from(*dst.ip());
        let dst_host = self.ip_to_host.get(&dst_ip).copied();
        let hash = flow_hash(src_ip, dst_ip, t.src_port, dst.port());
        let uplink = self.uplink(host, hash, t.src_port);
        let mut offset = 0;
        while offset < len {
            let n = seg.min(len - offset);
            let pkt = self.alloc_packet();
            let p = &mut self.packets[pkt as usize];
            if n == len && buf.len() == len {
                // A single datagram: hand over the buffer instead of copying it.
                std::mem::swap(&mut p.data, buf);
            } else {
                p.data.clear();
                p.data.extend_from_slice(&buf[offset..offset + n]);
            }
            offset += n;
            p.src_ip = src_ip;
            p.dst_ip = dst_ip;
            p.src_port = t.src_port;
            p.dst_port = dst.port();
            p.ecn = t.ecn;
            p.hash = hash;
            p.rc_ip_id = rc_ip_id;
            p.dst_host = dst_host.unwrap_or(u32::MAX);
            let h = &mut self.hosts[host];
            h.stats.packets_sent += 1;
            h.stats.bytes_sent += n as u64;
            self.stats.packets_sent += 1;
            match (dst_host, uplink) {
                (Some(d), _) if d as usize == host => self.push(self.now, EvKind::Local { pkt }),
                (Some(_), Some(up)) => self.send_on_link(up.0, pkt),
                _ => {
                    self.stats.no_route += 1;
                    let loc = Location::Host(HostId(host as u32));
                    self.drop_packet(pkt, DropReason::NoRoute, loc, 0);
                }
            }
        }
    }

    /// A packet enters link `li`'s queue (or is dropped there).
    fn send_on_link(&mut self, li: u32, pkt: u32) {
        let now = self.now;
        let overhead = u64::from(self.cfg.wire_overhead_bytes);
        let link = &mut self.links[li as usize];
        let p = &mut self.packets[pkt as usize];
        let len = p.data.len() as u64;
        let wire = len + overhead;
        let loc = Location::Link(LinkId(li));
        if !link.up {
            link.stats.drops.link_down += 1;
            return self.drop_packet(pkt, DropReason::LinkDown, loc, 0);
        }
        if link.cfg.impairments.blackhole {
            link.stats.drops.blackhole += 1;
            return self.drop_packet(pkt, DropReason::Blackhole, loc, 0);
        }
        let backlog = link.backlog_bytes(now);
        let mut marked = false;
        if !link.nic {
            if backlog + wire > link.cfg.queue_limit_bytes {
                link.stats.drops.queue_full += 1;
                return self.drop_packet(pkt, DropReason::QueueFull, loc, backlog);
            }
            if let Some(k) = link.cfg.ecn_threshold_bytes {
                if backlog > k && matches!(p.ecn, Some(EcnCodepoint::Ect0 | EcnCodepoint::Ect1)) {
                    p.ecn = Some(EcnCodepoint::Ce);
                    link.stats.ce_marks += 1;
                    marked = true;
                }
            }
        }
        let duplicate = chance(&mut link.rng, link.cfg.impairments.duplicate);
        let reorder = chance(&mut link.rng, link.cfg.impairments.reorder);
        link.integrate(now);
        let done = link
            .busy_until
            .max(now)
            .saturating_add(link.serialization_ps(wire));
        link.busy_until = done;
        let queue = backlog + wire;
        let s = &mut link.stats;
        s.max_queue_bytes = s.max_queue_bytes.max(queue);
        s.packets += 1;
        s.bytes += len;
        s.wire_bytes += wire;
        let mut arrive = done.saturating_add(duration_ps(link.cfg.delay));
        if reorder {
            s.reordered += 1;
            arrive = arrive.saturating_add(duration_ps(link.cfg.impairments.reorder_delay));
        }
        p.generation = link.generation;
        if self.trace.is_some() {
            // Before the arrival, so that it is processed first when both fall together.
            self.push(done, EvKind::Dequeue { link: li, pkt });
            if marked {
                self.trace_packet(TraceKind::Mark, loc, pkt, backlog);
            }
            self.trace_packet(TraceKind::Enqueue, loc, pkt, queue);
        }
        self.push(arrive, EvKind::Arrive { link: li, pkt });
        if duplicate {
            self.links[li as usize].stats.duplicated += 1;
            let copy = self.alloc_packet();
            let (a, b) = if copy > pkt {
                let (x, y) = self.packets.split_at_mut(copy as usize);
                (&x[pkt as usize], &mut y[0])
            } else {
                let (x, y) = self.packets.split_at_mut(pkt as usize);
                (&y[0], &mut x[copy as usize])
            };
            b.data.clear();
            b.data.extend_from_slice(&a.data);
            b.src_ip = a.src_ip;
            b.dst_ip = a.dst_ip;
            b.src_port = a.src_port;
            b.dst_port = a.dst_port;
            b.dst_host = a.dst_host;
            b.ecn = a.ecn;
            b.hash = a.hash;
            b.rc_ip_id = a.rc_ip_id;
            self.trace_packet(TraceKind::Duplicate, loc, pkt, queue);
            self.send_on_link(li, copy);
        }
    }

    fn on_dequeue(&mut self, li: u32, pkt: u32) {
        let link = &self.links[li as usize];
        if self.packets[pkt as usize].generation == link.generation {
            let q = link.backlog_bytes(self.now);
            self.trace_packet(TraceKind::Dequeue, Location::Link(LinkId(li)), pkt, q);
        }
    }

    /// A packet reached the far end of link `li`.
    fn on_arrive(&mut self, li: u32, pkt: u32) {
        let link = &mut self.links[li as usize];
        let p = &mut self.packets[pkt as usize];
        let loc = Location::Link(LinkId(li));
        if !link.up || p.generation != link.generation {
            link.stats.drops.link_down += 1;
            return self.drop_packet(pkt, DropReason::LinkDown, loc, 0);
        }
        let imp = &link.cfg.impairments;
        let (loss, corrupt, burst) = (imp.loss, imp.corrupt, imp.burst);
        if chance(&mut link.rng, loss) {
            link.stats.drops.random_loss += 1;
            return self.drop_packet(pkt, DropReason::RandomLoss, loc, 0);
        }
        if let Some(ge) = burst {
            let p_loss = if link.ge_bad {
                ge.loss_bad
            } else {
                ge.loss_good
            };
            let lost = chance(&mut link.rng, p_loss);
            let p_switch = if link.ge_bad {
                ge.p_bad_to_good
            } else {
                ge.p_good_to_bad
            };
            if chance(&mut link.rng, p_switch) {
                link.ge_bad = !link.ge_bad;
            }
            if lost {
                link.stats.drops.burst_loss += 1;
                return self.drop_packet(pkt, DropReason::BurstLoss, loc, 0);
            }
        }
        if !p.data.is_empty() && chance(&mut link.rng, corrupt) {
            let r = link.rng.next_u64();
            let pos = ((u128::from(r as u32) * p.data.len() as u128) >> 32) as usize;
            p.data[pos] ^= 1 + ((r >> 32) % 255) as u8;
            link.stats.corrupted += 1;
            self.trace_packet(TraceKind::Corrupt, loc, pkt, 0);
        }
        let link = &mut self.links[li as usize];
        link.stats.delivered += 1;
        match link.to {
            NodeId::Host(h) => self.deliver(h.index(), pkt),
            NodeId::Switch(s) => self.forward(s.index(), pkt),
        }
    }

    fn forward(&mut self, sw: usize, pkt: u32) {
        let p = &self.packets[pkt as usize];
        let s = &self.switches[sw];
        let hops = s.routes.next_hops(p.dst_host as usize);
        let link = match hops.len() {
            0 => {
                self.stats.no_route += 1;
                let loc = Location::Switch(SwitchId(sw as u32));
                return self.drop_packet(pkt, DropReason::NoRoute, loc, 0);
            }
            1 => hops[0],
            n => hops[pick(p.hash, s.salt, n)],
        };
        self.send_on_link(link, pkt);
    }

    /// A datagram reached its host: hand it over now, or add it to the receive batch.
    fn deliver(&mut self, host: usize, pkt: u32) {
        if self.cfg.rx_coalesce.is_zero() {
            self.hand_over(host, pkt);
            self.service(host, self.now);
            return;
        }
        let h = &mut self.hosts[host];
        h.rx_batch.push(pkt);
        if h.rx_batch.len() == 1 {
            let at = self.now.saturating_add(duration_ps(self.cfg.rx_coalesce));
            self.push(at, EvKind::RxFlush { host: host as u32 });
        }
    }

    fn flush_rx(&mut self, host: usize) {
        let mut batch = std::mem::take(&mut self.hosts[host].rx_batch);
        for &pkt in &batch {
            self.hand_over(host, pkt);
        }
        batch.clear();
        self.hosts[host].rx_batch = batch;
        self.service(host, self.now);
    }

    /// Give a datagram to the host's endpoint (without servicing the host).
    fn hand_over(&mut self, host: usize, pkt: u32) {
        let now = self.instant_ps(self.now);
        let h = &mut self.hosts[host];
        let p = &self.packets[pkt as usize];
        if p.dst_port != h.port || p.dst_ip != h.ip {
            self.stats.port_unreachable += 1;
            let loc = Location::Host(HostId(host as u32));
            return self.drop_packet(pkt, DropReason::PortUnreachable, loc, 0);
        }
        h.stats.packets_received += 1;
        h.stats.bytes_received += p.data.len() as u64;
        self.stats.packets_delivered += 1;
        self.trace_packet(
            TraceKind::Deliver,
            Location::Host(HostId(host as u32)),
            pkt,
            0,
        );
        let h = &mut self.hosts[host];
        let p = &self.packets[pkt as usize];
        if let Some(id) = p.rc_ip_id {
            // A native RoCEv2 packet: the whole IP packet a raw-IP backend would receive.
            let ip = crate::wire::icrc::IpHeader::V4 {
                src: Ipv4Addr::from(p.src_ip),
                dst: Ipv4Addr::from(p.dst_ip),
                id,
                flags_frag: crate::wire::icrc::IPV4_FLAG_DF,
                ttl: crate::wire::icrc::SYNTH_TTL,
                tos: p.ecn.map_or(0, |e| e as u8),
            };
            let mut raw = std::mem::take(&mut self.rc_rx_buf);
            raw.clear();
            let udp = crate::wire::icrc::udp_header(p.src_port, p.dst_port, p.data.len());
            if let (Ok(udp), Ok(udp_len)) = (udp, u16::try_from(p.data.len() + 8)) {
                raw.resize(ip.header_len(), 0);
                if ip.to_bytes(udp_len, &mut raw).is_ok() {
                    raw.extend_from_slice(&udp);
                    raw.extend_from_slice(&p.data);
                    h.endpoint.handle_ip_packet(now, &raw);
                }
            }
            self.rc_rx_buf = raw;
        } else {
            let from = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(p.src_ip), p.src_port));
            let local = IpAddr::V4(Ipv4Addr::from(p.dst_ip));
            h.endpoint
                .handle_datagram(now, from, Some(local), p.ecn, &p.data);
        }
        self.free_packets.push(pkt);
    }
}
