//! Command line of `metaroce-perf`: the clap definition and its validation into
//! [`Settings`].

use clap::{Parser, ValueEnum};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

/// UDP port of RoCEv2 (IANA), the default server port.
pub const DEFAULT_PORT: u16 = 4791;

/// Largest message / WRITE size (IBA: 2^31 bytes).
pub const MAX_SIZE: u64 = 1 << 31;

/// Most paths accepted on the command line.
pub const MAX_PATHS: u16 = 64;

/// The benchmarks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Test {
    /// One-sided RDMA WRITE bandwidth (perftest `ib_write_bw`).
    WriteBw,
    /// Two-sided SEND ping-pong latency (perftest `ib_send_lat`).
    SendLat,
}

impl Test {
    /// Every test, in the order `--help` lists them.
    pub const ALL: [Test; 2] = [Test::WriteBw, Test::SendLat];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Test::WriteBw => "write_bw",
            Test::SendLat => "send_lat",
        }
    }

    /// The test named `s`, if any.
    pub fn from_name(s: &str) -> Option<Test> {
        Test::ALL.into_iter().find(|t| t.name() == s)
    }

    /// The title line of the report.
    pub fn title(self) -> &'static str {
        match self {
            Test::WriteBw => "RDMA_Write BW Test",
            Test::SendLat => "Send Latency Test",
        }
    }

    /// Wire code used in the control exchange.
    pub fn code(self) -> u8 {
        match self {
            Test::WriteBw => 1,
            Test::SendLat => 2,
        }
    }

    /// The test of a wire code.
    pub fn from_code(c: u8) -> Option<Test> {
        Test::ALL.into_iter().find(|t| t.code() == c)
    }
}

/// Transport flavour (`--mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// MetaRoCE: multipath, selective repeat, per-path congestion control.
    Metaroce,
    /// Plain RoCEv2 RC (not implemented yet).
    Rocev2,
}

/// Datagram backend (`--backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// Kernel UDP sockets (GSO/GRO, ECN).
    Udp,
}

const AFTER_HELP: &str = "\
Modes:
  metaroce-perf [TEST]                  loopback: server and client in this process over 127.0.0.1
  metaroce-perf --server [-p PORT]      server: serve one client run, then exit
  metaroce-perf [TEST] HOST[:PORT]      client: connect to a server (default port 4791)

The server follows the client's parameters (test, sizes, iterations); its own
--loss/--paths/--mtu/--pcap apply to its side.

Units: MB/sec is 2^20 bytes per second (as perftest); Gb/sec (--report_gbits) is 10^9
bits per second. Latency is one-way: half of the measured round-trip time.

Examples:
  metaroce-perf                                   write_bw, 65536 B x 5000, loopback
  metaroce-perf -s 1048576 -n 1024 --loss 1       1 GiB of WRITEs under 1% loss
  metaroce-perf send_lat -a                       latency for sizes 2 .. 8 MiB
  metaroce-perf --file data.bin --pcap run.pcap   write a file, capture the packets";

/// perftest-style benchmark of the MetaRoCE transport.
#[derive(Debug, Parser)]
#[command(
    name = "metaroce-perf",
    version,
    allow_negative_numbers = true,
    about = "perftest-style benchmark of the MetaRoCE transport (RDMA WRITE bandwidth, SEND latency)",
    after_help = AFTER_HELP
)]
pub struct Args {
    /// Test to run: write_bw (default) or send_lat. When this is not a test name it is
    /// taken as SERVER.
    #[arg(value_name = "TEST")]
    pub first: Option<String>,

    /// Server to connect to, `host` or `host:port` (default port 4791). Without it (and
    /// without --server) both sides run in this process over 127.0.0.1.
    #[arg(value_name = "SERVER")]
    pub second: Option<String>,

    /// Run as the server: wait for one client on --bind:--port, serve its run, exit.
    #[arg(long)]
    pub server: bool,

    /// Server mode: local IP address to listen on.
    #[arg(long, value_name = "IP", default_value = "0.0.0.0")]
    pub bind: IpAddr,

    /// Server mode: UDP port to listen on.
    #[arg(short = 'p', long, value_name = "PORT", default_value_t = DEFAULT_PORT)]
    pub port: u16,

