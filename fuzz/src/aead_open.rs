//! `aead_open`: the AEAD packet-protection path on arbitrary input.
//!
//! Part 1, `metaroce::crypto::PacketProtection::open` directly: raw input bytes, and genuine
//! sealed packets mutated by the input (byte edits, truncation, a changed trailer word),
//! before and after key updates. Checked: no panic; a rejected packet is left unchanged; a
//! mutated packet that differs from every genuine one in a covered byte never opens; a
//! genuine packet opens exactly once and decrypts to its plaintext.
//!
//! Part 2, two endpoints with an AEAD connection (in memory, virtual time): the honest
//! client sends SENDs to the server while the input injects raw datagrams and mutated
//! (ICRC re-stamped) copies of genuine packets at the server, and asks for key updates.
//! Checked: no panic; every completion is Success; every message that arrives is exactly
//! one that was sent, in order.

use crate::util::{self, addr_of, ip_of};
use arbitrary::Arbitrary;
use bytes::Bytes;
use metaroce::crypto::{PacketProtection, PacketProtectionKey, ProtectionConfig, Side};
use metaroce::wire::{self, Bth, Headers, Opcode, PathEth, SendEth, Trailer};
use metaroce::{Endpoint, Event, WcStatus};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const MAX_STEPS: usize = 64;
const MAX_MSGS: usize = 16;

/// The fuzz input.
#[derive(Arbitrary, Debug, Clone)]
pub struct Input {
    /// AES-256-GCM (else AES-128-GCM).
    pub aes256: bool,
    /// Replay window selector: 64 << (x % 5).
    pub window: u8,
    /// Direct `open` steps.
    pub direct: Vec<Direct>,
    /// Endpoint steps.
    pub wire: Vec<WireStep>,
}

/// One step of part 1.
#[derive(Arbitrary, Debug, Clone)]
pub enum Direct {
    /// Open these bytes as they are.
    Raw(Vec<u8>),
    /// Seal a packet with this payload (and keep it for later steps).
    Seal(Vec<u8>),
    /// Open sealed packet `i` (mod count) unchanged.
    Genuine(u8),
    /// Open sealed packet `i` with `bytes[k].0 ^= bytes[k].1` edits.
    Mutate(u8, Vec<(u16, u8)>),
    /// Open sealed packet `i` truncated by `n` bytes.
    Truncate(u8, u8),
    /// Open sealed packet `i` with its trailer word replaced.
    Word(u8, u64),
    /// The sender asks for a key update.
    KeyUpdate,
    /// The receiver seals a packet that the sender opens (confirms key updates).
    Reply,
}

/// One step of part 2.
#[derive(Arbitrary, Debug, Clone)]
pub enum WireStep {
    /// The client posts a SEND of this many bytes (x * 37).
    Send(u8),
    /// Deliver raw bytes to the server from the client's first path.
    Raw(Vec<u8>),
    /// Deliver a mutated, ICRC re-stamped copy of held genuine packet `i` to the server.
    Mutate(u8, Vec<(u16, u8)>),
    /// Deliver held genuine packet `i` again (a replay).
    Replay(u8),
    /// Let the network run for x * 10 µs.
    Run(u8),
    /// The client (false) or the server (true) asks for a key update.
    KeyUpdate(bool),
}

fn packet(payload: &[u8], psn: u32) -> Vec<u8> {
    let bth = Bth::new(Opcode::MR_SEND, 0x42, psn);
    let h = Headers::Send {
        path: PathEth::default(),
        send: SendEth {
            msg_len: payload.len() as u32,
            ..Default::default()
        },
    };
    let t = Trailer::Aead {
        key_phase: false,
        pn: 0,
        tag: [0; 16],
    };
    let mut buf = vec![0u8; wire::packet_len_with(&h, payload.len(), &t)];
    wire::emit_packet_with(&bth, &h, payload, &t, &mut buf).expect("emit");
    buf
}

fn protection_config(input: &Input) -> ProtectionConfig {
    let key = if input.aes256 {
        PacketProtectionKey::new(&[0x5a; 32])
    } else {
        PacketProtectionKey::new(&[0xa5; 16])
    }
    .expect("key length");
    let mut c = ProtectionConfig::new(key);
    c.replay_window = 64 << (input.window % 5);
    c
}

