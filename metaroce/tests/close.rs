//! Connection close: graceful drain with a code and reason, abort, MR_CLOSE retransmission,
//! and per-connection state freed (issue #10, item 1). Virtual time, in-memory pair.

use bytes::Bytes;
use metaroce::testing::{Impair, Pair};
use metaroce::{ConnectionError, Event, PostError, TableSizes, WcStatus, MAX_CLOSE_REASON};
use std::time::Duration;

fn lost(p: &Pair, side: usize) -> Option<ConnectionError> {
    p.events[side].iter().find_map(|e| match e {
        Event::ConnectionLost { reason, .. } => Some(reason.clone()),
        _ => None,
    })
}

fn statuses(p: &Pair, side: usize) -> Vec<WcStatus> {
    p.events[side]
        .iter()
        .filter_map(|e| match e {
            Event::Completion { wc, .. } => Some(wc.status),
            _ => None,
        })
        .collect()
}

fn messages(p: &Pair, side: usize) -> usize {
    p.events[side]
        .iter()
        .filter(|e| matches!(e, Event::Message { .. }))
        .count()
}

#[test]
fn graceful_close_drains_then_peer_sees_code_and_reason() {
    let mut p = Pair::impaired(1, Impair::default());
    let (a, _b) = p.connect();
    for i in 0..20u64 {
        p.eps[0]
            .post_send(a, 1, i, Bytes::from(vec![i as u8; 10_000]))
            .unwrap();
    }
    p.eps[0].close_with(p.now, a, 42, b"bye now").unwrap();
    // No new posts while draining.
    assert_eq!(
        p.eps[0].post_send(a, 1, 99, Bytes::from_static(b"late")),
        Err(PostError::Closing)
    );
    let done = p.run_until(Duration::from_secs(5), |p| lost(p, 1).is_some());
    assert!(done, "peer never saw the close: {:?}", p.events[1]);
    // Every SEND posted before the close was delivered and completed with success.
    assert_eq!(messages(&p, 1), 20);
    assert_eq!(statuses(&p, 0), vec![WcStatus::Success; 20]);
    assert_eq!(lost(&p, 0), Some(ConnectionError::LocallyClosed));
    assert_eq!(
        lost(&p, 1),
        Some(ConnectionError::ClosedByPeer {
            code: 42,
            reason: Bytes::from_static(b"bye now")
        })
    );
    // The close was answered: nothing left on either side.
    p.run_until(Duration::from_secs(10), |_| false);
    assert_eq!(p.eps[0].table_sizes().closers, 0);
    assert_eq!(p.eps[0].table_sizes().connections, 0);
    assert_eq!(p.eps[1].table_sizes().connections, 0);
}

#[test]
fn close_reason_is_bounded() {
    let mut p = Pair::impaired(2, Impair::default());
    let (a, _b) = p.connect();
    let long = vec![b'x'; MAX_CLOSE_REASON + 1];
    assert_eq!(
        p.eps[0].close_with(p.now, a, 1, &long),
        Err(PostError::ReasonTooLong {
            len: MAX_CLOSE_REASON + 1,
            max: MAX_CLOSE_REASON
        })
    );
    assert!(
        p.eps[0].is_established(a),
        "a refused close must change nothing"
    );
    assert_eq!(
        p.eps[0].abort(p.now, a, 1, &long),
        Err(PostError::ReasonTooLong {
            len: MAX_CLOSE_REASON + 1,
            max: MAX_CLOSE_REASON
        })
    );
    let max = vec![b'y'; MAX_CLOSE_REASON];
    p.eps[0].close_with(p.now, a, 7, &max).unwrap();
    assert!(p.run_until(Duration::from_secs(5), |p| lost(p, 1).is_some()));
    assert_eq!(
        lost(&p, 1),
        Some(ConnectionError::ClosedByPeer {
            code: 7,
            reason: Bytes::from(max)
        })
    );
}

#[test]
fn close_drain_is_bounded_by_close_timeout() {
    let mut p = Pair::impaired(3, Impair::default());
    let (a, _b) = p.connect();
    p.eps[0]
        .post_send(a, 1, 1, Bytes::from(vec![1; 5000]))
        .unwrap();
    // The network dies: the SEND cannot drain.
    p.impair.blackhole = true;
    let t0 = p.now;
    p.eps[0].close_with(p.now, a, 5, b"").unwrap();
    assert!(p.run_until(Duration::from_secs(30), |p| lost(p, 0).is_some()));
    let took = p.now - t0;
    println!("close with a dead network ended after {took:?}");
    assert_eq!(lost(&p, 0), Some(ConnectionError::LocallyClosed));
    assert_eq!(statuses(&p, 0), vec![WcStatus::WrFlushError]);
    // The drain ends at close_timeout (2 s by default), not at retry exhaustion.
    assert!(took <= Duration::from_millis(2001), "{took:?}");
}

