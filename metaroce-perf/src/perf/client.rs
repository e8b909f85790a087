//! The client side of a run: drives the measurement and prints the table.

use super::cli::{AtomicType, Settings, Test};
use super::ctrl::Chan;
use super::data::{
    atomic_add, atomic_initial, client_pattern_seed, derive_seed, pattern, random_bytes,
    server_pattern_seed, window, VARIANTS,
};
use super::progress::{Progress, Unit};
use super::proto::{Ctrl, NO_REGION};
use super::report;
use super::stats::{BwMeter, BwResult, LatStats};
use super::xport::{Fill, LinkStats, Mr, Net, Pool, RcNet};
use super::Res;
use bytes::Bytes;
use futures::stream::FuturesUnordered;
use futures::{Future, SinkExt, StreamExt};
use metaroce::Access;
use metaroce_tokio::{MessageStream, RemoteRegion};
use std::time::{Duration, Instant};

/// The destination of one bandwidth size is at most this many bytes (unless one operation
/// is larger): slots = min(iterations, max(1, 1 GiB / size)).
pub const MAX_SLOTS_BYTES: u64 = 1 << 30;

/// Latency iterations before the measured ones (checked, not reported).
pub const WARMUP: u64 = 10;

/// Receive buffers the client keeps posted for RC send_lat echoes.
const RC_LAT_RECVS: u64 = 4;

/// One bandwidth row.
#[derive(Debug, Clone)]
pub struct BwRow {
    /// Bytes per operation.
    pub size: u64,
    /// Measurement.
    pub result: BwResult,
    /// Distinct destination slots.
    pub slots: u64,
    /// CRC-32 of the source: what the client wrote (write_bw), the server memory read
    /// (read_bw), the messages sent (send_bw).
    pub src_crc: u32,
    /// CRC-32 of what landed: the server's destination (write_bw), the client's
    /// destination (read_bw), the bytes the server received (send_bw).
    pub dst_crc: u32,
    /// Bytes checksummed.
    pub check_len: u64,
    /// send_bw: (messages sent, messages the server received).
    pub messages: Option<(u64, u64)>,
}

impl BwRow {
    /// Whether what landed matches the source.
    pub fn ok(&self) -> bool {
        self.src_crc == self.dst_crc && self.messages.is_none_or(|(a, b)| a == b)
    }
}

/// atomic_lat's end-to-end check of the counter.
#[derive(Debug, Clone, Copy)]
pub struct AtomicCheck {
    /// Counter value before the round.
    pub initial: u64,
    /// FETCH_AND_ADDs executed (warm-up included).
    pub adds: u64,
    /// initial + the sum of the adds (wrapping).
    pub expected: u64,
    /// The counter the server read at the end.
    pub found: u64,
}

/// One latency row.
#[derive(Debug, Clone)]
pub struct LatRow {
    /// Message / operation size.
    pub size: u64,
    /// Measured iterations.
    pub iterations: u64,
    /// Checked iterations (warm-up included).
    pub checked: u64,
    /// Statistics of the latency.
    pub stats: Option<LatStats>,
    /// Iterations whose data the client found wrong (echo, landed WRITE, READ result,
    /// fetched value).
    pub mismatches: u64,
    /// write_lat: WRITEs the server found landed wrong.
    pub peer_mismatches: u64,
    /// atomic_lat: the final counter.
    pub atomic: Option<AtomicCheck>,
}

impl LatRow {
    /// Whether every check passed.
    pub fn ok(&self) -> bool {
        self.mismatches == 0
            && self.peer_mismatches == 0
            && self.atomic.is_none_or(|a| a.expected == a.found)
    }
}

/// What the client measured.
#[derive(Debug, Clone, Default)]
pub struct ClientRun {
    /// Server's QPN.
    pub server_qpn: u32,
    /// Bandwidth rows.
    pub bw: Vec<BwRow>,
    /// Latency rows.
    pub lat: Vec<LatRow>,
    /// The connection's counters at the end.
    pub stats: Option<LinkStats>,
}

impl ClientRun {
    /// Whether every check passed.
    pub fn verified(&self) -> bool {
        self.bw.iter().all(BwRow::ok) && self.lat.iter().all(LatRow::ok)
    }

    /// Prints a bandwidth row and keeps it.
    fn push_bw(&mut self, s: &Settings, row: BwRow) {
        report::bw_row(s, &row);
        self.bw.push(row);
    }

