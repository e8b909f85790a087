//! The RC host: QP table, packet I/O and timers of RC queue pairs, over a memory-region
//! table owned by whoever embeds it ([`super::RcEndpoint`] on its own, or
//! [`crate::Endpoint`] beside its MetaRoCE connections).

use super::qp::Qp;
use super::{
    ConnectAttrs, QpInfo, QpInit, QpState, QpStats, RcConfig, RcError, RcEvent, RcStats,
    RcTransmit, RcWire, RecvWr, SendOp, SendWr,
};
use crate::mr::{Access, MrError, MrKeys, MrTable};
use crate::wire::icrc::{self, IpHeader, IPV4_FLAG_DF};
use crate::wire::{Opcode, Packet, PSN_MASK, ROCEV2_UDP_PORT};
use crate::{EcnCodepoint, Transmit};
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::collections::{BTreeMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::ops::Bound;
use std::time::Instant;

/// Which QPs a transmit poll serves.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Carrier {
    Native,
    Udp,
}

#[derive(Debug)]
pub(crate) struct RcHost {
    cfg: RcConfig,
    rng: Xoshiro256PlusPlus,
    qps: BTreeMap<u32, Qp>,
    last_tx_qpn: u32,
    events: VecDeque<RcEvent>,
    ip_id: u16,
    stats: RcStats,
}

fn valid_mtu(m: u32) -> bool {
    matches!(m, 256 | 512 | 1024 | 2048 | 4096)
}

pub(crate) fn validate(cfg: &RcConfig) -> Result<(), RcError> {
    if cfg.max_message_size > 1 << 31 {
        return Err(RcError::Invalid("max_message_size (> 2^31)"));
    }
    if cfg.max_unacked_psns == 0 || cfg.max_unacked_psns > 1 << 22 {
        return Err(RcError::Invalid("max_unacked_psns (1..=2^22)"));
    }
    cfg.dcqcn.validate()
}

impl RcHost {
    pub fn new(cfg: RcConfig) -> Result<Self, RcError> {
        validate(&cfg)?;
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(cfg.seed);
        let ip_id = cfg.initial_ip_id.unwrap_or_else(|| rng.next_u32() as u16);
        Ok(Self {
            cfg,
            rng,
            qps: BTreeMap::new(),
            last_tx_qpn: 0,
            events: VecDeque::new(),
            ip_id,
            stats: RcStats::default(),
        })
    }

    /// The RC host embedded in a [`crate::Endpoint`]: default limits, the endpoint's
    /// local IP (possibly unspecified) and a seed derived from the endpoint's.
    pub fn for_endpoint(cfg: &crate::EndpointConfig) -> Self {
        let mut rc = RcConfig::new(cfg.local_addr.ip());
        rc.seed = cfg.seed ^ 0x5243_5150_5f73_6565;
        Self::new(rc).expect("default RcConfig is valid")
    }

    pub fn config(&self) -> &RcConfig {
        &self.cfg
    }

    pub fn stats(&self) -> RcStats {
        self.stats
    }

    pub fn is_empty(&self) -> bool {
        self.qps.is_empty()
    }

    /// Whether a QP with this number exists (CNP demultiplexing on a shared socket).
    pub fn has_qp(&self, qpn: u32) -> bool {
        self.qps.contains_key(&qpn)
    }

    pub fn qp(&self, qpn: u32) -> Option<&Qp> {
        self.qps.get(&qpn)
    }

    pub fn qp_info(&self, qpn: u32) -> Option<QpInfo> {
        self.qps.get(&qpn).map(|q| QpInfo {
            qpn: q.qpn,
            psn: q.init_psn,
        })
    }

    pub fn qp_source_port(&self, qpn: u32) -> Option<u16> {
        self.qps
            .get(&qpn)
            .filter(|q| q.attrs.is_some())
            .map(|q| q.sport)
    }

    // ------------------------------------------------------------------ input

    /// The local IP of the QP a datagram is addressed to (BTH.DestQP), if it exists.
    fn dest_qp_ip(&self, datagram: &[u8]) -> Option<IpAddr> {
        let b = datagram.get(5..8)?;
        let qpn = u32::from_be_bytes([0, b[0], b[1], b[2]]);
        self.qps.get(&qpn).map(|q| q.local_ip)
    }

