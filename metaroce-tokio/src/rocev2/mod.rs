//! # RoCEv2-compatible mode (async)
//!
//! Standard RC queue pairs ([`QueuePair`]: `send`, `write`, `read`, `compare_swap`,
//! `fetch_add`, `post_recv`/`recv`) on either of two hosts:
//!
//! * **a MetaRoCE [`crate::Endpoint`]** ([`crate::Endpoint::create_rc_qp`]): beside its
//!   MetaRoCE connections, sharing its [`crate::MemoryRegion`]s and driver task. Over its UDP
//!   sockets a QP reaches RC QPs of other metaroce endpoints
//!   ([`QueuePair::connect_udp`]); with an [`IpBackend`] attached
//!   ([`crate::Endpoint::with_rocev2`]) also real RoCEv2 peers ([`QueuePair::connect`]).
//!   Without one, `connect` is refused with [`RcError::Unsupported`]: UDP sockets cannot send
//!   or check the ICRC over the real IP header that `rdma_rxe` and RNICs verify.
//! * **a stand-alone [`RcEndpoint`]**: drives a sans-IO [`metaroce::rocev2::RcEndpoint`]
//!   from a tokio task over an [`IpBackend`] — normally [`RawIpBackend`], raw IPv4 sockets,
//!   which need `CAP_NET_RAW` — or the [`UdpIpBackend`] adapter (plain UDP, metaroce peers
//!   only).
//!
//! [`exchange`] / [`QpExchange`] are the out-of-band step (QPN, PSN, GID, UDP port, one
//! region) in the manner of `ibv_rc_pingpong`'s TCP exchange.
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
mod exchange;
mod udp;

pub use exchange::{exchange, QpExchange};

pub use backend::{IpBackend, MemoryLink, RawIpBackend, MEMORY_LINK_QUEUE, NEED_CAP_NET_RAW};
pub use metaroce::rocev2::{
    Completion, ConnectAttrs, MrKeys, QpInfo, QpInit, QpState, QpStats, RcConfig, RcError, RcEvent,
    RcOpcode, RcStats, RcWire, RecvWr, SendOp, SendWr,
};
pub use udp::{UdpIpBackend, UdpIpStats};

use metaroce::fasthash::HashMap;
use metaroce::{Access, MrError, WcStatus};
use std::fmt;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use tokio::sync::{mpsc, oneshot, Notify};

/// Errors of the async RoCEv2 API.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The call was refused by the core; nothing was posted.
    #[error("work request refused")]
    Post(#[source] RcError),
    /// The work request completed with an error status.
    #[error(
        "work request {} ({:?}) failed: {} ({})",
        .0.wr_id,
        .0.opcode,
        .0.status,
        .0.status.ibv_code()
    )]
    Completion(Completion),
    /// The endpoint's driver stopped (or the QP was destroyed).
    #[error("endpoint closed")]
    Closed,
}

impl From<RcError> for Error {
    fn from(e: RcError) -> Self {
        Error::Post(e)
    }
}

/// Completion routing of RC QPs, kept in the driver state of whichever endpoint hosts them
/// (an [`RcEndpoint`] or a [`crate::Endpoint`]).
pub(crate) struct RcSide {
    waiters: HashMap<(u32, u64), oneshot::Sender<Completion>>,
    recv_tx: HashMap<u32, mpsc::UnboundedSender<Completion>>,
    next_wr_id: u64,
    /// The driver is gone ([`abandon`](Self::abandon)): nothing will complete.
    abandoned: bool,
}

impl RcSide {
    pub(crate) fn new() -> Self {
        Self {
            waiters: HashMap::default(),
            recv_tx: HashMap::default(),
            next_wr_id: 1 << 48,
            abandoned: false,
        }
    }

    /// The driver task was dropped before it stopped (its runtime shut down): pending
    /// operations end with [`Error::Closed`] (their senders are dropped), `recv` ends once
    /// the completions already queued are taken, and later posts are refused.
    pub(crate) fn abandon(&mut self) {
        self.abandoned = true;
        self.waiters.clear();
        self.recv_tx.clear();
    }

