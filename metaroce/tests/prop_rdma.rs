//! Property tests over random schedules of RDMA READs, atomics, posted receives (with RNR)
//! mixed with SENDs and WRITEs, from both endpoints, under random impairment schedules.
//! Every case runs every check of `harness::Workload::check_all`; beyond those of
//! `prop_ops.rs`:
//!
//! * READs: the local buffer holds the remote bytes (the READ source is never written),
//!   already when the completion is reported; invalid READs (bad or stale rkey, out of
//!   bounds, no REMOTE_READ) complete with RemoteAccessError and write nothing; nothing lands
//!   outside the target area (canaries); the responder executes each READ exactly once
//!   (its `reads` counter equals the number of successful READs);
//! * atomics (fetch-and-add with random addends, compare-and-swap with compare values that
//!   often match, on a counter that wraps): each executes exactly once (`atomics` counter),
//!   and the original values returned together with the counter's final value are those of
//!   one serial execution of the successful atomics in some order (an Eulerian trail of the
//!   value graph), whatever the network reordered; an atomic posted after every earlier
//!   one completed sees all their effects; misaligned ones complete with
//!   RemoteInvalidRequest, ones without REMOTE_ATOMIC (or bad key, out of bounds) with
//!   RemoteAccessError, and change nothing; result slots and canaries;
//! * posted receives (an endpoint that requires them, receives posted early, late or
//!   never — then the harness posts them at the end, so SENDs wait with RNR NAKs):
//!   message k of a stream lands in receive k, whole and once, `RecvCompletion`s in posting
//!   order; a receive shorter than its message completes with LocalLengthError and the SEND
//!   with RemoteInvalidRequest;
//! * RNR retry exceeded (a stream B never gives a receive, `rnr_retry` 0..=6): the first
//!   SEND on it fails with RnrRetryExceeded after its RNR tries, the stream enters the error
//!   state — later SENDs on it (posted before or after the failure) complete with
//!   WrFlushError and are never delivered, receives B posts on it afterwards (before or
//!   after the stream abort reaches B) complete with WrFlushError — while other streams,
//!   WRITEs, READs and atomics go on and the connection stays up;
//! * completions once, in posting order per stream and among one-sided operations, with
//!   RdmaRead / CompSwap / FetchAdd
//!   and the right byte_len; READ/atomic limits (`max_rd_atomic` 1..=16 on either side).
//!
//! `PROPTEST_CASES=N` scales the number of cases; failures are persisted in
//! `tests/proptest-regressions/prop_rdma.txt` and replayed first on the next run.

mod harness;

use harness::*;
use metaroce::Event;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use proptest::test_runner::TestCaseError;
use std::time::Duration;

fn cfg(default_cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases: cases(default_cases),
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "tests/proptest-regressions/prop_rdma.txt",
        ))),
        ..ProptestConfig::default()
    }
}

/// Where READs and atomics go: mostly valid, each kind of invalid one now and then.
fn rtarget() -> impl Strategy<Value = RTarget> {
    prop_oneof![
        14 => Just(RTarget::Valid),
        1 => Just(RTarget::BadRkey),
        1 => Just(RTarget::StaleRkey),
        1 => Just(RTarget::PastEnd),
        1 => Just(RTarget::BeforeStart),
        1 => Just(RTarget::NoRight),
        2 => Just(RTarget::Misaligned),
    ]
}

/// Fetch-and-add of small or arbitrary addends; compare-and-swap with compare values near
/// the counter's initial value (so that they often match) and small or arbitrary swaps.
fn atomic_spec() -> impl Strategy<Value = AtomicSpec> {
    prop_oneof![
        prop_oneof![4 => 0u64..=4, 1 => any::<u64>()].prop_map(|add| AtomicSpec::FetchAdd { add }),
        (0u64..=6, prop_oneof![4 => 0u64..=6, 1 => any::<u64>()])
            .prop_map(|(compare, swap)| AtomicSpec::CompareSwap { compare, swap }),
    ]
}

/// Receive lengths: mostly large enough for any message, sometimes random (often too
/// short: LocalLengthError).
fn recv_len() -> impl Strategy<Value = u32> {
    prop_oneof![3 => Just(MAX_OP_LEN), 1 => op_len()]
}

