//! Test harness for the property tests (`prop_*.rs`) and the named scenarios
//! (`scenarios.rs`).
//!
//! * The network is `metaroce::testing::Net` (re-exported here): two endpoints, a virtual
//!   clock, an impaired in-memory network with rules, capture and injection.
//! * [`Workload`]: memory regions with canary bytes on both endpoints, a schedule of
//!   operations ([`OpSpec`]: SENDs on streams, WRITEs and WRITEs with immediate, RDMA READs,
//!   atomics, posted receives; valid or not) posted from either side, and the checks every
//!   property and scenario asserts (exactly-once in-order delivery per stream, into posted
//!   receives where the receiver requires them; memory contents against a model, canaries;
//!   READ bytes; atomics executed exactly once in some serial order; one completion per
//!   operation, in posting order per stream and among one-sided operations, with the right status; immediates exactly once; liveness and
//!   quiescence).
//! * proptest strategies for operation schedules and impairment schedules, built from
//!   vectors of small structs so that they shrink to small, readable cases.
#![allow(dead_code)]

use bytes::Bytes;
use metaroce::wire::Packet;
use metaroce::{
    Access, AtomicOp, AtomicRequest, ConnectionError, ConnectionHandle, Endpoint, EndpointConfig,
    Event, MrKeys, PostError, ReadRequest, RecvRequest, WcOpcode, WcStatus, WriteRequest,
};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::time::Duration;

pub use metaroce::testing::*;

// =======================================================================================
// Workload: regions with canaries, operations, the model and the checks

/// Bytes of the local source region of each endpoint.
pub const SRC_LEN: u32 = 64 * 1024;
/// Canary bytes before and after the target area of the writable region.
pub const GUARD: u32 = 512;
/// Bytes of the target area of the writable region.
pub const AREA: u32 = 32 * 1024;
/// Bytes of the region without REMOTE_WRITE.
pub const RO_LEN: u32 = 4096;
/// Largest SEND and WRITE the generators make.
pub const MAX_OP_LEN: u32 = 20_000;

/// Bytes of the region peers READ from (REMOTE_READ only, never written).
pub const RSRC_LEN: u32 = AREA + 2 * GUARD;
/// Bytes of the counter region (REMOTE_ATOMIC): 8 canary bytes, the counter, 8 canary bytes.
pub const CTR_LEN: u32 = 24;
/// Offset of the counter in the counter region.
pub const CTR_OFF: u32 = 8;
/// Result slots of atomics in the atomic result region (8 bytes each, 8 canary bytes between).
pub const ATOMIC_SLOTS: usize = 1024;
/// Bytes of the receive buffer region (receives get disjoint slots, canary between).
pub const RBUF_LEN: u32 = 512 * 1024;
/// Canary bytes between two receive slots.
pub const RBUF_GAP: u32 = 64;

/// Canary byte `i` of region `which` on endpoint `side`.
pub fn canary(side: usize, which: u8, i: usize) -> u8 {
    (i as u8).wrapping_mul(31) ^ 0xA5 ^ which.wrapping_mul(17) ^ (side as u8 * 0x3C)
}

/// Contents of the READ source region of endpoint `side`.
pub fn rsrc_bytes(side: usize) -> Vec<u8> {
    pattern(0x4EAD_0000 + side as u64, RSRC_LEN as usize)
}

/// Initial value of the counter of endpoint `side` (B's wraps around after a few adds).
pub fn counter_init(side: usize) -> u64 {
    [0x0123_4567_89AB_CDEF, u64::MAX - 5][side]
}

/// Offset of the result slot `k` in the atomic result region.
pub fn slot_off(k: usize) -> u64 {
    8 + 16 * k as u64
}

/// The regions each endpoint registers.
#[derive(Debug, Clone, Copy)]
pub struct Regions {
    /// Local source of WRITEs (LOCAL_WRITE only).
    pub src: MrKeys,
    /// Target of valid WRITEs (LOCAL_WRITE | REMOTE_WRITE): GUARD canary bytes, AREA, GUARD.
    pub rw: MrKeys,
    /// A region without REMOTE_WRITE (LOCAL_WRITE | REMOTE_READ), all canary.
    pub ro: MrKeys,
    /// Source of peers' READs (REMOTE_READ only): [`rsrc_bytes`], never written.
    pub rsrc: MrKeys,
    /// Destination of local READs (LOCAL_WRITE): GUARD canary bytes, AREA, GUARD.
    pub rdst: MrKeys,
    /// The counter of peers' atomics (LOCAL_WRITE | REMOTE_ATOMIC): canary, counter, canary.
    pub ctr: MrKeys,
    /// Original values of local atomics (LOCAL_WRITE): a slot per atomic, canary between.
    pub ares: MrKeys,
    /// Posted receive buffers (LOCAL_WRITE): a slot per receive, canary between. Empty
    /// unless the side requires posted receives.
    pub rbuf: MrKeys,
}

impl Regions {
    /// The regions of `side`, with a receive buffer region of [`RBUF_LEN`] bytes if
    /// `posted` (the side requires posted receives), else an empty one.
    pub fn register_for(ep: &mut Endpoint, side: usize, posted: bool) -> Regions {
        let mut r = Self::register(ep, side);
        if posted {
            let rbuf: Vec<u8> = (0..RBUF_LEN as usize).map(|i| canary(side, 7, i)).collect();
            r.rbuf = ep.register_mr(rbuf, Access::LOCAL_WRITE);
        }
        r
    }

    /// The regions of `side` (an empty receive buffer region).
    pub fn register(ep: &mut Endpoint, side: usize) -> Regions {
        let src = pattern(0x5_0c0 + side as u64, SRC_LEN as usize);
        let rw: Vec<u8> = (0..(2 * GUARD + AREA) as usize)
            .map(|i| canary(side, 1, i))
            .collect();
        let ro: Vec<u8> = (0..RO_LEN as usize).map(|i| canary(side, 2, i)).collect();
        let rdst: Vec<u8> = (0..(2 * GUARD + AREA) as usize)
            .map(|i| canary(side, 4, i))
            .collect();
        let mut ctr: Vec<u8> = (0..CTR_LEN as usize).map(|i| canary(side, 5, i)).collect();
        ctr[CTR_OFF as usize..CTR_OFF as usize + 8]
            .copy_from_slice(&counter_init(side).to_le_bytes());
        let ares: Vec<u8> = (0..slot_off(ATOMIC_SLOTS) as usize)
            .map(|i| canary(side, 6, i))
            .collect();
        Regions {
            // Lends its bytes for gather send (`Net::gather`, on in half the cases).
            src: ep.register_mr_memory(
                Box::new(metaroce::testing::LendingRegion::new(src)),
                Access::LOCAL_WRITE,
            ),
            rw: ep.register_mr(rw, Access::LOCAL_WRITE | Access::REMOTE_WRITE),
            ro: ep.register_mr(ro, Access::LOCAL_WRITE | Access::REMOTE_READ),
            rsrc: ep.register_mr(rsrc_bytes(side), Access::REMOTE_READ),
            rdst: ep.register_mr(rdst, Access::LOCAL_WRITE),
            ctr: ep.register_mr(ctr, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC),
            ares: ep.register_mr(ares, Access::LOCAL_WRITE),
            rbuf: ep.register_mr(Vec::new(), Access::LOCAL_WRITE),
        }
    }
}

/// Where a WRITE goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Inside the target area of the peer's writable region: valid.
    Area,
    /// An rkey no region has.
    BadRkey,
    /// The writable region's rkey with another variant byte (a stale key).
    StaleRkey,
    /// Crossing the end of the writable region.
    PastEnd,
    /// Starting one byte before the writable region.
    BeforeStart,
    /// Inside the region without REMOTE_WRITE.
    NoRemoteWrite,
}

/// Where a READ or an atomic goes (in the peer's memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RTarget {
    /// READ: inside the peer's READ source region; atomic: the peer's counter. Valid.
    Valid,
    /// An rkey no region has.
    BadRkey,
    /// The right region's rkey with another variant byte (a stale key).
    StaleRkey,
    /// Crossing (READ) or just past (atomic) the end of the region.
    PastEnd,
    /// Starting before the region.
    BeforeStart,
    /// A region without the right the operation needs (READ: the peer's WRITE target, no
    /// REMOTE_READ; atomic: the peer's READ source, no REMOTE_ATOMIC).
    NoRight,
    /// Atomic: the counter's address plus 1..=7 (RemoteInvalidRequest). READ: a valid READ
    /// from an odd address.
    Misaligned,
}

/// An atomic's operation; compare and swap values are relative to the target counter's
/// initial value ([`counter_init`]) so that small numbers often match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicSpec {
    FetchAdd { add: u64 },
    CompareSwap { compare: u64, swap: u64 },
}

/// One operation of a schedule.
#[derive(Debug, Clone, PartialEq)]
pub enum OpKind {
    /// SEND of `len` bytes on `stream`.
    Send { stream: u32, len: u32 },
    /// RDMA WRITE (with immediate if `imm`) of `len` bytes from `src_off` in the local
    /// source region to `target` (`dst_off` inside the target area, modulo what fits).
    Write {
        target: Target,
        dst_off: u32,
        src_off: u32,
        len: u32,
        imm: bool,
    },
    /// RDMA READ of `len` bytes from `target` (`src_off` inside the peer's READ source,
    /// modulo what fits) to `dst_off` inside the target area of the local READ destination.
    Read {
        target: RTarget,
        src_off: u32,
        dst_off: u32,
        len: u32,
    },
    /// An atomic on `target`; its original value lands in the next free result slot.
    Atomic { target: RTarget, op: AtomicSpec },
    /// A receive of `len` bytes posted on `stream` by `side` (the receiving side). Only on
    /// sides that require posted receives (`require_posted_receives`); skipped elsewhere.
    Recv { stream: u32, len: u32 },
}

/// An operation posted by endpoint `side` after waiting `gap_us` of virtual time (and, if
/// `fence`, until every earlier operation of that side completed).
#[derive(Debug, Clone, PartialEq)]
pub struct OpSpec {
    pub side: usize,
    pub gap_us: u32,
    pub fence: bool,
    pub kind: OpKind,
}

impl OpSpec {
    pub fn send(side: usize, stream: u32, len: u32) -> OpSpec {
        OpSpec {
            side,
            gap_us: 0,
            fence: false,
            kind: OpKind::Send { stream, len },
        }
    }
    pub fn write(side: usize, target: Target, dst_off: u32, len: u32, imm: bool) -> OpSpec {
        OpSpec {
            side,
            gap_us: 0,
            fence: false,
            kind: OpKind::Write {
                target,
                dst_off,
                src_off: dst_off.wrapping_mul(7).wrapping_add(len),
                len,
                imm,
            },
        }
    }
    pub fn read(side: usize, target: RTarget, src_off: u32, dst_off: u32, len: u32) -> OpSpec {
        OpSpec {
            side,
            gap_us: 0,
            fence: false,
            kind: OpKind::Read {
                target,
                src_off,
                dst_off,
                len,
            },
        }
    }
    pub fn fetch_add(side: usize, target: RTarget, add: u64) -> OpSpec {
        OpSpec {
            side,
            gap_us: 0,
            fence: false,
            kind: OpKind::Atomic {
                target,
                op: AtomicSpec::FetchAdd { add },
            },
        }
    }
    pub fn compare_swap(side: usize, target: RTarget, compare: u64, swap: u64) -> OpSpec {
        OpSpec {
            side,
            gap_us: 0,
            fence: false,
            kind: OpKind::Atomic {
                target,
                op: AtomicSpec::CompareSwap { compare, swap },
            },
        }
    }
    /// A receive posted by `side` on `stream`.
    pub fn recv(side: usize, stream: u32, len: u32) -> OpSpec {
        OpSpec {
            side,
            gap_us: 0,
            fence: false,
            kind: OpKind::Recv { stream, len },
        }
    }
    /// Take a WRITE's source bytes from offset `off` of the local source region.
    pub fn src(mut self, off: u32) -> OpSpec {
        if let OpKind::Write { src_off, .. } = &mut self.kind {
            *src_off = off;
        }
        self
    }
    pub fn fenced(mut self) -> OpSpec {
        self.fence = true;
        self
    }
    pub fn after_us(mut self, us: u32) -> OpSpec {
        self.gap_us = us;
        self
    }
}

