//! The generic workload: one source file, written once against the `metaroce::api` traits,
//! run by every backend's tests (issue #12, item 2).
//!
//! This file is not a test target of `metaroce` (cargo builds only `tests/*.rs` and
//! `tests/*/main.rs`); backends include it with
//!
//! ```text
//! #[path = "../../metaroce/tests/generic/workload.rs"]
//! mod workload;
//! ```
//!
//! from `metaroce-tokio/tests/generic_udp.rs` (UDP loopback, clean and impaired) and
//! `metaroce-verbs/tests/generic_verbs.rs` (rdma_rxe in the CI guest). The including crate
//! needs `metaroce`, `futures` and `tokio` (features `time`, `macros`) as (dev-)dependencies.
//!
//! [`run`] takes two endpoints of the same backend (a server and a client; they may live in
//! one process) and drives both sides in one task, so it needs no spawning:
//!
//! 1. connect/accept;
//! 2. two ordered message streams, client to server, interleaved, sizes 1 B ..
//!    `max_msg`; both streams finished by the client (`Sink::close`), each answered by one
//!    message and finished by the server; order, contents and ends checked;
//! 3. the server sends its region's descriptor (`RemoteRegion::to_bytes`) on a stream;
//! 4. WRITE the first half of the region, WRITE_WITH_IMM the next quarter; the server's
//!    `recv_imm` reports `(imm, len)` and the server checks every byte locally;
//! 5. READ the whole region back (including a quarter the server filled locally) and
//!    compare;
//! 6. fetch_add and compare_swap (a swap that succeeds, one that fails) on an 8-byte word,
//!    checked by return values, a READ and the server's local view;
//! 7. close with a code and reason: the server's `closed()` reports them;
//! 8. on fresh connections: a WRITE with a forged rkey and a WRITE through a descriptor
//!    that claims more than the region has both fail with `RemoteAccessError`, and
//!    nothing lands (separate connections, because on verbs a remote access error moves
//!    the RC QP to the error state).
#![allow(dead_code)]

use futures::future::join;
use futures::{SinkExt, StreamExt};
use metaroce::api::{LocalRegion, OpError, RdmaConnection, RdmaEndpoint, RemoteRegion};
use metaroce::{Access, ConnectionError, WcStatus};
use std::future::Future;
use std::time::Duration;

/// Sizes and counts of the workload.
#[derive(Debug, Clone)]
pub struct Params {
    /// Messages per stream (two streams).
    pub messages_per_stream: usize,
    /// Largest message in bytes (sizes cycle from 1 up to this).
    pub max_msg: usize,
    /// Length of the server's target region in bytes (a multiple of 8, at least 64).
    pub region_len: usize,
    /// Longest wait for any one step before the workload fails with the step's name.
    pub step_timeout: Duration,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            messages_per_stream: 16,
            max_msg: 16 * 1024,
            region_len: 256 * 1024,
            step_timeout: Duration::from_secs(60),
        }
    }
}

/// What the workload moved, to print.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Messages sent, both directions.
    pub messages: usize,
    /// Message bytes sent, both directions.
    pub message_bytes: usize,
    /// Bytes moved by WRITE, WRITE_WITH_IMM and READ.
    pub rdma_bytes: usize,
    /// Atomic operations executed.
    pub atomics: usize,
    /// Operations that failed with the expected `RemoteAccessError`.
    pub access_errors: usize,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Run `fut`, failing with `what` if it takes longer than `p.step_timeout`.
async fn step<T>(p: &Params, what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(p.step_timeout, fut).await {
        Ok(v) => v,
        Err(_) => panic!(
            "workload step `{what}` did not finish in {:?}",
            p.step_timeout
        ),
    }
}

/// The bytes of message `seq` on stream `tag`: a 5-byte header (tag, seq BE) and a
/// pattern; 1 + (seq * 4099 mod max_msg) bytes long, at least 5.
fn message(tag: u8, seq: u32, max_msg: usize) -> Vec<u8> {
    let len = (1 + (seq as usize * 4099) % max_msg).max(5);
    let mut m = Vec::with_capacity(len);
    m.push(tag);
    m.extend_from_slice(&seq.to_be_bytes());
    m.extend((5..len).map(|i| (i as u32 ^ seq ^ u32::from(tag) << 3) as u8));
    m
}

fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31) as u8) ^ (i >> 8) as u8 ^ salt)
        .collect()
}

/// Connect `client` to `server` and accept: `(client side, server side)`.
pub async fn pair<E: RdmaEndpoint>(
    p: &Params,
    server: &E,
    client: &E,
) -> Result<(E::Connection, E::Connection), BoxError> {
    let (c, s) = step(
        p,
        "connect/accept",
        join(client.connect(server.local_addr()), server.accept()),
    )
    .await;
    let s = s.ok_or("server endpoint closed while accepting")??;
    Ok((c?, s))
}

