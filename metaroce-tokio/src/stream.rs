//! Message streams: `futures::Stream` of received messages and `futures::Sink<Bytes>` of
//! messages to send, on one stream id of a connection.

use crate::connection::ConnInner;
use crate::endpoint::{State, Waiter};
use crate::error::Error;
use bytes::Bytes;
use futures::{Sink, Stream};
use metaroce::{ConnectionHandle, PostError};
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

/// How the receive side of a stream ended.
#[derive(Debug, Clone)]
pub(crate) enum RxEnd {
    /// The peer finished the stream: `None` after the last message.
    Finished,
    /// An error to report once (reset by the peer, connection lost), then `None`.
    Error(Error),
    /// Reported already.
    Done,
}

/// Received messages of one stream waiting for its reader. Shared by the driver (which
/// pushes under the endpoint lock, then this one) and the [`MessageStream`] (which pops
/// under this lock alone).
#[derive(Debug, Default)]
pub(crate) struct RxQueue {
    pub queue: VecDeque<Bytes>,
    /// Bytes in `queue`.
    pub bytes: usize,
    pub end: Option<RxEnd>,
    pub waker: Option<Waker>,
    /// Set when the connection ended with every SEND posted on the stream completed and
    /// none failed: a `poll_flush` then has nothing left to fail (the driver's entry, which
    /// counts the SENDs in flight, is gone by the time the writer looks).
    pub sends_settled: bool,
}

pub(crate) type SharedRx = Arc<Mutex<RxQueue>>;

pub(crate) fn lock_rx(rx: &SharedRx) -> MutexGuard<'_, RxQueue> {
    rx.lock().unwrap_or_else(|e| e.into_inner())
}

impl RxQueue {
    pub fn push(&mut self, data: Bytes) {
        self.bytes += data.len();
        self.queue.push_back(data);
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }

    /// End the receive side (the first end wins).
    pub fn end(&mut self, end: RxEnd) {
        if self.end.is_none() {
            self.end = Some(end);
        }
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }
}

/// Driver-side state of one stream.
pub(crate) struct StreamEntry {
    /// Where received messages go.
    pub rx: SharedRx,
    /// Whether a reader exists or will (`false` after the `MessageStream` was dropped:
    /// later messages are discarded).
    pub has_reader: bool,
    /// The receiver of a peer-opened stream until `accept_stream` takes it.
    pub pending_rx: Option<SharedRx>,
    /// Messages posted on this stream and not yet completed.
    pub in_flight: usize,
    /// The first failed completion, reported by the next sink call.
    pub error: Option<Error>,
    /// The peer stopped the stream ([`Error::StreamStopped`]) or refused it
    /// ([`Error::StreamRefused`]): messages posted before that and not delivered fail with
    /// it, and so does every later `poll_ready`; a `poll_flush` whose messages were all
    /// delivered succeeds.
    pub stopped: Option<Error>,
    /// The task waiting in `poll_ready` / `poll_flush`.
    pub waker: Option<Waker>,
    /// Both directions are over in the core ([`metaroce::Event::StreamClosed`]): the entry
    /// goes when the handle does.
    pub closed: bool,
}

impl StreamEntry {
    /// An entry and its receive queue; `incoming` keeps the queue in `pending_rx` for
    /// `accept_stream`.
    pub fn new(incoming: bool) -> (StreamEntry, SharedRx) {
        let rx: SharedRx = Arc::default();
        (
            StreamEntry {
                rx: rx.clone(),
                has_reader: true,
                pending_rx: incoming.then(|| rx.clone()),
                in_flight: 0,
                error: None,
                stopped: None,
                waker: None,
                closed: false,
            },
            rx,
        )
    }

    /// A message arrived for this stream. Returns the bytes to report consumed at once
    /// (the reader is gone: the message is discarded).
    pub fn deliver(&mut self, data: Bytes) -> Option<u64> {
        if self.has_reader {
            lock_rx(&self.rx).push(data);
            None
        } else {
            Some(data.len() as u64)
        }
    }

    pub fn close(&mut self, err: Error) {
        let mut q = lock_rx(&self.rx);
        q.sends_settled = self.in_flight == 0 && self.error.is_none();
        q.end(RxEnd::Error(err.clone()));
        drop(q);
        if self.error.is_none() {
            self.error = Some(err);
        }
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }

    pub fn on_completion(&mut self, result: Option<Error>) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if let (Some(e), None) = (result, &self.error) {
            // A SEND flushed because the peer stopped the stream fails with the stop.
            self.error = Some(self.stopped.clone().unwrap_or(e));
        }
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }
}

