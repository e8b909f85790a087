//! A connection to one peer: many ordered message streams, one-sided operations.

use crate::endpoint::{EndpointRef, OpDone, Shared, Waiter};
use crate::error::Error;
use crate::mr::{remote_addr, MemoryRegion, RemoteRegion};
use crate::stream::{MessageStream, SharedRx, StreamEntry};
use crate::Endpoint;
use metaroce::fasthash::HashMap;
use metaroce::{
    AtomicOp, AtomicRequest, ConnectionError, ConnectionHandle, ConnectionStats, PostError,
    ReadRequest, RecvRequest, WcStatus, WorkCompletion, WriteRequest,
};
use std::collections::VecDeque;
use std::future::Future;
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
    /// What was delivered and not yet taken when the connection ended, handed out by
    /// `accept_stream`, `recv_imm` and `take_cancelled_recv` afterwards (freed with the
    /// last `Connection` handle).
    pub leftover: std::sync::Mutex<Leftover>,
}

/// Deliveries the application had not taken when its connection ended: the peer saw them
/// acknowledged (`Success`), so they are not dropped with the driver's entry. Bounded as
/// they were in it.
#[derive(Debug, Default)]
pub(crate) struct Leftover {
    /// Peer-opened streams not accepted yet, with their received messages.
    streams: VecDeque<(u32, SharedRx)>,
    /// WRITE-with-immediate notifications not taken yet.
    imms: VecDeque<(u32, u32)>,
    /// Messages that landed in the buffers of dropped `recv_into`s, not taken yet.
    cancelled_recvs: VecDeque<CancelledRecv>,
}

impl ConnSignals {
    pub fn reason(&self) -> Option<ConnectionError> {
        self.status.borrow().clone()
    }

    fn leftover(&self) -> std::sync::MutexGuard<'_, Leftover> {
        self.leftover.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Per-connection routing state kept by the driver; removed (with everything in it) when
/// the connection ends.
pub(crate) struct ConnEntry {
    pub streams: HashMap<u32, StreamEntry>,
    /// Peer-opened streams not yet taken by `accept_stream` (ids; at most the core's
    /// `max_streams`, each id once).
    pub accept_queue: VecDeque<u32>,
    /// Streams whose sink waits in `poll_ready` for the connection's unacknowledged SEND
    /// bytes to fall below `Config::connection_send_buffer` (a stream's id leaves with its
    /// handle): woken by the driver once they have (`driver::release_send_bound`).
    pub send_blocked: metaroce::fasthash::HashSet<u32>,
    /// Streams with a `Connection::send` waiting for a byte bound (woken through
    /// `sq_space`).
    pub send_waits: metaroce::fasthash::HashSet<u32>,
    /// This connection is in `State::send_bound` (a sink or a `Connection::send` waits for
    /// a byte bound).
    pub in_send_bound: bool,
    /// `core.send_bytes_finished` when the driver last looked at the waits above.
    pub send_freed_seen: u64,
    /// WRITE-with-immediate notifications `(imm, byte_len)` not yet taken by `recv_imm`
    /// (8 bytes each; no data). Bounded by the core: at most
    /// `2 × transport.max_unconsumed_immediates` (see its docs); beyond the cap the peer's
    /// WRITEs with immediate wait with flow-control RNR NAKs.
    pub imm_queue: VecDeque<(u32, u32)>,
    pub signals: Arc<ConnSignals>,
    pub next_stream: u32,
    /// Messages that landed in the buffer of a `recv_into` whose future was dropped
    /// (`Connection::take_cancelled_recv`); at most one per posted receive.
    pub cancelled_recvs: VecDeque<CancelledRecv>,
}

impl ConnEntry {
    pub fn new() -> ConnEntry {
        ConnEntry {
            // Keyed by the peer's stream ids: a secret key per connection (fasthash docs).
            streams: HashMap::with_hasher(metaroce::fasthash::FastState::random()),
            accept_queue: VecDeque::new(),
            // Ids are the application's own streams; keyed all the same.
            send_blocked: metaroce::fasthash::HashSet::with_hasher(
                metaroce::fasthash::FastState::random(),
            ),
            send_waits: metaroce::fasthash::HashSet::with_hasher(
                metaroce::fasthash::FastState::random(),
            ),
            in_send_bound: false,
            send_freed_seen: 0,
            imm_queue: VecDeque::new(),
            signals: Arc::new(ConnSignals {
                status: watch::Sender::new(None),
                queued: Notify::new(),
                leftover: Default::default(),
            }),
            next_stream: 0,
            cancelled_recvs: VecDeque::new(),
        }
    }

    /// The connection ended: record why, end every stream and wake every waiter; what was
    /// delivered and not yet taken moves to the handles' [`Leftover`]. The caller removes
    /// the entry (or, when the driver is gone, leaves it unused).
    pub fn on_lost(&mut self, reason: ConnectionError) {
        // The reason first: a stream's reader woken below may ask `close_reason` at once,
        // without the endpoint lock (found by review: it saw `None`).
        self.signals.status.send_replace(Some(reason.clone()));
        for s in self.streams.values_mut() {
            s.close(Error::ConnectionLost(reason.clone()));
        }
        {
            let mut left = self.signals.leftover();
            while let Some(id) = self.accept_queue.pop_front() {
                if let Some(rx) = self.streams.get_mut(&id).and_then(|s| s.pending_rx.take()) {
                    left.streams.push_back((id, rx));
                }
            }
            left.imms.extend(self.imm_queue.drain(..));
            left.cancelled_recvs.extend(self.cancelled_recvs.drain(..));
        }
        self.signals.queued.notify_waiters();
    }
}

/// Where a `recv_into` receive was posted: stream, region lkey, offset in the region.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RecvTarget {
    pub stream: u32,
    pub lkey: u32,
    pub offset: u64,
}

/// A message that landed in the buffer of a [`Connection::recv_into`] whose future was
/// dropped (or timed out) after the message had begun landing, so the receive could not
/// be withdrawn. Its bytes are in that region at `offset`, `wc.byte_len` of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CancelledRecv {
    /// The stream the receive was posted on.
    pub stream: u32,
    /// lkey of the region given to `recv_into` ([`MemoryRegion::keys`]).
    pub lkey: u32,
    /// Start of the range given to `recv_into`.
    pub offset: u64,
    /// The receive completion (`status == Success`, `byte_len` = message length).
    pub wc: WorkCompletion,
}

