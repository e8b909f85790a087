//! [`UringBackend`]: the same sockets as [`UdpBackend`](super::UdpBackend), driven through
//! Linux io_uring.
//!
//! What it does and the kernels it needs are on [`UringBackend`] (this module is private).

use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::task::{ready, Context, Poll};

use quinn_udp::{UdpSockRef, UdpSocketState};
use tokio::io::unix::AsyncFd;

use super::{check_transmit, unknown_src_port, DatagramBackend, RecvMeta, UdpConfig};

mod ring;
use ring::{Done, Ring};

/// Largest UDP payload of one IPv4 packet; also the bound of one GSO `sendmsg`.
const MAX_UDP_PAYLOAD: usize = 65_507;
/// The kernel's most GSO segments per send (`UDP_MAX_SEGMENTS`).
const MAX_GSO_SEGMENTS: usize = 64;
/// Environment variable that turns the io_uring backend off (`0`, `off`, `false`, `no`):
/// [`bind_backend`](super::bind_backend) then uses plain UDP.
pub const DISABLE_ENV: &str = "METAROCE_IO_URING";

/// Options of a [`UringBackend`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UringConfig {
    /// Socket options, as for [`UdpBackend`](super::UdpBackend).
    pub udp: UdpConfig,
    /// Submission queue entries (rounded up to a power of two by the kernel). Default 256.
    pub sq_entries: u32,
    /// Provided receive buffers (a power of two, at most 32 768), each holding one GRO batch
    /// of up to 64 KiB. Default 64 (about 4.2 MiB).
    pub recv_buffers: u16,
    /// Send slots: most `sendmsg` operations in flight at once, each holding up to 64
    /// datagram buffers. Default 128. `poll_send` is `Pending` while all are in use and the
    /// send queue is full.
    pub send_slots: usize,
    /// Datagrams queued in user space by `poll_send` before they become `sendmsg`s (at the
    /// next [`flush`](DatagramBackend::flush), receive poll, or when this many are queued).
    /// Queued datagrams to the same destination from the same path socket, with the same
    /// ECN codepoint and size (the last of a run may be shorter), go out as one `sendmsg`
    /// with `UDP_SEGMENT` (GSO). Default 256; at least 1.
    pub send_queue: usize,
    /// Join queued datagrams into GSO sends as described at
    /// [`send_queue`](Self::send_queue). Default `true`; off, each datagram is one `sendmsg`
    /// (as the UDP backend sends).
    pub coalesce: bool,
    /// Smallest GSO batch, in bytes, sent with `SENDMSG_ZC` (zero copy) where the kernel
    /// has it; `None` never uses zero copy. Default `None`: on loopback, and for datagrams
    /// of a few KiB, the zero-copy notification costs more than the copy it saves
    /// (docs/RESULTS.md); set it for large segments on a real NIC.
    pub zero_copy_min_bytes: Option<usize>,
    /// Refuse to set up io_uring (to test or force the fallback). Default `false`.
    pub disabled: bool,
}

impl Default for UringConfig {
    fn default() -> Self {
        Self {
            udp: UdpConfig::default(),
            sq_entries: 256,
            recv_buffers: 64,
            send_slots: 128,
            send_queue: 256,
            coalesce: true,
            zero_copy_min_bytes: None,
            disabled: false,
        }
    }
}

/// One bound socket and the offloads `quinn-udp` found on it.
#[derive(Debug)]
struct Sock {
    socket: std::net::UdpSocket,
    state: UdpSocketState,
    port: u16,
}

impl Sock {
    fn bind(addr: SocketAddr, recv_buffer: Option<usize>, send_buffer: usize) -> io::Result<Self> {
        let (socket, state, port) = super::udp::bind_configured(addr, recv_buffer, send_buffer)?;
        Ok(Self {
            socket,
            state,
            port,
        })
    }
}

/// One datagram (or, for a transmit the caller segmented itself, one GSO batch) queued for
/// sending.
#[derive(Debug)]
struct Queued {
    /// Index of the path socket.
    path: usize,
    /// Queue order, to keep each (path, destination)'s datagrams in order when the queue is
    /// sorted by them.
    seq: u64,
    dest: SocketAddr,
    ecn: Option<metaroce::EcnCodepoint>,
    /// `UDP_SEGMENT` of a caller-segmented batch (never joined with others).
    segment: Option<u16>,
    data: QData,
}

/// The bytes of a queued entry.
#[derive(Debug)]
enum QData {
    /// A buffer of its own (joinable with neighbours into one GSO send).
    Own(Vec<u8>),
    /// One chunk of a transmit too large for one `sendmsg`: a range of a buffer in the send
    /// ring's shared table (`Ring::share`), sent alone.
    Shared {
        id: usize,
        range: std::ops::Range<usize>,
    },
}

impl QData {
    fn len(&self) -> usize {
        match self {
            QData::Own(v) => v.len(),
            QData::Shared { range, .. } => range.end - range.start,
        }
    }
}

/// The mutable part: the ring, the send queue and the receive completions not yet handed
/// out.
#[derive(Debug)]
struct Inner {
    /// `send_fd` registered with the reactor while a `poll_send` waits for a send slot
    /// (first: deregistered before the rings close); `None` otherwise.
    send_wait: Option<AsyncFd<OwnedFd>>,
    /// The receive ring (multishot recvmsg, provided buffers).
    ring: Ring,
    /// The send ring (send slots).
    tx: Ring,
    /// Datagrams accepted by `poll_send`, not yet in a `sendmsg`.
    queue: std::collections::VecDeque<Queued>,
    next_seq: u64,
    /// GSO joining turned off (a `UDP_SEGMENT` send failed with EIO: no segmentation
    /// offload on the route's device).
    gso_off: bool,
    /// Receive completions (buffer id, bytes) in arrival order.
    ready: std::collections::VecDeque<(u16, usize)>,
    /// The multishot receive stopped with ENOBUFS (every buffer taken): re-arm once a
    /// buffer is recycled.
    starved: bool,
    /// The last receive error (errno) not yet reported by `poll_recv`.
    error: Option<i32>,
}

