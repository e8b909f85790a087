//! # RoCEv2-compatible mode (async)
//!
//! [`RcEndpoint`] drives a sans-IO [`metaroce::rocev2::RcEndpoint`] (standard RC queue
//! pairs, interoperable with Linux `rdma_rxe` and RNICs) from a tokio task over an
//! [`IpBackend`] — normally [`RawIpBackend`], raw IPv4 sockets, which need `CAP_NET_RAW`.
//!
//! ```no_run
//! use metaroce::rocev2::{ConnectAttrs, QpInit, RcConfig};
//! use metaroce::Access;
//! use metaroce_tokio::rocev2::RcEndpoint;
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let ip = "10.77.0.1".parse()?;
//! let ep = RcEndpoint::bind_raw(ip, RcConfig::new(ip.into()))?;
//! let mr = ep.register(vec![0; 4096], Access::LOCAL_WRITE);
//! let qp = ep.create_qp(QpInit::default())?;
//! // ... exchange qp.qpn()/qp.psn() with the peer out of band, then:
//! qp.connect(ConnectAttrs::new("10.77.0.2".parse()?, 0x11, 0x1234))?;
//! qp.post_recv(1, mr.lkey, 0, 4096)?;
//! qp.send(mr.lkey, 0, 64, None).await?;
//! let wc = qp.recv().await?;
//! # Ok(()) }
//! ```
#![allow(clippy::too_many_arguments)]

mod backend;
mod udp;

pub use backend::{IpBackend, MemoryLink, RawIpBackend, NEED_CAP_NET_RAW};
pub use metaroce::rocev2::{
    Completion, ConnectAttrs, MrKeys, QpInfo, QpInit, QpState, QpStats, RcConfig, RcError, RcEvent,
    RcOpcode, RcStats, RecvWr, SendOp, SendWr,
};
pub use udp::{UdpIpBackend, UdpIpStats};

use metaroce::{Access, MrError, WcStatus};
use std::collections::HashMap;
use std::fmt;
use std::future::poll_fn;
use std::io;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use tokio::sync::{mpsc, oneshot, Notify};

/// Errors of the async RoCEv2 API.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The call was refused by the core; nothing was posted.
    Post(RcError),
    /// The work request completed with an error status.
    Completion(Completion),
    /// The endpoint's driver stopped (or the QP was destroyed).
    Closed,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Post(e) => write!(f, "work request refused: {e}"),
            Error::Completion(c) => write!(
                f,
                "work request {} ({:?}) failed: {} ({})",
                c.wr_id,
                c.opcode,
                c.status,
                c.status.ibv_code()
            ),
            Error::Closed => f.write_str("endpoint closed"),
        }
    }
}

impl std::error::Error for Error {}

impl From<RcError> for Error {
    fn from(e: RcError) -> Self {
        Error::Post(e)
    }
}

struct State {
    core: metaroce::rocev2::RcEndpoint,
    waiters: HashMap<(u32, u64), oneshot::Sender<Completion>>,
    recv_tx: HashMap<u32, mpsc::UnboundedSender<Completion>>,
    next_wr_id: u64,
    closed: bool,
}

struct Shared {
    state: Mutex<State>,
    wake: Notify,
    backend: Arc<dyn IpBackend>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Stops the driver when the last user handle goes away.
struct Owner(Arc<Shared>);

impl Drop for Owner {
    fn drop(&mut self) {
        self.0.lock().closed = true;
        self.0.wake.notify_one();
    }
}

/// An async host of RC queue pairs (see the [module docs](self)). Cloning is cheap; the
/// driver task stops when every clone, QP and handle is dropped.
#[derive(Clone)]
pub struct RcEndpoint {
    owner: Arc<Owner>,
}

impl fmt::Debug for RcEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RcEndpoint")
            .field("backend", &self.owner.0.backend)
            .finish()
    }
}

