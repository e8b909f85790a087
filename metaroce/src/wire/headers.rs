//! The extension-header sequence that follows the BTH, selected by the opcode.

use super::cursor::Writer;
use super::opcode::{layout_of, Layout, RcSet};
use super::{
    AckEth, Aeth, AtomicAckEth, AtomicEth, CloseEth, ConnectEth, Deth, Error, NakEth, Opcode,
    PathEth, Reth, SendEth, WriteEth, BTH_LEN,
};

/// Size of an ImmDt or IETH field in bytes (4). IBA Vol. 1 §9.3.
pub const IMM_LEN: usize = 4;
/// Size of the CNP body after the BTH: 16 reserved zero bytes. RoCEv2 Annex A17.
pub const CNP_RESERVED_LEN: usize = 16;

/// Which headers follow the BTH; the variant is fully determined by the opcode (see
/// [`header_len`] and [`Headers::matches_opcode`]).
///
/// Sources: `Rc` / `Ud` IBA Vol. 1 §9.2–9.3; `Cnp` RoCEv2 Annex A17; the rest MetaRoCE
/// extension, see docs/PROTOCOL.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Headers {
    /// `MR_CONNECT`: ConnectEth (32 B).
    Connect(ConnectEth),
    /// `MR_ACK`: AckEth (48 B).
    Ack(AckEth),
    /// `MR_SEND`: PathEth (12 B), SendEth (16 B).
    Send {
        /// Per-path header.
        path: PathEth,
        /// Stream / message placement.
        send: SendEth,
    },
    /// `MR_WRITE` / `MR_WRITE_WITH_IMMEDIATE`: PathEth (12 B), RETH (16 B), WriteEth (8 B),
    /// then ImmDt (4 B) iff the opcode is `MR_WRITE_WITH_IMMEDIATE`.
    Write {
        /// Per-path header.
        path: PathEth,
        /// Target of the whole message (VA of its first byte, R_Key, total length).
        reth: Reth,
        /// Operation id and this packet's offset within the message.
        write: WriteEth,
        /// Immediate data (32 bits), present on every packet of `MR_WRITE_WITH_IMMEDIATE`.
        imm: Option<u32>,
    },
    /// `MR_NAK`: PathEth (12 B), NakEth (8 B).
    Nak {
        /// Per-path header (path of the failed packet).
        path: PathEth,
        /// Syndrome and failed operation.
        nak: NakEth,
    },
    /// `MR_CLOSE`: CloseEth (16 B).
    Close(CloseEth),
    /// `MR_READ_REQUEST`: PathEth (12 B), RETH (16 B: source VA, R_Key, length), WriteEth
    /// (8 B: operation id, offset 0).
    ReadRequest {
        /// Per-path header.
        path: PathEth,
        /// What to read at the responder.
        reth: Reth,
        /// Operation id.
        op: WriteEth,
    },
    /// `MR_READ_RESPONSE`: PathEth (12 B), WriteEth (8 B: the READ's operation id and this
    /// packet's offset in the read data).
    ReadResponse {
        /// Per-path header (the responder's path).
        path: PathEth,
        /// Operation id and offset.
        op: WriteEth,
    },
    /// `MR_COMPARE_SWAP` / `MR_FETCH_ADD`: PathEth (12 B), AtomicEth (28 B), WriteEth (8 B:
    /// operation id).
    Atomic {
        /// Per-path header.
        path: PathEth,
        /// Target and operands.
        atomic: AtomicEth,
        /// Operation id.
        op: WriteEth,
    },
    /// `MR_ATOMIC_RESPONSE`: PathEth (12 B), WriteEth (8 B: operation id), AtomicAckEth
    /// (8 B: the value before the operation).
    AtomicResponse {
        /// Per-path header (the responder's path).
        path: PathEth,
        /// Operation id.
        op: WriteEth,
        /// Original value.
        ack: AtomicAckEth,
    },
    /// RC opcodes `0x00..=0x17`: the headers the IBA opcode table prescribes, on the wire in
    /// the order RETH, AETH, AtomicETH, AtomicAckETH, ImmDt, IETH (only the present ones).
    Rc {
        /// RETH (16 B): WRITE First/Only, READ Request.
        reth: Option<Reth>,
        /// AETH (4 B): READ Response First/Last/Only, Acknowledge, Atomic Acknowledge.
        aeth: Option<Aeth>,
        /// AtomicETH (28 B): CmpSwap, FetchAdd.
        atomic: Option<AtomicEth>,
        /// AtomicAckETH (8 B): Atomic Acknowledge.
        atomic_ack: Option<AtomicAckEth>,
        /// ImmDt (4 B, opaque 32 bits): the `*_WITH_IMMEDIATE` opcodes.
        imm: Option<u32>,
        /// IETH (4 B, R_Key to invalidate): the `*_WITH_INVALIDATE` opcodes.
        ieth: Option<u32>,
    },
    /// UD opcodes `0x64` / `0x65`: DETH (8 B), then ImmDt (4 B) iff `0x65`.
    Ud {
        /// Datagram header.
        deth: Deth,
        /// Immediate data (32 bits), present iff `UD_SEND_ONLY_WITH_IMMEDIATE`.
        imm: Option<u32>,
    },
    /// CNP (`0x81`): 16 reserved bytes, sent as zero and ignored on receive.
    Cnp,
}

