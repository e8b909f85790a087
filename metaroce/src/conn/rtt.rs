//! Round-trip time estimation per path (RFC 6298 smoothing, plus the minimum).

use std::time::Duration;

/// RTT estimates of one path, from echoed timestamps (MetaRoCE ACK `echo_ts`).
#[derive(Debug, Clone)]
pub struct RttEstimator {
    latest: Option<Duration>,
    smoothed: Duration,
    var: Duration,
    min: Option<Duration>,
    has_sample: bool,
}

impl RttEstimator {
    /// Estimates seeded with `initial` (used until the first sample).
    pub fn new(initial: Duration) -> Self {
        Self {
            latest: None,
            smoothed: initial,
            var: initial / 2,
            min: None,
            has_sample: false,
        }
    }

    /// Add a sample.
    pub fn update(&mut self, sample: Duration) {
        self.latest = Some(sample);
        self.min = Some(self.min.map_or(sample, |m| m.min(sample)));
        if !self.has_sample {
            self.has_sample = true;
            self.smoothed = sample;
            self.var = sample / 2;
        } else {
            let diff = self.smoothed.abs_diff(sample);
            self.var = (self.var * 3 + diff) / 4;
            self.smoothed = (self.smoothed * 7 + sample) / 8;
        }
    }

    /// A sample that may only lower the minimum: SRTT, RTTVAR and the latest sample (and so
    /// the loss timers) are left to data samples. For the handshake's round trip, taken with
    /// small control packets before any data queued up.
    pub fn observe_min(&mut self, sample: Duration) {
        self.min = Some(self.min.map_or(sample, |m| m.min(sample)));
    }

    /// Smoothed RTT (SRTT).
    pub fn smoothed(&self) -> Duration {
        self.smoothed
    }

    /// RTT variation (RTTVAR).
    pub fn var(&self) -> Duration {
        self.var
    }

    /// Most recent sample.
    pub fn latest(&self) -> Option<Duration> {
        self.latest
    }

    /// Smallest sample seen.
    pub fn min(&self) -> Option<Duration> {
        self.min
    }

    /// Retransmission timeout before back-off: `SRTT + 4·RTTVAR` clamped to `[min, max]`.
    pub fn rto(&self, min: Duration, max: Duration) -> Duration {
        (self.smoothed + 4 * self.var).clamp(min, max)
    }
}
