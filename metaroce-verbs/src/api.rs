//! The `metaroce::api` traits over verbs: [`VerbsEndpoint`] (a device, a PD and a TCP
//! listener for the out-of-band exchange), [`VerbsConnection`] (one RC QP plus the
//! exchange's TCP stream kept as the control channel) and [`VerbsStream`].
//!
//! * Streams: many ordered streams share the QP's SEND queue. Every message is a
//!   SEND_WITH_IMM whose immediate is the stream id; bit 31 set marks the zero-length SEND
//!   that finishes the stream. The connecting side opens even ids, the accepting side odd
//!   ones. The first message of an unknown id announces a stream to `accept_stream`. RC
//!   delivers in order, so each stream stays ordered.
//! * Each stream's receive queue holds at most `recv_slots` messages; when one is full the
//!   connection's receive loop waits, so the QP's receives are not reposted and the peer
//!   meets RNR NAKs: backpressure instead of unbounded buffering. With the default
//!   [`QpConfig::rnr_retry`] (6) a queue left full for longer than 6 of the reader's RNR
//!   timers ([`QpConfig::min_rnr_timer`]) fails the writer's SEND with
//!   `RnrRetryExceeded`; set `rnr_retry` 7 (retry forever, IBA 9.7.5.2.8) for unbounded
//!   backpressure; a dead peer is then still caught by the TCP control channel. A reader that waits on one stream while another's queue is full
//!   blocks both (one SEND queue, as in any RC stream multiplexing).
//! * At most [`QpConfig::max_streams`] streams are open at once; a peer that opens more
//!   gets the connection closed with [`CLOSE_STREAM_LIMIT`].
//! * WRITE_WITH_IMM notices go to [`RdmaConnection::recv_imm`].
//! * Close: a record on the TCP channel (`u32` code, `u16` reason length, reason, all
//!   big-endian) then the QP to ERR (outstanding work requests flush). EOF without a record
//!   reads as `ClosedByPeer { code: 0, reason: "" }`.

use crate::exchange;
use crate::qp::{QpConfig, RcQp};
use crate::{Context, Error, Mr, OpFuture, Pd, Result};
use bytes::Bytes;
use futures::stream::FuturesOrdered;
use futures::{Sink, Stream, StreamExt};
use metaroce::api::{LocalRegion, OpError, RdmaConnection, RdmaEndpoint, RemoteRegion};
use metaroce::fasthash::HashMap;
use metaroce::{Access, ConnectionError, WcStatus, WorkCompletion};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::future::Future;
use std::net::SocketAddr;
use std::ops::Range;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context as TaskCx, Poll};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Notify};

const FIN: u32 = 1 << 31;

/// Close code sent when the peer opened more than [`QpConfig::max_streams`] streams
/// (reason `"stream limit exceeded"`).
pub const CLOSE_STREAM_LIMIT: u32 = 0x5354_4c4d;

impl OpError for Error {
    fn wc_status(&self) -> Option<WcStatus> {
        match self {
            Error::Completion { status, .. } => Some(*status),
            _ => None,
        }
    }
    fn connection_error(&self) -> Option<ConnectionError> {
        match self {
            Error::Closed => Some(ConnectionError::LocallyClosed),
            _ => None,
        }
    }
}

fn off(v: u64, what: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::InvalidArgument(format!("{what} {v} out of range")))
}

impl LocalRegion for Mr {
    type Error = Error;
    fn len(&self) -> usize {
        Mr::len(self)
    }
    fn access(&self) -> Access {
        self.0.access()
    }
    fn remote(&self) -> RemoteRegion {
        Mr::remote(self)
    }
    fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>> {
        Mr::read(self, off(offset, "offset")?, off(len, "length")?)
    }
    fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let o = off(offset, "offset")?;
        if self.0.buf().read(o, dst) {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "read {o}+{} outside the {}-byte MR",
                dst.len(),
                self.len()
            )))
        }
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        Mr::write(self, off(offset, "offset")?, data)
    }
}

