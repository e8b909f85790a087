//! What the core asks the I/O layer to send, and the ECN codepoints it reads and writes.

use std::any::Any;
use std::net::SocketAddr;
use std::sync::Arc;

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

/// A region's handle for the I/O layer ([`crate::RegionMemory::lend`]): opaque to the core,
/// downcast by the layer that registered the region.
pub type LendHandle = Arc<dyn Any + Send + Sync>;

/// One payload the I/O layer reads from a region when it sends (gather send): `len` bytes
/// at byte `offset` of the transmit's lent region, inserted before byte `at` of the
/// transmit buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LentSpan {
    /// Bytes of the transmit buffer that come before this payload (non-decreasing along
    /// [`Lent::spans`]).
    pub at: usize,
    /// Byte offset in the region.
    pub offset: usize,
    /// Payload bytes.
    pub len: usize,
}

/// The payloads of one transmit that stay in their region until it is sent, filled by
/// [`Endpoint::poll_transmit_lent`](crate::Endpoint::poll_transmit_lent).
///
/// Without gather send, a WRITE's payload is copied from its memory region into
/// the transmit buffer and then copied again by the kernel. With it, the buffer holds only
/// each packet's headers, pad, trailer and ICRC, and the datagrams are the buffer with
/// every [`LentSpan`] of the region inserted at its place: the I/O layer hands the pieces to
/// one `sendmsg` as an I/O vector (the payload is copied once, by the kernel). The ICRC
/// was computed over the region's bytes when the packet was built; an application that
/// changes a region under a work request still in flight (which verbs forbid: the
/// contents are then undefined, IBA 10.7.2.2) makes such packets fail the peer's ICRC
/// check, and the transport sends them again.
///
/// All spans of one transmit come from one region ([`memory`](Self::memory)), so the I/O
/// layer takes one lock to send it.
#[derive(Default)]
pub struct Lent {
    memory: Option<LendHandle>,
    spans: Vec<LentSpan>,
}

impl std::fmt::Debug for Lent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lent")
            .field("memory", &self.memory.is_some())
            .field("spans", &self.spans)
            .finish()
    }
}

impl Lent {
    /// An empty set (no allocation until the first span).
    pub fn new() -> Self {
        Self::default()
    }

    /// The region every span reads from; `None` when there are no spans.
    pub fn memory(&self) -> Option<&LendHandle> {
        self.memory.as_ref()
    }

    /// The payloads in datagram order.
    pub fn spans(&self) -> &[LentSpan] {
        &self.spans
    }

    /// Whether the transmit is all in its buffer.
    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Bytes the spans add to the transmit buffer.
    pub fn bytes(&self) -> usize {
        self.spans.iter().map(|s| s.len).sum()
    }

    /// Forget every span and the region (keeps the allocation).
    pub fn clear(&mut self) {
        self.memory = None;
        self.spans.clear();
    }

    /// Whether a payload of `memory` may join this transmit (it has no region yet, or the
    /// same one).
    pub(crate) fn accepts(&self, memory: &LendHandle) -> bool {
        self.memory
            .as_ref()
            .is_none_or(|m| std::ptr::addr_eq(Arc::as_ptr(m), Arc::as_ptr(memory)))
    }

    pub(crate) fn push(&mut self, memory: LendHandle, span: LentSpan) {
        if self.memory.is_none() {
            self.memory = Some(memory);
        }
        self.spans.push(span);
    }

    /// The datagram bytes in order, as pieces: `buf` (the transmit buffer, `size - bytes()`
    /// long) cut at each span, with the span's bytes of `region` (the lent region's whole
    /// memory) between. `f` is called with each non-empty piece. Returns `false`, having
    /// called `f` for none, if a span lies outside `buf` or `region` or the spans are out
    /// of order (the region is not the one lent, say).
    pub fn for_each_piece<'a>(
        &self,
        buf: &'a [u8],
        region: &'a [u8],
        mut f: impl FnMut(&'a [u8]),
    ) -> bool {
        let mut at = 0;
        for s in &self.spans {
            let fits = s.at >= at
                && s.at <= buf.len()
                && s.offset
                    .checked_add(s.len)
                    .is_some_and(|e| e <= region.len());
            if !fits {
                return false;
            }
            at = s.at;
        }
        let mut at = 0;
        for s in &self.spans {
            if s.at > at {
                f(&buf[at..s.at]);
            }
            if s.len > 0 {
                f(&region[s.offset..s.offset + s.len]);
            }
            at = s.at;
        }
        if buf.len() > at {
            f(&buf[at..]);
        }
        true
    }

    /// The datagram bytes assembled into `out` (cleared first): what a backend without an
    /// I/O vector send does. `false` as [`for_each_piece`](Self::for_each_piece).
    pub fn assemble(&self, buf: &[u8], region: &[u8], out: &mut Vec<u8>) -> bool {
        out.clear();
        self.for_each_piece(buf, region, |p| out.extend_from_slice(p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_outside_the_buffer_or_region_are_refused() {
        let buf = [1u8; 10];
        let region = [9u8; 100];
        // A well-formed transmit: head, payload, tail.
        let mut ok = Lent::new();
        assert!(ok.is_empty());
        let mut out = Vec::new();
        assert!(ok.assemble(&buf, &region, &mut out));
        assert_eq!(out, buf);
        let h: LendHandle = Arc::new(());
        let spans = |v: &[LentSpan]| {
            let mut l = Lent::new();
            for s in v {
                l.push(h.clone(), *s);
            }
            l
        };
        ok = spans(&[LentSpan {
            at: 4,
            offset: 90,
            len: 10,
        }]);
        assert!(ok.assemble(&buf, &region, &mut out));
        assert_eq!(out.len(), 20);
        assert_eq!(&out[4..14], &[9u8; 10]);
        for bad in [
            // Past the region's end.
            LentSpan {
                at: 4,
                offset: 91,
                len: 10,
            },
            // An offset that wraps.
            LentSpan {
                at: 4,
                offset: usize::MAX,
                len: 2,
            },
            // Past the buffer's end.
            LentSpan {
                at: 11,
                offset: 0,
                len: 1,
            },
        ] {
            let l = spans(&[bad]);
            let mut calls = 0;
            assert!(!l.for_each_piece(&buf, &region, |_| calls += 1), "{bad:?}");
            assert_eq!(calls, 0);
        }
        // Out of order.
        let l = spans(&[
            LentSpan {
                at: 6,
                offset: 0,
                len: 1,
            },
            LentSpan {
                at: 5,
                offset: 0,
                len: 1,
            },
        ]);
        assert!(!l.assemble(&buf, &region, &mut out));
    }
}
