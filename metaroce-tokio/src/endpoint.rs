//! The async endpoint: binds a datagram backend, runs the driver task, hands out
//! connections and memory regions.

use crate::backend::{DatagramBackend, UdpBackend, UdpConfig};
use crate::connection::{ConnEntry, Connection};
use crate::driver;
use crate::error::{ConfigError, ConnectError};
use crate::mr::MemoryRegion;
use metaroce::fasthash::HashMap;
use metaroce::{
    Access, ConnectionError, ConnectionHandle, EndpointConfig, EndpointStats, TransportConfig,
    WorkCompletion,
};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use tokio::sync::{mpsc, oneshot, Notify};

/// Configuration of an async [`Endpoint`].
///
/// Receive buffering is bounded by the core's limits, which this crate turns into
/// backpressure (`transport.explicit_consume` is always on): a stream takes in a new
/// message only if it fits, with what its reader has not taken yet, in
/// `transport.max_stream_recv_bytes` (default 16 MiB) — also a stream nobody accepted —
/// and in the connection's `transport.max_recv_buffer_bytes` (default 256 MiB); other
/// SENDs of the peer are held back by flow-control RNR NAKs (its `poll_ready` waits) until
/// the reader catches up. So that every stream can always make
/// progress, the next message due on a stream is taken in even beyond those limits, from
/// a second reserve of `max_recv_buffer_bytes`, and one such message may always come in
/// when that reserve is empty, whatever its length up to `transport.max_message_size`
/// (default 2 GiB, the IBA maximum): **a connection can hold up to `max_recv_buffer_bytes
/// + max(max_recv_buffer_bytes, max_message_size)`**, 2.25 GiB with the defaults. A peer
/// can fill that by sending on a stream this side never reads, and it can open many
/// connections: so received messages not yet read, over all connections of a shard, are
/// capped by [`Config::max_unread_recv_bytes`] (default 4 GiB). Once it is reached every
/// peer's new SENDs wait until the application reads; an application that reads what it
/// is given is never held back by it. Messages still being reassembled (a peer can start
/// messages and never finish them, on many connections) are capped the same way by
/// [`Config::max_reassembly_bytes`] (default 2 GiB; up to twice it, or it plus one
/// message of `max_message_size`, for messages next due on their streams, so that no
/// stream waits for good). Messages are charged at full length from their first packet, so
/// a peer that starts large messages and never finishes them holds that cap with a few
/// packets, and other peers' messages larger than [`Config::reassembly_floor_bytes`]
/// (64 KiB) wait while it does; smaller ones keep flowing. A service that takes messages
/// from untrusted peers should lower `max_unread_recv_bytes`, `max_reassembly_bytes`,
/// `transport.max_message_size` (it bounds WRITEs too) and `max_recv_buffer_bytes` as its
/// messages allow. Likewise the WRITE-with-immediate notifications not yet taken by
/// [`Connection::recv_imm`](crate::Connection::recv_imm) are capped by
/// `transport.max_unconsumed_immediates` (default 4096): beyond it the peer's
/// `write_with_imm` waits. Nothing is dropped.
///
/// The kernel's receive buffer of the endpoint's socket is shared the same way: every ACK
/// grants its sender a share of it (`transport.socket_recv_buffer`, which the endpoint
/// fills in from the socket's `SO_RCVBUF` when left at 0; [`Config::window_grant`]), so
/// that the senders together have about as much in flight as the socket holds, also
/// while this host is not reading it. A value set in the config is used as it is.
///
/// Liveness defaults: `transport.idle_timeout` is [`DEFAULT_IDLE_TIMEOUT`] (10 s) and
/// `transport.keepalive_interval` 3 s, so an idle connection to a live peer is never
/// closed, and a dead peer is reported within 10 s on every handle (pending operations
/// fail, streams yield `ConnectionLost(IdleTimeout)`, `closed()` resolves). In a data centre an RTT is tens of microseconds and a
/// retransmission timeout milliseconds, so ten seconds of silence on a connection that the
/// peer keeps alive is not congestion but a dead peer, a dead host or a partitioned network;
/// and ten seconds is long enough that a peer paused by a debugger or a long GC does not
/// lose its connections. Set it to `None` to keep idle connections forever.
#[derive(Debug, Clone)]
pub struct Config {
    /// Transport parameters (paths, path MTU, limits, congestion control, idle timeout) of
    /// every connection. `transport.paths` is also the number of path sockets bound.
    pub transport: TransportConfig,
    /// Seed of the core's reproducible RNG (QPNs, initial PSNs); `None` (the default) takes
    /// one from the operating system (`getrandom`). Set it only for reproducible runs. The
    /// core's secret seed (connection nonces and tokens, retry cookies, rkeys, region
    /// addresses) is always taken from the operating system (issue #9).
    pub seed: Option<u64>,
    /// Accept connection requests from peers (they are offered by [`Endpoint::accept`]).
    /// With `false` they are rejected by the core with code 1. Default `true`.
    pub accept_incoming: bool,
    /// Most connection requests waiting for [`Endpoint::accept`] at once; further ones are
    /// refused with [`REFUSED_BUSY`]. Default 1024.
    pub max_pending_incoming: usize,
    /// Most connections at once. Default 65 536.
    pub max_connections: usize,
    /// Most half-open connections (accepted, not yet confirmed by their client) per shard;
    /// a further request evicts the oldest of them once it is a handshake interval old
    /// (its client, if it had the Accept, is told with a CLOSE, code 1), so a flood from
    /// many sources slower than this many requests per handshake interval cannot lock
    /// other clients out, as long as the application keeps taking requests from
    /// [`Endpoint::accept`] (evicted ones stay in its queue until taken, and
    /// [`Incoming::accept`] then fails). Against a faster flood a client is refused for
    /// now (code 2 with TRY_AGAIN) and tries again on its handshake timer, so some
    /// connects fail once its attempts run out. Default 4096
    /// ([`metaroce::EndpointConfig::max_half_open`]).
    pub max_half_open: usize,
    /// Most half-open connections (accepted, not yet confirmed by their client: one round
    /// trip for a legitimate client) from one source address,
    /// per shard; further requests from that source are refused with code 5
    /// (`metaroce::wire::ConnectEth::REASON_SOURCE_LIMIT`). This keeps one host that never
    /// confirms its handshakes from filling the table and locking other clients out
    /// (see [`metaroce::EndpointConfig::max_half_open_per_source`]). Raise it for a client
    /// host that opens more connections than this to one endpoint at once. Default 64.
    pub max_half_open_per_source: usize,
    /// Most bytes of received messages not yet read, over all connections of one shard
    /// (each message counted with 128 bytes of bookkeeping). While they are at or above
    /// it, every peer's new SENDs wait (flow-control RNR NAKs; their `poll_ready` waits)
    /// until the application reads. See the type docs above and
    /// [`metaroce::EndpointConfig::max_unread_recv_bytes`]. Default 4 GiB.
    pub max_unread_recv_bytes: u64,
    /// Most bytes of messages being reassembled (first packet in, not yet delivered;
    /// counted at full length from the first packet), over all connections of one shard.
    /// New messages beyond it wait (flow-control RNR NAKs), except the next message due on
    /// its stream, which may come in up to twice it (or alone beyond it), so no stream
    /// waits for good. A shard holds at most `max(2 × this, this +
    /// transport.max_message_size)` bytes of them, plus one message of at most
    /// [`reassembly_floor_bytes`](Self::reassembly_floor_bytes) per connection. See
    /// [`metaroce::EndpointConfig::max_reassembly_bytes`], which also says how a peer that
    /// never finishes its messages holds other peers' larger messages back. Default 2 GiB.
    pub max_reassembly_bytes: u64,
    /// Messages of at most this many bytes come in beyond `max_reassembly_bytes`, one per
    /// connection at a time, so that every connection's small messages keep flowing
    /// ([`metaroce::EndpointConfig::reassembly_floor_bytes`]). 0 turns it off; default
    /// 64 KiB.
    pub reassembly_floor_bytes: u64,
    /// Socket options of the UDP backend (used by [`Endpoint::bind`]).
    pub udp: UdpConfig,
    /// Extra UDP source ports bound beside the `transport.paths` path ports, so that a path
    /// that keeps timing out can be re-rolled to fresh ECMP entropy. Default 8.
    pub spare_ports: usize,
    /// Most messages a [`MessageStream`](crate::MessageStream) sink has in flight (posted,
    /// not yet acknowledged) before `poll_ready` waits. Default 256.
    pub max_stream_in_flight: usize,
    /// Bytes one [`MessageStream`](crate::MessageStream) sink has posted and not yet
    /// acknowledged before `poll_ready` waits. Default 16 MiB.
    pub stream_send_buffer: usize,
    /// Bytes a connection's SENDs (every stream's sink and
    /// [`Connection::send`](crate::Connection::send)) have posted and not yet had
    /// acknowledged before a sink's `poll_ready` or a `send` waits, whichever stream it is
    /// on: the connection-wide bound on send buffering (quinn's `send_window`), so that
    /// many streams cannot each hold `stream_send_buffer` behind a peer that does not
    /// read. Default 64 MiB.
    pub connection_send_buffer: usize,
    /// Shards of an endpoint from [`Endpoint::bind`]: each shard is a core endpoint with
    /// its own lock, driver task and UDP sockets, so connections on different shards run
    /// in parallel on a multi-thread runtime. The shards share the listening port
    /// (`SO_REUSEPORT`); a classic-BPF reuseport program (`SO_ATTACH_REUSEPORT_CBPF`)
    /// steers every datagram in the kernel to the shard of its BTH DestQP (`DestQP mod
    /// shards`; a CONNECT Request by the client's QPN in its ConnectEth; non-MetaRoCE
    /// opcodes to shard 0, which hosts the RC QPs), and each shard's core allocates QPNs
    /// in its residue class. Memory regions are registered on every shard with the same
    /// keys. A connection lives on one shard (round-robin at [`Endpoint::connect`]).
    /// The receiver-driven fair share (`transport.recv_capacity_mbps`) counts the active
    /// senders of every shard: each shard's driver publishes its count and divides the
    /// capacity by the sum, so the shards together grant at most the capacity (a count
    /// not refreshed for 10 ms, or `fair_share_window` if longer, counts as 0). If the program cannot be attached the endpoint runs with one shard and logs a
    /// warning; [`Endpoint::shards`] tells. Endpoints from
    /// [`with_backend`](Endpoint::with_backend) / [`with_rocev2`](Endpoint::with_rocev2)
    /// always have one shard. In `1..=64`. Default 1 (one driver, as before), or the value
    /// of the environment variable `METAROCE_TOKIO_SHARDS` when set (to run a test suite
    /// sharded). See docs/ARCHITECTURE.md, "Shards".
    pub shards: usize,
    /// Send from the application task (issue #13 P2): a [`MessageStream`](crate::MessageStream)
    /// that posted a message, or read one, asks the core for its transmits itself and hands
    /// them to the backend without blocking, instead of waking the driver task to do it —
    /// one task hop fewer per message. It does so only while the driver is not sending
    /// (the backend's send side has one user at a time); a transmit the backend cannot take
    /// at once goes to the driver, which sends it first. The driver is still woken when the
    /// core's next timer moved ahead of the one it sleeps until, or when more is left to
    /// send. `false`: every transmit leaves from the driver task, as before. Default `true`.
    pub inline_transmit: bool,
    /// Grant the peers a window out of this endpoint's receive socket buffer
    /// (`transport.socket_recv_buffer`, filled in from the socket's `SO_RCVBUF` when left at
    /// 0; see [`metaroce::TransportConfig::socket_recv_buffer`]). On a host whose
    /// `net.core.rmem_max` is the usual 208 KiB that caps a lone sender near 48 packets of
    /// 4 KiB in flight, which is what the socket holds; raise `rmem_max` rather than turn
    /// this off. `false`: no grant, unless `transport.socket_recv_buffer` is set. Default
    /// `true`.
    pub window_grant: bool,
}

