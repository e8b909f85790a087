//! No allocation per packet in steady state (issue #13): a counting global allocator
//! watches two sans-IO endpoints in one thread while endpoint A keeps 16 RDMA WRITEs
//! outstanding to endpoint B over a lossless in-memory network (the shape of the
//! `core_rate` bench). After a warm-up, the allocations made by the core over a window of
//! many datagrams must be zero. (The warm-up is long: the responder's table of executed op
//! ids grows to `max_tracked_ops` entries and its hash table settles after two resizes.)
//!
//! `ALLOC_TRACE=N` prints the backtraces of the first N allocations in the window (to find
//! them when the test fails).

use metaroce::{Access, Endpoint, EndpointConfig, Event, WcStatus, WriteRequest};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);
static TRACE_LEFT: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Set on the measuring thread only (the test harness runs other threads).
    static MEASURED: Cell<bool> = const { Cell::new(false) };
    static IN_TRACE: Cell<bool> = const { Cell::new(false) };
}

fn note() {
    if !COUNTING.load(Ordering::Relaxed)
        || !MEASURED.with(|m| m.get())
        || IN_TRACE.with(|t| t.get())
    {
        return;
    }
    ALLOCS.fetch_add(1, Ordering::Relaxed);
    if TRACE_LEFT.load(Ordering::Relaxed) > 0 && !IN_TRACE.with(|t| t.replace(true)) {
        TRACE_LEFT.fetch_sub(1, Ordering::Relaxed);
        eprintln!(
            "allocation:\n{}",
            std::backtrace::Backtrace::force_capture()
        );
        IN_TRACE.with(|t| t.set(false));
    }
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note();
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        note();
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        note();
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, n) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

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
    MEASURED.with(|m| m.set(true));
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
                ALLOCS.store(0, Ordering::Relaxed);
                TRACE_LEFT.store(
                    std::env::var("ALLOC_TRACE")
                        .ok()
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0),
                    Ordering::Relaxed,
                );
                COUNTING.store(true, Ordering::Relaxed);
            }
            Some(s) if datagrams - s >= measure => {
                COUNTING.store(false, Ordering::Relaxed);
                MEASURED.with(|m| m.set(false));
                let n = ALLOCS.load(Ordering::Relaxed);
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
