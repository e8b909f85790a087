//! The datagram backends over loopback: GSO/GRO, ECN, local IP, path source ports, input
//! checks. One suite, run against `UdpBackend` (module `udp`) and `UringBackend` (module
//! `uring`, which needs io_uring: Linux 6.0 or later, not forbidden by seccomp).

use std::future::poll_fn;
use std::io::{self, IoSliceMut};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use metaroce::{EcnCodepoint, Transmit};
use metaroce_tokio::backend::{
    DatagramBackend, RecvMeta, UdpBackend, UdpConfig, UringBackend, UringConfig,
};

const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

fn loopback() -> SocketAddr {
    SocketAddr::new(LOCALHOST, 0)
}

/// Sends one transmit and flushes it to the kernel, as the driver does after a batch.
async fn send(b: &impl DatagramBackend, t: &Transmit, contents: &[u8]) -> io::Result<()> {
    let r = poll_fn(|cx| b.poll_send(cx, t, contents)).await;
    b.flush();
    r
}

/// One received datagram with the metadata of the buffer it came in.
struct Got {
    meta: RecvMeta,
    /// Datagrams in the receive buffer this one came in (> 1 when GRO coalesced).
    in_buffer: usize,
    bytes: Vec<u8>,
}

/// Receives until `want` datagrams have arrived (or 5 s pass), splitting GRO buffers.
async fn recv_datagrams(b: &impl DatagramBackend, want: usize) -> Vec<Got> {
    let mut bufs = vec![vec![0u8; 65_536]; 4];
    let mut meta = [RecvMeta::default(); 4];
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while out.len() < want {
        let n = tokio::time::timeout_at(
            deadline,
            poll_fn(|cx| {
                let mut slices: Vec<IoSliceMut<'_>> =
                    bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
                b.poll_recv(cx, &mut slices, &mut meta)
            }),
        )
        .await;
        let Ok(n) = n else { break };
        let n = n.expect("poll_recv");
        for (m, buf) in meta[..n].iter().zip(&bufs) {
            let in_buffer = m.datagrams(buf).count();
            for d in m.datagrams(buf) {
                out.push(Got {
                    meta: *m,
                    in_buffer,
                    bytes: d.to_vec(),
                });
            }
        }
    }
    out
}

/// `count` segments of `size` bytes, segment `i` filled with a pattern depending on `i`.
fn segments(count: usize, size: usize) -> Vec<u8> {
    (0..count)
        .flat_map(|i| (0..size).map(move |j| (i * 31 + j) as u8))
        .collect()
}

fn udp_bind(addr: SocketAddr, paths: usize) -> io::Result<UdpBackend> {
    UdpBackend::bind(addr, paths)
}

fn udp_bind_with(addr: SocketAddr, paths: usize, cfg: &UdpConfig) -> io::Result<UdpBackend> {
    UdpBackend::bind_with(addr, paths, cfg)
}

/// The io_uring backend; a machine without io_uring fails the suite (with the reason)
/// rather than skipping it.
fn uring_bind(addr: SocketAddr, paths: usize) -> io::Result<UringBackend> {
    uring_bind_with(addr, paths, &UdpConfig::default())
}

fn uring_bind_with(addr: SocketAddr, paths: usize, cfg: &UdpConfig) -> io::Result<UringBackend> {
    let config = UringConfig {
        udp: cfg.clone(),
        ..UringConfig::default()
    };
    let b = UringBackend::bind_with(addr, paths, &config);
    if let Err(e) = &b {
        assert_ne!(e.kind(), io::ErrorKind::Unsupported, "{e}");
    }
    b
}