/// Most shards of one endpoint ([`Config::shards`]).
pub const MAX_SHARDS: usize = 64;

fn default_shards() -> usize {
    std::env::var("METAROCE_TOKIO_SHARDS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|n| (1..=MAX_SHARDS).contains(n))
        .unwrap_or(1)
}

/// Default idle timeout of [`Config::default`]: 10 s (see [`Config`]).
pub const DEFAULT_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The code an [`Incoming`] dropped without a decision, or one beyond
/// [`Config::max_pending_incoming`], is refused with. It is the core's code for its own
/// connection limit too (`ConnectEth::REASON_LIMIT`; a full half-open table evicts its
/// oldest entry instead of refusing): to the requester all
/// of them mean "busy, try later". The accept-queue refusal carries the reason text
/// `accept queue full`; the core's refusals carry none. A requester whose own address holds
/// too many half-open connections gets code 5 instead
/// ([`Config::max_half_open_per_source`]).
pub const REFUSED_BUSY: u32 = 2;

impl Default for Config {
    fn default() -> Self {
        Self {
            transport: TransportConfig {
                idle_timeout: Some(DEFAULT_IDLE_TIMEOUT),
                ..TransportConfig::default()
            },
            seed: None,
            accept_incoming: true,
            max_pending_incoming: 1024,
            max_connections: 65_536,
            max_half_open: 4096,
            max_half_open_per_source: 64,
            max_unread_recv_bytes: 4 << 30,
            max_reassembly_bytes: 2 << 30,
            reassembly_floor_bytes: 64 << 10,
            udp: UdpConfig::default(),
            spare_ports: 8,
            max_stream_in_flight: 256,
            stream_send_buffer: 16 << 20,
            connection_send_buffer: 64 << 20,
            shards: default_shards(),
            inline_transmit: true,
            window_grant: true,
        }
    }
}

impl Config {
    /// Check the configuration as [`Endpoint::bind`] will.
    ///
    /// # Errors
    /// [`ConfigError`] naming the first invalid field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.transport.validate().map_err(ConfigError::Transport)?;
        for (name, v) in [
            ("max_pending_incoming", self.max_pending_incoming),
            ("max_connections", self.max_connections),
            ("max_half_open", self.max_half_open),
            ("max_half_open_per_source", self.max_half_open_per_source),
            ("max_stream_in_flight", self.max_stream_in_flight),
            ("stream_send_buffer", self.stream_send_buffer),
            ("connection_send_buffer", self.connection_send_buffer),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero(name));
            }
        }
        if self.shards == 0 {
            return Err(ConfigError::Zero("shards"));
        }
        if self.max_unread_recv_bytes == 0 {
            return Err(ConfigError::Zero("max_unread_recv_bytes"));
        }
        if self.max_reassembly_bytes == 0 {
            return Err(ConfigError::Zero("max_reassembly_bytes"));
        }
        if self.shards > MAX_SHARDS {
            return Err(ConfigError::TooManyShards(self.shards));
        }
        Ok(())
    }
}