    /// Route one event of the core to the waiting handle.
    pub(crate) fn on_event(&mut self, ev: RcEvent) {
        match ev {
            RcEvent::Completion(c) if c.is_recv() => {
                if let Some(tx) = self.recv_tx.get(&c.qpn) {
                    let _ = tx.send(c);
                }
            }
            RcEvent::Completion(c) => {
                if let Some(tx) = self.waiters.remove(&(c.qpn, c.wr_id)) {
                    let _ = tx.send(c);
                }
            }
            RcEvent::QpError { qpn, status } => {
                tracing::debug!(qpn, %status, "QP entered the error state");
            }
            _ => {}
        }
    }

    fn forget(&mut self, qpn: u32) {
        self.recv_tx.remove(&qpn);
        self.waiters.retain(|(q, _), _| *q != qpn);
    }
}

struct State {
    core: metaroce::rocev2::RcEndpoint,
    side: RcSide,
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

/// The stand-alone host in the one driver (`crate::driver`): RC QPs over its IP backend
/// only (no datagram backend, no MetaRoCE connections).
impl crate::driver::Driven for Shared {
    type State = State;
    fn lock(&self) -> MutexGuard<'_, State> {
        Shared::lock(self)
    }
    fn datagrams(&self) -> Option<&dyn crate::backend::DatagramBackend> {
        None
    }
    fn ip(&self) -> Option<&dyn IpBackend> {
        Some(&*self.backend)
    }
    fn woken(&self) -> &Notify {
        &self.wake
    }
    fn poll_timeout(st: &State) -> Option<Instant> {
        st.core.poll_timeout()
    }
    fn handle_timeout(st: &mut State, now: Instant) {
        st.core.handle_timeout(now);
    }
    fn handle_datagram(_: &mut State, _: Instant, _: &crate::backend::RecvMeta, _: &[u8]) {}
    fn poll_transmit(_: &mut State, _: Instant, _: &mut Vec<u8>) -> Option<metaroce::Transmit> {
        None
    }
    fn handle_ip_packet(st: &mut State, now: Instant, pkt: &[u8]) {
        st.core.handle_ip_packet(now, pkt);
    }
    fn poll_ip_transmit(
        st: &mut State,
        now: Instant,
        payload: &mut Vec<u8>,
    ) -> Option<metaroce::rocev2::RcTransmit> {
        st.core.poll_transmit(now, payload)
    }
    fn dispatch(&self, st: &mut State) {
        while let Some(ev) = st.core.poll_event() {
            st.side.on_event(ev);
        }
    }
    fn may_stop(&self, st: &State) -> bool {
        st.closed
    }
    fn on_abandoned(&self) {
        let mut st = self.lock();
        st.closed = true;
        st.side.abandon();
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
    /// the driver. `cfg.local_ip` is replaced by `local`, and `cfg.seed`, if it is
    /// [`RcConfig::FIXED_SEED`] (what [`RcConfig::new`] sets), by one from the operating
    /// system (set another value for a reproducible run). Must run inside a tokio runtime.
    pub fn bind_raw(local: Ipv4Addr, mut cfg: RcConfig) -> io::Result<Self> {
        let backend = RawIpBackend::bind(local)?;
        cfg.local_ip = local.into();
        Self::with_backend(Arc::new(backend), cfg)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
    }

    /// Start an endpoint over any backend (`cfg.local_ip` is replaced by the backend's;
    /// `cfg.seed` as in [`bind_raw`](Self::bind_raw): QPNs, initial PSNs, rkeys and region
    /// addresses differ between endpoints unless a seed is set).
    ///
    /// Errors: an invalid `cfg`, or [`RcError::Unsupported`] if the operating system gives
    /// no random seed.
    pub fn with_backend(backend: Arc<dyn IpBackend>, mut cfg: RcConfig) -> Result<Self, RcError> {
        cfg.local_ip = backend.local_ip();
        if cfg.seed == RcConfig::FIXED_SEED {
            cfg.seed = getrandom::u64()
                .map_err(|_| RcError::Unsupported("no random seed from the operating system"))?;
        }
        let core = metaroce::rocev2::RcEndpoint::new(cfg)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                core,
                side: RcSide::new(),
                closed: false,
            }),
            wake: Notify::new(),
            backend,
        });
        tokio::spawn(crate::driver::run(shared.clone()));
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
        self.shared().lock().core.mr_read(lkey, offset, len)
    }

    /// Copy bytes into a region.
    pub fn write_mr(&self, lkey: u32, offset: u64, data: &[u8]) -> Result<(), MrError> {
        self.shared().lock().core.mr_write(lkey, offset, data)
    }

    /// Endpoint counters.
    pub fn stats(&self) -> RcStats {
        self.shared().lock().core.stats()
    }

    /// Create a QP. Its packets are standard RoCEv2 ([`RcWire::Native`]) through this
    /// endpoint's [`IpBackend`].
    pub fn create_qp(&self, init: QpInit) -> Result<QueuePair, RcError> {
        QueuePair::create(Host::Rc(self.clone()), init)
    }
}

