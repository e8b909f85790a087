//! `UringBackend` specifics beyond the shared backend suite (`backend_udp.rs`): zero-copy
//! sends, send-slot exhaustion, queued sends going out without `flush`, and drop with
//! operations in flight. Needs io_uring (Linux 6.0+, not forbidden): a machine without it
//! fails here with the reason.

use std::future::poll_fn;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::time::Duration;

use metaroce::Transmit;
use metaroce_tokio::backend::{DatagramBackend, RecvMeta, UdpBackend, UringBackend, UringConfig};

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn uring(paths: usize, config: UringConfig) -> UringBackend {
    match UringBackend::bind_with(loopback(), paths, &config) {
        Ok(b) => b,
        Err(e) => panic!("io_uring backend: {e}"),
    }
}

/// Receives until `want` datagrams (or 5 s); returns them in arrival order.
async fn recv_all(b: &impl DatagramBackend, want: usize) -> Vec<Vec<u8>> {
    let mut bufs = vec![vec![0u8; 65_536]; 4];
    let mut meta = [RecvMeta::default(); 4];
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while out.len() < want {
        let r = tokio::time::timeout_at(
            deadline,
            poll_fn(|cx| {
                let mut s: Vec<IoSliceMut<'_>> =
                    bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
                b.poll_recv(cx, &mut s, &mut meta)
            }),
        )
        .await;
        let Ok(r) = r else { break };
        let n = r.expect("poll_recv");
        for (m, buf) in meta[..n].iter().zip(&bufs) {
            out.extend(m.datagrams(buf).map(<[u8]>::to_vec));
        }
    }
    out
}

fn transmit(to: SocketAddr, port: u16, size: usize, seg: Option<usize>) -> Transmit {
    Transmit {
        destination: to,
        src_port: port,
        ecn: None,
        size,
        segment_size: seg,
    }
}

#[tokio::test]
async fn zero_copy_gso_sends_arrive_intact() {
    let a = uring(
        1,
        UringConfig {
            zero_copy_min_bytes: Some(1),
            ..UringConfig::default()
        },
    );
    eprintln!("SENDMSG_ZC supported: {}", a.zero_copy_supported());
    let b = UdpBackend::bind(loopback(), 1).unwrap();
    let contents: Vec<u8> = (0..40 * 1500).map(|i| (i * 7 + i / 1500) as u8).collect();
    for round in 0..20 {
        let t = transmit(
            b.local_addr(),
            a.source_ports()[0],
            contents.len(),
            Some(1500),
        );
        poll_fn(|cx| a.poll_send(cx, &t, &contents)).await.unwrap();
        a.flush();
        let got = recv_all(&b, 40).await;
        assert_eq!(got.concat(), contents, "round {round}");
    }
    assert_eq!(a.send_errors(), 0);
}

#[tokio::test]
async fn more_transmits_than_send_slots_all_arrive_in_order() {
    // Two slots: poll_send must wait for completions (Pending) and never reuse a slot the
    // kernel still reads.
    let a = uring(
        1,
        UringConfig {
            send_slots: 2,
            ..UringConfig::default()
        },
    );
    let b = UdpBackend::bind(loopback(), 1).unwrap();
    let n = 500;
    for i in 0..n {
        let bytes = (i as u32).to_be_bytes().repeat(50);
        let t = transmit(b.local_addr(), a.source_ports()[0], bytes.len(), None);
        poll_fn(|cx| a.poll_send(cx, &t, &bytes)).await.unwrap();
    }
    a.flush();
    let got = recv_all(&b, n).await;
    assert_eq!(got.len(), n);
    for (i, g) in got.iter().enumerate() {
        assert_eq!(g, &(i as u32).to_be_bytes().repeat(50), "datagram {i}");
    }
}

#[tokio::test]
async fn a_transmit_larger_than_all_slots_is_invalid_input() {
    let a = uring(
        1,
        UringConfig {
            send_slots: 1,
            ..UringConfig::default()
        },
    );
    // 100 × 1200 B needs two GSO sends, so two slots.
    let contents = vec![0u8; 120_000];
    let t = transmit(
        "127.0.0.1:9".parse().unwrap(),
        a.source_ports()[0],
        contents.len(),
        Some(1200),
    );
    let err = poll_fn(|cx| a.poll_send(cx, &t, &contents))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
}

