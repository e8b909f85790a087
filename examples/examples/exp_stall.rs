//! Stall measurement for experiments: a client keeps `--depth` RDMA WRITEs of `--size`
//! bytes outstanding for `--duration` seconds, time-stamps every completion, and reports
//! the longest gap between consecutive completions, the goodput, a goodput timeline and
//! per-path statistics (sampled over time and at the end) as JSON. Meant to run while a
//! link of the network fails (see `experiments/netns/run.sh`).
//!
//! ```text
//! exp_stall --listen 10.77.0.2:4791                       # server (serves one client)
//! exp_stall --connect 10.77.0.2:4791 --duration 6 --size 65536 [--out run.json]
//! ```
//!
//! The client prints one JSON summary line on stdout; `--out FILE` also writes the full
//! document (with the completion-rate timeline and per-path samples). Any failed WRITE is
//! counted in `app_errors`; at the end the client RDMA-READs the destination back and
//! compares it with the source (`verified`). Transport knobs (`--min-rto-us`,
//! `--max-rto-ms`, `--reroll-timeouts`, `--retry-count`, `--spare-ports`,
//! `--delay-target-us`) apply to the side that sets them.

use bytes::Bytes;
use clap::Parser;
use futures::stream::FuturesUnordered;
use futures::{SinkExt, StreamExt};
use metaroce::{ConnectionStats, PathInfo};
use metaroce_tokio::{Access, Config, Connection, Endpoint, RemoteRegion};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Debug, Parser)]
#[command(about = "Completion-gap (stall) measurement of RDMA WRITEs over MetaRoCE")]
struct Args {
    /// Server: listen on this address and serve one client.
    #[arg(long, conflicts_with = "connect")]
    listen: Option<SocketAddr>,
    /// Client: connect to the server at this address.
    #[arg(long, required_unless_present = "listen")]
    connect: Option<SocketAddr>,
    /// Client: local address to bind.
    #[arg(long, default_value = "0.0.0.0:0")]
    bind: SocketAddr,
    /// Client: seconds of WRITEs.
    #[arg(long, default_value_t = 6.0)]
    duration: f64,
    /// Client: bytes per WRITE.
    #[arg(long, default_value_t = 65536)]
    size: u64,
    /// Client: WRITEs kept outstanding.
    #[arg(long, default_value_t = 64)]
    depth: usize,
    /// Client: destination slots (the destination region is slots x size bytes).
    #[arg(long, default_value_t = 64)]
    slots: u64,
    /// Paths (UDP source ports) per connection.
    #[arg(long, default_value_t = 8)]
    paths: u16,
    /// Path MTU (payload bytes per packet).
    #[arg(long, default_value_t = 4096)]
    mtu: u32,
    /// Spare source ports bound for re-rolls.
    #[arg(long, default_value_t = 8)]
    spare_ports: usize,
    /// transport.min_rto in microseconds (default: the transport's, 1000).
    #[arg(long)]
    min_rto_us: Option<u64>,
    /// transport.max_rto in milliseconds (default: the transport's, 1000).
    #[arg(long)]
    max_rto_ms: Option<u64>,
    /// transport.path_reroll_timeouts (default: the transport's, 3; 0 disables).
    #[arg(long)]
    reroll_timeouts: Option<u32>,
    /// transport.retry_count (default: the transport's, 12).
    #[arg(long)]
    retry_count: Option<u32>,
    /// congestion.delay_target in microseconds; 0 disables the delay signal
    /// (default: the transport's, 2000).
    #[arg(long)]
    delay_target_us: Option<u64>,
    /// Client: sample per-path state every this many milliseconds.
    #[arg(long, default_value_t = 20)]
    sample_ms: u64,
    /// Client: width of the goodput timeline bins in milliseconds.
    #[arg(long, default_value_t = 10)]
    bin_ms: u64,
    /// Client: also write the full JSON document (timeline, samples) here.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

fn config(a: &Args) -> Config {
    let mut c = Config::default();
    c.transport.paths = a.paths;
    c.transport.pmtu = a.mtu;
    c.spare_ports = a.spare_ports;
    if let Some(v) = a.min_rto_us {
        c.transport.min_rto = Duration::from_micros(v);
    }
    if let Some(v) = a.max_rto_ms {
        c.transport.max_rto = Duration::from_millis(v);
    }
    if let Some(v) = a.reroll_timeouts {
        c.transport.path_reroll_timeouts = v;
    }
    if let Some(v) = a.retry_count {
        c.transport.retry_count = v;
    }
    if let Some(v) = a.delay_target_us {
        c.transport.congestion.delay_target = (v > 0).then(|| Duration::from_micros(v));
    }
    c
}

fn knobs(c: &Config) -> Value {
    let t = &c.transport;
    json!({
        "paths": t.paths,
        "pmtu": t.pmtu,
        "spare_ports": c.spare_ports,
        "min_rto_us": t.min_rto.as_micros() as u64,
        "max_rto_ms": t.max_rto.as_millis() as u64,
        "path_reroll_timeouts": t.path_reroll_timeouts,
        "retry_count": t.retry_count,
        "delay_target_us": t.congestion.delay_target.map(|d| d.as_micros() as u64),
    })
}

/// A scheduling-latency probe: an OS thread that sleeps 1 ms at a time and records every
/// wake-up at least 2 ms late as `(unix time the sleep began, lateness in ms)`. Late
/// wake-ups that overlap a completion gap show that the host's CPUs, not the network, held
/// the process up.
struct SchedProbe {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(f64, f64)>>,
}

impl SchedProbe {
    fn start() -> SchedProbe {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut late_wakeups = Vec::new();
            let tick = Duration::from_millis(1);
            while !flag.load(Ordering::Relaxed) {
                let (t0, u0) = (Instant::now(), unix_now());
                std::thread::sleep(tick);
                let late = t0.elapsed().saturating_sub(tick);
                if late >= Duration::from_millis(2) {
                    late_wakeups.push((u0, late.as_secs_f64() * 1e3));
                }
            }
            late_wakeups
        });
        SchedProbe { stop, thread }
    }

    /// Stop the probe; late wake-ups with times relative to `origin` (unix seconds).
    fn finish(self, origin: f64) -> Value {
        self.stop.store(true, Ordering::Relaxed);
        let v = self.thread.join().unwrap_or_default();
        let max = v.iter().map(|x| x.1).fold(0.0, f64::max);
        json!({
            "origin_unix": origin,
            "max_late_ms": max,
            "late_wakeups": v.iter().map(|(u, l)| json!([u - origin, l])).collect::<Vec<_>>(),
        })
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn path_json(p: &PathInfo) -> Value {
    let s = &p.stats;
    json!({
        "id": p.id,
        "src_port": p.src_port,
        "state": format!("{:?}", p.state),
        "window": p.window,
        "in_flight": p.in_flight,
        "srtt_us": p.srtt.as_micros() as u64,
        "min_rtt_us": p.min_rtt.map(|d| d.as_micros() as u64),
        "generation": p.generation,
        "packets_sent": s.packets_sent,
        "packets_acked": s.packets_acked,
        "retransmits": s.retransmits,
        "sack_losses": s.sack_losses,
        "timeout_losses": s.timeout_losses,
        "probes": s.probes,
        "timeouts": s.rtos,
        "rerolls": s.rerolls,
        "ecn_marks": s.ecn_marks,
    })
}

fn stats_json(st: &ConnectionStats) -> Value {
    json!({
        "pmtu": st.pmtu,
        "paths": st.paths.iter().map(path_json).collect::<Vec<_>>(),
        "acks_sent": st.acks_sent,
        "acks_received": st.acks_received,
        "data_packets_received": st.data_packets_received,
        "duplicate_packets": st.duplicate_packets,
        "ce_received": st.ce_received,
        "write_bytes_placed": st.recv.write_bytes,
    })
}

/// A compact sample of every path: [state, window, in_flight, src_port, timeouts,
/// rerolls, srtt_us, ecn_marks, retransmits, sack_losses, packets_sent] (see
/// `SAMPLE_FIELDS`).
fn sample_json(t: f64, st: &ConnectionStats) -> Value {
    json!({
        "t": t,
        "paths": st.paths.iter().map(|p| json!([
            format!("{:?}", p.state), p.window, p.in_flight, p.src_port, p.stats.rtos,
            p.stats.rerolls, p.srtt.as_micros() as u64, p.stats.ecn_marks, p.stats.retransmits,
            p.stats.sack_losses, p.stats.packets_sent
        ])).collect::<Vec<_>>(),
    })
}

const SAMPLE_FIELDS: [&str; 11] = [
    "state",
    "window",
    "in_flight",
    "src_port",
    "timeouts",
    "rerolls",
    "srtt_us",
    "ecn_marks",
    "retransmits",
    "sack_losses",
    "packets_sent",
];

async fn server(a: &Args, addr: SocketAddr) -> Res<()> {
    let cfg = config(a);
    let ep = Endpoint::bind(addr, cfg.clone()).await?;
    eprintln!("exp_stall: listening on {}", ep.local_addr());
    let conn = ep.accept().await.ok_or("endpoint closed")?.accept()?;
    let mut ctrl = conn.accept_stream().await.ok_or("connection closed")?;
    let hello = ctrl.next().await.ok_or("control stream ended")??;
    let len: usize = std::str::from_utf8(&hello)?.trim().parse()?;
    let region = ep.alloc(
        len,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    );
    ctrl.send(Bytes::copy_from_slice(&region.remote().to_bytes()))
        .await?;
    // Wait for the client's "done" (or the connection's end), then report and exit.
    let probe = SchedProbe::start();
    let done = ctrl.next().await;
    let st = conn.stats();
    let doc = json!({
        "role": "server",
        "config": knobs(&cfg),
        "client_done": matches!(done, Some(Ok(_))),
        "sched": probe.finish(0.0),
        "stats": st.as_ref().map(stats_json),
    });
    println!("{doc}");
    if done.is_some() {
        ctrl.send(Bytes::from_static(b"bye")).await.ok();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 9)) as u8
}

