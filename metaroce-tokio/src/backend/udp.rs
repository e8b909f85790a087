//! [`UdpBackend`]: real UDP sockets, one to receive on and one per path to send from.

use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::task::{ready, Context, Poll};

use quinn_udp::{UdpSockRef, UdpSocketState};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::io::Interest;

use super::{check_transmit, unknown_src_port, DatagramBackend, RecvMeta};

/// Largest UDP payload of one IPv4 packet (65 535 − 20 bytes of IP header − 8 of UDP header),
/// which also bounds the sum of the segments of one GSO send.
const MAX_UDP_PAYLOAD: usize = 65_507;

/// Most path-socket datagrams discarded per [`UdpBackend::poll_recv`] call (peers never send
/// to path ports; whatever arrives there is drained and ignored).
const PATH_DRAIN_BUDGET: usize = 64;

/// The path sockets are drained on every this many `poll_recv` calls, not on each: a check
/// of all of them (one readiness load and a `WouldBlock` per socket, 32 sockets by default)
/// cost about 3 % of the CPU of a 64 B ping-pong, for datagrams no peer sends. Their small
/// receive buffers ([`PATH_RECV_BUFFER`]) bound what waits meanwhile.
const PATH_DRAIN_EVERY: u32 = 64;

/// Receive batches of at most this many datagrams take their metadata from a small array
/// on the stack ([`UdpBackend::poll_recv`]); the driver receives into 8 buffers.
const SMALL_RECV_BATCH: usize = 8;

/// `SO_RCVBUF` asked for the send-only path sockets, in bytes (Linux grants twice this):
/// only stray datagrams arrive there, and they wait in it until the next receive on the
/// main socket drains them.
const PATH_RECV_BUFFER: usize = 4096;

/// Socket options of a [`UdpBackend`].
///
/// The transport sends bursts of ~4 KiB datagrams, so the kernel socket buffers must be far
/// larger than the Linux defaults (~208 KiB) or bursts are dropped in the kernel. Linux caps
/// the values at `net.core.rmem_max` / `net.core.wmem_max` (raise those sysctls to get the
/// full size); [`UdpBackend::recv_buffer_bytes`] / [`UdpBackend::send_buffer_bytes`] report
/// what the kernel granted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UdpConfig {
    /// Requested receive buffer (`SO_RCVBUF`) of the main socket, in bytes. Default 8 MiB.
    pub recv_buffer_bytes: usize,
    /// Requested send buffer (`SO_SNDBUF`) of every socket, in bytes. Default 8 MiB.
    pub send_buffer_bytes: usize,
}

impl Default for UdpConfig {
    fn default() -> Self {
        Self {
            recv_buffer_bytes: 8 << 20,
            send_buffer_bytes: 8 << 20,
        }
    }
}

/// One bound socket with its `quinn-udp` state (offload capabilities, ECN/PKTINFO setup).
#[derive(Debug)]
struct Sock {
    io: tokio::net::UdpSocket,
    state: UdpSocketState,
    port: u16,
}

impl Sock {
    /// Creates, configures and binds a non-blocking UDP socket at `addr`.
    fn bind(addr: SocketAddr, recv_buffer: Option<usize>, send_buffer: usize) -> io::Result<Self> {
        Self::bind_opt(addr, recv_buffer, send_buffer, false)
    }

    fn bind_opt(
        addr: SocketAddr,
        recv_buffer: Option<usize>,
        send_buffer: usize,
        reuse_port: bool,
    ) -> io::Result<Self> {
        let (std_socket, state, port) =
            bind_configured_opt(addr, recv_buffer, send_buffer, reuse_port)?;
        let io = tokio::net::UdpSocket::from_std(std_socket)?;
        Ok(Self { io, state, port })
    }
}

/// Creates, configures and binds a non-blocking UDP socket at `addr`, shared by the UDP and
/// io_uring backends: best-effort buffer sizes, then quinn-udp's socket options. Returns the
/// socket, its quinn-udp state and its local port.
pub(crate) fn bind_configured(
    addr: SocketAddr,
    recv_buffer: Option<usize>,
    send_buffer: usize,
) -> io::Result<(std::net::UdpSocket, UdpSocketState, u16)> {
    bind_configured_opt(addr, recv_buffer, send_buffer, false)
}