fn rdma_op_kind(streams: u32) -> impl Strategy<Value = OpKind> {
    prop_oneof![
        3 => (0..streams, op_len()).prop_map(|(stream, len)| OpKind::Send { stream, len }),
        2 => (target(), 0..AREA, 0..SRC_LEN, op_len(), any::<bool>()).prop_map(
            |(target, dst_off, src_off, len, imm)| OpKind::Write {
                target,
                dst_off,
                src_off,
                len,
                imm,
            }
        ),
        3 => (rtarget(), 0..RSRC_LEN, 0..AREA, op_len()).prop_map(
            |(target, src_off, dst_off, len)| OpKind::Read {
                target,
                src_off,
                dst_off,
                len,
            }
        ),
        3 => (rtarget(), atomic_spec()).prop_map(|(target, op)| OpKind::Atomic { target, op }),
        2 => (0..streams, recv_len()).prop_map(|(stream, len)| OpKind::Recv { stream, len }),
    ]
}

fn spec_of(sides: usize, kind: impl Strategy<Value = OpKind>) -> impl Strategy<Value = OpSpec> {
    (
        0..sides,
        prop_oneof![3 => Just(0u32), 1 => 1u32..2000],
        prop::bool::weighted(0.1),
        kind,
    )
        .prop_map(|(side, gap_us, fence, kind)| OpSpec {
            side,
            gap_us,
            fence,
            kind,
        })
}

fn rdma_tuning() -> impl Strategy<Value = RdmaTuning> {
    let rd = || prop_oneof![3 => Just(16u32), 1 => Just(1u32), 1 => 2u32..=4];
    let rnr = || prop_oneof![2 => Just(12u8), 1 => 6u8..=14];
    (
        [prop::bool::weighted(0.35), prop::bool::weighted(0.35)],
        [rd(), rd()],
        [rnr(), rnr()],
    )
        .prop_map(|(posted, max_rd_atomic, min_rnr_timer)| RdmaTuning {
            posted,
            max_rd_atomic,
            min_rnr_timer,
            rnr_retry: [7, 7],
        })
}

fn schedule_of(
    ops: impl Strategy<Value = Vec<OpSpec>>,
    max_phases: usize,
    outage: bool,
) -> impl Strategy<Value = Schedule> {
    (
        any::<u64>(),
        prop::option::weighted(0.25, 0xFF_FF00u32..=0xFF_FFFF),
        ops,
        prop::collection::vec(phase(), 0..=max_phases),
        tuning(),
        rdma_tuning(),
        (0u32..20_000, 300u32..3_000)
            .prop_map(move |(start_us, len_ms)| outage.then_some(Outage { start_us, len_ms })),
    )
        .prop_map(
            |(seed, initial_psn, ops, mut phases, tuning, rdma, outage)| {
                // As in prop_ops: bursts stay below what can exhaust the retry budget.
                let paths = tuning.paths[0].min(tuning.paths[1]);
                for p in &mut phases {
                    if let ActSpec::Burst(n) = &mut p.act {
                        *n = (*n).min(8 * paths);
                    }
                }
                Schedule {
                    seed,
                    initial_psn,
                    impair_handshake: false,
                    ops,
                    phases,
                    outage,
                    close: None,
                    tuning,
                    rdma,
                    starved: [Vec::new(), Vec::new()],
                    then: Vec::new(),
                    then_early: false,
                }
            },
        )
}

fn schedule(max_ops: usize, max_phases: usize, outage: bool) -> impl Strategy<Value = Schedule> {
    schedule_of(
        prop::collection::vec(spec_of(2, rdma_op_kind(4)), 1..=max_ops),
        max_phases,
        outage,
    )
}

fn run(s: &Schedule) -> Result<Workload, String> {
    run_schedule(s)
}

proptest! {
    #![proptest_config(cfg(256))]

    /// No long outage: every valid operation succeeds, every invalid one gets its error,
    /// READ bytes, atomics exactly once and serializable, posted receives in order.
    #[test]
    fn rdma_ops_under_benign_impairments(s in schedule(24, 5, false)) {
        if let Err(e) = run(&s) {
            prop_assert!(false, "{}", e);
        }
    }
}

proptest! {
    #![proptest_config(cfg(96))]

    /// A long total outage somewhere in the run: the connection may fail (IBA pattern);
    /// READs and atomics that succeeded executed exactly once, nothing else changed memory
    /// but the ones whose fate the failure left open; receives are flushed.
    #[test]
    fn rdma_ops_with_long_outage(s in schedule(16, 3, true)) {
        if let Err(e) = run(&s) {
            prop_assert!(false, "{}", e);
        }
    }
}

