//! The K-QP chunk scheduler (`metaroce::multipath`) against fake RC QPs that fail at random.
//!
//! The fake HCA keeps each QP's posted work requests in a FIFO. A QP can complete its oldest
//! one (placing its bytes, or handing its notification to the receiver's `Reorderer`), or
//! fail: a random prefix of its work requests executed at the responder without the
//! acknowledgement coming back, every one of them may still be (re)placed later by packets
//! left in the network ("zombies") until the peer tears its end of the QP down, and the
//! completions come back as `RetryExceeded` then `WrFlushError`. Some operations are "bad"
//! (a bad rkey): every chunk of them completes with `RemoteAccessError`, and a bad chunk
//! moves its QP to the error state as in IBA.
//!
//! Checked, for every schedule:
//! * every submitted operation completes exactly once;
//! * a good WRITE/READ completes `Success` with every byte placed; a bad one
//!   `RemoteAccessError`; a good SEND / WRITE_WITH_IMM `Success`, or `WrFlushError` only
//!   behind a bad notification of its own channel;
//! * nothing is placed into an operation after its completion was reported (the fence on
//!   peer teardown), nothing outside its bytes, no work request on a QP that is down, no QP
//!   over its depth;
//! * per channel the receiver delivers each successful notification exactly once, in
//!   submission order, and never one whose operation failed;
//! * the receiver's reorderer never refuses a notification as beyond its window.
//!
//! A notification that lands goes first into its QP's *receive pipeline* (the receive
//! completions and the receive task of a real receiver), which drains into the reorderer only
//! on a `Deliver` action: one QP's pipeline can lag the others', as when its receive task is
//! not scheduled. The sender's window then holds only with receiver credits
//! (`MultipathConfig::receiver_credits`), which the model feeds back at once.

use metaroce::multipath::{
    ChunkKind, Event, MultipathConfig, MultipathError, OpId, OpKind, OpRequest, Post, QpId,
    Reorderer, Scheduler,
};
use metaroce::WcStatus;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
struct OpSpec {
    kind: u8,
    len: u16,
    channel: u8,
    fence: bool,
    bad: bool,
}

#[derive(Debug, Clone)]
enum Action {
    Submit,
    Complete(u8),
    Fail {
        qp: u8,
        landed: u8,
    },
    LateLand(u8),
    /// Move the oldest notification of one QP's receive pipeline into the reorderer.
    Deliver(u8),
    TearDown(u8),
    Replace,
    Tick(u8),
}

struct Model {
    sched: Scheduler,
    depth: usize,
    now: Instant,
    qps: BTreeMap<QpId, VecDeque<Post>>,
    zombies: Vec<(QpId, Post)>,
    failed: Vec<QpId>,
    specs: Vec<OpSpec>,
    next_spec: usize,
    ops: HashMap<OpId, OpSpec>,
    completed: HashMap<OpId, WcStatus>,
    placed: HashMap<OpId, Vec<u32>>,
    rx: Reorderer<OpId>,
    /// Landed notifications not yet handed to `rx`, per QP (the receive pipeline).
    pipes: BTreeMap<QpId, VecDeque<(u32, u64, OpId)>>,
    delivered: Vec<(u32, u64, OpId)>,
    violations: Vec<String>,
}

impl Model {
    fn new(config: MultipathConfig, specs: Vec<OpSpec>) -> Model {
        let depth = config.qp_depth as usize;
        let window = config.channel_window;
        let credits = config.receiver_credits;
        let mut sched = Scheduler::new(config).unwrap();
        let mut qps = BTreeMap::new();
        while let Ok(id) = sched.add_qp() {
            qps.insert(id, VecDeque::new());
        }
        Model {
            sched,
            depth,
            now: Instant::now(),
            qps,
            zombies: Vec::new(),
            failed: Vec::new(),
            specs,
            next_spec: 0,
            ops: HashMap::new(),
            completed: HashMap::new(),
            placed: HashMap::new(),
            rx: if credits {
                Reorderer::with_credits(window, 64)
            } else {
                Reorderer::new(window, 64)
            },
            pipes: BTreeMap::new(),
            delivered: Vec::new(),
            violations: Vec::new(),
        }
    }