impl RcEndpoint {
    /// Bind raw sockets on `local` (needs `CAP_NET_RAW`; see [`RawIpBackend`]) and start
    /// the driver. `cfg.local_ip` is replaced by `local`. Must run inside a tokio runtime.
    pub fn bind_raw(local: Ipv4Addr, mut cfg: RcConfig) -> io::Result<Self> {
        let backend = RawIpBackend::bind(local)?;
        cfg.local_ip = local.into();
        Self::with_backend(Arc::new(backend), cfg)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
    }

    /// Start an endpoint over any backend (`cfg.local_ip` is replaced by the backend's).
    pub fn with_backend(backend: Arc<dyn IpBackend>, mut cfg: RcConfig) -> Result<Self, RcError> {
        cfg.local_ip = backend.local_ip();
        let core = metaroce::rocev2::RcEndpoint::new(cfg)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                core,
                waiters: HashMap::new(),
                recv_tx: HashMap::new(),
                next_wr_id: 1 << 48,
                closed: false,
            }),
            wake: Notify::new(),
            backend,
        });
        tokio::spawn(run(shared.clone()));
        Ok(Self {
            owner: Arc::new(Owner(shared)),
        })
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.owner.0
    }

    /// Register a memory region.
    pub fn register(&self, data: Vec<u8>, access: Access) -> MrKeys {
        self.shared().lock().core.register_mr(data, access)
    }

    /// Copy bytes out of a region.
    pub fn read_mr(&self, lkey: u32, offset: u64, len: u64) -> Result<Vec<u8>, MrError> {
        self.shared()
            .lock()
            .core
            .mr_read(lkey, offset, len)
            .map(<[u8]>::to_vec)
    }

    /// Copy bytes into a region.
    pub fn write_mr(&self, lkey: u32, offset: u64, data: &[u8]) -> Result<(), MrError> {
        let mut st = self.shared().lock();
        let dst = st.core.mr_write(lkey, offset, data.len() as u64)?;
        dst.copy_from_slice(data);
        Ok(())
    }

    /// Endpoint counters.
    pub fn stats(&self) -> RcStats {
        self.shared().lock().core.stats()
    }

    /// Create a QP.
    pub fn create_qp(&self, init: QpInit) -> Result<QueuePair, RcError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut st = self.shared().lock();
        let info = st.core.create_qp(init)?;
        st.recv_tx.insert(info.qpn, tx);
        Ok(QueuePair {
            ep: self.clone(),
            info,
            recv_rx: tokio::sync::Mutex::new(rx),
        })
    }
}

/// An RC queue pair of an async [`RcEndpoint`].
pub struct QueuePair {
    ep: RcEndpoint,
    info: QpInfo,
    recv_rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<Completion>>,
}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("info", &self.info)
            .finish()
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        let mut st = self.ep.shared().lock();
        st.core.destroy_qp(self.info.qpn);
        st.recv_tx.remove(&self.info.qpn);
        let qpn = self.info.qpn;
        st.waiters.retain(|(q, _), _| *q != qpn);
    }
}

impl QueuePair {
    /// Local QPN.
    pub fn qpn(&self) -> u32 {
        self.info.qpn
    }

