//! `metaroce-rc-pingpong`: rdma-core's `ibv_rc_pingpong`, over metaroce's RoCEv2 mode.
//!
//! Speaks `ibv_rc_pingpong`'s out-of-band exchange on TCP 18515 (`"%04x:%06x:%06x:%s"` =
//! LID:QPN:PSN:GID, GID as 32 hex digits in wire order, 52 bytes with the NUL; the client
//! writes its record, reads the server's, writes `"done"`) and its ping-pong: both sides post
//! receives, the client SENDs first, each side sends its next message once its previous
//! SEND completed and a message arrived; `-n` messages each way of `-s` bytes.
//!
//! ```text
//! # host (needs CAP_NET_RAW), server:        guest:
//! metaroce-rc-pingpong -s 4096 -n 500        ibv_rc_pingpong -d rxe0 -g 1 -s 4096 -n 500 10.77.0.1
//! # host as client of a guest server:
//! metaroce-rc-pingpong -s 64 -n 500 10.77.0.2
//! ```
//!
//! `--rw` switches to a WRITE/READ/ATOMIC exercise against `interop/rdma_rw.c` (a small
//! libibverbs program; protocol in `docs/INTEROP.md`), default TCP port 18516: the client is
//! active first (`-n` × {RDMA WRITE `-s` bytes, RDMA READ them back and compare, FETCH_ADD 1
//! on the peer's counter}), then the server does the same to the client; each passive side
//! checks its memory afterwards and reports over TCP.
//!
//! `--unified` runs the ping-pong on an RC QP hosted by a MetaRoCE endpoint
//! (`metaroce_tokio::Endpoint::with_rocev2` + `create_rc_qp`: RoCEv2 chosen for this one
//! connection, the endpoint's regions and driver shared) rather than by the stand-alone
//! `rocev2::RcEndpoint`; on the wire it is the same standard RoCEv2.

use clap::Parser;
use metaroce::rocev2::{ConnectAttrs, QpInit, RcConfig};
use metaroce::Access;
use metaroce_tokio::rocev2::{QueuePair, RcEndpoint};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Parser, Debug)]
#[command(
    version,
    about = "ibv_rc_pingpong over metaroce's RoCEv2 mode (needs CAP_NET_RAW)"
)]
struct Args {
    /// Server to connect to (omit to be the server).
    server: Option<String>,
    /// TCP port of the out-of-band exchange (default 18515; 18516 with --rw).
    #[arg(short = 'p', long)]
    port: Option<u16>,
    /// Message size in bytes.
    #[arg(short = 's', long, default_value_t = 4096)]
    size: u32,
    /// Iterations (messages each way).
    #[arg(short = 'n', long, default_value_t = 1000)]
    iters: u32,
    /// Path MTU (256, 512, 1024, 2048, 4096).
    #[arg(short = 'm', long, default_value_t = 1024)]
    mtu: u32,
    /// Receive WRs kept posted.
    #[arg(short = 'r', long, default_value_t = 500)]
    rx_depth: u32,
    /// GID index (accepted for ibv_rc_pingpong compatibility; the GID is always the
    /// IPv4-mapped address of the local IP).
    #[arg(short = 'g', long)]
    gid_idx: Option<u32>,
    /// Local IPv4 address (default: the address of the TCP connection).
    #[arg(long)]
    local_ip: Option<Ipv4Addr>,
    /// Local ACK timeout exponent (4.096 µs × 2^t).
    #[arg(long, default_value_t = 14)]
    timeout: u8,
    /// WRITE/READ/ATOMIC exercise against interop/rdma_rw.c instead of the ping-pong.
    #[arg(long)]
    rw: bool,
    /// Ping-pong on an RC QP of a MetaRoCE endpoint (`metaroce_tokio::Endpoint::with_rocev2`:
    /// UDP sockets for MetaRoCE plus the raw-IP backend for the QP, one region table)
    /// instead of the stand-alone RoCEv2 endpoint.
    #[arg(long, conflicts_with = "rw")]
    unified: bool,
    /// Overall time limit in seconds.
    #[arg(long, default_value_t = 120)]
    deadline: u64,
}

/// `"%04x:%06x:%06x:%s"` with the GID of `ip` (`::ffff:a.b.c.d`) in wire order.
fn pingpong_record(qpn: u32, psn: u32, ip: Ipv4Addr) -> [u8; 52] {
    let gid: String = ip
        .to_ipv6_mapped()
        .octets()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let s = format!("{:04x}:{:06x}:{:06x}:{}", 0, qpn, psn, gid);
    let mut out = [0u8; 52];
    out[..s.len()].copy_from_slice(s.as_bytes());
    out
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

fn parse_gid(s: &str) -> io::Result<Ipv4Addr> {
    let s = s.trim_end_matches('\0');
    if s.len() != 32 {
        return Err(bad(format!("GID {s:?} is not 32 hex digits")));
    }
    let mut b = [0u8; 16];
    for (i, v) in b.iter_mut().enumerate() {
        *v = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad("GID hex"))?;
    }
    Ipv6Addr::from(b).to_ipv4_mapped().ok_or_else(|| {
        bad(format!(
            "GID {s} is not an IPv4-mapped RoCEv2 GID (use -g 1)"
        ))
    })
}

