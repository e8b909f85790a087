//! The io_uring instance, its provided-buffer ring and the send slots: all memory the kernel
//! reads or writes asynchronously lives here, and this is the io_uring backend's only module
//! with `unsafe` code.
//!
//! Ownership rules that make the `unsafe` blocks sound:
//!
//! * **Receive buffers** belong to one allocation of `count × buf_len` bytes that never moves
//!   and is freed only after the kernel has returned every buffer (or is leaked, see `Drop`).
//!   A buffer is the kernel's from the moment its id is published in the buffer ring until a
//!   completion names it (`IORING_CQE_F_BUFFER`); only then does [`Ring::recv_buf`] read it,
//!   and [`Ring::recycle`] hands it back.
//! * **Send slots** are boxed (stable addresses). A slot owns the datagram buffers it sends
//!   (moved in, never copied: their heap memory does not move when the `Vec` headers do);
//!   its buffers, `msghdr`, `iovec`s, address and control message are written before its SQE
//!   is pushed and not touched again until its last completion (for `SEND_ZC`, the
//!   notification `IORING_CQE_F_NOTIF`) frees it and its buffers become spare.
//! * **The multishot receive's `msghdr`** is boxed and lives as long as the ring.
//! * `Drop` cancels everything in flight and waits (bounded) for the completions before
//!   freeing; whatever the kernel still holds after that wait is leaked, never freed.

#![allow(unsafe_code)]

use std::alloc::{self, Layout};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU16, Ordering};

use io_uring::{cqueue, opcode, squeue, types, IoUring};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// `user_data` of the multishot receive (send slots use their index, far below).
const RECV_UD: u64 = 1 << 63;
/// `user_data` of cancellation requests (their completions are ignored).
const CANCEL_UD: u64 = (1 << 63) | 1;
/// Consecutive receive polls on a thread other than the one that armed the multishot
/// receive after which it is cancelled, to be re-armed from the polling thread. 4, not 32:
/// with the application's tasks on the runtime's workers beside the driver (as
/// `metaroce-perf` runs them since `50b5e26`), the driver task moves between the two
/// workers often and rarely polled 32 times in a row elsewhere (3 moves in 400,000 WRITEs),
/// so half its receives woke the other thread. `write_bw -s 64 --backend uring`, four runs
/// each: 32: 0.58–0.61 M WRITEs/s; 8: 0.62–0.66; 4: 0.66–0.72; 2: 0.68–0.74 but lists of 16
/// (`-Q 16`) fell to 0.59–0.77 against 4's 0.77–0.87 (32: 0.73–0.82); 1 MiB WRITEs and the
/// 64 B round trip unchanged (docs/RESULTS.md, fifteenth session).
pub(super) const RECV_FOLLOW_POLLS: u32 = 4;
/// Buffer group id of the receive buffer ring.
const BGID: u16 = 0x6d72;
/// Room reserved in each receive buffer for the source address and control messages.
pub(super) const NAME_LEN: u32 = 128;
pub(super) const CONTROL_LEN: u32 = 256;
/// `sizeof(struct io_uring_recvmsg_out)`.
const RECVMSG_OUT_LEN: usize = 16;

/// What one completion meant, as far as the backend cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Done {
    /// The multishot receive filled receive buffer `bid` with `len` bytes
    /// (`io_uring_recvmsg_out` header, name, control, payload).
    Recv { bid: u16, len: usize },
    /// The multishot receive failed with this errno (no buffer consumed).
    RecvError(i32),
    /// A send failed with this errno; `gso` when it carried `UDP_SEGMENT`, `datagrams` how
    /// many datagrams it held (all lost).
    SendError {
        errno: i32,
        gso: bool,
        datagrams: usize,
    },
}

