//! The endpoint: one local address, its connections, its memory regions; the sans-IO
//! driving contract.

use crate::config::RetryPolicy;
use crate::config::{EndpointConfig, TransportConfig};
use crate::conn::AuthError;
use crate::conn::{Connection, ConnectionStats, Outcome, State};
use crate::crypto::OpenError;
use crate::event::{ConnectionError, ConnectionHandle, Event, WcStatus};
use crate::fasthash::{FastState, HashMap};
use crate::mr::{Access, MrError, MrKeys, MrTable, RegionMemory};
use crate::secret::{self, SecretRng};
use crate::wire::{self, icrc, Bth, ConnectEth, ConnectKind, Headers, Opcode, Trailer};
use crate::{EcnCodepoint, Lent, Transmit};
use bytes::Bytes;
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::time::Instant;

/// What [`Endpoint::cancel`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CancelOutcome {
    /// Cancelled: it completes with `WrFlushError` (see [`Endpoint::cancel`] for when).
    Cancelled,
    /// Too late to cancel: it has its final status (or a message is landing in the
    /// receive) and completes with that.
    Finishing,
    /// This kind of operation cannot be cancelled (a SEND); it runs to completion.
    NotCancellable,
    /// No pending operation or receive with this `wr_id` on this connection (already
    /// reported, never posted, or the connection is gone).
    Unknown,
}

/// Why an application call was refused. Nothing was posted.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PostError {
    /// No connection with this handle (never existed, or closed).
    UnknownConnection,
    /// The connection is not established yet.
    NotConnected,
    /// The message or WRITE is larger than `max_message_size` (bytes).
    MessageTooLarge {
        /// Requested length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The local memory reference is invalid (lkey, range).
    LocalMemory(MrError),
    /// `max_outstanding_ops` operations are already pending on this connection, or its send
    /// queue holds twice that many (completed operations of other streams wait there behind
    /// an older unfinished one until it finishes), or the stream's or connection's
    /// [`SendLimits`] bytes are pending.
    SendQueueFull,
    /// The endpoint configuration is invalid: which field, and the rule it breaks.
    InvalidConfig(crate::ConfigError),
    /// Too many connections.
    TooManyConnections,
    /// The connection is closing ([`Endpoint::close_with`]): operations already posted
    /// drain, new ones are refused.
    Closing,
    /// The stream was finished by this side ([`Endpoint::finish_stream`]): no more SENDs.
    StreamFinished {
        /// Stream id.
        stream: u32,
    },
    /// The stream was reset by this side ([`Endpoint::reset_stream`]) or stopped by the
    /// peer ([`Event::StreamStopped`]): no more SENDs.
    StreamReset {
        /// Stream id.
        stream: u32,
    },
    /// This side ended the stream as its sender (finished or reset it, or the peer
    /// stopped it), every SEND and the end were acknowledged, and its send state was freed
    /// ([`Event::StreamClosed`] once the other direction is over too): no more SENDs.
    /// Stream ids are single-use per connection: open another id.
    StreamClosed {
        /// Stream id.
        stream: u32,
    },
    /// A close reason longer than [`MAX_CLOSE_REASON`] bytes.
    ReasonTooLong {
        /// Given length in bytes.
        len: usize,
        /// The limit ([`MAX_CLOSE_REASON`]).
        max: usize,
    },
    /// The connection does not use AEAD packet protection
    /// ([`TransportConfig::packet_protection`]).
    NotProtected,
}

/// Longest close reason, in bytes, that [`Endpoint::close_with`] and [`Endpoint::abort`]
/// accept (the MR_CLOSE payload; one packet at the smallest path MTU).
pub const MAX_CLOSE_REASON: usize = 256;

impl fmt::Display for PostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PostError::UnknownConnection => f.write_str("no such connection"),
            PostError::NotConnected => f.write_str("connection not established yet"),
            PostError::MessageTooLarge { len, max } => {
                write!(f, "message of {len} bytes exceeds max_message_size {max}")
            }
            PostError::LocalMemory(e) => write!(f, "invalid local memory reference: {e}"),
            PostError::SendQueueFull => f.write_str("send queue full (max_outstanding_ops)"),
            PostError::InvalidConfig(s) => write!(f, "invalid configuration: {s}"),
            PostError::TooManyConnections => f.write_str("too many connections (max_connections)"),
            PostError::Closing => f.write_str("connection is closing"),
            PostError::StreamFinished { stream } => {
                write!(f, "stream {stream} was finished: no more sends")
            }
            PostError::StreamReset { stream } => {
                write!(f, "stream {stream} was reset or stopped: no more sends")
            }
            PostError::StreamClosed { stream } => write!(
                f,
                "stream {stream} ended and was closed: no more sends (stream ids are single-use)"
            ),
            PostError::ReasonTooLong { len, max } => {
                write!(f, "close reason of {len} bytes exceeds {max} bytes")
            }
            PostError::NotProtected => f.write_str("connection does not use packet protection"),
        }
    }
}

impl std::error::Error for PostError {}

/// An RDMA WRITE to post: `len` bytes from offset `local_offset` of the local region
/// `lkey` to the peer's address `remote_addr` in the region `rkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteRequest {
    /// Caller's identifier, returned in the work completion.
    pub wr_id: u64,
    /// Local source region.
    pub lkey: u32,
    /// Byte offset in the local region.
    pub local_offset: u64,
    /// Bytes to write.
    pub len: u32,
    /// Remote virtual address of the first byte (the peer region's `addr` plus an offset).
    pub remote_addr: u64,
    /// Remote key of the peer's region.
    pub rkey: u32,
    /// Immediate data: makes this an RDMA WRITE with immediate, reported to the peer
    /// application once every byte has landed.
    pub imm: Option<u32>,
}

/// Bounds on unacknowledged SEND bytes for [`Endpoint::post_send_within`]: a post is
/// refused with [`PostError::SendQueueFull`] while its stream has `stream` bytes or more
/// posted and not yet acknowledged, or its connection has `connection` bytes or more over
/// all its streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendLimits {
    /// Most unacknowledged SEND bytes of one stream (bytes; `u64::MAX`: no bound).
    pub stream: u64,
    /// Most unacknowledged SEND bytes of the whole connection (bytes; `u64::MAX`: no
    /// bound).
    pub connection: u64,
}

impl SendLimits {
    /// No bound.
    pub const NONE: SendLimits = SendLimits {
        stream: u64::MAX,
        connection: u64::MAX,
    };
}

/// An RDMA READ to post: `len` bytes from the peer's address `remote_addr` in region
/// `rkey` into offset `local_offset` of the local region `lkey` (which needs LOCAL_WRITE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadRequest {
    /// Caller's identifier, returned in the work completion.
    pub wr_id: u64,
    /// Local destination region (LOCAL_WRITE).
    pub lkey: u32,
    /// Byte offset in the local region.
    pub local_offset: u64,
    /// Bytes to read.
    pub len: u32,
    /// Remote virtual address of the first byte.
    pub remote_addr: u64,
    /// Remote key of the peer's region (which needs REMOTE_READ).
    pub rkey: u32,
}

/// An atomic to post on the 8 bytes at `remote_addr` (8-byte aligned) of the peer's region
/// `rkey` (which needs REMOTE_ATOMIC). The original value is stored, little-endian, at
/// `local_offset` of the local region `lkey` (8 bytes, LOCAL_WRITE). Executed exactly once
/// at the responder however often the request is retransmitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtomicRequest {
    /// Caller's identifier, returned in the work completion.
    pub wr_id: u64,
    /// Local region receiving the original value.
    pub lkey: u32,
    /// Byte offset in the local region.
    pub local_offset: u64,
    /// Remote virtual address (8-byte aligned; otherwise `RemoteInvalidRequest`).
    pub remote_addr: u64,
    /// Remote key of the peer's region.
    pub rkey: u32,
    /// Compare-and-swap or fetch-and-add.
    pub op: crate::conn::AtomicOp,
}

/// A receive buffer to post on a stream: the next SEND on that stream without a receive
/// lands in `[offset, offset + len)` of the local region `lkey` (LOCAL_WRITE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvRequest {
    /// Caller's identifier, returned in the receive completion.
    pub wr_id: u64,
    /// Local region.
    pub lkey: u32,
    /// Byte offset in the region.
    pub offset: u64,
    /// Buffer length in bytes; a longer message completes the receive with
    /// `LocalLengthError` and the sender with `RemoteInvalidRequest`.
    pub len: u32,
}

/// Endpoint-wide counters of input that did not reach a connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EndpointStats {
    /// Datagrams handed to `handle_datagram`.
    pub datagrams_received: u64,
    /// Datagrams that did not parse (see `wire::Error`).
    pub malformed: u64,
    /// Datagrams with a wrong ICRC.
    pub bad_icrc: u64,
    /// Datagrams for a QPN with no connection, or from the wrong address.
    pub unknown_connection: u64,
    /// Well-formed packets of a kind this endpoint does not handle (e.g. UD, CNP). Standard
    /// RC packets go to the RC queue pairs ([`Endpoint::rc`]) and are counted there.
    pub unsupported: u64,
    /// Connection requests rejected.
    pub rejected: u64,
    /// Packets dropped on an AEAD-protected connection because they were not protected
    /// (no AEAD trailer) or their tag did not verify: forged, tampered or mis-keyed.
    pub aead_auth_failures: u64,
    /// Packets dropped on an AEAD-protected connection as replays: a packet number seen
    /// before, below the replay window, or of a discarded key phase.
    pub aead_replays: u64,
    /// Key updates of the receive direction completed on AEAD-protected connections (the
    /// peer's new key phase verified).
    pub key_updates: u64,
    /// Packets for an established connection whose trailer token was wrong (or of a kind
    /// the connection does not use), dropped before any state was touched.
    pub bad_auth: u64,
    /// Non-CONNECT MetaRoCE packets without a trailer (kind 0), dropped.
    pub missing_auth: u64,
    /// Retry packets sent (each the size of the Request it answers).
    pub retries_sent: u64,
    /// Requests whose cookie was present but invalid or expired (answered with a fresh
    /// Retry).
    pub bad_cookie: u64,
    /// Connections ended because their client came back as a new incarnation
    /// ([`ConnectionError::PeerRestarted`]).
    pub peer_restarts: u64,
    /// Handshake replies (and ACKs flushed at a local close) dropped because
    /// `max_control_queue` was full.
    pub control_dropped: u64,
    /// Bytes received in MR_CONNECT packets (for the amplification bound).
    pub handshake_bytes_in: u64,
    /// Bytes of MR_CONNECT replies (Retry, Reject) sent by the endpoint itself before any
    /// connection exists (the amplification numerator).
    pub handshake_bytes_out: u64,
    /// Requests with a valid retry cookie naming the client nonce of a connection this
    /// endpoint created already (one that has ended, or lives at another address), dropped
    /// without an answer: a replayed (or late duplicate) handshake of a closed connection,
    /// which would otherwise create a new connection and an [`Event::Incoming`] its client
    /// never asked for. Recognised while the replayed cookie is valid, the only time such a
    /// Request can pass the cookie check.
    pub replayed_requests: u64,
    /// Requests refused because their source already held
    /// [`EndpointConfig::max_half_open_per_source`] half-open connections (Reject reason
    /// 5; also counted in `rejected`).
    pub source_limited: u64,
    /// Half-open connections dropped to make room for a new Request when
    /// [`EndpointConfig::max_half_open`] was reached: each ended with `HandshakeTimeout` on
    /// this side, and its client, if it had the Accept and the connection is not AEAD, got
    /// an MR_CLOSE with code 1.
    pub half_open_evicted: u64,
}

impl std::ops::AddAssign for EndpointStats {
    /// Field-wise sum (the counters of several endpoints, e.g. the shards of one
    /// `metaroce-tokio` endpoint).
    fn add_assign(&mut self, o: Self) {
        // Exhaustive: a new counter must be added here too.
        let EndpointStats {
            datagrams_received,
            malformed,
            bad_icrc,
            unknown_connection,
            unsupported,
            rejected,
            aead_auth_failures,
            aead_replays,
            key_updates,
            bad_auth,
            missing_auth,
            retries_sent,
            bad_cookie,
            peer_restarts,
            control_dropped,
            handshake_bytes_in,
            handshake_bytes_out,
            replayed_requests,
            source_limited,
            half_open_evicted,
        } = o;
        self.datagrams_received += datagrams_received;
        self.malformed += malformed;
        self.bad_icrc += bad_icrc;
        self.unknown_connection += unknown_connection;
        self.unsupported += unsupported;
        self.rejected += rejected;
        self.aead_auth_failures += aead_auth_failures;
        self.aead_replays += aead_replays;
        self.key_updates += key_updates;
        self.bad_auth += bad_auth;
        self.missing_auth += missing_auth;
        self.retries_sent += retries_sent;
        self.bad_cookie += bad_cookie;
        self.peer_restarts += peer_restarts;
        self.control_dropped += control_dropped;
        self.handshake_bytes_in += handshake_bytes_in;
        self.handshake_bytes_out += handshake_bytes_out;
        self.replayed_requests += replayed_requests;
        self.source_limited += source_limited;
        self.half_open_evicted += half_open_evicted;
    }
}

/// What the endpoint remembers about one connection to find the work due without walking
/// every connection: its entries in [`Endpoint`]'s `timers` and `recent_rx` sets. Kept in
/// the connection itself (`Connection::ix`), so the one lookup of a datagram's QPN reaches
/// it too (issue #13: no second map keyed by QPN), and it cannot outlive the connection.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ConnIndex {
    /// The connection's `next_timeout()` when last looked at (its key in `timers`).
    deadline: Option<Instant>,
    /// The connection's `last_data_rx` when last looked at.
    data_rx: Option<Instant>,
    /// Its key in `recent_rx`, if it has one: a lower bound of `data_rx` (see
    /// `Endpoint::index_data_rx`).
    in_recent: Option<Instant>,
    /// The connection was touched since `deadline` was read: it is listed in
    /// `Endpoint::stale` and its `timers` entry may be out of date.
    stale: bool,
    /// The connection is in `Endpoint::ready` (issue #13: a touch of a connection already
    /// there costs no tree search).
    ready: bool,
    /// The connection's receive memory as counted in `Endpoint::recv_total`.
    recv_charged: RecvCharge,
}

/// Receive memory in library-owned buffers, of one connection or of all: bytes delivered
/// and not yet read (`EndpointConfig::max_unread_recv_bytes`) and bytes of messages being
/// reassembled (`EndpointConfig::max_reassembly_bytes`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct RecvCharge {
    unread: u64,
    reassembly: u64,
}

