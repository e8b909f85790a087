//! # RoCEv2-compatible mode: standard RC queue pairs
//!
//! A sans-IO host for InfiniBand **Reliable Connected** queue pairs that speak plain RoCEv2
//! (standard RC opcodes `0x00..=0x14`, BTH/RETH/AETH/AtomicETH/AtomicAckETH/ImmDt, ICRC)
//! so that they interoperate with Linux soft-RoCE (`rdma_rxe`) and RNICs. Semantics follow
//! the RoCEv2 reference (`shared/reference/rocev2-wire.md`) §6 (PSN/MSN, ACK coalescing,
//! duplicate handling, go-back-N, RNR and ACK timers, error NAKs) and §7 (memory protection).
//!
//! ## Two hosts, one QP implementation
//!
//! * **On a MetaRoCE [`crate::Endpoint`]** ([`crate::Endpoint::rc`] → [`RcQps`]): RC QPs
//!   beside MetaRoCE connections, one memory-region table for both (register once, use the
//!   keys on either), one driving contract. `handle_datagram` dispatches by BTH opcode
//!   (standard RC `0x00..=0x14` → the RC QP by DestQP; MetaRoCE `0xC0..` → the connection);
//!   RC completions come out of `poll_event` as [`crate::Event::Rc`]. Each QP picks its
//!   carrier when connected ([`RcWire`]): `Udp` rides the endpoint's datagrams (reaches other
//!   metaroce endpoints over plain UDP sockets), `Native` is real RoCEv2 through
//!   [`crate::Endpoint::poll_rc_transmit`] / [`crate::Endpoint::handle_ip_packet`] (reaches
//!   `rdma_rxe` and RNICs; needs a raw-IP backend).
//! * **Stand-alone** ([`RcEndpoint`]): RC QPs only, all `Native`, with their own regions.
//!
//! ## Driving contract (stand-alone)
//!
//! Same shape as [`crate::Endpoint`]:
//!
//! * inputs: [`RcEndpoint::handle_ip_packet`]`(now, packet)` with a whole received IPv4/IPv6
//!   packet (IP header + UDP header + payload; the ICRC is checked over the **received** IP
//!   header), or [`RcEndpoint::handle_datagram`]`(now, from, local_ip, ecn, udp_payload)`
//!   when only the UDP payload is known (the ICRC is then checked over a synthesized header,
//!   IPv4 ID 0 + DF, which is what a peer sending through an unconnected UDP socket produces);
//!   [`RcEndpoint::handle_timeout`]`(now)`; application calls (QPs, MRs, work requests);
//! * outputs, after every input: [`RcEndpoint::poll_transmit`]`(now, buf)` until `None` (one
//!   packet per call: `buf` receives the UDP payload, the [`RcTransmit`] says which IP header
//!   — addresses, ID, DF, TTL, TOS — and UDP ports the ICRC was computed over, and therefore
//!   what the backend must put on the wire; [`RcTransmit::write_ip_packet`] builds it);
//!   [`RcEndpoint::poll_timeout`]; [`RcEndpoint::poll_event`] until `None`.
//!
//! Every packet goes to UDP port 4791 from the QP's fixed source port
//! (`rdma_get_udp_sport(flow_label, lqpn, rqpn)`, reference §1.3), and receive
//! demultiplexing is by BTH.DestQP only.
//!
//! ## Memory
//!
//! One endpoint is one protection domain. Regions are owned by the endpoint
//! ([`RcEndpoint::register_mr`]); the lkey names a region locally (never reissued), the
//! rkey and the VA peers use ([`MrKeys::addr`] plus an offset) are drawn from the seed. Atomic operands are 8-byte **little-endian** integers in memory (as on an x86
//! host running rxe); the original value an atomic returns is written little-endian into the
//! requester's 8-byte local buffer.
//!
//! ## Congestion control
//!
//! Every RC packet is ECN-capable (ECT(0)); a QP that receives CE-marked packets sends CNPs
//! (RoCEv2 Annex A17.9, at most one per [`DcqcnConfig::cnp_interval`]) and a QP that receives
//! CNPs limits its rate with DCQCN (Zhu et al., SIGCOMM 2015). See [`DcqcnConfig`]; on by
//! default, `RcConfig::dcqcn.enabled = false` turns it off.
//!
//! Nothing here panics on input from the network; every limit is a field of [`RcConfig`].

