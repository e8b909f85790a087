//! Text output (perftest-like layout, our own wording) and the JSON document.

use super::cli::{Role, Settings, Test};
use super::client::{BwRow, ClientRun, LatRow};
use super::pcap::PcapSummary;
use super::server::ServerRun;
use metaroce::ConnectionStats;
use metaroce_tokio::backend::ImpairStats;
use metaroce_tokio::Connection;
use serde::Serialize;

const WIDTH: usize = 87;

/// A dashed separator line.
pub fn rule() {
    println!("{}", "-".repeat(WIDTH));
}

fn kv(key: &str, value: impl std::fmt::Display) {
    println!(" {key:<16}: {value}");
}

fn pct(p: f64) -> String {
    format!("{:.1}%", p * 100.0)
}

/// Compact list of ports: `a, b, c` or `a..b` when consecutive.
fn ports(list: &[u16]) -> String {
    let consecutive = list.windows(2).all(|w| w[1] == w[0].wrapping_add(1));
    match list {
        [] => "-".into(),
        [a] => a.to_string(),
        [a, .., b] if consecutive => format!("{a}..{b}"),
        _ => list
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(","),
    }
}

/// The title and the parameter block; with a connection, the local and remote addresses.
pub fn preamble(s: &Settings, link: Option<(&Connection, u32)>) {
    rule();
    let title = format!("{:^WIDTH$}", s.test.title());
    println!("{}", title.trim_end());
    kv("Transport", "MetaRoCE over UDP");
    match &s.role {
        Role::Loopback => kv("Mode", "loopback (server and client in this process)"),
        Role::Client { given, addr } => kv("Mode", format!("client of {given} ({addr})")),
        Role::Server { addr } => kv("Mode", format!("server on {addr}")),
    }
    kv("Connection type", "reliable, multipath (RC semantics)");
    kv("Paths", s.paths);
    kv("Mtu", format!("{}[B]", s.mtu));
    if s.test == Test::WriteBw {
        kv("TX depth", s.tx_depth);
    }
    let scope = match s.role {
        Role::Loopback => "of the datagrams sent by both endpoints",
        _ => "of the datagrams this process sends",
    };
    kv("Loss", format!("{} {scope}", pct(s.impair.loss)));
    if s.impair.dup > 0.0 || s.impair.reorder > 0.0 || s.impair.ce > 0.0 {
        kv(
            "Impairment",
            format!(
                "duplicate {}  reorder {} (+{} us)  CE mark {}",
                pct(s.impair.dup),
                pct(s.impair.reorder),
                s.impair.reorder_delay.as_micros(),
                pct(s.impair.ce)
            ),
        );
    }
    if !matches!(s.role, Role::Server { .. }) {
        match &s.file {
            Some(f) => kv(
                "Data",
                format!(
                    "file {} ({} bytes, written once)",
                    f.path.display(),
                    f.data.len()
                ),
            ),
            None => kv("Data", format!("pseudo-random, seed {}", s.seed)),
        }
        match (s.iters, s.duration) {
            (_, Some(d)) => kv("Duration", format!("{:.1} s per size", d.as_secs_f64())),
            (Some(n), None) if s.file.is_none() => kv("Iterations", n),
            _ => {}
        }
    }
    kv("Seed", s.seed);
    rule();
    if let Some((conn, remote_qpn)) = link {
        let ep = conn.endpoint();
        let mut local = ep.local_addr();
        if let (true, Some(peer)) = (local.ip().is_unspecified(), conn.remote_addr()) {
            local.set_ip(super::pcap::route_source(peer.ip()));
        }
        println!(
            " local address : {}  QPN 0x{:06x}  source ports {}",
            local,
            conn.handle().0,
            ports(&ep.source_ports())
        );
        println!(
            " remote address: {}  QPN 0x{remote_qpn:06x}",
            conn.remote_addr()
                .map_or_else(|| "?".to_string(), |a| a.to_string())
        );
        rule();
    }
}

fn bw_unit(s: &Settings) -> &'static str {
    if s.report_gbits {
        "Gb/sec"
    } else {
        "MB/sec"
    }
}

/// Bandwidth in the unit of the report: MB/sec = 2^20 B/s, Gb/sec = 10^9 bit/s.
fn bw_value(s: &Settings, bytes_per_sec: f64) -> f64 {
    if s.report_gbits {
        bytes_per_sec * 8.0 / 1e9
    } else {
        bytes_per_sec / f64::from(1u32 << 20)
    }
}

/// The write_bw column header.
pub fn bw_header(s: &Settings) {
    let u = bw_unit(s);
    println!(" #bytes     #iterations    BW peak[{u}]    BW average[{u}]   MsgRate[Mpps]");
}

