//! Transmits from the application task (`Config::inline_transmit`, issue #13 P2): a
//! `MessageStream` that posts a message hands its packets to the backend itself instead of
//! waking the driver; what the backend cannot take at once goes to the driver, in order;
//! a packet sent that way and lost is still recovered by the driver's timers.
//!
//! The client's backend is a UDP backend wrapped to record which tokio task called
//! `poll_send`, to answer `Pending` on chosen calls, and to drop chosen datagrams.

use futures::{SinkExt, StreamExt};
use metaroce_tokio::backend::{DatagramBackend, UdpBackend};
use metaroce_tokio::metaroce::fasthash::HashSet;
use metaroce_tokio::metaroce::Transmit;
use metaroce_tokio::{forward_datagram_backend, Config, Endpoint};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

const T: Duration = Duration::from_secs(20);

#[derive(Debug)]
struct Watched {
    inner: UdpBackend,
    /// Ids of the tokio tasks that called `poll_send`.
    tasks: Mutex<HashSet<tokio::task::Id>>,
    calls: AtomicUsize,
    /// Every `pending_every`-th call answers `Pending` (0: never).
    pending_every: usize,
    pendings: AtomicUsize,
    /// Datagrams still to drop (the next ones handed over, whatever they are).
    drop_next: AtomicUsize,
}

impl Watched {
    fn new(pending_every: usize) -> Arc<Self> {
        Arc::new(Watched {
            inner: UdpBackend::bind("127.0.0.1:0".parse().unwrap(), 8).unwrap(),
            tasks: Mutex::new(HashSet::default()),
            calls: AtomicUsize::new(0),
            pending_every,
            pendings: AtomicUsize::new(0),
            drop_next: AtomicUsize::new(0),
        })
    }
}

#[derive(Debug, Clone)]
struct Shared(Arc<Watched>);

impl DatagramBackend for Shared {
    forward_datagram_backend!([.0.inner] local_addr, source_ports, max_gso_segments,
        max_gro_segments, socket_recv_buffer, poll_recv, poll_recv_in_place, flush);

    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        transmit: &Transmit,
        contents: &[u8],
    ) -> Poll<std::io::Result<()>> {
        let w = &self.0;
        if let Some(id) = tokio::task::try_id() {
            w.tasks.lock().unwrap().insert(id);
        }
        let n = w.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if w.pending_every > 0 && n % w.pending_every == 0 {
            w.pendings.fetch_add(1, Ordering::SeqCst);
            // Whoever polls again will be let through (the driver's waker is woken; an
            // application task's no-op waker is not, so the driver must take over).
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let drop_it = w
            .drop_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |d| d.checked_sub(1))
            .is_ok();
        if drop_it {
            return Poll::Ready(Ok(()));
        }
        w.inner.poll_send(cx, transmit, contents)
    }
}

fn config(inline: bool) -> Config {
    let mut c = Config {
        inline_transmit: inline,
        ..Config::default()
    };
    // Nothing but the transport's own timers may wake a driver.
    c.transport.keepalive_interval = None;
    c.transport.idle_timeout = None;
    c
}

async fn pair(
    backend: Arc<Watched>,
    inline: bool,
) -> (
    Endpoint,
    Endpoint,
    metaroce_tokio::Connection,
    metaroce_tokio::Connection,
) {
    let server = Endpoint::bind("127.0.0.1:0".parse().unwrap(), config(inline))
        .await
        .unwrap();
    let client = Endpoint::with_backend(Shared(backend), config(inline)).unwrap();
    let (c, s) = connect(&client, &server).await;
    (client, server, c, s)
}

/// `client` connects to `server`, which accepts: the two ends of the connection.
async fn connect(
    client: &Endpoint,
    server: &Endpoint,
) -> (metaroce_tokio::Connection, metaroce_tokio::Connection) {
    let s2 = server.clone();
    let accept = tokio::spawn(async move { s2.accept().await.and_then(|i| i.accept().ok()) });
    let c = tokio::time::timeout(T, client.connect(server.local_addr()).unwrap())
        .await
        .unwrap()
        .unwrap();
    let s = accept.await.unwrap().unwrap();
    (c, s)
}

