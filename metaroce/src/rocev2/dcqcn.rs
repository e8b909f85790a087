//! DCQCN congestion control for RC QPs (Zhu et al., "Congestion Control for Large-Scale RDMA
//! Deployments", SIGCOMM 2015; CNP format: RoCEv2 Annex A17.9).
//!
//! * **Notification point** (receiver of CE-marked packets): a QP that receives a packet
//!   whose IP ECN field is CE sends a CNP (opcode `0x81`, BTH.DestQP = the sender's QP, 16
//!   reserved zero bytes) to its peer, at most one per [`DcqcnConfig::cnp_interval`].
//! * **Reaction point** (sender): on a CNP, `Rt = Rc`, `Rc = Rc·(1 − α/2)`,
//!   `α = (1 − g)·α + g`; without CNPs, `α = (1 − g)·α` every `alpha_timer`. The rate recovers
//!   in stages counted by a timer (`increase_timer`) and a byte counter (`byte_counter`):
//!   while both stage counts are below F: fast recovery `Rc = (Rt + Rc)/2`; once one passes
//!   F: additive increase `Rt += R_AI`; once both pass F: hyper increase
//!   `Rt += i·R_HAI`; then `Rc = (Rt + Rc)/2`. At the line rate the limiter switches off.
//!
//! All state is per QP; time comes in as `Instant` arguments (sans-IO).

use std::time::{Duration, Instant};

/// DCQCN parameters of an [`RcConfig`](super::RcConfig) (every QP of the endpoint).
///
/// Defaults: the notification interval N = 50 µs and g = 1/256 are the DCQCN paper's values
/// (§4, §5); the recovery timer, byte counter and increase steps are of the order the paper
/// uses, scaled to `line_rate_bps`. Tune them for a real fabric.
#[derive(Debug, Clone, PartialEq)]
pub struct DcqcnConfig {
    /// Run the notification point (send CNPs for CE-marked packets) and the reaction point
    /// (rate limiter driven by received CNPs). Default `true`. With `false`, received CE
    /// marks and CNPs are only counted.
    pub enabled: bool,
    /// Mark every transmitted packet ECN-capable, ECT(0), in the IP header (the ECN bits of
    /// [`ConnectAttrs::traffic_class`](super::ConnectAttrs::traffic_class) are never used).
    /// Default `true`. With `false` packets are Not-ECT and a switch drops instead of marking.
    pub ect: bool,
    /// Most one CNP per QP per this interval (notification point). Default 50 µs (the
    /// DCQCN paper's N).
    pub cnp_interval: Duration,
    /// Rate of an unthrottled QP, bits per second: the reaction point's starting and
    /// maximum rate. Default 100 Gbit/s.
    pub line_rate_bps: u64,
    /// Lowest rate a CNP can cut to, bits per second. Default 10 Mbit/s.
    pub min_rate_bps: u64,
    /// EWMA gain g of α, as 1/`alpha_g_inv`. Default 256 (g = 1/256).
    pub alpha_g_inv: u32,
    /// α decays by (1 − g) every this long without a CNP. Default 55 µs.
    pub alpha_timer: Duration,
    /// Rate-increase timer stage length. Default 55 µs.
    pub increase_timer: Duration,
    /// Rate-increase byte-counter stage length, bytes. Default 1 MiB.
    pub byte_counter: u64,
    /// F: stages of fast recovery before additive increase. Default 5.
    pub fast_recovery_stages: u32,
    /// R_AI, bits per second. Default 40 Mbit/s × (line rate / 10 Gbit/s).
    pub additive_increase_bps: u64,
    /// R_HAI, bits per second. Default 10 × R_AI.
    pub hyper_increase_bps: u64,
}

impl Default for DcqcnConfig {
    fn default() -> Self {
        let line = 100_000_000_000u64;
        let rai = 40_000_000 * (line / 10_000_000_000).max(1);
        Self {
            enabled: true,
            ect: true,
            cnp_interval: Duration::from_micros(50),
            line_rate_bps: line,
            min_rate_bps: 10_000_000,
            alpha_g_inv: 256,
            alpha_timer: Duration::from_micros(55),
            increase_timer: Duration::from_micros(55),
            byte_counter: 1 << 20,
            fast_recovery_stages: 5,
            additive_increase_bps: rai,
            hyper_increase_bps: 10 * rai,
        }
    }
}

