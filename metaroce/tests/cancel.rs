//! `Endpoint::cancel` in virtual time: cancelled WRITEs, READs and atomics stop, complete
//! with `WrFlushError` and leave the responder's op tracking moving; posted receives are
//! withdrawn unless a message is landing in them.

use bytes::Bytes;
use metaroce::testing::{Impair, Pair};
use metaroce::{
    Access, AtomicOp, AtomicRequest, CancelOutcome, Event, ReadRequest, RecvRequest, WcStatus,
    WorkCompletion, WriteRequest,
};
use std::time::Duration;

fn completion(events: &[Event], wr_id: u64) -> Option<WorkCompletion> {
    events.iter().find_map(|e| match e {
        Event::Completion { wc, .. } if wc.wr_id == wr_id => Some(*wc),
        _ => None,
    })
}

fn recv_completion(events: &[Event], wr_id: u64) -> Option<WorkCompletion> {
    events.iter().find_map(|e| match e {
        Event::RecvCompletion { wc, .. } if wc.wr_id == wr_id => Some(*wc),
        _ => None,
    })
}

fn lossy() -> Impair {
    Impair {
        loss: 0.05,
        dup: 0.05,
        reorder: 0.1,
        ..Default::default()
    }
}

fn write(wr_id: u64, src: metaroce::MrKeys, dst: metaroce::MrKeys, len: u32) -> WriteRequest {
    WriteRequest {
        wr_id,
        lkey: src.lkey,
        local_offset: 0,
        len,
        remote_addr: dst.addr,
        rkey: dst.rkey,
        imm: None,
    }
}

#[test]
fn cancelled_write_stops_and_a_later_write_succeeds() {
    for seed in 0..4 {
        let mut p = Pair::impaired(
            seed,
            if seed == 0 {
                Impair::default()
            } else {
                lossy()
            },
        );
        let (c, s) = p.connect();
        let n = 4 << 20;
        let src = p.eps[0].register_mr(vec![0xAB; n], Access::LOCAL_WRITE);
        let dst = p.eps[1].register_mr(vec![0; n], Access::REMOTE_WRITE);
        p.eps[0]
            .post_write(c, write(1, src, dst, n as u32))
            .unwrap();
        for _ in 0..4 {
            p.step();
        }
        let now = p.now;
        assert_eq!(p.eps[0].cancel(now, c, 1), CancelOutcome::Cancelled);
        assert!(
            p.run_until(Duration::from_secs(30), |p| completion(&p.events[0], 1)
                .is_some()),
            "seed {seed}: cancelled WRITE never completed"
        );
        assert_eq!(
            completion(&p.events[0], 1).unwrap().status,
            WcStatus::WrFlushError
        );
        let landed = p.eps[1].connection_stats(s).unwrap().recv.write_bytes;
        println!("seed {seed}: {landed} of {n} bytes landed before the cancel took effect");
        assert!(
            landed < n as u64 / 2,
            "seed {seed}: {landed} bytes landed: unsent segments were sent"
        );
        // Nothing of it lands after its completion: run the network for another 200 ms of
        // virtual time (bounded by time, not by quiet: keepalives keep the timer set).
        let until = p.now + Duration::from_millis(200);
        for _ in 0..2000 {
            if p.now > until || !p.step() {
                break;
            }
        }
        let r = p.eps[1].connection_stats(s).unwrap().recv;
        assert_eq!(
            r.write_bytes, landed,
            "seed {seed}: bytes landed after completion"
        );
        assert_eq!(r.aborted_ops, 1, "seed {seed}");
        // The responder's op tracking moved past the cancelled op id: a later WRITE works.
        let small = p.eps[0].register_mr(vec![7; 65_536], Access::LOCAL_WRITE);
        p.eps[0]
            .post_write(c, write(2, small, dst, 65_536))
            .unwrap();
        assert!(
            p.run_until(Duration::from_secs(30), |p| completion(&p.events[0], 2)
                .is_some())
        );
        assert_eq!(
            completion(&p.events[0], 2).unwrap().status,
            WcStatus::Success
        );
        let got = p.eps[1].mr_read(dst.lkey, 0, 65_536).unwrap();
        assert!(got.iter().all(|&b| b == 7), "seed {seed}");
        // What remains tracked is only the record of what WRITE 2 executed (the op-id
        // parameter history that refuses a reused op id, issue #9): no WRITE in progress,
        // nothing left of the cancelled op.
        assert_eq!(
            p.eps[1].connection_stats(s).unwrap().recv.tracked_ops,
            1,
            "seed {seed}: responder still tracks ops"
        );
        // Cancelling again, or after the completion, changes nothing.
        let now = p.now;
        assert_eq!(p.eps[0].cancel(now, c, 1), CancelOutcome::Unknown);
    }
}

