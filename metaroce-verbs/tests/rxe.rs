//! metaroce-verbs on a real verbs stack: two RC QPs on one device (rdma_rxe loopback in
//! the QEMU guest of `run-rxe-tests.sh`). Without an RDMA device each test prints
//! "skipped" and passes, unless `METAROCE_VERBS_REQUIRE_DEVICE=1` (set by the script in the
//! guest), which turns a missing device into a failure.

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use metaroce_verbs::{
    Access, Context, CqPoll, Error, GidType, MessageStream, Pd, QpConfig, RcQp, RemoteRegion,
    WcStatus,
};
use std::time::Duration;

fn device() -> Option<(Context, Pd)> {
    match Context::open(std::env::var("METAROCE_VERBS_DEVICE").ok().as_deref()) {
        Ok(ctx) => {
            let pd = ctx.alloc_pd().expect("ibv_alloc_pd");
            Some((ctx, pd))
        }
        Err(e) => {
            if std::env::var("METAROCE_VERBS_REQUIRE_DEVICE").is_ok_and(|v| v == "1") {
                panic!("METAROCE_VERBS_REQUIRE_DEVICE=1 but no device: {e}");
            }
            eprintln!("skipped: {e}");
            None
        }
    }
}

fn pair(pd: &Pd, a: QpConfig, b: QpConfig) -> (RcQp, RcQp) {
    let qa = RcQp::create(pd, a).expect("create qa");
    let qb = RcQp::create(pd, b).expect("create qb");
    qa.connect(&qb.local()).expect("connect qa");
    qb.connect(&qa.local()).expect("connect qb");
    (qa, qb)
}

/// A QP pair whose first SEND (returned) stays in flight, holding `qa`'s only send slot:
/// the peer posts no receive and the sender retries RNR forever.
fn stuck_send(pd: &Pd, poll: CqPoll) -> (RcQp, RcQp, metaroce_verbs::OpFuture) {
    let a = QpConfig {
        send_slots: 1,
        rnr_retry: 7,
        poll,
        ..QpConfig::default()
    };
    let b = QpConfig {
        recv_slots: 0,
        min_rnr_timer: 1,
        ..QpConfig::default()
    };
    let (qa, qb) = pair(pd, a, b);
    let stuck = qa.post_send(b"first", None).unwrap();
    (qa, qb, stuck)
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

async fn timeout<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .expect("operation timed out")
}

fn status_of(r: Result<impl std::fmt::Debug, Error>) -> WcStatus {
    match r {
        Err(Error::Completion { status, .. }) => status,
        other => panic!("expected an error completion, got {other:?}"),
    }
}

#[test]
fn device_port_and_roce_v2_gid() {
    let Some((ctx, _pd)) = device() else { return };
    let port = ctx.query_port(1).unwrap();
    println!("{}: {port:?}", ctx.name());
    assert_eq!(port.state, 4, "port ACTIVE");
    assert_eq!(port.link_layer, 2, "Ethernet link layer (RoCE)");
    let table = ctx.gid_table(1).unwrap();
    for e in &table {
        println!("  GID[{}] {} {:?}", e.index, e.gid, e.kind);
    }
    let v4 = ctx.select_gid(1, true).unwrap();
    assert_eq!(v4.kind, GidType::RoceV2);
    assert!(v4.gid.to_ipv4_mapped().is_some(), "{v4:?}");
    assert_eq!(ctx.gid(1, v4.index).unwrap(), v4.gid);
    if let Ok(v6) = ctx.select_gid(1, false) {
        assert_eq!(v6.kind, GidType::RoceV2);
        assert!(v6.gid.to_ipv4_mapped().is_none());
    }
    assert!(matches!(
        Context::open(Some("no-such-dev9")),
        Err(Error::NoDevice(Some(_)))
    ));
}