/// A posted operation as the model sees it.
#[derive(Debug, Clone)]
pub struct Posted {
    pub wr_id: u64,
    pub spec: OpSpec,
    /// For SENDs: the message bytes.
    pub data: Option<Bytes>,
    /// For WRITEs: the request.
    pub write: Option<WriteRequest>,
    /// For READs: the request.
    pub read: Option<ReadRequest>,
    /// For atomics: the request and its result slot.
    pub atomic: Option<(AtomicRequest, usize)>,
    /// Whether the responder must accept it (zero-length WRITEs and READs are never checked).
    pub valid: bool,
    /// The status it completes with when nothing goes wrong (SENDs into posted receives:
    /// see [`Workload::expected`]).
    pub expect: WcStatus,
    /// Every earlier operation of this side had completed when this one was posted.
    pub fenced: bool,
    pub posted_at: Duration,
}

impl Posted {
    pub fn len(&self) -> u32 {
        if let Some(r) = &self.read {
            return r.len;
        }
        match self.spec.kind {
            OpKind::Send { len, .. } | OpKind::Write { len, .. } | OpKind::Read { len, .. } => len,
            OpKind::Atomic { .. } => 8,
            OpKind::Recv { .. } => 0,
        }
    }
    pub fn opcode(&self) -> WcOpcode {
        match self.spec.kind {
            OpKind::Send { .. } => WcOpcode::Send,
            OpKind::Write { imm: false, .. } => WcOpcode::RdmaWrite,
            OpKind::Write { imm: true, .. } => WcOpcode::RdmaWriteWithImm,
            OpKind::Read { .. } => WcOpcode::RdmaRead,
            OpKind::Atomic {
                op: AtomicSpec::FetchAdd { .. },
                ..
            } => WcOpcode::FetchAdd,
            OpKind::Atomic {
                op: AtomicSpec::CompareSwap { .. },
                ..
            } => WcOpcode::CompSwap,
            OpKind::Recv { .. } => WcOpcode::Recv,
        }
    }
    pub fn expected(&self) -> WcStatus {
        self.expect
    }
}

/// A receive posted as the model sees it.
#[derive(Debug, Clone)]
pub struct RecvPosted {
    pub wr_id: u64,
    pub stream: u32,
    /// Offset of its slot in the receive buffer region.
    pub offset: u64,
    pub len: u32,
    /// Posted by the harness (a receive the schedule lacked), not by the schedule.
    pub topped_up: bool,
    pub posted_at: Duration,
}

/// First wr_id of receives (their own range, apart from the send queue's).
pub const RECV_WR_BASE: u64 = 1 << 40;

/// Immediate value of the WRITE with `wr_id` (unique per operation).
pub fn imm_of(wr_id: u64) -> u32 {
    0x1000_0000 | wr_id as u32
}

/// Two endpoints with regions and one connection, a schedule of operations, the model.
pub struct Workload {
    pub net: Net,
    pub regions: [Regions; 2],
    /// The connection handle on each side (A's, B's).
    pub conns: [ConnectionHandle; 2],
    pub posted: [Vec<Posted>; 2],
    /// Posts refused because the connection was already gone.
    pub refused: [Vec<OpSpec>; 2],
    next_wr: u64,
    /// Whether the connection may fail (the schedule blackholes long enough).
    pub allow_failure: bool,
    /// Whether a close is part of the schedule.
    pub closed_by: Option<usize>,
    /// Virtual time (since the start) at which the connection was up.
    pub t0: Duration,
    /// Whether packets for unknown connections are expected (stale traffic after a
    /// restart).
    pub stale_expected: bool,
    /// Packets beyond the SACK window a scenario forged, per receiving side.
    pub forged_beyond_window: [u64; 2],
    /// Receives posted, per receiving side, in posting order.
    pub recvs: [Vec<RecvPosted>; 2],
    /// Streams of each receiving side that get no receive before their first SEND failed
    /// (the harness does not top them up): the first SEND on one completes with
    /// RnrRetryExceeded and the stream enters the error state — every later SEND on it
    /// completes with WrFlushError, and every receive posted on it (see `dead`) with
    /// WrFlushError.
    pub starved: [Vec<u32>; 2],
    /// Starved streams of each receiving side known to be in the error state (the first
    /// SEND on it failed): receives in the schedule are posted on them again (and must
    /// be flushed).
    pub dead: [Vec<u32>; 2],
    /// Post the missing receive for each SEND as it is posted when the sender's `rnr_retry`
    /// is not 7 (otherwise a late receive would make it fail). Default true.
    pub eager_receives: bool,
    /// Next free byte of each side's receive buffer region.
    rbuf_next: [u64; 2],
    next_recv_wr: u64,
}

impl Workload {
    /// Regions on both sides, then connect. Returns `None` if the handshake failed (only
    /// acceptable under a schedule that allows failure).
    pub fn start(mut net: Net, connect_limit: Duration) -> Option<Workload> {
        let posted = [0, 1].map(|i| net.configs[i].transport.require_posted_receives);
        let regions = [
            Regions::register_for(&mut net.eps[0], 0, posted[0]),
            Regions::register_for(&mut net.eps[1], 1, posted[1]),
        ];
        let (c, s) = net.try_connect(connect_limit)?;
        Some(Self::resume(net, regions, [c, s], 0))
    }

    /// A workload over an existing network, regions and connection (e.g. a new connection
    /// after a restart); `first_wr` is the first wr_id it uses.
    pub fn resume(
        net: Net,
        regions: [Regions; 2],
        conns: [ConnectionHandle; 2],
        first_wr: u64,
    ) -> Workload {
        let t0 = net.elapsed();
        Workload {
            net,
            regions,
            conns,
            posted: [Vec::new(), Vec::new()],
            refused: [Vec::new(), Vec::new()],
            next_wr: first_wr,
            allow_failure: false,
            closed_by: None,
            t0,
            stale_expected: false,
            forged_beyond_window: [0, 0],
            recvs: [Vec::new(), Vec::new()],
            starved: [Vec::new(), Vec::new()],
            dead: [Vec::new(), Vec::new()],
            eager_receives: true,
            rbuf_next: [0, 0],
            next_recv_wr: RECV_WR_BASE + first_wr,
        }
    }

    /// Whether endpoint `i` requires posted receives on every stream.
    pub fn posted_mode(&self, i: usize) -> bool {
        self.net.configs[i].transport.require_posted_receives
    }

    /// Connection counters of side `i` (`None` once the connection is gone).
    pub fn stats(&self, i: usize) -> Option<metaroce::ConnectionStats> {
        self.net.eps[i].connection_stats(self.conns[i])
    }

    /// Sum of a path counter over side `i`'s paths.
    pub fn path_sum(&self, i: usize, f: impl Fn(&metaroce::PathStats) -> u64) -> u64 {
        self.stats(i)
            .map_or(0, |s| s.paths.iter().map(|p| f(&p.stats)).sum())
    }

    /// Statuses of side `i`'s completions, in posting order.
    pub fn statuses(&self, i: usize) -> Vec<WcStatus> {
        self.wcs(i).iter().map(|w| w.status).collect()
    }

    /// Side `side`'s completions sorted into posting order. They are reported in posting
    /// order per stream and among the one-sided operations, a SEND after every one-sided
    /// operation posted before it (`check_report_order`), not in posting order overall.
    pub fn wcs(&self, side: usize) -> Vec<metaroce::WorkCompletion> {
        let idx: HashMap<u64, usize> = self.posted[side]
            .iter()
            .enumerate()
            .map(|(i, p)| (p.wr_id, i))
            .collect();
        let mut w = self.net.completions(side, self.conns[side]);
        w.sort_by_key(|wc| idx.get(&wc.wr_id).copied().unwrap_or(usize::MAX));
        w
    }

    /// The order completions were reported in: posting order within each stream's SENDs
    /// and within the one-sided operations (WRITEs, READs, atomics), and a SEND only after
    /// every one-sided operation posted before it; each operation once.
    pub fn check_report_order(&self, side: usize) -> Result<(), String> {
        let posted: Vec<(u64, Option<u32>)> = self.posted[side]
            .iter()
            .map(|p| match p.spec.kind {
                OpKind::Send { stream, .. } => (p.wr_id, Some(stream)),
                _ => (p.wr_id, None),
            })
            .collect();
        let reported: Vec<u64> = self
            .net
            .completions(side, self.conns[side])
            .iter()
            .map(|wc| wc.wr_id)
            .collect();
        metaroce::testing::check_completion_order(&posted, &reported)
            .map_err(|e| format!("side {side}: {e}"))
    }

    /// Operations of `side` posted and not yet completed.
    pub fn pending(&self, side: usize) -> usize {
        self.posted[side].len() - self.net.completions(side, self.conns[side]).len()
    }

    /// Whether every posted operation has completed on both sides.
    pub fn all_done(&self) -> bool {
        self.pending(0) == 0 && self.pending(1) == 0
    }

    /// Build the request for a WRITE spec (source side `side`).
    pub fn write_request(&self, side: usize, wr_id: u64, kind: &OpKind) -> (WriteRequest, bool) {
        let OpKind::Write {
            target,
            dst_off,
            src_off,
            len,
            imm,
        } = *kind
        else {
            unreachable!()
        };
        let peer = &self.regions[1 - side];
        let len = len.min(AREA);
        let src_off = src_off % (SRC_LEN - len + 1);
        let area_off = (dst_off % (AREA - len + 1)) as u64;
        let in_area = peer.rw.addr + GUARD as u64 + area_off;
        let (remote_addr, rkey) = match target {
            Target::Area => (in_area, peer.rw.rkey),
            Target::BadRkey => (in_area, 0x00AB_CD00 | 0x11),
            Target::StaleRkey => (in_area, peer.rw.rkey ^ 0x80),
            Target::PastEnd => (
                peer.rw.addr + peer.rw.len - (len as u64 / 2).min(peer.rw.len),
                peer.rw.rkey,
            ),
            Target::BeforeStart => (peer.rw.addr - 1, peer.rw.rkey),
            Target::NoRemoteWrite => (
                peer.ro.addr + (dst_off % (RO_LEN - len.min(RO_LEN) + 1)) as u64,
                peer.ro.rkey,
            ),
        };
        let valid = len == 0 || target == Target::Area;
        (
            WriteRequest {
                wr_id,
                lkey: self.regions[side].src.lkey,
                local_offset: src_off as u64,
                len,
                remote_addr,
                rkey,
                imm: imm.then(|| imm_of(wr_id)),
            },
            valid,
        )
    }