/// Ping-pong of `n` messages (the server echoes each); returns when the last echo is in.
/// A burst of `n` 4-byte messages from `c` to `s` on a new stream, fed without waiting for
/// each: every one arrives, once, in order.
async fn burst(c: &metaroce_tokio::Connection, s: &metaroce_tokio::Connection, n: u32) {
    let mut tx = c.open_stream().unwrap();
    let sender = tokio::spawn(async move {
        for k in 0..n {
            tx.feed(bytes::Bytes::from(k.to_be_bytes().to_vec()))
                .await
                .unwrap();
        }
        tx.close().await.unwrap();
    });
    let mut rx = tokio::time::timeout(T, s.accept_stream())
        .await
        .unwrap()
        .unwrap();
    for k in 0..n {
        let m = tokio::time::timeout(T, rx.next())
            .await
            .expect("message within the guard time")
            .unwrap()
            .unwrap();
        assert_eq!(&m[..], &k.to_be_bytes()[..], "message {k} out of order");
    }
    tokio::time::timeout(T, sender).await.unwrap().unwrap();
}

async fn ping_pong(c: &metaroce_tokio::Connection, s: &metaroce_tokio::Connection, n: u32) {
    let mut tx = c.open_stream().unwrap();
    tx.feed(bytes::Bytes::from_static(b"hello")).await.unwrap();
    let mut rx = tokio::time::timeout(T, s.accept_stream())
        .await
        .unwrap()
        .unwrap();
    let echo = tokio::spawn(async move {
        while let Some(Ok(m)) = rx.next().await {
            if rx.feed(m).await.is_err() {
                break;
            }
        }
    });
    let first = tokio::time::timeout(T, tx.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(&first[..], b"hello");
    for k in 0..n {
        let m = bytes::Bytes::from(k.to_be_bytes().to_vec());
        tx.feed(m.clone()).await.unwrap();
        let got = tokio::time::timeout(T, tx.next())
            .await
            .expect("echo within the guard time")
            .unwrap()
            .unwrap();
        assert_eq!(got, m, "echo {k}");
    }
    tokio::time::timeout(T, tx.close()).await.unwrap().unwrap();
    echo.abort();
}

/// With `inline_transmit`, the client's packets leave from its application task too (a
/// second tokio task calls `poll_send`), and the ping-pong is intact. Without it, only the
/// driver task sends (as on the old code, where this test's first assertion fails).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_leave_from_the_application_task() {
    for inline in [true, false] {
        let w = Watched::new(0);
        let (_client, _server, c, s) = pair(w.clone(), inline).await;
        w.tasks.lock().unwrap().clear();
        // In a spawned task (the test's own body has no task id).
        let app = tokio::spawn(async move { ping_pong(&c, &s, 200).await });
        let app_id = app.id();
        app.await.unwrap();
        let tasks = w.tasks.lock().unwrap().clone();
        if inline {
            // The application task sent (with the delayed ACK riding behind each SEND,
            // it may have sent everything, and the driver nothing).
            assert!(
                tasks.contains(&app_id),
                "the application task never sent: {} other task(s) did",
                tasks.len()
            );
        } else {
            assert!(!tasks.contains(&app_id), "the application task sent");
            assert_eq!(tasks.len(), 1, "a task other than the driver sent");
        }
    }
}

/// Every third `poll_send` is `Pending` (the application task's no-op waker is never
/// woken): what it could not send must reach the driver and leave in order. 300
/// ping-pongs and a burst of 2,000 messages arrive complete and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_backend_hands_over_to_the_driver_in_order() {
    let w = Watched::new(3);
    let (_client, _server, c, s) = pair(w.clone(), true).await;
    ping_pong(&c, &s, 300).await;
    burst(&c, &s, 2000).await;
    assert!(w.pendings.load(Ordering::SeqCst) > 100);
    let st = c.stats().unwrap();
    let rtx: u64 = st.paths.iter().map(|p| p.stats.retransmits).sum();
    println!(
        "poll_send calls {}, Pending {}, retransmits {rtx}",
        w.calls.load(Ordering::SeqCst),
        w.pendings.load(Ordering::SeqCst)
    );
}

