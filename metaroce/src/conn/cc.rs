//! Congestion control: the seam between the delivery layer and the algorithm that sizes
//! each path's window, and the MetaRoCE default (ECN- and delay-driven AIMD).

use super::rtt::RttEstimator;
use crate::config::CongestionConfig;
use std::fmt;
use std::time::{Duration, Instant};

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

/// The connection-wide cap on packets in flight (sum over paths), MetaRoCE's "congestion
/// control from both sides":
///
/// * before the first ACK, at most `cfg.initial_connection_window` (the blind first round
///   trip);
/// * at most `cfg.max_connection_window`;
/// * when the peer grants a rate (`peer_rate_mbps > 0`, the receiver's fair share or its
///   advertised rate, from its latest ACK or, before any ACK, from its handshake packet, so
///   this caps the blind first round trip too), at most that rate times the connection's
///   **minimum** RTT, rounded
///   up to whole packets (at least 1). The minimum RTT is the fabric's base RTT as far as
///   this connection has seen it; sizing by the smoothed RTT instead would let the window
///   grow with the very queue the grant is meant to drain. Before any RTT sample,
///   `srtt` (the configured initial RTT) stands in;
/// * when the peer grants a window (`peer_window > 0` packets, its share of its receive
///   socket buffer from its latest ACK, `TransportConfig::socket_recv_buffer`), at most
///   that.
///
/// `pmtu` is the payload bytes per packet.
pub fn connection_window(
    cfg: &CongestionConfig,
    pmtu: u32,
    peer_rate_mbps: u32,
    peer_window: u32,
    acked: bool,
    min_rtt: Option<Duration>,
    srtt: Duration,
) -> u32 {
    let mut w = cfg.max_connection_window;
    if !acked {
        w = w.min(cfg.initial_connection_window);
    }
    if peer_rate_mbps > 0 {
        let rtt = min_rtt.unwrap_or(srtt);
        let bytes = f64::from(peer_rate_mbps) * 1e6 / 8.0 * rtt.as_secs_f64();
        w = w.min(((bytes / f64::from(pmtu.max(1))).ceil() as u32).max(1));
    }
    if peer_window > 0 {
        w = w.min(peer_window);
    }
    w.max(1)
}

/// A controller for the configured algorithm.
pub fn new_controller(cfg: &CongestionConfig, pmtu: u32) -> Box<dyn CongestionController> {
    match cfg.algorithm {
        crate::config::CongestionAlgorithm::Aimd => Box::new(Aimd::new(cfg.clone())),
        crate::config::CongestionAlgorithm::Swift {
            target,
            additive_increase,
            beta,
            max_decrease,
        } => Box::new(Swift::new(
            cfg,
            target,
            additive_increase,
            beta,
            max_decrease,
        )),
        crate::config::CongestionAlgorithm::Dcqcn {
            line_rate_mbps,
            rate_ai_mbps,
            rate_hai_mbps,
            g,
            cnp_interval,
            rate_timer,
        } => Box::new(Dcqcn::new(
            cfg,
            pmtu,
            line_rate_mbps,
            rate_ai_mbps,
            rate_hai_mbps,
            g,
            cnp_interval,
            rate_timer,
        )),
    }
}

/// Swift-like delay-targeting window control (Kumar et al., "Swift: Delay is Simple and
/// Effective for Congestion Control in the Datacenter", SIGCOMM 2020), per path: below the
/// target delay the window grows by `additive_increase` packets per RTT; above it, it
/// shrinks once per RTT by `beta × (delay − target) / delay`, at most `max_decrease`. Loss
/// cuts by `max_decrease`; a timeout resets to the minimum window.
#[derive(Debug, Clone)]
pub struct Swift {
    window: f64,
    min: f64,
    max: f64,
    target: Duration,
    ai: f64,
    beta: f64,
    max_decrease: f64,
    last_cut: Option<Instant>,
}

