//! Semantic layer, requester side: posted operations, their segmentation into
//! path-MTU-sized segments, acknowledgement per segment, READ/atomic responses, RNR
//! back-off, and completions in posting order per stream (see `SendQueue::pop_completion`).
//!
//! The same queue carries the responder's internal operations (READ and atomic
//! responses): they are sent and acknowledged like any data but report no completion.

use super::path::SegRef;
use crate::event::{WcOpcode, WcStatus, WorkCompletion};
use crate::fasthash::{HashMap, HashSet};
use crate::mr::MrTable;
use bytes::Bytes;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::{Duration, Instant};

/// PathEth flags bit 1 on an `MR_SEND`: stream abort. The packet carries no payload;
/// SendEth names the stream and the first message the sender gave up on (offset 0, message
/// length 0). See docs/PROTOCOL.md, "Errors on a stream".
pub(crate) const PATH_FLAG_STREAM_ABORT: u8 = crate::wire::PathEth::FLAG_STREAM_ABORT;

/// PathEth flags bit 2 on an `MR_SEND`: stream FIN (alone), or with bit 1 STOP. See
/// docs/PROTOCOL.md, "Ending a stream".
pub(crate) const PATH_FLAG_STREAM_FIN: u8 = crate::wire::PathEth::FLAG_STREAM_FIN;

/// PathEth flags bit 1 on an `MR_WRITE`: op abort. The packet carries no payload; its
/// WriteEth names the op id of a WRITE the requester gave up on (see docs/PROTOCOL.md,
/// "Errors of one operation").
pub(crate) const PATH_FLAG_OP_ABORT: u8 = crate::wire::PathEth::FLAG_OP_ABORT;

/// The code a stream abort carries when the sender gave up on the stream because a SEND
/// failed with `RnrRetryExceeded` (not an application reset).
pub const STREAM_CODE_RNR: u32 = u32::MAX;

/// The code a stream abort carries when the sender gave up on the stream because the
/// receiver refused it: its stream table was full (`TransportConfig::max_streams`; a NAK
/// 0x61 with `NakEth::FLAG_STREAM_REFUSED`, `RemoteInvalidRequest` at the sender).
pub const STREAM_CODE_REFUSED: u32 = u32::MAX - 1;

/// Emptied per-stream completion queues kept for reuse (`SendQueue::spare_queues`).
const SPARE_QUEUES: usize = 64;

/// How the sending side ended a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StreamEnd {
    /// `finish_stream`: a FIN follows the last message.
    Finished,
    /// `reset_stream` (or a STOP from the peer).
    Reset,
}

/// An atomic operation (IBA 9.4.5): compare-and-swap or fetch-and-add on 8 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicOp {
    /// If the remote value equals `compare`, replace it with `swap`.
    CompareSwap {
        /// Value to compare with.
        compare: u64,
        /// Value to store on a match.
        swap: u64,
    },
    /// Add `add` (wrapping) to the remote value.
    FetchAdd {
        /// Addend.
        add: u64,
    },
}

/// The flow-control key of the WRITEs with immediate (above every stream id).
const IMM_FLOW: u64 = 1 << 32;

/// Which receive flow control holds an operation back after a flow-control RNR NAK: the
/// stream of a SEND (`max_stream_recv_bytes`, `max_recv_buffer_bytes`), or [`IMM_FLOW`] for
/// a WRITE with immediate (`max_unconsumed_immediates`); `None` for the others.
fn flow_key(kind: &OpKind) -> Option<u64> {
    match kind {
        OpKind::Send { stream, .. } => Some(*stream as u64),
        OpKind::Write { imm: Some(_), .. } => Some(IMM_FLOW),
        _ => None,
    }
}

/// Index in `parked` of the segment the receiver admits first among a stream's refused
/// ones: the earliest operation's (a stream's messages are admitted in order), its earliest
/// segment. `None` if `parked` is empty.
fn earliest(parked: &[SegRef]) -> Option<usize> {
    (0..parked.len()).min_by_key(|&k| (parked[k].op, parked[k].seg))
}

#[derive(Debug)]
pub(crate) enum OpKind {
    Send {
        stream: u32,
        msg_seq: u32,
        data: Bytes,
    },
    Write {
        lkey: u32,
        local_offset: u64,
        va: u64,
        rkey: u32,
        imm: Option<u32>,
        wire_id: u32,
    },
    Read {
        lkey: u32,
        local_offset: u64,
        va: u64,
        rkey: u32,
        wire_id: u32,
    },
    Atomic {
        lkey: u32,
        local_offset: u64,
        va: u64,
        rkey: u32,
        op: AtomicOp,
        wire_id: u32,
    },
    /// Responder: the response to the READ `req_id` the peer requested: `[offset, offset +
    /// len)` of the local region `lkey` (which must still answer to `rkey` and grant
    /// REMOTE_READ), read for each packet built (a retransmission reads
    /// it again), as RNICs and Linux rxe read a READ's source; `lkey` 0 for a zero-length
    /// READ.
    ReadResponse {
        req_id: u32,
        lkey: u32,
        rkey: u32,
        offset: u64,
    },
    /// Responder: the original value of an atomic the peer requested.
    AtomicResponse { req_id: u32, orig: u64 },
    /// Requester: tell the peer that `stream` is dead from message `msg_seq` on (a SEND
    /// failed with `RnrRetryExceeded`): an `MR_SEND` with the stream-abort flag, no payload.
    /// `code`: the application's reset code, or [`STREAM_CODE_RNR`] for an RNR failure.
    StreamAbort {
        stream: u32,
        msg_seq: u32,
        code: u32,
    },
    /// Requester: the stream ends after message `msg_seq - 1` (`msg_seq` messages in
    /// all): an `MR_SEND` with the stream-FIN flag, no payload.
    StreamFin { stream: u32, msg_seq: u32 },
    /// Receiver of a stream: ask the peer to stop sending on `stream` (`code` from the
    /// application): an `MR_SEND` with the stream-abort and stream-FIN flags, no payload;
    /// `delivered` is the number of the stream's messages this side had delivered in order
    /// when it stopped (the peer completes those `Success`).
    StreamStop {
        stream: u32,
        code: u32,
        delivered: u32,
    },
    /// Requester: tell the peer that the WRITE with op id `wire_id` will send no more
    /// packets (it failed locally, e.g. its source region was deregistered), so the peer
    /// counts the op id as finished: an `MR_WRITE` with the op-abort flag, no payload.
    OpAbort { wire_id: u32 },
}

impl OpKind {
    /// Queued by the connection itself: sent and acknowledged like data, no completion.
    fn is_internal(&self) -> bool {
        self.is_response()
            || matches!(
                self,
                OpKind::StreamAbort { .. }
                    | OpKind::OpAbort { .. }
                    | OpKind::StreamFin { .. }
                    | OpKind::StreamStop { .. }
            )
    }

    /// The stream of a SEND, FIN or stream abort (what `stream_ops` counts).
    fn stream_op(&self) -> Option<u32> {
        match *self {
            OpKind::Send { stream, .. }
            | OpKind::StreamFin { stream, .. }
            | OpKind::StreamAbort { stream, .. } => Some(stream),
            _ => None,
        }
    }

    /// A response to the peer's READ or atomic (counts against responder resources).
    fn is_response(&self) -> bool {
        matches!(
            self,
            OpKind::ReadResponse { .. } | OpKind::AtomicResponse { .. }
        )
    }

    fn is_rd_atomic(&self) -> bool {
        matches!(self, OpKind::Read { .. } | OpKind::Atomic { .. })
    }
}

/// Segments of response data received for a READ.
#[derive(Debug)]
struct RespTrack {
    got: super::segbits::SegBits,
    got_segs: u32,
    nsegs: u32,
    /// When the last new response segment arrived (restarts the response wait).
    last_progress: Option<Instant>,
}

#[derive(Debug)]
pub(crate) struct Op {
    /// The application's work request id; for an internal operation, the id of the last
    /// application operation posted before it (a search key for `SendQueue::cancel`).
    pub wr_id: u64,
    pub kind: OpKind,
    /// Bytes the operation carries (message, WRITE or READ length; 8 for atomics).
    pub len: u32,
    /// Segments the requester sends (1 for READ and atomic requests).
    pub nsegs: u32,
    next_seg: u32,
    acked: super::segbits::SegBits,
    acked_segs: u32,
    resp: Option<RespTrack>,
    /// RNR state per segment (empty until the first RNR NAK): each packet is re-sent at
    /// most `rnr_retry` times after an RNR wait.
    rnr: Vec<RnrSeg>,
    /// Response timeouts of a READ/atomic whose request was acknowledged.
    resp_timeouts: u32,
    pub status: Option<WcStatus>,
    /// A cancelled operation: the id of the op abort that must be acknowledged before its
    /// completion is reported (from then on the peer neither places nor executes it).
    hold: Option<u64>,
    /// Its completion was reported (`pop_completion`); it stays in the queue until every
    /// operation before it left (its payload is dropped then).
    reported: bool,
    /// Listed in `ready` or `blocked` (at most once).
    listed: bool,
}

impl Op {
    fn opcode(&self) -> WcOpcode {
        match self.kind {
            OpKind::Send { .. }
            | OpKind::ReadResponse { .. }
            | OpKind::AtomicResponse { .. }
            | OpKind::StreamAbort { .. }
            | OpKind::StreamFin { .. }
            | OpKind::StreamStop { .. }
            | OpKind::OpAbort { .. } => WcOpcode::Send,
            OpKind::Write { imm: None, .. } => WcOpcode::RdmaWrite,
            OpKind::Write { imm: Some(_), .. } => WcOpcode::RdmaWriteWithImm,
            OpKind::Read { .. } => WcOpcode::RdmaRead,
            OpKind::Atomic {
                op: AtomicOp::CompareSwap { .. },
                ..
            } => WcOpcode::CompSwap,
            OpKind::Atomic {
                op: AtomicOp::FetchAdd { .. },
                ..
            } => WcOpcode::FetchAdd,
        }
    }

    fn is_acked(&self, seg: u32) -> bool {
        self.acked[(seg / 64) as usize] >> (seg % 64) & 1 == 1
    }

    /// Whether segment `seg` is waiting on its RNR timer (not to be sent until it ends).
    fn rnr_waiting(&self, seg: u32) -> bool {
        self.rnr
            .get(seg as usize)
            .is_some_and(|r| r.phase == RnrPhase::Waiting)
    }
}

/// Which copies of a segment an RNR NAK may count for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RnrPhase {
    /// Every copy (no RNR wait yet, or the retry budget is spent while another copy was in
    /// flight: then that copy's answer decides).
    Any,
    /// On the RNR timer: not sent; NAKs of copies sent before the wait began are stale.
    Waiting,
    /// The wait ended: only a NAK of a copy sent since (listed in `RnrSeg::copies`) counts.
    Resent,
}

/// At most this many copies sent since the last RNR wait are remembered per segment (the
/// oldest is forgotten first: its NAK is then ignored, and a newer copy answers).
const RNR_COPIES: usize = 4;

/// RNR state of one segment of an operation.
#[derive(Debug, Clone)]
struct RnrSeg {
    /// RNR NAKs counted (each one started a wait, or failed the operation).
    count: u8,
    phase: RnrPhase,
    /// (path id, PSN) of the copies sent since the last wait ended (phase `Resent`).
    copies: Vec<(u8, u32)>,
}