mod dcqcn;
mod endpoint;
mod host;
mod qp;
mod unified;

pub use dcqcn::DcqcnConfig;
pub use endpoint::{RcEndpoint, RcStats};
pub(crate) use host::RcHost;
pub use host::RcQps;

use crate::mr::{Access, MrError};
use crate::wire::icrc::{self, IpHeader};
use crate::wire::ROCEV2_UDP_PORT;
use crate::{EcnCodepoint, WcStatus};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

pub use crate::mr::MrKeys;

/// Configuration of an [`RcEndpoint`]. Every limit applied to peers' input is here.
#[derive(Debug, Clone)]
pub struct RcConfig {
    /// The local IP address: source of every packet, and the only destination accepted.
    pub local_ip: IpAddr,
    /// Seed of the RNGs that draw QPNs, initial PSNs, IPv4 IDs and, on a stand-alone
    /// [`RcEndpoint`], rkeys and region addresses. [`RcConfig::new`] sets
    /// [`RcConfig::FIXED_SEED`]: the sans-IO core uses the seed as given (a run is
    /// reproducible), and metaroce-tokio's `RcEndpoint` replaces that one value with a seed
    /// from the operating system, so unrelated endpoints do not hand out the same QPNs,
    /// PSNs and keys (RoCEv2 itself protects none of them; rdma-core's tools randomize the
    /// initial PSN too).
    pub seed: u64,
    /// Most queue pairs at once. Default 1024.
    pub max_qps: usize,
    /// Most outstanding send work requests per QP (send-queue depth). Default 4096.
    pub max_send_wr: usize,
    /// Most posted receive work requests per QP (receive-queue depth). Default 4096.
    pub max_recv_wr: usize,
    /// Most PSNs a requester has outstanding (sent, not acknowledged); rxe uses 128.
    /// Default 128, at most 2^22.
    pub max_unacked_psns: u32,
    /// AckReq is set on the last packet of every message and additionally on every this
    /// many packets of a long message (rxe: 64). Default 64, at least 1.
    pub max_pkts_per_ack: u32,
    /// Largest message (SEND, WRITE, READ) posted or accepted, bytes; at most 2^31.
    /// Default 2^31.
    pub max_message_size: u32,
    /// Most responder packets (ACK/NAK/READ-response jobs/atomic ACKs) queued per QP; more
    /// are dropped (the requester's timer recovers). Default 4096.
    pub max_pending_responses: usize,
    /// IPv4 TTL / IPv6 hop limit used when the connect attributes give 0. Default 64.
    pub default_ttl: u8,
    /// First IPv4 Identification value (then +1 per packet); `None` draws it from the RNG.
    pub initial_ip_id: Option<u16>,
    /// Drop received packets whose ICRC does not verify (as rxe does). Default `true`.
    pub verify_icrc: bool,
    /// ECN marking and DCQCN congestion control of every QP (on by default; see
    /// [`DcqcnConfig`]).
    pub dcqcn: DcqcnConfig,
}

impl RcConfig {
    /// The seed [`RcConfig::new`] sets (see [`seed`](Self::seed)).
    pub const FIXED_SEED: u64 = 0x726f_6365_7632_7263;

    /// Defaults for the given local IP.
    pub fn new(local_ip: IpAddr) -> Self {
        Self {
            local_ip,
            seed: Self::FIXED_SEED,
            max_qps: 1024,
            max_send_wr: 4096,
            max_recv_wr: 4096,
            max_unacked_psns: 128,
            max_pkts_per_ack: 64,
            max_message_size: 1 << 31,
            max_pending_responses: 4096,
            default_ttl: 64,
            initial_ip_id: None,
            verify_icrc: true,
            dcqcn: DcqcnConfig::default(),
        }
    }
}