/// The completion of an operation whose future was dropped (`Waiter::Cancelled`), under
/// the endpoint lock.
pub(crate) fn on_cancelled_completion(
    st: &mut crate::endpoint::State,
    conn: ConnectionHandle,
    wc: WorkCompletion,
    dereg: Option<u32>,
    recv: Option<RecvTarget>,
) {
    if let Some(lkey) = dereg {
        // The core is done with the operation: nothing can write the result region now.
        // It is registered on every shard; the driver deregisters it from all of them once
        // this shard's lock is released (`Shared::deregister_everywhere`).
        st.dereg_later.push(lkey);
    }
    if let Some(r) = recv {
        report_cancelled_recv(st, conn, r, wc);
    }
}

fn report_cancelled_recv(
    st: &mut crate::endpoint::State,
    conn: ConnectionHandle,
    r: RecvTarget,
    wc: WorkCompletion,
) {
    if wc.status == WcStatus::WrFlushError {
        return; // withdrawn (or flushed): no message was received into it.
    }
    tracing::debug!(%conn, stream = r.stream, len = wc.byte_len, "message landed in a cancelled recv_into");
    if let Some(e) = st.conns.get_mut(&conn) {
        e.cancelled_recvs.push_back(CancelledRecv {
            stream: r.stream,
            lkey: r.lkey,
            offset: r.offset,
            wc,
        });
    }
}

/// A posted operation, until its completion is taken. Dropped before that (the future
/// was dropped: cancelled, timed out), it asks the core to cancel the operation and
/// leaves a `Waiter::Cancelled` so that what the operation still holds is released only
/// when the core reports it finished.
struct PendingOp<'a> {
    conn: &'a Connection,
    wr_id: u64,
    rx: Option<oneshot::Receiver<OpDone>>,
    /// The stream of a SEND (`Connection::send`).
    send_stream: Option<u32>,
    /// An atomic's result region: deregistered only once the core finished the atomic.
    result: Option<MemoryRegion>,
    recv: Option<RecvTarget>,
}

impl PendingOp<'_> {
    async fn wait(&mut self) -> Result<WorkCompletion, Error> {
        let Some(rx) = self.rx.as_mut() else {
            return Err(Error::EndpointClosed);
        };
        let done = rx.await;
        self.rx = None;
        let OpDone { wc, ended, refused } = done.map_err(|_| Error::EndpointClosed)?;
        if wc.status == WcStatus::Success {
            Ok(wc)
        } else {
            Err(completion_error(wc, ended, refused))
        }
    }
}

impl Drop for PendingOp<'_> {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        // Taken over before the lock: from here the result region is deregistered through
        // the core, never by a handle dropped under the endpoint lock.
        let dereg = self.result.take().map(MemoryRegion::detach);
        let shared = self.conn.shared();
        let conn = self.conn.inner.handle;
        let key = (conn, self.wr_id);
        let mut st = shared.lock();
        let finished = match rx.try_recv() {
            Ok(done) => {
                // Completed, but the completion was never taken.
                if let Some(r) = self.recv {
                    report_cancelled_recv(&mut st, conn, r, done.wc);
                }
                true
            }
            // No waiter: the endpoint is shutting down.
            Err(_) => st.waiters.remove(&key).is_none(),
        };
        if finished {
            drop(st);
            if let Some(lkey) = dereg {
                shared.deregister_everywhere(lkey);
            }
            return;
        }
        // Cancelled, too late, not cancellable (a SEND) or already finished with its
        // completion still queued in the core: in every case a completion follows, and
        // only then is the result region released / a received message reported.
        let now = std::time::Instant::now();
        let _ = match self.recv {
            // Only its stream is searched (O(streams) per drop otherwise).
            Some(r) => st.core.cancel_recv(now, conn, r.stream, self.wr_id),
            None => st.core.cancel(now, conn, self.wr_id),
        };
        st.waiters.insert(
            key,
            Waiter::Cancelled {
                dereg,
                recv: self.recv,
                send_stream: self.send_stream,
            },
        );
        drop(st);
        shared.wake_driver.notify_one();
    }
}

/// Most WRITEs of a [`Connection::write_batch`] posted under one hold of the endpoint lock.
const POST_CHUNK: usize = 256;

/// What the members of one [`Connection::write_batch`] share (`Waiter::Batch`): how many
/// have not completed, the first failure in posting order, and the batch's one completion.
/// Only touched under the endpoint lock; the mutex makes it `Sync`.
pub(crate) struct BatchSlot(std::sync::Mutex<BatchState>);

struct BatchState {
    remaining: usize,
    /// The failed completion with the lowest position in the batch, and that position.
    failed: Option<(usize, OpDone)>,
    /// Sent `None` (every WRITE succeeded) or the first failure, when the last completes.
    tx: Option<oneshot::Sender<Option<OpDone>>>,
}

impl BatchSlot {
    /// Member `index` completed with `wc` (under the endpoint lock); `ended`: the
    /// connection's end flushed it (see `OpDone`).
    pub(crate) fn on_completion(
        &self,
        index: usize,
        wc: WorkCompletion,
        ended: Option<ConnectionError>,
    ) {
        let mut b = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if wc.status != WcStatus::Success && b.failed.as_ref().is_none_or(|(i, _)| index < *i) {
            b.failed = Some((
                index,
                OpDone {
                    wc,
                    ended,
                    refused: None,
                },
            ));
        }
        b.remaining = b.remaining.saturating_sub(1);
        if b.remaining == 0 {
            if let Some(tx) = b.tx.take() {
                // The wr_id the application sees is the WRITE's index in the batch (the
                // driver's own ids mean nothing to it).
                let _ = tx.send(b.failed.take().map(|(i, d)| OpDone {
                    wc: WorkCompletion {
                        wr_id: i as u64,
                        ..d.wc
                    },
                    ended: d.ended,
                    refused: None,
                }));
            }
        }
    }
}