/// One `sendmsg`'s memory: the datagram buffers it sends (one iovec each, concatenated by
/// the kernel and cut every `UDP_SEGMENT` bytes when there are several), destination,
/// control messages and the `msghdr` pointing at them.
struct SendSlot {
    /// The datagrams, owned by the slot until the send's last completion.
    bufs: Vec<Vec<u8>>,
    /// Instead of `bufs`: a range of shared buffer `shared` (one chunk of a transmit
    /// larger than one `sendmsg`), referenced until the send's last completion.
    shared: Option<(usize, std::ops::Range<usize>)>,
    /// One iovec per buffer; capacity fixed at creation (`MAX_IOVS`), so it never moves.
    iovs: Vec<libc::iovec>,
    name: socket2::SockAddr,
    control: [u64; 8],
    hdr: libc::msghdr,
    /// Awaiting the `IORING_CQE_F_NOTIF` completion of a `SEND_ZC`.
    awaiting_notif: bool,
    /// The send carries a `UDP_SEGMENT` control message.
    gso: bool,
}

/// Most buffers (iovecs) one send slot holds: the kernel's GSO limit.
pub(super) const MAX_IOVS: usize = 64;
/// Most spare datagram buffers kept for reuse after their sends completed.
const MAX_SPARE: usize = 1024;

// SAFETY: the raw pointers in `iovs` and `hdr` point into the slot's own heap data (the
// boxed slot, its `bufs` Vecs and `iovs` Vec, its `name`); they are only dereferenced by the kernel, and the slot
// is only accessed through `&mut Ring`, itself behind the backend's mutex.
unsafe impl Send for SendSlot {}

/// The receive buffers and the ring that provides them to the kernel.
struct BufRing {
    /// `count` entries of `io_uring_buf` (16 bytes each), page aligned; the tail is the
    /// `resv` field of entry 0.
    ring: *mut types::BufRingEntry,
    ring_layout: Layout,
    /// `count × buf_len` bytes of buffers.
    bufs: *mut u8,
    bufs_layout: Layout,
    count: u16,
    buf_len: usize,
    /// Next tail value to publish.
    tail: u16,
    registered: bool,
}

// SAFETY: the two allocations are owned by this value alone; the kernel accesses them only
// as described in the module documentation.
unsafe impl Send for BufRing {}

impl BufRing {
    fn new(count: u16, buf_len: usize) -> io::Result<BufRing> {
        if !count.is_power_of_two() || count > 32_768 || buf_len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "receive buffer count must be a power of two up to 32768",
            ));
        }
        let ring_layout = Layout::from_size_align(usize::from(count) * 16, 4096)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let bufs_layout = Layout::from_size_align(usize::from(count) * buf_len, 64)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: both layouts have a non-zero size (count ≥ 1, buf_len ≥ 1).
        let ring = unsafe { alloc::alloc_zeroed(ring_layout) }.cast::<types::BufRingEntry>();
        if ring.is_null() {
            return Err(io::Error::from(io::ErrorKind::OutOfMemory));
        }
        // SAFETY: as above.
        let bufs = unsafe { alloc::alloc(bufs_layout) };
        if bufs.is_null() {
            // SAFETY: `ring` was allocated just above with `ring_layout`.
            unsafe { alloc::dealloc(ring.cast(), ring_layout) };
            return Err(io::Error::from(io::ErrorKind::OutOfMemory));
        }
        Ok(BufRing {
            ring,
            ring_layout,
            bufs,
            bufs_layout,
            count,
            buf_len,
            tail: 0,
            registered: false,
        })
    }

    /// Writes buffer `bid` into the next ring entry (not yet published).
    fn add(&mut self, bid: u16) {
        let idx = usize::from(self.tail & (self.count - 1));
        // SAFETY: `idx < count`, so the entry is inside the ring allocation; the kernel only
        // reads entries between its head and the published tail, and this one is past the
        // published tail.
        let entry = unsafe { &mut *self.ring.add(idx) };
        // SAFETY: `bid < count`, so the buffer is inside the buffer allocation.
        let addr = unsafe { self.bufs.add(usize::from(bid) * self.buf_len) };
        entry.set_addr(addr as u64);
        entry.set_len(self.buf_len as u32);
        entry.set_bid(bid);
        self.tail = self.tail.wrapping_add(1);
    }

    /// Makes the entries added so far visible to the kernel.
    fn publish(&self) {
        // SAFETY: `tail` returns a pointer into entry 0 of our live ring allocation, 2-byte
        // aligned; the kernel reads it concurrently, hence the atomic store (Release, so the
        // entry writes are visible before the tail).
        unsafe {
            let tail = types::BufRingEntry::tail(self.ring).cast_mut();
            AtomicU16::from_ptr(tail).store(self.tail, Ordering::Release);
        }
    }
}

