//! `pair_impaired`: two endpoints run a schedule of SENDs (on several streams, both
//! directions) and WRITEs (into registered regions laid out as slots between canaries,
//! some of them deliberately faulty) over an in-memory network whose impairments change in
//! phases (loss, duplication, reordering, corruption, ECN CE marks, blackholes), in virtual
//! time, to a bound.
//!
//! Checked at the end: every posted operation completed exactly once, reported in posting
//! order per stream and among the one-sided operations (a SEND after every one-sided
//! operation posted before it), with its opcode and length; with no connection lost every good operation succeeded and
//! every faulty WRITE got `RemoteAccessError`; a connection was lost only if the schedule
//! had a long blackhole or very heavy loss; messages arrived exactly once, in order per
//! stream, with the right bytes (all of them when nothing was lost); a successful WRITE's
//! bytes equal the source, a failed one's bytes are source or canary; no byte outside a
//! good WRITE's slot changed; WRITE-with-immediate notifications came at most once each,
//! exactly once for successful ones, and never for faulty ones.

use crate::util;
use arbitrary::Arbitrary;
use bytes::Bytes;
use metaroce::testing::{self, Impair, ImpairPhase, Net};
use metaroce::{
    Access, AtomicOp, AtomicRequest, ConnectionHandle, Event, MrKeys, ReadRequest, WcOpcode,
    WcStatus, WriteRequest,
};
use std::collections::HashMap;
use std::time::{Duration, Instant};

const MAX_OPS: usize = 24;
const MAX_PHASES: usize = 8;
const MAX_LEN: usize = 8 * 1024;
const MAX_BAD_LEN: usize = 4096;
const SRC_LEN: usize = 32 * 1024;
const GAP: usize = 32;
const IMM_BASE: u32 = 0x1000_0000;
/// Virtual time allowed after the last phase and the last posting.
const SETTLE: Duration = Duration::from_secs(40);
const MAX_STEPS: u64 = 2_000_000;

/// The fuzz input.
#[derive(Arbitrary, Debug, Clone)]
pub struct Input {
    /// Seed of the endpoints and of the impairment draws.
    pub seed: u64,
    /// Configuration variations.
    pub cfg: PairCfg,
    /// Operations, posted one after the other with gaps.
    pub ops: Vec<OpSpec>,
    /// Impairment phases, one after the other from the end of the handshake; the network
    /// is clean after the last.
    pub phases: Vec<Phase>,
}

/// Configuration variations.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct PairCfg {
    /// Path MTU of each side: 256 << (x % 5).
    pub pmtu_sel: [u8; 2],
    /// Paths of each side: 1 + x % 8.
    pub paths: [u8; 2],
    /// GSO batch limit: 1 + x % 8.
    pub gso: u8,
    /// One-way delay: 10 µs × (1 + x).
    pub delay: u8,
    /// PSNs start just below 2^24.
    pub wrap: bool,
    /// Non-zero: small receive buffer (x × 4 KiB) and stream window (1 + x % 4).
    pub small_recv: u8,
    /// Transport variations of each side: bits 0-1 congestion controller (AIMD, Swift,
    /// DCQCN, AIMD); bit 2 receiver-driven fair share (1 Gbit/s); bit 3 no path re-roll;
    /// bit 4 re-roll after every timeout.
    pub knobs: [u8; 2],
}

/// An operation.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum OpSpec {
    /// SEND of `len % 8193` bytes on stream `stream % 4`.
    Send {
        from_b: bool,
        stream: u8,
        len: u16,
        gap: u8,
    },
    /// WRITE of `len % 8193` bytes into the peer's region, optionally with immediate.
    Write {
        from_b: bool,
        len: u16,
        imm: bool,
        gap: u8,
    },
    /// A WRITE the peer must refuse: wrong rkey, out of bounds, before the region, or into
    /// a region without REMOTE_WRITE.
    BadWrite {
        from_b: bool,
        kind: u8,
        len: u16,
        gap: u8,
    },
    /// READ of `len % 8193` bytes of the peer's source region at `offset`.
    Read {
        from_b: bool,
        len: u16,
        offset: u16,
        gap: u8,
    },
    /// FETCH_ADD of `1 + add % 2^20` on the peer's counter.
    FetchAdd { from_b: bool, add: u32, gap: u8 },
}

