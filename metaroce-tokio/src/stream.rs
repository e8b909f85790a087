//! Message streams: `futures::Stream` of received messages and `futures::Sink<Bytes>` of
//! messages to send, on one stream id of a connection.

use crate::endpoint::{EndpointRef, Waiter};
use crate::error::Error;
use bytes::Bytes;
use futures::{Sink, Stream};
use metaroce::{ConnectionHandle, PostError};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use tokio::sync::mpsc;

/// Driver-side state of one stream.
pub(crate) struct StreamEntry {
    /// Where received messages go; `None` once the connection ended.
    pub tx: Option<mpsc::UnboundedSender<Bytes>>,
    /// The receiver of a peer-opened stream until `accept_stream` takes it.
    pub pending_rx: Option<mpsc::UnboundedReceiver<Bytes>>,
    /// Messages posted on this stream and not yet completed.
    pub in_flight: usize,
    /// The first failed completion, reported by the next sink call.
    pub error: Option<Error>,
    /// The task waiting in `poll_ready` / `poll_flush`.
    pub waker: Option<Waker>,
}

impl StreamEntry {
    pub fn new() -> (StreamEntry, mpsc::UnboundedReceiver<Bytes>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (
            StreamEntry {
                tx: Some(tx),
                pending_rx: None,
                in_flight: 0,
                error: None,
                waker: None,
            },
            rx,
        )
    }

    /// An entry for a stream the peer opened: the receiver waits for `accept_stream`.
    pub fn incoming() -> StreamEntry {
        let (mut e, rx) = Self::new();
        e.pending_rx = Some(rx);
        e
    }

    pub fn close(&mut self, err: Error) {
        self.tx = None;
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
            self.error = Some(e);
        }
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }
}

/// One ordered message stream of a connection.
///
/// As a [`Stream`], it yields every message the peer sent on this stream exactly once and
/// in order, and ends when the connection ends. As a [`Sink<Bytes>`], each item is one
/// message; `poll_ready` waits while `max_stream_in_flight` messages are unacknowledged,
/// `poll_flush` waits until every message sent so far is acknowledged by the peer, and a
/// failed message surfaces as the error of the next sink call. Use
/// [`futures::StreamExt::split`] for independent halves.
pub struct MessageStream {
    ep: Arc<EndpointRef>,
    conn: ConnectionHandle,
    id: u32,
    rx: mpsc::UnboundedReceiver<Bytes>,
}

impl std::fmt::Debug for MessageStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageStream")
            .field("conn", &self.conn)
            .field("id", &self.id)
            .finish()
    }
}

impl MessageStream {
    pub(crate) fn new(
        ep: Arc<EndpointRef>,
        conn: ConnectionHandle,
        id: u32,
        rx: mpsc::UnboundedReceiver<Bytes>,
    ) -> Self {
        Self { ep, conn, id, rx }
    }

    /// The stream id.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Poll until the stream entry satisfies `ready`, registering the waker otherwise.
    fn poll_entry(
        &self,
        cx: &mut Context<'_>,
        ready: impl Fn(&crate::stream::StreamEntry, usize) -> bool,
    ) -> Poll<Result<(), Error>> {
        let shared = &self.ep.shared;
        let max = shared.cfg.max_stream_in_flight.max(1);
        let mut st = shared.lock();
        if st.closed {
            return Poll::Ready(Err(Error::EndpointClosed));
        }
        let Some(entry) = st
            .conns
            .get_mut(&self.conn)
            .and_then(|c| c.streams.get_mut(&self.id))
        else {
            return Poll::Ready(Err(Error::EndpointClosed));
        };
        if let Some(e) = entry.error.take() {
            return Poll::Ready(Err(e));
        }
        if ready(entry, max) {
            return Poll::Ready(Ok(()));
        }
        entry.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl Stream for MessageStream {
    type Item = Bytes;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        self.rx.poll_recv(cx)
    }
}

impl Sink<Bytes> for MessageStream {
    type Error = Error;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        self.poll_entry(cx, |e, max| e.in_flight < max)
    }

    fn start_send(self: Pin<&mut Self>, item: Bytes) -> Result<(), Error> {
        let shared = &self.ep.shared;
        {
            let mut st = shared.lock();
            let wr_id = st.wr_id();
            st.core
                .post_send(self.conn, self.id, wr_id, item)
                .map_err(|e| match e {
                    PostError::UnknownConnection => Error::EndpointClosed,
                    e => Error::Post(e),
                })?;
            st.waiters
                .insert((self.conn, wr_id), Waiter::Stream(self.id));
            if let Some(entry) = st
                .conns
                .get_mut(&self.conn)
                .and_then(|c| c.streams.get_mut(&self.id))
            {
                entry.in_flight += 1;
            }
        }
        shared.wake_driver.notify_one();
        Ok(())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        self.poll_entry(cx, |e, _| e.in_flight == 0)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        self.poll_flush(cx)
    }
}
