//! RC queue pairs: state transitions, posting, and the completion task.

use crate::ffi::{self, ibv_qp_attr, ibv_send_wr, ibv_wc};
use crate::mr::{MrInner, PdInner};
use crate::{verbs_err, Access, Error, Mr, Pd, RemoteRegion, Result, WcOpcode, WcStatus};
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::future::Future;
use std::net::Ipv6Addr;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context as TaskCx, Poll, Waker};
use std::time::Duration;
use tokio::io::unix::AsyncFd;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// How the task awaiting a completion ([`RcQp::send`], [`RcQp::recv`], ...) learns of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CqPoll {
    /// Completions are polled by the QP's CQ task, which sleeps on the completion channel
    /// (`ibv_req_notify_cq` + `ibv_get_cq_event`) when idle and hands each completion to
    /// the awaiting task through a channel. No CPU is used while idle. The default.
    #[default]
    Events,
    /// The awaiting task itself polls the CQ (`ibv_poll_cq`, no task hop), yielding to the
    /// runtime after every [`SPIN_BURST`] empty polls in a row, for about `max` per wait (the
    /// clock is read once per [`SPIN_BURST`] polls); after that it falls back to
    /// [`CqPoll::Events`] for the rest of that wait. This is perftest's default
    /// (busy-polled CQ, `-e` for events): it trades a CPU spinning during each wait for
    /// the latency of the event path. An idle QP (nobody awaiting) never spins. A burst
    /// holds the thread, so waiters that depend on each other (the two ends of a
    /// ping-pong) belong on different threads, not on one current-thread runtime.
    BusySpin {
        /// Longest spin of one wait before falling back to events (checked once per
        /// [`SPIN_BURST`] polls, so a wait spins at least that many polls).
        max: Duration,
    },
}

/// Configuration of an [`RcQp`]. Defaults follow `ibv_rc_pingpong` where it has one,
/// except [`QpConfig::retry_cnt`] and [`QpConfig::rnr_retry`] (finite here).
#[derive(Debug, Clone)]
pub struct QpConfig {
    /// Port number (1-based). Default 1.
    pub port: u8,
    /// GID index; `None` picks the first RoCEv2 IPv4 GID (then IPv6) of the port.
    pub gid_index: Option<u8>,
    /// Initial send PSN (24 bits); `None` draws one at random.
    pub psn: Option<u32>,
    /// Path MTU in bytes (256..4096). Default 1024, as `ibv_rc_pingpong`.
    pub path_mtu: u32,
    /// Receive slots kept posted (each `slot_size` bytes), i.e. messages the peer may send
    /// ahead of [`RcQp::recv`]. 0 posts none (the peer's SENDs then meet RNR NAKs).
    /// Default 64.
    pub recv_slots: u32,
    /// Send slots (SENDs in flight, copied into a registered send buffer). Default 64.
    pub send_slots: u32,
    /// Largest SEND message in bytes (= receive slot size). Default 64 KiB.
    pub slot_size: u32,
    /// RDMA WRITE/READ/atomic work requests in flight. Default 128.
    pub max_rdma_wr: u32,
    /// Local ACK timeout exponent (4.096 µs × 2^timeout; IBA 9.7.6.1.3). Default 14.
    pub timeout: u8,
    /// Transport retries after a local ACK timeout (0..7; IBA 9.7.6.1.3 counts 7 as 7
    /// retries, but rdma_rxe treats 7 as "retry forever", as for `rnr_retry`: its
    /// completer never decrements a count of 7). Default 6, so a SEND to a peer whose QP
    /// is gone (destroyed, or in ERR and silent) fails with `RetryExceeded` after
    /// 7 × the local ACK timeout (about 0.5 s with the default `timeout` 14) on every
    /// provider. (`ibv_rc_pingpong` uses 7.)
    pub retry_cnt: u8,
    /// RNR retries (IBA 9.7.5.2.8: 0..6 is that many retries after an RNR NAK, each after
    /// the responder's RNR timer; 7 retries forever). Default 6: a SEND to a peer QP that
    /// posts no receive (its owner stopped reading, or never started) fails with
    /// `RnrRetryExceeded` after 6 waits of the peer's [`QpConfig::min_rnr_timer`], rather
    /// than hanging. `ibv_rc_pingpong` uses 7; choose it only where something else
    /// bounds a dead peer (e.g. a control channel that moves the QP to ERR).
    pub rnr_retry: u8,
    /// Minimal RNR NAK timer code advertised (IBA table 45). Default 12 (0.64 ms).
    pub min_rnr_timer: u8,
    /// Outstanding READ/atomic requests, as initiator and as responder. Default 16.
    pub max_rd_atomic: u8,
    /// GRH flow label (20 bits): rdma_rxe and RoCE NICs derive the RoCEv2 UDP source
    /// port from it when non-zero. Default 0.
    pub flow_label: u32,
    /// GRH traffic class. Default 0.
    pub traffic_class: u8,
    /// GRH hop limit. Default 64.
    pub hop_limit: u8,
    /// How awaiting tasks learn of completions. Default [`CqPoll::Events`].
    pub poll: CqPoll,
    /// SENDs of at most this many bytes are posted with `IBV_SEND_INLINE` (the device
    /// copies the payload at post time rather than reading it by DMA; perftest's `-I`).
    /// Requested as the QP's `max_inline_data` capability; 0 (the default) disables it.
    /// A device that cannot support the size makes [`RcQp::create`] fail.
    pub max_inline_data: u32,
    /// Streams a [`crate::VerbsConnection`] keeps open at once, both sides' together
    /// (opened, announced and not yet accepted, or not finished). `open_stream` beyond it
    /// is an [`Error::InvalidArgument`]; a peer that opens more is misbehaving and the
    /// connection is closed with code [`crate::CLOSE_STREAM_LIMIT`]. Bounds the memory
    /// a peer can make us hold. Not used by a bare [`RcQp`]. Default 1024.
    pub max_streams: u32,
}

impl Default for QpConfig {
    fn default() -> Self {
        QpConfig {
            port: 1,
            gid_index: None,
            psn: None,
            path_mtu: 1024,
            recv_slots: 64,
            send_slots: 64,
            slot_size: 64 * 1024,
            max_rdma_wr: 128,
            timeout: 14,
            retry_cnt: 6,
            rnr_retry: 6,
            min_rnr_timer: 12,
            max_rd_atomic: 16,
            flow_label: 0,
            traffic_class: 0,
            hop_limit: 64,
            poll: CqPoll::Events,
            max_inline_data: 0,
            max_streams: 1024,
        }
    }
}

/// One side's address of an RC QP, as exchanged out of band.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpEndpoint {
    /// LID (0 on RoCE).
    pub lid: u16,
    /// QPN (24 bits).
    pub qpn: u32,
    /// Initial send PSN (24 bits).
    pub psn: u32,
    /// GID.
    pub gid: Ipv6Addr,
}

/// QP state as this crate last set it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// INIT: receives may be posted.
    Init,
    /// RTS after [`RcQp::connect`] (through RTR).
    Rts,
    /// ERR: every outstanding work request is flushed.
    Error,
}

/// A work completion (`ibv_wc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wc {
    /// Status. `ibv_wc_status` codes without a metaroce name are mapped to the nearest one
    /// (LOC_QP_OP/LOC_ACCESS → LocalProtectionError, RESP_TIMEOUT → RetryExceeded, others →
    /// RemoteOperationalError); [`Wc::code`] is always exact.
    pub status: WcStatus,
    /// The exact `ibv_wc_status`.
    pub code: u32,
    /// Opcode (for error completions the opcode of the request, as posted).
    pub opcode: WcOpcode,
    /// Bytes received (receives; for RECV_RDMA_WITH_IMM the WRITE's length).
    pub byte_len: u32,
    /// Immediate data (host order), if any.
    pub imm: Option<u32>,
    /// Provider-specific error detail.
    pub vendor_err: u32,
}

impl Wc {
    /// `Ok(self)` on success, else [`Error::Completion`].
    pub fn ok(self) -> Result<Wc> {
        if self.status == WcStatus::Success {
            Ok(self)
        } else {
            Err(Error::Completion {
                status: self.status,
                code: self.code,
                vendor_err: self.vendor_err,
            })
        }
    }
}

pub(crate) fn map_status(code: u32) -> WcStatus {
    match code {
        0 => WcStatus::Success,
        1 => WcStatus::LocalLengthError,
        2 | 4 | 8 => WcStatus::LocalProtectionError,
        5 => WcStatus::WrFlushError,
        9 | 15 => WcStatus::RemoteInvalidRequest,
        10 => WcStatus::RemoteAccessError,
        12 | 20 => WcStatus::RetryExceeded,
        13 => WcStatus::RnrRetryExceeded,
        _ => WcStatus::RemoteOperationalError,
    }
}

fn map_opcode(op: u32) -> WcOpcode {
    match op {
        0 => WcOpcode::Send,
        1 => WcOpcode::RdmaWrite,
        2 => WcOpcode::RdmaRead,
        3 => WcOpcode::CompSwap,
        4 => WcOpcode::FetchAdd,
        129 => WcOpcode::RdmaWriteWithImm,
        _ => WcOpcode::Recv,
    }
}

