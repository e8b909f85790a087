//! Two tasks, two endpoints on loopback: they talk through a message stream
//! (`futures::Stream` + `Sink<Bytes>`), and one RDMA-WRITEs into memory the other exposed.
//! The owner of the memory checks every byte.
//!
//! Run: `cargo run -p metaroce-examples --example stream_and_write`

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use metaroce_tokio::{Access, Config, Endpoint, RemoteRegion};

const LEN: usize = 8 << 20;

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (i >> 11)) as u8
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let server = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
    let addr = server.local_addr();

    // The memory owner: exposes a region, waits to be told it was written, checks it.
    let owner = tokio::spawn(async move {
        let conn = server.accept().await.ok_or("endpoint closed")?.accept()?;
        let mut stream = conn.accept_stream().await.ok_or("connection closed")?;
        let hello = stream.next().await.ok_or("stream ended")??;
        println!("owner: got {:?}", String::from_utf8_lossy(&hello));

        let region = server.alloc(LEN, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        stream
            .send(Bytes::copy_from_slice(&region.remote().to_bytes()))
            .await?;

        let note = stream.next().await.ok_or("stream ended")??;
        assert_eq!(&note[..], b"written");
        // The writer's completion means every byte landed before it sent "written".
        let bad = region.with_bytes(|b| {
            b.iter()
                .enumerate()
                .filter(|&(i, &x)| x != pattern(i))
                .count()
        })?;
        println!("owner: checked {LEN} bytes, {bad} differ");
        stream
            .send(Bytes::from(if bad == 0 { "verified" } else { "corrupt" }))
            .await?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(bad == 0)
    });

    // The writer: asks for a region, WRITEs into it, says so.
    let client = Endpoint::bind("127.0.0.1:0".parse()?, Config::default()).await?;
    let conn = client.connect(addr)?.await?;
    let (mut tx, mut rx) = conn.open_stream()?.split();
    tx.send(Bytes::from_static(b"hello, may I write?")).await?;
    let desc = rx.next().await.ok_or("stream ended")??;
    let remote = RemoteRegion::from_bytes(&desc).ok_or("bad region descriptor")?;
    println!(
        "writer: peer region at {:#x}, {} bytes, rkey {:#x}",
        remote.addr, remote.len, remote.rkey
    );

    let source = client.register((0..LEN).map(pattern).collect(), Access::LOCAL_WRITE);
    let wc = conn.write(&source, 0..LEN as u64, remote, 0).await?;
    println!(
        "writer: RDMA WRITE of {} bytes completed: {}",
        wc.byte_len, wc.status
    );
    tx.send(Bytes::from_static(b"written")).await?;
    let verdict = rx.next().await.ok_or("stream ended")??;
    println!("writer: owner says {:?}", String::from_utf8_lossy(&verdict));

    if !owner.await?? {
        return Err("destination memory does not match".into());
    }
    Ok(())
}