impl Drop for BufRing {
    fn drop(&mut self) {
        if self.registered {
            // Still registered: the kernel may write into the buffers. Leak them.
            return;
        }
        // SAFETY: allocated in `new` with these layouts; the kernel no longer holds them
        // (unregistered, every receive completed or cancelled).
        unsafe {
            alloc::dealloc(self.ring.cast(), self.ring_layout);
            alloc::dealloc(self.bufs, self.bufs_layout);
        }
    }
}

/// The ring plus everything it points into.
pub(super) struct Ring {
    // Field order is drop order: the ring (its fd) closes before the memory is freed, and
    // `Drop for Ring` has already cancelled and reaped whatever was in flight.
    ring: IoUring,
    bufs: BufRing,
    recv_hdr: Box<libc::msghdr>,
    recv_armed: bool,
    /// The thread that armed the multishot receive. The kernel posts its completions from
    /// task work queued to that thread, so when another thread waits for them, each
    /// datagram costs a wake-up of the arming thread first.
    recv_owner: Option<std::thread::ThreadId>,
    /// Consecutive polls from another thread than `recv_owner`.
    foreign_polls: u32,
    /// A cancellation of the receive was submitted and its last completion is not reaped.
    recv_cancelling: bool,
    /// Times the receive was cancelled to follow the polling thread.
    recv_moves: u64,
    // Boxed on purpose: the kernel holds pointers into each slot, whose address must not
    // depend on the Vec's buffer.
    #[allow(clippy::vec_box)]
    slots: Vec<Box<SendSlot>>,
    free: Vec<usize>,
    /// Datagram buffers of completed sends, emptied, for reuse (at most `MAX_SPARE`).
    spare: Vec<Vec<u8>>,
    /// Buffers shared by the sends of several chunks, with their reference counts; `None`
    /// entries are free (their indices in `shared_free`).
    shared: Vec<Option<(Vec<u8>, usize)>>,
    shared_free: Vec<usize>,
    /// `io_uring_enter` calls made to submit.
    submits: u64,
    /// SQEs pushed but not yet submitted.
    unsubmitted: usize,
    /// Send slots whose completions are outstanding.
    sends_in_flight: usize,
    /// Whether the kernel has `IORING_OP_SENDMSG_ZC`.
    zc_supported: bool,
}

// SAFETY: the raw pointers in `recv_hdr`, the slots and the buffer ring point into memory
// this `Ring` owns; they are dereferenced only by the kernel, and the `Ring` is only used
// through `&mut` behind the backend's mutex.
unsafe impl Send for Ring {}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("fd", &self.ring.as_raw_fd())
            .field("recv_buffers", &self.bufs.count)
            .field("send_slots", &self.slots.len())
            .field("sends_in_flight", &self.sends_in_flight)
            .field("zc_supported", &self.zc_supported)
            .finish_non_exhaustive()
    }
}

/// Why a ring could not be set up: the caller falls back to plain UDP on any of these.
pub(super) fn setup_error(what: &str, e: io::Error) -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        format!("io_uring unavailable: {what}: {e}"),
    )
}