/// An impairment phase; rates are x/255 of the maximum in brackets.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct Phase {
    /// Length: x × 10 ms.
    pub dur: u8,
    /// Loss rate [0.5].
    pub loss: u8,
    /// Duplication rate [0.3].
    pub dup: u8,
    /// Reordering rate [0.5]: extra delay of 1..8 one-way delays.
    pub reorder: u8,
    /// CE-marking rate of ECN-capable packets [0.5].
    pub ce: u8,
    /// Corruption rate [0.3]: bytes flipped or the datagram truncated, ICRC not fixed.
    pub corrupt: u8,
    /// Blackhole (drop everything) when ≥ 0xE0.
    pub blackhole: u8,
}

impl Phase {
    fn duration(&self) -> Duration {
        Duration::from_millis(u64::from(self.dur) * 10)
    }

    /// The phase as `metaroce::testing` simple impairments (reordering by 1..=8 one-way
    /// delays, corruption that flips bytes or truncates).
    fn imp(&self) -> Impair {
        let f = |x: u8, max: f64| f64::from(x) / 255.0 * max;
        Impair {
            loss: f(self.loss, 0.5),
            dup: f(self.dup, 0.3),
            reorder: f(self.reorder, 0.5),
            reorder_slots: 8,
            ce: f(self.ce, 0.5),
            corrupt: f(self.corrupt, 0.3),
            blackhole: self.blackhole >= 0xE0,
            ..Impair::default()
        }
    }

    /// Whether this phase may legitimately kill a connection.
    fn hostile(&self) -> bool {
        let i = self.imp();
        self.duration() >= Duration::from_millis(100) && (i.blackhole || i.loss >= 0.35)
    }
}

/// A planned operation and what became of it.
#[derive(Debug, Clone)]
struct Planned {
    side: usize,
    at: Instant,
    kind: Kind,
    posted: bool,
}

#[derive(Debug, Clone)]
enum Kind {
    Send {
        stream: u32,
        data: Bytes,
    },
    /// `slot`: offset in the receiver's destination region.
    Write {
        local_offset: usize,
        len: usize,
        slot: usize,
        imm: Option<u32>,
    },
    Bad {
        kind: u8,
        len: usize,
        slot: Option<usize>,
        imm: u32,
    },
    /// `slot`: offset in the requester's own destination region.
    Read {
        remote_offset: usize,
        len: usize,
        slot: usize,
    },
    FetchAdd {
        add: u64,
        slot: usize,
    },
}

impl Kind {
    fn opcode(&self) -> WcOpcode {
        match self {
            Kind::Send { .. } => WcOpcode::Send,
            Kind::Write { imm: None, .. } => WcOpcode::RdmaWrite,
            Kind::Write { imm: Some(_), .. } | Kind::Bad { .. } => WcOpcode::RdmaWriteWithImm,
            Kind::Read { .. } => WcOpcode::RdmaRead,
            Kind::FetchAdd { .. } => WcOpcode::FetchAdd,
        }
    }

    fn len(&self) -> usize {
        match self {
            Kind::Send { data, .. } => data.len(),
            Kind::Write { len, .. } | Kind::Bad { len, .. } | Kind::Read { len, .. } => *len,
            Kind::FetchAdd { .. } => 8,
        }
    }
}

/// What the target keeps of one side; its endpoint and events live in the [`Net`].
struct Side {
    conn: ConnectionHandle,
    src: MrKeys,
    src_data: Vec<u8>,
    dst: MrKeys,
    canary: Vec<u8>,
    ro: MrKeys,
    ro_canary: Vec<u8>,
    counter: MrKeys,
    counter_init: u64,
}

struct Sim {
    net: Net,
    sides: [Side; 2],
}

