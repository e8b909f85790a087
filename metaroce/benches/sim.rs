//! Speed of `metaroce::sim`.
//!
//! ```text
//! cargo bench -p metaroce --features sim --bench sim                 # both, full size
//! cargo bench -p metaroce --features sim --bench sim -- busy         # events/s only
//! cargo bench -p metaroce --features sim --bench sim -- all2all --leaves=4 --hosts-per-leaf=8
//! ```
//!
//! * `busy`: a 4-leaf × 4-spine leaf-spine with 8 hosts per leaf (100 Gbit/s links); every
//!   host keeps an RDMA WRITE stream going to a host on another leaf for `--busy-ms`
//!   (default 20) of simulated time. Reports events per second of wall time.
//! * `all2all`: `--leaves` (8) × `--hosts-per-leaf` (16) hosts, `--spines` (8), 100 Gbit/s
//!   links; every host connects to every other host and RDMA-WRITEs `--bytes` (1 MiB) to
//!   it. Reports the simulated completion time, wall time, events and events/s.
//!
//! * `scaling`: the core's cost per call of `Endpoint::poll_transmit` (when it has nothing
//!   to send) and `Endpoint::poll_timeout`, for an endpoint with 1 to 4,064 established,
//!   idle connections — the calls the driving contract makes after every datagram.
//!
//! Options for `busy` and `all2all`: `--gso=N` (transport `max_gso_segments`, default 1),
//! `--paths=N` (default 8), `--ecn=BYTES` (switch ECN threshold, default 200000, 0 = off),
//! `--queue=BYTES` (switch queue limit, default 1 MiB), `--seed=N`, `--nic=BYTES`
//! (`SimConfig::nic_queue_bytes`, default 64 KiB, 0 = unlimited), `--rx-coalesce-ns=N`
//! (`SimConfig::rx_coalesce`, default 0), `--init-window=N` (transport initial window per
//! path in packets; default: the core's default).

use metaroce::sim::{HostId, LinkConfig, Sim, SimConfig, GBPS};
use metaroce::{Access, Event, WriteRequest};
use std::cell::Cell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

