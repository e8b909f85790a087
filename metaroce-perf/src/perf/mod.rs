//! `metaroce-perf`: a perftest-style benchmark (ib_write_bw, ib_write_lat, ib_read_bw,
//! ib_read_lat, ib_atomic_lat, ib_send_bw, ib_send_lat) of the MetaRoCE transport and of its
//! RoCEv2-compatible RC mode over UDP, with loopback, client and server modes, impairments,
//! data verification, packet capture, and a side-by-side comparison of the two modes.

mod cli;
mod client;
mod compare;
mod ctrl;
mod data;
mod net;
mod pcap;
mod progress;
mod proto;
mod report;
mod server;
mod stats;
mod verbs;
mod xport;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};
use cli::{Args, Mode, Role, Settings};
use client::ClientRun;
use ctrl::Chan;
use data::derive_seed;
use metaroce_tokio::backend::ImpairStats;
use net::{Node, RcSockets};
use server::ServerRun;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};
use xport::{Net, RcNet};

/// Result with a message for the user.
pub type Res<T> = Result<T, String>;

/// Exit status: verification failed or the run broke.
const EXIT_FAILED: i32 = 1;

/// How long a rocev2 client keeps trying to reach the server's TCP port.
const TCP_CONNECT_PATIENCE: Duration = Duration::from_secs(10);

/// Parses the command line, runs, and returns the process exit status (clap exits with 2 on
/// usage errors).
pub fn main() -> i32 {
    let args = Args::parse();
    if args.backend == cli::BackendKind::Verbs {
        return verbs::main(&args);
    }
    let settings = match args.validate() {
        Ok(s) => s,
        Err(msg) => Args::command()
            .error(ErrorKind::ValueValidation, msg)
            .exit(),
    };
    // Colour codes only on a terminal: a log file or a pipe gets plain text.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .try_init();
    if settings.compare.is_some() {
        return compare::run(&settings);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("metaroce-perf: cannot start the async runtime: {e}");
            return EXIT_FAILED;
        }
    };
    // Every test runs as a task on the runtime's workers, not as the `block_on` future:
    // that future runs on this thread, outside the worker pool, so every completion the
    // endpoints' driver tasks (on the workers) deliver to it, and every post that wakes a
    // driver, is a wake-up of another thread — tens of µs on an idle VM (issue #13 P2). A
    // service that drives its connections from spawned tasks has the same advantage.
    // Bandwidth tests kept that third thread until `write_bw -s 64` showed it cost more
    // than it gave: as a task, 0.54–0.69 against 0.30–0.55 M WRITEs/s (udp) with half
    // the context switches, and 1 MiB WRITEs unchanged (docs/RESULTS.md, fifteenth
    // session). Their in-process server still has a runtime and thread of its own
    // (`LocalServer::thread`).
    let result = runtime.block_on(async { tokio::spawn(run(settings)).await });
    let code = match result {
        Ok(Ok(code)) => code,
        Ok(Err(e)) => {
            eprintln!("metaroce-perf: {e}");
            EXIT_FAILED
        }
        Err(e) => {
            eprintln!("metaroce-perf: the run's task failed: {e}");
            EXIT_FAILED
        }
    };
    // Do not wait for the endpoints' background tasks.
    runtime.shutdown_background();
    code
}

fn add(a: ImpairStats, b: ImpairStats) -> ImpairStats {
    ImpairStats {
        seen: a.seen + b.seen,
        dropped: a.dropped + b.dropped,
        queue_dropped: a.queue_dropped + b.queue_dropped,
        duplicated: a.duplicated + b.duplicated,
        reordered: a.reordered + b.reordered,
        corrupted: a.corrupted + b.corrupted,
        ce_marked: a.ce_marked + b.ce_marked,
        delayed: a.delayed + b.delayed,
        sent: a.sent + b.sent,
        send_errors: a.send_errors + b.send_errors,
        held_datagrams: a.held_datagrams + b.held_datagrams,
        held_bytes: a.held_bytes + b.held_bytes,
    }
}

/// Seed streams of the endpoints: the server side and the client side draw different
/// impairment decisions and QPNs from one `--seed`.
const SEED_SERVER_IMPAIR: u64 = 1;
const SEED_SERVER_CORE: u64 = 2;
const SEED_CLIENT_IMPAIR: u64 = 3;
const SEED_CLIENT_CORE: u64 = 4;

fn bind_err(what: &str, addr: SocketAddr) -> impl FnOnce(std::io::Error) -> String + '_ {
    move |e| format!("cannot bind the {what} endpoint at {addr}: {e}")
}

