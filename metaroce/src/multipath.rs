//! Multipath over K standard RC queue pairs: a sans-IO chunk scheduler for backends that
//! drive commodity RDMA NICs (`metaroce-verbs`).
//!
//! A MetaRoCE connection sprays packets over many paths itself. A commodity RoCE NIC cannot
//! be told to do that for one RC QP — every packet of an RC QP leaves with the same UDP
//! source port, so ECMP pins the whole QP to one path. What a backend *can* do is open K RC
//! QPs to the same peer, give each a different RoCEv2 UDP source port, and spread the work
//! over them. This module is that spreading, kept free of devices so it can be tested on a
//! host without one:
//!
//! * **Chunks.** A large WRITE or READ is split into chunks of
//!   [`MultipathConfig::chunk_size`] bytes (the last may be shorter); each chunk is one work
//!   request on one QP. The operation completes when all its chunks have; its status is the
//!   first error a chunk met ([`WcStatus`]), or `Success`.
//! * **Weighting.** Each chunk goes to the QP with the smallest expected finish time,
//!   `(outstanding bytes + chunk bytes) / completion rate`, where the completion rate is an
//!   EWMA of bytes per second measured on that QP's own completions (the time a chunk took
//!   from the later of its post and the QP's previous completion). A QP that completes faster
//!   is handed proportionally more bytes; a QP with no sample yet is assumed to be as fast as
//!   the mean of the others. Each QP also has a hard budget of
//!   [`MultipathConfig::qp_depth`] outstanding chunks (its send queue).
//! * **Notifications keep their order: sequence numbers and a reorder buffer.** SENDs (stream
//!   messages) and the immediate of a WRITE_WITH_IMM are *notifications*: they must reach the
//!   receiver exactly once and, within a channel (a message stream), in posting order. Each
//!   gets a per-channel sequence number at [`Scheduler::submit`]; the receiver passes what
//!   arrives through a [`Reorderer`], which delivers in sequence order and drops duplicates.
//!   Pinning a stream to one QP was rejected: when that QP fails, its last SENDs may or may
//!   not have been delivered (the acknowledgement may be what was lost), so re-issuing them
//!   elsewhere either loses or duplicates messages and breaks the order with the SENDs that
//!   follow on the new QP. Sequence numbers make re-issue safe, and let one stream use every
//!   QP. The sender keeps at most [`MultipathConfig::channel_window`] notifications of a
//!   channel outstanding. On completions alone that window moves once the responder's
//!   *device* has a frame (an RC completion), not once the receiver's reorderer has it, so a
//!   receive path that lags on one QP (its receive completions and task queue frames)
//!   lets the sender run past the reorderer's window, and a frame is refused after its SEND
//!   completed Success. [`MultipathConfig::receiver_credits`] closes that: the reorderer
//!   reports each channel's next expected number every quarter window
//!   ([`Reorderer::with_credits`], [`Reorderer::poll_credit`]), the sender's window moves
//!   on the lower of its completions and those credits ([`Scheduler::on_credit`]), and the
//!   reorderer's window is exactly `channel_window`, whatever the receive path holds.
//!   metaroce-verbs sends the credits on its TCP control connection.
//! * **Placement before notification.** QPs do not order against each other, so the
//!   immediate of a WRITE_WITH_IMM is posted only after every data chunk of the WRITE has
//!   completed successfully (an RC WRITE completes at the requester once the responder has
//!   placed it). [`OpRequest::fence`] holds an operation (and everything after it) until
//!   every earlier operation has completed — the cross-QP counterpart of `IBV_SEND_FENCE`.
//! * **A failed QP costs no operation.** A completion with `IBV_WC_RETRY_EXC_ERR` or
//!   `IBV_WC_WR_FLUSH_ERR`, or [`Scheduler::fail_qp`] (an asynchronous `IBV_EVENT_QP_FATAL`),
//!   marks the QP down: its outstanding chunks go back to the front of the queue and are
//!   re-issued on the other QPs, and [`Event::ReplaceQp`] asks the backend to build a new
//!   QP in its slot (new QP, new exchange over the connection's control channel) and to
//!   [`Scheduler::add_qp`] it. WRITE and READ chunks are idempotent — writing the same bytes
//!   to the same place again, or reading them again, has the same result — and
//!   notifications are deduplicated by sequence number, so re-issue is safe. A chunk is
//!   re-issued at most [`MultipathConfig::max_attempts`] times.
//! * **No late placement after completion.** A chunk that was outstanding on a failed QP
//!   may still have packets in the network, which a responder QP that is still alive would
//!   place — possibly after the operation completed and the application reused the memory.
//!   So an operation that had a chunk on a failed QP does not complete until the backend
//!   reports, with [`Scheduler::peer_torn_down`], that the peer has moved its end of that QP
//!   to the error state (or destroyed it); from then on nothing from the old QP is placed.
//! * **Errors of the operation itself** (`IBV_WC_REM_ACCESS_ERR`, `IBV_WC_REM_INV_REQ_ERR`,
//!   `IBV_WC_LOC_PROT_ERR`, ...) are not path failures: re-issuing would meet them again. The
//!   operation completes with that status once its outstanding chunks have completed, and
//!   its chunks not yet posted are dropped. As in IBA such an error also moves the RC QP to
//!   the error state, so that QP is replaced too and *other* operations' chunks on it are
//!   re-issued. A notification that fails this way leaves a hole its channel can never fill,
//!   so the channel enters the error state: later notifications on it complete with
//!   `WrFlushError` without being posted (as later SENDs on an RC QP in error do).
//!
//! The driving contract follows the rest of the core: inputs [`Scheduler::submit`],
//! [`Scheduler::on_completion`], [`Scheduler::fail_qp`], [`Scheduler::add_qp`],
//! [`Scheduler::peer_torn_down`], [`Scheduler::fail_all`]; outputs [`Scheduler::poll_post`]
//! (a work request to post) and [`Scheduler::poll_event`]. Time comes in as [`Instant`]
//! arguments; nothing here panics on any sequence of calls, and every table is bounded by
//! a config value.