fn endpoint_config(i: usize, seed: u64, cfg: &PairCfg) -> metaroce::EndpointConfig {
    let mut c = testing::config(i, seed);
    // The target checks transport properties under impairment: that the work completes
    // and no connection is lost unless a phase was hostile. The idle timeout (10 s, on by
    // default since issue #10) would end connections during long lossy phases whose
    // keepalives are all lost, which is liveness working, not a transport bug; liveness
    // has its own tests (metaroce/tests/liveness.rs, metaroce-tokio/tests/liveness.rs).
    c.transport.keepalive_interval = None;
    c.transport.idle_timeout = None;
    c.transport.pmtu = 256 << (cfg.pmtu_sel[i] % 5);
    c.transport.paths = 1 + u16::from(cfg.paths[i] % 8);
    c.transport.max_gso_segments = 1 + usize::from(cfg.gso % 8);
    if cfg.wrap {
        c.initial_psn = Some(0xFF_FFF0 + i as u32);
    }
    let k = cfg.knobs[i];
    c.transport.congestion.algorithm = match k & 3 {
        1 => metaroce::CongestionAlgorithm::swift_default(),
        2 => metaroce::CongestionAlgorithm::dcqcn_default(),
        _ => metaroce::CongestionAlgorithm::Aimd,
    };
    if k & 4 != 0 {
        c.transport.recv_capacity_mbps = 1000;
    }
    if k & 8 != 0 {
        c.transport.path_reroll_timeouts = 0;
    } else if k & 16 != 0 {
        c.transport.path_reroll_timeouts = 1;
    }
    if cfg.small_recv != 0 {
        c.transport.max_recv_buffer_bytes = u64::from(cfg.small_recv) * 4096;
        c.transport.max_stream_window = 1 + u32::from(cfg.small_recv % 4);
    }
    c
}

/// Lay out the operations: which side posts, when, and where WRITEs land.
fn plan(input: &Input, t0: Instant) -> (Vec<Planned>, [usize; 2]) {
    let mut at = t0;
    let mut cursor = [GAP, GAP];
    let mut out = Vec::new();
    for (k, op) in input.ops.iter().take(MAX_OPS).enumerate() {
        let (side, gap) = match *op {
            OpSpec::Send { from_b, gap, .. }
            | OpSpec::Write { from_b, gap, .. }
            | OpSpec::BadWrite { from_b, gap, .. }
            | OpSpec::Read { from_b, gap, .. }
            | OpSpec::FetchAdd { from_b, gap, .. } => (usize::from(from_b), gap),
        };
        at += Duration::from_micros(u64::from(gap) * 100);
        let recv = 1 - side;
        let kind = match *op {
            OpSpec::Send { stream, len, .. } => Kind::Send {
                stream: u32::from(stream % 4),
                data: Bytes::from(util::pattern(
                    input.seed ^ (k as u64) << 40,
                    usize::from(len) % (MAX_LEN + 1),
                )),
            },
            OpSpec::Write { len, imm, .. } => {
                let len = usize::from(len) % (MAX_LEN + 1);
                let slot = cursor[recv];
                cursor[recv] += len + GAP;
                Kind::Write {
                    local_offset: (k * 1237) % (SRC_LEN - len + 1),
                    len,
                    slot,
                    imm: imm.then_some(IMM_BASE + k as u32),
                }
            }
            OpSpec::BadWrite { kind, len, .. } => {
                let kind = kind % 4;
                // At least 2 bytes, so that "out of bounds" is out of bounds.
                let len = 2 + usize::from(len) % (MAX_BAD_LEN - 1);
                let slot = (kind == 0).then(|| {
                    let s = cursor[recv];
                    cursor[recv] += len + GAP;
                    s
                });
                Kind::Bad {
                    kind,
                    len,
                    slot,
                    imm: IMM_BASE + k as u32,
                }
            }
            OpSpec::Read { len, offset, .. } => {
                let len = usize::from(len) % (MAX_LEN + 1);
                let slot = cursor[side];
                cursor[side] += len + GAP;
                Kind::Read {
                    remote_offset: usize::from(offset) % (SRC_LEN - len + 1),
                    len,
                    slot,
                }
            }
            OpSpec::FetchAdd { add, .. } => {
                let slot = cursor[side];
                cursor[side] += 8 + GAP;
                Kind::FetchAdd {
                    add: 1 + u64::from(add % (1 << 20)),
                    slot,
                }
            }
        };
        out.push(Planned {
            side,
            at,
            kind,
            posted: false,
        });
    }
    (out, cursor)
}