    fn submit(&mut self) {
        let Some(spec) = self.specs.get(self.next_spec).cloned() else {
            return;
        };
        let channel = u32::from(spec.channel);
        let kind = match spec.kind {
            0 => OpKind::Write,
            1 => OpKind::Read,
            2 => OpKind::WriteWithImm { channel, imm: 7 },
            _ => OpKind::Send { channel },
        };
        let req = OpRequest {
            kind,
            len: u64::from(spec.len),
            fence: spec.fence,
        };
        match self.sched.submit(req) {
            Ok(id) => {
                self.next_spec += 1;
                self.placed.insert(id, vec![0; usize::from(spec.len)]);
                self.ops.insert(id, spec);
            }
            Err(MultipathError::TooManyOps) => {}
            Err(e) => self.violations.push(format!("submit refused: {e}")),
        }
    }

    /// The responder executes `post` (first time or a duplicate from the network).
    fn place(&mut self, post: &Post) {
        let Some(spec) = self.ops.get(&post.op) else {
            self.violations
                .push(format!("post for unknown op {:?}", post.op));
            return;
        };
        if spec.bad {
            return; // refused at the responder every time
        }
        if self.completed.contains_key(&post.op) {
            self.violations.push(format!(
                "{:?} placed after its completion: {post:?}",
                post.op
            ));
        }
        match post.kind {
            ChunkKind::Write | ChunkKind::Read => {
                let bytes = self.placed.get_mut(&post.op).unwrap();
                let end = post.offset as usize + post.len as usize;
                if end > bytes.len() {
                    self.violations
                        .push(format!("chunk beyond its op: {post:?}"));
                    return;
                }
                for b in &mut bytes[post.offset as usize..end] {
                    *b += 1;
                }
            }
            ChunkKind::Notify { channel, seq, .. } => self
                .pipes
                .entry(post.qp)
                .or_default()
                .push_back((channel, seq, post.op)),
        }
    }

    /// The receive path of one QP hands its oldest landed notification to the reorderer;
    /// the credits that fall due go back to the sender at once.
    fn deliver(&mut self, qp: QpId) {
        let Some((channel, seq, op)) = self.pipes.get_mut(&qp).and_then(|p| p.pop_front()) else {
            return;
        };
        self.rx.accept(channel, seq, op);
        while let Some(d) = self.rx.poll() {
            self.delivered.push(d);
        }
        while let Some((c, next)) = self.rx.poll_credit() {
            self.sched.on_credit(c, next);
        }
    }

    fn pump(&mut self) {
        loop {
            let mut progress = false;
            while let Some(p) = self.sched.poll_post(self.now) {
                progress = true;
                match self.qps.get_mut(&p.qp) {
                    Some(q) => {
                        q.push_back(p);
                        if q.len() > self.depth {
                            self.violations.push(format!("{:?} over depth", p.qp));
                        }
                    }
                    None => self.violations.push(format!("posted on a dead QP: {p:?}")),
                }
            }
            while let Some(ev) = self.sched.poll_event() {
                progress = true;
                match ev {
                    Event::Completed { op, status } => {
                        if self.completed.insert(op, status).is_some() {
                            self.violations.push(format!("{op:?} completed twice"));
                        }
                    }
                    Event::ReplaceQp { failed, .. } => self.failed.push(failed),
                }
            }
            if !progress {
                break;
            }
        }
    }

    fn live(&self, k: u8) -> Option<QpId> {
        let ids: Vec<QpId> = self.qps.keys().copied().collect();
        if ids.is_empty() {
            None
        } else {
            Some(ids[usize::from(k) % ids.len()])
        }
    }

    /// The HCA moves `qp` to the error state: `landed` of its work requests executed
    /// without an acknowledgement; all of them may still land from the network.
    fn fail(&mut self, qp: QpId, landed: usize, first: WcStatus) {
        let Some(posts) = self.qps.remove(&qp) else {
            return;
        };
        for p in posts.iter().take(landed) {
            self.place(p);
        }
        for (i, p) in posts.iter().enumerate() {
            self.zombies.push((qp, *p));
            let status = if i == 0 {
                first
            } else {
                WcStatus::WrFlushError
            };
            self.sched.on_completion(p.wr_id, status, self.now);
        }
        if posts.is_empty() {
            self.sched.fail_qp(qp, first);
        }
    }