/// [`bind_configured`], with `SO_REUSEPORT` set before the bind when `reuse_port` (the
/// sockets of a sharded endpoint share its port).
fn bind_configured_opt(
    addr: SocketAddr,
    recv_buffer: Option<usize>,
    send_buffer: usize,
    reuse_port: bool,
) -> io::Result<(std::net::UdpSocket, UdpSocketState, u16)> {
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    // Buffer sizes are best effort: the kernel silently caps them, and a refusal must not
    // make the endpoint unusable.
    if let Some(bytes) = recv_buffer {
        if let Err(e) = socket.set_recv_buffer_size(bytes) {
            tracing::warn!("cannot set SO_RCVBUF to {bytes} bytes: {e}");
        }
    }
    if let Err(e) = socket.set_send_buffer_size(send_buffer) {
        tracing::warn!("cannot set SO_SNDBUF to {send_buffer} bytes: {e}");
    }
    socket.set_nonblocking(true)?;
    #[cfg(unix)]
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    #[cfg(not(unix))]
    let _ = reuse_port;
    socket.bind(&addr.into())?;
    let std_socket: std::net::UdpSocket = socket.into();
    // Enables IP_RECVTOS, UDP_GRO, IP_PKTINFO / IPV6_RECVPKTINFO and forbids fragmentation.
    let state = UdpSocketState::new(UdpSockRef::from(&std_socket))?;
    let port = std_socket.local_addr()?.port();
    Ok((std_socket, state, port))
}

/// Identifies the transmit a partially completed [`UdpBackend::poll_send`] was working on,
/// so that the call repeated after `Pending` resumes instead of resending the first segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ResumeKey {
    transmit: metaroce::Transmit,
    fingerprint: u64,
}

impl ResumeKey {
    fn new(transmit: &metaroce::Transmit, contents: &[u8]) -> Self {
        // FNV-1a over a sample (the first 32 bytes of every KiB, the last 32 bytes and the
        // length): `Pending` is frequent when the socket buffer is full, and hashing whole
        // 64 KiB batches each time cost ~14% of CPU. A transmit is the same one when its
        // Transmit fields and this sample agree.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut mix = |b: u8| {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        };
        for chunk in contents.chunks(1024) {
            chunk.iter().take(32).for_each(|&b| mix(b));
        }
        contents.iter().rev().take(32).for_each(|&b| mix(b));
        contents.len().to_le_bytes().iter().for_each(|&b| mix(b));
        Self {
            transmit: *transmit,
            fingerprint: h,
        }
    }

    /// [`new`](Self::new) for a transmit in pieces: the length and first 16 bytes of
    /// every piece (a gather transmit's pieces alternate between a packet's headers, which
    /// hold its PSN, and its payload).
    pub(crate) fn of_pieces(transmit: &metaroce::Transmit, pieces: &[&[u8]]) -> Self {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut mix = |b: u8| {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        };
        for p in pieces {
            p.iter().take(16).for_each(|&b| mix(b));
            p.len().to_le_bytes().iter().for_each(|&b| mix(b));
        }
        Self {
            transmit: *transmit,
            fingerprint: h,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Resume {
    key: ResumeKey,
    /// Bytes of the transmit already handed to the kernel.
    offset: usize,
}

/// A set of UDP sockets on one IP: the main socket peers send to, plus one send-only
/// socket per path whose ephemeral port is that path's ECMP entropy.
///
/// Built on `quinn-udp`, which on Linux provides:
///
/// * **GSO** (`UDP_SEGMENT`): a [`metaroce::Transmit`] with `segment_size` is handed to the
///   kernel in one `sendmsg` of up to [`max_gso_segments`](DatagramBackend::max_gso_segments)
///   datagrams (and at most 65 507 bytes); without GSO the datagrams are sent one by one.
/// * **GRO** (`UDP_GRO`): one receive buffer may hold several datagrams, see [`RecvMeta`].
/// * **ECN**: [`metaroce::Transmit::ecn`] is written with an `IP_TOS` / `IPV6_TCLASS` control
///   message; received codepoints come from `IP_RECVTOS` / `IPV6_RECVTCLASS`.
/// * **Local IP** of received datagrams via `IP_PKTINFO` / `IPV6_RECVPKTINFO`.
///
/// Must be created inside a tokio runtime (the sockets register with its reactor).
pub struct UdpBackend {
    main: Sock,
    paths: Vec<Sock>,
    ports: Vec<u16>,
    local_addr: SocketAddr,
    resume: Mutex<Option<Resume>>,
    /// `recvmmsg` calls made on the main socket (see [`UdpBackend::recv_calls`]).
    recv_calls: AtomicU64,
    /// `poll_recv` calls, for draining the path sockets every [`PATH_DRAIN_EVERY`]th.
    recv_polls: AtomicU32,
}

impl fmt::Debug for UdpBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UdpBackend")
            .field("local_addr", &self.local_addr)
            .field("source_ports", &self.ports)
            .field("max_gso_segments", &self.max_gso_segments())
            .field("max_gro_segments", &self.max_gro_segments())
            .finish_non_exhaustive()
    }
}

impl UdpBackend {
    /// Binds the main socket at `addr` (port 0 picks an ephemeral port) and `paths` path
    /// sockets on the same IP with ephemeral ports, with the default [`UdpConfig`] (8 MiB
    /// socket buffers). If `addr`'s IP is unspecified (`0.0.0.0` / `::`), so are the path
    /// sockets'.
    ///
    /// Errors: `paths == 0` ([`io::ErrorKind::InvalidInput`]), no tokio runtime
    /// ([`io::ErrorKind::Other`]), or any socket / bind failure.
    pub fn bind(addr: SocketAddr, paths: usize) -> io::Result<Self> {
        Self::bind_with(addr, paths, &UdpConfig::default())
    }

