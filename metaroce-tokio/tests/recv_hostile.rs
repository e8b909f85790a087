//! Hostile input on the receive paths of both datagram backends: zero-length datagrams,
//! maximum-size datagrams, GRO batches with a short last segment, floods from many
//! sources. (Linux; the io_uring cases need io_uring.)
#![cfg(target_os = "linux")]

use std::future::poll_fn;
use std::io::IoSliceMut;
use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

use metaroce_tokio::backend::{DatagramBackend, RecvMeta, UdpBackend, UringBackend, UringConfig};

/// Receives with the driver's shape (8 buffers of 64 KiB, in place where the backend lends)
/// until `want` datagrams or `secs` pass; returns the datagrams and their metadata.
async fn recv_n(b: &dyn DatagramBackend, want: usize, secs: u64) -> Vec<(RecvMeta, Vec<u8>)> {
    let mut bufs = vec![vec![0u8; 1 << 16]; 8];
    let mut metas = [RecvMeta::EMPTY; 8];
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while out.len() < want {
        let r = tokio::time::timeout_at(
            deadline,
            poll_fn(|cx| {
                let mut got = Vec::new();
                let lent = b.poll_recv_in_place(cx, 8, &mut |m, bytes| {
                    for d in m.datagrams(bytes) {
                        got.push((*m, d.to_vec()));
                    }
                });
                if let Some(p) = lent {
                    return p.map(|r| r.map(|_| got));
                }
                let mut iovs: Vec<IoSliceMut<'_>> =
                    bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
                b.poll_recv(cx, &mut iovs, &mut metas).map(|r| {
                    r.map(|n| {
                        let mut got = Vec::new();
                        for (m, buf) in metas[..n].iter().zip(&bufs) {
                            for d in m.datagrams(buf) {
                                got.push((*m, d.to_vec()));
                            }
                        }
                        got
                    })
                })
            }),
        )
        .await;
        let Ok(r) = r else { break };
        out.extend(r.expect("receive"));
    }
    out
}

fn backends(addr: SocketAddr) -> Vec<(&'static str, Box<dyn DatagramBackend>)> {
    vec![
        ("udp", Box::new(UdpBackend::bind(addr, 1).unwrap())),
        (
            "uring",
            Box::new(UringBackend::bind_with(addr, 1, &UringConfig::default()).unwrap()),
        ),
    ]
}

#[tokio::test]
async fn zero_length_datagrams_do_not_stop_receiving() {
    for (name, b) in backends("127.0.0.1:0".parse().unwrap()) {
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = b.local_addr();
        // Arm first.
        let waker = futures::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        let _ = b.poll_recv_in_place(&mut cx, 1, &mut |_, _| {});
        for i in 0..100u32 {
            tx.send_to(&[], to).unwrap();
            tx.send_to(&i.to_be_bytes(), to).unwrap();
        }
        let got = recv_n(&*b, 200, 5).await;
        let empties = got.iter().filter(|(_, d)| d.is_empty()).count();
        let full: Vec<u32> = got
            .iter()
            .filter(|(_, d)| d.len() == 4)
            .map(|(_, d)| u32::from_be_bytes(d[..].try_into().unwrap()))
            .collect();
        eprintln!("{name}: {} datagrams, {empties} empty, {b:?}", got.len());
        assert_eq!(full, (0..100).collect::<Vec<_>>(), "{name}");
        assert_eq!(empties, 100, "{name}");
    }
}

#[tokio::test]
async fn maximum_size_datagrams_arrive_whole() {
    for (ip, max) in [("127.0.0.1", 65_507usize), ("[::1]", 65_527)] {
        let addr: SocketAddr = format!("{ip}:0").parse().unwrap();
        for (name, b) in backends(addr) {
            let tx = UdpSocket::bind(format!("{ip}:0")).unwrap();
            let to = b.local_addr();
            let payload: Vec<u8> = (0..max).map(|i| (i % 253) as u8).collect();
            let waker = futures::task::noop_waker();
            let mut cx = std::task::Context::from_waker(&waker);
            let _ = b.poll_recv_in_place(&mut cx, 1, &mut |_, _| {});
            tx.send_to(&payload, to).unwrap();
            tx.send_to(b"after", to).unwrap();
            let got = recv_n(&*b, 2, 5).await;
            let lens: Vec<usize> = got.iter().map(|(_, d)| d.len()).collect();
            eprintln!("{name} {ip}: {lens:?}");
            assert_eq!(lens, [max, 5], "{name} {ip}");
            assert_eq!(got[0].1, payload);
        }
    }
}

