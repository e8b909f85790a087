//! [`Impaired`]: a network-impairment layer over any [`DatagramBackend`].
//!
//! Impairments apply on the **send** side, per datagram (a GSO transmit is split into its
//! datagrams, each with its own random draws). Every decision comes from a seeded
//! `Xoshiro256PlusPlus`, with a fixed number of draws per datagram: the same sequence of sends
//! with the same [`Impairment`] yields the same decisions, and changing one probability does
//! not shift the random stream seen by the others.
//!
//! Surviving datagrams go to a queue ordered by due time; a task spawned by
//! [`Impaired::new`] sends them through the inner backend, one datagram per send, when they
//! are due (so held datagrams go out even if the application sends nothing more).

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use metaroce::EcnCodepoint;
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{check_transmit, unknown_src_port, DatagramBackend, RecvMeta};

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

fn check_probability(name: &str, p: f64) -> Result<(), String> {
    if (0.0..=1.0).contains(&p) {
        Ok(())
    } else {
        Err(format!("{name} must be a probability in [0, 1], got {p}"))
    }
}

fn check_duration(name: &str, d: Duration) -> Result<(), String> {
    if d <= MAX_DURATION {
        Ok(())
    } else {
        Err(format!(
            "{name} must be at most {MAX_DURATION:?}, got {d:?}"
        ))
    }
}

impl Impairment {
    /// Checks the parameters: probabilities in `[0, 1]` (NaN rejected), durations at most one
    /// hour, `reorder_delay > 0` when `reorder > 0`, a non-zero rate limit and queue limit.
    pub fn validate(&self) -> Result<(), String> {
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
            return Err("reorder > 0 needs a non-zero reorder_delay".into());
        }
        if self.rate_limit_bps == Some(0) {
            return Err("rate_limit_bps must be non-zero (use None for no limit)".into());
        }
        if self.queue_limit_bytes == 0 {
            return Err("queue_limit_bytes must be non-zero".into());
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImpairError {
    /// [`Impairment::validate`] rejected the parameters; the message says which.
    Invalid(String),
    /// [`Impaired::new`] was called outside a tokio runtime (it spawns its sender task).
    NoRuntime,
}

impl fmt::Display for ImpairError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Invalid(msg) => write!(f, "invalid impairment: {msg}"),
            Self::NoRuntime => f.write_str("Impaired::new must be called within a tokio runtime"),
        }
    }
}

impl std::error::Error for ImpairError {}

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

struct State {
    imp: Impairment,
    held_cap: usize,
    rng: Xoshiro256PlusPlus,
    /// Gilbert–Elliott channel state.
    bad: bool,
    /// When the bottleneck link finishes sending what it has accepted.
    link_free_at: Option<Instant>,
    queue: BinaryHeap<Held>,
    held_bytes: usize,
    next_seq: u64,
    stats: ImpairStats,
    closed: bool,
}

fn is_ect(ecn: Option<EcnCodepoint>) -> bool {
    matches!(ecn, Some(EcnCodepoint::Ect0 | EcnCodepoint::Ect1))
}

impl State {
    /// Applies the impairments to one datagram sent at `now`, queueing what survives.
    fn impair(&mut self, now: Instant, transmit: &metaroce::Transmit, datagram: &[u8]) {
        self.stats.seen += 1;
        let d = Draws::new(&mut self.rng);
        let imp = self.imp.clone();

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
            return;
        }

        let len = datagram.len();
        let copies = if d.duplicate < imp.duplicate { 2 } else { 1 };
        if self.held_bytes.saturating_add(len * copies) > self.held_cap {
            self.stats.queue_dropped += 1;
            return;
        }