fn direct(input: &Input) {
    let cfg = protection_config(input);
    let mut tx = PacketProtection::new(&cfg, Side::Client, 1, 2);
    let mut rx = PacketProtection::new(&cfg, Side::Server, 1, 2);
    // (sealed bytes, plaintext bytes, opened already)
    let mut sealed: Vec<(Vec<u8>, Vec<u8>, bool)> = Vec::new();
    for step in input.direct.iter().take(MAX_STEPS) {
        match step {
            Direct::Raw(b) => {
                let mut b = b.clone();
                let before = b.clone();
                if rx.open(&mut b).is_err() {
                    assert_eq!(b, before, "rejected input changed");
                }
            }
            Direct::Seal(p) => {
                let plain = packet(&p[..p.len().min(2048)], sealed.len() as u32);
                let mut s = plain.clone();
                tx.seal(&mut s).expect("seal");
                sealed.push((s, plain, false));
            }
            Direct::Genuine(i) => {
                let n = sealed.len();
                if n == 0 {
                    continue;
                }
                let (s, plain, opened) = &mut sealed[*i as usize % n];
                let mut b = s.clone();
                match rx.open(&mut b) {
                    Ok(_) => {
                        assert!(!*opened, "a genuine packet opened twice");
                        *opened = true;
                        let body = b.len() - 28;
                        assert_eq!(b[..body], plain[..body], "wrong plaintext");
                    }
                    Err(_) => assert_eq!(&b, s),
                }
            }
            Direct::Mutate(i, edits) => {
                let n = sealed.len();
                if n == 0 {
                    continue;
                }
                let (s, _, _) = &sealed[*i as usize % n];
                let mut b = s.clone();
                for &(k, x) in edits.iter().take(16) {
                    let len = b.len();
                    b[k as usize % len] ^= x;
                }
                // Bytes the AEAD does not cover: BTH byte 4 (masked) and the ICRC.
                let len = b.len();
                let covered_change = b
                    .iter()
                    .zip(s.iter())
                    .enumerate()
                    .any(|(k, (x, y))| x != y && k != 4 && k < len - 4);
                let before = b.clone();
                match rx.open(&mut b) {
                    Ok(_) => assert!(!covered_change, "a modified packet opened"),
                    Err(_) => assert_eq!(b, before),
                }
            }
            Direct::Truncate(i, t) => {
                let n = sealed.len();
                if n == 0 {
                    continue;
                }
                let (s, _, _) = &sealed[*i as usize % n];
                let cut = (*t as usize % 32 + 1).min(s.len());
                let mut b = s[..s.len() - cut].to_vec();
                assert!(rx.open(&mut b).is_err(), "a truncated packet opened");
            }
            Direct::Word(i, w) => {
                let n = sealed.len();
                if n == 0 {
                    continue;
                }
                let (s, _, _) = &sealed[*i as usize % n];
                let mut b = s.clone();
                let at = b.len() - 28;
                let orig = u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"));
                b[at..at + 8].copy_from_slice(&w.to_be_bytes());
                let r = rx.open(&mut b);
                assert!(*w == orig || r.is_err(), "a changed trailer word opened");
            }
            Direct::KeyUpdate => {
                tx.request_key_update();
            }
            Direct::Reply => {
                let mut b = packet(b"ack", 0);
                rx.seal(&mut b).expect("seal");
                tx.open(&mut b).expect("the genuine reply opens");
            }
        }
    }
}

fn restamp(from: SocketAddr, to: SocketAddr, data: &mut [u8]) {
    util::restamp(data, from.ip(), to.ip(), from.port(), to.port());
}