/// The path MTU a connection uses for `pmtu`: the largest power of two in 256..=4096 not
/// above it (256 below that). Configurations and both handshake messages are checked to
/// hold such a value already; this keeps the rule for a transport configuration changed
/// after the endpoint was made (`Endpoint::transport_config_mut`), so that the shifts of
/// [`segs_of`] and [`seg_of`] always hold. IBA path MTUs: 256, 512, 1024, 2048, 4096.
pub(crate) fn valid_pmtu(pmtu: u32) -> u32 {
    let p = pmtu.clamp(256, 4096);
    1 << (31 - p.leading_zeros())
}

/// Number of path-MTU segments of a `len`-byte message, `ceil(len / pmtu)` (0 for 0
/// bytes). The path MTU is a power of two ([`valid_pmtu`]), so this is a shift: a division
/// per packet was a measurable part of the per-packet cost (issue #13).
pub(crate) fn segs_of(len: u32, pmtu: u32) -> u32 {
    debug_assert!(pmtu.is_power_of_two());
    ((u64::from(len) + u64::from(pmtu) - 1) >> pmtu.trailing_zeros()) as u32
}

/// Index of the segment holding byte `offset` of a message (`offset / pmtu`, a shift; see
/// [`segs_of`]).
pub(crate) fn seg_of(offset: u32, pmtu: u32) -> u32 {
    debug_assert!(pmtu.is_power_of_two());
    (u64::from(offset) >> pmtu.trailing_zeros()) as u32
}

/// Byte offset and length of segment `seg` of a `len`-byte message.
pub(crate) fn seg_span(len: u32, pmtu: u32, seg: u32) -> (u32, u32) {
    let off = seg * pmtu;
    (off, (len - off.min(len)).min(pmtu))
}

/// The RNR timer of IBA (RoCEv2 reference §3.1): how long an RNR NAK with this 5-bit code
/// asks the sender to wait.
pub fn rnr_timer(code: u8) -> Duration {
    const US: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560,
        3_840, 5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880,
        163_840, 245_760, 327_680, 491_520,
    ];
    Duration::from_micros(US[(code & 31) as usize] as u64)
}

/// What a READ or atomic response did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RespOutcome {
    /// Placed (or a duplicate of placed data): acknowledge.
    Accepted,
    /// Does not answer a request this side sent (not sent yet, not a READ/atomic, length
    /// or offset off the request): dropped and counted, nothing placed.
    Invalid,
}

/// How far `SendQueue::peek`'s scan past a blocked cursor got: every operation from the
/// scan's start up to (not including) op id `from` could not be sent, in the scan mode
/// `flow_stop` (the cursor waits on receive flow control, not on `max_rd_atomic`), and at
/// `from` the scan had `only_internal` (a READ or atomic held by `max_rd_atomic` was
/// passed). Operations only ever become unsendable (finished, fully sent, their stream
/// entering a flow-control wait) except through the events that drop the hint: a stream's
/// flow-control wait ending, a started READ or atomic finishing (`rd_outstanding` falls),
/// or an unstarted one finishing (it may have set `only_internal`). Without it, a stream
/// the peer holds in a flow-control wait made every `peek` (one per packet sent) walk the
/// whole send queue: with 60,000 SENDs queued behind it, 0.5 ms per READ response packet
/// (found by review).
#[derive(Debug, Clone, Copy)]
struct ScanHint {
    flow_stop: bool,
    from: u64,
    only_internal: bool,
}

/// The send queue of a connection.
#[derive(Debug, Default)]
pub(crate) struct SendQueue {
    ops: VecDeque<Op>,
    base_id: u64,
    cursor: usize,
    retx: VecDeque<SegRef>,
    /// Segments on their RNR timer, by (end of the wait, arrival order). Ordered so that
    /// the next deadline and the waits that ended are found without a walk: the peer
    /// decides how many segments wait (every one it RNR-NAKs), and a list was walked on
    /// every timer recomputation, once per packet (found by review: 16,000 waiting
    /// segments cost 27 times the per-NAK time of 1,000).
    rnr_wait: std::collections::BTreeMap<(Instant, u64), SegRef>,
    /// Arrival counter of `rnr_wait` (ties of equal deadlines keep arrival order).
    rnr_seq: u64,
    /// READ/atomic requests acknowledged but not answered yet: (deadline, request segment,
    /// base response timeout, when the wait was armed).
    resp_wait: VecDeque<(Instant, SegRef, Duration, Instant)>,
    stream_seq: HashMap<u32, u32>,
    /// Streams this side finished or reset as their sender.
    ended_streams: HashMap<u32, StreamEnd>,
    /// Streams this side asked the peer to stop sending on.
    stopped_streams: HashSet<u32>,
    /// Bytes of SENDs posted per stream and not yet completed (entries removed at 0).
    stream_bytes: HashMap<u32, u64>,
    /// The sum of `stream_bytes`.
    send_bytes: u64,
    /// Bytes of SENDs finished so far (a running total: `send_bytes` went down by it).
    send_freed: u64,
    /// Streams in a flow-control wait: their receiver refused a message with a
    /// flow-control RNR NAK, and no acknowledgement of the probe has come back since. No
    /// segment of theirs is sent for the first time meanwhile.
    /// Keyed by [`flow_key`]: a stream id, or [`IMM_FLOW`] for the WRITEs with immediate
    /// (held back by the receiver's `max_unconsumed_immediates`).
    flow_wait: HashSet<u64>,
    /// Per stream in `flow_wait`: the one refused segment re-sent when its RNR wait ended
    /// (the probe); the other refused segments park in `flow_parked` until the probe is
    /// acknowledged, so a waiting stream costs one packet per RNR timer, not a window.
    flow_probe: HashMap<u64, SegRef>,
    flow_parked: HashMap<u64, Vec<SegRef>>,
    /// Streams in the error state: a SEND on it failed with `RnrRetryExceeded`; the value
    /// is the first message sequence number the stream lost. SENDs posted later on such a
    /// stream complete with `WrFlushError` without being sent.
    dead_streams: HashMap<u32, u32>,
    next_wire_id: u32,
    /// Pending READs/atomics by wire id.
    rd_ops: HashMap<u32, u64>,
    /// SENDs not yet reported and FINs and stream aborts not yet finished, per stream.
    stream_ops: HashMap<u32, u32>,
    /// Application SENDs not yet reported, per stream, oldest first: a stream's completions
    /// are reported in this order.
    stream_unreported: HashMap<u32, VecDeque<u64>>,
    /// Emptied queues of `stream_unreported` of retired streams, kept for their capacity
    /// (no allocation per request stream; at most `SPARE_QUEUES`).
    spare_queues: Vec<VecDeque<u64>>,
    /// Application WRITEs, READs and atomics (one-sided operations) not yet reported,
    /// oldest first: they are reported in this order, and a SEND only after every
    /// one-sided operation posted before it.
    os_unreported: VecDeque<u64>,
    /// Operations whose completion can be reported now (min-heap of op ids): finished,
    /// first of their stream (or of the one-sided operations), no earlier one-sided
    /// operation unreported, not held by an op abort.
    ready: BinaryHeap<Reverse<u64>>,
    /// Finished SENDs first of their stream, waiting for an earlier one-sided operation to
    /// be reported (min-heap of op ids).
    blocked: BinaryHeap<Reverse<u64>>,
    /// Op aborts of cancelled operations not yet acknowledged: abort's op id → the
    /// cancelled operation's (reported once the abort is acknowledged).
    held: HashMap<u64, u64>,
    /// Streams whose outgoing direction may have just become retirable (their last SEND,
    /// FIN or abort left the queue), for [`SendQueue::retire_streams`].
    retire_check: Vec<u32>,
    /// Streams whose outgoing direction ended and was forgotten (`retire_streams`).
    retired: super::idset::IdSet,
    /// Streams over when `retired` was at its range bound, kept for that alone: checked
    /// again once a neighbour is retired, or the ranges fall below the bound (before,
    /// nothing looked at them again and they were kept for the connection's life; found by
    /// review).
    kept: std::collections::BTreeSet<u32>,
    rd_outstanding: u32,
    /// READ/atomic responses queued and not yet acknowledged.
    internal_pending: u32,
    /// Internal operations of any kind queued and not yet acknowledged.
    internal_ops: u32,
    app_ops: usize,
    /// Where `peek`'s scan past a blocked cursor resumes (see [`ScanHint`]); `None` when
    /// it starts over at the cursor.
    scan_hint: Option<ScanHint>,
    /// Operations `peek` looked at past a blocked cursor (for the unit test of its cost).
    #[cfg(test)]
    scanned: u64,
    /// The work request id of the last application operation posted.
    last_wr_id: u64,
    /// Set once an application operation was posted with a smaller work request id than
    /// the one before it. Until then ids are nondecreasing along `ops` (internal operations
    /// carry `last_wr_id`), and `cancel` finds its operation by binary search.
    wr_ids_unsorted: bool,
    pmtu: u32,
    max_rd_atomic: u32,
}

impl SendQueue {
    pub fn new(pmtu: u32, max_rd_atomic: u32) -> Self {
        Self {
            pmtu: valid_pmtu(pmtu),
            max_rd_atomic,
            ..Default::default()
        }
    }

    /// Rebuild the (still empty) tables keyed by stream and operation ids with the hasher
    /// state `st` (a secret key: `fasthash`; the peer names streams in STOP and RESET, and
    /// its READs' operation ids).
    pub fn key_tables(&mut self, st: crate::fasthash::FastState) {
        debug_assert!(self.stream_seq.is_empty() && self.rd_ops.is_empty());
        self.stream_seq = HashMap::with_hasher(st);
        self.ended_streams = HashMap::with_hasher(st);
        self.stopped_streams = HashSet::with_hasher(st);
        self.stream_bytes = HashMap::with_hasher(st);
        self.flow_wait = HashSet::with_hasher(st);
        self.flow_probe = HashMap::with_hasher(st);
        self.flow_parked = HashMap::with_hasher(st);
        self.dead_streams = HashMap::with_hasher(st);
        self.rd_ops = HashMap::with_hasher(st);
        self.stream_ops = HashMap::with_hasher(st);
        self.stream_unreported = HashMap::with_hasher(st);
    }

    pub fn set_pmtu(&mut self, pmtu: u32) {
        self.pmtu = valid_pmtu(pmtu);
    }

    /// Operations in the queue, internal ones and finished ones waiting behind an
    /// unfinished one for in-order completion included.
    pub fn queued_ops(&self) -> usize {
        self.ops.len()
    }

    /// Operations posted by the application and not yet reported.
    pub fn len(&self) -> usize {
        self.app_ops
    }

    /// Responses queued for the peer's READs and atomics.
    pub fn internal_pending(&self) -> u32 {
        self.internal_pending
    }

    pub fn op(&self, id: u64) -> Option<&Op> {
        let i = id.checked_sub(self.base_id)?;
        self.ops.get(usize::try_from(i).ok()?)
    }

    fn op_mut(&mut self, id: u64) -> Option<&mut Op> {
        let i = id.checked_sub(self.base_id)?;
        self.ops.get_mut(usize::try_from(i).ok()?)
    }

