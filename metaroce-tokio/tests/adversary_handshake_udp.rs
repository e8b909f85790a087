//! Handshake flood over real UDP on 127.0.0.1 (issue #9): 100,000 forged connection
//! Requests from 1,000 source ports. The server keeps no per-peer state (resident memory
//! grows by at most 2 MiB, under 21 bytes per Request), answers with Retries no larger than the Requests (amplification
//! at most 1x in bytes), and a legitimate client connects and moves data during the flood.
//! Also: one host that completes its handshakes and never confirms them cannot lock other
//! clients out (`max_half_open_per_source`); two endpoints with default configuration
//! never share QPN space or secrets (OS seeding).

use bytes::Bytes;
use metaroce::wire::{self, icrc, Bth, ConnectEth, ConnectKind, Headers, Opcode};
use metaroce_tokio::{Config, Endpoint};
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn request(from: SocketAddr, to: SocketAddr, k: u32) -> Vec<u8> {
    request_with_cookie(from, to, k, [0; 16])
}

fn request_with_cookie(from: SocketAddr, to: SocketAddr, k: u32, cookie: [u8; 16]) -> Vec<u8> {
    let mut m = ConnectEth::new(ConnectKind::Request);
    m.cookie = cookie;
    m.paths = 8;
    m.src_qpn = (k % 0xFF_FFF0) + 2;
    m.pmtu = 4096;
    m.listen_port = from.port();
    m.nonce = u64::from(k).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let h = Headers::Connect(m);
    let mut p = vec![0u8; wire::packet_len(&h, 0)];
    wire::emit_packet(&Bth::new(Opcode::MR_CONNECT, 0, 0), &h, &[], &mut p).unwrap();
    let ip = icrc::IpHeader::synthesized(from.ip(), to.ip()).unwrap();
    icrc::stamp(&ip, from.port(), to.port(), &mut p).unwrap();
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_flood_keeps_state_bounded_and_lets_clients_in() {
    let server = Endpoint::bind("127.0.0.1:0".parse().unwrap(), Config::default())
        .await
        .unwrap();
    let saddr = server.local_addr();
    let s2 = server.clone();
    let acceptor = tokio::spawn(async move {
        let mut n = 0u32;
        // Streams are kept open until the end: dropping one resets it and stops the peer's
        // sender (metaroce-tokio's drop semantics), which would fail its last send.
        let mut kept = Vec::new();
        while let Some(inc) = s2.accept().await {
            let Ok(c) = inc.accept() else { continue };
            n += 1;
            let st = c.accept_stream().await;
            if let Some(mut st) = st {
                use futures::StreamExt;
                while let Some(Ok(m)) = st.next().await {
                    if m.len() == 1 {
                        break;
                    }
                }
                kept.push(st);
            }
            if n == 2 {
                break;
            }
        }
        (n, kept)
    });
    // Warm up (allocator, tokio, first connection) before measuring.
    let warm = Endpoint::bind("127.0.0.1:0".parse().unwrap(), Config::default())
        .await
        .unwrap();
    let wc = warm.connect(saddr).unwrap().await.unwrap();
    {
        use futures::SinkExt;
        let mut st = wc.open_stream().unwrap();
        st.send(Bytes::from_static(b"warm up")).await.unwrap();
        st.send(Bytes::from_static(b"x")).await.unwrap();
    }
    // The legitimate client's endpoint (its sockets, receive batch buffers, driver) is
    // bound before the baseline too: the bound is on what the flood costs, and the client
    // alone is part of the noise the bound below must allow for.
    let client = Endpoint::bind("127.0.0.1:0".parse().unwrap(), Config::default())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let rss0 = rss_kib();

    // The attacker: 1,000 sockets, 100 Requests each, in a thread.
    let sent = Arc::new(AtomicU64::new(0));
    let back = Arc::new(AtomicU64::new(0));
    let half = Arc::new(AtomicBool::new(false));
    let (sent2, back2, half2) = (sent.clone(), back.clone(), half.clone());
    let flood = std::thread::spawn(move || {
        let socks: Vec<UdpSocket> = (0..1000)
            .map(|_| {
                let s = UdpSocket::bind("127.0.0.1:0").unwrap();
                s.set_nonblocking(true).unwrap();
                s
            })
            .collect();
        let t0 = Instant::now();
        let mut buf = [0u8; 2048];
        for k in 0..100_000u32 {
            let s = &socks[(k % 1000) as usize];
            let p = request(s.local_addr().unwrap(), saddr, k);
            if s.send_to(&p, saddr).is_ok() {
                sent2.fetch_add(p.len() as u64, Ordering::Relaxed);
            }
            if k % 64 == 0 {
                // Pace a little so the server's socket buffer does not just drop it all.
                std::thread::sleep(Duration::from_micros(200));
            }
            if k == 50_000 {
                half2.store(true, Ordering::Relaxed);
            }
            if k % 1000 == 999 {
                for s in &socks {
                    while let Ok(n) = s.recv(&mut buf) {
                        back2.fetch_add(n as u64, Ordering::Relaxed);
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(200));
        for s in &socks {
            while let Ok(n) = s.recv(&mut buf) {
                back2.fetch_add(n as u64, Ordering::Relaxed);
            }
        }
        t0.elapsed()
    });
    // A legitimate client connects in the middle of the flood and sends data.
    while !half.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let t = Instant::now();
    let c = client
        .connect(saddr)
        .expect("connect starts")
        .await
        .expect("legitimate client connects");
    let connect_time = t.elapsed();
    let during = !flood.is_finished();
    {
        use futures::SinkExt;
        let mut st = c.open_stream().unwrap();
        st.send(Bytes::from(vec![7u8; 100_000])).await.unwrap();
        st.send(Bytes::from_static(b"y")).await.unwrap();
    }
    let elapsed = flood.join().unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let rss1 = rss_kib();
    let st = server.stats();
    let (sent, back) = (sent.load(Ordering::Relaxed), back.load(Ordering::Relaxed));
    println!(
        "flood: 100000 Requests ({sent} B) in {elapsed:?}; server got {} handshake B, sent {} B of Retries ({} retries, {} dropped answers); attacker got back {back} B; amplification {:.3}",
        st.handshake_bytes_in,
        st.handshake_bytes_out,
        st.retries_sent,
        st.control_dropped,
        back as f64 / sent.max(1) as f64
    );
    println!(
        "RSS {rss0} KiB -> {rss1} KiB (+{} KiB); legitimate client connected in {connect_time:?} (during the flood: {during})",
        rss1 as i64 - rss0 as i64
    );
    let (accepted, _streams) = acceptor.await.unwrap();
    assert_eq!(accepted, 2, "only the two real clients");
    assert!(back <= sent, "amplification above 1x");
    assert!(st.handshake_bytes_out <= st.handshake_bytes_in);
    assert!(st.retries_sent > 0);
    // 2 MiB for 100,000 Requests: per-Request state of 21 bytes or more would exceed it (a
    // half-open connection is hundreds). The growth that does not come from Requests (the
    // client's connection and message, the attacker thread, allocator arenas) is about the
    // same with 20,000 Requests as with 100,000 (+700..+780 against +584..+752 KiB on an
    // idle machine) and measured +1,148 KiB once in CI: too close to 1 MiB for a bound.
    assert!(
        rss1 <= rss0 + 2048,
        "RSS grew by more than 2 MiB (+{} KiB)",
        rss1 as i64 - rss0 as i64
    );
}

/// A server on 127.0.0.1 with `max_half_open`, whose application accepts every request;
/// the task resolves to the number accepted once the server is closed.
async fn server_accepting_everything(
    max_half_open: usize,
) -> (Endpoint, SocketAddr, tokio::task::JoinHandle<usize>) {
    let cfg = Config {
        max_half_open,
        ..Config::default()
    };
    let server = Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    let saddr = server.local_addr();
    let s2 = server.clone();
    let acceptor = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Some(inc) = s2.accept().await {
            if let Ok(c) = inc.accept() {
                conns.push(c);
            }
        }
        conns.len()
    });
    (server, saddr, acceptor)
}

/// A legitimate client at 127.0.0.1 connects to `saddr` (within 10 s, not refused) and
/// sends one message; its endpoint, kept alive by the caller.
async fn connect_and_send(saddr: SocketAddr) -> Endpoint {
    use futures::SinkExt;
    let client = Endpoint::bind("127.0.0.1:0".parse().unwrap(), Config::default())
        .await
        .unwrap();
    let c = tokio::time::timeout(Duration::from_secs(10), client.connect(saddr).unwrap())
        .await
        .expect("connect does not hang")
        .expect("the legitimate client is not refused");
    let mut stream = c.open_stream().unwrap();
    stream.send(Bytes::from_static(b"in")).await.unwrap();
    client
}

/// One host (127.0.0.2) completes the retry-cookie round trip for 300 connection
/// Requests from its own address and never confirms one. The server (`max_half_open` 128,
/// so that 300 would fill it) accepts every request it is offered. The host holds at most
/// `max_half_open_per_source` (64) half-open connections; its further Requests are refused
/// with reason 5, and a client at 127.0.0.1 connects and sends while the host's
/// connections are still half-open. Without the per-source limit the host fills the table
/// and the client is refused (reason 2): a trial by an attacker at 6,000 Requests/s
/// locked every other client out of the default 4,096 slots until 2 s after the flood.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_never_confirms_cannot_lock_other_clients_out() {
    let (server, saddr, acceptor) = server_accepting_everything(128).await;
    let attacker = std::thread::spawn(move || {
        let s = UdpSocket::bind("127.0.0.2:0").expect("bind 127.0.0.2 (loopback)");
        s.set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        let me = s.local_addr().unwrap();
        let mut buf = [0u8; 2048];
        let (mut accepts, mut source_limited, mut other) = (0u32, 0u32, 0u32);
        for k in 0..300u32 {
            s.send_to(&request(me, saddr, k), saddr).unwrap();
            // Answers to earlier cookie Requests (Accepts, Rejects) may come first.
            let cookie = loop {
                let Ok(n) = s.recv(&mut buf) else { break None };
                let Ok(p) = wire::Packet::parse(&buf[..n]) else {
                    continue;
                };
                let Headers::Connect(m) = p.headers else {
                    continue;
                };
                match m.kind {
                    ConnectKind::Retry => break Some(m.cookie),
                    ConnectKind::Accept => accepts += 1,
                    ConnectKind::Reject if m.reason == ConnectEth::REASON_SOURCE_LIMIT => {
                        source_limited += 1
                    }
                    _ => other += 1,
                }
            };
            let cookie = cookie.expect("a Retry for every Request");
            s.send_to(&request_with_cookie(me, saddr, k, cookie), saddr)
                .unwrap();
        }
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        while let Ok(n) = s.recv(&mut buf) {
            if let Ok(p) = wire::Packet::parse(&buf[..n]) {
                if let Headers::Connect(m) = p.headers {
                    match m.kind {
                        ConnectKind::Accept => accepts += 1,
                        ConnectKind::Reject if m.reason == ConnectEth::REASON_SOURCE_LIMIT => {
                            source_limited += 1
                        }
                        _ => other += 1,
                    }
                }
            }
        }
        (accepts, source_limited, other)
    });
    let (accepts, refused, other) = tokio::task::spawn_blocking(move || attacker.join().unwrap())
        .await
        .unwrap();
    let st = server.stats();
    println!(
        "attacker: {accepts} Accepts (with re-sends), {refused} Rejects reason 5, {other} other; server: {} refused by source",
        st.source_limited
    );
    // 300 cookie Requests: 64 half-open, the rest refused (236, unless the run outlasted
    // the 2 s half-open expiry on a slow machine and freed some slots).
    assert!(st.source_limited >= 100, "{st:?}");
    assert!(refused > 0, "the Rejects carry reason 5");
    // A client elsewhere gets in while the host's connections are half-open (they expire
    // after `handshake_attempts` × `handshake_interval`, 2 s).
    let _client = connect_and_send(saddr).await;
    server.close(0, b"");
    let accepted = acceptor.await.unwrap();
    assert!(
        accepted > 64,
        "the host's connections and the client: {accepted}"
    );
}

/// 200 hosts (127.0.0.2 to 127.0.0.201, one Request each, so no source limit applies)
/// complete the retry-cookie round trip, one every 2 ms or slower, and never confirm,
/// against a server with `max_half_open` 64: the table stays full for the 2 s half-open
/// lifetime. Each Request after the 64th evicts the oldest half-open connection (at least
/// a handshake interval, 100 ms, old, which this pace leaves), and a client at 127.0.0.1
/// connects at once the same way. Before, both were refused with reason 2 until the
/// flood's connections expired, and many sources (one IPv6 host owns a /64 of them) could
/// keep every other client out that way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_hosts_that_never_confirm_cannot_lock_other_clients_out() {
    let (server, saddr, acceptor) = server_accepting_everything(64).await;
    let hosts = tokio::task::spawn_blocking(move || {
        let mut accepted = 0;
        let mut buf = [0u8; 2048];
        for h in 0..200u32 {
            let s = half_open_host(&format!("127.0.0.{}", h + 2), saddr, h);
            std::thread::sleep(Duration::from_millis(2));
            if let Ok(n) = s.recv(&mut buf) {
                if let Ok(p) = wire::Packet::parse(&buf[..n]) {
                    if let Headers::Connect(m) = p.headers {
                        accepted += u32::from(m.kind == ConnectKind::Accept);
                    }
                }
            }
        }
        accepted
    })
    .await
    .unwrap();
    let st = server.stats();
    println!(
        "200 hosts: {hosts} Accepts; server: {} evicted, {} refused",
        st.half_open_evicted, st.rejected
    );
    let _client = connect_and_send(saddr).await;
    assert_eq!(hosts, 200, "every host's Request is accepted");
    assert!(st.half_open_evicted >= 100, "{st:?}");
    assert_eq!(server.stats().rejected, 0);
    server.close(0, b"");
    acceptor.await.unwrap();
}

