//! Experiment (d): a whole plane of a multi-plane fabric fails in the middle of a transfer,
//! and comes back later; plane-aware path management against a plane-unaware endpoint on
//! the same fabric and traffic.
//!
//! Fabric: 4 planes, each a leaf-spine of 2 leaves and 4 spines; 8 hosts with one
//! 100 Gbit/s uplink per plane (1 µs links, 1 MiB queues marking CE above 100 KB); uplink by
//! source port (`UplinkPolicy::SourcePort`), 32 paths per connection (8 per plane). Host `i`
//! RDMA-WRITEs 16 × 16 MiB to host `i + 4`. At 1 ms every link of plane 1 goes down (both
//! directions, packets on them lost); at 3 ms they come back. No routing change, no
//! application involvement.
//!
//! * plane-aware: `transport.planes = 4`, `plane_retry_interval = 500 µs` (shortened from
//!   the 10 ms default so that the return of the plane shows within the run);
//! * plane-unaware baseline: `transport.planes = 1`: paths re-roll one by one after
//!   `path_reroll_timeouts` timeouts to the next spare source port, whatever its plane.
//!
//! Both run with the default `min_rto` (1 ms, sized for OS timers) and with 200 µs (what a
//! fabric with a ~10 µs RTT and a precise timer can afford): the retransmission timeout is
//! what a failure costs.
//!
//! Reported: aggregate goodput before the failure, the dip (worst 10 µs bin), the time
//! until goodput is back to 90 % of what 3 planes carry (3/4 of before) over a 50 µs window,
//! goodput while the plane is down, after it is back, the longest gap in any flow's data,
//! and whether every WRITE completed with the right data and no error.
//!
//! ```text
//! cargo run --release -p metaroce --features sim --example sim_plane_failure [-- --seed 1]
//! ```
//! Writes `experiments/sim/results/plane_failure.json`.

#[path = "sim_common/mod.rs"]
mod common;

use common::{connect_all, run_transfers, Json, Transfers};
use metaroce::sim::{Action, LinkConfig, PlaneShape, Sim, SimConfig, UplinkPolicy, GBPS};
use std::time::Duration;

const PLANES: usize = 4;
const HOSTS: usize = 8;
const FAILED: usize = 1;

fn ms(x: f64) -> Duration {
    Duration::from_secs_f64(x / 1e3)
}

struct Out {
    r: Transfers,
    per_plane_after: Vec<u64>,
    paths_per_plane_end: Vec<usize>,
    /// (time since the post, paths per plane) every 50 µs.
    spread: Vec<(Duration, Vec<usize>)>,
    retransmits: u64,
    rtos: u64,
}

