//! The async API end to end over UDP on 127.0.0.1.

mod common;

use bytes::Bytes;
use common::pair;
use futures::{SinkExt, StreamExt};
use metaroce::{Access, WcStatus};
use metaroce_tokio::backend::{Impaired, Impairment, UdpBackend};
use metaroce_tokio::{Config, Endpoint, Error};
use std::time::Duration;

#[tokio::test]
async fn streams_exchange_messages_in_order() {
    let (_se, _ce, c, s) = pair(Config::default()).await;
    let mut a = c.open_stream().unwrap();
    let mut b = c.open_stream().unwrap();
    assert_ne!(a.id(), b.id());
    for i in 0..100u32 {
        a.feed(Bytes::from(vec![i as u8; (i as usize * 997) % 20000]))
            .await
            .unwrap();
        b.feed(Bytes::from(format!("b{i}"))).await.unwrap();
    }
    a.flush().await.unwrap();
    b.flush().await.unwrap();
    let mut got = metaroce_tokio::metaroce::fasthash::HashMap::default();
    for _ in 0..2 {
        let st = s.accept_stream().await.unwrap();
        got.insert(st.id(), st);
    }
    let ra = got.get_mut(&a.id()).unwrap();
    for i in 0..100u32 {
        let m = ra.next().await.unwrap().unwrap();
        assert_eq!(m.len(), (i as usize * 997) % 20000);
        assert!(m.iter().all(|&x| x == i as u8));
    }
    let rb = got.get_mut(&b.id()).unwrap();
    for i in 0..100u32 {
        assert_eq!(
            rb.next().await.unwrap().unwrap(),
            Bytes::from(format!("b{i}"))
        );
    }
    // Replies on a split stream.
    let (mut tx, _rx) = got.remove(&b.id()).unwrap().split();
    tx.send(Bytes::from_static(b"reply")).await.unwrap();
    assert_eq!(&b.next().await.unwrap().unwrap()[..], b"reply");
}

#[tokio::test]
async fn write_and_write_with_imm_land_in_peer_memory() {
    let (_se, _ce, c, s) = pair(Config::default()).await;
    let n = 1 << 20;
    let src: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
    let local = c.endpoint().register(src.clone(), Access::LOCAL_WRITE);
    let target = s
        .endpoint()
        .alloc(n, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let remote = metaroce_tokio::RemoteRegion::from_bytes(&target.remote().to_bytes()).unwrap();
    let wc = c.write(&local, 0..(n as u64 / 2), remote, 0).await.unwrap();
    assert_eq!(wc.byte_len as usize, n / 2);
    c.write_with_imm(
        &local,
        (n as u64 / 2)..n as u64,
        remote,
        n as u64 / 2,
        0xabcd,
    )
    .await
    .unwrap();
    let (imm, len) = tokio::time::timeout(Duration::from_secs(10), s.recv_imm())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((imm, len as usize), (0xabcd, n / 2));
    assert_eq!(target.read(0, n as u64).unwrap(), src);
}

#[tokio::test]
async fn bad_rkey_is_a_remote_access_error() {
    let (_se, _ce, c, s) = pair(Config::default()).await;
    let local = c.endpoint().alloc(4096, Access::LOCAL_WRITE);
    let target = s.endpoint().alloc(4096, Access::LOCAL_WRITE);
    let err = c
        .write(&local, 0..4096, target.remote(), 0)
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(WcStatus::RemoteAccessError), "{err}");
    let mut remote = target.remote();
    remote.rkey ^= 0xff00;
    let err = c.write(&local, 0..16, remote, 0).await.unwrap_err();
    assert_eq!(err.status(), Some(WcStatus::RemoteAccessError));
}

