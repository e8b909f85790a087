//! BTH opcodes and the table of extension headers each one implies.

use core::fmt;

/// The 8-bit BTH OpCode (byte 0 of the BTH).
///
/// Bits 7:5 select the transport (`000` RC, `011` UD, `100` CNP, `110` MetaRoCE), bits 4:0 the
/// operation. The opcode alone determines which extension headers follow the BTH
/// (see [`header_len`](super::header_len)). Source: IBA Vol. 1 §9.2 (BTH OpCode field);
/// CNP: RoCEv2 Annex A17; `MR_*`: MetaRoCE extension, see docs/PROTOCOL.md.
///
/// Any byte value can be held; [`Opcode::is_known`] tells whether this crate can parse packets
/// carrying it. UC (`0x20..=0x2B`), RD (`0x40..=0x5F`), FLUSH (`0x1C`) and ATOMIC_WRITE (`0x1D`)
/// are deliberately not supported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Opcode(pub u8);

/// Transport class of an opcode, from bits 7:5 (IBA Vol. 1 §9.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Transport {
    /// `000`: Reliable Connected (IBA).
    Rc,
    /// `001`: Unreliable Connected (IBA; not parsed by this crate).
    Uc,
    /// `010`: Reliable Datagram (IBA; never used on RoCE).
    Rd,
    /// `011`: Unreliable Datagram (IBA).
    Ud,
    /// `100`: CNP (RoCEv2 Annex A17).
    Cnp,
    /// `101`: reserved.
    Reserved,
    /// `110`: MetaRoCE (manufacturer-specific range; MetaRoCE extension, see docs/PROTOCOL.md).
    MetaRoce,
    /// `111`: other manufacturer-specific opcodes.
    Vendor,
}

impl Opcode {
    /// `0x00` RC SEND First: no extension headers (12-byte header), payload = PMTU. IBA Vol. 1 §9.2.
    pub const RC_SEND_FIRST: Opcode = Opcode(0x00);
    /// `0x01` RC SEND Middle: no extension headers (12-byte header), payload = PMTU. IBA Vol. 1 §9.2.
    pub const RC_SEND_MIDDLE: Opcode = Opcode(0x01);
    /// `0x02` RC SEND Last: no extension headers (12-byte header), payload 1..PMTU. IBA Vol. 1 §9.2.
    pub const RC_SEND_LAST: Opcode = Opcode(0x02);
    /// `0x03` RC SEND Last with Immediate: ImmDt (4 B) → 16-byte header. IBA Vol. 1 §9.2.
    pub const RC_SEND_LAST_WITH_IMMEDIATE: Opcode = Opcode(0x03);
    /// `0x04` RC SEND Only: no extension headers (12-byte header), payload 0..PMTU. IBA Vol. 1 §9.2.
    pub const RC_SEND_ONLY: Opcode = Opcode(0x04);
    /// `0x05` RC SEND Only with Immediate: ImmDt (4 B) → 16-byte header. IBA Vol. 1 §9.2.
    pub const RC_SEND_ONLY_WITH_IMMEDIATE: Opcode = Opcode(0x05);
    /// `0x06` RC RDMA WRITE First: RETH (16 B) → 28-byte header. IBA Vol. 1 §9.2.
    pub const RC_RDMA_WRITE_FIRST: Opcode = Opcode(0x06);
    /// `0x07` RC RDMA WRITE Middle: no extension headers (12-byte header). IBA Vol. 1 §9.2.
    pub const RC_RDMA_WRITE_MIDDLE: Opcode = Opcode(0x07);
    /// `0x08` RC RDMA WRITE Last: no extension headers (12-byte header). IBA Vol. 1 §9.2.
    pub const RC_RDMA_WRITE_LAST: Opcode = Opcode(0x08);
    /// `0x09` RC RDMA WRITE Last with Immediate: ImmDt (4 B) → 16-byte header. IBA Vol. 1 §9.2.
    pub const RC_RDMA_WRITE_LAST_WITH_IMMEDIATE: Opcode = Opcode(0x09);
    /// `0x0A` RC RDMA WRITE Only: RETH (16 B) → 28-byte header. IBA Vol. 1 §9.2.
    pub const RC_RDMA_WRITE_ONLY: Opcode = Opcode(0x0A);
    /// `0x0B` RC RDMA WRITE Only with Immediate: RETH (16 B) + ImmDt (4 B) → 32-byte header.
    /// IBA Vol. 1 §9.2.
    pub const RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE: Opcode = Opcode(0x0B);
    /// `0x0C` RC RDMA READ Request: RETH (16 B) → 28-byte header, no payload. IBA Vol. 1 §9.2.
    pub const RC_RDMA_READ_REQUEST: Opcode = Opcode(0x0C);
    /// `0x0D` RC RDMA READ Response First: AETH (4 B) → 16-byte header. IBA Vol. 1 §9.2.
    pub const RC_RDMA_READ_RESPONSE_FIRST: Opcode = Opcode(0x0D);
    /// `0x0E` RC RDMA READ Response Middle: no extension headers (12-byte header). IBA Vol. 1 §9.2.
    pub const RC_RDMA_READ_RESPONSE_MIDDLE: Opcode = Opcode(0x0E);
    /// `0x0F` RC RDMA READ Response Last: AETH (4 B) → 16-byte header. IBA Vol. 1 §9.2.
    pub const RC_RDMA_READ_RESPONSE_LAST: Opcode = Opcode(0x0F);
    /// `0x10` RC RDMA READ Response Only: AETH (4 B) → 16-byte header. IBA Vol. 1 §9.2.
    pub const RC_RDMA_READ_RESPONSE_ONLY: Opcode = Opcode(0x10);
    /// `0x11` RC Acknowledge (ACK / RNR NAK / NAK): AETH (4 B) → 16-byte header. IBA Vol. 1 §9.2.
    pub const RC_ACKNOWLEDGE: Opcode = Opcode(0x11);
    /// `0x12` RC ATOMIC Acknowledge: AETH (4 B) + AtomicAckETH (8 B) → 24-byte header.
    /// IBA Vol. 1 §9.2.
    pub const RC_ATOMIC_ACKNOWLEDGE: Opcode = Opcode(0x12);
    /// `0x13` RC CmpSwap: AtomicETH (28 B) → 40-byte header. IBA Vol. 1 §9.2.
    pub const RC_COMPARE_SWAP: Opcode = Opcode(0x13);
    /// `0x14` RC FetchAdd: AtomicETH (28 B) → 40-byte header. IBA Vol. 1 §9.2.
    pub const RC_FETCH_ADD: Opcode = Opcode(0x14);
    /// `0x16` RC SEND Last with Invalidate: IETH (4 B) → 16-byte header. IBA Vol. 1 §9.2.
    pub const RC_SEND_LAST_WITH_INVALIDATE: Opcode = Opcode(0x16);
    /// `0x17` RC SEND Only with Invalidate: IETH (4 B) → 16-byte header. IBA Vol. 1 §9.2.
    pub const RC_SEND_ONLY_WITH_INVALIDATE: Opcode = Opcode(0x17);

