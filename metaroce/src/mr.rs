//! Memory regions: memory registered with the endpoint, addressed by peers through rkeys.
//!
//! Like an IBA protection domain, one endpoint's regions are usable by every connection of
//! that endpoint.
//!
//! Keys (issue #9): the **lkey** never leaves the host; it counts up from 1 per endpoint,
//! looked up in a map, and is not reissued before 2^32 registrations, so a work request
//! that still names a deregistered region finds no region (rxe's `index << 8 | variant`
//! came back after 256 registrations of one slot). The **rkey** is a random 32-bit value from the
//! endpoint's secret RNG, drawn per registration, looked up in a map and never equal to a
//! live rkey; the region's **address** is a random page-aligned 48-bit VA, also per
//! registration. A remote access must name both: a key from another endpoint or from an
//! earlier registration matches with probability 2^-32 per try (the address check adds
//! more), and no counter wraps to revive a stale key.

use crate::fasthash::HashMap;
use crate::secret::SecretRng;
use std::fmt;

/// Access rights of a memory region (`ibv_access_flags` values).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(pub u32);

impl Access {
    /// No access bit (the same as `Access::default()`): the region can only be read
    /// locally, as the source of SENDs and WRITEs.
    pub const NONE: Access = Access(0);
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

/// The bytes behind a registered memory region.
///
/// The core never holds a reference into region memory: it calls these methods once per
/// packet, with the range already checked against the region's bounds and access rights,
/// so an implementation may keep its bytes behind its own lock (the async crate does: an
/// application copy then locks only that region, never the endpoint). `Vec<u8>` implements
/// it directly (the simulator and tests use that).
///
/// Every method may assume `offset + len <= self.len()` (the core checked it); an
/// implementation must not panic otherwise either, but what it does then is unspecified.
/// **Visibility:** a remote WRITE's packet is placed by one [`write_at`](Self::write_at)
/// call when the packet is processed; READ responses, atomic results and posted receives
/// likewise, one packet at a time.
pub trait RegionMemory: Send + 'static {
    /// Length in bytes (fixed for the life of the registration).
    fn len(&self) -> usize;

    /// Whether the region is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copy `dst.len()` bytes starting at `offset` into `dst` (bounds checked by the core).
    fn read_at(&self, offset: usize, dst: &mut [u8]);

    /// Copy `src` into the region at `offset` (bounds checked by the core).
    fn write_at(&mut self, offset: usize, src: &[u8]);

    /// Append the `len` bytes starting at `offset` to `out` (bounds checked by the core):
    /// `out` grows by exactly `len` bytes. The sender builds WRITE packets with it, copying
    /// the source bytes straight into the datagram. The default zero-fills the new bytes
    /// and then [`read_at`](Self::read_at)s into them; an implementation that can hand out
    /// its bytes as a slice should override it with `out.extend_from_slice` (one copy, no
    /// fill; issue #13).
    fn append_to(&self, offset: usize, len: usize, out: &mut Vec<u8>) {
        let start = out.len();
        out.resize(start + len, 0);
        self.read_at(offset, &mut out[start..]);
    }

    /// Replace the little-endian `u64` at `offset` with `f(old)` and return `old`, as one
    /// indivisible step with respect to local accesses (IBA 9.4.5 atomics). The default
    /// reads then writes; an implementation with interior locking overrides it to hold its
    /// lock across both.
    fn atomic_at(&mut self, offset: usize, f: &mut dyn FnMut(u64) -> u64) -> u64 {
        let mut b = [0u8; 8];
        self.read_at(offset, &mut b);
        let old = u64::from_le_bytes(b);
        self.write_at(offset, &f(old).to_le_bytes());
        old
    }

    /// Call `f` with the `len` bytes starting at `offset` (bounds checked by the core), in
    /// order, in one or more slices. The sender computes a lent packet's ICRC with it
    /// ([`lend`](Self::lend)). The default reads through [`read_at`](Self::read_at) in
    /// 256-byte pieces; an implementation that can hand out its bytes as a slice should
    /// override it with one call.
    fn with_span(&self, offset: usize, len: usize, f: &mut dyn FnMut(&[u8])) {
        let mut piece = [0u8; 256];
        let mut at = offset;
        let end = offset.saturating_add(len);
        while at < end {
            let n = (end - at).min(piece.len());
            self.read_at(at, &mut piece[..n]);
            f(&piece[..n]);
            at += n;
        }
    }

