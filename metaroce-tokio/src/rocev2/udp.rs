//! [`UdpIpBackend`]: RoCEv2 mode over ordinary UDP sockets, without `CAP_NET_RAW`.

use super::IpBackend;
use crate::backend::{DatagramBackend, RecvMeta, UdpBackend};
use metaroce::fasthash::HashMap;
use metaroce::wire::icrc::{self, IpHeader};
use metaroce::wire::ROCEV2_UDP_PORT;
use metaroce::{EcnCodepoint, Transmit};
use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::task::{Context, Poll};

/// Receive buffer: one GRO batch of up to 64 KiB.
const RX_BUF: usize = 1 << 16;
const IPV4_HEADER: usize = 20;
const IPV6_HEADER: usize = 40;
const UDP_HEADER: usize = 8;

/// Counters of a [`UdpIpBackend`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UdpIpStats {
    /// Datagrams handed to the inner backend.
    pub tx_datagrams: u64,
    /// Packets from the driver that were not IP/UDP packets this backend can send.
    pub tx_malformed: u64,
    /// Datagrams received and handed to the driver.
    pub rx_datagrams: u64,
    /// Datagrams received that could not be framed (wrong address family, oversize).
    pub rx_dropped: u64,
}

#[derive(Default)]
struct Counters {
    tx_datagrams: AtomicU64,
    tx_malformed: AtomicU64,
    rx_datagrams: AtomicU64,
    rx_dropped: AtomicU64,
}

/// The GRO batch being handed out one datagram at a time.
struct Rx {
    buf: Vec<u8>,
    meta: RecvMeta,
    /// Offset of the next datagram in `buf[..meta.len]`.
    pos: usize,
}

/// An [`IpBackend`] for RoCEv2 mode over ordinary UDP sockets, without `CAP_NET_RAW`.
///
/// The RoCEv2 ICRC covers IP and UDP header fields (addresses, the IPv4 Identification and
/// flags, the UDP ports and length) that a UDP socket can neither choose when sending nor
/// see when receiving. This backend therefore agrees with its peer on **synthesized**
/// headers, the ones [`metaroce::rocev2::RcEndpoint::handle_datagram`] assumes: IPv4 ID 0
/// with DF (or the IPv6 fixed header with flow label 0), the backend's advertised local IP
/// and the peer's IP as addresses, the UDP source port the datagram really leaves from, and
/// destination port 4791 whatever port the peer really listens on.
///
/// * **Send:** the driver hands over a whole IP packet whose ICRC the core computed over its
///   own header (an incrementing IPv4 ID, the QP's source port). The backend takes the UDP
///   payload (BTH … ICRC), re-stamps the ICRC over the synthesized headers and sends the
///   payload from its (first) source port to the peer's UDP address ([`set_peer`]; by
///   default `peer_ip:4791`).
/// * **Receive:** each datagram gets the synthesized IP and UDP headers in front of it
///   (source = the datagram's real source address and port, destination = the advertised
///   local IP and port 4791), so the core's `handle_ip_packet` verifies the ICRC exactly as
///   `handle_datagram` would. A corrupted datagram fails the check and is dropped.
///
/// The datagrams go through any [`DatagramBackend`]: a [`UdpBackend`] (see
/// [`UdpIpBackend::bind`]), or one wrapped in [`crate::backend::Impaired`] for seeded loss,
/// duplication, reordering and delay, or in a capture layer. One QP's traffic always
/// leaves from one source port (the backend's first), as an RC QP's does.
///
/// [`set_peer`]: UdpIpBackend::set_peer
pub struct UdpIpBackend<B = UdpBackend> {
    inner: B,
    local_ip: IpAddr,
    src_port: u16,
    peers: Mutex<HashMap<IpAddr, SocketAddr>>,
    tx: Mutex<Vec<u8>>,
    rx: Mutex<Rx>,
    counters: Counters,
}

