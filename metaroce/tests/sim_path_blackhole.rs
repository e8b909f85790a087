//! With `TransportConfig::path_reroll_on_first_timeout`, a path whose route is blackholed
//! (a failed spine link before routing converges) while the connection's other paths
//! deliver is re-rolled to a new UDP source port at its **first** retransmission timeout,
//! not after `path_reroll_timeouts` backed-off ones; the WRITE completes with the right
//! data. With the option off (the default), the old rule holds (three timeouts before the
//! first re-roll).
//!
//! Run with `cargo test -p metaroce --features sim --test sim_path_blackhole`.
#![cfg(feature = "sim")]

use metaroce::sim::{Action, LinkConfig, Sim, SimConfig, GBPS};
use metaroce::{Access, WcStatus, WriteRequest};
use std::time::Duration;

const LEN: usize = 4 << 20;

/// Per path of the writer's connection: (RTOs, re-rolls); and whether the WRITE completed
/// with the right data.
fn run(first_timeout: bool) -> (Vec<(u64, u64)>, bool, Duration) {
    let mut sim = Sim::new(SimConfig::with_seed(5));
    sim.set_host_config(move |_, cfg| {
        cfg.transport.paths = 8;
        cfg.transport.path_reroll_on_first_timeout = first_timeout;
    });
    let link = LinkConfig::new(25 * GBPS, Duration::from_micros(1))
        .with_queue_limit(1 << 20)
        .with_ecn_threshold(100_000);
    let ls = sim.leaf_spine(2, 4, 1, link.clone(), link);
    let (a, b) = (ls.hosts[0], ls.hosts[1]);
    let (conn, _) = sim
        .connect_and_wait(a, b, Duration::from_millis(100))
        .expect("connected");
    let src = sim
        .endpoint_mut(a)
        .register_mr(metaroce::testing::pattern(7, LEN), Access::LOCAL_WRITE);
    let dst = sim
        .endpoint_mut(b)
        .register_mr(vec![0; LEN], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    // Leaf 0 <-> spine 0 fails; routes are not recomputed: a blackhole for the paths
    // hashed onto it.
    for l in ls.fabric_links[0][0].both() {
        sim.apply(Action::LinkDown(l));
    }
    let t0 = sim.elapsed();
    let w = WriteRequest {
        wr_id: 1,
        lkey: src.lkey,
        local_offset: 0,
        len: LEN as u32,
        remote_addr: dst.addr,
        rkey: dst.rkey,
        imm: None,
    };
    sim.endpoint_mut(a).post_write(conn, w).expect("posted");
    let limit = t0 + Duration::from_secs(2);
    sim.run_while(|s| {
        s.elapsed() < limit && s.host_stats(a).completions + s.host_stats(a).completion_errors == 0
    });
    let time = sim.elapsed() - t0;
    let ok = sim.host_stats(a).completions == 1
        && sim.events(a).iter().all(|e| match &e.event {
            metaroce::Event::Completion { wc, .. } => wc.status == WcStatus::Success,
            _ => true,
        })
        && sim.endpoint(b).mr_read(dst.lkey, 0, LEN as u64).unwrap()
            == metaroce::testing::pattern(7, LEN);
    let cs = sim.endpoint(a).connection_stats(conn).expect("connection");
    let paths = cs
        .paths
        .iter()
        .map(|p| (p.stats.rtos, p.stats.rerolls))
        .collect();
    (paths, ok, time)
}

#[test]
fn a_blackholed_path_is_rerolled_after_its_first_timeout() {
    let (paths, ok, time) = run(true);
    println!("first-timeout re-roll: {time:?}, (RTOs, re-rolls) per path {paths:?}");
    assert!(ok, "the WRITE did not complete with the right data");
    let hit: Vec<_> = paths.iter().filter(|p| p.0 > 0).collect();
    assert!(
        !hit.is_empty(),
        "no path crossed the failed link: {paths:?}"
    );
    for &&(rtos, rerolls) in &hit {
        // Re-rolled at its first timeout (and at every later one while the others
        // deliver): never the old rule's 3 timeouts before the first re-roll.
        assert!(
            rerolls >= 1,
            "a timed-out path was not re-rolled: {paths:?}"
        );
        assert!(
            rtos <= 2 * rerolls,
            "more than one timeout per re-roll: {paths:?}"
        );
    }
}

#[test]
fn without_the_option_a_blackholed_path_waits_for_three_timeouts() {
    let (paths, ok, time) = run(false);
    println!("old rule: {time:?}, (RTOs, re-rolls) per path {paths:?}");
    assert!(ok, "the WRITE did not complete with the right data");
    let hit: Vec<_> = paths.iter().filter(|p| p.1 > 0).collect();
    assert!(!hit.is_empty(), "no path re-rolled: {paths:?}");
    for &&(rtos, _) in &hit {
        assert!(rtos >= 3, "re-rolled before three timeouts: {paths:?}");
    }
}
