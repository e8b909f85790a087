//! The K-QP multipath connection (`metaroce_verbs::multipath`) on a real verbs stack: both
//! ends in one process on one device (rdma_rxe loopback in the QEMU guest of
//! `run-rxe-tests.sh`, `TESTS="rxe_multipath"`). Without an RDMA device each test prints
//! "skipped" and passes, unless `METAROCE_VERBS_REQUIRE_DEVICE=1`.

use metaroce::multipath::MultipathConfig;
use metaroce_verbs::{Access, Context, Error, MpConfig, MpConnection, Pd, WcStatus};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};

fn device() -> Option<(Context, Pd)> {
    match Context::open(std::env::var("METAROCE_VERBS_DEVICE").ok().as_deref()) {
        Ok(ctx) => {
            let pd = ctx.alloc_pd().expect("ibv_alloc_pd");
            Some((ctx, pd))
        }
        Err(e) => {
            if std::env::var("METAROCE_VERBS_REQUIRE_DEVICE").is_ok_and(|v| v == "1") {
                panic!("METAROCE_VERBS_REQUIRE_DEVICE=1 but no device: {e}");
            }
            eprintln!("skipped: {e}");
            None
        }
    }
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8))
        .collect()
}

async fn within<T>(secs: u64, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .expect("timed out")
}