/// The error of a failed work completion: an operation flushed by its connection's end
/// (`ended`) is [`Error::ConnectionLost`] with the reason, as on a stream (a new user's
/// trial found the reason missing from flushed WRITEs); a SEND the peer refused for a full
/// stream table (`refused`, its stream) is [`Error::StreamRefused`]; any other is
/// [`Error::Completion`] — a flush by a stream's reset or stop among them (a review found
/// those misreported when the reason was looked up later).
fn completion_error(
    wc: WorkCompletion,
    ended: Option<ConnectionError>,
    refused: Option<u32>,
) -> Error {
    match (ended, refused) {
        (Some(reason), _) if wc.status == WcStatus::WrFlushError => Error::ConnectionLost(reason),
        (_, Some(stream)) if wc.status == WcStatus::RemoteInvalidRequest => {
            Error::StreamRefused { stream }
        }
        _ => Error::Completion(wc),
    }
}

/// A batch posted by [`Connection::write_batch`], until its completion is taken. Dropped
/// before that, it cancels the members that have not completed, as [`PendingOp`] does for
/// one operation.
struct PendingBatch<'a> {
    conn: &'a Connection,
    /// Work request ids of the members posted so far, in posting order.
    wr_ids: Vec<u64>,
    done: bool,
}

impl Drop for PendingBatch<'_> {
    fn drop(&mut self) {
        if self.done || self.wr_ids.is_empty() {
            return;
        }
        let shared = self.conn.shared();
        let conn = self.conn.inner.handle;
        let mut st = shared.lock();
        // Members whose waiter is gone completed already (or the endpoint shut down); the
        // others are cancelled in one pass over the send queue (one `cancel` each was
        // quadratic: 3.4 s under the endpoint lock for 60,000, found by review).
        self.wr_ids
            .retain(|&wr_id| match st.waiters.get_mut(&(conn, wr_id)) {
                Some(w) => {
                    *w = Waiter::Cancelled {
                        dereg: None,
                        recv: None,
                        send_stream: None,
                    };
                    true
                }
                None => false,
            });
        if self.wr_ids.is_empty() {
            return;
        }
        st.core
            .cancel_many(std::time::Instant::now(), conn, &self.wr_ids);
        drop(st);
        shared.wake_driver.notify_one();
    }
}

/// One RDMA WRITE of a [`Connection::write_batch`]: `src[range]` into the peer's region
/// `dst` at `dst_offset`, with an immediate when `imm` is set (as
/// [`Connection::write_with_imm`]).
#[derive(Debug, Clone)]
pub struct BatchWrite<'a> {
    /// The local source region.
    pub src: &'a MemoryRegion,
    /// Bytes of `src` to send.
    pub range: Range<u64>,
    /// The peer's region.
    pub dst: RemoteRegion,
    /// Where in `dst` the bytes land.
    pub dst_offset: u64,
    /// The immediate the peer's [`Connection::recv_imm`] reports, if any.
    pub imm: Option<u32>,
}

pub(crate) struct ConnInner {
    pub ep: Arc<EndpointRef>,
    /// The shard whose core holds this connection.
    pub shared: Arc<Shared>,
    pub handle: ConnectionHandle,
    pub signals: Arc<ConnSignals>,
    pub peer: Option<SocketAddr>,
    pub span: tracing::Span,
}