    fn next_wire_id(&mut self) -> u32 {
        let id = self.next_wire_id;
        self.next_wire_id = id.wrapping_add(1);
        id
    }

    fn push(&mut self, wr_id: u64, kind: OpKind, len: u32) {
        if let OpKind::Send { stream, .. } = kind {
            *self.stream_bytes.entry(stream).or_insert(0) += len as u64;
            self.send_bytes += len as u64;
        }
        if let Some(stream) = kind.stream_op() {
            *self.stream_ops.entry(stream).or_insert(0) += 1;
        }
        let data_segs = segs_of(len, self.pmtu).max(1);
        let (nsegs, resp) = match kind {
            OpKind::Read { .. } => (
                1,
                Some(RespTrack {
                    got: super::segbits::SegBits::zeroed(data_segs.div_ceil(64) as usize),
                    got_segs: 0,
                    nsegs: data_segs,
                    last_progress: None,
                }),
            ),
            OpKind::Atomic { .. } => (1, None),
            _ => (data_segs, None),
        };
        let wr_id = if kind.is_internal() {
            self.internal_ops += 1;
            if kind.is_response() {
                self.internal_pending += 1;
            }
            // Reported nowhere: it only keeps the ids along `ops` sorted for `cancel`.
            self.last_wr_id
        } else {
            self.app_ops += 1;
            self.wr_ids_unsorted |= wr_id < self.last_wr_id;
            self.last_wr_id = wr_id;
            wr_id
        };
        if let OpKind::Read { wire_id, .. } | OpKind::Atomic { wire_id, .. } = kind {
            self.rd_ops
                .insert(wire_id, self.base_id + self.ops.len() as u64);
        }
        self.ops.push_back(Op {
            wr_id,
            kind,
            len,
            nsegs,
            next_seg: 0,
            acked: super::segbits::SegBits::zeroed(nsegs.div_ceil(64) as usize),
            acked_segs: 0,
            resp,
            rnr: Vec::new(),
            resp_timeouts: 0,
            status: None,
            hold: None,
            reported: false,
            listed: false,
        });
        let id = self.base_id + self.ops.len() as u64 - 1;
        match self.ops[self.ops.len() - 1].kind {
            OpKind::Send { stream, .. } => {
                let spare = &mut self.spare_queues;
                self.stream_unreported
                    .entry(stream)
                    .or_insert_with(|| spare.pop().unwrap_or_default())
                    .push_back(id);
            }
            OpKind::Write { .. } | OpKind::Read { .. } | OpKind::Atomic { .. } => {
                self.os_unreported.push_back(id);
            }
            _ => {}
        }
    }

    /// Queue a SEND on `stream`. On a stream in the error state (see `fail_stream`) the
    /// operation is not sent: it completes with `WrFlushError` (IBA: work requests posted
    /// to a QP in the error state are flushed).
    pub fn post_send(&mut self, wr_id: u64, stream: u32, data: Bytes) {
        if self.dead_streams.contains_key(&stream) {
            let len = data.len() as u32;
            let id = self.base_id + self.ops.len() as u64;
            self.push(
                wr_id,
                OpKind::Send {
                    stream,
                    msg_seq: 0,
                    data,
                },
                len,
            );
            self.finish(id, WcStatus::WrFlushError);
            return;
        }
        let seq = self.stream_seq.entry(stream).or_insert(0);
        let msg_seq = *seq;
        *seq = seq.wrapping_add(1);
        let len = data.len() as u32;
        self.push(
            wr_id,
            OpKind::Send {
                stream,
                msg_seq,
                data,
            },
            len,
        );
    }

    pub fn post_write(&mut self, req: &crate::endpoint::WriteRequest) {
        let wire_id = self.next_wire_id();
        let kind = OpKind::Write {
            lkey: req.lkey,
            local_offset: req.local_offset,
            va: req.remote_addr,
            rkey: req.rkey,
            imm: req.imm,
            wire_id,
        };
        self.push(req.wr_id, kind, req.len);
    }

    pub fn post_read(&mut self, req: &crate::endpoint::ReadRequest) {
        let wire_id = self.next_wire_id();
        let kind = OpKind::Read {
            lkey: req.lkey,
            local_offset: req.local_offset,
            va: req.remote_addr,
            rkey: req.rkey,
            wire_id,
        };
        self.push(req.wr_id, kind, req.len);
    }

    pub fn post_atomic(&mut self, req: &crate::endpoint::AtomicRequest) {
        let wire_id = self.next_wire_id();
        let kind = OpKind::Atomic {
            lkey: req.lkey,
            local_offset: req.local_offset,
            va: req.remote_addr,
            rkey: req.rkey,
            op: req.op,
            wire_id,
        };
        self.push(req.wr_id, kind, 8);
    }

    /// Queue the response to the executed READ `req_id`: `len` bytes of the local region
    /// `lkey` (answering to `rkey`) from `offset`.
    pub fn post_read_response_mr(
        &mut self,
        req_id: u32,
        (lkey, rkey): (u32, u32),
        offset: u64,
        len: u32,
    ) {
        self.push(
            0,
            OpKind::ReadResponse {
                req_id,
                lkey,
                rkey,
                offset,
            },
            len,
        );
    }

    pub fn post_atomic_response(&mut self, req_id: u32, orig: u64) {
        self.push(0, OpKind::AtomicResponse { req_id, orig }, 0);
    }

    fn live(&self, s: SegRef) -> bool {
        self.op(s.op)
            .is_some_and(|o| o.status.is_none() && !o.is_acked(s.seg) && !o.rnr_waiting(s.seg))
    }

    /// A copy of segment `s` went out on path `path_id` with PSN `psn`: after an RNR wait,
    /// the RNR NAK of such a copy counts as the next retry.
    pub fn on_transmit(&mut self, s: SegRef, path_id: u8, psn: u32) {
        let Some(op) = self.op_mut(s.op) else { return };
        if let Some(r) = op.rnr.get_mut(s.seg as usize) {
            if r.phase == RnrPhase::Resent {
                if r.copies.len() >= RNR_COPIES {
                    r.copies.remove(0);
                }
                r.copies.push((path_id, psn));
            }
        }
    }

    /// The next segment to transmit (retransmissions first), without taking it. A READ or
    /// atomic waits while `max_rd_atomic` of them are outstanding (and holds back what was
    /// posted after it, like an RC send queue).
    pub fn peek(&mut self) -> Option<SegRef> {
        while let Some(&s) = self.retx.front() {
            if self.live(s) {
                return Some(s);
            }
            self.retx.pop_front();
        }
        let mut flow_stop = false;
        while let Some(op) = self.ops.get(self.cursor) {
            if op.status.is_none() && op.next_seg < op.nsegs {
                if op.next_seg == 0
                    && op.kind.is_rd_atomic()
                    && self.rd_outstanding >= self.max_rd_atomic
                {
                    break;
                }
                if self.is_flow_blocked(op) {
                    flow_stop = true;
                    break;
                }
                return Some(SegRef {
                    op: self.base_id + self.cursor as u64,
                    seg: op.next_seg,
                });
            }
            self.cursor += 1;
        }
        // Blocked (or done): responses to the peer's READs and atomics are not held back by
        // our own waiting ones — the peer's outstanding requests may be what we wait for —
        // nor are stream aborts. A stream waiting on receive flow control holds back only
        // itself: later operations go on, up to the next READ/atomic held by
        // `max_rd_atomic` (which holds back what follows it, as before).
        if self.internal_ops > 0 || flow_stop {
            let mut skip = if flow_stop {
                self.cursor
            } else {
                self.cursor + 1
            };
            let mut only_internal = !flow_stop;
            // Resume where the last scan in this mode stopped (see `ScanHint`). (The mode
            // cannot change under a live hint today: the cursor leaves a waiting READ or
            // atomic only through events that drop it. Checked anyway.)
            if let Some(h) = self.scan_hint.filter(|h| h.flow_stop == flow_stop) {
                if let Some(at) = h.from.checked_sub(self.base_id) {
                    if at as usize > skip {
                        skip = at as usize;
                        only_internal = h.only_internal;
                    }
                }
            }
            let mut found = None;
            let mut stop = self.ops.len();
            let mut stop_only_internal = only_internal;
            for (i, op) in self.ops.iter().enumerate().skip(skip) {
                if op.status.is_some() || op.next_seg >= op.nsegs {
                    continue;
                }
                let seg = Some(SegRef {
                    op: self.base_id + i as u64,
                    seg: op.next_seg,
                });
                if op.kind.is_internal() {
                    (found, stop, stop_only_internal) = (seg, i, only_internal);
                    break;
                }
                if only_internal || self.is_flow_blocked(op) {
                    continue;
                }
                if op.next_seg == 0
                    && op.kind.is_rd_atomic()
                    && self.rd_outstanding >= self.max_rd_atomic
                {
                    if self.internal_ops == 0 {
                        // Looked at again next time (internal operations may come).
                        (stop, stop_only_internal) = (i, only_internal);
                        break;
                    }
                    only_internal = true;
                    stop_only_internal = true;
                    continue;
                }
                (found, stop, stop_only_internal) = (seg, i, only_internal);
                break;
            }
            #[cfg(test)]
            {
                self.scanned += (stop + 1).saturating_sub(skip) as u64;
            }
            self.scan_hint = Some(ScanHint {
                flow_stop,
                from: self.base_id + stop as u64,
                only_internal: stop_only_internal,
            });
            return found;
        }
        None
    }

    fn is_flow_blocked(&self, op: &Op) -> bool {
        !self.flow_wait.is_empty()
            && flow_key(&op.kind).is_some_and(|k| self.flow_wait.contains(&k))
    }

    fn send_stream(&self, s: SegRef) -> Option<u64> {
        flow_key(&self.op(s.op)?.kind)
    }

    /// The receiver refused segment `s` (a SEND, or the last packet of a WRITE with
    /// immediate) with a flow-control RNR NAK (`on_rnr` has put it on its RNR wait): its
    /// stream (or the connection's WRITEs with immediate) enters (or stays in) the
    /// flow-control wait, and a new probe is chosen when the next refused segment's wait
    /// ends.
    pub fn flow_block(&mut self, s: SegRef) {
        if let Some(stream) = self.send_stream(s) {
            self.flow_wait.insert(stream);
            if self.flow_probe.get(&stream) == Some(&s) {
                self.flow_probe.remove(&stream);
            }
        }
    }

    /// Segment `s`, done waiting out an RNR NAK, goes back to the retransmission queue; an
    /// RNR NAK for a copy sent before now is stale (`RnrPhase::Resent`).
    fn resend_after_rnr(&mut self, s: SegRef) {
        if let Some(r) = self
            .op_mut(s.op)
            .and_then(|o| o.rnr.get_mut(s.seg as usize))
        {
            r.phase = RnrPhase::Resent;
        }
        self.on_lost(s);
    }

    /// Drop from `stream`'s parked segments those that need no sending any more: their
    /// operation finished (a NAK failed it: a length error at its receive, say) or another
    /// copy was acknowledged. Chosen as the probe, such a segment was never sent nor
    /// acknowledged, and the stream waited with no timer for good (found by `prop_rdma`
    /// `late_receives_wait_with_rnr`: a message refused for a short receive parked, then
    /// became the probe).
    fn prune_parked(&mut self, stream: u64) {
        let Some(mut parked) = self.flow_parked.remove(&stream) else {
            return;
        };
        parked.retain(|p| {
            self.op(p.op)
                .is_some_and(|o| o.status.is_none() && !o.is_acked(p.seg))
        });
        if !parked.is_empty() {
            self.flow_parked.insert(stream, parked);
        }
    }