/// Sample the connection's per-path state every `every` until `stop` fires.
async fn sampler(
    conn: Connection,
    start: Instant,
    every: Duration,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> Vec<Value> {
    let mut out = Vec::new();
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = &mut stop => return out,
        }
        match conn.stats() {
            Some(st) => out.push(sample_json(start.elapsed().as_secs_f64(), &st)),
            None => return out,
        }
    }
}

async fn client(a: &Args, addr: SocketAddr) -> Res<i32> {
    let cfg = config(a);
    let ep = Endpoint::bind(a.bind, cfg.clone()).await?;
    let conn = ep.connect(addr)?.await?;
    let (mut tx, mut rx) = conn.open_stream()?.split();
    let region_len = a.size * a.slots;
    tx.send(Bytes::from(region_len.to_string())).await?;
    let desc = rx.next().await.ok_or("control stream ended")??;
    let remote = RemoteRegion::from_bytes(&desc).ok_or("bad region descriptor")?;
    let source = ep.register((0..region_len).map(pattern).collect(), Access::LOCAL_WRITE);

    let probe = SchedProbe::start();
    let start = Instant::now();
    let start_unix = unix_now();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
    let sampling = tokio::spawn(sampler(
        conn.clone(),
        start,
        Duration::from_millis(a.sample_ms.max(1)),
        stop_rx,
    ));
    let deadline = start + Duration::from_secs_f64(a.duration);
    let mut done_at: Vec<f64> = Vec::new();
    let mut errors = 0u64;
    let mut first_error: Option<String> = None;
    let mut posted = 0u64;
    let mut pending = FuturesUnordered::new();
    loop {
        while pending.len() < a.depth && Instant::now() < deadline {
            let slot = posted % a.slots;
            let off = slot * a.size;
            let c = conn.clone();
            let src = &source;
            pending.push(async move { c.write(src, off..off + a.size, remote, off).await });
            posted += 1;
        }
        let Some(r) = pending.next().await else { break };
        let t = start.elapsed().as_secs_f64();
        match r {
            Ok(_) => done_at.push(t),
            Err(e) => {
                errors += 1;
                first_error.get_or_insert_with(|| format!("{e} at t={t:.3}s"));
            }
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let _ = stop_tx.send(());
    let sched = probe.finish(start_unix);
    let samples = sampling.await.unwrap_or_default();
    let final_stats = conn.stats();

    // Verify: READ the destination back and compare it with the source.
    let back = ep.alloc(region_len as usize, Access::LOCAL_WRITE);
    let verified = match conn.read(&back, 0..region_len, remote, 0).await {
        Ok(_) => {
            let a_ = back.read(0, region_len)?;
            let b_ = source.read(0, region_len)?;
            a_ == b_
        }
        Err(e) => {
            first_error.get_or_insert_with(|| format!("verify READ: {e}"));
            false
        }
    };

    // Gaps between consecutive completions (and from the start to the first).
    let mut gaps: Vec<(f64, f64)> = Vec::with_capacity(done_at.len());
    let mut prev = 0.0;
    for &t in &done_at {
        gaps.push((t - prev, prev));
        prev = t;
    }
    let mut sorted: Vec<f64> = gaps.iter().map(|g| g.0).collect();
    sorted.sort_by(f64::total_cmp);
    let pct = |p: f64| -> f64 {
        if sorted.is_empty() {
            return 0.0;
        }
        sorted[((sorted.len() - 1) as f64 * p).round() as usize] * 1e3
    };
    // The first completion includes the connection's ramp-up; report it apart.
    let steady: Vec<&(f64, f64)> = gaps.iter().skip(1).collect();
    let max_gap = steady
        .iter()
        .copied()
        .max_by(|x, y| x.0.total_cmp(&y.0))
        .copied()
        .unwrap_or((0.0, 0.0));
    let mut top: Vec<(f64, f64)> = steady.iter().map(|g| **g).collect();
    top.sort_by(|x, y| y.0.total_cmp(&x.0));
    top.truncate(5);

    let bytes = done_at.len() as u64 * a.size;
    let bin = a.bin_ms.max(1) as f64 / 1e3;
    let nbins = (elapsed / bin).ceil() as usize;
    let mut timeline = vec![0u64; nbins.max(1)];
    for &t in &done_at {
        let i = ((t / bin) as usize).min(timeline.len() - 1);
        timeline[i] += a.size;
    }
    let summary = json!({
        "role": "client",
        "config": knobs(&cfg),
        "size": a.size,
        "depth": a.depth,
        "start_unix": start_unix,
        "elapsed_s": elapsed,
        "completions": done_at.len(),
        "bytes": bytes,
        "goodput_mbps": bytes as f64 * 8.0 / elapsed / 1e6,
        "first_completion_ms": done_at.first().map(|t| t * 1e3),
        "max_gap_ms": max_gap.0 * 1e3,
        "max_gap_at_s": max_gap.1,
        "top_gaps": top.iter().map(|g| json!({"gap_ms": g.0 * 1e3, "at_s": g.1})).collect::<Vec<_>>(),
        "gap_p50_ms": pct(0.5),
        "gap_p99_ms": pct(0.99),
        "gap_p999_ms": pct(0.999),
        "app_errors": errors,
        "first_error": first_error,
        "verified": verified,
        "sched_max_late_ms": sched["max_late_ms"],
        "stats": final_stats.as_ref().map(stats_json),
    });
    println!("{summary}");
    if let Some(path) = &a.out {
        let mut full = summary.clone();
        full["bin_ms"] = json!(a.bin_ms.max(1));
        full["timeline_bytes"] = json!(timeline);
        full["samples"] = json!(samples);
        full["completion_s"] = json!(done_at);
        full["sched"] = sched;
        full["sample_fields"] = json!(SAMPLE_FIELDS);
        std::fs::write(path, serde_json::to_vec(&full)?)?;
    }
    tx.send(Bytes::from_static(b"done")).await.ok();
    let _ = tokio::time::timeout(Duration::from_secs(2), rx.next()).await;
    Ok(if errors == 0 && verified { 0 } else { 1 })
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let r = match (args.listen, args.connect) {
        (Some(addr), _) => server(&args, addr).await.map(|()| 0),
        (None, Some(addr)) => client(&args, addr).await,
        (None, None) => Err("give --listen or --connect".into()),
    };
    match r {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("exp_stall: {e}");
            std::process::exit(2);
        }
    }
}
