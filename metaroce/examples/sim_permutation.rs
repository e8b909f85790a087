//! Experiment (b): permutation traffic on a non-oversubscribed leaf-spine, spraying over many
//! paths vs a single path, in the same run (same fabric, seed and traffic).
//!
//! Fabric: 4 leaves × 8 hosts, 8 spines, every link 100 Gbit/s and 1 µs, 1 MiB port queues
//! marking CE above 100 KB. Host `i` of leaf `l` RDMA-WRITEs `--bytes` (default 16 MiB) to
//! host `i` of leaf `l + 1`: every byte crosses the spine layer, and every host sends and
//! receives exactly one flow, so the ideal aggregate is 32 × 100 Gbit/s — the fabric's full
//! bisection bandwidth (each leaf has 8 × 100 Gbit/s up and down).
//!
//! Goodput counts WRITE data delivered to the receivers (4096 bytes per full packet) over the
//! middle of the transfer (20 % to 80 % of the first completion time), as a fraction of
//! 32 × 100 Gbit/s. Per-packet headers (66 bytes of Ethernet/IP/UDP framing + the RoCE and
//! MetaRoCE headers) cap it near 97 %.
//!
//! ```text
//! cargo run --release -p metaroce --features sim --example sim_permutation [-- --bytes 16777216 --seed 1]
//! ```
//! Writes `experiments/sim/results/permutation.json`.

#[path = "sim_common/mod.rs"]
mod common;

use common::{connect_all, run_transfers, Json};
use metaroce::sim::{LinkConfig, Sim, SimConfig, GBPS};
use std::time::Duration;

const LEAVES: usize = 4;
const SPINES: usize = 8;
const PER_LEAF: usize = 8;

/// Command-line options.
#[derive(clap::Parser)]
struct Opts {
    /// Bytes each flow WRITEs.
    #[arg(long, default_value_t = 16 << 20)]
    bytes: usize,
    /// Simulator seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn main() {
    let Opts { bytes, seed } = clap::Parser::parse();
    let bisection_gbps = (LEAVES * PER_LEAF) as f64 * 100.0;
    println!(
        "permutation traffic, {LEAVES} leaves x {PER_LEAF} hosts, {SPINES} spines, 100 Gbit/s links; \
         {bytes} bytes per flow; bisection {bisection_gbps} Gbit/s"
    );
    println!(
        "{:>6} {:>14} {:>12} {:>10} {:>10} {:>9} {:>8} {:>5}",
        "paths", "goodput Gb/s", "of bisect.", "FCT min", "FCT max", "retx", "drops", "data"
    );
    let mut rows = Vec::new();
    for paths in [1u16, 2, 4, 8, 16, 32] {
        let mut sim = Sim::new(SimConfig::with_seed(seed));
        sim.set_host_config(move |_, cfg| cfg.transport.paths = paths);
        let link = LinkConfig::new(100 * GBPS, Duration::from_micros(1))
            .with_queue_limit(1 << 20)
            .with_ecn_threshold(100_000);
        let t = sim.leaf_spine(LEAVES, SPINES, PER_LEAF, link.clone(), link);
        let pairs: Vec<_> = (0..LEAVES * PER_LEAF)
            .map(|k| {
                let (l, i) = (k / PER_LEAF, k % PER_LEAF);
                (t.hosts[k], t.hosts[((l + 1) % LEAVES) * PER_LEAF + i])
            })
            .collect();
        let conns = connect_all(&mut sim, &pairs);
        let r = run_transfers(
            &mut sim,
            &pairs,
            &conns,
            bytes,
            1,
            Duration::from_micros(10),
            Duration::from_secs(1),
            |_| {},
            |_, _| {},
        );
        let goodput = r.steady_gbps(0.2, 0.8);
        let fcts: Vec<Duration> = r.fct.iter().flatten().copied().collect();
        let retx: u64 = pairs
            .iter()
            .zip(&conns)
            .map(|(&(h, _), &c)| {
                let st = sim.endpoint(h).connection_stats(c).unwrap();
                st.paths.iter().map(|p| p.stats.retransmits).sum::<u64>()
            })
            .sum();
        let drops: u64 = sim.links().map(|l| sim.link_stats(l).drops.total()).sum();
        let ok = r.data_ok && fcts.len() == pairs.len() && r.errors == 0;
        println!(
            "{:>6} {:>14.1} {:>11.1}% {:>10.2?} {:>10.2?} {:>9} {:>8} {:>5}",
            paths,
            goodput,
            100.0 * goodput / bisection_gbps,
            fcts.iter().min().copied().unwrap_or_default(),
            fcts.iter().max().copied().unwrap_or_default(),
            retx,
            drops,
            if ok { "ok" } else { "BAD" }
        );
        rows.push(
            Json::obj()
                .with("paths", paths as u64)
                .with("goodput_gbps", goodput)
                .with("fraction_of_bisection", goodput / bisection_gbps)
                .with(
                    "fct_min_us",
                    fcts.iter().min().map_or(0.0, |d| d.as_secs_f64() * 1e6),
                )
                .with(
                    "fct_max_us",
                    fcts.iter().max().map_or(0.0, |d| d.as_secs_f64() * 1e6),
                )
                .with("retransmits", retx)
                .with("drops", drops)
                .with("series_gbps", r.gbps())
                .with("data_ok", ok),
        );
    }
    Json::obj()
        .with("experiment", "permutation")
        .with("leaves", LEAVES)
        .with("spines", SPINES)
        .with("hosts_per_leaf", PER_LEAF)
        .with("link_gbps", 100u64)
        .with("bytes_per_flow", bytes)
        .with("seed", seed)
        .with("bisection_gbps", bisection_gbps)
        .with("bin_us", 10u64)
        .with("target", "spraying >= 90% of bisection")
        .with("runs", Json::Arr(rows))
        .save("permutation");
}