    /// End the flow-control wait of `stream`: every parked segment is re-sent.
    fn flow_release(&mut self, stream: u64) {
        self.flow_wait.remove(&stream);
        self.scan_hint = None;
        self.flow_probe.remove(&stream);
        for p in self.flow_parked.remove(&stream).unwrap_or_default() {
            self.resend_after_rnr(p);
        }
    }

    /// Take the segment `peek` returned; returns whether it is a retransmission.
    pub fn take(&mut self, s: SegRef) -> bool {
        if self.retx.front() == Some(&s) {
            self.retx.pop_front();
            return true;
        }
        let mut started_rd = false;
        if let Some(op) = self.op_mut(s.op) {
            if op.next_seg == s.seg {
                started_rd = s.seg == 0 && op.kind.is_rd_atomic();
                op.next_seg += 1;
            }
        }
        if started_rd {
            self.rd_outstanding += 1;
        }
        false
    }

    /// Whether a segment is still worth sending (its operation is pending, it is unacked).
    pub fn is_live(&self, s: SegRef) -> bool {
        self.live(s)
    }

    /// Payload span of a segment (READ and atomic requests carry none).
    pub fn seg_span(&self, s: SegRef) -> Option<(u32, u32)> {
        self.op(s.op).map(|o| match o.kind {
            OpKind::Read { .. }
            | OpKind::Atomic { .. }
            | OpKind::AtomicResponse { .. }
            | OpKind::StreamAbort { .. }
            | OpKind::StreamFin { .. }
            | OpKind::StreamStop { .. }
            | OpKind::OpAbort { .. } => (0, 0),
            _ => seg_span(o.len, self.pmtu, s.seg),
        })
    }

    /// Set the final status of an operation (once).
    fn finish(&mut self, id: u64, status: WcStatus) {
        let Some(op) = self.op_mut(id) else { return };
        if op.status.is_some() {
            return;
        }
        op.status = Some(status);
        let flow = flow_key(&op.kind);
        let rnr_waiting = op.rnr.iter().any(|r| r.phase == RnrPhase::Waiting);
        let (rd, started, internal, response) = (
            op.kind.is_rd_atomic(),
            op.next_seg > 0,
            op.kind.is_internal(),
            op.kind.is_response(),
        );
        let send_stream = match op.kind {
            OpKind::Send { stream, .. } => Some((stream, op.len as u64)),
            _ => None,
        };
        if let OpKind::Read { wire_id, .. } | OpKind::Atomic { wire_id, .. } = op.kind {
            self.rd_ops.remove(&wire_id);
        }
        if let Some((stream, len)) = send_stream {
            if let Some(b) = self.stream_bytes.get_mut(&stream) {
                self.send_bytes -= len.min(*b);
                self.send_freed += len.min(*b);
                *b = b.saturating_sub(len);
                if *b == 0 {
                    self.stream_bytes.remove(&stream);
                }
            }
        }
        if rd && started {
            self.rd_outstanding -= 1;
        }
        if rd {
            // Fewer READs/atomics outstanding, or an unstarted one that held the scan gone.
            self.scan_hint = None;
        }
        if internal {
            self.internal_ops -= 1;
        }
        if response {
            self.internal_pending -= 1;
        }
        if let Some(key) = flow {
            // The probe's operation ended without the probe being acknowledged (a NAK
            // failed it, e.g. a length error at the receive it reached): nothing else
            // would wake the segments parked behind it. End the wait; any of them refused
            // again starts a new one. Likewise when no probe was chosen yet and this
            // operation's segments are the ones on their RNR wait: the operation may leave
            // the queue before those waits end, and then they choose no probe, and the
            // stream waited with no timer for good (found by `prop_rdma`
            // `sends_and_receives_after_rnr_retry_exceeded`: a flow-control NAK, then a
            // length-error NAK of the same message).
            let probe = self.flow_probe.get(&key).map(|p| p.op);
            let orphaned = rnr_waiting && probe.is_none() && self.flow_wait.contains(&key);
            if probe == Some(id) || orphaned {
                self.flow_release(key);
            }
        }
        if internal {
            // A FIN or stream abort is done with once acknowledged (it reports nothing).
            if let Some(stream) = self.op(id).and_then(|o| o.kind.stream_op()) {
                self.stream_op_done(stream);
            }
            if let Some(h) = self.held.remove(&id) {
                self.consider(h);
            }
        } else {
            self.consider(id);
        }
    }

    /// One SEND (reported), FIN or stream abort (finished) of `stream` less in the queue;
    /// at none, the stream's outgoing direction may be over (`retire_streams`).
    fn stream_op_done(&mut self, stream: u32) {
        if let Some(n) = self.stream_ops.get_mut(&stream) {
            *n -= 1;
            if *n == 0 {
                self.stream_ops.remove(&stream);
                self.retire_check.push(stream);
            }
        }
    }

    /// List application operation `id` in `ready` (or `blocked`) if its completion can be
    /// reported now or once earlier one-sided operations are: it finished, is not held by
    /// an op abort, and is the first unreported operation of its stream (a SEND) or of the
    /// one-sided operations. Called whenever one of those may have become true.
    fn consider(&mut self, id: u64) {
        if id == self.base_id {
            // The oldest operation queued: `pop_completion` looks at it first.
            return;
        }
        let os_front = self.os_unreported.front().copied();
        let Some(op) = self.op(id) else { return };
        if op.reported || op.listed || op.status.is_none() || op.kind.is_internal() {
            return;
        }
        if op
            .hold
            .is_some_and(|h| self.op(h).is_some_and(|a| a.status.is_none()))
        {
            return;
        }
        let blocked = match op.kind {
            OpKind::Send { stream, .. } => {
                let first = self
                    .stream_unreported
                    .get(&stream)
                    .and_then(|q| q.front().copied());
                if first != Some(id) {
                    return;
                }
                os_front.is_some_and(|f| f < id)
            }
            _ => {
                if os_front != Some(id) {
                    return;
                }
                false
            }
        };
        if let Some(op) = self.op_mut(id) {
            op.listed = true;
        }
        if blocked {
            self.blocked.push(Reverse(id));
        } else {
            self.ready.push(Reverse(id));
        }
    }

    /// A segment was acknowledged. `resp_timeout` gives how long an acknowledged READ or
    /// atomic request waits for its response before it is sent again (doubling each time);
    /// it is called only for such a request (issue #13: it walks every path).
    pub fn on_acked(
        &mut self,
        s: SegRef,
        now: Instant,
        resp_timeout: &mut impl FnMut() -> Duration,
    ) {
        let Some(op) = self.op_mut(s.op) else { return };
        if op.status.is_some() || s.seg >= op.nsegs || op.is_acked(s.seg) {
            return;
        }
        op.acked[(s.seg / 64) as usize] |= 1 << (s.seg % 64);
        op.acked_segs += 1;
        if let Some(stream) = flow_key(&op.kind) {
            if self.flow_probe.get(&stream) == Some(&s)
                || (self.flow_wait.contains(&stream) && !self.flow_probe.contains_key(&stream))
            {
                // The receiver took the probe, or a segment of the waiting stream before a
                // probe was chosen: it has room again (a segment refused again only puts
                // the stream back into the wait).
                self.flow_release(stream);
            }
        }
        let Some(op) = self.op_mut(s.op) else { return };
        if op.acked_segs == op.nsegs {
            if op.kind.is_rd_atomic() {
                // READs and atomics complete with their response, not with the request's
                // ACK; if the response never comes (the responder went away), the request
                // is sent again and, after retry_count tries, fails.
                let t = resp_timeout();
                let Some(op) = self.op_mut(s.op) else { return };
                let wait = t * (1u32 << op.resp_timeouts.min(10));
                self.resp_wait.push_back((now + wait, s, t, now));
            } else {
                self.finish(s.op, WcStatus::Success);
            }
        }
    }

    /// Queue a lost segment for retransmission. The queue is kept in posting order (oldest
    /// operation first): a receiver drops messages that are not next on their stream (stream
    /// window, receive budget) without acknowledging them, so re-sending a later message
    /// ahead of the head of its stream wastes the round and, with a small window, every
    /// round until the retry budget runs out.
    pub fn on_lost(&mut self, s: SegRef) {
        if self.live(s) {
            let i = self
                .retx
                .partition_point(|r| (r.op, r.seg) <= (s.op, s.seg));
            self.retx.insert(i, s);
        }
    }

    /// The peer had no receive for this SEND segment (the copy sent on path `path_id` with
    /// PSN `psn`): retry after `delay`, or fail with `RnrRetryExceeded` once this segment
    /// was refused `rnr_retry` + 1 times (7 = retry forever). Counted per segment: every
    /// segment of a message is refused in each round.
    ///
    /// Only a NAK that answers a copy sent after the previous RNR wait ended counts (and
    /// starts a wait): a NAK of a copy sent before it (a tail-loss probe or loss
    /// retransmission that was in flight when the previous NAK came back) is stale and
    /// ignored, so the SEND fails only after `rnr_retry` full waits, each followed by a
    /// fresh copy and its RNR NAK. While it waits, the segment is neither probed nor
    /// re-sent (`live` is false), so no copy can draw a NAK that answers nothing new.
    ///
    /// `other_copy`: another copy of the segment is still in flight (a tail-loss probe or
    /// loss retransmission sent before this NAK came back, possibly over a faster path).
    /// Then the retry budget being spent does not fail the SEND yet: that copy may find a
    /// receive and deliver the message, and a SEND must not report RnrRetryExceeded for a
    /// delivered message. Its ACK completes the SEND, its RNR NAK fails it, its loss
    /// re-sends it (loss recovery, not an RNR retry).
    #[allow(clippy::too_many_arguments)]
    pub fn on_rnr(
        &mut self,
        s: SegRef,
        path_id: u8,
        psn: u32,
        now: Instant,
        delay: Duration,
        rnr_retry: u8,
        other_copy: bool,
    ) -> bool {
        let Some(op) = self.op_mut(s.op) else {
            return false;
        };
        if op.status.is_some() {
            return false;
        }
        // A READ or atomic request is RNR-NAKed when the responder's `max_rd_atomic`
        // response resources are busy (there is no negotiation of the responder's depth):
        // that is flow control, not a missing receive, so it is retried without limit —
        // counting it against `rnr_retry` failed READs with RnrRetryExceeded, a status IBA
        // reserves for SENDs that found no receive.
        let rnr_retry = if op.kind.is_rd_atomic() { 7 } else { rnr_retry };
        if op.rnr.is_empty() {
            op.rnr = vec![
                RnrSeg {
                    count: 0,
                    phase: RnrPhase::Any,
                    copies: Vec::new(),
                };
                op.nsegs as usize
            ];
        }
        let Some(r) = op.rnr.get_mut(s.seg as usize) else {
            return false;
        };
        let fresh = match r.phase {
            RnrPhase::Any => true,
            RnrPhase::Resent => r.copies.contains(&(path_id, psn)),
            RnrPhase::Waiting => false,
        };
        if !fresh {
            // Stale: answers a copy sent before the last RNR wait began.
            return false;
        }
        r.copies.clear();
        // Only NAKs that may fail the SEND count: a flow-control RNR NAK (passed here as
        // rnr_retry 7) costs no retry, also not once the segment later meets plain ones.
        if rnr_retry != 7 {
            r.count = r.count.saturating_add(1);
        }
        if rnr_retry != 7 && r.count > rnr_retry {
            if other_copy {
                r.phase = RnrPhase::Any;
                return false;
            }
            self.finish(s.op, WcStatus::RnrRetryExceeded);
            self.fail_stream(s.op, STREAM_CODE_RNR);
            return false;
        }
        r.phase = RnrPhase::Waiting;
        self.rnr_seq += 1;
        self.rnr_wait.insert((now + delay, self.rnr_seq), s);
        true
    }

