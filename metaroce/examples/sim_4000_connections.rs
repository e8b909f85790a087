//! Cluster scale in the simulator: thousands of concurrent MetaRoCE connections, each with
//! one RDMA WRITE in flight at once, across a leaf-spine; every WRITE is checked byte for
//! byte at its target.
//!
//! ```text
//! cargo run --release -p metaroce --features sim --example sim_4000_connections
//! cargo run --release -p metaroce --features sim --example sim_4000_connections -- \
//!     --leaves=8 --hosts-per-leaf=8 --spines=8 --conns-per-pair=1 --bytes=262144 --seed=1
//! ```
//!
//! Default: 64 hosts (8 leaves × 8 hosts, 8 spines, 100 Gbit/s links with 1 µs delay,
//! 1 MiB switch queues, ECN marking above 200 kB), and every host opens `--conns-per-pair`
//! connections to every other host: 64 × 63 = 4,032 connections (each endpoint holds its
//! 63 outgoing and 63 accepted ones). Once all are established, each connection posts one
//! WRITE of `--bytes` (256 KiB) at the same instant, from its own offset of the source
//! host's region into its own slot of the target host's region.
//!
//! Prints the connection count, the simulated time until the last WRITE completed, the
//! aggregate goodput against what the bottleneck (host NICs or leaf uplinks, whichever
//! binds for this traffic matrix) allows, the spread of per-connection completion times
//! (min / median / p99 / max), the fraction of data packets that were retransmissions,
//! and the wall and CPU time with simulator events per second.

use clap::builder::TypedValueParser as _;
use clap::Parser;
use metaroce::sim::{HostId, LinkConfig, Sim, SimConfig, GBPS};
use metaroce::{Access, ConnectionHandle, Event, MrKeys, WcStatus, WriteRequest};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

/// Command-line options (`--name N` or `--name=N`).
#[derive(Debug, Clone, Copy, Parser)]
struct Opts {
    /// Leaf switches.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..).map(|v| v as usize))]
    leaves: usize,
    /// Hosts per leaf.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..).map(|v| v as usize))]
    hosts_per_leaf: usize,
    /// Spine switches.
    #[arg(long, default_value_t = 8)]
    spines: usize,
    /// Connections per ordered host pair.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..).map(|v| v as usize))]
    conns_per_pair: usize,
    /// Bytes per WRITE.
    #[arg(long, default_value_t = 256 << 10, value_parser = clap::value_parser!(u32).range(1..))]
    bytes: u32,
    /// Simulator seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Paths per connection.
    #[arg(long, default_value_t = 8)]
    paths: u16,
}

