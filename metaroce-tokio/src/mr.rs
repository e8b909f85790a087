//! Memory regions owned by the endpoint and their remote descriptors.

use crate::endpoint::EndpointRef;
use crate::error::Error;
use metaroce::{MrError, MrKeys};
use std::sync::Arc;

/// What a peer needs to address a region: its address, length and rkey.
///
/// Serialise it with [`to_bytes`](Self::to_bytes) to send it in a message; the peer
/// rebuilds it with [`from_bytes`](Self::from_bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// Virtual address of the region's first byte, as the owner's endpoint assigned it.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

impl RemoteRegion {
    /// Encoded length of [`to_bytes`](Self::to_bytes): 20 bytes.
    pub const ENCODED_LEN: usize = 20;

    /// Big-endian encoding: addr (8 bytes), len (8), rkey (4).
    pub fn to_bytes(&self) -> [u8; 20] {
        let mut b = [0u8; 20];
        b[..8].copy_from_slice(&self.addr.to_be_bytes());
        b[8..16].copy_from_slice(&self.len.to_be_bytes());
        b[16..].copy_from_slice(&self.rkey.to_be_bytes());
        b
    }

    /// Decode [`to_bytes`](Self::to_bytes); `None` if `b` is not 20 bytes.
    pub fn from_bytes(b: &[u8]) -> Option<RemoteRegion> {
        if b.len() != Self::ENCODED_LEN {
            return None;
        }
        Some(RemoteRegion {
            addr: u64::from_be_bytes(b[..8].try_into().ok()?),
            len: u64::from_be_bytes(b[8..16].try_into().ok()?),
            rkey: u32::from_be_bytes(b[16..].try_into().ok()?),
        })
    }

    /// The sub-region `[offset, offset + len)`, or `None` if it does not fit.
    pub fn slice(&self, offset: u64, len: u64) -> Option<RemoteRegion> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| RemoteRegion {
            addr: self.addr + offset,
            len,
            rkey: self.rkey,
        })
    }
}

/// A region of memory registered with an endpoint.
///
/// The endpoint owns the bytes; peers WRITE into them while local code runs, so local
/// access goes through short critical sections ([`read`](Self::read),
/// [`with_bytes`](Self::with_bytes), [`write`](Self::write)) rather than references that
/// could race. **Visibility:** bytes of a remote WRITE are visible locally once
/// `recv_imm` reports it (WRITE with immediate), or once the writer says so in a later
/// message (the writer's completion means every byte has landed). Deregistered on drop:
/// later accesses by peers get a remote access error.
pub struct MemoryRegion {
    ep: Arc<EndpointRef>,
    keys: MrKeys,
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("keys", &self.keys)
            .finish()
    }
}

impl MemoryRegion {
    pub(crate) fn new(ep: Arc<EndpointRef>, keys: MrKeys) -> Self {
        Self { ep, keys }
    }

    pub(crate) fn ep(&self) -> &Arc<EndpointRef> {
        &self.ep
    }

    /// Keys, address, length and access rights.
    pub fn keys(&self) -> MrKeys {
        self.keys
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.keys.len as usize
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.keys.len == 0
    }

    /// The descriptor to hand to peers.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            addr: self.keys.addr,
            len: self.keys.len,
            rkey: self.keys.rkey,
        }
    }

    /// Copy out bytes `[offset, offset + len)`.
    pub fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, Error> {
        self.with_bytes(|b| {
            let end = offset
                .checked_add(len)
                .filter(|&e| e <= b.len() as u64)
                .ok_or(Error::Memory(MrError::OutOfBounds))?;
            Ok(b[offset as usize..end as usize].to_vec())
        })?
    }

    /// Run `f` over the whole region. Incoming packets wait while `f` runs: keep it short.
    pub fn with_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> Result<R, Error> {
        let st = self.ep.shared.lock();
        let b = st.core.mr_read(self.keys.lkey, 0, self.keys.len)?;
        Ok(f(b))
    }

    /// Copy `data` into the region at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        let mut st = self.ep.shared.lock();
        st.core
            .mr_write(self.keys.lkey, offset, data.len() as u64)?
            .copy_from_slice(data);
        Ok(())
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        self.ep.shared.lock().core.deregister_mr(self.keys.lkey);
    }
}
