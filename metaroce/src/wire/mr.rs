//! MetaRoCE extension headers (MetaRoCE extension, see docs/PROTOCOL.md).
//!
//! All fields are big-endian. Reserved bytes are written as zero and ignored on receive.
//! 24-bit fields held in a `u32` are masked to their low 24 bits on emit and parse.

use super::cursor::{fixed, Reader, Writer};
use super::{Aeth, Error, PSN_MASK};

/// Per-path header: 12 bytes, first after the BTH on every data packet (`MR_SEND`,
/// `MR_WRITE`, `MR_WRITE_WITH_IMMEDIATE`, `MR_READ_REQUEST`, `MR_READ_RESPONSE`,
/// `MR_COMPARE_SWAP`, `MR_FETCH_ADD`, `MR_ATOMIC_RESPONSE`) and on `MR_NAK`. On a READ or
/// atomic response it describes the responder's path. MetaRoCE extension, see
/// docs/PROTOCOL.md.
///
/// | Bytes | Field |
/// |---|---|
/// | 0 | path id (8 bits) |
/// | 1 | flags (8 bits): bit 0 = [`PathEth::FLAG_RETRANSMIT`]; bit 1 = [`PathEth::FLAG_STREAM_ABORT`] on `MR_SEND`, [`PathEth::FLAG_OP_ABORT`] on `MR_WRITE`, else 0; bit 2 = [`PathEth::FLAG_STREAM_FIN`] on `MR_SEND` (with bit 1: STOP), else 0; bit 3 = 0; bits 7:4 = the path's re-roll generation ([`PathEth::generation`]) |
/// | 2–3 | reserved, 0 |
/// | 4–7 | transmit timestamp, ns of the sender's clock modulo 2^32 |
/// | 8 | plane (bits 2:0, see [`PathEth::plane`]); bits 7:3 reserved, 0 |
/// | 9–11 | floor PSN (24 bits) |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PathEth {
    /// Path index (8 bits) the packet was sent on; selects the path's PSN space.
    pub path_id: u8,
    /// Flag bits (8 bits): [`PathEth::FLAG_RETRANSMIT`], [`PathEth::FLAG_STREAM_ABORT`] and
    /// the path generation in bits 7:4 ([`PathEth::GENERATION_SHIFT`]). Carried verbatim.
    pub flags: u8,
    /// Transmit timestamp (32 bits): sender clock in nanoseconds, modulo 2^32. Echoed in
    /// [`AckEth::echo_ts`].
    pub timestamp: u32,
    /// Floor PSN (24 bits): the oldest PSN on this path the sender still waits for; the
    /// receiver treats every earlier PSN as settled.
    pub floor_psn: u32,
    /// Plane (low 3 bits, 0–7) of the path's source port when the sender groups its paths
    /// by plane (`TransportConfig::planes > 1`), else 0; the receiver answers the path from
    /// a port of the same plane. Byte 8; bits 7:3 are reserved and written as 0.
    pub plane: u8,
}

impl PathEth {
    /// Size in bytes (12).
    pub const LEN: usize = 12;
    /// Flag bit 0: the payload is a retransmission of data sent before.
    pub const FLAG_RETRANSMIT: u8 = 0x01;
    /// Bits of byte 8 that carry [`PathEth::plane`].
    pub const PLANE_MASK: u8 = 0x07;
    /// Flag bit 1, on `MR_SEND` only: stream abort. The packet carries no payload; its
    /// SendEth names the stream and the first message the sender gave up on (offset 0,
    /// message length 0). See docs/PROTOCOL.md, "Errors on a stream". 0 on other opcodes.
    pub const FLAG_STREAM_ABORT: u8 = 0x02;
    /// Flag bit 1, on `MR_WRITE`: op abort. The packet carries no payload; its WriteEth
    /// names the op id of a WRITE the sender gave up on after a local error (offset 0;
    /// RETH all 0). See docs/PROTOCOL.md, "Errors of one operation". The same bit as
    /// [`PathEth::FLAG_STREAM_ABORT`]: its meaning depends on the opcode.
    pub const FLAG_OP_ABORT: u8 = 0x02;
    /// Flag bit 2, on `MR_SEND` only: stream FIN — the stream ends after `msg_seq`
    /// messages (SendEth: stream, message count, offset 0, length 0, no payload). With
    /// bit 1 also set: STOP — the receiver of the stream asks its sender to stop, SendEth
    /// offset = the application's code. See docs/PROTOCOL.md, "Ending a stream".
    pub const FLAG_STREAM_FIN: u8 = 0x04;
    /// Flags bits 7:4 carry the path's re-roll generation (0..=15, modulo 16): it counts
    /// the times the sender moved this path to a new UDP source port, and the receiver
    /// sends its ACKs and NAKs for the path from a port that moves with it.
    pub const GENERATION_SHIFT: u32 = 4;

