//! Generic error checks, written once against the `metaroce::api` traits like
//! `workload.rs` (include both: this file uses `super::workload::{pair, Params}`):
//!
//! ```text
//! #[path = "../../metaroce/tests/generic/workload.rs"]
//! mod workload;
//! #[path = "../../metaroce/tests/generic/errors.rs"]
//! mod errors;
//! ```
//!
//! * [`access_rights`]: every missing right and a forged rkey fail with
//!   `IBV_WC_REM_ACCESS_ERR` (`WcStatus::RemoteAccessError`), for WRITE, READ and both
//!   atomics, and leave the target untouched; each case on a fresh connection (on verbs
//!   the error moves the RC QP to the error state);
//! * [`flush_on_close`]: operations in flight when the connection is closed locally all
//!   resolve, each either successfully or flushed (`WrFlushError`, or an error naming the
//!   connection's end); operations posted after the close fail.
#![allow(dead_code)]

use super::workload::{pair, Params};
use futures::future::join_all;
use metaroce::api::{LocalRegion, OpError, RdmaConnection, RdmaEndpoint, RemoteRegion};
use metaroce::{Access, WcStatus};
use std::future::Future;
use std::pin::pin;
use std::task::Poll;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

async fn step<T>(p: &Params, what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(p.step_timeout, fut).await {
        Ok(v) => v,
        Err(_) => panic!(
            "error check `{what}` did not finish in {:?}",
            p.step_timeout
        ),
    }
}

/// Expect `r` to be a remote access error.
fn remote_access<T: std::fmt::Debug, E: OpError>(what: &str, r: Result<T, E>) {
    match r {
        Ok(v) => panic!("{what}: succeeded ({v:?}), expected a remote access error"),
        Err(e) => assert_eq!(
            e.wc_status(),
            Some(WcStatus::RemoteAccessError),
            "{what}: {e}"
        ),
    }
}

/// Every missing access right, and a forged rkey, refused with `RemoteAccessError`;
/// returns how many cases ran.
pub async fn access_rights<E: RdmaEndpoint>(
    p: &Params,
    server: &E,
    client: &E,
) -> Result<usize, BoxError> {
    let lw = Access::LOCAL_WRITE;
    let all = lw | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let filled = |len: usize| (0..len).map(|i| i as u8 | 1).collect::<Vec<u8>>();
    // One region per missing right; each starts with known bytes.
    let no_write = server.register(filled(4096), lw | Access::REMOTE_READ)?;
    let no_read = server.register(filled(4096), lw | Access::REMOTE_WRITE)?;
    let no_atomic = server.register(filled(64), lw | Access::REMOTE_WRITE | Access::REMOTE_READ)?;
    let open = server.register(filled(4096), all)?;
    let src = client.register(vec![0xEE; 4096], lw)?;
    let dst = client.alloc(4096, lw)?;
    let forged = |r: RemoteRegion| RemoteRegion {
        rkey: r.rkey ^ 0x00a5_5a00,
        ..r
    };

    let mut cases = 0;
    for case in 0..6 {
        let (conn, peer) = pair(p, server, client).await?;
        let what = match case {
            0 => {
                let r = conn.write(&src, 0..4096, no_write.remote(), 0);
                remote_access("WRITE without REMOTE_WRITE", step(p, "write", r).await);
                "write"
            }
            1 => {
                let r = conn.write_with_imm(&src, 0..64, no_write.remote(), 0, 9);
                remote_access(
                    "WRITE_WITH_IMM without REMOTE_WRITE",
                    step(p, "imm", r).await,
                );
                "write_with_imm"
            }
            2 => {
                let r = conn.read(&dst, 0..4096, no_read.remote(), 0);
                remote_access("READ without REMOTE_READ", step(p, "read", r).await);
                "read"
            }
            3 => {
                let r = conn.fetch_add(no_atomic.remote(), 8, 1);
                remote_access("FETCH_ADD without REMOTE_ATOMIC", step(p, "fa", r).await);
                "fetch_add"
            }
            4 => {
                let r = conn.compare_swap(forged(open.remote()), 8, 0, 1);
                remote_access("CMP_SWP with a forged rkey", step(p, "cas", r).await);
                "compare_swap"
            }
            _ => {
                let r = conn.read(&dst, 0..4096, forged(open.remote()), 0);
                remote_access("READ with a forged rkey", step(p, "read", r).await);
                "read forged"
            }
        };
        cases += 1;
        // No WRITE_WITH_IMM that was refused may be reported at the peer.
        if what == "write_with_imm" {
            conn.close(0, b"");
            let imm = step(p, "recv_imm after refusal", peer.recv_imm()).await;
            assert_eq!(imm, None, "a refused WRITE_WITH_IMM reported its immediate");
        } else {
            conn.close(0, b"");
        }
    }
    // Nothing of the refused operations landed, and the client's READ target was not
    // written by a refused READ.
    assert!(
        no_write.read(0, 4096)? == filled(4096),
        "refused WRITEs wrote nothing"
    );
    assert!(no_read.read(0, 4096)? == filled(4096));
    assert!(
        no_atomic.read(0, 64)? == filled(64),
        "refused atomic changed nothing"
    );
    assert!(
        open.read(0, 4096)? == filled(4096),
        "forged rkeys changed nothing"
    );
    assert!(
        dst.read(0, 4096)? == vec![0; 4096],
        "refused READs placed nothing"
    );
    Ok(cases)
}

/// What [`flush_on_close`] saw.
#[derive(Debug, Default, Clone)]
pub struct Flushed {
    /// Operations that completed before the close took effect.
    pub completed: usize,
    /// Operations that failed with `WrFlushError`.
    pub flushed: usize,
    /// Operations that failed with an error naming the connection's end (no status).
    pub connection_ended: usize,
}

/// `ops` WRITEs of `len` bytes each are posted, `between` runs (a backend's test may cut
/// the network there, so that none can complete), then the connection is closed locally:
/// every one resolves (no hang), each successfully or flushed; a WRITE posted after the
/// close fails.
pub async fn flush_on_close<E: RdmaEndpoint>(
    p: &Params,
    server: &E,
    client: &E,
    ops: usize,
    len: usize,
    between: impl FnOnce(),
) -> Result<Flushed, BoxError> {
    let (conn, peer) = pair(p, server, client).await?;
    let target = server.alloc(len, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let src = client.register(vec![3; len], Access::LOCAL_WRITE)?;
    let dst = target.remote();
    let all = join_all((0..ops).map(|_| conn.write(&src, 0..len as u64, dst, 0)));
    let mut all = pin!(all);
    // One poll posts them (as far as the send queue allows), then the close.
    let first = std::future::poll_fn(|cx| Poll::Ready(all.as_mut().poll(cx))).await;
    assert!(
        first.is_pending() || ops == 0,
        "{ops} WRITEs completed at their first poll"
    );
    between();
    conn.close(7, b"flush");
    let results = step(p, "operations pending at close", all).await;
    let mut f = Flushed::default();
    for r in results {
        match r {
            Ok(_) => f.completed += 1,
            Err(e) if e.wc_status() == Some(WcStatus::WrFlushError) => f.flushed += 1,
            Err(e) if e.wc_status().is_none() && e.connection_error().is_some() => {
                f.connection_ended += 1
            }
            Err(e) => panic!("an operation pending at close failed with {e} ({e:?})"),
        }
    }
    let late = step(p, "write after close", conn.write(&src, 0..8, dst, 0)).await;
    assert!(late.is_err(), "a WRITE posted after close succeeded");
    drop(peer);
    Ok(f)
}
