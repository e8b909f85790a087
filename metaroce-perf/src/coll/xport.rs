//! The two data paths of a rank: metaroce (RDMA WRITE_WITH_IMM into the peer's registered
//! buffer, the immediate as the ready signal) and tokio TCP (a header, then the bytes).
//! Both connect a full mesh (every pair of ranks; the ring uses the neighbours, all-to-all
//! every peer) and run the same [`Step`] plans.

use super::data::{reduce_into, Buf, DataType, Local, RedOp, Step};
use metaroce_tokio::{
    Access, Config, Connection, Endpoint, MemoryRegion, MessageStream, RemoteRegion,
};
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Res<T> = Result<T, BoxError>;

fn err(s: String) -> BoxError {
    s.into()
}

/// A rank's data path.
#[derive(Debug)]
pub enum Xport {
    Rdma(Box<Rdma>),
    Tcp(Box<Tcp>),
}

/// Connect every pair: rank r dials every lower rank and accepts every higher one, both at
/// once (a rank still dialling must not keep a higher one from being accepted).
async fn mesh<C, A, D, FutC, FutA>(r: usize, n: usize, dial: D, accept: A) -> Res<Vec<Option<C>>>
where
    D: Fn(usize) -> FutC,
    A: Fn() -> FutA,
    FutC: std::future::Future<Output = Res<C>>,
    FutA: std::future::Future<Output = Res<(usize, C)>>,
{
    let dials = futures::future::try_join_all((0..r).map(&dial));
    let accepts = async {
        let mut v = Vec::new();
        for _ in r + 1..n {
            v.push(accept().await?);
        }
        Ok::<_, BoxError>(v)
    };
    let (lower, higher) = futures::future::try_join(dials, accepts).await?;
    let mut peers: Vec<Option<C>> = (0..n).map(|_| None).collect();
    for (j, c) in lower.into_iter().enumerate() {
        peers[j] = Some(c);
    }
    for (j, c) in higher {
        if j <= r || j >= n || peers[j].is_some() {
            return Err(err(format!("rank {j} connected out of turn")));
        }
        peers[j] = Some(c);
    }
    Ok(peers)
}

/// A metaroce peer: its connection and the descriptors of its two remote-writable buffers.
#[derive(Debug)]
pub struct RdmaPeer {
    conn: Connection,
    stage: RemoteRegion,
    output: RemoteRegion,
    _stream: MessageStream,
}

/// The metaroce data path: four registered regions of `max` bytes each.
#[derive(Debug)]
pub struct Rdma {
    ep: Endpoint,
    input: MemoryRegion,
    work: MemoryRegion,
    stage: MemoryRegion,
    output: MemoryRegion,
    peers: Vec<Option<RdmaPeer>>,
    tmp: (Vec<u8>, Vec<u8>),
}

/// The hello on a new connection's first stream: rank (u32 LE), then the 20-byte
/// descriptors of the stage and output regions.
fn hello(r: usize, stage: &RemoteRegion, output: &RemoteRegion) -> bytes::Bytes {
    let mut v = (r as u32).to_le_bytes().to_vec();
    v.extend_from_slice(&stage.to_bytes());
    v.extend_from_slice(&output.to_bytes());
    v.into()
}

fn parse_hello(b: &[u8]) -> Res<(usize, RemoteRegion, RemoteRegion)> {
    if b.len() != 44 {
        return Err(err(format!("bad hello of {} bytes", b.len())));
    }
    let r = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    let s = RemoteRegion::from_bytes(&b[4..24]).ok_or("bad region descriptor")?;
    let o = RemoteRegion::from_bytes(&b[24..44]).ok_or("bad region descriptor")?;
    Ok((r, s, o))
}

