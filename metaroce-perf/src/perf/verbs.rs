//! `--backend verbs`: write_bw and send_lat on an RDMA device through metaroce-verbs, with
//! perftest's device flags (`-d DEVICE`, `-x GID_INDEX`). Both QPs live in this process
//! (RC loopback on the device), as perftest's server and client on one host; the figures
//! are meant to be read beside `ib_write_bw` / `ib_send_lat` run in the same place.
//!
//! * write_bw: `-n` RDMA WRITEs of `-s` bytes (default 65536 × 5000) with `-t` outstanding
//!   (default 128, at most the QP's `max_rdma_wr`); bandwidth = bytes / time from the first
//!   post to the last completion; then the destination is compared with the source.
//! * send_lat: `-n` SEND ping-pongs of `-s` bytes (default 2 × 1000); each one-way latency
//!   is half a round trip (one clock read per iteration, as perftest); t_typical is the
//!   median (perftest's definition). Like ib_send_lat, the CQs are busy-polled
//!   (`CqPoll::BusySpin`, up to 1 s per wait) and SENDs of at most 236 bytes go inline,
//!   unless `-e` (events: CQ task + completion channel, no inline). By default the echo QP
//!   runs on its own OS thread with its own current-thread runtime, as ib_send_lat's
//!   server is its own process; `--verbs-layer` selects other arrangements, down to the
//!   bare verbs (`raw`), to show what each layer costs (docs/RESULTS.md).

use super::cli::{Args, Test, VerbsLayer};
use futures::stream::{FuturesUnordered, StreamExt};
use metaroce_verbs::{Access, Context, CqPoll, QpConfig, RcQp};
use std::time::{Duration, Instant};

fn test_of(args: &Args) -> Result<Test, String> {
    match args.first.as_deref() {
        None => Ok(Test::WriteBw),
        Some(a) => match Test::from_name(a) {
            Some(t @ (Test::WriteBw | Test::SendLat)) => Ok(t),
            Some(t) => Err(format!(
                "--backend verbs runs write_bw and send_lat, not {}",
                t.name()
            )),
            None => Err(format!(
                "--backend verbs runs both sides in this process; {a:?} is not a test"
            )),
        },
    }
}

/// Entry point for `--backend verbs`; returns the exit status.
pub fn main(args: &Args) -> i32 {
    let test = match test_of(args) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("metaroce-perf: {e}");
            return 2;
        }
    };
    let mut b = if test == Test::SendLat && args.verbs_layer == VerbsLayer::Mt {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(2);
        b
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    let rt = match b.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("metaroce-perf: cannot start the async runtime: {e}");
            return 1;
        }
    };
    let r = rt.block_on(async {
        match test {
            Test::WriteBw => write_bw(args).await,
            _ => send_lat(args).await,
        }
    });
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("metaroce-perf: {e}");
            1
        }
    }
}

fn open(args: &Args, cfg: QpConfig) -> Result<(Context, metaroce_verbs::Pd, RcQp, RcQp), String> {
    let ctx = Context::open(args.ib_dev.as_deref()).map_err(|e| e.to_string())?;
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let cfg = QpConfig {
        gid_index: args.gid_index,
        ..cfg
    };
    let qa = RcQp::create(&pd, cfg.clone()).map_err(|e| e.to_string())?;
    let qb = RcQp::create(&pd, cfg).map_err(|e| e.to_string())?;
    qa.connect(&qb.local()).map_err(|e| e.to_string())?;
    qb.connect(&qa.local()).map_err(|e| e.to_string())?;
    println!(
        "# metaroce-verbs on {} port 1, GID index {} ({}), QPNs {:#x} -> {:#x}",
        ctx.name(),
        qa.gid_index(),
        qa.local().gid,
        qa.qpn(),
        qb.qpn()
    );
    Ok((ctx, pd, qa, qb))
}