    /// Build the request for a READ spec (requester side `side`).
    pub fn read_request(&self, side: usize, wr_id: u64, kind: &OpKind) -> (ReadRequest, bool) {
        let OpKind::Read {
            target,
            src_off,
            dst_off,
            len,
        } = *kind
        else {
            unreachable!()
        };
        let peer = &self.regions[1 - side];
        let len = len.min(AREA);
        let local_offset = GUARD as u64 + (dst_off % (AREA - len + 1)) as u64;
        let src = peer.rsrc.addr + (src_off % (RSRC_LEN - len + 1)) as u64;
        let (remote_addr, rkey) = match target {
            RTarget::Valid => (src, peer.rsrc.rkey),
            RTarget::Misaligned => {
                let off = (src_off % (RSRC_LEN - len + 1)) | 1;
                (
                    peer.rsrc.addr + off.min(RSRC_LEN - len) as u64,
                    peer.rsrc.rkey,
                )
            }
            RTarget::BadRkey => (src, 0x00AB_CD00 | 0x11),
            RTarget::StaleRkey => (src, peer.rsrc.rkey ^ 0x80),
            RTarget::PastEnd => (
                peer.rsrc.addr + peer.rsrc.len - (len as u64 / 2).min(peer.rsrc.len),
                peer.rsrc.rkey,
            ),
            RTarget::BeforeStart => (peer.rsrc.addr - 1, peer.rsrc.rkey),
            RTarget::NoRight => (
                peer.rw.addr + (src_off % (peer.rw.len as u32 - len + 1)) as u64,
                peer.rw.rkey,
            ),
        };
        let valid = len == 0 || matches!(target, RTarget::Valid | RTarget::Misaligned);
        (
            ReadRequest {
                wr_id,
                lkey: self.regions[side].rdst.lkey,
                local_offset,
                len,
                remote_addr,
                rkey,
            },
            valid,
        )
    }

    /// Build the request for an atomic spec (requester side `side`, result slot `slot`) and
    /// the status it must complete with.
    pub fn atomic_request(
        &self,
        side: usize,
        wr_id: u64,
        slot: usize,
        kind: &OpKind,
    ) -> (AtomicRequest, WcStatus) {
        let OpKind::Atomic { target, op } = *kind else {
            unreachable!()
        };
        let peer = &self.regions[1 - side];
        let init = counter_init(1 - side);
        let ctr = peer.ctr.addr + CTR_OFF as u64;
        let (remote_addr, rkey, status) = match target {
            RTarget::Valid => (ctr, peer.ctr.rkey, WcStatus::Success),
            RTarget::Misaligned => (
                ctr + 1 + wr_id % 7,
                peer.ctr.rkey,
                WcStatus::RemoteInvalidRequest,
            ),
            RTarget::BadRkey => (ctr, 0x00AB_CD00 | 0x11, WcStatus::RemoteAccessError),
            RTarget::StaleRkey => (ctr, peer.ctr.rkey ^ 0x80, WcStatus::RemoteAccessError),
            RTarget::PastEnd => (
                peer.ctr.addr + peer.ctr.len,
                peer.ctr.rkey,
                WcStatus::RemoteAccessError,
            ),
            RTarget::BeforeStart => (
                peer.ctr.addr - 8,
                peer.ctr.rkey,
                WcStatus::RemoteAccessError,
            ),
            RTarget::NoRight => (
                peer.rsrc.addr + 8 * (wr_id % 64),
                peer.rsrc.rkey,
                WcStatus::RemoteAccessError,
            ),
        };
        let op = match op {
            AtomicSpec::FetchAdd { add } => AtomicOp::FetchAdd { add },
            AtomicSpec::CompareSwap { compare, swap } => AtomicOp::CompareSwap {
                compare: init.wrapping_add(compare),
                swap: init.wrapping_add(swap),
            },
        };
        (
            AtomicRequest {
                wr_id,
                lkey: self.regions[side].ares.lkey,
                local_offset: slot_off(slot),
                remote_addr,
                rkey,
                op,
            },
            status,
        )
    }

    /// Post a receive of `len` bytes on `stream` of side `rx` now, in the next free slot.
    pub fn post_recv(
        &mut self,
        rx: usize,
        stream: u32,
        len: u32,
        topped_up: bool,
    ) -> Result<(), String> {
        let offset = self.rbuf_next[rx];
        if offset + len as u64 > self.regions[rx].rbuf.len {
            return Err(format!(
                "side {rx}: receive buffer region exhausted ({offset} + {len} bytes)"
            ));
        }
        let wr_id = self.next_recv_wr;
        let req = RecvRequest {
            wr_id,
            lkey: self.regions[rx].rbuf.lkey,
            offset,
            len,
        };
        match self.net.eps[rx].post_recv(self.conns[rx], stream, req) {
            Ok(()) => {
                self.next_recv_wr += 1;
                self.rbuf_next[rx] = (offset + len as u64 + RBUF_GAP as u64).next_multiple_of(8);
                self.recvs[rx].push(RecvPosted {
                    wr_id,
                    stream,
                    offset,
                    len,
                    topped_up,
                    posted_at: self.net.elapsed(),
                });
                Ok(())
            }
            Err(PostError::UnknownConnection) if self.net.lost(rx, self.conns[rx]).is_some() => {
                Ok(())
            }
            Err(e) => Err(format!("post_recv on side {rx} refused: {e:?}")),
        }
    }

    /// Messages `side` sent on `stream`: (index in `posted[side]`, length), posting order.
    pub fn sends_on(&self, side: usize, stream: u32) -> Vec<(usize, u32)> {
        self.posted[side]
            .iter()
            .enumerate()
            .filter_map(|(i, p)| match p.spec.kind {
                OpKind::Send { stream: s, len } if s == stream => Some((i, len)),
                _ => None,
            })
            .collect()
    }

    /// Receives side `rx` posted on `stream`, posting order.
    pub fn recvs_on(&self, rx: usize, stream: u32) -> Vec<&RecvPosted> {
        self.recvs[rx]
            .iter()
            .filter(|r| r.stream == stream)
            .collect()
    }