proptest! {
    #![proptest_config(cfg(96))]

    /// A close from either side at a random point: pending READs and atomics are flushed,
    /// posted receives complete with WrFlushError, nothing executes twice.
    #[test]
    fn rdma_close_at_a_random_point(
        s in schedule(16, 3, false),
        side in 0usize..2,
        at in 0usize..20,
    ) {
        let mut s = s;
        s.close = Some((side, at));
        if let Err(e) = run(&s) {
            prop_assert!(false, "{}", e);
        }
    }
}

proptest! {
    #![proptest_config(cfg(128))]

    /// Many atomics from both sides (each on the other's counter), with duplication, late
    /// copies and reordering among the impairments and `max_rd_atomic` from 1 to 16: every
    /// atomic executes exactly once and the results are those of a serial order.
    #[test]
    fn atomics_execute_once_in_some_serial_order(
        s in schedule_of(
            prop::collection::vec(
                spec_of(
                    2,
                    prop_oneof![
                        6 => (Just(RTarget::Valid), atomic_spec())
                            .prop_map(|(target, op)| OpKind::Atomic { target, op }),
                        1 => (rtarget(), atomic_spec())
                            .prop_map(|(target, op)| OpKind::Atomic { target, op }),
                        1 => (Just(RTarget::Valid), 0..RSRC_LEN, 0..AREA, op_len())
                            .prop_map(|(target, src_off, dst_off, len)| OpKind::Read {
                                target, src_off, dst_off, len,
                            }),
                    ],
                ),
                1..=40,
            ),
            4,
            false,
        )
    ) {
        if let Err(e) = run(&s) {
            prop_assert!(false, "{}", e);
        }
    }
}

/// A stream schedule for the RNR properties: A's SENDs on streams 0..3, B's receives
/// (possibly none: the harness posts the missing ones late), other traffic from both sides.
fn rnr_ops() -> impl Strategy<Value = Vec<OpSpec>> {
    prop::collection::vec(
        prop_oneof![
            4 => (0u32..3, op_len()).prop_map(|(stream, len)| OpSpec::send(0, stream, len)),
            3 => (0u32..3, recv_len()).prop_map(|(stream, len)| OpSpec::recv(1, stream, len)),
            1 => spec_of(2, rdma_op_kind(3)),
        ]
        .prop_flat_map(|op| {
            (Just(op), prop_oneof![2 => Just(0u32), 1 => 1u32..1500]).prop_map(|(mut op, gap)| {
                op.gap_us = gap;
                op
            })
        }),
        1..=20,
    )
}

proptest! {
    #![proptest_config(cfg(128))]

    /// B requires posted receives, and receives come early, late or only at the end: SENDs
    /// that find no receive get RNR NAKs and retry (rnr_retry 7: forever) until one is
    /// posted; every message lands in its receive (in order, once); receives that are too
    /// short end in LocalLengthError / RemoteInvalidRequest and the stream goes on.
    #[test]
    fn late_receives_wait_with_rnr(
        s in schedule_of(rnr_ops(), 3, false),
    ) {
        let mut s = s;
        s.rdma.posted[1] = true;
        let w = match run(&s) {
            Ok(w) => w,
            Err(e) => { prop_assert!(false, "{}", e); unreachable!() }
        };
        // Without impairments (and no READ/atomic limit holding SENDs back), a SEND posted
        // well before its receive meets an RNR NAK.
        let late = (0..3).any(|st| {
            w.sends_on(0, st).iter().zip(w.recvs_on(1, st)).any(|(&(i, _), r)| {
                w.posted[0][i].posted_at + Duration::from_micros(30) < r.posted_at
            })
        });
        if s.phases.is_empty() && s.rdma.max_rd_atomic[0] == 16 && late {
            let rnr = w.stats(1).map_or(0, |st| st.recv.rnr_naks);
            prop_assert!(rnr > 0, "receives posted late but no RNR NAK");
        }
    }
}