impl Ring {
    /// A ring with `sq_entries` submission entries, `recv_buffers` receive buffers of
    /// `payload_len` bytes of payload each and `send_slots` send slots (each one `sendmsg` of up
    /// to [`MAX_IOVS`] datagram buffers).
    ///
    /// Errors ([`io::ErrorKind::Unsupported`]): `io_uring_setup` refused (ENOSYS: no
    /// io_uring; EPERM: seccomp or `kernel.io_uring_disabled`), `io_uring_enter` refused
    /// (a seccomp filter that allows the setup), or a kernel older than 6.0
    /// (no `IORING_OP_SEND_ZC`, released with multishot `recvmsg`), or the buffer ring
    /// registration refused (older than 5.19).
    pub(super) fn new(
        sq_entries: u32,
        recv_buffers: u16,
        payload_len: usize,
        send_slots: usize,
    ) -> io::Result<Ring> {
        let cq = sq_entries
            .saturating_mul(2)
            .max(u32::from(recv_buffers) * 2);
        let ring = IoUring::builder()
            .setup_cqsize(cq)
            .setup_coop_taskrun()
            .build(sq_entries)
            .or_else(|_| IoUring::builder().setup_cqsize(cq).build(sq_entries))
            .map_err(|e| setup_error("io_uring_setup", e))?;
        // A sandbox may allow io_uring_setup and _register but refuse io_uring_enter (a
        // seccomp filter): then nothing queued is ever submitted, and a backend that bound
        // fine never received a datagram. One NOP submitted and reaped proves it works.
        let mut ring = ring;
        let nop = opcode::Nop::new().build().user_data(u64::MAX);
        // SAFETY: a NOP references no memory.
        unsafe { ring.submission().push(&nop) }
            .map_err(|_| setup_error("io_uring submission queue", io::ErrorKind::Other.into()))?;
        ring.submit_and_wait(1)
            .map_err(|e| setup_error("io_uring_enter", e))?;
        ring.completion().for_each(drop);
        let mut probe = io_uring::Probe::new();
        ring.submitter()
            .register_probe(&mut probe)
            .map_err(|e| setup_error("IORING_REGISTER_PROBE", e))?;
        if !probe.is_supported(opcode::SendZc::CODE) {
            return Err(setup_error(
                "kernel older than 6.0 (no multishot recvmsg)",
                io::Error::from(io::ErrorKind::Unsupported),
            ));
        }
        let zc_supported = probe.is_supported(opcode::SendMsgZc::CODE);
        let buf_len = RECVMSG_OUT_LEN + NAME_LEN as usize + CONTROL_LEN as usize + payload_len;
        let mut bufs = BufRing::new(recv_buffers, buf_len)?;
        // SAFETY: `bufs.ring` is a page-aligned, zeroed allocation of `count` entries that
        // stays alive (and unmoved: it is a heap pointer) until unregistered in `Drop`.
        unsafe {
            ring.submitter()
                .register_buf_ring_with_flags(bufs.ring as u64, bufs.count, BGID, 0)
                .map_err(|e| setup_error("IORING_REGISTER_PBUF_RING", e))?;
        }
        bufs.registered = true;
        for bid in 0..bufs.count {
            bufs.add(bid);
        }
        bufs.publish();
        // SAFETY: `msghdr` is a C struct of integers and raw pointers: all-zero is valid.
        let mut recv_hdr: Box<libc::msghdr> = Box::new(unsafe { std::mem::zeroed() });
        recv_hdr.msg_namelen = NAME_LEN;
        recv_hdr.msg_controllen = CONTROL_LEN as _;
        let slots = (0..send_slots)
            .map(|_| {
                Box::new(SendSlot {
                    bufs: Vec::with_capacity(MAX_IOVS),
                    shared: None,
                    iovs: Vec::with_capacity(MAX_IOVS),
                    name: socket2::SockAddr::from(std::net::SocketAddr::from(([0, 0, 0, 0], 0))),
                    control: [0; 8],
                    // SAFETY: as for `recv_hdr`.
                    hdr: unsafe { std::mem::zeroed() },
                    awaiting_notif: false,
                    gso: false,
                })
            })
            .collect();
        Ok(Ring {
            ring,
            bufs,
            recv_hdr,
            recv_armed: false,
            recv_owner: None,
            foreign_polls: 0,
            recv_cancelling: false,
            recv_moves: 0,
            slots,
            free: (0..send_slots).rev().collect(),
            spare: Vec::with_capacity(MAX_SPARE),
            shared: Vec::new(),
            shared_free: Vec::new(),
            submits: 0,
            unsubmitted: 0,
            sends_in_flight: 0,
            zc_supported,
        })
    }

