//! Liveness: keepalives keep an idle connection with a live peer up; a dead peer is
//! reported within the idle timeout, idle or not (issue #10, item 2). Virtual time.

use bytes::Bytes;
use metaroce::testing::{Impair, Pair};
use metaroce::{ConnectionError, Event, WcStatus, WriteRequest};
use std::time::Duration;

fn lost(p: &Pair, side: usize) -> Option<ConnectionError> {
    p.events[side].iter().find_map(|e| match e {
        Event::ConnectionLost { reason, .. } => Some(reason.clone()),
        _ => None,
    })
}

#[test]
fn idle_connection_with_live_peer_stays_up() {
    let mut p = Pair::impaired(11, Impair::default());
    let (a, b) = p.connect();
    let before = p.eps[0].connection_stats(a).unwrap().acks_received;
    p.run_until(Duration::from_secs(120), |_| false);
    assert!(p.eps[0].is_established(a) && p.eps[1].is_established(b));
    assert_eq!(lost(&p, 0), None);
    assert_eq!(lost(&p, 1), None);
    let after = p.eps[0].connection_stats(a).unwrap().acks_received;
    // Keepalives were answered (about one per 3 s of silence from either side).
    println!(
        "ACKs answering keepalives in 120 s idle: {}",
        after - before
    );
    assert!(after - before >= 10, "{}", after - before);
    // And the connection still works.
    p.eps[0]
        .post_send(a, 1, 1, Bytes::from_static(b"still here"))
        .unwrap();
    assert!(p.run_until(Duration::from_secs(121), |p| p.events[1]
        .iter()
        .any(|e| matches!(e, Event::Message { .. }))));
}

#[test]
fn dead_peer_on_idle_connection_is_reported_within_idle_timeout() {
    let mut p = Pair::impaired(12, Impair::default());
    let (_a, _b) = p.connect();
    p.run_until(Duration::from_secs(1), |_| false);
    // The peer dies: nothing more arrives from it (and nothing reaches it).
    p.impair.blackhole = true;
    let t0 = p.now;
    assert!(p.run_until(Duration::from_secs(60), |p| lost(p, 0).is_some()));
    let took = p.now - t0;
    println!("idle connection, dead peer reported after {took:?}");
    assert_eq!(lost(&p, 0), Some(ConnectionError::IdleTimeout));
    // Counted from the last packet heard, which may land one link delay after the cut.
    assert!(took <= Duration::from_secs(10) + p.delay, "{took:?}");
}

#[test]
fn dead_peer_fails_pending_operations_in_bounded_time() {
    let mut p = Pair::impaired(13, Impair::default());
    let (a, _b) = p.connect();
    let mr = p.eps[0].register_mr(vec![7; 1 << 20], metaroce::Access::LOCAL_WRITE);
    let remote = p.eps[1].register_mr(vec![0; 1 << 20], metaroce::Access::REMOTE_WRITE);
    p.run_until(Duration::from_millis(100), |_| false);
    p.impair.blackhole = true;
    let t0 = p.now;
    p.eps[0]
        .post_write(
            a,
            WriteRequest {
                wr_id: 1,
                lkey: mr.lkey,
                local_offset: 0,
                len: 1 << 20,
                remote_addr: remote.addr,
                rkey: remote.rkey,
                imm: None,
            },
        )
        .unwrap();
    p.eps[0]
        .post_send(a, 3, 2, Bytes::from_static(b"x"))
        .unwrap();
    assert!(p.run_until(Duration::from_secs(60), |p| lost(p, 0).is_some()));
    let took = p.now - t0;
    let reason = lost(&p, 0).unwrap();
    println!("pending operations, dead peer: {reason:?} after {took:?}");
    let st: Vec<WcStatus> = p.events[0]
        .iter()
        .filter_map(|e| match e {
            Event::Completion { wc, .. } => Some(wc.status),
            _ => None,
        })
        .collect();
    assert_eq!(st.len(), 2);
    assert_ne!(st[0], WcStatus::Success);
    assert_eq!(st[1], WcStatus::WrFlushError);
    // Never later than the idle timeout.
    assert!(took <= Duration::from_secs(10), "{took:?}");
}

#[test]
fn forged_looking_keepalive_only_draws_one_ack() {
    // A keepalive for a path the connection does not have is ignored; one for a real path
    // draws exactly one ACK and moves nothing else.
    let mut p = Pair::impaired(14, Impair::default());
    let (a, b) = p.connect();
    p.eps[0]
        .post_send(a, 1, 1, Bytes::from_static(b"m"))
        .unwrap();
    p.run_until(Duration::from_millis(10), |_| false);
    let s0 = p.eps[1].connection_stats(b).unwrap();
    p.run_until(Duration::from_millis(3_100), |_| false);
    let s1 = p.eps[1].connection_stats(b).unwrap();
    // Keepalives in both directions, each answered once: a handful of ACKs, no storm.
    assert!(
        s1.acks_sent - s0.acks_sent <= 4,
        "{} ACKs",
        s1.acks_sent - s0.acks_sent
    );
    assert_eq!(s1.recv.messages, s0.recv.messages);
}