    /// Parse the first 12 bytes of `b`; [`Error::Truncated`] if shorter.
    pub fn parse(b: &[u8]) -> Result<Self, Error> {
        let &[path_id, flags, _, _, t0, t1, t2, t3, plane, f0, f1, f2] = fixed::<{ Self::LEN }>(b)?;
        Ok(PathEth {
            path_id,
            flags,
            timestamp: u32::from_be_bytes([t0, t1, t2, t3]),
            floor_psn: u32::from_be_bytes([0, f0, f1, f2]),
            plane: plane & Self::PLANE_MASK,
        })
    }

    /// Write 12 bytes to the start of `out`; [`Error::BufferTooSmall`] if shorter.
    pub fn emit(&self, out: &mut [u8]) -> Result<(), Error> {
        let mut w = Writer::with_len(out, Self::LEN)?;
        w.u8(self.path_id)?;
        w.u8(self.flags)?;
        w.zeros(2)?;
        w.u32(self.timestamp)?;
        w.u8(self.plane & Self::PLANE_MASK)?;
        w.u24(self.floor_psn & PSN_MASK)
    }

    /// True when [`PathEth::FLAG_RETRANSMIT`] is set.
    pub fn is_retransmit(&self) -> bool {
        self.flags & Self::FLAG_RETRANSMIT != 0
    }

    /// The path's re-roll generation, flags bits 7:4 (0..=15).
    pub fn generation(&self) -> u8 {
        self.flags >> Self::GENERATION_SHIFT
    }
}

/// SEND segment header: 16 bytes after [`PathEth`] on `MR_SEND`. MetaRoCE extension, see
/// docs/PROTOCOL.md.
///
/// | Bytes | Field |
/// |---|---|
/// | 0–3 | stream id |
/// | 4–7 | message sequence number within the stream (first message 0) |
/// | 8–11 | byte offset of this packet's payload within the message |
/// | 12–15 | message length in bytes |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SendEth {
    /// Stream identifier (32 bits).
    pub stream_id: u32,
    /// Message sequence number within the stream (32 bits), starting at 0.
    pub msg_seq: u32,
    /// Byte offset (32 bits) of this packet's payload within the message.
    pub offset: u32,
    /// Total message length in bytes (32 bits).
    pub msg_len: u32,
}

impl SendEth {
    /// Size in bytes (16).
    pub const LEN: usize = 16;

    /// Parse the first 16 bytes of `b`; [`Error::Truncated`] if shorter.
    pub fn parse(b: &[u8]) -> Result<Self, Error> {
        let mut r = Reader::with_len(b, Self::LEN)?;
        Ok(SendEth {
            stream_id: r.u32()?,
            msg_seq: r.u32()?,
            offset: r.u32()?,
            msg_len: r.u32()?,
        })
    }

    /// Write 16 bytes to the start of `out`; [`Error::BufferTooSmall`] if shorter.
    pub fn emit(&self, out: &mut [u8]) -> Result<(), Error> {
        let mut w = Writer::with_len(out, Self::LEN)?;
        w.u32(self.stream_id)?;
        w.u32(self.msg_seq)?;
        w.u32(self.offset)?;
        w.u32(self.msg_len)
    }
}

