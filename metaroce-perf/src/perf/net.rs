//! Endpoints of a run: the UDP backend, optionally impaired, optionally recorded, under a
//! MetaRoCE endpoint or (`--mode rocev2`) an RC endpoint.

use super::cli::Settings;
use super::pcap::{PcapBackend, PcapSink};
use metaroce::rocev2::RcConfig;
use metaroce_tokio::backend::{
    bind_backend, DatagramBackend, ImpairStats, Impaired, Impairment, UdpConfig, UringConfig,
};
use metaroce_tokio::rocev2::{RcEndpoint, UdpIpBackend};
use metaroce_tokio::{Config, Endpoint};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

/// A datagram stack and its impairment layer (to read the counters), if any.
type Stack = (
    Box<dyn DatagramBackend>,
    Option<Arc<Impaired<Box<dyn DatagramBackend>>>>,
);

/// Binds the `--backend` sockets (io_uring falls back to UDP with a warning).
fn sockets(
    s: &Settings,
    addr: SocketAddr,
    paths: usize,
    udp: &UdpConfig,
) -> std::io::Result<Box<dyn DatagramBackend>> {
    let config = UringConfig {
        udp: udp.clone(),
        ..UringConfig::default()
    };
    let bound = bind_backend(s.backend.tokio(), addr, paths, &config)?;
    if let Some(why) = &bound.fallback_reason {
        eprintln!("metaroce-perf: --backend uring: {why}; using udp");
    }
    Ok(bound.backend)
}

/// The datagram stack of one endpoint: the backend, wrapped in the impairments of `s` (seeded with
/// `impair_seed`), wrapped in the pcap recorder when `pcap` is given (outermost, so that it
/// records what the transport sent before the impairment decides its fate).
fn stack(
    udp: Box<dyn DatagramBackend>,
    s: &Settings,
    impair_seed: u64,
    pcap: Option<&Arc<PcapSink>>,
) -> std::io::Result<Stack> {
    let mut impaired = None;
    let mut backend: Box<dyn DatagramBackend> = if s.impair.any() {
        let imp = Impairment {
            loss: s.impair.loss,
            duplicate: s.impair.dup,
            reorder: s.impair.reorder,
            reorder_delay: s.impair.reorder_delay,
            ce_mark: s.impair.ce,
            seed: impair_seed,
            ..Impairment::default()
        };
        let layer = Arc::new(Impaired::new(udp, imp).map_err(std::io::Error::other)?);
        impaired = Some(layer.clone());
        Box::new(layer)
    } else {
        Box::new(udp)
    };
    if let Some(sink) = pcap {
        backend = Box::new(PcapBackend::new(backend, sink.clone()));
    }
    Ok((backend, impaired))
}

fn impair_stats(i: &Option<Arc<Impaired<Box<dyn DatagramBackend>>>>) -> ImpairStats {
    i.as_ref().map(|i| i.stats()).unwrap_or_default()
}

/// One MetaRoCE endpoint and the handles to read its backend's counters.
#[derive(Debug)]
pub struct Node {
    /// The endpoint.
    pub ep: Endpoint,
    /// The impairment layer, when one is configured.
    pub impaired: Option<Arc<Impaired<Box<dyn DatagramBackend>>>>,
}