/// What a waiting operation is sent when it completes.
#[derive(Debug)]
pub(crate) struct OpDone {
    pub wc: WorkCompletion,
    /// The connection ended with this reason in the same batch of events that flushed the
    /// operation (`WrFlushError`): it failed because of the end (a flush of a stream's
    /// reset or stop is not one).
    pub ended: Option<ConnectionError>,
    /// The SEND failed because the peer refused its stream (`Event::StreamRefused`): the
    /// stream.
    pub refused: Option<u32>,
}

pub(crate) enum Waiter {
    /// An operation's future waits; for a `Connection::send`, the stream it is on (its
    /// completion lowers that stream's unacknowledged bytes, which the stream's sink and
    /// other `send`s wait on), and whether the core reported the SEND refused
    /// (`Event::StreamRefused`, before its completion).
    Op(oneshot::Sender<OpDone>, Option<u32>, bool),
    Stream(u32),
    /// The operation's future was dropped and the core was asked to cancel it
    /// (`Connection::run_op`): its completion is discarded, except that `dereg` (an
    /// atomic's result region) is deregistered only then, and a cancelled `recv_into`
    /// that still received a message is reported (`Connection::take_cancelled_recv`).
    Cancelled {
        dereg: Option<u32>,
        recv: Option<crate::connection::RecvTarget>,
        send_stream: Option<u32>,
    },
    /// Member `index` of a [`Connection::write_batch`](crate::Connection::write_batch):
    /// the batch's one completion is sent once its last member completes.
    Batch {
        batch: Arc<crate::connection::BatchSlot>,
        index: usize,
    },
}

pub(crate) struct State {
    pub core: metaroce::Endpoint,
    /// Routing entry of every live connection; removed when the connection ends.
    pub conns: HashMap<ConnectionHandle, ConnEntry>,
    pub connecting: HashMap<ConnectionHandle, oneshot::Sender<Result<(), ConnectionError>>>,
    pub waiters: HashMap<(ConnectionHandle, u64), Waiter>,
    pub next_wr_id: u64,
    /// A post was refused `SendQueueFull` since the driver last woke `sq_space`. The core's
    /// send queue can shrink with no completion reported (reported operations queued behind
    /// an internal one, a READ response or a FIN, leave when it is acknowledged), so the
    /// driver wakes such posters after its next pass, not only on completions.
    pub sq_full: bool,
    /// Stream sinks waiting in `poll_ready` for room in their connection's send queue
    /// (`Endpoint::send_queue_full`): woken with `sq_space`'s waiters.
    pub sq_blocked: Vec<(ConnectionHandle, u32)>,
    /// Connection requests for `Endpoint::accept` (shard index and handle: bounded by
    /// `max_pending_incoming` over all shards).
    pub incoming: Option<mpsc::Sender<(usize, ConnectionHandle)>>,
    /// lkeys of regions the core is done with, to deregister from every shard once this
    /// shard's lock is released (`Shared::deregister_everywhere`).
    pub dereg_later: Vec<u32>,
    /// Someone (the driver, or an application task in `driver::transmit_inline`) is
    /// handing transmits to the backend: the backend's send side is taken.
    pub tx_busy: bool,
    /// Transmits an application task took from the core and the backend did not take
    /// (`Pending`): the driver sends them first, in order.
    pub unsent: std::collections::VecDeque<(metaroce::Transmit, Vec<u8>)>,
    /// Spare transmit buffers of `transmit_inline`.
    pub tx_pool: Vec<Vec<u8>>,
    /// `transmit_inline`'s batch (empty between calls; kept for its capacity).
    pub tx_out: Vec<(metaroce::Transmit, Vec<u8>)>,
    /// The timer the driver will sleep until, as it last computed it under this lock
    /// (`Some(None)`: no timer); `None` until it first did.
    pub driver_deadline: Option<Option<std::time::Instant>>,
    pub closed: bool,
    /// Completion routing of the RC queue pairs (`Endpoint::create_rc_qp`).
    pub rc: crate::rocev2::RcSide,
    /// Connections with a sink or a `Connection::send` waiting for their send bound
    /// (`Config::connection_send_buffer`, `stream_send_buffer`); each once
    /// (`ConnEntry::in_send_bound`). `driver::release_send_bound` looks at them after
    /// every batch of events.
    pub send_bound: Vec<ConnectionHandle>,
}

impl State {
    /// The driver's entry of stream `id` of connection `conn`, if both are live.
    pub fn stream(&self, conn: ConnectionHandle, id: u32) -> Option<&crate::stream::StreamEntry> {
        self.conns.get(&conn).and_then(|c| c.streams.get(&id))
    }

    /// [`State::stream`], mutable.
    pub fn stream_mut(
        &mut self,
        conn: ConnectionHandle,
        id: u32,
    ) -> Option<&mut crate::stream::StreamEntry> {
        self.conns
            .get_mut(&conn)
            .and_then(|c| c.streams.get_mut(&id))
    }

    pub fn wr_id(&mut self) -> u64 {
        self.next_wr_id += 1;
        self.next_wr_id
    }

    /// Close a connection with an application code and reason (graceful where the core
    /// supports it).
    pub fn close_conn(&mut self, h: ConnectionHandle, code: u32, reason: &[u8]) {
        let reason = &reason[..reason.len().min(metaroce::MAX_CLOSE_REASON)];
        // A request not accepted yet is refused (with the code): the requester holds no
        // connection to close.
        if self.core.refuse_incoming(h, code, reason).is_ok() {
            return;
        }
        let now = std::time::Instant::now();
        if self.core.close_with(now, h, code, reason).is_err() {
            // Not a connection the core can drain (unknown): nothing to close.
            let _ = self.core.abort(now, h, code, reason);
        }
    }

    /// Whether the driver may stop: closed, and every connection and pending CLOSE gone.
    pub fn drained(&self) -> bool {
        // `closed` first: the driver asks after every flush, and `table_sizes` is
        // O(connections).
        if !self.closed {
            return false;
        }
        let t = self.core.table_sizes();
        t.connections == 0 && t.closers == 0
    }

    /// Sizes of the driver's per-connection maps (for leak tests).
    pub fn map_sizes(&self) -> DriverMaps {
        DriverMaps {
            connections: self.conns.len(),
            connecting: self.connecting.len(),
            waiters: self.waiters.len(),
            streams: self.conns.values().map(|c| c.streams.len()).sum(),
            core_connections: self.core.connections().count(),
            core: self.core.table_sizes(),
        }
    }
}

/// Sizes of the driver's per-connection structures, from [`Endpoint::driver_maps`]: all
/// are zero on an endpoint with no connection and no operation in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct DriverMaps {
    /// Routing entries of live connections.
    pub connections: usize,
    /// Connection attempts waiting for the handshake.
    pub connecting: usize,
    /// Posted operations waiting for their completion.
    pub waiters: usize,
    /// Streams the driver routes messages to, over all connections: each from its first
    /// use (or the peer's) until both directions are over in the core
    /// ([`metaroce::Event::StreamClosed`]) and its [`MessageStream`](crate::MessageStream)
    /// was dropped.
    pub streams: usize,
    /// Connections the core holds (including ones draining after a close).
    pub core_connections: usize,
    /// The core's per-connection tables (timers, indexes, CLOSEs awaiting an answer).
    pub core: metaroce::TableSizes,
}