    fn complete(&mut self, qp: QpId) {
        let Some(p) = self.qps.get_mut(&qp).and_then(|q| q.pop_front()) else {
            return;
        };
        if self.ops.get(&p.op).is_some_and(|s| s.bad) {
            // Refused: the completion carries the error, the QP goes to the error state.
            self.zombies.push((qp, p));
            self.sched
                .on_completion(p.wr_id, WcStatus::RemoteAccessError, self.now);
            self.fail(qp, 0, WcStatus::WrFlushError);
            return;
        }
        self.place(&p);
        self.sched
            .on_completion(p.wr_id, WcStatus::Success, self.now);
    }

    fn tear_down(&mut self, qp: QpId) {
        self.zombies.retain(|(z, _)| *z != qp);
        self.failed.retain(|f| *f != qp);
        self.sched.peer_torn_down(qp);
    }

    fn replace(&mut self) {
        if let Ok(id) = self.sched.add_qp() {
            self.qps.insert(id, VecDeque::new());
        }
    }

    fn act(&mut self, a: &Action) {
        match *a {
            Action::Submit => self.submit(),
            Action::Complete(k) => {
                if let Some(qp) = self.live(k) {
                    self.complete(qp);
                }
            }
            Action::Fail { qp, landed } => {
                if let Some(id) = self.live(qp) {
                    self.fail(id, usize::from(landed), WcStatus::RetryExceeded);
                }
            }
            Action::LateLand(k) => {
                if !self.zombies.is_empty() {
                    let (_, p) = self.zombies.remove(usize::from(k) % self.zombies.len());
                    self.place(&p);
                }
            }
            Action::Deliver(k) => {
                let busy: Vec<QpId> = self
                    .pipes
                    .iter()
                    .filter(|(_, p)| !p.is_empty())
                    .map(|(q, _)| *q)
                    .collect();
                if !busy.is_empty() {
                    self.deliver(busy[usize::from(k) % busy.len()]);
                }
            }
            Action::TearDown(k) => {
                if !self.failed.is_empty() {
                    let qp = self.failed[usize::from(k) % self.failed.len()];
                    self.tear_down(qp);
                }
            }
            Action::Replace => self.replace(),
            Action::Tick(us) => self.now += Duration::from_micros(u64::from(us) + 1),
        }
        self.pump();
    }

    /// No more failures: bring every QP back, tear every failed one down, complete
    /// everything.
    fn drain(&mut self) {
        for _ in 0..100_000 {
            self.submit();
            self.replace();
            if let Some(&qp) = self.failed.first() {
                self.tear_down(qp);
            }
            let ids: Vec<QpId> = self.qps.keys().copied().collect();
            for qp in ids {
                self.complete(qp);
            }
            let piped: Vec<QpId> = self.pipes.keys().copied().collect();
            for qp in piped {
                while self.pipes.get(&qp).is_some_and(|p| !p.is_empty()) {
                    self.deliver(qp);
                }
            }
            self.now += Duration::from_micros(3);
            self.pump();
            if self.next_spec == self.specs.len()
                && self.sched.outstanding_ops() == 0
                && self.failed.is_empty()
            {
                return;
            }
        }
        self.violations.push(format!(
            "no progress: {} ops outstanding",
            self.sched.outstanding_ops()
        ));
    }