/// The operations of a case `late_receives_wait_with_rnr` found (shrunk; seed
/// `abec8dc7…` in the regressions file): on stream 2, message 0 is RNR-NAKed twice (no
/// receive yet), message 1 (1,077 B, two packets) once, and message 2, beyond the stream
/// window of 2, gets a flow-control RNR NAK, so the stream waits with one probe; message
/// 1's wait ends first and it becomes the probe. `second_recv` is the length of the
/// receive for message 1, posted `second_gap_us` after the others.
fn probe_order_schedule(second_recv: u32, second_gap_us: u32) -> Schedule {
    let at = |side, gap_us, op: OpSpec| OpSpec { side, gap_us, ..op };
    let mut s = Schedule::new(
        0,
        vec![
            at(0, 0, OpSpec::send(0, 2, 0)),
            at(0, 328, OpSpec::send(0, 2, 1077)),
            at(0, 64, OpSpec::send(0, 1, 39)),
            at(0, 278, OpSpec::send(0, 1, 13)),
            at(1, 0, OpSpec::recv(1, 2, 20000)),
            at(0, 0, OpSpec::send(0, 2, 0)),
            at(1, second_gap_us, OpSpec::recv(1, 2, second_recv)),
        ],
    );
    s.tuning = Tuning {
        recv_buffer: 24744,
        stream_window: 2,
        paths: [2, 8],
        ..Tuning::default()
    };
    s.rdma.posted = [false, true];
    s
}

/// A message whose receive is too short, arriving while an earlier message of its stream
/// is still undelivered (waiting out an RNR NAK), waits for it with a flow-control RNR NAK:
/// the length error is due only once the messages before it are delivered. The receiver
/// used to drop it without an answer, so the sender timed it out until the connection
/// failed (RetryExceeded) — on a clean network.
#[test]
fn a_too_long_message_behind_an_undelivered_one_waits_without_costing_retries() {
    let w = run(&probe_order_schedule(1044, 0)).unwrap_or_else(|e| panic!("{e}"));
    let st = w.stats(1).expect("connection stats");
    assert!(
        st.recv.stream_window_naks > 0,
        "no flow-control RNR NAK: {st:?}"
    );
    // The run's own checks hold the rest: SEND 1 failed RemoteInvalidRequest, its receive
    // LocalLengthError, the connection stayed up.
}

/// The probe of a stream waiting out a flow-control RNR NAK is its earliest refused
/// segment: a message whose receive is posted is not held behind a later probe that
/// keeps meeting plain RNR NAKs until its own receive comes (5 ms later here). It used to
/// be, and with a finite `rnr_retry` it failed with the stream when the later one ran out
/// of RNR retries.
#[test]
fn an_earlier_message_probes_before_a_later_one_still_without_a_receive() {
    let gap = 5_000;
    let w = run(&probe_order_schedule(2000, gap)).unwrap_or_else(|e| panic!("{e}"));
    let done = completed_at(&w, 0, 0).expect("SEND 0 completed");
    let second_recv = w.recvs[1]
        .iter()
        .filter(|r| r.stream == 2)
        .nth(1)
        .expect("second receive on stream 2")
        .posted_at;
    assert!(
        done < second_recv,
        "SEND 0 (its receive posted at the start) completed at {done:?}, only after the \
         receive of SEND 1 was posted at {second_recv:?}"
    );
}

/// When operation `i` of `side` completed (virtual time since the start).
fn completed_at(w: &Workload, side: usize, i: usize) -> Option<Duration> {
    let (c, wr) = (w.conns[side], w.posted[side][i].wr_id);
    w.net.events[side]
        .iter()
        .zip(&w.net.event_times[side])
        .find_map(|(e, t)| match e {
            Event::Completion { conn, wc } if *conn == c && wc.wr_id == wr => {
                Some(*t - w.net.start)
            }
            _ => None,
        })
}

/// The RNR checks of a run in which B starved stream 0: the first SEND on it failed only
/// after rnr_retry RNR waits, B refused it rnr_retry + 1 times, and B put the stream in
/// the error state once; the connection stayed up.
fn check_starved_stream(w: &Workload, rnr_retry: u8, timer: u8) -> Result<(), TestCaseError> {
    prop_assert!(w.net.lost(0, w.conns[0]).is_none() && w.net.lost(1, w.conns[1]).is_none());
    let Some(&(first, _)) = w.sends_on(0, 0).first() else {
        return Ok(());
    };
    let p = &w.posted[0][first];
    let wait = metaroce::conn::rnr_timer(timer) * rnr_retry as u32;
    let at = completed_at(w, 0, first).unwrap();
    prop_assert!(
        at >= p.posted_at + wait,
        "SEND {} failed after {:?}, before {} RNR waits of {:?}",
        p.wr_id,
        at - p.posted_at,
        rnr_retry,
        metaroce::conn::rnr_timer(timer)
    );
    let recv = w.stats(1).unwrap().recv;
    prop_assert!(
        recv.rnr_naks > rnr_retry as u64,
        "{} RNR NAKs for a starved SEND with rnr_retry {}",
        recv.rnr_naks,
        rnr_retry
    );
    prop_assert_eq!(recv.dead_streams, 1, "streams B put in the error state");
    Ok(())
}