/// (QPN, PSN, IP, extra fields) of a peer record `LID:QPN:PSN:GID[:...]`.
fn parse_record(rec: &[u8]) -> io::Result<(u32, u32, Ipv4Addr, Vec<String>)> {
    let end = rec.iter().position(|&b| b == 0).unwrap_or(rec.len());
    let s = std::str::from_utf8(&rec[..end]).map_err(|_| bad("record not ASCII"))?;
    let f: Vec<&str> = s.split(':').collect();
    if f.len() < 4 {
        return Err(bad(format!("malformed record {s:?}")));
    }
    let hex = |x: &str| u32::from_str_radix(x, 16).map_err(|_| bad(format!("bad hex {x:?}")));
    Ok((
        hex(f[1])?,
        hex(f[2])?,
        parse_gid(f[3])?,
        f[4..].iter().map(|x| x.to_string()).collect(),
    ))
}

fn attrs(a: &Args, ip: Ipv4Addr, qpn: u32, psn: u32) -> ConnectAttrs {
    let mut c = ConnectAttrs::new(IpAddr::V4(ip), qpn, psn);
    c.path_mtu = a.mtu;
    c.timeout = a.timeout;
    c
}

fn endpoint(local: Ipv4Addr) -> io::Result<RcEndpoint> {
    let mut cfg = RcConfig::new(IpAddr::V4(local));
    cfg.seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
        ^ u64::from(std::process::id());
    RcEndpoint::bind_raw(local, cfg)
}

fn local_v4(a: &Args, sock: &TcpStream) -> io::Result<Ipv4Addr> {
    if let Some(ip) = a.local_ip {
        return Ok(ip);
    }
    match sock.local_addr()?.ip() {
        IpAddr::V4(v) => Ok(v),
        IpAddr::V6(v) => v
            .to_ipv4_mapped()
            .ok_or_else(|| bad("RoCEv2 mode here is IPv4 only")),
    }
}