    /// When the earliest RNR wait or READ/atomic response wait ends.
    pub fn wait_deadline(&self) -> Option<Instant> {
        // (`resp_wait` holds at most `max_rd_atomic` requests.)
        self.rnr_wait
            .first_key_value()
            .map(|(&(t, _), _)| t)
            .into_iter()
            .chain(self.resp_wait.iter().map(|(t, ..)| *t))
            .min()
    }

    /// Handle the RNR and response waits that have ended: RNR-refused segments go back to the
    /// retransmission queue; unanswered READ/atomic requests are sent again, or fail with
    /// `RetryExceeded` after `retry_count` response timeouts in a row. A READ whose response
    /// is still arriving is not timed out: each new response segment restarts the wait at
    /// the base response timeout and clears the count (IBA: the requester's transport timer
    /// restarts with every valid response packet), so a response longer than the whole
    /// retry budget completes instead of being requested again and failing.
    pub fn on_wait_timer(&mut self, now: Instant, retry_count: u32) {
        let mut keep = VecDeque::new();
        while let Some((t, s, base, armed)) = self.resp_wait.pop_front() {
            if t > now {
                keep.push_back((t, s, base, armed));
                continue;
            }
            let Some(op) = self.op_mut(s.op) else {
                continue;
            };
            if op.status.is_some() {
                continue;
            }
            let progress = op
                .resp
                .as_ref()
                .and_then(|r| r.last_progress)
                .filter(|&p| p > armed && p + base > now);
            if let Some(p) = progress {
                op.resp_timeouts = 0;
                keep.push_back((p + base, s, base, p));
                continue;
            }
            op.resp_timeouts += 1;
            if op.resp_timeouts > retry_count {
                self.finish(s.op, WcStatus::RetryExceeded);
                continue;
            }
            if op.is_acked(s.seg) {
                op.acked[(s.seg / 64) as usize] &= !(1 << (s.seg % 64));
                op.acked_segs -= 1;
            }
            self.on_lost(s);
        }
        self.resp_wait = keep;
        self.on_rnr_timer(now);
    }

    /// Move segments whose RNR wait has ended to the retransmission queue.
    fn on_rnr_timer(&mut self, now: Instant) {
        while let Some((&(t, _), _)) = self.rnr_wait.first_key_value() {
            if t > now {
                break;
            }
            let Some((_, s)) = self.rnr_wait.pop_first() else {
                break;
            };
            {
                if let Some(stream) = self.send_stream(s).filter(|st| self.flow_wait.contains(st)) {
                    if self
                        .op(s.op)
                        .is_none_or(|o| o.status.is_some() || o.is_acked(s.seg))
                    {
                        // Another copy of it (a tail-loss probe or loss retransmission in
                        // flight when the NAK came) was taken while this one waited: the
                        // receiver had room. As a probe it would never be sent (it is
                        // acknowledged) nor acknowledged again, and the stream would wait
                        // forever: end the wait instead.
                        self.flow_release(stream);
                        continue;
                    }
                    if self.flow_probe.get(&stream) == Some(&s) {
                        // The probe itself, back from an RNR wait (the receiver refused it
                        // again, e.g. with a plain RNR NAK: no receive posted yet). It
                        // stays the probe and is sent again (parking it too would leave
                        // the stream with nothing to wake it: a stall) — unless a segment
                        // of an earlier message parked while it waited. The receiver
                        // admits a stream's messages in order (the next one due first;
                        // with posted receives, message k takes receive k), so the earlier
                        // one probes instead: behind a later probe refused until its own
                        // receive is posted, a message whose receive is there waited for
                        // that receive too, and failed with the stream if the later one
                        // ran out of RNR retries.
                        let mut probe = s;
                        self.prune_parked(stream);
                        if let Some(parked) = self.flow_parked.get_mut(&stream) {
                            let earlier = earliest(parked)
                                .filter(|&k| (parked[k].op, parked[k].seg) < (s.op, s.seg));
                            if let Some(k) = earlier {
                                probe = parked.swap_remove(k);
                                parked.push(s);
                                self.flow_probe.insert(stream, probe);
                            }
                        }
                        self.resend_after_rnr(probe);
                        continue;
                    }
                    // Park it; unless another segment of the stream already probes, the
                    // earliest parked segment (of the earliest refused message, the one the
                    // receiver admits first) becomes the probe.
                    self.prune_parked(stream);
                    let parked = self.flow_parked.entry(stream).or_default();
                    parked.push(s);
                    if self.flow_probe.contains_key(&stream) {
                        continue;
                    }
                    let Some(k) = earliest(parked) else {
                        continue;
                    };
                    let probe = parked.swap_remove(k);
                    self.flow_probe.insert(stream, probe);
                    self.resend_after_rnr(probe);
                    continue;
                }
                self.resend_after_rnr(s);
            }
        }
    }

    /// A READ response packet that arrived at `now`: place it in the requester's buffer.
    /// A new segment is progress of the READ (restarts its response wait).
    pub fn on_read_response(
        &mut self,
        now: Instant,
        wire_id: u32,
        offset: u32,
        payload: &[u8],
        mrs: &mut MrTable,
    ) -> RespOutcome {
        let pmtu = self.pmtu;
        let Some(&id) = self.rd_ops.get(&wire_id) else {
            // Already complete (a response re-sent after crossing its ACK): acknowledge.
            return RespOutcome::Accepted;
        };
        let Some(op) = self.op_mut(id) else {
            return RespOutcome::Accepted;
        };
        let OpKind::Read {
            lkey, local_offset, ..
        } = op.kind
        else {
            return RespOutcome::Invalid;
        };
        if op.next_seg == 0 {
            // The request was never sent: nothing can answer it yet.
            return RespOutcome::Invalid;
        }
        let Some(resp) = op.resp.as_mut() else {
            return RespOutcome::Invalid;
        };
        if !super::recv::check_segment(offset, payload.len(), op.len as u64, pmtu) {
            return RespOutcome::Invalid;
        }
        let seg = seg_of(offset, pmtu);
        let (w, b) = ((seg / 64) as usize, seg % 64);
        if resp.got[w] >> b & 1 == 1 {
            return RespOutcome::Accepted;
        }
        resp.got[w] |= 1 << b;
        resp.got_segs += 1;
        resp.last_progress = Some(now);
        let done = resp.got_segs == resp.nsegs;
        if !payload.is_empty() {
            match mrs.local_write(lkey, local_offset + offset as u64, payload) {
                Ok(()) => {}
                Err(_) => {
                    self.finish(id, WcStatus::LocalProtectionError);
                    return RespOutcome::Accepted;
                }
            }
        }
        if done {
            self.finish(id, WcStatus::Success);
        }
        RespOutcome::Accepted
    }

    /// An atomic response: store the original value (8 bytes, little-endian) and complete.
    pub fn on_atomic_response(
        &mut self,
        wire_id: u32,
        orig: u64,
        mrs: &mut MrTable,
    ) -> RespOutcome {
        let Some(&id) = self.rd_ops.get(&wire_id) else {
            return RespOutcome::Accepted;
        };
        let Some(op) = self.op(id) else {
            return RespOutcome::Accepted;
        };
        let OpKind::Atomic {
            lkey, local_offset, ..
        } = op.kind
        else {
            return RespOutcome::Invalid;
        };
        if op.next_seg == 0 {
            // The request was never sent: nothing can answer it yet.
            return RespOutcome::Invalid;
        }
        let status = match mrs.local_write(lkey, local_offset, &orig.to_le_bytes()) {
            Ok(()) => WcStatus::Success,
            Err(_) => WcStatus::LocalProtectionError,
        };
        self.finish(id, status);
        RespOutcome::Accepted
    }

    /// The SEND `id` failed with `RnrRetryExceeded`: its stream enters the error state
    /// (RoCEv2 reference §6.3: an RNR retry error moves the QP to the error state; here the stream is
    /// the ordered unit, like a QP's send queue, and the connection's other streams and
    /// operations go on). Every later SEND on the stream completes with `WrFlushError` —
    /// also one already acknowledged and not yet reported: it waits at the receiver behind
    /// a message that never comes, so it is never delivered — and an `MR_SEND` with the
    /// stream-abort flag tells the receiver to drop the stream from this message on and to
    /// flush its receives there.
    ///
    /// `code` is the abort's: [`STREAM_CODE_RNR`] or [`STREAM_CODE_REFUSED`].
    fn fail_stream(&mut self, id: u64, code: u32) {
        let Some(op) = self.op(id) else { return };
        let OpKind::Send {
            stream, msg_seq, ..
        } = op.kind
        else {
            return;
        };
        let start = (id - self.base_id) as usize + 1;
        for i in start..self.ops.len() {
            let later = matches!(self.ops[i].kind, OpKind::Send { stream: s, .. } if s == stream);
            if !later {
                continue;
            }
            if self.ops[i].status.is_none() {
                self.finish(self.base_id + i as u64, WcStatus::WrFlushError);
            } else if !self.ops[i].reported {
                self.ops[i].status = Some(WcStatus::WrFlushError);
            }
        }
        let first = self.dead_streams.entry(stream).or_insert(msg_seq);
        if msg_seq.wrapping_sub(*first) as i32 <= 0 {
            *first = msg_seq;
            self.push(
                0,
                OpKind::StreamAbort {
                    stream,
                    msg_seq,
                    code,
                },
                0,
            );
        }
    }

    /// The peer refused the stream of SEND `id`: its stream table was full (NAK 0x61 with
    /// `NakEth::FLAG_STREAM_REFUSED`) and it keeps nothing of the stream. The SEND fails
    /// with `RemoteInvalidRequest`, and the stream enters the error state as for an RNR
    /// failure (`fail_stream`): later SENDs on it are flushed, and a stream abort from this
    /// message (code [`STREAM_CODE_REFUSED`]) lets the peer record the id as closed — a
    /// refused stream otherwise stays a gap among the peer's closed ids, and enough gaps
    /// wedge the connection (`closed_id_ranges`). `other_copy`: another copy of the refused
    /// segment is still in flight and may find room; that copy decides (nothing happens
    /// now). For an operation that is not a SEND, or already finished, it is a plain NAK
    /// 0x61 (`fail`). Returns the stream and the SEND's `wr_id` when this NAK failed the
    /// SEND for the refusal (once per SEND).
    pub fn on_stream_refused(&mut self, id: u64, other_copy: bool) -> Option<(u32, u64)> {
        let op = self.op(id)?;
        let stream = match op.kind {
            OpKind::Send { stream, .. } if op.status.is_none() => stream,
            _ => {
                self.finish(id, WcStatus::RemoteInvalidRequest);
                return None;
            }
        };
        if other_copy {
            return None;
        }
        let wr_id = op.wr_id;
        self.finish(id, WcStatus::RemoteInvalidRequest);
        self.fail_stream(id, STREAM_CODE_REFUSED);
        Some((stream, wr_id))
    }

