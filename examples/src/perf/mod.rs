//! `metaroce-perf`: a perftest-style benchmark (ib_write_bw, ib_send_lat) of the MetaRoCE
//! transport over UDP, with loopback, client and server modes, impairments, data
//! verification and packet capture.

mod cli;
mod client;
mod data;
mod net;
mod pcap;
mod proto;
mod report;
mod server;
mod stats;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};
use cli::{Args, Role, Settings};
use data::derive_seed;
use metaroce_tokio::backend::ImpairStats;
use net::Node;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Result with a message for the user.
pub type Res<T> = Result<T, String>;

/// Exit status: verification failed or the run broke.
const EXIT_FAILED: i32 = 1;

/// Parses the command line, runs, and returns the process exit status (clap exits with 2 on
/// usage errors).
pub fn main() -> i32 {
    let args = Args::parse();
    let settings = match args.validate() {
        Ok(s) => s,
        Err(msg) => Args::command()
            .error(ErrorKind::ValueValidation, msg)
            .exit(),
    };
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .try_init();
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
    let code = match runtime.block_on(run(settings)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("metaroce-perf: {e}");
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

async fn run(s: Settings) -> Res<i32> {
    let sink = match &s.pcap {
        Some(path) => Some(
            pcap::PcapSink::create(path, s.pcap_max_packets)
                .map_err(|e| format!("--pcap {}: {e}", path.display()))?,
        ),
        None => None,
    };
    let seed = s.seed;
    let (client_run, server_run, impair) = match &s.role {
        Role::Loopback => {
            let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
            let server = Node::bind(
                addr,
                &s,
                derive_seed(seed, SEED_SERVER_IMPAIR),
                derive_seed(seed, SEED_SERVER_CORE),
                sink.as_ref(),
            )
            .map_err(bind_err("server", addr))?;
            let client = Node::bind(
                addr,
                &s,
                derive_seed(seed, SEED_CLIENT_IMPAIR),
                derive_seed(seed, SEED_CLIENT_CORE),
                sink.as_ref(),
            )
            .map_err(bind_err("client", addr))?;
            let server_ep = server.ep.clone();
            let server_task = tokio::spawn(async move {
                let conn = server_ep
                    .accept()
                    .await
                    .ok_or("the server endpoint closed")?;
                server::serve(conn, false).await
            });
            let conn = client
                .ep
                .connect(server.ep.local_addr())
                .await
                .map_err(|e| format!("connecting to the in-process server: {e}"))?;
            let client_run = client::run(&conn, &s).await;
            conn.close();
            let server_run = match client_run {
                Ok(_) => Some(
                    server_task
                        .await
                        .map_err(|e| format!("server task: {e}"))??,
                ),
                Err(_) => {
                    server_task.abort();
                    None
                }
            };
            let client_run = client_run?;
            let impair = add(client.impair_stats(), server.impair_stats());
            (Some(client_run), server_run, impair)
        }
        Role::Client { addr, given } => {
            let local = SocketAddr::new(
                if addr.is_ipv4() {
                    IpAddr::V4(Ipv4Addr::UNSPECIFIED)
                } else {
                    IpAddr::V6(Ipv6Addr::UNSPECIFIED)
                },
                0,
            );
            let client = Node::bind(
                local,
                &s,
                derive_seed(seed, SEED_CLIENT_IMPAIR),
                derive_seed(seed, SEED_CLIENT_CORE),
                sink.as_ref(),
            )
            .map_err(bind_err("client", local))?;
            let conn = client.ep.connect(*addr).await.map_err(|e| {
                if *given == addr.to_string() {
                    format!("connecting to {addr}: {e}")
                } else {
                    format!("connecting to {given} ({addr}): {e}")
                }
            })?;
            let client_run = client::run(&conn, &s).await?;
            conn.close();
            (Some(client_run), None, client.impair_stats())
        }
        Role::Server { addr } => {
            let server = Node::bind(
                *addr,
                &s,
                derive_seed(seed, SEED_SERVER_IMPAIR),
                derive_seed(seed, SEED_SERVER_CORE),
                sink.as_ref(),
            )
            .map_err(bind_err("server", *addr))?;
            report::preamble(&s, None);
            println!(
                " Waiting for a client on {} (source ports {:?})",
                server.ep.local_addr(),
                server.ep.source_ports()
            );
            let conn = server
                .ep
                .accept()
                .await
                .ok_or("the server endpoint closed")?;
            let server_run = server::serve(conn, true).await?;
            report::rule();
            (None, Some(server_run), server.impair_stats())
        }
    };

    let pcap = match &sink {
        Some(sink) => Some(
            sink.finish()
                .map_err(|e| format!("writing the pcap file: {e}"))?,
        ),
        None => None,
    };
    let footer = report::Footer {
        client: client_run.as_ref(),
        server: server_run.as_ref(),
        impair,
        pcap,
    };
    report::footer(&s, &footer);
    let verified = !matches!(&client_run, Some(c) if !c.verified());
    if let Some(path) = &s.out_json {
        let text = report::json(&s, &footer, verified).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n")
            .map_err(|e| format!("--out_json {}: {e}", path.display()))?;
    }
    if !verified {
        eprintln!("metaroce-perf: data verification FAILED");
        return Ok(EXIT_FAILED);
    }
    Ok(0)
}
