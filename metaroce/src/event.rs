//! What the core reports to the application: work completions and connection events.

use bytes::Bytes;
use std::fmt;

/// Handle of a connection inside an [`Endpoint`](crate::Endpoint): the local QPN that
/// peers put in BTH.DestQP (24 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnectionHandle(pub u32);

impl fmt::Display for ConnectionHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "qp 0x{:06x}", self.0)
    }
}

/// Status of a work completion, named after `ibv_wc_status` (rdma-core `verbs.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcStatus {
    /// `IBV_WC_SUCCESS`: the operation executed at the responder.
    Success,
    /// `IBV_WC_LOC_LEN_ERR`: a local length was invalid.
    LocalLengthError,
    /// `IBV_WC_LOC_PROT_ERR`: the local memory reference (lkey, range) was invalid.
    LocalProtectionError,
    /// `IBV_WC_WR_FLUSH_ERR`: the operation was flushed because the connection closed or
    /// failed before it completed, or — for a SEND, and for a receive posted on a stream —
    /// because its stream is in the error state (see [`WcStatus::RnrRetryExceeded`]). A
    /// flushed SEND was not delivered; a flushed receive holds no message, though its
    /// buffer may hold part of one that began landing (as in IBA, its contents are
    /// undefined).
    WrFlushError,
    /// `IBV_WC_REM_INV_REQ_ERR`: the responder found the request invalid (NAK 0x61).
    RemoteInvalidRequest,
    /// `IBV_WC_REM_ACCESS_ERR`: bad rkey, range outside the region, or missing access
    /// right at the responder (NAK 0x62); nothing was written.
    RemoteAccessError,
    /// `IBV_WC_REM_OP_ERR`: the responder could not execute the operation (NAK 0x63).
    RemoteOperationalError,
    /// `IBV_WC_RETRY_EXC_ERR`: every path exceeded the retry budget without progress.
    RetryExceeded,
    /// `IBV_WC_RNR_RETRY_EXC_ERR`: a SEND found no receive posted at the responder on
    /// `rnr_retry` + 1 tries (`rnr_retry` 7 retries forever), with no other copy of it in
    /// flight; the message was not delivered (unless the network duplicated it). A try is
    /// a copy sent after the previous RNR wait ended: the sender waited the responder's
    /// RNR timer `rnr_retry` times in all, and an RNR NAK answering a copy sent before the
    /// last wait began (a tail-loss probe or loss retransmission) is not counted. Only the
    /// message whose receive is next is RNR-NAKed in this sense (as on an IBA RC QP, the
    /// head of the receive queue): a later message without a receive waits for the earlier
    /// ones without spending its RNR retries, so the first SEND of a stream to fail with
    /// this status is the earliest one not delivered.
    ///
    /// As in IBA, where this error moves the QP to the error state and flushes every later
    /// work request, it is fatal to the ordered unit — here the SEND's **stream**, which
    /// plays the role of an RC send queue: every later SEND on the stream completes with
    /// `WrFlushError` (even one already acknowledged: it waits at the receiver behind the
    /// lost message and is never delivered), SENDs posted on the stream afterwards complete
    /// with `WrFlushError` without being sent, and the receiver, told by a stream abort,
    /// flushes the stream's receives from that message on (docs/PROTOCOL.md, "Errors on a
    /// stream"). The connection's other streams, WRITEs, READs and atomics are not
    /// affected: a missing receive is a property of one stream, and failing the connection
    /// would let one slow consumer take every stream down. A stream in the error state
    /// stays so for the life of the connection; use another stream id. READs and atomics
    /// that meet a busy responder are retried without limit and never get this status.
    RnrRetryExceeded,
}

impl WcStatus {
    /// The numeric `ibv_wc_status` value.
    pub fn ibv_code(self) -> u32 {
        match self {
            WcStatus::Success => 0,
            WcStatus::LocalLengthError => 1,
            WcStatus::LocalProtectionError => 4,
            WcStatus::WrFlushError => 5,
            WcStatus::RemoteInvalidRequest => 9,
            WcStatus::RemoteAccessError => 10,
            WcStatus::RemoteOperationalError => 11,
            WcStatus::RetryExceeded => 12,
            WcStatus::RnrRetryExceeded => 13,
        }
    }