    pub fn handle_datagram(
        &mut self,
        now: Instant,
        from: SocketAddr,
        local_ip: Option<IpAddr>,
        ecn: Option<EcnCodepoint>,
        datagram: &[u8],
        mrs: &mut MrTable,
    ) {
        self.stats.rx_packets += 1;
        let dst = local_ip
            .filter(|ip| !ip.is_unspecified())
            .or_else(|| self.dest_qp_ip(datagram))
            .unwrap_or(self.cfg.local_ip);
        if self.cfg.verify_icrc {
            let ok = IpHeader::synthesized(from.ip(), dst)
                .ok()
                .and_then(|ip| icrc::verify(&ip, from.port(), ROCEV2_UDP_PORT, datagram).ok());
            if ok.is_none() {
                self.stats.rx_bad_icrc += 1;
                return;
            }
        }
        let ce = ecn == Some(EcnCodepoint::Ce);
        self.process(now, canonical(from.ip()), canonical(dst), ce, datagram, mrs);
    }

    pub fn handle_ip_packet(&mut self, now: Instant, packet: &[u8], mrs: &mut MrTable) {
        self.stats.rx_packets += 1;
        let Some((src, dst, ip_len)) = parse_ip(packet) else {
            self.stats.rx_malformed += 1;
            return;
        };
        let Some(udp) = packet.get(ip_len..ip_len + 8) else {
            self.stats.rx_malformed += 1;
            return;
        };
        let dport = u16::from_be_bytes([udp[2], udp[3]]);
        let ulen = usize::from(u16::from_be_bytes([udp[4], udp[5]]));
        if dport != ROCEV2_UDP_PORT || ulen < 8 {
            self.stats.rx_malformed += 1;
            return;
        }
        let Some(payload) = packet.get(ip_len + 8..ip_len + ulen) else {
            self.stats.rx_malformed += 1;
            return;
        };
        if self.cfg.verify_icrc {
            let ip_hdr = &packet[..ip_len];
            if icrc::verify_raw(ip_hdr, udp, payload).is_err() {
                self.stats.rx_bad_icrc += 1;
                return;
            }
        }
        // ECN field: IPv4 TOS bits 1:0, IPv6 traffic class bits 1:0.
        let ecn_bits = match packet[0] >> 4 {
            4 => packet[1] & 3,
            _ => (packet[1] >> 4) & 3,
        };
        self.process(now, src, dst, ecn_bits == 3, payload, mrs);
    }

    fn process(
        &mut self,
        now: Instant,
        src: IpAddr,
        dst: IpAddr,
        ce: bool,
        udp_payload: &[u8],
        mrs: &mut MrTable,
    ) {
        let Ok(pkt) = Packet::parse(udp_payload) else {
            self.stats.rx_malformed += 1;
            return;
        };
        if pkt.bth.opcode == Opcode::CNP {
            // Reaction point input (RoCEv2 Annex A17.9): BTH.DestQP is our QP; accepted
            // only from that QP's peer (the 16 reserved bytes are ignored).
            match self.qps.get_mut(&pkt.bth.dest_qp) {
                Some(qp) if dst == qp.local_ip && qp.attrs.is_some_and(|a| a.remote_ip == src) => {
                    qp.on_cnp(now, &self.cfg);
                }
                _ => self.stats.rx_no_qp += 1,
            }
            return;
        }
        if !super::is_rc_opcode(pkt.bth.opcode) {
            self.stats.rx_malformed += 1;
            return;
        }
        let Some(qp) = self.qps.get_mut(&pkt.bth.dest_qp) else {
            self.stats.rx_no_qp += 1;
            return;
        };
        if dst != qp.local_ip {
            self.stats.rx_malformed += 1;
            return;
        }
        let from_peer = qp.attrs.is_some_and(|a| a.remote_ip == src);
        // P_Key: low 15 bits must match the default partition's.
        if !from_peer || pkt.bth.pkey & 0x7FFF != 0x7FFF {
            self.stats.rx_no_qp += 1;
            return;
        }
        qp.on_packet(
            now,
            &self.cfg,
            ce,
            &pkt.bth,
            &pkt.headers,
            pkt.payload,
            mrs,
            &mut self.events,
        );
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        for qp in self.qps.values_mut() {
            if qp.next_timeout().is_some_and(|t| t <= now) {
                qp.handle_timeout(now, &self.cfg, &mut self.events);
            }
        }
    }

