//! `metaroce::sim::collective` at small size: ring all-reduce and all-to-all over a
//! two-plane leaf-spine, with many paths and with one path per connection, clean, with 1 %
//! loss on the host uplinks and with a failed spine link. Every run must complete with the
//! right data on every rank, no failed completion and no lost connection (times are printed,
//! not asserted). The full-size study is `examples/sim_collectives.rs`.
//!
//! Run with `cargo test -p metaroce --features sim --test sim_collectives`.
#![cfg(feature = "sim")]

use metaroce::sim::collective::{run_collective, Collective};
use metaroce::sim::{
    Action, HostId, Impairments, LinkConfig, PlaneShape, Sim, SimConfig, UplinkPolicy, GBPS,
};
use std::time::Duration;

const HOSTS: usize = 16;
const LEAVES: usize = 4;

fn run(multipath: bool, loss: bool, fail: bool, coll: Collective) {
    let mut sim = Sim::new(SimConfig {
        uplink_policy: UplinkPolicy::SourcePort,
        ..SimConfig::with_seed(3)
    });
    sim.set_host_config(move |_, cfg| {
        cfg.transport.paths = if multipath { 8 } else { 1 };
        cfg.transport.planes = if multipath { 2 } else { 1 };
    });
    let link = LinkConfig::new(25 * GBPS, Duration::from_micros(1))
        .with_queue_limit(1 << 20)
        .with_ecn_threshold(100_000);
    let mp = sim.multi_plane(
        2,
        HOSTS,
        PlaneShape::LeafSpine {
            leaves: LEAVES,
            spines: 2,
        },
        link.clone(),
        link.clone(),
    );
    if loss {
        for p in &mp.planes {
            for l in &p.host_links {
                sim.link_config_mut(l.forward).impairments = Impairments {
                    loss: 0.01,
                    ..Impairments::default()
                };
            }
        }
    }
    let per_leaf = HOSTS / LEAVES;
    let ranks: Vec<HostId> = (0..HOSTS)
        .map(|r| mp.hosts[(r % LEAVES) * per_leaf + r / LEAVES])
        .collect();
    let failed = mp.planes[0].fabric_links[0][0];
    let r = run_collective(&mut sim, &ranks, coll, Duration::from_secs(2), |sim| {
        if fail {
            for l in failed.both() {
                sim.apply(Action::LinkDown(l));
            }
        }
    })
    .expect("connections established");
    println!(
        "{coll:?} multipath={multipath} loss={loss} failed_link={fail}: {:?}, {} packets, {} \
         retransmitted, {} RTOs",
        r.time, r.packets_sent, r.retransmits, r.rtos
    );
    assert!(r.completed, "{coll:?}: not complete: {r:?}");
    assert!(r.data_ok, "{coll:?}: {} wrong bytes", r.wrong_bytes);
    assert_eq!(r.wrong_bytes, 0);
    assert_eq!(r.errors, 0, "{r:?}");
    assert_eq!(r.connections_lost, 0, "{r:?}");
    let per_rank = coll.bytes_sent_per_rank(HOSTS) as usize;
    let chunk = match coll {
        Collective::RingAllReduce { bytes_per_rank } => bytes_per_rank / HOSTS,
        Collective::AllToAll { bytes_per_pair } => bytes_per_pair,
    };
    assert_eq!(r.writes as usize, HOSTS * per_rank / chunk);
    if loss || fail {
        assert!(r.retransmits > 0, "impairments that cost nothing: {r:?}");
    }
}

fn all(coll: Collective) {
    for multipath in [true, false] {
        for (loss, fail) in [(false, false), (true, false), (false, true)] {
            run(multipath, loss, fail, coll);
        }
    }
}

#[test]
fn ring_allreduce_completes_with_the_right_sum() {
    all(Collective::RingAllReduce {
        bytes_per_rank: 128 << 10,
    });
}

#[test]
fn all_to_all_delivers_every_chunk() {
    all(Collective::AllToAll {
        bytes_per_pair: 16 << 10,
    });
}