use crate::WcStatus;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

/// Most QPs one multipath connection may use.
pub const MAX_QPS: usize = 64;

/// Limits and tuning of a [`Scheduler`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MultipathConfig {
    /// K, the number of RC QPs of one connection (1..=[`MAX_QPS`]; default 4).
    pub qps: usize,
    /// Bytes per WRITE/READ chunk (at least 1; default 64 KiB). Operations up to this size
    /// are not split.
    pub chunk_size: u32,
    /// Chunks outstanding on one QP at most (its send-queue budget; at least 1; default 16).
    pub qp_depth: u32,
    /// Times one chunk is re-issued after path failures before its operation completes with
    /// the failure's status (default 8).
    pub max_attempts: u32,
    /// Operations held by the scheduler at most (submitted, not yet completed; default 4096).
    pub max_ops: usize,
    /// Notifications of one channel outstanding at most; the receiver's [`Reorderer`] must
    /// use the same window (at least 1; default 64).
    pub channel_window: u32,
    /// Channels (message streams plus the WRITE_WITH_IMM channel) at most (default 1024).
    pub max_channels: usize,
    /// Move a channel's window on the receiver's *credits* as well as on completions
    /// (default false). With it, a notification of sequence number `s` is posted only while
    /// `s < min(released, credit) + channel_window`, where `credit` is the highest next
    /// expected sequence number the receiver's [`Reorderer`] reported
    /// ([`Reorderer::poll_credit`], fed back through [`Scheduler::on_credit`]). An RC
    /// completion says the responder's device has a frame, not that the receiver's
    /// reorderer has it, so only credits bound what the receive path holds, whatever it
    /// queues and however slowly one QP's receive path drains. Both ends must agree: a
    /// sender with credits whose receiver sends none stalls after `channel_window`
    /// notifications per channel.
    pub receiver_credits: bool,
}

impl Default for MultipathConfig {
    fn default() -> Self {
        MultipathConfig {
            qps: 4,
            chunk_size: 64 * 1024,
            qp_depth: 16,
            max_attempts: 8,
            max_ops: 4096,
            channel_window: 64,
            max_channels: 1024,
            receiver_credits: false,
        }
    }
}

impl MultipathConfig {
    /// Checks the limits; says which one is out of range.
    pub fn validate(&self) -> Result<(), MultipathError> {
        if self.qps == 0 || self.qps > MAX_QPS {
            return Err(MultipathError::Config("qps must be 1..=64"));
        }
        if self.chunk_size == 0 {
            return Err(MultipathError::Config("chunk_size must be at least 1"));
        }
        if self.qp_depth == 0 {
            return Err(MultipathError::Config("qp_depth must be at least 1"));
        }
        if self.max_ops == 0 {
            return Err(MultipathError::Config("max_ops must be at least 1"));
        }
        if self.channel_window == 0 {
            return Err(MultipathError::Config("channel_window must be at least 1"));
        }
        if self.max_channels == 0 {
            return Err(MultipathError::Config("max_channels must be at least 1"));
        }
        Ok(())
    }
}

/// What the scheduler refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MultipathError {
    /// A [`MultipathConfig`] field is out of range.
    Config(&'static str),
    /// [`MultipathConfig::max_ops`] operations are already outstanding; retry after one
    /// completes.
    TooManyOps,
    /// A SEND longer than `u32::MAX` bytes.
    TooLong,
    /// A new channel beyond [`MultipathConfig::max_channels`].
    TooManyChannels,
    /// Every slot already holds a QP that is up.
    NoFreeSlot,
    /// [`Scheduler::fail_all`] was called: the connection is gone.
    Closed,
}

impl fmt::Display for MultipathError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MultipathError::Config(what) => write!(f, "invalid multipath config: {what}"),
            MultipathError::TooManyOps => f.write_str("too many outstanding operations"),
            MultipathError::TooLong => f.write_str("SEND longer than 4 GiB - 1"),
            MultipathError::TooManyChannels => f.write_str("too many channels"),
            MultipathError::NoFreeSlot => f.write_str("every QP slot is in use"),
            MultipathError::Closed => f.write_str("the multipath connection is closed"),
        }
    }
}

impl std::error::Error for MultipathError {}

/// One of the connection's RC QPs: its slot (0..K, fixed for the connection) and the
/// generation of the QP in that slot (bumped each time the slot's QP is replaced, so a late
/// completion of a replaced QP is recognised and ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QpId {
    /// Slot index, 0..K. Backends derive the QP's GRH flow label (hence its UDP source
    /// port) from it.
    pub slot: u16,
    /// Generation of the QP in the slot, from 1.
    pub generation: u32,
}

/// Identifies an operation from [`Scheduler::submit`] to its [`Event::Completed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u64);

/// What an operation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// RDMA WRITE of `len` bytes; split into chunks.
    Write,
    /// RDMA READ of `len` bytes; split into chunks.
    Read,
    /// RDMA WRITE of `len` bytes, then the immediate `imm` as a notification on `channel`
    /// once every byte is placed.
    WriteWithImm {
        /// Channel the immediate is ordered in.
        channel: u32,
        /// The 32-bit immediate.
        imm: u32,
    },
    /// A SEND of `len` bytes on message stream `channel`; never split.
    Send {
        /// The message stream.
        channel: u32,
    },
}

