//! `Impaired<UdpBackend>` over loopback: loss (deterministic per seed), duplication,
//! corruption, delay, reordering, CE marking, rate limiting, input checks; and over a
//! recording backend: the inline path's GSO re-batching, resumption after `Pending`, order.

use std::collections::BTreeSet;
use std::future::poll_fn;
use std::io::{self, IoSliceMut};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use metaroce::{EcnCodepoint, Transmit};
use metaroce_tokio::backend::{
    DatagramBackend, ImpairError, ImpairStats, Impaired, Impairment, RecvMeta, UdpBackend,
};
use tokio::time::Instant;

fn loopback() -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0)
}

async fn send(b: &impl DatagramBackend, t: &Transmit, contents: &[u8]) -> io::Result<()> {
    poll_fn(|cx| b.poll_send(cx, t, contents)).await
}

/// A datagram as received.
#[derive(Clone)]
struct Got {
    at: Instant,
    ecn: Option<EcnCodepoint>,
    bytes: Vec<u8>,
}

impl Got {
    fn seq(&self) -> u32 {
        u32::from_be_bytes(self.bytes[..4].try_into().unwrap())
    }
}

/// A sender wrapped in impairments and a receiver drained by a background task.
struct Pair {
    tx: Impaired<UdpBackend>,
    dest: SocketAddr,
    port: u16,
    got: Arc<Mutex<Vec<Got>>>,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for Pair {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Pair {
    fn new(imp: Impairment) -> Pair {
        let tx = Impaired::new(UdpBackend::bind(loopback(), 2).unwrap(), imp).unwrap();
        let rx = UdpBackend::bind(loopback(), 1).unwrap();
        let dest = rx.local_addr();
        let port = tx.source_ports()[1];
        let got = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&got);
        let reader = tokio::spawn(async move {
            let mut bufs = vec![vec![0u8; 65_536]; 8];
            let mut meta = [RecvMeta::default(); 8];
            loop {
                let n = poll_fn(|cx| {
                    let mut slices: Vec<IoSliceMut<'_>> =
                        bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
                    rx.poll_recv(cx, &mut slices, &mut meta)
                })
                .await
                .expect("poll_recv");
                let at = Instant::now();
                let mut sink = sink.lock().unwrap();
                for (m, buf) in meta[..n].iter().zip(&bufs) {
                    for d in m.datagrams(buf) {
                        sink.push(Got {
                            at,
                            ecn: m.ecn,
                            bytes: d.to_vec(),
                        });
                    }
                }
            }
        });
        Pair {
            tx,
            dest,
            port,
            got,
            reader,
        }
    }

    fn transmit(&self, size: usize, segment_size: Option<usize>) -> Transmit {
        Transmit {
            destination: self.dest,
            src_port: self.port,
            ecn: Some(EcnCodepoint::Ect0),
            size,
            segment_size,
        }
    }

    /// Sends one datagram carrying `seq` followed by `len - 4` filler bytes.
    async fn send_seq(&self, seq: u32, len: usize) {
        let mut d = vec![0xA5u8; len.max(4)];
        d[..4].copy_from_slice(&seq.to_be_bytes());
        send(&self.tx, &self.transmit(d.len(), None), &d)
            .await
            .unwrap();
    }

    fn received(&self) -> Vec<Got> {
        self.got.lock().unwrap().clone()
    }

    /// Waits (up to 5 s) until every datagram handed to the impairment layer is accounted
    /// for (dropped or sent) and everything sent has been received.
    async fn settle(&self) -> ImpairStats {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let s = self.tx.stats();
            let accounted = s.dropped + s.queue_dropped + s.sent + s.send_errors;
            let done = accounted == s.seen + s.duplicated
                && self.got.lock().unwrap().len() as u64 >= s.sent;
            if done || Instant::now() > deadline {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

/// Sends 2000 numbered datagrams under 30 % loss, in batches so that the kernel never
/// drops any, and returns the set of sequence numbers received.
async fn lossy_run(seed: u64) -> BTreeSet<u32> {
    let pair = Pair::new(Impairment {
        loss: 0.3,
        seed,
        ..Default::default()
    });
    for batch in 0..20u32 {
        for i in 0..100 {
            pair.send_seq(batch * 100 + i, 32).await;
        }
        pair.settle().await;
    }
    let s = pair.settle().await;
    let got: BTreeSet<u32> = pair.received().iter().map(Got::seq).collect();
    assert_eq!(s.seen, 2000);
    assert_eq!(s.send_errors, 0);
    assert_eq!(got.len() as u64, s.sent, "no duplicates, no kernel drops");
    assert_eq!(s.dropped + s.sent, 2000);
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loss_is_plausible_and_deterministic_per_seed() {
    let first = lossy_run(42).await;
    let second = lossy_run(42).await;
    assert!(
        (1250..=1550).contains(&first.len()),
        "{} received",
        first.len()
    );
    assert_eq!(first, second, "same seed, same sends, same survivors");
    let other = lossy_run(43).await;
    assert_ne!(first, other, "another seed drops other datagrams");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_sends_everything_twice() {
    let pair = Pair::new(Impairment {
        duplicate: 1.0,
        ..Default::default()
    });
    for seq in 0..100 {
        pair.send_seq(seq, 64).await;
    }
    let s = pair.settle().await;
    assert_eq!(s.duplicated, 100);
    let got = pair.received();
    assert_eq!(got.len(), 200);
    let mut counts = [0u32; 100];
    for g in &got {
        counts[g.seq() as usize] += 1;
    }
    assert!(counts.iter().all(|&c| c == 2), "{counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_changes_exactly_one_byte() {
    let pair = Pair::new(Impairment {
        corrupt: 1.0,
        seed: 5,
        ..Default::default()
    });
    let mut positions = BTreeSet::new();
    for i in 0..30u8 {
        let original: Vec<u8> = (0..64).map(|j| i.wrapping_mul(7).wrapping_add(j)).collect();
        send(&pair.tx, &pair.transmit(64, None), &original)
            .await
            .unwrap();
        pair.settle().await;
        let got = pair.received();
        assert_eq!(got.len(), i as usize + 1);
        let received = &got[i as usize].bytes;
        assert_eq!(received.len(), original.len());
        let diffs: Vec<usize> = (0..64).filter(|&j| received[j] != original[j]).collect();
        assert_eq!(diffs.len(), 1, "datagram {i}: {diffs:?}");
        positions.insert(diffs[0]);
    }
    assert!(
        positions.len() > 5,
        "corrupted positions vary: {positions:?}"
    );
    assert_eq!(pair.tx.stats().corrupted, 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_holds_datagrams_even_without_further_sends() {
    let pair = Pair::new(Impairment {
        delay: Duration::from_millis(20),
        ..Default::default()
    });
    let start = Instant::now();
    for seq in 0..5 {
        pair.send_seq(seq, 100).await;
    }
    // Nothing else is sent: the held datagrams must still go out.
    let s = pair.settle().await;
    assert_eq!(s.delayed, 5);
    let got = pair.received();
    assert_eq!(got.len(), 5);
    for g in &got {
        assert!(
            g.at - start >= Duration::from_millis(20),
            "{:?}",
            g.at - start
        );
    }
    // A constant delay keeps the order.
    let seqs: Vec<u32> = got.iter().map(Got::seq).collect();
    assert_eq!(seqs, [0, 1, 2, 3, 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reorder_lets_later_datagrams_overtake() {
    let pair = Pair::new(Impairment {
        reorder: 0.3,
        reorder_delay: Duration::from_millis(15),
        seed: 9,
        ..Default::default()
    });
    for seq in 0..100 {
        pair.send_seq(seq, 64).await;
    }
    let s = pair.settle().await;
    assert!(s.reordered > 0);
    let seqs: Vec<u32> = pair.received().iter().map(Got::seq).collect();
    assert_eq!(seqs.len(), 100);
    let inversions = seqs.windows(2).filter(|w| w[0] > w[1]).count();
    assert!(inversions > 0, "{seqs:?}");
    let all: BTreeSet<u32> = seqs.iter().copied().collect();
    assert_eq!(all.len(), 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ce_mark_remarks_ecn_capable_datagrams() {
    let pair = Pair::new(Impairment {
        ce_mark: 1.0,
        ..Default::default()
    });
    send(&pair.tx, &pair.transmit(10, None), &[1u8; 10])
        .await
        .unwrap();
    let not_ect = Transmit {
        ecn: None,
        ..pair.transmit(10, None)
    };
    send(&pair.tx, &not_ect, &[2u8; 10]).await.unwrap();
    let s = pair.settle().await;
    assert_eq!(s.ce_marked, 1);
    let got = pair.received();
    assert_eq!(got.len(), 2);
    let by_byte = |b: u8| got.iter().find(|g| g.bytes[0] == b).unwrap().ecn;
    assert_eq!(by_byte(1), Some(EcnCodepoint::Ce));
    assert_eq!(by_byte(2), None, "Not-ECT is never marked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gso_transmits_are_impaired_per_segment() {
    let pair = Pair::new(Impairment::default());
    let contents: Vec<u8> = (0..10u32)
        .flat_map(|i| {
            let mut d = vec![i as u8; 1200];
            d[..4].copy_from_slice(&i.to_be_bytes());
            d
        })
        .collect();
    send(&pair.tx, &pair.transmit(12_000, Some(1200)), &contents)
        .await
        .unwrap();
    let s = pair.settle().await;
    assert_eq!(s.seen, 10);
    let got = pair.received();
    let seqs: Vec<u32> = got.iter().map(Got::seq).collect();
    assert_eq!(seqs, (0..10).collect::<Vec<_>>());
    assert!(got.iter().all(|g| g.bytes.len() == 1200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_paces_datagrams() {
    // 8 Mbit/s: 20 datagrams of 1000 bytes occupy the link for 20 ms.
    let pair = Pair::new(Impairment {
        rate_limit_bps: Some(8_000_000),
        ..Default::default()
    });
    let start = Instant::now();
    for seq in 0..20 {
        pair.send_seq(seq, 1000).await;
    }
    let s = pair.settle().await;
    assert_eq!(s.sent, 20);
    let last = pair.received().iter().map(|g| g.at).max().unwrap();
    assert!(
        last - start >= Duration::from_millis(19),
        "{:?}",
        last - start
    );
}

#[tokio::test]
async fn invalid_inputs_are_rejected() {
    let bad = Impairment {
        loss: 1.5,
        ..Default::default()
    };
    let e = bad.validate().unwrap_err();
    assert_eq!(e.field(), "loss");
    assert_eq!(
        e.to_string(),
        "loss must be a probability in [0, 1], got 1.5"
    );
    let inner = UdpBackend::bind(loopback(), 1).unwrap();
    assert!(matches!(
        Impaired::new(inner, bad),
        Err(ImpairError::Invalid(_))
    ));

    let pair = Pair::new(Impairment::default());
    // The wrapper reports its inner socket's buffer (the endpoint's window grant).
    assert_eq!(
        pair.tx.socket_recv_buffer(),
        pair.tx.inner().socket_recv_buffer()
    );
    assert!(pair.tx.socket_recv_buffer().is_some());
    let t = Transmit {
        src_port: pair.tx.local_addr().port(),
        ..pair.transmit(4, None)
    };
    let err = send(&pair.tx, &t, &[0u8; 4]).await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    let err = send(&pair.tx, &pair.transmit(5, None), &[0u8; 4])
        .await
        .unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    assert_eq!(pair.tx.stats().seen, 0);
    assert!(pair
        .tx
        .set_impairment(Impairment {
            duplicate: f64::INFINITY,
            ..Default::default()
        })
        .is_err());
}

#[test]
fn impaired_needs_a_runtime() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let inner = rt.block_on(async { UdpBackend::bind(loopback(), 1).unwrap() });
    assert_eq!(
        Impaired::new(inner, Impairment::default()).unwrap_err(),
        ImpairError::NoRuntime
    );
}

/// `n` datagrams of `seg` bytes (at least 12): the sequence number `first + i` three times,
/// then a pattern of it.
fn numbered(first: u32, n: u32, seg: usize) -> Vec<u8> {
    (first..first + n)
        .flat_map(|i| {
            let mut d: Vec<u8> = (0..seg).map(|j| (i as usize * 31 + j) as u8).collect();
            for k in 0..3 {
                d[4 * k..4 * k + 4].copy_from_slice(&i.to_be_bytes());
            }
            d
        })
        .collect()
}

/// The sequence number of a [`numbered`] datagram, by majority (one byte may be corrupted).
fn seq_of(d: &[u8]) -> u32 {
    let at = |k: usize| u32::from_be_bytes(d[4 * k..4 * k + 4].try_into().unwrap());
    if at(0) == at(1) || at(0) == at(2) {
        at(0)
    } else {
        at(1)
    }
}

/// Over loopback with no impairment, a 64-segment GSO transmit arrives whole and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lossless_gso_batch_arrives_complete_and_in_order() {
    let pair = Pair::new(Impairment::default());
    let contents = numbered(0, 64, 1024);
    send(
        &pair.tx,
        &pair.transmit(contents.len(), Some(1024)),
        &contents,
    )
    .await
    .unwrap();
    let s = pair.settle().await;
    assert_eq!(s.seen, 64);
    assert_eq!(s.sent, 64);
    assert_eq!((s.delayed, s.held_datagrams, s.held_bytes), (0, 0, 0));
    let got = pair.received();
    assert_eq!(got.len(), 64);
    for (i, g) in got.iter().enumerate() {
        assert_eq!(g.bytes, contents[i * 1024..(i + 1) * 1024], "datagram {i}");
        assert_eq!(g.ecn, Some(EcnCodepoint::Ect0));
    }
}

/// Sends 10 GSO transmits of 64 numbered datagrams under 50 % loss over loopback; checks
/// that the survivors arrive in order with their bytes, and returns their numbers.
async fn lossy_gso_run(seed: u64) -> Vec<u32> {
    let pair = Pair::new(Impairment {
        loss: 0.5,
        seed,
        ..Default::default()
    });
    let seg = 1000;
    let mut all = Vec::new();
    for batch in 0..10u32 {
        let contents = numbered(batch * 64, 64, seg);
        send(
            &pair.tx,
            &pair.transmit(contents.len(), Some(seg)),
            &contents,
        )
        .await
        .unwrap();
        all.extend_from_slice(&contents);
        pair.settle().await;
    }
    let s = pair.settle().await;
    assert_eq!(s.seen, 640);
    assert_eq!(s.dropped + s.sent, 640);
    assert_eq!(s.send_errors, 0);
    let got = pair.received();
    assert_eq!(got.len() as u64, s.sent);
    assert!((220..=420).contains(&got.len()), "{} survivors", got.len());
    let seqs: Vec<u32> = got.iter().map(Got::seq).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "in order: {seqs:?}");
    for g in &got {
        let i = g.seq() as usize;
        assert_eq!(g.bytes, all[i * seg..(i + 1) * seg], "datagram {i}");
    }
    seqs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lossy_gso_survivors_arrive_in_order_and_deterministically() {
    let first = lossy_gso_run(11).await;
    let second = lossy_gso_run(11).await;
    assert_eq!(first, second, "same seed, same sends, same survivors");
    assert_ne!(first, lossy_gso_run(12).await);
}

/// A backend that records what it is asked to send, and returns `Pending` (waking at once)
/// on chosen calls.
#[derive(Debug, Default)]
struct Recorder {
    sent: Mutex<Vec<(Transmit, Vec<u8>)>>,
    /// 1-based numbers of the `poll_send` calls that return `Pending`.
    pending_at: Mutex<BTreeSet<usize>>,
    polls: AtomicUsize,
}

const REC_PORTS: [u16; 2] = [4000, 4001];

impl Recorder {
    fn pending_at(calls: impl IntoIterator<Item = usize>) -> Self {
        Self {
            pending_at: Mutex::new(calls.into_iter().collect()),
            ..Default::default()
        }
    }

    fn transmits(&self) -> Vec<(Transmit, Vec<u8>)> {
        self.sent.lock().unwrap().clone()
    }

    /// Every datagram sent so far, with its ECN.
    fn datagrams(&self) -> Vec<(Option<EcnCodepoint>, Vec<u8>)> {
        let mut out = Vec::new();
        for (t, bytes) in self.sent.lock().unwrap().iter() {
            let seg = t.segment_size.unwrap_or(bytes.len()).max(1);
            for d in bytes.chunks(seg) {
                out.push((t.ecn, d.to_vec()));
            }
        }
        out
    }
}

impl DatagramBackend for Recorder {
    fn local_addr(&self) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 3999)
    }

    fn source_ports(&self) -> Vec<u16> {
        REC_PORTS.to_vec()
    }

    fn max_gso_segments(&self) -> usize {
        64
    }

    fn max_gro_segments(&self) -> usize {
        1
    }

    fn poll_recv(
        &self,
        _cx: &mut Context<'_>,
        _bufs: &mut [IoSliceMut<'_>],
        _meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        Poll::Pending
    }

    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        transmit: &Transmit,
        contents: &[u8],
    ) -> Poll<io::Result<()>> {
        assert_eq!(transmit.size, contents.len());
        let n = self.polls.fetch_add(1, Ordering::SeqCst) + 1;
        if self.pending_at.lock().unwrap().remove(&n) {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.sent
            .lock()
            .unwrap()
            .push((*transmit, contents.to_vec()));
        Poll::Ready(Ok(()))
    }
}

fn rec_transmit(size: usize, segment_size: Option<usize>) -> Transmit {
    Transmit {
        destination: "127.0.0.1:5000".parse().unwrap(),
        src_port: REC_PORTS[0],
        ecn: Some(EcnCodepoint::Ect0),
        size,
        segment_size,
    }
}

/// Waits (up to 5 s) until everything handed to `b` is dropped or sent.
async fn settle_rec(b: &Impaired<Recorder>) -> ImpairStats {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let s = b.stats();
        if s.dropped + s.queue_dropped + s.sent + s.send_errors == s.seen + s.duplicated
            || Instant::now() > deadline
        {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test]
async fn lossless_gso_transmit_goes_through_as_one_gso_send() {
    let b = Impaired::new(Recorder::default(), Impairment::default()).unwrap();
    let contents = numbered(0, 64, 4096);
    let t = rec_transmit(contents.len(), Some(4096));
    send(&b, &t, &contents).await.unwrap();
    // Sent inline: accounted for as soon as `poll_send` returns.
    let s = b.stats();
    assert_eq!((s.seen, s.sent, s.held_datagrams), (64, 64, 0));
    let sent = b.inner().transmits();
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].0, t);
    assert_eq!(sent[0].1, contents);
}

#[tokio::test]
async fn lossy_gso_survivors_are_rebatched() {
    let run = || async {
        let b = Impaired::new(
            Recorder::default(),
            Impairment {
                loss: 0.5,
                seed: 21,
                ..Default::default()
            },
        )
        .unwrap();
        let contents = numbered(0, 64, 1000);
        send(&b, &rec_transmit(contents.len(), Some(1000)), &contents)
            .await
            .unwrap();
        let s = b.stats();
        assert_eq!(s.dropped + s.sent, 64);
        assert!((16..=48).contains(&s.sent), "{s:?}");
        let sent = b.inner().transmits();
        assert_eq!(sent.len(), 1, "the survivors make one GSO transmit");
        assert_eq!(sent[0].0.segment_size, Some(1000));
        let datagrams = b.inner().datagrams();
        assert_eq!(datagrams.len() as u64, s.sent);
        let seqs: Vec<u32> = datagrams.iter().map(|(_, d)| seq_of(d)).collect();
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
        for (_, d) in &datagrams {
            let i = seq_of(d) as usize;
            assert_eq!(d[..], contents[i * 1000..(i + 1) * 1000]);
        }
        seqs
    };
    assert_eq!(run().await, run().await, "deterministic");
}

/// Everything random at once, inline: CE-marked datagrams go in transmits of their own ECN,
/// copies follow their original, corrupted ones differ in exactly one byte.
async fn mixed_run(pending_at: &[usize]) -> (Vec<(Option<EcnCodepoint>, Vec<u8>)>, ImpairStats) {
    let b = Impaired::new(
        Recorder::pending_at(pending_at.iter().copied()),
        Impairment {
            loss: 0.2,
            duplicate: 0.2,
            corrupt: 0.2,
            ce_mark: 0.2,
            seed: 77,
            ..Default::default()
        },
    )
    .unwrap();
    let seg = 512;
    let mut all = Vec::new();
    for batch in 0..4u32 {
        let mut contents = numbered(batch * 64, 64, seg);
        // A short last datagram.
        contents.truncate(contents.len() - 100);
        send(&b, &rec_transmit(contents.len(), Some(seg)), &contents)
            .await
            .unwrap();
        all.push(contents);
    }
    let s = b.stats();
    assert_eq!(s.seen, 256);
    assert_eq!(s.sent, s.seen + s.duplicated - s.dropped);
    assert_eq!(
        b.inner().polls.load(Ordering::SeqCst),
        b.inner().transmits().len() + pending_at.len()
    );
    let datagrams = b.inner().datagrams();
    assert_eq!(datagrams.len() as u64, s.sent);
    let (mut ce, mut corrupted) = (0, 0);
    let mut last: Option<(u32, Vec<u8>)> = None;
    for (ecn, d) in &datagrams {
        if *ecn == Some(EcnCodepoint::Ce) {
            ce += 1;
        } else {
            assert_eq!(*ecn, Some(EcnCodepoint::Ect0));
        }
        let i = seq_of(d);
        let contents = &all[(i / 64) as usize];
        let at = (i % 64) as usize * seg;
        let original = &contents[at..(at + seg).min(contents.len())];
        assert_eq!(d.len(), original.len());
        let diffs = d.iter().zip(original).filter(|(a, b)| a != b).count();
        match &last {
            // A copy: identical to the original right before it.
            Some((prev, bytes)) if *prev == i => assert_eq!(bytes, d),
            Some((prev, _)) => {
                assert!(*prev < i, "order: {prev} then {i}");
                corrupted += u64::from(diffs == 1);
            }
            None => corrupted += u64::from(diffs == 1),
        }
        assert!(diffs <= 1);
        last = Some((i, d.clone()));
    }
    // Batching happened.
    assert!(b.inner().transmits().len() * 2 < datagrams.len());
    // CE-marked originals, and their copies.
    assert!(s.ce_marked > 0 && (s.ce_marked..=2 * s.ce_marked).contains(&ce));
    // Copies of corrupted datagrams are not counted above.
    assert!(
        s.corrupted > 0 && corrupted == s.corrupted,
        "{corrupted} {s:?}"
    );
    (datagrams, s)
}

#[tokio::test]
async fn mixed_impairments_inline() {
    let (reference, s) = mixed_run(&[]).await;
    assert!(s.duplicated > 0 && s.dropped > 0);
    // Same decisions on a second run.
    let (again, _) = mixed_run(&[]).await;
    assert_eq!(reference, again);
}

#[tokio::test]
async fn pending_mid_transmit_resumes_without_redrawing() {
    let (reference, ref_stats) = mixed_run(&[]).await;
    // The inner backend stalls on several sends, including the first of a transmit.
    let (resumed, stats) = mixed_run(&[1, 3, 4, 10, 20]).await;
    assert_eq!(resumed, reference);
    assert_eq!(stats, ref_stats);
}

#[tokio::test]
async fn abandoned_transmit_counts_its_unsent_datagrams_as_errors() {
    let b = Impaired::new(Recorder::pending_at([1]), Impairment::default()).unwrap();
    let mut cx = Context::from_waker(futures::task::noop_waker_ref());
    let first = numbered(0, 8, 100);
    let t = rec_transmit(first.len(), Some(100));
    assert!(b.poll_send(&mut cx, &t, &first).is_pending());
    // The caller gives that transmit up and sends another one.
    let second = numbered(8, 2, 100);
    let t2 = rec_transmit(second.len(), Some(100));
    assert!(matches!(
        b.poll_send(&mut cx, &t2, &second),
        Poll::Ready(Ok(()))
    ));
    let s = b.stats();
    assert_eq!((s.seen, s.sent, s.send_errors), (10, 2, 8));
    assert_eq!(b.inner().datagrams().len(), 2);
}

/// With reordering, only the datagrams picked for it arrive late: the inline path never lets
/// a datagram overtake one held for the same destination that is already due.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reorder_with_inline_path_only_delays_picked_datagrams() {
    let b = Impaired::new(
        Recorder::default(),
        Impairment {
            reorder: 0.05,
            reorder_delay: Duration::from_millis(3),
            seed: 4,
            ..Default::default()
        },
    )
    .unwrap();
    for batch in 0..40u32 {
        let contents = numbered(batch * 16, 16, 200);
        send(&b, &rec_transmit(contents.len(), Some(200)), &contents)
            .await
            .unwrap();
        if batch % 8 == 0 {
            tokio::time::sleep(Duration::from_millis(4)).await;
        }
    }
    let s = settle_rec(&b).await;
    assert_eq!(s.sent, 640);
    assert!(s.reordered > 0);
    let seqs: Vec<u32> = b
        .inner()
        .datagrams()
        .iter()
        .map(|(_, d)| seq_of(d))
        .collect();
    assert_eq!(seqs.iter().collect::<BTreeSet<_>>().len(), 640);
    // A datagram is late if a higher number went out before it.
    let mut max = None;
    let mut late = 0;
    for &q in &seqs {
        if max.is_some_and(|m| m > q) {
            late += 1;
        }
        max = max.max(Some(q));
    }
    assert!(late > 0);
    assert!(
        late as u64 <= s.reordered,
        "{late} late, {} reordered",
        s.reordered
    );
}

/// Send throughput of `Impaired` (no impairment, and 1 % loss) against the bare
/// `UdpBackend` over loopback: 200 000 datagrams of 4 KiB in GSO transmits of 32, timed until
/// the impairment layer has handed everything to the kernel. Run with
/// `cargo test --release -p metaroce-tokio --test backend_impair -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "throughput measurement"]
async fn throughput_impaired_vs_plain_udp() {
    const DATAGRAMS: usize = 200_000;
    const SEG: usize = 4096;
    const BATCH: usize = 32;
    const ROUNDS: u32 = 5;
    let contents = vec![0x5Au8; SEG * BATCH];

    /// CPU time (user + system, in clock ticks) of this process so far, on Linux.
    fn cpu_ticks() -> u64 {
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map_or("", |(_, rest)| rest)
            .split_whitespace()
            .collect();
        let field = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
        field(11).unwrap_or(0) + field(12).unwrap_or(0)
    }

    /// Wall time and CPU ticks of one run.
    async fn run<B: DatagramBackend>(
        b: &B,
        dest: SocketAddr,
        contents: &[u8],
        stats: impl Fn(&B) -> Option<ImpairStats>,
    ) -> (Duration, u64) {
        let t = Transmit {
            destination: dest,
            src_port: b.source_ports()[0],
            ecn: Some(EcnCodepoint::Ect0),
            size: contents.len(),
            segment_size: Some(SEG),
        };
        let cpu = cpu_ticks();
        let start = std::time::Instant::now();
        for _ in 0..DATAGRAMS / BATCH {
            send(b, &t, contents).await.unwrap();
        }
        // Until everything queued is sent (dropped, for a too-long queue).
        while let Some(s) = stats(b) {
            if s.dropped + s.queue_dropped + s.sent + s.send_errors == s.seen + s.duplicated {
                break;
            }
            tokio::task::yield_now().await;
        }
        (start.elapsed(), cpu_ticks() - cpu)
    }
    let none = |_: &UdpBackend| None;
    let some = |b: &Impaired<UdpBackend>| Some(b.stats());

    // Nobody reads the sink: the kernel drops at its receive queue, the same for all.
    let sink = UdpBackend::bind(loopback(), 1).unwrap();
    let dest = sink.local_addr();
    let plain = UdpBackend::bind(loopback(), 1).unwrap();
    let lossless = Impaired::new(
        UdpBackend::bind(loopback(), 1).unwrap(),
        Impairment::default(),
    )
    .unwrap();
    let lossy = Impaired::new(
        UdpBackend::bind(loopback(), 1).unwrap(),
        Impairment {
            loss: 0.01,
            seed: 1,
            ..Default::default()
        },
    )
    .unwrap();
    // Warm up, then alternate to even out noise.
    run(&plain, dest, &contents, none).await;
    run(&lossless, dest, &contents, some).await;
    let mut total = [(Duration::ZERO, 0u64); 3];
    let add = |t: &mut (Duration, u64), (d, c): (Duration, u64)| {
        t.0 += d;
        t.1 += c;
    };
    for _ in 0..ROUNDS {
        add(&mut total[0], run(&plain, dest, &contents, none).await);
        add(&mut total[1], run(&lossless, dest, &contents, some).await);
        add(&mut total[2], run(&lossy, dest, &contents, some).await);
    }
    let gbps =
        |d: Duration| f64::from(ROUNDS) * (DATAGRAMS * SEG) as f64 * 8.0 / d.as_secs_f64() / 1e9;
    let [p, i, l] = total;
    println!(
        "plain UdpBackend: {:.2} Gbit/s; Impaired loss 0: {:.2} Gbit/s; Impaired loss 0.01: \
         {:.2} Gbit/s",
        gbps(p.0),
        gbps(i.0),
        gbps(l.0)
    );
    println!(
        "Impaired / plain, wall time: loss 0 {:.3}, loss 0.01 {:.3}; CPU time: loss 0 {:.3}, \
         loss 0.01 {:.3}",
        i.0.as_secs_f64() / p.0.as_secs_f64(),
        l.0.as_secs_f64() / p.0.as_secs_f64(),
        i.1 as f64 / p.1.max(1) as f64,
        l.1 as f64 / p.1.max(1) as f64,
    );
    println!("loss 0: {:?}", lossless.stats());
    println!("loss 0.01: {:?}", lossy.stats());
}
