//! Links: configuration, impairments, statistics, and the FIFO serialization model.

use super::{NodeId, PS_PER_SEC};
use rand_core::RngCore;
use rand_xoshiro::Xoshiro256PlusPlus;
use std::time::Duration;

/// One gigabit per second, in bit/s: `LinkConfig::new(100 * GBPS, …)` is a 100 Gbit/s link.
pub const GBPS: u64 = 1_000_000_000;

/// Configuration of one direction of a link.
///
/// A link is a FIFO queue feeding a serializer: a packet of `len` UDP payload bytes
/// occupies the link for `8 · (len + SimConfig::wire_overhead_bytes) / rate_bps` seconds
/// after the packets ahead of it, then propagates for `delay`. Queue sizes are counted in
/// wire bytes (payload plus overhead) not yet serialized, including the rest of the packet
/// being serialized.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkConfig {
    /// Line rate in bit/s; 0 means infinitely fast (no serialization time, never a queue).
    pub rate_bps: u64,
    /// Propagation delay (one way).
    pub delay: Duration,
    /// Tail-drop limit of the queue in bytes: a packet that would make the queue exceed it
    /// is dropped ([`DropReason::QueueFull`](super::DropReason::QueueFull)). Applies at
    /// switch egress ports only: a host's own uplink (its NIC transmit queue) never drops;
    /// the host stops taking packets from its endpoint while that queue holds
    /// [`SimConfig::nic_queue_bytes`](super::SimConfig::nic_queue_bytes) instead. Default
    /// 1 MiB.
    pub queue_limit_bytes: u64,
    /// ECN marking threshold in bytes: an ECN-capable (ECT) packet that joins a queue
    /// already holding more than this many bytes is marked CE. `None` (the default)
    /// disables marking. Switch egress ports only, like the queue limit.
    pub ecn_threshold_bytes: Option<u64>,
    /// Loss, duplication, reordering, corruption and blackholing.
    pub impairments: Impairments,
}

impl LinkConfig {
    /// A link of `rate_bps` bit/s and one-way propagation `delay`, with a 1 MiB tail-drop
    /// queue, no ECN marking and no impairments.
    pub fn new(rate_bps: u64, delay: Duration) -> Self {
        Self {
            rate_bps,
            delay,
            queue_limit_bytes: 1 << 20,
            ecn_threshold_bytes: None,
            impairments: Impairments::default(),
        }
    }

    /// The same link with a tail-drop limit of `bytes`.
    pub fn with_queue_limit(mut self, bytes: u64) -> Self {
        self.queue_limit_bytes = bytes;
        self
    }

    /// The same link marking CE on ECT packets above `bytes` of queue.
    pub fn with_ecn_threshold(mut self, bytes: u64) -> Self {
        self.ecn_threshold_bytes = Some(bytes);
        self
    }

    /// The same link with these impairments.
    pub fn with_impairments(mut self, impairments: Impairments) -> Self {
        self.impairments = impairments;
        self
    }
}

/// Impairments of one link direction. Every probability is per packet, in `0.0..=1.0`;
/// 0 disables the impairment and draws no random number, so enabling one impairment on one
/// link does not change the random decisions anywhere else (each link has its own RNG,
/// seeded from the simulation seed and the link's index).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Impairments {
    /// Probability that a packet is lost on the wire (after occupying the link).
    pub loss: f64,
    /// Bursty loss on the wire (Gilbert–Elliott), on top of `loss`.
    pub burst: Option<GilbertElliott>,
    /// Probability that a packet is duplicated on entering the queue; the copy is queued
    /// (and serialized) right behind the original.
    pub duplicate: f64,
    /// Probability that a packet is held back for an extra `reorder_delay` of propagation,
    /// so that packets behind it overtake it.
    pub reorder: f64,
    /// Extra propagation delay of a reordered packet.
    pub reorder_delay: Duration,
    /// Probability that one byte of a packet is flipped (XOR with a random non-zero mask)
    /// on the wire. The receiver's ICRC check catches it.
    pub corrupt: f64,
    /// Drop every packet entering the link, silently: the link still looks up to routing
    /// (a gray failure). See also [`Action::LinkDown`](super::Action::LinkDown).
    pub blackhole: bool,
}

/// Gilbert–Elliott two-state burst loss: in each state a packet is lost with that state's
/// probability, then the state changes with the transition probability. The mean burst
/// (bad state) length is `1 / p_bad_to_good` packets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GilbertElliott {
    /// Probability per packet of moving from the good to the bad state.
    pub p_good_to_bad: f64,
    /// Probability per packet of moving from the bad to the good state.
    pub p_bad_to_good: f64,
    /// Loss probability in the good state (usually 0).
    pub loss_good: f64,
    /// Loss probability in the bad state (usually close to 1).
    pub loss_bad: f64,
}

/// Packets dropped on a link, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DropStats {
    /// Tail drops: the queue limit would have been exceeded.
    pub queue_full: u64,
    /// Random loss on the wire ([`Impairments::loss`]).
    pub random_loss: u64,
    /// Gilbert–Elliott loss on the wire ([`Impairments::burst`]).
    pub burst_loss: u64,
    /// Dropped by a blackhole ([`Impairments::blackhole`]).
    pub blackhole: u64,
    /// Sent to a link that was down, or in flight or queued on it when it went down.
    pub link_down: u64,
}

