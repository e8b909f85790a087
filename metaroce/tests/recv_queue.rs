//! The posted receive queue of a stream when messages are refused, fail or wait for an
//! earlier one: receives stay bound to the messages they were given to, refusals leave no
//! gap, and RNR retries are spent only where they may fail a SEND. Each case was found by
//! a review (2026-12-07) of the rule that only the message whose receive is next draws
//! RNR NAKs that count (`prop_rdma::a_later_send_never_runs_out_of_rnr_retries_before_an_
//! earlier_one`), and failed before its fix.

use bytes::Bytes;
use metaroce::testing::{Action, Filter, Pair, Rule};
use metaroce::{Access, Event, RecvRequest, WcStatus};
use std::time::Duration;

/// The packets of message `seq` of `stream` sent by endpoint 0.
fn msg0(stream: u32, seq: u32) -> Filter {
    Filter::any().from(0).when(move |p| {
        p.send
            .is_some_and(|s| s.stream_id == stream && s.msg_seq == seq)
    })
}

fn status_of(p: &Pair, c: metaroce::ConnectionHandle, wr: u64) -> Option<WcStatus> {
    p.completions(0, c)
        .iter()
        .find(|w| w.wr_id == wr)
        .map(|w| w.status)
}

/// A later SEND's flow-control RNR NAKs (while the earlier message is re-sent after loss)
/// cost it no RNR retry: once the earlier message is delivered and the later one meets its
/// first plain RNR NAK, it still has all of `rnr_retry` (6). Its per-segment count took
/// the flow-control NAKs too, so it failed RnrRetryExceeded at that first plain NAK.
#[test]
fn flow_control_rnr_naks_of_a_later_send_cost_it_no_rnr_retry() {
    let mut a = metaroce::testing::config(0, 4);
    a.transport.rnr_retry = 6;
    let mut b = metaroce::testing::config(1, 4);
    b.transport.require_posted_receives = true;
    b.transport.min_rnr_timer = 1; // 10 us
    let mut p = Pair::with_configs(4, a, b);
    let (c, s) = p.connect();
    let buf = p.eps[1].register_mr(vec![0; 1000], Access::LOCAL_WRITE);
    let rr = |wr_id, off| RecvRequest {
        wr_id,
        lkey: buf.lkey,
        offset: off,
        len: 100,
    };
    p.eps[1].post_recv(s, 0, rr(10, 0)).unwrap();
    // The earlier message's copies are lost for 2 ms (loss recovery re-sends it).
    let t0 = p.elapsed();
    let r = p.add_rule(Rule::between(
        t0,
        t0 + Duration::from_millis(2),
        msg0(0, 0),
        Action::Blackhole,
    ));
    p.eps[0]
        .post_send(c, 0, 1, Bytes::from_static(b"first"))
        .unwrap();
    p.eps[0]
        .post_send(c, 0, 2, Bytes::from_static(b"second"))
        .unwrap();
    // Until B sends its first plain RNR NAK (for SEND 2: SEND 1 took receive 10).
    assert!(p.run_until(Duration::from_secs(5), |p| {
        p.eps[1].connection_stats(s).unwrap().recv.rnr_naks >= 1 || p.completions(0, c).len() == 2
    }));
    let st = p.eps[1].connection_stats(s).unwrap().recv;
    eprintln!("hits {:?}", p.hits(r));
    eprintln!(
        "at first plain RNR NAK: rnr_naks {} stream_window_naks {}",
        st.rnr_naks, st.stream_window_naks
    );
    // B posts the next receive right away: SEND 2 has 6 RNR retries left, it must land.
    p.eps[1].post_recv(s, 0, rr(11, 100)).unwrap();
    assert!(p.run_until(Duration::from_secs(5), |p| p.completions(0, c).len() == 2));
    let st = p.eps[1].connection_stats(s).unwrap().recv;
    eprintln!(
        "end: rnr_naks {} stream_window_naks {} completions {:?} recv {:?}",
        st.rnr_naks,
        st.stream_window_naks,
        p.completions(0, c),
        p.recv_completions(1, s)
    );
    assert_eq!(status_of(&p, c, 1), Some(WcStatus::Success));
    assert_eq!(
        status_of(&p, c, 2),
        Some(WcStatus::Success),
        "SEND 2 failed after {} plain RNR NAK(s) with rnr_retry 6",
        st.rnr_naks
    );
}

