//! One connection: the delivery layer (paths, PSNs, SACK, loss recovery, congestion
//! control) under the semantic layer (streams, WRITE placement, completions).

pub mod cc;
mod executed;
pub(crate) mod idset;
pub(crate) mod path;
pub(crate) mod recv;
pub use send::{rnr_timer, AtomicOp};
pub mod rtt;
pub(crate) mod segbits;
pub(crate) mod send;

use crate::config::TransportConfig;
use crate::crypto::{OpenError, Opened, PacketProtection, ProtectionStats, Side};
use crate::event::{ConnectionError, ConnectionHandle, Event, WcStatus};
use crate::fasthash::FastState;
use crate::mr::MrTable;
use crate::wire::{
    self, icrc, AckEth, AtomicAckEth, AtomicEth, Bth, ConnectEth, ConnectKind, Headers, NakEth,
    Opcode, PathEth, Reth, SendEth, Trailer, WriteEth,
};
use crate::{EcnCodepoint, LendHandle, Lent, LentSpan, Transmit};
use bytes::Bytes;
use path::{Hold, PathRx, PathTx, RxCheck, RxClass, SegRef};
use recv::{RecvLimits, RecvState, RecvStats, Respond, RxOutcome};
use rtt::RttEstimator;
use send::{OpKind, SendQueue};
use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

pub use path::{PathInfo, PathState, PathStats};

/// Protocol version carried in CONNECT.
pub(crate) const PROTOCOL_VERSION: u8 = ConnectEth::VERSION;

/// Rounds of one path's loss timer per [`Connection::handle_timeout`]: the RACK reorder
/// timer, then the probe or RTO that may be due behind it, and one spare.
const LOSS_TIMER_ROUNDS: usize = 3;

/// Reject reason when one side requires AEAD packet protection and the other does not
/// offer it ([`TransportConfig::packet_protection`]): 4, [`ConnectEth::REASON_AEAD_MISMATCH`].
pub const REJECT_PROTECTION_MISMATCH: u32 = ConnectEth::REASON_AEAD_MISMATCH;

/// Whether a handshake message asks for (Request) or confirms (Accept) AEAD packet
/// protection: `ConnectEth` flags bit 0.
pub(crate) fn aead_flag(msg: &ConnectEth) -> bool {
    msg.flags & ConnectEth::FLAG_AEAD != 0
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    Connecting,
    Established,
}

#[derive(Debug, Clone, Copy)]
struct Handshake {
    attempts: u32,
    next_at: Instant,
    pending: bool,
    paths_offered: u16,
    /// The retry cookie of the server's last Retry, echoed in the next Requests.
    cookie: [u8; 16],
    /// Retries accepted so far (bounded by `handshake_attempts`).
    retries: u32,
    /// Requests sent since the last Retry (or since the start): the handshake RTT is
    /// sampled only when exactly one was (Karn).
    sends_since_retry: u32,
    /// The server refused a Request because this source held too many half-open
    /// connections (Reject reason 5): the Request is sent again on the handshake timer, and
    /// if the attempts run out the connection fails with that Reject.
    source_limited: bool,
}

/// Server side of a connection accepted but not yet confirmed by its client (half-open):
/// the Accept is re-sent every `handshake_interval`, at most `handshake_attempts` times,
/// then the connection expires with [`ConnectionError::HandshakeTimeout`].
#[derive(Debug, Clone, Copy)]
struct HalfOpen {
    next_at: Instant,
    attempts: u32,
}

/// Why [`Connection::authenticate`] refused a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AuthError {
    /// No trailer (kind 0) on a non-CONNECT packet.
    Missing,
    /// A token that is not the connection's, or a trailer kind this connection does not use.
    Bad,
    /// The connection is not established, so it has no token yet.
    NotEstablished,
}

#[derive(Debug, Clone, Copy)]
struct PendingNak {
    path_id: u8,
    psn: u32,
    syndrome: u8,
    /// NakEth flags ([`NakEth::FLAG_STREAM_REFUSED`]).
    flags: u8,
    op_id: u32,
    echo_ts: u32,
}

/// A snapshot of a connection's counters and path state.
#[derive(Debug, Clone, PartialEq)]
pub struct ConnectionStats {
    /// Peer address.
    pub peer: SocketAddr,
    /// Negotiated path MTU (payload bytes per packet).
    pub pmtu: u32,
    /// Per-path state and counters (sender side).
    pub paths: Vec<PathInfo>,
    /// Responder-side counters.
    pub recv: RecvStats,
    /// ACKs sent, counted per path acknowledged: an ACK bundle of *n* paths counts *n*.
    pub acks_sent: u64,
    /// ACKs held for a reply (`TransportConfig::max_ack_delay`) that were sent before
    /// their delay was up because the application had no reply
    /// ([`Endpoint::release_held_ack`](crate::Endpoint::release_held_ack)).
    pub held_acks_released: u64,
    /// `MR_ACK` datagrams sent (ACK bundles and single ACKs; keepalives not counted):
    /// `acks_sent / ack_datagrams_sent` is the mean bundle size.
    pub ack_datagrams_sent: u64,
    /// ACK packets received.
    pub acks_received: u64,
    /// Data packets received (new, duplicate and dropped).
    pub data_packets_received: u64,
    /// Data packets received that were already received on their path.
    pub duplicate_packets: u64,
    /// Data packets beyond the SACK window, dropped.
    pub out_of_window_packets: u64,
    /// Data packets whose floor PSN was ahead of their own PSN (a sender's floor is the
    /// oldest PSN it still awaits, so it never is): dropped, nothing moved.
    pub bad_floor_packets: u64,
    /// ACKs dropped because they acknowledged PSNs the path never sent (cumulative PSN or
    /// a SACK bit at or beyond the path's next PSN, or before its first PSN): nothing
    /// completed, no window moved, no RTT sample.
    pub bad_acks: u64,
    /// ACKs with SACK bits for PSNs the path never sent (at or beyond its next PSN): those
    /// bits were ignored, the rest of the ACK processed. A receiver reports such a PSN only
    /// if a packet forged or replayed under it reached it first.
    pub acks_ignoring_unsent: u64,
    /// READ / atomic response packets dropped because they did not answer a request this
    /// side sent (unknown or not yet sent op id, length or offset off the request).
    pub bad_responses: u64,
    /// Data packets received with a CE mark.
    pub ce_received: u64,
    /// The rate the peer grants us in its ACKs (Mbit/s, 0 = no limit): its receiver-driven
    /// fair share.
    pub peer_rate_hint_mbps: u32,
    /// The rate we grant the peer in our ACKs (Mbit/s, 0 = no limit).
    pub granted_rate_mbps: u32,
    /// The window the peer grants us in its latest ACK, in packets over all paths
    /// ([`AckEth::window_grant`](crate::wire::AckEth::window_grant) × 8; 0 = no grant): a
    /// cap on [`send_window`](Self::send_window).
    pub peer_window_grant: u32,
    /// The window we grant the peer in our ACKs, in packets (0 = no grant): our share of
    /// `TransportConfig::socket_recv_buffer` for it.
    pub granted_window: u32,
    /// Packets the connection may have in flight now, over all paths: the smaller of the
    /// sum of the path windows and the connection-wide cap (see
    /// [`connection_window`](cc::connection_window)).
    pub send_window: u32,
    /// Paths moved to a new source port because they delivered persistently less than the
    /// connection's fastest path (ECMP collision handling; per path in
    /// [`PathStats::rebalance_rerolls`](path::PathStats::rebalance_rerolls)).
    pub rebalance_rerolls: u64,
    /// AEAD packet protection counters, `None` when the connection is not protected.
    pub protection: Option<ProtectionStats>,
    /// Gauge: entries of the per-stream send tables (streams sent on, and streams ended
    /// and not yet closed: one sent on and ended counts twice). 0 once every stream this
    /// side sent on was closed. Incoming state is `recv.streams`.
    pub send_streams: u64,
    /// Gauge: operations in the send queue, internal ones (responses, aborts, FINs,
    /// STOPs) and finished ones waiting behind an unfinished one for in-order completion
    /// included. At most `max_outstanding_ops` application operations plus what the peer
    /// makes this side answer, which is bounded too.
    pub queued_ops: u64,
    /// Gauge: ranges of stream ids whose outgoing direction was closed and forgotten
    /// (consecutive ids merge; at most `2 × max_streams + 1`).
    pub closed_send_stream_ranges: u64,
}

/// A graceful close in progress (`Endpoint::close_with`): no new posts; operations already
/// posted drain until `deadline`.
#[derive(Debug, Clone)]
pub(crate) struct Closing {
    pub code: u32,
    pub reason: bytes::Bytes,
    pub deadline: Instant,
}

/// How many idle paths a held RTO asks at most (`TransportConfig::ask_idle_path`): an
/// idle path may itself run through the failed link, so one is not enough.
const ASK_PATHS: usize = 4;

/// What the endpoint tells a connection of its receive memory over all its connections,
/// before each packet (`EndpointConfig::max_unread_recv_bytes`,
/// `EndpointConfig::max_reassembly_bytes`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct EndpointRecv {
    /// Delivered-and-unread bytes are at `max_unread_recv_bytes`.
    pub unread_full: bool,
    /// Bytes being reassembled on the endpoint's other connections.
    pub reassembly_others: u64,
    /// `max_reassembly_bytes`.
    pub max_reassembly: u64,
    /// `reassembly_floor_bytes`.
    pub reassembly_floor: u64,
}

impl Default for EndpointRecv {
    /// Before the endpoint first sets it: no endpoint-wide limit.
    fn default() -> Self {
        EndpointRecv {
            unread_full: false,
            reassembly_others: 0,
            max_reassembly: u64::MAX / 4,
            reassembly_floor: 0,
        }
    }
}

#[derive(Debug)]
pub(crate) struct Connection {
    pub handle: ConnectionHandle,
    /// Set by a graceful close.
    pub closing: Option<Closing>,
    /// When the last keepalive was queued (`keepalive_interval`).
    last_keepalive: Option<Instant>,
    /// A keepalive is due to be sent.
    keepalive_pending: bool,
    /// The path the next keepalive goes out on.
    next_keepalive_path: usize,
    pub state: State,
    pub peer: SocketAddr,
    pub peer_qpn: u32,
    pub nonce: u64,
    /// The server's nonce (the other half of the identity); 0 until known.
    pub server_nonce: u64,
    /// Token expected in the trailer of every packet received (identity-derived).
    rx_token: u64,
    /// Token put in the trailer of every packet sent.
    tx_token: u64,
    /// Server side: the client has confirmed the Accept (a Confirm or any authenticated
    /// packet); always true on the client side.
    pub confirmed: bool,
    half_open: Option<HalfOpen>,
    /// Client side: a Confirm is due.
    confirm_pending: bool,
    pub local_ip: Option<IpAddr>,
    /// The endpoint's receive memory over all its connections: set by the endpoint before
    /// each packet.
    pub(crate) endpoint_recv: EndpointRecv,
    /// The ICRC's IP header for packets to the peer, with the `(local_ip, peer IP)` it was
    /// synthesized from (issue #13: built once, not per packet).
    tx_ip: Option<(Option<IpAddr>, IpAddr, Option<icrc::IpHeader>)>,
    /// The further ACK blocks of the bundled `MR_ACK` being built (reused).
    ack_scratch: Vec<u8>,
    /// The endpoint's index entry for this connection (its keys in the endpoint's timer
    /// and fair-share sets); only the endpoint reads or writes it.
    pub(crate) ix: crate::endpoint::ConnIndex,
    /// `(now, ts32(epoch, now))` as last computed (see `ts_at`).
    ts_cache: Option<(Instant, u32)>,
    /// [`conn_window`](Self::conn_window) as last computed (issue #13: it walks every path,
    /// and was computed for every data packet sent). Cleared by everything its inputs
    /// depend on: ACKs (RTT samples, rate hint, first ACK), the handshake (paths, PMTU,
    /// grant, RTT from the handshake) and timers.
    window_cache: Option<u32>,
    local_port: u16,
    pub pmtu: u32,
    init_psn: u32,
    tx: Vec<PathTx>,
    rx: Vec<PathRx>,
    pub sq: SendQueue,
    rq: RecvState,
    next_path: usize,
    /// A loss timer scheduled a tail-loss probe on some path (`PathTx::probe`) that
    /// `poll_transmit` has not taken yet; `false` only when no path holds one.
    probe_pending: bool,
    /// Some path may hold an RTO that asked idle paths whether the peer is alive
    /// (`TransportConfig::ask_idle_path`, `PathTx::asked_at`); cleared when a look finds
    /// none.
    asking: bool,
    /// Paths (bit `i`: path `i`) a keepalive of such a question is still to go out on.
    ask_keepalives: [u64; 4],
    next_ack_path: usize,
    /// Delayed ACK (`TransportConfig::max_ack_delay`): while set, the ACKs due may wait
    /// until this time or until a data packet goes to the peer, whichever comes first.
    ack_hold: Option<Instant>,
    /// Packets that made an ACK due since every path's ACK was last sent.
    unacked_pkts: u32,
    naks: VecDeque<PendingNak>,
    pub accept_pending: bool,
    /// An incoming connection the application has not accepted yet
    /// (`EndpointConfig::manual_accept`): nothing is transmitted while set.
    pub held: bool,
    /// CONNECT Accepts sent (the first and any re-sent for a duplicate Request).
    pub(crate) accepts_sent: u64,
    /// This side sent the connection request.
    pub outgoing: bool,
    handshake: Option<Handshake>,
    pub last_heard: Instant,
    /// The latest silence of the whole connection (no packet from the peer on any path)
    /// of at least [`path::PTO_FLOOR`]: the last packet before it and the first after it.
    /// A probe found spurious teaches every path a stall allowance only when such a
    /// silence spans its firing (`stall_was_shared`).
    quiet: Option<(Instant, Instant)>,
    peer_rate_mbps: u32,
    /// Rate granted to the peer in our ACKs (Mbit/s, 0 = no limit); set by the endpoint.
    pub granted_rate_mbps: u32,
    /// The peer's window grant from its latest ACK, in [`AckEth::WINDOW_GRANT_UNIT`]s
    /// (0 = none).
    peer_window_grant: u8,
    /// Bytes of the endpoint's receive socket buffer granted to the peer (0 = no grant);
    /// set by the endpoint, turned into packets of our path MTU in every ACK.
    pub granted_window_bytes: u64,
    /// When the peer last delivered new data, or when the connection was established,
    /// whichever is later: the receiver's fair share counts the connection as an active
    /// sender for `fair_share_window` from then. Counting from establishment announces a
    /// sender before its first data (a connection is usually set up to be used at once);
    /// the cost is that an idle new connection takes a share for at most
    /// `fair_share_window`.
    pub last_data_rx: Option<Instant>,
    cfg: TransportConfig,
    acks_sent: u64,
    held_acks_released: u64,
    ack_datagrams_sent: u64,
    acks_received: u64,
    data_in: u64,
    dup_in: u64,
    oow_in: u64,
    bad_floor_in: u64,
    bad_acks: u64,
    acks_ignoring_unsent: u64,
    bad_responses: u64,
    ce_in: u64,
    source_ports: Vec<u16>,
    /// Where the search for a re-roll port starts.
    next_spare: usize,
    /// Plane health for multi-plane fabrics (`cfg.planes > 1`).
    planes: path::Planes,
    /// ECMP collision detection (`cfg.rebalance_ratio_permille > 0`).
    rebalance: path::Rebalance,
    epoch: Instant,
    /// AEAD packet protection, once the handshake agreed on it.
    protection: Option<Box<PacketProtection>>,
}