    /// [`bind`](Self::bind) with explicit socket options.
    pub fn bind_with(addr: SocketAddr, paths: usize, config: &UdpConfig) -> io::Result<Self> {
        Self::bind_member(addr, paths, config, false)
    }

    /// `shards` backends for the shards of one endpoint ([`Config::shards`](crate::Config::shards)):
    /// their main sockets share one port at `addr` (`SO_REUSEPORT`, bound in shard order)
    /// and a reuseport program steers each datagram to the shard of its BTH DestQP; each
    /// backend has its own `paths` path sockets. If the program cannot be attached (not
    /// Linux, an old kernel, a seccomp policy), one backend is returned and a warning
    /// logged: the endpoint then runs unsharded.
    ///
    /// Errors: as [`bind_with`](Self::bind_with); `shards == 0` is `InvalidInput`.
    pub(crate) fn bind_sharded(
        addr: SocketAddr,
        shards: usize,
        paths: usize,
        config: &UdpConfig,
    ) -> io::Result<Vec<Self>> {
        if shards == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "zero shards"));
        }
        let first = Self::bind_member(addr, paths, config, shards > 1)?;
        if shards == 1 {
            return Ok(vec![first]);
        }
        #[cfg(target_os = "linux")]
        let attached = super::reuseport::attach(&first.main.io, shards as u32);
        #[cfg(not(target_os = "linux"))]
        let attached: io::Result<()> = Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "reuseport steering needs Linux",
        ));
        if let Err(e) = attached {
            tracing::warn!(
                error = %e,
                shards,
                "cannot attach the reuseport steering program: running with one shard"
            );
            return Ok(vec![first]);
        }
        let mut at = addr;
        at.set_port(first.local_addr.port());
        let mut all = vec![first];
        for _ in 1..shards {
            all.push(Self::bind_member(at, paths, config, true)?);
        }
        Ok(all)
    }

    /// The one binding body: [`bind_with`](Self::bind_with), and a shard's member whose main
    /// socket shares its port (`reuse_port`, `SO_REUSEPORT`).
    fn bind_member(
        addr: SocketAddr,
        paths: usize,
        config: &UdpConfig,
        reuse_port: bool,
    ) -> io::Result<Self> {
        if paths == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a UdpBackend needs at least one path socket",
            ));
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(io::Error::other(
                "UdpBackend must be bound from within a tokio runtime",
            ));
        }
        let main = Sock::bind_opt(
            addr,
            Some(config.recv_buffer_bytes),
            config.send_buffer_bytes,
            reuse_port,
        )?;
        let local_addr = main.io.local_addr()?;
        let mut path_addr = addr;
        path_addr.set_port(0);
        let paths = (0..paths)
            .map(|_| Sock::bind(path_addr, Some(PATH_RECV_BUFFER), config.send_buffer_bytes))
            .collect::<io::Result<Vec<_>>>()?;
        let ports = paths.iter().map(|p| p.port).collect();
        tracing::debug!(
            %local_addr,
            ?ports,
            gso = main.state.max_gso_segments(),
            gro = main.state.gro_segments(),
            "UdpBackend bound"
        );
        Ok(Self {
            main,
            paths,
            ports,
            local_addr,
            resume: Mutex::new(None),
            recv_calls: AtomicU64::new(0),
            recv_polls: AtomicU32::new(0),
        })
    }

    /// The receive buffer the kernel granted the main socket, in bytes (as Linux reports it:
    /// twice the usable payload space).
    pub fn recv_buffer_bytes(&self) -> io::Result<usize> {
        self.main
            .state
            .recv_buffer_size(UdpSockRef::from(&self.main.io))
    }

    /// The send buffer the kernel granted the path sockets, in bytes (the smallest of them,
    /// as Linux reports it: twice the usable space).
    pub fn send_buffer_bytes(&self) -> io::Result<usize> {
        let mut min = usize::MAX;
        for p in &self.paths {
            min = min.min(p.state.send_buffer_size(UdpSockRef::from(&p.io))?);
        }
        Ok(min)
    }

    /// How many receive calls (`recvmmsg`, or `recvmsg` without it) this backend has made on
    /// its main socket so far, including those that found nothing (`EAGAIN`). A diagnostic
    /// for the receive path's system-call cost; it only grows.
    pub fn recv_calls(&self) -> u64 {
        self.recv_calls.load(Ordering::Relaxed)
    }

    /// Reads and discards whatever reached the path sockets, without registering for
    /// wake-ups: a path socket the reactor has not seen readable costs one atomic load, and
    /// every [`PATH_DRAIN_EVERY`]th receive on the main socket drains them. Registering a
    /// waker on every path socket at every receive cost 6 % of the CPU of a 64 B ping-pong
    /// (issue #13, P2). An endpoint that receives nothing leaves stray datagrams in the path socket's
    /// small receive buffer ([`PATH_RECV_BUFFER`]), where the kernel drops the excess.
    fn drain_paths(&self) {
        let mut scratch = [0u8; 256];
        for p in &self.paths {
            let mut budget = PATH_DRAIN_BUDGET;
            while budget > 0 {
                match p.io.try_recv_from(&mut scratch) {
                    Ok((_, from)) => {
                        tracing::trace!(port = p.port, %from, "discarded datagram sent to a path port");
                        budget -= 1;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(_) => budget -= 1,
                }
            }
        }
    }

    fn resume_offset(&self, transmit: &metaroce::Transmit, contents: &[u8]) -> usize {
        self.resume_with(|| ResumeKey::new(transmit, contents))
    }

    /// The offset saved for the transmit `key()` names; `key` is computed only when an
    /// offset is saved (rarely: after `Pending` part-way through a transmit).
    fn resume_with(&self, key: impl FnOnce() -> ResumeKey) -> usize {
        let mut guard = self.resume.lock().unwrap_or_else(|e| e.into_inner());
        match guard.take() {
            Some(r) if r.key == key() => r.offset,
            _ => 0,
        }
    }

    fn save_resume(&self, transmit: &metaroce::Transmit, contents: &[u8], offset: usize) {
        if offset == 0 {
            return;
        }
        self.save_resume_at(ResumeKey::new(transmit, contents), offset);
    }

    fn save_resume_at(&self, key: ResumeKey, offset: usize) {
        if offset == 0 {
            return;
        }
        *self.resume.lock().unwrap_or_else(|e| e.into_inner()) = Some(Resume { key, offset });
    }

    /// Bytes per `sendmsg` for a transmit of `remaining` bytes in `segment`-byte datagrams
    /// from `path`: one datagram, or as many whole datagrams as GSO and the 16-bit UDP
    /// length allow.
    fn chunk_len(path: &Sock, remaining: usize, segment: usize) -> usize {
        chunk_len(path.state.max_gso_segments(), remaining, segment)
    }
}