impl crate::Endpoint {
    /// Create an RC queue pair (RoCEv2 mode) on this endpoint, beside its MetaRoCE
    /// connections: it uses this endpoint's memory regions (`MemoryRegion::keys()`'s lkey,
    /// rkey and addr work on both kinds) and its driver task. Connect it with
    /// [`QueuePair::connect_udp`] to an RC QP of another metaroce endpoint (through this
    /// endpoint's UDP sockets), or with [`QueuePair::connect`] to a real RoCEv2 peer
    /// (`rdma_rxe`, an RNIC) — which needs an IP backend
    /// ([`with_rocev2`](crate::Endpoint::with_rocev2)) and is otherwise refused with
    /// [`RcError::Unsupported`], because a UDP socket cannot send or check the ICRC over the
    /// real IP header. [`QueuePair::connect_to`] picks whichever the endpoint can do.
    ///
    /// Errors: [`RcError::TooManyQps`] (`max_qps` of the endpoint's RC configuration).
    ///
    /// ```no_run
    /// use metaroce::Access;
    /// use metaroce_tokio::rocev2::{exchange, QpExchange, QpInit};
    /// use metaroce_tokio::{Config, Endpoint};
    ///
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let ep = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
    /// let region = ep.alloc(1 << 20, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    /// let qp = ep.create_rc_qp(QpInit { access: Access::REMOTE_WRITE, ..QpInit::default() })?;
    /// // Tell the peer our QPN, PSN, address and region; learn theirs (ibv_rc_pingpong-style
    /// // TCP exchange).
    /// let mut tcp = tokio::net::TcpStream::connect("127.0.0.1:18515").await?;
    /// let peer = exchange(&mut tcp, &qp.exchange_info(Some(region.remote()))).await?;
    /// qp.connect_to(&peer)?;
    /// let rr = peer.region.expect("peer sent its region");
    /// qp.write(region.keys().lkey, 0, 4096, rr.addr, rr.rkey, None).await?;
    /// # Ok(()) }
    /// ```
    pub fn create_rc_qp(&self, init: QpInit) -> Result<QueuePair, RcError> {
        QueuePair::create(Host::Meta(self.clone()), init)
    }

    /// Counters of this endpoint's RC side (RC packets received, bad ICRC, malformed, no
    /// QP, sent); MetaRoCE traffic is counted in [`stats`](crate::Endpoint::stats).
    pub fn rc_stats(&self) -> RcStats {
        self.shared().lock().core.rc_stats()
    }
}

/// Where a [`QueuePair`] lives.
#[derive(Clone)]
enum Host {
    /// A stand-alone RoCEv2 endpoint (raw IP or the UDP adapter).
    Rc(RcEndpoint),
    /// A MetaRoCE endpoint (its UDP sockets).
    Meta(crate::Endpoint),
}

impl Host {
    /// Run `f` on the QP verbs and completion routing under the host's lock.
    fn with<R>(&self, f: impl FnOnce(metaroce::rocev2::RcQps<'_>, &mut RcSide) -> R) -> R {
        match self {
            Host::Rc(ep) => {
                let mut st = ep.shared().lock();
                let st = &mut *st;
                f(st.core.qps(), &mut st.side)
            }
            Host::Meta(ep) => {
                let mut st = ep.shared().lock();
                let st = &mut *st;
                f(st.core.rc(), &mut st.rc)
            }
        }
    }

    fn wake(&self) {
        match self {
            Host::Rc(ep) => ep.shared().wake.notify_one(),
            Host::Meta(ep) => ep.shared().wake_driver.notify_one(),
        }
    }
}

/// An RC queue pair of an async [`RcEndpoint`] ([`RcEndpoint::create_qp`]) or of a MetaRoCE
/// [`crate::Endpoint`] ([`crate::Endpoint::create_rc_qp`]). Dropping it destroys the QP.
pub struct QueuePair {
    host: Host,
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
        let qpn = self.info.qpn;
        self.host.with(|mut qps, side| {
            qps.destroy_qp(qpn);
            side.forget(qpn);
        });
    }
}