/// A set of UDP sockets (main socket plus per-path send sockets, as
/// [`UdpBackend`](super::UdpBackend)) whose I/O goes through one io_uring instance.
///
/// Must be created inside a tokio runtime.
///
/// * **Receive**: one multishot `recvmsg` (`IORING_RECV_MULTISHOT`, Linux 6.0) on the main
///   socket, filling buffers from a provided buffer ring (`IORING_REGISTER_PBUF_RING`, 5.19):
///   the kernel posts one completion per datagram (or GRO batch) without a system call per
///   receive. The completion queue's fd is registered with tokio's reactor.
/// * **Send**: each transmit becomes one `sendmsg` per GSO batch (`UDP_SEGMENT` control
///   message, up to 64 segments / 65 507 bytes), queued in the submission ring and submitted
///   in one `io_uring_enter` per driver flush ([`DatagramBackend::flush`]), or earlier when
///   the ring fills. Batches of at least [`UringConfig::zero_copy_min_bytes`] use
///   `IORING_OP_SENDMSG_ZC` (6.1) when the kernel has it. The sends have a ring of their
///   own, whose fd is registered with the reactor only while a `poll_send` waits for a
///   free slot: otherwise the completions of each batch would wake a worker parked in
///   `epoll_wait`, for nothing.
/// * **Fallback**: [`UringBackend::bind`] fails with [`io::ErrorKind::Unsupported`] and a
///   message naming the cause when io_uring is missing or forbidden (ENOSYS, EPERM from
///   seccomp or `kernel.io_uring_disabled`, kernels before 6.0), or when
///   [`UringConfig::disabled`] / `METAROCE_IO_URING=0` forces it off;
///   [`bind_backend`](super::bind_backend) then binds a [`UdpBackend`](super::UdpBackend).
/// * **Threads**: the kernel completes each received datagram in task work queued to the
///   thread that armed the multishot receive. When another thread polls for datagrams (the
///   driver task moved to another tokio worker), each datagram would first wake the arming
///   thread, then the poller: two thread wake-ups instead of none on loopback. After 4
///   consecutive receive polls from one other thread, the receive is cancelled and re-armed
///   from that thread ([`UringStats::recv_moves`] counts these); datagrams arriving in
///   between wait in the socket buffer. Only receive polls arm it, never `poll_send` or
///   `flush`: sends may come from any thread (metaroce-tokio's application tasks send
///   their packets themselves, `Config::inline_transmit`) without that thread becoming the
///   one received datagrams wake.
///
/// Copies: the kernel copies each sent datagram once (as with `sendmsg`) after the backend
/// copied it into a send slot; received bytes are copied once from the provided buffer into
/// the caller's buffer. Send errors are reported by completions after `poll_send` returned,
/// so they are counted ([`UringBackend::send_errors`]) like lost packets.
pub struct UringBackend {
    // Reactor registrations first: they are dropped (deregistered) before the ring closes.
    recv_fd: AsyncFd<OwnedFd>,
    inner: Mutex<Inner>,
    /// The send ring's fd (a duplicate), registered with the reactor only while a
    /// `poll_send` waits for a free slot ([`Inner::send_wait`]).
    send_fd: OwnedFd,
    /// The runtime the backend was bound in, whose reactor `send_fd` is registered with.
    runtime: tokio::runtime::Handle,
    main: Sock,
    paths: Vec<Sock>,
    ports: Vec<u16>,
    local_addr: SocketAddr,
    zero_copy_min: Option<usize>,
    send_slots: usize,
    send_queue: usize,
    coalesce: bool,
    send_errors: AtomicU64,
    recv_errors: AtomicU64,
    sendmsgs: AtomicU64,
    datagrams_sent: AtomicU64,
    datagrams_lost: AtomicU64,
    recv_exhausted: AtomicU64,
    /// The gather transmit a `poll_send_pieces` returned `Pending` part-way through, and
    /// the bytes of it already sent.
    gather_resume: std::sync::Mutex<Option<(super::udp::ResumeKey, usize)>>,
}

/// Counters of a [`UringBackend`] ([`UringBackend::stats`]), since it was bound.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UringStats {
    /// `io_uring_enter` calls made to submit (sends, receive re-arms).
    pub submits: u64,
    /// `sendmsg` operations queued to the kernel.
    pub sendmsgs: u64,
    /// Datagrams in those `sendmsg`s (> `sendmsgs` when datagrams were joined with GSO).
    pub datagrams_sent: u64,
    /// `sendmsg`s whose completion reported an error ([`UringBackend::send_errors`]).
    pub send_errors: u64,
    /// Datagrams in the failed `sendmsg`s (lost, as far as the transport knows).
    pub datagrams_lost: u64,
    /// Receive completions that reported an error, or a malformed record
    /// ([`UringBackend::recv_errors`]).
    pub recv_errors: u64,
    /// Times the multishot receive stopped because every provided buffer was held (ENOBUFS;
    /// the kernel drops datagrams meanwhile, once the socket buffer is full); it is
    /// re-armed as soon as a buffer is recycled.
    pub recv_buffers_exhausted: u64,
    /// Times the multishot receive was cancelled and re-armed because another thread than
    /// the one that armed it kept polling for datagrams (see [`UringBackend`]'s
    /// "Threads").
    pub recv_moves: u64,
    /// Whether GSO joining was turned off after an EIO.
    pub gso_off: bool,
}

impl fmt::Debug for UringBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UringBackend")
            .field("local_addr", &self.local_addr)
            .field("source_ports", &self.ports)
            .field("max_gso_segments", &self.max_gso_segments())
            .field("max_gro_segments", &self.max_gro_segments())
            .finish_non_exhaustive()
    }
}

/// Whether `METAROCE_IO_URING` turns io_uring off.
pub(super) fn disabled_by_env() -> bool {
    std::env::var(DISABLE_ENV).is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "0" | "off" | "false" | "no"
        )
    })
}

impl UringBackend {
    /// Binds like [`UdpBackend::bind`](super::UdpBackend::bind) (main socket at `addr`,
    /// `paths` path sockets) with the default [`UringConfig`].
    ///
    /// Errors: [`io::ErrorKind::Unsupported`] when io_uring cannot be used (message says
    /// why; see the module docs), or the errors of `UdpBackend::bind`.
    pub fn bind(addr: SocketAddr, paths: usize) -> io::Result<Self> {
        Self::bind_with(addr, paths, &UringConfig::default())
    }