impl Rdma {
    /// Bind a metaroce endpoint on `ip` with regions of `max` bytes.
    pub async fn bind(ip: std::net::IpAddr, max: usize) -> std::io::Result<Rdma> {
        let ep = Endpoint::bind(SocketAddr::new(ip, 0), Config::default()).await?;
        let rw = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        Ok(Rdma {
            input: ep.alloc(max, Access::LOCAL_WRITE),
            work: ep.alloc(max, Access::LOCAL_WRITE),
            stage: ep.alloc(max, rw),
            output: ep.alloc(max, rw),
            ep,
            peers: Vec::new(),
            tmp: (Vec::new(), Vec::new()),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.ep.local_addr()
    }

    /// Connect to every other rank (`addrs[j]` = rank j's endpoint).
    pub async fn connect(&mut self, r: usize, addrs: &[SocketAddr]) -> Res<()> {
        use futures::{SinkExt, StreamExt};
        let n = addrs.len();
        let (ep, mine) = (
            &self.ep,
            hello(r, &self.stage.remote(), &self.output.remote()),
        );
        let dial = |j: usize| {
            let mine = mine.clone();
            async move {
                let conn = ep.connect(addrs[j])?.await?;
                let mut stream = conn.open_stream()?;
                stream.send(mine).await?;
                let b = stream.next().await.ok_or("stream ended")??;
                let (k, stage, output) = parse_hello(&b)?;
                if k != j {
                    return Err(err(format!("dialled rank {j}, rank {k} answered")));
                }
                Ok(RdmaPeer {
                    conn,
                    stage,
                    output,
                    _stream: stream,
                })
            }
        };
        let accept = || {
            let mine = mine.clone();
            async move {
                let conn = ep.accept().await.ok_or("endpoint closed")?.accept()?;
                let mut stream = conn.accept_stream().await.ok_or("connection closed")?;
                let b = stream.next().await.ok_or("stream ended")??;
                let (k, stage, output) = parse_hello(&b)?;
                stream.send(mine).await?;
                Ok((
                    k,
                    RdmaPeer {
                        conn,
                        stage,
                        output,
                        _stream: stream,
                    },
                ))
            }
        };
        self.peers = mesh(r, n, dial, accept).await?;
        Ok(())
    }

    fn mr(&self, b: Buf) -> &MemoryRegion {
        match b {
            Buf::Input => &self.input,
            Buf::Work => &self.work,
            Buf::Stage => &self.stage,
            Buf::Output => &self.output,
        }
    }

    fn peer(&self, j: usize) -> Res<&RdmaPeer> {
        self.peers
            .get(j)
            .and_then(|p| p.as_ref())
            .ok_or_else(|| err(format!("no connection to rank {j}")))
    }

    async fn step(&mut self, st: &Step, dt: DataType, op: RedOp) -> Res<()> {
        let me: &Rdma = self;
        let sends = st.sends.iter().map(|s| async move {
            let p = me.peer(s.peer)?;
            let dst = match s.dst {
                Buf::Stage => p.stage,
                Buf::Output => p.output,
                b => return Err(err(format!("{b:?} is not remote-writable"))),
            };
            let range = s.off as u64..(s.off + s.len) as u64;
            p.conn
                .write_with_imm(me.mr(s.src), range, dst, s.dst_off as u64, s.imm)
                .await?;
            Ok::<_, BoxError>(())
        });
        let recvs = st.recvs.iter().map(|rv| async move {
            let p = me.peer(rv.peer)?;
            let (imm, len) = p
                .conn
                .recv_imm()
                .await
                .ok_or_else(|| err(format!("connection to rank {} lost", rv.peer)))?;
            if imm != rv.imm || len as usize != rv.len {
                return Err(err(format!(
                    "rank {}: immediate {imm:#x} of {len} B, expected {:#x} of {} B",
                    rv.peer, rv.imm, rv.len
                )));
            }
            Ok(())
        });
        futures::future::try_join(
            futures::future::try_join_all(sends),
            futures::future::try_join_all(recvs),
        )
        .await?;
        for l in &st.after {
            self.local(l, dt, op)?;
        }
        Ok(())
    }

    fn local(&mut self, l: &Local, dt: DataType, op: RedOp) -> Res<()> {
        let (mut a, mut b) = std::mem::take(&mut self.tmp);
        match l {
            Local::Copy {
                src,
                range,
                dst,
                dst_off,
            } => {
                a.resize(range.len(), 0);
                self.mr(*src).read_into(range.start as u64, &mut a)?;
                self.mr(*dst).write(*dst_off as u64, &a)?;
            }
            Local::Reduce(range) => {
                a.resize(range.len(), 0);
                b.resize(range.len(), 0);
                self.work.read_into(range.start as u64, &mut a)?;
                self.stage.read_into(range.start as u64, &mut b)?;
                reduce_into(dt, op, &mut a, &b);
                self.work.write(range.start as u64, &a)?;
            }
        }
        self.tmp = (a, b);
        Ok(())
    }
}

/// The TCP data path: the same four buffers as plain memory, one stream per peer.
#[derive(Debug)]
pub struct Tcp {
    listener: Option<TcpListener>,
    bufs: [Vec<u8>; 4],
    rd: Vec<Option<Mutex<OwnedReadHalf>>>,
    wr: Vec<Option<Mutex<OwnedWriteHalf>>>,
    tmps: Vec<Vec<u8>>,
    tmp: Vec<u8>,
}

fn idx(b: Buf) -> usize {
    match b {
        Buf::Input => 0,
        Buf::Work => 1,
        Buf::Stage => 2,
        Buf::Output => 3,
    }
}

/// TCP message header: immediate (u32), destination buffer (u32: 2 stage, 3 output),
/// destination offset (u64), length (u64), all little-endian.
const HDR: usize = 24;

impl Tcp {
    pub async fn bind(ip: std::net::IpAddr, max: usize) -> std::io::Result<Tcp> {
        Ok(Tcp {
            listener: Some(TcpListener::bind(SocketAddr::new(ip, 0)).await?),
            bufs: [vec![0; max], vec![0; max], vec![0; max], vec![0; max]],
            rd: Vec::new(),
            wr: Vec::new(),
            tmps: Vec::new(),
            tmp: Vec::new(),
        })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener
            .as_ref()
            .ok_or_else(|| std::io::Error::other("listener closed"))?
            .local_addr()
    }

    pub async fn connect(&mut self, r: usize, addrs: &[SocketAddr]) -> Res<()> {
        let n = addrs.len();
        let listener = self.listener.take().ok_or("listener closed")?;
        let dial = |j: usize| async move {
            let mut s = TcpStream::connect(addrs[j]).await?;
            s.set_nodelay(true)?;
            s.write_all(&(r as u32).to_le_bytes()).await?;
            Ok(s)
        };
        let accept = || async {
            let (mut s, _) = listener.accept().await?;
            s.set_nodelay(true)?;
            let mut k = [0u8; 4];
            s.read_exact(&mut k).await?;
            Ok((u32::from_le_bytes(k) as usize, s))
        };
        let peers = mesh(r, n, dial, accept).await?;
        for p in peers {
            match p {
                Some(s) => {
                    let (rd, wr) = s.into_split();
                    self.rd.push(Some(Mutex::new(rd)));
                    self.wr.push(Some(Mutex::new(wr)));
                }
                None => {
                    self.rd.push(None);
                    self.wr.push(None);
                }
            }
        }
        Ok(())
    }

    async fn step(&mut self, st: &Step, dt: DataType, op: RedOp) -> Res<()> {
        let Tcp {
            bufs, rd, wr, tmps, ..
        } = self;
        tmps.resize_with(st.recvs.len(), Vec::new);
        let bufs_r: &[Vec<u8>; 4] = bufs;
        let (rd, wr) = (&*rd, &*wr);
        let sends = st.sends.iter().map(|s| async move {
            let w = wr
                .get(s.peer)
                .and_then(|w| w.as_ref())
                .ok_or_else(|| err(format!("no connection to rank {}", s.peer)))?;
            let mut w = w.lock().await;
            let mut h = [0u8; HDR];
            h[0..4].copy_from_slice(&s.imm.to_le_bytes());
            h[4..8].copy_from_slice(&(idx(s.dst) as u32).to_le_bytes());
            h[8..16].copy_from_slice(&(s.dst_off as u64).to_le_bytes());
            h[16..24].copy_from_slice(&(s.len as u64).to_le_bytes());
            w.write_all(&h).await?;
            w.write_all(&bufs_r[idx(s.src)][s.off..s.off + s.len])
                .await?;
            Ok::<_, BoxError>(())
        });
        let recvs = st.recvs.iter().zip(tmps.iter_mut()).map(|(rv, tmp)| async move {
            let r = rd
                .get(rv.peer)
                .and_then(|r| r.as_ref())
                .ok_or_else(|| err(format!("no connection to rank {}", rv.peer)))?;
            let mut r = r.lock().await;
            let mut h = [0u8; HDR];
            r.read_exact(&mut h).await?;
            let imm = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
            let dst = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
            let off = u64::from_le_bytes(h[8..16].try_into().unwrap_or([0; 8]));
            let len = u64::from_le_bytes(h[16..24].try_into().unwrap_or([0; 8]));
            if imm != rv.imm || dst != idx(rv.dst) || off != rv.off as u64 || len != rv.len as u64
            {
                return Err(err(format!(
                    "rank {}: message {imm:#x} to buffer {dst} at {off} of {len} B, expected {:#x} to {} at {} of {} B",
                    rv.peer,
                    rv.imm,
                    idx(rv.dst),
                    rv.off,
                    rv.len
                )));
            }
            tmp.resize(rv.len, 0);
            r.read_exact(tmp).await?;
            Ok(())
        });
        futures::future::try_join(
            futures::future::try_join_all(sends),
            futures::future::try_join_all(recvs),
        )
        .await?;
        for (rv, tmp) in st.recvs.iter().zip(self.tmps.iter()) {
            self.bufs[idx(rv.dst)][rv.off..rv.off + rv.len].copy_from_slice(tmp);
        }
        for l in &st.after {
            self.local(l, dt, op);
        }
        Ok(())
    }

    fn local(&mut self, l: &Local, dt: DataType, op: RedOp) {
        match l {
            Local::Copy {
                src,
                range,
                dst,
                dst_off,
            } => {
                self.tmp.clear();
                self.tmp
                    .extend_from_slice(&self.bufs[idx(*src)][range.clone()]);
                self.bufs[idx(*dst)][*dst_off..*dst_off + range.len()].copy_from_slice(&self.tmp);
            }
            Local::Reduce(range) => {
                let [_, work, stage, _] = &mut self.bufs;
                reduce_into(dt, op, &mut work[range.clone()], &stage[range.clone()]);
            }
        }
    }
}

impl Xport {
    pub fn name(&self) -> &'static str {
        match self {
            Xport::Rdma(_) => "metaroce",
            Xport::Tcp(_) => "tcp",
        }
    }

    /// Run one step of a plan.
    pub async fn step(&mut self, st: &Step, dt: DataType, op: RedOp) -> Res<()> {
        match self {
            Xport::Rdma(x) => x.step(st, dt, op).await,
            Xport::Tcp(x) => x.step(st, dt, op).await,
        }
    }

    /// Put `data` at the start of the input buffer.
    pub fn load_input(&mut self, data: &[u8]) -> Res<()> {
        match self {
            Xport::Rdma(x) => x.input.write(0, data)?,
            Xport::Tcp(x) => x.bufs[0][..data.len()].copy_from_slice(data),
        }
        Ok(())
    }

    /// Fill the first `len` bytes of the output with NaNs (0xff bytes), so that the check
    /// sees only what the timed iterations wrote.
    pub fn poison_output(&mut self, len: usize) -> Res<()> {
        match self {
            Xport::Rdma(x) => x.output.write(0, &vec![0xff; len])?,
            Xport::Tcp(x) => x.bufs[3][..len].fill(0xff),
        }
        Ok(())
    }

    /// A copy of the first `len` bytes of the output.
    pub fn output(&self, len: usize) -> Res<Vec<u8>> {
        Ok(match self {
            Xport::Rdma(x) => x.output.read(0, len as u64)?,
            Xport::Tcp(x) => x.bufs[3][..len].to_vec(),
        })
    }
}