const fn rc_len(s: RcSet) -> usize {
    let mut n = 0;
    if s.reth {
        n += Reth::LEN;
    }
    if s.aeth {
        n += Aeth::LEN;
    }
    if s.atomic {
        n += AtomicEth::LEN;
    }
    if s.atomic_ack {
        n += AtomicAckEth::LEN;
    }
    if s.imm {
        n += IMM_LEN;
    }
    if s.ieth {
        n += IMM_LEN;
    }
    n
}

const fn layout_len(l: Layout) -> usize {
    match l {
        Layout::Rc(s) => rc_len(s),
        Layout::Ud { imm } => Deth::LEN + if imm { IMM_LEN } else { 0 },
        Layout::Cnp => CNP_RESERVED_LEN,
        Layout::Connect => ConnectEth::LEN,
        Layout::Ack => AckEth::LEN,
        Layout::Send => PathEth::LEN + SendEth::LEN,
        Layout::Write { imm } => {
            PathEth::LEN + Reth::LEN + WriteEth::LEN + if imm { IMM_LEN } else { 0 }
        }
        Layout::Nak => PathEth::LEN + NakEth::LEN,
        Layout::Close => CloseEth::LEN,
        Layout::ReadRequest => PathEth::LEN + Reth::LEN + WriteEth::LEN,
        Layout::ReadResponse => PathEth::LEN + WriteEth::LEN,
        Layout::Atomic => PathEth::LEN + AtomicEth::LEN + WriteEth::LEN,
        Layout::AtomicResponse => PathEth::LEN + WriteEth::LEN + AtomicAckEth::LEN,
    }
}

/// Header length in bytes from the start of the BTH to the start of the payload (BTH 12 B +
/// extension headers) implied by `op`, per the IBA opcode table (IBA Vol. 1 §9.2), RoCEv2
/// Annex A17 (CNP) and the MetaRoCE extension (docs/PROTOCOL.md).
///
/// Errors: [`Error::UnknownOpcode`] for reserved, undefined or unsupported opcodes (UC, RD,
/// FLUSH, ATOMIC_WRITE, the undefined MetaRoCE opcodes `0xCC..=0xFF`, …).
pub fn header_len(op: Opcode) -> Result<usize, Error> {
    match SHAPES[op.0 as usize] {
        Some((_, n)) => Ok(BTH_LEN + n as usize),
        None => Err(Error::UnknownOpcode(op.0)),
    }
}

/// Every opcode's layout with the length of its extension headers (at most 48 bytes),
/// looked up once per parse instead of matched (issue #13); the one per-opcode table.
static SHAPES: [Option<(Layout, u8)>; 256] = {
    let mut t = [None; 256];
    let mut i = 0;
    while i < 256 {
        if let Some(l) = layout_of(i as u8) {
            t[i] = Some((l, layout_len(l) as u8));
        }
        i += 1;
    }
    t
};