/// Nanoseconds since the endpoint's epoch, modulo 2^32 (PathEth timestamp).
/// How long an acknowledged READ/atomic request waits for its response before it is sent
/// again: twice the largest path RTO.
fn response_timeout(tx: &[PathTx], cfg: &TransportConfig) -> Duration {
    let (min, max) = (cfg.min_rto, cfg.max_rto);
    2 * tx.iter().map(|p| p.rtt.rto(min, max)).max().unwrap_or(min)
}

pub(crate) fn ts32(epoch: Instant, now: Instant) -> u32 {
    now.saturating_duration_since(epoch).as_nanos() as u32
}

/// What a connection asks its endpoint to do after handling input.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    pub lost: Option<ConnectionError>,
}

impl Connection {
    #[allow(clippy::too_many_arguments)]
    pub fn new_outgoing(
        handle: ConnectionHandle,
        now: Instant,
        epoch: Instant,
        peer: SocketAddr,
        local_ip: Option<IpAddr>,
        local_port: u16,
        source_ports: Vec<u16>,
        nonce: u64,
        init_psn: u32,
        cfg: TransportConfig,
        tables: FastState,
    ) -> Self {
        let paths_offered = (cfg.paths as usize).min(source_ports.len()) as u16;
        let mut c = Self::blank(
            handle,
            now,
            epoch,
            peer,
            local_ip,
            local_port,
            source_ports,
            nonce,
            init_psn,
            cfg,
            tables,
        );
        c.handshake = Some(Handshake {
            attempts: 0,
            next_at: now,
            pending: true,
            paths_offered,
            cookie: [0; 16],
            retries: 0,
            sends_since_retry: 0,
            source_limited: false,
        });
        c.outgoing = true;
        c
    }

    #[allow(clippy::too_many_arguments)]
    pub fn new_incoming(
        handle: ConnectionHandle,
        now: Instant,
        epoch: Instant,
        peer: SocketAddr,
        local_ip: Option<IpAddr>,
        local_port: u16,
        source_ports: Vec<u16>,
        init_psn: u32,
        cfg: TransportConfig,
        tables: FastState,
        req: &ConnectEth,
        server_nonce: u64,
    ) -> Self {
        let mut c = Self::blank(
            handle,
            now,
            epoch,
            peer,
            local_ip,
            local_port,
            source_ports,
            req.nonce,
            init_psn,
            cfg,
            tables,
        );
        let paths = (c.cfg.paths as usize)
            .min(c.source_ports.len())
            .min(req.paths as usize)
            .max(1);
        let pmtu = c.cfg.pmtu.min(req.pmtu as u32);
        c.establish(now, req.src_qpn, paths, pmtu, req.init_psn);
        // The endpoint accepts a request only if both sides agree on protection.
        if let Some(pc) = &c.cfg.packet_protection {
            c.protection = Some(Box::new(PacketProtection::new(
                pc,
                Side::Server,
                req.nonce,
                server_nonce,
            )));
        }
        // The client's grant for what we send it, until its first ACK says otherwise.
        c.peer_rate_mbps = req.grant_mbps();
        c.accept_pending = true;
        c.server_nonce = server_nonce;
        let (c2s, s2c) = crate::secret::tokens(req.nonce, server_nonce);
        c.rx_token = c2s;
        c.tx_token = s2c;
        c.confirmed = false;
        c.half_open = Some(HalfOpen {
            next_at: now + c.cfg.handshake_interval,
            attempts: 1,
        });
        c
    }

    /// Check a received packet's trailer against the connection's token in constant time,
    /// before any state is touched (issue #9). `MR_CONNECT` packets never come here.
    pub fn authenticate(&self, trailer: &Trailer) -> Result<(), AuthError> {
        if self.state != State::Established {
            return Err(AuthError::NotEstablished);
        }
        match trailer {
            // With AEAD the trailer kind is all that is checked here; the tag is verified
            // by `open` before the connection sees the packet.
            Trailer::Aead { .. } if self.protection.is_some() => Ok(()),
            Trailer::Token(t)
                if self.protection.is_none() && crate::secret::ct_eq_u64(*t, self.rx_token) =>
            {
                Ok(())
            }
            Trailer::None => Err(AuthError::Missing),
            _ => Err(AuthError::Bad),
        }
    }

    /// An authenticated packet arrived: on the server side the connection is no longer
    /// half-open.
    pub fn on_authenticated(&mut self) {
        self.confirmed = true;
        self.half_open = None;
    }

    /// Server side: the client's Confirm (both nonces echoed, compared in constant time).
    /// Returns whether it matched.
    pub fn on_confirm(&mut self, msg: &ConnectEth) -> bool {
        let ok = self.state == State::Established
            && !self.outgoing
            && crate::secret::ct_eq_u64(msg.nonce, self.nonce)
            && crate::secret::ct_eq_u64(msg.server_nonce, self.server_nonce);
        if ok {
            self.on_authenticated();
        }
        ok
    }

    /// The token this side puts on the packets it sends (for endpoint-generated packets
    /// such as MR_CLOSE).
    pub fn tx_token(&self) -> u64 {
        self.tx_token
    }

    /// `(tx_token, rx_token)`.
    pub fn tokens(&self) -> (u64, u64) {
        (self.tx_token, self.rx_token)
    }

    #[allow(clippy::too_many_arguments)]
    fn blank(
        handle: ConnectionHandle,
        now: Instant,
        epoch: Instant,
        peer: SocketAddr,
        local_ip: Option<IpAddr>,
        local_port: u16,
        source_ports: Vec<u16>,
        nonce: u64,
        init_psn: u32,
        cfg: TransportConfig,
        tables: FastState,
    ) -> Self {
        let mut c = Self {
            handle,
            closing: None,
            last_keepalive: None,
            keepalive_pending: false,
            next_keepalive_path: 0,
            state: State::Connecting,
            peer,
            peer_qpn: 0,
            nonce,
            server_nonce: 0,
            rx_token: 0,
            tx_token: 0,
            confirmed: true,
            tx_ip: None,
            endpoint_recv: EndpointRecv::default(),
            // Room for the largest ACK bundle up front: it would grow once, mid-run, the
            // first time a bundle is longer than any before (issue #13: no allocation per
            // packet once warm).
            ack_scratch: Vec::with_capacity(
                cfg.max_ack_bundle.saturating_sub(1) * AckEth::BLOCK_LEN,
            ),
            ix: Default::default(),
            ts_cache: None,
            window_cache: None,
            half_open: None,
            confirm_pending: false,
            local_ip,
            local_port,
            pmtu: send::valid_pmtu(cfg.pmtu),
            init_psn,
            tx: Vec::new(),
            rx: Vec::new(),
            sq: SendQueue::new(cfg.pmtu, cfg.max_rd_atomic),
            rq: RecvState::default(),
            next_path: 0,
            probe_pending: false,
            asking: false,
            ask_keepalives: [0; 4],
            next_ack_path: 0,
            ack_hold: None,
            unacked_pkts: 0,
            naks: VecDeque::new(),
            accept_pending: false,
            held: false,
            accepts_sent: 0,
            outgoing: false,
            handshake: None,
            last_heard: now,
            quiet: None,
            peer_rate_mbps: 0,
            granted_rate_mbps: 0,
            peer_window_grant: 0,
            granted_window_bytes: 0,
            last_data_rx: None,
            cfg,
            acks_sent: 0,
            held_acks_released: 0,
            ack_datagrams_sent: 0,
            acks_received: 0,
            data_in: 0,
            dup_in: 0,
            oow_in: 0,
            bad_floor_in: 0,
            bad_acks: 0,
            acks_ignoring_unsent: 0,
            bad_responses: 0,
            ce_in: 0,
            next_spare: 0,
            planes: path::Planes::new(1),
            rebalance: path::Rebalance::default(),
            source_ports,
            epoch,
            protection: None,
        };
        // The tables indexed by ids the peer chooses (streams, operations) take the
        // endpoint's secret key (`fasthash`).
        c.sq.key_tables(tables);
        c.rq.key_tables(tables);
        c
    }

    fn establish(
        &mut self,
        now: Instant,
        peer_qpn: u32,
        paths: usize,
        pmtu: u32,
        peer_init_psn: u32,
    ) {
        self.window_cache = None;
        self.peer_qpn = peer_qpn;
        let pmtu = send::valid_pmtu(pmtu);
        self.pmtu = pmtu;
        self.sq.set_pmtu(pmtu);
        let ports = path::assign_ports(&self.source_ports, paths, self.cfg.planes);
        self.planes = path::Planes::new(self.cfg.planes);
        self.tx = (0..paths)
            .map(|i| {
                let mut p = PathTx::new(
                    i as u8,
                    ports[i],
                    self.init_psn,
                    RttEstimator::new(self.cfg.initial_rtt),
                    cc::new_controller(&self.cfg.congestion, pmtu),
                    now,
                );
                p.peer_ack_delay = self.cfg.max_ack_delay;
                p
            })
            .collect();
        self.rx = (0..paths).map(|_| PathRx::new(peer_init_psn)).collect();
        self.state = State::Established;
        self.handshake = None;
        // A just-established connection is about to send: count it in the fair share now
        // rather than when its first data comes out of the queue (see `last_data_rx`).
        self.last_data_rx = Some(now);
    }

    fn limits(&self) -> RecvLimits {
        RecvLimits {
            pmtu: self.pmtu,
            max_message_size: self.cfg.max_message_size,
            max_recv_buffer_bytes: self.cfg.max_recv_buffer_bytes,
            max_stream_window: self.cfg.max_stream_window,
            max_streams: self.cfg.max_streams,
            max_ranges: recv::closed_id_ranges(self.cfg.max_streams),
            require_posted_receives: self.cfg.require_posted_receives,
            max_tracked_ops: self.cfg.max_tracked_ops,
            max_held_immediates: self.cfg.max_held_immediates,
            max_unconsumed_immediates: self.cfg.max_unconsumed_immediates,
            explicit_consume: self.cfg.explicit_consume,
            max_stream_recv_bytes: self.cfg.max_stream_recv_bytes,
            endpoint_unread_full: self.endpoint_recv.unread_full,
            endpoint_reassembly_others: self.endpoint_recv.reassembly_others,
            max_reassembly_bytes: self.endpoint_recv.max_reassembly,
            reassembly_floor_bytes: self.endpoint_recv.reassembly_floor,
        }
    }

    /// Bytes delivered to the application and not yet consumed (`explicit_consume`).
    pub(crate) fn unread_bytes(&self) -> u64 {
        self.rq.unconsumed_bytes()
    }

    /// Bytes of messages being reassembled into library-owned buffers.
    pub(crate) fn reassembly_bytes(&self) -> u64 {
        self.rq.reassembly_bytes()
    }

    pub fn stats(&self) -> ConnectionStats {
        ConnectionStats {
            peer: self.peer,
            pmtu: self.pmtu,
            paths: self.tx.iter().map(PathTx::info).collect(),
            recv: self.rq.stats(),
            acks_sent: self.acks_sent,
            held_acks_released: self.held_acks_released,
            ack_datagrams_sent: self.ack_datagrams_sent,
            acks_received: self.acks_received,
            data_packets_received: self.data_in,
            duplicate_packets: self.dup_in,
            out_of_window_packets: self.oow_in,
            bad_floor_packets: self.bad_floor_in,
            bad_acks: self.bad_acks,
            acks_ignoring_unsent: self.acks_ignoring_unsent,
            bad_responses: self.bad_responses,
            ce_received: self.ce_in,
            peer_rate_hint_mbps: self.peer_rate_mbps,
            granted_rate_mbps: self.granted_rate_mbps,
            peer_window_grant: u32::from(self.peer_window_grant) * AckEth::WINDOW_GRANT_UNIT,
            granted_window: self.window_grant_packets(self.granted_window_bytes),
            send_window: self
                .tx
                .iter()
                .map(|p| p.cc.window())
                .sum::<u32>()
                .min(self.compute_conn_window()),
            rebalance_rerolls: self.tx.iter().map(|p| p.stats.rebalance_rerolls).sum(),
            protection: self.protection.as_ref().map(|p| *p.stats()),
            send_streams: self.sq.tracked_streams() as u64,
            queued_ops: self.sq.queued_ops() as u64,
            closed_send_stream_ranges: self.sq.retired_ranges() as u64,
        }
    }

    /// The connection's handshake answer arrived (client side).
    pub fn on_connect(
        &mut self,
        now: Instant,
        msg: &ConnectEth,
        payload: &[u8],
        events: &mut VecDeque<Event>,
    ) -> Outcome {
        if !crate::secret::ct_eq_u64(msg.nonce, self.nonce) {
            return Outcome::default();
        }
        self.window_cache = None;
        let Some(hs) = &mut self.handshake else {
            // Established: a repeated Accept of this very identity means our Confirm was
            // lost; send it again.
            if msg.kind == ConnectKind::Accept
                && self.state == State::Established
                && crate::secret::ct_eq_u64(msg.server_nonce, self.server_nonce)
            {
                self.confirm_pending = true;
            }
            return Outcome::default();
        };
        if msg.kind == ConnectKind::Retry {
            // Repeat the Request at once with the cookie; a Retry consumes an attempt's
            // worth of budget so a loop of Retries cannot keep us forever.
            if hs.retries < self.cfg.handshake_attempts {
                hs.retries += 1;
                hs.sends_since_retry = 0;
                hs.cookie = msg.cookie;
                hs.pending = true;
                hs.next_at = now + self.cfg.handshake_interval;
            }
            return Outcome::default();
        }
        let hs = *hs;
        match msg.kind {
            ConnectKind::Accept => {
                if !(256..=4096).contains(&msg.pmtu)
                    || !msg.pmtu.is_power_of_two()
                    || msg.paths == 0
                {
                    return Outcome {
                        lost: Some(ConnectionError::Rejected {
                            code: u32::MAX,
                            reason: Bytes::from_static(b"invalid Accept (path MTU or path count)"),
                        }),
                    };
                }
                // No silent downgrade: an Accept must confirm exactly what we asked for.
                if aead_flag(msg) != self.cfg.packet_protection.is_some() {
                    return Outcome {
                        lost: Some(ConnectionError::Rejected {
                            code: REJECT_PROTECTION_MISMATCH,
                            reason: Bytes::from_static(
                                b"Accept does not match the requested packet protection",
                            ),
                        }),
                    };
                }
                let paths = (msg.paths.min(hs.paths_offered) as usize).max(1);
                let pmtu = self.cfg.pmtu.min(msg.pmtu as u32);
                // The handshake's round trip (only when one request was sent since the
                // last Retry, so the answer is unambiguous — Karn) seeds every path's minimum
                // RTT, which sizes the receiver's grant, before data samples taken behind a
                // queue can inflate it. SRTT and the loss timers wait for data samples.
                let hs_rtt = (hs.sends_since_retry == 1).then(|| {
                    now.saturating_duration_since(hs.next_at - self.cfg.handshake_interval)
                });
                self.establish(now, msg.src_qpn, paths, pmtu, msg.init_psn);
                self.server_nonce = msg.server_nonce;
                let (c2s, s2c) = crate::secret::tokens(self.nonce, msg.server_nonce);
                self.tx_token = c2s;
                self.rx_token = s2c;
                self.confirm_pending = true;
                if let Some(pc) = &self.cfg.packet_protection {
                    self.protection = Some(Box::new(PacketProtection::new(
                        pc,
                        Side::Client,
                        self.nonce,
                        msg.server_nonce,
                    )));
                }
                // The server's grant rides in the Accept, so the blind first window is
                // already capped to grant × handshake RTT (`cc::connection_window`), before
                // any ACK.
                self.peer_rate_mbps = msg.grant_mbps();
                if let Some(r) = hs_rtt.filter(|r| !r.is_zero()) {
                    for p in &mut self.tx {
                        p.rtt.observe_min(r);
                    }
                }
                self.last_heard = now;
                events.push_back(Event::Connected(self.handle));
                Outcome::default()
            }
            ConnectKind::Reject if msg.flags & ConnectEth::FLAG_TRY_AGAIN != 0 => {
                // Busy for this source only, until its earlier connections are confirmed
                // (one round trip each for a legitimate host): try again on the handshake
                // timer, within the same attempt budget (found by review: a host opening
                // 100 connections at once lost 36 of them to this refusal). The flag, not
                // the code: an application's refusal may use any code, 5 included.
                if let Some(hs) = &mut self.handshake {
                    hs.source_limited = true;
                }
                Outcome::default()
            }
            ConnectKind::Reject => {
                // The reason text is the MR_CONNECT payload (docs/PROTOCOL.md, ConnectEth);
                // a longer one is cut like a close reason.
                let n = payload.len().min(crate::MAX_CLOSE_REASON);
                Outcome {
                    lost: Some(ConnectionError::Rejected {
                        code: msg.reason,
                        reason: Bytes::copy_from_slice(&payload[..n]),
                    }),
                }
            }
            ConnectKind::Request | ConnectKind::Retry | ConnectKind::Confirm => Outcome::default(),
        }
    }