#[tokio::test]
async fn queued_sends_go_out_at_the_next_receive_poll_without_flush() {
    let a = uring(1, UringConfig::default());
    let b = uring(1, UringConfig::default());
    let t = transmit(b.local_addr(), a.source_ports()[0], 3, None);
    poll_fn(|cx| a.poll_send(cx, &t, b"abc")).await.unwrap();
    // No flush: polling `a`'s receive side submits its queue.
    let mut buf = [0u8; 64];
    let mut meta = [RecvMeta::default(); 1];
    let waker = futures::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    let _ = a.poll_recv(&mut cx, &mut [IoSliceMut::new(&mut buf)], &mut meta);
    assert_eq!(recv_all(&b, 1).await, [b"abc".to_vec()]);
}

#[tokio::test]
async fn many_receives_recycle_the_provided_buffers() {
    // 8 provided buffers, 2000 datagrams: every buffer is reused many times, and a receive
    // stopped by ENOBUFS (all buffers held) is re-armed.
    let b = uring(
        1,
        UringConfig {
            recv_buffers: 8,
            ..UringConfig::default()
        },
    );
    let a = UdpBackend::bind(loopback(), 1).unwrap();
    let n = 2000;
    let mut got = 0;
    for chunk in 0..n / 50 {
        for i in 0..50 {
            let bytes = ((chunk * 50 + i) as u32).to_be_bytes();
            let t = transmit(b.local_addr(), a.source_ports()[0], 4, None);
            poll_fn(|cx| a.poll_send(cx, &t, &bytes)).await.unwrap();
        }
        got += recv_all(&b, 50).await.len();
    }
    assert_eq!(got, n);
    assert_eq!(b.recv_errors(), 0);
}

#[tokio::test]
async fn dropping_with_sends_in_flight_is_clean() {
    for _ in 0..20 {
        let a = uring(2, UringConfig::default());
        let contents = vec![9u8; 60_000];
        let t = transmit(
            "127.0.0.1:9".parse().unwrap(),
            a.source_ports()[1],
            contents.len(),
            Some(1000),
        );
        for _ in 0..10 {
            poll_fn(|cx| a.poll_send(cx, &t, &contents)).await.unwrap();
        }
        a.flush();
        drop(a);
    }
}

#[tokio::test]
async fn in_place_receive_lends_the_provided_buffers_without_a_copy() {
    let b = uring(1, UringConfig::default());
    let a = UdpBackend::bind(loopback(), 1).unwrap();
    let contents: Vec<u8> = (0..30 * 1000).map(|i| (i % 251) as u8).collect();
    let t = transmit(
        b.local_addr(),
        a.source_ports()[0],
        contents.len(),
        Some(1000),
    );
    poll_fn(|cx| a.poll_send(cx, &t, &contents)).await.unwrap();
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while got.len() < contents.len() && tokio::time::Instant::now() < deadline {
        let r = tokio::time::timeout_at(
            deadline,
            poll_fn(|cx| {
                b.poll_recv_in_place(cx, 4, &mut |m, bytes| {
                    assert_eq!(m.len, bytes.len());
                    assert_eq!(m.from.port(), a.source_ports()[0]);
                    for d in m.datagrams(bytes) {
                        got.extend_from_slice(d);
                    }
                })
                .expect("UringBackend lends its buffers")
            }),
        )
        .await;
        let Ok(r) = r else { break };
        assert!(r.unwrap() > 0);
    }
    assert_eq!(got, contents);
    // The UDP backend does not lend: the caller falls back to poll_recv.
    let waker = futures::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(a.poll_recv_in_place(&mut cx, 4, &mut |_, _| {}).is_none());
}

/// Queues `sizes` (one datagram each, contents depending on the index) on path `path` of `a`
/// to `to` with `poll_send_owned`, then flushes.
async fn send_owned(a: &UringBackend, to: SocketAddr, path: usize, sizes: &[usize], tag: u8) {
    let mut buf = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        buf.clear();
        buf.extend((0..size).map(|j| (i * 13 + j) as u8 ^ tag));
        let t = transmit(to, a.source_ports()[path], size, None);
        poll_fn(|cx| a.poll_send_owned(cx, &t, &mut buf))
            .await
            .unwrap();
    }
}

fn expected(sizes: &[usize], tag: u8) -> Vec<Vec<u8>> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| (0..size).map(|j| (i * 13 + j) as u8 ^ tag).collect())
        .collect()
}