/// How an RC QP's packets are carried; chosen per QP at connect time
/// ([`RcQps::connect_qp`]).
///
/// | carrier | reaches | needs |
/// |---|---|---|
/// | `Native` | any RoCEv2 peer: `rdma_rxe`, RNICs, another metaroce `Native` QP | a raw-IP backend (raw IPv4 socket or AF_PACKET, `CAP_NET_RAW`): the ICRC covers the real IPv4 header, ID included |
/// | `Udp` | another metaroce endpoint whose QP is `Udp` too (or a stand-alone [`RcEndpoint`] behind `metaroce_tokio::rocev2::UdpIpBackend`) | nothing: ordinary UDP sockets, loopback, CI |
///
/// Both carry the same standard RC packets (BTH, RETH, AETH, …, ICRC); only the headers
/// the ICRC is computed over differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RcWire {
    /// Standard RoCEv2: to `remote_ip:4791` from the QP's own source port
    /// ([`udp_sport`]), the ICRC over the exact IP header sent (an incrementing IPv4 ID,
    /// DF). Output is an [`RcTransmit`] to be sent as a whole IP packet
    /// ([`crate::Endpoint::poll_rc_transmit`], [`RcEndpoint::poll_transmit`]); input is
    /// the whole received IP packet (`handle_ip_packet`).
    Native,
    /// Carried as ordinary datagrams of the embedding endpoint's UDP sockets: to `peer`
    /// from the endpoint's first source port, the ICRC over the *synthesized* headers
    /// (IPv4 ID 0 + DF, or the IPv6 fixed header with flow label 0; UDP destination port
    /// 4791 whatever port `peer` really has), which is what a receiver that only sees the
    /// UDP payload can check. A real RoCEv2 peer drops these packets (ICRC mismatch).
    Udp {
        /// The peer endpoint's UDP address; its IP must be the connect attributes'
        /// `remote_ip`.
        peer: SocketAddr,
        /// Local IP the packets come from and are addressed to (the ICRC covers it);
        /// `None` = the endpoint's local IP, which must then be a concrete address.
        local_ip: Option<IpAddr>,
    },
}

/// Whether `op` is a standard RC opcode this module handles (`0x00..=0x14`): how an
/// endpoint tells RC QP traffic from MetaRoCE traffic (`0xC0..`) on one socket.
pub fn is_rc_opcode(op: crate::wire::Opcode) -> bool {
    op.transport() == crate::wire::Transport::Rc && op.0 <= 0x14
}

/// Parameters of a new QP (verbs: `ibv_create_qp` + the INIT transition).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpInit {
    /// QPN to use (24 bits, ≥ 2); `None` draws a free one from the RNG.
    pub qpn: Option<u32>,
    /// Initial send PSN (`sq_psn`); `None` draws one from the RNG.
    pub initial_psn: Option<u32>,
    /// `qp_access_flags`: which remote operations peers may run through this QP
    /// (REMOTE_WRITE / REMOTE_READ / REMOTE_ATOMIC).
    pub access: Access,
}

/// Identity of a created QP, to hand to the peer (rc_pingpong's QPN and PSN).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInfo {
    /// Local QPN (24 bits).
    pub qpn: u32,
    /// Initial send PSN (24 bits): the peer's `rq_psn`.
    pub psn: u32,
}