macro_rules! suite {
    ($name:ident, $bind:ident, $bind_with:ident) => {
        mod $name {
            use super::*;

            #[tokio::test]
            async fn gso_transmit_arrives_as_datagrams_from_the_path_port() {
                let a = $bind(loopback(), 3).unwrap();
                let b = $bind(loopback(), 1).unwrap();
                eprintln!(
                    "max_gso_segments = {}, max_gro_segments = {}, rcvbuf = {:?}, sndbuf = {:?}",
                    a.max_gso_segments(),
                    a.max_gro_segments(),
                    b.recv_buffer_bytes(),
                    a.send_buffer_bytes()
                );
                let ports = a.source_ports();
                assert_eq!(ports.len(), 3);
                assert!(!ports.contains(&a.local_addr().port()));
                let port = ports[1];

                let contents = segments(10, 1200);
                let t = Transmit {
                    destination: b.local_addr(),
                    src_port: port,
                    ecn: None,
                    size: contents.len(),
                    segment_size: Some(1200),
                };
                send(&a, &t, &contents).await.unwrap();

                let got = recv_datagrams(&b, 10).await;
                assert_eq!(got.len(), 10);
                let coalesced = got.iter().map(|g| g.in_buffer).max().unwrap();
                eprintln!("largest GRO buffer held {coalesced} datagrams");
                for (i, g) in got.iter().enumerate() {
                    assert_eq!(g.meta.from, SocketAddr::new(LOCALHOST, port));
                    assert_eq!(g.meta.local_ip, Some(LOCALHOST));
                    assert_eq!(g.meta.ecn, None);
                    assert_eq!(g.bytes, contents[i * 1200..(i + 1) * 1200], "datagram {i}");
                }
            }

            #[tokio::test]
            async fn oversized_gso_transmit_is_split_into_kernel_sized_sends() {
                // 100 × 1200 bytes exceeds both 64 segments and 65 507 bytes per sendmsg.
                let a = $bind(loopback(), 2).unwrap();
                let b = $bind(loopback(), 1).unwrap();
                let contents = segments(100, 1200);
                // The last segment is shorter, as the core may produce.
                let contents = &contents[..contents.len() - 200];
                let t = Transmit {
                    destination: b.local_addr(),
                    src_port: a.source_ports()[0],
                    ecn: Some(EcnCodepoint::Ect0),
                    size: contents.len(),
                    segment_size: Some(1200),
                };
                send(&a, &t, contents).await.unwrap();
                let got = recv_datagrams(&b, 100).await;
                assert_eq!(got.len(), 100);
                let joined: Vec<u8> = got.iter().flat_map(|g| g.bytes.clone()).collect();
                assert_eq!(joined, contents);
                assert_eq!(got[99].bytes.len(), 1000);
                assert!(got.iter().all(|g| g.meta.ecn == Some(EcnCodepoint::Ect0)));
            }

            #[tokio::test]
            async fn ecn_codepoints_survive_the_round_trip() {
                let a = $bind(loopback(), 1).unwrap();
                let b = $bind(loopback(), 1).unwrap();
                for ecn in [
                    Some(EcnCodepoint::Ect0),
                    Some(EcnCodepoint::Ect1),
                    Some(EcnCodepoint::Ce),
                    None,
                ] {
                    let t = Transmit {
                        destination: b.local_addr(),
                        src_port: a.source_ports()[0],
                        ecn,
                        size: 100,
                        segment_size: None,
                    };
                    send(&a, &t, &[7u8; 100]).await.unwrap();
                    let got = recv_datagrams(&b, 1).await;
                    assert_eq!(got.len(), 1);
                    assert_eq!(got[0].meta.ecn, ecn);
                    assert_eq!(got[0].bytes, [7u8; 100]);
                }
            }

            #[tokio::test]
            async fn every_path_port_sends() {
                let a = $bind(loopback(), 4).unwrap();
                let b = $bind(loopback(), 1).unwrap();
                for (i, &port) in a.source_ports().iter().enumerate() {
                    let t = Transmit {
                        destination: b.local_addr(),
                        src_port: port,
                        ecn: None,
                        size: 1,
                        segment_size: None,
                    };
                    send(&a, &t, &[i as u8]).await.unwrap();
                    let got = recv_datagrams(&b, 1).await;
                    assert_eq!(got[0].meta.from.port(), port);
                    assert_eq!(got[0].bytes, [i as u8]);
                }
            }

            #[tokio::test]
            async fn owned_sends_of_short_and_mixed_size_datagrams_arrive_in_order() {
                // Sizes 0, 1, 7, a run of equal ones ended by a shorter one, a longer one:
                // every datagram arrives whole, in order, whatever the backend joins or
                // copies; and the caller always gets a buffer back to reuse.
                let a = $bind(loopback(), 1).unwrap();
                let b = $bind(loopback(), 1).unwrap();
                let sizes = [1usize, 7, 300, 300, 300, 300, 120, 300, 1400, 0, 2];
                let port = a.source_ports()[0];
                let mut buf = Vec::new();
                for (i, &size) in sizes.iter().enumerate() {
                    buf.clear();
                    buf.extend((0..size).map(|j| (i * 37 + j) as u8));
                    let t = Transmit {
                        destination: b.local_addr(),
                        src_port: port,
                        ecn: None,
                        size,
                        segment_size: None,
                    };
                    poll_fn(|cx| a.poll_send_owned(cx, &t, &mut buf))
                        .await
                        .unwrap();
                }
                a.flush();
                let got = recv_datagrams(&b, sizes.len()).await;
                let lens: Vec<usize> = got.iter().map(|g| g.bytes.len()).collect();
                assert_eq!(lens, sizes);
                for (i, g) in got.iter().enumerate() {
                    let want: Vec<u8> = (0..sizes[i]).map(|j| (i * 37 + j) as u8).collect();
                    assert_eq!(g.bytes, want, "datagram {i}");
                    assert_eq!(g.meta.from.port(), port);
                }
                // A buffer shorter than the transmit says is the caller's error.
                let t = Transmit {
                    destination: b.local_addr(),
                    src_port: port,
                    ecn: None,
                    size: 10,
                    segment_size: None,
                };
                let mut short = vec![0u8; 9];
                let err = poll_fn(|cx| a.poll_send_owned(cx, &t, &mut short))
                    .await
                    .unwrap_err();
                assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
            }

            #[tokio::test]
            async fn bad_transmits_are_invalid_input() {
                let a = $bind(loopback(), 2).unwrap();
                let b = $bind(loopback(), 1).unwrap();
                let good = Transmit {
                    destination: b.local_addr(),
                    src_port: a.source_ports()[0],
                    ecn: None,
                    size: 10,
                    segment_size: None,
                };
                // The main socket's port is not a path port.
                let cases = [
                    Transmit {
                        src_port: a.local_addr().port(),
                        ..good
                    },
                    Transmit { size: 11, ..good },
                    Transmit {
                        segment_size: Some(0),
                        ..good
                    },
                ];
                for t in cases {
                    let err = send(&a, &t, &[0u8; 10]).await.unwrap_err();
                    assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{t:?}: {err}");
                }
                let err = send(&a, &cases[0], &[0u8; 10]).await.unwrap_err();
                assert!(err.to_string().contains("src_port"), "{err}");
                // The backend is still usable.
                send(&a, &good, &[1u8; 10]).await.unwrap();
                assert_eq!(recv_datagrams(&b, 1).await[0].bytes, [1u8; 10]);
            }

            #[tokio::test]
            async fn empty_receive_slices_return_zero() {
                let b = $bind(loopback(), 1).unwrap();
                let n = poll_fn(|cx| b.poll_recv(cx, &mut [], &mut []))
                    .await
                    .unwrap();
                assert_eq!(n, 0);
            }

            #[tokio::test]
            async fn datagrams_sent_to_a_path_port_are_ignored() {
                let a = $bind(loopback(), 1).unwrap();
                let b = $bind(loopback(), 2).unwrap();
                let to_path = SocketAddr::new(LOCALHOST, b.source_ports()[0]);
                for (dest, byte) in [(to_path, 1u8), (b.local_addr(), 2u8)] {
                    let t = Transmit {
                        destination: dest,
                        src_port: a.source_ports()[0],
                        ecn: None,
                        size: 1,
                        segment_size: None,
                    };
                    send(&a, &t, &[byte]).await.unwrap();
                }
                let got = recv_datagrams(&b, 1).await;
                assert_eq!(got.len(), 1);
                assert_eq!(got[0].bytes, [2]);
            }

            #[tokio::test]
            async fn config_sets_buffer_sizes() {
                let cfg = UdpConfig {
                    recv_buffer_bytes: 64 * 1024,
                    send_buffer_bytes: 64 * 1024,
                };
                let b = $bind_with(loopback(), 1, &cfg).unwrap();
                // Linux reports twice the requested value (bookkeeping overhead), capped by the sysctls.
                let rcv = b.recv_buffer_bytes().unwrap();
                let snd = b.send_buffer_bytes().unwrap();
                assert!((64 * 1024..=2 * 64 * 1024 + 4096).contains(&rcv), "{rcv}");
                assert!((64 * 1024..=2 * 64 * 1024 + 4096).contains(&snd), "{snd}");
                // What the endpoint divides among its senders (the window grant), through
                // the trait and through a boxed backend alike.
                assert_eq!(DatagramBackend::socket_recv_buffer(&b), Some(rcv as u64));
                let boxed: Box<dyn DatagramBackend> = Box::new(b);
                assert_eq!(boxed.socket_recv_buffer(), Some(rcv as u64));
            }
        }
    };
}

