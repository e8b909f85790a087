//! Targeted injection over real UDP sockets on loopback (issue #9): while a WRITE bulk
//! transfer runs, a separate thread with a plain `std::net::UdpSocket` sends 10,000 forged
//! packets per second from the client's IP, aimed at the known QPNs of both ends: WRITEs to
//! the server's QPN (valid ICRC, the target region's rkey and address, random PSNs, floors
//! and op ids) and ACKs to the client's QPN (random cumulative PSNs and SACK bits). The
//! test measures the goodput of a clean run and of the attacked run side by side, checks
//! that the data verifies and that every WRITE reports Success, and prints the ratio (the
//! issue asks for at least 90 %; the figure is reported, not asserted: tests never assert
//! wall-clock numbers).

mod common;

use common::pair;
use metaroce::wire::{self, icrc, AckEth, Bth, Headers, Opcode, PathEth, Reth, WriteEth};
use metaroce::Access;
use metaroce_tokio::{Config, Connection};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOTAL: usize = 32 << 20;
const CHUNK: usize = 1 << 20;
const RATE: u64 = 10_000;
const MAX_FORGED: u64 = 200_000;
/// Runs of each kind; the fastest of each is compared.
const RUNS: usize = 4;

/// xorshift64*: the forger's own randomness.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// What the forger knows: both QPNs, both addresses, the target region's rkey and VA.
#[derive(Clone, Copy)]
struct Target {
    server: SocketAddr,
    client: SocketAddr,
    server_qpn: u32,
    client_qpn: u32,
    rkey: u32,
    va: u64,
    len: u64,
}

fn forged(rng: &mut Rng, t: &Target, from_port: u16, k: u64) -> (Vec<u8>, SocketAddr) {
    let r = rng.next();
    let psn = (r as u32) & wire::PSN_MASK;
    let (bth, hdrs, payload, to) = if k % 2 == 0 {
        let payload = vec![0xEE; 1024];
        let floor = psn.wrapping_sub((r >> 24) as u32 % 300) & wire::PSN_MASK;
        let bth = Bth::new(Opcode::MR_WRITE, t.server_qpn, psn);
        let off = (r >> 40) % (t.len / 1024) * 1024;
        let hdrs = Headers::Write {
            path: PathEth {
                path_id: (r >> 33) as u8 % 4,
                flags: 0,
                timestamp: rng.next() as u32,
                floor_psn: floor,
                plane: 0,
            },
            reth: Reth {
                va: t.va + off,
                rkey: t.rkey,
                dma_len: 1024,
            },
            write: WriteEth {
                op_id: rng.next() as u32,
                offset: 0,
            },
            imm: None,
        };
        (bth, hdrs, payload, t.server)
    } else {
        let bth = Bth::new(Opcode::MR_ACK, t.client_qpn, psn);
        let mut sack = [0u8; 32];
        for b in sack.iter_mut() {
            *b = rng.next() as u8;
        }
        let hdrs = Headers::Ack(AckEth {
            path_id: (r >> 33) as u8 % 4,
            flags: 0,
            ack_delay: 0,
            echo_ts: rng.next() as u32,
            ce_count: rng.next() as u32,
            window_grant: 0,
            rate_hint: 1,
            sack,
        });
        (bth, hdrs, Vec::new(), t.client)
    };
    let mut buf = vec![0u8; wire::packet_len(&hdrs, payload.len())];
    wire::emit_packet(&bth, &hdrs, &payload, &mut buf).unwrap();
    let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let ip = icrc::IpHeader::synthesized(lo, lo).unwrap();
    icrc::stamp(&ip, from_port, to.port(), &mut buf).unwrap();
    (buf, to)
}

/// Send forged packets at `RATE` per second while `active`, until `stop` (at most
/// `MAX_FORGED`, at most 60 s); `sent` counts them.
fn attack(t: Target, active: Arc<AtomicBool>, stop: Arc<AtomicBool>, sent: Arc<AtomicU64>) {
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    let port = sock.local_addr().unwrap().port();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let start = Instant::now();
    let mut k = 0u64;
    let mut on = Duration::ZERO;
    while !stop.load(Ordering::Relaxed)
        && k < MAX_FORGED
        && start.elapsed() < Duration::from_secs(60)
    {
        // Paced in bursts once a millisecond: `RATE` per second of active time.
        std::thread::sleep(Duration::from_millis(1));
        if !active.load(Ordering::Relaxed) {
            continue;
        }
        on += Duration::from_millis(1);
        let due = (on.as_micros() as u64 * RATE / 1_000_000).min(MAX_FORGED);
        while k < due {
            let (buf, to) = forged(&mut rng, &t, port, k);
            let _ = sock.send_to(&buf, to);
            k += 1;
        }
        sent.store(k, Ordering::Relaxed);
    }
}

