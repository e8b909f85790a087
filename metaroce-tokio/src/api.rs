//! The [`metaroce::api`] traits for this crate's types: thin forwarding impls, so code
//! written against [`RdmaEndpoint`] runs over UDP with [`Endpoint`] (and over a NIC with
//! `metaroce-verbs`) unchanged. The inherent methods stay, and say the same with more
//! (path statistics, stream ids, [`Incoming`](crate::Incoming) to refuse requests, ...).
//!
//! | trait | type | notes |
//! |---|---|---|
//! | [`RdmaEndpoint`] | [`Endpoint`] | `connect` awaits the [`Connecting`](crate::Connecting); `accept` accepts every [`Incoming`](crate::Incoming); `alloc`/`register` never fail |
//! | [`RdmaConnection`] | [`Connection`] | same semantics and cancel safety as the inherent methods (dropping an operation future cancels the operation) |
//! | [`LocalRegion`] | [`MemoryRegion`] | |
//! | `RdmaConnection::Stream` | [`MessageStream`] | |
//! | [`OpError`] | [`Error`] | `wc_status` is [`Error::status`]; `connection_error` is the source of [`Error::ConnectionLost`] |

use crate::{ConnectError, WorkCompletion};
use crate::{Connection, Endpoint, Error, MemoryRegion, MessageStream};
use metaroce::api::{LocalRegion, OpError, RdmaConnection, RdmaEndpoint, RemoteRegion};
use metaroce::{Access, ConnectionError, WcStatus};
use std::net::SocketAddr;
use std::ops::Range;

impl From<ConnectError> for Error {
    /// One error type for the traits: a refused start is [`Error::Post`], a failed
    /// handshake [`Error::ConnectionLost`] with its reason, a closed endpoint
    /// [`Error::EndpointClosed`], an unreachable address [`Error::InvalidRemoteAddress`].
    fn from(e: ConnectError) -> Self {
        match e {
            ConnectError::Post(p) => Error::Post(p),
            ConnectError::Connection(c) => Error::ConnectionLost(c),
            ConnectError::EndpointClosed => Error::EndpointClosed,
            ConnectError::InvalidRemoteAddress(a) => Error::InvalidRemoteAddress(a),
        }
    }
}

impl OpError for Error {
    fn wc_status(&self) -> Option<WcStatus> {
        self.status()
    }

    fn connection_error(&self) -> Option<ConnectionError> {
        match self {
            Error::ConnectionLost(c) => Some(c.clone()),
            _ => None,
        }
    }
}

impl LocalRegion for MemoryRegion {
    type Error = Error;

    fn len(&self) -> usize {
        MemoryRegion::len(self)
    }

    fn access(&self) -> Access {
        self.keys().access
    }

    fn remote(&self) -> RemoteRegion {
        MemoryRegion::remote(self)
    }

    fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, Error> {
        MemoryRegion::read(self, offset, len)
    }

    fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<(), Error> {
        MemoryRegion::read_into(self, offset, dst)
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        MemoryRegion::write(self, offset, data)
    }
}

impl RdmaEndpoint for Endpoint {
    type Connection = Connection;
    type Region = MemoryRegion;
    type Error = Error;

    fn local_addr(&self) -> SocketAddr {
        Endpoint::local_addr(self)
    }

    async fn connect(&self, addr: SocketAddr) -> Result<Connection, Error> {
        Ok(Endpoint::connect(self, addr)?.await?)
    }

    async fn accept(&self) -> Option<Result<Connection, Error>> {
        let incoming = Endpoint::accept(self).await?;
        Some(incoming.accept().map_err(Error::from))
    }

    fn alloc(&self, len: usize, access: Access) -> Result<MemoryRegion, Error> {
        Ok(Endpoint::alloc(self, len, access))
    }

    fn register(&self, buf: Vec<u8>, access: Access) -> Result<MemoryRegion, Error> {
        Ok(Endpoint::register(self, buf, access))
    }

    fn close(&self, code: u32, reason: &[u8]) {
        Endpoint::close(self, code, reason)
    }
}

impl RdmaConnection for Connection {
    type Region = MemoryRegion;
    type Error = Error;
    type Stream = MessageStream;

    fn remote_addr(&self) -> Option<SocketAddr> {
        Connection::remote_addr(self)
    }

    fn open_stream(&self) -> Result<MessageStream, Error> {
        Connection::open_stream(self)
    }

    async fn accept_stream(&self) -> Option<MessageStream> {
        Connection::accept_stream(self).await
    }

    async fn write(
        &self,
        src: &MemoryRegion,
        range: Range<u64>,
        dst: RemoteRegion,
        dst_offset: u64,
    ) -> Result<WorkCompletion, Error> {
        Connection::write(self, src, range, dst, dst_offset).await
    }

    async fn write_with_imm(
        &self,
        src: &MemoryRegion,
        range: Range<u64>,
        dst: RemoteRegion,
        dst_offset: u64,
        imm: u32,
    ) -> Result<WorkCompletion, Error> {
        Connection::write_with_imm(self, src, range, dst, dst_offset, imm).await
    }

    async fn recv_imm(&self) -> Option<(u32, u32)> {
        Connection::recv_imm(self).await
    }

    async fn read(
        &self,
        dst: &MemoryRegion,
        range: Range<u64>,
        src: RemoteRegion,
        src_offset: u64,
    ) -> Result<WorkCompletion, Error> {
        Connection::read(self, dst, range, src, src_offset).await
    }

    async fn compare_swap(
        &self,
        remote: RemoteRegion,
        remote_offset: u64,
        compare: u64,
        swap: u64,
    ) -> Result<u64, Error> {
        Connection::compare_swap(self, remote, remote_offset, compare, swap).await
    }

    async fn fetch_add(
        &self,
        remote: RemoteRegion,
        remote_offset: u64,
        add: u64,
    ) -> Result<u64, Error> {
        Connection::fetch_add(self, remote, remote_offset, add).await
    }

    fn close(&self, code: u32, reason: &[u8]) {
        Connection::close(self, code, reason)
    }

    async fn closed(&self) -> ConnectionError {
        Connection::closed(self).await
    }
}
