//! # metaroce-tokio — async API for the metaroce transport
//!
//! An [`Endpoint`] owns a set of datagram sockets (a [`backend::DatagramBackend`]: UDP
//! with GSO/GRO and ECN, optionally wrapped in the [`backend::Impaired`] emulation
//! layer) and a driver task that feeds datagrams and timers into the sans-IO
//! [`metaroce::Endpoint`] and flushes what it transmits.
//!
//! ```no_run
//! use bytes::Bytes;
//! use futures::{SinkExt, StreamExt};
//! use metaroce::Access;
//! use metaroce_tokio::{Config, Endpoint};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let server = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
//! let client = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
//! let addr = server.local_addr();
//! let accept = tokio::spawn(async move { server.accept().await });
//! let conn = client.connect(addr).await?;
//! let peer = accept.await?.expect("accepted");
//!
//! // Two-sided: a message stream is a Stream of received messages and a Sink of messages.
//! let mut stream = conn.open_stream()?;
//! stream.send(Bytes::from_static(b"hello")).await?;
//! let mut incoming = peer.accept_stream().await.expect("stream");
//! assert_eq!(&incoming.next().await.unwrap()[..], b"hello");
//!
//! // One-sided: the peer exposes a region, we WRITE into it.
//! let target = peer.endpoint().alloc(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
//! let source = conn.endpoint().register(vec![7u8; 4096], Access::LOCAL_WRITE);
//! conn.write(&source, 0..4096, target.remote(), 0).await?;
//! assert!(target.read(0, 4096)?.iter().all(|&b| b == 7));
//! # Ok(()) }
//! ```
#![warn(missing_docs)]
#![deny(unsafe_code)]

pub mod backend;
mod connection;
mod driver;
mod endpoint;
mod error;
mod mr;
pub mod rocev2;
mod stream;

pub use connection::Connection;
pub use endpoint::{
    Config, Connecting, DriverMaps, Endpoint, Incoming, DEFAULT_IDLE_TIMEOUT, REFUSED_BUSY,
};
pub use error::{ConfigError, ConnectError, Error};
pub use mr::{MemoryRegion, RemoteRegion};
pub use stream::{MessageStream, RESET_ON_DROP};

pub use metaroce;
pub use metaroce::{
    Access, ConnectionError, ConnectionHandle, ConnectionStats, MrError, PostError, WcStatus,
    WorkCompletion,
};