/// A refused (too long) message whose first packet arrives after later messages were
/// bound to receives: it takes its receive (completed LocalLengthError when delivery
/// reaches it, in posting order), so every later
/// message lands in, and completes, the receive it was bound to. The later messages'
/// receive index had been computed without the skip: receive 12 completed twice, 10 and
/// 13 never, and a buffer already handed to the application was overwritten.
#[test]
fn a_message_refused_after_later_ones_took_receives_keeps_the_queue_in_order() {
    let a = metaroce::testing::config(0, 5);
    let mut b = metaroce::testing::config(1, 5);
    b.transport.max_message_size = 1000;
    let mut p = Pair::with_configs(5, a, b);
    let (c, s) = p.connect();
    let buf = p.eps[1].register_mr(vec![0; 4000], Access::LOCAL_WRITE);
    for (i, wr) in [10u64, 11, 12, 13].into_iter().enumerate() {
        p.eps[1]
            .post_recv(
                s,
                0,
                RecvRequest {
                    wr_id: wr,
                    lkey: buf.lkey,
                    offset: i as u64 * 1000,
                    len: 1000,
                },
            )
            .unwrap();
    }
    // The too-long SEND 1 arrives late (reordering).
    let r = p.add_rule(Rule::always(
        msg0(0, 0),
        Action::Hold {
            prob: 1.0,
            after: Duration::from_millis(1),
        },
    ));
    p.eps[0]
        .post_send(c, 0, 1, Bytes::from(vec![7u8; 1500]))
        .unwrap();
    p.eps[0]
        .post_send(c, 0, 2, Bytes::from_static(b"two"))
        .unwrap();
    p.eps[0]
        .post_send(c, 0, 3, Bytes::from_static(b"three"))
        .unwrap();
    assert!(p.run_until(Duration::from_secs(5), |p| p.completions(0, c).len() == 3));
    p.eps[0]
        .post_send(c, 0, 4, Bytes::from_static(b"four"))
        .unwrap();
    assert!(p.run_until(Duration::from_secs(5), |p| p.completions(0, c).len() == 4));
    p.run_for(Duration::from_millis(50));
    let rc: Vec<(u64, WcStatus)> = p
        .recv_completions(1, s)
        .iter()
        .map(|(_, w)| (w.wr_id, w.status))
        .collect();
    let data = p.eps[1].mr_read(buf.lkey, 0, 4000).unwrap();
    let at = |wr: u64| {
        String::from_utf8_lossy(&data[(wr as usize - 10) * 1000..][..8])
            .trim_end_matches('\0')
            .to_string()
    };
    eprintln!("hits {:?}", p.hits(r));
    eprintln!("sender {:?}", p.completions(0, c));
    eprintln!(
        "receiver completions {rc:?}; buffers {:?}",
        (10..14).map(at).collect::<Vec<_>>()
    );
    assert_eq!(status_of(&p, c, 1), Some(WcStatus::RemoteInvalidRequest));
    let ok: Vec<u64> = rc
        .iter()
        .filter(|x| x.1 == WcStatus::Success)
        .map(|x| x.0)
        .collect();
    let mut uniq = ok.clone();
    uniq.dedup();
    assert_eq!(ok, uniq, "a receive completed twice: {rc:?}");
    assert_eq!(
        rc,
        [
            (10, WcStatus::LocalLengthError),
            (11, WcStatus::Success),
            (12, WcStatus::Success),
            (13, WcStatus::Success)
        ],
        "receives complete once each, in posting order"
    );
    let got: Vec<String> = ok.iter().map(|&w| at(w)).collect();
    assert_eq!(
        got,
        ["two", "three", "four"],
        "receives {ok:?} do not hold the messages in order"
    );
}

