//! Packet-level trace records handed to the hook set with
//! [`Sim::set_trace`](super::Sim::set_trace).

use super::{HostId, LinkId, SwitchId};
use crate::wire::Opcode;
use crate::EcnCodepoint;
use std::net::SocketAddrV4;
use std::time::Duration;

/// The UDP 5-tuple of a packet (the protocol is always UDP, 17).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Flow {
    /// Source IP and UDP source port (the sending path's ECMP entropy).
    pub src: SocketAddrV4,
    /// Destination IP and UDP port (4791 for RoCEv2).
    pub dst: SocketAddrV4,
}

/// Where a trace event happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Location {
    /// On a link (its queue or its wire).
    Link(LinkId),
    /// In a switch (routing).
    Switch(SwitchId),
    /// At a host (injection or delivery).
    Host(HostId),
}

/// Why a packet was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// Tail drop at a full queue.
    QueueFull,
    /// Random loss on the wire.
    RandomLoss,
    /// Gilbert–Elliott burst loss on the wire.
    BurstLoss,
    /// The link is a blackhole.
    Blackhole,
    /// The link was down when the packet was sent on it, or went down before the packet
    /// arrived.
    LinkDown,
    /// No route to the destination IP (unknown address, or unreachable from this switch),
    /// or the host has no uplink.
    NoRoute,
    /// The destination is not an IPv4 address.
    NotIpv4,
    /// No endpoint listens on the destination UDP port at the destination host.
    PortUnreachable,
}

/// What happened to the packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TraceKind {
    /// Accepted into a link's queue; `queue_bytes` includes the packet.
    Enqueue,
    /// Fully serialized onto the link (left the queue); `queue_bytes` is what remains.
    /// Only produced while a trace hook is set (it costs an event per packet and hop).
    Dequeue,
    /// Dropped.
    Drop(DropReason),
    /// Marked CE by the queue it joined (reported just before its `Enqueue`).
    Mark,
    /// Duplicated by the link: the copy's `Enqueue` follows.
    Duplicate,
    /// A byte was flipped on the wire.
    Corrupt,
    /// Handed to the destination host's endpoint.
    Deliver,
}

/// One packet-level event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceEvent {
    /// Simulated time since the start of the simulation (ns resolution).
    pub time: Duration,
    /// What happened.
    pub kind: TraceKind,
    /// Where.
    pub location: Location,
    /// UDP payload bytes of the packet.
    pub len: u32,
    /// For link events, the link's queue in wire bytes (see [`TraceKind`]); 0 otherwise.
    pub queue_bytes: u64,
    /// The packet's 5-tuple.
    pub flow: Flow,
    /// The packet's ECN codepoint at that moment.
    pub ecn: Option<EcnCodepoint>,
    /// BTH opcode, if the payload is at least a BTH long.
    pub opcode: Option<Opcode>,
    /// BTH PSN (24 bits), if the payload is at least a BTH long.
    pub psn: Option<u32>,
}

/// The BTH opcode and PSN of a UDP payload, if it is long enough to hold a BTH.
pub(crate) fn bth_fields(data: &[u8]) -> (Option<Opcode>, Option<u32>) {
    match data {
        [op, _, _, _, _, _, _, _, _, a, b, c, ..] => {
            (Some(Opcode(*op)), Some(u32::from_be_bytes([0, *a, *b, *c])))
        }
        _ => (None, None),
    }
}
