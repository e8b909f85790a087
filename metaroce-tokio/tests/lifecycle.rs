//! Connection lifecycle over UDP on 127.0.0.1: connect/accept/refuse, close with a code,
//! closing by dropping handles, endpoint drop, wait_idle, and that every driver-side
//! structure of a connection is freed when it ends.

mod common;

use common::{connect, endpoints};
use metaroce_tokio::{Config, ConnectError, ConnectionError, REFUSED_BUSY};
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

fn is_closed_by_peer(e: &ConnectionError) -> bool {
    matches!(e, ConnectionError::ClosedByPeer { .. })
}

fn closed_by_peer(e: &ConnectionError) -> Option<(u32, &[u8])> {
    match e {
        ConnectionError::ClosedByPeer { code, reason } => Some((*code, &reason[..])),
        _ => None,
    }
}

/// `Endpoint::accept` ends with `None` once the endpoint is closed, whether it was already
/// waiting (on one shard or two) or is called afterwards. It used to wait forever: the
/// queue's senders lived on in the shards, and nothing woke the waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_returns_none_once_the_endpoint_is_closed() {
    for shards in [1, 2] {
        let cfg = Config {
            shards,
            ..Config::default()
        };
        let server = metaroce_tokio::Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg)
            .await
            .unwrap();
        let s2 = server.clone();
        let waiting = tokio::spawn(async move { s2.accept().await.is_none() });
        tokio::time::sleep(Duration::from_millis(20)).await;
        server.close(0, b"bye");
        let ended = tokio::time::timeout(T, waiting).await;
        assert!(
            matches!(ended, Ok(Ok(true))),
            "a waiting accept did not end with None ({shards} shards): {ended:?}"
        );
        let later = tokio::time::timeout(T, server.accept()).await;
        assert!(
            matches!(later, Ok(None)),
            "accept after close did not return None ({shards} shards)"
        );
    }
}

#[tokio::test]
async fn close_with_code_reaches_the_peers_closed() {
    let (server, client) = endpoints(Config::default()).await;
    let (c, s) = connect(&server, &client).await;
    c.close(42, b"bye");
    let why = tokio::time::timeout(T, s.closed()).await.unwrap();
    assert_eq!(closed_by_peer(&why), Some((42, &b"bye"[..])), "{why:?}");
    assert_eq!(c.closed().await, ConnectionError::LocallyClosed);
    assert_eq!(s.close_reason(), Some(why));
    // Both drivers freed the connection.
    tokio::time::timeout(T, server.wait_idle()).await.unwrap();
    tokio::time::timeout(T, client.wait_idle()).await.unwrap();
    assert_eq!(server.driver_maps(), Default::default());
    assert_eq!(client.driver_maps(), Default::default());
}

#[tokio::test]
async fn dropping_the_last_handle_closes_the_connection() {
    let (server, client) = endpoints(Config::default()).await;
    let (c, s) = connect(&server, &client).await;
    let c2 = c.clone();
    let stream = c.open_stream().unwrap();
    drop(c);
    drop(c2);
    // A stream keeps its connection open.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(s.close_reason(), None);
    drop(stream);
    let why = tokio::time::timeout(T, s.closed()).await.unwrap();
    assert_eq!(closed_by_peer(&why), Some((0, &b""[..])), "{why:?}");
    tokio::time::timeout(T, client.wait_idle()).await.unwrap();
    assert_eq!(client.driver_maps(), Default::default());
}

#[tokio::test]
async fn an_endpoint_dropped_without_close_closes_at_the_peer() {
    let (server, client) = endpoints(Config::default()).await;
    let (c, s) = connect(&server, &client).await;
    drop(c);
    drop(client);
    let why = tokio::time::timeout(T, s.closed()).await.unwrap();
    assert!(is_closed_by_peer(&why), "{why:?}");
    tokio::time::timeout(T, server.wait_idle()).await.unwrap();
    assert_eq!(server.driver_maps(), Default::default());
}

