//! Packet backends for RoCEv2 mode: they move whole **IP packets**, because the RoCEv2
//! ICRC covers IP header fields (the IPv4 Identification above all) that a UDP socket can
//! neither choose on send nor report on receive.
//!
//! * [`RawIpBackend`]: Linux raw sockets. Sends through `socket(AF_INET, SOCK_RAW,
//!   IPPROTO_RAW)` (implies `IP_HDRINCL`: the IPv4 header we built — our ID, DF, TTL, TOS,
//!   UDP checksum 0 — goes on the wire unchanged) and receives through
//!   `socket(AF_INET, SOCK_RAW, IPPROTO_UDP)`, which delivers every inbound UDP datagram
//!   with its IP header; the backend keeps those addressed to `local_ip:4791`. Both need
//!   `CAP_NET_RAW`. A plain UDP socket is also bound on `local_ip:4791` so the kernel does
//!   not answer the peer's packets with ICMP port-unreachable (it is never read; its small
//!   receive buffer just overflows). Without it (e.g. `rdma_rxe` loaded on the same host
//!   already owns 4791) the backend still works, with ICMP noise.
//! * [`MemoryLink`]: an in-memory pair for tests.
//!
//! No `unsafe`: socket2's safe `Read for &Socket` returns the IP packet (the source address
//! is in the IP header).

use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::fmt;
use std::io::{self, Read};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::Mutex;
use std::task::{ready, Context, Poll};
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

/// Moves whole IP packets for an RoCEv2 endpoint.
pub trait IpBackend: Send + Sync + fmt::Debug + 'static {
    /// The local IP packets are sent from and accepted for.
    fn local_ip(&self) -> IpAddr;
    /// Receive one whole IP packet (IP header first) into `buf`; returns its length.
    fn poll_recv(&self, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<usize>>;
    /// Send one whole IP packet (the IP header is used as given) to `dst`.
    fn poll_send(&self, cx: &mut Context<'_>, packet: &[u8], dst: IpAddr) -> Poll<io::Result<()>>;
}

/// The error text when raw sockets are refused.
pub const NEED_CAP_NET_RAW: &str = "RoCEv2 mode needs CAP_NET_RAW (run as root or \
     `setcap cap_net_raw+ep <binary>`): it sends through a raw IPv4 socket with IP_HDRINCL \
     and receives through a raw UDP socket, because the ICRC covers the IPv4 header";

fn raw_socket(proto: i32) -> io::Result<Socket> {
    // socket2 exposes Type::RAW only with its "all" feature; SOCK_RAW is 3 on Linux.
    Socket::new(Domain::IPV4, Type::from(3), Some(Protocol::from(proto))).map_err(|e| {
        if matches!(e.raw_os_error(), Some(1) | Some(13)) {
            io::Error::new(io::ErrorKind::PermissionDenied, NEED_CAP_NET_RAW)
        } else {
            e
        }
    })
}

/// Raw-socket backend (IPv4, Linux): sends through `SOCK_RAW`/`IPPROTO_RAW` with our own
/// IPv4 header, receives through `SOCK_RAW`/`IPPROTO_UDP`; both need `CAP_NET_RAW`.
pub struct RawIpBackend {
    local: Ipv4Addr,
    tx: AsyncFd<Socket>,
    rx: AsyncFd<Socket>,
    _sink: Option<UdpSocket>,
}

impl fmt::Debug for RawIpBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RawIpBackend")
            .field("local", &self.local)
            .field("icmp_sink", &self._sink.is_some())
            .finish()
    }
}

const IPPROTO_RAW: i32 = 255;
const IPPROTO_UDP: i32 = 17;

impl RawIpBackend {
    /// Open the raw sockets for `local` (must be inside a tokio runtime). Fails with
    /// `PermissionDenied` and [`NEED_CAP_NET_RAW`] without the capability.
    pub fn bind(local: Ipv4Addr) -> io::Result<Self> {
        let tx = raw_socket(IPPROTO_RAW)?;
        tx.set_nonblocking(true)?;
        let _ = tx.set_send_buffer_size(4 << 20);
        let rx = raw_socket(IPPROTO_UDP)?;
        rx.set_nonblocking(true)?;
        let _ = rx.set_recv_buffer_size(8 << 20);
        if !local.is_unspecified() {
            rx.bind(&SockAddr::from(SocketAddr::new(IpAddr::V4(local), 0)))?;
        }
        let sink = match UdpSocket::bind((local, metaroce::wire::ROCEV2_UDP_PORT)) {
            Ok(s) => {
                let s2 = Socket::from(s);
                let _ = s2.set_recv_buffer_size(1);
                Some(UdpSocket::from(s2))
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not bind UDP {local}:4791 (is rdma_rxe loaded?): the kernel will answer RoCEv2 packets with ICMP port unreachable");
                None
            }
        };
        Ok(Self {
            local,
            tx: register(tx)?,
            rx: register(rx)?,
            _sink: sink,
        })
    }
}

