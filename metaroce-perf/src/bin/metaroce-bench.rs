//! `metaroce-bench`: metaroce beside its peers on loopback, in one invocation.
//!
//! ```text
//! cargo build --release -p metaroce-perf
//! target/release/metaroce-bench --reps 3 --out_json bench.json
//! ```
//!
//! Each repetition runs every measure once, in an order rotated by one per repetition (so a
//! neighbour's load or a warm cache does not always favour the same measure); the figure of
//! a measure is the median of its repetitions. Measures:
//!
//! | name | what |
//! |---|---|
//! | `metaroce_bulk_{udp,uring}` | `metaroce-perf write_bw -s 1048576 -n 1024 --paths 8 --backend B`: Gbit/s |
//! | `metaroce_rate64_{udp,uring}` | `metaroce-perf write_bw -s 64 -n 200000 --paths 8 --backend B`: 64 B WRITEs (one data packet each) per second |
//! | `metaroce_rate64q_{udp,uring}` | the same with `-Q 16`: the WRITEs posted as lists of 16 with one completion each (`Connection::write_batch`, perftest's `--cq-mod`): 64 B WRITEs per second |
//! | `metaroce_rate64_{udp,uring}_cpu` | the run of `metaroce_rate64_*` with `-n 1000000`: 64 B WRITEs per CPU-second of the `metaroce-perf` process (user + system time of both endpoints, setup included) |
//! | `metaroce_bulk_{udp,uring}_cpu` | the same run as `metaroce_bulk_*`, again: Gbit per CPU-second of the process |
//! | `metaroce_rtt64_{udp,uring}` | `metaroce-perf send_lat -s 64 -n 10000 --backend B`: RTT = 2 × typical one-way, µs |
//! | `tcp_bulk` | kernel TCP, one stream: `iperf3 -c` for 3 s when iperf3 is installed, else an in-tree tokio blaster (1 GiB in 1 MiB writes, both sides tasks on the 2-worker runtime): Gbit/s |
//! | `tcp_rtt64` | tokio TCP ping-pong (`TCP_NODELAY`), 64 B, 10,000 round trips, both sides tasks on the 2-worker runtime (as in `metaroce-perf`): median RTT, µs |
//! | `udp_gso_bulk` | raw UDP blaster, GSO sends of 15 × 4096 B, GRO receives (quinn-udp), at most 2 MiB ahead of the receiver, 1 GiB: received Gbit/s |
//! | `udp_rtt64` | tokio UDP ping-pong, 64 B, 10,000 round trips, both sides tasks on the 2-worker runtime: median RTT, µs |
//! | `udp_rate64` | raw UDP blaster, 64 B datagrams (GSO batches of 64): received datagrams/s |
//! | `metaroce_conns8_shards{1,2}` | in process: 8 connections, bulk 1 MiB WRITEs (4 in flight each, 1 GiB in all), both endpoints with `Config::shards` = 1 or 2, the client on the 2-worker runtime, the server on its own 2-worker runtime: aggregate Gbit/s |
//! | `backend_rate{64,4096}_{udp,uring,uring_nojoin}[_cpu]` | the backends alone, in process, no transport: 8 path sockets send 64 B (or 4096 B) datagrams in driver-like batches of 32 (`poll_send_owned` each, then `flush`), at most 2 MiB ahead of the receiver (`uring_nojoin`: `UringConfig::coalesce = false`, one `sendmsg` per datagram), which takes them with `poll_recv_in_place` (io_uring) or `poll_recv` (UDP); 2,000,000 (500,000) datagrams: received datagrams/s, and per CPU-second of this process (`_cpu`) |
//! | `core_rate_{64,4096}` | `cargo bench -p metaroce --bench core_rate -- --json` when that bench exists in the source tree: data packets (WRITE packets, the work; ACKs are not counted) per second of CPU time, both endpoints in one thread; the bench's JSON also names the old core's figure (`baseline_data_packets_per_s`, commit `d176bb7`), the denominator of P3 |
//!
//! The tokio peers use a 2-worker multi-thread runtime, as `metaroce-perf` does.
//! `metaroce-perf`'s bandwidth tests run their in-process server on a one-worker runtime of
//! its own thread, as a separate server process would; the TCP blaster does better with
//! both sides on one runtime, and keeps that. Printed
//! ratios: P1 = metaroce bulk / TCP bulk, P2 = metaroce RTT / UDP RTT, P3 = core rate at 64 B /
//! the old core's (recorded in `benches/core_rate.rs`), io_uring / UDP backend
//! at 64 B and in bulk, per second and per CPU-second (the fair one when the end-to-end
//! figure is bound by the core's CPU or by a neighbour's load). Figures are measurements of a shared machine: the load average at
//! start and end is printed and stored in the JSON.

use std::collections::BTreeMap;
use std::io::{IoSliceMut, Read};
use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Side-by-side loopback benchmark: metaroce (both backends) against kernel TCP, raw UDP and
/// the in-memory core rate. See the crate docs of this binary for the measures.
#[derive(Debug, Parser)]
#[command(name = "metaroce-bench", version)]
struct Args {
    /// Repetitions of every measure (interleaved); figures are medians.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Smaller runs (1/4 of the bytes and iterations), for a quick look.
    #[arg(long)]
    quick: bool,
    /// Write the results as JSON to this file.
    #[arg(long = "out_json", value_name = "PATH")]
    out_json: Option<PathBuf>,
    /// Only the measures whose name contains one of these (comma-separated).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Most seconds one child run may take.
    #[arg(long, default_value_t = 180)]
    run_timeout: u64,
}

#[derive(Debug, Clone, Serialize)]
struct Sample {
    value: f64,
    /// Retransmitted packets (metaroce runs), lost datagrams (raw UDP), else 0.
    retransmits: u64,
    /// Packets the figure rests on (datagrams, round trips), when known.
    packets: u64,
}

