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