/// One ordered message stream of a connection.
///
/// As a [`Stream`], it yields every message the peer sent on this stream exactly once and
/// in order as `Ok(bytes)`; when the peer finishes the stream it ends (`None`) after the
/// last message; if the stream is reset or the connection ends first, it yields one
/// `Err` saying why (for a dead peer, `ConnectionLost(IdleTimeout)` or
/// `ConnectionLost(RetryExceeded)`), then `None`. Received messages wait until read in a
/// buffer bounded per stream by `transport.max_stream_recv_bytes` and per connection by
/// `transport.max_recv_buffer_bytes` (see [`Config`](crate::Config)); a reader that does
/// not read holds its peer's sender back through the protocol.
///
/// As a [`Sink<Bytes>`], each item is one message; `poll_ready` waits while
/// `max_stream_in_flight` messages or
/// [`Config::stream_send_buffer`](crate::Config::stream_send_buffer) bytes of this stream,
/// or [`Config::connection_send_buffer`](crate::Config::connection_send_buffer) bytes of
/// the whole connection, are unacknowledged (a peer that does not read stops acknowledging
/// once its receive buffer is full; a message readied by `poll_ready` is always taken by
/// `start_send`, so the connection may go past its bound by one message per stream),
/// `poll_flush` waits until every
/// message sent so far is acknowledged by the peer (and succeeds if they all were, even
/// when the connection ended right after), `poll_close` flushes and then
/// finishes the stream, and a failed message surfaces as the error of the next sink call
/// (statuses as for [`Connection::send`](crate::Connection::send); a stream opened while
/// the peer keeps `max_streams` streams fails its first message with
/// [`Error::StreamRefused`], so a service that opens a stream per request keeps fewer than
/// the peer's limit open at once). Sending after `poll_close` is [`Error::StreamClosed`]. Use
/// [`futures::StreamExt::split`] for independent halves.
///
/// The stream keeps its connection open. Dropping it without `poll_close` resets its send
/// side with [`RESET_ON_DROP`] (the peer's reader sees [`Error::StreamReset`]) and, if the
/// peer has not ended its side, asks the peer to stop sending (its sink sees
/// [`Error::StreamStopped`]); later messages for it are discarded. [`reset`](Self::reset)
/// and [`stop`](Self::stop) do the same with a code of your choice.
///
/// # Cancel safety
/// - Reading (`StreamExt::next`): cancel safe. A message leaves the stream's queue only
///   in the poll that returns it; a dropped `next()` loses nothing.
/// - Sending (`SinkExt::send`, `feed`): the message is handed to the transport in
///   `start_send`, after `poll_ready`. A `send` future dropped before that (while
///   `poll_ready` waits for room) sends nothing and reports nothing: the message is gone
///   with the future. Dropped after, the message is still delivered, in order, and a
///   failure shows as the error of the next sink call; only the wait for the peer's
///   acknowledgement (`poll_flush`) was abandoned. To know whether a message went out,
///   await `poll_ready` first (`SinkExt` has no `ready()`; use
///   `std::future::poll_fn(|cx| stream.poll_ready_unpin(cx))`, which is cancel safe), then
///   call `start_send_unpin` (it does not wait), and flush separately:
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # use metaroce_tokio::{Bytes, Config, Endpoint};
/// use metaroce_tokio::futures::SinkExt;
/// use std::time::Duration;
/// # let server = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
/// # let client = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
/// # let connecting = client.connect(server.local_addr())?;
/// # let _peer = server.accept().await.unwrap().accept()?;
/// # let conn = connecting.await?;
/// let mut tx = conn.open_stream()?;
/// let msg = Bytes::from_static(b"request");
/// // Wait for room with a deadline: on timeout nothing was sent, and `msg` is still ours.
/// let ready = std::future::poll_fn(|cx| tx.poll_ready_unpin(cx));
/// match tokio::time::timeout(Duration::from_secs(1), ready).await {
///     Ok(r) => {
///         r?;
///         tx.start_send_unpin(msg)?; // handed to the transport: it will be delivered
///     }
///     Err(_) => { /* not sent: retry `msg` later */ }
/// }
/// # Ok(()) }
/// ```
/// - `poll_close`: cancel safe in the same way as `poll_flush`; the stream is finished
///   once it returns `Ready`.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use bytes::Bytes;
/// use futures::{SinkExt, StreamExt};
/// use metaroce_tokio::{Config, Endpoint};
/// let server = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
/// let client = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
/// let connecting = client.connect(server.local_addr())?;
/// let peer = server.accept().await.unwrap().accept()?;
/// let conn = connecting.await?;
/// let mut tx = conn.open_stream()?;
/// tx.send(Bytes::from_static(b"one")).await?; // resolves once acknowledged
/// let mut rx = peer.accept_stream().await.unwrap();
/// assert_eq!(&rx.next().await.unwrap()?[..], b"one");
/// # Ok(()) }
/// ```
pub struct MessageStream {
    conn: Arc<ConnInner>,
    id: u32,
    rx: SharedRx,
    /// `poll_close` finished the send side.
    send_closed: bool,
}

