//! One API over every backend: the traits an application is written against once, and runs
//! over UDP (`metaroce-tokio`) or over an RDMA NIC through libibverbs (`metaroce-verbs`)
//! without changing its body (issue #12, item 2).
//!
//! The vocabulary is the verbs one: an **endpoint** ([`RdmaEndpoint`]) registers memory
//! regions ([`LocalRegion`], described to peers by a [`RemoteRegion`]: address, length,
//! rkey) and connects to or accepts **connections** ([`RdmaConnection`]), which carry
//! ordered **message streams** (SEND/RECV; a `Stream` of received messages and a `Sink` of
//! messages to send) and one-sided operations: RDMA WRITE, WRITE with immediate, READ,
//! atomic compare-and-swap and fetch-and-add. Each operation resolves with its
//! [`WorkCompletion`]; a failed one with an error whose [`OpError::wc_status`] is the
//! `ibv_wc_status` of its completion ([`WcStatus`]: `IBV_WC_REM_ACCESS_ERR` for a bad rkey,
//! `IBV_WC_RETRY_EXC_ERR`, `IBV_WC_RNR_RETRY_EXC_ERR`, `IBV_WC_WR_FLUSH_ERR`, ...).
//!
//! This module is plain types and traits, no I/O: the core stays sans-IO. The futures are
//! `Send`, so a generic function can be spawned on a multi-threaded runtime.
//!
//! ```
//! use metaroce::api::{LocalRegion, OpError, RdmaConnection, RdmaEndpoint, RemoteRegion};
//! use metaroce::{Access, WcStatus};
//!
//! /// WRITE `data` into the peer's region and tell it with an immediate, on any backend.
//! async fn put<E: RdmaEndpoint>(
//!     ep: &E,
//!     conn: &E::Connection,
//!     data: &[u8],
//!     dst: RemoteRegion,
//! ) -> Result<(), E::Error> {
//!     let src = ep.alloc(data.len(), Access::LOCAL_WRITE)?;
//!     src.write(0, data)?;
//!     match conn.write_with_imm(&src, 0..data.len() as u64, dst, 0, 7).await {
//!         Ok(_wc) => Ok(()),
//!         Err(e) if e.wc_status() == Some(WcStatus::RemoteAccessError) => {
//!             eprintln!("the peer refused the rkey: {e}");
//!             Err(e)
//!         }
//!         Err(e) => Err(e),
//!     }
//! }
//! ```
//!
//! # Why traits
//!
//! The two backends share the vocabulary, not the implementation: metaroce-tokio drives the
//! sans-IO core over datagram sockets, metaroce-verbs posts work requests to RC QPs of a
//! NIC. Traits with associated types keep each backend's concrete types (and their inherent,
//! backend-specific methods: path statistics, GID selection, ...) while generic code names
//! only `E: RdmaEndpoint`. Futures are returned as `impl Future + Send` (no boxing, no
//! `async-trait`). `docs/ARCHITECTURE.md`, "One API, two backends", gives the reasons
//! against an enum of backends.
//!
//! # What a backend must guarantee
//!
//! * An operation future resolves `Ok` only after the operation completed successfully at
//!   the responder (a WRITE's bytes landed, a READ's bytes are in the local region).
//! * A failed operation's error says its `ibv_wc_status` ([`OpError::wc_status`]).
//! * Messages on one stream arrive in the order they were sent, exactly once.
//! * Dropping an operation future after it was posted does not free, reuse or expose the
//!   local region's memory to the operation after the drop (each backend documents whether
//!   it cancels the operation or lets it run to completion in the background).

use crate::event::{ConnectionError, WorkCompletion};
use crate::mr::Access;
use bytes::Bytes;
use futures_core::Stream;
use futures_sink::Sink;
use std::future::Future;
use std::net::SocketAddr;
use std::ops::Range;

pub use crate::event::{WcOpcode, WcStatus};

/// What a peer needs to address a memory region: its address, length and rkey.
///
/// Send it to the peer in a message ([`to_bytes`](Self::to_bytes), 20 bytes); the peer
/// rebuilds it with [`from_bytes`](Self::from_bytes) and passes it to
/// [`RdmaConnection::write`], [`read`](RdmaConnection::read) and the atomics. The same
/// descriptor works on every backend: for verbs, `addr` is the MR's virtual address (or 0
/// for zero-based MRs) and `rkey` the MR's rkey.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// Virtual address of the region's first byte, as the owner's endpoint assigned it.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

