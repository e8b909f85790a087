//! Experiment (a): N-to-1 incast (default 64 senders), receiver-driven fair share vs AIMD
//! alone, measured in the same run on the same fabric.
//!
//! Fabric: a leaf-spine of 5 leaves × 16 hosts and 4 spines; host links 100 Gbit/s, leaf-spine
//! links 400 Gbit/s (non-blocking), 1 µs per hop, 8 MiB port queues marking CE above 100 KB.
//! The sink is host 0 (alone on leaf 0); the senders are the hosts of leaves 1-4. Every sender
//! RDMA-WRITEs `--bytes` (default 2 MiB) to the sink.
//!
//! Two waves per mechanism. Cold: every sender opens a new connection to the sink at the
//! same instant and posts its WRITE the moment the connection is established; time counts
//! from the first establishment. With `--cold idle` the cold wave instead runs on
//! connections opened 2 ms earlier and idle since (never used), all WRITEs posted at the
//! same instant. Warm: 100 µs after the cold wave ends, all senders post again on the same
//! connections at the same instant, while the receiver still counts them as active.
//!
//! The round trip is the fabric's base RTT, measured first with one 4 KiB WRITE on an idle
//! fabric (the path's minimum RTT). Each sender's goodput at the sink (bytes of WRITE packets
//! delivered to the sink) is counted in RTT-sized bins from the moment the writes are posted;
//! Jain's fairness index is computed per bin until the first sender finishes. "Settled" is
//! the first bin from which Jain stays at or above 0.95.
//!
//! ```text
//! cargo run --release -p metaroce --features sim --example sim_incast64 [-- --senders 64 --bytes 2097152 --seed 1 --cold new|idle]
//! ```
//! Writes `experiments/sim/results/incast64.json`.

#[path = "sim_common/mod.rs"]
mod common;

use common::{connect_all, jain, pattern, post_write, register_pair, Json};
use metaroce::sim::{HostId, LinkConfig, Location, Sim, SimConfig, TraceKind, GBPS};
use metaroce::wire::Opcode;
use metaroce::{ConnectionHandle, WriteRequest};
use std::cell::RefCell;
use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::rc::Rc;
use std::time::Duration;

/// Bins of the sliding goodput window.
const SLIDE: usize = 10;

/// Command-line options.
#[derive(clap::Parser)]
struct Opts {
    /// Senders into the one sink.
    #[arg(long, default_value_t = 64)]
    senders: usize,
    /// Bytes each sender WRITEs.
    #[arg(long, default_value_t = 2 << 20)]
    bytes: usize,
    /// Simulator seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Cold wave on new connections (`new`) or on connections opened 2 ms before and idle
    /// since (`idle`).
    #[arg(long = "cold", value_name = "new|idle", default_value = "new", value_parser = parse_cold, action = clap::ArgAction::Set)]
    idle_cold: bool,
}

fn parse_cold(v: &str) -> Result<bool, String> {
    match v {
        "new" => Ok(false),
        "idle" => Ok(true),
        _ => Err("expected new or idle".into()),
    }
}

fn opts() -> Opts {
    clap::Parser::parse()
}

/// What one wave of the incast measured.
struct Wave {
    /// Jain's index of per-sender goodput per RTT bin (bin k covers ((k-1)·RTT, k·RTT]
    /// after the post), until the first sender finished.
    jain: Vec<f64>,
    /// Jain's index of goodput over the trailing `SLIDE` bins, at each bin.
    slide: Vec<f64>,
    /// Jain's index of the senders' windows sampled at the end of each bin.
    alloc: Vec<f64>,
    /// Aggregate goodput at the sink per bin, Gbit/s.
    agg_gbps: Vec<f64>,
    /// Largest sink-port queue per bin, bytes.
    queue: Vec<u64>,
    settled_bin: Option<usize>,
    settled_alloc: Option<usize>,
    settled_slide: Option<usize>,
    /// Mean window (packets) at the last bin before the first completion.
    mean_window: f64,
    peak_queue: u64,
    drops: u64,
    retransmits: u64,
    fct_max: Duration,
    fct_min: Duration,
    completed: usize,
    data_ok: bool,
}

