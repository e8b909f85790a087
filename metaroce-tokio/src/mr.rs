//! Memory regions and their remote descriptors.
//!
//! (The rules of access and visibility are in the docs of [`MemoryRegion`].)

use crate::endpoint::EndpointRef;
use crate::error::Error;
use crate::Endpoint;
use metaroce::{Access, MrError, MrKeys, RegionMemory};
use parking_lot::{Mutex, MutexGuard};
use std::any::Any;
use std::sync::Arc;

/// What a peer needs to address a region: the core's [`metaroce::RemoteRegion`] (address,
/// length, rkey; 20-byte [`to_bytes`](RemoteRegion::to_bytes)), shared with every backend
/// of [`metaroce::api`].
pub use metaroce::RemoteRegion;

/// The peer's address of `len` bytes at `offset` of the region `r` describes, if the span
/// lies inside the descriptor: [`Error::RemoteOutOfBounds`] otherwise, so that this common
/// mistake is named before anything is sent (the peer would refuse it with a bare remote
/// access error). The peer still checks every access against its real region.
pub(crate) fn remote_addr(r: &RemoteRegion, offset: u64, len: u64) -> Result<u64, Error> {
    let end = offset.checked_add(len);
    // The span's last address must not pass u64::MAX either (as `RemoteRegion::slice`).
    let addr = r.addr_at(offset).filter(|a| a.checked_add(len).is_some());
    match (end, addr) {
        (Some(end), Some(addr)) if end <= r.len => Ok(addr),
        _ => Err(Error::RemoteOutOfBounds {
            offset,
            len,
            region_len: r.len,
        }),
    }
}

/// Largest piece a local copy moves under the region's lock (64 KiB, a few microseconds
/// of `memcpy`): the most a packet for the region waits for an application copy.
pub const COPY_CHUNK: usize = 64 * 1024;

/// An owned byte buffer a [`MemoryRegion`] can be built on without a copy: `Vec<u8>`,
/// `bytes::BytesMut`, `Box<[u8]>`, or any type with stable `AsRef<[u8]>`/`AsMut<[u8]>`
/// views. The region's length is the buffer's length at registration; the buffer is not
/// resized while registered (nothing but the region can reach it).
pub trait OwnedBuffer: AsRef<[u8]> + AsMut<[u8]> + Send + 'static {}

impl<T: AsRef<[u8]> + AsMut<[u8]> + Send + 'static> OwnedBuffer for T {}

/// The bytes behind a region, type-erased.
pub(crate) trait Backing: Send + 'static {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
    fn as_any(&self) -> &dyn Any;
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
}

