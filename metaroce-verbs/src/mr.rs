//! Protection domains and memory regions of user-owned buffers.

use crate::buf::RegBuf;
use crate::device::CtxInner;
use crate::{ffi, verbs_err, Access, Context, Error, RemoteRegion, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

pub(crate) struct PdInner {
    pub(crate) raw: ffi::Raw,
    pub(crate) ctx: Arc<CtxInner>,
    live_mrs: AtomicUsize,
}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: PdInner owns the PD and drops once; its MRs and QPs hold an Arc of it,
        // so all are gone.
        unsafe { ffi::dealloc_pd(self.raw) };
    }
}

/// A protection domain (`ibv_pd`). Cheap to clone.
#[derive(Clone)]
pub struct Pd(pub(crate) Arc<PdInner>);

impl std::fmt::Debug for Pd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pd")
            .field("live_mrs", &self.live_mrs())
            .finish()
    }
}

impl Pd {
    pub(crate) fn new(ctx: &Context) -> Result<Pd> {
        let raw = ffi::alloc_pd(ctx.0.raw).map_err(verbs_err("ibv_alloc_pd"))?;
        Ok(Pd(Arc::new(PdInner {
            raw,
            ctx: ctx.0.clone(),
            live_mrs: AtomicUsize::new(0),
        })))
    }

    /// The device context of this PD.
    pub fn context(&self) -> Context {
        Context(self.0.ctx.clone())
    }

    /// Register `buf` (`ibv_reg_mr`) with `access`. The buffer is owned by the MR from now
    /// on; get it back with [`Mr::into_inner`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty buffer or remote write/atomic access without
    /// local write (IBA 10.6.3.1), [`Error::Verbs`] if the device refuses.
    pub fn register(&self, buf: impl Into<Box<[u8]>>, access: Access) -> Result<Mr> {
        let buf = RegBuf::new(buf.into());
        if buf.len() == 0 {
            return Err(Error::InvalidArgument(
                "cannot register an empty buffer".into(),
            ));
        }
        if (access.contains(Access::REMOTE_WRITE) || access.contains(Access::REMOTE_ATOMIC))
            && !access.contains(Access::LOCAL_WRITE)
        {
            return Err(Error::InvalidArgument(
                "remote write or atomic access needs LOCAL_WRITE".into(),
            ));
        }
        // SAFETY: the buffer is owned by the MrInner made below, which deregisters before
        // dropping it (MrInner::drop), and its heap address never moves.
        let raw = unsafe { ffi::reg_mr(self.0.raw, buf.ptr(), buf.len(), access.0 as i32) }
            .map_err(verbs_err("ibv_reg_mr"))?;
        self.0.live_mrs.fetch_add(1, Ordering::Relaxed);
        Ok(Mr(Arc::new(MrInner {
            raw,
            buf: Some(buf),
            pd: self.0.clone(),
            access,
        })))
    }

    /// MRs of this PD still registered: those alive plus those dropped by the application
    /// whose outstanding work requests have not completed yet.
    pub fn live_mrs(&self) -> usize {
        self.0.live_mrs.load(Ordering::Relaxed)
    }
}

pub(crate) struct MrInner {
    raw: ffi::MrRaw,
    buf: Option<RegBuf>,
    pub(crate) pd: Arc<PdInner>,
    access: Access,
}

impl MrInner {
    pub(crate) fn addr(&self) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.ptr() as u64)
    }
    pub(crate) fn len(&self) -> usize {
        self.buf.as_ref().map_or(0, RegBuf::len)
    }
    pub(crate) fn access(&self) -> Access {
        self.access
    }
    pub(crate) fn buf(&self) -> &RegBuf {
        self.buf.as_ref().expect("buffer present until drop")
    }
    /// The SGE for `[off, off + len)`, or an error if out of range.
    pub(crate) fn sge(&self, off: u64, len: u64) -> Result<ffi::ibv_sge> {
        local_range(self.len(), off, len)?;
        if len > u64::from(u32::MAX) {
            return Err(Error::InvalidArgument(format!(
                "local range {off}+{len}: one SGE holds at most 2^32 - 1 bytes"
            )));
        }
        Ok(ffi::ibv_sge {
            addr: self.addr() + off,
            length: len as u32,
            lkey: self.raw.lkey,
        })
    }
    /// Deregister and take the buffer; `None` if `ibv_dereg_mr` failed: the MR is still
    /// registered and keeps its buffer (a handle to it stays usable).
    fn deregister(&mut self) -> Option<RegBuf> {
        // SAFETY: MrInner owns the MR; `buf` is Some only while it is registered (this
        // returns it on success, so a second successful call cannot happen), and the
        // handle is not used after that.
        if let Err(e) = unsafe { ffi::dereg_mr(self.raw.raw) } {
            tracing::error!(error = %e, "ibv_dereg_mr failed; the MR stays registered");
            return None;
        }
        self.pd.live_mrs.fetch_sub(1, Ordering::Relaxed);
        self.buf.take()
    }
}