/// A GSO send with a short last segment from a raw socket arrives as one GRO buffer; it is
/// split at the stride, the last one short.
#[tokio::test]
async fn gso_batches_with_a_short_tail_split_at_the_stride() {
    for (name, b) in backends("127.0.0.1:0".parse().unwrap()) {
        let tx = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None).unwrap();
        tx.bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
            .unwrap();
        let seg: u16 = 1000;
        let data: Vec<u8> = (0..10_500u32).map(|i| (i % 251) as u8).collect();
        let waker = futures::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        let _ = b.poll_recv_in_place(&mut cx, 1, &mut |_, _| {});
        let ctl = {
            // One UDP_SEGMENT control message (cmsghdr, u16 segment size).
            let mut c = vec![0u8; 24];
            c[..8].copy_from_slice(&18usize.to_ne_bytes());
            c[8..12].copy_from_slice(&libc::SOL_UDP.to_ne_bytes());
            c[12..16].copy_from_slice(&libc::UDP_SEGMENT.to_ne_bytes());
            c[16..18].copy_from_slice(&seg.to_ne_bytes());
            c
        };
        let addr = socket2::SockAddr::from(b.local_addr());
        let iov = [std::io::IoSlice::new(&data)];
        let msg = socket2::MsgHdr::new()
            .with_addr(&addr)
            .with_buffers(&iov)
            .with_control(&ctl);
        tx.sendmsg(&msg, 0).unwrap();
        let got = recv_n(&*b, 11, 5).await;
        let lens: Vec<usize> = got.iter().map(|(_, d)| d.len()).collect();
        let strides: Vec<usize> = got.iter().map(|(m, _)| m.stride).collect();
        eprintln!("{name}: lens {lens:?} strides {strides:?}");
        let mut want = vec![1000; 10];
        want.push(500);
        assert_eq!(lens, want, "{name}");
        let joined: Vec<u8> = got.iter().flat_map(|(_, d)| d.clone()).collect();
        assert_eq!(joined, data);
    }
}