impl Node {
    /// Binds a MetaRoCE endpoint at `addr` over [`stack`].
    pub fn bind(
        addr: SocketAddr,
        s: &Settings,
        impair_seed: u64,
        core_seed: Option<u64>,
        pcap: Option<&Arc<PcapSink>>,
    ) -> std::io::Result<Node> {
        let mut config = Config::default();
        config.transport.paths = s.paths;
        config.transport.pmtu = s.mtu;
        config.transport.max_rd_atomic = u32::from(s.outs);
        // `None`: metaroce-tokio seeds the core from the OS.
        config.seed = core_seed;
        if !s.rebalance {
            config.transport.rebalance_ratio_permille = 0;
        }
        if let Some(d) = s.max_ack_delay {
            config.transport.max_ack_delay = d;
        }
        config.inline_transmit = s.inline_transmit;
        if let Some(k) = &s.encrypt {
            let key = metaroce::crypto::PacketProtectionKey::new(k)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
            config.transport.packet_protection = Some(metaroce::crypto::ProtectionConfig::new(key));
        }
        // Spare source ports for re-rolls (timeouts, ECMP collisions) to move paths to:
        // three per path, so that the pool almost surely reaches every link (8 paths on
        // 3 of 4 links and 8 spares that all miss the 4th: (3/4)^8 = 10 %; 24: 0.1 %).
        let spares = spare_ports(s.paths);
        let udp = sockets(s, addr, usize::from(s.paths + spares), &config.udp)?;
        let (backend, impaired) = stack(udp, s, impair_seed, pcap)?;
        let ep = Endpoint::with_backend(backend, config)?;
        Ok(Node { ep, impaired })
    }

    /// The impairment counters (zero without impairment).
    pub fn impair_stats(&self) -> ImpairStats {
        impair_stats(&self.impaired)
    }
}

/// The sockets of an RC endpoint, bound before the address it advertises is known (a
/// server learns it from the TCP connection of its client).
#[derive(Debug)]
pub struct RcSockets {
    backend: Box<dyn DatagramBackend>,
    impaired: Option<Arc<Impaired<Box<dyn DatagramBackend>>>>,
}

/// The UDP datagram stack under an RC endpoint.
pub type RcBackend = UdpIpBackend<Box<dyn DatagramBackend>>;

impl RcSockets {
    /// Binds one UDP socket to receive on and one source port (an RC QP has one) at
    /// `addr`, over [`stack`].
    pub fn bind(
        addr: SocketAddr,
        s: &Settings,
        impair_seed: u64,
        pcap: Option<&Arc<PcapSink>>,
    ) -> std::io::Result<RcSockets> {
        let udp = sockets(s, addr, 1, &Config::default().udp)?;
        let (backend, impaired) = stack(udp, s, impair_seed, pcap)?;
        Ok(RcSockets { backend, impaired })
    }

    /// The UDP address peers send to.
    pub fn local_addr(&self) -> SocketAddr {
        self.backend.local_addr()
    }

    /// Starts the RC endpoint, advertising `local_ip` (the ICRC covers it).
    pub fn endpoint(
        self,
        local_ip: IpAddr,
        s: &Settings,
        core_seed: Option<u64>,
    ) -> std::io::Result<RcNode> {
        let backend = Arc::new(UdpIpBackend::new(self.backend, local_ip)?);
        let mut cfg = RcConfig::new(local_ip);
        cfg.seed = match core_seed {
            Some(x) => x,
            None => getrandom::u64().map_err(std::io::Error::other)?,
        };
        cfg.max_send_wr = s.tx_depth.max(4096);
        cfg.max_recv_wr = (s.rx_depth + 256).max(4096);
        let ep = RcEndpoint::with_backend(backend.clone(), cfg)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        Ok(RcNode {
            ep,
            backend,
            impaired: self.impaired,
        })
    }
}

/// An RC endpoint over UDP and the handles to read its counters.
#[derive(Debug)]
pub struct RcNode {
    /// The endpoint.
    pub ep: RcEndpoint,
    /// Its backend.
    pub backend: Arc<RcBackend>,
    /// The impairment layer, when one is configured.
    pub impaired: Option<Arc<Impaired<Box<dyn DatagramBackend>>>>,
}

impl RcNode {
    /// The impairment counters (zero without impairment).
    pub fn impair_stats(&self) -> ImpairStats {
        impair_stats(&self.impaired)
    }
}

/// Spare source ports bound beside `paths` path ports, for re-rolls (timeouts, ECMP
/// collisions) to move paths to: three per path, none for a single path.
pub fn spare_ports(paths: u16) -> u16 {
    if paths > 1 {
        3 * paths
    } else {
        0
    }
}
