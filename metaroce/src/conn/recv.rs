//! Semantic layer, responder side: SEND reassembly with in-order delivery per stream,
//! direct placement of RDMA WRITE packets into registered memory, and exactly-once
//! reporting of messages and WRITE-with-immediate completions.

use super::send::{seg_of, segs_of};
use crate::event::{ConnectionHandle, Event, WcOpcode, WcStatus, WorkCompletion};
use crate::fasthash::HashMap;
use crate::mr::{Access, MrTable};
use crate::wire::{AtomicEth, Reth, SendEth, WriteEth};
use bytes::Bytes;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// NAK syndromes (AETH NAK codes, RoCEv2 reference §3.1).
pub(crate) const NAK_INVALID_REQUEST: u8 = 0x61;
pub(crate) const NAK_REMOTE_ACCESS: u8 = 0x62;
pub(crate) const NAK_REMOTE_OPERATIONAL: u8 = 0x63;
/// MetaRoCE flow-control RNR NAK: `0x40 | RNR timer code` (the AETH class `010xxxxx`,
/// reserved in IBA): the receiver's buffers for the SEND's stream or connection hold too
/// many unconsumed bytes; retry after the timer, not counted against `rnr_retry`.
pub(crate) const NAK_FLOW_RNR: u8 = 0x40;

/// What the semantic layer made of a new packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RxOutcome {
    /// Placed (or a harmless duplicate of placed data): acknowledge it.
    Accepted,
    /// No resources now: drop without acknowledging, the sender will retry.
    Drop,
    /// Refused: NAK with this syndrome, nothing written.
    Nak(u8),
    /// A SEND on a new stream while the stream table is full (`max_streams`): NAK 0x61
    /// with [`NakEth::FLAG_STREAM_REFUSED`](crate::wire::NakEth::FLAG_STREAM_REFUSED),
    /// nothing recorded. The sender fails the SEND, ends the stream and sends a stream
    /// abort from that message, which fills the id's place among the closed ids
    /// (`on_stream_abort`).
    StreamRefused,
    /// No receive posted for this SEND: RNR NAK, the sender retries after the RNR timer.
    Rnr,
    /// Receive flow control (`explicit_consume`): the stream or connection holds too many
    /// unconsumed bytes; flow-control RNR NAK, the sender waits and retries without limit.
    FlowRnr,
}

/// Work the responder must queue after accepting a READ or atomic request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Respond {
    /// Send `len` bytes of the local region `lkey` (which answers to `rkey`) from `offset`
    /// back as the READ response (`lkey` 0 and `len` 0 for a zero-length READ). The region
    /// is read as each response packet is built, not copied here.
    Read {
        req_id: u32,
        lkey: u32,
        rkey: u32,
        offset: u64,
        len: u32,
    },
    /// Send the original value back.
    Atomic { req_id: u32, orig: u64 },
}

/// A receive buffer the application posted on a stream.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PostedRecv {
    pub wr_id: u64,
    pub lkey: u32,
    pub offset: u64,
    pub len: u32,
}

/// Where a message's bytes land.
#[derive(Debug)]
enum Dest {
    /// A library-owned buffer, handed over as `Event::Message`.
    Owned(Vec<u8>),
    /// A posted receive.
    Posted(PostedRecv),
}

#[derive(Debug)]
struct RxMsg {
    dest: Dest,
    /// What the message counts against the receive budget: its length plus
    /// `MSG_OVERHEAD` for a library-owned buffer, 0 for a posted receive.
    charge: u64,
    /// Admitted beyond `max_recv_buffer_bytes` because it was next in line on its stream
    /// (its charge counts in `Budget::over`).
    over: bool,
    /// Admitted beyond the endpoint's reassembly cap as the connection's one small
    /// next-due message (`EndpointConfig::reassembly_floor_bytes`; its charge counts in
    /// `Budget::floor`).
    floor: bool,
    len: u32,
    got: super::segbits::SegBits,
    got_segs: u32,
    nsegs: u32,
}

#[derive(Debug, Default)]
struct StreamRx {
    next_deliver: u32,
    msgs: BTreeMap<u32, RxMsg>,
    /// Receives posted and not yet completed, in posting order: the one at index k is for
    /// message `next_deliver + k`.
    posted: VecDeque<PostedRecv>,
    /// The stream consumes posted receives (RNR when none).
    posted_mode: bool,
    /// Messages at or after `next_deliver` the receiver refused (NAK): delivery skips them,
    /// so a refused message leaves no permanent gap in its stream. At most
    /// `max_stream_window` entries.
    refused: BTreeSet<u32>,
    /// Refused messages (a subset of `refused`) that take a posted receive all the same,
    /// with their length and the receive's error status: a message refused after it, or a
    /// later message, was bound to a receive counting it (it arrived late), or the message
    /// itself was placed into the receive until its region went away. Delivery completes
    /// that receive with the status (`LocalLengthError`, `LocalProtectionError`) when it
    /// reaches the message, so receives complete in order and every later message keeps the
    /// receive it was bound to.
    refused_recv: BTreeMap<u32, (u32, WcStatus)>,
    /// The stream is in the error state from this message on (the sender gave up on it
    /// with `RnrRetryExceeded` and sent a stream abort): its packets and every later
    /// message's are acknowledged and discarded, and once delivery reaches it every posted
    /// receive — and every receive posted afterwards — completes with `WrFlushError`.
    dead_from: Option<u32>,
    /// Messages that completed their receive in error (a length error, or a receive whose
    /// region could not be written), with the NAK syndrome they got (most recent
    /// `MAX_LEN_ERRORS`): every later packet of one is refused again with the same
    /// syndrome, so a re-sent packet (its NAK lost or overtaken) is neither acknowledged
    /// as a duplicate nor failed with another status.
    len_errors: VecDeque<(u32, u8)>,
    /// This side stopped the stream (its application called `stop_stream`, QUIC
    /// STOP_SENDING) when delivery had reached this message: nothing from it on is ever
    /// delivered. What was buffered of those messages was dropped, and their packets get a
    /// flow-control RNR NAK (never an acknowledgement), so none of them can complete
    /// `Success` at the sender before the STOP reaches it and flushes them.
    stopped_at: Option<u32>,
    /// The sender finished the stream after this many messages (its FIN).
    fin_at: Option<u32>,
    /// The stream's end (`Event::StreamFinished` or `Event::StreamReset`) was reported.
    end_reported: bool,
    /// The code of the stream abort that killed the stream.
    reset_code: u32,
    /// Charges of this stream's messages in library-owned buffers being reassembled or
    /// waiting for in-order delivery.
    buffered: u64,
    /// With `explicit_consume`: bytes still to be consumed of each delivered message, in
    /// delivery order (each also charges `MSG_OVERHEAD` until fully consumed).
    unconsumed_q: VecDeque<u32>,
    /// Charges of `unconsumed_q`.
    unconsumed: u64,
}

impl StreamRx {
    /// Whether nothing of the stream is buffered, unconsumed, posted or refused: no message
    /// in reassembly, no receive posted, nothing delivered and not yet consumed, and no
    /// message refused (a re-sent packet of a refused message must be refused again, so
    /// its stream is kept). The one test both ways of forgetting a stream use
    /// (`RecvState::try_retire`, `RecvState::try_retire_unanswered`).
    fn holds_nothing(&self) -> bool {
        self.msgs.is_empty()
            && self.posted.is_empty()
            && self.unconsumed_q.is_empty()
            && self.unconsumed == 0
            && self.buffered == 0
            && self.refused.is_empty()
            && self.refused_recv.is_empty()
            && self.len_errors.is_empty()
    }

    /// Remember that message `msg_seq` completed its receive in error with NAK `syndrome`
    /// (the most recent `MAX_LEN_ERRORS`): its re-sent packets get the same NAK.
    fn note_len_error(&mut self, msg_seq: u32, syndrome: u8) {
        self.len_errors.push_back((msg_seq, syndrome));
        if self.len_errors.len() > MAX_LEN_ERRORS {
            self.len_errors.pop_front();
        }
    }

    /// Which of the stream's posted receives message `msg_seq` (at or after
    /// `next_deliver`) takes: message `next_deliver + k` takes the k-th, less the refused
    /// messages before it that hold none and the messages before it arriving into library
    /// buffers (posted mode began after they did). Messages match receives in order (IBA
    /// receive queue semantics, per stream).
    fn receive_index(&self, msg_seq: u32) -> u32 {
        let ahead = msg_seq.wrapping_sub(self.next_deliver);
        let skipped = self
            .refused
            .iter()
            .filter(|&&m| seq_before(m, msg_seq) && !self.refused_recv.contains_key(&m))
            .count() as u32
            + self
                .msgs
                .iter()
                .filter(|(&m, msg)| seq_before(m, msg_seq) && matches!(msg.dest, Dest::Owned(_)))
                .count() as u32;
        ahead - skipped.min(ahead)
    }
}

/// Length-errored messages remembered per stream.
const MAX_LEN_ERRORS: usize = 1024;

/// What a one-sided operation id was used for: its opcode and every parameter that
/// decides what it does (VA, rkey, length, immediate, atomic operands). A later packet with
/// the same op id must carry the same parameters to count as part of (or a duplicate of)
/// that operation; otherwise it belongs to another operation — a forgery, or a requester
/// whose op id was taken by one — and is refused, never acknowledged as a duplicate
/// (docs/PROTOCOL.md, "Semantics": operation ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OpParams {
    opcode: u8,
    rkey: u32,
    len: u32,
    va: u64,
    /// WRITE: the immediate (bit 32 set when present); atomics: swap or add operand.
    x: u64,
    /// Compare operand of a compare-and-swap.
    y: u64,
}

impl OpParams {
    /// All zero: no operation (opcode 0 is none of the kinds below); an unused slot of
    /// [`ExecutedOps`](super::executed::ExecutedOps).
    pub const NONE: OpParams = OpParams {
        opcode: 0,
        rkey: 0,
        len: 0,
        va: 0,
        x: 0,
        y: 0,
    };

    /// Tests: parameters told apart by `va`.
    #[cfg(test)]
    pub fn set_va_for_test(&mut self, va: u64) {
        self.va = va;
    }

    /// An RDMA WRITE (with immediate when `imm` is set).
    pub fn write(reth: &Reth, imm: Option<u32>) -> Self {
        Self {
            opcode: if imm.is_some() { 2 } else { 1 },
            rkey: reth.rkey,
            len: reth.dma_len,
            va: reth.va,
            x: imm.map_or(0, |i| (1 << 32) | i as u64),
            y: 0,
        }
    }

    /// An RDMA READ request.
    pub fn read(reth: &Reth) -> Self {
        Self {
            opcode: 3,
            rkey: reth.rkey,
            len: reth.dma_len,
            va: reth.va,
            x: 0,
            y: 0,
        }
    }

    /// An atomic (fetch-and-add or compare-and-swap).
    pub fn atomic(at: &AtomicEth, fetch_add: bool) -> Self {
        Self {
            opcode: if fetch_add { 4 } else { 5 },
            rkey: at.rkey,
            len: 8,
            va: at.va,
            x: at.swap_add,
            y: if fetch_add { 0 } else { at.compare },
        }
    }
}

#[derive(Debug)]
struct WriteTrack {
    /// The WRITE's parameters as its first packet gave them.
    params: OpParams,
    got: super::segbits::SegBits,
    got_segs: u32,
    nsegs: u32,
}

/// Most ranges of closed stream ids a connection keeps per set and direction, for a
/// `max_streams` of `max_streams`: `2 × max_streams + 1`. The ids of streams that still
/// have state (at most `max_streams`) are gaps between closed ids, each splitting a range,
/// so an honest peer that opens its streams in order needs up to `max_streams + 1`
/// ranges; the rest leaves room for refused streams whose aborts are still on their way.
/// A peer that skips ids (`Connection::stream(id)`) fragments the set faster: at the
/// bound, ended streams are kept (and count against `max_streams`) instead of forgotten.
pub(crate) fn closed_id_ranges(max_streams: u32) -> usize {
    2 * max_streams as usize + 1
}

/// Limits the responder applies (from `TransportConfig`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RecvLimits {
    pub pmtu: u32,
    pub max_message_size: u64,
    pub max_recv_buffer_bytes: u64,
    pub max_stream_window: u32,
    pub max_streams: u32,
    /// Most ranges of closed stream ids kept per set ([`closed_id_ranges`]).
    pub max_ranges: usize,
    pub require_posted_receives: bool,
    pub max_tracked_ops: u32,
    pub max_held_immediates: u32,
    pub max_unconsumed_immediates: u32,
    pub explicit_consume: bool,
    pub max_stream_recv_bytes: u64,
    /// The endpoint's delivered-and-unread bytes, over all its connections, are at
    /// `EndpointConfig::max_unread_recv_bytes` (as it last counted them): no new message
    /// into a library-owned buffer until the application reads.
    pub endpoint_unread_full: bool,
    /// Bytes of messages being reassembled (library-owned buffers, not yet delivered) on
    /// the endpoint's *other* connections, as it last counted them.
    pub endpoint_reassembly_others: u64,
    /// `EndpointConfig::max_reassembly_bytes`.
    pub max_reassembly_bytes: u64,
    /// `EndpointConfig::reassembly_floor_bytes`.
    pub reassembly_floor_bytes: u64,
}