suite!(udp, udp_bind, udp_bind_with);
suite!(uring, uring_bind, uring_bind_with);

#[test]
fn recv_meta_splits_buffers_without_panicking() {
    let buf = [1u8, 2, 3, 4, 5];
    let m = |len, stride| RecvMeta {
        len,
        stride,
        ..RecvMeta::default()
    };
    let parts: Vec<&[u8]> = m(5, 2).datagrams(&buf).collect();
    assert_eq!(parts, [&[1u8, 2][..], &[3, 4], &[5]]);
    assert_eq!(m(5, 0).datagrams(&buf).count(), 1);
    assert_eq!(m(99, 5).datagrams(&buf).count(), 1);
    let empty: Vec<&[u8]> = m(0, 0).datagrams(&buf).collect();
    assert_eq!(empty, [&[][..]]);
}

// ---------------------------------------------------------------------------------------
// Review of gather send (poll_send_pieces).

/// Sends one transmit in pieces and flushes it, as the driver's `send_lent` does.
async fn send_pieces(b: &UdpBackend, t: &Transmit, pieces: &[&[u8]]) -> io::Result<()> {
    let r = poll_fn(|cx| b.poll_send_pieces(cx, t, pieces)).await;
    b.flush();
    r
}

/// A dual-stack IPv6 endpoint reaches IPv4 peers at IPv4-mapped addresses (the endpoint's
/// documented way to talk to IPv4 from `[::]`). The joined path (quinn-udp) marks such
/// datagrams with `IP_TOS`; the gather path sends `IPV6_TCLASS`, which Linux ignores for a
/// v4-mapped destination (udpv6_sendmsg hands the datagram to udp_sendmsg, whose
/// ip_cmsg_send skips every SOL_IPV6 message but IPV6_PKTINFO): data leaves Not-ECT.
#[tokio::test]
async fn gather_send_to_an_ipv4_mapped_peer_keeps_its_ecn_mark() {
    let a = udp_bind("[::]:0".parse().unwrap(), 1).unwrap();
    let b = udp_bind(loopback(), 1).unwrap();
    let mapped = SocketAddr::new(
        IpAddr::V6(Ipv4Addr::LOCALHOST.to_ipv6_mapped()),
        b.local_addr().port(),
    );
    let head = [1u8; 40];
    let payload = [2u8; 100];
    let tail = [3u8; 8];
    let whole: Vec<u8> = [&head[..], &payload[..], &tail[..]].concat();
    let t = Transmit {
        destination: mapped,
        src_port: a.source_ports()[0],
        ecn: Some(EcnCodepoint::Ect0),
        size: whole.len(),
        segment_size: None,
    };
    // The copy path, for reference.
    send(&a, &t, &whole).await.unwrap();
    let got = recv_datagrams(&b, 1).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].bytes, whole);
    assert_eq!(got[0].meta.ecn, Some(EcnCodepoint::Ect0), "joined path");
    // The gather path.
    assert!(a.sends_gathered());
    send_pieces(&a, &t, &[&head, &payload, &tail])
        .await
        .unwrap();
    let got = recv_datagrams(&b, 1).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].bytes, whole);
    assert_eq!(got[0].meta.ecn, Some(EcnCodepoint::Ect0), "gather path");
}

