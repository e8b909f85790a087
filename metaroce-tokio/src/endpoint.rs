//! The async endpoint: binds a datagram backend, runs the driver task, hands out
//! connections and memory regions.

use crate::backend::{DatagramBackend, UdpBackend, UdpConfig};
use crate::connection::{ConnEntry, Connection};
use crate::driver;
use crate::error::ConnectError;
use crate::mr::MemoryRegion;
use metaroce::{
    Access, ConnectionError, ConnectionHandle, EndpointConfig, EndpointStats, TransportConfig,
    WorkCompletion,
};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::{mpsc, oneshot, Notify};

/// Configuration of an async [`Endpoint`].
#[derive(Debug, Clone)]
pub struct Config {
    /// Transport parameters (paths, path MTU, limits, congestion control) of every
    /// connection. `transport.paths` is also the number of path sockets bound.
    pub transport: TransportConfig,
    /// Seed of the core's reproducible RNG (QPNs, initial PSNs); `None` (the default) takes
    /// one from the operating system (`getrandom`). Set it only for reproducible runs. The
    /// core's secret seed (connection nonces and tokens, retry cookies, rkeys, region
    /// addresses) is always taken from the operating system (issue #9).
    pub seed: Option<u64>,
    /// Accept connection requests from peers. Default `true`.
    pub accept_incoming: bool,
    /// Most connections at once. Default 65 536.
    pub max_connections: usize,
    /// Socket options of the UDP backend (used by [`Endpoint::bind`]).
    pub udp: UdpConfig,
    /// Extra UDP source ports bound beside the `transport.paths` path ports, so that a path
    /// that keeps timing out can be re-rolled to fresh ECMP entropy. Default 8.
    pub spare_ports: usize,
    /// Most messages a [`MessageStream`](crate::MessageStream) sink has in flight (posted,
    /// not yet acknowledged) before `poll_ready` waits. Default 256.
    pub max_stream_in_flight: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            transport: TransportConfig::default(),
            seed: None,
            accept_incoming: true,
            max_connections: 65_536,
            udp: UdpConfig::default(),
            spare_ports: 8,
            max_stream_in_flight: 256,
        }
    }
}

pub(crate) enum Waiter {
    Op(oneshot::Sender<WorkCompletion>),
    Stream(u32),
}

pub(crate) struct State {
    pub core: metaroce::Endpoint,
    pub conns: HashMap<ConnectionHandle, ConnEntry>,
    pub connecting: HashMap<ConnectionHandle, oneshot::Sender<Result<(), ConnectionError>>>,
    pub waiters: HashMap<(ConnectionHandle, u64), Waiter>,
    pub next_wr_id: u64,
    pub incoming: Option<mpsc::UnboundedSender<ConnectionHandle>>,
    pub closed: bool,
    /// Completion routing of the RC queue pairs (`Endpoint::create_rc_qp`).
    pub rc: crate::rocev2::RcSide,
}

impl State {
    pub fn wr_id(&mut self) -> u64 {
        self.next_wr_id += 1;
        self.next_wr_id
    }
}

/// State shared by the driver task and every handle.
pub(crate) struct Shared {
    pub state: Mutex<State>,
    /// Wakes the driver: new work was posted or the endpoint is closing.
    pub wake_driver: Notify,
    /// Signalled when send-queue space frees up (completions).
    pub sq_space: Notify,
    pub backend: Arc<dyn DatagramBackend>,
    /// Whole-IP-packet backend of native RoCEv2 QPs, if any (`Endpoint::with_rocev2`).
    pub ip_backend: Option<Arc<dyn crate::rocev2::IpBackend>>,
    pub id: u64,
    pub cfg: Config,
    /// Accepted connections waiting for `Endpoint::accept`.
    pub incoming_rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<ConnectionHandle>>,
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock would be a bug in this crate; keep going with the
        // state as it was rather than poisoning every handle.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("id", &self.id)
            .field("backend", &self.backend)
            .finish()
    }
}

/// Keeps the driver running while any user handle (endpoint, connection, region, stream)
/// exists; the last one dropped stops it.
#[derive(Debug)]
pub(crate) struct EndpointRef {
    pub shared: Arc<Shared>,
}

impl Drop for EndpointRef {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.wake_driver.notify_one();
    }
}

static NEXT_ENDPOINT_ID: AtomicU64 = AtomicU64::new(1);

/// A MetaRoCE endpoint bound to a local address: connects to peers, accepts their
/// connections, owns registered memory regions. Cheap to clone; the driver task stops when
/// the last endpoint, connection, region and stream handle is dropped, or on
/// [`close`](Self::close).
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub(crate) inner: Arc<EndpointRef>,
}