    // ------------------------------------------------------------------ output

    /// Next packet of a QP carried by `carrier`, round-robin over QPs. Returns the QP's
    /// connect attributes and UDP payload length; `buf[..len]` has no valid ICRC yet.
    fn poll_next(
        &mut self,
        now: Instant,
        carrier: Carrier,
        mrs: &MrTable,
        buf: &mut Vec<u8>,
    ) -> Option<(u32, usize)> {
        if self.qps.is_empty() {
            return None;
        }
        let start = self.last_tx_qpn;
        let order: Vec<u32> = self
            .qps
            .range((Bound::Excluded(start), Bound::Unbounded))
            .map(|(k, _)| *k)
            .chain(self.qps.range(..=start).map(|(k, _)| *k))
            .collect();
        for qpn in order {
            let Some(qp) = self.qps.get_mut(&qpn) else {
                continue;
            };
            let on_carrier = match qp.wire {
                RcWire::Native => carrier == Carrier::Native,
                RcWire::Udp { .. } => carrier == Carrier::Udp,
            };
            if !on_carrier || qp.attrs.is_none() {
                continue;
            }
            let Some(out) = qp.poll_packet(now, &self.cfg, mrs, buf, &mut self.events) else {
                continue;
            };
            buf.truncate(out.len);
            self.last_tx_qpn = qpn;
            return Some((qpn, out.len));
        }
        None
    }

    /// Next packet of a [`RcWire::Native`] QP (see [`RcTransmit`]).
    pub fn poll_native(
        &mut self,
        now: Instant,
        buf: &mut Vec<u8>,
        mrs: &MrTable,
    ) -> Option<RcTransmit> {
        loop {
            let (qpn, len) = self.poll_next(now, Carrier::Native, mrs, buf)?;
            let qp = &self.qps[&qpn];
            let Some(a) = qp.attrs else {
                continue;
            };
            let ttl = if a.hop_limit == 0 {
                self.cfg.default_ttl
            } else {
                a.hop_limit
            };
            let tos = self.tos(a.traffic_class);
            let ip = match (qp.local_ip, a.remote_ip) {
                (IpAddr::V4(src), IpAddr::V4(dst)) => {
                    let id = self.ip_id;
                    self.ip_id = self.ip_id.wrapping_add(1);
                    IpHeader::V4 {
                        src,
                        dst,
                        id,
                        flags_frag: IPV4_FLAG_DF,
                        ttl,
                        tos,
                    }
                }
                (IpAddr::V6(src), IpAddr::V6(dst)) => IpHeader::V6 {
                    src,
                    dst,
                    traffic_class: tos,
                    flow_label: 0,
                    hop_limit: ttl,
                },
                _ => continue,
            };
            if icrc::stamp(&ip, qp.sport, ROCEV2_UDP_PORT, buf).is_err() {
                continue;
            }
            self.stats.tx_packets += 1;
            return Some(RcTransmit {
                destination: SocketAddr::new(a.remote_ip, ROCEV2_UDP_PORT),
                src_port: qp.sport,
                ip,
                ecn: EcnCodepoint::from_bits(tos),
                size: len,
            });
        }
    }

    /// Next packet of a [`RcWire::Udp`] QP, as a datagram from `src_port` (one of the
    /// embedding endpoint's sockets) with the ICRC over the synthesized headers.
    pub fn poll_udp(
        &mut self,
        now: Instant,
        buf: &mut Vec<u8>,
        mrs: &MrTable,
        src_port: u16,
    ) -> Option<Transmit> {
        loop {
            let (qpn, len) = self.poll_next(now, Carrier::Udp, mrs, buf)?;
            let qp = &self.qps[&qpn];
            let (Some(a), RcWire::Udp { peer, .. }) = (qp.attrs, qp.wire) else {
                continue;
            };
            let Ok(ip) = IpHeader::synthesized(qp.local_ip, a.remote_ip) else {
                continue;
            };
            if icrc::stamp(&ip, src_port, ROCEV2_UDP_PORT, buf).is_err() {
                continue;
            }
            self.stats.tx_packets += 1;
            return Some(Transmit {
                destination: peer,
                src_port,
                ecn: EcnCodepoint::from_bits(self.tos(a.traffic_class)),
                size: len,
                segment_size: None,
            });
        }
    }