impl std::fmt::Debug for MessageStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageStream")
            .field("conn", &self.conn.handle)
            .field("id", &self.id)
            .finish()
    }
}

impl MessageStream {
    pub(crate) fn new(conn: Arc<ConnInner>, id: u32, rx: SharedRx) -> Self {
        Self {
            conn,
            id,
            rx,
            send_closed: false,
        }
    }

    /// The stream id.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Reset the send side with an application `code`: SENDs not yet acknowledged are
    /// flushed (their errors surface no more), the peer's reader yields
    /// [`Error::StreamReset`] with `code` after the messages before them, and later sends
    /// fail with [`Error::StreamClosed`].
    pub fn reset(&mut self, code: u32) {
        self.send_closed = true;
        let shared = &self.conn.shared;
        reset(&mut shared.lock(), self.handle(), self.id, code);
        shared.wake_driver.notify_one();
    }

    /// Ask the peer to stop sending on this stream with an application `code` (QUIC
    /// STOP_SENDING, RFC 9000 §3.5): its sink fails with [`Error::StreamStopped`], it
    /// resets the stream with the same code, and this side's reader then yields
    /// [`Error::StreamReset`] after the messages received before the call (those already
    /// buffered here; nothing that arrives after the call is yielded — it is discarded).
    ///
    /// Both ends agree on what was delivered: every message the reader yields, before or
    /// after the call, counts as delivered at the peer (its SEND completes `Success`, so
    /// its `send`/`poll_flush` succeeds), and every SEND the peer reports as failed by the
    /// stop ([`Error::StreamStopped`], or `WrFlushError` from `Connection::send`) was never
    /// yielded here. So a peer may safely retry exactly the messages that failed. Only the
    /// first call has an effect. Non-blocking; no cancel-safety concerns.
    ///
    /// A stream stopped before any message of it arrived is forgotten without waiting for
    /// the peer's reset once this side's sending on it is over (finished or reset and
    /// acknowledged): a peer that refused the stream (its `max_streams` streams open) may
    /// never answer. The reader then yields [`Error::StreamClosed`] instead.
    pub fn stop(&mut self, code: u32) {
        let shared = &self.conn.shared;
        stop(&mut shared.lock(), self.handle(), self.id, code);
        shared.wake_driver.notify_one();
    }

    /// Bytes received and waiting to be read.
    pub fn buffered_bytes(&self) -> usize {
        lock_rx(&self.rx).bytes
    }

    fn handle(&self) -> ConnectionHandle {
        self.conn.handle
    }

    fn lost(&self, st: &State) -> Error {
        if st.closed {
            return Error::EndpointClosed;
        }
        match self.conn.signals.reason() {
            Some(r) => Error::ConnectionLost(r),
            None => Error::EndpointClosed,
        }
    }

