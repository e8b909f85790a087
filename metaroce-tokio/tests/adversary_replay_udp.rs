//! An attacker on loopback with a plain `std::net::UdpSocket`, against running endpoints:
//! captured packets of a live connection re-sent from another IP, replays of a closed
//! connection's packets (handshake included) at its successor on the same sockets, CLOSEs
//! forged without the keys, junk (empty, tiny, truncated, bit-flipped, oversized) on every
//! socket either endpoint opened, and a flood of replays and junk during a transfer.
//!
//! The capture is a tap backend (the endpoint's own transmits, as an on-path observer
//! would see them); the attacker sends from its own sockets and re-stamps the ICRC for its
//! own addresses (the ICRC is no MAC). What an on-path attacker who *computes* tokens from
//! captured nonces can do is documented in PROTOCOL.md and not tested here.

mod common;

use common::CONNECT_LIMIT;
use metaroce::wire::{
    self, icrc, Bth, CloseEth, ConnectEth, ConnectKind, Headers, Opcode, Packet, Trailer,
};
use metaroce_tokio::backend::{DatagramBackend, UdpBackend};
use metaroce_tokio::futures::{SinkExt, StreamExt};
use metaroce_tokio::{forward_datagram_backend, Access, Bytes, Config, Connection, Endpoint};
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

/// One captured datagram: where it went and its UDP payload.
#[derive(Clone, Debug)]
struct Captured {
    to: SocketAddr,
    bytes: Vec<u8>,
}

/// What a tap records and whether it lets the endpoint's transmits through.
#[derive(Debug, Default)]
struct TapState {
    captured: Mutex<Vec<Captured>>,
    /// Record transmits.
    record: AtomicBool,
    /// Drop transmits (after recording them): the network loses them.
    hold: AtomicBool,
}

/// A UDP backend that records every datagram the endpoint sends (an on-path observer).
#[derive(Debug)]
struct Tap {
    inner: UdpBackend,
    state: Arc<TapState>,
}

impl DatagramBackend for Tap {
    forward_datagram_backend!([.inner] local_addr, source_ports, max_gso_segments,
        max_gro_segments, socket_recv_buffer, poll_recv, poll_recv_in_place, flush,
        send_from_any_task);

    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        transmit: &metaroce::Transmit,
        contents: &[u8],
    ) -> Poll<std::io::Result<()>> {
        if self.state.record.load(Ordering::Relaxed) {
            let seg = transmit.segment_size.unwrap_or(contents.len()).max(1);
            let mut cap = self.state.captured.lock().unwrap();
            for d in contents.chunks(seg) {
                cap.push(Captured {
                    to: transmit.destination,
                    bytes: d.to_vec(),
                });
            }
        }
        if self.state.hold.load(Ordering::Relaxed) {
            return Poll::Ready(Ok(()));
        }
        self.inner.poll_send(cx, transmit, contents)
    }
}

impl TapState {
    fn take(&self) -> Vec<Captured> {
        std::mem::take(&mut *self.captured.lock().unwrap())
    }
}

/// An endpoint on 127.0.0.1 behind a tap (recording from the start).
fn tapped(cfg: Config) -> (Endpoint, Arc<TapState>) {
    let ports = cfg.transport.paths as usize + cfg.spare_ports;
    let inner = UdpBackend::bind_with("127.0.0.1:0".parse().unwrap(), ports, &cfg.udp).unwrap();
    let state = Arc::new(TapState::default());
    state.record.store(true, Ordering::Relaxed);
    let ep = Endpoint::with_backend(
        Tap {
            inner,
            state: state.clone(),
        },
        cfg,
    )
    .unwrap();
    (ep, state)
}

async fn bind_local() -> Endpoint {
    Endpoint::bind("127.0.0.1:0".parse().unwrap(), Config::default())
        .await
        .unwrap()
}

/// Re-send `bytes` from `sock` to `to`, with the ICRC re-stamped for the attacker's own
/// source address and port (what an attacker who recomputes the CRC sends).
fn resend(sock: &UdpSocket, to: SocketAddr, bytes: &[u8]) {
    let mut b = bytes.to_vec();
    let from = sock.local_addr().unwrap();
    if b.len() >= 16 {
        let ip = icrc::IpHeader::synthesized(from.ip(), to.ip()).unwrap();
        let _ = icrc::stamp(&ip, from.port(), to.port(), &mut b);
    }
    let _ = sock.send_to(&b, to);
}