    /// The TOS byte sent: the DSCP of `traffic_class`, the ECN field ECT(0) when
    /// [`DcqcnConfig::ect`](super::DcqcnConfig::ect) (else Not-ECT). The application's ECN
    /// bits are never sent (a class of 3 would mark every packet CE).
    fn tos(&self, traffic_class: u8) -> u8 {
        let ecn = if self.cfg.dcqcn.ect {
            EcnCodepoint::Ect0 as u8
        } else {
            0
        };
        (traffic_class & !3) | ecn
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        self.qps.values().filter_map(|q| q.next_timeout()).min()
    }

    pub fn poll_event(&mut self) -> Option<RcEvent> {
        self.events.pop_front()
    }
}

/// The verbs of RC queue pairs over an endpoint's QP table and memory regions: what
/// [`RcEndpoint`](super::RcEndpoint) and [`crate::Endpoint::rc`] hand out. Memory regions
/// are the endpoint's: a key registered once works for RC QPs and (on a
/// [`crate::Endpoint`]) MetaRoCE connections alike.
#[derive(Debug)]
pub struct RcQps<'a> {
    host: &'a mut RcHost,
    mrs: &'a mut MrTable,
}

impl<'a> RcQps<'a> {
    pub(crate) fn new(host: &'a mut RcHost, mrs: &'a mut MrTable) -> Self {
        Self { host, mrs }
    }

    /// Create an RC QP (RESET → INIT).
    ///
    /// Errors: [`RcError::TooManyQps`] when `max_qps` QPs exist or `init.qpn` is taken or
    /// out of range (2..2^24).
    pub fn create_qp(&mut self, init: QpInit) -> Result<QpInfo, RcError> {
        let h = &mut *self.host;
        if h.qps.len() >= h.cfg.max_qps {
            return Err(RcError::TooManyQps);
        }
        let qpn = match init.qpn {
            Some(q) => {
                if !(2..=PSN_MASK).contains(&q) || h.qps.contains_key(&q) {
                    return Err(RcError::TooManyQps);
                }
                q
            }
            None => loop {
                let q = h.rng.next_u32() & PSN_MASK;
                if q >= 0x10 && !h.qps.contains_key(&q) {
                    break q;
                }
            },
        };
        let psn = init
            .initial_psn
            .map_or_else(|| h.rng.next_u32() & PSN_MASK, |p| p & PSN_MASK);
        h.qps.insert(qpn, Qp::new(qpn, psn, init.access));
        Ok(QpInfo { qpn, psn })
    }

    /// Connect a QP to its peer (INIT → RTR → RTS), its packets carried by `wire`.
    ///
    /// [`RcWire::Native`] packets come from [`RcConfig::local_ip`]; [`RcWire::Udp`] ones
    /// from its `local_ip`, or that one when `None`. Errors: [`RcError::Invalid`] for a
    /// bad MTU, remote QPN, an address family mismatch or no usable local IP;
    /// [`RcError::UnknownQp`]; [`RcError::InvalidState`] unless the QP is in INIT.
    pub fn connect_qp(
        &mut self,
        qpn: u32,
        attrs: ConnectAttrs,
        wire: RcWire,
    ) -> Result<(), RcError> {
        if !valid_mtu(attrs.path_mtu) {
            return Err(RcError::Invalid("path_mtu (256..=4096, power of two)"));
        }
        if attrs.remote_qpn > PSN_MASK || attrs.remote_qpn < 2 {
            return Err(RcError::Invalid("remote_qpn"));
        }
        let local_ip = match wire {
            RcWire::Native => canonical(self.host.cfg.local_ip),
            RcWire::Udp { local_ip, peer } => {
                if canonical(peer.ip()) != canonical(attrs.remote_ip) {
                    return Err(RcError::Invalid(
                        "remote_ip (must be the IP of the UDP peer address)",
                    ));
                }
                canonical(local_ip.unwrap_or(self.host.cfg.local_ip))
            }
        };
        if local_ip.is_unspecified() {
            return Err(RcError::Invalid(
                "local IP (the endpoint is bound to the unspecified address; name the \
                 local IP in RcWire::Udp)",
            ));
        }
        let same_family = matches!(
            (canonical(attrs.remote_ip), local_ip),
            (IpAddr::V4(_), IpAddr::V4(_)) | (IpAddr::V6(_), IpAddr::V6(_))
        );
        if !same_family {
            return Err(RcError::Invalid("remote_ip (address family)"));
        }
        let qp = self.host.qps.get_mut(&qpn).ok_or(RcError::UnknownQp)?;
        if qp.state != QpState::Init {
            return Err(RcError::InvalidState(qp.state));
        }
        let mut a = attrs;
        a.remote_ip = canonical(a.remote_ip);
        qp.wire = wire;
        qp.local_ip = local_ip;
        qp.connect(a);
        Ok(())
    }