/// An operation to schedule. Addresses stay with the backend: the scheduler hands out byte
/// offsets into the operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpRequest {
    /// What it does.
    pub kind: OpKind,
    /// Bytes (0 allowed: one zero-length work request).
    pub len: u64,
    /// Start only after every earlier operation has completed, and hold every later one
    /// until this one has started.
    pub fence: bool,
}

/// What one work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkKind {
    /// RDMA WRITE of bytes `offset..offset + len` of the operation.
    Write,
    /// RDMA READ of bytes `offset..offset + len` of the operation.
    Read,
    /// A notification: a SEND (`imm: None`, carrying bytes `offset..offset + len`) or the
    /// immediate of a WRITE_WITH_IMM (`imm: Some`, `len` 0), with its channel and sequence
    /// number, which the backend puts on the wire for the receiver's [`Reorderer`].
    Notify {
        /// Channel (message stream).
        channel: u32,
        /// Sequence number in the channel, from 0.
        seq: u64,
        /// The immediate of a WRITE_WITH_IMM.
        imm: Option<u32>,
    },
}

/// A work request the backend must post.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Post {
    /// The QP to post on.
    pub qp: QpId,
    /// The `wr_id` to post with; its completion goes to [`Scheduler::on_completion`].
    pub wr_id: u64,
    /// The operation it belongs to.
    pub op: OpId,
    /// What it does.
    pub kind: ChunkKind,
    /// Byte offset into the operation (local buffer and remote region alike).
    pub offset: u64,
    /// Bytes.
    pub len: u32,
}

/// What the scheduler tells the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The operation completed: every chunk has, and no chunk of it can still be placed.
    /// Reported exactly once per submitted operation.
    Completed {
        /// The operation.
        op: OpId,
        /// `Success`, or the first error one of its chunks met.
        status: WcStatus,
    },
    /// `failed` is down; build a new QP in its slot, exchange it with the peer, and
    /// [`Scheduler::add_qp`] it. Tell the peer to move its end of `failed` to the error
    /// state and report that with [`Scheduler::peer_torn_down`].
    ReplaceQp {
        /// The QP that failed.
        failed: QpId,
        /// Why.
        status: WcStatus,
    },
}

/// Per-QP counters.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct QpStats {
    /// The QP in the slot now, if one was added.
    pub qp: Option<QpId>,
    /// Whether it is up.
    pub up: bool,
    /// Chunks posted on this slot (all generations).
    pub posted_chunks: u64,
    /// Bytes posted on this slot (all generations).
    pub posted_bytes: u64,
    /// Chunks that completed successfully.
    pub completed_chunks: u64,
    /// Completion-rate estimate, bytes per second (0 before the first sample).
    pub rate: f64,
    /// Chunks outstanding now.
    pub outstanding: u32,
    /// Times the slot's QP failed.
    pub failures: u64,
}

/// Scheduler-wide counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SchedulerStats {
    /// Chunks re-issued after a path failure.
    pub reissued_chunks: u64,
    /// Completions ignored: of a QP already declared failed (its chunks were queued for
    /// re-issue when it was), or with a `wr_id` that is not outstanding.
    pub ignored_completions: u64,
    /// Credits ignored ([`Scheduler::on_credit`]): beyond every notification submitted on
    /// their channel, or for an unknown channel.
    pub bad_credits: u64,
}

#[derive(Debug, Clone, Copy)]
struct Chunk {
    op: OpId,
    kind: ChunkKind,
    offset: u64,
    len: u32,
    attempts: u32,
}

#[derive(Debug)]
struct Inflight {
    qp: QpId,
    chunk: Chunk,
    posted_at: Instant,
}

#[derive(Debug)]
struct OpState {
    req: OpRequest,
    /// Next byte of a WRITE/READ not yet cut into a chunk.
    next_offset: u64,
    /// Chunks cut and not finished (outstanding or queued for re-issue).
    open_chunks: u32,
    /// Where its notification (SEND, immediate) is.
    notify: Notify,
    status: Option<WcStatus>,
    /// Failed QPs that carried a chunk of this op and whose peer end is not torn down yet.
    tainted: BTreeSet<QpId>,
    /// Whether any work of it was cut (for fences).
    started: bool,
}

impl OpState {
    fn data_len(&self) -> u64 {
        match self.req.kind {
            OpKind::Send { .. } => 0,
            _ => self.req.len,
        }
    }
}

/// Life of an operation's notification.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum Notify {
    /// A WRITE or READ: no notification.
    None,
    /// Not posted yet.
    Uncut(u64),
    /// Posted, not completed.
    Outstanding(u64),
    /// Completed (or failed), waiting for the earlier notifications of its channel.
    Resolved,
    /// Every earlier notification of the channel is released too: done.
    Released,
}

#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum SlotState {
    Empty,
    Up,
    Down,
}

#[derive(Debug)]
struct Slot {
    state: SlotState,
    generation: u32,
    outstanding: u32,
    outstanding_bytes: u64,
    rate: Option<f64>,
    last_done: Option<Instant>,
    stats: QpStats,
}

