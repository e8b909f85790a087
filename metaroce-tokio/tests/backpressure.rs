//! Receive backpressure, measured: 1 GiB offered to a stream the peer does not read keeps
//! resident memory bounded, the sender's `send` waits, and once the reader starts every
//! byte arrives in order. Alone in its test binary so that VmRSS is this test's.

mod common;

use bytes::Bytes;
use common::{connect, endpoints, rss_kib};
use futures::{SinkExt, StreamExt};
use metaroce_tokio::Config;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MSG: usize = 1 << 20;
const COUNT: u64 = 1024; // 1 GiB
const STREAM_LIMIT: u64 = 4 << 20;
const SEND_BUFFER: usize = 8 << 20;
/// What may be resident beyond the baseline: the receiver's stream (2 x limit + one
/// message, `max_stream_recv_bytes`' documented worst case), the sender's unacknowledged
/// messages (`stream_send_buffer` + one message) and 32 MiB of allocator, socket and
/// runtime slack.
const BOUND_KIB: u64 = (2 * STREAM_LIMIT + SEND_BUFFER as u64 + 2 * MSG as u64 + (32 << 20)) / 1024;

fn message(i: u64) -> Bytes {
    let mut v = vec![(i % 251) as u8; MSG];
    v[..8].copy_from_slice(&i.to_be_bytes());
    Bytes::from(v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gibibyte_into_an_unread_stream_stays_bounded_and_then_arrives_in_order() {
    let mut cfg = Config::default();
    cfg.transport.max_stream_recv_bytes = STREAM_LIMIT;
    cfg.stream_send_buffer = SEND_BUFFER;
    let (server, client) = endpoints(cfg).await;
    let (conn, peer) = connect(&server, &client).await;
    let before = rss_kib();

    let sent = Arc::new(AtomicU64::new(0));
    let sent2 = sent.clone();
    let mut tx = conn.open_stream().unwrap();
    let sender = tokio::spawn(async move {
        for i in 0..COUNT {
            tx.feed(message(i)).await.unwrap();
            sent2.store(i + 1, Ordering::Relaxed);
        }
        tx.close().await.unwrap();
        tx
    });

    // Nobody reads (nobody even accepts the stream) for 3 s.
    let t0 = Instant::now();
    let mut peak = before;
    while t0.elapsed() < Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        peak = peak.max(rss_kib());
    }
    let sent_while_unread = sent.load(Ordering::Relaxed);
    println!(
        "unread for 3 s: {sent_while_unread} of {COUNT} x 1 MiB accepted by the sink; VmRSS \
         {before} KiB before, peak {peak} KiB (+{} KiB; bound +{BOUND_KIB} KiB)",
        peak - before
    );
    assert!(
        sent_while_unread < COUNT / 4,
        "the sender must wait: {sent_while_unread} MiB went into an unread stream"
    );
    assert!(
        peak <= before + BOUND_KIB,
        "VmRSS grew by {} KiB, bound {BOUND_KIB} KiB",
        peak - before
    );

    // Now read: everything arrives, in order, then the end of the stream.
    let t1 = Instant::now();
    let mut rx = peer.accept_stream().await.unwrap();
    for i in 0..COUNT {
        let m = tokio::time::timeout(Duration::from_secs(30), rx.next())
            .await
            .expect("stalled")
            .expect("ended early")
            .unwrap();
        assert_eq!(m.len(), MSG);
        assert_eq!(u64::from_be_bytes(m[..8].try_into().unwrap()), i, "order");
        assert!(m[8..].iter().all(|&b| b == (i % 251) as u8));
        peak = peak.max(rss_kib());
    }
    assert!(rx.next().await.is_none());
    sender.await.unwrap();
    println!(
        "read 1 GiB in {:?}; VmRSS peak {peak} KiB over the whole run (+{} KiB)",
        t1.elapsed(),
        peak - before
    );
    assert!(peak <= before + BOUND_KIB);
}
