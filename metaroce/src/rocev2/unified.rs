//! RC queue pairs on a MetaRoCE [`Endpoint`]: one endpoint, one memory-region table, two
//! kinds of connections.
//!
//! [`Endpoint::handle_datagram`] dispatches every packet by its BTH opcode: standard RC
//! opcodes (`0x00..=0x14`, [`is_rc_opcode`](super::is_rc_opcode)) go to the RC QP named
//! by BTH.DestQP, MetaRoCE opcodes (`0xC0..`) to the MetaRoCE connection named by it (the
//! two QPN spaces are separate). [`Endpoint::poll_transmit`] alternates between RC QPs
//! carried as UDP datagrams ([`RcWire::Udp`]) and MetaRoCE connections;
//! [`Endpoint::poll_timeout`], [`Endpoint::handle_timeout`] and [`Endpoint::poll_event`]
//! (as [`Event::Rc`](crate::Event::Rc)) cover both. [`RcWire::Native`] QPs, which need a
//! raw-IP backend, have their own output and input: [`Endpoint::poll_rc_transmit`] and
//! [`Endpoint::handle_ip_packet`].

use super::host::{validate, RcHost, RcQps};
#[cfg(doc)]
use super::RcWire;
use super::{RcConfig, RcError, RcStats, RcTransmit};
use crate::Endpoint;
use std::time::Instant;

impl Endpoint {
    /// The RC queue pairs (RoCEv2 mode) of this endpoint: create, connect (choosing the
    /// [`RcWire`] per QP), post work requests. They use this endpoint's memory regions:
    /// keys from [`Endpoint::register_mr`] are valid on RC QPs and MetaRoCE connections
    /// alike. Completions arrive as [`Event::Rc`](crate::Event::Rc).
    ///
    /// ```
    /// use metaroce::rocev2::{ConnectAttrs, QpInit, RcWire};
    /// use metaroce::{Access, Endpoint, EndpointConfig};
    ///
    /// let mut ep = Endpoint::new(EndpointConfig::new("10.0.0.1:4791".parse().unwrap(), vec![50000]))?;
    /// let mr = ep.register_mr(vec![0; 4096], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    /// let qp = ep.rc().create_qp(QpInit { access: Access::REMOTE_WRITE, ..QpInit::default() })?;
    /// // ... exchange qp.qpn / qp.psn / mr.addr / mr.rkey with the peer out of band, then:
    /// let peer = "10.0.0.2:4791".parse().unwrap();
    /// let attrs = ConnectAttrs::new("10.0.0.2".parse().unwrap(), 0x12, 0x3456);
    /// ep.rc().connect_qp(qp.qpn, attrs, RcWire::Udp { peer, local_ip: None })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn rc(&mut self) -> RcQps<'_> {
        RcQps::new(&mut self.rc, &mut self.mrs)
    }

    /// Configuration of the RC queue pairs: limits, [`RcConfig::local_ip`] (the endpoint's
    /// local IP unless set), seed of their QPNs and PSNs.
    pub fn rc_config(&self) -> &RcConfig {
        self.rc.config()
    }

    /// Replace the RC configuration; allowed only while no RC QP exists. An unspecified
    /// `cfg.local_ip` is replaced by the endpoint's local IP. Errors:
    /// [`RcError::Invalid`] for an invalid configuration, [`RcError::TooManyQps`] when QPs
    /// exist.
    pub fn set_rc_config(&mut self, mut cfg: RcConfig) -> Result<(), RcError> {
        validate(&cfg)?;
        if !self.rc.is_empty() {
            return Err(RcError::TooManyQps);
        }
        if cfg.local_ip.is_unspecified() {
            cfg.local_ip = self.config().local_addr.ip();
        }
        self.rc = RcHost::new(cfg)?;
        Ok(())
    }

    /// Counters of the RC side (packets received, bad ICRC, malformed, no QP, sent).
    pub fn rc_stats(&self) -> RcStats {
        self.rc.stats()
    }

    /// A whole received IP packet for a [`RcWire::Native`] QP (IPv4 without options or
    /// IPv6, UDP to port 4791), as a raw-IP backend delivers it; the ICRC is checked over
    /// the received headers. Anything else is counted in [`rc_stats`](Self::rc_stats)
    /// and dropped; never panics.
    pub fn handle_ip_packet(&mut self, now: Instant, packet: &[u8]) {
        self.rc.handle_ip_packet(now, packet, &mut self.mrs);
    }

    /// The next packet of a [`RcWire::Native`] QP: the UDP payload goes to `buf`, the
    /// [`RcTransmit`] names the IP and UDP headers the ICRC covers, which the raw-IP
    /// backend must send exactly ([`RcTransmit::write_ip_packet`]). Call until `None`
    /// after every input, beside [`poll_transmit`](Self::poll_transmit). A backend
    /// without raw IP never calls it and must not connect `Native` QPs.
    pub fn poll_rc_transmit(&mut self, now: Instant, buf: &mut Vec<u8>) -> Option<RcTransmit> {
        self.rc.poll_native(now, buf, &self.mrs)
    }
}