/// What one process measured and saw.
struct Outcome {
    client: Option<ClientRun>,
    server: Option<ServerRun>,
    impair: ImpairStats,
}

async fn run(s: Settings) -> Res<i32> {
    let sink = match &s.pcap {
        Some(path) => Some(
            pcap::PcapSink::create(path, s.pcap_max_packets)
                .map_err(|e| format!("--pcap {}: {e}", path.display()))?,
        ),
        None => None,
    };
    // Like --pcap: a path that cannot be written fails now, not after the run.
    if let Some(path) = &s.out_json {
        std::fs::File::create(path)
            .map_err(|e| format!("--out_json_file {}: {e}", path.display()))?;
    }
    let sink = sink.as_ref();
    let out = match (s.mode, &s.role) {
        (Mode::Metaroce, Role::Loopback) => meta_loopback(&s, sink).await?,
        (Mode::Metaroce, Role::Client { addr, given }) => {
            meta_client(&s, *addr, given, sink).await?
        }
        (Mode::Metaroce, Role::Server { addr }) => meta_server(&s, *addr, sink).await?,
        (Mode::Rocev2, Role::Loopback) => rc_loopback(&s, sink).await?,
        (Mode::Rocev2, Role::Client { addr, given }) => rc_client(&s, *addr, given, sink).await?,
        (Mode::Rocev2, Role::Server { addr }) => rc_server(&s, *addr, sink).await?,
    };

    let pcap = match sink {
        Some(sink) => Some(
            sink.finish()
                .map_err(|e| format!("writing the pcap file: {e}"))?,
        ),
        None => None,
    };
    let footer = report::Footer {
        client: out.client.as_ref(),
        server: out.server.as_ref(),
        impair: out.impair,
        pcap,
    };
    report::footer(&s, &footer);
    let verified = !matches!(&out.client, Some(c) if !c.verified());
    if let Some(path) = &s.out_json {
        let text = report::json(&s, &footer, verified).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n")
            .map_err(|e| format!("--out_json_file {}: {e}", path.display()))?;
    }
    if !verified {
        eprintln!("metaroce-perf: data verification FAILED");
        return Ok(EXIT_FAILED);
    }
    Ok(0)
}

type Sink<'a> = Option<&'a Arc<pcap::PcapSink>>;

fn unspecified_like(addr: &SocketAddr) -> SocketAddr {
    SocketAddr::new(
        if addr.is_ipv4() {
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        } else {
            IpAddr::V6(Ipv6Addr::UNSPECIFIED)
        },
        0,
    )
}

/// Runs the client over `net` while the in-process server runs `server`; the server's
/// result is awaited only if the client succeeded.
async fn with_local_server(
    client: Res<ClientRun>,
    server: tokio::task::JoinHandle<Res<ServerRun>>,
) -> Res<(ClientRun, ServerRun)> {
    match client {
        Ok(c) => {
            let r = server.await.map_err(|e| format!("server task: {e}"))??;
            Ok((c, r))
        }
        Err(e) => {
            server.abort();
            Err(e)
        }
    }
}

/// The in-process server of a loopback run (`meta_loopback`).
enum LocalServer {
    /// A task on this runtime (latency tests).
    Task {
        node: Node,
        task: tokio::task::JoinHandle<Res<ServerRun>>,
    },
    /// Its own runtime on its own thread (bandwidth tests); the endpoint is a handle to
    /// it, the thread returns the run and the impairment counters.
    Thread {
        ep: metaroce_tokio::Endpoint,
        thread: std::thread::JoinHandle<Res<(ServerRun, ImpairStats)>>,
    },
}

impl LocalServer {
    /// A server task on the current runtime.
    fn task(s: &Settings, addr: SocketAddr, sink: Sink<'_>) -> Res<LocalServer> {
        let node = meta_node(s, true, addr, sink)?;
        let ep = node.ep.clone();
        let rx_depth = s.rx_depth;
        let task = tokio::spawn(async move { meta_serve(&ep, false, rx_depth).await });
        Ok(LocalServer::Task { node, task })
    }