    /// `0x64` UD SEND Only: DETH (8 B) → 20-byte header. IBA Vol. 1 §9.2.
    pub const UD_SEND_ONLY: Opcode = Opcode(0x64);
    /// `0x65` UD SEND Only with Immediate: DETH (8 B) + ImmDt (4 B) → 24-byte header.
    /// IBA Vol. 1 §9.2.
    pub const UD_SEND_ONLY_WITH_IMMEDIATE: Opcode = Opcode(0x65);

    /// `0x81` Congestion Notification Packet: 16 reserved zero bytes → 28-byte header, no
    /// payload. RoCEv2 Annex A17.
    pub const CNP: Opcode = Opcode(0x81);

    /// `0xC0` MetaRoCE CONNECT (request / accept / reject): [`ConnectEth`](super::ConnectEth)
    /// (32 B) → 44-byte header, no payload. MetaRoCE extension, see docs/PROTOCOL.md.
    pub const MR_CONNECT: Opcode = Opcode(0xC0);
    /// `0xC1` MetaRoCE ACK: [`AckEth`](super::AckEth) (48 B) → 60-byte header, no payload.
    /// MetaRoCE extension, see docs/PROTOCOL.md.
    pub const MR_ACK: Opcode = Opcode(0xC1);
    /// `0xC2` MetaRoCE SEND: [`PathEth`](super::PathEth) (12 B) + [`SendEth`](super::SendEth)
    /// (16 B) → 40-byte header. MetaRoCE extension, see docs/PROTOCOL.md.
    pub const MR_SEND: Opcode = Opcode(0xC2);
    /// `0xC3` MetaRoCE WRITE: PathEth (12 B) + RETH (16 B) + [`WriteEth`](super::WriteEth)
    /// (8 B) → 48-byte header. MetaRoCE extension, see docs/PROTOCOL.md.
    pub const MR_WRITE: Opcode = Opcode(0xC3);
    /// `0xC4` MetaRoCE WRITE with Immediate: PathEth + RETH + WriteEth + ImmDt (4 B) →
    /// 52-byte header. MetaRoCE extension, see docs/PROTOCOL.md.
    pub const MR_WRITE_WITH_IMMEDIATE: Opcode = Opcode(0xC4);
    /// `0xC5` MetaRoCE NAK: PathEth (12 B) + [`NakEth`](super::NakEth) (8 B) → 32-byte header,
    /// no payload. MetaRoCE extension, see docs/PROTOCOL.md.
    pub const MR_NAK: Opcode = Opcode(0xC5);
    /// `0xC6` MetaRoCE CLOSE: [`CloseEth`](super::CloseEth) (16 B) → 28-byte header, no
    /// payload. MetaRoCE extension, see docs/PROTOCOL.md.
    pub const MR_CLOSE: Opcode = Opcode(0xC6);
    /// `0xC7` MetaRoCE RDMA READ request: PathEth (12 B) + RETH (16 B) + WriteEth (8 B, the
    /// operation id; offset 0) → 48-byte header, no payload. MetaRoCE extension, see
    /// docs/PROTOCOL.md.
    pub const MR_READ_REQUEST: Opcode = Opcode(0xC7);
    /// `0xC8` MetaRoCE RDMA READ response: PathEth (12 B) + WriteEth (8 B: the READ's
    /// operation id and this packet's offset) → 32-byte header, 0..PMTU payload.
    pub const MR_READ_RESPONSE: Opcode = Opcode(0xC8);
    /// `0xC9` MetaRoCE atomic compare-and-swap: PathEth (12 B) + AtomicEth (28 B) +
    /// WriteEth (8 B, operation id) → 60-byte header, no payload.
    pub const MR_COMPARE_SWAP: Opcode = Opcode(0xC9);
    /// `0xCA` MetaRoCE atomic fetch-and-add: same headers as `MR_COMPARE_SWAP`.
    pub const MR_FETCH_ADD: Opcode = Opcode(0xCA);
    /// `0xCB` MetaRoCE atomic response: PathEth (12 B) + WriteEth (8 B, the atomic's
    /// operation id) + AtomicAckEth (8 B, the original value) → 40-byte header, no payload.
    pub const MR_ATOMIC_RESPONSE: Opcode = Opcode(0xCB);