#[derive(Debug, Serialize)]
struct MeasureOut {
    name: &'static str,
    unit: &'static str,
    command: String,
    median: Option<f64>,
    samples: Vec<Sample>,
    errors: Vec<String>,
}

#[derive(Debug, Serialize)]
struct Ratio {
    name: &'static str,
    numerator: &'static str,
    denominator: &'static str,
    value: Option<f64>,
    target: &'static str,
}

#[derive(Debug, Serialize)]
struct Doc {
    commit: Option<String>,
    reps: usize,
    quick: bool,
    loadavg_start: Option<String>,
    loadavg_end: Option<String>,
    kernel: Option<String>,
    tcp_peer: &'static str,
    measures: Vec<MeasureOut>,
    ratios: Vec<Ratio>,
}

type Runner = Box<dyn Fn(&Ctx) -> Result<Sample, String>>;

struct Measure {
    name: &'static str,
    unit: &'static str,
    command: String,
    run: Runner,
}

struct Ctx {
    perf: PathBuf,
    timeout: Duration,
    scale: u64,
    rt: tokio::runtime::Runtime,
}

fn loadavg() -> Option<String> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    Some(s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

fn command_output(cmd: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(cmd).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Runs `exe args`, killing it after `timeout`; returns its stdout or why it failed.
fn run_child(exe: &Path, args: &[String], timeout: Duration) -> Result<String, String> {
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", exe.display()))?;
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let _ = r.read_to_string(&mut s);
            }
            s
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break Some(st),
            Ok(None) if start.elapsed() < timeout => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    match status {
        Some(st) if st.success() => Ok(stdout),
        Some(st) => Err(format!(
            "{} exited with {st}: {}",
            exe.display(),
            stderr.trim()
        )),
        None => Err(format!("{} killed after {timeout:?}", exe.display())),
    }
}

/// One `metaroce-perf` run with `--out_json_file` (its `bw` / `latency` sections); `pick` reads the figure from the document.
fn perf_run(
    ctx: &Ctx,
    args: &[String],
    pick: impl Fn(&serde_json::Value) -> Option<(f64, u64)>,
) -> Result<Sample, String> {
    let json = std::env::temp_dir().join(format!(
        "metaroce-bench-{}-{}.json",
        std::process::id(),
        rand_suffix()
    ));
    let mut a = args.to_vec();
    a.push("--out_json_file".into());
    a.push(json.display().to_string());
    let res = run_child(&ctx.perf, &a, ctx.timeout);
    let doc = std::fs::read_to_string(&json)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
    let _ = std::fs::remove_file(&json);
    res?;
    let doc = doc.ok_or("no JSON report")?;
    if doc["verified"].as_bool() == Some(false) {
        return Err("the data did not verify".into());
    }
    let (value, packets) = pick(&doc).ok_or("figure missing from the JSON report")?;
    Ok(Sample {
        value,
        retransmits: doc["retransmits"].as_u64().unwrap_or(0),
        packets,
    })
}

/// CPU seconds in `/proc/self/stat`: the sum of the two tick fields at `index` and
/// `index + 1`, counting from the field after the command name's closing parenthesis
/// (field 3, state, is index 0), in USER_HZ = 100 ticks per second (the unit Linux uses
/// there whatever the kernel's HZ); 0 where unreadable.
fn proc_stat_cpu_s(index: usize) -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    (tick(index) + tick(index + 1)) as f64 / 100.0
}

/// User + system CPU seconds of this process's waited-for children so far (fields 16
/// and 17 of `/proc/self/stat`, `cutime` + `cstime`).
fn children_cpu_s() -> f64 {
    proc_stat_cpu_s(13)
}

/// User + system CPU seconds of this process so far (fields 14 and 15 of
/// `/proc/self/stat`, `utime` + `stime`).
fn self_cpu_s() -> f64 {
    proc_stat_cpu_s(11)
}

/// [`perf_run`], with the figure divided by the child's CPU seconds: `per(doc)` is the
/// amount (packets, Gbit) the run moved.
fn perf_run_per_cpu(
    ctx: &Ctx,
    args: &[String],
    per: impl Fn(&serde_json::Value) -> Option<(f64, u64)>,
) -> Result<Sample, String> {
    let before = children_cpu_s();
    let s = perf_run(ctx, args, per)?;
    let cpu = children_cpu_s() - before;
    if cpu <= 0.0 {
        return Err("no CPU time recorded for the child".into());
    }
    Ok(Sample {
        value: s.value / cpu,
        ..s
    })
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    h.finish()
}

fn strings(s: &str) -> Vec<String> {
    s.split_whitespace().map(String::from).collect()
}

/// The figure a [`perf_run`] reads from `metaroce-perf`'s JSON report: (value, packets).
type Pick = fn(&serde_json::Value) -> Option<(f64, u64)>;

/// A measure of one `metaroce-perf` run with `args` (`per_cpu`: its figure divided by the
/// child's CPU seconds, [`perf_run_per_cpu`]), the figure read by `pick`.
fn perf_measure(
    name: String,
    unit: &'static str,
    args: String,
    per_cpu: bool,
    pick: Pick,
) -> Measure {
    Measure {
        name: Box::leak(name.into()),
        unit,
        command: format!("metaroce-perf {args}"),
        run: Box::new(move |ctx| {
            if per_cpu {
                perf_run_per_cpu(ctx, &strings(&args), pick)
            } else {
                perf_run(ctx, &strings(&args), pick)
            }
        }),
    }
}

