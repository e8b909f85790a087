//! Sharded endpoints (issue #13 item 4, `Config::shards`): several cores, locks and driver
//! tasks behind one UDP port, datagrams steered in the kernel by a reuseport program on
//! the BTH DestQP. Over real UDP on 127.0.0.1, on a 2-worker runtime.

use metaroce::wire::{self, icrc, AckEth, Bth, ConnectEth, ConnectKind, Headers, Opcode};
use metaroce::Access;
use metaroce_tokio::{Config, Connection, Endpoint};
use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

fn cfg(shards: usize, seed: u64) -> Config {
    Config {
        shards,
        seed: Some(seed),
        ..Config::default()
    }
}

async fn bind(shards: usize, seed: u64) -> Endpoint {
    let ep = Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg(shards, seed))
        .await
        .unwrap();
    assert_eq!(ep.shards(), shards, "the steering program was not attached");
    ep
}

/// `n` connections from `client` to `server`, paired (client side, server side). Fails
/// (rather than hangs) if a handshake does not complete in 20 s — what a mis-steered
/// handshake does.
async fn connect_n(
    client: &Endpoint,
    server: &Endpoint,
    n: usize,
) -> Vec<(Connection, Connection)> {
    tokio::time::timeout(Duration::from_secs(20), connect_all(client, server, n))
        .await
        .expect("handshakes did not complete: datagrams reached the wrong shard?")
}