    /// Prints a latency row and keeps it.
    fn push_lat(&mut self, row: LatRow) {
        report::lat_row(&row);
        self.lat.push(row);
    }
}

/// How one bandwidth size is laid out.
#[derive(Debug, Clone, Copy)]
struct Plan {
    /// Operations to post; `None` for a timed run.
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

/// Bytes of the largest region any size of the run lays out (one region serves them all).
fn largest_region(s: &Settings, what: &str) -> Res<usize> {
    let len = s
        .sizes
        .iter()
        .map(|&z| plan(s, z).region_len)
        .max()
        .unwrap_or(0);
    usize::try_from(len).map_err(|_| format!("{what} region too large"))
}

/// MetaRoCE: the one stream the test's messages go on, opened now (the server accepts it
/// with its first message; the handle stays alive for the run). RC: none.
fn data_stream(net: &Net, what: &str) -> Res<Option<MessageStream>> {
    match net {
        Net::Meta(c) => c
            .open_stream()
            .map(Some)
            .map_err(|e| format!("opening the {what} stream: {e}")),
        Net::Rc(_) => Ok(None),
    }
}

/// Data seed of round `round` of the tests that have one.
fn round_seed(s: &Settings, round: usize) -> u64 {
    derive_seed(s.seed, 1000 + round as u64)
}

/// The progress display of one size (a bar on a terminal, lines otherwise).
fn progress_for(s: &Settings, size: u64) -> Progress {
    match (s.iters, s.duration) {
        (Some(n), _) => Progress::new(n, Unit::Iterations, format!("{size} B")),
        (None, Some(d)) => Progress::new(d.as_millis() as u64, Unit::Millis, format!("{size} B")),
        (None, None) => Progress::Hidden,
    }
}

/// Runs the client side of the test over `net` and prints the report's table.
pub async fn run(net: &Net, ctrl: &mut Chan, s: &Settings) -> Res<ClientRun> {
    let (qpn, psn, port) = net.identity();
    ctrl.send(Ctrl::Hello {
        test: s.test.code(),
        rounds: s.sizes.len() as u32,
        max_size: s.max_size(),
        qpn,
        psn,
        port,
    })
    .await?;
    let (server_qpn, server_psn, server_port) = match ctrl.recv().await? {
        Ctrl::Welcome { qpn, psn, port } => (qpn, psn, port),
        other => return Err(format!("unexpected reply to hello: {other:?}")),
    };
    net.connect(server_qpn, server_psn, server_port)?;
    let (local, remote) = net.describe(server_qpn);
    report::preamble(s, Some((&local, &remote)));
    let mut out = ClientRun {
        server_qpn,
        ..ClientRun::default()
    };
    let mut pool = Pool::default();
    match s.test {
        Test::WriteBw => write_bw(net, ctrl, s, &mut out).await?,
        Test::ReadBw => read_bw(net, ctrl, s, &mut out).await?,
        Test::SendBw => send_bw(net, ctrl, s, &mut out, &mut pool).await?,
        Test::WriteLat => write_lat(net, ctrl, s, &mut out, &mut pool).await?,
        Test::ReadLat => read_lat(net, ctrl, s, &mut out, &mut pool).await?,
        Test::AtomicLat => atomic_lat(net, ctrl, s, &mut out, &mut pool).await?,
        Test::SendLat => send_lat(net, ctrl, s, &mut out, &mut pool).await?,
    }
    report::rule();
    out.stats = Some(net.stats());
    // The results are in: a lost goodbye is not worth failing the run for.
    if let Err(e) = ctrl.send(Ctrl::Bye).await {
        eprintln!("metaroce-perf: warning: saying goodbye to the server: {e}");
    }
    Ok(out)
}

/// `f`, unless the server reports a failure on its side first (then its report): a wait
/// for something only the server's side completes must not outlive that side.
async fn or_peer_failure<T>(ctrl: &mut Chan, f: impl Future<Output = Res<T>>) -> Res<T> {
    tokio::select! {
        biased;
        r = f => r,
        e = ctrl.peer_failure() => Err(e),
    }
}

/// SETUP → READY; the server's region must hold `need` bytes.
async fn setup(
    ctrl: &mut Chan,
    size: u64,
    iters: Option<u64>,
    region_len: u64,
    seed: u64,
    peer: RemoteRegion,
    need: u64,
) -> Res<RemoteRegion> {
    ctrl.send(Ctrl::Setup {
        size,
        iters: iters.unwrap_or(0),
        region_len,
        seed,
        peer,
    })
    .await?;
    let region = match ctrl.recv().await? {
        Ctrl::Ready { region, .. } => region,
        other => return Err(format!("unexpected reply to setup: {other:?}")),
    };
    if region.len < need {
        return Err(format!(
            "the server's region has {} bytes, {need} needed",
            region.len
        ));
    }
    Ok(region)
}

/// DONE → RESULT: (crc, check_len, ops, value).
async fn done(ctrl: &mut Chan, check_len: u64, ops: u64) -> Res<(u32, u64, u64, u64)> {
    ctrl.send(Ctrl::Done { check_len, ops }).await?;
    match ctrl.recv().await? {
        Ctrl::Result {
            crc,
            check_len,
            ops,
            value,
        } => Ok((crc, check_len, ops, value)),
        other => Err(format!("unexpected reply to done: {other:?}")),
    }
}

/// [`done`] for a test whose server checksums `check_len` bytes: the server's CRC, or an
/// error if it checksummed another length.
async fn done_checked(ctrl: &mut Chan, check_len: u64, ops: u64) -> Res<u32> {
    match done(ctrl, check_len, ops).await? {
        (crc, n, _, _) if n == check_len => Ok(crc),
        (_, n, _, _) => Err(format!(
            "the server checksummed {n} bytes instead of {check_len}"
        )),
    }
}

/// Waits for `reply` while completing the operations in `pending` (their errors end the
/// wait); ends early with the server's report when it reports a failure on its side.
async fn reply_while<F, U, T>(
    ctrl: &mut Chan,
    pending: &mut FuturesUnordered<F>,
    reply: impl Future<Output = Res<T>>,
) -> Res<T>
where
    F: Future<Output = Res<U>>,
{
    let mut reply = std::pin::pin!(reply);
    loop {
        tokio::select! {
            biased;
            Some(r) = pending.next() => { r?; }
            r = &mut reply => return r,
            e = ctrl.peer_failure() => return Err(e),
        }
    }
}

/// Completes every operation left in `pending`.
async fn drain<F: Future<Output = Res<U>>, U>(pending: &mut FuturesUnordered<F>) -> Res<()> {
    while let Some(r) = pending.next().await {
        r?;
    }
    Ok(())
}

/// Keeps `s.tx_depth` operations outstanding until `ops` completed (or the duration ran
/// out), metering completions. `op(i, n)` posts operations `i .. i + n` with one completion
/// and resolves with their bytes; `n` is `per_post` (the last post of a counted run may
/// take fewer), so `s.tx_depth / per_post` posts (rounded down, at least one) are kept
/// outstanding. Ends early with the
/// server's report when it reports a failure on its side.
async fn pump<F, Fut>(
    s: &Settings,
    ctrl: &mut Chan,
    size: u64,
    ops: Option<u64>,
    per_post: u64,
    mut op: F,
) -> Res<BwResult>
where
    F: FnMut(u64, u64) -> Fut,
    Fut: Future<Output = Res<u64>>,
{
    let mut pb = progress_for(s, size);
    let mut inflight = FuturesUnordered::new();
    let start = Instant::now();
    let deadline = s.duration.map(|d| start + d);
    let mut meter = BwMeter::new(start);
    let per_post = per_post.max(1);
    // `--cq-mod` is at most `--tx-depth`: at least one post, never more WRITEs than that.
    let depth = (s.tx_depth / per_post as usize).max(1);
    let mut posted: u64 = 0;
    loop {
        while inflight.len() < depth {
            let n = match (ops, deadline) {
                (Some(n), _) => per_post.min(n.saturating_sub(posted)),
                (None, Some(d)) if Instant::now() < d => per_post,
                _ => 0,
            };
            if n == 0 {
                break;
            }
            let fut = op(posted, n);
            inflight.push(async move { fut.await.map(|bytes| (bytes, n)) });
            posted += n;
        }
        let next = tokio::select! {
            biased;
            r = inflight.next() => r,
            e = ctrl.peer_failure() => Some(Err(e)),
        };
        match next {
            None => break,
            Some(Ok((len, n))) => {
                let now = Instant::now();
                meter.record_ops(now, len, n);
                match ops {
                    Some(_) => pb.inc(n),
                    None => pb.set_position(now.duration_since(start).as_millis() as u64),
                }
            }
            Some(Err(e)) => {
                pb.finish_and_clear();
                return Err(e);
            }
        }
    }
    pb.finish_and_clear();
    Ok(meter.finish())
}

async fn write_bw(net: &Net, ctrl: &mut Chan, s: &Settings, out: &mut ClientRun) -> Res<()> {
    // One source region serves every size: slot i of size z is bytes [i*z, (i+1)*z).
    let data = match &s.file {
        Some(f) => f.data.clone(),
        None => {
            let len = largest_region(s, "source")?;
            super::xport::off_worker(|| random_bytes(derive_seed(s.seed, 100), len))
        }
    };
    let src = net.register(data, Access::LOCAL_WRITE);
    report::bw_header(s);
    for &size in &s.sizes {
        let p = plan(s, size);
        let region = setup(ctrl, size, p.ops, p.region_len, 0, NO_REGION, p.region_len).await?;
        let src = &src;
        let slot = |i: u64| {
            let off = (i % p.slots) * size;
            (off, size.min(p.region_len - off))
        };
        let result = if s.cq_mod > 1 {
            // A post list of `cq_mod` WRITEs with one completion (perftest's --cq-mod).
            pump(s, &mut *ctrl, size, p.ops, s.cq_mod, |i, n| {
                let items: Vec<_> = (i..i + n).map(slot).collect();
                async move { net.write_batch(src, &items, region).await }
            })
            .await?
        } else {
            pump(s, &mut *ctrl, size, p.ops, 1, |i, _| {
                let (off, len) = slot(i);
                net.write(src, off, len, region, off, None)
            })
            .await?
        };
        let check_len = match &s.file {
            Some(_) => p.region_len,
            None => result.ops.min(p.slots) * size,
        };
        let dst_crc = done_checked(ctrl, check_len, result.ops).await?;
        if s.selftest_mismatch {
            src.flip(0)?;
        }
        let row = BwRow {
            size,
            result,
            slots: p.slots,
            src_crc: src.crc(0, check_len)?,
            dst_crc,
            check_len,
            messages: None,
        };
        out.push_bw(s, row);
    }
    Ok(())
}

async fn read_bw(net: &Net, ctrl: &mut Chan, s: &Settings, out: &mut ClientRun) -> Res<()> {
    let len = largest_region(s, "destination")?;
    let dst = net.register(vec![0; len.max(1)], Access::LOCAL_WRITE);
    report::bw_header(s);
    for (round, &size) in s.sizes.iter().enumerate() {
        let p = plan(s, size);
        let seed = round_seed(s, round);
        let region = setup(
            ctrl,
            size,
            p.ops,
            p.region_len,
            seed,
            NO_REGION,
            p.region_len,
        )
        .await?;
        let dst = &dst;
        let result = pump(s, &mut *ctrl, size, p.ops, 1, |i, _| {
            let off = (i % p.slots) * size;
            net.read(dst, off, size, region, off)
        })
        .await?;
        let check_len = result.ops.min(p.slots) * size;
        let src_crc = done_checked(ctrl, check_len, result.ops).await?;
        if s.selftest_mismatch {
            dst.flip(0)?;
        }
        let row = BwRow {
            size,
            result,
            slots: p.slots,
            src_crc,
            dst_crc: dst.crc(0, check_len)?,
            check_len,
            messages: None,
        };
        out.push_bw(s, row);
    }
    Ok(())
}

async fn send_bw(
    net: &Net,
    ctrl: &mut Chan,
    s: &Settings,
    out: &mut ClientRun,
    pool: &mut Pool,
) -> Res<()> {
    let stream = data_stream(net, "data")?;
    report::bw_header(s);
    for (round, &size) in s.sizes.iter().enumerate() {
        let seed = round_seed(s, round);
        setup(ctrl, size, s.iters, 0, seed, NO_REGION, 0).await?;
        let pat = Bytes::from(pattern(seed, size));
        let result = match (net, &stream) {
            (Net::Meta(c), Some(st)) => {
                let id = st.id();
                pump(s, &mut *ctrl, size, s.iters, 1, |i, _| {
                    let w = window(i) as usize;
                    let m = pat.slice(w..w + size as usize);
                    async move {
                        c.send(id, m)
                            .await
                            .map(|_| size)
                            .map_err(|e| format!("SEND of {size} bytes failed: {e}"))
                    }
                })
                .await?
            }
            (Net::Rc(rc), _) => {
                // The same bytes as `pat`: random_bytes(seed, size + VARIANTS).
                let src = pool.get(
                    net,
                    "send_src",
                    size + VARIANTS,
                    Access::LOCAL_WRITE,
                    Fill::Random(seed),
                )?;
                let (rc, src) = (&**rc, &src);
                pump(s, &mut *ctrl, size, s.iters, 1, |i, _| async move {
                    rc.send(src, window(i), size).await.map(|_| size)
                })
                .await?
            }
            _ => return Err("no data stream".into()),
        };
        // The messages in the order they were posted (which is the order on the wire).
        let mut h = crc32fast::Hasher::new();
        if s.selftest_mismatch {
            h.update(&[0]);
        }
        for i in 0..result.ops {
            let w = window(i) as usize;
            h.update(&pat[w..w + size as usize]);
        }
        let check_len = result.ops * size;
        // A short or long byte count shows in the checksum.
        let (crc, _, received, _) = done(ctrl, check_len, result.ops).await?;
        let row = BwRow {
            size,
            result,
            slots: 0,
            src_crc: h.finalize(),
            dst_crc: crc,
            check_len,
            messages: Some((result.ops, received)),
        };
        out.push_bw(s, row);
    }
    drop(stream);
    Ok(())
}

/// Iterations of a latency round: `WARMUP` unmeasured ones, then the measured ones until
/// `-n` or `-D` is reached.
struct Sampler {
    warmup: u64,
    iters: Option<u64>,
    duration: Option<Duration>,
    start: Option<Instant>,
    next: u64,
    rtts: Vec<Duration>,
    pb: Progress,
}

impl Sampler {
    fn new(s: &Settings, size: u64) -> Sampler {
        Sampler {
            warmup: WARMUP.min(s.iters.unwrap_or(WARMUP)),
            iters: s.iters,
            duration: s.duration,
            start: None,
            next: 0,
            rtts: Vec::with_capacity(s.iters.unwrap_or(1 << 16).min(1 << 24) as usize),
            pb: progress_for(s, size),
        }
    }