#[tokio::test]
async fn equal_size_datagrams_are_joined_into_gso_sends_at_the_run_boundaries() {
    // Each case: the datagram sizes queued before one flush, and the sendmsgs they must
    // make. A run ends at a shorter datagram (included), before a longer one, at 64
    // datagrams and before 65 507 bytes.
    let cases: [(Vec<usize>, u64); 5] = [
        (vec![100; 40], 1),
        (vec![100, 100, 100, 50, 100, 100], 2),
        (vec![100, 200, 200], 2),
        (vec![10; 100], 2),
        (vec![4000; 20], 2),
    ];
    let b = UdpBackend::bind(loopback(), 1).unwrap();
    for (sizes, sendmsgs) in cases {
        let a = uring(1, UringConfig::default());
        if a.max_gso_segments() <= 1 {
            eprintln!("no UDP GSO on this kernel: joining is off");
            return;
        }
        send_owned(&a, b.local_addr(), 0, &sizes, 0).await;
        a.flush();
        let got = recv_all(&b, sizes.len()).await;
        assert_eq!(got, expected(&sizes, 0), "sizes {sizes:?}");
        let st = a.stats();
        assert_eq!(st.datagrams_sent, sizes.len() as u64, "{st:?}");
        assert_eq!(st.sendmsgs, sendmsgs, "sizes {sizes:?}: {st:?}");
        assert_eq!((st.send_errors, st.datagrams_lost), (0, 0));
    }
}

#[tokio::test]
async fn joining_keeps_each_paths_order_and_never_mixes_destinations_or_ecn() {
    let a = uring(3, UringConfig::default());
    let b1 = UdpBackend::bind(loopback(), 1).unwrap();
    let b2 = UdpBackend::bind(loopback(), 1).unwrap();
    // Interleaved over 3 paths and 2 destinations, one ECN-marked datagram in the middle.
    let mut want1: Vec<(u16, Vec<u8>)> = Vec::new();
    let mut want2 = Vec::new();
    let mut buf = Vec::new();
    for i in 0..90usize {
        let path = i % 3;
        let to = if i % 2 == 0 { &b1 } else { &b2 };
        buf.clear();
        buf.extend_from_slice(&(i as u32).to_be_bytes().repeat(60));
        let mut t = transmit(to.local_addr(), a.source_ports()[path], buf.len(), None);
        if i == 45 {
            t.ecn = Some(metaroce::EcnCodepoint::Ect0);
        }
        let want = if i % 2 == 0 { &mut want1 } else { &mut want2 };
        want.push((a.source_ports()[path], buf.clone()));
        poll_fn(|cx| a.poll_send_owned(cx, &t, &mut buf))
            .await
            .unwrap();
    }
    a.flush();
    for (b, want) in [(&b1, want1), (&b2, want2)] {
        let mut bufs = vec![vec![0u8; 65_536]; 4];
        let mut meta = [RecvMeta::default(); 4];
        let mut got: Vec<(u16, Vec<u8>)> = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while got.len() < want.len() {
            let r = tokio::time::timeout_at(
                deadline,
                poll_fn(|cx| {
                    let mut s: Vec<IoSliceMut<'_>> =
                        bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
                    b.poll_recv(cx, &mut s, &mut meta)
                }),
            )
            .await;
            let Ok(r) = r else { break };
            for (m, buf) in meta[..r.unwrap()].iter().zip(&bufs) {
                let marked = m.ecn.is_some();
                for d in m.datagrams(buf) {
                    // Only datagram 45 was marked; a GSO send joining it with others
                    // would mark them too.
                    assert_eq!(
                        marked,
                        d[..4] == 45u32.to_be_bytes(),
                        "ECN of {:?}",
                        &d[..4]
                    );
                    got.push((m.from.port(), d.to_vec()));
                }
            }
        }
        assert_eq!(got.len(), want.len());
        // Per path (source port) and destination, the order sent is the order received.
        for port in a.source_ports() {
            let g: Vec<_> = got.iter().filter(|(p, _)| *p == port).collect();
            let w: Vec<_> = want.iter().filter(|(p, _)| *p == port).collect();
            assert_eq!(g, w, "path port {port}");
        }
    }
    let st = a.stats();
    assert_eq!(st.datagrams_sent, 90);
    assert!(
        st.sendmsgs < 90,
        "runs per path and destination were joined: {st:?}"
    );
}