    /// Destroy a QP; its outstanding work requests are dropped without completions.
    pub fn destroy_qp(&mut self, qpn: u32) -> bool {
        self.host.qps.remove(&qpn).is_some()
    }

    /// Post a receive work request (allowed in INIT and RTS).
    ///
    /// Errors: unknown QP, QP in error, `max_recv_wr` reached, or a local memory reference
    /// that is out of bounds or lacks LOCAL_WRITE.
    pub fn post_recv(&mut self, qpn: u32, wr: RecvWr) -> Result<(), RcError> {
        let max = self.host.cfg.max_recv_wr;
        let qp = self.host.qps.get_mut(&qpn).ok_or(RcError::UnknownQp)?;
        if qp.state == QpState::Error {
            return Err(RcError::InvalidState(qp.state));
        }
        if qp.rq_len() >= max {
            return Err(RcError::QueueFull);
        }
        check_local(self.mrs, wr.lkey, wr.offset, wr.len, true)?;
        qp.post_recv(wr);
        Ok(())
    }

    /// Post a send work request (the QP must be connected).
    ///
    /// Errors: unknown QP, QP not in RTS, `max_send_wr` reached, `len` above
    /// `max_message_size`, a READ whose packets at the path MTU plus `max_unacked_psns`
    /// reach 2^23 (half the PSN space: e.g. 2^31 bytes at PMTU 256), atomics not 8 bytes or
    /// not 8-byte aligned, READ/atomic with `max_rd_atomic` 0, or an invalid local memory
    /// reference.
    pub fn post_send(&mut self, qpn: u32, wr: SendWr) -> Result<(), RcError> {
        let max = self.host.cfg.max_send_wr;
        let max_msg = self.host.cfg.max_message_size;
        let qp = self.host.qps.get_mut(&qpn).ok_or(RcError::UnknownQp)?;
        if qp.state != QpState::Rts {
            return Err(RcError::InvalidState(qp.state));
        }
        if qp.sq_len() >= max {
            return Err(RcError::QueueFull);
        }
        if wr.len > max_msg {
            return Err(RcError::Invalid("len (> max_message_size)"));
        }
        match wr.op {
            SendOp::Read { .. } if !qp.read_fits(wr.len, self.host.cfg.max_unacked_psns) => {
                return Err(RcError::Invalid(
                    "len (a READ's packets at this path MTU, plus max_unacked_psns, must \
                     stay under 2^23 PSNs)",
                ));
            }
            SendOp::CompareSwap { remote_addr, .. } | SendOp::FetchAdd { remote_addr, .. } => {
                if wr.len != 8 {
                    return Err(RcError::Invalid("len (atomics need 8)"));
                }
                if remote_addr % 8 != 0 {
                    return Err(RcError::Invalid(
                        "remote_addr (atomics need 8-byte alignment)",
                    ));
                }
            }
            _ => {}
        }
        let need_write = wr.op.is_read_or_atomic();
        let rd_ok = qp.attrs.is_some_and(|a| a.max_rd_atomic > 0);
        if need_write && !rd_ok {
            return Err(RcError::Invalid("op (max_rd_atomic is 0)"));
        }
        check_local(self.mrs, wr.lkey, wr.local_offset, wr.len, need_write)?;
        qp.post_send(wr);
        Ok(())
    }

