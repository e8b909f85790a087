//! Zero-copy parsing and emission of RoCEv2 and MetaRoCE packets.
//!
//! A *UDP payload* is laid out as
//!
//! ```text
//! BTH (12 B) | extension headers (0..=48 B, set by the opcode) | payload | pad (0..=3 B) | trailer (0, 8 or 24 B) | ICRC (4 B)
//! ```
//!
//! The trailer ([`Trailer`]) exists only on MetaRoCE opcodes; its kind is BTH byte 8 bits
//! 1:0.
//!
//! All multi-byte fields are big-endian except the ICRC, which is little-endian
//! ([`icrc`]). RoCEv2 packets (RC opcodes `0x00..=0x17`, UD `0x64`/`0x65`, CNP `0x81`) follow
//! IBA Vol. 1 chapter 9 and RoCEv2 Annex A17; MetaRoCE packets use opcodes `0xC0..=0xCB`
//! (MetaRoCE extension, byte layouts in docs/PROTOCOL.md).
//!
//! Parsing never allocates and never panics: every malformed input is an [`Error`].
//!
//! ```
//! use metaroce::wire::{self, Bth, Headers, Opcode, Packet, PathEth, SendEth};
//!
//! let bth = Bth::new(Opcode::MR_SEND, 0x12, 7);
//! let headers = Headers::Send { path: PathEth::default(), send: SendEth { msg_len: 5, ..Default::default() } };
//! let mut buf = [0u8; 128];
//! let n = wire::emit_packet(&bth, &headers, b"hello", &mut buf).unwrap();
//! assert_eq!(n, wire::packet_len(&headers, 5));
//! let p = Packet::parse(&buf[..n]).unwrap();
//! assert_eq!(p.payload, b"hello");
//! assert_eq!(p.bth.pad_count, 3);
//! ```

use core::fmt;

mod bth;
mod cursor;
mod eth;
mod headers;
pub mod icrc;
mod mr;
mod opcode;
mod trailer;

pub use bth::Bth;
pub use eth::{Aeth, AtomicAckEth, AtomicEth, Deth, Reth};
pub use headers::{header_len, Headers, CNP_RESERVED_LEN, IMM_LEN};
pub use mr::{AckEth, CloseEth, ConnectEth, ConnectKind, NakEth, PathEth, SendEth, WriteEth};
pub use opcode::{Opcode, Transport};
pub use trailer::Trailer;

/// UDP destination port of RoCEv2 (4791, IANA-assigned). RoCEv2 Annex A17.
pub const ROCEV2_UDP_PORT: u16 = 4791;
/// Size of the Base Transport Header in bytes (12). IBA Vol. 1 §9.2.
pub const BTH_LEN: usize = 12;
/// Size of the invariant CRC trailer in bytes (4). IBA Vol. 1 §7.8.1.
pub const ICRC_LEN: usize = 4;
/// Default partition key (16 bits, 0xFFFF: full member of the default partition).
/// IBA Vol. 1 §9.2 (BTH P_Key).
pub const DEFAULT_PKEY: u16 = 0xFFFF;
/// Mask of the 24-bit PSN / QPN / MSN space (0x00FF_FFFF). IBA Vol. 1 §9.2.
pub const PSN_MASK: u32 = 0x00FF_FFFF;
/// Largest number of pad bytes (3): BTH.PadCnt is 2 bits. IBA Vol. 1 §9.2.
pub const MAX_PAD: usize = 3;

/// Everything that can be wrong with a packet being parsed or emitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// The input ended early: `needed` bytes were required, `got` were present.
    Truncated {
        /// Bytes required.
        needed: usize,
        /// Bytes available.
        got: usize,
    },
    /// BTH.TVer (4 bits) is not 0.
    UnsupportedTver(u8),
    /// The BTH opcode is reserved, undefined or not supported (see [`header_len`]).
    UnknownOpcode(u8),
    /// BTH.PadCnt is larger than the bytes between the headers and the ICRC. Non-zero pad
    /// bytes are accepted.
    BadPadCount,
    /// A length is inconsistent: a UDP payload that is not a multiple of 4 bytes, a length
    /// that does not fit a 16-bit IP/UDP length field, a header of the wrong size.
    BadLength,
    /// The output buffer is too small: `needed` bytes are required, `got` are available.
    BufferTooSmall {
        /// Bytes required.
        needed: usize,
        /// Bytes available.
        got: usize,
    },
    /// The ICRC does not match: `expected` was computed, `found` was received (both as the
    /// CRC value, i.e. the wire bytes read little-endian).
    BadIcrc {
        /// ICRC computed over the packet.
        expected: u32,
        /// ICRC carried by the packet.
        found: u32,
    },
    /// A field holds an undefined value, or the headers do not match the opcode; the string
    /// names the field.
    BadField(&'static str),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Error::Truncated { needed, got } => {
                write!(f, "packet truncated: need {needed} bytes, got {got}")
            }
            Error::UnsupportedTver(v) => write!(f, "unsupported BTH transport version {v}"),
            Error::UnknownOpcode(op) => write!(f, "unknown or unsupported opcode 0x{op:02x}"),
            Error::BadPadCount => f.write_str("BTH pad count exceeds the payload area"),
            Error::BadLength => f.write_str("inconsistent length"),
            Error::BufferTooSmall { needed, got } => {
                write!(f, "output buffer too small: need {needed} bytes, got {got}")
            }
            Error::BadIcrc { expected, found } => {
                write!(
                    f,
                    "bad ICRC: computed 0x{expected:08x}, packet carries 0x{found:08x}"
                )
            }
            Error::BadField(name) => write!(f, "invalid value in field {name}"),
        }
    }
}

