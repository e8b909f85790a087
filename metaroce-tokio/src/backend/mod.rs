//! Datagram backends: the sockets an endpoint's driver task sends and receives through.
//!
//! A metaroce endpoint sprays the packets of a connection over several *paths*, each path
//! being a distinct local UDP **source port** (the ECMP entropy a switch hashes on). A
//! backend therefore owns:
//!
//! * one main socket, bound at [`DatagramBackend::local_addr`]: the address peers send to,
//!   where all receiving happens;
//! * N path sockets on the same IP with their own ports ([`DatagramBackend::source_ports`]),
//!   used only to send: [`metaroce::Transmit::src_port`] names which one.
//!
//! Two implementations live here:
//!
//! * [`UdpBackend`]: real UDP sockets with the Linux offloads (GSO via `UDP_SEGMENT`, GRO via
//!   `UDP_GRO`), ECN in both directions (`IP_TOS` / `IP_RECVTOS`) and the local destination
//!   IP (`IP_PKTINFO`), through `quinn-udp`.
//! * [`Impaired`]: a wrapper around any backend that drops, duplicates, reorders, delays,
//!   corrupts, CE-marks and rate-limits outgoing datagrams, deterministically from a seed.

use std::io::{self, IoSliceMut};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::task::{Context, Poll};

mod impair;
#[cfg(target_os = "linux")]
pub(crate) mod reuseport;
mod udp;
#[cfg(target_os = "linux")]
mod uring;

pub use impair::{GilbertElliott, ImpairError, ImpairStats, Impaired, Impairment};
pub use udp::{UdpBackend, UdpConfig};
#[cfg(target_os = "linux")]
pub use uring::{UringBackend, UringConfig, UringStats, DISABLE_ENV};

/// Which socket backend [`bind_backend`] should use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// [`UdpBackend`]: readiness-based UDP sockets through `quinn-udp` (the default).
    #[default]
    Udp,
    /// `UringBackend` (Linux): io_uring with multishot `recvmsg`, falling back to
    /// [`UdpBackend`] where io_uring is unavailable, forbidden or turned off.
    Uring,
}

/// What [`bind_backend`] bound.
#[derive(Debug)]
pub struct BoundBackend {
    /// The backend.
    pub backend: Box<dyn DatagramBackend>,
    /// The kind actually bound ([`BackendKind::Udp`] after a fallback).
    pub kind: BackendKind,
    /// Why the requested io_uring backend was not used (the `Unsupported` error's message).
    pub fallback_reason: Option<String>,
}

#[cfg(target_os = "linux")]
/// Binds a backend of kind `kind` at `addr` with `paths` path sockets and the options
/// `config` (its `udp` socket options serve both kinds).
///
/// For [`BackendKind::Uring`], an [`io::ErrorKind::Unsupported`] error of `UringBackend`
/// (no io_uring in the kernel, EPERM from seccomp or `kernel.io_uring_disabled`, a kernel
/// older than 6.0, non-Linux, or `METAROCE_IO_URING=0`) is logged as a warning and a
/// [`UdpBackend`] is bound instead; [`BoundBackend::fallback_reason`] says why. Any other
/// error (bind failure, bad arguments) is returned.
pub fn bind_backend(
    kind: BackendKind,
    addr: SocketAddr,
    paths: usize,
    config: &UringConfig,
) -> io::Result<BoundBackend> {
    let mut fallback_reason = None;
    if kind == BackendKind::Uring {
        {
            match UringBackend::bind_with(addr, paths, config) {
                Ok(b) => {
                    return Ok(BoundBackend {
                        backend: Box::new(b),
                        kind: BackendKind::Uring,
                        fallback_reason: None,
                    })
                }
                Err(e) if e.kind() == io::ErrorKind::Unsupported => {
                    tracing::warn!("{e}; falling back to the UDP backend");
                    fallback_reason = Some(e.to_string());
                }
                Err(e) => return Err(e),
            }
        }
    }
    Ok(BoundBackend {
        backend: Box::new(UdpBackend::bind_with(addr, paths, &config.udp)?),
        kind: BackendKind::Udp,
        fallback_reason,
    })
}