    /// The status a NAK syndrome (AETH NAK codes, RoCEv2 reference §3.1) maps to.
    pub fn from_nak_syndrome(syndrome: u8) -> WcStatus {
        match syndrome {
            0x61 => WcStatus::RemoteInvalidRequest,
            0x62 => WcStatus::RemoteAccessError,
            _ => WcStatus::RemoteOperationalError,
        }
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            WcStatus::Success => "success",
            WcStatus::LocalLengthError => "local length error",
            WcStatus::LocalProtectionError => "local protection error",
            WcStatus::WrFlushError => "work request flushed error",
            WcStatus::RemoteInvalidRequest => "remote invalid request error",
            WcStatus::RemoteAccessError => "remote access error",
            WcStatus::RemoteOperationalError => "remote operation error",
            WcStatus::RetryExceeded => "transport retry counter exceeded",
            WcStatus::RnrRetryExceeded => "RNR retry counter exceeded",
        };
        f.write_str(s)
    }
}

/// Operation a work completion reports, named after `ibv_wc_opcode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcOpcode {
    /// A SEND on a stream.
    Send,
    /// An RDMA WRITE.
    RdmaWrite,
    /// An RDMA WRITE with immediate (requester side).
    RdmaWriteWithImm,
    /// An RDMA READ.
    RdmaRead,
    /// An atomic compare-and-swap.
    CompSwap,
    /// An atomic fetch-and-add.
    FetchAdd,
    /// A receive posted with [`Endpoint::post_recv`](crate::Endpoint::post_recv), consumed
    /// by a SEND (`IBV_WC_RECV`).
    Recv,
}

/// A work completion (CQE) of an operation the application posted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The `wr_id` given when posting.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// Which operation.
    pub opcode: WcOpcode,
    /// Bytes the operation carried (the message or WRITE length).
    pub byte_len: u32,
}

/// Why a connection ended.
///
/// Not `Copy` since [`ConnectionError::ClosedByPeer`] carries the peer's reason bytes;
/// cloning is cheap (the bytes are reference-counted).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectionError {
    /// The peer did not answer the connection request in time.
    HandshakeTimeout,
    /// The peer refused the connection with a CONNECT Reject: `code` is its ConnectEth
    /// reject reason field, `reason` its payload (the text the peer's application gave to
    /// [`Endpoint::refuse_incoming`](crate::Endpoint::refuse_incoming), at most
    /// [`MAX_CLOSE_REASON`](crate::MAX_CLOSE_REASON) bytes; empty for the core's own
    /// refusals, whose codes are the `ConnectEth::REASON_*` constants). The core also
    /// reports an Accept it cannot use this way, with a local text: code `u32::MAX`
    /// (invalid path MTU or path count) or [`REJECT_PROTECTION_MISMATCH`](crate::conn::REJECT_PROTECTION_MISMATCH).
    Rejected {
        /// Application or core reject code (ConnectEth bytes 28–31).
        code: u32,
        /// Reason bytes (the Reject's payload), possibly empty.
        reason: Bytes,
    },
    /// Every path exceeded the retry budget without progress.
    RetryExceeded,
    /// The peer closed the connection with
    /// [`Endpoint::close_with`](crate::Endpoint::close_with) or
    /// [`Endpoint::abort`](crate::Endpoint::abort) (or, with code 0 and no reason,
    /// [`Endpoint::close`](crate::Endpoint::close)): `code` is the CloseEth reason field,
    /// `reason` the MR_CLOSE payload (at most
    /// [`MAX_CLOSE_REASON`](crate::MAX_CLOSE_REASON) bytes; longer payloads are cut).
    /// Code 1 is sent by the core itself to drop a ghost connection (a stale connection
    /// request reached a restarted peer).
    ClosedByPeer {
        /// Application error code (CloseEth bytes 0–3).
        code: u32,
        /// Application reason bytes (MR_CLOSE payload), possibly empty.
        reason: Bytes,
    },
    /// The application closed the connection.
    LocallyClosed,
    /// Nothing was heard from the peer for `TransportConfig::idle_timeout` (keepalives
    /// included): the peer is dead or unreachable. Pending operations were flushed.
    IdleTimeout,
    /// The peer came back as a new incarnation (a validated connection Request from the
    /// same address and QPN as this connection, after it was confirmed, or with another
    /// nonce): this connection is ended, its pending operations fail with
    /// `WrFlushError`, and the new incarnation is a separate connection (issue #9).
    PeerRestarted,
}