/// Sender state of one channel. Notifications are *released* (may complete) in sequence
/// order, as an RC send queue completes in posting order: one that completed before an
/// earlier one failed sits at the receiver behind a hole that is never filled, so it
/// completes with `WrFlushError`, not `Success`.
#[derive(Debug, Default)]
struct ChannelTx {
    next_seq: u64,
    /// Every sequence number below this one is released.
    next_release: u64,
    /// The receiver's next expected sequence number, as last reported
    /// ([`Scheduler::on_credit`]; used with [`MultipathConfig::receiver_credits`]).
    credit: u64,
    /// Resolved, not released: seq → (op, whether its notification succeeded).
    resolved: BTreeMap<u64, (OpId, bool)>,
    /// A notification of the channel failed: the channel is in the error state.
    failed: bool,
}

/// The K-QP chunk scheduler of one connection. See the [module docs](self).
#[derive(Debug)]
pub struct Scheduler {
    config: MultipathConfig,
    slots: Vec<Slot>,
    ops: BTreeMap<OpId, OpState>,
    next_op: u64,
    /// Ops with work not yet cut into chunks, in submission order.
    ready: VecDeque<OpId>,
    /// Cut chunks waiting for a QP: re-issues and WRITE_WITH_IMM immediates.
    pending: VecDeque<Chunk>,
    inflight: HashMap<u64, Inflight>,
    next_wr: u64,
    channels: HashMap<u32, ChannelTx>,
    events: VecDeque<Event>,
    closed: Option<WcStatus>,
    stats: SchedulerStats,
}

/// A chunk is priced at least this many bytes when choosing a QP (zero-length work
/// requests still cost a round trip).
const MIN_CHUNK_COST: u64 = 64;