    /// Streams `side` sent SENDs on.
    pub fn send_streams(&self, side: usize) -> Vec<u32> {
        let mut v: Vec<u32> = self.posted[side]
            .iter()
            .filter_map(|p| match p.spec.kind {
                OpKind::Send { stream, .. } => Some(stream),
                _ => None,
            })
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// On a side that requires posted receives, post the receives the schedule lacks for
    /// the SENDs the peer posted (each exactly as long as its message), except on starved
    /// streams. A SEND waits (RNR) until then.
    pub fn top_up_receives(&mut self, rx: usize) -> Result<(), String> {
        if !self.posted_mode(rx) || self.net.lost(rx, self.conns[rx]).is_some() {
            return Ok(());
        }
        let tx = 1 - rx;
        for st in self.send_streams(tx) {
            if self.starved[rx].contains(&st) {
                continue;
            }
            let sends = self.sends_on(tx, st);
            let have = self.recvs_on(rx, st).len();
            for &(_, len) in sends.iter().skip(have) {
                self.post_recv(rx, st, len, true)?;
            }
        }
        Ok(())
    }

    /// Post one operation now. A refusal because the connection is gone is recorded; any
    /// other refusal is an error.
    pub fn post(&mut self, spec: OpSpec) -> Result<(), String> {
        let side = spec.side;
        if let OpKind::Recv { stream, len } = spec.kind {
            let starved =
                self.starved[side].contains(&stream) && !self.dead[side].contains(&stream);
            if !self.posted_mode(side) || starved {
                return Ok(());
            }
            return self.post_recv(side, stream, len, false);
        }
        let wr_id = self.next_wr;
        let fenced = self.pending(side) == 0;
        let conn = self.conns[side];
        let mut posted = Posted {
            wr_id,
            spec: spec.clone(),
            data: None,
            write: None,
            read: None,
            atomic: None,
            valid: true,
            expect: WcStatus::Success,
            fenced,
            posted_at: self.net.elapsed(),
        };
        let r = match &spec.kind {
            OpKind::Send { stream, len } => {
                let data = Bytes::from(pattern(wr_id ^ 0xD47A << 20, *len as usize));
                posted.data = Some(data.clone());
                self.net.eps[side].post_send(conn, *stream, wr_id, data)
            }
            k @ OpKind::Write { .. } => {
                let (req, valid) = self.write_request(side, wr_id, k);
                posted.write = Some(req);
                posted.valid = valid;
                if !valid {
                    posted.expect = WcStatus::RemoteAccessError;
                }
                self.net.eps[side].post_write(conn, req)
            }
            k @ OpKind::Read { .. } => {
                let (req, valid) = self.read_request(side, wr_id, k);
                posted.read = Some(req);
                posted.valid = valid;
                if !valid {
                    posted.expect = WcStatus::RemoteAccessError;
                }
                self.net
                    .snap_on
                    .insert((side, wr_id), (req.lkey, req.local_offset, req.len as u64));
                self.net.eps[side].post_read(conn, req)
            }
            k @ OpKind::Atomic { .. } => {
                let slot = self.posted[side]
                    .iter()
                    .filter(|p| p.atomic.is_some())
                    .count();
                if slot >= ATOMIC_SLOTS {
                    return Err(format!("side {side}: more than {ATOMIC_SLOTS} atomics"));
                }
                let (req, status) = self.atomic_request(side, wr_id, slot, k);
                posted.atomic = Some((req, slot));
                posted.valid = status == WcStatus::Success;
                posted.expect = status;
                self.net
                    .snap_on
                    .insert((side, wr_id), (req.lkey, req.local_offset, 8));
                self.net.eps[side].post_atomic(conn, req)
            }
            OpKind::Recv { .. } => unreachable!(),
        };
        match r {
            Ok(()) => {
                self.next_wr += 1;
                let send = matches!(spec.kind, OpKind::Send { .. });
                self.posted[side].push(posted);
                // A sender that gives up after rnr_retry RNR NAKs would fail SENDs whose
                // receive comes late: give them their receive now (before any packet
                // arrives), unless the schedule starves the stream.
                if send && self.eager_receives && self.net.configs[side].transport.rnr_retry != 7 {
                    self.top_up_receives(1 - side)?;
                }
                Ok(())
            }
            Err(PostError::UnknownConnection) if self.net.lost(side, conn).is_some() => {
                self.refused[side].push(spec);
                Ok(())
            }
            Err(e) => Err(format!("post of {spec:?} refused: {e:?}")),
        }
    }

    /// The status each operation of `side` completes with when nothing goes wrong: its own
    /// expectation, except SENDs to a peer that requires posted receives: message k of a
    /// stream lands in receive k of that stream; RemoteInvalidRequest if that receive is
    /// shorter; on a starved stream the first SEND fails with RnrRetryExceeded and the
    /// stream's later SENDs are flushed (WrFlushError: the stream is in the error state).
    pub fn expected(&self, side: usize) -> Vec<WcStatus> {
        let rx = 1 - side;
        let mut exp: Vec<WcStatus> = self.posted[side].iter().map(Posted::expected).collect();
        if self.posted_mode(rx) {
            for st in self.send_streams(side) {
                let recvs = self.recvs_on(rx, st);
                for (k, (i, len)) in self.sends_on(side, st).into_iter().enumerate() {
                    if self.starved[rx].contains(&st) {
                        exp[i] = if k == 0 {
                            WcStatus::RnrRetryExceeded
                        } else {
                            WcStatus::WrFlushError
                        };
                    } else if recvs.get(k).is_some_and(|r| r.len < len) {
                        exp[i] = WcStatus::RemoteInvalidRequest;
                    }
                }
            }
        }
        exp
    }

    /// Post a schedule: wait each op's gap (and fence), then post it.
    pub fn post_all(&mut self, ops: &[OpSpec], fence_limit: Duration) -> Result<(), String> {
        for op in ops {
            if op.gap_us > 0 {
                self.net.run_for(Duration::from_micros(op.gap_us as u64));
            }
            if op.fence {
                let side = op.side;
                // SENDs waiting for receives would hold the fence up to the limit (and RNR
                // rounds cost steps): receives missing so far come now.
                self.top_up_receives(0)?;
                self.top_up_receives(1)?;
                let limit = self.net.elapsed() + fence_limit;
                self.net.run_until(limit, |n| {
                    self.posted[side].len() == n.completions(side, self.conns[side]).len()
                });
            }
            self.post(op.clone())?;
        }
        Ok(())
    }

    /// Run until every operation completed (within `limit` of virtual time from the start)
    /// and then until the network is quiet (within `quiet` more). Liveness check.
    pub fn finish(&mut self, limit: Duration, quiet: Duration) -> Result<(), String> {
        self.top_up_receives(0)?;
        self.top_up_receives(1)?;
        let conns = self.conns;
        let counts = [self.posted[0].len(), self.posted[1].len()];
        let done = self.net.run_until(limit, |n| {
            (0..2).all(|i| n.completions(i, conns[i]).len() == counts[i])
        });
        if !done {
            return Err(format!(
                "liveness: not every operation completed by {:?} (stopped at {:?}): posted {:?}, completed [{}, {}], lost [{:?}, {:?}]",
                limit,
                self.net.elapsed(),
                counts,
                self.net.completions(0, conns[0]).len(),
                self.net.completions(1, conns[1]).len(),
                self.net.lost(0, conns[0]),
                self.net.lost(1, conns[1]),
            ));
        }
        if !self.net.run_until_idle(quiet) {
            return Err(format!(
                "liveness: the network did not go quiet within {quiet:?} after the last completion (in flight {}, timers {:?} {:?})",
                self.net.in_flight(),
                self.net.eps[0].poll_timeout().map(|t| t - self.net.now),
                self.net.eps[1].poll_timeout().map(|t| t - self.net.now),
            ));
        }
        Ok(())
    }

    // ---- checks ----

    /// Every check below.
    pub fn check_all(&self) -> Result<(), String> {
        self.check_completions()?;
        self.check_streams()?;
        self.check_recvs()?;
        self.check_immediates()?;
        self.check_memory()?;
        self.check_rdma_memory()?;
        self.check_rdma_counts()?;
        self.check_endpoint_stats()?;
        Ok(())
    }

    /// One completion per posted operation, in the order `check_report_order` gives, with
    /// the right opcode, length
    /// and status; error statuses only in the patterns a failure or close allows; the
    /// ConnectionLost event (if any) after the last completion.
    pub fn check_completions(&self) -> Result<(), String> {
        for side in 0..2 {
            let conn = self.conns[side];
            self.check_report_order(side)?;
            let wcs = self.wcs(side);
            let posted = &self.posted[side];
            if wcs.len() != posted.len() {
                return Err(format!(
                    "side {side}: {} completions for {} operations",
                    wcs.len(),
                    posted.len()
                ));
            }
            for (wc, p) in wcs.iter().zip(posted) {
                if wc.wr_id != p.wr_id {
                    return Err(format!(
                        "side {side}: completion for wr {} where wr {} was due (posting order): {:?}",
                        wc.wr_id,
                        p.wr_id,
                        wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>()
                    ));
                }
                if wc.opcode != p.opcode() || wc.byte_len != p.len() {
                    return Err(format!("side {side}: wr {}: {wc:?} for {p:?}", p.wr_id));
                }
            }
            let lost = self.net.lost(side, conn);
            let n_lost = self.net.events[side]
                .iter()
                .filter(|e| matches!(e, Event::ConnectionLost { conn: c, .. } if *c == conn))
                .count();
            if n_lost > 1 {
                return Err(format!("side {side}: {n_lost} ConnectionLost events"));
            }
            if let Some(pos) = self.net.events[side]
                .iter()
                .position(|e| matches!(e, Event::ConnectionLost { conn: c, .. } if *c == conn))
            {
                if self.net.events[side][pos + 1..]
                    .iter()
                    .any(|e| matches!(e, Event::Completion { conn: c, .. } if *c == conn))
                {
                    return Err(format!("side {side}: a completion after ConnectionLost"));
                }
            }
            let statuses: Vec<WcStatus> = wcs.iter().map(|w| w.status).collect();
            let expected = self.expected(side);
            match lost {
                None => {
                    if statuses != expected {
                        return Err(format!(
                            "side {side}: statuses {statuses:?}, expected {expected:?}"
                        ));
                    }
                }
                Some(ConnectionError::RetryExceeded) => {
                    if !self.allow_failure {
                        return Err(format!(
                            "side {side}: connection failed (RetryExceeded) under a schedule without a long outage; statuses {statuses:?}"
                        ));
                    }
                    check_error_pattern(side, &statuses, &expected, WcStatus::RetryExceeded)?;
                }
                Some(
                    r @ (ConnectionError::LocallyClosed | ConnectionError::ClosedByPeer { .. }),
                ) => {
                    let by = if r == ConnectionError::LocallyClosed {
                        side
                    } else {
                        1 - side
                    };
                    if self.closed_by != Some(by) {
                        return Err(format!("side {side}: unexpected {r:?}"));
                    }
                    check_error_pattern(side, &statuses, &expected, WcStatus::WrFlushError)?;
                }
                Some(ConnectionError::HandshakeTimeout) if side == 1 && self.allow_failure => {
                    // The accepting side's half-open connection expired: a long outage
                    // began before the client's Confirm (or first packet) reached it, and
                    // half-open state is bounded in time (issue #9: `handshake_attempts`
                    // Accepts, `handshake_interval` apart). The core reports it only from
                    // the half-open state. Its operations are flushed.
                    check_error_pattern(side, &statuses, &expected, WcStatus::WrFlushError)?;
                }
                Some(r) => return Err(format!("side {side}: connection lost: {r:?}")),
            }
        }
        Ok(())
    }

    /// Messages: per stream, what the receiver got is exactly what was sent, in order, each
    /// once — or, if the sender's connection ended, a prefix of it that contains every
    /// message whose SEND completed successfully.
    pub fn check_streams(&self) -> Result<(), String> {
        for side in 0..2 {
            let rx = 1 - side;
            let got = self.net.messages(rx, self.conns[rx]);
            if self.posted_mode(rx) {
                // Every stream consumes posted receives: see check_recvs.
                if let Some(st) = got.keys().next() {
                    return Err(format!(
                        "side {rx} requires posted receives but got a message (library buffer) on stream {st}"
                    ));
                }
                continue;
            }
            let wcs = self.wcs(side);
            let ended = self.net.lost(side, self.conns[side]).is_some()
                || self.net.lost(rx, self.conns[rx]).is_some();
            let mut sent: BTreeMap<u32, Vec<(Bytes, WcStatus)>> = BTreeMap::new();
            for (p, wc) in self.posted[side].iter().zip(wcs.iter()) {
                if let OpKind::Send { stream, .. } = p.spec.kind {
                    sent.entry(stream)
                        .or_default()
                        .push((p.data.clone().unwrap(), wc.status));
                }
            }
            for st in got.keys() {
                if !sent.contains_key(st) {
                    return Err(format!("side {rx}: message on stream {st} nobody sent"));
                }
            }
            for (st, msgs) in &sent {
                let empty = Vec::new();
                let g = got.get(st).unwrap_or(&empty);
                if g.len() > msgs.len() {
                    return Err(format!(
                        "stream {st} ({side}->{rx}): {} messages delivered, {} sent (duplicate delivery)",
                        g.len(),
                        msgs.len()
                    ));
                }
                for (i, (a, (b, _))) in g.iter().zip(msgs).enumerate() {
                    if a != b {
                        return Err(format!(
                            "stream {st} ({side}->{rx}): message {i} differs (len {} vs {}){}",
                            a.len(),
                            b.len(),
                            if msgs.iter().any(|(m, _)| m == a) {
                                " — it equals another message of the stream (order/duplicate)"
                            } else {
                                ""
                            }
                        ));
                    }
                }
                let must = msgs
                    .iter()
                    .rposition(|(_, s)| *s == WcStatus::Success)
                    .map_or(0, |i| i + 1);
                if g.len() < must {
                    return Err(format!(
                        "stream {st} ({side}->{rx}): {} messages delivered but {must} completed successfully",
                        g.len()
                    ));
                }
                if !ended && g.len() != msgs.len() {
                    return Err(format!(
                        "stream {st} ({side}->{rx}): {} of {} messages delivered",
                        g.len(),
                        msgs.len()
                    ));
                }
            }
        }
        Ok(())
    }

    /// Posted receives (sides that require them): message k of a stream lands in receive k
    /// of that stream (posting order), whole and exactly once: `Success` with the message
    /// length, or `LocalLengthError` if the receive is shorter (the SEND then completes with
    /// `RemoteInvalidRequest`); receive completions in posting order per stream, each
    /// receive at most once; every SEND that succeeded was received; without a failure every
    /// message was received and no other receive completed; when the receiver's connection
    /// ended, the rest completed with `WrFlushError`; on a starved stream (in the error
    /// state after its first SEND failed) every receive completes with `WrFlushError`.
    /// Sides without posted mode report no
    /// receive completions.
    pub fn check_recvs(&self) -> Result<(), String> {
        for rx in 0..2 {
            let tx = 1 - rx;
            let got = self.net.recv_completions(rx, self.conns[rx]);
            if !self.posted_mode(rx) {
                if let Some(g) = got.first() {
                    return Err(format!(
                        "side {rx}: receive completion {g:?} without receives"
                    ));
                }
                continue;
            }
            let rx_ended = self.net.lost(rx, self.conns[rx]).is_some();
            let ended = rx_ended || self.net.lost(tx, self.conns[tx]).is_some();
            let wcs = self.wcs(tx);
            let mut seen = HashSet::new();
            for (st, wc) in &got {
                if wc.opcode != WcOpcode::Recv {
                    return Err(format!("side {rx}: receive completion {wc:?}"));
                }
                match self.recvs[rx].iter().find(|r| r.wr_id == wc.wr_id) {
                    None => return Err(format!("side {rx}: completion of unknown receive {wc:?}")),
                    Some(r) if r.stream != *st => {
                        return Err(format!(
                            "side {rx}: receive {} of stream {} completed on stream {st}",
                            wc.wr_id, r.stream
                        ))
                    }
                    _ => {}
                }
                if !seen.insert(wc.wr_id) {
                    return Err(format!("side {rx}: receive {} completed twice", wc.wr_id));
                }
            }
            let mut streams: Vec<u32> = self.recvs[rx].iter().map(|r| r.stream).collect();
            streams.extend(self.send_streams(tx));
            streams.sort_unstable();
            streams.dedup();
            for st in streams {
                let recvs = self.recvs_on(rx, st);
                let sends = self.sends_on(tx, st);
                let g: Vec<metaroce::WorkCompletion> = got
                    .iter()
                    .filter(|(s, _)| *s == st)
                    .map(|(_, w)| *w)
                    .collect();
                let ctx = || {
                    format!(
                        "stream {st} ({tx}->{rx}): receives {:?}, messages {:?}, receive completions {:?}",
                        recvs.iter().map(|r| (r.wr_id, r.len)).collect::<Vec<_>>(),
                        sends
                            .iter()
                            .map(|&(i, len)| (self.posted[tx][i].wr_id, len, wcs.get(i).map(|w| w.status)))
                            .collect::<Vec<_>>(),
                        g.iter().map(|w| (w.wr_id, w.status, w.byte_len)).collect::<Vec<_>>()
                    )
                };
                if g.iter().zip(&recvs).any(|(w, r)| w.wr_id != r.wr_id) {
                    return Err(format!(
                        "receive completions out of posting order: {}",
                        ctx()
                    ));
                }
                let matched = g
                    .iter()
                    .take_while(|w| w.status != WcStatus::WrFlushError)
                    .count();
                if g[matched..]
                    .iter()
                    .any(|w| w.status != WcStatus::WrFlushError || w.byte_len != 0)
                {
                    return Err(format!(
                        "a receive completed after a flushed one: {}",
                        ctx()
                    ));
                }
                let starved = self.starved[rx].contains(&st);
                if matched < g.len() && !rx_ended && !starved {
                    return Err(format!("receives flushed on a live connection: {}", ctx()));
                }
                if matched > sends.len() {
                    return Err(format!("a receive completed by no message: {}", ctx()));
                }
                for k in 0..matched {
                    let (i, len) = sends[k];
                    let want = if len > recvs[k].len {
                        WcStatus::LocalLengthError
                    } else {
                        WcStatus::Success
                    };
                    if g[k].status != want || g[k].byte_len != len {
                        return Err(format!(
                            "receive {k} completed {:?} / {} bytes, expected {want:?} / {len}: {}",
                            g[k].status,
                            g[k].byte_len,
                            ctx()
                        ));
                    }
                    let sender = if want == WcStatus::Success {
                        WcStatus::Success
                    } else {
                        WcStatus::RemoteInvalidRequest
                    };
                    if let Some(w) = wcs.get(i) {
                        let failed =
                            matches!(w.status, WcStatus::RetryExceeded | WcStatus::WrFlushError);
                        if w.status != sender && !(ended && failed) {
                            return Err(format!(
                                "message {k} was received ({want:?}) but its SEND completed {:?}: {}",
                                w.status,
                                ctx()
                            ));
                        }
                    }
                }
                let must = sends
                    .iter()
                    .rposition(|(i, _)| {
                        wcs.get(*i).is_some_and(|w| {
                            matches!(w.status, WcStatus::Success | WcStatus::RemoteInvalidRequest)
                        })
                    })
                    .map_or(0, |k| k + 1);
                if matched < must {
                    return Err(format!(
                        "{matched} messages received but {must} SENDs completed: {}",
                        ctx()
                    ));
                }
                if starved && matched != 0 {
                    return Err(format!(
                        "a receive completed with a message on a starved stream: {}",
                        ctx()
                    ));
                }
                // The stream is in the error state at the receiver once the sender's abort
                // arrived: every receive posted on it is flushed, before or after that.
                if starved && !ended && g.len() != recvs.len() {
                    return Err(format!("receives on a dead stream not flushed: {}", ctx()));
                }
                if !ended && !self.starved[rx].contains(&st) && matched != sends.len() {
                    return Err(format!(
                        "{matched} of {} messages received: {}",
                        sends.len(),
                        ctx()
                    ));
                }
                if rx_ended && g.len() != recvs.len() {
                    return Err(format!(
                        "the connection ended but not every receive completed: {}",
                        ctx()
                    ));
                }
            }
        }
        Ok(())
    }

    /// Immediates: exactly once per successful WRITE with immediate, never for a refused
    /// one, at most once for one that failed with the connection; right length.
    pub fn check_immediates(&self) -> Result<(), String> {
        for side in 0..2 {
            let rx = 1 - side;
            let imms = self.net.immediates(rx, self.conns[rx]);
            let wcs = self.wcs(side);
            let mut count: HashMap<u32, (u32, usize)> = HashMap::new();
            for (imm, len) in &imms {
                let e = count.entry(*imm).or_insert((*len, 0));
                e.1 += 1;
            }
            for (p, wc) in self.posted[side].iter().zip(wcs.iter()) {
                let OpKind::Write { imm: true, .. } = p.spec.kind else {
                    continue;
                };
                let n = count.remove(&imm_of(p.wr_id));
                let times = n.map_or(0, |x| x.1);
                if let Some((len, _)) = n {
                    if len != p.len() {
                        return Err(format!("wr {}: immediate with byte_len {len}", p.wr_id));
                    }
                }
                let ok = match wc.status {
                    WcStatus::Success => times == 1,
                    WcStatus::RemoteAccessError => times == 0,
                    WcStatus::RetryExceeded | WcStatus::WrFlushError => times <= p.valid as usize,
                    _ => false,
                };
                if !ok {
                    return Err(format!(
                        "wr {} ({side}->{rx}, {:?}, valid {}): immediate reported {times} times",
                        p.wr_id, wc.status, p.valid
                    ));
                }
            }
            if !count.is_empty() {
                return Err(format!(
                    "side {rx}: immediates nobody sent: {:?}",
                    count.keys()
                ));
            }
        }
        Ok(())
    }

    /// Memory: each byte of every writable region holds a value some allowed WRITE put
    /// there (the last WRITE posted after everything before it completed wins; overlapping
    /// WRITEs in flight together may leave either's bytes; a WRITE that failed with the
    /// connection may have landed partly); canaries around the target area, the region
    /// without REMOTE_WRITE and the local sources are untouched; refused WRITEs wrote nothing.
    pub fn check_memory(&self) -> Result<(), String> {
        for rx in 0..2 {
            let side = 1 - rx;
            let regs = &self.regions[rx];
            let wcs = self.wcs(side);
            let src = self.net.eps[side]
                .mr_read(self.regions[side].src.lkey, 0, SRC_LEN as u64)
                .map_err(|e| format!("{e}"))?;
            let want_src = pattern(0x5_0c0 + side as u64, SRC_LEN as usize);
            if src[..] != want_src[..] {
                return Err(format!("side {side}: the local source region changed"));
            }
            // Candidate writers per byte of the rw region: None = canary.
            let n = (2 * GUARD + AREA) as usize;
            let mut cand: Vec<Vec<Option<usize>>> = vec![vec![None]; n];
            for (i, (p, wc)) in self.posted[side].iter().zip(wcs.iter()).enumerate() {
                let Some(req) = p.write else { continue };
                if req.len == 0 {
                    continue;
                }
                let landed = match wc.status {
                    WcStatus::Success => true,
                    WcStatus::RemoteAccessError => false,
                    _ => p.valid,
                };
                if !landed {
                    continue;
                }
                let off = (req.remote_addr - regs.rw.addr) as usize;
                for c in &mut cand[off..off + req.len as usize] {
                    if p.fenced && wc.status == WcStatus::Success {
                        c.clear();
                    }
                    c.push(Some(i));
                }
            }
            let mem = self.net.eps[rx]
                .mr_read(regs.rw.lkey, 0, n as u64)
                .map_err(|e| format!("{e}"))?;
            for (b, &v) in mem.iter().enumerate() {
                let ok = cand[b].iter().any(|c| match c {
                    None => v == canary(rx, 1, b),
                    Some(i) => {
                        let req = self.posted[side][*i].write.unwrap();
                        let off = (req.remote_addr - regs.rw.addr) as usize;
                        v == want_src[req.local_offset as usize + b - off]
                    }
                });
                if !ok {
                    let zone = if b < GUARD as usize || b >= (GUARD + AREA) as usize {
                        "canary guard"
                    } else {
                        "target area"
                    };
                    return Err(format!(
                        "side {rx}: rw region byte {b} ({zone}) = {v:#04x}, allowed writers {:?} (wr ids {:?})",
                        cand[b],
                        cand[b]
                            .iter()
                            .map(|c| c.map(|i| self.posted[side][i].wr_id))
                            .collect::<Vec<_>>()
                    ));
                }
            }
            let ro = self.net.eps[rx]
                .mr_read(regs.ro.lkey, 0, RO_LEN as u64)
                .map_err(|e| format!("{e}"))?;
            if let Some(b) = (0..RO_LEN as usize).find(|&b| ro[b] != canary(rx, 2, b)) {
                return Err(format!(
                    "side {rx}: region without REMOTE_WRITE changed at byte {b}"
                ));
            }
        }
        Ok(())
    }

    /// Memory touched by READs, atomics and receives:
    ///
    /// * READ sources never change;
    /// * READ destinations: each byte holds the canary or what some READ that may have
    ///   landed read there (a successful READ posted after everything before it completed
    ///   wins) — invalid READs write nothing, nothing lands outside the target area;
    /// * each successful READ's bytes are in place when its completion is reported (a
    ///   snapshot then): every byte is the remote byte, or that of another READ into the same
    ///   place posted before the completion;
    /// * atomics: the result slot of each successful one holds its original value (also when
    ///   its completion was reported); every other byte of the result region is canary; the
    ///   counter's canaries are intact; the counter's final value and the original values are
    ///   those of executing the successful atomics one after the other, each exactly once, in
    ///   some order (see [`serial_order_exists`]) — and an atomic posted after every earlier
    ///   operation completed saw all of their effects;
    /// * receive buffers: a successful receive holds its message (and the canary after it);
    ///   a receive that failed or is still pending holds the canary (or, after a failure, a
    ///   partial copy of its message); bytes between receive slots are canary.
    pub fn check_rdma_memory(&self) -> Result<(), String> {
        for side in 0..2 {
            let peer = 1 - side;
            let regs = &self.regions[side];
            let peer_regs = &self.regions[peer];
            let wcs = self.wcs(side);
            let ended = (0..2).any(|i| self.net.lost(i, self.conns[i]).is_some());
            let read = |lkey: u32, off: u64, len: u64| {
                self.net.eps[side]
                    .mr_read(lkey, off, len)
                    .map_err(|e| format!("side {side}: {e}"))
            };
            if read(regs.rsrc.lkey, 0, RSRC_LEN as u64)?[..] != rsrc_bytes(side)[..] {
                return Err(format!("side {side}: the READ source region changed"));
            }

            // READs.
            let peer_src = rsrc_bytes(peer);
            let reads: Vec<(usize, ReadRequest, WcStatus)> = self.posted[side]
                .iter()
                .zip(wcs.iter())
                .enumerate()
                .filter_map(|(i, (p, wc))| p.read.map(|r| (i, r, wc.status)))
                .filter(|(_, r, _)| r.len > 0)
                .collect();
            let value = |r: &ReadRequest, b: usize| -> u8 {
                peer_src
                    [(r.remote_addr - peer_regs.rsrc.addr) as usize + b - r.local_offset as usize]
            };
            let may_land = |i: usize, st: WcStatus| match st {
                WcStatus::Success => true,
                WcStatus::RemoteAccessError => false,
                _ => self.posted[side][i].valid,
            };
            // Byte by byte, the READs that may have put it there, newest first, down to the
            // newest successful one that was posted after everything before it completed;
            // the canary only if there is no such READ.
            let n = (2 * GUARD + AREA) as usize;
            let mem = read(regs.rdst.lkey, 0, n as u64)?;
            for (b, &v) in mem.iter().enumerate() {
                let mut ok = false;
                let mut canary_allowed = true;
                let covers = |r: &ReadRequest| {
                    (r.local_offset as usize..(r.local_offset + r.len as u64) as usize).contains(&b)
                };
                for &(i, r, st) in reads.iter().rev() {
                    if !may_land(i, st) || !covers(&r) {
                        continue;
                    }
                    if v == value(&r, b) {
                        ok = true;
                        break;
                    }
                    if self.posted[side][i].fenced && st == WcStatus::Success {
                        canary_allowed = false;
                        break;
                    }
                }
                if !(ok || (canary_allowed && v == canary(side, 4, b))) {
                    let allowed: Vec<u64> = reads
                        .iter()
                        .filter(|&&(i, r, st)| may_land(i, st) && covers(&r))
                        .map(|&(i, _, _)| self.posted[side][i].wr_id)
                        .collect();
                    return Err(format!(
                        "side {side}: READ destination byte {b} ({}) = {v:#04x}, READs that may land there (wr ids) {allowed:?}{}",
                        if b < GUARD as usize || b >= (GUARD + AREA) as usize {
                            "canary guard"
                        } else {
                            "target area"
                        },
                        if canary_allowed { " or the canary" } else { "" }
                    ));
                }
            }
            for &(i, r, st) in &reads {
                if st != WcStatus::Success {
                    continue;
                }
                let p = &self.posted[side][i];
                let Some((t, snap)) = self.net.snaps.get(&(side, p.wr_id)) else {
                    return Err(format!("side {side}: no snapshot of READ {}", p.wr_id));
                };
                for (k, &v) in snap.iter().enumerate() {
                    let b = r.local_offset as usize + k;
                    if v == value(&r, b) {
                        continue;
                    }
                    let other = reads.iter().any(|&(j, q, sj)| {
                        j != i
                            && may_land(j, sj)
                            && self.posted[side][j].posted_at <= *t
                            && (q.local_offset as usize..(q.local_offset + q.len as u64) as usize)
                                .contains(&b)
                            && v == value(&q, b)
                    });
                    if !other {
                        return Err(format!(
                            "side {side}: READ {} ({} bytes from {:#x}) completed at {t:?} while byte {k} of its buffer was {v:#04x}, not the remote byte {:#04x}",
                            p.wr_id,
                            r.len,
                            r.remote_addr - peer_regs.rsrc.addr,
                            value(&r, b)
                        ));
                    }
                }
            }

            // Atomics (this side's, on the peer's counter). An operation posted after every
            // earlier one completed cuts the atomics into segments that executed one after
            // the other; within a segment, in any order.
            let ares = read(regs.ares.lkey, 0, slot_off(ATOMIC_SLOTS))?;
            let mut result_bytes = vec![false; ares.len()];
            let mut segments: Vec<Vec<(u64, u64)>> = vec![Vec::new()];
            let mut uncertain = 0;
            let init = counter_init(peer);
            for (p, wc) in self.posted[side].iter().zip(wcs.iter()) {
                if p.fenced && !segments.last().unwrap().is_empty() {
                    segments.push(Vec::new());
                }
                let Some((req, slot)) = p.atomic else {
                    continue;
                };
                let off = slot_off(slot) as usize;
                let untouched = (off..off + 8).all(|b| ares[b] == canary(side, 6, b));
                let orig = u64::from_le_bytes(ares[off..off + 8].try_into().unwrap());
                if wc.status != WcStatus::Success {
                    if p.valid && wc.status != p.expect {
                        // Flushed or failed with the connection: it may have executed. If
                        // its response landed before the flush (an operation behind a
                        // pending one is flushed even if it finished), its original value
                        // is in its slot and it counts as executed.
                        if untouched {
                            uncertain += 1;
                        } else {
                            result_bytes[off..off + 8].fill(true);
                            segments
                                .last_mut()
                                .unwrap()
                                .push((orig, apply_atomic(req.op, orig)));
                        }
                    }
                    continue;
                }
                result_bytes[off..off + 8].fill(true);
                match self.net.snaps.get(&(side, p.wr_id)) {
                    Some((_, snap)) if snap[..] == ares[off..off + 8] => {}
                    Some((_, snap)) => {
                        return Err(format!(
                            "side {side}: atomic {} reported its completion before its original value landed ({snap:02x?} then {orig:#x})",
                            p.wr_id
                        ))
                    }
                    None => return Err(format!("side {side}: no snapshot of atomic {}", p.wr_id)),
                }
                segments
                    .last_mut()
                    .unwrap()
                    .push((orig, apply_atomic(req.op, orig)));
            }
            if let Some(b) =
                (0..ares.len()).find(|&b| !result_bytes[b] && ares[b] != canary(side, 6, b))
            {
                return Err(format!(
                    "side {side}: atomic result region byte {b} (slot {}) changed: {:02x?}",
                    b.saturating_sub(8) / 16,
                    &ares[b & !7..(b & !7) + 8]
                ));
            }
            let ctr = self.net.eps[peer]
                .mr_read(peer_regs.ctr.lkey, 0, CTR_LEN as u64)
                .map_err(|e| format!("{e}"))?;
            if let Some(b) = (0..CTR_LEN as usize)
                .filter(|b| !(CTR_OFF as usize..CTR_OFF as usize + 8).contains(b))
                .find(|&b| ctr[b] != canary(peer, 5, b))
            {
                return Err(format!(
                    "side {peer}: counter region canary byte {b} changed"
                ));
            }
            let fin = u64::from_le_bytes(
                ctr[CTR_OFF as usize..CTR_OFF as usize + 8]
                    .try_into()
                    .unwrap(),
            );
            if uncertain == 0 {
                let mut at = init;
                for (k, seg) in segments.iter().enumerate() {
                    let end = serial_end(at, seg)
                        .filter(|&e| serial_order_exists(at, e, seg))
                        .ok_or_else(|| {
                            format!(
                                "side {peer}: counter {init:#x} -> {fin:#x}: the atomics of segment {k} (original -> new value) {seg:x?} cannot have executed once each one after the other from {at:#x} (segments, cut where an operation was posted after every earlier one completed: {segments:x?})"
                            )
                        })?;
                    at = end;
                }
                if at != fin {
                    return Err(format!(
                        "side {peer}: counter {init:#x} -> {fin:#x}, but the atomics (original -> new value) {segments:x?} leave it at {at:#x}"
                    ));
                }
            }

            // Receive buffers (this side's).
            let rbuf = read(regs.rbuf.lkey, 0, regs.rbuf.len)?;
            let mut covered = vec![false; rbuf.len()];
            let got = self.net.recv_completions(side, self.conns[side]);
            let mut by_stream: HashMap<u32, usize> = HashMap::new();
            for r in &self.recvs[side] {
                let k = by_stream.entry(r.stream).or_default();
                let msg = self
                    .sends_on(peer, r.stream)
                    .get(*k)
                    .and_then(|&(i, _)| self.posted[peer][i].data.clone());
                *k += 1;
                let off = r.offset as usize;
                covered[off..off + r.len as usize].fill(true);
                let slot = &rbuf[off..off + r.len as usize];
                let status = got
                    .iter()
                    .find(|(_, w)| w.wr_id == r.wr_id)
                    .map(|(_, w)| w.status);
                let canary_at = |b: usize| canary(side, 7, off + b);
                // A receive flushed on a dead stream may hold part of a message that began
                // landing before the stream abort arrived (IBA: undefined contents).
                let dead = self.starved[side].contains(&r.stream);
                for (b, &v) in slot.iter().enumerate() {
                    let msg_byte = msg.as_ref().and_then(|m| m.get(b).copied());
                    let ok = match status {
                        Some(WcStatus::Success) => match msg_byte {
                            Some(x) => v == x,
                            None => v == canary_at(b),
                        },
                        Some(WcStatus::LocalLengthError) => v == canary_at(b),
                        _ if ended || dead => v == canary_at(b) || Some(v) == msg_byte,
                        _ => v == canary_at(b),
                    };
                    if !ok {
                        return Err(format!(
                            "side {side}: receive {} (stream {}, {} bytes, {status:?}) byte {b} = {v:#04x}, message byte {msg_byte:x?}",
                            r.wr_id, r.stream, r.len
                        ));
                    }
                }
                if status == Some(WcStatus::Success) {
                    let Some((_, snap)) = self.net.snaps.get(&(side, r.wr_id)) else {
                        continue;
                    };
                    if snap[..] != slot[..] {
                        return Err(format!(
                            "side {side}: receive {} reported before its message was in place",
                            r.wr_id
                        ));
                    }
                }
            }
            if let Some(b) = (0..rbuf.len()).find(|&b| !covered[b] && rbuf[b] != canary(side, 7, b))
            {
                return Err(format!(
                    "side {side}: receive buffer region byte {b} (outside every receive) changed"
                ));
            }
        }
        Ok(())
    }

    /// Exactly-once execution at the responder: the peer's READ and atomic counters equal
    /// the numbers of successful READs and atomics (plus at most those whose fate the end of
    /// the connection left open).
    pub fn check_rdma_counts(&self) -> Result<(), String> {
        for side in 0..2 {
            // The responder's counters as of its connection's end, if it ended (an ended
            // connection executes nothing more).
            let rx = 1 - side;
            let Some(recv) = self.net.last_stats[rx].get(&self.conns[rx]).map(|s| s.recv) else {
                return Err(format!(
                    "side {rx}: no counters of connection {}",
                    self.conns[rx]
                ));
            };
            let wcs = self.wcs(side);
            let (mut reads, mut reads_open, mut atomics, mut atomics_open) = (0, 0, 0, 0);
            for (p, wc) in self.posted[side].iter().zip(wcs.iter()) {
                let (ok, open) = (
                    wc.status == WcStatus::Success,
                    p.valid
                        && matches!(wc.status, WcStatus::RetryExceeded | WcStatus::WrFlushError),
                );
                if p.read.is_some() {
                    reads += ok as u64;
                    reads_open += open as u64;
                }
                if p.atomic.is_some() {
                    atomics += ok as u64;
                    atomics_open += open as u64;
                }
            }
            if recv.reads < reads || recv.reads > reads + reads_open {
                return Err(format!(
                    "side {}: executed {} READs for {reads} successful ones (+{reads_open} open)",
                    1 - side,
                    recv.reads
                ));
            }
            if recv.atomics < atomics || recv.atomics > atomics + atomics_open {
                return Err(format!(
                    "side {}: executed {} atomics for {atomics} successful ones (+{atomics_open} open)",
                    1 - side,
                    recv.atomics
                ));
            }
        }
        Ok(())
    }

    /// No malformed or bad-ICRC packets (the network never corrupts); no packet for an
    /// unknown connection unless a connection ended; one connection per side.
    pub fn check_endpoint_stats(&self) -> Result<(), String> {
        let ended = (0..2).any(|i| self.net.lost(i, self.conns[i]).is_some());
        for i in 0..2 {
            let s = self.net.eps[i].stats();
            if s.malformed != 0 || s.bad_icrc != 0 || s.unsupported != 0 {
                return Err(format!("side {i}: {s:?}"));
            }
            if !ended && !self.stale_expected && s.unknown_connection != 0 {
                return Err(format!(
                    "side {i}: packets for unknown connections while both ends were up: {s:?}"
                ));
            }
            // Every data packet carries its path's floor, at most 254 PSNs behind it, and
            // the receiver takes a packet its consistent floor brings into the window
            // (docs/PROTOCOL.md, "Delivery", check 2): a conforming sender never lands
            // beyond the 256-packet window unless every packet with the floor it last
            // learned was lost (a blackhole: resynchronization). That happens under a long
            // total outage (`allow_failure`): each RTO gives up on the path's packets and
            // moves its floor on while nothing arrives, so after enough of them the
            // receiver drops the first packets of the path's recovery before it resyncs
            // (found by `prop_rdma::rdma_ops_with_long_outage`; the case is kept in its
            // regression file).
            if let Some(st) = self.stats(i) {
                let resync = self.allow_failure && st.out_of_window_packets > 0;
                if st.out_of_window_packets != self.forged_beyond_window[i] && !resync {
                    return Err(format!(
                        "side {i}: {} packets beyond the SACK window",
                        st.out_of_window_packets
                    ));
                }
            }
            let n = self.net.eps[i].connections().count();
            if n > 1 && !self.stale_expected {
                return Err(format!("side {i}: {n} connections"));
            }
        }
        Ok(())
    }
}

/// Whether atomics with these (original value, new value) pairs can have executed one
/// after the other, each exactly once, starting from `init` and leaving `fin`: a walk from
/// `init` to `fin` that uses every pair once as an edge (an Eulerian trail of the multigraph
/// of values: balanced degrees and one connected component).
pub fn serial_order_exists(init: u64, fin: u64, edges: &[(u64, u64)]) -> bool {
    if serial_end(init, edges) != Some(fin) {
        return false;
    }
    let mut parent: HashMap<u64, u64> = HashMap::new();
    fn root(parent: &mut HashMap<u64, u64>, mut v: u64) -> u64 {
        while let Some(&p) = parent.get(&v) {
            if p == v {
                break;
            }
            v = p;
        }
        v
    }
    for &(a, b) in edges {
        parent.entry(a).or_insert(a);
        parent.entry(b).or_insert(b);
        let (ra, rb) = (root(&mut parent, a), root(&mut parent, b));
        parent.insert(ra, rb);
    }
    parent.entry(init).or_insert(init);
    let r = root(&mut parent, init);
    let vs: Vec<u64> = parent.keys().copied().collect();
    vs.into_iter().all(|v| root(&mut parent, v) == r)
}

/// The value an atomic leaves when it finds `orig`.
pub fn apply_atomic(op: AtomicOp, orig: u64) -> u64 {
    match op {
        AtomicOp::FetchAdd { add } => orig.wrapping_add(add),
        AtomicOp::CompareSwap { compare, swap } => {
            if orig == compare {
                swap
            } else {
                orig
            }
        }
    }
}

/// Where a serial execution of the (original, new) pairs from `init` ends, judged by the
/// degree balance (`None`: unbalanced, no serial order).
pub fn serial_end(init: u64, edges: &[(u64, u64)]) -> Option<u64> {
    let mut bal: HashMap<u64, i64> = HashMap::new();
    for &(a, b) in edges {
        *bal.entry(a).or_default() += 1;
        *bal.entry(b).or_default() -= 1;
    }
    *bal.entry(init).or_default() -= 1;
    let off: Vec<(u64, i64)> = bal.into_iter().filter(|&(_, d)| d != 0).collect();
    match off[..] {
        [] => Some(init),
        [(v, -1)] => Some(v),
        _ => None,
    }
}

/// Statuses after a connection ended: the expected statuses up to the first operation that
/// was still pending, which gets `first`; every later one either its expected status (it
/// had finished) or `WrFlushError`.
fn check_error_pattern(
    side: usize,
    statuses: &[WcStatus],
    expected: &[WcStatus],
    first: WcStatus,
) -> Result<(), String> {
    let Some(k) = statuses.iter().zip(expected).position(|(a, b)| a != b) else {
        return Ok(());
    };
    let bad = || {
        Err(format!(
            "side {side}: statuses {statuses:?} after the connection ended (expected {expected:?}, first error {first:?})"
        ))
    };
    if statuses[k] != first {
        return bad();
    }
    for (a, b) in statuses[k + 1..].iter().zip(&expected[k + 1..]) {
        if a != b && *a != WcStatus::WrFlushError {
            return bad();
        }
    }
    Ok(())
}

// =======================================================================================
// proptest strategies

/// How many cases a property runs: `PROPTEST_CASES` if set, else `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Message / WRITE lengths: zero, tiny, around the path MTU (1024), multi-packet.
pub fn op_len() -> impl Strategy<Value = u32> {
    prop_oneof![
        1 => Just(0u32),
        2 => 1u32..=64,
        2 => 1000u32..=1100,
        1 => Just(2048u32),
        3 => 1u32..=MAX_OP_LEN,
    ]
}

pub fn target() -> impl Strategy<Value = Target> {
    prop_oneof![
        12 => Just(Target::Area),
        1 => Just(Target::BadRkey),
        1 => Just(Target::StaleRkey),
        1 => Just(Target::PastEnd),
        1 => Just(Target::BeforeStart),
        1 => Just(Target::NoRemoteWrite),
    ]
}

pub fn op_kind(streams: u32) -> impl Strategy<Value = OpKind> {
    prop_oneof![
        (0..streams, op_len()).prop_map(|(stream, len)| OpKind::Send { stream, len }),
        (target(), 0..AREA, 0..SRC_LEN, op_len(), any::<bool>()).prop_map(
            |(target, dst_off, src_off, len, imm)| OpKind::Write {
                target,
                dst_off,
                src_off,
                len,
                imm,
            }
        ),
    ]
}

/// One operation; `sides` = 1 posts from A only, 2 from both.
pub fn op_spec(sides: usize, streams: u32) -> impl Strategy<Value = OpSpec> {
    (
        0..sides,
        prop_oneof![3 => Just(0u32), 1 => 1u32..2000],
        prop::bool::weighted(0.1),
        op_kind(streams),
    )
        .prop_map(|(side, gap_us, fence, kind)| OpSpec {
            side,
            gap_us,
            fence,
            kind,
        })
}

/// Direction of an impairment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirSel {
    AtoB,
    BtoA,
    Both,
}