impl RemoteRegion {
    /// Encoded length of [`to_bytes`](Self::to_bytes): 20 bytes.
    pub const ENCODED_LEN: usize = 20;

    /// Big-endian encoding: addr (8 bytes), len (8), rkey (4).
    pub fn to_bytes(&self) -> [u8; 20] {
        let mut b = [0u8; 20];
        b[..8].copy_from_slice(&self.addr.to_be_bytes());
        b[8..16].copy_from_slice(&self.len.to_be_bytes());
        b[16..].copy_from_slice(&self.rkey.to_be_bytes());
        b
    }

    /// Decode [`to_bytes`](Self::to_bytes); `None` if `b` is not 20 bytes. A descriptor
    /// from the network is not trusted: [`slice`](Self::slice) and the operations that
    /// take it check their arithmetic, and the owner's endpoint (or NIC) checks every
    /// access.
    pub fn from_bytes(b: &[u8]) -> Option<RemoteRegion> {
        if b.len() != Self::ENCODED_LEN {
            return None;
        }
        Some(RemoteRegion {
            addr: u64::from_be_bytes(b[..8].try_into().ok()?),
            len: u64::from_be_bytes(b[8..16].try_into().ok()?),
            rkey: u32::from_be_bytes(b[16..].try_into().ok()?),
        })
    }

    /// The sub-region `[offset, offset + len)`, or `None` if it does not fit in this one
    /// or its address would pass `u64::MAX` (checked arithmetic in every build).
    pub fn slice(&self, offset: u64, len: u64) -> Option<RemoteRegion> {
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        let addr = self.addr.checked_add(offset)?;
        addr.checked_add(len)?;
        Some(RemoteRegion {
            addr,
            len,
            rkey: self.rkey,
        })
    }

    /// The address `offset` bytes into the region, or `None` if it would pass `u64::MAX`.
    /// Not checked against `len`: the owner checks bounds and refuses an access outside
    /// the region with a remote access error.
    pub fn addr_at(&self, offset: u64) -> Option<u64> {
        self.addr.checked_add(offset)
    }
}

/// The error of a backend's operations: a standard error that says, for an operation that
/// completed with an error status, which `ibv_wc_status` it was.
pub trait OpError: std::error::Error + Send + Sync + 'static {
    /// The work completion status of a failed operation (`IBV_WC_REM_ACCESS_ERR` for a bad
    /// rkey or range, `IBV_WC_RETRY_EXC_ERR`, `IBV_WC_WR_FLUSH_ERR` for an operation
    /// flushed because the connection failed, ...); `None` for errors that are not a
    /// completion (a refused post, a local region error, an endpoint that closed).
    fn wc_status(&self) -> Option<WcStatus>;

    /// Why the connection ended, if this error says it did (closed by either side, idle
    /// timeout, retry exceeded); `None` otherwise. The default says `None`.
    fn connection_error(&self) -> Option<ConnectionError> {
        None
    }
}

/// A memory region registered with an endpoint (an MR): local bytes that this side's
/// operations read from or land in, and that peers address through its
/// [`remote`](Self::remote) descriptor.
///
/// Peers may WRITE into the region at any time their rights allow, so local code copies in
/// and out ([`read`](Self::read), [`read_into`](Self::read_into), [`write`](Self::write))
/// rather than holding a plain reference. Dropping the region deregisters it; a backend
/// does not free or reuse its memory while an operation that uses it is still in flight.
pub trait LocalRegion: Send + Sync + 'static {
    /// The backend's error type.
    type Error: OpError;

    /// Length in bytes.
    fn len(&self) -> usize;

    /// Whether the region is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The access rights it was registered with.
    fn access(&self) -> Access;

    /// The descriptor to hand to peers.
    fn remote(&self) -> RemoteRegion;

    /// Copy out bytes `[offset, offset + len)`.
    ///
    /// # Errors
    /// An error (local protection / out of bounds) if the range is not inside the region.
    fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, Self::Error>;

    /// Copy bytes `[offset, offset + dst.len())` into `dst`.
    ///
    /// # Errors
    /// As [`read`](Self::read).
    fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<(), Self::Error>;

    /// Copy `data` into the region at `offset`; peers see the bytes in their next READ.
    ///
    /// # Errors
    /// As [`read`](Self::read).
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), Self::Error>;
}