impl DcqcnConfig {
    /// Checks the limits: `0 < min_rate_bps <= line_rate_bps`, `alpha_timer` and
    /// `increase_timer` at least 1 µs, `byte_counter` and `alpha_g_inv` at least 1.
    pub fn validate(&self) -> Result<(), super::RcError> {
        use super::RcError::Invalid;
        if self.min_rate_bps == 0 || self.min_rate_bps > self.line_rate_bps {
            return Err(Invalid("dcqcn rates (0 < min_rate_bps <= line_rate_bps)"));
        }
        let us = Duration::from_micros(1);
        if self.alpha_timer < us || self.increase_timer < us {
            return Err(Invalid("dcqcn timers (>= 1 us)"));
        }
        if self.byte_counter == 0 || self.alpha_g_inv == 0 {
            return Err(Invalid("dcqcn byte_counter / alpha_g_inv (>= 1)"));
        }
        Ok(())
    }
}

/// Reaction-point state of one QP: current rate `rc`, target rate `rt`, α, the stage
/// counters and the rate limiter's next permitted transmission time.
#[derive(Debug, Clone)]
pub(crate) struct ReactionPoint {
    /// Current rate, bits per second; `None` = unthrottled (line rate, limiter off).
    rc: Option<f64>,
    rt: f64,
    alpha: f64,
    /// When α next decays.
    alpha_at: Option<Instant>,
    /// When the next timer stage ends.
    timer_at: Option<Instant>,
    timer_stages: u32,
    bytes: u64,
    byte_stages: u32,
    /// The limiter lets the next packet go at this time.
    next_tx: Option<Instant>,
}

impl ReactionPoint {
    pub fn new() -> Self {
        Self {
            rc: None,
            rt: 0.0,
            alpha: 1.0,
            alpha_at: None,
            timer_at: None,
            timer_stages: 0,
            bytes: 0,
            byte_stages: 0,
            next_tx: None,
        }
    }

    /// Current rate in bits per second (the line rate when unthrottled).
    pub fn rate_bps(&self, cfg: &DcqcnConfig) -> u64 {
        self.rc.map_or(cfg.line_rate_bps, |r| r as u64)
    }

    /// Whether the limiter is active (a CNP cut the rate and it has not recovered).
    pub fn throttled(&self) -> bool {
        self.rc.is_some()
    }

    /// A CNP arrived: cut the rate (paper Eq. 1) and restart the recovery stages.
    pub fn on_cnp(&mut self, now: Instant, cfg: &DcqcnConfig) {
        if !cfg.enabled {
            return;
        }
        let line = cfg.line_rate_bps as f64;
        let g = 1.0 / f64::from(cfg.alpha_g_inv.max(1));
        let rc = self.rc.unwrap_or(line);
        self.rt = rc;
        let cut = rc * (1.0 - self.alpha / 2.0);
        self.rc = Some(cut.max(cfg.min_rate_bps as f64).min(line));
        self.alpha = (1.0 - g) * self.alpha + g;
        self.alpha_at = Some(now + cfg.alpha_timer);
        self.timer_at = Some(now + cfg.increase_timer);
        self.timer_stages = 0;
        self.bytes = 0;
        self.byte_stages = 0;
    }

    /// One rate-increase event (a timer or byte-counter stage ended).
    fn increase(&mut self, cfg: &DcqcnConfig) {
        let Some(rc) = self.rc else {
            return;
        };
        let f = cfg.fast_recovery_stages;
        let (t, b) = (self.timer_stages, self.byte_stages);
        let line = cfg.line_rate_bps as f64;
        if t.max(b) < f {
            // fast recovery: towards the target
        } else if t.min(b) > f {
            let i = f64::from(t.min(b) - f);
            self.rt += i * cfg.hyper_increase_bps as f64;
        } else {
            self.rt += cfg.additive_increase_bps as f64;
        }
        self.rt = self.rt.min(line);
        let new = (self.rt + rc) / 2.0;
        if new >= line * 0.999 {
            // Recovered: the limiter switches off (state as at the start).
            *self = Self {
                alpha: self.alpha,
                alpha_at: self.alpha_at,
                ..Self::new()
            };
        } else {
            self.rc = Some(new);
        }
    }

    /// A packet of `bytes` left: advance the limiter and the byte counter.
    pub fn on_transmit(&mut self, now: Instant, bytes: usize, cfg: &DcqcnConfig) {
        let Some(rc) = self.rc else {
            return;
        };
        let secs = (bytes as f64 * 8.0) / rc.max(1.0);
        let start = self.next_tx.map_or(now, |t| t.max(now));
        self.next_tx = Some(start + Duration::from_secs_f64(secs));
        self.bytes += bytes as u64;
        if self.bytes >= cfg.byte_counter.max(1) {
            self.bytes = 0;
            self.byte_stages += 1;
            self.increase(cfg);
        }
    }

    /// Whether the limiter lets a packet go now.
    pub fn may_send(&self, now: Instant) -> bool {
        self.rc.is_none() || self.next_tx.is_none_or(|t| t <= now)
    }

    /// When the limiter next lets a packet go, if it is holding one back now.
    pub fn send_at(&self, now: Instant) -> Option<Instant> {
        self.next_tx.filter(|t| self.rc.is_some() && *t > now)
    }