/// The whole workload (see the module docs); panics with the failing step on a wrong
/// result, returns `Err` on an unexpected error.
pub async fn run<E: RdmaEndpoint>(p: &Params, server: &E, client: &E) -> Result<Report, BoxError> {
    assert!(p.region_len >= 64 && p.region_len % 8 == 0);
    let mut report = Report::default();
    let (conn, peer) = pair(p, server, client).await?;
    assert!(conn.remote_addr().is_some() || peer.remote_addr().is_some());

    // ---- 2. two ordered streams ----
    let n = p.messages_per_stream;
    let client_side = async {
        let mut a = conn.open_stream()?;
        let mut b = conn.open_stream()?;
        for seq in 0..n as u32 {
            a.feed(message(0, seq, p.max_msg).into()).await?;
            b.feed(message(1, seq, p.max_msg).into()).await?;
        }
        a.close().await?;
        b.close().await?;
        let mut replies = Vec::new();
        for (tag, s) in [(0u8, &mut a), (1u8, &mut b)] {
            let r = s
                .next()
                .await
                .ok_or("stream ended without the server's reply")??;
            assert_eq!(&r[..], format!("stream {tag}: {n} messages").as_bytes());
            assert!(s.next().await.is_none(), "the server finished stream {tag}");
            replies.push(r.len());
        }
        Ok::<_, BoxError>(replies)
    };
    let server_side = async {
        let mut sent = 0;
        for _ in 0..2 {
            let mut s = peer
                .accept_stream()
                .await
                .ok_or("connection ended before the stream came")?;
            let mut tag = None;
            let mut seq = 0u32;
            while let Some(m) = s.next().await {
                let m = m?;
                let t = *tag.get_or_insert(m[0]);
                assert_eq!(
                    &m[..],
                    &message(t, seq, p.max_msg)[..],
                    "stream {t} message {seq}"
                );
                seq += 1;
            }
            assert_eq!(seq as usize, n, "every message, then the end of the stream");
            let tag = tag.ok_or("empty stream")?;
            let reply = format!("stream {tag}: {n} messages");
            sent += reply.len();
            s.send(reply.into_bytes().into()).await?;
            s.close().await?;
        }
        Ok::<_, BoxError>(sent)
    };
    let (c, s) = step(p, "streams", join(client_side, server_side)).await;
    let (replies, _) = (c?, s?);
    report.messages += 2 * n + replies.len();
    report.message_bytes += (0..n as u32)
        .map(|seq| 2 * message(0, seq, p.max_msg).len())
        .sum::<usize>()
        + replies.iter().sum::<usize>();

    // ---- 3. the server's region, its descriptor sent on a stream ----
    let len = p.region_len;
    let (half, quarter) = (len / 2, len / 4);
    let rights =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let target = server.alloc(len, rights)?;
    assert_eq!(target.len(), len);
    assert!(target.access().contains(Access::REMOTE_WRITE));
    let server_part = pattern(quarter, 0x5a);
    target.write((half + quarter) as u64, &server_part)?;
    let words = server.alloc(64, rights)?;
    words.write(8, &100u64.to_le_bytes())?;
    let mut desc = peer.open_stream()?;
    let mut descs = Vec::new();
    descs.extend_from_slice(&target.remote().to_bytes());
    descs.extend_from_slice(&words.remote().to_bytes());
    // The receiver keeps its stream until the send resolved: a stream dropped before its
    // end asks the sender to stop, and the send in flight would fail.
    let ((), (got, _desc_rx)) = step(p, "descriptor", async {
        let send = async {
            desc.send(descs.into()).await.expect("send the descriptors");
        };
        let recv = async {
            let mut s = conn.accept_stream().await.expect("the descriptor stream");
            let m = s
                .next()
                .await
                .expect("a descriptor message")
                .expect("no error");
            (m, s)
        };
        join(send, recv).await
    })
    .await;
    let n2 = RemoteRegion::ENCODED_LEN;
    assert_eq!(got.len(), 2 * n2);
    let remote = RemoteRegion::from_bytes(&got[..n2]).ok_or("bad descriptor")?;
    let remote_words = RemoteRegion::from_bytes(&got[n2..]).ok_or("bad descriptor")?;
    assert_eq!(remote, target.remote());
    assert_eq!(remote.len, len as u64);
    report.messages += 1;
    report.message_bytes += got.len();

    // ---- 4. WRITE and WRITE_WITH_IMM ----
    let data = pattern(half + quarter, 0xa5);
    let src = client.register(data.clone(), Access::LOCAL_WRITE)?;
    let wc = step(p, "write", conn.write(&src, 0..half as u64, remote, 0)).await?;
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(wc.byte_len as usize, half);
    let imm = 0x00C0_FFEE;
    let range = half as u64..(half + quarter) as u64;
    let (wc, got_imm) = step(
        p,
        "write_with_imm + recv_imm",
        join(
            conn.write_with_imm(&src, range.clone(), remote, half as u64, imm),
            peer.recv_imm(),
        ),
    )
    .await;
    assert_eq!(wc?.status, WcStatus::Success);
    assert_eq!(
        got_imm,
        Some((imm, quarter as u32)),
        "the immediate and its length"
    );
    // Both WRITEs are visible once the immediate is reported.
    assert!(
        target.read(0, (half + quarter) as u64)? == data,
        "the server sees every written byte"
    );
    report.rdma_bytes += half + quarter;

    // ---- 5. READ back the whole region ----
    let dst = client.alloc(len, Access::LOCAL_WRITE)?;
    let wc = step(p, "read", conn.read(&dst, 0..len as u64, remote, 0)).await?;
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(wc.byte_len as usize, len);
    let back = dst.read(0, len as u64)?;
    assert!(
        back[..half + quarter] == data[..],
        "READ returns what was written"
    );
    assert!(
        back[half + quarter..] == server_part[..],
        "READ returns the server's bytes"
    );
    // A READ into part of a region, from an offset of the remote one.
    let mut part = vec![0u8; 100];
    step(p, "read part", conn.read(&dst, 1000..1100, remote, 3)).await?;
    dst.read_into(1000, &mut part)?;
    assert_eq!(&part[..], &data[3..103]);
    report.rdma_bytes += len + 100;

    // ---- 6. atomics ----
    assert_eq!(
        step(p, "fetch_add", conn.fetch_add(remote_words, 8, 5)).await?,
        100
    );
    assert_eq!(
        step(p, "fetch_add", conn.fetch_add(remote_words, 8, 7)).await?,
        105
    );
    let cas = conn.compare_swap(remote_words, 8, 112, 1000);
    assert_eq!(step(p, "compare_swap (equal)", cas).await?, 112);
    let cas = conn.compare_swap(remote_words, 8, 112, 2000);
    assert_eq!(step(p, "compare_swap (differs)", cas).await?, 1000);
    let w = client.alloc(8, Access::LOCAL_WRITE)?;
    step(p, "read atomic word", conn.read(&w, 0..8, remote_words, 8)).await?;
    assert_eq!(w.read(0, 8)?, 1000u64.to_le_bytes());
    assert_eq!(words.read(8, 8)?, 1000u64.to_le_bytes());
    assert_eq!(
        words.read(0, 8)?,
        [0; 8],
        "the neighbouring word is untouched"
    );
    report.atomics += 4;

    // ---- 7. close with a code and reason ----
    conn.close(42, b"workload done");
    let why = step(p, "closed (server)", peer.closed()).await;
    match why {
        ConnectionError::ClosedByPeer { code, reason } => {
            assert_eq!(code, 42);
            assert_eq!(&reason[..], b"workload done");
        }
        other => panic!("the server saw {other:?}, not the client's close"),
    }
    let mine = step(p, "closed (client)", conn.closed()).await;
    assert_eq!(mine, ConnectionError::LocallyClosed);
    let after = step(p, "write after close", conn.write(&src, 0..8, remote, 0)).await;
    assert!(after.is_err(), "no operation after close");

    // ---- 8. remote access errors, each on a fresh connection ----
    let forged = RemoteRegion {
        rkey: remote.rkey ^ 0x5a5a_0f0f,
        ..remote
    };
    // A descriptor that lies about its length: its last 56 bytes are past the region's
    // end. (A backend may check ranges against the descriptor before posting; this one
    // passes that check, and only the responder can refuse it.)
    let past_the_end = RemoteRegion {
        addr: remote.addr_at(len as u64 - 8).ok_or("address")?,
        len: 64,
        rkey: remote.rkey,
    };
    for (what, dst) in [
        ("forged rkey", forged),
        ("range past the end", past_the_end),
    ] {
        let (c2, s2) = pair(p, server, client).await?;
        let r = step(p, what, c2.write(&src, 0..64, dst, 0)).await;
        let e = r
            .err()
            .unwrap_or_else(|| panic!("a WRITE with a {what} succeeded"));
        assert_eq!(
            e.wc_status(),
            Some(WcStatus::RemoteAccessError),
            "{what}: {e}"
        );
        report.access_errors += 1;
        c2.close(0, b"");
        drop(s2);
    }
    // Nothing of the refused WRITEs landed.
    assert!(target.read(0, len as u64)?[half + quarter..] == server_part[..]);
    Ok(report)
}