    /// How this side ended `stream` as its sender, if it did (and its state is kept:
    /// see [`is_retired`](Self::is_retired)).
    pub fn stream_end(&self, stream: u32) -> Option<StreamEnd> {
        self.ended_streams.get(&stream).copied()
    }

    /// Whether `stream`'s outgoing direction ended and was forgotten (`retire_streams`).
    pub fn is_retired(&self, stream: u32) -> bool {
        self.retired.contains(stream)
    }

    /// Forget the outgoing direction of every stream that is over since the last call:
    /// this side finished or reset it, and every SEND, FIN and abort of it completed (the
    /// FIN and aborts acknowledged: the peer has its end, or the stream died at the peer)
    /// and was reported (a SEND leaves `stream_ops` when its completion is popped, so the
    /// caller reports the stream closed after the last of those completions; found by
    /// review: it was reported closed while a SEND's completion still waited behind an
    /// earlier operation). Its id joins `retired` unless that would add a range beyond
    /// `max_ranges`: the stream is then kept (`kept`) and looked at again once a neighbour
    /// id retires or the ranges fall below the bound. Calls `f` with each stream retired.
    /// Later posts on a retired stream are refused (`PostError::StreamClosed`), and a STOP
    /// or reset for it is a no-op. See `RecvState::try_retire` for the incoming direction.
    pub fn retire_streams(&mut self, max_ranges: usize, mut f: impl FnMut(u32)) {
        // (Below the bound, a stream kept at it fits now.)
        while let Some(stream) = self.retire_check.pop().or_else(|| {
            (self.retired.ranges() < max_ranges)
                .then(|| self.kept.pop_first())
                .flatten()
        }) {
            // Every SEND of it was reported and every FIN and abort acknowledged, so
            // `Event::StreamClosed` follows the last of their completions.
            let over = self.ended_streams.contains_key(&stream)
                && !self.stream_ops.contains_key(&stream)
                && !self.stream_bytes.contains_key(&stream);
            if !over || self.retired.contains(stream) {
                continue;
            }
            if self.retired.would_grow(stream) && self.retired.ranges() >= max_ranges {
                self.kept.insert(stream);
                continue;
            }
            self.kept.remove(&stream);
            for n in [stream.checked_sub(2), stream.checked_add(2)]
                .into_iter()
                .flatten()
            {
                if self.kept.remove(&n) {
                    self.retire_check.push(n);
                }
            }
            self.ended_streams.remove(&stream);
            self.stream_seq.remove(&stream);
            self.dead_streams.remove(&stream);
            if let Some(q) = self.stream_unreported.remove(&stream) {
                debug_assert!(q.is_empty());
                if self.spare_queues.len() < SPARE_QUEUES {
                    self.spare_queues.push(q);
                }
            }
            let key = u64::from(stream);
            self.flow_wait.remove(&key);
            self.flow_probe.remove(&key);
            self.flow_parked.remove(&key);
            self.retired.insert(stream);
            f(stream);
        }
    }

    /// Forget that this side stopped `stream` (its incoming direction was retired).
    pub fn forget_stop(&mut self, stream: u32) {
        self.stopped_streams.remove(&stream);
    }

    /// Ranges of retired stream ids held.
    pub fn retired_ranges(&self) -> usize {
        self.retired.ranges()
    }

    /// Whether this side has sent (or posted) SENDs on `stream`.
    pub fn knows_stream(&self, stream: u32) -> bool {
        self.stream_seq.contains_key(&stream)
    }

    /// An upper bound of the streams this side keeps state for (sent on, or ended).
    pub fn tracked_streams(&self) -> usize {
        self.stream_seq.len() + self.ended_streams.len()
    }

    /// Bytes of SENDs posted on `stream` and not yet completed.
    pub fn stream_pending(&self, stream: u32) -> u64 {
        self.stream_bytes.get(&stream).copied().unwrap_or(0)
    }

    /// Bytes of SENDs posted on every stream and not yet completed.
    pub fn send_pending(&self) -> u64 {
        self.send_bytes
    }

    /// Bytes of SENDs finished so far, a running total.
    pub fn send_freed(&self) -> u64 {
        self.send_freed
    }

    /// End `stream` after every SEND posted on it so far (a FIN the peer reports after
    /// the stream's last message). `false` if the stream was already finished or reset.
    pub fn finish_stream(&mut self, stream: u32) -> bool {
        if self.ended_streams.contains_key(&stream) || self.retired.contains(stream) {
            return false;
        }
        let msg_seq = self.stream_seq.get(&stream).copied().unwrap_or(0);
        self.ended_streams.insert(stream, StreamEnd::Finished);
        self.push(0, OpKind::StreamFin { stream, msg_seq }, 0);
        true
    }

    /// Reset `stream` with `code`: every SEND on it not yet completed completes with
    /// `WrFlushError` (also one acknowledged behind an unacknowledged one: the receiver
    /// drops the stream from the first unacknowledged message on), and a stream abort
    /// carrying `code` tells the receiver. Idempotent: a stream already reset is left
    /// alone (`false`).
    pub fn reset_stream(&mut self, stream: u32, code: u32) -> bool {
        self.reset_stream_after(stream, code, None)
    }

    /// [`Self::reset_stream`] for a STOP from the peer whose delivery on the stream ended
    /// at message `delivered` (message sequence numbers, wrapping): every message before
    /// it was delivered or refused there and is left to complete from its own
    /// acknowledgement or NAK (a STOP never completes anything `Success`, so a forged or
    /// confused one cannot make up a delivery), and nothing from it on will be delivered:
    /// those SENDs are flushed (`WrFlushError`, also one whose acknowledgements all came
    /// before it was due to be reported) and the stream abort names `delivered` (or the
    /// stream's next message, if the STOP names one not sent yet) as the first dead message.
    /// `None`: the reset starts at the first message not completed.
    pub fn reset_stream_after(&mut self, stream: u32, code: u32, delivered: Option<u32>) -> bool {
        if self.ended_streams.get(&stream) == Some(&StreamEnd::Reset)
            || self.retired.contains(stream)
        {
            return false;
        }
        self.ended_streams.insert(stream, StreamEnd::Reset);
        self.flow_release(stream as u64);
        let next = self.stream_seq.get(&stream).copied().unwrap_or(0);
        // A STOP naming a message not sent yet: nothing sent is cut.
        let stop_at = delivered.map(|d| {
            if (next.wrapping_sub(d) as i32) < 0 {
                next
            } else {
                d
            }
        });
        let mut first = stop_at;
        // A stream never sent on has no SEND in the queue: no walk (a peer's STOPs for
        // such streams cost O(1) each, not a walk of the whole queue; found by review).
        let sent_on = self.stream_seq.contains_key(&stream);
        for i in 0..if sent_on { self.ops.len() } else { 0 } {
            let OpKind::Send {
                stream: s, msg_seq, ..
            } = self.ops[i].kind
            else {
                continue;
            };
            if s != stream {
                continue;
            }
            if let Some(d) = stop_at {
                if (msg_seq.wrapping_sub(d) as i32) < 0 {
                    // Delivered or refused at the peer: its own ACK or NAK decides.
                    continue;
                }
                match self.ops[i].status {
                    None => self.finish(self.base_id + i as u64, WcStatus::WrFlushError),
                    Some(WcStatus::Success) if !self.ops[i].reported => {
                        self.ops[i].status = Some(WcStatus::WrFlushError);
                    }
                    Some(_) => {}
                }
                continue;
            }
            if first.is_none() && self.ops[i].status.is_none() {
                first = Some(msg_seq);
            }
            if first.is_some() {
                if self.ops[i].status.is_none() {
                    self.finish(self.base_id + i as u64, WcStatus::WrFlushError);
                } else if !self.ops[i].reported {
                    self.ops[i].status = Some(WcStatus::WrFlushError);
                }
            }
        }
        let msg_seq = first.unwrap_or(next);
        self.dead_streams.entry(stream).or_insert(msg_seq);
        self.push(
            0,
            OpKind::StreamAbort {
                stream,
                msg_seq,
                code,
            },
            0,
        );
        true
    }

    /// Ask the peer to stop sending on `stream` with `code` (once per stream): this side's
    /// delivery on it ended at message `delivered` (`RecvState::stop`). With `remember`
    /// false (the receiver kept no state for the stream) the STOP is queued without being
    /// recorded: `forget_stop` would never remove such a record.
    pub fn stop_stream(&mut self, stream: u32, code: u32, delivered: u32, remember: bool) -> bool {
        if remember && !self.stopped_streams.insert(stream) {
            return false;
        }
        self.push(
            0,
            OpKind::StreamStop {
                stream,
                code,
                delivered,
            },
            0,
        );
        true
    }

    /// Fail one operation (NAK from the responder, or a local error).
    pub fn fail(&mut self, op: u64, status: WcStatus) {
        self.finish(op, status);
    }

    /// Fail operation `id` with a local error found while sending it (its source region
    /// went away). A WRITE sends no more packets, so the responder would wait for the rest
    /// of its op id forever and its floor of finished op ids would stop moving (after
    /// `max_tracked_ops` more operations it would take no new ones): an op abort tells it to
    /// count the op id as finished. READ and atomic requests carry no local data, so they
    /// never fail here.
    pub fn fail_local(&mut self, id: u64, status: WcStatus) {
        let Some(op) = self.op(id) else { return };
        let abort = match op.kind {
            OpKind::Write { wire_id, .. } if op.status.is_none() => Some(wire_id),
            _ => None,
        };
        self.finish(id, status);
        if let Some(wire_id) = abort {
            self.push(0, OpKind::OpAbort { wire_id }, 0);
        }
    }

    /// Fail everything pending: the first pending operation gets `first`, the rest are
    /// flushed (IBA: the WQE that hit the error, then `WR_FLUSH_ERR` for the others) —
    /// including operations behind it that were acknowledged but not yet reported: a SEND
    /// acknowledged behind a message that never completes is never delivered.
    pub fn fail_all(&mut self, first: WcStatus) {
        let mut status = first;
        let mut failed = false;
        for i in 0..self.ops.len() {
            let internal = self.ops[i].kind.is_internal();
            if self.ops[i].status.is_none() {
                self.finish(self.base_id + i as u64, status);
                if !internal {
                    status = WcStatus::WrFlushError;
                    failed = true;
                }
            } else if failed && !internal && !self.ops[i].reported {
                self.ops[i].status = Some(WcStatus::WrFlushError);
            }
        }
        self.retx.clear();
        self.rnr_wait.clear();
        self.resp_wait.clear();
        self.flow_wait.clear();
        self.flow_probe.clear();
        self.flow_parked.clear();
        self.scan_hint = None;
    }

