//! Goodput of the sans-IO core with AEAD packet protection on and off, in one run.
//!
//! Two endpoints in memory (no sockets, virtual clock, lossless) move a bulk RDMA WRITE;
//! the wall-clock time spent in the core (packet building, sealing, opening, placement)
//! gives the goodput. Runs alternate off / AES-128-GCM / AES-256-GCM several times, and the
//! data is verified after every run. Prints each figure and the ratio to the plain runs.
//!
//!     cargo run --release -p metaroce --example aead_goodput [-- MiB rounds]

use metaroce::crypto::{PacketProtectionKey, ProtectionConfig};
use metaroce::{Access, Endpoint, EndpointConfig, Event, WcStatus, WriteRequest};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

fn config(i: usize, key: Option<&[u8]>) -> EndpointConfig {
    let mut c = EndpointConfig::new(
        format!("10.0.0.{}:4791", i + 1).parse().unwrap(),
        (0..8).map(|k| 0xC000 + k + 16 * i as u16).collect(),
    );
    c.seed = 42 + i as u64;
    c.transport.max_gso_segments = 16;
    c.transport.pmtu = 4096;
    c.transport.packet_protection =
        key.map(|k| ProtectionConfig::new(PacketProtectionKey::new(k).unwrap()));
    c
}

/// Returns the seconds spent moving `len` bytes.
fn run(key: Option<&[u8]>, src: &[u8]) -> f64 {
    let mut eps = [
        Endpoint::new(config(0, key)).unwrap(),
        Endpoint::new(config(1, key)).unwrap(),
    ];
    let addrs: [SocketAddr; 2] = [eps[0].config().local_addr, eps[1].config().local_addr];
    let mut now = Instant::now();
    let mut q: VecDeque<(usize, SocketAddr, Vec<u8>)> = VecDeque::new();
    let mut buf = Vec::with_capacity(1 << 17);
    let c = eps[0].connect(now, addrs[1], None).unwrap();
    let local = eps[0].register_mr(src.to_vec(), Access::LOCAL_WRITE);
    let remote = eps[1].register_mr(
        vec![0; src.len()],
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
    );
    let mut posted = false;
    let mut done = false;
    let mut t0 = None;
    while !done {
        for i in 0..2 {
            while let Some(t) = eps[i].poll_transmit(now, &mut buf) {
                let from = SocketAddr::new(addrs[i].ip(), t.src_port);
                let seg = t.segment_size.unwrap_or(t.size);
                for d in buf[..t.size].chunks(seg) {
                    q.push_back((1 - i, from, d.to_vec()));
                }
            }
            while let Some(e) = eps[i].poll_event() {
                match e {
                    Event::Connected(_) if !posted => {
                        posted = true;
                        t0 = Some(std::time::Instant::now());
                        let chunk = 1 << 20;
                        for (k, off) in (0..src.len()).step_by(chunk).enumerate() {
                            eps[0]
                                .post_write(
                                    c,
                                    WriteRequest {
                                        wr_id: k as u64,
                                        lkey: local.lkey,
                                        local_offset: off as u64,
                                        len: chunk.min(src.len() - off) as u32,
                                        remote_addr: remote.addr + off as u64,
                                        rkey: remote.rkey,
                                        imm: (off + chunk >= src.len()).then_some(1),
                                    },
                                )
                                .unwrap();
                        }
                    }
                    Event::Completion { wc, .. } => {
                        assert_eq!(wc.status, WcStatus::Success);
                        if wc.wr_id as usize == src.len().div_ceil(1 << 20) - 1 {
                            done = true;
                        }
                    }
                    _ => {}
                }
            }
        }
        // Deliver one round trip's worth, then advance the virtual clock a little.
        let n = q.len();
        for _ in 0..n {
            let (to, from, d) = q.pop_front().unwrap();
            eps[to].handle_datagram(now, from, Some(addrs[to].ip()), None, &d);
        }
        now += Duration::from_micros(2);
        for e in eps.iter_mut() {
            if e.poll_timeout().is_some_and(|t| t <= now) {
                e.handle_timeout(now);
            }
        }
    }
    let secs = t0.unwrap().elapsed().as_secs_f64();
    assert_eq!(
        eps[1].mr_read(remote.lkey, 0, src.len() as u64).unwrap(),
        src
    );
    secs
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().map_or(256, |a| a.parse().unwrap());
    let rounds: usize = args.next().map_or(3, |a| a.parse().unwrap());
    let src: Vec<u8> = (0..mib << 20).map(|i| (i * 7 + i / 4093) as u8).collect();
    let k128 = [0x11u8; 16];
    let k256 = [0x22u8; 32];
    let modes: [(&str, Option<&[u8]>); 3] = [
        ("plain", None),
        ("aes-128-gcm", Some(&k128)),
        ("aes-256-gcm", Some(&k256)),
    ];
    let mut best = [f64::MAX; 3];
    for r in 0..rounds {
        for (m, (name, key)) in modes.iter().enumerate() {
            let s = run(*key, &src);
            let gbps = (src.len() * 8) as f64 / s / 1e9;
            println!("round {r} {name:>12}: {mib} MiB in {s:.3} s = {gbps:.2} Gbit/s");
            best[m] = best[m].min(s);
        }
    }
    let g = |s: f64| (src.len() * 8) as f64 / s / 1e9;
    println!(
        "best of {rounds}: plain {:.2} Gbit/s, aes-128-gcm {:.2} Gbit/s ({:.2}x), aes-256-gcm {:.2} Gbit/s ({:.2}x)",
        g(best[0]),
        g(best[1]),
        best[0] / best[1],
        g(best[2]),
        best[0] / best[2]
    );
}