/// A MetaRoCE endpoint: sans-IO, deterministic. See the crate docs for the driving
/// contract.
///
/// Cost per call with `n` connections: `poll_timeout` O(log n); `handle_timeout` O(log n)
/// per connection whose timer is due (others are not looked at); `poll_transmit` O(log n)
/// per connection asked, and only connections marked ready (touched by an input, a post,
/// a timer or a transmit since they last had nothing to send) are asked; the receiver's
/// fair share is kept incrementally. Each call that touches a connection recomputes that
/// connection's deadline, O(paths).
#[derive(Debug)]
pub struct Endpoint {
    cfg: EndpointConfig,
    rng: Xoshiro256PlusPlus,
    /// The key of the hash tables indexed by peer-chosen ids (`fasthash`).
    tables: FastState,
    /// Secret randomness (nonces, cookie key, memory keys): see `EndpointConfig::secret_seed`.
    secret: SecretRng,
    cookie_key: [u8; 32],
    /// (client listen address, client QPN) → our QPN: a validated Request from the same
    /// address and QPN as a live connection is a restarted client.
    by_peer_qpn: HashMap<(SocketAddr, u32), u32>,
    /// Accepted connections not yet confirmed by their client, by source.
    half_open: HalfOpen,
    epoch: Option<Instant>,
    conns: BTreeMap<u32, Connection>,
    by_nonce: HashMap<u64, u32>,
    /// (cookie bucket, client nonce) of every Request that created a connection after a
    /// cookie round trip, oldest first, kept while that Request's cookie can still validate
    /// (the bucket it was accepted in and the next) and at most `max_connections +
    /// max_half_open` of them: a replay of such a Request after its connection ended is
    /// recognised by nonce ([`EndpointStats::replayed_requests`]). `cookie_nonces` is the
    /// same set, for the lookup (nonce → bucket). A connection the application refused
    /// (or that ended still held) leaves it at once: its client re-sends the Request when
    /// the Reject is lost and must be refused again, not met with silence.
    cookie_requests: VecDeque<(u64, u64)>,
    cookie_nonces: HashMap<u64, u64>,
    pub(crate) mrs: MrTable,
    events: VecDeque<Event>,
    control: VecDeque<ControlPacket>,
    /// Packets already built (and sealed) that go out ahead of everything else: the
    /// `MR_CLOSE` answer of an AEAD connection, whose keys are gone once it is removed, and
    /// the ACKs a connection closed locally still owed (flushed ahead of its `MR_CLOSE`).
    /// Each with the [`Transmit`] it leaves with.
    sealed_control: VecDeque<(Transmit, Vec<u8>)>,
    /// Scratch buffer: a received AEAD packet is decrypted in a copy.
    scratch: Vec<u8>,
    rr_cursor: u32,
    /// The caller's span list during [`poll_transmit_lent`](Self::poll_transmit_lent).
    lend: Option<Lent>,
    fair_share_at: Option<Instant>,
    /// The latest `now` the fair share was computed for.
    fair_share_latest: Option<Instant>,
    /// The grant computed at `fair_share_at` (Mbit/s), handed to each connection as it is
    /// polled.
    grant_mbps: u32,
    /// The window grant computed at `fair_share_at` (`TransportConfig::socket_recv_buffer`),
    /// in bytes; each connection turns it into packets of its path MTU. 0 = none.
    grant_window_bytes: u64,
    /// The most active senders counted for the window grant, and when that count was last
    /// reached (`TransportConfig::window_grant_hold`).
    grant_senders: (u32, Option<Instant>),
    /// Active senders of the fair share counted at `fair_share_at` on this endpoint alone.
    fair_share_local: u32,
    /// Active senders on the other endpoints that share this one's receive capacity
    /// (the other shards of a sharded endpoint), as told by
    /// [`set_other_shard_senders`](Self::set_other_shard_senders).
    fair_share_others: u32,
    /// (deadline, QPN) of every connection with a timer armed, as last read; the entries
    /// of connections in `stale` may be out of date.
    timers: BTreeSet<(Instant, u32)>,
    /// Connections touched since their deadline was last read (issue #13: the deadline,
    /// O(paths) to compute, is read once per burst of input and output instead of after
    /// every packet). Read back into `timers` by `flush_stale`: when `poll_transmit` has
    /// nothing more to send and before timers fire; `poll_timeout` computes theirs afresh.
    stale: Vec<u32>,
    /// QPNs of the connections that may have something to send: every connection whose
    /// `poll_transmit` could return a datagram is in here (it leaves only when its
    /// `poll_transmit` returns `None`, and any call that changes it puts it back).
    ready: BTreeSet<u32>,
    /// (last data arrival or establishment, QPN) of the connections that delivered data or
    /// were established within the fair-share window as of `fair_share_latest` (older
    /// entries are pruned lazily).
    recent_rx: BTreeSet<(Instant, u32)>,
    stats: EndpointStats,
    /// Receive memory of all connections (`max_unread_recv_bytes`,
    /// `max_reassembly_bytes`): the sum of their `ix.recv_charged`.
    recv_total: RecvCharge,
    /// RC queue pairs (RoCEv2 mode) over the same regions; see `rocev2::unified`.
    pub(crate) rc: crate::rocev2::RcHost,
    rc_turn: bool,
    /// Closes sent and not yet answered, by connection nonce (the connection itself is
    /// gone; the answer is matched by nonce and peer address).
    closers: HashMap<u64, Closer>,
    /// (next retransmission, nonce) of every entry in `closers` with a copy sent.
    close_timers: BTreeSet<(Instant, u64)>,
    /// Nonces in `closers` whose MR_CLOSE is due now.
    close_ready: VecDeque<u64>,
}

/// An MR_CLOSE being retransmitted until the peer answers (or `close_attempts` copies
/// went out): all that is left of a closed connection.
#[derive(Debug)]
struct Closer {
    peer: SocketAddr,
    peer_qpn: u32,
    local_ip: Option<IpAddr>,
    /// The connection's token towards the peer (carried by every MR_CLOSE copy) and the
    /// one the peer's packets carry (its answer must, issue #9).
    tx_token: u64,
    rx_token: u64,
    /// AEAD connections: every copy of the close, sealed (each under its own packet
    /// number) while the connection's keys still existed. Empty for token connections.
    sealed: Vec<Vec<u8>>,
    code: u32,
    reason: Bytes,
    sent: u32,
    /// Wait after the first copy (doubles after each).
    interval: std::time::Duration,
    next_at: Option<Instant>,
}

/// Sizes of an endpoint's per-connection tables (see [`Endpoint::table_sizes`]): every one
/// returns to its idle value when the connections end.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableSizes {
    /// Connections.
    pub connections: usize,
    /// Connection-request nonces of accepted connections.
    pub nonces: usize,
    /// Timer and fair-share index entries.
    pub index: usize,
    /// Armed connection timers.
    pub timers: usize,
    /// Connections marked ready to transmit.
    pub ready: usize,
    /// Fair-share entries.
    pub recent_rx: usize,
    /// Closes waiting for the peer's answer.
    pub closers: usize,
    /// Control packets queued.
    pub control: usize,
    /// Events not yet polled.
    pub events: usize,
}

/// Count connection `c`'s receive memory in `total` again, after a call that may have
/// changed it.
fn recount_recv(total: &mut RecvCharge, c: &mut Connection) {
    let now = RecvCharge {
        unread: c.unread_bytes(),
        reassembly: c.reassembly_bytes(),
    };
    let was = c.ix.recv_charged;
    total.unread = total.unread - was.unread + now.unread;
    total.reassembly = total.reassembly - was.reassembly + now.reassembly;
    c.ix.recv_charged = now;
}

/// Tell connection `c` the endpoint's receive memory before it handles a packet.
fn set_endpoint_recv(total: &RecvCharge, cfg: &EndpointConfig, c: &mut Connection) {
    c.endpoint_recv = crate::conn::EndpointRecv {
        unread_full: total.unread >= cfg.max_unread_recv_bytes,
        reassembly_others: total.reassembly - c.ix.recv_charged.reassembly,
        max_reassembly: cfg.max_reassembly_bytes,
        reassembly_floor: cfg.reassembly_floor_bytes,
    };
}

/// The source a half-open connection is counted against: its address (IPv4-mapped IPv6
/// addresses as IPv4). Not an IPv6 prefix: the hosts of a data-centre subnet, or every
/// link-local client, share one /64 (found by review), so one of them could lock out the
/// others.
fn source_key(ip: IpAddr) -> IpAddr {
    ip.to_canonical()
}

/// Accepted connections not yet confirmed by their client (half-open), with the source
/// each came from, the count per source (`EndpointConfig::max_half_open_per_source`) and
/// their order of arrival (the oldest is evicted when the table is full). At most
/// `max_half_open` entries, so at most that many sources.
#[derive(Debug, Default)]
struct HalfOpen {
    /// QPN → (source, arrival number, arrival time).
    conns: BTreeMap<u32, (IpAddr, u64, Instant)>,
    /// Arrival number → QPN.
    by_age: BTreeMap<u64, u32>,
    next: u64,
    per_source: HashMap<IpAddr, usize>,
}

impl HalfOpen {
    fn len(&self) -> usize {
        self.conns.len()
    }

    /// The half-open connection that arrived first, and when.
    fn oldest(&self) -> Option<(u32, Instant)> {
        let (_, &q) = self.by_age.first_key_value()?;
        Some((q, self.conns.get(&q)?.2))
    }

    /// Half-open connections from `source` (a [`source_key`]).
    fn from(&self, source: IpAddr) -> usize {
        self.per_source.get(&source).copied().unwrap_or(0)
    }

    fn insert(&mut self, qpn: u32, source: IpAddr, now: Instant) {
        let age = self.next;
        self.next += 1;
        if let Some((old, old_age, _)) = self.conns.insert(qpn, (source, age, now)) {
            self.by_age.remove(&old_age);
            self.forget(old);
        }
        self.by_age.insert(age, qpn);
        *self.per_source.entry(source).or_insert(0) += 1;
    }

    fn remove(&mut self, qpn: &u32) {
        if let Some((source, age, _)) = self.conns.remove(qpn) {
            self.by_age.remove(&age);
            self.forget(source);
        }
    }

    fn forget(&mut self, source: IpAddr) {
        if let Some(n) = self.per_source.get_mut(&source) {
            *n -= 1;
            if *n == 0 {
                self.per_source.remove(&source);
            }
        }
    }
}

/// Whether `c`'s send queue refuses new posts (`PostError::SendQueueFull`): `max_ops`
/// (`max_outstanding_ops`) operations unreported, or twice that queued. Operations reported
/// out of posting order (other streams') stay queued behind an unfinished older one, so the
/// queue as a whole is bounded too; the factor 2 also leaves room for the internal
/// operations the peer makes this side queue.
fn queue_full(c: &crate::conn::Connection, max_ops: usize) -> bool {
    c.sq.len() >= max_ops || c.sq.queued_ops() >= max_ops.saturating_mul(2)
}