/// An endpoint: the local side that registers memory and connects to or accepts peers.
///
/// Cheap to clone (a handle); all clones are the same endpoint.
pub trait RdmaEndpoint: Clone + Send + Sync + 'static {
    /// A connection to one peer.
    type Connection: RdmaConnection<Region = Self::Region, Error = Self::Error>;
    /// A memory region of this endpoint.
    type Region: LocalRegion<Error = Self::Error>;
    /// The backend's error type.
    type Error: OpError;

    /// The address peers connect to.
    fn local_addr(&self) -> SocketAddr;

    /// Connect to the endpoint at `addr`; resolves when the connection is established.
    ///
    /// # Errors
    /// The peer refused or did not answer (the error's
    /// [`connection_error`](OpError::connection_error) says which), or the endpoint closed.
    ///
    /// # Cancel safety
    /// Dropping the future abandons the attempt; no connection is left behind.
    fn connect(
        &self,
        addr: SocketAddr,
    ) -> impl Future<Output = Result<Self::Connection, Self::Error>> + Send;

    /// The next connection a peer opened to this endpoint, accepted; `None` once the
    /// endpoint is closed.
    ///
    /// # Errors
    /// `Some(Err(_))` if one request could not be accepted; later requests may still be.
    ///
    /// # Cancel safety
    /// Cancel safe: a request is taken only when the future resolves.
    fn accept(&self) -> impl Future<Output = Option<Result<Self::Connection, Self::Error>>> + Send;

    /// Register a new zero-filled region of `len` bytes with `access` rights (`LOCAL_WRITE`
    /// for it to receive READ results, the `REMOTE_*` rights for what peers may do).
    ///
    /// # Errors
    /// The backend could not register it (for verbs: `ibv_reg_mr` failed).
    fn alloc(&self, len: usize, access: Access) -> Result<Self::Region, Self::Error>;

    /// Register `buf` as a region with `access` rights, without copying it; its length is
    /// `buf.len()`.
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc).
    fn register(&self, buf: Vec<u8>, access: Access) -> Result<Self::Region, Self::Error>;

    /// Close every connection of this endpoint with `code` and `reason` (at most
    /// [`MAX_CLOSE_REASON`](crate::MAX_CLOSE_REASON) bytes are sent) and stop accepting.
    fn close(&self, code: u32, reason: &[u8]);
}