/// The RTR + RTS attributes (what the out-of-band exchange gives; reference §8.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectAttrs {
    /// Peer IP address (from its GID).
    pub remote_ip: IpAddr,
    /// Peer QPN (`dest_qp_num`).
    pub remote_qpn: u32,
    /// Peer's initial send PSN: our expected receive PSN (`rq_psn`).
    pub remote_psn: u32,
    /// Path MTU in bytes: 256, 512, 1024, 2048 or 4096.
    pub path_mtu: u32,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout; 0 disables the timer (5 bits).
    pub timeout: u8,
    /// Retransmissions after an ACK timeout, sequence NAK or READ-response gap without
    /// progress (3 bits).
    pub retry_cnt: u8,
    /// Retransmissions after RNR NAKs (3 bits); 7 = infinite.
    pub rnr_retry: u8,
    /// RNR timer code (5 bits) sent in our RNR NAKs.
    pub min_rnr_timer: u8,
    /// Our outstanding READ/ATOMIC limit as requester (`max_rd_atomic`, ≥ 1 to post them).
    pub max_rd_atomic: u8,
    /// READ/ATOMIC responder resources kept for duplicates (`max_dest_rd_atomic`); 0 refuses
    /// incoming READ/ATOMIC with NAK Invalid Request.
    pub max_dest_rd_atomic: u8,
    /// IP TOS / traffic class byte: only its DSCP (upper six bits) is used; the ECN field
    /// is set by the QP (ECT(0) by default, see [`DcqcnConfig::ect`]), never taken from here
    /// (RFC 3168 §5: the ECN field belongs to the transport, not the application).
    pub traffic_class: u8,
    /// IPv4 TTL / IPv6 hop limit; 0 = [`RcConfig::default_ttl`].
    pub hop_limit: u8,
    /// GRH flow label (20 bits); 0 = derive it from the QPNs. Selects the UDP source port.
    pub flow_label: u32,
}

impl ConnectAttrs {
    /// rc_pingpong / perftest defaults (reference §8.1): MTU 1024, timeout 14, retry 7,
    /// rnr_retry 7, min_rnr_timer 12, one READ/ATOMIC each way, TOS 0.
    pub fn new(remote_ip: IpAddr, remote_qpn: u32, remote_psn: u32) -> Self {
        Self {
            remote_ip,
            remote_qpn,
            remote_psn,
            path_mtu: 1024,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 1,
            max_dest_rd_atomic: 1,
            traffic_class: 0,
            hop_limit: 0,
            flow_label: 0,
        }
    }
}

/// Operation of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// SEND (with immediate when `imm` is `Some`; the value is sent big-endian as given).
    Send {
        /// Immediate data.
        imm: Option<u32>,
    },
    /// RDMA WRITE (with immediate when `imm` is `Some`).
    Write {
        /// Remote VA of the first byte.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Immediate data.
        imm: Option<u32>,
    },
    /// RDMA READ into the local buffer.
    Read {
        /// Remote VA of the first byte.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// ATOMIC compare-and-swap of the 8-byte remote value; the original value lands in the
    /// 8-byte local buffer.
    CompareSwap {
        /// Remote VA (8-byte aligned).
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Compare value.
        compare: u64,
        /// Swap value.
        swap: u64,
    },
    /// ATOMIC fetch-and-add; the original value lands in the 8-byte local buffer.
    FetchAdd {
        /// Remote VA (8-byte aligned).
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Addend (wrapping).
        add: u64,
    },
}

impl SendOp {
    pub(crate) fn is_read_or_atomic(&self) -> bool {
        matches!(
            self,
            SendOp::Read { .. } | SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. }
        )
    }

    pub(crate) fn is_atomic(&self) -> bool {
        matches!(self, SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. })
    }

    /// The opcode of this operation's work completion (`ibv_wc_opcode`).
    pub fn completion_opcode(&self) -> RcOpcode {
        match self {
            SendOp::Send { .. } => RcOpcode::Send,
            SendOp::Write { .. } => RcOpcode::RdmaWrite,
            SendOp::Read { .. } => RcOpcode::RdmaRead,
            SendOp::CompareSwap { .. } => RcOpcode::CompSwap,
            SendOp::FetchAdd { .. } => RcOpcode::FetchAdd,
        }
    }
}

/// A send work request: `op` over the local buffer `[local_offset, local_offset + len)` of
/// the region `lkey` (the source of SEND/WRITE, the destination of READ, the 8-byte result
/// of an atomic). `len` 0 sends no payload and needs no valid `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWr {
    /// Caller's id, returned in the completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// Local region.
    pub lkey: u32,
    /// Offset in the local region.
    pub local_offset: u64,
    /// Bytes (8 for atomics).
    pub len: u32,
    /// Set BTH.SE on the last packet (SEND / WRITE with immediate).
    pub solicited: bool,
}