impl Drop for ConnInner {
    /// The last handle (connection or stream) is gone: close the connection (code 0).
    fn drop(&mut self) {
        if self.signals.reason().is_none() {
            let shared = &self.shared;
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
        shared: Arc<Shared>,
        handle: ConnectionHandle,
        signals: Arc<ConnSignals>,
        peer: Option<SocketAddr>,
    ) -> Connection {
        let span = tracing::debug_span!(
            parent: &shared.span,
            "connection",
            qpn = handle.0,
            peer = ?peer
        );
        Connection {
            inner: Arc::new(ConnInner {
                ep,
                shared,
                handle,
                signals,
                peer,
                span,
            }),
        }
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.inner.shared
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

    /// The error of a post the core refused with `UnknownConnection` while the driver had
    /// not yet reported the connection's end (its routing entry still there): the reason,
    /// once the driver reports it, or `EndpointClosed` when the endpoint is closing (found
    /// by review: a post right after a `close` had drained reported `EndpointClosed` on a
    /// live endpoint).
    async fn lost_late(&self) -> Error {
        if self.inner.signals.reason().is_none() && self.shared().lock().closed {
            return Error::EndpointClosed;
        }
        Error::ConnectionLost(self.closed().await)
    }

    /// Open a new stream with an id of this side's parity (the connecting side uses even
    /// ids, the accepting side odd ones, so the two never collide).
    ///
    /// Nothing is sent: the peer learns of the stream with its first message (or its
    /// finish, reset or stop), and only then offers it from
    /// [`accept_stream`](Self::accept_stream). So the side that opens a stream must send on
    /// it first; a protocol where it waits for the peer to accept the stream before
    /// sending never starts.
    ///
    /// # Errors
    /// [`Error::ConnectionLost`] once the connection ended.
    pub fn open_stream(&self) -> Result<MessageStream, Error> {
        let mut guard = self.shared().lock();
        let parity = u32::from(!guard.core.is_client(self.inner.handle));
        let st = &mut *guard;
        let Some(entry) = st.conns.get_mut(&self.inner.handle) else {
            return Err(self.lost());
        };
        // Ids of this side's parity in order, skipping those in use or closed (named
        // streams may have taken some).
        let id = loop {
            let id = entry.next_stream.wrapping_mul(2).wrapping_add(parity);
            entry.next_stream = entry.next_stream.wrapping_add(1);
            if !entry.streams.contains_key(&id) && !st.core.stream_is_closed(self.inner.handle, id)
            {
                break id;
            }
        };
        drop(guard);
        self.stream(id)
    }

    /// Open the stream with a given id (for ids both sides agree on, such as a
    /// communicator id).
    ///
    /// Stream ids are single-use per connection: once a stream is over in a direction (a
    /// finish or reset acknowledged, or the peer's end delivered and read) the connection
    /// forgets it, and its id cannot be opened again.
    ///
    /// # Errors
    /// [`Error::StreamInUse`] if it is open already (including when the peer opened it
    /// first: take it from [`accept_stream`](Self::accept_stream));
    /// [`Error::StreamClosed`] if it was used and is over;
    /// [`Error::ConnectionLost`] once the connection ended.
    pub fn stream(&self, id: u32) -> Result<MessageStream, Error> {
        let mut st = self.shared().lock();
        let closed = st.core.stream_is_closed(self.inner.handle, id);
        let Some(entry) = st.conns.get_mut(&self.inner.handle) else {
            return Err(self.lost());
        };
        if entry.streams.contains_key(&id) {
            return Err(Error::StreamInUse(id));
        }
        if closed {
            return Err(Error::StreamClosed(id));
        }
        let (e, rx) = StreamEntry::new(false);
        entry.streams.insert(id, e);
        Ok(MessageStream::new(self.inner.clone(), id, rx))
    }

    /// The next stream the peer opened (its first message is waiting in it); once the
    /// connection has ended, the streams it delivered and nobody accepted yet (their
    /// messages, then the end), then `None`.
    ///
    /// A stream the peer finished without a message is offered too (it ends at once), as
    /// long as fewer than `TransportConfig::max_streams` streams wait here; one the peer
    /// reset before sending anything (a handle dropped unused) is not offered.
    ///
    /// # Cancel safety
    /// Cancel safe: a stream is taken from the queue only when this resolves.
    pub async fn accept_stream(&self) -> Option<MessageStream> {
        let sig = self.inner.signals.clone();
        loop {
            let notified = sig.queued.notified();
            {
                let mut st = self.shared().lock();
                // Ended (also when the driver is gone and the entry stays, found by
                // review: this waited forever): what was delivered before the end.
                let entry = match st.conns.get_mut(&self.inner.handle) {
                    Some(e) if sig.reason().is_none() => e,
                    _ => {
                        let (id, rx) = sig.leftover().streams.pop_front()?;
                        return Some(MessageStream::new(self.inner.clone(), id, rx));
                    }
                };
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
    /// resolves. Once the connection has ended, the notifications it delivered and nobody
    /// took yet, then `None`.
    ///
    /// # Backpressure
    /// Notifications not taken yet are bounded by
    /// [`TransportConfig::max_unconsumed_immediates`](metaroce::TransportConfig::max_unconsumed_immediates)
    /// (default 4096): beyond it the peer's next WRITE with immediate is held back with
    /// flow-control RNR NAKs (its `write_with_imm` waits; nothing is dropped or fails) until
    /// this is called again. An application that uses WRITE with immediate must keep
    /// calling it.
    ///
    /// # Cancel safety
    /// Cancel safe: a notification is taken from the queue only when this resolves.
    pub async fn recv_imm(&self) -> Option<(u32, u32)> {
        let sig = self.inner.signals.clone();
        loop {
            let notified = sig.queued.notified();
            {
                let mut st = self.shared().lock();
                let entry = match st.conns.get_mut(&self.inner.handle) {
                    Some(e) if sig.reason().is_none() => e,
                    _ => return sig.leftover().imms.pop_front(),
                };
                if let Some(v) = entry.imm_queue.pop_front() {
                    // Room for one more: the core stops holding the peer's next WRITE
                    // with immediate back (flow-control RNR) once it is under the cap.
                    st.core.immediates_consumed(self.inner.handle, 1);
                    return Some(v);
                }
            }
            notified.await;
        }
    }

    /// Post an operation and wait for its completion, in the connection's span (qpn,
    /// peer). Dropping the future after the post cancels the operation (see [`PendingOp`]).
    async fn run_op(
        &self,
        post: impl Fn(&mut metaroce::Endpoint, u64) -> Result<(), PostError>,
    ) -> Result<WorkCompletion, Error> {
        let span = self.inner.span.clone();
        tracing::Instrument::instrument(
            async { self.post_op(&post, None, None, None).await?.wait().await },
            span,
        )
        .await
    }

    /// Post an operation; the returned [`PendingOp`] waits for (or, dropped, cancels) it.
    ///
    /// `post` is borrowed, not moved: every layer of these nested futures that takes it by
    /// value keeps a copy for the future's whole life (an 848-byte `write` future, moved
    /// into and out of a `FuturesUnordered` per WRITE; issue #13).
    async fn post_op(
        &self,
        post: &impl Fn(&mut metaroce::Endpoint, u64) -> Result<(), PostError>,
        result: Option<MemoryRegion>,
        recv: Option<RecvTarget>,
        send_stream: Option<u32>,
    ) -> Result<PendingOp<'_>, Error> {
        let shared = self.shared();
        let (wr_id, rx) = loop {
            let notified = shared.sq_space.notified();
            let gone = {
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
                        st.waiters.insert(
                            (self.inner.handle, wr_id),
                            Waiter::Op(tx, send_stream, false),
                        );
                        break (wr_id, rx);
                    }
                    Err(PostError::SendQueueFull) => {
                        st.sq_full = true;
                        // A SEND held back by a byte bound (its stream's or the
                        // connection's): the driver looks again when bytes are freed,
                        // whatever frees them (`driver::release_send_bound`).
                        let h = self.inner.handle;
                        if let Some(sid) = send_stream {
                            let cfg = &shared.cfg;
                            let over = st.core.stream_send_pending(h, sid)
                                >= cfg.stream_send_buffer as u64
                                || st.core.send_pending(h) >= cfg.connection_send_buffer as u64;
                            if over {
                                if let Some(c) = st.conns.get_mut(&h) {
                                    c.send_waits.insert(sid);
                                }
                                crate::driver::wait_send_bound(&mut st, h);
                            }
                        }
                        false
                    }
                    Err(PostError::UnknownConnection) => true,
                    Err(PostError::Closing) => {
                        return Err(Error::ConnectionLost(ConnectionError::LocallyClosed))
                    }
                    Err(e) => return Err(Error::Post(e)),
                }
            };
            if gone {
                // Boxed: the rare path's future would otherwise widen every operation's.
                return Err(Box::pin(self.lost_late()).await);
            }
            // Boxed (only a full send queue waits): a `Notified` held in the future's
            // state widened every operation's future by its size.
            Box::pin(notified).await;
        };
        shared.wake_driver.notify_one();
        Ok(PendingOp {
            conn: self,
            wr_id,
            rx: Some(rx),
            send_stream,
            result,
            recv,
        })
    }

    /// The length of `range` of a local region `mr` used by a work request of this
    /// connection: [`Error::ForeignRegion`] if `mr` was registered on another endpoint,
    /// [`Error::Memory`] (`OutOfBounds`) for a reversed range, [`Error::Post`]
    /// (`MessageTooLarge`) beyond `u32::MAX` bytes (the core then applies
    /// `TransportConfig::max_message_size`, at most 2^31 as in IBA). Bounds within the
    /// region are the core's check (lkey and offset), made when the request is posted.
    fn local_len(&self, mr: &MemoryRegion, range: &Range<u64>) -> Result<u32, Error> {
        if !Arc::ptr_eq(mr.ep(), &self.inner.ep) {
            return Err(Error::ForeignRegion);
        }
        let len = range
            .end
            .checked_sub(range.start)
            .ok_or(Error::Memory(metaroce::MrError::OutOfBounds))?;
        u32::try_from(len).map_err(|_| {
            Error::Post(PostError::MessageTooLarge {
                len,
                max: u32::MAX as u64,
            })
        })
    }

    fn write_request(
        &self,
        src: &MemoryRegion,
        range: Range<u64>,
        dst: RemoteRegion,
        dst_offset: u64,
        imm: Option<u32>,
    ) -> Result<WriteRequest, Error> {
        let len = self.local_len(src, &range)?;
        Ok(WriteRequest {
            wr_id: 0,
            lkey: src.keys().lkey,
            local_offset: range.start,
            len,
            remote_addr: remote_addr(&dst, dst_offset, u64::from(len))?,
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
    /// `src` is **not** copied at post time: each packet's bytes are read from the region
    /// when the packet is built, and again for a retransmission, so — as with verbs — leave
    /// `src[range]` unchanged until the WRITE completed, or the peer may receive a mix.
    ///
    /// # Errors
    /// [`Error::ForeignRegion`] (`src` belongs to another endpoint), [`Error::Memory`]
    /// (`range` reversed), [`Error::RemoteOutOfBounds`] (the target span is not inside
    /// `dst` as its descriptor says; nothing sent), [`Error::Post`]
    /// (longer than `max_message_size`, range outside `src`), [`Error::ConnectionLost`]
    /// (before posting, or a WRITE flushed because the connection ended: the reason is the
    /// source), [`Error::Completion`] (the work completion of a failed WRITE).
    ///
    /// # Cancel safety
    /// The WRITE is posted at the future's first poll (or, with the send queue full, at the
    /// first poll that finds room). Dropping the future before that posts nothing. Dropping
    /// it after that **cancels** the WRITE ([`metaroce::Endpoint::cancel`]): packets not
    /// sent yet are never sent, the peer is told to stop tracking the operation (an op
    /// abort), and the connection stays usable. Bytes that landed before stay; the target
    /// range's content is then undefined, as after any failed WRITE. A deadline is a
    /// timeout around the future: `tokio::time::timeout(d, conn.write(..))`.
    pub fn write<'a>(
        &'a self,
        src: &'a MemoryRegion,
        range: Range<u64>,
        dst: RemoteRegion,
        dst_offset: u64,
    ) -> impl Future<Output = Result<WorkCompletion, Error>> + 'a {
        self.write_op(src, range, dst, dst_offset, None)
    }

    /// RDMA WRITE with immediate: as [`write`](Self::write), and the peer's
    /// [`recv_imm`](Self::recv_imm) yields `(imm, len)` once all bytes have landed.
    ///
    /// # Errors
    /// As [`write`](Self::write).
    ///
    /// # Cancel safety
    /// As [`write`](Self::write); a cancelled WRITE with immediate never reports its
    /// immediate at the peer.
    pub fn write_with_imm<'a>(
        &'a self,
        src: &'a MemoryRegion,
        range: Range<u64>,
        dst: RemoteRegion,
        dst_offset: u64,
        imm: u32,
    ) -> impl Future<Output = Result<WorkCompletion, Error>> + 'a {
        self.write_op(src, range, dst, dst_offset, Some(imm))
    }

    /// [`write`](Self::write) and [`write_with_imm`](Self::write_with_imm): one WRITE,
    /// with the immediate if `imm` is set. The request is checked and built here, before
    /// the future exists, so the future holds it once (the future borrows `src` all the
    /// same, as an `async fn` would); errors come at its first poll.
    fn write_op<'a>(
        &'a self,
        src: &'a MemoryRegion,
        range: Range<u64>,
        dst: RemoteRegion,
        dst_offset: u64,
        imm: Option<u32>,
    ) -> impl Future<Output = Result<WorkCompletion, Error>> + 'a {
        let req = self.write_request(src, range, dst, dst_offset, imm);
        let h = self.inner.handle;
        async move {
            let _src = src;
            let req = req?;
            self.run_op(move |core, wr_id| core.post_write(h, WriteRequest { wr_id, ..req }))
                .await
        }
    }

    /// Posts several RDMA WRITEs at once and resolves once all of them completed: a post
    /// list with selective signaling, as `ibv_post_send` with a chain of work requests of
    /// which only the last is signaled (perftest's `--cq-mod`). One lock and one wake-up
    /// of the driver per 256 WRITEs, and one completion for the whole batch, where
    /// [`write`](Self::write) costs one of each per WRITE: for small WRITEs that
    /// per-operation cost is most of the work.
    ///
    /// The WRITEs are posted in order and complete as [`write`](Self::write)s would
    /// (placed by the peer in any order; each acknowledged once every byte landed).
    /// `Ok(())` means every one of them succeeded. An empty batch is `Ok(())` at once.
    /// Unlike a verbs QP, which a failed work request moves to the error state (flushing
    /// the rest), a WRITE the peer refuses fails alone: the others still run, and the
    /// connection stays usable.
    ///
    /// # Errors
    /// Before anything is posted, every WRITE is checked as [`write`](Self::write) and the
    /// core check it ([`Error::ForeignRegion`], [`Error::Memory`],
    /// [`Error::RemoteOutOfBounds`], and [`Error::Post`]: the source range outside its
    /// region or without the right, a length over `max_message_size`): the first bad one
    /// fails the batch and none is posted. After
    /// that:
    /// - [`Error::Completion`]: the work completion of the first WRITE of the batch, in
    ///   posting order, that failed, reported once every WRITE completed (the others may
    ///   have landed). Its `wr_id` is that WRITE's index in the batch, from 0.
    /// - [`Error::ConnectionLost`]: the connection ended (or began closing) before every
    ///   WRITE could be posted; those already posted are cancelled, as on a drop. Also
    ///   when the first failed WRITE was flushed because the connection ended, with the
    ///   reason.
    /// - [`Error::Post`]: the core refused a WRITE part-way (the region was deregistered
    ///   meanwhile, say); [`Error::EndpointClosed`].
    ///
    /// # Cancel safety
    /// WRITEs are posted from the first poll on, up to 256 per poll and as many as the
    /// send queue takes; the rest at the polls that follow or that find room. Dropping the future before it resolved **cancels** every
    /// WRITE of the batch that has not completed, as dropping [`write`](Self::write)'s
    /// future does, and posts none of those not yet posted.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use metaroce_tokio::{Access, BatchWrite, Config, Endpoint};
    /// let server = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
    /// let client = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
    /// let connecting = client.connect(server.local_addr())?;
    /// let _peer = server.accept().await.unwrap().accept()?;
    /// let conn = connecting.await?;
    /// let target = server.alloc(4096, Access::REMOTE_WRITE);
    /// let src = client.register(vec![7u8; 4096], Access::LOCAL_WRITE);
    /// // Sixteen 256-byte WRITEs, one completion.
    /// let writes = (0..16u64).map(|i| BatchWrite {
    ///     src: &src,
    ///     range: i * 256..(i + 1) * 256,
    ///     dst: target.remote(),
    ///     dst_offset: i * 256,
    ///     imm: None,
    /// });
    /// conn.write_batch(writes).await?;
    /// assert_eq!(target.read(0, 4096)?, vec![7u8; 4096]);
    /// # Ok(()) }
    /// ```
    pub async fn write_batch<'a>(
        &self,
        writes: impl IntoIterator<Item = BatchWrite<'a>>,
    ) -> Result<(), Error> {
        let reqs = writes
            .into_iter()
            .map(|w| self.write_request(w.src, w.range, w.dst, w.dst_offset, w.imm))
            .collect::<Result<Vec<_>, _>>()?;
        if reqs.is_empty() {
            return Ok(());
        }
        let span = self.inner.span.clone();
        tracing::Instrument::instrument(self.post_batch(reqs), span).await
    }

    /// [`write_batch`](Self::write_batch) once its WRITEs are checked (at least one).
    async fn post_batch(&self, reqs: Vec<WriteRequest>) -> Result<(), Error> {
        let shared = self.shared();
        let h = self.inner.handle;
        let (tx, rx) = oneshot::channel();
        let slot = Arc::new(BatchSlot(std::sync::Mutex::new(BatchState {
            remaining: reqs.len(),
            failed: None,
            tx: Some(tx),
        })));
        let mut pending = PendingBatch {
            conn: self,
            wr_ids: Vec::with_capacity(reqs.len()),
            done: false,
        };
        {
            // What the core would refuse of a WRITE itself, for all of them before any is
            // posted (found by review: a source range past the region's end, or a WRITE
            // over `max_message_size`, failed the batch after the earlier ones landed).
            let st = shared.lock();
            for req in &reqs {
                st.core.check_write(req).map_err(Error::Post)?;
            }
        }
        let mut gone = false;
        while pending.wr_ids.len() < reqs.len() {
            let notified = shared.sq_space.notified();
            let mut full = false;
            {
                let mut st = shared.lock();
                if st.closed {
                    return Err(Error::EndpointClosed);
                }
                if !st.conns.contains_key(&h) {
                    return Err(self.lost());
                }
                let before = pending.wr_ids.len();
                // At most `POST_CHUNK` under one hold of the lock: other tasks and the
                // driver get in between (60,000 at once held it 41 ms).
                let chunk = reqs.iter().enumerate().skip(before).take(POST_CHUNK);
                for (index, req) in chunk {
                    let wr_id = st.wr_id();
                    match st.core.post_write(h, WriteRequest { wr_id, ..*req }) {
                        Ok(()) => {
                            let batch = slot.clone();
                            st.waiters
                                .insert((h, wr_id), Waiter::Batch { batch, index });
                            pending.wr_ids.push(wr_id);
                        }
                        Err(PostError::SendQueueFull) => {
                            st.sq_full = true;
                            full = true;
                            break;
                        }
                        Err(PostError::UnknownConnection) => {
                            gone = true;
                            break;
                        }
                        Err(PostError::Closing) => {
                            return Err(Error::ConnectionLost(ConnectionError::LocallyClosed))
                        }
                        Err(e) => return Err(Error::Post(e)),
                    }
                }
                if pending.wr_ids.len() > before {
                    drop(st);
                    shared.wake_driver.notify_one();
                }
            }
            if gone {
                return Err(self.lost_late().await);
            }
            if full {
                notified.await;
            } else if pending.wr_ids.len() < reqs.len() {
                // A chunk posted and more to come: let the executor run other tasks too.
                tokio::task::yield_now().await;
            }
        }
        drop(slot);
        let failed = rx.await.map_err(|_| Error::EndpointClosed)?;
        pending.done = true;
        match failed {
            None => Ok(()),
            Some(OpDone { wc, ended, refused }) => Err(completion_error(wc, ended, refused)),
        }
    }

    /// RDMA READ: copy the peer's `src` region from `src_offset` into `dst[range]`
    /// (`dst` needs `Access::LOCAL_WRITE`, the peer's region `REMOTE_READ`). Resolves once
    /// every byte has landed in `dst`. A refusal is `Err(Error::Completion(wc))` with
    /// `RemoteAccessError`, and `dst` is untouched.
    ///
    /// # Errors
    /// As [`write`](Self::write); `dst` needs `LOCAL_WRITE` ([`Error::Post`] otherwise).
    ///
    /// # Cancel safety
    /// Posted at the future's first poll (with the send queue full, at the first poll that
    /// finds room). Dropping the future after that **cancels** the READ: from that moment
    /// no response byte is written into `dst` (later responses are acknowledged and
    /// discarded), so `dst[range]` is free for other use at once; what landed before the
    /// drop stays there. The request is not sent if it had not been, and the peer is told
    /// to stop tracking it.
    pub fn read<'a>(
        &'a self,
        dst: &'a MemoryRegion,
        range: Range<u64>,
        src: RemoteRegion,
        src_offset: u64,
    ) -> impl Future<Output = Result<WorkCompletion, Error>> + 'a {
        // Built before the future, as `write_op` does.
        let req = self
            .write_request(dst, range, src, src_offset, None)
            .map(|w| ReadRequest {
                wr_id: 0,
                lkey: w.lkey,
                local_offset: w.local_offset,
                len: w.len,
                remote_addr: w.remote_addr,
                rkey: w.rkey,
            });
        let h = self.inner.handle;
        async move {
            let _dst = dst;
            let req = req?;
            self.run_op(move |core, wr_id| core.post_read(h, ReadRequest { wr_id, ..req }))
                .await
        }
    }

    async fn atomic(
        &self,
        remote: RemoteRegion,
        remote_offset: u64,
        op: AtomicOp,
    ) -> Result<u64, Error> {
        let remote_addr = remote_addr(&remote, remote_offset, 8)?;
        let ep = self.endpoint();
        let result = ep.alloc(8, metaroce::Access::LOCAL_WRITE);
        let req = AtomicRequest {
            wr_id: 0,
            lkey: result.keys().lkey,
            local_offset: 0,
            remote_addr,
            rkey: remote.rkey,
            op,
        };
        let h = self.inner.handle;
        let lkey = req.lkey;
        let mut op = self
            .post_op(
                &move |core: &mut metaroce::Endpoint, wr_id| {
                    core.post_atomic(h, AtomicRequest { wr_id, ..req })
                },
                Some(result),
                None,
                None,
            )
            .await?;
        op.wait().await?;
        let result = op.result.take();
        drop(op);
        let result = result.ok_or(Error::Memory(metaroce::MrError::InvalidKey))?;
        debug_assert_eq!(result.keys().lkey, lkey);
        let b = result.read(0, 8)?;
        let mut v = [0u8; 8];
        v.copy_from_slice(&b);
        Ok(u64::from_le_bytes(v))
    }

    /// Atomic compare-and-swap on the 8 bytes (little-endian u64, 8-byte aligned) at
    /// `remote_offset` of the peer's region (which needs `REMOTE_ATOMIC`): if they equal
    /// `compare` they become `swap`. Returns the value before the operation. Executed
    /// exactly once however often the request is retransmitted.
    ///
    /// # Errors
    /// [`Error::RemoteOutOfBounds`] if the 8 bytes are not inside `remote` as its
    /// descriptor says (nothing sent); [`Error::ConnectionLost`]; [`Error::Completion`]
    /// (e.g. `RemoteAccessError`: no REMOTE_ATOMIC right, bad rkey, out of the peer's real
    /// region; `RemoteInvalidRequest`: not 8-byte aligned).
    ///
    /// # Cancel safety
    /// Dropping the future after its first poll cancels the atomic: if the request had
    /// not reached the peer it is not executed; if it had, it stays executed (its result
    /// is discarded). Either way the 8-byte result region the connection allocated for it
    /// stays registered until the core reports the atomic finished, so no response can
    /// land in freed memory.
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
    ///
    /// # Errors
    /// As [`compare_swap`](Self::compare_swap).
    ///
    /// # Cancel safety
    /// As [`compare_swap`](Self::compare_swap).
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
    ///
    /// # Errors
    /// [`Error::ForeignRegion`], [`Error::Memory`] (reversed range), [`Error::Post`]
    /// (range outside `dst`, no `LOCAL_WRITE`), [`Error::ConnectionLost`] (also when the
    /// connection ended while the receive waited, with the reason), [`Error::Completion`]
    /// (`LocalLengthError`; `WrFlushError` when the peer finished or reset the stream and
    /// every message before the end was delivered: no message will come, so a receive loop
    /// ends there).
    ///
    /// The stream stays in posted-receive mode after this future is dropped too: a later
    /// message waits (the sender retries after RNR NAKs) for the next `recv_into` on the
    /// stream; it never goes to a `MessageStream` or to
    /// [`accept_stream`](Self::accept_stream).
    ///
    /// # Cancel safety
    /// The receive is posted at the first poll. Dropping the future after that withdraws
    /// it if no message has begun landing in it: the stream's next message then goes to the
    /// next posted receive (or is refused with an RNR NAK and retried by the sender), so
    /// nothing lands in the abandoned buffer. If a message is already landing, the receive
    /// cannot be withdrawn: the message completes into `dst[range]` and is reported by
    /// [`take_cancelled_recv`](Self::take_cancelled_recv) — a message is never received
    /// silently.
    pub async fn recv_into(
        &self,
        stream: u32,
        dst: &MemoryRegion,
        range: Range<u64>,
    ) -> Result<WorkCompletion, Error> {
        let len = self.local_len(dst, &range)?;
        let (lkey, offset) = (dst.keys().lkey, range.start);
        let h = self.inner.handle;
        let target = RecvTarget {
            stream,
            lkey,
            offset,
        };
        let mut op = self
            .post_op(
                &move |core: &mut metaroce::Endpoint, wr_id| {
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
                },
                None,
                Some(target),
                None,
            )
            .await?;
        op.wait().await
    }

    /// The next message that landed in the buffer of a [`recv_into`](Self::recv_into)
    /// whose future was dropped after the message had begun landing (so its receive could
    /// not be withdrawn): the stream, the buffer (`lkey`, `offset`) and the completion.
    /// Nothing is received silently: every message a dropped `recv_into` got shows up here.
    pub fn take_cancelled_recv(&self) -> Option<CancelledRecv> {
        let sig = &self.inner.signals;
        let mut st = self.shared().lock();
        match st.conns.get_mut(&self.inner.handle) {
            Some(e) if sig.reason().is_none() => e.cancelled_recvs.pop_front(),
            _ => sig.leftover().cancelled_recvs.pop_front(),
        }
    }

    /// Send one message on stream `stream` and wait for its completion (all packets
    /// acknowledged). [`MessageStream`]'s `Sink` is the pipelined way to send.
    ///
    /// `data` is not copied: the connection keeps this reference-counted [`bytes::Bytes`]
    /// (immutable, so later changes to the caller's buffers cannot reach it) until the
    /// message is acknowledged.
    ///
    /// Bounded as the sink is: while the stream has
    /// [`Config::stream_send_buffer`](crate::Config::stream_send_buffer) bytes or more
    /// posted and not yet acknowledged (by this call or the stream's sink), or the
    /// connection has
    /// [`Config::connection_send_buffer`](crate::Config::connection_send_buffer) bytes or
    /// more over all its streams, the message waits to be posted; one message is always
    /// taken when none is pending, whatever its size.
    ///
    /// # Errors
    /// [`Error::Post`] if the core refuses it (too large, not connected),
    /// [`Error::Completion`] for a failed completion: `RnrRetryExceeded` (the stream takes
    /// posted receives and none came), `WrFlushError` (the stream was reset or stopped;
    /// the message was not delivered), `RemoteInvalidRequest` (the peer refused the
    /// message: longer than its `max_message_size` or than its posted receive).
    /// [`Error::StreamRefused`] when the peer refused the stream itself (it already kept
    /// `max_streams` streams): try again on a new stream once one ends; its `status()` is
    /// `RemoteInvalidRequest` too. [`Error::ConnectionLost`] once the connection ended,
    /// also for a SEND flushed by that end.
    ///
    /// # Cancel safety
    /// Posted at the future's first poll that finds room (in the send queue and under the
    /// stream's byte bound); dropping the future before that posts nothing, dropping it
    /// after that does **not** cancel the SEND — it is still delivered, only its work
    /// completion is discarded. So a timeout around `send` against a slow reader gives up
    /// on messages that were never posted, and the connection holds at most the bound.
    pub async fn send(&self, stream: u32, data: bytes::Bytes) -> Result<WorkCompletion, Error> {
        let h = self.inner.handle;
        let cfg = &self.shared().cfg;
        let limits = metaroce::SendLimits {
            stream: cfg.stream_send_buffer as u64,
            connection: cfg.connection_send_buffer as u64,
        };
        // The sink's bounds: a timeout around `send` in a loop against a slow reader piled
        // messages into the transport without limit (found by a new user's trial: 1.5 GiB
        // in 5 s). Checked after every other check of the post (a closing connection, a
        // finished stream, a message too large fail at once; found by review).
        let post = move |core: &mut metaroce::Endpoint, wr_id| {
            core.post_send_within(h, stream, wr_id, data.clone(), limits)
        };
        let span = self.inner.span.clone();
        tracing::Instrument::instrument(
            async {
                self.post_op(&post, None, None, Some(stream))
                    .await?
                    .wait()
                    .await
            },
            span,
        )
        .await
    }

    /// Close the connection gracefully with an application `code` and `reason` (at most
    /// [`MAX_CLOSE_REASON`](metaroce::MAX_CLOSE_REASON) bytes are sent; longer reasons are
    /// cut): new operations fail at once with `ConnectionLost(LocallyClosed)`, operations
    /// already posted drain for at most `transport.close_timeout` (default 2 s) and then
    /// are flushed (they fail with `ConnectionLost(LocallyClosed)`); the peer's handles end
    /// with
    /// `ClosedByPeer { code, reason }`, this side's with `LocallyClosed`
    /// ([`closed`](Self::closed) resolves once the drain is over).
    pub fn close(&self, code: u32, reason: &[u8]) {
        let shared = self.shared();
        shared.lock().close_conn(self.inner.handle, code, reason);
        shared.wake_driver.notify_one();
        // Operations waiting for room fail now (`Closing`), not after the drain.
        shared.sq_space.notify_waiters();
    }
}