/// One-sided operation header: 8 bytes naming the operation a packet belongs to. After the
/// RETH on `MR_WRITE`, `MR_WRITE_WITH_IMMEDIATE` and `MR_READ_REQUEST`; after the
/// AtomicEth on `MR_COMPARE_SWAP` and `MR_FETCH_ADD`; right after [`PathEth`] on
/// `MR_READ_RESPONSE` and `MR_ATOMIC_RESPONSE`. MetaRoCE extension, see docs/PROTOCOL.md.
///
/// | Bytes | Field |
/// |---|---|
/// | 0–3 | op id: sequence number of the one-sided operation (WRITEs, READs and atomics counted together, per connection and direction); a response carries the op id of the request it answers |
/// | 4–7 | byte offset of this packet's payload within the operation's data: a WRITE's packet lands at RETH.VA + offset, a READ response's at the requester's buffer + offset; 0 on READ and atomic requests and atomic responses |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct WriteEth {
    /// Operation id (32 bits): of the WRITE, READ or atomic, or of the request a response
    /// answers.
    pub op_id: u32,
    /// Byte offset (32 bits) of this packet's payload within the operation's data (0 on
    /// packets without data).
    pub offset: u32,
}

impl WriteEth {
    /// Size in bytes (8).
    pub const LEN: usize = 8;

    /// Parse the first 8 bytes of `b`; [`Error::Truncated`] if shorter.
    pub fn parse(b: &[u8]) -> Result<Self, Error> {
        let &[i0, i1, i2, i3, o0, o1, o2, o3] = fixed::<{ Self::LEN }>(b)?;
        Ok(WriteEth {
            op_id: u32::from_be_bytes([i0, i1, i2, i3]),
            offset: u32::from_be_bytes([o0, o1, o2, o3]),
        })
    }

    /// Write 8 bytes to the start of `out`; [`Error::BufferTooSmall`] if shorter.
    pub fn emit(&self, out: &mut [u8]) -> Result<(), Error> {
        let mut w = Writer::with_len(out, Self::LEN)?;
        w.u32(self.op_id)?;
        w.u32(self.offset)
    }
}

/// Acknowledgement header: 48 bytes after the BTH on `MR_ACK`; BTH.PSN carries the
/// cumulative PSN. MetaRoCE extension, see docs/PROTOCOL.md.
///
/// | Bytes | Field |
/// |---|---|
/// | 0 | path id (8 bits) |
/// | 1 | flags (8 bits): bit 0 = [`AckEth::FLAG_ECE`]; bit 1 = [`AckEth::FLAG_KEEPALIVE`] |
/// | 2–3 | ACK delay in µs, saturating at 65,535 (reserved 0 before issue #13; see [`AckEth::ack_delay`]) |
/// | 4–7 | echoed timestamp (the [`PathEth::timestamp`] of the newest packet that triggered this ACK) |
/// | 8–11 | CE count: cumulative number of CE-marked packets received on this path |
/// | 12 | window grant: packets in flight granted to this sender over all paths, in units of [`AckEth::WINDOW_GRANT_UNIT`] (0 = no grant; 0 before issue #13, see [`AckEth::window_grant`]) |
/// | 13–15 | rate hint in Mbit/s granted to this sender, 24 bits (0 = no limit) |
/// | 16–47 | SACK bitmap, 256 bits: bit *i* ⇔ PSN cum+1+*i* received; bit *i* is bit (7 − *i* mod 8) of byte 16 + *i*/8 |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AckEth {
    /// Path index (8 bits) whose PSN space this ACK refers to.
    pub path_id: u8,
    /// Flag bits (8 bits): [`AckEth::FLAG_ECE`], [`AckEth::FLAG_KEEPALIVE`]. Carried
    /// verbatim.
    pub flags: u8,
    /// ACK delay (16 bits, µs, saturating): how long the receiver held this ACK after the
    /// packet whose timestamp it echoes arrived. The ACK's receiver subtracts it from its
    /// RTT sample (RFC 9002 §5.3). Bytes 2–3, reserved 0 before; a peer that does not set
    /// it sends 0 (no delay).
    pub ack_delay: u16,
    /// Echoed transmit timestamp (32 bits, ns modulo 2^32, sender's clock).
    pub echo_ts: u32,
    /// Cumulative count (32 bits) of CE-marked packets received on this path.
    pub ce_count: u32,
    /// Window granted to this sender (8 bits): the packets it may have in flight on the
    /// whole connection, over all paths, in units of [`AckEth::WINDOW_GRANT_UNIT`]
    /// packets; 0 = no grant. The receiver's share of its receive socket buffer
    /// (`TransportConfig::socket_recv_buffer`), as TCP's receive window is of its buffer.
    /// Byte 12, the top byte of the 32-bit rate hint before (issue #13): a peer that does
    /// not grant a window, or grants a rate below 2^24 Mbit/s, sends 0 there.
    pub window_grant: u8,
    /// Rate granted to this sender in Mbit/s (24 bits, bytes 13–15); 0 = no limit.
    /// [`emit`](Self::emit) saturates a larger value at [`AckEth::MAX_RATE_HINT`].
    pub rate_hint: u32,
    /// SACK bitmap (32 bytes = 256 bits), MSB first; use [`AckEth::sack_get`] /
    /// [`AckEth::sack_set`].
    pub sack: [u8; 32],
}

