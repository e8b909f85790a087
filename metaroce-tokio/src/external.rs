//! Externally owned memory (huge pages, device-mapped buffers) as a region's bytes: the
//! crate's only `unsafe` code.

#![allow(unsafe_code)]

use std::any::Any;

/// Memory the caller owns and maps (huge pages from `mmap`, a device BAR, a buffer a
/// driver allocated), registered without a copy through [`ExternalMemory::new`] and
/// [`Endpoint::register_buffer`](crate::Endpoint::register_buffer).
///
/// The `owner` value given to [`new`](Self::new) is kept until the region is dropped or
/// deregistered and the last access ended; dropping it is how the memory is released
/// (e.g. an `munmap` in its `Drop`). [`MemoryRegion::deregister`](crate::MemoryRegion::deregister)
/// returns the `ExternalMemory` itself, owner included.
pub struct ExternalMemory {
    ptr: *mut u8,
    len: usize,
    owner: Box<dyn Any + Send>,
}

// SAFETY: `ExternalMemory` is a unique handle to `len` bytes at `ptr` (the contract of
// `new`); the bytes are plain data, so moving the handle to another thread is sound, as
// moving a `Box<[u8]>` is. `owner` is `Send`.
unsafe impl Send for ExternalMemory {}

impl ExternalMemory {
    /// Wrap `len` bytes at `ptr`, kept valid by `owner`.
    ///
    /// # Safety
    /// Until `owner` is dropped (which happens only after the `ExternalMemory` itself is
    /// dropped):
    /// - `ptr` is non-null and valid for reads and writes of `len` bytes, and the bytes
    ///   are initialized (any value);
    /// - nothing else reads or writes those bytes (no other Rust reference, no other
    ///   mapping used concurrently by this process, no device DMA into them while the
    ///   region is registered) — this handle is their only user, as a `Box<[u8]>` would
    ///   be;
    /// - `len <= isize::MAX`;
    /// - moving `owner` does not invalidate `ptr`: hold the memory through a raw pointer
    ///   or a handle (an mmap guard, a `Vec`), not a `Box<[u8]>` or `&mut [u8]` whose move
    ///   asserts unique access to the bytes.
    pub unsafe fn new(ptr: *mut u8, len: usize, owner: Box<dyn Any + Send>) -> ExternalMemory {
        ExternalMemory { ptr, len, owner }
    }

    /// The owner value given to [`new`](Self::new).
    pub fn into_owner(self) -> Box<dyn Any + Send> {
        self.owner
    }
}

impl std::fmt::Debug for ExternalMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExternalMemory")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl AsRef<[u8]> for ExternalMemory {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `new`'s contract: `ptr` is valid for reads of `len` initialized bytes that
        // nothing else writes while this handle lives; the shared borrow of `self` bounds
        // the slice's lifetime, so no `&mut` from `as_mut` can coexist with it.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl AsMut<[u8]> for ExternalMemory {
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `new`'s contract: `ptr` is valid for writes of `len` bytes nothing else
        // touches; the exclusive borrow of `self` makes this the only reference to them.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}
