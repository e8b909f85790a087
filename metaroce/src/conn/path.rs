//! Delivery layer state of one path: the sender's sequence space, window and loss
//! detection, and the receiver's 256-packet SACK window.
//!
//! Every transmission takes a fresh PSN of its path, retransmissions included; a lost
//! packet's data is re-sent under a new PSN, possibly on another path. A hole below the
//! highest acknowledged PSN is declared lost only after a reorder window learned from the
//! path (time-based loss detection after RACK-TLP, RFC 8985), since real paths reorder a
//! little (RSS queues, multi-queue NICs, host scheduling).
//! Data packets carry the sender's floor PSN so that the receiver can slide its window
//! past PSNs the sender no longer waits for.

use super::cc::CongestionController;
use super::rtt::RttEstimator;
use crate::wire::{psn_add, psn_diff};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Width of the SACK bitmap in packets (MetaRoCE ACK).
pub(crate) const SACK_BITS: u32 = 256;

/// Which segment of which operation a packet carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SegRef {
    pub op: u64,
    pub seg: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PktState {
    Outstanding,
    Settled,
}

#[derive(Debug, Clone)]
pub(crate) struct SentPacket {
    pub psn: u32,
    pub seg: SegRef,
    pub state: PktState,
    /// When it was sent (RACK `xmit_ts`); an ACK's echoed timestamp must also fall within
    /// the send times of the packets it newly acknowledges for its RTT sample to count.
    pub sent: Instant,
}

/// A packet declared lost from a SACK hole, remembered for a while to find out whether the
/// declaration was spurious (the packet was delivered after all), RFC 8985 §6.2 / DSACK.
#[derive(Debug, Clone, Copy)]
struct LostRec {
    psn: u32,
    /// The first PSN sent with a floor above `psn`: an ACK whose highest acknowledged PSN
    /// is below it was built before the receiver could slide over `psn` by the floor, so
    /// if it covers `psn`, the packet itself arrived.
    floor_past: Option<u32>,
}

/// Lost-packet records kept per path for spurious-loss detection.
const LOST_LOG: usize = 64;
/// RACK `reo_wnd_mult` bound, and the loss recoveries after which it is reset (RFC 8985
/// §6.2 step 4: `reo_wnd_persist` = 16).
const REO_WND_MULT_MAX: u32 = 16;
const REO_WND_PERSIST: u32 = 16;
/// A loss timer handled this much after its deadline was late because of the host (see
/// `PathTx::defer_if_late`).
const LATE_TIMER: Duration = Duration::from_millis(1);
/// Bound of the allowance spurious probes add to a path's probe timeout and RTO.
const PTO_EXTRA_MAX: Duration = Duration::from_millis(50);
/// The least probe timeout (and late-timer grace): below it, a probe would fire on the
/// scheduling jitter of a loopback.
pub(crate) const PTO_FLOOR: Duration = Duration::from_micros(200);

/// Per-path counters, readable by the application.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PathStats {
    /// Data packets sent (first transmissions and retransmissions).
    pub packets_sent: u64,
    /// Data packets sent that carried data sent before (loss, or a probe with no new data
    /// queued).
    pub retransmits: u64,
    /// Packets acknowledged.
    pub packets_acked: u64,
    /// Packets declared lost from SACK holes.
    pub sack_losses: u64,
    /// Packets declared lost by a retransmission timeout.
    pub timeout_losses: u64,
    /// Tail-loss probes scheduled: loss timers that fired with packets outstanding (and
    /// held RTOs). Each sends one packet beyond the window when it can (not when the SACK
    /// span is full or its segment was settled meanwhile): new data when the send queue has
    /// some and the path has not timed out (then not a retransmission), else the newest
    /// outstanding segment again.
    pub probes: u64,
    /// SACK-hole losses found spurious afterwards (the packet had been delivered, only
    /// reordered): each one widens the path's reorder window (RACK `reo_wnd_mult`).
    pub spurious_losses: u64,
    /// Tail-loss probes found spurious afterwards (the ACK that followed acknowledged
    /// packets sent before the probe): each one lengthens the path's probe timeout.
    pub spurious_probes: u64,
    /// Loss timers handled more than 1 ms after their deadline (the host did not run the
    /// endpoint in time) and re-armed once for a grace period instead of firing.
    pub late_timers: u64,
    /// Tail-loss probes put off once because the whole connection had gone silent while
    /// another of its paths already had a probe out (see `PathTx::defer_probe`).
    pub deferred_probes: u64,
    /// Retransmission timeouts.
    pub rtos: u64,
    /// Of `rtos`, those that fired while the peer was silent about this path's packets:
    /// it had sent nothing since this path's probe, or acknowledged nothing sent after the
    /// path's oldest outstanding packet on any path, while every other live path waited
    /// too. The outstanding packets were kept, not declared lost, and the probe was sent
    /// again (see `PathTx::hold_timeout`,
    /// [`TransportConfig::hold_silent_rto`](crate::TransportConfig::hold_silent_rto)).
    pub silent_rtos: u64,
    /// Of `rtos`, those that fired before this path had any RTT sample, while no packet
    /// sent after its oldest outstanding one had been acknowledged on any path and no
    /// other path with an RTT sample was idle: the packets were kept and the probe sent
    /// again, as for `silent_rtos`
    /// ([`TransportConfig::unmeasured_rto_holds`](crate::TransportConfig::unmeasured_rto_holds)).
    /// An RTO that qualifies for both counts here.
    pub unmeasured_rtos: u64,
    /// RTOs held while a keepalive on an idle path asked whether the peer is alive:
    /// nothing showed a loss and every other live path was waiting for the peer or idle.
    /// Without an answer the ACKs that end the silence settle the packets, as for
    /// `silent_rtos`, and the RTO counts in `rtos`
    /// ([`TransportConfig::ask_idle_path`](crate::TransportConfig::ask_idle_path)).
    pub asked_rtos: u64,
    /// Of `asked_rtos`, those the peer's answer ended: it came while this path's packets
    /// were still unacknowledged (the peer alive, this path not), so the RTO fired shortly
    /// after and declared them lost. It counts once in `rtos`, when it fires.
    pub refuted_holds: u64,
    /// Re-rolls to a new source port after repeated timeouts.
    pub rerolls: u64,
    /// Re-rolls to a new source port because the path delivered persistently less than
    /// the connection's fastest path (ECMP collision handling, see
    /// [`TransportConfig::rebalance_ratio_permille`](crate::TransportConfig::rebalance_ratio_permille)).
    pub rebalance_rerolls: u64,
    /// CE marks the peer echoed for this path.
    pub ecn_marks: u64,
}

/// State of a path (MetaRoCE path management).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PathState {
    /// Carrying traffic normally.
    Active,
    /// A retransmission timeout fired without progress since: the window is at its minimum.
    Suspect,
    /// Re-rolled to a new UDP source port (new ECMP entropy) after `path_reroll_timeouts`
    /// timeouts in a row; carries one packet at a time until an ACK shows the new route
    /// works.
    Probing,
    /// Retired after `retry_count` timeouts in a row without progress; carries nothing.
    Failed,
}

/// What the application can read about one path.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PathInfo {
    /// Path id (index).
    pub id: u8,
    /// Local UDP source port (ECMP entropy).
    pub src_port: u16,
    /// Window in packets.
    pub window: u32,
    /// Packets in flight.
    pub in_flight: u32,
    /// Smoothed RTT.
    pub srtt: Duration,
    /// Minimum RTT seen, if any sample yet.
    pub min_rtt: Option<Duration>,
    /// Stall allowance: what spurious tail-loss probes taught this path to add to its probe
    /// timeout and RTO (host or peer scheduling stalls), at most 50 ms; halved by every
    /// probe that was needed. A stall of the host or the peer silences every path, so what
    /// one path learns from a stall applies to all of them; what a path learns while the
    /// others kept hearing from the peer is its own (a path slower than its RTT estimate).
    pub stall_allowance: Duration,
    /// Whether the path has failed (retired; see [`PathState::Failed`]).
    pub failed: bool,
    /// Path state.
    pub state: PathState,
    /// How many times the path was re-rolled to a new source port (modulo 16; carried in
    /// PathEth flags so the receiver moves its ACKs too).
    pub generation: u8,
    /// Counters.
    pub stats: PathStats,
}

/// A path's congestion controller and its window, read from the controller once per
/// change instead of at every send decision (`PathTx::can_send` runs for every packet;
/// issue #13: the window was a virtual call and a float conversion per packet). Every
/// change of a [`CongestionController`]'s state goes through one of the four signals
/// below, so the window read after each one is the controller's current window.
#[derive(Debug)]
pub(crate) struct PathCc {
    ctl: Box<dyn CongestionController>,
    window: u32,
}

impl PathCc {
    fn new(ctl: Box<dyn CongestionController>) -> Self {
        let window = ctl.window();
        PathCc { ctl, window }
    }

    /// The controller's window in packets ([`CongestionController::window`]).
    pub fn window(&self) -> u32 {
        self.window
    }

    fn on_ack(&mut self, now: Instant, acked: u32, rtt: &RttEstimator) {
        self.ctl.on_ack(now, acked, rtt);
        self.window = self.ctl.window();
    }

    fn on_ecn(&mut self, now: Instant, marked: u32, acked: u32, rtt: &RttEstimator) {
        self.ctl.on_ecn(now, marked, acked, rtt);
        self.window = self.ctl.window();
    }

    fn on_loss(&mut self, now: Instant, lost: u32, rtt: &RttEstimator) {
        self.ctl.on_loss(now, lost, rtt);
        self.window = self.ctl.window();
    }

    fn on_timeout(&mut self, now: Instant) {
        self.ctl.on_timeout(now);
        self.window = self.ctl.window();
    }
}

/// Why an RTO is held ([`PathTx::hold_timeout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    /// The path has no RTT sample yet (`unmeasured_rtos`).
    Unmeasured,
    /// The peer is silent on every path (`silent_rtos`).
    Silent,
    /// The peer is silent on every busy path, and a keepalive asks an idle one
    /// (`asked_rtos`).
    Asked,
}

/// Sender side of a path.
#[derive(Debug)]
pub(crate) struct PathTx {
    pub id: u8,
    pub src_port: u16,
    pub next_psn: u32,
    /// The path's first PSN: no ACK may acknowledge a PSN before it (while the path has
    /// sent fewer than 2^22 packets; beyond that every PSN behind `next_psn` was sent).
    first_psn: u32,
    /// Packets sent on the path so far (all transmissions).
    total_sent: u64,
    sent: VecDeque<SentPacket>,
    pub outstanding: u32,
    pub rtt: RttEstimator,
    pub cc: PathCc,
    last_ce_count: u32,
    pub consecutive_rtos: u32,
    /// `consecutive_rtos` when the timeout back-off last restarted (a re-roll while the
    /// connection's other paths deliver, `TransportConfig::path_reroll_resets_backoff`):
    /// the RTO doubles once per timeout since then.
    backoff_from: u32,
    /// Time of the last forward progress (or of the first send after idling); loss timers
    /// count from it.
    last_progress: Instant,
    /// The latest send time of a packet of this path that an ACK (or NAK) settled: the
    /// peer heard this route at least until then.
    newest_acked_sent: Option<Instant>,
    probe_sent: bool,
    /// The next PSN when the pending tail-loss probe was scheduled: packets below it were
    /// outstanding before the probe.
    probe_psn: Option<u32>,
    /// When an RTO was held (`hold_timeout`), if one was since the last progress,
    /// RTO or abandon: the ACKs that end the silence teach no stall allowance, and losses
    /// they show while acknowledging nothing sent before it collapse the window.
    held: Option<Instant>,
    /// A held RTO was shown wrong (the peer answered on another path while this path's
    /// packets stay unacknowledged): the loss timer fires at this time at the latest.
    refuted_at: Option<Instant>,
    /// When this path held an RTO that asked idle paths whether the peer is alive
    /// ([`Hold::Asked`]), while that hold stands and is not refuted.
    asked_at: Option<Instant>,
    /// `last_progress` before the pending probe was scheduled.
    probe_since: Instant,
    /// Learned allowance added to the probe timeout and the RTO after spurious probes
    /// (host scheduling stalls), at most `PTO_EXTRA_MAX`; halved on every probe that was
    /// needed. Shared by the paths of a connection (`learn_stall`) when the connection heard
    /// nothing from the peer meanwhile while another path waited for it.
    pub pto_extra: Duration,
    /// Whether, when the pending probe fired, another live path of the connection had a
    /// packet outstanding for longer than its smoothed RTT (it too was waiting for the
    /// peer): set by the connection; see `Connection::stall_was_shared`.
    pub probe_others_waiting: bool,
    /// How long the peer may hold an ACK of this path (its `max_ack_delay`, taken to be
    /// this side's: RFC 9002 §6.2.1 adds it to the probe timeout). Zero by default.
    pub peer_ack_delay: Duration,
    /// The `acked` list of the last ACK, handed back by the connection for the next one.
    pub spare_acked: Vec<SegRef>,
    /// RACK state (RFC 8985 §6): send time, PSN and RTT of the most recently sent packet
    /// that was delivered.
    rack_sent: Option<Instant>,
    rack_psn: u32,
    rack_rtt: Duration,
    /// The path has shown reordering (a hole filled after a later PSN was acknowledged).
    reordering_seen: bool,
    reo_wnd_mult: u32,
    reo_wnd_persist: u32,
    /// When the reorder window was last widened (at most once per SRTT).
    reo_wnd_widened: Option<Instant>,
    /// When the reorder timer fires: the earliest time an outstanding packet below
    /// `rack_psn` passes its deadline.
    rack_deadline: Option<Instant>,
    lost_log: VecDeque<LostRec>,
    /// The loss timer ran late (the host did not run the driver in time) and was given one
    /// grace period until this time instead of firing (`defer_if_late`).
    late_grace: Option<Instant>,
    /// A tail-loss probe is due on this path, ahead of everything else: the newest
    /// outstanding segment, sent again when the connection has no new data for it.
    pub probe: Option<SegRef>,
    pub state: PathState,
    /// Re-roll generation (4 bits), sent in PathEth flags bits 7:4.
    pub generation: u8,
    /// A source port this path moves to once its outstanding packets are settled (ECMP
    /// collision handling); while set, the path sends nothing new, so that packets on the
    /// new route cannot overtake the queued ones of the old route and open SACK holes
    /// (each path is ordered: a hole is a loss).
    pub pending_port: Option<u16>,
    pub stats: PathStats,
}

