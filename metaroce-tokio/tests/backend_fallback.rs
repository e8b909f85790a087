//! The io_uring backend's fallback to plain UDP, forced by configuration and by the
//! `METAROCE_IO_URING=0` environment variable (this file is its own process, so setting the
//! variable affects no other test).

use std::io;
use std::net::SocketAddr;

use metaroce_tokio::backend::{
    bind_backend, BackendKind, DatagramBackend, UringBackend, UringConfig, DISABLE_ENV,
};

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

#[tokio::test]
async fn disabled_config_is_unsupported_and_bind_backend_falls_back_to_udp() {
    let config = UringConfig {
        disabled: true,
        ..UringConfig::default()
    };
    let err = UringBackend::bind_with(loopback(), 2, &config).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::Unsupported);
    assert!(err.to_string().contains("io_uring unavailable"), "{err}");

    let bound = bind_backend(BackendKind::Uring, loopback(), 2, &config).unwrap();
    assert_eq!(bound.kind, BackendKind::Udp);
    let reason = bound.fallback_reason.expect("a fallback names its reason");
    assert!(reason.contains("turned off"), "{reason}");
    assert!(format!("{:?}", bound.backend).starts_with("UdpBackend"));
    assert_eq!(bound.backend.source_ports().len(), 2);
}

#[tokio::test]
async fn environment_variable_forces_the_fallback() {
    // SAFETY-free in edition 2021; this test binary has no other thread reading the
    // environment while it is written (the other test does not read it before binding,
    // and reading a value either way leads to the same UDP fallback for `disabled`).
    std::env::set_var(DISABLE_ENV, "0");
    let bound = bind_backend(BackendKind::Uring, loopback(), 1, &UringConfig::default()).unwrap();
    std::env::remove_var(DISABLE_ENV);
    assert_eq!(bound.kind, BackendKind::Udp);
    assert!(bound
        .fallback_reason
        .is_some_and(|r| r.contains(DISABLE_ENV)));
}

#[tokio::test]
async fn bind_errors_other_than_unsupported_are_not_hidden_by_the_fallback() {
    // Zero paths is a caller error for both backends: no silent fallback.
    let err = bind_backend(BackendKind::Uring, loopback(), 0, &UringConfig::default()).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
}

#[tokio::test]
async fn udp_kind_never_tries_io_uring() {
    let bound = bind_backend(BackendKind::Udp, loopback(), 1, &UringConfig::default()).unwrap();
    assert_eq!(bound.kind, BackendKind::Udp);
    assert!(bound.fallback_reason.is_none());
}