/// What [`RcQp::recv_into`] received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvInfo {
    /// Bytes copied into the caller's buffer: the message's length, or the buffer's if
    /// that is shorter. 0 for a WRITE_WITH_IMM.
    pub len: usize,
    /// The message's length in bytes: the SEND's, or the WRITE_WITH_IMM's (whose bytes
    /// landed in the MR).
    pub byte_len: u32,
    /// Immediate data (SEND_WITH_IMM, WRITE_WITH_IMM).
    pub imm: Option<u32>,
    /// True for RECV_RDMA_WITH_IMM (a WRITE_WITH_IMM).
    pub is_write_imm: bool,
}

impl RecvInfo {
    /// Whether the SEND was longer than the buffer, so that `byte_len - len` bytes were
    /// not copied.
    pub fn truncated(&self) -> bool {
        !self.is_write_imm && self.len < self.byte_len as usize
    }
}

/// A received message (or the notice of a WRITE_WITH_IMM).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The SEND's bytes (empty for a WRITE_WITH_IMM, whose bytes landed in the MR).
    pub data: Bytes,
    /// Immediate data (SEND_WITH_IMM, WRITE_WITH_IMM).
    pub imm: Option<u32>,
    /// True for RECV_RDMA_WITH_IMM (a WRITE_WITH_IMM of `write_len` bytes).
    pub is_write_imm: bool,
    /// The WRITE_WITH_IMM's length in bytes (0 for a SEND).
    pub write_len: u32,
}

const RECV_BIT: u64 = 1 << 63;
const IBV_SEND_SIGNALED: u32 = 2;
const IBV_SEND_INLINE: u32 = 8;
const IBV_WR_RDMA_WRITE: u32 = 0;
const IBV_WR_RDMA_WRITE_WITH_IMM: u32 = 1;
const IBV_WR_SEND: u32 = 2;
const IBV_WR_SEND_WITH_IMM: u32 = 3;
const IBV_WR_RDMA_READ: u32 = 4;
const IBV_WR_ATOMIC_CMP_AND_SWP: u32 = 5;
const IBV_WR_ATOMIC_FETCH_AND_ADD: u32 = 6;

/// A send-queue work request posted and not yet completed (an [`OpTable`] entry).
struct Posted {
    opcode: WcOpcode,
    /// Keeps the MR (and its buffer) registered until the completion is polled.
    _hold: Option<Arc<MrInner>>,
    /// The RDMA permit (WRITE/READ/atomics); SENDs are bounded by the send slots.
    _permit: Option<OwnedSemaphorePermit>,
    send_slot: Option<u32>,
    atomic_slot: Option<u32>,
    /// The waker of the [`OpFuture`] awaiting it, once that future has been polled.
    waker: Option<Waker>,
    /// The [`OpFuture`] still exists (when it does not, the entry is freed at completion).
    awaited: bool,
}

enum Entry {
    Free,
    Posted(Posted),
    /// Completed; the [`Wc`] waits for its [`OpFuture`].
    Done(Wc),
}

/// The send queue's bookkeeping, under one lock: an entry per posted work request,
/// indexed by the low 32 bits of its `wr_id` (the high bits hold the entry's generation,
/// so a stale or forged `wr_id` matches nothing), plus the free send and atomic slots.
/// Posting takes the lock once, a completion once, an [`OpFuture`] once per poll: no map,
/// no channel, no allocation per work request (the entry vector only grows while more
/// [`OpFuture`]s of completed requests are held than ever before).
struct OpTable {
    entries: Vec<(u32, Entry)>,
    free: Vec<u32>,
    send_free: Vec<u32>,
    atomic_free: Vec<u32>,
    /// Entries in [`Entry::Posted`] (work requests the device still owns).
    posted: usize,
    /// Set when the CQ task has ended: no completion is dispatched any more, so an
    /// awaiting [`OpFuture`] resolves to [`Error::Closed`] (the entry keeps its MR hold
    /// until the QP is destroyed).
    closed: bool,
}

impl OpTable {
    fn wr_id(idx: u32, gen: u32) -> u64 {
        (u64::from(gen) << 32) | u64::from(idx)
    }

    /// Store `p`; returns its `wr_id`.
    fn insert(&mut self, p: Posted) -> (u32, u32) {
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.entries.push((0, Entry::Free));
                (self.entries.len() - 1) as u32
            }
        };
        let e = &mut self.entries[idx as usize];
        // Bit 31 stays clear: bit 63 of a wr_id marks receives.
        e.0 = e.0.wrapping_add(1) & 0x7FFF_FFFF;
        e.1 = Entry::Posted(p);
        self.posted += 1;
        (idx, e.0)
    }

    /// The posted entry named by `wr_id`, taken out (the entry becomes free or, if its
    /// future still exists, is left for the [`Wc`]).
    fn take_posted(&mut self, wr_id: u64) -> Option<(u32, Posted)> {
        let (idx, gen) = ((wr_id & 0xFFFF_FFFF) as u32, (wr_id >> 32) as u32);
        let e = self.entries.get_mut(idx as usize)?;
        if e.0 != gen || !matches!(e.1, Entry::Posted(_)) {
            return None;
        }
        let Entry::Posted(p) = std::mem::replace(&mut e.1, Entry::Free) else {
            return None;
        };
        self.posted -= 1;
        if let Some(sl) = p.send_slot {
            self.send_free.push(sl);
        }
        if let Some(sl) = p.atomic_slot {
            self.atomic_free.push(sl);
        }
        if !p.awaited {
            self.free.push(idx);
        }
        Some((idx, p))
    }
}

/// Shared state of a QP: owned by its handles and its completion task; destroys the verbs
/// objects (QP first, so the device stops touching memory, then CQ and channel) when the
/// last of them is gone, and only then releases the MRs that outstanding requests held.
pub(crate) struct QpShared {
    qp: ffi::Raw,
    cq: ffi::Raw,
    ch: ffi::Raw,
    fd: RawFd,
    qpn: u32,
    psn: u32,
    gid: Ipv6Addr,
    gid_index: u8,
    cfg: QpConfig,
    state: Mutex<QpState>,
    ops: Mutex<OpTable>,
    posted_recvs: AtomicUsize,
    closing: AtomicBool,
    close_notify: Notify,
    /// Signalled when a send slot is freed while `send_waiters` > 0 ([`RcQp::send`]).
    send_space: Notify,
    send_waiters: AtomicUsize,
    rdma_sem: Arc<Semaphore>,
    send_pool: Arc<MrInner>,
    recv_pool: Option<Arc<MrInner>>,
    atomic_pool: Arc<MrInner>,
    /// Receive completions (with their slot) in CQ order, waiting for [`RcQp::recv`]. At
    /// most `recv_slots` (one per posted receive).
    recvd: Mutex<VecDeque<(Wc, u32)>>,
    /// Signalled on a push to `recvd` while `recv_waiters` > 0, and when the CQ task ends.
    recv_notify: Notify,
    recv_waiters: AtomicUsize,
    unknown_wcs: AtomicU64,
    /// Serializes poll + dispatch between the CQ task and busy-polling waiters, so
    /// completions are dispatched (and receives queued) in CQ order.
    poll_lock: Mutex<[ibv_wc; POLL_BATCH]>,
    /// Busy-polling waiters ([`CqPoll::BusySpin`]) currently spinning: while any is, the
    /// CQ task does not arm the CQ (no completion event, no system calls per completion).
    spinners: AtomicUsize,
    /// Waiters that sleep until a completion is dispatched for them (a receive, an
    /// operation or a free slot), not spinning: under [`CqPoll::BusySpin`] the CQ task is
    /// needed only for them (see [`QpShared::sleep_begin`]).
    sleepers: AtomicUsize,
    /// Wakes the CQ task off its wait during spinning: signalled when the last spinner
    /// ends while somebody sleeps, and when somebody starts to sleep while nobody spins.
    spin_notify: Notify,
    _pd: Arc<PdInner>,
    pd: Arc<PdInner>,
}

impl Drop for QpShared {
    fn drop(&mut self) {
        // SAFETY (the three calls below): QpShared owns the QP, its CQ and channel and
        // drops once; the completion task that polls them holds an Arc of it, so it is
        // gone; on an error the rest is leaked, never destroyed twice.
        if let Err(e) = unsafe { ffi::destroy_qp(self.qp) } {
            tracing::error!(error = %e, "ibv_destroy_qp failed; leaking QP resources");
            // The device may still reference the pools and held MRs: leak them.
            std::mem::forget(std::mem::take(&mut self.ops.lock().entries));
            std::mem::forget(self.send_pool.clone());
            std::mem::forget(self.atomic_pool.clone());
            std::mem::forget(self.recv_pool.clone());
            return;
        }
        if let Err(e) = unsafe { ffi::destroy_cq(self.cq) } {
            tracing::error!(error = %e, "ibv_destroy_cq failed");
            return;
        }
        unsafe { ffi::destroy_comp_channel(self.ch) };
    }
}

/// What the completion task owns. Fields drop in order: the `AsyncFd` is deregistered
/// before the last `Arc<QpShared>` can destroy the channel (also when the runtime drops
/// the task mid-way).
struct TaskState {
    afd: AsyncFd<ffi::ChannelFd>,
    shared: Arc<QpShared>,
}

impl Drop for TaskState {
    /// The task ended (or the runtime dropped it): nothing dispatches completions any
    /// more, so awaiting operations resolve to [`Error::Closed`] and `recv` ends.
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::Release);
        self.shared.close_ops();
    }
}

/// Which pool slot a work request takes ([`RcQp::post`]).
#[derive(Clone, Copy)]
enum Slot {
    None,
    Send,
    Atomic,
}

