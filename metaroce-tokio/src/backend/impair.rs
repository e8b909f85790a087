//! [`Impaired`]: a network-impairment layer over any [`DatagramBackend`].
//!
//! Impairments apply on the **send** side, per datagram (a GSO transmit is split into its
//! datagrams, each with its own random draws). Every decision comes from a seeded
//! `Xoshiro256PlusPlus`, with a fixed number of draws per datagram: the same sequence of sends
//! with the same [`Impairment`] yields the same decisions, and changing one probability does
//! not shift the random stream seen by the others.
//!
//! Surviving datagrams that need no hold (no delay, jitter or rate limit, not reordered, and
//! nothing held for their destination) are sent at once from `poll_send` through the inner
//! backend, the survivors of a GSO transmit re-batched into GSO transmits. The others go to
//! a queue ordered by due time; a task spawned by [`Impaired::new`] sends them through the
//! inner backend, one datagram per send, when they are due (so held datagrams go out even if
//! the application sends nothing more).

use metaroce::fasthash::HashMap;
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use metaroce::{ConfigError, EcnCodepoint};
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{check_transmit, unknown_src_port, DatagramBackend};

/// Longest accepted `delay`, `jitter` or `reorder_delay`: one hour.
const MAX_DURATION: Duration = Duration::from_secs(3600);

/// Cap on the bytes a rate-limited delay line may add to the held-bytes budget: 1 GiB.
const MAX_DELAY_LINE_BYTES: u128 = 1 << 30;

/// Gilbert–Elliott two-state burst-loss model.
///
/// Before each datagram the channel changes state (good → bad with `p_good_to_bad`, bad →
/// good with `p_bad_to_good`); in the bad state the datagram is lost with `loss_in_bad`. The
/// good state adds no loss of its own (independent loss is [`Impairment::loss`]). Mean burst
/// length is `1 / p_bad_to_good` datagrams. All fields are probabilities in `[0, 1]`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GilbertElliott {
    /// Probability of moving from the good to the bad state, per datagram.
    pub p_good_to_bad: f64,
    /// Probability of moving from the bad back to the good state, per datagram.
    pub p_bad_to_good: f64,
    /// Probability that a datagram is lost while the channel is in the bad state.
    pub loss_in_bad: f64,
}

/// What [`Impaired`] does to each outgoing datagram. All probabilities are per datagram, in
/// `[0, 1]`; [`Impairment::default`] impairs nothing.
///
/// Per datagram, in order: independent and burst loss; corruption; CE re-marking; the rate
/// limit (bottleneck queue); then the datagram leaves after `delay` plus jitter (plus
/// `reorder_delay` if picked for reordering), duplicated if picked.
#[derive(Debug, Clone, PartialEq)]
pub struct Impairment {
    /// Probability that a datagram is dropped, independently of the others.
    pub loss: f64,
    /// Optional Gilbert–Elliott burst loss, in addition to `loss`.
    pub burst: Option<GilbertElliott>,
    /// Probability that a datagram is sent twice (the copy leaves right after the original).
    pub duplicate: f64,
    /// Probability that a datagram is held back an extra `reorder_delay`, so that datagrams
    /// sent after it overtake it.
    pub reorder: f64,
    /// Extra hold of a reordered datagram. Must be non-zero when `reorder > 0`.
    pub reorder_delay: Duration,
    /// Constant one-way delay added to every datagram.
    pub delay: Duration,
    /// Uniformly random extra delay in `[0, jitter)` per datagram (which may itself reorder).
    pub jitter: Duration,
    /// Probability that one random byte of the datagram is changed (XOR with a random
    /// non-zero mask): the copy sent differs from the original in exactly one byte.
    pub corrupt: f64,
    /// Probability that an ECN-capable (ECT(0)/ECT(1)) datagram is re-marked CE; Not-ECT
    /// datagrams are never marked.
    pub ce_mark: f64,
    /// Bottleneck rate in bits per second (UDP payload bits): each datagram occupies the
    /// link for `8 × len / rate` seconds; datagrams arriving while it is busy wait in a FIFO
    /// holding at most `queue_limit_bytes` (tail drop beyond). `None`: unlimited.
    pub rate_limit_bps: Option<u64>,
    /// Bytes the bottleneck queue holds before tail-dropping; without a rate limit, bytes of
    /// held (delayed / reordered / not yet sent) datagrams before dropping. Bounds memory.
    /// Default 16 MiB; must be non-zero.
    pub queue_limit_bytes: usize,
    /// With a rate limit: ECN-capable datagrams that find at least this many bytes queued
    /// ahead of them at the bottleneck are re-marked CE (DCTCP/DCQCN-style step marking at a
    /// switch queue threshold). `None`: no queue-based marking.
    pub ce_threshold_bytes: Option<usize>,
    /// Seed of the random decisions.
    pub seed: u64,
}

impl Default for Impairment {
    fn default() -> Self {
        Self {
            loss: 0.0,
            burst: None,
            duplicate: 0.0,
            reorder: 0.0,
            reorder_delay: Duration::ZERO,
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            corrupt: 0.0,
            ce_mark: 0.0,
            rate_limit_bps: None,
            queue_limit_bytes: 16 << 20,
            ce_threshold_bytes: None,
            seed: 0,
        }
    }
}