fn metaroce_measures(scale: u64) -> Vec<Measure> {
    let mut v = Vec::new();
    for be in ["udp", "uring"] {
        let bulk = format!(
            "write_bw -s 1048576 -n {} --paths 8 --backend {be}",
            1024 / scale
        );
        let rate = format!(
            "write_bw -s 64 -n {} --paths 8 --backend {be}",
            200_000 / scale
        );
        // Five times the iterations, so that the process's setup (runtime, sockets, regions)
        // weighs little in its CPU time.
        let rate_cpu = format!(
            "write_bw -s 64 -n {} --paths 8 --backend {be}",
            1_000_000 / scale
        );
        let rate_q = format!(
            "write_bw -s 64 -n {} --paths 8 --backend {be} -Q 16",
            200_000 / scale
        );
        let lat = format!("send_lat -s 64 -n {} --backend {be}", 10_000 / scale);
        v.push(perf_measure(
            format!("metaroce_bulk_{be}"),
            "Gbit/s",
            bulk.clone(),
            false,
            |d| {
                let r = &d["bw"][0];
                Some((
                    r["bw_avg_gbit_per_sec"].as_f64()?,
                    r["iterations"].as_u64()? * 256,
                ))
            },
        ));
        // WRITEs per second, one by one and in lists of 16.
        for (name, args) in [("rate64", rate), ("rate64q", rate_q)] {
            v.push(perf_measure(
                format!("metaroce_{name}_{be}"),
                "packets/s",
                args,
                false,
                |d| {
                    let r = &d["bw"][0];
                    Some((
                        r["msg_rate_mpps"].as_f64()? * 1e6,
                        r["iterations"].as_u64()?,
                    ))
                },
            ));
        }
        v.push(perf_measure(
            format!("metaroce_bulk_{be}_cpu"),
            "Gbit/CPU-s",
            bulk,
            true,
            |d| {
                let it = d["bw"][0]["iterations"].as_u64()?;
                Some((it as f64 * 1048576.0 * 8.0 / 1e9, it * 256))
            },
        ));
        v.push(perf_measure(
            format!("metaroce_rate64_{be}_cpu"),
            "packets/CPU-s",
            rate_cpu,
            true,
            |d| {
                let it = d["bw"][0]["iterations"].as_u64()?;
                Some((it as f64, it))
            },
        ));
        v.push(perf_measure(
            format!("metaroce_rtt64_{be}"),
            "us RTT",
            lat,
            false,
            |d| {
                let l = &d["latency"][0];
                Some((l["t_typical_usec"].as_f64()? * 2.0, l["samples"].as_u64()?))
            },
        ));
    }
    v
}

/// 8 connections between two endpoints with `shards` shards each (issue #13 item 4): the
/// client on the 2-worker runtime `ctx.rt`, the server on its own 2-worker runtime; every
/// connection WRITEs 1 MiB messages, 4 in flight, into its own slot of one server region,
/// `total` bytes in all. Aggregate goodput in Gbit/s; the slots are verified at the end.
fn conns_bulk(ctx: &Ctx, shards: usize, total: u64) -> Result<Sample, String> {
    use futures::StreamExt;
    use metaroce_tokio::{Access, Config, Endpoint};
    const CONNS: usize = 8;
    const MSG: usize = 1 << 20;
    const DEPTH: usize = 4;
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let srt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|x| e(&x))?;
    let cfg = Config {
        shards,
        ..Config::default()
    };
    let any: SocketAddr = "127.0.0.1:0".parse().map_err(|x| e(&x))?;
    let server = srt
        .block_on(Endpoint::bind(any, cfg.clone()))
        .map_err(|x| e(&x))?;
    if server.shards() != shards {
        return Err(format!(
            "server runs {} shards, not {shards}",
            server.shards()
        ));
    }
    let target = server.alloc(CONNS * MSG, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let remote = target.remote();
    let s2 = server.clone();
    let acceptor = srt.spawn(async move {
        let mut v = Vec::new();
        while v.len() < CONNS {
            match s2.accept().await {
                Some(i) => v.extend(i.accept().ok()),
                None => break,
            }
        }
        v
    });
    let per_conn = (total / CONNS as u64 / MSG as u64).max(1);
    let saddr = server.local_addr();
    let data: Vec<Vec<u8>> = (0..CONNS)
        .map(|i| {
            (0..MSG)
                .map(|k| (k * 7 + i * 13 + k / 4096) as u8)
                .collect()
        })
        .collect();
    let want = data.clone();
    let (secs, retx) = ctx.rt.block_on(async move {
        let client = Endpoint::bind(any, cfg).await.map_err(|x| e(&x))?;
        let mut conns = Vec::new();
        for _ in 0..CONNS {
            let c = client
                .connect(saddr)
                .map_err(|x| e(&x))?
                .await
                .map_err(|x| e(&x))?;
            conns.push(c);
        }
        let start = Instant::now();
        let mut tasks = Vec::new();
        for (i, (c, d)) in conns.iter().zip(data).enumerate() {
            let c = c.clone();
            let src = Arc::new(client.register(d, Access::LOCAL_WRITE));
            tasks.push(tokio::spawn(async move {
                let off = (i * MSG) as u64;
                let mut results = futures::stream::iter(0..per_conn)
                    .map(|_| c.write(&src, 0..MSG as u64, remote, off))
                    .buffer_unordered(DEPTH);
                while let Some(r) = results.next().await {
                    r.map_err(|x| x.to_string())?;
                }
                Ok::<(), String>(())
            }));
        }
        for t in tasks {
            t.await.map_err(|x| e(&x))??;
        }
        let secs = start.elapsed().as_secs_f64();
        let retx: u64 = conns
            .iter()
            .filter_map(|c| c.stats())
            .flat_map(|s| s.paths.into_iter().map(|p| p.stats.retransmits))
            .sum();
        client.close(0, b"");
        client.wait_idle().await;
        Ok::<(f64, u64), String>((secs, retx))
    })?;
    let _ = srt.block_on(acceptor);
    for (i, w) in want.iter().enumerate() {
        if target
            .read((i * MSG) as u64, MSG as u64)
            .map_err(|x| e(&x))?
            != *w
        {
            return Err(format!("slot {i} did not verify"));
        }
    }
    drop(target);
    server.close(0, b"");
    srt.block_on(server.wait_idle());
    let bytes = per_conn * CONNS as u64 * MSG as u64;
    Ok(Sample {
        value: bytes as f64 * 8.0 / secs / 1e9,
        retransmits: retx,
        packets: bytes / 4096,
    })
}

