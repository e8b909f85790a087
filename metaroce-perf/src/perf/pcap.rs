//! `--pcap`: a [`DatagramBackend`] wrapper that records every datagram the transport asks
//! to send into a classic pcap file, as RoCEv2 frames tshark decodes.
//!
//! A UDP socket never shows the transport the real Ethernet/IP headers, so each recorded
//! frame gets synthesized ones: made-up MAC addresses, the IP header metaroce itself
//! assumes for its ICRC ([`IpHeader::synthesized`]: the endpoint's local IP and the
//! destination IP), and a UDP header from the path's source port to **port 4791** (so
//! Wireshark's RoCEv2 dissector picks it up whatever port the peer really listens on), with
//! checksum 0. Because the destination port is covered by the ICRC, the ICRC of the copy is
//! re-stamped for exactly those headers, which makes every recorded packet verify.
//!
//! The wrapper sits outside any impairment layer: it records what the transport sent,
//! including datagrams the impairment then drops.

use metaroce::wire::icrc::{self, IpHeader};
use metaroce::Transmit;
use metaroce_tokio::backend::DatagramBackend;
use pcap_file::pcap::{PcapHeader, PcapPacket, PcapWriter};
use pcap_file::{DataLink, Endianness, TsResolution};
use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufWriter};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

/// RoCEv2 UDP port.
const ROCE_PORT: u16 = 4791;
const ETH_LEN: usize = 14;
const ETHERTYPE_IPV4: u16 = 0x0800;
const ETHERTYPE_IPV6: u16 = 0x86dd;
/// Snap length: an IPv4 datagram never exceeds 65 535 bytes plus the Ethernet header.
const SNAPLEN: u32 = 65_535 + ETH_LEN as u32;

/// The shared pcap file of one process (both endpoints write to it in loopback).
#[derive(Debug)]
pub struct PcapSink {
    writer: Mutex<Option<PcapWriter<BufWriter<File>>>>,
    max_packets: u64,
    written: AtomicU64,
    not_recorded: AtomicU64,
    errors: AtomicU64,
}

/// What a capture amounted to.
#[derive(Debug, Clone, Copy)]
pub struct PcapSummary {
    /// Packets written.
    pub written: u64,
    /// Packets sent during the run after the cap was reached.
    pub not_recorded: u64,
    /// Packets that could not be framed or written.
    pub errors: u64,
}

impl PcapSink {
    /// Creates `path` with a little-endian, microsecond, Ethernet pcap header.
    pub fn create(path: &Path, max_packets: u64) -> io::Result<Arc<PcapSink>> {
        let file = File::create(path)?;
        let header = PcapHeader {
            version_major: 2,
            version_minor: 4,
            ts_correction: 0,
            ts_accuracy: 0,
            snaplen: SNAPLEN,
            datalink: DataLink::ETHERNET,
            ts_resolution: TsResolution::MicroSecond,
            endianness: Endianness::Little,
        };
        let writer = PcapWriter::with_header(BufWriter::with_capacity(1 << 20, file), header)
            .map_err(io::Error::other)?;
        Ok(Arc::new(PcapSink {
            writer: Mutex::new(Some(writer)),
            max_packets,
            written: AtomicU64::new(0),
            not_recorded: AtomicU64::new(0),
            errors: AtomicU64::new(0),
        }))
    }