/// CPU time this (single-threaded) process has run, from `/proc/self/schedstat` (the
/// machine may be shared, so wall time alone can mislead); zero if unavailable.
fn cpu_time() -> Duration {
    std::fs::read_to_string("/proc/self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .map(Duration::from_nanos)
        .unwrap_or_default()
}

#[derive(Debug, Clone)]
struct Opts {
    what: Vec<String>,
    leaves: usize,
    hosts_per_leaf: usize,
    spines: usize,
    bytes: u32,
    busy_ms: u64,
    gso: usize,
    paths: u16,
    ecn: u64,
    queue: u64,
    seed: u64,
    nic: u64,
    rx_coalesce_ns: u64,
    init_window: u32,
}

fn parse() -> Opts {
    let mut o = Opts {
        what: Vec::new(),
        leaves: 8,
        hosts_per_leaf: 16,
        spines: 8,
        bytes: 1 << 20,
        busy_ms: 20,
        gso: 1,
        paths: 8,
        ecn: 200_000,
        queue: 1 << 20,
        seed: 1,
        nic: 64 << 10,
        rx_coalesce_ns: 0,
        init_window: 0,
    };
    for a in std::env::args().skip(1) {
        let (k, v) = a.split_once('=').unwrap_or((&a, ""));
        let n = || {
            v.parse::<u64>()
                .unwrap_or_else(|_| panic!("bad value in {a}"))
        };
        match k {
            "--leaves" => o.leaves = n() as usize,
            "--hosts-per-leaf" => o.hosts_per_leaf = n() as usize,
            "--spines" => o.spines = n() as usize,
            "--bytes" => o.bytes = n() as u32,
            "--busy-ms" => o.busy_ms = n(),
            "--gso" => o.gso = n() as usize,
            "--paths" => o.paths = n() as u16,
            "--ecn" => o.ecn = n(),
            "--queue" => o.queue = n(),
            "--seed" => o.seed = n(),
            "--nic" => o.nic = n(),
            "--rx-coalesce-ns" => o.rx_coalesce_ns = n(),
            "--init-window" => o.init_window = n() as u32,
            "busy" | "all2all" | "scaling" => o.what.push(a.clone()),
            // `cargo bench` passes --bench; ignore other harness flags too.
            _ if a.starts_with("--") => {}
            _ => panic!("unknown argument {a}"),
        }
    }
    if o.what.is_empty() {
        o.what = vec!["busy".into(), "all2all".into()];
    }
    o
}

fn build(o: &Opts, leaves: usize, hosts_per_leaf: usize, spines: usize) -> (Sim, Vec<HostId>) {
    let mut sim = Sim::new(SimConfig {
        nic_queue_bytes: (o.nic > 0).then_some(o.nic),
        rx_coalesce: Duration::from_nanos(o.rx_coalesce_ns),
        ..SimConfig::with_seed(o.seed)
    });
    let (gso, paths, iw) = (o.gso, o.paths, o.init_window);
    sim.set_host_config(move |_, cfg| {
        cfg.transport.max_gso_segments = gso;
        cfg.transport.paths = paths;
        if iw > 0 {
            cfg.transport.congestion.initial_window = iw;
        }
    });
    let mut link = LinkConfig::new(100 * GBPS, Duration::from_micros(1)).with_queue_limit(o.queue);
    if o.ecn > 0 {
        link = link.with_ecn_threshold(o.ecn);
    }
    let t = sim.leaf_spine(leaves, spines, hosts_per_leaf, link.clone(), link);
    (sim, t.hosts)
}

fn report(label: &str, sim: &Sim, wall: Duration, cpu: Duration) {
    let st = sim.stats();
    println!(
        "{label}: simulated {:?}, wall {:.3} s, cpu {:.3} s, events {}, {:.2} M events/s (cpu), \
         packets sent {} delivered {} dropped {}, {:.2} M packets delivered/s (cpu), \
         max pending events {}, max packets alive {}, timeouts {}",
        sim.elapsed(),
        wall.as_secs_f64(),
        cpu.as_secs_f64(),
        st.events,
        st.events as f64 / cpu.as_secs_f64() / 1e6,
        st.packets_sent,
        st.packets_delivered,
        st.packets_dropped,
        st.packets_delivered as f64 / cpu.as_secs_f64() / 1e6,
        st.max_pending_events,
        st.max_packets_alive,
        st.timeouts,
    );
}

/// Every host keeps WRITEs of 4 MiB flowing to the host `hosts_per_leaf` further on (on the
/// next leaf) for the given simulated time.
fn busy(o: &Opts) {
    let (leaves, hpl, spines) = (4, 8, 4);
    let (mut sim, hosts) = build(o, leaves, hpl, spines);
    let n = hosts.len();
    let chunk = 4u32 << 20;
    let mut conns = Vec::new();
    for i in 0..n {
        conns.push(
            sim.connect_endpoints(hosts[i], hosts[(i + hpl) % n])
                .unwrap(),
        );
    }
    sim.run_while(|s| {
        s.elapsed() < Duration::from_millis(100)
            && hosts
                .iter()
                .zip(&conns)
                .any(|(&h, &c)| !s.endpoint(h).is_established(c))
    });
    let mut reqs = Vec::new();
    for i in 0..n {
        let src = sim
            .endpoint_mut(hosts[i])
            .register_mr(vec![0xA5; chunk as usize], Access::LOCAL_WRITE);
        let dst = hosts[(i + hpl) % n];
        let dst = sim.endpoint_mut(dst).register_mr(
            vec![0; chunk as usize],
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        );
        let req = WriteRequest {
            wr_id: 0,
            lkey: src.lkey,
            local_offset: 0,
            len: chunk,
            remote_addr: dst.addr,
            rkey: dst.rkey,
            imm: None,
        };
        // Two WRITEs in flight per host; each completion posts the next.
        for k in 0..2 {
            sim.endpoint_mut(hosts[i])
                .post_write(conns[i], WriteRequest { wr_id: k, ..req })
                .unwrap();
        }
        reqs.push(req);
    }
    let by_host: HashMap<HostId, WriteRequest> = hosts.iter().copied().zip(reqs).collect();
    sim.set_event_handler(move |ctx, ev| {
        if let Event::Completion { conn, wc } = ev {
            let req = by_host[&ctx.host];
            let _ = ctx.endpoint.post_write(
                *conn,
                WriteRequest {
                    wr_id: wc.wr_id + 2,
                    ..req
                },
            );
        }
        true
    });
    let events0 = sim.stats().events;
    let t0 = sim.elapsed();
    let wall = Instant::now();
    let cpu0 = cpu_time();
    sim.run_until(t0 + Duration::from_millis(o.busy_ms));
    let wall = wall.elapsed();
    let cpu = cpu_time() - cpu0;
    let bytes: u64 = hosts
        .iter()
        .map(|&h| sim.host_stats(h).completed_bytes)
        .sum();
    report(
        &format!("busy leaf-spine {leaves}x{hpl} hosts, {spines} spines"),
        &sim,
        wall,
        cpu,
    );
    let ev = sim.stats().events - events0;
    println!(
        "busy: {ev} events in the measured window, {:.2} M events/s of cpu time \
         ({:.2} M/s of wall time); aggregate goodput {:.1} Gbit/s of simulated time",
        ev as f64 / cpu.as_secs_f64() / 1e6,
        ev as f64 / wall.as_secs_f64() / 1e6,
        bytes as f64 * 8.0 / (sim.elapsed() - t0).as_secs_f64() / 1e9
    );
}

/// Every ordered pair of hosts: one connection, one WRITE of `o.bytes`.
fn all_to_all(o: &Opts) {
    let wall0 = Instant::now();
    let (mut sim, hosts) = build(o, o.leaves, o.hosts_per_leaf, o.spines);
    let n = hosts.len();
    let len = o.bytes;
    println!(
        "all2all: {n} hosts ({} leaves x {}, {} spines, 100 Gbit/s, 1 us links), {} bytes per \
         ordered pair, {} pairs, {:.2} GiB total; paths {}, gso {}, ECN threshold {}, queue {}, \
         nic {}, rx coalesce {} ns, initial window {}",
        o.leaves,
        o.hosts_per_leaf,
        o.spines,
        len,
        n * (n - 1),
        (n * (n - 1)) as f64 * len as f64 / (1u64 << 30) as f64,
        o.paths,
        o.gso,
        o.ecn,
        o.queue,
        o.nic,
        o.rx_coalesce_ns,
        if o.init_window > 0 {
            o.init_window.to_string()
        } else {
            "default".into()
        }
    );
    // One source region per host, one target region per host that every peer writes the
    // same bytes into (keeps memory at 2 × bytes per host); checked at the end.
    let pattern: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
    let mut src = Vec::new();
    let mut dst = Vec::new();
    for &h in &hosts {
        src.push(
            sim.endpoint_mut(h)
                .register_mr(pattern.clone(), Access::LOCAL_WRITE),
        );
        dst.push(sim.endpoint_mut(h).register_mr(
            vec![0; len as usize],
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        ));
    }
    let mut conns = Vec::with_capacity(n * (n - 1));
    for (i, &a) in hosts.iter().enumerate() {
        for (j, &b) in hosts.iter().enumerate() {
            if i != j {
                conns.push((i, j, sim.connect_endpoints(a, b).unwrap()));
            }
        }
    }
    let t_connect = Instant::now();
    sim.run_while(|s| {
        s.elapsed() < Duration::from_secs(1)
            && hosts
                .iter()
                .any(|&h| s.host_stats(h).connected < (n - 1) as u64)
    });
    let connected: u64 = hosts.iter().map(|&h| sim.host_stats(h).connected).sum();
    println!(
        "all2all: {connected} connections established at {:?} (wall {:.2} s, events {})",
        sim.elapsed(),
        t_connect.elapsed().as_secs_f64(),
        sim.stats().events
    );
    let t0 = sim.elapsed();
    let events0 = sim.stats().events;
    for &(i, j, c) in &conns {
        let req = WriteRequest {
            wr_id: j as u64,
            lkey: src[i].lkey,
            local_offset: 0,
            len,
            remote_addr: dst[j].addr,
            rkey: dst[j].rkey,
            imm: None,
        };
        sim.endpoint_mut(hosts[i]).post_write(c, req).unwrap();
    }
    let per_host = (n - 1) as u64;
    let total_ops = per_host * n as u64;
    // Count completions in a handler: O(1) per event.
    let completed = Rc::new(Cell::new(0u64));
    let counter = completed.clone();
    sim.set_event_handler(move |_, ev| {
        if matches!(ev, Event::Completion { .. }) {
            counter.set(counter.get() + 1);
        }
        true
    });
    let wall = Instant::now();
    let cpu0 = cpu_time();
    let mut next_report = Duration::from_millis(1);
    sim.run_while(|s| {
        if s.elapsed() - t0 >= next_report {
            eprintln!(
                "  .. simulated {:?}: {}/{total_ops} writes done, {} events, wall {:.1} s, \
                 cpu {:.1} s",
                s.elapsed() - t0,
                completed.get(),
                s.stats().events - events0,
                wall.elapsed().as_secs_f64(),
                (cpu_time() - cpu0).as_secs_f64(),
            );
            next_report += Duration::from_millis(1);
        }
        s.elapsed() - t0 < Duration::from_secs(10) && completed.get() < total_ops
    });
    let wall = wall.elapsed();
    let cpu = cpu_time() - cpu0;
    let done: u64 = hosts.iter().map(|&h| sim.host_stats(h).completions).sum();
    let errors: u64 = hosts
        .iter()
        .map(|&h| sim.host_stats(h).completion_errors)
        .sum();
    let ok = hosts
        .iter()
        .zip(&dst)
        .all(|(&h, d)| sim.endpoint(h).mr_read(d.lkey, 0, u64::from(len)).unwrap() == pattern[..]);
    let mut retx = 0u64;
    let mut sent = 0u64;
    for &h in &hosts {
        let ep = sim.endpoint(h);
        for c in ep.connections() {
            if ep.is_client(c) {
                for p in ep.connection_stats(c).unwrap().paths {
                    retx += p.stats.retransmits;
                    sent += p.stats.packets_sent;
                }
            }
        }
    }
    let sim_time = sim.elapsed() - t0;
    let total = (n * (n - 1)) as f64 * f64::from(len);
    // Lower bounds: each host's NIC sends (n-1)·len; each leaf's uplinks carry
    // hosts_per_leaf·(n - hosts_per_leaf)·len.
    let host_bound = f64::from(len) * per_host as f64 * 8.0 / 100e9;
    let hpl = o.hosts_per_leaf as f64;
    let leaf_bound = if o.spines > 0 && o.leaves > 1 {
        hpl * (n as f64 - hpl) * f64::from(len) * 8.0 / (o.spines as f64 * 100e9)
    } else {
        0.0
    };
    println!(
        "all2all: {done} writes succeeded, {errors} failed, data {}; simulated completion \
         time {sim_time:?} (lower bound {:?}: host NIC {:?}, leaf uplinks {:?}); data \
         packets {sent}, retransmitted {retx} ({:.2}%)",
        if ok { "verified" } else { "WRONG" },
        Duration::from_secs_f64(host_bound.max(leaf_bound)),
        Duration::from_secs_f64(host_bound),
        Duration::from_secs_f64(leaf_bound),
        retx as f64 * 100.0 / sent.max(1) as f64
    );
    report("all2all (write phase)", &sim, wall, cpu);
    let ev = sim.stats().events - events0;
    println!(
        "all2all: write phase {ev} events, {:.2} M events/s of cpu time; aggregate goodput \
         {:.1} Gbit/s simulated; total wall time including setup {:.2} s",
        ev as f64 / cpu.as_secs_f64() / 1e6,
        total * 8.0 / sim_time.as_secs_f64() / 1e9,
        wall0.elapsed().as_secs_f64()
    );
}

/// Per-call cost of the endpoint's poll functions against its number of connections.
fn scaling() {
    for (peers, per_peer) in [
        (1usize, 1usize),
        (16, 1),
        (64, 1),
        (127, 1),
        (254, 1),
        (254, 16),
    ] {
        let conns = peers * per_peer;
        let mut sim = Sim::new(SimConfig::default());
        let sw = sim.add_switch();
        let link = LinkConfig::new(100 * GBPS, Duration::from_micros(1));
        let hosts: Vec<HostId> = (0..=peers).map(|_| sim.add_host()).collect();
        for &h in &hosts {
            sim.connect(h, sw, link.clone());
        }
        let hub = hosts[0];
        let handles: Vec<_> = hosts[1..]
            .iter()
            .flat_map(|&p| std::iter::repeat_n(p, per_peer))
            .map(|p| sim.connect_endpoints(hub, p).unwrap())
            .collect();
        sim.run_while(|s| {
            s.elapsed() < Duration::from_secs(1)
                && handles.iter().any(|&c| !s.endpoint(hub).is_established(c))
        });
        sim.run_for(Duration::from_millis(1));
        let now = sim.now();
        let ep = sim.endpoint_mut(hub);
        let mut buf = Vec::with_capacity(1 << 16);
        let iters = 200_000 / conns.max(1) as u32 + 1000;
        let t = Instant::now();
        for _ in 0..iters {
            assert!(ep.poll_transmit(now, &mut buf).is_none());
        }
        let tx = t.elapsed() / iters;
        let t = Instant::now();
        let mut x = 0usize;
        for _ in 0..iters {
            x += usize::from(ep.poll_timeout().is_some());
        }
        let to = t.elapsed() / iters;
        std::hint::black_box(x);
        println!(
            "scaling: {conns:>4} connections (8 paths each): poll_transmit -> None {:>8.2} us, \
             poll_timeout {:>8.2} us per call",
            tx.as_secs_f64() * 1e6,
            to.as_secs_f64() * 1e6
        );
    }
}

fn main() {
    let o = parse();
    for w in o.what.clone() {
        match w.as_str() {
            "busy" => busy(&o),
            "all2all" => all_to_all(&o),
            "scaling" => scaling(),
            _ => unreachable!(),
        }
    }
}
