//! The hooks of the in-memory test network that the fuzz harness uses (`metaroce::testing`):
//! impairment phases, truncating corruption, per-segment emission checks and the timer
//! assertion.

use bytes::Bytes;
use metaroce::testing::{self, pattern, Impair, ImpairPhase, Net};
use metaroce::Event;
use std::net::SocketAddr;
use std::time::Duration;

fn net(seed: u64) -> Net {
    let mut n = Net::impaired_with_configs(
        seed,
        Impair::default(),
        testing::config(0, seed),
        testing::config(1, seed),
    );
    n.check_emitted = true;
    n.check_timers = true;
    n
}

fn delivered(n: &Net, len: usize) -> bool {
    n.events[1]
        .iter()
        .any(|e| matches!(e, Event::Message { data, .. } if data.len() == len))
}

/// A phase that corrupts every datagram: the receiver counts both truncated (malformed)
/// and byte-flipped (bad ICRC) datagrams and drops them; after the phase the message is
/// delivered intact, with every emitted segment checked and the timer contract asserted.
#[test]
fn corrupt_phase_flips_and_truncates_then_delivery_completes() {
    let mut n = net(3);
    let (a, _b) = n.connect();
    let from = n.elapsed();
    n.phases.push(ImpairPhase {
        from,
        until: from + Duration::from_millis(30),
        impair: Impair {
            corrupt: 1.0,
            ..Impair::default()
        },
    });
    let msg = pattern(9, 256 * 1024);
    n.eps[0]
        .post_send(a, 0, 1, Bytes::from(msg.clone()))
        .unwrap();
    assert!(n.run_until(Duration::from_secs(20), |n| delivered(n, msg.len())));
    let got = n.events[1].iter().find_map(|e| match e {
        Event::Message { data, .. } => Some(data.clone()),
        _ => None,
    });
    assert_eq!(&got.unwrap()[..], &msg[..]);
    let s = n.eps[1].stats();
    println!(
        "receiver: malformed {} bad_icrc {}",
        s.malformed, s.bad_icrc
    );
    assert!(s.malformed > 0, "no truncated datagram was dropped: {s:?}");
    assert!(
        s.bad_icrc > 0,
        "no byte-flipped datagram was dropped: {s:?}"
    );
}

/// A blackhole phase drops everything sent inside its window and nothing outside it.
#[test]
fn blackhole_phase_applies_only_inside_its_window() {
    let mut n = net(5);
    let (a, _b) = n.connect();
    // Let the last handshake datagrams land first (no keepalive: the net goes quiet).
    assert!(n.run_until_idle(Duration::from_secs(1)));
    let from = n.elapsed();
    n.phases.push(ImpairPhase {
        from,
        until: from + Duration::from_millis(50),
        impair: Impair {
            blackhole: true,
            ..Impair::default()
        },
    });
    let before = n.delivered_to[1];
    n.eps[0]
        .post_send(a, 0, 1, Bytes::from(pattern(1, 4000)))
        .unwrap();
    n.run_for(Duration::from_millis(40));
    assert_eq!(
        n.delivered_to[1], before,
        "a datagram crossed the blackhole"
    );
    assert!(n.dropped > 0);
    assert!(n.run_until(Duration::from_secs(20), |n| delivered(n, 4000)));
}

/// The emission check rejects a datagram that does not parse.
#[test]
#[should_panic(expected = "unparsable")]
fn check_emitted_rejects_an_unparsable_datagram() {
    let dest: SocketAddr = "10.0.0.2:4791".parse().unwrap();
    testing::check_emitted(&[0xC2, 0, 0], "10.0.0.1".parse().unwrap(), dest, 0xC000);
}

/// The emission check rejects a packet whose ICRC is wrong, and accepts what an endpoint
/// really sends.
#[test]
fn check_emitted_checks_the_icrc() {
    let mut n = net(11);
    n.record = 64;
    n.connect();
    let sent = n.wire[0].clone();
    let dest = n.addrs[sent.to];
    let local = n.addrs[sent.from_ep].ip();
    testing::check_emitted(&sent.data, local, dest, sent.from.port());
    let mut bad = sent.data.clone();
    let last = bad.len() - 1;
    bad[last] ^= 0x55;
    let r =
        std::panic::catch_unwind(|| testing::check_emitted(&bad, local, dest, sent.from.port()));
    assert!(r.is_err(), "a wrong ICRC passed the emission check");
}