/// An invalid message arriving beyond the stream window (or with the refusal records
/// full) waits with a flow-control RNR NAK until its refusal can be recorded. It used to
/// be NAKed without a record: delivery stopped at it for good, and later SENDs completed
/// Success at the sender without ever being delivered.
#[test]
fn a_refusal_beyond_the_stream_window_leaves_no_gap() {
    let a = metaroce::testing::config(0, 6);
    let mut b = metaroce::testing::config(1, 6);
    b.transport.max_message_size = 1000;
    b.transport.max_stream_window = 2;
    let mut p = Pair::with_configs(6, a, b);
    let (c, s) = p.connect();
    // The first copy of message 0 is lost.
    let r = p.add_rule(Rule::always(msg0(0, 0), Action::Burst(1)));
    p.eps[0]
        .post_send(c, 0, 1, Bytes::from_static(b"m0"))
        .unwrap();
    p.eps[0]
        .post_send(c, 0, 2, Bytes::from_static(b"m1"))
        .unwrap();
    p.eps[0]
        .post_send(c, 0, 3, Bytes::from(vec![7u8; 1500]))
        .unwrap();
    p.eps[0]
        .post_send(c, 0, 4, Bytes::from_static(b"m3"))
        .unwrap();
    let done = p.run_until(Duration::from_secs(5), |p| p.completions(0, c).len() == 4);
    p.run_for(Duration::from_millis(200));
    let msgs = p.messages(1, s);
    eprintln!(
        "hits {:?} stats {:?}",
        p.hits(r),
        p.eps[1].connection_stats(s).unwrap().recv
    );
    eprintln!("sender {:?}\nreceiver {:?}", p.completions(0, c), msgs);
    assert!(done, "not every SEND completed");
    let delivered = msgs.get(&0).map_or(0, |v| v.len());
    let ok: Vec<u64> = p
        .completions(0, c)
        .iter()
        .filter(|w| w.status == WcStatus::Success)
        .map(|w| w.wr_id)
        .collect();
    assert_eq!(
        ok.len(),
        delivered,
        "SENDs completed Success {ok:?} but {delivered} messages delivered"
    );
}

/// The receive at the head of the queue names a deregistered region: SEND 1 fails
/// RemoteOperationalError and that receive completes LocalProtectionError (IBA: the WQE
/// completes in error), so the stream moves on and SEND 2, which has no receive, meets
/// plain RNR NAKs and ends. The receive used to stay posted with delivery stuck at SEND 1,
/// and SEND 2 waited with flow-control RNR NAKs for ever.
#[test]
fn a_send_behind_one_whose_receive_failed_completes() {
    for lose_first_nak in [false, true] {
        send_behind_a_failed_receive(lose_first_nak);
    }
}

