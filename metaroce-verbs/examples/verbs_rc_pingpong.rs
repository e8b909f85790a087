//! `ibv_rc_pingpong` on metaroce-verbs: the same out-of-band exchange (TCP 18515, 52-byte
//! `LID:QPN:PSN:GID` records) and the same ping-pong (the client SENDs first; each side
//! sends its next message once a message arrived), so it pairs with the stock tool and with
//! `metaroce-rc-pingpong` (metaroce's RoCEv2 mode) in either role.
//!
//! ```text
//! verbs_rc_pingpong -d rxe0 -g 1 -s 4096 -n 500            # server
//! verbs_rc_pingpong -d rxe0 -g 1 -s 4096 -n 500 10.77.0.1  # client
//! ```

use metaroce_verbs::{exchange, Context, QpConfig, RcQp};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};

struct Args {
    server: Option<String>,
    dev: Option<String>,
    gid: Option<u8>,
    size: u32,
    iters: u32,
    port: u16,
    mtu: u32,
    rx_depth: u32,
}

fn usage() -> ! {
    eprintln!("usage: verbs_rc_pingpong [-d DEV] [-g GID_INDEX] [-s SIZE] [-n ITERS] [-p PORT] [-m MTU] [-r RX_DEPTH] [SERVER]");
    std::process::exit(2)
}

fn parse() -> Args {
    let mut a = Args {
        server: None,
        dev: None,
        gid: None,
        size: 4096,
        iters: 1000,
        port: 18515,
        mtu: 1024,
        rx_depth: 500,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| usage());
        match x.as_str() {
            "-d" => a.dev = Some(val()),
            "-g" => a.gid = Some(val().parse().unwrap_or_else(|_| usage())),
            "-s" => a.size = val().parse().unwrap_or_else(|_| usage()),
            "-n" => a.iters = val().parse().unwrap_or_else(|_| usage()),
            "-p" => a.port = val().parse().unwrap_or_else(|_| usage()),
            "-m" => a.mtu = val().parse().unwrap_or_else(|_| usage()),
            "-r" => a.rx_depth = val().parse().unwrap_or_else(|_| usage()),
            s if !s.starts_with('-') => a.server = Some(s.to_string()),
            _ => usage(),
        }
    }
    a
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = parse();
    let ctx = Context::open(a.dev.as_deref())?;
    let pd = ctx.alloc_pd()?;
    let qp = RcQp::create(
        &pd,
        QpConfig {
            gid_index: a.gid,
            path_mtu: a.mtu,
            slot_size: a.size.max(1),
            recv_slots: a.rx_depth.clamp(1, 1024),
            send_slots: 16,
            ..QpConfig::default()
        },
    )?;
    let mut tcp = match &a.server {
        Some(h) => {
            let addr = format!("{h}:{}", a.port);
            let t0 = Instant::now();
            loop {
                match TcpStream::connect(&addr).await {
                    Ok(s) => break s,
                    Err(_) if t0.elapsed() < Duration::from_secs(60) => {
                        tokio::time::sleep(Duration::from_millis(250)).await
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
        None => {
            let l = TcpListener::bind(("0.0.0.0", a.port)).await?;
            eprintln!("waiting for a client on TCP port {}", a.port);
            l.accept().await?.0
        }
    };
    let client = a.server.is_some();
    let remote = if client {
        exchange::client(&mut tcp, &qp).await?
    } else {
        exchange::server(&mut tcp, &qp).await?
    };
    let l = qp.local();
    println!(
        "  local address:  LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}, GID {}",
        l.lid, l.qpn, l.psn, l.gid
    );
    println!(
        "  remote address: LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}, GID {}",
        remote.lid, remote.qpn, remote.psn, remote.gid
    );
    let msg = vec![0x7bu8; a.size as usize];
    let start = Instant::now();
    for i in 0..a.iters {
        if client {
            qp.send(&msg, None).await?;
        }
        let m = tokio::time::timeout(Duration::from_secs(30), qp.recv()).await??;
        if m.data.len() != a.size as usize {
            return Err(format!("message {i}: {} bytes, want {}", m.data.len(), a.size).into());
        }
        if !client {
            qp.send(&msg, None).await?;
        }
    }
    let dt = start.elapsed().as_secs_f64();
    let bytes = f64::from(a.size) * f64::from(a.iters) * 2.0;
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
    // Let the last ACK leave before the QP is destroyed.
    tokio::time::sleep(Duration::from_millis(200)).await;
    Ok(())
}