/// What an ACK did on a path.
#[derive(Debug, Default)]
pub(crate) struct AckOutcome {
    pub acked: Vec<SegRef>,
    pub lost: Vec<SegRef>,
    pub progress: bool,
    /// The ACK's cumulative PSN acknowledged PSNs the path never sent: it was dropped,
    /// nothing moved.
    pub invalid: bool,
    /// The ACK had SACK bits for PSNs the path never sent (at or beyond `next_psn`): they
    /// were ignored.
    pub ignored_unsent: bool,
    /// The RTT sample was taken (the ACK newly acknowledged packets and its echoed
    /// timestamp lies within their send times).
    pub rtt_sampled: bool,
}

impl PathTx {
    pub fn new(
        id: u8,
        src_port: u16,
        init_psn: u32,
        rtt: RttEstimator,
        cc: Box<dyn CongestionController>,
        now: Instant,
    ) -> Self {
        Self {
            id,
            src_port,
            next_psn: init_psn,
            first_psn: init_psn,
            total_sent: 0,
            sent: VecDeque::new(),
            outstanding: 0,
            rtt,
            cc: PathCc::new(cc),
            last_ce_count: 0,
            consecutive_rtos: 0,
            backoff_from: 0,
            last_progress: now,
            newest_acked_sent: None,
            probe_sent: false,
            probe_psn: None,
            held: None,
            refuted_at: None,
            asked_at: None,
            probe_since: now,
            pto_extra: Duration::ZERO,
            probe_others_waiting: false,
            peer_ack_delay: Duration::ZERO,
            spare_acked: Vec::new(),
            rack_sent: None,
            rack_psn: init_psn,
            rack_rtt: Duration::ZERO,
            reordering_seen: false,
            reo_wnd_mult: 1,
            reo_wnd_persist: REO_WND_PERSIST,
            reo_wnd_widened: None,
            rack_deadline: None,
            lost_log: VecDeque::new(),
            late_grace: None,
            probe: None,
            state: PathState::Active,
            generation: 0,
            pending_port: None,
            stats: PathStats::default(),
        }
    }

    fn trim(&mut self) {
        while self
            .sent
            .front()
            .is_some_and(|p| p.state == PktState::Settled)
        {
            self.sent.pop_front();
        }
    }

    /// Oldest PSN still awaited (the floor carried in PathEth).
    pub fn floor_psn(&self) -> u32 {
        self.sent.front().map_or(self.next_psn, |p| p.psn)
    }

    /// Whether a new packet fits the window and the SACK span.
    pub fn can_send(&self) -> bool {
        let window = if self.state == PathState::Probing {
            1
        } else {
            self.cc.window()
        };
        self.state != PathState::Failed
            && self.pending_port.is_none()
            && self.outstanding < window
            && (psn_diff(self.next_psn, self.floor_psn()) as u32) < SACK_BITS - 1
    }

    /// Whether the path timed out since its last progress (an RTO, held or not): its
    /// probes then send what it has out, not new data.
    pub fn timed_out(&self) -> bool {
        self.consecutive_rtos > 0
    }

    /// Whether a probe may go out now (probes bypass the window, not the SACK span).
    pub fn can_probe(&self) -> bool {
        self.state != PathState::Failed
            && (psn_diff(self.next_psn, self.floor_psn()) as u32) < SACK_BITS - 1
    }

    /// Record a transmission; returns the PSN used.
    pub fn on_sent(&mut self, seg: SegRef, now: Instant, retransmit: bool) -> u32 {
        let psn = self.next_psn;
        self.next_psn = psn_add(psn, 1);
        if self.outstanding == 0 {
            self.last_progress = now;
        }
        let floor = self.floor_psn();
        for r in self.lost_log.iter_mut() {
            if r.floor_past.is_none() && psn_diff(floor, r.psn) > 0 {
                r.floor_past = Some(psn);
            }
        }
        self.sent.push_back(SentPacket {
            psn,
            seg,
            state: PktState::Outstanding,
            sent: now,
        });
        self.total_sent += 1;
        self.outstanding += 1;
        self.stats.packets_sent += 1;
        if retransmit {
            self.stats.retransmits += 1;
        }
        psn
    }

    fn index_of(&self, psn: u32) -> Option<usize> {
        let front = self.sent.front()?.psn;
        let d = psn_diff(psn, front);
        if d < 0 || d as usize >= self.sent.len() {
            return None;
        }
        Some(d as usize)
    }

    /// Whether an ACK's cumulative PSN `cum` acknowledges only PSNs this path sent: before
    /// `next_psn`, and not before the path's first PSN − 1 (the receiver's initial `cum`)
    /// while fewer than 2^22 packets went out (after that every PSN in the half-space
    /// behind `next_psn` was sent).
    fn cum_in_range(&self, cum: u32) -> bool {
        if psn_diff(cum, self.next_psn) >= 0 {
            return false;
        }
        self.total_sent >= 1 << 22
            || psn_diff(cum, psn_add(self.first_psn, crate::wire::PSN_MASK)) >= 0
    }

    /// RACK reorder window (RFC 8985 §6.2 step 4): 0 while the path has shown no
    /// reordering (fast reaction to real loss), then `min(reo_wnd_mult · min_RTT / 4, SRTT)`,
    /// `reo_wnd_mult` growing by one for each spurious loss found (at most once per SRTT).
    pub fn reo_wnd(&self) -> Duration {
        if !self.reordering_seen {
            return Duration::ZERO;
        }
        let min = self.rtt.min().unwrap_or(self.rtt.smoothed());
        (min / 4 * self.reo_wnd_mult).min(self.rtt.smoothed())
    }

    /// Process an ACK: `cum` acknowledges every PSN up to and including it; bit i of
    /// `sack` acknowledges `cum + 1 + i`. Outstanding packets sent before the most
    /// recently sent delivered packet are declared lost once `RACK.rtt + reo_wnd` has passed
    /// since they were sent (RFC 8985 §6.2), or at once when they trail the highest
    /// acknowledged PSN by more than `reorder_threshold` packets (0: no packet threshold).
    ///
    /// Checks, in order, before anything moves (docs/PROTOCOL.md, "Delivery"): the
    /// cumulative PSN acknowledges only PSNs the path sent
    /// ([`cum_in_range`](Self::cum_in_range)), else the ACK is dropped (`invalid`: no
    /// completion, no window or ECN change, no RTT sample); SACK bits for PSNs at or beyond
    /// `next_psn` are ignored (`ignored_unsent`) — a receiver reports such a PSN only when
    /// a forged or replayed packet reached it under a PSN this side had not used yet, and
    /// dropping every ACK until the path catches up would let one such packet stall it.
    /// The RTT sample is taken only if the ACK newly acknowledges at least one packet and
    /// the echoed timestamp lies within the send times of the packets it newly
    /// acknowledges (RFC 6298 §3 / Karn: every transmission has its own PSN, so a newly
    /// acknowledged PSN names one transmission; a duplicate ACK, a late ACK or a replayed
    /// packet's stale timestamp takes no sample).
    #[cfg(test)]
    #[allow(clippy::too_many_arguments)]
    pub fn on_ack(
        &mut self,
        now: Instant,
        cum: u32,
        sack: &[u8; 32],
        rtt_sample: Option<Duration>,
        ce_count: u32,
        reorder_threshold: u32,
    ) -> AckOutcome {
        self.on_ack_delayed(
            now,
            cum,
            sack,
            rtt_sample,
            Duration::ZERO,
            ce_count,
            reorder_threshold,
        )
    }