proptest! {
    #![proptest_config(cfg(96))]

    /// B requires posted receives and never posts one on stream 0 (rnr_retry 0..=6 at A;
    /// any stream window): the first SEND on stream 0 completes with RnrRetryExceeded, and
    /// only after it was tried rnr_retry + 1 times, waiting the RNR timer between tries;
    /// stream 0 enters the error state, so every later SEND on it completes with
    /// WrFlushError (the model predicts both, `Workload::expected`) and is never
    /// delivered; every other operation (other streams, READs, atomics, WRITEs, from both
    /// sides) completes as usual and the connection stays up.
    #[test]
    fn rnr_retry_exceeded_on_a_starved_stream(
        s in schedule_of(rnr_ops(), 2, false),
        rnr_retry in 0u8..=6,
        timer in 1u8..=6,
    ) {
        let mut s = s;
        s.rdma.posted[1] = true;
        s.rdma.rnr_retry[0] = rnr_retry;
        s.rdma.min_rnr_timer[1] = timer;
        s.starved[1] = vec![0];
        let w = match run(&s) {
            Ok(w) => w,
            Err(e) => { prop_assert!(false, "{}", e); unreachable!() }
        };
        check_starved_stream(&w, rnr_retry, timer)?;
    }
}

proptest! {
    #![proptest_config(cfg(96))]

    /// A's first SEND on stream 0 exhausts its RNR retries (B posts no receive on it); once
    /// it failed (and, in half the cases, once B put the stream in the error state), A
    /// posts more SENDs on stream 0 and the other streams, B posts receives on stream 0
    /// (and the others), and both sides
    /// go on with READs, atomics and WRITEs. Every later SEND on stream 0 completes with
    /// WrFlushError and is never delivered, every receive on stream 0 completes with
    /// WrFlushError, the other streams deliver everything in order into their receives,
    /// and no SEND completes with Success unless its message arrived (checked against the
    /// model, `Workload::check_all`).
    #[test]
    fn sends_and_receives_after_rnr_retry_exceeded(
        s in schedule_of(rnr_ops(), 2, false),
        first_len in op_len(),
        then in rnr_ops(),
        more_on_0 in prop::collection::vec((op_len(), recv_len()), 1..=4),
        rnr_retry in 0u8..=6,
        timer in 1u8..=6,
        early in any::<bool>(),
    ) {
        let mut s = s;
        s.rdma.posted[1] = true;
        s.rdma.rnr_retry[0] = rnr_retry;
        s.rdma.min_rnr_timer[1] = timer;
        s.starved[1] = vec![0];
        s.ops.insert(0, OpSpec::send(0, 0, first_len));
        s.then = then;
        if early {
            // Receives on stream 0 may come before B learns that the stream is dead; no
            // impairment may then deliver a stale copy of the failed message (see
            // `Schedule::then_early`).
            s.then_early = true;
            s.phases.retain(|p| {
                !matches!(p.act, ActSpec::Dup(_) | ActSpec::Late(..) | ActSpec::Reorder(..))
            });
        }
        // Make sure stream 0 sees both after the failure, interleaved with the rest.
        for (k, (len, rlen)) in more_on_0.into_iter().enumerate() {
            let at = (2 * k).min(s.then.len());
            s.then.insert(at, OpSpec::recv(1, 0, rlen));
            s.then.insert(at, OpSpec::send(0, 0, len));
        }
        let w = match run(&s) {
            Ok(w) => w,
            Err(e) => { prop_assert!(false, "{}", e); unreachable!() }
        };
        check_starved_stream(&w, rnr_retry, timer)?;
        // Receives on the dead stream were posted and flushed (check_recvs compares them
        // with the model; here: the property exercised it).
        let flushed = w
            .net
            .recv_completions(1, w.conns[1])
            .iter()
            .filter(|(st, wc)| *st == 0 && wc.status == metaroce::WcStatus::WrFlushError)
            .count();
        prop_assert!(flushed >= 1, "no receive on the dead stream was flushed");
    }
}

