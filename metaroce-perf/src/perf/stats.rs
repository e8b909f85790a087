//! Bandwidth and latency arithmetic.

use serde::Serialize;
use std::time::{Duration, Instant};

/// Shortest interval the peak bandwidth is measured over.
pub const PEAK_WINDOW: Duration = Duration::from_millis(100);

/// Resolution of the completion record: completions closer together than this share one
/// point (the later one's time, the sum of their bytes).
const POINT_RES: Duration = Duration::from_millis(1);

/// Records completions to compute the average and the peak bandwidth of a run.
///
/// The peak is the best rate over a real interval between two completion instants (or the
/// first post and a completion) at least [`PEAK_WINDOW`] long: the bytes completed in
/// (t_i, t_j] over t_j − t_i. So it is a rate the run achieved, never one made up by
/// putting a large completion's bytes into a window shorter than its time in flight; a run
/// with one completion has peak = average. Memory: one point per [`POINT_RES`] of run time
/// at most.
#[derive(Debug)]
pub struct BwMeter {
    start: Instant,
    /// (ns since `start`, bytes completed by then), in time order; the first is (0, 0).
    points: Vec<(u64, u64)>,
    /// When the last point received its first completion (ns since `start`).
    opened: u64,
    bytes: u64,
    ops: u64,
    last: Instant,
}

/// Bandwidth of one run.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct BwResult {
    /// Bytes completed.
    pub bytes: u64,
    /// Operations completed.
    pub ops: u64,
    /// First post to last completion, in seconds.
    pub elapsed_sec: f64,
    /// Average bandwidth, bytes per second.
    pub avg_bytes_per_sec: f64,
    /// Best rate over an interval of at least 100 ms between completions (or the first
    /// post and a completion), bytes per second; the average when higher (short runs).
    pub peak_bytes_per_sec: f64,
    /// Operations per second, in millions.
    pub msg_rate_mpps: f64,
}

impl BwMeter {
    /// A meter whose clock starts at `start` (the first post).
    pub fn new(start: Instant) -> Self {
        Self {
            start,
            points: vec![(0, 0)],
            opened: 0,
            bytes: 0,
            ops: 0,
            last: start,
        }
    }

    /// One operation of `bytes` completed at `now`.
    #[cfg(test)]
    pub fn record(&mut self, now: Instant, bytes: u64) {
        self.record_ops(now, bytes, 1);
    }

    /// `ops` operations of `bytes` in all completed at `now` (one signaled completion of
    /// a batch).
    pub fn record_ops(&mut self, now: Instant, bytes: u64, ops: u64) {
        let ns = now.saturating_duration_since(self.start).as_nanos() as u64;
        self.bytes += bytes;
        let res = POINT_RES.as_nanos() as u64;
        let merge = self.points.len() > 1 && ns < self.opened + res;
        match self.points.last_mut() {
            // Merge into the last point (never into the origin) within its resolution.
            Some(p) if merge => *p = (p.0.max(ns), self.bytes),
            _ => {
                self.opened = ns;
                self.points.push((ns, self.bytes));
            }
        }
        self.ops += ops;
        self.last = self.last.max(now);
    }

    /// The result.
    pub fn finish(&self) -> BwResult {
        let elapsed = self.last.saturating_duration_since(self.start);
        let secs = elapsed.as_secs_f64().max(1e-9);
        let avg = self.bytes as f64 / secs;
        // For every completion point j, the shortest interval (t_i, t_j] of at least the
        // window: i is the last point at least PEAK_WINDOW before t_j.
        let w = PEAK_WINDOW.as_nanos() as u64;
        let mut peak = avg;
        let mut i = 0;
        for j in 1..self.points.len() {
            let (tj, bj) = self.points[j];
            if tj < w {
                continue;
            }
            while i + 1 < j && self.points[i + 1].0 + w <= tj {
                i += 1;
            }
            let (ti, bi) = self.points[i];
            let rate = (bj - bi) as f64 / ((tj - ti) as f64 / 1e9);
            peak = peak.max(rate);
        }
        BwResult {
            bytes: self.bytes,
            ops: self.ops,
            elapsed_sec: elapsed.as_secs_f64(),
            avg_bytes_per_sec: avg,
            peak_bytes_per_sec: peak,
            msg_rate_mpps: self.ops as f64 / secs / 1e6,
        }
    }
}