#[test]
fn cancelled_reads_and_atomics_never_touch_their_destination() {
    for seed in 0..4 {
        let mut p = Pair::impaired(seed, lossy());
        let (c, _s) = p.connect();
        let n = 64 * 1024;
        let remote =
            p.eps[1].register_mr(vec![0x5A; n], Access::REMOTE_READ | Access::REMOTE_ATOMIC);
        let local = p.eps[0].register_mr(vec![0; 40 * n], Access::LOCAL_WRITE);
        // 40 READs: more than max_rd_atomic (16), so later ones wait unsent.
        for i in 0..40u64 {
            let req = ReadRequest {
                wr_id: i,
                lkey: local.lkey,
                local_offset: i * n as u64,
                len: n as u32,
                remote_addr: remote.addr,
                rkey: remote.rkey,
            };
            p.eps[0].post_read(c, req).unwrap();
        }
        let atomic = p.eps[0].register_mr(vec![0xEE; 8], Access::LOCAL_WRITE);
        let req = AtomicRequest {
            wr_id: 100,
            lkey: atomic.lkey,
            local_offset: 0,
            remote_addr: remote.addr,
            rkey: remote.rkey,
            op: AtomicOp::FetchAdd { add: 1 },
        };
        p.eps[0].post_atomic(c, req).unwrap();
        p.step();
        p.step();
        let now = p.now;
        // What landed before the cancel may stay; nothing may land after it.
        let before = p.eps[0].mr_read(local.lkey, 0, 40 * n as u64).unwrap();
        // One READ likely in flight, one surely still queued, and the atomic.
        for wr in [1u64, 35, 100] {
            assert_eq!(
                p.eps[0].cancel(now, c, wr),
                CancelOutcome::Cancelled,
                "wr {wr}"
            );
        }
        assert!(
            p.run_until(Duration::from_secs(60), |p| completion(&p.events[0], 100)
                .is_some()),
            "seed {seed}"
        );
        for wr in 0..40u64 {
            let wc = completion(&p.events[0], wr).unwrap();
            let want = if wr == 1 || wr == 35 {
                WcStatus::WrFlushError
            } else {
                WcStatus::Success
            };
            assert_eq!(wc.status, want, "seed {seed} wr {wr}");
            let got = p.eps[0]
                .mr_read(local.lkey, wr * n as u64, n as u64)
                .unwrap();
            let at = (wr * n as u64) as usize;
            let ok = if want == WcStatus::Success {
                got.iter().all(|&b| b == 0x5A)
            } else {
                got[..] == before[at..at + n]
            };
            assert!(
                ok,
                "seed {seed} wr {wr}: destination of a cancelled READ was written"
            );
        }
        assert_eq!(
            completion(&p.events[0], 100).unwrap().status,
            WcStatus::WrFlushError
        );
        assert_eq!(p.eps[0].mr_read(atomic.lkey, 0, 8).unwrap(), vec![0xEE; 8]);
        // A later atomic runs (the op ids were released at the responder).
        let req = AtomicRequest {
            wr_id: 101,
            op: AtomicOp::CompareSwap {
                compare: 0,
                swap: 0,
            },
            ..req
        };
        p.eps[0].post_atomic(c, req).unwrap();
        assert!(
            p.run_until(Duration::from_secs(30), |p| completion(&p.events[0], 101)
                .is_some())
        );
        assert_eq!(
            completion(&p.events[0], 101).unwrap().status,
            WcStatus::Success
        );
    }
}

#[test]
fn withdrawn_receive_is_flushed_and_the_message_takes_the_next_one() {
    withdrawn_receive(false);
}

/// The same through `cancel_recv`, which is told the stream (and finds nothing on another).
#[test]
fn withdrawn_receive_named_by_its_stream_is_flushed_and_the_message_takes_the_next_one() {
    withdrawn_receive(true);
}

fn withdrawn_receive(by_stream: bool) {
    let mut p = Pair::impaired(1, Impair::default());
    let (c, s) = p.connect();
    let buf = p.eps[1].register_mr(vec![0; 8192], Access::LOCAL_WRITE);
    for (wr, off) in [(1u64, 0u64), (2, 4096)] {
        let r = RecvRequest {
            wr_id: wr,
            lkey: buf.lkey,
            offset: off,
            len: 4096,
        };
        p.eps[1].post_recv(s, 3, r).unwrap();
    }
    let now = p.now;
    if by_stream {
        assert_eq!(p.eps[1].cancel_recv(now, s, 4, 1), CancelOutcome::Unknown);
        assert_eq!(p.eps[1].cancel_recv(now, s, 3, 1), CancelOutcome::Cancelled);
    } else {
        assert_eq!(p.eps[1].cancel(now, s, 1), CancelOutcome::Cancelled);
    }
    p.flush();
    assert_eq!(
        recv_completion(&p.events[1], 1).map(|w| w.status),
        Some(WcStatus::WrFlushError)
    );
    p.eps[0]
        .post_send(c, 3, 10, Bytes::from(vec![9u8; 3000]))
        .unwrap();
    assert!(
        p.run_until(Duration::from_secs(10), |p| completion(&p.events[0], 10)
            .is_some())
    );
    assert_eq!(
        completion(&p.events[0], 10).unwrap().status,
        WcStatus::Success
    );
    let wc = recv_completion(&p.events[1], 2).expect("message not in the next receive");
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 3000));
    let got = p.eps[1].mr_read(buf.lkey, 0, 8192).unwrap();
    assert!(
        got[..4096].iter().all(|&b| b == 0),
        "withdrawn buffer written"
    );
    assert!(got[4096..7096].iter().all(|&b| b == 9));
    // SENDs are not cancellable.
    p.eps[0]
        .post_send(c, 3, 11, Bytes::from_static(b"x"))
        .unwrap();
    let now = p.now;
    assert_eq!(p.eps[0].cancel(now, c, 11), CancelOutcome::NotCancellable);
}