/// Returns the slice of `b` from `off`, or an empty slice past the end (the next header
/// parse then reports the truncation).
fn from(b: &[u8], off: usize) -> &[u8] {
    b.get(off..).unwrap_or(&[])
}

/// If `present`, parse the `len`-byte header at `b[*off..]` with `parse` and advance `*off`
/// past it; `None` (nothing read) otherwise. The parse side of [`put`].
fn take<T>(
    present: bool,
    b: &[u8],
    off: &mut usize,
    len: usize,
    parse: impl FnOnce(&[u8]) -> Result<T, Error>,
) -> Result<Option<T>, Error> {
    if !present {
        return Ok(None);
    }
    let v = parse(from(b, *off))?;
    *off += len;
    Ok(Some(v))
}

/// Run `f` on `out[*off..]` and advance `*off` by `len` (the size `f` writes).
fn put(
    out: &mut [u8],
    off: &mut usize,
    len: usize,
    f: impl FnOnce(&mut [u8]) -> Result<(), Error>,
) -> Result<(), Error> {
    let got = out.len();
    let dst = out.get_mut(*off..).ok_or(Error::BufferTooSmall {
        needed: off.saturating_add(len),
        got,
    })?;
    f(dst)?;
    *off += len;
    Ok(())
}

/// A 4-byte big-endian ImmDt / IETH value at the start of `out`.
fn emit_u32(v: u32, out: &mut [u8]) -> Result<(), Error> {
    Writer::with_len(out, IMM_LEN)?.u32(v)
}

fn u32_at(b: &[u8], off: usize) -> Result<u32, Error> {
    let got = b.len();
    let s = b
        .get(off..off.saturating_add(IMM_LEN))
        .ok_or(Error::Truncated {
            needed: off.saturating_add(IMM_LEN),
            got,
        })?;
    let a = <[u8; IMM_LEN]>::try_from(s).map_err(|_| Error::BadLength)?;
    Ok(u32::from_be_bytes(a))
}

impl Headers {
    /// Parse the extension headers that `op` prescribes from `b`, the bytes right after the
    /// BTH. Reads exactly `header_len(op)? - 12` bytes; anything after them is payload.
    ///
    /// Errors: [`Error::UnknownOpcode`], [`Error::Truncated`] (sizes relative to `b`),
    /// [`Error::BadField`] from a header with an undefined enum value.
    pub fn parse(op: Opcode, b: &[u8]) -> Result<Headers, Error> {
        let (l, need) = SHAPES[op.0 as usize].ok_or(Error::UnknownOpcode(op.0))?;
        let need = need as usize;
        if b.len() < need {
            return Err(Error::Truncated {
                needed: need,
                got: b.len(),
            });
        }
        let h = match l {
            Layout::Rc(s) => {
                let mut off = 0;
                let reth = take(s.reth, b, &mut off, Reth::LEN, Reth::parse)?;
                let aeth = take(s.aeth, b, &mut off, Aeth::LEN, Aeth::parse)?;
                let atomic = take(s.atomic, b, &mut off, AtomicEth::LEN, AtomicEth::parse)?;
                let atomic_ack = take(
                    s.atomic_ack,
                    b,
                    &mut off,
                    AtomicAckEth::LEN,
                    AtomicAckEth::parse,
                )?;
                let imm = take(s.imm, b, &mut off, IMM_LEN, |b| u32_at(b, 0))?;
                let ieth = take(s.ieth, b, &mut off, IMM_LEN, |b| u32_at(b, 0))?;
                Headers::Rc {
                    reth,
                    aeth,
                    atomic,
                    atomic_ack,
                    imm,
                    ieth,
                }
            }
            Layout::Ud { imm } => Headers::Ud {
                deth: Deth::parse(b)?,
                imm: if imm {
                    Some(u32_at(b, Deth::LEN)?)
                } else {
                    None
                },
            },
            Layout::Cnp => Headers::Cnp,
            Layout::Connect => Headers::Connect(ConnectEth::parse(b)?),
            Layout::Ack => Headers::Ack(AckEth::parse(b)?),
            Layout::Send => Headers::Send {
                path: PathEth::parse(b)?,
                send: SendEth::parse(from(b, PathEth::LEN))?,
            },
            Layout::Write { imm } => Headers::Write {
                path: PathEth::parse(b)?,
                reth: Reth::parse(from(b, PathEth::LEN))?,
                write: WriteEth::parse(from(b, PathEth::LEN + Reth::LEN))?,
                imm: if imm {
                    Some(u32_at(b, PathEth::LEN + Reth::LEN + WriteEth::LEN)?)
                } else {
                    None
                },
            },
            Layout::Nak => Headers::Nak {
                path: PathEth::parse(b)?,
                nak: NakEth::parse(from(b, PathEth::LEN))?,
            },
            Layout::Close => Headers::Close(CloseEth::parse(b)?),
            Layout::ReadRequest => Headers::ReadRequest {
                path: PathEth::parse(b)?,
                reth: Reth::parse(from(b, PathEth::LEN))?,
                op: WriteEth::parse(from(b, PathEth::LEN + Reth::LEN))?,
            },
            Layout::ReadResponse => Headers::ReadResponse {
                path: PathEth::parse(b)?,
                op: WriteEth::parse(from(b, PathEth::LEN))?,
            },
            Layout::Atomic => Headers::Atomic {
                path: PathEth::parse(b)?,
                atomic: AtomicEth::parse(from(b, PathEth::LEN))?,
                op: WriteEth::parse(from(b, PathEth::LEN + AtomicEth::LEN))?,
            },
            Layout::AtomicResponse => Headers::AtomicResponse {
                path: PathEth::parse(b)?,
                op: WriteEth::parse(from(b, PathEth::LEN))?,
                ack: AtomicAckEth::parse(from(b, PathEth::LEN + WriteEth::LEN))?,
            },
        };
        Ok(h)
    }