/// Why [`QueuePair::connect`] is refused on a [`crate::Endpoint`].
const NATIVE_ON_UDP: &str = "native RoCEv2 (rdma_rxe, RNICs) needs the ICRC over the real IP \
     header, which UDP sockets can neither send nor check: this endpoint has only UDP \
     sockets, so its QPs reach only other metaroce endpoints (QueuePair::connect_udp); for a \
     RoCEv2 peer start the endpoint with Endpoint::with_rocev2 and a RawIpBackend (raw IP, \
     CAP_NET_RAW), or use rocev2::RcEndpoint::bind_raw";

/// Why [`QueuePair::connect_udp`] is refused on an [`RcEndpoint`].
const UDP_ON_RAW: &str = "this QP belongs to an rocev2::RcEndpoint, whose backend moves whole \
     IP packets: use QueuePair::connect (over a UdpIpBackend, UdpIpBackend::set_peer names \
     the peer's UDP address), or create the QP with metaroce_tokio::Endpoint::create_rc_qp";

impl QueuePair {
    fn create(host: Host, init: QpInit) -> Result<QueuePair, RcError> {
        // Receive completions (no data: the bytes are in the application's posted
        // buffers), one per receive the application posted (at most `max_recv_wr` posted
        // at once): it grows only if the application keeps posting receives without
        // reading their completions — the CQ of verbs, which would overflow instead.
        let (tx, rx) = mpsc::unbounded_channel();
        let info = host.with(|mut qps, side| {
            let info = qps.create_qp(init)?;
            side.recv_tx.insert(info.qpn, tx);
            Ok::<_, RcError>(info)
        })?;
        Ok(QueuePair {
            host,
            info,
            recv_rx: tokio::sync::Mutex::new(rx),
        })
    }

    /// Local QPN.
    pub fn qpn(&self) -> u32 {
        self.info.qpn
    }

    /// Initial send PSN (the peer's `rq_psn`).
    pub fn psn(&self) -> u32 {
        self.info.psn
    }

    /// The stand-alone RoCEv2 endpoint hosting this QP, if that is where it lives.
    pub fn rc_endpoint(&self) -> Option<&RcEndpoint> {
        match &self.host {
            Host::Rc(ep) => Some(ep),
            Host::Meta(_) => None,
        }
    }

    /// The MetaRoCE endpoint hosting this QP, if that is where it lives.
    pub fn metaroce_endpoint(&self) -> Option<&crate::Endpoint> {
        match &self.host {
            Host::Meta(ep) => Some(ep),
            Host::Rc(_) => None,
        }
    }

    fn connect_wire(&self, attrs: ConnectAttrs, wire: RcWire) -> Result<(), RcError> {
        self.host
            .with(|mut qps, _| qps.connect_qp(self.info.qpn, attrs, wire))?;
        self.host.wake();
        Ok(())
    }

    /// Connect to the peer as a standard RoCEv2 QP (INIT → RTS, [`RcWire::Native`]).
    ///
    /// Errors: [`RcError::Unsupported`] on a [`crate::Endpoint`]'s QP (UDP sockets cannot
    /// carry RoCEv2 to a real peer; the message says what to use instead), otherwise what
    /// [`RcQps::connect_qp`](metaroce::rocev2::RcQps::connect_qp) returns.
    pub fn connect(&self, attrs: ConnectAttrs) -> Result<(), RcError> {
        match &self.host {
            Host::Meta(ep) if ep.shared().ip_backend.is_none() => {
                Err(RcError::Unsupported(NATIVE_ON_UDP))
            }
            _ => self.connect_wire(attrs, RcWire::Native),
        }
    }

