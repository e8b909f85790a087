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

/// perftest's default JSON report file (`DEFAULT_JSON_FILE_NAME`), in the working directory.
pub const DEFAULT_JSON_FILE: &str = "perftest_out.json";

/// The benchmarks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Test {
    /// One-sided RDMA WRITE bandwidth (perftest `ib_write_bw`).
    WriteBw,
    /// RDMA WRITE ping-pong latency (perftest `ib_write_lat --write_with_imm`).
    WriteLat,
    /// One-sided RDMA READ bandwidth (perftest `ib_read_bw`).
    ReadBw,
    /// RDMA READ latency, one READ at a time (perftest `ib_read_lat`).
    ReadLat,
    /// Atomic FETCH_AND_ADD latency, one at a time (perftest `ib_atomic_lat`).
    AtomicLat,
    /// Two-sided SEND bandwidth (perftest `ib_send_bw`).
    SendBw,
    /// Two-sided SEND ping-pong latency (perftest `ib_send_lat`).
    SendLat,
}

impl Test {
    /// Every test, in the order `--help` lists them.
    pub const ALL: [Test; 7] = [
        Test::WriteBw,
        Test::WriteLat,
        Test::ReadBw,
        Test::ReadLat,
        Test::AtomicLat,
        Test::SendBw,
        Test::SendLat,
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Test::WriteBw => "write_bw",
            Test::WriteLat => "write_lat",
            Test::ReadBw => "read_bw",
            Test::ReadLat => "read_lat",
            Test::AtomicLat => "atomic_lat",
            Test::SendBw => "send_bw",
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
            Test::WriteLat => "RDMA_Write Latency Test",
            Test::ReadBw => "RDMA_Read BW Test",
            Test::ReadLat => "RDMA_Read Latency Test",
            Test::AtomicLat => "Atomic FETCH_AND_ADD Latency Test",
            Test::SendBw => "Send BW Test",
            Test::SendLat => "Send Latency Test",
        }
    }

    /// Wire code used in the control exchange.
    pub fn code(self) -> u8 {
        match self {
            Test::WriteBw => 1,
            Test::SendLat => 2,
            Test::WriteLat => 3,
            Test::ReadBw => 4,
            Test::ReadLat => 5,
            Test::AtomicLat => 6,
            Test::SendBw => 7,
        }
    }

    /// The test of a wire code.
    pub fn from_code(c: u8) -> Option<Test> {
        Test::ALL.into_iter().find(|t| t.code() == c)
    }

    /// Whether the report is a bandwidth table (else a latency table).
    pub fn is_bw(self) -> bool {
        matches!(self, Test::WriteBw | Test::ReadBw | Test::SendBw)
    }

    /// Whether the latency column is half the round-trip time (ping-pong tests, as perftest
    /// does for WRITE and SEND) rather than the whole round trip of one operation (READ and
    /// atomics, which are round trips by nature).
    pub fn halves_rtt(self) -> bool {
        matches!(self, Test::WriteLat | Test::SendLat)
    }
}

/// Transport flavour (`--mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// MetaRoCE: multipath, selective repeat, per-path congestion control.
    Metaroce,
    /// RoCEv2-compatible RC queue pair (one path, go-back-N), over UDP sockets.
    Rocev2,
}

impl Mode {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Metaroce => "metaroce",
            Mode::Rocev2 => "rocev2",
        }
    }
}

/// How `--backend verbs send_lat` drives its two QPs (`--verbs-layer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum VerbsLayer {
    /// Verbs directly, one spinning thread per QP.
    Raw,
    /// RcQp API, one thread per QP, no tokio scheduler.
    Threads,
    /// RcQp API, one thread and current-thread runtime per QP.
    Runtimes,
    /// RcQp API, both QPs on one current-thread runtime.
    Runtime,
    /// RcQp API, both QPs on one two-worker multi-thread runtime.
    Mt,
}