/// Packet kinds an impairment phase targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KindSel {
    Any,
    Data,
    Ack,
}

/// An impairment in a schedule, in small integers so that it shrinks and prints well.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ActSpec {
    /// Loss, percent.
    Loss(u8),
    /// Burst loss of this many consecutive matching packets.
    Burst(u16),
    /// Duplication, percent.
    Dup(u8),
    /// Reordering: percent delayed, by up to this many µs.
    Reorder(u8, u16),
    /// Late copies: percent, delivered this many ms later.
    Late(u8, u16),
    /// CE marks, percent.
    Ce(u8),
    /// Blackhole.
    Blackhole,
}

/// One phase of an impairment schedule: from `start_us` for `len_us` (virtual µs after the
/// connection is up), `act` on packets matching `dir`, `kind`, `path`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Phase {
    pub start_us: u32,
    pub len_us: u32,
    pub dir: DirSel,
    pub kind: KindSel,
    pub path: Option<u8>,
    pub act: ActSpec,
}

impl Phase {
    /// The rules this phase adds, with times offset by `t0` (the start of the workload).
    pub fn rules(&self, t0: Duration) -> Vec<Rule> {
        let from = t0 + Duration::from_micros(self.start_us as u64);
        let until = from + Duration::from_micros(self.len_us as u64);
        let dirs: &[usize] = match self.dir {
            DirSel::AtoB => &[0],
            DirSel::BtoA => &[1],
            DirSel::Both => &[0, 1],
        };
        let pct = |p: u8| p as f64 / 100.0;
        let action = match self.act {
            ActSpec::Loss(p) => Action::Drop(pct(p)),
            ActSpec::Burst(n) => Action::Burst(n as u64),
            ActSpec::Dup(p) => Action::Dup {
                prob: pct(p),
                copies: 1,
            },
            ActSpec::Reorder(p, us) => Action::Jitter {
                prob: pct(p),
                max: Duration::from_micros(us as u64),
            },
            ActSpec::Late(p, ms) => Action::Late {
                prob: pct(p),
                after: Duration::from_millis(ms as u64),
            },
            ActSpec::Ce(p) => Action::Ce(pct(p)),
            ActSpec::Blackhole => Action::Blackhole,
        };
        dirs.iter()
            .map(|&d| {
                let mut f = Filter::any().from(d);
                f.kind = match self.kind {
                    KindSel::Any => None,
                    KindSel::Data => Some(Kind::Data),
                    KindSel::Ack => Some(Kind::Ack),
                };
                f.path = self.path.map(|p| p as usize);
                Rule::between(from, until, f, action)
            })
            .collect()
    }
}