    /// A packet addressed to this connection (BTH.DestQP matched).
    #[allow(clippy::too_many_arguments)]
    pub fn handle_packet(
        &mut self,
        now: Instant,
        local_ip: Option<IpAddr>,
        ecn: Option<EcnCodepoint>,
        pkt: &wire::Packet<'_>,
        mrs: &mut MrTable,
        events: &mut VecDeque<Event>,
    ) -> Outcome {
        if self.state != State::Established {
            return Outcome::default();
        }
        // (Datagrams of one receive batch share `now`: no time arithmetic for them, issue
        // #13.)
        if now != self.last_heard
            && now.saturating_duration_since(self.last_heard) >= path::PTO_FLOOR
        {
            self.quiet = Some((self.last_heard, now));
        }
        self.last_heard = now;
        if self.local_ip.is_none() {
            self.local_ip = local_ip;
        }
        match &pkt.headers {
            Headers::Ack(a) if a.flags & AckEth::FLAG_KEEPALIVE != 0 => {
                // A keepalive: answer with an ACK of that path echoing its timestamp (an
                // honest RTT sample for the peer). Nothing else moves.
                if let Some(rx) = self.rx.get_mut(a.path_id as usize) {
                    rx.echo_ts = a.echo_ts;
                    rx.echo_at = Some(now);
                    rx.ack_pending = true;
                    self.ack_due(now, false);
                }
            }
            Headers::Ack(a) if a.flags & AckEth::FLAG_BUNDLE != 0 => {
                let first = self.apply_ack(now, pkt.bth.psn, a);
                self.on_ack_bundle(now, first, pkt.payload, events);
            }
            Headers::Ack(a) => self.on_ack(now, pkt.bth.psn, a, events),
            Headers::Send { path, send } => {
                self.on_data(ecn, pkt, path, Data::Send(send), mrs, events)
            }
            Headers::Write {
                path,
                reth,
                write,
                imm,
            } => self.on_data(ecn, pkt, path, Data::Write(reth, write, *imm), mrs, events),
            Headers::ReadRequest { path, reth, op } => {
                self.on_data(ecn, pkt, path, Data::ReadRequest(reth, op), mrs, events)
            }
            Headers::ReadResponse { path, op } => {
                self.on_data(ecn, pkt, path, Data::ReadResponse(op), mrs, events)
            }
            Headers::Atomic { path, atomic, op } => {
                let fetch_add = pkt.bth.opcode == Opcode::MR_FETCH_ADD;
                self.on_data(
                    ecn,
                    pkt,
                    path,
                    Data::Atomic(atomic, op, fetch_add),
                    mrs,
                    events,
                )
            }
            Headers::AtomicResponse { path, op, ack } => {
                self.on_data(ecn, pkt, path, Data::AtomicResponse(op, ack), mrs, events)
            }
            Headers::Nak { path, nak } => {
                let _span = self.path_span(path.path_id as usize).entered();
                if let Some(p) = self.tx.get_mut(path.path_id as usize) {
                    if let Some(seg) = p.on_nak(pkt.bth.psn, now) {
                        let flow = nak.syndrome & 0xE0 == recv::NAK_FLOW_RNR;
                        if nak.syndrome & 0x60 == 0x20 || flow {
                            // RNR NAK: no receive posted; wait the coded time and retry. A
                            // flow-control RNR NAK (the receiver's buffers for the stream
                            // are full) is retried without limit, and the stream sends no
                            // new message until the wait ends.
                            let delay = send::rnr_timer(nak.syndrome & 0x1F);
                            let copy = self.tx.iter().any(|p| p.is_outstanding(seg));
                            let (id, psn) = (path.path_id, pkt.bth.psn);
                            let retry = if flow { 7 } else { self.cfg.rnr_retry };
                            let waits = self.sq.on_rnr(seg, id, psn, now, delay, retry, copy);
                            // Only a segment now on its RNR wait blocks its stream: its
                            // wait's end picks the probe. A stale NAK, or one for an
                            // operation already finished (a length error NAKed it), put
                            // the stream in the wait with nothing to end it, for good
                            // (found by `prop_rdma`).
                            if flow && waits {
                                self.sq.flow_block(seg);
                            }
                        } else if nak.syndrome == recv::NAK_INVALID_REQUEST
                            && nak.flags & NakEth::FLAG_STREAM_REFUSED != 0
                        {
                            // The peer's stream table was full: the stream is refused
                            // (unless another copy of the segment, still in flight, may
                            // find room: then that copy decides, as for an RNR NAK).
                            let copy = self.tx.iter().any(|p| p.is_outstanding(seg));
                            if let Some((stream, wr_id)) = self.sq.on_stream_refused(seg.op, copy) {
                                // Before the SEND's completion (drained below or later).
                                events.push_back(Event::StreamRefused {
                                    conn: self.handle,
                                    stream,
                                    wr_id,
                                });
                            }
                        } else {
                            self.sq
                                .fail(seg.op, WcStatus::from_nak_syndrome(nak.syndrome));
                        }
                        self.drain_completions(events);
                    }
                }
            }
            // MR_CLOSE is handled by the endpoint (it may outlive the connection).
            _ => {}
        }
        Outcome::default()
    }

    /// The tracing span of path `i`: `path{conn, path, port, plane}` at DEBUG, entered
    /// around everything the connection does for one path (ACK, NAK, loss timer), so that
    /// every loss, timeout, retransmission and re-roll event names the path and its UDP
    /// source port (the ECMP entropy). Disabled spans cost one cached interest check.
    fn path_span(&self, i: usize) -> tracing::Span {
        match self.tx.get(i) {
            Some(p) => tracing::debug_span!(
                "path",
                conn = %self.handle,
                path = p.id,
                port = p.src_port,
                plane = path::plane_of(p.src_port, self.cfg.planes),
            ),
            None => tracing::Span::none(),
        }
    }

    /// The further ACK blocks of a bundled `MR_ACK` (docs/PROTOCOL.md, "ACK bundles"), each
    /// applied like an ACK of its own path. A payload that is not a whole number of blocks,
    /// holds more blocks than the connection has paths, or a block flagged KEEPALIVE or
    /// BUNDLE, is malformed: none of the blocks is applied (`bad_acks` counts it once).
    /// The first AckEth was applied already: it is a complete ACK by itself.
    /// `first`: whether the first AckEth, applied by the caller, made progress.
    fn on_ack_bundle(
        &mut self,
        now: Instant,
        first: bool,
        blocks: &[u8],
        events: &mut VecDeque<Event>,
    ) {
        let bad_flags = AckEth::FLAG_KEEPALIVE | AckEth::FLAG_BUNDLE;
        let well_formed = blocks.len() % AckEth::BLOCK_LEN == 0
            && blocks.len() / AckEth::BLOCK_LEN < self.tx.len().max(1)
            && blocks
                .chunks_exact(AckEth::BLOCK_LEN)
                .all(|b| b[5] & bad_flags == 0);
        let mut progress = first;
        if !well_formed {
            self.bad_acks += 1;
            if progress {
                self.detect_collisions(now);
            }
            self.drain_completions(events);
            return;
        }
        for b in blocks.chunks_exact(AckEth::BLOCK_LEN) {
            if let Ok((cum, a)) = AckEth::parse_block(b) {
                progress |= self.apply_ack(now, cum, &a);
            }
        }
        if progress {
            self.detect_collisions(now);
        }
        self.drain_completions(events);
    }

    fn on_ack(&mut self, now: Instant, cum: u32, a: &AckEth, events: &mut VecDeque<Event>) {
        if self.apply_ack(now, cum, a) {
            self.detect_collisions(now);
        }
        self.drain_completions(events);
    }

    /// Whether a probe that fired at `fired` (while `others_waiting`) and was found
    /// spurious shows a stall of the host or of the peer, which every path of the
    /// connection shares: the latest silence of the whole connection (`quiet`) spans the
    /// firing, and another path was waiting for the peer then. Silence alone is no
    /// evidence: with the other paths idle (request/response traffic), a path slower than
    /// its RTT estimate looks the same.
    fn stall_was_shared(&self, fired: Option<Instant>, others_waiting: bool) -> bool {
        match (fired, self.quiet) {
            (Some(at), Some((from, until))) => others_waiting && from <= at && until > at,
            _ => false,
        }
    }

    /// A valid ACK on path `j` whose echoed timestamp is `sample` old: it answers every
    /// question of a held RTO on another path (`ask_idle_path`) asked at or before the time
    /// it echoes, the answer to a keepalive or anything else the peer acknowledged since:
    /// the peer is alive while that path's packets stay unacknowledged, so its RTO fires
    /// one SRTT of that path later (ACKs of it the peer sent with this one still count;
    /// `PathTx::refute_hold`). Clears `asking` when no path asks any more.
    ///
    /// The echoed timestamp is 32 bits of nanoseconds: in token mode an ACK replayed a
    /// multiple of about 4.29 s later looks recent. AEAD protection's replay window stops
    /// that.
    fn answer_questions(&mut self, now: Instant, j: usize, sample: Option<Duration>) {
        let echoed = sample.and_then(|d| now.checked_sub(d));
        let mut asking = false;
        for (i, h) in self.tx.iter_mut().enumerate() {
            let Some(at) = h.asked_at() else {
                continue;
            };
            if i != j && echoed.is_some_and(|t| t >= at) {
                let grace = h.rtt.smoothed();
                h.refute_hold(now + grace);
            } else {
                asking = true;
            }
        }
        self.asking = asking;
    }

    /// Whether a live path other than `i` has had a packet outstanding for longer than its
    /// smoothed RTT at `now`: its ACK is overdue, it is waiting for the peer as well.
    fn others_waiting(&self, i: usize, now: Instant) -> bool {
        self.tx
            .iter()
            .enumerate()
            .any(|(k, q)| k != i && q.state != PathState::Failed && q.overdue_since(now).is_some())
    }

    /// The per-path part of an ACK (one AckEth, or one block of a bundle): the path's
    /// state, the segments it acknowledges or declares lost. Returns whether it made
    /// progress; the caller then runs the connection-wide part once per datagram (ECMP
    /// collision detection, completions: issue #13, one pass per bundle, not per path).
    fn apply_ack(&mut self, now: Instant, cum: u32, a: &AckEth) -> bool {
        self.window_cache = None;
        let _span = self.path_span(a.path_id as usize).entered();
        let ts = self.ts_at(now);
        let elapsed = ts.wrapping_sub(a.echo_ts);
        let sample = (elapsed < 1 << 31).then(|| Duration::from_nanos(elapsed as u64));
        let Some(p) = self.tx.get_mut(a.path_id as usize) else {
            return false;
        };
        // The time the peer held this ACK (AckEth ACK delay) is not network time: the path
        // subtracts it, at most `max_ack_delay` (RFC 9002 §5.3).
        let held = Duration::from_micros(u64::from(a.ack_delay)).min(self.cfg.max_ack_delay);
        let extra_before = p.pto_extra;
        let (fired, others_waiting) = (p.probe_fired_at(), p.probe_others_waiting);
        let mut out = p.on_ack_delayed(
            now,
            cum,
            &a.sack,
            sample,
            held,
            a.ce_count,
            self.cfg.reorder_threshold,
        );
        if out.invalid {
            // Acknowledges PSNs this path never sent: dropped before it moved anything
            // (not even the rate grant it carries).
            self.bad_acks += 1;
            return false;
        }
        if out.ignored_unsent {
            self.acks_ignoring_unsent += 1;
        }
        self.acks_received += 1;
        self.peer_rate_mbps = a.rate_hint;
        self.peer_window_grant = a.window_grant;
        // A spurious probe taught this path how long the host (or the peer) stalls: the
        // other paths of the connection run between the same two hosts. Not when the
        // connection kept hearing from the peer while this path waited, nor when no other
        // path was waiting for it: then the path itself may be slower than its RTT
        // estimate (a longer route), and its allowance is its own.
        let extra = p.pto_extra;
        let port = p.src_port;
        if extra > extra_before && self.stall_was_shared(fired, others_waiting) {
            for q in &mut self.tx {
                q.learn_stall(extra);
            }
        }
        if out.progress && self.cfg.planes > 1 {
            self.planes.on_progress(port);
            self.rebalance_planes(now);
        }
        let (tx, cfg) = (&self.tx, &self.cfg);
        let mut resp_timeout = || response_timeout(tx, cfg);
        for &s in &out.acked {
            self.sq.on_acked(s, now, &mut resp_timeout);
        }
        for s in out.lost {
            self.sq.on_lost(s);
        }
        // The list goes back to the path for its next ACK (no allocation per ACK).
        out.acked.clear();
        if let Some(p) = self.tx.get_mut(a.path_id as usize) {
            p.spare_acked = out.acked;
        }
        // Only a valid ACK answers a held RTO's question (issue #9: nothing moves state
        // before a packet is validated).
        if self.asking {
            self.answer_questions(now, a.path_id as usize, sample);
        }
        out.progress
    }