impl<B: fmt::Debug> fmt::Debug for UdpIpBackend<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UdpIpBackend")
            .field("inner", &self.inner)
            .field("local_ip", &self.local_ip)
            .field("src_port", &self.src_port)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn canonical(a: IpAddr) -> IpAddr {
    match a {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

fn invalid(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg.to_string())
}

impl UdpIpBackend<UdpBackend> {
    /// Binds a [`UdpBackend`] with one source port at `addr` (a concrete IP: it is the
    /// address the RC endpoint advertises and the ICRC covers). Must run inside a tokio
    /// runtime.
    pub fn bind(addr: SocketAddr) -> io::Result<Self> {
        if addr.ip().is_unspecified() {
            return Err(invalid(
                "UdpIpBackend::bind needs a concrete local IP (the ICRC covers it); bind the \
                 UdpBackend yourself and use UdpIpBackend::new to advertise another one",
            ));
        }
        let udp = UdpBackend::bind(addr, 1)?;
        Self::new(udp, addr.ip())
    }
}

impl<B: DatagramBackend> UdpIpBackend<B> {
    /// Carries the RoCEv2 traffic of an RC endpoint over `inner`, advertising `local_ip`
    /// (the address peers see as the datagrams' source; it becomes the endpoint's
    /// `local_ip`). Datagrams leave from `inner`'s first source port.
    pub fn new(inner: B, local_ip: IpAddr) -> io::Result<Self> {
        let local_ip = canonical(local_ip);
        if local_ip.is_unspecified() {
            return Err(invalid("UdpIpBackend needs a concrete local IP"));
        }
        let src_port = *inner
            .source_ports()
            .first()
            .ok_or_else(|| invalid("the inner backend has no source port"))?;
        Ok(Self {
            inner,
            local_ip,
            src_port,
            peers: Mutex::new(HashMap::default()),
            tx: Mutex::new(Vec::with_capacity(RX_BUF)),
            rx: Mutex::new(Rx {
                buf: vec![0; RX_BUF],
                meta: RecvMeta::EMPTY,
                pos: 0,
            }),
            counters: Counters::default(),
        })
    }

    /// Packets for the RC peer at `ip` go to the UDP address `addr` (by default
    /// `ip:4791`). Needed whenever the peer does not listen on port 4791, e.g. two endpoints
    /// on one host.
    pub fn set_peer(&self, ip: IpAddr, addr: SocketAddr) {
        lock(&self.peers).insert(canonical(ip), addr);
    }

    /// The inner datagram backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// The address peers send to (the inner backend's receiving address).
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr()
    }

    /// The UDP source port every datagram leaves from.
    pub fn source_port(&self) -> u16 {
        self.src_port
    }

    /// Counters.
    pub fn stats(&self) -> UdpIpStats {
        let c = &self.counters;
        UdpIpStats {
            tx_datagrams: c.tx_datagrams.load(Ordering::Relaxed),
            tx_malformed: c.tx_malformed.load(Ordering::Relaxed),
            rx_datagrams: c.rx_datagrams.load(Ordering::Relaxed),
            rx_dropped: c.rx_dropped.load(Ordering::Relaxed),
        }
    }

    fn peer_addr(&self, ip: IpAddr) -> SocketAddr {
        let ip = canonical(ip);
        lock(&self.peers)
            .get(&ip)
            .copied()
            .unwrap_or(SocketAddr::new(ip, ROCEV2_UDP_PORT))
    }

    /// Frames one received datagram into `out` as the IP packet the peer's ICRC was computed
    /// for. Returns the packet length, or `None` if it cannot be framed.
    fn frame(
        &self,
        from: SocketAddr,
        ecn: Option<EcnCodepoint>,
        d: &[u8],
        out: &mut [u8],
    ) -> Option<usize> {
        let mut ip = IpHeader::synthesized(canonical(from.ip()), self.local_ip).ok()?;
        let bits = ecn.map_or(0, |e| e as u8);
        match &mut ip {
            IpHeader::V4 { tos, .. } => *tos = bits,
            IpHeader::V6 { traffic_class, .. } => *traffic_class = bits,
        }
        let hl = ip.header_len();
        let total = hl + UDP_HEADER + d.len();
        let out = out.get_mut(..total)?;
        let udp = icrc::udp_header(from.port(), ROCEV2_UDP_PORT, d.len()).ok()?;
        let udp_len = u16::try_from(UDP_HEADER + d.len()).ok()?;
        ip.to_bytes(udp_len, &mut out[..hl]).ok()?;
        out[hl..hl + UDP_HEADER].copy_from_slice(&udp);
        out[hl + UDP_HEADER..].copy_from_slice(d);
        Some(total)
    }
}