impl Drop for MrInner {
    fn drop(&mut self) {
        if self.buf.is_some() && self.deregister().is_none() {
            // The device still references the memory: leak it rather than free it.
            std::mem::forget(self.buf.take());
        }
    }
}

/// A registered memory region owning its buffer. Work requests hold a reference to it
/// until they complete, so dropping an `Mr` with operations in flight defers the
/// deregistration and the freeing of the buffer until their completions.
///
/// The device may write the memory at any time (remote WRITE, local READ results), so its
/// bytes are accessed by copy ([`Mr::read`], [`Mr::write`]).
#[derive(Clone)]
pub struct Mr(pub(crate) Arc<MrInner>);

impl std::fmt::Debug for Mr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mr")
            .field("addr", &format_args!("{:#x}", self.0.addr()))
            .field("len", &self.0.len())
            .field("lkey", &self.0.raw.lkey)
            .field("rkey", &self.0.raw.rkey)
            .field("access", &self.0.access)
            .finish()
    }
}

impl Mr {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }
    /// Always false (empty buffers are refused at registration).
    pub fn is_empty(&self) -> bool {
        self.0.len() == 0
    }
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.0.raw.lkey
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.0.raw.rkey
    }
    /// Virtual address of the first byte (what a peer uses as `remote_addr`).
    pub fn addr(&self) -> u64 {
        self.0.addr()
    }
    /// The whole region as a peer addresses it.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            addr: self.addr(),
            len: self.len() as u64,
            rkey: self.rkey(),
        }
    }
    /// Copy `len` bytes from `offset`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if out of range.
    pub fn read(&self, offset: usize, len: usize) -> Result<Vec<u8>> {
        // Range first: `len` is application input and may be huge (`usize::MAX`), so it
        // must not size an allocation before it is known to fit the MR.
        if !self.0.buf().check(offset, len) {
            return Err(Error::InvalidArgument(format!(
                "read {offset}+{len} outside the {}-byte MR",
                self.len()
            )));
        }
        let mut v = vec![0u8; len];
        let copied = self.0.buf().read(offset, &mut v);
        debug_assert!(copied, "range checked above");
        Ok(v)
    }
    /// Copy `data` to `offset`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if out of range.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        if self.0.buf().write(offset, data) {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "write {offset}+{} outside the {}-byte MR",
                data.len(),
                self.len()
            )))
        }
    }
    /// Deregister and return the buffer, if this is the last handle and no work request
    /// uses it; otherwise give the `Mr` back (also when `ibv_dereg_mr` fails: the MR then
    /// stays registered, and the handle usable).
    pub fn into_inner(self) -> Result<Box<[u8]>, Mr> {
        match Arc::try_unwrap(self.0) {
            Ok(mut inner) => match inner.deregister() {
                Some(b) => Ok(b.into_box()),
                None => Err(Mr(Arc::new(inner))),
            },
            Err(a) => Err(Mr(a)),
        }
    }
}

/// Checks that `off..off + len` lies within an MR of `mr_len` bytes (every sum checked):
/// [`Error::InvalidArgument`] otherwise. Shared by SGEs and [`crate::MpConnection`].
pub(crate) fn local_range(mr_len: usize, off: u64, len: u64) -> Result<()> {
    if off.checked_add(len).is_none_or(|e| e > mr_len as u64) {
        return Err(Error::InvalidArgument(format!(
            "local range {off}+{len} outside the {mr_len}-byte MR"
        )));
    }
    Ok(())
}
