//! Property tests over random schedules of operations (SENDs on streams, WRITEs and
//! WRITEs with immediate, valid and invalid, from both endpoints) under random impairment
//! schedules. Every case runs every check of `harness::Workload::check_all`:
//!
//! * each message delivered exactly once and in order within its stream, right bytes;
//! * WRITE bytes equal the source; canaries untouched; refused WRITEs write nothing; the
//!   region without REMOTE_WRITE never changes; a WRITE posted after everything before it
//!   completed is never overwritten by stale (late, duplicated) packets of earlier ones;
//! * one completion per operation, in posting order per stream and among one-sided
//!   operations (a SEND after the one-sided operations posted before it), right opcode and
//!   length; Success for
//!   valid operations, RemoteAccessError for invalid ones; RetryExceeded / WrFlushError only
//!   when the schedule has a long outage (then ConnectionLost follows, last);
//! * immediates exactly once per successful WRITE with immediate, never for refused ones;
//! * liveness: everything completes within a bound of virtual time, then the network goes
//!   quiet (no timer left armed); no panic, no livelock (step bound).
//!
//! `PROPTEST_CASES=N` scales the number of cases; failures are persisted in
//! `tests/proptest-regressions/prop_ops.txt` and replayed first on the next run.

mod harness;

use harness::*;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

fn cfg(default_cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases: cases(default_cases),
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "tests/proptest-regressions/prop_ops.txt",
        ))),
        ..ProptestConfig::default()
    }
}

fn schedule(
    max_ops: usize,
    sides: usize,
    max_phases: usize,
    outage: bool,
) -> impl Strategy<Value = Schedule> {
    (
        any::<u64>(),
        prop::option::weighted(0.25, 0xFF_FF00u32..=0xFF_FFFF),
        prop::bool::weighted(0.2),
        prop::collection::vec(op_spec(sides, 6), 1..=max_ops),
        prop::collection::vec(phase(), 0..=max_phases),
        tuning(),
        (0u32..20_000, 300u32..3_000)
            .prop_map(move |(start_us, len_ms)| outage.then_some(Outage { start_us, len_ms })),
    )
        .prop_map(
            |(seed, initial_psn, impair_handshake, ops, mut phases, tuning, outage)| {
                // Failing a connection takes retry_count + 1 = 8 timeouts on every path it
                // uses, each losing at least a probe and a retransmission (or their ACKs):
                // at least 16 packets per path. A burst of at most half of that is benign
                // even when traffic is sparse.
                let paths = tuning.paths[0].min(tuning.paths[1]);
                for p in &mut phases {
                    if let ActSpec::Burst(n) = &mut p.act {
                        *n = (*n).min(8 * paths);
                    }
                }
                Schedule {
                    seed,
                    initial_psn,
                    impair_handshake,
                    ops,
                    phases,
                    outage,
                    close: None,
                    tuning,
                    rdma: RdmaTuning::default(),
                    starved: [Vec::new(), Vec::new()],
                    then: Vec::new(),
                    then_early: false,
                }
            },
        )
}

proptest! {
    #![proptest_config(cfg(384))]

    /// No long outage: every valid operation succeeds, every invalid one gets
    /// RemoteAccessError, all data and memory checks hold.
    #[test]
    fn ops_under_benign_impairments(s in schedule(24, 2, 5, false)) {
        if let Err(e) = run_schedule(&s) {
            prop_assert!(false, "{}", e);
        }
    }
}

proptest! {
    #![proptest_config(cfg(256))]

    /// A long total outage somewhere in the run: the connection may fail, and then only
    /// in the IBA pattern (one RetryExceeded, WrFlushError for the rest, ConnectionLost
    /// last); everything that succeeded is delivered / placed exactly once.
    #[test]
    fn ops_with_long_outage(s in schedule(16, 2, 3, true)) {
        if let Err(e) = run_schedule(&s) {
            prop_assert!(false, "{}", e);
        }
    }

}

proptest! {
    #![proptest_config(cfg(128))]

    /// The network goes down for good while operations are pending: the oldest pending one
    /// completes with RetryExceeded, the rest with WrFlushError, ConnectionLost follows,
    /// and the run ends (bounded virtual time).
    #[test]
    fn permanent_outage_fails_cleanly(
        seed in any::<u64>(),
        ops in prop::collection::vec(op_spec(1, 4), 1..=10),
    ) {
        let mut ops = ops;
        ops[0].gap_us = 0;
        ops[0].fence = false;
        let mut s = Schedule::new(seed, ops);
        s.outage = Some(Outage { start_us: 0, len_ms: 1_000_000 });
        let w = match run_schedule(&s) {
            Ok(w) => w,
            Err(e) => { prop_assert!(false, "{}", e); unreachable!() }
        };
        let c = w.conns[0];
        prop_assert_eq!(w.net.lost(0, c), Some(metaroce::ConnectionError::RetryExceeded));
        let statuses: Vec<_> = w.net.completions(0, c).iter().map(|x| x.status).collect();
        prop_assert_eq!(statuses[0], metaroce::WcStatus::RetryExceeded);
        prop_assert!(statuses[1..].iter().all(|s| *s == metaroce::WcStatus::WrFlushError),
            "{:?}", statuses);
        prop_assert!(w.net.elapsed() < std::time::Duration::from_secs(60),
            "failure took {:?}", w.net.elapsed());
    }

}