    /// A handle through which the I/O layer reads this region's bytes when it sends, so
    /// that a WRITE's payload goes from the region to the kernel without the
    /// core copying it into the datagram (gather send, [`crate::Lent`]). `None` (the
    /// default): the core copies with [`append_to`](Self::append_to).
    ///
    /// The handle is opaque to the core; the I/O layer that registered the region knows
    /// its type (`Any::downcast_ref`). It must not keep the region's buffer from its owner:
    /// hold a weak reference, and let a send whose region is gone drop the packet (the
    /// transport re-sends it, and the re-send fails the work request if the region is
    /// deregistered).
    fn lend(&self) -> Option<crate::LendHandle> {
        None
    }

    /// The memory as `Any`, so that its owner can take its own type back after
    /// deregistration (`Box<dyn Any>::downcast`).
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any>;
}

impl RegionMemory for Vec<u8> {
    fn len(&self) -> usize {
        Vec::len(self)
    }
    fn read_at(&self, offset: usize, dst: &mut [u8]) {
        if let Some(s) = self.get(offset..offset.saturating_add(dst.len())) {
            dst.copy_from_slice(s);
        }
    }
    fn append_to(&self, offset: usize, len: usize, out: &mut Vec<u8>) {
        match self.get(offset..offset.saturating_add(len)) {
            Some(s) => out.extend_from_slice(s),
            None => out.resize(out.len() + len, 0),
        }
    }
    fn with_span(&self, offset: usize, len: usize, f: &mut dyn FnMut(&[u8])) {
        if let Some(s) = self.get(offset..offset.saturating_add(len)) {
            f(s);
        }
    }
    fn write_at(&mut self, offset: usize, src: &[u8]) {
        if let Some(d) = self.get_mut(offset..offset.saturating_add(src.len())) {
            d.copy_from_slice(src);
        }
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
        self
    }
}

/// A region found by [`MrTable::check_remote`]: its slot and the rkey it was found under.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RemoteSlot {
    idx: usize,
    rkey: u32,
}

struct Region {
    keys: MrKeys,
    data: Box<dyn RegionMemory>,
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region").field("keys", &self.keys).finish()
    }
}

/// A span of a local region whose key and bounds were checked ([`MrTable::local_span`]):
/// it borrows the table, so the region cannot go away while it is held.
pub(crate) struct LocalSpan<'a> {
    region: &'a Region,
    offset: usize,
    len: usize,
}

impl LocalSpan<'_> {
    /// Append the span's bytes to `out` ([`RegionMemory::append_to`]).
    pub(crate) fn append_to(&self, out: &mut Vec<u8>) {
        self.region.data.append_to(self.offset, self.len, out);
    }

    /// The region's lend handle ([`RegionMemory::lend`]) and the span's byte offset in it;
    /// `None` when the region does not lend.
    pub(crate) fn lend(&self) -> Option<(crate::LendHandle, usize)> {
        self.region.data.lend().map(|h| (h, self.offset))
    }
}

/// The endpoint's table of registered regions. Each region's bytes sit behind its own
/// [`RegionMemory`]; the table checks keys, bounds and access rights and then calls it.
#[derive(Debug)]
pub(crate) struct MrTable {
    slots: Vec<Option<Region>>,
    free: Vec<usize>,
    /// lkey → slot index of every live region.
    by_lkey: HashMap<u32, usize>,
    /// The next lkey to hand out: lkeys count up from 1 and are not reissued before the
    /// counter wraps (2^32 registrations), so a work request that still names a
    /// deregistered region's lkey finds nothing. (An lkey of slot index and an 8-bit
    /// generation, as NICs build them, came back after 256 registrations of one slot: a
    /// receive posted on a deregistered region then took the data into an unrelated region
    /// and completed `Success`; found by review.)
    next_lkey: u32,
    /// rkey → slot index of every live region.
    by_rkey: HashMap<u32, usize>,
    rng: SecretRng,
}

#[cfg(test)]
impl Default for MrTable {
    /// A table with a fixed, public key seed, for unit tests. Endpoints use
    /// [`MrTable::new`] with a seed of their own.
    fn default() -> Self {
        Self::with_rng(SecretRng::new(SecretRng::default_seed(0x7263)))
    }
}

/// Bits of a random region address: page-aligned (low 12 bits 0) below 2^48, never 0.
const IOVA_MASK: u64 = 0x0000_FFFF_FFFF_F000;

/// `[offset, offset + len)` inside a region of `region_len` bytes, as `usize` offsets.
fn span(offset: u64, len: u64, region_len: u64) -> Result<(usize, usize), MrError> {
    let end = offset.checked_add(len).ok_or(MrError::OutOfBounds)?;
    if end > region_len {
        return Err(MrError::OutOfBounds);
    }
    // Both fit in usize: region lengths come from in-memory buffers.
    Ok((offset as usize, end as usize))
}

