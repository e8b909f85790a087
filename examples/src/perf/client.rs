//! The client side of a run: drives the measurement and prints the table.

use super::cli::{Settings, Test};
use super::data::{derive_seed, random_bytes};
use super::proto::Ctrl;
use super::report;
use super::stats::{BwMeter, BwResult, LatStats};
use super::Res;
use bytes::Bytes;
use futures::stream::FuturesUnordered;
use futures::{SinkExt, StreamExt};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use metaroce::{Access, ConnectionStats};
use metaroce_tokio::{Connection, MemoryRegion, MessageStream};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// The destination of one write_bw size is at most this many bytes (unless one WRITE is
/// larger): slots = min(iterations, max(1, 1 GiB / size)).
pub const MAX_SLOTS_BYTES: u64 = 1 << 30;

/// send_lat ping-pongs before the measured ones (not reported).
const WARMUP: u64 = 10;

/// One write_bw row.
#[derive(Debug, Clone)]
pub struct BwRow {
    /// Bytes per WRITE.
    pub size: u64,
    /// Measurement.
    pub result: BwResult,
    /// Destination slots (distinct WRITE targets).
    pub slots: u64,
    /// CRC-32 of what was written (source side).
    pub src_crc: u32,
    /// CRC-32 the server computed over its destination.
    pub dst_crc: u32,
    /// Bytes checksummed.
    pub check_len: u64,
}

impl BwRow {
    /// Whether the destination matches the source.
    pub fn ok(&self) -> bool {
        self.src_crc == self.dst_crc
    }
}

/// One send_lat row.
#[derive(Debug, Clone)]
pub struct LatRow {
    /// Message size.
    pub size: u64,
    /// Measured iterations.
    pub iterations: u64,
    /// Statistics of the one-way latency.
    pub stats: Option<LatStats>,
    /// Echoes that differed from what was sent.
    pub mismatches: u64,
}

/// What the client measured.
#[derive(Debug, Clone, Default)]
pub struct ClientRun {
    /// Server's QPN.
    pub server_qpn: u32,
    /// write_bw rows.
    pub bw: Vec<BwRow>,
    /// send_lat rows.
    pub lat: Vec<LatRow>,
    /// The connection's statistics at the end.
    pub stats: Option<ConnectionStats>,
}

impl ClientRun {
    /// Whether every checksum and every echo matched.
    pub fn verified(&self) -> bool {
        self.bw.iter().all(BwRow::ok) && self.lat.iter().all(|r| r.mismatches == 0)
    }
}

/// How one write_bw size is laid out.
#[derive(Debug, Clone, Copy)]
struct Plan {
    /// WRITEs to post; `None` for a timed run.
    ops: Option<u64>,
    /// Destination slots.
    slots: u64,
    /// Destination (and source) bytes used.
    region_len: u64,
}

fn plan(s: &Settings, size: u64) -> Plan {
    match &s.file {
        Some(f) => {
            let len = f.data.len() as u64;
            let ops = len.div_ceil(size);
            Plan {
                ops: Some(ops),
                slots: ops,
                region_len: len,
            }
        }
        None => {
            let slots = (MAX_SLOTS_BYTES / size)
                .max(1)
                .min(s.iters.unwrap_or(u64::MAX));
            Plan {
                ops: s.iters,
                slots,
                region_len: slots * size,
            }
        }
    }
}

async fn send(ctrl: &mut MessageStream, m: Ctrl) -> Res<()> {
    ctrl.send(m.encode())
        .await
        .map_err(|e| format!("sending a control message: {e}"))
}

async fn recv(ctrl: &mut MessageStream) -> Res<Ctrl> {
    let msg = ctrl
        .next()
        .await
        .ok_or("the connection to the server ended")?;
    match Ctrl::decode(&msg) {
        Some(Ctrl::Error(text)) => Err(format!("the server refused: {text}")),
        Some(m) => Ok(m),
        None => Err("malformed control message from the server".into()),
    }
}

/// A progress bar on stderr when it is a terminal, hidden otherwise.
fn progress(len: u64, what: String) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template(" {msg:>14} [{bar:40}] {percent:>3}% {elapsed_precise}")
    {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(what);
    pb
}