fn parsed(c: &Captured) -> Option<Packet<'_>> {
    Packet::parse(&c.bytes).ok()
}

/// One message over a fresh stream from `a` to `b`, checked on arrival: the connection
/// still carries traffic.
async fn still_works(a: &Connection, b: &Connection, tag: &'static [u8]) {
    let mut tx = a.open_stream().unwrap();
    tx.send(Bytes::from_static(tag)).await.unwrap();
    let mut rx = tokio::time::timeout(CONNECT_LIMIT, b.accept_stream())
        .await
        .expect("no stream")
        .expect("connection ended");
    let m = tokio::time::timeout(CONNECT_LIMIT, rx.next())
        .await
        .expect("no message")
        .unwrap()
        .unwrap();
    assert_eq!(&m[..], tag);
}

/// Every socket the endpoints opened: each one's main address and its path ports.
fn every_socket(eps: &[&Endpoint]) -> Vec<SocketAddr> {
    let mut all = Vec::new();
    for ep in eps {
        let ip = ep.local_addr().ip();
        all.push(ep.local_addr());
        all.extend(
            ep.source_ports()
                .into_iter()
                .map(|p| SocketAddr::new(ip, p)),
        );
    }
    all
}

async fn connect(server: &Endpoint, client: &Endpoint) -> (Connection, Connection) {
    common::connect(server, client).await
}

