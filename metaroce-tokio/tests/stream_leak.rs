//! Streams this side opens and drops while the peer's receive stream table is full
//! (`TransportConfig::max_streams` at the peer): the peer refuses their first message
//! (`RemoteInvalidRequest`) and ignores their reset, so nothing at the peer ever answers
//! for them. They must still be forgotten here — by the driver (`driver_maps().streams`)
//! and by the core (`send_streams`, `recv.streams`) — or a service that keeps opening
//! streams toward a peer that holds its table full grows without bound.

mod common;

use bytes::Bytes;
use common::pair_with;
use futures::{SinkExt, StreamExt};
use metaroce::WcStatus;
use metaroce_tokio::{Config, Endpoint, Error, MessageStream};
use std::time::Duration;

const T: Duration = Duration::from_secs(10);
const LIMIT: u32 = 4;

async fn until(what: &str, mut f: impl FnMut() -> bool) -> bool {
    let t0 = std::time::Instant::now();
    while !f() {
        if t0.elapsed() > T {
            eprintln!("timed out waiting for {what}");
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    true
}

/// The server (with `max_streams` = 4) holding its table full: four streams accepted,
/// each with one message read and (with `reply`) one message sent back, none finished or
/// dropped. (With the replies, the server's send side tracks four streams too, as many
/// as its `max_streams`: it has no room to answer a STOP of a stream it never sent on.)
async fn full_server(
    reply: bool,
) -> (
    Endpoint,
    Endpoint,
    metaroce_tokio::Connection,
    metaroce_tokio::Connection,
    Vec<MessageStream>,
    Vec<MessageStream>,
) {
    let mut scfg = Config::default();
    scfg.transport.max_streams = LIMIT;
    let client = Endpoint::bind("127.0.0.1:0".parse().unwrap(), Config::default())
        .await
        .unwrap();
    let (server, client, c, s) = pair_with(scfg, client).await;
    let mut held_tx = Vec::new();
    let mut held_rx = Vec::new();
    for i in 0..LIMIT {
        let mut tx = c.open_stream().unwrap();
        tokio::time::timeout(T, tx.send(Bytes::from(format!("hold {i}"))))
            .await
            .expect("send hung")
            .unwrap();
        let mut rx = tokio::time::timeout(T, s.accept_stream())
            .await
            .expect("accept hung")
            .unwrap();
        let m = tokio::time::timeout(T, rx.next()).await.unwrap().unwrap();
        assert_eq!(m.unwrap(), Bytes::from(format!("hold {i}")));
        if reply {
            tokio::time::timeout(T, rx.send(Bytes::from(format!("reply {i}"))))
                .await
                .expect("reply hung")
                .unwrap();
            let m = tokio::time::timeout(T, tx.next()).await.unwrap().unwrap();
            assert_eq!(m.unwrap(), Bytes::from(format!("reply {i}")));
        }
        held_tx.push(tx);
        held_rx.push(rx);
    }
    assert_eq!(s.stats().unwrap().recv.streams, LIMIT as u64);
    (server, client, c, s, held_tx, held_rx)
}

/// Open a stream toward the full peer, send one message (refused), drop it; 200 times.
/// Every one of them is forgotten by the client's driver and core once its reset is
/// acknowledged.
async fn refused_streams(reply: bool) {
    let (server, client, c, s, held_tx, held_rx) = full_server(reply).await;
    let base = client.driver_maps().streams;
    assert_eq!(base, LIMIT as usize, "the four held streams");
    const N: usize = 200;
    for i in 0..N {
        let mut st = c.open_stream().unwrap();
        let r = tokio::time::timeout(T, st.send(Bytes::from(format!("refused {i}"))))
            .await
            .expect("send hung");
        // Refused by the full peer: never reported as delivered.
        assert_eq!(
            r.as_ref().err().and_then(Error::status),
            Some(WcStatus::RemoteInvalidRequest),
            "message {i} on a stream beyond the peer's limit: {r:?}"
        );
        drop(st);
    }
    let ok = until("the refused streams to be forgotten", || {
        client.driver_maps().streams <= base
    })
    .await;
    let stats = c.stats().unwrap();
    eprintln!(
        "driver streams {} (base {base}); core send_streams {}, recv.streams {}, \
         closed_send_stream_ranges {}, queued_ops {}; server recv.streams {}",
        client.driver_maps().streams,
        stats.send_streams,
        stats.recv.streams,
        stats.closed_send_stream_ranges,
        stats.queued_ops,
        s.stats().unwrap().recv.streams,
    );
    assert!(
        ok,
        "driver entries of dropped refused streams stayed: {} (base {base})",
        client.driver_maps().streams
    );
    // The core's state for them is gone too: only the held streams remain.
    assert!(
        stats.send_streams <= 2 * LIMIT as u64,
        "core send-side state stayed: {}",
        stats.send_streams
    );
    assert!(
        stats.recv.streams <= LIMIT as u64,
        "core receive-side state stayed: {}",
        stats.recv.streams
    );
    // The held streams still work both ways, and a new stream works once the peer frees
    // a slot.
    let mut held_tx = held_tx;
    let mut held_rx = held_rx;
    held_tx[0].send(Bytes::from_static(b"still")).await.unwrap();
    assert_eq!(
        tokio::time::timeout(T, held_rx[0].next())
            .await
            .unwrap()
            .unwrap()
            .unwrap(),
        Bytes::from_static(b"still")
    );
    held_rx[1].send(Bytes::from_static(b"back")).await.unwrap();
    assert_eq!(
        tokio::time::timeout(T, held_tx[1].next())
            .await
            .unwrap()
            .unwrap()
            .unwrap(),
        Bytes::from_static(b"back")
    );
    drop((held_tx, held_rx, server, client, c, s));
}

/// Streams dropped without a message: nothing reaches the peer but the reset and stop;
/// they are forgotten all the same.
async fn silent_streams(reply: bool) {
    let (_server, client, c, _s, _held_tx, _held_rx) = full_server(reply).await;
    let base = client.driver_maps().streams;
    for _ in 0..200 {
        let st = c.open_stream().unwrap();
        drop(st);
    }
    let ok = until("the silent streams to be forgotten", || {
        client.driver_maps().streams <= base
    })
    .await;
    let stats = c.stats().unwrap();
    eprintln!(
        "driver streams {} (base {base}); core send_streams {}, recv.streams {}",
        client.driver_maps().streams,
        stats.send_streams,
        stats.recv.streams
    );
    assert!(
        ok,
        "driver entries stayed: {}",
        client.driver_maps().streams
    );
    assert!(
        stats.send_streams <= 2 * LIMIT as u64,
        "{}",
        stats.send_streams
    );
    assert!(stats.recv.streams <= LIMIT as u64, "{}", stats.recv.streams);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_streams_dropped_toward_a_full_peer_are_forgotten() {
    refused_streams(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_streams_dropped_toward_a_full_replying_peer_are_forgotten() {
    refused_streams(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_streams_dropped_toward_a_full_peer_are_forgotten() {
    silent_streams(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_streams_dropped_toward_a_full_replying_peer_are_forgotten() {
    silent_streams(true).await;
}

/// A handle kept after `reset` and `stop` on a stream the full peer refused: the core
/// forgets the stream once the reset is acknowledged (the peer never answers the STOP),
/// and the reader ends with `StreamClosed` instead of waiting forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_handle_of_a_refused_stopped_stream_ends_its_reader() {
    let (_server, client, c, _s, _held_tx, _held_rx) = full_server(true).await;
    let base = client.driver_maps().streams;
    let mut st = c.open_stream().unwrap();
    let id = st.id();
    let r = tokio::time::timeout(T, st.send(Bytes::from_static(b"refused")))
        .await
        .expect("send hung");
    assert_eq!(
        r.as_ref().err().and_then(Error::status),
        Some(WcStatus::RemoteInvalidRequest)
    );
    st.reset(7);
    st.stop(7);
    let end = tokio::time::timeout(T, st.next())
        .await
        .expect("the reader of a forgotten stream hung");
    assert!(
        matches!(end, Some(Err(Error::StreamClosed(i))) if i == id),
        "{end:?}"
    );
    assert!(tokio::time::timeout(T, st.next()).await.unwrap().is_none());
    drop(st);
    assert!(
        until("the entry to go", || client.driver_maps().streams <= base).await,
        "entry stayed"
    );
}