    fn check(&mut self) {
        if self.rx.refused() > 0 {
            self.violations.push(format!(
                "the receiver refused {} notifications beyond its window",
                self.rx.refused()
            ));
        }
        if self.sched.stats().bad_credits > 0 {
            self.violations.push(format!(
                "{} credits ignored",
                self.sched.stats().bad_credits
            ));
        }
        let mut bad_notify: HashMap<u32, u64> = HashMap::new();
        let mut seq_of: HashMap<OpId, (u32, u64)> = HashMap::new();
        let mut next_seq: HashMap<u32, u64> = HashMap::new();
        let mut ids: Vec<OpId> = self.ops.keys().copied().collect();
        ids.sort();
        for id in &ids {
            let spec = &self.ops[id];
            if spec.kind >= 2 {
                let c = u32::from(spec.channel);
                let s = next_seq.entry(c).or_insert(0);
                seq_of.insert(*id, (c, *s));
                if spec.bad {
                    bad_notify.entry(c).or_insert(*s);
                }
                *s += 1;
            }
        }
        for id in &ids {
            let spec = self.ops[id].clone();
            let Some(&status) = self.completed.get(id) else {
                self.violations.push(format!("{id:?} never completed"));
                continue;
            };
            // A notification behind a bad one of its channel is flushed (bad or not).
            let flushed = spec.kind >= 2 && {
                let (c, s) = seq_of[id];
                status == WcStatus::WrFlushError && bad_notify.get(&c).is_some_and(|b| *b < s)
            };
            let expected_ok = flushed
                || if spec.bad {
                    status == WcStatus::RemoteAccessError
                } else {
                    status == WcStatus::Success
                };
            if !expected_ok {
                self.violations
                    .push(format!("{id:?} {spec:?} completed with {status:?}"));
            }
            if status == WcStatus::Success && spec.kind <= 2 {
                if let Some(b) = self.placed[id].iter().position(|n| *n == 0) {
                    self.violations
                        .push(format!("{id:?} Success but byte {b} never placed"));
                }
            }
        }
        // Receiver side: in order, once, only successful ones, all successful ones.
        let mut seen = HashSet::new();
        let mut last: HashMap<u32, OpId> = HashMap::new();
        for &(c, s, op) in &self.delivered {
            if !seen.insert(op) {
                self.violations.push(format!("{op:?} delivered twice"));
            }
            if seq_of.get(&op) != Some(&(c, s)) {
                self.violations.push(format!(
                    "{op:?} delivered as ({c}, {s}), expected {:?}",
                    seq_of.get(&op)
                ));
            }
            if let Some(prev) = last.insert(c, op) {
                if prev > op {
                    self.violations
                        .push(format!("channel {c}: {op:?} after {prev:?}"));
                }
            }
            if self.completed.get(&op) != Some(&WcStatus::Success) {
                self.violations.push(format!(
                    "{op:?} delivered but completed {:?}",
                    self.completed.get(&op)
                ));
            }
        }
        for id in &ids {
            if self.ops[id].kind >= 2
                && self.completed.get(id) == Some(&WcStatus::Success)
                && !seen.contains(id)
            {
                self.violations
                    .push(format!("{id:?} Success but never delivered"));
            }
        }
    }
}

/// A SEND or a WRITE_WITH_IMM on channel 0 or 1 (never bad).
fn notify_spec() -> impl Strategy<Value = OpSpec> {
    (2u8..4, 0u16..40, 0u8..2).prop_map(|(kind, len, channel)| OpSpec {
        kind,
        len,
        channel,
        fence: false,
        bad: false,
    })
}

fn op_spec(allow_bad: bool) -> impl Strategy<Value = OpSpec> {
    (
        0u8..4,
        0u16..200,
        0u8..3,
        prop::bool::weighted(0.1),
        prop::bool::weighted(if allow_bad { 0.08 } else { 0.0 }),
    )
        .prop_map(|(kind, len, channel, fence, bad)| OpSpec {
            kind,
            len,
            channel,
            fence,
            bad,
        })
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        4 => Just(Action::Submit),
        8 => any::<u8>().prop_map(Action::Complete),
        1 => (any::<u8>(), 0u8..6).prop_map(|(qp, landed)| Action::Fail { qp, landed }),
        2 => any::<u8>().prop_map(Action::LateLand),
        6 => any::<u8>().prop_map(Action::Deliver),
        1 => any::<u8>().prop_map(Action::TearDown),
        1 => Just(Action::Replace),
        1 => any::<u8>().prop_map(Action::Tick),
    ]
}

fn config() -> impl Strategy<Value = MultipathConfig> {
    (1usize..=5, 1u32..=48, 1u32..=4, 1u32..=4).prop_map(|(qps, chunk_size, qp_depth, window)| {
        MultipathConfig {
            qps,
            chunk_size,
            qp_depth,
            max_attempts: 1_000,
            channel_window: window,
            receiver_credits: true,
            ..MultipathConfig::default()
        }
    })
}