    #[allow(clippy::too_many_arguments)]
    fn on_data(
        &mut self,
        ecn: Option<EcnCodepoint>,
        pkt: &wire::Packet<'_>,
        path: &PathEth,
        data: Data<'_>,
        mrs: &mut MrTable,
        events: &mut VecDeque<Event>,
    ) {
        self.data_in += 1;
        let lim = self.limits();
        let handle = self.handle;
        let Some(rx) = self.rx.get_mut(path.path_id as usize) else {
            return;
        };
        let psn = pkt.bth.psn;
        // Nothing moves before the packet's own PSN is known to be in window and its floor
        // consistent with it (docs/PROTOCOL.md, "Delivery": receiver checks).
        // The next PSN on a path without a gap (the common case) passes every check and
        // is new: `is_next` stands for `check`, `apply_floor` and `classify` (issue #13).
        let next = rx.is_next(psn, path.floor_psn);
        if !next {
            let (now, quiet) = (self.last_heard, self.cfg.min_rto);
            match rx.check(psn, path.floor_psn, now, quiet) {
                RxCheck::Ok => {}
                RxCheck::OutOfWindow => {
                    self.oow_in += 1;
                    return;
                }
                RxCheck::BadFloor => {
                    self.bad_floor_in += 1;
                    return;
                }
            }
            rx.apply_floor(path.floor_psn);
        }
        // A PSN received before is still handed to the semantic layer, which is
        // idempotent (per-segment bitmaps, op id records): a network duplicate is counted
        // there as a duplicate and changes nothing, but if a forged or replayed packet
        // took this PSN first, the sender's real packet under it is still placed —
        // otherwise it would be acknowledged (the PSN is marked) and never placed.
        let class = if next { RxClass::New } else { rx.classify(psn) };
        let dup = match class {
            RxClass::OutOfWindow => {
                self.oow_in += 1;
                return;
            }
            RxClass::Duplicate if !rx.recent(psn) => {
                // Far behind the window: a very late copy (or a blind guess). Nothing to
                // place or acknowledge.
                self.dup_in += 1;
                return;
            }
            RxClass::Duplicate => {
                self.dup_in += 1;
                true
            }
            RxClass::New => {
                // The port this path's ACKs and NAKs leave from follows the sender's
                // re-roll generation and plane, taken from new packets only: every packet
                // sent after a re-roll (retransmissions too) has a new PSN, while a late
                // copy from the route the sender left, or a replay, would send the answers
                // back onto that route (found by review).
                rx.generation = path.flags >> 4;
                rx.plane = path.plane;
                false
            }
        };
        let ctrl = path.flags & (send::PATH_FLAG_STREAM_ABORT | send::PATH_FLAG_STREAM_FIN);
        let outcome = match data {
            Data::Send(s) if ctrl == send::PATH_FLAG_STREAM_ABORT | send::PATH_FLAG_STREAM_FIN => {
                // STOP: the peer, receiving on this stream, asks us to stop sending on it.
                // Once per stream: we reset it with the peer's code.
                // msg_seq is where the peer's delivery ended: the messages before it
                // complete from their own ACK or NAK, the rest are flushed (the peer never
                // delivers them).
                // A stream this side has not sent on yet is reset too (room permitting:
                // at most `max_streams` tracked streams), or a later SEND on it would be
                // refused by the stopped receiver forever.
                // Each such reset queues a stream abort, and acknowledged ones wait behind an
                // unfinished operation at the front to be popped: with closed streams
                // forgotten, a peer that keeps the front stuck and STOPs stream after
                // stream would grow the queue without bound. So a STOP for a stream never
                // sent on is taken only while the queue holds fewer than
                // `max_outstanding_ops + max_streams` operations (otherwise it is
                // acknowledged and ignored: a later SEND on that stream would meet the
                // stopped receiver's refusals, which is the STOPping peer's own doing).
                let room = self.sq.tracked_streams() < self.cfg.max_streams as usize
                    && self.sq.queued_ops()
                        < self.cfg.max_outstanding_ops + self.cfg.max_streams as usize;
                let known = self.sq.knows_stream(s.stream_id) || room;
                if known
                    && self
                        .sq
                        .reset_stream_after(s.stream_id, s.offset, Some(s.msg_seq))
                {
                    events.push_back(Event::StreamStopped {
                        conn: handle,
                        stream: s.stream_id,
                        code: s.offset,
                    });
                    self.drain_completions(events);
                }
                RxOutcome::Accepted
            }
            Data::Send(s) if ctrl == send::PATH_FLAG_STREAM_ABORT => {
                self.rq
                    .on_stream_abort(handle, s.stream_id, s.msg_seq, s.offset, &lim, events)
            }
            Data::Send(s) if ctrl == send::PATH_FLAG_STREAM_FIN => {
                self.rq
                    .on_stream_fin(handle, s.stream_id, s.msg_seq, &lim, events)
            }
            Data::Send(s) => self.rq.on_send(handle, s, pkt.payload, &lim, mrs, events),
            Data::Write(_, w, _) if path.flags & send::PATH_FLAG_OP_ABORT != 0 => {
                self.rq.on_op_abort(w.op_id, &lim)
            }
            Data::Write(reth, w, imm) => {
                self.rq
                    .on_write(handle, mrs, reth, w, imm, pkt.payload, &lim, events)
            }
            // With the responder's resources exhausted (`busy`), a new request gets an RNR
            // NAK: the requester waits and retries without counting it as a lost packet.
            // A request that was already executed is acknowledged even then.
            Data::ReadRequest(reth, op) => {
                let busy = self.sq.internal_pending() >= self.cfg.max_rd_atomic;
                let (out, respond) = self.rq.on_read_request(mrs, reth, op, &lim, busy);
                self.respond(respond);
                out
            }
            Data::Atomic(at, op, fetch_add) => {
                let busy = self.sq.internal_pending() >= self.cfg.max_rd_atomic;
                let (out, respond) = self.rq.on_atomic(mrs, at, op, fetch_add, &lim, busy);
                self.respond(respond);
                out
            }
            Data::ReadResponse(op) => {
                let out = self.sq.on_read_response(
                    self.last_heard,
                    op.op_id,
                    op.offset,
                    pkt.payload,
                    mrs,
                );
                self.drain_completions(events);
                self.response_outcome(out)
            }
            Data::AtomicResponse(op, ack) => {
                let out = self.sq.on_atomic_response(op.op_id, ack.orig, mrs);
                self.drain_completions(events);
                self.response_outcome(out)
            }
        };
        if let Data::Send(s) = data {
            // A FIN, reset or the last message may have ended the stream's incoming
            // direction.
            self.retire_incoming(s.stream_id, events);
        }
        // A READ, atomic, refusal or op abort may have moved the floor of finished op ids
        // past held immediates (the WRITE_WITH_IMM fence).
        self.rq.take_released(handle, events);
        let Some(rx) = self.rx.get_mut(path.path_id as usize) else {
            return;
        };
        match outcome {
            RxOutcome::Accepted if dup => {
                // Acknowledged again (its ACK may have been lost), but its timestamp is not
                // echoed: it advanced no PSN, and an old timestamp echoed back would
                // inflate the sender's RTT estimate.
                rx.ack_pending = true;
                self.ack_due(self.last_heard, false);
            }
            RxOutcome::Accepted => {
                rx.mark(psn);
                rx.on_new(self.last_heard);
                self.last_data_rx = Some(self.last_heard);
                if ecn == Some(EcnCodepoint::Ce) {
                    rx.ce_count = rx.ce_count.wrapping_add(1);
                    rx.ce_since_ack = true;
                    self.ce_in += 1;
                }
                rx.echo_ts = path.timestamp;
                rx.echo_at = Some(self.last_heard);
                rx.ack_pending = true;
                // Only a lone, in-order, unmarked first copy of a SEND packet may wait for
                // a reply to ride on (a retransmission answers a sender already waiting,
                // perhaps racing a NAK: it is acknowledged at once).
                let lone_send = matches!(data, Data::Send(_))
                    && ctrl == 0
                    && !path.is_retransmit()
                    && ecn != Some(EcnCodepoint::Ce)
                    && rx.in_order();
                self.ack_due(self.last_heard, lone_send);
            }
            RxOutcome::Drop if !dup => {}
            RxOutcome::Drop
            | RxOutcome::Nak(_)
            | RxOutcome::StreamRefused
            | RxOutcome::Rnr
            | RxOutcome::FlowRnr => {
                // (A dropped packet under a PSN already marked — taken first by a forged
                // packet — would be acknowledged and never retried: it gets an RNR NAK, so
                // the sender re-sends it after the RNR timer.)
                let syndrome = match outcome {
                    RxOutcome::Nak(s) => s,
                    RxOutcome::StreamRefused => recv::NAK_INVALID_REQUEST,
                    RxOutcome::FlowRnr => recv::NAK_FLOW_RNR | (self.cfg.min_rnr_timer & 0x1F),
                    _ => 0x20 | (self.cfg.min_rnr_timer & 0x1F),
                };
                self.rq.stats.naks += 1;
                let op_id = match data {
                    Data::Send(s) => s.stream_id,
                    Data::Write(_, w, _)
                    | Data::ReadRequest(_, w)
                    | Data::Atomic(_, w, _)
                    | Data::ReadResponse(w)
                    | Data::AtomicResponse(w, _) => w.op_id,
                };
                if self.naks.len() < 1024 {
                    self.naks.push_back(PendingNak {
                        path_id: path.path_id,
                        psn,
                        syndrome,
                        flags: if matches!(outcome, RxOutcome::StreamRefused) {
                            NakEth::FLAG_STREAM_REFUSED
                        } else {
                            0
                        },
                        op_id,
                        echo_ts: path.timestamp,
                    });
                }
            }
        }
    }

    /// Stop holding the ACK for a reply (see `Endpoint::release_held_ack`); whether one
    /// was held.
    pub fn release_held_ack(&mut self) -> bool {
        let held = self.ack_hold.take().is_some();
        self.held_acks_released += u64::from(held);
        held
    }

    /// A received packet made an ACK due at `now`. `lone_send`: it is an in-order, unmarked
    /// `MR_SEND` packet; if it is also the only packet not yet acknowledged, its ACK may be
    /// held (`TransportConfig::max_ack_delay`). Anything else makes every ACK due at once.
    fn ack_due(&mut self, now: Instant, lone_send: bool) {
        self.unacked_pkts = self.unacked_pkts.saturating_add(1);
        let delay = self.cfg.max_ack_delay;
        self.ack_hold =
            (lone_send && self.unacked_pkts == 1 && !delay.is_zero()).then(|| now + delay);
    }

    /// Path `i` timed out while other paths deliver ([`Self::others_delivered_since`],
    /// `TransportConfig::path_reroll_on_first_timeout`): move it to a new source port (new
    /// ECMP entropy) at once, on its own plane. A route
    /// inside the plane is dead (a failed spine link); if the whole plane is, its other
    /// paths time out too and `detect_plane_down` moves them all (this one, `Probing` after
    /// a timeout, counts as timed out there).
    fn reroll_at_timeout(&mut self, i: usize) {
        let planes = self.cfg.planes;
        let own = (planes > 1).then(|| path::plane_of(self.tx[i].src_port, planes));
        tracing::info!(conn = %self.handle, path = self.tx[i].id, "path timed out while the others deliver: re-rolled at once");
        self.move_path(i, own);
    }

    /// Whether a path other than `i` had a packet acknowledged that was sent after `since`
    /// (the send time of path `i`'s newest outstanding packet, usually its tail-loss
    /// probe): the network delivered what left after path `i`'s last packet; only path
    /// `i`'s route is silent.
    fn others_delivered_since(&self, i: usize, since: Option<Instant>) -> bool {
        let Some(since) = since else {
            return false;
        };
        self.tx.iter().enumerate().any(|(k, q)| {
            k != i
                && q.state != PathState::Failed
                && q.newest_acked_sent().is_some_and(|t| t > since)
        })
    }

    /// Whether a path other than `i` (not retired) had a packet acknowledged that was sent
    /// after path `i`'s oldest outstanding packet: evidence that the network delivers what
    /// was sent after it, so its silence is a loss. Strictly after: packets written in one
    /// send batch share one send time, and in a receiver's FIFO queue the ones written
    /// first are acknowledged first, so a packet of the same batch is no evidence (issue
    /// #13: with ties counted, a path whose first window waited in the receiver's queue
    /// was declared lost as the ACKs of its batch arrived). A message that fits in one
    /// batch therefore shows no evidence until something later is sent; the unmeasured
    /// hold also requires that no other path is known to work and idle.
    fn loss_evidence(&self, i: usize) -> bool {
        self.others_delivered_since(i, self.tx[i].oldest_outstanding_sent())
    }

    /// Path `i` timed out `path_reroll_timeouts` times in a row: move it to a source port no
    /// other path of this connection uses (new ECMP entropy); with planes, on the healthy
    /// plane with the fewest paths.
    fn reroll(&mut self, i: usize, now: Instant) {
        self.planes.on_path_timeouts(now, &self.tx, i);
        let planes = self.cfg.planes;
        let target = (planes > 1).then(|| {
            let load = self.planes.load(&self.tx);
            self.planes
                .pick(&load, path::plane_of(self.tx[i].src_port, planes))
        });
        self.move_path(i, target);
    }

    /// ECMP collision handling after an ACK (see [`path::Rebalance`]): a path persistently
    /// slower than the connection's fastest moves to a new source port on its plane.
    fn detect_collisions(&mut self, now: Instant) {
        let cfg = path::RebalanceConfig {
            ratio_permille: self.cfg.rebalance_ratio_permille,
            interval_rtts: self.cfg.rebalance_interval_rtts,
            min_packets: self.cfg.rebalance_min_packets,
            rounds: self.cfg.rebalance_rounds,
            max_rerolls: self.cfg.rebalance_max_rerolls,
        };
        let Some(m) = self.rebalance.on_ack(now, &self.tx, &cfg) else {
            return;
        };
        let planes = self.cfg.planes;
        let plane = (planes > 1).then(|| path::plane_of(self.tx[m.path].src_port, planes));
        let Some(port) = self.spare_port(plane) else {
            return;
        };
        let p = &mut self.tx[m.path];
        if p.pending_port.is_some() {
            return;
        }
        tracing::info!(
            conn = %self.handle,
            path = p.id,
            old_port = p.src_port,
            new_port = port,
            acked = m.acked,
            max_acked = m.max_acked,
            "path re-rolled: persistently slower than the fastest path (ECMP collision)"
        );
        p.rebalance(port);
    }

    /// A source port no path uses, on plane `plane` if given and possible; `None` if every
    /// port is taken.
    fn spare_port(&mut self, plane: Option<u8>) -> Option<u16> {
        let used: Vec<u16> = self
            .tx
            .iter()
            .flat_map(|p| [Some(p.src_port), p.pending_port])
            .flatten()
            .collect();
        let n = self.source_ports.len();
        let planes = self.cfg.planes;
        for pass in 0..2 {
            for k in 0..n {
                let cand = self.source_ports[(self.next_spare + k) % n];
                let plane_ok =
                    pass == 1 || plane.is_none_or(|pl| path::plane_of(cand, planes) == pl);
                if plane_ok && !used.contains(&cand) {
                    self.next_spare = (self.next_spare + k + 1) % n;
                    return Some(cand);
                }
            }
        }
        None
    }

    /// Give path `i` a source port no other path uses, on plane `plane` if given and
    /// possible, and make it probe (see [`PathTx::reroll`]).
    fn move_path(&mut self, i: usize, plane: Option<u8>) {
        let port = self.spare_port(plane).unwrap_or(self.tx[i].src_port);
        let p = &mut self.tx[i];
        tracing::info!(conn = %self.handle, path = p.id, old_port = p.src_port, new_port = port, "path re-rolled after repeated timeouts");
        p.reroll(port);
    }

    /// Multi-plane housekeeping after an ACK: a plane found down is probed again every
    /// `plane_retry_interval` by moving one path onto it; paths are moved one per smoothed
    /// RTT from the most to the least loaded healthy plane until the spread is even.
    fn rebalance_planes(&mut self, now: Instant) {
        let planes = self.cfg.planes;
        if planes <= 1 {
            return;
        }
        let srtt = self
            .tx
            .iter()
            .map(|p| p.rtt.smoothed())
            .max()
            .unwrap_or(self.cfg.initial_rtt);
        if self
            .planes
            .last_probe
            .is_some_and(|t| now.saturating_duration_since(t) < srtt)
        {
            return;
        }
        let load = self.planes.load(&self.tx);
        let retry = self.cfg.plane_retry_interval;
        let due = (0..planes as usize).find(|&p| {
            load[p] == 0
                && self.planes.down_since[p]
                    .is_some_and(|t| now.saturating_duration_since(t) >= retry)
        });
        let healthy = |p: &usize| self.planes.down_since[*p].is_none();
        let Some(from) = (0..planes as usize)
            .filter(healthy)
            .max_by_key(|&p| load[p])
        else {
            return;
        };
        let to = match due {
            Some(p) => p,
            None => match (0..planes as usize)
                .filter(healthy)
                .min_by_key(|&p| load[p])
            {
                Some(p) if load[from] >= load[p] + 2 => p,
                _ => return,
            },
        };
        // The path to move: an active one of the busiest plane, preferably idle.
        let Some(i) = (0..self.tx.len())
            .filter(|&k| {
                self.tx[k].state == PathState::Active
                    && path::plane_of(self.tx[k].src_port, planes) as usize == from
            })
            .min_by_key(|&k| self.tx[k].outstanding)
        else {
            return;
        };
        if due.is_some() {
            tracing::info!(conn = %self.handle, plane = to, "probing a plane that was down");
            // If the probe fails, wait another interval before the next one.
            self.planes.down_since[to] = Some(now);
        }
        self.planes.last_probe = Some(now);
        for seg in self.tx[i].abandon(now) {
            self.sq.on_lost(seg);
        }
        self.move_path(i, Some(to as u8));
    }