/// A receive work request: an application buffer for one incoming SEND (or the completion
/// slot of an incoming WRITE with immediate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWr {
    /// Caller's id, returned in the completion.
    pub wr_id: u64,
    /// Local region (needs LOCAL_WRITE).
    pub lkey: u32,
    /// Offset in the region.
    pub offset: u64,
    /// Buffer length.
    pub len: u32,
}

/// What a [`Completion`] reports (`ibv_wc_opcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RcOpcode {
    /// `IBV_WC_SEND`.
    Send,
    /// `IBV_WC_RDMA_WRITE`.
    RdmaWrite,
    /// `IBV_WC_RDMA_READ`.
    RdmaRead,
    /// `IBV_WC_COMP_SWAP`.
    CompSwap,
    /// `IBV_WC_FETCH_ADD`.
    FetchAdd,
    /// `IBV_WC_RECV` (a SEND arrived; `imm` set for SEND with immediate).
    Recv,
    /// `IBV_WC_RECV_RDMA_WITH_IMM`: a WRITE with immediate consumed a receive WR.
    RecvRdmaWithImm,
}

/// A work completion of a send or receive work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The QP.
    pub qpn: u32,
    /// The work request's id.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// Operation.
    pub opcode: RcOpcode,
    /// Bytes: the message length (receive side: bytes received; WRITE with immediate: the
    /// RETH length); the requested length for send-side completions.
    pub byte_len: u32,
    /// Immediate data (host order), for receives.
    pub imm: Option<u32>,
}

impl Completion {
    /// Whether this completes a receive work request.
    pub fn is_recv(&self) -> bool {
        matches!(self.opcode, RcOpcode::Recv | RcOpcode::RecvRdmaWithImm)
    }
}

/// Something for the application.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RcEvent {
    /// A work completion (send or receive queue; see [`Completion::is_recv`]).
    Completion(Completion),
    /// The QP entered the error state (its work requests are completed with errors before
    /// this event).
    QpError {
        /// The QP.
        qpn: u32,
        /// The status that caused it.
        status: WcStatus,
    },
}

/// State of a QP (verbs QP states, reduced).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// Created; receive WRs may be posted, nothing is sent or accepted.
    Init,
    /// Connected (RTR + RTS): sends and receives.
    Rts,
    /// Failed; every work request was flushed.
    Error,
}

/// Per-QP counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpStats {
    /// Request packets sent (first transmissions and retransmissions).
    pub tx_requests: u64,
    /// Request packets sent again (go-back-N, timeouts, RNR).
    pub retransmitted: u64,
    /// Response packets sent (ACK, NAK, READ responses, atomic ACK).
    pub tx_responses: u64,
    /// PSN-sequence-error NAKs sent.
    pub seq_naks_sent: u64,
    /// RNR NAKs sent.
    pub rnr_naks_sent: u64,
    /// PSN-sequence-error NAKs received.
    pub seq_naks_received: u64,
    /// RNR NAKs received.
    pub rnr_naks_received: u64,
    /// Local ACK timeouts that started a retry.
    pub timeouts: u64,
    /// Duplicate request packets received.
    pub duplicates_received: u64,
    /// Out-of-sequence request packets dropped.
    pub out_of_sequence: u64,
    /// Packets received with the IP ECN field CE (notification point input).
    pub ce_received: u64,
    /// CNPs sent (notification point; at most one per `cnp_interval`).
    pub cnps_sent: u64,
    /// CNPs received for this QP (reaction point input).
    pub cnps_received: u64,
    /// READ/atomic requests refused (NAK Invalid Request) because `max_dest_rd_atomic`
    /// resources were saved and the oldest's last response had never been sent (the
    /// requester exceeded the limit).
    pub rd_atomic_refused: u64,
    /// The reaction point's current rate, bits per second (`line_rate_bps` when not
    /// throttled; 0 until the QP first sends, receives a CNP or runs a timer).
    pub dcqcn_rate_bps: u64,
}

