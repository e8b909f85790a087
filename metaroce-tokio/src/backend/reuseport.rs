//! Kernel steering of a sharded endpoint's datagrams: a classic-BPF reuseport program
//! (`SO_ATTACH_REUSEPORT_CBPF`, Linux ≥ 4.5) on the group of `SO_REUSEPORT` sockets that
//! share the listening port, choosing the socket — the shard — from the BTH.
//!
//! For a UDP socket the kernel runs the program with the packet's data starting at the
//! UDP payload (`reuseport_select_sock` pulls the UDP header), and the value it returns
//! indexes the group's sockets in bind order; a value past the last socket (or a load past
//! the end of a short datagram, which makes the program return 0) falls back to shard 0 or
//! the kernel's hash, both harmless: the shard's core counts and drops what is not its own.
//!
//! A GSO buffer from a local sender (delivered whole to a `UDP_GRO` socket) or a NIC's GRO
//! buffer (datagrams of one 5-tuple: one peer path port, whichever connections it carries)
//! is steered whole, by its first datagram. The driver therefore checks each datagram of a
//! buffer with [`steer`] and hands another shard's to that shard (`Shared::hand_over`):
//! before it did, they were dropped as `unknown_connection` by the shard that got them.
//!
//! The program (offsets in docs/PROTOCOL.md, "Base Transport Header" and "ConnectEth"):
//!
//! ```text
//! A = payload[0]                      BTH.OpCode
//! if A < 0xC0: return 0               RoCEv2 RC / CNP / UD: shard 0 (hosts the RC QPs)
//! A = be32(payload[4..8]) & 0xFFFFFF  BTH.DestQP
//! if A == 0:                          a CONNECT Request:
//!     A = be32(payload[16..20]) & 0xFFFFFF   ConnectEth sender QPN (the client's)
//! return A % shards
//! ```
//!
//! Every later packet of a handshake carries the client's QPN (Retry, Accept, Reject as
//! DestQP) or the server's QPN chosen in the same residue class (Confirm, data), so the
//! retry cookie is checked by the shard that issued it.

#![allow(unsafe_code)]

use std::io;
use std::os::fd::AsRawFd;

/// `struct sock_filter` (linux/filter.h).
#[repr(C)]
#[derive(Clone, Copy)]
struct SockFilter {
    code: u16,
    jt: u8,
    jf: u8,
    k: u32,
}

/// `struct sock_fprog` (linux/filter.h).
#[repr(C)]
struct SockFprog {
    len: u16,
    filter: *const SockFilter,
}

const SO_ATTACH_REUSEPORT_CBPF: libc::c_int = 51;

// Classic BPF opcodes (linux/bpf_common.h).
const BPF_LD: u16 = 0x00;
const BPF_ALU: u16 = 0x04;
const BPF_JMP: u16 = 0x05;
const BPF_RET: u16 = 0x06;
const BPF_W: u16 = 0x00;
const BPF_B: u16 = 0x10;
const BPF_ABS: u16 = 0x20;
const BPF_AND: u16 = 0x50;
const BPF_MOD: u16 = 0x90;
const BPF_JEQ: u16 = 0x10;
const BPF_JGE: u16 = 0x30;
const BPF_K: u16 = 0x00;
const BPF_A: u16 = 0x10;