impl MrTable {
    /// A table whose rkeys and addresses come from (a child of) the endpoint's secret RNG.
    pub(crate) fn new(secret: &mut SecretRng) -> Self {
        let mut seed = [0u8; 32];
        secret.fill(&mut seed);
        Self::with_rng(SecretRng::new(seed))
    }

    fn with_rng(rng: SecretRng) -> Self {
        Self {
            slots: Vec::new(),
            free: Vec::new(),
            by_lkey: HashMap::default(),
            next_lkey: 1,
            by_rkey: HashMap::default(),
            rng,
        }
    }

    pub(crate) fn register(&mut self, data: Box<dyn RegionMemory>, access: Access) -> MrKeys {
        let idx = self.free_slot();
        let key = loop {
            let k = self.next_lkey;
            self.next_lkey = k.wrapping_add(1);
            if k != 0 && !self.by_lkey.contains_key(&k) {
                break k;
            }
        };
        let rkey = loop {
            let k = self.rng.next_u32();
            if k != 0 && !self.by_rkey.contains_key(&k) {
                break k;
            }
        };
        let addr = loop {
            let a = self.rng.next_u64() & IOVA_MASK;
            // Room for the region below 2^48 (regions are far smaller than the space).
            if a != 0
                && a.checked_add(data.len() as u64)
                    .is_some_and(|e| e <= 1 << 48)
            {
                break a;
            }
        };
        self.by_rkey.insert(rkey, idx);
        self.by_lkey.insert(key, idx);
        let keys = MrKeys {
            lkey: key,
            rkey,
            addr,
            len: data.len() as u64,
            access,
        };
        self.slots[idx] = Some(Region { keys, data });
        keys
    }

    /// Register `data` under keys another table chose (`keys` from its
    /// [`register`](Self::register)): the same lkey, rkey and address, so that one region
    /// answers to one set of keys on several endpoints (the shards of one async endpoint).
    /// `InvalidKey` if the lkey or the rkey is taken here or 0, or `keys.len` is not
    /// `data.len()`; nothing is registered then.
    pub(crate) fn register_with_keys(
        &mut self,
        data: Box<dyn RegionMemory>,
        keys: MrKeys,
    ) -> Result<(), MrError> {
        if keys.lkey == 0
            || keys.rkey == 0
            || self.by_lkey.contains_key(&keys.lkey)
            || self.by_rkey.contains_key(&keys.rkey)
            || keys.len != data.len() as u64
        {
            return Err(MrError::InvalidKey);
        }
        let idx = self.free_slot();
        self.by_lkey.insert(keys.lkey, idx);
        self.by_rkey.insert(keys.rkey, idx);
        self.slots[idx] = Some(Region { keys, data });
        Ok(())
    }

