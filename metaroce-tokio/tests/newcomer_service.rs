//! A newcomer's service over loopback: request/response with one stream per request,
//! one-sided WRITE/READ, and the edges a quinn/tokio user pokes at (FIN, resets, cancel
//! safety, backpressure, liveness). Every wait has a timeout, so a hang fails.

use metaroce_tokio::futures::{SinkExt, StreamExt};
use metaroce_tokio::{Access, Bytes, Config, Connection, Endpoint, Error};
use std::time::{Duration, Instant};
use tokio::time::timeout;

mod common;
use common::{pair, pair_with};

const T: Duration = Duration::from_secs(20);

fn payload(i: u32, len: usize) -> Bytes {
    let mut v = Vec::with_capacity(len);
    for k in 0..len {
        v.push((i as usize * 31 + k) as u8);
    }
    Bytes::from(v)
}

/// Echo server: each incoming stream is one request; the reply is sent on the same
/// stream after the request's FIN.
fn spawn_server(peer: Connection) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(mut s) = peer.accept_stream().await {
            tokio::spawn(async move {
                let mut req = Vec::new();
                while let Some(m) = s.next().await {
                    match m {
                        Ok(m) => req.extend_from_slice(&m),
                        Err(_) => return,
                    }
                }
                let mut reply = req.clone();
                reply.reverse();
                if s.send(Bytes::from(reply)).await.is_ok() {
                    let _ = s.close().await;
                }
            });
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_concurrent_stream_per_request_rpcs() {
    let (_se, _ce, conn, peer) = pair(Config::default()).await;
    let server = spawn_server(peer);
    let n = 3000u32;
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..n {
        let conn = conn.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = conn.open_stream()?;
            let req = payload(i, 1 + (i as usize * 97) % 3000);
            s.send(req.clone()).await?;
            s.close().await?;
            let reply = s.next().await.ok_or(Error::StreamClosed(s.id()))??;
            let mut want = req.to_vec();
            want.reverse();
            assert_eq!(&reply[..], &want[..], "reply of request {i}");
            assert!(s.next().await.is_none(), "FIN after the reply");
            Ok::<_, Error>(())
        }));
    }
    let mut failed = 0;
    for t in tasks {
        match timeout(T, t).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => {
                failed += 1;
                eprintln!("request failed: {e}");
            }
            Ok(Err(e)) => panic!("request task panicked: {e}"),
            Err(_) => panic!("request hung"),
        }
    }
    eprintln!("{n} requests in {:?}", start.elapsed());
    assert_eq!(failed, 0);
    server.abort();
}

