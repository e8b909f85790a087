//! Memory regions: memory registered with the endpoint, addressed by peers through rkeys.
//!
//! Like an IBA protection domain, one endpoint's regions are usable by every connection of
//! that endpoint. Keys follow rxe's scheme (RoCEv2 reference §7): `index << 8 | variant`,
//! so a stale key whose index was reused is still rejected.

use std::fmt;

/// Access rights of a memory region (`ibv_access_flags` values).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(pub u32);

impl Access {
    /// `IBV_ACCESS_LOCAL_WRITE`: local receives and READ results may land here.
    pub const LOCAL_WRITE: Access = Access(0x1);
    /// `IBV_ACCESS_REMOTE_WRITE`: peers may RDMA WRITE here.
    pub const REMOTE_WRITE: Access = Access(0x2);
    /// `IBV_ACCESS_REMOTE_READ`: peers may RDMA READ from here.
    pub const REMOTE_READ: Access = Access(0x4);
    /// `IBV_ACCESS_REMOTE_ATOMIC`: peers may run atomics here.
    pub const REMOTE_ATOMIC: Access = Access(0x8);

    /// Whether every bit of `other` is set in `self`.
    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Self::LOCAL_WRITE, "LOCAL_WRITE"),
            (Self::REMOTE_WRITE, "REMOTE_WRITE"),
            (Self::REMOTE_READ, "REMOTE_READ"),
            (Self::REMOTE_ATOMIC, "REMOTE_ATOMIC"),
        ];
        let set: Vec<&str> = names
            .iter()
            .filter(|(a, _)| self.contains(*a))
            .map(|(_, n)| *n)
            .collect();
        write!(
            f,
            "Access({})",
            if set.is_empty() {
                "none".to_string()
            } else {
                set.join("|")
            }
        )
    }
}

/// Keys and address of a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MrKeys {
    /// Local key, used by the owner to name the region as a source or destination.
    pub lkey: u32,
    /// Remote key, handed to peers for RETH/AtomicETH.
    pub rkey: u32,
    /// The region's I/O virtual address: the VA peers use for its first byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Access rights.
    pub access: Access,
}

/// Why a memory reference was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MrError {
    /// No region has this key (never registered, deregistered, or stale).
    InvalidKey,
    /// `[addr, addr + len)` is not inside the region.
    OutOfBounds,
    /// The region lacks the access right the operation needs.
    AccessDenied,
}

impl fmt::Display for MrError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MrError::InvalidKey => "no memory region with this key",
            MrError::OutOfBounds => "range outside the memory region",
            MrError::AccessDenied => "memory region lacks the required access right",
        })
    }
}

impl std::error::Error for MrError {}

#[derive(Debug)]
struct Region {
    keys: MrKeys,
    data: Vec<u8>,
}

/// The endpoint's table of registered regions. The core owns the bytes; the application
/// reads and writes them through the endpoint.
#[derive(Debug, Default)]
pub(crate) struct MrTable {
    slots: Vec<Option<Region>>,
    variants: Vec<u8>,
    free: Vec<usize>,
}

/// Base of the IOVA space handed out: regions get disjoint, page-aligned VAs so that a VA
/// names a region unambiguously in traces.
const IOVA_BASE: u64 = 0x1000_0000_0000;