/// The case above; with `lose_first_nak`, B's first NAK of SEND 1 is lost, so A re-sends it
/// and B refuses the copy again: with the same syndrome (0x63), so SEND 1 still completes
/// RemoteOperationalError (not RemoteInvalidRequest), and the receive completes once.
fn send_behind_a_failed_receive(lose_first_nak: bool) {
    let mut a = metaroce::testing::config(0, 7);
    a.transport.rnr_retry = 1;
    let mut b = metaroce::testing::config(1, 7);
    b.transport.min_rnr_timer = 1;
    let mut p = Pair::with_configs(7, a, b);
    let (c, s) = p.connect();
    if lose_first_nak {
        let naks = Filter::any().from(1).when(|p| p.nak.is_some());
        p.add_rule(Rule::always(naks, Action::Burst(1)));
    }
    let buf = p.eps[1].register_mr(vec![0; 1000], Access::LOCAL_WRITE);
    let rr = RecvRequest {
        wr_id: 10,
        lkey: buf.lkey,
        offset: 0,
        len: 100,
    };
    p.eps[1].post_recv(s, 0, rr).unwrap();
    p.eps[1].deregister_mr(buf.lkey).unwrap();
    p.eps[0]
        .post_send(c, 0, 1, Bytes::from_static(b"first"))
        .unwrap();
    assert!(p.run_until(Duration::from_secs(5), |p| p.completions(0, c).len() == 1));
    p.eps[0]
        .post_send(c, 0, 2, Bytes::from_static(b"second"))
        .unwrap();
    let done = p.run_until(Duration::from_secs(20), |p| p.completions(0, c).len() == 2);
    let st = p.eps[1].connection_stats(s).unwrap().recv;
    assert!(
        done,
        "SEND 2 did not complete in 20 s: rnr_naks {}, stream_window_naks {}",
        st.rnr_naks, st.stream_window_naks
    );
    assert_eq!(status_of(&p, c, 1), Some(WcStatus::RemoteOperationalError));
    assert_eq!(status_of(&p, c, 2), Some(WcStatus::RnrRetryExceeded));
    let rc: Vec<(u64, WcStatus)> = p
        .recv_completions(1, s)
        .iter()
        .map(|(_, w)| (w.wr_id, w.status))
        .collect();
    assert_eq!(rc, [(10, WcStatus::LocalProtectionError)]);
}

/// Statuses of the receive completions endpoint 1 reported on `stream`, by wr_id, and
/// whether each came before the stream's `StreamFinished`.
fn recvs_on(p: &Pair, stream: u32) -> Vec<(u64, WcStatus, bool)> {
    let mut finished = false;
    let mut out = Vec::new();
    for e in &p.events[1] {
        match e {
            Event::RecvCompletion { stream: s, wc, .. } if *s == stream => {
                out.push((wc.wr_id, wc.status, !finished));
            }
            Event::StreamFinished { stream: s, .. } if *s == stream => finished = true,
            _ => {}
        }
    }
    out
}

/// A receive still posted when the peer's FIN is delivered will never be filled: it
/// completes with `WrFlushError` just before `StreamFinished`, and the stream closes.
/// Before, it waited until the connection ended and kept the stream from closing (the
/// stream counted against `max_streams` for the connection's life). A receive posted after
/// the stream closed is flushed at once.
#[test]
fn a_receive_pending_at_the_fin_is_flushed_and_the_stream_closes() {
    let mut p = Pair::new(11);
    let (c, s) = p.connect();
    let buf = p.eps[1].register_mr(vec![0; 1000], Access::LOCAL_WRITE);
    let rr = |wr_id, off| RecvRequest {
        wr_id,
        lkey: buf.lkey,
        offset: off,
        len: 100,
    };
    p.eps[1].post_recv(s, 3, rr(10, 0)).unwrap();
    p.eps[1].post_recv(s, 3, rr(11, 100)).unwrap();
    p.eps[0]
        .post_send(c, 3, 1, Bytes::from_static(b"only"))
        .unwrap();
    p.eps[0].finish_stream(p.now, c, 3).unwrap();
    p.eps[1].finish_stream(p.now, s, 3).unwrap();
    let closed = |p: &Pair, i: usize| {
        p.events[i]
            .iter()
            .any(|e| matches!(e, Event::StreamClosed { stream: 3, .. }))
    };
    assert!(p.run_until(Duration::from_secs(5), |p| closed(p, 0) && closed(p, 1)));
    assert_eq!(
        recvs_on(&p, 3),
        [
            (10, WcStatus::Success, true),
            (11, WcStatus::WrFlushError, true)
        ]
    );
    p.eps[1].post_recv(s, 3, rr(12, 200)).unwrap();
    p.run_for(Duration::from_millis(5));
    assert_eq!(recvs_on(&p, 3)[2..], [(12, WcStatus::WrFlushError, false)]);
}