    /// With planes: when every remaining path of a plane has timed out without progress
    /// since (at least two paths, all suspect or probing), the plane is down — one
    /// retransmission timeout is enough when several independent paths agree — and its
    /// paths move to the healthy planes now instead of after `path_reroll_timeouts`.
    fn detect_plane_down(&mut self, now: Instant) {
        let planes = self.cfg.planes;
        if planes <= 1 {
            return;
        }
        for plane in 0..planes as u8 {
            if self.planes.down_since[plane as usize].is_some() {
                continue;
            }
            let on: Vec<usize> = (0..self.tx.len())
                .filter(|&k| {
                    self.tx[k].state != PathState::Failed
                        && path::plane_of(self.tx[k].src_port, planes) == plane
                })
                .collect();
            let all_timed_out = on.len() >= 2
                && on.iter().all(|&k| {
                    matches!(self.tx[k].state, PathState::Suspect | PathState::Probing)
                        && self.tx[k].consecutive_rtos > 0
                });
            if !all_timed_out {
                continue;
            }
            self.planes.down_since[plane as usize] = Some(now);
            tracing::warn!(conn = %self.handle, plane, "plane down: every path on it timed out");
            for k in on {
                let load = self.planes.load(&self.tx);
                let to = self.planes.pick(&load, plane);
                if self.planes.down_since[to as usize].is_some() {
                    break; // nowhere healthy to go
                }
                for seg in self.tx[k].abandon(now) {
                    self.sq.on_lost(seg);
                }
                self.move_path(k, Some(to));
            }
        }
    }

    /// The local source port for packets answering the peer's path `path_id` (ACKs, NAKs):
    /// it moves with the peer's re-roll generation, and with planes it stays on the plane
    /// the peer sends that path on (`plane`, from PathEth byte 8).
    fn answer_port(&self, path_id: u8, generation: u8, plane: u8) -> u16 {
        let n = self.source_ports.len();
        let paths = self.rx.len().max(1);
        let k = path_id as usize + generation as usize * paths;
        let planes = self.cfg.planes;
        if planes > 1 {
            if let Some(&p) = (0..n)
                .map(|j| &self.source_ports[(k + j) % n])
                .find(|&&p| path::plane_of(p, planes) == plane)
            {
                return p;
            }
        }
        self.source_ports[k % n]
    }

    /// A READ/atomic response that does not answer a request this side sent is dropped
    /// unacknowledged and counted: it places nothing and completes nothing.
    fn response_outcome(&mut self, out: send::RespOutcome) -> RxOutcome {
        match out {
            send::RespOutcome::Accepted => RxOutcome::Accepted,
            send::RespOutcome::Invalid => {
                self.bad_responses += 1;
                RxOutcome::Drop
            }
        }
    }

    fn respond(&mut self, r: Option<Respond>) {
        match r {
            Some(Respond::Read {
                req_id,
                lkey,
                rkey,
                offset,
                len,
            }) => self
                .sq
                .post_read_response_mr(req_id, (lkey, rkey), offset, len),
            Some(Respond::Atomic { req_id, orig }) => self.sq.post_atomic_response(req_id, orig),
            None => {}
        }
    }

    /// The largest retransmission timeout of the connection's paths (`min_rto` if none).
    pub fn largest_rto(&self) -> Duration {
        let (min, max) = (self.cfg.min_rto, self.cfg.max_rto);
        self.tx
            .iter()
            .map(|p| p.rtt.rto(min, max))
            .max()
            .unwrap_or(min)
    }

    fn drain_completions(&mut self, events: &mut VecDeque<Event>) {
        while let Some(wc) = self.sq.pop_completion() {
            events.push_back(Event::Completion {
                conn: self.handle,
                wc,
            });
        }
        // Streams whose outgoing direction just ended for good (their last SEND, FIN or
        // abort left the queue with the completions above): forget them; a stream over
        // both ways is reported closed, after those completions.
        // A stream this side stopped before anything of it was delivered is forgotten
        // too: the peer may never answer the STOP (`RecvState::try_retire_unanswered`).
        let max = recv::closed_id_ranges(self.cfg.max_streams);
        let rq = &mut self.rq;
        let mut closed = Vec::new();
        self.sq.retire_streams(max, |stream| {
            if rq.is_retired(stream) || rq.try_retire_unanswered(stream, max) {
                closed.push(stream);
            }
        });
        for stream in closed {
            self.report_closed(stream, events);
        }
        self.retire_kept(events);
    }

    /// `stream` is over both ways and forgotten: drop what is left of this side's STOP
    /// of it and report it closed (once: each direction is retired once).
    fn report_closed(&mut self, stream: u32, events: &mut VecDeque<Event>) {
        self.sq.forget_stop(stream);
        events.push_back(Event::StreamClosed {
            conn: self.handle,
            stream,
        });
    }

    /// Whether either direction of `stream` ended and was forgotten.
    pub fn stream_is_closed(&self, stream: u32) -> bool {
        self.sq.is_retired(stream) || self.rq.is_retired(stream)
    }

    /// Forget `stream`'s incoming direction if it is over (`RecvState::try_retire`); a
    /// stream over both ways is reported closed.
    fn retire_incoming(&mut self, stream: u32, events: &mut VecDeque<Event>) {
        let max = recv::closed_id_ranges(self.cfg.max_streams);
        if self.rq.try_retire(stream, max) {
            self.incoming_retired(stream, events);
        }
        self.retire_kept(events);
    }

    /// Streams kept at the range bound that fit among the closed ids now
    /// (`RecvState::retire_kept`).
    fn retire_kept(&mut self, events: &mut VecDeque<Event>) {
        let max = recv::closed_id_ranges(self.cfg.max_streams);
        for stream in self.rq.retire_kept(max) {
            self.incoming_retired(stream, events);
        }
    }

    /// `stream`'s incoming direction was just forgotten: this side's STOP of it is no
    /// longer needed, and a stream over both ways is reported closed.
    fn incoming_retired(&mut self, stream: u32, events: &mut VecDeque<Event>) {
        if self.sq.is_retired(stream) {
            self.report_closed(stream, events);
        } else {
            self.sq.forget_stop(stream);
        }
    }

    /// Fail every pending operation and report it; used when the connection ends.
    pub fn flush(&mut self, first: WcStatus, events: &mut VecDeque<Event>) {
        self.sq.fail_all(first);
        self.drain_completions(events);
        self.rq.flush_receives(self.handle, events);
    }

    /// Flush what `finish`/`reset` completed at once.
    pub fn report(&mut self, events: &mut VecDeque<Event>) {
        self.drain_completions(events);
    }

    pub fn post_send(&mut self, wr_id: u64, stream: u32, data: bytes::Bytes) {
        self.sq.post_send(wr_id, stream, data);
    }

    pub fn post_write(&mut self, req: &crate::endpoint::WriteRequest) {
        self.sq.post_write(req);
    }

    pub fn post_read(&mut self, req: &crate::endpoint::ReadRequest) {
        self.sq.post_read(req);
    }

    pub fn post_atomic(&mut self, req: &crate::endpoint::AtomicRequest) {
        self.sq.post_atomic(req);
    }

    /// Stop `stream` as its receiver: delivery ends here (`RecvState::stop`) and a STOP
    /// naming the stop point asks the peer to flush the rest.
    pub fn stop_stream(&mut self, stream: u32, code: u32, events: &mut VecDeque<Event>) {
        if self.rq.is_retired(stream) {
            // It ended and was forgotten: nothing more arrives to stop.
            return;
        }
        let lim = self.limits();
        let delivered = self.rq.stop(stream, &lim);
        // With no room for the stream's incoming state (`max_streams`), the STOP is sent
        // but not remembered: nothing here would ever forget it.
        let remember = self.rq.has_stream(stream);
        self.sq.stop_stream(stream, code, delivered, remember);
        // This side's sending on it is over already: a stream stopped before anything of
        // it was delivered is forgotten now (the peer may never answer the STOP).
        // (Without room for its state, `RecvState::stop` forgot it at once.)
        let max = recv::closed_id_ranges(self.cfg.max_streams);
        if self.sq.is_retired(stream)
            && (!remember && self.rq.is_retired(stream)
                || self.rq.try_retire_unanswered(stream, max))
        {
            self.report_closed(stream, events);
        }
        self.retire_kept(events);
    }

    /// The application consumed `bytes` of the messages delivered on `stream`.
    pub fn stream_consumed(&mut self, stream: u32, bytes: u64, events: &mut VecDeque<Event>) {
        self.rq.consume(stream, bytes);
        self.retire_incoming(stream, events);
    }

    pub fn immediates_consumed(&mut self, n: u32) {
        self.rq.immediates_consumed(n);
    }

    pub fn post_recv(&mut self, stream: u32, r: recv::PostedRecv) {
        self.rq.post_recv(stream, r);
    }

    /// Cancel operation or posted receive `wr_id` (see `Endpoint::cancel`); due
    /// completions are reported into `events`.
    pub fn cancel(
        &mut self,
        wr_id: u64,
        events: &mut VecDeque<Event>,
    ) -> crate::endpoint::CancelOutcome {
        let out = match self.sq.cancel(wr_id) {
            Some(o) => o,
            None => Self::withdrawn(self.rq.withdraw_recv(None, wr_id)),
        };
        self.drain_completions(events);
        self.rq.take_flushed(self.handle, events);
        out
    }

    /// Withdraw the receive `wr_id` posted on `stream` (see `Endpoint::cancel_recv`).
    pub fn cancel_recv(
        &mut self,
        stream: u32,
        wr_id: u64,
        events: &mut VecDeque<Event>,
    ) -> crate::endpoint::CancelOutcome {
        let out = Self::withdrawn(self.rq.withdraw_recv(Some(stream), wr_id));
        self.rq.take_flushed(self.handle, events);
        out
    }

    fn withdrawn(w: Option<bool>) -> crate::endpoint::CancelOutcome {
        use crate::endpoint::CancelOutcome;
        match w {
            Some(true) => CancelOutcome::Cancelled,
            Some(false) => CancelOutcome::Finishing,
            None => CancelOutcome::Unknown,
        }
    }

    /// Cancel the unfinished WRITEs, READs and atomics named in `wr_ids` (see
    /// `Endpoint::cancel_many`); due completions are reported into `events`.
    pub fn cancel_many(&mut self, wr_ids: &[u64], events: &mut VecDeque<Event>) -> usize {
        let n = self.sq.cancel_many(wr_ids);
        self.drain_completions(events);
        n
    }

    // ---- timers ----

    pub fn next_timeout(&self) -> Option<Instant> {
        let mut t: Option<Instant> = None;
        let mut consider = |x: Option<Instant>| {
            if let Some(x) = x {
                t = Some(t.map_or(x, |t| t.min(x)));
            }
        };
        if let Some(hs) = &self.handshake {
            consider(Some(hs.next_at));
        }
        if let Some(h) = &self.half_open {
            consider(Some(h.next_at));
        }
        for p in &self.tx {
            consider(p.loss_deadline(self.cfg.min_rto, self.cfg.max_rto));
        }
        consider(self.sq.wait_deadline());
        consider(self.ack_hold);
        if let Some(cl) = &self.closing {
            consider(Some(cl.deadline));
        }
        // Completions of operations flushed when posted (on a dead stream) are reported by
        // the next timer call: now.
        if self.sq.completion_ready() || self.rq.has_flushed() {
            consider(Some(self.last_heard));
        }
        if self.state == State::Established {
            if let Some(idle) = self.cfg.idle_timeout {
                consider(Some(self.last_heard + idle));
            }
            if let Some(k) = self.cfg.effective_keepalive() {
                consider(Some(self.keepalive_base() + k));
            }
        }
        t
    }

    pub fn handle_timeout(&mut self, now: Instant, events: &mut VecDeque<Event>) -> Outcome {
        self.window_cache = None;
        if self.ack_hold.is_some_and(|t| now >= t) {
            // Nothing went back to the peer in time: the held ACK leaves alone.
            self.ack_hold = None;
        }
        if let Some(hs) = &mut self.handshake {
            if now >= hs.next_at {
                if hs.attempts >= self.cfg.handshake_attempts {
                    let lost = if hs.source_limited {
                        ConnectionError::Rejected {
                            code: ConnectEth::REASON_SOURCE_LIMIT,
                            reason: Bytes::new(),
                        }
                    } else {
                        ConnectionError::HandshakeTimeout
                    };
                    return Outcome { lost: Some(lost) };
                }
                hs.pending = true;
                hs.next_at = now + self.cfg.handshake_interval;
            }
            return Outcome::default();
        }
        self.drain_completions(events);
        self.rq.take_flushed(self.handle, events);
        // A server that has heard nothing from its client since accepting re-sends the
        // Accept every `handshake_interval` (if it was lost, the client drops data until one
        // arrives), at most `handshake_attempts` times: then the half-open connection
        // expires (issue #9: half-open state is bounded in time).
        if let Some(h) = &mut self.half_open {
            if now >= h.next_at {
                if h.attempts >= self.cfg.handshake_attempts {
                    self.flush(WcStatus::WrFlushError, events);
                    return Outcome {
                        lost: Some(ConnectionError::HandshakeTimeout),
                    };
                }
                h.attempts += 1;
                h.next_at = now + self.cfg.handshake_interval;
                self.accept_pending = true;
            }
        }
        if self.sq.wait_deadline().is_some_and(|t| t <= now) {
            self.sq.on_wait_timer(now, self.cfg.retry_count);
        }
        let retry = self.cfg.retry_count;
        let mut lost = Vec::new();
        let heard = self.last_heard;
        let mut probing = self.tx.iter().any(|q| q.probe_unanswered_since(heard));
        for i in 0..self.tx.len() {
            // One path can have two timers due at once: the RACK reorder timer and, behind
            // it, the probe or RTO of what it left outstanding (a late call, or a late grace
            // that held both). Each round settles one of them, so no due timer is left for a
            // driver to spin on: the RACK round clears `rack_deadline`, a probe or a grace
            // moves the deadline past `now`, an RTO leaves nothing outstanding or (held)
            // re-arms the timer `rto · 2^k + stall` after `now`.
            for round in 0..LOSS_TIMER_ROUNDS {
                let first = round == 0;
                if !self.on_path_loss_timer(i, now, first, retry, heard, &mut probing, &mut lost) {
                    break;
                }
            }
        }
        self.detect_plane_down(now);
        for s in lost {
            self.sq.on_lost(s);
        }
        if !self.tx.is_empty() && self.tx.iter().all(|p| p.state == PathState::Failed) {
            self.flush(WcStatus::RetryExceeded, events);
            return Outcome {
                lost: Some(ConnectionError::RetryExceeded),
            };
        }
        if let Some(idle) = self.cfg.idle_timeout {
            if now >= self.last_heard + idle {
                tracing::debug!(conn = %self.handle, "idle timeout: nothing heard from the peer");
                return Outcome {
                    lost: Some(ConnectionError::IdleTimeout),
                };
            }
        }
        if let Some(k) = self.cfg.effective_keepalive() {
            if now >= self.keepalive_base() + k && !self.tx.is_empty() {
                self.keepalive_pending = true;
                self.last_keepalive = Some(now);
            }
        }
        Outcome::default()
    }

