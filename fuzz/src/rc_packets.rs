//! `rc_packets`: the RoCEv2 RC mode (`metaroce::rocev2`, IBA Vol. 1 ch. 9) between two
//! stand-alone RC endpoints with connected QPs. Endpoint A posts a schedule of SENDs
//! (with and without immediate), WRITEs (with and without immediate), READs and both
//! atomics; B posts receives. On the link the input decides, packet by packet and in both
//! directions, to pass, drop, or mutate the packet (a header byte, the opcode, the PSN,
//! the length, the pad count) and re-stamp its ICRC so that it passes the ICRC check, as
//! an on-path attacker or a broken peer would; afterwards it injects raw bytes and late
//! copies of earlier packets.
//!
//! Checked: no panic; regions that grant no remote access are never written; every send
//! work request completes exactly once, in posting order, with its opcode; every receive
//! completes at most once. (RC mode makes no claim against forged packets beyond the
//! standard's, DESIGN §3, so statuses are not checked: a mutated packet may legally turn
//! into another operation.)

use arbitrary::Arbitrary;
use metaroce::rocev2::{RecvWr, SendOp, SendWr};
use metaroce::testing::rc::{restamp, Net, Seen};
use metaroce::Access;
use std::collections::HashMap;
use std::time::Duration;

const MAX_OPS: usize = 12;
const MAX_ACTS: usize = 256;
const MAX_INJECT: usize = 16;
const SRC_LEN: usize = 16 * 1024;
const RECVS: u64 = 8;
const RECV_LEN: u32 = 2048;

/// The fuzz input.
#[derive(Arbitrary, Debug, Clone)]
pub struct Input {
    /// Path MTU: 256 << (x % 5).
    pub pmtu_sel: u8,
    /// Initial PSNs of A and B (`None`: drawn), to reach the 2^24 wrap.
    pub psns: (Option<u32>, Option<u32>),
    /// Operations A posts, in order.
    pub ops: Vec<OpSpec>,
    /// What the link does to each packet, in order of transmission (both directions);
    /// once these run out every packet passes.
    pub acts: Vec<Act>,
    /// Datagrams injected after the run (then the endpoints run to quiescence again).
    pub inject: Vec<Inject>,
}

/// One operation A posts.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct OpSpec {
    /// SEND, SEND with immediate, WRITE, WRITE with immediate, READ, FETCH_ADD,
    /// CMP_SWAP (x % 7).
    pub kind: u8,
    /// Length (x % (2 * RECV_LEN + 1)); atomics take 8.
    pub len: u16,
    /// Offset in the remote region (x % 4096; atomics align it down to 8).
    pub off: u16,
}

/// What the link does to one packet.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Act {
    /// Deliver it.
    Pass,
    /// Lose it.
    Drop,
    /// XOR a byte of the BTH or extension headers (index % 44) with a non-zero value.
    Byte(u8, u8),
    /// Another opcode (x % 0x18: the RC opcodes and a few beyond).
    Opcode(u8),
    /// PSN moved by a small amount.
    Psn(i8),
    /// Payload grown or shrunk by 4 × (x % 64) bytes.
    Len(bool, u8),
    /// Another pad count (x % 4).
    Pad(u8),
}

/// A datagram injected after the run.
#[derive(Arbitrary, Debug, Clone)]
pub enum Inject {
    /// Raw bytes as the UDP payload, from the peer's address, ICRC stamped.
    Raw { to_b: bool, bytes: Vec<u8> },
    /// A late copy of the n-th packet seen on the link (n % packets seen).
    Replay(u16),
}

/// Apply `act` to the packet `s`; `true` if it is lost.
fn apply(act: Act, s: &mut Seen) -> bool {
    let Some(udp) = s.ip_packet.get(28..) else {
        return false;
    };
    let mut udp = udp.to_vec();
    let body = udp.len().saturating_sub(4);
    match act {
        Act::Pass => return false,
        Act::Drop => return true,
        Act::Byte(at, x) => {
            let at = usize::from(at) % body.clamp(1, 44);
            if let Some(b) = udp.get_mut(at) {
                *b ^= x.max(1);
            }
        }
        Act::Opcode(op) => udp[0] = op % 0x18,
        Act::Psn(d) => {
            let psn = u32::from_be_bytes([0, udp[9], udp[10], udp[11]]);
            let p = psn.wrapping_add_signed(i32::from(d)) & 0xFF_FFFF;
            udp[9..12].copy_from_slice(&p.to_be_bytes()[1..]);
        }
        Act::Len(grow, n) => {
            let d = 4 * usize::from(n % 64);
            if grow {
                udp.splice(body..body, (0..d).map(|i| i as u8));
            } else if body >= d + 12 {
                udp.drain(body - d..body);
            }
        }
        Act::Pad(p) => udp[1] = (udp[1] & !0x30) | ((p % 4) << 4),
    }
    if let Some(pkt) = restamp(&s.ip_packet, udp) {
        s.ip_packet = pkt;
    }
    false
}