fn shard_measures(scale: u64) -> Vec<Measure> {
    let total = (1u64 << 30) / scale;
    [1usize, 2]
        .into_iter()
        .map(|n| Measure {
            name: if n == 1 {
                "metaroce_conns8_shards1"
            } else {
                "metaroce_conns8_shards2"
            },
            unit: "Gbit/s",
            command: format!(
                "in-process: 8 connections, 1 MiB WRITEs, 4 in flight each, {total} bytes, Config::shards = {n} on both ends, 2 + 2 tokio workers"
            ),
            run: Box::new(move |ctx| conns_bulk(ctx, n, total)),
        })
        .collect()
}

/// Median of RTT samples, in µs.
fn median_us(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v.get(v.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1e6)
}

/// The in-tree TCP blaster, both sides tasks on the bench's 2-worker runtime. (With its
/// receiver on a runtime and thread of its own, as `metaroce-perf`'s bandwidth tests run
/// their server, it measured 22.2–31.4 Gbit/s against 24.6–33.8 in 5 interleaved pairs:
/// P1 is taken against TCP's better arrangement.)
async fn tcp_bulk(total: u64) -> std::io::Result<Sample> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0u64;
        loop {
            let n = s.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            got += n as u64;
        }
        Ok::<_, std::io::Error>((got, Instant::now()))
    });
    let start = Instant::now();
    let mut c = tokio::net::TcpStream::connect(addr).await?;
    let buf = vec![0x5au8; 1 << 20];
    let mut sent = 0;
    while sent < total {
        c.write_all(&buf).await?;
        sent += buf.len() as u64;
    }
    c.shutdown().await?;
    drop(c);
    let (got, end) = server.await.map_err(std::io::Error::other)??;
    let secs = (end - start).as_secs_f64();
    Ok(Sample {
        value: got as f64 * 8.0 / secs / 1e9,
        retransmits: 0,
        packets: got / 65_536,
    })
}

fn iperf3_bulk(ctx: &Ctx) -> Result<Sample, String> {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        l.local_addr().map_err(|e| e.to_string())?.port()
    };
    let mut server = Command::new("iperf3")
        .args(["-s", "-1", "-B", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("iperf3 -s: {e}"))?;
    std::thread::sleep(Duration::from_millis(300));
    let secs = if ctx.scale > 1 { 1 } else { 3 };
    let out = run_child(
        Path::new("iperf3"),
        &strings(&format!("-c 127.0.0.1 -p {port} -t {secs} -J")),
        ctx.timeout,
    );
    let _ = server.kill();
    let _ = server.wait();
    let v: serde_json::Value = serde_json::from_str(&out?).map_err(|e| e.to_string())?;
    let bps = v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .ok_or("iperf3: no end.sum_received")?;
    Ok(Sample {
        value: bps / 1e9,
        retransmits: v["end"]["sum_sent"]["retransmits"].as_u64().unwrap_or(0),
        packets: 0,
    })
}

async fn tcp_rtt(n: usize) -> std::io::Result<Sample> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        s.set_nodelay(true)?;
        let mut b = [0u8; 64];
        while s.read_exact(&mut b).await.is_ok() {
            s.write_all(&b).await?;
        }
        Ok::<_, std::io::Error>(())
    });
    let mut c = tokio::net::TcpStream::connect(addr).await?;
    c.set_nodelay(true)?;
    let mut b = [7u8; 64];
    let mut rtts = Vec::with_capacity(n);
    for i in 0..n + 100 {
        let t = Instant::now();
        c.write_all(&b).await?;
        c.read_exact(&mut b).await?;
        if i >= 100 {
            rtts.push(t.elapsed());
        }
    }
    drop(c);
    let _ = server.await;
    Ok(Sample {
        value: median_us(rtts),
        retransmits: 0,
        packets: n as u64,
    })
}

/// Run a ping-pong peer as a task on `rt`'s workers, as `metaroce-perf` runs its client and
/// server: both sides of every round-trip measure are then tasks of one 2-worker runtime
/// (the `block_on` future itself runs outside the workers, so a client there pays a
/// thread wake-up per round trip that the other tasks do not).
fn on_worker(
    rt: &tokio::runtime::Runtime,
    f: impl std::future::Future<Output = std::io::Result<Sample>> + Send + 'static,
) -> Result<Sample, String> {
    match rt.block_on(async { tokio::spawn(f).await }) {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(e) => Err(format!("the ping-pong task failed: {e}")),
    }
}

async fn udp_rtt(n: usize) -> std::io::Result<Sample> {
    let server = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
    let saddr = server.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let echo = tokio::spawn(async move {
        let mut b = [0u8; 2048];
        while !stop2.load(Ordering::Relaxed) {
            let Ok(Ok((len, from))) =
                tokio::time::timeout(Duration::from_millis(200), server.recv_from(&mut b)).await
            else {
                continue;
            };
            let _ = server.send_to(&b[..len], from).await;
        }
    });
    let c = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
    c.connect(saddr).await?;
    let mut b = [7u8; 64];
    let mut rtts = Vec::with_capacity(n);
    let mut lost = 0;
    for i in 0..n + 100 {
        let t = Instant::now();
        c.send(&b[..64]).await?;
        match tokio::time::timeout(Duration::from_millis(100), c.recv(&mut b)).await {
            Ok(r) => {
                r?;
            }
            Err(_) => {
                lost += 1;
                continue;
            }
        }
        if i >= 100 {
            rtts.push(t.elapsed());
        }
    }
    stop.store(true, Ordering::Relaxed);
    let _ = echo.await;
    Ok(Sample {
        value: median_us(rtts),
        retransmits: lost,
        packets: n as u64,
    })
}