impl QpShared {
    /// Copy `data` into send slot `slot` (taken from the op table's free list by the
    /// caller) and return the SGE naming it (`None` for an empty message).
    fn fill_send_slot(&self, slot: u32, data: &[u8]) -> Result<Option<ffi::ibv_sge>> {
        let off = slot as usize * self.cfg.slot_size as usize;
        self.send_pool.buf().write(off, data);
        (!data.is_empty())
            .then(|| self.send_pool.sge(off as u64, data.len() as u64))
            .transpose()
    }

    fn modify(&self, attr: &mut ibv_qp_attr, mask: i32, op: &'static str) -> Result<()> {
        ffi::modify_qp(self.qp, attr, mask).map_err(verbs_err(op))
    }

    fn to_error(&self) -> Result<()> {
        let mut a = ibv_qp_attr {
            qp_state: 6, // IBV_QPS_ERR
            ..Default::default()
        };
        self.modify(&mut a, 1, "ibv_modify_qp(ERR)")?;
        *self.state.lock() = QpState::Error;
        Ok(())
    }

    fn outstanding(&self) -> usize {
        self.ops.lock().posted + self.posted_recvs.load(Ordering::Acquire)
    }

    fn post_recv_slot(&self, slot: u32) -> Result<()> {
        let Some(pool) = &self.recv_pool else {
            return Ok(());
        };
        let size = u64::from(self.cfg.slot_size);
        let mut sge = pool.sge(u64::from(slot) * size, size)?;
        self.posted_recvs.fetch_add(1, Ordering::AcqRel);
        // SAFETY: the slot lies in recv_pool, which QpShared keeps registered until after
        // the QP is destroyed (fields drop after Drop::drop destroyed the QP).
        let r = unsafe { ffi::post_recv(self.qp, RECV_BIT | u64::from(slot), &mut sge) };
        r.map_err(|e| {
            self.posted_recvs.fetch_sub(1, Ordering::AcqRel);
            Error::Verbs {
                op: "ibv_post_recv",
                source: e,
            }
        })
    }

    fn dispatch(&self, w: &ibv_wc) {
        let wc = Wc {
            status: map_status(w.status),
            code: w.status,
            opcode: map_opcode(w.opcode),
            byte_len: w.byte_len,
            imm: (w.wc_flags & 2 != 0).then(|| u32::from_be(w.imm_data)),
            vendor_err: w.vendor_err,
        };
        if w.wr_id & RECV_BIT != 0 {
            self.posted_recvs.fetch_sub(1, Ordering::AcqRel);
            let mut wc = wc;
            if w.status != 0 {
                wc.opcode = WcOpcode::Recv;
            }
            let slot = (w.wr_id & !RECV_BIT) as u32;
            self.recvd.lock().push_back((wc, slot));
            if self.recv_waiters.load(Ordering::SeqCst) > 0 {
                self.recv_notify.notify_waiters();
            }
            return;
        }
        let mut t = self.ops.lock();
        let Some((idx, mut p)) = t.take_posted(w.wr_id) else {
            drop(t);
            self.unknown_wcs.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let mut wc = wc;
        if w.status != 0 {
            wc.opcode = p.opcode;
        }
        if let Some(s) = p.atomic_slot {
            // The old value (host order, as the device wrote it) goes to atomic() as
            // (byte_len << 32) | imm. The slot went back to the free list above, but
            // nobody can take it before this lock is released.
            let mut b = [0u8; 8];
            self.atomic_pool.buf().read(s as usize * 8, &mut b);
            let v = u64::from_ne_bytes(b);
            wc.imm = Some(v as u32);
            wc.byte_len = (v >> 32) as u32;
        }
        if p.awaited {
            t.entries[idx as usize].1 = Entry::Done(wc);
        }
        drop(t);
        if p.send_slot.is_some() && self.send_waiters.load(Ordering::SeqCst) > 0 {
            self.send_space.notify_waiters();
        }
        // Wake (and release the permit and the MR hold) outside the lock.
        if let Some(w) = p.waker.take() {
            w.wake();
        }
    }

    /// Mark the table closed and wake every awaiting [`OpFuture`] (they resolve to
    /// [`Error::Closed`]): called when the CQ task ends, after which nothing dispatches.
    fn close_ops(&self) {
        let wakers: Vec<Waker> = {
            let mut t = self.ops.lock();
            t.closed = true;
            t.entries
                .iter_mut()
                .filter_map(|e| match &mut e.1 {
                    Entry::Posted(p) => p.waker.take(),
                    _ => None,
                })
                .collect()
        };
        for w in wakers {
            w.wake();
        }
        self.send_space.notify_waiters();
        self.recv_notify.notify_waiters();
    }

    /// A waiter starts to sleep (until a dispatch wakes it): make sure somebody polls the
    /// CQ. While a spinner polls, the spinner does (and wakes the CQ task when it ends,
    /// seeing this count); otherwise wake the CQ task now. Pair with [`Self::sleep_end`].
    /// Under [`CqPoll::Events`] nobody spins and the CQ task never waits for spinners, so
    /// this counts nothing.
    fn sleep_begin(&self) {
        if matches!(self.cfg.poll, CqPoll::Events) {
            return;
        }
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        if self.spinners.load(Ordering::SeqCst) == 0 {
            self.spin_notify.notify_one();
        }
    }

    fn sleep_end(&self) {
        if !matches!(self.cfg.poll, CqPoll::Events) {
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn poll_all(&self) -> Result<usize> {
        // The buffer lives under the lock: a spinning waiter polls many times per
        // completion, and zeroing 32 entries per poll is not free under emulation.
        let mut wcs = self.poll_lock.lock();
        let mut total = 0;
        loop {
            let n = ffi::poll_cq(self.cq, &mut wcs[..]).map_err(verbs_err("ibv_poll_cq"))?;
            for w in &wcs[..n] {
                self.dispatch(w);
            }
            total += n;
            if n < wcs.len() {
                return Ok(total);
            }
        }
    }
}

async fn cq_task(st: TaskState) {
    let shared = &st.shared;
    let afd = &st.afd;
    let mut close_deadline = None;
    loop {
        // After activity, poll a little longer (yielding to the tasks the completions
        // woke) before arming the CQ: a busy QP then completes without an event and a
        // system call per completion. Bounded: SPIN_ROUNDS empty polls in a row end it, so
        // an idle QP sleeps on the channel fd.
        let mut empty = 0;
        let mut failed = false;
        while empty < SPIN_ROUNDS {
            if shared.spinners.load(Ordering::Acquire) > 0 {
                // A busy-polling waiter appeared: it drains the CQ itself; competing with
                // it for the CQ (and, on a current-thread runtime, for the thread) only
                // delays it.
                break;
            }
            match shared.poll_all() {
                Ok(0) => empty += 1,
                Ok(_) => empty = 0,
                Err(e) => {
                    tracing::error!(error = %e, "CQ polling failed");
                    failed = true;
                    break;
                }
            }
            if shared.closing.load(Ordering::Acquire) {
                break;
            }
            tokio::task::yield_now().await;
        }
        if failed {
            break;
        }
        if shared.closing.load(Ordering::Acquire) {
            if shared.outstanding() == 0 {
                break;
            }
            let d = *close_deadline
                .get_or_insert_with(|| tokio::time::Instant::now() + Duration::from_secs(2));
            if tokio::time::Instant::now() >= d {
                tracing::warn!(
                    outstanding = shared.outstanding(),
                    "QP closed with work requests not flushed after 2 s; destroying it"
                );
                break;
            }
        }
        if shared.spinners.load(Ordering::Acquire) > 0 && !shared.closing.load(Ordering::Acquire) {
            // Busy-polling waiters drain the CQ themselves: stay off the completion
            // channel until the last of them is done. No timer here: arming one per wait
            // reads the clock, and the runtime then reads it at every yield of the
            // spinning waiter (costly where the clocksource is an emulated HPET). Woken
            // only when needed: by the last spinner leaving while somebody sleeps, or by
            // somebody starting to sleep while nobody spins (`sleep_begin`); a completion
            // nobody waits for stays in the CQ until the next waiter polls it. No wake-up
            // is lost: a notify before this wait leaves a permit in `spin_notify`.
            tokio::select! {
                _ = shared.spin_notify.notified() => {}
                _ = shared.close_notify.notified() => {}
            }
            continue;
        }
        if let Err(e) = ffi::req_notify_cq(shared.cq) {
            tracing::error!(error = %e, "ibv_req_notify_cq failed");
            break;
        }
        // Completions that arrived before the CQ was armed raise no event: poll once more.
        match shared.poll_all() {
            Ok(0) => {}
            Ok(_) => continue,
            Err(_) => break,
        }
        tokio::select! {
            r = afd.readable() => {
                let Ok(mut guard) = r else { break };
                loop {
                    match ffi::get_and_ack_cq_event(shared.ch) {
                        Ok(true) => continue,
                        Ok(false) => { guard.clear_ready(); break; }
                        Err(e) => { tracing::error!(error = %e, "ibv_get_cq_event"); break; }
                    }
                }
            }
            _ = shared.close_notify.notified() => {}
            _ = tokio::time::sleep(Duration::from_millis(50)), if shared.closing.load(Ordering::Acquire) => {}
        }
    }
    // recv() returns Closed once drained.
    shared.closing.store(true, Ordering::Release);
    drop(st);
}

/// Empty CQ polls in a row, after completions, before the CQ is armed and the task sleeps.
/// (A time-based spin of 200 µs was tried for send_lat on rxe and changed nothing.)
const SPIN_ROUNDS: u32 = 64;

/// Completions taken per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;

/// Under [`CqPoll::BusySpin`], empty CQ polls a waiter makes in a row before it yields to
/// the runtime (and before it reads the clock for its deadline). A yield is a pass through
/// the scheduler (on a current-thread runtime an `epoll_wait` and a clock read), which in
/// a TCG guest costs several `ibv_poll_cq` of rdma_rxe: send_lat 64 B there measured 50 us
/// with bursts of 8 polls, 33 us with 32 and 32 us with 128 (docs/RESULTS.md). The price:
/// a spinning waiter holds its thread for up to this many polls, so two QPs ping-ponging
/// on ONE current-thread runtime wait for each other's bursts (keep latency-critical peers
/// on separate threads, as separate processes would be).
pub const SPIN_BURST: u32 = 128;

/// A spinning waiter looks for its result after every poll that dispatched completions
/// and, in case another thread dispatched it, once every this many polls.
const RECHECK: u32 = 16;

/// Counts a waiter while it exists (cancel safe: a dropped wait uncounts itself).
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A sleeping waiter while it exists ([`QpShared::sleep_begin`]); cancel safe.
struct Sleeping<'a>(&'a QpShared);

impl<'a> Sleeping<'a> {
    fn new(s: &'a QpShared) -> Self {
        s.sleep_begin();
        Sleeping(s)
    }
}

impl Drop for Sleeping<'_> {
    fn drop(&mut self) {
        self.0.sleep_end();
    }
}

struct Handle(Arc<QpShared>);

impl Drop for Handle {
    fn drop(&mut self) {
        self.0.closing.store(true, Ordering::Release);
        let _ = self.0.to_error();
        self.0.close_notify.notify_one();
    }
}

/// An RC queue pair with its own CQ (shared by send and receive queues) and completion
/// channel, driven by a tokio task. Cheap to clone; the QP is moved to ERR and destroyed
/// when the last clone is dropped (outstanding work requests are flushed first, up to 2 s).
///
/// Every operation waits for its work completion; a future dropped before that leaves the
/// work request running (the memory it uses stays registered until it completes), so all
/// operations are cancel safe in the sense that no memory is released early.
#[derive(Clone)]
pub struct RcQp {
    h: Arc<Handle>,
}

impl std::fmt::Debug for RcQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.h.0;
        f.debug_struct("RcQp")
            .field("qpn", &s.qpn)
            .field("psn", &s.psn)
            .field("gid", &s.gid)
            .field("state", &*s.state.lock())
            .finish()
    }
}

