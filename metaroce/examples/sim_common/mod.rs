//! Helpers shared by the `sim_*` experiment examples (not an example itself): connecting
//! host pairs, posting RDMA WRITEs, Jain's fairness index, and a tiny JSON writer so the
//! examples need no extra dependencies.

#![allow(dead_code)]

use metaroce::sim::{HostId, Sim};
use metaroce::{Access, ConnectionHandle, WriteRequest};
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
        assert!(sim.endpoint(h).is_established(c), "connection not established");
    }
    conns
}

/// The byte pattern sender `i` writes (so the receiver can check the data).
pub fn pattern(i: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|k| (k as u32).wrapping_mul(2_654_435_761).wrapping_add(i as u32 * 7919) as u8 >> 1)
        .collect()
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
    let target = sim.endpoint_mut(dst).register_mr(
        vec![0; len],
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
    );
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
    sim.endpoint_mut(src).post_write(conn, req).expect("post_write");
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
    /// Flow completion times, pair order (`None`: not completed).
    pub fct: Vec<Option<Duration>>,
    /// Every destination region holds exactly what its source wrote.
    pub data_ok: bool,
    /// Work completions with an error status, over all senders.
    pub errors: u64,
}

impl Transfers {
    /// Aggregate goodput in Gbit/s of the bins between `from` and `to` (fractions of the
    /// earliest completion time): the steady state, without ramp-up and tail.
    pub fn steady_gbps(&self, from: f64, to: f64) -> f64 {
        let first = self
            .fct
            .iter()
            .flatten()
            .min()
            .copied()
            .unwrap_or_default();
        let (a, b) = (
            (first.as_secs_f64() * from / self.bin.as_secs_f64()) as usize,
            (first.as_secs_f64() * to / self.bin.as_secs_f64()) as usize,
        );
        let b = b.min(self.series.len());
        if b <= a {
            return 0.0;
        }
        self.series[a..b].iter().sum::<f64>() * 8.0 / ((b - a) as f64 * self.bin.as_secs_f64()) / 1e9
    }

    /// Gbit/s per bin.
    pub fn gbps(&self) -> Vec<f64> {
        self.series
            .iter()
            .map(|b| b * 8.0 / self.bin.as_secs_f64() / 1e9)
            .collect()
    }
}

/// Post one WRITE of `bytes` on every `(src, dst)` pair at once (connections `conns`), run
/// until all complete (or `limit` of simulated time), counting the data delivered to the
/// destinations in bins of `bin`. `before_run` may schedule actions (times relative to
/// the post are `sim.elapsed() + …`). The trace hook is set for the run and cleared after.
pub fn run_transfers(
    sim: &mut Sim,
    pairs: &[(HostId, HostId)],
    conns: &[ConnectionHandle],
    bytes: usize,
    bin: Duration,
    limit: Duration,
    before_run: impl FnOnce(&mut Sim),
) -> Transfers {
    use metaroce::sim::{Location, TraceKind};
    use metaroce::wire::Opcode;
    use std::cell::RefCell;
    use std::rc::Rc;
    let dsts: std::collections::HashSet<HostId> = pairs.iter().map(|p| p.1).collect();
    let series: Rc<RefCell<Vec<f64>>> = Rc::default();
    let start = sim.elapsed();
    let bin_ns = bin.as_nanos() as u64;
    {
        let series = series.clone();
        sim.set_trace(move |e| {
            if let (TraceKind::Deliver, Location::Host(h)) = (e.kind, e.location) {
                if matches!(e.opcode, Some(Opcode::MR_WRITE)) && dsts.contains(&h) {
                    let k = (e.time.saturating_sub(start).as_nanos() as u64 / bin_ns) as usize;
                    let mut s = series.borrow_mut();
                    if s.len() <= k {
                        s.resize(k + 1, 0.0);
                    }
                    // UDP payload = headers + data; full packets carry 4096 data bytes.
                    s[k] += f64::from(e.len.min(4096));
                }
            }
        });
    }
    let targets: Vec<u32> = pairs
        .iter()
        .zip(conns)
        .enumerate()
        .map(|(i, (&(s, d), &c))| post_write(sim, s, d, c, pattern(i, bytes), 1000 + i as u64))
        .collect();
    before_run(sim);
    let fct = |s: &Sim, i: usize| {
        s.events(pairs[i].0).iter().find_map(|e| match &e.event {
            metaroce::Event::Completion { wc, .. } if wc.wr_id == 1000 + i as u64 => {
                Some(e.time - start)
            }
            _ => None,
        })
    };
    let deadline = start + limit;
    let mut done = vec![false; pairs.len()];
    sim.run_while(|s| {
        for (i, d) in done.iter_mut().enumerate() {
            if !*d {
                *d = fct(s, i).is_some();
            }
        }
        s.elapsed() < deadline && done.iter().any(|d| !d)
    });
    sim.clear_trace();
    let fcts: Vec<Option<Duration>> = (0..pairs.len()).map(|i| fct(sim, i)).collect();
    let data_ok = targets.iter().enumerate().all(|(i, &lkey)| {
        sim.endpoint(pairs[i].1)
            .mr_read(lkey, 0, bytes as u64)
            .is_ok_and(|d| d == &pattern(i, bytes)[..])
    });
    let mut srcs: Vec<HostId> = pairs.iter().map(|p| p.0).collect();
    srcs.sort();
    srcs.dedup();
    let errors = srcs.iter().map(|&h| sim.host_stats(h).completion_errors).sum();
    let series = series.borrow().clone();
    Transfers {
        series,
        bin,
        fct: fcts,
        data_ok,
        errors,
    }
}