    /// [`on_ack`](Self::on_ack) of an ACK the peer held for `ack_delay` (its AckEth ACK
    /// delay, already bounded by `max_ack_delay`): once the sample passed the send-time
    /// check, the delay is subtracted from it where the result stays at or above the
    /// path's minimum RTT (RFC 9002 §5.3), so a forged delay cannot shrink the RTT.
    #[allow(clippy::too_many_arguments)]
    pub fn on_ack_delayed(
        &mut self,
        now: Instant,
        cum: u32,
        sack: &[u8; 32],
        rtt_sample: Option<Duration>,
        ack_delay: Duration,
        ce_count: u32,
        reorder_threshold: u32,
    ) -> AckOutcome {
        let mut out = AckOutcome {
            acked: std::mem::take(&mut self.spare_acked),
            ..AckOutcome::default()
        };
        out.acked.clear();
        if !self.cum_in_range(cum) {
            out.invalid = true;
            return out;
        }
        // SACK bits for PSNs this path has sent (bit i is PSN cum + 1 + i): the first
        // `sent_bits` of them.
        let sent_bits = (psn_diff(self.next_psn, cum) - 1).clamp(0, SACK_BITS as i32) as u32;
        // The bitmap as four words, bit i = bit i % 64 of word i / 64; split into the bits
        // of sent PSNs and the rest (whole-word operations, not 256 bit tests per ACK).
        let mut words = [0u64; 4];
        let mut unsent = [0u64; 4];
        // An ACK of an in-order path carries an empty bitmap (the common case): nothing to
        // split then.
        let empty = *sack == [0u8; 32];
        for (w, (word, extra)) in words.iter_mut().zip(unsent.iter_mut()).enumerate() {
            if empty {
                break;
            }
            // Wire bytes MSB first: read big-endian and reverse the word (bit 0 = the MSB
            // of the first byte), one reversal per word (issue #13).
            let mut b = [0u8; 8];
            b.copy_from_slice(&sack[8 * w..8 * w + 8]);
            let all = u64::from_be_bytes(b).reverse_bits();
            let first = 64 * w as u32;
            let keep = match sent_bits.saturating_sub(first) {
                0 => 0,
                n if n >= 64 => u64::MAX,
                n => (1u64 << n) - 1,
            };
            *word = all & keep;
            *extra = all & !keep;
        }
        out.ignored_unsent = unsent.iter().any(|&w| w != 0);
        let bit = |i: u32| i < SACK_BITS && words[(i / 64) as usize] >> (i % 64) & 1 == 1;
        // Highest PSN this ACK acknowledges.
        let highest = (0..4usize).rev().find(|&w| words[w] != 0).map_or(cum, |w| {
            let i = 64 * w as u32 + 63 - words[w].leading_zeros();
            psn_add(cum, i + 1)
        });
        let covers = |psn: u32| {
            let d = psn_diff(psn, cum);
            d <= 0 || bit((d - 1) as u32)
        };
        // Spurious loss declarations (the packet was delivered, only late): widen the
        // reorder window.
        let mut spurious = 0u32;
        if !self.lost_log.is_empty() {
            self.lost_log.retain(|r| {
                let built_before_floor = r.floor_past.is_none_or(|f| psn_diff(highest, f) < 0);
                if covers(r.psn) && built_before_floor {
                    spurious += 1;
                    return false;
                }
                built_before_floor
            });
        }
        if spurious > 0 {
            self.stats.spurious_losses += spurious as u64;
            self.reordering_seen = true;
            let srtt = self.rtt.smoothed();
            if self.reo_wnd_widened.is_none_or(|t| now >= t + srtt) {
                self.reo_wnd_widened = Some(now);
                self.reo_wnd_mult = (self.reo_wnd_mult + 1).min(REO_WND_MULT_MAX);
                self.reo_wnd_persist = REO_WND_PERSIST;
            }
        }
        // A probe is spurious when this ACK acknowledges a packet that was outstanding
        // before it (the path was only slow: host scheduling, a queue).
        let probe_psn = self.probe_psn;
        let prev_rack = self.rack_sent.map(|_| self.rack_psn);
        let mut probe_spurious = false;
        // Send times of the packets this ACK newly acknowledges (oldest, newest).
        let mut span: Option<(Instant, Instant)> = None;
        let mut rack_moved = false;
        for p in self.sent.iter_mut() {
            if p.state != PktState::Outstanding {
                continue;
            }
            if psn_diff(p.psn, highest) > 0 {
                break; // PSNs are in order: nothing further is acknowledged.
            }
            if covers(p.psn) {
                p.state = PktState::Settled;
                out.acked.push(p.seg);
                let t = p.sent;
                span = Some(span.map_or((t, t), |(a, b)| (a.min(t), b.max(t))));
                if probe_psn.is_some_and(|q| psn_diff(p.psn, q) < 0) {
                    probe_spurious = true;
                }
                // A hole filled below a PSN delivered by an earlier ACK: the path reorders.
                if prev_rack.is_some_and(|r| psn_diff(p.psn, r) < 0) {
                    self.reordering_seen = true;
                }
                if self.rack_sent.is_none_or(|t| p.sent >= t) {
                    self.rack_sent = Some(p.sent);
                    self.rack_psn = p.psn;
                    rack_moved = true;
                }
            }
        }
        // RACK.rtt of the packet RACK now points at (read once, not per packet).
        if let Some(t) = self.rack_sent.filter(|_| rack_moved) {
            self.rack_rtt = now.saturating_duration_since(t);
        }
        // The probe timeout in force when a pending probe fired, before this ACK's RTT
        // sample (which includes the stall the probe fell into) moves it. Only read with a
        // probe pending (`probe_spurious` needs one): most ACKs have none (issue #13).
        let base_before = probe_psn.map(|_| self.tlp_base());
        // RTT sample: only when this ACK newly acknowledges packets and its echoed
        // timestamp lies within their send times (Karn; a stale or forged echo takes none).
        if let (Some(s), Some((oldest, newest))) = (rtt_sample, span) {
            // (RACK.rtt, just read, is `now - newest` when RACK moved to the newest packet
            // acknowledged here; one packet makes both bounds one: no time read again.)
            let lo = match self.rack_sent {
                Some(t) if rack_moved && t == newest => self.rack_rtt,
                _ => now.saturating_duration_since(newest),
            };
            let hi = if oldest == newest {
                lo
            } else {
                now.saturating_duration_since(oldest)
            };
            if s >= lo && s <= hi {
                let s = match self.rtt.min() {
                    Some(min) if s >= min + ack_delay => s - ack_delay,
                    None if s >= ack_delay => s - ack_delay,
                    _ => s,
                };
                self.rtt.update(s);
                out.rtt_sampled = true;
            }
        }
        if probe_spurious && self.held.is_some() {
            // The silence outlasted an RTO: an outage of the path or of the peer's ACKs as
            // likely as a host stall, and as long as it lasted. Counted, not learnt from
            // (it would add up to the whole outage to every later timeout).
            self.stats.spurious_probes += 1;
        } else if probe_spurious {
            self.stats.spurious_probes += 1;
            // The ACK came this long after the last progress: the probe timeout should
            // have covered it. Learn it, bounded by the RTO.
            // (Against the timeout that fired: measured after this ACK's sample raised
            // SRTT, the need came out as zero and nothing was learnt, issue #13.)
            let gap = now.saturating_duration_since(self.probe_since);
            let need = gap.saturating_sub(base_before.unwrap_or_default());
            self.pto_extra = (self.pto_extra.max(need + need / 4)).min(PTO_EXTRA_MAX);
        } else if probe_psn.is_some() && !out.acked.is_empty() {
            // The probe was needed (only it, or packets after it, came back): a real tail
            // loss; react faster next time.
            self.pto_extra /= 2;
        }
        out.lost = self.rack_detect(now, highest, reorder_threshold);
        // Persistent congestion (RFC 9002 §7.6): losses shown by an ACK that ends a held
        // silence while acknowledging nothing sent before it: everything sent across the
        // silence is gone.
        let persistent = self
            .held
            .is_some_and(|at| span.is_none_or(|(oldest, _)| oldest >= at));
        let (na, nl) = (out.acked.len() as u32, out.lost.len() as u32);
        self.outstanding -= na + nl;
        self.stats.packets_acked += na as u64;
        self.stats.sack_losses += nl as u64;
        if nl > 0 {
            tracing::debug!(
                lost = nl,
                cum,
                rack_psn = self.rack_psn,
                "packets declared lost (SACK gap beyond the reorder window)"
            );
        }
        let marked = ce_count.wrapping_sub(self.last_ce_count);
        // A count that went backwards is a stale ACK: ignore it.
        if marked < (1 << 31) {
            self.last_ce_count = ce_count;
            if marked > 0 {
                self.stats.ecn_marks += marked as u64;
                tracing::trace!(marked, "CE marks echoed: window decrease");
                self.cc.on_ecn(now, marked, na, &self.rtt);
            }
        }
        if na > 0 {
            if self.state != PathState::Active {
                tracing::debug!(path = self.id, port = self.src_port, from = ?self.state, "path active again");
            }
            self.state = PathState::Active;
            out.progress = true;
            self.restart_loss_timer(now, span.map(|(_, newest)| newest));
            self.late_grace = None;
            self.restart_rto_count();
            self.cc.on_ack(now, na, &self.rtt);
        }
        if nl > 0 && persistent {
            // The window collapses as the RTO would have.
            self.cc.on_timeout(now);
        } else if nl > 0 {
            self.cc.on_loss(now, nl, &self.rtt);
        }
        self.trim();
        self.apply_pending_port();
        out
    }

    /// RACK loss detection (RFC 8985 §6.2 step 5): every outstanding packet sent before
    /// the most recently sent delivered one (`rack_psn`) whose `sent + RACK.rtt + reo_wnd`
    /// has passed is lost; the earliest deadline still ahead arms the reorder timer.
    /// Returns the lost segments; `outstanding` and the counters are the caller's.
    fn rack_detect(&mut self, now: Instant, highest: u32, reorder_threshold: u32) -> Vec<SegRef> {
        let mut lost = Vec::new();
        self.rack_deadline = None;
        if self.rack_sent.is_none() {
            return lost;
        }
        let wait = self.rack_rtt + self.reo_wnd();
        let rack_psn = self.rack_psn;
        let mut deadline: Option<Instant> = None;
        for p in self.sent.iter_mut() {
            if psn_diff(p.psn, rack_psn) >= 0 {
                break;
            }
            if p.state != PktState::Outstanding {
                continue;
            }
            let due = p.sent + wait;
            let by_count =
                reorder_threshold > 0 && psn_diff(highest, p.psn) > reorder_threshold as i32;
            if now >= due || by_count {
                p.state = PktState::Settled;
                lost.push(p.seg);
                if self.lost_log.len() == LOST_LOG {
                    self.lost_log.pop_front();
                }
                self.lost_log.push_back(LostRec {
                    psn: p.psn,
                    floor_past: None,
                });
            } else {
                deadline = Some(deadline.map_or(due, |d| d.min(due)));
            }
        }
        self.rack_deadline = deadline;
        if !lost.is_empty() {
            // RFC 8985 §6.2 step 4: after `reo_wnd_persist` recoveries without a spurious
            // loss, the multiplier goes back to 1.
            self.reo_wnd_persist = self.reo_wnd_persist.saturating_sub(1);
            if self.reo_wnd_persist == 0 {
                self.reo_wnd_mult = 1;
                self.reo_wnd_persist = REO_WND_PERSIST;
            }
        }
        lost
    }

    /// The peer refused the packet with this PSN (NAK): settle it and return its segment.
    ///
    /// A NAK is an answer from the peer: the path works, so the RTO count that fails a
    /// path (`retry_count`) and its backoff start over. It restarts the loss timer (and
    /// ends probes) only when it names the oldest packet the path has outstanding: the
    /// older packet may be lost, and a peer that kept refusing later packets (flow-control
    /// RNR NAKs every RNR timer) would otherwise push its loss timer back for as long as
    /// the NAKs went on. (When such NAKs did not restart the RTO count either, a lossy but
    /// answering path failed after `retry_count` RTOs and took the connection with it:
    /// found by the `pair_impaired` fuzz target.) Nor does a NAK move RACK: NAKs leave the
    /// receiver ahead of ACKs it holds (delayed ACK), so a NAK of a later packet says
    /// nothing about the earlier ones, and a probe's NAK must not declare lost the first
    /// copy of its own segment (found by review: that failed a SEND the receiver then
    /// delivered).
    pub fn on_nak(&mut self, psn: u32, now: Instant) -> Option<SegRef> {
        let i = self.index_of(psn)?;
        let p = &mut self.sent[i];
        if p.state != PktState::Outstanding {
            return None;
        }
        p.state = PktState::Settled;
        let (seg, sent) = (p.seg, p.sent);
        self.outstanding -= 1;
        let oldest = !self
            .sent
            .range(..i)
            .any(|q| q.state == PktState::Outstanding);
        self.restart_rto_count();
        if self.state != PathState::Failed {
            self.state = PathState::Active;
        }
        if oldest {
            self.restart_loss_timer(now, Some(sent));
        }
        self.trim();
        self.apply_pending_port();
        Some(seg)
    }

    /// The peer answered (an ACK of new packets, or any NAK): the path works, so the count
    /// of RTOs in a row that fails it (`retry_count`) and the RTO backoff start over.
    fn restart_rto_count(&mut self) {
        self.consecutive_rtos = 0;
        self.backoff_from = 0;
    }

    /// The loss timer counts from `now` again and probing ends (no probe pending, no held
    /// silence, no refuted or asked-for probe): the peer answered the oldest outstanding
    /// packet (or newer ones, by ACK), an RTO settled everything, or the path moved
    /// (`abandon`). `newest` is the send time of the newest packet an answer covers. One
    /// place for all four, so that a new piece of probe state cannot be reset by one and
    /// forgotten by another.
    fn restart_loss_timer(&mut self, now: Instant, newest: Option<Instant>) {
        self.last_progress = now;
        self.newest_acked_sent = self.newest_acked_sent.max(newest);
        self.probe_sent = false;
        self.probe_psn = None;
        self.held = None;
        self.refuted_at = None;
        self.asked_at = None;
    }

    /// Probe timeout (PTO): `max(2·SRTT, SRTT + 4·RTTVAR, 200 µs)`. RFC 8985 §7.2 uses
    /// 2·SRTT; the RTTVAR term (as in QUIC's PTO, RFC 9002 §6.2.1) keeps probes from firing
    /// on every RTT spike of a path whose RTT varies (host scheduling, queueing), which on
    /// a clean loopback made almost every retransmission a spurious probe.
    /// The RTTVAR term only counts once the path has an RTT sample: before that RTTVAR is
    /// the made-up `initial_rtt / 2`, and the first probe comes after 2 · `initial_rtt`.
    fn tlp_base(&self) -> Duration {
        let srtt = self.rtt.smoothed();
        let var = if self.rtt.latest().is_some() {
            srtt + 4 * self.rtt.var()
        } else {
            Duration::ZERO
        };
        (2 * srtt).max(var).max(PTO_FLOOR)
    }

