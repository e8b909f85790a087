//! Errors of the async API.
//!
//! One mapping of the core's errors is used everywhere: a refused post is
//! [`Error::Post`], a failed work completion [`Error::Completion`], the end of the
//! connection [`Error::ConnectionLost`] with the core's [`ConnectionError`] (for a close by
//! the peer, with its code and reason), the end of the endpoint [`Error::EndpointClosed`].

use metaroce::{ConnectionError, MrError, PostError, WcStatus, WorkCompletion};

/// An invalid [`Config`](crate::Config): which part, and what the core's check said.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `transport` failed [`TransportConfig::validate`](metaroce::TransportConfig::validate):
    /// the core's [`ConfigError`](metaroce::ConfigError) names the field
    /// ([`field`](metaroce::ConfigError::field)) and the rule with the value found. (It is
    /// part of this error's `Display`, so it is not also its `source()`.)
    #[error("invalid transport configuration: {0}")]
    Transport(metaroce::ConfigError),
    /// The backend offers no source port (a connection needs at least one path).
    #[error("the backend has no source port")]
    NoSourcePorts,
    /// The RoCEv2 RC configuration was refused (the text names the field).
    #[error("invalid RoCEv2 configuration: {0}")]
    Rc(String),
    /// A limit of the async layer is zero (the field name).
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// [`Config::shards`](crate::Config::shards) is above
    /// [`MAX_SHARDS`](crate::MAX_SHARDS) (the value found).
    #[error("shards must be at most 64, not {0}")]
    TooManyShards(usize),
}

impl ConfigError {
    /// The core's refusal, typed.
    pub(crate) fn from_post(e: PostError) -> ConfigError {
        match e {
            PostError::InvalidConfig(e) if e.field() == "source_ports" => {
                ConfigError::NoSourcePorts
            }
            PostError::InvalidConfig(e) => ConfigError::Transport(e),
            e => ConfigError::Transport(metaroce::ConfigError::new("endpoint", e.to_string())),
        }
    }
}

impl From<ConfigError> for std::io::Error {
    /// `InvalidInput`, with the [`ConfigError`] as its inner error (`get_ref`/`downcast`).
    fn from(e: ConfigError) -> Self {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, e)
    }
}

/// Why `connect` (or accepting an incoming connection) failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The core refused to start (connection limit); reported by
    /// [`Endpoint::connect`](crate::Endpoint::connect) itself, before any await.
    #[error("cannot connect")]
    Post(#[source] PostError),
    /// The connection attempt ended (timeout, refused by the peer with a code, closed).
    #[error("connection failed")]
    Connection(#[source] ConnectionError),
    /// The endpoint was closed or its driver stopped.
    #[error("endpoint closed")]
    EndpointClosed,
    /// No datagram can reach this address from this endpoint: port 0, an unspecified IP
    /// (`0.0.0.0`, `::`), or an IPv6 address from an endpoint bound to IPv4. Reported by
    /// [`Endpoint::connect`](crate::Endpoint::connect) itself, before any await.
    #[error("invalid remote address {0}")]
    InvalidRemoteAddress(std::net::SocketAddr),
}

/// Errors of operations on a connection, a stream or a memory region.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The core refused to post the operation (what was wrong is the source).
    #[error("operation refused")]
    Post(#[source] PostError),
    /// The operation completed with an error status (the whole work completion is inside;
    /// its `wr_id` is the driver's, not one the application chose, so the message names
    /// the operation by its opcode).
    #[error("{:?} failed: {} (ibv_wc_status {})", .0.opcode, .0.status, .0.status.ibv_code())]
    Completion(WorkCompletion),
    /// The connection ended; the source says why (closed locally or by the peer with a
    /// code, idle timeout, retry exceeded). Also what an operation that was flushed by the
    /// end (`WrFlushError`) fails with, instead of [`Error::Completion`].
    #[error("connection lost")]
    ConnectionLost(#[source] ConnectionError),
    /// A local memory region reference was invalid.
    #[error("invalid memory region reference")]
    Memory(#[source] MrError),
    /// The region belongs to another endpoint.
    #[error("memory region belongs to another endpoint")]
    ForeignRegion,
    /// The span of a one-sided operation is not inside the peer's region as its
    /// [`RemoteRegion`](metaroce::api::RemoteRegion) descriptor says: `len` bytes at
    /// `offset` of a region of `region_len` bytes (or the end passes `u64::MAX`). Found
    /// before anything is sent; the peer would refuse it with a remote access error.
    #[error("remote range of {len} bytes at offset {offset} is outside the peer's region of {region_len} bytes")]
    RemoteOutOfBounds {
        /// Offset in the peer's region.
        offset: u64,
        /// Bytes of the operation.
        len: u64,
        /// The region's length in its descriptor.
        region_len: u64,
    },
    /// No datagram can reach this address from this endpoint
    /// ([`ConnectError::InvalidRemoteAddress`]).
    #[error("invalid remote address {0}")]
    InvalidRemoteAddress(std::net::SocketAddr),
    /// A stream with this id is already open on this connection.
    #[error("stream {0} is already open")]
    StreamInUse(u32),
    /// The stream's send side was finished ([`Sink::poll_close`](futures::Sink::poll_close))
    /// or reset: nothing more can be sent on it. Also from
    /// [`Connection::stream`](crate::Connection::stream) for an id that was used and is
    /// over (stream ids are single-use per connection; see
    /// [`metaroce::Event::StreamClosed`]).
    #[error("stream {0} is closed for sending")]
    StreamClosed(u32),
    /// The peer reset the stream with this code (on its own, on drop, or in answer to
    /// this side's `stop`).
    #[error("stream {stream} reset by the peer with code {code}")]
    StreamReset {
        /// The stream id.
        stream: u32,
        /// The application error code the peer gave.
        code: u32,
    },
    /// The peer refused the stream: it already kept its
    /// [`max_streams`](metaroce::TransportConfig::max_streams) streams when the stream's
    /// message arrived ([`metaroce::Event::StreamRefused`]). Nothing of the stream from
    /// that message on is delivered, and the stream is over for sending (its later
    /// messages fail with this error too). Not a fault of the message: open a new stream
    /// and send again once one of this connection's streams ends. Its
    /// [`status`](Error::status) is `RemoteInvalidRequest`, the completion status the
    /// refused SEND had.
    #[error("stream {stream} refused by the peer (its stream table is full)")]
    StreamRefused {
        /// The stream id.
        stream: u32,
    },
    /// The peer's reader asked this side to stop sending on the stream with this code
    /// (the stream was reset with it).
    #[error("stream {stream} stopped by the peer with code {code}")]
    StreamStopped {
        /// The stream id.
        stream: u32,
        /// The application error code the peer gave.
        code: u32,
    },
    /// The endpoint was closed, or its driver stopped (also when the runtime that ran the
    /// driver shut down).
    #[error("endpoint closed")]
    EndpointClosed,
}

impl Error {
    /// The work completion status, for completion errors (and `RemoteInvalidRequest` for
    /// [`Error::StreamRefused`], the status of the refused SEND).
    pub fn status(&self) -> Option<WcStatus> {
        match self {
            Error::Completion(wc) => Some(wc.status),
            Error::StreamRefused { .. } => Some(WcStatus::RemoteInvalidRequest),
            _ => None,
        }
    }
}

impl From<PostError> for Error {
    fn from(e: PostError) -> Self {
        Error::Post(e)
    }
}

impl From<MrError> for Error {
    fn from(e: MrError) -> Self {
        Error::Memory(e)
    }
}