    /// Connect a [`crate::Endpoint`]'s QP to the RC QP of another metaroce endpoint whose
    /// UDP address is `peer` (INIT → RTS, [`RcWire::Udp`]; `attrs.remote_ip` must be
    /// `peer`'s IP). Errors: [`RcError::Unsupported`] on an [`RcEndpoint`]'s QP, otherwise
    /// what [`RcQps::connect_qp`](metaroce::rocev2::RcQps::connect_qp) returns.
    pub fn connect_udp(&self, attrs: ConnectAttrs, peer: SocketAddr) -> Result<(), RcError> {
        let Host::Meta(ep) = &self.host else {
            return Err(RcError::Unsupported(UDP_ON_RAW));
        };
        let local_ip = crate::endpoint::local_ip_for(ep.local_addr(), peer);
        self.connect_wire(attrs, RcWire::Udp { peer, local_ip })
    }

    /// Connect to the peer described by an out-of-band [`QpExchange`] with
    /// [`ConnectAttrs::new`] defaults: native RoCEv2 ([`connect`](Self::connect)) when the
    /// host has a whole-IP-packet backend (an [`RcEndpoint`], or a [`crate::Endpoint`]
    /// started with [`with_rocev2`](crate::Endpoint::with_rocev2)), otherwise
    /// [`connect_udp`](Self::connect_udp) to `peer.udp_addr()`.
    pub fn connect_to(&self, peer: &QpExchange) -> Result<(), RcError> {
        let attrs = peer.connect_attrs();
        if self.native_capable() {
            self.connect(attrs)
        } else {
            self.connect_udp(attrs, peer.udp_addr())
        }
    }

    fn native_capable(&self) -> bool {
        match &self.host {
            Host::Rc(_) => true,
            Host::Meta(ep) => ep.shared().ip_backend.is_some(),
        }
    }

    /// What to tell the peer about this QP ([`exchange`]): QPN, initial PSN, the local IP
    /// (the GID) and UDP port packets for it go to, and optionally one region the peer may
    /// access. The address is the one [`connect_to`](Self::connect_to) uses: the IP
    /// backend's local IP and port 4791 for native RoCEv2, else the endpoint's UDP address.
    /// On a [`crate::Endpoint`] bound to the unspecified address, set `ip` to the address
    /// the peer reaches.
    pub fn exchange_info(&self, region: Option<crate::RemoteRegion>) -> QpExchange {
        let native = metaroce::wire::ROCEV2_UDP_PORT;
        let (ip, udp_port) = match &self.host {
            Host::Rc(ep) => (ep.shared().backend.local_ip(), native),
            Host::Meta(ep) => match &ep.shared().ip_backend {
                Some(ipb) => (ipb.local_ip(), native),
                None => {
                    let a = ep.local_addr();
                    (a.ip(), a.port())
                }
            },
        };
        QpExchange {
            qpn: self.info.qpn,
            psn: self.info.psn,
            ip,
            udp_port,
            region,
        }
    }

    /// State of the QP.
    pub fn state(&self) -> Option<QpState> {
        self.host.with(|qps, _| qps.qp_state(self.info.qpn))
    }

    /// Counters of the QP.
    pub fn stats(&self) -> Option<QpStats> {
        self.host.with(|qps, _| qps.qp_stats(self.info.qpn))
    }

    /// Post a receive buffer.
    pub fn post_recv(&self, wr_id: u64, lkey: u32, offset: u64, len: u32) -> Result<(), RcError> {
        let wr = RecvWr {
            wr_id,
            lkey,
            offset,
            len,
        };
        self.host
            .with(|mut qps, _| qps.post_recv(self.info.qpn, wr))?;
        self.host.wake();
        Ok(())
    }

