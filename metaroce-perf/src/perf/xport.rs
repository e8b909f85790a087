//! What the tests run over: a MetaRoCE [`Connection`] or an RC [`QueuePair`] of the
//! RoCEv2-compatible mode, behind one interface for memory regions and one-sided
//! operations. Two-sided SENDs differ too much between the two (message streams vs posted
//! receives) and are handled by the tests themselves.

use super::data::random_chunks;
use super::net::RcNode;
use super::Res;
use metaroce::rocev2::{ConnectAttrs, QpInit, QpStats, RcOpcode, RcStats, SendOp, SendWr};
use metaroce::{Access, ConnectionStats, WcStatus};
use metaroce_tokio::rocev2::{Completion, QueuePair, UdpIpStats};
use metaroce_tokio::{Connection, MemoryRegion, RemoteRegion};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

/// Bytes copied or checksummed per lock of an RC region (the endpoint's packets wait
/// meanwhile).
const CHUNK: u64 = 4 << 20;

/// Zero-length receives an RC QP keeps posted for WRITE-with-immediate notifications.
pub const IMM_RECVS: u64 = 64;

/// Remote rights of every QP and of the regions peers access.
pub const REMOTE_ALL: Access =
    Access(Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0 | Access::REMOTE_ATOMIC.0);

/// An RC queue pair with its endpoint.
#[derive(Debug)]
pub struct RcNet {
    /// The node (endpoint, backend, impairment).
    pub node: RcNode,
    /// The QP.
    pub qp: QueuePair,
    /// The peer's IP address.
    pub peer_ip: IpAddr,
    /// Path MTU.
    mtu: u32,
    /// Local ACK timeout exponent.
    timeout: u8,
    /// READs/atomics in flight.
    outs: u8,
    /// Remote identity, once connected: QPN, PSN, UDP address.
    remote: std::sync::Mutex<Option<(u32, u32, SocketAddr)>>,
}

impl RcNet {
    /// Creates the QP (not yet connected).
    pub fn new(node: RcNode, peer_ip: IpAddr, mtu: u32, timeout: u8, outs: u16) -> Res<RcNet> {
        let qp = node
            .ep
            .create_qp(QpInit {
                access: REMOTE_ALL,
                ..QpInit::default()
            })
            .map_err(|e| format!("creating the RC queue pair: {e}"))?;
        Ok(RcNet {
            node,
            qp,
            peer_ip,
            mtu,
            timeout,
            outs: u8::try_from(outs).unwrap_or(u8::MAX),
            remote: std::sync::Mutex::new(None),
        })
    }

    /// Connects the QP to the peer's QPN/PSN; its datagrams go to UDP `port` of the peer.
    pub fn connect(&self, qpn: u32, psn: u32, port: u16) -> Res<()> {
        let mut a = ConnectAttrs::new(self.peer_ip, qpn, psn);
        a.path_mtu = self.mtu;
        a.timeout = self.timeout;
        a.max_rd_atomic = self.outs;
        a.max_dest_rd_atomic = self.outs;
        let addr = SocketAddr::new(self.peer_ip, port);
        self.node.backend.set_peer(self.peer_ip, addr);
        self.qp
            .connect(a)
            .map_err(|e| format!("connecting the RC queue pair to QPN 0x{qpn:06x}: {e}"))?;
        *self.remote.lock().unwrap_or_else(|e| e.into_inner()) = Some((qpn, psn, addr));
        Ok(())
    }

    /// The UDP port peers send to.
    pub fn udp_port(&self) -> u16 {
        self.node.backend.local_addr().port()
    }

    /// Posts a receive; `Err` with the reason.
    pub fn post_recv(&self, wr_id: u64, mr: &Mr, offset: u64, len: u32) -> Res<()> {
        self.qp
            .post_recv(wr_id, mr.lkey(), offset, len)
            .map_err(|e| format!("posting a receive: {e}"))
    }

    /// Posts zero-length receives for WRITE-with-immediate notifications.
    pub fn post_imm_recvs(&self, n: u64) -> Res<()> {
        for _ in 0..n {
            self.qp
                .post_recv(0, 0, 0, 0)
                .map_err(|e| format!("posting a receive: {e}"))?;
        }
        Ok(())
    }

