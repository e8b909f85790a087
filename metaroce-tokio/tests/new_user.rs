//! What a new user writes from the README and the crate docs alone, with only the public
//! API and no test helpers: connect/accept, a message stream used as `Stream` and
//! `Sink<Bytes>` in both directions with end of stream, the peer's region descriptor sent
//! in a message, a one-sided WRITE and READ into it, an access error, and close with a code
//! and reason the peer reports.

use metaroce_tokio::futures::{SinkExt, StreamExt};
use metaroce_tokio::{
    Access, Bytes, Config, ConnectionError, Endpoint, Error, RemoteRegion, WcStatus,
};
use std::time::Duration;

/// A guard against a hang (the test fails instead of blocking CI), not a timing check.
const LIMIT: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_promises_hold_for_a_new_user() {
    tokio::time::timeout(LIMIT, program())
        .await
        .expect("the program hung")
        .expect("the program failed");
}

async fn program() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let server = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
    let client = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;

    let connecting = client.connect(server.local_addr())?;
    let incoming = server.accept().await.ok_or("server endpoint closed")?;
    assert_eq!(
        incoming.remote_addr().map(|a| a.ip()),
        Some(client.local_addr().ip())
    );
    let peer = incoming.accept()?;
    let conn = connecting.await?;
    assert_eq!(conn.remote_addr(), Some(server.local_addr()));

    // Client to server: three messages, then end of stream (`SinkExt::close`).
    let mut tx = conn.open_stream()?;
    for m in [&b"one"[..], b"", b"three"] {
        tx.feed(Bytes::copy_from_slice(m)).await?;
    }
    tx.close().await?; // flushes (every message acknowledged), then finishes the stream
    assert!(matches!(
        tx.send(Bytes::from_static(b"late")).await,
        Err(Error::StreamClosed { .. })
    ));

    let mut rx = peer.accept_stream().await.ok_or("connection ended")?;
    assert_eq!(rx.id(), tx.id());
    let got: Vec<Bytes> = (&mut rx)
        .map(|m| m.expect("a message"))
        .collect::<Vec<_>>()
        .await;
    assert_eq!(got, [&b"one"[..], b"", b"three"]); // in order, zero-length kept, then None
    assert!(rx.next().await.is_none(), "end of stream is sticky");

    // Server to client on the same stream id: the region descriptor (20 bytes).
    let target = server.alloc(
        1 << 16,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    );
    rx.send(Bytes::copy_from_slice(&target.remote().to_bytes()))
        .await?;
    rx.close().await?;
    let desc = tx.next().await.ok_or("stream ended early")??;
    let remote = RemoteRegion::from_bytes(&desc).ok_or("bad descriptor")?;
    assert_eq!(remote, target.remote());
    assert!(tx.next().await.is_none());

    // One-sided WRITE, then READ back into another local region.
    let pattern: Vec<u8> = (0..1u32 << 16).map(|i| (i * 7 + 1) as u8).collect();
    let src = client.register(pattern.clone(), Access::LOCAL_WRITE);
    let wc = conn.write(&src, 0..1 << 16, remote, 0).await?;
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(target.read(0, 1 << 16)?, pattern);
    target.write(100, b"server side")?;
    let back = client.alloc(1 << 16, Access::LOCAL_WRITE);
    conn.read(&back, 0..1 << 16, remote, 0).await?;
    assert_eq!(&back.read(100, 11)?[..], b"server side");
    assert_eq!(back.read(0, 100)?, pattern[..100]);

    // Past the end of the peer's region as its descriptor says: refused before sending,
    // with an error that says so.
    let err = conn
        .write(&src, 0..16, remote, (1 << 16) - 8)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::RemoteOutOfBounds { .. }), "{err}");
    // A forged rkey: the peer refuses it, that operation fails, the connection goes on.
    let forged = RemoteRegion {
        rkey: remote.rkey ^ 1,
        ..remote
    };
    let err = conn.write(&src, 0..16, forged, 0).await.unwrap_err();
    assert_eq!(err.status(), Some(WcStatus::RemoteAccessError));
    assert!(conn.close_reason().is_none());

    // Close with a code and reason; the peer reports both, and the client goes idle.
    conn.close(42, b"done");
    match peer.closed().await {
        ConnectionError::ClosedByPeer { code, reason } => {
            assert_eq!((code, &reason[..]), (42, &b"done"[..]));
        }
        other => panic!("peer saw {other}"),
    }
    client.wait_idle().await;
    server.wait_idle().await;
    assert!(
        conn.open_stream().is_err(),
        "a closed connection opens no stream"
    );
    Ok(())
}

/// A user who builds the backend inside a runtime and starts the endpoint outside it gets
/// an error that says what to do, not a panic from `tokio::spawn`.
#[test]
fn starting_an_endpoint_outside_a_runtime_is_an_error() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let backend = rt
        .block_on(async {
            metaroce_tokio::backend::UdpBackend::bind("127.0.0.1:0".parse().unwrap(), 2)
        })
        .unwrap();
    let err = Endpoint::with_backend(backend, Config::default()).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::Other);
    assert!(err.to_string().contains("tokio runtime"), "{err}");
}