    /// The header shape of this value, for comparison with an opcode's layout.
    fn shape(&self) -> Layout {
        match *self {
            Headers::Connect(_) => Layout::Connect,
            Headers::Ack(_) => Layout::Ack,
            Headers::Send { .. } => Layout::Send,
            Headers::Write { imm, .. } => Layout::Write { imm: imm.is_some() },
            Headers::Nak { .. } => Layout::Nak,
            Headers::Close(_) => Layout::Close,
            Headers::ReadRequest { .. } => Layout::ReadRequest,
            Headers::ReadResponse { .. } => Layout::ReadResponse,
            Headers::Atomic { .. } => Layout::Atomic,
            Headers::AtomicResponse { .. } => Layout::AtomicResponse,
            Headers::Rc {
                reth,
                aeth,
                atomic,
                atomic_ack,
                imm,
                ieth,
            } => Layout::Rc(RcSet {
                reth: reth.is_some(),
                aeth: aeth.is_some(),
                atomic: atomic.is_some(),
                atomic_ack: atomic_ack.is_some(),
                imm: imm.is_some(),
                ieth: ieth.is_some(),
            }),
            Headers::Ud { imm, .. } => Layout::Ud { imm: imm.is_some() },
            Headers::Cnp => Layout::Cnp,
        }
    }

    /// True when `op` prescribes exactly this header sequence (same variant and the same
    /// optional headers present), i.e. a packet with this opcode and these headers is
    /// well-formed.
    pub fn matches_opcode(&self, op: Opcode) -> bool {
        SHAPES[op.0 as usize].map(|(l, _)| l) == Some(self.shape())
    }

    /// Bytes of extension headers after the BTH for this variant (0..=48).
    pub fn len(&self) -> usize {
        layout_len(self.shape())
    }