/// A stream whose peer finished it but that is kept (its closed id would add a range
/// beyond the `2 × max_streams + 1` ranges kept): a receive posted on it after every message was delivered
/// completes with `WrFlushError` at once instead of waiting for a message that cannot
/// come.
#[test]
fn a_receive_posted_on_a_finished_stream_that_is_kept_is_flushed_at_once() {
    let a = metaroce::testing::config(0, 4);
    let mut b = metaroce::testing::config(1, 4);
    b.transport.max_streams = 2;
    let mut p = Pair::with_configs(4, a, b);
    let (c, s) = p.connect();
    // Streams 0, 10, .. 50: ids that join no neighbour, one range each; 5 are kept.
    for (i, id) in [0u32, 10, 20, 30, 40, 50].into_iter().enumerate() {
        p.eps[0]
            .post_send(c, id, i as u64, Bytes::from_static(b"msg"))
            .unwrap();
        p.eps[0].finish_stream(p.now, c, id).unwrap();
        assert!(p.run_until(Duration::from_secs(5), |p| {
            p.events[1]
                .iter()
                .any(|e| matches!(e, Event::StreamFinished { stream, .. } if *stream == id))
        }));
    }
    assert!(p.eps[1].stream_is_closed(s, 40));
    assert!(!p.eps[1].stream_is_closed(s, 50), "kept: a sixth range");
    let buf = p.eps[1].register_mr(vec![0; 100], Access::LOCAL_WRITE);
    let rr = RecvRequest {
        wr_id: 7,
        lkey: buf.lkey,
        offset: 0,
        len: 100,
    };
    p.eps[1].post_recv(s, 50, rr).unwrap();
    p.run_for(Duration::from_millis(5));
    assert_eq!(recvs_on(&p, 50), [(7, WcStatus::WrFlushError, false)]);
}

/// A receive posted on a region that is then deregistered completes with
/// `LocalProtectionError` (the SEND with `RemoteOperationalError`), however many regions
/// are registered and deregistered meanwhile: an lkey is not reissued. With lkeys of slot
/// index and an 8-bit generation, the 256th later registration got the old lkey and the
/// message landed in that unrelated region, completing `Success` (found by review, in RC
/// mode; the table is shared).
#[test]
fn a_receive_on_a_deregistered_region_never_lands_in_a_later_one() {
    let mut p = Pair::new(12);
    let (c, s) = p.connect();
    let old = p.eps[1].register_mr(vec![0; 64], Access::LOCAL_WRITE);
    let rr = RecvRequest {
        wr_id: 1,
        lkey: old.lkey,
        offset: 0,
        len: 64,
    };
    p.eps[1].post_recv(s, 0, rr).unwrap();
    assert!(p.eps[1].deregister_mr(old.lkey).is_some());
    // Registrations that reuse the freed slot; one that got the old lkey is kept.
    let mut kept = None;
    for _ in 0..300 {
        let k = p.eps[1].register_mr(vec![0x11; 64], Access::LOCAL_WRITE);
        if k.lkey == old.lkey {
            kept = Some(k);
            break;
        }
        assert!(p.eps[1].deregister_mr(k.lkey).is_some());
    }
    let kept = kept.unwrap_or_else(|| p.eps[1].register_mr(vec![0x11; 64], Access::LOCAL_WRITE));
    p.eps[0]
        .post_send(c, 0, 9, Bytes::from(vec![0xEE; 64]))
        .unwrap();
    assert!(p.run_until(Duration::from_secs(5), |p| !p.completions(0, c).is_empty()));
    assert_eq!(status_of(&p, c, 9), Some(WcStatus::RemoteOperationalError));
    let rc = p.recv_completions(1, s);
    assert_eq!(rc.len(), 1);
    assert_eq!(rc[0].1.status, WcStatus::LocalProtectionError);
    assert_eq!(p.eps[1].mr_read(kept.lkey, 0, 64).unwrap(), vec![0x11; 64]);
}

