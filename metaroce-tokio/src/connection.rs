//! A connection to one peer: many ordered message streams, one-sided operations.

use crate::endpoint::{EndpointRef, Shared, Waiter};
use crate::error::Error;
use crate::mr::{MemoryRegion, RemoteRegion};
use crate::stream::{MessageStream, StreamEntry};
use crate::Endpoint;
use metaroce::{
    AtomicOp, AtomicRequest, ConnectionError, ConnectionHandle, ConnectionStats, PostError,
    ReadRequest, RecvRequest, WcStatus, WorkCompletion, WriteRequest,
};
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;
use tokio::sync::{oneshot, watch, Notify};

/// What the driver and the user handles of one connection share: why it ended, and the
/// signals for peer-opened streams and WRITE-with-immediate notifications. Holds nothing
/// that keeps the endpoint alive.
#[derive(Debug)]
pub(crate) struct ConnSignals {
    /// `None` while the connection lives; the reason once it ended.
    pub status: watch::Sender<Option<ConnectionError>>,
    /// Notified when a peer-opened stream or an immediate is queued, or the connection ends.
    pub queued: Notify,
}

impl ConnSignals {
    pub fn reason(&self) -> Option<ConnectionError> {
        self.status.borrow().clone()
    }
}

/// Per-connection routing state kept by the driver; removed (with everything in it) when
/// the connection ends.
pub(crate) struct ConnEntry {
    pub streams: HashMap<u32, StreamEntry>,
    /// Peer-opened streams not yet taken by `accept_stream` (ids; at most the core's
    /// `max_streams`, each id once).
    pub accept_queue: VecDeque<u32>,
    /// WRITE-with-immediate notifications `(imm, byte_len)` not yet taken by `recv_imm`
    /// (8 bytes each; no data).
    pub imm_queue: VecDeque<(u32, u32)>,
    pub signals: Arc<ConnSignals>,
    pub next_stream: u32,
}

impl ConnEntry {
    pub fn new() -> ConnEntry {
        ConnEntry {
            streams: HashMap::new(),
            accept_queue: VecDeque::new(),
            imm_queue: VecDeque::new(),
            signals: Arc::new(ConnSignals {
                status: watch::Sender::new(None),
                queued: Notify::new(),
            }),
            next_stream: 0,
        }
    }

    /// The connection ended: record why, end every stream and wake every waiter. The
    /// caller removes the entry.
    pub fn on_lost(&mut self, reason: ConnectionError) {
        self.signals.status.send_replace(Some(reason.clone()));
        self.signals.queued.notify_waiters();
        for s in self.streams.values_mut() {
            s.close(Error::ConnectionLost(reason.clone()));
        }
    }
}

pub(crate) struct ConnInner {
    pub ep: Arc<EndpointRef>,
    pub handle: ConnectionHandle,
    pub signals: Arc<ConnSignals>,
    pub peer: Option<SocketAddr>,
    pub span: tracing::Span,
}

impl Drop for ConnInner {
    /// The last handle (connection or stream) is gone: close the connection (code 0).
    fn drop(&mut self) {
        if self.signals.reason().is_none() {
            let shared = &self.ep.shared;
            let mut st = shared.lock();
            if st.conns.contains_key(&self.handle) {
                st.close_conn(self.handle, 0, b"");
                drop(st);
                shared.wake_driver.notify_one();
            }
        }
    }
}

/// A connection to one peer. Cheap to clone. It carries any number of independent ordered
/// [`MessageStream`]s and one-sided RDMA operations, sprayed over the connection's paths.
///
/// The connection lives while any clone of it or any of its [`MessageStream`]s exists;
/// dropping the last one closes it (code 0). [`close`](Self::close) closes it with a code
/// and reason the peer's [`closed`](Self::closed) reports.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use metaroce_tokio::{Config, Endpoint};
/// let server = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
/// let client = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
/// let connecting = client.connect(server.local_addr())?;
/// let peer = server.accept().await.unwrap().accept()?;
/// let conn = connecting.await?;
/// println!("connected to {:?}, local {}", conn.remote_addr(), conn.handle());
/// drop(conn); // the last handle: the connection closes
/// let why = peer.closed().await;
/// println!("peer saw: {why}");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Connection {
    inner: Arc<ConnInner>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("handle", &self.inner.handle)
            .field("peer", &self.inner.peer)
            .finish()
    }
}

