//! Collectives on simulated hosts: ring all-reduce and all-to-all, moved with RDMA
//! WRITE_WITH_IMM, the way NCCL-style libraries move them over RDMA.
//!
//! * **Ring all-reduce** ([`Collective::RingAllReduce`]): reduce-scatter then all-gather
//!   over a ring of `N` ranks; the buffer of `S` bytes is cut into `N` chunks. In the
//!   reduce-scatter, the rank that receives chunk `k` (a WRITE_WITH_IMM into a staging
//!   region of the next rank, at chunk `k`'s offset; the immediate names the phase and `k`)
//!   adds it byte by byte (wrapping `u8` sum) into its own buffer and forwards the sum to
//!   the next rank; the rank whose sum is complete starts the all-gather of that chunk,
//!   which WRITEs it straight into the next ranks' buffers. Each step starts as soon as the
//!   data it depends on has landed (the immediate is delivered only after every WRITE
//!   posted before it on the connection has landed, docs/PROTOCOL.md).
//! * **All-to-all** ([`Collective::AllToAll`]): every rank WRITE_WITH_IMMs a distinct
//!   chunk of `c` bytes into every other rank's receive region (mixture-of-experts
//!   dispatch).
//!
//! [`run_collective`] connects the ranks, registers the regions, runs the collective on
//! the simulator until every rank has all its data (or a time limit passed), and checks the
//! result on every rank against a locally computed reference.
//!
//! ## Transports
//!
//! [`run_collective_with`] chooses how the data moves ([`Transport`]): MetaRoCE
//! connections, or standard RoCEv2 **RC queue pairs** ([`Transport::Rc`]), one QP per
//! connection, driven through the endpoints' RoCEv2 mode ([`crate::Endpoint::rc`],
//! [`crate::rocev2::RcWire::Native`]): go-back-N from the oldest unacknowledged PSN on a
//! sequence NAK or a local ACK timeout, `retry_cnt` retries and then the QP goes to the
//! error state (IBA §9.7.5.1, §10.3.1), DCQCN reacting to CE/CNP as the endpoint's
//! [`crate::rocev2::RcConfig::dcqcn`] says, and every packet from the QP's fixed UDP source
//! port (`rdma_get_udp_sport` of the two QPNs), so ECMP pins each QP to one route and the
//! host to one plane. A WRITE_WITH_IMM consumes a receive WR at the responder (IBA
//! §9.4.3); the run posts enough of them. A QP that goes to the error state fails the
//! collective: the run stops there and reports it ([`CollectiveRun::failed_at`]), as an
//! NCCL job would abort.

use super::{HostId, Sim};
use crate::rocev2::{ConnectAttrs, QpInit, RcEvent, RcOpcode, RcWire, RecvWr, SendOp, SendWr};
use crate::{Access, ConnectionHandle, Endpoint, Event, MrKeys, WcStatus, WriteRequest};
use std::cell::RefCell;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::rc::Rc;
use std::time::Duration;

/// Which collective to run and how big it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    /// Ring all-reduce of `bytes_per_rank` bytes per rank (rounded down to a multiple of
    /// the number of ranks).
    RingAllReduce {
        /// Buffer size of every rank, in bytes.
        bytes_per_rank: usize,
    },
    /// All-to-all: every rank sends `bytes_per_pair` bytes to every other rank.
    AllToAll {
        /// Bytes from one rank to one other rank.
        bytes_per_pair: usize,
    },
}

impl Collective {
    /// Bytes every rank sends in total for `ranks` ranks: `2 (N-1)/N · S` for the ring
    /// all-reduce, `(N-1) · c` for the all-to-all.
    pub fn bytes_sent_per_rank(&self, ranks: usize) -> u64 {
        let n = ranks as u64;
        match *self {
            Collective::RingAllReduce { bytes_per_rank } => {
                let chunk = (bytes_per_rank / ranks.max(1)) as u64;
                2 * (n - 1) * chunk
            }
            Collective::AllToAll { bytes_per_pair } => (n - 1) * bytes_per_pair as u64,
        }
    }
}

/// How a collective's data moves between ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    /// MetaRoCE connections, configured by the hosts' endpoint configuration (paths,
    /// planes, loss recovery).
    #[default]
    MetaRoce,
    /// One RoCEv2 RC QP per connection (see the module documentation).
    Rc(RcQpParams),
}