/// Not a property: what the generators produce. Runs `PROPTEST_CASES` (default 400)
/// schedules of `rdma_ops_under_benign_impairments` (seed byte `SEED`, default 0) and prints
/// completion counts by opcode and status, receive completions, RNR NAKs, slow and failing
/// cases. `cargo test -p metaroce --test prop_rdma coverage_report -- --ignored --nocapture`
#[test]
#[ignore]
fn coverage_report() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{RngAlgorithm, TestRng, TestRunner};
    let seed = std::env::var("SEED").map_or(0, |v| v.parse::<u8>().unwrap());
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]);
    let mut runner = TestRunner::new_with_rng(ProptestConfig::default(), rng);
    let strat = schedule(24, 5, false);
    let mut tot: std::collections::BTreeMap<String, u64> = Default::default();
    for k in 0..cases(400) {
        let s = strat.new_tree(&mut runner).unwrap().current();
        let t = std::time::Instant::now();
        let r = run(&s);
        let el = t.elapsed();
        if let Ok(w) = &r {
            for side in 0..2 {
                let wcs = w.net.completions(side, w.conns[side]);
                for (p, wc) in w.posted[side].iter().zip(wcs) {
                    *tot.entry(format!("{:?} {:?}", p.opcode(), wc.status))
                        .or_default() += 1;
                }
                for (_, wc) in w.net.recv_completions(side, w.conns[side]) {
                    *tot.entry(format!("Recv {:?}", wc.status)).or_default() += 1;
                }
                if let Some(st) = w.stats(side) {
                    *tot.entry("RNR NAKs".into()).or_default() += st.recv.rnr_naks;
                }
            }
        }
        if el > Duration::from_millis(300) || r.is_err() {
            eprintln!("case {k}: {el:?} {:?}\n  {s:?}", r.as_ref().err());
        }
    }
    eprintln!("{tot:#?}");
}

/// A starved stream (B never posts a receive on stream 0) with a short SEND followed by a
/// five-packet one, copies from A to B reordered by up to 2 ms, `rnr_retry` 3, and then
/// receives posted on stream 0 once B heard of the failure, while A sends more on it.
fn later_send_schedule(seed: u64) -> Schedule {
    let mut s = Schedule::new(seed, vec![OpSpec::send(0, 0, 2), OpSpec::send(0, 0, 1099)]);
    s.phases = vec![Phase {
        start_us: 0,
        len_us: 20_000,
        dir: DirSel::AtoB,
        kind: KindSel::Any,
        path: None,
        act: ActSpec::Reorder(46, 2079),
    }];
    s.tuning.pmtu = [256, 1024];
    s.rdma.posted[1] = true;
    s.rdma.rnr_retry[0] = 3;
    s.rdma.min_rnr_timer[1] = 3;
    s.starved[1] = vec![0];
    s.then = vec![
        OpSpec::recv(1, 0, 20000),
        OpSpec::send(0, 0, 23),
        OpSpec::recv(1, 0, 20000),
        OpSpec::send(0, 2, 100),
        OpSpec::recv(1, 2, 20000),
    ];
    s
}

/// Only the message whose receive is next draws RNR NAKs that count against the sender's
/// `rnr_retry`; a later message without a receive waits with a flow-control RNR NAK. When
/// the later one's NAKs counted, it could run out of RNR retries before the earlier one:
/// the stream was aborted from the later message, B took that for the stream's end, and a
/// delayed copy of the earlier SEND — which then failed with RnrRetryExceeded at A — found
/// a receive posted meanwhile and completed Success at B (found by
/// `sends_and_receives_after_rnr_retry_exceeded` in CI, `dfc06bca…` in the regressions
/// file; this is the same case, shrunk by hand). Before the fix, 18 of the seeds 0..3000
/// of this schedule delivered the failed SEND, among them these; none does now.
#[test]
fn a_later_send_never_runs_out_of_rnr_retries_before_an_earlier_one() {
    let mut waited = 0;
    for seed in [135, 193, 397, 507, 1123, 1199] {
        let w = run(&later_send_schedule(seed)).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        check_starved_stream(&w, 3, 3).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        waited += w.stats(1).unwrap().recv.stream_window_naks;
    }
    assert!(
        waited > 0,
        "no later SEND waited with a flow-control RNR NAK"
    );
}