/// Two endpoints with the default configuration (seeds from the OS) draw different QPNs
/// and keys: nothing is shared between runs or processes.
#[tokio::test]
async fn default_endpoints_are_seeded_from_the_os() {
    let mut rkeys = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..2 {
        let e = Endpoint::bind("127.0.0.1:0".parse().unwrap(), Config::default())
            .await
            .unwrap();
        let mr = e.alloc(4096, metaroce::Access::REMOTE_WRITE);
        let r = mr.remote();
        rkeys.push(r.rkey);
        addrs.push(r.addr);
    }
    assert_ne!(rkeys[0], rkeys[1]);
    assert_ne!(addrs[0], addrs[1]);
}

/// A host at `ip` that completes the retry-cookie round trip for Request `k` and never
/// confirms; its socket.
fn half_open_host(ip: &str, saddr: SocketAddr, k: u32) -> UdpSocket {
    let s = UdpSocket::bind(format!("{ip}:0")).expect("bind 127.0.0.x (loopback)");
    s.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let me = s.local_addr().unwrap();
    let mut buf = [0u8; 2048];
    s.send_to(&request(me, saddr, k), saddr).unwrap();
    let cookie = loop {
        let n = s.recv(&mut buf).expect("a Retry");
        if let Ok(p) = wire::Packet::parse(&buf[..n]) {
            if let Headers::Connect(m) = p.headers {
                if m.kind == ConnectKind::Retry {
                    break m.cookie;
                }
            }
        }
    };
    s.send_to(&request_with_cookie(me, saddr, k, cookie), saddr)
        .unwrap();
    s
}