/// What a message in a library-owned buffer counts against `max_recv_buffer_bytes` on top
/// of its length (its bookkeeping), so that zero-length or tiny messages parked ahead of
/// their stream's next one cannot pile up without bound.
const MSG_OVERHEAD: u64 = 128;

/// Bytes of library-owned receive buffers (`Dest::Owned`) a connection holds, each message
/// counted with `MSG_OVERHEAD`.
#[derive(Debug, Default)]
struct Budget {
    /// All of them.
    bytes: u64,
    /// Those of messages admitted beyond `max_recv_buffer_bytes` because they were next in
    /// line on their stream: at most `max_recv_buffer_bytes`, or one message when alone.
    over: u64,
    /// Entries of every stream's `refused` set. Invalid messages are recorded there only
    /// while this is below `max_tracked_ops` (beyond it a refused message is NAKed but not
    /// recorded); an honest peer's messages in flight, hence its refused ones, are fewer.
    refused: usize,
    /// Of `bytes`: delivered and not yet consumed (`explicit_consume`).
    unconsumed: u64,
    /// Of `bytes`: the message admitted beyond the endpoint's reassembly cap under
    /// `reassembly_floor_bytes` (at most one at a time).
    floor: u64,
    /// `explicit_consume` is on (copied from the limits).
    explicit: bool,
    /// Messages in every stream's `msgs` (being reassembled or waiting for delivery), so
    /// that `RecvState::stats` costs O(1): the Pair harness reads the stats at every step,
    /// and summing over streams made tests with thousands of streams crawl.
    msgs: u64,
}

impl Budget {
    /// Bytes of messages being reassembled or waiting for in-order delivery (not yet
    /// delivered), with their bookkeeping.
    fn reassembly(&self) -> u64 {
        self.bytes - self.unconsumed
    }

    fn release(&mut self, msg: &RxMsg) {
        self.bytes -= msg.charge;
        if msg.over {
            self.over -= msg.charge;
        }
        if msg.floor {
            self.floor -= msg.charge;
        }
    }

    /// `msg` of stream `st` leaves the reassembly buffers (dropped or refused).
    fn release_msg(&mut self, st: &mut StreamRx, msg: &RxMsg) {
        self.release(msg);
        st.buffered -= msg.charge;
        self.msgs -= 1;
    }

    /// Drop what stream `st` holds of messages `from` on (buffered parts, refusals): the
    /// stream ends before them (a reset at `from`, a FIN counting `from` messages).
    fn forget_from(&mut self, st: &mut StreamRx, from: u32) {
        let gone: Vec<u32> = st
            .msgs
            .keys()
            .copied()
            .filter(|&m| !seq_before(m, from))
            .collect();
        for m in gone {
            if let Some(msg) = st.msgs.remove(&m) {
                self.release_msg(st, &msg);
            }
        }
        let before = st.refused.len();
        st.refused.retain(|&m| seq_before(m, from));
        st.refused_recv.retain(|&m, _| seq_before(m, from));
        self.refused -= before - st.refused.len();
    }

    /// `msg` of stream `st` was delivered: with `explicit_consume` its bytes stay charged
    /// (as unconsumed) until `RecvState::consume`; otherwise they are released.
    fn delivered(&mut self, st: &mut StreamRx, msg: &RxMsg) {
        st.buffered -= msg.charge;
        self.msgs -= 1;
        if self.explicit && matches!(msg.dest, Dest::Owned(_)) {
            if msg.over {
                self.over -= msg.charge;
            }
            if msg.floor {
                self.floor -= msg.charge;
            }
            st.unconsumed_q.push_back(msg.len);
            st.unconsumed += msg.charge;
            self.unconsumed += msg.charge;
        } else {
            self.release(msg);
        }
    }
}

/// What the responder knows of a one-sided operation id (WRITE, READ, atomic).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpState {
    /// Not finished: new, or a WRITE with segments still to come.
    Open,
    /// Executed (or refused so long ago that its refusal record was evicted).
    Executed,
    /// Refused for good with this NAK syndrome.
    Refused(u8),
}

/// Records keyed by an id, at most a given number, the oldest evicted first (in order of
/// first insertion; a key removed meanwhile keeps its place in `order` until it comes up,
/// so `order` stays within the bound too).
#[derive(Debug)]
struct FifoRecords<V> {
    map: HashMap<u32, V>,
    order: VecDeque<u32>,
}

impl<V> Default for FifoRecords<V> {
    fn default() -> Self {
        FifoRecords {
            map: HashMap::default(),
            order: VecDeque::new(),
        }
    }
}

impl<V> FifoRecords<V> {
    /// Rebuild the (still empty) map with the hasher state `st` (its keys are the peer's).
    fn key_table(&mut self, st: crate::fasthash::FastState) {
        self.map = HashMap::with_hasher(st);
    }

    /// The record of `k` (no hashing while there is none).
    fn get(&self, k: u32) -> Option<&V> {
        if self.map.is_empty() {
            return None;
        }
        self.map.get(&k)
    }

    fn remove(&mut self, k: u32) {
        self.map.remove(&k);
    }

    fn len(&self) -> usize {
        self.map.len()
    }