/// Datagram backend (`--backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// Kernel UDP sockets (GSO/GRO, ECN).
    Udp,
    /// io_uring: multishot recvmsg, batched GSO sendmsg (Linux 6.0+); falls back to udp
    /// with a warning where io_uring is unavailable or forbidden.
    Uring,
    /// An RDMA device through libibverbs (metaroce-verbs RC QPs; `-d`, `-x` as perftest).
    /// Runs write_bw or send_lat with both QPs in this process, like perftest's server and
    /// client on one host.
    Verbs,
}

impl BackendKind {
    /// The metaroce-tokio backend kind. `Verbs` never reaches the datagram path (it is
    /// dispatched before validation, see `validate`); it maps to UDP only to keep this total.
    pub fn tokio(self) -> metaroce_tokio::backend::BackendKind {
        match self {
            BackendKind::Udp | BackendKind::Verbs => metaroce_tokio::backend::BackendKind::Udp,
            BackendKind::Uring => metaroce_tokio::backend::BackendKind::Uring,
        }
    }
}

/// Default TCP port of the RoCEv2-mode control exchange (perftest's).
pub const DEFAULT_OOB_PORT: u16 = 18515;

const AFTER_HELP: &str = "\
Tests (perftest names without the ib_ prefix):
  write_bw    pipelined RDMA WRITEs (-t outstanding); the server checksums its memory
  write_lat   RDMA WRITE ping-pong: each side WRITEs (with immediate) into the other's
              memory and waits for the peer's WRITE of the same iteration; the arrival is
              seen through the immediate (ib_write_lat --write_with_imm), not by polling
              the last byte; one-way latency = RTT/2; every landed WRITE is compared
  read_bw     pipelined RDMA READs (-t outstanding, at most -o in flight) of seeded server
              memory; checksums of the server's source and of what landed
  read_lat    one RDMA READ at a time; latency = the READ's round trip; every READ checked
  atomic_lat  one FETCH_AND_ADD (or, -A CMP_AND_SWAP, compare-and-swap) at a time on an
              8-byte counter; latency = round trip; every fetched value and the final
              counter (= initial + sum of adds) checked
  send_bw     pipelined SENDs on a stream (metaroce) / into posted receives (rocev2, -r
              posted); checksum of every byte received, in order
  send_lat    SEND ping-pong (echo); one-way latency = RTT/2; every echo compared

Modes:
  metaroce-perf [TEST]                  loopback: server and client in this process over 127.0.0.1
  metaroce-perf --server [-p PORT]      server: serve one client run, then exit
  metaroce-perf [TEST] HOST[:PORT]      client: connect to a server (default port 4791)

--mode rocev2 runs the same tests over a standard RoCEv2 RC queue pair
(metaroce_tokio::rocev2): one QP, one UDP source port, go-back-N. It needs no
CAP_NET_RAW: the packets travel in UDP datagrams and the ICRC covers synthesized IPv4
headers (ID 0, DF, destination port 4791). The QPNs, PSNs and ports are exchanged over
TCP (--oob-port, default 18515, like perftest): the server listens on TCP --oob-port and
UDP -p; the client gives HOST only (no port) and --oob-port if not 18515.

--compare-modes runs write_bw in both modes at 0%, 1% and 5% loss on loopback (one child
process per run, same -s/-n, default -s 65536 -n 2000) and prints one table.

The server follows the client's parameters (test, sizes, iterations); its own
--loss/--paths/--mtu/--pcap apply to its side.

Units: MiB/sec is 2^20 bytes per second (as perftest); Gb/sec (--report_gbits) is 10^9
bits per second.

--out_json writes perftest's JSON report (perftest_out.json, or --out_json_file PATH):
\"test_info\" and \"results\" with perftest's keys (MsgSize, n_iterations, BW_peak,
BW_average, MsgRate; latency: t_min, t_max, t_typical, t_avg, t_stdev, percentile_99,
percentile_99.9), for the last size as perftest leaves it; every size in
\"results_per_size\"; metaroce's own figures beside them.