    /// A duplicate of the ring's fd registered with tokio's reactor: readable when the
    /// completion queue has entries. Needs a tokio runtime.
    pub(super) fn reactor_fd(&self) -> io::Result<AsyncFd<OwnedFd>> {
        register_readable(self.dup_fd()?)
    }

    /// A duplicate of the ring's fd, not registered anywhere (see [`register_readable`]).
    pub(super) fn dup_fd(&self) -> io::Result<OwnedFd> {
        // SAFETY: the ring's fd is open for as long as `self.ring` lives, which outlasts
        // this borrow; the duplicate is an independent owned fd.
        unsafe { BorrowedFd::borrow_raw(self.ring.as_raw_fd()) }.try_clone_to_owned()
    }

    pub(super) fn zc_supported(&self) -> bool {
        self.zc_supported
    }

    pub(super) fn free_slots(&self) -> usize {
        self.free.len()
    }

    pub(super) fn recv_armed(&self) -> bool {
        self.recv_armed
    }

    /// The `msghdr` the multishot receive was armed with (for parsing its buffers).
    pub(super) fn recv_hdr(&self) -> &libc::msghdr {
        &self.recv_hdr
    }

    fn push(&mut self, entry: &squeue::Entry) -> io::Result<()> {
        // SAFETY (for the caller's entry): every entry pushed here points only at memory
        // this `Ring` owns and keeps alive until the entry's completion (module docs).
        if unsafe { self.ring.submission().push(entry) }.is_err() {
            self.submit()?;
            // SAFETY: as above.
            unsafe { self.ring.submission().push(entry) }
                .map_err(|_| io::Error::other("io_uring submission queue full"))?;
        }
        self.unsubmitted += 1;
        Ok(())
    }

    /// Arms the multishot `recvmsg` on `fd` (a UDP socket the caller keeps open as long as
    /// the ring).
    pub(super) fn arm_recv(&mut self, fd: RawFd) -> io::Result<()> {
        let hdr: *const libc::msghdr = &*self.recv_hdr;
        let entry = opcode::RecvMsgMulti::new(types::Fd(fd), hdr, BGID)
            .build()
            .user_data(RECV_UD);
        self.push(&entry)?;
        self.recv_armed = true;
        self.recv_owner = Some(std::thread::current().id());
        self.foreign_polls = 0;
        Ok(())
    }

    /// Called by the thread that waits for receive completions. After
    /// [`RECV_FOLLOW_POLLS`] consecutive calls from a thread other than the one that armed
    /// the multishot receive, cancels it (and submits); its last completion then lets the
    /// caller re-arm it from the polling thread, so that the kernel's task work for each
    /// datagram runs on the thread that is already awake for it instead of waking another
    /// (a tokio driver task can move between worker threads). Datagrams arriving in
    /// between wait in the socket's receive buffer.
    pub(super) fn follow_poller(&mut self) {
        if !self.recv_armed || self.recv_cancelling {
            return;
        }
        if self.recv_owner == Some(std::thread::current().id()) {
            self.foreign_polls = 0;
            return;
        }
        self.foreign_polls += 1;
        if self.foreign_polls < RECV_FOLLOW_POLLS {
            return;
        }
        let cancel = opcode::AsyncCancel::new(RECV_UD)
            .build()
            .user_data(CANCEL_UD);
        if self.push(&cancel).is_ok() {
            self.recv_cancelling = true;
            self.recv_moves += 1;
            let _ = self.submit();
        }
    }

    /// Times [`follow_poller`](Self::follow_poller) cancelled the receive.
    pub(super) fn recv_moves(&self) -> u64 {
        self.recv_moves
    }

    /// An emptied datagram buffer of a completed send, if one is spare (for the caller to
    /// fill and hand back through [`push_send`](Self::push_send)).
    pub(super) fn take_spare(&mut self) -> Option<Vec<u8>> {
        self.spare.pop()
    }

