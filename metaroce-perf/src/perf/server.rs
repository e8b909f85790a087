//! The server side of a run: answers the client's control messages, allocates the regions
//! the client's one-sided operations target, checksums them, answers WRITEs (write_lat),
//! receives and echoes SENDs.

use super::cli::Test;
use super::ctrl::Chan;
use super::data::VARIANTS;
use super::data::{atomic_initial, client_pattern_seed, pattern, server_pattern_seed, window};
use super::proto::{Ctrl, NO_REGION};
use super::xport::{aligned8, Fill, LinkStats, Mr, Net, Pool, RcNet};
use super::Res;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, SinkExt, StreamExt};
use metaroce::Access;
use metaroce_tokio::{MessageStream, RemoteRegion};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// Largest region the server agrees to allocate.
const MAX_REGION: u64 = 16 << 30;

/// How long the server waits for the client to close after its BYE.
const LINGER: Duration = Duration::from_secs(2);

/// How long the server waits at DONE for send_bw messages still on their way.
const SINK_WAIT: Duration = Duration::from_secs(10);

/// Byte a WRITE destination is filled with before a run: touches every page (so page
/// faults do not land in the measurement) and differs from what a correct run leaves there.
const DEST_FILL: u8 = 0xa5;

/// Bytes of posted receive buffers of the RC send tests (at least one buffer).
const RING_BYTES: u64 = 256 << 20;

/// One size served.
#[derive(Debug, Clone)]
pub struct ServerRound {
    /// Bytes per operation / message.
    pub size: u64,
    /// Iterations announced (0: timed).
    pub iters: u64,
    /// Region length.
    pub region_len: u64,
    /// Bytes checksummed.
    pub check_len: u64,
    /// CRC-32 (see the proto table).
    pub crc: u32,
    /// Operations the client reported.
    pub client_ops: u64,
    /// Test-specific value returned (see the proto table).
    pub value: u64,
}

/// What the server saw of a run.
#[derive(Debug, Clone, Default)]
pub struct ServerRun {
    /// Test the client ran.
    pub test: Option<Test>,
    /// Client's QPN.
    pub client_qpn: u32,
    /// Rounds.
    pub rounds: Vec<ServerRound>,
    /// send_lat messages echoed.
    pub echoed: u64,
    /// The connection's counters at the end.
    pub stats: Option<LinkStats>,
}

/// What send_bw's receiver has taken in since the last SETUP.
#[derive(Default)]
struct SinkState {
    crc: crc32fast::Hasher,
    msgs: u64,
    bytes: u64,
    error: Option<String>,
}

#[derive(Default)]
struct Sink {
    state: Mutex<SinkState>,
    changed: Notify,
}

impl Sink {
    fn lock(&self) -> std::sync::MutexGuard<'_, SinkState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fail(&self, e: String) {
        self.lock().error.get_or_insert(e);
        self.changed.notify_waiters();
    }

    /// Waits until `ops` messages arrived (or an error, or `SINK_WAIT` without progress);
    /// returns (crc, messages, bytes).
    async fn wait_for(&self, ops: u64) -> Res<(u32, u64, u64)> {
        loop {
            let changed = self.changed.notified();
            let before = {
                let st = self.lock();
                if let Some(e) = &st.error {
                    return Err(e.clone());
                }
                if st.msgs >= ops {
                    return Ok((st.crc.clone().finalize(), st.msgs, st.bytes));
                }
                st.msgs
            };
            if tokio::time::timeout(SINK_WAIT, changed).await.is_err() {
                let st = self.lock();
                if st.msgs == before {
                    return Ok((st.crc.clone().finalize(), st.msgs, st.bytes));
                }
            }
        }
    }
}

/// Posts a reply without waiting for its acknowledgement.
async fn refuse(ctrl: &mut Chan, text: String) -> String {
    let _ = ctrl.post(Ctrl::Error(text.clone())).await;
    text
}

/// Where a task serving the client's operations reports that it stopped: [`serve`] sends
/// the report to the client as an ERROR, which ends the run on both sides (the client may
/// be waiting for something only this task would have sent).
type FailTx = UnboundedSender<String>;

