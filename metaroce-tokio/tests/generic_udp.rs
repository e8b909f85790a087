//! The generic workload (`metaroce/tests/generic/workload.rs`, the same source file the
//! verbs backend runs in the rdma_rxe guest) over this crate's UDP backend: on clean
//! loopback, and through the impairment layer (1 % loss; reordering; both, with
//! duplication), so the trait-level contract holds when the network is hostile; and the
//! shared error checks (`metaroce/tests/generic/errors.rs`): remote access errors for
//! every missing right and forged rkeys, flush on close, and (UDP only: the impairment
//! layer cuts the network) `RetryExceeded` through the traits.

#[path = "../../metaroce/tests/generic/workload.rs"]
mod workload;

#[path = "../../metaroce/tests/generic/errors.rs"]
mod errors;

use metaroce::api::{OpError, RdmaConnection, RdmaEndpoint};
use metaroce::{Access, ConnectionError, WcStatus};
use metaroce_tokio::backend::{ImpairStats, Impaired, Impairment, UdpBackend};
use metaroce_tokio::{Config, Endpoint};
use std::sync::Arc;
use std::time::Duration;
use workload::{Params, Report};

async fn udp() -> Endpoint {
    Endpoint::bind("127.0.0.1:0".parse().unwrap(), Config::default())
        .await
        .unwrap()
}

/// An endpoint whose datagrams (both directions: each side impairs what it sends) go
/// through `imp`; path MTU 1024 so that the workload is a few thousand packets.
fn impaired(imp: Impairment) -> (Endpoint, Arc<Impaired<UdpBackend>>) {
    let mut config = Config::default();
    config.transport.pmtu = 1024;
    let ports = config.transport.paths as usize + config.spare_ports;
    let udp = UdpBackend::bind("127.0.0.1:0".parse().unwrap(), ports).unwrap();
    let backend = Arc::new(Impaired::new(udp, imp).unwrap());
    (
        Endpoint::with_backend(backend.clone(), config).unwrap(),
        backend,
    )
}

/// A heavier workload for the impaired runs: 2 x 64 messages, a 1 MiB region.
fn heavy() -> Params {
    Params {
        messages_per_stream: 64,
        region_len: 1 << 20,
        ..Params::default()
    }
}

/// Run the heavy workload between two impaired endpoints and check that the impairment
/// really hit it (datagrams dropped / reordered / duplicated), printing the figures.
async fn impaired_run(name: &str, imp: impl Fn(u64) -> Impairment) -> [ImpairStats; 2] {
    let (server, sb) = impaired(imp(1));
    let (client, cb) = impaired(imp(2));
    let r = workload::run(&heavy(), &server, &client).await.unwrap();
    assert_eq!(r.access_errors, 2);
    print(name, &r, &server, &client);
    let st = [sb.stats(), cb.stats()];
    println!("{name}: impairment server {:?}", st[0]);
    println!("{name}: impairment client {:?}", st[1]);
    st
}

fn print(name: &str, r: &Report, server: &Endpoint, client: &Endpoint) {
    let (s, c) = (server.stats(), client.stats());
    println!("{name}: {r:?}");
    println!("{name}: server {s:?}");
    println!("{name}: client {c:?}");
}

#[tokio::test]
async fn workload_over_udp_loopback() {
    let (server, client) = (udp().await, udp().await);
    let r = workload::run(&Params::default(), &server, &client)
        .await
        .unwrap();
    assert_eq!(r.access_errors, 2);
    assert_eq!(r.atomics, 4);
    print("clean", &r, &server, &client);
}