/// Bytes per `sendmsg` for `remaining` bytes in `segment`-byte datagrams when a socket
/// takes `max_segments` per GSO send: one datagram, or as many whole datagrams as GSO and
/// the 16-bit UDP length allow. Shared with the io_uring backend's gather send.
pub(crate) fn chunk_len(max_segments: usize, remaining: usize, segment: usize) -> usize {
    if remaining <= segment || max_segments <= 1 {
        segment.min(remaining)
    } else {
        let per_call = max_segments.min(MAX_UDP_PAYLOAD / segment).max(1);
        (per_call * segment).min(remaining)
    }
}

/// How a backend sends `transmit` in `pieces` ([`DatagramBackend::poll_send_pieces`])
/// from a socket bound at `local`: `Ok((total, segment))` to send them with
/// [`gather::send`] per GSO batch, `total` bytes in `segment`-byte datagrams; or
/// `Err(poll)`, what `send_joined` returned for the pieces joined (one piece, a platform
/// without [`gather::send`], or an IPv4 destination from an IPv6 socket), or an error if
/// the pieces do not add up to the transmit's size or its segment size is 0. The one
/// place both backends decide this.
pub(crate) fn pieces_plan(
    local: SocketAddr,
    transmit: &metaroce::Transmit,
    pieces: &[&[u8]],
    send_joined: impl FnOnce(&metaroce::Transmit, &[u8]) -> Poll<io::Result<()>>,
) -> Result<(usize, usize), Poll<io::Result<()>>> {
    let direct = cfg!(target_os = "linux")
        && local.is_ipv4() == transmit.destination.is_ipv4()
        && pieces.len() > 1;
    if !direct {
        return Err(match pieces {
            [one] => send_joined(transmit, one),
            _ => send_joined(transmit, &pieces.concat()),
        });
    }
    let total: usize = pieces.iter().map(|p| p.len()).sum();
    let segment = match (total == transmit.size, transmit.segment_size) {
        (true, Some(s)) if s > 0 => s,
        (true, None) => total.max(1),
        _ => {
            return Err(Poll::Ready(Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "transmit of size {} and segment size {:?} does not match its pieces \
                     ({total} bytes)",
                    transmit.size, transmit.segment_size
                ),
            ))))
        }
    };
    Ok((total, segment))
}

