//! Bandwidth and latency arithmetic.

use serde::Serialize;
use std::time::{Duration, Instant};

/// Width of the peak-bandwidth window.
pub const PEAK_WINDOW: Duration = Duration::from_millis(100);

/// Bytes completed per millisecond since the first post, to find the best window.
#[derive(Debug)]
pub struct BwMeter {
    start: Instant,
    bins: Vec<u64>,
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
    /// Best 100 ms window, bytes per second (the average for shorter runs).
    pub peak_bytes_per_sec: f64,
    /// Operations per second, in millions.
    pub msg_rate_mpps: f64,
}

impl BwMeter {
    /// A meter whose clock starts at `start` (the first post).
    pub fn new(start: Instant) -> Self {
        Self {
            start,
            bins: Vec::new(),
            bytes: 0,
            ops: 0,
            last: start,
        }
    }

    /// One operation of `bytes` completed at `now`.
    pub fn record(&mut self, now: Instant, bytes: u64) {
        let ms = now.saturating_duration_since(self.start).as_millis() as usize;
        if self.bins.len() <= ms {
            self.bins.resize(ms + 1, 0);
        }
        self.bins[ms] += bytes;
        self.bytes += bytes;
        self.ops += 1;
        self.last = self.last.max(now);
    }

    /// The result.
    pub fn finish(&self) -> BwResult {
        let elapsed = self.last.saturating_duration_since(self.start);
        let secs = elapsed.as_secs_f64().max(1e-9);
        let avg = self.bytes as f64 / secs;
        let w = PEAK_WINDOW.as_millis() as usize;
        let peak = if elapsed < PEAK_WINDOW || self.bins.len() < w {
            avg
        } else {
            let mut sum: u64 = self.bins[..w].iter().sum();
            let mut best = sum;
            for i in w..self.bins.len() {
                sum = sum + self.bins[i] - self.bins[i - w];
                best = best.max(sum);
            }
            best as f64 / PEAK_WINDOW.as_secs_f64()
        };
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
