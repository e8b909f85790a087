//! Authentication trailer of MetaRoCE packets (between the pad and the ICRC).

use super::{Error, Opcode};

/// The authentication trailer of a MetaRoCE packet, carried between the pad and the ICRC.
/// MetaRoCE extension (issue #9), byte layout in docs/PROTOCOL.md "Authentication trailer".
///
/// Its kind is BTH byte 8 bits 1:0 (MetaRoCE opcodes only; on RoCEv2 opcodes these bits
/// stay reserved and there is never a trailer):
///
/// | Kind | Length | Content |
/// |---|---|---|
/// | 0 | 0 B | none — valid only on `MR_CONNECT` (the codec accepts it on every opcode so that old captures parse; the connection logic drops it) |
/// | 1 | 8 B | token: the 64-bit per-direction connection token the receiver expects, big-endian |
/// | 2 | 24 B | AEAD: an 8-byte word (bit 63 = key phase, bits 62:0 = packet number), then the 16-byte AES-GCM tag |
/// | 3 | — | malformed: [`Error::BadField`]`("BTH.trailer")` |
///
/// The ICRC covers the trailer like every other byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Trailer {
    /// Kind 0: no trailer (0 bytes).
    #[default]
    None,
    /// Kind 1: the 64-bit connection token of the direction (8 bytes, big-endian).
    Token(u64),
    /// Kind 2: AEAD packet protection (24 bytes).
    Aead {
        /// Key phase (bit 63 of the first word).
        key_phase: bool,
        /// Packet number (bits 62:0 of the first word), per direction, from 0.
        pn: u64,
        /// AES-GCM authentication tag (16 bytes).
        tag: [u8; 16],
    },
}

impl Trailer {
    /// Kind value 0 (no trailer) in BTH byte 8 bits 1:0.
    pub const KIND_NONE: u8 = 0;
    /// Kind value 1 (token).
    pub const KIND_TOKEN: u8 = 1;
    /// Kind value 2 (AEAD).
    pub const KIND_AEAD: u8 = 2;
    /// Mask of the trailer kind in BTH byte 8 (bits 1:0).
    pub const KIND_MASK: u8 = 0x03;
    /// Length in bytes of a token trailer (8).
    pub const TOKEN_LEN: usize = 8;
    /// Length in bytes of an AEAD trailer (24).
    pub const AEAD_LEN: usize = 24;
    /// Largest packet number an AEAD trailer can carry (2^63 − 1).
    pub const MAX_PN: u64 = (1 << 63) - 1;

    /// The kind value (0, 1 or 2) for BTH byte 8 bits 1:0.
    pub fn kind(&self) -> u8 {
        match self {
            Trailer::None => Self::KIND_NONE,
            Trailer::Token(_) => Self::KIND_TOKEN,
            Trailer::Aead { .. } => Self::KIND_AEAD,
        }
    }

    /// Length in bytes on the wire: 0, 8 or 24.
    pub fn len(&self) -> usize {
        Self::len_of_kind(self.kind()).unwrap_or(0)
    }

    /// True for [`Trailer::None`].
    pub fn is_empty(&self) -> bool {
        matches!(self, Trailer::None)
    }

    /// Length of a trailer of kind `kind` (the low 2 bits are used): `Some(0 | 8 | 24)`, or
    /// `None` for the malformed kind 3.
    pub fn len_of_kind(kind: u8) -> Option<usize> {
        match kind & Self::KIND_MASK {
            0 => Some(0),
            1 => Some(Self::TOKEN_LEN),
            2 => Some(Self::AEAD_LEN),
            _ => None,
        }
    }

    /// The trailer kind a packet of opcode `op` announces in its BTH byte 8 (`byte8`): bits
    /// 1:0 for MetaRoCE opcodes, always 0 for RoCEv2 opcodes (reserved bits there).
    pub fn kind_in(op: Opcode, byte8: u8) -> u8 {
        if op.is_metaroce() {
            byte8 & Self::KIND_MASK
        } else {
            Self::KIND_NONE
        }
    }

    /// Parse a trailer of kind `kind` from exactly its bytes `b` (0, 8 or 24 bytes).
    ///
    /// Errors: [`Error::BadField`]`("BTH.trailer")` for kind 3; [`Error::BadLength`] if `b`
    /// has the wrong length; an AEAD packet number is masked to 63 bits by construction.
    pub fn parse(kind: u8, b: &[u8]) -> Result<Trailer, Error> {
        let want = Self::len_of_kind(kind).ok_or(Error::BadField("BTH.trailer"))?;
        if b.len() != want {
            return Err(Error::BadLength);
        }
        match kind & Self::KIND_MASK {
            0 => Ok(Trailer::None),
            1 => {
                let w = <[u8; 8]>::try_from(b).map_err(|_| Error::BadLength)?;
                Ok(Trailer::Token(u64::from_be_bytes(w)))
            }
            _ => {
                let (w, t) = b.split_at(8);
                let w = u64::from_be_bytes(<[u8; 8]>::try_from(w).map_err(|_| Error::BadLength)?);
                let tag = <[u8; 16]>::try_from(t).map_err(|_| Error::BadLength)?;
                Ok(Trailer::Aead {
                    key_phase: w >> 63 != 0,
                    pn: w & Self::MAX_PN,
                    tag,
                })
            }
        }
    }

    /// Write the trailer to exactly `out` (whose length must be [`Trailer::len`]). An AEAD
    /// packet number is masked to 63 bits.
    ///
    /// Errors: [`Error::BufferTooSmall`] / [`Error::BadLength`] on a wrong-sized `out`.
    pub fn emit(&self, out: &mut [u8]) -> Result<(), Error> {
        let want = self.len();
        if out.len() < want {
            return Err(Error::BufferTooSmall {
                needed: want,
                got: out.len(),
            });
        }
        if out.len() != want {
            return Err(Error::BadLength);
        }
        match *self {
            Trailer::None => {}
            Trailer::Token(t) => out.copy_from_slice(&t.to_be_bytes()),
            Trailer::Aead { key_phase, pn, tag } => {
                let w = (u64::from(key_phase) << 63) | (pn & Self::MAX_PN);
                let (a, b) = out.split_at_mut(8);
                a.copy_from_slice(&w.to_be_bytes());
                b.copy_from_slice(&tag);
            }
        }
        Ok(())
    }

    /// The 8-byte first word as it appears on the wire (token, or key phase + packet
    /// number); `None` for [`Trailer::None`]. sec-crypto's AAD ends with this word.
    pub fn word(&self) -> Option<[u8; 8]> {
        match *self {
            Trailer::None => None,
            Trailer::Token(t) => Some(t.to_be_bytes()),
            Trailer::Aead { key_phase, pn, .. } => {
                Some(((u64::from(key_phase) << 63) | (pn & Self::MAX_PN)).to_be_bytes())
            }
        }
    }
}
