//! MetaRoCE ideas on commodity NICs: one connection = K RC QPs with distinct RoCEv2 UDP
//! source ports, large WRITEs and READs sprayed over them in chunks, a failed QP replaced
//! without costing an operation.
//!
//! The scheduling (chunking, weighting by completion rate, re-issue, the completion fence on
//! the peer's teardown) is the device-independent [`metaroce::multipath::Scheduler`]; this
//! module drives it with [`RcQp`]s and a TCP control channel.
//!
//! # How a QP gets its UDP source port
//! RoCEv2 puts the IBA packet in UDP to port 4791; the *source* port is the ECMP entropy.
//! Linux derives it from the GRH flow label of the QP's address vector
//! (`include/rdma/ib_verbs.h`):
//!
//! * `rdma_get_udp_sport(fl, lqpn, rqpn)`: if `fl` is 0, `fl = rdma_calc_flow_label(lqpn,
//!   rqpn)` — the 64-bit product `lqpn * rqpn` folded (`fl ^= fl >> 20; fl ^= fl >> 40`) to
//!   20 bits, symmetric so both ends compute the same value; then
//!   `rdma_flow_label_to_udp_sport(fl)`;
//! * `rdma_flow_label_to_udp_sport(fl)`: `(fl & 0x3fff) ^ ((fl & 0xfc000) >> 14)`, ORed
//!   with `0xC000` (`IB_ROCE_UDP_ENCAP_VALID_PORT_MIN`): a port in 49152..=65535.
//!
//! `rdma_rxe` (`drivers/infiniband/sw/rxe/rxe_verbs.c`, `rxe_modify_qp`, since Linux 5.17)
//! sets `qp->src_port = rdma_get_udp_sport(attr->ah_attr.grh.flow_label, qp_num,
//! dest_qp_num)` whenever a modify carries `IB_QP_AV` with a GRH — for RoCEv2, the
//! INIT→RTR transition, which also carries `IB_QP_DEST_QPN` — and `rxe_net.c`
//! (`prepare4`/`prepare6`) writes `qp->src_port` into every packet of the QP. Before that
//! modify, `rxe_qp_init_req` had set `0xC000 + hash_32(qpn, 14)`. mlx5 and irdma use the same
//! `rdma_get_udp_sport` convention in their address-vector code. So with flow label 0 the K
//! QPs would get ports from their QPN products — distinct only by luck of the hash — while an
//! explicit flow label fixes the port: [`flow_label_for`] gives slot `s` of generation `g` the
//! 14-bit value `1 + (s + K·(g-1)) mod 16383` with the upper 6 flow-label bits zero, so
//! [`rocev2_udp_sport`] is `0xC000 | value`: K distinct ports by construction, and a
//! replacement QP takes a *new* port, so ECMP re-hashes it away from the path that failed.
//! Each end sets the flow label of its own QPs; each direction's packets carry their
//! sender's port. (Over RoCEv2/IPv6 the flow label is also put in the IPv6 header.)
//!
//! # Control channel
//! A TCP connection, kept for the life of the connection, carries the setup and the QP
//! replacements. All integers big-endian:
//!
//! * hello, client → server and back: `b"MRMP"`, version `2u8`, `K: u16`, channel window
//!   `u32`. The server takes the client's K, answers the smaller of the two windows, and
//!   both ends use that.
//! * setup, for each slot 0..K: the client's 52-byte `ibv_rc_pingpong` record
//!   ([`exchange::to_record`]), then the server's; both connect (INIT→RTR→RTS).
//! * `REPLACE` (client → server) `1u8, slot: u16, generation: u32, record[52]`: the client
//!   has moved its QP of the slot's previous generation to ERR and made a new one. The
//!   server moves its end to ERR too, makes and connects its new QP and answers
//!   * `REPLACED` (server → client) `2u8, slot, generation, record[52]`.
//! * `FAILED` (server → client) `3u8, slot, generation`: the server's QP of that generation
//!   failed; the client starts a replacement.
//! * `CREDIT` (both ways) `4u8, 0u16, channel: u32, next: u64`: the sender's reorderer has
//!   delivered every frame of `channel` below `next` (receiver credits,
//!   [`MultipathConfig::receiver_credits`]): the peer's window for that channel moves on the
//!   lower of its own completions and this.
//!
//! The client drives every replacement, so the two ends never race to replace one slot.
//! Generation `g` of a slot is the `g`-th QP both ends put there, so it names the same pair
//! on both sides. Each end tells its scheduler that the peer's end of the old pair is torn
//! down ([`Scheduler::peer_torn_down`]) when it learns so: the server on `REPLACE`, the client
//! on `REPLACED`. Until then operations that had a chunk on the failed QP do not complete
//! (a packet of it still in the network could otherwise land after the application reused
//! its buffer). If the control channel closes, every QP is moved to ERR and every operation
//! still outstanding completes with `WrFlushError`.
//!
//! # Streams over K QPs
//! [`MpConnection::send`] / [`MpConnection::recv`] carry ordered message streams (channels)
//! and [`MpConnection::write_with_imm`] an immediate ordered with them. Each is a SEND of a
//! *stream frame* on whichever QP the scheduler picks: kind `u8` (0 message, 1 immediate),
//! channel `u32`, sequence number `u64`, then the message bytes or the immediate `u32` (all
//! big-endian; [`FRAME_HEADER`] = 13 bytes). Every QP keeps `qp.recv_slots` receives posted;
//! a task per QP hands what arrives to the driver, whose
//! [`Reorderer`] delivers each channel in sequence order and
//! drops the duplicates that re-issue after a QP failure can create. The sequence number is
//! assigned when the driver takes the operation from the connection's command queue, and
//! the queue is entered in the order the submitting futures were first polled (a ticket
//! taken in the first poll; see [`MpConnection::send`]), so concurrent sends keep the order
//! in which they were started, not the order in which they found queue space. The sender
//! keeps at most `channel_window` frames of a channel beyond the receiver's last `CREDIT`, so
//! the reorder window is exactly `channel_window` however long one QP's receive path lags.
//! Malformed or out-of-window frames are counted ([`MpStats::bad_frames`]) and dropped. At most
//! `INBOX_LIMIT` (1024) delivered items wait for [`MpConnection::recv`]; beyond that the
//! receive tasks stop taking (and so reposting) receives and the peer's SENDs meet RNR NAKs.

use crate::RemoteRegion;
use crate::{exchange, Error, Mr, Pd, QpConfig, RcQp, Result, WcStatus};
use bytes::{BufMut, Bytes, BytesMut};
use metaroce::fasthash::{HashMap, HashSet};
use metaroce::multipath::{
    Accepted, ChunkKind, Event, MultipathConfig, MultipathError, OpId, OpKind, OpRequest, QpId,
    QpStats, Reorderer, Scheduler,
};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

