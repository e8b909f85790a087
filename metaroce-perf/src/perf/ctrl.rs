//! The control channel a run's two sides exchange [`Ctrl`] messages on: a message stream of
//! the MetaRoCE connection, or a byte stream (TCP, or an in-process pipe in loopback) with
//! each message framed by a 4-byte big-endian length, for the RoCEv2 mode.

use super::proto::{Ctrl, MAX_FRAME};
use super::Res;
use futures::{SinkExt, StreamExt};
use metaroce_tokio::MessageStream;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// A byte stream the control messages can be framed on.
pub trait ByteStream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> ByteStream for T {}

/// One side of the control channel.
pub enum Chan {
    /// The first stream of the MetaRoCE connection.
    Stream(MessageStream),
    /// A framed byte stream and the bytes read from it that do not yet form a whole frame
    /// (kept here so that [`Chan::recv_raw`] is cancel-safe).
    Bytes(Box<dyn ByteStream>, Vec<u8>),
}

impl std::fmt::Debug for Chan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Chan::Stream(s) => f.debug_tuple("Stream").field(s).finish(),
            Chan::Bytes(..) => f.write_str("Bytes"),
        }
    }
}

impl Chan {
    /// A channel framed on byte stream `b`.
    pub fn bytes(b: impl ByteStream) -> Chan {
        Chan::Bytes(Box::new(b), Vec::new())
    }

    /// Sends `m` and waits until it is delivered (stream: acknowledged; bytes: flushed).
    pub async fn send(&mut self, m: Ctrl) -> Res<()> {
        match self {
            Chan::Stream(s) => s.send(m.encode()).await.map_err(|e| e.to_string()),
            Chan::Bytes(b, _) => write_frame(b, &m).await,
        }
        .map_err(|e| format!("sending a control message: {e}"))
    }

    /// Posts `m` without waiting for its acknowledgement (the peer's next message proves it
    /// arrived, and the peer may close right after the last one).
    pub async fn post(&mut self, m: Ctrl) -> Res<()> {
        match self {
            Chan::Stream(s) => s.feed(m.encode()).await.map_err(|e| e.to_string()),
            Chan::Bytes(b, _) => write_frame(b, &m).await,
        }
        .map_err(|e| format!("sending a control message: {e}"))
    }

    /// The next raw message; `None` when the channel ended (or sent a frame longer than
    /// [`MAX_FRAME`]). Cancel-safe: dropping the future loses no bytes, so it can be one
    /// branch of a `select!` that waits for the peer's failure report.
    pub async fn recv_raw(&mut self) -> Option<Vec<u8>> {
        match self {
            // The stream's end — finished, reset or the connection lost — ends the channel.
            Chan::Stream(s) => s.next().await.and_then(Result::ok).map(|b| b.to_vec()),
            Chan::Bytes(b, buf) => loop {
                if let Some(head) = buf.get(..4) {
                    let len = u32::from_be_bytes(head.try_into().ok()?) as usize;
                    if len > MAX_FRAME {
                        return None;
                    }
                    if buf.len() >= 4 + len {
                        let v = buf[4..4 + len].to_vec();
                        buf.drain(..4 + len);
                        return Some(v);
                    }
                }
                let mut chunk = [0u8; 4096];
                // `read` is cancel-safe: bytes are only taken when it completes.
                let n = b.read(&mut chunk).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            },
        }
    }

    /// The next message from the server (client side): an ERROR becomes `Err`.
    pub async fn recv(&mut self) -> Res<Ctrl> {
        let msg = self
            .recv_raw()
            .await
            .ok_or("the control channel to the server ended")?;
        match Ctrl::decode(&msg) {
            Some(Ctrl::Error(text)) => Err(format!("the server reported an error: {text}")),
            Some(m) => Ok(m),
            None => Err("malformed control message from the server".into()),
        }
    }

    /// Waits until the server says something in the middle of a round, when it should say
    /// nothing: its report of a failure on its side (or the channel ending); returns the
    /// error to end the run with. Cancel-safe, for one branch of a client's `select!`.
    pub async fn peer_failure(&mut self) -> String {
        match self.recv().await {
            Err(e) => e,
            Ok(m) => format!("unexpected control message from the server during a round: {m:?}"),
        }
    }

    /// Waits (at most `limit`) until the peer closes the channel, discarding what arrives.
    pub async fn linger(&mut self, limit: Duration) {
        let _ =
            tokio::time::timeout(limit, async { while self.recv_raw().await.is_some() {} }).await;
    }
}

async fn write_frame(b: &mut Box<dyn ByteStream>, m: &Ctrl) -> Result<(), String> {
    let body = m.encode();
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    b.write_all(&frame).await.map_err(|e| e.to_string())?;
    b.flush().await.map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn framed_round_trip() {
        let (a, b) = tokio::io::duplex(1024);
        let (mut a, mut b) = (Chan::bytes(a), Chan::bytes(b));
        a.send(Ctrl::Done {
            check_len: 1,
            ops: 2,
        })
        .await
        .unwrap();
        a.post(Ctrl::Bye).await.unwrap();
        assert_eq!(
            b.recv().await.unwrap(),
            Ctrl::Done {
                check_len: 1,
                ops: 2
            }
        );
        assert_eq!(b.recv().await.unwrap(), Ctrl::Bye);
        b.post(Ctrl::Error("no".into())).await.unwrap();
        assert_eq!(
            a.recv().await.unwrap_err(),
            "the server reported an error: no"
        );
        drop(b);
        assert!(a.recv_raw().await.is_none());
    }

    #[tokio::test]
    async fn recv_raw_is_cancel_safe() {
        let (mut w, r) = tokio::io::duplex(1024);
        let mut r = Chan::bytes(r);
        let body = Ctrl::Bye.encode();
        let mut frame = (body.len() as u32).to_be_bytes().to_vec();
        frame.extend_from_slice(&body);
        // Half a frame arrives, the receive is dropped (as a losing select! branch is).
        w.write_all(&frame[..3]).await.unwrap();
        let wait = std::time::Duration::from_millis(20);
        assert!(tokio::time::timeout(wait, r.recv_raw()).await.is_err());
        w.write_all(&frame[3..]).await.unwrap();
        assert_eq!(r.recv().await.unwrap(), Ctrl::Bye);
    }
}