impl Endpoint {
    /// Bind a UDP endpoint at `addr` (port 0 for an ephemeral port) with one main socket
    /// and `config.transport.paths + config.spare_ports` path sockets, and start its driver
    /// task. Must be called
    /// within a tokio runtime.
    ///
    /// Errors: the sockets could not be bound, or the configuration is invalid
    /// (`InvalidInput`, naming the field).
    pub async fn bind(addr: SocketAddr, config: Config) -> std::io::Result<Endpoint> {
        let ports = config.transport.paths as usize + config.spare_ports;
        let backend = UdpBackend::bind_with(addr, ports, &config.udp)?;
        Self::with_backend(backend, config)
    }

    /// Start an endpoint over any datagram backend (for example a UDP backend wrapped in
    /// [`Impaired`](crate::backend::Impaired)). Must be called within a tokio runtime.
    pub fn with_backend(
        backend: impl DatagramBackend,
        config: Config,
    ) -> std::io::Result<Endpoint> {
        Self::start(Arc::new(backend), None, config)
    }

    /// Start an endpoint over a datagram backend (MetaRoCE connections, RC QPs connected
    /// with [`QueuePair::connect_udp`](crate::rocev2::QueuePair::connect_udp)) **and** a
    /// whole-IP-packet backend for native RoCEv2 QPs
    /// ([`QueuePair::connect`](crate::rocev2::QueuePair::connect)) that interoperate with
    /// `rdma_rxe` and RNICs: normally a
    /// [`RawIpBackend`](crate::rocev2::RawIpBackend) (needs `CAP_NET_RAW`), or a
    /// [`MemoryLink`](crate::rocev2::MemoryLink) in tests. One driver task serves both;
    /// memory regions are shared. The native QPs' local IP is `ip_backend.local_ip()`.
    /// Must be called within a tokio runtime.
    ///
    /// `backend` carries the MetaRoCE connections (and RC QPs connected with `connect_udp`):
    /// build it as [`bind`](Self::bind) does, with
    /// [`UdpBackend::bind_with`](crate::backend::UdpBackend::bind_with)`(addr,
    /// config.transport.paths + config.spare_ports, &config.udp)`. On such an endpoint
    /// [`QueuePair::connect_to`](crate::rocev2::QueuePair::connect_to) connects natively;
    /// on one from [`bind`](Self::bind) it falls back to UDP encapsulation, which reaches
    /// metaroce peers only. (The README's RoCEv2 example; compiled, not run.)
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use metaroce_tokio::backend::UdpBackend;
    /// use metaroce_tokio::rocev2::{exchange, QpInit, RawIpBackend};
    /// use metaroce_tokio::{Access, Config, Endpoint};
    ///
    /// async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    ///     let config = Config::default();
    ///     let ports = config.transport.paths as usize + config.spare_ports;
    ///     let udp = UdpBackend::bind_with("10.0.0.1:4791".parse()?, ports, &config.udp)?;
    ///     let raw = Arc::new(RawIpBackend::bind("10.0.0.1".parse()?)?); // CAP_NET_RAW
    ///     let ep = Endpoint::with_rocev2(udp, raw, config)?;
    ///     let region = ep.alloc(1 << 20, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    ///     let _meta = ep.connect("10.0.0.2:4791".parse()?).await?; // MetaRoCE to one peer
    ///     let qp = ep.create_rc_qp(QpInit { access: Access::REMOTE_WRITE, ..QpInit::default() })?;
    ///     let mut tcp = tokio::net::TcpStream::connect("10.0.0.3:18515").await?;
    ///     let peer = exchange(&mut tcp, &qp.exchange_info(Some(region.remote()))).await?;
    ///     qp.connect_to(&peer)?; // native RoCEv2 (with_rocev2) to an RNIC, same region
    ///     let their = peer.region.expect("peer sent its region");
    ///     qp.write(region.keys().lkey, 0, 4096, their.addr, their.rkey, None).await?;
    ///     Ok(())
    /// }
    /// ```
    ///
    /// Errors: the configuration is invalid (`InvalidInput`, naming the field).
    pub fn with_rocev2(
        backend: impl DatagramBackend,
        ip_backend: Arc<dyn crate::rocev2::IpBackend>,
        config: Config,
    ) -> std::io::Result<Endpoint> {
        Self::start(Arc::new(backend), Some(ip_backend), config)
    }