/// write_bw over one [`MpConnection`] of `k` RC QPs, both ends in this process (the
/// control channel over loopback TCP): `-n` WRITEs of `-s` bytes, `-t` outstanding.
async fn mp_write_bw(args: &Args, k: usize) -> Result<(), String> {
    use metaroce::multipath::MultipathConfig;
    use metaroce_verbs::{MpConfig, MpConnection};
    let size = args.size.unwrap_or(65536);
    let iters = args.iters.unwrap_or(5000);
    let depth = args.tx_depth.clamp(1, 1024);
    if size == 0 || size > 1 << 30 {
        return Err(format!("-s {size}: want 1 .. 2^30"));
    }
    let ctx = Context::open(args.ib_dev.as_deref()).map_err(|e| e.to_string())?;
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let mut cfg = MpConfig {
        multipath: MultipathConfig {
            qps: k,
            ..MultipathConfig::default()
        },
        ..MpConfig::default()
    };
    cfg.qp.gid_index = args.gid_index;
    cfg.qp.recv_slots = 0;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let (server, client) = tokio::join!(
        async {
            let (tcp, _) = listener.accept().await.map_err(|e| e.to_string())?;
            MpConnection::accept(&pd, cfg.clone(), tcp)
                .await
                .map_err(|e| e.to_string())
        },
        async {
            let tcp = tokio::net::TcpStream::connect(addr)
                .await
                .map_err(|e| e.to_string())?;
            MpConnection::connect(&pd, cfg.clone(), tcp)
                .await
                .map_err(|e| e.to_string())
        }
    );
    let (_server, client) = (server?, client?);
    println!(
        "# metaroce-verbs multipath on {}: {k} RC QPs, UDP source ports {:?}",
        ctx.name(),
        client.stats().ports.iter().map(|p| p.1).collect::<Vec<_>>()
    );
    let (src, dst) = bw_regions(&pd, size)?;
    let remote = dst.remote();
    let mut inflight = FuturesUnordered::new();
    let (mut posted, mut done) = (0u64, 0u64);
    let t0 = Instant::now();
    while done < iters {
        while posted < iters && inflight.len() < depth {
            let (c, src) = (client.clone(), src.clone());
            inflight.push(async move { c.write(&src, 0, size, &remote, 0).await });
            posted += 1;
        }
        match inflight.next().await {
            Some(r) => {
                r.map_err(|e| e.to_string())?;
                done += 1;
            }
            None => break,
        }
    }
    let gbps = report_bw(&src, &dst, size, iters, t0.elapsed())?;
    let st = client.stats();
    println!(
        "# chunks per QP {:?}",
        st.slots.iter().map(|s| s.posted_chunks).collect::<Vec<_>>()
    );
    println!("write_bw_gbps={gbps:.6}");
    Ok(())
}

async fn write_bw(args: &Args) -> Result<(), String> {
    if let Some(k) = args.qps {
        return mp_write_bw(args, k).await;
    }
    let size = args.size.unwrap_or(65536);
    let iters = args.iters.unwrap_or(5000);
    let depth = args.tx_depth.clamp(1, 1024);
    if size == 0 || size > 1 << 30 {
        return Err(format!("-s {size}: want 1 .. 2^30"));
    }
    let cfg = QpConfig {
        max_rdma_wr: depth as u32,
        recv_slots: 1,
        send_slots: 1,
        slot_size: 64,
        path_mtu: 1024,
        ..QpConfig::default()
    };
    let (_ctx, pd, qa, _qb) = open(args, cfg)?;
    let (src, dst) = bw_regions(&pd, size)?;
    let remote = dst.remote();
    let mut inflight = FuturesUnordered::new();
    let mut posted = 0u64;
    let mut done = 0u64;
    let t0 = Instant::now();
    while done < iters {
        while posted < iters && inflight.len() < depth {
            let op = qa
                .post_write(&src, 0, size, &remote, 0, None)
                .map_err(|e| e.to_string())?;
            inflight.push(op);
            posted += 1;
        }
        match inflight.next().await {
            Some(r) => {
                r.and_then(|wc| wc.ok()).map_err(|e| e.to_string())?;
                done += 1;
            }
            None => break,
        }
    }
    let gbps = report_bw(&src, &dst, size, iters, t0.elapsed())?;
    println!("write_bw_gbps={gbps:.6}");
    Ok(())
}

/// The source (a fixed byte pattern, LOCAL_WRITE) and destination (zeroes, LOCAL_WRITE |
/// REMOTE_WRITE) regions of a write_bw run, `size` bytes each.
fn bw_regions(
    pd: &metaroce_verbs::Pd,
    size: u64,
) -> Result<(metaroce_verbs::Mr, metaroce_verbs::Mr), String> {
    let src: Vec<u8> = (0..size)
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add(3))
        .collect();
    let src = pd
        .register(src, Access::LOCAL_WRITE)
        .map_err(|e| e.to_string())?;
    let dst = pd
        .register(
            vec![0u8; size as usize],
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        )
        .map_err(|e| e.to_string())?;
    Ok((src, dst))
}

