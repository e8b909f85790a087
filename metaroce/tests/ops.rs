//! RDMA READ, atomics, posted receives and RNR, two endpoints in memory with a virtual
//! clock under loss, reordering and duplication.

use bytes::Bytes;
use metaroce::testing::{Impair, Pair};
use metaroce::{
    Access, AtomicOp, AtomicRequest, Event, ReadRequest, RecvRequest, WcOpcode, WcStatus,
    WorkCompletion,
};
use std::time::Duration;

fn completions(events: &[Event]) -> Vec<WorkCompletion> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Completion { wc, .. } => Some(*wc),
            _ => None,
        })
        .collect()
}

fn lossy() -> Impair {
    Impair {
        loss: 0.05,
        dup: 0.05,
        reorder: 0.1,
        ..Default::default()
    }
}

#[test]
fn read_places_remote_bytes_under_impairment() {
    for seed in 0..5 {
        let mut p = Pair::impaired(seed, lossy());
        let (c, _) = p.connect();
        let n = 200_003usize;
        let src: Vec<u8> = (0..n).map(|i| (i * 13 + seed as usize) as u8).collect();
        let remote = p.eps[1].register_mr(src.clone(), Access::REMOTE_READ);
        let local = p.eps[0].register_mr(vec![0; n + 64], Access::LOCAL_WRITE);
        // Several READs, more than max_rd_atomic (16) of them, so some wait.
        let chunk = 10_000;
        let mut wr = 0;
        for off in (0..n).step_by(chunk) {
            let len = chunk.min(n - off) as u32;
            let req = ReadRequest {
                wr_id: wr,
                lkey: local.lkey,
                local_offset: off as u64,
                len,
                remote_addr: remote.addr + off as u64,
                rkey: remote.rkey,
            };
            p.eps[0].post_read(c, req).unwrap();
            wr += 1;
        }
        assert!(
            p.run_until(Duration::from_secs(60), |p| completions(&p.events[0]).len()
                as u64
                == wr),
            "seed {seed}"
        );
        let wcs = completions(&p.events[0]);
        for (i, wc) in wcs.iter().enumerate() {
            assert_eq!(
                (wc.wr_id, wc.status, wc.opcode),
                (i as u64, WcStatus::Success, WcOpcode::RdmaRead)
            );
        }
        let got = p.eps[0].mr_read(local.lkey, 0, (n + 64) as u64).unwrap();
        assert_eq!(&got[..n], &src[..], "seed {seed}: READ data differs");
        assert!(
            got[n..].iter().all(|&b| b == 0),
            "READ wrote past its buffer"
        );
    }
}