    /// A server on a one-worker runtime of its own thread, as a separate server process
    /// would be (perftest's and iperf3's arrangement). On one shared runtime tokio runs a
    /// task woken by another on the waker's worker (its LIFO slot, which other workers do
    /// not steal from), so in a bulk transfer the two endpoints' driver tasks took turns
    /// on one worker while the other idled: one CPU of two (issue #13 P1). One worker, not
    /// a current-thread runtime: the server's own work between rounds (allocating and
    /// checking its region) must not hold up its driver.
    async fn thread(s: &Settings, addr: SocketAddr, sink: Sink<'_>) -> Res<LocalServer> {
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let (s2, sink2) = (s.clone(), sink.cloned());
        let thread = std::thread::Builder::new()
            .name("metaroce-perf server".into())
            .spawn(move || -> Res<(ServerRun, ImpairStats)> {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .enable_all()
                    .build()
                    .map_err(|e| format!("cannot start the server's runtime: {e}"))?;
                rt.block_on(async move {
                    let node = match meta_node(&s2, true, addr, sink2.as_ref()) {
                        Ok(n) => n,
                        Err(e) => {
                            let _ = ready_tx.send(None);
                            return Err(e);
                        }
                    };
                    let _ = ready_tx.send(Some(node.ep.clone()));
                    let run = meta_serve(&node.ep, false, s2.rx_depth).await?;
                    Ok((run, node.impair_stats()))
                })
            })
            .map_err(|e| format!("cannot start the server's thread: {e}"))?;
        match ready_rx.await {
            Ok(Some(ep)) => Ok(LocalServer::Thread { ep, thread }),
            _ => Err(join_server(thread)
                .await
                .err()
                .unwrap_or_else(|| "the server did not start".into())),
        }
    }

    fn ep(&self) -> &metaroce_tokio::Endpoint {
        match self {
            LocalServer::Task { node, .. } => &node.ep,
            LocalServer::Thread { ep, .. } => ep,
        }
    }

    /// The server's run and impairment counters once the client's run `client` ended;
    /// if the client failed, the server is stopped instead and the client's error returned.
    async fn finish(self, client: Res<ClientRun>) -> Res<(ClientRun, ServerRun, ImpairStats)> {
        let c = match client {
            Ok(c) => c,
            Err(e) => return Err(self.abandon(e).await),
        };
        match self {
            LocalServer::Task { node, task } => {
                let r = task.await.map_err(|e| format!("server task: {e}"))??;
                Ok((c, r, node.impair_stats()))
            }
            LocalServer::Thread { ep, thread } => {
                drop(ep);
                let (r, impair) = join_server(thread).await?;
                Ok((c, r, impair))
            }
        }
    }

    /// Stops the server after the client side failed with `e` (before connecting or during
    /// its run) and returns `e`. A server thread still waiting for its client ends when its
    /// endpoint is closed (`accept` returns `None`); it is joined, not left behind.
    async fn abandon(self, e: String) -> String {
        match self {
            LocalServer::Task { task, .. } => task.abort(),
            LocalServer::Thread { ep, thread } => {
                ep.close(0, b"client failed");
                drop(ep);
                if let Err(server) = join_server(thread).await {
                    tracing::debug!(%server, "the in-process server stopped");
                }
            }
        }
        e
    }
}

/// Waits (off the runtime's workers) for the server's thread to return.
async fn join_server(
    thread: std::thread::JoinHandle<Res<(ServerRun, ImpairStats)>>,
) -> Res<(ServerRun, ImpairStats)> {
    tokio::task::spawn_blocking(move || {
        thread
            .join()
            .map_err(|_| "the server's thread panicked".to_string())?
    })
    .await
    .map_err(|e| format!("the server's thread: {e}"))?
}

/// Both sides in this process over 127.0.0.1. Bandwidth tests run the server on its own
/// runtime and thread ([`LocalServer::thread`]); latency tests, one message at a time,
/// keep it on this runtime, where a completion does not have to wake another thread
/// (tens of µs on an idle VM).
async fn meta_loopback(s: &Settings, sink: Sink<'_>) -> Res<Outcome> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let server = if s.test.is_bw() {
        LocalServer::thread(s, addr, sink).await?
    } else {
        LocalServer::task(s, addr, sink)?
    };
    let client = match meta_node(s, false, addr, sink) {
        Ok(c) => c,
        Err(e) => return Err(server.abandon(e).await),
    };
    let run = async {
        let conn = client
            .ep
            .connect(server.ep().local_addr())
            .map_err(|e| format!("connecting to the in-process server: {e}"))?
            .await
            .map_err(|e| format!("connecting to the in-process server: {}", error_chain(&e)))?;
        let r = meta_run_client(&conn, s).await;
        conn.close(0, b"done");
        r
    };
    let r = run.await;
    let (c, r, server_impair) = server.finish(r).await?;
    Ok(Outcome {
        client: Some(c),
        server: Some(r),
        impair: add(client.impair_stats(), server_impair),
    })
}

