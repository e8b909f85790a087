//! `metaroce::sim::collective` at small size: ring all-reduce and all-to-all over a
//! two-plane leaf-spine, with many paths and with one path per connection, clean, with 1 %
//! loss on the host uplinks and with a failed spine link. Every run must complete with the
//! right data on every rank, no failed completion and no lost connection (times are printed,
//! not asserted). The full-size study is `examples/sim_collectives.rs`.
//!
//! The same collectives over RoCEv2 RC QPs (one QP per connection, go-back-N, NCCL's
//! timeout and retry count): they complete with the right data clean and under 1 % loss;
//! with the failed spine link, a QP whose fixed route crosses it retries `retry_cnt` times
//! and goes to the error state with `RetryExceeded`, which fails the collective.
//!
//! Run with `cargo test -p metaroce --features sim --test sim_collectives`.
#![cfg(feature = "sim")]

use metaroce::sim::collective::{
    run_collective, run_collective_with, Collective, CollectiveRun, RcQpParams, Transport,
};
use metaroce::sim::{
    Action, HostId, Impairments, LinkConfig, PlaneShape, Sim, SimConfig, UplinkPolicy, GBPS,
};
use metaroce::WcStatus;
use std::time::Duration;

const HOSTS: usize = 16;
const LEAVES: usize = 4;

fn run(multipath: bool, loss: bool, fail: bool, coll: Collective) {
    let (r, _) = run_on(Some(multipath), loss, fail, coll);
    check_complete(&r, coll);
    if loss || fail {
        assert!(r.retransmits > 0, "impairments that cost nothing: {r:?}");
    }
}

fn check_complete(r: &CollectiveRun, coll: Collective) {
    assert!(r.completed, "{coll:?}: not complete: {r:?}");
    assert!(r.data_ok, "{coll:?}: {} wrong bytes", r.wrong_bytes);
    assert_eq!(r.wrong_bytes, 0);
    assert_eq!(r.errors, 0, "{r:?}");
    assert_eq!(r.connections_lost, 0, "{r:?}");
    assert_eq!(r.failed_at, None, "{r:?}");
    let per_rank = coll.bytes_sent_per_rank(HOSTS) as usize;
    let chunk = match coll {
        Collective::RingAllReduce { bytes_per_rank } => bytes_per_rank / HOSTS,
        Collective::AllToAll { bytes_per_pair } => bytes_per_pair,
    };
    assert_eq!(r.writes as usize, HOSTS * per_rank / chunk);
}

/// One run: `multipath` `Some(_)` = MetaRoCE with many paths or one, `None` = RC QPs.
/// Returns the run and the packets dropped at the failed link.
fn run_on(
    multipath: Option<bool>,
    loss: bool,
    fail: bool,
    coll: Collective,
) -> (CollectiveRun, u64) {
    let mut sim = Sim::new(SimConfig {
        uplink_policy: UplinkPolicy::SourcePort,
        ..SimConfig::with_seed(3)
    });
    sim.set_host_config(move |_, cfg| {
        let many = multipath == Some(true);
        cfg.transport.paths = if many { 8 } else { 1 };
        cfg.transport.planes = if many { 2 } else { 1 };
    });
    let link = LinkConfig::new(25 * GBPS, Duration::from_micros(1))
        .with_queue_limit(1 << 20)
        .with_ecn_threshold(100_000);
    let mp = sim.multi_plane(
        2,
        HOSTS,
        PlaneShape::LeafSpine {
            leaves: LEAVES,
            spines: 2,
        },
        link.clone(),
        link.clone(),
    );
    if loss {
        for p in &mp.planes {
            for l in &p.host_links {
                sim.link_config_mut(l.forward).impairments = Impairments {
                    loss: 0.01,
                    ..Impairments::default()
                };
            }
        }
    }
    let per_leaf = HOSTS / LEAVES;
    let ranks: Vec<HostId> = (0..HOSTS)
        .map(|r| mp.hosts[(r % LEAVES) * per_leaf + r / LEAVES])
        .collect();
    let failed = mp.planes[0].fabric_links[0][0];
    let before = |sim: &mut Sim| {
        if fail {
            for l in failed.both() {
                sim.apply(Action::LinkDown(l));
            }
        }
    };
    let r = match multipath {
        Some(_) => run_collective(&mut sim, &ranks, coll, Duration::from_secs(2), before),
        // Long enough for 8 timeouts of 1.07 s.
        None => run_collective_with(
            &mut sim,
            &ranks,
            coll,
            Transport::Rc(RcQpParams::nccl()),
            Duration::from_secs(20),
            before,
        ),
    }
    .expect("connections established");
    let dropped = failed
        .both()
        .iter()
        .map(|&l| sim.link_stats(l).drops.link_down)
        .sum();
    println!(
        "{coll:?} multipath={multipath:?} loss={loss} failed_link={fail}: {:?}, {} packets, {} \
         retransmitted, {} RTOs, {dropped} dropped at the failed link, failed at {:?} ({:?})",
        r.time, r.packets_sent, r.retransmits, r.rtos, r.failed_at, r.qp_error
    );
    (r, dropped)
}

/// RC QPs: clean and 1 % loss complete with the right data; with the failed spine link, a
/// QP pinned to it (packets were dropped there) exhausts `retry_cnt` and fails the run.
fn rc_all(coll: Collective) {
    let (r, _) = run_on(None, false, false, coll);
    check_complete(&r, coll);
    assert_eq!(r.retransmits, 0, "clean fabric: {r:?}");
    let (r, _) = run_on(None, true, false, coll);
    check_complete(&r, coll);
    assert!(r.retransmits > 0, "1 % loss that cost nothing: {r:?}");
    let (r, dropped) = run_on(None, false, true, coll);
    assert!(dropped > 0, "no QP routed over the failed link: {r:?}");
    assert!(!r.completed, "{r:?}");
    assert_eq!(r.qp_error, Some(WcStatus::RetryExceeded), "{r:?}");
    assert!(r.connections_lost >= 1 && r.errors >= 1, "{r:?}");
    // 8 timeouts of 4.096 us x 2^18 before the error.
    let rto = Duration::from_nanos(4096 << 18);
    let failed_at = r.failed_at.expect("failure time");
    assert!(failed_at >= rto * 8, "{r:?}");
    assert!(r.rtos >= 8, "{r:?}");
}

fn all(coll: Collective) {
    for multipath in [true, false] {
        for (loss, fail) in [(false, false), (true, false), (false, true)] {
            run(multipath, loss, fail, coll);
        }
    }
}

#[test]
fn ring_allreduce_completes_with_the_right_sum() {
    all(Collective::RingAllReduce {
        bytes_per_rank: 128 << 10,
    });
}

#[test]
fn all_to_all_delivers_every_chunk() {
    all(Collective::AllToAll {
        bytes_per_pair: 16 << 10,
    });
}

#[test]
fn rc_ring_allreduce_completes_or_fails_on_a_blackholed_path() {
    rc_all(Collective::RingAllReduce {
        bytes_per_rank: 128 << 10,
    });
}

#[test]
fn rc_all_to_all_completes_or_fails_on_a_blackholed_path() {
    rc_all(Collective::AllToAll {
        bytes_per_pair: 16 << 10,
    });
}
