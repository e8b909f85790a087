//! `metaroce-allreduce`: a collective benchmark with nccl-tests' conventions
//! (`all_reduce_perf -b 8 -e 128M -f 2 -g 4`), over metaroce and, for comparison, over TCP.
//!
//! Every rank is a process (the default: this program starts `-g` copies of itself on
//! loopback; or start one per host with `--rank R --rendezvous HOST:PORT`) or, with
//! `--in-process`, a task. A rank needs only the rendezvous address: rank 0 listens on it,
//! the others connect, and rank 0 hands out the table of data addresses (NCCL's unique id
//! plays this role). The ring collectives move data with RDMA WRITE_WITH_IMM into the next
//! rank's registered buffer; the immediate is the ready signal, and on metaroce it is
//! delivered only after every byte of that WRITE (and of every earlier WRITE on the
//! connection) has landed. `--transport tcp` runs the same plans over tokio TCP streams.
//!
//! Columns (nccl-tests, out-of-place): `size` bytes of the whole vector (all-reduce), of the
//! gathered output (all-gather) or of the input (reduce-scatter, all-to-all); `count` its
//! elements; `time` the mean per iteration, the slowest rank's; `algbw = size / time`;
//! `busbw = algbw × factor` with nccl-tests' PERFORMANCE.md factors (2(n-1)/n for
//! all-reduce, (n-1)/n for the others); `#wrong` the elements, summed over ranks, that
//! differ from the result computed locally (inputs are small integers, so the check is
//! exact in float and bfloat16).

mod boot;
mod data;
mod xport;

use clap::Parser;
use data::{Collective, DataType, RedOp};
use std::net::SocketAddr;
use std::time::Instant;
use xport::{BoxError, Rdma, Tcp, Xport};

/// Which data path(s).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TransportSel {
    /// metaroce: RDMA WRITE_WITH_IMM.
    Metaroce,
    /// tokio TCP streams.
    Tcp,
    /// Both, metaroce first, in the same run, with a table of the busbw ratio.
    Both,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|v| v.checked_mul(mul))
        .ok_or_else(|| format!("bad size {s:?} (a number with an optional K, M or G suffix)"))
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "metaroce-allreduce",
    version,
    about = "nccl-tests-style collective benchmark (all_reduce, all_gather, reduce_scatter, alltoall) over metaroce RDMA WRITE_WITH_IMM, or TCP"
)]
pub struct Args {
    /// Smallest size in bytes (K, M, G suffixes: powers of 1024).
    #[arg(short = 'b', long = "minbytes", default_value = "32M", value_parser = parse_size)]
    pub min_bytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "32M", value_parser = parse_size)]
    pub max_bytes: usize,
    /// Size multiplication factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    pub step_factor: usize,
    /// Number of ranks.
    #[arg(short = 'g', long = "ranks", alias = "ngpus", default_value_t = 4)]
    pub ranks: usize,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    pub iters: usize,
    /// Warm-up iterations per size (not timed).
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    pub warmup: usize,
    /// Check the results (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    pub check: u8,
    /// Element type.
    #[arg(short = 'd', long = "datatype", value_enum, default_value_t = DataType::Float)]
    pub datatype: DataType,
    /// Reduction operator.
    #[arg(short = 'o', long = "op", value_enum, default_value_t = RedOp::Sum)]
    pub op: RedOp,
    /// The collective.
    #[arg(long, value_enum, default_value_t = Collective::AllReduce)]
    pub collective: Collective,
    /// Data path.
    #[arg(long, value_enum, default_value_t = TransportSel::Metaroce)]
    pub transport: TransportSel,
    /// Run every rank as a task of this process instead of a process of its own.
    #[arg(long)]
    pub in_process: bool,
    /// Run only this rank (with `--rendezvous`); the launcher sets it for its children.
    #[arg(long, requires = "rendezvous")]
    pub rank: Option<usize>,
    /// Rendezvous address: rank 0 listens on it, the others connect to it.
    #[arg(long)]
    pub rendezvous: Option<SocketAddr>,
}