    /// True for the MetaRoCE/manufacturer range `0xC0..=0xFF` (transport bits `11x`).
    /// Only `0xC0..=0xCB` are defined; see [`Opcode::is_known`].
    pub fn is_metaroce(self) -> bool {
        self.0 >= 0xC0
    }

    /// True when this crate knows the header layout of the opcode (every `RC_*`, `UD_*`,
    /// `CNP` and `MR_*` constant), i.e. [`header_len`](super::header_len) is `Ok`.
    pub fn is_known(self) -> bool {
        super::header_len(self).is_ok()
    }

    /// Transport class from bits 7:5 (IBA Vol. 1 §9.2).
    pub fn transport(self) -> Transport {
        match self.0 >> 5 {
            0 => Transport::Rc,
            1 => Transport::Uc,
            2 => Transport::Rd,
            3 => Transport::Ud,
            4 => Transport::Cnp,
            5 => Transport::Reserved,
            6 => Transport::MetaRoce,
            _ => Transport::Vendor,
        }
    }

    /// The constant's name without its type, e.g. `"RC_SEND_ONLY"`, `"MR_ACK"`; `"UNKNOWN"`
    /// for opcodes this crate does not define.
    pub fn name(&self) -> &'static str {
        match self.0 {
            0x00 => "RC_SEND_FIRST",
            0x01 => "RC_SEND_MIDDLE",
            0x02 => "RC_SEND_LAST",
            0x03 => "RC_SEND_LAST_WITH_IMMEDIATE",
            0x04 => "RC_SEND_ONLY",
            0x05 => "RC_SEND_ONLY_WITH_IMMEDIATE",
            0x06 => "RC_RDMA_WRITE_FIRST",
            0x07 => "RC_RDMA_WRITE_MIDDLE",
            0x08 => "RC_RDMA_WRITE_LAST",
            0x09 => "RC_RDMA_WRITE_LAST_WITH_IMMEDIATE",
            0x0A => "RC_RDMA_WRITE_ONLY",
            0x0B => "RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE",
            0x0C => "RC_RDMA_READ_REQUEST",
            0x0D => "RC_RDMA_READ_RESPONSE_FIRST",
            0x0E => "RC_RDMA_READ_RESPONSE_MIDDLE",
            0x0F => "RC_RDMA_READ_RESPONSE_LAST",
            0x10 => "RC_RDMA_READ_RESPONSE_ONLY",
            0x11 => "RC_ACKNOWLEDGE",
            0x12 => "RC_ATOMIC_ACKNOWLEDGE",
            0x13 => "RC_COMPARE_SWAP",
            0x14 => "RC_FETCH_ADD",
            0x16 => "RC_SEND_LAST_WITH_INVALIDATE",
            0x17 => "RC_SEND_ONLY_WITH_INVALIDATE",
            0x64 => "UD_SEND_ONLY",
            0x65 => "UD_SEND_ONLY_WITH_IMMEDIATE",
            0x81 => "CNP",
            0xC0 => "MR_CONNECT",
            0xC1 => "MR_ACK",
            0xC2 => "MR_SEND",
            0xC3 => "MR_WRITE",
            0xC4 => "MR_WRITE_WITH_IMMEDIATE",
            0xC5 => "MR_NAK",
            0xC6 => "MR_CLOSE",
            0xC7 => "MR_READ_REQUEST",
            0xC8 => "MR_READ_RESPONSE",
            0xC9 => "MR_COMPARE_SWAP",
            0xCA => "MR_FETCH_ADD",
            0xCB => "MR_ATOMIC_RESPONSE",
            _ => "UNKNOWN",
        }
    }
}

