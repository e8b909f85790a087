//! The responder against a hostile or unlucky peer: memory stays bounded whatever op ids,
//! stream ids and message lengths the peer's packets carry, and a request that was already
//! executed is answered as executed before any other check (region gone, responder busy).
//!
//! Two endpoints, a virtual clock and a lossless in-memory network with a drop predicate;
//! hostile packets are built with the public wire API and fed to `Endpoint::handle_datagram`.

use bytes::Bytes;
use metaroce::testing::Net;
use metaroce::wire::{
    self, icrc, AtomicEth, Bth, Headers, Opcode, Packet, PathEth, Reth, SendEth, Trailer, WriteEth,
};
use metaroce::{
    Access, AtomicOp, AtomicRequest, ConnectionHandle, ConnectionStats, EndpointConfig, Event,
    ReadRequest, WcOpcode, WcStatus, WorkCompletion, WriteRequest,
};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

fn ip_of(i: usize) -> IpAddr {
    format!("10.0.0.{}", i + 1).parse().unwrap()
}

fn config(i: usize) -> EndpointConfig {
    let mut c = EndpointConfig::new(
        SocketAddr::new(ip_of(i), 4791),
        (0..4).map(|k| 0xC000 + k + 16 * i as u16).collect(),
    );
    c.seed = 7 + i as u64;
    c.initial_psn = Some(0);
    c.transport.pmtu = 1024;
    c.transport.paths = 2;
    c
}

/// Two endpoints on the test network (`metaroce::testing::Net`) with no delay, recording
/// every datagram that leaves an endpoint (dropped or not).
type Two = Net;

fn two_of(a: EndpointConfig, b: EndpointConfig) -> Two {
    let mut n = Net::with_configs(0, a, b);
    n.delay = Duration::ZERO;
    n.record = usize::MAX;
    n
}