    /// [`bind`](Self::bind) with explicit options.
    pub fn bind_with(addr: SocketAddr, paths: usize, config: &UringConfig) -> io::Result<Self> {
        if config.disabled || disabled_by_env() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!(
                    "io_uring unavailable: turned off (UringConfig::disabled or {DISABLE_ENV}=0)"
                ),
            ));
        }
        if paths == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a UringBackend needs at least one path socket",
            ));
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(io::Error::other(
                "UringBackend must be bound from within a tokio runtime",
            ));
        }
        if config.send_slots == 0 || config.send_queue == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "UringConfig::send_slots and send_queue must be at least 1",
            ));
        }
        // Two rings: completions of sends (one per sendmsg, most of them posted during the
        // driver's own flush) must not wake the task waiting for receives; each ring's fd
        // is registered with the reactor on its own. (The send ring's buffer ring is a
        // placeholder of one small buffer, never used.)
        let ring = Ring::new(config.sq_entries.max(8), config.recv_buffers, 1 << 16, 0)?;
        let tx = Ring::new(config.sq_entries.max(8), 1, 0, config.send_slots)?;
        let main = Sock::bind(
            addr,
            Some(config.udp.recv_buffer_bytes),
            config.udp.send_buffer_bytes,
        )?;
        let local_addr = main.socket.local_addr()?;
        let mut path_addr = addr;
        path_addr.set_port(0);
        // Path sockets only send; datagrams sent to them are never read and are dropped by
        // the kernel once their (small) receive buffer is full.
        let paths = (0..paths)
            .map(|_| Sock::bind(path_addr, Some(4096), config.udp.send_buffer_bytes))
            .collect::<io::Result<Vec<_>>>()?;
        let ports = paths.iter().map(|p| p.port).collect();
        // The multishot receive is armed by the first `poll_recv`, not here: io_uring runs
        // a request's completion work on the thread that submitted it, and `bind` often
        // runs on a thread that then sleeps (a `block_on` caller), which would have to be
        // woken for every received datagram. The driver task's worker thread is awake.
        // (Multishot recvmsg came with IORING_OP_SEND_ZC in 6.0, checked by `Ring::new`.)
        let recv_fd = ring.reactor_fd()?;
        // The send ring's fd stays out of the reactor: its completions are posted during
        // the submitting `io_uring_enter` itself, and were it registered, each batch's
        // completions would wake a worker parked in `epoll_wait` for nothing. A sender
        // that has to wait for a free slot registers it for that wait only.
        let send_fd = tx.dup_fd()?;
        tracing::debug!(%local_addr, ?ports, zc = tx.zc_supported(), "UringBackend bound");
        let backend = Self {
            recv_fd,
            send_fd,
            runtime: tokio::runtime::Handle::current(),
            inner: Mutex::new(Inner {
                send_wait: None,
                ring,
                tx,
                queue: std::collections::VecDeque::with_capacity(config.send_queue),
                next_seq: 0,
                gso_off: false,
                ready: Default::default(),
                starved: false,
                error: None,
            }),
            main,
            paths,
            ports,
            local_addr,
            zero_copy_min: config.zero_copy_min_bytes,
            send_slots: config.send_slots,
            send_queue: config.send_queue,
            coalesce: config.coalesce,
            send_errors: AtomicU64::new(0),
            recv_errors: AtomicU64::new(0),
            sendmsgs: AtomicU64::new(0),
            datagrams_sent: AtomicU64::new(0),
            datagrams_lost: AtomicU64::new(0),
            recv_exhausted: AtomicU64::new(0),
            gather_resume: std::sync::Mutex::new(None),
        };
        Ok(backend)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The receive buffer the kernel granted the main socket, in bytes (as Linux reports it:
    /// twice the usable payload space).
    pub fn recv_buffer_bytes(&self) -> io::Result<usize> {
        self.main
            .state
            .recv_buffer_size(UdpSockRef::from(&self.main.socket))
    }

    /// The send buffer the kernel granted the path sockets, in bytes (the smallest of them).
    pub fn send_buffer_bytes(&self) -> io::Result<usize> {
        let mut min = usize::MAX;
        for p in &self.paths {
            min = min.min(p.state.send_buffer_size(UdpSockRef::from(&p.socket))?);
        }
        Ok(min)
    }

    /// Whether the kernel offers `IORING_OP_SENDMSG_ZC` (used for batches of at least
    /// [`UringConfig::zero_copy_min_bytes`]).
    pub fn zero_copy_supported(&self) -> bool {
        self.lock().tx.zc_supported()
    }

    /// Sends whose completion reported an error (each a lost packet to the transport).
    pub fn send_errors(&self) -> u64 {
        self.send_errors.load(Ordering::Relaxed)
    }

    /// Receive completions that reported an error (the receive was re-armed).
    pub fn recv_errors(&self) -> u64 {
        self.recv_errors.load(Ordering::Relaxed)
    }

    /// The backend's counters.
    pub fn stats(&self) -> UringStats {
        let inner = self.lock();
        UringStats {
            submits: inner.ring.submits() + inner.tx.submits(),
            sendmsgs: self.sendmsgs.load(Ordering::Relaxed),
            datagrams_sent: self.datagrams_sent.load(Ordering::Relaxed),
            send_errors: self.send_errors.load(Ordering::Relaxed),
            datagrams_lost: self.datagrams_lost.load(Ordering::Relaxed),
            recv_errors: self.recv_errors.load(Ordering::Relaxed),
            recv_buffers_exhausted: self.recv_exhausted.load(Ordering::Relaxed),
            recv_moves: inner.ring.recv_moves(),
            gso_off: inner.gso_off,
        }
    }

    /// Takes the completions of both rings (receive completions are kept for `deliver`).
    /// Does not re-arm the receive: that is [`rearm_recv`](Self::rearm_recv)'s, called
    /// from the receive side only.
    fn reap(&self, inner: &mut Inner) {
        let Inner {
            ring,
            tx,
            ready,
            starved,
            error,
            gso_off,
            ..
        } = inner;
        let mut on = |d| match d {
            Done::Recv { bid, len } => ready.push_back((bid, len)),
            Done::RecvError(errno) => {
                if errno == libc::ENOBUFS {
                    self.recv_exhausted.fetch_add(1, Ordering::Relaxed);
                    *starved = true;
                } else if errno != libc::ECANCELED {
                    tracing::debug!(errno, "io_uring multishot recvmsg failed");
                    self.recv_errors.fetch_add(1, Ordering::Relaxed);
                    *error = Some(errno);
                }
            }
            Done::SendError {
                errno,
                gso,
                datagrams,
            } => {
                tracing::debug!(errno, gso, datagrams, "io_uring sendmsg failed");
                self.send_errors.fetch_add(1, Ordering::Relaxed);
                self.datagrams_lost
                    .fetch_add(datagrams as u64, Ordering::Relaxed);
                if gso && errno == libc::EIO && !*gso_off {
                    // As quinn-udp does: EIO from a UDP_SEGMENT send means the device
                    // cannot segment; send datagrams one by one from now on.
                    tracing::warn!("UDP GSO refused (EIO): joining datagrams turned off");
                    *gso_off = true;
                }
            }
        };
        ring.reap(&mut on);
        tx.reap(&mut on);
    }

    /// Re-arms the multishot receive when the kernel ended it (an error, ENOBUFS once
    /// buffers are back, or a move to the polling thread), unless receive completions
    /// still hold every buffer.
    ///
    /// Only the receive side calls this (`poll_recv`, `poll_recv_in_place`): the kernel
    /// completes the receive in task work of the thread that armed it, so a sender that
    /// re-armed it (reaping in `flush` or `poll_send`, on an application task's thread,
    /// say) would make that thread wake for every received datagram.
    ///
    /// A receive queued but not submitted (`io_uring_enter` failed) is submitted again at
    /// every call, and the failure is reported as a receive error: once the receive was
    /// marked armed nothing else submitted it, and the backend never received again
    /// without a word (found by review, with a seccomp filter refusing `io_uring_enter`).
    fn rearm_recv(&self, inner: &mut Inner) {
        let Inner {
            ring,
            ready,
            starved,
            error,
            ..
        } = inner;
        if !ring.recv_armed() && (!*starved || ready.is_empty()) {
            *starved = false;
            let _ = ring.arm_recv(self.main.socket.as_raw_fd());
        }
        if let Err(e) = ring.submit() {
            error.get_or_insert(e.raw_os_error().unwrap_or(libc::EIO));
        }
    }

    /// Hands up to `max` received completions to `f` (metadata, payload in the provided
    /// buffer), recycling each buffer after `f` returns; returns how many.
    fn deliver(&self, inner: &mut Inner, max: usize, f: &mut dyn FnMut(&RecvMeta, &[u8])) -> usize {
        let mut filled = 0;
        while filled < max {
            let Some((bid, len)) = inner.ready.pop_front() else {
                break;
            };
            let ok = {
                let raw = inner.ring.recv_buf(bid, len);
                match parse_recv(raw, inner.ring.recv_hdr()) {
                    Some((m, payload)) => {
                        f(&m, payload);
                        true
                    }
                    None => false,
                }
            };
            inner.ring.recycle(bid);
            if ok {
                filled += 1;
            } else {
                self.recv_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        if filled > 0 && !inner.ring.recv_armed() {
            // Buffers came back: a receive stopped by ENOBUFS can resume.
            self.reap(inner);
            self.rearm_recv(inner);
        }
        filled
    }

    /// The receive loop shared by `poll_recv` (copying) and `poll_recv_in_place`.
    fn poll_recv_with(
        &self,
        cx: &mut Context<'_>,
        max: usize,
        f: &mut dyn FnMut(&RecvMeta, &[u8]),
    ) -> Poll<io::Result<usize>> {
        if max == 0 {
            return Poll::Ready(Ok(0));
        }
        loop {
            {
                let mut inner = self.lock();
                inner.ring.follow_poller();
                // Sends queued by callers that never flush go out before we wait (and those
                // left queued for want of a slot, once completions free slots).
                self.reap(&mut inner);
                self.rearm_recv(&mut inner);
                self.drain_queue(&mut inner);
                let _ = inner.tx.submit();
                let n = self.deliver(&mut inner, max, f);
                if n > 0 {
                    return Poll::Ready(Ok(n));
                }
                // A failed receive is reported (as the UDP backend reports a failed
                // recvmsg) instead of re-arming in a loop here; the next call re-arms.
                if let Some(errno) = inner.error.take() {
                    return Poll::Ready(Err(io::Error::from_raw_os_error(errno)));
                }
            }
            // Nothing yet: wait for the completion queue's fd. After clearing the
            // readiness the loop reaps once more, so a completion posted in between is
            // never missed; the next poll registers the waker.
            let mut guard = ready!(self.recv_fd.poll_read_ready(cx))?;
            guard.clear_ready();
        }
    }
}

/// Parses one provided buffer (`io_uring_recvmsg_out`, name, control, payload): the
/// metadata and the payload. `None` for a malformed or truncated record (counted by the
/// caller).
fn parse_recv<'a>(raw: &'a [u8], hdr: &libc::msghdr) -> Option<(RecvMeta, &'a [u8])> {
    let msg = io_uring::types::RecvMsgOut::parse(raw, hdr).ok()?;
    // Truncated in any part, the record is dropped: a cut payload's last datagram lost its
    // tail, and cut control messages may have lost the `UDP_GRO` segment size, which would
    // make a GRO batch pass for one datagram. (With 64 KiB of payload room and 256 bytes
    // of control room neither happens today; the parser does not rely on it.)
    if msg.is_name_data_truncated() || msg.is_payload_truncated() || msg.is_control_data_truncated()
    {
        return None;
    }
    let from = parse_sockaddr(msg.name_data())?;
    // The payload follows the header and the name and control areas of the sizes the
    // receive was armed with (`hdr` holds NAME_LEN and CONTROL_LEN) (`payload_data` borrows `msg`; this slice borrows `raw`).
    let off = (16 + ring::NAME_LEN as usize + ring::CONTROL_LEN as usize).min(raw.len());
    let len = msg.payload_data().len().min(raw.len() - off);
    let payload = &raw[off..off + len];
    let mut m = RecvMeta {
        from,
        local_ip: None,
        ecn: None,
        len,
        stride: len,
    };
    for (level, ty, data) in cmsgs(msg.control_data()) {
        match (level, ty) {
            (libc::IPPROTO_IP, libc::IP_TOS) | (libc::IPPROTO_IP, libc::IP_RECVTOS) => {
                if let Some(&b) = data.first() {
                    m.ecn = metaroce::EcnCodepoint::from_bits(b & 0b11);
                }
            }
            (libc::IPPROTO_IPV6, libc::IPV6_TCLASS) => {
                if let Some(b) = data.get(..4) {
                    let v = i32::from_ne_bytes(b.try_into().unwrap_or([0; 4]));
                    m.ecn = metaroce::EcnCodepoint::from_bits((v & 0b11) as u8);
                }
            }
            (libc::IPPROTO_IP, libc::IP_PKTINFO) => {
                // struct in_pktinfo { int ipi_ifindex; in_addr ipi_spec_dst; in_addr ipi_addr; }
                if let Some(a) = data.get(8..12) {
                    m.local_ip = Some(IpAddr::V4(Ipv4Addr::new(a[0], a[1], a[2], a[3])));
                }
            }
            (libc::IPPROTO_IPV6, libc::IPV6_PKTINFO) => {
                if let Some(a) = data.get(..16) {
                    let a: [u8; 16] = a.try_into().unwrap_or([0; 16]);
                    m.local_ip = Some(IpAddr::V6(Ipv6Addr::from(a)));
                }
            }
            (libc::SOL_UDP, libc::UDP_GRO) => {
                if let Some(b) = data.get(..4) {
                    let s = i32::from_ne_bytes(b.try_into().unwrap_or([0; 4]));
                    if s > 0 {
                        m.stride = (s as usize).min(len.max(1));
                    }
                }
            }
            _ => {}
        }
    }
    if m.stride == 0 {
        m.stride = len;
    }
    Some((m, payload))
}

/// A `sockaddr_in` / `sockaddr_in6` as the kernel wrote it.
fn parse_sockaddr(b: &[u8]) -> Option<SocketAddr> {
    let family = u16::from_ne_bytes(b.get(..2)?.try_into().ok()?);
    let port = u16::from_be_bytes(b.get(2..4)?.try_into().ok()?);
    match i32::from(family) {
        libc::AF_INET => {
            let a: [u8; 4] = b.get(4..8)?.try_into().ok()?;
            Some(SocketAddr::new(IpAddr::V4(Ipv4Addr::from(a)), port))
        }
        libc::AF_INET6 => {
            let a: [u8; 16] = b.get(8..24)?.try_into().ok()?;
            // As quinn-udp reports it (a v4-mapped source stays an IPv6 address), so both
            // backends name a peer the same way.
            Some(SocketAddr::new(IpAddr::V6(Ipv6Addr::from(a)), port))
        }
        _ => None,
    }
}

/// `cmsghdr` header length and alignment on Linux (`size_t cmsg_len; int level; int type`).
const CMSG_HDR: usize = std::mem::size_of::<libc::cmsghdr>();
const CMSG_ALIGN: usize = std::mem::size_of::<usize>();

fn cmsg_align(n: usize) -> usize {
    (n + CMSG_ALIGN - 1) & !(CMSG_ALIGN - 1)
}

/// Iterates over the control messages of a buffer: `(level, type, data)`; stops at the
/// first malformed header.
fn cmsgs(mut b: &[u8]) -> impl Iterator<Item = (i32, i32, &[u8])> {
    std::iter::from_fn(move || {
        if b.len() < CMSG_HDR {
            return None;
        }
        let len = usize::from_ne_bytes(b[..CMSG_ALIGN].try_into().ok()?);
        let level = i32::from_ne_bytes(b[CMSG_ALIGN..CMSG_ALIGN + 4].try_into().ok()?);
        let ty = i32::from_ne_bytes(b[CMSG_ALIGN + 4..CMSG_ALIGN + 8].try_into().ok()?);
        if len < CMSG_HDR || len > b.len() {
            return None;
        }
        let data = &b[CMSG_HDR..len];
        b = &b[cmsg_align(len).min(b.len())..];
        Some((level, ty, data))
    })
}

/// Control messages of one send, built on the stack (no allocation per send). Also the
/// UDP backend's gather send's (`udp::gather`).
pub(crate) struct Control {
    buf: [u8; 64],
    len: usize,
}

impl Control {
    /// Appends one control message (header, data, padding to the cmsg alignment).
    fn push(&mut self, level: i32, ty: i32, data: &[u8]) {
        let len = CMSG_HDR + data.len();
        let space = cmsg_align(len);
        let Some(out) = self.buf.get_mut(self.len..self.len + space) else {
            return;
        };
        out.fill(0);
        out[..CMSG_ALIGN].copy_from_slice(&len.to_ne_bytes());
        out[CMSG_ALIGN..CMSG_ALIGN + 4].copy_from_slice(&level.to_ne_bytes());
        out[CMSG_ALIGN + 4..CMSG_HDR].copy_from_slice(&ty.to_ne_bytes());
        out[CMSG_HDR..len].copy_from_slice(data);
        self.len += space;
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

/// Control messages of one send: ECN (`IP_TOS` / `IPV6_TCLASS`) and GSO (`UDP_SEGMENT`).
/// An IPv4-mapped destination leaves a dual-stack socket through the IPv4 stack, which
/// ignores `IPV6_TCLASS`: it gets `IP_TOS`, as quinn-udp gives it (found by review: such
/// sends left Not-ECT).
pub(crate) fn send_control(
    dest: SocketAddr,
    ecn: Option<metaroce::EcnCodepoint>,
    segment: Option<u16>,
) -> Control {
    let mut c = Control {
        buf: [0; 64],
        len: 0,
    };
    if let Some(e) = ecn {
        let v = i32::from(e.bits());
        let v4 = match dest {
            SocketAddr::V4(_) => true,
            SocketAddr::V6(a) => a.ip().to_ipv4_mapped().is_some(),
        };
        if v4 {
            c.push(libc::IPPROTO_IP, libc::IP_TOS, &v.to_ne_bytes());
        } else {
            c.push(libc::IPPROTO_IPV6, libc::IPV6_TCLASS, &v.to_ne_bytes());
        }
    }
    if let Some(s) = segment {
        c.push(libc::SOL_UDP, libc::UDP_SEGMENT, &s.to_ne_bytes());
    }
    c
}

impl DatagramBackend for UringBackend {
    fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    fn source_ports(&self) -> Vec<u16> {
        self.ports.clone()
    }

    /// As [`UdpBackend`](super::UdpBackend): the kernel's GSO limit, the lowest over the
    /// path sockets.
    fn max_gso_segments(&self) -> usize {
        super::udp::lowest_gso_segments(self.paths.iter().map(|p| &p.state)).min(MAX_GSO_SEGMENTS)
    }

    fn max_gro_segments(&self) -> usize {
        self.main.state.gro_segments().max(1)
    }

    /// The main socket's `SO_RCVBUF` ([`UringBackend::recv_buffer_bytes`]).
    fn socket_recv_buffer(&self) -> Option<u64> {
        self.recv_buffer_bytes().ok().map(|b| b as u64)
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let max = bufs.len().min(meta.len());
        let mut i = 0;
        self.poll_recv_with(cx, max, &mut |m, payload| {
            let out = &mut bufs[i];
            let len = payload.len().min(out.len());
            out[..len].copy_from_slice(&payload[..len]);
            meta[i] = RecvMeta {
                len,
                stride: m.stride.min(len.max(1)),
                ..*m
            };
            i += 1;
        })
    }

    /// Lends the provided buffers: no copy into the caller's buffers.
    fn poll_recv_in_place(
        &self,
        cx: &mut Context<'_>,
        max: usize,
        f: &mut dyn FnMut(&RecvMeta, &[u8]),
    ) -> Option<Poll<io::Result<usize>>> {
        Some(self.poll_recv_with(cx, max, f))
    }

    /// Copies `contents` into a spare buffer and queues it (see [`UringConfig::send_queue`]).
    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        transmit: &metaroce::Transmit,
        contents: &[u8],
    ) -> Poll<io::Result<()>> {
        self.poll_send_impl(cx, transmit, Src::Borrowed(contents))
    }

    /// Queues the caller's buffer itself and hands back a spare one: no copy.
    fn poll_send_owned(
        &self,
        cx: &mut Context<'_>,
        transmit: &metaroce::Transmit,
        buf: &mut Vec<u8>,
    ) -> Poll<io::Result<()>> {
        if buf.len() < transmit.size {
            return Poll::Ready(Err(super::short_buffer(transmit.size, buf.len())));
        }
        self.poll_send_impl(cx, transmit, Src::Owned(buf))
    }

    fn flush(&self) {
        let mut inner = self.lock();
        self.reap(&mut inner);
        self.drain_queue(&mut inner);
        if let Err(e) = inner.tx.submit() {
            tracing::debug!(error = %e, "io_uring submit failed");
        }
    }

    /// Gather send, unless zero-copy sends are configured (those go through the ring).
    fn sends_gathered(&self) -> bool {
        cfg!(target_os = "linux") && self.zero_copy_min.is_none()
    }

    /// A transmit in pieces (payloads still in their memory region, readable only during
    /// this call) cannot wait in the send ring: each GSO batch is one `sendmsg` system call
    /// with the pieces as its I/O vector, after the queued sends are handed to the kernel
    /// (so it does not pass them). What cannot go now (`EAGAIN`, a refused batch) is joined
    /// and queued as `poll_send` queues it. A single piece is `poll_send`.
    fn poll_send_pieces(
        &self,
        cx: &mut Context<'_>,
        transmit: &metaroce::Transmit,
        pieces: &[&[u8]],
    ) -> Poll<io::Result<()>> {
        let plan = super::udp::pieces_plan(self.local_addr, transmit, pieces, |t, b| {
            self.poll_send(cx, t, b)
        });
        let (total, segment) = match plan {
            Ok(direct) => direct,
            Err(joined) => return joined,
        };
        let Some(path) = self.paths.iter().find(|p| p.port == transmit.src_port) else {
            return Poll::Ready(Err(unknown_src_port(transmit.src_port, &self.ports)));
        };
        let mut offset = {
            let mut r = self.gather_resume.lock().unwrap_or_else(|e| e.into_inner());
            match r.take() {
                Some((key, at)) if key == super::udp::ResumeKey::of_pieces(transmit, pieces) => at,
                _ => 0,
            }
        };
        if offset == 0 {
            self.flush();
        }
        let max_segments = path.state.max_gso_segments().clamp(1, MAX_GSO_SEGMENTS);
        while offset < total {
            let chunk = super::udp::chunk_len(max_segments, total - offset, segment);
            let gso = (chunk > segment).then_some(segment);
            match super::udp::gather::send(&path.socket, transmit, pieces, offset, chunk, gso) {
                Ok(()) => {
                    offset += chunk;
                    self.sendmsgs.fetch_add(1, Ordering::Relaxed);
                    self.datagrams_sent
                        .fetch_add(chunk.div_ceil(segment) as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    if e.kind() != io::ErrorKind::WouldBlock {
                        tracing::debug!("gather send failed ({e}); queueing the rest joined");
                    }
                    let rest = pieces.concat();
                    let rest = &rest[offset..];
                    let t = metaroce::Transmit {
                        size: rest.len(),
                        ..*transmit
                    };
                    let r = self.poll_send(cx, &t, rest);
                    if r.is_pending() {
                        let key = super::udp::ResumeKey::of_pieces(transmit, pieces);
                        *self.gather_resume.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some((key, offset));
                    }
                    return r;
                }
            }
        }
        Poll::Ready(Ok(()))
    }
}

/// Where a transmit's bytes come from.
enum Src<'a> {
    /// Copied into a spare buffer.
    Borrowed(&'a [u8]),
    /// Taken (swapped for a spare buffer).
    Owned(&'a mut Vec<u8>),
}

impl UringBackend {
    fn poll_send_impl(
        &self,
        cx: &mut Context<'_>,
        transmit: &metaroce::Transmit,
        mut src: Src<'_>,
    ) -> Poll<io::Result<()>> {
        let contents: &[u8] = match &src {
            Src::Borrowed(c) => c,
            Src::Owned(b) => &b[..transmit.size],
        };
        let len = contents.len();
        let segment = match check_transmit(transmit, contents) {
            Ok(s) => s,
            Err(e) => return Poll::Ready(Err(e)),
        };
        let Some(path) = self.paths.iter().position(|p| p.port == transmit.src_port) else {
            return Poll::Ready(Err(unknown_src_port(transmit.src_port, &self.ports)));
        };
        // A caller-segmented transmit larger than one GSO send is cut into several queue
        // entries (copied); a single datagram, or a batch that fits, is one entry.
        let max_segments = self.paths[path]
            .state
            .max_gso_segments()
            .clamp(1, MAX_GSO_SEGMENTS);
        let single = transmit.segment_size.is_none() || len <= segment;
        // (`segment` is 0 only for a zero-length single datagram.)
        let per_call = if single || segment >= MAX_UDP_PAYLOAD || max_segments <= 1 {
            1
        } else {
            max_segments.min(MAX_UDP_PAYLOAD / segment).max(1)
        };
        let chunk_bytes = (per_call * segment).max(1);
        let entries = if single {
            1
        } else {
            len.div_ceil(chunk_bytes).max(1)
        };
        if entries > self.send_slots.min(self.send_queue).max(1) && !single {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "transmit of {len} bytes needs {entries} sends; the backend has {} send \
                     slots and a send queue of {}",
                    self.send_slots, self.send_queue
                ),
            )));
        }
        // Room for `entries` more: the queue stays within `send_queue` and within the free
        // slots (each queued entry could need a slot of its own), so that `flush` can
        // always hand the whole queue to the kernel without waiting.
        let fits = |inner: &Inner| {
            let queued = inner.queue.len() + entries;
            queued <= self.send_queue && queued <= inner.tx.free_slots()
        };
        loop {
            let mut inner = self.lock();
            if !fits(&inner) {
                self.reap(&mut inner);
                if !fits(&inner) {
                    self.drain_queue(&mut inner);
                    if let Err(e) = inner.tx.submit() {
                        return Poll::Ready(Err(e));
                    }
                    self.reap(&mut inner);
                }
            }
            if fits(&inner) {
                // A wait for a slot is over: completions no longer need to wake anyone.
                inner.send_wait = None;
                let dest = transmit.destination;
                let ecn = transmit.ecn;
                match &mut src {
                    Src::Owned(buf) if single => {
                        let spare = inner.tx.take_spare().unwrap_or_default();
                        let mut data = std::mem::replace(*buf, spare);
                        data.truncate(len);
                        let seg = (len > segment).then_some(segment as u16);
                        self.enqueue(&mut inner, path, dest, ecn, seg, QData::Own(data));
                    }
                    Src::Owned(buf) => {
                        // Larger than one sendmsg: the chunks' sends share the buffer.
                        let spare = inner.tx.take_spare().unwrap_or_default();
                        let mut data = std::mem::replace(*buf, spare);
                        data.truncate(len);
                        let id = inner.tx.share(data, entries);
                        for start in (0..len).step_by(chunk_bytes) {
                            let end = (start + chunk_bytes).min(len);
                            let seg = (end - start > segment).then_some(segment as u16);
                            let range = start..end;
                            self.enqueue(
                                &mut inner,
                                path,
                                dest,
                                ecn,
                                seg,
                                QData::Shared { id, range },
                            );
                        }
                    }
                    _ => {
                        let contents: &[u8] = match &src {
                            Src::Borrowed(c) => c,
                            Src::Owned(b) => &b[..transmit.size],
                        };
                        if single {
                            let seg = (contents.len() > segment).then_some(segment as u16);
                            let data = copy_into(inner.tx.take_spare(), contents);
                            self.enqueue(&mut inner, path, dest, ecn, seg, QData::Own(data));
                        } else {
                            for chunk in contents.chunks(chunk_bytes) {
                                let seg = (chunk.len() > segment).then_some(segment as u16);
                                let data = copy_into(inner.tx.take_spare(), chunk);
                                self.enqueue(&mut inner, path, dest, ecn, seg, QData::Own(data));
                            }
                        }
                    }
                }
                if inner.queue.len() >= self.send_queue.min(inner.tx.free_slots()) {
                    // A full queue goes to the kernel now rather than at the next flush.
                    self.drain_queue(&mut inner);
                    if let Err(e) = inner.tx.submit() {
                        tracing::debug!(error = %e, "io_uring submit failed");
                    }
                }
                return Poll::Ready(Ok(()));
            }
            // The queue is full and every slot is in flight: wait for completions, through
            // the send ring's fd, registered for this wait (registering reports the
            // completions already posted, so none is missed).
            if inner.send_wait.is_none() {
                let _rt = self.runtime.enter();
                inner.send_wait = Some(ring::register_readable(self.send_fd.try_clone()?)?);
            }
            let Some(wait) = &inner.send_wait else {
                continue;
            };
            let mut guard = ready!(wait.poll_read_ready(cx))?;
            guard.clear_ready();
        }
    }

    fn enqueue(
        &self,
        inner: &mut Inner,
        path: usize,
        dest: SocketAddr,
        ecn: Option<metaroce::EcnCodepoint>,
        segment: Option<u16>,
        data: QData,
    ) {
        let seq = inner.next_seq;
        inner.next_seq += 1;
        inner.queue.push_back(Queued {
            path,
            seq,
            dest,
            ecn,
            segment,
            data,
        });
    }

    /// Turns queued datagrams into `sendmsg` SQEs while slots are free: the queue is sorted
    /// by path socket and destination (the datagrams of each pair keep their order), and
    /// each run of datagrams
    /// to one destination with one ECN codepoint and one size (the last may be shorter), at
    /// most 64 and 65 507 bytes, becomes one GSO send. `poll_send` keeps the queue within the
    /// free slots, so everything fits (what would not stays queued). Does not submit.
    fn drain_queue(&self, inner: &mut Inner) {
        if inner.queue.is_empty() {
            return;
        }
        let join = self.coalesce && !inner.gso_off;
        if join && inner.queue.len() > 2 {
            // Unique keys: the unstable sort is deterministic and keeps each (path,
            // destination)'s order, the only order a peer can see.
            inner
                .queue
                .make_contiguous()
                .sort_unstable_by_key(|q| (q.path, q.dest, q.seq));
        }
        while !inner.queue.is_empty() {
            if inner.tx.free_slots() == 0 {
                self.reap(inner);
                if inner.tx.free_slots() == 0 {
                    return;
                }
            }
            let Some(first) = inner.queue.front() else {
                return;
            };
            let path = first.path;
            let dest = first.dest;
            let ecn = first.ecn;
            let size = first.data.len();
            let mut run = 1;
            let mut bytes = size;
            let own = matches!(first.data, QData::Own(_));
            let max_segments = if join && own && first.segment.is_none() && size > 0 {
                self.paths[path]
                    .state
                    .max_gso_segments()
                    .clamp(1, MAX_GSO_SEGMENTS)
                    .min(ring::MAX_IOVS)
            } else {
                1
            };
            for q in inner.queue.iter().skip(1) {
                if run >= max_segments
                    || q.path != path
                    || q.dest != dest
                    || q.ecn != ecn
                    || q.segment.is_some()
                    || !matches!(q.data, QData::Own(_))
                    || q.data.len() == 0
                    || q.data.len() > size
                    || bytes + q.data.len() > MAX_UDP_PAYLOAD
                {
                    break;
                }
                run += 1;
                bytes += q.data.len();
                if q.data.len() < size {
                    break;
                }
            }
            let segment = if run > 1 {
                Some(size as u16)
            } else {
                first.segment
            };
            let datagrams = match first.segment {
                Some(s) if run == 1 => size.div_ceil(usize::from(s).max(1)),
                _ => run,
            };
            let control = send_control(dest, ecn, segment);
            let zc = self.zero_copy_min.is_some_and(|m| bytes >= m);
            let fd = self.paths[path].socket.as_raw_fd();
            let Inner { tx, queue, .. } = &mut *inner;
            let gso = segment.is_some();
            let res = if own {
                let bufs = queue.drain(..run).filter_map(|q| match q.data {
                    QData::Own(v) => Some(v),
                    QData::Shared { .. } => None,
                });
                tx.push_send(fd, dest, control.bytes(), gso, bufs, zc)
            } else {
                match queue.pop_front().map(|q| q.data) {
                    Some(QData::Shared { id, range }) => {
                        tx.push_send_shared(fd, dest, control.bytes(), gso, id, range, zc)
                    }
                    _ => Ok(()),
                }
            };
            if let Err(e) = res {
                // Only a submission failure gets here (the slot was free): the datagrams are
                // lost, as a failed sendmsg's would be.
                tracing::debug!(error = %e, "io_uring send could not be queued");
                self.send_errors.fetch_add(1, Ordering::Relaxed);
                self.datagrams_lost
                    .fetch_add(datagrams as u64, Ordering::Relaxed);
                return;
            }
            self.sendmsgs.fetch_add(1, Ordering::Relaxed);
            self.datagrams_sent
                .fetch_add(datagrams as u64, Ordering::Relaxed);
        }
    }
}

