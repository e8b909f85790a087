//! The cluster-scale question (#14 item 3): collectives on a 128-host, two-plane, two-tier
//! fabric, MetaRoCE (spraying over many paths, SACK) against one path per connection and
//! against RoCEv2 RC queue pairs (one path per QP, go-back-N).
//!
//! Fabric: 2 planes, each a leaf-spine of 8 leaves × 4 spines; 128 hosts (16 per leaf),
//! each with one 25 Gbit/s uplink per plane (50 Gbit/s per host); leaf–spine links
//! 100 Gbit/s, so each plane is non-blocking (bisection 128/2 × 25 Gbit/s per plane and
//! direction). 1 µs per link, 1 MiB queues marking CE above 100 KB; the host picks the
//! plane by UDP source port (`UplinkPolicy::SourcePort`).
//!
//! Collectives (`metaroce::sim::collective`, data moved with WRITE_WITH_IMM, the result
//! checked on every rank):
//! * ring all-reduce of 4 MiB per rank (reduce-scatter + all-gather, 254 steps of 32 KiB),
//!   ring order interleaved over the leaves so that every hop crosses the spine;
//! * all-to-all of 32 KiB per pair (4 MiB sent per rank, 8 128 connections).
//!
//! Transports:
//! * **MetaRoCE**: 16 paths per connection (8 per plane), plane-aware, SACK loss recovery;
//! * **MetaRoCE paths=1**: `transport.paths = 1`, `planes = 1` — the RoCEv2 path model (one
//!   UDP source port per connection, so one ECMP route and one plane) with MetaRoCE's loss
//!   recovery (SACK, timeouts that re-roll the port);
//! * **RoCEv2 RC (go-back-N)**: one standard RC QP per connection, native RoCEv2 through the
//!   endpoints' RoCEv2 mode (`Transport::Rc`): UDP source port `rdma_get_udp_sport` of the
//!   QPNs (one route, one plane), go-back-N on a sequence NAK or local ACK timeout, NCCL's
//!   defaults `timeout` 18 (4.096 µs × 2^18 ≈ 1.07 s) and `retry_cnt` 7, then the QP goes to
//!   the error state (a failed collective), DCQCN on (line rate 25 Gbit/s), path MTU 4096,
//!   128 unacknowledged PSNs per QP.
//!
//! Conditions: clean; 1 % random loss on every host uplink (host → leaf); one failed
//! spine link (plane 0, leaf 0 ↔ spine 0 down in both directions when the collective
//! starts, routes not recomputed: the blackhole a link failure is until routing converges).
//!
//! The failed link runs twice: with the default `min_rto` (1 ms, sized for OS timers) and
//! with a short one: MetaRoCE `min_rto` 200 µs (what a fabric with a ~10 µs RTT and a precise
//! timer can afford), RC `timeout` 14 (67 ms, NCCL's default before 2.14 and rc_pingpong's).
//!
//! Ideal: the bytes each rank sends over its 50 Gbit/s (for the ring this equals bytes
//! across the bisection / bisection bandwidth; for the all-to-all the bisection bound is
//! half of it and the hosts' injection bound is the tighter one).
//!
//! ```text
//! cargo run --release -p metaroce --features sim --example sim_collectives [-- --seed 1 --hosts 128]
//! ```
//! A run that fails (an RC QP in the error state) is reported with the time it failed.
//! Writes `experiments/sim/results/collectives.json`; `python3 experiments/plot_results.py
//! --collectives` draws `docs/results/sim_collectives.png`.

#[path = "sim_common/mod.rs"]
mod common;

use common::Json;
use metaroce::rocev2::RcConfig;
use metaroce::sim::collective::{
    run_collective_with, Collective, CollectiveRun, RcQpParams, Transport,
};
use metaroce::sim::{
    Action, HostId, Impairments, LinkConfig, PlaneShape, Sim, SimConfig, UplinkPolicy, GBPS,
};
use std::time::{Duration, Instant};

const PLANES: usize = 2;
const HOST_GBPS: u64 = 25;