#[tokio::test]
async fn one_sided_write_read_roundtrip() {
    let (_se, client, conn, peer) = pair(Config::default()).await;
    let len = 3 << 20;
    let target = peer.endpoint().alloc(
        len,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    );
    let src: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    let source = client.register(src.clone(), Access::LOCAL_WRITE);
    timeout(T, conn.write(&source, 0..len as u64, target.remote(), 0))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(target.read(0, len as u64).unwrap(), src);
    let back = client.alloc(len, Access::LOCAL_WRITE);
    timeout(T, conn.read(&back, 0..len as u64, target.remote(), 0))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(back.read(0, len as u64).unwrap(), src);
    // READ without REMOTE_READ rights: an error, not a hang.
    let wo = peer
        .endpoint()
        .alloc(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let r = timeout(T, conn.read(&back, 0..4096, wo.remote(), 0))
        .await
        .unwrap();
    eprintln!("read of write-only region: {r:?}");
    assert!(r.is_err());
    // Connection still usable.
    timeout(T, conn.write(&source, 0..4096, target.remote(), 0))
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn empty_messages_are_delivered_as_messages() {
    let (_se, _ce, conn, peer) = pair(Config::default()).await;
    let mut tx = conn.open_stream().unwrap();
    tx.send(Bytes::from_static(b"a")).await.unwrap();
    timeout(T, tx.send(Bytes::new())).await.unwrap().unwrap();
    tx.send(Bytes::from_static(b"b")).await.unwrap();
    tx.close().await.unwrap();
    let mut rx = timeout(T, peer.accept_stream()).await.unwrap().unwrap();
    let mut got = Vec::new();
    while let Some(m) = timeout(T, rx.next()).await.unwrap() {
        got.push(m.unwrap());
    }
    assert_eq!(
        got,
        vec![
            Bytes::from_static(b"a"),
            Bytes::new(),
            Bytes::from_static(b"b")
        ]
    );
}

/// Cancel safety of the sink: `ready()` under a short timeout, then `start_send`,
/// `flush()` under a short timeout; retried with the same message until `ready()`
/// succeeded. The reader reads slowly. Every message must arrive once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sink_cancelled_mid_wait_loses_and_duplicates_nothing() {
    let mut cfg = Config {
        max_stream_in_flight: 4,
        stream_send_buffer: 64 << 10,
        ..Config::default()
    };
    cfg.transport.max_stream_recv_bytes = 32 << 10;
    let (_se, _ce, conn, peer) = pair(cfg).await;
    let n = 600u32;
    let writer = tokio::spawn(async move {
        let mut tx = conn.open_stream().unwrap();
        let mut cancels = 0;
        for i in 0..n {
            loop {
                match timeout(
                    Duration::from_micros(300),
                    std::future::poll_fn(|cx| tx.poll_ready_unpin(cx)),
                )
                .await
                {
                    Ok(r) => {
                        r.unwrap();
                        break;
                    }
                    Err(_) => cancels += 1,
                }
            }
            tx.start_send_unpin(payload(i, 8 << 10)).unwrap();
            if i % 7 == 0 {
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
            if i % 3 == 0 {
                let _ = timeout(Duration::from_micros(50), tx.flush()).await;
            }
        }
        timeout(T, tx.close()).await.unwrap().unwrap();
        (cancels, conn)
    });
    let mut rx = timeout(T, peer.accept_stream()).await.unwrap().unwrap();
    let mut i = 0u32;
    let mut read_cancels = 0;
    loop {
        // Reader cancelled often too.
        let m = tokio::select! {
            m = rx.next() => m,
            _ = tokio::time::sleep(Duration::from_micros(300)) => { read_cancels += 1; continue }
        };
        let Some(m) = m else { break };
        assert_eq!(m.unwrap(), payload(i, 8 << 10), "message {i}");
        i += 1;
        if i % 4 == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    assert_eq!(i, n);
    let (cancels, _conn) = timeout(T, writer).await.unwrap().unwrap();
    eprintln!("sink waits cancelled: {cancels}, reads cancelled: {read_cancels}");
    assert!(
        cancels > 0 && read_cancels > 0,
        "the test cancelled nothing"
    );
}

#[tokio::test]
async fn reset_and_stop_codes_reach_the_other_side() {
    let (_se, _ce, conn, peer) = pair(Config::default()).await;
    let mut tx = conn.open_stream().unwrap();
    tx.send(Bytes::from_static(b"x")).await.unwrap();
    tx.reset(42);
    let mut rx = timeout(T, peer.accept_stream()).await.unwrap().unwrap();
    assert_eq!(timeout(T, rx.next()).await.unwrap().unwrap().unwrap(), "x");
    let e = timeout(T, rx.next()).await.unwrap().unwrap().unwrap_err();
    eprintln!("reset: {e:?} / {e}");
    assert!(matches!(e, Error::StreamReset { code: 42, .. }), "{e:?}");
    assert!(timeout(T, rx.next()).await.unwrap().is_none());

    // stop from the reader: the sender's sink fails with the code.
    let mut tx = conn.open_stream().unwrap();
    tx.send(Bytes::from_static(b"y")).await.unwrap();
    let mut rx = timeout(T, peer.accept_stream()).await.unwrap().unwrap();
    rx.stop(7);
    let t0 = Instant::now();
    let e = loop {
        match timeout(T, tx.send(Bytes::from_static(b"z"))).await.unwrap() {
            Ok(()) => continue,
            Err(e) => break e,
        }
    };
    eprintln!("stop: {e:?} after {:?}", t0.elapsed());
    assert!(matches!(e, Error::StreamStopped { code: 7, .. }), "{e:?}");
}

/// Dropping the client's connection (all handles) while a reply is being streamed: the
/// server's sink fails, its reader ends, nothing hangs.
#[tokio::test]
async fn dropping_the_connection_mid_transfer_ends_the_peer_stream() {
    let (_se, _ce, conn, peer) = pair(Config::default()).await;
    let mut tx = conn.open_stream().unwrap();
    tx.send(Bytes::from_static(b"go")).await.unwrap();
    let mut rx = timeout(T, peer.accept_stream()).await.unwrap().unwrap();
    timeout(T, rx.next()).await.unwrap().unwrap().unwrap();
    let server = tokio::spawn(async move {
        let mut sent = 0u64;
        loop {
            match timeout(T, rx.send(Bytes::from(vec![1u8; 64 << 10]))).await {
                Ok(Ok(())) => sent += 1,
                Ok(Err(e)) => return (sent, e),
                Err(_) => panic!("server send hung after the client dropped"),
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let t0 = Instant::now();
    drop(tx);
    drop(conn);
    let (sent, e) = timeout(T, server).await.unwrap().unwrap();
    eprintln!("server sent {sent} then {e:?} after {:?}", t0.elapsed());
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert_eq!(
        timeout(T, peer.closed()).await.unwrap(),
        peer.close_reason().unwrap()
    );
}

/// A partition (every datagram dropped) during a flush: how soon, and with what error.
#[tokio::test]
async fn a_partition_mid_flush_fails_within_the_idle_timeout() {
    use metaroce_tokio::backend::{Impaired, Impairment, UdpBackend};
    let mut cfg = Config::default();
    cfg.transport.idle_timeout = Some(Duration::from_secs(2));
    let server = Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg.clone())
        .await
        .unwrap();
    let udp = UdpBackend::bind("127.0.0.1:0".parse().unwrap(), cfg.transport.paths.into()).unwrap();
    let imp = std::sync::Arc::new(Impaired::new(udp, Impairment::default()).unwrap());
    let client = Endpoint::with_backend(imp.clone(), cfg).unwrap();
    let connecting = client.connect(server.local_addr()).unwrap();
    let peer = timeout(T, server.accept())
        .await
        .unwrap()
        .unwrap()
        .accept()
        .unwrap();
    let conn = timeout(T, connecting).await.unwrap().unwrap();
    let mut tx = conn.open_stream().unwrap();
    tx.send(Bytes::from_static(b"hi")).await.unwrap();
    let mut rx = timeout(T, peer.accept_stream()).await.unwrap().unwrap();
    imp.set_impairment(Impairment {
        loss: 1.0,
        ..Impairment::default()
    })
    .unwrap();
    let t0 = Instant::now();
    let r = timeout(T, tx.send(Bytes::from(vec![0u8; 100_000])))
        .await
        .unwrap();
    eprintln!("sender: {r:?} after {:?}", t0.elapsed());
    assert!(r.is_err());
    let _ = timeout(T, rx.next()).await.unwrap(); // "hi"
    let r2 = timeout(T, rx.next()).await.unwrap();
    eprintln!("reader: {r2:?} after {:?}", t0.elapsed());
    assert!(matches!(r2, Some(Err(Error::ConnectionLost(_)))), "{r2:?}");
}

#[tokio::test]
async fn a_message_larger_than_the_stream_receive_budget_arrives() {
    let (_se, _ce, conn, peer) = pair(Config::default()).await;
    let mut tx = conn.open_stream().unwrap();
    let big = payload(5, 40 << 20);
    let b2 = big.clone();
    let w = tokio::spawn(async move {
        tx.send(b2).await.unwrap();
        tx.send(Bytes::from_static(b"tail")).await.unwrap();
        tx.close().await.unwrap();
    });
    let mut rx = timeout(T, peer.accept_stream()).await.unwrap().unwrap();
    assert!(timeout(T, rx.next()).await.unwrap().unwrap().unwrap() == big);
    assert_eq!(
        timeout(T, rx.next()).await.unwrap().unwrap().unwrap(),
        "tail"
    );
    assert!(timeout(T, rx.next()).await.unwrap().is_none());
    timeout(T, w).await.unwrap().unwrap();
}

#[tokio::test]
async fn cancelled_read_and_write_then_reuse() {
    let (_se, client, conn, peer) = pair(Config::default()).await;
    let len = 8 << 20;
    let target = peer.endpoint().alloc(
        len,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    );
    let src: Vec<u8> = (0..len).map(|i| (i * 13 % 253) as u8).collect();
    let source = client.register(src.clone(), Access::LOCAL_WRITE);
    let back = client.alloc(len, Access::LOCAL_WRITE);
    for round in 0..20u64 {
        let cut = Duration::from_micros(100 + round * 150);
        let _ = timeout(cut, conn.write(&source, 0..len as u64, target.remote(), 0)).await;
        let _ = timeout(cut, conn.read(&back, 0..len as u64, target.remote(), 0)).await;
    }
    timeout(T, conn.write(&source, 0..len as u64, target.remote(), 0))
        .await
        .unwrap()
        .unwrap();
    back.write(0, &vec![0u8; len]).unwrap();
    timeout(T, conn.read(&back, 0..len as u64, target.remote(), 0))
        .await
        .unwrap()
        .unwrap();
    assert!(back.read(0, len as u64).unwrap() == src);
    // Atomics: misaligned offset, and on a region without REMOTE_ATOMIC.
    let ctr = peer
        .endpoint()
        .alloc(16, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC);
    let r = timeout(T, conn.fetch_add(ctr.remote(), 4, 1))
        .await
        .unwrap();
    eprintln!("misaligned fetch_add: {r:?}");
    assert!(r.is_err());
    let r = timeout(T, conn.fetch_add(target.remote(), 0, 1))
        .await
        .unwrap();
    eprintln!("fetch_add without REMOTE_ATOMIC: {r:?}");
    assert!(r.is_err());
    assert_eq!(
        timeout(T, conn.fetch_add(ctr.remote(), 8, 5))
            .await
            .unwrap()
            .unwrap(),
        0
    );
    assert_eq!(
        timeout(T, conn.fetch_add(ctr.remote(), 8, 5))
            .await
            .unwrap()
            .unwrap(),
        5
    );
}

/// A region dropped at the owner while the peer writes into it.
#[tokio::test]
async fn a_write_into_a_dropped_region_fails_cleanly() {
    let (_se, client, conn, peer) = pair(Config::default()).await;
    let target = peer
        .endpoint()
        .alloc(1 << 20, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let remote = target.remote();
    let source = client.register(vec![9u8; 1 << 20], Access::LOCAL_WRITE);
    timeout(T, conn.write(&source, 0..1 << 20, remote, 0))
        .await
        .unwrap()
        .unwrap();
    drop(target);
    let r = timeout(T, conn.write(&source, 0..1 << 20, remote, 0))
        .await
        .unwrap();
    eprintln!("write into a dropped region: {r:?}");
    assert!(r.is_err());
    // The connection survives a remote access error? (RDMA RC would move the QP to error.)
    let mut s = conn.open_stream().unwrap();
    let r = timeout(T, s.send(Bytes::from_static(b"after")))
        .await
        .unwrap();
    eprintln!("send after a remote access error: {r:?}");
    r.unwrap();
}

/// A server with `scfg` and a client with `ccfg`, connected (`common::pair_with`).
async fn pair2(scfg: Config, ccfg: Config) -> (Endpoint, Endpoint, Connection, Connection) {
    let client = Endpoint::bind("127.0.0.1:0".parse().unwrap(), ccfg)
        .await
        .unwrap();
    pair_with(scfg, client).await
}

#[tokio::test]
async fn highest_stream_ids_work_and_are_single_use() {
    let (_se, _ce, conn, peer) = pair(Config::default()).await;
    for id in [u32::MAX, u32::MAX - 1, 0x8000_0000] {
        let mut tx = conn.stream(id).unwrap();
        timeout(T, tx.send(Bytes::from_static(b"edge")))
            .await
            .unwrap()
            .unwrap();
        timeout(T, tx.close()).await.unwrap().unwrap();
        let mut rx = timeout(T, peer.accept_stream()).await.unwrap().unwrap();
        assert_eq!(rx.id(), id);
        assert_eq!(
            timeout(T, rx.next()).await.unwrap().unwrap().unwrap(),
            "edge"
        );
        assert!(timeout(T, rx.next()).await.unwrap().is_none());
        rx.close().await.unwrap();
        drop(rx);
        drop(tx);
        tokio::time::sleep(Duration::from_millis(20)).await;
        let again = conn.stream(id);
        eprintln!("reopen {id:#x}: {again:?}");
        assert!(matches!(again, Err(Error::StreamClosed(_))), "{again:?}");
    }
    // Connection still fine.
    let mut tx = conn.open_stream().unwrap();
    timeout(T, tx.send(Bytes::from_static(b"ok")))
        .await
        .unwrap()
        .unwrap();
}

/// A receiver with a smaller `max_message_size` than the sender.
#[tokio::test]
async fn a_message_over_the_peers_max_message_size_fails_clearly() {
    let mut scfg = Config::default();
    scfg.transport.max_message_size = 4096;
    let (_se, _ce, conn, peer) = pair2(scfg, Config::default()).await;
    let mut tx = conn.open_stream().unwrap();
    timeout(T, tx.send(Bytes::from_static(b"small")))
        .await
        .unwrap()
        .unwrap();
    let r = timeout(T, tx.send(Bytes::from(vec![1u8; 10_000]))).await;
    eprintln!("sink send of 10000 B to a 4096 B peer: {r:?}");
    let r = r.expect("send hung");
    assert!(r.is_err());
    let r2 = timeout(T, conn.send(100, Bytes::from(vec![1u8; 10_000]))).await;
    eprintln!("Connection::send of 10000 B: {r2:?}");
    assert!(r2.expect("send hung").is_err());
    let mut rx = timeout(T, peer.accept_stream()).await.unwrap().unwrap();
    assert_eq!(
        timeout(T, rx.next()).await.unwrap().unwrap().unwrap(),
        "small"
    );
    // A WRITE larger than the peer's max_message_size.
    let target = peer
        .endpoint()
        .alloc(1 << 16, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let src = conn.endpoint().alloc(1 << 16, Access::LOCAL_WRITE);
    let w = timeout(T, conn.write(&src, 0..1 << 16, target.remote(), 0)).await;
    eprintln!("WRITE of 64 KiB to a 4096 B max peer: {w:?}");
    w.expect("write hung").ok();
    // Connection still works for small ones.
    let mut tx2 = conn.open_stream().unwrap();
    let r3 = timeout(T, tx2.send(Bytes::from_static(b"after"))).await;
    eprintln!("after: {r3:?}");
    r3.expect("hung").unwrap();
}

/// Many more concurrent requests than the server's `max_streams`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_concurrent_requests_than_max_streams() {
    let mut scfg = Config::default();
    scfg.transport.max_streams = 32;
    let (_se, _ce, conn, peer) = pair2(scfg, Config::default()).await;
    let server = spawn_server(peer);
    let n = 400u32;
    let mut tasks = Vec::new();
    for i in 0..n {
        let conn = conn.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = conn.open_stream()?;
            s.send(payload(i, 100)).await?;
            s.close().await?;
            let reply = s.next().await.ok_or(Error::StreamClosed(s.id()))??;
            assert_eq!(reply.len(), 100);
            Ok::<_, Error>(())
        }));
    }
    let mut errs = std::collections::BTreeMap::<String, u32>::new();
    for t in tasks {
        match timeout(T, t).await {
            Ok(Ok(Ok(()))) => *errs.entry("ok".into()).or_default() += 1,
            Ok(Ok(Err(e))) => {
                let kind = match e.status() {
                    Some(st) => format!("{st:?}"),
                    None => format!("{e:?}"),
                };
                *errs.entry(kind).or_default() += 1
            }
            Ok(Err(e)) => panic!("task panicked: {e}"),
            Err(_) => *errs.entry("HUNG".into()).or_default() += 1,
        }
    }
    eprintln!("{errs:?}");
    assert!(!errs.contains_key("HUNG"));
    // Afterwards (every request resolved, every handle dropped) the connection serves
    // requests again.
    let t0 = Instant::now();
    let mut fails = 0;
    loop {
        let mut s = conn.open_stream().unwrap();
        match timeout(T, s.send(payload(1, 10))).await.unwrap() {
            Ok(()) => break,
            Err(e) => {
                fails += 1;
                if t0.elapsed() > Duration::from_secs(5) {
                    panic!(
                        "no request served {:?} after the burst, with nothing open \
                         ({fails} refused; the burst: {errs:?}): {e:?}",
                        t0.elapsed()
                    );
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    eprintln!("served again after {:?}, {fails} refused", t0.elapsed());
    server.abort();
}

/// Endpoint::close with thousands of requests in flight: every one resolves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_close_with_requests_in_flight_resolves_all() {
    let (_se, client, conn, peer) = pair(Config::default()).await;
    let server = spawn_server(peer);
    let n = 2000u32;
    let mut tasks = Vec::new();
    for i in 0..n {
        let conn = conn.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = conn.open_stream()?;
            s.send(payload(i, 2000)).await?;
            s.close().await?;
            let reply = s.next().await.ok_or(Error::StreamClosed(s.id()))??;
            assert_eq!(reply.len(), 2000);
            Ok::<_, Error>(())
        }));
    }
    tokio::time::sleep(Duration::from_millis(5)).await;
    client.close(9, b"shutdown");
    let mut errs = std::collections::BTreeMap::<String, u32>::new();
    for t in tasks {
        match timeout(T, t).await {
            Ok(Ok(Ok(()))) => *errs.entry("ok".into()).or_default() += 1,
            Ok(Ok(Err(e))) => *errs.entry(format!("{e:?}")).or_default() += 1,
            Ok(Err(e)) => panic!("task panicked: {e}"),
            Err(_) => *errs.entry("HUNG".into()).or_default() += 1,
        }
    }
    eprintln!("{errs:#?}");
    assert!(!errs.contains_key("HUNG"));
    timeout(T, client.wait_idle()).await.unwrap();
    server.abort();
}

#[tokio::test]
async fn sequential_requests_under_a_small_max_streams() {
    let mut scfg = Config::default();
    scfg.transport.max_streams = 8;
    let (_se, _ce, conn, peer) = pair2(scfg, Config::default()).await;
    let server = spawn_server(peer);
    for i in 0..100u32 {
        let mut s = conn.open_stream().unwrap();
        timeout(T, s.send(payload(i, 100)))
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("request {i}: {e:?}"));
        timeout(T, s.close()).await.unwrap().unwrap();
        timeout(T, s.next()).await.unwrap().unwrap().unwrap();
        assert!(timeout(T, s.next()).await.unwrap().is_none());
    }
    server.abort();
}

/// Cycles of: the client fills the server's `max_streams` with open requests, one more
/// request is refused (`RemoteInvalidRequest`, documented) and dropped, then every open
/// request completes (both sides finish and drop their streams). Each cycle leaves
/// nothing open, so the next cycle's first requests must be accepted.
///
/// Fails on df9461f: at cycle 5 (with `max_streams` 4) the first request is refused with
/// nothing open, and every later one too. The refused ids are never recorded by the
/// server (no room), so each leaves a hole in the set of closed stream ids
/// (`RecvState::retired`); once that set has `max_streams` ranges, `try_retire` keeps
/// completed streams instead of forgetting them, they fill the table, and every new stream
/// is refused for the rest of the connection's life. README: "a connection can open one
/// per request without end (`max_streams` bounds the streams open at once)". Now the
/// refusal carries a flag, the client aborts the refused stream from message 0, and the
/// server records its id as closed (docs/PROTOCOL.md, "Refused streams").
#[tokio::test]
async fn refusals_at_max_streams_do_not_wedge_the_connection() {
    const MAX: u32 = 4;
    let mut scfg = Config::default();
    scfg.transport.max_streams = MAX;
    let (_se, _ce, conn, peer) = pair2(scfg, Config::default()).await;
    let srv = spawn_server(peer);
    for cycle in 0..3 * MAX {
        let mut open = Vec::new();
        for i in 0..MAX {
            let mut s = conn.open_stream().unwrap();
            let r = timeout(T, s.send(payload(i, 10))).await.expect("send hung");
            if let Err(e) = r {
                panic!("cycle {cycle}: request {i} of {MAX} refused with nothing open: {e:?}");
            }
            open.push(s);
        }
        let mut extra = conn.open_stream().unwrap();
        let r = timeout(T, extra.send(payload(99, 10)))
            .await
            .expect("send hung");
        match r {
            Err(metaroce_tokio::Error::StreamRefused { .. }) => {}
            other => panic!("cycle {cycle}: request beyond max_streams: {other:?}"),
        }
        // The sink stays failed with it; the stream is over for sending.
        let again = timeout(T, extra.send(payload(98, 10)))
            .await
            .expect("send hung");
        assert!(
            matches!(again, Err(metaroce_tokio::Error::StreamRefused { .. })),
            "{again:?}"
        );
        drop(extra);
        // `Connection::send` on a new stream says the same.
        let id = 1_000_001 + 2 * cycle;
        let r = timeout(T, conn.send(id, payload(97, 10)))
            .await
            .expect("send hung");
        match r {
            Err(e @ metaroce_tokio::Error::StreamRefused { stream }) => {
                assert_eq!(stream, id);
                assert_eq!(
                    e.status(),
                    Some(metaroce_tokio::metaroce::WcStatus::RemoteInvalidRequest)
                );
            }
            other => panic!("cycle {cycle}: Connection::send beyond max_streams: {other:?}"),
        }
        for mut s in open {
            timeout(T, s.close()).await.unwrap().unwrap();
            timeout(T, s.next()).await.unwrap().unwrap().unwrap();
            assert!(timeout(T, s.next()).await.unwrap().is_none());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    srv.abort();
}

/// A stale descriptor (the region was dropped and another allocated in its place) must
/// not reach the new region.
#[tokio::test]
async fn a_stale_remote_descriptor_does_not_reach_a_new_region() {
    let (_se, client, conn, peer) = pair(Config::default()).await;
    let src = client.register(vec![0xAB; 4096], Access::LOCAL_WRITE);
    let mut hits = 0;
    for _ in 0..200 {
        let a = peer
            .endpoint()
            .alloc(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        let stale = a.remote();
        drop(a);
        let b = peer
            .endpoint()
            .alloc(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        let r = timeout(T, conn.write(&src, 0..4096, stale, 0))
            .await
            .unwrap();
        if r.is_ok() || b.read(0, 1).unwrap()[0] != 0 {
            hits += 1;
        }
    }
    assert_eq!(hits, 0, "stale descriptors wrote into new regions");
}

#[tokio::test]
async fn accept_under_timeouts_loses_no_connection_request() {
    let server = Endpoint::bind("127.0.0.1:0".parse().unwrap(), Config::default())
        .await
        .unwrap();
    let client = Endpoint::bind("127.0.0.1:0".parse().unwrap(), Config::default())
        .await
        .unwrap();
    let n = 40;
    let mut conns = Vec::new();
    for _ in 0..n {
        let c = client.connect(server.local_addr()).unwrap();
        conns.push(tokio::spawn(c));
    }
    let mut accepted = Vec::new();
    let t0 = Instant::now();
    while accepted.len() < n && t0.elapsed() < T {
        if let Ok(Some(inc)) = timeout(Duration::from_micros(200), server.accept()).await {
            accepted.push(inc.accept().unwrap());
        }
    }
    assert_eq!(accepted.len(), n);
    for c in conns {
        timeout(T, c).await.unwrap().unwrap().unwrap();
    }
}

#[tokio::test]
async fn local_region_errors_are_values() {
    let (_se, client, conn, peer) = pair(Config::default()).await;
    let target = peer.endpoint().alloc(
        4096,
        Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE,
    );
    let ro = client.alloc(4096, Access::NONE);
    let r = timeout(T, conn.read(&ro, 0..4096, target.remote(), 0))
        .await
        .unwrap();
    eprintln!("READ into a region without LOCAL_WRITE: {r:?}");
    assert!(r.is_err());
    let src = client.alloc(100, Access::LOCAL_WRITE);
    let r = timeout(T, conn.write(&src, 0..200, target.remote(), 0))
        .await
        .unwrap();
    eprintln!("WRITE of a range past the source: {r:?}");
    assert!(r.is_err());
    let other = Endpoint::bind("127.0.0.1:0".parse().unwrap(), Config::default())
        .await
        .unwrap();
    let foreign = other.alloc(100, Access::LOCAL_WRITE);
    let r = timeout(T, conn.write(&foreign, 0..100, target.remote(), 0))
        .await
        .unwrap();
    eprintln!("WRITE from another endpoint's region: {r:?}");
    assert!(r.is_err());
    let r = timeout(T, conn.write(&src, 0..0, target.remote(), 0))
        .await
        .unwrap();
    eprintln!("zero-length WRITE: {r:?}");
}

/// Request/response where both sides drop their stream as soon as they are done with it
/// (the client right after reading the reply, without waiting for the FIN; the server
/// right after `close`). Afterwards neither driver keeps a stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_drops_leave_no_stream_state() {
    let (server_ep, client_ep, conn, peer) = pair(Config::default()).await;
    let srv = tokio::spawn(async move {
        while let Some(mut s) = peer.accept_stream().await {
            tokio::spawn(async move {
                let Some(Ok(m)) = s.next().await else { return };
                // Reply before the request's FIN (full duplex), then finish.
                if s.send(m).await.is_ok() {
                    let _ = s.close().await;
                }
            });
        }
    });
    let n = 2000u32;
    let mut tasks = Vec::new();
    for i in 0..n {
        let conn = conn.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = conn.open_stream()?;
            s.send(payload(i, 64)).await?;
            // The server may have replied, finished and dropped its handle (a stop)
            // before this close: then it says so.
            match s.close().await {
                Ok(()) | Err(Error::StreamStopped { code: 0, .. }) => {}
                Err(e) => return Err(e),
            }
            let r = s.next().await.ok_or(Error::StreamClosed(0))??;
            assert_eq!(r, payload(i, 64));
            Ok::<_, Error>(())
        }));
    }
    for t in tasks {
        timeout(T, t).await.unwrap().unwrap().unwrap();
    }
    let t0 = Instant::now();
    loop {
        let (c, s) = (client_ep.driver_maps(), server_ep.driver_maps());
        if c.streams == 0 && s.streams == 0 && c.waiters == 0 && s.waiters == 0 {
            break;
        }
        if t0.elapsed() > Duration::from_secs(5) {
            panic!("stream state left: client {c:?} server {s:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // And the connection is still fully usable.
    let mut s = conn.open_stream().unwrap();
    timeout(T, s.send(payload(1, 8))).await.unwrap().unwrap();
    srv.abort();
}

/// `close()` under a short timeout, retried until it returns: the reader sees every
/// message once and then the end, never a reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_retried_after_timeouts_finishes_cleanly() {
    let mut cfg = Config::default();
    cfg.transport.max_stream_recv_bytes = 16 << 10;
    let (_se, _ce, conn, peer) = pair(cfg).await;
    let writer = tokio::spawn(async move {
        let mut tx = conn.open_stream().unwrap();
        for i in 0..200u32 {
            tx.feed(payload(i, 4 << 10)).await.unwrap();
        }
        let mut cancelled = 0;
        loop {
            match timeout(Duration::from_micros(500), tx.close()).await {
                Ok(r) => {
                    r.unwrap();
                    break;
                }
                Err(_) => cancelled += 1,
            }
        }
        drop(tx);
        (cancelled, conn)
    });
    let mut rx = timeout(T, peer.accept_stream()).await.unwrap().unwrap();
    let mut i = 0;
    while let Some(m) = timeout(T, rx.next()).await.unwrap() {
        assert_eq!(m.unwrap(), payload(i, 4 << 10));
        i += 1;
        if i % 10 == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    assert_eq!(i, 200);
    let (cancelled, _c) = timeout(T, writer).await.unwrap().unwrap();
    eprintln!("close cancelled {cancelled} times");
    assert!(cancelled > 0, "the test cancelled nothing");
}

/// The writer keeps sending on a stream whose reader was dropped: it learns at once.
#[tokio::test]
async fn a_dropped_reader_stops_the_writer() {
    let (_se, _ce, conn, peer) = pair(Config::default()).await;
    let mut tx = conn.open_stream().unwrap();
    tx.send(Bytes::from_static(b"first")).await.unwrap();
    let rx = timeout(T, peer.accept_stream()).await.unwrap().unwrap();
    drop(rx);
    let t0 = Instant::now();
    let mut sent = 0;
    let e = loop {
        match timeout(T, tx.send(Bytes::from(vec![0u8; 1 << 16])))
            .await
            .unwrap()
        {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
    };
    eprintln!("after {sent} more sends, {:?}: {e:?}", t0.elapsed());
    assert!(matches!(e, Error::StreamStopped { code: 0, .. }), "{e:?}");
}

/// The peer dropped its handle (a stop with `RESET_ON_DROP`, documented as "its sink sees
/// `StreamStopped`"), then this side closes: `close()` says the stream was stopped by the
/// peer, not that this side finished or reset it (`StreamClosed`).
#[tokio::test]
async fn close_after_the_peer_stopped_reports_stream_stopped() {
    let (_se, _ce, conn, peer) = pair(Config::default()).await;
    let mut tx = conn.open_stream().unwrap();
    tx.send(Bytes::from_static(b"req")).await.unwrap();
    let mut rx = timeout(T, peer.accept_stream()).await.unwrap().unwrap();
    rx.stop(5);
    // Let the stop arrive.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let r = timeout(T, tx.close()).await.unwrap();
    assert_eq!(
        r,
        Err(Error::StreamStopped {
            stream: tx.id(),
            code: 5
        })
    );
    // The other sink calls agree.
    let r = timeout(T, tx.send(Bytes::from_static(b"more")))
        .await
        .unwrap();
    eprintln!("send after that: {r:?}");
}

/// Stream handles opened and dropped unused, between requests: the ids they skip must
/// not use up the server's `max_streams`.
#[tokio::test]
async fn unused_stream_handles_between_requests_do_not_wedge_the_connection() {
    let mut scfg = Config::default();
    scfg.transport.max_streams = 4;
    let (_se, _ce, conn, peer) = pair2(scfg, Config::default()).await;
    let srv = spawn_server(peer);
    for i in 0..40u32 {
        drop(conn.open_stream().unwrap());
        let mut s = conn.open_stream().unwrap();
        let r = timeout(T, s.send(payload(i, 10))).await.expect("hung");
        if let Err(e) = r {
            panic!("request {i} refused: {e:?}");
        }
        timeout(T, s.close()).await.unwrap().unwrap();
        timeout(T, s.next()).await.unwrap().unwrap().unwrap();
        assert!(timeout(T, s.next()).await.unwrap().is_none());
    }
    srv.abort();
}

/// The request/response service through loss, duplicates and reordering (both
/// directions impaired): every reply correct, nothing hangs, no stream state left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_per_request_through_loss_duplicates_and_reordering() {
    use metaroce_tokio::backend::{Impaired, Impairment, UdpBackend};
    let cfg = Config::default();
    let imp = Impairment {
        loss: 0.05,
        duplicate: 0.02,
        reorder: 0.02,
        reorder_delay: Duration::from_micros(300),
        seed: 7,
        ..Impairment::default()
    };
    let mk = |seed: u64| {
        let udp =
            UdpBackend::bind("127.0.0.1:0".parse().unwrap(), cfg.transport.paths.into()).unwrap();
        let b = std::sync::Arc::new(
            Impaired::new(
                udp,
                Impairment {
                    seed,
                    ..imp.clone()
                },
            )
            .unwrap(),
        );
        (Endpoint::with_backend(b.clone(), cfg.clone()).unwrap(), b)
    };
    let (server_ep, sb) = mk(1);
    let (client_ep, cb) = mk(2);
    let connecting = client_ep.connect(server_ep.local_addr()).unwrap();
    let peer = timeout(T, server_ep.accept())
        .await
        .unwrap()
        .unwrap()
        .accept()
        .unwrap();
    let conn = timeout(T, connecting).await.unwrap().unwrap();
    let srv = spawn_server(peer);
    let n = 1000u32;
    let mut tasks = Vec::new();
    for i in 0..n {
        let conn = conn.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = conn.open_stream()?;
            let req = payload(i, 1 + (i as usize * 131) % 9000);
            s.send(req.clone()).await?;
            s.close().await?;
            let reply = s.next().await.ok_or(Error::StreamClosed(s.id()))??;
            let mut want = req.to_vec();
            want.reverse();
            assert_eq!(&reply[..], &want[..], "reply of request {i}");
            assert!(s.next().await.is_none());
            Ok::<_, Error>(())
        }));
    }
    let t0 = Instant::now();
    for t in tasks {
        timeout(T, t).await.expect("request hung").unwrap().unwrap();
    }
    let (ss, cs) = (sb.stats(), cb.stats());
    eprintln!("{n} requests through impairment in {:?}; dropped {} + {}, duplicated {} + {}, reordered {} + {}", t0.elapsed(), ss.dropped, cs.dropped, ss.duplicated, cs.duplicated, ss.reordered, cs.reordered);
    assert!(ss.dropped > 0 && cs.dropped > 0);
    let t0 = Instant::now();
    loop {
        let (c, s) = (client_ep.driver_maps(), server_ep.driver_maps());
        if c.streams == 0 && s.streams == 0 && c.waiters == 0 && s.waiters == 0 {
            break;
        }
        if t0.elapsed() > Duration::from_secs(10) {
            panic!("stream state left: client {c:?} server {s:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    srv.abort();
}

/// Eager drops on both sides (server: reply, finish, drop before the request's FIN;
/// client: drop right after the reply) through loss, duplicates and reordering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_drops_through_loss_duplicates_and_reordering() {
    use metaroce_tokio::backend::{Impaired, Impairment, UdpBackend};
    let cfg = Config::default();
    let mk = |seed: u64| {
        let udp =
            UdpBackend::bind("127.0.0.1:0".parse().unwrap(), cfg.transport.paths.into()).unwrap();
        let imp = Impairment {
            loss: 0.05,
            duplicate: 0.02,
            reorder: 0.02,
            reorder_delay: Duration::from_micros(300),
            seed,
            ..Impairment::default()
        };
        Endpoint::with_backend(Impaired::new(udp, imp).unwrap(), cfg.clone()).unwrap()
    };
    let server_ep = mk(11);
    let client_ep = mk(12);
    let connecting = client_ep.connect(server_ep.local_addr()).unwrap();
    let peer = timeout(T, server_ep.accept())
        .await
        .unwrap()
        .unwrap()
        .accept()
        .unwrap();
    let conn = timeout(T, connecting).await.unwrap().unwrap();
    let srv = tokio::spawn(async move {
        while let Some(mut s) = peer.accept_stream().await {
            tokio::spawn(async move {
                let Some(Ok(m)) = s.next().await else { return };
                if s.send(m).await.is_ok() {
                    let _ = s.close().await;
                }
            });
        }
    });
    let n = 1000u32;
    let mut tasks = Vec::new();
    for i in 0..n {
        let conn = conn.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = conn.open_stream()?;
            s.send(payload(i, 1 + (i as usize * 131) % 9000)).await?;
            match s.close().await {
                Ok(()) | Err(Error::StreamStopped { code: 0, .. }) => {}
                Err(e) => return Err(e),
            }
            let r = s.next().await.ok_or(Error::StreamClosed(0))??;
            assert_eq!(r, payload(i, 1 + (i as usize * 131) % 9000));
            Ok::<_, Error>(())
        }));
    }
    for t in tasks {
        timeout(T, t).await.expect("request hung").unwrap().unwrap();
    }
    let t0 = Instant::now();
    loop {
        let (c, s) = (client_ep.driver_maps(), server_ep.driver_maps());
        if c.streams == 0 && s.streams == 0 && c.waiters == 0 && s.waiters == 0 {
            break;
        }
        if t0.elapsed() > Duration::from_secs(10) {
            panic!("stream state left: client {c:?} server {s:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    srv.abort();
}

/// `recv_imm` raced against a short timer in `select!`: every immediate is seen once,
/// in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recv_imm_under_select_loses_and_duplicates_nothing() {
    let (_se, client, conn, peer) = pair(Config::default()).await;
    let target = peer
        .endpoint()
        .alloc(1 << 20, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let remote = target.remote();
    let n = 3000u32;
    let writer = tokio::spawn(async move {
        let src = client.register(vec![0u8; 1 << 20], Access::LOCAL_WRITE);
        for i in 0..n {
            let off = (i as u64 % 256) * 4096;
            src.write(off, &i.to_le_bytes()).unwrap();
            timeout(
                T,
                conn.write_with_imm(&src, off..off + 4096, remote, off, i),
            )
            .await
            .unwrap()
            .unwrap();
            if i % 100 == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        conn
    });
    let mut want = 0u32;
    let mut cancelled = 0;
    while want < n {
        tokio::select! {
            v = peer.recv_imm() => {
                let (imm, len) = v.expect("connection ended");
                assert_eq!((imm, len), (want, 4096), "immediate {want}");
                want += 1;
            }
            _ = tokio::time::sleep(Duration::from_micros(200)) => cancelled += 1,
        }
    }
    let _conn = timeout(T, writer).await.unwrap().unwrap();
    eprintln!("recv_imm cancelled {cancelled} times");
    assert!(cancelled > 0);
}