/// The completion of one posted work request. Resolves to the [`Wc`] (any status; use
/// [`Wc::ok`]), or [`Error::Closed`] if the QP's completion task ended first. Dropping it
/// does not cancel the work request (its memory stays held until it completes).
///
/// Under [`CqPoll::BusySpin`] the future polls the CQ itself from its first poll on; a
/// future that is dropped unpolled (a fire-and-forget [`RcQp::post_send`]) costs no spin.
pub struct OpFuture {
    shared: Arc<QpShared>,
    /// Entry index in the op table; `u32::MAX` once the result was taken.
    idx: u32,
    gen: u32,
    spin: SpinPhase,
    /// Counted in `sleepers` (waiting for the dispatch, not spinning).
    sleeping: bool,
}

enum SpinPhase {
    Off,
    NotStarted(Duration),
    On(Spin),
}

impl std::fmt::Debug for OpFuture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpFuture")
            .field("qpn", &self.shared.qpn)
            .field("wr_id", &OpTable::wr_id(self.idx, self.gen))
            .finish()
    }
}

impl OpFuture {
    /// The result if the work request completed (or can no longer complete); otherwise
    /// registers `waker` (if any) and returns `None`.
    fn try_take(
        shared: &QpShared,
        this_idx: &mut u32,
        gen: u32,
        waker: Option<&Waker>,
    ) -> Option<Result<Wc>> {
        let mut t = shared.ops.lock();
        let closed = t.closed;
        let idx = *this_idx as usize;
        let Some(e) = t.entries.get_mut(idx).filter(|e| e.0 == gen) else {
            *this_idx = u32::MAX;
            return Some(Err(Error::Closed));
        };
        match &mut e.1 {
            Entry::Done(wc) => {
                let wc = *wc;
                e.1 = Entry::Free;
                t.free.push(*this_idx);
                *this_idx = u32::MAX;
                Some(Ok(wc))
            }
            Entry::Posted(p) if closed => {
                // Nothing will dispatch it; the entry (and its hold) stays until the QP
                // is destroyed.
                p.awaited = false;
                p.waker = None;
                *this_idx = u32::MAX;
                Some(Err(Error::Closed))
            }
            Entry::Posted(p) => {
                if let Some(w) = waker {
                    match &p.waker {
                        Some(old) if old.will_wake(w) => {}
                        _ => p.waker = Some(w.clone()),
                    }
                }
                None
            }
            Entry::Free => {
                *this_idx = u32::MAX;
                Some(Err(Error::Closed))
            }
        }
    }
}

impl Drop for OpFuture {
    fn drop(&mut self) {
        if std::mem::take(&mut self.sleeping) {
            self.shared.sleep_end();
        }
        if self.idx == u32::MAX {
            return;
        }
        let mut t = self.shared.ops.lock();
        let idx = self.idx as usize;
        let Some(e) = t.entries.get_mut(idx).filter(|e| e.0 == self.gen) else {
            return;
        };
        match &mut e.1 {
            Entry::Done(_) => {
                e.1 = Entry::Free;
                t.free.push(self.idx);
            }
            Entry::Posted(p) => {
                // The completion frees the entry.
                p.awaited = false;
                p.waker = None;
            }
            Entry::Free => {}
        }
    }
}

/// The busy-poll state of one wait under [`CqPoll::BusySpin`].
struct Spin {
    shared: Arc<QpShared>,
    deadline: Option<std::time::Instant>,
    max: Duration,
    /// CQ polls made so far.
    polls: u32,
}

impl Spin {
    fn new(shared: &Arc<QpShared>, max: Duration) -> Spin {
        shared.spinners.fetch_add(1, Ordering::SeqCst);
        Spin {
            shared: shared.clone(),
            deadline: None,
            max,
            polls: 0,
        }
    }
}

impl Drop for Spin {
    fn drop(&mut self) {
        // The CQ task is woken only if somebody sleeps: a completion nobody waits for (a
        // fire-and-forget SEND's) waits in the CQ for the next waiter, who polls it (a
        // spinner) or wakes the CQ task (a sleeper). A busy QP's spinners thus come and go
        // without a task wake-up per wait. SeqCst against `sleep_begin`: one of the two
        // sees the other.
        if self.shared.spinners.fetch_sub(1, Ordering::SeqCst) == 1
            && self.shared.sleepers.load(Ordering::SeqCst) > 0
        {
            self.shared.spin_notify.notify_one();
        }
    }
}

impl Spin {
    /// Poll the CQ once (dispatching whatever completed). Returns how many completions
    /// it dispatched, or `None` once the spin's time is up (or polling failed): the
    /// caller then waits for the CQ task instead.
    fn poll_once(&mut self) -> Option<usize> {
        if self.polls % SPIN_BURST == 0 && self.polls != 0 {
            // The clock is read once per burst, and not before the first: in a guest whose
            // clocksource is the emulated HPET a read costs more than a poll, and most
            // waits of a busy QP end within the first burst. A wait thus spins at least
            // one burst, and `max` counts from the end of the first.
            let now = std::time::Instant::now();
            let d = *self.deadline.get_or_insert(now + self.max);
            if now >= d {
                return None;
            }
        }
        self.polls = self.polls.wrapping_add(1);
        if self.shared.closing.load(Ordering::Acquire) {
            return None;
        }
        self.shared.poll_all().ok()
    }

    /// Whether a waiter should look for its result after a poll that dispatched `n`
    /// completions: when this poll dispatched some, and every [`RECHECK`] polls (another
    /// waiter or the CQ task may have dispatched it), so that the empty polls of a spin
    /// stay a CQ poll and nothing more.
    fn recheck(&self, n: usize) -> bool {
        n > 0 || self.polls % RECHECK == 1
    }
}

impl Future for OpFuture {
    type Output = Result<Wc>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskCx<'_>) -> Poll<Result<Wc>> {
        let this = &mut *self;
        if this.idx == u32::MAX {
            return Poll::Ready(Err(Error::Closed));
        }
        if let SpinPhase::NotStarted(max) = this.spin {
            this.spin = SpinPhase::On(Spin::new(&this.shared, max));
        }
        if let SpinPhase::On(spin) = &mut this.spin {
            let mut live = true;
            for _ in 0..SPIN_BURST {
                let Some(n) = spin.poll_once() else {
                    live = false;
                    break;
                };
                // No `spin_loop()` hint: QEMU's TCG turns PAUSE into an exit from its
                // translated-code loop, costlier than the poll.
                if spin.recheck(n) {
                    if let Some(r) = Self::try_take(&this.shared, &mut this.idx, this.gen, None) {
                        return Poll::Ready(r);
                    }
                }
            }
            if live {
                // Yield: let the runtime run other tasks, then poll again.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            this.spin = SpinPhase::Off;
        }
        match Self::try_take(&this.shared, &mut this.idx, this.gen, Some(cx.waker())) {
            Some(r) => {
                if std::mem::take(&mut this.sleeping) {
                    this.shared.sleep_end();
                }
                Poll::Ready(r)
            }
            None => {
                if !this.sleeping {
                    this.sleeping = true;
                    this.shared.sleep_begin();
                    // A dispatch between the look above and the count is not lost: the
                    // waker is registered, and the dispatcher wakes it.
                }
                Poll::Pending
            }
        }
    }
}

