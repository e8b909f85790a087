//! 100,000 connect/close cycles on one pair of endpoints over loopback: every driver-side
//! structure is freed and resident memory stays flat. Alone in its test binary, so that
//! no other test's memory shows in the process's VmRSS.

mod common;

use common::{connect, endpoints, rss_kib};
use metaroce_tokio::Config;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

/// `n` connect/close cycles on one pair of endpoints; the driver maps must be empty after
/// each, resident memory is printed and its growth bounded.
async fn cycles(n: usize) {
    let (server, client) = endpoints(Config::default()).await;
    // Warm up allocator pools and socket buffers before the first figure.
    for _ in 0..200 {
        let (c, s) = connect(&server, &client).await;
        c.close(1, b"");
        s.closed().await;
    }
    client.wait_idle().await;
    server.wait_idle().await;
    let before = rss_kib();
    let t0 = std::time::Instant::now();
    for i in 0..n {
        let (c, s) = connect(&server, &client).await;
        if i % 2 == 0 {
            c.close(1, b"cycle");
        } else {
            drop(c);
        }
        tokio::time::timeout(T, s.closed()).await.unwrap();
        drop(s);
        if i % 1000 == 999 {
            client.wait_idle().await;
            server.wait_idle().await;
            assert_eq!(client.driver_maps(), Default::default(), "cycle {i}");
            assert_eq!(server.driver_maps(), Default::default(), "cycle {i}");
        }
    }
    client.wait_idle().await;
    server.wait_idle().await;
    let after = rss_kib();
    println!(
        "{n} connect/close cycles in {:?}: VmRSS {before} KiB before, {after} KiB after \
         ({:+} KiB); client maps {:?}, server maps {:?}",
        t0.elapsed(),
        after as i64 - before as i64,
        client.driver_maps(),
        server.driver_maps()
    );
    assert_eq!(client.driver_maps(), Default::default());
    assert_eq!(server.driver_maps(), Default::default());
    // Flat: less than 8 bytes per cycle, plus 4 MiB of allocator slack.
    assert!(
        after <= before + 4096 + (n as u64 * 8) / 1024,
        "VmRSS grew from {before} to {after} KiB over {n} cycles"
    );
}

/// 100,000 cycles take about 9 s on loopback (test profile), so they run every time.
#[tokio::test]
async fn hundred_thousand_connect_close_cycles_free_everything() {
    cycles(100_000).await;
}
