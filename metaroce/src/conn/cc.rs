//! Congestion control: the seam between the delivery layer and the algorithm that sizes
//! each path's window, and the MetaRoCE default (ECN- and delay-driven AIMD).

use super::rtt::RttEstimator;
use crate::config::CongestionConfig;
use std::fmt;
use std::time::Instant;

/// A congestion controller for one path. The delivery layer reports acknowledgements
/// and congestion signals; the controller answers with the path's window in packets.
///
/// Implementations must be deterministic (no clock or randomness of their own).
pub trait CongestionController: Send + fmt::Debug {
    /// Current window in packets (at least 1).
    fn window(&self) -> u32;
    /// `acked` packets were newly acknowledged; `rtt` holds the path's estimates,
    /// including the sample taken from this ACK if any.
    fn on_ack(&mut self, now: Instant, acked: u32, rtt: &RttEstimator);
    /// An ACK reported `marked` newly CE-marked packets out of `acked` newly acknowledged.
    fn on_ecn(&mut self, now: Instant, marked: u32, acked: u32, rtt: &RttEstimator);
    /// `lost` packets were declared lost from SACK holes.
    fn on_loss(&mut self, now: Instant, lost: u32, rtt: &RttEstimator);
    /// The retransmission timer expired.
    fn on_timeout(&mut self, now: Instant);
}

/// The default controller: additive increase of `additive_increase` packets per round
/// trip; multiplicative decrease at most once per smoothed RTT on ECN echo (scaled by the
/// marked fraction, as DCTCP), on loss, and on queueing delay above `delay_target`.
#[derive(Debug, Clone)]
pub struct Aimd {
    cfg: CongestionConfig,
    window: f64,
    last_cut: Option<Instant>,
}

impl Aimd {
    /// A controller starting at `cfg.initial_window`.
    pub fn new(cfg: CongestionConfig) -> Self {
        let window = cfg.initial_window as f64;
        Self {
            cfg,
            window,
            last_cut: None,
        }
    }

    fn may_cut(&mut self, now: Instant, rtt: &RttEstimator) -> bool {
        match self.last_cut {
            Some(t) if now.saturating_duration_since(t) < rtt.smoothed() => false,
            _ => {
                self.last_cut = Some(now);
                true
            }
        }
    }

    fn cut(&mut self, factor: f64) {
        self.window = (self.window * factor).max(self.cfg.min_window as f64);
    }
}

impl CongestionController for Aimd {
    fn window(&self) -> u32 {
        (self.window as u32).clamp(self.cfg.min_window, self.cfg.max_window)
    }

    fn on_ack(&mut self, now: Instant, acked: u32, rtt: &RttEstimator) {
        if let (Some(target), Some(latest), Some(min)) =
            (self.cfg.delay_target, rtt.latest(), rtt.min())
        {
            if latest > min + target {
                if self.may_cut(now, rtt) {
                    self.cut(self.cfg.delay_beta);
                }
                return;
            }
        }
        self.window += self.cfg.additive_increase * acked as f64 / self.window;
        self.window = self.window.min(self.cfg.max_window as f64);
    }

    fn on_ecn(&mut self, now: Instant, marked: u32, acked: u32, rtt: &RttEstimator) {
        if marked == 0 || !self.may_cut(now, rtt) {
            return;
        }
        let frac = (marked as f64 / acked.max(marked).max(1) as f64).min(1.0);
        self.cut(1.0 - self.cfg.ecn_beta * frac.max(0.25));
    }

    fn on_loss(&mut self, now: Instant, lost: u32, rtt: &RttEstimator) {
        if lost > 0 && self.may_cut(now, rtt) {
            self.cut(self.cfg.loss_beta);
        }
    }

    fn on_timeout(&mut self, now: Instant) {
        self.last_cut = Some(now);
        self.window = self.cfg.min_window as f64;
    }
}
