//! An endpoint bound to the IPv6 wildcard (`[::]:0`, a dual-stack socket on Linux) reaches
//! an IPv4 server, as a UDP socket bound there does. The socket reports the server as
//! `::ffff:127.0.0.1`; before the core took that for the IPv4 address, the server's
//! answers matched no connection and the handshake timed out.

mod common;

use metaroce::Access;
use metaroce_tokio::{Config, Endpoint};

#[tokio::test]
async fn an_endpoint_on_the_ipv6_wildcard_connects_to_an_ipv4_server() {
    let client = Endpoint::bind("[::]:0".parse().unwrap(), Config::default())
        .await
        .unwrap();
    let server = Endpoint::bind("127.0.0.1:0".parse().unwrap(), Config::default())
        .await
        .unwrap();
    let connecting = client.connect(server.local_addr()).unwrap();
    let incoming = tokio::time::timeout(common::CONNECT_LIMIT, server.accept())
        .await
        .expect("no connection request reached the server")
        .expect("the server endpoint closed");
    assert_eq!(
        incoming.remote_addr().map(|a| a.ip()),
        Some("127.0.0.1".parse().unwrap())
    );
    let s = incoming.accept().unwrap();
    let c = tokio::time::timeout(common::CONNECT_LIMIT, connecting)
        .await
        .expect("the handshake did not complete")
        .unwrap();
    // Data both ways.
    let dst = server.alloc(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let src = client.register(vec![7u8; 4096], Access::LOCAL_WRITE);
    c.write(&src, 0..4096, dst.remote(), 0).await.unwrap();
    assert!(dst.read(0, 4096).unwrap().iter().all(|&b| b == 7));
    let back = client.alloc(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    s.write(&dst, 0..4096, back.remote(), 0).await.unwrap();
    assert!(back.read(0, 4096).unwrap().iter().all(|&b| b == 7));
    assert_eq!(c.remote_addr(), Some(server.local_addr()));
}