/// Lowest RoCEv2 UDP source port (`IB_ROCE_UDP_ENCAP_VALID_PORT_MIN`).
pub const ROCEV2_SPORT_MIN: u16 = 0xC000;

/// `rdma_flow_label_to_udp_sport`: the UDP source port a flow label gives.
pub fn rdma_flow_label_to_udp_sport(fl: u32) -> u16 {
    let low = fl & 0x3fff;
    let high = fl & 0xfc000;
    ((low ^ (high >> 14)) as u16) | ROCEV2_SPORT_MIN
}

/// `rdma_calc_flow_label`: the flow label Linux derives from the two QPNs when the address
/// vector's is 0 (symmetric in the QPNs).
pub fn rdma_calc_flow_label(lqpn: u32, rqpn: u32) -> u32 {
    let mut fl = u64::from(lqpn) * u64::from(rqpn);
    fl ^= fl >> 20;
    fl ^= fl >> 40;
    (fl & 0xf_ffff) as u32
}

/// `rdma_get_udp_sport`: the RoCEv2 UDP source port of a QP with GRH flow label `fl`
/// (0: derived from the QPNs) — what `rdma_rxe` puts in its packets.
pub fn rocev2_udp_sport(fl: u32, lqpn: u32, rqpn: u32) -> u16 {
    let fl = if fl == 0 {
        rdma_calc_flow_label(lqpn, rqpn)
    } else {
        fl
    };
    rdma_flow_label_to_udp_sport(fl)
}

/// The flow label this module gives slot `slot` (0..K) in generation `generation` (from 1)
/// of a K-QP connection: never 0, distinct across the K slots and across the next
/// generations, and mapping to the UDP source port `0xC000 + label`.
pub fn flow_label_for(slot: u16, generation: u32, k: usize) -> u32 {
    let n = u64::from(slot) + (k as u64) * u64::from(generation.saturating_sub(1));
    1 + (n % 0x3fff) as u32
}

/// Configuration of an [`MpConnection`].
#[derive(Debug, Clone)]
pub struct MpConfig {
    /// K, chunk size, depths (see [`MultipathConfig`]); `multipath.qps` is K (default 4).
    pub multipath: MultipathConfig,
    /// Template for the K QPs; `flow_label` is overwritten per slot ([`flow_label_for`]).
    /// `max_rdma_wr` and `send_slots` must be at least `multipath.qp_depth`; `slot_size` −
    /// [`FRAME_HEADER`] is the largest message. Default: [`QpConfig::default`] with 32
    /// receive and 32 send slots of 16 KiB per QP (`recv_slots` 0: WRITE and READ only).
    pub qp: QpConfig,
    /// How long a failed QP's replacement may take (from the failure to the peer's
    /// `REPLACED`, or on the server from `FAILED` to `REPLACE`) before the connection is
    /// given up: operations that had a chunk on the failed QP cannot complete until the
    /// peer confirms its end is torn down. Default 10 s.
    pub replace_timeout: Duration,
}

impl Default for MpConfig {
    fn default() -> Self {
        MpConfig {
            multipath: MultipathConfig::default(),
            qp: QpConfig {
                recv_slots: 32,
                send_slots: 32,
                slot_size: 16 * 1024,
                ..QpConfig::default()
            },
            replace_timeout: Duration::from_secs(10),
        }
    }
}

/// Counters of an [`MpConnection`].
#[derive(Debug, Clone, Default)]
pub struct MpStats {
    /// Per slot: the scheduler's counters.
    pub slots: Vec<QpStats>,
    /// Per slot: the flow label of its current QP and the UDP source port it gives.
    pub ports: Vec<(u32, u16)>,
    /// QPs replaced so far.
    pub replacements: u64,
    /// Chunks re-issued after a QP failure.
    pub reissued_chunks: u64,
    /// Stream frames dropped as duplicates (re-issued after a QP failure).
    pub duplicate_frames: u64,
    /// Stream frames dropped as malformed or out of window.
    pub bad_frames: u64,
    /// `CREDIT`s sent (this end's reorderer) and taken (the peer's, for this end's
    /// streams); credits ignored as beyond what this end submitted or for an unknown
    /// channel (a peer bug or a forgery) are in `bad_credits`.
    pub credits_sent: u64,
    /// See `credits_sent`.
    pub credits_received: u64,
    /// See `credits_sent`.
    pub bad_credits: u64,
}

enum Cmd {
    Op {
        req: OpRequest,
        target: Target,
        done: oneshot::Sender<WcStatus>,
    },
}

/// What an operation's chunks address.
enum Target {
    Rdma {
        local: Mr,
        loff: u64,
        remote: RemoteRegion,
        roff: u64,
    },
    Send(Bytes),
}

/// A frame received on one of the QPs, for the driver's reorderer.
type Frame = Bytes;

/// Bytes of a stream frame's header: kind `u8` (0 message, 1 immediate), channel `u32`,
/// sequence number `u64` (big-endian).
pub const FRAME_HEADER: usize = 13;

/// What [`MpConnection::recv`] returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Incoming {
    /// A message sent with [`MpConnection::send`].
    Message(Bytes),
    /// The immediate of a [`MpConnection::write_with_imm`]: every byte of that WRITE is
    /// placed.
    Immediate(u32),
}

enum Ctrl {
    Replace {
        slot: u16,
        generation: u32,
        record: [u8; exchange::RECORD_LEN],
    },
    Replaced {
        slot: u16,
        generation: u32,
        record: [u8; exchange::RECORD_LEN],
    },
    Failed {
        slot: u16,
        generation: u32,
    },
    /// The peer's reorderer expects `next` next on `channel` (receiver credits).
    Credit {
        channel: u32,
        next: u64,
    },
}

/// The connection's bounded command queue to its driver task, entered in the order in which
/// the submitting futures were *first polled*.
///
/// A bare bounded `mpsc::Sender::send` does not give that order: a waiter granted space
/// pushes its value only when it is polled again, so a later future whose first poll finds
/// spare room can overtake it (and tokio's cooperative budget can make a first poll return
/// `Pending` before it even queues as a waiter). Here a ticket is taken synchronously, in the
/// first poll, and only the holder of the oldest live ticket may enter the channel; the ticket
/// is released once its value is queued, or when its future is dropped before that (which
/// cancels the submission and hands the turn on).
struct CmdQueue<T> {
    tx: mpsc::Sender<T>,
    turns: Arc<Mutex<Turns>>,
}

