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
    let s = VerbsEndpoint::bind(&ctx, addr, cfg.clone()).expect("bind server");
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
