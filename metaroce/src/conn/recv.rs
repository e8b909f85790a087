//! Semantic layer, responder side: SEND reassembly with in-order delivery per stream,
//! direct placement of RDMA WRITE packets into registered memory, and exactly-once
//! reporting of messages and WRITE-with-immediate completions.

use crate::event::{ConnectionHandle, Event};
use crate::mr::{Access, MrTable};
use crate::wire::{Reth, SendEth, WriteEth};
use bytes::Bytes;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

/// NAK syndromes (AETH NAK codes, RoCEv2 reference §3.1).
pub(crate) const NAK_INVALID_REQUEST: u8 = 0x61;
pub(crate) const NAK_REMOTE_ACCESS: u8 = 0x62;

/// What the semantic layer made of a new packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RxOutcome {
    /// Placed (or a harmless duplicate of placed data): acknowledge it.
    Accepted,
    /// No resources now: drop without acknowledging, the sender will retry.
    Drop,
    /// Refused: NAK with this syndrome, nothing written.
    Nak(u8),
}

#[derive(Debug)]
struct RxMsg {
    data: Vec<u8>,
    got: Vec<u64>,
    got_segs: u32,
    nsegs: u32,
}

#[derive(Debug, Default)]
struct StreamRx {
    next_deliver: u32,
    msgs: BTreeMap<u32, RxMsg>,
}

#[derive(Debug)]
struct WriteTrack {
    got: Vec<u64>,
    got_segs: u32,
    nsegs: u32,
}

/// Limits the responder applies (from `TransportConfig`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RecvLimits {
    pub pmtu: u32,
    pub max_message_size: u64,
    pub max_recv_buffer_bytes: u64,
    pub max_stream_window: u32,
    pub max_streams: u32,
}

/// Most WRITE operations tracked at once (in progress or finished above the floor).
const MAX_TRACKED_WRITES: usize = 1 << 16;