struct Run {
    label: &'static str,
    base_rtt: Duration,
    waves: Vec<Wave>,
}

type Bins = Rc<RefCell<(Duration, Vec<Vec<f64>>, Vec<u64>)>>;

fn run(o: &Opts, fair_share: bool) -> Run {
    let mut sim = Sim::new(SimConfig::with_seed(o.seed));
    let capacity_mbps = 100_000;
    sim.set_host_config(move |_, cfg| {
        if fair_share {
            cfg.transport.recv_capacity_mbps = capacity_mbps;
        }
    });
    let host = LinkConfig::new(100 * GBPS, Duration::from_micros(1))
        .with_queue_limit(8 << 20)
        .with_ecn_threshold(100_000);
    let fabric = LinkConfig::new(400 * GBPS, Duration::from_micros(1))
        .with_queue_limit(8 << 20)
        .with_ecn_threshold(400_000);
    let per_leaf = 16;
    let leaves = 1 + o.senders.div_ceil(per_leaf);
    let t = sim.leaf_spine(leaves, 4, per_leaf, host, fabric);
    let sink = t.hosts[0];
    let senders: Vec<HostId> = t.hosts[per_leaf..per_leaf + o.senders].to_vec();

    // Base RTT: a 4 KiB write on the idle fabric completes one data round trip after it
    // is posted (one packet out, its ACK back). On a connection of its own, so that the
    // incast's connections are all new in the cold wave.
    let probe = connect_all(&mut sim, &[(senders[0], sink)])[0];
    let mut conns: Vec<ConnectionHandle> = if o.idle_cold {
        let pairs: Vec<_> = senders.iter().map(|&s| (s, sink)).collect();
        connect_all(&mut sim, &pairs)
    } else {
        Vec::new()
    };
    let t0 = sim.elapsed();
    post_write(&mut sim, senders[0], sink, probe, vec![1; 4096], u64::MAX);
    sim.run_while(|s| s.host_stats(senders[0]).completions == 0);
    let base_rtt = sim.events(senders[0]).back().unwrap().time - t0;
    sim.run_for(Duration::from_millis(2)); // let the fair-share window forget it
    sim.drain_events(senders[0]).for_each(drop);

    let index: HashMap<Ipv4Addr, usize> = senders
        .iter()
        .enumerate()
        .map(|(i, &h)| (sim.ip(h), i))
        .collect();
    let n = o.senders;
    let sink_down = t.host_links[0].reverse;
    let bins: Bins = Rc::new(RefCell::new((Duration::ZERO, Vec::new(), Vec::new())));
    let rtt_ns = base_rtt.as_nanos() as u64;
    {
        let bins = bins.clone();
        sim.set_trace(move |e| {
            let mut b = bins.borrow_mut();
            let bin = ((e.time.saturating_sub(b.0).as_nanos() as u64).saturating_sub(1) / rtt_ns)
                as usize;
            match (e.kind, e.location) {
                (TraceKind::Deliver, Location::Host(h)) if h == sink => {
                    if matches!(e.opcode, Some(Opcode::MR_WRITE)) {
                        if let Some(&i) = index.get(e.flow.src.ip()) {
                            while b.1.len() <= bin {
                                b.1.push(vec![0.0; n]);
                            }
                            b.1[bin][i] += f64::from(e.len);
                        }
                    }
                }
                (TraceKind::Enqueue, Location::Link(l)) if l == sink_down => {
                    if b.2.len() <= bin {
                        b.2.resize(bin + 1, 0);
                    }
                    b.2[bin] = b.2[bin].max(e.queue_bytes);
                }
                _ => {}
            }
        });
    }
    let mut waves = Vec::new();
    for wave in 0..2u64 {
        if wave > 0 {
            // A short pause (well inside the 1 ms fair-share window): the receiver still
            // knows its senders from the first wave.
            sim.run_for(Duration::from_micros(100));
        }
        let drops0: u64 = sim.links().map(|l| sim.link_stats(l).drops.total()).sum();
        let retx0 = retransmits(&sim, &senders, &conns);
        let base = wave * n as u64;
        let start;
        let targets: Vec<u32>;
        if wave == 0 && !o.idle_cold {
            // Cold: every sender opens its connection at the same instant and posts its
            // WRITE the moment the connection is up (in the event handler). Time is counted
            // from the first connection's establishment, when the first WRITE is posted.
            let mut reqs = HashMap::new();
            targets = senders
                .iter()
                .enumerate()
                .map(|(i, &s)| {
                    let (src, dst) =
                        register_pair(&mut sim, s, sink, pattern(i + base as usize, o.bytes));
                    reqs.insert(
                        s,
                        WriteRequest {
                            wr_id: base + i as u64,
                            lkey: src.lkey,
                            local_offset: 0,
                            len: o.bytes as u32,
                            remote_addr: dst.addr,
                            rkey: dst.rkey,
                            imm: None,
                        },
                    );
                    dst.lkey
                })
                .collect();
            conns = senders
                .iter()
                .map(|&s| sim.connect_endpoints(s, sink).expect("connect"))
                .collect();
            let posted = Rc::new(RefCell::new(0usize));
            let p = posted.clone();
            sim.set_event_handler(move |ctx, ev| {
                if let metaroce::Event::Connected(c) = ev {
                    if let Some(req) = reqs.remove(&ctx.host) {
                        ctx.endpoint.post_write(*c, req).expect("post_write");
                        *p.borrow_mut() += 1;
                    }
                }
                false
            });
            sim.run_while(|_| *posted.borrow() == 0);
            start = sim.elapsed();
        } else {
            start = sim.elapsed();
            targets = senders
                .iter()
                .zip(&conns)
                .enumerate()
                .map(|(i, (&s, &c))| {
                    post_write(
                        &mut sim,
                        s,
                        sink,
                        c,
                        pattern(i + base as usize, o.bytes),
                        base + i as u64,
                    )
                })
                .collect();
        }
        *bins.borrow_mut() = (start, Vec::new(), Vec::new());
        // Sample every sender's window (packets it may have in flight) at each RTT boundary.
        let mut windows: Vec<Vec<f64>> = Vec::new();
        let fct = |s: &Sim, i: usize| {
            s.events(senders[i]).iter().find_map(|e| match &e.event {
                metaroce::Event::Completion { wc, .. } if wc.wr_id == base + i as u64 => {
                    Some(e.time - start)
                }
                _ => None,
            })
        };
        while (0..n).any(|i| fct(&sim, i).is_none())
            && sim.elapsed() < start + Duration::from_secs(2)
        {
            sim.run_until(start + base_rtt * (windows.len() as u32 + 1));
            windows.push(
                senders
                    .iter()
                    .zip(&conns)
                    .map(|(&h, &c)| {
                        f64::from(sim.endpoint(h).connection_stats(c).unwrap().send_window)
                    })
                    .collect(),
            );
        }
        let fcts: Vec<Duration> = (0..n).filter_map(|i| fct(&sim, i)).collect();
        let fct_min = fcts.iter().copied().min().unwrap_or_default();
        let fct_max = fcts.iter().copied().max().unwrap_or_default();
        let data_ok = targets.iter().enumerate().all(|(i, &lkey)| {
            sim.endpoint(sink)
                .mr_read(lkey, 0, o.bytes as u64)
                .is_ok_and(|d| d == pattern(i + base as usize, o.bytes)[..])
        });
        let b = bins.borrow();
        let (bins_g, qbins) = (&b.1, &b.2);
        // Bins up to the first completion (after that the set of senders shrinks).
        let horizon = (fct_min.as_nanos() as u64 / rtt_ns) as usize;
        let used = horizon.min(bins_g.len());
        let jains: Vec<f64> = bins_g[..used].iter().map(|b| jain(b)).collect();
        let slide: Vec<f64> = (0..used)
            .map(|k| {
                let mut sum = vec![0.0; n];
                for b in &bins_g[k.saturating_sub(SLIDE - 1)..=k] {
                    for (x, y) in sum.iter_mut().zip(b) {
                        *x += y;
                    }
                }
                jain(&sum)
            })
            .collect();
        let alloc: Vec<f64> = windows[..used.min(windows.len())]
            .iter()
            .map(|w| jain(w))
            .collect();
        let agg: Vec<f64> = bins_g[..used]
            .iter()
            .map(|b| b.iter().sum::<f64>() * 8.0 / base_rtt.as_secs_f64() / 1e9)
            .collect();
        let settle = |j: &[f64]| {
            (0..j.len())
                .find(|&k| j[k..].iter().all(|&x| x >= 0.95))
                .map(|k| k + 1)
        };
        let drops: u64 = sim.links().map(|l| sim.link_stats(l).drops.total()).sum();
        waves.push(Wave {
            settled_bin: settle(&jains),
            settled_alloc: settle(&alloc),
            settled_slide: settle(&slide),
            mean_window: windows
                .get(used.saturating_sub(1))
                .map_or(0.0, |w| w.iter().sum::<f64>() / n as f64),
            jain: jains,
            slide,
            alloc,
            agg_gbps: agg,
            queue: qbins[..used.min(qbins.len())].to_vec(),
            peak_queue: qbins.iter().copied().max().unwrap_or(0),
            drops: drops - drops0,
            retransmits: retransmits(&sim, &senders, &conns) - retx0,
            fct_min,
            fct_max,
            completed: fcts.len(),
            data_ok,
        });
    }
    sim.clear_trace();
    sim.clear_event_handler();
    Run {
        label: if fair_share {
            "fair share (recv_capacity_mbps=100000)"
        } else {
            "AIMD alone (fair share off)"
        },
        base_rtt,
        waves,
    }
}