    /// The next receive completion; a failed one is `Err`.
    pub async fn recv(&self) -> Res<Completion> {
        let c = self
            .qp
            .recv()
            .await
            .map_err(|e| format!("waiting for a receive: {e}"))?;
        if c.status != WcStatus::Success {
            return Err(format!(
                "receive completed with {} ({})",
                c.status,
                c.status.ibv_code()
            ));
        }
        Ok(c)
    }

    /// Posts a send work request and waits for its completion.
    pub async fn execute(&self, wr: SendWr) -> Res<()> {
        let what = op_name(&wr.op);
        let c = self
            .qp
            .post(wr)
            .map_err(|e| format!("posting an RDMA {what}: {e}"))?
            .await
            .map_err(|e| format!("RDMA {what}: {e}"))?;
        if c.status != WcStatus::Success {
            return Err(format!(
                "RDMA {what} of {} bytes completed with {} ({})",
                wr.len,
                c.status,
                c.status.ibv_code()
            ));
        }
        Ok(())
    }

    /// SEND `len` bytes of `src` from `offset`.
    pub async fn send(&self, src: &Mr, offset: u64, len: u64) -> Res<()> {
        self.execute(wr(SendOp::Send { imm: None }, src.lkey(), offset, len)?)
            .await
    }
}

fn op_name(op: &SendOp) -> &'static str {
    match op {
        SendOp::Send { .. } => "SEND",
        SendOp::Write { .. } => "WRITE",
        SendOp::Read { .. } => "READ",
        SendOp::CompareSwap { .. } => "COMPARE_SWAP",
        SendOp::FetchAdd { .. } => "FETCH_ADD",
    }
}

fn wr(op: SendOp, lkey: u32, local_offset: u64, len: u64) -> Res<SendWr> {
    Ok(SendWr {
        wr_id: 0,
        op,
        lkey,
        local_offset,
        len: u32::try_from(len).map_err(|_| format!("{len} bytes is too large for one RC WR"))?,
        solicited: false,
    })
}

/// The connection of a run, in either mode. Cheap to clone.
#[derive(Debug, Clone)]
pub enum Net {
    /// MetaRoCE.
    Meta(Connection),
    /// RoCEv2 RC.
    Rc(Arc<RcNet>),
}

/// A memory region of either mode.
pub enum Mr {
    /// MetaRoCE region (deregistered on drop).
    Meta(MemoryRegion),
    /// RC region; `len` may be a prefix of a larger registration (see [`Pool`]).
    Rc {
        /// The endpoint.
        ep: metaroce_tokio::rocev2::RcEndpoint,
        /// Its keys.
        keys: metaroce::MrKeys,
        /// Bytes in use.
        len: u64,
    },
}

impl std::fmt::Debug for Mr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mr")
            .field("remote", &self.remote())
            .finish()
    }
}

impl Mr {
    /// The descriptor to hand to the peer.
    pub fn remote(&self) -> RemoteRegion {
        match self {
            Mr::Meta(m) => m.remote(),
            Mr::Rc { keys, len, .. } => RemoteRegion {
                addr: keys.addr,
                len: *len,
                rkey: keys.rkey,
            },
        }
    }

    /// Bytes in use.
    pub fn len(&self) -> u64 {
        match self {
            Mr::Meta(m) => m.len() as u64,
            Mr::Rc { len, .. } => *len,
        }
    }

    fn lkey(&self) -> u32 {
        match self {
            Mr::Meta(m) => m.keys().lkey,
            Mr::Rc { keys, .. } => keys.lkey,
        }
    }