/// Echoes every message of `stream` back on it.
async fn echo(mut stream: MessageStream, count: Arc<AtomicU64>, fail: FailTx) {
    while let Some(Ok(m)) = stream.next().await {
        if let Err(e) = stream.feed(m).await {
            let _ = fail.send(format!("send_lat echo stopped: {e}"));
            break;
        }
        count.fetch_add(1, Ordering::Relaxed);
    }
}

/// Checksums every message of `stream`, in order.
async fn sink(mut stream: MessageStream, sink: Arc<Sink>) {
    while let Some(Ok(m)) = stream.next().await {
        {
            let mut st = sink.lock();
            st.crc.update(&m);
            st.msgs += 1;
            st.bytes += m.len() as u64;
        }
        sink.changed.notify_waiters();
    }
}

/// Receive buffers of the RC send tests: `count` slots of `slot` bytes.
fn ring_shape(max_size: u64, rx_depth: usize, cap: u64) -> (u64, u64) {
    let slot = max_size.max(1);
    let count = (rx_depth as u64).min((RING_BYTES / slot).max(1)).min(cap);
    (slot, count.max(1))
}

/// RC send_bw: keeps `count` receives posted and checksums what lands, in order.
async fn rc_sink(rc: Arc<RcNet>, ring: Mr, slot: u64, count: u64, sink: Arc<Sink>, fail: FailTx) {
    let r: Res<()> = async {
        for k in 0..count {
            rc.post_recv(k, &ring, k * slot, slot as u32)?;
        }
        loop {
            let c = rc.recv().await?;
            let k = c.wr_id;
            {
                let mut st = sink.lock();
                ring.hash_into(&mut st.crc, k * slot, u64::from(c.byte_len))?;
                st.msgs += 1;
                st.bytes += u64::from(c.byte_len);
            }
            sink.changed.notify_waiters();
            rc.post_recv(k, &ring, k * slot, slot as u32)?;
        }
    }
    .await;
    if let Err(e) = r {
        let _ = fail.send(format!("send_bw receiver stopped: {e}"));
        sink.fail(e);
    }
}