Examples:
  metaroce-perf                                   write_bw, 65536 B x 5000, loopback
  metaroce-perf -s 1048576 -n 1024 --loss 1       1 GiB of WRITEs under 1% loss
  metaroce-perf read_bw --mode rocev2 -s 1048576  RDMA READs over a RoCEv2 RC QP
  metaroce-perf atomic_lat -n 1000                FETCH_AND_ADD latency
  metaroce-perf send_lat -a                       latency for sizes 2 .. 8 MiB
  metaroce-perf --compare-modes -s 65536 -n 2000  RoCEv2 beside MetaRoCE under loss
  metaroce-perf --file data.bin --pcap run.pcap   write a file, capture the packets";

/// perftest-style benchmark of the MetaRoCE transport.
#[derive(Debug, Parser)]
#[command(
    name = "metaroce-perf",
    version,
    allow_negative_numbers = true,
    about = "perftest-style benchmark of the MetaRoCE transport and of its RoCEv2-compatible RC mode",
    after_help = AFTER_HELP
)]
pub struct Args {
    /// Test to run: write_bw (default), write_lat, read_bw, read_lat, atomic_lat, send_bw
    /// or send_lat. When this is not a test name it is taken as SERVER.
    #[arg(value_name = "TEST")]
    pub first: Option<String>,

    /// Server to connect to, `host` or `host:port` (default port 4791; rocev2: `host`
    /// only). Without it (and without --server) both sides run in this process over
    /// 127.0.0.1 (metaroce bandwidth tests: the server side on a runtime and thread of its
    /// own, as a server process would be).
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

    /// --mode rocev2: TCP port of the out-of-band exchange (server listens, client
    /// connects).
    #[arg(long = "oob-port", value_name = "PORT", default_value_t = DEFAULT_OOB_PORT)]
    pub oob_port: u16,

    /// Message / operation size in bytes (1 .. 2^31) [default: 65536; atomic_lat: 8].
    #[arg(short = 's', long, value_name = "BYTES")]
    pub size: Option<u64>,

    /// Iterations per size [default: 5000 for the bw tests, 1000 for the lat tests, 2000
    /// with --compare-modes].
    #[arg(short = 'n', long, value_name = "N", conflicts_with = "duration")]
    pub iters: Option<u64>,

    /// Run every size 2, 4, 8, ... 2^23 bytes (one row each); -s is ignored.
    #[arg(short = 'a', long)]
    pub all: bool,

    /// Run each size for SECS seconds instead of a number of iterations.
    #[arg(short = 'D', long, value_name = "SECS")]
    pub duration: Option<f64>,

    /// Report bandwidth in Gb/sec instead of MiB/sec.
    #[arg(long = "report_gbits", visible_alias = "report-gbits")]
    pub report_gbits: bool,

    /// Also write the report as JSON (perftest's keys: test_info, results.MsgSize,
    /// BW_peak, BW_average, MsgRate, t_min … percentile_99.9) to --out_json_file.
    #[arg(long = "out_json", visible_alias = "out-json")]
    pub out_json: bool,