#[tokio::test]
async fn send_recv_ordered_stream_with_imm_and_edge_sizes() {
    let Some((_ctx, pd)) = device() else { return };
    let cfg = QpConfig {
        slot_size: 8192,
        send_slots: 16,
        recv_slots: 32,
        ..QpConfig::default()
    };
    let (qa, qb) = pair(&pd, cfg.clone(), cfg);
    // Zero-length, one byte, and the largest message; with immediate data.
    qa.send(&[], Some(7)).await.unwrap();
    let m = timeout(qb.recv()).await.unwrap();
    assert!(m.data.is_empty());
    assert_eq!(m.imm, Some(7));
    qa.send(&[0xab], None).await.unwrap();
    let m = timeout(qb.recv()).await.unwrap();
    assert_eq!(&m.data[..], &[0xab]);
    assert_eq!(m.imm, None);
    let big = pattern(8192, 3);
    qa.send(&big, Some(0xdead_beef)).await.unwrap();
    let m = timeout(qb.recv()).await.unwrap();
    assert_eq!(m.data, big);
    assert_eq!(m.imm, Some(0xdead_beef));
    assert!(matches!(
        qa.send(&pattern(8193, 0), None).await,
        Err(Error::InvalidArgument(_))
    ));
    // 300 messages through the Sink / Stream pair: order and content preserved, more
    // messages than send or receive slots.
    let mut tx = MessageStream::new(qa.clone());
    let mut rx = MessageStream::new(qb.clone());
    let n = 300usize;
    let sender = tokio::spawn(async move {
        for i in 0..n {
            let mut m = pattern(1 + (i * 37) % 4000, i as u8);
            m[0] = i as u8;
            tx.feed(Bytes::from(m)).await.unwrap();
        }
        tx.flush().await.unwrap();
    });
    for i in 0..n {
        let m = timeout(rx.next()).await.unwrap().unwrap();
        let mut want = pattern(1 + (i * 37) % 4000, i as u8);
        want[0] = i as u8;
        assert_eq!(m.data, want, "message {i}");
    }
    sender.await.unwrap();
    assert_eq!(qa.unknown_completions() + qb.unknown_completions(), 0);
}

/// CqPoll::BusySpin + max_inline_data: waiters on one current-thread runtime poll their
/// CQs themselves (cooperatively: the peer's echo task runs on the same thread), inline and
/// non-inline SENDs keep order and content; a spin bound too short for any completion
/// (1 ns) falls back to the CQ task and completion events and still completes.
#[tokio::test]
async fn busy_spin_and_inline_sends_ping_pong() {
    let Some((_ctx, pd)) = device() else { return };
    for max in [Duration::from_secs(1), Duration::from_nanos(1)] {
        let cfg = QpConfig {
            slot_size: 512,
            send_slots: 8,
            recv_slots: 8,
            poll: CqPoll::BusySpin { max },
            max_inline_data: 64,
            ..QpConfig::default()
        };
        let (qa, qb) = pair(&pd, cfg.clone(), cfg);
        let n = 200usize;
        let qb2 = qb.clone();
        let echo = tokio::spawn(async move {
            for _ in 0..n {
                let m = qb2.recv().await.unwrap();
                qb2.send(&m.data, m.imm).await.unwrap();
            }
        });
        for i in 0..n {
            // 0..=127 bytes: both sides of the 64-byte inline limit.
            let msg = pattern(i % 128, i as u8);
            let wc = timeout(qa.send(&msg, Some(i as u32))).await.unwrap();
            assert_eq!(wc.status, WcStatus::Success);
            let m = timeout(qa.recv()).await.unwrap();
            assert_eq!(m.data, msg, "message {i} (spin {max:?})");
            assert_eq!(m.imm, Some(i as u32));
        }
        timeout(echo).await.unwrap();
        assert_eq!(qa.unknown_completions() + qb.unknown_completions(), 0);
    }
}