#[tokio::test]
async fn coalesce_off_sends_one_datagram_per_sendmsg() {
    let a = uring(
        1,
        UringConfig {
            coalesce: false,
            ..UringConfig::default()
        },
    );
    let b = UdpBackend::bind(loopback(), 1).unwrap();
    // The first flush arms the multishot receive (one submit of its own).
    a.flush();
    let before = a.stats().submits;
    let sizes = [100usize; 20];
    send_owned(&a, b.local_addr(), 0, &sizes, 5).await;
    a.flush();
    assert_eq!(recv_all(&b, 20).await, expected(&sizes, 5));
    let st = a.stats();
    assert_eq!((st.sendmsgs, st.datagrams_sent), (20, 20));
    // One io_uring_enter for the whole flush, none for the sends themselves.
    assert_eq!(st.submits - before, 1, "{st:?}");
}

#[tokio::test]
async fn owned_sends_move_the_buffer_and_hand_back_completed_ones() {
    let a = uring(1, UringConfig::default());
    let b = UdpBackend::bind(loopback(), 1).unwrap();
    let mut buf = vec![7u8; 1000];
    let first = buf.as_ptr();
    let t = transmit(b.local_addr(), a.source_ports()[0], 1000, None);
    poll_fn(|cx| a.poll_send_owned(cx, &t, &mut buf))
        .await
        .unwrap();
    // Taken, not copied: the caller holds another (here new, empty) buffer.
    assert_ne!(buf.as_ptr(), first);
    a.flush();
    assert_eq!(recv_all(&b, 1).await, [vec![7u8; 1000]]);
    // Once that send completed, the next owned send hands the first buffer back, emptied.
    buf.clear();
    buf.resize(10, 1);
    let t = transmit(b.local_addr(), a.source_ports()[0], 10, None);
    let mut back = None;
    for _ in 0..100 {
        poll_fn(|cx| a.poll_send_owned(cx, &t, &mut buf))
            .await
            .unwrap();
        if buf.as_ptr() == first {
            back = Some(buf.len());
            break;
        }
        buf.clear();
        buf.resize(10, 1);
        a.flush();
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(
        back,
        Some(0),
        "the completed send's buffer came back, emptied"
    );
}

#[tokio::test]
async fn exhausted_receive_buffers_are_counted_and_receiving_resumes() {
    // 2 provided buffers and 300 datagrams sent before anyone receives: the multishot
    // receive runs out of buffers (ENOBUFS, counted), the kernel keeps what fits in the
    // socket buffer, and receiving resumes once buffers are recycled: later datagrams all
    // arrive.
    let b = uring(
        1,
        UringConfig {
            recv_buffers: 2,
            ..UringConfig::default()
        },
    );
    let a = UdpBackend::bind(loopback(), 1).unwrap();
    let to = b.local_addr();
    let port = a.source_ports()[0];
    // Arm the receive (the first poll does), then flood it.
    let waker = futures::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    let _ = b.poll_recv_in_place(&mut cx, 1, &mut |_, _| {});
    for i in 0..300u32 {
        let bytes = i.to_be_bytes();
        let t = transmit(to, port, 4, None);
        poll_fn(|cx| a.poll_send(cx, &t, &bytes)).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let flood = recv_all(&b, 300).await;
    assert!(!flood.is_empty());
    let st = b.stats();
    eprintln!("{} of 300 flooded datagrams received; {st:?}", flood.len());
    assert!(st.recv_buffers_exhausted > 0, "{st:?}");
    assert_eq!(st.recv_errors, 0);
    // Liveness: the receive was re-armed, later datagrams arrive.
    for i in 0..50u32 {
        let bytes = (1000 + i).to_be_bytes();
        let t = transmit(to, port, 4, None);
        poll_fn(|cx| a.poll_send(cx, &t, &bytes)).await.unwrap();
        let got = recv_all(&b, 1).await;
        assert_eq!(got, [bytes.to_vec()], "datagram {i} after the flood");
    }
}

/// Counts wake-ups.
struct CountWake(std::sync::atomic::AtomicUsize);

impl futures::task::ArcWake for CountWake {
    fn wake_by_ref(arc_self: &std::sync::Arc<Self>) {
        arc_self
            .0
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

#[tokio::test]
async fn send_completions_do_not_wake_the_receive_side() {
    // The task waiting in poll_recv (the driver) must not be woken by the completions of
    // its own sends: 200 sends, no datagram received, no wake-up.
    let a = uring(2, UringConfig::default());
    let sink = UdpBackend::bind(loopback(), 1).unwrap();
    let count = std::sync::Arc::new(CountWake(Default::default()));
    let waker = futures::task::waker(count.clone());
    let mut cx = std::task::Context::from_waker(&waker);
    let mut buf = [0u8; 64];
    let mut meta = [RecvMeta::default(); 1];
    // Each round: register the waker (poll until Pending; tokio wakers are one-shot),
    // send 20 datagrams and flush, and see whether the receive side was woken.
    let mut woken_rounds = 0;
    for round in 0..10 {
        for _ in 0..10 {
            if a.poll_recv(&mut cx, &mut [IoSliceMut::new(&mut buf)], &mut meta)
                .is_pending()
            {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        let before = count.0.load(std::sync::atomic::Ordering::Relaxed);
        for i in 0..20usize {
            let bytes = vec![round as u8; 100 + i];
            let t = transmit(
                sink.local_addr(),
                a.source_ports()[i % 2],
                bytes.len(),
                None,
            );
            poll_fn(|cx| a.poll_send(cx, &t, &bytes)).await.unwrap();
        }
        a.flush();
        tokio::time::sleep(Duration::from_millis(5)).await;
        if count.0.load(std::sync::atomic::Ordering::Relaxed) > before {
            woken_rounds += 1;
        }
    }
    assert_eq!(recv_all(&sink, 200).await.len(), 200);
    assert_eq!(
        woken_rounds, 0,
        "the receive side was woken by send completions in {woken_rounds} of 10 rounds"
    );
}

#[test]
fn send_completions_do_not_wake_a_parked_worker() {
    // The send ring's completions are posted while its submitting `io_uring_enter` runs;
    // nobody waits for them unless every send slot is busy. Were the send ring's fd in the
    // reactor, each flush would wake the worker parked in `epoll_wait` (here the runtime's
    // only worker, idle): 50 flushes, 50 wake-ups.
    let worker = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(0));
    let w = worker.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .on_thread_start(move || {
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() };
            let _ = w.compare_exchange(
                0,
                tid,
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
            );
        })
        .build()
        .unwrap();
    let a = {
        let _rt = rt.enter();
        uring(2, UringConfig::default())
    };
    let sink = std::net::UdpSocket::bind(loopback()).unwrap();
    let to = sink.local_addr().unwrap();
    // Let the worker park.
    std::thread::sleep(Duration::from_millis(50));
    let tid = worker.load(std::sync::atomic::Ordering::SeqCst);
    assert_ne!(tid, 0, "the worker started");
    let waker = futures::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    let before = voluntary_switches(tid);
    for round in 0..50u32 {
        for i in 0..4usize {
            let bytes = round.to_be_bytes();
            let t = transmit(to, a.source_ports()[i % 2], bytes.len(), None);
            assert!(matches!(
                a.poll_send(&mut cx, &t, &bytes),
                std::task::Poll::Ready(Ok(()))
            ));
        }
        a.flush();
        std::thread::sleep(Duration::from_millis(2));
    }
    let woke = voluntary_switches(tid) - before;
    sink.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 16];
    for _ in 0..200 {
        sink.recv(&mut buf).expect("all 200 datagrams arrive");
    }
    assert!(woke < 10, "50 flushes woke the parked worker {woke} times");
    drop(a);
}

#[tokio::test]
async fn an_owned_transmit_larger_than_one_sendmsg_is_sent_in_chunks_without_a_copy() {
    // 100 × 1200 B (a core GSO batch larger than 64 KiB): two sendmsgs sharing the
    // caller's buffer; everything arrives in order; the buffer comes back once both
    // completed.
    let a = uring(1, UringConfig::default());
    let b = UdpBackend::bind(loopback(), 1).unwrap();
    let contents: Vec<u8> = (0..100 * 1200).map(|i| (i / 1200 * 7 + i) as u8).collect();
    let mut buf = contents.clone();
    let first = buf.as_ptr();
    let t = transmit(
        b.local_addr(),
        a.source_ports()[0],
        contents.len(),
        Some(1200),
    );
    poll_fn(|cx| a.poll_send_owned(cx, &t, &mut buf))
        .await
        .unwrap();
    assert_ne!(buf.as_ptr(), first, "the buffer was taken");
    a.flush();
    let got = recv_all(&b, 100).await;
    assert_eq!(got.concat(), contents);
    let st = a.stats();
    if a.max_gso_segments() > 1 {
        assert_eq!(st.sendmsgs, 2, "{st:?}");
    }
    assert_eq!(st.datagrams_sent, 100, "{st:?}");
    // Both chunks completed: the shared buffer is spare and comes back.
    let small = transmit(b.local_addr(), a.source_ports()[0], 1, None);
    let mut back = false;
    for _ in 0..100 {
        buf.clear();
        buf.push(1);
        poll_fn(|cx| a.poll_send_owned(cx, &small, &mut buf))
            .await
            .unwrap();
        if buf.as_ptr() == first {
            back = true;
            break;
        }
        a.flush();
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        back,
        "the shared buffer came back after its last chunk completed"
    );
}

/// Ping-pong of `n` numbered datagrams from `a` to `b`, one at a time; returns what `b`
/// received, in order.
async fn one_at_a_time(a: &UringBackend, b: &UringBackend, n: u32) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    for i in 0..n {
        let t = transmit(b.local_addr(), a.source_ports()[0], 4, None);
        poll_fn(|cx| a.poll_send(cx, &t, &i.to_be_bytes()))
            .await
            .unwrap();
        a.flush();
        got.extend(recv_all(b, 1).await);
    }
    got
}

#[test]
fn the_receive_is_re_armed_from_the_thread_that_keeps_polling_it() {
    // The kernel completes a multishot receive in task work of the thread that armed it.
    // Arm on this thread, then drive the same runtime from another thread: the receive
    // must follow, once, without losing or reordering a datagram.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (a, b) = rt.block_on(async {
        let a = uring(1, UringConfig::default());
        let b = uring(1, UringConfig::default());
        let first = one_at_a_time(&a, &b, 1).await;
        assert_eq!(first, [0u32.to_be_bytes().to_vec()]);
        (a, b)
    });
    assert_eq!(
        b.stats().recv_moves,
        0,
        "polled only from the arming thread"
    );
    // SAFETY: gettid has no preconditions.
    let arming = unsafe { libc::gettid() };
    let wakeups = std::thread::spawn(move || {
        rt.block_on(async {
            let got = one_at_a_time(&a, &b, 200).await;
            let want: Vec<Vec<u8>> = (0..200u32).map(|i| i.to_be_bytes().to_vec()).collect();
            assert_eq!(got, want);
            assert_eq!(b.stats().recv_moves, 1, "{:?}", b.stats());
            assert_eq!(b.stats().recv_errors, 0);
            // Once moved, datagrams no longer wake the arming thread (parked in `join`).
            let before = voluntary_switches(arming);
            let got = one_at_a_time(&a, &b, 200).await;
            assert_eq!(got.len(), 200);
            assert_eq!(b.stats().recv_moves, 1, "moved once, not back and forth");
            voluntary_switches(arming) - before
        })
    })
    .join()
    .unwrap();
    assert!(
        wakeups < 20,
        "the arming thread woke {wakeups} times for 200 datagrams"
    );
}