/// A receive whose region is deregistered after its message began landing in it: the
/// message fails whole, as when the region is gone at admission. Its receive completes
/// `LocalProtectionError`, the SEND `RemoteOperationalError` — also when B's NAKs are lost
/// for 2 ms and A re-sends the refused packets — and the next message on the stream lands in the
/// next receive. Before (found by review): the refused packet's segment stayed marked
/// received, so its re-sent copy was acknowledged as a duplicate and the SEND completed
/// `Success` with its bytes never placed; and the message never completed, so the stream
/// delivered nothing after it.
#[test]
fn a_receive_deregistered_mid_message_fails_the_message_and_the_stream_goes_on() {
    for lose_naks in [false, true] {
        receive_deregistered_mid_message(lose_naks);
    }
}

fn receive_deregistered_mid_message(lose_naks: bool) {
    let mut p = Pair::new(13);
    let (c, s) = p.connect();
    let pmtu = p.eps[0].config().transport.pmtu as usize;
    let first = p.eps[1].register_mr(vec![0; 4 * pmtu], Access::LOCAL_WRITE);
    let second = p.eps[1].register_mr(vec![0; 4 * pmtu], Access::LOCAL_WRITE);
    for (wr_id, lkey) in [(10, first.lkey), (11, second.lkey)] {
        let rr = RecvRequest {
            wr_id,
            lkey,
            offset: 0,
            len: 4 * pmtu as u32,
        };
        p.eps[1].post_recv(s, 0, rr).unwrap();
    }
    // Only the first segment of SEND 1 gets through at first.
    let later = Filter::any()
        .from(0)
        .when(|p| p.send.is_some_and(|s| s.msg_seq == 0 && s.offset != 0));
    let t0 = p.elapsed();
    p.add_rule(Rule::between(
        t0,
        t0 + Duration::from_millis(1),
        later,
        Action::Blackhole,
    ));
    p.eps[0]
        .post_send(c, 0, 1, Bytes::from(vec![0xAB; 3 * pmtu]))
        .unwrap();
    assert!(p.run_until(Duration::from_millis(1), |p| {
        p.eps[1]
            .connection_stats(s)
            .is_some_and(|st| st.data_packets_received >= 1)
    }));
    assert!(p.completions(0, c).is_empty());
    // B's application deregisters the receive's region mid-message.
    assert!(p.eps[1].deregister_mr(first.lkey).is_some());
    if lose_naks {
        let naks = Filter::any().from(1).when(|p| p.nak.is_some());
        let t1 = p.elapsed();
        p.add_rule(Rule::between(
            t1,
            t1 + Duration::from_millis(2),
            naks,
            Action::Blackhole,
        ));
    }
    assert!(p.run_until(Duration::from_secs(5), |p| p.completions(0, c).len() == 1));
    assert_eq!(status_of(&p, c, 1), Some(WcStatus::RemoteOperationalError));
    p.eps[0]
        .post_send(c, 0, 2, Bytes::from(vec![0xCD; 100]))
        .unwrap();
    assert!(p.run_until(Duration::from_secs(5), |p| p.completions(0, c).len() == 2));
    assert_eq!(status_of(&p, c, 2), Some(WcStatus::Success));
    let rc: Vec<(u64, WcStatus)> = p
        .recv_completions(1, s)
        .iter()
        .map(|(_, w)| (w.wr_id, w.status))
        .collect();
    assert_eq!(
        rc,
        [
            (10, WcStatus::LocalProtectionError),
            (11, WcStatus::Success)
        ],
        "lose_naks {lose_naks}"
    );
    assert_eq!(
        p.eps[1].mr_read(second.lkey, 0, 100).unwrap(),
        vec![0xCD; 100]
    );
}