/// Checks that `dst` holds `src`'s bytes, prints perftest's bandwidth row for `iters`
/// WRITEs of `size` bytes in `elapsed`, and returns the bandwidth in Gbit/s.
fn report_bw(
    src: &metaroce_verbs::Mr,
    dst: &metaroce_verbs::Mr,
    size: u64,
    iters: u64,
    elapsed: Duration,
) -> Result<f64, String> {
    let dt = elapsed.as_secs_f64();
    if dst.read(0, size as usize).map_err(|e| e.to_string())?
        != src.read(0, size as usize).map_err(|e| e.to_string())?
    {
        return Err("destination differs from the source after the run".into());
    }
    let bytes = (size * iters) as f64;
    let gbps = bytes * 8.0 / dt / 1e9;
    println!(" #bytes     #iterations    BW average[Gb/sec]   BW average[MiB/sec]   MsgRate[Mpps]");
    println!(
        " {:<10} {:<14} {:<20.4} {:<21.2} {:.6}",
        size,
        iters,
        gbps,
        bytes / dt / (1 << 20) as f64,
        iters as f64 / dt / 1e6
    );
    Ok(gbps)
}

fn send_lat_cfg(args: &Args, size: u64) -> QpConfig {
    QpConfig {
        slot_size: (size as u32).max(1),
        recv_slots: 16,
        send_slots: 16,
        max_rdma_wr: 1,
        poll: if args.events {
            CqPoll::Events
        } else {
            CqPoll::BusySpin {
                max: Duration::from_secs(1),
            }
        },
        max_inline_data: if args.events { 0 } else { 236 },
        gid_index: args.gid_index,
        ..QpConfig::default()
    }
}