fn run(config: MultipathConfig, specs: Vec<OpSpec>, actions: Vec<Action>) -> Vec<String> {
    let mut m = Model::new(config, specs);
    for a in &actions {
        m.act(a);
    }
    m.drain();
    m.check();
    m.violations
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "tests/proptest-regressions/multipath_sched.txt",
        ))),
        ..ProptestConfig::default()
    })]

    /// Receive paths that lag (one QP's notifications wait while the others' are
    /// delivered), with QP failures and re-issue: with receiver credits the reorderer
    /// never refuses one, and every SEND that completed Success was delivered.
    #[test]
    fn lagging_receive_paths_keep_every_message_with_credits(
        config in config(),
        specs in prop::collection::vec(notify_spec(), 0..64),
        actions in prop::collection::vec(action(), 0..400),
    ) {
        // Many notifications on two channels: the receive pipelines lag by whole windows.
        let v = run(config, specs, actions);
        prop_assert!(v.is_empty(), "{:#?}", v);
    }

    /// Random QP failures, late and duplicated packets, bad operations: every operation
    /// completes exactly once with the right status, bytes placed, notifications in order
    /// exactly once, nothing placed after completion.
    #[test]
    fn random_failures_cost_no_operation(
        config in config(),
        specs in prop::collection::vec(op_spec(true), 0..24),
        actions in prop::collection::vec(action(), 0..200),
    ) {
        let v = run(config, specs, actions);
        prop_assert!(v.is_empty(), "{:#?}", v);
    }

    /// Without bad operations every operation succeeds, whatever fails.
    #[test]
    fn only_path_failures_all_succeed(
        config in config(),
        specs in prop::collection::vec(op_spec(false), 0..24),
        actions in prop::collection::vec(action(), 0..200),
    ) {
        let mut m = Model::new(config, specs);
        for a in &actions {
            m.act(a);
        }
        m.drain();
        m.check();
        prop_assert!(m.violations.is_empty(), "{:#?}", m.violations);
        prop_assert!(m.completed.values().all(|s| *s == WcStatus::Success), "{:?}", m.completed);
    }
}

/// One QP of four fails in the middle of a 1 MiB WRITE: the WRITE still completes
/// `Success`, its chunks on the failed QP are re-issued on the others, and it waits for the
/// peer's teardown of the failed QP before completing.
#[test]
fn one_path_failure_mid_write_costs_nothing() {
    let config = MultipathConfig {
        chunk_size: 16 * 1024,
        ..MultipathConfig::default()
    };
    let specs = vec![OpSpec {
        kind: 0,
        len: 0,
        channel: 0,
        fence: false,
        bad: false,
    }];
    let mut m = Model::new(config, specs);
    // A 1 MiB write does not fit the u16 spec: submit it directly.
    let id = m
        .sched
        .submit(OpRequest {
            kind: OpKind::Write,
            len: 1 << 20,
            fence: false,
        })
        .unwrap();
    m.next_spec = 1;
    m.ops.insert(
        id,
        OpSpec {
            kind: 0,
            len: 0,
            channel: 0,
            fence: false,
            bad: false,
        },
    );
    m.placed.insert(id, vec![0; 1 << 20]);
    m.pump();
    let slots: Vec<u16> = m.qps.keys().map(|q| q.slot).collect();
    assert_eq!(slots, vec![0, 1, 2, 3], "K = 4 QPs in distinct slots");
    for k in 0..4u8 {
        m.act(&Action::Complete(k));
    }
    let victim = m.live(2).unwrap();
    m.fail(victim, 1, WcStatus::RetryExceeded);
    m.pump();
    assert_eq!(m.failed, vec![victim]);
    // Complete everything else, but do not tear the failed QP down yet.
    for _ in 0..1000 {
        let ids: Vec<QpId> = m.qps.keys().copied().collect();
        for qp in ids {
            m.complete(qp);
        }
        m.pump();
    }
    assert!(
        m.completed.is_empty(),
        "completed before the failed QP was torn down"
    );
    assert!(m.sched.stats().reissued_chunks > 0);
    // A late packet of the failed QP lands now: still before completion, so harmless.
    m.act(&Action::LateLand(0));
    m.tear_down(victim);
    m.pump();
    assert_eq!(m.completed.get(&id), Some(&WcStatus::Success));
    m.drain();
    m.check();
    assert!(m.violations.is_empty(), "{:#?}", m.violations);
    let posted: Vec<u64> = (0..4)
        .map(|s| m.sched.qp_stats(s).unwrap().posted_chunks)
        .collect();
    println!(
        "chunks per slot: {posted:?}, reissued {}",
        m.sched.stats().reissued_chunks
    );
    assert!(
        posted.iter().all(|n| *n > 0),
        "every QP carried chunks: {posted:?}"
    );
}

