//! # metaroce — sans-IO core of a MetaRoCE-class RDMA transport
//!
//! RDMA semantics (memory regions with rkeys, SEND/RECV on ordered message streams, RDMA
//! WRITE and WRITE with immediate, work completions) over a delivery layer built for lossy,
//! multipath Ethernet: every packet carries its own placement, packets are sprayed over
//! many paths (UDP source ports, i.e. ECMP entropy), each path has its own 24-bit PSN
//! space, window and RTT, and 256-packet selective ACKs turn a hole into an immediate
//! retransmission. Packets are RoCEv2-framed (BTH, ICRC) with MetaRoCE opcodes in the
//! manufacturer-specific range; `docs/PROTOCOL.md` gives the wire format byte by byte.
//!
//! This crate does no I/O: no sockets, no clock, no threads, no global randomness. Time
//! comes in as [`Instant`](std::time::Instant) arguments and randomness from the seeds in
//! [`EndpointConfig`] (`seed` for QPNs and PSNs, `secret_seed` for nonces, tokens, cookies
//! and memory keys), so the same inputs always give the same outputs — which is what
//! makes simulation, property tests and fuzzing possible. Real deployments must take both
//! seeds from the operating system; `metaroce-tokio`, which drives the core over real
//! sockets, does.
//!
//! ## The driving contract
//!
//! An [`Endpoint`] is driven like `quinn-proto`'s:
//!
//! * **Inputs**: [`Endpoint::handle_datagram`]`(now, from, local_ip, ecn, bytes)` for every
//!   UDP datagram received on the endpoint's address (split GRO buffers first);
//!   [`Endpoint::handle_timeout`]`(now)` when the time from `poll_timeout` has come;
//!   application calls: [`Endpoint::connect`], [`Endpoint::register_mr`],
//!   [`Endpoint::post_send`], [`Endpoint::post_write`], [`Endpoint::close`].
//! * **Outputs**, drained after every input, in this order:
//!   1. [`Endpoint::poll_transmit`]`(now, &mut buf)` until `None`: each
//!      [`Transmit`] names the destination, the local source port (a path's ECMP
//!      entropy), the ECN codepoint and, for GSO, the segment size of the datagrams packed
//!      in `buf`;
//!   2. [`Endpoint::poll_timeout`]: the next time `handle_timeout` is due;
//!   3. [`Endpoint::poll_event`] until `None`: connection events, work completions,
//!      received messages and WRITE-with-immediate notifications ([`Event`]).
//!
//! Nothing here panics or allocates without bound on input from the network: malformed
//! packets are counted in [`EndpointStats`] and dropped; every limit is a field of
//! [`TransportConfig`].
//!
//! ## Layers
//!
//! * [`wire`]: zero-copy views and emitters for BTH, the RoCEv2 extended headers and the
//!   MetaRoCE extension headers; the ICRC.
//! * Delivery layer (`conn::path`, [`conn::cc`], [`conn::rtt`]): per-path PSNs, SACK
//!   windows, loss detection, tail-loss probes and retransmission timeouts, AIMD windows
//!   behind the [`conn::cc::CongestionController`] seam.
//! * Semantic layer (`conn::send`, `conn::recv`, [`mr`]): operations and their
//!   segmentation, placement into memory regions with rkey/bounds/access checks,
//!   exactly-once in-order delivery per stream, completions in posting order per stream
//!   and among one-sided operations.
//! * [`rocev2`]: standard RC queue pairs (RoCEv2 mode), selectable per connection on the same
//!   [`Endpoint`] ([`Endpoint::rc`]) over the same memory regions, or stand-alone
//!   ([`rocev2::RcEndpoint`]). Received packets are dispatched by BTH opcode: standard RC
//!   opcodes to the RC QPs, MetaRoCE opcodes to the connections.
//!
//! ## One API over every backend
//!
//! [`api`] holds the traits ([`api::RdmaEndpoint`], [`api::RdmaConnection`],
//! [`api::LocalRegion`], [`api::OpError`]) and the [`RemoteRegion`] descriptor that both
//! `metaroce-tokio` (UDP) and `metaroce-verbs` (RDMA NICs through libibverbs) implement, so
//! an application written once against them runs over either.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod api;
pub mod config;
pub mod conn;
pub mod crypto;
pub mod endpoint;
pub mod event;
pub mod fasthash;
pub mod mr;
pub mod multipath;
pub mod rocev2;
pub(crate) mod secret;
#[cfg(feature = "sim")]
pub mod sim;
#[cfg(feature = "testing")]
pub mod testing;
pub mod transmit;
pub mod wire;

pub use api::RemoteRegion;
pub use config::{
    ConfigError, CongestionAlgorithm, CongestionConfig, EndpointConfig, RetryPolicy,
    TransportConfig,
};
pub use conn::send::{STREAM_CODE_REFUSED, STREAM_CODE_RNR};
pub use conn::AtomicOp;
pub use conn::{ConnectionStats, PathInfo, PathState, PathStats};
pub use endpoint::{
    AtomicRequest, CancelOutcome, Endpoint, EndpointStats, PostError, ReadRequest, RecvRequest,
    SendLimits, TableSizes, WriteRequest, MAX_CLOSE_REASON,
};
pub use event::{ConnectionError, ConnectionHandle, Event, WcOpcode, WcStatus, WorkCompletion};
pub use mr::{Access, MrError, MrKeys, RegionMemory};
pub use transmit::{EcnCodepoint, LendHandle, Lent, LentSpan, Transmit};