impl<B: OwnedBuffer> Backing for B {
    fn bytes(&self) -> &[u8] {
        self.as_ref()
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.as_mut()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

type Cell = Arc<Mutex<Box<dyn Backing>>>;

/// The region's lock. `parking_lot`'s: no poisoning (a panic in a user closure under the
/// lock leaves plain bytes), and `unlock_fair` hands the lock to a waiting thread, which a
/// long chunked copy needs so that the driver's packets for this region are not starved.
fn lock(cell: &Mutex<Box<dyn Backing>>) -> MutexGuard<'_, Box<dyn Backing>> {
    cell.lock()
}

/// The core's handle on a region's bytes: one region lock per call.
struct Shared(Cell, metaroce::LendHandle);

impl Shared {
    /// The core's handle on `cell`, lending it for gather send through a weak reference
    /// ([`RegionMemory::lend`]): a transmit queued in the driver does not keep the buffer
    /// from [`MemoryRegion::into_inner`], and finds it gone after deregistration.
    fn new(cell: &Cell) -> Self {
        let weak: std::sync::Weak<Mutex<Box<dyn Backing>>> = Arc::downgrade(cell);
        Shared(cell.clone(), Arc::new(weak))
    }
}

/// Call `f` with the bytes of the region a lent transmit reads from, under the region's
/// lock ([`metaroce::Lent`]); `None` if the region is gone (deregistered) or the handle is
/// not one of this crate's regions.
pub(crate) fn with_lent<R>(lent: &metaroce::Lent, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
    let weak = lent
        .memory()?
        .downcast_ref::<std::sync::Weak<Mutex<Box<dyn Backing>>>>()?;
    let cell = weak.upgrade()?;
    let g = lock(&cell);
    Some(f(g.bytes()))
}

impl RegionMemory for Shared {
    fn len(&self) -> usize {
        lock(&self.0).bytes().len()
    }
    fn read_at(&self, offset: usize, dst: &mut [u8]) {
        let g = lock(&self.0);
        if let Some(s) = g.bytes().get(offset..offset.saturating_add(dst.len())) {
            dst.copy_from_slice(s);
        }
    }
    fn append_to(&self, offset: usize, len: usize, out: &mut Vec<u8>) {
        // One copy under the lock, no zero fill first (the sender's WRITE packets).
        let g = lock(&self.0);
        match g.bytes().get(offset..offset.saturating_add(len)) {
            Some(s) => out.extend_from_slice(s),
            None => out.resize(out.len() + len, 0),
        }
    }
    fn write_at(&mut self, offset: usize, src: &[u8]) {
        let mut g = lock(&self.0);
        if let Some(d) = g
            .bytes_mut()
            .get_mut(offset..offset.saturating_add(src.len()))
        {
            d.copy_from_slice(src);
        }
    }
    fn atomic_at(&mut self, offset: usize, f: &mut dyn FnMut(u64) -> u64) -> u64 {
        // Read and write under one hold of the lock: local writes cannot slip between.
        let mut g = lock(&self.0);
        let Some(cell) = g.bytes_mut().get_mut(offset..offset.saturating_add(8)) else {
            return 0;
        };
        let mut b = [0u8; 8];
        b.copy_from_slice(cell);
        let old = u64::from_le_bytes(b);
        cell.copy_from_slice(&f(old).to_le_bytes());
        old
    }
    fn with_span(&self, offset: usize, len: usize, f: &mut dyn FnMut(&[u8])) {
        let g = lock(&self.0);
        if let Some(s) = g.bytes().get(offset..offset.saturating_add(len)) {
            f(s);
        }
    }
    fn lend(&self) -> Option<metaroce::LendHandle> {
        Some(self.1.clone())
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

/// A region of memory registered with an endpoint.
///
/// Peers WRITE into it while local code runs, so local code never gets a plain reference
/// that a remote write could race with: it copies in and out ([`read`](Self::read),
/// [`read_into`](Self::read_into), [`write`](Self::write)) or runs a closure under the
/// region's lock ([`with_bytes`](Self::with_bytes)); below, when remote bytes are
/// visible. Deregistered on drop (later accesses by peers get a remote access error);
/// [`into_inner`](Self::into_inner) deregisters and returns the buffer.
///
/// # Where the bytes live, and who may touch them when
///
/// A [`MemoryRegion`] owns its buffer (a `Vec<u8>`, `BytesMut`, `Box<[u8]>` or any
/// [`OwnedBuffer`], registered without a copy; or externally owned memory, see
/// [`ExternalMemory`]). The buffer sits behind a lock of its own, not the endpoint's: the
/// protocol core checks every access (rkey, bounds, access rights) under the endpoint lock
/// and then takes the region's lock for the one packet it places or reads. Local copies
/// ([`read`](MemoryRegion::read), [`read_into`](MemoryRegion::read_into),
/// [`write`](MemoryRegion::write)) take only the region's lock, in chunks of
/// [`COPY_CHUNK`] bytes, so packet processing — of this region and of every other — waits
/// at most one chunk, never a whole large copy.
///
/// # When remote bytes are visible
///
/// Each packet of a peer's RDMA WRITE is placed when the driver processes it, in any order
/// (packets are sprayed over many paths); a local read at that moment sees whatever packets
/// have landed. Every byte of a WRITE is visible to a local read that starts after either
/// - the peer's WRITE with immediate is reported by [`recv_imm`](crate::Connection::recv_imm)
///   (all of its bytes landed before the immediate is reported), or
/// - the writer, after its `write` resolved (every packet acknowledged, hence placed), says
///   so in a later message or operation.
///
/// A local read concurrent with a remote WRITE may see part of it; bytes of one packet are
/// placed under one region lock, so a read never sees a torn packet within one
/// [`COPY_CHUNK`]. READ responses, atomic results and posted receives land the same way
/// and are complete when their operation resolves.
///
/// # Example
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use metaroce_tokio::{Access, Endpoint};
/// let ep = Endpoint::bind("127.0.0.1:0".parse()?, Default::default()).await?;
/// let mr = ep.register_buffer(bytes::BytesMut::zeroed(4096), Access::LOCAL_WRITE);
/// mr.write(0, b"hello")?;
/// assert_eq!(mr.read(0, 5)?, b"hello");
/// let buf: bytes::BytesMut = mr.into_inner().expect("registered as BytesMut");
/// assert_eq!(&buf[..5], b"hello");
/// # Ok(()) }
/// ```
pub struct MemoryRegion {
    ep: Arc<EndpointRef>,
    keys: MrKeys,
    mem: Cell,
    /// Deregistration was handed to someone else (`detach`): Drop does nothing.
    detached: bool,
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("keys", &self.keys)
            .finish()
    }
}

impl Endpoint {
    /// Register `buf` as a memory region with `access` rights, without copying it: the
    /// region owns the buffer until [`MemoryRegion::into_inner`] gives it back. Its length
    /// is `buf.as_ref().len()`. `access` needs `LOCAL_WRITE` for the region to receive
    /// READ results and messages, the `REMOTE_*` rights for what peers may do.
    pub fn register_buffer<B: OwnedBuffer>(&self, buf: B, access: Access) -> MemoryRegion {
        self.register_backing(Box::new(buf), access)
    }

