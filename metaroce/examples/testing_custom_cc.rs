//! Checking your own congestion-control settings on the in-memory test network.
//!
//! The scenario: A sends 64 messages of 64 KiB to B on four streams over a 10 Gbit/s link
//! (10 µs one way) that CE-marks 20 % of the packets and loses 1 % of A's data packets. For each congestion
//! controller (the default AIMD, Swift, DCQCN, and an AIMD tuned the way "you" would), the
//! example checks the rules every MetaRoCE connection must keep — every message delivered
//! exactly once, in order within its stream, byte for byte, and every SEND completed
//! successfully — and prints virtual completion time, retransmissions and CE marks.
//!
//! Everything runs on virtual time: the run is deterministic for a seed and takes no
//! wall-clock time beyond the CPU it needs.
//!
//! `cargo run -p metaroce --features testing --example testing_custom_cc`

use metaroce::config::CongestionAlgorithm;
use metaroce::testing::{config, pattern, Action, Filter, Kind, Net, Rule};
use metaroce::{Event, WcStatus};
use std::time::Duration;

const MESSAGES: u64 = 64;
const LEN: usize = 64 * 1024;
const STREAMS: u64 = 4;

fn run(name: &str, tune: impl Fn(&mut metaroce::EndpointConfig)) -> Result<(), String> {
    let seed = 42;
    let (mut a, mut b) = (config(0, seed), config(1, seed));
    tune(&mut a);
    tune(&mut b);
    let mut net = Net::with_configs(seed, a, b);
    // A 10 Gbit/s link per direction, 10 µs one way: the queue builds in the network.
    net.rate_bps = Some(10_000_000_000);
    net.add_rule(Rule::always(Filter::any(), Action::Ce(0.2)));
    net.add_rule(Rule::always(
        Filter::any().from(0).kind(Kind::Data),
        Action::Drop(0.01),
    ));
    let (ca, cb) = net.connect();
    let t0 = net.elapsed();
    for i in 0..MESSAGES {
        let stream = (i % STREAMS) as u32;
        net.eps[0]
            .post_send(ca, stream, i, pattern(i, LEN).into())
            .map_err(|e| format!("post_send {i}: {e:?}"))?;
    }
    let done = net.run_until(Duration::from_secs(30), |n| {
        n.completions(0, ca).len() == MESSAGES as usize
    });
    if !done {
        return Err(format!("{name}: not every SEND completed"));
    }
    // Rule 1: every SEND completed successfully, in posting order.
    let wcs = net.completions(0, ca);
    for (i, wc) in wcs.iter().enumerate() {
        if wc.status != WcStatus::Success || wc.wr_id != i as u64 {
            return Err(format!("{name}: completion {i} is {wc:?}"));
        }
    }
    // Rule 2: exactly once, in order per stream, byte for byte.
    let got = net.messages(1, cb);
    for stream in 0..STREAMS {
        let want: Vec<Vec<u8>> = (0..MESSAGES)
            .filter(|i| i % STREAMS == stream)
            .map(|i| pattern(i, LEN))
            .collect();
        let have: Vec<Vec<u8>> = got
            .get(&(stream as u32))
            .map(|v| v.iter().map(|m| m.to_vec()).collect())
            .unwrap_or_default();
        if have != want {
            return Err(format!("{name}: stream {stream} delivered wrong messages"));
        }
    }
    let lost = net.events[1]
        .iter()
        .any(|e| matches!(e, Event::ConnectionLost { .. }));
    if lost {
        return Err(format!("{name}: connection lost"));
    }
    let st = net.eps[0].connection_stats(ca).unwrap();
    let sent: u64 = st.paths.iter().map(|p| p.stats.packets_sent).sum();
    let retx: u64 = st.paths.iter().map(|p| p.stats.retransmits).sum();
    let ce = net.eps[1].connection_stats(cb).map_or(0, |s| s.ce_received);
    let secs = (net.elapsed() - t0).as_secs_f64();
    println!(
        "{name:<14} {:>9.2} ms {:>9.1} Mbit/s {sent:>8} {retx:>6} {ce:>6}",
        secs * 1e3,
        (MESSAGES * LEN as u64 * 8) as f64 / secs / 1e6,
    );
    Ok(())
}

fn main() -> Result<(), String> {
    println!(
        "{:<14} {:>12} {:>16} {:>8} {:>6} {:>6}",
        "controller", "time", "goodput", "packets", "retx", "CE"
    );
    run("aimd", |_| {})?;
    run("swift", |c| {
        c.transport.congestion.algorithm = CongestionAlgorithm::swift_default();
    })?;
    run("dcqcn", |c| {
        c.transport.congestion.algorithm = CongestionAlgorithm::Dcqcn {
            line_rate_mbps: 100_000,
            rate_ai_mbps: 40,
            rate_hai_mbps: 400,
            g: 1.0 / 256.0,
            cnp_interval: Duration::from_micros(50),
            rate_timer: Duration::from_micros(55),
        };
    })?;
    // Your own tuning: a gentler ECN reaction and a larger initial window.
    run("aimd-tuned", |c| {
        c.transport.congestion.ecn_beta = 0.9;
        c.transport.congestion.initial_window = 64;
    })?;
    println!("every controller kept the delivery rules");
    Ok(())
}