/// A receive whose message failed mid-message (its region deregistered) while an earlier
/// message of the stream is still arriving stays bound to that message until delivery
/// reaches it. Withdrawing it then is refused (`CancelOutcome::Finishing`: a message began
/// landing in it), and it completes `LocalProtectionError` in order. Before (found by
/// review): it was withdrawn (`Cancelled`, `WrFlushError`), and delivery later completed
/// the *next* receive `LocalProtectionError` for the failed message.
#[test]
fn a_receive_failed_mid_message_cannot_be_withdrawn_from_under_its_message() {
    use metaroce::CancelOutcome;
    let mut p = Pair::new(13);
    let (c, s) = p.connect();
    let pmtu = p.eps[0].config().transport.pmtu as usize;
    let kept = p.eps[1].register_mr(vec![0; 16 * pmtu], Access::LOCAL_WRITE);
    let gone = p.eps[1].register_mr(vec![0; 4 * pmtu], Access::LOCAL_WRITE);
    for (wr_id, lkey, off) in [
        (10, kept.lkey, 0),
        (11, gone.lkey, 0),
        (12, kept.lkey, 4 * pmtu as u64),
        (13, kept.lkey, 8 * pmtu as u64),
    ] {
        let rr = RecvRequest {
            wr_id,
            lkey,
            offset: off,
            len: 4 * pmtu as u32,
        };
        p.eps[1].post_recv(s, 0, rr).unwrap();
    }
    // Only the first segment of messages 0 and 1 gets through for now.
    let later = |seq: u32| {
        Filter::any()
            .from(0)
            .when(move |p| p.send.is_some_and(|s| s.msg_seq == seq && s.offset != 0))
    };
    let t0 = p.elapsed();
    let far = t0 + Duration::from_secs(60);
    p.add_rule(Rule::between(t0, far, later(0), Action::Blackhole));
    p.add_rule(Rule::between(t0, far, later(1), Action::Blackhole));
    p.eps[0]
        .post_send(c, 0, 1, Bytes::from(vec![0xAB; 3 * pmtu]))
        .unwrap();
    p.eps[0]
        .post_send(c, 0, 2, Bytes::from(vec![0xCD; 3 * pmtu]))
        .unwrap();
    assert!(p.run_until(Duration::from_millis(1), |p| {
        p.eps[1]
            .connection_stats(s)
            .is_some_and(|st| st.data_packets_received >= 2)
    }));
    // B deregisters the region of receive 11 (message 1 began landing in it) ...
    assert!(p.eps[1].deregister_mr(gone.lkey).is_some());
    // ... and message 1's other packets come: it fails; message 0 is still arriving.
    p.clear_rules();
    let t1 = p.elapsed();
    p.add_rule(Rule::between(
        t1,
        t1 + Duration::from_secs(60),
        later(0),
        Action::Blackhole,
    ));
    assert!(p.run_until(p.elapsed() + Duration::from_millis(20), |p| {
        p.eps[1]
            .connection_stats(s)
            .is_some_and(|st| st.recv.refused_messages == 1)
    }));
    assert!(
        p.recv_completions(1, s).is_empty(),
        "message 0 is not complete yet"
    );
    let now = p.now;
    let out = p.eps[1].cancel_recv(now, s, 0, 11);
    p.clear_rules();
    assert!(p.run_until(Duration::from_secs(5), |p| status_of(p, c, 2).is_some()));
    assert_eq!(status_of(&p, c, 1), Some(WcStatus::Success));
    assert_eq!(status_of(&p, c, 2), Some(WcStatus::RemoteOperationalError));
    p.eps[0]
        .post_send(c, 0, 3, Bytes::from(vec![0xEF; 100]))
        .unwrap();
    assert!(p.run_until(Duration::from_secs(5), |p| status_of(p, c, 3).is_some()));
    let rc: Vec<(u64, WcStatus)> = p
        .recv_completions(1, s)
        .iter()
        .map(|(_, w)| (w.wr_id, w.status))
        .collect();
    assert_eq!(
        (out, rc),
        (
            CancelOutcome::Finishing,
            vec![
                (10, WcStatus::Success),
                (11, WcStatus::LocalProtectionError),
                (12, WcStatus::Success),
            ]
        )
    );
}