/// The RC QP attributes a [`Transport::Rc`] run connects with (`ibv_modify_qp` RTR/RTS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RcQpParams {
    /// Path MTU, bytes (256..=4096, a power of two).
    pub path_mtu: u32,
    /// Local ACK timeout exponent: 4.096 µs × 2^`timeout` (IBA §9.7.6.1.3); 1..=31.
    pub timeout: u8,
    /// Retries after a timeout or sequence NAK before the QP goes to the error state
    /// (0..=7).
    pub retry_cnt: u8,
}

impl RcQpParams {
    /// NCCL's defaults over RoCE (`NCCL_IB_TIMEOUT` 18, i.e. 4.096 µs × 2^18 ≈ 1.07 s;
    /// `NCCL_IB_RETRY_CNT` 7) with a 4096-byte path MTU: a QP whose path is blackholed
    /// fails after 8 timeouts, ≈ 8.6 s.
    pub fn nccl() -> Self {
        Self {
            path_mtu: 4096,
            timeout: 18,
            retry_cnt: 7,
        }
    }
}

impl Default for RcQpParams {
    fn default() -> Self {
        Self::nccl()
    }
}

/// One direction of a rank-to-rank connection.
#[derive(Debug, Clone, Copy)]
enum Wire {
    Conn(ConnectionHandle),
    /// A local RC QP number.
    Qp(u32),
}

/// Post `w` on `wire` of `ep`; whether it was accepted.
fn post(ep: &mut Endpoint, wire: Wire, w: WriteRequest) -> bool {
    match wire {
        Wire::Conn(c) => ep.post_write(c, w).is_ok(),
        Wire::Qp(q) => {
            let wr = SendWr {
                wr_id: w.wr_id,
                op: SendOp::Write {
                    remote_addr: w.remote_addr,
                    rkey: w.rkey,
                    imm: w.imm,
                },
                lkey: w.lkey,
                local_offset: w.local_offset,
                len: w.len,
                solicited: false,
            };
            ep.rc().post_send(q, wr).is_ok()
        }
    }
}

/// The outcome of [`run_collective`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CollectiveRun {
    /// Every rank received everything it waits for within the limit.
    pub completed: bool,
    /// Time from the first post until the last rank had all its data (RC: and the last
    /// send completion arrived); the limit if not completed.
    pub time: Duration,
    /// Every rank's result equals the reference (checked only if completed).
    pub data_ok: bool,
    /// Bytes of the results that differ from the reference.
    pub wrong_bytes: u64,
    /// WRITE_WITH_IMMs posted.
    pub writes: u64,
    /// Completions with a status other than success.
    pub errors: u64,
    /// Connections that ended during the run (RC: QPs that went to the error state).
    pub connections_lost: u64,
    /// RC: time from the first post until the first QP went to the error state, which
    /// ends the run; `None` if none did (always `None` for MetaRoCE).
    pub failed_at: Option<Duration>,
    /// RC: the status the first failed QP reported (`RetryExceeded` after `retry_cnt`
    /// timeouts on a blackholed path).
    pub qp_error: Option<WcStatus>,
    /// Data packets sent, over every connection of every rank (RC: request packets).
    pub packets_sent: u64,
    /// Data packets retransmitted (RC: request packets resent by go-back-N).
    pub retransmits: u64,
    /// Retransmission timeouts (RC: local ACK timeouts).
    pub rtos: u64,
}

/// The input of rank `r`: deterministic bytes ([`crate::testing::pattern`]).
fn input(r: usize, len: usize) -> Vec<u8> {
    crate::testing::pattern(r as u64 + 1, len)
}

const AG: u32 = 1 << 31;

struct Rank {
    host: HostId,
    /// Ring: the rank's buffer (input, accumulator, result); all-to-all: the send region.
    data: MrKeys,
    /// Ring: the reduce-scatter staging region; all-to-all: the receive region.
    recv: MrKeys,
    /// Connection to rank `j`, by rank (ring: only the next rank).
    conns: HashMap<usize, Wire>,
    received: usize,
    done: Option<Duration>,
}

