//! Packet rate of the sans-IO core in memory: two endpoints in one thread, no sockets.
//!
//! ```text
//! cargo bench -p metaroce --bench core_rate                    # 64 B and 4 KiB, 3 s each
//! cargo bench -p metaroce --bench core_rate -- --size=64 --secs=5
//! cargo bench -p metaroce --bench core_rate -- --packets=200000   # fixed work (callgrind)
//! cargo bench -p metaroce --bench core_rate -- --json             # one JSON line per size
//! ```
//!
//! Endpoint A keeps `--inflight` (16) RDMA WRITEs of `--size` bytes outstanding to a region
//! of endpoint B (default transport configuration: 8 paths, path MTU 4096, no GSO), over a
//! lossless in-memory network: every datagram one endpoint emits is handed to the other in
//! the same round. The virtual clock advances by `--step-ns` (1,000) per round, so the run
//! is deterministic (same figures under `valgrind --tool=callgrind` every time). The figure
//! is datagrams per second of CPU time for both ends together: every `handle_datagram` call
//! counts once (data packets and ACKs alike; an ACK bundle acknowledging several paths is
//! one datagram). It also prints data packets per second of CPU, the work done. Nothing is ever dropped, so the run also counts
//! retransmitted data packets, which should be zero.
//!
//! The reference rates printed beside the result are the baseline of this bench, measured
//! on the commit named there (`BASELINE`), on the project's 2-vCPU development machine.

use metaroce::{Access, Endpoint, EndpointConfig, Event, WcStatus, WriteRequest};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// (payload size, datagrams/s, commit): this bench on the core of `d176bb7`, before the
/// per-packet path work of issue #13. Measured 2026-12-06 02:10 UTC with this harness built
/// against `d176bb7`, in 5 runs of 3 s interleaved with the core of `3bd59c3` (load average
/// 2.9 on 2 vCPUs; docs/RESULTS.md, "P3 against the old core itself"): medians 0.657 M data
/// packets/s at 64 B, 0.495 M at 4 KiB, i.e. 0.986 and 0.743 M datagrams/s at the old core's
/// 2/3 data share. (The first record, 2026-12-01 at load average 6: 0.933 and 0.710.)
const BASELINE: &[(u32, f64, &str)] = &[(64, 0.986e6, "d176bb7"), (4096, 0.743e6, "d176bb7")];

/// Data packets per datagram in the baseline runs: 2/3 (one ACK per path per round, 16
/// packets over 8 paths: 16 data packets and 8 ACKs). Since ACK bundles (several paths per
/// ACK datagram) the datagram count includes fewer ACKs for the same work, so the bench
/// also prints data packets (WRITE packets) per second, against `baseline × 2/3`.
const BASELINE_DATA_SHARE: f64 = 2.0 / 3.0;