async fn pair(pd: &Pd, k: usize, chunk: u32) -> (MpConnection, MpConnection) {
    let cfg = MpConfig {
        multipath: MultipathConfig {
            qps: k,
            chunk_size: chunk,
            ..MultipathConfig::default()
        },
        ..MpConfig::default()
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = async {
        let (tcp, _) = listener.accept().await.unwrap();
        MpConnection::accept(pd, cfg.clone(), tcp).await
    };
    let client = async {
        let tcp = TcpStream::connect(addr).await.unwrap();
        MpConnection::connect(pd, cfg.clone(), tcp).await
    };
    let (s, c) = within(60, async { tokio::join!(server, client) }).await;
    (s.expect("accept"), c.expect("connect"))
}

/// K = 4: four QPs, four distinct flow labels and so four distinct RoCEv2 UDP source ports
/// (as `rdma_get_udp_sport` computes them); a 4 MiB WRITE sprayed over all four, read back
/// with a sprayed READ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k4_write_and_read_use_every_qp() {
    let Some((_ctx, pd)) = device() else { return };
    let (server, client) = pair(&pd, 4, 64 * 1024).await;
    let n = 4 << 20;
    let data = pattern(n, 3);
    let src = pd.register(data.clone(), Access::LOCAL_WRITE).unwrap();
    let dst = pd
        .register(
            vec![0u8; n],
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
        .unwrap();
    let back = pd.register(vec![0u8; n], Access::LOCAL_WRITE).unwrap();
    let t = std::time::Instant::now();
    within(120, client.write(&src, 0, n as u64, &dst.remote(), 0))
        .await
        .expect("write");
    let took = t.elapsed();
    assert!(dst.read(0, n).unwrap() == data, "WRITE placed the bytes");
    within(120, client.read(&back, 0, n as u64, &dst.remote(), 0))
        .await
        .expect("read");
    assert!(back.read(0, n).unwrap() == data, "READ brought them back");
    let st = client.stats();
    println!(
        "4 MiB WRITE in {took:?}; ports (flow label, UDP sport) {:?}",
        st.ports
    );
    let ports: std::collections::BTreeSet<u16> = st.ports.iter().map(|p| p.1).collect();
    assert_eq!(ports.len(), 4, "four distinct source ports: {:?}", st.ports);
    for (i, s) in st.slots.iter().enumerate() {
        println!(
            "slot {i}: {} chunks, {} bytes, rate {:.0} B/s",
            s.posted_chunks, s.posted_bytes, s.rate
        );
        assert!(s.posted_chunks > 0, "slot {i} carried no chunk");
    }
    // The server's QPs carry flow labels too (its ACKs and READ responses use them).
    assert_eq!(server.stats().ports.len(), 4);
    let qpns: std::collections::BTreeSet<u32> =
        (0..4).map(|s| client.qp(s).unwrap().qpn()).collect();
    assert_eq!(qpns.len(), 4);
}

/// A QP forced into the error state (`ibv_modify_qp` to ERR) in the middle of sixteen
/// 256 KiB WRITEs costs no operation: all sixteen complete `Success`, the data is right,
/// the failed QP's chunks were re-issued and the slot got a new QP with a new source port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qp_forced_to_error_mid_transfer_costs_no_operation() {
    let Some((_ctx, pd)) = device() else { return };
    let (server, client) = pair(&pd, 4, 16 * 1024).await;
    let each = 256 * 1024;
    let ops = 16;
    let n = each * ops;
    let data = pattern(n, 11);
    let src = pd.register(data.clone(), Access::LOCAL_WRITE).unwrap();
    let dst = pd
        .register(
            vec![0u8; n],
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
        .unwrap();
    let remote = dst.remote();
    let port_before = client.stats().ports[1];
    let victim_qpn = client.qp(1).unwrap().qpn();
    let writes: Vec<_> = (0..ops)
        .map(|i| {
            let c = client.clone();
            let src = src.clone();
            let off = (i * each) as u64;
            tokio::spawn(async move { c.write(&src, off, each as u64, &remote, off).await })
        })
        .collect();
    // Wait until slot 1 has completed a chunk, then break its QP.
    within(60, async {
        while client.stats().slots[1].completed_chunks == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    let outstanding = client.stats().slots[1].outstanding;
    client
        .qp(1)
        .unwrap()
        .set_error()
        .expect("ibv_modify_qp(ERR)");
    let mut statuses = Vec::new();
    for w in writes {
        statuses.push(match within(120, w).await.unwrap() {
            Ok(()) => WcStatus::Success,
            Err(Error::Completion { status, .. }) => status,
            Err(e) => panic!("{e}"),
        });
    }
    let st = client.stats();
    println!(
        "slot 1 had {outstanding} chunks outstanding when forced to ERR; reissued {}, replacements {}, ports {:?} (slot 1 was {port_before:?})",
        st.reissued_chunks, st.replacements, st.ports
    );
    assert!(
        statuses.iter().all(|s| *s == WcStatus::Success),
        "{statuses:?}"
    );
    assert!(dst.read(0, n).unwrap() == data, "every byte placed");
    assert_eq!(st.slots[1].failures, 1);
    assert!(
        st.reissued_chunks > 0,
        "the failed QP had chunks to re-issue"
    );
    // The replacement arrives shortly after (it is not needed for the WRITEs to finish).
    within(30, async {
        while client.stats().replacements == 0 || server.stats().replacements == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let st = client.stats();
    assert_ne!(
        client.qp(1).unwrap().qpn(),
        victim_qpn,
        "slot 1 has a new QP"
    );
    assert_ne!(st.ports[1], port_before, "the new QP has a new source port");
    // And the connection goes on using all four QPs.
    let again = pattern(n, 99);
    src.write(0, &again).unwrap();
    within(120, client.write(&src, 0, n as u64, &remote, 0))
        .await
        .expect("write after the replacement");
    assert!(dst.read(0, n).unwrap() == again);
    let after = client.stats();
    assert!(
        after.slots[1].posted_chunks > st.slots[1].posted_chunks,
        "slot 1 used again"
    );
}

/// The guest half of the capture test (`run-rxe-multipath.sh`): a K = 4 connection from the
/// rxe guest to `mp_rc_peer` on the host (`METAROCE_MP_PEER` = its control address,
/// `METAROCE_MP_REGION` = the file with its region), a sprayed 1 MiB WRITE and READ-back over
/// the tap, which the script captures to count the connection's UDP source ports. Skipped
/// when `METAROCE_MP_PEER` is not set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k4_to_host_peer_over_the_wire() {
    let (Ok(peer), Ok(region)) = (
        std::env::var("METAROCE_MP_PEER"),
        std::env::var("METAROCE_MP_REGION"),
    ) else {
        eprintln!("skipped: METAROCE_MP_PEER / METAROCE_MP_REGION not set");
        return;
    };
    let Some((_ctx, pd)) = device() else { return };
    let text = std::fs::read_to_string(&region).expect("region file");
    let f: Vec<u64> = text
        .split_whitespace()
        .map(|x| u64::from_str_radix(x, 16).expect("hex"))
        .collect();
    let remote = metaroce_verbs::RemoteRegion {
        addr: f[0],
        rkey: f[1] as u32,
        len: f[2],
    };
    let tcp = within(30, async {
        loop {
            match TcpStream::connect(&peer).await {
                Ok(t) => break t,
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    })
    .await;
    let cfg = MpConfig {
        multipath: MultipathConfig {
            qps: 4,
            chunk_size: 16 * 1024,
            ..MultipathConfig::default()
        },
        ..MpConfig::default()
    };
    let client = within(30, MpConnection::connect(&pd, cfg, tcp))
        .await
        .expect("connect to the host peer");
    let n = (1usize << 20).min(remote.len as usize);
    let data = pattern(n, 5);
    let src = pd.register(data.clone(), Access::LOCAL_WRITE).unwrap();
    let back = pd.register(vec![0u8; n], Access::LOCAL_WRITE).unwrap();
    let t = std::time::Instant::now();
    within(120, client.write(&src, 0, n as u64, &remote, 0))
        .await
        .expect("write to the host");
    let w = t.elapsed();
    within(120, client.read(&back, 0, n as u64, &remote, 0))
        .await
        .expect("read from the host");
    assert!(
        back.read(0, n).unwrap() == data,
        "READ-back equals the WRITE"
    );
    let st = client.stats();
    println!(
        "MP-PORTS {}",
        st.ports
            .iter()
            .map(|p| p.1.to_string())
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "1 MiB WRITE to the host in {w:?}; per slot chunks {:?}",
        st.slots.iter().map(|s| s.posted_chunks).collect::<Vec<_>>()
    );
    assert!(st.slots.iter().all(|s| s.posted_chunks > 0));
}

fn message(i: u32) -> Vec<u8> {
    let len = 1 + (i as usize * 397) % 4000;
    let mut m = i.to_be_bytes().to_vec();
    m.extend((0..len).map(|j| (j as u32 ^ i) as u8));
    m
}

/// Ordered message streams over K = 4 QPs keep their order and lose or duplicate nothing
/// when one QP is forced to ERR mid-stream: 600 SENDs on channel 0 pipelined over all four
/// QPs, and on channel 1 messages with a WRITE_WITH_IMM between them; the receiver gets
/// every message once, in submission order, and the immediate after its data is placed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_keep_order_across_a_qp_forced_to_error() {
    let Some((_ctx, pd)) = device() else { return };
    let (server, client) = pair(&pd, 4, 16 * 1024).await;
    let n = 600u32;
    let c = client.clone();
    // 600 sends in flight at once. `send` fixes a message's place in the channel when its
    // future is first polled, so poll each once, in index order, before awaiting them all:
    // index order is then the channel's order, whatever order they later get queue space in.
    let sender = tokio::spawn(async move {
        let mut futs: Vec<_> = (0..n)
            .map(|i| {
                let c = c.clone();
                futures::future::maybe_done(Box::pin(async move { c.send(0, &message(i)).await }))
            })
            .collect();
        for f in futs.iter_mut() {
            let _ = futures::poll!(&mut *f);
        }
        futures::future::join_all(futs.iter_mut()).await;
        futs.into_iter()
            .map(|mut f| {
                std::pin::Pin::new(&mut f)
                    .take_output()
                    .expect("send resolved")
            })
            .collect::<Vec<_>>()
    });
    let s = server.clone();
    let cl = client.clone();
    let receiver = tokio::spawn(async move {
        let mut got = Vec::new();
        for i in 0..n {
            match tokio::time::timeout(Duration::from_secs(120), s.recv(0)).await {
                Ok(m) => got.push(m.expect("recv")),
                // A stuck stream: say where, and what both ends counted (bad_frames are
                // frames the receiver refused, e.g. beyond its reorder window).
                Err(_) => panic!(
                    "recv of position {i} timed out;\nserver {:?}\nclient {:?}",
                    s.stats(),
                    cl.stats()
                ),
            }
        }
        got
    });
    within(60, async {
        while client.stats().slots[2].completed_chunks < 3 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    let outstanding = client.stats().slots[2].outstanding;
    client
        .qp(2)
        .unwrap()
        .set_error()
        .expect("ibv_modify_qp(ERR)");
    // Channel 1: message, WRITE_WITH_IMM, message.
    let dst = pd
        .register(
            vec![0u8; 64 * 1024],
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        )
        .unwrap();
    let data = pattern(64 * 1024, 1);
    let src = pd.register(data.clone(), Access::LOCAL_WRITE).unwrap();
    let dst_remote = dst.remote();
    // One after the other: each operation's place is fixed when it is first polled, and
    // sequential awaits make that order explicit without relying on how a combinator polls.
    client.send(1, b"before").await.unwrap();
    client
        .write_with_imm(&src, 0, 64 * 1024, &dst_remote, 0, 1, 0xfeed)
        .await
        .unwrap();
    client.send(1, b"after").await.unwrap();
    let results = within(120, sender).await.unwrap();
    let failed: Vec<_> = results
        .iter()
        .enumerate()
        .filter(|(_, r)| r.is_err())
        .collect();
    assert!(
        failed.is_empty(),
        "{} sends failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(3)]
    );
    let got = within(120, receiver).await.unwrap();
    for (i, m) in got.iter().enumerate() {
        if *m != metaroce_verbs::Incoming::Message(message(i as u32).into()) {
            let at = match m {
                metaroce_verbs::Incoming::Message(b) if b.len() >= 4 => {
                    format!("message {}", u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
                }
                other => format!("{:?}", other),
            };
            panic!("position {i} holds {at}: out of order or corrupt");
        }
    }
    use metaroce_verbs::Incoming;
    assert_eq!(
        within(30, server.recv(1)).await.unwrap(),
        Incoming::Message(b"before"[..].into())
    );
    assert_eq!(
        within(30, server.recv(1)).await.unwrap(),
        Incoming::Immediate(0xfeed)
    );
    assert!(
        dst.read(0, 64 * 1024).unwrap() == data,
        "data placed before its immediate"
    );
    assert_eq!(
        within(30, server.recv(1)).await.unwrap(),
        Incoming::Message(b"after"[..].into())
    );
    let st = client.stats();
    let sst = server.stats();
    println!(
        "slot 2 had {outstanding} chunks outstanding at ERR; reissued {}; server dropped {} duplicate frames, {} bad; chunks per slot {:?}",
        st.reissued_chunks,
        sst.duplicate_frames,
        sst.bad_frames,
        st.slots.iter().map(|s| s.posted_chunks).collect::<Vec<_>>()
    );
    assert_eq!(st.slots[2].failures, 1);
    assert!(st.reissued_chunks > 0);
    assert_eq!(sst.bad_frames, 0);
    // The client's window moved on the server's credits (a quarter window of 64 each).
    println!(
        "credits: server sent {}, client took {}, bad {}",
        sst.credits_sent, st.credits_received, st.bad_credits
    );
    assert!(st.credits_received > 0 && st.credits_received <= sst.credits_sent);
    assert_eq!(st.bad_credits, 0);
    assert!(st.slots.iter().all(|s| s.posted_chunks > 0));
}

/// The hello fixes one channel window for both ends: the server answers the smaller of the
/// client's and its own, so a client cannot make the server's reorderer buffer more than the
/// server's configuration allows; a window of 0 and a version-1 hello are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hello_agrees_on_the_smaller_channel_window() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some((_ctx, pd)) = device() else { return };
    let hello = |version: u8, window: u32| {
        let mut h = b"MRMP".to_vec();
        h.push(version);
        h.extend_from_slice(&1u16.to_be_bytes());
        if version == 2 {
            h.extend_from_slice(&window.to_be_bytes());
        }
        h
    };
    for (sent, answer) in [
        (hello(2, u32::MAX), Some(64u32)),
        (hello(2, 16), Some(16)),
        (hello(2, 0), None),
        (hello(1, 0), None),
    ] {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let pd2 = pd.clone();
        let server = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            MpConnection::accept(&pd2, MpConfig::default(), tcp).await
        });
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        tcp.write_all(&sent).await.unwrap();
        // A version-1 hello is 7 bytes: pad it to the 11 the server reads.
        tcp.write_all(&[0u8; 11][..11 - sent.len()]).await.unwrap();
        let mut back = [0u8; 11];
        let got = within(30, tcp.read_exact(&mut back)).await;
        match answer {
            Some(w) => {
                got.expect("the server answers the hello");
                assert_eq!(&back[..7], &sent[..7]);
                assert_eq!(u32::from_be_bytes([back[7], back[8], back[9], back[10]]), w);
            }
            None => assert!(got.is_err(), "hello {sent:?} must be refused"),
        }
        drop(tcp);
        assert!(
            matches!(within(30, server).await.unwrap(), Err(Error::Exchange(_))),
            "the server gives up with an exchange error once the client leaves"
        );
    }
}
