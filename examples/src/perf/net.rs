//! Endpoints of a run: the UDP backend, optionally impaired, optionally recorded.

use super::cli::Settings;
use super::pcap::{PcapBackend, PcapSink};
use metaroce_tokio::backend::{DatagramBackend, ImpairStats, Impaired, Impairment, UdpBackend};
use metaroce_tokio::{Config, Endpoint};
use std::net::SocketAddr;
use std::sync::Arc;

/// One endpoint and the handles to read its backend's counters.
#[derive(Debug)]
pub struct Node {
    /// The endpoint.
    pub ep: Endpoint,
    /// The impairment layer, when one is configured.
    pub impaired: Option<Arc<Impaired<UdpBackend>>>,
}

impl Node {
    /// Binds an endpoint at `addr`: UDP, wrapped in the impairments of `s` (seeded with
    /// `impair_seed`), wrapped in the pcap recorder when `pcap` is given (outermost, so that
    /// it records what the transport sent before the impairment decides its fate).
    pub fn bind(
        addr: SocketAddr,
        s: &Settings,
        impair_seed: u64,
        core_seed: u64,
        pcap: Option<&Arc<PcapSink>>,
    ) -> std::io::Result<Node> {
        let mut config = Config::default();
        config.transport.paths = s.paths;
        config.transport.pmtu = s.mtu;
        config.seed = Some(core_seed);
        let udp = UdpBackend::bind_with(addr, usize::from(s.paths), &config.udp)?;
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
        let ep = Endpoint::with_backend(backend, config)?;
        Ok(Node { ep, impaired })
    }

    /// The impairment counters (zero without impairment).
    pub fn impair_stats(&self) -> ImpairStats {
        self.impaired
            .as_ref()
            .map(|i| i.stats())
            .unwrap_or_default()
    }
}
