//! Errors of the async API.

use metaroce::{ConnectionError, MrError, PostError, WcStatus, WorkCompletion};
use std::fmt;

/// Why `connect` failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum ConnectError {
    /// The core refused to start (configuration, connection limit).
    Post(PostError),
    /// The connection attempt ended (timeout, rejected).
    Connection(ConnectionError),
    /// The endpoint was closed or its driver stopped.
    EndpointClosed,
}

impl fmt::Display for ConnectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConnectError::Post(e) => write!(f, "cannot connect: {e}"),
            ConnectError::Connection(e) => write!(f, "connection failed: {e}"),
            ConnectError::EndpointClosed => f.write_str("endpoint closed"),
        }
    }
}

impl std::error::Error for ConnectError {}

/// Errors of operations on a connection, a stream or a memory region.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// The core refused to post the operation (what was wrong is inside).
    Post(PostError),
    /// The operation completed with an error status (the whole work completion is inside).
    Completion(WorkCompletion),
    /// The connection ended.
    ConnectionLost(ConnectionError),
    /// A local memory region reference was invalid.
    Memory(MrError),
    /// The region belongs to another endpoint.
    ForeignRegion,
    /// A stream with this id is already open on this connection.
    StreamInUse(u32),
    /// The endpoint was closed or its driver stopped.
    EndpointClosed,
}

impl Error {
    /// The work completion status, for completion errors.
    pub fn status(&self) -> Option<WcStatus> {
        match self {
            Error::Completion(wc) => Some(wc.status),
            _ => None,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Post(e) => write!(f, "{e}"),
            Error::Completion(wc) => write!(
                f,
                "work request {} failed: {} ({})",
                wc.wr_id,
                wc.status,
                wc.status.ibv_code()
            ),
            Error::ConnectionLost(e) => write!(f, "connection lost: {e}"),
            Error::Memory(e) => write!(f, "{e}"),
            Error::ForeignRegion => f.write_str("memory region belongs to another endpoint"),
            Error::StreamInUse(id) => write!(f, "stream {id} is already open"),
            Error::EndpointClosed => f.write_str("endpoint closed"),
        }
    }
}

impl std::error::Error for Error {}

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