impl fmt::Display for Opcode {
    /// The name, or `UNKNOWN(0xNN)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_known() {
            f.write_str(self.name())
        } else {
            write!(f, "UNKNOWN(0x{:02x})", self.0)
        }
    }
}

impl From<u8> for Opcode {
    fn from(v: u8) -> Self {
        Opcode(v)
    }
}

impl From<Opcode> for u8 {
    fn from(v: Opcode) -> Self {
        v.0
    }
}

/// Which standard extension headers an RC opcode carries (reference opcode table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct RcSet {
    pub reth: bool,
    pub aeth: bool,
    pub atomic: bool,
    pub atomic_ack: bool,
    pub imm: bool,
    pub ieth: bool,
}

/// The header shape an opcode prescribes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    Rc(RcSet),
    Ud { imm: bool },
    Cnp,
    Connect,
    Ack,
    Send,
    Write { imm: bool },
    Nak,
    Close,
    ReadRequest,
    ReadResponse,
    Atomic,
    AtomicResponse,
}

/// The layout of a known opcode, `None` for everything this crate does not parse: the
/// opcode table itself (IBA Vol. 1 §9.2, RoCEv2 Annex A17, docs/PROTOCOL.md), from which
/// `wire::headers` builds its per-opcode table at compile time (issue #13: one load per
/// packet instead of this match).
pub(crate) const fn layout_of(op: u8) -> Option<Layout> {
    const NONE: RcSet = RcSet {
        reth: false,
        aeth: false,
        atomic: false,
        atomic_ack: false,
        imm: false,
        ieth: false,
    };
    let rc = match op {
        0x00 | 0x01 | 0x02 | 0x04 | 0x07 | 0x08 | 0x0E => NONE,
        0x03 | 0x05 | 0x09 => RcSet { imm: true, ..NONE },
        0x06 | 0x0A | 0x0C => RcSet { reth: true, ..NONE },
        0x0B => RcSet {
            reth: true,
            imm: true,
            ..NONE
        },
        0x0D | 0x0F | 0x10 | 0x11 => RcSet { aeth: true, ..NONE },
        0x12 => RcSet {
            aeth: true,
            atomic_ack: true,
            ..NONE
        },
        0x13 | 0x14 => RcSet {
            atomic: true,
            ..NONE
        },
        0x16 | 0x17 => RcSet { ieth: true, ..NONE },
        _ => {
            return match op {
                0x64 => Some(Layout::Ud { imm: false }),
                0x65 => Some(Layout::Ud { imm: true }),
                0x81 => Some(Layout::Cnp),
                0xC0 => Some(Layout::Connect),
                0xC1 => Some(Layout::Ack),
                0xC2 => Some(Layout::Send),
                0xC3 => Some(Layout::Write { imm: false }),
                0xC4 => Some(Layout::Write { imm: true }),
                0xC5 => Some(Layout::Nak),
                0xC6 => Some(Layout::Close),
                0xC7 => Some(Layout::ReadRequest),
                0xC8 => Some(Layout::ReadResponse),
                0xC9 | 0xCA => Some(Layout::Atomic),
                0xCB => Some(Layout::AtomicResponse),
                _ => None,
            }
        }
    };
    Some(Layout::Rc(rc))
}