fn retransmits(sim: &Sim, senders: &[HostId], conns: &[metaroce::ConnectionHandle]) -> u64 {
    senders
        .iter()
        .zip(conns)
        .map(|(&h, &c)| {
            let st = sim.endpoint(h).connection_stats(c).unwrap();
            st.paths.iter().map(|p| p.stats.retransmits).sum::<u64>()
        })
        .sum()
}

fn fmt_bin(b: Option<usize>) -> String {
    b.map_or("never".to_string(), |b| b.to_string())
}

fn main() {
    let o = opts();
    let runs = [run(&o, true), run(&o, false)];
    let rtt = runs[0].base_rtt;
    // 100 Gbit/s over one RTT, in 4096-byte packets (+ 66 B of headers on the wire).
    let pkts_per_rtt = 100e9 * rtt.as_secs_f64() / 8.0 / (4096.0 + 66.0 + 60.0);
    println!(
        "{}-to-1 incast, {} bytes per sender, base RTT {:?} (bin = 1 RTT); the sink link \
         carries about {:.0} packets per RTT = {:.2} per sender",
        o.senders,
        o.bytes,
        rtt,
        pkts_per_rtt,
        pkts_per_rtt / o.senders as f64
    );
    println!(
        "{:<44} {:>7} {:>7} {:>7} {:>7} {:>9} {:>9} {:>9} {:>8} {:>7} {:>6} {:>9} {:>9} {:>4}",
        "mechanism",
        "Jw b1",
        "Jw b2",
        "Jw b3",
        "Jw min",
        "settle Jw",
        "settle Jg",
        "sett Jg10",
        "peakQ KB",
        "drops",
        "w/snd",
        "FCT min",
        "FCT max",
        "data"
    );
    for (r, w) in runs
        .iter()
        .flat_map(|r| r.waves.iter().enumerate().map(move |w| (r, w)))
    {
        let (wave, r2) = w;
        let label = format!("{} {}", r.label, if wave == 0 { "cold" } else { "warm" });
        let r_label = label.as_str();
        let r = r2;
        let j = |k: usize| r.alloc.get(k - 1).copied().unwrap_or(f64::NAN);
        let jmin = r
            .alloc
            .iter()
            .skip(2)
            .copied()
            .fold(f64::INFINITY, f64::min);
        println!(
            "{:<44} {:>7.3} {:>7.3} {:>7.3} {:>7.3} {:>9} {:>9} {:>9} {:>8} {:>7} {:>6.1} {:>9.2?} {:>9.2?} {:>4}",
            r_label,
            j(1),
            j(2),
            j(3),
            jmin,
            fmt_bin(r.settled_alloc),
            fmt_bin(r.settled_bin),
            fmt_bin(r.settled_slide),
            r.peak_queue / 1000,
            r.drops,
            r.mean_window,
            r.fct_min,
            r.fct_max,
            if r.data_ok && r.completed == o.senders {
                "ok"
            } else {
                "BAD"
            }
        );
    }
    println!(
        "Jw: Jain of the senders' windows at the end of RTT bin k; Jg: of per-sender goodput \
         at the sink in each RTT bin; Jg10: of goodput over the trailing {SLIDE} bins. \
         settle: first bin from which the index stays >= 0.95 until the first sender finishes."
    );
    let mut arr = Vec::new();
    for (r, (wave, r2)) in runs
        .iter()
        .flat_map(|r| r.waves.iter().enumerate().map(move |w| (r, w)))
    {
        let label = r.label;
        let r = r2;
        arr.push(
            Json::obj()
                .with("label", label)
                .with("wave", if wave == 0 { "cold" } else { "warm" })
                .with(
                    "settled_bin_window",
                    r.settled_alloc.map_or(-1i64, |b| b as i64),
                )
                .with(
                    "settled_bin_goodput",
                    r.settled_bin.map_or(-1i64, |b| b as i64),
                )
                .with(
                    "settled_bin_goodput_sliding",
                    r.settled_slide.map_or(-1i64, |b| b as i64),
                )
                .with("jain_window", r.alloc.clone())
                .with("jain_goodput", r.jain.clone())
                .with("jain_goodput_sliding", r.slide.clone())
                .with("aggregate_gbps", r.agg_gbps.clone())
                .with("queue_bytes", r.queue.clone())
                .with("peak_queue_bytes", r.peak_queue)
                .with("mean_window_packets", r.mean_window)
                .with("drops", r.drops)
                .with("retransmits", r.retransmits)
                .with("fct_min_us", r.fct_min.as_secs_f64() * 1e6)
                .with("fct_max_us", r.fct_max.as_secs_f64() * 1e6)
                .with("completed", r.completed)
                .with("data_ok", r.data_ok),
        );
    }
    Json::obj()
        .with("experiment", "incast")
        .with("senders", o.senders)
        .with("bytes_per_sender", o.bytes)
        .with("seed", o.seed)
        .with(
            "cold_wave",
            if o.idle_cold {
                "connections opened 2 ms before, idle"
            } else {
                "new connections, WRITE posted on establishment"
            },
        )
        .with("base_rtt_ns", rtt.as_nanos() as u64)
        .with("sliding_bins", SLIDE)
        .with("packets_per_rtt_at_sink", pkts_per_rtt)
        .with("target", "Jain >= 0.95 within 2 round trips")
        .with("runs", Json::Arr(arr))
        .save("incast64");
}