/// The echo side of send_lat over the RcQp API: `iters` times, receive and send back.
async fn echo_loop(qb: &RcQp, expect: usize, iters: u64) -> Result<(), String> {
    let echo_msg = vec![0x5au8; expect];
    let mut buf = vec![0u8; expect.max(1)];
    for _ in 0..iters {
        let m = qb.recv_into(&mut buf).await.map_err(|e| e.to_string())?;
        if m.byte_len as usize != expect {
            return Err(format!("echo got {} bytes", m.byte_len));
        }
        qb.post_send(&echo_msg, None).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The initiating side of send_lat over the RcQp API; returns each round trip in µs.
async fn ping_loop(qa: &RcQp, msg: &[u8], iters: u64) -> Result<Vec<f64>, String> {
    // One clock read per iteration, as perftest's latency tests (a round trip is the time
    // between consecutive stamps): in a TCG guest whose clocksource is the emulated HPET a
    // read costs about 1 us.
    let mut rtts = Vec::with_capacity(iters as usize);
    let mut t = Instant::now();
    let mut buf = vec![0u8; msg.len().max(1)];
    for _ in 0..iters {
        qa.post_send(msg, None).map_err(|e| e.to_string())?;
        let m = qa.recv_into(&mut buf).await.map_err(|e| e.to_string())?;
        let now = Instant::now();
        rtts.push((now - t).as_secs_f64() * 1e6);
        t = now;
        if m.byte_len as usize != msg.len() || buf[..m.len] != *msg {
            return Err("echo differs".into());
        }
    }
    Ok(rtts)
}

fn join_err<T>(r: std::thread::Result<Result<T, String>>) -> Result<T, String> {
    r.map_err(|_| "a send_lat thread panicked".to_string())?
}

async fn send_lat(args: &Args) -> Result<(), String> {
    let size = args.size.unwrap_or(2);
    let iters = args.iters.unwrap_or(1000);
    if size > 1 << 20 {
        return Err(format!("-s {size}: at most 1 MiB for send_lat"));
    }
    let cfg = send_lat_cfg(args, size);
    let msg = vec![0x5au8; size as usize];
    let layer = args.verbs_layer;
    println!("# send_lat layer {layer:?}");
    let rtts = match layer {
        VerbsLayer::Runtimes => {
            // The echo QP lives on its own thread's runtime (its CQ task too), as
            // ib_send_lat's server process; endpoints cross over std channels.
            let ctx = Context::open(args.ib_dev.as_deref()).map_err(|e| e.to_string())?;
            let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
            let qa = RcQp::create(&pd, cfg.clone()).map_err(|e| e.to_string())?;
            let (to_echo, from_main) = std::sync::mpsc::channel();
            let (to_main, from_echo) = tokio::sync::oneshot::channel();
            let (pd2, cfg2, n) = (pd.clone(), cfg.clone(), size as usize);
            let echo = std::thread::spawn(move || -> Result<(), String> {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| e.to_string())?;
                rt.block_on(async move {
                    let qb = RcQp::create(&pd2, cfg2).map_err(|e| e.to_string())?;
                    let _ = to_main.send(qb.local());
                    let remote = from_main
                        .recv()
                        .map_err(|_| "send_lat: no endpoint from the client".to_string())?;
                    qb.connect(&remote).map_err(|e| e.to_string())?;
                    echo_loop(&qb, n, iters).await
                })
            });
            let rb = from_echo
                .await
                .map_err(|_| "send_lat: the echo thread did not start".to_string());
            let rb = match rb {
                Ok(rb) => rb,
                Err(e) => return join_err(echo.join()).and(Err(e)),
            };
            qa.connect(&rb).map_err(|e| e.to_string())?;
            let _ = to_echo.send(qa.local());
            println!(
                "# metaroce-verbs on {} port 1, GID index {} ({}), QPNs {:#x} -> {:#x}",
                ctx.name(),
                qa.gid_index(),
                qa.local().gid,
                qa.qpn(),
                rb.qpn
            );
            let rtts = ping_loop(&qa, &msg, iters).await?;
            join_err(echo.join())?;
            rtts
        }
        VerbsLayer::Runtime | VerbsLayer::Mt => {
            let (_ctx, _pd, qa, qb) = open(args, cfg)?;
            let n = size as usize;
            let echo = tokio::spawn(async move { echo_loop(&qb, n, iters).await });
            let rtts = ping_loop(&qa, &msg, iters).await?;
            echo.await.map_err(|e| e.to_string())??;
            rtts
        }
        VerbsLayer::Raw | VerbsLayer::Threads => {
            // Both QPs were created on this runtime, whose CQ tasks do not run while this
            // thread waits for the two below: they poll their own CQs.
            let (_ctx, _pd, qa, qb) = open(args, cfg)?;
            let h = tokio::runtime::Handle::current();
            let n = size as usize;
            std::thread::scope(|sc| {
                let h2 = h.clone();
                let echo = sc.spawn(move || -> Result<(), String> {
                    if layer == VerbsLayer::Raw {
                        qb.probe_pingpong(false, &vec![0x5au8; n], iters)
                            .map(drop)
                            .map_err(|e| e.to_string())
                    } else {
                        let _g = h2.enter();
                        futures::executor::block_on(echo_loop(&qb, n, iters))
                    }
                });
                let ping = sc.spawn(|| -> Result<Vec<f64>, String> {
                    if layer == VerbsLayer::Raw {
                        qa.probe_pingpong(true, &msg, iters)
                            .map_err(|e| e.to_string())
                    } else {
                        let _g = h.enter();
                        futures::executor::block_on(ping_loop(&qa, &msg, iters))
                    }
                });
                let rtts = join_err(ping.join());
                let e = join_err(echo.join());
                let rtts = rtts?;
                e?;
                Ok::<_, String>(rtts)
            })?
        }
    };
    report_lat(size, &rtts);
    Ok(())
}

fn report_lat(size: u64, rtts: &[f64]) {
    let mut half: Vec<f64> = rtts.iter().map(|r| r / 2.0).collect();
    if half.is_empty() {
        return;
    }
    half.sort_by(|a, b| a.total_cmp(b));
    let n = half.len();
    let pct = |p: f64| half[((n as f64 * p) as usize).min(n - 1)];
    let avg = half.iter().sum::<f64>() / n as f64;
    println!(" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    99% percentile[usec]");
    println!(
        " {:<6} {:<12} {:<14.2} {:<12.2} {:<16.2} {:<14.2} {:.2}",
        size,
        n,
        half[0],
        half[n - 1],
        pct(0.5),
        avg,
        pct(0.99)
    );
    println!("send_lat_typical_usec={:.3}", pct(0.5));
}