    /// Another path of the connection found its probe spurious after a stall of the host or
    /// the peer (the peer was silent on every path meanwhile, while another path waited
    /// for it): the stall allowance applies to this path too.
    pub fn learn_stall(&mut self, extra: Duration) {
        self.pto_extra = self.pto_extra.max(extra);
    }

    /// The probe timeout plus what spurious probes taught (`pto_extra`).
    fn tlp_delay(&self) -> Duration {
        self.tlp_base() + self.pto_extra + self.peer_ack_delay
    }

    fn rto(&self, min: Duration, max: Duration) -> Duration {
        let base = self.rtt.rto(min, max);
        let doublings = self.consecutive_rtos.saturating_sub(self.backoff_from);
        (base * (1u32 << doublings.min(16))).min(max)
    }

    /// When the loss timer of this path fires, if armed.
    pub fn loss_deadline(&self, min_rto: Duration, max_rto: Duration) -> Option<Instant> {
        if self.outstanding == 0 || self.state == PathState::Failed {
            return None;
        }
        let wait = if self.probe_sent {
            self.rto(min_rto, max_rto) + self.pto_extra
        } else {
            self.tlp_delay()
        };
        let t = self.last_progress + wait;
        let t = self.rack_deadline.map_or(t, |r| r.min(t));
        let t = self.refuted_at.map_or(t, |r| r.min(t));
        Some(self.late_grace.map_or(t, |g| g.max(t)))
    }

    /// The loss timer, due at `deadline`, is handled only at `now`: if that is more than
    /// `LATE_TIMER` late, the host did not run this endpoint meanwhile (scheduling), and the
    /// silence of the path says nothing about the network — the peer's ACKs, or the peer
    /// itself on a loaded host, were held up just as long. The timer is then re-armed once
    /// for a grace period of `max(SRTT, 200 µs)` from `now` instead of firing; returns
    /// whether it was. In virtual time (simulator, tests) timers are never late.
    pub fn defer_if_late(&mut self, now: Instant, deadline: Instant) -> bool {
        if self.late_grace.is_some() || now.saturating_duration_since(deadline) < LATE_TIMER {
            return false;
        }
        let grace = self.rtt.smoothed().max(PTO_FLOOR);
        self.late_grace = Some(now + grace);
        self.stats.late_timers += 1;
        true
    }

    /// The tail-loss probe of this path is due while the whole connection has heard
    /// nothing from the peer for this path's probe timeout and another path's probe is
    /// already out, unanswered: one probe tells whether the peer host is alive (a host
    /// stall silences every path at once; issue #13: on a loaded host each stall made every
    /// path probe), so this one is put off once, by one probe timeout from `now`. Not when
    /// the due timer is the RACK reorder timer or the RTO, nor twice in a row (the grace
    /// ends with progress or the next timer); returns whether it was put off.
    ///
    /// A loss on this path alone is not delayed: then the peer is heard on the other
    /// paths. When every path lost its packets at once, this path probes one probe timeout
    /// later than before.
    /// `heard`: when the connection last received anything from the peer.
    pub fn defer_probe(&mut self, now: Instant, heard: Instant) -> bool {
        if now.saturating_duration_since(heard) < self.tlp_delay()
            || self.probe_sent
            || self.late_grace.is_some()
            || self.rack_deadline.is_some_and(|d| d <= now)
        {
            return false;
        }
        self.late_grace = Some(now + self.tlp_delay());
        self.stats.deferred_probes += 1;
        true
    }

    /// Whether this path has a tail-loss probe out that nothing has answered since
    /// `since`.
    pub fn probe_unanswered_since(&self, since: Instant) -> bool {
        self.probe_sent && self.state != PathState::Failed && self.last_progress >= since
    }

    /// Whether the RACK reorder timer (RFC 8985 §6.3) is due at `now`: the step
    /// [`on_loss_timer`](Self::on_loss_timer) runs first, which leaves the probe or RTO of
    /// the packets still outstanding armed, possibly already due.
    pub fn rack_due(&self, now: Instant) -> bool {
        self.rack_deadline.is_some_and(|d| d <= now)
    }

    /// Fire the loss timer: first a tail-loss probe (the newest outstanding segment is sent
    /// again on this path to elicit a SACK), then a retransmission timeout that declares
    /// every outstanding packet lost. Returns the segments to retransmit.
    pub fn on_loss_timer(&mut self, now: Instant, retry_count: u32) -> Vec<SegRef> {
        self.late_grace = None;
        if self.rack_due(now) {
            // The reorder timer (RFC 8985 §6.3): holes whose reorder window has passed.
            let lost = self.rack_detect(now, self.rack_psn, 0);
            let nl = lost.len() as u32;
            self.outstanding -= nl;
            self.stats.sack_losses += nl as u64;
            if nl > 0 {
                self.cc.on_loss(now, nl, &self.rtt);
            }
            self.trim();
            self.apply_pending_port();
            return lost;
        }
        if !self.probe_sent {
            self.probe_since = self.last_progress;
            self.probe_sent = true;
            if self.arm_probe(now) {
                tracing::debug!(
                    path = self.id,
                    outstanding = self.outstanding,
                    since_progress = ?now.saturating_duration_since(self.probe_since),
                    pto = ?self.tlp_delay(),
                    "tail-loss probe"
                );
            }
            return Vec::new();
        }
        // A refuted hold (`refute_hold`) already counted this timeout when it held it.
        let counted = self.refuted_at.is_some();
        let mut lost = Vec::new();
        for p in self.sent.iter_mut() {
            if p.state == PktState::Outstanding {
                p.state = PktState::Settled;
                lost.push(p.seg);
            }
        }
        self.sent.clear();
        self.outstanding = 0;
        self.probe = None;
        self.rack_deadline = None;
        self.restart_loss_timer(now, None);
        if !counted {
            self.stats.rtos += 1;
        }
        tracing::debug!(
            path = self.id,
            lost = lost.len(),
            srtt = ?self.rtt.smoothed(),
            stall = ?self.pto_extra,
            "retransmission timeout"
        );
        self.stats.timeout_losses += lost.len() as u64;
        if !counted {
            self.consecutive_rtos += 1;
        }
        self.cc.on_timeout(now);
        if self.state == PathState::Active {
            self.state = PathState::Suspect;
        }
        if self.consecutive_rtos > retry_count {
            self.state = PathState::Failed;
        }
        self.apply_pending_port();
        lost
    }

    /// Whether the RTO due now can be held by [`hold_timeout`](Self::hold_timeout) instead
    /// of declaring the path's packets lost, when the connection finds no evidence of a
    /// loss (the peer silent on every path, or no RTT sample yet and nothing sent later
    /// acknowledged): only the first `in_a_row` RTOs in a row (for a silence, 1: a silence
    /// that outlasts it and the doubled RTO after it is treated as before, since under
    /// heavy ACK loss one probe per path per RTO used up `retry_count` where re-sending the
    /// window got ACKs through), and not the reorder timer, nor the timeout that re-rolls
    /// the path (`reroll_timeouts`) or retires it (`retry_count`), which move its packets
    /// elsewhere.
    pub fn can_hold_timeout(
        &self,
        now: Instant,
        reroll_timeouts: u32,
        retry_count: u32,
        in_a_row: u32,
    ) -> bool {
        let next = self.consecutive_rtos + 1;
        self.probe_sent
            && self.refuted_at.is_none()
            && !self.rack_due(now)
            && self.probe.is_none()
            && self.consecutive_rtos < in_a_row
            && next <= retry_count
            && (reroll_timeouts == 0 || next % reroll_timeouts != 0)
    }

    /// The RTO is held because nothing shows a loss: the peer was silent on every path of
    /// the connection since this path's probe while every other path waited for ACKs of
    /// packets it sent before that probe (a host stall of the peer, or every path down at
    /// once); or the peer acknowledged nothing sent after this path's oldest outstanding
    /// packet on any path while every other path waited too (a queue that has not reached
    /// the packets); or the path has no RTT sample yet and nothing sent later was
    /// acknowledged (`unmeasured`: the RTO came from `initial_rtt`, and the first window
    /// may just be queued). There is no evidence against this path in particular, and no
    /// path known to work to move its packets to. As a QUIC probe timeout does (RFC 9002
    /// §6.2.4), the outstanding packets stay outstanding, the path keeps its congestion
    /// window and turns *Suspect* (it timed out: plane-down detection counts it), and the
    /// newest outstanding segment goes out again as one more probe; the timeout counts
    /// (back-off, `retry_count`). The ACKs that end the wait settle the packets (RACK
    /// declares lost whatever they show missing) and teach no stall allowance: a wait that
    /// outlasted an RTO says nothing about how long the host stalls. The timeouts that
    /// re-roll or retire the path still declare its packets lost
    /// ([`can_hold_timeout`](Self::can_hold_timeout)); the caller checks the rest.
    ///
    /// `unmeasured`: held because the RTO came from `initial_rtt` with no evidence of a
    /// loss ([`TransportConfig::unmeasured_rto_holds`](crate::TransportConfig::unmeasured_rto_holds)),
    /// counted in `unmeasured_rtos` instead of `silent_rtos`; the rest is the same.
    pub fn hold_timeout(&mut self, now: Instant, why: Hold) {
        self.late_grace = None;
        self.stats.rtos += 1;
        match why {
            Hold::Unmeasured => self.stats.unmeasured_rtos += 1,
            Hold::Silent => self.stats.silent_rtos += 1,
            Hold::Asked => {
                self.stats.asked_rtos += 1;
                self.asked_at = Some(now);
            }
        }
        self.consecutive_rtos += 1;
        self.held = Some(now);
        if self.state == PathState::Active {
            self.state = PathState::Suspect;
        }
        self.arm_probe(now);
        tracing::debug!(
            path = self.id,
            outstanding = self.outstanding,
            rtos = self.consecutive_rtos,
            "retransmission timeout while the peer is silent: packets kept, one more probe"
        );
    }

    /// Whether an RTO of this path is held with its packets still outstanding.
    pub fn holding(&self) -> bool {
        self.held.is_some() && self.outstanding > 0
    }

    /// The peer answered on another path while this path holds an RTO
    /// ([`Hold::Asked`]): the packets are not merely late. The loss timer fires at `at`
    /// (which the caller puts a little after the answer, so that ACKs of this path sent
    /// with it still count); that timeout is not held again, so it declares them lost.
    ///
    /// The timeout that fires is the held one, now shown to be real: it counts once in
    /// `rtos`, the back-off and `retry_count`, as if it had not been held.
    pub fn refute_hold(&mut self, at: Instant) {
        if self.holding() && self.asked_at.take().is_some() && self.refuted_at.is_none() {
            self.refuted_at = Some(at);
            self.stats.refuted_holds += 1;
        }
    }

    /// When this path held an RTO that asked idle paths ([`Hold::Asked`]), while that
    /// hold stands and no answer has refuted it.
    pub fn asked_at(&self) -> Option<Instant> {
        self.asked_at.filter(|_| self.holding())
    }

    /// Whether a held RTO of this path was refuted and has not fired yet.
    pub fn refuted(&self) -> bool {
        self.refuted_at.is_some()
    }

    /// When the oldest packet still outstanding on this path was sent.
    pub fn oldest_outstanding_sent(&self) -> Option<Instant> {
        self.sent
            .iter()
            .find(|p| p.state == PktState::Outstanding)
            .map(|p| p.sent)
    }

    /// When the oldest outstanding packet was sent, if its ACK is overdue at `now` (it has
    /// been outstanding for longer than the smoothed RTT): the path is waiting for the peer.
    pub fn overdue_since(&self, now: Instant) -> Option<Instant> {
        self.oldest_outstanding_sent()
            .filter(|&t| now.saturating_duration_since(t) > self.rtt.smoothed())
    }

    /// When this path's tail-loss probe fired, while one is out unanswered.
    pub fn probe_fired_at(&self) -> Option<Instant> {
        self.probe_sent.then_some(self.last_progress)
    }

    /// Schedule a probe fired at `now`: the next PSN sent answers it, the loss timer counts
    /// from `now`, and the newest outstanding segment is what it sends again if there is
    /// no new data (counted in `probes` when there is one); returns whether there was.
    fn arm_probe(&mut self, now: Instant) -> bool {
        self.probe_psn = Some(self.next_psn);
        self.last_progress = now;
        self.probe = self.newest_outstanding_seg();
        if self.probe.is_some() {
            self.stats.probes += 1;
        }
        self.probe.is_some()
    }