    /// Record `v` for `k`: `merge`d into the record `k` has, or a new record; beyond `max`
    /// records the oldest go.
    fn record(&mut self, k: u32, v: V, max: usize, merge: impl FnOnce(&mut V, V)) {
        if let Some(old) = self.map.get_mut(&k) {
            merge(old, v);
            return;
        }
        self.map.insert(k, v);
        self.order.push_back(k);
        while self.order.len() > max {
            if let Some(old) = self.order.pop_front() {
                self.map.remove(&old);
            }
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct RecvState {
    streams: HashMap<u32, StreamRx>,
    /// Streams whose incoming direction ended, was drained and was forgotten
    /// ([`RecvState::try_retire`]): their late packets are acknowledged and dropped.
    retired: super::idset::IdSet,
    /// Of `retired`: streams this side stopped before any message of theirs was delivered
    /// and forgot without the peer's end (`try_retire_unanswered`). Nothing of them was
    /// ever delivered, so every SEND packet of one is refused (a flow-control RNR NAK, as
    /// for the stopped stream it was), never acknowledged: none completes `Success` at the
    /// sender.
    unanswered: super::idset::IdSet,
    /// Streams that were over (`try_retire`) when `retired` was at its range bound, and
    /// were kept for that alone. Retired once an id joining them, or a merge below the
    /// bound, makes room (`retire_kept`); before, nothing looked at them again and they
    /// held the stream table for the connection's life (found by review).
    kept: BTreeSet<u32>,
    /// Ids added to `retired` since the last `retire_kept` (only while `kept` is not
    /// empty): their neighbours in `kept` may now join a range.
    fresh: Vec<u32>,
    /// Streams `withdraw_recv` looked at (tests bound its cost with it).
    #[cfg(test)]
    withdraw_visits: u64,
    buf: Budget,
    /// WRITEs in progress (some segments placed).
    writes: HashMap<u32, WriteTrack>,
    /// 64-bit words of the `got` bitmaps in `writes`: at most `max_tracked_ops` × 64 (a
    /// WRITE's bitmap grows with its length, up to `max_message_size`), plus the WRITE at
    /// the floor, always admitted.
    write_words: usize,
    /// Every op id (WRITE, READ, atomic) before `write_floor` is finished; `writes_done`
    /// holds finished ids at or above it. `writes.len() + writes_done.len()` stays below
    /// `max_tracked_ops` (plus the op at the floor, always admitted): a new op id beyond
    /// that is not taken (WRITE packet dropped unacknowledged, READ/atomic RNR-NAKed) until
    /// the floor moves.
    write_floor: u32,
    writes_done: BTreeSet<u32>,
    /// Op ids refused for good, with their NAK syndrome, so that a re-sent request of a
    /// refused operation is refused again rather than taken for an executed one. At most
    /// `max_tracked_ops` entries: the oldest record is evicted first.
    refused_ops: FifoRecords<u8>,
    /// Streams with no state whose message this side refused for want of room (stream id
    /// → the earliest message refused). The sender fails that SEND, flushes the stream's
    /// later ones and aborts the stream from it; until its abort arrives, a copy of any of
    /// those messages (a late network duplicate, or a re-send racing the refusal) is
    /// refused again, even once room came: delivering it would deliver a message whose
    /// SEND failed (found by review). At most `max_tracked_ops` records, the oldest evicted
    /// first.
    refused_new: FifoRecords<u32>,
    /// What the most recently executed op ids were used for (at most `max_tracked_ops`,
    /// oldest evicted first): a packet reusing one of them with other parameters is refused
    /// instead of being acknowledged as a duplicate of an operation it is not part of.
    executed: super::executed::ExecutedOps,
    /// Immediates of WRITEs with immediate whose data has fully landed but which wait for
    /// an earlier op id to finish (the WRITE_WITH_IMM fence): op id → (immediate, length).
    /// At most `max_held_immediates` entries (see [`RecvState::on_write`]).
    held_imms: HashMap<u32, (u32, u32)>,
    /// Immediates released by the floor of finished op ids, in op id order, not yet
    /// reported as events (`take_released`).
    released_imms: VecDeque<(u32, u32)>,
    /// With `explicit_consume`: immediates reported ([`Event::WriteWithImm`]) and not yet
    /// consumed by the application (`immediates_consumed`). At most
    /// `max_unconsumed_immediates + min(max_unconsumed_immediates, max_held_immediates)`.
    unconsumed_imms: u32,
    /// Receives posted on a dead stream, flushed and not yet reported (`take_flushed`).
    flushed: VecDeque<(u32, WorkCompletion)>,
    pub stats: RecvStats,
}

/// Responder-side counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecvStats {
    /// Messages delivered to the application.
    pub messages: u64,
    /// Message bytes delivered.
    pub message_bytes: u64,
    /// WRITE payload bytes placed into memory.
    pub write_bytes: u64,
    /// Packets whose data had already been placed (retransmissions that crossed).
    pub duplicates: u64,
    /// Packets refused for lack of receive buffer (with a flow-control RNR NAK), without
    /// `explicit_consume`, or dropped for lack of WRITE tracking room.
    pub no_buffer_drops: u64,
    /// SEND packets refused with a flow-control RNR NAK because their message is
    /// `max_stream_window` or more messages ahead of the next one due on its stream, or
    /// because its posted receive is too short while earlier messages of the stream are
    /// undelivered (the length error waits until they are), or because it has no posted
    /// receive while an earlier message of the stream still needs one (only the message
    /// whose receive is next counts against the sender's `rnr_retry`).
    pub stream_window_naks: u64,
    /// NAKs sent.
    pub naks: u64,
    /// RNR NAKs sent (a SEND found no posted receive).
    pub rnr_naks: u64,
    /// Op aborts taken: WRITEs the requester gave up on after a local error, and WRITEs,
    /// READs and atomics it cancelled before they were executed here (their op ids count as
    /// finished).
    pub aborted_ops: u64,
    /// One-sided packets (WRITE, READ, atomic) whose op id was already taken by an
    /// operation with other parameters (opcode, VA, rkey, length, immediate, operands):
    /// refused with NAK 0x61 (invalid request), never taken for a duplicate of it.
    pub op_mismatches: u64,
    /// One-sided packets whose op id lies `max_tracked_ops` or more ahead of the floor of
    /// finished op ids: dropped unacknowledged, not executed.
    pub op_id_out_of_window: u64,
    /// RDMA READ requests executed.
    pub reads: u64,
    /// Executed READs whose response stopped because its source region was deregistered
    /// while the response was queued: the op id is refused with NAK 0x62 from then on, so
    /// the requester's READ fails `RemoteAccessError`.
    pub read_responses_revoked: u64,
    /// Atomics executed.
    pub atomics: u64,
    /// Streams that entered the error state because the sender aborted them (a SEND on
    /// them failed with `RnrRetryExceeded`).
    pub dead_streams: u64,
    /// SEND packets of messages at or after a stream's stop point (this side stopped the
    /// stream, `stop_stream`): answered with a flow-control RNR NAK, never placed nor
    /// acknowledged, until the peer's reset for the STOP arrives.
    pub stopped_naks: u64,
    /// SEND packets of messages at or after their stream's FIN count (an honest sender
    /// never sends one): refused with NAK invalid request, nothing placed.
    pub beyond_fin_naks: u64,
    /// Gauge, at the time of the snapshot: one-sided op ids the responder tracks (WRITEs
    /// in progress, finished ids above the floor, refusal records, records of what executed
    /// ids did). At most about 3 × `max_tracked_ops`.
    pub tracked_ops: u64,
    /// Gauge: bytes of library-owned buffers held for SEND messages being reassembled or
    /// waiting for in-order delivery, each message counted with 128 bytes of bookkeeping.
    /// At most `max_recv_buffer_bytes` plus `max(max_recv_buffer_bytes, max_message_size +
    /// 128)`.
    pub buffered_bytes: u64,
    /// Gauge: bytes of the segment bitmaps of WRITEs in progress (one bit per path-MTU
    /// segment of each WRITE). At most `max_tracked_ops` × 512 bytes, plus one WRITE's.
    pub write_track_bytes: u64,
    /// Gauge: SEND messages being reassembled or waiting for in-order delivery.
    pub buffered_messages: u64,
    /// Gauge: refused SEND messages ahead of their stream's next one, remembered so that
    /// in-order delivery skips them. At most `max_tracked_ops` (plus messages too long for
    /// their posted receive).
    pub refused_messages: u64,
    /// Gauge: streams with incoming state (opened by the peer's first message, FIN or
    /// reset, by a posted receive or by `stop_stream`; at most `max_streams`). A stream
    /// whose incoming direction ended and was drained is forgotten and leaves this count
    /// (`retired_streams`).
    pub streams: u64,
    /// Streams whose incoming direction ended (FIN or reset reported), was drained
    /// (delivered and consumed) and was forgotten; their ids are remembered as ranges
    /// (`retired_stream_ranges`), so a late packet of one is acknowledged and dropped.
    /// Also counts refused streams recorded as closed by the sender's stream abort
    /// (`refused_streams`), and streams stopped before anything of them arrived.
    pub retired_streams: u64,
    /// Gauge: ranges of retired stream ids held (at most `2 × max_streams + 1`;
    /// consecutive ids of one side merge).
    pub retired_stream_ranges: u64,
    /// SEND packets of new streams refused because `max_streams` streams had state, and
    /// copies of such a refused message (or of a later one of its stream) refused again
    /// although the table had room by then (`refused_copies`) (NAK 0x61 with the
    /// stream-refused flag; `RemoteInvalidRequest` at the sender, which ends the stream).
    pub refused_streams: u64,
    /// Of `refused_streams`: copies of a message refused before (or of a later message
    /// of its stream) refused again although the stream table had room (or the stream
    /// had state) by then — the sender failed that SEND (a late network duplicate, or a
    /// re-send racing the first refusal). A copy arriving while the table is still full
    /// is refused for want of room, and counts only in `refused_streams`.
    pub refused_copies: u64,
    /// FINs and stream aborts of streams with no state and no room for any that waited
    /// (flow-control RNR NAK) for the stream's earlier messages to arrive or be aborted.
    pub stream_table_naks: u64,
    /// SEND packets of retired streams (late or duplicated copies), acknowledged and
    /// dropped.
    pub retired_stream_packets: u64,
    /// Gauge: immediates of WRITEs with immediate that have fully landed and wait for an
    /// earlier operation to finish (the fence, see `TransportConfig::max_held_immediates`).
    pub held_immediates: u64,
    /// Last packets of WRITEs with immediate dropped unacknowledged because
    /// `max_held_immediates` immediates were already held (the requester re-sends them).
    pub held_immediate_drops: u64,
    /// Flow-control RNR NAKs sent (`explicit_consume`: a message did not fit the stream's
    /// or the connection's unconsumed-byte limits; the sender waits).
    pub flow_rnr_naks: u64,
    /// Of `flow_rnr_naks`: WRITEs with immediate held back because
    /// `max_unconsumed_immediates` notifications were outstanding.
    pub imm_flow_rnr_naks: u64,
    /// Gauge (`explicit_consume`): immediates reported and not yet consumed.
    pub unconsumed_immediates: u64,
    /// SEND packets of new messages refused with a flow-control RNR NAK because the
    /// endpoint's delivered-and-unread bytes, over all its connections, were at
    /// `EndpointConfig::max_unread_recv_bytes` (the sender waits until the application
    /// reads).
    pub memory_rnr_naks: u64,
    /// SEND packets of new messages refused with a flow-control RNR NAK because the
    /// endpoint's messages being reassembled, over all its connections, were at
    /// `EndpointConfig::max_reassembly_bytes` (the sender waits until messages in progress
    /// complete).
    pub reassembly_rnr_naks: u64,
    /// Gauge: bytes delivered in `Event::Message` and not yet consumed
    /// (`explicit_consume`), each message counted with 128 bytes of bookkeeping; included in
    /// `buffered_bytes`.
    pub unconsumed_bytes: u64,
}

fn seq_before(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

fn test_set(bits: &mut [u64], i: u32) -> bool {
    let (w, b) = ((i / 64) as usize, i % 64);
    let was = bits[w] >> b & 1 == 1;
    bits[w] |= 1 << b;
    !was
}

/// The completion of a receive flushed without data.
fn flush_wc(wr_id: u64) -> WorkCompletion {
    WorkCompletion {
        wr_id,
        status: WcStatus::WrFlushError,
        opcode: WcOpcode::Recv,
        byte_len: 0,
    }
}

/// Check that a packet is the segment the path MTU implies at its offset.
pub(crate) fn check_segment(offset: u32, payload: usize, total: u64, pmtu: u32) -> bool {
    let off = offset as u64;
    // `off % pmtu` (a power of two, see `send::segs_of`).
    debug_assert!(pmtu.is_power_of_two());
    if off & (pmtu as u64 - 1) != 0 || (off >= total && !(off == 0 && total == 0)) {
        return false;
    }
    payload as u64 == (total - off).min(pmtu as u64)
}

impl RecvState {
    /// Rebuild the (still empty) tables keyed by ids the peer chooses with the hasher
    /// state `st` (a secret key: `fasthash`).
    pub fn key_tables(&mut self, st: crate::fasthash::FastState) {
        debug_assert!(self.streams.is_empty() && self.writes.is_empty());
        self.streams = HashMap::with_hasher(st);
        self.writes = HashMap::with_hasher(st);
        self.refused_ops.key_table(st);
        self.refused_new.key_table(st);
        self.held_imms = HashMap::with_hasher(st);
    }

    /// Post a receive buffer on a stream; the stream then consumes posted receives. On a
    /// dead stream whose delivery reached the lost message, and on a finished stream whose
    /// every message is delivered, the receive is flushed at once (reported by
    /// `take_flushed`), as IBA flushes receives posted to a QP in the error state: nothing
    /// will ever land in it.
    pub fn post_recv(&mut self, stream: u32, r: PostedRecv) {
        if self.retired.contains(stream) {
            // The stream ended and was forgotten: nothing will arrive on it.
            self.flushed.push_back((stream, flush_wc(r.wr_id)));
            return;
        }
        let st = self.streams.entry(stream).or_default();
        st.posted_mode = true;
        if st.dead_from == Some(st.next_deliver) || st.fin_at == Some(st.next_deliver) {
            // Nothing more will arrive on the stream: reset, or finished with every
            // message delivered.
            self.flushed.push_back((stream, flush_wc(r.wr_id)));
        } else {
            st.posted.push_back(r);
        }
    }

    /// Withdraw the posted receive `wr_id` if no message has begun landing in it (nor in a
    /// receive posted after it on the same stream, whose message-to-receive matching would
    /// shift): it completes with `WrFlushError` (reported by `take_flushed`) and the next
    /// message of its stream takes the next receive. `Some(false)`: a message is landing
    /// in it (or it was flushed already); it completes normally. `None`: no such receive.
    ///
    /// With `stream` only that stream's receives are searched: O(its posted receives +
    /// its messages). Without, every stream's: O(streams) more, which made dropping a
    /// receive on each of n streams cost O(n²).
    pub fn withdraw_recv(&mut self, stream: Option<u32>, wr_id: u64) -> Option<bool> {
        if self
            .flushed
            .iter()
            .any(|&(sid, wc)| wc.wr_id == wr_id && stream.is_none_or(|s| s == sid))
        {
            return Some(false);
        }
        let mut visits = 0u64;
        let found = match stream {
            Some(sid) => self.streams.get(&sid).and_then(|st| {
                visits += 1;
                Some((sid, st.posted.iter().position(|r| r.wr_id == wr_id)?))
            }),
            None => self.streams.iter().find_map(|(&sid, st)| {
                visits += 1;
                Some((sid, st.posted.iter().position(|r| r.wr_id == wr_id)?))
            }),
        };
        #[cfg(test)]
        {
            self.withdraw_visits += visits;
        }
        let _ = visits;
        let (sid, k) = found?;
        let st = self.streams.get_mut(&sid)?;
        // A refused message that keeps its receive (it failed after it was bound, e.g. its
        // region went away mid-message) holds the receive at its index until delivery
        // completes it in error: that one or a later one means the matching cannot shift
        // either (found by review: the next receive was completed in error instead).
        if st
            .refused_recv
            .keys()
            .any(|&m| st.receive_index(m) as usize >= k)
        {
            return Some(false);
        }
        // Receives bound to messages that began landing: this one or a later one means the
        // matching cannot shift.
        let mut bound = st.msgs.values().filter_map(|m| match m.dest {
            Dest::Posted(r) => Some(r.wr_id),
            Dest::Owned(_) => None,
        });
        let first = bound.next();
        if let Some(first) = first {
            let rest: std::collections::HashSet<u64> = bound.chain([first]).collect();
            if st.posted.iter().skip(k).any(|r| rest.contains(&r.wr_id)) {
                return Some(false);
            }
        }
        st.posted.remove(k);
        self.flushed.push_back((sid, flush_wc(wr_id)));
        Some(true)
    }

    /// Whether flushed receives wait to be reported.
    pub fn has_flushed(&self) -> bool {
        !self.flushed.is_empty()
    }

    /// Report the receives flushed at posting time.
    pub fn take_flushed(&mut self, conn: ConnectionHandle, events: &mut VecDeque<Event>) {
        for (stream, wc) in self.flushed.drain(..) {
            events.push_back(Event::RecvCompletion { conn, stream, wc });
        }
    }

    /// This side stops `stream` (its application no longer reads it, QUIC STOP_SENDING,
    /// RFC 9000 §3.5): delivery ends at the next undelivered message `N`, which is
    /// returned for the STOP. Every message before `N` was delivered or refused (and
    /// answered so: a retransmitted packet of one is acknowledged as a duplicate or refused
    /// again), and nothing from `N` on will ever be delivered: what was buffered of it is
    /// dropped now, and later packets get a flow-control RNR NAK, so none completes
    /// `Success` at the sender. A second call returns the first point. A stream this side
    /// has no state for gets some (if `max_streams` allows; otherwise its id closes as
    /// stopped, or, at the range bound, a refusal record keeps its packets refused until
    /// the sender's abort comes) and stops at 0.
    pub fn stop(&mut self, stream: u32, lim: &RecvLimits) -> u32 {
        self.buf.explicit = lim.explicit_consume;
        if self.retired.contains(stream) {
            return 0;
        }
        if !self.streams.contains_key(&stream) && self.streams.len() >= lim.max_streams as usize {
            // No room for its state: nothing of it was delivered. It is forgotten at once
            // as stopped at 0 (`try_retire_unanswered`), ranges permitting; else a refusal
            // record from message 0 keeps its packets refused (even once room comes).
            let max = lim.max_ranges;
            let full = |set: &super::idset::IdSet| set.would_grow(stream) && set.ranges() >= max;
            if !full(&self.retired) && !full(&self.unanswered) {
                self.retire_id(stream);
                self.unanswered.insert(stream);
                self.stats.retired_streams += 1;
            } else {
                // Nothing else can be kept: a refusal record from message 0, so that the
                // stream's messages stay refused once room comes, until the sender's
                // abort (its answer to this STOP) arrives. Before, a message arriving after
                // room came was delivered although the STOP (delivered 0) had flushed its
                // SEND at the sender (found by review).
                self.record_refused_stream(stream, 0, lim);
            }
            return 0;
        }
        let st = self.streams.entry(stream).or_default();
        if let Some(n) = st.stopped_at {
            return n;
        }
        let n = st.next_deliver;
        st.stopped_at = Some(n);
        let dropped: Vec<u32> = st.msgs.keys().copied().collect();
        for m in dropped {
            if let Some(msg) = st.msgs.remove(&m) {
                self.buf.release_msg(st, &msg);
            }
        }
        n
    }

    /// The sender aborted `stream` from message `first` on (an `MR_SEND` with the
    /// stream-abort flag: a SEND failed with `RnrRetryExceeded` and every later SEND on
    /// the stream was flushed). Messages before `first` are still delivered as they
    /// complete; from `first` on (or from the next undelivered message, if `first` was
    /// delivered already) the stream is dead: what was buffered of those messages is
    /// dropped, later packets are acknowledged and discarded, and the stream's receives are
    /// flushed once delivery reaches that point. Always acknowledged.
    pub fn on_stream_abort(
        &mut self,
        conn: ConnectionHandle,
        stream: u32,
        first: u32,
        code: u32,
        lim: &RecvLimits,
        events: &mut VecDeque<Event>,
    ) -> RxOutcome {
        self.buf.explicit = lim.explicit_consume;
        // The sender's abort of a stream this side refused (or an earlier one): from here
        // on the stream's state, or its id among the closed ones, refuses what the record
        // refused. (An abort that waits below keeps it.)
        let refused = self
            .refused_new
            .get(stream)
            .is_some_and(|&f| !seq_before(f, first));
        if self.retired.contains(stream) {
            // (A record of a closed id is never looked at again: `on_send` answers the id
            // first.)
            self.refused_new.remove(stream);
            return RxOutcome::Accepted;
        }
        if !self.streams.contains_key(&stream) && self.streams.len() >= lim.max_streams as usize {
            // No room for its state. Dead from message 0 (the sender's answer to a refused
            // stream, or a reset of a stream nothing of which arrived): nothing of it was
            // or will be delivered, so its id is recorded as closed, as if it had been
            // delivered and drained (later copies of its messages are acknowledged and
            // dropped: their SENDs are already failed or flushed at the sender). Without
            // this each refused stream left a gap among the closed ids, and gaps piling up
            // to the range bound wedged the connection (every new stream refused, found by
            // a new user's trial). Dead from a later message: the earlier ones are still
            // to arrive and be delivered or refused, so the abort waits (flow-control RNR
            // NAK, the sender re-sends it) rather than being acknowledged and lost.
            let out = self.retire_unseen(stream, first == 0, lim);
            if out == RxOutcome::Accepted {
                // The id is closed now (whatever message the record names).
                self.refused_new.remove(stream);
            }
            return out;
        }
        if refused
            && first == 0
            && !self.streams.contains_key(&stream)
            && self.retire_fits(stream, lim)
        {
            // The answer to this side's refusal of the stream's first message, and room
            // came meanwhile: nothing of the stream was delivered, so it closes as above,
            // without taking state or reporting a reset of a stream the application never
            // saw.
            self.refused_new.remove(stream);
            return self.retire_unseen(stream, true, lim);
        }
        if refused {
            self.refused_new.remove(stream);
        }
        let st = self.streams.entry(stream).or_default();
        let mut from = if seq_before(first, st.next_deliver) {
            st.next_deliver
        } else {
            first
        };
        if let Some(n) = st.stopped_at.filter(|&n| seq_before(n, from)) {
            // Nothing from the stop point on is delivered: the stream ends there.
            from = n;
        }
        if st.end_reported {
            // Already ended (finished or reset) and reported: late or duplicate.
            return RxOutcome::Accepted;
        }
        match st.dead_from {
            Some(d) if !seq_before(from, d) => return RxOutcome::Accepted,
            None => self.stats.dead_streams += 1,
            Some(_) => {}
        }
        st.dead_from = Some(from);
        st.reset_code = code;
        self.buf.forget_from(st, from);
        Self::deliver(conn, stream, st, &mut self.buf, &mut self.stats, events);
        RxOutcome::Accepted
    }

    /// The sender finished `stream` after `count` messages (an `MR_SEND` with the FIN
    /// flag). Once delivery reaches message `count`, `Event::StreamFinished` is reported
    /// (once). The first FIN counts: a duplicate, a different later one, or one naming a
    /// count below the messages already delivered (impossible from an honest sender) is
    /// ignored; so is a FIN of a stream that was reset. Always acknowledged.
    pub fn on_stream_fin(
        &mut self,
        conn: ConnectionHandle,
        stream: u32,
        count: u32,
        lim: &RecvLimits,
        events: &mut VecDeque<Event>,
    ) -> RxOutcome {
        self.buf.explicit = lim.explicit_consume;
        if self.retired.contains(stream) {
            return RxOutcome::Accepted;
        }
        if !self.streams.contains_key(&stream) && self.streams.len() >= lim.max_streams as usize {
            // No room for its state. A FIN after no message (an empty stream) is recorded
            // as a closed id at once: nothing of it is ever delivered. A FIN after
            // messages that are still to arrive, or to be refused and aborted, waits
            // (flow-control RNR NAK): acknowledged and ignored, as before, it completed
            // `Success` at the sender while the receiver never learned the stream's end,
            // and a stream whose messages were admitted later hung open for good.
            return self.retire_unseen(stream, count == 0, lim);
        }
        let st = self.streams.entry(stream).or_default();
        if st.fin_at.is_some() || st.dead_from.is_some() || seq_before(count, st.next_deliver) {
            return RxOutcome::Accepted;
        }
        st.fin_at = Some(count);
        // Messages at or after the count (a peer that sent them is broken or hostile) are
        // dropped, their receives freed for the flush at the FIN: nothing more is written
        // into a receive once it is reported flushed.
        self.buf.forget_from(st, count);
        Self::deliver(conn, stream, st, &mut self.buf, &mut self.stats, events);
        RxOutcome::Accepted
    }

    /// The application consumed `bytes` more bytes of the messages delivered on `stream`
    /// (`explicit_consume`), in delivery order: they, and the bookkeeping charge of every
    /// message consumed to its end (a zero-length message is consumed by any call that
    /// reaches it), stop counting against the limits. Bytes beyond what was delivered are
    /// ignored.
    pub fn consume(&mut self, stream: u32, bytes: u64) {
        let Some(st) = self.streams.get_mut(&stream) else {
            return;
        };
        let mut n = bytes;
        while let Some(front) = st.unconsumed_q.front_mut() {
            let take = n.min(*front as u64);
            *front -= take as u32;
            n -= take;
            let mut freed = take;
            let done = *front == 0;
            if done {
                st.unconsumed_q.pop_front();
                freed += MSG_OVERHEAD;
            }
            st.unconsumed -= freed;
            self.buf.unconsumed -= freed;
            self.buf.bytes -= freed;
            if !done {
                break;
            }
        }
    }

    /// Forget `stream`'s incoming direction if it is over: its end (FIN or reset) was
    /// reported, nothing of it is buffered, unconsumed or waiting for a receive, and no
    /// message took a receive too short for it (`len_errors`: a re-sent packet of one
    /// must be refused again with its syndrome, so such a stream is kept; an invalid
    /// message is recognised from the packet itself, see `on_send`). Its id joins `retired`, unless that would add a
    /// range beyond `max_ranges` (then the stream is kept, and counts against
    /// `max_streams` as before). Returns whether this call retired it (`false` for a
    /// stream retired before, or with no state).
    ///
    /// Stream ids are single-use per connection and direction, so the id alone answers
    /// every later packet: a duplicate or very late copy of a delivered message (or of a
    /// dead one after a reset) is acknowledged and dropped, as it would have been, and a
    /// FIN, reset or receive posted for it is a no-op (the receive completes with
    /// `WrFlushError`). Without this a connection held the state of every stream it ever
    /// saw, and `max_streams` was a limit over its whole life (found by a new user's trial:
    /// the 65,537th request stream of a long-lived connection failed).
    pub fn try_retire(&mut self, stream: u32, max_ranges: usize) -> bool {
        // (A retired stream has no entry in `streams`.)
        let Some(st) = self.streams.get(&stream) else {
            return false;
        };
        let over = st.end_reported && st.holds_nothing();
        if !over {
            return false;
        }
        if self.retired.would_grow(stream) && self.retired.ranges() >= max_ranges {
            self.kept.insert(stream);
            return false;
        }
        self.kept.remove(&stream);
        self.streams.remove(&stream);
        self.retire_id(stream);
        self.stats.retired_streams += 1;
        true
    }

    /// Forget `stream`'s incoming direction although the peer never ended it: this side
    /// stopped it before any of its messages was delivered (`stop` at message 0), and
    /// nothing of it is buffered, unconsumed, posted or refused. The caller does this once
    /// this side's sending on the stream is over too. A STOP is answered by the peer's
    /// reset only if the peer has room for it (it acknowledges and ignores one for a
    /// stream it never sent on while it tracks `max_streams` streams, e.g. one it refused
    /// for a full stream table), so waiting for that end held the stream's state — counted
    /// against this side's `max_streams` — until the connection ended. Its id joins
    /// `retired` and `unanswered` (unless either would add a range beyond `max_ranges`:
    /// then the stream is kept, as before); later SENDs of it are refused, never
    /// acknowledged, and its FIN or reset is acknowledged and ignored. Returns whether this
    /// call retired it.
    pub fn try_retire_unanswered(&mut self, stream: u32, max_ranges: usize) -> bool {
        let Some(st) = self.streams.get(&stream) else {
            return false;
        };
        let unheard = st.stopped_at == Some(0)
            && st.next_deliver == 0
            && !st.end_reported
            && st.holds_nothing();
        let full = |set: &super::idset::IdSet| set.would_grow(stream) && set.ranges() >= max_ranges;
        if !unheard || full(&self.retired) || full(&self.unanswered) {
            return false;
        }
        self.streams.remove(&stream);
        self.retire_id(stream);
        self.unanswered.insert(stream);
        self.stats.retired_streams += 1;
        true
    }

    /// A FIN or stream abort for `stream`, which has no state here and no room for any
    /// (`max_streams`). `empty`: nothing of the stream was or will be delivered (FIN after
    /// no message, abort from message 0): its id joins `retired` at once, unless that
    /// would add a range beyond `max_ranges`. Otherwise (or with no range to spare) the
    /// packet waits: flow-control RNR NAK, and the sender re-sends it until the stream's
    /// earlier messages made room for it or were aborted.
    fn retire_unseen(&mut self, stream: u32, empty: bool, lim: &RecvLimits) -> RxOutcome {
        if !empty || !self.retire_fits(stream, lim) {
            self.stats.stream_table_naks += 1;
            return RxOutcome::FlowRnr;
        }
        self.retire_id(stream);
        self.stats.retired_streams += 1;
        RxOutcome::Accepted
    }

    /// Whether `stream` can join `retired` without adding a range beyond `max_ranges`.
    fn retire_fits(&self, stream: u32, lim: &RecvLimits) -> bool {
        !(self.retired.would_grow(stream) && self.retired.ranges() >= lim.max_ranges)
    }

    /// Add `stream` to `retired`, noting it for `retire_kept`.
    fn retire_id(&mut self, stream: u32) {
        self.retired.insert(stream);
        if !self.kept.is_empty() {
            self.fresh.push(stream);
        }
    }

    /// Retire the streams kept at the range bound (`kept`) that fit now: below the bound
    /// any of them, at it those next to an id retired since the last call (which then join
    /// its range), in a chain. Returns the streams retired. O(1) while `kept` is empty.
    pub fn retire_kept(&mut self, max_ranges: usize) -> Vec<u32> {
        let mut out = Vec::new();
        while !self.kept.is_empty() {
            let cand = if self.retired.ranges() < max_ranges {
                self.kept.first().copied()
            } else {
                let mut c = None;
                while let Some(&x) = self.fresh.last() {
                    c = [x.checked_sub(2), x.checked_add(2)]
                        .into_iter()
                        .flatten()
                        .find(|n| self.kept.contains(n));
                    if c.is_some() {
                        break;
                    }
                    self.fresh.pop();
                }
                c
            };
            let Some(s) = cand else { break };
            self.kept.remove(&s);
            if self.try_retire(s, max_ranges) {
                out.push(s);
            }
        }
        self.fresh.clear();
        out
    }

    /// Whether this side keeps incoming state for `stream`.
    pub fn has_stream(&self, stream: u32) -> bool {
        self.streams.contains_key(&stream)
    }

    /// Whether `stream`'s incoming direction ended and was forgotten (`try_retire`).
    pub fn is_retired(&self, stream: u32) -> bool {
        self.retired.contains(stream)
    }

    /// Fail every posted receive not yet completed (the connection ended).
    pub fn flush_receives(&mut self, conn: ConnectionHandle, events: &mut VecDeque<Event>) {
        self.take_flushed(conn, events);
        let mut ids: Vec<_> = self.streams.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let Some(st) = self.streams.get_mut(&id) else {
                continue;
            };
            flush_posted(conn, id, st, events);
        }
    }

    pub fn on_send(
        &mut self,
        conn: ConnectionHandle,
        hdr: &SendEth,
        payload: &[u8],
        lim: &RecvLimits,
        mrs: &mut MrTable,
        events: &mut VecDeque<Event>,
    ) -> RxOutcome {
        self.buf.explicit = lim.explicit_consume;
        let total = hdr.msg_len as u64;
        let valid = total <= lim.max_message_size
            && check_segment(hdr.offset, payload.len(), total, lim.pmtu);
        if self.unanswered.contains(hdr.stream_id) {
            // Stopped before anything of it was delivered, and forgotten: nothing of it is
            // ever delivered, so nothing is acknowledged (the sender waits until the STOP
            // flushes it, as for the stopped stream it was).
            self.stats.stopped_naks += 1;
            return RxOutcome::FlowRnr;
        }
        if self.retired.contains(hdr.stream_id) {
            // A late copy of a message of a stream that ended. An invalid one was refused
            // when it first came, and is refused again (acknowledging it would complete
            // its SEND `Success`, found by review: delivery had already passed the
            // refusal's record when the stream was retired). Any other was delivered, or
            // is dead after a reset (flushed at the sender) and none took a receive too
            // short for it (`try_retire`): what a duplicate gets.
            self.stats.retired_stream_packets += 1;
            if !valid {
                return RxOutcome::Nak(NAK_INVALID_REQUEST);
            }
            return RxOutcome::Accepted;
        }
        if self
            .refused_new
            .get(hdr.stream_id)
            .is_some_and(|&first| !seq_before(hdr.msg_seq, first))
        {
            // A copy of a refused message, or of a later one of its stream: the sender
            // failed or flushes its SEND (see `refused_new`). Counted as a copy only when
            // the record decided it: with the table still full it is refused for want of
            // room anyway (found by review: every re-sent copy at a full table counted).
            self.stats.refused_streams += 1;
            if self.streams.contains_key(&hdr.stream_id)
                || self.streams.len() < lim.max_streams as usize
            {
                self.stats.refused_copies += 1;
            }
            return RxOutcome::StreamRefused;
        }
        if !self.streams.contains_key(&hdr.stream_id)
            && self.streams.len() >= lim.max_streams as usize
        {
            self.stats.refused_streams += 1;
            self.record_refused_stream(hdr.stream_id, hdr.msg_seq, lim);
            return RxOutcome::StreamRefused;
        }
        let st = self.streams.entry(hdr.stream_id).or_default();
        if st.dead_from.is_some_and(|d| !seq_before(hdr.msg_seq, d)) {
            // A message of a dead stream (a copy sent before the abort, or overtaken by
            // it): its SEND is already flushed at the sender.
            return RxOutcome::Accepted;
        }
        if st.fin_at.is_some_and(|f| !seq_before(hdr.msg_seq, f)) {
            // Beyond the FIN: the stream has fewer messages. Placing it would write into a
            // receive that delivery flushes at the FIN (found by review).
            self.stats.beyond_fin_naks += 1;
            return RxOutcome::Nak(NAK_INVALID_REQUEST);
        }
        if st.stopped_at.is_some_and(|n| !seq_before(hdr.msg_seq, n)) {
            // This side stopped the stream before this message: it is never delivered,
            // and never acknowledged (that would complete it Success at the sender); the
            // sender waits (flow-control RNR) until the STOP flushes it.
            self.stats.stopped_naks += 1;
            return RxOutcome::FlowRnr;
        }
        if !valid {
            // Refuse the whole message (every packet of it gets this NAK) and let delivery
            // skip it, so later messages of the stream are not stuck behind it.
            let ahead = hdr.msg_seq.wrapping_sub(st.next_deliver);
            let room = ahead == 0 || self.buf.refused < lim.max_tracked_ops as usize;
            let can_record = (ahead == 0 || ahead < lim.max_stream_window) && room;
            if !can_record && !st.refused.contains(&hdr.msg_seq) {
                // A refusal that cannot be recorded would leave a gap delivery
                // never passes (later SENDs acknowledged, never delivered: found by review):
                // let the sender come back, as for a valid message.
                self.stats.stream_window_naks += 1;
                return RxOutcome::FlowRnr;
            }
            if can_record && st.refused.insert(hdr.msg_seq) {
                self.buf.refused += 1;
                // Later messages already bound to receives counted this one as taking a
                // receive (it was valid when they came), as did this one if it was bound
                // itself: it keeps that receive, completed in error when delivery reaches
                // it, so their bindings hold (found by review: receives were completed
                // twice and a buffer already delivered was overwritten).
                let bound = st.msgs.iter().any(|(&m, msg)| {
                    !seq_before(m, hdr.msg_seq) && matches!(msg.dest, Dest::Posted(_))
                });
                if st.posted_mode && bound {
                    st.refused_recv
                        .insert(hdr.msg_seq, (hdr.msg_len, WcStatus::LocalLengthError));
                }
                if let Some(msg) = st.msgs.remove(&hdr.msg_seq) {
                    self.buf.release_msg(st, &msg);
                }
                Self::deliver(
                    conn,
                    hdr.stream_id,
                    st,
                    &mut self.buf,
                    &mut self.stats,
                    events,
                );
            }
            return RxOutcome::Nak(NAK_INVALID_REQUEST);
        }
        if lim.require_posted_receives {
            st.posted_mode = true;
        }
        if let Some(&(_, syndrome)) = st.len_errors.iter().find(|e| e.0 == hdr.msg_seq) {
            return RxOutcome::Nak(syndrome);
        }
        if seq_before(hdr.msg_seq, st.next_deliver) {
            self.stats.duplicates += 1;
            return RxOutcome::Accepted;
        }
        let ahead = hdr.msg_seq.wrapping_sub(st.next_deliver);
        if ahead != 0 && ahead >= lim.max_stream_window {
            // Too far ahead of delivery (the peer's window may be larger than ours): refuse
            // with a flow-control RNR NAK, never acknowledged, so the sender waits and
            // re-sends it once delivery has moved on. A silent drop cost the sender its
            // retry budget and the connection (RetryExceeded). The next message due is
            // always admitted, so a window of 0 acts as 1.
            self.stats.stream_window_naks += 1;
            return RxOutcome::FlowRnr;
        }
        let nsegs = segs_of(hdr.msg_len, lim.pmtu).max(1);
        if !st.msgs.contains_key(&hdr.msg_seq) {
            let mut over = false;
            let mut floor = false;
            let mut charge = 0;
            let dest = if st.posted_mode {
                let ahead = st.receive_index(hdr.msg_seq);
                if ahead as usize >= st.posted.len() {
                    if ahead != 0 {
                        // No receive for it, but an earlier message of the stream still
                        // needs one too (or is arriving into its own): as on an IBA RC QP,
                        // where the responder RNR-NAKs only the message at the head of its
                        // receive queue, only the message whose receive is next draws an
                        // RNR NAK that counts against the sender's `rnr_retry`. A later one
                        // waits with a flow-control RNR NAK. Counting it let a later SEND
                        // run out of RNR retries first: the stream was aborted from it
                        // while the earlier one was still being retried, the receiver took
                        // that abort for the stream's end, and a delayed copy of the
                        // earlier SEND, which then failed RnrRetryExceeded at the sender,
                        // found a receive posted meanwhile and was delivered (found by
                        // `prop_rdma`, CI, 2026-12-07).
                        self.stats.stream_window_naks += 1;
                        return RxOutcome::FlowRnr;
                    }
                    self.stats.rnr_naks += 1;
                    return RxOutcome::Rnr;
                }
                let r = st.posted[ahead as usize];
                // The receive cannot take the message: too short (IBA length error: the
                // sender gets "invalid request"), or its region can no longer be written
                // (deregistered: "remote operational error"). The receive completes in
                // error (IBA: the WQE completes in error) and delivery skips the message.
                let failed = if hdr.msg_len > r.len {
                    Some((WcStatus::LocalLengthError, NAK_INVALID_REQUEST))
                } else if mrs
                    .check_local_write(r.lkey, r.offset, hdr.msg_len as u64)
                    .is_err()
                {
                    Some((WcStatus::LocalProtectionError, NAK_REMOTE_OPERATIONAL))
                } else {
                    None
                };
                if let Some((status, syndrome)) = failed {
                    if ahead != 0 {
                        // But receives complete in order: the error waits until every
                        // message before it is delivered. Refuse it for now with a
                        // flow-control RNR NAK (the sender waits and re-sends it without
                        // limit); a silent drop cost the sender its retry budget and the
                        // connection (RetryExceeded) while it waited for the earlier
                        // messages, and with no record at all (the region case) delivery
                        // stayed at the message for good (found by review).
                        self.stats.stream_window_naks += 1;
                        return RxOutcome::FlowRnr;
                    }
                    st.posted.pop_front();
                    // Delivery skips it (it may not be at the head yet: messages arriving
                    // into library buffers may precede it).
                    if st.refused.insert(hdr.msg_seq) {
                        self.buf.refused += 1;
                    }
                    st.note_len_error(hdr.msg_seq, syndrome);
                    let wc = WorkCompletion {
                        wr_id: r.wr_id,
                        status,
                        opcode: WcOpcode::Recv,
                        byte_len: hdr.msg_len,
                    };
                    events.push_back(Event::RecvCompletion {
                        conn,
                        stream: hdr.stream_id,
                        wc,
                    });
                    Self::deliver(
                        conn,
                        hdr.stream_id,
                        st,
                        &mut self.buf,
                        &mut self.stats,
                        events,
                    );
                    return RxOutcome::Nak(syndrome);
                }
                Dest::Posted(r)
            } else {
                // The next message due on a stream may go beyond the budget, so that every
                // stream can progress however the budget is used by messages further
                // ahead; those messages share a reserve of the same size (or, one at a
                // time, may be as large as max_message_size), so the peer cannot make the
                // receiver hold one such message per stream.
                let head = ahead == 0;
                charge = total + MSG_OVERHEAD;
                let explicit = lim.explicit_consume;
                // The endpoint's cap on delivered, unread bytes over all its connections (a
                // peer's connections are cheap, and each holds its own budgets). Only the
                // application's reads lower it, never the transport's progress, so an
                // application that reads what it is given cannot be stalled by it.
                if lim.endpoint_unread_full {
                    self.stats.memory_rnr_naks += 1;
                    return RxOutcome::FlowRnr;
                }
                // The endpoint's cap on messages being reassembled, over all its connections
                // (each connection's own budgets below scale with their number). A message
                // further ahead only comes in below the cap, so those never hold more than
                // it; the next message due on its stream may also come in while the total
                // stays under twice the cap, or alone over the cap (one as large as
                // `max_message_size`). Such a message needs only its own packets to be
                // delivered, so next-due messages admitted always drain, and a next-due
                // message refused gets in once they have: no stream waits for good on
                // messages further ahead, as under a single cap (which deadlocked after one
                // lost packet).
                //
                // Such messages can also be held by a peer that never finishes them (two
                // first packets of maximum-size messages reach twice the cap: found by
                // review), and no timeout can tell that peer from slow honest ones. So each
                // connection may also have one next-due message of at most
                // `reassembly_floor_bytes` in beyond the cap: small messages (requests,
                // control) of every connection keep flowing whoever holds the cap.
                let ep_total = lim.endpoint_reassembly_others + self.buf.reassembly();
                let cap = lim.max_reassembly_bytes;
                let ep_ok = if head {
                    ep_total <= cap || ep_total + charge <= cap.saturating_mul(2)
                } else {
                    ep_total + charge <= cap
                };
                floor = !ep_ok
                    && head
                    && self.buf.floor == 0
                    && lim.reassembly_floor_bytes > 0
                    && charge <= lim.reassembly_floor_bytes.saturating_add(MSG_OVERHEAD);
                if !ep_ok && !floor {
                    self.stats.reassembly_rnr_naks += 1;
                    return RxOutcome::FlowRnr;
                }
                if explicit {
                    // Receive flow control: the stream's limit. The next message due is
                    // checked against delivered, unconsumed bytes only, so messages
                    // further ahead cannot keep it out (they could never be delivered).
                    let held = if head {
                        st.unconsumed
                    } else {
                        st.unconsumed + st.buffered
                    };
                    if held > 0 && held + charge > lim.max_stream_recv_bytes {
                        self.stats.flow_rnr_naks += 1;
                        return RxOutcome::FlowRnr;
                    }
                }
                if self.buf.bytes + charge > lim.max_recv_buffer_bytes {
                    // With flow control the reserve for next-due messages is closed while
                    // unconsumed bytes fill the budget: otherwise every stream's head could
                    // come in through it, one after the other, without bound.
                    let unconsumed_ok = !explicit
                        || self.buf.unconsumed == 0
                        || self.buf.unconsumed + charge <= lim.max_recv_buffer_bytes;
                    over = head
                        && unconsumed_ok
                        && (self.buf.over == 0
                            || self.buf.over + charge <= lim.max_recv_buffer_bytes);
                    if !over {
                        // Wait, do not drop: a drop costs the sender timeouts, and a
                        // message held out for longer than `retry_count` timeouts (behind
                        // a long next-due message filling the reserve) failed every path
                        // and the connection with RetryExceeded — with or without flow
                        // control.
                        if explicit {
                            self.stats.flow_rnr_naks += 1;
                        } else {
                            self.stats.no_buffer_drops += 1;
                        }
                        return RxOutcome::FlowRnr;
                    }
                    self.buf.over += charge;
                }
                self.buf.bytes += charge;
                if floor {
                    self.buf.floor += charge;
                }
                st.buffered += charge;
                Dest::Owned(vec![0; hdr.msg_len as usize])
            };
            self.buf.msgs += 1;
            st.msgs.insert(
                hdr.msg_seq,
                RxMsg {
                    dest,
                    charge,
                    over,
                    floor,
                    len: hdr.msg_len,
                    got: super::segbits::SegBits::zeroed(nsegs.div_ceil(64) as usize),
                    got_segs: 0,
                    nsegs,
                },
            );
        }
        let Some(msg) = st.msgs.get_mut(&hdr.msg_seq) else {
            return RxOutcome::Drop;
        };
        if msg.nsegs != nsegs || msg.len != hdr.msg_len {
            // Same message sequence number, different length: a confused or hostile peer.
            return RxOutcome::Nak(NAK_INVALID_REQUEST);
        }
        if !test_set(&mut msg.got, seg_of(hdr.offset, lim.pmtu)) {
            self.stats.duplicates += 1;
            return RxOutcome::Accepted;
        }
        let off = hdr.offset as usize;
        match &mut msg.dest {
            Dest::Owned(data) => data[off..off + payload.len()].copy_from_slice(payload),
            Dest::Posted(r) => {
                if !payload.is_empty()
                    && mrs
                        .local_write(r.lkey, r.offset + off as u64, payload)
                        .is_err()
                {
                    // The receive's region went away after the message began landing in
                    // it (deregistered by the application). The whole message fails as at
                    // admission: its receive completes `LocalProtectionError` when
                    // delivery reaches it, delivery skips it, and every packet of it —
                    // this one re-sent after a lost NAK too — is NAKed 0x63. Leaving the
                    // segment marked received let a re-sent copy be acknowledged as a
                    // duplicate (the SEND completed `Success` with its bytes never
                    // placed) and kept the message, and its stream, from ever completing
                    // (found by review). One reassembly entry becomes one refusal record.
                    let msg_seq = hdr.msg_seq;
                    if let Some(msg) = st.msgs.remove(&msg_seq) {
                        self.buf.release_msg(st, &msg);
                    }
                    if st.refused.insert(msg_seq) {
                        self.buf.refused += 1;
                    }
                    st.refused_recv
                        .insert(msg_seq, (hdr.msg_len, WcStatus::LocalProtectionError));
                    st.note_len_error(msg_seq, NAK_REMOTE_OPERATIONAL);
                    Self::deliver(
                        conn,
                        hdr.stream_id,
                        st,
                        &mut self.buf,
                        &mut self.stats,
                        events,
                    );
                    return RxOutcome::Nak(NAK_REMOTE_OPERATIONAL);
                }
            }
        }
        msg.got_segs += 1;
        Self::deliver(
            conn,
            hdr.stream_id,
            st,
            &mut self.buf,
            &mut self.stats,
            events,
        );
        RxOutcome::Accepted
    }

    /// Deliver every complete message at the head of the stream, in order.
    fn deliver(
        conn: ConnectionHandle,
        stream: u32,
        st: &mut StreamRx,
        buf: &mut Budget,
        stats: &mut RecvStats,
        events: &mut VecDeque<Event>,
    ) {
        loop {
            if st.dead_from == Some(st.next_deliver) {
                flush_posted(conn, stream, st, events);
                if !st.end_reported {
                    st.end_reported = true;
                    events.push_back(Event::StreamReset {
                        conn,
                        stream,
                        code: st.reset_code,
                    });
                }
                break;
            }
            if st.fin_at == Some(st.next_deliver) {
                // Every message is delivered and none will follow: a receive still posted
                // would wait forever (and keep the stream from closing).
                flush_posted(conn, stream, st, events);
                if !st.end_reported {
                    st.end_reported = true;
                    events.push_back(Event::StreamFinished { conn, stream });
                }
                break;
            }
            if st
                .stopped_at
                .is_some_and(|n| !seq_before(st.next_deliver, n))
            {
                // Stopped by this side: nothing more is delivered (the reset for the STOP
                // ends the stream above).
                break;
            }
            if st.refused.remove(&st.next_deliver) {
                buf.refused -= 1;
                if let Some((len, status)) = st.refused_recv.remove(&st.next_deliver) {
                    if let Some(r) = st.posted.pop_front() {
                        let wc = WorkCompletion {
                            wr_id: r.wr_id,
                            status,
                            opcode: WcOpcode::Recv,
                            byte_len: len,
                        };
                        events.push_back(Event::RecvCompletion { conn, stream, wc });
                    }
                }
                st.next_deliver = st.next_deliver.wrapping_add(1);
                continue;
            }
            if st
                .msgs
                .get(&st.next_deliver)
                .is_none_or(|m| m.got_segs != m.nsegs)
            {
                break;
            }
            let Some(m) = st.msgs.remove(&st.next_deliver) else {
                break;
            };
            stats.messages += 1;
            stats.message_bytes += m.len as u64;
            buf.delivered(st, &m);
            match m.dest {
                Dest::Owned(data) => {
                    events.push_back(Event::Message {
                        conn,
                        stream,
                        data: Bytes::from(data),
                    });
                }
                Dest::Posted(r) => {
                    st.posted.pop_front();
                    let wc = WorkCompletion {
                        wr_id: r.wr_id,
                        status: WcStatus::Success,
                        opcode: WcOpcode::Recv,
                        byte_len: m.len,
                    };
                    events.push_back(Event::RecvCompletion { conn, stream, wc });
                }
            }
            st.next_deliver = st.next_deliver.wrapping_add(1);
        }
    }

    /// What is known of an operation id.
    fn op_state(&self, id: u32) -> OpState {
        if let Some(&syndrome) = self.refused_ops.get(id) {
            OpState::Refused(syndrome)
        } else if seq_before(id, self.write_floor) || self.writes_done.contains(&id) {
            OpState::Executed
        } else {
            OpState::Open
        }
    }

    /// Whether `id` lies `max_tracked_ops` or more ahead of the floor of finished op ids: an
    /// honest requester's ids are never that far ahead of the oldest one it still awaits
    /// (the responder takes at most that many), so such a packet is not executed.
    fn op_ahead(&self, id: u32, lim: &RecvLimits) -> bool {
        !seq_before(id, self.write_floor)
            && id.wrapping_sub(self.write_floor) >= lim.max_tracked_ops
    }

    /// Remember what executed op id `id` did (bounded, oldest evicted first).
    fn record_executed(&mut self, id: u32, params: OpParams, lim: &RecvLimits) {
        self.executed.record(id, params, lim.max_tracked_ops);
    }

    /// A packet with op id `id` whose parameters differ from the operation that holds the
    /// id: refused with "invalid request", counted, nothing recorded.
    fn mismatch(&mut self) -> RxOutcome {
        self.stats.op_mismatches += 1;
        RxOutcome::Nak(NAK_INVALID_REQUEST)
    }

    /// Whether a new operation id may be tracked: the tracking set has room, or the id is
    /// the floor itself (finishing it never grows the set, so the oldest open operation can
    /// always complete).
    fn can_track(&self, id: u32, lim: &RecvLimits) -> bool {
        id == self.write_floor
            || self.writes.contains_key(&id)
            || self.writes.len() + self.writes_done.len() < lim.max_tracked_ops as usize
    }

    /// The answer to a request whose op id was seen before, ahead of every other check (a
    /// re-sent request must get the answer the first copy got, whatever changed since:
    /// region deregistered, responder busy).
    ///
    /// Checks, in order: op id `max_tracked_ops` or more ahead of the floor → dropped
    /// unacknowledged (counted in `op_id_out_of_window`); refused before → the same NAK;
    /// executed (or in progress) under other parameters → NAK 0x61 (counted in
    /// `op_mismatches`); executed with the same parameters, or so long ago that its record
    /// was evicted → acknowledged as a duplicate.
    fn seen_answer(&mut self, id: u32, params: &OpParams, lim: &RecvLimits) -> Option<RxOutcome> {
        if self.op_ahead(id, lim) {
            self.stats.op_id_out_of_window += 1;
            return Some(RxOutcome::Drop);
        }
        match self.op_state(id) {
            OpState::Open => match self.writes.get(&id) {
                Some(t) if t.params != *params => Some(self.mismatch()),
                _ => None,
            },
            OpState::Executed => {
                if self
                    .executed
                    .get(id, lim.max_tracked_ops)
                    .is_some_and(|p| p != params)
                {
                    return Some(self.mismatch());
                }
                self.stats.duplicates += 1;
                Some(RxOutcome::Accepted)
            }
            OpState::Refused(syndrome) => Some(RxOutcome::Nak(syndrome)),
        }
    }

    /// Refuse operation `id` for good with NAK `syndrome`: recorded (bounded) so that a
    /// re-sent request gets the same NAK, and counted as finished so the floor moves on.
    /// With the tracking set full it is not recorded: a re-sent packet is checked again.
    fn refuse_op(&mut self, id: u32, syndrome: u8, lim: &RecvLimits) -> RxOutcome {
        if !self.can_track(id, lim) {
            return RxOutcome::Nak(syndrome);
        }
        if self.op_state(id) == OpState::Open {
            self.record_refusal(id, syndrome, lim);
        }
        self.finish_write(id);
        RxOutcome::Nak(syndrome)
    }

    /// Record that message `msg_seq` of `stream`, which has no state, was refused (see
    /// `refused_new`); the oldest record goes when there are more than `max_tracked_ops`.
    fn record_refused_stream(&mut self, stream: u32, msg_seq: u32, lim: &RecvLimits) {
        let max = lim.max_tracked_ops as usize;
        self.refused_new.record(stream, msg_seq, max, |first, m| {
            if seq_before(m, *first) {
                *first = m;
            }
        });
    }

    /// Record op id `id` as refused with `syndrome`; the oldest record goes when there are
    /// more than `max_tracked_ops`.
    fn record_refusal(&mut self, id: u32, syndrome: u8, lim: &RecvLimits) {
        let max = lim.max_tracked_ops as usize;
        self.refused_ops
            .record(id, syndrome, max, |old, new| *old = new);
    }

    /// An RDMA READ request: check it, execute it once, and return the data to send back.
    /// `busy`: the responder's `max_rd_atomic` response resources are all in use.
    ///
    /// Checks, in order: op id seen before (executed: acknowledged, nothing else — its
    /// response is already reliable data of this side; refused: the same NAK again); busy
    /// or op id tracking full → RNR NAK (nothing recorded); length → NAK 0x61; access →
    /// NAK 0x62; then executed once.
    pub fn on_read_request(
        &mut self,
        mrs: &MrTable,
        reth: &Reth,
        op: &WriteEth,
        lim: &RecvLimits,
        busy: bool,
    ) -> (RxOutcome, Option<Respond>) {
        let params = OpParams::read(reth);
        if let Some(out) = self.seen_answer(op.op_id, &params, lim) {
            return (out, None);
        }
        if busy || !self.can_track(op.op_id, lim) {
            return (RxOutcome::Rnr, None);
        }
        let len = reth.dma_len as u64;
        if len > lim.max_message_size {
            return (self.refuse_op(op.op_id, NAK_INVALID_REQUEST, lim), None);
        }
        let (lkey, offset) = if len == 0 {
            (0, 0)
        } else {
            match mrs.remote_read_source(reth.rkey, reth.va, len) {
                Ok(src) => src,
                Err(_) => return (self.refuse_op(op.op_id, NAK_REMOTE_ACCESS, lim), None),
            }
        };
        self.finish_write(op.op_id);
        self.record_executed(op.op_id, params, lim);
        self.stats.reads += 1;
        (
            RxOutcome::Accepted,
            Some(Respond::Read {
                req_id: op.op_id,
                lkey,
                rkey: reth.rkey,
                offset,
                len: reth.dma_len,
            }),
        )
    }

    /// The response of the executed READ `id` cannot be sent: its source region was
    /// deregistered while the response was queued. The op id's record turns into a refusal
    /// with NAK 0x62 (bounded like every refusal), so the request its requester re-sends
    /// when its response wait expires is NAKed and the READ completes
    /// `RemoteAccessError`, never `Success` (IBA §9.7.5.2.x: a protection error found
    /// while responding). Counted in [`RecvStats::read_responses_revoked`].
    pub fn revoke_read(&mut self, id: u32, lim: &RecvLimits) {
        self.stats.read_responses_revoked += 1;
        self.record_refusal(id, NAK_REMOTE_ACCESS, lim);
    }

    /// An atomic request: check it, execute it exactly once, return the original value.
    /// Checks in the order of [`RecvState::on_read_request`] (VA alignment → NAK 0x61).
    pub fn on_atomic(
        &mut self,
        mrs: &mut MrTable,
        at: &AtomicEth,
        op: &WriteEth,
        fetch_add: bool,
        lim: &RecvLimits,
        busy: bool,
    ) -> (RxOutcome, Option<Respond>) {
        let params = OpParams::atomic(at, fetch_add);
        if let Some(out) = self.seen_answer(op.op_id, &params, lim) {
            return (out, None);
        }
        if busy || !self.can_track(op.op_id, lim) {
            return (RxOutcome::Rnr, None);
        }
        if at.va % 8 != 0 {
            return (self.refuse_op(op.op_id, NAK_INVALID_REQUEST, lim), None);
        }
        let (swap_add, compare) = (at.swap_add, at.compare);
        let res = mrs
            .check_remote(at.rkey, at.va, 8, Access::REMOTE_ATOMIC)
            .and_then(|_| {
                mrs.remote_atomic(at.rkey, at.va, |old| {
                    if fetch_add {
                        old.wrapping_add(swap_add)
                    } else if old == compare {
                        swap_add
                    } else {
                        old
                    }
                })
            });
        let Ok(orig) = res else {
            return (self.refuse_op(op.op_id, NAK_REMOTE_ACCESS, lim), None);
        };
        self.finish_write(op.op_id);
        self.record_executed(op.op_id, params, lim);
        self.stats.atomics += 1;
        (
            RxOutcome::Accepted,
            Some(Respond::Atomic {
                req_id: op.op_id,
                orig,
            }),
        )
    }

    /// A packet of an RDMA WRITE. Checks, in order: op id seen before (finished:
    /// acknowledged as a duplicate, nothing written; refused: the same NAK again); length
    /// → NAK 0x61; segment → NAK 0x61; access (the whole message) → NAK 0x62; op id
    /// tracking full → dropped unacknowledged; then placed.
    #[allow(clippy::too_many_arguments)]
    pub fn on_write(
        &mut self,
        conn: ConnectionHandle,
        mrs: &mut MrTable,
        reth: &Reth,
        hdr: &WriteEth,
        imm: Option<u32>,
        payload: &[u8],
        lim: &RecvLimits,
        events: &mut VecDeque<Event>,
    ) -> RxOutcome {
        self.buf.explicit = lim.explicit_consume;
        let id = hdr.op_id;
        let params = OpParams::write(reth, imm);
        if let Some(out) = self.seen_answer(id, &params, lim) {
            return out;
        }
        let total = reth.dma_len as u64;
        if total > lim.max_message_size {
            return self.refuse_op(id, NAK_INVALID_REQUEST, lim);
        }
        if !check_segment(hdr.offset, payload.len(), total, lim.pmtu) {
            return RxOutcome::Nak(NAK_INVALID_REQUEST);
        }
        // The access check covers the whole message, so every packet of a bad WRITE is
        // refused and none of its bytes land. Zero-length WRITEs are not checked (IBA).
        let slot = if total > 0 {
            match mrs.check_remote(reth.rkey, reth.va, total, Access::REMOTE_WRITE) {
                Ok(s) => Some(s),
                Err(_) => return self.refuse_op(id, NAK_REMOTE_ACCESS, lim),
            }
        } else {
            None
        };
        let nsegs = segs_of(reth.dma_len, lim.pmtu).max(1);
        if self.writes.is_empty() || !self.writes.contains_key(&id) {
            let words = nsegs.div_ceil(64) as usize;
            let room = self.write_words + words <= lim.max_tracked_ops as usize * 64;
            if !self.can_track(id, lim) || !(room || id == self.write_floor) {
                self.stats.no_buffer_drops += 1;
                return RxOutcome::Drop;
            }
            if nsegs == 1 && imm.is_none() {
                // A one-packet WRITE without immediate (issue #13): placed and finished
                // here, never entered in `writes` (the general path below would insert it
                // and remove it again at once; no immediate means neither immediate check
                // below applies).
                if !payload.is_empty() {
                    let va = reth.va.wrapping_add(hdr.offset as u64);
                    let placed = match slot {
                        Some(s) => mrs.remote_write_in(s, va, payload),
                        None => mrs.remote_write(reth.rkey, va, payload),
                    };
                    if placed.is_err() {
                        // As the general path leaves it: the segment seen, not finished.
                        let mut got = super::segbits::SegBits::zeroed(1);
                        test_set(&mut got, 0);
                        self.write_words += words;
                        self.writes.insert(
                            id,
                            WriteTrack {
                                params,
                                got,
                                got_segs: 0,
                                nsegs,
                            },
                        );
                        return RxOutcome::Nak(NAK_REMOTE_ACCESS);
                    }
                    self.stats.write_bytes += payload.len() as u64;
                }
                self.finish_write(id);
                self.record_executed(id, params, lim);
                self.take_released(conn, events);
                return RxOutcome::Accepted;
            }
            self.write_words += words;
        }
        let t = self.writes.entry(id).or_insert_with(|| WriteTrack {
            params,
            got: super::segbits::SegBits::zeroed(nsegs.div_ceil(64) as usize),
            got_segs: 0,
            nsegs,
        });
        if t.nsegs != nsegs {
            return RxOutcome::Nak(NAK_INVALID_REQUEST);
        }
        let seg = seg_of(hdr.offset, lim.pmtu);
        let new_seg = t.got[(seg / 64) as usize] & (1 << (seg % 64)) == 0;
        // The WRITE_WITH_IMM fence: the packet that would complete a WRITE with immediate
        // whose immediate would have to be held (an earlier op id is not finished) while
        // `max_held_immediates` are held already is dropped unacknowledged, before it is
        // placed; the requester re-sends it. The op id at the floor is always taken (its
        // immediate is released at once), so the oldest operation can always finish.
        if new_seg
            && imm.is_some()
            && t.got_segs + 1 == t.nsegs
            && id != self.write_floor
            && self.held_imms.len() >= lim.max_held_immediates as usize
        {
            self.stats.held_immediate_drops += 1;
            return RxOutcome::Drop;
        }
        // Receive flow control of immediates (`max_unconsumed_immediates`): the packet that
        // would complete a WRITE with immediate while the application has that many
        // notifications outstanding waits (flow-control RNR NAK), before it is placed. The
        // oldest unfinished operation counts only the reported ones, so immediates held
        // behind it cannot block it (it would release them).
        if new_seg && imm.is_some() && t.got_segs + 1 == t.nsegs && lim.explicit_consume {
            let held = if id == self.write_floor {
                0
            } else {
                self.held_imms.len() as u32
            };
            if self.unconsumed_imms.saturating_add(held) >= lim.max_unconsumed_immediates {
                self.stats.flow_rnr_naks += 1;
                self.stats.imm_flow_rnr_naks += 1;
                return RxOutcome::FlowRnr;
            }
        }
        if !test_set(&mut t.got, seg) {
            self.stats.duplicates += 1;
            return RxOutcome::Accepted;
        }
        if !payload.is_empty() {
            let va = reth.va.wrapping_add(hdr.offset as u64);
            if mrs.remote_write(reth.rkey, va, payload).is_err() {
                return RxOutcome::Nak(NAK_REMOTE_ACCESS);
            }
            self.stats.write_bytes += payload.len() as u64;
        }
        t.got_segs += 1;
        if t.got_segs == t.nsegs {
            // Held until every earlier op id is finished; `finish_write` releases it (at
            // once when this op id is the floor).
            if let Some(imm) = imm {
                self.held_imms.insert(id, (imm, reth.dma_len));
            }
            self.finish_write(id);
            self.record_executed(id, params, lim);
            self.take_released(conn, events);
        }
        RxOutcome::Accepted
    }

    /// Report the immediates the floor of finished op ids released, in op id order, as
    /// [`Event::WriteWithImm`].
    pub fn take_released(&mut self, conn: ConnectionHandle, events: &mut VecDeque<Event>) {
        if self.released_imms.is_empty() {
            return;
        }
        if self.buf.explicit {
            self.unconsumed_imms = self
                .unconsumed_imms
                .saturating_add(self.released_imms.len() as u32);
        }
        for (imm, byte_len) in self.released_imms.drain(..) {
            events.push_back(Event::WriteWithImm {
                conn,
                imm,
                byte_len,
            });
        }
    }

    /// An op abort (`MR_WRITE` with PathEth flags bit 1): the requester gave up on the
    /// operation with op id `id` (a WRITE that failed locally, or any operation it
    /// cancelled) and sends none of its remaining packets. The op id counts as
    /// finished (what already landed stays; no immediate is reported), so the floor of
    /// finished op ids moves past it. A finished or refused id is acknowledged as a
    /// duplicate; an id beyond the tracking limit is dropped unacknowledged (re-sent later),
    /// like a WRITE packet.
    pub fn on_op_abort(&mut self, id: u32, lim: &RecvLimits) -> RxOutcome {
        if self.op_ahead(id, lim) {
            self.stats.op_id_out_of_window += 1;
            return RxOutcome::Drop;
        }
        if self.op_state(id) != OpState::Open {
            self.stats.duplicates += 1;
            return RxOutcome::Accepted;
        }
        if !self.can_track(id, lim) {
            self.stats.no_buffer_drops += 1;
            return RxOutcome::Drop;
        }
        self.stats.aborted_ops += 1;
        self.finish_write(id);
        RxOutcome::Accepted
    }

    /// The application consumed `n` reported immediates (`explicit_consume`); more than
    /// were reported is ignored.
    pub fn immediates_consumed(&mut self, n: u32) {
        self.unconsumed_imms = self.unconsumed_imms.saturating_sub(n);
    }

    /// Record operation `id` as finished (executed or refused).
    ///
    /// `write_floor` is never in `writes_done` (each call moves every finished id at the
    /// floor below it), so an id other than the floor only joins `writes_done`, and the
    /// floor itself moves on without entering it (issue #13: in-order completions, the
    /// common case, touch no set but an empty one).
    fn finish_write(&mut self, id: u32) {
        if !self.writes.is_empty() {
            if let Some(t) = self.writes.remove(&id) {
                self.write_words -= t.got.len();
            }
        }
        if seq_before(id, self.write_floor) {
            return;
        }
        if id != self.write_floor {
            self.writes_done.insert(id);
            return;
        }
        loop {
            if !self.held_imms.is_empty() {
                if let Some(r) = self.held_imms.remove(&self.write_floor) {
                    self.released_imms.push_back(r);
                }
            }
            self.write_floor = self.write_floor.wrapping_add(1);
            if !self.writes_done.remove(&self.write_floor) {
                break;
            }
        }
    }

    /// Bytes delivered and not yet consumed (`RecvStats::unconsumed_bytes`).
    pub fn unconsumed_bytes(&self) -> u64 {
        self.buf.unconsumed
    }

    /// Bytes of messages in library-owned buffers not yet delivered (being reassembled, or
    /// complete and waiting for an earlier message of their stream), with bookkeeping.
    pub fn reassembly_bytes(&self) -> u64 {
        self.buf.reassembly()
    }

    /// The counters, with the gauges filled in.
    pub fn stats(&self) -> RecvStats {
        // The count agrees with the maps (checked where that is cheap).
        debug_assert!(
            self.streams.len() > 64
                || self.buf.msgs == self.streams.values().map(|st| st.msgs.len() as u64).sum()
        );
        RecvStats {
            tracked_ops: (self.writes.len()
                + self.writes_done.len()
                + self.refused_ops.len()
                + self.executed.len()) as u64,
            buffered_bytes: self.buf.bytes,
            write_track_bytes: self.write_words as u64 * 8,
            buffered_messages: self.buf.msgs,
            refused_messages: self.buf.refused as u64,
            streams: self.streams.len() as u64,
            retired_stream_ranges: self.retired.ranges() as u64,
            held_immediates: self.held_imms.len() as u64,
            unconsumed_immediates: self.unconsumed_imms as u64,
            unconsumed_bytes: self.buf.unconsumed,
            ..self.stats
        }
    }
}

/// Complete every receive still posted on `stream` with `WrFlushError`, in posting order:
/// nothing will land in them (the stream ended, or the connection did).
fn flush_posted(
    conn: ConnectionHandle,
    stream: u32,
    st: &mut StreamRx,
    events: &mut VecDeque<Event>,
) {
    for r in st.posted.drain(..) {
        events.push_back(Event::RecvCompletion {
            conn,
            stream,
            wc: flush_wc(r.wr_id),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recv(wr_id: u64) -> PostedRecv {
        PostedRecv {
            wr_id,
            lkey: 1,
            offset: 0,
            len: 10,
        }
    }

    /// Withdrawing a receive on each of n streams, each named, looks at n streams in all;
    /// unnamed, it searched every stream each time (O(n²): dropping the `recv_into`
    /// futures of a server with a receive per stream).
    #[test]
    fn withdrawing_with_the_stream_looks_at_that_stream_only() {
        let n = 2_000u32;
        let mut rq = RecvState::default();
        for s in 0..n {
            rq.post_recv(s, recv(u64::from(s)));
        }
        for s in (0..n).rev() {
            assert_eq!(rq.withdraw_recv(Some(s), u64::from(s)), Some(true));
            rq.flushed.clear();
        }
        assert_eq!(rq.withdraw_visits, u64::from(n));
        // The wrong stream does not find it; the right one, or none named, does.
        rq.post_recv(7, recv(70));
        assert_eq!(rq.withdraw_recv(Some(8), 70), None);
        assert_eq!(rq.withdraw_recv(None, 70), Some(true));
        assert_eq!(
            rq.withdraw_recv(Some(7), 70),
            Some(false),
            "flushed already"
        );
        rq.flushed.clear();
        // Unnamed: a search over the streams.
        rq.withdraw_visits = 0;
        for s in 0..n {
            rq.post_recv(s, recv(u64::from(s)));
        }
        for s in 0..n {
            assert_eq!(rq.withdraw_recv(None, u64::from(s)), Some(true));
            rq.flushed.clear();
        }
        assert!(
            rq.withdraw_visits > u64::from(n) * 50,
            "{}",
            rq.withdraw_visits
        );
    }

    /// A receive flushed on one stream, not yet reported, does not hide a receive with the
    /// same wr_id posted on another (ids may repeat): naming the stream finds it.
    #[test]
    fn a_flushed_receive_of_another_stream_does_not_hide_the_named_one() {
        let mut rq = RecvState::default();
        rq.post_recv(1, recv(5));
        rq.post_recv(2, recv(5));
        assert_eq!(rq.withdraw_recv(Some(1), 5), Some(true));
        assert_eq!(rq.withdraw_recv(Some(2), 5), Some(true));
        assert_eq!(rq.withdraw_recv(Some(2), 5), Some(false), "flushed already");
    }

    fn limits() -> RecvLimits {
        RecvLimits {
            pmtu: 1024,
            max_message_size: 1 << 20,
            max_recv_buffer_bytes: 1 << 20,
            max_stream_window: 64,
            max_streams: 64,
            max_ranges: closed_id_ranges(64),
            require_posted_receives: true,
            max_tracked_ops: 64,
            max_held_immediates: 64,
            max_unconsumed_immediates: 64,
            explicit_consume: false,
            max_stream_recv_bytes: 1 << 20,
            endpoint_unread_full: false,
            endpoint_reassembly_others: 0,
            max_reassembly_bytes: 1 << 20,
            reassembly_floor_bytes: 0,
        }
    }

    /// A receiver with room for one stream and no posted receives needed: its regions,
    /// limits, connection, state and event queue.
    fn one_slot() -> (
        crate::mr::MrTable,
        RecvLimits,
        ConnectionHandle,
        RecvState,
        VecDeque<Event>,
    ) {
        let mrs = crate::mr::MrTable::new(&mut crate::secret::SecretRng::new([7; 32]));
        let mut lim = limits();
        lim.max_streams = 1;
        lim.require_posted_receives = false;
        (
            mrs,
            lim,
            ConnectionHandle(1),
            RecvState::default(),
            VecDeque::new(),
        )
    }

    /// A one-byte message `msg_seq` of `stream_id`.
    fn msg(stream_id: u32, msg_seq: u32) -> crate::wire::SendEth {
        crate::wire::SendEth {
            stream_id,
            msg_seq,
            offset: 0,
            msg_len: 1,
        }
    }

    /// The records of refused streams (`refused_new`) stay within `max_tracked_ops`,
    /// refuse copies until the sender's abort comes, and go with it.
    #[test]
    fn refused_stream_records_are_bounded_and_go_with_the_abort() {
        let (mut mrs, mut lim, conn, mut rq, mut ev) = one_slot();
        // Stream 0 takes the one slot; the next 200 streams are refused.
        let out = rq.on_send(conn, &msg(0, 0), b"x", &lim, &mut mrs, &mut ev);
        assert_eq!(out, RxOutcome::Accepted);
        for s in 1..=200u32 {
            let out = rq.on_send(conn, &msg(2 * s, 3), b"x", &lim, &mut mrs, &mut ev);
            assert_eq!(out, RxOutcome::StreamRefused);
        }
        assert_eq!(rq.refused_new.len(), lim.max_tracked_ops as usize);
        assert!(rq.refused_new.order.len() <= lim.max_tracked_ops as usize);
        // Room comes: a copy of the newest refused message, or of a later one of its
        // stream, is refused again; an earlier message of that stream is taken.
        lim.max_streams = 4;
        let out = rq.on_send(conn, &msg(400, 3), b"x", &lim, &mut mrs, &mut ev);
        assert_eq!(out, RxOutcome::StreamRefused);
        let out = rq.on_send(conn, &msg(400, 9), b"x", &lim, &mut mrs, &mut ev);
        assert_eq!(out, RxOutcome::StreamRefused);
        assert_eq!(rq.stats.refused_copies, 2);
        let out = rq.on_send(conn, &msg(400, 0), b"x", &lim, &mut mrs, &mut ev);
        assert_eq!(out, RxOutcome::Accepted);
        // The oldest records were evicted: their streams are new again.
        let out = rq.on_send(conn, &msg(2, 3), b"x", &lim, &mut mrs, &mut ev);
        assert_eq!(out, RxOutcome::Accepted);
        // The sender's abort from the refused message ends the record; the stream's state
        // takes over (dead from message 3: a copy is acknowledged and dropped).
        rq.on_stream_abort(conn, 400, 3, u32::MAX - 1, &lim, &mut ev);
        assert!(rq.refused_new.get(400).is_none());
        let out = rq.on_send(conn, &msg(400, 3), b"x", &lim, &mut mrs, &mut ev);
        assert_eq!(out, RxOutcome::Accepted);
        assert_eq!(rq.stats.refused_copies, 2);
        // An abort from message 0 of a refused stream with no state closes its id without
        // state or a reset event, even with room.
        let before = ev.len();
        rq.on_stream_abort(conn, 398, 0, u32::MAX - 1, &lim, &mut ev);
        assert!(rq.refused_new.get(398).is_none());
        assert!(!rq.streams.contains_key(&398));
        assert_eq!(
            ev.len(),
            before,
            "{:?}",
            ev.iter().skip(before).collect::<Vec<_>>()
        );
    }

    /// Found by review: which aborts end a refusal record. One from a later message
    /// than the record's keeps it (the sender's abort from the refused message is still to
    /// come); one from an earlier message ends it; one waiting at a full table keeps it;
    /// and an id closed meanwhile takes its record with it.
    #[test]
    fn which_aborts_end_a_refusal_record() {
        let (mut mrs, mut lim, conn, mut rq, mut ev) = one_slot();
        let out = rq.on_send(conn, &msg(0, 0), b"x", &lim, &mut mrs, &mut ev);
        assert_eq!(out, RxOutcome::Accepted);
        // Streams 2 and 4 refused from message 3 (the table is full).
        for s in [2, 4] {
            let out = rq.on_send(conn, &msg(s, 3), b"x", &lim, &mut mrs, &mut ev);
            assert_eq!(out, RxOutcome::StreamRefused);
        }
        assert_eq!(rq.stats.refused_copies, 0);
        // At the full table a copy is refused for want of room: not counted as a copy.
        let out = rq.on_send(conn, &msg(2, 3), b"x", &lim, &mut mrs, &mut ev);
        assert_eq!(out, RxOutcome::StreamRefused);
        assert_eq!(rq.stats.refused_copies, 0);
        // An abort from message 3 at the full table waits, and keeps the record.
        let out = rq.on_stream_abort(conn, 2, 3, 1, &lim, &mut ev);
        assert_eq!(out, RxOutcome::FlowRnr);
        assert_eq!(rq.refused_new.get(2), Some(&3));
        lim.max_streams = 8;
        // An abort from a later message (5) keeps it: messages 3 and 4 are still refused.
        let out = rq.on_stream_abort(conn, 2, 5, 1, &lim, &mut ev);
        assert_eq!(out, RxOutcome::Accepted);
        assert_eq!(rq.refused_new.get(2), Some(&3));
        let out = rq.on_send(conn, &msg(2, 4), b"x", &lim, &mut mrs, &mut ev);
        assert_eq!(out, RxOutcome::StreamRefused);
        assert_eq!(rq.stats.refused_copies, 1);
        // Earlier messages are taken.
        let out = rq.on_send(conn, &msg(2, 0), b"x", &lim, &mut mrs, &mut ev);
        assert_eq!(out, RxOutcome::Accepted);
        // An abort from an earlier message (1) ends it; copies of 3 are then dead.
        let out = rq.on_stream_abort(conn, 2, 1, 1, &lim, &mut ev);
        assert_eq!(out, RxOutcome::Accepted);
        assert!(rq.refused_new.get(2).is_none());
        let out = rq.on_send(conn, &msg(2, 3), b"x", &lim, &mut mrs, &mut ev);
        assert_eq!(out, RxOutcome::Accepted);
        // Stream 4: this side stops it at the full table (its id closes at once); its
        // record is useless from then on and goes with the abort, from whatever message.
        lim.max_streams = 2;
        assert!(rq.streams.len() >= 2);
        assert_eq!(rq.stop(4, &lim), 0);
        assert!(rq.is_retired(4));
        let out = rq.on_stream_abort(conn, 4, 7, 1, &lim, &mut ev);
        assert_eq!(out, RxOutcome::Accepted);
        assert_eq!(rq.refused_new.len(), 0, "{:?}", rq.refused_new);
    }

    /// A peer sends part of message 1 (bound to the second posted receive), then a FIN
    /// saying the stream has one message, then message 0: delivery reaches the FIN and the
    /// second receive completes `WrFlushError`. The rest of message 1 must not be written
    /// into that receive's buffer afterwards (the application was told it is free): it is
    /// refused (NAK invalid request), as is anything beyond a FIN. Found by review: it was
    /// placed and acknowledged.
    #[test]
    fn nothing_lands_in_a_receive_flushed_at_the_fin() {
        use crate::mr::{Access, MrTable};
        use crate::secret::SecretRng;
        use crate::wire::SendEth;
        let mut mrs = MrTable::new(&mut SecretRng::new([7; 32]));
        let keys = mrs.register(Box::new(vec![0u8; 4096]), Access::LOCAL_WRITE);
        let lim = limits();
        let conn = ConnectionHandle(1);
        let mut rq = RecvState::default();
        let mut ev = VecDeque::new();
        for (i, wr_id) in [10u64, 11].into_iter().enumerate() {
            let r = PostedRecv {
                wr_id,
                lkey: keys.lkey,
                offset: i as u64 * 2048,
                len: 2048,
            };
            rq.post_recv(5, r);
        }
        let m1 = |offset| SendEth {
            stream_id: 5,
            msg_seq: 1,
            offset,
            msg_len: 2048,
        };
        let out = rq.on_send(conn, &m1(0), &[0xAA; 1024], &lim, &mut mrs, &mut ev);
        assert_eq!(out, RxOutcome::Accepted);
        rq.on_stream_fin(conn, 5, 1, &lim, &mut ev);
        let m0 = SendEth {
            stream_id: 5,
            msg_seq: 0,
            offset: 0,
            msg_len: 4,
        };
        rq.on_send(conn, &m0, b"zero", &lim, &mut mrs, &mut ev);
        let done: Vec<_> = ev
            .iter()
            .filter_map(|e| match e {
                Event::RecvCompletion { wc, .. } => Some((wc.wr_id, wc.status)),
                _ => None,
            })
            .collect();
        assert_eq!(
            done,
            [(10, WcStatus::Success), (11, WcStatus::WrFlushError)]
        );
        // The application reuses the flushed buffer.
        mrs.local_write(keys.lkey, 2048 + 1024, &[0x11; 1024])
            .unwrap();
        let out = rq.on_send(conn, &m1(1024), &[0xBB; 1024], &lim, &mut mrs, &mut ev);
        assert_eq!(out, RxOutcome::Nak(NAK_INVALID_REQUEST));
        assert_eq!(
            mrs.local_vec(keys.lkey, 2048 + 1024, 1024).unwrap(),
            vec![0x11; 1024]
        );
        assert_eq!(rq.stats().beyond_fin_naks, 1);
        // Nothing of the stream is left: it can close.
        assert!(rq.try_retire(5, 64));
    }
}