/// A request the application holds undecided is evicted by a newer one (`max_half_open`
/// 1): its `Incoming::accept` fails with the reason, `HandshakeTimeout` (it said
/// `LocallyClosed`, found by review), and a request accepted and then evicted ends its
/// `Connection` the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_request_fails_with_handshake_timeout() {
    let cfg = Config {
        max_half_open: 1,
        ..Config::default()
    };
    let server = Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    let saddr = server.local_addr();
    let host = |ip: &'static str, k: u32| {
        tokio::task::spawn_blocking(move || half_open_host(ip, saddr, k))
    };
    let _a = host("127.0.0.2", 1).await.unwrap();
    let inc_a = tokio::time::timeout(Duration::from_secs(2), server.accept())
        .await
        .expect("a request")
        .unwrap();
    // Half-open entries are evicted only once a handshake interval (100 ms) old.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let _b = host("127.0.0.3", 2).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(server.stats().half_open_evicted, 1);
    match inc_a.accept() {
        Err(metaroce_tokio::ConnectError::Connection(e)) => {
            assert_eq!(e, metaroce::ConnectionError::HandshakeTimeout)
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    let conn_b = tokio::time::timeout(Duration::from_secs(2), server.accept())
        .await
        .expect("a request")
        .unwrap()
        .accept()
        .expect("accepted");
    tokio::time::sleep(Duration::from_millis(150)).await;
    let _c = host("127.0.0.4", 3).await.unwrap();
    let why = tokio::time::timeout(Duration::from_secs(2), conn_b.closed())
        .await
        .expect("the evicted connection ends");
    assert_eq!(why, metaroce::ConnectionError::HandshakeTimeout);
    server.close(0, b"");
}