/// Raw UDP blaster: `total` bytes in datagrams of `seg` bytes, GSO batches of `batch`
/// datagrams (quinn-udp, so GSO/GRO as the UDP backend has them); returns the receiver's
/// figure: Gbit/s (`per_packet == false`) or datagrams/s.
fn udp_blast(total: u64, seg: usize, batch: usize, per_packet: bool) -> std::io::Result<Sample> {
    use quinn_udp::{RecvMeta, Transmit, UdpSockRef, UdpSocketState};
    let bind = |rcv: usize| -> std::io::Result<(UdpSocket, UdpSocketState)> {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None)?;
        s.set_recv_buffer_size(rcv)?;
        s.set_send_buffer_size(8 << 20)?;
        s.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())?;
        let s: UdpSocket = s.into();
        let st = UdpSocketState::new(UdpSockRef::from(&s))?;
        Ok((s, st))
    };
    let (rx, rx_state) = bind(8 << 20)?;
    rx.set_read_timeout(Some(Duration::from_millis(200)))?;
    let (tx, tx_state) = bind(1 << 16)?;
    let dest = rx.local_addr()?;
    let done = Arc::new(AtomicBool::new(false));
    let done2 = done.clone();
    // Received bytes, for the sender's window: at most WINDOW bytes in flight, well below
    // the receive buffer, so that the kernel drops nothing and the figure is the rate both
    // ends sustain (a blaster without a window measures mostly drops on a busy machine).
    const WINDOW: u64 = 2 << 20;
    let acked = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let acked2 = acked.clone();
    let receiver = std::thread::spawn(move || {
        let mut bufs = vec![vec![0u8; 1 << 16]; quinn_udp::BATCH_SIZE.min(8)];
        let mut meta = vec![RecvMeta::default(); bufs.len()];
        let (mut bytes, mut dgrams) = (0u64, 0u64);
        let mut last = Instant::now();
        loop {
            let mut io: Vec<IoSliceMut<'_>> = bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
            match rx_state.recv(UdpSockRef::from(&rx), &mut io, &mut meta) {
                Ok(n) => {
                    for m in &meta[..n] {
                        bytes += m.len as u64;
                        dgrams += m.len.div_ceil(m.stride.max(1)) as u64;
                    }
                    acked2.store(bytes, Ordering::Release);
                    last = Instant::now();
                }
                Err(_) if done2.load(Ordering::Relaxed) => break,
                Err(_) => {}
            }
        }
        (bytes, dgrams, last)
    });
    let contents: Vec<u8> = (0..seg * batch).map(|i| i as u8).collect();
    let start = Instant::now();
    let mut sent = 0u64;
    let mut sent_dgrams = 0u64;
    let gso = tx_state.max_gso_segments() > 1;
    while sent < total {
        while sent.saturating_sub(acked.load(Ordering::Acquire)) > WINDOW {
            if start.elapsed() > Duration::from_secs(60) {
                break;
            }
            std::thread::yield_now();
        }
        let t = Transmit {
            destination: dest,
            ecn: None,
            contents: if gso { &contents } else { &contents[..seg] },
            segment_size: gso.then_some(seg),
            src_ip: None,
        };
        // A blocking socket: send waits for room in the send buffer.
        if tx_state.send(UdpSockRef::from(&tx), &t).is_ok() {
            sent += t.contents.len() as u64;
            sent_dgrams += t.contents.len().div_ceil(seg) as u64;
        }
    }
    done.store(true, Ordering::Relaxed);
    let (bytes, dgrams, last) = receiver
        .join()
        .map_err(|_| std::io::Error::other("receiver panicked"))?;
    let secs = (last - start).as_secs_f64().max(1e-9);
    Ok(Sample {
        value: if per_packet {
            dgrams as f64 / secs
        } else {
            bytes as f64 * 8.0 / secs / 1e9
        },
        retransmits: sent_dgrams.saturating_sub(dgrams),
        packets: dgrams,
    })
}

fn peer_measures(scale: u64, iperf: bool) -> Vec<Measure> {
    let gib = (1u64 << 30) / scale;
    let rtts = 10_000 / scale as usize;
    vec![
        Measure {
            name: "tcp_bulk",
            unit: "Gbit/s",
            command: if iperf {
                "iperf3 -c 127.0.0.1 -t 3 -J (one stream)".into()
            } else {
                format!("in-tree tokio TCP blaster, {gib} bytes in 1 MiB writes")
            },
            run: Box::new(move |ctx| {
                if iperf {
                    iperf3_bulk(ctx)
                } else {
                    ctx.rt.block_on(tcp_bulk(gib)).map_err(|e| e.to_string())
                }
            }),
        },
        Measure {
            name: "tcp_rtt64",
            unit: "us RTT",
            command: format!(
                "in-tree tokio TCP ping-pong, 64 B, TCP_NODELAY, {rtts} round trips, median"
            ),
            run: Box::new(move |ctx| on_worker(&ctx.rt, tcp_rtt(rtts))),
        },
        Measure {
            name: "udp_gso_bulk",
            unit: "Gbit/s",
            command: format!(
                "in-tree UDP blaster, GSO 15 x 4096 B, GRO receive, 2 MiB window, {gib} bytes"
            ),
            run: Box::new(move |_| udp_blast(gib, 4096, 15, false).map_err(|e| e.to_string())),
        },
        Measure {
            name: "udp_rate64",
            unit: "packets/s",
            command: format!(
                "in-tree UDP blaster, 64 B datagrams, GSO 64 x 64 B, 2 MiB window, {} datagrams",
                gib / 4096
            ),
            run: Box::new(move |_| {
                udp_blast(gib / 4096 * 64, 64, 64, true).map_err(|e| e.to_string())
            }),
        },
        Measure {
            name: "udp_rtt64",
            unit: "us RTT",
            command: format!("in-tree tokio UDP ping-pong, 64 B, {rtts} round trips, median"),
            run: Box::new(move |ctx| on_worker(&ctx.rt, udp_rtt(rtts))),
        },
    ]
}