    /// Queues one `sendmsg` (or `sendmsg` zero-copy) to `dest` on `fd` of the datagram
    /// buffers `bufs` (taken: the slot owns them until the send completes, then they become
    /// spare), concatenated, with the control messages `control` (already encoded, at most
    /// 64 bytes); `gso` says `control` holds `UDP_SEGMENT`. Needs a free slot
    /// ([`free_slots`](Self::free_slots)) and at most [`MAX_IOVS`] buffers; on an error the
    /// buffers are dropped (the send is lost).
    pub(super) fn push_send(
        &mut self,
        fd: RawFd,
        dest: std::net::SocketAddr,
        control: &[u8],
        gso: bool,
        bufs: impl Iterator<Item = Vec<u8>>,
        zero_copy: bool,
    ) -> io::Result<()> {
        self.push_send_inner(fd, dest, control, gso, bufs, None, zero_copy)
    }

    #[allow(clippy::too_many_arguments)]
    fn push_send_inner(
        &mut self,
        fd: RawFd,
        dest: std::net::SocketAddr,
        control: &[u8],
        gso: bool,
        bufs: impl Iterator<Item = Vec<u8>>,
        shared: Option<(usize, std::ops::Range<usize>)>,
        zero_copy: bool,
    ) -> io::Result<()> {
        let Some(idx) = self.free.pop() else {
            if let Some((id, _)) = shared {
                self.unshare(id);
            }
            return Err(io::Error::from(io::ErrorKind::WouldBlock));
        };
        let zero_copy = zero_copy && self.zc_supported;
        let slot = &mut *self.slots[idx];
        debug_assert!(slot.bufs.is_empty() && slot.shared.is_none());
        slot.bufs.clear();
        slot.iovs.clear();
        for b in bufs.take(MAX_IOVS) {
            slot.bufs.push(b);
        }
        for b in &mut slot.bufs {
            // Within the capacity reserved at creation: `iovs` never reallocates.
            slot.iovs.push(libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            });
        }
        if let Some((id, range)) = shared {
            // Checked by the caller: `id` is live and `range` inside its buffer, whose heap
            // memory does not move while the table entry holds it (the `Vec` header may
            // move when `self.shared` grows; its buffer does not).
            if let Some((b, _)) = self.shared.get_mut(id).and_then(Option::as_mut) {
                // SAFETY: `range.start <= b.len()` (checked by `push_send_shared`), so the
                // pointer stays within (or one past the end of) the allocation.
                let base = unsafe { b.as_mut_ptr().add(range.start) };
                slot.iovs.push(libc::iovec {
                    iov_base: base.cast(),
                    iov_len: range.end - range.start,
                });
            }
            slot.shared = Some((id, range));
        }
        slot.name = socket2::SockAddr::from(dest);
        let mut ctl = [0u8; 64];
        let clen = control.len().min(64);
        ctl[..clen].copy_from_slice(&control[..clen]);
        for (w, c) in slot.control.iter_mut().zip(ctl.chunks_exact(8)) {
            *w = u64::from_ne_bytes(c.try_into().unwrap_or([0; 8]));
        }
        slot.hdr.msg_name = slot.name.as_ptr() as *mut libc::c_void;
        slot.hdr.msg_namelen = slot.name.len();
        slot.hdr.msg_iov = slot.iovs.as_mut_ptr();
        slot.hdr.msg_iovlen = slot.iovs.len() as _;
        slot.hdr.msg_control = if clen == 0 {
            std::ptr::null_mut()
        } else {
            slot.control.as_mut_ptr().cast()
        };
        slot.hdr.msg_controllen = clen as _;
        slot.awaiting_notif = zero_copy;
        slot.gso = gso;
        let hdr: *const libc::msghdr = &slot.hdr;
        let entry = if zero_copy {
            opcode::SendMsgZc::new(types::Fd(fd), hdr).build()
        } else {
            opcode::SendMsg::new(types::Fd(fd), hdr).build()
        }
        .user_data(idx as u64);
        if let Err(e) = self.push(&entry) {
            self.release(idx);
            return Err(e);
        }
        self.sends_in_flight += 1;
        Ok(())
    }

    /// Frees slot `idx`: its buffers become spare, the slot becomes free.
    fn release(&mut self, idx: usize) {
        release_slot(
            &mut self.slots[idx],
            &mut self.spare,
            &mut self.shared,
            &mut self.shared_free,
        );
        self.free.push(idx);
    }

    /// Takes `buf` to be sent in `refs` chunks ([`push_send_shared`](Self::push_send_shared)
    /// once per chunk): returns its id. Once every chunk's send completed (or failed to be
    /// queued, see [`unshare`](Self::unshare)), the buffer becomes spare.
    pub(super) fn share(&mut self, buf: Vec<u8>, refs: usize) -> usize {
        let entry = Some((buf, refs.max(1)));
        match self.shared_free.pop() {
            Some(id) => {
                self.shared[id] = entry;
                id
            }
            None => {
                self.shared.push(entry);
                self.shared.len() - 1
            }
        }
    }

    /// Drops one reference of shared buffer `id` without sending (a chunk that will never
    /// be queued).
    pub(super) fn unshare(&mut self, id: usize) {
        unref_shared(id, &mut self.shared, &mut self.shared_free, &mut self.spare);
    }

    /// Queues one `sendmsg` of `range` of shared buffer `id` (no copy), as
    /// [`push_send`](Self::push_send) otherwise. Consumes one reference: on an error it is
    /// dropped.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn push_send_shared(
        &mut self,
        fd: RawFd,
        dest: std::net::SocketAddr,
        control: &[u8],
        gso: bool,
        id: usize,
        range: std::ops::Range<usize>,
        zero_copy: bool,
    ) -> io::Result<()> {
        let ok = self
            .shared
            .get(id)
            .and_then(Option::as_ref)
            .is_some_and(|(b, _)| range.start <= range.end && range.end <= b.len());
        if !ok {
            self.unshare(id);
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "shared send range out of bounds",
            ));
        }
        self.push_send_inner(
            fd,
            dest,
            control,
            gso,
            std::iter::empty(),
            Some((id, range)),
            zero_copy,
        )
    }

    /// `io_uring_enter` calls made to submit so far.
    pub(super) fn submits(&self) -> u64 {
        self.submits
    }

    /// Submits the queued SQEs (no waiting).
    pub(super) fn submit(&mut self) -> io::Result<()> {
        if self.unsubmitted == 0 {
            return Ok(());
        }
        self.submits += 1;
        match self.ring.submit() {
            Ok(_) => {
                self.unsubmitted = 0;
                Ok(())
            }
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Takes every completion, frees finished send slots, and reports receives and errors
    /// through `out`.
    pub(super) fn reap(&mut self, out: &mut impl FnMut(Done)) {
        let mut cq = self.ring.completion();
        cq.sync();
        for cqe in &mut cq {
            let ud = cqe.user_data();
            let res = cqe.result();
            let flags = cqe.flags();
            if ud == RECV_UD {
                if !cqueue::more(flags) {
                    self.recv_armed = false;
                    self.recv_cancelling = false;
                }
                match (res, cqueue::buffer_select(flags)) {
                    (n, Some(bid)) if n >= 0 && bid < self.bufs.count => out(Done::Recv {
                        bid,
                        len: (n as usize).min(self.bufs.buf_len),
                    }),
                    (n, _) if n < 0 => out(Done::RecvError(-n)),
                    _ => {}
                }
            } else if ud == CANCEL_UD {
            } else if let Some(slot) = self.slots.get_mut(ud as usize) {
                let idx = ud as usize;
                if cqueue::notif(flags) {
                    slot.awaiting_notif = false;
                } else {
                    if res < 0 {
                        out(Done::SendError {
                            errno: -res,
                            gso: slot.gso,
                            datagrams: slot.bufs.len().max(usize::from(slot.shared.is_some())),
                        });
                    }
                    if !cqueue::more(flags) {
                        // No notification will follow (the kernel copied, or it failed).
                        slot.awaiting_notif = false;
                    }
                }
                if !slot.awaiting_notif {
                    release_slot(
                        slot,
                        &mut self.spare,
                        &mut self.shared,
                        &mut self.shared_free,
                    );
                    self.free.push(idx);
                    self.sends_in_flight -= 1;
                }
            }
        }
    }

    /// The bytes of receive buffer `bid` (as reported by [`Done::Recv`]).
    pub(super) fn recv_buf(&self, bid: u16, len: usize) -> &[u8] {
        let bid = bid.min(self.bufs.count - 1);
        let len = len.min(self.bufs.buf_len);
        // SAFETY: `bid < count` and `len ≤ buf_len`: inside the buffer allocation. The kernel
        // handed this buffer back in a completion and does not own it until `recycle`,
        // which takes `&mut self` and so cannot run while this borrow lives.
        unsafe {
            std::slice::from_raw_parts(
                self.bufs.bufs.add(usize::from(bid) * self.bufs.buf_len),
                len,
            )
        }
    }

    /// Returns receive buffer `bid` to the kernel.
    pub(super) fn recycle(&mut self, bid: u16) {
        if bid < self.bufs.count {
            self.bufs.add(bid);
            self.bufs.publish();
        }
    }
}

/// Registers a ring's fd (a duplicate, [`Ring::dup_fd`]) with tokio's reactor: readable
/// when its completion queue has entries. Needs a tokio runtime.
pub(super) fn register_readable(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: the `OwnedFd` moved into the `AsyncFd` keeps the descriptor open and
    // unchanged for the `AsyncFd`'s whole life (nothing else can close it).
    unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }.map_err(io::Error::from)
}