async fn tcp_pair(a: &Args, default_port: u16) -> io::Result<TcpStream> {
    let port = a.port.unwrap_or(default_port);
    match &a.server {
        Some(host) => {
            let addr = format!("{host}:{port}");
            // The server may still be starting: retry for a while like a patient client.
            let start = Instant::now();
            loop {
                match TcpStream::connect(&addr).await {
                    Ok(s) => return Ok(s),
                    Err(e) if start.elapsed() < Duration::from_secs(60) => {
                        tracing::debug!(error = %e, "connect {addr}");
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        None => {
            let l =
                TcpListener::bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port)).await?;
            eprintln!("waiting for a client on TCP port {port}");
            Ok(l.accept().await?.0)
        }
    }
}

/// The endpoint hosting the ping-pong QP (kept alive until the end).
enum Host {
    Rc(RcEndpoint),
    /// The region is kept registered until the end (dropping it deregisters).
    Meta {
        ep: metaroce_tokio::Endpoint,
        _mr: metaroce_tokio::MemoryRegion,
    },
}

/// A MetaRoCE endpoint on `local` (UDP, ephemeral port) with the raw-IP backend attached
/// for native RoCEv2 QPs.
fn unified_endpoint(local: Ipv4Addr) -> io::Result<metaroce_tokio::Endpoint> {
    let udp = metaroce_tokio::backend::UdpBackend::bind(SocketAddr::new(local.into(), 0), 1)?;
    let raw = metaroce_tokio::rocev2::RawIpBackend::bind(local)?;
    metaroce_tokio::Endpoint::with_rocev2(
        udp,
        std::sync::Arc::new(raw),
        metaroce_tokio::Config::default(),
    )
}

async fn pingpong(a: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let mut tcp = tcp_pair(a, 18515).await?;
    let local = local_v4(a, &tcp)?;
    let size = a.size;
    let depth = a.rx_depth.max(1);
    let buf = vec![0x7b; size.max(1) as usize * 2];
    let (qp, lkey, host) = if a.unified {
        let ep = unified_endpoint(local)?;
        let mr = ep.register(buf, Access::LOCAL_WRITE);
        let qp = ep.create_rc_qp(QpInit::default())?;
        (qp, mr.keys().lkey, Host::Meta { ep, _mr: mr })
    } else {
        let ep = endpoint(local)?;
        let mr = ep.register(buf, Access::LOCAL_WRITE);
        let qp = ep.create_qp(QpInit::default())?;
        (qp, mr.lkey, Host::Rc(ep))
    };

    for i in 0..depth.min(a.iters.max(1)) {
        qp.post_recv(u64::from(i), lkey, u64::from(size), size)?;
    }
    let mine = pingpong_record(qp.qpn(), qp.psn(), local);
    let mut theirs = [0u8; 52];
    if a.server.is_some() {
        tcp.write_all(&mine).await?;
        tcp.read_exact(&mut theirs).await?;
        let (rqpn, rpsn, rip, _) = parse_record(&theirs)?;
        tcp.write_all(b"done\0").await?;
        qp.connect(attrs(a, rip, rqpn, rpsn))?;
        print_addrs(&qp, local, rqpn, rpsn, rip);
    } else {
        tcp.read_exact(&mut theirs).await?;
        let (rqpn, rpsn, rip, _) = parse_record(&theirs)?;
        qp.connect(attrs(a, rip, rqpn, rpsn))?;
        tcp.write_all(&mine).await?;
        let mut done = [0u8; 5];
        let _ = tcp.read(&mut done).await?;
        print_addrs(&qp, local, rqpn, rpsn, rip);
    }
    let client = a.server.is_some();
    let start = Instant::now();
    let mut posted = depth.min(a.iters.max(1));
    for i in 0..a.iters {
        if client {
            qp.send(lkey, 0, size, None).await?;
        }
        let wc = qp.recv().await?;
        if wc.status != metaroce::WcStatus::Success || wc.byte_len != size {
            return Err(format!("receive {i} failed: {:?}", wc).into());
        }
        if posted < a.iters {
            qp.post_recv(u64::from(posted), lkey, u64::from(size), size)?;
            posted += 1;
        }
        if !client {
            qp.send(lkey, 0, size, None).await?;
        }
    }
    let dt = start.elapsed().as_secs_f64();
    let bytes = f64::from(size) * f64::from(a.iters) * 2.0;
    println!(
        "{} bytes in {:.2} seconds = {:.2} Mbit/sec",
        bytes as u64,
        dt,
        bytes * 8.0 / dt / 1e6
    );
    println!(
        "{} iters in {:.2} seconds = {:.2} usec/iter",
        a.iters,
        dt,
        dt * 1e6 / f64::from(a.iters.max(1))
    );
    // Let the last ACK leave before the process exits.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let st = qp.stats().unwrap_or_default();
    println!(
        "metaroce: tx_requests {} retransmitted {} timeouts {} dup_rx {} seq_naks rx/tx {}/{} rnr_naks rx/tx {}/{}; endpoint {:?}",
        st.tx_requests,
        st.retransmitted,
        st.timeouts,
        st.duplicates_received,
        st.seq_naks_received,
        st.seq_naks_sent,
        st.rnr_naks_received,
        st.rnr_naks_sent,
        match &host {
            Host::Rc(ep) => format!("{:?}", ep.stats()),
            Host::Meta { ep, .. } =>
                format!("{:?} (RC side of a MetaRoCE endpoint)", ep.rc_stats()),
        }
    );
    Ok(())
}

fn print_addrs(qp: &QueuePair, local: Ipv4Addr, rqpn: u32, rpsn: u32, rip: Ipv4Addr) {
    println!(
        "  local address:  LID 0x0000, QPN 0x{:06x}, PSN 0x{:06x}, GID ::ffff:{}",
        qp.qpn(),
        qp.psn(),
        local
    );
    println!(
        "  remote address: LID 0x0000, QPN 0x{:06x}, PSN 0x{:06x}, GID ::ffff:{}",
        rqpn, rpsn, rip
    );
}

fn pat(i: u32, j: usize, seed: u8) -> u8 {
    (i.wrapping_mul(7) as u8)
        .wrapping_add((j as u8).wrapping_mul(13))
        .wrapping_add(seed)
}

/// The `--rw` record: `LID:QPN:PSN:GID:RKEY:VADDR:SIZE` (`%04x:%06x:%06x:%s:%08x:%016x:%08x`),
/// 86 characters + NUL.
const RW_REC: usize = 87;

async fn rw(a: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let size = a.size;
    if size % 8 != 0 || size == 0 {
        return Err("--rw needs a size that is a non-zero multiple of 8".into());
    }
    let mut tcp = tcp_pair(a, 18516).await?;
    let local = local_v4(a, &tcp)?;
    let ep = endpoint(local)?;
    let s = size as u64;
    // [0,s) target  [s,2s) write source  [2s,3s) read destination  [3s,3s+8) counter
    // [3s+8, 3s+16) atomic result
    let mr = ep.register(
        vec![0; 3 * s as usize + 16],
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
    );
    let qp = ep.create_qp(QpInit {
        access: Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
        ..Default::default()
    })?;
    let gid: String = local
        .to_ipv6_mapped()
        .octets()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let rec = format!(
        "{:04x}:{:06x}:{:06x}:{}:{:08x}:{:016x}:{:08x}",
        0,
        qp.qpn(),
        qp.psn(),
        gid,
        mr.rkey,
        mr.addr,
        size
    );
    let mut mine = [0u8; RW_REC];
    mine[..rec.len()].copy_from_slice(rec.as_bytes());
    let mut theirs = [0u8; RW_REC];
    let client = a.server.is_some();
    if client {
        tcp.write_all(&mine).await?;
        tcp.read_exact(&mut theirs).await?;
    } else {
        tcp.read_exact(&mut theirs).await?;
        tcp.write_all(&mine).await?;
    }
    let (rqpn, rpsn, rip, extra) = parse_record(&theirs)?;
    if extra.len() < 3 {
        return Err("rw record lacks RKEY:VADDR:SIZE".into());
    }
    let rkey = u32::from_str_radix(&extra[0], 16)?;
    let raddr = u64::from_str_radix(&extra[1], 16)?;
    let rsize = u32::from_str_radix(extra[2].trim_end_matches('\0'), 16)?;
    if rsize != size {
        return Err(format!("peer size {rsize} != ours {size}").into());
    }
    qp.connect(attrs(a, rip, rqpn, rpsn))?;
    print_addrs(&qp, local, rqpn, rpsn, rip);
    // Both QPs are connected once each side has written 'R'.
    tcp.write_all(b"R").await?;
    let mut b = [0u8; 1];
    tcp.read_exact(&mut b).await?;

    let mut failed = false;
    for phase in 0..2 {
        let active = (phase == 0) == client;
        let seed = if phase == 0 { 0x11 } else { 0x55 };
        let who = if active { "active" } else { "passive" };
        let start = Instant::now();
        if active {
            for i in 0..a.iters {
                let src: Vec<u8> = (0..size as usize).map(|j| pat(i, j, seed)).collect();
                ep.write_mr(mr.lkey, s, &src)?;
                qp.write(mr.lkey, s, size, raddr, rkey, None).await?;
                qp.read(mr.lkey, 2 * s, size, raddr, rkey).await?;
                if ep.read_mr(mr.lkey, 2 * s, s)? != src {
                    return Err(format!(
                        "phase {phase} iter {i}: READ returned other bytes than written"
                    )
                    .into());
                }
                let old = qp
                    .fetch_add(mr.lkey, 3 * s + 8, raddr + 3 * s, rkey, 1)
                    .await?;
                if old != u64::from(i) {
                    return Err(format!("phase {phase} iter {i}: FETCH_ADD returned {old}").into());
                }
            }
            tcp.write_all(b"D").await?;
            let mut r = [0u8; 2];
            tcp.read_exact(&mut r).await?;
            let ok = &r == b"OK";
            failed |= !ok;
            let dt = start.elapsed().as_secs_f64();
            println!(
                "rw phase {phase} {who}: {} x (WRITE {size} B + READ {size} B + FETCH_ADD) in {:.2} s = {:.0} us/iter; peer memory check: {}",
                a.iters,
                dt,
                dt * 1e6 / f64::from(a.iters.max(1)),
                if ok { "OK" } else { "BAD" }
            );
        } else {
            tcp.read_exact(&mut b).await?;
            let last = a.iters.saturating_sub(1);
            let want: Vec<u8> = (0..size as usize).map(|j| pat(last, j, seed)).collect();
            let mem = ep.read_mr(mr.lkey, 0, s)?;
            let ctr = ep.read_mr(mr.lkey, 3 * s, 8)?;
            let mut c = [0u8; 8];
            c.copy_from_slice(&ctr);
            let ok = (a.iters == 0 || mem == want) && u64::from_le_bytes(c) == u64::from(a.iters);
            tcp.write_all(if ok { b"OK" } else { b"NO" }).await?;
            failed |= !ok;
            println!(
                "rw phase {phase} {who}: memory after peer's {} WRITEs and FETCH_ADDs: {}",
                a.iters,
                if ok { "OK" } else { "BAD" }
            );
            // Reset the counter for symmetry (not needed by the protocol).
        }
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    if failed {
        return Err("memory check failed".into());
    }
    Ok(())
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tokio: {e}");
            std::process::exit(1);
        }
    };
    let deadline = Duration::from_secs(args.deadline);
    let r = rt.block_on(async {
        match tokio::time::timeout(deadline, async {
            if args.rw {
                rw(&args).await
            } else {
                pingpong(&args).await
            }
        })
        .await
        {
            Ok(r) => r,
            Err(_) => Err(format!("timed out after {}s", args.deadline).into()),
        }
    });
    if let Err(e) = r {
        eprintln!("metaroce-rc-pingpong: {e}");
        std::process::exit(1);
    }
}
