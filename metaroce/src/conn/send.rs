//! Semantic layer, requester side: posted operations, their segmentation into
//! path-MTU-sized segments, acknowledgement per segment, and completions in posting order.

use super::path::SegRef;
use crate::endpoint::WriteRequest;
use crate::event::{WcOpcode, WcStatus, WorkCompletion};
use bytes::Bytes;
use std::collections::{HashMap, VecDeque};

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
}

#[derive(Debug)]
pub(crate) struct Op {
    pub wr_id: u64,
    pub kind: OpKind,
    pub len: u32,
    pub nsegs: u32,
    next_seg: u32,
    acked: Vec<u64>,
    acked_segs: u32,
    pub status: Option<WcStatus>,
}

impl Op {
    fn opcode(&self) -> WcOpcode {
        match self.kind {
            OpKind::Send { .. } => WcOpcode::Send,
            OpKind::Write { imm: None, .. } => WcOpcode::RdmaWrite,
            OpKind::Write { imm: Some(_), .. } => WcOpcode::RdmaWriteWithImm,
        }
    }

    fn is_acked(&self, seg: u32) -> bool {
        self.acked[(seg / 64) as usize] >> (seg % 64) & 1 == 1
    }
}

/// Byte offset and length of segment `seg` of a `len`-byte message.
pub(crate) fn seg_span(len: u32, pmtu: u32, seg: u32) -> (u32, u32) {
    let off = seg * pmtu;
    (off, (len - off.min(len)).min(pmtu))
}

/// The send queue of a connection.
#[derive(Debug, Default)]
pub(crate) struct SendQueue {
    ops: VecDeque<Op>,
    base_id: u64,
    cursor: usize,
    retx: VecDeque<SegRef>,
    stream_seq: HashMap<u32, u32>,
    next_wire_id: u32,
    pmtu: u32,
}

impl SendQueue {
    pub fn new(pmtu: u32) -> Self {
        Self {
            pmtu,
            ..Default::default()
        }
    }

    pub fn set_pmtu(&mut self, pmtu: u32) {
        self.pmtu = pmtu;
    }

    pub fn len(&self) -> usize {
        self.ops.len()
    }

    pub fn op(&self, id: u64) -> Option<&Op> {
        let i = id.checked_sub(self.base_id)?;
        self.ops.get(usize::try_from(i).ok()?)
    }

    fn op_mut(&mut self, id: u64) -> Option<&mut Op> {
        let i = id.checked_sub(self.base_id)?;
        self.ops.get_mut(usize::try_from(i).ok()?)
    }

    fn push(&mut self, wr_id: u64, kind: OpKind, len: u32) {
        let nsegs = len.div_ceil(self.pmtu).max(1);
        self.ops.push_back(Op {
            wr_id,
            kind,
            len,
            nsegs,
            next_seg: 0,
            acked: vec![0; nsegs.div_ceil(64) as usize],
            acked_segs: 0,
            status: None,
        });
    }

    pub fn post_send(&mut self, wr_id: u64, stream: u32, data: Bytes) {
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

    pub fn post_write(&mut self, req: &WriteRequest) {
        let wire_id = self.next_wire_id;
        self.next_wire_id = wire_id.wrapping_add(1);
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

    fn live(&self, s: SegRef) -> bool {
        self.op(s.op)
            .is_some_and(|o| o.status.is_none() && !o.is_acked(s.seg))
    }

    /// The next segment to transmit (retransmissions first), without taking it.
    pub fn peek(&mut self) -> Option<SegRef> {
        while let Some(&s) = self.retx.front() {
            if self.live(s) {
                return Some(s);
            }
            self.retx.pop_front();
        }
        while let Some(op) = self.ops.get(self.cursor) {
            if op.status.is_none() && op.next_seg < op.nsegs {
                return Some(SegRef {
                    op: self.base_id + self.cursor as u64,
                    seg: op.next_seg,
                });
            }
            self.cursor += 1;
        }
        None
    }

    /// Take the segment `peek` returned; returns whether it is a retransmission.
    pub fn take(&mut self, s: SegRef) -> bool {
        if self.retx.front() == Some(&s) {
            self.retx.pop_front();
            return true;
        }
        if let Some(op) = self.op_mut(s.op) {
            if op.next_seg == s.seg {
                op.next_seg += 1;
            }
        }
        false
    }

    /// Whether a segment is still worth sending (its operation is pending, it is unacked).
    pub fn is_live(&self, s: SegRef) -> bool {
        self.live(s)
    }

    pub fn seg_span(&self, s: SegRef) -> Option<(u32, u32)> {
        self.op(s.op).map(|o| seg_span(o.len, self.pmtu, s.seg))
    }

    pub fn on_acked(&mut self, s: SegRef) {
        if let Some(op) = self.op_mut(s.op) {
            if op.status.is_none() && s.seg < op.nsegs && !op.is_acked(s.seg) {
                op.acked[(s.seg / 64) as usize] |= 1 << (s.seg % 64);
                op.acked_segs += 1;
                if op.acked_segs == op.nsegs {
                    op.status = Some(WcStatus::Success);
                }
            }
        }
    }

    pub fn on_lost(&mut self, s: SegRef) {
        if self.live(s) {
            self.retx.push_back(s);
        }
    }

    /// Fail one operation (NAK from the responder, or a local error).
    pub fn fail(&mut self, op: u64, status: WcStatus) {
        if let Some(op) = self.op_mut(op) {
            if op.status.is_none() {
                op.status = Some(status);
            }
        }
    }

    /// Fail everything pending: the first pending operation gets `first`, the rest are
    /// flushed (IBA: the WQE that hit the error, then `WR_FLUSH_ERR` for the others).
    pub fn fail_all(&mut self, first: WcStatus) {
        let mut status = first;
        for op in self.ops.iter_mut() {
            if op.status.is_none() {
                op.status = Some(status);
                status = WcStatus::WrFlushError;
            }
        }
        self.retx.clear();
    }

    /// Pop completions that are due, in posting order.
    pub fn pop_completion(&mut self) -> Option<WorkCompletion> {
        let status = self.ops.front()?.status?;
        let op = self.ops.pop_front()?;
        self.base_id += 1;
        self.cursor = self.cursor.saturating_sub(1);
        Some(WorkCompletion {
            wr_id: op.wr_id,
            status,
            opcode: op.opcode(),
            byte_len: op.len,
        })
    }

    /// Whether anything is posted and not yet completed.
    pub fn has_pending(&self) -> bool {
        self.ops.iter().any(|o| o.status.is_none())
    }
}