#[test]
fn sending_never_arms_the_receive_on_the_senders_thread() {
    // The kernel completes the multishot receive in task work of the thread that armed
    // it. A thread that only sends (an application task's, with inline sends) must not be
    // the one: sends and flushes here, receive polls on another thread, and the receive
    // never has to move to the polling thread.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (a, b) = rt.block_on(async {
        let a = uring(1, UringConfig::default());
        let b = uring(1, UringConfig::default());
        let sink = UdpBackend::bind(loopback(), 1).unwrap();
        for i in 0..50u32 {
            let t = transmit(sink.local_addr(), b.source_ports()[0], 4, None);
            poll_fn(|cx| b.poll_send(cx, &t, &i.to_be_bytes()))
                .await
                .unwrap();
            b.flush();
        }
        assert_eq!(recv_all(&sink, 50).await.len(), 50);
        (a, b)
    });
    std::thread::spawn(move || {
        rt.block_on(async {
            let got = one_at_a_time(&a, &b, 100).await;
            let want: Vec<Vec<u8>> = (0..100u32).map(|i| i.to_be_bytes().to_vec()).collect();
            assert_eq!(got, want);
            assert_eq!(
                b.stats().recv_moves,
                0,
                "the receive was armed on the sending thread: {:?}",
                b.stats()
            );
        })
    })
    .join()
    .unwrap();
}

/// `voluntary_ctxt_switches` of thread `tid` of this process (each sleep after a wake-up).
fn voluntary_switches(tid: libc::pid_t) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("voluntary_ctxt_switches")
}