/// CPU time of this single-threaded process (from `/proc/self/schedstat`; zero if
/// unavailable): the machine may be shared, so wall time alone can mislead.
fn cpu_time() -> Duration {
    std::fs::read_to_string("/proc/self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .map(Duration::from_nanos)
        .unwrap_or_default()
}

/// Host `h`'s source bytes: a xorshift stream seeded by the host index.
fn source_pattern(h: usize, len: usize) -> Vec<u8> {
    let mut x = (h as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// One connection's WRITE: `src` host, `dst` host, `k`-th connection of the pair.
#[derive(Debug, Clone, Copy)]
struct Flow {
    src: usize,
    dst: usize,
    conn: ConnectionHandle,
    /// Offset in the source host's region (differs per target and connection).
    src_offset: u64,
    /// Slot (in units of `bytes`) in the target host's region.
    slot: u64,
}

/// When (since the start of the simulation) and how a flow's WRITE completed.
type Completed = (Duration, WcStatus);

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

fn main() {
    let o = Opts::parse();
    let wall0 = Instant::now();
    let mut sim = Sim::new(SimConfig::with_seed(o.seed));
    let paths = o.paths;
    sim.set_host_config(move |_, cfg| cfg.transport.paths = paths);
    let link = LinkConfig::new(100 * GBPS, Duration::from_micros(1))
        .with_queue_limit(1 << 20)
        .with_ecn_threshold(200_000);
    let hosts: Vec<HostId> = sim
        .leaf_spine(o.leaves, o.spines, o.hosts_per_leaf, link.clone(), link)
        .hosts;
    let n = hosts.len();
    let cpp = o.conns_per_pair;
    let len = o.bytes as u64;
    // Source region: `len` bytes plus room for a different starting offset per flow.
    let stride = 4099u64;
    let src_len = len + stride * (n * cpp) as u64;
    let slots = (n * cpp) as u64;
    let mut src: Vec<MrKeys> = Vec::new();
    let mut dst: Vec<MrKeys> = Vec::new();
    for (i, &h) in hosts.iter().enumerate() {
        let ep = sim.endpoint_mut(h);
        src.push(ep.register_mr(source_pattern(i, src_len as usize), Access::LOCAL_WRITE));
        dst.push(ep.register_mr(
            vec![0; (slots * len) as usize],
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        ));
    }
    let mut flows = Vec::new();
    for i in 0..n {
        for j in (0..n).filter(|&j| j != i) {
            for k in 0..cpp {
                let conn = sim.connect_endpoints(hosts[i], hosts[j]).unwrap();
                flows.push(Flow {
                    src: i,
                    dst: j,
                    conn,
                    src_offset: stride * (j * cpp + k) as u64,
                    slot: (i * cpp + k) as u64,
                });
            }
        }
    }
    let per_host = ((n - 1) * cpp) as u64;
    sim.run_while(|s| {
        s.elapsed() < Duration::from_secs(1)
            && hosts.iter().any(|&h| s.host_stats(h).connected < per_host)
    });
    let connected: u64 = hosts.iter().map(|&h| sim.host_stats(h).connected).sum();
    let objects: usize = hosts
        .iter()
        .map(|&h| sim.endpoint(h).connections().count())
        .sum();
    println!(
        "{n} hosts ({} leaves x {}, {} spines, 100 Gbit/s links), {} connections established \
         at {:?} ({objects} connection objects over all endpoints, up to {} per endpoint); \
         {} paths each",
        o.leaves,
        o.hosts_per_leaf,
        o.spines,
        connected,
        sim.elapsed(),
        hosts
            .iter()
            .map(|&h| sim.endpoint(h).connections().count())
            .max()
            .unwrap_or(0),
        o.paths,
    );
    assert_eq!(
        connected as usize,
        flows.len(),
        "not every connection came up"
    );

    // Post every WRITE at once; record each completion's time.
    let t0 = sim.elapsed();
    for (f_idx, f) in flows.iter().enumerate() {
        let req = WriteRequest {
            wr_id: f_idx as u64,
            lkey: src[f.src].lkey,
            local_offset: f.src_offset,
            len: o.bytes,
            remote_addr: dst[f.dst].addr + f.slot * len,
            rkey: dst[f.dst].rkey,
            imm: None,
        };
        sim.endpoint_mut(hosts[f.src])
            .post_write(f.conn, req)
            .unwrap();
    }
    let done: Rc<RefCell<Vec<Option<Completed>>>> = Rc::new(RefCell::new(vec![None; flows.len()]));
    let remaining = Rc::new(RefCell::new(flows.len()));
    {
        let (done, remaining) = (done.clone(), remaining.clone());
        sim.set_event_handler(move |ctx, ev| {
            if let Event::Completion { wc, .. } = ev {
                let slot = &mut done.borrow_mut()[wc.wr_id as usize];
                if slot.is_none() {
                    *slot = Some((ctx.time, wc.status));
                    *remaining.borrow_mut() -= 1;
                }
            }
            true
        });
    }
    let events0 = sim.stats().events;
    let wall = Instant::now();
    let cpu0 = cpu_time();
    sim.run_while(|s| s.elapsed() - t0 < Duration::from_secs(10) && *remaining.borrow() > 0);
    let wall = wall.elapsed();
    let cpu = cpu_time() - cpu0;
    let events = sim.stats().events - events0;
    let sim_time = sim.elapsed() - t0;

    // Check every WRITE: its slot holds exactly its source bytes.
    let done = done.borrow();
    let mut fct = Vec::new();
    let (mut failed, mut wrong, mut missing) = (0, 0, 0);
    for (f, result) in flows.iter().zip(done.iter()) {
        match *result {
            None => missing += 1,
            Some((_, status)) if status != WcStatus::Success => failed += 1,
            Some((t, _)) => fct.push(t - t0),
        }
        let expect = sim
            .endpoint(hosts[f.src])
            .mr_read(src[f.src].lkey, f.src_offset, len)
            .unwrap();
        let got = sim
            .endpoint(hosts[f.dst])
            .mr_read(dst[f.dst].lkey, f.slot * len, len)
            .unwrap();
        if got != expect {
            wrong += 1;
        }
    }
    fct.sort_unstable();

    let (mut retx, mut sent) = (0u64, 0u64);
    for &h in &hosts {
        let ep = sim.endpoint(h);
        for c in ep.connections() {
            for p in ep.connection_stats(c).unwrap().paths {
                retx += p.stats.retransmits;
                sent += p.stats.packets_sent;
            }
        }
    }
    let total_bytes = flows.len() as f64 * len as f64;
    // Lower bounds on the completion time: every host sends and receives (n-1)·cpp·len
    // through its 100 Gbit/s NIC; every leaf's uplinks carry what its hosts send off-leaf.
    let host_bound = per_host as f64 * len as f64 * 8.0 / 100e9;
    let hpl = o.hosts_per_leaf as f64;
    let leaf_bound = if o.leaves > 1 && o.spines > 0 {
        hpl * (n as f64 - hpl) * cpp as f64 * len as f64 * 8.0 / (o.spines as f64 * 100e9)
    } else {
        0.0
    };
    let bound = host_bound.max(leaf_bound);
    println!(
        "WRITEs: {} of {} completed successfully ({failed} with an error, {missing} \
         missing), {} with wrong data at the target; {} bytes each, {:.2} GiB in total",
        fct.len(),
        flows.len(),
        wrong,
        len,
        total_bytes / (1u64 << 30) as f64,
    );
    println!(
        "simulated time {sim_time:?} (lower bound {:?}: host NICs {:?}, leaf uplinks {:?})",
        Duration::from_secs_f64(bound),
        Duration::from_secs_f64(host_bound),
        Duration::from_secs_f64(leaf_bound),
    );
    println!(
        "aggregate goodput {:.1} Gbit/s; the bottleneck allows {:.1} Gbit/s for this traffic \
         matrix ({:.1}%)",
        total_bytes * 8.0 / sim_time.as_secs_f64() / 1e9,
        total_bytes * 8.0 / bound / 1e9,
        bound / sim_time.as_secs_f64() * 100.0,
    );
    if !fct.is_empty() {
        println!(
            "per-connection completion time: min {:?}, median {:?}, p99 {:?}, max {:?}",
            fct[0],
            percentile(&fct, 0.5),
            percentile(&fct, 0.99),
            fct[fct.len() - 1],
        );
    }
    println!(
        "data packets {sent}, retransmitted {retx} ({:.2}%)",
        retx as f64 * 100.0 / sent.max(1) as f64
    );
    println!(
        "write phase: {events} events, wall {:.2} s, cpu {:.2} s, {:.2} M events/s of cpu \
         time ({:.2} M/s of wall time); total wall time including setup {:.2} s",
        wall.as_secs_f64(),
        cpu.as_secs_f64(),
        events as f64 / cpu.as_secs_f64().max(1e-9) / 1e6,
        events as f64 / wall.as_secs_f64().max(1e-9) / 1e6,
        wall0.elapsed().as_secs_f64(),
    );
    if failed + missing + wrong > 0 {
        std::process::exit(1);
    }
}
