//! Reorder tolerance of loss detection (RACK-TLP, RFC 8985; docs/PROTOCOL.md "Delivery"):
//! packets reordered within a path are not retransmitted, real loss still is, quickly.
//! Figures are printed; the assertions are on packet counts and on goodput in simulated
//! (deterministic) time.
//!
//! Run with `cargo test -p metaroce --features sim --test sim_reorder -- --nocapture`.
#![cfg(feature = "sim")]

use metaroce::sim::{Impairments, LinkConfig, Sim, SimConfig, GBPS};
use metaroce::{Access, Event, WcStatus, WriteRequest};
use std::time::Duration;

const LEN: usize = 128 << 20;

struct Run {
    sent: u64,
    retransmits: u64,
    probes: u64,
    sack_losses: u64,
    spurious: u64,
    /// Goodput in Gbit/s of simulated time.
    gbps: f64,
}

/// One 128 MiB WRITE from a to b through one switch (100 Gbit/s, 1 µs links), the
/// switch → b link impaired with `imp`.
fn run(seed: u64, imp: Impairments) -> Run {
    let mut sim = Sim::new(SimConfig::with_seed(seed));
    let sw = sim.add_switch();
    let a = sim.add_host();
    let b = sim.add_host();
    let link = LinkConfig::new(100 * GBPS, Duration::from_micros(1));
    sim.connect(a, sw, link.clone());
    sim.connect(b, sw, link.with_impairments(imp));
    let (c, _) = sim
        .connect_and_wait(a, b, Duration::from_millis(50))
        .unwrap();
    let data: Vec<u8> = (0..LEN).map(|i| (i * 7 + 3) as u8).collect();
    let src = sim
        .endpoint_mut(a)
        .register_mr(data.clone(), Access::LOCAL_WRITE);
    let dst = sim
        .endpoint_mut(b)
        .register_mr(vec![0; LEN], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let t0 = sim.elapsed();
    sim.endpoint_mut(a)
        .post_write(
            c,
            WriteRequest {
                wr_id: 1,
                lkey: src.lkey,
                local_offset: 0,
                len: LEN as u32,
                remote_addr: dst.addr,
                rkey: dst.rkey,
                imm: None,
            },
        )
        .unwrap();
    let deadline = t0 + Duration::from_secs(5);
    sim.run_while(|s| s.host_stats(a).completions < 1 && s.elapsed() < deadline);
    let done = sim
        .events(a)
        .iter()
        .find_map(|e| match &e.event {
            Event::Completion { wc, .. } => Some((e.time, wc.status)),
            _ => None,
        })
        .expect("WRITE did not complete");
    assert_eq!(done.1, WcStatus::Success);
    assert!(sim.endpoint(b).mr_read(dst.lkey, 0, LEN as u64).unwrap() == data[..]);
    let elapsed = done.0 - t0;
    let st = sim.endpoint(a).connection_stats(c).unwrap();
    let sum = |f: &dyn Fn(&metaroce::PathStats) -> u64| -> u64 {
        st.paths.iter().map(|p| f(&p.stats)).sum()
    };
    Run {
        sent: sum(&|p| p.packets_sent),
        retransmits: sum(&|p| p.retransmits),
        probes: sum(&|p| p.probes),
        sack_losses: sum(&|p| p.sack_losses),
        spurious: sum(&|p| p.spurious_losses),
        gbps: LEN as f64 * 8.0 / elapsed.as_secs_f64() / 1e9,
    }
}

fn show(what: &str, r: &Run) {
    println!(
        "{what}: {} packets sent, {} retransmitted ({:.2} %), {} probes, {} SACK losses \
         ({} found spurious), goodput {:.1} Gbit/s",
        r.sent,
        r.retransmits,
        100.0 * r.retransmits as f64 / r.sent as f64,
        r.probes,
        r.sack_losses,
        r.spurious,
        r.gbps
    );
}

/// 5 % of packets reordered (held back) by up to 3 packet times of their path, with 8 paths
/// sharing the link in turn: 1, 3 and 8 µs (one 4 KiB packet is 0.33 µs at 100 Gbit/s, so a
/// path's own packets are about 2.7 µs apart): fewer than 2 % of packets retransmitted.
#[test]
fn reordering_within_a_path_is_not_loss() {
    for (seed, ns) in [(1, 1000), (2, 3000), (3, 8000)] {
        let r = run(
            seed,
            Impairments {
                reorder: 0.05,
                reorder_delay: Duration::from_nanos(ns),
                ..Default::default()
            },
        );
        show(&format!("seed {seed}, 5 % reordered by {ns} ns"), &r);
        assert!(
            r.retransmits * 100 < 2 * r.sent,
            "{} of {} packets retransmitted",
            r.retransmits,
            r.sent
        );
    }
}

/// 1 % random loss: goodput at least 95 % of the lossless run, and the losses are found
/// from SACK holes (RACK), not by timeouts.
#[test]
fn one_percent_loss_keeps_goodput() {
    let clean = run(4, Impairments::default());
    show("lossless", &clean);
    assert_eq!(clean.retransmits, 0, "retransmissions on a clean link");
    for seed in [4, 5, 6] {
        let lossy = run(
            seed,
            Impairments {
                loss: 0.01,
                ..Default::default()
            },
        );
        show(&format!("seed {seed}, 1 % loss"), &lossy);
        println!(
            "goodput {:.1} % of lossless",
            100.0 * lossy.gbps / clean.gbps
        );
        assert!(
            lossy.gbps >= 0.95 * clean.gbps,
            "goodput {:.1} vs {:.1} Gbit/s lossless",
            lossy.gbps,
            clean.gbps
        );
        assert!(lossy.sack_losses > 0);
    }
}
