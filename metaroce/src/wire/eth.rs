//! Standard InfiniBand extended transport headers (IBA Vol. 1 §9.3).
//!
//! ImmDt (4 B, opaque) and IETH (4 B, R_Key to invalidate) are single 32-bit big-endian
//! fields and are carried as plain `u32` values in [`Headers`](super::Headers).

use super::cursor::{fixed, Reader, Writer};
use super::{Error, PSN_MASK};

/// RDMA Extended Transport Header: 16 bytes. IBA Vol. 1 §9.3 (RETH).
///
/// | Bytes | Field |
/// |---|---|
/// | 0–7 | virtual address (u64) |
/// | 8–11 | R_Key (u32) |
/// | 12–15 | DMA length in bytes (u32), of the whole message |
///
/// Also used by MetaRoCE WRITE packets (MetaRoCE extension, see docs/PROTOCOL.md), where it
/// is repeated on every packet of the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Reth {
    /// Remote virtual address (64 bits) of the first byte of the message.
    pub va: u64,
    /// Remote key (32 bits) of the target memory region.
    pub rkey: u32,
    /// Length in bytes (32 bits) of the whole message.
    pub dma_len: u32,
}

impl Reth {
    /// Size in bytes (16).
    pub const LEN: usize = 16;

    /// Parse the first 16 bytes of `b`; [`Error::Truncated`] if shorter.
    pub fn parse(b: &[u8]) -> Result<Self, Error> {
        let &[v0, v1, v2, v3, v4, v5, v6, v7, k0, k1, k2, k3, l0, l1, l2, l3] =
            fixed::<{ Self::LEN }>(b)?;
        Ok(Reth {
            va: u64::from_be_bytes([v0, v1, v2, v3, v4, v5, v6, v7]),
            rkey: u32::from_be_bytes([k0, k1, k2, k3]),
            dma_len: u32::from_be_bytes([l0, l1, l2, l3]),
        })
    }

    /// Write 16 bytes to the start of `out`; [`Error::BufferTooSmall`] if shorter.
    pub fn emit(&self, out: &mut [u8]) -> Result<(), Error> {
        let mut w = Writer::with_len(out, Self::LEN)?;
        w.u64(self.va)?;
        w.u32(self.rkey)?;
        w.u32(self.dma_len)
    }
}

/// ACK Extended Transport Header: 4 bytes. IBA Vol. 1 §9.3 (AETH).
///
/// | Byte | Field |
/// |---|---|
/// | 0 | syndrome (8 bits): bit 7 reserved, bits 6:5 type (00 ACK, 01 RNR NAK, 11 NAK), bits 4:0 credit / timer / NAK code |
/// | 1–3 | MSN (24 bits): message sequence number |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Aeth {
    /// Syndrome byte (8 bits), see the `Aeth::*` constants.
    pub syndrome: u8,
    /// Message sequence number (24 bits, low bits of the `u32`; masked on emit).
    pub msn: u32,
}

impl Aeth {
    /// Size in bytes (4).
    pub const LEN: usize = 4;
    /// Syndrome of a plain ACK without end-to-end credit information (0x1F).
    pub const ACK_NO_CREDIT: u8 = 0x1F;
    /// NAK syndrome: PSN sequence error (0x60).
    pub const NAK_PSN_SEQUENCE_ERROR: u8 = 0x60;
    /// NAK syndrome: invalid request (0x61).
    pub const NAK_INVALID_REQUEST: u8 = 0x61;
    /// NAK syndrome: remote access error (0x62).
    pub const NAK_REMOTE_ACCESS_ERROR: u8 = 0x62;
    /// NAK syndrome: remote operational error (0x63).
    pub const NAK_REMOTE_OPERATIONAL_ERROR: u8 = 0x63;

    /// Parse the first 4 bytes of `b`; [`Error::Truncated`] if shorter.
    pub fn parse(b: &[u8]) -> Result<Self, Error> {
        let mut r = Reader::with_len(b, Self::LEN)?;
        Ok(Aeth {
            syndrome: r.u8()?,
            msn: r.u24()?,
        })
    }

    /// Write 4 bytes to the start of `out` (MSN masked to 24 bits);
    /// [`Error::BufferTooSmall`] if shorter.
    pub fn emit(&self, out: &mut [u8]) -> Result<(), Error> {
        let mut w = Writer::with_len(out, Self::LEN)?;
        w.u8(self.syndrome)?;
        w.u24(self.msn & PSN_MASK)
    }
}