fn run(seed: u64, aware: bool, min_rto: Duration, fail_at: Duration, up_at: Duration) -> Out {
    let mut sim = Sim::new(SimConfig {
        uplink_policy: UplinkPolicy::SourcePort,
        ..SimConfig::with_seed(seed)
    });
    sim.set_host_config(move |_, cfg| {
        cfg.transport.paths = (8 * PLANES) as u16;
        cfg.transport.min_rto = min_rto;
        if aware {
            cfg.transport.planes = PLANES as u16;
            cfg.transport.plane_retry_interval = Duration::from_micros(500);
        }
    });
    let link = LinkConfig::new(100 * GBPS, Duration::from_micros(1))
        .with_queue_limit(1 << 20)
        .with_ecn_threshold(100_000);
    let mp = sim.multi_plane(
        PLANES,
        HOSTS,
        PlaneShape::LeafSpine {
            leaves: 2,
            spines: 4,
        },
        link.clone(),
        link,
    );
    let pairs: Vec<_> = (0..HOSTS)
        .map(|i| (mp.hosts[i], mp.hosts[(i + HOSTS / 2) % HOSTS]))
        .collect();
    let conns = connect_all(&mut sim, &pairs);
    let dead = mp.planes[FAILED].all_links();
    let mut spread: Vec<(Duration, Vec<usize>)> = Vec::new();
    let r = run_transfers(
        &mut sim,
        &pairs,
        &conns,
        16 << 20,
        16,
        Duration::from_micros(10),
        Duration::from_secs(2),
        |sim| {
            let t0 = sim.elapsed();
            for &l in &dead {
                sim.schedule(t0 + fail_at, Action::LinkDown(l));
                sim.schedule(t0 + up_at, Action::LinkUp(l));
            }
        },
        |sim, t| {
            // Every 50 µs: how many paths (not failed) each plane has, over all connections.
            if t.as_nanos() % 50_000 == 0 {
                let mut per = vec![0usize; PLANES];
                for (&(h, _), &c) in pairs.iter().zip(&conns) {
                    for p in sim.endpoint(h).connection_stats(c).unwrap().paths {
                        if !p.failed {
                            per[p.src_port as usize % PLANES] += 1;
                        }
                    }
                }
                spread.push((t, per));
            }
        },
    );
    let per_plane_after = mp
        .planes
        .iter()
        .map(|p| {
            p.host_links
                .iter()
                .map(|l| sim.link_stats(l.forward).bytes)
                .sum()
        })
        .collect();
    let (mut retransmits, mut rtos) = (0, 0);
    for (&(h, _), &c) in pairs.iter().zip(&conns) {
        for p in sim.endpoint(h).connection_stats(c).unwrap().paths {
            retransmits += p.stats.retransmits;
            rtos += p.stats.rtos;
        }
    }
    let mut paths_per_plane_end = vec![0; PLANES];
    for (&(h, _), &c) in pairs.iter().zip(&conns) {
        for p in sim.endpoint(h).connection_stats(c).unwrap().paths {
            paths_per_plane_end[p.src_port as usize % PLANES] += 1;
        }
    }
    Out {
        r,
        per_plane_after,
        paths_per_plane_end,
        spread,
        retransmits,
        rtos,
    }
}

