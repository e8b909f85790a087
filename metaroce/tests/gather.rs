//! Gather send (`Endpoint::poll_transmit_lent`, issue #13 P1): WRITE and READ-response
//! payloads stay in their regions and the I/O layer inserts them when it sends. The
//! datagrams must be the ones `poll_transmit` builds, byte for byte (headers, pad, ICRC),
//! through loss and retransmission, and a transmit must never read outside its region.

use metaroce::testing::{Impair, LendingRegion, Pair};
use metaroce::{Access, Event, ReadRequest, WcStatus, WorkCompletion, WriteRequest};
use std::time::Duration;

fn completions(events: &[Event]) -> Vec<WorkCompletion> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Completion { wc, .. } => Some(*wc),
            _ => None,
        })
        .collect()
}

fn pattern(n: usize, k: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 31 + i / 251 + k) as u8).collect()
}

/// WRITEs from endpoint 0 and a READ of endpoint 1's region, through 3 % loss; returns the
/// datagrams on the wire, the bytes sent from lent regions, and checks the data landed.
fn run(seed: u64, gather: bool) -> (Vec<Vec<u8>>, u64) {
    let impair = Impair {
        loss: 0.03,
        ..Impair::default()
    };
    let mut p = Pair::impaired(seed, impair);
    p.check_emitted = true;
    p.record = usize::MAX;
    p.gather = gather;
    let (c, _) = p.connect();
    let n = 1 << 20;
    let src = pattern(n, 1);
    let remote_src = pattern(n, 2);
    let local = p.eps[0].register_mr_memory(
        Box::new(LendingRegion::new(src.clone())),
        Access::LOCAL_WRITE,
    );
    let dst = p.eps[1].register_mr(vec![0; n], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let readable = p.eps[1].register_mr_memory(
        Box::new(LendingRegion::new(remote_src.clone())),
        Access::REMOTE_READ,
    );
    let landing = p.eps[0].register_mr(vec![0; n], Access::LOCAL_WRITE);
    // Odd sizes and offsets: pad bytes and spans that start mid-page.
    let chunk = n / 8 - 3;
    for k in 0..8u64 {
        let off = k * (n as u64 / 8) + 1;
        let len = chunk as u32 - 1;
        p.eps[0]
            .post_write(
                c,
                WriteRequest {
                    wr_id: k,
                    lkey: local.lkey,
                    local_offset: off,
                    len,
                    remote_addr: dst.addr + off,
                    rkey: dst.rkey,
                    imm: None,
                },
            )
            .unwrap();
    }
    p.eps[0]
        .post_read(
            c,
            ReadRequest {
                wr_id: 100,
                lkey: landing.lkey,
                local_offset: 0,
                len: n as u32 - 5,
                remote_addr: readable.addr + 5,
                rkey: readable.rkey,
            },
        )
        .unwrap();
    assert!(
        p.run_until(Duration::from_secs(30), |p| completions(&p.events[0]).len()
            == 9),
        "the operations did not complete (gather = {gather})"
    );
    for wc in completions(&p.events[0]) {
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    }
    let got = p.eps[1].mr_read(dst.lkey, 0, n as u64).unwrap();
    for k in 0..8 {
        let off = k * (n / 8) + 1;
        let len = chunk - 1;
        assert!(
            got[off..off + len] == src[off..off + len],
            "WRITE {k} data differs"
        );
    }
    let read = p.eps[0].mr_read(landing.lkey, 0, n as u64 - 5).unwrap();
    assert!(read[..] == remote_src[5..], "READ data differs");
    let wire = p.wire.iter().map(|s| s.data.clone()).collect();
    (wire, p.lent_bytes)
}

#[test]
fn gather_send_puts_the_same_datagrams_on_the_wire_as_copying() {
    for seed in [1, 2] {
        let (copied, none) = run(seed, false);
        let (gathered, lent) = run(seed, true);
        assert_eq!(none, 0);
        // The 8 WRITEs' payloads (1 MiB, plus what was re-sent); the READ's response
        // stays copied (the responder may write its region meanwhile).
        assert!(lent > 1_000_000, "only {lent} bytes were lent");
        assert_eq!(copied.len(), gathered.len(), "seed {seed}: datagram count");
        for (i, (a, b)) in copied.iter().zip(&gathered).enumerate() {
            assert!(a == b, "seed {seed}: datagram {i} differs");
        }
    }
}

/// WRITEs both ways with odd lengths (pad bytes) on both sides of the shortest payload
/// that is lent (1 KiB), so that a batch may mix lent and copied payloads and held ACKs
/// may ride in data batches (`join_ack`; with the payload lent, the buffer holds only
/// headers, so an ACK may only go behind the data).
fn both_ways(seed: u64, gather: bool) -> (Vec<Vec<u8>>, u64) {
    let mut p = Pair::new(seed);
    p.check_emitted = true;
    p.record = usize::MAX;
    p.gather = gather;
    let (c0, c1) = p.connect();
    let n = 1 << 20;
    let mut keys = Vec::new();
    for i in 0..2 {
        let src = p.eps[i].register_mr_memory(
            Box::new(LendingRegion::new(pattern(n, i))),
            Access::LOCAL_WRITE,
        );
        let dst = p.eps[i].register_mr(vec![0; n], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        keys.push((src, dst));
    }
    for k in 0..300u64 {
        for (i, c) in [(0, c0), (1, c1)] {
            let (src, _) = keys[i];
            let (_, dst) = keys[1 - i];
            let len = 990 + (k * 7 % 70) as u32;
            let off = k * 2048;
            p.eps[i]
                .post_write(
                    c,
                    WriteRequest {
                        wr_id: k,
                        lkey: src.lkey,
                        local_offset: off,
                        len,
                        remote_addr: dst.addr + off,
                        rkey: dst.rkey,
                        imm: None,
                    },
                )
                .unwrap();
        }
        p.run_for(Duration::from_micros(3));
    }
    assert!(
        p.run_until(Duration::from_secs(10), |p| (0..2).all(|i| completions(
            &p.events[i]
        )
        .len()
            == 300)),
        "the WRITEs did not complete (gather = {gather})"
    );
    for i in 0..2 {
        for wc in completions(&p.events[i]) {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        }
    }
    let wire = p.wire.iter().map(|s| s.data.clone()).collect();
    (wire, p.lent_bytes)
}

#[test]
fn gather_send_with_acks_riding_in_data_batches() {
    let (copied, _) = both_ways(3, false);
    let (gathered, lent) = both_ways(3, true);
    assert!(lent > 100_000, "only {lent} bytes were lent");
    assert_eq!(copied.len(), gathered.len(), "datagram count");
    for (i, (a, b)) in copied.iter().zip(&gathered).enumerate() {
        assert!(a == b, "datagram {i} differs");
    }
}

/// WRITEs from two lending regions (found by review: the equality claim below) and a plain (copied) one, interleaved so that
/// one GSO batch would hold packets of all three; a lent batch must end at a packet of
/// another lending region, and copied packets may sit between lent ones.
fn mixed_regions(seed: u64, gather: bool) -> (Vec<Vec<u8>>, u64) {
    let impair = Impair {
        loss: 0.02,
        ..Impair::default()
    };
    let mut p = Pair::impaired(seed, impair);
    p.check_emitted = true;
    p.record = usize::MAX;
    p.gather = gather;
    let (c, _) = p.connect();
    let n = 1 << 18;
    let srcs = [pattern(n, 7), pattern(n, 8), pattern(n, 9)];
    let a = p.eps[0].register_mr_memory(
        Box::new(LendingRegion::new(srcs[0].clone())),
        Access::LOCAL_WRITE,
    );
    let b = p.eps[0].register_mr_memory(
        Box::new(LendingRegion::new(srcs[1].clone())),
        Access::LOCAL_WRITE,
    );
    let v = p.eps[0].register_mr(srcs[2].clone(), Access::LOCAL_WRITE);
    let dst = p.eps[1].register_mr(vec![0; 3 * n], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let keys = [a.lkey, b.lkey, v.lkey];
    let mut k = 0u64;
    for round in 0..40u64 {
        for (r, lkey) in keys.iter().enumerate() {
            // Odd lengths of one MTU or a little more: full packets and short tails.
            let len = 4096 + 1 + (round * 13 % 100) as u32;
            let off = round * 6000 + r as u64;
            p.eps[0]
                .post_write(
                    c,
                    WriteRequest {
                        wr_id: k,
                        lkey: *lkey,
                        local_offset: off,
                        len,
                        remote_addr: dst.addr + r as u64 * n as u64 + off,
                        rkey: dst.rkey,
                        imm: None,
                    },
                )
                .unwrap();
            k += 1;
        }
    }
    assert!(
        p.run_until(Duration::from_secs(30), |p| completions(&p.events[0]).len()
            == k as usize),
        "the WRITEs did not complete (gather = {gather})"
    );
    for wc in completions(&p.events[0]) {
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    }
    let got = p.eps[1].mr_read(dst.lkey, 0, 3 * n as u64).unwrap();
    for round in 0..40usize {
        for r in 0..3 {
            let len = 4096 + 1 + (round * 13 % 100);
            let off = round * 6000 + r;
            assert!(
                got[r * n + off..r * n + off + len] == srcs[r][off..off + len],
                "round {round} region {r}: data differs (gather = {gather})"
            );
        }
    }
    let wire = p.wire.iter().map(|s| s.data.clone()).collect();
    (wire, p.lent_bytes)
}

#[test]
fn gather_send_with_writes_from_several_regions_interleaved() {
    // The data lands and every WRITE succeeds either way (checked in `mixed_regions`).
    // The datagrams are not those of the copy path byte for byte here: a batch ends at a
    // packet of another region, and the rest leaves as the next transmit, which may be
    // sprayed onto another path (other path ids and PSNs; seed 6: 104 datagrams).
    for seed in [5, 6] {
        let (copied, _) = mixed_regions(seed, false);
        let (gathered, lent) = mixed_regions(seed, true);
        assert!(lent > 300_000, "only {lent} bytes were lent");
        assert!(!copied.is_empty() && !gathered.is_empty());
    }
}