/// The same over plain IPv4 and IPv6, with GSO (UDP_SEGMENT and the ECN cmsg together),
/// datagrams that span pieces and a short last datagram.
#[tokio::test]
async fn gather_send_gso_batches_match_the_joined_bytes_and_marks() {
    for (from, to) in [
        (loopback(), loopback()),
        ("[::1]:0".parse().unwrap(), "[::1]:0".parse().unwrap()),
    ] {
        let a = udp_bind(from, 1).unwrap();
        let b = udp_bind(to, 1).unwrap();
        let whole = segments(100, 1000);
        let whole = &whole[..whole.len() - 333];
        // Cut at odd places, so datagrams span pieces.
        let mut pieces: Vec<&[u8]> = Vec::new();
        let mut at = 0;
        let mut k = 1;
        while at < whole.len() {
            let n = (k * 379 % 1500 + 1).min(whole.len() - at);
            pieces.push(&whole[at..at + n]);
            at += n;
            k += 1;
        }
        for ecn in [Some(EcnCodepoint::Ect0), Some(EcnCodepoint::Ce), None] {
            let t = Transmit {
                destination: b.local_addr(),
                src_port: a.source_ports()[0],
                ecn,
                size: whole.len(),
                segment_size: Some(1000),
            };
            send_pieces(&a, &t, &pieces).await.unwrap();
            let got = recv_datagrams(&b, 100).await;
            assert_eq!(got.len(), 100, "{from}");
            let joined: Vec<u8> = got.iter().flat_map(|g| g.bytes.clone()).collect();
            assert_eq!(joined, whole, "{from}");
            assert!(got.iter().all(|g| g.meta.ecn == ecn), "{from} {ecn:?}");
        }
    }
}

