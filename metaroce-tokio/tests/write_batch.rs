//! `Connection::write_batch`: many WRITEs posted under one lock with one completion
//! (a post list with selective signaling), over UDP on 127.0.0.1.

mod common;

use common::{batch, pair};
use metaroce::{Access, WcStatus};
use metaroce_tokio::{Config, Error};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_lands_every_write_and_resolves_once() {
    let (server, client, c, s) = pair(Config::default()).await;
    let n = 200u64;
    let len = 64u64;
    let data: Vec<u8> = (0..n * len).map(|i| (i % 251) as u8).collect();
    let src = client.register(data.clone(), Access::LOCAL_WRITE);
    let dst = server.alloc((n * len) as usize, Access::REMOTE_WRITE);
    c.write_batch(batch(&src, dst.remote(), n, len))
        .await
        .unwrap();
    assert_eq!(dst.read(0, n * len).unwrap(), data);
    assert_eq!(s.stats().unwrap().recv.write_bytes, n * len);
    // Nothing of the batch is left in the driver's maps.
    assert_eq!(client.driver_maps().waiters, 0);
    // An empty batch resolves at once.
    c.write_batch(Vec::new()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_longer_than_the_send_queue_is_posted_as_room_frees() {
    let mut cfg = Config::default();
    cfg.transport.max_outstanding_ops = 16;
    let (server, client, c, _s) = pair(cfg).await;
    let (n, len) = (100u64, 128u64);
    let data: Vec<u8> = (0..n * len).map(|i| (i % 249) as u8).collect();
    let src = client.register(data.clone(), Access::LOCAL_WRITE);
    let dst = server.alloc((n * len) as usize, Access::REMOTE_WRITE);
    tokio::time::timeout(
        Duration::from_secs(20),
        c.write_batch(batch(&src, dst.remote(), n, len)),
    )
    .await
    .expect("the batch never completed")
    .unwrap();
    assert_eq!(dst.read(0, n * len).unwrap(), data);
    assert_eq!(client.driver_maps().waiters, 0);
}

/// A WRITE the peer refuses (outside its region) fails the batch with that WRITE's
/// completion, the first such in posting order, reported after the others completed;
/// the others landed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_write_fails_the_batch_with_the_first_failed_completion() {
    let (server, client, c, _s) = pair(Config::default()).await;
    let len = 100u64;
    let src = client.register(vec![9u8; 1000], Access::LOCAL_WRITE);
    let dst = server.alloc(1000, Access::REMOTE_WRITE);
    c.write(&src, 0..1, dst.remote(), 0).await.unwrap();
    dst.write(0, &[0]).unwrap();
    let mut writes = batch(&src, dst.remote(), 10, len);
    // WRITEs 3 and 6 go past the end of the peer's region, with a descriptor that claims
    // a longer region (within the descriptor, a span past its end is refused before
    // anything is posted: `Error::RemoteOutOfBounds`), so the peer refuses them.
    let lying = metaroce_tokio::RemoteRegion {
        len: 2000,
        ..dst.remote()
    };
    for (i, off) in [(3, 950), (6, 990)] {
        writes[i].dst = lying;
        writes[i].dst_offset = off;
    }
    let e = c.write_batch(writes.clone()).await.unwrap_err();
    let Error::Completion(wc) = e else {
        panic!("expected a completion error, got {e:?}");
    };
    assert_eq!(wc.status, WcStatus::RemoteAccessError);
    assert_eq!(
        wc.wr_id, 3,
        "not the completion of WRITE 3 (its index in the batch)"
    );
    let seen = dst.read(0, 1000).unwrap();
    for (i, w) in writes.iter().enumerate() {
        if i == 3 || i == 6 {
            continue;
        }
        let r = w.dst_offset as usize..(w.dst_offset + len) as usize;
        assert!(seen[r].iter().all(|&b| b == 9), "WRITE {i} did not land");
    }
    assert_eq!(client.driver_maps().waiters, 0);
    // The connection goes on: a later batch succeeds.
    c.write_batch(batch(&src, dst.remote(), 5, len))
        .await
        .unwrap();
    assert_eq!(client.driver_maps().waiters, 0);
}

/// A bad argument anywhere in the batch fails it before anything is posted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_write_fails_the_batch_before_anything_is_posted() {
    let (server, client, c, s) = pair(Config::default()).await;
    let src = client.register(vec![1u8; 1000], Access::LOCAL_WRITE);
    let other = server.register(vec![1u8; 1000], Access::LOCAL_WRITE);
    let dst = server.alloc(1000, Access::REMOTE_WRITE);
    let mut writes = batch(&src, dst.remote(), 5, 100);
    writes[4].src = &other;
    let e = c.write_batch(writes).await.unwrap_err();
    assert!(matches!(e, Error::ForeignRegion), "{e:?}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(s.stats().unwrap().recv.write_bytes, 0, "a WRITE was posted");
    assert_eq!(client.driver_maps().waiters, 0);
}

/// Dropping the batch's future cancels what has not completed: no waiter is left, the
/// peer is told, and the connection carries a later batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_batch_cancels_its_writes() {
    let (server, client, c, s) = pair(Config::default()).await;
    let (n, len) = (32u64, 4u64 << 20);
    let src = client.alloc((n * len) as usize, Access::LOCAL_WRITE);
    let dst = server.alloc((n * len) as usize, Access::REMOTE_WRITE);
    let r = tokio::time::timeout(
        Duration::from_millis(20),
        c.write_batch(batch(&src, dst.remote(), n, len)),
    )
    .await;
    assert!(
        r.is_err(),
        "128 MiB of WRITEs finished in 20 ms: nothing to cancel"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let recv = s.stats().unwrap().recv;
    println!(
        "dropped batch: {} of {} bytes landed, {} op aborts at the peer",
        recv.write_bytes,
        n * len,
        recv.aborted_ops
    );
    assert!(recv.write_bytes < n * len, "the whole batch was sent");
    assert!(recv.aborted_ops >= 1, "the peer never heard of the cancel");
    assert_eq!(client.driver_maps().waiters, 0, "waiters left behind");
    c.write_batch(batch(&src, dst.remote(), 4, 1024))
        .await
        .unwrap();
    assert_eq!(client.driver_maps().waiters, 0);
}

/// The future can be spawned (it is `Send`), as `write`'s is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_can_run_on_a_spawned_task() {
    let (server, client, c, _s) = pair(Config::default()).await;
    let src = client.register(vec![3u8; 4096], Access::LOCAL_WRITE);
    let dst = server.alloc(4096, Access::REMOTE_WRITE);
    let remote = dst.remote();
    tokio::spawn(async move { c.write_batch(batch(&src, remote, 16, 256)).await })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(dst.read(0, 4096).unwrap(), vec![3u8; 4096]);
}