impl AckEth {
    /// Size in bytes (48).
    pub const LEN: usize = 48;
    /// Flag bit 0 (ECE): a CE mark was seen on this path since the previous ACK.
    pub const FLAG_ECE: u8 = 0x01;
    /// Flag bit 1: keepalive. The packet is not an acknowledgement: it asks the peer to
    /// send at once an ACK of path `path_id` (the receiver's PSN space of the sender's path
    /// `path_id`) that echoes this packet's `echo_ts` (the sender's transmit timestamp
    /// here). BTH.PSN, CE count, rate hint and SACK are 0 and ignored. See
    /// docs/PROTOCOL.md, "Keepalive".
    pub const FLAG_KEEPALIVE: u8 = 0x02;
    /// Flag bit 2 (BUNDLE), on the first AckEth of an `MR_ACK` only: the payload carries
    /// further ACK blocks ([`AckEth::BLOCK_LEN`] bytes each: the cumulative PSN of another
    /// path, then that path's AckEth), so one datagram acknowledges several paths. See
    /// docs/PROTOCOL.md, "ACK bundles".
    pub const FLAG_BUNDLE: u8 = 0x04;
    /// Size in bytes (52) of one further ACK block in the payload of a bundled `MR_ACK`:
    /// 4 bytes (8 reserved bits, 0, then the 24-bit cumulative PSN) and a 48-byte AckEth.
    pub const BLOCK_LEN: usize = 4 + Self::LEN;
    /// Number of PSNs the SACK bitmap covers beyond the cumulative PSN (256).
    pub const SACK_BITS: usize = 256;
    /// Packets per unit of [`AckEth::window_grant`] (8): one byte grants up to 2,040.
    pub const WINDOW_GRANT_UNIT: u32 = 8;
    /// Largest rate hint the 24-bit field carries, in Mbit/s (about 16.8 Tbit/s).
    pub const MAX_RATE_HINT: u32 = (1 << 24) - 1;

    /// Parse the first 48 bytes of `b`; [`Error::Truncated`] if shorter.
    pub fn parse(b: &[u8]) -> Result<Self, Error> {
        let mut r = Reader::with_len(b, Self::LEN)?;
        let path_id = r.u8()?;
        let flags = r.u8()?;
        let ack_delay = r.u16()?;
        Ok(AckEth {
            path_id,
            flags,
            ack_delay,
            echo_ts: r.u32()?,
            ce_count: r.u32()?,
            window_grant: r.u8()?,
            rate_hint: r.u24()?,
            sack: r.array()?,
        })
    }

    /// Write 48 bytes to the start of `out`; [`Error::BufferTooSmall`] if shorter.
    pub fn emit(&self, out: &mut [u8]) -> Result<(), Error> {
        let mut w = Writer::with_len(out, Self::LEN)?;
        w.u8(self.path_id)?;
        w.u8(self.flags)?;
        w.u16(self.ack_delay)?;
        w.u32(self.echo_ts)?;
        w.u32(self.ce_count)?;
        w.u8(self.window_grant)?;
        w.u24(self.rate_hint.min(Self::MAX_RATE_HINT))?;
        w.bytes(&self.sack)
    }

    /// Parse one further ACK block (the first [`AckEth::BLOCK_LEN`] bytes of `b`) of a
    /// bundled `MR_ACK`: (cumulative PSN, AckEth). The reserved top byte of the PSN word is
    /// ignored. [`Error::Truncated`] if `b` is shorter.
    pub fn parse_block(b: &[u8]) -> Result<(u32, Self), Error> {
        let mut r = Reader::with_len(b, Self::BLOCK_LEN)?;
        let cum = r.u32()? & PSN_MASK;
        Ok((cum, Self::parse(&b[4..])?))
    }