    /// Number of memory regions registered on this endpoint now (the application's and
    /// the 8-byte result regions of atomics in flight).
    pub fn registered_regions(&self) -> usize {
        self.inner.shared.lock().core.registered_mrs()
    }

    pub(crate) fn register_backing(&self, b: Box<dyn Backing>, access: Access) -> MemoryRegion {
        let mem: Cell = Arc::new(Mutex::new(b));
        // Shard 0 chooses the keys; every other shard registers the same bytes under the
        // same keys, so that a WRITE, READ or atomic reaches the region on whichever shard
        // its connection lives (one lock at a time: never two shard locks at once).
        let shards = &self.inner.shards;
        let keys = shards[0]
            .lock()
            .core
            .register_mr_memory(Box::new(Shared::new(&mem)), access);
        for s in &shards[1..] {
            let r = s
                .lock()
                .core
                .register_mr_memory_with_keys(Box::new(Shared::new(&mem)), keys);
            if let Err(e) = r {
                // Cannot happen while shard 0 alone chooses keys and deregistration
                // reaches shard 0 last; reported rather than panicking.
                tracing::error!(lkey = keys.lkey, error = %e, "region not registered on a shard");
            }
        }
        MemoryRegion {
            ep: self.inner.clone(),
            keys,
            mem,
            detached: false,
        }
    }
}

impl MemoryRegion {
    pub(crate) fn ep(&self) -> &Arc<EndpointRef> {
        &self.ep
    }