/// Ticket bookkeeping of a [`CmdQueue`]. Memory: one waker per live waiting future, one
/// entry per future dropped while waiting behind the head.
#[derive(Default)]
struct Turns {
    /// Next ticket to hand out.
    next: u64,
    /// Ticket whose holder may enter the channel now.
    serving: u64,
    /// Wakers of waiting tickets.
    wakers: HashMap<u64, std::task::Waker>,
    /// Tickets dropped before their turn: skipped when reached.
    abandoned: HashSet<u64>,
}

impl Turns {
    /// The turn passes from `serving` to the next live ticket, which is woken.
    fn advance(&mut self) {
        self.serving += 1;
        while self.abandoned.remove(&self.serving) {
            self.serving += 1;
        }
        if let Some(w) = self.wakers.remove(&self.serving) {
            w.wake();
        }
    }
}

/// A place in a [`CmdQueue`]'s order; releases it on drop.
struct Ticket<'a> {
    turns: &'a Mutex<Turns>,
    n: u64,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut t = self.turns.lock();
        t.wakers.remove(&self.n);
        if t.serving == self.n {
            t.advance();
        } else if self.n > t.serving {
            t.abandoned.insert(self.n);
        }
    }
}

impl<T> Clone for CmdQueue<T> {
    fn clone(&self) -> Self {
        CmdQueue {
            tx: self.tx.clone(),
            turns: self.turns.clone(),
        }
    }
}

impl<T> CmdQueue<T> {
    fn new(tx: mpsc::Sender<T>) -> Self {
        CmdQueue {
            tx,
            turns: Arc::default(),
        }
    }

    /// Queues `v` after every value whose `send` was first polled earlier; `Err(v)` if the
    /// driver is gone. Its place is taken in the first poll (synchronously, before any
    /// await). Cancel safety: dropped before it resolves, `v` is not queued and the place
    /// is given up; once it has resolved, `v` is queued.
    async fn send(&self, v: T) -> std::result::Result<(), T> {
        let ticket = {
            let mut t = self.turns.lock();
            let n = t.next;
            t.next += 1;
            Ticket {
                turns: &self.turns,
                n,
            }
        };
        std::future::poll_fn(|cx| {
            let mut t = self.turns.lock();
            if t.serving == ticket.n {
                std::task::Poll::Ready(())
            } else {
                t.wakers.insert(ticket.n, cx.waker().clone());
                std::task::Poll::Pending
            }
        })
        .await;
        let r = self.tx.send(v).await.map_err(|e| e.0);
        drop(ticket);
        r
    }
}

/// One connection over K RC QPs. Cheap to clone; the QPs are moved to ERR and destroyed
/// when the last clone is dropped and the operations outstanding have completed.
#[derive(Clone)]
pub struct MpConnection {
    cmd: CmdQueue<Cmd>,
    shared: Arc<Mutex<SharedView>>,
    arrived: Arc<tokio::sync::Notify>,
    slot_size: u32,
    pd: Pd,
}

impl std::fmt::Debug for MpConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpConnection")
            .field("stats", &self.shared.lock().stats)
            .finish()
    }
}

#[derive(Default)]
struct SharedView {
    qps: Vec<Option<RcQp>>,
    stats: MpStats,
    /// Delivered, in order, per channel, not yet taken by `recv`.
    inbox: HashMap<u32, VecDeque<Incoming>>,
    queued: usize,
    closed: bool,
}

impl MpConnection {
    /// Client side: K QPs to the server at the other end of `tcp` (which stays open as the
    /// control channel).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad configuration, [`Error::Exchange`] if the control
    /// channel fails or the peer speaks something else, or a QP error.
    pub async fn connect(pd: &Pd, cfg: MpConfig, tcp: TcpStream) -> Result<MpConnection> {
        Self::setup(pd, cfg, tcp, true).await
    }

    /// Server side of [`MpConnection::connect`] on an accepted `tcp`.
    ///
    /// # Errors
    /// As [`MpConnection::connect`].
    pub async fn accept(pd: &Pd, cfg: MpConfig, tcp: TcpStream) -> Result<MpConnection> {
        Self::setup(pd, cfg, tcp, false).await
    }

    async fn setup(
        pd: &Pd,
        mut cfg: MpConfig,
        mut tcp: TcpStream,
        client: bool,
    ) -> Result<MpConnection> {
        cfg.multipath
            .validate()
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        if cfg.qp.max_rdma_wr < cfg.multipath.qp_depth
            || cfg.qp.send_slots < cfg.multipath.qp_depth
            || (cfg.qp.slot_size as usize) < FRAME_HEADER + 4
        {
            return Err(Error::InvalidArgument(
                "qp.max_rdma_wr and qp.send_slots must be at least multipath.qp_depth, qp.slot_size at least 17"
                    .into(),
            ));
        }
        let io = |e| Error::Exchange(e);
        let mut hello = [0u8; HELLO_LEN];
        hello[..5].copy_from_slice(HELLO_MAGIC);
        if client {
            hello[5..7].copy_from_slice(&(cfg.multipath.qps as u16).to_be_bytes());
            hello[7..].copy_from_slice(&cfg.multipath.channel_window.to_be_bytes());
            tcp.write_all(&hello).await.map_err(io)?;
            let mut back = [0u8; HELLO_LEN];
            tcp.read_exact(&mut back).await.map_err(io)?;
            let w = hello_window(&back);
            if back[..7] != hello[..7] || w == 0 || w > cfg.multipath.channel_window {
                return Err(Error::Exchange(bad("peer refused the multipath hello")));
            }
            cfg.multipath.channel_window = w;
        } else {
            let mut got = [0u8; HELLO_LEN];
            tcp.read_exact(&mut got).await.map_err(io)?;
            let k = usize::from(u16::from_be_bytes([got[5], got[6]]));
            let w = hello_window(&got);
            if &got[..5] != HELLO_MAGIC || k == 0 || k > metaroce::multipath::MAX_QPS || w == 0 {
                return Err(Error::Exchange(bad("not a multipath hello")));
            }
            // Both ends use the smaller window: the sender's bound and the receiver's
            // reorder buffer are the same number, and a client cannot make the server
            // buffer more than its own configuration allows.
            let w = w.min(cfg.multipath.channel_window);
            cfg.multipath.qps = k;
            cfg.multipath.channel_window = w;
            got[7..].copy_from_slice(&w.to_be_bytes());
            tcp.write_all(&got).await.map_err(io)?;
        }
        // The window moves on the peer's credits (see `Driver::send_credits`).
        cfg.multipath.receiver_credits = true;
        let k = cfg.multipath.qps;
        let mut sched = Scheduler::new(cfg.multipath.clone())
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let mut qps = Vec::with_capacity(k);
        for slot in 0..k as u16 {
            let qp = new_qp(pd, &cfg, slot, 1, k)?;
            let mine = exchange::to_record(&qp.local());
            let mut theirs = [0u8; exchange::RECORD_LEN];
            if client {
                tcp.write_all(&mine).await.map_err(io)?;
                tcp.read_exact(&mut theirs).await.map_err(io)?;
            } else {
                tcp.read_exact(&mut theirs).await.map_err(io)?;
            }
            let remote = exchange::parse_record(&theirs).map_err(io)?;
            qp.connect(&remote)?;
            if !client {
                tcp.write_all(&mine).await.map_err(io)?;
            }
            let id = sched
                .add_qp_at(slot)
                .map_err(|e| Error::InvalidArgument(e.to_string()))?;
            debug_assert_eq!(id.generation, 1);
            qps.push(Some((id, qp)));
        }
        let (rd, wr) = tcp.into_split();
        // Bounded: the application waits (backpressure) instead of queueing without limit,
        // and a peer flooding the control channel is read no faster than it is handled.
        let (cmd_tx, cmd_rx) = mpsc::channel(64);
        let (ctrl_tx, ctrl_rx) = mpsc::channel(16);
        let (comp_tx, comp_rx) = mpsc::unbounded_channel();
        tokio::spawn(read_ctrl(rd, ctrl_tx));
        let shared = Arc::new(Mutex::new(SharedView::default()));
        let (frame_tx, frame_rx) = mpsc::channel(FRAME_QUEUE);
        let reorder =
            Reorderer::with_credits(cfg.multipath.channel_window, cfg.multipath.max_channels);
        let d = Driver {
            pd: pd.clone(),
            cfg,
            client,
            sched,
            qps,
            pending: HashMap::default(),
            deadlines: HashMap::default(),
            ops: HashMap::default(),
            ctrl: wr,
            comp_tx,
            shared: shared.clone(),
            replacements: 0,
            closed: false,
            frame_tx,
            reorder,
            arrived: Arc::new(tokio::sync::Notify::new()),
            bad_frames: 0,
            credits_sent: 0,
            credits_received: 0,
        };
        let initial: Vec<RcQp> = d.qps.iter().flatten().map(|(_, qp)| qp.clone()).collect();
        for qp in initial {
            d.spawn_recv(qp);
        }
        d.publish();
        let slot_size = d.cfg.qp.slot_size;
        let arrived = d.arrived.clone();
        tokio::spawn(d.run(cmd_rx, ctrl_rx, comp_rx, frame_rx));
        Ok(MpConnection {
            cmd: CmdQueue::new(cmd_tx),
            shared,
            arrived,
            slot_size,
            pd: pd.clone(),
        })
    }