/// `contents` in a buffer: the spare one `spare` if given (its capacity reused), else a new one.
fn copy_into(spare: Option<Vec<u8>>, contents: &[u8]) -> Vec<u8> {
    let mut v = spare.unwrap_or_default();
    v.clear();
    v.extend_from_slice(contents);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_messages_round_trip_through_the_parser() {
        let c = send_control(
            "127.0.0.1:1".parse().unwrap(),
            Some(metaroce::EcnCodepoint::Ce),
            Some(1200),
        );
        let parsed: Vec<(i32, i32, Vec<u8>)> = cmsgs(c.bytes())
            .map(|(l, t, d)| (l, t, d.to_vec()))
            .collect();
        assert_eq!(parsed.len(), 2);
        assert_eq!((parsed[0].0, parsed[0].1), (libc::IPPROTO_IP, libc::IP_TOS));
        assert_eq!(parsed[0].2, 3i32.to_ne_bytes());
        assert_eq!(
            (parsed[1].0, parsed[1].1),
            (libc::SOL_UDP, libc::UDP_SEGMENT)
        );
        assert_eq!(parsed[1].2, 1200u16.to_ne_bytes());
    }

    #[test]
    fn malformed_control_messages_stop_the_parser() {
        // A length shorter than the header, and one past the end: nothing, no panic.
        for len in [0usize, 3, 15, 1000] {
            let mut b = vec![0u8; 32];
            b[..8].copy_from_slice(&len.to_ne_bytes());
            assert_eq!(cmsgs(&b).count(), 0, "cmsg_len {len}");
        }
        assert_eq!(cmsgs(&[]).count(), 0);
    }

    /// A provided buffer as the multishot receive fills it: `io_uring_recvmsg_out`, a
    /// `sockaddr_in` in the name area, `control` in the control area, then `payload`.
    fn record(flags: i32, payloadlen: u32, control: &[u8], payload: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&16u32.to_ne_bytes()); // namelen
        b.extend_from_slice(&(control.len() as u32).to_ne_bytes()); // controllen
        b.extend_from_slice(&payloadlen.to_ne_bytes());
        b.extend_from_slice(&(flags as u32).to_ne_bytes());
        let mut name = [0u8; ring::NAME_LEN as usize];
        name[..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
        name[2..4].copy_from_slice(&4791u16.to_be_bytes());
        name[4..8].copy_from_slice(&[10, 0, 0, 1]);
        b.extend_from_slice(&name);
        let mut ctl = [0u8; ring::CONTROL_LEN as usize];
        ctl[..control.len()].copy_from_slice(control);
        b.extend_from_slice(&ctl);
        b.extend_from_slice(payload);
        b
    }

    fn recv_hdr() -> libc::msghdr {
        libc::msghdr {
            msg_name: std::ptr::null_mut(),
            msg_namelen: ring::NAME_LEN,
            msg_iov: std::ptr::null_mut(),
            msg_iovlen: 0,
            msg_control: std::ptr::null_mut(),
            msg_controllen: ring::CONTROL_LEN as _,
            msg_flags: 0,
        }
    }

    fn gro_cmsg(stride: i32) -> Vec<u8> {
        let mut c = vec![0u8; cmsg_align(CMSG_HDR + 4)];
        c[..CMSG_ALIGN].copy_from_slice(&(CMSG_HDR + 4).to_ne_bytes());
        c[CMSG_ALIGN..CMSG_ALIGN + 4].copy_from_slice(&libc::SOL_UDP.to_ne_bytes());
        c[CMSG_ALIGN + 4..CMSG_HDR].copy_from_slice(&libc::UDP_GRO.to_ne_bytes());
        c[CMSG_HDR..CMSG_HDR + 4].copy_from_slice(&stride.to_ne_bytes());
        c
    }

    /// A record the kernel flagged truncated is never handed on as if whole: with
    /// `MSG_TRUNC` its last datagram lost its tail; with `MSG_CTRUNC` the `UDP_GRO` segment
    /// size may be the control message that was cut, and a GRO batch would then pass for
    /// one datagram (the concatenation of several). Both are dropped and counted, as the
    /// parser's documentation says; an intact record still parses, split at its stride.
    #[test]
    fn records_flagged_truncated_are_rejected() {
        let hdr = recv_hdr();
        let payload: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
        let gro = gro_cmsg(1000);
        let intact = record(0, 3000, &gro, &payload);
        let (m, p) = parse_recv(&intact, &hdr).expect("intact");
        assert_eq!((m.len, m.stride, p.len()), (3000, 1000, 3000));
        assert_eq!(m.from, "10.0.0.1:4791".parse().unwrap());
        // The kernel says 70 000 bytes came, 3000 fit.
        let cut = record(libc::MSG_TRUNC, 70_000, &gro, &payload);
        assert!(
            parse_recv(&cut, &hdr).is_none(),
            "a payload flagged MSG_TRUNC was parsed as whole: {:?}",
            parse_recv(&cut, &hdr).map(|(m, _)| m)
        );
        // Control messages cut: no segment size survived, three datagrams read as one.
        let ctrunc = record(libc::MSG_CTRUNC, 3000, &[], &payload);
        assert!(
            parse_recv(&ctrunc, &hdr).is_none(),
            "a record flagged MSG_CTRUNC was parsed: {:?}",
            parse_recv(&ctrunc, &hdr).map(|(m, _)| m)
        );
    }

    #[test]
    fn short_or_foreign_addresses_are_rejected() {
        assert_eq!(parse_sockaddr(&[]), None);
        assert_eq!(parse_sockaddr(&[2, 0, 1]), None);
        let mut v4 = [0u8; 16];
        v4[..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
        v4[2..4].copy_from_slice(&4791u16.to_be_bytes());
        v4[4..8].copy_from_slice(&[10, 0, 0, 1]);
        assert_eq!(parse_sockaddr(&v4), Some("10.0.0.1:4791".parse().unwrap()));
        v4[..2].copy_from_slice(&1u16.to_ne_bytes());
        assert_eq!(parse_sockaddr(&v4), None);
    }
}