fn check_probability(name: &'static str, p: f64) -> Result<(), ConfigError> {
    if (0.0..=1.0).contains(&p) {
        Ok(())
    } else {
        Err(ConfigError::new(
            name,
            format!("must be a probability in [0, 1], got {p}"),
        ))
    }
}

fn check_duration(name: &'static str, d: Duration) -> Result<(), ConfigError> {
    if d <= MAX_DURATION {
        Ok(())
    } else {
        Err(ConfigError::new(
            name,
            format!("must be at most {MAX_DURATION:?}, got {d:?}"),
        ))
    }
}

impl Impairment {
    /// Checks the parameters: probabilities in `[0, 1]` (NaN rejected), durations at most one
    /// hour, `reorder_delay > 0` when `reorder > 0`, a non-zero rate limit and queue limit.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field (`loss`, `burst.loss_in_bad`, `reorder_delay`, ...)
    /// and the rule it breaks.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_probability("loss", self.loss)?;
        check_probability("duplicate", self.duplicate)?;
        check_probability("reorder", self.reorder)?;
        check_probability("corrupt", self.corrupt)?;
        check_probability("ce_mark", self.ce_mark)?;
        if let Some(ge) = &self.burst {
            check_probability("burst.p_good_to_bad", ge.p_good_to_bad)?;
            check_probability("burst.p_bad_to_good", ge.p_bad_to_good)?;
            check_probability("burst.loss_in_bad", ge.loss_in_bad)?;
        }
        check_duration("delay", self.delay)?;
        check_duration("jitter", self.jitter)?;
        check_duration("reorder_delay", self.reorder_delay)?;
        if self.reorder > 0.0 && self.reorder_delay.is_zero() {
            return Err(ConfigError::new(
                "reorder_delay",
                "must be non-zero when reorder > 0",
            ));
        }
        if self.rate_limit_bps == Some(0) {
            return Err(ConfigError::new(
                "rate_limit_bps",
                "must be non-zero (use None for no limit)",
            ));
        }
        if self.queue_limit_bytes == 0 {
            return Err(ConfigError::new("queue_limit_bytes", "must be non-zero"));
        }
        Ok(())
    }

    /// Most bytes that may be held at once (bounds memory): the queue limit, plus, with a rate
    /// limit, what the link can push into the delay line during the longest delay (capped at
    /// 1 GiB), doubled for duplicates.
    fn held_cap(&self) -> usize {
        let line = match self.rate_limit_bps {
            Some(bps) => {
                let max_delay = self.delay + self.jitter + self.reorder_delay;
                (u128::from(bps) * max_delay.as_nanos() / 8_000_000_000).min(MAX_DELAY_LINE_BYTES)
            }
            None => 0,
        };
        let line = usize::try_from(line).unwrap_or(usize::MAX);
        self.queue_limit_bytes
            .saturating_add(line)
            .saturating_mul(2)
    }
}

/// Why an [`Impaired`] backend could not be built or reconfigured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ImpairError {
    /// [`Impairment::validate`] rejected the parameters: which field, and the rule (part of
    /// this error's `Display`, so not also its `source()`).
    #[error("invalid impairment: {0}")]
    Invalid(ConfigError),
    /// [`Impaired::new`] was called outside a tokio runtime (it spawns its sender task).
    #[error("Impaired::new must be called within a tokio runtime")]
    NoRuntime,
}

/// Counters of an [`Impaired`] backend, in datagrams (except `held_bytes`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImpairStats {
    /// Datagrams handed to `poll_send` (GSO transmits count each segment).
    pub seen: u64,
    /// Dropped by random loss (independent or burst).
    pub dropped: u64,
    /// Dropped because the bottleneck queue or the held-bytes budget was full.
    pub queue_dropped: u64,
    /// Extra copies scheduled by `duplicate`.
    pub duplicated: u64,
    /// Held back by `reorder`.
    pub reordered: u64,
    /// Had one byte changed.
    pub corrupted: u64,
    /// Re-marked CE (randomly or by the queue threshold).
    pub ce_marked: u64,
    /// Scheduled to leave later than when they were sent (delay, jitter, reorder or rate).
    pub delayed: u64,
    /// Handed successfully to the inner backend (copies included).
    pub sent: u64,
    /// Inner-backend send errors (those datagrams are lost).
    pub send_errors: u64,
    /// Datagrams currently held, waiting to be sent.
    pub held_datagrams: u64,
    /// Bytes currently held.
    pub held_bytes: u64,
}

/// A datagram waiting in the delay line.
struct Held {
    due: Instant,
    seq: u64,
    destination: SocketAddr,
    src_port: u16,
    ecn: Option<EcnCodepoint>,
    bytes: Vec<u8>,
}