struct EpInner {
    pd: Pd,
    cfg: QpConfig,
    listener: tokio::sync::Mutex<TcpListener>,
    local: SocketAddr,
    closed: AtomicBool,
    close_notify: Notify,
    conns: Mutex<Vec<Weak<ConnInner>>>,
}

/// An endpoint on an RDMA device: connections are RC QPs set up over TCP
/// (`ibv_rc_pingpong`'s exchange, [`crate::exchange`]) on `local_addr()`.
#[derive(Clone)]
pub struct VerbsEndpoint(Arc<EpInner>);

impl std::fmt::Debug for VerbsEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsEndpoint")
            .field("local", &self.0.local)
            .finish()
    }
}

impl VerbsEndpoint {
    /// Listen for connections on TCP `addr` (port 0 picks one), with QPs made from `cfg`
    /// on a new PD of `ctx`. Must be called within a tokio runtime.
    ///
    /// # Errors
    /// [`Error::Exchange`] if the listener cannot bind, [`Error::Verbs`] for the PD.
    pub fn bind(ctx: &Context, addr: SocketAddr, cfg: QpConfig) -> Result<VerbsEndpoint> {
        let pd = ctx.alloc_pd()?;
        let std_l = std::net::TcpListener::bind(addr).map_err(Error::Exchange)?;
        std_l.set_nonblocking(true).map_err(Error::Exchange)?;
        let local = std_l.local_addr().map_err(Error::Exchange)?;
        let listener = TcpListener::from_std(std_l).map_err(Error::Exchange)?;
        Ok(VerbsEndpoint(Arc::new(EpInner {
            pd,
            cfg,
            listener: tokio::sync::Mutex::new(listener),
            local,
            closed: AtomicBool::new(false),
            close_notify: Notify::new(),
            conns: Mutex::new(Vec::new()),
        })))
    }

    /// The PD connections and regions of this endpoint use.
    pub fn pd(&self) -> &Pd {
        &self.0.pd
    }

    fn track(&self, c: &VerbsConnection) {
        let mut v = self.0.conns.lock();
        v.retain(|w| w.strong_count() > 0);
        v.push(Arc::downgrade(&c.0));
    }
}

impl RdmaEndpoint for VerbsEndpoint {
    type Connection = VerbsConnection;
    type Region = Mr;
    type Error = Error;

    fn local_addr(&self) -> SocketAddr {
        self.0.local
    }

    async fn connect(&self, addr: SocketAddr) -> Result<VerbsConnection> {
        if self.0.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        let mut tcp = TcpStream::connect(addr).await.map_err(Error::Exchange)?;
        let _ = tcp.set_nodelay(true);
        let qp = RcQp::create(&self.0.pd, self.0.cfg.clone())?;
        exchange::client(&mut tcp, &qp).await?;
        let c = VerbsConnection::start(qp, tcp, addr, true);
        self.track(&c);
        Ok(c)
    }

    async fn accept(&self) -> Option<Result<VerbsConnection>> {
        if self.0.closed.load(Ordering::Acquire) {
            return None;
        }
        let l = self.0.listener.lock().await;
        let r = tokio::select! {
            r = l.accept() => r,
            _ = self.0.close_notify.notified() => return None,
        };
        drop(l);
        let (mut tcp, peer) = match r {
            Ok(x) => x,
            Err(e) => return Some(Err(Error::Exchange(e))),
        };
        let _ = tcp.set_nodelay(true);
        let qp = match RcQp::create(&self.0.pd, self.0.cfg.clone()) {
            Ok(q) => q,
            Err(e) => return Some(Err(e)),
        };
        Some(match exchange::server(&mut tcp, &qp).await {
            Ok(_) => {
                let c = VerbsConnection::start(qp, tcp, peer, false);
                self.track(&c);
                Ok(c)
            }
            Err(e) => Err(e),
        })
    }

    fn alloc(&self, len: usize, access: Access) -> Result<Mr> {
        self.0.pd.register(vec![0u8; len], access)
    }

