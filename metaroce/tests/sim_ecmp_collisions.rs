//! ECMP collision handling (`TransportConfig::rebalance_ratio_permille`): when hashing puts
//! several of a connection's paths on one spine and leaves another spine unused, the
//! paths that share a spine deliver persistently less than a path alone on one, and the
//! connection moves them to new source ports until every spine carries traffic.
//!
//! Run with `cargo test -p metaroce --release --features sim --test sim_ecmp_collisions`.
#![cfg(feature = "sim")]

use metaroce::sim::{
    HostId, LinkConfig, LinkId, Sim, SimConfig, GBPS, LISTEN_PORT, SOURCE_PORT_BASE,
};
use metaroce::{Access, ConnectionHandle, WriteRequest};
use std::collections::BTreeSet;
use std::time::Duration;

const SPINES: usize = 4;
const PATHS: u16 = 8;
/// Fabric links (leaf–spine) are the bottleneck: 4 × 10 Gbit/s behind a 100 Gbit/s host link.
const FABRIC_GBPS: u64 = 10;
const WRITE: usize = 16 << 20;
const WRITES: usize = 96;
/// Virtual time given to the connection to find a balance before measuring.
const SETTLE: Duration = Duration::from_millis(250);
/// Virtual time over which the per-spine rates are measured.
const MEASURE: Duration = Duration::from_millis(10);

fn link(gbps: u64) -> LinkConfig {
    LinkConfig::new(gbps * GBPS, Duration::from_micros(1))
}

fn build(seed: u64, rebalance: bool) -> (Sim, HostId, HostId, Vec<LinkId>) {
    let mut sim = Sim::new(SimConfig::with_seed(seed));
    sim.set_host_config(move |_, cfg| {
        cfg.transport.paths = PATHS;
        if !rebalance {
            cfg.transport.rebalance_ratio_permille = 0;
        }
    });
    let t = sim.leaf_spine(2, SPINES, 1, link(100), link(FABRIC_GBPS));
    let up = (0..SPINES).map(|s| t.fabric_links[0][s].forward).collect();
    (sim, t.hosts[0], t.hosts[1], up)
}

/// The spines the ECMP hash gives the connection's initial source ports.
fn spines_routed(sim: &mut Sim, a: HostId, b: HostId, up: &[LinkId]) -> BTreeSet<usize> {
    (0..PATHS)
        .map(|i| {
            let route = sim.route(a, b, SOURCE_PORT_BASE + i, LISTEN_PORT).unwrap();
            up.iter().position(|l| *l == route[1]).unwrap()
        })
        .collect()
}

/// What one run measured.
#[derive(Debug)]
struct Run {
    /// Bytes each spine uplink carried during the measuring window.
    per_spine: Vec<u64>,
    /// All spine uplinks together during the measuring window, in Gbit/s.
    gbps: f64,
    /// `ConnectionStats::rebalance_rerolls` at the end.
    rerolls: u64,
    /// The spine each path's source port hashes to at the end.
    path_spines: Vec<usize>,
}

impl Run {
    fn spines_used(&self) -> usize {
        let total: u64 = self.per_spine.iter().sum();
        // A spine counts when it carries at least a tenth of the traffic (8 paths over 4
        // spines give each at least one eighth of the paths when all are used).
        self.per_spine.iter().filter(|&&b| b * 10 >= total).count()
    }
}

