//! The stand-alone RC endpoint: an RC host with its own memory regions.

use super::host::{RcHost, RcQps};
use super::{
    ConnectAttrs, QpInfo, QpInit, QpState, QpStats, RcConfig, RcError, RcEvent, RcTransmit, RcWire,
    RecvWr, SendWr,
};
use crate::mr::{Access, MrError, MrKeys, MrTable};
use crate::secret::SecretRng;
use crate::EcnCodepoint;
use std::net::{IpAddr, SocketAddr};
use std::time::Instant;

/// Endpoint-wide counters of received and sent packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RcStats {
    /// Packets handed to `handle_*`.
    pub rx_packets: u64,
    /// Dropped: ICRC mismatch.
    pub rx_bad_icrc: u64,
    /// Dropped: not a well-formed RoCEv2 RC packet (IP/UDP/BTH/headers), or not for us.
    pub rx_malformed: u64,
    /// Dropped: no QP with that DestQP, QP not connected, or wrong source address / P_Key.
    pub rx_no_qp: u64,
    /// Packets produced by `poll_transmit`.
    pub tx_packets: u64,
}

/// Host of RC queue pairs speaking standard RoCEv2 and nothing else (see the
/// [module docs](super)). Every QP is [`RcWire::Native`]. To run RC QPs beside MetaRoCE
/// connections on one endpoint and one set of memory regions, use [`crate::Endpoint::rc`]
/// instead.
#[derive(Debug)]
pub struct RcEndpoint {
    host: RcHost,
    mrs: MrTable,
}

impl RcEndpoint {
    /// An endpoint with no QPs and no memory regions. Errors: an invalid [`RcConfig`]
    /// (`max_message_size` above 2^31, `max_unacked_psns` outside 1..=2^22).
    pub fn new(cfg: RcConfig) -> Result<Self, RcError> {
        // Keys and region addresses from the configured seed (a fixed key seed made every
        // stand-alone endpoint hand out the same first rkey and address; found by review).
        let mut keys = SecretRng::new(SecretRng::default_seed(cfg.seed ^ 0x6d72_5f6b_6579_7321));
        Ok(Self {
            mrs: MrTable::new(&mut keys),
            host: RcHost::new(cfg)?,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RcConfig {
        self.host.config()
    }

    /// Endpoint counters.
    pub fn stats(&self) -> RcStats {
        self.host.stats()
    }

    /// The QP verbs over this endpoint's QPs and regions (what the methods below call).
    pub fn qps(&mut self) -> RcQps<'_> {
        RcQps::new(&mut self.host, &mut self.mrs)
    }

    // ------------------------------------------------------------------ memory

    /// Register `data` as a memory region with `access`.
    pub fn register_mr(&mut self, data: Vec<u8>, access: Access) -> MrKeys {
        self.mrs.register(Box::new(data), access)
    }

    /// Deregister a region, returning its bytes.
    pub fn deregister_mr(&mut self, lkey: u32) -> Option<Vec<u8>> {
        self.mrs.deregister(lkey).map(crate::mr::into_vec)
    }

    /// Keys of a region.
    pub fn mr_keys(&self, lkey: u32) -> Option<MrKeys> {
        self.mrs.keys(lkey)
    }

    /// A copy of bytes `[offset, offset + len)` of a region.
    pub fn mr_read(&self, lkey: u32, offset: u64, len: u64) -> Result<Vec<u8>, MrError> {
        self.mrs.local_vec(lkey, offset, len)
    }

    /// Copy `data` into a region at `offset`.
    pub fn mr_write(&mut self, lkey: u32, offset: u64, data: &[u8]) -> Result<(), MrError> {
        self.mrs.local_write(lkey, offset, data)
    }

    // ------------------------------------------------------------------ QPs

    /// Create an RC QP (RESET → INIT). See [`RcQps::create_qp`].
    pub fn create_qp(&mut self, init: QpInit) -> Result<QpInfo, RcError> {
        self.qps().create_qp(init)
    }

    /// Connect a QP to its peer (INIT → RTR → RTS) as a [`RcWire::Native`] QP. See
    /// [`RcQps::connect_qp`].
    pub fn connect_qp(&mut self, qpn: u32, attrs: ConnectAttrs) -> Result<(), RcError> {
        self.qps().connect_qp(qpn, attrs, RcWire::Native)
    }

    /// Destroy a QP; its outstanding work requests are dropped without completions.
    pub fn destroy_qp(&mut self, qpn: u32) -> bool {
        self.qps().destroy_qp(qpn)
    }

    /// QPN and initial send PSN of a QP.
    pub fn qp_info(&self, qpn: u32) -> Option<QpInfo> {
        self.host.qp_info(qpn)
    }

    /// State of a QP.
    pub fn qp_state(&self, qpn: u32) -> Option<QpState> {
        self.host.qp(qpn).map(|q| q.state)
    }

    /// Counters of a QP.
    pub fn qp_stats(&self, qpn: u32) -> Option<QpStats> {
        self.host.qp(qpn).map(|q| q.stats)
    }

    /// The UDP source port a connected QP sends from.
    pub fn qp_source_port(&self, qpn: u32) -> Option<u16> {
        self.host.qp_source_port(qpn)
    }

    /// Post a receive work request (allowed in INIT and RTS). See [`RcQps::post_recv`].
    pub fn post_recv(&mut self, qpn: u32, wr: RecvWr) -> Result<(), RcError> {
        self.qps().post_recv(qpn, wr)
    }

    /// Post a send work request (the QP must be connected). See [`RcQps::post_send`].
    pub fn post_send(&mut self, qpn: u32, wr: SendWr) -> Result<(), RcError> {
        self.qps().post_send(qpn, wr)
    }

    // ------------------------------------------------------------------ input

    /// A received UDP payload (BTH … ICRC) whose IP header is not available: the ICRC is
    /// checked over the synthesized header (IPv4 ID 0, DF;
    /// [`IpHeader::synthesized`](crate::wire::icrc::IpHeader::synthesized)) with `from`'s
    /// port as UDP source port and 4791 as destination port.
    pub fn handle_datagram(
        &mut self,
        now: Instant,
        from: SocketAddr,
        local_ip: Option<IpAddr>,
        ecn: Option<EcnCodepoint>,
        datagram: &[u8],
    ) {
        self.host
            .handle_datagram(now, from, local_ip, ecn, datagram, &mut self.mrs);
    }

    /// A whole received IP packet (IPv4 without options, or IPv6 without extension
    /// headers): IP header, UDP header to port 4791, UDP payload. The ICRC is checked over
    /// the received headers. Anything else is counted and dropped.
    pub fn handle_ip_packet(&mut self, now: Instant, packet: &[u8]) {
        self.host.handle_ip_packet(now, packet, &mut self.mrs);
    }

    /// Run the timers that are due.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.host.handle_timeout(now);
    }

    // ------------------------------------------------------------------ output

    /// Next packet to send: the UDP payload goes to `buf` (cleared first), the transmit
    /// describes the IP/UDP headers it must be sent with. QPs are served round-robin.
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut Vec<u8>) -> Option<RcTransmit> {
        self.host.poll_native(now, buf, &self.mrs)
    }

    /// When `handle_timeout` is next due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.host.poll_timeout()
    }

    /// Next event for the application.
    pub fn poll_event(&mut self) -> Option<RcEvent> {
        self.host.poll_event()
    }
}