/// State shared by the driver task and every handle.
pub(crate) struct Shared {
    pub state: Mutex<State>,
    /// Wakes the driver: new work was posted or the endpoint is closing.
    pub wake_driver: Notify,
    /// Signalled when send-queue space frees up (completions).
    pub sq_space: Notify,
    /// Signalled when the last connection ends or the driver stops.
    pub idle: Notify,
    pub backend: Arc<dyn DatagramBackend>,
    /// Whole-IP-packet backend of native RoCEv2 QPs, if any (`Endpoint::with_rocev2`).
    pub ip_backend: Option<Arc<dyn crate::rocev2::IpBackend>>,
    pub id: u64,
    /// This shard's index in its endpoint (0 for an unsharded one).
    pub shard: usize,
    /// Every shard of the endpoint, this one included, in order (set once at start).
    pub siblings: std::sync::OnceLock<Vec<std::sync::Weak<Shared>>>,
    /// Datagrams of this shard's connections that the kernel delivered to another shard
    /// (inside a GSO or GRO buffer, which the reuseport program steers whole by its first
    /// datagram), handed over by that shard's driver. Bounded by [`INBOX_BYTES`].
    pub inbox: Mutex<Inbox>,
    /// The shards' active-sender counts for the receiver-driven fair share (one table per
    /// endpoint, shared by its shards).
    pub fair: Arc<FairShare>,
    pub cfg: Config,
    /// The driver task returned.
    pub stopped: std::sync::atomic::AtomicBool,
    pub span: tracing::Span,
}

/// Most bytes of datagrams waiting in a shard's [`Inbox`], each counted with its queue
/// entry; more are dropped (counted in [`Inbox::dropped`]), as the socket would drop them.
pub(crate) const INBOX_BYTES: usize = 4 << 20;

/// Datagrams another shard received for this one (see [`Shared::inbox`]).
#[derive(Default)]
pub(crate) struct Inbox {
    pub datagrams: std::collections::VecDeque<(crate::backend::RecvMeta, Vec<u8>)>,
    pub bytes: usize,
    /// Datagrams refused because the inbox was full.
    pub dropped: u64,
}

impl Shared {
    /// The shard (other than this one) that datagram `d` belongs to, by the rule the
    /// kernel's reuseport program steers lone datagrams with; `None` when it is this
    /// shard's or the endpoint is not sharded.
    pub fn shard_of(&self, d: &[u8]) -> Option<Arc<Shared>> {
        let sibs = self.siblings.get()?;
        if sibs.len() < 2 {
            return None;
        }
        #[cfg(target_os = "linux")]
        let k = crate::backend::reuseport::steer(d, sibs.len() as u32) as usize;
        #[cfg(not(target_os = "linux"))]
        let k = self.shard;
        if k == self.shard {
            return None;
        }
        sibs.get(k)?.upgrade()
    }

    /// Queues `d` for this shard's driver (from another shard's) and wakes it; dropped
    /// when the inbox is full, or when this shard's driver has stopped (nothing would
    /// drain it, and a handle may keep this `Shared` alive for long).
    pub fn hand_over(&self, meta: &crate::backend::RecvMeta, d: &[u8]) {
        if self.stopped.load(Ordering::Acquire) {
            return;
        }
        // Each entry is charged its queue slot as well as its payload: a zero-length
        // datagram (or a runt, which `steer` gives to shard 0) costs nothing by its length,
        // and the queue grew without limit while its driver did not drain it.
        let cost = d.len() + std::mem::size_of::<(crate::backend::RecvMeta, Vec<u8>)>();
        let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        if inbox.bytes + cost > INBOX_BYTES {
            inbox.dropped += 1;
            return;
        }
        inbox.bytes += cost;
        inbox.datagrams.push_back((*meta, d.to_vec()));
        drop(inbox);
        self.wake_driver.notify_one();
    }
}

/// The receiver-driven fair share of a sharded endpoint (`transport.recv_capacity_mbps`):
/// the shards are separate cores behind one address and one NIC, so each must divide the
/// capacity among the active senders of *all* shards, or together they grant up to
/// `shards` times the capacity. Each shard's driver publishes its own count (with the time
/// it counted) on every turn and hands its core the sum of the others'
/// ([`metaroce::Endpoint::set_other_shard_senders`]). A count not refreshed for
/// [`FAIR_SHARE_STALE`] (or `fair_share_window`, if longer) is taken as 0: a shard whose
/// driver has not run for that long received no data in that time, so none of its
/// senders is active any more.
pub(crate) struct FairShare {
    epoch: std::time::Instant,
    counts: Vec<std::sync::atomic::AtomicU32>,
    /// When each count was published: microseconds since `epoch`, plus 1 (0: never).
    stamps: Vec<AtomicU64>,
}

/// How long a shard's published fair-share count stays valid without a refresh (at least
/// `fair_share_window`): a little longer than a busy driver's turn under load.
pub(crate) const FAIR_SHARE_STALE: std::time::Duration = std::time::Duration::from_millis(10);