impl Endpoint {
    /// A new endpoint. Errors if the configuration is invalid.
    pub fn new(cfg: EndpointConfig) -> Result<Self, PostError> {
        cfg.transport.validate().map_err(PostError::InvalidConfig)?;
        if cfg.source_ports.is_empty() {
            return Err(PostError::InvalidConfig(crate::ConfigError::new(
                "source_ports",
                "must not be empty",
            )));
        }
        if !(1..=65_536).contains(&cfg.qpn_modulus) {
            return Err(PostError::InvalidConfig(crate::ConfigError::new(
                "qpn_modulus",
                "must be in 1..=65536",
            )));
        }
        // Limits where 0 would refuse every Request or every message for good, even the
        // first (found by review for `max_unread_recv_bytes`).
        for (name, value, rule) in [
            (
                "max_half_open",
                cfg.max_half_open as u64,
                "must be at least 1 (accept_incoming = false refuses every Request)",
            ),
            (
                "max_half_open_per_source",
                cfg.max_half_open_per_source as u64,
                "must be at least 1",
            ),
            (
                "max_unread_recv_bytes",
                cfg.max_unread_recv_bytes,
                "must be at least 1",
            ),
            (
                "max_reassembly_bytes",
                cfg.max_reassembly_bytes,
                "must be at least 1",
            ),
        ] {
            if value == 0 {
                return Err(PostError::InvalidConfig(crate::ConfigError::new(
                    name, rule,
                )));
            }
        }
        if cfg.qpn_residue >= cfg.qpn_modulus {
            return Err(PostError::InvalidConfig(crate::ConfigError::new(
                "qpn_residue",
                "must be below qpn_modulus",
            )));
        }
        let mut secret = SecretRng::new(
            cfg.secret_seed
                .unwrap_or_else(|| SecretRng::default_seed(cfg.seed)),
        );
        let mut cookie_key = [0u8; 32];
        secret.fill(&mut cookie_key);
        let mrs = MrTable::new(&mut secret);
        // The hash tables keyed by ids peers choose (their QPNs and connection nonces, and
        // each connection's stream and operation ids) take a secret key (`fasthash`).
        let tables = FastState::keyed(secret.derive_u64(b"hash tables"));
        Ok(Self {
            tables,
            rc: crate::rocev2::RcHost::for_endpoint(&cfg),
            rc_turn: false,
            rng: Xoshiro256PlusPlus::seed_from_u64(cfg.seed),
            secret,
            cookie_key,
            by_peer_qpn: HashMap::with_hasher(tables),
            half_open: HalfOpen::default(),
            cfg,
            epoch: None,
            conns: BTreeMap::new(),
            by_nonce: HashMap::with_hasher(tables),
            cookie_requests: VecDeque::new(),
            cookie_nonces: HashMap::with_hasher(tables),
            mrs,
            events: VecDeque::new(),
            control: VecDeque::new(),
            sealed_control: VecDeque::new(),
            scratch: Vec::new(),
            rr_cursor: 0,
            lend: None,
            fair_share_at: None,
            fair_share_latest: None,
            grant_mbps: 0,
            grant_window_bytes: 0,
            grant_senders: (0, None),
            fair_share_local: 0,
            fair_share_others: 0,
            timers: BTreeSet::new(),
            stale: Vec::new(),
            ready: BTreeSet::new(),
            recent_rx: BTreeSet::new(),
            stats: EndpointStats::default(),
            recv_total: RecvCharge::default(),
            closers: HashMap::with_hasher(tables),
            close_timers: BTreeSet::new(),
            close_ready: VecDeque::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EndpointConfig {
        &self.cfg
    }

    /// Mutable transport defaults for connections made from now on (e.g. the backend's
    /// GSO limit). Not validated again: see [`TransportConfig::validate`] for the rules
    /// (a path MTU that is not an IBA value is rounded down, `TransportConfig::pmtu`).
    pub fn transport_config_mut(&mut self) -> &mut TransportConfig {
        &mut self.cfg.transport
    }

    fn epoch(&mut self, now: Instant) -> Instant {
        *self.epoch.get_or_insert(now)
    }

    fn local_ip(&self) -> Option<IpAddr> {
        let ip = self.cfg.local_addr.ip();
        (!ip.is_unspecified()).then_some(ip)
    }

    fn new_qpn(&mut self) -> u32 {
        let (m, r) = (self.cfg.qpn_modulus, self.cfg.qpn_residue);
        loop {
            let q = self.rng.next_u32() & wire::PSN_MASK;
            // Into this endpoint's residue class (identity when `m == 1`).
            let q = q - q % m + r;
            if q > 1 && q <= wire::PSN_MASK && !self.conns.contains_key(&q) {
                return q;
            }
        }
    }

    fn initial_psn(&mut self) -> u32 {
        let r = self.rng.next_u32();
        self.cfg.initial_psn.unwrap_or(r) & wire::PSN_MASK
    }

    /// Start connecting to `remote` (the peer's listening address). `local_ip` is the
    /// source address the ICRC pseudo-header uses when the endpoint is bound to the
    /// unspecified address (pass `None` otherwise). Progress is reported as
    /// [`Event::Connected`] or [`Event::ConnectionLost`].
    pub fn connect(
        &mut self,
        now: Instant,
        remote: SocketAddr,
        local_ip: Option<IpAddr>,
    ) -> Result<ConnectionHandle, PostError> {
        if self.conns.len() >= self.cfg.max_connections {
            return Err(PostError::TooManyConnections);
        }
        let epoch = self.epoch(now);
        let qpn = self.new_qpn();
        let nonce = self.secret.next_u64();
        let init_psn = self.initial_psn();
        let conn = Connection::new_outgoing(
            ConnectionHandle(qpn),
            now,
            epoch,
            remote,
            local_ip.or(self.local_ip()),
            self.cfg.local_addr.port(),
            self.cfg.source_ports.clone(),
            nonce,
            init_psn,
            self.cfg.transport.clone(),
            self.tables,
        );
        self.conns.insert(qpn, conn);
        self.touched(qpn);
        Ok(ConnectionHandle(qpn))
    }

    /// Whether the connection exists and is established.
    pub fn is_established(&self, conn: ConnectionHandle) -> bool {
        self.conns
            .get(&conn.0)
            .is_some_and(|c| c.state == State::Established)
    }

    /// Whether this side requested the connection (`false` for accepted ones and for
    /// unknown handles).
    pub fn is_client(&self, conn: ConnectionHandle) -> bool {
        self.conns.get(&conn.0).is_some_and(|c| c.outgoing)
    }

    /// The peer address of a connection.
    pub fn peer_addr(&self, conn: ConnectionHandle) -> Option<SocketAddr> {
        self.conns.get(&conn.0).map(|c| c.peer)
    }

    /// The connection's tokens (issue #9): `(sent, expected)` — the token this side puts in
    /// the trailer of every non-CONNECT packet it sends, and the one it requires on every
    /// packet it receives. `None` for unknown handles or before establishment. For test
    /// harnesses and capture tools that build or check packets by hand; an application
    /// never needs them, and they are as secret as the connection itself.
    pub fn connection_tokens(&self, conn: ConnectionHandle) -> Option<(u64, u64)> {
        self.conns
            .get(&conn.0)
            .filter(|c| c.state == State::Established)
            .map(|c| c.tokens())
    }

    /// Active senders this endpoint counts for its receiver-driven fair share
    /// (`TransportConfig::recv_capacity_mbps`) as of `now`: connections that delivered
    /// data or were established within `fair_share_window`. 0 when the fair share is off.
    /// A sharded driver publishes it to the other shards, which pass the sum of theirs
    /// to [`set_other_shard_senders`](Self::set_other_shard_senders).
    pub fn fair_share_senders(&mut self, now: Instant) -> u32 {
        self.update_fair_share(now);
        if self.cfg.transport.recv_capacity_mbps > 0 {
            self.fair_share_local
        } else {
            0
        }
    }

    /// Active senders on other endpoints that share this endpoint's receive capacity
    /// (the other shards of one sharded endpoint, each a separate core behind one
    /// address and NIC). The fair-share grant divides `recv_capacity_mbps` by this
    /// endpoint's own active senders plus `n`, so the shards together grant no more than
    /// the configured capacity. Default 0; takes effect at the next grant computed.
    pub fn set_other_shard_senders(&mut self, n: u32) {
        if self.fair_share_others != n {
            self.fair_share_others = n;
            self.fair_share_at = None;
        }
    }

    /// Counters and path state of a connection.
    pub fn connection_stats(&self, conn: ConnectionHandle) -> Option<ConnectionStats> {
        self.conns.get(&conn.0).map(|c| {
            let mut s = c.stats();
            // The grant is handed to a connection only when it is polled; report the one
            // in force (as of the last `poll_transmit`).
            if self.fair_share_at.is_some() {
                s.granted_rate_mbps = self.grant_mbps;
                s.granted_window = c.window_grant_packets(self.grant_window_bytes);
            }
            s
        })
    }

    /// Endpoint-wide counters.
    pub fn stats(&self) -> EndpointStats {
        self.stats
    }

    /// Handles of every connection, in QPN order.
    pub fn connections(&self) -> impl Iterator<Item = ConnectionHandle> + '_ {
        self.conns.keys().map(|&q| ConnectionHandle(q))
    }

    // ---- memory regions ----

    /// Register `data` as a memory region with `access` rights; returns its keys and the
    /// address peers use. The endpoint owns the bytes until [`deregister_mr`](Self::deregister_mr).
    pub fn register_mr(&mut self, data: Vec<u8>, access: Access) -> MrKeys {
        self.mrs.register(Box::new(data), access)
    }

    /// Register memory the caller implements ([`RegionMemory`]: its bytes may live behind
    /// the caller's own lock, so local copies need not hold whatever guards this endpoint).
    /// The core calls it once per packet placed or read, with bounds and access rights
    /// already checked. Returns the keys and the address peers use.
    pub fn register_mr_memory(&mut self, mem: Box<dyn RegionMemory>, access: Access) -> MrKeys {
        self.mrs.register(mem, access)
    }

    /// Register memory under keys (lkey, rkey, address, length, access) that another
    /// endpoint's [`register_mr_memory`](Self::register_mr_memory) returned, so that one
    /// region is reachable with the same keys through several endpoints — the shards of
    /// one `metaroce-tokio` endpoint, which share one UDP port and one set of regions.
    /// Use it on an endpoint whose regions are all registered this way (keys chosen by one
    /// endpoint only): each endpoint counts its own lkeys up from 1, so its own
    /// registrations would take lkeys the other endpoint hands out too.
    ///
    /// # Errors
    /// [`MrError::InvalidKey`] if the lkey or the rkey is 0 or in use here, or `keys.len`
    /// is not `mem.len()`; nothing is registered.
    pub fn register_mr_memory_with_keys(
        &mut self,
        mem: Box<dyn RegionMemory>,
        keys: MrKeys,
    ) -> Result<(), MrError> {
        self.mrs.register_with_keys(mem, keys)
    }

    /// Deregister a region; returns its bytes (the registered `Vec` itself, or a copy of
    /// memory registered with [`register_mr_memory`](Self::register_mr_memory)). Later
    /// remote accesses with its rkey get a remote access error; pending local WRITEs from it
    /// fail with a local protection error.
    pub fn deregister_mr(&mut self, lkey: u32) -> Option<Vec<u8>> {
        self.mrs.deregister(lkey).map(crate::mr::into_vec)
    }

    /// Deregister a region and return its memory as registered. From this call on the core
    /// never touches it again.
    pub fn deregister_mr_memory(&mut self, lkey: u32) -> Option<Box<dyn RegionMemory>> {
        self.mrs.deregister(lkey)
    }

    /// Number of regions registered now.
    pub fn registered_mrs(&self) -> usize {
        self.mrs.count()
    }

    /// Keys of a registered region.
    pub fn mr_keys(&self, lkey: u32) -> Option<MrKeys> {
        self.mrs.keys(lkey)
    }

    /// A copy of bytes `[offset, offset + len)` of a local region.
    pub fn mr_read(&self, lkey: u32, offset: u64, len: u64) -> Result<Vec<u8>, MrError> {
        self.mrs.local_vec(lkey, offset, len)
    }

    /// Copy `data` into a local region at `offset`.
    pub fn mr_write(&mut self, lkey: u32, offset: u64, data: &[u8]) -> Result<(), MrError> {
        self.mrs.local_write(lkey, offset, data)
    }

    // ---- posting ----

    /// Check that connection `conn` takes an operation of `len` bytes now (known,
    /// established, not closing, `len` within `max_message_size`, fewer than
    /// `max_outstanding_ops` pending), hand the connection to `post`, and mark it touched
    /// when `post` succeeds.
    fn post_to(
        &mut self,
        conn: ConnectionHandle,
        len: u64,
        post: impl FnOnce(&mut Connection) -> Result<(), PostError>,
    ) -> Result<(), PostError> {
        let max = self.cfg.transport.max_message_size;
        let max_ops = self.cfg.transport.max_outstanding_ops;
        let c = self
            .conns
            .get_mut(&conn.0)
            .ok_or(PostError::UnknownConnection)?;
        if c.state != State::Established {
            return Err(PostError::NotConnected);
        }
        if c.closing.is_some() {
            return Err(PostError::Closing);
        }
        if len > max {
            return Err(PostError::MessageTooLarge { len, max });
        }
        if queue_full(c, max_ops) {
            return Err(PostError::SendQueueFull);
        }
        post(c)?;
        Self::touch_conn(
            c,
            conn.0,
            &mut self.stale,
            &mut self.recent_rx,
            &mut self.fair_share_at,
            &mut self.ready,
        );
        Ok(())
    }

    /// Post a SEND of `data` as one message on `stream`. The peer receives it once, in
    /// order within the stream, as [`Event::Message`] (or in its next posted receive); a
    /// completion with `wr_id` follows once every packet is acknowledged.
    ///
    /// On a stream in the error state — a SEND on it failed with
    /// [`WcStatus::RnrRetryExceeded`] — the SEND is not
    /// sent and completes with [`WcStatus::WrFlushError`]
    /// (docs/PROTOCOL.md, "Errors on a stream"); the connection's other streams are not
    /// affected.
    pub fn post_send(
        &mut self,
        conn: ConnectionHandle,
        stream: u32,
        wr_id: u64,
        data: Bytes,
    ) -> Result<(), PostError> {
        self.post_send_within(conn, stream, wr_id, data, SendLimits::NONE)
    }

    /// [`post_send`](Self::post_send), refused with [`PostError::SendQueueFull`] — after
    /// every other check, so a closing connection, a finished or reset stream or a message
    /// too large still fail with their own error — while `stream` has `limits.stream`
    /// bytes or more posted and not yet acknowledged
    /// ([`stream_send_pending`](Self::stream_send_pending)), or the connection has
    /// `limits.connection` bytes or more over all its streams
    /// ([`send_pending`](Self::send_pending)): the bounds of a sender that must not queue
    /// without limit behind a slow reader (metaroce-tokio's `Connection::send` and
    /// `MessageStream` sink). One message is taken when none is pending, whatever its size.
    pub fn post_send_within(
        &mut self,
        conn: ConnectionHandle,
        stream: u32,
        wr_id: u64,
        data: Bytes,
        limits: SendLimits,
    ) -> Result<(), PostError> {
        self.post_to(conn, data.len() as u64, |c| {
            stream_open(c, stream)?;
            if c.sq.stream_pending(stream) >= limits.stream
                || c.sq.send_pending() >= limits.connection
            {
                return Err(PostError::SendQueueFull);
            }
            c.post_send(wr_id, stream, data);
            Ok(())
        })
    }

    /// Finish `stream` (like a QUIC stream FIN or TCP half-close): after every SEND posted
    /// on it so far, the peer reports [`Event::StreamFinished`] — once, after the stream's
    /// last [`Event::Message`] / [`Event::RecvCompletion`]. The FIN is a payload-less
    /// `MR_SEND` (docs/PROTOCOL.md, "Ending a stream"), delivered reliably; it reports no
    /// completion. Later [`post_send`](Self::post_send)s on the stream fail with
    /// [`PostError::StreamFinished`]. Finishing a stream never used sends a FIN with a
    /// message count of 0.
    ///
    /// # Errors
    /// [`PostError::UnknownConnection`], [`PostError::NotConnected`],
    /// [`PostError::Closing`]; [`PostError::StreamFinished`] /
    /// [`PostError::StreamReset`] if the stream was already finished or reset.
    pub fn finish_stream(
        &mut self,
        _now: Instant,
        conn: ConnectionHandle,
        stream: u32,
    ) -> Result<(), PostError> {
        let c = self.conn_for_stream(conn)?;
        stream_open(c, stream)?;
        c.sq.finish_stream(stream);
        self.touched(conn.0);
        Ok(())
    }

    /// Reset `stream` with an application `code` (like QUIC RESET_STREAM): every SEND on
    /// it not yet completed completes with [`WcStatus::WrFlushError`] (reported by the next
    /// [`poll_event`](Self::poll_event)), and the peer, once it has delivered the messages
    /// before the first of them, reports [`Event::StreamReset`] with `code` (its receives
    /// still posted on the stream are flushed). Later posts on the stream fail with
    /// [`PostError::StreamReset`]. Resetting a stream again does nothing; resetting a
    /// finished stream whose FIN is still in flight resets it.
    ///
    /// # Errors
    /// [`PostError::UnknownConnection`], [`PostError::NotConnected`],
    /// [`PostError::Closing`].
    pub fn reset_stream(
        &mut self,
        _now: Instant,
        conn: ConnectionHandle,
        stream: u32,
        code: u32,
    ) -> Result<(), PostError> {
        let c = self
            .conns
            .get_mut(&conn.0)
            .ok_or(PostError::UnknownConnection)?;
        if c.state != State::Established {
            return Err(PostError::NotConnected);
        }
        if c.closing.is_some() {
            return Err(PostError::Closing);
        }
        c.sq.reset_stream(stream, code);
        c.report(&mut self.events);
        self.touched(conn.0);
        Ok(())
    }

    /// Ask the peer to stop sending on `stream` with an application `code` (QUIC
    /// STOP_SENDING, RFC 9000 §3.5), as its receiver. Delivery on the stream ends at once:
    /// no [`Event::Message`] for it is reported after this call, and whatever arrives
    /// later is discarded (never acknowledged: it gets a flow-control RNR NAK until the
    /// STOP lands). The peer reports [`Event::StreamStopped`] with `code`, flushes every
    /// SEND on the stream this side did not deliver (`WrFlushError`) and resets the stream
    /// with the same code, so this side then reports [`Event::StreamReset`].
    ///
    /// The promise both ends keep: a SEND completes `Success` at the peer if and only if
    /// its message was reported here as [`Event::Message`] (or completed a posted
    /// receive); a SEND flushed by the STOP was never handed to this side's application.
    /// This holds when the STOP crosses messages in flight, is duplicated or reordered,
    /// or follows the peer's FIN. Only the first call per stream sends anything; a peer
    /// that has not sent on the stream yet resets it all the same (a later post there
    /// fails with [`PostError::StreamReset`]), as long as it tracks fewer than
    /// `max_streams` streams.
    ///
    /// A stream stopped before any of its messages was delivered here is forgotten
    /// without waiting for that reset once this side's sending on it is over too
    /// ([`Event::StreamClosed`], with no [`Event::StreamReset`]): the peer may never
    /// answer (one that refused the stream for a full stream table does not). Its later
    /// SENDs are still refused, never acknowledged.
    ///
    /// # Errors
    /// [`PostError::UnknownConnection`], [`PostError::NotConnected`],
    /// [`PostError::Closing`].
    pub fn stop_stream(
        &mut self,
        _now: Instant,
        conn: ConnectionHandle,
        stream: u32,
        code: u32,
    ) -> Result<(), PostError> {
        self.conn_for_stream(conn)?;
        if let Some(c) = self.conns.get_mut(&conn.0) {
            c.stop_stream(stream, code, &mut self.events);
        }
        self.touched(conn.0);
        Ok(())
    }

    /// Whether `stream` of `conn` was used and is closed in either direction: this side's
    /// sending on it ended and was acknowledged, or the peer's ended and was delivered and
    /// consumed, and the connection forgot that direction's state ([`Event::StreamClosed`]
    /// once both are). Stream ids are single-use per connection, so such a stream cannot
    /// be used again. `false` for unknown connections.
    pub fn stream_is_closed(&self, conn: ConnectionHandle, stream: u32) -> bool {
        self.conns
            .get(&conn.0)
            .is_some_and(|c| c.stream_is_closed(stream))
    }

    /// Bytes of SENDs posted on `stream` that have not completed yet (sent and not yet
    /// acknowledged, or not yet sent): what a driver's `poll_ready` compares with its
    /// send-buffer limit. It drops as [`Event::Completion`]s of the stream's SENDs are
    /// reported. 0 for unknown connections and streams.
    pub fn stream_send_pending(&self, conn: ConnectionHandle, stream: u32) -> u64 {
        self.conns
            .get(&conn.0)
            .map_or(0, |c| c.sq.stream_pending(stream))
    }

    /// Whether a post on `conn` would now be refused [`PostError::SendQueueFull`] by the
    /// operation bounds (`max_outstanding_ops` unreported, or twice that queued). The
    /// queue can leave this state with no completion reported (operations reported out of
    /// posting order leave once an internal operation before them, a READ response or a
    /// FIN, is acknowledged), so a caller waiting for room looks again after the
    /// endpoint handled input or timers, not only on completions. `false` for unknown
    /// connections.
    pub fn send_queue_full(&self, conn: ConnectionHandle) -> bool {
        let max_ops = self.cfg.transport.max_outstanding_ops;
        self.conns
            .get(&conn.0)
            .is_some_and(|c| queue_full(c, max_ops))
    }

    /// Bytes of SENDs posted on any stream of `conn` that have not completed yet: the sum
    /// of [`stream_send_pending`](Self::stream_send_pending) over its streams, O(1). 0 for
    /// unknown connections.
    pub fn send_pending(&self, conn: ConnectionHandle) -> u64 {
        self.conns.get(&conn.0).map_or(0, |c| c.sq.send_pending())
    }

    /// Bytes of `conn`'s SENDs that have finished (acknowledged, failed or flushed) since
    /// the connection began, a running total: when it moves, [`send_pending`](Self::send_pending)
    /// and some stream's [`stream_send_pending`](Self::stream_send_pending) went down — which
    /// happens when a SEND finishes, possibly well before its [`Event::Completion`] is
    /// reported (completions come in posting order per stream), or with none (a reset). 0
    /// for unknown connections.
    pub fn send_bytes_finished(&self, conn: ConnectionHandle) -> u64 {
        self.conns.get(&conn.0).map_or(0, |c| c.sq.send_freed())
    }

    /// Send the ACK `conn` holds for a reply (`TransportConfig::max_ack_delay`) with the
    /// next [`poll_transmit`](Self::poll_transmit), instead of when its delay is up: the
    /// application read the message and has nothing to answer with now (a reader that
    /// went back to waiting, say). Returns whether an ACK was held; unknown connections
    /// are ignored. The delay exists so that a reply can carry the ACK; once no reply is
    /// coming, holding it only delays the peer's completion — by the delay, or, with a
    /// timer coarser than it (tokio's resolves 1 ms), by much more.
    pub fn release_held_ack(&mut self, conn: ConnectionHandle) -> bool {
        let released = self
            .conns
            .get_mut(&conn.0)
            .is_some_and(|c| c.release_held_ack());
        if released {
            self.touched(conn.0);
        }
        released
    }

    /// The application consumed `bytes` more bytes of the messages delivered on `stream`
    /// of `conn` (with `TransportConfig::explicit_consume`), in delivery order: they stop
    /// counting against `max_stream_recv_bytes` and `max_recv_buffer_bytes`. Call it as a
    /// driver's per-stream queue drains — e.g. once per message taken, with the message's
    /// length (0 for an empty message); partial amounts are fine. A sender held back by
    /// flow control resumes within one RNR timer (`min_rnr_timer`, 0.64 ms by default)
    /// plus a round trip. Bytes beyond what was delivered, unknown connections and streams
    /// are ignored. Without `explicit_consume` it does nothing.
    pub fn stream_consumed(&mut self, conn: ConnectionHandle, stream: u32, bytes: u64) {
        if let Some(c) = self.conns.get_mut(&conn.0) {
            c.stream_consumed(stream, bytes, &mut self.events);
            // Reads are what lower `max_unread_recv_bytes`'s count: at once.
            recount_recv(&mut self.recv_total, c);
        }
    }

    /// The application took `n` more WRITE-with-immediate notifications
    /// ([`Event::WriteWithImm`]) of `conn` (with `TransportConfig::explicit_consume`): they
    /// stop counting against `TransportConfig::max_unconsumed_immediates`. A requester
    /// held back resumes within one RNR timer plus a round trip. More than were reported,
    /// and unknown connections, are ignored; without `explicit_consume` it does nothing.
    pub fn immediates_consumed(&mut self, conn: ConnectionHandle, n: u32) {
        if let Some(c) = self.conns.get_mut(&conn.0) {
            c.immediates_consumed(n);
        }
    }

    fn conn_for_stream(&mut self, conn: ConnectionHandle) -> Result<&mut Connection, PostError> {
        let c = self
            .conns
            .get_mut(&conn.0)
            .ok_or(PostError::UnknownConnection)?;
        if c.state != State::Established {
            return Err(PostError::NotConnected);
        }
        if c.closing.is_some() {
            return Err(PostError::Closing);
        }
        Ok(c)
    }

    /// Post an RDMA WRITE (or WRITE with immediate). Each packet lands directly at its
    /// address in the peer's region; the completion reports success once all are
    /// acknowledged, or the peer's refusal (`RemoteAccessError`: bad rkey, out of bounds,
    /// no REMOTE_WRITE right; nothing is written).
    pub fn post_write(
        &mut self,
        conn: ConnectionHandle,
        req: WriteRequest,
    ) -> Result<(), PostError> {
        self.mrs
            .check_local(req.lkey, req.local_offset, req.len as u64)
            .map_err(PostError::LocalMemory)?;
        self.post_to(conn, req.len as u64, |c| {
            c.post_write(&req);
            Ok(())
        })
    }

    /// The checks [`post_write`](Self::post_write) makes of `req` itself, without posting
    /// it: the local key, range and access (`PostError::LocalMemory`) and the length
    /// against `max_message_size` (`PostError::MessageTooLarge`). The connection's state
    /// and send-queue room are checked when it is posted. A driver posting a list of
    /// WRITEs checks them all first, so that a bad one posts none.
    pub fn check_write(&self, req: &WriteRequest) -> Result<(), PostError> {
        self.mrs
            .check_local(req.lkey, req.local_offset, req.len as u64)
            .map_err(PostError::LocalMemory)?;
        let (len, max) = (req.len as u64, self.cfg.transport.max_message_size);
        if len > max {
            return Err(PostError::MessageTooLarge { len, max });
        }
        Ok(())
    }

    /// Post an RDMA READ. The peer's bytes land in the local region as response packets
    /// arrive, in any order; the completion (`RdmaRead`) reports success once all have
    /// landed, or `RemoteAccessError` (bad rkey, out of bounds, no REMOTE_READ right).
    /// At most `max_rd_atomic` READs and atomics are outstanding; later operations wait.
    pub fn post_read(&mut self, conn: ConnectionHandle, req: ReadRequest) -> Result<(), PostError> {
        self.mrs
            .check_local_write(req.lkey, req.local_offset, req.len as u64)
            .map_err(PostError::LocalMemory)?;
        self.post_to(conn, req.len as u64, |c| {
            c.post_read(&req);
            Ok(())
        })
    }

    /// Post an atomic compare-and-swap or fetch-and-add (IBA 9.4.5).
    pub fn post_atomic(
        &mut self,
        conn: ConnectionHandle,
        req: AtomicRequest,
    ) -> Result<(), PostError> {
        self.mrs
            .check_local_write(req.lkey, req.local_offset, 8)
            .map_err(PostError::LocalMemory)?;
        self.post_to(conn, 8, |c| {
            c.post_atomic(&req);
            Ok(())
        })
    }

    /// Post a receive buffer on `stream`. From then on the stream consumes posted receives
    /// in order (IBA receive queue semantics): each SEND lands directly in the next one and
    /// completes it ([`Event::RecvCompletion`]); a SEND finding none gets an RNR NAK and the
    /// sender retries after the RNR timer, up to `rnr_retry` times (only the message whose
    /// receive is next spends retries; a later one waits with a flow-control RNR NAK).
    /// A receive whose region was deregistered (or no longer has room) by the time its
    /// message arrives completes with [`WcStatus::LocalProtectionError`] and the SEND with
    /// `RemoteOperationalError`; a message longer than its receive, or refused as invalid
    /// after later messages were bound to receives, completes it with
    /// [`WcStatus::LocalLengthError`] (docs/PROTOCOL.md, "Posted receives and RNR").
    ///
    /// On a stream in the error state (the peer's SEND on it failed with
    /// [`WcStatus::RnrRetryExceeded`] and the peer sent a
    /// stream abort), once in-order delivery has reached the aborted message, the receive
    /// completes at once with [`WcStatus::WrFlushError`] —
    /// reported by the next [`Endpoint::handle_timeout`] — as do the receives still pending
    /// there (docs/PROTOCOL.md, "Errors on a stream"). The same holds once the peer
    /// finished the stream and every message before its FIN was delivered: the receives
    /// still pending complete with `WrFlushError` just before [`Event::StreamFinished`],
    /// and later ones at once (on a closed stream, [`Event::StreamClosed`], too).
    /// Receives pending when the connection ends complete with `WrFlushError` too.
    pub fn post_recv(
        &mut self,
        conn: ConnectionHandle,
        stream: u32,
        req: RecvRequest,
    ) -> Result<(), PostError> {
        self.mrs
            .check_local_write(req.lkey, req.offset, req.len as u64)
            .map_err(PostError::LocalMemory)?;
        let c = self
            .conns
            .get_mut(&conn.0)
            .ok_or(PostError::UnknownConnection)?;
        if c.state != State::Established {
            return Err(PostError::NotConnected);
        }
        if c.closing.is_some() {
            return Err(PostError::Closing);
        }
        c.post_recv(
            stream,
            crate::conn::recv::PostedRecv {
                wr_id: req.wr_id,
                lkey: req.lkey,
                offset: req.offset,
                len: req.len,
            },
        );
        self.touched(conn.0);
        Ok(())
    }

    /// Ask an AEAD-protected connection to update its keys (docs/PROTOCOL.md, "Key
    /// update"): the next packet it sends uses the next key phase, unless the previous
    /// update is not yet confirmed by the peer, in which case the update waits for that.
    /// Returns `Ok(true)` if it happens at the next packet, `Ok(false)` if deferred.
    ///
    /// Errors: [`PostError::UnknownConnection`] if there is no such connection,
    /// [`PostError::NotProtected`] if it does not use packet protection.
    pub fn update_keys(&mut self, conn: ConnectionHandle) -> Result<bool, PostError> {
        let c = self
            .conns
            .get_mut(&conn.0)
            .ok_or(PostError::UnknownConnection)?;
        let r = c.update_keys().ok_or(PostError::NotProtected)?;
        self.touched(conn.0);
        Ok(r)
    }

    /// Cancel the operation or posted receive with `wr_id` on `conn` (an application gave
    /// up on it: its future was dropped, its deadline passed).
    ///
    /// - A WRITE, READ or atomic not finished yet stops at once: its unsent packets are
    ///   never sent and an op abort (`MR_WRITE` with PathEth flags bit 1, docs/PROTOCOL.md
    ///   "Errors of one operation") tells the responder to count its op id as finished, so
    ///   the responder's op tracking does not wait for it. It completes with
    ///   [`WcStatus::WrFlushError`] in posting order, once the peer acknowledged the abort.
    ///   From this call on the core never writes into a READ's or atomic's local
    ///   destination (late responses are acknowledged and discarded). After the
    ///   completion, no byte of a cancelled WRITE lands (what landed before stays; the
    ///   target range is undefined, as after any failed WRITE), and a cancelled READ or
    ///   atomic either was executed by the peer before the abort reached it (an atomic may
    ///   have run) or never will be.
    /// - A posted receive no message has begun landing in is withdrawn: it completes with
    ///   `WrFlushError` ([`Event::RecvCompletion`]) and the stream's next message takes the
    ///   next receive. If a message is landing in it, it is not withdrawn
    ///   ([`CancelOutcome::Finishing`]): it completes normally, with the message.
    /// - SENDs are not cancellable ([`CancelOutcome::NotCancellable`]): their message
    ///   sequence numbers order the stream.
    ///
    /// Completions that become due are queued as events before this returns.
    ///
    /// Cost: O(log queue) to find a WRITE, READ or atomic while the connection's work
    /// request ids have been posted in nondecreasing order (repeats allowed; metaroce-tokio
    /// posts them so), O(queue) once one was smaller than the one before. A posted receive
    /// is searched among every stream's posted receives, O(streams + posted receives):
    /// [`cancel_recv`](Self::cancel_recv), given the stream, searches only there.
    pub fn cancel(&mut self, _now: Instant, conn: ConnectionHandle, wr_id: u64) -> CancelOutcome {
        let Some(c) = self.conns.get_mut(&conn.0) else {
            return CancelOutcome::Unknown;
        };
        let out = c.cancel(wr_id, &mut self.events);
        self.touched(conn.0);
        out
    }

    /// Withdraw the receive `wr_id` posted on `stream` of `conn` ([`post_recv`](Self::post_recv)),
    /// as [`cancel`](Self::cancel) does for a posted receive: [`CancelOutcome::Cancelled`]
    /// if no message had begun landing in it (nor in a receive posted after it on the
    /// stream): it completes with [`WcStatus::WrFlushError`] ([`Event::RecvCompletion`],
    /// queued before this returns) and the stream's next message takes the next receive;
    /// [`CancelOutcome::Finishing`] if a message is landing in it (it completes normally,
    /// with the message) or it was flushed already; [`CancelOutcome::Unknown`] if no such
    /// receive is posted on that stream. The send queue is not searched.
    ///
    /// Cost: O(the stream's posted receives + its messages in reassembly), whatever the
    /// number of streams (an application dropping a receive on each of n streams pays
    /// O(n), where `cancel` would pay O(n²)).
    pub fn cancel_recv(
        &mut self,
        _now: Instant,
        conn: ConnectionHandle,
        stream: u32,
        wr_id: u64,
    ) -> CancelOutcome {
        let Some(c) = self.conns.get_mut(&conn.0) else {
            return CancelOutcome::Unknown;
        };
        let out = c.cancel_recv(stream, wr_id, &mut self.events);
        self.touched(conn.0);
        out
    }

    /// Cancels, as [`cancel`](Self::cancel) does, every WRITE, READ or atomic of `conn`
    /// not finished yet whose work request id is in `wr_ids` (in any order), in one pass
    /// over the send queue: O(queue + n log n), where `n` calls of `cancel` cost
    /// O(n · queue) unless the ids were posted in order. Where an id names several unfinished operations (ids may repeat),
    /// all of them are cancelled (`cancel` takes the oldest). SENDs and posted receives are
    /// not touched, and no per-id outcome is reported. Returns how many operations were
    /// cancelled; 0 for an unknown connection. Completions that become due are queued as
    /// events before it returns.
    pub fn cancel_many(&mut self, _now: Instant, conn: ConnectionHandle, wr_ids: &[u64]) -> usize {
        let Some(c) = self.conns.get_mut(&conn.0) else {
            return 0;
        };
        let n = c.cancel_many(wr_ids, &mut self.events);
        self.touched(conn.0);
        n
    }

    /// Close a connection now, with code 0 and no reason: the same as
    /// [`abort`](Self::abort)`(now, conn, 0, &[])`. Unknown handles are ignored.
    pub fn close(&mut self, now: Instant, conn: ConnectionHandle) {
        let _ = self.abort(now, conn, 0, &[]);
    }

    /// Close a connection gracefully with an application `code` and `reason` (at most
    /// [`MAX_CLOSE_REASON`] bytes), as quinn's `Connection::close` and a TCP FIN do:
    ///
    /// 1. From now on new posts on the connection are refused with
    ///    [`PostError::Closing`]; operations already posted (and the responses this side
    ///    owes the peer) go on until they complete, for at most
    ///    `TransportConfig::close_timeout`. Incoming data is still handled meanwhile.
    /// 2. Then what is still pending completes with `WrFlushError`, posted receives are
    ///    flushed, [`Event::ConnectionLost`] with [`ConnectionError::LocallyClosed`] is
    ///    reported and every per-connection structure is freed.
    /// 3. The peer is sent an `MR_CLOSE` carrying `code` (CloseEth reason) and `reason`
    ///    (payload), retransmitted until the peer answers or `close_attempts` copies went
    ///    out; it reports [`ConnectionError::ClosedByPeer`] with the same code and bytes.
    ///
    /// A connection still connecting is closed at once (the peer holds nothing yet worth
    /// telling). Calling it again while the close drains changes nothing.
    ///
    /// # Errors
    /// [`PostError::UnknownConnection`] for a handle with no connection;
    /// [`PostError::ReasonTooLong`] if `reason` exceeds [`MAX_CLOSE_REASON`] (nothing is
    /// done then).
    pub fn close_with(
        &mut self,
        now: Instant,
        conn: ConnectionHandle,
        code: u32,
        reason: &[u8],
    ) -> Result<(), PostError> {
        check_close_reason(reason)?;
        let timeout = self.cfg.transport.close_timeout;
        let c = self
            .conns
            .get_mut(&conn.0)
            .ok_or(PostError::UnknownConnection)?;
        if c.state != State::Established {
            return self.abort(now, conn, code, reason);
        }
        if c.closing.is_none() {
            c.closing = Some(crate::conn::Closing {
                code,
                reason: Bytes::copy_from_slice(reason),
                deadline: now + timeout,
            });
            tracing::debug!(%conn, code, "closing: draining");
        }
        self.touched(conn.0);
        self.progress_close(now, conn.0);
        Ok(())
    }

    /// Close a connection at once with an application `code` and `reason`: pending
    /// operations complete with `WrFlushError` and posted receives are flushed now,
    /// [`Event::ConnectionLost`] with [`ConnectionError::LocallyClosed`] follows, and the
    /// peer is sent an `MR_CLOSE` as by [`close_with`](Self::close_with) (retransmitted
    /// until answered). Also ends a graceful close early. A connection accepted
    /// ([`accept_incoming`](Self::accept_incoming)) whose Accept has not gone out yet is
    /// refused instead: the requester gets a CONNECT Reject with `code` and `reason`
    /// (before the Accept it cannot authenticate an MR_CLOSE).
    ///
    /// # Errors
    /// [`PostError::UnknownConnection`], [`PostError::ReasonTooLong`] as for
    /// [`close_with`](Self::close_with).
    pub fn abort(
        &mut self,
        now: Instant,
        conn: ConnectionHandle,
        code: u32,
        reason: &[u8],
    ) -> Result<(), PostError> {
        check_close_reason(reason)?;
        if !self.conns.contains_key(&conn.0) {
            return Err(PostError::UnknownConnection);
        }
        self.finish_close(now, conn.0, code, Bytes::copy_from_slice(reason));
        Ok(())
    }

    /// A gracefully closing connection `q` finished draining, or its `close_timeout`
    /// passed: end it.
    fn progress_close(&mut self, now: Instant, q: u32) {
        let Some(c) = self.conns.get(&q) else { return };
        let Some(cl) = &c.closing else { return };
        if now >= cl.deadline || !c.sq.has_pending() {
            let (code, reason) = (cl.code, cl.reason.clone());
            self.finish_close(now, q, code, reason);
        }
    }

    /// Remove connection `q` as closed locally and start sending its MR_CLOSE.
    ///
    /// The ACKs the connection still owes go out first: a message it received just before
    /// the close (its Message event already reported) is acknowledged ahead of the MR_CLOSE,
    /// so on a link that keeps order the sender completes that operation with `Success`
    /// rather than flushing it when the MR_CLOSE arrives. (With loss or reordering the
    /// sender may still fail it: conservative, never a false success.)
    fn finish_close(&mut self, now: Instant, q: u32, code: u32, reason: Bytes) {
        let Some(c) = self.conns.get(&q) else {
            return;
        };
        // An Accept due (`accept_pending`) and never sent: the client, still without the
        // server's nonce, could not take an MR_CLOSE (its token is unknown to it) and
        // would time out its handshake; refuse the request instead, with the close's code
        // and reason (found by a new user's trial: an accepted connection dropped at once
        // showed the client `HandshakeTimeout` after 2 s). An Accept due again (a
        // duplicate Request, the half-open timer) after one went out: the client may be
        // connected, and ignores a Reject then; it gets the MR_CLOSE as well.
        let (reject, close) = (
            c.accept_pending,
            c.state == State::Established && (!c.accept_pending || c.accepts_sent > 0),
        );
        if reject {
            self.send_reject(q, code, reason.clone());
        }
        let Some(c) = self.conns.get_mut(&q) else {
            return;
        };
        if close {
            let mut b = Vec::new();
            while let Some(t) = c.poll_ack(now, &mut b) {
                if self.sealed_control.len() >= self.cfg.max_control_queue {
                    self.stats.control_dropped += 1;
                    continue;
                }
                self.sealed_control.push_back((t, std::mem::take(&mut b)));
            }
            let t = &self.cfg.transport;
            let interval = c.largest_rto().max(t.min_rto);
            let (tx_token, rx_token) = c.tokens();
            let sealed = if c.is_protected() {
                let port = self.cfg.source_ports[0];
                let attempts = t.close_attempts;
                let reply_port = self.cfg.local_addr.port();
                let (bth, hdrs) = close_packet(c.peer_qpn, code, false, reply_port, c.nonce);
                let c = self.conns.get_mut(&q).expect("looked up above");
                (0..attempts)
                    .filter_map(|_| {
                        let mut b = Vec::new();
                        c.emit(&mut b, port, &bth, &hdrs, &reason).map(|_| b)
                    })
                    .collect()
            } else {
                Vec::new()
            };
            let Some(c) = self.conns.get(&q) else { return };
            let closer = Closer {
                peer: c.peer,
                peer_qpn: c.peer_qpn,
                local_ip: c.local_ip,
                tx_token,
                rx_token,
                sealed,
                code,
                reason,
                sent: 0,
                interval,
                next_at: None,
            };
            let nonce = c.nonce;
            self.forget_closer(nonce);
            self.closers.insert(nonce, closer);
            self.close_ready.push_back(nonce);
        }
        let _ = now;
        self.remove(
            ConnectionHandle(q),
            ConnectionError::LocallyClosed,
            WcStatus::WrFlushError,
        );
    }

    /// Drop the record of a close (answered, or out of attempts).
    fn forget_closer(&mut self, nonce: u64) {
        if let Some(cl) = self.closers.remove(&nonce) {
            if let Some(t) = cl.next_at {
                self.close_timers.remove(&(t, nonce));
            }
        }
    }

    /// Sizes of the per-connection tables: for checking that connections that ended left
    /// nothing behind (e.g. over many connect/close cycles).
    pub fn table_sizes(&self) -> TableSizes {
        TableSizes {
            connections: self.conns.len(),
            nonces: self.by_nonce.len(),
            index: self.timers.len() + self.recent_rx.len(),
            timers: self
                .timers
                .iter()
                .filter(|(_, q)| !self.is_stale(*q))
                .count()
                + self
                    .stale
                    .iter()
                    .filter(|q| self.is_stale(**q))
                    .filter(|q| {
                        self.conns
                            .get(q)
                            .is_some_and(|c| c.next_timeout().is_some())
                    })
                    .count(),
            ready: self.ready.len(),
            recent_rx: self.recent_rx.len(),
            closers: self.closers.len(),
            control: self.control.len(),
            events: self.events.len(),
        }
    }

    /// An MR_CLOSE arrived for local QPN `dest_qp`. Like every non-CONNECT packet it must
    /// carry the connection's token (issue #9): a close, or the answer to ours, that does
    /// not is counted and dropped, so an off-path sender can neither end a connection nor
    /// stop a close from being retransmitted.
    #[allow(clippy::too_many_arguments)]
    fn handle_close(
        &mut self,
        from: SocketAddr,
        local_ip: Option<IpAddr>,
        dest_qp: u32,
        msg: &wire::CloseEth,
        trailer: &Trailer,
        opened: bool,
        payload: &[u8],
    ) {
        let token_ok = |expected: u64| match trailer {
            Trailer::Token(t) => secret::ct_eq_u64(*t, expected),
            _ => false,
        };
        if msg.is_ack() {
            // The answer to our close: stop retransmitting it.
            match self.closers.get(&msg.nonce) {
                Some(cl) if cl.peer.ip() == from.ip() && token_ok(cl.rx_token) => {
                    self.forget_closer(msg.nonce);
                }
                Some(cl) if cl.peer.ip() == from.ip() => self.stats.bad_auth += 1,
                _ => self.stats.unknown_connection += 1,
            }
            return;
        }
        let mut answer = None;
        match self.conns.get(&dest_qp) {
            Some(c) if c.nonce == msg.nonce && c.peer.ip() == from.ip() => {
                // `opened`: an AEAD connection's close, already verified by `open`. Any
                // other close of an AEAD connection is refused by `authenticate`.
                if !opened {
                    if let Err(e) = c.authenticate(trailer) {
                        count_auth_error(&mut self.stats, e, c.is_protected());
                        return;
                    }
                }
                if c.is_protected() {
                    let (bth, hdrs) = close_packet(
                        c.peer_qpn,
                        msg.reason,
                        true,
                        self.cfg.local_addr.port(),
                        msg.nonce,
                    );
                    let port = self.cfg.source_ports[0];
                    let mut b = Vec::new();
                    let peer = c.peer;
                    if let Some(c) = self.conns.get_mut(&dest_qp) {
                        if c.emit(&mut b, port, &bth, &hdrs, &[]).is_some()
                            && self.sealed_control.len() < self.cfg.max_control_queue
                        {
                            let t = Transmit {
                                destination: peer,
                                src_port: port,
                                ecn: None,
                                size: b.len(),
                                segment_size: None,
                            };
                            self.sealed_control.push_back((t, b));
                        }
                    }
                } else {
                    answer = Some((c.peer, c.peer_qpn, c.local_ip, c.tx_token()));
                }
                let n = payload.len().min(MAX_CLOSE_REASON);
                let reason = ConnectionError::ClosedByPeer {
                    code: msg.reason,
                    reason: Bytes::copy_from_slice(&payload[..n]),
                };
                self.remove(ConnectionHandle(dest_qp), reason, WcStatus::WrFlushError);
            }
            Some(_) => self.stats.unknown_connection += 1,
            None => {
                // Already gone. If both sides closed at once, the peer's close is the answer
                // to ours: stop ours and answer it. A close for a connection we no longer
                // know cannot be authenticated: it is not answered (the peer's
                // retransmissions are bounded by its `close_attempts`).
                match self.closers.get(&msg.nonce) {
                    Some(cl) if cl.peer.ip() == from.ip() && token_ok(cl.rx_token) => {
                        let a = (cl.peer, cl.peer_qpn, cl.local_ip, cl.tx_token);
                        self.forget_closer(msg.nonce);
                        answer = Some(a);
                    }
                    Some(_) => self.stats.bad_auth += 1,
                    None => self.stats.unknown_connection += 1,
                }
            }
        }
        if let Some((peer, peer_qpn, lip, tx)) = answer {
            let (bth, hdrs) = close_packet(
                peer_qpn,
                msg.reason,
                true,
                self.cfg.local_addr.port(),
                msg.nonce,
            );
            self.push_control(peer, bth, hdrs, Trailer::Token(tx), lip.or(local_ip));
        }
    }

    /// Accept a connection held by [`EndpointConfig::manual_accept`]: the CONNECT Accept
    /// goes out with the next `poll_transmit`. `false` if there is no such held connection
    /// (it was refused, closed, or accepted already).
    pub fn accept_incoming(&mut self, conn: ConnectionHandle) -> bool {
        let Some(c) = self.conns.get_mut(&conn.0) else {
            return false;
        };
        if !c.held {
            return false;
        }
        c.held = false;
        c.accept_pending = true;
        self.touched(conn.0);
        true
    }

    /// Refuse a connection held by [`EndpointConfig::manual_accept`]: the peer's request is
    /// answered with a CONNECT Reject carrying `code` and `reason` (the `MR_CONNECT`
    /// payload, docs/PROTOCOL.md "ConnectEth"); the requester's connection ends with
    /// [`ConnectionError::Rejected`]` { code, reason }`, the connection is removed here and
    /// [`Event::ConnectionLost`] with the same error follows.
    ///
    /// # Errors
    /// [`PostError::ReasonTooLong`] if `reason` exceeds [`MAX_CLOSE_REASON`] bytes (the
    /// close-reason rule; nothing is sent and the connection stays held);
    /// [`PostError::UnknownConnection`] if there is no such held connection (accepted,
    /// refused or ended already).
    pub fn refuse_incoming(
        &mut self,
        conn: ConnectionHandle,
        code: u32,
        reason: &[u8],
    ) -> Result<(), PostError> {
        let Some(c) = self.conns.get(&conn.0) else {
            return Err(PostError::UnknownConnection);
        };
        if !c.held {
            return Err(PostError::UnknownConnection);
        }
        check_close_reason(reason)?;
        self.send_reject(conn.0, code, Bytes::copy_from_slice(reason));
        self.remove(
            conn,
            ConnectionError::Rejected {
                code,
                reason: Bytes::copy_from_slice(reason),
            },
            WcStatus::WrFlushError,
        );
        Ok(())
    }

    /// Answer connection `q`'s request with a CONNECT Reject carrying the application's
    /// `code` and `reason` (the Reject a refusal by configuration sends, docs/PROTOCOL.md
    /// CONNECT): the requester's connect fails with `Rejected { code, reason }`.
    fn send_reject(&mut self, q: u32, code: u32, reason: Bytes) {
        let Some(c) = self.conns.get(&q) else { return };
        let (bth, hdrs) = c.connect_packet(ConnectKind::Reject, code);
        let hdrs = match hdrs {
            Headers::Connect(m) => Headers::Connect(ConnectEth { src_qpn: 0, ..m }),
            h => h,
        };
        let (peer, lip) = (c.peer, c.local_ip);
        self.push_control_with(peer, bth, hdrs, reason, Trailer::None, lip);
        self.stats.rejected += 1;
    }

    fn remove(&mut self, conn: ConnectionHandle, reason: ConnectionError, first: WcStatus) {
        if let Some(mut c) = self.conns.remove(&conn.0) {
            self.forget(conn.0, c.ix);
            c.flush(first, &mut self.events);
            if self.by_nonce.get(&c.nonce) == Some(&conn.0) {
                self.by_nonce.remove(&c.nonce);
                if c.held {
                    // Refused, or ended before the application decided: its Request may
                    // come again (the Reject was lost) and is decided again.
                    self.cookie_nonces.remove(&c.nonce);
                }
            }
            if self.by_peer_qpn.get(&(c.peer, c.peer_qpn)) == Some(&conn.0) {
                self.by_peer_qpn.remove(&(c.peer, c.peer_qpn));
            }
            self.half_open.remove(&conn.0);
            tracing::debug!(%conn, %reason, "connection lost");
            self.events
                .push_back(Event::ConnectionLost { conn, reason });
        }
    }

    fn apply(&mut self, conn: ConnectionHandle, out: Outcome) {
        if let Some(reason) = out.lost {
            let first = if reason == ConnectionError::RetryExceeded {
                WcStatus::RetryExceeded
            } else {
                WcStatus::WrFlushError
            };
            self.remove(conn, reason, first);
        }
    }

    // ---- the driving contract ----

    /// Feed one received UDP datagram: `from` is the sender's address, `local_ip` the
    /// address it was sent to (if the I/O layer knows it), `ecn` the IP ECN codepoint.
    /// Malformed or unexpected input is counted (see [`stats`](Self::stats)) and dropped;
    /// this never panics.
    pub fn handle_datagram(
        &mut self,
        now: Instant,
        from: SocketAddr,
        local_ip: Option<IpAddr>,
        ecn: Option<EcnCodepoint>,
        data: &[u8],
    ) {
        self.epoch(now);
        self.stats.datagrams_received += 1;
        // A dual-stack socket (bound to `[::]`) reports an IPv4 peer as `::ffff:a.b.c.d`:
        // the peer is the IPv4 address, as `connect` names it and as the ICRC covers it.
        let from = SocketAddr::new(wire::icrc::canonical(from.ip()), from.port());
        let local_ip = local_ip.map(wire::icrc::canonical);
        // Borrowed from the parse result, not moved out of it (issue #13: a 184-byte copy
        // per datagram).
        let parsed = wire::Packet::parse(data);
        let pkt = match &parsed {
            Ok(p) => p,
            Err(e) => {
                self.stats.malformed += 1;
                tracing::trace!(%from, error = %e, "malformed datagram");
                return;
            }
        };
        if crate::rocev2::is_rc_opcode(pkt.bth.opcode)
            || (pkt.bth.opcode == wire::Opcode::CNP && self.rc.has_qp(pkt.bth.dest_qp))
        {
            // Standard RC opcodes, and CNPs addressed to an RC QP, belong to the RC queue
            // pairs (`Endpoint::rc`).
            let dst = local_ip.or(self.local_ip());
            self.rc
                .handle_datagram(now, from, dst, ecn, data, &mut self.mrs);
            return;
        }
        if self.cfg.transport.verify_icrc {
            if let Some(dst) = local_ip.or(self.local_ip()) {
                if let Ok(ip) = icrc::IpHeader::synthesized(from.ip(), dst) {
                    if icrc::verify(&ip, from.port(), self.cfg.local_addr.port(), data).is_err() {
                        self.stats.bad_icrc += 1;
                        return;
                    }
                }
            }
        }
        if !pkt.bth.opcode.is_metaroce() {
            self.stats.unsupported += 1;
            return;
        }
        if let Headers::Connect(msg) = &pkt.headers {
            self.stats.handshake_bytes_in += data.len() as u64;
            self.handle_connect(now, from, local_ip, pkt.bth.dest_qp, msg, pkt.payload);
            return;
        }
        if let Headers::Close(msg) = &pkt.headers {
            // A close for an AEAD connection is opened like any of its packets first (below).
            let protected = self
                .conns
                .get(&pkt.bth.dest_qp)
                .is_some_and(|c| c.is_protected() && c.peer.ip() == from.ip());
            if !protected {
                self.handle_close(
                    from,
                    local_ip,
                    pkt.bth.dest_qp,
                    msg,
                    &pkt.trailer,
                    false,
                    pkt.payload,
                );
                return;
            }
        }
        let qpn = pkt.bth.dest_qp;
        let Some(c) = self.conns.get_mut(&qpn) else {
            self.stats.unknown_connection += 1;
            return;
        };
        if c.peer.ip() != from.ip() {
            self.stats.unknown_connection += 1;
            return;
        }
        // Identity (issue #9): the trailer token (or, with AEAD, the trailer kind) is
        // checked in constant time before the connection sees the packet; a miss is counted
        // and dropped.
        if let Err(e) = c.authenticate(&pkt.trailer) {
            count_auth_error(&mut self.stats, e, c.is_protected());
            return;
        }
        if c.is_protected() {
            // AEAD: verify (and decrypt, in a copy) before any connection state is touched.
            let mut plain = std::mem::take(&mut self.scratch);
            plain.clear();
            plain.extend_from_slice(data);
            match c.open(&mut plain) {
                Ok(o) => {
                    if o.key_updated {
                        self.stats.key_updates += 1;
                    }
                }
                Err(e) => {
                    match e {
                        OpenError::Replay | OpenError::TooOld | OpenError::KeyDiscarded => {
                            self.stats.aead_replays += 1
                        }
                        OpenError::Auth | OpenError::Malformed => {
                            self.stats.aead_auth_failures += 1
                        }
                    }
                    self.scratch = plain;
                    return;
                }
            }
            if !c.confirmed {
                c.on_authenticated();
                self.half_open.remove(&qpn);
            }
            // The layout is unchanged by decryption, so this parses as before.
            if let Ok(pkt) = wire::Packet::parse(&plain) {
                if let Headers::Close(msg) = &pkt.headers {
                    let (msg, payload) = (*msg, pkt.payload.to_vec());
                    self.scratch = plain;
                    self.handle_close(from, local_ip, qpn, &msg, &Trailer::None, true, &payload);
                    return;
                }
                set_endpoint_recv(&self.recv_total, &self.cfg, c);
                let out =
                    c.handle_packet(now, local_ip, ecn, &pkt, &mut self.mrs, &mut self.events);
                recount_recv(&mut self.recv_total, c);
                self.touched(qpn);
                self.apply(ConnectionHandle(qpn), out);
            }
            self.scratch = plain;
            return;
        }
        if !c.confirmed {
            c.on_authenticated();
            self.half_open.remove(&qpn);
        }
        set_endpoint_recv(&self.recv_total, &self.cfg, c);
        let out = c.handle_packet(now, local_ip, ecn, pkt, &mut self.mrs, &mut self.events);
        recount_recv(&mut self.recv_total, c);
        Self::touch_conn(
            c,
            qpn,
            &mut self.stale,
            &mut self.recent_rx,
            &mut self.fair_share_at,
            &mut self.ready,
        );
        let closing = c.closing.is_some();
        self.apply(ConnectionHandle(qpn), out);
        if closing {
            self.progress_close(now, qpn);
        }
    }

    /// Queue an endpoint-generated packet (Retry, Reject, CLOSE), bounded by
    /// `max_control_queue`.
    fn push_control(
        &mut self,
        dest: SocketAddr,
        bth: Bth,
        hdrs: Headers,
        t: Trailer,
        ip: Option<IpAddr>,
    ) {
        self.push_control_with(dest, bth, hdrs, Bytes::new(), t, ip);
    }

    /// [`push_control`](Self::push_control) with a payload (a Reject's reason, at most
    /// [`MAX_CLOSE_REASON`] bytes).
    fn push_control_with(
        &mut self,
        dest: SocketAddr,
        bth: Bth,
        hdrs: Headers,
        payload: Bytes,
        t: Trailer,
        ip: Option<IpAddr>,
    ) {
        if self.control.len() < self.cfg.max_control_queue {
            self.control.push_back(ControlPacket {
                dest,
                bth,
                hdrs,
                payload,
                trailer: t,
                local_ip: ip,
            });
        } else {
            self.stats.control_dropped += 1;
        }
    }

    /// The retry-cookie time bucket of `now`.
    fn cookie_bucket(&self, now: Instant) -> u64 {
        let life = self.cfg.retry_cookie_lifetime.as_nanos().max(1);
        let since = self
            .epoch
            .map_or(0, |e| now.saturating_duration_since(e).as_nanos());
        (since / life) as u64
    }

    fn cookie_valid(&self, now: Instant, peer: SocketAddr, msg: &ConnectEth) -> bool {
        let b = self.cookie_bucket(now);
        [b, b.wrapping_sub(1)].iter().any(|&bucket| {
            let c = secret::cookie(&self.cookie_key, peer, msg.nonce, msg.src_qpn, bucket);
            secret::ct_eq(&c, &msg.cookie)
        })
    }

    /// Forgets the Requests of `cookie_requests` whose cookies no longer
    /// validate in `bucket`: a cookie accepted in bucket `b` was made in `b` or `b - 1` and
    /// is good until the end of `b + 1` at the latest.
    fn expire_cookie_requests(&mut self, bucket: u64) {
        while let Some(&(b, nonce)) = self.cookie_requests.front() {
            if b.saturating_add(1) >= bucket {
                break;
            }
            self.cookie_requests.pop_front();
            self.forget_cookie_nonce(nonce, b);
        }
    }

    /// Removes `nonce` from `cookie_nonces` if it is there for `bucket` (not for a later
    /// Request that reused a nonce forgotten early, see `remove`).
    fn forget_cookie_nonce(&mut self, nonce: u64, bucket: u64) {
        if self.cookie_nonces.get(&nonce) == Some(&bucket) {
            self.cookie_nonces.remove(&nonce);
        }
    }

    fn handle_request(
        &mut self,
        now: Instant,
        from: SocketAddr,
        local_ip: Option<IpAddr>,
        msg: &ConnectEth,
    ) {
        // The client's listening address: the source IP (never another) and the port the
        // Request names, which the retry cookie round trip validates.
        let peer = SocketAddr::new(from.ip(), msg.listen_port);
        let reply = |kind: ConnectKind, reason: u32, cookie: [u8; 16]| {
            let mut m = ConnectEth::new(kind);
            m.dst_qpn = msg.src_qpn;
            m.nonce = msg.nonce;
            m.reason = reason;
            m.cookie = cookie;
            (
                Bth::new(Opcode::MR_CONNECT, msg.src_qpn, 0),
                Headers::Connect(m),
            )
        };
        let load = self.conns.len();
        let need_cookie = match self.cfg.retry {
            RetryPolicy::Always => true,
            RetryPolicy::AboveLoad(n) => load >= n,
            RetryPolicy::Never => false,
        };
        let validated = !need_cookie || self.cookie_valid(now, peer, msg);
        // A Request for an identity we already accepted: a duplicate or a retransmission.
        // If the client has not confirmed yet, our Accept was lost: send it again. Either
        // way create nothing. (A restarted client with the *same* nonce — the same secret
        // seed — cannot be told from a late duplicate; it is never merged with the old
        // connection either: it gets no Accept until that one has ended.)
        if let Some(&q) = self.by_nonce.get(&msg.nonce) {
            if let Some(c) = self.conns.get_mut(&q) {
                let same_ip = c.peer.ip() == peer.ip();
                if c.peer == peer && c.peer_qpn == msg.src_qpn && !c.confirmed && validated {
                    c.accept_pending = true;
                    self.touched(q);
                }
                if same_ip {
                    return;
                }
            }
        }
        if !validated {
            if msg.cookie != [0; 16] {
                self.stats.bad_cookie += 1;
            }
            let b = self.cookie_bucket(now);
            let cookie = secret::cookie(&self.cookie_key, peer, msg.nonce, msg.src_qpn, b);
            let (bth, hdrs) = reply(ConnectKind::Retry, 0, cookie);
            self.stats.retries_sent += 1;
            self.push_control(peer, bth, hdrs, Trailer::None, local_ip);
            return;
        }
        // A validated Request whose nonce created a connection that has since ended (the
        // live ones returned above): a replay of a captured handshake while its cookie is
        // still good, or a late duplicate. Its client never asks twice with one nonce.
        let bucket = self.cookie_bucket(now);
        self.expire_cookie_requests(bucket);
        if need_cookie && self.cookie_nonces.contains_key(&msg.nonce) {
            self.stats.replayed_requests += 1;
            return;
        }
        // A validated Request with a new nonce from the address and QPN of a live
        // connection: the client restarted (its endpoint cannot hold two connections with
        // one QPN). End the old incarnation; never merge the two (issue #9).
        if let Some(&q) = self.by_peer_qpn.get(&(peer, msg.src_qpn)) {
            let restarted = self.conns.get(&q).is_some_and(|c| c.nonce != msg.nonce);
            if restarted {
                self.stats.peer_restarts += 1;
                self.remove(
                    ConnectionHandle(q),
                    ConnectionError::PeerRestarted,
                    WcStatus::WrFlushError,
                );
            }
        }
        let valid = msg.paths > 0 && (256..=4096).contains(&msg.pmtu) && msg.pmtu.is_power_of_two();
        let source = source_key(peer.ip());
        // A half-open table whose oldest entry is younger than a handshake interval:
        // evicting it could push out a client still inside its round trip, so a flood that
        // fast is refused instead, with TRY_AGAIN (the client sends its Request again on
        // its handshake timer and gets in when a slot turns over; without the flag a flood
        // at 10x the turnover failed 18 of 20 connects for good, found by review).
        let young = self.half_open.len() >= self.cfg.max_half_open
            && self.half_open.oldest().is_none_or(|(_, at)| {
                now.saturating_duration_since(at) < self.cfg.transport.handshake_interval
            });
        let conns_full = self.conns.len() >= self.cfg.max_connections;
        let reason = if !self.cfg.accept_incoming {
            Some(ConnectEth::REASON_NOT_ACCEPTING)
        } else if conns_full || young {
            Some(ConnectEth::REASON_LIMIT)
        } else if self.half_open.from(source) >= self.cfg.max_half_open_per_source {
            self.stats.source_limited += 1;
            Some(ConnectEth::REASON_SOURCE_LIMIT)
        } else if !valid || msg.version != crate::conn::PROTOCOL_VERSION {
            Some(ConnectEth::REASON_INVALID)
        } else if crate::conn::aead_flag(msg) != self.cfg.transport.packet_protection.is_some() {
            // No silent downgrade in either direction.
            Some(ConnectEth::REASON_AEAD_MISMATCH)
        } else {
            None
        };
        if let Some(r) = reason {
            self.stats.rejected += 1;
            let (bth, mut hdrs) = reply(ConnectKind::Reject, r, [0; 16]);
            if let Headers::Connect(m) = &mut hdrs {
                // Reason 2 without the connection limit reached is the young table's.
                let busy_for_now = r == ConnectEth::REASON_SOURCE_LIMIT
                    || (r == ConnectEth::REASON_LIMIT && !conns_full);
                if busy_for_now {
                    m.flags |= ConnectEth::FLAG_TRY_AGAIN;
                }
            }
            self.push_control(peer, bth, hdrs, Trailer::None, local_ip);
            return;
        }
        // A full half-open table makes room by dropping the half-open connection that
        // arrived first (at least a handshake interval ago, checked above). Refusing the
        // new Request instead let many sources that never confirm (one IPv6 host owns a
        // /64 of them) lock every other client out while they kept the table full; now
        // each half-open connection has at least a handshake interval, and otherwise the
        // time the flood takes to send `max_half_open` Requests, to finish its round
        // trip. Not for `max_connections` (refused above): with few connections
        // half-open, one Request would push out a client mid-handshake (found by review).
        if self.half_open.len() >= self.cfg.max_half_open {
            if let Some((q, _)) = self.half_open.oldest() {
                self.evict_half_open(q);
            }
        }
        let epoch = self.epoch(now);
        let qpn = self.new_qpn();
        let init_psn = self.initial_psn();
        let server_nonce = self.secret.next_u64();
        let mut conn = Connection::new_incoming(
            ConnectionHandle(qpn),
            now,
            epoch,
            peer,
            local_ip.or(self.local_ip()),
            self.cfg.local_addr.port(),
            self.cfg.source_ports.clone(),
            init_psn,
            self.cfg.transport.clone(),
            self.tables,
            msg,
            server_nonce,
        );
        // `manual_accept`: the application decides (`accept_incoming`/`refuse_incoming`);
        // until then the connection sends nothing, not even its Accept.
        conn.held = self.cfg.manual_accept;
        self.conns.insert(qpn, conn);
        self.touched(qpn);
        self.by_nonce.insert(msg.nonce, qpn);
        if need_cookie {
            let cap = self.cfg.max_connections + self.cfg.max_half_open;
            while self.cookie_requests.len() >= cap {
                if let Some((b, old)) = self.cookie_requests.pop_front() {
                    self.forget_cookie_nonce(old, b);
                }
            }
            self.cookie_requests.push_back((bucket, msg.nonce));
            self.cookie_nonces.insert(msg.nonce, bucket);
        }
        self.by_peer_qpn.insert((peer, msg.src_qpn), qpn);
        self.half_open.insert(qpn, source, now);
        tracing::debug!(conn = %ConnectionHandle(qpn), %peer, "accepted connection");
        self.events
            .push_back(Event::Incoming(ConnectionHandle(qpn)));
    }

    /// Drop half-open connection `q` to make room for a new one
    /// (`EndpointStats::half_open_evicted`). It ends with `HandshakeTimeout` here. Its
    /// client, if it may have the Accept, gets one MR_CLOSE with code 1 (as for a ghost
    /// connection; not for an AEAD connection, whose CLOSE would need sealing: that client
    /// finds out by its own timeouts). One whose Request the application had not decided
    /// on (held) got no Accept: `remove` forgets its nonce, so its Request, sent again,
    /// is decided afresh. Otherwise the nonce stays known, so a captured copy of the
    /// Request replayed while its cookie is valid creates nothing (found by review:
    /// forgetting it let each replay open a connection its client never asked for); a
    /// client whose Accept was lost and that was evicted then ends with
    /// `HandshakeTimeout` and connects again with a new nonce.
    fn evict_half_open(&mut self, q: u32) {
        let Some(c) = self.conns.get(&q) else {
            self.half_open.remove(&q);
            return;
        };
        self.stats.half_open_evicted += 1;
        if !c.held && !c.is_protected() {
            let (bth, hdrs) =
                close_packet(c.peer_qpn, 1, false, self.cfg.local_addr.port(), c.nonce);
            let (peer, token, local_ip) = (c.peer, c.tx_token(), c.local_ip);
            self.push_control(peer, bth, hdrs, Trailer::Token(token), local_ip);
        }
        self.remove(
            ConnectionHandle(q),
            ConnectionError::HandshakeTimeout,
            WcStatus::WrFlushError,
        );
    }

    fn handle_connect(
        &mut self,
        now: Instant,
        from: SocketAddr,
        local_ip: Option<IpAddr>,
        dest_qp: u32,
        msg: &ConnectEth,
        payload: &[u8],
    ) {
        match msg.kind {
            ConnectKind::Request => self.handle_request(now, from, local_ip, msg),
            ConnectKind::Confirm => {
                let Some(c) = self.conns.get_mut(&dest_qp) else {
                    self.stats.unknown_connection += 1;
                    return;
                };
                if c.peer.ip() != from.ip() || !c.on_confirm(msg) {
                    self.stats.unknown_connection += 1;
                    return;
                }
                self.half_open.remove(&dest_qp);
                self.touched(dest_qp);
            }
            ConnectKind::Accept | ConnectKind::Reject | ConnectKind::Retry => {
                // An Accept for a connection we do not have, or from a peer QPN other than
                // the one our connection is established with: a stale request reached a
                // restarted peer, or we gave up. Tell the peer to drop it (an MR_CLOSE
                // authenticated with the token of the Accept's identity, smaller than the
                // Accept), or it would keep a ghost connection until its half-open expiry.
                // (A late duplicate Retry or Reject for an established connection is not a
                // ghost: `on_connect` ignores it.)
                let ghost = match self.conns.get(&dest_qp) {
                    None => true,
                    Some(c) => {
                        msg.kind == ConnectKind::Accept
                            && c.state == State::Established
                            && c.peer_qpn != msg.src_qpn
                    }
                };
                if ghost && msg.kind == ConnectKind::Accept {
                    let peer = SocketAddr::new(from.ip(), msg.listen_port);
                    let (bth, hdrs) =
                        close_packet(msg.src_qpn, 1, false, self.cfg.local_addr.port(), msg.nonce);
                    let (c2s, _) = secret::tokens(msg.nonce, msg.server_nonce);
                    self.push_control(peer, bth, hdrs, Trailer::Token(c2s), local_ip);
                }
                let Some(c) = self.conns.get_mut(&dest_qp) else {
                    self.stats.unknown_connection += 1;
                    return;
                };
                if ghost {
                    self.stats.unknown_connection += 1;
                    return;
                }
                if c.peer.ip() != from.ip() {
                    self.stats.unknown_connection += 1;
                    return;
                }
                let out = c.on_connect(now, msg, payload, &mut self.events);
                self.touched(dest_qp);
                self.apply(ConnectionHandle(dest_qp), out);
            }
        }
    }

    // ---- per-connection indexes (timers, ready set, fair share) ----

    /// Connection `q` was handed input, a post or a timer: its deadline is marked stale
    /// (re-read by `flush_stale`) and it is asked in the next `poll_transmit`. Nothing if
    /// there is no such connection. O(log n).
    fn touched(&mut self, q: u32) {
        let Some(c) = self.conns.get_mut(&q) else {
            return;
        };
        Self::touch_conn(
            c,
            q,
            &mut self.stale,
            &mut self.recent_rx,
            &mut self.fair_share_at,
            &mut self.ready,
        );
    }

    /// [`touched`](Self::touched) for connection `q` = `c`, already looked up (the
    /// datagram and posting paths hold it: issue #13, one lookup per datagram or
    /// operation): [`mark_conn`](Self::mark_conn), and into `ready` unless it is there.
    #[inline]
    fn touch_conn(
        c: &mut Connection,
        q: u32,
        stale: &mut Vec<u32>,
        recent_rx: &mut BTreeSet<(Instant, u32)>,
        fair_share_at: &mut Option<Instant>,
        ready: &mut BTreeSet<u32>,
    ) {
        Self::mark_conn(c, q, stale, recent_rx, fair_share_at);
        if !std::mem::replace(&mut c.ix.ready, true) {
            ready.insert(q);
        }
    }

    /// Mark connection `q` = `c` touched: its deadline is stale (read later by
    /// `flush_stale`), and its last data arrival, which the fair share reads, is indexed
    /// now. O(log n) when the last data arrival changed.
    #[inline]
    fn mark_conn(
        c: &mut Connection,
        q: u32,
        stale: &mut Vec<u32>,
        recent_rx: &mut BTreeSet<(Instant, u32)>,
        fair_share_at: &mut Option<Instant>,
    ) {
        if !c.ix.stale {
            c.ix.stale = true;
            stale.push(q);
        }
        let last = c.last_data_rx;
        Self::index_data_rx(&mut c.ix, recent_rx, fair_share_at, q, last);
    }

    /// Keep connection `q`'s entry in `recent_rx` (issue #13: lazily). A connection that
    /// has an entry keeps it when its last data arrival moves on (a data packet moves it
    /// every time): the entry's time is then a lower bound of the real one, and
    /// [`update_fair_share`](Self::update_fair_share) re-reads the real time before it
    /// drops an entry that looks old. Only a connection without an entry is inserted (a
    /// new sender: the next grant must count it even at the same `now`). O(1) per data
    /// packet instead of a remove and an insert. `last`: the connection's `last_data_rx`.
    #[inline]
    fn index_data_rx(
        ix: &mut ConnIndex,
        recent_rx: &mut BTreeSet<(Instant, u32)>,
        fair_share_at: &mut Option<Instant>,
        q: u32,
        last: Option<Instant>,
    ) {
        if last == ix.data_rx {
            return;
        }
        ix.data_rx = last;
        match (ix.in_recent, last) {
            (None, Some(new)) => {
                recent_rx.insert((new, q));
                ix.in_recent = Some(new);
                *fair_share_at = None;
            }
            (Some(old), None) => {
                recent_rx.remove(&(old, q));
                ix.in_recent = None;
                *fair_share_at = None;
            }
            _ => {}
        }
    }

    /// Read the deadlines of the connections touched since the last call into `timers`.
    fn flush_stale(&mut self) {
        let mut stale = std::mem::take(&mut self.stale);
        for q in stale.drain(..) {
            self.refresh_if_stale(q);
        }
        self.stale = stale;
    }

    /// Read connection `q`'s deadline into `timers` if it is marked stale (one lookup).
    fn refresh_if_stale(&mut self, q: u32) {
        let Some(c) = self.conns.get_mut(&q) else {
            return;
        };
        if !c.ix.stale {
            return;
        }
        let next = c.next_timeout();
        c.ix.stale = false;
        // Unread bytes another call changed (a stream reset or stopped, a flush).
        recount_recv(&mut self.recv_total, c);
        move_entry(&mut self.timers, q, &mut c.ix.deadline, next);
        let last = c.last_data_rx;
        Self::index_data_rx(
            &mut c.ix,
            &mut self.recent_rx,
            &mut self.fair_share_at,
            q,
            last,
        );
    }

    /// The earliest deadline of the connections whose `timers` entry may be out of date.
    fn stale_deadline(&self) -> Option<Instant> {
        self.stale
            .iter()
            .filter_map(|q| self.conns.get(q).filter(|c| c.ix.stale)?.next_timeout())
            .min()
    }

    /// Whether connection `q`'s `timers` entry may be out of date.
    fn is_stale(&self, q: u32) -> bool {
        self.conns.get(&q).is_some_and(|c| c.ix.stale)
    }

    /// Drop connection `q`, removed with index entry `ix`, from every index.
    fn forget(&mut self, q: u32, ix: ConnIndex) {
        self.recv_total.unread -= ix.recv_charged.unread;
        self.recv_total.reassembly -= ix.recv_charged.reassembly;
        if let Some(t) = ix.deadline {
            self.timers.remove(&(t, q));
        }
        if let Some(t) = ix.in_recent {
            self.recent_rx.remove(&(t, q));
        }
        self.ready.remove(&q);
    }

    /// Debug builds, small endpoints: the cached deadlines match the connections'.
    fn check_index(&self) {
        if cfg!(debug_assertions) && self.conns.len() <= 64 {
            for (q, c) in &self.conns {
                debug_assert_eq!(c.ix.ready, self.ready.contains(q), "ready flag of {q:#x}");
                if self.is_stale(*q) {
                    continue;
                }
                let cached = c.ix.deadline;
                debug_assert_eq!(cached, c.next_timeout(), "stale timer of QPN {q:#x}");
                // Every call that changes a connection's receive memory counts it again or
                // marks it stale.
                debug_assert_eq!(
                    c.ix.recv_charged,
                    RecvCharge {
                        unread: c.unread_bytes(),
                        reassembly: c.reassembly_bytes(),
                    },
                    "receive memory of QPN {q:#x} not counted again"
                );
            }
            let sum = self.conns.values().fold(RecvCharge::default(), |t, c| {
                let m = c.ix.recv_charged;
                RecvCharge {
                    unread: t.unread + m.unread,
                    reassembly: t.reassembly + m.reassembly,
                }
            });
            debug_assert_eq!(self.recv_total, sum, "receive memory count");
            debug_assert_eq!(
                self.timers
                    .iter()
                    .filter(|(_, q)| !self.is_stale(*q))
                    .count(),
                self.conns
                    .iter()
                    .filter(|(q, c)| !self.is_stale(**q) && c.next_timeout().is_some())
                    .count()
            );
        }
    }

    /// Fire the timers that are due (retransmission, tail-loss probe, handshake, idle).
    /// Only connections whose deadline is at or before `now` are touched, in QPN order.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.rc.handle_timeout(now);
        self.flush_stale();
        self.check_index();
        let mut due = Vec::new();
        while let Some(&(t, q)) = self.timers.first() {
            if t > now {
                break;
            }
            self.timers.pop_first();
            if let Some(c) = self.conns.get_mut(&q) {
                c.ix.deadline = None;
            }
            due.push(q);
        }
        due.sort_unstable();
        for q in due {
            if let Some(c) = self.conns.get_mut(&q) {
                let out = c.handle_timeout(now, &mut self.events);
                self.touched(q);
                self.apply(ConnectionHandle(q), out);
                self.progress_close(now, q);
            }
        }
        // Closes waiting for an answer: send the next copy, or give up.
        while let Some(&(t, nonce)) = self.close_timers.first() {
            if t > now {
                break;
            }
            self.close_timers.pop_first();
            let attempts = self.cfg.transport.close_attempts;
            let Some(cl) = self.closers.get_mut(&nonce) else {
                continue;
            };
            cl.next_at = None;
            if cl.sent >= attempts {
                tracing::debug!(peer = %cl.peer, "close not answered; giving up");
                self.closers.remove(&nonce);
            } else {
                self.close_ready.push_back(nonce);
            }
        }
    }

    /// The earliest time [`handle_timeout`](Self::handle_timeout) must be called, if any.
    /// O(log n) in the number of connections, plus O(paths) for each connection touched
    /// since `poll_transmit` last returned `None` (the driving contract calls it after
    /// `poll_transmit`, so usually none).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.check_index();
        let conns = self.timers.first().map(|&(t, _)| t);
        let conns = match (conns, self.stale_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let closes = self.close_timers.first().map(|&(t, _)| t);
        let conns = match (conns, closes) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        match (conns, self.rc.poll_timeout()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Receiver-driven fair share (MetaRoCE): grant every sender an equal part of
    /// `recv_capacity_mbps` among the connections that delivered data or were established
    /// within `fair_share_window` (`Connection::last_data_rx`), or the fixed
    /// `advertised_rate_mbps`; and the window grant, an equal part of half of
    /// `socket_recv_buffer` among the most such senders counted within
    /// `window_grant_hold`. Recomputed at most once per distinct `now`, and again when the
    /// set of recent senders changes.
    ///
    /// The count of recent senders is kept in `recent_rx`, whose entries older than the
    /// window are pruned as `now` advances: O(log n) per pruned entry. A `now` earlier than
    /// one seen before (the driving contract does not promise monotonic time) falls back to
    /// counting every connection, so the result is the same either way.
    fn update_fair_share(&mut self, now: Instant) {
        if self.fair_share_at == Some(now) {
            return;
        }
        self.fair_share_at = Some(now);
        let t = &self.cfg.transport;
        let (capacity, budget) = (t.recv_capacity_mbps, t.socket_recv_buffer);
        self.grant_mbps = t.advertised_rate_mbps;
        self.grant_window_bytes = 0;
        if capacity > 0 || budget > 0 {
            let window = t.fair_share_window;
            let recent = |at: Instant| now.saturating_duration_since(at) <= window;
            let active = if self.fair_share_latest.is_some_and(|l| now < l) {
                self.conns
                    .values()
                    .filter(|c| c.last_data_rx.is_some_and(recent))
                    .count()
            } else {
                self.fair_share_latest = Some(now);
                // Entries hold a lower bound of each connection's last data arrival
                // (`index_data_rx`): an old-looking entry is re-read before it goes.
                while let Some(&(at, q)) = self.recent_rx.first() {
                    if recent(at) {
                        break;
                    }
                    self.recent_rx.pop_first();
                    let c = self.conns.get_mut(&q);
                    let real = c.as_ref().and_then(|c| c.last_data_rx);
                    let ix = c.map(|c| &mut c.ix);
                    match (real, ix) {
                        (Some(t), Some(ix)) if t > at && recent(t) => {
                            self.recent_rx.insert((t, q));
                            ix.in_recent = Some(t);
                        }
                        (_, Some(ix)) => ix.in_recent = None,
                        (_, None) => {}
                    }
                }
                debug_assert!(
                    self.conns.len() > 64
                        || self.recent_rx.len()
                            == self
                                .conns
                                .values()
                                .filter(|c| c.last_data_rx.is_some_and(recent))
                                .count()
                );
                self.recent_rx.len()
            };
            self.fair_share_local = active as u32;
            if capacity > 0 {
                let all = (active as u32).saturating_add(self.fair_share_others);
                self.grant_mbps = (capacity / all.max(1)).max(1);
            }
            // This endpoint's socket only: the other shards have their own. Divided among
            // the most senders counted within `window_grant_hold` (see there).
            let (peak, at) = self.grant_senders;
            let held =
                at.is_some_and(|at| now.saturating_duration_since(at) <= t.window_grant_hold);
            if active as u32 >= peak || !held {
                self.grant_senders = (active as u32, Some(now));
            }
            self.grant_window_bytes = budget / 2 / u64::from(self.grant_senders.0.max(1));
        }
    }

    /// The next datagram (or GSO batch) to send, written into `buf` (cleared first).
    /// Call until it returns `None` after every input.
    ///
    /// Connections are served round-robin in QPN order, starting after the one served
    /// last; only those marked ready are asked.
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut Vec<u8>) -> Option<Transmit> {
        self.lend = None;
        self.next_transmit(now, buf)
    }

    /// [`poll_transmit`](Self::poll_transmit) with gather send: WRITE payloads of 1 KiB
    /// or more from regions whose memory lends
    /// ([`RegionMemory::lend`]) are not copied into `buf` but
    /// listed in `lent` (cleared first), and the datagrams are `buf` with those payloads
    /// inserted ([`Lent::for_each_piece`]); `Transmit::size` counts them. Every other
    /// packet, and every packet of an AEAD-protected connection, is all in `buf`.
    ///
    /// The same packets as `poll_transmit` builds, byte for byte, given the same inputs,
    /// except that a batch also ends at a payload of another lending region (one region
    /// per transmit): the packets after it then leave in the next transmit, possibly on
    /// another path.
    pub fn poll_transmit_lent(
        &mut self,
        now: Instant,
        buf: &mut Vec<u8>,
        lent: &mut Lent,
    ) -> Option<Transmit> {
        lent.clear();
        self.lend = Some(std::mem::take(lent));
        let t = self.next_transmit(now, buf);
        if let Some(l) = self.lend.take() {
            *lent = l;
        }
        t
    }

    fn next_transmit(&mut self, now: Instant, buf: &mut Vec<u8>) -> Option<Transmit> {
        buf.clear();
        self.epoch(now);
        if let Some((t, bytes)) = self.sealed_control.pop_front() {
            buf.extend_from_slice(&bytes);
            return Some(t);
        }
        while let Some(ControlPacket {
            dest,
            bth,
            hdrs,
            payload,
            trailer,
            local_ip,
        }) = self.control.pop_front()
        {
            let port = self.cfg.source_ports[0];
            let len = wire::packet_len_with(&hdrs, payload.len(), &trailer);
            buf.resize(len, 0);
            if wire::emit_packet_with(&bth, &hdrs, &payload, &trailer, buf).is_err() {
                buf.clear();
                continue;
            }
            if bth.opcode == Opcode::MR_CONNECT {
                self.stats.handshake_bytes_out += len as u64;
            }
            stamp_icrc(local_ip.or(self.local_ip()), dest, port, buf);
            return Some(Transmit {
                destination: dest,
                src_port: port,
                ecn: None,
                size: len,
                segment_size: None,
            });
        }
        while let Some(nonce) = self.close_ready.pop_front() {
            let reply_port = self.cfg.local_addr.port();
            let my_ip = self.local_ip();
            let port = self.cfg.source_ports[0];
            let Some(cl) = self.closers.get_mut(&nonce) else {
                continue;
            };
            if cl.next_at.is_some() {
                continue;
            }
            let dest = cl.peer;
            let len = if cl.sealed.is_empty() {
                let (bth, hdrs) = close_packet(cl.peer_qpn, cl.code, false, reply_port, nonce);
                let trailer = Trailer::Token(cl.tx_token);
                let len = wire::packet_len_with(&hdrs, cl.reason.len(), &trailer);
                buf.resize(len, 0);
                if wire::emit_packet_with(&bth, &hdrs, &cl.reason, &trailer, buf).is_err() {
                    buf.clear();
                    self.closers.remove(&nonce);
                    continue;
                }
                stamp_icrc(cl.local_ip.or(my_ip), dest, port, buf);
                len
            } else {
                // AEAD: the copy sealed for this attempt (a fresh packet number each, so
                // the peer's replay window takes every one).
                let i = (cl.sent as usize).min(cl.sealed.len() - 1);
                buf.clear();
                buf.extend_from_slice(&cl.sealed[i]);
                buf.len()
            };
            let wait = cl.interval.saturating_mul(1u32 << cl.sent.min(16));
            cl.sent += 1;
            let at = now + wait;
            cl.next_at = Some(at);
            self.close_timers.insert((at, nonce));
            return Some(Transmit {
                destination: dest,
                src_port: port,
                ecn: None,
                size: len,
                segment_size: None,
            });
        }
        // RC queue pairs and MetaRoCE connections take turns.
        self.rc_turn = !self.rc_turn;
        if self.rc_turn && !self.rc.is_empty() {
            if let Some(t) = self
                .rc
                .poll_udp(now, buf, &self.mrs, self.cfg.source_ports[0])
            {
                return Some(t);
            }
        }
        self.update_fair_share(now);
        // Round-robin over the ready connections, starting after the one served last. A
        // connection with nothing to send leaves the ready set.
        let mut cursor = self.rr_cursor;
        loop {
            let q = match self.ready.range(cursor..).next() {
                Some(&q) => q,
                None => match self.ready.first() {
                    Some(&q) => q,
                    None => break,
                },
            };
            let Some(c) = self.conns.get_mut(&q) else {
                self.ready.remove(&q);
                continue;
            };
            c.granted_rate_mbps = self.grant_mbps;
            c.granted_window_bytes = self.grant_window_bytes;
            let t = c.poll_transmit(now, buf, &self.mrs, self.lend.as_mut());
            let (stale, recent, at) = (
                &mut self.stale,
                &mut self.recent_rx,
                &mut self.fair_share_at,
            );
            Self::mark_conn(c, q, stale, recent, at);
            if t.is_none() {
                c.ix.ready = false;
            }
            match t {
                Some(t) => {
                    self.rr_cursor = q.wrapping_add(1);
                    return Some(t);
                }
                None => {
                    self.ready.remove(&q);
                    cursor = q.wrapping_add(1);
                }
            }
        }
        // Nothing more to send: the burst is over, read the touched connections' deadlines.
        self.flush_stale();
        if self.rc.is_empty() {
            return None;
        }
        self.rc
            .poll_udp(now, buf, &self.mrs, self.cfg.source_ports[0])
    }

    /// The next event for the application, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events
            .pop_front()
            .or_else(|| self.rc.poll_event().map(Event::Rc))
    }
}

/// `Ok` unless this side already ended `stream` as its sender:
/// [`PostError::StreamFinished`] after `finish_stream`, [`PostError::StreamReset`] after a
/// reset (or the peer's STOP), [`PostError::StreamClosed`] once that end was acknowledged
/// and the stream's send state freed.
fn stream_open(c: &Connection, stream: u32) -> Result<(), PostError> {
    if c.sq.is_retired(stream) {
        return Err(PostError::StreamClosed { stream });
    }
    match c.sq.stream_end(stream) {
        Some(crate::conn::send::StreamEnd::Finished) => Err(PostError::StreamFinished { stream }),
        Some(crate::conn::send::StreamEnd::Reset) => Err(PostError::StreamReset { stream }),
        None => Ok(()),
    }
}

/// Write the ICRC of the endpoint-built packet in `buf`, sent from `local` (the unspecified
/// address of `dest`'s family when unknown) and UDP source port `port` to `dest`. A packet
/// whose addresses cannot make an IP header keeps its ICRC field as it was.
fn stamp_icrc(local: Option<IpAddr>, dest: SocketAddr, port: u16, buf: &mut [u8]) {
    let local = local.unwrap_or(match dest.ip() {
        IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
    });
    if let Ok(ip) = icrc::IpHeader::synthesized(local, dest.ip()) {
        let _ = icrc::stamp(&ip, port, dest.port(), buf);
    }
}

/// An MR_CLOSE to the peer's QPN `peer_qpn` (PROTOCOL.md, *CloseEth*): CloseEth
/// `reason` (the application's code), the ACK flag when it answers the peer's close,
/// the port answers go to, and the connection's nonce (the client nonce of its identity).
fn close_packet(
    peer_qpn: u32,
    reason: u32,
    ack: bool,
    reply_port: u16,
    nonce: u64,
) -> (Bth, Headers) {
    let flags = if ack { wire::CloseEth::FLAG_ACK } else { 0 };
    let bth = Bth::new(Opcode::MR_CLOSE, peer_qpn, 0);
    let hdrs = Headers::Close(wire::CloseEth {
        reason,
        flags,
        reply_port,
        nonce,
    });
    (bth, hdrs)
}

/// Move connection `q`'s entry in the time-ordered index `set` from `*at` to `new` (none:
/// no entry); whether it changed. O(log n).
fn move_entry(
    set: &mut BTreeSet<(Instant, u32)>,
    q: u32,
    at: &mut Option<Instant>,
    new: Option<Instant>,
) -> bool {
    if *at == new {
        return false;
    }
    if let Some(old) = *at {
        set.remove(&(old, q));
    }
    if let Some(t) = new {
        set.insert((t, q));
    }
    *at = new;
    true
}

/// An endpoint-generated packet waiting for `poll_transmit` (Retry, Reject, CLOSE answer).
#[derive(Debug)]
struct ControlPacket {
    dest: SocketAddr,
    bth: Bth,
    hdrs: Headers,
    /// A Reject's reason bytes; empty otherwise.
    payload: Bytes,
    trailer: Trailer,
    local_ip: Option<IpAddr>,
}

/// `reason` fits an `MR_CLOSE` or a CONNECT Reject ([`MAX_CLOSE_REASON`] bytes).
fn check_close_reason(reason: &[u8]) -> Result<(), PostError> {
    if reason.len() > MAX_CLOSE_REASON {
        return Err(PostError::ReasonTooLong {
            len: reason.len(),
            max: MAX_CLOSE_REASON,
        });
    }
    Ok(())
}

/// Count a packet refused by `Connection::authenticate` (issue #9): a missing trailer or a
/// wrong token (also as an AEAD failure on a protected connection), or a connection that is
/// not established yet.
fn count_auth_error(stats: &mut EndpointStats, e: AuthError, protected: bool) {
    match e {
        AuthError::Missing => stats.missing_auth += 1,
        AuthError::Bad => stats.bad_auth += 1,
        AuthError::NotEstablished => {
            stats.unknown_connection += 1;
            return;
        }
    }
    if protected {
        stats.aead_auth_failures += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sources are addresses (an IPv4-mapped IPv6 address is the IPv4 one; two hosts of one
    /// IPv6 /64 are two sources); the per-source counts follow inserts and removals.
    #[test]
    fn half_open_sources_are_addresses() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(source_key(ip("10.1.2.3")), ip("10.1.2.3"));
        assert_eq!(source_key(ip("::ffff:10.1.2.3")), ip("10.1.2.3"));
        assert_ne!(source_key(ip("fe80::1")), source_key(ip("fe80::2")));
        let mut h = HalfOpen::default();
        let a = source_key(ip("2001:db8:1:2::1"));
        let b = source_key(ip("10.0.0.1"));
        let t = Instant::now();
        h.insert(1, a, t);
        h.insert(2, source_key(ip("2001:db8:1:2::1")), t);
        h.insert(3, b, t);
        assert_eq!((h.len(), h.from(a), h.from(b)), (3, 2, 1));
        assert_eq!(h.oldest(), Some((1, t)));
        // Re-inserting a QPN moves it (to the back of the age order), removing an unknown
        // one changes nothing.
        h.insert(1, b, t);
        h.remove(&99);
        assert_eq!((h.len(), h.from(a), h.from(b)), (3, 1, 2));
        assert_eq!(h.oldest(), Some((2, t)));
        for q in [1, 2, 3] {
            h.remove(&q);
        }
        assert_eq!((h.len(), h.per_source.len(), h.by_age.len()), (0, 0, 0));
        assert_eq!(h.oldest(), None);
    }
}