impl Swift {
    fn new(
        cfg: &CongestionConfig,
        target: Duration,
        ai: f64,
        beta: f64,
        max_decrease: f64,
    ) -> Self {
        Self {
            window: cfg.initial_window as f64,
            min: cfg.min_window as f64,
            max: cfg.max_window as f64,
            target,
            ai,
            beta,
            max_decrease: max_decrease.clamp(0.0, 1.0),
            last_cut: None,
        }
    }

    fn can_cut(&mut self, now: Instant, rtt: &RttEstimator) -> bool {
        match self.last_cut {
            Some(t) if now.saturating_duration_since(t) < rtt.smoothed() => false,
            _ => {
                self.last_cut = Some(now);
                true
            }
        }
    }
}

impl CongestionController for Swift {
    fn window(&self) -> u32 {
        (self.window as u32).clamp(self.min as u32, self.max as u32)
    }

    fn on_ack(&mut self, now: Instant, acked: u32, rtt: &RttEstimator) {
        let delay = rtt.latest().unwrap_or_else(|| rtt.smoothed());
        if delay <= self.target {
            self.window = (self.window + self.ai * acked as f64 / self.window).min(self.max);
        } else if self.can_cut(now, rtt) {
            let excess = (delay - self.target).as_secs_f64() / delay.as_secs_f64();
            let factor = 1.0 - (self.beta * excess).min(self.max_decrease);
            self.window = (self.window * factor).max(self.min);
        }
    }

    fn on_ecn(&mut self, _now: Instant, _marked: u32, _acked: u32, _rtt: &RttEstimator) {
        // Swift is purely delay-based.
    }

    fn on_loss(&mut self, now: Instant, lost: u32, rtt: &RttEstimator) {
        if lost > 0 && self.can_cut(now, rtt) {
            self.window = (self.window * (1.0 - self.max_decrease)).max(self.min);
        }
    }

    fn on_timeout(&mut self, now: Instant) {
        self.last_cut = Some(now);
        self.window = self.min;
    }
}

/// DCQCN's reaction point (Zhu et al., "Congestion Control for Large-Scale RDMA
/// Deployments", SIGCOMM 2015), per path. A CE echo plays the CNP: at most once per
/// `cnp_interval` the target rate takes the current rate and the current rate drops by
/// `alpha / 2`, with `alpha ← (1 − g)·alpha + g`. Every `rate_timer` without a CNP, alpha
/// decays (`alpha ← (1 − g)·alpha`) and the rate increases: five fast-recovery steps
/// (`Rc ← (Rt + Rc) / 2`), then additive (`Rt += R_AI`) and hyper (`Rt += R_HAI`) increase.
/// The sans-IO core paces with windows, so the rate becomes a window of `rate × SRTT`
/// packets. Timers are evaluated when ACKs arrive (no timer events of their own).
#[derive(Debug, Clone)]
pub struct Dcqcn {
    rc: f64,
    rt: f64,
    alpha: f64,
    line: f64,
    ai: f64,
    hai: f64,
    g: f64,
    cnp_interval: Duration,
    rate_timer: Duration,
    last_cnp: Option<Instant>,
    last_increase: Option<Instant>,
    stage: u32,
    srtt: Duration,
    pmtu: f64,
    min: u32,
    max: u32,
}

impl Dcqcn {
    #[allow(clippy::too_many_arguments)]
    fn new(
        cfg: &CongestionConfig,
        pmtu: u32,
        line: u32,
        ai: u32,
        hai: u32,
        g: f64,
        cnp_interval: Duration,
        rate_timer: Duration,
    ) -> Self {
        let line = line.max(1) as f64;
        Self {
            rc: line,
            rt: line,
            alpha: 1.0,
            line,
            ai: ai as f64,
            hai: hai as f64,
            g: g.clamp(0.0, 1.0),
            cnp_interval,
            rate_timer: rate_timer.max(Duration::from_micros(1)),
            last_cnp: None,
            last_increase: None,
            stage: 0,
            srtt: Duration::from_micros(100),
            pmtu: pmtu.max(1) as f64,
            min: cfg.min_window,
            max: cfg.max_window,
        }
    }