/// Post planned operation `k` (its wr_id is `k`).
fn post(sim: &mut Sim, k: usize, p: &mut Planned) {
    let other = 1 - p.side;
    let (dst, ro) = (sim.sides[other].dst, sim.sides[other].ro);
    let (rsrc, counter) = (sim.sides[other].src, sim.sides[other].counter);
    let s = &sim.sides[p.side];
    let ep = &mut sim.net.eps[p.side];
    let wr_id = k as u64;
    let res = match &p.kind {
        Kind::Send { stream, data } => ep.post_send(s.conn, *stream, wr_id, data.clone()),
        Kind::Write {
            local_offset,
            len,
            slot,
            imm,
        } => ep.post_write(
            s.conn,
            WriteRequest {
                wr_id,
                lkey: s.src.lkey,
                local_offset: *local_offset as u64,
                len: *len as u32,
                remote_addr: dst.addr + *slot as u64,
                rkey: dst.rkey,
                imm: *imm,
            },
        ),
        Kind::Bad {
            kind,
            len,
            slot,
            imm,
        } => {
            let (addr, rkey) = match kind {
                0 => (dst.addr + slot.unwrap_or(0) as u64, dst.rkey ^ 0x100),
                1 => (dst.addr + dst.len - 1, dst.rkey),
                2 => (dst.addr - 1, dst.rkey),
                _ => (ro.addr, ro.rkey),
            };
            ep.post_write(
                s.conn,
                WriteRequest {
                    wr_id,
                    lkey: s.src.lkey,
                    local_offset: 0,
                    len: *len as u32,
                    remote_addr: addr,
                    rkey,
                    imm: Some(*imm),
                },
            )
        }
        Kind::Read {
            remote_offset,
            len,
            slot,
        } => ep.post_read(
            s.conn,
            ReadRequest {
                wr_id,
                lkey: s.dst.lkey,
                local_offset: *slot as u64,
                len: *len as u32,
                remote_addr: rsrc.addr + *remote_offset as u64,
                rkey: rsrc.rkey,
            },
        ),
        Kind::FetchAdd { add, slot } => ep.post_atomic(
            s.conn,
            AtomicRequest {
                wr_id,
                lkey: s.dst.lkey,
                local_offset: *slot as u64,
                remote_addr: counter.addr,
                rkey: counter.rkey,
                op: AtomicOp::FetchAdd { add: *add },
            },
        ),
    };
    p.posted = res.is_ok();
}

