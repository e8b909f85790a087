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
