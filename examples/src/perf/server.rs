//! The server side of a run: answers the client's control messages, allocates the WRITE
//! destinations, checksums them, echoes send_lat messages.

use super::cli::Test;
use super::proto::Ctrl;
use super::Res;
use futures::{SinkExt, StreamExt};
use metaroce::{Access, ConnectionStats};
use metaroce_tokio::{Connection, MemoryRegion, MessageStream, RemoteRegion};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Largest destination region the server agrees to allocate.
const MAX_REGION: u64 = 16 << 30;

/// How long the server waits for the client to close after its BYE.
const LINGER: std::time::Duration = std::time::Duration::from_secs(2);

/// Byte the destination is filled with before a run: touches every page (so page faults do
/// not land in the measurement) and differs from what a correct run leaves there.
const DEST_FILL: u8 = 0xa5;

/// One size served.
#[derive(Debug, Clone)]
pub struct ServerRound {
    /// Bytes per WRITE / message.
    pub size: u64,
    /// Iterations announced (0: timed).
    pub iters: u64,
    /// Destination length (write_bw).
    pub region_len: u64,
    /// Destination prefix checksummed.
    pub check_len: u64,
    /// CRC-32 of the destination prefix (write_bw).
    pub crc: u32,
    /// Operations the client reported.
    pub client_ops: u64,
}

/// What the server saw of a run.
#[derive(Debug, Clone, Default)]
pub struct ServerRun {
    /// Test the client ran.
    pub test: Option<Test>,
    /// Client's QPN.
    pub client_qpn: u32,
    /// Rounds.
    pub rounds: Vec<ServerRound>,
    /// send_lat messages echoed.
    pub echoed: u64,
    /// The connection's statistics at the end.
    pub stats: Option<ConnectionStats>,
}

/// Posts a reply without waiting for its acknowledgement: the client's next message
/// proves it arrived, and the client may close the connection right after the last one.
async fn reply(ctrl: &mut MessageStream, m: Ctrl) -> Res<()> {
    ctrl.feed(m.encode())
        .await
        .map_err(|e| format!("sending a control message: {e}"))
}

async fn refuse(ctrl: &mut MessageStream, text: String) -> String {
    let _ = reply(ctrl, Ctrl::Error(text.clone())).await;
    text
}

/// Echoes every message of `stream` back on it.
async fn echo(mut stream: MessageStream, count: Arc<AtomicU64>) {
    while let Some(m) = stream.next().await {
        if stream.feed(m).await.is_err() {
            break;
        }
        count.fetch_add(1, Ordering::Relaxed);
    }
}

/// Serves one client run on `conn`; prints progress lines when `print`.
pub async fn serve(conn: Connection, print: bool) -> Res<ServerRun> {
    let mut ctrl = conn
        .accept_stream()
        .await
        .ok_or("the client closed the connection before saying hello")?;
    let mut run = ServerRun::default();
    let echoed = Arc::new(AtomicU64::new(0));
    // Every later stream is a send_lat ping-pong stream.
    let acceptor = {
        let conn = conn.clone();
        let echoed = echoed.clone();
        tokio::spawn(async move {
            while let Some(stream) = conn.accept_stream().await {
                tokio::spawn(echo(stream, echoed.clone()));
            }
        })
    };
    let mut region: Option<(MemoryRegion, u64, u64, u64)> = None;
    let result = loop {
        let Some(msg) = ctrl.next().await else {
            break Err("the client went away before the end of the run".to_string());
        };
        let Some(m) = Ctrl::decode(&msg) else {
            break Err(refuse(&mut ctrl, "malformed control message".into()).await);
        };
        match m {
            Ctrl::Hello { test, rounds, qpn } => {
                let Some(t) = Test::from_code(test) else {
                    break Err(refuse(&mut ctrl, format!("unknown test code {test}")).await);
                };
                run.test = Some(t);
                run.client_qpn = qpn;
                if print {
                    println!(
                        " Client {} (QPN 0x{qpn:06x}) runs {} with {rounds} size(s)",
                        conn.remote_addr()
                            .map_or_else(|| "?".to_string(), |a| a.to_string()),
                        t.name()
                    );
                }
                reply(
                    &mut ctrl,
                    Ctrl::Welcome {
                        qpn: conn.handle().0,
                    },
                )
                .await?;
            }
            Ctrl::Setup {
                size,
                iters,
                region_len,
            } => {
                if size == 0 || size > super::cli::MAX_SIZE {
                    break Err(refuse(&mut ctrl, format!("invalid size {size}")).await);
                }
                if region_len > MAX_REGION {
                    let text =
                        format!("destination of {region_len} bytes refused (at most {MAX_REGION})");
                    break Err(refuse(&mut ctrl, text).await);
                }
                let remote = if region_len > 0 {
                    let Ok(len) = usize::try_from(region_len) else {
                        break Err(refuse(&mut ctrl, "region too large".into()).await);
                    };
                    let mr = conn.endpoint().register(
                        vec![DEST_FILL; len],
                        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
                    );
                    let remote = mr.remote();
                    region = Some((mr, size, iters, region_len));
                    remote
                } else {
                    region = None;
                    RemoteRegion {
                        addr: 0,
                        len: 0,
                        rkey: 0,
                    }
                };
                reply(
                    &mut ctrl,
                    Ctrl::Ready {
                        region: remote,
                        size,
                        iters,
                        slots: region_len.div_ceil(size),
                    },
                )
                .await?;
            }
            Ctrl::Done { check_len, ops } => {
                let (crc, check_len, size, iters, region_len) = match region.take() {
                    Some((mr, size, iters, len)) => {
                        let n = check_len.min(len) as usize;
                        let crc = mr
                            .with_bytes(|b| crc32fast::hash(&b[..n]))
                            .map_err(|e| format!("reading the destination: {e}"))?;
                        (crc, n as u64, size, iters, len)
                    }
                    None => (0, 0, 0, 0, 0),
                };
                let done = echoed.load(Ordering::Relaxed);
                reply(
                    &mut ctrl,
                    Ctrl::Result {
                        crc,
                        check_len,
                        ops: done,
                    },
                )
                .await?;
                if print {
                    if region_len > 0 {
                        println!(
                            " {size:>10} B x {ops:<8} destination {region_len} B, checksum 0x{crc:08x} over {check_len} B"
                        );
                    } else {
                        println!(" send_lat round done: {done} messages echoed so far");
                    }
                }
                run.rounds.push(ServerRound {
                    size,
                    iters,
                    region_len,
                    check_len,
                    crc,
                    client_ops: ops,
                });
            }
            Ctrl::Bye => {
                // Stay until the client closes the connection (or a short while), so that
                // a retransmitted BYE is still acknowledged.
                run.stats = conn.stats();
                let _ =
                    tokio::time::timeout(LINGER, async { while ctrl.next().await.is_some() {} })
                        .await;
                break Ok(());
            }
            other => {
                let text = format!("unexpected control message {other:?}");
                break Err(refuse(&mut ctrl, text).await);
            }
        }
    };
    run.echoed = echoed.load(Ordering::Relaxed);
    if run.stats.is_none() {
        run.stats = conn.stats();
    }
    acceptor.abort();
    result.map(|()| run)
}