impl PartialEq for Held {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Held {}

impl PartialOrd for Held {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Held {
    /// Reversed, so that `BinaryHeap` pops the earliest due (FIFO among equal due times).
    fn cmp(&self, other: &Self) -> Ordering {
        (other.due, other.seq).cmp(&(self.due, self.seq))
    }
}

/// The random numbers drawn for every datagram, whatever the configuration.
struct Draws {
    loss: f64,
    ge_transition: f64,
    ge_loss: f64,
    duplicate: f64,
    reorder: f64,
    jitter: u64,
    corrupt: f64,
    corrupt_pos: u64,
    corrupt_mask: u64,
    ce: f64,
}

/// A uniform float in `[0, 1)` from the top 53 bits.
fn unit(x: u64) -> f64 {
    (x >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// `x / 2^64 × n`, a uniform integer in `[0, n)` for uniform `x`.
fn scale(x: u64, n: u128) -> u128 {
    (u128::from(x) * n) >> 64
}

impl Draws {
    fn new(rng: &mut Xoshiro256PlusPlus) -> Self {
        Self {
            loss: unit(rng.next_u64()),
            ge_transition: unit(rng.next_u64()),
            ge_loss: unit(rng.next_u64()),
            duplicate: unit(rng.next_u64()),
            reorder: unit(rng.next_u64()),
            jitter: rng.next_u64(),
            corrupt: unit(rng.next_u64()),
            corrupt_pos: rng.next_u64(),
            corrupt_mask: rng.next_u64(),
            ce: unit(rng.next_u64()),
        }
    }
}

/// The fate of a datagram that survived loss and the queue limits.
#[derive(Debug, Clone, Copy)]
struct Survivor {
    ecn: Option<EcnCodepoint>,
    /// Byte to change: position in the datagram and XOR mask.
    corrupt: Option<(usize, u8)>,
    /// 1, or 2 when duplicated.
    copies: usize,
    due: Instant,
    /// Sent at once by `poll_send` rather than through the delay line.
    inline: bool,
}

struct State {
    imp: Impairment,
    held_cap: usize,
    rng: Xoshiro256PlusPlus,
    /// Gilbert–Elliott channel state.
    bad: bool,
    /// When the bottleneck link finishes sending what it has accepted.
    link_free_at: Option<Instant>,
    queue: BinaryHeap<Held>,
    /// Held datagrams not yet in `queue`: they follow inline datagrams of the same
    /// `poll_send`, and join the queue once those are sent so that they cannot overtake them.
    deferred: Vec<Held>,
    /// Per destination, datagrams in `queue` or `deferred` or being sent by the sender task.
    /// A datagram only goes inline when its destination has none (so it cannot overtake a
    /// held one that is already due); destinations with none have no entry.
    outstanding: HashMap<SocketAddr, usize>,
    held_bytes: usize,
    next_seq: u64,
    stats: ImpairStats,
    closed: bool,
}

fn is_ect(ecn: Option<EcnCodepoint>) -> bool {
    matches!(ecn, Some(EcnCodepoint::Ect0 | EcnCodepoint::Ect1))
}

impl State {
    fn new(imp: Impairment) -> Self {
        Self {
            rng: Xoshiro256PlusPlus::seed_from_u64(imp.seed),
            held_cap: imp.held_cap(),
            imp,
            bad: false,
            link_free_at: None,
            queue: BinaryHeap::new(),
            deferred: Vec::new(),
            outstanding: HashMap::default(),
            held_bytes: 0,
            next_seq: 0,
            stats: ImpairStats::default(),
            closed: false,
        }
    }

    /// Whether datagrams to `destination` may currently skip the delay line (if not picked
    /// for reordering): no delay, jitter or rate limit configured, and nothing held for it.
    fn inline_allowed(&self, destination: &SocketAddr) -> bool {
        self.imp.delay.is_zero()
            && self.imp.jitter.is_zero()
            && self.imp.rate_limit_bps.is_none()
            && !self.outstanding.contains_key(destination)
    }

    /// Draws the fate of one datagram of `len` bytes sent at `now` with ECN `ecn`, updating
    /// the counters. `None`: dropped. With `inline_ok` (see [`Self::inline_allowed`]), a
    /// datagram that needs no hold is marked `inline` and is not charged to the held budget.
    fn decide(
        &mut self,
        now: Instant,
        ecn: Option<EcnCodepoint>,
        len: usize,
        inline_ok: bool,
    ) -> Option<Survivor> {
        self.stats.seen += 1;
        let d = Draws::new(&mut self.rng);
        let imp = &self.imp;

        let mut lost = d.loss < imp.loss;
        if let Some(ge) = &imp.burst {
            self.bad = if self.bad {
                d.ge_transition >= ge.p_bad_to_good
            } else {
                d.ge_transition < ge.p_good_to_bad
            };
            lost |= self.bad && d.ge_loss < ge.loss_in_bad;
        }
        if lost {
            self.stats.dropped += 1;
            return None;
        }

        let copies = if d.duplicate < imp.duplicate { 2 } else { 1 };
        let reordered = d.reorder < imp.reorder;
        let inline = inline_ok
            && !reordered
            && imp.delay.is_zero()
            && imp.jitter.is_zero()
            && imp.rate_limit_bps.is_none();
        if !inline && self.held_bytes.saturating_add(len * copies) > self.held_cap {
            self.stats.queue_dropped += 1;
            return None;
        }

        let mut ecn = ecn;
        let mut ce_marked = false;
        if is_ect(ecn) && d.ce < imp.ce_mark {
            ecn = Some(EcnCodepoint::Ce);
            ce_marked = true;
        }

        // Bottleneck link: serialise after whatever it already accepted.
        let mut depart = now;
        if let Some(bps) = imp.rate_limit_bps {
            let start = self.link_free_at.map_or(now, |t| t.max(now));
            let backlog = u128::from(bps) * start.duration_since(now).as_nanos() / 8_000_000_000;
            let backlog = usize::try_from(backlog).unwrap_or(usize::MAX);
            if backlog.saturating_add(len) > imp.queue_limit_bytes {
                self.stats.queue_dropped += 1;
                return None;
            }
            if let Some(threshold) = imp.ce_threshold_bytes {
                if backlog >= threshold && is_ect(ecn) {
                    ecn = Some(EcnCodepoint::Ce);
                    ce_marked = true;
                }
            }
            let nanos = (len as u128 * 8_000_000_000).div_ceil(u128::from(bps));
            let tx = Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX));
            let Some(end) = start.checked_add(tx) else {
                self.stats.queue_dropped += 1;
                return None;
            };
            self.link_free_at = Some(end);
            depart = end;
        }

        let jitter = scale(d.jitter, imp.jitter.as_nanos());
        let jitter = Duration::from_nanos(u64::try_from(jitter).unwrap_or(u64::MAX));
        let mut hold = imp.delay + jitter;
        if reordered {
            hold += imp.reorder_delay;
        }
        let Some(due) = depart.checked_add(hold) else {
            self.stats.queue_dropped += 1;
            return None;
        };

        let mut corrupt = None;
        if d.corrupt < imp.corrupt && len > 0 {
            let pos = scale(d.corrupt_pos, len as u128) as usize;
            let mask = 1 + (d.corrupt_mask % 255) as u8;
            corrupt = Some((pos, mask));
            self.stats.corrupted += 1;
        }

        self.stats.ce_marked += u64::from(ce_marked);
        self.stats.reordered += u64::from(reordered);
        self.stats.delayed += u64::from(due > now);
        self.stats.duplicated += u64::from(copies == 2);
        Some(Survivor {
            ecn,
            corrupt,
            copies,
            due,
            inline,
        })
    }

    /// Puts a surviving datagram (and its copy) in the delay line: in `deferred` when
    /// `defer`, else straight into the queue.
    fn hold(&mut self, transmit: &metaroce::Transmit, datagram: &[u8], s: &Survivor, defer: bool) {
        let mut bytes = datagram.to_vec();
        if let Some((pos, mask)) = s.corrupt {
            if let Some(b) = bytes.get_mut(pos) {
                *b ^= mask;
            }
        }
        self.held_bytes += bytes.len() * s.copies;
        *self.outstanding.entry(transmit.destination).or_insert(0) += s.copies;
        let make = |bytes| Held {
            due: s.due,
            seq: 0,
            destination: transmit.destination,
            src_port: transmit.src_port,
            ecn: s.ecn,
            bytes,
        };
        // A copy shares the original's due time: the two leave back to back.
        let copy = (s.copies == 2).then(|| make(bytes.clone()));
        for held in copy.into_iter().chain([make(bytes)]) {
            if defer {
                self.deferred.push(held);
            } else {
                self.enqueue(held);
            }
        }
    }

    fn enqueue(&mut self, mut held: Held) {
        held.seq = self.next_seq;
        self.next_seq += 1;
        self.queue.push(held);
    }

    /// Moves the deferred datagrams into the queue; whether there were any.
    fn flush_deferred(&mut self) -> bool {
        if self.deferred.is_empty() {
            return false;
        }
        let mut deferred = std::mem::take(&mut self.deferred);
        for held in deferred.drain(..) {
            self.enqueue(held);
        }
        // Keep the allocation for next time.
        self.deferred = deferred;
        true
    }

    /// The sender task is done with one held datagram to `destination`.
    fn release(&mut self, destination: &SocketAddr) {
        if let Some(n) = self.outstanding.get_mut(destination) {
            *n -= 1;
            if *n == 0 {
                self.outstanding.remove(destination);
            }
        }
    }

    /// Applies the impairments to one datagram sent at `now`, queueing what survives (the
    /// delay-line-only behaviour, without the inline path).
    #[cfg(test)]
    fn impair(&mut self, now: Instant, transmit: &metaroce::Transmit, datagram: &[u8]) {
        if let Some(s) = self.decide(now, transmit.ecn, datagram.len(), false) {
            self.hold(transmit, datagram, &s, false);
        }
    }

    fn snapshot(&self) -> ImpairStats {
        ImpairStats {
            held_datagrams: (self.queue.len() + self.deferred.len()) as u64,
            held_bytes: self.held_bytes as u64,
            ..self.stats
        }
    }
}

struct Shared {
    state: Mutex<State>,
    wake: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A datagram of the current transmit that goes inline: where it is in the contents, and
/// what happens to it.
#[derive(Debug, Clone, Copy)]
struct Piece {
    start: usize,
    len: usize,
    ecn: Option<EcnCodepoint>,
    corrupt: Option<(usize, u8)>,
    copies: usize,
}

/// One send to the inner backend: `count` datagrams (GSO when more than one) of
/// `Job::stride` bytes, the last `last_len`, all with the same ECN.
#[derive(Debug, Clone, Copy)]
struct Op {
    ecn: Option<EcnCodepoint>,
    /// The bytes are `scratch[start..start + len]` if set, else `contents[start..start + len]`.
    in_scratch: bool,
    start: usize,
    len: usize,
    count: usize,
    last_len: usize,
}

/// Identifies the transmit of a job suspended after `Pending`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ResumeKey {
    transmit: metaroce::Transmit,
    fingerprint: u64,
}

/// Bytes of `contents` hashed per [`FINGERPRINT_STRIDE`] bytes by [`ResumeKey::new`].
const FINGERPRINT_SAMPLE: usize = 32;
/// Spacing of the hashed samples.
const FINGERPRINT_STRIDE: usize = 1024;

impl ResumeKey {
    fn new(transmit: &metaroce::Transmit, contents: &[u8]) -> Self {
        // FNV-1a over samples (the first 32 bytes of every KiB, and the last 32): only meant
        // to notice a caller that gives a transmit up after `Pending` (packets differ in their
        // headers), at a small fraction of the cost of hashing everything on each `Pending`.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let tail = &contents[contents.len().saturating_sub(FINGERPRINT_SAMPLE)..];
        let samples = contents
            .chunks(FINGERPRINT_STRIDE)
            .map(|c| &c[..c.len().min(FINGERPRINT_SAMPLE)])
            .chain([tail]);
        for sample in samples {
            for &b in sample {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        Self {
            transmit: *transmit,
            fingerprint: h,
        }
    }
}

/// Scratch capacity kept between transmits; a larger buffer is freed after use.
const SCRATCH_KEEP: usize = 1 << 20;

/// The inline part of the transmit being sent, kept across `Pending` (all buffers are
/// reused from one transmit to the next).
#[derive(Debug, Default)]
struct Job {
    pieces: Vec<Piece>,
    ops: Vec<Op>,
    /// Bytes of the ops that are not a plain slice of the contents (gaps, copies, corruption).
    scratch: Vec<u8>,
    /// Datagram size of the transmit (GSO `segment_size` of multi-datagram ops).
    stride: usize,
    /// Index of the next op to send.
    next: usize,
    /// Datagrams sent / failed so far, added to the stats when the job ends.
    sent: u64,
    errors: u64,
    /// Set while suspended after the inner backend returned `Pending`.
    suspended: Option<ResumeKey>,
}

impl Job {
    /// Turns `pieces` into `ops`: consecutive datagrams with the same ECN go into one GSO
    /// op while they have the full `stride` (a shorter one ends it). An op stays a slice of
    /// `contents` while its datagrams are unmodified and contiguous there, and is moved to
    /// `scratch` otherwise.
    fn build_ops(&mut self, contents: &[u8], stride: usize) {
        self.stride = stride;
        for i in 0..self.pieces.len() {
            let p = self.pieces[i];
            for _ in 0..p.copies {
                self.add(contents, &p);
            }
        }
    }

    fn add(&mut self, contents: &[u8], p: &Piece) {
        let bytes = &contents[p.start..p.start + p.len];
        if let Some(cur) = self.ops.last_mut() {
            let fits = cur.ecn == p.ecn
                && cur.last_len == self.stride
                && p.len > 0
                && p.len <= self.stride;
            if fits {
                if !cur.in_scratch && p.corrupt.is_none() && cur.start + cur.len == p.start {
                    cur.len += p.len;
                } else {
                    if !cur.in_scratch {
                        let at = self.scratch.len();
                        self.scratch
                            .extend_from_slice(&contents[cur.start..cur.start + cur.len]);
                        cur.start = at;
                        cur.in_scratch = true;
                    }
                    append(&mut self.scratch, bytes, p.corrupt);
                    cur.len += p.len;
                }
                cur.count += 1;
                cur.last_len = p.len;
                return;
            }
        }
        let (in_scratch, start) = if p.corrupt.is_none() {
            (false, p.start)
        } else {
            let at = self.scratch.len();
            append(&mut self.scratch, bytes, p.corrupt);
            (true, at)
        };
        self.ops.push(Op {
            ecn: p.ecn,
            in_scratch,
            start,
            len: p.len,
            count: 1,
            last_len: p.len,
        });
    }

    /// Gives up the ops not sent yet (their datagrams count as send errors).
    fn abandon(&mut self) {
        let rest: usize = self
            .ops
            .get(self.next..)
            .unwrap_or(&[])
            .iter()
            .map(|o| o.count)
            .sum();
        self.errors += rest as u64;
        self.next = self.ops.len();
    }

    fn clear(&mut self) {
        self.pieces.clear();
        self.ops.clear();
        self.scratch.clear();
        if self.scratch.capacity() > SCRATCH_KEEP {
            self.scratch = Vec::new();
        }
        self.next = 0;
        self.sent = 0;
        self.errors = 0;
        self.suspended = None;
    }
}

/// Appends `bytes` to `scratch`, XOR-ing one byte if `corrupt`.
fn append(scratch: &mut Vec<u8>, bytes: &[u8], corrupt: Option<(usize, u8)>) {
    let at = scratch.len();
    scratch.extend_from_slice(bytes);
    if let Some((pos, mask)) = corrupt {
        if let Some(b) = scratch.get_mut(at + pos) {
            *b ^= mask;
        }
    }
}

/// A [`DatagramBackend`] that impairs what it sends (see [`Impairment`]) and passes
/// receiving through to the wrapped backend unchanged.
///
/// Datagrams that need no hold (no `delay`, `jitter` or rate limit configured, not picked
/// for reordering, and nothing held for their destination) are sent from `poll_send` itself
/// through the inner backend, the survivors of a GSO transmit re-batched into GSO transmits
/// (a CE re-marked datagram goes in its own). `poll_send` returns `Pending` only when the
/// inner backend does for such a send; the repeated call resumes where it stopped, without
/// drawing again.
///
/// Other datagrams go to a delay line: a background task (spawned by [`new`](Self::new) on
/// the current tokio runtime, stopped when this value is dropped, discarding what it still
/// holds) sends them through the inner backend one by one when they are due.
pub struct Impaired<B> {
    inner: Arc<B>,
    shared: Arc<Shared>,
    ports: Vec<u16>,
    /// The inline sends of the current transmit. Only `poll_send` locks it (the sender task
    /// and `stats` use `shared`), so holding it across inner sends contends with nothing but
    /// a second concurrent sender.
    job: Mutex<Job>,
}

impl<B: fmt::Debug> fmt::Debug for Impaired<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.shared.lock();
        f.debug_struct("Impaired")
            .field("inner", &self.inner)
            .field("impairment", &st.imp)
            .field("stats", &st.snapshot())
            .finish()
    }
}

impl<B: DatagramBackend> Impaired<B> {
    /// Wraps `inner` with the impairments `imp` and spawns the sender task.
    ///
    /// Errors: invalid parameters ([`ImpairError::Invalid`]) or no tokio runtime
    /// ([`ImpairError::NoRuntime`]).
    pub fn new(inner: B, imp: Impairment) -> Result<Self, ImpairError> {
        imp.validate().map_err(ImpairError::Invalid)?;
        let handle = tokio::runtime::Handle::try_current().map_err(|_| ImpairError::NoRuntime)?;
        let inner = Arc::new(inner);
        let shared = Arc::new(Shared {
            state: Mutex::new(State::new(imp)),
            wake: Notify::new(),
        });
        handle.spawn(run_sender(Arc::clone(&inner), Arc::clone(&shared)));
        let ports = inner.source_ports();
        Ok(Self {
            inner,
            shared,
            ports,
            job: Mutex::new(Job::default()),
        })
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ImpairStats {
        self.shared.lock().snapshot()
    }

    /// The impairments in force.
    pub fn impairment(&self) -> Impairment {
        self.shared.lock().imp.clone()
    }

    /// Replaces the impairments for datagrams sent from now on (already held ones keep their
    /// schedule). The random stream continues: `seed` is only used by [`new`](Self::new).
    pub fn set_impairment(&self, imp: Impairment) -> Result<(), ImpairError> {
        imp.validate().map_err(ImpairError::Invalid)?;
        let mut st = self.shared.lock();
        st.held_cap = imp.held_cap();
        if imp.burst.is_none() {
            st.bad = false;
        }
        if imp.rate_limit_bps.is_none() {
            st.link_free_at = None;
        }
        st.imp = imp;
        Ok(())
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// Draws the fate of every datagram of the transmit (one lock of the shared state),
    /// queueing the held ones and turning the inline ones into `job.ops`. Returns whether
    /// there is anything to send inline.
    fn plan(
        &self,
        job: &mut Job,
        transmit: &metaroce::Transmit,
        contents: &[u8],
        segment: usize,
    ) -> bool {
        // A zero-length datagram is still one datagram.
        let count = if contents.is_empty() {
            1
        } else {
            contents.len().div_ceil(segment)
        };
        let mut queued = false;
        {
            let mut st = self.shared.lock();
            let now = Instant::now();
            let mut inline_ok = st.inline_allowed(&transmit.destination);
            for i in 0..count {
                let start = i * segment;
                let len = segment.min(contents.len() - start);
                let Some(s) = st.decide(now, transmit.ecn, len, inline_ok) else {
                    continue;
                };
                if s.inline {
                    job.pieces.push(Piece {
                        start,
                        len,
                        ecn: s.ecn,
                        corrupt: s.corrupt,
                        copies: s.copies,
                    });
                } else {
                    // Everything after a held datagram is held too, to keep the order.
                    inline_ok = false;
                    let defer = !job.pieces.is_empty();
                    st.hold(transmit, &contents[start..start + len], &s, defer);
                    queued |= !defer;
                }
            }
        }
        if queued {
            self.shared.wake.notify_one();
        }
        if job.pieces.is_empty() {
            return false;
        }
        job.build_ops(contents, segment);
        true
    }

    /// Sends the job's ops from `job.next` on; `Pending` if the inner backend is.
    fn send_ops(
        &self,
        cx: &mut Context<'_>,
        job: &mut Job,
        transmit: &metaroce::Transmit,
        contents: &[u8],
    ) -> Poll<()> {
        while let Some(op) = job.ops.get(job.next).copied() {
            let bytes = if op.in_scratch {
                &job.scratch[op.start..op.start + op.len]
            } else {
                &contents[op.start..op.start + op.len]
            };
            let t = metaroce::Transmit {
                destination: transmit.destination,
                src_port: transmit.src_port,
                ecn: op.ecn,
                size: op.len,
                segment_size: (op.count > 1).then_some(job.stride),
            };
            match self.inner.poll_send(cx, &t, bytes) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(())) => job.sent += op.count as u64,
                Poll::Ready(Err(e)) => {
                    job.errors += op.count as u64;
                    tracing::debug!("impaired send to {} failed: {e}", transmit.destination);
                }
            }
            job.next += 1;
        }
        Poll::Ready(())
    }