/// One write_bw row.
pub fn bw_row(s: &Settings, r: &BwRow) {
    println!(
        "{:>7}{:>16}{:>19.2}{:>22.2}{:>16.6}",
        r.size,
        r.result.ops,
        bw_value(s, r.result.peak_bytes_per_sec),
        bw_value(s, r.result.avg_bytes_per_sec),
        r.result.msg_rate_mpps
    );
}

/// The send_lat column header.
pub fn lat_header() {
    println!(
        " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]"
    );
}

/// One send_lat row.
pub fn lat_row(r: &LatRow) {
    match &r.stats {
        Some(l) => println!(
            "{:>7}{:>12}{:>15.2}{:>15.2}{:>17.2}{:>15.2}{:>17.2}{:>23.2}{:>25.2}",
            r.size,
            r.iterations,
            l.t_min_usec,
            l.t_max_usec,
            l.t_typical_usec,
            l.t_avg_usec,
            l.t_stdev_usec,
            l.p99_usec,
            l.p999_usec
        ),
        None => println!("{:>7}{:>12}   (no samples)", r.size, r.iterations),
    }
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "OK"
    } else {
        "MISMATCH"
    }
}

/// Everything printed after the table.
#[derive(Debug)]
pub struct Footer<'a> {
    /// Client results (loopback / client mode).
    pub client: Option<&'a ClientRun>,
    /// Server results (loopback / server mode).
    pub server: Option<&'a ServerRun>,
    /// Impairment counters of this process's endpoints, summed.
    pub impair: ImpairStats,
    /// pcap outcome.
    pub pcap: Option<PcapSummary>,
}

fn retransmits(stats: Option<&ConnectionStats>) -> u64 {
    stats.map_or(0, |c| c.paths.iter().map(|p| p.stats.retransmits).sum())
}

fn probes(stats: Option<&ConnectionStats>) -> u64 {
    stats.map_or(0, |c| c.paths.iter().map(|p| p.stats.probes).sum())
}

/// Tail-loss probes of this process's connections (the library counts them as
/// retransmissions too).
pub fn total_probes(f: &Footer<'_>) -> u64 {
    probes(f.client.and_then(|c| c.stats.as_ref()))
        + probes(f.server.and_then(|r| r.stats.as_ref()))
}

/// Retransmissions of this process's connections.
pub fn total_retransmits(f: &Footer<'_>) -> u64 {
    retransmits(f.client.and_then(|c| c.stats.as_ref()))
        + retransmits(f.server.and_then(|r| r.stats.as_ref()))
}

/// Checksums, echo verification, retransmissions, drops, capture.
pub fn footer(s: &Settings, f: &Footer<'_>) {
    if let Some(c) = f.client {
        match c.bw.as_slice() {
            [r] => println!(
                " Checksum source 0x{:08x}  destination 0x{:08x}  {}",
                r.src_crc,
                r.dst_crc,
                verdict(r.ok())
            ),
            rows => {
                for r in rows {
                    println!(
                        " Checksum {:>8} B  source 0x{:08x}  destination 0x{:08x}  {}",
                        r.size,
                        r.src_crc,
                        r.dst_crc,
                        verdict(r.ok())
                    );
                }
            }
        }
        if !c.lat.is_empty() {
            let total: u64 = c.lat.iter().map(|r| r.iterations).sum();
            let bad: u64 = c.lat.iter().map(|r| r.mismatches).sum();
            println!(
                " Echo check: {bad} of {total} echoed messages differ from what was sent  {}",
                verdict(bad == 0)
            );
        }
    }
    if let (Some(r), None) = (f.server, f.client) {
        let n = r.rounds.len();
        println!(" Served {n} size(s); {} messages echoed", r.echoed);
    }
    let client_rtx = retransmits(f.client.and_then(|c| c.stats.as_ref()));
    let server_rtx = retransmits(f.server.and_then(|r| r.stats.as_ref()));
    let probes = total_probes(f);
    let detail = match (f.client.is_some(), f.server.is_some()) {
        (true, true) => format!(" (client {client_rtx}, server {server_rtx}; {probes} probes)"),
        _ => format!(" ({probes} probes)"),
    };
    let drops = f.impair.dropped + f.impair.queue_dropped;
    let impaired = if s.impair.any() {
        format!(
            "  Impairment dropped {drops} of {} datagrams",
            f.impair.seen
        )
    } else {
        "  Impairment: none".to_string()
    };
    println!(
        " Retransmits: {}{detail} over {} paths{impaired}",
        client_rtx + server_rtx,
        s.paths
    );
    if let (Some(p), Some(path)) = (f.pcap, &s.pcap) {
        let mut extra = String::new();
        if p.not_recorded > 0 {
            extra += &format!(
                " ({} more not recorded: --pcap-max-packets)",
                p.not_recorded
            );
        }
        if p.errors > 0 {
            extra += &format!(" ({} could not be framed)", p.errors);
        }
        println!(
            " Capture: {} packets in {}{extra}",
            p.written,
            path.display()
        );
    }
    if s.verbose {
        if let Some(st) = f.client.and_then(|c| c.stats.as_ref()) {
            path_table("client -> server", st);
        }
        if let Some(st) = f.server.and_then(|c| c.stats.as_ref()) {
            path_table("server -> client", st);
        }
    }
}