    fn register(&self, buf: Vec<u8>, access: Access) -> Result<Mr> {
        self.0.pd.register(buf, access)
    }

    fn close(&self, code: u32, reason: &[u8]) {
        self.0.closed.store(true, Ordering::Release);
        self.0.close_notify.notify_waiters();
        for c in self.0.conns.lock().drain(..) {
            if let Some(c) = c.upgrade() {
                VerbsConnection(c).close(code, reason);
            }
        }
    }
}

struct StreamSlot {
    tx: mpsc::Sender<Bytes>,
}

struct ConnInner {
    qp: RcQp,
    remote: SocketAddr,
    streams: Mutex<HashMap<u32, StreamSlot>>,
    incoming_rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<VerbsStream>>,
    imm_rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<(u32, u32)>>,
    next_id: AtomicU32,
    closed: watch::Sender<Option<ConnectionError>>,
    ctrl: Mutex<Option<tokio::net::tcp::OwnedWriteHalf>>,
    queue_cap: usize,
    max_streams: usize,
}

impl Drop for ConnInner {
    fn drop(&mut self) {
        let _ = self.qp.set_error();
    }
}

/// One RC QP connection (see the module docs for streams and close).
#[derive(Clone)]
pub struct VerbsConnection(Arc<ConnInner>);

impl std::fmt::Debug for VerbsConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsConnection")
            .field("qp", &self.0.qp)
            .field("remote", &self.0.remote)
            .finish()
    }
}

/// Ends every stream of a connection and marks it closed when its receive loop stops: at
/// the end of the loop (QP in ERR or gone), or when the loop's runtime shuts down and drops
/// the task, also before its first poll (the guard is made before the task and moved into
/// it). Streams waited forever when this ran only at the end of the loop (found by review,
/// 2026-12-07).
struct EndStreams(std::sync::Weak<ConnInner>);

impl Drop for EndStreams {
    fn drop(&mut self) {
        if let Some(c) = self.0.upgrade() {
            c.streams.lock().clear();
            set_closed(&c.closed, ConnectionError::LocallyClosed);
        }
    }
}

fn set_closed(tx: &watch::Sender<Option<ConnectionError>>, e: ConnectionError) -> bool {
    tx.send_if_modified(|v| {
        if v.is_none() {
            *v = Some(e);
            true
        } else {
            false
        }
    })
}