/// What rank 0 learned: per transport, the rows (size, busbw, #wrong).
type Rows = Vec<(usize, f64, u64)>;

/// Run the benchmark; the process exit code (0 ok, 1 wrong results or an error, 2 usage).
pub fn main() -> i32 {
    let args = Args::parse();
    if args.ranks < 2 || args.ranks > 4096 {
        eprintln!("metaroce-allreduce: -g must be in 2..=4096");
        return 2;
    }
    if args.min_bytes == 0 || args.min_bytes > args.max_bytes || args.step_factor < 2 {
        eprintln!("metaroce-allreduce: need 0 < -b <= -e and -f >= 2");
        return 2;
    }
    if let Some(r) = args.rank {
        if r >= args.ranks {
            eprintln!("metaroce-allreduce: --rank {r} with -g {}", args.ranks);
            return 2;
        }
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("metaroce-allreduce: tokio: {e}");
            return 1;
        }
    };
    match (args.rank, args.in_process) {
        (Some(r), _) => {
            let res = rt.block_on(rank_main(args.clone(), r, None));
            finish(r, res)
        }
        (None, true) => rt.block_on(in_process(args)),
        (None, false) => launch(&args),
    }
}

fn finish(r: usize, res: Result<u64, BoxError>) -> i32 {
    match res {
        Ok(0) => 0,
        Ok(w) => {
            if r == 0 {
                eprintln!("metaroce-allreduce: {w} wrong elements");
            }
            1
        }
        Err(e) => {
            eprintln!("metaroce-allreduce: rank {r}: {e}");
            1
        }
    }
}

async fn in_process(args: Args) -> i32 {
    let listener = match tokio::net::TcpListener::bind("127.0.0.1:0").await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("metaroce-allreduce: rendezvous: {e}");
            return 1;
        }
    };
    let Ok(addr) = listener.local_addr() else {
        return 1;
    };
    let mut args = args;
    args.rendezvous = Some(addr);
    let mut listener = Some(listener);
    let tasks: Vec<_> = (0..args.ranks)
        .map(|r| tokio::spawn(rank_main(args.clone(), r, listener.take())))
        .collect();
    let aborts: Vec<_> = tasks.iter().map(|t| t.abort_handle()).collect();
    let mut pending: futures::stream::FuturesUnordered<_> = tasks
        .into_iter()
        .enumerate()
        .map(|(r, t)| async move { (r, t.await) })
        .collect();
    let mut code = 0;
    while let Some((r, res)) = futures::StreamExt::next(&mut pending).await {
        let res = res.unwrap_or_else(|e| Err(format!("task: {e}").into()));
        if res.is_err() {
            // The other ranks would wait for this one forever.
            aborts.iter().for_each(|a| a.abort());
        }
        code = code.max(finish(r, res));
    }
    code
}