    /// The segment of the newest packet still outstanding on this path (what a probe sends
    /// again).
    pub fn newest_outstanding_seg(&self) -> Option<SegRef> {
        self.sent
            .iter()
            .rev()
            .find(|p| p.state == PktState::Outstanding)
            .map(|p| p.seg)
    }

    /// When the newest packet still outstanding on this path (a tail-loss probe, after
    /// one) was sent.
    pub fn newest_outstanding_sent(&self) -> Option<Instant> {
        self.sent
            .iter()
            .rev()
            .find(|p| p.state == PktState::Outstanding)
            .map(|p| p.sent)
    }

    /// The latest send time of a packet of this path an ACK or NAK settled (`None`: none
    /// yet).
    pub fn newest_acked_sent(&self) -> Option<Instant> {
        self.newest_acked_sent
    }

    /// Whether this path should move to a new source port now: every
    /// `reroll_timeouts` timeouts in a row without progress (and not retired).
    pub fn wants_reroll(&self, reroll_timeouts: u32) -> bool {
        self.state != PathState::Failed
            && reroll_timeouts > 0
            && self.consecutive_rtos > 0
            && self.consecutive_rtos % reroll_timeouts == 0
    }

    /// Give up on every outstanding packet of this path without counting a timeout (the
    /// path is being moved to another plane): they are settled and their segments returned
    /// for retransmission, so that a late ACK from the old route cannot be mistaken for
    /// progress on the new one.
    pub fn abandon(&mut self, now: Instant) -> Vec<SegRef> {
        let lost: Vec<SegRef> = self
            .sent
            .iter()
            .filter(|p| p.state == PktState::Outstanding)
            .map(|p| p.seg)
            .collect();
        self.sent.clear();
        self.outstanding = 0;
        self.probe = None;
        self.rack_deadline = None;
        self.restart_loss_timer(now, None);
        self.apply_pending_port();
        lost
    }

    /// Move the path to a new source port (new ECMP entropy) and probe it with one packet
    /// at a time. The timeout back-off and the count of timeouts in a row carry on, so a
    /// path that stays dead is still retired after `retry_count` timeouts.
    pub fn reroll(&mut self, new_port: u16) {
        self.pending_port = None;
        self.src_port = new_port;
        self.generation = (self.generation + 1) & 0x0F;
        self.state = PathState::Probing;
        self.stats.rerolls += 1;
    }

    /// Restart the timeout back-off (the next RTO is the path's base RTO again) without
    /// forgetting the count of timeouts in a row, which still retires the path after
    /// `retry_count`. For a path just re-rolled while the connection's other paths deliver:
    /// its new route is untried, and the back-off earned on the dead one would hold its one
    /// probe packet (real data other work may wait for) for 2^n RTOs.
    pub fn reset_backoff(&mut self) {
        self.backoff_from = self.consecutive_rtos;
    }

    /// Move the path to a new source port (new ECMP entropy) while it works, once its
    /// outstanding packets are settled: until then it sends nothing new (see
    /// `pending_port`); then the re-roll generation advances so that the peer moves its
    /// ACKs too, and the window and RTT estimate carry on. Used by ECMP collision handling.
    pub fn rebalance(&mut self, new_port: u16) {
        self.pending_port = Some(new_port);
        self.stats.rebalance_rerolls += 1;
        self.apply_pending_port();
    }

    /// Take the pending source port if nothing is outstanding any more; returns whether
    /// the path moved.
    pub fn apply_pending_port(&mut self) -> bool {
        if self.outstanding > 0 {
            return false;
        }
        let Some(port) = self.pending_port.take() else {
            return false;
        };
        self.src_port = port;
        self.generation = (self.generation + 1) & 0x0F;
        true
    }

    /// Whether a copy of `seg` sent on this path is still awaited (neither acknowledged,
    /// refused nor declared lost).
    pub fn is_outstanding(&self, seg: SegRef) -> bool {
        self.sent
            .iter()
            .any(|p| p.seg == seg && p.state == PktState::Outstanding)
    }

    pub fn info(&self) -> PathInfo {
        PathInfo {
            id: self.id,
            src_port: self.src_port,
            window: self.cc.window(),
            in_flight: self.outstanding,
            srtt: self.rtt.smoothed(),
            min_rtt: self.rtt.min(),
            stall_allowance: self.pto_extra,
            failed: self.state == PathState::Failed,
            state: self.state,
            generation: self.generation,
            stats: self.stats,
        }
    }
}

/// How a received PSN relates to the receiver's window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RxClass {
    /// Not seen before: process it.
    New,
    /// Already received or settled.
    Duplicate,
    /// Beyond the 256-packet SACK window: drop without acknowledging.
    OutOfWindow,
}

/// What [`PathRx::check`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RxCheck {
    /// In window with a consistent floor: the floor may be applied.
    Ok,
    /// The packet's own PSN is beyond the SACK window: drop, move nothing.
    OutOfWindow,
    /// The floor is ahead of the packet's own PSN: drop, move nothing.
    BadFloor,
}

/// Receiver side of a path: cumulative PSN plus a 256-bit SACK bitmap.
#[derive(Debug, Clone)]
pub(crate) struct PathRx {
    /// Every PSN up to and including `cum` is received or settled.
    pub cum: u32,
    /// Bit i (word i/64, bit i%64) = PSN `cum + 1 + i` received.
    bits: [u64; 4],
    pub ce_count: u32,
    pub ce_since_ack: bool,
    pub echo_ts: u32,
    /// When the packet whose timestamp `echo_ts` is arrived (the ACK reports the time
    /// since as its ACK delay).
    pub echo_at: Option<Instant>,
    pub ack_pending: bool,
    /// The sender's re-roll generation of this path (PathEth flags 7:4): ACKs move to a new
    /// source port with it, so a re-rolled path gets new entropy in both directions.
    pub generation: u8,
    /// The sender's plane of this path (PathEth byte 8); ACKs leave on the same plane.
    pub plane: u8,
    /// When a new packet was last accepted on the path.
    last_new: Option<Instant>,
    /// A packet ahead of the window with a consistent floor, seen while the path was quiet:
    /// (PSN, floor). See [`check`](Self::check).
    resync: Option<(u32, u32)>,
}

impl PathRx {
    /// Clear the ACK due and the CE-since-last-ACK mark, returning the AckEth flags
    /// (ECE) of the ACK being sent.
    pub fn take_ack_flags(&mut self) -> u8 {
        self.ack_pending = false;
        let flags = self.ce_since_ack as u8;
        self.ce_since_ack = false;
        flags
    }

    /// The AckEth describing this path's state (cumulative PSN in the BTH or ACK block).
    /// `now`: when the ACK is sent; its ACK delay is the time since `echo_at`, in µs
    /// (saturating).
    pub fn ack_eth(
        &self,
        path_id: u8,
        flags: u8,
        (rate_hint, window_grant): (u32, u8),
        now: Instant,
    ) -> crate::wire::AckEth {
        let held = self
            .echo_at
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        crate::wire::AckEth {
            path_id,
            flags,
            ack_delay: u16::try_from(held.as_micros()).unwrap_or(u16::MAX),
            echo_ts: self.echo_ts,
            ce_count: self.ce_count,
            window_grant,
            rate_hint,
            sack: self.sack_bytes(),
        }
    }

    pub fn new(init_psn: u32) -> Self {
        Self {
            cum: psn_add(init_psn, crate::wire::PSN_MASK),
            bits: [0; 4],
            ce_count: 0,
            ce_since_ack: false,
            echo_ts: 0,
            echo_at: None,
            ack_pending: false,
            generation: 0,
            plane: 0,
            last_new: None,
            resync: None,
        }
    }

    /// No PSN beyond `cum` was received: the path has no gap.
    pub fn in_order(&self) -> bool {
        self.bits == [0; 4]
    }

    fn bit(&self, i: u32) -> bool {
        self.bits[(i / 64) as usize] >> (i % 64) & 1 == 1
    }

    fn shift(&mut self, n: u32) {
        if n >= SACK_BITS {
            self.bits = [0; 4];
        } else if n > 0 {
            let (w, b) = ((n / 64) as usize, n % 64);
            let old = self.bits;
            for i in 0..4 {
                let lo = old.get(i + w).copied().unwrap_or(0);
                let hi = old.get(i + w + 1).copied().unwrap_or(0);
                self.bits[i] = if b == 0 {
                    lo
                } else {
                    (lo >> b) | (hi << (64 - b))
                };
            }
        }
        self.cum = psn_add(self.cum, n);
    }

    fn advance(&mut self) {
        // Slide over the received prefix.
        let ones = self.bits[0].trailing_ones();
        if ones == 0 {
            return;
        }
        let mut n = 0;
        for w in self.bits {
            let t = w.trailing_ones();
            n += t;
            if t < 64 {
                break;
            }
        }
        self.shift(n);
    }

    /// Check a data packet's PSN and floor before anything moves (docs/PROTOCOL.md,
    /// "Delivery", receiver checks): its floor must not be ahead of its own PSN (a sender's
    /// floor is the oldest PSN it still awaits, and the packet itself is awaited), and its
    /// own PSN must be in the SACK window as it stands (`cum + 1 ..= cum + 256`, the floor
    /// not applied yet), or be brought into it by a consistent floor (`floor <= psn <
    /// floor + 256`) that slides the window by at most 256 (`floor <= cum + 257`). Only then may [`apply_floor`](Self::apply_floor) run, moving the
    /// window at most up to the packet's own PSN; a floor behind `cum` is stale and moves
    /// nothing.
    ///
    /// Resynchronization: a sender whose packets on this path were all lost for a while
    /// (a blackhole lasting many retransmission timeouts) may have given up on more PSNs
    /// than the window holds, so its packets arrive ahead of the window. Such a packet is
    /// dropped, but remembered as a candidate when its floor is consistent with it
    /// (`floor <= psn < floor + 256`) and the path has accepted no new packet for `quiet`
    /// (the sender's minimum RTO). A second consistent packet ahead of the window, with a
    /// higher PSN less than 256 after the candidate's and a floor not behind it, while the
    /// path is still quiet, is accepted (`Ok`): its floor then moves the window. The
    /// sender's probes after a blackhole are at least one RTO apart and nothing else
    /// arrives on the path, so it recovers on its second probe; a forged packet during
    /// traffic on the path moves nothing.
    pub fn check(&mut self, psn: u32, floor: u32, now: Instant, quiet: Duration) -> RxCheck {
        if psn_diff(floor, psn) > 0 {
            return RxCheck::BadFloor;
        }
        let d = psn_diff(psn, self.cum);
        if d <= 0 || d as u32 <= SACK_BITS {
            return RxCheck::Ok;
        }
        let consistent = (psn_diff(psn, floor) as u32) < SACK_BITS;
        // A consistent floor that slides the window by at most its width (to `floor - 1 <=
        // cum + 256`) brings the packet into it: the sender's floor jumped (it gave up on
        // the packet at the floor) and the first packets carrying the new floor were lost.
        // Such a floor moves the window no further than an in-window packet's could.
        let fd = psn_diff(floor, self.cum);
        if consistent && fd > 0 && fd as u32 <= SACK_BITS + 1 {
            return RxCheck::Ok;
        }
        let is_quiet = self
            .last_new
            .is_none_or(|t| now.saturating_duration_since(t) >= quiet);
        if !consistent || !is_quiet {
            return RxCheck::OutOfWindow;
        }
        if let Some((cpsn, cfloor)) = self.resync {
            let step = psn_diff(psn, cpsn);
            if step > 0 && (step as u32) < SACK_BITS && psn_diff(floor, cfloor) >= 0 {
                self.resync = None;
                return RxCheck::Ok;
            }
        }
        self.resync = Some((psn, floor));
        RxCheck::OutOfWindow
    }

    /// A new packet was accepted on the path at `now` (it is not quiet).
    pub fn on_new(&mut self, now: Instant) {
        self.last_new = Some(now);
        self.resync = None;
    }

    /// Apply the sender's floor: every PSN before it is settled. Call only for a packet
    /// that passed [`check`](Self::check) with this floor: the window then moves at most
    /// up to the packet's own PSN.
    pub fn apply_floor(&mut self, floor: u32) {
        let d = psn_diff(psn_add(floor, crate::wire::PSN_MASK), self.cum);
        if d > 0 {
            self.shift(d as u32);
            self.advance();
        }
    }