/// Runs the client side of the test over `conn` and prints the report's table.
pub async fn run(conn: &Connection, s: &Settings) -> Res<ClientRun> {
    let mut ctrl = conn
        .open_stream()
        .map_err(|e| format!("opening the control stream: {e}"))?;
    send(
        &mut ctrl,
        Ctrl::Hello {
            test: s.test.code(),
            rounds: s.sizes.len() as u32,
            qpn: conn.handle().0,
        },
    )
    .await?;
    let server_qpn = match recv(&mut ctrl).await? {
        Ctrl::Welcome { qpn } => qpn,
        other => return Err(format!("unexpected reply to hello: {other:?}")),
    };
    report::preamble(s, Some((conn, server_qpn)));
    let mut out = ClientRun {
        server_qpn,
        ..ClientRun::default()
    };
    match s.test {
        Test::WriteBw => write_bw(conn, &mut ctrl, s, &mut out).await?,
        Test::SendLat => send_lat(conn, &mut ctrl, s, &mut out).await?,
    }
    report::rule();
    out.stats = conn.stats();
    // The results are in: a lost goodbye is not worth failing the run for.
    if let Err(e) = send(&mut ctrl, Ctrl::Bye).await {
        eprintln!("metaroce-perf: warning: saying goodbye to the server: {e}");
    }
    Ok(out)
}

async fn write_bw(
    conn: &Connection,
    ctrl: &mut MessageStream,
    s: &Settings,
    out: &mut ClientRun,
) -> Res<()> {
    // One source region serves every size: slot i of size z is bytes [i*z, (i+1)*z).
    let data = match &s.file {
        Some(f) => f.data.clone(),
        None => {
            let len = s
                .sizes
                .iter()
                .map(|&z| plan(s, z).region_len)
                .max()
                .unwrap_or(0);
            let len = usize::try_from(len).map_err(|_| "source region too large")?;
            random_bytes(derive_seed(s.seed, 100), len)
        }
    };
    let src = conn.endpoint().register(data, Access::LOCAL_WRITE);
    report::bw_header(s);
    for &size in &s.sizes {
        let row = bw_round(conn, ctrl, s, &src, size).await?;
        report::bw_row(s, &row);
        out.bw.push(row);
    }
    Ok(())
}

async fn bw_round(
    conn: &Connection,
    ctrl: &mut MessageStream,
    s: &Settings,
    src: &MemoryRegion,
    size: u64,
) -> Res<BwRow> {
    let p = plan(s, size);
    send(
        ctrl,
        Ctrl::Setup {
            size,
            iters: p.ops.unwrap_or(0),
            region_len: p.region_len,
        },
    )
    .await?;
    let region = match recv(ctrl).await? {
        Ctrl::Ready { region, .. } => region,
        other => return Err(format!("unexpected reply to setup: {other:?}")),
    };
    if region.len < p.region_len {
        return Err(format!(
            "the server's region has {} bytes, {} needed",
            region.len, p.region_len
        ));
    }

    let pb = match (p.ops, s.duration) {
        (Some(n), _) => progress(n, format!("{size} B")),
        (None, Some(d)) => progress(d.as_millis() as u64, format!("{size} B")),
        (None, None) => ProgressBar::hidden(),
    };
    let depth = s.tx_depth;
    let mut inflight = FuturesUnordered::new();
    let start = Instant::now();
    let deadline = s.duration.map(|d| start + d);
    let mut meter = BwMeter::new(start);
    let mut posted: u64 = 0;
    loop {
        while inflight.len() < depth {
            let more = match (p.ops, deadline) {
                (Some(n), _) => posted < n,
                (None, Some(d)) => Instant::now() < d,
                (None, None) => false,
            };
            if !more {
                break;
            }
            let off = (posted % p.slots) * size;
            let len = size.min(p.region_len - off);
            inflight.push(async move {
                conn.write(src, off..off + len, region, off)
                    .await
                    .map(|_| len)
            });
            posted += 1;
        }
        match inflight.next().await {
            None => break,
            Some(Ok(len)) => {
                let now = Instant::now();
                meter.record(now, len);
                match p.ops {
                    Some(_) => pb.inc(1),
                    None => pb.set_position(now.duration_since(start).as_millis() as u64),
                }
            }
            Some(Err(e)) => {
                pb.finish_and_clear();
                return Err(format!("RDMA WRITE of {size} bytes failed: {e}"));
            }
        }
    }
    pb.finish_and_clear();
    let result = meter.finish();

    let check_len = match &s.file {
        Some(_) => p.region_len,
        None => result.ops.min(p.slots) * size,
    };
    send(
        ctrl,
        Ctrl::Done {
            check_len,
            ops: result.ops,
        },
    )
    .await?;
    let dst_crc = match recv(ctrl).await? {
        Ctrl::Result {
            crc, check_len: n, ..
        } if n == check_len => crc,
        Ctrl::Result { check_len: n, .. } => {
            return Err(format!(
                "the server checksummed {n} bytes instead of {check_len}"
            ))
        }
        other => return Err(format!("unexpected reply to done: {other:?}")),
    };
    let src_crc = src
        .with_bytes(|b| crc32fast::hash(&b[..check_len as usize]))
        .map_err(|e| format!("reading the source: {e}"))?;
    Ok(BwRow {
        size,
        result,
        slots: p.slots,
        src_crc,
        dst_crc,
        check_len,
    })
}