    /// Initial send PSN (the peer's `rq_psn`).
    pub fn psn(&self) -> u32 {
        self.info.psn
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &RcEndpoint {
        &self.ep
    }

    /// Connect to the peer (INIT → RTS).
    pub fn connect(&self, attrs: ConnectAttrs) -> Result<(), RcError> {
        self.ep
            .shared()
            .lock()
            .core
            .connect_qp(self.info.qpn, attrs)?;
        self.ep.shared().wake.notify_one();
        Ok(())
    }

    /// State of the QP.
    pub fn state(&self) -> Option<QpState> {
        self.ep.shared().lock().core.qp_state(self.info.qpn)
    }

    /// Counters of the QP.
    pub fn stats(&self) -> Option<QpStats> {
        self.ep.shared().lock().core.qp_stats(self.info.qpn)
    }

    /// Post a receive buffer.
    pub fn post_recv(&self, wr_id: u64, lkey: u32, offset: u64, len: u32) -> Result<(), RcError> {
        self.ep.shared().lock().core.post_recv(
            self.info.qpn,
            RecvWr {
                wr_id,
                lkey,
                offset,
                len,
            },
        )?;
        self.ep.shared().wake.notify_one();
        Ok(())
    }

    /// The next receive completion (any status).
    pub async fn recv(&self) -> Result<Completion, Error> {
        self.recv_rx.lock().await.recv().await.ok_or(Error::Closed)
    }

    /// Post a send work request; its `wr_id` is replaced by an internal one. The returned
    /// future resolves with the completion (any status).
    pub fn post(
        &self,
        mut wr: SendWr,
    ) -> Result<impl std::future::Future<Output = Result<Completion, Error>>, Error> {
        let (tx, rx) = oneshot::channel();
        {
            let mut st = self.ep.shared().lock();
            st.next_wr_id += 1;
            wr.wr_id = st.next_wr_id;
            st.core.post_send(self.info.qpn, wr)?;
            st.waiters.insert((self.info.qpn, wr.wr_id), tx);
        }
        self.ep.shared().wake.notify_one();
        Ok(async move { rx.await.map_err(|_| Error::Closed) })
    }

    /// Post and wait; a non-success completion is an [`Error::Completion`].
    pub async fn execute(&self, wr: SendWr) -> Result<Completion, Error> {
        let c = self.post(wr)?.await?;
        if c.status == WcStatus::Success {
            Ok(c)
        } else {
            Err(Error::Completion(c))
        }
    }

    /// SEND `len` bytes from `lkey` at `offset` (with immediate data).
    pub async fn send(
        &self,
        lkey: u32,
        offset: u64,
        len: u32,
        imm: Option<u32>,
    ) -> Result<Completion, Error> {
        self.execute(wr(SendOp::Send { imm }, lkey, offset, len))
            .await
    }

    /// RDMA WRITE `len` bytes from `lkey` at `offset` to `remote_addr`/`rkey`.
    pub async fn write(
        &self,
        lkey: u32,
        offset: u64,
        len: u32,
        remote_addr: u64,
        rkey: u32,
        imm: Option<u32>,
    ) -> Result<Completion, Error> {
        self.execute(wr(
            SendOp::Write {
                remote_addr,
                rkey,
                imm,
            },
            lkey,
            offset,
            len,
        ))
        .await
    }

    /// RDMA READ `len` bytes from `remote_addr`/`rkey` into `lkey` at `offset`.
    pub async fn read(
        &self,
        lkey: u32,
        offset: u64,
        len: u32,
        remote_addr: u64,
        rkey: u32,
    ) -> Result<Completion, Error> {
        self.execute(wr(SendOp::Read { remote_addr, rkey }, lkey, offset, len))
            .await
    }

    /// ATOMIC compare-and-swap; returns the original remote value (also written
    /// little-endian to `lkey` at `offset`).
    pub async fn compare_swap(
        &self,
        lkey: u32,
        offset: u64,
        remote_addr: u64,
        rkey: u32,
        compare: u64,
        swap: u64,
    ) -> Result<u64, Error> {
        let op = SendOp::CompareSwap {
            remote_addr,
            rkey,
            compare,
            swap,
        };
        self.execute(wr(op, lkey, offset, 8)).await?;
        self.atomic_result(lkey, offset)
    }

    /// ATOMIC fetch-and-add; returns the original remote value.
    pub async fn fetch_add(
        &self,
        lkey: u32,
        offset: u64,
        remote_addr: u64,
        rkey: u32,
        add: u64,
    ) -> Result<u64, Error> {
        let op = SendOp::FetchAdd {
            remote_addr,
            rkey,
            add,
        };
        self.execute(wr(op, lkey, offset, 8)).await?;
        self.atomic_result(lkey, offset)
    }

    fn atomic_result(&self, lkey: u32, offset: u64) -> Result<u64, Error> {
        let b = self
            .ep
            .read_mr(lkey, offset, 8)
            .map_err(|e| Error::Post(RcError::LocalMemory(e)))?;
        let mut a = [0u8; 8];
        a.copy_from_slice(&b);
        Ok(u64::from_le_bytes(a))
    }
}

fn wr(op: SendOp, lkey: u32, local_offset: u64, len: u32) -> SendWr {
    SendWr {
        wr_id: 0,
        op,
        lkey,
        local_offset,
        len,
        solicited: false,
    }
}

/// Packets gathered under one lock before they are sent.
const TX_BATCH: usize = 64;
const RECV_BUF: usize = 1 << 16;

async fn run(shared: Arc<Shared>) {
    let mut rbuf = vec![0u8; RECV_BUF];
    let mut payload = Vec::with_capacity(RECV_BUF);
    let mut out: Vec<(std::net::IpAddr, Vec<u8>)> = Vec::with_capacity(TX_BATCH);
    loop {
        let deadline;
        {
            let mut st = shared.lock();
            let now = Instant::now();
            if st.core.poll_timeout().is_some_and(|t| t <= now) {
                st.core.handle_timeout(now);
            }
            while out.len() < TX_BATCH {
                let Some(t) = st.core.poll_transmit(now, &mut payload) else {
                    break;
                };
                let mut pkt = Vec::with_capacity(t.size + 28);
                if t.write_ip_packet(&payload[..t.size], &mut pkt).is_ok() {
                    out.push((t.destination.ip(), pkt));
                }
            }
            dispatch(&mut st);
            if st.closed && out.is_empty() {
                return;
            }
            deadline = st.core.poll_timeout();
        }
        let full = out.len() == TX_BATCH;
        for (dst, pkt) in out.drain(..) {
            if let Err(e) = poll_fn(|cx| shared.backend.poll_send(cx, &pkt, dst)).await {
                tracing::debug!(error = %e, %dst, "rocev2 send failed");
            }
        }
        if full {
            tokio::task::yield_now().await;
            continue;
        }
        let sleep = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = poll_fn(|cx| shared.backend.poll_recv(cx, &mut rbuf)) => match r {
                Ok(n) => {
                    let mut st = shared.lock();
                    let now = Instant::now();
                    st.core.handle_ip_packet(now, &rbuf[..n]);
                    // Take whatever else is queued without waiting.
                    let waker = futures::task::noop_waker();
                    let mut cx = std::task::Context::from_waker(&waker);
                    for _ in 0..64 {
                        match shared.backend.poll_recv(&mut cx, &mut rbuf) {
                            std::task::Poll::Ready(Ok(n)) => st.core.handle_ip_packet(now, &rbuf[..n]),
                            _ => break,
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "rocev2 receive failed");
                    if e.kind() == io::ErrorKind::BrokenPipe {
                        // Memory link closed: keep serving timers only.
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    }
                }
            },
            _ = sleep => {}
            _ = shared.wake.notified() => {}
        }
    }
}

fn dispatch(st: &mut State) {
    while let Some(ev) = st.core.poll_event() {
        match ev {
            RcEvent::Completion(c) if c.is_recv() => {
                if let Some(tx) = st.recv_tx.get(&c.qpn) {
                    let _ = tx.send(c);
                }
            }
            RcEvent::Completion(c) => {
                if let Some(tx) = st.waiters.remove(&(c.qpn, c.wr_id)) {
                    let _ = tx.send(c);
                }
            }
            RcEvent::QpError { qpn, status } => {
                tracing::debug!(qpn, %status, "QP entered the error state");
            }
            _ => {}
        }
    }
}