    /// The JSON report's file (default perftest_out.json in the working directory, as
    /// perftest); giving it implies --out_json.
    #[arg(
        long = "out_json_file",
        visible_alias = "out-json-file",
        value_name = "PATH"
    )]
    pub out_json_file: Option<PathBuf>,

    /// Bandwidth tests: operations kept outstanding.
    #[arg(
        short = 't',
        long = "tx-depth",
        value_name = "N",
        default_value_t = 128
    )]
    pub tx_depth: usize,

    /// write_bw: one work completion per N WRITEs (perftest's --cq-mod): each post is a
    /// list of N WRITEs of which only the last is signaled (`Connection::write_batch`);
    /// --tx-depth still counts WRITEs (--tx-depth / N lists are kept outstanding). 1 (the
    /// default): every WRITE posted and completed on its own.
    #[arg(short = 'Q', long = "cq-mod", value_name = "N", default_value_t = 1)]
    pub cq_mod: u64,

    /// RDMA READs and atomics in flight at once (IBA max_rd_atomic, both directions).
    #[arg(short = 'o', long = "outs", value_name = "N", default_value_t = 16)]
    pub outs: u16,

    /// --mode rocev2 send tests: receive buffers kept posted.
    #[arg(
        short = 'r',
        long = "rx-depth",
        value_name = "N",
        default_value_t = 512
    )]
    pub rx_depth: usize,

    /// --mode rocev2: local ACK timeout exponent of the QP (4.096 us x 2^N; 14 = 67 ms,
    /// perftest's default).
    #[arg(long = "rc-timeout", value_name = "N", default_value_t = 14)]
    pub rc_timeout: u8,

    /// Paths (UDP source ports) each connection sprays over (1 .. 64) [default: 8; 1 with
    /// --mode rocev2, which accepts no other value].
    #[arg(long, value_name = "N")]
    pub paths: Option<u16>,

    /// Path MTU in bytes: 256, 512, 1024, 2048 or 4096.
    #[arg(long, value_name = "BYTES", default_value_t = 4096)]
    pub mtu: u32,

    /// Turn off ECMP collision handling (re-rolling the source port of a path that
    /// delivers persistently less than the others; `TransportConfig::rebalance_ratio_permille`
    /// = 0), to measure without it. With more than one path, each side also binds three
    /// spare source ports per path, for re-rolls to move to.
    #[arg(long = "no-rebalance")]
    pub no_rebalance: bool,

    /// Delayed ACK: longest time a receiver holds the ACK of a lone SEND for a reply to
    /// ride behind (`TransportConfig::max_ack_delay`, microseconds; 0 = acknowledge at
    /// once). Both sides should agree. Default: the transport's (100 µs).
    #[arg(long = "max-ack-delay", value_name = "USEC")]
    pub max_ack_delay: Option<u64>,

    /// Send every transmit from the driver task, never from the application task
    /// (`metaroce_tokio::Config::inline_transmit` = false), to measure without it.
    #[arg(long = "no-inline-transmit")]
    pub no_inline_transmit: bool,

    /// AES-GCM packet protection of every MetaRoCE packet (metaroce mode; both sides must
    /// agree). The key is the hex value of METAROCE_PERF_KEY (32 or 64 hex digits:
    /// AES-128-GCM or AES-256-GCM) or, without it, a fixed test key (AES-128-GCM); never use
    /// that one outside benchmarks.
    #[arg(long)]
    pub encrypt: bool,

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

    /// Random ECN CE marking in percent of ECN-capable datagrams, applied like --loss
    /// (metaroce mode only).
    #[arg(long, value_name = "PERCENT", default_value_t = 0.0)]
    pub ce: f64,

    /// Send through the impairment layer even when no impairment is asked for, so that a
    /// lossless baseline pays the same emulation cost as the lossy runs it is compared with.
    #[arg(long)]
    pub emulate: bool,

    /// Seed of the impairments and of the data written (default 1) and, only when given,
    /// of the transport cores' QPNs and PSNs too (a reproducible run). Without it the cores
    /// are seeded from the operating system; connection nonces, tokens and memory keys
    /// always are.
    #[arg(long, value_name = "S")]
    pub seed: Option<u64>,

    /// write_bw: write this file's bytes (once, in chunks of --size) and check the
    /// destination against it.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["all", "duration", "iters"])]
    pub file: Option<PathBuf>,

    /// atomic_lat: the atomic operation, as perftest's `-A`: FETCH_AND_ADD (default) or
    /// CMP_AND_SWAP (compare with the expected value, swap in that value plus the addend,
    /// so the counter follows the same sequence and is checked the same way).
    #[arg(short = 'A', long = "atomic_type", value_enum, value_name = "TYPE")]
    pub atomic_type: Option<AtomicType>,

    /// Record every datagram this process sends into a classic pcap (Ethernet/IPv4/UDP
    /// 4791 headers synthesized, ICRC re-stamped for them).
    #[arg(long, value_name = "FILE")]
    pub pcap: Option<PathBuf>,

    /// Most packets written to --pcap (the rest are not recorded).
    #[arg(long = "pcap-max-packets", value_name = "N", default_value_t = 100_000)]
    pub pcap_max_packets: u64,

    /// Transport: metaroce (default) or rocev2 (RoCEv2-compatible RC queue pair).
    #[arg(long, value_enum, value_name = "MODE")]
    pub mode: Option<Mode>,

    /// Datagram backend.
    #[arg(long, value_enum, default_value = "udp")]
    pub backend: BackendKind,

    /// --backend verbs: RDMA device name (perftest's -d / --ib-dev) [default: the first].
    #[arg(short = 'd', long = "ib-dev", value_name = "DEVICE")]
    pub ib_dev: Option<String>,

    /// --backend verbs: GID index (perftest's -x / --gid-index) [default: the first RoCEv2
    /// IPv4 GID].
    #[arg(short = 'x', long = "gid-index", value_name = "N")]
    pub gid_index: Option<u8>,

    /// --backend verbs: wait for completions through the completion channel (CQ events)
    /// instead of busy-polling the CQ (perftest's -e / --events). Without it, the *_lat
    /// tests busy-poll their CQs (metaroce-verbs `CqPoll::BusySpin`) and post SENDs of at
    /// most 236 bytes inline, as perftest's ib_send_lat does by default.
    #[arg(short = 'e', long = "events")]
    pub events: bool,

    /// --backend verbs send_lat: the layers of metaroce-verbs each ping-pong goes through
    /// (for measuring where the latency goes; docs/RESULTS.md has the table). `raw`: two
    /// threads spinning on ibv_post_send / ibv_post_recv / ibv_poll_cq (the floor);
    /// `threads`: the RcQp API (send, recv) on two threads without a tokio scheduler;
    /// `runtimes` (the default): each QP on its own thread's current-thread tokio runtime,
    /// as perftest's server and client processes; `runtime`: both QPs' tasks on one
    /// current-thread runtime;
    /// `mt`: both on one two-worker multi-thread runtime.
    #[arg(
        long = "verbs-layer",
        value_enum,
        default_value = "runtimes",
        value_name = "LAYER"
    )]
    pub verbs_layer: VerbsLayer,

    /// --backend verbs: run write_bw over one multipath connection of K RC QPs
    /// (metaroce-verbs `MpConnection`: WRITEs cut into 64 KiB chunks sprayed over the K QPs,
    /// each with its own UDP source port) instead of one RC QP.
    #[arg(long, value_name = "K")]
    pub qps: Option<usize>,

    /// Run write_bw in both modes at 0%, 1% and 5% loss (loopback) and print one table.
    #[arg(long = "compare-modes")]
    pub compare_modes: bool,

    /// --compare-modes: the loss rates in percent, comma-separated.
    #[arg(long, value_name = "LIST", requires = "compare_modes")]
    pub losses: Option<String>,

    /// --compare-modes: most seconds one run may take before it is killed.
    #[arg(
        long = "run-timeout",
        value_name = "SECS",
        default_value_t = 300.0,
        requires = "compare_modes"
    )]
    pub run_timeout: f64,

    /// Print per-path (metaroce) or per-QP (rocev2) statistics at the end; with
    /// --compare-modes, also every run's own report.
    #[arg(long)]
    pub verbose: bool,

    /// Testing aid: corrupt one byte of what the client checks against after the transfer,
    /// so that the verification must fail (and the exit status be 1).
    #[arg(long = "selftest-mismatch", hide = true)]
    pub selftest_mismatch: bool,
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
    /// Use the impairment layer even with nothing to impair (`--emulate`).
    pub emulate: bool,
}