    /// A free slot index (the most recently freed one, or a new one).
    fn free_slot(&mut self) -> usize {
        match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        }
    }

    fn slot(&self, key: u32) -> Option<&Region> {
        let idx = *self.by_lkey.get(&key)?;
        self.slots.get(idx)?.as_ref().filter(|r| r.keys.lkey == key)
    }

    fn remote_slot(&self, rkey: u32) -> Option<&Region> {
        let idx = *self.by_rkey.get(&rkey)?;
        self.slots
            .get(idx)?
            .as_ref()
            .filter(|r| r.keys.rkey == rkey)
    }

    fn remote_slot_mut(&mut self, rkey: u32) -> Option<&mut Region> {
        let idx = *self.by_rkey.get(&rkey)?;
        self.slots
            .get_mut(idx)?
            .as_mut()
            .filter(|r| r.keys.rkey == rkey)
    }

    fn slot_mut(&mut self, key: u32) -> Option<&mut Region> {
        let idx = *self.by_lkey.get(&key)?;
        self.slots
            .get_mut(idx)?
            .as_mut()
            .filter(|r| r.keys.lkey == key)
    }

    pub(crate) fn deregister(&mut self, key: u32) -> Option<Box<dyn RegionMemory>> {
        let idx = *self.by_lkey.get(&key)?;
        let slot = self.slots.get_mut(idx)?;
        if slot.as_ref().map(|r| r.keys.lkey) != Some(key) {
            return None;
        }
        let region = slot.take()?;
        self.by_lkey.remove(&key);
        self.by_rkey.remove(&region.keys.rkey);
        self.free.push(idx);
        Some(region.data)
    }

    /// Number of registered regions.
    pub(crate) fn count(&self) -> usize {
        self.slots.len() - self.free.len()
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
        span(off, len, region.keys.len).map(|(o, _)| o)
    }

    /// Validate a remote access to a whole message `[va, va+len)`. Returns the region's
    /// slot, for [`remote_write_in`](Self::remote_write_in).
    pub(crate) fn check_remote(
        &self,
        rkey: u32,
        va: u64,
        len: u64,
        need: Access,
    ) -> Result<RemoteSlot, MrError> {
        let idx = *self.by_rkey.get(&rkey).ok_or(MrError::InvalidKey)?;
        let r = self
            .slots
            .get(idx)
            .and_then(|s| s.as_ref())
            .filter(|r| r.keys.rkey == rkey)
            .ok_or(MrError::InvalidKey)?;
        Self::check(r, va, len, need).map(|_| RemoteSlot { idx, rkey })
    }

    /// Write `data` at `va` in the region named by `rkey` (checked).
    pub(crate) fn remote_write(&mut self, rkey: u32, va: u64, data: &[u8]) -> Result<(), MrError> {
        let r = self.remote_slot_mut(rkey).ok_or(MrError::InvalidKey)?;
        let off = Self::check(r, va, data.len() as u64, Access::REMOTE_WRITE)?;
        r.data.write_at(off, data);
        Ok(())
    }

    /// [`remote_write`](Self::remote_write) into the region `check_remote` just found,
    /// without a second key lookup (issue #13: one rkey lookup per one-packet WRITE). The
    /// slot is checked again (same rkey, bounds, REMOTE_WRITE), so a stale slot fails with
    /// [`MrError::InvalidKey`] like an unknown rkey.
    pub(crate) fn remote_write_in(
        &mut self,
        slot: RemoteSlot,
        va: u64,
        data: &[u8],
    ) -> Result<(), MrError> {
        let r = self
            .slots
            .get_mut(slot.idx)
            .and_then(|s| s.as_mut())
            .filter(|r| r.keys.rkey == slot.rkey)
            .ok_or(MrError::InvalidKey)?;
        let off = Self::check(r, va, data.len() as u64, Access::REMOTE_WRITE)?;
        r.data.write_at(off, data);
        Ok(())
    }

    /// Where `[va, va+len)` of the region named by `rkey` lies, as its lkey and the offset
    /// of `va` in it, if the region grants REMOTE_READ and holds the whole span: the source
    /// of an RDMA READ's response, read as each response packet is built (checked each
    /// time with [`read_source_span`](Self::read_source_span)).
    pub(crate) fn remote_read_source(
        &self,
        rkey: u32,
        va: u64,
        len: u64,
    ) -> Result<(u32, u64), MrError> {
        let r = self.remote_slot(rkey).ok_or(MrError::InvalidKey)?;
        let off = Self::check(r, va, len, Access::REMOTE_READ)?;
        Ok((r.keys.lkey, off as u64))
    }

    /// A copy of bytes `[va, va+len)` of the region named by `rkey`, for an RDMA READ
    /// (checked for REMOTE_READ).
    pub(crate) fn remote_read(&self, rkey: u32, va: u64, len: u64) -> Result<Vec<u8>, MrError> {
        let r = self.remote_slot(rkey).ok_or(MrError::InvalidKey)?;
        let off = Self::check(r, va, len, Access::REMOTE_READ)?;
        let mut out = vec![0u8; len as usize];
        r.data.read_at(off, &mut out);
        Ok(out)
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
        let r = self.remote_slot_mut(rkey).ok_or(MrError::InvalidKey)?;
        let off = Self::check(r, va, 8, Access::REMOTE_ATOMIC)?;
        let mut f = Some(f);
        Ok(r.data.atomic_at(off, &mut |old| match f.take() {
            Some(f) => f(old),
            None => old,
        }))
    }

    /// Check that local bytes `[offset, offset+len)` of the region `lkey` exist.
    pub(crate) fn check_local(&self, lkey: u32, offset: u64, len: u64) -> Result<(), MrError> {
        let r = self.slot(lkey).ok_or(MrError::InvalidKey)?;
        span(offset, len, r.keys.len).map(|_| ())
    }

    /// Bytes `[offset, offset + len)` of the local region `lkey`, checked as by
    /// [`check_local`](Self::check_local), as a handle that reads them without looking the
    /// key up again (issue #13: a sent WRITE segment used to look its region up twice).
    pub(crate) fn local_span(
        &self,
        lkey: u32,
        offset: u64,
        len: usize,
    ) -> Result<LocalSpan<'_>, MrError> {
        let region = self.slot(lkey).ok_or(MrError::InvalidKey)?;
        let (offset, _) = span(offset, len as u64, region.keys.len)?;
        Ok(LocalSpan {
            region,
            offset,
            len,
        })
    }

    /// [`local_span`](Self::local_span) for the source of a READ response: also that the
    /// region named by `lkey` still answers to `rkey` and grants REMOTE_READ, so a region
    /// registered under a reused lkey (`register_with_keys` takes any lkey not in use) is
    /// never read for a READ another region's keys allowed.
    pub(crate) fn read_source_span(
        &self,
        lkey: u32,
        rkey: u32,
        offset: u64,
        len: usize,
    ) -> Result<LocalSpan<'_>, MrError> {
        let region = self.slot(lkey).ok_or(MrError::InvalidKey)?;
        if region.keys.rkey != rkey || !region.keys.access.contains(Access::REMOTE_READ) {
            return Err(MrError::InvalidKey);
        }
        let (offset, _) = span(offset, len as u64, region.keys.len)?;
        Ok(LocalSpan {
            region,
            offset,
            len,
        })
    }

    /// [`RegionMemory::with_span`] of the local region `lkey` at byte offset `o` (as
    /// [`LocalSpan::lend`] returned it).
    pub(crate) fn local_with_span(
        &self,
        lkey: u32,
        o: usize,
        len: usize,
        f: &mut dyn FnMut(&[u8]),
    ) -> Result<(), MrError> {
        let r = self.slot(lkey).ok_or(MrError::InvalidKey)?;
        span(o as u64, len as u64, r.keys.len)?;
        r.data.with_span(o, len, f);
        Ok(())
    }

    /// A copy of local bytes `[offset, offset + len)` of the region named by `lkey`.
    pub(crate) fn local_vec(&self, lkey: u32, offset: u64, len: u64) -> Result<Vec<u8>, MrError> {
        let r = self.slot(lkey).ok_or(MrError::InvalidKey)?;
        let (o, e) = span(offset, len, r.keys.len)?;
        let mut out = vec![0u8; e - o];
        r.data.read_at(o, &mut out);
        Ok(out)
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
        span(offset, len, r.keys.len).map(|_| ())
    }

    /// Copy `src` into the local region `lkey` at `offset` (bounds checked; the owner's
    /// local access needs no access right).
    pub(crate) fn local_write(
        &mut self,
        lkey: u32,
        offset: u64,
        src: &[u8],
    ) -> Result<(), MrError> {
        let r = self.slot_mut(lkey).ok_or(MrError::InvalidKey)?;
        let (o, _) = span(offset, src.len() as u64, r.keys.len)?;
        r.data.write_at(o, src);
        Ok(())
    }
}