#[test]
fn abort_is_immediate_and_close_is_retransmitted() {
    let mut p = Pair::impaired(4, Impair::default());
    let (a, _b) = p.connect();
    p.eps[0]
        .post_send(a, 1, 1, Bytes::from(vec![1; 50_000]))
        .unwrap();
    // The first copies of the MR_CLOSE are lost.
    p.impair.blackhole = true;
    p.eps[0].abort(p.now, a, 9, b"abort").unwrap();
    p.flush();
    assert_eq!(statuses(&p, 0), vec![WcStatus::WrFlushError]);
    assert_eq!(lost(&p, 0), Some(ConnectionError::LocallyClosed));
    assert_eq!(p.eps[0].table_sizes().closers, 1);
    p.run_until(Duration::from_millis(3), |_| false);
    p.impair.blackhole = false;
    assert!(p.run_until(Duration::from_secs(5), |p| lost(p, 1).is_some()));
    assert_eq!(
        lost(&p, 1),
        Some(ConnectionError::ClosedByPeer {
            code: 9,
            reason: Bytes::from_static(b"abort")
        })
    );
    p.run_until(Duration::from_secs(10), |_| false);
    assert_eq!(p.eps[0].table_sizes().closers, 0);
}

#[test]
fn unanswered_close_gives_up() {
    let mut p = Pair::impaired(5, Impair::default());
    let (a, _b) = p.connect();
    p.impair.blackhole = true;
    p.eps[0].close(p.now, a);
    p.run_until(Duration::from_secs(60), |_| false);
    let sent_closes = p.eps[0].table_sizes().closers;
    assert_eq!(sent_closes, 0, "a close record outlived its attempts");
}

#[test]
fn crossing_closes_and_duplicates_are_harmless() {
    let mut p = Pair::impaired(
        6,
        Impair {
            dup: 0.5,
            ..Impair::default()
        },
    );
    let (a, b) = p.connect();
    p.eps[0].close_with(p.now, a, 1, b"a").unwrap();
    p.eps[1].close_with(p.now, b, 2, b"b").unwrap();
    p.run_until(Duration::from_secs(10), |_| false);
    // Each side reports its own close (the peer's arrived after it had ended, or the
    // peer's won): never twice, never a panic, nothing left.
    for side in 0..2 {
        let n = p.events[side]
            .iter()
            .filter(|e| matches!(e, Event::ConnectionLost { .. }))
            .count();
        assert_eq!(n, 1, "side {side}: {:?}", p.events[side]);
        assert_eq!(p.eps[side].table_sizes().closers, 0);
        assert_eq!(p.eps[side].table_sizes().connections, 0);
    }
}

#[test]
fn many_connect_close_cycles_leave_tables_flat() {
    let mut p = Pair::impaired(7, Impair::default());
    let idle = [p.eps[0].table_sizes(), p.eps[1].table_sizes()];
    for i in 0..500u64 {
        let (a, b) = p.connect();
        p.eps[0]
            .post_send(a, 1, i, Bytes::from_static(b"hello"))
            .unwrap();
        if i % 2 == 0 {
            p.eps[0].close_with(p.now, a, 0, b"done").unwrap();
        } else {
            p.eps[1].close(p.now, b);
        }
        p.run_until(Duration::from_secs(10), |p| {
            p.eps[0].table_sizes().connections == 0 && p.eps[1].table_sizes().connections == 0
        });
        p.run_until(Duration::from_millis(100), |_| false);
        p.events[0].clear();
        p.events[1].clear();
        // Drain events so the event queue does not count.
        while p.eps[0].poll_event().is_some() {}
        while p.eps[1].poll_event().is_some() {}
    }
    let after = [p.eps[0].table_sizes(), p.eps[1].table_sizes()];
    println!("tables idle: {idle:?}\ntables after 500 cycles: {after:?}");
    assert_eq!(after, idle);
    assert_eq!(idle, [TableSizes::default(); 2]);
}

/// `refuse_incoming(conn, code, reason)`: the CONNECT Reject carries the reason text as its
/// payload; a reason over MAX_CLOSE_REASON is refused (nothing sent, the request stays held);
/// the requester's connection ends with both, and a second refusal finds nothing.
#[test]
fn refusing_a_held_request_sends_code_and_reason() {
    let mut b = metaroce::testing::pair_config(1, 40);
    b.manual_accept = true;
    let mut p = Pair::impaired_with_configs(
        40,
        Impair::default(),
        metaroce::testing::pair_config(0, 40),
        b,
    );
    let c = p.eps[0].connect(p.now, p.addrs[1], None).unwrap();
    assert!(p.run_until(Duration::from_secs(5), |p| p.events[1]
        .iter()
        .any(|e| matches!(e, Event::Incoming(_)))));
    let held = p.events[1]
        .iter()
        .find_map(|e| match e {
            Event::Incoming(h) => Some(*h),
            _ => None,
        })
        .unwrap();
    let long = vec![b'x'; MAX_CLOSE_REASON + 1];
    assert_eq!(
        p.eps[1].refuse_incoming(held, 7, &long),
        Err(PostError::ReasonTooLong {
            len: MAX_CLOSE_REASON + 1,
            max: MAX_CLOSE_REASON
        })
    );
    let reason = vec![b'r'; MAX_CLOSE_REASON];
    assert_eq!(p.eps[1].refuse_incoming(held, 7, &reason), Ok(()));
    assert_eq!(
        p.eps[1].refuse_incoming(held, 7, b""),
        Err(PostError::UnknownConnection)
    );
    assert!(p.run_until(Duration::from_secs(5), |p| lost(p, 0).is_some()));
    let _ = c;
    assert_eq!(
        lost(&p, 0),
        Some(ConnectionError::Rejected {
            code: 7,
            reason: Bytes::from(reason),
        })
    );
    assert_eq!(p.eps[1].connections().count(), 0);
}