        let mut ecn = transmit.ecn;
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
                return;
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
                return;
            };
            self.link_free_at = Some(end);
            depart = end;
        }

        let jitter = scale(d.jitter, imp.jitter.as_nanos());
        let jitter = Duration::from_nanos(u64::try_from(jitter).unwrap_or(u64::MAX));
        let reordered = d.reorder < imp.reorder;
        let mut hold = imp.delay + jitter;
        if reordered {
            hold += imp.reorder_delay;
        }
        let Some(due) = depart.checked_add(hold) else {
            self.stats.queue_dropped += 1;
            return;
        };

        let mut bytes = datagram.to_vec();
        if d.corrupt < imp.corrupt && !bytes.is_empty() {
            let pos = scale(d.corrupt_pos, len as u128) as usize;
            let mask = 1 + (d.corrupt_mask % 255) as u8;
            if let Some(b) = bytes.get_mut(pos) {
                *b ^= mask;
                self.stats.corrupted += 1;
            }
        }

        self.stats.ce_marked += u64::from(ce_marked);
        self.stats.reordered += u64::from(reordered);
        self.stats.delayed += u64::from(due > now);
        if copies == 2 {
            self.stats.duplicated += 1;
            let copy = bytes.clone();
            self.push(due, transmit, ecn, copy);
        }
        // A copy shares the original's due time: the two leave back to back.
        self.push(due, transmit, ecn, bytes);
    }

    fn push(
        &mut self,
        due: Instant,
        transmit: &metaroce::Transmit,
        ecn: Option<EcnCodepoint>,
        bytes: Vec<u8>,
    ) {
        self.held_bytes += bytes.len();
        let seq = self.next_seq;
        self.next_seq += 1;
        self.queue.push(Held {
            due,
            seq,
            destination: transmit.destination,
            src_port: transmit.src_port,
            ecn,
            bytes,
        });
    }

    fn snapshot(&self) -> ImpairStats {
        ImpairStats {
            held_datagrams: self.queue.len() as u64,
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

/// A [`DatagramBackend`] that impairs what it sends (see [`Impairment`]) and passes
/// receiving through to the wrapped backend unchanged.
///
/// `poll_send` never blocks: it returns `Ready` once each datagram is queued or dropped. A
/// background task (spawned by [`new`](Self::new) on the current tokio runtime, stopped when
/// this value is dropped, discarding what it still holds) sends queued datagrams through the
/// inner backend one by one when they are due.
pub struct Impaired<B> {
    inner: Arc<B>,
    shared: Arc<Shared>,
    ports: Vec<u16>,
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
            state: Mutex::new(State {
                rng: Xoshiro256PlusPlus::seed_from_u64(imp.seed),
                held_cap: imp.held_cap(),
                imp,
                bad: false,
                link_free_at: None,
                queue: BinaryHeap::new(),
                held_bytes: 0,
                next_seq: 0,
                stats: ImpairStats::default(),
                closed: false,
            }),
            wake: Notify::new(),
        });
        handle.spawn(run_sender(Arc::clone(&inner), Arc::clone(&shared)));
        let ports = inner.source_ports();
        Ok(Self {
            inner,
            shared,
            ports,
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
                let mut st = shared.lock();
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
    fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr()
    }

    fn source_ports(&self) -> Vec<u16> {
        self.ports.clone()
    }

    /// The inner backend's value, so a driver batches as it would without impairment (the
    /// batches are split into datagrams here anyway).
    fn max_gso_segments(&self) -> usize {
        self.inner.max_gso_segments()
    }

    fn max_gro_segments(&self) -> usize {
        self.inner.max_gro_segments()
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn poll_send(
        &self,
        _cx: &mut Context<'_>,
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
        {
            let mut st = self.shared.lock();
            let now = Instant::now();
            if contents.is_empty() {
                st.impair(now, transmit, contents);
            } else {
                for datagram in contents.chunks(segment) {
                    st.impair(now, transmit, datagram);
                }
            }
        }
        self.shared.wake.notify_one();
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(imp: Impairment) -> State {
        State {
            rng: Xoshiro256PlusPlus::seed_from_u64(imp.seed),
            held_cap: imp.held_cap(),
            imp,
            bad: false,
            link_free_at: None,
            queue: BinaryHeap::new(),
            held_bytes: 0,
            next_seq: 0,
            stats: ImpairStats::default(),
            closed: false,
        }
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
}