/// The lowest GSO limit over the path sockets' `states` (at least 1): what one `sendmsg`
/// may carry whichever path it leaves on. Shared with the io_uring backend.
pub(crate) fn lowest_gso_segments<'a>(states: impl Iterator<Item = &'a UdpSocketState>) -> usize {
    states
        .map(UdpSocketState::max_gso_segments)
        .min()
        .unwrap_or(1)
        .max(1)
}

fn to_quinn_ecn(ecn: Option<metaroce::EcnCodepoint>) -> Option<quinn_udp::EcnCodepoint> {
    ecn.and_then(|e| quinn_udp::EcnCodepoint::from_bits(e.bits()))
}

fn from_quinn_ecn(ecn: Option<quinn_udp::EcnCodepoint>) -> Option<metaroce::EcnCodepoint> {
    ecn.and_then(|e| metaroce::EcnCodepoint::from_bits(e as u8))
}

impl DatagramBackend for UdpBackend {
    fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    fn source_ports(&self) -> Vec<u16> {
        self.ports.clone()
    }

    /// The kernel's GSO limit (64 on Linux with `UDP_SEGMENT`), or 1 without GSO or after the
    /// NIC rejected it; the lowest over the path sockets.
    fn max_gso_segments(&self) -> usize {
        lowest_gso_segments(self.paths.iter().map(|p| &p.state))
    }

    /// 64 on Linux with `UDP_GRO` (the kernel's `UDP_GRO_CNT_MAX`), else 1.
    fn max_gro_segments(&self) -> usize {
        self.main.state.gro_segments().max(1)
    }