/// A connection to one peer: ordered message streams and one-sided operations.
///
/// Cheap to clone (a handle); all clones are the same connection. Offsets and lengths are
/// in bytes. A `range` is a byte range of the local region; `dst_offset`/`src_offset`/
/// `remote_offset` are offsets into the peer's region.
pub trait RdmaConnection: Clone + Send + Sync + 'static {
    /// A memory region of the connection's endpoint.
    type Region: LocalRegion<Error = Self::Error>;
    /// The backend's error type.
    type Error: OpError;
    /// An ordered message stream: a `Stream` of the messages received on it (ending with
    /// `None` when the peer finished sending) and a `Sink` of messages to send (a send
    /// resolves when the message is acknowledged; `poll_close` finishes the send side).
    type Stream: Stream<Item = Result<Bytes, Self::Error>>
        + Sink<Bytes, Error = Self::Error>
        + Send
        + Unpin
        + 'static;

    /// The peer's address, if known.
    fn remote_addr(&self) -> Option<SocketAddr>;

    /// Open a new stream to the peer. The peer sees it in
    /// [`accept_stream`](Self::accept_stream) when the first message arrives.
    ///
    /// # Errors
    /// The connection ended, or the backend's stream limit is reached.
    fn open_stream(&self) -> Result<Self::Stream, Self::Error>;

    /// The next stream the peer opened; `None` once the connection ended.
    ///
    /// # Cancel safety
    /// Cancel safe: a stream is taken only when the future resolves.
    fn accept_stream(&self) -> impl Future<Output = Option<Self::Stream>> + Send;

    /// RDMA WRITE: copy `src[range]` into the peer's region `dst` at `dst_offset`.
    /// Resolves once every byte has landed in the peer's memory. Leave `src[range]`
    /// unchanged until then.
    ///
    /// # Errors
    /// A refusal by the peer (bad rkey, out of bounds, no `REMOTE_WRITE` right) has
    /// [`wc_status`](OpError::wc_status) `Some(RemoteAccessError)`; a local range outside
    /// `src` or a region of another endpoint is an error without status (or
    /// `LocalProtectionError`); the end of the connection flushes it.
    fn write(
        &self,
        src: &Self::Region,
        range: Range<u64>,
        dst: RemoteRegion,
        dst_offset: u64,
    ) -> impl Future<Output = Result<WorkCompletion, Self::Error>> + Send;

    /// RDMA WRITE with immediate: as [`write`](Self::write), and the peer's
    /// [`recv_imm`](Self::recv_imm) yields `(imm, range length)` once every byte landed.
    ///
    /// # Errors
    /// As [`write`](Self::write).
    fn write_with_imm(
        &self,
        src: &Self::Region,
        range: Range<u64>,
        dst: RemoteRegion,
        dst_offset: u64,
        imm: u32,
    ) -> impl Future<Output = Result<WorkCompletion, Self::Error>> + Send;

    /// The next WRITE with immediate the peer made into this endpoint's memory:
    /// `(imm, byte_len)`; every byte of it is visible when this resolves. `None` once the
    /// connection ended.
    ///
    /// # Cancel safety
    /// Cancel safe: a notification is taken only when the future resolves.
    fn recv_imm(&self) -> impl Future<Output = Option<(u32, u32)>> + Send;

    /// RDMA READ: copy the peer's region `src` from `src_offset` into `dst[range]` (`dst`
    /// needs `LOCAL_WRITE`, the peer's region `REMOTE_READ`). Resolves once every byte is
    /// in `dst`.
    ///
    /// # Errors
    /// As [`write`](Self::write) (`RemoteAccessError` without `REMOTE_READ`).
    fn read(
        &self,
        dst: &Self::Region,
        range: Range<u64>,
        src: RemoteRegion,
        src_offset: u64,
    ) -> impl Future<Output = Result<WorkCompletion, Self::Error>> + Send;

    /// Atomic compare-and-swap on the 8 bytes (u64 in the responder's byte order — little
    /// endian on every supported host — 8-byte aligned) at `remote_offset` of the peer's
    /// region (`REMOTE_ATOMIC`): if they equal `compare` they become `swap`. Returns the
    /// value before the operation.
    ///
    /// # Errors
    /// As [`write`](Self::write); a misaligned address is refused by the responder
    /// (`RemoteInvalidRequest` or `RemoteAccessError`, backend-dependent).
    fn compare_swap(
        &self,
        remote: RemoteRegion,
        remote_offset: u64,
        compare: u64,
        swap: u64,
    ) -> impl Future<Output = Result<u64, Self::Error>> + Send;

    /// Atomic fetch-and-add of `add` (wrapping) on the 8 bytes at `remote_offset` of the
    /// peer's region (`REMOTE_ATOMIC`). Returns the value before the operation.
    ///
    /// # Errors
    /// As [`compare_swap`](Self::compare_swap).
    fn fetch_add(
        &self,
        remote: RemoteRegion,
        remote_offset: u64,
        add: u64,
    ) -> impl Future<Output = Result<u64, Self::Error>> + Send;

    /// Close the connection with an application `code` and `reason` (at most
    /// [`MAX_CLOSE_REASON`](crate::MAX_CLOSE_REASON) bytes are sent); the peer's
    /// [`closed`](Self::closed) reports them as
    /// [`ConnectionError::ClosedByPeer`]. Pending operations are flushed
    /// (`WrFlushError`).
    fn close(&self, code: u32, reason: &[u8]);

    /// Wait until the connection ends, and say why (`LocallyClosed`, `ClosedByPeer` with
    /// the peer's code and reason, `IdleTimeout`, `RetryExceeded`, ...).
    ///
    /// # Cancel safety
    /// Cancel safe: it only observes.
    fn closed(&self) -> impl Future<Output = ConnectionError> + Send;
}