    /// Earliest timer (α decay, rate-increase stage).
    pub fn next_timer(&self) -> Option<Instant> {
        match (self.alpha_at, self.timer_at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Run the timers due at `now`.
    pub fn handle_timeout(&mut self, now: Instant, cfg: &DcqcnConfig) {
        let g = 1.0 / f64::from(cfg.alpha_g_inv.max(1));
        let min = Duration::from_micros(1);
        if let Some(t) = self.alpha_at.filter(|t| *t <= now) {
            // Every whole period that passed decays α once (a late call catches up).
            let period = cfg.alpha_timer.max(min);
            let k = (now - t).as_nanos() / period.as_nanos() + 1;
            self.alpha *= (1.0 - g).powi(k.min(1 << 20) as i32);
            // α decays only while throttled; once recovered its timer stops.
            let k = u32::try_from(k).unwrap_or(u32::MAX);
            self.alpha_at = self.rc.is_some().then(|| t + period.saturating_mul(k));
        }
        let period = cfg.increase_timer.max(min);
        // At most this many stages per call (recovery takes far fewer); after a long gap
        // the rest are skipped rather than looped over.
        let mut budget = 4096u32;
        while let Some(t) = self.timer_at.filter(|t| *t <= now) {
            self.timer_stages += 1;
            self.increase(cfg);
            budget -= 1;
            let next = if budget == 0 {
                now + period
            } else {
                t + period
            };
            self.timer_at = self.rc.is_some().then_some(next);
        }
        if self.rc.is_none() {
            self.timer_at = None;
            self.alpha_at = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> DcqcnConfig {
        DcqcnConfig {
            line_rate_bps: 10_000_000_000,
            additive_increase_bps: 40_000_000,
            hyper_increase_bps: 400_000_000,
            ..DcqcnConfig::default()
        }
    }

    /// DCQCN paper §3 (RP): a CNP cuts Rc by α/2 (α starts at 1: halves), α rises towards 1.
    #[test]
    fn cnp_cuts_rate_and_raises_alpha() {
        let c = cfg();
        let t0 = Instant::now();
        let mut rp = ReactionPoint::new();
        assert_eq!(rp.rate_bps(&c), 10_000_000_000);
        rp.on_cnp(t0, &c);
        assert_eq!(rp.rate_bps(&c), 5_000_000_000);
        let a1 = rp.alpha;
        rp.on_cnp(t0, &c);
        assert!(rp.rate_bps(&c) < 5_000_000_000 && rp.rate_bps(&c) >= 2_500_000_000);
        assert!(rp.alpha <= 1.0 && rp.alpha >= a1 * (255.0 / 256.0));
        // Never below the floor.
        for _ in 0..1000 {
            rp.on_cnp(t0, &c);
        }
        assert_eq!(rp.rate_bps(&c), c.min_rate_bps);
    }

    /// DCQCN paper §3 (RP): without CNPs the rate recovers through fast recovery, additive
    /// and hyper increase back to the line rate, and the limiter switches off.
    #[test]
    fn rate_recovers_by_timer_and_byte_counter() {
        let c = cfg();
        let t0 = Instant::now();
        let mut rp = ReactionPoint::new();
        rp.on_cnp(t0, &c);
        let cut = rp.rate_bps(&c);
        // Five timer stages of fast recovery: Rc → Rt = 10 G halves the gap each time.
        rp.handle_timeout(t0 + c.increase_timer, &c);
        let r1 = rp.rate_bps(&c);
        assert!(r1 > cut, "{r1} > {cut}");
        // Byte counter stages too.
        rp.on_transmit(t0, c.byte_counter as usize, &c);
        assert!(rp.rate_bps(&c) > r1);
        let mut t = t0;
        for _ in 0..200 {
            t += c.increase_timer;
            rp.handle_timeout(t, &c);
            if !rp.throttled() {
                break;
            }
        }
        assert!(!rp.throttled(), "recovered to the line rate");
        assert_eq!(rp.next_timer(), None);
        assert!(rp.may_send(t));
    }

    /// The limiter spaces packets at the current rate.
    #[test]
    fn limiter_paces_at_the_current_rate() {
        let c = cfg();
        let t0 = Instant::now();
        let mut rp = ReactionPoint::new();
        rp.on_cnp(t0, &c); // 5 Gbit/s
        assert!(rp.may_send(t0));
        rp.on_transmit(t0, 1250, &c); // 10 000 bits = 2 µs at 5 Gbit/s
        assert!(!rp.may_send(t0));
        assert_eq!(rp.send_at(t0), Some(t0 + Duration::from_micros(2)));
        assert!(rp.may_send(t0 + Duration::from_micros(2)));
    }
}
