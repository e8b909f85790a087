//! The endpoint: one local address, its connections, its memory regions; the sans-IO
//! driving contract.

use crate::config::{EndpointConfig, TransportConfig};
use crate::conn::{Connection, ConnectionStats, Outcome, State};
use crate::event::{ConnectionError, ConnectionHandle, Event, WcStatus};
use crate::mr::{Access, MrError, MrKeys, MrTable};
use crate::wire::{self, icrc, Bth, ConnectEth, ConnectKind, Headers, Opcode};
use crate::{EcnCodepoint, Transmit};
use bytes::Bytes;
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::time::Instant;

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
    /// `max_outstanding_ops` operations are already pending on this connection.
    SendQueueFull,
    /// The endpoint configuration is invalid (the text says which field).
    InvalidConfig(String),
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
    /// A close reason longer than [`MAX_CLOSE_REASON`] bytes.
    ReasonTooLong {
        /// Given length in bytes.
        len: usize,
        /// The limit ([`MAX_CLOSE_REASON`]).
        max: usize,
    },
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
            PostError::ReasonTooLong { len, max } => {
                write!(f, "close reason of {len} bytes exceeds {max} bytes")
            }
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
}

/// What the endpoint remembers about one connection to find the work due without walking
/// every connection: its entries in [`Endpoint`]'s `timers` and `recent_rx` sets.
#[derive(Debug, Clone, Copy, Default)]
struct ConnIndex {
    /// The connection's `next_timeout()` when last looked at (its key in `timers`).
    deadline: Option<Instant>,
    /// The connection's `last_data_rx` when last looked at (its key in `recent_rx`, unless
    /// it has since left the fair-share window).
    data_rx: Option<Instant>,
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
    epoch: Option<Instant>,
    conns: BTreeMap<u32, Connection>,
    by_nonce: HashMap<u64, u32>,
    pub(crate) mrs: MrTable,
    events: VecDeque<Event>,
    control: VecDeque<(SocketAddr, Bth, Headers, Option<IpAddr>)>,
    rr_cursor: u32,
    fair_share_at: Option<Instant>,
    /// The latest `now` the fair share was computed for.
    fair_share_latest: Option<Instant>,
    /// The grant computed at `fair_share_at` (Mbit/s), handed to each connection as it is
    /// polled.
    grant_mbps: u32,
    /// Per-connection keys in `timers` and `recent_rx`.
    index: HashMap<u32, ConnIndex>,
    /// (deadline, QPN) of every connection with a timer armed.
    timers: BTreeSet<(Instant, u32)>,
    /// QPNs of the connections that may have something to send: every connection whose
    /// `poll_transmit` could return a datagram is in here (it leaves only when its
    /// `poll_transmit` returns `None`, and any call that changes it puts it back).
    ready: BTreeSet<u32>,
    /// (last data arrival or establishment, QPN) of the connections that delivered data or
    /// were established within the fair-share window as of `fair_share_latest` (older
    /// entries are pruned lazily).
    recent_rx: BTreeSet<(Instant, u32)>,
    stats: EndpointStats,
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

impl Endpoint {
    /// A new endpoint. Errors if the configuration is invalid.
    pub fn new(cfg: EndpointConfig) -> Result<Self, PostError> {
        cfg.transport.validate().map_err(PostError::InvalidConfig)?;
        if cfg.source_ports.is_empty() {
            return Err(PostError::InvalidConfig(
                "source_ports must not be empty".into(),
            ));
        }
        Ok(Self {
            rc: crate::rocev2::RcHost::for_endpoint(&cfg),
            rc_turn: false,
            rng: Xoshiro256PlusPlus::seed_from_u64(cfg.seed),
            cfg,
            epoch: None,
            conns: BTreeMap::new(),
            by_nonce: HashMap::new(),
            mrs: MrTable::default(),
            events: VecDeque::new(),
            control: VecDeque::new(),
            rr_cursor: 0,
            fair_share_at: None,
            fair_share_latest: None,
            grant_mbps: 0,
            index: HashMap::new(),
            timers: BTreeSet::new(),
            ready: BTreeSet::new(),
            recent_rx: BTreeSet::new(),
            stats: EndpointStats::default(),
            closers: HashMap::new(),
            close_timers: BTreeSet::new(),
            close_ready: VecDeque::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EndpointConfig {
        &self.cfg
    }

    /// Mutable transport defaults for connections made from now on (e.g. the backend's
    /// GSO limit).
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
        loop {
            let q = self.rng.next_u32() & wire::PSN_MASK;
            if q > 1 && !self.conns.contains_key(&q) {
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
        let nonce = self.rng.next_u64();
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

    /// Counters and path state of a connection.
    pub fn connection_stats(&self, conn: ConnectionHandle) -> Option<ConnectionStats> {
        self.conns.get(&conn.0).map(|c| {
            let mut s = c.stats();
            // The grant is handed to a connection only when it is polled; report the one
            // in force (as of the last `poll_transmit`).
            if self.fair_share_at.is_some() {
                s.granted_rate_mbps = self.grant_mbps;
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
        self.mrs.register(data, access)
    }

    /// Deregister a region; returns its bytes. Later remote accesses with its rkey get a
    /// remote access error; pending local WRITEs from it fail with a local protection error.
    pub fn deregister_mr(&mut self, lkey: u32) -> Option<Vec<u8>> {
        self.mrs.deregister(lkey)
    }

    /// Keys of a registered region.
    pub fn mr_keys(&self, lkey: u32) -> Option<MrKeys> {
        self.mrs.keys(lkey)
    }

    /// Read bytes `[offset, offset + len)` of a local region.
    pub fn mr_read(&self, lkey: u32, offset: u64, len: u64) -> Result<&[u8], MrError> {
        self.mrs.local(lkey, offset, len)
    }

    /// Mutable access to bytes `[offset, offset + len)` of a local region.
    pub fn mr_write(&mut self, lkey: u32, offset: u64, len: u64) -> Result<&mut [u8], MrError> {
        self.mrs.local_mut(lkey, offset, len)
    }

    // ---- posting ----

    fn conn_for_post(
        &mut self,
        conn: ConnectionHandle,
        len: u64,
    ) -> Result<&mut Connection, PostError> {
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
        if c.sq.len() >= max_ops {
            return Err(PostError::SendQueueFull);
        }
        Ok(c)
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
        let c = self.conn_for_post(conn, data.len() as u64)?;
        match c.sq.stream_end(stream) {
            Some(crate::conn::send::StreamEnd::Finished) => {
                return Err(PostError::StreamFinished { stream })
            }
            Some(crate::conn::send::StreamEnd::Reset) => {
                return Err(PostError::StreamReset { stream })
            }
            None => {}
        }
        c.post_send(wr_id, stream, data);
        self.touched(conn.0);
        Ok(())
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
        match c.sq.stream_end(stream) {
            Some(crate::conn::send::StreamEnd::Finished) => {
                return Err(PostError::StreamFinished { stream })
            }
            Some(crate::conn::send::StreamEnd::Reset) => {
                return Err(PostError::StreamReset { stream })
            }
            None => {}
        }
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

    /// Ask the peer to stop sending on `stream` with an application `code` (like QUIC
    /// STOP_SENDING), as its receiver: the peer reports [`Event::StreamStopped`] with
    /// `code`, flushes its pending SENDs on the stream and resets it with the same code, so
    /// this side then reports [`Event::StreamReset`] after the messages delivered before
    /// the reset point. Messages that arrive meanwhile are still delivered. Only the first
    /// call per stream sends anything; a peer that never sent on the stream ignores it.
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
        let c = self.conn_for_stream(conn)?;
        c.sq.stop_stream(stream, code);
        self.touched(conn.0);
        Ok(())
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
            c.stream_consumed(stream, bytes);
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
            .local(req.lkey, req.local_offset, req.len as u64)
            .map_err(PostError::LocalMemory)?;
        let c = self.conn_for_post(conn, req.len as u64)?;
        c.post_write(&req);
        self.touched(conn.0);
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
        let c = self.conn_for_post(conn, req.len as u64)?;
        c.post_read(&req);
        self.touched(conn.0);
        Ok(())
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
        let c = self.conn_for_post(conn, 8)?;
        c.post_atomic(&req);
        self.touched(conn.0);
        Ok(())
    }

    /// Post a receive buffer on `stream`. From then on the stream consumes posted receives
    /// in order (IBA receive queue semantics): each SEND lands directly in the next one and
    /// completes it ([`Event::RecvCompletion`]); a SEND finding none gets an RNR NAK and the
    /// sender retries after the RNR timer, up to `rnr_retry` times.
    ///
    /// On a stream in the error state (the peer's SEND on it failed with
    /// [`WcStatus::RnrRetryExceeded`] and the peer sent a
    /// stream abort), once in-order delivery has reached the aborted message, the receive
    /// completes at once with [`WcStatus::WrFlushError`] —
    /// reported by the next [`Endpoint::handle_timeout`] — as do the receives still pending
    /// there (docs/PROTOCOL.md, "Errors on a stream"). Receives pending when the connection
    /// ends complete with `WrFlushError` too.
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
        if reason.len() > MAX_CLOSE_REASON {
            return Err(PostError::ReasonTooLong {
                len: reason.len(),
                max: MAX_CLOSE_REASON,
            });
        }
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
    /// until answered). Also ends a graceful close early.
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
        if reason.len() > MAX_CLOSE_REASON {
            return Err(PostError::ReasonTooLong {
                len: reason.len(),
                max: MAX_CLOSE_REASON,
            });
        }
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
    fn finish_close(&mut self, now: Instant, q: u32, code: u32, reason: Bytes) {
        let Some(c) = self.conns.get(&q) else { return };
        if c.state == State::Established {
            let t = &self.cfg.transport;
            let interval = c.largest_rto().max(t.min_rto);
            let closer = Closer {
                peer: c.peer,
                peer_qpn: c.peer_qpn,
                local_ip: c.local_ip,
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
            index: self.index.len(),
            timers: self.timers.len(),
            ready: self.ready.len(),
            recent_rx: self.recent_rx.len(),
            closers: self.closers.len(),
            control: self.control.len(),
            events: self.events.len(),
        }
    }

    /// An MR_CLOSE arrived for local QPN `dest_qp`.
    fn handle_close(
        &mut self,
        from: SocketAddr,
        local_ip: Option<IpAddr>,
        dest_qp: u32,
        msg: &wire::CloseEth,
        payload: &[u8],
    ) {
        if msg.is_ack() {
            // The answer to our close: stop retransmitting it.
            match self.closers.get(&msg.nonce) {
                Some(cl) if cl.peer.ip() == from.ip() => {
                    self.forget_closer(msg.nonce);
                }
                _ => self.stats.unknown_connection += 1,
            }
            return;
        }
        let reply_to =
            |port: u16| SocketAddr::new(from.ip(), if port == 0 { from.port() } else { port });
        let mut answer = None;
        match self.conns.get(&dest_qp) {
            Some(c) if c.nonce == msg.nonce && c.peer.ip() == from.ip() => {
                answer = Some((c.peer, c.peer_qpn, c.local_ip));
                let n = payload.len().min(MAX_CLOSE_REASON);
                let reason = ConnectionError::ClosedByPeer {
                    code: msg.reason,
                    reason: Bytes::copy_from_slice(&payload[..n]),
                };
                self.remove(ConnectionHandle(dest_qp), reason, WcStatus::WrFlushError);
            }
            Some(_) => self.stats.unknown_connection += 1,
            None => {
                // Already gone (our answer was lost, or both sides closed at once): answer
                // again so the peer stops retransmitting. The answer is smaller than the
                // close and carries nothing but what the close held.
                match self.closers.get(&msg.nonce) {
                    Some(cl) if cl.peer.ip() == from.ip() => {
                        // Both sides closed at once: the peer knows; stop ours.
                        let (peer, pq, lip) = (cl.peer, cl.peer_qpn, cl.local_ip);
                        self.forget_closer(msg.nonce);
                        answer = Some((peer, pq, lip));
                    }
                    Some(_) => {}
                    None => answer = Some((reply_to(msg.reply_port), dest_qp, local_ip)),
                }
            }
        }
        if let Some((peer, peer_qpn, lip)) = answer {
            if self.control.len() < 1024 {
                let bth = Bth::new(Opcode::MR_CLOSE, peer_qpn, 0);
                let hdrs = Headers::Close(wire::CloseEth {
                    reason: msg.reason,
                    flags: wire::CloseEth::FLAG_ACK,
                    reply_port: self.cfg.local_addr.port(),
                    nonce: msg.nonce,
                });
                self.control.push_back((peer, bth, hdrs, lip.or(local_ip)));
            }
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
    /// answered with a CONNECT Reject carrying `code` (the requester's connection ends with
    /// [`ConnectionError::Rejected`]`(code)`), the connection is removed and
    /// [`Event::ConnectionLost`] with `Rejected(code)` follows. `false` if there is no such
    /// held connection.
    pub fn refuse_incoming(&mut self, conn: ConnectionHandle, code: u32) -> bool {
        let Some(c) = self.conns.get(&conn.0) else {
            return false;
        };
        if !c.held {
            return false;
        }
        // The same Reject a refusal by configuration sends (docs/PROTOCOL.md, CONNECT),
        // with the application's code as the reason.
        let (bth, hdrs) = c.connect_packet(ConnectKind::Reject, code);
        let hdrs = match hdrs {
            Headers::Connect(m) => Headers::Connect(ConnectEth { src_qpn: 0, ..m }),
            h => h,
        };
        self.control.push_back((c.peer, bth, hdrs, c.local_ip));
        self.stats.rejected += 1;
        self.remove(
            conn,
            ConnectionError::Rejected(code),
            WcStatus::WrFlushError,
        );
        true
    }

    fn remove(&mut self, conn: ConnectionHandle, reason: ConnectionError, first: WcStatus) {
        if let Some(mut c) = self.conns.remove(&conn.0) {
            self.forget(conn.0);
            c.flush(first, &mut self.events);
            if self.by_nonce.get(&c.nonce) == Some(&conn.0) {
                self.by_nonce.remove(&c.nonce);
            }
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
        let pkt = match wire::Packet::parse(data) {
            Ok(p) => p,
            Err(e) => {
                self.stats.malformed += 1;
                tracing::trace!(%from, error = %e, "malformed datagram");
                return;
            }
        };
        if crate::rocev2::is_rc_opcode(pkt.bth.opcode) {
            // Standard RC opcodes belong to the RC queue pairs (`Endpoint::rc`).
            let dst = local_ip.or(self.local_ip());
            self.rc.handle_datagram(now, from, dst, data, &mut self.mrs);
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
            self.handle_connect(now, from, local_ip, pkt.bth.dest_qp, msg);
            return;
        }
        if let Headers::Close(msg) = &pkt.headers {
            self.handle_close(from, local_ip, pkt.bth.dest_qp, msg, pkt.payload);
            return;
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
        let out = c.handle_packet(now, local_ip, ecn, &pkt, &mut self.mrs, &mut self.events);
        self.touched(qpn);
        self.apply(ConnectionHandle(qpn), out);
        self.progress_close(now, qpn);
    }

    fn handle_connect(
        &mut self,
        now: Instant,
        from: SocketAddr,
        local_ip: Option<IpAddr>,
        dest_qp: u32,
        msg: &ConnectEth,
    ) {
        match msg.kind {
            ConnectKind::Request => {
                let peer = SocketAddr::new(from.ip(), msg.reply_port);
                if let Some(&q) = self.by_nonce.get(&msg.nonce) {
                    if let Some(c) = self.conns.get_mut(&q) {
                        if c.peer == peer {
                            c.accept_pending = true;
                            self.touched(q);
                        }
                    }
                    return;
                }
                let reject = |reason: u32| {
                    let bth = Bth::new(Opcode::MR_CONNECT, 0, 0);
                    let mut m = *msg;
                    m.kind = ConnectKind::Reject;
                    m.dst_qpn = msg.src_qpn;
                    m.src_qpn = 0;
                    m.reason = reason;
                    (
                        peer,
                        Bth {
                            dest_qp: msg.src_qpn,
                            ..bth
                        },
                        Headers::Connect(m),
                        local_ip,
                    )
                };
                let valid =
                    msg.paths > 0 && (256..=4096).contains(&msg.pmtu) && msg.pmtu.is_power_of_two();
                let reason = if !self.cfg.accept_incoming {
                    Some(1)
                } else if self.conns.len() >= self.cfg.max_connections {
                    Some(2)
                } else if !valid || msg.version != crate::conn::PROTOCOL_VERSION {
                    Some(3)
                } else {
                    None
                };
                if let Some(r) = reason {
                    self.stats.rejected += 1;
                    self.control.push_back(reject(r));
                    return;
                }
                let epoch = self.epoch(now);
                let qpn = self.new_qpn();
                let init_psn = self.initial_psn();
                let conn = Connection::new_incoming(
                    ConnectionHandle(qpn),
                    now,
                    epoch,
                    peer,
                    local_ip.or(self.local_ip()),
                    self.cfg.local_addr.port(),
                    self.cfg.source_ports.clone(),
                    init_psn,
                    self.cfg.transport.clone(),
                    msg,
                );
                let mut conn = conn;
                conn.held = self.cfg.manual_accept;
                self.conns.insert(qpn, conn);
                self.touched(qpn);
                self.by_nonce.insert(msg.nonce, qpn);
                tracing::debug!(conn = %ConnectionHandle(qpn), %peer, "accepted connection");
                self.events
                    .push_back(Event::Incoming(ConnectionHandle(qpn)));
            }
            ConnectKind::Accept | ConnectKind::Reject => {
                // An Accept for a connection we do not have, or from a peer QPN other than
                // the one our connection is established with: a stale request reached a
                // restarted peer, or we gave up. Tell the peer to drop it, or it would keep a
                // ghost connection forever.
                let ghost = match self.conns.get(&dest_qp) {
                    None => true,
                    Some(c) => c.state == State::Established && c.peer_qpn != msg.src_qpn,
                };
                if ghost && msg.kind == ConnectKind::Accept {
                    let peer = SocketAddr::new(from.ip(), msg.reply_port);
                    let bth = Bth::new(Opcode::MR_CLOSE, msg.src_qpn, 0);
                    let hdrs = Headers::Close(wire::CloseEth {
                        reason: 1,
                        flags: 0,
                        reply_port: self.cfg.local_addr.port(),
                        nonce: msg.nonce,
                    });
                    if self.control.len() < 1024 {
                        self.control.push_back((peer, bth, hdrs, local_ip));
                    }
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
                let out = c.on_connect(now, msg, &mut self.events);
                self.touched(dest_qp);
                self.apply(ConnectionHandle(dest_qp), out);
            }
        }
    }

    // ---- per-connection indexes (timers, ready set, fair share) ----

    /// Re-read connection `q`'s deadline and last data arrival into the indexes, after any
    /// call that may have changed them; `false` if there is no such connection.
    /// O(paths + log n).
    fn refresh(&mut self, q: u32) -> bool {
        let Some(c) = self.conns.get(&q) else {
            return false;
        };
        let ix = self.index.entry(q).or_default();
        let deadline = c.next_timeout();
        if deadline != ix.deadline {
            if let Some(old) = ix.deadline {
                self.timers.remove(&(old, q));
            }
            if let Some(new) = deadline {
                self.timers.insert((new, q));
            }
            ix.deadline = deadline;
        }
        if c.last_data_rx != ix.data_rx {
            if let Some(old) = ix.data_rx {
                self.recent_rx.remove(&(old, q));
            }
            if let Some(new) = c.last_data_rx {
                self.recent_rx.insert((new, q));
            }
            ix.data_rx = c.last_data_rx;
            // The set of active senders changed: the next grant must count it even at
            // the same `now` (several connections established in one instant).
            self.fair_share_at = None;
        }
        true
    }

    /// Connection `q` was handed input, a post or a timer: refresh its indexes and ask it
    /// in the next `poll_transmit`.
    fn touched(&mut self, q: u32) {
        if self.refresh(q) {
            self.ready.insert(q);
        }
    }

    /// Drop a removed connection from every index.
    fn forget(&mut self, q: u32) {
        if let Some(ix) = self.index.remove(&q) {
            if let Some(t) = ix.deadline {
                self.timers.remove(&(t, q));
            }
            if let Some(t) = ix.data_rx {
                self.recent_rx.remove(&(t, q));
            }
        }
        self.ready.remove(&q);
    }

    /// Debug builds, small endpoints: the cached deadlines match the connections'.
    fn check_index(&self) {
        if cfg!(debug_assertions) && self.conns.len() <= 64 {
            for (q, c) in &self.conns {
                let cached = self.index.get(q).and_then(|ix| ix.deadline);
                debug_assert_eq!(cached, c.next_timeout(), "stale timer of QPN {q:#x}");
            }
            debug_assert_eq!(
                self.timers.len(),
                self.conns
                    .values()
                    .filter(|c| c.next_timeout().is_some())
                    .count()
            );
        }
    }

    /// Fire the timers that are due (retransmission, tail-loss probe, handshake, idle).
    /// Only connections whose deadline is at or before `now` are touched, in QPN order.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.rc.handle_timeout(now);
        self.check_index();
        let mut due = Vec::new();
        while let Some(&(t, q)) = self.timers.first() {
            if t > now {
                break;
            }
            self.timers.pop_first();
            if let Some(ix) = self.index.get_mut(&q) {
                ix.deadline = None;
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
    /// O(log n) in the number of connections.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.check_index();
        let conns = self.timers.first().map(|&(t, _)| t);
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
    /// `advertised_rate_mbps`. Recomputed at most once per distinct `now`, and again when
    /// the set of recent senders changes.
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
        self.grant_mbps = if t.recv_capacity_mbps > 0 {
            let window = t.fair_share_window;
            let recent = |at: Instant| now.saturating_duration_since(at) <= window;
            let active = if self.fair_share_latest.is_some_and(|l| now < l) {
                self.conns
                    .values()
                    .filter(|c| c.last_data_rx.is_some_and(recent))
                    .count()
            } else {
                self.fair_share_latest = Some(now);
                while let Some(&(at, _)) = self.recent_rx.first() {
                    if recent(at) {
                        break;
                    }
                    self.recent_rx.pop_first();
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
            (t.recv_capacity_mbps / active.max(1) as u32).max(1)
        } else {
            t.advertised_rate_mbps
        };
    }

    /// The next datagram (or GSO batch) to send, written into `buf` (cleared first).
    /// Call until it returns `None` after every input.
    ///
    /// Connections are served round-robin in QPN order, starting after the one served
    /// last; only those marked ready are asked.
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut Vec<u8>) -> Option<Transmit> {
        buf.clear();
        self.epoch(now);
        while let Some((dest, bth, hdrs, local_ip)) = self.control.pop_front() {
            let port = self.cfg.source_ports[0];
            let len = wire::packet_len(&hdrs, 0);
            buf.resize(len, 0);
            if wire::emit_packet(&bth, &hdrs, &[], buf).is_err() {
                buf.clear();
                continue;
            }
            let local = local_ip.or(self.local_ip()).unwrap_or(match dest.ip() {
                IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
                IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
            });
            if let Ok(ip) = icrc::IpHeader::synthesized(local, dest.ip()) {
                let _ = icrc::stamp(&ip, port, dest.port(), buf);
            }
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
            let bth = Bth::new(Opcode::MR_CLOSE, cl.peer_qpn, 0);
            let hdrs = Headers::Close(wire::CloseEth {
                reason: cl.code,
                flags: 0,
                reply_port,
                nonce,
            });
            let len = wire::packet_len(&hdrs, cl.reason.len());
            buf.resize(len, 0);
            if wire::emit_packet(&bth, &hdrs, &cl.reason, buf).is_err() {
                buf.clear();
                self.closers.remove(&nonce);
                continue;
            }
            let dest = cl.peer;
            let local = cl.local_ip.or(my_ip).unwrap_or(match dest.ip() {
                IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
                IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
            });
            if let Ok(ip) = icrc::IpHeader::synthesized(local, dest.ip()) {
                let _ = icrc::stamp(&ip, port, dest.port(), buf);
            }
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
        if self.rc_turn {
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
            let t = c.poll_transmit(now, buf, &self.mrs);
            self.refresh(q);
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