    /// Message / WRITE size in bytes (1 .. 2^31).
    #[arg(short = 's', long, value_name = "BYTES", default_value_t = 65536)]
    pub size: u64,

    /// Iterations per size [default: 5000 for write_bw, 1000 for send_lat].
    #[arg(short = 'n', long, value_name = "N", conflicts_with = "duration")]
    pub iters: Option<u64>,

    /// Run every size 2, 4, 8, ... 2^23 bytes (one row each); -s is ignored.
    #[arg(short = 'a', long)]
    pub all: bool,

    /// Run each size for SECS seconds instead of a number of iterations.
    #[arg(short = 'D', long, value_name = "SECS")]
    pub duration: Option<f64>,

    /// Report bandwidth in Gb/sec instead of MB/sec.
    #[arg(long = "report_gbits", visible_alias = "report-gbits")]
    pub report_gbits: bool,

    /// Also write the results as JSON to PATH.
    #[arg(long = "out_json", visible_alias = "out-json", value_name = "PATH")]
    pub out_json: Option<PathBuf>,

    /// write_bw: WRITEs kept outstanding.
    #[arg(
        short = 't',
        long = "tx-depth",
        value_name = "N",
        default_value_t = 128
    )]
    pub tx_depth: usize,

    /// Paths (UDP source ports) each connection sprays over (1 .. 64).
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub paths: u16,

    /// Path MTU in bytes: 256, 512, 1024, 2048 or 4096.
    #[arg(long, value_name = "BYTES", default_value_t = 4096)]
    pub mtu: u32,

    /// Random loss in percent applied to every datagram sent (by both endpoints in loopback,
    /// by this process otherwise).
    #[arg(long, value_name = "PERCENT", default_value_t = 0.0)]
    pub loss: f64,

    /// Random duplication in percent, applied like --loss.
    #[arg(long, value_name = "PERCENT", default_value_t = 0.0)]
    pub dup: f64,

    /// Random reordering in percent (the datagram is held back --reorder-delay), applied
    /// like --loss.
    #[arg(long, value_name = "PERCENT", default_value_t = 0.0)]
    pub reorder: f64,

    /// How long a reordered datagram is held back, in microseconds.
    #[arg(long = "reorder-delay", value_name = "USEC", default_value_t = 100)]
    pub reorder_delay: u64,

    /// Random ECN CE marking in percent of ECN-capable datagrams, applied like --loss.
    #[arg(long, value_name = "PERCENT", default_value_t = 0.0)]
    pub ce: f64,

    /// Seed of the impairments and of the data written.
    #[arg(long, value_name = "S", default_value_t = 1)]
    pub seed: u64,

    /// write_bw: write this file's bytes (once, in chunks of --size) and check the
    /// destination against it.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["all", "duration", "iters"])]
    pub file: Option<PathBuf>,

    /// Record every datagram this process sends into a classic pcap (Ethernet/IPv4/UDP
    /// 4791 headers synthesized, ICRC re-stamped for them).
    #[arg(long, value_name = "FILE")]
    pub pcap: Option<PathBuf>,

    /// Most packets written to --pcap (the rest are not recorded).
    #[arg(long = "pcap-max-packets", value_name = "N", default_value_t = 100_000)]
    pub pcap_max_packets: u64,

    /// Transport: metaroce (rocev2 is not implemented yet).
    #[arg(long, value_enum, default_value = "metaroce")]
    pub mode: Mode,

    /// Datagram backend.
    #[arg(long, value_enum, default_value = "udp")]
    pub backend: BackendKind,

    /// Print per-path statistics of the connection at the end.
    #[arg(long)]
    pub verbose: bool,
}

/// Where this process runs.
#[derive(Debug, Clone)]
pub enum Role {
    /// Server and client in this process over 127.0.0.1.
    Loopback,
    /// Connect to a server.
    Client {
        /// Resolved address.
        addr: SocketAddr,
        /// As given on the command line.
        given: String,
    },
    /// Listen for one client.
    Server {
        /// Address to bind.
        addr: SocketAddr,
    },
}

impl Role {
    /// Short name used in the report and JSON.
    pub fn name(&self) -> &'static str {
        match self {
            Role::Loopback => "loopback",
            Role::Client { .. } => "client",
            Role::Server { .. } => "server",
        }
    }
}