/// Receive windows of two messages per stream: the streams' senders wait for the server's
/// reader (flow-control RNR), and since the workload feeds and reads each stream in its own
/// future, one stream waiting never blocks the other.
#[tokio::test]
async fn workload_with_small_stream_windows() {
    let mk = || async {
        let mut config = Config::default();
        config.transport.max_stream_recv_bytes = 32 * 1024;
        Endpoint::bind("127.0.0.1:0".parse().unwrap(), config)
            .await
            .unwrap()
    };
    let (server, client) = (mk().await, mk().await);
    let r = workload::run(&heavy(), &server, &client).await.unwrap();
    assert_eq!(r.access_errors, 2);
    print("small windows", &r, &server, &client);
}

/// Same workload on a multi-threaded runtime: the trait futures are `Send`, and the two
/// sides may be polled from different worker threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workload_spawned_on_a_multi_thread_runtime() {
    let (server, client) = (udp().await, udp().await);
    let r = tokio::spawn(async move { workload::run(&Params::default(), &server, &client).await })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(r.access_errors, 2);
}

#[tokio::test]
async fn workload_with_one_percent_loss() {
    let st = impaired_run("loss 1%", |seed| Impairment {
        loss: 0.01,
        seed,
        ..Impairment::default()
    })
    .await;
    assert!(
        st[0].dropped + st[1].dropped > 0,
        "the loss hit the workload"
    );
}

#[tokio::test]
async fn workload_with_reordering() {
    let st = impaired_run("reorder 20%", |seed| Impairment {
        reorder: 0.2,
        reorder_delay: Duration::from_millis(2),
        seed,
        ..Impairment::default()
    })
    .await;
    assert!(st[0].reordered + st[1].reordered > 0);
}

#[tokio::test]
async fn workload_with_loss_reordering_and_duplicates() {
    let st = impaired_run("loss 1% + reorder 10% + dup 1%", |seed| Impairment {
        loss: 0.01,
        duplicate: 0.01,
        reorder: 0.1,
        reorder_delay: Duration::from_millis(1),
        jitter: Duration::from_micros(200),
        seed,
        ..Impairment::default()
    })
    .await;
    let sum = |f: fn(&ImpairStats) -> u64| f(&st[0]) + f(&st[1]);
    assert!(sum(|s| s.dropped) > 0 && sum(|s| s.duplicated) > 0 && sum(|s| s.reordered) > 0);
}

#[tokio::test]
async fn access_errors_map_to_remote_access_error() {
    let (server, client) = (udp().await, udp().await);
    let n = errors::access_rights(&Params::default(), &server, &client)
        .await
        .unwrap();
    assert_eq!(n, 6);
}

#[tokio::test]
async fn local_errors_are_values() {
    let (server, client) = (udp().await, udp().await);
    let n = errors::local_errors(&Params::default(), &server, &client)
        .await
        .unwrap();
    assert_eq!(n, 9);
}

#[tokio::test]
async fn access_errors_under_loss_and_reordering() {
    let imp = |seed| Impairment {
        loss: 0.05,
        reorder: 0.1,
        reorder_delay: Duration::from_millis(1),
        duplicate: 0.02,
        seed,
        ..Impairment::default()
    };
    let ((server, _), (client, _)) = (impaired(imp(41)), impaired(imp(42)));
    let n = errors::access_rights(&Params::default(), &server, &client)
        .await
        .unwrap();
    assert_eq!(n, 6);
}