impl FairShare {
    pub fn new(shards: usize) -> FairShare {
        FairShare {
            epoch: std::time::Instant::now(),
            counts: (0..shards).map(|_| Default::default()).collect(),
            stamps: (0..shards).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn micros(&self, now: std::time::Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_micros() as u64 + 1
    }

    /// Publish shard `me`'s count and return the sum of the other shards' valid counts.
    pub fn exchange(
        &self,
        me: usize,
        mine: u32,
        now: std::time::Instant,
        window: std::time::Duration,
    ) -> u32 {
        let at = self.micros(now);
        if let (Some(c), Some(t)) = (self.counts.get(me), self.stamps.get(me)) {
            c.store(mine, Ordering::Relaxed);
            t.store(at, Ordering::Release);
        }
        let stale = window.max(FAIR_SHARE_STALE).as_micros() as u64;
        let mut others = 0u32;
        for (i, (c, t)) in self.counts.iter().zip(&self.stamps).enumerate() {
            let t = t.load(Ordering::Acquire);
            if i != me && t != 0 && at.saturating_sub(t) <= stale {
                others = others.saturating_add(c.load(Ordering::Relaxed));
            }
        }
        others
    }
}

impl Shared {
    /// Sharded endpoints with the fair share on: publish this shard's active senders and
    /// tell the core the other shards' (see [`FairShare`]). Called on every driver turn.
    pub fn sync_fair_share(&self, st: &mut State) {
        let window = self.cfg.transport.fair_share_window;
        if self.fair.counts.len() < 2 || self.cfg.transport.recv_capacity_mbps == 0 {
            return;
        }
        let now = std::time::Instant::now();
        let mine = st.core.fair_share_senders(now);
        let others = self.fair.exchange(self.shard, mine, now, window);
        st.core.set_other_shard_senders(others);
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock would be a bug in this crate; keep going with the
        // state as it was rather than poisoning every handle.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Deregister `lkey` from every shard of this endpoint, shard 0 (which chooses the
    /// keys) last, so that no shard still holds the slot when shard 0 reuses it. Takes
    /// each shard's lock in turn (never two at once); must not be called with one held.
    /// The cores' handles on the memory are dropped outside the locks.
    pub fn deregister_everywhere(&self, lkey: u32) {
        let Some(sibs) = self.siblings.get() else {
            let core_side = self.lock().core.deregister_mr_memory(lkey);
            drop(core_side);
            return;
        };
        for s in sibs.iter().rev().filter_map(std::sync::Weak::upgrade) {
            let core_side = s.lock().core.deregister_mr_memory(lkey);
            drop(core_side);
        }
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("id", &self.id)
            .field("backend", &self.backend)
            .finish()
    }
}

/// Keeps the driver running while any user handle (endpoint, connection, region, stream)
/// exists; the last one dropped closes every connection (the peers are sent CLOSE before
/// the driver stops) and stops it.
#[derive(Debug)]
pub(crate) struct EndpointRef {
    /// Shard 0: the endpoint's address, RC QPs, the keys of memory regions.
    pub shared: Arc<Shared>,
    /// Every shard (`shards[0]` is `shared`).
    pub shards: Vec<Arc<Shared>>,
    /// Connection requests of every shard waiting for `Endpoint::accept`.
    pub incoming_rx: tokio::sync::Mutex<mpsc::Receiver<(usize, ConnectionHandle)>>,
    /// Round-robin counter of `Endpoint::connect`.
    pub next_shard: AtomicU64,
}

impl Drop for EndpointRef {
    fn drop(&mut self) {
        for shared in &self.shards {
            let mut st = shared.lock();
            let handles: Vec<_> = st.core.connections().collect();
            for h in handles {
                st.close_conn(h, 0, b"");
            }
            st.closed = true;
            drop(st);
            shared.wake_driver.notify_one();
        }
    }
}

static NEXT_ENDPOINT_ID: AtomicU64 = AtomicU64::new(1);

/// A MetaRoCE endpoint bound to a local address: connects to peers, accepts their
/// connections, owns registered memory regions. Cheap to clone.
///
/// Lifecycle (as in quinn): [`connect`](Self::connect) returns a [`Connecting`] future;
/// [`accept`](Self::accept) yields [`Incoming`] requests to accept or refuse;
/// [`close`](Self::close) closes every connection with a code the peers see;
/// [`wait_idle`](Self::wait_idle) waits until they are gone. When the last endpoint,
/// connection, region and stream handle is dropped, every connection is closed (code 0)
/// — the peers are sent CLOSE — and the driver task stops.
///
/// The driver is a task of the runtime the endpoint was bound in. If that runtime shuts
/// down first, the driver is gone without closing anything (the peers are not told; their
/// connections end by their own timeouts): pending operations and calls on any handle
/// then fail with [`Error::EndpointClosed`](crate::Error::EndpointClosed), streams end,
/// [`Connection::closed`](crate::Connection::closed) gives `LocallyClosed`, and
/// [`wait_idle`](Self::wait_idle) returns. Bind an endpoint in the runtime that outlives
/// its use (one endpoint shared by several `#[tokio::test]` runtimes does not work).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use metaroce_tokio::{Config, Endpoint};
/// let server = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
/// let client = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
/// let connecting = client.connect(server.local_addr())?;
/// let incoming = server.accept().await.expect("a request");
/// let peer = incoming.accept()?;
/// let conn = connecting.await?;
/// conn.close(7, b"done");
/// let why = peer.closed().await;
/// println!("{why}");
/// client.wait_idle().await;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub(crate) inner: Arc<EndpointRef>,
}

impl Endpoint {
    /// Bind a UDP endpoint at `addr` (port 0 for an ephemeral port) with one main socket
    /// and `config.transport.paths + config.spare_ports` path sockets, and start its driver
    /// task. Must be called within a tokio runtime.
    ///
    /// # Errors
    /// The sockets could not be bound, or the configuration is invalid (`InvalidInput`
    /// whose inner error is the [`ConfigError`]).
    ///
    /// # Cancel safety
    /// Binding completes before the first await point; dropping the future before it
    /// resolves leaves nothing behind.
    pub async fn bind(addr: SocketAddr, config: Config) -> std::io::Result<Endpoint> {
        config.validate()?;
        let ports = config.transport.paths as usize + config.spare_ports;
        if config.shards == 1 {
            let backend = UdpBackend::bind_with(addr, ports, &config.udp)?;
            return Self::with_backend(backend, config);
        }
        let backends = UdpBackend::bind_sharded(addr, config.shards, ports, &config.udp)?;
        let backends = backends
            .into_iter()
            .map(|b| Arc::new(b) as Arc<dyn DatagramBackend>)
            .collect();
        Self::start_shards(backends, None, config)
    }

    /// Start an endpoint over any datagram backend (for example a UDP backend wrapped in
    /// [`Impaired`](crate::backend::Impaired)). Must be called within a tokio runtime.
    ///
    /// # Errors
    /// The configuration is invalid (`InvalidInput` whose inner error is the
    /// [`ConfigError`]); called outside a tokio runtime (`Other`, instead of a panic).
    pub fn with_backend(
        backend: impl DatagramBackend,
        config: Config,
    ) -> std::io::Result<Endpoint> {
        Self::start(Arc::new(backend), None, config)
    }

    /// Start an endpoint over a datagram backend (MetaRoCE connections, RC QPs connected
    /// with [`QueuePair::connect_udp`](crate::rocev2::QueuePair::connect_udp)) **and** a
    /// whole-IP-packet backend for native RoCEv2 QPs
    /// ([`QueuePair::connect`](crate::rocev2::QueuePair::connect)) that interoperate with
    /// `rdma_rxe` and RNICs: normally a
    /// [`RawIpBackend`](crate::rocev2::RawIpBackend) (needs `CAP_NET_RAW`), or a
    /// [`MemoryLink`](crate::rocev2::MemoryLink) in tests. One driver task serves both;
    /// memory regions are shared. The native QPs' local IP is `ip_backend.local_ip()`.
    /// Must be called within a tokio runtime.
    ///
    /// `backend` carries the MetaRoCE connections (and RC QPs connected with `connect_udp`):
    /// build it as [`bind`](Self::bind) does, with
    /// [`UdpBackend::bind_with`](crate::backend::UdpBackend::bind_with)`(addr,
    /// config.transport.paths + config.spare_ports, &config.udp)`. On such an endpoint
    /// [`QueuePair::connect_to`](crate::rocev2::QueuePair::connect_to) connects natively;
    /// on one from [`bind`](Self::bind) it falls back to UDP encapsulation, which reaches
    /// metaroce peers only. (The README's RoCEv2 example; compiled, not run.)
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use metaroce_tokio::backend::UdpBackend;
    /// use metaroce_tokio::rocev2::{exchange, QpInit, RawIpBackend};
    /// use metaroce_tokio::{Access, Config, Endpoint};
    ///
    /// async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    ///     let config = Config::default();
    ///     let ports = config.transport.paths as usize + config.spare_ports;
    ///     let udp = UdpBackend::bind_with("10.0.0.1:4791".parse()?, ports, &config.udp)?;
    ///     let raw = Arc::new(RawIpBackend::bind("10.0.0.1".parse()?)?); // CAP_NET_RAW
    ///     let ep = Endpoint::with_rocev2(udp, raw, config)?;
    ///     let region = ep.alloc(1 << 20, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    ///     let _meta = ep.connect("10.0.0.2:4791".parse()?)?.await?; // MetaRoCE to one peer
    ///     let qp = ep.create_rc_qp(QpInit { access: Access::REMOTE_WRITE, ..QpInit::default() })?;
    ///     let mut tcp = tokio::net::TcpStream::connect("10.0.0.3:18515").await?;
    ///     let peer = exchange(&mut tcp, &qp.exchange_info(Some(region.remote()))).await?;
    ///     qp.connect_to(&peer)?; // native RoCEv2 (with_rocev2) to an RNIC, same region
    ///     let their = peer.region.expect("peer sent its region");
    ///     qp.write(region.keys().lkey, 0, 4096, their.addr, their.rkey, None).await?;
    ///     Ok(())
    /// }
    /// ```
    ///
    /// # Errors
    /// The configuration is invalid (`InvalidInput` whose inner error is the
    /// [`ConfigError`]); called outside a tokio runtime (`Other`, instead of a panic).
    pub fn with_rocev2(
        backend: impl DatagramBackend,
        ip_backend: Arc<dyn crate::rocev2::IpBackend>,
        config: Config,
    ) -> std::io::Result<Endpoint> {
        Self::start(Arc::new(backend), Some(ip_backend), config)
    }

    fn start(
        backend: Arc<dyn DatagramBackend>,
        ip_backend: Option<Arc<dyn crate::rocev2::IpBackend>>,
        config: Config,
    ) -> std::io::Result<Endpoint> {
        Self::start_shards(vec![backend], ip_backend, config)
    }

    /// Start one shard per backend (all bound to one address; shard `i` allocates QPNs
    /// `≡ i mod n`). The IP backend (native RC QPs) goes to shard 0.
    fn start_shards(
        backends: Vec<Arc<dyn DatagramBackend>>,
        mut ip_backend: Option<Arc<dyn crate::rocev2::IpBackend>>,
        config: Config,
    ) -> std::io::Result<Endpoint> {
        config.validate()?;
        if tokio::runtime::Handle::try_current().is_err() {
            // `tokio::spawn` below would panic; say what to do instead.
            return Err(std::io::Error::other(
                "a metaroce-tokio Endpoint must be started from within a tokio runtime \
                 (inside #[tokio::main], a Runtime::block_on or a task)",
            ));
        }
        let n = backends.len();
        let (tx, rx) = mpsc::channel(config.max_pending_incoming);
        let id = NEXT_ENDPOINT_ID.fetch_add(1, Ordering::Relaxed);
        let mut shards = Vec::with_capacity(n);
        let fair = Arc::new(FairShare::new(n));
        for (i, backend) in backends.into_iter().enumerate() {
            let ip = if i == 0 { ip_backend.take() } else { None };
            let shard =
                Self::new_shard(backend, ip, &config, id, (i, n), fair.clone(), tx.clone())?;
            shards.push(shard);
        }
        drop(tx);
        let weak: Vec<_> = shards.iter().map(Arc::downgrade).collect();
        for s in &shards {
            let _ = s.siblings.set(weak.clone());
        }
        let inner = Arc::new(EndpointRef {
            shared: shards[0].clone(),
            shards: shards.clone(),
            incoming_rx: tokio::sync::Mutex::new(rx),
            next_shard: AtomicU64::new(0),
        });
        for shared in shards {
            let span = shared.span.clone();
            tokio::spawn(tracing::Instrument::instrument(driver::run(shared), span));
        }
        Ok(Endpoint { inner })
    }

    fn new_shard(
        backend: Arc<dyn DatagramBackend>,
        ip_backend: Option<Arc<dyn crate::rocev2::IpBackend>>,
        config: &Config,
        id: u64,
        (shard, shards): (usize, usize),
        fair: Arc<FairShare>,
        tx: mpsc::Sender<(usize, ConnectionHandle)>,
    ) -> std::io::Result<Arc<Shared>> {
        let mut ecfg = EndpointConfig::new(backend.local_addr(), backend.source_ports());
        ecfg.transport = config.transport.clone();
        ecfg.transport.max_gso_segments = backend.max_gso_segments().clamp(1, 64);
        // The window grant divides the socket's real buffer among the senders, unless the
        // application set one itself.
        if config.window_grant && ecfg.transport.socket_recv_buffer == 0 {
            ecfg.transport.socket_recv_buffer = backend.socket_recv_buffer().unwrap_or(0);
        }
        // Delivered bytes stay charged until the reader takes them (MessageStream::poll_next
        // reports them consumed): the receive buffers are bounded by the core's limits.
        ecfg.transport.explicit_consume = true;
        ecfg.accept_incoming = config.accept_incoming;
        ecfg.manual_accept = true;
        ecfg.max_connections = config.max_connections;
        ecfg.max_half_open = config.max_half_open;
        ecfg.max_half_open_per_source = config.max_half_open_per_source;
        ecfg.max_unread_recv_bytes = config.max_unread_recv_bytes;
        ecfg.max_reassembly_bytes = config.max_reassembly_bytes;
        ecfg.reassembly_floor_bytes = config.reassembly_floor_bytes;
        let os_err = |e: getrandom::Error| {
            std::io::Error::other(format!("no randomness from the operating system: {e}"))
        };
        ecfg.seed = match config.seed {
            Some(s) => s.wrapping_add(shard as u64),
            None => getrandom::u64().map_err(os_err)?,
        };
        // Residue class `shard mod shards` (identity for one shard): the kernel's
        // reuseport program steers by `DestQP mod shards`.
        ecfg.qpn_modulus = shards as u32;
        ecfg.qpn_residue = shard as u32;
        let mut secret = [0u8; 32];
        getrandom::fill(&mut secret).map_err(os_err)?;
        ecfg.secret_seed = Some(secret);
        let mut core = metaroce::Endpoint::new(ecfg).map_err(ConfigError::from_post)?;
        if let Some(ip) = &ip_backend {
            let mut rc = core.rc_config().clone();
            rc.local_ip = ip.local_ip();
            core.set_rc_config(rc)
                .map_err(|e| ConfigError::Rc(e.to_string()))?;
        }
        let span = tracing::debug_span!("endpoint", id, shard, addr = %backend.local_addr());
        Ok(Arc::new(Shared {
            state: Mutex::new(State {
                sq_full: false,
                sq_blocked: Vec::new(),
                core,
                conns: HashMap::default(),
                connecting: HashMap::default(),
                waiters: HashMap::default(),
                next_wr_id: 0,
                incoming: Some(tx),
                dereg_later: Vec::new(),
                tx_busy: false,
                unsent: std::collections::VecDeque::new(),
                tx_pool: Vec::new(),
                tx_out: Vec::new(),
                driver_deadline: None,
                closed: false,
                rc: crate::rocev2::RcSide::new(),
                send_bound: Vec::new(),
            }),
            wake_driver: Notify::new(),
            sq_space: Notify::new(),
            idle: Notify::new(),
            backend,
            ip_backend,
            id,
            shard,
            siblings: std::sync::OnceLock::new(),
            inbox: Mutex::new(Inbox::default()),
            fair,
            cfg: config.clone(),
            stopped: std::sync::atomic::AtomicBool::new(false),
            span,
        }))
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.inner.shared
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared().backend.local_addr()
    }

    /// Start connecting to the endpoint listening at `addr`. The returned [`Connecting`]
    /// resolves once the handshake completes.
    ///
    /// # Errors
    /// At once, before any await: [`ConnectError::EndpointClosed`] if the endpoint is
    /// closed, [`ConnectError::InvalidRemoteAddress`] for port 0, an unspecified IP or an
    /// IPv6 address from an IPv4 endpoint (which would only time out),
    /// [`ConnectError::Post`] if the core refuses (`max_connections` reached).
    /// Awaiting the [`Connecting`] reports how the handshake ended.
    pub fn connect(&self, addr: SocketAddr) -> Result<Connecting, ConnectError> {
        // An IPv4-mapped address is the IPv4 address for an IPv4 endpoint.
        let addr = match addr {
            SocketAddr::V6(a) if self.local_addr().is_ipv4() => a
                .ip()
                .to_ipv4_mapped()
                .map_or(addr, |v4| SocketAddr::new(v4.into(), a.port())),
            _ => addr,
        };
        let v6_from_v4 = self.local_addr().is_ipv4() && addr.is_ipv6();
        if addr.port() == 0 || addr.ip().is_unspecified() || v6_from_v4 {
            return Err(ConnectError::InvalidRemoteAddress(addr));
        }
        let shards = &self.inner.shards;
        let pick = self.inner.next_shard.fetch_add(1, Ordering::Relaxed) % shards.len() as u64;
        let shared = &shards[pick as usize];
        let local_ip = local_ip_for(self.local_addr(), addr);
        let (tx, rx) = oneshot::channel();
        let conn = {
            let mut st = shared.lock();
            if st.closed {
                return Err(ConnectError::EndpointClosed);
            }
            let h = st
                .core
                .connect(std::time::Instant::now(), addr, local_ip)
                .map_err(ConnectError::Post)?;
            st.connecting.insert(h, tx);
            let entry = ConnEntry::new();
            let conn = Connection::new(
                self.inner.clone(),
                shared.clone(),
                h,
                entry.signals.clone(),
                Some(addr),
            );
            st.conns.insert(h, entry);
            conn
        };
        shared.wake_driver.notify_one();
        Ok(Connecting {
            conn: Some(conn),
            rx,
        })
    }

    /// The next connection request a peer sent to this endpoint, to
    /// [`accept`](Incoming::accept) or [`refuse`](Incoming::refuse); `None` once the
    /// endpoint is closed. Nothing is sent to the requester until then.
    ///
    /// # Cancel safety
    /// Cancel safe: a request is taken from the queue only when this resolves.
    pub async fn accept(&self) -> Option<Incoming> {
        loop {
            let (i, h) = self.inner.incoming_rx.lock().await.recv().await?;
            let shared = self.inner.shards.get(i)?;
            let st = shared.lock();
            if st.closed {
                return None;
            }
            if let Some(e) = st.conns.get(&h) {
                let signals = e.signals.clone();
                drop(st);
                return Some(Incoming {
                    ep: self.inner.clone(),
                    shared: shared.clone(),
                    handle: h,
                    signals,
                    decided: false,
                });
            }
        }
    }

    /// Register `data` as a memory region with `access` rights, without copying it (as
    /// [`register_buffer`](Self::register_buffer)). Pass
    /// `Access::LOCAL_WRITE | Access::REMOTE_WRITE` to let peers WRITE into it.
    pub fn register(&self, data: Vec<u8>, access: Access) -> MemoryRegion {
        self.register_buffer(data, access)
    }

    /// Register a zero-filled region of `len` bytes.
    pub fn alloc(&self, len: usize, access: Access) -> MemoryRegion {
        self.register(vec![0; len], access)
    }

    /// Endpoint-wide counters (malformed datagrams, bad ICRCs, …), summed over the shards.
    pub fn stats(&self) -> EndpointStats {
        let mut total = EndpointStats::default();
        for s in &self.inner.shards {
            total += s.lock().core.stats();
        }
        total
    }

    /// The counters of each shard, in shard order ([`Config::shards`]).
    pub fn shard_stats(&self) -> Vec<EndpointStats> {
        self.inner
            .shards
            .iter()
            .map(|s| s.lock().core.stats())
            .collect()
    }

    /// Number of shards this endpoint runs ([`Config::shards`], or 1 after a fallback).
    pub fn shards(&self) -> usize {
        self.inner.shards.len()
    }

    /// Live connections on each shard, in shard order (diagnostics: how connections
    /// spread over the shards).
    pub fn shard_connections(&self) -> Vec<usize> {
        self.inner
            .shards
            .iter()
            .map(|s| s.lock().conns.len())
            .collect()
    }

    /// The backends' local UDP source ports (one per path; shard 0's first, then each
    /// further shard's).
    pub fn source_ports(&self) -> Vec<u16> {
        self.inner
            .shards
            .iter()
            .flat_map(|s| s.backend.source_ports())
            .collect()
    }

    /// Close every connection gracefully with `code` and `reason` (at most
    /// [`MAX_CLOSE_REASON`](metaroce::MAX_CLOSE_REASON) bytes are sent): operations already
    /// posted drain for at most `transport.close_timeout`, then the rest are flushed (they
    /// fail with `ConnectionLost(LocallyClosed)`); the peers' handles end with
    /// `ClosedByPeer` carrying the code and
    /// reason, the local ones with `LocallyClosed`. New operations and connections are
    /// refused at once; the driver stops once every CLOSE was answered (or sent
    /// `close_attempts` times). [`wait_idle`](Self::wait_idle) waits for that.
    pub fn close(&self, code: u32, reason: &[u8]) {
        for shared in &self.inner.shards {
            {
                let mut st = shared.lock();
                let handles: Vec<_> = st.core.connections().collect();
                for h in handles {
                    st.close_conn(h, code, reason);
                }
                st.closed = true;
                // The accept queue's senders are the shards' alone: once every shard has
                // dropped its own, a pending or later `accept` ends with `None`.
                st.incoming = None;
            }
            shared.wake_driver.notify_one();
            // Operations waiting for room fail now, not after the drain.
            shared.sq_space.notify_waiters();
        }
    }

    /// Wait until this endpoint has no connection left (every connection closed, by
    /// either side or by a timeout, and its driver state freed) — or until the driver has
    /// stopped after [`close`](Self::close). Resolves at once on an idle endpoint.
    ///
    /// # Cancel safety
    /// Cancel safe: it only observes.
    pub async fn wait_idle(&self) {
        for shared in &self.inner.shards {
            Self::wait_shard_idle(shared).await;
        }
    }

    async fn wait_shard_idle(shared: &Shared) {
        loop {
            let notified = shared.idle.notified();
            if shared.stopped.load(Ordering::Acquire) {
                return;
            }
            {
                let st = shared.lock();
                if st.conns.is_empty() {
                    let t = st.core.table_sizes();
                    if t.connections == 0 && t.closers == 0 {
                        return;
                    }
                }
            }
            shared.wake_driver.notify_one();
            notified.await;
        }
    }

    /// Whether this endpoint is closed ([`close`](Self::close) was called on it or a
    /// clone): new operations on it and its connections fail with
    /// [`Error::EndpointClosed`](crate::Error::EndpointClosed).
    pub fn is_closed(&self) -> bool {
        self.shared().lock().closed
    }

    /// Sizes of the driver's per-connection structures (diagnostics and leak tests).
    pub fn driver_maps(&self) -> DriverMaps {
        let mut total = DriverMaps::default();
        for s in &self.inner.shards {
            let m = s.lock().map_sizes();
            total.connections += m.connections;
            total.connecting += m.connecting;
            total.waiters += m.waiters;
            total.streams += m.streams;
            total.core_connections += m.core_connections;
            let (t, c) = (&mut total.core, m.core);
            t.connections += c.connections;
            t.nonces += c.nonces;
            t.index += c.index;
            t.timers += c.timers;
            t.ready += c.ready;
            t.recent_rx += c.recent_rx;
            t.closers += c.closers;
            t.control += c.control;
            t.events += c.events;
        }
        total
    }
}

/// A connection attempt from [`Endpoint::connect`]; resolves to the [`Connection`] once
/// the handshake completes.
///
/// # Cancel safety
/// Dropping it before it resolves abandons the attempt: the half-open connection is closed
/// and its driver state freed.
#[derive(Debug)]
#[must_use = "a connection attempt does nothing unless awaited"]
pub struct Connecting {
    conn: Option<Connection>,
    rx: oneshot::Receiver<Result<(), ConnectionError>>,
}

impl Connecting {
    /// The local handle (QPN) of the connection being set up.
    pub fn handle(&self) -> Option<ConnectionHandle> {
        self.conn.as_ref().map(Connection::handle)
    }
}

impl Future for Connecting {
    type Output = Result<Connection, ConnectError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let r = std::task::ready!(Pin::new(&mut self.rx).poll(cx));
        let conn = self.conn.take();
        Poll::Ready(match (r, conn) {
            (Ok(Ok(())), Some(c)) => Ok(c),
            (Ok(Err(e)), _) => Err(ConnectError::Connection(e)),
            _ => Err(ConnectError::EndpointClosed),
        })
    }
}

/// A connection request from a peer, from [`Endpoint::accept`]: the core holds it —
/// nothing is sent to the requester — until it is [accepted](Self::accept) or
/// [refused](Self::refuse). Dropping it refuses it with [`REFUSED_BUSY`].
#[derive(Debug)]
pub struct Incoming {
    ep: Arc<EndpointRef>,
    /// The shard whose core holds the request.
    shared: Arc<Shared>,
    handle: ConnectionHandle,
    /// The request's connection signals: why it ended, if the endpoint ended it before
    /// the application decided (evicted or expired while half-open).
    signals: Arc<crate::connection::ConnSignals>,
    decided: bool,
}

impl Incoming {
    /// The requester's address.
    pub fn remote_addr(&self) -> Option<SocketAddr> {
        self.shared.lock().core.peer_addr(self.handle)
    }