#[derive(Clone, Copy, PartialEq)]
enum Cond {
    Clean,
    Loss,
    FailedLink,
    /// The failed link with a short timeout: MetaRoCE `min_rto` 200 µs instead of the 1 ms
    /// default; RC `timeout` 14 (67 ms) instead of 18.
    FailedLinkFastRto,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    MetaRoce,
    OnePath,
    Rc,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::MetaRoce => "MetaRoCE",
            Kind::OnePath => "MetaRoCE paths=1",
            Kind::Rc => "RoCEv2 RC (go-back-N)",
        }
    }
}

impl Cond {
    fn name(self) -> &'static str {
        match self {
            Cond::Clean => "clean",
            Cond::Loss => "1% loss",
            Cond::FailedLink => "failed spine link",
            Cond::FailedLinkFastRto => "failed, short timeout",
        }
    }
}

fn run(seed: u64, hosts: usize, kind: Kind, cond: Cond, coll: Collective) -> CollectiveRun {
    let multipath = kind == Kind::MetaRoce;
    let mut sim = Sim::new(SimConfig {
        uplink_policy: UplinkPolicy::SourcePort,
        ..SimConfig::with_seed(seed)
    });
    sim.set_host_config(move |_, cfg| {
        if cond == Cond::FailedLinkFastRto {
            cfg.transport.min_rto = Duration::from_micros(200);
        }
        if multipath {
            cfg.transport.paths = (8 * PLANES) as u16;
            cfg.transport.planes = PLANES as u16;
        } else {
            cfg.transport.paths = 1;
            cfg.transport.planes = 1;
        }
    });
    let leaves = (hosts / 16).max(2);
    let host_link = LinkConfig::new(HOST_GBPS * GBPS, Duration::from_micros(1))
        .with_queue_limit(1 << 20)
        .with_ecn_threshold(100_000);
    let fabric = LinkConfig::new(HOST_GBPS * 4 * GBPS, Duration::from_micros(1))
        .with_queue_limit(1 << 20)
        .with_ecn_threshold(100_000);
    let mp = sim.multi_plane(
        PLANES,
        hosts,
        PlaneShape::LeafSpine { leaves, spines: 4 },
        host_link,
        fabric,
    );
    if cond == Cond::Loss {
        for p in &mp.planes {
            for l in &p.host_links {
                sim.link_config_mut(l.forward).impairments = Impairments {
                    loss: 0.01,
                    ..Impairments::default()
                };
            }
        }
    }
    // Ring order: rank r on leaf r % leaves, so every ring hop crosses the spine.
    let per_leaf = hosts / leaves;
    let ranks: Vec<HostId> = (0..hosts)
        .map(|r| mp.hosts[(r % leaves) * per_leaf + r / leaves])
        .collect();
    let failed = mp.planes[0].fabric_links[0][0];
    let (transport, limit) = if kind == Kind::Rc {
        for &h in &mp.hosts {
            let ep = sim.endpoint_mut(h);
            let mut rc = RcConfig::new(ep.config().local_addr.ip());
            rc.dcqcn.line_rate_bps = HOST_GBPS * GBPS;
            ep.set_rc_config(rc).expect("no QP yet");
        }
        let mut p = RcQpParams::nccl();
        if cond == Cond::FailedLinkFastRto {
            p.timeout = 14;
        }
        // Room for 8 timeouts of 1.07 s and for stalls under loss.
        (Transport::Rc(p), Duration::from_secs(30))
    } else {
        (Transport::MetaRoce, Duration::from_secs(2))
    };
    run_collective_with(&mut sim, &ranks, coll, transport, limit, |sim| {
        if matches!(cond, Cond::FailedLink | Cond::FailedLinkFastRto) {
            for l in failed.both() {
                sim.apply(Action::LinkDown(l));
            }
        }
    })
    .expect("connections established")
}

/// Command-line options.
#[derive(clap::Parser)]
struct Opts {
    /// Simulator seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Hosts (a multiple of 16; at least 32).
    #[arg(long, default_value_t = 128)]
    hosts: usize,
    /// Ring all-reduce buffer per rank, in KiB.
    #[arg(long, default_value_t = 4096)]
    allreduce_kib: usize,
    /// All-to-all bytes per pair, in KiB.
    #[arg(long, default_value_t = 32)]
    alltoall_kib: usize,
    /// Run only the rows whose "collective / transport / condition" contains this text
    /// (the JSON file is then not written).
    #[arg(long)]
    only: Option<String>,
}

