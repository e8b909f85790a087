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
    let connecting = client.connect(server.local_addr()).unwrap();
    let s = tokio::time::timeout(CONNECT_LIMIT, server.accept())
        .await
        .expect("no connection request")
        .expect("the server endpoint closed")
        .accept()
        .unwrap();
    let c = tokio::time::timeout(CONNECT_LIMIT, connecting)
        .await
        .expect("the handshake did not complete")
        .unwrap();
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