/// Command-line options.
#[derive(clap::Parser)]
struct Opts {
    /// Simulator seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn main() {
    let Opts { seed } = clap::Parser::parse();
    let (fail_at, up_at) = (ms(1.0), ms(3.0));
    println!(
        "plane failure: {PLANES} planes (2 leaves x 4 spines each), {HOSTS} hosts, 100 Gbit/s per \
         host per plane; plane {FAILED} down at {fail_at:?}, up at {up_at:?}"
    );
    println!(
        "{:<30} {:>9} {:>9} {:>10} {:>9} {:>10} {:>9} {:>10} {:>9} {:>6} {:>5}",
        "endpoints",
        "pre Gb/s",
        "dip Gb/s",
        "recovery",
        "down Gb/s",
        "of 3/4pre",
        "back Gb/s",
        "max stall",
        "FCT max",
        "errors",
        "data"
    );
    let mut rows = Vec::new();
    let configs = [
        (true, ms(1.0)),
        (false, ms(1.0)),
        (true, ms(0.2)),
        (false, ms(0.2)),
    ];
    for (aware, min_rto) in configs {
        let o = run(seed, aware, min_rto, fail_at, up_at);
        let r = &o.r;
        let bin = r.bin;
        let pre = r.mean_gbps(ms(0.5), fail_at);
        let expect = pre * (PLANES - 1) as f64 / PLANES as f64;
        let g = r.gbps();
        let fb = (fail_at.as_nanos() / bin.as_nanos()) as usize;
        let ub = (up_at.as_nanos() / bin.as_nanos()) as usize;
        let dip = g[fb..ub.min(g.len())]
            .iter()
            .copied()
            .fold(f64::INFINITY, f64::min);
        // Recovery: the first 50 µs window after the failure averaging >= 90 % of 3/4 pre.
        let w = 5;
        let rec_bin = (fb..ub.saturating_sub(w))
            .find(|&k| g[k..k + w].iter().sum::<f64>() / w as f64 >= 0.9 * expect);
        let recovery = rec_bin.map(|k| bin * (k + w - fb) as u32);
        let down = r.mean_gbps(fail_at + ms(0.5), up_at);
        let fct_max = r.fct.iter().flatten().max().copied().unwrap_or_default();
        let back = r.mean_gbps(up_at + ms(1.0), fct_max.mul_f64(0.95).max(up_at + ms(1.1)));
        let stall = r.max_gap.iter().max().copied().unwrap_or_default();
        let ok = r.data_ok && r.fct.iter().all(Option::is_some) && r.errors == 0;
        let label = format!(
            "{}, min_rto {:?}",
            if aware {
                "plane-aware"
            } else {
                "plane-unaware"
            },
            min_rto
        );
        println!(
            "{:<30} {:>9.1} {:>9.1} {:>10} {:>9.1} {:>9.1}% {:>9.1} {:>10.2?} {:>9.2?} {:>6} {:>5}",
            label.as_str(),
            pre,
            dip,
            recovery.map_or("never".to_string(), |d| format!("{d:.2?}")),
            down,
            100.0 * down / expect,
            back,
            stall,
            fct_max,
            r.errors + r.connections_lost,
            if ok { "ok" } else { "BAD" }
        );
        let on_failed_at = |t: Duration| {
            o.spread
                .iter()
                .find(|(s, _)| *s >= t)
                .map_or(0, |(_, per)| per[FAILED])
        };
        let cgap = r
            .max_completion_gap
            .iter()
            .max()
            .copied()
            .unwrap_or_default();
        println!(
            "{:<30} paths on plane {FAILED}: {} before, {} at +0.5 ms, {} at +1.5 ms, {} after it is \
             back (+1.5 ms); longest wait for a WRITE completion {:.2?} (16 MiB each); \
             {} retransmitted packets, {} timeouts",
            "",
            on_failed_at(fail_at - ms(0.05)),
            on_failed_at(fail_at + ms(0.5)),
            on_failed_at(fail_at + ms(1.5)),
            on_failed_at(up_at + ms(1.5)),
            cgap,
            o.retransmits,
            o.rtos,
        );
        println!(
            "{:<30} bytes sent per plane {:?}; paths per plane at the end {:?}",
            "", o.per_plane_after, o.paths_per_plane_end
        );
        rows.push(
            Json::obj()
                .with("label", label.as_str())
                .with("plane_aware", aware)
                .with("min_rto_us", min_rto.as_secs_f64() * 1e6)
                .with("pre_gbps", pre)
                .with("dip_gbps", dip)
                .with(
                    "recovery_us",
                    recovery.map_or(-1.0, |d| d.as_secs_f64() * 1e6),
                )
                .with("down_gbps", down)
                .with("down_fraction_of_three_planes", down / expect)
                .with("back_gbps", back)
                .with("max_stall_us", stall.as_secs_f64() * 1e6)
                .with("fct_max_us", fct_max.as_secs_f64() * 1e6)
                .with("errors", r.errors)
                .with("connections_lost", r.connections_lost)
                .with("bytes_per_plane", o.per_plane_after.clone())
                .with("paths_per_plane_end", o.paths_per_plane_end.clone())
                .with("series_gbps", g.clone())
                .with("max_completion_gap_us", cgap.as_secs_f64() * 1e6)
                .with("retransmits", o.retransmits)
                .with("timeouts", o.rtos)
                .with(
                    "paths_on_failed_plane_us",
                    Json::Arr(
                        o.spread
                            .iter()
                            .map(|(t, _)| Json::Num(t.as_secs_f64() * 1e6))
                            .collect(),
                    ),
                )
                .with(
                    "paths_on_failed_plane",
                    Json::Arr(
                        o.spread
                            .iter()
                            .map(|(_, p)| Json::Int(p[FAILED] as i64))
                            .collect(),
                    ),
                )
                .with("data_ok", ok),
        );
    }
    Json::obj()
        .with("experiment", "plane_failure")
        .with("planes", PLANES)
        .with("hosts", HOSTS)
        .with("failed_plane", FAILED)
        .with("fail_at_us", fail_at.as_secs_f64() * 1e6)
        .with("up_at_us", up_at.as_secs_f64() * 1e6)
        .with("bin_us", 10u64)
        .with("seed", seed)
        .with("runs", Json::Arr(rows))
        .save("plane_failure");
}