struct State {
    ranks: Vec<Rank>,
    by_host: HashMap<HostId, usize>,
    chunk: usize,
    writes: u64,
    errors: u64,
    lost: u64,
    failed_at: Option<Duration>,
    qp_error: Option<WcStatus>,
    /// RC: successful send completions (a WRITE is done when its ACK came back).
    sends_done: u64,
    last_send_done: Option<Duration>,
    next_wr: u64,
}

impl State {
    fn write(&mut self, from: usize, local: u64, remote: MrKeys, off: u64) -> WriteRequest {
        self.writes += 1;
        self.next_wr += 1;
        WriteRequest {
            wr_id: self.next_wr,
            lkey: self.ranks[from].data.lkey,
            local_offset: local,
            len: self.chunk as u32,
            remote_addr: remote.addr + off,
            rkey: remote.rkey,
            imm: None,
        }
    }
}

/// Connect every `(a, b)` pair (a dials b) and wait until all are established; returns each
/// host's handle per peer address.
fn connect(
    sim: &mut Sim,
    pairs: &[(HostId, HostId)],
) -> Option<HashMap<HostId, HashMap<SocketAddr, ConnectionHandle>>> {
    let mut conns = Vec::new();
    for &(a, b) in pairs {
        conns.push((a, sim.connect_endpoints(a, b).ok()?));
    }
    let deadline = sim.elapsed() + Duration::from_millis(500);
    sim.run_while(|s| {
        s.elapsed() < deadline && conns.iter().any(|&(h, c)| !s.endpoint(h).is_established(c))
    });
    if conns
        .iter()
        .any(|&(h, c)| !sim.endpoint(h).is_established(c))
    {
        return None;
    }
    let mut map: HashMap<HostId, HashMap<SocketAddr, ConnectionHandle>> = HashMap::new();
    let hosts: Vec<HostId> = pairs.iter().flat_map(|&(a, b)| [a, b]).collect();
    for h in hosts {
        if map.contains_key(&h) {
            continue;
        }
        let ep = sim.endpoint(h);
        let m = ep
            .connections()
            .filter_map(|c| ep.peer_addr(c).map(|p| (p, c)))
            .collect();
        map.insert(h, m);
    }
    Some(map)
}

/// Create and connect one RC QP on each side of every `(a, b)` pair; returns each host's
/// QPN per peer host. `recvs[i]`: receive WRs to post on each QP of pair `i` (both ends).
fn connect_rc(
    sim: &mut Sim,
    pairs: &[(HostId, HostId)],
    recvs: usize,
    p: RcQpParams,
) -> Option<HashMap<HostId, HashMap<HostId, u32>>> {
    let mut map: HashMap<HostId, HashMap<HostId, u32>> = HashMap::new();
    let init = QpInit {
        access: Access::REMOTE_WRITE,
        ..QpInit::default()
    };
    // A zero-length MR for the receive WRs of WRITE_WITH_IMM (they take no data).
    let mut recv_lkey = HashMap::new();
    for &(a, b) in pairs {
        let qa = sim.endpoint_mut(a).rc().create_qp(init).ok()?;
        let qb = sim.endpoint_mut(b).rc().create_qp(init).ok()?;
        for (h, local, peer, remote) in [(a, qa, b, qb), (b, qb, a, qa)] {
            let ip = IpAddr::V4(sim.ip(peer));
            let mut attrs = ConnectAttrs::new(ip, remote.qpn, remote.psn);
            attrs.path_mtu = p.path_mtu;
            attrs.timeout = p.timeout;
            attrs.retry_cnt = p.retry_cnt;
            let lkey = *recv_lkey.entry(h).or_insert_with(|| {
                sim.endpoint_mut(h)
                    .register_mr(Vec::new(), Access::LOCAL_WRITE)
                    .lkey
            });
            let ep = sim.endpoint_mut(h);
            let mut rc = ep.rc();
            rc.connect_qp(local.qpn, attrs, RcWire::Native).ok()?;
            for i in 0..recvs {
                let wr = RecvWr {
                    wr_id: i as u64,
                    lkey,
                    offset: 0,
                    len: 0,
                };
                rc.post_recv(local.qpn, wr).ok()?;
            }
            map.entry(h).or_default().insert(peer, local.qpn);
        }
    }
    // Let the simulator take in the new state (routes are computed on the first run, as
    // the MetaRoCE handshake does), so that a link failed by `before_start` is one the
    // routes still use: a blackhole until routing converges.
    sim.run_for(Duration::ZERO);
    Some(map)
}