/// Why an application call was refused; nothing was posted.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RcError {
    /// No QP with this number.
    UnknownQp,
    /// The QP is not in a state that allows this call.
    InvalidState(QpState),
    /// `max_qps` QPs exist, or the requested QPN is taken.
    TooManyQps,
    /// The send or receive queue is full (`max_send_wr` / `max_recv_wr`).
    QueueFull,
    /// The local memory reference is invalid.
    LocalMemory(MrError),
    /// A field of the work request or attributes is invalid (the text names it).
    Invalid(&'static str),
    /// The I/O layer driving the endpoint cannot carry what was asked (the text says what
    /// would), e.g. a [`RcWire::Native`] QP on an endpoint that only has UDP sockets.
    Unsupported(&'static str),
}

impl fmt::Display for RcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RcError::UnknownQp => f.write_str("no such QP"),
            RcError::InvalidState(s) => write!(f, "QP in state {s:?}"),
            RcError::TooManyQps => f.write_str("too many QPs or QPN in use"),
            RcError::QueueFull => f.write_str("work queue full"),
            RcError::LocalMemory(e) => write!(f, "invalid local memory reference: {e}"),
            RcError::Invalid(s) => write!(f, "invalid {s}"),
            RcError::Unsupported(s) => write!(f, "unsupported: {s}"),
        }
    }
}

impl std::error::Error for RcError {}

/// One packet to send: `buf[..size]` is the UDP payload (BTH … ICRC); the ICRC covers
/// exactly [`RcTransmit::ip`] and the UDP header `src_port → 4791`, length `8 + size`,
/// checksum 0, so the backend must send those bytes (see [`RcTransmit::write_ip_packet`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RcTransmit {
    /// Destination IP and UDP port (always 4791).
    pub destination: SocketAddr,
    /// UDP source port: the sending QP's fixed port.
    pub src_port: u16,
    /// The IP header the ICRC was computed over (addresses, ID, DF, TTL, TOS).
    pub ip: IpHeader,
    /// ECN codepoint of the TOS byte, if any.
    pub ecn: Option<EcnCodepoint>,
    /// UDP payload bytes in the buffer.
    pub size: usize,
}

impl RcTransmit {
    /// Append the whole IP packet (IP header, UDP header with checksum 0, `payload`) to
    /// `out`; `payload` is `buf[..size]` from `poll_transmit`.
    pub fn write_ip_packet(
        &self,
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), crate::wire::Error> {
        let udp = icrc::udp_header(self.src_port, ROCEV2_UDP_PORT, payload.len())?;
        let udp_len =
            u16::try_from(udp.len() + payload.len()).map_err(|_| crate::wire::Error::BadLength)?;
        let start = out.len();
        out.resize(start + self.ip.header_len(), 0);
        self.ip.to_bytes(udp_len, &mut out[start..])?;
        out.extend_from_slice(&udp);
        out.extend_from_slice(payload);
        Ok(())
    }
}

/// The UDP source port of an RC QP: the kernel's `rdma_get_udp_sport(fl, lqpn, rqpn)`
/// (reference §1.3): the flow label, or one computed from the QPNs when it is 0, folded
/// into 0xC000..=0xFFFF.
pub fn udp_sport(flow_label: u32, lqpn: u32, rqpn: u32) -> u16 {
    let fl = if flow_label & 0xF_FFFF != 0 {
        flow_label & 0xF_FFFF
    } else {
        let mut v = u64::from(lqpn) * u64::from(rqpn);
        v ^= v >> 20;
        v ^= v >> 40;
        (v & 0xF_FFFF) as u32
    };
    let mut lo = fl & 0x3FFF;
    let hi = fl & 0xF_C000;
    lo ^= hi >> 14;
    (lo | 0xC000) as u16
}

/// RNR timer for a 5-bit code (reference §3.1).
pub fn rnr_timer(code: u8) -> Duration {
    const US: [u64; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840,
        5120, 7680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840,
        245_760, 327_680, 491_520,
    ];
    Duration::from_micros(US[usize::from(code & 0x1F)])
}

/// Local ACK timeout for the 5-bit exponent: 4.096 µs × 2^timeout; `None` for 0 (disabled).
pub fn ack_timeout(timeout: u8) -> Option<Duration> {
    let t = timeout & 0x1F;
    (t != 0).then(|| Duration::from_nanos(4096u64 << t))
}