    /// Give up the handle without deregistering: the caller deregisters `lkey` later
    /// (through the core) once no operation can touch it.
    pub(crate) fn detach(mut self) -> u32 {
        self.detached = true;
        self.keys.lkey
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

    fn span(&self, offset: u64, len: usize) -> Result<usize, Error> {
        offset
            .checked_add(len as u64)
            .filter(|&e| e <= self.keys.len)
            .map(|_| offset as usize)
            .ok_or(Error::Memory(MrError::OutOfBounds))
    }

    /// Copy out bytes `[offset, offset + len)`.
    ///
    /// # Errors
    /// [`Error::Memory`]`(OutOfBounds)` if the range is not inside the region.
    pub fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, Error> {
        let n = usize::try_from(len).map_err(|_| Error::Memory(MrError::OutOfBounds))?;
        self.span(offset, n)?;
        let mut out = vec![0u8; n];
        self.read_into(offset, &mut out)?;
        Ok(out)
    }

    /// Copy bytes `[offset, offset + dst.len())` into `dst`, [`COPY_CHUNK`] bytes per hold
    /// of the region's lock (remote writes may land between chunks).
    ///
    /// # Errors
    /// [`Error::Memory`]`(OutOfBounds)` if the range is not inside the region.
    pub fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<(), Error> {
        let start = self.span(offset, dst.len())?;
        let end = start + dst.len();
        for (i, chunk) in dst.chunks_mut(COPY_CHUNK).enumerate() {
            let at = start + i * COPY_CHUNK;
            let g = lock(&self.mem);
            match g.bytes().get(at..at + chunk.len()) {
                Some(s) => chunk.copy_from_slice(s),
                None => return Err(Error::Memory(MrError::OutOfBounds)),
            }
            // Hand the lock to the driver if it waits (a plain unlock would let this loop
            // take it again first, and the region's packets would wait for the whole copy),
            // and give up the CPU before the next chunk: `unlock_fair` hands off only to a
            // thread already parked on the lock, and without the yield a thread that was
            // runnable but not running never got in — a 64 MiB copy kept another thread
            // off the lock for the whole copy in 500 of 500 copies on a loaded 2-core
            // machine (memory.rs, `local_copies_do_not_stall_packet_processing`). The yield
            // is a no-op when nothing else is runnable (20 copies of 64 MiB: 219–450 ms
            // with it, 564 ms without, on that machine: within its noise).
            MutexGuard::unlock_fair(g);
            if at + chunk.len() < end {
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    /// Copy `data` into the region at `offset`, [`COPY_CHUNK`] bytes per hold of the
    /// region's lock. Peers see the bytes in their next READ of the range (or in the
    /// packets of a READ response still being sent: the responder reads the region as it
    /// builds each one).
    ///
    /// # Errors
    /// [`Error::Memory`]`(OutOfBounds)` if the range is not inside the region.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        let start = self.span(offset, data.len())?;
        for (i, chunk) in data.chunks(COPY_CHUNK).enumerate() {
            let at = start + i * COPY_CHUNK;
            let mut g = lock(&self.mem);
            match g.bytes_mut().get_mut(at..at + chunk.len()) {
                Some(d) => d.copy_from_slice(chunk),
                None => return Err(Error::Memory(MrError::OutOfBounds)),
            }
            MutexGuard::unlock_fair(g);
            // As in `read_into`: let a waiting packet in between chunks.
            if at + chunk.len() < start + data.len() {
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    /// Run `f` over the whole region under the region's lock: a consistent view (no remote
    /// write lands while `f` runs). Packets for **this** region wait until `f` returns, and
    /// while one waits so does the driver: keep `f` short, or copy out with
    /// [`read_into`](Self::read_into). Other regions' packets and the endpoint's lock are
    /// not held by `f`.
    ///
    /// `f` must not call into the endpoint or its connections (post, stats, close, …): the
    /// driver may be waiting for this region's lock while it holds the endpoint's (to place
    /// a packet, or to read a READ response or WRITE source), so such a call never returns.
    pub fn with_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> Result<R, Error> {
        let g = lock(&self.mem);
        Ok(f(g.bytes()))
    }

    /// Deregister the region and return its buffer, as registered. From the moment this
    /// returns, the transport never touches the buffer again: peers' later accesses get a
    /// remote access error, and a local operation still using the region fails with a
    /// local protection error. (An operation future borrows the region, so none can be
    /// pending when `self` is moved here; one cancelled by dropping its future has been
    /// stopped by the core already.)
    ///
    /// # Errors
    /// `Err(self)`, still registered, if `B` is not the type that was registered (for
    /// [`Endpoint::register`] and [`Endpoint::alloc`] it is `Vec<u8>`; external memory
    /// cannot be taken back this way: use [`deregister`](Self::deregister)). Also
    /// `Err(self)`, deregistered already, in the unlikely case that the driver kept reading
    /// the region for a send (gather send, [`metaroce::Lent`]) for a whole second: call
    /// `into_inner` again. (It may block that long waiting for such a send.)
    pub fn into_inner<B: OwnedBuffer>(mut self) -> Result<B, MemoryRegion> {
        if !lock(&self.mem).as_any().is::<B>() {
            return Err(self);
        }
        if !self.detached {
            self.detached = true;
            self.ep.shared.deregister_everywhere(self.keys.lkey);
        }
        let mem = std::mem::replace(&mut self.mem, Arc::new(Mutex::new(Box::new(Vec::new()))));
        match unwrap_cell(mem) {
            Ok(b) => match b.into_any().downcast::<B>() {
                Ok(b) => Ok(*b),
                // Checked above; unreachable, but never panic.
                Err(_) => unreachable_buffer(),
            },
            Err(mem) => {
                // Deregistered, but a send still reads it (see `unwrap_cell`): the caller
                // may try again.
                self.mem = mem;
                Err(self)
            }
        }
    }

    /// Deregister the region and return its buffer type-erased (downcast it with
    /// `Box::<dyn Any>::downcast`; for [`ExternalMemory`] this drops nothing until the box
    /// is dropped). The transport never touches the memory again (see
    /// [`into_inner`](Self::into_inner)).
    pub fn deregister(mut self) -> Box<dyn Any> {
        if !self.detached {
            self.detached = true;
            self.ep.shared.deregister_everywhere(self.keys.lkey);
        }
        let mem = std::mem::replace(&mut self.mem, Arc::new(Mutex::new(Box::new(Vec::new()))));
        match unwrap_cell(mem) {
            Ok(b) => b.into_any(),
            // A send outlasted every wait (see `unwrap_cell`): a copy of the bytes.
            Err(shared) => {
                let g = lock(&shared);
                Box::new(g.bytes().to_vec())
            }
        }
    }
}

/// How long `unwrap_cell` waits for sends that still read a deregistered region.
const UNWRAP_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The buffer of `mem` once nothing else holds it. After deregistration the core has let
/// go; what may still hold it is the driver sending a gather transmit that reads it (one
/// `sendmsg`, under the region's lock, see [`with_lent`]), and the driver's queue holds at
/// most one batch of those. So wait for the lock between tries, yielding at first and then
/// sleeping 50 µs (a driver thread descheduled while it holds the region, on a loaded
/// machine, outlasted 10,000 yields in a review's run); `Err` only if sends kept holding
/// it for [`UNWRAP_WAIT`].
fn unwrap_cell(mut mem: Cell) -> Result<Box<dyn Backing>, Cell> {
    let start = std::time::Instant::now();
    for tries in 0u32.. {
        match Arc::try_unwrap(mem) {
            Ok(m) => return Ok(m.into_inner()),
            Err(m) => {
                drop(lock(&m));
                if start.elapsed() >= UNWRAP_WAIT {
                    return Err(m);
                }
                if tries < 64 {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(std::time::Duration::from_micros(50));
                }
                mem = m;
            }
        }
    }
    Err(mem)
}

#[cold]
fn unreachable_buffer<B>() -> Result<B, MemoryRegion> {
    unreachable!("buffer type checked before deregistration")
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        if !self.detached {
            // The core's handle is dropped outside the endpoint lock (it is only a
            // reference count; the buffer goes with this region's last reference).
            self.ep.shared.deregister_everywhere(self.keys.lkey);
        }
    }
}

pub use crate::external::ExternalMemory;