#[tokio::test]
async fn endpoint_close_reaches_every_peer_and_wait_idle_returns() {
    let (server, client) = endpoints(Config::default()).await;
    let mut peers = Vec::new();
    let mut mine = Vec::new();
    for _ in 0..4 {
        let (c, s) = connect(&server, &client).await;
        mine.push(c);
        peers.push(s);
    }
    client.close(9, b"shutdown");
    tokio::time::timeout(T, client.wait_idle()).await.unwrap();
    for s in &peers {
        let why = tokio::time::timeout(T, s.closed()).await.unwrap();
        assert_eq!(closed_by_peer(&why), Some((9, &b"shutdown"[..])), "{why:?}");
    }
    for c in &mine {
        assert_eq!(c.close_reason(), Some(ConnectionError::LocallyClosed));
    }
    assert!(matches!(
        client.connect(server.local_addr()),
        Err(ConnectError::EndpointClosed)
    ));
}

fn rejected(code: u32, reason: &[u8]) -> ConnectionError {
    ConnectionError::Rejected {
        code,
        reason: metaroce_tokio::Bytes::copy_from_slice(reason),
    }
}

#[tokio::test]
async fn a_refused_request_fails_the_connecting_side_with_the_code_and_reason() {
    let (server, client) = endpoints(Config::default()).await;
    let connecting = client.connect(server.local_addr()).unwrap();
    let incoming = server.accept().await.unwrap();
    incoming.refuse(77, b"tenant over quota");
    let err = tokio::time::timeout(T, connecting)
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(
        err,
        ConnectError::Connection(rejected(77, b"tenant over quota"))
    );
    // What a user prints: the error chain names code and reason.
    let chain = format!("{err}: {}", std::error::Error::source(&err).unwrap());
    assert!(
        chain.contains("code 77") && chain.contains("tenant over quota"),
        "{chain}"
    );
    // A reason longer than MAX_CLOSE_REASON is cut to it, as a close reason is.
    let connecting = client.connect(server.local_addr()).unwrap();
    let long = vec![b'x'; metaroce_tokio::metaroce::MAX_CLOSE_REASON + 100];
    server.accept().await.unwrap().refuse(78, &long);
    let err = tokio::time::timeout(T, connecting)
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(
        err,
        ConnectError::Connection(rejected(
            78,
            &long[..metaroce_tokio::metaroce::MAX_CLOSE_REASON]
        ))
    );
    // Dropping the request refuses it too.
    let connecting = client.connect(server.local_addr()).unwrap();
    drop(server.accept().await.unwrap());
    let err = tokio::time::timeout(T, connecting)
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err, ConnectError::Connection(rejected(REFUSED_BUSY, b"")));
    tokio::time::timeout(T, server.wait_idle()).await.unwrap();
    tokio::time::timeout(T, client.wait_idle()).await.unwrap();
    assert_eq!(server.driver_maps(), Default::default());
    assert_eq!(client.driver_maps(), Default::default());
}

#[tokio::test]
async fn dropping_connecting_abandons_the_attempt() {
    let (_server, client) = endpoints(Config::default()).await;
    let dead = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let connecting = client.connect(dead.local_addr().unwrap()).unwrap();
    assert_eq!(client.driver_maps().connecting, 1);
    drop(connecting);
    tokio::time::timeout(T, client.wait_idle()).await.unwrap();
    assert_eq!(client.driver_maps().core_connections, 0);
    assert_eq!(client.driver_maps().connections, 0);
}

#[tokio::test]
async fn closing_an_endpoint_refuses_requests_it_holds() {
    let (server, client) = endpoints(Config::default()).await;
    let connecting = client.connect(server.local_addr()).unwrap();
    let undecided = server.accept().await.unwrap();
    server.close(5, b"going away");
    let err = tokio::time::timeout(T, connecting)
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err, ConnectError::Connection(rejected(5, b"going away")));
    assert!(matches!(
        undecided.accept(),
        Err(ConnectError::EndpointClosed)
    ));
    tokio::time::timeout(T, server.wait_idle()).await.unwrap();
}

/// How the receiving side goes away right after the message arrived.
#[derive(Debug, Clone, Copy)]
enum CloseHow {
    Connection,
    Endpoint,
    DropAll,
}

