//! One async `Endpoint` with a MetaRoCE connection to one peer and an RC queue pair
//! (RoCEv2 mode, `Endpoint::create_rc_qp`) to another at the same time, over UDP loopback
//! with seeded loss, sharing one memory region; the QP parameters go through the
//! out-of-band TCP exchange.

use metaroce::rocev2::{QpInit, RcError, RcOpcode};
use metaroce::{Access, WcStatus};
use metaroce_tokio::backend::{Impaired, Impairment, UdpBackend};
use metaroce_tokio::rocev2::{exchange, QpExchange};
use metaroce_tokio::{Config, Endpoint};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};

const HALF: usize = 192 * 1024;

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

fn endpoint(loss: f64, seed: u64) -> Endpoint {
    let udp = UdpBackend::bind("127.0.0.1:0".parse().unwrap(), 4).unwrap();
    let imp = Impairment {
        loss,
        seed,
        ..Impairment::default()
    };
    Endpoint::with_backend(Impaired::new(udp, imp).unwrap(), Config::default()).unwrap()
}

async fn mixed(loss: f64) {
    let (a, b, c) = (endpoint(loss, 1), endpoint(loss, 2), endpoint(loss, 3));
    let remote = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    // A's one region, registered once, used by both kinds of connection.
    let shared = a.alloc(2 * HALF, remote);
    let a_src = a.register(pattern(HALF, 1), Access::LOCAL_WRITE);
    let b_src = b.register(pattern(HALF, 2), Access::LOCAL_WRITE);
    let b_dst = b.alloc(2 * HALF, remote);
    let c_src = c.register(pattern(HALF, 3), Access::LOCAL_WRITE);
    let c_dst = c.alloc(2 * HALF, remote);

    // MetaRoCE: A -> B.
    let b2 = b.clone();
    let accept = tokio::spawn(async move { b2.accept().await.and_then(|i| i.accept().ok()) });
    let ab = a.connect(b.local_addr()).unwrap().await.unwrap();
    let ba = accept.await.unwrap().unwrap();

    // RC QP: A <-> C, parameters exchanged over TCP like ibv_rc_pingpong.
    let init = QpInit {
        access: Access::REMOTE_WRITE | Access::REMOTE_READ,
        ..QpInit::default()
    };
    let qa = a.create_rc_qp(init).unwrap();
    let qc = c.create_rc_qp(init).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tcp_addr = listener.local_addr().unwrap();
    let a_info = qa.exchange_info(Some(shared.remote()));
    let server = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        exchange(&mut s, &a_info).await.unwrap()
    });
    let mut t = TcpStream::connect(tcp_addr).await.unwrap();
    let a_seen_by_c = exchange(&mut t, &qc.exchange_info(Some(c_dst.remote())))
        .await
        .unwrap();
    let c_seen_by_a = server.await.unwrap();
    assert_eq!((a_seen_by_c.qpn, a_seen_by_c.psn), (qa.qpn(), qa.psn()));
    assert_eq!(a_seen_by_c.udp_addr(), a.local_addr());
    let attrs = |peer: &QpExchange| {
        let mut at = peer.connect_attrs();
        // The default local ACK timeout (2^14 x 4.096 us = 67 ms): a shorter one can fire
        // spuriously on a loaded machine and spend retry_cnt without loss.
        at.max_rd_atomic = 4;
        at.max_dest_rd_atomic = 4;
        at
    };
    qa.connect_udp(attrs(&c_seen_by_a), c_seen_by_a.udp_addr())
        .unwrap();
    qc.connect_udp(attrs(&a_seen_by_c), a_seen_by_c.udp_addr())
        .unwrap();
    let a_region = a_seen_by_c.region.unwrap();
    let c_region = c_seen_by_a.region.unwrap();
    assert_eq!(a_region, shared.remote());

    // Phase 1, all at once: B (MetaRoCE) and C (RC) write into A's region; A writes its one
    // source region to both (same lkey on both kinds of connection).
    let len = HALF as u32;
    let (r1, r2, r3, r4) = tokio::join!(
        ba.write(&b_src, 0..HALF as u64, shared.remote(), 0),
        ab.write(&a_src, 0..HALF as u64, b_dst.remote(), 0),
        qc.write(
            c_src.keys().lkey,
            0,
            len,
            a_region.addr + HALF as u64,
            a_region.rkey,
            None
        ),
        qa.write(
            a_src.keys().lkey,
            0,
            len,
            c_region.addr,
            c_region.rkey,
            None
        ),
    );
    assert_eq!(r1.unwrap().status, WcStatus::Success);
    assert_eq!(r2.unwrap().status, WcStatus::Success);
    assert_eq!(r3.unwrap().opcode, RcOpcode::RdmaWrite);
    assert_eq!(r4.unwrap().opcode, RcOpcode::RdmaWrite);
    let got = shared.read(0, 2 * HALF as u64).unwrap();
    assert!(got[..HALF] == pattern(HALF, 2)[..], "B's WRITE (MetaRoCE)");
    assert!(got[HALF..] == pattern(HALF, 3)[..], "C's WRITE (RC)");
    assert!(b_dst.read(0, HALF as u64).unwrap() == pattern(HALF, 1));
    assert!(c_dst.read(0, HALF as u64).unwrap() == pattern(HALF, 1));

    // Phase 2: crosswise READs of A's region: B reads C's half, C reads B's half.
    let (r5, r6) = tokio::join!(
        ba.read(
            &b_dst,
            HALF as u64..2 * HALF as u64,
            shared.remote(),
            HALF as u64
        ),
        qc.read(
            c_dst.keys().lkey,
            HALF as u64,
            len,
            a_region.addr,
            a_region.rkey
        ),
    );
    assert_eq!(r5.unwrap().status, WcStatus::Success);
    assert_eq!(r6.unwrap().opcode, RcOpcode::RdmaRead);
    assert!(b_dst.read(HALF as u64, HALF as u64).unwrap() == pattern(HALF, 3));
    assert!(c_dst.read(HALF as u64, HALF as u64).unwrap() == pattern(HALF, 2));

    for ep in [&a, &b, &c] {
        let s = ep.stats();
        assert_eq!((s.unsupported, s.bad_icrc, s.malformed), (0, 0, 0), "{s:?}");
    }
    if loss > 0.0 {
        let (sa, sc) = (qa.stats().unwrap(), qc.stats().unwrap());
        assert!(
            sa.retransmitted + sc.retransmitted > 0,
            "no go-back-N under loss: {sa:?} {sc:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metaroce_connection_and_rc_qp_share_one_region_over_udp() {
    tokio::time::timeout(Duration::from_secs(60), mixed(0.0))
        .await
        .expect("hung");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metaroce_connection_and_rc_qp_share_one_region_over_lossy_udp() {
    tokio::time::timeout(Duration::from_secs(120), mixed(0.03))
        .await
        .expect("hung");
}

/// Native RoCEv2 needs raw IP: a UDP endpoint's QP refuses it with a message saying so.
#[tokio::test]
async fn native_rocev2_on_udp_endpoint_is_refused_clearly() {
    let ep = endpoint(0.0, 9);
    let qp = ep.create_rc_qp(QpInit::default()).unwrap();
    let attrs = metaroce::rocev2::ConnectAttrs::new("127.0.0.1".parse().unwrap(), 0x20, 1);
    let err = qp.connect(attrs).unwrap_err();
    assert!(matches!(err, RcError::Unsupported(_)), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("CAP_NET_RAW") && text.contains("connect_udp"),
        "{text}"
    );
    // The QP is still in INIT and can be connected over UDP.
    qp.connect_udp(attrs, "127.0.0.1:4791".parse().unwrap())
        .unwrap();
}

/// A native RoCEv2 QP (ICRC over the real IPv4 header, whole IP packets through an
/// `IpBackend`) on the same `Endpoint` as a MetaRoCE connection over UDP: A talks MetaRoCE
/// to B and standard RoCEv2 to C, a stand-alone `rocev2::RcEndpoint` behind an in-memory
/// IP link that loses 2% of the packets. (A `RawIpBackend` is the same to the endpoint.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_rc_qp_beside_metaroce_connection() {
    tokio::time::timeout(Duration::from_secs(120), native())
        .await
        .expect("hung");
}

async fn native() {
    use metaroce::rocev2::RcConfig;
    use metaroce_tokio::rocev2::{IpBackend, MemoryLink, RcEndpoint};
    use std::net::{IpAddr, Ipv4Addr};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    let ip_a = IpAddr::V4(Ipv4Addr::new(10, 9, 0, 1));
    let ip_c = IpAddr::V4(Ipv4Addr::new(10, 9, 0, 2));
    let (la, lc) = MemoryLink::pair(ip_a, ip_c);
    // Lose 2% of the packets, pseudo-randomly (a strictly periodic loss can line up with
    // go-back-N's resend length and hit the same PSN every round, exhausting retry_cnt).
    let lossy = |seed: u64| {
        let n = AtomicU64::new(seed);
        move |_: &[u8]| {
            let x = n
                .fetch_add(1, Ordering::Relaxed)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15);
            (x >> 40) % 50 == 0
        }
    };
    let la = la.with_loss(lossy(1));
    let lc = lc.with_loss(lossy(1 << 20));
    let udp = UdpBackend::bind("127.0.0.1:0".parse().unwrap(), 4).unwrap();
    let a = Endpoint::with_rocev2(udp, Arc::new(la), Config::default()).unwrap();
    let b = endpoint(0.0, 2);
    let lc: Arc<dyn IpBackend> = Arc::new(lc);
    let c = RcEndpoint::with_backend(lc, RcConfig::new(ip_c)).unwrap();

    let remote = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let shared = a.alloc(2 * HALF, remote);
    let sk = shared.keys();
    let a_src = a.register(pattern(HALF, 1), Access::LOCAL_WRITE);
    let b_src = b.register(pattern(HALF, 2), Access::LOCAL_WRITE);
    let c_src = c.register(pattern(HALF, 3), Access::LOCAL_WRITE);
    let c_dst = c.register(vec![0; 2 * HALF], remote);

    let b2 = b.clone();
    let accept = tokio::spawn(async move { b2.accept().await.and_then(|i| i.accept().ok()) });
    let _ab = a.connect(b.local_addr()).unwrap().await.unwrap();
    let ba = accept.await.unwrap().unwrap();

    let init = QpInit {
        access: Access::REMOTE_WRITE | Access::REMOTE_READ,
        ..QpInit::default()
    };
    let qa = a.create_rc_qp(init).unwrap();
    let qc = c.create_qp(init).unwrap();
    // The exchange records name the IP backend's address (the native QPs' GID) and 4791.
    let a_info = qa.exchange_info(Some(shared.remote()));
    let c_info = qc.exchange_info(None);
    assert_eq!((a_info.ip, a_info.udp_port), (ip_a, 4791));
    assert_eq!((c_info.ip, c_info.udp_port), (ip_c, 4791));
    qa.connect_to(&c_info).unwrap();
    qc.connect_to(&a_info).unwrap();

    let len = HALF as u32;
    let (r1, r2, r3) = tokio::join!(
        ba.write(&b_src, 0..HALF as u64, shared.remote(), 0),
        qc.write(c_src.lkey, 0, len, sk.addr + HALF as u64, sk.rkey, None),
        qa.write(a_src.keys().lkey, 0, len, c_dst.addr, c_dst.rkey, None),
    );
    assert_eq!(r1.unwrap().status, WcStatus::Success);
    r2.unwrap();
    r3.unwrap();
    let got = shared.read(0, 2 * HALF as u64).unwrap();
    assert!(got[..HALF] == pattern(HALF, 2)[..], "B's WRITE (MetaRoCE)");
    assert!(
        got[HALF..] == pattern(HALF, 3)[..],
        "C's WRITE (native RoCEv2)"
    );
    assert!(c.read_mr(c_dst.lkey, 0, HALF as u64).unwrap() == pattern(HALF, 1));
    // C READs back what B wrote through MetaRoCE.
    qc.read(c_dst.lkey, HALF as u64, len, sk.addr, sk.rkey)
        .await
        .unwrap();
    assert!(c.read_mr(c_dst.lkey, HALF as u64, HALF as u64).unwrap() == pattern(HALF, 2));
    // C checked every packet's ICRC over the real IPv4 header A built.
    let cs = c.stats();
    assert_eq!((cs.rx_bad_icrc, cs.rx_malformed), (0, 0), "{cs:?}");
    assert!(cs.rx_packets > 0);
    let (sa, sc) = (qa.stats().unwrap(), qc.stats().unwrap());
    assert!(sa.retransmitted + sc.retransmitted > 0, "{sa:?} {sc:?}");
    assert_eq!(a.stats().unsupported, 0);
}
