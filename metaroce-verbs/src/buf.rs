//! The memory behind a memory region: a heap buffer whose address never changes while it is
//! registered, read and written only by copies (the device may write it at any time, so no
//! `&[u8]` or `&mut [u8]` to it is ever handed out). The copies of this process are
//! serialized by a lock of the buffer's own: handles of one region are `Clone + Sync`, and
//! two threads copying into the same bytes at once was a data race from safe code (found by
//! review, confirmed with ThreadSanitizer). What the device writes by DMA meanwhile is
//! ordered only by work completions, as in every verbs program.

/// A boxed byte buffer owned through a raw pointer, freed on drop.
#[derive(Debug)]
pub(crate) struct RegBuf {
    ptr: *mut u8,
    len: usize,
    /// Held by every copy in or out: the CPU's accesses through `&RegBuf` never overlap.
    copy: std::sync::Mutex<()>,
}

// SAFETY: RegBuf owns its allocation exclusively (like Box<[u8]>); the memory is reached
// only by the copies below, and device access is the MR's business, as with any DMA buffer.
unsafe impl Send for RegBuf {}
// SAFETY: &RegBuf allows only copies in and out (no references into the memory), each made
// while holding `copy`, so no two threads access the bytes at the same time.
unsafe impl Sync for RegBuf {}

impl RegBuf {
    pub(crate) fn new(b: Box<[u8]>) -> RegBuf {
        let len = b.len();
        let ptr = Box::into_raw(b) as *mut u8;
        RegBuf {
            ptr,
            len,
            copy: std::sync::Mutex::new(()),
        }
    }

    /// The copy lock (a panic while it was held cannot leave it in a state that matters:
    /// the bytes are plain data).
    fn lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.copy
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether `[off, off + n)` lies inside the buffer (false on overflow).
    pub(crate) fn check(&self, off: usize, n: usize) -> bool {
        off.checked_add(n).is_some_and(|end| end <= self.len)
    }

    /// Copy `src` to `[off, off + src.len())`; false if out of range.
    pub(crate) fn write(&self, off: usize, src: &[u8]) -> bool {
        if !self.check(off, src.len()) {
            return false;
        }
        let _held = self.lock();
        // SAFETY: the range is in bounds of the live allocation; src is a distinct Rust
        // slice (it cannot alias memory only reachable through this raw pointer); no other
        // thread copies while `_held` is held.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(off), src.len()) };
        true
    }

    /// Copy `[off, off + dst.len())` into `dst`; false if out of range.
    pub(crate) fn read(&self, off: usize, dst: &mut [u8]) -> bool {
        if !self.check(off, dst.len()) {
            return false;
        }
        let _held = self.lock();
        // SAFETY: in bounds of the live allocation; dst is a distinct Rust slice; no other
        // thread copies while `_held` is held.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), dst.as_mut_ptr(), dst.len()) };
        true
    }

    /// Give the buffer back (only when it is no longer registered).
    pub(crate) fn into_box(self) -> Box<[u8]> {
        let me = std::mem::ManuallyDrop::new(self);
        // SAFETY: ptr/len came from Box::into_raw of a Box<[u8]> of that length, and
        // ManuallyDrop keeps Drop from freeing it a second time.
        unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(me.ptr, me.len)) }
    }
}

impl Drop for RegBuf {
    fn drop(&mut self) {
        // SAFETY: as in into_box; Drop runs once.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_bounds_checked_and_buffer_round_trips() {
        let b = RegBuf::new(vec![0u8; 8].into_boxed_slice());
        assert!(b.write(4, &[1, 2, 3, 4]));
        assert!(!b.write(5, &[1, 2, 3, 4]));
        assert!(!b.write(usize::MAX, &[1]));
        let mut d = [0u8; 3];
        assert!(b.read(5, &mut d));
        assert_eq!(d, [2, 3, 4]);
        assert!(!b.read(6, &mut d));
        assert_eq!(&*b.into_box(), &[0, 0, 0, 0, 1, 2, 3, 4]);
    }

    /// Two threads write the same bytes with different patterns while a third reads
    /// them: every read sees one whole pattern, never a mix (the copies are serialized;
    /// without the lock this was a data race, shown under ThreadSanitizer by review).
    #[test]
    fn concurrent_copies_never_tear() {
        let b = std::sync::Arc::new(RegBuf::new(vec![0u8; 1 << 16].into_boxed_slice()));
        let writers: Vec<_> = [0x55u8, 0xAA]
            .into_iter()
            .map(|v| {
                let b = b.clone();
                std::thread::spawn(move || {
                    let src = vec![v; 1 << 16];
                    for _ in 0..3000 {
                        assert!(b.write(0, &src));
                    }
                })
            })
            .collect();
        let mut d = vec![0u8; 1 << 16];
        for _ in 0..3000 {
            assert!(b.read(0, &mut d));
            assert!(d.iter().all(|&x| x == d[0]), "a read saw two writes' bytes");
        }
        for w in writers {
            w.join().unwrap();
        }
    }
}