/// The datagram backends alone (no transport): see the crate docs, `backend_rate*`.
fn backend_measures(scale: u64) -> Vec<Measure> {
    let mut v = Vec::new();
    for (size, n, base) in [
        (64usize, 2_000_000 / scale, "backend_rate64"),
        (4096, 500_000 / scale, "backend_rate4096"),
    ] {
        for be in ["udp", "uring", "uring_nojoin"] {
            for per_cpu in [false, true] {
                let name: &'static str =
                    Box::leak(format!("{base}_{be}{}", if per_cpu { "_cpu" } else { "" }).into());
                v.push(Measure {
                    name,
                    unit: if per_cpu {
                        "datagrams/CPU-s"
                    } else {
                        "datagrams/s"
                    },
                    command: format!(
                        "in-process {be} backend to {be} backend, 8 paths, {n} x {size} B, batches of 32"
                    ),
                    run: Box::new(move |ctx| {
                        let kind = if be == "udp" {
                            metaroce_tokio::backend::BackendKind::Udp
                        } else {
                            metaroce_tokio::backend::BackendKind::Uring
                        };
                        let join = be != "uring_nojoin";
                        ctx.rt
                            .block_on(backend_blast(kind, size, n, join, per_cpu))
                            .map_err(|e| e.to_string())
                    }),
                });
            }
        }
    }
    v
}

/// One backend sending `n` datagrams of `size` bytes to another of the same kind over 8
/// paths (the driver's pattern: 32 `poll_send_owned`, then `flush`), at most 2 MiB (64 to
/// 4096 datagrams) ahead of what was received (`join`: `UringConfig::coalesce`); returns received datagrams per second (or per CPU-second of the
/// process) and, as `retransmits`, the datagrams lost.
async fn backend_blast(
    kind: metaroce_tokio::backend::BackendKind,
    size: usize,
    n: u64,
    join: bool,
    per_cpu: bool,
) -> std::io::Result<Sample> {
    use metaroce_tokio::backend::{bind_backend, DatagramBackend, RecvMeta, UringConfig};
    use std::future::poll_fn;
    use std::sync::atomic::AtomicU64;
    let lo: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let cfg = UringConfig {
        coalesce: join,
        ..UringConfig::default()
    };
    // At most 2 MiB in flight (the receive buffer the backends ask for), 64 to 4096 datagrams.
    let window = ((2u64 << 20) / size as u64).clamp(64, 4096);
    let tx = bind_backend(kind, lo, 8, &cfg)?;
    let rx = bind_backend(kind, lo, 1, &cfg)?;
    if tx.kind != kind || rx.kind != kind {
        return Err(std::io::Error::other(format!(
            "backend fell back: {:?}",
            tx.fallback_reason.or(rx.fallback_reason)
        )));
    }
    let (tx, rx): (Arc<dyn DatagramBackend>, Arc<dyn DatagramBackend>) =
        (tx.backend.into(), rx.backend.into());
    let got = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let dest = rx.local_addr();
    let ports = tx.source_ports();
    let cpu0 = self_cpu_s();
    let start = Instant::now();
    let receiver = {
        let (rx, got, done) = (rx.clone(), got.clone(), done.clone());
        tokio::spawn(async move {
            let mut bufs = vec![vec![0u8; 1 << 16]; 8];
            let mut meta = [RecvMeta::EMPTY; 8];
            while !done.load(Ordering::Relaxed) {
                let r = tokio::time::timeout(
                    Duration::from_millis(200),
                    poll_fn(|cx| {
                        let mut c = 0u64;
                        if let Some(p) = rx.poll_recv_in_place(cx, 8, &mut |m, b| {
                            c += m.datagrams(b).count() as u64;
                        }) {
                            return p.map(|r| r.map(|_| c));
                        }
                        let mut s: Vec<IoSliceMut<'_>> =
                            bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
                        rx.poll_recv(cx, &mut s, &mut meta).map(|r| {
                            r.map(|k| {
                                meta[..k]
                                    .iter()
                                    .zip(&bufs)
                                    .map(|(m, b)| m.datagrams(b).count() as u64)
                                    .sum()
                            })
                        })
                    }),
                )
                .await;
                match r {
                    Ok(Ok(c)) => {
                        got.fetch_add(c, Ordering::Relaxed);
                    }
                    Ok(Err(_)) => {}
                    // Nothing for 200 ms: the rest was lost.
                    Err(_) => break,
                }
            }
        })
    };
    let mut sent = 0u64;
    let mut buf = Vec::with_capacity(size);
    let mut idle_since = None;
    // Datagrams written off as lost (the receiver made no progress for 200 ms).
    let mut lost = 0u64;
    while sent < n {
        let ahead = sent.saturating_sub(got.load(Ordering::Relaxed) + lost);
        if ahead > window {
            // Wait for the receiver; write off what was lost after 200 ms of no progress.
            let t0 = *idle_since.get_or_insert_with(Instant::now);
            if t0.elapsed() > Duration::from_millis(200) {
                lost += ahead;
                idle_since = None;
            }
            tokio::task::yield_now().await;
            continue;
        }
        idle_since = None;
        for i in 0..32u64.min(n - sent) {
            buf.clear();
            buf.resize(size, (sent + i) as u8);
            let t = metaroce::Transmit {
                destination: dest,
                src_port: ports[((sent + i) % 8) as usize],
                ecn: None,
                size,
                segment_size: None,
            };
            poll_fn(|cx| tx.poll_send_owned(cx, &t, &mut buf)).await?;
        }
        tx.flush();
        sent += 32u64.min(n - sent);
    }
    // Let the last ones arrive (the receiver stops after 200 ms without any).
    while got.load(Ordering::Relaxed) + lost < n && !receiver.is_finished() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu = self_cpu_s() - cpu0;
    done.store(true, Ordering::Relaxed);
    let _ = receiver.await;
    let received = got.load(Ordering::Relaxed).min(n);
    let value = if per_cpu {
        received as f64 / cpu.max(0.01)
    } else {
        received as f64 / secs
    };
    Ok(Sample {
        value,
        retransmits: n - received,
        packets: received,
    })
}

