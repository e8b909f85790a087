//! Base Transport Header.

use super::cursor::fixed;
use super::{Error, Opcode, BTH_LEN, DEFAULT_PKEY, PSN_MASK};

/// Base Transport Header: 12 bytes, first in every RoCEv2 UDP payload. IBA Vol. 1 §9.2.
///
/// | Byte | Bits | Field |
/// |---|---|---|
/// | 0 | 7:0 | OpCode |
/// | 1 | 7 | SE (solicited event) |
/// | 1 | 6 | M (MigReq) |
/// | 1 | 5:4 | PadCnt (0..=3 pad bytes after the payload) |
/// | 1 | 3:0 | TVer (must be 0) |
/// | 2–3 | 15:0 | P_Key |
/// | 4 | 7 | FECN |
/// | 4 | 6 | BECN |
/// | 4 | 5:0 | reserved (sent 0, ignored on receive) |
/// | 5–7 | 23:0 | DestQP |
/// | 8 | 7 | AckReq |
/// | 8 | 6:2 | reserved (sent 0, ignored on receive) |
/// | 8 | 1:0 | MetaRoCE trailer kind ([`Trailer`](super::Trailer); not part of [`Bth`], read and written by [`Packet::parse`](super::Packet::parse) / [`emit_packet_with`](super::emit_packet_with)); reserved on RoCEv2 opcodes |
/// | 9–11 | 23:0 | PSN |
///
/// In MetaRoCE packets the BTH keeps this exact layout (TVer 0, P_Key 0xFFFF); DestQP is the
/// receiver's connection QPN and PSN the per-path sequence number (MetaRoCE extension, see
/// docs/PROTOCOL.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bth {
    /// OpCode, 8 bits: selects transport and extension headers.
    pub opcode: Opcode,
    /// SE, 1 bit: solicited event.
    pub solicited: bool,
    /// M, 1 bit: migration request (APM); ignored by metaroce.
    pub mig_req: bool,
    /// PadCnt, 2 bits: zero bytes (0..=3) between payload and ICRC. Only the low 2 bits are
    /// emitted. [`emit_packet`](super::emit_packet) overwrites it from the payload length.
    pub pad_count: u8,
    /// TVer, 4 bits: transport header version, 0. [`Bth::parse`] rejects any other value;
    /// only the low 4 bits are emitted.
    pub tver: u8,
    /// P_Key, 16 bits: partition key; [`DEFAULT_PKEY`] (0xFFFF) on RoCE.
    pub pkey: u16,
    /// FECN, 1 bit: forward explicit congestion notification (IB link level; masked in ICRC).
    pub fecn: bool,
    /// BECN, 1 bit: backward explicit congestion notification; set on CNPs (masked in ICRC).
    pub becn: bool,
    /// DestQP, 24 bits (low 24 bits of the `u32`): queue pair number at the receiver.
    pub dest_qp: u32,
    /// AckReq, 1 bit: the sender asks for an acknowledgement.
    pub ack_req: bool,
    /// PSN, 24 bits (low 24 bits of the `u32`): packet sequence number modulo 2^24.
    pub psn: u32,
}

impl Bth {
    /// Size of the BTH in bytes (12).
    pub const LEN: usize = BTH_LEN;

    /// A BTH with the given opcode, DestQP and PSN (both masked to 24 bits), P_Key 0xFFFF and
    /// every other field 0 / false.
    pub fn new(opcode: Opcode, dest_qp: u32, psn: u32) -> Bth {
        Bth {
            opcode,
            solicited: false,
            mig_req: false,
            pad_count: 0,
            tver: 0,
            pkey: DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qp: dest_qp & PSN_MASK,
            ack_req: false,
            psn: psn & PSN_MASK,
        }
    }

    /// Parse the first 12 bytes of `b`. Reserved bits are ignored.
    ///
    /// Errors: [`Error::Truncated`] if `b` is shorter than 12 bytes,
    /// [`Error::UnsupportedTver`] if TVer ≠ 0. The opcode is not checked here.
    pub fn parse(b: &[u8]) -> Result<Bth, Error> {
        let &[op, b1, p0, p1, b4, q0, q1, q2, b8, s0, s1, s2] = fixed::<BTH_LEN>(b)?;
        let tver = b1 & 0x0F;
        if tver != 0 {
            return Err(Error::UnsupportedTver(tver));
        }
        Ok(Bth {
            opcode: Opcode(op),
            solicited: b1 & 0x80 != 0,
            mig_req: b1 & 0x40 != 0,
            pad_count: (b1 >> 4) & 0x03,
            tver,
            pkey: u16::from_be_bytes([p0, p1]),
            fecn: b4 & 0x80 != 0,
            becn: b4 & 0x40 != 0,
            dest_qp: u32::from_be_bytes([0, q0, q1, q2]),
            ack_req: b8 & 0x80 != 0,
            psn: u32::from_be_bytes([0, s0, s1, s2]),
        })
    }

    /// Write the 12 BTH bytes to the start of `out`. `dest_qp` and `psn` are masked to 24
    /// bits, `pad_count` to 2 and `tver` to 4; reserved bits are written as 0.
    ///
    /// Errors: [`Error::BufferTooSmall`] if `out` is shorter than 12 bytes.
    pub fn emit(&self, out: &mut [u8]) -> Result<(), Error> {
        let got = out.len();
        let out = out.get_mut(..BTH_LEN).ok_or(Error::BufferTooSmall {
            needed: BTH_LEN,
            got,
        })?;
        let b1 = (u8::from(self.solicited) << 7)
            | (u8::from(self.mig_req) << 6)
            | ((self.pad_count & 0x03) << 4)
            | (self.tver & 0x0F);
        let [p0, p1] = self.pkey.to_be_bytes();
        let b4 = (u8::from(self.fecn) << 7) | (u8::from(self.becn) << 6);
        // The low three bytes: `dest_qp` and `psn` masked to 24 bits.
        let [_, q0, q1, q2] = self.dest_qp.to_be_bytes();
        let [_, s0, s1, s2] = self.psn.to_be_bytes();
        // One 12-byte store, not twelve checked writes (issue #13: every packet has one).
        out.copy_from_slice(&[
            self.opcode.0,
            b1,
            p0,
            p1,
            b4,
            q0,
            q1,
            q2,
            u8::from(self.ack_req) << 7,
            s0,
            s1,
            s2,
        ]);
        Ok(())
    }
}