/// Chunks are weighted by completion rate: QP 0 completes three times as fast as QP 1 and
/// gets most of the bytes.
#[test]
fn faster_qp_gets_more_chunks() {
    let config = MultipathConfig {
        qps: 2,
        chunk_size: 4096,
        qp_depth: 8,
        ..MultipathConfig::default()
    };
    let mut s = Scheduler::new(config).unwrap();
    let q0 = s.add_qp().unwrap();
    let q1 = s.add_qp().unwrap();
    let t0 = Instant::now();
    let op = s
        .submit(OpRequest {
            kind: OpKind::Write,
            len: 4096 * 4000,
            fence: false,
        })
        .unwrap();
    // Each QP serves its FIFO: QP 0 takes 1 µs per chunk, QP 1 takes 3 µs.
    let mut queues: [VecDeque<u64>; 2] = [VecDeque::new(), VecDeque::new()];
    let mut busy_until = [t0, t0];
    let mut now = t0;
    let mut done = false;
    for _ in 0..100_000 {
        while let Some(p) = s.poll_post(now) {
            let i = if p.qp == q0 {
                0
            } else {
                assert_eq!(p.qp, q1);
                1
            };
            queues[i].push_back(p.wr_id);
        }
        now += Duration::from_micros(1);
        for i in 0..2 {
            let service = Duration::from_micros(if i == 0 { 1 } else { 3 });
            if busy_until[i] + service <= now {
                if let Some(wr) = queues[i].pop_front() {
                    s.on_completion(wr, WcStatus::Success, now);
                    busy_until[i] = now;
                }
            }
        }
        if let Some(Event::Completed { op: o, status }) = s.poll_event() {
            assert_eq!((o, status), (op, WcStatus::Success));
            done = true;
            break;
        }
    }
    assert!(done);
    let b0 = s.qp_stats(0).unwrap().posted_bytes as f64;
    let b1 = s.qp_stats(1).unwrap().posted_bytes as f64;
    let share = b0 / (b0 + b1);
    println!(
        "fast QP share {share:.3}, rates {:.0} / {:.0} B/s",
        s.qp_stats(0).unwrap().rate,
        s.qp_stats(1).unwrap().rate
    );
    assert!(share > 0.65, "fast QP got {share:.3} of the bytes");
}

/// A fenced operation starts only after every earlier one completed.
#[test]
fn fence_waits_for_earlier_operations() {
    let mut s = Scheduler::new(MultipathConfig::default()).unwrap();
    for _ in 0..4 {
        s.add_qp().unwrap();
    }
    let now = Instant::now();
    let w = s
        .submit(OpRequest {
            kind: OpKind::Write,
            len: 100,
            fence: false,
        })
        .unwrap();
    let send = s
        .submit(OpRequest {
            kind: OpKind::Send { channel: 0 },
            len: 8,
            fence: true,
        })
        .unwrap();
    let p = s.poll_post(now).unwrap();
    assert_eq!(p.op, w);
    assert_eq!(s.poll_post(now), None, "the fenced SEND waits");
    s.on_completion(p.wr_id, WcStatus::Success, now);
    assert_eq!(
        s.poll_event(),
        Some(Event::Completed {
            op: w,
            status: WcStatus::Success
        })
    );
    let p = s.poll_post(now).unwrap();
    assert_eq!(p.op, send);
    assert!(matches!(
        p.kind,
        ChunkKind::Notify {
            channel: 0,
            seq: 0,
            imm: None
        }
    ));
}