/// `poll_send_pieces` falls back to the joined path (`poll_send`) when a gather `sendmsg`
/// fails, and that path saves its resume point under `ResumeKey::new(t', rest)`. Before
/// the fix (found by review), the driver's next call after `Pending` looked it up under
/// `ResumeKey::of_pieces(t, pieces)`, took it (a mismatch) and started the transmit over
/// from byte 0: every datagram sent before `Pending` went out again, and a transmit whose
/// gather sends kept failing never finished (441 `Pending`s, 237 duplicates, 236 of 300
/// datagrams never sent).
///
/// The gather send is made to fail here with more pieces per datagram than its I/O vector
/// holds (the same branch as EIO / EINVAL / ENOBUFS from the kernel). `Pending` part-way
/// needs a send queue that fills, which loopback never does, so this test runs in a private
/// network namespace with a rate-limited loopback (`.ci/run` runs both this way):
///
/// ```text
/// unshare -n sh -c 'ip link set lo up && tc qdisc add dev lo root tbf rate 20mbit \
///   burst 16kb limit 4mb && exec <backend_udp test binary> --ignored --exact \
///   gather_fallback_resumes_instead_of_resending'
/// ```
#[tokio::test]
#[ignore = "needs a rate-limited loopback (see the doc comment)"]
async fn gather_fallback_resumes_instead_of_resending() {
    // 3-byte pieces: 334 per datagram, more than one sendmsg's I/O vector (256).
    resume_case(3).await;
}