/// Metadata of one received buffer.
///
/// With GRO (Linux `UDP_GRO`) one buffer may hold several datagrams from the same sender
/// with the same ECN codepoint: `len` bytes made of datagrams of `stride` bytes each, the
/// last one possibly shorter. Without GRO, `stride == len`. Use [`RecvMeta::datagrams`] to
/// split a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvMeta {
    /// Source address (IP and UDP port) of the datagram(s).
    pub from: SocketAddr,
    /// Local IP address the datagram(s) were sent to (from `IP_PKTINFO` /
    /// `IPV6_PKTINFO`), when the platform reports it.
    pub local_ip: Option<IpAddr>,
    /// ECN codepoint of the IP header (from `IP_RECVTOS` / `IPV6_RECVTCLASS`); `None` for
    /// Not-ECT or when the platform does not report it.
    pub ecn: Option<metaroce::EcnCodepoint>,
    /// Bytes filled in the buffer.
    pub len: usize,
    /// Bytes per datagram in the buffer (the last may be shorter); equals `len` for a single
    /// datagram.
    pub stride: usize,
}

impl RecvMeta {
    /// An all-zero placeholder (unspecified IPv4 address), to fill a metadata array before
    /// [`DatagramBackend::poll_recv`] overwrites it.
    pub const EMPTY: RecvMeta = RecvMeta {
        from: SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 0),
        local_ip: None,
        ecn: None,
        len: 0,
        stride: 0,
    };

    /// Splits the received buffer `buf` (the one this metadata describes) into its
    /// datagrams: `buf[..len]` cut every `stride` bytes.
    ///
    /// Never panics: `len` is clamped to `buf.len()`, and a zero `stride` yields the whole
    /// (possibly empty) buffer as one datagram.
    pub fn datagrams<'a>(&self, buf: &'a [u8]) -> impl Iterator<Item = &'a [u8]> + 'a {
        let data = &buf[..self.len.min(buf.len())];
        let stride = if self.stride == 0 {
            data.len().max(1)
        } else {
            self.stride
        };
        // `chunks` yields nothing for an empty slice; a zero-length datagram is still one.
        let empty = data.is_empty().then_some(data);
        data.chunks(stride).chain(empty)
    }
}

impl Default for RecvMeta {
    fn default() -> Self {
        Self::EMPTY
    }
}