    /// Poll until the stream entry satisfies `ready`, registering the waker otherwise.
    fn poll_entry(
        &self,
        cx: &mut Context<'_>,
        fail_if_stopped: bool,
        ready: impl Fn(&StreamEntry, usize) -> bool,
    ) -> Poll<Result<(), Error>> {
        let shared = &self.conn.shared;
        let max = shared.cfg.max_stream_in_flight.max(1);
        let mut st = shared.lock();
        if st.closed {
            return Poll::Ready(Err(Error::EndpointClosed));
        }
        let lost = self.lost(&st);
        let Some(entry) = st.stream_mut(self.handle(), self.id) else {
            return Poll::Ready(Err(lost));
        };
        if let Some(e) = entry.error.take() {
            return Poll::Ready(Err(e));
        }
        if let (true, Some(e)) = (fail_if_stopped, &entry.stopped) {
            return Poll::Ready(Err(e.clone()));
        }
        if ready(entry, max) {
            return Poll::Ready(Ok(()));
        }
        entry.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl Stream for MessageStream {
    type Item = Result<Bytes, Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let mut q = lock_rx(&self.rx);
        if let Some(m) = q.queue.pop_front() {
            q.bytes -= m.len();
            drop(q);
            // The bytes leave the core's receive budget: a sender held back by flow
            // control may go on.
            let shared = &self.conn.shared;
            let mut st = shared.lock();
            st.core
                .stream_consumed(self.handle(), self.id, m.len() as u64);
            // Whatever that lets the core send (a credit update, a held ACK whose timer
            // is due) leaves from here, or the driver is woken for it.
            crate::driver::transmit_inline(shared, st);
            return Poll::Ready(Some(Ok(m)));
        }
        match q.end.replace(RxEnd::Done) {
            Some(RxEnd::Error(e)) => Poll::Ready(Some(Err(e))),
            Some(RxEnd::Finished) | Some(RxEnd::Done) => Poll::Ready(None),
            None => {
                q.end = None;
                q.waker = Some(cx.waker().clone());
                drop(q);
                // The reader goes back to waiting without having answered: an ACK held
                // for a reply (`max_ack_delay`) leaves now. Else a `send().await` at the
                // peer that nothing answers waited for the delay rounded up to tokio's
                // 1 ms timer (1.2 ms for the 100 µs default; found by a new user's trial).
                let shared = &self.conn.shared;
                let mut st = shared.lock();
                if st.core.release_held_ack(self.handle()) {
                    crate::driver::transmit_inline(shared, st);
                }
                Poll::Pending
            }
        }
    }
}

impl Sink<Bytes> for MessageStream {
    type Error = Error;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        if self.send_closed {
            return Poll::Ready(Err(Error::StreamClosed(self.id)));
        }
        let shared = &self.conn.shared;
        let cfg = &shared.cfg;
        let (max_msgs, max_bytes) = (cfg.max_stream_in_flight.max(1), cfg.stream_send_buffer);
        let conn_max = cfg.connection_send_buffer as u64;
        let h = self.handle();
        let mut st = shared.lock();
        if st.closed {
            return Poll::Ready(Err(Error::EndpointClosed));
        }
        let lost = self.lost(&st);
        // The bytes as the core has them now: it frees a SEND's bytes when the SEND
        // finishes, which may be before its completion is reported (found by review).
        let stream_pending = st.core.stream_send_pending(h, self.id);
        let conn_pending = st.core.send_pending(h);
        // Room in the core's send queue: with completions reported per stream, a sink with
        // nothing in flight can meet a queue full of other operations (`start_send` would
        // fail with `SendQueueFull`).
        let sq_full = st.core.send_queue_full(h);
        let Some(e) = st.stream_mut(h, self.id) else {
            return Poll::Ready(Err(lost));
        };
        if let Some(err) = e.error.take() {
            return Poll::Ready(Err(err));
        }
        if let Some(err) = &e.stopped {
            return Poll::Ready(Err(err.clone()));
        }
        // The stream's bounds, and the connection-wide one (`Config::connection_send_buffer`):
        // without it, many streams each held `stream_send_buffer` behind a peer that did
        // not read (found by a new user's trial: 48 streams, 967 MiB).
        let bytes_ok = stream_pending < max_bytes as u64 && conn_pending < conn_max;
        if e.in_flight < max_msgs && bytes_ok && !sq_full {
            return Poll::Ready(Ok(()));
        }
        e.waker = Some(cx.waker().clone());
        if sq_full {
            st.sq_full = true;
            st.sq_blocked.push((h, self.id));
        }
        if !bytes_ok {
            // Woken by the driver once bytes were freed (`driver::release_send_bound`);
            // a count bound is woken by the stream's own completions.
            if let Some(c) = st.conns.get_mut(&h) {
                c.send_blocked.insert(self.id);
            }
            crate::driver::wait_send_bound(&mut st, h);
        }
        Poll::Pending
    }