impl ImpairSettings {
    /// Whether anything is impaired (an [`Impaired`](metaroce_tokio::backend::Impaired)
    /// layer is needed).
    pub fn any(&self) -> bool {
        self.emulate || self.loss > 0.0 || self.dup > 0.0 || self.reorder > 0.0 || self.ce > 0.0
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

/// `--compare-modes` parameters.
#[derive(Debug, Clone)]
pub struct CompareSettings {
    /// Loss rates, probabilities in [0, 1].
    pub losses: Vec<f64>,
    /// Limit of one child run.
    pub run_timeout: Duration,
    /// `--paths` as given (metaroce runs only).
    pub paths: Option<u16>,
}

/// Validated settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Test.
    pub test: Test,
    /// Datagram backend (`--backend`).
    pub backend: BackendKind,
    /// Transport flavour.
    pub mode: Mode,
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
    /// JSON output path (`--out_json` / `--out_json_file`).
    pub out_json: Option<PathBuf>,
    /// Outstanding operations of the bandwidth tests.
    pub tx_depth: usize,
    /// write_bw: WRITEs per signaled completion (`--cq-mod`).
    pub cq_mod: u64,
    /// READs/atomics in flight.
    pub outs: u16,
    /// Posted receives (rocev2 send tests).
    pub rx_depth: usize,
    /// RC local ACK timeout exponent.
    pub rc_timeout: u8,
    /// TCP port of the rocev2 exchange.
    pub oob_port: u16,
    /// Paths.
    pub paths: u16,
    /// Path MTU.
    pub mtu: u32,
    /// ECMP collision handling on (not `--no-rebalance`).
    pub rebalance: bool,
    /// `--max-ack-delay`, if given.
    pub max_ack_delay: Option<std::time::Duration>,
    /// Transmit from the application task (not `--no-inline-transmit`).
    pub inline_transmit: bool,
    /// `--encrypt`: the packet protection key (16 or 32 bytes).
    pub encrypt: Option<Vec<u8>>,
    /// Impairments.
    pub impair: ImpairSettings,
    /// Seed of impairments and data.
    pub seed: u64,
    /// Seed of the transport cores (`--seed` when given; `None` = from the OS).
    pub core_seed: Option<u64>,
    /// `--file` source.
    pub file: Option<FileSource>,
    /// atomic_lat's operation (`-A`).
    pub atomic_type: AtomicType,
    /// pcap output.
    pub pcap: Option<PathBuf>,
    /// pcap packet cap.
    pub pcap_max_packets: u64,
    /// Per-path statistics.
    pub verbose: bool,
    /// `--selftest-mismatch`.
    pub selftest_mismatch: bool,
    /// `--compare-modes`.
    pub compare: Option<CompareSettings>,
}

impl Settings {
    /// The largest size of the run.
    pub fn max_size(&self) -> u64 {
        self.sizes.iter().copied().max().unwrap_or(1)
    }
}

/// Whether a SERVER argument names a port explicitly.
fn has_port(s: &str) -> bool {
    if s.parse::<SocketAddr>().is_ok() {
        return true;
    }
    match s.rsplit_once(':') {
        Some((h, _)) => !h.contains(':') || h.ends_with(']'),
        None => false,
    }
}

fn parse_losses(list: &str) -> Result<Vec<f64>, String> {
    let mut v = Vec::new();
    for w in list.split(',').map(str::trim).filter(|w| !w.is_empty()) {
        let p: f64 = w
            .parse()
            .map_err(|_| format!("--losses: '{w}' is not a number"))?;
        v.push(percent("losses", p)?);
    }
    if v.is_empty() {
        return Err("--losses needs at least one loss rate".into());
    }
    Ok(v)
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
        if self.backend == BackendKind::Verbs {
            return Err("--backend verbs is handled before validation".into());
        }
        let mode = self.mode.unwrap_or(Mode::Metaroce);

        // Positionals: [TEST] [SERVER]; a first positional that is no test is the server.
        // `guessed`: the server address is the first positional, which may be a mistyped test.
        let (test, server, guessed) = match (self.first.as_deref(), self.second.as_deref()) {
            (None, _) => (Test::WriteBw, None, false),
            (Some(a), b) => match Test::from_name(a) {
                Some(t) => (t, b, false),
                None if b.is_some() => return Err(unknown_test(a)),
                // Host names cannot contain '_' (RFC 1123): such a word is a test name.
                None if a.contains('_') => return Err(unknown_test(a)),
                None => (Test::WriteBw, Some(a), true),
            },
        };
        let role = match (server, self.server) {
            (Some(s), true) => {
                return Err(format!(
                    "--server listens for a client; do not also give a server address ('{s}')"
                ))
            }
            (Some(s), false) => {
                if mode == Mode::Rocev2 && has_port(s) {
                    return Err(format!(
                        "--mode rocev2: give the server as HOST without a port ('{s}'): the \
                         client learns the server's UDP port in the TCP exchange; use \
                         --oob-port for the TCP port (default {DEFAULT_OOB_PORT})"
                    ));
                }
                let addr = parse_server(s).map_err(|e| {
                    // A single word that does not resolve and has no port, no dot and is no
                    // IP address reads more like a mistyped test than a host.
                    let wordlike = !s.contains([':', '.']) && s.parse::<IpAddr>().is_err();
                    if guessed && wordlike {
                        format!(
                            "{}, or give the server address as HOST:PORT ({e})",
                            unknown_test(s)
                        )
                    } else {
                        e
                    }
                })?;
                Role::Client {
                    addr,
                    given: s.to_string(),
                }
            }
            (None, true) => Role::Server {
                addr: SocketAddr::new(self.bind, self.port),
            },
            (None, false) => Role::Loopback,
        };

        let compare = if self.compare_modes {
            if self.first.is_some() && test != Test::WriteBw {
                return Err(format!(
                    "--compare-modes runs write_bw; it cannot run {}",
                    test.name()
                ));
            }
            if !matches!(role, Role::Loopback) {
                return Err(
                    "--compare-modes runs on loopback only (no --server, no SERVER)".into(),
                );
            }
            if self.mode.is_some() {
                return Err("--compare-modes runs both modes; do not give --mode".into());
            }
            if self.loss != 0.0 || self.dup != 0.0 || self.reorder != 0.0 || self.ce != 0.0 {
                return Err(
                    "--compare-modes sets the loss itself (0%, 1%, 5%; see --losses) and adds \
                     no other impairment: drop --loss/--dup/--reorder/--ce"
                        .into(),
                );
            }
            if self.all || self.file.is_some() || self.pcap.is_some() {
                return Err("--compare-modes takes one size: drop -a/--file/--pcap".into());
            }
            if !(self.run_timeout.is_finite() && self.run_timeout > 0.0) {
                return Err("--run-timeout must be a positive number of seconds".into());
            }
            Some(CompareSettings {
                losses: parse_losses(self.losses.as_deref().unwrap_or("0,1,5"))?,
                run_timeout: Duration::from_secs_f64(self.run_timeout.min(86_400.0)),
                paths: self.paths,
            })
        } else {
            None
        };

        let paths = match (mode, self.paths) {
            (Mode::Rocev2, Some(p)) if p != 1 && compare.is_none() => {
                return Err(format!(
                    "--paths {p}: RoCEv2 RC mode uses one QP and one UDP source port \
                     (--paths must be 1)"
                ))
            }
            (Mode::Rocev2, _) => 1,
            (Mode::Metaroce, p) => p.unwrap_or(8),
        };
        if paths == 0 || paths > MAX_PATHS {
            return Err(format!("--paths must be in 1..={MAX_PATHS}, got {paths}"));
        }

        let size = match (test, self.size) {
            (Test::AtomicLat, Some(s)) if s != 8 => {
                return Err(format!(
                    "atomic_lat works on 8-byte operands: -s must be 8, got {s}"
                ))
            }
            (Test::AtomicLat, _) if self.all => {
                return Err("-a does not apply to atomic_lat (8-byte operands)".into())
            }
            (Test::AtomicLat, _) => 8,
            (_, s) => s.unwrap_or(65536),
        };
        if size == 0 {
            return Err("--size must be at least 1 byte".into());
        }
        if size > MAX_SIZE {
            return Err(format!(
                "--size must be at most 2^31 = {MAX_SIZE} bytes, got {size}"
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
        if self.cq_mod == 0 || self.cq_mod > self.tx_depth as u64 {
            return Err(format!(
                "--cq-mod must be in 1..=--tx-depth ({}), got {}",
                self.tx_depth, self.cq_mod
            ));
        }
        if self.cq_mod > 1 && test != Test::WriteBw {
            return Err("--cq-mod applies to write_bw only".into());
        }
        if self.outs == 0 || self.outs > 255 {
            return Err(format!("--outs must be in 1..=255, got {}", self.outs));
        }
        if self.rx_depth == 0 || self.rx_depth > 65_536 {
            return Err(format!(
                "--rx-depth must be in 1..=65536, got {}",
                self.rx_depth
            ));
        }
        if self.rc_timeout == 0 || self.rc_timeout > 31 {
            return Err(format!(
                "--rc-timeout must be in 1..=31 (4.096 us x 2^N), got {}",
                self.rc_timeout
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
            emulate: self.emulate,
        };
        if impair.reorder > 0.0 && self.reorder_delay == 0 {
            return Err("--reorder needs a non-zero --reorder-delay".into());
        }
        if self.reorder_delay > 10_000_000 {
            return Err("--reorder-delay must be at most 10 s (10000000 us)".into());
        }
        if mode == Mode::Rocev2 && impair.ce > 0.0 {
            return Err(
                "--ce: RoCEv2 RC mode sends Not-ECT packets and has no congestion control, \
                 so CE marking would change nothing (metaroce mode only)"
                    .into(),
            );
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

        let sizes = if self.all { all_sizes() } else { vec![size] };
        let iters = match duration {
            Some(_) => None,
            None => Some(
                self.iters
                    .unwrap_or(match (compare.is_some(), test.is_bw()) {
                        (true, _) => 2000,
                        (false, true) => 5000,
                        (false, false) => 1000,
                    }),
            ),
        };
        Ok(Settings {
            test,
            mode,
            role,
            sizes,
            iters,
            duration,
            report_gbits: self.report_gbits,
            out_json: match (self.out_json, self.out_json_file) {
                (_, Some(p)) => Some(p),
                (true, None) => Some(PathBuf::from(DEFAULT_JSON_FILE)),
                (false, None) => None,
            },
            tx_depth: self.tx_depth,
            cq_mod: self.cq_mod,
            outs: self.outs,
            rx_depth: self.rx_depth,
            rc_timeout: self.rc_timeout,
            oob_port: self.oob_port,
            paths,
            mtu: self.mtu,
            rebalance: !self.no_rebalance,
            max_ack_delay: self.max_ack_delay.map(std::time::Duration::from_micros),
            inline_transmit: !self.no_inline_transmit,
            encrypt: if self.encrypt {
                Some(perf_key()?)
            } else {
                None
            },
            impair,
            seed: self.seed.unwrap_or(1),
            core_seed: self.seed,
            file,
            pcap: self.pcap,
            pcap_max_packets: self.pcap_max_packets,
            atomic_type: self.atomic_type.unwrap_or_default(),
            verbose: self.verbose,
            selftest_mismatch: self.selftest_mismatch,
            compare,
            backend: self.backend,
        })
    }
}

/// The `--encrypt` key: METAROCE_PERF_KEY as hex (32 or 64 digits), or the fixed test key.
fn perf_key() -> Result<Vec<u8>, String> {
    let Ok(hex) = std::env::var("METAROCE_PERF_KEY") else {
        return Ok(b"metaroce-perf-k!".to_vec());
    };
    let hex = hex.trim();
    if !(hex.len() == 32 || hex.len() == 64) || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err("METAROCE_PERF_KEY must be 32 or 64 hex digits".into());
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).map_err(|e| e.to_string()))
        .collect()
}

/// atomic_lat's operation (perftest `-A, --atomic_type`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum AtomicType {
    /// FETCH_AND_ADD (`MR_FETCH_ADD`, RC `FetchAdd`).
    #[default]
    #[value(name = "FETCH_AND_ADD")]
    FetchAndAdd,
    /// CMP_AND_SWAP (`MR_COMPARE_SWAP`, RC `CmpSwap`).
    #[value(name = "CMP_AND_SWAP")]
    CmpAndSwap,
}