    /// Write one further ACK block for path `self.path_id` with cumulative PSN `cum` (24
    /// bits; higher bits are dropped) to the start of `out` ([`AckEth::BLOCK_LEN`] bytes);
    /// [`Error::BufferTooSmall`] if shorter.
    pub fn emit_block(&self, cum: u32, out: &mut [u8]) -> Result<(), Error> {
        Writer::with_len(out, Self::BLOCK_LEN)?.u32(cum & PSN_MASK)?;
        self.emit(&mut out[4..])
    }

    /// True when [`AckEth::FLAG_ECE`] is set.
    pub fn ece(&self) -> bool {
        self.flags & Self::FLAG_ECE != 0
    }

    /// SACK bit `i` (PSN cum+1+`i` received); `false` for `i >= 256`.
    pub fn sack_get(&self, i: usize) -> bool {
        match self.sack.get(i / 8) {
            Some(byte) => byte & (0x80 >> (i % 8)) != 0,
            None => false,
        }
    }

    /// Set SACK bit `i`. Returns `false` (and changes nothing) for `i >= 256`.
    pub fn sack_set(&mut self, i: usize) -> bool {
        match self.sack.get_mut(i / 8) {
            Some(byte) => {
                *byte |= 0x80 >> (i % 8);
                true
            }
            None => false,
        }
    }
}

/// Negative-acknowledgement header: 8 bytes after [`PathEth`] on `MR_NAK`; BTH.PSN is the
/// PSN of the packet that failed. MetaRoCE extension, see docs/PROTOCOL.md.
///
/// | Bytes | Field |
/// |---|---|
/// | 0 | syndrome (AETH coding: 0x20..=0x3F RNR NAK with the RNR timer code in bits 4:0; 0x61 invalid request, 0x62 remote access error, 0x63 remote operational error) |
/// | 1 | flags: bit 0 [`NakEth::FLAG_STREAM_REFUSED`]; bits 7:1 reserved, 0 |
/// | 2–3 | reserved, 0 |
/// | 4–7 | op id of the failed operation (WriteEth op id of the request, or of the READ/atomic a refused response answers; stream id for SEND) |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct NakEth {
    /// NAK syndrome (8 bits): an RNR NAK (`0x20 | timer code`), or one of
    /// [`Aeth::NAK_INVALID_REQUEST`], [`Aeth::NAK_REMOTE_ACCESS_ERROR`],
    /// [`Aeth::NAK_REMOTE_OPERATIONAL_ERROR`]. Not validated by the parser.
    pub syndrome: u8,
    /// Flags (8 bits): [`NakEth::FLAG_STREAM_REFUSED`]; the other bits are reserved (sent
    /// as 0; the parser clears them).
    pub flags: u8,
    /// Op id (32 bits) of the failed operation.
    pub op_id: u32,
}

impl NakEth {
    /// Size in bytes (8).
    pub const LEN: usize = 8;
    /// Syndrome: invalid request (0x61), as in the AETH.
    pub const INVALID_REQUEST: u8 = Aeth::NAK_INVALID_REQUEST;
    /// Syndrome: remote access error (0x62), as in the AETH.
    pub const REMOTE_ACCESS_ERROR: u8 = Aeth::NAK_REMOTE_ACCESS_ERROR;
    /// Syndrome: remote operational error (0x63), as in the AETH.
    pub const REMOTE_OPERATIONAL_ERROR: u8 = Aeth::NAK_REMOTE_OPERATIONAL_ERROR;
    /// Flag (with syndrome 0x61 on the NAK of an `MR_SEND`): the receiver refused the
    /// SEND's stream because its stream table is full (`max_streams`), and keeps no state
    /// for it. The sender fails the SEND with `RemoteInvalidRequest`, ends the stream
    /// (later SENDs on it flushed) and sends a stream abort from that message, which the
    /// receiver records as a closed stream id. See docs/PROTOCOL.md, "Refused streams".
    pub const FLAG_STREAM_REFUSED: u8 = 0x01;