    /// Current rate in Mbit/s.
    pub fn rate_mbps(&self) -> f64 {
        self.rc
    }

    fn cut(&mut self, now: Instant) {
        if self
            .last_cnp
            .is_some_and(|t| now.saturating_duration_since(t) < self.cnp_interval)
        {
            return;
        }
        self.last_cnp = Some(now);
        self.last_increase = Some(now);
        self.rt = self.rc;
        self.rc = (self.rc * (1.0 - self.alpha / 2.0)).max(1.0);
        self.alpha = (1.0 - self.g) * self.alpha + self.g;
        self.stage = 0;
    }

    fn increase(&mut self, now: Instant) {
        let last = *self.last_increase.get_or_insert(now);
        let periods = (now.saturating_duration_since(last).as_nanos() / self.rate_timer.as_nanos())
            .min(1000) as u32;
        for _ in 0..periods {
            self.alpha *= 1.0 - self.g;
            self.stage += 1;
            if self.stage > 5 {
                self.rt += if self.stage > 10 { self.hai } else { self.ai };
                self.rt = self.rt.min(self.line);
            }
            self.rc = ((self.rt + self.rc) / 2.0).min(self.line);
        }
        if periods > 0 {
            self.last_increase = Some(last + self.rate_timer * periods);
        }
    }
}

impl CongestionController for Dcqcn {
    fn window(&self) -> u32 {
        let bytes = self.rc * 1e6 / 8.0 * self.srtt.as_secs_f64();
        ((bytes / self.pmtu).ceil() as u32).clamp(self.min, self.max)
    }

    fn on_ack(&mut self, now: Instant, _acked: u32, rtt: &RttEstimator) {
        self.srtt = rtt.smoothed();
        self.increase(now);
    }

    fn on_ecn(&mut self, now: Instant, marked: u32, _acked: u32, rtt: &RttEstimator) {
        self.srtt = rtt.smoothed();
        if marked > 0 {
            self.cut(now);
        }
    }

    fn on_loss(&mut self, now: Instant, lost: u32, _rtt: &RttEstimator) {
        // DCQCN assumes a lossless fabric; treat loss like a CNP so it still backs off.
        if lost > 0 {
            self.cut(now);
        }
    }