    /// Handle path `i`'s loss timer if it is due at `now` (one round of
    /// [`handle_timeout`](Self::handle_timeout)): a late timer (`first` round only: the
    /// call's lateness is judged once) or a probe while another is unanswered is put off,
    /// else the path's RACK, probe or RTO step runs and its lost segments are added to
    /// `lost`. Returns whether a step ran that can leave another timer of the path due (the
    /// RACK reorder timer).
    #[allow(clippy::too_many_arguments)]
    fn on_path_loss_timer(
        &mut self,
        i: usize,
        now: Instant,
        first: bool,
        retry: u32,
        heard: Instant,
        probing: &mut bool,
        lost: &mut Vec<SegRef>,
    ) -> bool {
        let (min_rto, max_rto) = (self.cfg.min_rto, self.cfg.max_rto);
        let Some(d) = self.tx[i]
            .loss_deadline(min_rto, max_rto)
            .filter(|&d| d <= now)
        else {
            return false;
        };
        let _span = self.path_span(i).entered();
        let p = &mut self.tx[i];
        if first && p.defer_if_late(now, d) {
            return false;
        }
        // The peer went silent on every path: one probe at a time (PathTx::defer_probe).
        if *probing && p.defer_probe(now, heard) {
            return false;
        }
        let reorder = p.rack_due(now);
        // An RTO is held when nothing shows a loss (PathTx::hold_timeout):
        // - *silent* (`hold_silent_rto`, the first RTO in a row): the peer went silent on
        //   every path, not on this one only. Either nothing was heard since this path's
        //   probe and every other live path has been waiting for ACKs since before it,
        //   longer than its own smoothed RTT; or nothing sent after this path's oldest
        //   outstanding packet was acknowledged on any path (the peer acknowledges only
        //   older packets: its queue has not reached these; issue #13, 8 connections
        //   ramping up together) and every other live path is waiting too. An idle path
        //   may well work, a peer with nothing else to acknowledge is silent too, and a
        //   slow path's ACKs may just not be due yet: then no hold.
        // - *unmeasured* (`unmeasured_rto_holds` in a row): the path has no RTT sample, so
        //   the RTO came from `initial_rtt`, a guess; every earlier RTO of the path was
        //   held this way; and nothing sent after its oldest outstanding packet has been
        //   acknowledged on any path (issue #13: connections starting together on a
        //   loaded host).
        // The hold's probe must be able to go out (its segment still awaited, the SACK span
        // open): a path holding packets whose segments were settled through other paths
        // would send nothing and only count timeouts until it is retired.
        let p = &self.tx[i];
        let probed = p.probe_fired_at();
        let holdable = |in_a_row: u32| {
            p.can_hold_timeout(now, self.cfg.path_reroll_timeouts, retry, in_a_row)
                && p.can_probe()
                && p.newest_outstanding_seg()
                    .is_some_and(|s| self.sq.is_live(s))
                && self
                    .tx
                    .iter()
                    .filter(|q| q.state != PathState::Failed)
                    .count()
                    > 1
        };
        // A path known to work and idle could take the packets (found by review: a dead
        // route under request/response traffic held its first RPC two RTOs).
        let idle_measured_path = |k: usize, q: &PathTx| {
            k != i && q.state != PathState::Failed && q.outstanding == 0 && q.rtt.latest().is_some()
        };
        let idle_measured = self
            .tx
            .iter()
            .enumerate()
            .any(|(k, q)| idle_measured_path(k, q));
        let evidence = self.loss_evidence(i);
        let unmeasured = p.rtt.latest().is_none()
            && p.stats.rtos == p.stats.unmeasured_rtos
            && !idle_measured
            && holdable(self.cfg.unmeasured_rto_holds)
            && !evidence;
        // Every other live path waiting for the peer (`since_probe`: since before this
        // path's probe), or idle (`idle_too`).
        let waiting = |since_probe: bool, idle_too: bool| {
            self.tx.iter().enumerate().all(|(k, q)| {
                k == i
                    || q.state == PathState::Failed
                    || (idle_too && q.outstanding == 0)
                    || q.overdue_since(now)
                        .is_some_and(|sent| !since_probe || probed.is_some_and(|at| sent <= at))
            })
        };
        let silent = !unmeasured
            && self.cfg.hold_silent_rto
            && holdable(1)
            && ((p.probe_unanswered_since(heard) && waiting(true, false))
                || (!evidence && waiting(false, false)));
        // - *asked* (`ask_idle_path`, the first RTO in a row): as the second kind of
        //   silence, except that some other live paths are idle rather than waiting. An
        //   idle path may work, so the hold asks: keepalives go out on up to ASK_PATHS idle
        //   paths with an RTT sample, smallest SRTT first. A valid ACK on another path
        //   that echoes a time at or after the question, while this path's packets are
        //   still unacknowledged, shows the peer alive and this path not: the RTO fires
        //   then (`answer_questions`, `PathTx::refute_hold`). Without one (a host stall of
        //   the peer, issue #13: a single connection's 64 B WRITEs on a loaded host) the
        //   ACKs that end the silence settle the packets, and only the hold's probe was
        //   sent twice.
        let ask = !unmeasured
            && !silent
            && self.cfg.ask_idle_path
            && !evidence
            && holdable(1)
            && waiting(false, true);
        let mut via = [0u16; ASK_PATHS];
        let mut n = 0;
        if ask {
            // The idle paths with an RTT sample, smallest SRTT first, at most ASK_PATHS.
            let idle = self
                .tx
                .iter()
                .enumerate()
                .filter(|&(k, q)| idle_measured_path(k, q));
            for (k, q) in idle {
                let srtt = |j: u16| self.tx[j as usize].rtt.smoothed();
                let at = via[..n]
                    .iter()
                    .position(|&j| q.rtt.smoothed() < srtt(j))
                    .unwrap_or(n);
                if at < ASK_PATHS {
                    via.copy_within(at..ASK_PATHS - 1, at + 1);
                    via[at] = k as u16;
                    n = (n + 1).min(ASK_PATHS);
                }
            }
        }
        if unmeasured || silent || n > 0 {
            let why = if unmeasured {
                Hold::Unmeasured
            } else if silent {
                Hold::Silent
            } else {
                Hold::Asked
            };
            let p = &mut self.tx[i];
            p.hold_timeout(now, why);
            self.probe_pending |= p.probe.is_some();
            for &k in &via[..n] {
                self.ask_keepalives[usize::from(k) / 64] |= 1 << (k % 64);
                self.asking = true;
            }
            return false;
        }
        let p = &mut self.tx[i];
        let (newest, rtos, refuted) = (p.newest_outstanding_sent(), p.stats.rtos, p.refuted());
        let segs = p.on_loss_timer(now, retry);
        if p.probe_fired_at() == Some(now) {
            let waiting = self.others_waiting(i, now);
            self.tx[i].probe_others_waiting = waiting;
        }
        let p = &mut self.tx[i];
        self.probe_pending |= p.probe.is_some();
        *probing |= p.probe_unanswered_since(heard);
        lost.extend(segs);
        // A refuted hold's RTO was counted when it was held.
        let timed_out = p.stats.rtos > rtos || (refuted && !p.refuted());
        if p.state == PathState::Failed {
            tracing::warn!(conn = %self.handle, path = p.id, "path retired: retry count exceeded");
        } else if p.wants_reroll(self.cfg.path_reroll_timeouts) {
            self.reroll(i, now);
            if self.cfg.path_reroll_resets_backoff && self.others_delivered_since(i, newest) {
                self.tx[i].reset_backoff();
            }
        } else if timed_out
            && self.cfg.path_reroll_on_first_timeout
            && self.others_delivered_since(i, newest)
        {
            self.reroll_at_timeout(i);
            if self.cfg.path_reroll_resets_backoff {
                self.tx[i].reset_backoff();
            }
        }
        reorder
    }

    /// What the keepalive interval counts from: the last packet heard, or the last
    /// keepalive sent since.
    fn keepalive_base(&self) -> Instant {
        match self.last_keepalive {
            Some(k) if k > self.last_heard => k,
            _ => self.last_heard,
        }
    }

    // ---- transmit ----

    fn ip_header(&self) -> Option<icrc::IpHeader> {
        let local = self.local_ip.unwrap_or(match self.peer.ip() {
            IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        });
        icrc::IpHeader::synthesized(local, self.peer.ip()).ok()
    }

    /// The trailer a packet of this connection carries: none on `MR_CONNECT`; the AEAD
    /// trailer (its bytes filled in by [`PacketProtection::seal`]) when the connection is
    /// protected; else the direction's token.
    pub fn trailer_for(&self, op: Opcode) -> Trailer {
        if op == Opcode::MR_CONNECT {
            Trailer::None
        } else if self.protection.is_some() {
            Trailer::Aead {
                key_phase: false,
                pn: 0,
                tag: [0; 16],
            }
        } else {
            Trailer::Token(self.tx_token)
        }
    }

    /// Append one packet to `buf`, seal it when the connection is AEAD-protected (every
    /// opcode but `MR_CONNECT`) and stamp its ICRC; returns its length.
    pub fn emit(
        &mut self,
        buf: &mut Vec<u8>,
        src_port: u16,
        bth: &Bth,
        hdrs: &Headers,
        payload: &[u8],
    ) -> Option<usize> {
        self.emit_with(buf, src_port, bth, hdrs, payload.len(), |b| {
            b.extend_from_slice(payload);
            true
        })
    }

    /// [`emit`](Self::emit) with the payload appended by `fill`: it is handed `buf` ending
    /// right after the headers and must append exactly `payload_len` bytes (or return
    /// `false`: nothing is emitted, `buf` is as before). The payload is written once, by
    /// `fill` (a WRITE's source region copies its bytes straight in), and never zero-filled
    /// first (issue #13, P1).
    pub fn emit_with(
        &mut self,
        buf: &mut Vec<u8>,
        src_port: u16,
        bth: &Bth,
        hdrs: &Headers,
        payload_len: usize,
        fill: impl FnOnce(&mut Vec<u8>) -> bool,
    ) -> Option<usize> {
        let trailer = self.trailer_for(bth.opcode);
        let len = wire::packet_len_with(hdrs, payload_len, &trailer);
        self.emit_sized(buf, src_port, bth, hdrs, &trailer, len, payload_len, fill)
    }

    /// [`emit_with`](Self::emit_with) for a caller that already has the packet's trailer
    /// (`trailer_for(bth.opcode)`) and its length `len` (`wire::packet_len_with`), so a
    /// data packet computes neither twice (issue #13).
    #[allow(clippy::too_many_arguments)]
    fn emit_sized(
        &mut self,
        buf: &mut Vec<u8>,
        src_port: u16,
        bth: &Bth,
        hdrs: &Headers,
        trailer: &wire::Trailer,
        len: usize,
        payload_len: usize,
        fill: impl FnOnce(&mut Vec<u8>) -> bool,
    ) -> Option<usize> {
        let start = buf.len();
        // BTH and extension headers: what the length holds besides payload, pad, trailer
        // and ICRC.
        let head = len - payload_len - wire::pad_for(payload_len) - trailer.len() - wire::ICRC_LEN;
        debug_assert_eq!(head, wire::BTH_LEN + hdrs.len());
        buf.resize(start + head, 0);
        if !fill(buf) || buf.len() != start + head + payload_len {
            buf.truncate(start);
            return None;
        }
        buf.resize(start + len, 0);
        let out = &mut buf[start..];
        if wire::emit_packet_in_place(bth, hdrs, payload_len, trailer, out).is_err() {
            buf.truncate(start);
            return None;
        }
        if let (Some(p), wire::Trailer::Aead { .. }) = (self.protection.as_mut(), trailer) {
            if p.seal(out).is_err() {
                buf.truncate(start);
                return None;
            }
        }
        if let Some(ip) = self.icrc_ip() {
            let _ = icrc::stamp(&ip, src_port, self.peer.port(), out);
        }
        Some(len)
    }

    /// The IP header the ICRC covers (cached while the addresses stay).
    fn icrc_ip(&mut self) -> Option<icrc::IpHeader> {
        let peer_ip = self.peer.ip();
        match self.tx_ip {
            Some((l, p, ip)) if l == self.local_ip && p == peer_ip => ip,
            _ => {
                let ip = self.ip_header();
                self.tx_ip = Some((self.local_ip, peer_ip, ip));
                ip
            }
        }
    }

    /// [`emit_sized`](Self::emit_sized) for a payload that stays in its region (gather
    /// send): `buf` gets the packet's head and tail, `lend` the span `[o, o + payload_len)`
    /// of `memory`, the region `src = (mrs, lkey, o)` names; the ICRC is computed over the
    /// region's bytes now. Never for a sealed packet.
    #[allow(clippy::too_many_arguments)]
    fn emit_lent(
        &mut self,
        buf: &mut Vec<u8>,
        src_port: u16,
        bth: &Bth,
        hdrs: &Headers,
        trailer: &wire::Trailer,
        len: usize,
        payload_len: usize,
        src: (&MrTable, u32, usize),
        memory: LendHandle,
        lend: &mut Lent,
    ) -> Option<usize> {
        let (mrs, lkey, o) = src;
        let start = buf.len();
        let tail = wire::tail_len(payload_len, trailer);
        let head = len.checked_sub(payload_len + tail)?;
        buf.resize(start + head + tail, 0);
        let (h, t) = buf[start..].split_at_mut(head);
        if wire::emit_split(bth, hdrs, payload_len, trailer, h, t).is_err() {
            buf.truncate(start);
            return None;
        }
        if let Some(ip) = self.icrc_ip() {
            let (h, t) = buf[start..].split_at_mut(head);
            let body = t.len() - wire::ICRC_LEN;
            let mut read = Ok(());
            let crc = icrc::compute_parts(
                &ip,
                src_port,
                self.peer.port(),
                h,
                payload_len,
                |hs| read = mrs.local_with_span(lkey, o, payload_len, &mut |b| hs.update(b)),
                &t[..body],
            );
            if read.is_err() {
                buf.truncate(start);
                return None;
            }
            t[body..].copy_from_slice(&crc.to_le_bytes());
        }
        lend.push(
            memory,
            LentSpan {
                at: start + head,
                offset: o,
                len: payload_len,
            },
        );
        Some(len)
    }

    /// Whether received packets must be AEAD-protected.
    pub fn is_protected(&self) -> bool {
        self.protection.is_some()
    }

    /// Verify and decrypt a received packet in place (see [`PacketProtection::open`]);
    /// `Err(OpenError::Malformed)` on an unprotected connection.
    pub fn open(&mut self, pkt: &mut [u8]) -> Result<Opened, OpenError> {
        match self.protection.as_mut() {
            Some(p) => p.open(pkt),
            None => Err(OpenError::Malformed),
        }
    }

    /// Ask for a key update (see [`PacketProtection::request_key_update`]); `None` when the
    /// connection is not protected.
    pub fn update_keys(&mut self) -> Option<bool> {
        self.protection.as_mut().map(|p| p.request_key_update())
    }

    fn transmit(
        &self,
        src_port: u16,
        ecn: Option<EcnCodepoint>,
        size: usize,
        segment: Option<usize>,
    ) -> Transmit {
        Transmit {
            destination: self.peer,
            src_port,
            ecn,
            size,
            segment_size: segment,
        }
    }