    async fn op(
        &self,
        kind: OpKind,
        local: &Mr,
        loff: u64,
        len: u64,
        remote: &RemoteRegion,
        roff: u64,
    ) -> Result<()> {
        if !Arc::ptr_eq(&local.0.pd, &self.pd.0) {
            return Err(Error::InvalidArgument(
                "the MR belongs to another protection domain than the connection".into(),
            ));
        }
        crate::mr::local_range(local.len(), loff, len)?;
        crate::qp::remote_range(remote, roff, len)?;
        let target = Target::Rdma {
            local: local.clone(),
            loff,
            remote: *remote,
            roff,
        };
        self.submit(kind, len, target).await
    }

    async fn submit(&self, kind: OpKind, len: u64, target: Target) -> Result<()> {
        let (done, rx) = oneshot::channel();
        self.cmd
            .send(Cmd::Op {
                req: OpRequest {
                    kind,
                    len,
                    fence: false,
                },
                target,
                done,
            })
            .await
            .map_err(|_| Error::Closed)?;
        let status = rx.await.map_err(|_| Error::Closed)?;
        if status == WcStatus::Success {
            Ok(())
        } else {
            Err(Error::Completion {
                status,
                code: status.ibv_code(),
                vendor_err: 0,
            })
        }
    }

    /// RDMA WRITE of `local[loff..loff+len]` to `remote` at `roff`, sprayed over the K QPs in
    /// chunks; resolves when every chunk has completed (and no chunk of it can still be
    /// placed by a failed QP).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for ranges; [`Error::Completion`] with the first error a
    /// chunk met (never a path failure that a re-issue recovered from); [`Error::Closed`].
    ///
    /// # Cancel safety
    /// Ordered by first poll with the connection's other operations, as
    /// [`MpConnection::send`]. Dropped while it waits for its turn, the WRITE is not
    /// issued; dropped after the connection accepted it, the WRITE is not cancelled and
    /// `local` stays registered until it has completed.
    pub async fn write(
        &self,
        local: &Mr,
        loff: u64,
        len: u64,
        remote: &RemoteRegion,
        roff: u64,
    ) -> Result<()> {
        self.op(OpKind::Write, local, loff, len, remote, roff).await
    }

    /// RDMA READ of `remote[roff..roff+len]` into `local` at `loff`, in chunks over the K
    /// QPs. Errors and cancel safety as [`MpConnection::write`].
    pub async fn read(
        &self,
        local: &Mr,
        loff: u64,
        len: u64,
        remote: &RemoteRegion,
        roff: u64,
    ) -> Result<()> {
        self.op(OpKind::Read, local, loff, len, remote, roff).await
    }

    /// RDMA WRITE as [`MpConnection::write`], then the immediate `imm` on `channel`: the
    /// peer's [`MpConnection::recv`] on `channel` returns [`Incoming::Immediate`] once every
    /// byte of the WRITE is placed, exactly once, in order with the channel's messages.
    /// Over K QPs the immediate travels as a stream frame posted after all data chunks
    /// completed (a verbs WRITE_WITH_IMM cannot carry the sequence number that makes it
    /// exactly-once when re-issued on another QP).
    ///
    /// # Errors
    /// As [`MpConnection::write`]; `WrFlushError` if an earlier notification of `channel`
    /// failed (the channel is then in the error state).
    #[allow(clippy::too_many_arguments)]
    pub async fn write_with_imm(
        &self,
        local: &Mr,
        loff: u64,
        len: u64,
        remote: &RemoteRegion,
        roff: u64,
        channel: u32,
        imm: u32,
    ) -> Result<()> {
        self.op(
            OpKind::WriteWithImm { channel, imm },
            local,
            loff,
            len,
            remote,
            roff,
        )
        .await
    }