/// CPU time this (single-threaded) process has run, from `/proc/self/schedstat` (the machine
/// may be shared, so wall time alone can mislead); `None` if unavailable.
fn cpu_time() -> Option<Duration> {
    std::fs::read_to_string("/proc/self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .map(Duration::from_nanos)
}

struct Opts {
    sizes: Vec<u32>,
    secs: f64,
    packets: Option<u64>,
    inflight: usize,
    step_ns: u64,
    json: bool,
}

fn parse() -> Opts {
    let mut o = Opts {
        sizes: vec![64, 4096],
        secs: 3.0,
        packets: None,
        inflight: 16,
        step_ns: 1_000,
        json: false,
    };
    for a in std::env::args().skip(1) {
        let (k, v) = a.split_once('=').unwrap_or((a.as_str(), ""));
        match k {
            "--size" => o.sizes = v.split(',').map(|s| s.parse().expect("--size")).collect(),
            "--secs" => o.secs = v.parse().expect("--secs"),
            "--packets" => o.packets = Some(v.parse().expect("--packets")),
            "--inflight" => o.inflight = v.parse().expect("--inflight"),
            "--step-ns" => o.step_ns = v.parse().expect("--step-ns"),
            "--json" => o.json = true,
            "--bench" => {}
            other => eprintln!("core_rate: ignoring argument {other}"),
        }
    }
    o
}

fn config(i: usize) -> EndpointConfig {
    let addr: SocketAddr = format!("10.0.0.{}:4791", i + 1).parse().unwrap();
    let mut c = EndpointConfig::new(addr, (0..8).map(|k| 0xC000 + k + 16 * i as u16).collect());
    c.seed = 7 + i as u64;
    c
}

/// One datagram in flight: bytes, sender address, ECN bits.
struct Dgram {
    data: Vec<u8>,
    len: usize,
    from: SocketAddr,
    ecn: Option<metaroce::EcnCodepoint>,
}

struct Run {
    eps: [Endpoint; 2],
    addrs: [SocketAddr; 2],
    now: Instant,
    step: Duration,
    /// Datagrams in flight to endpoint `i`.
    queues: [Vec<Dgram>; 2],
    /// Spare datagram buffers (no allocation per packet in the harness itself).
    pool: Vec<Vec<u8>>,
    buf: Vec<u8>,
    datagrams: u64,
    completions: u64,
}

impl Run {
    fn new() -> Run {
        let (a, b) = (config(0), config(1));
        let addrs = [a.local_addr, b.local_addr];
        Run {
            eps: [Endpoint::new(a).unwrap(), Endpoint::new(b).unwrap()],
            addrs,
            now: Instant::now(),
            step: Duration::from_nanos(1_000),
            queues: [Vec::new(), Vec::new()],
            pool: Vec::new(),
            buf: Vec::with_capacity(1 << 16),
            datagrams: 0,
            completions: 0,
        }
    }

    /// One round: both endpoints transmit everything, then each handles what it received,
    /// then timers that are due; the clock advances by one step.
    fn round(&mut self) {
        for i in 0..2 {
            let to = 1 - i;
            while let Some(t) = self.eps[i].poll_transmit(self.now, &mut self.buf) {
                let seg = t.segment_size.unwrap_or(t.size);
                for chunk in self.buf[..t.size].chunks(seg) {
                    let mut data = self.pool.pop().unwrap_or_default();
                    data.clear();
                    data.extend_from_slice(chunk);
                    self.queues[to].push(Dgram {
                        len: chunk.len(),
                        data,
                        from: SocketAddr::new(self.addrs[i].ip(), t.src_port),
                        ecn: t.ecn,
                    });
                }
            }
        }
        for i in 0..2 {
            let local = Some(self.addrs[i].ip());
            let mut q = std::mem::take(&mut self.queues[i]);
            for d in q.drain(..) {
                self.eps[i].handle_datagram(self.now, d.from, local, d.ecn, &d.data[..d.len]);
                self.datagrams += 1;
                self.pool.push(d.data);
            }
            self.queues[i] = q;
        }
        self.now += self.step;
        for ep in &mut self.eps {
            if ep.poll_timeout().is_some_and(|t| t <= self.now) {
                ep.handle_timeout(self.now);
            }
        }
    }
}

struct Result {
    size: u32,
    datagrams: u64,
    cpu: Duration,
    wall: Duration,
    retransmits: u64,
    data_packets: u64,
}

fn run(size: u32, o: &Opts) -> Result {
    let mut r = Run::new();
    r.step = Duration::from_nanos(o.step_ns);
    let c = r.eps[0].connect(r.now, r.addrs[1], None).unwrap();
    let mut server = None;
    while !r.eps[0].is_established(c) || server.is_none() {
        r.round();
        while let Some(e) = r.eps[1].poll_event() {
            if let Event::Incoming(h) = e {
                server = Some(h);
            }
        }
        while r.eps[0].poll_event().is_some() {}
    }
    let region = (size as usize).max(4096) * o.inflight;
    let local = r.eps[0].register_mr(vec![0x5a; region], Access::LOCAL_WRITE);
    let remote = r.eps[1].register_mr(vec![0; region], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let post = |ep: &mut Endpoint, k: u64| {
        let off = (k % o.inflight as u64) * size as u64;
        ep.post_write(
            c,
            WriteRequest {
                wr_id: k,
                lkey: local.lkey,
                local_offset: off,
                len: size,
                remote_addr: remote.addr + off,
                rkey: remote.rkey,
                imm: None,
            },
        )
        .unwrap();
    };
    let mut next = 0u64;
    for _ in 0..o.inflight {
        post(&mut r.eps[0], next);
        next += 1;
    }
    // Warm-up: a few thousand operations, then measure.
    let mut measuring = false;
    let mut start_dg = 0;
    let (mut t0, mut c0) = (Instant::now(), cpu_time());
    let sent = |r: &Run| {
        let s = r.eps[0].connection_stats(c).unwrap();
        s.paths.iter().fold((0, 0), |(p, x), i| {
            (p + i.stats.packets_sent, x + i.stats.retransmits)
        })
    };
    let mut s0 = sent(&r);
    let warm = 5_000;
    loop {
        r.round();
        while let Some(e) = r.eps[0].poll_event() {
            if let Event::Completion { wc, .. } = e {
                assert_eq!(wc.status, WcStatus::Success, "WRITE failed: {wc:?}");
                r.completions += 1;
                post(&mut r.eps[0], next);
                next += 1;
            }
        }
        while r.eps[1].poll_event().is_some() {}
        if !measuring && r.completions >= warm {
            measuring = true;
            start_dg = r.datagrams;
            s0 = sent(&r);
            t0 = Instant::now();
            c0 = cpu_time();
        }
        if measuring && r.datagrams & 1023 < 64 {
            let n = r.datagrams - start_dg;
            let done = match o.packets {
                Some(p) => n >= p,
                None => t0.elapsed().as_secs_f64() >= o.secs,
            };
            if done {
                break;
            }
        }
    }
    let wall = t0.elapsed();
    let cpu = match (c0, cpu_time()) {
        (Some(a), Some(b)) => b - a,
        _ => wall,
    };
    let s1 = sent(&r);
    Result {
        size,
        datagrams: r.datagrams - start_dg,
        cpu,
        wall,
        retransmits: s1.1 - s0.1,
        data_packets: s1.0 - s0.0,
    }
}

fn main() {
    let o = parse();
    for &size in &o.sizes {
        let res = run(size, &o);
        let rate = res.datagrams as f64 / res.cpu.as_secs_f64();
        let data_rate = res.data_packets as f64 / res.cpu.as_secs_f64();
        let base = BASELINE.iter().find(|b| b.0 == size);
        if o.json {
            println!(
                "{{\"bench\":\"core_rate\",\"size\":{},\"inflight\":{},\"datagrams\":{},\"cpu_s\":{:.6},\"wall_s\":{:.6},\"datagrams_per_s\":{:.0},\"data_packets_per_s\":{:.0},\"data_packets\":{},\"retransmits\":{},\"baseline_per_s\":{},\"baseline_data_packets_per_s\":{:.0},\"baseline_commit\":\"{}\"}}",
                res.size,
                o.inflight,
                res.datagrams,
                res.cpu.as_secs_f64(),
                res.wall.as_secs_f64(),
                rate,
                data_rate,
                res.data_packets,
                res.retransmits,
                base.map_or(0.0, |b| b.1),
                base.map_or(0.0, |b| b.1 * BASELINE_DATA_SHARE),
                base.map_or("", |b| b.2),
            );
        } else {
            let (vs, data_vs) = match base {
                Some(&(_, b, commit)) if b > 0.0 => (
                    format!(
                        " = {:.2}x the baseline {:.3} M/s of {commit}",
                        rate / b,
                        b / 1e6
                    ),
                    format!(
                        " = {:.2}x the baseline's {:.3} M/s",
                        data_rate / (b * BASELINE_DATA_SHARE),
                        b * BASELINE_DATA_SHARE / 1e6
                    ),
                ),
                _ => (String::new(), String::new()),
            };
            println!(
                "core_rate {:>5} B WRITEs, {} in flight: {} datagrams in {:.3} s CPU ({:.3} s wall): {:.3} M datagrams/s{vs}; {} data packets: {:.3} M/s{data_vs}; {} retransmitted",
                res.size,
                o.inflight,
                res.datagrams,
                res.cpu.as_secs_f64(),
                res.wall.as_secs_f64(),
                rate / 1e6,
                res.data_packets,
                data_rate / 1e6,
                res.retransmits,
            );
        }
    }
}