    /// Parse the first 8 bytes of `b`; [`Error::Truncated`] if shorter.
    pub fn parse(b: &[u8]) -> Result<Self, Error> {
        let mut r = Reader::with_len(b, Self::LEN)?;
        let syndrome = r.u8()?;
        let flags = r.u8()? & Self::FLAG_STREAM_REFUSED;
        r.skip(2)?;
        Ok(NakEth {
            syndrome,
            flags,
            op_id: r.u32()?,
        })
    }

    /// Write 8 bytes to the start of `out`; [`Error::BufferTooSmall`] if shorter.
    pub fn emit(&self, out: &mut [u8]) -> Result<(), Error> {
        let mut w = Writer::with_len(out, Self::LEN)?;
        w.u8(self.syndrome)?;
        w.u8(self.flags)?;
        w.zeros(2)?;
        w.u32(self.op_id)
    }
}

/// Kind of an `MR_CONNECT` packet: byte 0 of [`ConnectEth`]. MetaRoCE extension, see
/// docs/PROTOCOL.md. Any other byte value is [`Error::BadField`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ConnectKind {
    /// 1: the initiator asks to open a connection.
    Request = 1,
    /// 2: the responder accepts a request.
    Accept = 2,
    /// 3: the responder refuses a request ([`ConnectEth::reason`] says why).
    Reject = 3,
    /// 4: the responder asks the initiator to repeat its request with the
    /// [`ConnectEth::cookie`] it carries (stateless address validation).
    Retry = 4,
    /// 5: the initiator confirms an Accept (both nonces echoed): the responder's
    /// connection stops being half-open.
    Confirm = 5,
}

impl TryFrom<u8> for ConnectKind {
    type Error = Error;

    fn try_from(v: u8) -> Result<Self, Error> {
        match v {
            1 => Ok(ConnectKind::Request),
            2 => Ok(ConnectKind::Accept),
            3 => Ok(ConnectKind::Reject),
            4 => Ok(ConnectKind::Retry),
            5 => Ok(ConnectKind::Confirm),
            _ => Err(Error::BadField("ConnectEth.kind")),
        }
    }
}

/// Connection set-up header: 60 bytes after the BTH on `MR_CONNECT`. MetaRoCE extension,
/// see docs/PROTOCOL.md ("Connection set-up"; protocol version 2, issue #9).
///
/// | Bytes | Field |
/// |---|---|
/// | 0 | kind ([`ConnectKind`]: 1 request, 2 accept, 3 reject, 4 retry, 5 confirm) |
/// | 1 | protocol version ([`ConnectEth::VERSION`] = 2) |
/// | 2–3 | path count (request: proposed; accept: agreed) |
/// | 4–7 | sender's QPN (low 24 bits, upper byte 0) |
/// | 8–11 | receiver's QPN (low 24 bits, upper byte 0; 0 in a request) |
/// | 12–13 | path MTU in payload bytes (256..=4096, a power of two) |
/// | 14–15 | UDP port where the sender listens (validated by the retry cookie) |
/// | 16–19 | initial PSN of every path (low 24 bits, upper byte 0) |
/// | 20–27 | client nonce (random, from the client's secret RNG) |
/// | 28–31 | kind = reject: reject reason. Request / accept: the sender's fair-share grant for its peer in Mbit/s (0 = none) |
/// | 32–39 | server nonce (accept, confirm; 0 otherwise) |
/// | 40–41 | flags: bit 0 = AEAD requested (request) / in use (accept) |
/// | 42–43 | reserved, 0 |
/// | 44–59 | retry cookie (retry; request repeated after a retry; 0 otherwise) |
///
/// The parser checks only `kind`; version, path count and MTU are left to the connection
/// logic so it can answer with a reject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnectEth {
    /// Request, accept, reject, retry or confirm (8 bits).
    pub kind: ConnectKind,
    /// Protocol version (8 bits), [`ConnectEth::VERSION`].
    pub version: u8,
    /// Number of paths (16 bits): proposed in a request, agreed in an accept.
    pub paths: u16,
    /// Sender's connection QPN (24 bits; masked on emit and parse).
    pub src_qpn: u32,
    /// Receiver's connection QPN (24 bits; masked on emit and parse); 0 in a request.
    pub dst_qpn: u32,
    /// Path MTU in payload bytes (16 bits): 256, 512, 1024, 2048 or 4096.
    pub pmtu: u16,
    /// UDP port (16 bits) on which the sender of this packet listens; the server sends to
    /// the Request's source IP at this port, validated by the retry cookie round trip.
    pub listen_port: u16,
    /// Initial PSN of every path (24 bits; masked on emit and parse).
    pub init_psn: u32,
    /// Client nonce (64 bits), from the client's secret RNG; half of the identity.
    pub nonce: u64,
    /// Reject reason (32 bits) when `kind` is [`ConnectKind::Reject`]; in a request or an
    /// accept, the same bytes carry the sender's grant ([`ConnectEth::grant_mbps`]).
    pub reason: u32,
    /// Server nonce (64 bits), from the server's secret RNG: the other half of the
    /// identity; in accept and confirm, 0 otherwise.
    pub server_nonce: u64,
    /// Flags (16 bits): [`ConnectEth::FLAG_AEAD`].
    pub flags: u16,
    /// Retry cookie (16 bytes): set by the server in a retry, echoed by the client in the
    /// repeated request; zero otherwise.
    pub cookie: [u8; 16],
}