    /// Sends `data` as one message on stream `channel`. Messages of one channel are
    /// delivered in submission order, exactly once, whichever QPs carry them and whatever
    /// QP fails; resolves when the peer's device has received it and every earlier message
    /// of the channel.
    ///
    /// # Submission order
    /// A message's place is fixed when its future is **first polled** (the first poll takes a
    /// ticket synchronously, before anything can wait), across every operation of the
    /// connection and all its clones. Futures first polled in the order A, B are delivered
    /// A, B, even if B finds queue space before A (the connection queues at most 64
    /// submissions; later ones wait their turn, oldest first). For many concurrent sends
    /// the order is therefore the order in which the executor or combinator first polls
    /// them: sequential `.await`s, or poll each future once in the intended order before
    /// awaiting them together; `join!`/`join_all` make no documented promise about it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `data` is longer than `qp.slot_size` −
    /// [`FRAME_HEADER`] (returned in the first poll, without taking a place);
    /// [`Error::Completion`] (`WrFlushError` once the channel is in the error state);
    /// [`Error::Closed`].
    ///
    /// # Cancel safety
    /// Dropped while it still waits for its turn, the message is not sent and its place is
    /// given up (later messages move up). Dropped after the connection accepted it, the
    /// SEND is not cancelled and keeps its place.
    pub async fn send(&self, channel: u32, data: &[u8]) -> Result<()> {
        let max = self.slot_size as usize - FRAME_HEADER.min(self.slot_size as usize);
        if data.len() > max {
            return Err(Error::InvalidArgument(format!(
                "message of {} bytes exceeds {max} (slot_size - {FRAME_HEADER})",
                data.len()
            )));
        }
        let kind = OpKind::Send { channel };
        self.submit(
            kind,
            data.len() as u64,
            Target::Send(Bytes::copy_from_slice(data)),
        )
        .await
    }

    /// The next message or immediate on `channel`, in order.
    ///
    /// # Errors
    /// [`Error::Closed`] once the connection is closed and nothing is left on `channel`.
    ///
    /// # Cancel safety
    /// Cancel safe: an item is taken only when this returns it.
    pub async fn recv(&self, channel: u32) -> Result<Incoming> {
        loop {
            let notified = self.arrived.notified();
            {
                let mut v = self.shared.lock();
                if let Some(item) = v.inbox.get_mut(&channel).and_then(|q| q.pop_front()) {
                    v.queued -= 1;
                    drop(v);
                    // The driver may be waiting for room in the inbox.
                    self.arrived.notify_waiters();
                    return Ok(item);
                }
                if v.closed {
                    return Err(Error::Closed);
                }
            }
            notified.await;
        }
    }

    /// The QP now in `slot` (for diagnostics and fault injection: tests move one to ERR).
    pub fn qp(&self, slot: usize) -> Option<RcQp> {
        self.shared.lock().qps.get(slot).cloned().flatten()
    }

    /// Counters.
    pub fn stats(&self) -> MpStats {
        self.shared.lock().stats.clone()
    }
}

/// Frames between the QPs' receive tasks and the driver, at most.
const FRAME_QUEUE: usize = 64;

/// The hello's magic and version (2: K and the channel window).
const HELLO_MAGIC: &[u8; 5] = b"MRMP\x02";
/// Hello: magic and version (5), K `u16`, channel window `u32`.
const HELLO_LEN: usize = 11;

/// The channel window of a hello.
fn hello_window(h: &[u8; HELLO_LEN]) -> u32 {
    u32::from_be_bytes([h[7], h[8], h[9], h[10]])
}

/// A control message's header: kind, slot `u16`, generation `u32` (what [`read_ctrl`]
/// reads first); the caller appends the body.
fn ctrl_msg(kind: u8, slot: u16, generation: u32) -> Vec<u8> {
    let mut m = Vec::with_capacity(7 + exchange::RECORD_LEN);
    m.push(kind);
    m.extend_from_slice(&slot.to_be_bytes());
    m.extend_from_slice(&generation.to_be_bytes());
    m
}

fn bad(msg: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.to_string())
}

fn new_qp(pd: &Pd, cfg: &MpConfig, slot: u16, generation: u32, k: usize) -> Result<RcQp> {
    let mut qc = cfg.qp.clone();
    qc.flow_label = flow_label_for(slot, generation, k);
    RcQp::create(pd, qc)
}

async fn read_ctrl(mut rd: OwnedReadHalf, tx: mpsc::Sender<Ctrl>) {
    loop {
        let mut t = [0u8; 7];
        if rd.read_exact(&mut t).await.is_err() {
            return;
        }
        let slot = u16::from_be_bytes([t[1], t[2]]);
        let generation = u32::from_be_bytes([t[3], t[4], t[5], t[6]]);
        let msg = match t[0] {
            1 | 2 => {
                let mut record = [0u8; exchange::RECORD_LEN];
                if rd.read_exact(&mut record).await.is_err() {
                    return;
                }
                if t[0] == 1 {
                    Ctrl::Replace {
                        slot,
                        generation,
                        record,
                    }
                } else {
                    Ctrl::Replaced {
                        slot,
                        generation,
                        record,
                    }
                }
            }
            3 => Ctrl::Failed { slot, generation },
            4 => {
                let mut next = [0u8; 8];
                if rd.read_exact(&mut next).await.is_err() {
                    return;
                }
                // The generation field carries the channel.
                Ctrl::Credit {
                    channel: generation,
                    next: u64::from_be_bytes(next),
                }
            }
            _ => {
                tracing::warn!(kind = t[0], "unknown multipath control message; closing");
                return;
            }
        };
        if tx.send(msg).await.is_err() {
            return;
        }
    }
}

struct OpCtx {
    target: Target,
    done: oneshot::Sender<WcStatus>,
}

/// Ends the connection for its waiters however the driver stops: at the end of `run`, or
/// when its runtime shuts down and drops the task, also before its first poll (`run` takes
/// the driver by value, so the unpolled future owns it). Receives waited forever when this
/// was done only at the end of `run` (found by review, 2026-12-07; the same fault as
/// metaroce-tokio's driver guard).
impl Drop for Driver {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.arrived.notify_waiters();
    }
}

struct Driver {
    pd: Pd,
    cfg: MpConfig,
    client: bool,
    sched: Scheduler,
    /// Per slot: the QP the scheduler knows (up or failed, until replaced).
    qps: Vec<Option<(QpId, RcQp)>>,
    /// Client: replacement QPs waiting for the server's REPLACED, by slot.
    pending: HashMap<u16, (u32, RcQp)>,
    /// Slots whose failed pair the peer has not yet confirmed torn down, with the time by
    /// which it must (`replace_timeout`).
    deadlines: HashMap<u16, Instant>,
    ops: HashMap<OpId, OpCtx>,
    ctrl: OwnedWriteHalf,
    comp_tx: mpsc::UnboundedSender<(u64, WcStatus)>,
    shared: Arc<Mutex<SharedView>>,
    replacements: u64,
    closed: bool,
    frame_tx: mpsc::Sender<Frame>,
    reorder: Reorderer<Incoming>,
    arrived: Arc<tokio::sync::Notify>,
    bad_frames: u64,
    credits_sent: u64,
    credits_received: u64,
}