/// The MetaRoCE endpoint of the server (`server`) or client side at `addr`, with that
/// side's impairment and core seeds.
fn meta_node(s: &Settings, server: bool, addr: SocketAddr, sink: Sink<'_>) -> Res<Node> {
    let (what, impair, core) = if server {
        ("server", SEED_SERVER_IMPAIR, SEED_SERVER_CORE)
    } else {
        ("client", SEED_CLIENT_IMPAIR, SEED_CLIENT_CORE)
    };
    Node::bind(
        addr,
        s,
        derive_seed(s.seed, impair),
        core_seed(s, core),
        sink,
    )
    .map_err(bind_err(what, addr))
}

/// The server side's first client: its connection, accepted, and the control stream it
/// says hello on.
/// Serves the first client of `ep`: `server::serve` over its connection and control
/// stream (`print`: report each round, as a stand-alone server does).
async fn meta_serve(ep: &metaroce_tokio::Endpoint, print: bool, rx_depth: usize) -> Res<ServerRun> {
    let (conn, ctrl) = meta_accept(ep).await?;
    server::serve(Net::Meta(conn), Chan::Stream(ctrl), print, rx_depth).await
}

async fn meta_accept(
    ep: &metaroce_tokio::Endpoint,
) -> Res<(metaroce_tokio::Connection, metaroce_tokio::MessageStream)> {
    let conn = ep
        .accept()
        .await
        .ok_or("the server endpoint closed")?
        .accept()
        .map_err(|e| format!("accepting the client's connection: {e}"))?;
    let ctrl = conn
        .accept_stream()
        .await
        .ok_or("the client closed the connection before saying hello")?;
    Ok((conn, ctrl))
}

async fn meta_run_client(conn: &metaroce_tokio::Connection, s: &Settings) -> Res<ClientRun> {
    let ctrl = conn
        .open_stream()
        .map_err(|e| format!("opening the control stream: {e}"))?;
    client::run(&Net::Meta(conn.clone()), &mut Chan::Stream(ctrl), s).await
}

async fn meta_client(s: &Settings, addr: SocketAddr, given: &str, sink: Sink<'_>) -> Res<Outcome> {
    let local = unspecified_like(&addr);
    let client = meta_node(s, false, local, sink)?;
    let connecting = client.ep.connect(addr).map_err(|e| e.to_string());
    let conn = match connecting {
        Ok(c) => c.await.map_err(|e| error_chain(&e)),
        Err(e) => Err(e),
    };
    let conn = conn.map_err(|e| {
        if given == addr.to_string() {
            format!("connecting to {addr}: {e}")
        } else {
            format!("connecting to {given} ({addr}): {e}")
        }
    })?;
    let c = meta_run_client(&conn, s).await?;
    conn.close(0, b"done");
    Ok(Outcome {
        client: Some(c),
        server: None,
        impair: client.impair_stats(),
    })
}

async fn meta_server(s: &Settings, addr: SocketAddr, sink: Sink<'_>) -> Res<Outcome> {
    let server = meta_node(s, true, addr, sink)?;
    report::preamble(s, None);
    println!(
        " Waiting for a client on {} (source ports {:?})",
        server.ep.local_addr(),
        server.ep.source_ports()
    );
    let r = meta_serve(&server.ep, true, s.rx_depth).await?;
    report::rule();
    Ok(Outcome {
        client: None,
        server: Some(r),
        impair: server.impair_stats(),
    })
}

/// The seed of a transport core's reproducible RNG (QPNs, PSNs): derived from `--seed`
/// when it was given, else `None` = from the operating system (issue #9: runs must not all
/// share QPNs). Impairments and data keep their own seeds.
fn core_seed(s: &Settings, stream: u64) -> Option<u64> {
    s.core_seed.map(|x| derive_seed(x, stream))
}

/// An RC QP on UDP sockets bound at `bind`, advertising `local_ip`, for a peer at `peer_ip`.
fn rc_net(
    s: &Settings,
    sockets: RcSockets,
    local_ip: IpAddr,
    peer_ip: IpAddr,
    core_seed: Option<u64>,
) -> Res<Arc<RcNet>> {
    let node = sockets
        .endpoint(local_ip, s, core_seed)
        .map_err(|e| format!("starting the RC endpoint: {e}"))?;
    Ok(Arc::new(RcNet::new(
        node,
        peer_ip,
        s.mtu,
        s.rc_timeout,
        s.outs,
    )?))
}

fn rc_impair(net: &RcNet) -> ImpairStats {
    net.node.impair_stats()
}