    pub fn classify(&self, psn: u32) -> RxClass {
        let d = psn_diff(psn, self.cum);
        if d <= 0 {
            RxClass::Duplicate
        } else if d as u32 > SACK_BITS {
            RxClass::OutOfWindow
        } else if self.bit(d as u32 - 1) {
            RxClass::Duplicate
        } else {
            RxClass::New
        }
    }

    /// Whether `psn` is within the window or at most 256 PSNs behind its start (a PSN a
    /// duplicate or a packet whose PSN a forged one took first may still carry).
    pub fn recent(&self, psn: u32) -> bool {
        psn_diff(psn, self.cum) > -(SACK_BITS as i32)
    }

    /// Whether a data packet with `psn` and `floor` is the common case: the next PSN
    /// (`cum + 1`) on a path with no gap, its floor not ahead of it. Such a packet passes
    /// [`check`](Self::check) (`Ok`), its floor moves nothing in
    /// [`apply_floor`](Self::apply_floor) and it is [`classify`](Self::classify)'d `New`,
    /// so those three may be skipped (issue #13: none of the SACK window machinery runs).
    #[inline]
    pub fn is_next(&self, psn: u32, floor: u32) -> bool {
        psn == psn_add(self.cum, 1) && psn_diff(floor, psn) <= 0 && self.in_order()
    }

    /// Record `psn` as received (it must have been classified `New`).
    #[inline]
    pub fn mark(&mut self, psn: u32) {
        if psn == psn_add(self.cum, 1) && self.in_order() {
            // The next PSN with no gap: the window slides by one, nothing else to do.
            self.cum = psn;
            return;
        }
        self.mark_general(psn);
    }

    /// [`mark`](Self::mark) through the SACK bitmap, any PSN in the window.
    fn mark_general(&mut self, psn: u32) {
        let d = psn_diff(psn, self.cum);
        if d > 0 && d as u32 <= SACK_BITS {
            let i = d as u32 - 1;
            self.bits[(i / 64) as usize] |= 1 << (i % 64);
            self.advance();
        }
    }

