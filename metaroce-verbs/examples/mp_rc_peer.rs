//! The responder end of a K-QP multipath connection ([`metaroce_verbs::MpConnection`])
//! built from metaroce's software RoCEv2 RC QPs (`metaroce_tokio::rocev2::RcEndpoint`, raw
//! IP sockets, so it needs `CAP_NET_RAW`): the host side of the capture test in
//! `run-rxe-multipath.sh`, where the client runs in the rxe guest and tcpdump on the host
//! side of the tap shows the K UDP source ports of the one connection.
//!
//! It registers one region of `SIZE` bytes (REMOTE_WRITE | REMOTE_READ), writes
//! `ADDR RKEY LEN` (hex) to `REGION_FILE`, accepts one control connection on `LISTEN`,
//! answers the multipath hello and sets up the K QP pairs (each of its QPs with the slot's
//! flow label, as the verbs side does), then serves WRITEs and READs until the client
//! closes the control channel. It does not take part in QP replacement.
//!
//! `mp_rc_peer LOCAL_IP LISTEN_ADDR SIZE REGION_FILE`

use metaroce::rocev2::{ConnectAttrs, QpInit, RcConfig};
use metaroce::Access;
use metaroce_tokio::rocev2::RcEndpoint;
use metaroce_verbs::exchange;
use metaroce_verbs::multipath::flow_label_for;
use metaroce_verbs::QpEndpoint;
use std::net::{IpAddr, Ipv4Addr};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 {
        return Err("usage: mp_rc_peer LOCAL_IP LISTEN_ADDR SIZE REGION_FILE".into());
    }
    let local: Ipv4Addr = args[1].parse()?;
    let listen: std::net::SocketAddr = args[2].parse()?;
    let size: usize = args[3].parse()?;
    let mut cfg = RcConfig::new(IpAddr::V4(local));
    cfg.seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64
        ^ u64::from(std::process::id());
    let ep = RcEndpoint::bind_raw(local, cfg)?;
    let mr = ep.register(
        vec![0u8; size],
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    );
    let listener = tokio::net::TcpListener::bind(listen).await?;
    std::fs::write(
        &args[4],
        format!("{:x} {:x} {:x}\n", mr.addr, mr.rkey, mr.len),
    )?;
    eprintln!(
        "mp_rc_peer: region {:#x} rkey {:#x} len {}; listening on {listen}",
        mr.addr, mr.rkey, mr.len
    );
    let (mut tcp, from) = listener.accept().await?;
    // Hello v2: "MRMP", 2, K u16, channel window u32; echoed (this peer has no reorderer:
    // it serves WRITEs and READs only, so it sends no credits).
    let mut hello = [0u8; 11];
    tcp.read_exact(&mut hello).await?;
    if &hello[..5] != b"MRMP\x02" {
        return Err("not a multipath hello".into());
    }
    let k = usize::from(u16::from_be_bytes([hello[5], hello[6]]));
    tcp.write_all(&hello).await?;
    let mut qps = Vec::new();
    for slot in 0..k as u16 {
        let qp = ep.create_qp(QpInit {
            access: Access::REMOTE_WRITE | Access::REMOTE_READ,
            ..Default::default()
        })?;
        let mut rec = [0u8; exchange::RECORD_LEN];
        tcp.read_exact(&mut rec).await?;
        let peer = exchange::parse_record(&rec)?;
        let ip = peer
            .gid
            .to_ipv4_mapped()
            .map_or(IpAddr::V6(peer.gid), IpAddr::V4);
        let mut attrs = ConnectAttrs::new(ip, peer.qpn, peer.psn);
        attrs.max_dest_rd_atomic = 16;
        attrs.max_rd_atomic = 16;
        attrs.flow_label = flow_label_for(slot, 1, k);
        qp.connect(attrs)?;
        let mine = QpEndpoint {
            lid: 0,
            qpn: qp.qpn(),
            psn: qp.psn(),
            gid: local.to_ipv6_mapped(),
        };
        tcp.write_all(&exchange::to_record(&mine)).await?;
        eprintln!(
            "mp_rc_peer: slot {slot}: qpn {:#x} <-> {:#x} at {ip}",
            qp.qpn(),
            peer.qpn
        );
        qps.push(qp);
    }
    eprintln!("mp_rc_peer: {k} QPs up with {from}; serving until the control channel closes");
    let mut buf = [0u8; 256];
    while tcp.read(&mut buf).await? > 0 {}
    let st = ep.stats();
    eprintln!("mp_rc_peer: done; {st:?}");
    Ok(())
}