impl DropStats {
    /// All drops.
    pub fn total(&self) -> u64 {
        self.queue_full + self.random_loss + self.burst_loss + self.blackhole + self.link_down
    }
}

/// Counters of one link direction.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LinkStats {
    /// Packets accepted into the queue (each is serialized onto the link).
    pub packets: u64,
    /// UDP payload bytes of those packets.
    pub bytes: u64,
    /// Wire bytes of those packets (payload plus the per-packet overhead).
    pub wire_bytes: u64,
    /// Packets that reached the far end (not lost, not caught by the link going down).
    pub delivered: u64,
    /// Drops by reason.
    pub drops: DropStats,
    /// Packets marked CE by this link's queue.
    pub ce_marks: u64,
    /// Packets duplicated.
    pub duplicated: u64,
    /// Packets given the extra reordering delay.
    pub reordered: u64,
    /// Packets with a byte flipped.
    pub corrupted: u64,
    /// Largest queue seen, in wire bytes (just after an enqueue).
    pub max_queue_bytes: u64,
    /// Queue depth in wire bytes averaged over time, from the start of the simulation to
    /// the time of the query.
    pub avg_queue_bytes: f64,
}

/// Whether a draw with probability `p` succeeds; draws nothing when `p <= 0`.
#[inline]
pub(crate) fn chance(rng: &mut Xoshiro256PlusPlus, p: f64) -> bool {
    if p <= 0.0 {
        return false;
    }
    // 53 random bits as a float in [0, 1).
    ((rng.next_u64() >> 11) as f64) * (1.0 / (1u64 << 53) as f64) < p
}

/// Internal state of one link direction.
#[derive(Debug)]
pub(crate) struct Link {
    pub from: NodeId,
    pub to: NodeId,
    pub reverse: u32,
    pub cfg: LinkConfig,
    pub up: bool,
    /// Incremented when the link goes down, so packets queued or in flight before that
    /// are recognised on arrival and dropped.
    pub generation: u32,
    /// The link leaves a host: no tail drop, no ECN marking.
    pub nic: bool,
    /// When the serializer finishes everything accepted so far, in ps.
    pub busy_until: u64,
    pub rng: Xoshiro256PlusPlus,
    pub ge_bad: bool,
    pub stats: LinkStats,
    /// ∫ queue bytes dt, in byte·ps, up to `area_until`.
    area: f64,
    area_until: u64,
}

impl Link {
    pub fn new(
        from: NodeId,
        to: NodeId,
        reverse: u32,
        cfg: LinkConfig,
        rng: Xoshiro256PlusPlus,
    ) -> Self {
        Self {
            from,
            to,
            reverse,
            cfg,
            up: true,
            generation: 0,
            nic: matches!(from, NodeId::Host(_)),
            busy_until: 0,
            rng,
            ge_bad: false,
            stats: LinkStats::default(),
            area: 0.0,
            area_until: 0,
        }
    }

    /// Serialization time of `bytes` wire bytes, in ps (rounded up).
    #[inline]
    pub fn serialization_ps(&self, bytes: u64) -> u64 {
        if self.cfg.rate_bps == 0 {
            return 0;
        }
        let bits = bytes as u128 * 8 * PS_PER_SEC as u128;
        u64::try_from(bits.div_ceil(self.cfg.rate_bps as u128)).unwrap_or(u64::MAX)
    }

    /// Wire bytes not yet serialized at time `now` (ps).
    #[inline]
    pub fn backlog_bytes(&self, now: u64) -> u64 {
        if self.busy_until <= now || self.cfg.rate_bps == 0 {
            return 0;
        }
        let ps = (self.busy_until - now) as u128;
        (ps * self.cfg.rate_bps as u128 / (8 * PS_PER_SEC as u128)) as u64
    }

    /// ∫ backlog dt over `[from, to]` with no enqueue in between, in byte·ps.
    fn area_between(&self, from: u64, to: u64) -> f64 {
        if self.busy_until <= from || to <= from || self.cfg.rate_bps == 0 {
            return 0.0;
        }
        let end = to.min(self.busy_until);
        let a = (self.busy_until - from) as f64;
        let b = (self.busy_until - end) as f64;
        let bytes_per_ps = self.cfg.rate_bps as f64 / (8.0 * PS_PER_SEC as f64);
        (a * a - b * b) / 2.0 * bytes_per_ps
    }

    /// Bring the queue-depth integral up to `now`; call before changing `busy_until`.
    #[inline]
    pub fn integrate(&mut self, now: u64) {
        if now > self.area_until {
            self.area += self.area_between(self.area_until, now);
            self.area_until = now;
        }
    }

    /// Empty the queue at `now` (the link went down).
    pub fn flush(&mut self, now: u64) {
        self.integrate(now);
        self.busy_until = self.busy_until.min(now);
        self.generation = self.generation.wrapping_add(1);
    }

    /// The counters, with the average queue depth over `[0, now]`.
    pub fn stats_at(&self, now: u64) -> LinkStats {
        let mut s = self.stats;
        let area = self.area + self.area_between(self.area_until, now);
        s.avg_queue_bytes = if now == 0 { 0.0 } else { area / now as f64 };
        s
    }
}