/// The remote address of `remote[roff..roff + len]`. `remote` may come from a peer, so
/// every sum is checked: an [`Error::InvalidArgument`], never an overflow. Shared by
/// [`RcQp`] and [`crate::MpConnection`].
pub(crate) fn remote_range(remote: &RemoteRegion, roff: u64, len: u64) -> Result<u64> {
    let bad = || {
        Error::InvalidArgument(format!(
            "remote range {roff}+{len} outside the {}-byte region at {:#x}",
            remote.len, remote.addr
        ))
    };
    if roff.checked_add(len).is_none_or(|e| e > remote.len) {
        return Err(bad());
    }
    let raddr = remote.addr.checked_add(roff).ok_or_else(bad)?;
    raddr.checked_add(len).ok_or_else(bad)?;
    Ok(raddr)
}

fn mtu_enum(bytes: u32) -> Result<u32> {
    Ok(match bytes {
        256 => 1,
        512 => 2,
        1024 => 3,
        2048 => 4,
        4096 => 5,
        _ => {
            return Err(Error::InvalidArgument(format!(
                "path MTU {bytes} (want 256, 512, 1024, 2048 or 4096)"
            )))
        }
    })
}

fn random_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0),
    );
    (h.finish() as u32) & 0xFF_FFFF
}