fn post_writes(sim: &mut Sim, a: HostId, b: HostId, c: ConnectionHandle) {
    let src = sim
        .endpoint_mut(a)
        .register_mr(vec![7u8; WRITE], Access::LOCAL_WRITE);
    let dst = sim
        .endpoint_mut(b)
        .register_mr(vec![0; WRITE], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    for k in 0..WRITES {
        let req = WriteRequest {
            wr_id: k as u64,
            lkey: src.lkey,
            local_offset: 0,
            len: WRITE as u32,
            remote_addr: dst.addr,
            rkey: dst.rkey,
            imm: None,
        };
        sim.endpoint_mut(a).post_write(c, req).unwrap();
    }
}

fn run(seed: u64, rebalance: bool) -> Run {
    let (mut sim, a, b, up) = build(seed, rebalance);
    let (c, _) = sim
        .connect_and_wait(a, b, Duration::from_millis(10))
        .unwrap();
    post_writes(&mut sim, a, b, c);
    sim.run_for(SETTLE);
    let before: Vec<u64> = up.iter().map(|&l| sim.link_stats(l).bytes).collect();
    sim.run_for(MEASURE);
    let per_spine: Vec<u64> = up
        .iter()
        .zip(&before)
        .map(|(&l, &b0)| sim.link_stats(l).bytes - b0)
        .collect();
    // Still backlogged at the end: the measuring window saw a window-limited sender.
    assert!(
        sim.host_stats(a).completions < WRITES as u64,
        "the transfer finished inside the measuring window; make it longer"
    );
    // The spine of every path's final source port, for the log.
    let st = sim.endpoint(a).connection_stats(c).unwrap();
    let path_spines: Vec<usize> = st
        .paths
        .iter()
        .map(|p| {
            let r = sim.route(a, b, p.src_port, LISTEN_PORT).unwrap();
            up.iter().position(|l| *l == r[1]).unwrap()
        })
        .collect();
    let gbps = per_spine.iter().sum::<u64>() as f64 * 8.0 / MEASURE.as_secs_f64() / 1e9;
    assert_eq!(
        st.rebalance_rerolls,
        st.paths
            .iter()
            .map(|p| p.stats.rebalance_rerolls)
            .sum::<u64>()
    );
    Run {
        per_spine,
        gbps,
        rerolls: st.rebalance_rerolls,
        path_spines,
    }
}

/// Seeds whose 8 initial source ports hash onto only 3 of the 4 spines.
fn colliding_seeds(n: usize) -> Vec<u64> {
    (1..)
        .filter(|&seed| {
            let (mut sim, a, b, up) = build(seed, true);
            spines_routed(&mut sim, a, b, &up).len() == SPINES - 1
        })
        .take(n)
        .collect()
}

/// With a spine left unused by the hash, the connection without collision handling stays
/// on 3 spines (≈ 3 links' worth); with it, it moves paths until all 4 spines carry
/// traffic and its rate approaches 4 links' worth.
#[test]
fn rerolls_paths_until_every_spine_is_used() {
    let link_gbps = FABRIC_GBPS as f64;
    for seed in colliding_seeds(8) {
        let off = run(seed, false);
        let on = run(seed, true);
        println!("seed {seed}: off {off:?} ({} spines)", off.spines_used());
        println!("seed {seed}: on  {on:?} ({} spines)", on.spines_used());
        assert_eq!(off.rerolls, 0, "seed {seed}: disabled but re-rolled");
        assert_eq!(off.spines_used(), SPINES - 1, "seed {seed}: {off:?}");
        assert!(off.gbps < 3.05 * link_gbps, "seed {seed}: {off:?}");
        assert_eq!(on.spines_used(), SPINES, "seed {seed}: {on:?}");
        assert!(on.rerolls >= 1, "seed {seed}: {on:?}");
        let mut on_spines = on.path_spines.clone();
        on_spines.sort_unstable();
        on_spines.dedup();
        assert_eq!(on_spines.len(), SPINES, "seed {seed}: {on:?}");
        assert!(
            on.rerolls <= metaroce::TransportConfig::default().rebalance_max_rerolls as u64,
            "seed {seed}: {on:?}"
        );
        assert!(
            on.gbps > 3.6 * link_gbps,
            "seed {seed}: with re-rolls {:.1} Gbit/s, want > {:.1}: {on:?}",
            on.gbps,
            3.6 * link_gbps
        );
        assert!(
            on.gbps > 1.15 * off.gbps,
            "seed {seed}: on {on:?}, off {off:?}"
        );
    }
}

/// When the hash already spreads the 8 paths evenly (2 per spine), nothing is re-rolled:
/// equal sharing of the links is not mistaken for a collision.
#[test]
fn balanced_paths_are_left_alone() {
    let seed = (1..)
        .find(|&seed| {
            let (mut sim, a, b, up) = build(seed, true);
            let mut per = [0; SPINES];
            for i in 0..PATHS {
                let r = sim.route(a, b, SOURCE_PORT_BASE + i, LISTEN_PORT).unwrap();
                per[up.iter().position(|l| *l == r[1]).unwrap()] += 1;
            }
            per == [2; SPINES]
        })
        .unwrap();
    let on = run(seed, true);
    println!("seed {seed}: {on:?}");
    assert_eq!(on.rerolls, 0, "seed {seed}: {on:?}");
    assert_eq!(on.spines_used(), SPINES, "seed {seed}: {on:?}");
}