#[tokio::test]
async fn works_through_an_impaired_backend() {
    let imp = Impairment {
        loss: 0.05,
        duplicate: 0.02,
        reorder: 0.05,
        reorder_delay: Duration::from_micros(200),
        seed: 5,
        ..Default::default()
    };
    let server = Endpoint::bind("127.0.0.1:0".parse().unwrap(), Config::default())
        .await
        .unwrap();
    let backend = Impaired::new(
        UdpBackend::bind("127.0.0.1:0".parse().unwrap(), 8).unwrap(),
        imp,
    )
    .unwrap();
    let client = Endpoint::with_backend(backend, Config::default()).unwrap();
    let s2 = server.clone();
    let accept = tokio::spawn(async move { s2.accept().await.and_then(|i| i.accept().ok()) });
    let c = client.connect(server.local_addr()).unwrap().await.unwrap();
    let s = accept.await.unwrap().unwrap();
    let n = 4 << 20;
    let src: Vec<u8> = (0..n).map(|i| (i % 253) as u8).collect();
    let local = client.register(src.clone(), Access::LOCAL_WRITE);
    let target = server.alloc(n, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    c.write(&local, 0..n as u64, target.remote(), 0)
        .await
        .unwrap();
    assert_eq!(target.read(0, n as u64).unwrap(), src);
    let stats = c.stats().unwrap();
    assert!(
        stats.paths.iter().map(|p| p.stats.retransmits).sum::<u64>() > 0,
        "loss should cause retransmissions"
    );
    drop(s);
}

#[tokio::test]
async fn connect_to_nobody_times_out() {
    let mut cfg = Config::default();
    cfg.transport.handshake_interval = Duration::from_millis(10);
    cfg.transport.handshake_attempts = 3;
    let client = Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    let dead = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let err = client
        .connect(dead.local_addr().unwrap())
        .unwrap()
        .await
        .unwrap_err();
    // The cause is the error's source (thiserror style: Display does not repeat it).
    let cause = std::error::Error::source(&err).map(|e| e.to_string());
    assert!(
        cause.as_deref().is_some_and(|c| c.contains("timed out")),
        "{err}: {cause:?}"
    );
}

#[tokio::test]
async fn closing_flushes_and_ends_streams() {
    let (_se, _ce, c, s) = pair(Config::default()).await;
    let mut st = c.open_stream().unwrap();
    st.send(Bytes::from_static(b"x")).await.unwrap();
    let mut peer_stream = s.accept_stream().await.unwrap();
    assert_eq!(&peer_stream.next().await.unwrap().unwrap()[..], b"x");
    c.close(0, b"");
    assert!(matches!(
        st.send(Bytes::from_static(b"y")).await,
        Err(Error::ConnectionLost(_)) | Err(Error::EndpointClosed) | Err(Error::Post(_))
    ));
    // The peer hears the close and its stream ends with the reason, then `None`.
    let end = tokio::time::timeout(Duration::from_secs(5), peer_stream.next())
        .await
        .unwrap();
    assert!(
        matches!(end, Some(Err(Error::ConnectionLost(_)))),
        "{end:?}"
    );
    assert!(peer_stream.next().await.is_none());
}

#[tokio::test]
async fn read_and_atomics() {
    let (_se, _ce, c, s) = pair(Config::default()).await;
    let n = 300_000usize;
    let data: Vec<u8> = (0..n).map(|i| (i % 241) as u8).collect();
    let exposed = s.endpoint().register(data.clone(), Access::REMOTE_READ);
    let dst = c.endpoint().alloc(n, Access::LOCAL_WRITE);
    let wc = c
        .read(&dst, 0..n as u64, exposed.remote(), 0)
        .await
        .unwrap();
    assert_eq!(wc.byte_len as usize, n);
    assert_eq!(dst.read(0, n as u64).unwrap(), data);

    let counter = s
        .endpoint()
        .alloc(64, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC);
    let futs: Vec<_> = (0..50)
        .map(|_| c.fetch_add(counter.remote(), 8, 2))
        .collect();
    let mut olds: Vec<u64> = futures::future::join_all(futs)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    olds.sort_unstable();
    assert_eq!(olds, (0..50).map(|i| i * 2).collect::<Vec<_>>());
    assert_eq!(
        c.compare_swap(counter.remote(), 8, 100, 5).await.unwrap(),
        100
    );
    assert_eq!(
        c.compare_swap(counter.remote(), 8, 100, 6).await.unwrap(),
        5
    );
    assert_eq!(counter.read(8, 8).unwrap(), 5u64.to_le_bytes());
    let err = c.fetch_add(counter.remote(), 3, 1).await.unwrap_err();
    assert_eq!(
        err.status(),
        Some(WcStatus::RemoteInvalidRequest),
        "misaligned atomic"
    );
}

#[tokio::test]
async fn receives_into_application_buffers() {
    // Every stream takes posted receives, so a SEND that arrives first waits (RNR).
    let mut cfg = Config::default();
    cfg.transport.require_posted_receives = true;
    cfg.transport.min_rnr_timer = 1;
    let (_se, _ce, c, s) = pair(cfg).await;
    let buf = s.endpoint().alloc(1 << 16, Access::LOCAL_WRITE);
    let s2 = s.clone();
    let sender = tokio::spawn(async move {
        // Sent before any receive is posted for message 2: RNR NAKs until it is.
        for i in 0..3u8 {
            c.send(9, Bytes::from(vec![i + 1; 10_000])).await.unwrap();
        }
        c
    });
    let mut got = Vec::new();
    for i in 0..3u64 {
        let wc = s2
            .recv_into(9, &buf, i * 16384..(i + 1) * 16384)
            .await
            .unwrap();
        got.push(wc.byte_len);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    sender.await.unwrap();
    assert_eq!(got, vec![10_000; 3]);
    for i in 0..3u64 {
        assert!(buf
            .read(i * 16384, 10_000)
            .unwrap()
            .iter()
            .all(|&b| b == i as u8 + 1));
    }
}

/// A receive loop over `recv_into` ends when the peer finishes the stream: the receive
/// waiting for a message that cannot come completes with `WrFlushError` (it waited until
/// the connection ended before), and one posted after that at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recv_into_ends_when_the_peer_finishes_the_stream() {
    let (_se, _ce, c, s) = pair(Config::default()).await;
    let buf = s.endpoint().alloc(1 << 16, Access::LOCAL_WRITE);
    let receiver = tokio::spawn(async move {
        let mut got = Vec::new();
        let end = loop {
            let k = got.len() as u64;
            match s.recv_into(4, &buf, k * 4096..(k + 1) * 4096).await {
                Ok(wc) => got.push(wc.byte_len),
                Err(e) => break e,
            }
        };
        let after = s.recv_into(4, &buf, 0..4096).await.unwrap_err();
        (got, end, after)
    });
    // Posted receives first: the messages must land in them, not in a MessageStream.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut tx = c.stream(4).unwrap();
    for n in [100usize, 200, 300] {
        tx.send(Bytes::from(vec![1u8; n])).await.unwrap();
    }
    tx.close().await.unwrap();
    let (got, end, after) = tokio::time::timeout(Duration::from_secs(5), receiver)
        .await
        .expect("recv_into still waits after the peer finished the stream")
        .unwrap();
    assert_eq!(got, [100, 200, 300]);
    assert_eq!(end.status(), Some(WcStatus::WrFlushError), "{end}");
    assert_eq!(after.status(), Some(WcStatus::WrFlushError), "{after}");
}

#[tokio::test]
async fn an_invalid_config_names_the_field_typed_and_in_the_io_error() {
    let mut cfg = Config::default();
    cfg.transport.congestion.max_window = 300;
    let e = cfg.validate().unwrap_err();
    let metaroce_tokio::ConfigError::Transport(core) = &e else {
        panic!("{e:?}")
    };
    assert_eq!(core.field(), "congestion.max_window");
    assert_eq!(core.rule(), "must be at most 255 packets, got 300");
    // Endpoint::bind reports it as InvalidInput with the same text.
    let io = Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap_err();
    assert_eq!(io.kind(), std::io::ErrorKind::InvalidInput);
    assert_eq!(
        io.to_string(),
        "invalid transport configuration: congestion.max_window must be at most 255 packets, got 300"
    );
    assert!(io
        .get_ref()
        .and_then(|e| e.downcast_ref::<metaroce_tokio::ConfigError>())
        .is_some());
}

/// Endpoint-wide receive caps of 0 would refuse every message for good: `validate` names
/// them.
#[test]
fn zero_receive_caps_are_refused() {
    for (field, set) in [
        (
            "max_unread_recv_bytes",
            (|c: &mut Config| c.max_unread_recv_bytes = 0) as fn(&mut Config),
        ),
        ("max_reassembly_bytes", |c: &mut Config| {
            c.max_reassembly_bytes = 0
        }),
    ] {
        let mut cfg = Config::default();
        set(&mut cfg);
        let e = cfg.validate().unwrap_err();
        assert!(
            matches!(e, metaroce_tokio::ConfigError::Zero(f) if f == field),
            "{e:?}"
        );
    }
}