    /// The SACK bitmap in wire order (bit i = bit 7 - i%8 of byte i/8).
    pub fn sack_bytes(&self) -> [u8; 32] {
        // Bit i is bit i % 64 of word i / 64 (LSB first): byte k of the little-endian word
        // holds indices 8k..8k+7 LSB first, the wire wants them MSB first.
        // Reversing the whole word puts index 0 in bit 63, which big-endian order puts in
        // the MSB of the first byte: one reversal per word, not one per byte (issue #13).
        let mut out = [0u8; 32];
        for (chunk, w) in out.chunks_exact_mut(8).zip(self.bits) {
            chunk.copy_from_slice(&w.reverse_bits().to_be_bytes());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The in-order fast paths agree with the general code: whenever `is_next` holds,
    /// `check` says `Ok`, `apply_floor` moves nothing and `classify` says `New`; `mark`
    /// leaves the same state as `mark_general`, for in-order, reordered, duplicate and
    /// lost PSNs and floors that jump, across the PSN wrap.
    #[test]
    fn in_order_fast_paths_match_the_general_code() {
        let now = Instant::now();
        let quiet = Duration::from_millis(1);
        let mut x: u64 = 0x2545_F491_4F6C_DD1D;
        for start in [0, crate::wire::PSN_MASK - 40] {
            let mut rx = PathRx::new(start);
            let mut next = start;
            let mut fast = 0;
            for _ in 0..5000 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // Mostly the next PSN; sometimes one ahead (a gap), one behind (late or
                // duplicate) or a floor jump.
                let psn = match x % 16 {
                    0 => psn_add(next, 1 + (x >> 8) as u32 % 5),
                    1 => psn_add(next, crate::wire::PSN_MASK - (x >> 8) as u32 % 5),
                    _ => next,
                };
                // The floor: usually a little behind; at the packet's PSN (which slides the
                // window past a gap); now and then ahead of it (refused by `check`).
                let k = (x >> 24) as u32 % 4;
                let f = match (x >> 32) % 8 {
                    0 => psn_add(psn, 1 + k),
                    1 => psn,
                    _ => psn_add(psn, crate::wire::PSN_MASK - k),
                };
                if rx.is_next(psn, f) {
                    fast += 1;
                    let mut r = rx.clone();
                    assert_eq!(r.check(psn, f, now, quiet), RxCheck::Ok);
                    r.apply_floor(f);
                    assert_eq!((r.cum, r.bits), (rx.cum, rx.bits));
                    assert_eq!(r.classify(psn), RxClass::New);
                }
                if rx.check(psn, f, now, quiet) != RxCheck::Ok {
                    continue;
                }
                rx.apply_floor(f);
                if rx.classify(psn) == RxClass::New {
                    let mut general = rx.clone();
                    general.mark_general(psn);
                    rx.mark(psn);
                    assert_eq!((rx.cum, rx.bits), (general.cum, general.bits));
                }
                next = psn_add(rx.cum, 1);
            }
            assert!(fast > 2000, "{fast}");
        }
    }

    fn tx(id: u8, port: u16, now: Instant) -> PathTx {
        let cfg = crate::CongestionConfig::default();
        PathTx::new(
            id,
            port,
            0,
            RttEstimator::new(Duration::from_micros(100)),
            super::super::cc::new_controller(&cfg, 4096),
            now,
        )
    }

    /// The SACK bitmap in wire order, both ways (issue #13 turned the per-byte bit
    /// reversals into one per word): bit i is bit 7 - i % 8 of byte i / 8
    /// (`AckEth::sack_get`), for the receiver's `sack_bytes` and for the sender's reading
    /// of it in `on_ack` (each SACKed packet acknowledged, the others not).
    #[test]
    fn sack_bit_order_matches_the_wire() {
        let now = Instant::now();
        let set = [0u32, 1, 7, 8, 9, 63, 64, 65, 127, 128, 200, 254];
        let mut rx = PathRx::new(0);
        let cum0 = rx.cum;
        for &i in &set {
            // PSN cum + 2 + i: SACK bit i + 1 (bit 0 stays clear, so `cum` does not move).
            rx.mark(psn_add(cum0, i + 2));
        }
        assert_eq!(rx.cum, cum0);
        let sack = rx.sack_bytes();
        let a = crate::wire::AckEth {
            path_id: 0,
            flags: 0,
            ack_delay: 0,
            echo_ts: 0,
            ce_count: 0,
            window_grant: 0,
            rate_hint: 0,
            sack,
        };
        for i in 0..256usize {
            let want = set.iter().any(|&k| k as usize + 1 == i);
            assert_eq!(a.sack_get(i), want, "bit {i}");
        }
        // The sender: 256 packets from PSN 0; an ACK with cum = PSN 0 and these bits.
        let mut p = tx(0, 1, now);
        for k in 0..255 {
            p.on_sent(SegRef { op: 0, seg: k }, now, false);
        }
        let out = p.on_ack(now, 0, &sack, None, 0, 1000);
        let mut acked: Vec<u32> = out.acked.iter().map(|s| s.seg).collect();
        acked.sort_unstable();
        let mut want: Vec<u32> = std::iter::once(0)
            .chain(set.iter().map(|&k| k + 2).filter(|&s| s < 255))
            .collect();
        want.sort_unstable();
        assert_eq!(acked, want);
    }

    /// Ack `n` packets sent now on `p`, 100 µs later.
    fn send_and_ack(p: &mut PathTx, now: Instant, n: u32) {
        for k in 0..n {
            p.on_sent(SegRef { op: 0, seg: k }, now, false);
        }
        let cum = psn_add(p.next_psn, 0xFF_FFFF); // next_psn - 1
        p.on_ack(now, cum, &[0; 32], Some(Duration::from_micros(100)), 0, 0);
    }

    #[test]
    fn rebalance_moves_the_persistently_slowest_path_with_back_off() {
        let t0 = Instant::now();
        let mut paths: Vec<PathTx> = (0..4).map(|i| tx(i, 1000 + i as u16, t0)).collect();
        let cfg = RebalanceConfig {
            ratio_permille: 750,
            interval_rtts: 4,
            min_packets: 16,
            rounds: 2,
            max_rerolls: 2,
        };
        let mut rb = Rebalance::default();
        let mut moves = Vec::new();
        for step in 0..200u64 {
            let now = t0 + Duration::from_micros(100 * step);
            // Paths 0..2 get 30 packets per step, path 3 (sharing a link) 20: 667‰.
            for (i, p) in paths.iter_mut().enumerate() {
                send_and_ack(p, now, if i == 3 { 20 } else { 30 });
            }
            if let Some(m) = rb.on_ack(now, &paths, &cfg) {
                moves.push((step, m.path));
            }
        }
        // Intervals of 4 RTTs = 4 steps; two slow intervals, then the first move; then 1
        // skipped interval; the budget of 2 stops it.
        assert_eq!(moves.len(), 2, "{moves:?}");
        assert!(moves.iter().all(|&(_, p)| p == 3), "{moves:?}");
        assert!(moves[1].0 - moves[0].0 >= 3 * 4, "{moves:?}");
        // Level paths are never moved, and an app-limited interval is not counted.
        let mut rb = Rebalance::default();
        for step in 0..200u64 {
            let now = t0 + Duration::from_micros(100 * (200 + step));
            for p in paths.iter_mut() {
                send_and_ack(p, now, 30);
            }
            assert_eq!(rb.on_ack(now, &paths, &cfg), None);
        }
        let mut rb = Rebalance::default();
        for step in 0..200u64 {
            let now = t0 + Duration::from_micros(100 * (400 + step));
            for (i, p) in paths.iter_mut().enumerate() {
                send_and_ack(p, now, if i == 3 { 10 } else { 30 });
            }
            rb.app_limited = true;
            assert_eq!(rb.on_ack(now, &paths, &cfg), None);
        }
    }

    #[test]
    fn rebalance_move_waits_until_the_path_drains() {
        let t0 = Instant::now();
        let mut p = tx(0, 1000, t0);
        for k in 0..4 {
            p.on_sent(SegRef { op: 0, seg: k }, t0, false);
        }
        p.rebalance(2000);
        assert_eq!((p.src_port, p.generation), (1000, 0));
        assert!(!p.can_send(), "a path waiting to move sends nothing new");
        let mut sack = [0u8; 32];
        sack[0] = 0x80; // PSN 2 (cum 0: PSNs 0 and 2 acked, 1 and 3 outstanding)
        p.on_ack(t0, 0, &sack, None, 0, 4);
        assert_eq!(p.src_port, 1000);
        p.on_ack(t0, 3, &[0; 32], None, 0, 4);
        assert_eq!((p.src_port, p.generation, p.pending_port), (2000, 1, None));
        assert_eq!(p.stats.rebalance_rerolls, 1);
        assert!(p.can_send());
    }

    fn seg(k: u32) -> SegRef {
        SegRef { op: 0, seg: k }
    }

    /// SACK bitmap acknowledging `cum + 1 + i` for each `i` in `bits`.
    fn sack(bits: &[u32]) -> [u8; 32] {
        let mut s = [0u8; 32];
        for &i in bits {
            s[(i / 8) as usize] |= 0x80 >> (i % 8);
        }
        s
    }

    /// Before the path has shown reordering, a hole below a delivered packet is lost at
    /// once (reo_wnd = 0: the fast reaction to real loss, RFC 8985 §6.2 step 4).
    #[test]
    fn rack_hole_is_lost_at_once_on_a_path_without_reordering() {
        let t0 = Instant::now();
        let mut p = tx(0, 1000, t0);
        for k in 0..4 {
            p.on_sent(seg(k), t0, false);
        }
        let t1 = t0 + Duration::from_micros(20);
        // cum 0, PSN 2 and 3 acknowledged: PSN 1 is a hole.
        let out = p.on_ack(t1, 0, &sack(&[1, 2]), Some(Duration::from_micros(20)), 0, 0);
        assert_eq!(out.lost, vec![seg(1)]);
        assert_eq!(p.reo_wnd(), Duration::ZERO);
    }

    /// Once a hole filled late (reordering seen), a hole waits `RACK.rtt + reo_wnd` from
    /// its sending; the reorder timer then declares it lost. A loss that turns out to be
    /// delivered (acknowledged before the floor passed it) is spurious and widens the
    /// window.
    #[test]
    fn rack_waits_a_reorder_window_once_the_path_reorders() {
        let t0 = Instant::now();
        let us = Duration::from_micros;
        let mut p = tx(0, 1000, t0);
        p.rtt.update(us(20));
        for k in 0..4 {
            p.on_sent(seg(k), t0, false);
        }
        // PSN 1 lost at once (no reordering seen yet).
        let out = p.on_ack(t0 + us(20), 0, &sack(&[1]), Some(us(20)), 0, 0);
        assert_eq!(out.lost, vec![seg(1)]);
        // PSN 1 was only late: it is acknowledged before any packet carried a floor above
        // it (nothing was sent since).
        let out = p.on_ack(t0 + us(22), 3, &[0; 32], Some(us(22)), 0, 0);
        assert_eq!(out.acked, vec![seg(3)], "PSN 1 was settled as lost");
        assert_eq!(p.stats.spurious_losses, 1);
        assert!(p.reo_wnd() > Duration::ZERO);
        let wnd = p.reo_wnd();
        // Now a hole is not lost at once.
        let t1 = t0 + us(100);
        for k in 4..8 {
            p.on_sent(seg(k), t1, false);
        }
        let out = p.on_ack(t1 + us(20), 4, &sack(&[1, 2]), Some(us(20)), 0, 0);
        assert!(out.lost.is_empty(), "{out:?}");
        let d = p
            .loss_deadline(Duration::from_millis(1), Duration::from_secs(1))
            .unwrap();
        assert_eq!(
            d,
            t1 + us(20) + wnd,
            "reorder timer at sent + RACK.rtt + reo_wnd"
        );
        // Filled in time: no loss.
        let out = p.on_ack(t1 + us(21), 7, &[0; 32], Some(us(21)), 0, 0);
        assert_eq!((out.acked.len(), out.lost.len()), (1, 0));
        // A hole that stays: lost when the reorder timer fires.
        let t2 = t0 + us(200);
        for k in 8..12 {
            p.on_sent(seg(k), t2, false);
        }
        let out = p.on_ack(t2 + us(20), 8, &sack(&[1, 2]), Some(us(20)), 0, 0);
        assert!(out.lost.is_empty());
        let d = p
            .loss_deadline(Duration::from_millis(1), Duration::from_secs(1))
            .unwrap();
        let lost = p.on_loss_timer(d, 12);
        assert_eq!(lost, vec![seg(9)]);
        assert_eq!(
            p.stats.probes, 0,
            "the reorder timer is not a tail-loss probe"
        );
        // The floor now passes PSN 9: an ACK built after the receiver saw it says nothing
        // about whether PSN 9 arrived, so it is not taken for a spurious loss.
        p.on_sent(seg(12), t2 + us(60), true);
        let out = p.on_ack(t2 + us(80), 12, &[0; 32], Some(us(20)), 0, 0);
        assert_eq!(out.acked.len(), 1);
        assert_eq!(p.stats.spurious_losses, 1);
    }

    /// A loss timer handled long after its deadline (the host did not run the endpoint)
    /// is re-armed once for a grace period instead of firing; a timer on time fires.
    #[test]
    fn late_loss_timer_gets_one_grace_period() {
        let t0 = Instant::now();
        let (min, max) = (Duration::from_millis(1), Duration::from_secs(1));
        let mut p = tx(0, 1000, t0);
        p.on_sent(seg(0), t0, false);
        let d = p.loss_deadline(min, max).unwrap();
        assert!(!p.defer_if_late(d, d), "on time: fires");
        let late = d + Duration::from_millis(5);
        assert!(p.defer_if_late(late, d));
        let g = p.loss_deadline(min, max).unwrap();
        assert!(g > late, "re-armed after now");
        assert!(
            !p.defer_if_late(g + Duration::from_millis(5), g),
            "only once"
        );
        assert!(p.on_loss_timer(g, 12).is_empty());
        assert_eq!((p.stats.probes, p.stats.late_timers), (1, 1));
    }

    #[test]
    fn rx_window_tracks_holes_and_floor() {
        let mut rx = PathRx::new(100);
        assert_eq!(rx.classify(100), RxClass::New);
        rx.mark(100);
        assert_eq!(rx.cum, 100);
        rx.mark(102);
        assert_eq!(rx.cum, 100);
        assert_eq!(rx.sack_bytes()[0], 0b0100_0000);
        assert_eq!(rx.classify(102), RxClass::Duplicate);
        assert_eq!(rx.classify(101), RxClass::New);
        assert_eq!(rx.classify(100 + 257), RxClass::OutOfWindow);
        // The sender gave up on 101: the floor moves the window past it.
        rx.apply_floor(103);
        assert_eq!(rx.cum, 102);
        assert_eq!(rx.sack_bytes(), [0; 32]);
        assert_eq!(rx.classify(101), RxClass::Duplicate);
    }

    #[test]
    fn rx_checks_own_psn_before_floor_and_resyncs_only_when_quiet() {
        let t0 = Instant::now();
        let quiet = Duration::from_millis(1);
        let mut rx = PathRx::new(0);
        rx.mark(0);
        rx.on_new(t0);
        // Floor ahead of the packet's own PSN; own PSN beyond the window.
        assert_eq!(rx.check(5, 50, t0, quiet), RxCheck::BadFloor);
        assert_eq!(rx.check(300, 290, t0, quiet), RxCheck::OutOfWindow);
        assert_eq!(
            rx.check(301, 291, t0, quiet),
            RxCheck::OutOfWindow,
            "not quiet"
        );
        assert_eq!(rx.check(200, 100, t0, quiet), RxCheck::Ok);
        assert_eq!(rx.cum, 0, "check moves nothing");
        // Quiet: the first consistent packet ahead is a candidate, the second is taken.
        let t1 = t0 + quiet;
        assert_eq!(rx.check(1000, 900, t1, quiet), RxCheck::OutOfWindow);
        assert_eq!(
            rx.check(1000, 900, t1, quiet),
            RxCheck::OutOfWindow,
            "same PSN"
        );
        assert_eq!(rx.check(1001, 1200, t1, quiet), RxCheck::BadFloor);
        assert_eq!(rx.check(1100, 1000, t1, quiet), RxCheck::Ok);
        rx.apply_floor(1000);
        assert_eq!(rx.classify(1100), RxClass::New);
        // An inconsistent floor (more than a window behind its PSN) never resyncs.
        let mut rx = PathRx::new(0);
        assert_eq!(rx.check(5000, 1000, t1, quiet), RxCheck::OutOfWindow);
        assert_eq!(rx.check(5001, 1000, t1, quiet), RxCheck::OutOfWindow);
        assert!(rx.recent(0) && !rx.recent(0xFF_FFFF - 300));
    }

    /// The sender gave up on the packet at its floor and the ones after were acknowledged:
    /// its floor jumped by up to 255 PSNs, and if the first packets carrying the new floor
    /// were lost, the next ones arrive beyond `cum + 256` during traffic (no resync). A
    /// consistent floor that moves the window by at most 256 takes them in; one further
    /// ahead, or a PSN a window past its floor, still does not.
    #[test]
    fn rx_takes_a_packet_its_floor_brings_into_the_window() {
        let t0 = Instant::now();
        let quiet = Duration::from_millis(1);
        let mut rx = PathRx::new(1);
        rx.mark(1);
        rx.on_new(t0);
        assert_eq!(rx.cum, 1);
        assert_eq!(rx.check(259, 258, t0, quiet), RxCheck::Ok);
        assert_eq!(rx.check(512, 258, t0, quiet), RxCheck::Ok);
        assert_eq!(rx.check(260, 259, t0, quiet), RxCheck::OutOfWindow);
        assert_eq!(rx.check(514, 258, t0, quiet), RxCheck::OutOfWindow);
        assert_eq!(rx.cum, 1, "check moves nothing");
        rx.apply_floor(258);
        assert_eq!(rx.cum, 257);
        assert_eq!(rx.classify(512), RxClass::New);
    }

    #[test]
    fn the_ack_delay_comes_off_the_sample_but_never_below_the_minimum() {
        let t0 = Instant::now();
        let mut p = tx(0, 1000, t0);
        let us = Duration::from_micros;
        for k in 0..3u32 {
            p.on_sent(SegRef { op: 0, seg: k }, t0 + us(100 * u64::from(k)), false);
        }
        // 50 µs measured, 30 of them held by the peer: a 20 µs sample.
        let out = p.on_ack_delayed(t0 + us(50), 0, &[0; 32], Some(us(50)), us(30), 0, 0);
        assert!(out.rtt_sampled);
        assert_eq!(p.rtt.latest(), Some(us(20)));
        // A (forged) delay that would take the sample below the minimum RTT (20 µs) is
        // not subtracted at all.
        let out = p.on_ack_delayed(t0 + us(130), 1, &[0; 32], Some(us(30)), us(25), 0, 0);
        assert!(out.rtt_sampled);
        assert_eq!(p.rtt.latest(), Some(us(30)));
        assert_eq!(p.rtt.min(), Some(us(20)));
        // 40 µs measured, 15 held: 25 µs, above the minimum.
        let out = p.on_ack_delayed(t0 + us(240), 2, &[0; 32], Some(us(40)), us(15), 0, 0);
        assert!(out.rtt_sampled);
        assert_eq!(p.rtt.latest(), Some(us(25)));
        // The delay is applied after the send-time check: an echo outside the packet's
        // send times takes no sample, whatever delay it reports.
        p.on_sent(SegRef { op: 0, seg: 3 }, t0 + us(300), false);
        let out = p.on_ack_delayed(t0 + us(320), 3, &[0; 32], Some(us(900)), us(880), 0, 0);
        assert!(!out.rtt_sampled);
        assert_eq!(p.rtt.latest(), Some(us(25)));
    }

    /// The send-time bounds of an ACK that newly acknowledges several packets are exactly
    /// `now` minus the newest and the oldest send time (the lower one is read through
    /// RACK.rtt, which this ACK moved to the newest packet).
    #[test]
    fn rtt_sample_bounds_of_a_multi_packet_ack() {
        let us = Duration::from_micros;
        let run = |sample: u64| {
            let t0 = Instant::now();
            let mut p = tx(0, 1000, t0);
            for k in 0..3u32 {
                p.on_sent(SegRef { op: 0, seg: k }, t0 + us(10 * u64::from(k)), false);
            }
            // PSNs 0 to 2 (sent at +0, +10, +20) acknowledged at +100: bounds 80..=100 µs.
            let out = p.on_ack(t0 + us(100), 2, &[0; 32], Some(us(sample)), 0, 0);
            assert_eq!(out.acked.len(), 3);
            assert_eq!(p.rack_rtt, us(80));
            out.rtt_sampled
        };
        assert!(!run(79), "below now - newest");
        assert!(run(80), "at now - newest");
        assert!(run(100), "at now - oldest");
        assert!(!run(101), "above now - oldest");
    }

    #[test]
    fn rtt_sample_only_from_newly_acked_packets_within_their_send_times() {
        let t0 = Instant::now();
        let mut p = tx(0, 1000, t0);
        let us = Duration::from_micros;
        p.on_sent(SegRef { op: 0, seg: 0 }, t0, false);
        p.on_sent(SegRef { op: 0, seg: 1 }, t0 + us(10), false);
        let srtt0 = p.rtt.smoothed();
        // Echo older than the oldest newly acked packet: no sample.
        let out = p.on_ack(t0 + us(50), 0, &[0; 32], Some(us(5000)), 0, 0);
        assert_eq!(out.acked.len(), 1);
        assert!(!out.rtt_sampled);
        assert_eq!(p.rtt.smoothed(), srtt0);
        // Within the send times: taken.
        let out = p.on_ack(t0 + us(50), 1, &[0; 32], Some(us(40)), 0, 0);
        assert!(out.rtt_sampled);
        assert_eq!(p.rtt.smoothed(), us(40));
        // A duplicate ACK newly acknowledges nothing: no sample.
        let out = p.on_ack(t0 + us(9000), 1, &[0; 32], Some(us(9000)), 0, 0);
        assert!(!out.rtt_sampled && out.acked.is_empty() && !out.invalid);
        assert_eq!(p.rtt.smoothed(), us(40));
        // Cumulative PSN never sent: dropped; SACK bit beyond next_psn: ignored.
        p.on_sent(SegRef { op: 0, seg: 2 }, t0 + us(60), false);
        assert!(
            p.on_ack(t0 + us(70), 3, &[0; 32], Some(us(10)), 0, 0)
                .invalid
        );
        assert!(
            p.on_ack(t0 + us(70), 0xFF_FFF0, &[0; 32], None, 0, 0)
                .invalid
        );
        let mut sack = [0u8; 32];
        sack[0] = 0x40; // PSN 3: never sent
        let out = p.on_ack(t0 + us(70), 1, &sack, None, 0, 0);
        assert!(!out.invalid && out.ignored_unsent && out.acked.is_empty());
        assert_eq!(p.outstanding, 1);
    }

    #[test]
    fn rx_window_wraps_at_2_pow_24() {
        let mut rx = PathRx::new(0xFF_FFFE);
        for psn in [0xFF_FFFE, 0xFF_FFFF, 0, 1] {
            assert_eq!(rx.classify(psn), RxClass::New);
            rx.mark(psn);
        }
        assert_eq!(rx.cum, 1);
        rx.mark(70);
        rx.mark(200);
        assert_eq!(rx.cum, 1);
        for psn in 2..70 {
            rx.mark(psn);
        }
        assert_eq!(rx.cum, 70);
        assert_eq!(rx.classify(200), RxClass::Duplicate);
    }
}

/// The plane of a local UDP source port in a multi-plane fabric of `planes` planes:
/// `port mod planes` (0 when `planes <= 1`). A deployment makes this true by sending each
/// source port through the matching local interface or address (see
/// [`TransportConfig::planes`](crate::TransportConfig::planes)).
pub(crate) fn plane_of(port: u16, planes: u16) -> u8 {
    if planes <= 1 {
        0
    } else {
        (port % planes) as u8
    }
}

/// Source ports for `paths` paths out of `ports`, spread evenly over the planes: path `i`
/// gets the first unused port of plane `i mod planes` (or, when that plane has no port
/// left, the first unused port at all). With one plane this is `ports[..paths]`.
pub(crate) fn assign_ports(ports: &[u16], paths: usize, planes: u16) -> Vec<u16> {
    if planes <= 1 {
        return ports.iter().copied().take(paths).collect();
    }
    let mut used = vec![false; ports.len()];
    let mut out = Vec::with_capacity(paths);
    for i in 0..paths.min(ports.len()) {
        let want = (i % planes as usize) as u8;
        let k = (0..ports.len())
            .find(|&k| !used[k] && plane_of(ports[k], planes) == want)
            .or_else(|| (0..ports.len()).find(|&k| !used[k]))
            .expect("fewer paths than ports");
        used[k] = true;
        out.push(ports[k]);
    }
    out
}

/// ECMP collision detection of one connection (in the spirit of PLB, Protective Load
/// Balancing, SIGCOMM 2022, which re-rolls a flow's entropy on persistent congestion).
///
/// Paths that hash onto the same bottleneck link split it between their windows, so a
/// path's delivery rate is about `link / k` when `k` of the connection's paths share its
/// link, and a whole link when it is alone. Where every link is a bottleneck, every path
/// sees queueing and ECN, so congestion itself says nothing; the relative rate does. The
/// connection measures, over intervals of `rebalance_interval_rtts` smoothed RTTs (and at
/// least `rebalance_min_packets` packets acknowledged on its fastest path), how many
/// packets each path got acknowledged. An interval counts only if the connection was
/// window-limited throughout (it always had data to send when a window opened) and every
/// working path stayed active (no timeout). A path whose count stays below
/// `rebalance_ratio_permille`‰ of the fastest path's for `rebalance_rounds` counted
/// intervals in a row is moved to a new source port — the slowest such path, one per
/// interval — and the 2^(n/2) intervals after the `n`-th move (at most 64) are not
/// counted, so that the windows settle and moves get rarer when they do not bring the
/// paths level.
/// The connection moves at most `rebalance_max_rerolls` paths this way in its lifetime.
#[derive(Debug, Clone, Default)]
pub(crate) struct Rebalance {
    /// Start of the current interval, `None` before the first.
    start: Option<Instant>,
    /// Every path's `packets_acked` at the start of the interval.
    base: Vec<u64>,
    /// Counted intervals in a row in which each path was slow.
    slow_rounds: Vec<u32>,
    /// The connection ran out of data to send with a window open during this interval.
    pub app_limited: bool,
    /// Intervals still to skip (after a move).
    skip: u32,
    /// Moves decided so far (for the budget and the back-off).
    rerolls: u64,
}

/// What [`Rebalance::on_ack`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RebalanceMove {
    /// Path to move.
    pub path: usize,
    /// Its packets acknowledged in the interval.
    pub acked: u64,
    /// The fastest path's packets acknowledged in the interval.
    pub max_acked: u64,
}