fn main() {
    let o: Opts = clap::Parser::parse();
    let host_bps = (PLANES as u64 * HOST_GBPS * GBPS) as f64;
    println!(
        "collectives: {} hosts, {PLANES} planes x (leaf-spine {} leaves x 4 spines), {} Gbit/s per \
         host per plane, seed {}",
        o.hosts,
        (o.hosts / 16).max(2),
        HOST_GBPS,
        o.seed
    );
    println!(
        "{:<16} {:<22} {:<22} {:>10} {:>10} {:>7} {:>9} {:>7} {:>6} {:>6} {:>5}",
        "collective",
        "transport",
        "condition",
        "time",
        "ideal",
        "x ideal",
        "packets",
        "retx",
        "RTOs",
        "errors",
        "data"
    );
    let colls = [
        (
            "ring all-reduce",
            Collective::RingAllReduce {
                bytes_per_rank: o.allreduce_kib << 10,
            },
        ),
        (
            "all-to-all",
            Collective::AllToAll {
                bytes_per_pair: o.alltoall_kib << 10,
            },
        ),
    ];
    let mut rows = Vec::new();
    let wall = Instant::now();
    for (cname, coll) in colls {
        let ideal =
            Duration::from_secs_f64(coll.bytes_sent_per_rank(o.hosts) as f64 * 8.0 / host_bps);
        for kind in [Kind::MetaRoce, Kind::OnePath, Kind::Rc] {
            for cond in [
                Cond::Clean,
                Cond::Loss,
                Cond::FailedLink,
                Cond::FailedLinkFastRto,
            ] {
                let label = format!("{cname} / {} / {}", kind.name(), cond.name());
                if o.only.as_ref().is_some_and(|f| !label.contains(f.as_str())) {
                    continue;
                }
                let t = Instant::now();
                let r = run(o.seed, o.hosts, kind, cond, coll);
                let tname = kind.name();
                // A failed run: the time it failed.
                let time = r.failed_at.unwrap_or(r.time);
                let ratio = time.as_secs_f64() / ideal.as_secs_f64();
                let ok = r.completed && r.data_ok && r.errors == 0 && r.connections_lost == 0;
                let status = match (ok, r.qp_error) {
                    (true, _) => "ok".to_string(),
                    (false, Some(s)) => format!("QP error {s:?}"),
                    (false, None) => "BAD".to_string(),
                };
                println!(
                    "{:<16} {:<22} {:<22} {:>10.2?} {:>10.2?} {:>7.2} {:>9} {:>7} {:>6} {:>6} {}",
                    cname,
                    tname,
                    cond.name(),
                    time,
                    ideal,
                    ratio,
                    r.packets_sent,
                    r.retransmits,
                    r.rtos,
                    r.errors + r.connections_lost,
                    status
                );
                eprintln!("  ({:.1} s wall)", t.elapsed().as_secs_f64());
                rows.push(
                    Json::obj()
                        .with("collective", cname)
                        .with("transport", tname)
                        .with("condition", cond.name())
                        .with("completed", r.completed)
                        .with("failed", r.failed_at.is_some())
                        .with("status", status.as_str())
                        .with("data_ok", r.data_ok)
                        .with("time_us", time.as_secs_f64() * 1e6)
                        .with("ideal_us", ideal.as_secs_f64() * 1e6)
                        .with("ratio_to_ideal", ratio)
                        .with("bytes_sent_per_rank", coll.bytes_sent_per_rank(o.hosts))
                        .with("writes", r.writes)
                        .with("packets_sent", r.packets_sent)
                        .with("retransmits", r.retransmits)
                        .with("rtos", r.rtos)
                        .with("errors", r.errors)
                        .with("connections_lost", r.connections_lost),
                );
            }
        }
    }
    println!("wall time {:.1} s", wall.elapsed().as_secs_f64());
    if o.only.is_some() {
        return;
    }
    Json::obj()
        .with("experiment", "collectives")
        .with("hosts", o.hosts)
        .with("planes", PLANES)
        .with("host_gbps_per_plane", HOST_GBPS)
        .with("allreduce_bytes_per_rank", o.allreduce_kib << 10)
        .with("alltoall_bytes_per_pair", o.alltoall_kib << 10)
        .with("seed", o.seed)
        .with("runs", Json::Arr(rows))
        .save("collectives");
}