    /// The next iteration's index and whether it is measured; `None` when done.
    fn next(&mut self) -> Option<(u64, bool)> {
        let i = self.next;
        if i < self.warmup {
            self.next += 1;
            return Some((i, false));
        }
        let start = *self.start.get_or_insert_with(Instant::now);
        let more = match (self.iters, self.duration) {
            (Some(n), _) => i - self.warmup < n,
            (None, Some(d)) => start.elapsed() < d,
            (None, None) => false,
        };
        if !more {
            return None;
        }
        self.next += 1;
        Some((i, true))
    }

    fn record(&mut self, measured: bool, d: Duration) {
        if !measured {
            return;
        }
        self.rtts.push(d);
        match (self.iters, self.start) {
            (Some(_), _) => self.pb.inc(1),
            (None, Some(t)) => self.pb.set_position(t.elapsed().as_millis() as u64),
            (None, None) => {}
        }
    }

    /// (measured iterations, checked iterations, statistics).
    fn finish(self, test: Test) -> (u64, u64, Option<LatStats>) {
        self.pb.finish_and_clear();
        let divisor = if test.halves_rtt() { 2.0 } else { 1.0 };
        (
            self.rtts.len() as u64,
            self.next,
            LatStats::from_samples(&self.rtts, divisor),
        )
    }
}

fn lat_row(
    size: u64,
    smp: Sampler,
    test: Test,
    mismatches: u64,
    peer_mismatches: u64,
    atomic: Option<AtomicCheck>,
) -> LatRow {
    let (iterations, checked, stats) = smp.finish(test);
    LatRow {
        size,
        iterations,
        checked,
        stats,
        mismatches,
        peer_mismatches,
        atomic,
    }
}

async fn write_lat(
    net: &Net,
    ctrl: &mut Chan,
    s: &Settings,
    out: &mut ClientRun,
    pool: &mut Pool,
) -> Res<()> {
    net.prepare_imm()?;
    report::lat_header();
    for (round, &size) in s.sizes.iter().enumerate() {
        let seed = round_seed(s, round);
        let mine = pool.get(
            net,
            "wl_src",
            size + VARIANTS,
            Access::LOCAL_WRITE,
            Fill::Random(client_pattern_seed(seed)),
        )?;
        // Two slots: iteration i lands in slot i % 2, so the previous one can still be
        // checked while the next lands.
        let land = pool.get(
            net,
            "wl_dst",
            2 * size,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            Fill::Byte(0),
        )?;
        let mut theirs = pattern(server_pattern_seed(seed), size);
        theirs[0] ^= u8::from(s.selftest_mismatch);
        let region = setup(ctrl, size, s.iters, 2 * size, seed, land.remote(), 2 * size).await?;
        let mut smp = Sampler::new(s, size);
        let mut bad = 0;
        let mut writes = FuturesUnordered::new();
        while let Some((i, measured)) = smp.next() {
            let slot = (i % 2) * size;
            let t0 = Instant::now();
            writes.push(net.write(&mine, window(i), size, region, slot, Some(i as u32)));
            let imm = reply_while(ctrl, &mut writes, net.next_imm()).await?;
            let rtt = t0.elapsed();
            let w = window(i) as usize;
            if imm != i as u32 || !land.eq_at(slot, &theirs[w..w + size as usize])? {
                bad += 1;
            }
            smp.record(measured, rtt);
        }
        drain(&mut writes).await?;
        let ops = smp.next;
        let (_, _, replies, server_bad) = done(ctrl, 0, ops).await?;
        if replies != ops {
            return Err(format!("the server answered {replies} of {ops} WRITEs"));
        }
        let row = lat_row(size, smp, s.test, bad, server_bad, None);
        out.push_lat(row);
    }
    Ok(())
}

async fn read_lat(
    net: &Net,
    ctrl: &mut Chan,
    s: &Settings,
    out: &mut ClientRun,
    pool: &mut Pool,
) -> Res<()> {
    report::lat_header();
    for (round, &size) in s.sizes.iter().enumerate() {
        let seed = round_seed(s, round);
        // The server fills its region with random_bytes(seed, size + VARIANTS).
        let mut expected = pattern(seed, size);
        expected[0] ^= u8::from(s.selftest_mismatch);
        let region_len = size + VARIANTS;
        let region = setup(ctrl, size, s.iters, region_len, seed, NO_REGION, region_len).await?;
        let dst = pool.get(net, "rl_dst", size, Access::LOCAL_WRITE, Fill::Byte(0))?;
        let mut smp = Sampler::new(s, size);
        let mut bad = 0;
        while let Some((i, measured)) = smp.next() {
            let t0 = Instant::now();
            or_peer_failure(ctrl, net.read(&dst, 0, size, region, window(i))).await?;
            let rtt = t0.elapsed();
            let w = window(i) as usize;
            if !dst.eq_at(0, &expected[w..w + size as usize])? {
                bad += 1;
            }
            smp.record(measured, rtt);
        }
        done(ctrl, 0, smp.next).await?;
        let row = lat_row(size, smp, s.test, bad, 0, None);
        out.push_lat(row);
    }
    Ok(())
}

async fn atomic_lat(
    net: &Net,
    ctrl: &mut Chan,
    s: &Settings,
    out: &mut ClientRun,
    pool: &mut Pool,
) -> Res<()> {
    report::lat_header();
    let result = pool.get(net, "at_res", 8, Access::LOCAL_WRITE, Fill::Byte(0))?;
    for (round, &size) in s.sizes.iter().enumerate() {
        let seed = round_seed(s, round);
        let counter = setup(ctrl, size, s.iters, 16, seed, NO_REGION, 8).await?;
        let initial = atomic_initial(seed);
        let mut expected = initial ^ u64::from(s.selftest_mismatch);
        let mut smp = Sampler::new(s, size);
        let mut bad = 0;
        while let Some((i, measured)) = smp.next() {
            let add = atomic_add(seed, i);
            let t0 = Instant::now();
            let op = async {
                match s.atomic_type {
                    AtomicType::FetchAndAdd => net.fetch_add(&result, counter, add).await,
                    // Compare with the value the counter must hold, swap in the sum: the
                    // same sequence as FETCH_AND_ADD, so the same end-to-end check.
                    AtomicType::CmpAndSwap => {
                        net.compare_swap(&result, counter, expected, expected.wrapping_add(add))
                            .await
                    }
                }
            };
            let old = or_peer_failure(ctrl, op).await?;
            let rtt = t0.elapsed();
            if old != expected {
                bad += 1;
            }
            expected = expected.wrapping_add(add);
            smp.record(measured, rtt);
        }
        let adds = smp.next;
        let (_, _, _, found) = done(ctrl, 0, adds).await?;
        let check = AtomicCheck {
            initial,
            adds,
            expected,
            found,
        };
        let row = lat_row(size, smp, s.test, bad, 0, Some(check));
        out.push_lat(row);
    }
    Ok(())
}

async fn send_lat(
    net: &Net,
    ctrl: &mut Chan,
    s: &Settings,
    out: &mut ClientRun,
    pool: &mut Pool,
) -> Res<()> {
    let mut data = data_stream(net, "ping-pong")?;
    // RC: echoes land in posted receives of the largest size.
    let ring = match net {
        Net::Rc(rc) => {
            let slot = s.max_size();
            let ring = pool.get(
                net,
                "sl_ring",
                RC_LAT_RECVS * slot,
                Access::LOCAL_WRITE,
                Fill::Byte(0),
            )?;
            for k in 0..RC_LAT_RECVS {
                rc.post_recv(k, &ring, k * slot, slot as u32)?;
            }
            Some(ring)
        }
        Net::Meta(_) => None,
    };
    report::lat_header();
    for (round, &size) in s.sizes.iter().enumerate() {
        let seed = derive_seed(s.seed, 200 + round as u64);
        setup(ctrl, size, s.iters, 0, seed, NO_REGION, 0).await?;
        let row = match (net, &mut data, &ring) {
            (Net::Meta(_), Some(data), _) => meta_send_lat(ctrl, data, s, size, seed).await?,
            (Net::Rc(rc), _, Some(ring)) => {
                rc_send_lat(ctrl, net, rc, s, size, seed, ring, pool).await?
            }
            _ => return Err("no ping-pong channel".into()),
        };
        done(ctrl, 0, row.checked).await?;
        out.push_lat(row);
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
        .ok_or("the connection ended during the ping-pong")?
        .map_err(|e| format!("the ping-pong stream failed: {}", super::error_chain(&e)))?;
    Ok((t0.elapsed(), echo))
}

async fn meta_send_lat(
    ctrl: &mut Chan,
    data: &mut MessageStream,
    s: &Settings,
    size: u64,
    seed: u64,
) -> Res<LatRow> {
    let n = usize::try_from(size).map_err(|_| "size too large")?;
    let pat = Bytes::from(pattern(seed, size));
    let mut expected = pat.to_vec();
    expected[0] ^= u8::from(s.selftest_mismatch);
    let mut smp = Sampler::new(s, size);
    let mut bad = 0;
    while let Some((i, measured)) = smp.next() {
        let w = window(i) as usize;
        let m = pat.slice(w..w + n);
        let (rtt, echo) = or_peer_failure(ctrl, ping(data, m)).await?;
        bad += u64::from(echo[..] != expected[w..w + n]);
        smp.record(measured, rtt);
    }
    Ok(lat_row(size, smp, s.test, bad, 0, None))
}

#[allow(clippy::too_many_arguments)]
async fn rc_send_lat(
    ctrl: &mut Chan,
    net: &Net,
    rc: &RcNet,
    s: &Settings,
    size: u64,
    seed: u64,
    ring: &Mr,
    pool: &mut Pool,
) -> Res<LatRow> {
    let slot = s.max_size();
    let src = pool.get(
        net,
        "sl_src",
        size + VARIANTS,
        Access::LOCAL_WRITE,
        Fill::Random(seed),
    )?;
    let mut pat = pattern(seed, size);
    pat[0] ^= u8::from(s.selftest_mismatch);
    let mut smp = Sampler::new(s, size);
    let mut bad = 0;
    let mut sends = FuturesUnordered::new();
    while let Some((i, measured)) = smp.next() {
        let t0 = Instant::now();
        sends.push(rc.send(&src, window(i), size));
        let c = reply_while(ctrl, &mut sends, rc.recv()).await?;
        let rtt = t0.elapsed();
        let w = window(i) as usize;
        let k = c.wr_id;
        if u64::from(c.byte_len) != size || !ring.eq_at(k * slot, &pat[w..w + size as usize])? {
            bad += 1;
        }
        rc.post_recv(k, ring, k * slot, slot as u32)?;
        smp.record(measured, rtt);
    }
    drain(&mut sends).await?;
    Ok(lat_row(size, smp, s.test, bad, 0, None))
}
