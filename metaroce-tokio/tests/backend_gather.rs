//! `DatagramBackend::poll_send_pieces` (gather send, issue #13 P1) on both backends: a
//! transmit given as pieces that cut across datagram boundaries arrives as the datagrams
//! its concatenation holds, in order, with its ECN codepoint, also when it is larger than
//! one `sendmsg`. Needs io_uring for the `UringBackend` half.

use std::future::poll_fn;
use std::io::IoSliceMut;
use std::net::SocketAddr;
use std::time::Duration;

use metaroce::{EcnCodepoint, Transmit};
use metaroce_tokio::backend::{DatagramBackend, RecvMeta, UdpBackend, UringBackend};

/// Receives until `want` datagrams (or 5 s): (bytes, ECN) in arrival order.
async fn recv_all(b: &impl DatagramBackend, want: usize) -> Vec<(Vec<u8>, Option<EcnCodepoint>)> {
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
            out.extend(m.datagrams(buf).map(|d| (d.to_vec(), m.ecn)));
        }
    }
    out
}

/// `count` datagrams of `seg` bytes (the last `last`), cut into pieces of 7, 300 and
/// `seg - 1` bytes in turn (as headers, payloads and tails fall).
fn pieces_of(count: usize, seg: usize, last: usize) -> (Vec<u8>, Vec<std::ops::Range<usize>>) {
    let total = (count - 1) * seg + last;
    let bytes: Vec<u8> = (0..total).map(|i| (i * 13 + i / seg) as u8).collect();
    let mut cuts = Vec::new();
    let (mut at, mut k) = (0, 0);
    while at < total {
        let len = [7, 300, seg - 1][k % 3].min(total - at);
        cuts.push(at..at + len);
        at += len;
        k += 1;
    }
    (bytes, cuts)
}

async fn check(tx: &impl DatagramBackend, rx: &impl DatagramBackend, what: &str) {
    assert!(tx.sends_gathered(), "{what}: gather send is off");
    let to = rx.local_addr();
    let port = tx.source_ports()[0];
    // One GSO batch, then one larger than a sendmsg (several batches), then one datagram.
    for (count, seg, last) in [(20, 1000, 611), (150, 1400, 1400), (1, 900, 900)] {
        let (bytes, cuts) = pieces_of(count, seg, last);
        let pieces: Vec<&[u8]> = cuts.iter().map(|r| &bytes[r.clone()]).collect();
        let t = Transmit {
            destination: to,
            src_port: port,
            ecn: Some(EcnCodepoint::Ect0),
            size: bytes.len(),
            segment_size: (count > 1).then_some(seg),
        };
        poll_fn(|cx| tx.poll_send_pieces(cx, &t, &pieces))
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        tx.flush();
        let got = recv_all(rx, count).await;
        assert_eq!(got.len(), count, "{what}: {count} x {seg}");
        for (i, (d, ecn)) in got.iter().enumerate() {
            let want = &bytes[i * seg..((i + 1) * seg).min(bytes.len())];
            assert!(
                d[..] == want[..],
                "{what}: datagram {i} of {count} x {seg} differs"
            );
            assert_eq!(*ecn, Some(EcnCodepoint::Ect0), "{what}: datagram {i}'s ECN");
        }
    }
    // Pieces that do not add up to the transmit's size are refused.
    let t = Transmit {
        destination: to,
        src_port: port,
        ecn: None,
        size: 100,
        segment_size: None,
    };
    let r = poll_fn(|cx| tx.poll_send_pieces(cx, &t, &[&[1u8; 10], &[2u8; 10]])).await;
    assert!(r.is_err(), "{what}: 20 bytes sent as a 100-byte transmit");
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

#[tokio::test]
async fn udp_backend_sends_pieces_as_the_datagrams_they_join_into() {
    let tx = UdpBackend::bind(loopback(), 1).unwrap();
    let rx = UdpBackend::bind(loopback(), 1).unwrap();
    check(&tx, &rx, "udp").await;
}

#[tokio::test]
async fn uring_backend_sends_pieces_as_the_datagrams_they_join_into() {
    let tx = UringBackend::bind(loopback(), 1).unwrap_or_else(|e| panic!("io_uring: {e}"));
    let rx = UdpBackend::bind(loopback(), 1).unwrap();
    check(&tx, &rx, "uring").await;
}
