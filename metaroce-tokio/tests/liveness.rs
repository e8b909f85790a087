//! Liveness over UDP on 127.0.0.1 against a peer in another process: an idle connection to
//! a live peer survives past the idle timeout (keepalives), and a killed peer is reported
//! on every handle within the idle timeout.
//!
//! The peer is this test binary re-executed with `METAROCE_LIVENESS_PEER` set: then the
//! `peer_process` test connects to the given address, sends one message and waits to be
//! killed.

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use metaroce_tokio::{Config, ConnectionError, Endpoint, Error};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const PEER_ENV: &str = "METAROCE_LIVENESS_PEER";
const IDLE: Duration = Duration::from_secs(3);

fn config() -> Config {
    let mut cfg = Config::default();
    cfg.transport.idle_timeout = Some(IDLE);
    cfg.transport.keepalive_interval = Some(Duration::from_millis(500));
    cfg
}

/// The child side (does nothing unless run as the peer).
#[test]
fn peer_process() {
    let Ok(addr) = std::env::var(PEER_ENV) else {
        return;
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let ep = Endpoint::bind("127.0.0.1:0".parse().unwrap(), config())
            .await
            .unwrap();
        let conn = ep.connect(addr.parse().unwrap()).unwrap().await.unwrap();
        let mut s = conn.open_stream().unwrap();
        s.send(Bytes::from_static(b"alive")).await.unwrap();
        // Stay connected (and silent) until killed.
        std::future::pending::<()>().await;
    });
}

struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn a_killed_peer_is_reported_on_every_handle_of_an_idle_connection() {
    let server = Endpoint::bind("127.0.0.1:0".parse().unwrap(), config())
        .await
        .unwrap();
    let mut child = Child(
        Command::new(std::env::current_exe().unwrap())
            .args(["peer_process", "--exact", "--test-threads=1"])
            .env(PEER_ENV, server.local_addr().to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let conn = tokio::time::timeout(Duration::from_secs(30), server.accept())
        .await
        .expect("the peer process connects")
        .unwrap()
        .accept()
        .unwrap();
    let mut stream = conn.accept_stream().await.unwrap();
    assert_eq!(&stream.next().await.unwrap().unwrap()[..], b"alive");
    let mut reply = conn.open_stream().unwrap();

    // Idle, peer alive: keepalives keep the connection up past the idle timeout.
    tokio::time::sleep(IDLE * 2).await;
    assert_eq!(
        conn.close_reason(),
        None,
        "a live idle peer must not time out"
    );

    // Kill the peer process; every handle must report it.
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let killed = Instant::now();
    let closed = conn.clone();
    let closed = tokio::spawn(async move { closed.closed().await });
    let next = tokio::time::timeout(IDLE * 3, stream.next())
        .await
        .expect("stream.next() must end after the peer died");
    let after_next = killed.elapsed();
    let why = match next {
        Some(Err(Error::ConnectionLost(r))) => r,
        other => panic!("expected ConnectionLost, got {other:?}"),
    };
    assert!(
        matches!(
            why,
            ConnectionError::IdleTimeout | ConnectionError::RetryExceeded
        ),
        "{why:?}"
    );
    assert!(stream.next().await.is_none());
    assert_eq!(closed.await.unwrap(), why);
    // Operations fail with the same reason.
    let send = reply.send(Bytes::from_static(b"anyone?")).await;
    assert_eq!(send, Err(Error::ConnectionLost(why.clone())));
    let one_sided = conn.send(5, Bytes::from_static(b"x")).await;
    assert_eq!(one_sided, Err(Error::ConnectionLost(why.clone())));
    assert!(conn.open_stream().is_err());
    println!(
        "peer killed: stream.next() ended {after_next:?} later with {why} (idle timeout {IDLE:?})"
    );
    tokio::time::timeout(Duration::from_secs(10), server.wait_idle())
        .await
        .unwrap();
    assert_eq!(server.driver_maps(), Default::default());
}

#[tokio::test]
async fn an_operation_pending_when_the_peer_dies_fails() {
    let server = Endpoint::bind("127.0.0.1:0".parse().unwrap(), config())
        .await
        .unwrap();
    let mut child = Child(
        Command::new(std::env::current_exe().unwrap())
            .args(["peer_process", "--exact", "--test-threads=1"])
            .env(PEER_ENV, server.local_addr().to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let conn = tokio::time::timeout(Duration::from_secs(30), server.accept())
        .await
        .unwrap()
        .unwrap()
        .accept()
        .unwrap();
    let mut stream = conn.accept_stream().await.unwrap();
    stream.next().await.unwrap().unwrap();
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let killed = Instant::now();
    // Posted after the death: never acknowledged.
    let r = tokio::time::timeout(IDLE * 3, conn.send(9, Bytes::from(vec![1u8; 100_000])))
        .await
        .expect("a SEND to a dead peer must fail");
    println!(
        "SEND to the killed peer failed {:?} later: {r:?}",
        killed.elapsed()
    );
    assert!(
        matches!(
            &r,
            Err(Error::Completion(_)) | Err(Error::ConnectionLost(_))
        ),
        "{r:?}"
    );
}
