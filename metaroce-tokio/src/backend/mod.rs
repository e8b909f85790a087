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
mod udp;

pub use impair::{GilbertElliott, ImpairError, ImpairStats, Impaired, Impairment};
pub use udp::{UdpBackend, UdpConfig};

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
    /// `Ready(Ok(()))` once handed to the kernel (or, for [`Impaired`], once sent inline,
    /// queued for later or dropped; it is `Pending` only when its inner backend is). An `Err` concerns this transmit only (it was not, or not entirely, sent, as
    /// if lost): the backend stays usable. After `Pending`, the next call must be for the
    /// same transmit.
    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        transmit: &metaroce::Transmit,
        contents: &[u8],
    ) -> Poll<io::Result<()>>;
}

impl<T: DatagramBackend + ?Sized> DatagramBackend for Arc<T> {
    fn local_addr(&self) -> SocketAddr {
        (**self).local_addr()
    }

    fn source_ports(&self) -> Vec<u16> {
        (**self).source_ports()
    }

    fn max_gso_segments(&self) -> usize {
        (**self).max_gso_segments()
    }

    fn max_gro_segments(&self) -> usize {
        (**self).max_gro_segments()
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        (**self).poll_recv(cx, bufs, meta)
    }

    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        transmit: &metaroce::Transmit,
        contents: &[u8],
    ) -> Poll<io::Result<()>> {
        (**self).poll_send(cx, transmit, contents)
    }
}

impl<T: DatagramBackend + ?Sized> DatagramBackend for Box<T> {
    fn local_addr(&self) -> SocketAddr {
        (**self).local_addr()
    }

    fn source_ports(&self) -> Vec<u16> {
        (**self).source_ports()
    }

    fn max_gso_segments(&self) -> usize {
        (**self).max_gso_segments()
    }

    fn max_gro_segments(&self) -> usize {
        (**self).max_gro_segments()
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        (**self).poll_recv(cx, bufs, meta)
    }

    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        transmit: &metaroce::Transmit,
        contents: &[u8],
    ) -> Poll<io::Result<()>> {
        (**self).poll_send(cx, transmit, contents)
    }
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

/// The error for a `src_port` that is not one of the backend's path ports.
pub(crate) fn unknown_src_port(port: u16, ports: &[u16]) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("transmit src_port {port} is not one of this backend's source ports {ports:?}"),
    )
}