    /// Records one UDP payload (a RoCEv2 packet, BTH … ICRC) sent from `src`:`sport` to
    /// `dst`.
    fn record(&self, src: IpAddr, dst: IpAddr, sport: u16, payload: &[u8]) {
        if self.written.load(Ordering::Relaxed) >= self.max_packets {
            self.not_recorded.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let Some(frame) = frame(src, dst, sport, payload) else {
            self.errors.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let mut guard = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        // After `finish` (the run is over: closing packets) nothing is recorded.
        let Some(w) = guard.as_mut() else {
            return;
        };
        // Re-check under the lock so that concurrent writers never exceed the cap.
        if self.written.load(Ordering::Relaxed) >= self.max_packets {
            self.not_recorded.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let packet = PcapPacket::new(ts, frame.len() as u32, &frame);
        match w.write_packet(&packet) {
            Ok(_) => {
                self.written.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Flushes and closes the file; later packets are not recorded.
    pub fn finish(&self) -> io::Result<PcapSummary> {
        let w = self.writer.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(w) = w {
            use std::io::Write;
            w.into_writer().flush()?;
        }
        Ok(PcapSummary {
            written: self.written.load(Ordering::Relaxed),
            not_recorded: self.not_recorded.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        })
    }
}

/// A made-up locally administered MAC address derived from an IP address.
fn mac_for(ip: IpAddr) -> [u8; 6] {
    let o = match ip {
        IpAddr::V4(v4) => v4.octets(),
        IpAddr::V6(v6) => {
            let s = v6.octets();
            [s[12], s[13], s[14], s[15]]
        }
    };
    [0x02, 0x00, o[0], o[1], o[2], o[3]]
}

/// Ethernet + IP + UDP (dport 4791) + the payload with its ICRC re-stamped for those
/// headers. `None` if the headers cannot be built (mixed families, oversize, or a payload
/// too short to hold a BTH and an ICRC).
fn frame(src: IpAddr, dst: IpAddr, sport: u16, payload: &[u8]) -> Option<Vec<u8>> {
    let ip = IpHeader::synthesized(src, dst).ok()?;
    let udp = icrc::udp_header(sport, ROCE_PORT, payload.len()).ok()?;
    let udp_len = u16::try_from(udp.len() + payload.len()).ok()?;
    let ip_len = ip.header_len();
    let mut f = vec![0u8; ETH_LEN + ip_len + udp.len() + payload.len()];
    let ethertype = match ip {
        IpHeader::V4 { .. } => ETHERTYPE_IPV4,
        IpHeader::V6 { .. } => ETHERTYPE_IPV6,
    };
    f[0..6].copy_from_slice(&mac_for(ip.dst()));
    f[6..12].copy_from_slice(&mac_for(ip.src()));
    f[12..14].copy_from_slice(&ethertype.to_be_bytes());
    ip.to_bytes(udp_len, &mut f[ETH_LEN..ETH_LEN + ip_len])
        .ok()?;
    let udp_at = ETH_LEN + ip_len;
    f[udp_at..udp_at + udp.len()].copy_from_slice(&udp);
    let body = &mut f[udp_at + udp.len()..];
    body.copy_from_slice(payload);
    icrc::stamp(&ip, sport, ROCE_PORT, body).ok()?;
    Some(f)
}

/// Wraps a backend and records what it is asked to send into a [`PcapSink`].
pub struct PcapBackend {
    inner: Box<dyn DatagramBackend>,
    sink: Arc<PcapSink>,
    /// The local IP, or `None` when bound to the unspecified address (then the source IP of
    /// each destination is looked up once, as the kernel would route it).
    local_ip: Option<IpAddr>,
    routes: Mutex<HashMap<IpAddr, IpAddr>>,
    /// The last transmit was recorded but the inner backend returned `Pending`: the retry
    /// of the same transmit must not be recorded again.
    retry_recorded: AtomicBool,
}

impl std::fmt::Debug for PcapBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PcapBackend")
            .field("inner", &self.inner)
            .field("local_ip", &self.local_ip)
            .finish_non_exhaustive()
    }
}

impl PcapBackend {
    /// Records the sends of `inner` into `sink`.
    pub fn new(inner: Box<dyn DatagramBackend>, sink: Arc<PcapSink>) -> PcapBackend {
        let ip = inner.local_addr().ip();
        PcapBackend {
            local_ip: (!ip.is_unspecified()).then_some(ip),
            inner,
            sink,
            routes: Mutex::new(HashMap::new()),
            retry_recorded: AtomicBool::new(false),
        }
    }

    fn source_ip(&self, dst: IpAddr) -> IpAddr {
        if let Some(ip) = self.local_ip {
            return ip;
        }
        let mut routes = self.routes.lock().unwrap_or_else(|e| e.into_inner());
        *routes.entry(dst).or_insert_with(|| route_source(dst))
    }

    fn record(&self, transmit: &Transmit, contents: &[u8]) {
        let dst = transmit.destination.ip();
        let src = self.source_ip(dst);
        let segment = match transmit.segment_size {
            Some(s) if s > 0 => s,
            _ => contents.len().max(1),
        };
        for datagram in contents.chunks(segment) {
            self.sink.record(src, dst, transmit.src_port, datagram);
        }
    }
}

/// The source IP the kernel would use towards `dst` (a connected UDP socket tells without
/// sending anything); the unspecified address if that fails.
pub fn route_source(dst: IpAddr) -> IpAddr {
    let bind: SocketAddr = match dst {
        IpAddr::V4(_) => SocketAddr::from(([0, 0, 0, 0], 0)),
        IpAddr::V6(_) => SocketAddr::from(([0u16; 8], 0)),
    };
    std::net::UdpSocket::bind(bind)
        .and_then(|s| {
            s.connect(SocketAddr::new(dst, ROCE_PORT))?;
            s.local_addr()
        })
        .map(|a| a.ip())
        .unwrap_or(bind.ip())
}

impl DatagramBackend for PcapBackend {
    // Everything but sending is the inner backend's, unchanged.
    metaroce_tokio::forward_datagram_backend!([.inner] local_addr, source_ports,
        max_gso_segments, max_gro_segments, socket_recv_buffer, poll_recv, poll_recv_in_place,
        flush, send_from_any_task);

    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        transmit: &Transmit,
        contents: &[u8],
    ) -> Poll<io::Result<()>> {
        if !self.retry_recorded.swap(false, Ordering::Relaxed) {
            self.record(transmit, contents);
        }
        let res = self.inner.poll_send(cx, transmit, contents);
        if res.is_pending() {
            self.retry_recorded.store(true, Ordering::Relaxed);
        }
        res
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_verifies_with_raw_headers() {
        // A minimal RC SEND_ONLY-shaped payload: 12-byte BTH, 4 bytes data, 4-byte ICRC.
        let mut payload = vec![0u8; 20];
        payload[0] = 0x04;
        let src: IpAddr = "10.0.0.1".parse().unwrap();
        let dst: IpAddr = "10.0.0.2".parse().unwrap();
        let f = frame(src, dst, 50000, &payload).unwrap();
        let ip = &f[ETH_LEN..ETH_LEN + 20];
        let udp = &f[ETH_LEN + 20..ETH_LEN + 28];
        assert_eq!(u16::from_be_bytes([udp[2], udp[3]]), 4791);
        icrc::verify_raw(ip, udp, &f[ETH_LEN + 28..]).unwrap();
    }
}