/// The immediate of a WRITE_WITH_IMM is posted only after every data chunk completed.
#[test]
fn immediate_follows_all_data_chunks() {
    let config = MultipathConfig {
        chunk_size: 10,
        ..MultipathConfig::default()
    };
    let mut s = Scheduler::new(config).unwrap();
    for _ in 0..4 {
        s.add_qp().unwrap();
    }
    let now = Instant::now();
    s.submit(OpRequest {
        kind: OpKind::WriteWithImm {
            channel: 9,
            imm: 42,
        },
        len: 35,
        fence: false,
    })
    .unwrap();
    let mut data = Vec::new();
    while let Some(p) = s.poll_post(now) {
        assert_eq!(p.kind, ChunkKind::Write);
        data.push(p);
    }
    assert_eq!(
        data.iter().map(|p| p.len).collect::<Vec<_>>(),
        vec![10, 10, 10, 5]
    );
    let slots: HashSet<u16> = data.iter().map(|p| p.qp.slot).collect();
    assert_eq!(slots.len(), 4, "sprayed over the four QPs");
    for p in &data {
        assert_eq!(s.poll_post(now), None);
        s.on_completion(p.wr_id, WcStatus::Success, now);
    }
    let imm = s.poll_post(now).unwrap();
    assert_eq!(
        imm.kind,
        ChunkKind::Notify {
            channel: 9,
            seq: 0,
            imm: Some(42)
        }
    );
    assert_eq!(imm.len, 0);
}

/// One QP's receive path stalls while the other's delivers. Without receiver credits the
/// sender's window moves on completions alone (an RC completion says the responder's device
/// has the frame), runs past the reorderer's window, and a notification is refused after
/// its SEND completed Success: a lost message. With credits the sender waits for the
/// stalled path, and everything arrives once it drains.
#[test]
fn a_stalled_receive_path_needs_receiver_credits() {
    for credits in [false, true] {
        let config = MultipathConfig {
            qps: 2,
            chunk_size: 64,
            qp_depth: 4,
            max_attempts: 1_000,
            channel_window: 4,
            receiver_credits: credits,
            ..MultipathConfig::default()
        };
        let specs = (0..40)
            .map(|_| OpSpec {
                kind: 3,
                len: 8,
                channel: 0,
                fence: false,
                bad: false,
            })
            .collect();
        let mut m = Model::new(config, specs);
        let stalled = *m.qps.keys().next().unwrap();
        for _ in 0..200 {
            // Submissions outpace completions, so both QPs get work.
            for _ in 0..3 {
                m.act(&Action::Submit);
            }
            let ids: Vec<QpId> = m.qps.keys().copied().collect();
            for qp in ids {
                m.complete(qp);
                if qp != stalled {
                    while m.pipes.get(&qp).is_some_and(|p| !p.is_empty()) {
                        m.deliver(qp);
                    }
                }
            }
            m.pump();
        }
        let held = m.pipes.get(&stalled).map_or(0, |p| p.len());
        m.drain();
        m.check();
        if credits {
            assert!(m.violations.is_empty(), "{:#?}", m.violations);
            assert!(held <= 4, "the stalled path held {held} > channel_window");
        } else {
            assert!(
                m.violations.iter().any(|v| v.contains("refused"))
                    && m.violations.iter().any(|v| v.contains("never delivered")),
                "without credits the window must break here: {:#?}",
                m.violations
            );
        }
    }
}

/// Credits: due every quarter window of progress, only growing, and a credit beyond what
/// was submitted (or for an unknown channel) is ignored and counted, not trusted.
#[test]
fn credits_are_due_every_quarter_window_and_forged_ones_are_ignored() {
    let mut r: Reorderer<u64> = Reorderer::with_credits(8, 4);
    for seq in 0..5 {
        assert_eq!(r.accept(3, seq, seq), metaroce::multipath::Accepted::Taken);
    }
    // Due at 2 (a quarter of 8) and again at 4; taken once, with the latest number.
    assert_eq!(r.poll_credit(), Some((3, 5)));
    assert_eq!(r.poll_credit(), None);
    r.accept(3, 5, 5);
    assert_eq!(r.poll_credit(), None, "one past the report, a quarter is 2");
    r.accept(3, 6, 6);
    assert_eq!(r.poll_credit(), Some((3, 7)));
    assert_eq!(Reorderer::<u8>::new(8, 4).poll_credit(), None);

    let mut s = Scheduler::new(MultipathConfig {
        qps: 1,
        channel_window: 2,
        receiver_credits: true,
        ..MultipathConfig::default()
    })
    .unwrap();
    s.add_qp().unwrap();
    let send = || OpRequest {
        kind: OpKind::Send { channel: 0 },
        len: 1,
        fence: false,
    };
    for _ in 0..6 {
        s.submit(send()).unwrap();
    }
    let now = Instant::now();
    let mut posted = Vec::new();
    let drain = |s: &mut Scheduler, posted: &mut Vec<u64>| {
        while let Some(p) = s.poll_post(now) {
            if let ChunkKind::Notify { seq, .. } = p.kind {
                posted.push(seq);
            }
            s.on_completion(p.wr_id, WcStatus::Success, now);
        }
    };
    drain(&mut s, &mut posted);
    assert_eq!(
        posted,
        vec![0, 1],
        "completions alone do not move the window"
    );
    s.on_credit(0, 7); // beyond the 6 submitted: a forgery
    s.on_credit(9, 1); // no such channel
    drain(&mut s, &mut posted);
    assert_eq!(posted, vec![0, 1]);
    assert_eq!(s.stats().bad_credits, 2);
    s.on_credit(0, 2);
    s.on_credit(0, 1); // older: credits only grow
    drain(&mut s, &mut posted);
    assert_eq!(posted, vec![0, 1, 2, 3]);
    s.on_credit(0, 6);
    drain(&mut s, &mut posted);
    assert_eq!(posted, vec![0, 1, 2, 3, 4, 5]);
}