#[cfg(test)]
mod connection_bound_tests {
    use crate::{Config, Endpoint};
    use bytes::Bytes;
    use futures::SinkExt;
    use std::time::Duration;

    /// Streams that wait on the connection-wide bound and are dropped while it stays full
    /// (a request with a timeout against a peer that does not read) leave nothing behind in
    /// `ConnEntry::send_blocked`: it holds at most one id per live stream handle.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn streams_dropped_while_waiting_on_the_connection_bound_are_forgotten() {
        const MSG: usize = 32 << 10;
        let mut cfg = Config {
            connection_send_buffer: 256 << 10,
            ..Config::default()
        };
        cfg.transport.max_stream_recv_bytes = 64 << 10;
        let server = Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg.clone())
            .await
            .unwrap();
        let client = Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg)
            .await
            .unwrap();
        let connecting = client.connect(server.local_addr()).unwrap();
        let _s = server.accept().await.unwrap().accept().unwrap();
        let c = connecting.await.unwrap();
        // The peer never reads: one stream fills the connection's bound.
        let mut a = c.open_stream().unwrap();
        while tokio::time::timeout(
            Duration::from_millis(300),
            a.feed(Bytes::from(vec![1u8; MSG])),
        )
        .await
        .is_ok()
        {}
        // Requests with a timeout: each stream waits on the bound, then is dropped.
        for _ in 0..1000 {
            let mut r = c.open_stream().unwrap();
            let waited =
                tokio::time::timeout(Duration::from_millis(1), r.feed(Bytes::from_static(b"q")))
                    .await;
            assert!(waited.is_err(), "the bound did not hold");
        }
        let blocked = c
            .inner
            .shared
            .lock()
            .conns
            .get(&c.inner.handle)
            .map_or(0, |e| e.send_blocked.len());
        assert!(
            blocked <= 1,
            "{blocked} ids of dropped streams in send_blocked"
        );
        drop(a);
    }
}
