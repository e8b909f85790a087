//! What the core asks the I/O layer to send, and the ECN codepoints it reads and writes.

use std::net::SocketAddr;

/// The two-bit ECN field of the IP header (RFC 3168), as carried in IPv4 TOS / IPv6 TC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum EcnCodepoint {
    /// ECT(0), `0b10`: ECN-capable transport. metaroce marks all data packets with it.
    Ect0 = 0b10,
    /// ECT(1), `0b01`.
    Ect1 = 0b01,
    /// CE, `0b11`: congestion experienced, set by a switch queue (or an impairment layer).
    Ce = 0b11,
}

impl EcnCodepoint {
    /// The codepoint for the low two bits of a TOS / traffic-class byte; `None` for Not-ECT.
    pub fn from_bits(bits: u8) -> Option<Self> {
        match bits & 0b11 {
            0b10 => Some(Self::Ect0),
            0b01 => Some(Self::Ect1),
            0b11 => Some(Self::Ce),
            _ => None,
        }
    }

    /// The two ECN bits of this codepoint.
    pub fn bits(self) -> u8 {
        self as u8
    }
}

/// One datagram, or a batch of equal-size datagrams for UDP GSO, that the core asks to send.
///
/// Produced by `poll_transmit(now, buf)`: the bytes are `buf[..size]`. When `segment_size`
/// is `Some(s)`, the buffer holds `ceil(size / s)` UDP payloads back to back, each `s` bytes
/// except possibly the last; a backend without GSO sends them one by one. Every payload is
/// a complete RoCEv2-framed packet (BTH … ICRC) addressed to `destination`, sent from the
/// local UDP port `src_port` (the ECMP entropy of one path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    /// Peer address (IP and UDP port) to send to.
    pub destination: SocketAddr,
    /// Local UDP source port to send from: the path's ECMP entropy. It is always one of the
    /// ports the endpoint was configured with.
    pub src_port: u16,
    /// ECN codepoint to put in the IP header, or `None` for Not-ECT.
    pub ecn: Option<EcnCodepoint>,
    /// Total bytes in the buffer.
    pub size: usize,
    /// Size of each datagram when the buffer holds several (GSO); `None` for one datagram.
    pub segment_size: Option<usize>,
}