fn path_table(title: &str, st: &ConnectionStats) {
    rule();
    println!(
        " Paths of the {title} direction (pmtu {}, {} ACKs sent, {} received, {} duplicate packets received)",
        st.pmtu, st.acks_sent, st.acks_received, st.duplicate_packets
    );
    println!(
        " {:>4} {:>9} {:>12} {:>10} {:>10} {:>9} {:>7} {:>9} {:>10} {:>8}",
        "path",
        "src port",
        "packets",
        "retrans",
        "sack loss",
        "timeouts",
        "probes",
        "ecn marks",
        "srtt[us]",
        "window"
    );
    for p in &st.paths {
        println!(
            " {:>4} {:>9} {:>12} {:>10} {:>10} {:>9} {:>7} {:>9} {:>10.1} {:>8}{}",
            p.id,
            p.src_port,
            p.stats.packets_sent,
            p.stats.retransmits,
            p.stats.sack_losses,
            p.stats.timeout_losses,
            p.stats.probes,
            p.stats.ecn_marks,
            p.srtt.as_secs_f64() * 1e6,
            p.window,
            if p.failed { "  FAILED" } else { "" }
        );
    }
}

/// Per-path counters in the JSON document.
#[derive(Debug, Serialize)]
pub struct JsonPath {
    direction: &'static str,
    path: u8,
    src_port: u16,
    packets_sent: u64,
    retransmits: u64,
    sack_losses: u64,
    timeout_losses: u64,
    probes: u64,
    rtos: u64,
    ecn_marks: u64,
    srtt_usec: f64,
    window: u32,
    failed: bool,
}

#[derive(Debug, Serialize)]
struct JsonBw {
    bytes: u64,
    iterations: u64,
    slots: u64,
    elapsed_sec: f64,
    bw_peak_mb_per_sec: f64,
    bw_avg_mb_per_sec: f64,
    bw_peak_gbit_per_sec: f64,
    bw_avg_gbit_per_sec: f64,
    msg_rate_mpps: f64,
    checksum_len: u64,
    checksum_source: String,
    checksum_destination: String,
    checksum_ok: bool,
}

#[derive(Debug, Serialize)]
struct JsonLat {
    bytes: u64,
    iterations: u64,
    #[serde(flatten)]
    stats: Option<super::stats::LatStats>,
    echo_mismatches: u64,
}

#[derive(Debug, Serialize)]
struct JsonServerRound {
    bytes: u64,
    iterations: u64,
    region_len: u64,
    checksum_len: u64,
    checksum_destination: String,
    client_ops: u64,
}

#[derive(Debug, Serialize)]
struct JsonImpair {
    loss_percent: f64,
    dup_percent: f64,
    reorder_percent: f64,
    ce_percent: f64,
    datagrams_seen: u64,
    dropped: u64,
    queue_dropped: u64,
    duplicated: u64,
    reordered: u64,
    ce_marked: u64,
}

#[derive(Debug, Serialize)]
struct JsonPcap {
    file: String,
    packets: u64,
    not_recorded: u64,
    errors: u64,
}

#[derive(Debug, Serialize)]
struct JsonReport {
    test: &'static str,
    mode: &'static str,
    transport: &'static str,
    backend: &'static str,
    paths: u16,
    mtu: u32,
    tx_depth: usize,
    seed: u64,
    sizes: Vec<u64>,
    iterations: Option<u64>,
    duration_sec: Option<f64>,
    file: Option<String>,
    bw_unit: &'static str,
    server_qpn: Option<u32>,
    results: Vec<JsonBw>,
    latency: Vec<JsonLat>,
    server_rounds: Vec<JsonServerRound>,
    verified: bool,
    retransmits: u64,
    tail_loss_probes: u64,
    retransmits_client: Option<u64>,
    retransmits_server: Option<u64>,
    loss: JsonImpair,
    path_stats: Vec<JsonPath>,
    pcap: Option<JsonPcap>,
}