async fn rc_loopback(s: &Settings, sink: Sink<'_>) -> Res<Outcome> {
    let seed = s.seed;
    let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let addr = SocketAddr::new(lo, 0);
    let ss = RcSockets::bind(addr, s, derive_seed(seed, SEED_SERVER_IMPAIR), sink)
        .map_err(bind_err("server", addr))?;
    let cs = RcSockets::bind(addr, s, derive_seed(seed, SEED_CLIENT_IMPAIR), sink)
        .map_err(bind_err("client", addr))?;
    let server = rc_net(s, ss, lo, lo, core_seed(s, SEED_SERVER_CORE))?;
    let client = rc_net(s, cs, lo, lo, core_seed(s, SEED_CLIENT_CORE))?;
    // The control exchange runs over an in-process pipe, framed as over TCP.
    let (a, b) = tokio::io::duplex(1 << 16);
    let server_net = Net::Rc(server.clone());
    let rx_depth = s.rx_depth;
    let server_task =
        tokio::spawn(
            async move { server::serve(server_net, Chan::bytes(b), false, rx_depth).await },
        );
    let mut chan = Chan::bytes(a);
    let r = client::run(&Net::Rc(client.clone()), &mut chan, s).await;
    drop(chan);
    let (c, r) = with_local_server(r, server_task).await?;
    Ok(Outcome {
        client: Some(c),
        server: Some(r),
        impair: add(rc_impair(&client), rc_impair(&server)),
    })
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

async fn tcp_connect(target: SocketAddr) -> Res<tokio::net::TcpStream> {
    // The server may still be starting: retry for a while.
    let start = Instant::now();
    loop {
        match tokio::net::TcpStream::connect(target).await {
            Ok(t) => {
                let _ = t.set_nodelay(true);
                return Ok(t);
            }
            Err(e) if start.elapsed() < TCP_CONNECT_PATIENCE => {
                tracing::debug!(error = %e, "connect {target}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(format!("connecting to the exchange port {target}: {e}")),
        }
    }
}

async fn rc_client(s: &Settings, addr: SocketAddr, given: &str, sink: Sink<'_>) -> Res<Outcome> {
    let seed = s.seed;
    let target = SocketAddr::new(addr.ip(), s.oob_port);
    let tcp = tcp_connect(target)
        .await
        .map_err(|e| format!("{e} (server {given})"))?;
    let local_ip = canonical(tcp.local_addr().map_err(|e| e.to_string())?.ip());
    let peer_ip = canonical(tcp.peer_addr().map_err(|e| e.to_string())?.ip());
    let bind = SocketAddr::new(local_ip, 0);
    let sockets = RcSockets::bind(bind, s, derive_seed(seed, SEED_CLIENT_IMPAIR), sink)
        .map_err(bind_err("client", bind))?;
    let net = rc_net(
        s,
        sockets,
        local_ip,
        peer_ip,
        core_seed(s, SEED_CLIENT_CORE),
    )?;
    let mut chan = Chan::bytes(tcp);
    let c = client::run(&Net::Rc(net.clone()), &mut chan, s).await?;
    Ok(Outcome {
        client: Some(c),
        server: None,
        impair: rc_impair(&net),
    })
}

async fn rc_server(s: &Settings, addr: SocketAddr, sink: Sink<'_>) -> Res<Outcome> {
    let seed = s.seed;
    let sockets = RcSockets::bind(addr, s, derive_seed(seed, SEED_SERVER_IMPAIR), sink)
        .map_err(bind_err("server", addr))?;
    let tcp_addr = SocketAddr::new(addr.ip(), s.oob_port);
    let listener = tokio::net::TcpListener::bind(tcp_addr)
        .await
        .map_err(|e| format!("cannot listen on TCP {tcp_addr} for the exchange: {e}"))?;
    report::preamble(s, None);
    println!(
        " Waiting for a client on TCP {tcp_addr} (RoCEv2 datagrams on UDP {})",
        sockets.local_addr()
    );
    let (tcp, peer) = listener
        .accept()
        .await
        .map_err(|e| format!("accepting the exchange connection: {e}"))?;
    drop(listener);
    let _ = tcp.set_nodelay(true);
    let local_ip = canonical(tcp.local_addr().map_err(|e| e.to_string())?.ip());
    let net = rc_net(
        s,
        sockets,
        local_ip,
        canonical(peer.ip()),
        core_seed(s, SEED_SERVER_CORE),
    )?;
    let r = server::serve(Net::Rc(net.clone()), Chan::bytes(tcp), true, s.rx_depth).await?;
    report::rule();
    Ok(Outcome {
        client: None,
        server: Some(r),
        impair: rc_impair(&net),
    })
}

/// An error and its sources, `: `-separated.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