/// Network impairment, probabilities in [0, 1].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ImpairSettings {
    /// Loss probability.
    pub loss: f64,
    /// Duplication probability.
    pub dup: f64,
    /// Reordering probability.
    pub reorder: f64,
    /// Hold of a reordered datagram.
    pub reorder_delay: Duration,
    /// CE marking probability.
    pub ce: f64,
}

impl ImpairSettings {
    /// Whether anything is impaired (an [`Impaired`](metaroce_tokio::backend::Impaired)
    /// layer is needed).
    pub fn any(&self) -> bool {
        self.loss > 0.0 || self.dup > 0.0 || self.reorder > 0.0 || self.ce > 0.0
    }
}

/// The source data of a `--file` run.
#[derive(Debug, Clone)]
pub struct FileSource {
    /// Path as given.
    pub path: PathBuf,
    /// The file's bytes.
    pub data: Vec<u8>,
}

/// Validated settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Test.
    pub test: Test,
    /// Where this process runs.
    pub role: Role,
    /// Sizes, one table row each.
    pub sizes: Vec<u64>,
    /// Iterations per size; `None` in duration mode.
    pub iters: Option<u64>,
    /// Duration per size (`-D`).
    pub duration: Option<Duration>,
    /// Report Gb/sec.
    pub report_gbits: bool,
    /// JSON output path.
    pub out_json: Option<PathBuf>,
    /// Outstanding WRITEs.
    pub tx_depth: usize,
    /// Paths.
    pub paths: u16,
    /// Path MTU.
    pub mtu: u32,
    /// Impairments.
    pub impair: ImpairSettings,
    /// Seed.
    pub seed: u64,
    /// `--file` source.
    pub file: Option<FileSource>,
    /// pcap output.
    pub pcap: Option<PathBuf>,
    /// pcap packet cap.
    pub pcap_max_packets: u64,
    /// Per-path statistics.
    pub verbose: bool,
}

fn percent(name: &str, p: f64) -> Result<f64, String> {
    if p.is_finite() && (0.0..=100.0).contains(&p) {
        Ok(p / 100.0)
    } else {
        Err(format!(
            "--{name} must be a percentage in [0, 100], got {p}"
        ))
    }
}

/// Parses a server address: `host`, `host:port`, `a.b.c.d[:port]`, `[v6]:port` or a bare
/// IPv6 address. The default port is 4791.
pub fn parse_server(s: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, DEFAULT_PORT));
    }
    let (host, port) = match s.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => {
            let port = p
                .parse::<u16>()
                .map_err(|_| format!("invalid port '{p}' in server address '{s}'"))?;
            (h, port)
        }
        Some(_) => return Err(format!("invalid server address '{s}'")),
        None => (s, DEFAULT_PORT),
    };
    if host.is_empty() {
        return Err(format!("invalid server address '{s}': empty host"));
    }
    let mut addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve server address '{s}': {e}"))?
        .collect();
    // Prefer IPv4, which is what the pcap and most test beds use.
    addrs.sort_by_key(|a| !a.is_ipv4());
    addrs
        .into_iter()
        .next()
        .ok_or_else(|| format!("server address '{s}' resolves to nothing"))
}

fn unknown_test(s: &str) -> String {
    let names: Vec<&str> = Test::ALL.iter().map(|t| t.name()).collect();
    format!("unknown test '{s}' (expected one of: {})", names.join(", "))
}

/// Sizes of `-a`: 2, 4, ..., 2^23.
pub fn all_sizes() -> Vec<u64> {
    (1..=23).map(|k| 1u64 << k).collect()
}