/// The echo QP on its own thread with its own current-thread runtime (as the send_lat of
/// metaroce-perf runs it, and as two processes would): BusySpin waiters on two runtimes
/// ping-pong with content and immediates intact; with a spin bound too short for any
/// completion (1 ns) every wait falls back to its QP's CQ task, which is only woken by the
/// last spinner leaving (no timer): a lost wake-up would hang here (the 60 s timeout).
#[tokio::test]
async fn busy_spin_echo_on_its_own_runtime() {
    let Some((_ctx, pd)) = device() else { return };
    for max in [Duration::from_secs(1), Duration::from_nanos(1)] {
        let cfg = QpConfig {
            slot_size: 256,
            send_slots: 8,
            recv_slots: 8,
            poll: CqPoll::BusySpin { max },
            max_inline_data: 64,
            ..QpConfig::default()
        };
        let qa = RcQp::create(&pd, cfg.clone()).expect("create qa");
        let (to_echo, from_main) = std::sync::mpsc::channel();
        let (to_main, from_echo) = tokio::sync::oneshot::channel();
        let n = 300usize;
        let pd2 = pd.clone();
        let echo = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let qb = RcQp::create(&pd2, cfg).expect("create qb");
                to_main.send(qb.local()).unwrap();
                qb.connect(&from_main.recv().unwrap()).expect("connect qb");
                for _ in 0..n + 16 {
                    let m = timeout(qb.recv()).await.unwrap();
                    timeout(qb.send(&m.data, m.imm)).await.unwrap();
                }
                qb.unknown_completions()
            })
        });
        qa.connect(&timeout(from_echo).await.unwrap())
            .expect("connect qa");
        to_echo.send(qa.local()).unwrap();
        for i in 0..n {
            let msg = pattern(i % 200, i as u8);
            qa.post_send(&msg, Some(i as u32)).unwrap();
            let m = timeout(qa.recv()).await.unwrap();
            assert_eq!(m.data, msg, "message {i} (spin {max:?})");
            assert_eq!(m.imm, Some(i as u32));
        }
        // Send slots were all given back (the earlier SENDs' completions dispatched by
        // the spinning receives): 16 waited SENDs through 8 slots.
        for i in 0..16u8 {
            timeout(qa.send(&[i], None)).await.unwrap();
            assert_eq!(timeout(qa.recv()).await.unwrap().data, vec![i]);
        }
        assert_eq!(echo.join().unwrap(), 0);
        assert_eq!(qa.unknown_completions(), 0);
    }
}

/// Under BusySpin the CQ task stays off the CQ while waiters spin, and is woken only
/// when the last spinner leaves while somebody sleeps (or somebody starts to sleep while
/// nobody spins). This waiter sleeps (a `send` waiting for the only send slot, held by a
/// SEND the peer answers with RNR) while another task spins in `recv`; the spinner then
/// gets a message and leaves. The flush that frees the slot must then reach the sleeper
/// through the CQ task: a lost wake-up hangs here (the 60 s timeout). Fire-and-forget
/// completions meanwhile wait in the CQ for the next waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_spin_a_sleeper_is_served_after_the_last_spinner_leaves() {
    let Some((_ctx, pd)) = device() else { return };
    let (qa, qb, stuck) = stuck_send(
        &pd,
        CqPoll::BusySpin {
            max: Duration::from_secs(30),
        },
    );
    let qa_spin = qa.clone();
    let spinner = tokio::spawn(async move { qa_spin.recv().await.map(|m| m.data) });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let qa_sleep = qa.clone();
    let sleeper = tokio::spawn(async move { qa_sleep.send(b"second", None).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !sleeper.is_finished(),
        "send() must wait while no slot is free"
    );
    assert!(!spinner.is_finished());
    // The spinner gets its message and leaves; the sleeper still waits.
    timeout(qb.send(b"wake", None)).await.unwrap();
    assert_eq!(timeout(spinner).await.unwrap().unwrap(), &b"wake"[..]);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!sleeper.is_finished());
    // Nobody spins now: the flush must reach the sleeper through the CQ task.
    qa.set_error().unwrap();
    let st = status_of(timeout(sleeper).await.unwrap());
    assert_eq!(st, WcStatus::WrFlushError);
    assert_eq!(timeout(stuck).await.unwrap().status, WcStatus::WrFlushError);
    assert_eq!(qa.unknown_completions(), 0);
}