    fn on_timeout(&mut self, now: Instant) {
        self.cut(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CongestionAlgorithm;

    fn rtt(sample_us: u64) -> RttEstimator {
        let mut r = RttEstimator::new(Duration::from_micros(sample_us));
        r.update(Duration::from_micros(sample_us));
        r
    }

    #[test]
    fn connection_window_caps() {
        let cfg = CongestionConfig::default();
        let us = Duration::from_micros;
        // Blind first round trip.
        assert_eq!(
            connection_window(&cfg, 4096, 0, 0, false, None, us(500)),
            cfg.initial_connection_window
        );
        assert_eq!(
            connection_window(&cfg, 4096, 0, 0, true, Some(us(10)), us(10)),
            cfg.max_connection_window
        );
        // 100 Gbit/s × 10 µs = 125 000 B = 31 packets of 4096 B (rounded up).
        assert_eq!(
            connection_window(&cfg, 4096, 100_000, 0, true, Some(us(10)), us(400)),
            31
        );
        // A grant below one packet per RTT still lets one packet fly.
        assert_eq!(
            connection_window(&cfg, 4096, 100, 0, true, Some(us(10)), us(400)),
            1
        );
        // Before the first ACK a grant from the handshake caps the blind window too, sized by
        // the handshake RTT: 100 Gbit/s × 8.5 µs = 106 250 B = 26 packets (under the 32 of
        // `initial_connection_window`); a 1/64 share is 1 packet.
        assert_eq!(
            connection_window(
                &cfg,
                4096,
                100_000,
                0,
                false,
                Some(Duration::from_nanos(8_500)),
                us(500)
            ),
            26
        );
        assert_eq!(
            connection_window(
                &cfg,
                4096,
                100_000 / 64,
                0,
                false,
                Some(Duration::from_nanos(8_500)),
                us(500)
            ),
            1
        );
        // Without an RTT sample the smoothed (initial) RTT stands in.
        assert_eq!(
            connection_window(&cfg, 4096, 1_000, 0, true, None, us(500)),
            16
        );
        // The peer's window grant caps the window, alone or beside a rate grant (the
        // smaller wins); 0 is no grant.
        assert_eq!(
            connection_window(&cfg, 4096, 0, 128, true, Some(us(10)), us(10)),
            128
        );
        assert_eq!(
            connection_window(&cfg, 4096, 100_000, 8, true, Some(us(10)), us(400)),
            8
        );
        assert_eq!(
            connection_window(&cfg, 4096, 100_000, 2040, true, Some(us(10)), us(400)),
            31
        );
        assert_eq!(
            connection_window(&cfg, 4096, 0, 4096, true, Some(us(10)), us(10)),
            cfg.max_connection_window
        );
        // Before the first ACK the blind window still applies under a larger grant.
        assert_eq!(
            connection_window(&cfg, 4096, 0, 128, false, None, us(500)),
            cfg.initial_connection_window
        );
    }

    #[test]
    fn aimd_grows_and_cuts_on_ecn_once_per_rtt() {
        let cfg = CongestionConfig::default();
        let mut c = Aimd::new(cfg.clone());
        let t0 = Instant::now();
        let r = rtt(100);
        c.on_ack(t0, 320, &r);
        assert!(c.window() > cfg.initial_window);
        let w = c.window();
        c.on_ecn(t0, 10, 10, &r);
        let w1 = c.window();
        assert!(w1 < w);
        c.on_ecn(t0 + Duration::from_micros(10), 10, 10, &r);
        assert_eq!(c.window(), w1, "at most one cut per RTT");
    }

    #[test]
    fn swift_holds_the_delay_target() {
        let cfg = CongestionConfig {
            algorithm: CongestionAlgorithm::swift_default(),
            ..Default::default()
        };
        let mut c = new_controller(&cfg, 4096);
        let t0 = Instant::now();
        let w0 = c.window();
        c.on_ack(t0, 64, &rtt(20));
        assert!(c.window() > w0, "below target: grow");
        let w1 = c.window();
        c.on_ack(t0 + Duration::from_millis(1), 1, &rtt(500));
        assert!(c.window() < w1, "far above target: shrink");
        assert!(
            c.window() as f64 >= w1 as f64 * 0.5 - 1.0,
            "at most max_decrease per RTT"
        );
    }

    #[test]
    fn dcqcn_cuts_on_cnp_and_recovers() {
        let cfg = CongestionConfig::default();
        let mut c = Dcqcn::new(
            &cfg,
            4096,
            10_000,
            40,
            100,
            1.0 / 16.0,
            Duration::from_micros(50),
            Duration::from_micros(55),
        );
        let t0 = Instant::now();
        let r = rtt(100);
        c.on_ack(t0, 1, &r);
        let full = c.rate_mbps();
        c.on_ecn(t0, 1, 1, &r);
        let cut = c.rate_mbps();
        assert!(
            (cut - full / 2.0).abs() < 1.0,
            "first CNP halves the rate (alpha = 1)"
        );
        c.on_ecn(t0 + Duration::from_micros(10), 1, 1, &r);
        assert_eq!(
            c.rate_mbps(),
            cut,
            "second CNP within the CNP interval is ignored"
        );
        c.on_ack(t0 + Duration::from_millis(5), 1, &r);
        assert!(
            c.rate_mbps() > cut * 1.8,
            "recovers towards the target rate"
        );
        assert!(c.window() >= cfg.min_window);
    }
}
