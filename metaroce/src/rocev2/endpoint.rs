//! The RC endpoint: QP table, memory regions, packet I/O and timers.

use super::qp::Qp;
use super::{
    ConnectAttrs, QpInfo, QpInit, QpState, QpStats, RcConfig, RcError, RcEvent, RcTransmit, RecvWr,
    SendOp, SendWr,
};
use crate::mr::{Access, MrError, MrKeys, MrTable};
use crate::wire::icrc::{self, IpHeader, IPV4_FLAG_DF};
use crate::wire::{Packet, Transport, PSN_MASK, ROCEV2_UDP_PORT};
use crate::EcnCodepoint;
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::collections::{BTreeMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::ops::Bound;
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

/// Host of RC queue pairs speaking standard RoCEv2 (see the [module docs](super)).
#[derive(Debug)]
pub struct RcEndpoint {
    cfg: RcConfig,
    rng: Xoshiro256PlusPlus,
    mrs: MrTable,
    qps: BTreeMap<u32, Qp>,
    last_tx_qpn: u32,
    events: VecDeque<RcEvent>,
    ip_id: u16,
    stats: RcStats,
}

fn valid_mtu(m: u32) -> bool {
    matches!(m, 256 | 512 | 1024 | 2048 | 4096)
}

impl RcEndpoint {
    /// An endpoint with no QPs and no memory regions.
    pub fn new(cfg: RcConfig) -> Result<Self, RcError> {
        if cfg.max_message_size > 1 << 31 {
            return Err(RcError::Invalid("max_message_size (> 2^31)"));
        }
        if cfg.max_unacked_psns == 0 || cfg.max_unacked_psns > 1 << 22 {
            return Err(RcError::Invalid("max_unacked_psns (1..=2^22)"));
        }
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(cfg.seed);
        let ip_id = cfg.initial_ip_id.unwrap_or_else(|| rng.next_u32() as u16);
        Ok(Self {
            cfg,
            rng,
            mrs: MrTable::default(),
            qps: BTreeMap::new(),
            last_tx_qpn: 0,
            events: VecDeque::new(),
            ip_id,
            stats: RcStats::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RcConfig {
        &self.cfg
    }

    /// Endpoint counters.
    pub fn stats(&self) -> RcStats {
        self.stats
    }

    // ------------------------------------------------------------------ memory

    /// Register `data` as a memory region with `access`.
    pub fn register_mr(&mut self, data: Vec<u8>, access: Access) -> MrKeys {
        self.mrs.register(data, access)
    }

    /// Deregister a region, returning its bytes.
    pub fn deregister_mr(&mut self, lkey: u32) -> Option<Vec<u8>> {
        self.mrs.deregister(lkey)
    }

    /// Keys of a region.
    pub fn mr_keys(&self, lkey: u32) -> Option<MrKeys> {
        self.mrs.keys(lkey)
    }

    /// Read `[offset, offset + len)` of a region.
    pub fn mr_read(&self, lkey: u32, offset: u64, len: u64) -> Result<&[u8], MrError> {
        self.mrs.local(lkey, offset, len)
    }

    /// Mutable `[offset, offset + len)` of a region.
    pub fn mr_write(&mut self, lkey: u32, offset: u64, len: u64) -> Result<&mut [u8], MrError> {
        self.mrs.local_mut(lkey, offset, len)
    }

    // ------------------------------------------------------------------ QPs

    /// Create an RC QP (RESET → INIT).
    pub fn create_qp(&mut self, init: QpInit) -> Result<QpInfo, RcError> {
        if self.qps.len() >= self.cfg.max_qps {
            return Err(RcError::TooManyQps);
        }
        let qpn = match init.qpn {
            Some(q) => {
                if !(2..=PSN_MASK).contains(&q) || self.qps.contains_key(&q) {
                    return Err(RcError::TooManyQps);
                }
                q
            }
            None => loop {
                let q = self.rng.next_u32() & PSN_MASK;
                if q >= 0x10 && !self.qps.contains_key(&q) {
                    break q;
                }
            },
        };
        let psn = init
            .initial_psn
            .map_or_else(|| self.rng.next_u32() & PSN_MASK, |p| p & PSN_MASK);
        self.qps.insert(qpn, Qp::new(qpn, psn, init.access));
        Ok(QpInfo { qpn, psn })
    }

    /// Connect a QP to its peer (INIT → RTR → RTS).
    pub fn connect_qp(&mut self, qpn: u32, attrs: ConnectAttrs) -> Result<(), RcError> {
        if !valid_mtu(attrs.path_mtu) {
            return Err(RcError::Invalid("path_mtu (256..=4096, power of two)"));
        }
        if attrs.remote_qpn > PSN_MASK || attrs.remote_qpn < 2 {
            return Err(RcError::Invalid("remote_qpn"));
        }
        let same_family = matches!(
            (canonical(attrs.remote_ip), canonical(self.cfg.local_ip)),
            (IpAddr::V4(_), IpAddr::V4(_)) | (IpAddr::V6(_), IpAddr::V6(_))
        );
        if !same_family {
            return Err(RcError::Invalid("remote_ip (address family)"));
        }
        let qp = self.qps.get_mut(&qpn).ok_or(RcError::UnknownQp)?;
        if qp.state != QpState::Init {
            return Err(RcError::InvalidState(qp.state));
        }
        let mut a = attrs;
        a.remote_ip = canonical(a.remote_ip);
        qp.connect(a);
        Ok(())
    }

    /// Destroy a QP; its outstanding work requests are dropped without completions.
    pub fn destroy_qp(&mut self, qpn: u32) -> bool {
        self.qps.remove(&qpn).is_some()
    }

    /// QPN and initial send PSN of a QP.
    pub fn qp_info(&self, qpn: u32) -> Option<QpInfo> {
        self.qps.get(&qpn).map(|q| QpInfo {
            qpn: q.qpn,
            psn: q.init_psn,
        })
    }

    /// State of a QP.
    pub fn qp_state(&self, qpn: u32) -> Option<QpState> {
        self.qps.get(&qpn).map(|q| q.state)
    }

    /// Counters of a QP.
    pub fn qp_stats(&self, qpn: u32) -> Option<QpStats> {
        self.qps.get(&qpn).map(|q| q.stats)
    }

    /// The UDP source port a connected QP sends from.
    pub fn qp_source_port(&self, qpn: u32) -> Option<u16> {
        self.qps
            .get(&qpn)
            .filter(|q| q.attrs.is_some())
            .map(|q| q.sport)
    }

    /// Post a receive work request (allowed in INIT and RTS).
    pub fn post_recv(&mut self, qpn: u32, wr: RecvWr) -> Result<(), RcError> {
        let max = self.cfg.max_recv_wr;
        let qp = self.qps.get_mut(&qpn).ok_or(RcError::UnknownQp)?;
        if qp.state == QpState::Error {
            return Err(RcError::InvalidState(qp.state));
        }
        if qp.rq_len() >= max {
            return Err(RcError::QueueFull);
        }
        check_local(&self.mrs, wr.lkey, wr.offset, wr.len, true)?;
        qp.post_recv(wr);
        Ok(())
    }

    /// Post a send work request (the QP must be connected).
    pub fn post_send(&mut self, qpn: u32, wr: SendWr) -> Result<(), RcError> {
        let max = self.cfg.max_send_wr;
        let max_msg = self.cfg.max_message_size;
        let qp = self.qps.get_mut(&qpn).ok_or(RcError::UnknownQp)?;
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
        check_local(&self.mrs, wr.lkey, wr.local_offset, wr.len, need_write)?;
        qp.post_send(wr);
        Ok(())
    }

    // ------------------------------------------------------------------ input

    /// A received UDP payload (BTH … ICRC) whose IP header is not available: the ICRC is
    /// checked over the synthesized header (IPv4 ID 0, DF; [`IpHeader::synthesized`]) with
    /// `from`'s port as UDP source port and 4791 as destination port.
    pub fn handle_datagram(
        &mut self,
        now: Instant,
        from: SocketAddr,
        local_ip: Option<IpAddr>,
        ecn: Option<EcnCodepoint>,
        datagram: &[u8],
    ) {
        let _ = ecn;
        self.stats.rx_packets += 1;
        let dst = local_ip.unwrap_or(self.cfg.local_ip);
        if self.cfg.verify_icrc {
            let ok = IpHeader::synthesized(from.ip(), dst)
                .ok()
                .and_then(|ip| icrc::verify(&ip, from.port(), ROCEV2_UDP_PORT, datagram).ok());
            if ok.is_none() {
                self.stats.rx_bad_icrc += 1;
                return;
            }
        }
        self.process(now, canonical(from.ip()), canonical(dst), datagram);
    }

    /// A whole received IP packet (IPv4 without options, or IPv6 without extension
    /// headers): IP header, UDP header to port 4791, UDP payload. The ICRC is checked over
    /// the received headers. Anything else is counted and dropped.
    pub fn handle_ip_packet(&mut self, now: Instant, packet: &[u8]) {
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
        self.process(now, src, dst, payload);
    }

    fn process(&mut self, now: Instant, src: IpAddr, dst: IpAddr, udp_payload: &[u8]) {
        if dst != canonical(self.cfg.local_ip) {
            self.stats.rx_malformed += 1;
            return;
        }
        let Ok(pkt) = Packet::parse(udp_payload) else {
            self.stats.rx_malformed += 1;
            return;
        };
        if pkt.bth.opcode.transport() != Transport::Rc || pkt.bth.opcode.0 > 0x14 {
            self.stats.rx_malformed += 1;
            return;
        }
        let Some(qp) = self.qps.get_mut(&pkt.bth.dest_qp) else {
            self.stats.rx_no_qp += 1;
            return;
        };
        let from_peer = qp.attrs.is_some_and(|a| a.remote_ip == src);
        // P_Key: low 15 bits must match the default partition's.
        if !from_peer || pkt.bth.pkey & 0x7FFF != 0x7FFF {
            self.stats.rx_no_qp += 1;
            return;
        }
        qp.on_packet(
            now,
            &self.cfg,
            &pkt.bth,
            &pkt.headers,
            pkt.payload,
            &mut self.mrs,
            &mut self.events,
        );
    }

    /// Run the timers that are due.
    pub fn handle_timeout(&mut self, now: Instant) {
        for qp in self.qps.values_mut() {
            qp.handle_timeout(now, &mut self.events);
        }
    }

    // ------------------------------------------------------------------ output

    /// Next packet to send: the UDP payload goes to `buf` (cleared first), the transmit
    /// describes the IP/UDP headers it must be sent with. QPs are served round-robin.
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut Vec<u8>) -> Option<RcTransmit> {
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
            let Some(out) = qp.poll_packet(now, &self.cfg, &self.mrs, buf, &mut self.events) else {
                continue;
            };
            let Some(a) = qp.attrs else {
                continue;
            };
            let ttl = if a.hop_limit == 0 {
                self.cfg.default_ttl
            } else {
                a.hop_limit
            };
            let ip = match (canonical(self.cfg.local_ip), a.remote_ip) {
                (IpAddr::V4(src), IpAddr::V4(dst)) => {
                    let id = self.ip_id;
                    self.ip_id = self.ip_id.wrapping_add(1);
                    IpHeader::V4 {
                        src,
                        dst,
                        id,
                        flags_frag: IPV4_FLAG_DF,
                        ttl,
                        tos: a.traffic_class,
                    }
                }
                (IpAddr::V6(src), IpAddr::V6(dst)) => IpHeader::V6 {
                    src,
                    dst,
                    traffic_class: a.traffic_class,
                    flow_label: 0,
                    hop_limit: ttl,
                },
                _ => continue,
            };
            buf.truncate(out.len);
            if icrc::stamp(&ip, qp.sport, ROCEV2_UDP_PORT, buf).is_err() {
                continue;
            }
            self.last_tx_qpn = qpn;
            self.stats.tx_packets += 1;
            return Some(RcTransmit {
                destination: SocketAddr::new(a.remote_ip, ROCEV2_UDP_PORT),
                src_port: qp.sport,
                ip,
                ecn: EcnCodepoint::from_bits(a.traffic_class),
                size: out.len,
            });
        }
        None
    }

    /// When `handle_timeout` is next due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.qps.values().filter_map(|q| q.next_timeout()).min()
    }

    /// Next event for the application.
    pub fn poll_event(&mut self) -> Option<RcEvent> {
        self.events.pop_front()
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
    mrs.local(lkey, offset, u64::from(len))
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

fn canonical(a: IpAddr) -> IpAddr {
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