/// (header length, destination IP, UDP payload range) of an IPv4 (no options) or IPv6 UDP
/// packet.
fn parse(p: &[u8]) -> Option<(IpAddr, std::ops::Range<usize>)> {
    let (hl, dst) = match p.first()? >> 4 {
        4 => {
            let h = p.get(..IPV4_HEADER)?;
            if h[0] & 0x0F != 5 || h[9] != 17 {
                return None;
            }
            let d: [u8; 4] = h[16..20].try_into().ok()?;
            (IPV4_HEADER, IpAddr::from(d))
        }
        6 => {
            let h = p.get(..IPV6_HEADER)?;
            if h[6] != 17 {
                return None;
            }
            let d: [u8; 16] = h[24..40].try_into().ok()?;
            (IPV6_HEADER, IpAddr::from(d))
        }
        _ => return None,
    };
    let udp = p.get(hl..hl + UDP_HEADER)?;
    let ulen = usize::from(u16::from_be_bytes([udp[4], udp[5]]));
    if ulen < UDP_HEADER || hl + ulen > p.len() {
        return None;
    }
    Some((dst, hl + UDP_HEADER..hl + ulen))
}

impl<B: DatagramBackend> IpBackend for UdpIpBackend<B> {
    fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    fn poll_recv(&self, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<usize>> {
        let mut rx = lock(&self.rx);
        loop {
            let len = rx.meta.len.min(rx.buf.len());
            if rx.pos < len {
                let stride = if rx.meta.stride == 0 {
                    len
                } else {
                    rx.meta.stride
                };
                let start = rx.pos;
                let end = (start + stride).min(len);
                rx.pos = end;
                let (from, ecn) = (rx.meta.from, rx.meta.ecn);
                match self.frame(from, ecn, &rx.buf[start..end], buf) {
                    Some(n) => {
                        self.counters.rx_datagrams.fetch_add(1, Ordering::Relaxed);
                        return Poll::Ready(Ok(n));
                    }
                    None => {
                        self.counters.rx_dropped.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                }
            }
            let rx = &mut *rx;
            let mut meta = [RecvMeta::EMPTY];
            let mut iov = [IoSliceMut::new(&mut rx.buf)];
            match self.inner.poll_recv(cx, &mut iov, &mut meta) {
                Poll::Ready(Ok(n)) if n >= 1 => {
                    rx.meta = meta[0];
                    rx.pos = 0;
                    if rx.meta.len == 0 {
                        // A zero-length datagram is no RoCEv2 packet.
                        self.counters.rx_dropped.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Poll::Ready(Ok(_)) => continue,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn poll_send(&self, cx: &mut Context<'_>, packet: &[u8], dst: IpAddr) -> Poll<io::Result<()>> {
        let Some((_, range)) = parse(packet) else {
            self.counters.tx_malformed.fetch_add(1, Ordering::Relaxed);
            return Poll::Ready(Err(invalid("not an IPv4/IPv6 UDP packet")));
        };
        let tos = match packet[0] >> 4 {
            4 => packet[1],
            _ => (u16::from_be_bytes([packet[0], packet[1]]) >> 4) as u8,
        };
        let mut payload = lock(&self.tx);
        payload.clear();
        payload.extend_from_slice(&packet[range]);
        let stamped = IpHeader::synthesized(self.local_ip, canonical(dst))
            .ok()
            .and_then(|ip| icrc::stamp(&ip, self.src_port, ROCEV2_UDP_PORT, &mut payload).ok());
        if stamped.is_none() {
            self.counters.tx_malformed.fetch_add(1, Ordering::Relaxed);
            return Poll::Ready(Err(invalid(
                "cannot stamp the ICRC (address family or size)",
            )));
        }
        let transmit = Transmit {
            destination: self.peer_addr(dst),
            src_port: self.src_port,
            ecn: EcnCodepoint::from_bits(tos),
            size: payload.len(),
            segment_size: None,
        };
        let r = self.inner.poll_send(cx, &transmit, &payload);
        if let Poll::Ready(Ok(())) = r {
            // The IP-packet interface has no flush: a batching datagram backend (io_uring)
            // gets each packet submitted at once.
            self.inner.flush();
            self.counters.tx_datagrams.fetch_add(1, Ordering::Relaxed);
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rocev2::RcEndpoint;
    use metaroce::rocev2::{ConnectAttrs, QpInit, RcConfig};
    use metaroce::Access;
    use std::net::Ipv4Addr;
    use std::sync::Arc;

    fn pair() -> (Arc<UdpIpBackend>, Arc<UdpIpBackend>) {
        let lo = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let a = Arc::new(UdpIpBackend::bind(lo).unwrap());
        let b = Arc::new(UdpIpBackend::bind(lo).unwrap());
        a.set_peer(b.local_ip(), b.local_addr());
        b.set_peer(a.local_ip(), a.local_addr());
        (a, b)
    }

    #[tokio::test]
    async fn write_read_atomic_over_udp() {
        let (ba, bb) = pair();
        let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let a = RcEndpoint::with_backend(ba.clone(), RcConfig::new(ip)).unwrap();
        let b = RcEndpoint::with_backend(bb.clone(), RcConfig::new(ip)).unwrap();
        let acc = Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
        let init = QpInit {
            access: acc,
            ..QpInit::default()
        };
        let qa = a.create_qp(init).unwrap();
        let qb = b.create_qp(init).unwrap();
        qa.connect(ConnectAttrs::new(ip, qb.qpn(), qb.psn()))
            .unwrap();
        qb.connect(ConnectAttrs::new(ip, qa.qpn(), qa.psn()))
            .unwrap();
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let src = a.register(data.clone(), Access::LOCAL_WRITE);
        let dst = b.register(vec![0; 10_016], Access::LOCAL_WRITE | acc);
        qa.write(src.lkey, 0, 10_000, dst.addr, dst.rkey, None)
            .await
            .unwrap();
        assert_eq!(b.read_mr(dst.lkey, 0, 10_000).unwrap(), data);
        let back = a.register(vec![0; 10_000], Access::LOCAL_WRITE);
        qa.read(back.lkey, 0, 10_000, dst.addr, dst.rkey)
            .await
            .unwrap();
        assert_eq!(a.read_mr(back.lkey, 0, 10_000).unwrap(), data);
        let res = a.register(vec![0; 8], Access::LOCAL_WRITE);
        let off = 10_008 - (dst.addr + 10_000) % 8;
        for i in 0..5u64 {
            let old = qa
                .fetch_add(res.lkey, 0, dst.addr + off, dst.rkey, 3)
                .await
                .unwrap();
            assert_eq!(old, 3 * i);
        }
        assert_eq!(b.stats().rx_bad_icrc, 0);
        assert!(ba.stats().tx_datagrams > 0 && bb.stats().rx_datagrams > 0);
    }

    #[test]
    fn framed_datagram_verifies_over_synthesized_header() {
        // A SEND_ONLY-shaped payload stamped for the synthesized header verifies once framed.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _g = rt.enter();
        let be = UdpIpBackend::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).unwrap();
        let from: SocketAddr = "10.1.2.3:50000".parse().unwrap();
        let mut payload = vec![0u8; 24];
        payload[0] = 0x04;
        let ip = IpHeader::synthesized(from.ip(), be.local_ip()).unwrap();
        icrc::stamp(&ip, from.port(), ROCEV2_UDP_PORT, &mut payload).unwrap();
        let mut out = vec![0u8; 128];
        let n = be.frame(from, None, &payload, &mut out).unwrap();
        assert_eq!(n, 20 + 8 + 24);
        icrc::verify_raw(&out[..20], &out[20..28], &out[28..n]).unwrap();
        let (dst, range) = parse(&out[..n]).unwrap();
        assert_eq!(dst, be.local_ip());
        assert_eq!(&out[range], &payload[..]);
    }
}