/// `recv_into` copies into the caller's buffer without allocating: whole messages,
/// a truncated one (its length reported, the tail not copied), empty ones, a
/// WRITE_WITH_IMM's notice, in order with `recv`, and every slot is reposted.
#[tokio::test]
async fn recv_into_copies_truncates_and_reposts() {
    let Some((_ctx, pd)) = device() else { return };
    let cfg = QpConfig {
        slot_size: 256,
        recv_slots: 4,
        ..QpConfig::default()
    };
    let (qa, qb) = pair(&pd, cfg.clone(), cfg);
    let mut buf = [0u8; 100];
    // More messages than receive slots: each recv_into must repost its slot.
    for i in 0..12usize {
        let msg = pattern([0, 1, 99, 100, 101, 256][i % 6], i as u8);
        timeout(qa.send(&msg, Some(i as u32))).await.unwrap();
        let r = timeout(qb.recv_into(&mut buf)).await.unwrap();
        assert_eq!(r.byte_len as usize, msg.len(), "message {i}");
        assert_eq!(r.len, msg.len().min(100));
        assert_eq!(&buf[..r.len], &msg[..r.len]);
        assert_eq!(r.truncated(), msg.len() > 100);
        assert_eq!(r.imm, Some(i as u32));
        assert!(!r.is_write_imm);
    }
    // A WRITE_WITH_IMM reports its length; its bytes are in the MR, not in `buf`.
    let mr = pd
        .register(vec![0u8; 4096], Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    let src = pd.register(pattern(300, 7), Access::LOCAL_WRITE).unwrap();
    buf.fill(0xEE);
    timeout(qa.write_with_imm(&src, 0, 300, &mr.remote(), 0, 42))
        .await
        .unwrap();
    let r = timeout(qb.recv_into(&mut buf)).await.unwrap();
    assert!(r.is_write_imm && !r.truncated());
    assert_eq!((r.len, r.byte_len, r.imm), (0, 300, Some(42)));
    assert!(
        buf.iter().all(|&b| b == 0xEE),
        "nothing copied for a WRITE_WITH_IMM"
    );
    assert_eq!(mr.read(0, 300).unwrap(), pattern(300, 7));
    // recv and recv_into share one queue, in order.
    timeout(qa.send(b"one", None)).await.unwrap();
    timeout(qa.send(b"two", None)).await.unwrap();
    assert_eq!(timeout(qb.recv()).await.unwrap().data, &b"one"[..]);
    let r = timeout(qb.recv_into(&mut buf)).await.unwrap();
    assert_eq!(&buf[..r.len], b"two");
}

/// `RcQp::probe_pingpong` (the verbs-floor probe of `metaroce-perf send_lat --verbs-layer
/// raw`): two threads, one per QP, drive SEND ping-pongs straight through the verbs; every
/// round trip is measured, no completion is lost or unknown, and afterwards both QPs work
/// through their normal API (receive slots reposted, the borrowed send slot returned).
#[tokio::test]
async fn probe_pingpong_on_two_threads() {
    let Some((_ctx, pd)) = device() else { return };
    let cfg = QpConfig {
        slot_size: 64,
        send_slots: 4,
        recv_slots: 4,
        max_inline_data: 64,
        ..QpConfig::default()
    };
    let (qa, qb) = pair(&pd, cfg.clone(), cfg);
    let n = 500;
    let msg = pattern(64, 3);
    let (rtts, echoed) = std::thread::scope(|sc| {
        let e = sc.spawn(|| qb.probe_pingpong(false, &msg, n));
        let p = sc.spawn(|| qa.probe_pingpong(true, &msg, n));
        (p.join().unwrap().unwrap(), e.join().unwrap().unwrap())
    });
    assert_eq!(rtts.len(), n as usize);
    assert!(echoed.is_empty());
    assert!(rtts.iter().all(|r| r.is_finite() && *r > 0.0), "{rtts:?}");
    // Each side took n receives and reposted them; the peer's n SENDs all completed.
    assert_eq!(qa.unknown_completions() + qb.unknown_completions(), 0);
    for i in 0..8u8 {
        timeout(qa.send(&[i; 10], None)).await.unwrap();
        assert_eq!(timeout(qb.recv()).await.unwrap().data, vec![i; 10]);
    }
    // Bad input is an error value, not a panic.
    assert!(matches!(
        qa.probe_pingpong(true, &[0u8; 65], 1),
        Err(Error::InvalidArgument(_))
    ));
}

#[tokio::test]
async fn write_read_and_write_with_imm() {
    let Some((_ctx, pd)) = device() else { return };
    let (qa, qb) = pair(&pd, QpConfig::default(), QpConfig::default());
    let n = 256 * 1024;
    let src = pd.register(pattern(n, 1), Access::LOCAL_WRITE).unwrap();
    let dst = pd
        .register(
            vec![0u8; n],
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
        .unwrap();
    let back = pd.register(vec![0u8; n], Access::LOCAL_WRITE).unwrap();
    let wc = timeout(qa.write(&src, 0, n as u64, &dst.remote(), 0))
        .await
        .unwrap();
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(dst.read(0, n).unwrap(), pattern(n, 1));
    // READ it back at an offset.
    timeout(qa.read(&back, 16, (n - 16) as u64, &dst.remote(), 16))
        .await
        .unwrap();
    assert_eq!(back.read(16, n - 16).unwrap(), pattern(n, 1)[16..]);
    assert_eq!(back.read(0, 16).unwrap(), vec![0u8; 16]);
    // WRITE_WITH_IMM: the bytes land and the peer's receive reports the immediate.
    src.write(0, &pattern(4096, 9)).unwrap();
    timeout(qa.write_with_imm(&src, 0, 4096, &dst.remote(), 1000, 0x1234_5678))
        .await
        .unwrap();
    let m = timeout(qb.recv()).await.unwrap();
    assert!(m.is_write_imm);
    assert_eq!(m.imm, Some(0x1234_5678));
    assert_eq!(m.write_len, 4096);
    assert!(m.data.is_empty());
    assert_eq!(dst.read(1000, 4096).unwrap(), pattern(4096, 9));
    // Local range checks are application errors, not completions.
    assert!(matches!(
        qa.write(&src, 0, n as u64 + 1, &dst.remote(), 0).await,
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        qa.write(&src, 0, 16, &dst.remote(), n as u64 - 8).await,
        Err(Error::InvalidArgument(_))
    ));
}

#[tokio::test]
async fn atomics_fetch_add_and_compare_swap() {
    let Some((_ctx, pd)) = device() else { return };
    let (qa, _qb) = pair(&pd, QpConfig::default(), QpConfig::default());
    let target = pd
        .register(
            vec![0u8; 64],
            Access::LOCAL_WRITE | Access::REMOTE_ATOMIC | Access::REMOTE_READ,
        )
        .unwrap();
    target.write(8, &41u64.to_ne_bytes()).unwrap();
    let r = target.remote();
    assert_eq!(timeout(qa.fetch_add(&r, 8, 1)).await.unwrap(), 41);
    assert_eq!(timeout(qa.fetch_add(&r, 8, 1 << 40)).await.unwrap(), 42);
    let v = 42 + (1u64 << 40);
    assert_eq!(target.read(8, 8).unwrap(), v.to_ne_bytes());
    // CMP_SWP that matches swaps; one that does not leaves the word alone.
    assert_eq!(timeout(qa.compare_swap(&r, 8, v, 7)).await.unwrap(), v);
    assert_eq!(timeout(qa.compare_swap(&r, 8, 99, 8)).await.unwrap(), 7);
    assert_eq!(target.read(8, 8).unwrap(), 7u64.to_ne_bytes());
    assert!(matches!(
        qa.fetch_add(&r, 4, 1).await,
        Err(Error::InvalidArgument(_))
    ));
}

#[tokio::test]
async fn remote_access_error_then_flush_on_qp_error() {
    let Some((_ctx, pd)) = device() else { return };
    let cfg = QpConfig {
        retry_cnt: 1,
        ..QpConfig::default()
    };
    let (qa, _qb) = pair(&pd, cfg.clone(), cfg);
    let src = pd.register(pattern(4096, 5), Access::LOCAL_WRITE).unwrap();
    // A region the peer registered without remote write access.
    let ro = pd
        .register(vec![0u8; 4096], Access::LOCAL_WRITE | Access::REMOTE_READ)
        .unwrap();
    let st = status_of(timeout(qa.write(&src, 0, 4096, &ro.remote(), 0)).await);
    assert_eq!(st, WcStatus::RemoteAccessError);
    assert_eq!(
        ro.read(0, 4096).unwrap(),
        vec![0u8; 4096],
        "nothing written"
    );
    // The QP is now in the error state: the next request is flushed.
    let st = status_of(timeout(qa.read(&src, 0, 64, &ro.remote(), 0)).await);
    assert_eq!(st, WcStatus::WrFlushError);

    // A wrong rkey on a fresh pair.
    let (qc, _qd) = pair(&pd, QpConfig::default(), QpConfig::default());
    let bad = RemoteRegion {
        rkey: ro.rkey() ^ 0x5a5a_0000,
        ..ro.remote()
    };
    let st = status_of(timeout(qc.read(&src, 0, 64, &bad, 0)).await);
    assert_eq!(st, WcStatus::RemoteAccessError);
}

#[tokio::test]
async fn rnr_retry_exceeded_when_peer_posts_no_receive() {
    let Some((_ctx, pd)) = device() else { return };
    let a = QpConfig {
        rnr_retry: 0,
        ..QpConfig::default()
    };
    let b = QpConfig {
        recv_slots: 0,
        min_rnr_timer: 1,
        ..QpConfig::default()
    };
    let (qa, _qb) = pair(&pd, a, b);
    let st = status_of(timeout(qa.send(b"nobody listens", None)).await);
    assert_eq!(st, WcStatus::RnrRetryExceeded);
    let st = status_of(timeout(qa.send(b"after the error", None)).await);
    assert_eq!(st, WcStatus::WrFlushError);
}

/// With the default configuration (a finite `rnr_retry`), a SEND to a peer that never
/// posts a receive fails with RNR_RETRY_EXC_ERR instead of being retried forever (as it
/// was with `rnr_retry` 7, IBA 9.7.5.2.8). The peer keeps its QP open and in RTS.
#[tokio::test]
async fn default_config_send_to_peer_without_receives_fails_rnr_retry_exceeded() {
    let Some((_ctx, pd)) = device() else { return };
    assert!(
        QpConfig::default().rnr_retry < 7,
        "the default must be finite"
    );
    let b = QpConfig {
        recv_slots: 0,
        ..QpConfig::default()
    };
    let (qa, qb) = pair(&pd, QpConfig::default(), b);
    let st = status_of(timeout(qa.send(b"nobody posts a receive", None)).await);
    assert_eq!(st, WcStatus::RnrRetryExceeded);
    assert_eq!(qb.state(), metaroce_verbs::QpState::Rts);
}

/// A SEND to a peer QP whose owner dropped it (QP moved to ERR, then destroyed) fails
/// with a transport error in bounded time, with the default configuration: the peer's
/// device no longer answers, so the local ACK timeout and `retry_cnt` end it
/// (RETRY_EXC_ERR), or an RNR NAK seen before the peer's QP left RTS does
/// (RNR_RETRY_EXC_ERR). The later SEND is flushed. With the former default `retry_cnt` 7
/// this hung (rdma_rxe retries a count of 7 forever): the test timed out after 60 s.
#[tokio::test]
async fn send_to_dropped_peer_fails_in_bounded_time() {
    let Some((_ctx, pd)) = device() else { return };
    let (qa, qb) = pair(&pd, QpConfig::default(), QpConfig::default());
    let wc = timeout(qa.send(b"peer alive", None)).await.unwrap();
    assert_eq!(wc.status, WcStatus::Success);
    drop(qb);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let st = status_of(timeout(qa.send(b"peer gone", None)).await);
    assert!(
        matches!(st, WcStatus::RetryExceeded | WcStatus::RnrRetryExceeded),
        "{st:?}"
    );
    let st = status_of(timeout(qa.send(b"after the error", None)).await);
    assert_eq!(st, WcStatus::WrFlushError);
}

/// With every send slot in flight, `post_send` says `SendQueueFull` and `send` waits
/// (a waiter dropped mid-wait leaves nothing behind); once the QP enters ERR the stuck SEND
/// is flushed, which frees its slot, and the waiting `send` is posted and flushed too.
#[tokio::test]
async fn send_waits_for_a_free_slot_and_is_flushed_on_error() {
    let Some((_ctx, pd)) = device() else { return };
    let (qa, _qb, stuck) = stuck_send(&pd, CqPoll::Events);
    assert!(matches!(
        qa.post_send(b"no slot", None),
        Err(Error::SendQueueFull)
    ));
    // A waiter that gives up (dropped mid-wait) ...
    let gave_up = tokio::time::timeout(Duration::from_millis(200), qa.send(b"cancelled", None));
    assert!(
        gave_up.await.is_err(),
        "send() must wait while no slot is free"
    );
    // ... and one that keeps waiting.
    let qa2 = qa.clone();
    let waiting = tokio::spawn(async move { qa2.send(b"second", None).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !waiting.is_finished(),
        "send() must wait while no slot is free"
    );
    qa.set_error().unwrap();
    let wc = timeout(stuck).await.unwrap();
    assert_eq!(wc.status, WcStatus::WrFlushError);
    let st = status_of(timeout(waiting).await.unwrap());
    assert_eq!(st, WcStatus::WrFlushError);
}

#[tokio::test]
async fn set_error_flushes_posted_receives() {
    let Some((_ctx, pd)) = device() else { return };
    let cfg = QpConfig {
        recv_slots: 4,
        ..QpConfig::default()
    };
    let (_qa, qb) = pair(&pd, cfg.clone(), cfg);
    qb.set_error().unwrap();
    for _ in 0..4 {
        let st = status_of(timeout(qb.recv()).await);
        assert_eq!(st, WcStatus::WrFlushError);
    }
}

#[tokio::test]
async fn mr_dropped_with_write_in_flight_stays_registered_until_completion() {
    let Some((_ctx, pd)) = device() else { return };
    // The peer posts no receive and the sender retries RNR forever: a WRITE_WITH_IMM
    // stays in flight until we move the QP to ERR.
    let a = QpConfig {
        rnr_retry: 7,
        ..QpConfig::default()
    };
    let b = QpConfig {
        recv_slots: 0,
        min_rnr_timer: 1,
        ..QpConfig::default()
    };
    let (qa, _qb) = pair(&pd, a, b);
    let n = 4 << 20;
    let dst = pd
        .register(vec![0u8; n], Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    let base = pd.live_mrs();
    let src = pd.register(pattern(n, 77), Access::LOCAL_WRITE).unwrap();
    assert_eq!(pd.live_mrs(), base + 1);
    let stuck = qa
        .post_write(&src, 0, n as u64, &dst.remote(), 0, Some(1))
        .unwrap();
    // A clone of the handle cannot take the buffer back while the WRITE holds it.
    let src = match src.into_inner() {
        Ok(b) => panic!("{}-byte buffer given back while a WRITE holds it", b.len()),
        Err(m) => m,
    };
    drop(src);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        pd.live_mrs(),
        base + 1,
        "dropped but still registered: a WR holds it"
    );
    // Registering more memory meanwhile cannot reuse it (it is still registered, and the
    // allocator cannot hand out its buffer, which is not freed).
    let other = pd.register(pattern(n, 1), Access::LOCAL_WRITE).unwrap();
    assert_eq!(pd.live_mrs(), base + 2);
    drop(other);
    qa.set_error().unwrap();
    let wc = timeout(stuck).await.unwrap();
    assert_eq!(wc.status, WcStatus::WrFlushError);
    assert_eq!(
        pd.live_mrs(),
        base,
        "deregistered once the WRITE completed (flushed)"
    );

    // The normal case on a fresh pair: the WRITE completes and the bytes land intact.
    let (qa, _qb) = pair(&pd, QpConfig::default(), QpConfig::default());
    let base = pd.live_mrs();
    let src = pd.register(pattern(n, 76), Access::LOCAL_WRITE).unwrap();
    let op = qa
        .post_write(&src, 0, n as u64, &dst.remote(), 0, None)
        .unwrap();
    drop(src);
    let wc = timeout(op).await.unwrap();
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(pd.live_mrs(), base);
    assert_eq!(dst.read(0, n).unwrap(), pattern(n, 76));

    // A dropped OpFuture does not cancel the WRITE nor free its MR early.
    let src = pd.register(pattern(n, 78), Access::LOCAL_WRITE).unwrap();
    drop(
        qa.post_write(&src, 0, n as u64, &dst.remote(), 0, None)
            .unwrap(),
    );
    drop(src);
    // Fence: a READ after the WRITE on the same QP completes after it.
    let probe = pd.register(vec![0u8; 8], Access::LOCAL_WRITE).unwrap();
    let dst_r = pd
        .register(vec![0u8; 8], Access::LOCAL_WRITE | Access::REMOTE_READ)
        .unwrap();
    timeout(qa.read(&probe, 0, 8, &dst_r.remote(), 0))
        .await
        .unwrap();
    assert_eq!(dst.read(0, n).unwrap(), pattern(n, 78));
    // Registered: dst, probe, dst_r (the dropped source is gone).
    assert_eq!(pd.live_mrs(), base + 2);
    // An unused MR gives its buffer back.
    let b = probe.into_inner().expect("no WR uses it");
    assert_eq!(b.len(), 8);
    assert_eq!(pd.live_mrs(), base + 1);
}

#[tokio::test]
async fn dropping_a_qp_releases_its_resources() {
    let Some((_ctx, pd)) = device() else { return };
    let base = pd.live_mrs();
    let (qa, qb) = pair(&pd, QpConfig::default(), QpConfig::default());
    assert!(pd.live_mrs() > base, "slot pools registered");
    let remote = pd
        .register(
            vec![0u8; 1 << 20],
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        )
        .unwrap();
    let src = pd
        .register(pattern(1 << 20, 4), Access::LOCAL_WRITE)
        .unwrap();
    let op = qa
        .post_write(&src, 0, 1 << 20, &remote.remote(), 0, None)
        .unwrap();
    drop(src);
    drop(qa);
    drop(qb);
    // The WRITE either completed or was flushed; either way the future resolves.
    let r = timeout(op).await;
    println!("write on a dropped QP: {r:?}");
    for _ in 0..100 {
        if pd.live_mrs() == base + 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(pd.live_mrs(), base + 1, "only `remote` is left registered");
}