impl fmt::Display for ConnectionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConnectionError::HandshakeTimeout => f.write_str("connection request timed out"),
            ConnectionError::Rejected { code, reason } => {
                write!(f, "connection refused by peer (code {code}")?;
                if !reason.is_empty() {
                    write!(f, ": {}", String::from_utf8_lossy(reason))?;
                }
                f.write_str(")")
            }
            ConnectionError::RetryExceeded => f.write_str("retry count exceeded on every path"),
            ConnectionError::ClosedByPeer { code, reason } => {
                write!(f, "closed by peer (code {code}")?;
                if !reason.is_empty() {
                    write!(f, ": {}", String::from_utf8_lossy(reason))?;
                }
                f.write_str(")")
            }
            ConnectionError::LocallyClosed => f.write_str("closed locally"),
            ConnectionError::IdleTimeout => f.write_str("idle timeout"),
            ConnectionError::PeerRestarted => {
                f.write_str("peer restarted: a new incarnation replaced this connection")
            }
        }
    }
}

impl std::error::Error for ConnectionError {}

/// An event for the application, drained with [`Endpoint::poll_event`](crate::Endpoint::poll_event).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// A connection this endpoint requested is established.
    Connected(ConnectionHandle),
    /// A peer's connection request was accepted; the connection is established. With
    /// [`EndpointConfig::manual_accept`](crate::EndpointConfig::manual_accept) the
    /// connection is held instead — nothing is sent to the peer — until
    /// [`Endpoint::accept_incoming`](crate::Endpoint::accept_incoming) or
    /// [`Endpoint::refuse_incoming`](crate::Endpoint::refuse_incoming).
    Incoming(ConnectionHandle),
    /// The connection ended; its outstanding operations were completed with
    /// `WrFlushError` (or `RetryExceeded`) before this event.
    ConnectionLost {
        /// Which connection.
        conn: ConnectionHandle,
        /// Why.
        reason: ConnectionError,
    },
    /// Completion of a posted operation, reported once. A stream's SENDs complete in the
    /// order they were posted (like an RC send queue, the stream in the place of the QP),
    /// and so do the one-sided operations (WRITEs, READs, atomics) among themselves; a SEND
    /// completes only after every one-sided operation posted before it. Streams do not wait
    /// for one another: a SEND the peer holds back delays only its own stream's later
    /// completions. See docs/PROTOCOL.md, "Completions".
    Completion {
        /// Which connection.
        conn: ConnectionHandle,
        /// The completion.
        wc: WorkCompletion,
    },
    /// A whole SEND message arrived. Messages of one stream are reported exactly once and
    /// in the order they were sent; streams are independent of each other.
    Message {
        /// Which connection.
        conn: ConnectionHandle,
        /// Stream id.
        stream: u32,
        /// The message bytes.
        data: Bytes,
    },
    /// A receive posted with [`Endpoint::post_recv`](crate::Endpoint::post_recv) completed:
    /// a message of `wc.byte_len` bytes landed in its buffer (status `Success`), or did not
    /// fit (`LocalLengthError`; the sender gets `RemoteInvalidRequest`), or the connection
    /// ended or the stream is in the error state (`WrFlushError`; see
    /// [`WcStatus::RnrRetryExceeded`]). Reported in the order the receives were posted on
    /// the stream.
    RecvCompletion {
        /// Which connection.
        conn: ConnectionHandle,
        /// Stream id.
        stream: u32,
        /// The completion (`opcode` is [`WcOpcode::Recv`]).
        wc: WorkCompletion,
    },
    /// An RDMA WRITE with immediate finished landing in local memory: every byte of it is
    /// visible in the target region when this event is reported. Reported exactly once per
    /// operation, in the order the writes complete.
    WriteWithImm {
        /// Which connection.
        conn: ConnectionHandle,
        /// The immediate value (host order).
        imm: u32,
        /// Bytes written.
        byte_len: u32,
    },
    /// The peer finished `stream` ([`Endpoint::finish_stream`](crate::Endpoint::finish_stream)):
    /// reported once, after the stream's last [`Event::Message`] / [`Event::RecvCompletion`].
    /// No further message arrives on the stream.
    StreamFinished {
        /// Which connection.
        conn: ConnectionHandle,
        /// Stream id.
        stream: u32,
    },
    /// The peer reset `stream` with `code`
    /// ([`Endpoint::reset_stream`](crate::Endpoint::reset_stream), or in answer to this
    /// side's [`Endpoint::stop_stream`](crate::Endpoint::stop_stream)), or gave up on it after
    /// a SEND failed with `RnrRetryExceeded` (code [`STREAM_CODE_RNR`](crate::STREAM_CODE_RNR))
    /// or was refused for a full stream table after earlier messages of the stream were
    /// taken (code [`STREAM_CODE_REFUSED`](crate::STREAM_CODE_REFUSED); a stream refused
    /// from its first message is closed without this event, the application never saw it,
    /// unless the closed stream ids are at their range bound: docs/PROTOCOL.md, "Refused
    /// streams").
    /// Reported once, after the messages delivered before the reset point; receives still
    /// posted on the stream were completed with `WrFlushError` just before. No further
    /// message arrives on the stream.
    StreamReset {
        /// Which connection.
        conn: ConnectionHandle,
        /// Stream id.
        stream: u32,
        /// The peer's code.
        code: u32,
    },
    /// The peer refused `stream`: its stream table was full (it keeps
    /// [`TransportConfig::max_streams`](crate::TransportConfig::max_streams) streams) when
    /// the SEND `wr_id` arrived, and it kept nothing of it (NAK 0x61 with
    /// `NakEth::FLAG_STREAM_REFUSED`, docs/PROTOCOL.md "Refused streams"). Reported once per
    /// refused stream, before that SEND's completion (`RemoteInvalidRequest`). The stream
    /// is then in the error state, as after `RnrRetryExceeded`: its later SENDs, and SENDs
    /// posted on it afterwards, complete with `WrFlushError`, and nothing of the stream
    /// from that message on is delivered. It tells a refusal (try again on a new stream once
    /// one of yours ends) from the other causes of `RemoteInvalidRequest` (a message longer
    /// than the peer's `max_message_size` or its posted receive), which the completion's
    /// status alone does not.
    StreamRefused {
        /// Which connection.
        conn: ConnectionHandle,
        /// Stream id.
        stream: u32,
        /// The refused SEND's work request id.
        wr_id: u64,
    },
    /// The peer, receiving on `stream`, asked this side to stop sending on it
    /// ([`Endpoint::stop_stream`](crate::Endpoint::stop_stream)) with `code`: the stream was
    /// reset with that code (its SENDs not yet completed were completed with
    /// `WrFlushError` before this event; later posts on it are refused with
    /// [`PostError::StreamReset`](crate::PostError::StreamReset)). Reported once.
    StreamStopped {
        /// Which connection.
        conn: ConnectionHandle,
        /// Stream id.
        stream: u32,
        /// The peer's code.
        code: u32,
    },
    /// Both directions of `stream` are over and the connection forgot its state: this
    /// side's sending ended (finished or reset, or stopped by the peer) with every SEND,
    /// FIN and abort acknowledged, and the peer's sending ended ([`Event::StreamFinished`]
    /// or [`Event::StreamReset`] reported) with every message delivered and consumed — or
    /// this side stopped it before any message of it was delivered (`stop_stream`; the
    /// peer may never answer, and no `StreamReset` is reported then).
    /// Reported once, after every other event of the stream; nothing more is reported for
    /// its id. Stream ids are single-use per connection: later posts on it fail with
    /// [`PostError::StreamClosed`](crate::PostError::StreamClosed), a receive posted on it
    /// completes with `WrFlushError`, and late packets of it are acknowledged and dropped.
    /// `TransportConfig::max_streams` counts streams not closed yet. (A stream with a
    /// refused message, or beyond `2 × max_streams + 1` ranges of closed ids that do not
    /// merge, is kept instead and never reported closed.)
    StreamClosed {
        /// Which connection.
        conn: ConnectionHandle,
        /// Stream id.
        stream: u32,
    },
    /// A work completion or error of an RC queue pair (RoCEv2 mode, [`Endpoint::rc`](crate::Endpoint::rc)).
    Rc(crate::rocev2::RcEvent),
}