    /// Ends the job: adds its counts to the stats, releases the datagrams deferred behind it
    /// into the queue, and clears it for the next transmit.
    fn finish(&self, job: &mut Job) {
        let flushed = {
            let mut st = self.shared.lock();
            st.stats.sent += job.sent;
            st.stats.send_errors += job.errors;
            st.flush_deferred()
        };
        if flushed {
            self.shared.wake.notify_one();
        }
        job.clear();
    }

    fn lock_job(&self) -> MutexGuard<'_, Job> {
        match self.job.lock() {
            Ok(job) => job,
            Err(poisoned) => {
                // A panic (in the inner backend) interrupted a send: give that job up.
                let mut job = poisoned.into_inner();
                job.abandon();
                self.finish(&mut job);
                self.job.clear_poison();
                job
            }
        }
    }
}

impl<B> Drop for Impaired<B> {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.wake.notify_one();
    }
}

enum Next {
    Send(Held),
    WaitUntil(Instant),
    Wait,
    Stop,
}

/// Sends held datagrams through `inner` as they fall due, until the [`Impaired`] is dropped.
async fn run_sender<B: DatagramBackend>(inner: Arc<B>, shared: Arc<Shared>) {
    loop {
        let next = {
            let mut st = shared.lock();
            let now = Instant::now();
            if st.closed {
                Next::Stop
            } else {
                match st.queue.peek().map(|h| h.due) {
                    Some(due) if due <= now => match st.queue.pop() {
                        Some(held) => {
                            st.held_bytes -= held.bytes.len();
                            Next::Send(held)
                        }
                        None => Next::Wait,
                    },
                    Some(due) => Next::WaitUntil(due),
                    None => Next::Wait,
                }
            }
        };
        match next {
            Next::Stop => return,
            Next::Send(held) => {
                let transmit = metaroce::Transmit {
                    destination: held.destination,
                    src_port: held.src_port,
                    ecn: held.ecn,
                    size: held.bytes.len(),
                    segment_size: None,
                };
                let res =
                    std::future::poll_fn(|cx| inner.poll_send(cx, &transmit, &held.bytes)).await;
                // A delayed datagram is sent on its own: hand it to the kernel now.
                inner.flush();
                let mut st = shared.lock();
                st.release(&held.destination);
                match res {
                    Ok(()) => st.stats.sent += 1,
                    Err(e) => {
                        st.stats.send_errors += 1;
                        tracing::debug!("impaired send to {} failed: {e}", held.destination);
                    }
                }
            }
            Next::WaitUntil(due) => {
                tokio::select! {
                    _ = shared.wake.notified() => {}
                    _ = tokio::time::sleep_until(due) => {}
                }
            }
            Next::Wait => shared.wake.notified().await,
        }
    }
}