impl VerbsConnection {
    fn start(qp: RcQp, tcp: TcpStream, remote: SocketAddr, client: bool) -> VerbsConnection {
        let (mut rd, wr) = tcp.into_split();
        let (in_tx, in_rx) = mpsc::unbounded_channel();
        let (imm_tx, imm_rx) = mpsc::unbounded_channel();
        let queue_cap = qp.config().recv_slots.max(1) as usize;
        let max_streams = qp.config().max_streams as usize;
        let c = Arc::new(ConnInner {
            qp,
            remote,
            // Keyed by the peer's stream ids: a secret key per connection (fasthash docs).
            streams: Mutex::new(HashMap::with_hasher(metaroce::fasthash::FastState::random())),
            incoming_rx: tokio::sync::Mutex::new(in_rx),
            imm_rx: tokio::sync::Mutex::new(imm_rx),
            next_id: AtomicU32::new(if client { 0 } else { 1 }),
            closed: watch::channel(None).0,
            ctrl: Mutex::new(Some(wr)),
            queue_cap,
            max_streams,
        });
        // Receive loop: route SENDs to streams, WRITE_WITH_IMM notices to recv_imm.
        let weak = Arc::downgrade(&c);
        let qp = c.qp.clone();
        let ended = EndStreams(weak.clone());
        tokio::spawn(async move {
            let _ended = ended;
            while let Ok(m) = qp.recv().await {
                let Some(conn) = weak.upgrade() else { break };
                if m.is_write_imm {
                    let _ = imm_tx.send((m.imm.unwrap_or(0), m.write_len));
                    continue;
                }
                let Some(imm) = m.imm else {
                    tracing::debug!("SEND without a stream id dropped");
                    continue;
                };
                let id = imm & !FIN;
                let mut over_limit = false;
                let tx = {
                    let mut map = conn.streams.lock();
                    match map.get(&id) {
                        Some(s) => Some(s.tx.clone()),
                        None if id % 2 == u32::from(client) && map.len() >= conn.max_streams => {
                            over_limit = true;
                            None
                        }
                        None if id % 2 == u32::from(client) => {
                            // A new stream of the peer's parity.
                            let (tx, rx) = mpsc::channel(conn.queue_cap);
                            map.insert(id, StreamSlot { tx: tx.clone() });
                            let _ = in_tx.send(VerbsStream::new(conn.clone(), id, rx));
                            Some(tx)
                        }
                        None => None, // our id, stream already gone: drop
                    }
                };
                if over_limit {
                    tracing::warn!(id, "peer exceeded max_streams; closing the connection");
                    VerbsConnection(conn).close(CLOSE_STREAM_LIMIT, b"stream limit exceeded");
                    break;
                }
                drop(conn);
                if imm & FIN != 0 {
                    if let Some(c) = weak.upgrade() {
                        c.streams.lock().remove(&id);
                    }
                    continue;
                }
                if let Some(tx) = tx {
                    let _ = tx.send(m.data).await;
                }
            }
            // QP in ERR or gone: every stream ends (`_ended`).
        });
        // Control channel: the peer's close record, or EOF.
        let weak = Arc::downgrade(&c);
        tokio::spawn(async move {
            let mut hdr = [0u8; 6];
            let e = match rd.read_exact(&mut hdr).await {
                Ok(_) => {
                    let code = u32::from_be_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
                    let n = usize::from(u16::from_be_bytes([hdr[4], hdr[5]]))
                        .min(metaroce::MAX_CLOSE_REASON);
                    let mut reason = vec![0u8; n];
                    let _ = rd.read_exact(&mut reason).await;
                    ConnectionError::ClosedByPeer {
                        code,
                        reason: reason.into(),
                    }
                }
                Err(_) => ConnectionError::ClosedByPeer {
                    code: 0,
                    reason: Bytes::new(),
                },
            };
            if let Some(c) = weak.upgrade() {
                set_closed(&c.closed, e);
                let _ = c.qp.set_error();
            }
        });
        VerbsConnection(c)
    }

    /// The QP.
    pub fn qp(&self) -> &RcQp {
        &self.0.qp
    }

    fn check_open(&self) -> Result<()> {
        if self.0.closed.borrow().is_some() {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }
}

fn range_len(r: &Range<u64>) -> Result<u64> {
    r.end
        .checked_sub(r.start)
        .ok_or_else(|| Error::InvalidArgument(format!("reversed range {r:?}")))
}

fn wc_of(wc: crate::Wc) -> WorkCompletion {
    WorkCompletion {
        wr_id: 0,
        status: wc.status,
        opcode: wc.opcode,
        byte_len: wc.byte_len,
    }
}

impl RdmaConnection for VerbsConnection {
    type Region = Mr;
    type Error = Error;
    type Stream = VerbsStream;

    fn remote_addr(&self) -> Option<SocketAddr> {
        Some(self.0.remote)
    }

    fn open_stream(&self) -> Result<VerbsStream> {
        self.check_open()?;
        let id = self.0.next_id.fetch_add(2, Ordering::Relaxed);
        if id & FIN != 0 {
            return Err(Error::InvalidArgument("stream ids exhausted".into()));
        }
        let (tx, rx) = mpsc::channel(self.0.queue_cap);
        {
            let mut map = self.0.streams.lock();
            if map.len() >= self.0.max_streams {
                return Err(Error::InvalidArgument(format!(
                    "{} streams open (max_streams)",
                    map.len()
                )));
            }
            map.insert(id, StreamSlot { tx });
        }
        Ok(VerbsStream::new(self.0.clone(), id, rx))
    }