    /// Accept: the CONNECT Accept goes out and the connection is usable at once.
    ///
    /// If the connection is closed (or its last handle dropped) before the driver sent the
    /// Accept, the request is refused instead: the requester's connect fails with
    /// `Rejected` carrying the close's code and reason (it could not take a close before
    /// it has the Accept). Once the Accept is out, the requester connects and then sees
    /// `ClosedByPeer`.
    ///
    /// # Errors
    /// [`ConnectError::Connection`] if the request ended meanwhile, with the reason:
    /// `HandshakeTimeout` when it expired or was evicted by newer requests while half-open
    /// ([`Config::max_half_open`]); [`ConnectError::EndpointClosed`] if the endpoint is
    /// closed.
    pub fn accept(mut self) -> Result<Connection, ConnectError> {
        self.decided = true;
        let shared = self.shared.clone();
        let mut st = shared.lock();
        if st.closed {
            return Err(ConnectError::EndpointClosed);
        }
        let Some(signals) = st.conns.get(&self.handle).map(|e| e.signals.clone()) else {
            // Ended meanwhile: evicted or expired while half-open (`HandshakeTimeout`).
            return Err(ConnectError::Connection(
                self.signals
                    .reason()
                    .unwrap_or(ConnectionError::LocallyClosed),
            ));
        };
        if !st.core.accept_incoming(self.handle) {
            return Err(ConnectError::Connection(
                signals.reason().unwrap_or(ConnectionError::LocallyClosed),
            ));
        }
        let peer = st.core.peer_addr(self.handle);
        drop(st);
        shared.wake_driver.notify_one();
        Ok(Connection::new(
            self.ep.clone(),
            shared.clone(),
            self.handle,
            signals,
            peer,
        ))
    }