/// A message sent inline while the client's driver sleeps with no timer armed (no
/// keepalive, no idle timeout, nothing in flight) is lost: the application task must have
/// told the driver about the new loss timer, or the message would never be re-sent (the
/// guard times out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_inline_send_is_recovered_by_the_driver_timer() {
    let w = Watched::new(0);
    let (_client, _server, c, s) = pair(w.clone(), true).await;
    ping_pong(&c, &s, 5).await;
    // Let every ACK settle and the timers disarm.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut tx = c.open_stream().unwrap();
    w.drop_next.store(1, Ordering::SeqCst);
    tx.feed(bytes::Bytes::from_static(b"lost once"))
        .await
        .unwrap();
    let mut rx = tokio::time::timeout(T, s.accept_stream())
        .await
        .expect("the lost message was re-sent")
        .unwrap();
    let m = tokio::time::timeout(T, rx.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(&m[..], b"lost once");
    tokio::time::timeout(T, tx.flush()).await.unwrap().unwrap();
    assert_eq!(w.drop_next.load(Ordering::SeqCst), 0);
    let st = c.stats().unwrap();
    let rtx: u64 = st.paths.iter().map(|p| p.stats.retransmits).sum();
    assert!(rtx >= 1, "no retransmission");
}

/// A `UringBackend` that records which tokio tasks handed it transmits.
#[cfg(target_os = "linux")]
#[derive(Debug)]
struct WatchedUring {
    inner: metaroce_tokio::backend::UringBackend,
    tasks: Mutex<HashSet<tokio::task::Id>>,
}

#[cfg(target_os = "linux")]
impl DatagramBackend for WatchedUring {
    forward_datagram_backend!([.inner] local_addr, source_ports, max_gso_segments,
        max_gro_segments, socket_recv_buffer, poll_recv, poll_recv_in_place, poll_send, flush,
        send_from_any_task);

    fn poll_send_owned(
        &self,
        cx: &mut Context<'_>,
        transmit: &Transmit,
        buf: &mut Vec<u8>,
    ) -> Poll<std::io::Result<()>> {
        if let Some(id) = tokio::task::try_id() {
            self.tasks.lock().unwrap().insert(id);
        }
        self.inner.poll_send_owned(cx, transmit, buf)
    }
}

/// Over io_uring too, the application task sends its packets itself, handing the backend
/// its buffers, and the ping-pong and a burst of 2,000 messages arrive complete and in
/// order (`UringBackend::send_from_any_task` used to be `false`: only the driver sent).
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uring_sends_leave_from_the_application_task() {
    let bind = || metaroce_tokio::backend::UringBackend::bind("127.0.0.1:0".parse().unwrap(), 8);
    let client_backend = Arc::new(WatchedUring {
        inner: bind().expect("io_uring backend"),
        tasks: Mutex::new(HashSet::default()),
    });
    let server = Endpoint::with_backend(bind().unwrap(), config(true)).unwrap();
    let client = Endpoint::with_backend(client_backend.clone(), config(true)).unwrap();
    let (c, s) = connect(&client, &server).await;
    client_backend.tasks.lock().unwrap().clear();
    let app = tokio::spawn(async move {
        ping_pong(&c, &s, 200).await;
        burst(&c, &s, 2000).await;
    });
    let app_id = app.id();
    app.await.unwrap();
    let tasks = client_backend.tasks.lock().unwrap().clone();
    assert!(
        tasks.contains(&app_id),
        "the application task never sent: {} other task(s) did",
        tasks.len()
    );
}
