//! No allocation per packet in steady state (issue #13): a counting global allocator
//! watches two sans-IO endpoints in one thread while endpoint A keeps 16 RDMA WRITEs
//! outstanding to endpoint B over a lossless in-memory network (the shape of the
//! `core_rate` bench). After a warm-up, the allocations made by the core over a window of
//! many datagrams must be zero. (The warm-up is long: the responder's table of executed op
//! ids grows to `max_tracked_ops` entries and its hash table settles after two resizes.)
//!
//! `ALLOC_TRACE=N` prints the backtraces of the first N allocations in the window (to find
//! them when the test fails; `counting_alloc`).

use metaroce::{Access, Endpoint, EndpointConfig, Event, WcStatus, WriteRequest};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

mod counting_alloc;

/// A datagram in flight: bytes (a pooled buffer), length, sender, ECN codepoint.
type Dgram = (Vec<u8>, usize, SocketAddr, Option<metaroce::EcnCodepoint>);

fn config(i: usize) -> EndpointConfig {
    let addr: SocketAddr = format!("10.0.0.{}:4791", i + 1).parse().unwrap();
    let mut c = EndpointConfig::new(addr, (0..8).map(|k| 0xC000 + k + 16 * i as u16).collect());
    c.seed = 3 + i as u64;
    // The responder remembers the last `max_tracked_ops` executed op ids (for duplicate
    // detection); its tables grow until that many ops were executed, then stay put. A
    // smaller bound than the default 65 536 lets the warm-up reach that steady state sooner
    // (its hash table settles after a resize or two: removals leave tombstones, and the
    // table is rehashed in place once it is at most half full).
    c.transport.max_tracked_ops = 4096;
    c
}