    /// The main socket's `SO_RCVBUF` ([`UdpBackend::recv_buffer_bytes`]).
    fn socket_recv_buffer(&self) -> Option<u64> {
        self.recv_buffer_bytes().ok().map(|b| b as u64)
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        if self.recv_polls.fetch_add(1, Ordering::Relaxed) % PATH_DRAIN_EVERY == 0 {
            self.drain_paths();
        }
        let n = bufs.len().min(meta.len()).min(quinn_udp::BATCH_SIZE);
        if n == 0 {
            return Poll::Ready(Ok(0));
        }
        loop {
            ready!(self.main.io.poll_recv_ready(cx))?;
            // quinn-udp's per-datagram metadata, made only once the socket is readable (a
            // driver polls once more per datagram in a ping-pong, to wait) and only as large
            // as the batch: `BATCH_SIZE` (32) defaults, each with a `SocketAddr`, cost
            // about 400 instructions per poll, 3 % of the user time of a 64 B ping-pong.
            let mut small = [quinn_udp::RecvMeta::default(); SMALL_RECV_BATCH];
            let mut large;
            let qmeta: &mut [quinn_udp::RecvMeta] = if n <= SMALL_RECV_BATCH {
                &mut small[..n]
            } else {
                large = [quinn_udp::RecvMeta::default(); quinn_udp::BATCH_SIZE];
                &mut large[..n]
            };
            // A batch that came back with fewer datagrams than it had room for emptied the
            // socket's queue: the closure then reports `WouldBlock` to `try_io`, which clears
            // the readiness, so the next poll waits for the next datagram instead of paying
            // one more `recvmmsg` that returns EAGAIN. tokio only clears the readiness if no
            // new event arrived since it was observed, so a datagram that lands meanwhile is
            // not missed. The datagrams already read travel in `got`.
            let mut got = None;
            let res = self.main.io.try_io(Interest::READABLE, || {
                self.recv_calls.fetch_add(1, Ordering::Relaxed);
                let count = self.main.state.recv(
                    UdpSockRef::from(&self.main.io),
                    &mut bufs[..n],
                    &mut *qmeta,
                )?;
                if count > 0 && count < n {
                    got = Some(count);
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                Ok(count)
            });
            let count = match (res, got) {
                (_, Some(count)) => count,
                (Ok(count), None) => count,
                (Err(e), None) if e.kind() == io::ErrorKind::WouldBlock => continue,
                (Err(e), None) => return Poll::Ready(Err(e)),
            };
            let count = count.min(n);
            for (out, q) in meta.iter_mut().zip(&qmeta[..count]) {
                *out = RecvMeta {
                    from: q.addr,
                    local_ip: q.dst_ip,
                    ecn: from_quinn_ecn(q.ecn),
                    len: q.len,
                    stride: q.stride,
                };
            }
            return Poll::Ready(Ok(count));
        }
    }

    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        transmit: &metaroce::Transmit,
        contents: &[u8],
    ) -> Poll<io::Result<()>> {
        let segment = match check_transmit(transmit, contents) {
            Ok(s) => s,
            Err(e) => return Poll::Ready(Err(e)),
        };
        let Some(path) = self.paths.iter().find(|p| p.port == transmit.src_port) else {
            return Poll::Ready(Err(unknown_src_port(transmit.src_port, &self.ports)));
        };
        let ecn = to_quinn_ecn(transmit.ecn);
        let mut offset = self.resume_offset(transmit, contents);
        // A zero-length datagram is still one datagram.
        let mut first = contents.is_empty();
        while offset < contents.len() || first {
            first = false;
            let chunk_len = Self::chunk_len(path, contents.len() - offset, segment);
            let chunk = &contents[offset..offset + chunk_len];
            let qt = quinn_udp::Transmit {
                destination: transmit.destination,
                ecn,
                contents: chunk,
                segment_size: (chunk_len > segment).then_some(segment),
                src_ip: None,
            };
            match path.io.poll_send_ready(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    self.save_resume(transmit, contents, offset);
                    return Poll::Pending;
                }
            }
            let res = path.io.try_io(Interest::WRITABLE, || {
                path.state.try_send(UdpSockRef::from(&path.io), &qt)
            });
            match res {
                Ok(()) => offset += chunk_len,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Readiness was cleared: the next `poll_send_ready` registers the waker.
                    first = contents.is_empty();
                }
                Err(e) if qt.segment_size.is_some() && path.state.max_gso_segments() <= 1 => {
                    // quinn-udp just turned GSO off for this socket (the NIC or driver refused
                    // it): retry the same bytes one datagram at a time.
                    tracing::debug!("GSO send failed ({e}); retrying without segmentation");
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        Poll::Ready(Ok(()))
    }

    fn sends_gathered(&self) -> bool {
        cfg!(target_os = "linux")
    }

    /// One `sendmsg` per GSO batch with the pieces as its I/O vector (Linux; elsewhere,
    /// and for an IPv4 destination from an IPv6 socket, the pieces are joined and sent as
    /// [`poll_send`](DatagramBackend::poll_send) does). A batch the kernel refuses is
    /// sent again joined, through quinn-udp, which turns GSO off where the NIC refuses it.
    fn poll_send_pieces(
        &self,
        cx: &mut Context<'_>,
        transmit: &metaroce::Transmit,
        pieces: &[&[u8]],
    ) -> Poll<io::Result<()>> {
        let plan = pieces_plan(self.local_addr, transmit, pieces, |t, b| {
            self.poll_send(cx, t, b)
        });
        let (total, segment) = match plan {
            Ok(direct) => direct,
            Err(joined) => return joined,
        };
        let Some(path) = self.paths.iter().find(|p| p.port == transmit.src_port) else {
            return Poll::Ready(Err(unknown_src_port(transmit.src_port, &self.ports)));
        };
        let mut offset = self.resume_with(|| ResumeKey::of_pieces(transmit, pieces));
        while offset < total {
            let chunk_len = Self::chunk_len(path, total - offset, segment);
            match path.io.poll_send_ready(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    if offset > 0 {
                        self.save_resume_at(ResumeKey::of_pieces(transmit, pieces), offset);
                    }
                    return Poll::Pending;
                }
            }
            let gso = (chunk_len > segment).then_some(segment);
            let res = path.io.try_io(Interest::WRITABLE, || {
                gather::send(&path.io, transmit, pieces, offset, chunk_len, gso)
            });
            match res {
                Ok(()) => offset += chunk_len,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => {
                    // The rest joined, through quinn-udp (its own resume from here on).
                    tracing::debug!("gather send failed ({e}); sending the rest joined");
                    let rest = pieces.concat();
                    let rest = &rest[offset..];
                    let t = metaroce::Transmit {
                        size: rest.len(),
                        ..*transmit
                    };
                    let r = self.poll_send(cx, &t, rest);
                    if r.is_pending() {
                        // `poll_send` saved its point under (t, rest); the next call comes
                        // with (transmit, pieces): re-key it, counted from the start (found
                        // by review: the transmit started again from its first byte).
                        let inner = self.resume_offset(&t, rest);
                        let key = ResumeKey::of_pieces(transmit, pieces);
                        self.save_resume_at(key, offset + inner);
                    }
                    return r;
                }
            }
        }
        Poll::Ready(Ok(()))
    }
}