/// Start `-g` copies of this program, one per rank, on loopback.
fn launch(args: &Args) -> i32 {
    let Ok(exe) = std::env::current_exe() else {
        eprintln!("metaroce-allreduce: cannot find my own executable");
        return 1;
    };
    // A free port for the rendezvous; rank 0 binds it again right away.
    let addr = match std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("metaroce-allreduce: rendezvous: {e}");
            return 1;
        }
    };
    let passed: Vec<String> = std::env::args().skip(1).collect();
    let mut children = Vec::new();
    for r in 0..args.ranks {
        let mut c = std::process::Command::new(&exe);
        c.args(&passed)
            .arg("--rank")
            .arg(r.to_string())
            .arg("--rendezvous")
            .arg(addr.to_string());
        match c.spawn() {
            Ok(ch) => children.push(ch),
            Err(e) => {
                eprintln!("metaroce-allreduce: start rank {r}: {e}");
                for mut ch in children {
                    let _ = ch.kill();
                    let _ = ch.wait();
                }
                return 1;
            }
        }
    }
    // Wait for all; once one rank failed, the others would wait for it forever: end them.
    let mut children: Vec<Option<std::process::Child>> = children.into_iter().map(Some).collect();
    let mut code = 0;
    loop {
        let mut running = 0;
        for slot in &mut children {
            let Some(ch) = slot else { continue };
            match ch.try_wait() {
                Ok(None) => running += 1,
                Ok(Some(st)) => {
                    code = code.max(st.code().unwrap_or(1));
                    *slot = None;
                }
                Err(_) => {
                    code = 1;
                    *slot = None;
                }
            }
        }
        if running == 0 {
            return code;
        }
        if code != 0 {
            for mut ch in children.iter_mut().filter_map(Option::take) {
                let _ = ch.kill();
                let _ = ch.wait();
            }
            return code;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The sizes of the run: `-b`, `-b·f`, … up to `-e`.
fn sizes(a: &Args) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = a.min_bytes;
    while s <= a.max_bytes {
        v.push(s);
        match s.checked_mul(a.step_factor) {
            Some(x) => s = x,
            None => break,
        }
    }
    v
}

/// One rank: bootstrap, connect, run every size on every selected transport. Returns the
/// total number of wrong elements (rank 0: over all ranks; others 0).
async fn rank_main(
    args: Args,
    r: usize,
    listener: Option<tokio::net::TcpListener>,
) -> Result<u64, BoxError> {
    let n = args.ranks;
    let rendezvous = args.rendezvous.ok_or("no rendezvous address")?;
    let max = args.max_bytes;
    let (want_rdma, want_tcp) = match args.transport {
        TransportSel::Metaroce => (true, false),
        TransportSel::Tcp => (false, true),
        TransportSel::Both => (true, true),
    };
    let (mut boot, table, (rdma, tcp)) =
        boot::Boot::join(r, n, rendezvous, listener, |ip| async move {
            let rdma = if want_rdma {
                Some(Rdma::bind(ip, max).await?)
            } else {
                None
            };
            let tcp = if want_tcp {
                Some(Tcp::bind(ip, max).await?)
            } else {
                None
            };
            let unbound = SocketAddr::new(ip, 0);
            let addrs = boot::RankAddrs {
                rdma: rdma.as_ref().map_or(unbound, |x| x.local_addr()),
                tcp: match &tcp {
                    Some(t) => t.local_addr()?,
                    None => unbound,
                },
            };
            Ok((addrs, (rdma, tcp)))
        })
        .await?;
    let mut xports = Vec::new();
    if let Some(mut x) = rdma {
        x.connect(r, &table.iter().map(|a| a.rdma).collect::<Vec<_>>())
            .await?;
        xports.push(Xport::Rdma(Box::new(x)));
    }
    if let Some(mut x) = tcp {
        x.connect(r, &table.iter().map(|a| a.tcp).collect::<Vec<_>>())
            .await?;
        xports.push(Xport::Tcp(Box::new(x)));
    }
    boot.barrier().await?;

    let mut wrong_total = 0;
    let mut results: Vec<(&'static str, Rows)> = Vec::new();
    for x in &mut xports {
        if r == 0 {
            header(&args, x.name());
        }
        let mut rows = Rows::new();
        for size in sizes(&args) {
            let (line, w) = run_size(&args, r, x, &mut boot, size).await?;
            wrong_total += w.map_or(0, |(_, _, w)| w);
            if let Some(row) = w {
                rows.push(row);
            }
            if r == 0 {
                println!("{line}");
            }
        }
        if r == 0 {
            let avg = if rows.is_empty() {
                0.0
            } else {
                rows.iter().map(|x| x.1).sum::<f64>() / rows.len() as f64
            };
            let w: u64 = rows.iter().map(|x| x.2).sum();
            println!(
                "# Out of bounds values : {w} {}",
                if w == 0 { "OK" } else { "FAILED" }
            );
            println!("# Avg bus bandwidth    : {avg:.4} GB/s ({})", x.name());
            println!("#");
        }
        results.push((x.name(), rows));
    }
    if r == 0 && results.len() == 2 {
        println!("# busbw ratio, same run: metaroce / tcp");
        println!("#       size   metaroce busbw   tcp busbw    ratio");
        println!("#        (B)          (GB/s)       (GB/s)");
        for (a, b) in results[0].1.iter().zip(results[1].1.iter()) {
            let ratio = if b.1 > 0.0 { a.1 / b.1 } else { f64::NAN };
            println!("{:>12} {:>16.3} {:>11.3} {:>8.2}", a.0, a.1, b.1, ratio);
        }
    }
    Ok(wrong_total)
}

fn header(a: &Args, transport: &str) {
    println!(
        "# metaroce-allreduce: {} over {transport}, {} ranks ({})",
        a.collective.name(),
        a.ranks,
        if a.in_process { "tasks" } else { "processes" }
    );
    println!(
        "#  minBytes {} maxBytes {} step: {}(factor) warmup iters: {} iters: {} validation: {}",
        a.min_bytes, a.max_bytes, a.step_factor, a.warmup, a.iters, a.check
    );
    println!("#");
    println!("#                                             out-of-place");
    println!("#       size         count      type   redop     time   algbw   busbw  #wrong");
    println!("#        (B)    (elements)                       (us)  (GB/s)  (GB/s)");
}

/// Run one size on one transport. Returns the table line (rank 0) and the row, `None`
/// for a size too small to split over the ranks.
async fn run_size(
    a: &Args,
    r: usize,
    x: &mut Xport,
    boot: &mut boot::Boot,
    size: usize,
) -> Result<(String, Option<(usize, f64, u64)>), BoxError> {
    let (n, dt, op, coll) = (a.ranks, a.datatype, a.op, a.collective);
    let count = data::count_for(coll, dt, n, size);
    let redop = if coll.reduces() { op.name() } else { "none" };
    if count < n {
        return Ok((
            format!(
                "{size:>12} {count:>13} {:>9} {redop:>7}   (skipped: fewer elements than ranks)",
                dt.name()
            ),
            None,
        ));
    }
    let bytes = count * dt.size();
    let plan = data::plan(coll, dt, r, n, count);
    x.load_input(&data::input_for(coll, dt, r, n, count))?;
    let out_len = if coll == Collective::ReduceScatter {
        bytes / n
    } else {
        bytes
    };
    boot.barrier().await?;
    for _ in 0..a.warmup {
        for st in &plan {
            x.step(st, dt, op).await?;
        }
    }
    x.poison_output(out_len)?;
    boot.barrier().await?;
    let t0 = Instant::now();
    for _ in 0..a.iters.max(1) {
        for st in &plan {
            x.step(st, dt, op).await?;
        }
    }
    let el = t0.elapsed();
    let wrong = if a.check != 0 {
        data::wrong(coll, dt, op, r, n, count, &x.output(out_len)?)
    } else {
        0
    };
    let all = boot.gather(&format!("{} {wrong}", el.as_nanos())).await?;
    if r != 0 {
        return Ok((String::new(), Some((bytes, 0.0, 0))));
    }
    let mut worst_ns: u128 = 0;
    let mut wrong_sum: u64 = 0;
    for l in &all {
        let mut f = l.split(' ');
        let t: u128 = f.next().and_then(|v| v.parse().ok()).ok_or("bad gather")?;
        let w: u64 = f.next().and_then(|v| v.parse().ok()).ok_or("bad gather")?;
        worst_ns = worst_ns.max(t);
        wrong_sum += w;
    }
    let t_us = worst_ns as f64 / 1e3 / a.iters.max(1) as f64;
    let algbw = bytes as f64 / (t_us * 1e-6) / 1e9;
    let busbw = algbw * coll.bus_factor(n);
    let wrong_col = if a.check != 0 {
        wrong_sum.to_string()
    } else {
        "N/A".into()
    };
    Ok((
        format!(
            "{bytes:>12} {count:>13} {:>9} {redop:>7} {t_us:>8.1} {algbw:>7.3} {busbw:>7.3} {wrong_col:>7}",
            dt.name()
        ),
        Some((bytes, busbw, wrong_sum)),
    ))
}
