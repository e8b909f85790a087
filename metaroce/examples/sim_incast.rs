//! Incast in the simulator: 15 hosts RDMA-WRITE 2 MiB each into one host across a
//! leaf-spine; prints flow completion times, what the bottleneck queue did, and drops by
//! reason from the packet trace.
//!
//! ```text
//! cargo run --release -p metaroce --features sim --example sim_incast [seed]
//! ```

use metaroce::sim::{DropReason, LinkConfig, Sim, SimConfig, TraceKind, GBPS};
use metaroce::{Access, Event, WriteRequest};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;

fn main() {
    let seed = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let mut sim = Sim::new(SimConfig::with_seed(seed));
    let link = LinkConfig::new(100 * GBPS, Duration::from_micros(1))
        .with_queue_limit(512 << 10)
        .with_ecn_threshold(100_000);
    let t = sim.leaf_spine(2, 2, 8, link.clone(), link);
    let sink = t.hosts[0];
    let senders = &t.hosts[1..];

    // Drops by reason, from the trace.
    let drops: Rc<RefCell<BTreeMap<String, u64>>> = Rc::default();
    let d = drops.clone();
    sim.set_trace(move |e| {
        if let TraceKind::Drop(reason) = e.kind {
            let name = match reason {
                DropReason::QueueFull => "queue full".to_string(),
                other => format!("{other:?}"),
            };
            *d.borrow_mut().entry(name).or_default() += 1;
        }
    });

    let conns: Vec<_> = senders
        .iter()
        .map(|&s| sim.connect_endpoints(s, sink).unwrap())
        .collect();
    sim.run_while(|s| {
        s.elapsed() < Duration::from_millis(100)
            && senders
                .iter()
                .zip(&conns)
                .any(|(&h, &c)| !s.endpoint(h).is_established(c))
    });

    let len = 2u32 << 20;
    let target = sim.endpoint_mut(sink).register_mr(
        vec![0; len as usize],
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
    );
    let start = sim.elapsed();
    for (&s, &c) in senders.iter().zip(&conns) {
        let src = sim
            .endpoint_mut(s)
            .register_mr(vec![s.index() as u8; len as usize], Access::LOCAL_WRITE);
        let req = WriteRequest {
            wr_id: 0,
            lkey: src.lkey,
            local_offset: 0,
            len,
            remote_addr: target.addr,
            rkey: target.rkey,
            imm: None,
        };
        sim.endpoint_mut(s).post_write(c, req).unwrap();
    }
    sim.run_while(|s| {
        s.elapsed() < Duration::from_secs(1)
            && senders.iter().any(|&h| s.host_stats(h).completions == 0)
    });

    // Flow completion times from the time-stamped completion events.
    let mut fct: Vec<Duration> = senders
        .iter()
        .filter_map(|&h| {
            sim.events(h).iter().find_map(|e| match e.event {
                Event::Completion { .. } => Some(e.time - start),
                _ => None,
            })
        })
        .collect();
    fct.sort();
    println!(
        "{} of {} writes of {len} bytes completed; FCT min {:?}, median {:?}, max {:?} \
         (ideal for all: {:?})",
        fct.len(),
        senders.len(),
        fct.first().unwrap(),
        fct[fct.len() / 2],
        fct.last().unwrap(),
        Duration::from_secs_f64(senders.len() as f64 * f64::from(len) * 8.0 / 100e9)
    );
    let down = sim.link_stats(t.host_links[0].reverse);
    println!(
        "leaf -> sink link: {} packets, {} CE marks, {} tail drops, queue max {} B, average {:.0} B",
        down.packets, down.ce_marks, down.drops.queue_full, down.max_queue_bytes, down.avg_queue_bytes
    );
    let retx: u64 = senders
        .iter()
        .zip(&conns)
        .map(|(&h, &c)| {
            let st = sim.endpoint(h).connection_stats(c).unwrap();
            st.paths.iter().map(|p| p.stats.retransmits).sum::<u64>()
        })
        .sum();
    println!(
        "retransmitted packets: {retx}; drops by reason: {:?}",
        drops.borrow()
    );
    println!("{:?}", sim.stats());
}