    fn check(&self, off: u64, len: u64) -> Res<()> {
        match off.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(format!(
                "bytes {off}..+{len} are outside a region of {}",
                self.len()
            )),
        }
    }

    /// Runs `f` over `[off, off + len)`, in pieces for RC regions.
    fn each_chunk(&self, off: u64, len: u64, mut f: impl FnMut(&[u8])) -> Res<()> {
        self.check(off, len)?;
        match self {
            Mr::Meta(m) => m
                .with_bytes(|b| f(&b[off as usize..(off + len) as usize]))
                .map_err(|e| format!("reading a region: {e}")),
            Mr::Rc { ep, keys, .. } => {
                let mut at = off;
                while at < off + len {
                    let n = CHUNK.min(off + len - at);
                    let b = ep
                        .read_mr(keys.lkey, at, n)
                        .map_err(|e| format!("reading a region: {e}"))?;
                    f(&b);
                    at += n;
                }
                Ok(())
            }
        }
    }

    /// CRC-32 of `[off, off + len)`.
    pub fn crc(&self, off: u64, len: u64) -> Res<u32> {
        off_worker(|| {
            let mut h = crc32fast::Hasher::new();
            self.each_chunk(off, len, |b| h.update(b))?;
            Ok(h.finalize())
        })
    }

    /// Feeds `[off, off + len)` into `h`.
    pub fn hash_into(&self, h: &mut crc32fast::Hasher, off: u64, len: u64) -> Res<()> {
        self.each_chunk(off, len, |b| h.update(b))
    }

    /// Whether the bytes at `off` equal `expected`.
    pub fn eq_at(&self, off: u64, expected: &[u8]) -> Res<bool> {
        let mut ok = true;
        let mut at = 0usize;
        self.each_chunk(off, expected.len() as u64, |b| {
            ok &= b == &expected[at..at + b.len()];
            at += b.len();
        })?;
        Ok(ok)
    }

    /// Copies `data` in at `off`.
    pub fn write(&self, off: u64, data: &[u8]) -> Res<()> {
        self.check(off, data.len() as u64)?;
        match self {
            Mr::Meta(m) => m.write(off, data).map_err(|e| e.to_string()),
            Mr::Rc { ep, keys, .. } => ep.write_mr(keys.lkey, off, data).map_err(|e| e.to_string()),
        }
        .map_err(|e| format!("writing a region: {e}"))
    }

    /// Flips the low bit of the byte at `off` (the `--selftest-mismatch` aid).
    pub fn flip(&self, off: u64) -> Res<()> {
        let mut b = [0u8; 1];
        self.each_chunk(off, 1, |x| b[0] = x[0])?;
        self.write(off, &[b[0] ^ 1])
    }

    /// The little-endian u64 at `off`.
    pub fn read_u64(&self, off: u64) -> Res<u64> {
        let mut v = [0u8; 8];
        let mut at = 0;
        self.each_chunk(off, 8, |b| {
            v[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        })?;
        Ok(u64::from_le_bytes(v))
    }
}

/// Runs `f` — filling or checksumming a region, up to a second of CPU for 1 GiB — on a
/// multi-thread runtime through [`tokio::task::block_in_place`], so that the tasks queued on
/// this worker, the endpoints' drivers among them, move to another thread meanwhile.
/// Without it a driver woken by this task waits in the worker's next-task slot, which no
/// other worker steals from, and the peer's retransmission timer fires (spurious
/// retransmissions, issue #13). On a current-thread runtime `f` just runs.
pub fn off_worker<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Initial contents of a region from a [`Pool`].
#[derive(Debug, Clone, Copy)]
pub enum Fill {
    /// Every byte the same.
    Byte(u8),
    /// `random_bytes(seed, len)`.
    Random(u64),
}

impl Fill {
    fn build(self, len: u64) -> Res<Vec<u8>> {
        let n = usize::try_from(len).map_err(|_| "region too large for this host")?;
        Ok(off_worker(|| match self {
            Fill::Byte(b) => vec![b; n],
            Fill::Random(seed) => super::data::random_bytes(seed, n),
        }))
    }

    fn apply(self, mr: &Mr, len: u64) -> Res<()> {
        let mut at = 0;
        let mut put = |c: &[u8]| -> Res<()> {
            mr.write(at, c)?;
            at += c.len() as u64;
            Ok(())
        };
        match self {
            Fill::Byte(b) => {
                let chunk = vec![b; CHUNK.min(len) as usize];
                let mut left = len;
                while left > 0 {
                    let n = CHUNK.min(left) as usize;
                    put(&chunk[..n])?;
                    left -= n as u64;
                }
                Ok(())
            }
            Fill::Random(seed) => random_chunks(seed, len, CHUNK as usize, put),
        }
    }
}

/// Regions by purpose. MetaRoCE regions are registered anew each time (the old one is
/// deregistered when dropped); the async RC endpoint has no deregistration, so an RC region
/// is reused (refilled) when it is large enough and replaced by a larger one otherwise.
#[derive(Debug, Default)]
pub struct Pool {
    rc: HashMap<&'static str, metaroce::MrKeys>,
}