/// Hold every datagram A sends, then hand them to B one by one; the moment B reports the
/// message, `close` runs on B (before B's endpoint is polled for anything to send). Returns
/// the pair and A's handle, with the held datagrams delivered and the network run on.
fn close_right_after_last_message(
    mut p: Pair,
    len: usize,
    close: impl FnOnce(&mut Pair, metaroce::ConnectionHandle),
) -> (Pair, metaroce::ConnectionHandle) {
    let (a, b) = p.connect();
    p.keep_held = true;
    p.drop_hook = Some(Box::new(|from, _| from == 0));
    p.eps[0]
        .post_send(a, 1, 7, Bytes::from(vec![3; len]))
        .unwrap();
    p.flush();
    p.drop_hook = None;
    p.keep_held = false;
    let held = std::mem::take(&mut p.held);
    assert!(!held.is_empty());
    let mut close = Some(close);
    for s in held {
        p.deliver(1, s.from, &s.data);
        if messages(&p, 1) == 1 {
            if let Some(f) = close.take() {
                f(&mut p, b);
            }
        }
    }
    assert!(close.is_none(), "B never got the message");
    assert!(p.run_until(Duration::from_secs(10), |p| lost(p, 0).is_some()));
    (p, a)
}

#[test]
fn abort_right_after_the_last_message_still_acks_it() {
    for len in [100, 20_000] {
        let p = Pair::impaired(11, Impair::default());
        let (p, _a) = close_right_after_last_message(p, len, |p, b| {
            let now = p.now;
            p.eps[1].close(now, b)
        });
        // The ACK left before the MR_CLOSE: the SEND was delivered, so it succeeded.
        assert_eq!(statuses(&p, 0), vec![WcStatus::Success], "len {len}");
        assert_eq!(
            lost(&p, 0),
            Some(ConnectionError::ClosedByPeer {
                code: 0,
                reason: Bytes::new()
            })
        );
    }
}

#[test]
fn graceful_close_right_after_the_last_message_still_acks_it() {
    let p = Pair::impaired(12, Impair::default());
    let (p, _a) = close_right_after_last_message(p, 30_000, |p, b| {
        let now = p.now;
        p.eps[1].close_with(now, b, 5, b"done").unwrap()
    });
    assert_eq!(statuses(&p, 0), vec![WcStatus::Success]);
    assert_eq!(
        lost(&p, 0),
        Some(ConnectionError::ClosedByPeer {
            code: 5,
            reason: Bytes::from_static(b"done")
        })
    );
}

#[test]
fn aead_close_right_after_the_last_message_still_acks_it() {
    use metaroce::crypto::{PacketProtectionKey, ProtectionConfig};
    let cfg = |i| {
        let mut c = metaroce::testing::pair_config(i, 13);
        c.transport.packet_protection = Some(ProtectionConfig::new(
            PacketProtectionKey::new(b"metaroce test k!").unwrap(),
        ));
        c
    };
    let p = Pair::impaired_with_configs(13, Impair::default(), cfg(0), cfg(1));
    let (p, _a) = close_right_after_last_message(p, 20_000, |p, b| {
        let now = p.now;
        p.eps[1].close_with(now, b, 6, b"sealed").unwrap()
    });
    // The flushed ACKs are sealed like any other: the sender takes them, then the close.
    assert_eq!(statuses(&p, 0), vec![WcStatus::Success]);
    assert_eq!(
        lost(&p, 0),
        Some(ConnectionError::ClosedByPeer {
            code: 6,
            reason: Bytes::from_static(b"sealed")
        })
    );
}

#[test]
fn close_before_the_message_is_complete_never_reports_success() {
    let mut p = Pair::impaired(14, Impair::default());
    let (a, b) = p.connect();
    p.keep_held = true;
    p.drop_hook = Some(Box::new(|from, _| from == 0));
    p.eps[0]
        .post_send(a, 1, 7, Bytes::from(vec![3; 20_000]))
        .unwrap();
    p.flush();
    p.drop_hook = None;
    p.keep_held = false;
    let mut held = std::mem::take(&mut p.held);
    // The last data datagram is lost; B closes with the message incomplete.
    held.pop();
    for s in held {
        p.deliver(1, s.from, &s.data);
    }
    assert_eq!(messages(&p, 1), 0);
    let now = p.now;
    p.eps[1].close(now, b);
    assert!(p.run_until(Duration::from_secs(10), |p| lost(p, 0).is_some()));
    // The ACKs flushed at the close cover only part of the message: the SEND fails.
    assert_eq!(statuses(&p, 0), vec![WcStatus::WrFlushError]);
}