/// The server takes one message and closes at once (connection close, endpoint close, or
/// dropping every handle): the client's SEND of that message was delivered, so it must
/// complete with Success (`Connection::send`) or flush Ok (the stream's Sink), not fail
/// because the close overtook its ACK or was handled right after it.
async fn close_right_after_receiving(how: CloseHow, len: usize, sink: bool) {
    let (server, client) = endpoints(Config::default()).await;
    let (c, s) = connect(&server, &client).await;
    let send = {
        let c = c.clone();
        let data = bytes::Bytes::from(vec![5u8; len]);
        tokio::spawn(async move {
            if sink {
                // The Sink: `send` is ready + start_send + flush, and the flush resolves
                // once the message is acknowledged.
                let mut tx = c.open_stream()?;
                futures::SinkExt::send(&mut tx, data).await
            } else {
                c.send(0, data).await.map(|wc| {
                    assert_eq!(wc.status, metaroce::WcStatus::Success);
                })
            }
        })
    };
    let mut rx = tokio::time::timeout(T, s.accept_stream())
        .await
        .unwrap()
        .unwrap();
    let msg = tokio::time::timeout(T, futures::StreamExt::next(&mut rx))
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(msg.len(), len);
    match how {
        CloseHow::Connection => s.close(3, b"got it"),
        CloseHow::Endpoint => server.close(3, b"got it"),
        CloseHow::DropAll => {
            drop(rx);
            drop(s);
            drop(server);
        }
    }
    let r = tokio::time::timeout(T, send).await.unwrap().unwrap();
    if let Err(e) = r {
        panic!("{how:?}, {len} bytes, sink {sink}: the delivered SEND failed: {e:?}");
    }
    let why = tokio::time::timeout(T, c.closed()).await.unwrap();
    assert!(is_closed_by_peer(&why), "{why:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_received_just_before_close_completes_success_at_the_sender() {
    for round in 0..20 {
        for how in [CloseHow::Connection, CloseHow::Endpoint, CloseHow::DropAll] {
            let len = if round % 2 == 0 { 100 } else { 100_000 };
            close_right_after_receiving(how, len, round % 4 >= 2).await;
        }
    }
}

/// The runtime shuts down before the drivers it was given ever ran: a current-thread
/// runtime whose `block_on` made the endpoints and returned without yielding, so their
/// driver tasks were dropped unpolled. The handles must end as when a running driver is
/// dropped (below). They waited forever when the driver's guard was made inside its
/// `async` body, which an unpolled task never enters (seen as an occasional timeout of the
/// RC variant, `rocev2_async::rc_handles_end_when_the_runtime_of_the_driver_shuts_down`).
#[test]
fn handles_end_when_the_driver_never_ran() {
    use metaroce_tokio::backend::UdpBackend;
    use metaroce_tokio::Endpoint;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (server, client) = rt.block_on(async {
        let ep = || {
            let b = UdpBackend::bind("127.0.0.1:0".parse().unwrap(), 2).unwrap();
            Endpoint::with_backend(b, Config::default()).unwrap()
        };
        (ep(), ep())
    });
    drop(rt);
    let rt2 = tokio::runtime::Runtime::new().unwrap();
    rt2.block_on(async {
        assert!(matches!(
            client.connect(server.local_addr()),
            Err(ConnectError::EndpointClosed)
        ));
        tokio::time::timeout(T, server.accept())
            .await
            .expect("accept must not wait for a driver that never ran");
        tokio::time::timeout(T, client.wait_idle()).await.unwrap();
        tokio::time::timeout(T, server.wait_idle()).await.unwrap();
        assert!(client.is_closed() && server.is_closed());
    });
}

/// The runtime that ran the endpoints' drivers shuts down while the handles live on. The
/// handles must not wait for a driver that is gone: a receive already waiting (on another
/// runtime) ends, and afterwards, on a new runtime, a stream send fails with
/// `EndpointClosed`, `Connection::closed` resolves, `connect` is refused at once,
/// `wait_idle` returns and `is_closed` is true. Every one of these used to wait forever
/// (found by a new user's trial: a shared endpoint fixture across `#[tokio::test]`s).
#[test]
fn handles_end_when_the_runtime_of_the_driver_shuts_down() {
    use futures::{SinkExt, StreamExt};
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (server, client, conn, peer, mut stream, mut peer_stream) = rt.block_on(async {
        let (server, client) = endpoints(Config::default()).await;
        let (c, s) = connect(&server, &client).await;
        let mut stream = c.open_stream().unwrap();
        stream
            .send(metaroce_tokio::Bytes::from_static(b"first"))
            .await
            .unwrap();
        let mut peer_stream = tokio::time::timeout(T, s.accept_stream())
            .await
            .unwrap()
            .unwrap();
        let m = tokio::time::timeout(T, peer_stream.next()).await.unwrap();
        assert_eq!(&m.unwrap().unwrap()[..], b"first");
        (server, client, c, s, stream, peer_stream)
    });
    // A receive waiting on another runtime when the drivers go away.
    let (tx, rx) = std::sync::mpsc::channel();
    let waiting = std::thread::spawn(move || {
        let rt3 = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt3.block_on(async move {
            tx.send(()).unwrap();
            let r = tokio::time::timeout(T, peer_stream.next()).await;
            r.map(|m| m.map(|m| m.is_ok()))
        })
    });
    rx.recv().unwrap();
    std::thread::sleep(Duration::from_millis(50));
    drop(rt);
    let got = waiting.join().unwrap();
    assert!(
        matches!(got, Ok(None) | Ok(Some(false))),
        "the waiting receive ends without a message: {got:?}"
    );
    let rt2 = tokio::runtime::Runtime::new().unwrap();
    rt2.block_on(async {
        let r = tokio::time::timeout(T, stream.send(metaroce_tokio::Bytes::from_static(b"x")))
            .await
            .expect("a send after the driver is gone must not wait");
        assert!(
            matches!(r, Err(metaroce_tokio::Error::EndpointClosed)),
            "{r:?}"
        );
        let why = tokio::time::timeout(T, conn.closed()).await.unwrap();
        assert_eq!(why, ConnectionError::LocallyClosed);
        tokio::time::timeout(T, peer.closed()).await.unwrap();
        assert!(matches!(
            client.connect(server.local_addr()),
            Err(ConnectError::EndpointClosed)
        ));
        tokio::time::timeout(T, client.wait_idle()).await.unwrap();
        tokio::time::timeout(T, server.wait_idle()).await.unwrap();
        assert!(client.is_closed() && server.is_closed());
    });
}

/// A server that accepts and at once drops the connection, or closes it with a code, before
/// its Accept went out (found by a new user's trial: the client saw `HandshakeTimeout`
/// after 2 s, since it cannot take an MR_CLOSE before it has the server's nonce). The
/// request is refused instead, with the close's code and reason, and the client learns it
/// within a round trip. A second connection between the same endpoints works. (One
/// thread: the driver cannot send the Accept between `accept` and the close. Once the
/// Accept is out, the client connects and then sees `ClosedByPeer`.)
#[tokio::test]
async fn a_connection_closed_right_after_accept_refuses_the_client() {
    let (server, client) = endpoints(Config::default()).await;
    for (code, reason) in [(0u32, &b""[..]), (9, &b"not now"[..])] {
        let connecting = client.connect(server.local_addr()).unwrap();
        let incoming = tokio::time::timeout(T, server.accept())
            .await
            .unwrap()
            .unwrap();
        let conn = incoming.accept().unwrap();
        if code == 0 {
            drop(conn);
        } else {
            conn.close(code, reason);
        }
        let t = std::time::Instant::now();
        let err = tokio::time::timeout(T, connecting)
            .await
            .unwrap()
            .unwrap_err();
        println!(
            "closed after accept, code {code}: {err:?} after {:?}",
            t.elapsed()
        );
        assert_eq!(err, ConnectError::Connection(rejected(code, reason)));
    }
    let (c, s) = connect(&server, &client).await;
    drop((c, s));
}

/// The runtime that ran the drivers shuts down while connection handles live on: calls on
/// them end (the `Endpoint` docs), `accept_stream` and `recv_imm` too, both when called
/// afterwards and when already waiting on another runtime. Before (found by review), the
/// driver's entries stayed and both waited forever.
#[test]
fn accept_stream_and_recv_imm_end_when_the_driver_is_gone() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (server, client, conn, peer) = rt.block_on(async {
        let (server, client) = endpoints(Config::default()).await;
        let (c, s) = connect(&server, &client).await;
        (server, client, c, s)
    });
    // An acceptor already waiting on another runtime when the drivers go.
    let waiting_peer = peer.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiting = std::thread::spawn(move || {
        let rt3 = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt3.block_on(async move {
            tx.send(()).unwrap();
            tokio::time::timeout(T, waiting_peer.accept_stream())
                .await
                .map(|s| s.is_some())
        })
    });
    rx.recv().unwrap();
    std::thread::sleep(Duration::from_millis(50));
    drop(rt);
    let rt2 = tokio::runtime::Runtime::new().unwrap();
    rt2.block_on(async {
        let why = tokio::time::timeout(T, peer.closed()).await.unwrap();
        assert_eq!(why, ConnectionError::LocallyClosed);
        assert!(server.is_closed() && client.is_closed());
        let a = tokio::time::timeout(T, peer.accept_stream())
            .await
            .map(|s| s.is_some());
        let i = tokio::time::timeout(T, conn.recv_imm()).await;
        let w = waiting.join().unwrap();
        assert!(
            a == Ok(false) && i == Ok(None) && w == Ok(false),
            "Err(Elapsed) = hung: accept_stream {a:?}, recv_imm {i:?}, waiting accept {w:?}"
        );
    });
}