    async fn accept_stream(&self) -> Option<VerbsStream> {
        let mut rx = self.0.incoming_rx.lock().await;
        let mut closed = self.0.closed.subscribe();
        loop {
            tokio::select! {
                s = rx.recv() => return s,
                r = closed.changed() => {
                    if r.is_err() || closed.borrow().is_some() {
                        // Streams announced before the end are still handed out.
                        return rx.try_recv().ok();
                    }
                }
            }
        }
    }

    async fn write(
        &self,
        src: &Mr,
        range: Range<u64>,
        dst: RemoteRegion,
        dst_offset: u64,
    ) -> Result<WorkCompletion> {
        self.check_open()?;
        let len = range_len(&range)?;
        let wc = self
            .0
            .qp
            .write(src, range.start, len, &dst, dst_offset)
            .await?;
        Ok(wc_of(wc))
    }

    async fn write_with_imm(
        &self,
        src: &Mr,
        range: Range<u64>,
        dst: RemoteRegion,
        dst_offset: u64,
        imm: u32,
    ) -> Result<WorkCompletion> {
        self.check_open()?;
        let len = range_len(&range)?;
        let wc = self
            .0
            .qp
            .write_with_imm(src, range.start, len, &dst, dst_offset, imm)
            .await?;
        Ok(wc_of(wc))
    }

    async fn recv_imm(&self) -> Option<(u32, u32)> {
        let mut rx = self.0.imm_rx.lock().await;
        let mut closed = self.0.closed.subscribe();
        loop {
            tokio::select! {
                v = rx.recv() => return v,
                r = closed.changed() => {
                    if r.is_err() || closed.borrow().is_some() {
                        return rx.try_recv().ok();
                    }
                }
            }
        }
    }

    async fn read(
        &self,
        dst: &Mr,
        range: Range<u64>,
        src: RemoteRegion,
        src_offset: u64,
    ) -> Result<WorkCompletion> {
        self.check_open()?;
        let len = range_len(&range)?;
        let wc = self
            .0
            .qp
            .read(dst, range.start, len, &src, src_offset)
            .await?;
        Ok(wc_of(wc))
    }

    async fn compare_swap(
        &self,
        remote: RemoteRegion,
        remote_offset: u64,
        compare: u64,
        swap: u64,
    ) -> Result<u64> {
        self.check_open()?;
        self.0
            .qp
            .compare_swap(&remote, remote_offset, compare, swap)
            .await
    }

    async fn fetch_add(&self, remote: RemoteRegion, remote_offset: u64, add: u64) -> Result<u64> {
        self.check_open()?;
        self.0.qp.fetch_add(&remote, remote_offset, add).await
    }

    fn close(&self, code: u32, reason: &[u8]) {
        if !set_closed(&self.0.closed, ConnectionError::LocallyClosed) {
            return;
        }
        let reason = &reason[..reason.len().min(metaroce::MAX_CLOSE_REASON)];
        let mut rec = Vec::with_capacity(6 + reason.len());
        rec.extend_from_slice(&code.to_be_bytes());
        rec.extend_from_slice(&(reason.len() as u16).to_be_bytes());
        rec.extend_from_slice(reason);
        let w = self.0.ctrl.lock().take();
        let qp = self.0.qp.clone();
        let _ = qp.set_error();
        if let Some(mut w) = w {
            tokio::spawn(async move {
                let _ = w.write_all(&rec).await;
                let _ = w.shutdown().await;
            });
        }
    }

    async fn closed(&self) -> ConnectionError {
        let mut rx = self.0.closed.subscribe();
        loop {
            if let Some(e) = rx.borrow().clone() {
                return e;
            }
            if rx.changed().await.is_err() {
                return ConnectionError::LocallyClosed;
            }
        }
    }
}

/// One ordered message stream of a [`VerbsConnection`]: `Stream` of received messages
/// (ends after the peer finished it or the connection ended) and `Sink<Bytes>` of messages
/// to send (`poll_close` sends the FIN after every message completed).
pub struct VerbsStream {
    conn: Arc<ConnInner>,
    id: u32,
    rx: mpsc::Receiver<Bytes>,
    inflight: FuturesOrdered<OpFuture>,
    backlog: VecDeque<Bytes>,
    fin: Option<OpFuture>,
    fin_done: bool,
}

impl std::fmt::Debug for VerbsStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsStream").field("id", &self.id).finish()
    }
}