fn endpoints(input: &Input) {
    let mut eps: Vec<Endpoint> = (0..2)
        .map(|i| {
            let mut c = util::config(i, 7);
            c.transport.packet_protection = Some(protection_config(input));
            Endpoint::new(c).expect("config")
        })
        .collect();
    let mut now = Instant::now();
    let start = now;
    let client = eps[0].connect(now, addr_of(1), None).expect("connect");
    let mut queue: VecDeque<(usize, SocketAddr, Vec<u8>)> = VecDeque::new();
    let mut held: Vec<(SocketAddr, Vec<u8>)> = Vec::new();
    let mut sent: Vec<Vec<u8>> = Vec::new();
    let mut got: Vec<Bytes> = Vec::new();
    let mut server = None;
    let mut buf = Vec::new();
    let mut pump = |eps: &mut Vec<Endpoint>,
                    queue: &mut VecDeque<(usize, SocketAddr, Vec<u8>)>,
                    held: &mut Vec<(SocketAddr, Vec<u8>)>,
                    now: Instant| {
        for (i, ep) in eps.iter_mut().enumerate().take(2) {
            while let Some(t) = ep.poll_transmit(now, &mut buf) {
                let from = SocketAddr::new(ip_of(i), t.src_port);
                let to = 1 - i;
                for d in util::segments(&t, &buf) {
                    if to == 1 && held.len() < 256 {
                        held.push((from, d.to_vec()));
                    }
                    queue.push_back((to, from, d.to_vec()));
                }
            }
        }
    };
    let mut run = |eps: &mut Vec<Endpoint>,
                   queue: &mut VecDeque<(usize, SocketAddr, Vec<u8>)>,
                   held: &mut Vec<(SocketAddr, Vec<u8>)>,
                   now: &mut Instant,
                   dur: Duration| {
        let until = *now + dur;
        for _ in 0..10_000 {
            pump(eps, queue, held, *now);
            if let Some((to, from, d)) = queue.pop_front() {
                eps[to].handle_datagram(*now, from, Some(ip_of(to)), None, &d);
                continue;
            }
            let next = eps.iter().filter_map(|e| e.poll_timeout()).min();
            match next {
                Some(t) if t <= until => {
                    *now = (*now).max(t);
                    for e in eps.iter_mut() {
                        if e.poll_timeout().is_some_and(|t| t <= *now) {
                            e.handle_timeout(*now);
                        }
                    }
                }
                _ => break,
            }
        }
        *now = (*now).max(until);
    };
    run(
        &mut eps,
        &mut queue,
        &mut held,
        &mut now,
        Duration::from_millis(5),
    );
    let drain = |eps: &mut Vec<Endpoint>, got: &mut Vec<Bytes>, server: &mut Option<_>| {
        while let Some(e) = eps[0].poll_event() {
            if let Event::Completion { wc, .. } = e {
                assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            }
        }
        while let Some(e) = eps[1].poll_event() {
            match e {
                Event::Incoming(h) => *server = Some(h),
                Event::Message { data, .. } => got.push(data),
                _ => {}
            }
        }
    };
    drain(&mut eps, &mut got, &mut server);
    for step in input.wire.iter().take(MAX_STEPS) {
        let srv = addr_of(1);
        match step {
            WireStep::Send(n) => {
                if sent.len() < MAX_MSGS {
                    let m = util::pattern(sent.len() as u64, *n as usize * 37);
                    if eps[0]
                        .post_send(client, 0, sent.len() as u64, Bytes::from(m.clone()))
                        .is_ok()
                    {
                        sent.push(m);
                    }
                }
            }
            WireStep::Raw(b) => {
                let from = SocketAddr::new(ip_of(0), util::source_ports(0)[0]);
                eps[1].handle_datagram(now, from, Some(ip_of(1)), None, b);
            }
            WireStep::Mutate(i, edits) => {
                if !held.is_empty() {
                    let (from, d) = &held[*i as usize % held.len()];
                    let mut d = d.clone();
                    for &(k, x) in edits.iter().take(16) {
                        let len = d.len();
                        d[k as usize % len] ^= x;
                    }
                    restamp(*from, srv, &mut d);
                    eps[1].handle_datagram(now, *from, Some(ip_of(1)), None, &d);
                }
            }
            WireStep::Replay(i) => {
                if !held.is_empty() {
                    let (from, d) = held[*i as usize % held.len()].clone();
                    eps[1].handle_datagram(now, from, Some(ip_of(1)), None, &d);
                }
            }
            WireStep::Run(t) => run(
                &mut eps,
                &mut queue,
                &mut held,
                &mut now,
                Duration::from_micros(u64::from(*t) * 10),
            ),
            WireStep::KeyUpdate(on_server) => {
                if *on_server {
                    if let Some(h) = server {
                        let _ = eps[1].update_keys(h);
                    }
                } else {
                    let _ = eps[0].update_keys(client);
                }
            }
        }
        drain(&mut eps, &mut got, &mut server);
        if now - start > Duration::from_secs(2) {
            break;
        }
    }
    run(
        &mut eps,
        &mut queue,
        &mut held,
        &mut now,
        Duration::from_millis(20),
    );
    drain(&mut eps, &mut got, &mut server);
    if std::env::var_os("AEAD_TRACE").is_some() {
        eprintln!(
            "aead_open: sent {} got {} held {}",
            sent.len(),
            got.len(),
            held.len()
        );
    }
    assert!(got.len() <= sent.len(), "more messages than sent");
    for (g, s) in got.iter().zip(&sent) {
        assert_eq!(&g[..], &s[..], "a message arrived altered or out of order");
    }
}

/// Run one input.
pub fn run(input: &Input) {
    direct(input);
    endpoints(input);
}
