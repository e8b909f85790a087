//! Helpers shared by metaroce-tokio's integration tests.
#![allow(dead_code)]

use metaroce_tokio::{Config, Connection, Endpoint};
use std::time::Duration;

/// How long a test waits for a handshake step before it fails (a guard against a hang,
/// not a timing assertion).
pub const CONNECT_LIMIT: Duration = Duration::from_secs(10);

/// A server endpoint with `cfg` on 127.0.0.1, and `client` connected to it: (server,
/// client, the client's connection, the server's).
pub async fn pair_with(
    cfg: Config,
    client: Endpoint,
) -> (Endpoint, Endpoint, Connection, Connection) {
    let server = Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    let (c, s) = connect(&server, &client).await;
    (server, client, c, s)
}

/// Two endpoints with `cfg` on 127.0.0.1, connected: (server, client, the client's
/// connection, the server's).
pub async fn pair(cfg: Config) -> (Endpoint, Endpoint, Connection, Connection) {
    let client = Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg.clone())
        .await
        .unwrap();
    pair_with(cfg, client).await
}

/// A server and a client endpoint, both with `cfg`, on 127.0.0.1: (server, client).
pub async fn endpoints(cfg: Config) -> (Endpoint, Endpoint) {
    let server = Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg.clone())
        .await
        .unwrap();
    let client = Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    (server, client)
}

/// Connect `client` to `server`: (the client's connection, the server's). The request
/// must come from the client's IP.
pub async fn connect(server: &Endpoint, client: &Endpoint) -> (Connection, Connection) {
    let connecting = client.connect(server.local_addr()).unwrap();
    let incoming = tokio::time::timeout(CONNECT_LIMIT, server.accept())
        .await
        .expect("no connection request")
        .expect("the server endpoint closed");
    assert_eq!(
        incoming.remote_addr().map(|a| a.ip()),
        Some(client.local_addr().ip())
    );
    let s = incoming.accept().unwrap();
    let c = tokio::time::timeout(CONNECT_LIMIT, connecting)
        .await
        .expect("the handshake did not complete")
        .unwrap();
    (c, s)
}

/// This process's resident memory (VmRSS) in KiB; 0 where /proc does not tell.
pub fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// `n` WRITEs of `len` bytes from `src` into `dst` for `Connection::write_batch`, WRITE i
/// at offset i·len of both.
pub fn batch<'a>(
    src: &'a metaroce_tokio::MemoryRegion,
    dst: metaroce_tokio::RemoteRegion,
    n: u64,
    len: u64,
) -> Vec<metaroce_tokio::BatchWrite<'a>> {
    (0..n)
        .map(|i| metaroce_tokio::BatchWrite {
            src,
            range: i * len..(i + 1) * len,
            dst,
            dst_offset: i * len,
            imm: None,
        })
        .collect()
}