/// Empties a completed slot: its buffers become spare (up to `MAX_SPARE`, the rest are
/// freed), its reference to a shared buffer is dropped.
fn release_slot(
    slot: &mut SendSlot,
    spare: &mut Vec<Vec<u8>>,
    shared: &mut [Option<(Vec<u8>, usize)>],
    shared_free: &mut Vec<usize>,
) {
    slot.iovs.clear();
    for mut b in slot.bufs.drain(..) {
        if spare.len() < MAX_SPARE {
            b.clear();
            spare.push(b);
        }
    }
    if let Some((id, _)) = slot.shared.take() {
        unref_shared(id, shared, shared_free, spare);
    }
}

/// Drops one reference of shared buffer `id`; the last one makes the buffer spare.
fn unref_shared(
    id: usize,
    shared: &mut [Option<(Vec<u8>, usize)>],
    shared_free: &mut Vec<usize>,
    spare: &mut Vec<Vec<u8>>,
) {
    let Some(entry) = shared.get_mut(id) else {
        return;
    };
    let last = match entry {
        Some((_, refs)) => {
            *refs -= 1;
            *refs == 0
        }
        None => false,
    };
    if last {
        if let Some((mut b, _)) = entry.take() {
            if spare.len() < MAX_SPARE {
                b.clear();
                spare.push(b);
            }
        }
        shared_free.push(id);
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // Cancel everything, then wait (bounded) until no completion is outstanding.
        let cancel = opcode::AsyncCancel2::new(types::CancelBuilder::any())
            .build()
            .user_data(CANCEL_UD);
        if self.push(&cancel).is_ok() {
            let _ = self.submit();
        }
        let mut ignore = |_| {};
        for _ in 0..2000 {
            self.reap(&mut ignore);
            if !self.recv_armed && self.sends_in_flight == 0 {
                break;
            }
            // Entering the kernel runs the task work that posts the completions.
            std::thread::sleep(std::time::Duration::from_micros(500));
        }
        if self.recv_armed || self.sends_in_flight > 0 {
            tracing::warn!(
                sends = self.sends_in_flight,
                recv = self.recv_armed,
                "io_uring operations still in flight at drop: leaking their memory"
            );
            std::mem::forget(std::mem::take(&mut self.slots));
            std::mem::forget(std::mem::take(&mut self.shared));
            // SAFETY: all-zero is a valid `msghdr` (integers and raw pointers).
            let hdr =
                std::mem::replace(&mut self.recv_hdr, Box::new(unsafe { std::mem::zeroed() }));
            std::mem::forget(hdr);
            return;
        }
        if self.ring.submitter().unregister_buf_ring(BGID).is_ok() {
            self.bufs.registered = false;
        }
    }
}