/// Longest blackhole phase of a benign schedule (µs).
pub const MAX_BENIGN_BLACKHOLE_US: u32 = 20_000;

/// Impairments that never add up to an outage long enough to exhaust the retry budget:
/// loss up to 25 %, bursts up to 64 packets, blackholes up to 20 ms.
pub fn benign_act() -> impl Strategy<Value = ActSpec> {
    prop_oneof![
        4 => (1u8..=25).prop_map(ActSpec::Loss),
        2 => (1u16..=64).prop_map(ActSpec::Burst),
        2 => (1u8..=50).prop_map(ActSpec::Dup),
        3 => (1u8..=50, 10u16..=3000).prop_map(|(p, us)| ActSpec::Reorder(p, us)),
        2 => (1u8..=20, 1u16..=100).prop_map(|(p, ms)| ActSpec::Late(p, ms)),
        1 => (1u8..=50).prop_map(ActSpec::Ce),
        1 => Just(ActSpec::Blackhole),
    ]
}

pub fn phase() -> impl Strategy<Value = Phase> {
    (
        prop_oneof![2 => Just(0u32), 3 => 0u32..5_000, 1 => 0u32..50_000],
        prop_oneof![3 => 100u32..20_000, 1 => 20_000u32..200_000],
        prop_oneof![Just(DirSel::AtoB), Just(DirSel::BtoA), Just(DirSel::Both)],
        prop_oneof![
            2 => Just(KindSel::Any),
            1 => Just(KindSel::Data),
            1 => Just(KindSel::Ack)
        ],
        prop::option::weighted(0.3, 0u8..8),
        benign_act(),
    )
        .prop_map(|(start_us, len_us, dir, kind, path, act)| Phase {
            start_us,
            // Blackholes stay short: a benign schedule never exhausts the retry budget.
            len_us: if act == ActSpec::Blackhole {
                len_us.min(MAX_BENIGN_BLACKHOLE_US)
            } else {
                len_us
            },
            dir,
            kind,
            path,
            act,
        })
}

