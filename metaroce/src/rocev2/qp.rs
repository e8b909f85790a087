//! One RC queue pair: requester (send queue, retransmission) and responder (receive queue,
//! PSN checks, duplicate replay). Modelled on the behaviour in reference §6.

use super::dcqcn::ReactionPoint;
use super::{
    ack_timeout, rnr_timer, Completion, ConnectAttrs, QpState, QpStats, RcConfig, RcEvent,
    RcOpcode, RecvWr, SendOp, SendWr,
};
use crate::mr::{Access, MrTable};
use crate::wire::{
    self, psn_add, psn_diff, Aeth, AtomicAckEth, AtomicEth, Bth, Headers, Opcode, Reth,
};
use crate::WcStatus;
use std::collections::VecDeque;
use std::time::Instant;

const SYN_TYPE_MASK: u8 = 0x60;
const SYN_ACK: u8 = 0x00;
const SYN_RNR: u8 = 0x20;
const SYN_NAK: u8 = 0x60;

#[derive(Debug)]
struct SendWqe {
    wr: SendWr,
    /// PSNs assigned at first transmission.
    sent: bool,
    first_psn: u32,
    last_psn: u32,
    npkts: u32,
    /// READ: response packets received in order.
    read_rcvd: u32,
    /// READ: the response index the last re-issued request (a retry of a partially received
    /// READ) asked from; a responder may restart there with FIRST/ONLY (IBA §9.7.5.1.x,
    /// see `on_response`).
    read_restart: Option<u32>,
}

#[derive(Debug)]
enum InMsg {
    Send {
        wqe: RecvWr,
        received: u32,
    },
    Write {
        rkey: u32,
        va: u64,
        remaining: u32,
        total: u32,
    },
}

/// A responder resource saved for duplicate READ/atomic requests, and whether its last
/// response (READ: the LAST or ONLY packet; atomic: the ATOMIC ACKNOWLEDGE) has been sent
/// at least once, by the first answer or a replay.
#[derive(Debug, Clone, Copy)]
struct Saved {
    res: Resource,
    answered: bool,
}

#[derive(Debug, Clone, Copy)]
enum Resource {
    Read {
        first_psn: u32,
        n: u32,
        va: u64,
        rkey: u32,
        len: u32,
    },
    Atomic {
        psn: u32,
        orig: u64,
    },
}