/// Register a socket with the reactor. `AsyncFd::new` is deprecated in favour of an
/// `unsafe` constructor because a caller could close the fd behind the reactor's back;
/// here the `AsyncFd` takes ownership of the `Socket`, which owns the fd and is never
/// handed out, so that cannot happen and the safe constructor is sound.
#[allow(deprecated)]
fn register(s: Socket) -> io::Result<AsyncFd<Socket>> {
    AsyncFd::new(s)
}

/// Whether `p` is an IPv4 UDP packet to `local`:4791.
fn for_us(p: &[u8], local: Ipv4Addr) -> bool {
    if p.len() < 28 || p[0] >> 4 != 4 || p[9] != 17 {
        return false;
    }
    let ihl = usize::from(p[0] & 0x0F) * 4;
    let dst = Ipv4Addr::new(p[16], p[17], p[18], p[19]);
    let dport = p
        .get(ihl + 2..ihl + 4)
        .map(|b| u16::from_be_bytes([b[0], b[1]]));
    (local.is_unspecified() || dst == local) && dport == Some(metaroce::wire::ROCEV2_UDP_PORT)
}

impl IpBackend for RawIpBackend {
    fn local_ip(&self) -> IpAddr {
        IpAddr::V4(self.local)
    }

    fn poll_recv(&self, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.rx.poll_read_ready(cx))?;
            match guard.try_io(|s| s.get_ref().read(buf)) {
                Ok(Ok(n)) => {
                    if for_us(&buf[..n.min(buf.len())], self.local) {
                        return Poll::Ready(Ok(n));
                    }
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_send(&self, cx: &mut Context<'_>, packet: &[u8], dst: IpAddr) -> Poll<io::Result<()>> {
        let addr = SockAddr::from(SocketAddr::new(dst, 0));
        loop {
            let mut guard = ready!(self.tx.poll_write_ready(cx))?;
            match guard.try_io(|s| s.get_ref().send_to(packet, &addr)) {
                Ok(r) => return Poll::Ready(r.map(|_| ())),
                Err(_would_block) => continue,
            }
        }
    }
}

/// Decides whether an outgoing packet of a [`MemoryLink`] is lost.
type LossFn = Box<dyn Fn(&[u8]) -> bool + Send + Sync>;

/// Packets a [`MemoryLink`] direction queues; more are dropped (a full switch queue).
pub const MEMORY_LINK_QUEUE: usize = 4096;

/// One end of an in-memory link between two endpoints (tests, examples). Packets are
/// delivered in order, without loss, unless `drop` says otherwise or more than
/// [`MEMORY_LINK_QUEUE`] wait unreceived (then, as at a full switch queue, the new one is
/// dropped and the transport recovers it).
pub struct MemoryLink {
    local: IpAddr,
    tx: mpsc::Sender<Vec<u8>>,
    rx: Mutex<mpsc::Receiver<Vec<u8>>>,
    drop: Option<LossFn>,
}

impl fmt::Debug for MemoryLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryLink")
            .field("local", &self.local)
            .finish()
    }
}

impl MemoryLink {
    /// Two connected ends with the given local IPs.
    pub fn pair(a: IpAddr, b: IpAddr) -> (MemoryLink, MemoryLink) {
        let (ta, ra) = mpsc::channel(MEMORY_LINK_QUEUE);
        let (tb, rb) = mpsc::channel(MEMORY_LINK_QUEUE);
        (
            MemoryLink {
                local: a,
                tx: tb,
                rx: Mutex::new(ra),
                drop: None,
            },
            MemoryLink {
                local: b,
                tx: ta,
                rx: Mutex::new(rb),
                drop: None,
            },
        )
    }

    /// Lose the outgoing packets for which `f` returns true.
    pub fn with_loss(mut self, f: impl Fn(&[u8]) -> bool + Send + Sync + 'static) -> Self {
        self.drop = Some(Box::new(f));
        self
    }
}

impl IpBackend for MemoryLink {
    fn local_ip(&self) -> IpAddr {
        self.local
    }

    fn poll_recv(&self, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<usize>> {
        let mut rx = self.rx.lock().unwrap_or_else(|e| e.into_inner());
        match ready!(rx.poll_recv(cx)) {
            Some(p) => {
                let n = p.len().min(buf.len());
                buf[..n].copy_from_slice(&p[..n]);
                Poll::Ready(Ok(n))
            }
            None => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "memory link closed",
            ))),
        }
    }

    fn poll_send(
        &self,
        _cx: &mut Context<'_>,
        packet: &[u8],
        _dst: IpAddr,
    ) -> Poll<io::Result<()>> {
        if self.drop.as_ref().is_some_and(|f| f(packet)) {
            return Poll::Ready(Ok(()));
        }
        // A closed peer or a full queue is a lost packet.
        let _ = self.tx.try_send(packet.to_vec());
        Poll::Ready(Ok(()))
    }
}
