//! The memory behind a memory region: a heap buffer whose address never changes while it is
//! registered, read and written only by copies (the device may write it at any time, so no
//! `&[u8]` or `&mut [u8]` to it is ever handed out). The second of the crate's two `unsafe`
//! modules.

/// A boxed byte buffer owned through a raw pointer, freed on drop.
#[derive(Debug)]
pub(crate) struct RegBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: RegBuf owns its allocation exclusively (like Box<[u8]>); concurrent access goes
// through copies below, and device access is the MR's business, as with any DMA buffer.
unsafe impl Send for RegBuf {}
// SAFETY: &RegBuf only allows copies in and out (no references into the memory).
unsafe impl Sync for RegBuf {}

impl RegBuf {
    pub(crate) fn new(b: Box<[u8]>) -> RegBuf {
        let len = b.len();
        let ptr = Box::into_raw(b) as *mut u8;
        RegBuf { ptr, len }
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
        // SAFETY: the range is in bounds of the live allocation; src is a distinct Rust
        // slice (it cannot alias memory only reachable through this raw pointer).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(off), src.len()) };
        true
    }

    /// Copy `[off, off + dst.len())` into `dst`; false if out of range.
    pub(crate) fn read(&self, off: usize, dst: &mut [u8]) -> bool {
        if !self.check(off, dst.len()) {
            return false;
        }
        // SAFETY: in bounds of the live allocation; dst is a distinct Rust slice.
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
}