/// The source tree this binary was built from (for `cargo bench` and the commit).
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// The old core's rate per payload size, as the core_rate bench's JSON names it
/// (`baseline_data_packets_per_s`): the denominator of P3.
static CORE_BASELINE: std::sync::Mutex<BTreeMap<u32, f64>> = std::sync::Mutex::new(BTreeMap::new());

/// `core_rate_64` / `core_rate_4096` from the core's bench, when it exists: data packets
/// per CPU-second.
fn core_measures() -> Vec<Measure> {
    let ws = workspace();
    if !ws.join("metaroce/benches/core_rate.rs").exists() {
        return Vec::new();
    }
    [(64u32, "core_rate_64"), (4096, "core_rate_4096")]
        .into_iter()
        .map(|(size, name)| {
            let ws = ws.clone();
            Measure {
                name,
                unit: "data packets/s",
                command: format!(
                    "cargo bench -p metaroce --bench core_rate -- --json --size={size} --secs=2"
                ),
                run: Box::new(move |ctx| {
                    let out = Command::new("cargo")
                        .current_dir(&ws)
                        .args([
                            "bench",
                            "-q",
                            "-p",
                            "metaroce",
                            "--bench",
                            "core_rate",
                            "--",
                        ])
                        .arg("--json")
                        .arg(format!("--size={size}"))
                        .arg("--secs=2")
                        .stderr(Stdio::null())
                        .output()
                        .map_err(|e| format!("cargo bench: {e}"))?;
                    let _ = ctx;
                    let text = String::from_utf8_lossy(&out.stdout);
                    let line = text
                        .lines()
                        .find(|l| l.contains("\"core_rate\""))
                        .ok_or("cargo bench printed no core_rate line")?;
                    let v: serde_json::Value =
                        serde_json::from_str(line).map_err(|e| e.to_string())?;
                    if let Some(b) = v["baseline_data_packets_per_s"].as_f64() {
                        if let Ok(mut m) = CORE_BASELINE.lock() {
                            m.insert(size, b);
                        }
                    }
                    Ok(Sample {
                        value: v["data_packets_per_s"]
                            .as_f64()
                            .ok_or("no data_packets_per_s")?,
                        retransmits: v["retransmits"].as_u64().unwrap_or(0),
                        packets: v["data_packets"].as_u64().unwrap_or(0),
                    })
                }),
            }
        })
        .collect()
}

fn median(v: &[Sample]) -> Option<f64> {
    let mut x: Vec<f64> = v.iter().map(|s| s.value).collect();
    x.sort_by(f64::total_cmp);
    match x.len() {
        0 => None,
        n if n % 2 == 1 => Some(x[n / 2]),
        n => Some((x[n / 2 - 1] + x[n / 2]) / 2.0),
    }
}