/// Control for the test above, same namespace: pieces that fit the I/O vector (the
/// gather path's own resume, `ResumeKey::of_pieces`).
#[tokio::test]
#[ignore = "needs a rate-limited loopback (see gather_fallback_resumes_instead_of_resending)"]
async fn gather_send_resumes_after_pending() {
    resume_case(700).await;
}

async fn resume_case(piece: usize) {
    let cfg = UdpConfig {
        recv_buffer_bytes: 8 << 20,
        send_buffer_bytes: 8 * 1024,
    };
    let a = udp_bind_with(loopback(), 1, &cfg).unwrap();
    let b = udp_bind_with(loopback(), 1, &cfg).unwrap();
    let (count, seg) = (300usize, 1000usize);
    let mut whole = segments(count, seg);
    for i in 0..count {
        whole[i * seg..i * seg + 2].copy_from_slice(&(i as u16).to_be_bytes());
    }
    let pieces: Vec<&[u8]> = whole.chunks(piece).collect();
    let t = Transmit {
        destination: b.local_addr(),
        src_port: a.source_ports()[0],
        ecn: None,
        size: whole.len(),
        segment_size: Some(seg),
    };
    let mut pendings = 0u32;
    let send = async {
        tokio::time::timeout(
            Duration::from_secs(5),
            poll_fn(|cx| {
                let r = a.poll_send_pieces(cx, &t, &pieces);
                if r.is_pending() {
                    pendings += 1;
                }
                r
            }),
        )
        .await
    };
    let (sent, got) = tokio::join!(send, recv_datagrams(&b, count + 1));
    let mut seen = vec![0u32; count];
    for g in &got {
        let i = u16::from_be_bytes([g.bytes[0], g.bytes[1]]) as usize;
        assert_eq!(g.bytes, whole[i * seg..(i + 1) * seg]);
        seen[i] += 1;
    }
    let dups: u32 = seen.iter().map(|&s| s.saturating_sub(1)).sum();
    let missing = seen.iter().filter(|&&s| s == 0).count();
    eprintln!(
        "sent: {sent:?}; Pending {pendings} times; {} datagrams received, {dups} duplicates, \
         {missing} missing",
        got.len()
    );
    assert!(
        pendings > 0,
        "the send never waited: the scenario was not exercised"
    );
    assert!(
        matches!(sent, Ok(Ok(()))),
        "the transmit never finished: {sent:?}"
    );
    assert_eq!(dups, 0, "datagrams sent twice");
    assert_eq!(missing, 0, "datagrams missing");
}

/// Not from these commits, same cause: `UringBackend`'s `send_control` also picks
/// `IPV6_TCLASS` for a v4-mapped destination (`dest.is_ipv4()` only).
#[tokio::test]
async fn uring_send_to_an_ipv4_mapped_peer_keeps_its_ecn_mark() {
    let a = uring_bind("[::]:0".parse().unwrap(), 1).unwrap();
    let b = udp_bind(loopback(), 1).unwrap();
    let mapped = SocketAddr::new(
        IpAddr::V6(Ipv4Addr::LOCALHOST.to_ipv6_mapped()),
        b.local_addr().port(),
    );
    let t = Transmit {
        destination: mapped,
        src_port: a.source_ports()[0],
        ecn: Some(EcnCodepoint::Ect0),
        size: 100,
        segment_size: None,
    };
    send(&a, &t, &[5u8; 100]).await.unwrap();
    let got = recv_datagrams(&b, 1).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].meta.ecn, Some(EcnCodepoint::Ect0));
}