impl RcQp {
    /// Create an RC QP on `pd` and move it to INIT, with its receive slots posted.
    /// Must be called within a tokio runtime (the completion task is spawned on it).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad configuration or outside a runtime,
    /// [`Error::NoGid`], [`Error::Verbs`].
    pub fn create(pd: &Pd, cfg: QpConfig) -> Result<RcQp> {
        let rt = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::InvalidArgument("RcQp::create outside a tokio runtime".into()))?;
        mtu_enum(cfg.path_mtu)?;
        if cfg.send_slots == 0 || cfg.slot_size == 0 || cfg.max_rdma_wr == 0 {
            return Err(Error::InvalidArgument(
                "send_slots, slot_size and max_rdma_wr must be > 0".into(),
            ));
        }
        let ctx = pd.context();
        let gid_e = match cfg.gid_index {
            Some(i) => crate::GidEntry {
                index: i,
                gid: ctx.gid(cfg.port, i)?,
                kind: crate::GidType::Unknown,
            },
            None => ctx
                .select_gid(cfg.port, true)
                .or_else(|_| ctx.select_gid(cfg.port, false))?,
        };
        let pool = |n: u32, size: u32| -> Result<Mr> {
            let bytes = (n as usize)
                .checked_mul(size as usize)
                .filter(|&b| b <= 1 << 30)
                .ok_or_else(|| Error::InvalidArgument("slot pools over 1 GiB".into()))?;
            pd.register(vec![0u8; bytes.max(8)], Access::LOCAL_WRITE)
        };
        let send_pool = pool(cfg.send_slots, cfg.slot_size)?;
        let recv_pool = if cfg.recv_slots > 0 {
            Some(pool(cfg.recv_slots, cfg.slot_size)?)
        } else {
            None
        };
        let atomic_pool = pool(cfg.max_rdma_wr, 8)?;
        let (ch, fd) =
            ffi::create_comp_channel(ctx.0.raw).map_err(verbs_err("ibv_create_comp_channel"))?;
        let fail_ch = |e: Error| {
            // SAFETY: the channel was just made, has no CQ, and the error return drops
            // every copy of it.
            unsafe { ffi::destroy_comp_channel(ch) };
            e
        };
        ffi::set_nonblocking(fd)
            .map_err(verbs_err("fcntl(O_NONBLOCK)"))
            .map_err(fail_ch)?;
        // The pools above bound each count (at most 2^30), so these sums fit a u64; the
        // CQ size must also fit the `int` of ibv_create_cq, else the configuration is bad.
        let total =
            u64::from(cfg.send_slots) + u64::from(cfg.max_rdma_wr) + u64::from(cfg.recv_slots) + 16;
        let (Ok(max_send), Ok(cqe)) = (
            u32::try_from(u64::from(cfg.send_slots) + u64::from(cfg.max_rdma_wr)),
            i32::try_from(total),
        ) else {
            // SAFETY: as in fail_ch.
            unsafe { ffi::destroy_comp_channel(ch) };
            return Err(Error::InvalidArgument(format!(
                "send_slots + max_rdma_wr + recv_slots = {total} exceeds a CQ's size"
            )));
        };
        let cq = ffi::create_cq(ctx.0.raw, cqe, ch)
            .map_err(verbs_err("ibv_create_cq"))
            .map_err(fail_ch)?;
        let cap = ffi::ibv_qp_cap {
            max_send_wr: max_send,
            max_recv_wr: cfg.recv_slots.max(1),
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: cfg.max_inline_data,
        };
        let (qp, qpn) = match ffi::create_rc_qp(pd.0.raw, cq, cap) {
            Ok(x) => x,
            Err(e) => {
                // SAFETY: the CQ and channel were just made, no QP uses them, and the
                // error return drops every copy.
                let _ = unsafe { ffi::destroy_cq(cq) };
                unsafe { ffi::destroy_comp_channel(ch) };
                return Err(Error::Verbs {
                    op: "ibv_create_qp",
                    source: e,
                });
            }
        };
        let psn = cfg.psn.unwrap_or_else(random_psn) & 0xFF_FFFF;
        let shared = Arc::new(QpShared {
            qp,
            cq,
            ch,
            fd,
            qpn,
            psn,
            gid: gid_e.gid,
            gid_index: gid_e.index,
            state: Mutex::new(QpState::Init),
            ops: Mutex::new(OpTable {
                entries: Vec::with_capacity((cfg.send_slots + cfg.max_rdma_wr) as usize),
                free: Vec::new(),
                send_free: (0..cfg.send_slots).rev().collect(),
                atomic_free: (0..cfg.max_rdma_wr).rev().collect(),
                posted: 0,
                closed: false,
            }),
            posted_recvs: AtomicUsize::new(0),
            closing: AtomicBool::new(false),
            close_notify: Notify::new(),
            send_space: Notify::new(),
            send_waiters: AtomicUsize::new(0),
            rdma_sem: Arc::new(Semaphore::new(cfg.max_rdma_wr as usize)),
            send_pool: send_pool.0,
            recv_pool: recv_pool.map(|m| m.0),
            atomic_pool: atomic_pool.0,
            recvd: Mutex::new(VecDeque::with_capacity(cfg.recv_slots as usize)),
            recv_notify: Notify::new(),
            recv_waiters: AtomicUsize::new(0),
            unknown_wcs: AtomicU64::new(0),
            poll_lock: Mutex::new([ibv_wc::default(); POLL_BATCH]),
            spinners: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            spin_notify: Notify::new(),
            _pd: pd.0.clone(),
            pd: pd.0.clone(),
            cfg,
        });
        // RESET -> INIT.
        let mut a = ibv_qp_attr {
            qp_state: 1, // IBV_QPS_INIT
            pkey_index: 0,
            port_num: shared.cfg.port,
            qp_access_flags: (Access::LOCAL_WRITE
                | Access::REMOTE_WRITE
                | Access::REMOTE_READ
                | Access::REMOTE_ATOMIC)
                .0 as i32,
            ..Default::default()
        };
        // IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS
        shared.modify(&mut a, 1 | 16 | 32 | 8, "ibv_modify_qp(INIT)")?;
        for s in 0..shared.cfg.recv_slots {
            shared.post_recv_slot(s)?;
        }
        let afd = {
            let _g = rt.enter();
            // SAFETY: the channel is destroyed by QpShared::drop, which cannot run before
            // TaskState (which owns both the AsyncFd and an Arc<QpShared>) dropped the
            // AsyncFd; on the error path below `shared` is dropped after the error.
            unsafe { ffi::register_channel_fd(shared.fd) }
                .map_err(verbs_err("AsyncFd(completion channel)"))?
        };
        rt.spawn(cq_task(TaskState {
            afd,
            shared: shared.clone(),
        }));
        Ok(RcQp {
            h: Arc::new(Handle(shared)),
        })
    }

    fn s(&self) -> &QpShared {
        &self.h.0
    }

    /// This QP's address for the peer.
    pub fn local(&self) -> QpEndpoint {
        QpEndpoint {
            lid: 0,
            qpn: self.s().qpn,
            psn: self.s().psn,
            gid: self.s().gid,
        }
    }

    /// QPN.
    pub fn qpn(&self) -> u32 {
        self.s().qpn
    }

    /// The GID index used as source GID.
    pub fn gid_index(&self) -> u8 {
        self.s().gid_index
    }

    /// State as this crate last set it.
    pub fn state(&self) -> QpState {
        *self.s().state.lock()
    }

    /// The configuration.
    pub fn config(&self) -> &QpConfig {
        &self.s().cfg
    }

    /// Completions polled whose wr_id matched no request (should stay 0).
    pub fn unknown_completions(&self) -> u64 {
        self.s().unknown_wcs.load(Ordering::Relaxed)
    }

    /// INIT → RTR → RTS towards `remote` (IBA 10.3; attributes as `ibv_rc_pingpong`).
    ///
    /// # Errors
    /// [`Error::Verbs`] if the device refuses a transition (e.g. called twice).
    pub fn connect(&self, remote: &QpEndpoint) -> Result<()> {
        let s = self.s();
        let c = &s.cfg;
        let mut a = ibv_qp_attr {
            qp_state: 2, // IBV_QPS_RTR
            path_mtu: mtu_enum(c.path_mtu)?,
            dest_qp_num: remote.qpn & 0xFF_FFFF,
            rq_psn: remote.psn & 0xFF_FFFF,
            max_dest_rd_atomic: c.max_rd_atomic,
            min_rnr_timer: c.min_rnr_timer,
            ..Default::default()
        };
        a.ah_attr.is_global = 1;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.port_num = c.port;
        a.ah_attr.grh.dgid = remote.gid.octets();
        a.ah_attr.grh.sgid_index = s.gid_index;
        a.ah_attr.grh.hop_limit = c.hop_limit;
        a.ah_attr.grh.flow_label = c.flow_label & 0xF_FFFF;
        a.ah_attr.grh.traffic_class = c.traffic_class;
        // STATE | AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER
        s.modify(
            &mut a,
            1 | 128 | 256 | 1_048_576 | 4096 | 131_072 | 32_768,
            "ibv_modify_qp(RTR)",
        )?;
        let mut a = ibv_qp_attr {
            qp_state: 3, // IBV_QPS_RTS
            timeout: c.timeout,
            retry_cnt: c.retry_cnt,
            rnr_retry: c.rnr_retry,
            sq_psn: s.psn,
            max_rd_atomic: c.max_rd_atomic,
            ..Default::default()
        };
        // STATE | TIMEOUT | RETRY_CNT | RNR_RETRY | SQ_PSN | MAX_QP_RD_ATOMIC
        s.modify(
            &mut a,
            1 | 512 | 1024 | 2048 | 65_536 | 8192,
            "ibv_modify_qp(RTS)",
        )?;
        *s.state.lock() = QpState::Rts;
        Ok(())
    }

    /// Move the QP to ERR: every outstanding and later work request completes with
    /// `WrFlushError` (IBA 10.3.1).
    pub fn set_error(&self) -> Result<()> {
        self.s().to_error()
    }

    /// Post `wr` as a signaled work request with a new op-table entry (holding `permit`,
    /// `hold` and, per `slot`, a send or atomic slot, whose index `sge` gets to name the
    /// local memory). One op-table lock, one `ibv_post_send`, no allocation.
    /// [`Error::SendQueueFull`] if `slot` is [`Slot::Send`] and every send slot is taken.
    fn post(
        &self,
        permit: Option<OwnedSemaphorePermit>,
        mut wr: ibv_send_wr,
        opcode: WcOpcode,
        hold: Option<Arc<MrInner>>,
        slot: Slot,
        sge: impl FnOnce(Option<u32>) -> Result<Option<ffi::ibv_sge>>,
    ) -> Result<OpFuture> {
        let s = self.s();
        let (idx, gen, sl) = {
            let mut t = s.ops.lock();
            let sl = match slot {
                Slot::None => None,
                Slot::Send => match t.send_free.pop() {
                    Some(sl) => Some(sl),
                    None => return Err(Error::SendQueueFull),
                },
                Slot::Atomic => Some(
                    t.atomic_free
                        .pop()
                        .expect("an RDMA permit guarantees an atomic slot"),
                ),
            };
            let (idx, gen) = t.insert(Posted {
                opcode,
                _hold: hold,
                _permit: permit,
                send_slot: sl.filter(|_| matches!(slot, Slot::Send)),
                atomic_slot: sl.filter(|_| matches!(slot, Slot::Atomic)),
                waker: None,
                awaited: true,
            });
            (idx, gen, sl)
        };
        let id = OpTable::wr_id(idx, gen);
        let undo = |e: Error| {
            let p = {
                let mut t = s.ops.lock();
                let p = t.take_posted(id);
                t.free.push(idx);
                p
            };
            drop(p);
            e
        };
        let mut sge = sge(sl).map_err(undo)?;
        wr.wr_id = id;
        wr.send_flags |= IBV_SEND_SIGNALED;
        // SAFETY: the memory named by the SGE belongs to an MR held by the op-table entry
        // just inserted (or to a pool of QpShared), released only when the completion is
        // dispatched or after the QP is destroyed.
        let r = unsafe { ffi::post_send(s.qp, &mut wr, sge.as_mut()) };
        if let Err(e) = r {
            return Err(undo(Error::Verbs {
                op: "ibv_post_send",
                source: e,
            }));
        }
        Ok(OpFuture {
            shared: self.h.0.clone(),
            idx,
            gen,
            spin: match s.cfg.poll {
                CqPoll::Events => SpinPhase::Off,
                CqPoll::BusySpin { max } => SpinPhase::NotStarted(max),
            },
            sleeping: false,
        })
    }

    fn spinner(&self) -> Option<Spin> {
        match self.s().cfg.poll {
            CqPoll::Events => None,
            CqPoll::BusySpin { max } => Some(Spin::new(&self.h.0, max)),
        }
    }

    fn blank_wr(opcode: u32) -> ibv_send_wr {
        ibv_send_wr {
            wr_id: 0,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
            opcode,
            send_flags: 0,
            imm_data: 0,
            wr: Default::default(),
            _tail: [0; 7],
        }
    }

    fn check_open(&self) -> Result<()> {
        if self.s().closing.load(Ordering::Acquire) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    /// Post a SEND of `data` (copied into a send slot) without waiting for a slot.
    ///
    /// # Errors
    /// [`Error::SendQueueFull`] if every send slot is in flight; [`Error::InvalidArgument`]
    /// if `data` exceeds `slot_size`; [`Error::Verbs`] if the post fails (e.g. QP in RESET).
    pub fn post_send(&self, data: &[u8], imm: Option<u32>) -> Result<OpFuture> {
        self.check_open()?;
        let s = self.s();
        if data.len() > s.cfg.slot_size as usize {
            return Err(Error::InvalidArgument(format!(
                "message of {} bytes exceeds slot_size {}",
                data.len(),
                s.cfg.slot_size
            )));
        }
        let mut wr = Self::blank_wr(if imm.is_some() {
            IBV_WR_SEND_WITH_IMM
        } else {
            IBV_WR_SEND
        });
        wr.imm_data = imm.unwrap_or(0).to_be();
        if !data.is_empty() && data.len() <= s.cfg.max_inline_data as usize {
            wr.send_flags = IBV_SEND_INLINE;
        }
        self.post(None, wr, WcOpcode::Send, None, Slot::Send, |sl| {
            s.fill_send_slot(sl.expect("Slot::Send"), data)
        })
    }

    /// SEND `data` (optionally with immediate data) and wait for its completion. Waits for
    /// a free send slot first. Messages arrive in order at the peer's [`RcQp::recv`].
    ///
    /// # Errors
    /// As [`RcQp::post_send`] (never `SendQueueFull`), or [`Error::Completion`].
    pub async fn send(&self, data: &[u8], imm: Option<u32>) -> Result<Wc> {
        let s = self.s();
        let op = match self.post_send(data, imm) {
            Err(Error::SendQueueFull) => loop {
                // Count ourselves as a waiter before the retry: a slot freed after the
                // retry then notifies (see OpTable::take_posted's caller, dispatch).
                let space = s.send_space.notified();
                tokio::pin!(space);
                space.as_mut().enable();
                s.send_waiters.fetch_add(1, Ordering::SeqCst);
                // Uncounts on every exit, also when this future is dropped mid-wait.
                let _waiting = Waiting(&s.send_waiters);
                let _sleeping = Sleeping::new(s);
                let r = self.post_send(data, imm);
                if !matches!(r, Err(Error::SendQueueFull)) {
                    break r?;
                }
                space.await;
            },
            r => r?,
        };
        op.await?.ok()
    }

    /// The next received message, in order. Reposts its receive slot.
    ///
    /// # Errors
    /// [`Error::Completion`] for a receive completed in error (e.g. `WrFlushError` after
    /// the QP entered ERR), [`Error::Closed`] once the QP is gone.
    ///
    /// # Cancel safety
    /// Cancel safe: a message is taken only when this returns.
    pub async fn recv(&self) -> Result<Message> {
        let (wc, slot) = self.next_recv().await?;
        let n = if wc.opcode == WcOpcode::RdmaWriteWithImm {
            0
        } else {
            (wc.byte_len as usize).min(self.s().cfg.slot_size as usize)
        };
        let mut v = vec![0u8; n];
        let info = self.finish_recv(&wc, slot, &mut v)?;
        Ok(Message {
            data: v.into(),
            imm: info.imm,
            is_write_imm: info.is_write_imm,
            write_len: if info.is_write_imm { info.byte_len } else { 0 },
        })
    }

    /// The next received message, in order, copied into `buf` (no allocation: what a
    /// latency-bound loop or a caller with its own buffers wants). Copies
    /// `min(message length, buf.len())` bytes, like `recv` on a UDP socket: a
    /// [`RecvInfo::truncated`] message lost its tail. Reposts its receive slot.
    ///
    /// # Errors
    /// As [`RcQp::recv`].
    ///
    /// # Cancel safety
    /// Cancel safe: a message is taken only when this returns.
    pub async fn recv_into(&self, buf: &mut [u8]) -> Result<RecvInfo> {
        let (wc, slot) = self.next_recv().await?;
        self.finish_recv(&wc, slot, buf)
    }

    /// Copies the message of receive `wc` (in `slot`) into `buf` (as much as fits; nothing
    /// for a WRITE_WITH_IMM, whose bytes are in the MR) and reposts the slot. Shared by
    /// [`RcQp::recv`] and [`RcQp::recv_into`].
    fn finish_recv(&self, wc: &Wc, slot: u32, buf: &mut [u8]) -> Result<RecvInfo> {
        let s = self.s();
        let is_write_imm = wc.opcode == WcOpcode::RdmaWriteWithImm;
        let len = if is_write_imm {
            0
        } else {
            let n = (wc.byte_len as usize)
                .min(s.cfg.slot_size as usize)
                .min(buf.len());
            let pool = s.recv_pool.as_ref().expect("next_recv checked recv_slots");
            pool.buf()
                .read(slot as usize * s.cfg.slot_size as usize, &mut buf[..n]);
            n
        };
        if self.state() != QpState::Error {
            s.post_recv_slot(slot)?;
        }
        Ok(RecvInfo {
            len,
            byte_len: wc.byte_len,
            imm: wc.imm,
            is_write_imm,
        })
    }

    /// Wait for the next receive completion (successful) and its slot; shared by
    /// [`RcQp::recv`] and [`RcQp::recv_into`], which must repost the slot.
    async fn next_recv(&self) -> Result<(Wc, u32)> {
        let s = self.s();
        if s.recv_pool.is_none() {
            return Err(Error::InvalidArgument("QP has recv_slots 0".into()));
        }
        let take = || s.recvd.lock().pop_front();
        let mut spin = self.spinner();
        let (wc, slot) = loop {
            // Something else (the CQ task, another waiter) may have dispatched it.
            if let Some(m) = take() {
                break m;
            }
            if let Some(sp) = &mut spin {
                let mut live = true;
                let mut got = None;
                for _ in 0..SPIN_BURST {
                    let Some(n) = sp.poll_once() else {
                        live = false;
                        break;
                    };
                    if sp.recheck(n) {
                        if let Some(m) = take() {
                            got = Some(m);
                            break;
                        }
                    }
                }
                if let Some(m) = got {
                    break m;
                }
                if live {
                    tokio::task::yield_now().await;
                    continue;
                }
                spin = None;
            }
            // Count ourselves as a waiter before looking again: a push after that look
            // then notifies (see dispatch).
            let pushed = s.recv_notify.notified();
            tokio::pin!(pushed);
            pushed.as_mut().enable();
            s.recv_waiters.fetch_add(1, Ordering::SeqCst);
            let _waiting = Waiting(&s.recv_waiters);
            let _sleeping = Sleeping::new(s);
            if let Some(m) = take() {
                break m;
            }
            // Receives are flushed (queued) before the CQ task ends; wake up on close.
            tokio::select! {
                _ = pushed => {}
                _ = tokio::time::sleep(Duration::from_millis(200)), if s.closing.load(Ordering::Acquire) => {
                    let ended = s.ops.lock().closed;
                    if s.recvd.lock().is_empty() && (ended || s.outstanding() == 0) {
                        return Err(Error::Closed);
                    }
                }
            }
        };
        // A receive completed in error is not reposted (the QP is in ERR, where a new
        // receive would only be flushed again).
        Ok((wc.ok()?, slot))
    }

    /// Latency probe at the verbs floor (a measurement tool, not a stable API): `iters`
    /// SEND ping-pongs of `data` on this QP driven by `ibv_post_send` / `ibv_post_recv` /
    /// `ibv_poll_cq` directly on the calling thread, spinning on the CQ, with no task, no
    /// channel and no copy out of the receive slot; what `ib_send_lat` does per iteration.
    /// The initiator (`initiator = true`) SENDs first and returns each round trip in µs;
    /// the other side echoes every message it receives and returns an empty vector. Every
    /// SEND is signaled; a SEND waits for a free send-queue entry only when `send_slots`
    /// are outstanding. Nothing else may use the QP (or its CQ) meanwhile: the QP's CQ
    /// task must not run (drive it from threads outside its runtime) and no other operation
    /// may be in flight.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `data` exceeds `slot_size` or the QP has no receive
    /// slots, [`Error::Completion`] for a completion in error, [`Error::Verbs`] if a verb
    /// fails, [`Error::Closed`] if the QP is closed, or a wait exceeds 5 s.
    #[doc(hidden)]
    pub fn probe_pingpong(&self, initiator: bool, data: &[u8], iters: u64) -> Result<Vec<f64>> {
        const PROBE_WR: u64 = RECV_BIT - 1;
        let s = self.s();
        if data.len() > s.cfg.slot_size as usize || s.recv_pool.is_none() {
            return Err(Error::InvalidArgument(
                "probe: data exceeds slot_size, or recv_slots is 0".into(),
            ));
        }
        let slot = s.ops.lock().send_free.pop().ok_or(Error::SendQueueFull)?;
        let sge0 = match s.fill_send_slot(slot, data) {
            Ok(g) => g,
            Err(e) => {
                s.ops.lock().send_free.push(slot);
                return Err(e);
            }
        };
        let max_out = s.cfg.send_slots as usize;
        let mut sends_out = 0usize;
        let post = |sends_out: &mut usize| -> Result<()> {
            let mut wr = Self::blank_wr(IBV_WR_SEND);
            wr.wr_id = PROBE_WR;
            wr.send_flags = IBV_SEND_SIGNALED;
            if !data.is_empty() && data.len() <= s.cfg.max_inline_data as usize {
                wr.send_flags |= IBV_SEND_INLINE;
            }
            let mut sge = sge0;
            // SAFETY: the SGE lies in send_pool, registered until after the QP is destroyed.
            unsafe { ffi::post_send(s.qp, &mut wr, sge.as_mut()) }
                .map_err(verbs_err("ibv_post_send"))?;
            *sends_out += 1;
            Ok(())
        };
        // Polls until a receive completes (`want_recv`) or until `sends_out <= target`.
        let wait = |sends_out: &mut usize, want_recv: bool, target: usize| -> Result<()> {
            let mut wcs = [ibv_wc::default(); POLL_BATCH];
            let t0 = std::time::Instant::now();
            let mut spins = 0u32;
            loop {
                let n = {
                    let _g = s.poll_lock.lock();
                    ffi::poll_cq(s.cq, &mut wcs).map_err(verbs_err("ibv_poll_cq"))?
                };
                let mut got = false;
                for w in &wcs[..n] {
                    let wc = Wc {
                        status: map_status(w.status),
                        code: w.status,
                        opcode: map_opcode(w.opcode),
                        byte_len: w.byte_len,
                        imm: None,
                        vendor_err: w.vendor_err,
                    };
                    wc.ok()?;
                    if w.wr_id & RECV_BIT != 0 {
                        s.posted_recvs.fetch_sub(1, Ordering::AcqRel);
                        s.post_recv_slot((w.wr_id & !RECV_BIT) as u32)?;
                        got = true;
                    } else if w.wr_id == PROBE_WR {
                        *sends_out -= 1;
                    } else {
                        s.unknown_wcs.fetch_add(1, Ordering::Relaxed);
                    }
                }
                if (want_recv && got) || (!want_recv && *sends_out <= target) {
                    return Ok(());
                }
                spins = spins.wrapping_add(1);
                if spins % 4096 == 0
                    && (s.closing.load(Ordering::Acquire) || t0.elapsed() > Duration::from_secs(5))
                {
                    return Err(Error::Closed);
                }
            }
        };
        let mut rtts = Vec::with_capacity(if initiator { iters as usize } else { 0 });
        let r = (|| {
            // One clock read per iteration (round trip = time between consecutive stamps).
            let mut t = std::time::Instant::now();
            for _ in 0..iters {
                if initiator {
                    if sends_out >= max_out {
                        wait(&mut sends_out, false, max_out - 1)?;
                    }
                    post(&mut sends_out)?;
                    wait(&mut sends_out, true, 0)?;
                    let now = std::time::Instant::now();
                    rtts.push((now - t).as_secs_f64() * 1e6);
                    t = now;
                } else {
                    wait(&mut sends_out, true, 0)?;
                    if sends_out >= max_out {
                        wait(&mut sends_out, false, max_out - 1)?;
                    }
                    post(&mut sends_out)?;
                }
            }
            if sends_out > 0 {
                wait(&mut sends_out, false, 0)?;
            }
            Ok(())
        })();
        if r.is_ok() {
            s.ops.lock().send_free.push(slot);
        }
        r.map(|()| rtts)
    }

    fn rdma_permit_try(&self) -> Result<OwnedSemaphorePermit> {
        self.check_open()?;
        self.s()
            .rdma_sem
            .clone()
            .try_acquire_owned()
            .map_err(|_| Error::SendQueueFull)
    }

    async fn rdma_permit(&self) -> Result<OwnedSemaphorePermit> {
        match self.rdma_permit_try() {
            Err(Error::SendQueueFull) => {}
            r => return r,
        }
        // Permits come back when completions are dispatched: count as a sleeper.
        let _sleeping = Sleeping::new(self.s());
        self.s()
            .rdma_sem
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Error::Closed)
    }

    /// Validate an RDMA WRITE/READ before it waits for a send-queue slot: the remote
    /// range, the local range (within the MR and at most 2^32 - 1 bytes, one SGE), and that
    /// the MR is of this QP's PD (otherwise the device would fail the work request with a
    /// local protection error and move the QP to ERR, IBA 10.6.3.3).
    fn rdma_check(
        &self,
        local: &Mr,
        loff: u64,
        len: u64,
        remote: &RemoteRegion,
        roff: u64,
    ) -> Result<(u64, ffi::ibv_sge)> {
        if !Arc::ptr_eq(&local.0.pd, &self.s().pd) {
            return Err(Error::InvalidArgument(
                "the MR belongs to another protection domain than the QP".into(),
            ));
        }
        let raddr = remote_range(remote, roff, len)?;
        let sge = local.0.sge(loff, len)?;
        Ok((raddr, sge))
    }

    #[allow(clippy::too_many_arguments)]
    fn post_rdma(
        &self,
        permit: OwnedSemaphorePermit,
        opcode: u32,
        local: &Mr,
        loff: u64,
        len: u64,
        remote: &RemoteRegion,
        roff: u64,
        imm: Option<u32>,
    ) -> Result<OpFuture> {
        let (raddr, sge) = self.rdma_check(local, loff, len, remote, roff)?;
        let mut wr = Self::blank_wr(opcode);
        wr.wr.remote_addr = raddr;
        wr.wr.word1 = u64::from(remote.rkey);
        wr.imm_data = imm.unwrap_or(0).to_be();
        let op = match opcode {
            IBV_WR_RDMA_READ => WcOpcode::RdmaRead,
            IBV_WR_RDMA_WRITE_WITH_IMM => WcOpcode::RdmaWriteWithImm,
            _ => WcOpcode::RdmaWrite,
        };
        let sge = (len > 0).then_some(sge);
        self.post(
            Some(permit),
            wr,
            op,
            Some(local.0.clone()),
            Slot::None,
            |_| Ok(sge),
        )
    }

    /// Post an RDMA WRITE of `local[loff..loff+len]` to `remote` at `roff` (with
    /// immediate data: WRITE_WITH_IMM, which consumes a receive at the peer). `local` stays
    /// registered until the completion, even if dropped meanwhile.
    ///
    /// # Errors
    /// [`Error::SendQueueFull`], [`Error::InvalidArgument`] for ranges, [`Error::Verbs`].
    #[allow(clippy::too_many_arguments)]
    pub fn post_write(
        &self,
        local: &Mr,
        loff: u64,
        len: u64,
        remote: &RemoteRegion,
        roff: u64,
        imm: Option<u32>,
    ) -> Result<OpFuture> {
        self.rdma_check(local, loff, len, remote, roff)?;
        let p = self.rdma_permit_try()?;
        let op = if imm.is_some() {
            IBV_WR_RDMA_WRITE_WITH_IMM
        } else {
            IBV_WR_RDMA_WRITE
        };
        self.post_rdma(p, op, local, loff, len, remote, roff, imm)
    }

    /// RDMA WRITE and wait for its completion (see [`RcQp::post_write`]).
    pub async fn write(
        &self,
        local: &Mr,
        loff: u64,
        len: u64,
        remote: &RemoteRegion,
        roff: u64,
    ) -> Result<Wc> {
        self.rdma_check(local, loff, len, remote, roff)?;
        let p = self.rdma_permit().await?;
        self.post_rdma(p, IBV_WR_RDMA_WRITE, local, loff, len, remote, roff, None)?
            .await?
            .ok()
    }

    /// RDMA WRITE_WITH_IMM and wait for its completion.
    pub async fn write_with_imm(
        &self,
        local: &Mr,
        loff: u64,
        len: u64,
        remote: &RemoteRegion,
        roff: u64,
        imm: u32,
    ) -> Result<Wc> {
        self.rdma_check(local, loff, len, remote, roff)?;
        let p = self.rdma_permit().await?;
        self.post_rdma(
            p,
            IBV_WR_RDMA_WRITE_WITH_IMM,
            local,
            loff,
            len,
            remote,
            roff,
            Some(imm),
        )?
        .await?
        .ok()
    }

    /// Post an RDMA READ of `remote[roff..roff+len]` into `local` at `loff`.
    pub fn post_read(
        &self,
        local: &Mr,
        loff: u64,
        len: u64,
        remote: &RemoteRegion,
        roff: u64,
    ) -> Result<OpFuture> {
        self.rdma_check(local, loff, len, remote, roff)?;
        let p = self.rdma_permit_try()?;
        self.post_rdma(p, IBV_WR_RDMA_READ, local, loff, len, remote, roff, None)
    }

    /// RDMA READ and wait for its completion.
    pub async fn read(
        &self,
        local: &Mr,
        loff: u64,
        len: u64,
        remote: &RemoteRegion,
        roff: u64,
    ) -> Result<Wc> {
        self.rdma_check(local, loff, len, remote, roff)?;
        let p = self.rdma_permit().await?;
        self.post_rdma(p, IBV_WR_RDMA_READ, local, loff, len, remote, roff, None)?
            .await?
            .ok()
    }

    async fn atomic(
        &self,
        opcode: u32,
        remote: &RemoteRegion,
        roff: u64,
        compare_add: u64,
        swap: u64,
    ) -> Result<u64> {
        let raddr = remote_range(remote, roff, 8)?;
        if raddr % 8 != 0 {
            return Err(Error::InvalidArgument(format!(
                "atomic target {raddr:#x} is not 8-byte aligned"
            )));
        }
        let p = self.rdma_permit().await?;
        let s = self.s();
        let mut wr = Self::blank_wr(opcode);
        wr.wr.remote_addr = raddr;
        wr.wr.word1 = compare_add;
        wr.wr.swap = swap;
        wr.wr.atomic_rkey = remote.rkey;
        let op = if opcode == IBV_WR_ATOMIC_CMP_AND_SWP {
            WcOpcode::CompSwap
        } else {
            WcOpcode::FetchAdd
        };
        let wc = self
            .post(Some(p), wr, op, None, Slot::Atomic, |sl| {
                let slot = sl.expect("Slot::Atomic");
                s.atomic_pool.sge(u64::from(slot) * 8, 8).map(Some)
            })?
            .await?
            .ok()?;
        // dispatch() hands the old value over as (byte_len << 32) | imm.
        Ok((u64::from(wc.byte_len) << 32) | u64::from(wc.imm.unwrap_or(0)))
    }

    /// ATOMIC CMP_SWP on the 8-byte word at `remote + roff` (8-byte aligned): if it equals
    /// `compare` it becomes `swap`. Returns the word's previous value.
    pub async fn compare_swap(
        &self,
        remote: &RemoteRegion,
        roff: u64,
        compare: u64,
        swap: u64,
    ) -> Result<u64> {
        self.atomic(IBV_WR_ATOMIC_CMP_AND_SWP, remote, roff, compare, swap)
            .await
    }

    /// ATOMIC FETCH_ADD of `add` to the 8-byte word at `remote + roff` (8-byte aligned).
    /// Returns the word's previous value.
    pub async fn fetch_add(&self, remote: &RemoteRegion, roff: u64, add: u64) -> Result<u64> {
        self.atomic(IBV_WR_ATOMIC_FETCH_AND_ADD, remote, roff, add, 0)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_and_local_ranges_are_checked_without_overflow() {
        let r = RemoteRegion {
            addr: 0x1000,
            len: 100,
            rkey: 7,
        };
        assert_eq!(remote_range(&r, 0, 100).unwrap(), 0x1000);
        assert_eq!(remote_range(&r, 60, 40).unwrap(), 0x1000 + 60);
        assert!(remote_range(&r, 60, 41).is_err());
        assert!(remote_range(&r, u64::MAX, 2).is_err());
        // A peer's region that wraps the address space.
        let wrap = RemoteRegion {
            addr: u64::MAX - 10,
            len: 100,
            rkey: 7,
        };
        assert!(remote_range(&wrap, 5, 20).is_err());
        assert!(remote_range(&wrap, 20, 0).is_err());
        assert!(crate::mr::local_range(100, 99, 1).is_ok());
        assert!(crate::mr::local_range(100, 99, 2).is_err());
        assert!(crate::mr::local_range(100, u64::MAX, 2).is_err());
    }

    #[test]
    fn op_table_matches_generation_and_frees_unawaited_entries() {
        let mut t = OpTable {
            entries: Vec::new(),
            free: Vec::new(),
            send_free: vec![0],
            atomic_free: Vec::new(),
            posted: 0,
            closed: false,
        };
        let sem = Arc::new(Semaphore::new(1));
        let posted = |awaited| Posted {
            opcode: WcOpcode::Send,
            _hold: None,
            _permit: sem.clone().try_acquire_owned().ok(),
            send_slot: None,
            atomic_slot: None,
            waker: None,
            awaited,
        };
        let (i, g) = t.insert(posted(false));
        let id = OpTable::wr_id(i, g);
        // A stale or forged wr_id (other generation, other index, receive bit) matches nothing.
        assert!(t.take_posted(id ^ (1 << 32)).is_none());
        assert!(t.take_posted(id + 1).is_none());
        assert!(t.take_posted(id | RECV_BIT).is_none());
        assert_eq!(t.posted, 1);
        assert!(t.take_posted(id).is_some());
        assert_eq!(
            (t.posted, t.free.len()),
            (0, 1),
            "unawaited: freed at completion"
        );
        // Replayed completion of the same wr_id: nothing.
        assert!(t.take_posted(id).is_none());
        // The entry is reused with a new generation; the old wr_id stays dead.
        let (i2, g2) = t.insert(posted(true));
        assert_eq!(i2, i);
        assert_ne!(g2, g);
        assert!(t.take_posted(id).is_none());
        assert!(t.take_posted(OpTable::wr_id(i2, g2)).is_some());
        assert!(t.free.is_empty(), "awaited: left for its OpFuture");
    }
}