impl Args {
    /// Checks the arguments and resolves the positionals. Errors are messages for the user
    /// (the caller exits with status 2).
    pub fn validate(self) -> Result<Settings, String> {
        if self.mode == Mode::Rocev2 {
            return Err("RoCEv2 mode is not implemented yet (only --mode metaroce)".into());
        }
        let BackendKind::Udp = self.backend;

        // Positionals: [TEST] [SERVER]; a first positional that is no test is the server.
        let (test, server) = match (self.first.as_deref(), self.second.as_deref()) {
            (None, _) => (Test::WriteBw, None),
            (Some(a), b) => match Test::from_name(a) {
                Some(t) => (t, b),
                None if b.is_some() => return Err(unknown_test(a)),
                // Host names cannot contain '_' (RFC 1123): such a word is a test name.
                None if a.contains('_') => return Err(unknown_test(a)),
                None => (Test::WriteBw, Some(a)),
            },
        };
        let role = match (server, self.server) {
            (Some(s), true) => {
                return Err(format!(
                    "--server listens for a client; do not also give a server address ('{s}')"
                ))
            }
            (Some(s), false) => Role::Client {
                addr: parse_server(s)?,
                given: s.to_string(),
            },
            (None, true) => Role::Server {
                addr: SocketAddr::new(self.bind, self.port),
            },
            (None, false) => Role::Loopback,
        };

        if self.size == 0 {
            return Err("--size must be at least 1 byte".into());
        }
        if self.size > MAX_SIZE {
            return Err(format!(
                "--size must be at most 2^31 = {MAX_SIZE} bytes, got {}",
                self.size
            ));
        }
        if self.iters == Some(0) {
            return Err("--iters must be at least 1".into());
        }
        let duration = match self.duration {
            None => None,
            Some(d) if d.is_finite() && d > 0.0 && d <= 86_400.0 => {
                Some(Duration::from_secs_f64(d))
            }
            Some(d) => {
                return Err(format!(
                    "--duration must be a number of seconds in (0, 86400], got {d}"
                ))
            }
        };
        if self.tx_depth == 0 || self.tx_depth > 65_536 {
            return Err(format!(
                "--tx-depth must be in 1..=65536, got {}",
                self.tx_depth
            ));
        }
        if self.paths == 0 || self.paths > MAX_PATHS {
            return Err(format!(
                "--paths must be in 1..={MAX_PATHS}, got {}",
                self.paths
            ));
        }
        if !(256..=4096).contains(&self.mtu) || !self.mtu.is_power_of_two() {
            return Err(format!(
                "--mtu must be 256, 512, 1024, 2048 or 4096, got {}",
                self.mtu
            ));
        }
        let impair = ImpairSettings {
            loss: percent("loss", self.loss)?,
            dup: percent("dup", self.dup)?,
            reorder: percent("reorder", self.reorder)?,
            reorder_delay: Duration::from_micros(self.reorder_delay),
            ce: percent("ce", self.ce)?,
        };
        if impair.reorder > 0.0 && self.reorder_delay == 0 {
            return Err("--reorder needs a non-zero --reorder-delay".into());
        }
        if self.reorder_delay > 10_000_000 {
            return Err("--reorder-delay must be at most 10 s (10000000 us)".into());
        }
        if self.pcap_max_packets == 0 {
            return Err("--pcap-max-packets must be at least 1".into());
        }

        let file = match &self.file {
            None => None,
            Some(_) if test != Test::WriteBw => {
                return Err("--file applies to write_bw only".into());
            }
            Some(_) if matches!(role, Role::Server { .. }) => {
                return Err(
                    "--file is a client option: the server checks what the client writes".into(),
                );
            }
            Some(path) => {
                let meta = std::fs::metadata(path)
                    .map_err(|e| format!("--file {}: {e}", path.display()))?;
                if !meta.is_file() {
                    return Err(format!("--file {}: not a regular file", path.display()));
                }
                let data =
                    std::fs::read(path).map_err(|e| format!("--file {}: {e}", path.display()))?;
                if data.is_empty() {
                    return Err(format!("--file {}: the file is empty", path.display()));
                }
                Some(FileSource {
                    path: path.clone(),
                    data,
                })
            }
        };

        let sizes = if self.all {
            all_sizes()
        } else {
            vec![self.size]
        };
        let iters = match duration {
            Some(_) => None,
            None => Some(self.iters.unwrap_or(match test {
                Test::WriteBw => 5000,
                Test::SendLat => 1000,
            })),
        };
        Ok(Settings {
            test,
            role,
            sizes,
            iters,
            duration,
            report_gbits: self.report_gbits,
            out_json: self.out_json,
            tx_depth: self.tx_depth,
            paths: self.paths,
            mtu: self.mtu,
            impair,
            seed: self.seed,
            file,
            pcap: self.pcap,
            pcap_max_packets: self.pcap_max_packets,
            verbose: self.verbose,
        })
    }
}