/// The receiver drops duplicates and refuses what is beyond the window.
#[test]
fn reorderer_orders_dedups_and_bounds() {
    let mut r: Reorderer<&str> = Reorderer::new(4, 2);
    use metaroce::multipath::Accepted::*;
    assert_eq!(r.accept(1, 2, "c"), Taken);
    assert_eq!(r.accept(1, 4, "e"), Refused, "beyond the window of 4");
    assert_eq!(r.poll(), None);
    assert_eq!(r.accept(1, 0, "a"), Taken);
    assert_eq!(r.accept(1, 2, "c again"), Duplicate);
    assert_eq!(r.accept(1, 1, "b"), Taken);
    let got: Vec<_> = std::iter::from_fn(|| r.poll()).collect();
    assert_eq!(got, vec![(1, 0, "a"), (1, 1, "b"), (1, 2, "c")]);
    assert_eq!(r.accept(1, 0, "a again"), Duplicate);
    assert_eq!(r.accept(2, 0, "x"), Taken);
    assert_eq!(
        r.accept(3, 0, "y"),
        Refused,
        "third channel beyond max_channels 2"
    );
    assert_eq!((r.duplicates(), r.refused()), (2, 2));
}

/// Bad configs and requests are refused with a value, not a panic.
#[test]
fn refusals_are_errors() {
    for bad in [
        MultipathConfig {
            qps: 0,
            ..MultipathConfig::default()
        },
        MultipathConfig {
            qps: 65,
            ..MultipathConfig::default()
        },
        MultipathConfig {
            chunk_size: 0,
            ..MultipathConfig::default()
        },
        MultipathConfig {
            qp_depth: 0,
            ..MultipathConfig::default()
        },
    ] {
        assert!(matches!(
            Scheduler::new(bad),
            Err(MultipathError::Config(_))
        ));
    }
    let mut s = Scheduler::new(MultipathConfig {
        qps: 1,
        max_ops: 1,
        ..MultipathConfig::default()
    })
    .unwrap();
    s.add_qp().unwrap();
    assert_eq!(s.add_qp(), Err(MultipathError::NoFreeSlot));
    assert_eq!(
        s.submit(OpRequest {
            kind: OpKind::Send { channel: 0 },
            len: 1 << 33,
            fence: false
        }),
        Err(MultipathError::TooLong)
    );
    s.submit(OpRequest {
        kind: OpKind::Read,
        len: 1,
        fence: false,
    })
    .unwrap();
    assert_eq!(
        s.submit(OpRequest {
            kind: OpKind::Read,
            len: 1,
            fence: false
        }),
        Err(MultipathError::TooManyOps)
    );
    s.on_completion(12345, WcStatus::Success, Instant::now());
    assert_eq!(s.stats().ignored_completions, 1);
    s.fail_all(WcStatus::WrFlushError);
    assert!(matches!(
        s.poll_event(),
        Some(Event::Completed {
            status: WcStatus::WrFlushError,
            ..
        })
    ));
    assert_eq!(s.add_qp(), Err(MultipathError::Closed));
}