    /// The trailer of a packet of `opcode` sent on this connection: none on `MR_CONNECT`,
    /// the token of our sending direction on everything else.
    pub fn connect_packet(&self, kind: ConnectKind, reason: u32) -> (Bth, Headers) {
        let paths = match (&self.handshake, kind) {
            (Some(hs), _) => hs.paths_offered,
            _ => self.tx.len() as u16,
        };
        let dest = if kind == ConnectKind::Request {
            0
        } else {
            self.peer_qpn
        };
        let bth = Bth::new(Opcode::MR_CONNECT, dest, 0);
        let hdrs = Headers::Connect(ConnectEth {
            kind,
            version: PROTOCOL_VERSION,
            paths,
            flags: if self.cfg.packet_protection.is_some() {
                ConnectEth::FLAG_AEAD
            } else {
                0
            },
            src_qpn: self.handle.0,
            dst_qpn: self.peer_qpn,
            pmtu: self.pmtu as u16,
            listen_port: self.local_port,
            init_psn: self.init_psn,
            nonce: self.nonce,
            server_nonce: if kind == ConnectKind::Request {
                0
            } else {
                self.server_nonce
            },
            cookie: match (&self.handshake, kind) {
                (Some(hs), ConnectKind::Request) => hs.cookie,
                _ => [0; 16],
            },
            // A request or accept carries our current grant for the peer instead of a
            // reject reason (docs/PROTOCOL.md, ConnectEth bytes 28–31).
            reason: if kind == ConnectKind::Reject {
                reason
            } else {
                self.granted_rate_mbps
            },
        });
        (bth, hdrs)
    }

    /// [`ts32`]`(self.epoch, now)`, remembered for the last `now` asked (issue #13: every
    /// block of an ACK bundle and every batch sent at one `now` need it, and the
    /// `Instant` subtraction is the costly part).
    #[inline]
    fn ts_at(&mut self, now: Instant) -> u32 {
        match self.ts_cache {
            Some((at, ts)) if at == now => ts,
            _ => {
                let ts = ts32(self.epoch, now);
                self.ts_cache = Some((now, ts));
                ts
            }
        }
    }

    fn conn_window(&mut self) -> u32 {
        if let Some(w) = self.window_cache {
            return w;
        }
        let w = self.compute_conn_window();
        self.window_cache = Some(w);
        w
    }

    /// `bytes` of the receiver's socket buffer as an [`AckEth::window_grant`]: whole
    /// packets of this connection's path MTU, in units of [`AckEth::WINDOW_GRANT_UNIT`],
    /// at least 1 unit and at most 255; 0 when `bytes` is 0 (no grant).
    fn window_grant_units(&self, bytes: u64) -> u8 {
        if bytes == 0 {
            return 0;
        }
        let packets = bytes / u64::from(self.pmtu.max(1));
        u8::try_from(packets / u64::from(AckEth::WINDOW_GRANT_UNIT))
            .unwrap_or(u8::MAX)
            .max(1)
    }

    /// [`window_grant_units`](Self::window_grant_units) in packets (for the stats).
    pub(crate) fn window_grant_packets(&self, bytes: u64) -> u32 {
        u32::from(self.window_grant_units(bytes)) * AckEth::WINDOW_GRANT_UNIT
    }

    fn compute_conn_window(&self) -> u32 {
        let srtt = self
            .tx
            .iter()
            .map(|p| p.rtt.smoothed())
            .max()
            .unwrap_or(self.cfg.initial_rtt);
        let min_rtt = self.tx.iter().filter_map(|p| p.rtt.min()).min();
        cc::connection_window(
            &self.cfg.congestion,
            self.pmtu,
            self.peer_rate_mbps,
            u32::from(self.peer_window_grant) * AckEth::WINDOW_GRANT_UNIT,
            self.acks_received > 0,
            min_rtt,
            srtt,
        )
    }

    /// The next pending MR_ACK datagram (rotating over the paths whose receive side owes
    /// one, several paths of one plane bundled into one datagram), written into `buf`; `None` when no path owes an ACK. Called by
    /// [`poll_transmit`](Self::poll_transmit) and, when the connection is closed locally, by
    /// the endpoint to flush the ACKs still owed ahead of the MR_CLOSE (so a message this
    /// side received is never reported lost by the sender merely because the close
    /// overtook its ACK).
    pub fn poll_ack(&mut self, now: Instant, buf: &mut Vec<u8>) -> Option<Transmit> {
        buf.clear();
        let (port, n_bytes) = self.append_ack(now, buf, None)?;
        Some(self.transmit(port, None, n_bytes, None))
    }

    /// The source port of the ACK datagram [`poll_ack`](Self::poll_ack) would send next
    /// and its length in bytes, when exactly one path owes an ACK (the delayed-ACK case,
    /// `ack_due`); `None` otherwise.
    fn lone_ack(&self) -> Option<(u16, usize)> {
        if self.unacked_pkts != 1 {
            return None;
        }
        let mut due = self.rx.iter().enumerate().filter(|(_, r)| r.ack_pending);
        let (i, r) = due.next()?;
        if due.next().is_some() {
            return None;
        }
        let port = self.answer_port(i as u8, r.generation, r.plane);
        let hdrs = Headers::Ack(AckEth::default());
        let len = wire::packet_len_with(&hdrs, 0, &self.trailer_for(Opcode::MR_ACK));
        Some((port, len))
    }

    /// Append the next pending MR_ACK datagram (see [`poll_ack`](Self::poll_ack)) to
    /// `buf`; returns its source port and length. With `port_wanted` set, nothing is appended
    /// (and nothing changes) unless the datagram would leave from that port.
    fn append_ack(
        &mut self,
        now: Instant,
        buf: &mut Vec<u8>,
        port_wanted: Option<u16>,
    ) -> Option<(u16, usize)> {
        // The next path in turn with an ACK due, bundled with up to `max_ack_bundle - 1`
        // further due paths of the same plane (docs/PROTOCOL.md, "ACK bundles"); the
        // datagram leaves from the first path's answer port.
        let nrx = self.rx.len();
        // Paths in turn from `next_ack_path`, wrapping without a division per step. No
        // path owes an ACK while `unacked_pkts` is 0: every `ack_pending = true` goes with
        // an `ack_due`, which counts it, and the count goes back to 0 only when no path
        // owes one (below). Most calls end here (issue #13: one scan of every path per
        // data packet sent).
        if nrx == 0 || self.unacked_pkts == 0 {
            return None;
        }
        let start = self.next_ack_path % nrx;
        for k in 0..nrx {
            let i = if start + k < nrx {
                start + k
            } else {
                start + k - nrx
            };
            if !self.rx[i].ack_pending {
                continue;
            }
            let port = self.answer_port(i as u8, self.rx[i].generation, self.rx[i].plane);
            if port_wanted.is_some_and(|p| p != port) {
                return None;
            }
            let plane = self.rx[i].plane;
            let grant = (
                self.granted_rate_mbps,
                self.window_grant_units(self.granted_window_bytes),
            );
            let mut flags = self.rx[i].take_ack_flags();
            let first = &self.rx[i];
            let (cum, first_ack) = (first.cum, first.ack_eth(i as u8, flags, grant, now));
            let mut last = i;
            let mut blocks = std::mem::take(&mut self.ack_scratch);
            blocks.clear();
            let max = self.cfg.max_ack_bundle.max(1);
            let mut n = 1;
            for k2 in k + 1..nrx {
                if n >= max {
                    break;
                }
                let j = if start + k2 < nrx {
                    start + k2
                } else {
                    start + k2 - nrx
                };
                let rx = &mut self.rx[j];
                if !rx.ack_pending || rx.plane != plane {
                    continue;
                }
                let f = rx.take_ack_flags();
                let at = blocks.len();
                blocks.resize(at + AckEth::BLOCK_LEN, 0);
                let _ = rx
                    .ack_eth(j as u8, f, grant, now)
                    .emit_block(rx.cum, &mut blocks[at..]);
                last = j;
                n += 1;
            }
            if n > 1 {
                flags |= AckEth::FLAG_BUNDLE;
            }
            self.next_ack_path = (last + 1) % nrx;
            let bth = Bth::new(Opcode::MR_ACK, self.peer_qpn, cum);
            let hdrs = Headers::Ack(AckEth { flags, ..first_ack });
            let emitted = self.emit(buf, port, &bth, &hdrs, &blocks);
            self.ack_scratch = blocks;
            let n_bytes = emitted?;
            self.acks_sent += n as u64;
            self.ack_datagrams_sent += 1;
            if !self.rx.iter().any(|r| r.ack_pending) {
                self.unacked_pkts = 0;
                self.ack_hold = None;
            }
            return Some((port, n_bytes));
        }
        None
    }

    /// The next datagram (or GSO batch) of this connection into `buf` (cleared first).
    /// With `lend`, WRITE payloads of 1 KiB or more from regions that lend
    /// ([`crate::RegionMemory::lend`]) stay where they are and are listed there (cleared
    /// first); the transmit's `size` counts them.
    pub fn poll_transmit(
        &mut self,
        now: Instant,
        buf: &mut Vec<u8>,
        mrs: &MrTable,
        mut lend: Option<&mut Lent>,
    ) -> Option<Transmit> {
        buf.clear();
        if let Some(l) = lend.as_deref_mut() {
            l.clear();
        }
        if self.held {
            return None;
        }
        // 1. Handshake.
        if let Some(hs) = &mut self.handshake {
            if !hs.pending {
                return None;
            }
            hs.pending = false;
            // Each attempt leaves from the next source port, so one broken route cannot keep
            // the connection from forming.
            // (The Request repeated at once after a Retry is no new attempt: same port.)
            let turn = hs.attempts.saturating_sub(hs.retries) as usize;
            let port = self.source_ports[turn % self.source_ports.len()];
            hs.attempts += 1;
            hs.sends_since_retry += 1;
            hs.next_at = now + self.cfg.handshake_interval;
            let (bth, hdrs) = self.connect_packet(ConnectKind::Request, 0);
            let n = self.emit(buf, port, &bth, &hdrs, &[])?;
            return Some(self.transmit(port, None, n, None));
        }
        if self.confirm_pending {
            self.confirm_pending = false;
            let port = self.source_ports[0];
            let (bth, hdrs) = self.connect_packet(ConnectKind::Confirm, 0);
            let n = self.emit(buf, port, &bth, &hdrs, &[])?;
            return Some(self.transmit(port, None, n, None));
        }
        if self.accept_pending {
            self.accept_pending = false;
            self.accepts_sent += 1;
            let port =
                self.source_ports[(self.accepts_sent - 1) as usize % self.source_ports.len()];
            let (bth, hdrs) = self.connect_packet(ConnectKind::Accept, 0);
            let n = self.emit(buf, port, &bth, &hdrs, &[])?;
            return Some(self.transmit(port, None, n, None));
        }
        // 2. Keepalives: an MR_ACK with the keepalive flag. First those a held RTO asks
        //    idle paths with (`ask_idle_path`), then the interval's, on the next usable
        //    path in turn.
        let asking = self
            .ask_keepalives
            .iter_mut()
            .enumerate()
            .find(|(_, w)| **w != 0)
            .map(|(wi, w)| {
                let b = w.trailing_zeros() as usize;
                *w &= !(1 << b);
                wi * 64 + b
            });
        let pick = asking
            .filter(|&i| self.tx.get(i).is_some_and(|q| q.state != PathState::Failed))
            .or_else(|| {
                if !self.keepalive_pending {
                    return None;
                }
                self.keepalive_pending = false;
                let n = self.tx.len();
                let i = (0..n)
                    .map(|k| (self.next_keepalive_path + k) % n)
                    .find(|&i| self.tx[i].state != PathState::Failed)?;
                self.next_keepalive_path = (i + 1) % n;
                Some(i)
            });
        if let Some(i) = pick {
            let port = self.tx[i].src_port;
            let bth = Bth::new(Opcode::MR_ACK, self.peer_qpn, 0);
            let hdrs = Headers::Ack(AckEth {
                path_id: i as u8,
                flags: AckEth::FLAG_KEEPALIVE,
                ack_delay: 0,
                echo_ts: ts32(self.epoch, now),
                ce_count: 0,
                window_grant: 0,
                rate_hint: 0,
                sack: [0; 32],
            });
            let n = self.emit(buf, port, &bth, &hdrs, &[])?;
            return Some(self.transmit(port, None, n, None));
        }
        // 3. NAKs.
        if let Some(nak) = self.naks.pop_front() {
            let (gen, plane) = self
                .rx
                .get(nak.path_id as usize)
                .map_or((0, 0), |r| (r.generation, r.plane));
            let port = self.answer_port(nak.path_id, gen, plane);
            let mut bth = Bth::new(Opcode::MR_NAK, self.peer_qpn, nak.psn);
            bth.ack_req = false;
            let hdrs = Headers::Nak {
                path: PathEth {
                    path_id: nak.path_id,
                    flags: 0,
                    timestamp: nak.echo_ts,
                    floor_psn: 0,
                    plane: 0,
                },
                nak: NakEth {
                    syndrome: nak.syndrome,
                    flags: nak.flags,
                    op_id: nak.op_id,
                },
            };
            let n = self.emit(buf, port, &bth, &hdrs, &[])?;
            return Some(self.transmit(port, None, n, None));
        }
        // 3. ACKs (bundled, see `poll_ack`), unless held for a reply (delayed ACK,
        //    `ack_due`): then they leave right behind the next data packet.
        let held = self.ack_hold.is_some_and(|t| now < t);
        if !held {
            if let Some(t) = self.poll_ack(now, buf) {
                return Some(t);
            }
        }
        // 4. Tail-loss probes, ahead of the window. Only looked for when a loss timer
        //    scheduled one since the last look (issue #13: the look reads every path).
        //    A probe carries the next segment of the send queue when there is one (RFC 8985
        //    §7.3: new data first), else the newest segment outstanding on its path again:
        //    a probe that finds the path only slow (a host stall) then costs no
        //    retransmission. Either way each probe is one packet beyond the windows, the
        //    peer's window grant included (a path has at most its tail-loss probe and its
        //    held RTOs' probes out). A path that has timed out already (an RTO, held or
        //    not, since its last progress) probes with what it has out: an outage does not
        //    draw new data onto it.
        if self.probe_pending {
            for i in 0..self.tx.len() {
                if let Some(seg) = self.tx[i].probe.take() {
                    let probe = if !self.tx[i].can_probe() {
                        None
                    } else if let Some(next) = self.sq.peek().filter(|_| !self.tx[i].timed_out()) {
                        Some(Probe::Next(next))
                    } else {
                        self.sq.is_live(seg).then_some(Probe::Again(seg))
                    };
                    if let Some(probe) = probe {
                        let t = self.send_data(
                            now,
                            buf,
                            mrs,
                            lend.as_deref_mut(),
                            i,
                            Some(probe),
                            None,
                        );
                        if t.is_some() {
                            self.ack_hold = None;
                        }
                        // Later paths may hold probes too: looked for on the next call.
                        return t;
                    }
                }
            }
            self.probe_pending = false;
        }
        // 5. Data, sprayed: the next path in turn that has window.
        let in_flight: u32 = self.tx.iter().map(|p| p.outstanding).sum();
        let window = self.conn_window();
        if in_flight >= window {
            return None;
        }
        let Some(next) = self.sq.peek() else {
            // Out of data with a window open: rates measured now say nothing about paths.
            self.rebalance.app_limited = true;
            return None;
        };
        let n = self.tx.len();
        if n == 0 {
            return None;
        }
        // A held ACK joins the reply in one GSO batch (one datagram send, and the peer
        // receives both at once) when a path sends from the port the ACK leaves from
        // (docs/PROTOCOL.md, "Delayed ACK"); that path carries the reply, out of turn.
        let join = if held && self.cfg.max_gso_segments > 1 {
            self.lone_ack().and_then(|(port, len)| {
                let j = self
                    .tx
                    .iter()
                    .position(|p| p.src_port == port && p.can_send())?;
                Some((j, len))
            })
        } else {
            None
        };
        let i = match join {
            Some((j, _)) => j,
            None => {
                // Paths in turn from `next_path` (below `n` unless the path set shrank),
                // wrapping without a division.
                let mut i = if self.next_path < n {
                    self.next_path
                } else {
                    0
                };
                let mut tried = 0;
                while !self.tx[i].can_send() {
                    tried += 1;
                    if tried == n {
                        return None;
                    }
                    i = if i + 1 == n { 0 } else { i + 1 };
                }
                self.next_path = if i + 1 == n { 0 } else { i + 1 };
                i
            }
        };
        let mut t = self.send_data(
            now,
            buf,
            mrs,
            lend.as_deref_mut(),
            i,
            None,
            Some((window, in_flight, next)),
        )?;
        // A held ACK rides behind this packet: in the same batch when it joins, else the
        // next call sends it.
        self.ack_hold = None;
        if let Some((_, ack_len)) = join {
            let lent = lend.is_some_and(|l| !l.is_empty());
            self.join_ack(now, buf, &mut t, ack_len, lent);
        }
        Some(t)
    }