/// Items delivered and not yet taken by the application, over all channels, at most; the
/// QPs' receive tasks then stop taking receives (which stops reposting them, so the peer
/// meets RNR NAKs: backpressure).
const INBOX_LIMIT: usize = 1024;

impl Driver {
    /// Reads every receive of `qp` and hands the frames to the driver, until the QP fails.
    fn spawn_recv(&self, qp: RcQp) {
        if qp.config().recv_slots == 0 {
            return;
        }
        let tx = self.frame_tx.clone();
        tokio::spawn(async move {
            while let Ok(m) = qp.recv().await {
                if tx.send(m.data).await.is_err() {
                    return;
                }
            }
        });
    }

    fn on_frame(&mut self, f: Frame) {
        if f.len() < FRAME_HEADER {
            self.bad_frames += 1;
            return;
        }
        let kind = f[0];
        let channel = u32::from_be_bytes([f[1], f[2], f[3], f[4]]);
        let seq = u64::from_be_bytes(f[5..13].try_into().expect("8 bytes"));
        let item = match (kind, f.len()) {
            (0, _) => Incoming::Message(f.slice(FRAME_HEADER..)),
            (1, 17) => Incoming::Immediate(u32::from_be_bytes([f[13], f[14], f[15], f[16]])),
            _ => {
                self.bad_frames += 1;
                return;
            }
        };
        if self.reorder.accept(channel, seq, item) == Accepted::Refused {
            self.bad_frames += 1;
        }
        let mut delivered = false;
        {
            let mut v = self.shared.lock();
            while let Some((c, _, item)) = self.reorder.poll() {
                v.inbox.entry(c).or_default().push_back(item);
                v.queued += 1;
                delivered = true;
            }
        }
        if delivered {
            self.arrived.notify_waiters();
        }
    }

