//! `metaroce-verbs`: metaroce on RDMA NICs (and soft-RoCE, `rdma_rxe`) through libibverbs.
//!
//! * [`Context`]: an open RDMA device; its ports ([`PortAttr`]) and GID table
//!   ([`GidEntry`], RoCEv2 IPv4/IPv6 selection with [`Context::select_gid`]).
//! * [`Pd`]: a protection domain; [`Pd::register`] makes an [`Mr`] of a user-owned buffer.
//!   The buffer lives exactly as long as its registration, and an [`Mr`] dropped while work
//!   requests that use it are outstanding is neither deregistered nor freed until their
//!   completions have been polled (or their QP destroyed, after which the device can no
//!   longer touch it).
//! * [`RcQp`]: an RC QP with its own CQ and completion channel; the channel's fd is driven by
//!   tokio's `AsyncFd` in a small task (no busy polling when idle). SEND/RECV as an ordered
//!   message stream ([`RcQp::send`], [`RcQp::recv`], [`MessageStream`] as `Stream` + `Sink`),
//!   RDMA WRITE, WRITE_WITH_IMM, READ and the atomics CMP_SWP / FETCH_ADD, each returning a
//!   [`Wc`] whose status is a [`metaroce::WcStatus`].
//! * [`exchange`]: connection setup with `ibv_rc_pingpong`'s out-of-band TCP exchange.
//! * [`VerbsEndpoint`], [`VerbsConnection`], [`VerbsStream`]: the `metaroce::api` traits
//!   (`RdmaEndpoint`, `RdmaConnection`, `LocalRegion` for [`Mr`], `OpError` for [`Error`]),
//!   so code written against them runs over UDP (metaroce-tokio) and over a NIC unchanged.
//!
//! # Binding
//! libibverbs is opened with `dlopen` at run time ([`ffi`](crate) module, through the
//! `libloading` crate), so the crate builds with no rdma-core headers or libraries, and on a
//! machine without them [`Context::open`] fails with [`Error::LibraryNotFound`] (without a
//! device: [`Error::NoDevice`]) instead of failing to start. The `sideway` crate was the
//! first choice; its `rdma-mummy-sys` compiles a vendored rdma-core with `cmake` and runs
//! `bindgen` (libclang) at build time, neither of which this project's build machines have,
//! so `cargo build --workspace` would fail there. The data-path verbs are `static inline` in
//! `verbs.h`; like them, the crate calls the provider's ops table. `unsafe` code lives in two
//! small modules (`ffi`, `buf`); the `ffi` functions whose misuse would free or reach memory
//! the device still uses (registration, posting, destroying) are `unsafe fn`s with their
//! contract, called from the owning types in `device`, `mr` and `qp`. Each `unsafe` block
//! has a `// SAFETY:` comment; struct layouts are asserted at compile time.
//!
//! # Runtime
//! [`RcQp::create`] spawns its completion task on the current tokio runtime (it panics, as
//! `tokio::spawn` does, outside one; [`RcQp::create`] checks and returns
//! [`Error::InvalidArgument`] instead).

mod api;
mod buf;
mod device;
pub mod exchange;
mod ffi;
mod mr;
pub mod multipath;
mod qp;
mod stream;

pub use api::{VerbsConnection, VerbsEndpoint, VerbsStream, CLOSE_STREAM_LIMIT};
pub use device::{devices, Context, GidEntry, GidType, PortAttr};
pub use metaroce::RemoteRegion;
pub use metaroce::{Access, WcOpcode, WcStatus};
pub use mr::{Mr, Pd};
pub use multipath::{Incoming, MpConfig, MpConnection, MpStats};
pub use qp::{
    CqPoll, Message, OpFuture, QpConfig, QpEndpoint, QpState, RcQp, RecvInfo, Wc, SPIN_BURST,
};
pub use stream::MessageStream;

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `libibverbs.so.1` could not be loaded (rdma-core is not installed), or lacks a symbol.
    #[error("libibverbs not found: {0}")]
    LibraryNotFound(String),
    /// No RDMA device (or none of the requested name) is present.
    #[error("no RDMA device{}", .0.as_ref().map(|n| format!(" named {n:?}")).unwrap_or_default())]
    NoDevice(Option<String>),
    /// A verb failed (the source is the errno it set or returned).
    #[error("{op} failed")]
    Verbs {
        /// The verb (`ibv_reg_mr`, `ibv_modify_qp(RTR)`, ...).
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The work request completed with an error status.
    #[error("work completion error: {status} (ibv_wc_status {code}, vendor_err {vendor_err:#x})")]
    Completion {
        /// The status as metaroce names it.
        status: WcStatus,
        /// The exact `ibv_wc_status` code.
        code: u32,
        /// The provider's vendor error.
        vendor_err: u32,
    },
    /// A bad argument from the application (range, size, alignment, configuration).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// No free send-queue slot for a non-waiting `post_*` call (use the async form to wait).
    #[error("send queue full")]
    SendQueueFull,
    /// No GID of the wanted kind on the port.
    #[error("no {0} GID on the port")]
    NoGid(&'static str),
    /// The QP was closed (dropped, or the runtime driving it shut down).
    #[error("QP closed")]
    Closed,
    /// The out-of-band exchange failed.
    #[error("out-of-band exchange failed")]
    Exchange(#[source] std::io::Error),
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn verbs_err(op: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Verbs { op, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without RDMA (this crate's CI host), opening fails with a clear error.
    #[test]
    fn open_without_device_is_a_clear_error() {
        match Context::open(None) {
            Ok(c) => eprintln!("an RDMA device is present here: {}", c.name()),
            Err(e @ (Error::LibraryNotFound(_) | Error::NoDevice(_))) => {
                let s = e.to_string();
                assert!(
                    s.contains("libibverbs not found") || s.contains("no RDMA device"),
                    "{s}"
                );
            }
            Err(e) => panic!("unexpected error: {e:?}"),
        }
        match Context::open(Some("no-such-dev0")) {
            Err(Error::LibraryNotFound(_)) | Err(Error::NoDevice(Some(_))) => {}
            other => panic!("unexpected: {other:?}"),
        }
    }
}