impl ConnectEth {
    /// Size in bytes (60).
    pub const LEN: usize = 60;
    /// The protocol version this crate speaks (2: identity, tokens and retry cookies).
    pub const VERSION: u8 = 2;
    /// Flag bit 0: AEAD packet protection requested (request) / in use (accept).
    pub const FLAG_AEAD: u16 = 0x0001;
    /// Flag bit 1 (Reject only): the refusal is temporary and set by the core, not by an
    /// application (whose codes share the reason field): the requester sends its Request
    /// again on its handshake timer. Set with [`REASON_SOURCE_LIMIT`](Self::REASON_SOURCE_LIMIT),
    /// and with [`REASON_LIMIT`](Self::REASON_LIMIT) when the half-open table is full of
    /// connections younger than a handshake interval (a flood faster than the table turns
    /// over).
    pub const FLAG_TRY_AGAIN: u16 = 0x0002;
    /// Reject reason 1: not accepting connections.
    pub const REASON_NOT_ACCEPTING: u32 = 1;
    /// Reject reason 2: connection limit reached with no connection half-open (a full
    /// half-open table evicts its oldest entry instead, `EndpointConfig::max_half_open`).
    pub const REASON_LIMIT: u32 = 2;
    /// Reject reason 3: invalid request (version, path count, path MTU).
    pub const REASON_INVALID: u32 = 3;
    /// Reject reason 4: packet protection (AEAD) mismatch between the two ends.
    pub const REASON_AEAD_MISMATCH: u32 = 4;
    /// Reject reason 5: too many half-open connections from the requester's source address
    /// (`EndpointConfig::max_half_open_per_source`); the requester may try again once its
    /// earlier connections are confirmed.
    pub const REASON_SOURCE_LIMIT: u32 = 5;

    /// A message of `kind` with every other field 0 and the current version.
    pub fn new(kind: ConnectKind) -> Self {
        ConnectEth {
            kind,
            version: Self::VERSION,
            paths: 0,
            src_qpn: 0,
            dst_qpn: 0,
            pmtu: 0,
            listen_port: 0,
            init_psn: 0,
            nonce: 0,
            reason: 0,
            server_nonce: 0,
            flags: 0,
            cookie: [0; 16],
        }
    }

    /// The rate (Mbit/s, 0 = no limit) the sender of this request or accept grants its
    /// peer, as its ACKs will (receiver-driven fair share): bytes 28–31, which a reject
    /// uses for the reason. 0 for a reject.
    pub fn grant_mbps(&self) -> u32 {
        if self.kind == ConnectKind::Reject {
            0
        } else {
            self.reason
        }
    }

    /// Parse the first 60 bytes of `b`. Errors: [`Error::Truncated`] if shorter,
    /// [`Error::BadField`]`("ConnectEth.kind")` for a kind other than 1..=5.
    pub fn parse(b: &[u8]) -> Result<Self, Error> {
        let mut r = Reader::with_len(b, Self::LEN)?;
        let kind = ConnectKind::try_from(r.u8()?)?;
        let version = r.u8()?;
        let paths = r.u16()?;
        let src_qpn = r.u32()? & PSN_MASK;
        let dst_qpn = r.u32()? & PSN_MASK;
        let pmtu = r.u16()?;
        let listen_port = r.u16()?;
        let init_psn = r.u32()? & PSN_MASK;
        let nonce = r.u64()?;
        let reason = r.u32()?;
        let server_nonce = r.u64()?;
        let flags = r.u16()?;
        r.skip(2)?;
        Ok(ConnectEth {
            kind,
            version,
            paths,
            src_qpn,
            dst_qpn,
            pmtu,
            listen_port,
            init_psn,
            nonce,
            reason,
            server_nonce,
            flags,
            cookie: r.array()?,
        })
    }