    /// QPN and initial send PSN of a QP.
    pub fn qp_info(&self, qpn: u32) -> Option<QpInfo> {
        self.host.qp_info(qpn)
    }

    /// State of a QP.
    pub fn qp_state(&self, qpn: u32) -> Option<QpState> {
        self.host.qps.get(&qpn).map(|q| q.state)
    }

    /// Counters of a QP.
    pub fn qp_stats(&self, qpn: u32) -> Option<QpStats> {
        self.host.qps.get(&qpn).map(|q| q.stats)
    }

    /// How a connected QP's packets are carried.
    pub fn qp_wire(&self, qpn: u32) -> Option<RcWire> {
        self.host
            .qps
            .get(&qpn)
            .filter(|q| q.attrs.is_some())
            .map(|q| q.wire)
    }

    /// The UDP source port a connected [`RcWire::Native`] QP sends from
    /// (`rdma_get_udp_sport`); a [`RcWire::Udp`] QP sends from its endpoint's socket.
    pub fn qp_source_port(&self, qpn: u32) -> Option<u16> {
        self.host.qp_source_port(qpn)
    }

    /// Endpoint-wide RC counters.
    pub fn stats(&self) -> RcStats {
        self.host.stats
    }

    /// Keys of a registered region.
    pub fn mr_keys(&self, lkey: u32) -> Option<MrKeys> {
        self.mrs.keys(lkey)
    }

    /// Bytes `[offset, offset + len)` of a registered region.
    pub fn mr_read(&self, lkey: u32, offset: u64, len: u64) -> Result<Vec<u8>, MrError> {
        self.mrs.local_vec(lkey, offset, len)
    }
}

fn check_local(
    mrs: &MrTable,
    lkey: u32,
    offset: u64,
    len: u32,
    write: bool,
) -> Result<(), RcError> {
    if len == 0 {
        return Ok(());
    }
    mrs.check_local(lkey, offset, u64::from(len))
        .map_err(RcError::LocalMemory)?;
    if write {
        let k = mrs
            .keys(lkey)
            .ok_or(RcError::LocalMemory(MrError::InvalidKey))?;
        if !k.access.contains(Access::LOCAL_WRITE) {
            return Err(RcError::LocalMemory(MrError::AccessDenied));
        }
    }
    Ok(())
}

pub(crate) fn canonical(a: IpAddr) -> IpAddr {
    match a {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

/// (source, destination, header length) of an IPv4 (IHL 5, unfragmented, UDP) or IPv6
/// (next header UDP) packet whose length fields are consistent with `p`.
fn parse_ip(p: &[u8]) -> Option<(IpAddr, IpAddr, usize)> {
    match p.first()? >> 4 {
        4 => {
            let h = p.get(..20)?;
            if h[0] & 0x0F != 5 || h[9] != 17 {
                return None;
            }
            let total = usize::from(u16::from_be_bytes([h[2], h[3]]));
            let frag = u16::from_be_bytes([h[6], h[7]]);
            if total > p.len() || total < 28 || frag & 0x3FFF != 0 {
                return None;
            }
            let src = Ipv4Addr::new(h[12], h[13], h[14], h[15]);
            let dst = Ipv4Addr::new(h[16], h[17], h[18], h[19]);
            // The UDP length is checked against the IP total length.
            let ulen = usize::from(u16::from_be_bytes([*p.get(24)?, *p.get(25)?]));
            if 20 + ulen > total {
                return None;
            }
            Some((IpAddr::V4(src), IpAddr::V4(dst), 20))
        }
        6 => {
            let h = p.get(..40)?;
            if h[6] != 17 {
                return None;
            }
            let plen = usize::from(u16::from_be_bytes([h[4], h[5]]));
            if 40 + plen > p.len() {
                return None;
            }
            let mut s = [0u8; 16];
            let mut d = [0u8; 16];
            s.copy_from_slice(&h[8..24]);
            d.copy_from_slice(&h[24..40]);
            let ulen = usize::from(u16::from_be_bytes([*p.get(44)?, *p.get(45)?]));
            if ulen > plen {
                return None;
            }
            Some((
                canonical(IpAddr::V6(Ipv6Addr::from(s))),
                canonical(IpAddr::V6(Ipv6Addr::from(d))),
                40,
            ))
        }
        _ => None,
    }
}