/// What the peer saw delivered (`Success`) before it closed gracefully is not lost to an
/// application that takes it only after the end: a stream not accepted yet is still
/// offered, with its message, and so is the immediate of a WRITE with immediate. Before
/// (found by review), the driver's queues went with the connection: `accept_stream` and
/// `recv_imm` gave `None`.
#[tokio::test]
async fn deliveries_before_a_graceful_close_reach_a_slow_acceptor() {
    use futures::{SinkExt, StreamExt};
    use metaroce_tokio::Access;
    let (server, client) = endpoints(Config::default()).await;
    let (c, s) = connect(&server, &client).await;
    let target = server.alloc(64, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let src = client.register(vec![7u8; 64], Access::LOCAL_WRITE);
    let mut tx = c.open_stream().unwrap();
    tokio::time::timeout(T, tx.send(metaroce_tokio::Bytes::from_static(b"request")))
        .await
        .unwrap()
        .expect("delivered");
    tokio::time::timeout(T, c.write_with_imm(&src, 0..64, target.remote(), 0, 42))
        .await
        .unwrap()
        .expect("the WRITE with immediate completed Success");
    c.close(0, b"done");
    let why = tokio::time::timeout(T, s.closed()).await.unwrap();
    assert!(is_closed_by_peer(&why), "{why}");
    assert_eq!(target.read(0, 64).unwrap(), vec![7u8; 64]);
    let mut rx = tokio::time::timeout(T, s.accept_stream())
        .await
        .unwrap()
        .expect("the stream delivered before the close");
    let m = tokio::time::timeout(T, rx.next()).await.unwrap();
    assert_eq!(m.unwrap().unwrap(), &b"request"[..]);
    assert!(tokio::time::timeout(T, rx.next())
        .await
        .unwrap()
        .is_some_and(|r| r.is_err()));
    assert_eq!(
        tokio::time::timeout(T, s.recv_imm()).await.unwrap(),
        Some((42, 64))
    );
    assert!(tokio::time::timeout(T, s.accept_stream())
        .await
        .unwrap()
        .is_none());
    assert_eq!(tokio::time::timeout(T, s.recv_imm()).await.unwrap(), None);
    drop(tx);
}

/// A stream that yields `ConnectionLost` belongs to a connection whose `close_reason` is
/// known: a reader that sees the end and then asks its connection why must not get `None`.
/// (`ConnEntry::on_lost` now ends every stream before it records the reason.) Readers on
/// their own threads, so that they run while the driver is still ending the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_ended_by_the_connection_end_sees_the_close_reason() {
    use futures::{SinkExt, StreamExt};
    const STREAMS: usize = 64;
    let mut none_seen = 0;
    for _round in 0..10 {
        let (server, client) = endpoints(Config::default()).await;
        let (c, s) = connect(&server, &client).await;
        let mut sinks = Vec::new();
        for _ in 0..STREAMS {
            let mut tx = c.open_stream().unwrap();
            tokio::time::timeout(T, tx.send(metaroce_tokio::Bytes::from_static(b"x")))
                .await
                .unwrap()
                .unwrap();
            sinks.push(tx);
        }
        let mut readers = Vec::new();
        for _ in 0..STREAMS {
            let mut rx = tokio::time::timeout(T, s.accept_stream())
                .await
                .unwrap()
                .unwrap();
            let s2 = s.clone();
            readers.push(std::thread::spawn(move || {
                futures::executor::block_on(async move {
                    assert!(rx.next().await.unwrap().is_ok());
                    match rx.next().await {
                        Some(Err(metaroce_tokio::Error::ConnectionLost(_))) => {
                            s2.close_reason().is_some()
                        }
                        other => panic!("{other:?}"),
                    }
                })
            }));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        c.close(0, b"bye");
        for r in readers {
            if !r.join().unwrap() {
                none_seen += 1;
            }
        }
        drop(sinks);
    }
    assert_eq!(
        none_seen, 0,
        "readers saw ConnectionLost while close_reason() was None"
    );
}
