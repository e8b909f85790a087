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
    let accept = tokio::spawn(async move { b2.accept().await });
    let ab = a.connect(b.local_addr()).await.unwrap();
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
        at.timeout = 10; // 4.2 ms
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