/// A set of datagram sockets (one receiving address plus the per-path source ports),
/// polled by the endpoint's driver task.
///
/// All methods take `&self`; each direction is meant to be driven by a single task at a
/// time (a second task polling the same direction may steal the first one's wake-up).
pub trait DatagramBackend: Send + Sync + std::fmt::Debug + 'static {
    /// The address peers send to (IP and listening UDP port).
    fn local_addr(&self) -> SocketAddr;

    /// The local UDP source ports of the path sockets, in path order.
    /// [`metaroce::Transmit::src_port`] must be one of them.
    fn source_ports(&self) -> Vec<u16>;

    /// Most datagrams one [`poll_send`](Self::poll_send) hands to the kernel in a single
    /// call (GSO); 1 without GSO. Larger transmits are still accepted and split.
    fn max_gso_segments(&self) -> usize;

    /// Most datagrams one receive buffer may hold (GRO); 1 without GRO. A receive buffer
    /// should be at least `max_gro_segments() ×` the largest datagram, else coalesced data
    /// is truncated by the kernel.
    fn max_gro_segments(&self) -> usize;

    /// Bytes of receive buffer the kernel keeps for the socket every peer sends to (Linux:
    /// `SO_RCVBUF` as `getsockopt` reports it, twice the smaller of what was asked for and
    /// `net.core.rmem_max`), if known. The endpoint gives it to its core as
    /// `TransportConfig::socket_recv_buffer`, which every ACK grants the active senders a
    /// share of (the window grant), so that together they have about as much in flight as
    /// the socket holds. Default `None`: no grant. Wrappers forward it.
    fn socket_recv_buffer(&self) -> Option<u64> {
        None
    }

    /// Receives into up to `min(bufs.len(), meta.len())` buffers; returns how many were
    /// filled, with their metadata in `meta[..n]`. Returns `Ready(Ok(0))` only when given no
    /// buffer or no metadata slot.
    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>>;

    /// Sends one transmit, whose bytes are `contents` (`contents.len() == transmit.size`).
    ///
    /// `Ready(Ok(()))` once handed to the kernel, or queued for the next
    /// [`flush`](Self::flush) by a batching backend (or, for [`Impaired`], once sent inline,
    /// queued for later or dropped; it is `Pending` only when its inner backend is). An `Err` concerns this transmit only (it was not, or not entirely, sent, as
    /// if lost): the backend stays usable. After `Pending`, the next call must be for the
    /// same transmit.
    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        transmit: &metaroce::Transmit,
        contents: &[u8],
    ) -> Poll<io::Result<()>>;

    /// Sends one transmit whose bytes are `buf[..transmit.size]`, like
    /// [`poll_send`](Self::poll_send), but lets the backend keep the buffer instead of
    /// copying it: on `Ready` (`Ok` or `Err`) `buf` may have been swapped for another buffer
    /// (empty, or holding stale bytes the caller overwrites) that the caller reuses for its
    /// next transmit; on `Pending` `buf` is unchanged and the next call must be for the same
    /// transmit. Errors as `poll_send`, plus [`io::ErrorKind::InvalidInput`] when `buf` is
    /// shorter than `transmit.size`.
    ///
    /// The default sends `&buf[..transmit.size]` through `poll_send` (one copy, by the
    /// kernel or the backend). `UringBackend` moves the buffer into the `sendmsg` it queues
    /// and hands back the emptied buffer of an earlier, completed send: no copy in user
    /// space, and no allocation once the buffers circulate.
    fn poll_send_owned(
        &self,
        cx: &mut Context<'_>,
        transmit: &metaroce::Transmit,
        buf: &mut Vec<u8>,
    ) -> Poll<io::Result<()>> {
        match buf.get(..transmit.size) {
            Some(contents) => self.poll_send(cx, transmit, contents),
            None => Poll::Ready(Err(short_buffer(transmit.size, buf.len()))),
        }
    }

    /// Receives like [`poll_recv`](Self::poll_recv), but lends the backend's own buffers
    /// instead of copying into the caller's: `f(meta, bytes)` is called for each of up to
    /// `max` received buffers (`bytes` = `meta.len` bytes, split with
    /// [`RecvMeta::datagrams`]), while the backend holds its own lock, so `f` must not call
    /// into the same backend. Returns how many buffers were handed to `f`.
    ///
    /// `None` when the backend cannot lend (the default): the caller uses `poll_recv`.
    /// `UringBackend` lends its provided buffers (saving one copy per datagram).
    fn poll_recv_in_place(
        &self,
        cx: &mut Context<'_>,
        max: usize,
        f: &mut dyn FnMut(&RecvMeta, &[u8]),
    ) -> Option<Poll<io::Result<usize>>> {
        let _ = (cx, max, f);
        None
    }

    /// Whether this backend sends a transmit from several pieces without joining them
    /// first ([`poll_send_pieces`](Self::poll_send_pieces) with an I/O vector): the driver
    /// then asks the core for gather transmits (`Endpoint::poll_transmit_lent`, issue #13
    /// P1), whose WRITE payloads stay in their memory regions until the
    /// kernel copies them. Default `false`; `UdpBackend` says `true` on Linux. Wrappers
    /// that forward it must forward `poll_send_pieces` too.
    fn sends_gathered(&self) -> bool {
        false
    }

    /// Sends one transmit whose bytes are the concatenation of `pieces` (their lengths add
    /// up to `transmit.size`; a GSO batch's datagrams may span pieces), like
    /// [`poll_send`](Self::poll_send), with the same errors and the same rule after
    /// `Pending` (the next call is for the same transmit, with the same pieces).
    ///
    /// The default joins the pieces into one buffer (an allocation and a copy) and calls
    /// `poll_send`; a backend whose [`sends_gathered`](Self::sends_gathered) is `true`
    /// overrides it.
    fn poll_send_pieces(
        &self,
        cx: &mut Context<'_>,
        transmit: &metaroce::Transmit,
        pieces: &[&[u8]],
    ) -> Poll<io::Result<()>> {
        match pieces {
            [one] => self.poll_send(cx, transmit, one),
            _ => self.poll_send(cx, transmit, &pieces.concat()),
        }
    }

    /// Hands the sends queued by [`poll_send`](Self::poll_send) to the kernel now. Backends
    /// that batch submissions (`UringBackend`) queue sends until this call, until their
    /// queue fills, or until the next [`poll_recv`](Self::poll_recv); the driver calls it
    /// after each batch of transmits. The default does nothing (the send already happened).
    /// Never blocks.
    fn flush(&self) {}

    /// Whether a task other than the driver may call [`poll_send_owned`](Self::poll_send_owned)
    /// (and [`flush`](Self::flush)) cheaply, one at a time: metaroce-tokio's application
    /// tasks then send their messages' packets themselves (`Config::inline_transmit`, issue
    /// #13 P2). Default `true`, and both in-tree backends keep it (`UringBackend` once said
    /// `false`, while a flush from another thread could re-arm its receive there; only the
    /// receive side arms it now). Wrappers forward it.
    fn send_from_any_task(&self) -> bool {
        true
    }
}