impl VerbsStream {
    fn new(conn: Arc<ConnInner>, id: u32, rx: mpsc::Receiver<Bytes>) -> VerbsStream {
        VerbsStream {
            conn,
            id,
            rx,
            inflight: FuturesOrdered::new(),
            backlog: VecDeque::new(),
            fin: None,
            fin_done: false,
        }
    }

    /// The stream id (carried as the SENDs' immediate data).
    pub fn id(&self) -> u32 {
        self.id
    }

    fn push(&mut self) -> Result<bool> {
        while let Some(m) = self.backlog.front() {
            match self.conn.qp.post_send(m, Some(self.id)) {
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

    fn drain(&mut self, cx: &mut TaskCx<'_>) -> Poll<Result<()>> {
        loop {
            self.push()?;
            if self.inflight.is_empty() && self.backlog.is_empty() {
                return Poll::Ready(Ok(()));
            }
            if self.inflight.is_empty() {
                // Other streams hold every send slot: retry soon.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            match self.inflight.poll_next_unpin(cx) {
                Poll::Ready(Some(r)) => {
                    r.and_then(|wc| wc.ok())?;
                }
                Poll::Ready(None) => {}
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl Stream for VerbsStream {
    type Item = Result<Bytes>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskCx<'_>) -> Poll<Option<Result<Bytes>>> {
        self.rx.poll_recv(cx).map(|o| o.map(Ok))
    }
}

impl Sink<Bytes> for VerbsStream {
    type Error = Error;
    fn poll_ready(mut self: Pin<&mut Self>, cx: &mut TaskCx<'_>) -> Poll<Result<()>> {
        if self.fin.is_some() || self.fin_done {
            return Poll::Ready(Err(Error::InvalidArgument(
                "stream already finished".into(),
            )));
        }
        let window = self.conn.qp.config().send_slots as usize;
        while self.inflight.len() + self.backlog.len() >= window {
            self.push()?;
            match self.inflight.poll_next_unpin(cx) {
                Poll::Ready(Some(r)) => {
                    r.and_then(|wc| wc.ok())?;
                }
                Poll::Ready(None) => break,
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }
    fn start_send(mut self: Pin<&mut Self>, item: Bytes) -> Result<()> {
        if self.conn.closed.borrow().is_some() {
            return Err(Error::Closed);
        }
        if item.len() > self.conn.qp.config().slot_size as usize {
            return Err(Error::InvalidArgument(format!(
                "message of {} bytes exceeds slot_size {}",
                item.len(),
                self.conn.qp.config().slot_size
            )));
        }
        self.backlog.push_back(item);
        self.push().map(|_| ())
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut TaskCx<'_>) -> Poll<Result<()>> {
        self.drain(cx)
    }
    fn poll_close(mut self: Pin<&mut Self>, cx: &mut TaskCx<'_>) -> Poll<Result<()>> {
        if self.fin_done {
            return Poll::Ready(Ok(()));
        }
        if self.fin.is_none() {
            match self.drain(cx) {
                Poll::Ready(Ok(())) => {}
                other => return other,
            }
            match self.conn.qp.post_send(&[], Some(self.id | FIN)) {
                Ok(f) => self.fin = Some(f),
                Err(Error::SendQueueFull) => {
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        let f = self.fin.as_mut().expect("set above");
        match Pin::new(f).poll(cx) {
            Poll::Ready(r) => {
                self.fin = None;
                self.fin_done = true;
                Poll::Ready(r.and_then(|wc| wc.ok()).map(|_| ()))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for VerbsStream {
    fn drop(&mut self) {
        self.conn.streams.lock().remove(&self.id);
    }
}