impl Connection {
    pub(crate) fn new(
        ep: Arc<EndpointRef>,
        handle: ConnectionHandle,
        signals: Arc<ConnSignals>,
        peer: Option<SocketAddr>,
    ) -> Connection {
        let span = tracing::debug_span!(
            parent: &ep.shared.span,
            "connection",
            qpn = handle.0,
            peer = ?peer
        );
        Connection {
            inner: Arc::new(ConnInner {
                ep,
                handle,
                signals,
                peer,
                span,
            }),
        }
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.inner.ep.shared
    }

    /// The tracing span of this connection (fields `qpn`, `peer`; child of the endpoint's).
    pub fn span(&self) -> &tracing::Span {
        &self.inner.span
    }

    /// The core's handle (the local QPN).
    pub fn handle(&self) -> ConnectionHandle {
        self.inner.handle
    }

    /// The endpoint this connection belongs to.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint {
            inner: self.inner.ep.clone(),
        }
    }

    /// The peer's address.
    pub fn remote_addr(&self) -> Option<SocketAddr> {
        self.inner
            .peer
            .or_else(|| self.shared().lock().core.peer_addr(self.inner.handle))
    }

    /// Counters and per-path state (RTT, window, retransmissions, ECN marks); `None` once
    /// the connection ended.
    pub fn stats(&self) -> Option<ConnectionStats> {
        self.shared()
            .lock()
            .core
            .connection_stats(self.inner.handle)
    }

    /// Why the connection ended, if it has.
    pub fn close_reason(&self) -> Option<ConnectionError> {
        self.inner.signals.reason()
    }

    /// Wait until the connection ends, and say why: closed here
    /// (`LocallyClosed`), closed by the peer (with its code and reason), idle timeout,
    /// retry exceeded.
    ///
    /// # Cancel safety
    /// Cancel safe: it only observes.
    pub async fn closed(&self) -> ConnectionError {
        let mut rx = self.inner.signals.status.subscribe();
        let r = match rx.wait_for(Option::is_some).await {
            Ok(r) => r.clone().unwrap_or(ConnectionError::LocallyClosed),
            Err(_) => ConnectionError::LocallyClosed,
        };
        r
    }

    fn lost(&self) -> Error {
        match self.inner.signals.reason() {
            Some(r) => Error::ConnectionLost(r),
            None => Error::EndpointClosed,
        }
    }

    /// Open a new stream with an id of this side's parity (the connecting side uses even
    /// ids, the accepting side odd ones, so the two never collide).
    ///
    /// # Errors
    /// [`Error::ConnectionLost`] once the connection ended.
    pub fn open_stream(&self) -> Result<MessageStream, Error> {
        let mut st = self.shared().lock();
        let parity = u32::from(!st.core.is_client(self.inner.handle));
        let Some(entry) = st.conns.get_mut(&self.inner.handle) else {
            return Err(self.lost());
        };
        loop {
            let id = entry.next_stream * 2 + parity;
            entry.next_stream += 1;
            if !entry.streams.contains_key(&id) {
                drop(st);
                return self.stream(id);
            }
        }
    }

    /// Open the stream with a given id (for ids both sides agree on, such as a
    /// communicator id).
    ///
    /// # Errors
    /// [`Error::StreamInUse`] if it is open already (including when the peer opened it
    /// first: take it from [`accept_stream`](Self::accept_stream));
    /// [`Error::ConnectionLost`] once the connection ended.
    pub fn stream(&self, id: u32) -> Result<MessageStream, Error> {
        let mut st = self.shared().lock();
        let Some(entry) = st.conns.get_mut(&self.inner.handle) else {
            return Err(self.lost());
        };
        if entry.streams.contains_key(&id) {
            return Err(Error::StreamInUse(id));
        }
        let (e, rx) = StreamEntry::new(false);
        entry.streams.insert(id, e);
        Ok(MessageStream::new(self.inner.clone(), id, rx))
    }

    /// The next stream the peer opened (its first message is waiting in it); `None` once
    /// the connection has ended.
    ///
    /// # Cancel safety
    /// Cancel safe: a stream is taken from the queue only when this resolves.
    pub async fn accept_stream(&self) -> Option<MessageStream> {
        let sig = self.inner.signals.clone();
        loop {
            let notified = sig.queued.notified();
            {
                let mut st = self.shared().lock();
                let entry = st.conns.get_mut(&self.inner.handle)?;
                while let Some(id) = entry.accept_queue.pop_front() {
                    if let Some(rx) = entry.streams.get_mut(&id).and_then(|s| s.pending_rx.take()) {
                        return Some(MessageStream::new(self.inner.clone(), id, rx));
                    }
                }
            }
            notified.await;
        }
    }

    /// The next RDMA WRITE with immediate that landed in this endpoint's memory from this
    /// peer: `(imm, byte_len)`. Every byte of it is visible in the target region when this
    /// resolves. `None` once the connection has ended.
    ///
    /// # Cancel safety
    /// Cancel safe: a notification is taken from the queue only when this resolves.
    pub async fn recv_imm(&self) -> Option<(u32, u32)> {
        let sig = self.inner.signals.clone();
        loop {
            let notified = sig.queued.notified();
            {
                let mut st = self.shared().lock();
                let entry = st.conns.get_mut(&self.inner.handle)?;
                if let Some(v) = entry.imm_queue.pop_front() {
                    return Some(v);
                }
            }
            notified.await;
        }
    }

    /// Post an operation and wait for its completion.
    async fn run_op(
        &self,
        post: impl Fn(&mut metaroce::Endpoint, u64) -> Result<(), PostError>,
    ) -> Result<WorkCompletion, Error> {
        // Operations run in the connection's span (qpn, peer).
        let span = self.inner.span.clone();
        tracing::Instrument::instrument(
            async {
                let shared = self.shared();
                let rx = loop {
                    let notified = shared.sq_space.notified();
                    {
                        let mut st = shared.lock();
                        if st.closed {
                            return Err(Error::EndpointClosed);
                        }
                        if !st.conns.contains_key(&self.inner.handle) {
                            return Err(self.lost());
                        }
                        let wr_id = st.wr_id();
                        match post(&mut st.core, wr_id) {
                            Ok(()) => {
                                let (tx, rx) = oneshot::channel();
                                st.waiters
                                    .insert((self.inner.handle, wr_id), Waiter::Op(tx));
                                break rx;
                            }
                            Err(PostError::SendQueueFull) => {}
                            Err(PostError::UnknownConnection) => return Err(self.lost()),
                            Err(PostError::Closing) => {
                                return Err(Error::ConnectionLost(ConnectionError::LocallyClosed))
                            }
                            Err(e) => return Err(Error::Post(e)),
                        }
                    }
                    notified.await;
                };
                shared.wake_driver.notify_one();
                let wc = rx.await.map_err(|_| self.lost())?;
                if wc.status == WcStatus::Success {
                    Ok(wc)
                } else {
                    Err(Error::Completion(wc))
                }
            },
            span,
        )
        .await
    }

    fn write_request(
        &self,
        src: &MemoryRegion,
        range: Range<u64>,
        dst: RemoteRegion,
        dst_offset: u64,
        imm: Option<u32>,
    ) -> Result<WriteRequest, Error> {
        if !Arc::ptr_eq(&src.ep().shared, self.shared()) {
            return Err(Error::ForeignRegion);
        }
        let len = range
            .end
            .checked_sub(range.start)
            .ok_or(Error::Memory(metaroce::MrError::OutOfBounds))?;
        let len = u32::try_from(len).map_err(|_| {
            Error::Post(PostError::MessageTooLarge {
                len,
                max: u32::MAX as u64,
            })
        })?;
        Ok(WriteRequest {
            wr_id: 0,
            lkey: src.keys().lkey,
            local_offset: range.start,
            len,
            remote_addr: dst.addr.wrapping_add(dst_offset),
            rkey: dst.rkey,
            imm,
        })
    }

    /// RDMA WRITE: copy `src[range]` into the peer's region `dst` at `dst_offset`. Resolves
    /// with the work completion once every packet is acknowledged, which means every byte
    /// has landed in the peer's memory. A refusal by the peer (bad rkey, out of bounds, no
    /// REMOTE_WRITE right) is `Err(Error::Completion(wc))` with
    /// `wc.status == WcStatus::RemoteAccessError`, and nothing was written.
    ///
    /// The WRITE is posted at the future's first poll (or, with the send queue full, at the
    /// first poll that finds room). Dropping the future after that does **not** cancel it:
    /// the WRITE still runs to completion, only its work completion is discarded. `src` is
    /// **not** copied at post time: each packet's bytes are read from the region when the
    /// packet is built, and again for a retransmission, so — as with verbs — leave
    /// `src[range]` unchanged until the WRITE completed, or the peer may receive a mix.
    pub async fn write(
        &self,
        src: &MemoryRegion,
        range: Range<u64>,
        dst: RemoteRegion,
        dst_offset: u64,
    ) -> Result<WorkCompletion, Error> {
        let req = self.write_request(src, range, dst, dst_offset, None)?;
        let h = self.inner.handle;
        self.run_op(move |core, wr_id| core.post_write(h, WriteRequest { wr_id, ..req }))
            .await
    }

    /// RDMA WRITE with immediate: as [`write`](Self::write), and the peer's
    /// [`recv_imm`](Self::recv_imm) yields `(imm, len)` once all bytes have landed.
    pub async fn write_with_imm(
        &self,
        src: &MemoryRegion,
        range: Range<u64>,
        dst: RemoteRegion,
        dst_offset: u64,
        imm: u32,
    ) -> Result<WorkCompletion, Error> {
        let req = self.write_request(src, range, dst, dst_offset, Some(imm))?;
        let h = self.inner.handle;
        self.run_op(move |core, wr_id| core.post_write(h, WriteRequest { wr_id, ..req }))
            .await
    }

    /// RDMA READ: copy the peer's `src` region from `src_offset` into `dst[range]`
    /// (`dst` needs `Access::LOCAL_WRITE`, the peer's region `REMOTE_READ`). Resolves once
    /// every byte has landed in `dst`. A refusal is `Err(Error::Completion(wc))` with
    /// `RemoteAccessError`, and `dst` is untouched.
    ///
    /// Posted at the future's first poll (with the send queue full, at the first poll that
    /// finds room); dropping the future after that does **not** cancel the READ: response
    /// bytes keep landing in `dst[range]` until it completes, so do not reuse that range
    /// for something else before then.
    pub async fn read(
        &self,
        dst: &MemoryRegion,
        range: Range<u64>,
        src: RemoteRegion,
        src_offset: u64,
    ) -> Result<WorkCompletion, Error> {
        let w = self.write_request(dst, range, src, src_offset, None)?;
        let req = ReadRequest {
            wr_id: 0,
            lkey: w.lkey,
            local_offset: w.local_offset,
            len: w.len,
            remote_addr: w.remote_addr,
            rkey: w.rkey,
        };
        let h = self.inner.handle;
        self.run_op(move |core, wr_id| core.post_read(h, ReadRequest { wr_id, ..req }))
            .await
    }

    async fn atomic(
        &self,
        remote: RemoteRegion,
        remote_offset: u64,
        op: AtomicOp,
    ) -> Result<u64, Error> {
        let ep = self.endpoint();
        let result = ep.alloc(8, metaroce::Access::LOCAL_WRITE);
        let req = AtomicRequest {
            wr_id: 0,
            lkey: result.keys().lkey,
            local_offset: 0,
            remote_addr: remote.addr.wrapping_add(remote_offset),
            rkey: remote.rkey,
            op,
        };
        let h = self.inner.handle;
        self.run_op(move |core, wr_id| core.post_atomic(h, AtomicRequest { wr_id, ..req }))
            .await?;
        let b = result.read(0, 8)?;
        let mut v = [0u8; 8];
        v.copy_from_slice(&b);
        Ok(u64::from_le_bytes(v))
    }

    /// Atomic compare-and-swap on the 8 bytes (little-endian u64, 8-byte aligned) at
    /// `remote_offset` of the peer's region (which needs `REMOTE_ATOMIC`): if they equal
    /// `compare` they become `swap`. Returns the value before the operation. Executed
    /// exactly once however often the request is retransmitted.
    pub async fn compare_swap(
        &self,
        remote: RemoteRegion,
        remote_offset: u64,
        compare: u64,
        swap: u64,
    ) -> Result<u64, Error> {
        self.atomic(
            remote,
            remote_offset,
            AtomicOp::CompareSwap { compare, swap },
        )
        .await
    }

    /// Atomic fetch-and-add (wrapping) on the 8 bytes at `remote_offset` of the peer's
    /// region. Returns the value before the addition. Executed exactly once.
    pub async fn fetch_add(
        &self,
        remote: RemoteRegion,
        remote_offset: u64,
        add: u64,
    ) -> Result<u64, Error> {
        self.atomic(remote, remote_offset, AtomicOp::FetchAdd { add })
            .await
    }

    /// Post a receive buffer `dst[range]` (`dst` needs `Access::LOCAL_WRITE`) on stream
    /// `stream` and wait until a message lands in it. Once a receive has been posted on a
    /// stream, its messages go to posted receives in order (not to the `MessageStream`), and
    /// a message arriving when none is posted is refused with an RNR NAK and retried by the
    /// sender. Resolves with the receive completion (`byte_len` = message length); a message
    /// longer than the buffer is `Err` with `LocalLengthError`.
    pub async fn recv_into(
        &self,
        stream: u32,
        dst: &MemoryRegion,
        range: Range<u64>,
    ) -> Result<WorkCompletion, Error> {
        if !Arc::ptr_eq(&dst.ep().shared, self.shared()) {
            return Err(Error::ForeignRegion);
        }
        let len = range
            .end
            .checked_sub(range.start)
            .ok_or(Error::Memory(metaroce::MrError::OutOfBounds))?;
        let len = u32::try_from(len).map_err(|_| {
            Error::Post(PostError::MessageTooLarge {
                len,
                max: u32::MAX as u64,
            })
        })?;
        let (lkey, offset) = (dst.keys().lkey, range.start);
        let h = self.inner.handle;
        self.run_op(move |core, wr_id| {
            core.post_recv(
                h,
                stream,
                RecvRequest {
                    wr_id,
                    lkey,
                    offset,
                    len,
                },
            )
        })
        .await
    }

    /// Send one message on stream `stream` and wait for its completion (all packets
    /// acknowledged). [`MessageStream`]'s `Sink` is the pipelined way to send.
    ///
    /// `data` is not copied: the connection keeps this reference-counted [`bytes::Bytes`]
    /// (immutable, so later changes to the caller's buffers cannot reach it) until the
    /// message is acknowledged.
    ///
    /// # Errors
    /// [`Error::Post`] if the core refuses it (too large, not connected),
    /// [`Error::Completion`] for a failed completion (RNR retry exceeded, flushed),
    /// [`Error::ConnectionLost`] once the connection ended.
    ///
    /// # Cancel safety
    /// Posted at the future's first poll (with the send queue full, at the first poll that
    /// finds room); dropping the future before that posts nothing, dropping it after that
    /// does **not** cancel the SEND — it is still delivered, only its work completion is
    /// discarded.
    pub async fn send(&self, stream: u32, data: bytes::Bytes) -> Result<WorkCompletion, Error> {
        let h = self.inner.handle;
        self.run_op(move |core, wr_id| core.post_send(h, stream, wr_id, data.clone()))
            .await
    }

    /// Close the connection gracefully with an application `code` and `reason` (at most
    /// [`MAX_CLOSE_REASON`](metaroce::MAX_CLOSE_REASON) bytes are sent; longer reasons are
    /// cut): new operations fail at once with `ConnectionLost(LocallyClosed)`, operations
    /// already posted drain for at most `transport.close_timeout` (default 2 s) and then
    /// fail with `WrFlushError`; the peer's handles end with
    /// `ClosedByPeer { code, reason }`, this side's with `LocallyClosed`
    /// ([`closed`](Self::closed) resolves once the drain is over).
    pub fn close(&self, code: u32, reason: &[u8]) {
        let shared = self.shared();
        shared.lock().close_conn(self.inner.handle, code, reason);
        shared.wake_driver.notify_one();
    }
}