    /// Refuse with an application `code` and `reason`: the requester's [`Connecting`] fails
    /// with [`ConnectError::Connection`]`(`[`ConnectionError::Rejected`]` { code, reason })`
    /// (the CONNECT Reject carries the code and, as its payload, the reason). As for
    /// [`Connection::close`], at most [`MAX_CLOSE_REASON`](metaroce::MAX_CLOSE_REASON)
    /// bytes of `reason` are sent; a longer reason is cut.
    pub fn refuse(mut self, code: u32, reason: &[u8]) {
        self.decided = true;
        self.do_refuse(code, reason);
    }

    fn do_refuse(&self, code: u32, reason: &[u8]) {
        let reason = &reason[..reason.len().min(metaroce::MAX_CLOSE_REASON)];
        let shared = &self.shared;
        // Err: the request ended meanwhile (nothing to refuse).
        let _ = shared
            .lock()
            .core
            .refuse_incoming(self.handle, code, reason);
        shared.wake_driver.notify_one();
    }
}

impl Drop for Incoming {
    fn drop(&mut self) {
        if !self.decided {
            self.do_refuse(REFUSED_BUSY, b"");
        }
    }
}

/// The local IP the kernel will use towards `peer` when bound to the unspecified address
/// (a connected UDP socket tells, without sending anything).
pub(crate) fn local_ip_for(local: SocketAddr, peer: SocketAddr) -> Option<std::net::IpAddr> {
    if !local.ip().is_unspecified() {
        return None;
    }
    let bind: SocketAddr = if peer.is_ipv4() {
        "0.0.0.0:0".parse().ok()?
    } else {
        "[::]:0".parse().ok()?
    };
    let s = std::net::UdpSocket::bind(bind).ok()?;
    s.connect(peer).ok()?;
    s.local_addr().ok().map(|a| a.ip())
}

#[cfg(all(test, target_os = "linux"))]
mod inbox_tests {
    use super::*;
    use crate::backend::RecvMeta;
    use crate::driver::Driven;