const fn stmt(code: u16, k: u32) -> SockFilter {
    SockFilter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

const fn jump(code: u16, k: u32, jt: u8, jf: u8) -> SockFilter {
    SockFilter { code, jt, jf, k }
}

/// The steering program for `shards` sockets (see the module docs).
fn program(shards: u32) -> [SockFilter; 10] {
    [
        stmt(BPF_LD | BPF_B | BPF_ABS, 0),
        jump(BPF_JMP | BPF_JGE | BPF_K, 0xC0, 1, 0),
        stmt(BPF_RET | BPF_K, 0),
        stmt(BPF_LD | BPF_W | BPF_ABS, 4),
        stmt(BPF_ALU | BPF_AND | BPF_K, 0x00FF_FFFF),
        jump(BPF_JMP | BPF_JEQ | BPF_K, 0, 0, 2),
        stmt(BPF_LD | BPF_W | BPF_ABS, 16),
        stmt(BPF_ALU | BPF_AND | BPF_K, 0x00FF_FFFF),
        stmt(BPF_ALU | BPF_MOD | BPF_K, shards),
        stmt(BPF_RET | BPF_A, 0),
    ]
}

/// The shard the program picks for `payload` (the same logic in Rust: the kernel runs
/// [`program`]). A GSO or GRO buffer is steered whole by its first datagram, so the
/// driver checks every datagram of a buffer with this and hands another shard's to it.
pub(crate) fn steer(payload: &[u8], shards: u32) -> u32 {
    let be24 = |at: usize| {
        payload
            .get(at..at + 4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) & 0x00FF_FFFF)
    };
    match payload.first() {
        Some(&op) if op >= 0xC0 => {}
        _ => return 0,
    }
    let Some(mut q) = be24(4) else { return 0 };
    if q == 0 {
        let Some(s) = be24(16) else { return 0 };
        q = s;
    }
    q % shards
}

/// Attach the steering program for `shards` sockets to the reuseport group of `socket`
/// (any member; the group shares it).
///
/// # Errors
/// The kernel refused (not Linux ≥ 4.5, a seccomp filter, a socket without
/// `SO_REUSEPORT`).
pub(crate) fn attach(socket: &impl AsRawFd, shards: u32) -> io::Result<()> {
    if shards == 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "zero shards"));
    }
    let prog = program(shards);
    let fprog = SockFprog {
        len: prog.len() as u16,
        filter: prog.as_ptr(),
    };
    // SAFETY: `fprog` points at `prog`, an array of `prog.len()` initialized
    // `sock_filter`s laid out as the kernel's (`repr(C)`), both alive for the whole call;
    // the kernel copies the program before returning and keeps no pointer. The option
    // length is the size of `sock_fprog`. The fd is a live socket borrowed from `socket`.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_ATTACH_REUSEPORT_CBPF,
            (&fprog as *const SockFprog).cast(),
            std::mem::size_of::<SockFprog>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bth(op: u8, dest_qp: u32) -> Vec<u8> {
        let mut p = vec![0u8; 76];
        p[0] = op;
        p[2] = 0xFF;
        p[3] = 0xFF;
        p[5..8].copy_from_slice(&dest_qp.to_be_bytes()[1..]);
        p
    }

    #[test]
    fn steering_follows_the_qpn() {
        assert_eq!(steer(&bth(0xC0, 0x12_3457), 2), 1);
        assert_eq!(steer(&bth(0xC4, 0x12_3456), 2), 0);
        assert_eq!(steer(&bth(0xC4, 0x00_0007), 4), 3);
        // CONNECT Request: DestQP 0, the client's QPN at ConnectEth offset 4.
        let mut req = bth(0xC0, 0);
        req[12 + 4..12 + 8].copy_from_slice(&0x00AB_CDEFu32.to_be_bytes());
        assert_eq!(steer(&req, 3), 0xAB_CDEF % 3);
        // RoCEv2 RC opcodes and CNPs: shard 0; runts: shard 0.
        assert_eq!(steer(&bth(0x04, 0x11), 2), 0);
        assert_eq!(steer(&bth(0x81, 0x11), 2), 0);
        assert_eq!(steer(&[0xC0, 0, 0], 2), 0);
    }

    #[test]
    fn program_shape() {
        // Jumps stay inside the program and the last instruction returns A.
        let p = program(2);
        for (i, ins) in p.iter().enumerate() {
            if ins.code & 0x07 == BPF_JMP {
                assert!(i + 1 + (ins.jt.max(ins.jf) as usize) < p.len());
            }
        }
        assert_eq!(p[p.len() - 1].code, BPF_RET | BPF_A);
    }
}
