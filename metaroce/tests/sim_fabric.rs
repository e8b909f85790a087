//! `metaroce::sim` fabrics: ECMP spreading over a leaf-spine, surviving a blackholed spine
//! link and a failed plane, multi-plane spreading, route recomputation, fat trees.
//!
//! Run with `cargo test -p metaroce --features sim`.
#![cfg(feature = "sim")]

use metaroce::sim::{
    Action, HostId, LinkConfig, LinkId, PlaneShape, Sim, SimConfig, UplinkPolicy, GBPS,
    LISTEN_PORT, SOURCE_PORT_BASE,
};
use metaroce::testing::pattern;
use metaroce::{Access, ConnectionHandle, WriteRequest};
use std::collections::BTreeSet;
use std::time::Duration;

fn link(gbps: u64) -> LinkConfig {
    LinkConfig::new(gbps * GBPS, Duration::from_micros(1))
}

/// Post a WRITE of `data` from `a` to a fresh region at `b`; returns the target lkey.
fn post_write(sim: &mut Sim, a: HostId, b: HostId, conn: ConnectionHandle, data: Vec<u8>) -> u32 {
    let len = data.len();
    let src = sim.endpoint_mut(a).register_mr(data, Access::LOCAL_WRITE);
    let dst = sim
        .endpoint_mut(b)
        .register_mr(vec![0; len], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let req = WriteRequest {
        wr_id: 0,
        lkey: src.lkey,
        local_offset: 0,
        len: len as u32,
        remote_addr: dst.addr,
        rkey: dst.rkey,
        imm: None,
    };
    sim.endpoint_mut(a).post_write(conn, req).unwrap();
    dst.lkey
}

fn run_to_completions(sim: &mut Sim, hosts: &[HostId], n: u64, limit: Duration) {
    let deadline = sim.elapsed() + limit;
    sim.run_while(|s| {
        s.elapsed() < deadline && hosts.iter().any(|&h| s.host_stats(h).completions < n)
    });
    for &h in hosts {
        assert_eq!(
            sim.host_stats(h).completions,
            n,
            "host {h:?} incomplete after {limit:?}: {:?}",
            sim.host_stats(h)
        );
    }
}

/// Spines whose leaf-0 uplink carried more than `min` packets.
fn spines_used(sim: &Sim, uplinks: &[LinkId], min: u64) -> BTreeSet<usize> {
    uplinks
        .iter()
        .enumerate()
        .filter(|(_, &l)| sim.link_stats(l).packets > min)
        .map(|(i, _)| i)
        .collect()
}

/// The spines the sim's ECMP picks for the first `paths` source ports from `a` to `b`.
fn spines_routed(
    sim: &mut Sim,
    a: HostId,
    b: HostId,
    paths: u16,
    uplinks: &[LinkId],
) -> BTreeSet<usize> {
    (0..paths)
        .map(|i| {
            let route = sim.route(a, b, SOURCE_PORT_BASE + i, LISTEN_PORT).unwrap();
            assert_eq!(route.len(), 4, "host-leaf-spine-leaf-host");
            uplinks.iter().position(|l| *l == route[1]).unwrap()
        })
        .collect()
}

/// One connection between hosts on different leaves of a 4-spine leaf-spine: with 8 paths
/// its packets spread over every spine the ECMP hash gives its source ports, with 1 path
/// they stay on one spine.
///
/// Hashed ECMP gives no guarantee that 8 source ports reach all 4 spines (it does with
/// probability ≈ 0.62, see `ecmp_coverage_matches_theory`), so the test takes the first
/// seed for which the routes do, and checks that the traffic follows the routes.
#[test]
fn leaf_spine_paths_spread_over_spines() {
    let build = |seed: u64, paths: u16| {
        let mut sim = Sim::new(SimConfig::with_seed(seed));
        sim.set_host_config(move |_, cfg| cfg.transport.paths = paths);
        let t = sim.leaf_spine(2, 4, 1, link(100), link(100));
        (sim, t)
    };
    let seed = (1..)
        .find(|&seed| {
            let (mut sim, t) = build(seed, 8);
            let up: Vec<LinkId> = (0..4).map(|s| t.fabric_links[0][s].forward).collect();
            spines_routed(&mut sim, t.hosts[0], t.hosts[1], 8, &up).len() == 4
        })
        .unwrap();
    for paths in [8u16, 1] {
        let (mut sim, t) = build(seed, paths);
        let (a, b) = (t.hosts[0], t.hosts[1]);
        let up: Vec<LinkId> = (0..4).map(|s| t.fabric_links[0][s].forward).collect();
        let routed = spines_routed(&mut sim, a, b, paths, &up);
        let (c, _) = sim
            .connect_and_wait(a, b, Duration::from_millis(10))
            .unwrap();
        assert_eq!(
            sim.endpoint(a).connection_stats(c).unwrap().paths.len(),
            paths as usize
        );
        let data = pattern(1, 4 << 20);
        let dst = post_write(&mut sim, a, b, c, data.clone());
        run_to_completions(&mut sim, &[a], 1, Duration::from_secs(1));
        assert!(sim.endpoint(b).mr_read(dst, 0, data.len() as u64).unwrap() == data[..]);
        let used = spines_used(&sim, &up, 0);
        let counts: Vec<u64> = up.iter().map(|&l| sim.link_stats(l).packets).collect();
        println!("seed {seed}, {paths} paths: packets per spine {counts:?}");
        assert_eq!(used, routed, "traffic must follow the ECMP routes");
        if paths == 8 {
            assert_eq!(
                used.len(),
                4,
                "8 paths should cover the 4 spines: {counts:?}"
            );
            // Every spine carries its share (8 paths over 4 spines: 1 to 5 paths each).
            let total: u64 = counts.iter().sum();
            assert!(counts.iter().all(|&c| c * 10 > total), "{counts:?}");
        } else {
            assert_eq!(used.len(), 1, "1 path must use 1 spine: {counts:?}");
        }
    }
}

/// Over seeds, the share of connections whose 8 paths reach all 4 spines is what uniform
/// hashing predicts: 1 − 4·(3/4)⁸ + 6·(1/2)⁸ − 4·(1/4)⁸ ≈ 0.623.
#[test]
fn ecmp_coverage_matches_theory() {
    let mut full = 0;
    let seeds = 400;
    for seed in 0..seeds {
        let mut sim = Sim::new(SimConfig::with_seed(seed));
        let t = sim.leaf_spine(2, 4, 1, link(100), link(100));
        let up: Vec<LinkId> = (0..4).map(|s| t.fabric_links[0][s].forward).collect();
        if spines_routed(&mut sim, t.hosts[0], t.hosts[1], 8, &up).len() == 4 {
            full += 1;
        }
    }
    let share = full as f64 / seeds as f64;
    // σ ≈ 0.024 over 400 seeds.
    assert!((0.54..=0.71).contains(&share), "coverage share {share}");
}

/// Over many flows, ECMP hashing covers each spine about equally.
#[test]
fn ecmp_hash_is_balanced() {
    let mut sim = Sim::new(SimConfig::with_seed(5));
    let t = sim.leaf_spine(2, 4, 4, link(100), link(100));
    let up: Vec<LinkId> = (0..4).map(|s| t.fabric_links[0][s].forward).collect();
    let mut per_spine = [0u32; 4];
    for &a in &t.hosts[..4] {
        for &b in &t.hosts[4..] {
            for p in 0..64 {
                let r = sim.route(a, b, SOURCE_PORT_BASE + p, LISTEN_PORT).unwrap();
                per_spine[up.iter().position(|l| *l == r[1]).unwrap()] += 1;
            }
        }
    }
    // 1024 flows: each spine expects 256 (σ ≈ 14).
    assert!(
        per_spine.iter().all(|&n| (200..=312).contains(&n)),
        "{per_spine:?}"
    );
}

/// A spine link that one of the connection's paths uses turns into a blackhole
/// mid-transfer: paths over the other spines carry the transfer to completion.
#[test]
fn blackholed_spine_link_mid_transfer() {
    let mut sim = Sim::new(SimConfig::with_seed(11));
    let t = sim.leaf_spine(2, 4, 1, link(100), link(100));
    let (a, b) = (t.hosts[0], t.hosts[1]);
    let up: Vec<LinkId> = (0..4).map(|s| t.fabric_links[0][s].forward).collect();
    let (c, _) = sim
        .connect_and_wait(a, b, Duration::from_millis(10))
        .unwrap();
    let len = 64 << 20;
    let data = pattern(2, len);
    let dst = post_write(&mut sim, a, b, c, data.clone());
    sim.run_for(Duration::from_micros(500));
    assert_eq!(sim.host_stats(a).completions, 0, "transfer already over");
    // Blackhole the busiest spine uplink.
    let victim = *up
        .iter()
        .max_by_key(|&&l| sim.link_stats(l).packets)
        .unwrap();
    sim.apply(Action::Blackhole(victim, true));
    run_to_completions(&mut sim, &[a], 1, Duration::from_secs(5));
    let ls = sim.link_stats(victim);
    assert!(ls.drops.blackhole > 0, "{ls:?}");
    assert!(sim.endpoint(b).mr_read(dst, 0, len as u64).unwrap() == data[..]);
    let st = sim.endpoint(a).connection_stats(c).unwrap();
    let retx: u64 = st.paths.iter().map(|p| p.stats.retransmits).sum();
    assert!(retx > 0);
    println!(
        "completed at {:?}; blackhole drops {}; retransmits {retx}; failed paths {}",
        sim.elapsed(),
        ls.drops.blackhole,
        st.paths.iter().filter(|p| p.failed).count()
    );
}

/// A spine link goes down; after routing converges, no route uses it.
#[test]
fn route_recomputation_avoids_down_links() {
    let mut sim = Sim::new(SimConfig::with_seed(3));
    let t = sim.leaf_spine(2, 4, 2, link(100), link(100));
    let down = t.fabric_links[0][2].forward;
    let (a, b) = (t.hosts[0], t.hosts[2]);
    let uses = |sim: &mut Sim| {
        (0..64).any(|p| {
            sim.route(a, b, SOURCE_PORT_BASE + p, LISTEN_PORT)
                .unwrap()
                .contains(&down)
        })
    };
    assert!(uses(&mut sim));
    sim.schedule(Duration::from_micros(10), Action::LinkDown(down));
    sim.schedule(Duration::from_micros(50), Action::RecomputeRoutes);
    sim.run_until(Duration::from_micros(20));
    assert!(uses(&mut sim), "routes changed before convergence");
    sim.run_until(Duration::from_micros(60));
    assert!(!uses(&mut sim), "routes still use the down link");
    assert!(!sim.link_info(down).up);
}

/// Multi-plane fabrics of 2 and 4 single-switch planes: every plane carries traffic, with
/// either uplink policy.
#[test]
fn multi_plane_uses_every_plane() {
    for policy in [UplinkPolicy::FlowHash, UplinkPolicy::SourcePort] {
        for planes in [2usize, 4] {
            let mut sim = Sim::new(SimConfig {
                uplink_policy: policy,
                ..SimConfig::with_seed(21)
            });
            let mp = sim.multi_plane(planes, 4, PlaneShape::SingleSwitch, link(100), link(100));
            assert!(mp.hosts.iter().all(|&h| sim.uplinks(h).len() == planes));
            let conns: Vec<_> = (0..4)
                .map(|i| {
                    sim.connect_and_wait(
                        mp.hosts[i],
                        mp.hosts[(i + 1) % 4],
                        Duration::from_millis(10),
                    )
                    .unwrap()
                    .0
                })
                .collect();
            for (i, &c) in conns.iter().enumerate() {
                post_write(
                    &mut sim,
                    mp.hosts[i],
                    mp.hosts[(i + 1) % 4],
                    c,
                    pattern(i as u64, 2 << 20),
                );
            }
            run_to_completions(&mut sim, &mp.hosts, 1, Duration::from_secs(1));
            let bytes: Vec<u64> = mp
                .planes
                .iter()
                .map(|p| {
                    p.host_links
                        .iter()
                        .map(|l| sim.link_stats(l.forward).bytes)
                        .sum()
                })
                .collect();
            println!("{policy:?}, {planes} planes: bytes per plane {bytes:?}");
            let total: u64 = bytes.iter().sum();
            for (p, &b) in bytes.iter().enumerate() {
                assert!(
                    b * (planes as u64) * 4 > total,
                    "{policy:?}: plane {p} of {planes} carried {b} of {total} bytes"
                );
            }
        }
    }
}

/// One of two leaf-spine planes fails completely mid-transfer; the other carries it.
#[test]
fn plane_failure_is_survived() {
    let mut sim = Sim::new(SimConfig::with_seed(8));
    let mp = sim.multi_plane(
        2,
        4,
        PlaneShape::LeafSpine {
            leaves: 2,
            spines: 2,
        },
        link(100),
        link(100),
    );
    let (a, b) = (mp.hosts[0], mp.hosts[3]);
    let (c, _) = sim
        .connect_and_wait(a, b, Duration::from_millis(10))
        .unwrap();
    let len = 32 << 20;
    let data = pattern(9, len);
    let dst = post_write(&mut sim, a, b, c, data.clone());
    let at = sim.elapsed() + Duration::from_micros(300);
    for l in mp.planes[1].all_links() {
        sim.schedule(at, Action::LinkDown(l));
    }
    run_to_completions(&mut sim, &[a], 1, Duration::from_secs(5));
    assert!(sim.endpoint(b).mr_read(dst, 0, len as u64).unwrap() == data[..]);
    let drops: u64 = mp.planes[1]
        .all_links()
        .iter()
        .map(|&l| sim.link_stats(l).drops.link_down)
        .sum();
    assert!(drops > 0);
}

/// A k = 4 fat tree: 16 hosts, flows between pods cross the core and complete.
#[test]
fn fat_tree_cross_pod_traffic() {
    let mut sim = Sim::new(SimConfig::with_seed(4));
    let ft = sim.fat_tree(4, link(100), link(100));
    assert_eq!(ft.hosts.len(), 16);
    assert_eq!(ft.cores.len(), 4);
    assert_eq!(sim.switch_count(), 20);
    // Host i of pod p sends to the same host of pod p + 1.
    let pairs: Vec<(HostId, HostId)> = (0..16)
        .map(|i| (ft.hosts[i], ft.hosts[(i + 4) % 16]))
        .collect();
    for &(a, b) in &pairs {
        let route = sim.route(a, b, SOURCE_PORT_BASE, LISTEN_PORT).unwrap();
        assert_eq!(route.len(), 6, "host-edge-agg-core-agg-edge-host");
    }
    let conns: Vec<_> = pairs
        .iter()
        .map(|&(a, b)| sim.connect_endpoints(a, b).unwrap())
        .collect();
    sim.run_while(|s| {
        s.elapsed() < Duration::from_millis(100)
            && pairs
                .iter()
                .zip(&conns)
                .any(|(&(a, _), &c)| !s.endpoint(a).is_established(c))
    });
    for (&(a, b), &c) in pairs.iter().zip(&conns) {
        post_write(&mut sim, a, b, c, pattern(3, 1 << 20));
    }
    let senders: Vec<HostId> = pairs.iter().map(|p| p.0).collect();
    run_to_completions(&mut sim, &senders, 1, Duration::from_secs(1));
    let core_packets: u64 = ft
        .agg_core
        .iter()
        .flatten()
        .flatten()
        .map(|l| sim.link_stats(l.forward).packets)
        .sum();
    assert!(core_packets > 16 * 256, "traffic did not cross the core");
    let cores_used = ft
        .agg_core
        .iter()
        .flatten()
        .flatten()
        .filter(|l| sim.link_stats(l.forward).packets > 0)
        .count();
    assert_eq!(
        cores_used, 16,
        "every aggregation-to-core link carries traffic"
    );
}
