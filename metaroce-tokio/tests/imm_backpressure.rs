//! The WRITE-with-immediate notification queue is bounded
//! (`TransportConfig::max_unconsumed_immediates`) with backpressure the peer understands:
//! a receiver that never calls `recv_imm` holds the sender's WRITEs with immediate back with
//! flow-control RNR NAKs — nothing is dropped, nothing fails, the queue does not grow — and
//! once it reads, every immediate arrives, in order, and every WRITE completes.

mod common;

use common::{connect, endpoints};
use metaroce_tokio::{Access, Config, WcStatus};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

const CAP: u32 = 8;
const WRITES: u32 = 64;
const LEN: u64 = 3000; // three packets at a 1024-byte path MTU
const T: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unread_immediate_queue_holds_the_sender_back_and_then_delivers_everything() {
    let mut cfg = Config::default();
    cfg.transport.max_unconsumed_immediates = CAP;
    cfg.transport.pmtu = 1024;
    let (server, client) = endpoints(cfg).await;
    let (conn, peer) = connect(&server, &client).await;

    let target = server.alloc(
        (LEN * WRITES as u64) as usize,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
    );
    let src: Vec<u8> = (0..LEN * WRITES as u64).map(|i| (i % 253) as u8).collect();
    let local = Arc::new(client.register(src.clone(), Access::LOCAL_WRITE));
    let remote = target.remote();

    // The sender posts every WRITE with immediate at once, in order: `join_all` polls the
    // futures in order, and each posts at its first poll (op ids follow posting order).
    let done = Arc::new(AtomicU32::new(0));
    let sender = {
        let (conn, local, done) = (conn.clone(), local.clone(), done.clone());
        tokio::spawn(async move {
            let futs = (0..WRITES).map(|i| {
                let (conn, local, done) = (&conn, &local, &done);
                let off = i as u64 * LEN;
                async move {
                    let wc = conn
                        .write_with_imm(local, off..off + LEN, remote, off, 0x1000 + i)
                        .await;
                    done.fetch_add(1, Ordering::Relaxed);
                    wc
                }
            });
            futures::future::join_all(futs).await
        })
    };

    // The receiver does not read. Give the sender ample time: at most the cap (plus what the
    // fence may release with the oldest operation) is reported, the rest wait.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let rs = peer.stats().unwrap().recv;
    let cs = conn.stats().unwrap();
    let completed = done.load(Ordering::Relaxed);
    println!(
        "unread: {} of {WRITES} WRITEs completed, {} immediates outstanding at the receiver, \
         {} flow-control RNR NAKs for immediates, {} no-buffer drops",
        completed, rs.unconsumed_immediates, rs.imm_flow_rnr_naks, rs.no_buffer_drops
    );
    assert!(
        rs.unconsumed_immediates <= 2 * CAP as u64,
        "queue grew past the bound: {rs:?}"
    );
    assert!(
        completed <= 2 * CAP,
        "{completed} WRITEs completed although the receiver read nothing"
    );
    assert!(completed < WRITES, "no backpressure at all");
    assert!(rs.imm_flow_rnr_naks > 0, "held back without RNR: {rs:?}");
    assert!(
        cs.paths.iter().all(|p| !p.failed),
        "a path failed under backpressure: {cs:?}"
    );

    // Now read: every immediate arrives, in posting order, and every WRITE succeeds.
    for i in 0..WRITES {
        let (imm, len) = tokio::time::timeout(T, peer.recv_imm())
            .await
            .expect("immediate not delivered")
            .expect("connection ended");
        assert_eq!((imm, len as u64), (0x1000 + i, LEN));
    }
    for wc in tokio::time::timeout(T, sender).await.unwrap().unwrap() {
        assert_eq!(wc.unwrap().status, WcStatus::Success);
    }
    assert_eq!(target.read(0, LEN * WRITES as u64).unwrap(), src);
    let rs = peer.stats().unwrap().recv;
    assert_eq!(rs.unconsumed_immediates, 0);
    println!(
        "after reading: {} flow-control RNR NAKs for immediates in all",
        rs.imm_flow_rnr_naks
    );
}