/// The target.
pub fn run(input: &Input) {
    let seed = input.seed;
    let mut net = Net::impaired_with_configs(
        seed,
        Impair::default(),
        endpoint_config(0, seed, &input.cfg),
        endpoint_config(1, seed, &input.cfg),
    );
    net.delay = Duration::from_micros(10 * (1 + u64::from(input.cfg.delay)));
    net.check_emitted = true;
    net.check_timers = true;
    let mut max_bad = 0usize;
    for op in input.ops.iter().take(MAX_OPS) {
        if let OpSpec::BadWrite { len, .. } = op {
            max_bad = max_bad.max(2 + usize::from(*len) % (MAX_BAD_LEN - 1));
        }
    }
    let sides = [0, 1].map(|i| {
        let ep = &mut net.eps[i];
        let src_data = util::pattern(seed ^ 0x5EED ^ i as u64, SRC_LEN);
        let src = ep.register_mr(src_data.clone(), Access::LOCAL_WRITE | Access::REMOTE_READ);
        let ro_canary = util::pattern(0xCA9A ^ i as u64, max_bad + GAP);
        let ro = ep.register_mr(ro_canary.clone(), Access::LOCAL_WRITE | Access::REMOTE_READ);
        let counter_init = seed.rotate_left(i as u32 * 7) & 0xFFFF_FFFF;
        let counter = ep.register_mr(
            counter_init.to_le_bytes().to_vec(),
            Access::LOCAL_WRITE | Access::REMOTE_ATOMIC,
        );
        Side {
            conn: ConnectionHandle(0),
            src,
            src_data,
            dst: src, // replaced once the layout is known
            canary: Vec::new(),
            ro,
            ro_canary,
            counter,
            counter_init,
        }
    });
    let mut sim = Sim { net, sides };

    // Clean handshake (no phase yet); clears the event logs.
    let (c, server) = sim.net.connect();
    sim.sides[0].conn = c;
    sim.sides[1].conn = server;

    // Layout and schedule.
    let t0 = sim.net.now;
    let (mut planned, sizes) = plan(input, t0);
    // The destination region of side r is laid out by `plan` (sizes[r] bytes of slots and
    // gaps) and starts as canary bytes.
    for (r, s) in sim.sides.iter_mut().enumerate() {
        let canary = util::pattern(0xC0FFEE ^ r as u64, sizes[r] + GAP);
        s.dst =
            sim.net.eps[r].register_mr(canary.clone(), Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        s.canary = canary;
    }
    let mut t = t0;
    let mut hostile = false;
    for p in input.phases.iter().take(MAX_PHASES) {
        let end = t + p.duration();
        let start = sim.net.start;
        sim.net.phases.push(ImpairPhase {
            from: t - start,
            until: end - start,
            impair: p.imp(),
        });
        hostile |= p.hostile();
        t = end;
    }
    let last_post = planned.last().map_or(t0, |p| p.at);
    let limit = t.max(last_post) + SETTLE;

    // Run: post each operation when due, let the network run to the next posting.
    let mut next_op = 0;
    let mut wr_ids: [Vec<usize>; 2] = [Vec::new(), Vec::new()];
    let mut timed_out = false;
    loop {
        while next_op < planned.len() && planned[next_op].at <= sim.net.now {
            let mut p = planned[next_op].clone();
            post(&mut sim, next_op, &mut p);
            if p.posted {
                wr_ids[p.side].push(next_op);
            }
            planned[next_op] = p;
            next_op += 1;
        }
        sim.net.flush();
        let next = [sim.net.next_event(), planned.get(next_op).map(|p| p.at)]
            .into_iter()
            .flatten()
            .min();
        let Some(next) = next else { break };
        if next > limit {
            timed_out = true;
            break;
        }
        sim.net.advance_to(next);
        assert!(
            sim.net.steps < MAX_STEPS,
            "run did not finish in {MAX_STEPS} steps"
        );
    }
    sim.net.flush();
    if util::trace() {
        let lost: Vec<_> = sim
            .net
            .events
            .iter()
            .map(|ev| ev.iter().any(|e| matches!(e, Event::ConnectionLost { .. })))
            .collect();
        eprintln!(
            "pair_impaired: {} ops ({} posted), {} phases (hostile {hostile}), {} steps, {:?} virtual, lost {lost:?}, events {:?}",
            planned.len(),
            planned.iter().filter(|p| p.posted).count(),
            sim.net.phases.len(),
            sim.net.steps,
            sim.net.now - t0,
            [sim.net.events[0].len(), sim.net.events[1].len()],
        );
    }

    check(&sim, &planned, &wr_ids, hostile, timed_out);
}

fn check(sim: &Sim, planned: &[Planned], wr_ids: &[Vec<usize>; 2], hostile: bool, timed_out: bool) {
    let events = &sim.net.events;
    let lost: Vec<bool> = events
        .iter()
        .map(|ev| ev.iter().any(|e| matches!(e, Event::ConnectionLost { .. })))
        .collect();
    let any_lost = lost.iter().any(|&l| l);
    assert!(
        !any_lost || hostile,
        "a connection was lost although no phase was hostile: {:?}",
        events
            .iter()
            .map(|ev| ev
                .iter()
                .find(|e| matches!(e, Event::ConnectionLost { .. })))
            .collect::<Vec<_>>()
    );

    // Known bug "rd-atomic-hang" (fuzz/README.md): after the peer's connection is gone, a
    // READ or atomic whose request was acknowledged waits for its response forever, and
    // every later operation of that side waits behind it. Tolerated only on request.
    let mut hung = [false; 2];
    if any_lost && util::tolerate("rd-atomic-hang") {
        for side in 0..2 {
            let done = sim.net.completions(side, sim.sides[side].conn).len();
            if let Some(&k) = wr_ids[side].get(done) {
                hung[side] = matches!(planned[k].kind, Kind::Read { .. } | Kind::FetchAdd { .. });
            }
        }
    }

    // Completions: exactly once each, reported in posting order per stream and among the
    // one-sided operations (a SEND after every one-sided operation posted before it);
    // sorted into posting order below, right opcode and length. (The operations completed
    // are a prefix of the posting order: a hung READ or atomic holds back the one-sided
    // operations after it, and the SENDs after it wait for it.)
    let mut status: HashMap<usize, WcStatus> = HashMap::new();
    let sorted = |side: usize| {
        let mut w = sim.net.completions(side, sim.sides[side].conn);
        w.sort_by_key(|wc| wc.wr_id);
        w
    };
    for side in 0..2 {
        let raw = sim.net.completions(side, sim.sides[side].conn);
        let posted: Vec<(u64, Option<u32>)> = wr_ids[side]
            .iter()
            .map(|&k| match &planned[k].kind {
                Kind::Send { stream, .. } => (k as u64, Some(*stream)),
                _ => (k as u64, None),
            })
            .collect();
        let reported: Vec<u64> = raw.iter().map(|wc| wc.wr_id).collect();
        if let Err(e) = testing::check_completion_order(&posted, &reported) {
            panic!("side {side}: {e}");
        }
        let wcs = sorted(side);
        let all_posted = &wr_ids[side];
        let posted = if hung[side] {
            &all_posted[..wcs.len().min(all_posted.len())]
        } else {
            &all_posted[..]
        };
        assert!(
            !timed_out || wcs.len() == posted.len(),
            "side {side}: {} of {} operations completed within the time limit",
            wcs.len(),
            posted.len()
        );
        assert_eq!(
            wcs.len(),
            posted.len(),
            "side {side}: completions {wcs:?} for {} posted operations",
            posted.len()
        );
        for (wc, &k) in wcs.iter().zip(posted) {
            let p = &planned[k];
            assert_eq!(
                wc.wr_id, k as u64,
                "side {side}: completion {wc:?} twice, or of an operation not posted"
            );
            assert_eq!(
                wc.opcode,
                p.kind.opcode(),
                "side {side} op {k}: opcode {wc:?}"
            );
            assert_eq!(
                wc.byte_len as usize,
                p.kind.len(),
                "side {side} op {k}: length {wc:?}"
            );
            status.insert(k, wc.status);
        }
    }
    // Sorted into posting order, the sequence of (opcode, length) pairs matches the posting
    // sequence exactly.

    for side in 0..2 {
        let got: Vec<(WcOpcode, u32)> = sorted(side)
            .iter()
            .map(|w| (w.opcode, w.byte_len))
            .collect();
        let n = if hung[side] {
            got.len().min(wr_ids[side].len())
        } else {
            wr_ids[side].len()
        };
        let want: Vec<(WcOpcode, u32)> = wr_ids[side][..n]
            .iter()
            .map(|&k| (planned[k].kind.opcode(), planned[k].kind.len() as u32))
            .collect();
        assert_eq!(got, want, "side {side}: completions not in posting order");
    }
    for (k, p) in planned.iter().enumerate() {
        let Some(&st) = status.get(&k) else { continue };
        let bad = matches!(p.kind, Kind::Bad { .. });
        let ok = match (any_lost, bad) {
            (false, false) => st == WcStatus::Success,
            (false, true) => st == WcStatus::RemoteAccessError,
            (true, false) => matches!(
                st,
                WcStatus::Success | WcStatus::RetryExceeded | WcStatus::WrFlushError
            ),
            (true, true) => matches!(
                st,
                WcStatus::RemoteAccessError | WcStatus::RetryExceeded | WcStatus::WrFlushError
            ),
        };
        assert!(
            ok,
            "op {k} ({:?}) completed with {st:?} (connection lost: {any_lost})",
            p.kind
        );
    }

    // Messages: per receiving side and stream, a prefix of what was posted (all of it when
    // nothing was lost), exactly once, in order, byte for byte.
    for (recv, recv_events) in events.iter().enumerate().take(2) {
        let mut want: HashMap<u32, Vec<&Bytes>> = HashMap::new();
        for p in planned.iter().filter(|p| p.posted && p.side == 1 - recv) {
            if let Kind::Send { stream, data } = &p.kind {
                want.entry(*stream).or_default().push(data);
            }
        }
        let mut got: HashMap<u32, Vec<&Bytes>> = HashMap::new();
        for e in recv_events {
            if let Event::Message { stream, data, .. } = e {
                got.entry(*stream).or_default().push(data);
            }
        }
        for (stream, g) in &got {
            let w = want.get(stream).map_or(&[][..], Vec::as_slice);
            assert!(
                g.len() <= w.len(),
                "side {recv} stream {stream}: {} messages delivered, {} sent",
                g.len(),
                w.len()
            );
            for (i, (a, b)) in g.iter().zip(w).enumerate() {
                assert!(
                    a[..] == b[..],
                    "side {recv} stream {stream}: message {i} differs ({} vs {} bytes)",
                    a.len(),
                    b.len()
                );
            }
        }
        if !any_lost {
            for (stream, w) in &want {
                let n = got.get(stream).map_or(0, Vec::len);
                assert_eq!(n, w.len(), "side {recv} stream {stream}: messages missing");
            }
        }
    }

    // WRITEs: memory, canaries and immediates.
    for (recv, recv_events) in events.iter().enumerate().take(2) {
        let s = &sim.sides[recv];
        let ep = &sim.net.eps[recv];
        let mem = ep
            .mr_read(s.dst.lkey, 0, s.dst.len)
            .expect("destination region readable");
        let mut covered = vec![false; mem.len()];
        let mut imms: HashMap<u32, Vec<u32>> = HashMap::new();
        for e in recv_events {
            if let Event::WriteWithImm { imm, byte_len, .. } = e {
                imms.entry(*imm).or_default().push(*byte_len);
            }
        }
        let sender = &sim.sides[1 - recv];
        let mut origs = Vec::new();
        for (k, p) in planned.iter().enumerate() {
            // READ and FETCH_ADD results land at the requester.
            match &p.kind {
                Kind::Read {
                    remote_offset,
                    len,
                    slot,
                } if p.side == recv => {
                    let src = &sender.src_data[*remote_offset..remote_offset + len];
                    let got = &mem[*slot..slot + len];
                    let can = &s.canary[*slot..slot + len];
                    if p.posted {
                        for c in &mut covered[*slot..slot + len] {
                            *c = true;
                        }
                    }
                    if status.get(&k) == Some(&WcStatus::Success) {
                        assert!(
                            got == src,
                            "side {recv}: successful READ op {k} landed wrong bytes"
                        );
                    } else {
                        for (i, ((&g, &x), &c)) in got.iter().zip(src).zip(can).enumerate() {
                            assert!(
                                g == x || g == c,
                                "side {recv}: failed READ op {k} byte {i} is neither source nor canary"
                            );
                        }
                    }
                    continue;
                }
                Kind::FetchAdd { slot, .. } if p.side == recv => {
                    if p.posted {
                        for c in &mut covered[*slot..slot + 8] {
                            *c = true;
                        }
                    }
                    if status.get(&k) == Some(&WcStatus::Success) {
                        let mut b = [0u8; 8];
                        b.copy_from_slice(&mem[*slot..slot + 8]);
                        origs.push((k, u64::from_le_bytes(b)));
                    }
                    continue;
                }
                _ => {}
            }
            if p.side != 1 - recv {
                continue;
            }
            match &p.kind {
                Kind::Write {
                    local_offset,
                    len,
                    slot,
                    imm,
                } => {
                    let src = &sender.src_data[*local_offset..local_offset + len];
                    let got = &mem[*slot..slot + len];
                    let can = &s.canary[*slot..slot + len];
                    let st = status.get(&k).copied();
                    if p.posted {
                        for c in &mut covered[*slot..slot + len] {
                            *c = true;
                        }
                    }
                    if st == Some(WcStatus::Success) {
                        assert!(
                            got == src,
                            "side {recv}: successful WRITE op {k} landed wrong bytes"
                        );
                    } else {
                        for (i, ((&g, &x), &c)) in got.iter().zip(src).zip(can).enumerate() {
                            assert!(
                                g == x || g == c,
                                "side {recv}: failed WRITE op {k} byte {i} is neither source nor canary"
                            );
                        }
                    }
                    if let Some(imm) = imm {
                        let n = imms.remove(imm).unwrap_or_default();
                        assert!(
                            n.len() <= 1,
                            "side {recv}: WRITE op {k} immediate reported {} times",
                            n.len()
                        );
                        if st == Some(WcStatus::Success) {
                            assert_eq!(n, vec![*len as u32], "side {recv}: WRITE op {k} immediate");
                        }
                        if !n.is_empty() {
                            assert_eq!(n[0] as usize, *len);
                            assert!(
                                got == src,
                                "immediate reported before WRITE op {k} fully landed"
                            );
                        }
                    }
                }
                Kind::Bad { imm, .. } => {
                    assert!(
                        !imms.contains_key(imm),
                        "side {recv}: refused WRITE op {k} reported an immediate"
                    );
                }
                Kind::Send { .. } | Kind::Read { .. } | Kind::FetchAdd { .. } => {}
            }
        }
        // FETCH_ADD: executed exactly once each at the peer's counter.
        let peer = &sim.sides[1 - recv];
        let raw = sim.net.eps[1 - recv]
            .mr_read(peer.counter.lkey, 0, 8)
            .expect("counter readable");
        let mut b = [0u8; 8];
        b.copy_from_slice(&raw);
        let fin = u64::from_le_bytes(b);
        let adds = |only_success: bool| -> u64 {
            planned
                .iter()
                .enumerate()
                .filter(|(k, p)| {
                    p.side == recv
                        && p.posted
                        && (!only_success || status.get(k) == Some(&WcStatus::Success))
                })
                .filter_map(|(_, p)| match p.kind {
                    Kind::FetchAdd { add, .. } => Some(add),
                    _ => None,
                })
                .sum()
        };
        let init = peer.counter_init;
        if !any_lost {
            assert_eq!(
                fin,
                init + adds(false),
                "side {recv}: FETCH_ADDs not executed exactly once"
            );
        } else {
            assert!(
                fin >= init + adds(true) && fin <= init + adds(false),
                "side {recv}: counter {fin} outside [{}, {}]",
                init + adds(true),
                init + adds(false)
            );
        }
        let mut seen = std::collections::HashSet::new();
        for (k, o) in origs {
            assert!(
                o >= init && o < fin,
                "side {recv}: FETCH_ADD op {k} returned {o}, outside [{init}, {fin})"
            );
            assert!(
                seen.insert(o),
                "side {recv}: FETCH_ADD op {k} returned a value twice ({o})"
            );
        }
        assert!(
            imms.is_empty(),
            "side {recv}: unexpected immediates {imms:?}"
        );
        for (i, ((&m, &c), &cov)) in mem.iter().zip(&s.canary).zip(&covered).enumerate() {
            assert!(
                cov || m == c,
                "side {recv}: byte {i} of the destination region outside every WRITE changed"
            );
        }
        let ro = ep
            .mr_read(s.ro.lkey, 0, s.ro.len)
            .expect("read-only region readable");
        assert!(
            ro == s.ro_canary[..],
            "side {recv}: region without REMOTE_WRITE was written"
        );
        // Sources are never modified.
        let src = ep
            .mr_read(s.src.lkey, 0, s.src.len)
            .expect("source readable");
        assert!(src == s.src_data[..], "side {recv}: source region modified");
    }
}
