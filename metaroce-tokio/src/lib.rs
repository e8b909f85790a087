//! # metaroce-tokio — async API for the metaroce transport
//!
//! An [`Endpoint`] owns a set of datagram sockets (a [`backend::DatagramBackend`]: UDP
//! with GSO/GRO and ECN, optionally wrapped in the [`backend::Impaired`] emulation
//! layer) and a driver task that feeds datagrams and timers into the sans-IO
//! [`metaroce::Endpoint`] and flushes what it transmits.
//!
//! ```
//! use metaroce_tokio::futures::{SinkExt, StreamExt};
//! use metaroce_tokio::{Access, Bytes, Config, Endpoint};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let server = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
//! let client = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
//! let connecting = client.connect(server.local_addr())?; // refuses at once what cannot start
//! let peer = server.accept().await.expect("a request").accept()?;
//! let conn = connecting.await?; // the handshake completed
//!
//! // Two-sided: a message stream is a Stream of received messages and a Sink of messages.
//! let mut stream = conn.open_stream()?;
//! stream.send(Bytes::from_static(b"hello")).await?;
//! let mut incoming = peer.accept_stream().await.expect("stream");
//! assert_eq!(&incoming.next().await.expect("a message")?[..], b"hello");
//!
//! // One-sided: the peer exposes a region, we WRITE into it.
//! let target = peer.endpoint().alloc(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
//! let source = conn.endpoint().register(vec![7u8; 4096], Access::LOCAL_WRITE);
//! conn.write(&source, 0..4096, target.remote(), 0).await?;
//! assert!(target.read(0, 4096)?.iter().all(|&b| b == 7));
//!
//! // Close with a code; the peer's `closed()` says so.
//! conn.close(3, b"bye");
//! println!("{}", peer.closed().await);
//! # Ok(()) }
//! ```
//!
//! # Lifecycle
//!
//! As in quinn: [`Endpoint::connect`] returns a [`Connecting`] future;
//! [`Endpoint::accept`] yields [`Incoming`] requests, which the application accepts or
//! refuses with a code and a reason the requester's [`ConnectError`] reports; [`Connection::close`] sends a code and reason that the peer's
//! [`Connection::closed`] reports; dropping the last handle of a connection (its
//! `Connection` clones and `MessageStream`s) closes it, and once the last handle of any
//! kind is gone (every `Endpoint` clone, connection, stream and memory region: each keeps
//! the endpoint alive) all its connections are closed at the peers and the driver stops.
//! Dropping the `Endpoint` alone closes nothing while a connection handle lives; use
//! [`Endpoint::close`] for that.
//! [`Endpoint::wait_idle`] waits until no connection is left. Every driver-side structure
//! of a connection is freed when it ends ([`Endpoint::driver_maps`]).
//!
//! # One API, two backends
//!
//! [`Endpoint`], [`Connection`], [`MemoryRegion`], [`MessageStream`] and [`Error`]
//! implement the [`metaroce::api`] traits (`RdmaEndpoint`, `RdmaConnection`,
//! `LocalRegion`, `OpError`), which `metaroce-verbs` implements for RDMA NICs: a function
//! generic over `E: RdmaEndpoint` runs over either. The traits are re-exported here as
//! [`api`](metaroce::api).
//!
//! # Errors
//!
//! [`Error`], [`ConnectError`] and [`ConfigError`] implement `std::error::Error` with
//! `source()`: the core's [`PostError`], [`ConnectionError`] and [`MrError`] are the
//! sources; their `Display` does not repeat the source.
//!
//! # Threads and latency
//!
//! The driver task runs on the runtime's worker threads. On a multi-thread runtime, a
//! future passed to `Runtime::block_on` (or the body of `#[tokio::main]`) runs on the
//! calling thread, outside the workers: each completion the driver delivers to it wakes
//! that thread, one wake-up more per round trip than a spawned task pays. A
//! latency-sensitive request loop therefore runs as a spawned task (`tokio::spawn`), where
//! the driver's wake-up usually resumes it on the same worker. `metaroce-perf`'s latency
//! tests do so; on an idle 2-vCPU VM this took the 64 B one-way latency from about 50 µs
//! to about 17 µs (docs/RESULTS.md, "Two regimes of the 64 B round trip").
//!
//! The other side of that slot: a task that wakes the driver and then computes for long
//! (fills or checksums a large buffer, say) holds the driver on its worker, since tokio
//! does not let another worker steal the task it woke last. The endpoint then answers no
//! packet meanwhile, and the peer's retransmission timers fire (in `metaroce-perf`, a 1 GiB
//! region fill cost about 200 spurious retransmissions per run). Run such work through
//! `tokio::task::block_in_place` or `spawn_blocking`.
//!
//! # Tracing
//!
//! The driver task runs in an `endpoint` span (`id`, `addr`); each [`Connection`] has a
//! `connection` span (`qpn`, `peer`; [`Connection::span`]) that its operations run in.
//! Connection ends are DEBUG events. Everything the core does for one path (ACKs, NAKs,
//! loss timers) runs in a `path` span with `conn` (the QPN), `path` (the path id of
//! PathEth), `port` (its UDP source port, the ECMP entropy) and `plane`, so the events
//! below say which path and port lost, retransmitted or was re-rolled:
//!
//! | Level | Target | Event |
//! |---|---|---|
//! | DEBUG | `metaroce::conn::path` | `packets declared lost` (SACK/RACK; `lost`, `cum`), `retransmission timeout` (`lost`, `srtt`), `tail-loss probe`, `path active again` |
//! | TRACE | `metaroce::conn` | `retransmission` (`conn`, `path`, `port`, `psn`, `op`, `seg`), one per re-sent packet |
//! | TRACE | `metaroce::conn::path` | `CE marks echoed` (`marked`): ECN window decrease |
//! | INFO | `metaroce::conn` | `path re-rolled` (`old_port`, `new_port`): after repeated timeouts or an ECMP collision |
//! | WARN | `metaroce::conn` | `path retired`, `plane down` |
//!
//! Nothing is printed unless the application installs a subscriber; with
//! `tracing-subscriber` (feature `env-filter`):
//!
//! ```no_run
//! // RUST_LOG-style filter: per-path loss and re-roll events, connection ends.
//! tracing_subscriber::fmt()
//!     .with_env_filter("metaroce=debug,metaroce_tokio=debug")
//!     .init();
//! ```
//!
//! A line then reads, for example,
//! `DEBUG endpoint{id=0 addr=127.0.0.1:4791}:path{conn=qp 0x00c3a1 path=3 port=49155 plane=0}: metaroce::conn::path: retransmission timeout lost=12 ...`.
//! Use `metaroce=trace` for every retransmitted PSN (verbose: one line per packet).
#![warn(missing_docs)]
#![deny(unsafe_code)]

mod api;
pub mod backend;
mod connection;
mod driver;
mod endpoint;
mod error;
mod external;
mod mr;
pub mod rocev2;
mod stream;

pub use connection::{BatchWrite, CancelledRecv, Connection};
pub use endpoint::{
    Config, Connecting, DriverMaps, Endpoint, Incoming, DEFAULT_IDLE_TIMEOUT, MAX_SHARDS,
    REFUSED_BUSY,
};
pub use error::{ConfigError, ConnectError, Error};
pub use mr::{ExternalMemory, MemoryRegion, OwnedBuffer, RemoteRegion, COPY_CHUNK};
pub use stream::{MessageStream, RESET_ON_DROP};

pub use bytes::{self, Bytes};
pub use futures;
pub use metaroce;
pub use metaroce::api::{LocalRegion, OpError, RdmaConnection, RdmaEndpoint};
pub use metaroce::{
    Access, ConnectionError, ConnectionHandle, ConnectionStats, MrError, PostError, WcStatus,
    WorkCompletion,
};

/// The README's examples, run as doc tests so they cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
mod readme {}
