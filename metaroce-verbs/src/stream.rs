//! SEND/RECV of one RC QP as an ordered message stream: `Stream` of received messages and
//! `Sink` of messages to send, with up to `send_slots` SENDs in flight.

use crate::qp::{Message, OpFuture, RcQp};
use crate::{Error, Result};
use bytes::Bytes;
use futures::stream::FuturesOrdered;
use futures::{Sink, Stream, StreamExt};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

type RecvFut = Pin<Box<dyn Future<Output = Result<Message>> + Send>>;

/// An ordered message stream over an [`RcQp`]'s SEND/RECV (RC delivers in order, exactly
/// once). As a `Stream` it yields received [`Message`]s (an error item ends it: once the
/// QP is in ERR every later receive is flushed); as a `Sink<Bytes>` it posts SENDs,
/// `poll_ready` waiting while `send_slots` are in flight, `poll_flush` until every SEND
/// posted so far completed successfully (the first failed completion is returned as the
/// error).
///
/// Messages larger than the QP's `slot_size` are refused with
/// [`Error::InvalidArgument`].
pub struct MessageStream {
    qp: RcQp,
    inflight: FuturesOrdered<OpFuture>,
    recv: Option<RecvFut>,
    window: usize,
    /// Messages accepted by `start_send` while no slot was free (at most one).
    backlog: VecDeque<Bytes>,
}

impl std::fmt::Debug for MessageStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageStream")
            .field("qp", &self.qp)
            .field("inflight", &self.inflight.len())
            .finish()
    }
}

impl MessageStream {
    /// A stream over `qp` (which may still be used directly; receives are shared).
    pub fn new(qp: RcQp) -> MessageStream {
        let window = qp.config().send_slots as usize;
        MessageStream {
            qp,
            inflight: FuturesOrdered::new(),
            recv: None,
            window,
            backlog: VecDeque::new(),
        }
    }

    /// The QP.
    pub fn qp(&self) -> &RcQp {
        &self.qp
    }

    fn poll_one(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        match self.inflight.poll_next_unpin(cx) {
            Poll::Ready(Some(r)) => Poll::Ready(r.and_then(|wc| wc.ok()).map(|_| ())),
            Poll::Ready(None) => Poll::Ready(Ok(())),
            Poll::Pending => Poll::Pending,
        }
    }

    fn push_backlog(&mut self) -> Result<bool> {
        while let Some(m) = self.backlog.front() {
            match self.qp.post_send(m, None) {
                Ok(f) => {
                    self.backlog.pop_front();
                    self.inflight.push_back(f);
                }
                Err(Error::SendQueueFull) => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }
}

impl Stream for MessageStream {
    type Item = Result<Message>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.recv.is_none() {
            let qp = self.qp.clone();
            self.recv = Some(Box::pin(async move { qp.recv().await }));
        }
        let r = self.recv.as_mut().expect("set above").as_mut().poll(cx);
        match r {
            Poll::Ready(r) => {
                self.recv = None;
                match r {
                    Err(Error::Closed) => Poll::Ready(None),
                    r => Poll::Ready(Some(r)),
                }
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Sink<Bytes> for MessageStream {
    type Error = Error;
    fn poll_ready(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        loop {
            if !self.push_backlog()? {
                // Slots are held by SENDs of other users of the QP or ours: wait for ours.
                if self.inflight.is_empty() {
                    // Only other users hold them; yield and retry.
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
            } else if self.inflight.len() < self.window {
                return Poll::Ready(Ok(()));
            }
            match self.poll_one(cx) {
                Poll::Ready(Ok(())) => continue,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
    fn start_send(mut self: Pin<&mut Self>, item: Bytes) -> Result<()> {
        if item.len() > self.qp.config().slot_size as usize {
            return Err(Error::InvalidArgument(format!(
                "message of {} bytes exceeds slot_size {}",
                item.len(),
                self.qp.config().slot_size
            )));
        }
        self.backlog.push_back(item);
        self.push_backlog().map(|_| ())
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        loop {
            self.push_backlog()?;
            if self.inflight.is_empty() && self.backlog.is_empty() {
                return Poll::Ready(Ok(()));
            }
            if self.inflight.is_empty() {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            match self.poll_one(cx) {
                Poll::Ready(Ok(())) => continue,
                other => return other,
            }
        }
    }
    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.poll_flush(cx)
    }
}