/// Run one input.
pub fn run(input: &Input) {
    let mtu = 256u32 << (input.pmtu_sel % 5);
    // Bounded RNR retries: a mutation may turn a WRITE into a WRITE with immediate that
    // takes a receive, and rnr_retry 7 (retry forever) would then never complete a SEND.
    let mut n = Net::with(mtu, input.psns.0, input.psns.1, |a| a.rnr_retry = 3);
    let src =
        n.a.register_mr(crate::util::pattern(1, SRC_LEN), Access::LOCAL_WRITE);
    let res = n.a.register_mr(vec![0; SRC_LEN], Access::LOCAL_WRITE);
    let guard_a = n.a.register_mr(vec![0xAA; 4096], Access::LOCAL_WRITE);
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let tgt =
        n.b.register_mr(crate::util::pattern(2, 8192), all | Access::REMOTE_ATOMIC);
    let guard_b = n.b.register_mr(vec![0xBB; 4096], Access::LOCAL_WRITE);
    let rbuf = n.b.register_mr(
        vec![0; (RECVS as usize) * RECV_LEN as usize],
        Access::LOCAL_WRITE,
    );
    for i in 0..RECVS {
        let r = RecvWr {
            wr_id: 1000 + i,
            lkey: rbuf.lkey,
            offset: i * u64::from(RECV_LEN),
            len: RECV_LEN,
        };
        n.b.post_recv(n.qb, r).expect("receive posted");
    }
    let mut posted: Vec<(u64, SendOp)> = Vec::new();
    for (i, o) in input.ops.iter().take(MAX_OPS).enumerate() {
        let len = u32::from(o.len) % (2 * RECV_LEN + 1);
        let off = u64::from(o.off % 4096);
        let remote_addr = tgt.addr + off;
        let (op, len, local) = match o.kind % 7 {
            0 => (SendOp::Send { imm: None }, len, src.lkey),
            1 => (
                SendOp::Send {
                    imm: Some(i as u32),
                },
                len,
                src.lkey,
            ),
            2 => (
                SendOp::Write {
                    remote_addr,
                    rkey: tgt.rkey,
                    imm: None,
                },
                len,
                src.lkey,
            ),
            3 => (
                SendOp::Write {
                    remote_addr,
                    rkey: tgt.rkey,
                    imm: Some(i as u32),
                },
                len,
                src.lkey,
            ),
            4 => (
                SendOp::Read {
                    remote_addr,
                    rkey: tgt.rkey,
                },
                len,
                res.lkey,
            ),
            5 => (
                SendOp::FetchAdd {
                    remote_addr: tgt.addr + (off & !7),
                    rkey: tgt.rkey,
                    add: 1,
                },
                8,
                res.lkey,
            ),
            _ => (
                SendOp::CompareSwap {
                    remote_addr: tgt.addr + (off & !7),
                    rkey: tgt.rkey,
                    compare: 0,
                    swap: 9,
                },
                8,
                res.lkey,
            ),
        };
        // Each op's local range is its own slot, so READ results never overlap.
        let local_offset = (i as u64 * 1024) % (SRC_LEN as u64 - 4096);
        let wr = SendWr {
            wr_id: i as u64,
            op,
            lkey: local,
            local_offset,
            len,
            solicited: false,
        };
        if n.a.post_send(n.qa, wr).is_ok() {
            posted.push((i as u64, op));
        }
    }
    let mut acts = input.acts.iter().take(MAX_ACTS).copied();
    n.run(
        Duration::from_secs(30),
        &mut |s| apply(acts.next().unwrap_or(Act::Pass), s),
        &|_| false,
    );
    for inj in input.inject.iter().take(MAX_INJECT) {
        match inj {
            Inject::Raw { to_b, bytes } => {
                let Some(orig) = n.wire.iter().find(|s| s.from_a == *to_b) else {
                    continue;
                };
                let Some(pkt) = restamp(&orig.ip_packet, bytes.clone()) else {
                    continue;
                };
                if *to_b {
                    n.b.handle_ip_packet(n.now, &pkt);
                } else {
                    n.a.handle_ip_packet(n.now, &pkt);
                }
            }
            Inject::Replay(k) => {
                if n.wire.is_empty() {
                    continue;
                }
                let s = &n.wire[usize::from(*k) % n.wire.len()];
                let (to_b, pkt) = (s.from_a, s.ip_packet.clone());
                if to_b {
                    n.b.handle_ip_packet(n.now, &pkt);
                } else {
                    n.a.handle_ip_packet(n.now, &pkt);
                }
            }
        }
    }
    n.run(Duration::from_secs(30), &mut |_| false, &|_| false);

    assert_eq!(
        n.a.mr_read(guard_a.lkey, 0, 4096).unwrap(),
        vec![0xAA; 4096]
    );
    assert_eq!(
        n.b.mr_read(guard_b.lkey, 0, 4096).unwrap(),
        vec![0xBB; 4096]
    );
    let done = n.completions_a();
    let ids: Vec<u64> = done.iter().map(|c| c.wr_id).collect();
    let want: Vec<u64> = posted.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids, want, "send completions: {done:?}");
    for (c, (_, op)) in done.iter().zip(&posted) {
        assert_eq!(c.opcode, op.completion_opcode(), "{c:?}");
    }
    let mut recvs: HashMap<u64, usize> = HashMap::new();
    for c in n.completions_b() {
        *recvs.entry(c.wr_id).or_default() += 1;
    }
    assert!(
        recvs.values().all(|&k| k == 1),
        "a receive completed twice: {recvs:?}"
    );
}