    /// Add the held ACK to the data batch `t` in `buf` (same source port, checked by the
    /// caller) as one more GSO segment: behind the data when it is no longer than the data
    /// segments (GSO's rule: only the last segment may be shorter), ahead of a lone data
    /// packet shorter than the ACK. Leaves `t` as it was when neither fits (a batch at the
    /// GSO limit, or ending in a shorter packet): the ACK then leaves on its own. `lent`:
    /// the data's payloads are lent (gather send), so `buf` holds only the data's headers
    /// and the ACK can only go behind.
    fn join_ack(
        &mut self,
        now: Instant,
        buf: &mut Vec<u8>,
        t: &mut Transmit,
        ack_len: usize,
        lent: bool,
    ) {
        let seg = t.segment_size.unwrap_or(t.size);
        let count = t.size.div_ceil(seg.max(1));
        if seg == 0 || count >= self.cfg.max_gso_segments || t.size % seg != 0 {
            return;
        }
        if ack_len > seg && (count > 1 || lent) {
            return;
        }
        let data_len = t.size;
        let Some((_, n)) = self.append_ack(now, buf, Some(t.src_port)) else {
            return;
        };
        // One path owed the ACK (`lone_ack`), so it is no bundle: the length was known.
        debug_assert_eq!(n, ack_len);
        t.size = data_len + n;
        if n <= seg {
            t.segment_size = Some(seg);
        } else {
            // [data][ACK] -> [ACK][data]: the longer datagram first.
            buf[..t.size].rotate_left(data_len);
            t.segment_size = Some(n);
        }
    }

    /// Build a batch of data packets on path `i`: one probe segment, or up to the GSO limit
    /// of equal-size packets. `fresh`: the connection window and the packets in flight the
    /// caller just computed, and the segment `sq.peek()` just returned (nothing moved the send queue since, so the
    /// first packet need not peek again).
    #[allow(clippy::too_many_arguments)]
    fn send_data(
        &mut self,
        now: Instant,
        buf: &mut Vec<u8>,
        mrs: &MrTable,
        mut lend: Option<&mut Lent>,
        i: usize,
        probe: Option<Probe>,
        fresh: Option<(u32, u32, SegRef)>,
    ) -> Option<Transmit> {
        let max = if probe.is_some() {
            1
        } else {
            self.cfg.max_gso_segments.max(1)
        };
        let conn_window = fresh.map_or_else(|| self.conn_window(), |(w, _, _)| w);
        let mut peeked = fresh.map(|(_, _, s)| s);
        // Data packets carry the transmit timestamp (ACKs and NAKs do not need it): read
        // once per batch, only when data goes out.
        let ts = self.ts_at(now);
        let mut in_flight: u32 = match fresh {
            Some((_, f, _)) => f,
            None => self.tx.iter().map(|p| p.outstanding).sum(),
        };
        let mut seg_size = None;
        let mut count = 0;
        let port = self.tx[i].src_port;
        while count < max {
            let again = matches!(probe, Some(Probe::Again(_)));
            let (seg, retx) = match probe {
                Some(Probe::Again(s)) => (s, true),
                Some(Probe::Next(s)) => (s, false),
                None => {
                    let Some(s) = peeked.take().or_else(|| self.sq.peek()) else {
                        break;
                    };
                    (s, false)
                }
            };
            let Some((offset, len)) = self.sq.seg_span(seg) else {
                break;
            };
            let Some(op) = self.sq.op(seg.op) else { break };
            let path = PathEth {
                path_id: i as u8,
                flags: self.tx[i].generation << 4,
                plane: path::plane_of(port, self.cfg.planes),
                timestamp: ts,
                floor_psn: self.tx[i].floor_psn(),
            };
            let last = offset + len >= op.len;
            let (opcode, hdrs, src) = match &op.kind {
                OpKind::Send {
                    stream,
                    msg_seq,
                    data,
                } => (
                    Opcode::MR_SEND,
                    Headers::Send {
                        path,
                        send: SendEth {
                            stream_id: *stream,
                            msg_seq: *msg_seq,
                            offset,
                            msg_len: op.len,
                        },
                    },
                    Src::Bytes(data.slice(offset as usize..(offset + len) as usize)),
                ),
                OpKind::Write {
                    lkey,
                    local_offset,
                    va,
                    rkey,
                    imm,
                    wire_id,
                } => (
                    if imm.is_some() {
                        Opcode::MR_WRITE_WITH_IMMEDIATE
                    } else {
                        Opcode::MR_WRITE
                    },
                    Headers::Write {
                        path,
                        reth: Reth {
                            va: *va,
                            rkey: *rkey,
                            dma_len: op.len,
                        },
                        write: WriteEth {
                            op_id: *wire_id,
                            offset,
                        },
                        imm: *imm,
                    },
                    Src::Mr(*lkey, local_offset + offset as u64, None),
                ),
                OpKind::Read {
                    va, rkey, wire_id, ..
                } => (
                    Opcode::MR_READ_REQUEST,
                    Headers::ReadRequest {
                        path,
                        reth: Reth {
                            va: *va,
                            rkey: *rkey,
                            dma_len: op.len,
                        },
                        op: WriteEth {
                            op_id: *wire_id,
                            offset: 0,
                        },
                    },
                    Src::Bytes(bytes::Bytes::new()),
                ),
                OpKind::Atomic {
                    va,
                    rkey,
                    op: aop,
                    wire_id,
                    ..
                } => {
                    let (opcode, swap_add, compare) = match *aop {
                        send::AtomicOp::CompareSwap { compare, swap } => {
                            (Opcode::MR_COMPARE_SWAP, swap, compare)
                        }
                        send::AtomicOp::FetchAdd { add } => (Opcode::MR_FETCH_ADD, add, 0),
                    };
                    (
                        opcode,
                        Headers::Atomic {
                            path,
                            atomic: AtomicEth {
                                va: *va,
                                rkey: *rkey,
                                swap_add,
                                compare,
                            },
                            op: WriteEth {
                                op_id: *wire_id,
                                offset: 0,
                            },
                        },
                        Src::Bytes(bytes::Bytes::new()),
                    )
                }
                OpKind::StreamAbort {
                    stream,
                    msg_seq,
                    code,
                } => stream_ctrl(path, send::PATH_FLAG_STREAM_ABORT, *stream, *msg_seq, *code),
                OpKind::StreamFin { stream, msg_seq } => {
                    stream_ctrl(path, send::PATH_FLAG_STREAM_FIN, *stream, *msg_seq, 0)
                }
                OpKind::StreamStop {
                    stream,
                    code,
                    delivered,
                } => stream_ctrl(
                    path,
                    send::PATH_FLAG_STREAM_ABORT | send::PATH_FLAG_STREAM_FIN,
                    *stream,
                    *delivered,
                    *code,
                ),
                OpKind::OpAbort { wire_id } => (
                    Opcode::MR_WRITE,
                    Headers::Write {
                        path: PathEth {
                            flags: path.flags | send::PATH_FLAG_OP_ABORT,
                            ..path
                        },
                        reth: Reth {
                            va: 0,
                            rkey: 0,
                            dma_len: 0,
                        },
                        write: WriteEth {
                            op_id: *wire_id,
                            offset: 0,
                        },
                        imm: None,
                    },
                    Src::Bytes(bytes::Bytes::new()),
                ),
                OpKind::ReadResponse {
                    req_id,
                    lkey,
                    rkey,
                    offset: base,
                } => (
                    Opcode::MR_READ_RESPONSE,
                    Headers::ReadResponse {
                        path,
                        op: WriteEth {
                            op_id: *req_id,
                            offset,
                        },
                    },
                    // An empty response (zero-length READ) reads nothing.
                    if len == 0 {
                        Src::Bytes(bytes::Bytes::new())
                    } else {
                        Src::Mr(*lkey, base + offset as u64, Some(*rkey))
                    },
                ),
                OpKind::AtomicResponse { req_id, orig } => (
                    Opcode::MR_ATOMIC_RESPONSE,
                    Headers::AtomicResponse {
                        path,
                        op: WriteEth {
                            op_id: *req_id,
                            offset: 0,
                        },
                        ack: AtomicAckEth { orig: *orig },
                    },
                    Src::Bytes(bytes::Bytes::new()),
                ),
            };
            // The payload's source: bytes held by the operation, or a span of a local
            // region, copied straight into the datagram by `emit_with` (issue #13, P1).
            // A region that went away under the operation fails it (checked first, so
            // nothing is taken from the queue for it).
            // One lookup of the region: the span read below is the one checked here.
            let (payload_len, payload) = match &src {
                Src::Bytes(b) => (b.len(), Payload::Bytes(b)),
                Src::Mr(lkey, off, guard) => {
                    let checked = match guard {
                        None => mrs.local_span(*lkey, *off, len as usize),
                        Some(rkey) => mrs.read_source_span(*lkey, *rkey, *off, len as usize),
                    };
                    let Ok(region) = checked else {
                        // A READ response's source went away: the READ is refused from now
                        // on (its requester's re-sent request gets NAK 0x62).
                        if let OpKind::ReadResponse { req_id, .. } = op.kind {
                            self.rq.revoke_read(req_id, &self.limits());
                        }
                        if !again {
                            self.sq.take(seg);
                        }
                        self.sq.fail_local(seg.op, WcStatus::LocalProtectionError);
                        break;
                    };
                    (len as usize, Payload::Span(region))
                }
            };
            let trailer = self.trailer_for(opcode);
            let size = wire::packet_len_with(&hdrs, payload_len, &trailer);
            // GSO: every datagram of a batch has the first one's size, but the last may be shorter.
            if seg_size.is_some_and(|s| size > s) {
                break;
            }
            // Gather send (issue #13, P1): the payload stays in its region until the I/O
            // layer sends it, unless the packet is sealed (AEAD encrypts in place). One
            // region per transmit: a payload of another ends the batch.
            let lent_src = match (lend.as_deref(), &src, &payload) {
                // READ responses (`Src::Mr(.., Some(rkey))`) stay copied: the responder's
                // application may write its region meanwhile (it has no work request on
                // it), and a payload read after its ICRC was computed fails the
                // requester's check (found by review: a READ of a counter its owner kept
                // bumping took 80 times as long).
                (Some(l), Src::Mr(lkey, _, None), Payload::Span(region))
                    if self.protection.is_none() && payload_len >= LEND_MIN_PAYLOAD =>
                {
                    match region.lend() {
                        Some((h, o)) if l.accepts(&h) => Some((h, *lkey, o)),
                        Some(_) => break,
                        None => None,
                    }
                }
                _ => None,
            };
            let retransmit = if again {
                true
            } else {
                self.sq.take(seg) || retx
            };
            let psn = self.tx[i].next_psn;
            let mut bth = Bth::new(opcode, self.peer_qpn, psn);
            // AckReq marks the packet that ends an operation's data, so READ (length > 0)
            // and atomic requests carry none; receivers ignore it (docs/PROTOCOL.md, BTH).
            bth.ack_req = last;
            let mut hdrs = hdrs;
            if retransmit {
                if let Headers::Send { path, .. }
                | Headers::Write { path, .. }
                | Headers::ReadRequest { path, .. }
                | Headers::ReadResponse { path, .. }
                | Headers::Atomic { path, .. }
                | Headers::AtomicResponse { path, .. } = &mut hdrs
                {
                    path.flags |= 1;
                }
            }
            let emitted = match (lent_src, lend.as_deref_mut()) {
                (Some((memory, lkey, o)), Some(l)) => self.emit_lent(
                    buf,
                    port,
                    &bth,
                    &hdrs,
                    &trailer,
                    size,
                    payload_len,
                    (mrs, lkey, o),
                    memory,
                    l,
                ),
                _ => self.emit_sized(buf, port, &bth, &hdrs, &trailer, size, payload_len, |b| {
                    match &payload {
                        Payload::Bytes(d) => b.extend_from_slice(d),
                        Payload::Span(region) => region.append_to(b),
                    }
                    true
                }),
            };
            let Some(n) = emitted else {
                break;
            };
            self.tx[i].on_sent(seg, now, retransmit);
            if retransmit {
                let p = &self.tx[i];
                tracing::trace!(
                    conn = %self.handle,
                    path = p.id,
                    port = p.src_port,
                    psn,
                    op = seg.op,
                    seg = seg.seg,
                    "retransmission"
                );
            }
            self.sq.on_transmit(seg, i as u8, psn);
            count += 1;
            in_flight += 1;
            if seg_size.is_none() {
                seg_size = Some(n);
            }
            // A shorter packet ends a GSO batch.
            if Some(n) != seg_size
                || probe.is_some()
                || !self.tx[i].can_send()
                || in_flight >= conn_window
            {
                break;
            }
        }
        if count == 0 {
            return None;
        }
        let size = buf.len() + lend.map_or(0, |l| l.bytes());
        let seg = seg_size.filter(|_| count > 1);
        Some(self.transmit(port, Some(EcnCodepoint::Ect0), size, seg))
    }
}

/// Shortest payload gather send leaves in its region: below it, copying the bytes costs
/// less than the extra I/O vector entries and the region lookups (write_bw at 64 B was
/// about 5 % slower lending every payload).
const LEND_MIN_PAYLOAD: usize = 1024;

enum Src {
    Bytes(bytes::Bytes),
    /// `(lkey, offset, rkey)`: bytes of a local region from `offset`; with `Some(rkey)` (a
    /// READ response) the region must still answer to that rkey and grant REMOTE_READ.
    Mr(u32, u64, Option<u32>),
}

/// A packet's payload once its source was checked: the operation's bytes, or the span of a
/// local region (looked up once, [`MrTable::local_span`]).
enum Payload<'a> {
    Bytes(&'a bytes::Bytes),
    Span(crate::mr::LocalSpan<'a>),
}

/// What a tail-loss probe sends (RFC 8985 §7.3).
#[derive(Debug, Clone, Copy)]
enum Probe {
    /// The next segment of the send queue: new data, or a retransmission already queued.
    Next(SegRef),
    /// The newest segment outstanding on the probing path, sent again.
    Again(SegRef),
}

/// A payload-less stream control packet (abort/reset, FIN, STOP): an `MR_SEND` with
/// `flag` in PathEth, SendEth = (stream, msg_seq, offset = code, length 0).
fn stream_ctrl(
    path: PathEth,
    flag: u8,
    stream: u32,
    msg_seq: u32,
    code: u32,
) -> (Opcode, Headers, Src) {
    (
        Opcode::MR_SEND,
        Headers::Send {
            path: PathEth {
                flags: path.flags | flag,
                ..path
            },
            send: SendEth {
                stream_id: stream,
                msg_seq,
                offset: code,
                msg_len: 0,
            },
        },
        Src::Bytes(bytes::Bytes::new()),
    )
}

#[derive(Debug, Clone, Copy)]
enum Data<'a> {
    Send(&'a SendEth),
    Write(&'a Reth, &'a WriteEth, Option<u32>),
    ReadRequest(&'a Reth, &'a WriteEth),
    ReadResponse(&'a WriteEth),
    Atomic(&'a AtomicEth, &'a WriteEth, bool),
    AtomicResponse(&'a WriteEth, &'a AtomicAckEth),
}