/// A live connection's own packets, captured and withheld from the server, re-sent from
/// another loopback IP (127.0.0.2): the source-IP check drops every one, and nothing of
/// the WRITE they carry lands until the real client's retransmissions get through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captured_packets_from_another_ip_land_nothing() {
    let server = bind_local().await;
    let (client, tap) = tapped(Config::default());
    let (conn, _peer) = connect(&server, &client).await;
    let target = server.alloc(8192, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let src = client.register(vec![0xA5; 8192], Access::LOCAL_WRITE);

    tap.take();
    tap.hold.store(true, Ordering::Relaxed);
    let remote = target.remote();
    let write = tokio::spawn({
        let conn = conn.clone();
        async move { conn.write(&src, 0..8192, remote, 0).await }
    });
    // Wait until the WRITE's packets were captured (and withheld).
    let writes = loop {
        let cap: Vec<Captured> = tap
            .captured
            .lock()
            .unwrap()
            .iter()
            .filter(|c| parsed(c).is_some_and(|p| matches!(p.headers, Headers::Write { .. })))
            .cloned()
            .collect();
        if cap.len() >= 2 {
            break cap;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let before = server.stats();
    let other = UdpSocket::bind("127.0.0.2:0").unwrap();
    for _ in 0..3 {
        for c in &writes {
            resend(&other, c.to, &c.bytes);
        }
    }
    // Wait until the server has seen them all.
    let sent = 3 * writes.len() as u64;
    for _ in 0..400 {
        if server.stats().unknown_connection - before.unknown_connection >= sent {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let after = server.stats();
    assert!(
        after.unknown_connection - before.unknown_connection >= sent,
        "packets from a foreign IP are counted as not belonging: {before:?} -> {after:?}"
    );
    assert!(
        target.read(0, 8192).unwrap().iter().all(|&b| b == 0),
        "a packet from a foreign IP placed data"
    );
    assert!(!write.is_finished(), "the WRITE completed without delivery");

    tap.hold.store(false, Ordering::Relaxed);
    let wc = tokio::time::timeout(CONNECT_LIMIT * 3, write)
        .await
        .expect("the WRITE never completed once the path healed")
        .unwrap()
        .unwrap();
    assert_eq!(wc.status, metaroce_tokio::WcStatus::Success);
    assert!(target.read(0, 8192).unwrap().iter().all(|&b| b == 0xA5));
}

/// Everything a closed connection's client sent (handshake, SENDs, a WRITE, ACKs, its
/// close), replayed at the server while a new connection between the same sockets runs:
/// no data lands in the region the old WRITE targeted, no message appears on the new
/// connection, and the new connection carries on. The replayed handshake Request (valid
/// cookie, still in its time bucket) must not make the server's application see a new
/// `Incoming`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_of_a_closed_connection_land_nowhere_on_its_successor() {
    let server = bind_local().await;
    let (client, tap) = tapped(Config::default());
    let target = server.alloc(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);

    let (old, old_peer) = connect(&server, &client).await;
    let src = client.register(vec![0x5A; 4096], Access::LOCAL_WRITE);
    old.write(&src, 0..4096, target.remote(), 0).await.unwrap();
    still_works(&old, &old_peer, b"old incarnation").await;
    old.close(0, b"bye");
    old_peer.closed().await;
    client.wait_idle().await;
    let captured = tap.take();
    tap.record.store(false, Ordering::Relaxed);
    assert!(
        captured
            .iter()
            .any(|c| parsed(c).is_some_and(|p| p.bth.opcode == Opcode::MR_CONNECT)),
        "the handshake was captured"
    );
    target.write(0, &[0; 4096]).unwrap();

    let (new, new_peer) = connect(&server, &client).await;
    let before = server.stats();
    let attacker = UdpSocket::bind("127.0.0.1:0").unwrap();
    for _ in 0..3 {
        for c in captured.iter().filter(|c| c.to == server.local_addr()) {
            resend(&attacker, c.to, &c.bytes);
        }
    }
    still_works(&new, &new_peer, b"new incarnation").await;
    // No stream, no message and no request from the replays.
    let extra = tokio::time::timeout(Duration::from_millis(300), new_peer.accept_stream()).await;
    assert!(
        extra.is_err(),
        "a replayed SEND opened a stream on the new connection"
    );
    let ghost = tokio::time::timeout(Duration::from_millis(300), server.accept()).await;
    assert!(
        ghost.is_err(),
        "a replayed Request of the old connection surfaced as an Incoming"
    );
    assert!(
        target.read(0, 4096).unwrap().iter().all(|&b| b == 0),
        "a replayed WRITE of the old connection landed"
    );
    let after = server.stats();
    assert!(after.unknown_connection > before.unknown_connection);
    assert!(new.close_reason().is_none() && new_peer.close_reason().is_none());
    still_works(&new_peer, &new, b"still up").await;
}

/// A captured handshake Request (with its valid retry cookie) of a connection that has
/// since closed, replayed from the client's IP while the cookie is still good (one to two
/// `retry_cookie_lifetime`s, 10–20 s by default), creates nothing: the server's
/// application sees no `Incoming` the client never sent, and the core counts the replay
/// (`EndpointStats::replayed_requests`). Before, the ended connection's nonce was forgotten
/// and the replay made a held connection (AEAD does not help: MR_CONNECT is never
/// protected); accepted, that ghost lived until the real client answered its Accept with
/// MR_CLOSE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_request_of_a_closed_connection_surfaces_no_incoming() {
    let server = bind_local().await;
    let (client, tap) = tapped(Config::default());
    let (old, old_peer) = connect(&server, &client).await;
    old.close(0, b"bye");
    old_peer.closed().await;
    client.wait_idle().await;
    let requests: Vec<Captured> = tap
        .take()
        .into_iter()
        .filter(|c| {
            parsed(c).is_some_and(
                |p| matches!(p.headers, Headers::Connect(m) if m.kind == ConnectKind::Request),
            )
        })
        .collect();
    assert!(!requests.is_empty());
    let attacker = UdpSocket::bind("127.0.0.1:0").unwrap();
    for c in &requests {
        resend(&attacker, c.to, &c.bytes);
    }
    let ghost = tokio::time::timeout(Duration::from_millis(500), server.accept()).await;
    assert!(
        ghost.is_err(),
        "a replayed Request of a closed connection surfaced as an Incoming from {:?}",
        ghost.ok().flatten().and_then(|i| i.remote_addr())
    );
    // The first Request carried no cookie (it got a Retry again); the one with the cookie
    // is the replay the server recognised.
    let with_cookie = requests
        .iter()
        .filter_map(parsed)
        .filter(|p| matches!(p.headers, Headers::Connect(m) if m.cookie != [0; 16]))
        .count();
    assert!(with_cookie >= 1);
    assert_eq!(server.stats().replayed_requests, with_cookie as u64);
    // The client itself connects again at once (a new nonce).
    let (conn, peer) = connect(&server, &client).await;
    still_works(&conn, &peer, b"a fresh connection").await;
}

/// MR_CLOSE forged by an attacker who knows both QPNs but not the keys: without a trailer,
/// with a guessed token, as a close and as an answer, at both ends; then junk at every
/// socket either endpoint opened (main and path ports): nothing ends the connection, each
/// forgery is counted, and traffic goes on in both directions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_closes_and_junk_on_every_socket_change_nothing() {
    let (server, stap) = tapped(Config::default());
    let (client, ctap) = tapped(Config::default());
    let (conn, peer) = connect(&server, &client).await;
    still_works(&conn, &peer, b"warm up").await;
    let qpn_of = |cap: &[Captured], to: SocketAddr| {
        cap.iter()
            .filter(|c| c.to == to)
            .filter_map(parsed)
            .find(|p| p.bth.opcode != Opcode::MR_CONNECT)
            .map(|p| p.bth.dest_qp)
            .expect("a packet to the peer")
    };
    let ccap = ctap.take();
    let scap = stap.take();
    let server_qpn = qpn_of(&ccap, server.local_addr());
    let client_qpn = qpn_of(&scap, client.local_addr());
    let sample = ccap
        .iter()
        .chain(&scap)
        .filter(|c| parsed(c).is_some_and(|p| !p.payload.is_empty()))
        .cloned()
        .collect::<Vec<_>>();
    assert!(!sample.is_empty());

    let attacker = UdpSocket::bind("127.0.0.1:0").unwrap();
    let from = attacker.local_addr().unwrap();
    let (s0, c0) = (server.stats(), client.stats());
    let mut forged = 0u64;
    for (qpn, to) in [
        (server_qpn, server.local_addr()),
        (client_qpn, client.local_addr()),
    ] {
        for flags in [0, CloseEth::FLAG_ACK] {
            for trailer in [Trailer::None, Trailer::Token(0x0123_4567_89AB_CDEF)] {
                let hdrs = Headers::Close(CloseEth {
                    reason: 9,
                    flags,
                    reply_port: from.port(),
                    nonce: 0xDEAD_BEEF,
                });
                let payload: &[u8] = if flags == 0 { b"forged" } else { b"" };
                let mut buf = vec![0; wire::packet_len_with(&hdrs, payload.len(), &trailer)];
                let bth = Bth::new(Opcode::MR_CLOSE, qpn, 0);
                wire::emit_packet_with(&bth, &hdrs, payload, &trailer, &mut buf).unwrap();
                resend(&attacker, to, &buf);
                forged += 1;
            }
        }
    }
    // Junk at every socket of both endpoints.
    let targets = every_socket(&[&server, &client]);
    let big = vec![0xC0; 65_507];
    for &to in &targets {
        for len in [0usize, 1, 4, 12, 15, 16, 17, 9000] {
            let _ = attacker.send_to(&big[..len], to);
        }
        let _ = attacker.send_to(&big, to);
        for c in &sample {
            // Truncations of a real packet (ICRC re-stamped, so parsing and the connection
            // logic see them), and bit flips: as they are (a wrong ICRC) and with the token
            // changed too and the ICRC re-stamped (any header value, without the key; a
            // flip that keeps the captured token is an on-path injection, out of scope).
            let n = c.bytes.len();
            for cut in (1..n).step_by(7) {
                resend(&attacker, to, &c.bytes[..cut]);
            }
            for pos in (0..n - 12).step_by(3) {
                let mut b = c.bytes.clone();
                b[pos] ^= 1 << (pos % 8);
                let _ = attacker.send_to(&b, to);
                b[n - 5] ^= 0x80;
                resend(&attacker, to, &b);
            }
        }
    }
    still_works(&conn, &peer, b"after the junk").await;
    still_works(&peer, &conn, b"and back").await;
    let (s1, c1) = (server.stats(), client.stats());
    let auth = |a: &metaroce::EndpointStats, b: &metaroce::EndpointStats| {
        (b.missing_auth - a.missing_auth) + (b.bad_auth - a.bad_auth)
    };
    assert!(
        auth(&s0, &s1) + auth(&c0, &c1) >= forged,
        "every forged close is counted as failing authentication"
    );
    assert!(s1.malformed > s0.malformed && c1.malformed > c0.malformed);
    assert!(conn.close_reason().is_none(), "{:?}", conn.close_reason());
    assert!(peer.close_reason().is_none(), "{:?}", peer.close_reason());
    let target = server.alloc(1 << 16, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let src = client.register(vec![3; 1 << 16], Access::LOCAL_WRITE);
    conn.write(&src, 0..1 << 16, target.remote(), 0)
        .await
        .unwrap();
    assert!(target.read(0, 1 << 16).unwrap().iter().all(|&b| b == 3));
}

/// While a bulk WRITE transfer and a stream run, a thread floods the server's and the
/// client's main and path sockets with replays of both sides' captured packets (valid
/// tokens, stale PSNs and ACK state) and junk, as fast as it can (bounded): the transfer
/// completes, every byte is right, the stream delivers every message in order, and both
/// connections stay up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_and_junk_flood_during_a_transfer_corrupts_nothing() {
    const TOTAL: usize = 8 << 20;
    const CHUNK: usize = 1 << 20;
    const ROUNDS: usize = 4;
    const MAX_FLOOD: u64 = 2_000_000;
    let (server, stap) = tapped(Config::default());
    let (client, ctap) = tapped(Config::default());
    let (conn, peer) = connect(&server, &client).await;
    // A first round whose packets the attacker captures.
    let target = server.alloc(TOTAL, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let src = client.register(vec![0x11; TOTAL], Access::LOCAL_WRITE);
    conn.write(&src, 0..CHUNK as u64, target.remote(), 0)
        .await
        .unwrap();
    still_works(&conn, &peer, b"captured").await;
    let mut captured = ctap.take();
    captured.extend(stap.take());
    ctap.record.store(false, Ordering::Relaxed);
    stap.record.store(false, Ordering::Relaxed);
    let targets = every_socket(&[&server, &client]);

    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let flood = std::thread::spawn({
        let (stop, sent) = (stop.clone(), sent.clone());
        move || {
            let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
            let mut k = 0u64;
            while !stop.load(Ordering::Relaxed) && k < MAX_FLOOD {
                let c = &captured[k as usize % captured.len()];
                if k % 3 == 0 {
                    // Replay to the right endpoint.
                    resend(&sock, c.to, &c.bytes);
                } else {
                    let to = targets[k as usize % targets.len()];
                    let cut = (k as usize * 13) % (c.bytes.len() + 1);
                    let _ = sock.send_to(&c.bytes[..cut], to);
                }
                k += 1;
                if k % 1024 == 0 {
                    sent.store(k, Ordering::Relaxed);
                }
            }
            sent.store(k, Ordering::Relaxed);
        }
    });

    // The flood is under way before the transfer starts (it ends when the transfer has).
    while sent.load(Ordering::Relaxed) < 4096 && !flood.is_finished() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let started = std::time::Instant::now();
    let mut tx = conn.open_stream().unwrap();
    let sender = tokio::spawn(async move {
        for i in 0u32..200 {
            tx.send(Bytes::from(i.to_be_bytes().to_vec()))
                .await
                .unwrap();
        }
        tx.close().await.unwrap();
    });
    for round in 0..ROUNDS {
        let pattern: Vec<u8> = (0..TOTAL).map(|i| ((i + round) % 251) as u8).collect();
        let src2 = client.register(pattern.clone(), Access::LOCAL_WRITE);
        let writes = futures_join(&conn, &src2, &target, TOTAL, CHUNK);
        tokio::time::timeout(Duration::from_secs(120), writes)
            .await
            .expect("the transfer did not complete under the flood");
        assert_eq!(target.read(0, TOTAL as u64).unwrap(), pattern);
    }
    let mut rx = tokio::time::timeout(CONNECT_LIMIT, peer.accept_stream())
        .await
        .unwrap()
        .unwrap();
    let mut n = 0u32;
    while let Some(m) = tokio::time::timeout(CONNECT_LIMIT * 3, rx.next())
        .await
        .expect("the stream stalled")
    {
        assert_eq!(&m.unwrap()[..], n.to_be_bytes());
        n += 1;
    }
    assert_eq!(n, 200);
    sender.await.unwrap();
    stop.store(true, Ordering::Relaxed);
    flood.join().unwrap();
    assert!(conn.close_reason().is_none() && peer.close_reason().is_none());
    // The replayed data packets were counted as what they are, not applied.
    let ps = peer.stats().unwrap();
    assert!(
        ps.duplicate_packets + ps.out_of_window_packets > 0,
        "replays reached the connection uncounted: {ps:?}"
    );
    println!(
        "flood: {} datagrams in {:?} while {ROUNDS} x {TOTAL} B were written; server stats {:?}",
        sent.load(Ordering::Relaxed),
        started.elapsed(),
        server.stats()
    );
}

/// Every CHUNK of `target` written from `src`, all posted at once; each must succeed.
async fn futures_join(
    conn: &Connection,
    src: &metaroce_tokio::MemoryRegion,
    target: &metaroce_tokio::MemoryRegion,
    total: usize,
    chunk: usize,
) {
    let remote = target.remote();
    let ops = (0..total / chunk).map(|i| {
        let r = (i * chunk) as u64..((i + 1) * chunk) as u64;
        conn.write(src, r.clone(), remote, r.start)
    });
    for r in metaroce_tokio::futures::future::join_all(ops).await {
        assert_eq!(r.unwrap().status, metaroce_tokio::WcStatus::Success);
    }
}

/// While a client waits for its Accept (the server's application has not decided yet), an
/// attacker who knows the client's QPN and address, but not its nonce, sprays it with
/// forged handshake answers from the server's IP: Rejects, Retries, Accepts and Confirms
/// with guessed nonces. None of them ends or hijacks the attempt: once the server accepts,
/// the connection comes up with the real server and carries traffic both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_handshake_answers_do_not_end_or_hijack_a_connect() {
    let server = bind_local().await;
    let client = bind_local().await;
    let connecting = client.connect(server.local_addr()).unwrap();
    let qpn = connecting.handle().expect("a connection attempt").0;
    let incoming = tokio::time::timeout(CONNECT_LIMIT, server.accept())
        .await
        .unwrap()
        .unwrap();
    let attacker = UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut x = 0x243F_6A88_85A3_08D3u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for k in 0..4000u32 {
        let kind = [
            ConnectKind::Reject,
            ConnectKind::Retry,
            ConnectKind::Accept,
            ConnectKind::Confirm,
        ][k as usize % 4];
        let mut m = ConnectEth::new(kind);
        m.src_qpn = (next() as u32) & wire::PSN_MASK;
        m.dst_qpn = qpn;
        m.paths = 4;
        m.pmtu = 1024;
        m.listen_port = server.local_addr().port();
        m.init_psn = (next() as u32) & wire::PSN_MASK;
        m.nonce = next();
        m.server_nonce = next();
        m.reason = 2;
        m.cookie = (u128::from(next()) << 64 | u128::from(next())).to_be_bytes();
        let hdrs = Headers::Connect(m);
        let mut buf = vec![0; wire::packet_len(&hdrs, 0)];
        wire::emit_packet(&Bth::new(Opcode::MR_CONNECT, qpn, 0), &hdrs, &[], &mut buf).unwrap();
        resend(&attacker, client.local_addr(), &buf);
    }
    // Let the client's driver take them all in before the real Accept is sent.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let peer = incoming.accept().unwrap();
    let conn = tokio::time::timeout(CONNECT_LIMIT, connecting)
        .await
        .expect("the handshake did not complete")
        .expect("a forged answer ended the attempt");
    assert_eq!(conn.remote_addr(), Some(server.local_addr()));
    still_works(&conn, &peer, b"to the real server").await;
    still_works(&peer, &conn, b"from the real server").await;
}

/// Junk at the shared main port of a sharded endpoint (its reuseport program reads the
/// BTH DestQP to pick a shard): empty, shorter than a BTH, and every DestQP byte pattern;
/// nothing is lost for the live connections, which keep working on both shards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn junk_at_a_sharded_main_port_changes_nothing() {
    let cfg = Config {
        shards: 2,
        ..Config::default()
    };
    let server = Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    let client = bind_local().await;
    let pairs = [
        connect(&server, &client).await,
        connect(&server, &client).await,
        connect(&server, &client).await,
    ];
    let attacker = UdpSocket::bind("127.0.0.1:0").unwrap();
    let to = server.local_addr();
    let mut junk = [0u8; 64];
    for len in 0..=16usize {
        for b in 0..=255u8 {
            junk.iter_mut().for_each(|x| *x = b);
            let _ = attacker.send_to(&junk[..len], to);
        }
    }
    for b in 0..=255u8 {
        junk[4..8].copy_from_slice(&[0, b, b.wrapping_mul(7), b ^ 0x5A]);
        let _ = attacker.send_to(&junk[..16], to);
        let _ = attacker.send_to(&junk[..64], to);
    }
    for (c, s) in &pairs {
        still_works(c, s, b"sharded").await;
        still_works(s, c, b"sharded back").await;
    }
    assert!(server.stats().malformed > 0);
}
