//! Helpers shared by the `sim_*` experiment examples (not an example itself): connecting
//! host pairs, posting RDMA WRITEs, Jain's fairness index, and a tiny JSON writer so the
//! examples need no extra dependencies.

#![allow(dead_code)]

use metaroce::sim::{HostId, Sim};
use metaroce::{Access, ConnectionHandle, MrKeys, WriteRequest};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

/// Connect every `(src, dst)` pair at once and run until all are established (or 100 ms of
/// simulated time passed). Returns the connection handles in pair order.
pub fn connect_all(sim: &mut Sim, pairs: &[(HostId, HostId)]) -> Vec<ConnectionHandle> {
    let conns: Vec<_> = pairs
        .iter()
        .map(|&(s, d)| sim.connect_endpoints(s, d).expect("connect"))
        .collect();
    let deadline = sim.elapsed() + Duration::from_millis(100);
    sim.run_while(|s| {
        s.elapsed() < deadline
            && pairs
                .iter()
                .zip(&conns)
                .any(|(&(h, _), &c)| !s.endpoint(h).is_established(c))
    });
    for (&(h, _), &c) in pairs.iter().zip(&conns) {
        assert!(
            sim.endpoint(h).is_established(c),
            "connection not established"
        );
    }
    conns
}

/// The byte pattern sender `i` writes (so the receiver can check the data).
pub fn pattern(i: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|k| {
            (k as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(i as u32 * 7919) as u8
                >> 1
        })
        .collect()
}

/// Register a source region holding `data` on `src` and a zeroed target region of the same
/// size on `dst` (remote-writable).
pub fn register_pair(sim: &mut Sim, src: HostId, dst: HostId, data: Vec<u8>) -> (MrKeys, MrKeys) {
    let target = sim.endpoint_mut(dst).register_mr(
        vec![0; data.len()],
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
    );
    let source = sim.endpoint_mut(src).register_mr(data, Access::LOCAL_WRITE);
    (source, target)
}