#[derive(Debug, Default)]
pub(crate) struct RecvState {
    streams: HashMap<u32, StreamRx>,
    buffered: u64,
    writes: HashMap<u32, WriteTrack>,
    /// Every WRITE op id before `write_floor` is finished; `writes_done` holds finished
    /// ids at or above it.
    write_floor: u32,
    writes_done: BTreeSet<u32>,
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
    /// Packets dropped for lack of receive buffer or stream window.
    pub no_buffer_drops: u64,
    /// NAKs sent.
    pub naks: u64,
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

/// Check that a packet is the segment the path MTU implies at its offset.
fn check_segment(offset: u32, payload: usize, total: u64, pmtu: u32) -> bool {
    let off = offset as u64;
    if off % pmtu as u64 != 0 || (off >= total && !(off == 0 && total == 0)) {
        return false;
    }
    payload as u64 == (total - off).min(pmtu as u64)
}

impl RecvState {
    pub fn on_send(
        &mut self,
        conn: ConnectionHandle,
        hdr: &SendEth,
        payload: &[u8],
        lim: &RecvLimits,
        events: &mut VecDeque<Event>,
    ) -> RxOutcome {
        let total = hdr.msg_len as u64;
        if total > lim.max_message_size
            || !check_segment(hdr.offset, payload.len(), total, lim.pmtu)
        {
            return RxOutcome::Nak(NAK_INVALID_REQUEST);
        }
        if !self.streams.contains_key(&hdr.stream_id)
            && self.streams.len() >= lim.max_streams as usize
        {
            return RxOutcome::Nak(NAK_INVALID_REQUEST);
        }
        let st = self.streams.entry(hdr.stream_id).or_default();
        if seq_before(hdr.msg_seq, st.next_deliver) {
            self.stats.duplicates += 1;
            return RxOutcome::Accepted;
        }
        if hdr.msg_seq.wrapping_sub(st.next_deliver) >= lim.max_stream_window {
            self.stats.no_buffer_drops += 1;
            return RxOutcome::Drop;
        }
        let nsegs = hdr.msg_len.div_ceil(lim.pmtu).max(1);
        if !st.msgs.contains_key(&hdr.msg_seq) {
            let head = hdr.msg_seq == st.next_deliver;
            if !head && self.buffered + total > lim.max_recv_buffer_bytes {
                self.stats.no_buffer_drops += 1;
                return RxOutcome::Drop;
            }
            self.buffered += total;
            st.msgs.insert(
                hdr.msg_seq,
                RxMsg {
                    data: vec![0; hdr.msg_len as usize],
                    got: vec![0; nsegs.div_ceil(64) as usize],
                    got_segs: 0,
                    nsegs,
                },
            );
        }
        let Some(msg) = st.msgs.get_mut(&hdr.msg_seq) else {
            return RxOutcome::Drop;
        };
        if msg.nsegs != nsegs {
            // Same message sequence number, different length: a confused or hostile peer.
            return RxOutcome::Nak(NAK_INVALID_REQUEST);
        }
        if !test_set(&mut msg.got, hdr.offset / lim.pmtu) {
            self.stats.duplicates += 1;
            return RxOutcome::Accepted;
        }
        let off = hdr.offset as usize;
        msg.data[off..off + payload.len()].copy_from_slice(payload);
        msg.got_segs += 1;
        // Deliver every complete message at the head of the stream, in order.
        while st
            .msgs
            .get(&st.next_deliver)
            .is_some_and(|m| m.got_segs == m.nsegs)
        {
            let Some(m) = st.msgs.remove(&st.next_deliver) else {
                break;
            };
            self.buffered -= m.data.len() as u64;
            self.stats.messages += 1;
            self.stats.message_bytes += m.data.len() as u64;
            events.push_back(Event::Message {
                conn,
                stream: hdr.stream_id,
                data: Bytes::from(m.data),
            });
            st.next_deliver = st.next_deliver.wrapping_add(1);
        }
        RxOutcome::Accepted
    }

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
        let total = reth.dma_len as u64;
        if total > lim.max_message_size
            || !check_segment(hdr.offset, payload.len(), total, lim.pmtu)
        {
            return RxOutcome::Nak(NAK_INVALID_REQUEST);
        }
        // The access check covers the whole message, so every packet of a bad WRITE is
        // refused and none of its bytes land. Zero-length WRITEs are not checked (IBA).
        if total > 0 {
            if let Err(_e) = mrs.check_remote(reth.rkey, reth.va, total, Access::REMOTE_WRITE) {
                self.finish_write(hdr.op_id);
                return RxOutcome::Nak(NAK_REMOTE_ACCESS);
            }
        }
        let id = hdr.op_id;
        if seq_before(id, self.write_floor) || self.writes_done.contains(&id) {
            self.stats.duplicates += 1;
            return RxOutcome::Accepted;
        }
        let nsegs = reth.dma_len.div_ceil(lim.pmtu).max(1);
        if !self.writes.contains_key(&id)
            && self.writes.len() + self.writes_done.len() >= MAX_TRACKED_WRITES
        {
            self.stats.no_buffer_drops += 1;
            return RxOutcome::Drop;
        }
        let t = self.writes.entry(id).or_insert_with(|| WriteTrack {
            got: vec![0; nsegs.div_ceil(64) as usize],
            got_segs: 0,
            nsegs,
        });
        if t.nsegs != nsegs {
            return RxOutcome::Nak(NAK_INVALID_REQUEST);
        }
        if !test_set(&mut t.got, hdr.offset / lim.pmtu) {
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
            self.writes.remove(&id);
            self.finish_write(id);
            if let Some(imm) = imm {
                events.push_back(Event::WriteWithImm {
                    conn,
                    imm,
                    byte_len: reth.dma_len,
                });
            }
        }
        RxOutcome::Accepted
    }

    fn finish_write(&mut self, id: u32) {
        self.writes.remove(&id);
        if seq_before(id, self.write_floor) {
            return;
        }
        self.writes_done.insert(id);
        while self.writes_done.remove(&self.write_floor) {
            self.write_floor = self.write_floor.wrapping_add(1);
        }
    }
}