    fn start_send(self: Pin<&mut Self>, item: Bytes) -> Result<(), Error> {
        if self.send_closed {
            return Err(Error::StreamClosed(self.id));
        }
        let shared = &self.conn.shared;
        let mut st = shared.lock();
        {
            let wr_id = st.wr_id();
            if let Err(e) = st.core.post_send(self.handle(), self.id, wr_id, item) {
                return Err(post_error(e, self.id, || self.lost(&st)));
            }
            st.waiters
                .insert((self.handle(), wr_id), Waiter::Stream(self.id));
            if let Some(entry) = st.stream_mut(self.handle(), self.id) {
                entry.in_flight += 1;
            }
        }
        // The message's packets leave from this task when the backend can take them now
        // (`Config::inline_transmit`); else the driver sends them.
        crate::driver::transmit_inline(shared, st);
        Ok(())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        if self.send_closed {
            return Poll::Ready(Ok(()));
        }
        match self.poll_entry(cx, false, |e, _| e.in_flight == 0) {
            // The connection ended after every message sent so far was acknowledged
            // (the close came right behind the last ACK): the flush succeeded. The next
            // `poll_ready` reports the loss.
            Poll::Ready(Err(Error::ConnectionLost(_))) if lock_rx(&self.rx).sends_settled => {
                Poll::Ready(Ok(()))
            }
            r => r,
        }
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        if self.send_closed {
            return Poll::Ready(Ok(()));
        }
        std::task::ready!(self.as_mut().poll_flush(cx))?;
        self.send_closed = true;
        let shared = &self.conn.shared;
        let mut st = shared.lock();
        let r = finish(&mut st, self.handle(), self.id).map_err(|e| {
            // The peer stopped the stream (its reader was dropped or called `stop`): say
            // so, as every other sink call does, rather than `StreamClosed`, which means
            // this side finished or reset it (found by a new user's trial).
            let stopped = st
                .stream(self.handle(), self.id)
                .and_then(|e| e.stopped.clone());
            stopped.unwrap_or_else(|| post_error(e, self.id, || self.lost(&st)))
        });
        drop(st);
        shared.wake_driver.notify_one();
        Poll::Ready(r)
    }
}

impl Drop for MessageStream {
    fn drop(&mut self) {
        let shared = &self.conn.shared;
        let mut st = shared.lock();
        if !self.send_closed {
            reset(&mut st, self.handle(), self.id, RESET_ON_DROP);
        }
        if lock_rx(&self.rx).end.is_none() {
            stop(&mut st, self.handle(), self.id, RESET_ON_DROP);
        }
        // No longer waiting for the connection's send bound (found by review: ids of
        // streams dropped while waiting piled up).
        if let Some(c) = st.conns.get_mut(&self.conn.handle) {
            c.send_blocked.remove(&self.id);
        }
        if let Some(e) = st.stream_mut(self.conn.handle, self.id) {
            e.has_reader = false;
            let closed = e.closed;
            let mut q = lock_rx(&e.rx);
            q.queue.clear();
            let unread = std::mem::take(&mut q.bytes) as u64;
            drop(q);
            st.core.stream_consumed(self.conn.handle, self.id, unread);
            if closed {
                // The core forgot the stream already: so does the driver. (Otherwise its
                // `StreamClosed`, once the reset and stop above are answered, removes it.)
                if let Some(c) = st.conns.get_mut(&self.conn.handle) {
                    c.streams.remove(&self.id);
                }
            }
        }
        drop(st);
        shared.wake_driver.notify_one();
    }
}

/// The code a stream dropped without `poll_close` is reset with (the peer sees it as
/// [`Error::StreamReset`]).
pub const RESET_ON_DROP: u32 = 0;

/// Finish the send side of a stream (the peer's reader ends after the last message).
pub(crate) fn finish(st: &mut State, conn: ConnectionHandle, stream: u32) -> Result<(), PostError> {
    st.core.finish_stream(Instant::now(), conn, stream)
}

/// Reset the send side of a stream with `code` (unsent and unacknowledged SENDs are
/// flushed; the peer's reader gets [`Error::StreamReset`] after the messages before).
pub(crate) fn reset(st: &mut State, conn: ConnectionHandle, stream: u32, code: u32) {
    // A connection that is gone or closing has nothing left to reset.
    let _ = st.core.reset_stream(Instant::now(), conn, stream, code);
}

/// Ask the peer to stop sending on a stream with `code`.
pub(crate) fn stop(st: &mut State, conn: ConnectionHandle, stream: u32, code: u32) {
    let _ = st.core.stop_stream(Instant::now(), conn, stream, code);
}

/// The one mapping of a refused post on a stream.
pub(crate) fn post_error(e: PostError, stream: u32, lost: impl FnOnce() -> Error) -> Error {
    match e {
        PostError::UnknownConnection => lost(),
        PostError::Closing => Error::ConnectionLost(metaroce::ConnectionError::LocallyClosed),
        PostError::StreamFinished { .. }
        | PostError::StreamReset { .. }
        | PostError::StreamClosed { .. } => Error::StreamClosed(stream),
        e => Error::Post(e),
    }
}