fn peer_addr(sim: &Sim, h: HostId) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(sim.ip(h)), sim.addr(h).port())
}

/// Run `coll` over `ranks` (rank `r` is host `ranks[r]`, ring order for the all-reduce) on
/// `sim`, for at most `limit` of simulated time after the connections are up.
/// `before_start` runs once the connections are established and the regions registered,
/// just before the first WRITE is posted (to fail a link, say). The hosts'
/// event handler ([`Sim::set_event_handler`]) is taken for the run and cleared afterwards.
///
/// Returns `None` if the connections could not be established within 500 ms. Memory: the
/// ring needs `2 S` bytes of regions per rank, the all-to-all `2 N c`.
///
/// # Panics
/// If fewer than two ranks are given or a rank's chunk is empty or above 4 GiB.
pub fn run_collective(
    sim: &mut Sim,
    ranks: &[HostId],
    coll: Collective,
    limit: Duration,
    before_start: impl FnOnce(&mut Sim),
) -> Option<CollectiveRun> {
    run_collective_with(sim, ranks, coll, Transport::MetaRoce, limit, before_start)
}

/// [`run_collective`] over the given [`Transport`]. With [`Transport::Rc`] the QPs are
/// connected at once (no handshake; the endpoints' [`crate::rocev2::RcConfig`], e.g. its
/// DCQCN line rate, applies; set it with [`Endpoint::set_rc_config`] before), and the run
/// ends early when a QP goes to the error state ([`CollectiveRun::failed_at`]).
///
/// Returns `None` if the MetaRoCE connections could not be established within 500 ms or
/// an RC QP could not be created or connected (`max_qps`, `max_recv_wr`).
///
/// # Panics
/// As [`run_collective`].
pub fn run_collective_with(
    sim: &mut Sim,
    ranks: &[HostId],
    coll: Collective,
    transport: Transport,
    limit: Duration,
    before_start: impl FnOnce(&mut Sim),
) -> Option<CollectiveRun> {
    let n = ranks.len();
    assert!(n >= 2, "a collective needs at least two ranks");
    let ring = matches!(coll, Collective::RingAllReduce { .. });
    let rc = matches!(transport, Transport::Rc(_));
    let chunk = match coll {
        Collective::RingAllReduce { bytes_per_rank } => bytes_per_rank / n,
        Collective::AllToAll { bytes_per_pair } => bytes_per_pair,
    };
    assert!(
        chunk > 0 && chunk <= u32::MAX as usize,
        "chunk of {chunk} bytes"
    );
    let pairs: Vec<(HostId, HostId)> = if ring {
        (0..n).map(|r| (ranks[r], ranks[(r + 1) % n])).collect()
    } else {
        (0..n)
            .flat_map(|i| (i + 1..n).map(move |j| (ranks[i], ranks[j])))
            .collect()
    };
    // What each host uses to reach each peer host.
    let wires: HashMap<HostId, HashMap<HostId, Wire>> = match transport {
        Transport::MetaRoce => {
            let map = connect(sim, &pairs)?;
            let mut w: HashMap<HostId, HashMap<HostId, Wire>> = HashMap::new();
            for &h in ranks {
                for &p in ranks {
                    if let Some(&c) = map.get(&h).and_then(|m| m.get(&peer_addr(sim, p))) {
                        w.entry(h).or_default().insert(p, Wire::Conn(c));
                    }
                }
            }
            w
        }
        Transport::Rc(p) => {
            // Ring: 2 (N-1) WRITE_WITH_IMMs arrive on each QP; all-to-all: one.
            let recvs = if ring { 2 * (n - 1) } else { 1 };
            connect_rc(sim, &pairs, recvs, p)?
                .into_iter()
                .map(|(h, m)| (h, m.into_iter().map(|(k, q)| (k, Wire::Qp(q))).collect()))
                .collect()
        }
    };
    let region = chunk * n;
    let mut st = State {
        ranks: Vec::with_capacity(n),
        by_host: HashMap::new(),
        chunk,
        writes: 0,
        errors: 0,
        lost: 0,
        failed_at: None,
        qp_error: None,
        sends_done: 0,
        last_send_done: None,
        next_wr: 0,
    };
    for (r, &h) in ranks.iter().enumerate() {
        let data = if ring {
            input(r, region)
        } else {
            (0..n).flat_map(|j| input(r * n + j, chunk)).collect()
        };
        let ep = sim.endpoint_mut(h);
        let data = ep.register_mr(data, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        let recv = ep.register_mr(vec![0; region], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        let peers: Vec<usize> = if ring {
            vec![(r + 1) % n]
        } else {
            (0..n).filter(|&j| j != r).collect()
        };
        let conns = peers
            .into_iter()
            .map(|j| (j, wires[&h][&ranks[j]]))
            .collect();
        st.ranks.push(Rank {
            host: h,
            data,
            recv,
            conns,
            received: 0,
            done: None,
        });
        st.by_host.insert(h, r);
    }
    before_start(sim);
    let t0 = sim.elapsed();
    // The first writes: ring rank r sends chunk r (reduce-scatter step 0); all-to-all rank
    // r sends to r+1, r+2, … (pairwise order).
    for r in 0..n {
        let targets: Vec<usize> = if ring {
            vec![(r + 1) % n]
        } else {
            (1..n).map(|d| (r + d) % n).collect()
        };
        for j in targets {
            let (local, off, imm) = if ring {
                ((r * chunk) as u64, (r * chunk) as u64, r as u32)
            } else {
                ((j * chunk) as u64, (r * chunk) as u64, r as u32)
            };
            let remote = st.ranks[j].recv;
            let mut w = st.write(r, local, remote, off);
            w.imm = Some(imm);
            let conn = st.ranks[r].conns[&j];
            if !post(sim.endpoint_mut(st.ranks[r].host), conn, w) {
                st.errors += 1;
            }
        }
    }
    let state = Rc::new(RefCell::new(st));
    let s2 = state.clone();
    sim.set_event_handler(move |ctx, ev| {
        let mut st = s2.borrow_mut();
        let Some(&r) = st.by_host.get(&ctx.host) else {
            return false;
        };
        let imm = match ev {
            Event::Completion { wc, .. } => {
                if wc.status != WcStatus::Success {
                    st.errors += 1;
                }
                return true;
            }
            Event::ConnectionLost { .. } => {
                st.lost += 1;
                return true;
            }
            Event::Rc(RcEvent::QpError { status, .. }) => {
                st.lost += 1;
                st.failed_at.get_or_insert(ctx.time);
                st.qp_error.get_or_insert(*status);
                return true;
            }
            Event::Rc(RcEvent::Completion(c)) => {
                if c.status != WcStatus::Success {
                    st.errors += 1;
                    return true;
                }
                match (c.opcode, c.imm) {
                    (RcOpcode::RecvRdmaWithImm, Some(imm)) => imm,
                    (RcOpcode::RdmaWrite, _) => {
                        st.sends_done += 1;
                        st.last_send_done = Some(ctx.time);
                        return true;
                    }
                    _ => return true,
                }
            }
            Event::WriteWithImm { imm, .. } => *imm,
            _ => return false,
        };
        let chunk = st.chunk;
        st.ranks[r].received += 1;
        if !ring {
            if st.ranks[r].received == n - 1 {
                st.ranks[r].done = Some(ctx.time);
            }
            return true;
        }
        let k = (imm & !AG) as usize % n;
        let off = (k * chunk) as u64;
        let next = (r + 1) % n;
        let conn = st.ranks[r].conns[&next];
        let post_to = if imm & AG == 0 {
            // Reduce-scatter: add the staged chunk into the buffer.
            let (dl, rl) = (st.ranks[r].data.lkey, st.ranks[r].recv.lkey);
            let (Ok(mut acc), Ok(inc)) = (
                ctx.endpoint.mr_read(dl, off, chunk as u64),
                ctx.endpoint.mr_read(rl, off, chunk as u64),
            ) else {
                st.errors += 1;
                return true;
            };
            for (a, b) in acc.iter_mut().zip(&inc) {
                *a = a.wrapping_add(*b);
            }
            if ctx.endpoint.mr_write(dl, off, &acc).is_err() {
                st.errors += 1;
            }
            if (r + 1) % n == k {
                // The sum of chunk k is complete here: start its all-gather.
                Some((st.ranks[next].data, k as u32 | AG))
            } else {
                Some((st.ranks[next].recv, k as u32))
            }
        } else {
            // All-gather: chunk k landed in the buffer; forward it unless the next
            // rank is the one that completed it.
            ((r + 2) % n != k).then_some((st.ranks[next].data, k as u32 | AG))
        };
        if st.ranks[r].received == 2 * (n - 1) {
            st.ranks[r].done = Some(ctx.time);
        }
        if let Some((remote, imm)) = post_to {
            let mut w = st.write(r, off, remote, off);
            w.imm = Some(imm);
            if !post(ctx.endpoint, conn, w) {
                st.errors += 1;
            }
        }
        true
    });
    let deadline = t0 + limit;
    let s3 = state.clone();
    sim.run_while(|s| {
        let st = s3.borrow();
        // RC also waits for every send completion: a QP whose ACKs are lost fails even
        // though its data landed, and a job waits for its sends to complete.
        let sends_pending = rc && st.sends_done < st.writes;
        s.elapsed() < deadline
            && st.failed_at.is_none()
            && (sends_pending || st.ranks.iter().any(|k| k.done.is_none()))
    });
    // Let the last ACKs and completions arrive (bounded).
    let settle = sim.elapsed() + Duration::from_millis(1);
    sim.run_while(|s| s.elapsed() < settle.min(deadline + Duration::from_millis(1)));
    sim.clear_event_handler();
    let st = state.borrow();
    let completed = st.ranks.iter().all(|k| k.done.is_some())
        && (!rc || (st.sends_done == st.writes && st.failed_at.is_none()));
    let end = st
        .ranks
        .iter()
        .filter_map(|k| k.done)
        .chain(st.last_send_done)
        .max()
        .unwrap_or(deadline);
    let mut run = CollectiveRun {
        completed,
        time: if completed { end - t0 } else { limit },
        writes: st.writes,
        errors: st.errors,
        connections_lost: st.lost,
        failed_at: st.failed_at.map(|t| t - t0),
        qp_error: st.qp_error,
        ..Default::default()
    };
    for k in &st.ranks {
        for &w in k.conns.values() {
            match w {
                Wire::Conn(c) => {
                    let Some(cs) = sim.endpoint(k.host).connection_stats(c) else {
                        continue;
                    };
                    for p in cs.paths {
                        run.packets_sent += p.stats.packets_sent;
                        run.retransmits += p.stats.retransmits;
                        run.rtos += p.stats.rtos;
                    }
                }
                Wire::Qp(q) => {
                    let Some(qs) = sim.endpoint_mut(k.host).rc().qp_stats(q) else {
                        continue;
                    };
                    run.packets_sent += qs.tx_requests;
                    run.retransmits += qs.retransmitted;
                    run.rtos += qs.timeouts;
                }
            }
        }
    }
    if completed {
        let mut wrong = 0u64;
        if ring {
            let mut want = vec![0u8; region];
            for r in 0..n {
                for (w, x) in want.iter_mut().zip(input(r, region)) {
                    *w = w.wrapping_add(x);
                }
            }
            for k in &st.ranks {
                let got = sim.endpoint(k.host).mr_read(k.data.lkey, 0, region as u64);
                let got = got.unwrap_or_default();
                wrong += got.iter().zip(&want).filter(|(a, b)| a != b).count() as u64;
                wrong += want.len().abs_diff(got.len()) as u64;
            }
        } else {
            for (j, k) in st.ranks.iter().enumerate() {
                let got = sim.endpoint(k.host).mr_read(k.recv.lkey, 0, region as u64);
                let got = got.unwrap_or_default();
                for i in (0..n).filter(|&i| i != j) {
                    let want = input(i * n + j, chunk);
                    let have = got.get(i * chunk..(i + 1) * chunk).unwrap_or(&[]);
                    wrong += have.iter().zip(&want).filter(|(a, b)| a != b).count() as u64;
                    wrong += want.len().abs_diff(have.len()) as u64;
                }
            }
        }
        run.wrong_bytes = wrong;
        run.data_ok = wrong == 0;
    }
    Some(run)
}