/// Runs WRITEs of `size` bytes, 16 outstanding, for `warm` completions and then `measure`
/// datagrams; returns (allocations in the window, datagrams in the window).
fn run(size: u32, warm: u64, measure: u64) -> (u64, u64) {
    let _one = counting_alloc::exclusive();
    let (a, b) = (config(0), config(1));
    let addrs = [a.local_addr, b.local_addr];
    let mut eps = [Endpoint::new(a).unwrap(), Endpoint::new(b).unwrap()];
    let mut now = Instant::now();
    // The harness's own buffers are allocated up front and reused.
    let mut queues: [Vec<Dgram>; 2] = [Vec::with_capacity(4096), Vec::with_capacity(4096)];
    let mut pool: Vec<Vec<u8>> = (0..8192).map(|_| Vec::with_capacity(8192)).collect();
    let mut buf = Vec::with_capacity(1 << 16);
    let c = eps[0].connect(now, addrs[1], None).unwrap();
    let inflight = 16u64;
    let region = (size as usize).max(4096) * inflight as usize;
    let local = eps[0].register_mr(vec![0x5a; region], Access::LOCAL_WRITE);
    let remote = eps[1].register_mr(vec![0; region], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let (mut posted, mut completed, mut datagrams) = (0u64, 0u64, 0u64);
    let mut established = false;
    let mut window_start = None;
    counting_alloc::measure_this_thread(true);
    let mut rounds = 0u64;
    loop {
        rounds += 1;
        assert!(rounds < 10_000_000, "no progress");
        for i in 0..2 {
            while let Some(t) = eps[i].poll_transmit(now, &mut buf) {
                let seg = t.segment_size.unwrap_or(t.size);
                for chunk in buf[..t.size].chunks(seg) {
                    let mut d = pool.pop().expect("harness pool");
                    d.clear();
                    d.extend_from_slice(chunk);
                    let from = SocketAddr::new(addrs[i].ip(), t.src_port);
                    queues[1 - i].push((d, chunk.len(), from, t.ecn));
                }
            }
        }
        for (i, ep) in eps.iter_mut().enumerate() {
            for (d, len, from, ecn) in queues[i].drain(..) {
                ep.handle_datagram(now, from, Some(addrs[i].ip()), ecn, &d[..len]);
                datagrams += 1;
                pool.push(d);
            }
        }
        now += Duration::from_micros(1);
        for ep in &mut eps {
            if ep.poll_timeout().is_some_and(|t| t <= now) {
                ep.handle_timeout(now);
            }
        }
        while let Some(e) = eps[0].poll_event() {
            match e {
                Event::Connected(_) => established = true,
                Event::Completion { wc, .. } => {
                    assert_eq!(wc.status, WcStatus::Success);
                    completed += 1;
                }
                _ => {}
            }
        }
        while eps[1].poll_event().is_some() {}
        if established {
            while posted < completed + inflight {
                let off = (posted % inflight) * size as u64;
                let req = WriteRequest {
                    wr_id: posted,
                    lkey: local.lkey,
                    local_offset: off,
                    len: size,
                    remote_addr: remote.addr + off,
                    rkey: remote.rkey,
                    imm: None,
                };
                eps[0].post_write(c, req).unwrap();
                posted += 1;
            }
        }
        match window_start {
            None if completed >= warm => {
                window_start = Some(datagrams);
                counting_alloc::start();
            }
            Some(s) if datagrams - s >= measure => {
                let n = counting_alloc::stop();
                counting_alloc::measure_this_thread(false);
                let s0 = eps[0].connection_stats(c).unwrap();
                let retx: u64 = s0.paths.iter().map(|p| p.stats.retransmits).sum();
                assert_eq!(retx, 0, "lossless run retransmitted");
                return (n, datagrams - s);
            }
            _ => {}
        }
    }
}

#[test]
fn no_allocation_per_packet_64b_writes() {
    let (allocs, datagrams) = run(64, 60_000, 200_000);
    println!("64 B WRITEs: {allocs} allocations over {datagrams} datagrams");
    assert_eq!(
        allocs, 0,
        "allocations over {datagrams} datagrams in steady state"
    );
}

#[test]
fn no_allocation_per_packet_4k_writes() {
    let (allocs, datagrams) = run(4096, 60_000, 200_000);
    println!("4 KiB WRITEs: {allocs} allocations over {datagrams} datagrams");
    assert_eq!(
        allocs, 0,
        "allocations over {datagrams} datagrams in steady state"
    );
}

/// An RDMA READ's responder reads the region as each response packet is built and never
/// copies the requested range (docs/PROTOCOL.md "RDMA READ"): a peer granted REMOTE_READ
/// cannot make it hold `max_rd_atomic` × the region's size, nor stall while it copies.
/// A 64 MiB READ runs with the counting allocator on for both endpoints (the requester
/// places into its own region; the harness's copies of datagrams are not counted): they
/// allocate less than 1/16 of the READ's length.
#[test]
fn read_response_is_not_copied() {
    const LEN: usize = 64 << 20;
    let _one = counting_alloc::exclusive();
    let (a, b) = (config(0), config(1));
    let addrs = [a.local_addr, b.local_addr];
    let mut eps = [Endpoint::new(a).unwrap(), Endpoint::new(b).unwrap()];
    let mut now = Instant::now();
    let mut buf = Vec::with_capacity(1 << 16);
    let c = eps[0].connect(now, addrs[1], None).unwrap();
    let local = eps[0].register_mr(vec![0; LEN], Access::LOCAL_WRITE);
    let src: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
    let remote = eps[1].register_mr(src, Access::REMOTE_READ);
    let mut queues: [Vec<Dgram>; 2] = [Vec::new(), Vec::new()];
    counting_alloc::measure_this_thread(true);
    let (mut posted, mut done) = (false, None);
    for _ in 0..10_000_000u64 {
        for i in 0..2 {
            while let Some(t) = eps[i].poll_transmit(now, &mut buf) {
                let seg = t.segment_size.unwrap_or(t.size);
                // The harness's copies of the datagrams are not counted.
                counting_alloc::measure_this_thread(false);
                for chunk in buf[..t.size].chunks(seg) {
                    let from = SocketAddr::new(addrs[i].ip(), t.src_port);
                    queues[1 - i].push((chunk.to_vec(), chunk.len(), from, t.ecn));
                }
                counting_alloc::measure_this_thread(true);
            }
        }
        for (i, ep) in eps.iter_mut().enumerate() {
            for (d, len, from, ecn) in queues[i].drain(..) {
                ep.handle_datagram(now, from, Some(addrs[i].ip()), ecn, &d[..len]);
            }
        }
        now += Duration::from_micros(1);
        for ep in &mut eps {
            if ep.poll_timeout().is_some_and(|t| t <= now) {
                ep.handle_timeout(now);
            }
        }
        while let Some(e) = eps[0].poll_event() {
            match e {
                Event::Connected(_) if !posted => {
                    // Counted from the READ's post on: the request, its execution, the
                    // response and its placement.
                    counting_alloc::start();
                    let req = metaroce::ReadRequest {
                        wr_id: 1,
                        lkey: local.lkey,
                        local_offset: 0,
                        len: LEN as u32,
                        remote_addr: remote.addr,
                        rkey: remote.rkey,
                    };
                    eps[0].post_read(c, req).unwrap();
                    posted = true;
                }
                Event::Completion { wc, .. } => done = Some(wc.status),
                _ => {}
            }
        }
        while eps[1].poll_event().is_some() {}
        if done.is_some() {
            break;
        }
    }
    let bytes = counting_alloc::bytes();
    counting_alloc::stop();
    counting_alloc::measure_this_thread(false);
    assert_eq!(done, Some(WcStatus::Success));
    let got = eps[0].mr_read(local.lkey, 0, LEN as u64).unwrap();
    assert!(got.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
    println!("64 MiB READ: {bytes} bytes allocated by both endpoints");
    assert!(
        bytes < (LEN / 16) as u64,
        "{bytes} bytes allocated for a {LEN}-byte READ: the response was copied"
    );
}
