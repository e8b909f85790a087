//! Found by review of the per-stream completion order: the send queue's 2 x max_outstanding_ops bound (SendQueueFull) can
//! clear without any completion being reported, when the operation holding the queue's
//! front is internal (a READ response): the reported SENDs behind it leave silently.
//! metaroce-tokio woke posters waiting on SendQueueFull only on completions, so such a
//! poster waited for good; `Endpoint::send_queue_full` tells a caller when to look again.

use bytes::Bytes;
use metaroce::testing::{config, Action, Filter, Net, Rule};
use metaroce::{Access, Event, PostError, ReadRequest};
use std::time::Duration;

#[test]
fn queue_room_freed_by_an_internal_front_op_comes_with_no_completion() {
    let mut a = config(0, 5);
    a.transport.max_outstanding_ops = 4;
    let b = config(1, 5);
    let mut n = Net::with_configs(5, a, b);
    let (ca, cb) = n.connect();
    let mr = n.eps[0].register_mr(vec![7u8; 4096], Access::REMOTE_READ);
    let local = n.eps[1].register_mr(vec![0u8; 4096], Access::LOCAL_WRITE);
    // A's READ responses are lost for 200 ms: the response sits at the front of A's queue.
    let t0 = n.elapsed();
    n.add_rule(Rule::between(
        t0,
        t0 + Duration::from_millis(200),
        Filter::any().from(0).when(|p| p.read_resp.is_some()),
        Action::Blackhole,
    ));
    n.eps[1]
        .post_read(
            cb,
            ReadRequest {
                wr_id: 1,
                lkey: local.lkey,
                local_offset: 0,
                len: 100,
                remote_addr: mr.addr,
                rkey: mr.rkey,
            },
        )
        .unwrap();
    n.run_for(Duration::from_millis(1));
    // SENDs on stream 1 complete (and are reported) behind it until the queue is full.
    let mut wr = 0u64;
    let full = loop {
        match n.eps[0].post_send(ca, 1, wr, Bytes::from_static(b"m")) {
            Ok(()) => wr += 1,
            Err(PostError::SendQueueFull) => break true,
            Err(e) => panic!("{e:?}"),
        }
        n.run_for(Duration::from_millis(1));
        if wr > 100 {
            break false;
        }
    };
    assert!(full, "the queue never filled");
    let done = |n: &Net| {
        n.events[0]
            .iter()
            .filter(|e| matches!(e, Event::Completion { .. }))
            .count()
    };
    n.run_for(Duration::from_millis(5));
    let reported = done(&n);
    assert_eq!(reported as u64, wr, "every SEND posted was reported");
    assert!(n.eps[0].send_queue_full(ca));
    assert!(matches!(
        n.eps[0].post_send(ca, 1, 999, Bytes::from_static(b"m")),
        Err(PostError::SendQueueFull)
    ));
    // The response gets through; the queue empties with no completion reported: a
    // caller waiting for room must look again after input, not only on completions.
    n.run_for(Duration::from_secs(2));
    assert_eq!(done(&n), reported, "no completion came with the room");
    assert!(!n.eps[0].send_queue_full(ca));
    assert!(n.eps[0]
        .post_send(ca, 1, 1000, Bytes::from_static(b"m"))
        .is_ok());
}
