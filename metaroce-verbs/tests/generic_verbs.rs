//! The shared generic workload (`metaroce/tests/generic/`, written once against the
//! `metaroce::api` traits and run over UDP by metaroce-tokio's `tests/generic_udp.rs`) over
//! verbs: two `VerbsEndpoint`s on one RDMA device (rdma_rxe loopback in the CI guest, TCP
//! on 127.0.0.1). Without a device the tests print "skipped" and pass, unless
//! `METAROCE_VERBS_REQUIRE_DEVICE=1` (set by `run-rxe-tests.sh`).

#[path = "../../metaroce/tests/generic/errors.rs"]
mod errors;
#[path = "../../metaroce/tests/generic/workload.rs"]
mod workload;

use metaroce_verbs::{Context, QpConfig, VerbsEndpoint};

fn endpoints() -> Option<(VerbsEndpoint, VerbsEndpoint)> {
    endpoints_with(u32::MAX)
}

/// Two endpoints; the server's connections keep at most `server_max_streams` streams.
fn endpoints_with(server_max_streams: u32) -> Option<(VerbsEndpoint, VerbsEndpoint)> {
    let ctx = match Context::open(std::env::var("METAROCE_VERBS_DEVICE").ok().as_deref()) {
        Ok(c) => c,
        Err(e) => {
            if std::env::var("METAROCE_VERBS_REQUIRE_DEVICE").is_ok_and(|v| v == "1") {
                panic!("METAROCE_VERBS_REQUIRE_DEVICE=1 but no device: {e}");
            }
            eprintln!("skipped: {e}");
            return None;
        }
    };
    let cfg = QpConfig {
        slot_size: 16 * 1024,
        ..QpConfig::default()
    };
    let addr = "127.0.0.1:0".parse().unwrap();
    let scfg = QpConfig {
        max_streams: server_max_streams,
        ..cfg.clone()
    };
    let s = VerbsEndpoint::bind(&ctx, addr, scfg).expect("bind server");
    let c = VerbsEndpoint::bind(&ctx, addr, cfg).expect("bind client");
    Some((s, c))
}

#[tokio::test]
async fn generic_workload_over_verbs() {
    let Some((server, client)) = endpoints() else {
        return;
    };
    let p = workload::Params::default();
    let r = workload::run(&p, &server, &client).await.unwrap();
    println!("{r:?}");
    assert_eq!(r.access_errors, 2);
}

#[tokio::test]
async fn generic_access_rights_over_verbs() {
    let Some((server, client)) = endpoints() else {
        return;
    };
    let p = workload::Params::default();
    assert_eq!(
        errors::access_rights(&p, &server, &client).await.unwrap(),
        6
    );
}

#[tokio::test]
async fn generic_flush_on_close_over_verbs() {
    let Some((server, client)) = endpoints() else {
        return;
    };
    let p = workload::Params::default();
    let f = errors::flush_on_close(&p, &server, &client, 32, 1 << 20, || {})
        .await
        .unwrap();
    println!("{f:?}");
    assert_eq!(f.completed + f.flushed + f.connection_ended, 32);
}

/// The same bad-application-input checks as metaroce-tokio's `generic_udp.rs`: copies out
/// of range (offsets and lengths near `u64::MAX`), reversed and too long local ranges, and
/// an MR of another endpoint's PD are error values (no status or a local one), never
/// panics, and change nothing.
#[tokio::test]
async fn generic_local_errors_over_verbs() {
    let Some((server, client)) = endpoints() else {
        return;
    };
    let p = workload::Params::default();
    assert_eq!(errors::local_errors(&p, &server, &client).await.unwrap(), 9);
}

/// A peer that opens more streams than `max_streams` cannot make the receiver hold more:
/// the receiver closes the connection with `CLOSE_STREAM_LIMIT`, which the opener sees as
/// `ClosedByPeer`; the receiver's own `open_stream` beyond the limit is an error value.
#[tokio::test]
async fn peer_beyond_max_streams_is_closed_not_buffered() {
    use futures::SinkExt;
    use metaroce::api::RdmaConnection;
    use metaroce::ConnectionError;
    let Some((server, client)) = endpoints_with(4) else {
        return;
    };
    let p = workload::Params::default();
    let (conn, peer) = workload::pair(&p, &server, &client).await.unwrap();
    // The server side refuses a fifth local stream once four are open.
    let mine: Vec<_> = (0..4).map(|_| peer.open_stream().unwrap()).collect();
    assert!(peer.open_stream().is_err(), "fifth local stream refused");
    drop(mine);
    let mut opened = Vec::new();
    for i in 0..8u8 {
        // After the server's close record arrived, opening is refused too.
        let Ok(mut s) = conn.open_stream() else {
            assert!(i > 4, "open_stream {i} failed before the limit");
            break;
        };
        // Once the server has closed, sends fail; that is the expected end.
        let r = tokio::time::timeout(p.step_timeout, s.send(bytes::Bytes::from(vec![i; 8])))
            .await
            .expect("send did not finish");
        opened.push((s, r.is_ok()));
    }
    let e = tokio::time::timeout(p.step_timeout, conn.closed())
        .await
        .expect("client connection not closed");
    match e {
        ConnectionError::ClosedByPeer { code, .. } => {
            assert_eq!(code, metaroce_verbs::CLOSE_STREAM_LIMIT)
        }
        other => panic!("expected ClosedByPeer(CLOSE_STREAM_LIMIT), got {other:?}"),
    }
    let mut accepted = 0;
    while let Some(_s) = tokio::time::timeout(p.step_timeout, peer.accept_stream())
        .await
        .expect("accept_stream did not end after the close")
    {
        accepted += 1;
    }
    println!(
        "sends ok: {}, accepted by the server: {accepted}",
        opened.iter().filter(|(_, ok)| *ok).count()
    );
    assert!(accepted <= 4, "server accepted {accepted} > max_streams 4");
}