/// Latency statistics in microseconds: one-way (half the round-trip times) for ping-pong
/// tests, whole round trips for READ and atomics.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LatStats {
    /// Samples.
    pub samples: u64,
    /// Minimum.
    pub t_min_usec: f64,
    /// Maximum.
    pub t_max_usec: f64,
    /// Median.
    pub t_typical_usec: f64,
    /// Mean.
    pub t_avg_usec: f64,
    /// Standard deviation.
    pub t_stdev_usec: f64,
    /// 99th percentile.
    pub p99_usec: f64,
    /// 99.9th percentile.
    pub p999_usec: f64,
}

impl LatStats {
    /// Statistics of the one-way latencies RTT/2 of `rtts`; `None` without samples.
    #[cfg(test)]
    pub fn from_rtts(rtts: &[Duration]) -> Option<LatStats> {
        Self::from_samples(rtts, 2.0)
    }

    /// Statistics of `samples / divisor`; `None` without samples.
    pub fn from_samples(samples: &[Duration], divisor: f64) -> Option<LatStats> {
        if samples.is_empty() {
            return None;
        }
        let mut v: Vec<f64> = samples
            .iter()
            .map(|d| d.as_secs_f64() * 1e6 / divisor)
            .collect();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let avg = v.iter().sum::<f64>() / n as f64;
        let var = v.iter().map(|x| (x - avg) * (x - avg)).sum::<f64>() / n as f64;
        let pct = |p: f64| {
            let rank = ((p * n as f64).ceil() as usize).clamp(1, n);
            v[rank - 1]
        };
        Some(LatStats {
            samples: n as u64,
            t_min_usec: v[0],
            t_max_usec: v[n - 1],
            t_typical_usec: v[n / 2],
            t_avg_usec: avg,
            t_stdev_usec: var.sqrt(),
            p99_usec: pct(0.99),
            p999_usec: pct(0.999),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_is_best_window() {
        let t0 = Instant::now();
        let mut m = BwMeter::new(t0);
        // 1000 bytes per ms for 300 ms, with a 100 ms burst of 3000 bytes per ms.
        for ms in 0..300u64 {
            let b = if (100..200).contains(&ms) { 3000 } else { 1000 };
            m.record(t0 + Duration::from_millis(ms), b);
        }
        let r = m.finish();
        assert!((r.peak_bytes_per_sec - 3_000_000.0).abs() < 1.0, "{r:?}");
        assert!(r.avg_bytes_per_sec < r.peak_bytes_per_sec);
    }

    #[test]
    fn peak_of_few_large_completions_is_what_was_achieved() {
        let t0 = Instant::now();
        // One 2 GiB completion after 23.7 s: peak = average.
        let mut m = BwMeter::new(t0);
        m.record(t0 + Duration::from_millis(23_700), 2 << 30);
        let r = m.finish();
        assert!(
            (r.peak_bytes_per_sec / r.avg_bytes_per_sec - 1.0).abs() < 1e-9,
            "{r:?}"
        );
        // Two 256 MiB completions at 1.0 s and 2.0 s: the best interval is either second,
        // 256 MiB/s, never 256 MiB per 100 ms.
        let mut m = BwMeter::new(t0);
        m.record(t0 + Duration::from_millis(1000), 256 << 20);
        m.record(t0 + Duration::from_millis(2000), 256 << 20);
        let r = m.finish();
        let mib_s = f64::from(256u32 << 20);
        assert!((r.peak_bytes_per_sec - mib_s).abs() < 1.0, "{r:?}");
        // Completions within one point's resolution merge, bytes kept.
        let mut m = BwMeter::new(t0);
        for us in 0..1000 {
            m.record(t0 + Duration::from_micros(200_000 + us), 1000);
        }
        let r = m.finish();
        assert_eq!(r.bytes, 1_000_000);
        assert!(r.peak_bytes_per_sec <= 1_000_000.0 / 0.1 + 1.0, "{r:?}");
    }

    #[test]
    fn latency_percentiles() {
        let rtts: Vec<Duration> = (1..=1000).map(Duration::from_micros).collect();
        let s = LatStats::from_rtts(&rtts).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-6;
        assert!(close(s.t_min_usec, 0.5), "{s:?}");
        assert!(close(s.t_max_usec, 500.0), "{s:?}");
        assert!(close(s.p99_usec, 495.0), "{s:?}");
        assert!(close(s.p999_usec, 499.5), "{s:?}");
        assert!(close(s.t_typical_usec, 250.5), "{s:?}");
    }
}