impl Scheduler {
    /// A scheduler with K empty slots; add the QPs with [`Scheduler::add_qp`].
    ///
    /// # Errors
    /// [`MultipathError::Config`] if `config` does not [validate](MultipathConfig::validate).
    pub fn new(config: MultipathConfig) -> Result<Scheduler, MultipathError> {
        config.validate()?;
        let slots = (0..config.qps)
            .map(|_| Slot {
                state: SlotState::Empty,
                generation: 0,
                outstanding: 0,
                outstanding_bytes: 0,
                rate: None,
                last_done: None,
                stats: QpStats::default(),
            })
            .collect();
        Ok(Scheduler {
            config,
            slots,
            ops: BTreeMap::new(),
            next_op: 0,
            ready: VecDeque::new(),
            pending: VecDeque::new(),
            inflight: HashMap::new(),
            next_wr: 1,
            channels: HashMap::new(),
            events: VecDeque::new(),
            closed: None,
            stats: SchedulerStats::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &MultipathConfig {
        &self.config
    }

    /// Puts a new QP (ready to send: RTS) in the lowest slot that has none or whose QP is
    /// down, and returns its id. The slot's rate estimate starts afresh.
    ///
    /// # Errors
    /// [`MultipathError::NoFreeSlot`] if all K slots hold a QP that is up;
    /// [`MultipathError::Closed`] after [`Scheduler::fail_all`].
    pub fn add_qp(&mut self) -> Result<QpId, MultipathError> {
        let i = self
            .slots
            .iter()
            .position(|s| s.state != SlotState::Up)
            .ok_or(MultipathError::NoFreeSlot)?;
        self.add_qp_at(i as u16)
    }

    /// Puts a new QP in slot `slot` (which must have none, or one that is down) and returns
    /// its id (the slot's next generation).
    ///
    /// # Errors
    /// [`MultipathError::NoFreeSlot`] if `slot` is out of range or its QP is up;
    /// [`MultipathError::Closed`] after [`Scheduler::fail_all`].
    pub fn add_qp_at(&mut self, slot: u16) -> Result<QpId, MultipathError> {
        if self.closed.is_some() {
            return Err(MultipathError::Closed);
        }
        let i = usize::from(slot);
        let slot = match self.slots.get_mut(i) {
            Some(s) if s.state != SlotState::Up => s,
            _ => return Err(MultipathError::NoFreeSlot),
        };
        slot.state = SlotState::Up;
        slot.generation += 1;
        slot.outstanding = 0;
        slot.outstanding_bytes = 0;
        slot.rate = None;
        slot.last_done = None;
        let id = QpId {
            slot: i as u16,
            generation: slot.generation,
        };
        slot.stats.qp = Some(id);
        slot.stats.up = true;
        Ok(id)
    }

    /// Queues an operation.
    ///
    /// # Errors
    /// [`MultipathError::TooManyOps`], [`MultipathError::TooLong`] (a SEND over
    /// `u32::MAX` bytes), [`MultipathError::TooManyChannels`], [`MultipathError::Closed`].
    pub fn submit(&mut self, req: OpRequest) -> Result<OpId, MultipathError> {
        if self.closed.is_some() {
            return Err(MultipathError::Closed);
        }
        if self.ops.len() >= self.config.max_ops {
            return Err(MultipathError::TooManyOps);
        }
        let channel = match req.kind {
            OpKind::Send { channel } => {
                if req.len > u64::from(u32::MAX) {
                    return Err(MultipathError::TooLong);
                }
                Some(channel)
            }
            OpKind::WriteWithImm { channel, .. } => Some(channel),
            OpKind::Write | OpKind::Read => None,
        };
        let notify = match channel {
            Some(c) => {
                if !self.channels.contains_key(&c)
                    && self.channels.len() >= self.config.max_channels
                {
                    return Err(MultipathError::TooManyChannels);
                }
                let ch = self.channels.entry(c).or_default();
                let seq = ch.next_seq;
                ch.next_seq += 1;
                Notify::Uncut(seq)
            }
            None => Notify::None,
        };
        let id = OpId(self.next_op);
        self.next_op += 1;
        self.ops.insert(
            id,
            OpState {
                req,
                next_offset: 0,
                open_chunks: 0,
                notify,
                status: None,
                tainted: BTreeSet::new(),
                started: false,
            },
        );
        self.ready.push_back(id);
        Ok(id)
    }

    /// The next work request to post, or `None` when nothing can be posted now (no work, or
    /// every QP that is up has [`MultipathConfig::qp_depth`] chunks outstanding, or no QP is
    /// up). Call until `None` after every input.
    pub fn poll_post(&mut self, now: Instant) -> Option<Post> {
        if self.closed.is_some() {
            return None;
        }
        // Re-issues and immediates first: they belong to the oldest work.
        let mut i = 0;
        while i < self.pending.len() {
            let chunk = self.pending[i];
            if self.op_failed(chunk.op) {
                // The operation already has its status; this chunk need not run.
                self.pending.remove(i);
                self.finish_chunk(chunk.op);
                continue;
            }
            if !self.notify_postable(&chunk) {
                i += 1;
                continue;
            }
            let qp = self.pick_qp(chunk.len)?;
            self.pending.remove(i);
            return Some(self.post(qp, chunk, now));
        }
        // Then new work, in submission order; a fence is a barrier.
        let mut i = 0;
        while i < self.ready.len() {
            let id = self.ready[i];
            let Some(op) = self.ops.get(&id) else {
                self.ready.remove(i);
                continue;
            };
            if op.req.fence && !op.started {
                let oldest = self.ops.keys().next().copied();
                if i != 0 || oldest != Some(id) || !self.pending.is_empty() {
                    return None;
                }
            }
            let chunk = match self.cut(id) {
                Cut::Chunk(c) => c,
                Cut::Done => {
                    self.ready.remove(i);
                    continue;
                }
                Cut::Blocked => {
                    i += 1;
                    continue;
                }
            };
            let qp = self.pick_qp(chunk.len)?;
            let op = self.ops.get_mut(&id)?;
            op.started = true;
            op.open_chunks += 1;
            match chunk.kind {
                ChunkKind::Notify { seq, .. } => op.notify = Notify::Outstanding(seq),
                _ => op.next_offset = chunk.offset + u64::from(chunk.len),
            }
            if self.cut_done(id) {
                self.ready.remove(i);
            }
            return Some(self.post(qp, chunk, now));
        }
        None
    }

    /// Reports the completion of work request `wr_id` on any QP of this connection.
    /// Unknown `wr_id`s, and completions of a QP already declared failed, are counted and
    /// ignored.
    pub fn on_completion(&mut self, wr_id: u64, status: WcStatus, now: Instant) {
        // fail_qp drops a failed QP's chunks from `inflight` (they are queued again), so a
        // late completion of a failed QP is unknown here too.
        let Some(inf) = self.inflight.remove(&wr_id) else {
            self.stats.ignored_completions += 1;
            return;
        };
        let qp = inf.qp;
        let slot = &mut self.slots[usize::from(qp.slot)];
        slot.outstanding = slot.outstanding.saturating_sub(1);
        let cost = u64::from(inf.chunk.len).max(MIN_CHUNK_COST);
        slot.outstanding_bytes = slot.outstanding_bytes.saturating_sub(cost);
        if status == WcStatus::Success {
            let start = match slot.last_done {
                Some(t) if t > inf.posted_at => t,
                _ => inf.posted_at,
            };
            let took = now
                .saturating_duration_since(start)
                .max(Duration::from_micros(1));
            let sample = cost as f64 / took.as_secs_f64();
            slot.rate = Some(match slot.rate {
                Some(r) => r * 0.75 + sample * 0.25,
                None => sample,
            });
            slot.stats.rate = slot.rate.unwrap_or(0.0);
            slot.last_done = Some(now);
            slot.stats.completed_chunks += 1;
            self.chunk_succeeded(inf.chunk);
        } else if is_path_error(status) {
            // The chunk itself goes back with the rest of the QP's.
            self.inflight.insert(wr_id, inf);
            self.fail_qp(qp, status);
        } else {
            self.chunk_error(inf.chunk, status);
            self.fail_qp(qp, status);
        }
    }

    /// Declares `qp` failed (an error completion already does this; call it for
    /// `IBV_EVENT_QP_FATAL` and the like). Its outstanding chunks are queued for re-issue on
    /// the other QPs and [`Event::ReplaceQp`] is reported. A QP that is not the slot's
    /// current, up QP is ignored.
    pub fn fail_qp(&mut self, qp: QpId, status: WcStatus) {
        let Some(slot) = self.slots.get_mut(usize::from(qp.slot)) else {
            return;
        };
        if slot.state != SlotState::Up || slot.generation != qp.generation {
            return;
        }
        slot.state = SlotState::Down;
        slot.outstanding = 0;
        slot.outstanding_bytes = 0;
        slot.stats.up = false;
        slot.stats.failures += 1;
        let mut moved: Vec<(u64, Chunk)> = self
            .inflight
            .iter()
            .filter(|(_, inf)| inf.qp == qp)
            .map(|(wr, inf)| (*wr, inf.chunk))
            .collect();
        // Oldest first, so re-issue keeps posting order.
        moved.sort_by_key(|(wr, _)| *wr);
        for (wr, _) in &moved {
            self.inflight.remove(wr);
        }
        for (_, mut chunk) in moved.into_iter().rev() {
            if let Some(op) = self.ops.get_mut(&chunk.op) {
                op.tainted.insert(qp);
            }
            if self.op_failed(chunk.op) {
                // The operation already has its status: the chunk need not run again.
                self.finish_chunk(chunk.op);
                continue;
            }
            if chunk.attempts >= self.config.max_attempts {
                self.chunk_error(chunk, status);
                continue;
            }
            chunk.attempts += 1;
            self.stats.reissued_chunks += 1;
            self.pending.push_front(chunk);
        }
        self.events
            .push_back(Event::ReplaceQp { failed: qp, status });
    }

    /// The peer has moved its end of the failed `qp` to the error state (or destroyed it):
    /// no packet of `qp` can be placed any more. Operations that waited only for this
    /// complete.
    pub fn peer_torn_down(&mut self, qp: QpId) {
        let ids: Vec<OpId> = self
            .ops
            .iter_mut()
            .filter_map(|(id, op)| op.tainted.remove(&qp).then_some(*id))
            .collect();
        for id in ids {
            self.try_complete(id);
        }
    }

    /// The connection is gone: every operation not yet completed completes now with
    /// `status` (or the error it already met), and the scheduler refuses new work. The
    /// backend must have stopped every QP first (nothing can be placed any more).
    pub fn fail_all(&mut self, status: WcStatus) {
        if self.closed.is_some() {
            return;
        }
        self.closed = Some(status);
        for (id, op) in std::mem::take(&mut self.ops) {
            self.events.push_back(Event::Completed {
                op: id,
                status: op.status.unwrap_or(status),
            });
        }
        self.ready.clear();
        self.pending.clear();
        self.inflight.clear();
        for slot in &mut self.slots {
            slot.state = SlotState::Down;
            slot.stats.up = false;
            slot.outstanding = 0;
            slot.outstanding_bytes = 0;
        }
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Operations submitted and not yet completed.
    pub fn outstanding_ops(&self) -> usize {
        self.ops.len()
    }

    /// Counters of slot `slot` (0..K).
    pub fn qp_stats(&self, slot: usize) -> Option<QpStats> {
        self.slots.get(slot).map(|s| {
            let mut st = s.stats;
            st.outstanding = s.outstanding;
            st
        })
    }

    /// The receiver reports that its [`Reorderer`] expects `next_expected` next on
    /// `channel` (every notification below it delivered): with
    /// [`MultipathConfig::receiver_credits`], the channel's window may move up to there.
    /// Credits only grow; one beyond what was ever posted on the channel, or for a channel
    /// that does not exist here, is ignored and counted in
    /// [`SchedulerStats::bad_credits`] (a peer bug or a forgery: it must not open the window
    /// for notifications the receiver has not seen).
    pub fn on_credit(&mut self, channel: u32, next_expected: u64) {
        match self.channels.get_mut(&channel) {
            Some(c) if next_expected <= c.next_seq => c.credit = c.credit.max(next_expected),
            _ => self.stats.bad_credits += 1,
        }
    }

    /// Scheduler-wide counters.
    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    // ---- internals -----------------------------------------------------------------

    fn op_failed(&self, op: OpId) -> bool {
        self.ops.get(&op).is_none_or(|o| o.status.is_some())
    }

    fn notify_postable(&self, chunk: &Chunk) -> bool {
        let ChunkKind::Notify { channel, seq, .. } = chunk.kind else {
            return true;
        };
        self.channels.get(&channel).is_none_or(|c| {
            let floor = if self.config.receiver_credits {
                c.next_release.min(c.credit)
            } else {
                c.next_release
            };
            seq < floor.saturating_add(u64::from(self.config.channel_window))
        })
    }

    /// The next chunk of op `id` (not yet accounted).
    fn cut(&mut self, id: OpId) -> Cut {
        let Some(op) = self.ops.get(&id) else {
            return Cut::Done;
        };
        if op.status.is_some() {
            return Cut::Done;
        }
        let data_len = op.data_len();
        let data_kind = match op.req.kind {
            OpKind::Read => ChunkKind::Read,
            _ => ChunkKind::Write,
        };
        // Data chunks: a zero-length WRITE/READ is one zero-length chunk.
        let data_left = op.next_offset < data_len
            || (data_len == 0
                && !op.started
                && matches!(op.req.kind, OpKind::Write | OpKind::Read));
        if data_left {
            let len = (data_len - op.next_offset).min(u64::from(self.config.chunk_size)) as u32;
            return Cut::Chunk(Chunk {
                op: id,
                kind: data_kind,
                offset: op.next_offset,
                len,
                attempts: 0,
            });
        }
        let Notify::Uncut(seq) = op.notify else {
            return Cut::Done;
        };
        let (channel, imm, len) = match op.req.kind {
            OpKind::Send { channel } => (channel, None, op.req.len as u32),
            OpKind::WriteWithImm { channel, imm } => {
                if op.open_chunks > 0 {
                    // The immediate waits until every data chunk has completed.
                    return Cut::Blocked;
                }
                (channel, Some(imm), 0)
            }
            _ => return Cut::Done,
        };
        if self.channels.get(&channel).is_some_and(|c| c.failed) {
            // The channel is in the error state: flush without posting.
            if let Some(op) = self.ops.get_mut(&id) {
                op.status = Some(WcStatus::WrFlushError);
                op.started = true;
            }
            self.resolve(channel, seq, id, false);
            return Cut::Done;
        }
        let chunk = Chunk {
            op: id,
            kind: ChunkKind::Notify { channel, seq, imm },
            offset: if imm.is_some() { data_len } else { 0 },
            len,
            attempts: 0,
        };
        if !self.notify_postable(&chunk) {
            return Cut::Blocked;
        }
        Cut::Chunk(chunk)
    }

    /// Whether op `id` has nothing left to cut.
    fn cut_done(&self, id: OpId) -> bool {
        self.ops.get(&id).is_none_or(|op| {
            op.next_offset >= op.data_len() && !matches!(op.notify, Notify::Uncut(_))
        })
    }

    fn pick_qp(&self, len: u32) -> Option<QpId> {
        let cost = u64::from(len).max(MIN_CHUNK_COST) as f64;
        let known: Vec<f64> = self
            .slots
            .iter()
            .filter(|s| s.state == SlotState::Up)
            .filter_map(|s| s.rate)
            .collect();
        let default_rate = if known.is_empty() {
            1.0
        } else {
            known.iter().sum::<f64>() / known.len() as f64
        };
        let mut best: Option<(f64, usize)> = None;
        for (i, s) in self.slots.iter().enumerate() {
            if s.state != SlotState::Up || s.outstanding >= self.config.qp_depth {
                continue;
            }
            let rate = s.rate.unwrap_or(default_rate).max(f64::MIN_POSITIVE);
            let score = (s.outstanding_bytes as f64 + cost) / rate;
            if best.is_none_or(|(b, _)| score < b) {
                best = Some((score, i));
            }
        }
        let (_, i) = best?;
        Some(QpId {
            slot: i as u16,
            generation: self.slots[i].generation,
        })
    }

    fn post(&mut self, qp: QpId, chunk: Chunk, now: Instant) -> Post {
        let wr_id = self.next_wr;
        self.next_wr += 1;
        let slot = &mut self.slots[usize::from(qp.slot)];
        slot.outstanding += 1;
        slot.outstanding_bytes += u64::from(chunk.len).max(MIN_CHUNK_COST);
        slot.stats.posted_chunks += 1;
        slot.stats.posted_bytes += u64::from(chunk.len);
        self.inflight.insert(
            wr_id,
            Inflight {
                qp,
                chunk,
                posted_at: now,
            },
        );
        Post {
            qp,
            wr_id,
            op: chunk.op,
            kind: chunk.kind,
            offset: chunk.offset,
            len: chunk.len,
        }
    }

    fn chunk_succeeded(&mut self, chunk: Chunk) {
        self.finish_chunk(chunk.op);
        if let ChunkKind::Notify { channel, seq, .. } = chunk.kind {
            self.resolve(channel, seq, chunk.op, true);
        }
    }

    fn chunk_error(&mut self, chunk: Chunk, status: WcStatus) {
        if let Some(op) = self.ops.get_mut(&chunk.op) {
            if op.status.is_none() {
                op.status = Some(status);
            }
            // Nothing more of it is cut: drop the rest of the data and the notification.
            op.next_offset = op.data_len();
            let uncut = match op.notify {
                Notify::Uncut(seq) => channel_of(op.req.kind).map(|c| (c, seq)),
                _ => None,
            };
            if let Some((channel, seq)) = uncut {
                self.resolve(channel, seq, chunk.op, false);
            }
            // Its chunks queued for re-issue need not run.
            let before = self.pending.len();
            self.pending.retain(|c| c.op != chunk.op);
            let dropped = (before - self.pending.len()) as u32;
            if let Some(op) = self.ops.get_mut(&chunk.op) {
                op.open_chunks = op.open_chunks.saturating_sub(dropped);
            }
        }
        self.finish_chunk(chunk.op);
        if let ChunkKind::Notify { channel, seq, .. } = chunk.kind {
            self.resolve(channel, seq, chunk.op, false);
        }
    }

    /// Notification `seq` of `channel` (operation `op`) completed (`ok`) or failed; release
    /// every notification of the channel that is now in order.
    fn resolve(&mut self, channel: u32, seq: u64, op: OpId, ok: bool) {
        if let Some(o) = self.ops.get_mut(&op) {
            o.notify = Notify::Resolved;
        }
        let Some(c) = self.channels.get_mut(&channel) else {
            return;
        };
        c.resolved.insert(seq, (op, ok));
        let mut released = Vec::new();
        while let Some((op, ok)) = c.resolved.remove(&c.next_release) {
            c.next_release += 1;
            if !ok {
                c.failed = true;
            } else if c.failed {
                // Delivered, but behind a hole the receiver never sees filled.
                released.push((op, Some(WcStatus::WrFlushError)));
                continue;
            }
            released.push((op, None));
        }
        for (id, flush) in released {
            if let Some(o) = self.ops.get_mut(&id) {
                o.notify = Notify::Released;
                if o.status.is_none() {
                    o.status = flush;
                }
            }
            self.try_complete(id);
        }
    }

    fn finish_chunk(&mut self, id: OpId) {
        if let Some(op) = self.ops.get_mut(&id) {
            op.open_chunks = op.open_chunks.saturating_sub(1);
        }
        self.try_complete(id);
    }

    fn try_complete(&mut self, id: OpId) {
        let Some(op) = self.ops.get(&id) else {
            return;
        };
        let nothing_left = op.open_chunks == 0
            && op.tainted.is_empty()
            && matches!(op.notify, Notify::None | Notify::Released)
            && (op.status.is_some() || op.next_offset >= op.data_len())
            && op.started;
        if !nothing_left {
            return;
        }
        // A failed operation whose chunks are still queued (re-issues) is not done yet.
        if self.pending.iter().any(|c| c.op == id) {
            return;
        }
        let status = op.status.unwrap_or(WcStatus::Success);
        self.ops.remove(&id);
        self.events.push_back(Event::Completed { op: id, status });
    }
}

enum Cut {
    Chunk(Chunk),
    Blocked,
    Done,
}

fn channel_of(kind: OpKind) -> Option<u32> {
    match kind {
        OpKind::Send { channel } | OpKind::WriteWithImm { channel, .. } => Some(channel),
        OpKind::Write | OpKind::Read => None,
    }
}

/// Whether a completion status means the path (the QP) failed, not the operation: the
/// chunk is re-issued on another QP. `IBV_WC_RETRY_EXC_ERR` (no acknowledgement within the
/// retry budget: the path is broken) and `IBV_WC_WR_FLUSH_ERR` (the QP went to the error
/// state before the work request completed).
pub fn is_path_error(status: WcStatus) -> bool {
    matches!(status, WcStatus::RetryExceeded | WcStatus::WrFlushError)
}

/// Receiver half of the notification ordering: delivers the notifications of each channel
/// in sequence order, exactly once, whatever QP they arrived on and however often.
///
/// Memory is bounded: at most `window` items buffered per channel and `max_channels`
/// channels; a sequence number at or beyond `next + window` (which a sender that keeps the
/// window never sends) is refused.
#[derive(Debug)]
pub struct Reorderer<T> {
    window: u64,
    max_channels: usize,
    channels: HashMap<u32, ChannelRx<T>>,
    ready: VecDeque<(u32, u64, T)>,
    duplicates: u64,
    refused: u64,
    /// Report a channel's credit once its next expected number moved this far past the
    /// last report (0: no credits).
    credit_step: u64,
    /// Channels whose credit is due, in the order they became due (each at most once).
    credits_due: VecDeque<u32>,
}

#[derive(Debug)]
struct ChannelRx<T> {
    next: u64,
    buffered: BTreeMap<u64, T>,
    /// The next expected number last reported as a credit.
    reported: u64,
    /// Queued in `credits_due`.
    due: bool,
}

/// What [`Reorderer::accept`] did with an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accepted {
    /// Delivered or buffered.
    Taken,
    /// Already delivered or buffered: dropped (a re-issue after a QP failure).
    Duplicate,
    /// Beyond the window, or a new channel beyond the limit: dropped (a sender bug or a
    /// forged message).
    Refused,
}

impl<T> Reorderer<T> {
    /// A reorderer with `window` (at least the sender's [`MultipathConfig::channel_window`],
    /// plus whatever the receive path can hold before frames reach it; see the module docs)
    /// and at most `max_channels` channels.
    pub fn new(window: u32, max_channels: usize) -> Self {
        Reorderer {
            window: u64::from(window.max(1)),
            max_channels,
            channels: HashMap::new(),
            ready: VecDeque::new(),
            duplicates: 0,
            refused: 0,
            credit_step: 0,
            credits_due: VecDeque::new(),
        }
    }

    /// A reorderer for a sender with [`MultipathConfig::receiver_credits`]: `window` is
    /// the sender's `channel_window` exactly (the credits keep the sender within it), and a
    /// channel's credit is due ([`Reorderer::poll_credit`]) each time its next expected
    /// number has moved a quarter of the window past the last report. A quarter keeps the
    /// sender streaming (it always has three quarters of its window open) at one credit per
    /// `window / 4` notifications; the sender never stalls on a credit that is not sent,
    /// since a sender stopped at the window's end has all of it delivered, which is a full
    /// window past the last report.
    pub fn with_credits(window: u32, max_channels: usize) -> Self {
        let mut r = Self::new(window, max_channels);
        r.credit_step = (r.window / 4).max(1);
        r
    }

    /// A credit that is due: `(channel, next expected sequence number)`, for the sender's
    /// [`Scheduler::on_credit`]. Call until `None` after [`Reorderer::accept`]; always
    /// `None` without [`Reorderer::with_credits`].
    pub fn poll_credit(&mut self) -> Option<(u32, u64)> {
        let channel = self.credits_due.pop_front()?;
        let ch = self.channels.get_mut(&channel)?;
        ch.due = false;
        ch.reported = ch.next;
        Some((channel, ch.next))
    }

    /// Takes notification `seq` of `channel`; whatever becomes deliverable in order is
    /// queued for [`Reorderer::poll`].
    pub fn accept(&mut self, channel: u32, seq: u64, item: T) -> Accepted {
        if !self.channels.contains_key(&channel) && self.channels.len() >= self.max_channels {
            self.refused += 1;
            return Accepted::Refused;
        }
        let ch = self.channels.entry(channel).or_insert(ChannelRx {
            next: 0,
            buffered: BTreeMap::new(),
            reported: 0,
            due: false,
        });
        if seq < ch.next || ch.buffered.contains_key(&seq) {
            self.duplicates += 1;
            return Accepted::Duplicate;
        }
        if seq - ch.next >= self.window {
            self.refused += 1;
            return Accepted::Refused;
        }
        ch.buffered.insert(seq, item);
        while let Some(item) = ch.buffered.remove(&ch.next) {
            self.ready.push_back((channel, ch.next, item));
            ch.next += 1;
        }
        if self.credit_step > 0 && !ch.due && ch.next - ch.reported >= self.credit_step {
            ch.due = true;
            self.credits_due.push_back(channel);
        }
        Accepted::Taken
    }

    /// The next in-order notification: `(channel, seq, item)`.
    pub fn poll(&mut self) -> Option<(u32, u64, T)> {
        self.ready.pop_front()
    }

    /// Next sequence number expected on `channel`.
    pub fn next_expected(&self, channel: u32) -> u64 {
        self.channels.get(&channel).map_or(0, |c| c.next)
    }

    /// Duplicates dropped so far.
    pub fn duplicates(&self) -> u64 {
        self.duplicates
    }

    /// Items refused so far (out of window, too many channels).
    pub fn refused(&self) -> u64 {
        self.refused
    }
}