impl std::error::Error for Error {}

/// A parsed packet borrowing the datagram.
///
/// `payload` excludes the pad, the trailer and the ICRC; `trailer` is the authentication
/// trailer (always [`Trailer::None`] on RoCEv2 opcodes); `icrc` holds the 4 trailing wire
/// bytes as received (the CRC value is `u32::from_le_bytes(icrc)`). Sizes: a packet is
/// `12 + headers.len() + payload.len() + bth.pad_count + trailer.len() + 4` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Packet<'a> {
    /// Base transport header (12 B).
    pub bth: Bth,
    /// Extension headers that the opcode prescribes.
    pub headers: Headers,
    /// Payload bytes (after the headers, before the pad).
    pub payload: &'a [u8],
    /// Authentication trailer (between the pad and the ICRC); its kind is BTH byte 8 bits
    /// 1:0 on MetaRoCE opcodes.
    pub trailer: Trailer,
    /// The 4 ICRC bytes as they appear on the wire (little-endian CRC value).
    pub icrc: [u8; ICRC_LEN],
}

impl<'a> Packet<'a> {
    /// Parse a whole UDP payload (BTH … ICRC).
    ///
    /// Checks, in order: at least 16 bytes (BTH + ICRC) → [`Error::Truncated`]; TVer 0 →
    /// [`Error::UnsupportedTver`]; opcode known → [`Error::UnknownOpcode`]; length ≥ BTH +
    /// headers + ICRC → [`Error::Truncated`]; length a multiple of 4 → [`Error::BadLength`];
    /// on a MetaRoCE opcode, trailer kind (BTH byte 8 bits 1:0) not 3 →
    /// [`Error::BadField`]`("BTH.trailer")` and length ≥ BTH + headers + trailer + ICRC →
    /// [`Error::Truncated`]; pad count ≤ the bytes between headers and trailer →
    /// [`Error::BadPadCount`]; the header fields themselves → [`Error::BadField`]. Reserved
    /// bits and the values of pad bytes are ignored. Trailer kind 0 is accepted on every
    /// opcode (the connection logic decides). The ICRC is **not** verified (see
    /// [`icrc::verify`]).
    pub fn parse(udp_payload: &'a [u8]) -> Result<Packet<'a>, Error> {
        let len = udp_payload.len();
        let min = BTH_LEN + ICRC_LEN;
        if len < min {
            return Err(Error::Truncated {
                needed: min,
                got: len,
            });
        }
        let bth = Bth::parse(udp_payload)?;
        let hdr = header_len(bth.opcode)?;
        if len < hdr + ICRC_LEN {
            return Err(Error::Truncated {
                needed: hdr + ICRC_LEN,
                got: len,
            });
        }
        if len % 4 != 0 {
            return Err(Error::BadLength);
        }
        let kind = Trailer::kind_in(bth.opcode, udp_payload.get(8).copied().unwrap_or(0));
        let tlen = Trailer::len_of_kind(kind).ok_or(Error::BadField("BTH.trailer"))?;
        if len < hdr + tlen + ICRC_LEN {
            return Err(Error::Truncated {
                needed: hdr + tlen + ICRC_LEN,
                got: len,
            });
        }
        let pad = usize::from(bth.pad_count);
        let area = len - hdr - tlen - ICRC_LEN;
        if pad > area {
            return Err(Error::BadPadCount);
        }
        let ext = udp_payload.get(BTH_LEN..hdr).ok_or(Error::BadLength)?;
        let headers = Headers::parse(bth.opcode, ext)?;
        let tail = len - ICRC_LEN - tlen;
        let payload = udp_payload.get(hdr..tail - pad).ok_or(Error::BadLength)?;
        let trailer = Trailer::parse(
            kind,
            udp_payload
                .get(tail..len - ICRC_LEN)
                .ok_or(Error::BadLength)?,
        )?;
        let icrc = udp_payload
            .get(len - ICRC_LEN..)
            .and_then(|s| <[u8; ICRC_LEN]>::try_from(s).ok())
            .ok_or(Error::BadLength)?;
        Ok(Packet {
            bth,
            headers,
            payload,
            trailer,
            icrc,
        })
    }

    /// The ICRC value carried by the packet (`u32::from_le_bytes(self.icrc)`).
    pub fn icrc_value(&self) -> u32 {
        u32::from_le_bytes(self.icrc)
    }
}

/// Pad bytes for a payload of `payload_len` bytes: `(4 - len % 4) % 4`, 0..=3.
/// IBA Vol. 1 §9.2 (PadCnt).
pub fn pad_for(payload_len: usize) -> usize {
    (4 - payload_len % 4) % 4
}

/// Total UDP payload length in bytes of a packet with these headers, a payload of
/// `payload_len` bytes and no trailer: BTH (12) + `headers.len()` + payload + pad + ICRC (4).
/// Saturates at `usize::MAX` instead of overflowing. See [`packet_len_with`].
pub fn packet_len(headers: &Headers, payload_len: usize) -> usize {
    packet_len_with(headers, payload_len, &Trailer::None)
}

/// Total UDP payload length in bytes of a packet with these headers, a payload of
/// `payload_len` bytes and `trailer`: BTH (12) + `headers.len()` + payload + pad +
/// `trailer.len()` + ICRC (4). Saturates at `usize::MAX` instead of overflowing.
pub fn packet_len_with(headers: &Headers, payload_len: usize, trailer: &Trailer) -> usize {
    (BTH_LEN + headers.len() + trailer.len() + ICRC_LEN)
        .saturating_add(payload_len)
        .saturating_add(pad_for(payload_len))
}

/// Emit a whole packet without a trailer (kind 0); see [`emit_packet_with`].
pub fn emit_packet(
    bth: &Bth,
    headers: &Headers,
    payload: &[u8],
    out: &mut [u8],
) -> Result<usize, Error> {
    emit_packet_with(bth, headers, payload, &Trailer::None, out)
}

/// Emit a whole packet into the start of `out`: the BTH (with `pad_count` replaced by
/// [`pad_for`]`(payload.len())` and, on MetaRoCE opcodes, the trailer kind in byte 8 bits
/// 1:0), the headers, the payload, zero pad bytes, the trailer and 4 ICRC bytes left as
/// zero — stamp them afterwards with [`icrc::stamp`]. Returns the total length,
/// [`packet_len_with`]`(headers, payload.len(), trailer)`.
///
/// Errors: [`Error::UnknownOpcode`] if `bth.opcode` is not known;
/// [`Error::BadField`]`("headers do not match opcode")` if `headers` is not the sequence the
/// opcode prescribes ([`Headers::matches_opcode`]);
/// [`Error::BadField`]`("trailer on a RoCEv2 opcode")` for a trailer other than
/// [`Trailer::None`] on a non-MetaRoCE opcode; [`Error::BufferTooSmall`] if `out` is shorter
/// than the packet.
pub fn emit_packet_with(
    bth: &Bth,
    headers: &Headers,
    payload: &[u8],
    trailer: &Trailer,
    out: &mut [u8],
) -> Result<usize, Error> {
    check_emit(bth, headers, trailer)?;
    let total = packet_len_with(headers, payload.len(), trailer);
    let got = out.len();
    let at = BTH_LEN + headers.len();
    if total <= got {
        if let Some(p) = out.get_mut(at..at + payload.len()) {
            p.copy_from_slice(payload);
        }
    }
    emit_around_payload(bth, headers, payload.len(), trailer, out)
}

/// Like [`emit_packet_with`], for a packet whose `payload_len` payload bytes are already in
/// place in `out` (at offset 12 + `headers.len()`, right after the BTH and the headers):
/// writes everything else (BTH, headers, pad, trailer, zero ICRC) and leaves the payload
/// bytes untouched. The sender uses it to copy a WRITE's bytes from the source region
/// straight into the datagram (issue #13, P1: no intermediate copy, no zero fill of the
/// payload). Same errors and return value as [`emit_packet_with`].
pub fn emit_packet_in_place(
    bth: &Bth,
    headers: &Headers,
    payload_len: usize,
    trailer: &Trailer,
    out: &mut [u8],
) -> Result<usize, Error> {
    check_emit(bth, headers, trailer)?;
    emit_around_payload(bth, headers, payload_len, trailer, out)
}

/// The checks both emitters make before writing anything: a known opcode, headers that
/// match it, and a trailer only on a MetaRoCE opcode.
fn check_emit(bth: &Bth, headers: &Headers, trailer: &Trailer) -> Result<(), Error> {
    header_len(bth.opcode)?;
    if !headers.matches_opcode(bth.opcode) {
        return Err(Error::BadField("headers do not match opcode"));
    }
    if !trailer.is_empty() && !bth.opcode.is_metaroce() {
        return Err(Error::BadField("trailer on a RoCEv2 opcode"));
    }
    Ok(())
}

/// [`emit_packet_in_place`] after [`check_emit`]: everything but the payload bytes.
fn emit_around_payload(
    bth: &Bth,
    headers: &Headers,
    payload_len: usize,
    trailer: &Trailer,
    out: &mut [u8],
) -> Result<usize, Error> {
    let total = packet_len_with(headers, payload_len, trailer);
    let got = out.len();
    let out = out
        .get_mut(..total)
        .ok_or(Error::BufferTooSmall { needed: total, got })?;
    let head = emit_head(bth, headers, payload_len, trailer, out)?;
    let tail = out
        .get_mut(head + payload_len..)
        .ok_or(Error::BufferTooSmall { needed: total, got })?;
    emit_tail(payload_len, trailer, tail)?;
    Ok(total)
}

/// The bytes before a packet's payload (BTH with its pad count and trailer kind, then the
/// extension headers) into the start of `out`; returns how many. `payload_len` sets the
/// BTH pad count. The caller has made [`check_emit`]'s checks.
fn emit_head(
    bth: &Bth,
    headers: &Headers,
    payload_len: usize,
    trailer: &Trailer,
    out: &mut [u8],
) -> Result<usize, Error> {
    let pad = pad_for(payload_len);
    let mut b = *bth;
    // pad_for() is at most 3, so this cannot truncate.
    b.pad_count = pad as u8;
    let got = out.len();
    if got < BTH_LEN {
        return Err(Error::BufferTooSmall {
            needed: BTH_LEN,
            got,
        });
    }
    let (bth_bytes, rest) = out.split_at_mut(BTH_LEN);
    b.emit(bth_bytes)?;
    if let Some(b8) = bth_bytes.get_mut(8) {
        *b8 |= trailer.kind();
    }
    let n = headers.emit(rest)?;
    Ok(BTH_LEN + n)
}

/// The bytes after a packet's payload: the pad (zeros), the trailer and a zeroed ICRC,
/// into the start of `out`; returns how many ([`tail_len`]).
fn emit_tail(payload_len: usize, trailer: &Trailer, out: &mut [u8]) -> Result<usize, Error> {
    let n = tail_len(payload_len, trailer);
    let got = out.len();
    let out = out
        .get_mut(..n)
        .ok_or(Error::BufferTooSmall { needed: n, got })?;
    let pad = pad_for(payload_len);
    let (pad_bytes, rest) = out.split_at_mut(pad);
    pad_bytes.fill(0);
    let (tr, icrc) = rest.split_at_mut(trailer.len());
    trailer.emit(tr)?;
    icrc.fill(0);
    Ok(n)
}

/// Bytes after a payload of `payload_len`: pad, trailer and ICRC.
pub fn tail_len(payload_len: usize, trailer: &Trailer) -> usize {
    pad_for(payload_len) + trailer.len() + ICRC_LEN
}

/// A packet with its payload left out, for a sender that hands the payload to the kernel
/// from where it lies (gather send, [`crate::Lent`]): the header bytes (BTH, extension
/// headers) go into `head` and the pad, trailer and zeroed ICRC into `tail`, both
/// written from their start. Returns the two lengths; the packet on the wire is
/// `head ++ payload ++ tail`, `packet_len_with(headers, payload_len, trailer)` bytes.
///
/// Errors: as [`emit_packet_in_place`].
pub fn emit_split(
    bth: &Bth,
    headers: &Headers,
    payload_len: usize,
    trailer: &Trailer,
    head: &mut [u8],
    tail: &mut [u8],
) -> Result<(usize, usize), Error> {
    check_emit(bth, headers, trailer)?;
    let h = emit_head(bth, headers, payload_len, trailer, head)?;
    let t = emit_tail(payload_len, trailer, tail)?;
    Ok((h, t))
}

/// `a + n` in the 24-bit PSN space (modulo 2^24). IBA Vol. 1 §9.2 (PSN).
pub fn psn_add(a: u32, n: u32) -> u32 {
    a.wrapping_add(n) & PSN_MASK
}

/// Signed distance `a − b` in the 24-bit PSN space, in (−2^23, 2^23]: positive when `a` is
/// after `b`, negative when before, 0 when equal (inputs are masked to 24 bits first).
/// IBA Vol. 1 §9.2 (PSN), modular comparison as in the RoCEv2 reference §6.1.
pub fn psn_diff(a: u32, b: u32) -> i32 {
    let d = a.wrapping_sub(b) & PSN_MASK;
    if d > 1 << 23 {
        d as i32 - (1 << 24)
    } else {
        d as i32
    }
}