#[test]
fn read_without_remote_read_right_is_refused() {
    let mut p = Pair::impaired(1, Impair::default());
    let (c, _) = p.connect();
    let remote = p.eps[1].register_mr(vec![9; 4096], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let local = p.eps[0].register_mr(vec![0; 4096], Access::LOCAL_WRITE);
    let req = ReadRequest {
        wr_id: 1,
        lkey: local.lkey,
        local_offset: 0,
        len: 4096,
        remote_addr: remote.addr,
        rkey: remote.rkey,
    };
    p.eps[0].post_read(c, req).unwrap();
    let bad_bounds = ReadRequest {
        wr_id: 2,
        remote_addr: remote.addr + 1,
        ..req
    };
    p.eps[0].post_read(c, bad_bounds).unwrap();
    assert!(
        p.run_until(Duration::from_secs(10), |p| completions(&p.events[0]).len()
            == 2)
    );
    assert!(completions(&p.events[0])
        .iter()
        .all(|wc| wc.status == WcStatus::RemoteAccessError));
    assert!(p.eps[0]
        .mr_read(local.lkey, 0, 4096)
        .unwrap()
        .iter()
        .all(|&b| b == 0));
    // A READ into a local region without LOCAL_WRITE is refused at post time.
    let ro = p.eps[0].register_mr(vec![0; 16], Access::REMOTE_READ);
    let err = p.eps[0]
        .post_read(
            c,
            ReadRequest {
                lkey: ro.lkey,
                len: 16,
                ..req
            },
        )
        .unwrap_err();
    assert!(matches!(
        err,
        metaroce::PostError::LocalMemory(metaroce::MrError::AccessDenied)
    ));
}

#[test]
fn atomics_execute_exactly_once_under_retransmission() {
    for seed in 0..5 {
        let mut p = Pair::impaired(
            seed,
            Impair {
                loss: 0.15,
                dup: 0.15,
                reorder: 0.1,
                ..Default::default()
            },
        );
        let (c, _) = p.connect();
        let counter =
            p.eps[1].register_mr(vec![0; 16], Access::LOCAL_WRITE | Access::REMOTE_ATOMIC);
        let results = p.eps[0].register_mr(vec![0; 8 * 100], Access::LOCAL_WRITE);
        for i in 0..100u64 {
            let req = AtomicRequest {
                wr_id: i,
                lkey: results.lkey,
                local_offset: i * 8,
                remote_addr: counter.addr,
                rkey: counter.rkey,
                op: AtomicOp::FetchAdd { add: 3 },
            };
            p.eps[0].post_atomic(c, req).unwrap();
        }
        assert!(
            p.run_until(Duration::from_secs(60), |p| completions(&p.events[0]).len()
                == 100),
            "seed {seed}"
        );
        let wcs = completions(&p.events[0]);
        assert!(wcs.iter().enumerate().all(|(i, wc)| wc.wr_id == i as u64
            && wc.status == WcStatus::Success
            && wc.opcode == WcOpcode::FetchAdd));
        let v = u64::from_le_bytes(
            p.eps[1]
                .mr_read(counter.lkey, 0, 8)
                .unwrap()
                .try_into()
                .unwrap(),
        );
        assert_eq!(
            v, 300,
            "seed {seed}: every fetch-and-add must execute exactly once"
        );
        // The fetched values are the distinct multiples of 3 from 0 to 297.
        let res = p.eps[0].mr_read(results.lkey, 0, 800).unwrap();
        let mut olds: Vec<u64> = res
            .chunks(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        olds.sort_unstable();
        assert_eq!(olds, (0..100).map(|i| i * 3).collect::<Vec<_>>());
    }
}

#[test]
fn compare_swap_and_atomic_errors() {
    let mut p = Pair::impaired(2, Impair::default());
    let (c, _) = p.connect();
    let target = p.eps[1].register_mr(vec![0; 16], Access::LOCAL_WRITE | Access::REMOTE_ATOMIC);
    let no_atomic = p.eps[1].register_mr(vec![0; 16], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let res = p.eps[0].register_mr(vec![0; 64], Access::LOCAL_WRITE);
    let cas = |wr_id, off: u64, addr, rkey, compare, swap| AtomicRequest {
        wr_id,
        lkey: res.lkey,
        local_offset: off,
        remote_addr: addr,
        rkey,
        op: AtomicOp::CompareSwap { compare, swap },
    };
    p.eps[0]
        .post_atomic(c, cas(0, 0, target.addr, target.rkey, 0, 42))
        .unwrap(); // matches: 0 -> 42
    p.eps[0]
        .post_atomic(c, cas(1, 8, target.addr, target.rkey, 0, 7))
        .unwrap(); // no match: stays 42
    p.eps[0]
        .post_atomic(c, cas(2, 16, target.addr + 4, target.rkey, 0, 1))
        .unwrap(); // misaligned
    p.eps[0]
        .post_atomic(c, cas(3, 24, no_atomic.addr, no_atomic.rkey, 0, 1))
        .unwrap(); // no right
    assert!(
        p.run_until(Duration::from_secs(10), |p| completions(&p.events[0]).len()
            == 4)
    );
    let st: Vec<_> = completions(&p.events[0]).iter().map(|w| w.status).collect();
    assert_eq!(
        st,
        vec![
            WcStatus::Success,
            WcStatus::Success,
            WcStatus::RemoteInvalidRequest,
            WcStatus::RemoteAccessError
        ]
    );
    let r = p.eps[0].mr_read(res.lkey, 0, 16).unwrap();
    assert_eq!(u64::from_le_bytes(r[..8].try_into().unwrap()), 0);
    assert_eq!(u64::from_le_bytes(r[8..16].try_into().unwrap()), 42);
    assert_eq!(
        u64::from_le_bytes(
            p.eps[1]
                .mr_read(target.lkey, 0, 8)
                .unwrap()
                .try_into()
                .unwrap()
        ),
        42
    );
    assert!(p.eps[1]
        .mr_read(no_atomic.lkey, 0, 16)
        .unwrap()
        .iter()
        .all(|&b| b == 0));
}

#[test]
fn posted_receives_take_sends_in_order_and_rnr_waits_for_them() {
    let mut p = Pair::impaired(3, lossy());
    let (c, s) = p.connect();
    let buf = p.eps[1].register_mr(vec![0; 64 * 1024], Access::LOCAL_WRITE);
    // One receive posted, three messages sent: the first lands, the others get RNR NAKs
    // until receives are posted.
    p.eps[1]
        .post_recv(
            s,
            5,
            RecvRequest {
                wr_id: 100,
                lkey: buf.lkey,
                offset: 0,
                len: 8192,
            },
        )
        .unwrap();
    for i in 0..3u8 {
        p.eps[0]
            .post_send(c, 5, i as u64, Bytes::from(vec![i + 1; 5000]))
            .unwrap();
    }
    let recvs = |p: &Pair| {
        p.events[1]
            .iter()
            .filter_map(|e| match e {
                Event::RecvCompletion { wc, .. } => Some(*wc),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    // `run_until` limits count from the pair's start; the handshake (one more round trip
    // since the retry cookie, longer when a handshake packet is lost) is not part of them.
    let t0 = p.now - p.start;
    assert!(p.run_until(t0 + Duration::from_millis(20), |p| recvs(p).len() == 1));
    p.run_until(t0 + Duration::from_millis(30), |_| false);
    assert_eq!(
        recvs(&p).len(),
        1,
        "a SEND without a posted receive must not complete"
    );
    assert!(
        p.eps[1].connection_stats(s).unwrap().recv.rnr_naks > 0,
        "RNR NAKs expected"
    );
    p.eps[1]
        .post_recv(
            s,
            5,
            RecvRequest {
                wr_id: 101,
                lkey: buf.lkey,
                offset: 8192,
                len: 8192,
            },
        )
        .unwrap();
    p.eps[1]
        .post_recv(
            s,
            5,
            RecvRequest {
                wr_id: 102,
                lkey: buf.lkey,
                offset: 16384,
                len: 8192,
            },
        )
        .unwrap();
    assert!(p.run_until(Duration::from_secs(20), |p| recvs(p).len() == 3
        && completions(&p.events[0]).len() == 3));
    let r = recvs(&p);
    assert_eq!(
        r.iter()
            .map(|w| (w.wr_id, w.status, w.byte_len))
            .collect::<Vec<_>>(),
        vec![
            (100, WcStatus::Success, 5000),
            (101, WcStatus::Success, 5000),
            (102, WcStatus::Success, 5000)
        ]
    );
    let data = p.eps[1].mr_read(buf.lkey, 0, 3 * 8192).unwrap();
    for i in 0..3 {
        assert!(data[i * 8192..i * 8192 + 5000]
            .iter()
            .all(|&b| b == i as u8 + 1));
        assert!(data[i * 8192 + 5000..(i + 1) * 8192]
            .iter()
            .all(|&b| b == 0));
    }
    assert!(completions(&p.events[0])
        .iter()
        .all(|wc| wc.status == WcStatus::Success));
    assert!(
        !p.events[1]
            .iter()
            .any(|e| matches!(e, Event::Message { .. })),
        "posted-mode streams use no library buffers"
    );
}

#[test]
fn rnr_retry_exceeded_and_length_error() {
    let mut a = metaroce::testing::pair_config(0, 4);
    a.transport.rnr_retry = 2;
    let mut b = metaroce::testing::pair_config(1, 4);
    b.transport.require_posted_receives = true;
    b.transport.min_rnr_timer = 1; // 10 µs
    let mut p = Pair::impaired_with_configs(4, Impair::default(), a, b);
    let (c, s) = p.connect();
    p.eps[0]
        .post_send(c, 0, 1, Bytes::from_static(b"nobody listens"))
        .unwrap();
    assert!(
        p.run_until(Duration::from_secs(10), |p| completions(&p.events[0]).len()
            == 1)
    );
    assert_eq!(
        completions(&p.events[0])[0].status,
        WcStatus::RnrRetryExceeded
    );
    // A message longer than the posted receive: LocalLengthError there, RemoteInvalidRequest here.
    let buf = p.eps[1].register_mr(vec![0; 100], Access::LOCAL_WRITE);
    p.eps[1]
        .post_recv(
            s,
            1,
            RecvRequest {
                wr_id: 7,
                lkey: buf.lkey,
                offset: 0,
                len: 10,
            },
        )
        .unwrap();
    p.eps[0]
        .post_send(
            c,
            1,
            2,
            Bytes::from_static(b"this is longer than ten bytes"),
        )
        .unwrap();
    assert!(
        p.run_until(Duration::from_secs(10), |p| completions(&p.events[0]).len()
            == 2)
    );
    assert_eq!(
        completions(&p.events[0])[1].status,
        WcStatus::RemoteInvalidRequest
    );
    assert!(p.events[1].iter().any(|e| matches!(e, Event::RecvCompletion { wc, .. } if wc.wr_id == 7 && wc.status == WcStatus::LocalLengthError)));
    assert!(p.eps[1]
        .mr_read(buf.lkey, 0, 100)
        .unwrap()
        .iter()
        .all(|&b| b == 0));
}

#[test]
fn posted_receives_are_flushed_when_the_connection_closes() {
    let mut p = Pair::impaired(6, Impair::default());
    let (_c, s) = p.connect();
    let buf = p.eps[1].register_mr(vec![0; 100], Access::LOCAL_WRITE);
    p.eps[1]
        .post_recv(
            s,
            1,
            RecvRequest {
                wr_id: 9,
                lkey: buf.lkey,
                offset: 0,
                len: 100,
            },
        )
        .unwrap();
    let now = p.now;
    p.eps[1].close(now, s);
    p.flush();
    assert!(p.events[1].iter().any(|e| matches!(e, Event::RecvCompletion { wc, .. } if wc.wr_id == 9 && wc.status == WcStatus::WrFlushError)));
}