/// Implements the named [`DatagramBackend`] methods of a wrapper backend by handing each
/// call, unchanged, to the backend it wraps; the wrapper writes the others itself. For use
/// inside an `impl DatagramBackend for Wrapper` block.
///
/// The first argument, in brackets, is what follows `self` to reach the inner backend: a
/// field (`[.inner]`) or a method call (`[.as_ref()]`). Then the method names, any of
/// `local_addr`, `source_ports`, `max_gso_segments`, `max_gro_segments`,
/// `socket_recv_buffer`, `poll_recv`,
/// `poll_send`, `poll_send_owned`, `poll_recv_in_place`, `flush`, `send_from_any_task`,
/// `sends_gathered`, `poll_send_pieces`. A
/// wrapper that writes its own `poll_send` and does not name `poll_send_owned` gets the
/// trait's default, which calls the wrapper's `poll_send`.
///
/// ```
/// use metaroce_tokio::backend::{DatagramBackend, UdpBackend};
/// use metaroce_tokio::forward_datagram_backend;
///
/// /// A backend that counts the sends it passes on.
/// #[derive(Debug)]
/// struct Counting {
///     inner: UdpBackend,
///     sends: std::sync::atomic::AtomicU64,
/// }
///
/// impl DatagramBackend for Counting {
///     forward_datagram_backend!([.inner] local_addr, source_ports, max_gso_segments,
///         max_gro_segments, socket_recv_buffer, poll_recv, poll_recv_in_place, flush);
///
///     fn poll_send(
///         &self,
///         cx: &mut std::task::Context<'_>,
///         transmit: &metaroce_tokio::metaroce::Transmit,
///         contents: &[u8],
///     ) -> std::task::Poll<std::io::Result<()>> {
///         let res = self.inner.poll_send(cx, transmit, contents);
///         if res.is_ready() {
///             self.sends.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
///         }
///         res
///     }
/// }
/// ```
#[macro_export]
macro_rules! forward_datagram_backend {
    (@one [$($to:tt)+] local_addr) => {
        fn local_addr(&self) -> ::std::net::SocketAddr {
            self $($to)+ .local_addr()
        }
    };
    (@one [$($to:tt)+] source_ports) => {
        fn source_ports(&self) -> ::std::vec::Vec<u16> {
            self $($to)+ .source_ports()
        }
    };
    (@one [$($to:tt)+] max_gso_segments) => {
        fn max_gso_segments(&self) -> usize {
            self $($to)+ .max_gso_segments()
        }
    };
    (@one [$($to:tt)+] max_gro_segments) => {
        fn max_gro_segments(&self) -> usize {
            self $($to)+ .max_gro_segments()
        }
    };
    (@one [$($to:tt)+] socket_recv_buffer) => {
        fn socket_recv_buffer(&self) -> ::std::option::Option<u64> {
            self $($to)+ .socket_recv_buffer()
        }
    };
    (@one [$($to:tt)+] poll_recv) => {
        fn poll_recv(
            &self,
            cx: &mut ::std::task::Context<'_>,
            bufs: &mut [::std::io::IoSliceMut<'_>],
            meta: &mut [$crate::backend::RecvMeta],
        ) -> ::std::task::Poll<::std::io::Result<usize>> {
            self $($to)+ .poll_recv(cx, bufs, meta)
        }
    };
    (@one [$($to:tt)+] poll_send) => {
        fn poll_send(
            &self,
            cx: &mut ::std::task::Context<'_>,
            transmit: &$crate::metaroce::Transmit,
            contents: &[u8],
        ) -> ::std::task::Poll<::std::io::Result<()>> {
            self $($to)+ .poll_send(cx, transmit, contents)
        }
    };
    (@one [$($to:tt)+] poll_send_owned) => {
        fn poll_send_owned(
            &self,
            cx: &mut ::std::task::Context<'_>,
            transmit: &$crate::metaroce::Transmit,
            buf: &mut ::std::vec::Vec<u8>,
        ) -> ::std::task::Poll<::std::io::Result<()>> {
            self $($to)+ .poll_send_owned(cx, transmit, buf)
        }
    };
    (@one [$($to:tt)+] poll_recv_in_place) => {
        fn poll_recv_in_place(
            &self,
            cx: &mut ::std::task::Context<'_>,
            max: usize,
            f: &mut dyn FnMut(&$crate::backend::RecvMeta, &[u8]),
        ) -> ::std::option::Option<::std::task::Poll<::std::io::Result<usize>>> {
            self $($to)+ .poll_recv_in_place(cx, max, f)
        }
    };
    (@one [$($to:tt)+] flush) => {
        fn flush(&self) {
            self $($to)+ .flush()
        }
    };
    (@one [$($to:tt)+] sends_gathered) => {
        fn sends_gathered(&self) -> bool {
            self $($to)+ .sends_gathered()
        }
    };
    (@one [$($to:tt)+] poll_send_pieces) => {
        fn poll_send_pieces(
            &self,
            cx: &mut ::std::task::Context<'_>,
            transmit: &$crate::metaroce::Transmit,
            pieces: &[&[u8]],
        ) -> ::std::task::Poll<::std::io::Result<()>> {
            self $($to)+ .poll_send_pieces(cx, transmit, pieces)
        }
    };
    (@one [$($to:tt)+] send_from_any_task) => {
        fn send_from_any_task(&self) -> bool {
            self $($to)+ .send_from_any_task()
        }
    };
    ($to:tt $($method:ident),+ $(,)?) => {
        $( $crate::forward_datagram_backend!(@one $to $method); )+
    };
}

impl<T: DatagramBackend + ?Sized> DatagramBackend for Arc<T> {
    forward_datagram_backend!([.as_ref()] local_addr, source_ports, max_gso_segments,
        max_gro_segments, socket_recv_buffer, poll_recv, poll_send, poll_send_owned,
        poll_recv_in_place, flush, send_from_any_task, sends_gathered, poll_send_pieces);
}

impl<T: DatagramBackend + ?Sized> DatagramBackend for Box<T> {
    forward_datagram_backend!([.as_ref()] local_addr, source_ports, max_gso_segments,
        max_gro_segments, socket_recv_buffer, poll_recv, poll_send, poll_send_owned,
        poll_recv_in_place, flush, send_from_any_task, sends_gathered, poll_send_pieces);
}

/// Checks a transmit's shape and returns its datagram size (`segment_size`, or the whole
/// buffer for a single datagram). Shared by the backends so they reject the same inputs.
pub(crate) fn check_transmit(transmit: &metaroce::Transmit, contents: &[u8]) -> io::Result<usize> {
    if contents.len() != transmit.size {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "transmit size {} does not match the {} bytes of contents",
                transmit.size,
                contents.len()
            ),
        ));
    }
    match transmit.segment_size {
        Some(0) => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "transmit segment_size is 0",
        )),
        Some(s) => Ok(s),
        None => Ok(contents.len()),
    }
}

/// The error for a buffer shorter than its transmit's `size`.
pub(crate) fn short_buffer(size: usize, len: usize) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("transmit size {size} is larger than its {len}-byte buffer"),
    )
}

/// The error for a `src_port` that is not one of the backend's path ports.
pub(crate) fn unknown_src_port(port: u16, ports: &[u16]) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("transmit src_port {port} is not one of this backend's source ports {ports:?}"),
    )
}