    /// The next receive completion (any status).
    ///
    /// # Errors
    /// [`Error::Closed`] once the endpoint stopped.
    ///
    /// # Cancel safety
    /// Cancel safe: a completion is taken from the queue only when this resolves.
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
        let qpn = self.info.qpn;
        self.host.with(|mut qps, side| {
            if side.abandoned {
                return Err(Error::Closed);
            }
            side.next_wr_id += 1;
            wr.wr_id = side.next_wr_id;
            qps.post_send(qpn, wr)?;
            side.waiters.insert((qpn, wr.wr_id), tx);
            Ok::<_, Error>(())
        })?;
        self.host.wake();
        Ok(async move { rx.await.map_err(|_| Error::Closed) })
    }

    /// Post and wait; a non-success completion is an [`Error::Completion`].
    ///
    /// # Errors
    /// [`Error::Post`] if the work request is refused at post time (QP state, lkey, length),
    /// [`Error::Completion`] for a non-success completion, [`Error::Closed`] if the
    /// endpoint stopped.
    ///
    /// # Cancel safety
    /// Not cancel safe in the sense of undoing: the work request is posted at the first
    /// poll, and dropping the future afterwards does not withdraw it — it runs to its
    /// completion (RC verbs have no cancel), which is then discarded. Keep the local range
    /// untouched until the QP's later completions show it is done.
    pub async fn execute(&self, wr: SendWr) -> Result<Completion, Error> {
        let c = self.post(wr)?.await?;
        if c.status == WcStatus::Success {
            Ok(c)
        } else {
            Err(Error::Completion(c))
        }
    }

    /// SEND `len` bytes from `lkey` at `offset` (with immediate data).
    ///
    /// # Errors
    /// [`Error::Post`] if the work request is refused at post time (QP state, lkey, length),
    /// [`Error::Completion`] for a non-success completion, [`Error::Closed`] if the
    /// endpoint stopped.
    ///
    /// # Cancel safety
    /// Not cancel safe in the sense of undoing: the work request is posted at the first
    /// poll, and dropping the future afterwards does not withdraw it — it runs to its
    /// completion (RC verbs have no cancel), which is then discarded. Keep the local range
    /// untouched until the QP's later completions show it is done.
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
    ///
    /// # Errors
    /// [`Error::Post`] if the work request is refused at post time (QP state, lkey, length),
    /// [`Error::Completion`] for a non-success completion, [`Error::Closed`] if the
    /// endpoint stopped.
    ///
    /// # Cancel safety
    /// Not cancel safe in the sense of undoing: the work request is posted at the first
    /// poll, and dropping the future afterwards does not withdraw it — it runs to its
    /// completion (RC verbs have no cancel), which is then discarded. Keep the local range
    /// untouched until the QP's later completions show it is done.
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
    ///
    /// # Errors
    /// [`Error::Post`] if the work request is refused at post time (QP state, lkey, length),
    /// [`Error::Completion`] for a non-success completion, [`Error::Closed`] if the
    /// endpoint stopped.
    ///
    /// # Cancel safety
    /// Not cancel safe in the sense of undoing: the work request is posted at the first
    /// poll, and dropping the future afterwards does not withdraw it — it runs to its
    /// completion (RC verbs have no cancel), which is then discarded. Keep the local range
    /// untouched until the QP's later completions show it is done.
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
    ///
    /// # Errors
    /// [`Error::Post`] if the work request is refused at post time (QP state, lkey, length),
    /// [`Error::Completion`] for a non-success completion, [`Error::Closed`] if the
    /// endpoint stopped.
    ///
    /// # Cancel safety
    /// Not cancel safe in the sense of undoing: the work request is posted at the first
    /// poll, and dropping the future afterwards does not withdraw it — it runs to its
    /// completion (RC verbs have no cancel), which is then discarded. Keep the local range
    /// untouched until the QP's later completions show it is done.
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
    ///
    /// # Errors
    /// [`Error::Post`] if the work request is refused at post time (QP state, lkey, length),
    /// [`Error::Completion`] for a non-success completion, [`Error::Closed`] if the
    /// endpoint stopped.
    ///
    /// # Cancel safety
    /// Not cancel safe in the sense of undoing: the work request is posted at the first
    /// poll, and dropping the future afterwards does not withdraw it — it runs to its
    /// completion (RC verbs have no cancel), which is then discarded. Keep the local range
    /// untouched until the QP's later completions show it is done.
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
        self.host.with(|qps, _| {
            let b = qps
                .mr_read(lkey, offset, 8)
                .map_err(|e| Error::Post(RcError::LocalMemory(e)))?;
            let mut a = [0u8; 8];
            a.copy_from_slice(&b);
            Ok(u64::from_le_bytes(a))
        })
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