/// Atomic Extended Transport Header: 28 bytes. IBA Vol. 1 §9.3 (AtomicETH).
///
/// | Bytes | Field |
/// |---|---|
/// | 0–7 | virtual address (u64, 8-byte aligned) |
/// | 8–11 | R_Key (u32) |
/// | 12–19 | swap (CmpSwap) or add (FetchAdd) data (u64) |
/// | 20–27 | compare data (u64; unused by FetchAdd) |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AtomicEth {
    /// Remote virtual address (64 bits) of the 8-byte operand.
    pub va: u64,
    /// Remote key (32 bits).
    pub rkey: u32,
    /// Swap value (CmpSwap) or addend (FetchAdd), 64 bits.
    pub swap_add: u64,
    /// Compare value (CmpSwap), 64 bits.
    pub compare: u64,
}

impl AtomicEth {
    /// Size in bytes (28).
    pub const LEN: usize = 28;

    /// Parse the first 28 bytes of `b`; [`Error::Truncated`] if shorter.
    pub fn parse(b: &[u8]) -> Result<Self, Error> {
        let mut r = Reader::with_len(b, Self::LEN)?;
        Ok(AtomicEth {
            va: r.u64()?,
            rkey: r.u32()?,
            swap_add: r.u64()?,
            compare: r.u64()?,
        })
    }

    /// Write 28 bytes to the start of `out`; [`Error::BufferTooSmall`] if shorter.
    pub fn emit(&self, out: &mut [u8]) -> Result<(), Error> {
        let mut w = Writer::with_len(out, Self::LEN)?;
        w.u64(self.va)?;
        w.u32(self.rkey)?;
        w.u64(self.swap_add)?;
        w.u64(self.compare)
    }
}

/// Atomic Acknowledge Extended Transport Header: 8 bytes. IBA Vol. 1 §9.3 (AtomicAckETH).
///
/// | Bytes | Field |
/// |---|---|
/// | 0–7 | original remote data (u64) before the atomic operation |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AtomicAckEth {
    /// Value at the target address before the operation, 64 bits.
    pub orig: u64,
}

impl AtomicAckEth {
    /// Size in bytes (8).
    pub const LEN: usize = 8;

    /// Parse the first 8 bytes of `b`; [`Error::Truncated`] if shorter.
    pub fn parse(b: &[u8]) -> Result<Self, Error> {
        let mut r = Reader::with_len(b, Self::LEN)?;
        Ok(AtomicAckEth { orig: r.u64()? })
    }

    /// Write 8 bytes to the start of `out`; [`Error::BufferTooSmall`] if shorter.
    pub fn emit(&self, out: &mut [u8]) -> Result<(), Error> {
        let mut w = Writer::with_len(out, Self::LEN)?;
        w.u64(self.orig)
    }
}

/// Datagram Extended Transport Header: 8 bytes. IBA Vol. 1 §9.3 (DETH).
///
/// | Bytes | Field |
/// |---|---|
/// | 0–3 | Q_Key (u32) |
/// | 4 | reserved (sent 0, ignored on receive) |
/// | 5–7 | source QPN (24 bits) |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Deth {
    /// Queue key (32 bits) the receiving UD QP expects.
    pub qkey: u32,
    /// Sender's QPN (24 bits, low bits of the `u32`; masked on emit).
    pub src_qp: u32,
}

impl Deth {
    /// Size in bytes (8).
    pub const LEN: usize = 8;

    /// Parse the first 8 bytes of `b`; [`Error::Truncated`] if shorter.
    pub fn parse(b: &[u8]) -> Result<Self, Error> {
        let mut r = Reader::with_len(b, Self::LEN)?;
        let qkey = r.u32()?;
        r.skip(1)?;
        Ok(Deth {
            qkey,
            src_qp: r.u24()?,
        })
    }

    /// Write 8 bytes to the start of `out` (source QPN masked to 24 bits);
    /// [`Error::BufferTooSmall`] if shorter.
    pub fn emit(&self, out: &mut [u8]) -> Result<(), Error> {
        let mut w = Writer::with_len(out, Self::LEN)?;
        w.u32(self.qkey)?;
        w.u8(0)?;
        w.u24(self.src_qp & PSN_MASK)
    }
}