    /// The inbox bound (`INBOX_BYTES`) must bound the memory the queue holds, not only
    /// the payload bytes: a zero-length datagram (or a runt) that shard 1 receives on
    /// one of its own path sockets (not steered by the kernel) is steered to shard 0 by
    /// `reuseport::steer` and queued there at 0 (or a few) bytes, while each queued
    /// entry costs a `RecvMeta` and a `Vec` header. While shard 0's driver does not
    /// drain (busy sending, stopped with its handle alive), the queue grew without limit.
    #[tokio::test(flavor = "current_thread")]
    async fn inbox_bound_holds_for_empty_and_tiny_datagrams() {
        let ep = Endpoint::bind(
            "127.0.0.1:0".parse().unwrap(),
            Config {
                shards: 2,
                ..Config::default()
            },
        )
        .await
        .unwrap();
        assert_eq!(ep.shards(), 2, "reuseport program not attached");
        let (shard0, shard1) = (ep.inner.shards[0].clone(), ep.inner.shards[1].clone());
        let meta = RecvMeta {
            from: "127.0.0.1:9".parse().unwrap(),
            ..RecvMeta::EMPTY
        };
        let entry = std::mem::size_of::<(RecvMeta, Vec<u8>)>();
        let most = INBOX_BYTES / entry;
        // No await in between: shard 0's driver (same thread) cannot drain meanwhile.
        for i in 0..3 * most {
            let d: &[u8] = if i % 2 == 0 { &[] } else { &[0x01] };
            assert!(
                <Shared as Driven>::hand_over(&shard1, &meta, d),
                "a runt at shard 1 is shard 0's by the steering rule"
            );
        }
        let queued = shard0.inbox.lock().unwrap().datagrams.len();
        // A shard whose driver stopped takes nothing more (nothing would drain it).
        shard0.stopped.store(true, Ordering::Release);
        let payload_counted = {
            let mut inbox = shard0.inbox.lock().unwrap();
            inbox.datagrams.clear();
            std::mem::take(&mut inbox.bytes)
        };
        assert!(<Shared as Driven>::hand_over(&shard1, &meta, &[]));
        assert_eq!(
            shard0.inbox.lock().unwrap().datagrams.len(),
            0,
            "a stopped shard's inbox took a datagram"
        );
        shard0.stopped.store(false, Ordering::Release);
        assert!(
            queued <= most,
            "{} datagrams queued ({} B of entries, {} B counted) past a {} B bound",
            queued,
            queued * entry,
            payload_counted,
            INBOX_BYTES
        );
    }
}