/// WRITE `TOTAL` bytes in `CHUNK`-byte WRITEs, all posted at once; returns the elapsed
/// time once every one completed with Success.
async fn bulk(
    c: &Connection,
    src: &metaroce_tokio::MemoryRegion,
    dst: &metaroce_tokio::MemoryRegion,
) -> Duration {
    let t0 = Instant::now();
    let writes = (0..TOTAL / CHUNK).map(|k| {
        let off = (k * CHUNK) as u64;
        c.write(src, off..off + CHUNK as u64, dst.remote(), off)
    });
    for wc in futures::future::join_all(writes).await {
        let wc = wc.expect("WRITE failed");
        assert_eq!(wc.status, metaroce::WcStatus::Success);
    }
    t0.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_write_goodput_under_10k_forged_packets_per_second() {
    let (server, client, c, s) = pair(Config {
        seed: Some(0x5EC),
        ..Config::default()
    })
    .await;
    let data: Vec<u8> = (0..TOTAL).map(|i| (i % 251) as u8).collect();
    let src = client.register(data.clone(), Access::LOCAL_WRITE);
    let dst = server.alloc(TOTAL, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let keys = dst.keys();
    let target = Target {
        server: server.local_addr(),
        client: client.local_addr(),
        server_qpn: s.handle().0,
        client_qpn: c.handle().0,
        rkey: keys.rkey,
        va: keys.addr,
        len: keys.len,
    };
    let active = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let th = {
        let (active, stop, sent) = (active.clone(), stop.clone(), sent.clone());
        std::thread::spawn(move || attack(target, active, stop, sent))
    };
    let rtos = |c: &Connection| {
        c.stats()
            .unwrap()
            .paths
            .iter()
            .map(|p| p.stats.rtos)
            .sum::<u64>()
    };
    // Clean and attacked runs alternate on the same connection (the machine is shared:
    // the fastest run of each kind is compared).
    let (mut clean, mut attacked) = (Duration::MAX, Duration::MAX);
    let (mut rtos_clean, mut rtos_attacked) = (0, 0);
    for run in 0..2 * RUNS {
        let attack_on = run % 2 == 1;
        active.store(attack_on, Ordering::Relaxed);
        if attack_on {
            // Let the attack reach its rate first.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let r0 = rtos(&c);
        let t = bulk(&c, &src, &dst).await;
        active.store(false, Ordering::Relaxed);
        let r = rtos(&c) - r0;
        println!(
            "{} run: {t:?}, {r} RTOs",
            if attack_on { "attacked" } else { "clean" }
        );
        if attack_on {
            attacked = attacked.min(t);
            rtos_attacked += r;
        } else {
            clean = clean.min(t);
            rtos_clean += r;
        }
        assert!(
            dst.read(0, TOTAL as u64).unwrap() == data,
            "data differs after the {} run (forged bytes landed or real ones are missing)",
            if attack_on { "attacked" } else { "clean" }
        );
        dst.write(0, &vec![0; TOTAL]).unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    th.join().unwrap();
    let forged = sent.load(Ordering::Relaxed);
    let mb = TOTAL as f64 / 1e6;
    let (g_clean, g_att) = (
        mb * 8.0 / clean.as_secs_f64(),
        mb * 8.0 / attacked.as_secs_f64(),
    );
    let cs = c.stats().unwrap();
    let ss = s.stats().unwrap();
    let est = server.stats();
    println!(
        "best of {RUNS}: clean: {TOTAL} B in {clean:?} = {g_clean:.0} Mbit/s; attacked \
         ({forged} forged packets in all, {RATE}/s while on): {attacked:?} = {g_att:.0} Mbit/s; \
         goodput ratio {:.3}",
        g_att / g_clean
    );
    println!(
        "client: bad_acks {} acks_ignoring_unsent {} RTOs clean {rtos_clean} attacked \
         {rtos_attacked}; server: oow {} bad_floor {} dup {} op_id_out_of_window {} \
         op_mismatches {}; endpoint bad_icrc {} unknown {}",
        cs.bad_acks,
        cs.acks_ignoring_unsent,
        ss.out_of_window_packets,
        ss.bad_floor_packets,
        ss.duplicate_packets,
        ss.recv.op_id_out_of_window,
        ss.recv.op_mismatches,
        est.bad_icrc,
        est.unknown_connection,
    );
    assert!(forged > 0);
}