    /// Cancel the application operation `wr_id` (the oldest pending one with that id).
    ///
    /// A WRITE, READ or atomic that has not finished stops at once: nothing more of it is
    /// sent, and an op abort (`MR_WRITE` with the op-abort flag, docs/PROTOCOL.md "Errors
    /// of one operation") tells the responder to count its op id as finished, so its
    /// tracking never waits for packets that will not come and a request still in flight
    /// is not executed when it arrives after the abort. A READ's or atomic's later
    /// responses are acknowledged and not placed (the local destination is never written
    /// again). The operation completes with `WrFlushError`, in its order, once the
    /// abort is acknowledged: from then on no byte of a cancelled WRITE lands at the peer
    /// (bytes that landed before stay) and a cancelled READ or atomic either was executed
    /// before the abort or never will be. SENDs cannot be cancelled (their message sequence
    /// numbers order the stream).
    pub fn cancel(&mut self, wr_id: u64) -> Option<crate::endpoint::CancelOutcome> {
        use crate::endpoint::CancelOutcome;
        let app = |o: &Op| !o.kind.is_internal() && !o.reported && o.wr_id == wr_id;
        // The operations with this id: a run found by binary search while the application
        // posted ids in nondecreasing order (metaroce-tokio does), else the whole queue.
        // One by one, n cancels then cost O(n log queue), not O(n · queue).
        let (lo, hi) = if self.wr_ids_unsorted {
            (0, self.ops.len())
        } else {
            let lo = self.ops.partition_point(|o| o.wr_id < wr_id);
            (lo, self.ops.partition_point(|o| o.wr_id <= wr_id))
        };
        let run = || self.ops.range(lo..hi);
        let i = lo
            + run()
                .position(|o| app(o) && o.status.is_none())
                .or_else(|| run().position(app))?;
        let op = &self.ops[i];
        if op.status.is_some() {
            return Some(CancelOutcome::Finishing);
        }
        Some(match self.cancel_at(i) {
            true => CancelOutcome::Cancelled,
            false => CancelOutcome::NotCancellable,
        })
    }

    /// Cancels every unfinished application WRITE, READ or atomic whose `wr_id` is in
    /// `wr_ids` (all of them where an id repeats), in one pass; how many were cancelled.
    pub fn cancel_many(&mut self, wr_ids: &[u64]) -> usize {
        let mut ids = wr_ids.to_vec();
        ids.sort_unstable();
        let mut n = 0;
        // The aborts are queued behind: the operations before them keep their places.
        for i in 0..self.ops.len() {
            let o = &self.ops[i];
            if o.kind.is_internal() || o.status.is_some() || ids.binary_search(&o.wr_id).is_err() {
                // (A reported operation has its status.)
                continue;
            }
            n += usize::from(self.cancel_at(i));
        }
        n
    }

    /// Cancels the unfinished operation at index `i` if it is a WRITE, READ or atomic:
    /// it completes `WrFlushError` once an op abort queued behind it is acknowledged.
    fn cancel_at(&mut self, i: usize) -> bool {
        let wire_id = match self.ops[i].kind {
            OpKind::Write { wire_id, .. }
            | OpKind::Read { wire_id, .. }
            | OpKind::Atomic { wire_id, .. } => wire_id,
            _ => return false,
        };
        let id = self.base_id + i as u64;
        // Held before it finishes: its completion waits for the abort's acknowledgement.
        let abort = self.base_id + self.ops.len() as u64;
        self.push(0, OpKind::OpAbort { wire_id }, 0);
        self.ops[i].hold = Some(abort);
        self.held.insert(abort, id);
        self.finish(id, WcStatus::WrFlushError);
        true
    }

    /// Pop the next completion that is due. Completions are reported in posting order
    /// **per stream** (a stream's SENDs), and in posting order among the one-sided
    /// operations (WRITEs, READs, atomics); a SEND is reported only after every one-sided
    /// operation posted before it. Streams do not wait for one another: a SEND the peer
    /// holds back (a stream it does not read, an RNR wait) delays only its own stream's
    /// later completions. (Before, completions came in posting order across the whole
    /// connection, so one such stream held back every other stream's completions: a
    /// service's `send().await` on an unrelated stream hung; found by a probe of the async
    /// API.) Of several due, the oldest comes first. Internal operations report none.
    pub fn pop_completion(&mut self) -> Option<WorkCompletion> {
        loop {
            self.pop_front_done();
            // The oldest operation queued is reported as soon as it is due (it is the first
            // of its stream and of the one-sided operations): the common case, without the
            // heap. Later ones come through `ready`.
            let id = match self.ops.front() {
                Some(o) if self.due(o) => self.base_id,
                _ => self.ready.pop()?.0,
            };
            let Some(op) = self.op_mut(id) else { continue };
            let Some(status) = op.status.filter(|_| !op.reported) else {
                continue;
            };
            op.reported = true;
            let wc = WorkCompletion {
                wr_id: op.wr_id,
                status,
                opcode: op.opcode(),
                byte_len: op.len,
            };
            // A reported SEND may stay queued a while (behind an older unfinished
            // operation): its message bytes go now.
            let stream = match &mut op.kind {
                OpKind::Send { stream, data, .. } => {
                    *data = Bytes::new();
                    Some(*stream)
                }
                _ => None,
            };
            self.app_ops -= 1;
            // (First, so that an operation now at the front is left to the fast path.)
            self.pop_front_done();
            match stream {
                Some(stream) => {
                    let next = self.stream_unreported.get_mut(&stream).and_then(|q| {
                        debug_assert_eq!(q.front(), Some(&id));
                        q.pop_front();
                        q.front().copied()
                    });
                    self.stream_op_done(stream);
                    if let Some(n) = next {
                        self.consider(n);
                    }
                }
                None => {
                    debug_assert_eq!(self.os_unreported.front(), Some(&id));
                    self.os_unreported.pop_front();
                    let front = self.os_unreported.front().copied();
                    // SENDs that waited for this one-sided operation.
                    while let Some(&Reverse(b)) = self.blocked.peek() {
                        if front.is_some_and(|f| f < b) {
                            break;
                        }
                        self.blocked.pop();
                        self.ready.push(Reverse(b));
                    }
                    if let Some(f) = front {
                        self.consider(f);
                    }
                }
            }
            return Some(wc);
        }
    }

    /// Whether application operation `o` is finished, not reported and not held by an op
    /// abort still unacknowledged.
    fn due(&self, o: &Op) -> bool {
        !o.reported
            && o.status.is_some()
            && !o.kind.is_internal()
            && o.hold
                .is_none_or(|h| self.op(h).is_none_or(|a| a.status.is_some()))
    }

    /// Drop the operations at the front that are over: reported, or internal and
    /// finished (acknowledged).
    fn pop_front_done(&mut self) {
        while self
            .ops
            .front()
            .is_some_and(|o| o.reported || o.kind.is_internal() && o.status.is_some())
        {
            self.ops.pop_front();
            self.base_id += 1;
            self.cursor = self.cursor.saturating_sub(1);
        }
    }

    /// Whether a completion is due and not yet popped (an operation flushed when it was
    /// posted, with nothing pending before it).
    pub fn completion_ready(&self) -> bool {
        !self.ready.is_empty() || self.ops.front().is_some_and(|o| self.due(o))
    }

    /// Whether anything is posted and not yet completed.
    pub fn has_pending(&self) -> bool {
        self.ops.iter().any(|o| o.status.is_none())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One step of the model below.
    #[derive(Debug, Clone)]
    enum Step {
        /// Post a WRITE (`true`) or a SEND with the id `gap` above the last one.
        Post(u64, bool),
        /// Queue a READ response (an internal operation).
        Response,
        /// Finish the operation at this index (modulo the queue's length).
        Finish(usize),
        /// Cancel this id.
        Cancel(u64),
        /// Pop the completions that are due.
        Pop,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0u64..3, any::<bool>()).prop_map(|(g, w)| Step::Post(g, w)),
            1 => Just(Step::Response),
            2 => (0usize..64).prop_map(Step::Finish),
            3 => (0u64..40).prop_map(Step::Cancel),
            1 => Just(Step::Pop),
        ]
    }

    /// Ten thousand SENDs wait behind a stream in a flow-control wait, and the peer READs
    /// from us: each READ response packet is found by `peek` past the blocked cursor. The
    /// scan resumes where it stopped, so the queue is walked about once, not once per
    /// packet (2,000 packets walked 20 million operations before `ScanHint`).
    #[test]
    fn peek_past_a_flow_blocked_stream_walks_the_queue_once() {
        let mut q = SendQueue::new(1024, 4);
        for i in 0..10_000 {
            q.post_send(i, 1, Bytes::from_static(b"held"));
        }
        let first = q.peek().unwrap();
        q.take(first);
        q.flow_block(first);
        assert_eq!(q.peek(), None, "the stream waits; nothing else is queued");
        for r in 0..500 {
            q.post_read_response_mr(r, (1, 1), 0, 4096);
        }
        let mut sent = 0;
        while let Some(s) = q.peek() {
            assert!(
                q.op(s.op).unwrap().kind.is_internal(),
                "only responses go out"
            );
            q.take(s);
            sent += 1;
        }
        assert_eq!(sent, 2_000, "four segments of each of the 500 responses");
        assert!(
            q.scanned < 3 * 12_000,
            "peek looked at {} operations for {sent} packets",
            q.scanned
        );
    }

    /// One step of the `peek` model below.
    #[derive(Debug, Clone)]
    enum PeekStep {
        /// A SEND on stream 0 or 1.
        Send(bool),
        /// A READ (held by `max_rd_atomic` 2 once two are outstanding).
        Read,
        /// A READ response (internal).
        Response,
        /// Take what `peek` offers.
        Take,
        /// The peer refuses the newest taken SEND of stream 0 or 1 (flow-control wait).
        Block(bool),
        /// The wait of stream 0 or 1 ends.
        Release(bool),
        /// The operation at this index (modulo the length) finishes.
        Finish(usize),
        /// Pop due completions.
        Pop,
    }

    fn peek_step() -> impl Strategy<Value = PeekStep> {
        prop_oneof![
            3 => any::<bool>().prop_map(PeekStep::Send),
            1 => Just(PeekStep::Read),
            1 => Just(PeekStep::Response),
            4 => Just(PeekStep::Take),
            1 => any::<bool>().prop_map(PeekStep::Block),
            1 => any::<bool>().prop_map(PeekStep::Release),
            2 => (0usize..64).prop_map(PeekStep::Finish),
            1 => Just(PeekStep::Pop),
        ]
    }

    proptest! {
        /// `peek` resuming its scan where it stopped (`ScanHint`) offers what a scan from
        /// the cursor offers, after every step.
        #[test]
        fn peek_with_the_scan_hint_agrees_with_a_full_scan(
            steps in proptest::collection::vec(peek_step(), 1..150)
        ) {
            let read = crate::endpoint::ReadRequest {
                wr_id: 0,
                lkey: 1,
                local_offset: 0,
                len: 2048,
                remote_addr: 0,
                rkey: 2,
            };
            let mut q = [SendQueue::new(1024, 2), SendQueue::new(1024, 2)];
            let mut taken: [Option<SegRef>; 2] = [None; 2];
            for st in steps {
                let mut out = Vec::new();
                for (k, q) in q.iter_mut().enumerate() {
                    if k == 1 {
                        q.scan_hint = None;
                    }
                    match st {
                        PeekStep::Send(one) => {
                            q.post_send(7, u32::from(one), Bytes::from(vec![1u8; 1500]))
                        }
                        PeekStep::Read => q.post_read(&read),
                        PeekStep::Response => q.post_read_response_mr(3, (1, 1), 0, 2000),
                        PeekStep::Take => {
                            if let Some(s) = q.peek() {
                                q.take(s);
                                if let Some(stream) = q.send_stream(s) {
                                    if k == 0 {
                                        taken[stream as usize] = Some(s);
                                    }
                                }
                            }
                        }
                        PeekStep::Block(one) => {
                            if let Some(s) = taken[usize::from(one)] {
                                q.flow_block(s);
                            }
                        }
                        PeekStep::Release(one) => q.flow_release(u64::from(one)),
                        PeekStep::Finish(i) if !q.ops.is_empty() => {
                            let id = q.base_id + (i % q.ops.len()) as u64;
                            q.finish(id, WcStatus::Success);
                        }
                        PeekStep::Finish(_) => {}
                        PeekStep::Pop => while q.pop_completion().is_some() {},
                    }
                    if k == 1 {
                        q.scan_hint = None;
                    }
                    out.push(q.peek());
                }
                prop_assert_eq!(out[0], out[1], "after {:?}", st);
            }
        }

        /// `cancel`'s binary search (ids posted in nondecreasing order, repeats and
        /// internal operations between them) gives what the whole-queue search gives, on
        /// every call, and leaves the same queue.
        #[test]
        fn cancel_by_binary_search_agrees_with_the_linear_search(
            steps in proptest::collection::vec(step(), 1..120)
        ) {
            let req = |wr_id| crate::endpoint::WriteRequest {
                wr_id,
                lkey: 1,
                local_offset: 0,
                len: 3000,
                remote_addr: 0,
                rkey: 2,
                imm: None,
            };
            let mut q = [SendQueue::new(1024, 4), SendQueue::new(1024, 4)];
            q[1].wr_ids_unsorted = true;
            let mut next = 0u64;
            for st in steps {
                let mut out = Vec::new();
                for q in &mut q {
                    match st {
                        Step::Post(g, write) => {
                            let id = next + g;
                            if write {
                                q.post_write(&req(id));
                            } else {
                                q.post_send(id, 0, Bytes::from_static(b"x"));
                            }
                        }
                        Step::Response => q.post_read_response_mr(7, (1, 1), 0, 1),
                        Step::Finish(i) if !q.ops.is_empty() => {
                            let id = q.base_id + (i % q.ops.len()) as u64;
                            q.finish(id, WcStatus::Success);
                        }
                        Step::Finish(_) => {}
                        Step::Cancel(w) => out.push(format!("{:?}", q.cancel(w))),
                        Step::Pop => {
                            while let Some(wc) = q.pop_completion() {
                                out.push(format!("{wc:?}"));
                            }
                        }
                    }
                    out.push(format!(
                        "{:?}",
                        q.ops.iter().map(|o| (o.wr_id, o.status, o.hold)).collect::<Vec<_>>()
                    ));
                }
                if let Step::Post(g, _) = st {
                    next += g;
                }
                prop_assert!(!q[0].wr_ids_unsorted);
                prop_assert_eq!(&out[..out.len() / 2], &out[out.len() / 2..]);
            }
        }
    }

    #[test]
    fn path_mtus_are_iba_values_and_segments_are_counted_by_shift() {
        for (asked, used) in [
            (0, 256),
            (255, 256),
            (256, 256),
            (300, 256),
            (1000, 512),
            (1024, 1024),
            (4095, 2048),
            (4096, 4096),
            (9000, 4096),
            (u32::MAX, 4096),
        ] {
            assert_eq!(valid_pmtu(asked), used, "asked {asked}");
        }
        for pmtu in [256, 512, 1024, 2048, 4096] {
            for len in [0, 1, pmtu - 1, pmtu, pmtu + 1, 3 * pmtu, u32::MAX] {
                assert_eq!(
                    segs_of(len, pmtu),
                    len.div_ceil(pmtu),
                    "len {len} pmtu {pmtu}"
                );
                assert_eq!(seg_of(len, pmtu), len / pmtu, "offset {len} pmtu {pmtu}");
            }
        }
    }
}