#[test]
fn receive_with_a_message_landing_is_not_withdrawn() {
    let mut p = Pair::impaired(2, Impair::default());
    let (c, s) = p.connect();
    let buf = p.eps[1].register_mr(vec![0; 1 << 20], Access::LOCAL_WRITE);
    let r = RecvRequest {
        wr_id: 1,
        lkey: buf.lkey,
        offset: 0,
        len: 1 << 20,
    };
    p.eps[1].post_recv(s, 0, r).unwrap();
    p.eps[0]
        .post_send(c, 0, 10, Bytes::from(vec![4u8; 1 << 20]))
        .unwrap();
    // Step until the first packets landed, not the whole message.
    assert!(p.run_until(Duration::from_secs(10), |p| {
        p.eps[1]
            .connection_stats(s)
            .is_some_and(|st| st.recv.buffered_messages > 0)
    }));
    let now = p.now;
    assert_eq!(p.eps[1].cancel_recv(now, s, 0, 1), CancelOutcome::Finishing);
    assert_eq!(p.eps[1].cancel(now, s, 1), CancelOutcome::Finishing);
    assert!(p.run_until(Duration::from_secs(10), |p| recv_completion(
        &p.events[1],
        1
    )
    .is_some()));
    let wc = recv_completion(&p.events[1], 1).unwrap();
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 1 << 20));
}

/// `cancel_many` is `cancel` for each listed work request, in one pass: the same
/// operations stop, each completes `WrFlushError` in posting order, the ones not listed
/// (and the SEND, which is not cancellable) complete `Success`, and the responder counts
/// the same op aborts. Run both ways on the same schedule and compared.
#[test]
fn cancel_many_cancels_what_cancel_would_one_by_one() {
    let run = |many: bool| {
        let mut p = Pair::impaired(3, lossy());
        let (c, s) = p.connect();
        let src = p.eps[0].register_mr(vec![0xAB; 64 << 10], Access::LOCAL_WRITE);
        let dst = p.eps[1].register_mr(vec![0; 64 << 10], Access::REMOTE_WRITE);
        for wr in 1..=40u64 {
            p.eps[0]
                .post_write(c, write(wr, src, dst, 16 << 10))
                .unwrap();
        }
        p.eps[0]
            .post_send(c, 0, 41, Bytes::from_static(b"not cancellable"))
            .unwrap();
        for _ in 0..4 {
            p.step();
        }
        // Every third WRITE, the SEND, and ids that name nothing; in no particular order.
        let mut ids: Vec<u64> = (1..=40).filter(|w| w % 3 == 0).rev().collect();
        ids.extend([41, 999, 0]);
        let now = p.now;
        let cancelled = if many {
            p.eps[0].cancel_many(now, c, &ids)
        } else {
            ids.iter()
                .filter(|&&w| p.eps[0].cancel(now, c, w) == CancelOutcome::Cancelled)
                .count()
        };
        assert!(
            p.run_until(Duration::from_secs(30), |p| (1..=41).all(|w| completion(
                &p.events[0],
                w
            )
            .is_some()))
        );
        let statuses: Vec<WcStatus> = (1..=41)
            .map(|w| completion(&p.events[0], w).unwrap().status)
            .collect();
        let order: Vec<u64> = p.events[0]
            .iter()
            .filter_map(|e| match e {
                Event::Completion { wc, .. } if (1..=41).contains(&wc.wr_id) => Some(wc.wr_id),
                _ => None,
            })
            .collect();
        let aborts = p.eps[1].connection_stats(s).unwrap().recv.aborted_ops;
        (cancelled, statuses, order, aborts)
    };
    let (n, statuses, order, aborts) = run(true);
    assert_eq!((n, &statuses, &order, aborts), {
        let one = run(false);
        (one.0, &one.1.clone(), &one.2.clone(), one.3)
    });
    assert_eq!(
        order,
        (1..=41).collect::<Vec<_>>(),
        "completions in posting order"
    );
    for (i, st) in statuses.iter().enumerate() {
        let wr = i as u64 + 1;
        let want = if wr <= 40 && wr % 3 == 0 {
            WcStatus::WrFlushError
        } else {
            WcStatus::Success
        };
        assert_eq!(*st, want, "work request {wr}");
    }
    assert_eq!(n, 13, "every listed WRITE was still running");
    // (Operations the responder had not begun are not counted there.)
    assert!(aborts as usize <= n);
}
