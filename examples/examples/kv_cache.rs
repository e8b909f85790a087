//! KV-cache transfer between a prefill server and a decode client, the way disaggregated
//! LLM serving moves it (the job of NIXL or Mooncake's transfer engine).
//!
//! The decode side owns a **paged KV cache**: one registered region laid out as
//! `[layer][K|V][block][B tokens × token_bytes]`. For every request it takes free blocks
//! from its pool (scattered, as a paged allocator hands them out) and sends the prefill
//! side a **block table**: the request id, the token count and the block numbers. The
//! prefill side computes the KV layer by layer and RDMA WRITEs each finished block straight
//! into its place in the decode cache; the last WRITE of a layer is a WRITE_WITH_IMM whose
//! immediate (`request << 8 | layer`) tells the decode side "layer done". On metaroce the
//! immediate is delivered only after every earlier WRITE of the connection landed, so the
//! decode side may start on layer `l` the moment its immediate arrives. Transfers of layer
//! `l` overlap the computation of layer `l + 1`.
//!
//! The same exchange then runs over TCP (a header per block, the decode side reads each
//! block straight into its cache), and the example prints both side by side: time per
//! request and per layer (p50/p99 over all requests), blocks/s, and whether every byte of
//! every block landed where the block table said (checked on the decode side).
//!
//! Run: `cargo run --release -p metaroce-examples --example kv_cache -- --requests 50`

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use metaroce_tokio::{Access, Config, Connection, Endpoint, MemoryRegion, RemoteRegion};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The shape of the paged KV cache (a small model by default: 8 layers, 8 KV heads of
/// 128 bf16 values per token, blocks of 16 tokens = 32 KiB per K or V block).
#[derive(Clone, Copy, Debug)]
struct Layout {
    layers: usize,
    block_tokens: usize,
    /// Bytes of one token's K (or V) in one layer: kv_heads × head_dim × 2 (bf16).
    token_bytes: usize,
    /// Blocks in the decode side's pool.
    pool_blocks: usize,
}

impl Layout {
    fn block_bytes(&self) -> usize {
        self.block_tokens * self.token_bytes
    }
    fn region_bytes(&self) -> usize {
        self.layers * 2 * self.pool_blocks * self.block_bytes()
    }
    /// Offset of block `block` of `layer`'s K (`kv` 0) or V (`kv` 1) in the cache.
    fn offset(&self, layer: usize, kv: usize, block: u32) -> usize {
        ((layer * 2 + kv) * self.pool_blocks + block as usize) * self.block_bytes()
    }
}

/// What the decode side tells the prefill side for one request.
#[derive(Debug, Clone, PartialEq)]
struct BlockTable {
    request: u32,
    tokens: u32,
    blocks: Vec<u32>,
}

impl BlockTable {
    fn encode(&self) -> Bytes {
        let mut v = Vec::with_capacity(8 + 4 * self.blocks.len());
        v.extend_from_slice(&self.request.to_le_bytes());
        v.extend_from_slice(&self.tokens.to_le_bytes());
        for b in &self.blocks {
            v.extend_from_slice(&b.to_le_bytes());
        }
        v.into()
    }
    /// Parse a block table, refusing blocks outside the pool.
    fn decode(b: &[u8], layout: &Layout) -> Result<BlockTable, BoxError> {
        if b.len() < 8 || b.len() % 4 != 0 {
            return Err("malformed block table".into());
        }
        let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let blocks: Vec<u32> = (8..b.len()).step_by(4).map(word).collect();
        if blocks.iter().any(|&x| x as usize >= layout.pool_blocks) {
            return Err("block table names a block outside the pool".into());
        }
        Ok(BlockTable {
            request: word(0),
            tokens: word(4),
            blocks,
        })
    }
}

/// The "computed" KV of one block: a pattern only (request, layer, K/V, position in the
/// request) determines, so the decode side can check every byte.
fn fill_block(out: &mut [u8], request: u32, layer: usize, kv: usize, i: usize) {
    let mut x =
        (u64::from(request) << 40) ^ ((layer as u64) << 24) ^ ((kv as u64) << 20) ^ i as u64;
    for w in out.chunks_mut(8) {
        // splitmix64
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        let z = (z ^ (z >> 31)).to_le_bytes();
        w.copy_from_slice(&z[..w.len()]);
    }
}

/// Bytes of `req`'s blocks in `cache` that differ from what the prefill side computed.
fn check(cache: &[u8], layout: &Layout, req: &BlockTable) -> usize {
    let mut want = vec![0u8; layout.block_bytes()];
    let mut bad = 0;
    for layer in 0..layout.layers {
        for kv in 0..2 {
            for (i, &b) in req.blocks.iter().enumerate() {
                fill_block(&mut want, req.request, layer, kv, i);
                let at = layout.offset(layer, kv, b);
                let got = &cache[at..at + want.len()];
                bad += got.iter().zip(&want).filter(|(a, b)| a != b).count();
            }
        }
    }
    bad
}

/// A paged allocator's free list: blocks come back scattered, not in order.
struct Pool {
    free: Vec<u32>,
}

impl Pool {
    fn new(n: usize) -> Pool {
        // A fixed shuffle (multiplicative hash order) so block tables are not contiguous.
        let mut free: Vec<u32> = (0..n as u32).collect();
        free.sort_by_key(|&b| b.wrapping_mul(2_654_435_761) % n as u32);
        Pool { free }
    }
    fn take(&mut self, k: usize) -> Option<Vec<u32>> {
        (self.free.len() >= k).then(|| self.free.split_off(self.free.len() - k))
    }
    /// The block table of request `request`: `tokens` tokens in free pool blocks.
    fn table(
        &mut self,
        request: u32,
        tokens: usize,
        layout: &Layout,
    ) -> Result<BlockTable, BoxError> {
        let blocks = self
            .take(tokens.div_ceil(layout.block_tokens))
            .ok_or("KV cache pool exhausted")?;
        Ok(BlockTable {
            request,
            tokens: tokens as u32,
            blocks,
        })
    }
    fn give(&mut self, blocks: Vec<u32>) {
        self.free.splice(0..0, blocks);
    }
}

/// What the decode side measured for one request.
struct Timing {
    request: Duration,
    /// Time from the block table's send to each layer's "done" signal.
    layers: Vec<Duration>,
    bad_bytes: usize,
}

// ---------------------------------------------------------------- metaroce ----------

/// Prefill server over metaroce: for each block table, compute the layers and WRITE them
/// into place; the last WRITE of each layer carries the immediate.
async fn prefill_rdma(ep: Endpoint, layout: Layout) -> Result<(), BoxError> {
    let conn = ep.accept().await.ok_or("endpoint closed")?.accept()?;
    let mut stream = conn.accept_stream().await.ok_or("connection closed")?;
    let desc = stream.next().await.ok_or("stream ended")??;
    let cache = RemoteRegion::from_bytes(&desc).ok_or("bad region descriptor")?;
    // Computed KV of one request, all layers (a GPU's output buffer, here host memory).
    let max_blocks = layout.pool_blocks;
    let src = Arc::new(ep.alloc(
        layout.layers * 2 * max_blocks * layout.block_bytes(),
        Access::LOCAL_WRITE,
    ));
    let mut block = vec![0u8; layout.block_bytes()];
    while let Some(msg) = stream.next().await {
        let msg = msg?;
        if msg.is_empty() {
            // The decode side is done: return, which drops the stream, the connection and
            // the endpoint. The close sends the ACKs still owed ahead of the MR_CLOSE, so
            // the decode side's send of this message completes Success.
            return Ok(());
        }
        let req = BlockTable::decode(&msg, &layout)?;
        // The sender posts each finished layer's WRITEs as soon as the layer is handed
        // over, in layer order, without waiting for the previous layer's completions.
        let (done, mut ready) = tokio::sync::mpsc::unbounded_channel::<usize>();
        let sender = {
            let (conn, src, req) = (conn.clone(), src.clone(), req.clone());
            tokio::spawn(async move {
                let mut inflight = futures::stream::FuturesUnordered::new();
                loop {
                    tokio::select! {
                        biased;
                        Some(layer) = ready.recv() => {
                            inflight.push(send_layer(&conn, &src, cache, layout, &req, layer));
                        }
                        Some(r) = inflight.next(), if !inflight.is_empty() => r?,
                        else => return Ok::<_, BoxError>(()),
                    }
                }
            })
        };
        for layer in 0..layout.layers {
            // "Compute" layer `layer` of every block of the request into the source buffer.
            for kv in 0..2 {
                for i in 0..req.blocks.len() {
                    fill_block(&mut block, req.request, layer, kv, i);
                    src.write(src_offset(&layout, max_blocks, layer, kv, i) as u64, &block)?;
                }
            }
            // Ship it while the next layer is computed.
            done.send(layer).map_err(|_| "sender ended")?;
        }
        drop(done);
        sender.await??;
    }
    Ok(())
}

/// Where block `i` of `layer`'s K/V sits in the prefill side's source buffer.
fn src_offset(layout: &Layout, max_blocks: usize, layer: usize, kv: usize, i: usize) -> usize {
    ((layer * 2 + kv) * max_blocks + i) * layout.block_bytes()
}

/// WRITE every K and V block of `layer` to its place in the decode cache; the last one is
/// a WRITE_WITH_IMM (posted after all the others), the layer's "done" signal.
async fn send_layer(
    conn: &Connection,
    src: &MemoryRegion,
    cache: RemoteRegion,
    layout: Layout,
    req: &BlockTable,
    layer: usize,
) -> Result<(), BoxError> {
    let bb = layout.block_bytes() as u64;
    let mut targets = Vec::new();
    for kv in 0..2 {
        for (i, &b) in req.blocks.iter().enumerate() {
            let s = src_offset(&layout, layout.pool_blocks, layer, kv, i) as u64;
            targets.push((s, layout.offset(layer, kv, b) as u64));
        }
    }
    let (last, rest) = targets.split_last().ok_or("empty request")?;
    let writes = futures::future::try_join_all(
        rest.iter()
            .map(|&(s, d)| conn.write(src, s..s + bb, cache, d)),
    );
    let imm = (req.request << 8) | layer as u32;
    let signal = conn.write_with_imm(src, last.0..last.0 + bb, cache, last.1, imm);
    // `try_join` polls (and so posts) the plain WRITEs first.
    futures::future::try_join(writes, signal).await?;
    Ok(())
}

/// Decode client over metaroce: register the cache, send block tables, time the layers'
/// immediates, check the blocks.
async fn decode_rdma(
    prefill: std::net::SocketAddr,
    layout: Layout,
    requests: u32,
    tokens: usize,
) -> Result<Vec<Timing>, BoxError> {
    let ep = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
    let cache = ep.alloc(
        layout.region_bytes(),
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
    );
    let conn = ep.connect(prefill)?.await?;
    let mut stream = conn.open_stream()?;
    stream
        .send(Bytes::copy_from_slice(&cache.remote().to_bytes()))
        .await?;
    let mut pool = Pool::new(layout.pool_blocks);
    let mut out = Vec::new();
    for request in 0..requests {
        let req = pool.table(request, tokens, &layout)?;
        let t0 = Instant::now();
        stream.send(req.encode()).await?;
        let mut layers = Vec::new();
        for layer in 0..layout.layers {
            let (imm, _len) = conn.recv_imm().await.ok_or("connection lost")?;
            if imm != (request << 8) | layer as u32 {
                return Err(format!("immediate {imm:#x} out of order").into());
            }
            layers.push(t0.elapsed());
        }
        let elapsed = t0.elapsed();
        let bad_bytes = cache.with_bytes(|c| check(c, &layout, &req))?;
        out.push(Timing {
            request: elapsed,
            layers,
            bad_bytes,
        });
        pool.give(req.blocks);
    }
    // An empty message says "no more requests"; once it is acknowledged, close.
    stream.send(Bytes::new()).await?;
    conn.close(0, b"done");
    Ok(out)
}

// ---------------------------------------------------------------- TCP ----------------

/// Per-block header on TCP: layer (u16), K/V (u8), last-of-layer flag (u8), block (u32).
const HDR: usize = 8;

/// Prefill server over TCP: the same computation; each block goes out as a header and
/// its bytes, in the order the RDMA version WRITEs them.
async fn prefill_tcp(listener: TcpListener, layout: Layout) -> Result<(), BoxError> {
    let (s, _) = listener.accept().await?;
    s.set_nodelay(true)?;
    let (mut rd, mut wr) = s.into_split();
    let mut block = vec![0u8; layout.block_bytes()];
    loop {
        let mut len = [0u8; 4];
        rd.read_exact(&mut len).await?;
        let len = u32::from_le_bytes(len) as usize;
        if len == 0 {
            return Ok(());
        }
        if len > 8 + 4 * layout.pool_blocks {
            return Err("block table too long".into());
        }
        let mut msg = vec![0u8; len];
        rd.read_exact(&mut msg).await?;
        let req = BlockTable::decode(&msg, &layout)?;
        let n = req.blocks.len();
        for layer in 0..layout.layers {
            for kv in 0..2 {
                for (i, &b) in req.blocks.iter().enumerate() {
                    fill_block(&mut block, req.request, layer, kv, i);
                    let mut h = [0u8; HDR];
                    h[0..2].copy_from_slice(&(layer as u16).to_le_bytes());
                    h[2] = kv as u8;
                    h[3] = u8::from(kv == 1 && i == n - 1);
                    h[4..8].copy_from_slice(&b.to_le_bytes());
                    wr.write_all(&h).await?;
                    wr.write_all(&block).await?;
                }
            }
        }
    }
}

/// Decode client over TCP: each block is read straight into its place in the cache.
async fn decode_tcp(
    prefill: std::net::SocketAddr,
    layout: Layout,
    requests: u32,
    tokens: usize,
) -> Result<Vec<Timing>, BoxError> {
    let s = TcpStream::connect(prefill).await?;
    s.set_nodelay(true)?;
    let (mut rd, mut wr) = s.into_split();
    let mut cache = vec![0u8; layout.region_bytes()];
    let mut pool = Pool::new(layout.pool_blocks);
    let bb = layout.block_bytes();
    let mut out = Vec::new();
    for request in 0..requests {
        let req = pool.table(request, tokens, &layout)?;
        let t0 = Instant::now();
        let msg = req.encode();
        wr.write_all(&(msg.len() as u32).to_le_bytes()).await?;
        wr.write_all(&msg).await?;
        let mut layers = Vec::new();
        while layers.len() < layout.layers {
            let mut h = [0u8; HDR];
            rd.read_exact(&mut h).await?;
            let layer = u16::from_le_bytes([h[0], h[1]]) as usize;
            let (kv, last) = (h[2] as usize, h[3] == 1);
            let b = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
            if layer >= layout.layers || kv > 1 || b as usize >= layout.pool_blocks {
                return Err("block header out of range".into());
            }
            let at = layout.offset(layer, kv, b);
            rd.read_exact(&mut cache[at..at + bb]).await?;
            if last {
                layers.push(t0.elapsed());
            }
        }
        let elapsed = t0.elapsed();
        out.push(Timing {
            request: elapsed,
            bad_bytes: check(&cache, &layout, &req),
            layers,
        });
        pool.give(req.blocks);
    }
    wr.write_all(&0u32.to_le_bytes()).await?;
    Ok(out)
}

// ---------------------------------------------------------------- report -------------

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    let rank = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// One table row; returns the number of wrong bytes. blocks/s and GB/s are over the sum
/// of the requests' times (the decode side's view: block table sent to last layer done).
fn row(name: &str, t: &[Timing], layout: &Layout, blocks: usize) -> usize {
    let total: Duration = t.iter().map(|x| x.request).sum();
    let mut req: Vec<Duration> = t.iter().map(|x| x.request).collect();
    // A layer's own time: from the previous layer's signal (or the request) to its signal.
    let mut lay: Vec<Duration> = t
        .iter()
        .flat_map(|x| {
            let mut prev = Duration::ZERO;
            x.layers.iter().map(move |&l| {
                let d = l - prev;
                prev = l;
                d
            })
        })
        .collect();
    let bad: usize = t.iter().map(|x| x.bad_bytes).sum();
    let pages = (t.len() * layout.layers * 2 * blocks) as f64;
    let bytes = pages * layout.block_bytes() as f64;
    println!(
        "{name:>9} {:>8} {:>10.3} {:>10.3} {:>12.3} {:>12.3} {:>11.0} {:>8.3}  {}",
        t.len(),
        ms(pct(&mut req, 0.5)),
        ms(pct(&mut req, 0.99)),
        ms(pct(&mut lay, 0.5)),
        ms(pct(&mut lay, 0.99)),
        pages / total.as_secs_f64(),
        bytes / total.as_secs_f64() / 1e9,
        if bad == 0 {
            "verified".to_string()
        } else {
            format!("{bad} BAD BYTES")
        }
    );
    bad
}

fn arg(args: &[String], name: &str, default: usize) -> Result<usize, BoxError> {
    match args.iter().position(|a| a == name) {
        Some(i) => Ok(args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .ok_or(format!("{name} needs a number"))?),
        None => Ok(default),
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().collect();
    let layout = Layout {
        layers: arg(&args, "--layers", 8)?,
        block_tokens: arg(&args, "--block-tokens", 16)?,
        token_bytes: arg(&args, "--token-bytes", 8 * 128 * 2)?,
        pool_blocks: arg(&args, "--pool-blocks", 256)?,
    };
    let requests = arg(&args, "--requests", 20)? as u32;
    let tokens = arg(&args, "--tokens", 512)?;
    match run(layout, requests, tokens).await? {
        0 => Ok(()),
        bad => Err(format!("{bad} bytes of KV blocks landed wrong").into()),
    }
}

/// Both transports, one after the other; prints the table; the wrong bytes in total.
async fn run(layout: Layout, requests: u32, tokens: usize) -> Result<usize, BoxError> {
    let blocks = tokens.div_ceil(layout.block_tokens.max(1));
    if layout.layers == 0
        || layout.layers > 256
        || layout.block_bytes() == 0
        || tokens == 0
        || blocks > layout.pool_blocks
        || requests == 0
        || requests >= 1 << 24
    {
        return Err("need 1..=256 layers, blocks of at least one byte, 1..2^24 requests, and a prompt that fits the pool".into());
    }
    println!(
        "KV cache: {} layers x K/V x {} blocks of {} tokens x {} B = {:.1} MiB (decode side, registered)",
        layout.layers,
        layout.pool_blocks,
        layout.block_tokens,
        layout.token_bytes,
        layout.region_bytes() as f64 / (1 << 20) as f64
    );
    println!(
        "request: {tokens} tokens = {blocks} blocks/layer, {} block WRITEs of {} KiB, {:.1} MiB; {requests} requests one after another",
        layout.layers * 2 * blocks,
        layout.block_bytes() / 1024,
        (layout.layers * 2 * blocks * layout.block_bytes()) as f64 / (1 << 20) as f64
    );

    // metaroce: the prefill server, then the decode client.
    let ep = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
    let addr = ep.local_addr();
    let prefill = tokio::spawn(prefill_rdma(ep, layout));
    let rdma = decode_rdma(addr, layout, requests, tokens).await;
    // The prefill side's error, if any, says more than the decode side's.
    if let Err(e) = prefill.await? {
        return Err(format!("prefill side (metaroce): {e}").into());
    }
    let rdma = rdma.map_err(|e| format!("decode side (metaroce): {e}"))?;

    // TCP: the same exchange.
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let prefill = tokio::spawn(prefill_tcp(listener, layout));
    let tcp = decode_tcp(addr, layout, requests, tokens).await;
    if let Err(e) = prefill.await? {
        return Err(format!("prefill side (tcp): {e}").into());
    }
    let tcp = tcp.map_err(|e| format!("decode side (tcp): {e}"))?;

    println!(
        "{:>9} {:>8} {:>10} {:>10} {:>12} {:>12} {:>11} {:>8}  check",
        "transport", "requests", "p50 req", "p99 req", "p50 layer", "p99 layer", "blocks/s", "GB/s"
    );
    println!(
        "{:>9} {:>8} {:>10} {:>10} {:>12} {:>12}",
        "", "", "[ms]", "[ms]", "[ms]", "[ms]"
    );
    let bad = row("metaroce", &rdma, &layout, blocks) + row("tcp", &tcp, &layout, blocks);
    Ok(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small configuration end to end over both transports: every byte of every block
    /// of every request lands where the block table put it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn small_configuration_verifies_over_metaroce_and_tcp() {
        let layout = Layout {
            layers: 4,
            block_tokens: 4,
            token_bytes: 512,
            pool_blocks: 40,
        };
        // 30 tokens: 8 blocks, the last one partly filled by tokens but sent whole.
        let bad = run(layout, 6, 30).await.expect("run");
        assert_eq!(bad, 0);
    }

    #[test]
    fn block_table_round_trips_and_refuses_blocks_outside_the_pool() {
        let layout = Layout {
            layers: 2,
            block_tokens: 4,
            token_bytes: 8,
            pool_blocks: 10,
        };
        let t = BlockTable {
            request: 7,
            tokens: 12,
            blocks: vec![9, 0, 4],
        };
        assert_eq!(BlockTable::decode(&t.encode(), &layout).unwrap(), t);
        let bad = BlockTable {
            blocks: vec![10],
            ..t
        };
        assert!(BlockTable::decode(&bad.encode(), &layout).is_err());
        assert!(BlockTable::decode(&[1, 2, 3], &layout).is_err());
    }

    #[test]
    fn check_counts_a_block_written_to_the_wrong_place() {
        let layout = Layout {
            layers: 2,
            block_tokens: 2,
            token_bytes: 16,
            pool_blocks: 4,
        };
        let req = BlockTable {
            request: 1,
            tokens: 4,
            blocks: vec![3, 1],
        };
        let mut cache = vec![0u8; layout.region_bytes()];
        let bb = layout.block_bytes();
        for layer in 0..2 {
            for kv in 0..2 {
                for (i, &b) in req.blocks.iter().enumerate() {
                    let at = layout.offset(layer, kv, b);
                    fill_block(&mut cache[at..at + bb], 1, layer, kv, i);
                }
            }
        }
        assert_eq!(check(&cache, &layout, &req), 0);
        // Layer 1's V block 0 lands in block 0 instead of block 3.
        let (from, to) = (layout.offset(1, 1, 3), layout.offset(1, 1, 0));
        cache.copy_within(from..from + bb, to);
        cache[from..from + bb].fill(0);
        assert!(check(&cache, &layout, &req) > 0);
    }
}