/// Thresholds of [`Rebalance`] (from [`TransportConfig`](crate::TransportConfig)).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RebalanceConfig {
    pub ratio_permille: u32,
    pub interval_rtts: u32,
    pub min_packets: u32,
    pub rounds: u32,
    pub max_rerolls: u32,
}

impl Rebalance {
    fn restart(&mut self, now: Instant, tx: &[PathTx]) {
        self.start = Some(now);
        self.base.clear();
        self.base.extend(tx.iter().map(|p| p.stats.packets_acked));
        self.slow_rounds.resize(tx.len(), 0);
        self.app_limited = false;
    }

    /// Called after every ACK: closes the interval when it is long enough and returns the
    /// path to move, if any.
    pub fn on_ack(
        &mut self,
        now: Instant,
        tx: &[PathTx],
        cfg: &RebalanceConfig,
    ) -> Option<RebalanceMove> {
        if cfg.ratio_permille == 0 || tx.len() < 2 || self.rerolls >= cfg.max_rerolls as u64 {
            return None;
        }
        let Some(start) = self.start.filter(|_| self.base.len() == tx.len()) else {
            self.restart(now, tx);
            return None;
        };
        let srtt = tx
            .iter()
            .filter(|p| p.state != PathState::Failed)
            .map(|p| p.rtt.smoothed())
            .max()?;
        if now.saturating_duration_since(start) < srtt * cfg.interval_rtts.max(1) {
            return None;
        }
        // Packets acknowledged per path since the interval began (no list built: this
        // runs on every ACK).
        let base = &self.base;
        let acked = |i: usize| tx[i].stats.packets_acked.saturating_sub(base[i]);
        let max_acked = (0..tx.len()).map(acked).max().unwrap_or(0);
        if max_acked < cfg.min_packets.max(1) as u64 {
            return None; // keep measuring
        }
        let counted = !self.app_limited
            && self.skip == 0
            && tx
                .iter()
                .all(|p| matches!(p.state, PathState::Active | PathState::Failed));
        self.skip = self.skip.saturating_sub(1);
        if !counted {
            self.restart(now, tx);
            return None;
        }
        let mut pick: Option<(usize, u64)> = None;
        self.slow_rounds.resize(tx.len(), 0);
        for (i, p) in tx.iter().enumerate() {
            let a = acked(i);
            let slow =
                p.state == PathState::Active && a * 1000 < max_acked * cfg.ratio_permille as u64;
            self.slow_rounds[i] = if slow { self.slow_rounds[i] + 1 } else { 0 };
            if slow && self.slow_rounds[i] >= cfg.rounds.max(1) && pick.is_none_or(|(_, b)| a < b) {
                pick = Some((i, a));
            }
        }
        self.restart(now, tx);
        let (i, acked_i) = pick?;
        self.slow_rounds.iter_mut().for_each(|r| *r = 0);
        self.rerolls += 1;
        // Back off: the n-th move is followed by 2^(n/2) uncounted intervals (1, 2, 2, 4,
        // 4, 8, ... at most 64), so that the windows settle, the first moves (a move lands
        // on a given unused link with probability 1/links, so finding it can take several)
        // come quickly, and a connection whose paths cannot be brought level (uneven
        // sharing, noise) slows its churn.
        self.skip = 1u32 << (self.rerolls / 2).min(6);
        Some(RebalanceMove {
            path: i,
            acked: acked_i,
            max_acked,
        })
    }
}

/// Per-connection view of the planes of a multi-plane fabric (MetaRoCE "paths grouped by
/// plane"): which planes lost every path that was on them, so that re-rolled paths go to
/// the healthy planes, and when a plane that went down may be tried again.
#[derive(Debug, Clone)]
pub(crate) struct Planes {
    /// Plane count (1: no planes).
    pub count: u16,
    /// When each plane was found down (every path on it timed out without progress since),
    /// `None` while it is considered healthy.
    pub down_since: Vec<Option<Instant>>,
    /// When a path was last moved back onto a down plane to probe it.
    pub last_probe: Option<Instant>,
}

impl Planes {
    pub fn new(count: u16) -> Self {
        Self {
            count: count.max(1),
            down_since: vec![None; count.max(1) as usize],
            last_probe: None,
        }
    }

    /// Path counts per plane of the given paths (failed ones left out).
    pub fn load(&self, paths: &[PathTx]) -> Vec<usize> {
        let mut load = vec![0; self.count as usize];
        for p in paths.iter().filter(|p| p.state != PathState::Failed) {
            load[plane_of(p.src_port, self.count) as usize] += 1;
        }
        load
    }

    /// Path `i` timed out repeatedly and is being re-rolled: if no other path on its plane
    /// is carrying traffic, the plane is marked down.
    pub fn on_path_timeouts(&mut self, now: Instant, paths: &[PathTx], i: usize) {
        if self.count <= 1 {
            return;
        }
        let plane = plane_of(paths[i].src_port, self.count);
        let healthy_peer = paths.iter().enumerate().any(|(k, p)| {
            k != i && p.state == PathState::Active && plane_of(p.src_port, self.count) == plane
        });
        let d = &mut self.down_since[plane as usize];
        if !healthy_peer && d.is_none() {
            tracing::warn!(plane, "plane down: every path on it timed out");
            *d = Some(now);
        }
    }

    /// A path on this port made progress: its plane works.
    pub fn on_progress(&mut self, port: u16) {
        if self.count <= 1 {
            return;
        }
        let plane = plane_of(port, self.count) as usize;
        if self.down_since[plane].take().is_some() {
            tracing::info!(plane, "plane up again: a path on it made progress");
        }
    }

    /// The plane a re-rolled path should move to: among the planes not marked down, the
    /// one with the fewest paths (ties: the lowest number after `avoid`, so that a path
    /// leaves its plane when another is as good). When every plane is down, the one down
    /// the longest (it is probed).
    pub fn pick(&self, load: &[usize], avoid: u8) -> u8 {
        let n = self.count as usize;
        let order = (1..=n).map(|k| (avoid as usize + k) % n);
        let healthy = order
            .clone()
            .filter(|&p| self.down_since[p].is_none())
            .min_by_key(|&p| load[p]);
        match healthy {
            Some(p) => p as u8,
            None => order.min_by_key(|&p| self.down_since[p]).unwrap_or(0) as u8,
        }
    }
}

#[cfg(test)]
mod plane_tests {
    use super::*;

    #[test]
    fn ports_spread_over_planes() {
        let ports: Vec<u16> = (0xC000..0xC000 + 32).collect();
        let got = assign_ports(&ports, 8, 4);
        let planes: Vec<u8> = got.iter().map(|&p| plane_of(p, 4)).collect();
        assert_eq!(planes, vec![0, 1, 2, 3, 0, 1, 2, 3]);
        // Ports not in order: still one path per plane in turn.
        let shuffled: Vec<u16> = vec![8, 12, 16, 1, 5, 2, 3, 7];
        let got = assign_ports(&shuffled, 4, 4);
        let planes: Vec<u8> = got.iter().map(|&p| plane_of(p, 4)).collect();
        assert_eq!(planes, vec![0, 1, 2, 3]);
        assert_eq!(assign_ports(&ports, 3, 1), vec![0xC000, 0xC001, 0xC002]);
    }

    #[test]
    fn pick_prefers_healthy_least_loaded_plane() {
        let now = Instant::now();
        let mut p = Planes::new(4);
        assert_eq!(p.pick(&[2, 2, 1, 2], 0), 2);
        p.down_since[2] = Some(now);
        assert_ne!(p.pick(&[2, 2, 0, 2], 0), 2, "a down plane is avoided");
        for d in &mut p.down_since {
            d.get_or_insert(now);
        }
        p.down_since[1] = Some(now - Duration::from_millis(5));
        assert_eq!(p.pick(&[0, 0, 0, 0], 0), 1, "all down: probe the oldest");
    }
}