/// Exchange packets until quiet, firing timers up to `dur` of virtual time; `drop`
/// decides (by sender and packet) which datagrams are lost.
fn run(two: &mut Two, dur: Duration, mut drop: impl FnMut(usize, &Packet<'_>) -> bool) {
    two.run_dropping(dur, |i, d| drop(i, &Packet::parse(d).unwrap()));
}

fn connect(two: &mut Two) -> (ConnectionHandle, ConnectionHandle) {
    let c = two.eps[0]
        .connect(two.now, SocketAddr::new(ip_of(1), 4791), None)
        .unwrap();
    run(two, Duration::from_millis(50), |_, _| false);
    let s = two.events[1]
        .iter()
        .find_map(|e| match e {
            Event::Incoming(h) => Some(*h),
            _ => None,
        })
        .expect("handshake");
    assert!(two.eps[0].is_established(c));
    for e in &mut two.events {
        e.clear();
    }
    two.wire.clear();
    (c, s)
}

fn completions(two: &Two, i: usize) -> Vec<WorkCompletion> {
    two.events[i]
        .iter()
        .filter_map(|e| match e {
            Event::Completion { wc, .. } => Some(*wc),
            _ => None,
        })
        .collect()
}

fn stats(two: &Two, i: usize, conn: ConnectionHandle) -> ConnectionStats {
    two.eps[i].connection_stats(conn).unwrap()
}

/// Every datagram that left endpoint `i` since the last `connect` or `wire.clear()`.
fn sent(two: &Two, i: usize) -> Vec<Vec<u8>> {
    two.wire
        .iter()
        .filter(|d| d.from_ep == i)
        .map(|d| d.data.clone())
        .collect()
}

/// NAKs endpoint `i` sent: (syndrome, op id).
fn naks_sent(two: &Two, i: usize) -> Vec<(u8, u32)> {
    sent(two, i)
        .iter()
        .filter_map(|d| match Packet::parse(d).unwrap().headers {
            Headers::Nak { nak, .. } => Some((nak.syndrome, nak.op_id)),
            _ => None,
        })
        .collect()
}

/// Builds packets as endpoint 0's connection would, but with any header values: each takes
/// the next PSN of path 0 and moves the path's floor PSN up to itself, so the receiver's
/// 256-packet window never stops it (a peer may do exactly that).
///
/// The first PSN is inside the receiver's window (its own PSN is checked before its floor
/// is applied, docs/PROTOCOL.md "Delivery"), ahead of every PSN the honest requester uses
/// on path 0 before the forger starts.
/// One before the forger's first PSN: within 256 of the path's initial PSN (0).
const FORGER_FIRST_PSN: u32 = 200;

struct Forger {
    dest_qp: u32,
    /// The token endpoint 0's connection sends with (the trailer every packet carries).
    token: u64,
    psn: u32,
    src_port: u16,
}

impl Forger {
    fn send(&mut self, two: &mut Two, opcode: Opcode, headers: Headers, payload: &[u8]) {
        self.psn = wire::psn_add(self.psn, 1);
        let path = PathEth {
            path_id: 0,
            flags: 0,
            timestamp: 0,
            floor_psn: self.psn,
            plane: 0,
        };
        let headers = match headers {
            Headers::Send { send, .. } => Headers::Send { path, send },
            Headers::Write {
                reth, write, imm, ..
            } => Headers::Write {
                path,
                reth,
                write,
                imm,
            },
            Headers::ReadRequest { reth, op, .. } => Headers::ReadRequest { path, reth, op },
            Headers::Atomic { atomic, op, .. } => Headers::Atomic { path, atomic, op },
            h => h,
        };
        let bth = Bth::new(opcode, self.dest_qp, self.psn);
        let trailer = Trailer::Token(self.token);
        let mut buf = vec![0u8; wire::packet_len_with(&headers, payload.len(), &trailer)];
        wire::emit_packet_with(&bth, &headers, payload, &trailer, &mut buf).unwrap();
        let ip = icrc::IpHeader::synthesized(ip_of(0), ip_of(1)).unwrap();
        icrc::stamp(&ip, self.src_port, 4791, &mut buf).unwrap();
        let from = SocketAddr::new(ip_of(0), self.src_port);
        two.eps[1].handle_datagram(two.now, from, Some(ip_of(1)), None, &buf);
    }
}

fn read_req(op_id: u32, rkey: u32, va: u64, len: u32) -> Headers {
    Headers::ReadRequest {
        path: PathEth::default(),
        reth: Reth {
            va,
            rkey,
            dma_len: len,
        },
        op: WriteEth { op_id, offset: 0 },
    }
}

fn fetch_add(op_id: u32, rkey: u32, va: u64) -> Headers {
    Headers::Atomic {
        path: PathEth::default(),
        atomic: AtomicEth {
            va,
            rkey,
            swap_add: 1,
            compare: 0,
        },
        op: WriteEth { op_id, offset: 0 },
    }
}

/// A peer sends READ, atomic and WRITE requests with scattered op ids (executed ones and
/// refused ones), and first packets of large SENDs on thousands of streams. The responder's
/// op id records and receive buffers stay within their configured bounds, and the honest
/// requester on the same connection still gets its READs done afterwards.
#[test]
fn scattered_op_ids_and_streams_stay_bounded() {
    const TRACKED: u32 = 512;
    const BUDGET: u64 = 256 << 10;
    const MAX_MSG: u64 = 64 << 10;
    let mut b = config(1);
    b.transport.max_tracked_ops = TRACKED;
    b.transport.max_recv_buffer_bytes = BUDGET;
    b.transport.max_message_size = MAX_MSG;
    b.transport.max_streams = 4096;
    let mut two = two_of(config(0), b);
    let (ca, cb) = connect(&mut two);
    let target = two.eps[1].register_mr(
        vec![0; 4096],
        Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
    );
    let mut f = Forger {
        dest_qp: cb.0,
        token: two.eps[0].connection_tokens(ca).unwrap().0,
        psn: FORGER_FIRST_PSN,
        src_port: 0xC000,
    };
    let big = vec![0xAB; 1024];
    for k in 0..6000u32 {
        // Above the honest requester's first ids (0, 1, 2), which are never used here, so
        // the floor of finished ids never moves; inside the window of `TRACKED` ids ahead
        // of the floor (ids further ahead are dropped unexecuted, see below), so ids come
        // back with other opcodes and parameters (refused as mismatches).
        let id = 3 + k % (TRACKED - 3);
        match k % 6 {
            0 => f.send(
                &mut two,
                Opcode::MR_READ_REQUEST,
                read_req(id, target.rkey, target.addr, 64),
                &[],
            ),
            1 => f.send(
                &mut two,
                Opcode::MR_READ_REQUEST,
                read_req(id, 0xDEAD, 0, 64),
                &[],
            ),
            2 => f.send(
                &mut two,
                Opcode::MR_FETCH_ADD,
                fetch_add(id, target.rkey, target.addr),
                &[],
            ),
            3 => f.send(
                &mut two,
                Opcode::MR_FETCH_ADD,
                fetch_add(id, target.rkey, target.addr + 3),
                &[],
            ),
            4 => {
                let write = Headers::Write {
                    path: PathEth::default(),
                    reth: Reth {
                        va: target.addr,
                        rkey: target.rkey,
                        dma_len: 2048,
                    },
                    write: WriteEth {
                        op_id: id,
                        offset: 0,
                    },
                    imm: None,
                };
                f.send(&mut two, Opcode::MR_WRITE, write, &big);
            }
            _ => {
                // The first packet of a MAX_MSG-byte message, next in line on a new stream.
                let send = Headers::Send {
                    path: PathEth::default(),
                    send: SendEth {
                        stream_id: k,
                        msg_seq: 0,
                        offset: 0,
                        msg_len: MAX_MSG as u32,
                    },
                };
                f.send(&mut two, Opcode::MR_SEND, send, &big);
            }
        }
        if k % 64 == 0 {
            // Let the responses flow (the honest side acknowledges them), so the responder
            // is not merely busy.
            run(&mut two, Duration::from_micros(200), |_, _| false);
        }
        let s = stats(&two, 1, cb).recv;
        assert!(
            s.tracked_ops <= 3 * TRACKED as u64 + 1,
            "op id records grow without bound: {} after {k} packets",
            s.tracked_ops
        );
        assert!(
            s.buffered_bytes <= BUDGET + BUDGET.max(MAX_MSG),
            "receive buffers grow without bound: {} bytes after {k} packets",
            s.buffered_bytes
        );
        assert!(s.streams <= 4096);
        assert!(
            s.write_track_bytes <= TRACKED as u64 * 512 + (64 << 20) / 1024 / 8,
            "WRITE bitmaps grow without bound: {} bytes after {k} packets",
            s.write_track_bytes
        );
        assert!(
            s.buffered_messages * 128 <= BUDGET + BUDGET.max(MAX_MSG + 128),
            "parked messages grow without bound: {} after {k} packets",
            s.buffered_messages
        );
    }
    let s = stats(&two, 1, cb).recv;
    // The bounds were reached: the test exercised them.
    assert!(s.tracked_ops >= TRACKED as u64, "{s:?}");
    assert!(s.buffered_bytes >= BUDGET, "{s:?}");
    assert!(s.reads > 0 && s.atomics > 0, "{s:?}");
    assert!(s.op_mismatches > 0, "{s:?}");
    // An op id far ahead of the floor is never executed: dropped unacknowledged.
    let far = s.op_id_out_of_window;
    for id in [TRACKED, 1 << 23, u32::MAX / 2] {
        f.send(
            &mut two,
            Opcode::MR_READ_REQUEST,
            read_req(id, target.rkey, target.addr, 64),
            &[],
        );
    }
    let s = stats(&two, 1, cb).recv;
    assert_eq!(s.op_id_out_of_window, far + 3, "{s:?}");
    // The op id at the floor is always admitted, so the peer's own first operations
    // (ids 0, 1, 2: each becomes the floor in turn) still execute. (The window of
    // `TRACKED` ids ahead of the floor now bounds the tracking set by itself: with every
    // other id of the window taken, no new one is left to refuse with an RNR NAK.)
    run(&mut two, Duration::from_micros(200), |_, _| false);
    two.wire.clear();
    let before = stats(&two, 1, cb).recv;
    for id in [0, 1, 2] {
        f.send(
            &mut two,
            Opcode::MR_READ_REQUEST,
            read_req(id, target.rkey, target.addr, 64),
            &[],
        );
        run(&mut two, Duration::from_micros(200), |_, _| false);
    }
    let after = stats(&two, 1, cb).recv;
    assert_eq!(after.reads, before.reads + 3);
    let naks = naks_sent(&two, 1);
    assert!(naks.is_empty(), "{naks:?}");
    assert!(two.eps[0].is_established(ca));
}

/// Refused op ids in sequence: the floor of finished ids moves with them, and the records
/// of refusals (kept so a re-sent request gets the same NAK) are forgotten oldest first
/// beyond `max_tracked_ops`.
#[test]
fn refusal_records_are_bounded() {
    const TRACKED: u32 = 256;
    let mut b = config(1);
    b.transport.max_tracked_ops = TRACKED;
    let mut two = two_of(config(0), b);
    let (ca, cb) = connect(&mut two);
    let mut f = Forger {
        dest_qp: cb.0,
        token: two.eps[0].connection_tokens(ca).unwrap().0,
        psn: FORGER_FIRST_PSN,
        src_port: 0xC000,
    };
    for id in 0..4 * TRACKED {
        f.send(
            &mut two,
            Opcode::MR_READ_REQUEST,
            read_req(id, 0xDEAD, 0, 8),
            &[],
        );
        let s = stats(&two, 1, cb).recv;
        assert!(
            s.tracked_ops <= TRACKED as u64,
            "{} records after {id}",
            s.tracked_ops
        );
    }
    run(&mut two, Duration::from_micros(200), |_, _| false);
    let naks = naks_sent(&two, 1);
    assert_eq!(naks.len(), 4 * TRACKED as usize);
    assert!(naks.iter().all(|&(syn, _)| syn == 0x62));
    // The most recent refusals are remembered: a re-sent request is refused again.
    two.wire.clear();
    f.send(
        &mut two,
        Opcode::MR_READ_REQUEST,
        read_req(4 * TRACKED - 1, 0xDEAD, 0, 8),
        &[],
    );
    run(&mut two, Duration::from_micros(200), |_, _| false);
    assert_eq!(naks_sent(&two, 1), vec![(0x62, 4 * TRACKED - 1)]);
}

/// First packets of 64 MiB WRITEs with scattered op ids: the segment bitmaps that track
/// WRITEs in progress stay within `max_tracked_ops` × 512 bytes.
#[test]
fn write_bitmaps_are_bounded() {
    const TRACKED: u32 = 64;
    let mut b = config(1);
    b.transport.max_tracked_ops = TRACKED;
    let mut two = two_of(config(0), b);
    let (ca, cb) = connect(&mut two);
    let huge = two.eps[1].register_mr(vec![0; 64 << 20], Access::REMOTE_WRITE);
    let mut f = Forger {
        dest_qp: cb.0,
        token: two.eps[0].connection_tokens(ca).unwrap().0,
        psn: FORGER_FIRST_PSN,
        src_port: 0xC000,
    };
    let one_write = (64 << 20) / 1024 / 8; // bitmap bytes of one 64 MiB WRITE at 1024 B/packet
    for k in 0..200u32 {
        let write = Headers::Write {
            path: PathEth::default(),
            reth: Reth {
                va: huge.addr,
                rkey: huge.rkey,
                dma_len: 64 << 20,
            },
            write: WriteEth {
                // Every other id, from 1 (the floor, 0, never moves): the first 32 are
                // inside the window of `TRACKED` ids ahead of the floor, the rest are
                // dropped unexecuted.
                op_id: 1 + 2 * k,
                offset: 0,
            },
            imm: None,
        };
        f.send(&mut two, Opcode::MR_WRITE, write, &[7; 1024]);
        let s = stats(&two, 1, cb).recv;
        assert!(
            s.write_track_bytes <= TRACKED as u64 * 512 + one_write,
            "WRITE bitmaps grow without bound: {} bytes after {k} packets",
            s.write_track_bytes
        );
    }
    let s = stats(&two, 1, cb).recv;
    assert!(
        s.write_track_bytes + one_write > TRACKED as u64 * 512,
        "{s:?}"
    );
    assert!(s.no_buffer_drops > 0, "{s:?}");
    assert!(s.op_id_out_of_window > 0, "{s:?}");
}

/// Empty messages parked ahead of the next one on their streams: each counts against the
/// receive budget, so they cannot pile up without bound.
#[test]
fn parked_empty_messages_are_bounded() {
    const BUDGET: u64 = 64 << 10;
    let mut b = config(1);
    b.transport.max_recv_buffer_bytes = BUDGET;
    let mut two = two_of(config(0), b);
    let (ca, cb) = connect(&mut two);
    let mut f = Forger {
        dest_qp: cb.0,
        token: two.eps[0].connection_tokens(ca).unwrap().0,
        psn: FORGER_FIRST_PSN,
        src_port: 0xC000,
    };
    for k in 0..4000u32 {
        let send = Headers::Send {
            path: PathEth::default(),
            send: SendEth {
                stream_id: k % 4,
                msg_seq: 1 + k / 4,
                offset: 0,
                msg_len: 0,
            },
        };
        f.send(&mut two, Opcode::MR_SEND, send, &[]);
        let s = stats(&two, 1, cb).recv;
        assert!(
            s.buffered_messages * 128 <= 2 * BUDGET,
            "parked messages grow without bound: {} after {k} packets",
            s.buffered_messages
        );
    }
    let s = stats(&two, 1, cb).recv;
    assert!(s.buffered_messages * 128 + 128 > BUDGET, "{s:?}");
    assert_eq!(s.messages, 0);
}

/// Invalid messages (longer than `max_message_size`) ahead of their streams' next ones:
/// the records that let in-order delivery skip them stay within `max_tracked_ops`, and a
/// refused message at the head of its stream is still skipped.
#[test]
fn refused_messages_are_bounded() {
    const TRACKED: u32 = 256;
    let mut b = config(1);
    b.transport.max_tracked_ops = TRACKED;
    b.transport.max_message_size = 4096;
    let mut two = two_of(config(0), b);
    let (ca, cb) = connect(&mut two);
    let mut f = Forger {
        dest_qp: cb.0,
        token: two.eps[0].connection_tokens(ca).unwrap().0,
        psn: FORGER_FIRST_PSN,
        src_port: 0xC000,
    };
    let send = |stream_id, msg_seq, msg_len| Headers::Send {
        path: PathEth::default(),
        send: SendEth {
            stream_id,
            msg_seq,
            offset: 0,
            msg_len,
        },
    };
    for k in 0..3000u32 {
        f.send(
            &mut two,
            Opcode::MR_SEND,
            send(k % 8, 1 + k / 8, 1 << 20),
            &[1; 1024],
        );
        let s = stats(&two, 1, cb).recv;
        assert!(
            s.refused_messages <= TRACKED as u64,
            "refused message records grow without bound: {} after {k} packets",
            s.refused_messages
        );
    }
    assert_eq!(stats(&two, 1, cb).recv.refused_messages, TRACKED as u64);
    // Stream 9: message 0 is refused at the head and skipped, message 1 is delivered.
    f.send(&mut two, Opcode::MR_SEND, send(9, 0, 1 << 20), &[1; 1024]);
    f.send(&mut two, Opcode::MR_SEND, send(9, 1, 3), &[5, 6, 7]);
    run(&mut two, Duration::from_micros(100), |_, _| false);
    let msgs: Vec<_> = two.events[1]
        .iter()
        .filter_map(|e| match e {
            Event::Message { stream, data, .. } => Some((*stream, data.to_vec())),
            _ => None,
        })
        .collect();
    assert_eq!(msgs, vec![(9, vec![5, 6, 7])]);
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Read,
    FetchAdd,
}

#[derive(Debug, Clone, Copy)]
enum Trouble {
    /// The responder's application deregisters the region once the request has executed.
    Deregistered,
    /// The responder has `max_rd_atomic` = 1 and its response to this very request is
    /// still unacknowledged when the request comes again.
    Busy,
}

/// A READ or atomic executes; the responder's ACK and response are lost, so the requester
/// re-sends the request (after its RTO); the responder must answer the re-sent request as
/// executed — not NAK it because the region has gone meanwhile (the requester would report
/// an error for an atomic that ran: exactly-once reporting breaks), nor RNR-NAK it because
/// the response it owes is what keeps it busy. The exception is a READ whose region went
/// away before its response could be read: it fails `RemoteAccessError`.
fn executed_request_resent(kind: Kind, trouble: Trouble) {
    let mut b = config(1);
    if let Trouble::Busy = trouble {
        b.transport.max_rd_atomic = 1;
    }
    let mut two = two_of(config(0), b);
    let (ca, _cb) = connect(&mut two);
    let mut init = vec![0u8; 64];
    init[..8].copy_from_slice(&41u64.to_le_bytes());
    init[8..]
        .iter_mut()
        .enumerate()
        .for_each(|(i, x)| *x = i as u8);
    let target = two.eps[1].register_mr(init.clone(), Access::REMOTE_READ | Access::REMOTE_ATOMIC);
    let local = two.eps[0].register_mr(vec![0; 64], Access::LOCAL_WRITE);
    match kind {
        Kind::Read => two.eps[0].post_read(
            ca,
            ReadRequest {
                wr_id: 1,
                lkey: local.lkey,
                local_offset: 0,
                len: 64,
                remote_addr: target.addr,
                rkey: target.rkey,
            },
        ),
        Kind::FetchAdd => two.eps[0].post_atomic(
            ca,
            AtomicRequest {
                wr_id: 1,
                lkey: local.lkey,
                local_offset: 0,
                remote_addr: target.addr,
                rkey: target.rkey,
                op: AtomicOp::FetchAdd { add: 1 },
            },
        ),
    }
    .unwrap();
    // Phase 1: everything the responder sends is lost; the request executes.
    run(&mut two, Duration::from_micros(100), |from, _| from == 1);
    let executed = two.eps[1]
        .connections()
        .map(|c| stats(&two, 1, c).recv)
        .map(|s| s.reads + s.atomics)
        .sum::<u64>();
    assert_eq!(executed, 1);
    if let Trouble::Deregistered = trouble {
        let mem = two.eps[1].deregister_mr(target.lkey).unwrap();
        if let Kind::FetchAdd = kind {
            assert_eq!(u64::from_le_bytes(mem[..8].try_into().unwrap()), 42);
        }
    }
    // Phase 2: responses stay lost until the responder has seen the re-sent request.
    let mut resent = false;
    run(&mut two, Duration::from_millis(200), |from, p| {
        let request = matches!(
            p.headers,
            Headers::ReadRequest { .. } | Headers::Atomic { .. }
        );
        let response = matches!(
            p.headers,
            Headers::ReadResponse { .. } | Headers::AtomicResponse { .. }
        );
        if from == 0 && request {
            resent = true;
        }
        from == 1 && response && !resent
    });
    assert!(resent, "the request was not re-sent");
    if let (Trouble::Deregistered, Kind::Read) = (trouble, kind) {
        // The response is read from the region as each packet is built (no copy at
        // execution): with the region gone it cannot be sent, so the READ is refused from
        // then on — the re-sent request gets NAK 0x62 and the READ fails, as an RNIC
        // re-reading memory for a duplicate READ would fail it. Never `Success`.
        let revoked = two.eps[1]
            .connections()
            .map(|c| stats(&two, 1, c).recv.read_responses_revoked)
            .sum::<u64>();
        assert_eq!(revoked, 1);
        let naks = naks_sent(&two, 1);
        assert!(
            !naks.is_empty() && naks.iter().all(|&(s, _)| s == 0x62),
            "{naks:?}"
        );
        let wcs = completions(&two, 0);
        assert_eq!(wcs.len(), 1, "{wcs:?}");
        assert_eq!(
            (wcs[0].opcode, wcs[0].status),
            (WcOpcode::RdmaRead, WcStatus::RemoteAccessError)
        );
        return;
    }
    assert_eq!(
        naks_sent(&two, 1),
        vec![],
        "an executed request was refused"
    );
    let (opcode, expect) = match kind {
        Kind::Read => (WcOpcode::RdmaRead, init.clone()),
        Kind::FetchAdd => {
            let mut v = vec![0; 64];
            v[..8].copy_from_slice(&41u64.to_le_bytes());
            (WcOpcode::FetchAdd, v)
        }
    };
    let wcs = completions(&two, 0);
    assert_eq!(wcs.len(), 1, "{wcs:?}");
    assert_eq!((wcs[0].opcode, wcs[0].status), (opcode, WcStatus::Success));
    assert_eq!(two.eps[0].mr_read(local.lkey, 0, 64).unwrap(), &expect[..]);
    if let (Trouble::Busy, Kind::FetchAdd) = (trouble, kind) {
        let mem = two.eps[1].mr_read(target.lkey, 0, 8).unwrap();
        assert_eq!(
            u64::from_le_bytes(mem.try_into().unwrap()),
            42,
            "executed once"
        );
    }
}

#[test]
fn resent_read_after_deregistration_fails_remote_access() {
    executed_request_resent(Kind::Read, Trouble::Deregistered);
}

#[test]
fn resent_atomic_after_deregistration_is_acknowledged() {
    executed_request_resent(Kind::FetchAdd, Trouble::Deregistered);
}

#[test]
fn resent_read_at_busy_responder_is_acknowledged() {
    executed_request_resent(Kind::Read, Trouble::Busy);
}

#[test]
fn resent_atomic_at_busy_responder_is_acknowledged() {
    executed_request_resent(Kind::FetchAdd, Trouble::Busy);
}

/// A refused request re-sent (its NAK lost) is refused again with the same syndrome, not
/// taken for an executed one: the responder records refusals, since with the "already
/// executed" check first a re-sent refused READ would otherwise be acknowledged and its
/// requester would wait for a response that never comes.
#[test]
fn resent_refused_request_gets_the_same_nak() {
    let mut two = two_of(config(0), config(1));
    let (ca, _cb) = connect(&mut two);
    let target = two.eps[1].register_mr(vec![0; 64], Access::REMOTE_READ | Access::REMOTE_WRITE);
    let local = two.eps[0].register_mr(vec![0; 64], Access::LOCAL_WRITE);
    // Bad rkey, then a READ beyond the region; a WRITE beyond it too.
    for (wr_id, rkey, len) in [(1, 0xDEAD_u32, 8u32), (2, target.rkey, 64)] {
        let off = if wr_id == 2 { 8 } else { 0 };
        two.eps[0]
            .post_read(
                ca,
                ReadRequest {
                    wr_id,
                    lkey: local.lkey,
                    local_offset: 0,
                    len,
                    remote_addr: target.addr + off,
                    rkey,
                },
            )
            .unwrap();
    }
    two.eps[0]
        .post_write(
            ca,
            WriteRequest {
                wr_id: 3,
                lkey: local.lkey,
                local_offset: 0,
                len: 64,
                remote_addr: target.addr + 1,
                rkey: target.rkey,
                imm: None,
            },
        )
        .unwrap();
    // The first NAK of each op is lost.
    let mut seen = std::collections::HashSet::new();
    run(&mut two, Duration::from_secs(1), |from, p| {
        match p.headers {
            Headers::Nak { nak, .. } if from == 1 => seen.insert(nak.op_id),
            _ => false,
        }
    });
    let naks = naks_sent(&two, 1);
    for id in 0..3 {
        assert!(
            naks.iter().filter(|n| n.1 == id).count() >= 2,
            "op {id} refused only once: {naks:?}"
        );
    }
    let wcs: Vec<_> = completions(&two, 0)
        .iter()
        .map(|w| (w.wr_id, w.status))
        .collect();
    assert_eq!(
        wcs,
        vec![
            (1, WcStatus::RemoteAccessError),
            (2, WcStatus::RemoteAccessError),
            (3, WcStatus::RemoteAccessError)
        ]
    );
}

/// BTH.AckReq as docs/PROTOCOL.md describes it: set on the packet that ends an operation's
/// data (last packet of a SEND, WRITE, READ response; every atomic response; a zero-length
/// READ request) and clear on every other packet, READ (length > 0) and atomic requests
/// included. Receivers ignore the bit.
#[test]
fn ack_req_marks_the_end_of_an_operations_data() {
    let mut two = two_of(config(0), config(1));
    let (ca, _cb) = connect(&mut two);
    let target = two.eps[1].register_mr(
        vec![0; 8192],
        Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
    );
    let local = two.eps[0].register_mr(vec![0; 8192], Access::LOCAL_WRITE);
    two.eps[0]
        .post_send(ca, 5, 1, Bytes::from(vec![1; 2500]))
        .unwrap();
    let write = |wr_id, len| WriteRequest {
        wr_id,
        lkey: local.lkey,
        local_offset: 0,
        len,
        remote_addr: target.addr,
        rkey: target.rkey,
        imm: None,
    };
    two.eps[0].post_write(ca, write(2, 3000)).unwrap();
    for (wr_id, len) in [(3, 2100), (4, 0)] {
        let r = ReadRequest {
            wr_id,
            lkey: local.lkey,
            local_offset: 0,
            len,
            remote_addr: target.addr,
            rkey: target.rkey,
        };
        two.eps[0].post_read(ca, r).unwrap();
    }
    let at = AtomicRequest {
        wr_id: 5,
        lkey: local.lkey,
        local_offset: 0,
        remote_addr: target.addr,
        rkey: target.rkey,
        op: AtomicOp::CompareSwap {
            compare: 0,
            swap: 9,
        },
    };
    two.eps[0].post_atomic(ca, at).unwrap();
    run(&mut two, Duration::from_secs(1), |_, _| false);
    assert_eq!(completions(&two, 0).len(), 5);
    let mut checked = 0;
    for i in 0..2 {
        for d in &sent(&two, i) {
            let p = Packet::parse(d).unwrap();
            let end = p.payload.len() as u64;
            let want = match p.headers {
                Headers::Send { send, .. } => send.offset as u64 + end >= send.msg_len as u64,
                Headers::Write { reth, write, .. } => {
                    write.offset as u64 + end >= reth.dma_len as u64
                }
                Headers::ReadResponse { op, .. } => op.offset as u64 + end >= 2100 || end == 0,
                Headers::ReadRequest { reth, .. } => reth.dma_len == 0,
                Headers::Atomic { .. } => false,
                Headers::AtomicResponse { .. } => true,
                _ => {
                    assert!(!p.bth.ack_req, "{:?} {:?}", p.bth, p.headers);
                    continue;
                }
            };
            assert_eq!(p.bth.ack_req, want, "{:?} {:?}", p.bth, p.headers);
            checked += 1;
        }
    }
    // 3 + 3 SEND/WRITE packets, 2 READ requests, 3 + 1 READ response packets, 2 atomic.
    assert!(checked >= 14, "{checked}");
}

/// The requester deregisters the source region of a WRITE while the WRITE is being sent: it
/// completes with LocalProtectionError and sends none of its remaining packets (and a READ
/// whose sink region is deregistered completes with LocalProtectionError). The op abort
/// it sends instead lets the responder count the op id as finished, so the responder's floor
/// of finished op ids moves on: more than `max_tracked_ops` WRITEs and READs after it all
/// complete with Success. Before, the responder waited for the rest of the failed WRITE
/// forever and, once `max_tracked_ops` later operations had finished, dropped every new
/// WRITE and RNR-NAKed every new READ.
#[test]
fn locally_failed_write_leaves_no_gap_in_op_ids() {
    const TRACKED: u32 = 4;
    let mut b = config(1);
    b.transport.max_tracked_ops = TRACKED;
    let mut two = two_of(config(0), b);
    let (ca, cb) = connect(&mut two);
    let dst = two.eps[1].register_mr(
        vec![0; 256 << 10],
        Access::REMOTE_WRITE | Access::REMOTE_READ,
    );
    let src = two.eps[0].register_mr(vec![5; 64 << 10], Access::LOCAL_WRITE);
    let other = two.eps[0].register_mr(vec![9; 64 << 10], Access::LOCAL_WRITE);
    two.eps[0]
        .post_write(
            ca,
            WriteRequest {
                wr_id: 1,
                lkey: src.lkey,
                local_offset: 0,
                len: 64 << 10,
                remote_addr: dst.addr,
                rkey: dst.rkey,
                imm: Some(77),
            },
        )
        .unwrap();
    // Send the first batch of the WRITE's packets, then take its source region away.
    let mut buf = Vec::new();
    let t = two.eps[0]
        .poll_transmit(two.now, &mut buf)
        .expect("a first batch");
    let seg = t.segment_size.unwrap_or(t.size);
    for d in buf[..t.size].chunks(seg) {
        assert!(matches!(
            Packet::parse(d).unwrap().headers,
            Headers::Write { .. }
        ));
        let from = SocketAddr::new(ip_of(0), t.src_port);
        two.eps[1].handle_datagram(two.now, from, Some(ip_of(1)), t.ecn, d);
    }
    two.eps[0].deregister_mr(src.lkey).unwrap();
    let placed = stats(&two, 1, cb).recv.write_bytes;
    assert!(placed > 0 && placed < 64 << 10, "{placed} bytes placed");
    // A READ whose sink region goes away before its response lands fails locally too; its
    // request executed at the responder, so its op id is finished there already.
    let sink = two.eps[0].register_mr(vec![0; 8192], Access::LOCAL_WRITE);
    let req = ReadRequest {
        wr_id: 2,
        lkey: sink.lkey,
        local_offset: 0,
        len: 8192,
        remote_addr: dst.addr,
        rkey: dst.rkey,
    };
    two.eps[0].post_read(ca, req).unwrap();
    two.eps[0].deregister_mr(sink.lkey).unwrap();
    // Then many more operations than the responder tracks.
    let n = 6 * TRACKED as u64;
    for k in 0..n {
        let off = (k % 16) * 4096;
        if k % 2 == 0 {
            let req = WriteRequest {
                wr_id: 10 + k,
                lkey: other.lkey,
                local_offset: off,
                len: 3000,
                remote_addr: dst.addr + 128 * 1024 + off,
                rkey: dst.rkey,
                imm: None,
            };
            two.eps[0].post_write(ca, req).unwrap();
        } else {
            let req = ReadRequest {
                wr_id: 10 + k,
                lkey: other.lkey,
                local_offset: off,
                len: 2000,
                remote_addr: dst.addr + off,
                rkey: dst.rkey,
            };
            two.eps[0].post_read(ca, req).unwrap();
        }
    }
    run(&mut two, Duration::from_secs(2), |_, _| false);
    let wcs = completions(&two, 0);
    assert_eq!(wcs.len() as u64, n + 2, "completions {wcs:?}");
    let failed: Vec<_> = wcs[..2].iter().map(|wc| (wc.wr_id, wc.status)).collect();
    assert_eq!(
        failed,
        [
            (1, WcStatus::LocalProtectionError),
            (2, WcStatus::LocalProtectionError)
        ]
    );
    for wc in &wcs[2..] {
        assert_eq!(wc.status, WcStatus::Success, "{wcs:?}");
    }
    let s = stats(&two, 1, cb).recv;
    assert_eq!(s.aborted_ops, 1, "{s:?}");
    // The failed WRITE's immediate is never reported at the responder.
    assert!(
        !two.events[1]
            .iter()
            .any(|e| matches!(e, Event::WriteWithImm { .. })),
        "immediate of a failed WRITE reported"
    );
}

/// A READ response is read only from the region the READ's rkey named: the response checks,
/// for every packet, that the region under its lkey still answers to that rkey and grants
/// REMOTE_READ. Here the region is deregistered while its response waits, and another
/// region is registered under the same lkey with other keys (`register_mr_memory_with_keys`
/// takes any lkey not in use; it is meant for keys another endpoint chose, but nothing
/// stops a caller reusing one): the READ fails `RemoteAccessError` and not one byte of the
/// new region reaches the requester.
#[test]
fn read_response_never_reads_a_region_registered_under_a_reused_lkey() {
    let mut two = two_of(config(0), config(1));
    let (ca, _cb) = connect(&mut two);
    let target = two.eps[1].register_mr(vec![0x11; 4096], Access::REMOTE_READ);
    let local = two.eps[0].register_mr(vec![0; 4096], Access::LOCAL_WRITE);
    two.eps[0]
        .post_read(
            ca,
            ReadRequest {
                wr_id: 1,
                lkey: local.lkey,
                local_offset: 0,
                len: 4096,
                remote_addr: target.addr,
                rkey: target.rkey,
            },
        )
        .unwrap();
    // The request executes; every response packet is lost for now.
    let resp =
        |i: usize, p: &Packet<'_>| i == 1 && matches!(p.headers, Headers::ReadResponse { .. });
    run(&mut two, Duration::from_micros(100), resp);
    assert!(two.eps[1].deregister_mr(target.lkey).is_some());
    let mut keys = target;
    keys.rkey ^= 0x5A5A_0001;
    two.eps[1]
        .register_mr_memory_with_keys(Box::new(vec![0xEE_u8; 4096]), keys)
        .unwrap();
    run(&mut two, Duration::from_secs(2), |_, _| false);
    let wcs = completions(&two, 0);
    assert_eq!(wcs.len(), 1, "{wcs:?}");
    assert_eq!(
        (wcs[0].opcode, wcs[0].status),
        (WcOpcode::RdmaRead, WcStatus::RemoteAccessError)
    );
    let got = two.eps[0].mr_read(local.lkey, 0, 4096).unwrap();
    assert!(!got.contains(&0xEE), "bytes of the other region were read");
}