impl Resource {
    /// The first PSN of the request this resource answers.
    fn first_psn(&self) -> u32 {
        match *self {
            Resource::Read { first_psn, .. } => first_psn,
            Resource::Atomic { psn, .. } => psn,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum RespItem {
    /// ACK / NAK / RNR NAK.
    Ack {
        psn: u32,
        syndrome: u8,
        msn: u32,
    },
    /// READ responses still to send: packets `k..n` of the READ whose first PSN is `base`.
    Read {
        base: u32,
        k: u32,
        n: u32,
        va: u64,
        rkey: u32,
        remaining: u32,
    },
    AtomicAck {
        psn: u32,
        orig: u64,
        msn: u32,
    },
}

/// A packet the QP wants sent; the endpoint stamps the ICRC.
pub(crate) struct OutPacket {
    pub len: usize,
}

#[derive(Debug)]
pub(crate) struct Qp {
    pub qpn: u32,
    pub init_psn: u32,
    pub access: Access,
    pub state: QpState,
    pub attrs: Option<ConnectAttrs>,
    pub sport: u16,
    /// How the QP's packets are carried (set by `connect`).
    pub wire: super::RcWire,
    /// The local IP address the QP's packets come from and must be sent to (the ICRC
    /// covers it).
    pub local_ip: std::net::IpAddr,
    pub stats: QpStats,
    pmtu: u32,
    // requester
    sq: VecDeque<SendWqe>,
    cursor: usize,
    cursor_pkt: u32,
    next_new_psn: u32,
    una: u32,
    retry_left: u8,
    rnr_left: u8,
    rnr_until: Option<Instant>,
    ack_deadline: Option<Instant>,
    noack_pkts: u32,
    rd_atomic_inflight: u32,
    /// Highest PSN ever sent + 1 (PSNs at or after it were never sent).
    high_psn: u32,
    /// A response-triggered retry started at this PSN: no other one starts until `una`
    /// passes it or the timer fires (rxe's `started_retry`).
    retry_from: Option<u32>,
    /// A go-back rewound the send queue and no request was sent since: the ACK timer that
    /// expires now times a wait for nothing sent, and spends no retry (it is re-armed).
    rewound_unsent: bool,
    /// The last data packet out was a READ response: a request ready to go is sent next,
    /// so that one direction's READ response stream cannot starve this QP's own requests.
    request_turn: bool,
    // responder
    epsn: u32,
    msn: u32,
    rq: VecDeque<RecvWr>,
    nak_seq_sent: bool,
    in_msg: Option<InMsg>,
    /// Oldest first (PSN order).
    resources: VecDeque<Saved>,
    out: VecDeque<RespItem>,
    // congestion control (DCQCN)
    /// Reaction point: rate limiter on this QP's request and READ-response packets.
    rp: ReactionPoint,
    /// Notification point: when the last CNP was queued.
    last_cnp: Option<Instant>,
    /// A CNP is due (sent before any other packet).
    cnp_pending: bool,
    /// The limiter held a packet back until then: a wake-up for `next_timeout`.
    pace_wake: Option<Instant>,
}

fn npkts(len: u32, pmtu: u32) -> u32 {
    if len == 0 {
        1
    } else {
        len.div_ceil(pmtu)
    }
}

impl Qp {
    pub fn new(qpn: u32, init_psn: u32, access: Access) -> Self {
        Qp {
            qpn,
            init_psn,
            access,
            state: QpState::Init,
            attrs: None,
            sport: 0xC000,
            wire: super::RcWire::Native,
            local_ip: std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
            stats: QpStats::default(),
            pmtu: 1024,
            sq: VecDeque::new(),
            cursor: 0,
            cursor_pkt: 0,
            next_new_psn: init_psn,
            una: init_psn,
            retry_left: 0,
            rnr_left: 0,
            rnr_until: None,
            ack_deadline: None,
            noack_pkts: 0,
            rd_atomic_inflight: 0,
            high_psn: init_psn,
            retry_from: None,
            rewound_unsent: false,
            request_turn: false,
            epsn: 0,
            msn: 0,
            rq: VecDeque::new(),
            nak_seq_sent: false,
            in_msg: None,
            resources: VecDeque::new(),
            out: VecDeque::new(),
            rp: ReactionPoint::new(),
            last_cnp: None,
            cnp_pending: false,
            pace_wake: None,
        }
    }

    pub fn connect(&mut self, a: ConnectAttrs) {
        self.pmtu = a.path_mtu;
        self.epsn = a.remote_psn & wire::PSN_MASK;
        self.retry_left = a.retry_cnt & 7;
        self.rnr_left = a.rnr_retry & 7;
        self.sport = super::udp_sport(a.flow_label, self.qpn, a.remote_qpn);
        self.attrs = Some(a);
        self.state = QpState::Rts;
    }

    pub fn sq_len(&self) -> usize {
        self.sq.len()
    }

    pub fn rq_len(&self) -> usize {
        self.rq.len()
    }

    pub fn post_send(&mut self, wr: SendWr) {
        let n = match wr.op {
            SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } => 1,
            _ => npkts(wr.len, self.pmtu),
        };
        self.sq.push_back(SendWqe {
            wr,
            sent: false,
            first_psn: 0,
            last_psn: 0,
            npkts: n,
            read_rcvd: 0,
            read_restart: None,
        });
    }

    /// Whether a READ of `len` bytes fits the PSN space: its responses take one PSN per
    /// path-MTU packet, reserved at once, and with up to `max_unacked` PSNs before it
    /// the whole span must stay under half the 24-bit space, or its own responses (and a
    /// retry of it at the responder) compare as ahead instead of behind (a 2^31-byte READ
    /// at PMTU 256 never completed; found by review).
    pub fn read_fits(&self, len: u32, max_unacked: u32) -> bool {
        npkts(len, self.pmtu).saturating_add(max_unacked) < 1 << 23
    }

    pub fn post_recv(&mut self, wr: RecvWr) {
        self.rq.push_back(wr);
    }

    pub fn next_timeout(&self) -> Option<Instant> {
        if self.state != QpState::Rts {
            return None;
        }
        [
            self.rnr_until,
            self.ack_deadline,
            self.pace_wake,
            self.rp.next_timer(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    fn outstanding(&self) -> bool {
        self.sq.front().is_some_and(|w| w.sent)
    }

    fn timeout_dur(&self) -> Option<std::time::Duration> {
        self.attrs.and_then(|a| ack_timeout(a.timeout))
    }

    fn arm_ack_timer(&mut self, now: Instant) {
        if self.ack_deadline.is_none() {
            self.ack_deadline = self.timeout_dur().map(|d| now + d);
        }
    }

    fn rearm_after_progress(&mut self, now: Instant) {
        self.ack_deadline = if self.outstanding() {
            self.timeout_dur().map(|d| now + d)
        } else {
            None
        };
    }

    /// Go back to the oldest unacknowledged PSN.
    fn rewind(&mut self) {
        let Some(front) = self.sq.front() else {
            return;
        };
        if !front.sent {
            return;
        }
        let k = psn_diff(self.una, front.first_psn).max(0) as u32;
        let k = k.min(front.npkts.saturating_sub(1));
        // Count what will be sent again.
        let sent_from = psn_diff(self.high_psn, self.una).max(0) as u64;
        self.stats.retransmitted += sent_from;
        self.cursor = 0;
        self.cursor_pkt = k;
        self.noack_pkts = 0;
        self.retry_from = Some(self.una);
        self.rewound_unsent = true;
    }

    pub fn handle_timeout(&mut self, now: Instant, cfg: &RcConfig, events: &mut VecDeque<RcEvent>) {
        if self.state != QpState::Rts {
            return;
        }
        if self.pace_wake.is_some_and(|t| t <= now) {
            self.pace_wake = None;
        }
        self.rp.handle_timeout(now, &cfg.dcqcn);
        self.stats.dcqcn_rate_bps = self.rp.rate_bps(&cfg.dcqcn);
        if self.rnr_until.is_some_and(|t| t <= now) {
            self.rnr_until = None;
        }
        if self.ack_deadline.is_some_and(|t| t <= now) {
            self.ack_deadline = None;
            if !self.outstanding() || self.rnr_until.is_some() {
                return;
            }
            if self.rewound_unsent {
                // Nothing was sent again since the last go-back (this QP's READ responses
                // or the rate limiter held the requests back): the timer has not timed a
                // response to anything, so no retry is spent. (IBA §9.7.6.1.x: the retry
                // count bounds retransmissions; each expiry cost one before, and a QP
                // serving a long READ failed RetryExceeded with one copy ever sent; found
                // by review.)
                self.rearm_after_progress(now);
                return;
            }
            self.stats.timeouts += 1;
            // The timer is no response-triggered retry: it always goes back.
            self.retry_from = None;
            self.go_back(now, events);
        }
    }

    /// Go back N (IBA §9.7.5.x requester retry; rxe `req_retry`): spend one unit of
    /// `retry_cnt` (none left: the front WR completes with `RetryExceeded`, the QP goes to
    /// ERROR), resend from the oldest unacknowledged PSN and rearm the ACK timer so that the
    /// resent requests get a full timeout. A response-triggered retry is started once per
    /// gap: while one is under way (`retry_from`), this does nothing.
    fn go_back(&mut self, now: Instant, events: &mut VecDeque<RcEvent>) {
        if self.retry_from.is_some() {
            return;
        }
        if self.retry_left == 0 {
            self.fail_front(WcStatus::RetryExceeded, events);
            return;
        }
        self.retry_left -= 1;
        self.rewind();
        self.rearm_after_progress(now);
    }

    fn complete_front(&mut self, status: WcStatus, events: &mut VecDeque<RcEvent>) {
        if let Some(w) = self.sq.pop_front() {
            if w.wr.op.is_read_or_atomic() && w.sent {
                self.rd_atomic_inflight = self.rd_atomic_inflight.saturating_sub(1);
            }
            if w.sent {
                self.una = psn_add(w.last_psn, 1);
            }
            if self.cursor == 0 {
                self.cursor_pkt = 0;
            } else {
                self.cursor -= 1;
            }
            events.push_back(RcEvent::Completion(Completion {
                qpn: self.qpn,
                wr_id: w.wr.wr_id,
                status,
                opcode: w.wr.op.completion_opcode(),
                byte_len: w.wr.len,
                imm: None,
            }));
        }
    }

    /// Complete the front WR with `status` and move to the error state.
    fn fail_front(&mut self, status: WcStatus, events: &mut VecDeque<RcEvent>) {
        self.complete_front(status, events);
        self.enter_error(status, events);
    }

    /// Move to ERROR: flush every WR with WrFlushError.
    pub fn enter_error(&mut self, status: WcStatus, events: &mut VecDeque<RcEvent>) {
        if self.state == QpState::Error {
            return;
        }
        self.state = QpState::Error;
        while !self.sq.is_empty() {
            self.complete_front(WcStatus::WrFlushError, events);
        }
        if let Some(InMsg::Send { wqe, .. }) = self.in_msg.take() {
            events.push_back(self.recv_completion(
                wqe,
                WcStatus::WrFlushError,
                RcOpcode::Recv,
                0,
                None,
            ));
        }
        while let Some(r) = self.rq.pop_front() {
            events.push_back(self.recv_completion(
                r,
                WcStatus::WrFlushError,
                RcOpcode::Recv,
                0,
                None,
            ));
        }
        self.ack_deadline = None;
        self.rnr_until = None;
        // Keep only a pending error NAK: it must still reach the requester.
        self.out.retain(|i| matches!(i, RespItem::Ack { syndrome, .. } if *syndrome & SYN_TYPE_MASK == SYN_NAK && *syndrome != Aeth::NAK_PSN_SEQUENCE_ERROR));
        events.push_back(RcEvent::QpError {
            qpn: self.qpn,
            status,
        });
    }

    fn recv_completion(
        &self,
        wqe: RecvWr,
        status: WcStatus,
        opcode: RcOpcode,
        byte_len: u32,
        imm: Option<u32>,
    ) -> RcEvent {
        RcEvent::Completion(Completion {
            qpn: self.qpn,
            wr_id: wqe.wr_id,
            status,
            opcode,
            byte_len,
            imm,
        })
    }

    // ------------------------------------------------------------------ transmit

    /// Emit the next packet (responses first, then requests) into `buf` as a UDP payload
    /// without a valid ICRC. Returns its length.
    pub fn poll_packet(
        &mut self,
        now: Instant,
        cfg: &RcConfig,
        mrs: &MrTable,
        buf: &mut Vec<u8>,
        events: &mut VecDeque<RcEvent>,
    ) -> Option<OutPacket> {
        self.attrs?;
        if self.cnp_pending {
            self.cnp_pending = false;
            let mut bth = Bth::new(Opcode::CNP, self.remote_qpn(), 0);
            bth.becn = true;
            if let Some(p) = self.emit(buf, bth, Headers::Cnp, &[]) {
                self.stats.cnps_sent += 1;
                return Some(p);
            }
        }
        // The DCQCN rate limiter holds back READ responses and requests (not ACKs/NAKs).
        // In ERROR only owed responses remain: they go out unpaced (no timer would wake them).
        let paced = cfg.dcqcn.enabled && self.state == QpState::Rts && !self.rp.may_send(now);
        // READ response data and this QP's requests take turns (rxe runs its requester and
        // responder as separate tasks); ACKs, NAKs and atomic ACKs go first.
        let reading = matches!(self.out.front(), Some(RespItem::Read { .. }));
        if !(reading && self.request_turn && self.state == QpState::Rts && !paced) {
            if let Some((p, data)) = self.poll_response(mrs, buf, paced) {
                self.stats.tx_responses += 1;
                if data {
                    self.request_turn = true;
                    self.rp.on_transmit(now, p.len, &cfg.dcqcn);
                    self.stats.dcqcn_rate_bps = self.rp.rate_bps(&cfg.dcqcn);
                }
                return Some(p);
            }
        }
        if self.state != QpState::Rts {
            return None;
        }
        if paced {
            if self.sq.get(self.cursor).is_some() || self.out.front().is_some() {
                self.pace_wake = self.rp.send_at(now);
            }
            return None;
        }
        self.request_turn = false;
        let Some(p) = self.poll_request(now, cfg, mrs, buf, events) else {
            // No request to send: the READ response waiting there goes.
            return if reading {
                self.poll_packet(now, cfg, mrs, buf, events)
            } else {
                None
            };
        };
        self.rewound_unsent = false;
        self.stats.tx_requests += 1;
        if cfg.dcqcn.enabled {
            self.rp.on_transmit(now, p.len, &cfg.dcqcn);
            self.stats.dcqcn_rate_bps = self.rp.rate_bps(&cfg.dcqcn);
        }
        Some(p)
    }

    fn remote_qpn(&self) -> u32 {
        self.attrs.map_or(0, |a| a.remote_qpn)
    }

    fn emit(
        &self,
        buf: &mut Vec<u8>,
        bth: Bth,
        headers: Headers,
        payload: &[u8],
    ) -> Option<OutPacket> {
        let len = wire::packet_len(&headers, payload.len());
        buf.clear();
        buf.resize(len, 0);
        wire::emit_packet(&bth, &headers, payload, buf).ok()?;
        Some(OutPacket { len })
    }

    /// The next response packet and whether it carries READ data (rate limited); with
    /// `paced`, a READ response at the front waits (and what is queued behind it).
    fn poll_response(
        &mut self,
        mrs: &MrTable,
        buf: &mut Vec<u8>,
        paced: bool,
    ) -> Option<(OutPacket, bool)> {
        let rqpn = self.remote_qpn();
        loop {
            let item = *self.out.front()?;
            match item {
                RespItem::Ack { psn, syndrome, msn } => {
                    self.out.pop_front();
                    let bth = Bth::new(Opcode::RC_ACKNOWLEDGE, rqpn, psn);
                    return self
                        .emit(
                            buf,
                            bth,
                            rc(None, Some(Aeth { syndrome, msn }), None, None, None),
                            &[],
                        )
                        .map(|p| (p, false));
                }
                RespItem::AtomicAck { psn, orig, msn } => {
                    self.out.pop_front();
                    self.mark_answered(psn);
                    let bth = Bth::new(Opcode::RC_ATOMIC_ACKNOWLEDGE, rqpn, psn);
                    let h = Headers::Rc {
                        reth: None,
                        aeth: Some(Aeth {
                            syndrome: Aeth::ACK_NO_CREDIT,
                            msn,
                        }),
                        atomic: None,
                        atomic_ack: Some(AtomicAckEth { orig }),
                        imm: None,
                        ieth: None,
                    };
                    return self.emit(buf, bth, h, &[]).map(|p| (p, false));
                }
                RespItem::Read {
                    base,
                    k,
                    n,
                    va,
                    rkey,
                    remaining,
                } => {
                    if k >= n {
                        self.out.pop_front();
                        continue;
                    }
                    if paced {
                        return None;
                    }
                    let plen = remaining.min(self.pmtu);
                    let data = if plen == 0 {
                        Some(Vec::new())
                    } else {
                        read_remote(mrs, rkey, va, plen)
                    };
                    let Some(data) = data else {
                        // The region went away under the READ: stop responding; the
                        // requester's timer and retry budget decide.
                        self.out.pop_front();
                        continue;
                    };
                    let op = if n == 1 {
                        Opcode::RC_RDMA_READ_RESPONSE_ONLY
                    } else if k == 0 {
                        Opcode::RC_RDMA_READ_RESPONSE_FIRST
                    } else if k + 1 == n {
                        Opcode::RC_RDMA_READ_RESPONSE_LAST
                    } else {
                        Opcode::RC_RDMA_READ_RESPONSE_MIDDLE
                    };
                    let aeth = (op != Opcode::RC_RDMA_READ_RESPONSE_MIDDLE).then_some(Aeth {
                        syndrome: Aeth::ACK_NO_CREDIT,
                        msn: self.msn,
                    });
                    let bth = Bth::new(op, rqpn, psn_add(base, k));
                    let p = self.emit(buf, bth, rc(None, aeth, None, None, None), &data);
                    if k + 1 == n {
                        self.mark_answered(base);
                    }
                    if let Some(RespItem::Read {
                        k: kk,
                        va: vv,
                        remaining: rr,
                        ..
                    }) = self.out.front_mut()
                    {
                        *kk += 1;
                        *vv = vv.wrapping_add(u64::from(plen));
                        *rr -= plen;
                        if *kk >= n {
                            self.out.pop_front();
                        }
                    }
                    return p.map(|p| (p, true));
                }
            }
        }
    }

    fn poll_request(
        &mut self,
        now: Instant,
        cfg: &RcConfig,
        mrs: &MrTable,
        buf: &mut Vec<u8>,
        events: &mut VecDeque<RcEvent>,
    ) -> Option<OutPacket> {
        if self.rnr_until.is_some() {
            return None;
        }
        let attrs = self.attrs?;
        let pmtu = self.pmtu;
        let rqpn = attrs.remote_qpn;
        let w = self.sq.get(self.cursor)?;
        if !w.sent
            && w.wr.op.is_read_or_atomic()
            && self.rd_atomic_inflight >= u32::from(attrs.max_rd_atomic)
        {
            return None;
        }
        let psn_probe = if w.sent {
            psn_add(w.first_psn, self.cursor_pkt)
        } else {
            self.next_new_psn
        };
        if psn_diff(psn_probe, self.una) >= cfg.max_unacked_psns as i32 {
            return None;
        }
        let idx = self.cursor;
        let w = self.sq.get_mut(idx)?;
        if !w.sent {
            w.sent = true;
            w.first_psn = self.next_new_psn;
            w.last_psn = psn_add(w.first_psn, w.npkts - 1);
            self.next_new_psn = psn_add(w.last_psn, 1);
            self.cursor_pkt = 0;
            if w.wr.op.is_read_or_atomic() {
                self.rd_atomic_inflight += 1;
            }
        }
        let wr = w.wr;
        let (first_psn, n) = (w.first_psn, w.npkts);
        let k = self.cursor_pkt;
        let psn = psn_add(first_psn, k);
        let off = u64::from(k) * u64::from(pmtu);
        let mut bth;
        let headers;
        let mut payload_buf = Vec::new();
        let mut consumed = 1;
        match wr.op {
            SendOp::Send { imm } | SendOp::Write { imm, .. } => {
                let is_send = matches!(wr.op, SendOp::Send { .. });
                let plen = (u64::from(wr.len) - off.min(u64::from(wr.len))).min(u64::from(pmtu));
                if plen > 0 {
                    match mrs.local_vec(wr.lkey, wr.local_offset + off, plen) {
                        Ok(d) => payload_buf = d,
                        Err(_) => {
                            // Only if the region was deregistered after posting.
                            self.fail_at(idx, WcStatus::LocalProtectionError, events);
                            return None;
                        }
                    }
                }
                let first = k == 0;
                let last = k + 1 == n;
                let op = match (is_send, first, last, imm.is_some()) {
                    (true, true, true, false) => Opcode::RC_SEND_ONLY,
                    (true, true, true, true) => Opcode::RC_SEND_ONLY_WITH_IMMEDIATE,
                    (true, true, false, _) => Opcode::RC_SEND_FIRST,
                    (true, false, false, _) => Opcode::RC_SEND_MIDDLE,
                    (true, false, true, false) => Opcode::RC_SEND_LAST,
                    (true, false, true, true) => Opcode::RC_SEND_LAST_WITH_IMMEDIATE,
                    (false, true, true, false) => Opcode::RC_RDMA_WRITE_ONLY,
                    (false, true, true, true) => Opcode::RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE,
                    (false, true, false, _) => Opcode::RC_RDMA_WRITE_FIRST,
                    (false, false, false, _) => Opcode::RC_RDMA_WRITE_MIDDLE,
                    (false, false, true, false) => Opcode::RC_RDMA_WRITE_LAST,
                    (false, false, true, true) => Opcode::RC_RDMA_WRITE_LAST_WITH_IMMEDIATE,
                };
                let reth = match wr.op {
                    SendOp::Write {
                        remote_addr, rkey, ..
                    } if first => Some(Reth {
                        va: remote_addr,
                        rkey,
                        dma_len: wr.len,
                    }),
                    _ => None,
                };
                bth = Bth::new(op, rqpn, psn);
                bth.solicited = last && wr.solicited && (is_send || imm.is_some());
                headers = rc(reth, None, None, None, if last { imm } else { None });
                bth.ack_req = last;
            }
            SendOp::Read { remote_addr, rkey } => {
                // A retry of a partially received READ asks only for the rest.
                let done = u64::from(k) * u64::from(pmtu);
                let rest = u64::from(wr.len).saturating_sub(done) as u32;
                bth = Bth::new(Opcode::RC_RDMA_READ_REQUEST, rqpn, psn);
                headers = rc(
                    Some(Reth {
                        va: remote_addr.wrapping_add(done),
                        rkey,
                        dma_len: rest,
                    }),
                    None,
                    None,
                    None,
                    None,
                );
                bth.ack_req = true;
                consumed = n - k;
                if let Some(w) = self.sq.get_mut(idx) {
                    w.read_restart = (k > 0).then_some(k);
                }
            }
            SendOp::CompareSwap {
                remote_addr,
                rkey,
                compare,
                swap,
            } => {
                let eth = AtomicEth {
                    va: remote_addr,
                    rkey,
                    swap_add: swap,
                    compare,
                };
                (bth, headers) = atomic_request(Opcode::RC_COMPARE_SWAP, rqpn, psn, eth);
            }
            SendOp::FetchAdd {
                remote_addr,
                rkey,
                add,
            } => {
                let eth = AtomicEth {
                    va: remote_addr,
                    rkey,
                    swap_add: add,
                    compare: 0,
                };
                (bth, headers) = atomic_request(Opcode::RC_FETCH_ADD, rqpn, psn, eth);
            }
        }
        self.noack_pkts += 1;
        if self.noack_pkts >= cfg.max_pkts_per_ack.max(1) {
            bth.ack_req = true;
        }
        if bth.ack_req {
            self.noack_pkts = 0;
        }
        let p = self.emit(buf, bth, headers, &payload_buf)?;
        // Advance the cursor.
        self.cursor_pkt += consumed;
        if self.cursor_pkt >= n {
            self.cursor += 1;
            self.cursor_pkt = 0;
        }
        let after = psn_add(psn, consumed);
        if psn_diff(after, self.high_psn) > 0 {
            self.high_psn = after;
        }
        if self.rp.throttled() {
            // The DCQCN limiter, not the network, spaces these packets: the ACK timer
            // counts from the latest transmission, so a slow (throttled) QP is not taken
            // for a lossy one (IBA §9.7.6.1: the timer covers the wait for the response).
            self.ack_deadline = None;
        }
        self.arm_ack_timer(now);
        Some(p)
    }

    /// The WR at `idx` failed locally (its region went away after posting): it completes
    /// with `status` and the QP moves to ERROR, flushing the rest.
    fn fail_at(&mut self, idx: usize, status: WcStatus, events: &mut VecDeque<RcEvent>) {
        if let Some(w) = self.sq.remove(idx) {
            if w.wr.op.is_read_or_atomic() && w.sent {
                self.rd_atomic_inflight = self.rd_atomic_inflight.saturating_sub(1);
            }
            events.push_back(RcEvent::Completion(Completion {
                qpn: self.qpn,
                wr_id: w.wr.wr_id,
                status,
                opcode: w.wr.op.completion_opcode(),
                byte_len: w.wr.len,
                imm: None,
            }));
        }
        self.enter_error(status, events);
    }

    // ------------------------------------------------------------------ receive

    /// A packet for this QP from the right peer, after ICRC/header checks.
    #[allow(clippy::too_many_arguments)]
    pub fn on_packet(
        &mut self,
        now: Instant,
        cfg: &RcConfig,
        ce: bool,
        bth: &Bth,
        headers: &Headers,
        payload: &[u8],
        mrs: &mut MrTable,
        events: &mut VecDeque<RcEvent>,
    ) {
        if self.state != QpState::Rts {
            return;
        }
        if ce {
            self.on_ce(now, cfg);
        }
        match bth.opcode.0 {
            0x0D..=0x12 => self.on_response(now, bth, headers, payload, mrs, events),
            _ => self.on_request(cfg, bth, headers, payload, mrs, events),
        }
    }

    /// Notification point (RoCEv2 Annex A17.9; DCQCN paper §3 NP): a CE-marked packet
    /// arrived; queue a CNP unless one was queued less than `cnp_interval` ago.
    fn on_ce(&mut self, now: Instant, cfg: &RcConfig) {
        self.stats.ce_received += 1;
        if !cfg.dcqcn.enabled {
            return;
        }
        if self
            .last_cnp
            .is_some_and(|t| now.saturating_duration_since(t) < cfg.dcqcn.cnp_interval)
        {
            return;
        }
        self.last_cnp = Some(now);
        self.cnp_pending = true;
    }

    /// Reaction point: a CNP from the peer for this QP (RoCEv2 Annex A17.9; DCQCN paper §3
    /// RP): cut the rate.
    pub fn on_cnp(&mut self, now: Instant, cfg: &RcConfig) {
        if self.state != QpState::Rts {
            return;
        }
        self.stats.cnps_received += 1;
        self.rp.on_cnp(now, &cfg.dcqcn);
        self.stats.dcqcn_rate_bps = self.rp.rate_bps(&cfg.dcqcn);
    }

    // ---------------------------------------------------------------- requester

    fn on_response(
        &mut self,
        now: Instant,
        bth: &Bth,
        headers: &Headers,
        payload: &[u8],
        mrs: &mut MrTable,
        events: &mut VecDeque<RcEvent>,
    ) {
        let Headers::Rc {
            aeth, atomic_ack, ..
        } = *headers
        else {
            return;
        };
        let p = bth.psn;
        let op = bth.opcode;
        // Responses for PSNs never sent are bogus.
        if psn_diff(p, self.high_psn) >= 0 {
            return;
        }
        let syn = aeth.map(|a| a.syndrome);
        let syn_type = syn.map(|s| s & SYN_TYPE_MASK);
        // Implicit completion: every SEND/WRITE that ends before `p` is acknowledged
        // (for a NAK/RNR NAK PSN p, the PSNs before p are; for an ACK, those ≤ p).
        let mut progress = false;
        loop {
            let Some(w) = self.sq.front() else {
                return;
            };
            if !w.sent {
                return;
            }
            if psn_diff(p, w.last_psn) <= 0 {
                break;
            }
            if w.wr.op.is_read_or_atomic() {
                let w_first = w.first_psn;
                // Its response was lost: the responder has moved past it.
                if op == Opcode::RC_ACKNOWLEDGE {
                    if progress {
                        self.rearm_after_progress(now);
                    }
                    let behind = self.cursor > 0
                        || self.cursor_pkt > psn_diff(self.una, w_first).max(0) as u32;
                    if behind {
                        self.go_back(now, events);
                    }
                    return;
                }
                break;
            }
            self.complete_front(WcStatus::Success, events);
            progress = true;
        }
        if progress {
            self.reset_retry();
        }
        let Some(w) = self.sq.front() else {
            return;
        };
        if !w.sent {
            return;
        }
        if psn_diff(p, self.una) < 0 {
            if progress {
                self.rearm_after_progress(now);
            }
            return; // stale duplicate
        }
        let w_op = w.wr.op;
        let (first_psn, last_psn, n, read_rcvd, wr) =
            (w.first_psn, w.last_psn, w.npkts, w.read_rcvd, w.wr);
        let w_restart = w.read_restart;
        match op {
            Opcode::RC_ACKNOWLEDGE => match syn_type {
                Some(SYN_ACK) if !w_op.is_read_or_atomic() => {
                    if p == last_psn {
                        self.complete_front(WcStatus::Success, events);
                    } else {
                        self.una = psn_add(p, 1);
                    }
                    progress = true;
                    self.reset_retry();
                }
                Some(SYN_RNR) => {
                    self.stats.rnr_naks_received += 1;
                    if psn_diff(p, self.una) > 0 && !w_op.is_read_or_atomic() {
                        self.una = p;
                    }
                    let rnr_retry = self.attrs.map_or(0, |a| a.rnr_retry & 7);
                    if rnr_retry != 7 {
                        if self.rnr_left == 0 {
                            self.fail_front(WcStatus::RnrRetryExceeded, events);
                            return;
                        }
                        self.rnr_left -= 1;
                    }
                    self.rewind();
                    self.ack_deadline = None;
                    self.rnr_until = Some(now + rnr_timer(syn.unwrap_or(0)));
                    return;
                }
                Some(SYN_NAK) => {
                    let s = syn.unwrap_or(0);
                    if s == Aeth::NAK_PSN_SEQUENCE_ERROR {
                        self.stats.seq_naks_received += 1;
                        if psn_diff(p, self.una) > 0 && !w_op.is_read_or_atomic() {
                            self.una = p;
                            progress = true;
                            self.reset_retry();
                        }
                        if !progress {
                            if self.retry_from.is_some() {
                                return; // already going back for this gap
                            }
                            if self.retry_left == 0 {
                                self.fail_front(WcStatus::RetryExceeded, events);
                                return;
                            }
                            self.retry_left -= 1;
                        }
                        self.rewind();
                        self.rearm_after_progress(now);
                        return;
                    }
                    self.fail_front(WcStatus::from_nak_syndrome(s), events);
                    return;
                }
                _ => {}
            },
            Opcode::RC_ATOMIC_ACKNOWLEDGE => {
                if w_op.is_atomic() && p == first_psn && syn_type == Some(SYN_ACK) {
                    if let Some(a) = atomic_ack {
                        match mrs.local_write(wr.lkey, wr.local_offset, &a.orig.to_le_bytes()) {
                            Ok(()) => {}
                            Err(_) => {
                                self.fail_front(WcStatus::LocalProtectionError, events);
                                return;
                            }
                        }
                        self.complete_front(WcStatus::Success, events);
                        progress = true;
                        self.reset_retry();
                    }
                }
            }
            _ => {
                // READ responses.
                if !matches!(w_op, SendOp::Read { .. }) {
                    return;
                }
                let expected = psn_add(first_psn, read_rcvd);
                if p != expected {
                    // A response beyond the expected one means the responder went past a
                    // lost packet (one path, in order). Re-request the rest of the READ
                    // from the first missing PSN now (rxe would wait for the local ACK
                    // timer, which on a long READ fires again and again while the
                    // responder still streams the old response): once per gap, guarded
                    // by `retry_from` like the ACK-past-READ retry above, and counted
                    // against `retry_cnt`. Behind-`una` duplicates were dropped earlier.
                    if psn_diff(p, expected) > 0 {
                        self.go_back(now, events);
                    }
                    return;
                }
                if aeth.is_some() && syn_type != Some(SYN_ACK) {
                    return;
                }
                let k = read_rcvd;
                let expected_op = if n == 1 {
                    Opcode::RC_RDMA_READ_RESPONSE_ONLY
                } else if k == 0 {
                    Opcode::RC_RDMA_READ_RESPONSE_FIRST
                } else if k + 1 == n {
                    Opcode::RC_RDMA_READ_RESPONSE_LAST
                } else {
                    Opcode::RC_RDMA_READ_RESPONSE_MIDDLE
                };
                // A responder answering a re-issued READ (a retry from response k) may
                // restart the response there: FIRST (ONLY if one packet is left) instead
                // of MIDDLE (LAST) — IBA §9.7.5.1.x; rxe and RNICs do. Accept that at the
                // restart point only; anything else out of shape is dropped.
                let restarted = if k + 1 == n {
                    Opcode::RC_RDMA_READ_RESPONSE_ONLY
                } else {
                    Opcode::RC_RDMA_READ_RESPONSE_FIRST
                };
                let restart_ok = w_restart == Some(k) && op == restarted;
                if op != expected_op && !restart_ok {
                    return;
                }
                let off = u64::from(k) * u64::from(self.pmtu);
                let want = (u64::from(wr.len).saturating_sub(off)).min(u64::from(self.pmtu));
                if payload.len() as u64 != want {
                    return;
                }
                if want > 0 {
                    match mrs.local_write(wr.lkey, wr.local_offset + off, payload) {
                        Ok(()) => {}
                        Err(_) => {
                            self.fail_front(WcStatus::LocalProtectionError, events);
                            return;
                        }
                    }
                }
                if let Some(w) = self.sq.front_mut() {
                    w.read_rcvd += 1;
                }
                self.una = psn_add(p, 1);
                progress = true;
                self.reset_retry();
                if k + 1 == n {
                    self.complete_front(WcStatus::Success, events);
                }
            }
        }
        if progress {
            // The cursor may point behind una after a cumulative ACK; never resend acked PSNs.
            self.skip_acked();
            self.rearm_after_progress(now);
        }
    }

    fn reset_retry(&mut self) {
        if self.retry_from.is_some_and(|r| psn_diff(self.una, r) > 0) {
            self.retry_from = None;
        }
        if let Some(a) = self.attrs {
            self.retry_left = a.retry_cnt & 7;
            self.rnr_left = a.rnr_retry & 7;
        }
    }

    /// After progress, make sure the transmit cursor is not before `una` in the front WR.
    fn skip_acked(&mut self) {
        if self.cursor != 0 {
            return;
        }
        if let Some(w) = self.sq.front() {
            if w.sent {
                let k = psn_diff(self.una, w.first_psn).max(0) as u32;
                if k > self.cursor_pkt && k < w.npkts && !matches!(w.wr.op, SendOp::Read { .. }) {
                    self.cursor_pkt = k;
                }
            }
        }
    }

    // ---------------------------------------------------------------- responder

    fn push_out(&mut self, cfg: &RcConfig, item: RespItem) {
        if let RespItem::Ack { psn, syndrome, msn } = item {
            if syndrome == Aeth::ACK_NO_CREDIT {
                if let Some(RespItem::Ack {
                    psn: p,
                    syndrome: s,
                    msn: m,
                }) = self.out.back_mut()
                {
                    if *s == Aeth::ACK_NO_CREDIT {
                        // Coalesce: a later cumulative ACK replaces the queued one; an
                        // older one (a duplicate request's) is covered by it and dropped.
                        // (Replacing it moved the queued PSN backwards: the requester then
                        // waited for an ACK of the newer requests until its timeout; found
                        // by review.)
                        if psn_diff(psn, *p) > 0 {
                            *p = psn;
                            *m = msn;
                        }
                        return;
                    }
                }
            }
        }
        if self.out.len() >= cfg.max_pending_responses {
            return;
        }
        self.out.push_back(item);
    }

    /// An incoming SEND that cannot be placed in its receive WQE `wqe` (after `at` bytes
    /// were): the WQE completes with `fail.0` (LocalLengthError when the message is longer
    /// than the WQE, LocalProtectionError when its lkey does not allow the write), the
    /// message is abandoned, and the QP answers the packet `psn` with the fatal NAK
    /// `fail.1` and moves to ERROR (IBA §9.9.3, responder errors; see `nak_fatal`).
    fn fail_send(
        &mut self,
        cfg: &RcConfig,
        wqe: RecvWr,
        at: u32,
        fail: (WcStatus, u8),
        psn: u32,
        events: &mut VecDeque<RcEvent>,
    ) {
        self.in_msg = None;
        events.push_back(self.recv_completion(wqe, fail.0, RcOpcode::Recv, at, None));
        self.nak_fatal(cfg, fail.1, psn, events);
    }

    /// A fatal responder error on the request with PSN `psn` (IBA §9.9.3 responder class
    /// B/C errors; §9.7.5 "responses in PSN order"): the responses still owed for earlier
    /// requests (READ responses, atomic ACKs, a coalesced ACK) go out first, then the NAK,
    /// and the QP moves to ERROR. The requester thus completes everything before the bad
    /// request as it would have, the bad request with the NAK's error, and flushes the rest.
    fn nak_fatal(
        &mut self,
        _cfg: &RcConfig,
        syndrome: u8,
        psn: u32,
        events: &mut VecDeque<RcEvent>,
    ) {
        let owed = std::mem::take(&mut self.out);
        let msn = self.msn;
        self.enter_error(WcStatus::from_nak_syndrome(syndrome), events);
        self.out = owed;
        // Never dropped for `max_pending_responses`: it is the last response of this QP.
        self.out.push_back(RespItem::Ack { psn, syndrome, msn });
    }

    fn on_request(
        &mut self,
        cfg: &RcConfig,
        bth: &Bth,
        headers: &Headers,
        payload: &[u8],
        mrs: &mut MrTable,
        events: &mut VecDeque<RcEvent>,
    ) {
        let Headers::Rc {
            reth, atomic, imm, ..
        } = *headers
        else {
            return;
        };
        let Some(attrs) = self.attrs else {
            return;
        };
        let p = bth.psn;
        let op = bth.opcode.0;
        let d = psn_diff(p, self.epsn);
        if d > 0 {
            self.stats.out_of_sequence += 1;
            if !self.nak_seq_sent {
                self.nak_seq_sent = true;
                self.stats.seq_naks_sent += 1;
                let epsn = self.epsn;
                self.push_out(
                    cfg,
                    RespItem::Ack {
                        psn: epsn,
                        syndrome: Aeth::NAK_PSN_SEQUENCE_ERROR,
                        msn: self.msn,
                    },
                );
            }
            return;
        }
        if d < 0 {
            self.stats.duplicates_received += 1;
            self.on_duplicate(cfg, op, p, reth);
            return;
        }
        self.nak_seq_sent = false;
        let pmtu = self.pmtu;
        let plen = payload.len() as u32;
        // Opcode sequence (reference §4.1).
        let in_send = matches!(self.in_msg, Some(InMsg::Send { .. }));
        let in_write = matches!(self.in_msg, Some(InMsg::Write { .. }));
        let seq_ok = match op {
            0x01..=0x03 => in_send,
            0x07..=0x09 => in_write,
            0x00 | 0x04 | 0x05 | 0x06 | 0x0A | 0x0B | 0x0C | 0x13 | 0x14 => self.in_msg.is_none(),
            _ => false, // *_WITH_INVALIDATE and anything else: unsupported
        };
        if !seq_ok {
            self.nak_fatal(cfg, Aeth::NAK_INVALID_REQUEST, p, events);
            return;
        }
        let is_first = matches!(op, 0x00 | 0x06);
        let is_middle = matches!(op, 0x01 | 0x07);
        let is_last = matches!(op, 0x02 | 0x03 | 0x08 | 0x09);
        let is_only = matches!(op, 0x04 | 0x05 | 0x0A | 0x0B);
        let len_ok = if is_first || is_middle {
            plen == pmtu
        } else if is_last {
            plen >= 1 && plen <= pmtu
        } else if is_only {
            plen <= pmtu
        } else {
            plen == 0
        };
        if !len_ok {
            self.nak_fatal(cfg, Aeth::NAK_INVALID_REQUEST, p, events);
            return;
        }
        match op {
            // ---------------- SEND
            0x00..=0x05 => {
                if matches!(op, 0x00 | 0x04 | 0x05) {
                    let Some(wqe) = self.rq.pop_front() else {
                        self.rnr_nak(cfg, p, attrs.min_rnr_timer);
                        return;
                    };
                    self.in_msg = Some(InMsg::Send { wqe, received: 0 });
                }
                let Some(InMsg::Send { wqe, received }) = self.in_msg.as_mut() else {
                    return;
                };
                let (wqe, at) = (*wqe, *received);
                if u64::from(at) + u64::from(plen) > u64::from(wqe.len) {
                    let fail = (WcStatus::LocalLengthError, Aeth::NAK_INVALID_REQUEST);
                    self.fail_send(cfg, wqe, at, fail, p, events);
                    return;
                }
                if plen > 0
                    && mrs
                        .local_write(wqe.lkey, wqe.offset + u64::from(at), payload)
                        .is_err()
                {
                    let fail = (
                        WcStatus::LocalProtectionError,
                        Aeth::NAK_REMOTE_OPERATIONAL_ERROR,
                    );
                    self.fail_send(cfg, wqe, at, fail, p, events);
                    return;
                }
                if let Some(InMsg::Send { received, .. }) = self.in_msg.as_mut() {
                    *received += plen;
                }
                if is_last || is_only {
                    self.in_msg = None;
                    self.msn = psn_add(self.msn, 1);
                    events.push_back(self.recv_completion(
                        wqe,
                        WcStatus::Success,
                        RcOpcode::Recv,
                        at + plen,
                        imm,
                    ));
                }
            }
            // ---------------- WRITE
            0x06..=0x0B => {
                let needs_rwr = matches!(op, 0x09 | 0x0B);
                if needs_rwr && self.rq.is_empty() {
                    self.rnr_nak(cfg, p, attrs.min_rnr_timer);
                    return;
                }
                if is_first || is_only {
                    if !self.access.contains(Access::REMOTE_WRITE) {
                        self.nak_fatal(cfg, Aeth::NAK_INVALID_REQUEST, p, events);
                        return;
                    }
                    let Some(r) = reth else {
                        return;
                    };
                    if r.dma_len > cfg.max_message_size {
                        self.nak_fatal(cfg, Aeth::NAK_INVALID_REQUEST, p, events);
                        return;
                    }
                    if r.dma_len > 0
                        && mrs
                            .check_remote(r.rkey, r.va, u64::from(r.dma_len), Access::REMOTE_WRITE)
                            .is_err()
                    {
                        self.nak_fatal(cfg, Aeth::NAK_REMOTE_ACCESS_ERROR, p, events);
                        return;
                    }
                    self.in_msg = Some(InMsg::Write {
                        rkey: r.rkey,
                        va: r.va,
                        remaining: r.dma_len,
                        total: r.dma_len,
                    });
                }
                let Some(InMsg::Write {
                    rkey,
                    va,
                    remaining,
                    total,
                }) = self.in_msg.as_mut()
                else {
                    return;
                };
                let (rk, v, rem, tot) = (*rkey, *va, *remaining, *total);
                let len_ok = if is_last || is_only {
                    plen == rem
                } else {
                    plen <= rem
                };
                if !len_ok {
                    self.in_msg = None;
                    self.nak_fatal(cfg, Aeth::NAK_INVALID_REQUEST, p, events);
                    return;
                }
                if plen > 0 && mrs.remote_write(rk, v, payload).is_err() {
                    self.in_msg = None;
                    self.nak_fatal(cfg, Aeth::NAK_REMOTE_ACCESS_ERROR, p, events);
                    return;
                }
                if let Some(InMsg::Write { va, remaining, .. }) = self.in_msg.as_mut() {
                    *va = va.wrapping_add(u64::from(plen));
                    *remaining -= plen;
                }
                if is_last || is_only {
                    self.in_msg = None;
                    self.msn = psn_add(self.msn, 1);
                    if needs_rwr {
                        if let Some(wqe) = self.rq.pop_front() {
                            events.push_back(self.recv_completion(
                                wqe,
                                WcStatus::Success,
                                RcOpcode::RecvRdmaWithImm,
                                tot,
                                imm,
                            ));
                        }
                    }
                }
            }
            // ---------------- READ
            0x0C => {
                let Some(r) = reth else {
                    return;
                };
                if !self.access.contains(Access::REMOTE_READ)
                    || attrs.max_dest_rd_atomic == 0
                    || r.dma_len > cfg.max_message_size
                {
                    self.nak_fatal(cfg, Aeth::NAK_INVALID_REQUEST, p, events);
                    return;
                }
                if r.dma_len > 0
                    && mrs
                        .check_remote(r.rkey, r.va, u64::from(r.dma_len), Access::REMOTE_READ)
                        .is_err()
                {
                    self.nak_fatal(cfg, Aeth::NAK_REMOTE_ACCESS_ERROR, p, events);
                    return;
                }
                if !self.make_room(attrs.max_dest_rd_atomic) {
                    self.stats.rd_atomic_refused += 1;
                    self.nak_fatal(cfg, Aeth::NAK_INVALID_REQUEST, p, events);
                    return;
                }
                let n = npkts(r.dma_len, pmtu);
                self.msn = psn_add(self.msn, 1);
                self.save_resource(Resource::Read {
                    first_psn: p,
                    n,
                    va: r.va,
                    rkey: r.rkey,
                    len: r.dma_len,
                });
                self.push_out(
                    cfg,
                    RespItem::Read {
                        base: p,
                        k: 0,
                        n,
                        va: r.va,
                        rkey: r.rkey,
                        remaining: r.dma_len,
                    },
                );
                self.epsn = psn_add(p, n);
                return;
            }
            // ---------------- ATOMIC
            0x13 | 0x14 => {
                let Some(a) = atomic else {
                    return;
                };
                if !self.access.contains(Access::REMOTE_ATOMIC)
                    || attrs.max_dest_rd_atomic == 0
                    || a.va % 8 != 0
                {
                    self.nak_fatal(cfg, Aeth::NAK_INVALID_REQUEST, p, events);
                    return;
                }
                if !self.make_room(attrs.max_dest_rd_atomic) {
                    self.stats.rd_atomic_refused += 1;
                    self.nak_fatal(cfg, Aeth::NAK_INVALID_REQUEST, p, events);
                    return;
                }
                let Some(orig) = atomic_exec(mrs, op, &a) else {
                    self.nak_fatal(cfg, Aeth::NAK_REMOTE_ACCESS_ERROR, p, events);
                    return;
                };
                self.msn = psn_add(self.msn, 1);
                self.save_resource(Resource::Atomic { psn: p, orig });
                let msn = self.msn;
                self.push_out(cfg, RespItem::AtomicAck { psn: p, orig, msn });
                self.epsn = psn_add(p, 1);
                return;
            }
            _ => return,
        }
        self.epsn = psn_add(p, 1);
        if bth.ack_req {
            let msn = self.msn;
            self.push_out(
                cfg,
                RespItem::Ack {
                    psn: p,
                    syndrome: Aeth::ACK_NO_CREDIT,
                    msn,
                },
            );
        }
    }

    fn rnr_nak(&mut self, cfg: &RcConfig, psn: u32, timer: u8) {
        self.stats.rnr_naks_sent += 1;
        let msn = self.msn;
        self.push_out(
            cfg,
            RespItem::Ack {
                psn,
                syndrome: SYN_RNR | (timer & 0x1F),
                msn,
            },
        );
    }

    /// Room for one more READ/atomic responder resource (IBA §9.7.4.x / o9-xx
    /// `max_dest_rd_atomic`): with `max` saved, the oldest is retired, together with any of
    /// its responses still queued. rxe recycles the oldest the same way.
    ///
    /// A requester within its `max_rd_atomic` (at most our `max_dest_rd_atomic`) sends the
    /// request that needs the slot only after it has completed the oldest, which needs the
    /// oldest's last response. Queued responses of the oldest are then a replay for a
    /// duplicate request that came late, which nobody waits for: they must not keep the
    /// slot (a younger resource retired in its place could no longer be replayed, and its
    /// READ would fail with `RetryExceeded`). If the oldest's last response was never sent,
    /// the requester exceeded the limit: `false`.
    fn make_room(&mut self, max: u8) -> bool {
        let max = usize::from(max.max(1));
        while self.resources.len() >= max {
            let Some(oldest) = self.resources.front().copied() else {
                break;
            };
            if !oldest.answered {
                return false;
            }
            self.resources.pop_front();
            let psn = oldest.res.first_psn();
            self.out.retain(|it| match *it {
                RespItem::Read { base, .. } => base != psn,
                RespItem::AtomicAck { psn: a, .. } => a != psn,
                RespItem::Ack { .. } => true,
            });
        }
        true
    }

    fn save_resource(&mut self, res: Resource) {
        self.resources.push_back(Saved {
            res,
            answered: false,
        });
    }

    /// The last response of the resource whose request starts at `psn` went out.
    fn mark_answered(&mut self, psn: u32) {
        if let Some(s) = self
            .resources
            .iter_mut()
            .rev()
            .find(|s| s.res.first_psn() == psn)
        {
            s.answered = true;
        }
    }

    /// Queue `item`, the replay of the READ or atomic whose request starts at `psn`, ahead
    /// of everything queued for younger requests (READ responses, ATOMIC ACKNOWLEDGEs,
    /// ACKs and NAKs): responses leave in PSN order, which the requester expects. A younger
    /// READ's responses ahead of it would be dropped and asked for again; a younger
    /// request's ACK ahead of it acknowledges past the READ or atomic whose response has
    /// not arrived, which the requester takes as that response lost and goes back once
    /// more (IBA §9.7.5.1 (≈), docs/CONFORMANCE.md "ACK past READ"). Dropped when `max_pending_responses` are
    /// queued, like every response.
    fn push_replay(&mut self, cfg: &RcConfig, psn: u32, item: RespItem) {
        if self.out.len() >= cfg.max_pending_responses {
            return;
        }
        let at = self
            .out
            .iter()
            .position(|it| match *it {
                RespItem::Read { base, .. } => psn_diff(base, psn) > 0,
                RespItem::AtomicAck { psn: a, .. } | RespItem::Ack { psn: a, .. } => {
                    psn_diff(a, psn) > 0
                }
            })
            .unwrap_or(self.out.len());
        self.out.insert(at, item);
    }

    fn on_duplicate(&mut self, cfg: &RcConfig, op: u8, p: u32, reth: Option<Reth>) {
        match op {
            0x0C => {
                let Some(r) = reth else {
                    return;
                };
                let found = self.resources.iter().rev().find_map(|s| match s.res {
                    Resource::Read {
                        first_psn,
                        n,
                        va,
                        rkey,
                        len,
                    } => {
                        let k = psn_diff(p, first_psn);
                        (k >= 0 && (k as u32) < n)
                            .then_some((first_psn, n, va, rkey, len, k as u32))
                    }
                    _ => None,
                });
                let Some((base, n, va, rkey, len, k)) = found else {
                    return;
                };
                let end = va.saturating_add(u64::from(len));
                if r.rkey != rkey
                    || r.va < va
                    || r.va.saturating_add(u64::from(r.dma_len)) > end
                    || npkts(r.dma_len, self.pmtu) != n - k
                {
                    return;
                }
                let replay = RespItem::Read {
                    base,
                    k,
                    n,
                    va: r.va,
                    rkey,
                    remaining: r.dma_len,
                };
                // Either the requester lost part of the response and goes back N (its
                // requests for the later READs follow), or the network delivered a copy of
                // an old request late. Answer from the requested PSN in place of this
                // READ's own queued responses, ahead of the later READs' streams (PSN
                // order), and keep those: after a go-back each is replaced in turn when its
                // own request comes again, and after a late copy they are what the
                // requester still waits for. rxe likewise never drops a younger READ's
                // responses for a duplicate. (Dropping them made one late copy cost the
                // requester an ACK timeout: `rc_conformance.rs::
                // a_late_duplicate_read_request_keeps_the_younger_reads_responses`.)
                self.out
                    .retain(|it| !matches!(*it, RespItem::Read { base: b, .. } if b == base));
                self.push_replay(cfg, base, replay);
            }
            0x13 | 0x14 => {
                let found = self.resources.iter().rev().find_map(|s| match s.res {
                    Resource::Atomic { psn, orig } if psn == p => Some(orig),
                    _ => None,
                });
                // One ATOMIC ACKNOWLEDGE queued per atomic: more copies of the request
                // (a flood of duplicates) add nothing.
                let queued = self
                    .out
                    .iter()
                    .any(|it| matches!(*it, RespItem::AtomicAck { psn, .. } if psn == p));
                if let (Some(orig), false) = (found, queued) {
                    let msn = self.msn;
                    self.push_replay(cfg, p, RespItem::AtomicAck { psn: p, orig, msn });
                }
            }
            _ => {
                // Duplicate SEND/WRITE (IBA §9.7.5.1.x, C9-105 in rxe's numbering): not
                // executed again, acknowledged with the duplicate's own PSN. ePSN − 1
                // would be wrong when a READ/atomic follows: an ACK past it tells the
                // requester the READ's responses were lost and makes it go back.
                let msn = self.msn;
                let psn = p;
                self.push_out(
                    cfg,
                    RespItem::Ack {
                        psn,
                        syndrome: Aeth::ACK_NO_CREDIT,
                        msn,
                    },
                );
            }
        }
    }
}

fn rc(
    reth: Option<Reth>,
    aeth: Option<Aeth>,
    atomic: Option<AtomicEth>,
    atomic_ack: Option<AtomicAckEth>,
    imm: Option<u32>,
) -> Headers {
    Headers::Rc {
        reth,
        aeth,
        atomic,
        atomic_ack,
        imm,
        ieth: None,
    }
}

/// The BTH (AckReq set: an atomic is always answered) and AtomicETH of an atomic request
/// `opcode` (IBA 9.4.5) to QP `rqpn` at `psn`.
fn atomic_request(opcode: Opcode, rqpn: u32, psn: u32, eth: AtomicEth) -> (Bth, Headers) {
    let mut bth = Bth::new(opcode, rqpn, psn);
    bth.ack_req = true;
    (bth, rc(None, None, Some(eth), None, None))
}

/// `len` bytes at `va` of the region `rkey`, if READ is allowed there.
fn read_remote(mrs: &MrTable, rkey: u32, va: u64, len: u32) -> Option<Vec<u8>> {
    mrs.remote_read(rkey, va, u64::from(len)).ok()
}

/// Execute an atomic on the 8-byte little-endian value at `a.va`; the original value.
fn atomic_exec(mrs: &mut MrTable, op: u8, a: &AtomicEth) -> Option<u64> {
    mrs.remote_atomic(a.rkey, a.va, |old| {
        if op == 0x13 {
            if old == a.compare {
                a.swap_add
            } else {
                old
            }
        } else {
            old.wrapping_add(a.swap_add)
        }
    })
    .ok()
}
