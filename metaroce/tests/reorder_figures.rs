//! The reorder-tolerance figures of issue #11, measured on the one test network
//! (`metaroce::testing::Net`): a 16 MiB RDMA WRITE over a 10 Gbit/s link per direction
//! (10 µs one-way delay, 8 paths, path MTU 1024).
//!
//! * 5 % of A's data packets held back by a uniform 0..3 packet times (reordered within
//!   their path and across paths): fewer than 2 % of the packets are retransmitted.
//! * 1 % random loss of A's data packets: goodput at least 95 % of the lossless run.
//!
//! Figures are printed (`-- --nocapture`); assertions are on packet counts and on goodput
//! in virtual (deterministic) time.

use metaroce::testing::{pattern, Action, Filter, Kind, Net, Rule};
use metaroce::{Access, WcStatus, WriteRequest};
use std::time::Duration;

const LEN: usize = 16 << 20;
const RATE: u64 = 10_000_000_000;

struct Figures {
    sent: u64,
    retransmits: u64,
    gbps: f64,
}

fn run(seed: u64, rule: Option<Rule>) -> Figures {
    let mut net = Net::new(seed);
    net.rate_bps = Some(RATE);
    if let Some(r) = rule {
        net.add_rule(r);
    }
    let (a, _b) = net.connect();
    let data = pattern(seed, LEN);
    let src = net.eps[0].register_mr(data.clone(), Access::LOCAL_WRITE);
    let dst = net.eps[1].register_mr(vec![0; LEN], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let t0 = net.elapsed();
    net.eps[0]
        .post_write(
            a,
            WriteRequest {
                wr_id: 1,
                lkey: src.lkey,
                local_offset: 0,
                len: LEN as u32,
                remote_addr: dst.addr,
                rkey: dst.rkey,
                imm: None,
            },
        )
        .unwrap();
    let limit = t0 + Duration::from_secs(20);
    assert!(net.run_until(limit, |n| !n.completions(0, a).is_empty()));
    let t = net.elapsed() - t0;
    assert_eq!(net.completions(0, a)[0].status, WcStatus::Success);
    assert_eq!(net.eps[1].mr_read(dst.lkey, 0, LEN as u64).unwrap(), data);
    let st = net.eps[0].connection_stats(a).unwrap();
    Figures {
        sent: st.paths.iter().map(|p| p.stats.packets_sent).sum(),
        retransmits: st.paths.iter().map(|p| p.stats.retransmits).sum(),
        gbps: LEN as f64 * 8.0 / t.as_secs_f64() / 1e9,
    }
}

/// One packet time on the link: a 1024-byte datagram plus framing at 10 Gbit/s.
fn packet_time() -> Duration {
    Duration::from_nanos((1024 + 66) * 8 * 1_000_000_000 / RATE)
}

fn data_from_a() -> Filter {
    Filter::any().from(0).kind(Kind::Data)
}

#[test]
fn reordering_within_a_path_is_not_retransmitted() {
    for seed in 1..=3 {
        let f = run(
            seed,
            Some(Rule::always(
                data_from_a(),
                Action::Jitter {
                    prob: 0.05,
                    max: packet_time() * 3,
                },
            )),
        );
        let pct = 100.0 * f.retransmits as f64 / f.sent as f64;
        println!(
            "seed {seed}: 5 % reordered by up to 3 packet times: {} of {} packets retransmitted \
             ({pct:.3} %), {:.2} Gbit/s",
            f.retransmits, f.sent, f.gbps
        );
        assert!(pct < 2.0, "{pct:.3} % retransmitted");
    }
}

#[test]
fn one_percent_loss_keeps_95_percent_of_goodput() {
    for seed in 1..=3 {
        let clean = run(seed, None);
        let lossy = run(seed, Some(Rule::always(data_from_a(), Action::Drop(0.01))));
        let ratio = lossy.gbps / clean.gbps;
        println!(
            "seed {seed}: lossless {:.2} Gbit/s, 1 % loss {:.2} Gbit/s ({:.1} % of lossless; {} \
             of {} packets retransmitted)",
            clean.gbps,
            lossy.gbps,
            100.0 * ratio,
            lossy.retransmits,
            lossy.sent
        );
        assert!(
            ratio >= 0.95,
            "1 % loss: {:.1} % of lossless",
            100.0 * ratio
        );
    }
}