/// Register a source region with `data` on `src` and a zeroed target region on `dst`,
/// post one RDMA WRITE of all of it; returns the target region's lkey on `dst`.
pub fn post_write(
    sim: &mut Sim,
    src: HostId,
    dst: HostId,
    conn: ConnectionHandle,
    data: Vec<u8>,
    wr_id: u64,
) -> u32 {
    let len = data.len();
    let target = sim
        .endpoint_mut(dst)
        .register_mr(vec![0; len], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let source = sim.endpoint_mut(src).register_mr(data, Access::LOCAL_WRITE);
    let req = WriteRequest {
        wr_id,
        lkey: source.lkey,
        local_offset: 0,
        len: len as u32,
        remote_addr: target.addr,
        rkey: target.rkey,
        imm: None,
    };
    sim.endpoint_mut(src)
        .post_write(conn, req)
        .expect("post_write");
    target.lkey
}

/// Jain's fairness index of `x`: `(Σx)² / (n·Σx²)`, 1 when all are equal, `1/n` when one
/// takes everything. 1 for an all-zero input.
pub fn jain(x: &[f64]) -> f64 {
    let s: f64 = x.iter().sum();
    let s2: f64 = x.iter().map(|v| v * v).sum();
    if s2 == 0.0 {
        1.0
    } else {
        s * s / (x.len() as f64 * s2)
    }
}

/// `experiments/sim/results/<name>.json` under the repository root (created if missing).
pub fn results_path(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("experiments")
        .join("sim")
        .join("results");
    std::fs::create_dir_all(&dir).expect("create results dir");
    dir.join(format!("{name}.json"))
}

/// A JSON value built by hand (objects keep insertion order).
#[derive(Debug, Clone)]
pub enum Json {
    Num(f64),
    Int(i64),
    Str(String),
    Bool(bool),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

impl Json {
    pub fn obj() -> Self {
        Json::Obj(Vec::new())
    }

    /// Add a field to an object (no-op on other values).
    pub fn with(mut self, k: &str, v: impl Into<Json>) -> Self {
        if let Json::Obj(f) = &mut self {
            f.push((k.to_string(), v.into()));
        }
        self
    }

    pub fn render(&self, out: &mut String) {
        match self {
            Json::Num(v) if v.is_finite() => {
                let _ = write!(out, "{}", (v * 1e6).round() / 1e6);
            }
            Json::Num(_) => out.push_str("null"),
            Json::Int(v) => {
                let _ = write!(out, "{v}");
            }
            Json::Str(s) => {
                out.push('"');
                for c in s.chars() {
                    match c {
                        '"' => out.push_str("\\\""),
                        '\\' => out.push_str("\\\\"),
                        '\n' => out.push_str("\\n"),
                        c => out.push(c),
                    }
                }
                out.push('"');
            }
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Arr(a) => {
                out.push('[');
                for (i, v) in a.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    v.render(out);
                }
                out.push(']');
            }
            Json::Obj(f) => {
                out.push_str("{\n");
                for (i, (k, v)) in f.iter().enumerate() {
                    if i > 0 {
                        out.push_str(",\n");
                    }
                    let _ = write!(out, "  \"{k}\": ");
                    v.render(out);
                }
                out.push_str("\n}");
            }
        }
    }

    /// Write to `experiments/sim/results/<name>.json` and say where.
    pub fn save(&self, name: &str) {
        let mut s = String::new();
        self.render(&mut s);
        s.push('\n');
        let p = results_path(name);
        std::fs::write(&p, s).expect("write results");
        println!("wrote {}", p.display());
    }
}

impl From<f64> for Json {
    fn from(v: f64) -> Self {
        Json::Num(v)
    }
}
impl From<u64> for Json {
    fn from(v: u64) -> Self {
        Json::Int(v as i64)
    }
}
impl From<usize> for Json {
    fn from(v: usize) -> Self {
        Json::Int(v as i64)
    }
}
impl From<i64> for Json {
    fn from(v: i64) -> Self {
        Json::Int(v)
    }
}
impl From<bool> for Json {
    fn from(v: bool) -> Self {
        Json::Bool(v)
    }
}
impl From<&str> for Json {
    fn from(v: &str) -> Self {
        Json::Str(v.to_string())
    }
}
impl From<String> for Json {
    fn from(v: String) -> Self {
        Json::Str(v)
    }
}
impl<T: Into<Json>> From<Vec<T>> for Json {
    fn from(v: Vec<T>) -> Self {
        Json::Arr(v.into_iter().map(Into::into).collect())
    }
}

/// What [`run_transfers`] measured.
pub struct Transfers {
    /// Data bytes (4096 per full WRITE packet) delivered to the destinations per `bin`,
    /// over all flows, from the post.
    pub series: Vec<f64>,
    /// Bin width.
    pub bin: Duration,
    /// Flow completion times (the last WRITE of the flow), pair order (`None`: not
    /// completed).
    pub fct: Vec<Option<Duration>>,
    /// Per flow (pair order): the longest time between two data packets delivered to its
    /// destination, from the post to the flow's completion.
    pub max_gap: Vec<Duration>,
    /// Every destination region holds exactly what its source wrote.
    pub data_ok: bool,
    /// Work completions with an error status, over all senders.
    pub errors: u64,
    /// Connections lost, over all senders.
    pub connections_lost: u64,
    /// Per flow: the longest time between the post and the first WRITE completion or
    /// between two consecutive completions (what the application sees of a stall).
    pub max_completion_gap: Vec<Duration>,
}

impl Transfers {
    /// Aggregate goodput in Gbit/s of the bins between `from` and `to` (fractions of the
    /// earliest completion time): the steady state, without ramp-up and tail.
    pub fn steady_gbps(&self, from: f64, to: f64) -> f64 {
        let first = self.fct.iter().flatten().min().copied().unwrap_or_default();
        self.mean_gbps(first.mul_f64(from), first.mul_f64(to))
    }

    /// Mean aggregate goodput in Gbit/s between two times after the post.
    pub fn mean_gbps(&self, from: Duration, to: Duration) -> f64 {
        let a = (from.as_secs_f64() / self.bin.as_secs_f64()) as usize;
        let b = ((to.as_secs_f64() / self.bin.as_secs_f64()) as usize).min(self.series.len());
        if b <= a {
            return 0.0;
        }
        self.series[a..b].iter().sum::<f64>() * 8.0
            / ((b - a) as f64 * self.bin.as_secs_f64())
            / 1e9
    }

    /// Gbit/s per bin.
    pub fn gbps(&self) -> Vec<f64> {
        self.series
            .iter()
            .map(|b| b * 8.0 / self.bin.as_secs_f64() / 1e9)
            .collect()
    }
}

/// Post `repeat` WRITEs of `bytes` (the same source region to the same target region) on
/// every `(src, dst)` pair at once (connections `conns`; every destination distinct), run
/// until all complete (or `limit` of simulated time), counting the data delivered to the
/// destinations in bins of `bin`. `before_run` may schedule actions (the post happens at
/// `sim.elapsed()` when it is called). The trace hook is set for the run and cleared after.
#[allow(clippy::too_many_arguments)]
pub fn run_transfers(
    sim: &mut Sim,
    pairs: &[(HostId, HostId)],
    conns: &[ConnectionHandle],
    bytes: usize,
    repeat: usize,
    bin: Duration,
    limit: Duration,
    before_run: impl FnOnce(&mut Sim),
    mut on_tick: impl FnMut(&Sim, Duration),
) -> Transfers {
    use metaroce::sim::{Location, TraceKind};
    use metaroce::wire::Opcode;
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::rc::Rc;
    let dst_index: HashMap<HostId, usize> =
        pairs.iter().enumerate().map(|(i, p)| (p.1, i)).collect();
    assert_eq!(
        dst_index.len(),
        pairs.len(),
        "destinations must be distinct"
    );
    // (series, last delivery per flow, max gap per flow)
    type State = (Vec<f64>, Vec<Duration>, Vec<Duration>);
    let n = pairs.len();
    let start = sim.elapsed();
    let state: Rc<RefCell<State>> = Rc::new(RefCell::new((
        Vec::new(),
        vec![start; n],
        vec![Duration::ZERO; n],
    )));
    let bin_ns = bin.as_nanos() as u64;
    {
        let state = state.clone();
        sim.set_trace(move |e| {
            if let (TraceKind::Deliver, Location::Host(h)) = (e.kind, e.location) {
                if !matches!(e.opcode, Some(Opcode::MR_WRITE)) {
                    return;
                }
                let Some(&i) = dst_index.get(&h) else {
                    return;
                };
                let k = (e.time.saturating_sub(start).as_nanos() as u64 / bin_ns) as usize;
                let mut st = state.borrow_mut();
                if st.0.len() <= k {
                    st.0.resize(k + 1, 0.0);
                }
                // UDP payload = headers + data; full packets carry 4096 data bytes.
                st.0[k] += f64::from(e.len.min(4096));
                let gap = e.time.saturating_sub(st.1[i]);
                st.1[i] = e.time;
                st.2[i] = st.2[i].max(gap);
            }
        });
    }
    let mut targets = Vec::new();
    for (i, (&(s, d), &c)) in pairs.iter().zip(conns).enumerate() {
        let (src, dst) = register_pair(sim, s, d, pattern(i, bytes));
        for r in 0..repeat {
            let req = WriteRequest {
                wr_id: wr_id(i, r),
                lkey: src.lkey,
                local_offset: 0,
                len: bytes as u32,
                remote_addr: dst.addr,
                rkey: dst.rkey,
                imm: None,
            };
            sim.endpoint_mut(s).post_write(c, req).expect("post_write");
        }
        targets.push(dst.lkey);
    }
    before_run(sim);
    let last = |s: &Sim, i: usize| {
        s.events(pairs[i].0).iter().find_map(|e| match &e.event {
            metaroce::Event::Completion { wc, .. } if wc.wr_id == wr_id(i, repeat - 1) => {
                Some(e.time - start)
            }
            _ => None,
        })
    };
    let deadline = start + limit;
    let mut done = vec![false; n];
    let mut tick = start;
    while sim.elapsed() < deadline && done.iter().any(|d| !d) {
        tick += bin;
        sim.run_until(tick);
        on_tick(sim, tick - start);
        for (i, d) in done.iter_mut().enumerate() {
            if !*d {
                *d = last(sim, i).is_some();
            }
        }
    }
    sim.clear_trace();
    let fcts: Vec<Option<Duration>> = (0..n).map(|i| last(sim, i)).collect();
    let data_ok = targets.iter().enumerate().all(|(i, &lkey)| {
        sim.endpoint(pairs[i].1)
            .mr_read(lkey, 0, bytes as u64)
            .is_ok_and(|d| d[..] == pattern(i, bytes)[..])
    });
    let mut srcs: Vec<HostId> = pairs.iter().map(|p| p.0).collect();
    srcs.sort();
    srcs.dedup();
    let errors = srcs
        .iter()
        .map(|&h| sim.host_stats(h).completion_errors)
        .sum();
    let connections_lost = srcs
        .iter()
        .map(|&h| sim.host_stats(h).connections_lost)
        .sum();
    let max_completion_gap = (0..n)
        .map(|i| {
            let mut times: Vec<Duration> = sim
                .events(pairs[i].0)
                .iter()
                .filter_map(|e| match &e.event {
                    metaroce::Event::Completion { wc, .. }
                        if (wr_id(i, 0)..=wr_id(i, repeat - 1)).contains(&wc.wr_id) =>
                    {
                        Some(e.time)
                    }
                    _ => None,
                })
                .collect();
            times.insert(0, start);
            times
                .windows(2)
                .map(|w| w[1] - w[0])
                .max()
                .unwrap_or_default()
        })
        .collect();
    let st = state.borrow();
    // Gaps only up to each flow's completion.
    Transfers {
        series: st.0.clone(),
        bin,
        fct: fcts,
        max_gap: st.2.clone(),
        data_ok,
        errors,
        connections_lost,
        max_completion_gap,
    }
}

fn wr_id(flow: usize, r: usize) -> u64 {
    1_000_000 + (flow as u64) * 10_000 + r as u64
}
