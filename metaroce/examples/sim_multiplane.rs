//! Experiment (c): throughput scaling with the number of planes of a multi-plane fabric.
//!
//! `P` independent planes (P = 1, 2, 4, 8), each a leaf-spine of 2 leaves and 8 spines;
//! 16 hosts, each with one 100 Gbit/s uplink per plane (1 µs links, 1 MiB queues marking CE
//! above 100 KB). A host sends each packet on the plane of its path: the simulator's
//! `UplinkPolicy::SourcePort` puts source port `p` on uplink `p mod P`, and the endpoints are
//! told `transport.planes = P`, so the path manager spreads the connection's paths evenly
//! over the planes (8 paths per plane) and answers each path on its own plane.
//! Host `i` RDMA-WRITEs `P × --bytes` (default 8 MiB per plane) to host `i + 8`, across the
//! spines of every plane. Goodput counts WRITE data delivered over the middle of the
//! transfer (20 % to 80 % of the first completion); linear scaling is `P ×` the 1-plane value.
//!
//! ```text
//! cargo run --release -p metaroce --features sim --example sim_multiplane [-- --bytes 8388608 --seed 1]
//! ```
//! Writes `experiments/sim/results/multiplane.json`.

#[path = "sim_common/mod.rs"]
mod common;

use common::{connect_all, run_transfers, Json};
use metaroce::sim::{LinkConfig, PlaneShape, Sim, SimConfig, UplinkPolicy, GBPS};
use std::time::Duration;

const HOSTS: usize = 16;

/// Command-line options.
#[derive(clap::Parser)]
struct Opts {
    /// Bytes each flow WRITEs.
    #[arg(long, default_value_t = 8 << 20)]
    bytes: usize,
    /// Simulator seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn main() {
    let Opts { bytes, seed } = clap::Parser::parse();
    println!(
        "multi-plane: {HOSTS} hosts, planes of 2 leaves x 8 spines, 100 Gbit/s per host per plane, \
         host i -> host i+8, 8 paths per plane"
    );
    println!(
        "{:>6} {:>8} {:>6} {:>14} {:>10} {:>11} {:>10} {:>10} {:>9} {:>5}",
        "planes",
        "paths by",
        "paths",
        "goodput Gb/s",
        "per host",
        "of linear",
        "FCT min",
        "FCT max",
        "retx",
        "data"
    );
    let mut rows = Vec::new();
    let mut one_plane = 0.0;
    let runs = [1usize, 2, 4, 8]
        .into_iter()
        .flat_map(|p| [(p, true), (p, false)])
        .filter(|&(p, grouped)| grouped || p > 1);
    for (planes, grouped) in runs {
        // Grouped: paths pinned to planes by source port and spread evenly (the mechanism).
        // Baseline: each path's plane chosen by a hash of its 5-tuple, the endpoint unaware
        // of planes.
        let mut sim = Sim::new(SimConfig {
            uplink_policy: if grouped {
                UplinkPolicy::SourcePort
            } else {
                UplinkPolicy::FlowHash
            },
            ..SimConfig::with_seed(seed)
        });
        let paths = (8 * planes) as u16;
        sim.set_host_config(move |_, cfg| {
            cfg.transport.paths = paths;
            cfg.transport.planes = if grouped { planes as u16 } else { 1 };
        });
        let link = LinkConfig::new(100 * GBPS, Duration::from_micros(1))
            .with_queue_limit(1 << 20)
            .with_ecn_threshold(100_000);
        let mp = sim.multi_plane(
            planes,
            HOSTS,
            PlaneShape::LeafSpine {
                leaves: 2,
                spines: 8,
            },
            link.clone(),
            link,
        );
        let pairs: Vec<_> = (0..HOSTS)
            .map(|i| (mp.hosts[i], mp.hosts[(i + HOSTS / 2) % HOSTS]))
            .collect();
        let conns = connect_all(&mut sim, &pairs);
        let r = run_transfers(
            &mut sim,
            &pairs,
            &conns,
            bytes * planes,
            1,
            Duration::from_micros(10),
            Duration::from_secs(1),
            |_| {},
            |_, _| {},
        );
        let goodput = r.steady_gbps(0.2, 0.8);
        if planes == 1 {
            one_plane = goodput;
        }
        let linear = goodput / (one_plane * planes as f64);
        let fcts: Vec<Duration> = r.fct.iter().flatten().copied().collect();
        let retx: u64 = pairs
            .iter()
            .zip(&conns)
            .map(|(&(h, _), &c)| {
                let st = sim.endpoint(h).connection_stats(c).unwrap();
                st.paths.iter().map(|p| p.stats.retransmits).sum::<u64>()
            })
            .sum();
        // Bytes each plane carried (host -> leaf links), to show the spread.
        let per_plane: Vec<u64> = mp
            .planes
            .iter()
            .map(|p| {
                p.host_links
                    .iter()
                    .map(|l| sim.link_stats(l.forward).bytes)
                    .sum()
            })
            .collect();
        let ok = r.data_ok && fcts.len() == pairs.len() && r.errors == 0;
        println!(
            "{:>6} {:>8} {:>6} {:>14.1} {:>10.1} {:>10.1}% {:>10.2?} {:>10.2?} {:>9} {:>5}",
            planes,
            if grouped { "plane" } else { "hash" },
            paths,
            goodput,
            goodput / HOSTS as f64,
            100.0 * linear,
            fcts.iter().min().copied().unwrap_or_default(),
            fcts.iter().max().copied().unwrap_or_default(),
            retx,
            if ok { "ok" } else { "BAD" }
        );
        rows.push(
            Json::obj()
                .with("planes", planes)
                .with("grouped_by_plane", grouped)
                .with("paths", paths as u64)
                .with("goodput_gbps", goodput)
                .with("per_host_gbps", goodput / HOSTS as f64)
                .with("fraction_of_linear", linear)
                .with("bytes_per_plane", per_plane)
                .with("retransmits", retx)
                .with(
                    "fct_max_us",
                    fcts.iter().max().map_or(0.0, |d| d.as_secs_f64() * 1e6),
                )
                .with("data_ok", ok),
        );
    }
    Json::obj()
        .with("experiment", "multiplane")
        .with("hosts", HOSTS)
        .with("bytes_per_flow_per_plane", bytes)
        .with("seed", seed)
        .with("target", "4- and 8-plane within 10% of linear")
        .with("runs", Json::Arr(rows))
        .save("multiplane");
}