async fn send_lat(
    conn: &Connection,
    ctrl: &mut MessageStream,
    s: &Settings,
    out: &mut ClientRun,
) -> Res<()> {
    let mut data = conn
        .open_stream()
        .map_err(|e| format!("opening the ping-pong stream: {e}"))?;
    report::lat_header();
    for (round, &size) in s.sizes.iter().enumerate() {
        send(
            ctrl,
            Ctrl::Setup {
                size,
                iters: s.iters.unwrap_or(0),
                region_len: 0,
            },
        )
        .await?;
        match recv(ctrl).await? {
            Ctrl::Ready { .. } => {}
            other => return Err(format!("unexpected reply to setup: {other:?}")),
        }
        let row = lat_round(&mut data, s, size, round as u64).await?;
        send(
            ctrl,
            Ctrl::Done {
                check_len: 0,
                ops: row.iterations,
            },
        )
        .await?;
        match recv(ctrl).await? {
            Ctrl::Result { .. } => {}
            other => return Err(format!("unexpected reply to done: {other:?}")),
        }
        report::lat_row(&row);
        out.lat.push(row);
    }
    Ok(())
}

async fn ping(data: &mut MessageStream, msg: Bytes) -> Res<(Duration, Bytes)> {
    let t0 = Instant::now();
    data.feed(msg)
        .await
        .map_err(|e| format!("sending a ping: {e}"))?;
    let echo = data
        .next()
        .await
        .ok_or("the connection ended during the ping-pong")?;
    Ok((t0.elapsed(), echo))
}

async fn lat_round(data: &mut MessageStream, s: &Settings, size: u64, round: u64) -> Res<LatRow> {
    const VARIANTS: usize = 251;
    let size = usize::try_from(size).map_err(|_| "size too large")?;
    // Message i is a window of a random buffer, shifted by i % 251: consecutive messages
    // differ, and slicing a `Bytes` copies nothing.
    let pattern = Bytes::from(random_bytes(
        derive_seed(s.seed, 200 + round),
        size + VARIANTS,
    ));
    let msg = |i: u64| {
        let off = (i % VARIANTS as u64) as usize;
        pattern.slice(off..off + size)
    };
    let mut mismatches = 0;
    for i in 0..WARMUP.min(s.iters.unwrap_or(WARMUP)) {
        let m = msg(i);
        let (_, echo) = ping(data, m.clone()).await?;
        mismatches += u64::from(echo != m);
    }
    let pb = match (s.iters, s.duration) {
        (Some(n), _) => progress(n, format!("{size} B")),
        (None, Some(d)) => progress(d.as_millis() as u64, format!("{size} B")),
        (None, None) => ProgressBar::hidden(),
    };
    let mut rtts = Vec::with_capacity(s.iters.unwrap_or(1 << 16) as usize);
    let start = Instant::now();
    let mut i: u64 = 0;
    loop {
        let more = match (s.iters, s.duration) {
            (Some(n), _) => i < n,
            (None, Some(d)) => start.elapsed() < d,
            (None, None) => false,
        };
        if !more {
            break;
        }
        let m = msg(i);
        let (rtt, echo) = ping(data, m.clone()).await?;
        rtts.push(rtt);
        mismatches += u64::from(echo != m);
        i += 1;
        match s.iters {
            Some(_) => pb.inc(1),
            None => pb.set_position(start.elapsed().as_millis() as u64),
        }
    }
    pb.finish_and_clear();
    Ok(LatRow {
        size: size as u64,
        iterations: i,
        stats: LatStats::from_rtts(&rtts),
        mismatches,
    })
}