impl MrTable {
    pub(crate) fn register(&mut self, data: Vec<u8>, access: Access) -> MrKeys {
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(None);
                self.variants.push(0);
                self.slots.len() - 1
            }
        };
        self.variants[idx] = self.variants[idx].wrapping_add(1);
        let key = ((idx as u32 + 1) << 8) | self.variants[idx] as u32;
        // Each slot owns a 2^40-byte IOVA window: the VA says which slot it is in.
        let addr = IOVA_BASE + ((idx as u64) << 40);
        let keys = MrKeys {
            lkey: key,
            rkey: key,
            addr,
            len: data.len() as u64,
            access,
        };
        self.slots[idx] = Some(Region { keys, data });
        keys
    }

    fn slot(&self, key: u32) -> Option<&Region> {
        let idx = (key >> 8).checked_sub(1)? as usize;
        self.slots.get(idx)?.as_ref().filter(|r| r.keys.lkey == key)
    }

    fn slot_mut(&mut self, key: u32) -> Option<&mut Region> {
        let idx = (key >> 8).checked_sub(1)? as usize;
        self.slots
            .get_mut(idx)?
            .as_mut()
            .filter(|r| r.keys.lkey == key)
    }

    pub(crate) fn deregister(&mut self, key: u32) -> Option<Vec<u8>> {
        let idx = (key >> 8).checked_sub(1)? as usize;
        let slot = self.slots.get_mut(idx)?;
        if slot.as_ref().map(|r| r.keys.lkey) != Some(key) {
            return None;
        }
        let region = slot.take()?;
        self.free.push(idx);
        Some(region.data)
    }

    pub(crate) fn keys(&self, key: u32) -> Option<MrKeys> {
        self.slot(key).map(|r| r.keys)
    }

    /// Offset of `[va, va+len)` in the region named by `rkey`, if it is inside and the
    /// region grants `need`.
    fn check(region: &Region, va: u64, len: u64, need: Access) -> Result<usize, MrError> {
        if !region.keys.access.contains(need) {
            return Err(MrError::AccessDenied);
        }
        let off = va
            .checked_sub(region.keys.addr)
            .ok_or(MrError::OutOfBounds)?;
        let end = off.checked_add(len).ok_or(MrError::OutOfBounds)?;
        if end > region.keys.len {
            return Err(MrError::OutOfBounds);
        }
        Ok(off as usize)
    }

    /// Validate a remote access to a whole message `[va, va+len)`.
    pub(crate) fn check_remote(
        &self,
        rkey: u32,
        va: u64,
        len: u64,
        need: Access,
    ) -> Result<(), MrError> {
        let r = self.slot(rkey).ok_or(MrError::InvalidKey)?;
        Self::check(r, va, len, need).map(|_| ())
    }

    /// Write `data` at `va` in the region named by `rkey` (checked).
    pub(crate) fn remote_write(&mut self, rkey: u32, va: u64, data: &[u8]) -> Result<(), MrError> {
        let r = self.slot_mut(rkey).ok_or(MrError::InvalidKey)?;
        let off = Self::check(r, va, data.len() as u64, Access::REMOTE_WRITE)?;
        r.data[off..off + data.len()].copy_from_slice(data);
        Ok(())
    }

    /// Bytes `[va, va+len)` of the region named by `rkey`, for an RDMA READ (checked for
    /// REMOTE_READ).
    pub(crate) fn remote_read(&self, rkey: u32, va: u64, len: u64) -> Result<&[u8], MrError> {
        let r = self.slot(rkey).ok_or(MrError::InvalidKey)?;
        let off = Self::check(r, va, len, Access::REMOTE_READ)?;
        Ok(&r.data[off..off + len as usize])
    }

    /// Execute an atomic on the 8 bytes at `va` of the region named by `rkey` (checked for
    /// REMOTE_ATOMIC; the caller checks alignment). The value is little-endian in memory.
    /// `f` maps the old value to the new one; returns the old value.
    pub(crate) fn remote_atomic(
        &mut self,
        rkey: u32,
        va: u64,
        f: impl FnOnce(u64) -> u64,
    ) -> Result<u64, MrError> {
        let r = self.slot_mut(rkey).ok_or(MrError::InvalidKey)?;
        let off = Self::check(r, va, 8, Access::REMOTE_ATOMIC)?;
        let cell = &mut r.data[off..off + 8];
        let mut b = [0u8; 8];
        b.copy_from_slice(cell);
        let old = u64::from_le_bytes(b);
        cell.copy_from_slice(&f(old).to_le_bytes());
        Ok(old)
    }

    /// Local bytes `[offset, offset+len)` of the region named by `lkey`.
    pub(crate) fn local(&self, lkey: u32, offset: u64, len: u64) -> Result<&[u8], MrError> {
        let r = self.slot(lkey).ok_or(MrError::InvalidKey)?;
        let end = offset.checked_add(len).ok_or(MrError::OutOfBounds)?;
        if end > r.keys.len {
            return Err(MrError::OutOfBounds);
        }
        Ok(&r.data[offset as usize..end as usize])
    }

    /// Check that `[offset, offset+len)` of the local region `lkey` exists and may be
    /// written by incoming data (LOCAL_WRITE, the verbs rule for receive and READ/atomic
    /// result buffers).
    pub(crate) fn check_local_write(
        &self,
        lkey: u32,
        offset: u64,
        len: u64,
    ) -> Result<(), MrError> {
        let r = self.slot(lkey).ok_or(MrError::InvalidKey)?;
        if !r.keys.access.contains(Access::LOCAL_WRITE) {
            return Err(MrError::AccessDenied);
        }
        let end = offset.checked_add(len).ok_or(MrError::OutOfBounds)?;
        if end > r.keys.len {
            return Err(MrError::OutOfBounds);
        }
        Ok(())
    }

    pub(crate) fn local_mut(
        &mut self,
        lkey: u32,
        offset: u64,
        len: u64,
    ) -> Result<&mut [u8], MrError> {
        let r = self.slot_mut(lkey).ok_or(MrError::InvalidKey)?;
        let end = offset.checked_add(len).ok_or(MrError::OutOfBounds)?;
        if end > r.keys.len {
            return Err(MrError::OutOfBounds);
        }
        Ok(&mut r.data[offset as usize..end as usize])
    }
}