    /// True when there are no extension headers (RC opcodes with a bare BTH).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Emit the extension headers (after the BTH) into the start of `out`; reserved bytes
    /// are written as zero. Returns the number of bytes written, [`Headers::len`].
    ///
    /// Errors: [`Error::BufferTooSmall`] if `out` is shorter than [`Headers::len`].
    pub fn emit(&self, out: &mut [u8]) -> Result<usize, Error> {
        let total = self.len();
        if out.len() < total {
            return Err(Error::BufferTooSmall {
                needed: total,
                got: out.len(),
            });
        }
        let mut off = 0usize;
        match self {
            Headers::Connect(c) => put(out, &mut off, ConnectEth::LEN, |o| c.emit(o))?,
            Headers::Ack(a) => put(out, &mut off, AckEth::LEN, |o| a.emit(o))?,
            Headers::Send { path, send } => {
                put(out, &mut off, PathEth::LEN, |o| path.emit(o))?;
                put(out, &mut off, SendEth::LEN, |o| send.emit(o))?;
            }
            Headers::Write {
                path,
                reth,
                write,
                imm,
            } => {
                put(out, &mut off, PathEth::LEN, |o| path.emit(o))?;
                put(out, &mut off, Reth::LEN, |o| reth.emit(o))?;
                put(out, &mut off, WriteEth::LEN, |o| write.emit(o))?;
                if let Some(v) = imm {
                    put(out, &mut off, IMM_LEN, |o| emit_u32(*v, o))?;
                }
            }
            Headers::Nak { path, nak } => {
                put(out, &mut off, PathEth::LEN, |o| path.emit(o))?;
                put(out, &mut off, NakEth::LEN, |o| nak.emit(o))?;
            }
            Headers::Close(c) => put(out, &mut off, CloseEth::LEN, |o| c.emit(o))?,
            Headers::ReadRequest { path, reth, op } => {
                put(out, &mut off, PathEth::LEN, |o| path.emit(o))?;
                put(out, &mut off, Reth::LEN, |o| reth.emit(o))?;
                put(out, &mut off, WriteEth::LEN, |o| op.emit(o))?;
            }
            Headers::ReadResponse { path, op } => {
                put(out, &mut off, PathEth::LEN, |o| path.emit(o))?;
                put(out, &mut off, WriteEth::LEN, |o| op.emit(o))?;
            }
            Headers::Atomic { path, atomic, op } => {
                put(out, &mut off, PathEth::LEN, |o| path.emit(o))?;
                put(out, &mut off, AtomicEth::LEN, |o| atomic.emit(o))?;
                put(out, &mut off, WriteEth::LEN, |o| op.emit(o))?;
            }
            Headers::AtomicResponse { path, op, ack } => {
                put(out, &mut off, PathEth::LEN, |o| path.emit(o))?;
                put(out, &mut off, WriteEth::LEN, |o| op.emit(o))?;
                put(out, &mut off, AtomicAckEth::LEN, |o| ack.emit(o))?;
            }
            Headers::Rc {
                reth,
                aeth,
                atomic,
                atomic_ack,
                imm,
                ieth,
            } => {
                if let Some(h) = reth {
                    put(out, &mut off, Reth::LEN, |o| h.emit(o))?;
                }
                if let Some(h) = aeth {
                    put(out, &mut off, Aeth::LEN, |o| h.emit(o))?;
                }
                if let Some(h) = atomic {
                    put(out, &mut off, AtomicEth::LEN, |o| h.emit(o))?;
                }
                if let Some(h) = atomic_ack {
                    put(out, &mut off, AtomicAckEth::LEN, |o| h.emit(o))?;
                }
                if let Some(v) = imm {
                    put(out, &mut off, IMM_LEN, |o| emit_u32(*v, o))?;
                }
                if let Some(v) = ieth {
                    put(out, &mut off, IMM_LEN, |o| emit_u32(*v, o))?;
                }
            }
            Headers::Ud { deth, imm } => {
                put(out, &mut off, Deth::LEN, |o| deth.emit(o))?;
                if let Some(v) = imm {
                    put(out, &mut off, IMM_LEN, |o| emit_u32(*v, o))?;
                }
            }
            Headers::Cnp => put(out, &mut off, CNP_RESERVED_LEN, |o| {
                Writer::with_len(o, CNP_RESERVED_LEN)?.zeros(CNP_RESERVED_LEN)
            })?,
        }
        Ok(off)
    }
}