fn main() {
    let args = Args::parse();
    let scale = if args.quick { 4 } else { 1 };
    let perf = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("metaroce-perf")))
        .filter(|p| p.exists());
    let Some(perf) = perf else {
        eprintln!("metaroce-bench: metaroce-perf is not beside this executable; build the package (cargo build --release -p metaroce-perf)");
        std::process::exit(2);
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("metaroce-bench: cannot start the runtime: {e}");
            std::process::exit(2);
        }
    };
    let ctx = Ctx {
        perf,
        timeout: Duration::from_secs(args.run_timeout),
        scale,
        rt,
    };
    let iperf = command_output("iperf3", &["--version"]).is_some();
    let mut measures = metaroce_measures(scale);
    measures.extend(peer_measures(scale, iperf));
    measures.extend(shard_measures(scale));
    measures.extend(core_measures());
    measures.extend(backend_measures(scale));
    if !args.only.is_empty() {
        measures.retain(|m| args.only.iter().any(|o| m.name.contains(o.as_str())));
    }
    let commit = command_output(
        "git",
        &[
            "-C",
            &workspace().display().to_string(),
            "rev-parse",
            "--short",
            "HEAD",
        ],
    );
    let load_start = loadavg();
    println!(
        "metaroce-bench: commit {}, {} repetitions, load average at start {}",
        commit.as_deref().unwrap_or("?"),
        args.reps,
        load_start.as_deref().unwrap_or("?")
    );
    let mut samples: Vec<Vec<Sample>> = measures.iter().map(|_| Vec::new()).collect();
    let mut errors: Vec<Vec<String>> = measures.iter().map(|_| Vec::new()).collect();
    for rep in 0..args.reps {
        for k in 0..measures.len() {
            let i = (k + rep) % measures.len();
            let m = &measures[i];
            match (m.run)(&ctx) {
                Ok(s) => {
                    println!(
                        "  rep {} {:<22} {:>14.3} {} ({} retransmits)",
                        rep + 1,
                        m.name,
                        s.value,
                        m.unit,
                        s.retransmits
                    );
                    samples[i].push(s);
                }
                Err(e) => {
                    println!("  rep {} {:<22} FAILED: {e}", rep + 1, m.name);
                    errors[i].push(e);
                }
            }
        }
    }
    let load_end = loadavg();
    let outs: Vec<MeasureOut> = measures
        .iter()
        .zip(samples)
        .zip(errors)
        .map(|((m, s), e)| MeasureOut {
            name: m.name,
            unit: m.unit,
            command: m.command.clone(),
            median: median(&s),
            samples: s,
            errors: e,
        })
        .collect();
    let mut by: BTreeMap<&str, f64> = outs
        .iter()
        .filter_map(|m| Some((m.name, m.median?)))
        .collect();
    // P3's denominator: the old core's figure, recorded in the core_rate bench.
    if let Some(b) = CORE_BASELINE.lock().ok().and_then(|m| m.get(&64).copied()) {
        by.insert("core_rate_64_d176bb7", b);
    }
    let ratio = |name, num, den, target| Ratio {
        name,
        numerator: num,
        denominator: den,
        value: by.get(num).zip(by.get(den)).map(|(a, b)| a / b),
        target,
    };
    let ratios = vec![
        ratio(
            "P1 bulk vs kernel TCP (udp backend)",
            "metaroce_bulk_udp",
            "tcp_bulk",
            ">= 1.0",
        ),
        ratio(
            "P1 bulk vs kernel TCP (uring backend)",
            "metaroce_bulk_uring",
            "tcp_bulk",
            ">= 1.0",
        ),
        ratio(
            "P2 64 B RTT vs UDP ping-pong (udp backend)",
            "metaroce_rtt64_udp",
            "udp_rtt64",
            "<= 1.15",
        ),
        ratio(
            "P2 64 B RTT vs UDP ping-pong (uring backend)",
            "metaroce_rtt64_uring",
            "udp_rtt64",
            "<= 1.15",
        ),
        ratio(
            "P3 core rate, 64 B data packets vs d176bb7",
            "core_rate_64",
            "core_rate_64_d176bb7",
            ">= 3.0",
        ),
        ratio(
            "io_uring / UDP backend, 64 B packets/s",
            "metaroce_rate64_uring",
            "metaroce_rate64_udp",
            ">= 1.2",
        ),
        ratio(
            "io_uring / UDP backend, 64 B packets/s, -Q 16",
            "metaroce_rate64q_uring",
            "metaroce_rate64q_udp",
            ">= 1.2",
        ),
        ratio(
            "64 B WRITEs/s, lists of 16 vs one by one (udp)",
            "metaroce_rate64q_udp",
            "metaroce_rate64_udp",
            "-",
        ),
        ratio(
            "io_uring / UDP backend, bulk",
            "metaroce_bulk_uring",
            "metaroce_bulk_udp",
            ">= 1.0",
        ),
        ratio(
            "io_uring / UDP backend, 64 B packets per CPU-second",
            "metaroce_rate64_uring_cpu",
            "metaroce_rate64_udp_cpu",
            ">= 1.2",
        ),
        ratio(
            "io_uring / UDP backend, bulk per CPU-second",
            "metaroce_bulk_uring_cpu",
            "metaroce_bulk_udp_cpu",
            ">= 1.0",
        ),
        ratio(
            "io_uring / UDP, backends alone, 64 B datagrams/s",
            "backend_rate64_uring",
            "backend_rate64_udp",
            "-",
        ),
        ratio(
            "io_uring / UDP, backends alone, 64 B per CPU-second",
            "backend_rate64_uring_cpu",
            "backend_rate64_udp_cpu",
            "-",
        ),
        ratio(
            "io_uring without GSO joining / UDP, alone, 64 B per CPU-s",
            "backend_rate64_uring_nojoin_cpu",
            "backend_rate64_udp_cpu",
            "-",
        ),
        ratio(
            "io_uring / UDP, backends alone, 4096 B datagrams/s",
            "backend_rate4096_uring",
            "backend_rate4096_udp",
            "-",
        ),
        ratio(
            "io_uring / UDP, backends alone, 4096 B per CPU-second",
            "backend_rate4096_uring_cpu",
            "backend_rate4096_udp_cpu",
            "-",
        ),
        ratio(
            "bulk vs raw UDP GSO/GRO (udp backend)",
            "metaroce_bulk_udp",
            "udp_gso_bulk",
            "-",
        ),
        ratio(
            "64 B packets/s vs raw UDP (udp backend)",
            "metaroce_rate64_udp",
            "udp_rate64",
            "-",
        ),
        ratio("TCP RTT vs UDP RTT", "tcp_rtt64", "udp_rtt64", "-"),
        ratio(
            "8 connections, 2 shards vs 1 (2-worker runtime)",
            "metaroce_conns8_shards2",
            "metaroce_conns8_shards1",
            "> 1.0",
        ),
    ];
    println!();
    println!(" {:<24} {:>14} {:<12} samples", "measure", "median", "unit");
    for m in &outs {
        let med = m.median.map_or("-".into(), |v| format!("{v:.3}"));
        let s: Vec<String> = m
            .samples
            .iter()
            .map(|s| format!("{:.3}", s.value))
            .collect();
        println!(
            " {:<24} {:>14} {:<12} [{}]",
            m.name,
            med,
            m.unit,
            s.join(", ")
        );
    }
    println!();
    for r in &ratios {
        let v = r.value.map_or("-".into(), |v| format!("{v:.2}x"));
        println!(" {:<46} {:>8}   target {}", r.name, v, r.target);
    }
    println!(
        " tcp_bulk peer: {}; load average at end {}",
        if iperf {
            "iperf3"
        } else {
            "in-tree tokio blaster"
        },
        load_end.as_deref().unwrap_or("?")
    );
    if let Some(p) = &args.out_json {
        let doc = Doc {
            commit,
            reps: args.reps,
            quick: args.quick,
            loadavg_start: load_start,
            loadavg_end: load_end,
            kernel: command_output("uname", &["-r"]),
            tcp_peer: if iperf { "iperf3" } else { "tokio" },
            measures: outs,
            ratios,
        };
        match serde_json::to_string_pretty(&doc) {
            Ok(t) => {
                if let Err(e) = std::fs::write(p, t + "\n") {
                    eprintln!("metaroce-bench: {}: {e}", p.display());
                    std::process::exit(1);
                }
            }
            Err(e) => {
                eprintln!("metaroce-bench: {e}");
                std::process::exit(1);
            }
        }
    }
}