/// The dual-stack case of `dual_stack.rs` with io_uring on both sides, each side on the
/// IPv6 wildcard in turn: the io_uring receive reports IPv4 peers as `::ffff:a.b.c.d`, its
/// local IP from `IPV6_PKTINFO` and ECN from `IP_TOS` (not `IPV6_TCLASS`).
#[tokio::test]
async fn io_uring_endpoints_on_the_ipv6_wildcard_talk_to_ipv4_peers() {
    use metaroce::Access;
    use metaroce_tokio::{Config, Endpoint};
    for wildcard_server in [false, true] {
        let cfg = Config::default();
        let ports = cfg.transport.paths as usize + cfg.spare_ports;
        let mk = |addr: &str| {
            let b = UringBackend::bind_with(addr.parse().unwrap(), ports, &UringConfig::default())
                .unwrap();
            Endpoint::with_backend(b, Config::default()).unwrap()
        };
        let (client, server) = if wildcard_server {
            (mk("127.0.0.1:0"), mk("[::]:0"))
        } else {
            (mk("[::]:0"), mk("127.0.0.1:0"))
        };
        let mut to = server.local_addr();
        to.set_ip("127.0.0.1".parse().unwrap());
        let connecting = client.connect(to).unwrap();
        let incoming = tokio::time::timeout(Duration::from_secs(5), server.accept())
            .await
            .expect("no connection request reached the server")
            .expect("the server endpoint closed");
        let s = incoming.accept().unwrap();
        let c = tokio::time::timeout(Duration::from_secs(5), connecting)
            .await
            .expect("the handshake did not complete")
            .unwrap();
        let dst = server.alloc(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        let src = client.register(vec![7u8; 4096], Access::LOCAL_WRITE);
        c.write(&src, 0..4096, dst.remote(), 0).await.unwrap();
        assert!(dst.read(0, 4096).unwrap().iter().all(|&b| b == 7));
        let back = client.alloc(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        s.write(&dst, 0..4096, back.remote(), 0).await.unwrap();
        assert!(back.read(0, 4096).unwrap().iter().all(|&b| b == 7));
    }
}

/// One provided buffer, a flood from 64 source ports mixing empty datagrams in, received
/// with the driver's shape: ENOBUFS and the re-arms after each empty datagram never stop
/// the receive; every datagram of a later, paced exchange arrives.
#[tokio::test]
async fn one_buffer_flood_from_many_sources_with_empty_datagrams_stays_live() {
    for bufs in [1u16, 2, 64] {
        let b = UringBackend::bind_with(
            "127.0.0.1:0".parse().unwrap(),
            1,
            &UringConfig {
                recv_buffers: bufs,
                ..UringConfig::default()
            },
        )
        .unwrap();
        let to = b.local_addr();
        let waker = futures::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        let _ = b.poll_recv_in_place(&mut cx, 1, &mut |_, _| {});
        let senders: Vec<UdpSocket> = (0..64)
            .map(|_| UdpSocket::bind("127.0.0.1:0").unwrap())
            .collect();
        let mut sent = 0;
        for round in 0..20u32 {
            for (i, s) in senders.iter().enumerate() {
                if (i as u32 + round) % 3 == 0 {
                    s.send_to(&[], to).unwrap();
                } else {
                    s.send_to(&[i as u8; 100], to).unwrap();
                }
                sent += 1;
            }
        }
        let flood = recv_n(&b, sent, 2).await;
        let st = b.stats();
        eprintln!("{bufs} buffers: {} of {sent} received; {st:?}", flood.len());
        assert_eq!(st.recv_errors, 0);
        for i in 0..100u32 {
            senders[i as usize % 64]
                .send_to(&i.to_be_bytes(), to)
                .unwrap();
            let got = recv_n(&b, 1, 5).await;
            assert_eq!(got.len(), 1, "{bufs} buffers: datagram {i} after the flood");
            assert_eq!(got[0].1, i.to_be_bytes());
        }
    }
}

/// A sharded server's reuseport program steers each received buffer by the DestQP of its
/// first datagram, so a GSO buffer (a local sender's `UDP_SEGMENT` send, delivered whole
/// to a `UDP_GRO` socket) or a GRO buffer (a NIC's, of one 5-tuple: one peer path port,
/// whatever connections it carries) lands whole on one shard. One GSO send of 16
/// datagrams, alternating between QPNs of the two residue classes: each shard must see its
/// own 8 (here: forgeries for no connection, counted as `unknown_connection` by the shard
/// that owns the QPN). Before the driver handed other shards' datagrams over, shard 0 took
/// all 16 and a connection of shard 1 lost whatever shared a buffer with shard 0's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gso_buffer_mixing_shards_is_steered_per_datagram() {
    use metaroce::wire::{self, icrc, AckEth, Bth, Headers, Opcode};
    use metaroce_tokio::{Config, Endpoint};
    let server = Endpoint::bind(
        "127.0.0.1:0".parse().unwrap(),
        Config {
            shards: 2,
            seed: Some(7),
            ..Config::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(server.shards(), 2);
    let to = server.local_addr();
    let tx = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None).unwrap();
    tx.bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
        .unwrap();
    let from = tx.local_addr().unwrap().as_socket().unwrap();
    let ack = |q: u32| {
        let h = Headers::Ack(AckEth::default());
        let mut p = vec![0u8; wire::packet_len(&h, 0)];
        wire::emit_packet(&Bth::new(Opcode::MR_ACK, q, 5), &h, &[], &mut p).unwrap();
        let ip = icrc::IpHeader::synthesized(from.ip(), to.ip()).unwrap();
        icrc::stamp(&ip, from.port(), to.port(), &mut p).unwrap();
        p
    };
    // QPNs of no connection (there is none), one per residue class.
    let seg = ack(0x1000).len();
    let mut batch = Vec::new();
    for _ in 0..8 {
        batch.extend(ack(0x1000));
        batch.extend(ack(0x1001));
    }
    let mut ctl = vec![0u8; 24];
    ctl[..8].copy_from_slice(&18usize.to_ne_bytes());
    ctl[8..12].copy_from_slice(&libc::SOL_UDP.to_ne_bytes());
    ctl[12..16].copy_from_slice(&libc::UDP_SEGMENT.to_ne_bytes());
    ctl[16..18].copy_from_slice(&(seg as u16).to_ne_bytes());
    let before: Vec<u64> = server
        .shard_stats()
        .iter()
        .map(|s| s.unknown_connection)
        .collect();
    let addr = socket2::SockAddr::from(to);
    let iov = [std::io::IoSlice::new(&batch)];
    let msg = socket2::MsgHdr::new()
        .with_addr(&addr)
        .with_buffers(&iov)
        .with_control(&ctl);
    tx.sendmsg(&msg, 0).unwrap();
    let mut got = vec![0u64; 2];
    for _ in 0..200 {
        got = server
            .shard_stats()
            .iter()
            .zip(&before)
            .map(|(a, b)| a.unknown_connection - b)
            .collect();
        if got.iter().sum::<u64>() >= 16 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!("unknown_connection per shard after one 16-datagram GSO send: {got:?}");
    assert_eq!(got, [8, 8], "datagrams of one GSO buffer went to one shard");
}