/// RC send_lat: keeps `count` receives posted and SENDs every message back from its buffer
/// (which is posted again once that SEND completed).
async fn rc_echo(
    rc: Arc<RcNet>,
    ring: Mr,
    slot: u64,
    count: u64,
    echoed: Arc<AtomicU64>,
    fail: FailTx,
) {
    let r: Res<()> = async {
        for k in 0..count {
            rc.post_recv(k, &ring, k * slot, slot as u32)?;
        }
        let mut sends = FuturesUnordered::new();
        loop {
            tokio::select! {
                biased;
                Some(r) = sends.next() => {
                    let k: u64 = r?;
                    rc.post_recv(k, &ring, k * slot, slot as u32)?;
                }
                c = rc.recv() => {
                    let c = c?;
                    let (k, len) = (c.wr_id, u64::from(c.byte_len));
                    let (rc, ring) = (&rc, &ring);
                    sends.push(async move { rc.send(ring, k * slot, len).await.map(|_| k) });
                    echoed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
    .await;
    if let Err(e) = r {
        let _ = fail.send(format!("send_lat echo stopped: {e}"));
    }
}

/// write_lat counters of one round.
#[derive(Debug, Default)]
struct WlCounters {
    replies: AtomicU64,
    bad: AtomicU64,
}

/// write_lat: waits for the client's WRITE of iteration i (its immediate), WRITEs the
/// server's message i back into the client's region, then checks what landed.
async fn write_lat_round(
    net: Net,
    land: Mr,
    mine: Mr,
    peer: RemoteRegion,
    size: u64,
    expected: Vec<u8>,
    counters: Arc<WlCounters>,
) -> Res<()> {
    let mut replies = FuturesUnordered::new();
    let mut i: u64 = 0;
    loop {
        let imm = tokio::select! {
            biased;
            Some(r) = replies.next() => { r?; continue; }
            r = net.next_imm() => r?,
        };
        let slot = (i % 2) * size;
        replies.push(net.write(&mine, window(i), size, peer, slot, Some(i as u32)));
        // Post the reply now (its first poll), then check while it travels.
        if let Some(Some(r)) = replies.next().now_or_never() {
            r?;
        }
        counters.replies.fetch_add(1, Ordering::Relaxed);
        let w = window(i) as usize;
        if imm != i as u32 || !land.eq_at(slot, &expected[w..w + size as usize])? {
            counters.bad.fetch_add(1, Ordering::Relaxed);
        }
        i += 1;
    }
}

/// The state of the current size.
enum Round {
    /// A region the client accesses (write_bw, read_bw, read_lat).
    Region(Mr),
    /// The atomic counter at this offset of the region.
    Counter(Mr, u64),
    /// write_lat's answering task.
    WriteLat(JoinHandle<Res<()>>, Arc<WlCounters>),
    /// Nothing to keep (send tests).
    None,
}

/// Serves one client run over `net` with control channel `ctrl`; prints progress lines
/// when `print`. `rx_depth` is the receives kept posted by the RC send tests.
pub async fn serve(net: Net, mut ctrl: Chan, print: bool, rx_depth: usize) -> Res<ServerRun> {
    let mut run = ServerRun::default();
    let echoed = Arc::new(AtomicU64::new(0));
    let sink_state = Arc::new(Sink::default());
    let mut tasks: Vec<JoinHandle<()>> = Vec::new();
    let mut pool = Pool::default();
    let mut round = Round::None;
    let mut current = (0u64, 0u64, 0u64);
    let (fail, mut failed) = tokio::sync::mpsc::unbounded_channel::<String>();
    let result = loop {
        let msg = tokio::select! {
            m = ctrl.recv_raw() => m,
            Some(e) = failed.recv() => break Err(refuse(&mut ctrl, e).await),
        };
        let Some(msg) = msg else {
            break Err("the client went away before the end of the run".to_string());
        };
        let Some(m) = Ctrl::decode(&msg) else {
            break Err(refuse(&mut ctrl, "malformed control message".into()).await);
        };
        match m {
            Ctrl::Hello {
                test,
                rounds,
                max_size,
                qpn,
                psn,
                port,
            } => {
                let Some(t) = Test::from_code(test) else {
                    break Err(refuse(&mut ctrl, format!("unknown test code {test}")).await);
                };
                if max_size == 0 || max_size > super::cli::MAX_SIZE {
                    break Err(refuse(&mut ctrl, format!("invalid size {max_size}")).await);
                }
                if let Err(e) = net.connect(qpn, psn, port) {
                    break Err(refuse(&mut ctrl, e).await);
                }
                run.test = Some(t);
                run.client_qpn = qpn;
                if let Err(e) = start_services(
                    &net,
                    t,
                    max_size,
                    rx_depth,
                    &mut pool,
                    &echoed,
                    &sink_state,
                    &mut tasks,
                    &fail,
                ) {
                    break Err(refuse(&mut ctrl, e).await);
                }
                if print {
                    let who = match &net {
                        Net::Meta(c) => c
                            .remote_addr()
                            .map_or_else(|| "?".to_string(), |a| a.to_string()),
                        Net::Rc(rc) => format!("{}:{port}", rc.peer_ip),
                    };
                    super::report::client_banner(t, &who, qpn, rounds);
                }
                let (qpn, psn, port) = net.identity();
                ctrl.post(Ctrl::Welcome { qpn, psn, port }).await?;
            }
            Ctrl::Setup {
                size,
                iters,
                region_len,
                seed,
                peer,
            } => {
                let Some(test) = run.test else {
                    break Err(refuse(&mut ctrl, "SETUP before HELLO".into()).await);
                };
                if size == 0 || size > super::cli::MAX_SIZE {
                    break Err(refuse(&mut ctrl, format!("invalid size {size}")).await);
                }
                if region_len > MAX_REGION {
                    let text =
                        format!("region of {region_len} bytes refused (at most {MAX_REGION})");
                    break Err(refuse(&mut ctrl, text).await);
                }
                if let Round::WriteLat(h, _) = std::mem::replace(&mut round, Round::None) {
                    h.abort();
                }
                match setup_round(&net, test, size, region_len, seed, peer, &mut pool, &fail) {
                    Ok((r, remote)) => {
                        round = r;
                        if test == Test::SendBw {
                            *sink_state.lock() = SinkState::default();
                        }
                        current = (size, iters, region_len);
                        ctrl.post(Ctrl::Ready {
                            region: remote,
                            size,
                            iters,
                            slots: region_len.div_ceil(size),
                        })
                        .await?;
                    }
                    Err(e) => break Err(refuse(&mut ctrl, e).await),
                }
            }
            Ctrl::Done { check_len, ops } => {
                let (size, iters, region_len) = current;
                let test = run.test.unwrap_or(Test::WriteBw);
                let r = finish_round(
                    std::mem::replace(&mut round, Round::None),
                    test,
                    check_len,
                    &echoed,
                    &sink_state,
                    ops,
                )
                .await;
                let (crc, check_len, done_ops, value) = match r {
                    Ok(v) => v,
                    Err(e) => break Err(refuse(&mut ctrl, e).await),
                };
                ctrl.post(Ctrl::Result {
                    crc,
                    check_len,
                    ops: done_ops,
                    value,
                })
                .await?;
                if print {
                    print_round(test, size, ops, region_len, crc, check_len, done_ops, value);
                }
                run.rounds.push(ServerRound {
                    size,
                    iters,
                    region_len,
                    check_len,
                    crc,
                    client_ops: ops,
                    value,
                });
            }
            Ctrl::Bye => {
                // Stay until the client closes (or a short while), so that a retransmitted
                // BYE or the last acknowledgements still get through.
                run.stats = Some(net.stats());
                ctrl.linger(LINGER).await;
                break Ok(());
            }
            other => {
                let text = format!("unexpected control message {other:?}");
                break Err(refuse(&mut ctrl, text).await);
            }
        }
    };
    run.echoed = echoed.load(Ordering::Relaxed);
    if run.stats.is_none() {
        run.stats = Some(net.stats());
    }
    if let Round::WriteLat(h, _) = round {
        h.abort();
    }
    for t in tasks {
        t.abort();
    }
    result.map(|()| run)
}

/// The receivers and echoers a test needs for the whole run.
#[allow(clippy::too_many_arguments)]
fn start_services(
    net: &Net,
    test: Test,
    max_size: u64,
    rx_depth: usize,
    pool: &mut Pool,
    echoed: &Arc<AtomicU64>,
    sink_state: &Arc<Sink>,
    tasks: &mut Vec<JoinHandle<()>>,
    fail: &FailTx,
) -> Res<()> {
    match (net, test) {
        (Net::Meta(conn), Test::SendLat | Test::SendBw) => {
            // Every stream after the control stream carries the test's messages.
            let conn = conn.clone();
            let (echoed, sink_state, fail) = (echoed.clone(), sink_state.clone(), fail.clone());
            tasks.push(tokio::spawn(async move {
                while let Some(stream) = conn.accept_stream().await {
                    if test == Test::SendLat {
                        tokio::spawn(echo(stream, echoed.clone(), fail.clone()));
                    } else {
                        tokio::spawn(sink(stream, sink_state.clone()));
                    }
                }
            }));
        }
        (Net::Rc(rc), Test::SendBw | Test::SendLat) => {
            let cap = if test == Test::SendLat { 16 } else { u64::MAX };
            let (slot, count) = ring_shape(max_size, rx_depth, cap);
            let ring = pool.get(
                net,
                "ring",
                slot * count,
                Access::LOCAL_WRITE,
                Fill::Byte(0),
            )?;
            let rc = rc.clone();
            tasks.push(if test == Test::SendBw {
                tokio::spawn(rc_sink(
                    rc,
                    ring,
                    slot,
                    count,
                    sink_state.clone(),
                    fail.clone(),
                ))
            } else {
                tokio::spawn(rc_echo(rc, ring, slot, count, echoed.clone(), fail.clone()))
            });
        }
        (_, Test::WriteLat) => net.prepare_imm()?,
        _ => {}
    }
    Ok(())
}

/// Allocates what the client's operations of one size target; returns the round state and
/// the descriptor for READY.
#[allow(clippy::too_many_arguments)]
fn setup_round(
    net: &Net,
    test: Test,
    size: u64,
    region_len: u64,
    seed: u64,
    peer: RemoteRegion,
    pool: &mut Pool,
    fail: &FailTx,
) -> Res<(Round, RemoteRegion)> {
    let rw = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let rr = Access::LOCAL_WRITE | Access::REMOTE_READ;
    Ok(match test {
        Test::WriteBw => {
            let mr = pool.get(net, "dst", region_len, rw, Fill::Byte(DEST_FILL))?;
            let remote = mr.remote();
            (Round::Region(mr), remote)
        }
        Test::ReadBw | Test::ReadLat => {
            let mr = pool.get(net, "src", region_len, rr, Fill::Random(seed))?;
            let remote = mr.remote();
            (Round::Region(mr), remote)
        }
        Test::AtomicLat => {
            let access = Access::LOCAL_WRITE | Access::REMOTE_ATOMIC;
            let mr = pool.get(net, "counter", 16, access, Fill::Byte(0))?;
            let (off, remote) = aligned8(mr.remote()).ok_or("counter region too small")?;
            mr.write(off, &atomic_initial(seed).to_le_bytes())?;
            (Round::Counter(mr, off), remote)
        }
        Test::WriteLat => {
            if peer.len < 2 * size {
                return Err(format!(
                    "write_lat needs a client region of {} bytes, got {}",
                    2 * size,
                    peer.len
                ));
            }
            let land = pool.get(net, "wl_dst", 2 * size, rw, Fill::Byte(0))?;
            let mine = pool.get(
                net,
                "wl_src",
                size + VARIANTS,
                Access::LOCAL_WRITE,
                Fill::Random(server_pattern_seed(seed)),
            )?;
            let remote = land.remote();
            let expected = pattern(client_pattern_seed(seed), size);
            let counters = Arc::new(WlCounters::default());
            let answering = write_lat_round(
                net.clone(),
                land,
                mine,
                peer,
                size,
                expected,
                counters.clone(),
            );
            let fail = fail.clone();
            let h = tokio::spawn(async move {
                let r = answering.await;
                if let Err(e) = &r {
                    let _ = fail.send(format!("answering WRITEs: {e}"));
                }
                r
            });
            (Round::WriteLat(h, counters), remote)
        }
        Test::SendBw | Test::SendLat => (Round::None, NO_REGION),
    })
}

/// The RESULT of one size: (crc, check_len, ops, value).
async fn finish_round(
    round: Round,
    test: Test,
    check_len: u64,
    echoed: &AtomicU64,
    sink_state: &Sink,
    ops: u64,
) -> Res<(u32, u64, u64, u64)> {
    Ok(match (round, test) {
        (Round::Region(mr), Test::WriteBw | Test::ReadBw) => {
            let n = check_len.min(mr.len());
            (mr.crc(0, n)?, n, 0, 0)
        }
        (Round::Counter(mr, off), _) => (0, 0, 0, mr.read_u64(off)?),
        (Round::WriteLat(h, counters), _) => {
            // The client sent DONE after the reply to its last WRITE arrived: the task
            // waits for a WRITE that will not come (or is finishing its last check).
            h.abort();
            if let Ok(Err(e)) = h.await {
                return Err(format!("answering WRITEs: {e}"));
            }
            (
                0,
                0,
                counters.replies.load(Ordering::Relaxed),
                counters.bad.load(Ordering::Relaxed),
            )
        }
        (_, Test::SendBw) => {
            let (crc, msgs, bytes) = sink_state.wait_for(ops).await?;
            (crc, bytes, msgs, bytes)
        }
        (_, Test::SendLat) => (0, 0, echoed.load(Ordering::Relaxed), 0),
        _ => (0, 0, 0, 0),
    })
}

#[allow(clippy::too_many_arguments)]
fn print_round(
    test: Test,
    size: u64,
    ops: u64,
    region_len: u64,
    crc: u32,
    check_len: u64,
    done_ops: u64,
    value: u64,
) {
    match test {
        Test::WriteBw => println!(
            " {size:>10} B x {ops:<8} destination {region_len} B, checksum 0x{crc:08x} over {check_len} B"
        ),
        Test::ReadBw => println!(
            " {size:>10} B x {ops:<8} READ source {region_len} B, checksum 0x{crc:08x} over {check_len} B"
        ),
        Test::SendBw => println!(
            " {size:>10} B x {ops:<8} received {done_ops} messages, {value} B, checksum 0x{crc:08x}"
        ),
        Test::WriteLat => println!(
            " {size:>10} B x {ops:<8} answered {done_ops} WRITEs, {value} landed wrong"
        ),
        Test::ReadLat => println!(" {size:>10} B x {ops:<8} READs served"),
        Test::AtomicLat => println!(
            " {size:>10} B x {ops:<8} FETCH_AND_ADDs, counter now 0x{value:016x}"
        ),
        Test::SendLat => println!(" send_lat round done: {done_ops} messages echoed so far"),
    }
}