/// `sendmsg` with an I/O vector and the control messages quinn-udp would write (Linux).
#[cfg(target_os = "linux")]
pub(crate) mod gather {
    use std::io::{self, IoSlice};

    /// Most I/O vector entries one `sendmsg` gets here: 64 datagrams of head, payload and
    /// tail each, with room to spare (the kernel takes up to 1024).
    const MAX_IOV: usize = 256;

    /// Sends bytes `[offset, offset + len)` of the concatenation of `pieces` as one
    /// `sendmsg` to `t.destination`, in `gso`-byte datagrams (`UDP_SEGMENT`) if given,
    /// with `t.ecn` in `IP_TOS` / `IPV6_TCLASS`. `WouldBlock` as the socket says; any
    /// other error if the kernel refuses, or if the range needs more than [`MAX_IOV`]
    /// entries or the send is short.
    pub(crate) fn send(
        sock: &impl std::os::fd::AsFd,
        t: &metaroce::Transmit,
        pieces: &[&[u8]],
        offset: usize,
        len: usize,
        gso: Option<usize>,
    ) -> io::Result<()> {
        let mut iov = [IoSlice::new(&[]); MAX_IOV];
        let mut n = 0;
        let (mut at, end) = (0usize, offset + len);
        for p in pieces {
            let (from, to) = (at.max(offset), (at + p.len()).min(end));
            if from < to {
                let slot = iov
                    .get_mut(n)
                    .ok_or_else(|| io::Error::other("transmit in too many pieces"))?;
                *slot = IoSlice::new(&p[from - at..to - at]);
                n += 1;
            }
            at += p.len();
            if at >= end {
                break;
            }
        }
        let gso = match gso {
            Some(seg) => {
                Some(u16::try_from(seg).map_err(|_| io::Error::other("segment too large"))?)
            }
            None => None,
        };
        let ctrl = crate::backend::uring::send_control(t.destination, t.ecn, gso);
        let addr = socket2::SockAddr::from(t.destination);
        let mut msg = socket2::MsgHdr::new()
            .with_addr(&addr)
            .with_buffers(&iov[..n]);
        if !ctrl.bytes().is_empty() {
            msg = msg.with_control(ctrl.bytes());
        }
        let sent = socket2::SockRef::from(sock).sendmsg(&msg, 0)?;
        if sent != len {
            return Err(io::Error::other(format!(
                "short send: {sent} of {len} bytes"
            )));
        }
        Ok(())
    }
}