/// Model of the per-stream completion order (`pop_completion`): random posts, finishes,
/// cancels, resets, STOPs, refusals, a final `fail_all`; after every drain the reported
/// completions obey the order rule, nothing due is left unreported, a cancelled
/// operation waits for its op abort, a retired stream has nothing unreported, and at the
/// end every application operation was reported exactly once.
#[cfg(test)]
mod completion_order_model {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum MStep {
        Send(u32),
        Write,
        Read,
        Response,
        Fin(u32),
        Reset(u32),
        Stop(u32, u32),
        Refuse(usize),
        Finish(usize, bool),
        Cancel(usize),
        Pop,
        Retire,
    }

    fn mstep() -> impl Strategy<Value = MStep> {
        prop_oneof![
            4 => (0u32..3).prop_map(MStep::Send),
            2 => Just(MStep::Write),
            1 => Just(MStep::Read),
            1 => Just(MStep::Response),
            1 => (0u32..3).prop_map(MStep::Fin),
            1 => (0u32..3).prop_map(MStep::Reset),
            1 => ((0u32..3), (0u32..5)).prop_map(|(s, d)| MStep::Stop(s, d)),
            1 => (0usize..64).prop_map(MStep::Refuse),
            6 => ((0usize..64), any::<bool>()).prop_map(|(i, ok)| MStep::Finish(i, ok)),
            1 => (0usize..64).prop_map(MStep::Cancel),
            3 => Just(MStep::Pop),
            1 => Just(MStep::Retire),
        ]
    }

    #[derive(Debug, Clone)]
    struct MOp {
        id: u64,
        stream: Option<u32>,
        hold: Option<u64>,
        reported: Option<WcStatus>,
    }

    fn due_unreported(q: &SendQueue, m: &[MOp]) -> Option<u64> {
        for (k, o) in m.iter().enumerate() {
            if o.reported.is_some() {
                continue;
            }
            let Some(op) = q.op(o.id) else { continue };
            if op.status.is_none() {
                continue;
            }
            if o.hold
                .is_some_and(|h| q.op(h).is_some_and(|a| a.status.is_none()))
            {
                continue;
            }
            let blocked = m[..k]
                .iter()
                .any(|e| e.reported.is_none() && (e.stream.is_none() || e.stream == o.stream));
            if !blocked {
                return Some(o.id);
            }
        }
        None
    }

    fn drain(q: &mut SendQueue, m: &mut [MOp]) -> Result<(), TestCaseError> {
        while let Some(wc) = q.pop_completion() {
            let k = wc.wr_id as usize;
            prop_assert!(m[k].reported.is_none(), "reported twice: {:?}", wc);
            let o = m[k].clone();
            for e in &m[..k] {
                if e.stream.is_none() || e.stream == o.stream {
                    prop_assert!(e.reported.is_some(), "{:?} reported before {:?}", o, e);
                }
            }
            if let Some(h) = o.hold {
                prop_assert!(
                    q.op(h).is_none_or(|a| a.status.is_some()),
                    "cancelled {:?} reported before its abort was acknowledged",
                    o
                );
            }
            m[k].reported = Some(wc.status);
        }
        prop_assert_eq!(due_unreported(q, m), None, "due but not reported");
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn completions_follow_the_per_stream_rule(
            steps in proptest::collection::vec(mstep(), 1..80)
        ) {
            let mut q = SendQueue::new(1024, 4);
            let mut m: Vec<MOp> = Vec::new();
            let mut retired: Vec<u32> = Vec::new();
            for st in steps {
                let next = q.base_id + q.ops.len() as u64;
                let wr = m.len() as u64;
                match st {
                    MStep::Send(s) => {
                        if retired.contains(&s) { continue; }
                        q.post_send(wr, s, Bytes::from_static(b"x"));
                        m.push(MOp { id: next, stream: Some(s), hold: None, reported: None });
                    }
                    MStep::Write => {
                        q.post_write(&crate::endpoint::WriteRequest {
                            wr_id: wr, lkey: 1, local_offset: 0, len: 3000,
                            remote_addr: 0, rkey: 2, imm: None,
                        });
                        m.push(MOp { id: next, stream: None, hold: None, reported: None });
                    }
                    MStep::Read => {
                        q.post_read(&crate::endpoint::ReadRequest {
                            wr_id: wr, lkey: 1, local_offset: 0, len: 100,
                            remote_addr: 0, rkey: 2,
                        });
                        m.push(MOp { id: next, stream: None, hold: None, reported: None });
                    }
                    MStep::Response => q.post_read_response_mr(7, (1, 1), 0, 1),
                    MStep::Fin(s) => { q.finish_stream(s); }
                    MStep::Reset(s) => { q.reset_stream(s, 1); }
                    MStep::Stop(s, d) => { q.reset_stream_after(s, 1, Some(d)); }
                    MStep::Refuse(i) if !q.ops.is_empty() => {
                        let id = q.base_id + (i % q.ops.len()) as u64;
                        if matches!(q.op(id).unwrap().kind, OpKind::Send { .. }) {
                            q.on_stream_refused(id, false);
                        }
                    }
                    MStep::Finish(i, ok) if !q.ops.is_empty() => {
                        let id = q.base_id + (i % q.ops.len()) as u64;
                        let send = matches!(q.op(id).unwrap().kind, OpKind::Send { .. });
                        // SENDs fail only by refusal or flush here (see the check below).
                        let st = if ok || send { WcStatus::Success } else { WcStatus::RemoteAccessError };
                        q.finish(id, st);
                    }
                    MStep::Cancel(i) if !m.is_empty() => {
                        let k = i % m.len();
                        if m[k].stream.is_none() && m[k].reported.is_none() {
                            let before = q.base_id + q.ops.len() as u64;
                            if q.cancel(k as u64).is_some() && q.base_id + q.ops.len() as u64 > before {
                                m[k].hold = Some(before);
                            }
                        }
                    }
                    MStep::Pop => drain(&mut q, &mut m)?,
                    MStep::Retire => {
                        drain(&mut q, &mut m)?;
                        let mut r = Vec::new();
                        q.retire_streams(usize::MAX, |s| r.push(s));
                        for s in r {
                            for e in &m {
                                prop_assert!(e.stream != Some(s) || e.reported.is_some(),
                                    "stream {} retired before {:?} was reported", s, e);
                            }
                            retired.push(s);
                        }
                    }
                    _ => {}
                }
                // A stream's SENDs: no Success after a failure, in posting order.
                for s in 0..3u32 {
                    let mut failed = None;
                    for e in m.iter().filter(|e| e.stream == Some(s)) {
                        let st = e.reported.or_else(|| q.op(e.id).and_then(|o| o.status));
                        match st {
                            Some(WcStatus::Success) => prop_assert!(failed.is_none(),
                                "{:?} Success after failed {:?}", e, failed),
                            Some(_) => failed = failed.or(Some(e.clone())),
                            None => {}
                        }
                    }
                }
            }
            q.fail_all(WcStatus::RetryExceeded);
            drain(&mut q, &mut m)?;
            for e in &m {
                prop_assert!(e.reported.is_some(), "never reported: {:?}", e);
            }
            prop_assert!(q.ops.is_empty(), "left queued: {}", q.ops.len());
            prop_assert_eq!(q.len(), 0);
        }
    }
}
