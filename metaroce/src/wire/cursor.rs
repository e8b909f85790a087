//! Bounds-checked big-endian readers and writers used by every header codec.
//!
//! Nothing in here can panic: every access goes through `get` / `get_mut` and a short buffer
//! becomes an [`Error`].

use super::Error;

/// The first `N` bytes of `buf` as an array, for headers read at fixed offsets with no
/// further bounds checks (issue #13: a [`Reader`] checks every field); [`Error::Truncated`]
/// if `buf` is shorter.
#[inline]
pub(crate) fn fixed<const N: usize>(buf: &[u8]) -> Result<&[u8; N], Error> {
    buf.first_chunk::<N>().ok_or(Error::Truncated {
        needed: N,
        got: buf.len(),
    })
}

/// Sequential big-endian reader over a borrowed byte slice.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A reader over `buf` that first checks that at least `need` bytes are present.
    pub(crate) fn with_len(buf: &'a [u8], need: usize) -> Result<Self, Error> {
        if buf.len() < need {
            return Err(Error::Truncated {
                needed: need,
                got: buf.len(),
            });
        }
        Ok(Reader { buf, pos: 0 })
    }

    /// The next `N` bytes as an array.
    pub(crate) fn array<const N: usize>(&mut self) -> Result<[u8; N], Error> {
        let end = self.pos.checked_add(N).ok_or(Error::BadLength)?;
        let got = self.buf.len();
        let slice = self
            .buf
            .get(self.pos..end)
            .ok_or(Error::Truncated { needed: end, got })?;
        let arr = <[u8; N]>::try_from(slice).map_err(|_| Error::BadLength)?;
        self.pos = end;
        Ok(arr)
    }

    pub(crate) fn skip(&mut self, n: usize) -> Result<(), Error> {
        let end = self.pos.checked_add(n).ok_or(Error::BadLength)?;
        if end > self.buf.len() {
            return Err(Error::Truncated {
                needed: end,
                got: self.buf.len(),
            });
        }
        self.pos = end;
        Ok(())
    }

    pub(crate) fn u8(&mut self) -> Result<u8, Error> {
        let [b] = self.array::<1>()?;
        Ok(b)
    }

    pub(crate) fn u16(&mut self) -> Result<u16, Error> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    /// A 24-bit big-endian field, returned in the low 24 bits.
    pub(crate) fn u24(&mut self) -> Result<u32, Error> {
        let [a, b, c] = self.array::<3>()?;
        Ok(u32::from_be_bytes([0, a, b, c]))
    }

    pub(crate) fn u32(&mut self) -> Result<u32, Error> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    pub(crate) fn u64(&mut self) -> Result<u64, Error> {
        Ok(u64::from_be_bytes(self.array()?))
    }
}

/// Sequential big-endian writer into a borrowed mutable byte slice.
pub(crate) struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl<'a> Writer<'a> {
    /// A writer over `buf` that first checks that at least `need` bytes of room exist.
    pub(crate) fn with_len(buf: &'a mut [u8], need: usize) -> Result<Self, Error> {
        if buf.len() < need {
            return Err(Error::BufferTooSmall {
                needed: need,
                got: buf.len(),
            });
        }
        Ok(Writer { buf, pos: 0 })
    }

    pub(crate) fn bytes(&mut self, src: &[u8]) -> Result<(), Error> {
        let end = self.pos.checked_add(src.len()).ok_or(Error::BadLength)?;
        let got = self.buf.len();
        let dst = self
            .buf
            .get_mut(self.pos..end)
            .ok_or(Error::BufferTooSmall { needed: end, got })?;
        dst.copy_from_slice(src);
        self.pos = end;
        Ok(())
    }

    /// `N` bytes of a fixed-size field: one store of known size (issue #13: the field
    /// writers of every header of every packet went through a byte loop).
    #[inline]
    fn array<const N: usize>(&mut self, src: [u8; N]) -> Result<(), Error> {
        let end = self.pos.checked_add(N).ok_or(Error::BadLength)?;
        let got = self.buf.len();
        let dst: &mut [u8; N] = self
            .buf
            .get_mut(self.pos..end)
            .and_then(|d| d.try_into().ok())
            .ok_or(Error::BufferTooSmall { needed: end, got })?;
        *dst = src;
        self.pos = end;
        Ok(())
    }

    /// `n` zero bytes (reserved fields, pad).
    pub(crate) fn zeros(&mut self, n: usize) -> Result<(), Error> {
        let end = self.pos.checked_add(n).ok_or(Error::BadLength)?;
        let got = self.buf.len();
        let dst = self
            .buf
            .get_mut(self.pos..end)
            .ok_or(Error::BufferTooSmall { needed: end, got })?;
        dst.fill(0);
        self.pos = end;
        Ok(())
    }

    pub(crate) fn u8(&mut self, v: u8) -> Result<(), Error> {
        self.array([v])
    }

    pub(crate) fn u16(&mut self, v: u16) -> Result<(), Error> {
        self.array(v.to_be_bytes())
    }

    /// The low 24 bits of `v`, big-endian; the upper byte is dropped.
    pub(crate) fn u24(&mut self, v: u32) -> Result<(), Error> {
        let [_, a, b, c] = v.to_be_bytes();
        self.array([a, b, c])
    }

    pub(crate) fn u32(&mut self, v: u32) -> Result<(), Error> {
        self.array(v.to_be_bytes())
    }

    pub(crate) fn u64(&mut self, v: u64) -> Result<(), Error> {
        self.array(v.to_be_bytes())
    }
}
