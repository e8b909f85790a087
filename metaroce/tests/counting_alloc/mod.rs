//! A counting global allocator for the steady-state allocation tests (issue #13: no
//! allocation per packet). It counts the allocations made by the threads that called
//! [`measure_this_thread`], between [`start`] and [`stop`], and the bytes they asked for
//! ([`bytes`]). One copy, used by
//! `metaroce/tests/alloc_steady_state.rs` (the core) and, through `#[path]`, by
//! `metaroce-tokio/tests/alloc_driver.rs` (the driver).
//!
//! `ALLOC_TRACE=N` prints the backtraces of the first N allocations counted (to find them
//! when a test fails).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);
static TRACE_LEFT: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Set on the measured threads only (the test harness runs other threads).
    static MEASURED: Cell<bool> = const { Cell::new(false) };
    static IN_TRACE: Cell<bool> = const { Cell::new(false) };
}

/// One measurement at a time: the count is global, so tests of one binary that measure
/// hold this while they do (the test harness runs them on parallel threads).
#[allow(dead_code)] // not every test file that includes this module needs it
pub fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Count (or stop counting) the allocations of the calling thread.
pub fn measure_this_thread(on: bool) {
    MEASURED.with(|m| m.set(on));
}

/// Reset the count and start counting.
pub fn start() {
    ALLOCS.store(0, Ordering::Relaxed);
    BYTES.store(0, Ordering::Relaxed);
    TRACE_LEFT.store(
        std::env::var("ALLOC_TRACE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
        Ordering::Relaxed,
    );
    COUNTING.store(true, Ordering::Relaxed);
}

/// Stop counting; returns the allocations counted since [`start`].
pub fn stop() -> u64 {
    COUNTING.store(false, Ordering::Relaxed);
    ALLOCS.load(Ordering::Relaxed)
}

/// Bytes the allocations counted since [`start`] asked for (a `realloc` counts its new
/// size).
#[allow(dead_code)] // not every test file that includes this module asks
pub fn bytes() -> u64 {
    BYTES.load(Ordering::Relaxed)
}

fn note(size: usize) {
    if !COUNTING.load(Ordering::Relaxed)
        || !MEASURED.try_with(|m| m.get()).unwrap_or(false)
        || IN_TRACE.try_with(|t| t.get()).unwrap_or(true)
    {
        return;
    }
    ALLOCS.fetch_add(1, Ordering::Relaxed);
    BYTES.fetch_add(size as u64, Ordering::Relaxed);
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
        note(l.size());
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        note(l.size());
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        note(n);
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