/// Close drains for `close_timeout`, then flushes: with the network cut right after the
/// WRITEs were posted (nothing can complete; the runtime is single-threaded, so the driver
/// cannot run between the post and the cut), every WRITE is flushed (`WrFlushError`), which
/// metaroce-tokio reports as the connection's end with its reason
/// (`ConnectionLost(LocallyClosed)`), as a stream does.
#[tokio::test]
async fn operations_pending_at_close_are_flushed() {
    let mk = |seed| {
        let mut config = Config::default();
        config.transport.close_timeout = Duration::from_millis(100);
        let ports = config.transport.paths as usize + config.spare_ports;
        let udp = UdpBackend::bind("127.0.0.1:0".parse().unwrap(), ports).unwrap();
        let imp = Impairment {
            seed,
            ..Impairment::default()
        };
        let backend = Arc::new(Impaired::new(udp, imp).unwrap());
        (
            Endpoint::with_backend(backend.clone(), config).unwrap(),
            backend,
        )
    };
    let ((server, sb), (client, cb)) = (mk(61), mk(62));
    let cut = || {
        let dead = Impairment {
            loss: 1.0,
            ..Impairment::default()
        };
        sb.set_impairment(dead.clone()).unwrap();
        cb.set_impairment(dead).unwrap();
    };
    let f = errors::flush_on_close(&Params::default(), &server, &client, 32, 1 << 20, cut)
        .await
        .unwrap();
    println!("32 x 1 MiB WRITEs, network cut, closed: {f:?}");
    assert_eq!(f.connection_ended, 32, "{f:?}");
}

/// Without a cut most of the WRITEs drain before the close completes; all resolve.
#[tokio::test]
async fn operations_pending_at_a_graceful_close_all_resolve() {
    let (server, client) = (udp().await, udp().await);
    let f = errors::flush_on_close(&Params::default(), &server, &client, 32, 1 << 20, || {})
        .await
        .unwrap();
    println!("32 x 1 MiB WRITEs, closed after posting: {f:?}");
    assert_eq!(f.completed + f.flushed + f.connection_ended, 32);
}

/// The network fails under a connection with a WRITE outstanding: through the traits the
/// WRITE fails with `IBV_WC_RETRY_EXC_ERR` (or an error naming the connection's end by
/// `RetryExceeded`), and `closed()` says `RetryExceeded`.
#[tokio::test]
async fn a_dead_network_gives_retry_exceeded() {
    let mk = |seed| {
        let mut config = Config::default();
        config.transport.retry_count = 4;
        config.transport.max_rto = Duration::from_millis(20);
        config.transport.idle_timeout = None;
        config.transport.keepalive_interval = None;
        let ports = config.transport.paths as usize + config.spare_ports;
        let udp = UdpBackend::bind("127.0.0.1:0".parse().unwrap(), ports).unwrap();
        let imp = Impairment {
            seed,
            ..Impairment::default()
        };
        let backend = Arc::new(Impaired::new(udp, imp).unwrap());
        (
            Endpoint::with_backend(backend.clone(), config).unwrap(),
            backend,
        )
    };
    let ((server, sb), (client, cb)) = (mk(51), mk(52));
    let p = Params::default();
    let (conn, peer) = workload::pair(&p, &server, &client).await.unwrap();
    let target =
        RdmaEndpoint::alloc(&server, 1 << 16, Access::LOCAL_WRITE | Access::REMOTE_WRITE).unwrap();
    let src = RdmaEndpoint::alloc(&client, 1 << 16, Access::LOCAL_WRITE).unwrap();
    // The path works, then every datagram in both directions is lost.
    RdmaConnection::write(&conn, &src, 0..1 << 16, target.remote(), 0)
        .await
        .unwrap();
    let dead = Impairment {
        loss: 1.0,
        ..Impairment::default()
    };
    sb.set_impairment(dead.clone()).unwrap();
    cb.set_impairment(dead).unwrap();
    let r = tokio::time::timeout(
        Duration::from_secs(30),
        RdmaConnection::write(&conn, &src, 0..1 << 16, target.remote(), 0),
    )
    .await
    .expect("the WRITE fails within the retry budget");
    let e = r.expect_err("a WRITE over a dead network succeeded");
    assert!(
        e.wc_status() == Some(WcStatus::RetryExceeded)
            || e.connection_error() == Some(ConnectionError::RetryExceeded),
        "{e:?}"
    );
    let why = RdmaConnection::closed(&conn).await;
    assert_eq!(why, ConnectionError::RetryExceeded);
    println!(
        "dead network: WRITE failed with {e} (status {:?})",
        e.wc_status()
    );
    drop(peer);
}