impl Pool {
    /// A region of `len` bytes (at least 1) with `access`, filled with `fill`.
    pub fn get(
        &mut self,
        net: &Net,
        purpose: &'static str,
        len: u64,
        access: Access,
        fill: Fill,
    ) -> Res<Mr> {
        let len = len.max(1);
        match net {
            Net::Meta(c) => Ok(Mr::Meta(c.endpoint().register(fill.build(len)?, access))),
            Net::Rc(rc) => {
                let ep = rc.node.ep.clone();
                if let Some(&keys) = self
                    .rc
                    .get(purpose)
                    .filter(|k| k.len >= len && k.access == access)
                {
                    let mr = Mr::Rc { ep, keys, len };
                    fill.apply(&mr, len)?;
                    return Ok(mr);
                }
                let keys = ep.register(fill.build(len)?, access);
                self.rc.insert(purpose, keys);
                Ok(Mr::Rc { ep, keys, len })
            }
        }
    }
}

/// A region's remote descriptor narrowed to the 8 bytes at the first 8-byte-aligned
/// address (atomics need alignment); the region must be at least 16 bytes.
pub fn aligned8(r: RemoteRegion) -> Option<(u64, RemoteRegion)> {
    let off = (8 - r.addr % 8) % 8;
    r.slice(off, 8).map(|s| (off, s))
}

impl Net {
    /// (QPN, initial PSN, UDP port) to announce to the peer; PSN and port are 0 in
    /// MetaRoCE mode (the connection handshake exchanged them already).
    pub fn identity(&self) -> (u32, u32, u16) {
        match self {
            Net::Meta(c) => (c.handle().0, 0, 0),
            Net::Rc(rc) => (rc.qp.qpn(), rc.qp.psn(), rc.udp_port()),
        }
    }

    /// RC: connects to the peer's identity; MetaRoCE: nothing to do.
    pub fn connect(&self, qpn: u32, psn: u32, port: u16) -> Res<()> {
        match self {
            Net::Meta(_) => Ok(()),
            Net::Rc(rc) => rc.connect(qpn, psn, port),
        }
    }

    /// Registers a region.
    pub fn register(&self, data: Vec<u8>, access: Access) -> Mr {
        match self {
            Net::Meta(c) => Mr::Meta(c.endpoint().register(data, access)),
            Net::Rc(rc) => {
                let len = data.len() as u64;
                Mr::Rc {
                    ep: rc.node.ep.clone(),
                    keys: rc.node.ep.register(data, access),
                    len,
                }
            }
        }
    }

    /// RDMA WRITE (with immediate when `imm` is set) of `src[off..off + len]` to `dst` at
    /// `dst_off`; resolves once acknowledged.
    pub async fn write(
        &self,
        src: &Mr,
        off: u64,
        len: u64,
        dst: RemoteRegion,
        dst_off: u64,
        imm: Option<u32>,
    ) -> Res<u64> {
        match (self, src) {
            (Net::Meta(c), Mr::Meta(m)) => {
                let r = match imm {
                    None => c.write(m, off..off + len, dst, dst_off).await,
                    Some(i) => c.write_with_imm(m, off..off + len, dst, dst_off, i).await,
                };
                r.map_err(|e| format!("RDMA WRITE of {len} bytes failed: {e}"))?;
            }
            (Net::Rc(rc), Mr::Rc { keys, .. }) => {
                let op = SendOp::Write {
                    remote_addr: dst.addr.wrapping_add(dst_off),
                    rkey: dst.rkey,
                    imm,
                };
                rc.execute(wr(op, keys.lkey, off, len)?).await?;
            }
            _ => return Err("a region of the other mode".into()),
        }
        Ok(len)
    }

    /// RDMA WRITEs of `src[off..off + len]` to `dst` at the same offset, one per
    /// `(off, len)` of `items`, posted together and signaled once (MetaRoCE:
    /// [`Connection::write_batch`](metaroce_tokio::Connection::write_batch); RC: each WRITE
    /// posted and awaited on its own, all at once). Resolves with the bytes written once
    /// every WRITE is acknowledged.
    pub async fn write_batch(&self, src: &Mr, items: &[(u64, u64)], dst: RemoteRegion) -> Res<u64> {
        let bytes = items.iter().map(|&(_, len)| len).sum();
        match (self, src) {
            (Net::Meta(c), Mr::Meta(m)) => {
                let writes = items.iter().map(|&(off, len)| metaroce_tokio::BatchWrite {
                    src: m,
                    range: off..off + len,
                    dst,
                    dst_offset: off,
                    imm: None,
                });
                c.write_batch(writes)
                    .await
                    .map_err(|e| format!("a batch of {} RDMA WRITEs failed: {e}", items.len()))?;
            }
            (Net::Rc(_), Mr::Rc { .. }) => {
                futures::future::try_join_all(
                    items
                        .iter()
                        .map(|&(off, len)| self.write(src, off, len, dst, off, None)),
                )
                .await?;
            }
            _ => return Err("a region of the other mode".into()),
        }
        Ok(bytes)
    }

