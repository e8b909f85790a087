//! # metaroce — sans-IO core of a MetaRoCE-class RDMA transport
//!
//! (crate docs are filled in as the layers land)
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod config;
pub mod conn;
pub mod endpoint;
pub mod event;
pub mod mr;
pub mod transmit;
pub mod wire;

pub use config::{CongestionConfig, EndpointConfig, TransportConfig};
pub use conn::{ConnectionStats, PathStats};
pub use endpoint::{Endpoint, EndpointStats, PostError, WriteRequest};
pub use event::{ConnectionError, ConnectionHandle, Event, WcOpcode, WcStatus, WorkCompletion};
pub use mr::{Access, MrError, MrKeys};
pub use transmit::{EcnCodepoint, Transmit};