impl<B: DatagramBackend> DatagramBackend for Impaired<B> {
    // Receiving is not impaired. The inner backend's GSO limit is kept, so a driver
    // batches as it would without impairment (the surviving datagrams of a batch are
    // re-batched here).
    crate::forward_datagram_backend!([.inner] local_addr, max_gso_segments, max_gro_segments,
        socket_recv_buffer, poll_recv, poll_recv_in_place, flush, send_from_any_task);

    fn source_ports(&self) -> Vec<u16> {
        self.ports.clone()
    }

    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        transmit: &metaroce::Transmit,
        contents: &[u8],
    ) -> Poll<io::Result<()>> {
        let segment = match check_transmit(transmit, contents) {
            Ok(s) => s,
            Err(e) => return Poll::Ready(Err(e)),
        };
        if !self.ports.contains(&transmit.src_port) {
            return Poll::Ready(Err(unknown_src_port(transmit.src_port, &self.ports)));
        }
        let mut guard = self.lock_job();
        let job = &mut *guard;
        let resumed = match job.suspended.take() {
            Some(key) if key == ResumeKey::new(transmit, contents) => true,
            Some(_) => {
                // Not the transmit that was interrupted (the caller gave it up): what it had
                // left to send is lost.
                job.abandon();
                self.finish(job);
                false
            }
            None => false,
        };
        if !resumed && !self.plan(job, transmit, contents, segment) {
            return Poll::Ready(Ok(()));
        }
        if self.send_ops(cx, job, transmit, contents).is_pending() {
            job.suspended = Some(ResumeKey::new(transmit, contents));
            return Poll::Pending;
        }
        self.finish(job);
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(imp: Impairment) -> State {
        State::new(imp)
    }

    fn transmit(size: usize) -> metaroce::Transmit {
        metaroce::Transmit {
            destination: "127.0.0.1:9".parse().unwrap(),
            src_port: 1,
            ecn: Some(EcnCodepoint::Ect0),
            size,
            segment_size: None,
        }
    }

    #[test]
    fn validate_rejects_bad_values() {
        assert!(Impairment::default().validate().is_ok());
        let bad = [
            Impairment {
                loss: 1.5,
                ..Default::default()
            },
            Impairment {
                corrupt: f64::NAN,
                ..Default::default()
            },
            Impairment {
                ce_mark: -0.1,
                ..Default::default()
            },
            Impairment {
                reorder: 0.5,
                ..Default::default()
            },
            Impairment {
                rate_limit_bps: Some(0),
                ..Default::default()
            },
            Impairment {
                queue_limit_bytes: 0,
                ..Default::default()
            },
            Impairment {
                delay: Duration::MAX,
                ..Default::default()
            },
            Impairment {
                burst: Some(GilbertElliott {
                    p_good_to_bad: 2.0,
                    ..Default::default()
                }),
                ..Default::default()
            },
        ];
        for imp in bad {
            assert!(imp.validate().is_err(), "{imp:?}");
        }
    }

    #[test]
    fn rate_limit_spaces_datagrams_and_tail_drops() {
        // 8 Mbit/s: a 1000-byte datagram takes 1 ms on the link.
        let mut st = state(Impairment {
            rate_limit_bps: Some(8_000_000),
            queue_limit_bytes: 3000,
            ..Default::default()
        });
        let now = Instant::now();
        let data = [0u8; 1000];
        for _ in 0..5 {
            st.impair(now, &transmit(1000), &data);
        }
        // Backlog before each: 0, 1000, 2000 accepted; 3000 + 1000 > 3000 dropped twice.
        assert_eq!(st.queue.len(), 3);
        assert_eq!(st.stats.queue_dropped, 2);
        let mut dues: Vec<_> = st.queue.iter().map(|h| h.due - now).collect();
        dues.sort();
        assert_eq!(dues, [1, 2, 3].map(Duration::from_millis).to_vec());
    }

    #[test]
    fn ce_threshold_marks_queued_datagrams() {
        let mut st = state(Impairment {
            rate_limit_bps: Some(8_000_000),
            ce_threshold_bytes: Some(1500),
            ..Default::default()
        });
        let now = Instant::now();
        for _ in 0..4 {
            st.impair(now, &transmit(1000), &[0u8; 1000]);
        }
        let mut held: Vec<_> = st.queue.drain().collect();
        held.sort_by_key(|h| h.seq);
        let marks: Vec<_> = held.iter().map(|h| h.ecn).collect();
        use EcnCodepoint::*;
        assert_eq!(marks, [Some(Ect0), Some(Ect0), Some(Ce), Some(Ce)]);
    }

    #[test]
    fn burst_loss_produces_runs() {
        let mut st = state(Impairment {
            burst: Some(GilbertElliott {
                p_good_to_bad: 0.01,
                p_bad_to_good: 0.2,
                loss_in_bad: 1.0,
            }),
            seed: 7,
            ..Default::default()
        });
        let now = Instant::now();
        let mut lost = Vec::new();
        for _ in 0..20_000 {
            let before = st.stats.dropped;
            st.impair(now, &transmit(1), &[0]);
            lost.push(st.stats.dropped > before);
            st.queue.clear();
            st.held_bytes = 0;
        }
        let drops = lost.iter().filter(|&&l| l).count();
        let runs = lost.windows(2).filter(|w| !w[0] && w[1]).count();
        // Stationary bad share 0.01 / 0.21 ≈ 4.8 %, mean run 5 datagrams.
        assert!((400..1600).contains(&drops), "drops {drops}");
        assert!(
            drops as f64 / runs as f64 > 2.5,
            "drops {drops} runs {runs}"
        );
    }

    #[test]
    fn empty_and_odd_inputs_do_not_panic() {
        let mut st = state(Impairment {
            corrupt: 1.0,
            duplicate: 1.0,
            jitter: Duration::from_nanos(1),
            ..Default::default()
        });
        let now = Instant::now();
        st.impair(now, &transmit(0), &[]);
        st.impair(now, &transmit(1), &[5]);
        assert_eq!(st.queue.len(), 4);
        assert_eq!(st.stats.corrupted, 1);
    }

    #[test]
    fn build_ops_rebatches_survivors() {
        use EcnCodepoint::*;
        // Seven datagrams of 4 bytes, the last one of 2.
        let contents: Vec<u8> = (0..26).collect();
        let piece = |i: usize, ecn, corrupt, copies| Piece {
            start: i * 4,
            len: 4.min(26 - i * 4),
            ecn: Some(ecn),
            corrupt,
            copies,
        };
        let mut job = Job::default();
        job.pieces.extend([
            piece(0, Ect0, None, 1),
            piece(1, Ect0, None, 1),
            // 2 lost; 3 duplicated: the op moves to scratch.
            piece(3, Ect0, None, 2),
            // CE-marked: an op of its own.
            piece(4, Ce, None, 1),
            piece(5, Ect0, Some((1, 0xFF)), 1),
            // The short last one ends a batch, and its copy starts another.
            piece(6, Ect0, None, 2),
        ]);
        job.build_ops(&contents, 4);
        let bytes = |op: &Op| {
            if op.in_scratch {
                job.scratch[op.start..op.start + op.len].to_vec()
            } else {
                contents[op.start..op.start + op.len].to_vec()
            }
        };
        let ops: Vec<_> = job
            .ops
            .iter()
            .map(|op| (op.ecn, op.count, op.in_scratch, bytes(op)))
            .collect();
        assert_eq!(
            ops,
            [
                (
                    Some(Ect0),
                    4,
                    true,
                    vec![0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15, 12, 13, 14, 15]
                ),
                (Some(Ce), 1, false, vec![16, 17, 18, 19]),
                (Some(Ect0), 2, true, vec![20, 21 ^ 0xFF, 22, 23, 24, 25]),
                (Some(Ect0), 1, false, vec![24, 25]),
            ]
        );

        // Unmodified consecutive survivors stay a slice of the contents.
        job.clear();
        job.pieces.extend((0..6).map(|i| piece(i, Ect0, None, 1)));
        job.build_ops(&contents, 4);
        assert_eq!(job.ops.len(), 1);
        assert!(!job.ops[0].in_scratch && job.scratch.is_empty());
        assert_eq!(
            (job.ops[0].start, job.ops[0].len, job.ops[0].count),
            (0, 24, 6)
        );
    }
}