/// A long total outage (both directions, every path): `start_us` after the workload starts,
/// lasting `len_ms`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outage {
    pub start_us: u32,
    pub len_ms: u32,
}

impl Outage {
    pub fn rules(&self, t0: Duration) -> Vec<Rule> {
        let from = t0 + Duration::from_micros(self.start_us as u64);
        let until = from + Duration::from_millis(self.len_ms as u64);
        vec![Rule::between(from, until, Filter::any(), Action::Blackhole)]
    }
}

/// Transport parameters: mostly the harness defaults, sometimes small path MTUs, one or
/// two paths, no GSO, a tiny receive budget or stream window.
pub fn tuning() -> impl Strategy<Value = Tuning> {
    let pmtu = prop_oneof![3 => Just(1024u32), 1 => Just(256u32), 1 => Just(4096u32)];
    let paths = prop_oneof![3 => Just(8u16), 1 => Just(1u16), 1 => Just(2u16)];
    prop_oneof![
        2 => Just(Tuning::default()),
        1 => (
            [pmtu.clone(), pmtu],
            [paths.clone(), paths],
            prop_oneof![Just(1usize), Just(4usize)],
            prop_oneof![2 => Just(256u64 << 20), 1 => 1u64..=65_536],
            prop_oneof![2 => Just(1024u32), 1 => 1u32..=4],
        )
            .prop_map(|(pmtu, paths, gso, recv_buffer, stream_window)| Tuning {
                pmtu,
                paths,
                gso,
                recv_buffer,
                stream_window,
            }),
    ]
}