proptest! {
    #![proptest_config(cfg(256))]

    /// A close from either side at a random point: the closing side's pending operations
    /// are flushed (WrFlushError) and it reports LocallyClosed; the peer reports
    /// ClosedByPeer (or, if the best-effort CLOSE is lost, fails its pending operations
    /// with RetryExceeded); nothing is delivered twice, nothing hangs.
    #[test]
    fn close_at_a_random_point(
        s in schedule(16, 2, 3, false),
        side in 0usize..2,
        at in 0usize..20,
    ) {
        let mut s = s;
        s.close = Some((side, at));
        if let Err(e) = run_schedule(&s) {
            prop_assert!(false, "{}", e);
        }
    }
}

/// A restart of B in the middle of a schedule.
#[derive(Debug, Clone)]
struct Restart {
    seed: u64,
    /// Operations of A on the first connection.
    before: Vec<OpSpec>,
    /// Late copies of A's data packets: percent, and delay in ms.
    late: (u8, u16),
    /// When B restarts, after the last operation was posted (µs).
    restart_after_us: u32,
    /// Operations on the connection to the restarted B (both sides).
    after: Vec<OpSpec>,
    /// Impairments of the second connection.
    phases: Vec<Phase>,
}

fn restart_case() -> impl Strategy<Value = Restart> {
    (
        any::<u64>(),
        prop::collection::vec(op_spec(1, 4), 1..=10),
        (0u8..=50, 1u16..=50),
        prop_oneof![Just(0u32), 0u32..50, 0u32..3000],
        prop::collection::vec(op_spec(2, 4), 1..=10),
        prop::collection::vec(phase(), 0..=2),
    )
        .prop_map(
            |(seed, before, late, restart_after_us, after, phases)| Restart {
                seed,
                before,
                late,
                restart_after_us,
                after,
                phases,
            },
        )
}

fn run_restart(r: &Restart) -> Result<(), String> {
    use std::time::Duration;
    let mut w =
        Workload::start(Net::new(r.seed), Duration::from_secs(10)).ok_or("handshake failed")?;
    if r.late.0 > 0 {
        w.net.add_rule(Rule::always(
            Filter::any().from(0).kind(Kind::Data),
            Action::Late {
                prob: r.late.0 as f64 / 100.0,
                after: Duration::from_millis(r.late.1 as u64),
            },
        ));
    }
    w.post_all(&r.before, Duration::from_secs(5))?;
    w.net
        .run_for(Duration::from_micros(r.restart_after_us as u64));
    w.net.restart(1, r.seed ^ 0x0EE7_5EED);
    let regions_b = Regions::register(&mut w.net.eps[1], 1);
    let limit = w.net.elapsed() + Duration::from_secs(10);
    let (c, s) = w.net.try_connect(limit).ok_or("reconnect failed")?;
    let net = std::mem::replace(&mut w.net, Net::new(0));
    let mut nw = Workload::resume(net, [w.regions[0], regions_b], [c, s], 1 << 20);
    nw.stale_expected = true;
    let t0 = nw.t0;
    for p in &r.phases {
        for rule in p.rules(t0) {
            nw.net.add_rule(rule);
        }
    }
    nw.post_all(&r.after, Duration::from_secs(5))?;
    let limit = nw.net.elapsed() + Duration::from_secs(30);
    nw.finish(limit, Duration::from_secs(10))?;
    nw.check_all().map_err(|e| format!("new connection: {e}"))?;
    // The first connection: A's side completed every operation (those still pending when
    // B restarted fail with RetryExceeded / WrFlushError); what the old B delivered is a
    // correct prefix of each stream, and includes every SEND that succeeded.
    let mut net = std::mem::replace(&mut nw.net, Net::new(0));
    std::mem::swap(&mut net.events[1], &mut net.old_events[1][0]);
    w.net = net;
    w.allow_failure = true;
    w.stale_expected = true;
    w.check_completions()
        .and_then(|_| w.check_streams())
        .and_then(|_| w.check_immediates())
        .map_err(|e| format!("old connection: {e}"))
}

proptest! {
    #![proptest_config(cfg(256))]

    /// B restarts while A's operations and late copies of its packets are in flight: the
    /// stale packets never reach the new connection (nothing on it is corrupted, every
    /// check holds for it), the old connection completes every operation (RetryExceeded
    /// pattern for what was pending), and the old B delivered a correct prefix.
    #[test]
    fn restart_midway(r in restart_case()) {
        if let Err(e) = run_restart(&r) {
            prop_assert!(false, "{}", e);
        }
    }
}