    async fn run(
        mut self,
        mut cmd_rx: mpsc::Receiver<Cmd>,
        mut ctrl_rx: mpsc::Receiver<Ctrl>,
        mut comp_rx: mpsc::UnboundedReceiver<(u64, WcStatus)>,
        mut frame_rx: mpsc::Receiver<Frame>,
    ) {
        let mut cmds_open = true;
        loop {
            self.pump().await;
            self.publish();
            if !cmds_open && self.ops.is_empty() {
                break;
            }
            let room = self.sched.outstanding_ops() < self.cfg.multipath.max_ops;
            let inbox_room = self.shared.lock().queued < INBOX_LIMIT;
            let taken = self.arrived.notified();
            let deadline = self.deadlines.values().min().copied();
            tokio::select! {
                _ = tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now).into()), if deadline.is_some() && !self.closed => {
                    tracing::warn!("a failed multipath QP was not replaced in time; closing the connection");
                    self.close();
                }
                c = cmd_rx.recv(), if cmds_open && room => match c {
                    Some(Cmd::Op { req, target, done }) => {
                        match self.sched.submit(req) {
                            Ok(id) => { self.ops.insert(id, OpCtx { target, done }); }
                            Err(MultipathError::TooManyOps) | Err(MultipathError::Closed) | Err(_) => {
                                let _ = done.send(WcStatus::WrFlushError);
                            }
                        }
                    }
                    None => cmds_open = false,
                },
                Some((wr, status)) = comp_rx.recv() => {
                    self.sched.on_completion(wr, status, Instant::now());
                }
                Some(f) = frame_rx.recv(), if inbox_room => {
                    self.on_frame(f);
                    self.send_credits().await;
                }
                _ = taken, if !inbox_room => {}
                m = ctrl_rx.recv(), if !self.closed => match m {
                    Some(m) => self.on_ctrl(m).await,
                    None => self.close(),
                },
            }
        }
        // Last handle gone and nothing outstanding: dropping the QPs moves them to ERR
        // (and `Drop` tells the waiters).
    }

    fn close(&mut self) {
        self.closed = true;
        self.deadlines.clear();
        for (_, qp) in self.qps.iter().flatten() {
            let _ = qp.set_error();
        }
        for (_, qp) in self.pending.values() {
            let _ = qp.set_error();
        }
        self.sched.fail_all(WcStatus::WrFlushError);
        self.shared.lock().closed = true;
        self.arrived.notify_waiters();
    }

    fn publish(&self) {
        let mut v = self.shared.lock();
        v.qps = self
            .qps
            .iter()
            .map(|q| q.as_ref().map(|(_, qp)| qp.clone()))
            .collect();
        let k = self.cfg.multipath.qps;
        v.stats.slots = (0..k).filter_map(|s| self.sched.qp_stats(s)).collect();
        v.stats.ports = self
            .qps
            .iter()
            .enumerate()
            .map(|(s, q)| {
                let g = q.as_ref().map_or(1, |(id, _)| id.generation);
                let fl = flow_label_for(s as u16, g, k);
                (fl, rdma_flow_label_to_udp_sport(fl))
            })
            .collect();
        v.stats.replacements = self.replacements;
        v.stats.reissued_chunks = self.sched.stats().reissued_chunks;
        v.stats.duplicate_frames = self.reorder.duplicates();
        v.stats.bad_frames = self.bad_frames;
        v.stats.credits_sent = self.credits_sent;
        v.stats.credits_received = self.credits_received;
        v.stats.bad_credits = self.sched.stats().bad_credits;
    }

    async fn pump(&mut self) {
        loop {
            let mut progress = false;
            while let Some(p) = self.sched.poll_post(Instant::now()) {
                progress = true;
                let qp = match self.qps.get(usize::from(p.qp.slot)) {
                    Some(Some((id, qp))) if *id == p.qp => qp.clone(),
                    _ => {
                        let _ = self.comp_tx.send((p.wr_id, WcStatus::WrFlushError));
                        continue;
                    }
                };
                let Some(ctx) = self.ops.get(&p.op) else {
                    continue;
                };
                let len = u64::from(p.len);
                let posted = match (&ctx.target, p.kind) {
                    (
                        Target::Rdma {
                            local,
                            loff,
                            remote,
                            roff,
                        },
                        ChunkKind::Write,
                    ) => qp.post_write(local, loff + p.offset, len, remote, roff + p.offset, None),
                    (
                        Target::Rdma {
                            local,
                            loff,
                            remote,
                            roff,
                        },
                        ChunkKind::Read,
                    ) => qp.post_read(local, loff + p.offset, len, remote, roff + p.offset),
                    (
                        Target::Rdma { .. },
                        ChunkKind::Notify {
                            channel,
                            seq,
                            imm: Some(imm),
                        },
                    ) => {
                        let mut f = BytesMut::with_capacity(FRAME_HEADER + 4);
                        f.put_u8(1);
                        f.put_u32(channel);
                        f.put_u64(seq);
                        f.put_u32(imm);
                        qp.post_send(&f, None)
                    }
                    (
                        Target::Send(data),
                        ChunkKind::Notify {
                            channel,
                            seq,
                            imm: None,
                        },
                    ) => {
                        let mut f = BytesMut::with_capacity(FRAME_HEADER + data.len());
                        f.put_u8(0);
                        f.put_u32(channel);
                        f.put_u64(seq);
                        f.put_slice(data);
                        qp.post_send(&f, None)
                    }
                    _ => Err(Error::InvalidArgument(
                        "chunk does not match its operation".into(),
                    )),
                };
                let tx = self.comp_tx.clone();
                let wr = p.wr_id;
                match posted {
                    Ok(fut) => {
                        tokio::spawn(async move {
                            let status = match fut.await {
                                Ok(wc) => wc.status,
                                Err(_) => WcStatus::WrFlushError,
                            };
                            let _ = tx.send((wr, status));
                        });
                    }
                    Err(e) => {
                        // A QP in ERR refuses posts: a path failure, like a flush.
                        tracing::debug!(error = %e, "post on a multipath QP failed");
                        let _ = tx.send((wr, WcStatus::WrFlushError));
                    }
                }
            }
            while let Some(ev) = self.sched.poll_event() {
                progress = true;
                match ev {
                    Event::Completed { op, status } => {
                        if let Some(ctx) = self.ops.remove(&op) {
                            let _ = ctx.done.send(status);
                        }
                    }
                    Event::ReplaceQp { failed, status } => {
                        tracing::info!(slot = failed.slot, generation = failed.generation, %status, "multipath QP failed");
                        self.on_failed(failed).await;
                    }
                }
            }
            if !progress {
                return;
            }
        }
    }

    fn current(&self, slot: u16) -> Option<QpId> {
        self.qps
            .get(usize::from(slot))
            .and_then(|q| q.as_ref())
            .map(|(id, _)| *id)
    }

    /// Sends the credits the reorderer has due (`CREDIT`, 15 bytes each: a quarter window
    /// of progress per channel, so a few bytes of TCP per `channel_window / 4` frames).
    async fn send_credits(&mut self) {
        while let Some((channel, next)) = self.reorder.poll_credit() {
            // The generation field carries the channel.
            let mut m = ctrl_msg(4, 0, channel);
            m.extend_from_slice(&next.to_be_bytes());
            self.credits_sent += 1;
            self.send_ctrl(&m).await;
        }
    }

    async fn send_ctrl(&mut self, buf: &[u8]) {
        if self.closed {
            return;
        }
        if self.ctrl.write_all(buf).await.is_err() {
            self.close();
        }
    }

    /// Our QP `failed` is down (the scheduler already re-queued its chunks).
    async fn on_failed(&mut self, failed: QpId) {
        if self.closed || self.current(failed.slot) != Some(failed) {
            return; // already replaced
        }
        if let Some(Some((_, qp))) = self.qps.get(usize::from(failed.slot)) {
            let _ = qp.set_error(); // our end of the pair: nothing more from it
        }
        self.deadlines
            .entry(failed.slot)
            .or_insert_with(|| Instant::now() + self.cfg.replace_timeout);
        if !self.client {
            let m = ctrl_msg(3, failed.slot, failed.generation);
            self.send_ctrl(&m).await;
            return;
        }
        if self.pending.contains_key(&failed.slot) {
            return;
        }
        let generation = failed.generation + 1;
        match new_qp(
            &self.pd,
            &self.cfg,
            failed.slot,
            generation,
            self.cfg.multipath.qps,
        ) {
            Ok(qp) => {
                let mut m = ctrl_msg(1, failed.slot, generation);
                m.extend_from_slice(&exchange::to_record(&qp.local()));
                self.pending.insert(failed.slot, (generation, qp));
                self.send_ctrl(&m).await;
            }
            Err(e) => {
                tracing::warn!(error = %e, slot = failed.slot, "cannot create a replacement QP; slot stays down")
            }
        }
    }

    async fn on_ctrl(&mut self, m: Ctrl) {
        match m {
            Ctrl::Failed { slot, generation } if self.client => {
                if let Some(id) = self.current(slot) {
                    if id.generation == generation {
                        // Our end may look healthy; the pair is not.
                        self.sched.fail_qp(id, WcStatus::WrFlushError);
                    }
                }
            }
            Ctrl::Replace {
                slot,
                generation,
                record,
            } if !self.client => {
                let Some(old) = self.current(slot) else {
                    return;
                };
                if old.generation + 1 != generation {
                    tracing::warn!(
                        slot,
                        generation,
                        "REPLACE for an unexpected generation; ignored"
                    );
                    return;
                }
                if let Some(Some((_, qp))) = self.qps.get(usize::from(slot)) {
                    let _ = qp.set_error();
                }
                self.sched.fail_qp(old, WcStatus::WrFlushError);
                // The client moved its end to ERR before sending REPLACE.
                self.sched.peer_torn_down(old);
                self.deadlines.remove(&slot);
                let Ok(remote) = exchange::parse_record(&record) else {
                    return;
                };
                let qp = match new_qp(
                    &self.pd,
                    &self.cfg,
                    slot,
                    generation,
                    self.cfg.multipath.qps,
                )
                .and_then(|qp| qp.connect(&remote).map(|()| qp))
                {
                    Ok(qp) => qp,
                    Err(e) => {
                        tracing::warn!(error = %e, slot, "cannot build the replacement QP");
                        return;
                    }
                };
                let mut out = ctrl_msg(2, slot, generation);
                out.extend_from_slice(&exchange::to_record(&qp.local()));
                if let Ok(id) = self.sched.add_qp_at(slot) {
                    self.spawn_recv(qp.clone());
                    self.qps[usize::from(slot)] = Some((id, qp));
                    self.replacements += 1;
                }
                self.send_ctrl(&out).await;
            }
            Ctrl::Replaced {
                slot,
                generation,
                record,
            } if self.client => {
                let Some((g, qp)) = self.pending.remove(&slot) else {
                    return;
                };
                if g != generation {
                    return;
                }
                let Some(old) = self.current(slot) else {
                    return;
                };
                // The server moved its end of the old pair to ERR before answering.
                self.sched.peer_torn_down(old);
                self.deadlines.remove(&slot);
                let ok = exchange::parse_record(&record)
                    .map_err(Error::Exchange)
                    .and_then(|remote| qp.connect(&remote));
                if let Err(e) = ok {
                    tracing::warn!(error = %e, slot, "cannot connect the replacement QP");
                    return;
                }
                if let Ok(id) = self.sched.add_qp_at(slot) {
                    self.spawn_recv(qp.clone());
                    self.qps[usize::from(slot)] = Some((id, qp));
                    self.replacements += 1;
                }
            }
            Ctrl::Credit { channel, next } => {
                self.credits_received += 1;
                self.sched.on_credit(channel, next);
            }
            _ => tracing::warn!("multipath control message in the wrong direction; ignored"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Collects what the queue's consumer has so far, without waiting.
    fn drain(rx: &mut mpsc::Receiver<u32>, n: usize) -> Vec<u32> {
        (0..n).map_while(|_| rx.try_recv().ok()).collect()
    }

    /// A submission's place is fixed when its future is first polled: a later future that
    /// finds queue space on its first poll does not overtake earlier ones that are still
    /// waiting, even if those were already granted space but not yet polled again. (Plain
    /// `mpsc::Sender::send` lets future 6 below overtake 4 and 5.)
    #[tokio::test]
    async fn first_poll_fixes_the_place_in_the_queue() {
        let (tx, mut rx) = mpsc::channel::<u32>(4);
        let q = CmdQueue::new(tx);
        let mut futs: Vec<_> = (0..8u32)
            .map(|i| {
                let q = q.clone();
                futures::future::maybe_done(Box::pin(async move { q.send(i).await }))
            })
            .collect();
        // 0..=3 fill the queue, 4 and 5 wait for space.
        for f in futs[..6].iter_mut() {
            let _ = futures::poll!(&mut *f);
        }
        // Three places free up: two for the waiters, one spare.
        assert_eq!(drain(&mut rx, 3), vec![0, 1, 2]);
        // 6 and 7 are first polled before 4 and 5 are polled again.
        for f in futs[6..].iter_mut() {
            let _ = futures::poll!(&mut *f);
        }
        let mut got = vec![0, 1, 2];
        {
            let mut all = futures::future::join_all(futs.iter_mut());
            loop {
                tokio::select! {
                    biased;
                    _ = &mut all => break,
                    Some(v) = rx.recv() => got.push(v),
                }
            }
        }
        for f in futs.iter_mut() {
            assert_eq!(std::pin::Pin::new(f).take_output(), Some(Ok(())));
        }
        got.extend(drain(&mut rx, 8));
        assert_eq!(got, (0..8).collect::<Vec<_>>());
    }

    /// Many concurrent submissions through a small queue whose consumer takes a few items
    /// between first polls, with every seventh submission dropped while it waits: the
    /// consumer sees exactly the submissions not dropped, in first-poll order.
    #[tokio::test]
    async fn concurrent_submissions_keep_first_poll_order() {
        let (tx, mut rx) = mpsc::channel::<u32>(4);
        let q = CmdQueue::new(tx);
        let n = 600u32;
        let mut futs: Vec<_> = (0..n)
            .map(|i| {
                let q = q.clone();
                Some(futures::future::maybe_done(Box::pin(async move {
                    q.send(i).await
                })))
            })
            .collect();
        let mut got = Vec::new();
        let mut want = Vec::new();
        for i in 0..n as usize {
            let f = futs[i].as_mut().unwrap();
            let ready = futures::poll!(&mut *f).is_ready();
            if i % 7 == 3 && !ready {
                futs[i] = None; // cancelled before it was queued
            } else {
                want.push(i as u32);
            }
            if i % 5 == 4 {
                got.extend(drain(&mut rx, 3));
                // Waiters granted room run (or not) before the next first poll.
                for f in futs[..i].iter_mut().rev().take(3).flatten() {
                    let _ = futures::poll!(&mut *f);
                }
            }
        }
        let mut rest: Vec<_> = futs.into_iter().flatten().collect();
        {
            let mut all = futures::future::join_all(rest.iter_mut());
            loop {
                tokio::select! {
                    biased;
                    _ = &mut all => break,
                    Some(v) = rx.recv() => got.push(v),
                }
            }
        }
        for f in rest.iter_mut() {
            assert_eq!(std::pin::Pin::new(f).take_output(), Some(Ok(())));
        }
        drop(q);
        while let Some(v) = rx.recv().await {
            got.push(v);
        }
        assert_eq!(got, want);
    }

    /// The port arithmetic matches the kernel's (`ib_verbs.h`), values worked by hand.
    #[test]
    fn udp_sport_from_flow_label_as_linux() {
        assert_eq!(rdma_flow_label_to_udp_sport(0), 0xC000);
        assert_eq!(rdma_flow_label_to_udp_sport(1), 0xC001);
        assert_eq!(rdma_flow_label_to_udp_sport(0x3fff), 0xffff);
        // The upper 6 bits fold onto the low ones: 0x4000 -> 1, 0x4001 -> 0.
        assert_eq!(rdma_flow_label_to_udp_sport(0x4000), 0xC001);
        assert_eq!(rdma_flow_label_to_udp_sport(0x4001), 0xC000);
        // QPN-derived label: 0x11 * 0x12 = 0x132, no high bits to fold.
        assert_eq!(rdma_calc_flow_label(0x11, 0x12), 0x132);
        assert_eq!(rdma_calc_flow_label(0x12, 0x11), 0x132);
        assert_eq!(rocev2_udp_sport(0, 0x11, 0x12), 0xC132);
        // 0xffffff^2 = 0xfffffe000001; folded: ^ (>>20) then ^ (>>40).
        let p = 0xff_ffffu64 * 0xff_ffff;
        let mut f = p;
        f ^= f >> 20;
        f ^= f >> 40;
        assert_eq!(
            rdma_calc_flow_label(0xff_ffff, 0xff_ffff),
            (f & 0xf_ffff) as u32
        );
        assert_eq!(rocev2_udp_sport(7, 1, 2), 0xC007, "explicit label wins");
    }

    /// K slots get K distinct source ports, and a replacement gets a port none of the
    /// current QPs use.
    #[test]
    fn flow_labels_give_distinct_ports() {
        for k in [1usize, 4, 8, 64] {
            let gen1: Vec<u16> = (0..k as u16)
                .map(|s| rdma_flow_label_to_udp_sport(flow_label_for(s, 1, k)))
                .collect();
            let set: HashSet<_> = gen1.iter().collect();
            assert_eq!(set.len(), k, "K = {k}: {gen1:?}");
            assert!(
                gen1.iter().all(|p| *p > ROCEV2_SPORT_MIN),
                "label 0 never used"
            );
            let repl = rdma_flow_label_to_udp_sport(flow_label_for(0, 2, k));
            assert!(!gen1.contains(&repl));
        }
        assert_eq!(flow_label_for(0, 1, 4), 1);
        assert_eq!(flow_label_for(3, 1, 4), 4);
        assert_eq!(flow_label_for(1, 2, 4), 6);
    }
}