fn json_paths(direction: &'static str, st: Option<&ConnectionStats>, out: &mut Vec<JsonPath>) {
    for p in st.map(|s| s.paths.as_slice()).unwrap_or(&[]) {
        out.push(JsonPath {
            direction,
            path: p.id,
            src_port: p.src_port,
            packets_sent: p.stats.packets_sent,
            retransmits: p.stats.retransmits,
            sack_losses: p.stats.sack_losses,
            timeout_losses: p.stats.timeout_losses,
            probes: p.stats.probes,
            rtos: p.stats.rtos,
            ecn_marks: p.stats.ecn_marks,
            srtt_usec: p.srtt.as_secs_f64() * 1e6,
            window: p.window,
            failed: p.failed,
        });
    }
}

/// The JSON document of a run.
pub fn json(s: &Settings, f: &Footer<'_>, verified: bool) -> serde_json::Result<String> {
    let mib = f64::from(1u32 << 20);
    let results = f
        .client
        .map(|c| {
            c.bw.iter()
                .map(|r| JsonBw {
                    bytes: r.size,
                    iterations: r.result.ops,
                    slots: r.slots,
                    elapsed_sec: r.result.elapsed_sec,
                    bw_peak_mb_per_sec: r.result.peak_bytes_per_sec / mib,
                    bw_avg_mb_per_sec: r.result.avg_bytes_per_sec / mib,
                    bw_peak_gbit_per_sec: r.result.peak_bytes_per_sec * 8.0 / 1e9,
                    bw_avg_gbit_per_sec: r.result.avg_bytes_per_sec * 8.0 / 1e9,
                    msg_rate_mpps: r.result.msg_rate_mpps,
                    checksum_len: r.check_len,
                    checksum_source: format!("0x{:08x}", r.src_crc),
                    checksum_destination: format!("0x{:08x}", r.dst_crc),
                    checksum_ok: r.ok(),
                })
                .collect()
        })
        .unwrap_or_default();
    let latency = f
        .client
        .map(|c| {
            c.lat
                .iter()
                .map(|r| JsonLat {
                    bytes: r.size,
                    iterations: r.iterations,
                    stats: r.stats,
                    echo_mismatches: r.mismatches,
                })
                .collect()
        })
        .unwrap_or_default();
    let server_rounds = match (f.server, f.client) {
        (Some(r), None) => r
            .rounds
            .iter()
            .map(|x| JsonServerRound {
                bytes: x.size,
                iterations: x.iters,
                region_len: x.region_len,
                checksum_len: x.check_len,
                checksum_destination: format!("0x{:08x}", x.crc),
                client_ops: x.client_ops,
            })
            .collect(),
        _ => Vec::new(),
    };
    let client_stats = f.client.and_then(|c| c.stats.as_ref());
    let server_stats = f.server.and_then(|r| r.stats.as_ref());
    let mut path_stats = Vec::new();
    json_paths("client_to_server", client_stats, &mut path_stats);
    json_paths("server_to_client", server_stats, &mut path_stats);
    let test = f
        .server
        .and_then(|r| r.test)
        .filter(|_| f.client.is_none())
        .unwrap_or(s.test);
    let doc = JsonReport {
        test: test.name(),
        mode: s.role.name(),
        transport: "metaroce",
        backend: "udp",
        paths: s.paths,
        mtu: s.mtu,
        tx_depth: s.tx_depth,
        seed: s.seed,
        sizes: match (f.server, f.client) {
            // A server runs the client's sizes.
            (Some(r), None) => r.rounds.iter().map(|x| x.size).collect(),
            _ => s.sizes.clone(),
        },
        iterations: s.iters.filter(|_| f.client.is_some()),
        duration_sec: s.duration.map(|d| d.as_secs_f64()),
        file: s.file.as_ref().map(|f| f.path.display().to_string()),
        bw_unit: bw_unit(s),
        server_qpn: f.client.map(|c| c.server_qpn),
        results,
        latency,
        server_rounds,
        verified,
        retransmits: total_retransmits(f),
        tail_loss_probes: total_probes(f),
        retransmits_client: f.client.map(|_| retransmits(client_stats)),
        retransmits_server: f.server.map(|_| retransmits(server_stats)),
        loss: JsonImpair {
            loss_percent: s.impair.loss * 100.0,
            dup_percent: s.impair.dup * 100.0,
            reorder_percent: s.impair.reorder * 100.0,
            ce_percent: s.impair.ce * 100.0,
            datagrams_seen: f.impair.seen,
            dropped: f.impair.dropped,
            queue_dropped: f.impair.queue_dropped,
            duplicated: f.impair.duplicated,
            reordered: f.impair.reordered,
            ce_marked: f.impair.ce_marked,
        },
        path_stats,
        pcap: match (f.pcap, &s.pcap) {
            (Some(p), Some(path)) => Some(JsonPcap {
                file: path.display().to_string(),
                packets: p.written,
                not_recorded: p.not_recorded,
                errors: p.errors,
            }),
            _ => None,
        },
    };
    serde_json::to_string_pretty(&doc)
}