// =======================================================================================
// A whole run: configuration, impairment schedule, operations, checks

/// Everything a property run needs; shrinks field by field.
#[derive(Debug, Clone)]
pub struct Schedule {
    pub seed: u64,
    /// First PSN of every path on both sides (`None`: random).
    pub initial_psn: Option<u32>,
    /// Whether the impairment phases also apply to the handshake (times then count from
    /// the very start instead of from the end of the handshake).
    pub impair_handshake: bool,
    pub ops: Vec<OpSpec>,
    pub phases: Vec<Phase>,
    /// A long total outage (makes connection failure acceptable).
    pub outage: Option<Outage>,
    /// Close the connection from `side` just before operation `index` is posted (or after
    /// the last one).
    pub close: Option<(usize, usize)>,
    /// Transport parameters other than the harness defaults.
    pub tuning: Tuning,
    /// READ / atomic / posted-receive parameters.
    pub rdma: RdmaTuning,
    /// Streams of each receiving side that never get a receive (see `Workload::starved`).
    pub starved: [Vec<u32>; 2],
    /// Operations posted after `ops`, once the first SEND on every starved stream has
    /// failed (RnrRetryExceeded) and its receiver has put the stream in the error state;
    /// receives in them on starved streams are posted (`Workload::dead`) and must be
    /// flushed. Not combined with `close`.
    pub then: Vec<OpSpec>,
    /// Post `then` as soon as the senders saw the failures, without waiting for the
    /// receivers to learn of them (receives posted before the stream abort arrives).
    /// Only under impairments that never deliver a stale copy of a message (loss, not
    /// duplication, late copies or reordering): such a copy may find one of those
    /// receives and be delivered although its SEND failed.
    pub then_early: bool,
}

/// READ / atomic / posted-receive parameters a schedule may vary, per endpoint.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RdmaTuning {
    /// `require_posted_receives`: every stream to this endpoint consumes posted receives.
    pub posted: [bool; 2],
    /// `max_rd_atomic`.
    pub max_rd_atomic: [u32; 2],
    /// `min_rnr_timer`: the RNR timer code this endpoint puts in its RNR NAKs.
    pub min_rnr_timer: [u8; 2],
    /// `rnr_retry` (7 = forever).
    pub rnr_retry: [u8; 2],
}

impl Default for RdmaTuning {
    fn default() -> Self {
        RdmaTuning {
            posted: [false, false],
            max_rd_atomic: [16, 16],
            min_rnr_timer: [12, 12],
            rnr_retry: [7, 7],
        }
    }
}

impl RdmaTuning {
    pub fn apply(&self, i: usize, c: &mut EndpointConfig) {
        c.transport.require_posted_receives = self.posted[i];
        c.transport.max_rd_atomic = self.max_rd_atomic[i];
        c.transport.min_rnr_timer = self.min_rnr_timer[i];
        c.transport.rnr_retry = self.rnr_retry[i];
    }
}

/// Transport parameters a schedule may vary (per endpoint where it matters).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tuning {
    /// Path MTU of A and B.
    pub pmtu: [u32; 2],
    /// Paths of A and B (the connection uses the smaller).
    pub paths: [u16; 2],
    /// GSO batch size of both.
    pub gso: usize,
    /// Receive buffer budget of both, bytes.
    pub recv_buffer: u64,
    /// Stream window of both, messages.
    pub stream_window: u32,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            pmtu: [1024, 1024],
            paths: [8, 8],
            gso: 4,
            recv_buffer: 256 << 20,
            stream_window: 1024,
        }
    }
}

impl Tuning {
    pub fn apply(&self, i: usize, c: &mut EndpointConfig) {
        c.transport.pmtu = self.pmtu[i];
        c.transport.paths = self.paths[i];
        c.transport.max_gso_segments = self.gso;
        c.transport.max_recv_buffer_bytes = self.recv_buffer;
        c.transport.max_stream_window = self.stream_window;
    }
}

impl Schedule {
    pub fn new(seed: u64, ops: Vec<OpSpec>) -> Schedule {
        Schedule {
            seed,
            initial_psn: None,
            impair_handshake: false,
            ops,
            phases: Vec::new(),
            outage: None,
            close: None,
            tuning: Tuning::default(),
            rdma: RdmaTuning::default(),
            starved: [Vec::new(), Vec::new()],
            then: Vec::new(),
            then_early: false,
        }
    }
}

/// Run a schedule and every check. Returns the workload for further checks.
///
/// Debugging aids: `HARNESS_TRACE=1` prints every datagram as delivered (virtual time,
/// endpoint, source port, BTH and headers); `HARNESS_DUMP=1` prints the operations,
/// receives and events of a run whose checks failed.
pub fn run_schedule(s: &Schedule) -> Result<Workload, String> {
    let mut a = config(0, s.seed);
    let mut b = config(1, s.seed);
    a.initial_psn = s.initial_psn;
    b.initial_psn = s.initial_psn;
    s.tuning.apply(0, &mut a);
    s.tuning.apply(1, &mut b);
    s.rdma.apply(0, &mut a);
    s.rdma.apply(1, &mut b);
    let mut net = Net::with_configs(s.seed, a, b);
    // Gather send in half the cases: WRITEs of 1 KiB or more from `Regions::src` leave
    // their payload in the region until the net assembles the datagram.
    net.gather = s.seed % 2 == 1;
    if std::env::var_os("HARNESS_TRACE").is_some() {
        // Debugging aid: every datagram as delivered (after the impairments), one line.
        net.deliver_hook = Some(Box::new(|n: &mut Net, to, from: SocketAddr, d: &[u8]| {
            let t = n.elapsed();
            match Packet::parse(d) {
                Ok(p) => eprintln!(
                    "{t:>10.3?} to {to} from :{} {:?} psn {} ack_req {} {:?} payload {}",
                    from.port(),
                    p.bth.opcode,
                    p.bth.psn,
                    p.bth.ack_req,
                    p.headers,
                    p.payload.len()
                ),
                Err(e) => eprintln!("{t:>10.3?} to {to} from :{} unparsed: {e:?}", from.port()),
            }
        }));
    }
    if s.impair_handshake {
        for p in &s.phases {
            for r in p.rules(Duration::ZERO) {
                net.add_rule(r);
            }
        }
    }
    let mut w = Workload::start(net, Duration::from_secs(10))
        .ok_or_else(|| "handshake did not complete within 10 s".to_string())?;
    w.starved = s.starved.clone();
    let t0 = w.net.elapsed();
    if !s.impair_handshake {
        for p in &s.phases {
            for r in p.rules(t0) {
                w.net.add_rule(r);
            }
        }
    }
    if let Some(o) = &s.outage {
        for r in o.rules(t0) {
            w.net.add_rule(r);
        }
        w.allow_failure = true;
    }
    for (i, op) in s.ops.iter().enumerate() {
        if let Some((side, at)) = s.close {
            if at == i && w.closed_by.is_none() {
                close(&mut w, side);
            }
        }
        w.post_all(std::slice::from_ref(op), Duration::from_secs(5))?;
    }
    if let Some((side, _)) = s.close {
        if w.closed_by.is_none() {
            close(&mut w, side);
        }
    }
    if !s.then.is_empty() {
        if s.close.is_some() {
            return Err("a schedule with `then` operations cannot close".into());
        }
        wait_for_dead_streams(&mut w, !s.then_early)?;
        w.post_all(&s.then, Duration::from_secs(5))?;
    }
    let limit = w.net.elapsed()
        + if w.allow_failure {
            Duration::from_secs(120)
        } else {
            Duration::from_secs(30)
        };
    w.finish(limit, Duration::from_secs(5))?;
    if let Err(e) = w.check_all() {
        if std::env::var_os("HARNESS_DUMP").is_some() {
            dump(&w);
        }
        return Err(e);
    }
    Ok(w)
}

/// Run until the first SEND on every starved stream has completed at its sender and (if
/// `receiver`) the receiver has put all of them in the error state (its `dead_streams`
/// counter); then mark them dead in the model (receives on them are posted from now on).
pub fn wait_for_dead_streams(w: &mut Workload, receiver: bool) -> Result<(), String> {
    for rx in 0..2 {
        let tx = 1 - rx;
        let firsts: Vec<(u32, usize)> = w.starved[rx]
            .iter()
            .filter_map(|&st| w.sends_on(tx, st).first().map(|&(i, _)| (st, i)))
            .collect();
        if firsts.is_empty() {
            continue;
        }
        let conns = w.conns;
        // (Completions are not in posting order across streams: wait for these.)
        let wr_ids: Vec<u64> = firsts.iter().map(|f| w.posted[tx][f.1].wr_id).collect();
        let n = firsts.len() as u64;
        let limit = w.net.elapsed() + Duration::from_secs(10);
        let done = w.net.run_until(limit, |net| {
            let wcs = net.completions(tx, conns[tx]);
            wr_ids.iter().all(|id| wcs.iter().any(|wc| wc.wr_id == *id))
                && (!receiver
                    || net.eps[rx]
                        .connection_stats(conns[rx])
                        .is_some_and(|s| s.recv.dead_streams >= n))
        });
        if !done {
            return Err(format!(
                "side {rx}: starved streams {:?} not dead within 10 s",
                w.starved[rx]
            ));
        }
        w.dead[rx] = firsts.iter().map(|f| f.0).collect();
    }
    Ok(())
}

/// Close the workload's connection from `side` now.
pub fn close(w: &mut Workload, side: usize) {
    let now = w.net.now;
    w.net.eps[side].close(now, w.conns[side]);
    w.net.flush();
    w.closed_by = Some(side);
    // The peer may never hear of it (best effort): its pending operations then fail
    // with RetryExceeded.
    w.allow_failure = true;
}

/// Debug aid: print the events of a workload.
pub fn dump(w: &Workload) {
    for i in 0..2 {
        for (k, p) in w.posted[i].iter().enumerate() {
            eprintln!(
                "  [{i}] op {k}: wr {} at {:?} {:?}",
                p.wr_id, p.posted_at, p.spec.kind
            );
        }
        for r in &w.recvs[i] {
            eprintln!("  [{i}] {r:?}");
        }
        eprintln!("  [{i}] regions {:?}", w.regions[i]);
    }
    for i in 0..2 {
        for (e, t) in w.net.events[i].iter().zip(&w.net.event_times[i]) {
            eprintln!("  [{i}] {:>10.3?} {e:?}", *t - w.net.start);
        }
    }
}

/// Re-emit a captured packet with its BTH and headers edited, ICRC re-stamped for the
/// addresses of the harness (as if `from` sent it to `to`). The captured trailer (the
/// connection's token) is kept: this is an on-path forger, who has seen the token.
pub fn forge(
    c: &Captured,
    to: SocketAddr,
    edit: impl FnOnce(&mut metaroce::wire::Bth, &mut metaroce::wire::Headers),
) -> Vec<u8> {
    let p = Packet::parse(&c.data).expect("captured packet parses");
    let (mut bth, mut hdrs) = (p.bth, p.headers);
    edit(&mut bth, &mut hdrs);
    let t = p.trailer;
    let mut out = vec![0u8; metaroce::wire::packet_len_with(&hdrs, p.payload.len(), &t)];
    metaroce::wire::emit_packet_with(&bth, &hdrs, p.payload, &t, &mut out).unwrap();
    let ip = metaroce::wire::icrc::IpHeader::synthesized(c.from.ip(), to.ip()).unwrap();
    metaroce::wire::icrc::stamp(&ip, c.from.port(), to.port(), &mut out).unwrap();
    out
}