/// The bytes of a deregistered region as a `Vec<u8>`: the vector itself if it was
/// registered as one, else a copy.
pub(crate) fn into_vec(m: Box<dyn RegionMemory>) -> Vec<u8> {
    let mut copy = vec![0u8; m.len()];
    m.read_at(0, &mut copy);
    match m.into_any().downcast::<Vec<u8>>() {
        Ok(v) => *v,
        Err(_) => copy,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slot `check_remote` handed out names its region only while that region is
    /// registered: after a deregistration, and after another region took the slot, a write
    /// through it fails like an unknown rkey and changes no byte of either region.
    #[test]
    fn remote_write_in_rejects_a_stale_slot() {
        let mut t = MrTable::default();
        let a = t.register(Box::new(vec![0u8; 64]), Access::REMOTE_WRITE);
        let slot = t
            .check_remote(a.rkey, a.addr, 64, Access::REMOTE_WRITE)
            .unwrap();
        assert!(t.remote_write_in(slot, a.addr, &[1; 8]).is_ok());
        // Bounds and access are checked again through the slot.
        assert_eq!(
            t.remote_write_in(slot, a.addr + 60, &[1; 8]),
            Err(MrError::OutOfBounds)
        );
        let old = into_vec(t.deregister(a.lkey).unwrap());
        assert_eq!(&old[..9], &[1, 1, 1, 1, 1, 1, 1, 1, 0]);
        assert_eq!(
            t.remote_write_in(slot, a.addr, &[2; 8]),
            Err(MrError::InvalidKey)
        );
        // A new region in the same slot has another rkey: the old slot does not reach it.
        let b = t.register(Box::new(vec![0u8; 64]), Access::REMOTE_WRITE);
        assert_eq!(t.by_lkey[&b.lkey], slot.idx);
        assert_eq!(
            t.remote_write_in(slot, b.addr, &[2; 8]),
            Err(MrError::InvalidKey)
        );
        assert_eq!(into_vec(t.deregister(b.lkey).unwrap()), vec![0u8; 64]);
    }
}