    fn start(
        backend: Arc<dyn DatagramBackend>,
        ip_backend: Option<Arc<dyn crate::rocev2::IpBackend>>,
        config: Config,
    ) -> std::io::Result<Endpoint> {
        let mut ecfg = EndpointConfig::new(backend.local_addr(), backend.source_ports());
        ecfg.transport = config.transport.clone();
        ecfg.transport.max_gso_segments = backend.max_gso_segments().clamp(1, 64);
        ecfg.accept_incoming = config.accept_incoming;
        ecfg.max_connections = config.max_connections;
        let os_err = |e: getrandom::Error| {
            std::io::Error::other(format!("no randomness from the operating system: {e}"))
        };
        ecfg.seed = match config.seed {
            Some(s) => s,
            None => getrandom::u64().map_err(os_err)?,
        };
        let mut secret = [0u8; 32];
        getrandom::fill(&mut secret).map_err(os_err)?;
        ecfg.secret_seed = Some(secret);
        let mut core = metaroce::Endpoint::new(ecfg)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
        if let Some(ip) = &ip_backend {
            let mut rc = core.rc_config().clone();
            rc.local_ip = ip.local_ip();
            core.set_rc_config(rc).map_err(|e| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())
            })?;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                core,
                conns: HashMap::new(),
                connecting: HashMap::new(),
                waiters: HashMap::new(),
                next_wr_id: 0,
                incoming: Some(tx),
                closed: false,
                rc: crate::rocev2::RcSide::new(),
            }),
            wake_driver: Notify::new(),
            sq_space: Notify::new(),
            backend,
            ip_backend,
            id: NEXT_ENDPOINT_ID.fetch_add(1, Ordering::Relaxed),
            cfg: config,
            incoming_rx: tokio::sync::Mutex::new(rx),
        });
        let inner = Arc::new(EndpointRef {
            shared: shared.clone(),
        });
        tokio::spawn(driver::run(shared));
        Ok(Endpoint { inner })
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.inner.shared
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared().backend.local_addr()
    }

    /// Connect to the endpoint listening at `addr`; resolves once the handshake completes.
    pub async fn connect(&self, addr: SocketAddr) -> Result<Connection, ConnectError> {
        let shared = self.shared();
        let local_ip = local_ip_for(self.local_addr(), addr);
        let (tx, rx) = oneshot::channel();
        let conn = {
            let mut st = shared.lock();
            if st.closed {
                return Err(ConnectError::EndpointClosed);
            }
            let h = st
                .core
                .connect(std::time::Instant::now(), addr, local_ip)
                .map_err(ConnectError::Post)?;
            st.connecting.insert(h, tx);
            let mut entry = ConnEntry::new();
            let conn = Connection::from_entry(self.inner.clone(), h, &mut entry);
            st.conns.insert(h, entry);
            conn.ok_or(ConnectError::EndpointClosed)?
        };
        shared.wake_driver.notify_one();
        match rx.await {
            Ok(Ok(())) => Ok(conn),
            Ok(Err(e)) => Err(ConnectError::Connection(e)),
            Err(_) => Err(ConnectError::EndpointClosed),
        }
    }

    /// The next connection a peer opened to this endpoint; `None` once the endpoint is
    /// closed.
    pub async fn accept(&self) -> Option<Connection> {
        loop {
            let h = self.shared().incoming_rx.lock().await.recv().await?;
            let mut st = self.shared().lock();
            if let Some(c) = st
                .conns
                .get_mut(&h)
                .and_then(|e| Connection::from_entry(self.inner.clone(), h, e))
            {
                return Some(c);
            }
        }
    }

    /// Register `data` as a memory region with `access` rights. Pass
    /// `Access::LOCAL_WRITE | Access::REMOTE_WRITE` to let peers WRITE into it.
    pub fn register(&self, data: Vec<u8>, access: Access) -> MemoryRegion {
        let keys = self.shared().lock().core.register_mr(data, access);
        MemoryRegion::new(self.inner.clone(), keys)
    }

    /// Register a zero-filled region of `len` bytes.
    pub fn alloc(&self, len: usize, access: Access) -> MemoryRegion {
        self.register(vec![0; len], access)
    }

    /// Endpoint-wide counters (malformed datagrams, bad ICRCs, …).
    pub fn stats(&self) -> EndpointStats {
        self.shared().lock().core.stats()
    }

    /// The backend's local UDP source ports (one per path).
    pub fn source_ports(&self) -> Vec<u16> {
        self.shared().backend.source_ports()
    }

    /// Close every connection (pending operations complete with `WrFlushError`) and stop
    /// the driver.
    pub fn close(&self) {
        let shared = self.shared();
        {
            let mut st = shared.lock();
            let handles: Vec<_> = st.core.connections().collect();
            let now = std::time::Instant::now();
            for h in handles {
                st.core.close(now, h);
            }
            st.closed = true;
        }
        shared.wake_driver.notify_one();
    }

    /// Whether this endpoint is closed ([`close`](Self::close) was called on it or a
    /// clone): new operations on it and its connections fail with
    /// [`Error::EndpointClosed`](crate::Error::EndpointClosed).
    pub fn is_closed(&self) -> bool {
        self.shared().lock().closed
    }
}

/// The local IP the kernel will use towards `peer` when bound to the unspecified address
/// (a connected UDP socket tells, without sending anything).
pub(crate) fn local_ip_for(local: SocketAddr, peer: SocketAddr) -> Option<std::net::IpAddr> {
    if !local.ip().is_unspecified() {
        return None;
    }
    let bind: SocketAddr = if peer.is_ipv4() {
        "0.0.0.0:0".parse().ok()?
    } else {
        "[::]:0".parse().ok()?
    };
    let s = std::net::UdpSocket::bind(bind).ok()?;
    s.connect(peer).ok()?;
    s.local_addr().ok().map(|a| a.ip())
}
