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

use super::{HostId, Sim};
use crate::{Access, ConnectionHandle, Event, MrKeys, WcStatus, WriteRequest};
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

/// The outcome of [`run_collective`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CollectiveRun {
    /// Every rank received everything it waits for within the limit.
    pub completed: bool,
    /// Time from the first post until the last rank had all its data (the limit if not
    /// completed).
    pub time: Duration,
    /// Every rank's result equals the reference (checked only if completed).
    pub data_ok: bool,
    /// Bytes of the results that differ from the reference.
    pub wrong_bytes: u64,
    /// WRITE_WITH_IMMs posted.
    pub writes: u64,
    /// Completions with a status other than success.
    pub errors: u64,
    /// Connections that ended during the run.
    pub connections_lost: u64,
    /// Data packets sent, over every connection of every rank.
    pub packets_sent: u64,
    /// Data packets retransmitted.
    pub retransmits: u64,
    /// Retransmission timeouts.
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
    conns: HashMap<usize, ConnectionHandle>,
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
    let n = ranks.len();
    assert!(n >= 2, "a collective needs at least two ranks");
    let ring = matches!(coll, Collective::RingAllReduce { .. });
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
    let map = connect(sim, &pairs)?;
    let region = chunk * n;
    let mut st = State {
        ranks: Vec::with_capacity(n),
        by_host: HashMap::new(),
        chunk,
        writes: 0,
        errors: 0,
        lost: 0,
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
            .map(|j| (j, map[&h][&peer_addr(sim, ranks[j])]))
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
            if sim
                .endpoint_mut(st.ranks[r].host)
                .post_write(conn, w)
                .is_err()
            {
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
        match ev {
            Event::Completion { wc, .. } => {
                if wc.status != WcStatus::Success {
                    st.errors += 1;
                }
                true
            }
            Event::ConnectionLost { .. } => {
                st.lost += 1;
                true
            }
            Event::WriteWithImm { imm, .. } => {
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
                let post = if imm & AG == 0 {
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
                if let Some((remote, imm)) = post {
                    let mut w = st.write(r, off, remote, off);
                    w.imm = Some(imm);
                    if ctx.endpoint.post_write(conn, w).is_err() {
                        st.errors += 1;
                    }
                }
                true
            }
            _ => false,
        }
    });
    let deadline = t0 + limit;
    let s3 = state.clone();
    sim.run_while(|s| {
        let st = s3.borrow();
        s.elapsed() < deadline && st.ranks.iter().any(|k| k.done.is_none())
    });
    // Let the last ACKs and completions arrive (bounded).
    let settle = sim.elapsed() + Duration::from_millis(1);
    sim.run_while(|s| s.elapsed() < settle.min(deadline + Duration::from_millis(1)));
    sim.clear_event_handler();
    let st = state.borrow();
    let completed = st.ranks.iter().all(|k| k.done.is_some());
    let end = st
        .ranks
        .iter()
        .filter_map(|k| k.done)
        .max()
        .unwrap_or(deadline);
    let mut run = CollectiveRun {
        completed,
        time: if completed { end - t0 } else { limit },
        writes: st.writes,
        errors: st.errors,
        connections_lost: st.lost,
        ..Default::default()
    };
    for k in &st.ranks {
        let ep = sim.endpoint(k.host);
        for &c in k.conns.values() {
            if let Some(cs) = ep.connection_stats(c) {
                for p in cs.paths {
                    run.packets_sent += p.stats.packets_sent;
                    run.retransmits += p.stats.retransmits;
                    run.rtos += p.stats.rtos;
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