    /// RDMA READ of `len` bytes of `src` at `src_off` into `dst[off..]`; resolves once
    /// every byte landed.
    pub async fn read(
        &self,
        dst: &Mr,
        off: u64,
        len: u64,
        src: RemoteRegion,
        src_off: u64,
    ) -> Res<u64> {
        match (self, dst) {
            (Net::Meta(c), Mr::Meta(m)) => {
                c.read(m, off..off + len, src, src_off)
                    .await
                    .map_err(|e| format!("RDMA READ of {len} bytes failed: {e}"))?;
            }
            (Net::Rc(rc), Mr::Rc { keys, .. }) => {
                let op = SendOp::Read {
                    remote_addr: src.addr.wrapping_add(src_off),
                    rkey: src.rkey,
                };
                rc.execute(wr(op, keys.lkey, off, len)?).await?;
            }
            _ => return Err("a region of the other mode".into()),
        }
        Ok(len)
    }

    /// Atomic FETCH_AND_ADD on the 8 bytes at `remote` (aligned); RC mode lands the result
    /// in `result[0..8]`. Returns the value before the addition.
    pub async fn fetch_add(&self, result: &Mr, remote: RemoteRegion, add: u64) -> Res<u64> {
        match self {
            Net::Meta(c) => c
                .fetch_add(remote, 0, add)
                .await
                .map_err(|e| format!("FETCH_AND_ADD failed: {e}")),
            Net::Rc(rc) => {
                let op = SendOp::FetchAdd {
                    remote_addr: remote.addr,
                    rkey: remote.rkey,
                    add,
                };
                rc.execute(wr(op, result.lkey(), 0, 8)?).await?;
                result.read_u64(0)
            }
        }
    }

    /// Atomic CMP_AND_SWAP on the 8 bytes at `remote` (aligned): stores `swap` if they equal
    /// `compare`; RC mode lands the result in `result[0..8]`. Returns the value before.
    pub async fn compare_swap(
        &self,
        result: &Mr,
        remote: RemoteRegion,
        compare: u64,
        swap: u64,
    ) -> Res<u64> {
        match self {
            Net::Meta(c) => c
                .compare_swap(remote, 0, compare, swap)
                .await
                .map_err(|e| format!("CMP_AND_SWAP failed: {e}")),
            Net::Rc(rc) => {
                let op = SendOp::CompareSwap {
                    remote_addr: remote.addr,
                    rkey: remote.rkey,
                    compare,
                    swap,
                };
                rc.execute(wr(op, result.lkey(), 0, 8)?).await?;
                result.read_u64(0)
            }
        }
    }

    /// Makes WRITE-with-immediate notifications possible (RC: posts receives for them).
    pub fn prepare_imm(&self) -> Res<()> {
        match self {
            Net::Meta(_) => Ok(()),
            Net::Rc(rc) => rc.post_imm_recvs(IMM_RECVS),
        }
    }

    /// The immediate of the next WRITE with immediate that landed (every byte of it is
    /// visible). RC: consumes a posted receive and posts a new one.
    pub async fn next_imm(&self) -> Res<u32> {
        match self {
            Net::Meta(c) => c
                .recv_imm()
                .await
                .map(|(imm, _)| imm)
                .ok_or_else(|| "the connection ended while waiting for a WRITE".to_string()),
            Net::Rc(rc) => loop {
                let c = rc.recv().await?;
                rc.post_imm_recvs(1)?;
                if c.opcode == RcOpcode::RecvRdmaWithImm {
                    return c
                        .imm
                        .ok_or_else(|| "a WRITE with immediate without its immediate".to_string());
                }
            },
        }
    }

    /// Counters at this point.
    pub fn stats(&self) -> LinkStats {
        match self {
            Net::Meta(c) => LinkStats::Meta(c.stats()),
            Net::Rc(rc) => LinkStats::Rc {
                qp: rc.qp.stats().unwrap_or_default(),
                ep: rc.node.ep.stats(),
                udp: rc.node.backend.stats(),
            },
        }
    }

