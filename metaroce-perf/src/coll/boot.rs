//! The bootstrap: a rendezvous address is all a rank needs (as NCCL's unique id). Rank 0
//! listens on it; every other rank connects, says who it is and where its data endpoints
//! listen; rank 0 answers with the whole table. The same TCP connections then carry the
//! barriers and the gather of the results. Line-based text, one message a line.

use std::io;
use std::net::SocketAddr;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

/// Where one rank's data endpoints listen.
#[derive(Clone, Copy, Debug)]
pub struct RankAddrs {
    /// The metaroce endpoint.
    pub rdma: SocketAddr,
    /// The TCP listener of `--transport tcp`.
    pub tcp: SocketAddr,
}

/// How long rank 0 waits for the other ranks to join, and the others for rank 0.
const JOIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Longest bootstrap line accepted (a table of 4096 ranks fits).
const MAX_LINE: usize = 1 << 20;

type Line = (BufReader<OwnedReadHalf>, OwnedWriteHalf);

/// This rank's bootstrap connections: rank 0 holds one per other rank, the others one to 0.
#[derive(Debug)]
pub struct Boot {
    pub rank: usize,
    links: Vec<Line>,
}

fn bad(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

async fn read_line(r: &mut BufReader<OwnedReadHalf>) -> io::Result<String> {
    let mut s = String::new();
    let mut limited = (&mut *r).take(MAX_LINE as u64);
    if limited.read_line(&mut s).await? == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "bootstrap peer closed",
        ));
    }
    Ok(s.trim_end().to_owned())
}

use tokio::io::AsyncReadExt;

async fn send_line(w: &mut OwnedWriteHalf, s: &str) -> io::Result<()> {
    w.write_all(format!("{s}\n").as_bytes()).await
}

impl Boot {
    /// Rank 0: accept `n - 1` ranks on `listener`, learn their addresses, send the table.
    /// Others: connect to `rendezvous` (retrying for up to 60 s while rank 0 starts up); rank 0 waits as long for them.
    /// `mine` is called with the local IP the bootstrap connection uses (the data
    /// endpoints bind to it) and returns this rank's addresses. Returns every rank's.
    pub async fn join<F, Fut, T>(
        rank: usize,
        n: usize,
        rendezvous: SocketAddr,
        listener: Option<TcpListener>,
        mine: F,
    ) -> io::Result<(Boot, Vec<RankAddrs>, T)>
    where
        F: FnOnce(std::net::IpAddr) -> Fut,
        Fut: std::future::Future<Output = io::Result<(RankAddrs, T)>>,
    {
        if rank == 0 {
            let listener = match listener {
                Some(l) => l,
                None => TcpListener::bind(rendezvous).await?,
            };
            let (me, extra) = mine(rendezvous.ip()).await?;
            let mut table: Vec<Option<RankAddrs>> = vec![None; n];
            table[0] = Some(me);
            let mut links: Vec<Option<Line>> = (0..n).map(|_| None).collect();
            for _ in 1..n {
                let (s, _) = tokio::time::timeout(JOIN_TIMEOUT, listener.accept())
                    .await
                    .map_err(|_| {
                        io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("not every rank joined within {JOIN_TIMEOUT:?}"),
                        )
                    })??;
                s.set_nodelay(true)?;
                let (r, w) = s.into_split();
                let mut r = BufReader::new(r);
                let hello = read_line(&mut r).await?;
                let f: Vec<&str> = hello.split(' ').collect();
                let (Some(&"HELLO"), Some(k), Some(nn), Some(a), Some(t)) =
                    (f.first(), f.get(1), f.get(2), f.get(3), f.get(4))
                else {
                    return Err(bad(format!("bad bootstrap hello {hello:?}")));
                };
                let k: usize = k.parse().map_err(|_| bad("bad rank"))?;
                if nn.parse::<usize>().ok() != Some(n) {
                    return Err(bad(format!(
                        "rank {k} runs with {nn} ranks, rank 0 with {n}"
                    )));
                }
                if k == 0 || k >= n || table[k].is_some() {
                    return Err(bad(format!("rank {k} is out of range or joined twice")));
                }
                table[k] = Some(RankAddrs {
                    rdma: a.parse().map_err(|_| bad("bad address"))?,
                    tcp: t.parse().map_err(|_| bad("bad address"))?,
                });
                links[k] = Some((r, w));
            }
            let table: Vec<RankAddrs> = table.into_iter().flatten().collect();
            let mut line = String::from("TABLE");
            for a in &table {
                line.push_str(&format!(" {} {}", a.rdma, a.tcp));
            }
            let mut links: Vec<Line> = links.into_iter().flatten().collect();
            for (_, w) in &mut links {
                send_line(w, &line).await?;
            }
            Ok((Boot { rank, links }, table, extra))
        } else {
            let t0 = std::time::Instant::now();
            let s = loop {
                match TcpStream::connect(rendezvous).await {
                    Ok(s) => break s,
                    Err(e) if t0.elapsed() > JOIN_TIMEOUT => {
                        return Err(io::Error::new(
                            e.kind(),
                            format!("rendezvous {rendezvous}: {e}"),
                        ))
                    }
                    Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
                }
            };
            s.set_nodelay(true)?;
            let (me, extra) = mine(s.local_addr()?.ip()).await?;
            let (r, mut w) = s.into_split();
            let mut r = BufReader::new(r);
            send_line(&mut w, &format!("HELLO {rank} {n} {} {}", me.rdma, me.tcp)).await?;
            let line = read_line(&mut r).await?;
            let f: Vec<&str> = line.split(' ').collect();
            if f.first() != Some(&"TABLE") || f.len() != 1 + 2 * n {
                return Err(bad(format!("bad bootstrap table {line:?}")));
            }
            let mut table = Vec::with_capacity(n);
            for k in 0..n {
                table.push(RankAddrs {
                    rdma: f[1 + 2 * k].parse().map_err(|_| bad("bad address"))?,
                    tcp: f[2 + 2 * k].parse().map_err(|_| bad("bad address"))?,
                });
            }
            Ok((
                Boot {
                    rank,
                    links: vec![(r, w)],
                },
                table,
                extra,
            ))
        }
    }

    /// Every rank waits until all ranks arrived here.
    pub async fn barrier(&mut self) -> io::Result<()> {
        self.gather("B").await.map(|_| ())
    }

    /// Every rank sends `line`; rank 0 gets all of them (index = rank, its own first), the
    /// others an empty list. Also a barrier: returns on every rank once rank 0 has all.
    pub async fn gather(&mut self, line: &str) -> io::Result<Vec<String>> {
        if self.rank == 0 {
            let mut all = vec![line.to_owned()];
            for (r, _) in &mut self.links {
                all.push(read_line(r).await?);
            }
            for (_, w) in &mut self.links {
                send_line(w, "GO").await?;
            }
            Ok(all)
        } else {
            let (r, w) = &mut self.links[0];
            send_line(w, line).await?;
            let go = read_line(r).await?;
            if go != "GO" {
                return Err(bad(format!("bad bootstrap reply {go:?}")));
            }
            Ok(Vec::new())
        }
    }
}