    /// Write 60 bytes to the start of `out` (QPNs and PSN masked to 24 bits);
    /// [`Error::BufferTooSmall`] if shorter.
    pub fn emit(&self, out: &mut [u8]) -> Result<(), Error> {
        let mut w = Writer::with_len(out, Self::LEN)?;
        w.u8(self.kind as u8)?;
        w.u8(self.version)?;
        w.u16(self.paths)?;
        w.u32(self.src_qpn & PSN_MASK)?;
        w.u32(self.dst_qpn & PSN_MASK)?;
        w.u16(self.pmtu)?;
        w.u16(self.listen_port)?;
        w.u32(self.init_psn & PSN_MASK)?;
        w.u64(self.nonce)?;
        w.u32(self.reason)?;
        w.u64(self.server_nonce)?;
        w.u16(self.flags)?;
        w.zeros(2)?;
        w.bytes(&self.cookie)
    }
}

/// Connection tear-down header: 16 bytes after the BTH on `MR_CLOSE`. MetaRoCE extension,
/// see docs/PROTOCOL.md. A close (flags bit 0 clear) may carry up to 256 bytes of
/// application reason as payload; its answer (flags bit 0 set) carries none.
///
/// | Bytes | Field |
/// |---|---|
/// | 0–3 | reason code (0 = normal close by the application; the application's code) |
/// | 4 | flags (8 bits): bit 0 = [`CloseEth::FLAG_ACK`]; bits 7:1 reserved, 0 |
/// | 5 | reserved, 0 |
/// | 6–7 | reply port: the UDP port the sender listens on, where the answer goes |
/// | 8–15 | connection nonce (the [`ConnectEth::nonce`] of the incarnation being closed) |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CloseEth {
    /// Reason code (32 bits); [`CloseEth::REASON_NORMAL`] = 0, others defined by the
    /// application (1 is used by the core to drop a ghost connection).
    pub reason: u32,
    /// Flag bits (8 bits): [`CloseEth::FLAG_ACK`]. Reserved bits are ignored on parse.
    pub flags: u8,
    /// The sender's listening UDP port (16 bits): the answer to a close goes there. 0 in
    /// packets of senders that predate it; the receiver then answers the source port.
    pub reply_port: u16,
    /// Nonce (64 bits) of the connection incarnation being closed.
    pub nonce: u64,
}

impl CloseEth {
    /// Size in bytes (16).
    pub const LEN: usize = 16;
    /// Reason 0: orderly close requested by the application.
    pub const REASON_NORMAL: u32 = 0;
    /// Flag bit 0: this packet answers a close (the close was received); it carries no
    /// payload and is never answered itself.
    pub const FLAG_ACK: u8 = 0x01;

    /// True when [`CloseEth::FLAG_ACK`] is set.
    pub fn is_ack(&self) -> bool {
        self.flags & Self::FLAG_ACK != 0
    }

    /// Parse the first 16 bytes of `b`; [`Error::Truncated`] if shorter.
    pub fn parse(b: &[u8]) -> Result<Self, Error> {
        let mut r = Reader::with_len(b, Self::LEN)?;
        let reason = r.u32()?;
        let flags = r.u8()? & Self::FLAG_ACK;
        r.skip(1)?;
        let reply_port = r.u16()?;
        Ok(CloseEth {
            reason,
            flags,
            reply_port,
            nonce: r.u64()?,
        })
    }

    /// Write 16 bytes to the start of `out`; [`Error::BufferTooSmall`] if shorter.
    pub fn emit(&self, out: &mut [u8]) -> Result<(), Error> {
        let mut w = Writer::with_len(out, Self::LEN)?;
        w.u32(self.reason)?;
        w.u8(self.flags & Self::FLAG_ACK)?;
        w.zeros(1)?;
        w.u16(self.reply_port)?;
        w.u64(self.nonce)
    }
}