    /// The address lines of the report: (local, remote).
    pub fn describe(&self, remote_qpn: u32) -> (String, String) {
        match self {
            Net::Meta(conn) => {
                let ep = conn.endpoint();
                let mut local = ep.local_addr();
                if let (true, Some(peer)) = (local.ip().is_unspecified(), conn.remote_addr()) {
                    local.set_ip(super::pcap::route_source(peer.ip()));
                }
                (
                    format!(
                        "{local}  QPN 0x{:06x}  source ports {}",
                        conn.handle().0,
                        super::report::ports(&ep.source_ports())
                    ),
                    format!(
                        "{}  QPN 0x{remote_qpn:06x}",
                        conn.remote_addr()
                            .map_or_else(|| "?".to_string(), |a| a.to_string())
                    ),
                )
            }
            Net::Rc(rc) => {
                let b = &rc.node.backend;
                let local = SocketAddr::new(
                    metaroce_tokio::rocev2::IpBackend::local_ip(&**b),
                    b.local_addr().port(),
                );
                let remote = *rc.remote.lock().unwrap_or_else(|e| e.into_inner());
                (
                    format!(
                        "{local}  QPN 0x{:06x}  PSN 0x{:06x}  source port {}",
                        rc.qp.qpn(),
                        rc.qp.psn(),
                        b.source_port()
                    ),
                    match remote {
                        Some((qpn, psn, addr)) => {
                            format!("{addr}  QPN 0x{qpn:06x}  PSN 0x{psn:06x}")
                        }
                        None => "? (not connected)".into(),
                    },
                )
            }
        }
    }
}

/// Counters of one side's connection.
#[derive(Debug, Clone)]
// A snapshot read once per report: boxing the larger variant would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum LinkStats {
    /// MetaRoCE connection counters (`None` once the connection is gone).
    Meta(Option<ConnectionStats>),
    /// RC QP, endpoint and backend counters.
    Rc {
        /// The QP.
        qp: QpStats,
        /// The endpoint.
        ep: RcStats,
        /// The UDP backend.
        udp: UdpIpStats,
    },
}

impl LinkStats {
    /// Packets sent again (MetaRoCE: retransmissions incl. tail-loss probes; RC: go-back-N
    /// resends).
    pub fn retransmits(&self) -> u64 {
        match self {
            LinkStats::Meta(c) => c
                .as_ref()
                .map_or(0, |c| c.paths.iter().map(|p| p.stats.retransmits).sum()),
            LinkStats::Rc { qp, .. } => qp.retransmitted,
        }
    }

    /// MetaRoCE tail-loss probes (0 in RC mode).
    pub fn probes(&self) -> u64 {
        match self {
            LinkStats::Meta(c) => c
                .as_ref()
                .map_or(0, |c| c.paths.iter().map(|p| p.stats.probes).sum()),
            LinkStats::Rc { .. } => 0,
        }
    }

    /// The MetaRoCE connection counters.
    pub fn meta(&self) -> Option<&ConnectionStats> {
        match self {
            LinkStats::Meta(c) => c.as_ref(),
            LinkStats::Rc { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::off_worker;
    use std::sync::mpsc;
    use std::time::Duration;

    /// A task woken by a task that then does long CPU work must still run meanwhile, as the
    /// endpoint's driver must to answer the peer (issue #13). Without `block_in_place` the
    /// woken task waits in the worker's next-task slot, which the idle worker does not
    /// steal, and the `recv_timeout` below runs out.
    #[test]
    fn a_task_woken_before_long_work_runs_during_it() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let ran = rt.block_on(async {
            tokio::spawn(async {
                let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
                let (done_tx, done_rx) = mpsc::channel::<()>();
                let waiter = tokio::spawn(async move {
                    let _ = go_rx.await;
                    let _ = done_tx.send(());
                });
                // Let the waiter start and park on its channel.
                tokio::time::sleep(Duration::from_millis(50)).await;
                // Wakes the waiter from this worker: it goes to this worker's next-task slot.
                let _ = go_tx.send(());
                // The "long work": waits (at most 10 s) for the woken task to have run.
                let ran = off_worker(|| done_rx.recv_timeout(Duration::from_secs(10)).is_ok());
                let _ = waiter.await;
                ran
            })
            .await
            .unwrap()
        });
        assert!(ran, "the woken task did not run while this one was busy");
    }
}
