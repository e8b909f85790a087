//! Cancellation of one-sided operations over UDP on 127.0.0.1: dropping a future (or a
//! timeout around it) cancels what was not sent, keeps what the transport may still
//! write into registered, and never lets a message land unreported.

mod common;

use bytes::Bytes;
use common::{pair, pair_with};
use metaroce::Access;
use metaroce_tokio::backend::{Impaired, Impairment, UdpBackend};
use metaroce_tokio::{Config, Endpoint};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_write_cancels_unsent_segments_and_a_later_write_succeeds() {
    let (_se, ce, c, s) = pair(Config::default()).await;
    let n: u64 = 64 << 20;
    let src = ce.alloc(n as usize, Access::LOCAL_WRITE);
    src.write(0, &vec![0xAB; n as usize]).unwrap();
    let dst = s
        .endpoint()
        .alloc(n as usize, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let r = tokio::time::timeout(
        Duration::from_millis(20),
        c.write(&src, 0..n, dst.remote(), 0),
    )
    .await;
    assert!(
        r.is_err(),
        "a 64 MiB WRITE finished in 20 ms: nothing to cancel"
    );
    // Give the abort time to reach the peer and any packets in flight time to land.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let recv = s.stats().unwrap().recv;
    println!(
        "cancelled WRITE: {} of {n} bytes landed, {} op aborts at the peer",
        recv.write_bytes, recv.aborted_ops
    );
    assert!(recv.write_bytes < n, "the whole WRITE was sent");
    assert_eq!(recv.aborted_ops, 1, "the peer never heard of the cancel");
    let landed = recv.write_bytes;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        s.stats().unwrap().recv.write_bytes,
        landed,
        "bytes of the cancelled WRITE still landing"
    );
    // The connection and the peer's op tracking are fine: a later WRITE succeeds.
    src.write(0, &[7u8; 1 << 20]).unwrap();
    let wc = c.write(&src, 0..1 << 20, dst.remote(), 0).await.unwrap();
    assert_eq!(wc.byte_len, 1 << 20);
    assert!(dst.read(0, 1 << 20).unwrap().iter().all(|&b| b == 7));
    // Only the record of what the later WRITE executed remains (the op-id parameter
    // history, issue #9): nothing of the cancelled op, no WRITE in progress.
    assert_eq!(s.stats().unwrap().recv.tracked_ops, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_atomic_keeps_its_result_region_until_the_core_finished_it() {
    // Every client packet takes 100 ms: the atomic is surely in flight when dropped.
    let imp = Impairment {
        delay: Duration::from_millis(100),
        ..Default::default()
    };
    let backend = Impaired::new(
        UdpBackend::bind("127.0.0.1:0".parse().unwrap(), 8).unwrap(),
        imp,
    )
    .unwrap();
    let client = Endpoint::with_backend(backend, Config::default()).unwrap();
    let (_se, ce, c, s) = pair_with(Config::default(), client).await;
    let counter = s.endpoint().alloc(8, Access::REMOTE_ATOMIC);
    let base = ce.registered_regions();
    let r = tokio::time::timeout(
        Duration::from_millis(10),
        c.fetch_add(counter.remote(), 0, 1),
    )
    .await;
    assert!(r.is_err());
    assert_eq!(
        ce.registered_regions(),
        base + 1,
        "the atomic's result region was freed while the atomic was in flight"
    );
    // The core finishes it (the abort or the response comes back); then it is released.
    let mut released = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if ce.registered_regions() == base {
            released = true;
            break;
        }
    }
    assert!(
        released,
        "result region of a cancelled atomic never released"
    );
    let v = u64::from_le_bytes(counter.read(0, 8).unwrap().try_into().unwrap());
    assert!(v <= 1, "executed more than once: {v}");
    // Later atomics work.
    let old = c.fetch_add(counter.remote(), 0, 10).await.unwrap();
    assert_eq!(old, v);
    assert_eq!(ce.registered_regions(), base);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timed_out_recv_into_is_withdrawn_and_the_message_takes_the_next_receive() {
    let (_se, _ce, c, s) = pair(Config::default()).await;
    let buf = s.endpoint().alloc(8192, Access::LOCAL_WRITE);
    let r = tokio::time::timeout(Duration::from_millis(50), s.recv_into(5, &buf, 0..4096)).await;
    assert!(r.is_err(), "no message was sent");
    // Bounded: on the old code the message landed in the abandoned buffer and this
    // receive never completed.
    let (got, sent) = tokio::time::timeout(Duration::from_secs(5), async {
        tokio::join!(
            s.recv_into(5, &buf, 4096..8192),
            c.send(5, Bytes::from(vec![9u8; 3000]))
        )
    })
    .await
    .expect("the message did not reach the next posted receive");
    sent.unwrap();
    let wc = got.unwrap();
    assert_eq!(wc.byte_len, 3000);
    let mem = buf.read(0, 8192).unwrap();
    assert!(
        mem[..4096].iter().all(|&b| b == 0),
        "the message landed in the abandoned buffer"
    );
    assert!(mem[4096..7096].iter().all(|&b| b == 9));
    assert!(s.take_cancelled_recv().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recv_into_dropped_while_a_message_lands_reports_the_message() {
    let (_se, _ce, c, s) = pair(Config::default()).await;
    let n = 32usize << 20;
    let buf = s.endpoint().alloc(n, Access::LOCAL_WRITE);
    let mut recv = Box::pin(s.recv_into(1, &buf, 0..n as u64));
    // Post the receive before the first packet can arrive (else the message would go to
    // a MessageStream, as messages that began before any receive was posted do).
    tokio::select! {
        r = &mut recv => panic!("receive completed with nothing sent: {r:?}"),
        _ = tokio::time::sleep(Duration::from_millis(10)) => {}
    }
    let sender = {
        let c = c.clone();
        tokio::spawn(async move { c.send(1, Bytes::from(vec![3u8; n])).await })
    };
    // Poll the receive until the message has begun landing, then drop it.
    let mut landing = false;
    for _ in 0..5000 {
        tokio::select! {
            r = &mut recv => panic!("32 MiB arrived before the test could drop the receive: {r:?}"),
            _ = tokio::time::sleep(Duration::from_micros(200)) => {}
        }
        if s.stats().unwrap().recv.buffered_messages > 0 {
            landing = true;
            break;
        }
    }
    assert!(landing, "the message never began landing");
    drop(recv);
    sender.await.unwrap().unwrap();
    let mut reported = None;
    for _ in 0..100 {
        if let Some(r) = s.take_cancelled_recv() {
            reported = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let r = reported.expect("a message landed in a dropped recv_into and was not reported");
    assert_eq!((r.stream, r.lkey, r.offset), (1, buf.keys().lkey, 0));
    assert_eq!(r.wc.byte_len as usize, n);
    assert!(buf.read(0, n as u64).unwrap().iter().all(|&b| b == 3));
}