async fn connect_all(
    client: &Endpoint,
    server: &Endpoint,
    n: usize,
) -> Vec<(Connection, Connection)> {
    let mut out = Vec::new();
    for _ in 0..n {
        let connecting = client.connect(server.local_addr()).unwrap();
        let inc = server.accept().await.expect("a request");
        let s = inc.accept().unwrap();
        let c = connecting.await.unwrap();
        out.push((c, s));
    }
    out
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_connections_over_two_shards_write_and_read() {
    const CONNS: usize = 8;
    const LEN: usize = 256 << 10;
    let server = bind(2, 11).await;
    let client = bind(2, 12).await;
    // Registered before any connection: one region, reachable from both shards.
    let target = server.alloc(
        CONNS * LEN,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
    );
    let pairs = connect_n(&client, &server, CONNS).await;
    // Round-robin on the client, and the server's half of each follows the client's QPN.
    assert_eq!(client.shard_connections(), vec![4, 4]);
    assert_eq!(server.shard_connections(), vec![4, 4]);
    for (c, s) in &pairs {
        assert_eq!(
            c.handle().0 % 2,
            s.handle().0 % 2,
            "the two halves of a connection sit on different shards"
        );
    }
    let mut tasks = Vec::new();
    for (i, (c, _)) in pairs.iter().enumerate() {
        let c = c.clone();
        let ep = client.clone();
        let remote = target.remote();
        tasks.push(tokio::spawn(async move {
            let data = pattern(i as u64 + 1, LEN);
            let src = ep.register(data.clone(), Access::LOCAL_WRITE);
            c.write(&src, 0..LEN as u64, remote, (i * LEN) as u64)
                .await
                .unwrap();
            let back = ep.alloc(LEN, Access::LOCAL_WRITE);
            c.read(&back, 0..LEN as u64, remote, (i * LEN) as u64)
                .await
                .unwrap();
            assert_eq!(back.read(0, LEN as u64).unwrap(), data, "READ of conn {i}");
            // An atomic's result region lives on every shard for the atomic's lifetime.
            let old = c.fetch_add(remote, (i * LEN) as u64, 1).await.unwrap();
            assert_eq!(old, u64::from_le_bytes(data[..8].try_into().unwrap()));
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    for i in 0..CONNS {
        let mut want = pattern(i as u64 + 1, LEN);
        let first = u64::from_le_bytes(want[..8].try_into().unwrap()).wrapping_add(1);
        want[..8].copy_from_slice(&first.to_le_bytes());
        assert_eq!(
            target.read((i * LEN) as u64, LEN as u64).unwrap(),
            want,
            "server region, conn {i}"
        );
    }
    for ep in [&server, &client] {
        for (k, st) in ep.shard_stats().iter().enumerate() {
            assert_eq!(
                st.unknown_connection, 0,
                "shard {k} got another shard's packets"
            );
            assert!(st.datagrams_received > 0, "shard {k} received nothing");
        }
    }
    // Every region (the atomics' results too) is gone from every shard when dropped.
    let before = client.registered_regions();
    assert_eq!(before, 0, "client regions left: {before}");
    drop(pairs);
    client.close(0, b"");
    client.wait_idle().await;
    server.wait_idle().await;
    assert_eq!(server.driver_maps().connections, 0);
}

/// A server bound with `scfg` (two shards), a two-shard client seeded `client_seed`, and
/// eight connections between them, four on each server shard, each of which has sent three
/// messages: every one an active sender for the fair share and the window grant
/// (`fair_share_window` is set to 30 s), whose ACKs have carried the grants back.
async fn eight_active_senders(
    mut scfg: Config,
    client_seed: u64,
) -> (Endpoint, Endpoint, Vec<(Connection, Connection)>) {
    scfg.transport.fair_share_window = Duration::from_secs(30);
    let server = Endpoint::bind("127.0.0.1:0".parse().unwrap(), scfg)
        .await
        .unwrap();
    assert_eq!(server.shards(), 2, "the steering program was not attached");
    let client = bind(2, client_seed).await;
    let pairs = connect_n(&client, &server, 8).await;
    assert_eq!(server.shard_connections(), vec![4, 4]);
    for round in 0..3u8 {
        for (c, _) in &pairs {
            c.send(round as u32, bytes::Bytes::from(vec![round; 4000]))
                .await
                .unwrap();
        }
    }
    (server, client, pairs)
}

/// Receiver-driven fair share on a sharded endpoint: the shards are separate cores behind
/// one address and NIC, so the grants they hand out together must not exceed the
/// configured `recv_capacity_mbps`. Eight connections, four on each of two shards, all
/// active (each sent a message within `fair_share_window`): each must be granted
/// 1000 / 8, not 1000 / 4. Before the fix each shard divided the capacity among its own
/// four senders only, and the grants summed to 2000 Mbit/s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_share_over_two_shards_grants_no_more_than_the_capacity() {
    const CONNS: usize = 8;
    const CAPACITY: u32 = 1000;
    let mut scfg = cfg(2, 41);
    scfg.transport.recv_capacity_mbps = CAPACITY;
    let (_server, _client, pairs) = eight_active_senders(scfg, 42).await;
    let granted: Vec<u32> = pairs
        .iter()
        .map(|(_, s)| s.stats().unwrap().granted_rate_mbps)
        .collect();
    let hinted: Vec<u32> = pairs
        .iter()
        .map(|(c, _)| c.stats().unwrap().peer_rate_hint_mbps)
        .collect();
    println!("granted by the server's shards: {granted:?}; seen by the senders: {hinted:?}");
    let total: u32 = granted.iter().sum();
    assert!(
        total <= CAPACITY,
        "the shards grant {total} Mbit/s together, capacity {CAPACITY}: {granted:?}"
    );
    assert!(
        granted.iter().all(|&g| g == CAPACITY / CONNS as u32),
        "each active sender gets an equal share of the whole capacity: {granted:?}"
    );
    let seen: u32 = hinted.iter().sum();
    assert!(
        seen <= CAPACITY,
        "the senders were granted {seen} Mbit/s together: {hinted:?}"
    );
}

/// The receiver window grant on a sharded endpoint: each shard has its own socket, so it
/// divides its own buffer among its own active senders. `socket_recv_buffer` 4 MiB, four
/// active connections per shard: each is granted 4 MiB / 2 / 4 = 512 KiB, 128 packets of
/// 4096 bytes (dividing among all eight would give 64), and its sender hears that in the
/// ACKs. Left at 0, the endpoint takes the size of its socket's receive buffer instead,
/// and still grants something; with `Config::window_grant` off it grants nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn window_grant_divides_each_shards_own_socket_buffer() {
    for (buffer, on, want) in [
        (4u64 << 20, true, Some(128u32)),
        (0, true, None),
        (0, false, Some(0)),
    ] {
        let mut scfg = cfg(2, 43);
        scfg.transport.socket_recv_buffer = buffer;
        scfg.window_grant = on;
        let (_server, _client, pairs) = eight_active_senders(scfg, 44).await;
        let granted: Vec<u32> = pairs
            .iter()
            .map(|(_, s)| s.stats().unwrap().granted_window)
            .collect();
        let heard: Vec<u32> = pairs
            .iter()
            .map(|(c, _)| c.stats().unwrap().peer_window_grant)
            .collect();
        assert_eq!(granted, heard, "the senders heard what was granted");
        match want {
            Some(w) => assert!(granted.iter().all(|&g| g == w), "{granted:?}, want {w}"),
            None => assert!(
                granted.iter().all(|&g| g > 0 && g == granted[0]),
                "the socket's buffer, shared equally: {granted:?}"
            ),
        }
    }
}

/// A well-formed MR_ACK (valid ICRC) without the connection's token: a forgery.
fn forged_ack(from: SocketAddr, to: SocketAddr, dest_qp: u32) -> Vec<u8> {
    let h = Headers::Ack(AckEth::default());
    let mut p = vec![0u8; wire::packet_len(&h, 0)];
    wire::emit_packet(&Bth::new(Opcode::MR_ACK, dest_qp, 5), &h, &[], &mut p).unwrap();
    let ip = icrc::IpHeader::synthesized(from.ip(), to.ip()).unwrap();
    icrc::stamp(&ip, from.port(), to.port(), &mut p).unwrap();
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_packets_reach_only_their_shard_and_are_dropped() {
    let server = bind(2, 21).await;
    let client = bind(2, 22).await;
    let pairs = connect_n(&client, &server, 2).await;
    let to = server.local_addr();
    let forger = UdpSocket::bind("127.0.0.1:0").unwrap();
    let from = forger.local_addr().unwrap();
    let before = server.shard_stats();
    // An ACK without a token for each live server-side QPN (one per shard: counted as
    // missing authentication by the shard that owns the QPN, and by no other), and for
    // QPNs no connection has, in both residue classes (unknown connection, on the shard of
    // the residue class).
    let live: Vec<u32> = pairs.iter().map(|(_, s)| s.handle().0).collect();
    let mut dead = Vec::new();
    for q in [0x00_1000u32, 0x00_1001] {
        let mut q = q;
        while live.contains(&q) {
            q += 2;
        }
        dead.push(q);
    }
    const EACH: u64 = 50;
    for q in live.iter().chain(&dead) {
        for _ in 0..EACH {
            forger.send_to(&forged_ack(from, to, *q), to).unwrap();
        }
    }
    let mut after = server.shard_stats();
    for _ in 0..200 {
        after = server.shard_stats();
        let got: u64 = after
            .iter()
            .zip(&before)
            .map(|(a, b)| {
                (a.missing_auth + a.bad_auth + a.unknown_connection)
                    - (b.missing_auth + b.bad_auth + b.unknown_connection)
            })
            .sum();
        if got >= 4 * EACH {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for k in 0..2usize {
        let (a, b) = (&after[k], &before[k]);
        let live_here = live.iter().filter(|q| **q as usize % 2 == k).count() as u64;
        let dead_here = dead.iter().filter(|q| **q as usize % 2 == k).count() as u64;
        assert_eq!(
            (a.missing_auth + a.bad_auth) - (b.missing_auth + b.bad_auth),
            live_here * EACH,
            "shard {k}: forged packets for its connections"
        );
        assert_eq!(
            a.unknown_connection - b.unknown_connection,
            dead_here * EACH,
            "shard {k}: forged packets for no connection"
        );
    }
    // Nothing was mis-delivered: the connections still work.
    let region = server.alloc(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    for (c, s) in &pairs {
        assert!(s.close_reason().is_none());
        let src = client.register(vec![7u8; 4096], Access::LOCAL_WRITE);
        c.write(&src, 0..4096, region.remote(), 0).await.unwrap();
    }
}

fn request(from: SocketAddr, to: SocketAddr, src_qpn: u32, nonce: u64) -> Vec<u8> {
    let mut m = ConnectEth::new(ConnectKind::Request);
    m.paths = 8;
    m.src_qpn = src_qpn;
    m.pmtu = 4096;
    m.listen_port = from.port();
    m.nonce = nonce;
    let h = Headers::Connect(m);
    let mut p = vec![0u8; wire::packet_len(&h, 0)];
    wire::emit_packet(&Bth::new(Opcode::MR_CONNECT, 0, 0), &h, &[], &mut p).unwrap();
    let ip = icrc::IpHeader::synthesized(from.ip(), to.ip()).unwrap();
    icrc::stamp(&ip, from.port(), to.port(), &mut p).unwrap();
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_flood_on_one_shard_does_not_lock_clients_out() {
    let server = bind(2, 31).await;
    let client = bind(2, 32).await;
    let to = server.local_addr();
    let flood = std::thread::spawn(move || {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        let from = s.local_addr().unwrap();
        for k in 0..20_000u32 {
            // Every forged client QPN is even: the whole flood lands on shard 0.
            let q = ((k * 2) % 0xFF_FFF0) + 2;
            let _ = s.send_to(&request(from, to, q, (u64::from(k) * 0x9E37) | 1), to);
        }
    });
    // Meanwhile clients on both client shards connect (so through both server shards),
    // each through the Retry round trip of the shard that issued the cookie.
    let pairs = connect_n(&client, &server, 6).await;
    flood.join().unwrap();
    assert_eq!(server.shard_connections(), vec![3, 3]);
    let st = server.shard_stats();
    assert!(
        st[0].retries_sent > 1_000,
        "the flood did not reach shard 0: {st:?}"
    );
    assert!(
        st[1].retries_sent <= 3 + 3,
        "shard 1 answered forged requests: {}",
        st[1].retries_sent
    );
    assert_eq!(
        st[0].bad_cookie + st[1].bad_cookie,
        0,
        "a cookie checked by the wrong shard"
    );
    for (c, s) in &pairs {
        let mut tx = c.open_stream().unwrap();
        use futures::{SinkExt, StreamExt};
        tx.send(bytes::Bytes::from_static(b"hello")).await.unwrap();
        let mut rx = s.accept_stream().await.unwrap();
        assert_eq!(&rx.next().await.unwrap().unwrap()[..], b"hello");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_shard_and_two_shards_interoperate() {
    let server = bind(1, 41).await;
    let client = bind(2, 42).await;
    let pairs = connect_n(&client, &server, 4).await;
    let region = client.alloc(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    for (c, s) in &pairs {
        let src = server.register(vec![c.handle().0 as u8; 4096], Access::LOCAL_WRITE);
        s.write(&src, 0..4096, region.remote(), 0).await.unwrap();
    }
    assert_eq!(client.shard_connections(), vec![2, 2]);
}

#[tokio::test]
async fn zero_or_too_many_shards_are_refused() {
    for n in [0, metaroce_tokio::MAX_SHARDS + 1] {
        let e = Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg(n, 1))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{n}: {e}");
    }
}

#[test]
fn the_environment_sets_the_default() {
    // The suites run sharded with METAROCE_TOKIO_SHARDS=2: check that it took effect.
    match std::env::var("METAROCE_TOKIO_SHARDS").ok().as_deref() {
        Some("2") => assert_eq!(Config::default().shards, 2),
        None => assert_eq!(Config::default().shards, 1),
        Some(_) => {}
    }
}