#[cfg(not(target_os = "linux"))]
pub(crate) mod gather {
    pub(crate) fn send<S>(
        _sock: &S,
        _t: &metaroce::Transmit,
        _pieces: &[&[u8]],
        _offset: usize,
        _len: usize,
        _gso: Option<usize>,
    ) -> std::io::Result<()> {
        Err(std::io::Error::other("gather send needs Linux"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::IpAddr;

    #[test]
    fn ecn_conversion_round_trips() {
        use metaroce::EcnCodepoint as E;
        for e in [E::Ect0, E::Ect1, E::Ce] {
            assert_eq!(from_quinn_ecn(to_quinn_ecn(Some(e))), Some(e));
        }
        assert_eq!(to_quinn_ecn(None), None);
    }

    #[test]
    fn bind_outside_runtime_is_an_error() {
        let err = UdpBackend::bind("127.0.0.1:0".parse().unwrap(), 1).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::Other);
    }

    #[tokio::test]
    async fn bind_rejects_zero_paths() {
        let err = UdpBackend::bind("127.0.0.1:0".parse().unwrap(), 0).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }

    #[tokio::test]
    async fn unspecified_ip_binds_paths_unspecified() {
        let b = UdpBackend::bind("0.0.0.0:0".parse().unwrap(), 2).unwrap();
        assert!(b.local_addr().ip().is_unspecified());
        for p in &b.paths {
            assert_eq!(p.io.local_addr().unwrap().ip(), IpAddr::from([0, 0, 0, 0]));
        }
    }

    #[tokio::test]
    async fn a_partial_batch_ends_the_readiness_without_an_eagain_receive() {
        let b = UdpBackend::bind("127.0.0.1:0".parse().unwrap(), 1).unwrap();
        let tx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        tx.send_to(b"one", b.local_addr()).unwrap();
        tx.send_to(b"two", b.local_addr()).unwrap();
        let mut storage = [[0u8; 64]; 4];
        let mut meta = [RecvMeta::EMPTY; 4];
        // Wait until both datagrams are queued, so one batch takes both.
        let mut total = 0;
        while total < 2 {
            let mut bufs: Vec<IoSliceMut<'_>> =
                storage.iter_mut().map(|s| IoSliceMut::new(s)).collect();
            total += std::future::poll_fn(|cx| b.poll_recv(cx, &mut bufs, &mut meta))
                .await
                .unwrap();
        }
        let calls = b.recv_calls();
        // The queue is empty: a poll now must wait without another receive call.
        let mut bufs: Vec<IoSliceMut<'_>> =
            storage.iter_mut().map(|s| IoSliceMut::new(s)).collect();
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(b.poll_recv(&mut cx, &mut bufs, &mut meta).is_pending());
        assert_eq!(b.recv_calls(), calls, "an empty socket cost a receive call");
        // A datagram that arrives later is still received.
        tx.send_to(b"three", b.local_addr()).unwrap();
        let got = std::future::poll_fn(|cx| b.poll_recv(cx, &mut bufs, &mut meta))
            .await
            .unwrap();
        assert_eq!(got, 1);
        assert_eq!(meta[0].len, 5);
    }

    /// Batches larger than `SMALL_RECV_BATCH` (metadata from the larger array) and smaller
    /// ones (from the small one) both return every datagram, in order, with its sender and
    /// length.
    #[tokio::test]
    async fn receive_batches_of_every_size_return_their_metadata() {
        let b = UdpBackend::bind("127.0.0.1:0".parse().unwrap(), 1).unwrap();
        let tx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        for (bufs_n, count) in [(SMALL_RECV_BATCH + 8, SMALL_RECV_BATCH + 4), (3, 5)] {
            // Distinct lengths, so that GRO cannot join them: one datagram per buffer.
            for i in 0..count {
                tx.send_to(&vec![i as u8; 10 + i], b.local_addr()).unwrap();
            }
            let mut storage = vec![[0u8; 64]; bufs_n];
            let mut meta = vec![RecvMeta::EMPTY; bufs_n];
            let mut got: Vec<(SocketAddr, Vec<u8>)> = Vec::new();
            while got.len() < count {
                let mut bufs: Vec<IoSliceMut<'_>> =
                    storage.iter_mut().map(|s| IoSliceMut::new(s)).collect();
                let n = std::future::poll_fn(|cx| b.poll_recv(cx, &mut bufs, &mut meta))
                    .await
                    .unwrap();
                assert!(n <= bufs_n);
                for (m, s) in meta[..n].iter().zip(&storage) {
                    for d in m.datagrams(s) {
                        got.push((m.from, d.to_vec()));
                    }
                }
            }
            let want: Vec<(SocketAddr, Vec<u8>)> = (0..count)
                .map(|i| (tx.local_addr().unwrap(), vec![i as u8; 10 + i]))
                .collect();
            assert_eq!(got, want, "{bufs_n} buffers");
        }
    }

    /// Junk sent to a path port is discarded by the next receive on the main socket
    /// (`drain_paths`, no waker on the path sockets) and never shows up as a datagram.
    #[tokio::test]
    async fn datagrams_sent_to_path_ports_are_drained_by_the_next_receive() {
        let b = UdpBackend::bind("127.0.0.1:0".parse().unwrap(), 2).unwrap();
        let tx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let path_addr = |p: &Sock| SocketAddr::new([127, 0, 0, 1].into(), p.port);
        for p in &b.paths {
            for _ in 0..3 {
                tx.send_to(b"junk", path_addr(p)).unwrap();
            }
        }
        // Let the reactor see the path sockets readable.
        for p in &b.paths {
            p.io.readable().await.unwrap();
        }
        tx.send_to(b"real", b.local_addr()).unwrap();
        let mut storage = [[0u8; 64]; 4];
        let mut meta = [RecvMeta::EMPTY; 4];
        let mut bufs: Vec<IoSliceMut<'_>> =
            storage.iter_mut().map(|s| IoSliceMut::new(s)).collect();
        let got = std::future::poll_fn(|cx| b.poll_recv(cx, &mut bufs, &mut meta))
            .await
            .unwrap();
        assert_eq!(got, 1);
        assert_eq!(meta[0].len, 4);
        assert_eq!(&storage[0][..4], b"real");
        let mut scratch = [0u8; 16];
        for p in &b.paths {
            let e = p.io.try_recv_from(&mut scratch).unwrap_err();
            assert_eq!(
                e.kind(),
                io::ErrorKind::WouldBlock,
                "path {} not drained",
                p.port
            );
        }
    }
}
