//! Text output (perftest-like layout, our own wording) and the JSON document.

use super::cli::{Mode, Role, Settings, Test};
use super::client::{BwRow, ClientRun, LatRow};
use super::pcap::PcapSummary;
use super::server::ServerRun;
use super::xport::LinkStats;
use metaroce::rocev2::{ack_timeout, QpStats};
use metaroce::ConnectionStats;
use metaroce_tokio::backend::ImpairStats;
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
pub fn ports(list: &[u16]) -> String {
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

/// The local ACK timeout of `--rc-timeout`, e.g. "67.1 ms".
fn rc_timeout_text(exp: u8) -> String {
    match ack_timeout(exp) {
        Some(d) if d.as_secs_f64() >= 1.0 => format!("{:.2} s", d.as_secs_f64()),
        Some(d) if d.as_secs_f64() >= 1e-3 => format!("{:.1} ms", d.as_secs_f64() * 1e3),
        Some(d) => format!("{:.1} us", d.as_secs_f64() * 1e6),
        None => "off".into(),
    }
}

fn title_text(t: &str) {
    let title = format!("{t:^WIDTH$}");
    println!("{}", title.trim_end());
}

/// The centred title line of test `t` (perftest's banner, e.g. "RDMA_Write BW Test").
fn title(t: Test) {
    title_text(t.title());
}

/// A server's banner once a client said which test it runs: the test's title between
/// rules, then who the client is.
pub fn client_banner(t: Test, who: &str, qpn: u32, rounds: u32) {
    rule();
    title(t);
    println!(
        " Client {who} (QPN 0x{qpn:06x}) runs {} with {rounds} size(s)",
        t.name()
    );
    rule();
}

/// The title and the parameter block; with a connection, the local and remote address
/// lines.
pub fn preamble(s: &Settings, link: Option<(&str, &str)>) {
    rule();
    // A server runs whatever test its client asks for: it names it in the client's banner
    // ([`client_banner`]), not here.
    if !matches!(s.role, Role::Server { .. }) {
        title(s.test);
    } else {
        title_text("metaroce-perf server");
    }
    match s.mode {
        Mode::Metaroce => kv("Transport", "MetaRoCE over UDP"),
        Mode::Rocev2 => kv(
            "Transport",
            "RoCEv2 RC (standard opcodes) in UDP datagrams, ICRC over synthesized IPv4 headers",
        ),
    }
    match &s.role {
        Role::Loopback => kv("Mode", "loopback (server and client in this process)"),
        Role::Client { given, addr } => match s.mode {
            Mode::Metaroce => kv("Mode", format!("client of {given} ({addr})")),
            Mode::Rocev2 => kv(
                "Mode",
                format!(
                    "client of {given} ({}, exchange over TCP port {})",
                    addr.ip(),
                    s.oob_port
                ),
            ),
        },
        Role::Server { addr } => match s.mode {
            Mode::Metaroce => kv("Mode", format!("server on {addr}")),
            Mode::Rocev2 => kv(
                "Mode",
                format!(
                    "server on UDP {addr}, exchange over TCP port {}",
                    s.oob_port
                ),
            ),
        },
    }
    match s.mode {
        Mode::Metaroce => {
            kv("Connection type", "reliable, multipath (RC semantics)");
            match super::net::spare_ports(s.paths) {
                0 => kv("Paths", s.paths),
                spares => kv(
                    "Paths",
                    format!("{} (+ {spares} spare source ports for re-rolls)", s.paths),
                ),
            }
        }
        Mode::Rocev2 => {
            kv(
                "Connection type",
                format!(
                    "RC, one QP (ACK timeout {} = 4.096 us x 2^{}, retry 7)",
                    rc_timeout_text(s.rc_timeout),
                    s.rc_timeout
                ),
            );
            kv("Paths", "1 (RoCEv2 RC, go-back-N)");
        }
    }
    kv("Mtu", format!("{}[B]", s.mtu));
    if s.test.is_bw() {
        kv("TX depth", s.tx_depth);
    }
    if matches!(s.test, Test::ReadBw | Test::ReadLat | Test::AtomicLat) {
        kv("Outstand reads", s.outs);
    }
    if s.mode == Mode::Rocev2 && matches!(s.test, Test::SendBw | Test::SendLat) {
        kv("RX depth", format!("{} (receiving side)", s.rx_depth));
    }
    match s.test {
        Test::WriteLat => kv(
            "Latency",
            "one-way = RTT/2 of a WRITE ping-pong; arrival seen through WRITE with immediate",
        ),
        Test::SendLat => kv("Latency", "one-way = RTT/2 of a SEND ping-pong (echo)"),
        Test::ReadLat => kv("Latency", "round trip of one READ at a time (not halved)"),
        Test::AtomicLat => kv(
            "Latency",
            "round trip of one FETCH_AND_ADD at a time (not halved)",
        ),
        _ => {}
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
        // Latency tests run unmeasured (but checked) warm-up iterations first.
        let warmup = match s.iters {
            _ if s.test.is_bw() => String::new(),
            Some(n) => format!(
                " (+ {} warm-up, not measured)",
                super::client::WARMUP.min(n)
            ),
            None => format!(" (+ {} warm-up iterations)", super::client::WARMUP),
        };
        match (s.iters, s.duration) {
            (_, Some(d)) => kv(
                "Duration",
                format!("{:.1} s per size{warmup}", d.as_secs_f64()),
            ),
            (Some(n), None) if s.file.is_none() => kv("Iterations", format!("{n}{warmup}")),
            _ => {}
        }
    }
    kv("Seed", s.seed);
    rule();
    if let Some((local, remote)) = link {
        println!(" local address : {local}");
        println!(" remote address: {remote}");
        rule();
    }
}

fn bw_unit(s: &Settings) -> &'static str {
    if s.report_gbits {
        "Gb/sec"
    } else {
        "MiB/sec"
    }
}

/// Bandwidth in the unit of the report: MiB/sec = 2^20 B/s, Gb/sec = 10^9 bit/s.
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
        "{:>7}{:>16}{:>19.2}{:>22.2}{:>16}",
        r.size,
        r.result.ops,
        bw_value(s, r.result.peak_bytes_per_sec),
        bw_value(s, r.result.avg_bytes_per_sec),
        mpps(r.result.msg_rate_mpps)
    );
}

/// A message rate in Mpps with six decimals, or in scientific notation when that would
/// show 0.000000 for a rate that is not zero (few large messages).
fn mpps(v: f64) -> String {
    if v > 0.0 && v < 5e-7 {
        format!("{v:.3e}")
    } else {
        format!("{v:.6}")
    }
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

impl Footer<'_> {
    fn client_stats(&self) -> Option<&LinkStats> {
        self.client.and_then(|c| c.stats.as_ref())
    }

    fn server_stats(&self) -> Option<&LinkStats> {
        self.server.and_then(|r| r.stats.as_ref())
    }
}

/// Tail-loss probes of this process's connections (the library counts them as
/// retransmissions too).
pub fn total_probes(f: &Footer<'_>) -> u64 {
    f.client_stats().map_or(0, LinkStats::probes) + f.server_stats().map_or(0, LinkStats::probes)
}

/// Retransmitted packets of this process's connections.
pub fn total_retransmits(f: &Footer<'_>) -> u64 {
    f.client_stats().map_or(0, LinkStats::retransmits)
        + f.server_stats().map_or(0, LinkStats::retransmits)
}

fn rc_parts(st: Option<&LinkStats>) -> Option<(QpStats, metaroce::rocev2::RcStats)> {
    match st {
        Some(LinkStats::Rc { qp, ep, .. }) => Some((*qp, *ep)),
        _ => None,
    }
}

/// The verification lines of the client's rows.
fn checks(c: &ClientRun, test: Test) {
    match test {
        Test::WriteBw | Test::ReadBw => match c.bw.as_slice() {
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
        },
        Test::SendBw => {
            for r in &c.bw {
                let (sent, got) = r.messages.unwrap_or_default();
                println!(
                    " Checksum {:>8} B  sent 0x{:08x}  received 0x{:08x}  ({got} of {sent} messages)  {}",
                    r.size,
                    r.src_crc,
                    r.dst_crc,
                    verdict(r.ok())
                );
            }
        }
        Test::SendLat => {
            let total: u64 = c.lat.iter().map(|r| r.checked).sum();
            let bad: u64 = c.lat.iter().map(|r| r.mismatches).sum();
            println!(
                " Echo check: {bad} of {total} echoed messages differ from what was sent  {}",
                verdict(bad == 0)
            );
        }
        Test::WriteLat => {
            let total: u64 = c.lat.iter().map(|r| r.checked).sum();
            let bad: u64 = c.lat.iter().map(|r| r.mismatches).sum();
            let peer: u64 = c.lat.iter().map(|r| r.peer_mismatches).sum();
            println!(
                " Data check: WRITEs landed with wrong bytes or immediate: {bad} of {total} at the client, {peer} of {total} at the server  {}",
                verdict(bad == 0 && peer == 0)
            );
        }
        Test::ReadLat => {
            let total: u64 = c.lat.iter().map(|r| r.checked).sum();
            let bad: u64 = c.lat.iter().map(|r| r.mismatches).sum();
            println!(
                " Data check: {bad} of {total} READs returned other bytes than the server holds  {}",
                verdict(bad == 0)
            );
        }
        Test::AtomicLat => {
            for r in &c.lat {
                if let Some(a) = r.atomic {
                    println!(
                        " Atomic check: {} of {} fetched values wrong; final counter 0x{:016x}, expected 0x{:016x} = initial 0x{:016x} + sum of {} adds  {}",
                        r.mismatches,
                        a.adds,
                        a.found,
                        a.expected,
                        a.initial,
                        a.adds,
                        verdict(r.ok())
                    );
                }
            }
        }
    }
}

/// Checksums, data checks, retransmissions, drops, capture.
pub fn footer(s: &Settings, f: &Footer<'_>) {
    if let Some(c) = f.client {
        checks(c, s.test);
    }
    if let (Some(r), None) = (f.server, f.client) {
        let n = r.rounds.len();
        match r.test {
            Some(Test::SendLat) => println!(" Served {n} size(s); {} messages echoed", r.echoed),
            Some(t) => println!(" Served {n} size(s) of {}", t.name()),
            None => println!(" Served no run"),
        }
    }
    let client_rtx = f.client_stats().map_or(0, LinkStats::retransmits);
    let server_rtx = f.server_stats().map_or(0, LinkStats::retransmits);
    let drops = f.impair.dropped + f.impair.queue_dropped;
    let impaired = if s.impair.any() {
        format!(
            "  Impairment dropped {drops} of {} datagrams",
            f.impair.seen
        )
    } else {
        "  Impairment: none".to_string()
    };
    let both = f.client.is_some() && f.server.is_some();
    match s.mode {
        Mode::Metaroce => {
            let probes = total_probes(f);
            let detail = if both {
                format!(" (client {client_rtx}, server {server_rtx}; {probes} probes)")
            } else {
                format!(" ({probes} probes)")
            };
            println!(
                " Retransmits: {}{detail} over {} paths{impaired}",
                client_rtx + server_rtx,
                s.paths
            );
        }
        Mode::Rocev2 => {
            let parts: Vec<(QpStats, metaroce::rocev2::RcStats)> =
                [rc_parts(f.client_stats()), rc_parts(f.server_stats())]
                    .into_iter()
                    .flatten()
                    .collect();
            let sum = |g: fn(&QpStats) -> u64| parts.iter().map(|(q, _)| g(q)).sum::<u64>();
            let timeouts = sum(|q| q.timeouts);
            let naks = sum(|q| q.seq_naks_sent);
            let rnr = sum(|q| q.rnr_naks_sent);
            let who = if both {
                format!("client {client_rtx}, server {server_rtx}; ")
            } else {
                String::new()
            };
            println!(
                " Retransmits: {} ({who}{timeouts} ACK timeouts, {naks} sequence NAKs, {rnr} RNR NAKs) over 1 path (RoCEv2 RC, go-back-N){impaired}",
                client_rtx + server_rtx
            );
            let rx: u64 = parts.iter().map(|(_, e)| e.rx_packets).sum();
            let bad: u64 = parts.iter().map(|(_, e)| e.rx_bad_icrc).sum();
            println!(
                " ICRC: verified on every packet received, over the synthesized IPv4 header: {bad} of {rx} bad"
            );
        }
    }
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
        for (title, st) in [
            ("client -> server", f.client_stats()),
            ("server -> client", f.server_stats()),
        ] {
            match st {
                Some(LinkStats::Meta(Some(st))) => path_table(title, st),
                Some(LinkStats::Rc { qp, ep, udp }) => {
                    rule();
                    let side = if title.starts_with("client") {
                        "client"
                    } else {
                        "server"
                    };
                    println!(" RC QP of the {side}: {qp:?}");
                    println!(" RC endpoint of the {side}: {ep:?}; UDP {udp:?}");
                }
                _ => {}
            }
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
    rerolls: u64,
    rebalance_rerolls: u64,
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
    bw_peak_mib_per_sec: f64,
    bw_avg_mib_per_sec: f64,
    bw_peak_gbit_per_sec: f64,
    bw_avg_gbit_per_sec: f64,
    msg_rate_mpps: f64,
    checksum_len: u64,
    checksum_source: String,
    checksum_destination: String,
    checksum_ok: bool,
    messages_sent: Option<u64>,
    messages_received: Option<u64>,
}

#[derive(Debug, Serialize)]
struct JsonAtomic {
    initial: String,
    adds: u64,
    expected: String,
    found: String,
}

#[derive(Debug, Serialize)]
struct JsonLat {
    bytes: u64,
    iterations: u64,
    checked: u64,
    #[serde(flatten)]
    stats: Option<super::stats::LatStats>,
    /// Echo mismatches (send_lat) / landed WRITEs (write_lat, client side) / READ results /
    /// fetched values that were wrong.
    echo_mismatches: u64,
    peer_mismatches: u64,
    atomic: Option<JsonAtomic>,
    ok: bool,
}

#[derive(Debug, Serialize)]
struct JsonServerRound {
    bytes: u64,
    iterations: u64,
    region_len: u64,
    checksum_len: u64,
    checksum_destination: String,
    client_ops: u64,
    value: u64,
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
struct JsonRc {
    side: &'static str,
    tx_requests: u64,
    retransmitted: u64,
    tx_responses: u64,
    ack_timeouts: u64,
    seq_naks_sent: u64,
    seq_naks_received: u64,
    rnr_naks_sent: u64,
    rnr_naks_received: u64,
    duplicates_received: u64,
    out_of_sequence: u64,
    rx_packets: u64,
    rx_bad_icrc: u64,
}

#[derive(Debug, Serialize)]
struct JsonReport {
    /// perftest's `test_info` object.
    test_info: serde_json::Value,
    /// perftest's `results` object: the last size, as perftest's file holds after `-a`.
    results: serde_json::Value,
    /// perftest's `results` object of every size, in order.
    results_per_size: Vec<serde_json::Value>,
    test: &'static str,
    mode: &'static str,
    transport: &'static str,
    backend: &'static str,
    paths: u16,
    mtu: u32,
    tx_depth: usize,
    outs: u16,
    seed: u64,
    sizes: Vec<u64>,
    iterations: Option<u64>,
    duration_sec: Option<f64>,
    file: Option<String>,
    bw_unit: &'static str,
    latency_unit: &'static str,
    server_qpn: Option<u32>,
    bw: Vec<JsonBw>,
    latency: Vec<JsonLat>,
    server_rounds: Vec<JsonServerRound>,
    verified: bool,
    retransmits: u64,
    tail_loss_probes: u64,
    retransmits_client: Option<u64>,
    retransmits_server: Option<u64>,
    loss: JsonImpair,
    path_stats: Vec<JsonPath>,
    rc_stats: Vec<JsonRc>,
    pcap: Option<JsonPcap>,
}

fn json_paths(direction: &'static str, st: Option<&LinkStats>, out: &mut Vec<JsonPath>) {
    let paths = st
        .and_then(LinkStats::meta)
        .map(|s| s.paths.as_slice())
        .unwrap_or(&[]);
    for p in paths {
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
            rerolls: p.stats.rerolls,
            rebalance_rerolls: p.stats.rebalance_rerolls,
            ecn_marks: p.stats.ecn_marks,
            srtt_usec: p.srtt.as_secs_f64() * 1e6,
            window: p.window,
            failed: p.failed,
        });
    }
}

fn json_rc(side: &'static str, st: Option<&LinkStats>, out: &mut Vec<JsonRc>) {
    if let Some((q, e)) = rc_parts(st) {
        out.push(JsonRc {
            side,
            tx_requests: q.tx_requests,
            retransmitted: q.retransmitted,
            tx_responses: q.tx_responses,
            ack_timeouts: q.timeouts,
            seq_naks_sent: q.seq_naks_sent,
            seq_naks_received: q.seq_naks_received,
            rnr_naks_sent: q.rnr_naks_sent,
            rnr_naks_received: q.rnr_naks_received,
            duplicates_received: q.duplicates_received,
            out_of_sequence: q.out_of_sequence,
            rx_packets: e.rx_packets,
            rx_bad_icrc: e.rx_bad_icrc,
        });
    }
}

fn json_bw(r: &BwRow) -> JsonBw {
    let mib = f64::from(1u32 << 20);
    JsonBw {
        bytes: r.size,
        iterations: r.result.ops,
        slots: r.slots,
        elapsed_sec: r.result.elapsed_sec,
        bw_peak_mib_per_sec: r.result.peak_bytes_per_sec / mib,
        bw_avg_mib_per_sec: r.result.avg_bytes_per_sec / mib,
        bw_peak_gbit_per_sec: r.result.peak_bytes_per_sec * 8.0 / 1e9,
        bw_avg_gbit_per_sec: r.result.avg_bytes_per_sec * 8.0 / 1e9,
        msg_rate_mpps: r.result.msg_rate_mpps,
        checksum_len: r.check_len,
        checksum_source: format!("0x{:08x}", r.src_crc),
        checksum_destination: format!("0x{:08x}", r.dst_crc),
        checksum_ok: r.ok(),
        messages_sent: r.messages.map(|m| m.0),
        messages_received: r.messages.map(|m| m.1),
    }
}

fn json_lat(r: &LatRow) -> JsonLat {
    JsonLat {
        bytes: r.size,
        iterations: r.iterations,
        checked: r.checked,
        stats: r.stats,
        echo_mismatches: r.mismatches,
        peer_mismatches: r.peer_mismatches,
        atomic: r.atomic.map(|a| JsonAtomic {
            initial: format!("0x{:016x}", a.initial),
            adds: a.adds,
            expected: format!("0x{:016x}", a.expected),
            found: format!("0x{:016x}", a.found),
        }),
        ok: r.ok(),
    }
}

/// perftest's name of a test in `test_info.test` (`testsStr[verb]`, the atomic type,
/// `BW_` or `Latency_`, `Test`).
pub fn perftest_test_name(t: Test) -> &'static str {
    match t {
        Test::WriteBw => "RDMA_Write_BW_Test",
        Test::WriteLat => "RDMA_Write_Latency_Test",
        Test::ReadBw => "RDMA_Read_BW_Test",
        Test::ReadLat => "RDMA_Read_Latency_Test",
        Test::AtomicLat => "Atomic_FETCH_AND_ADD_Latency_Test",
        Test::SendBw => "Send_BW_Test",
        Test::SendLat => "Send_Latency_Test",
    }
}

/// perftest's `test_info` object (perftest_parameters.c, `write_test_info_to_file`): the
/// keys that have a meaning here, with perftest's spellings and value forms.
fn perftest_test_info(s: &Settings, test: Test) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    let mut put = |k: &str, v: serde_json::Value| {
        m.insert(k.to_owned(), v);
    };
    put("test", perftest_test_name(test).into());
    put("Dual_port", "OFF".into());
    put(
        "Device",
        match s.mode {
            Mode::Metaroce => "metaroce",
            Mode::Rocev2 => "metaroce-rocev2",
        }
        .into(),
    );
    put("Number_of_qps", 1.into());
    put("Transport_type", "IB".into());
    put(
        "Connection_type",
        match s.mode {
            Mode::Metaroce => "MetaRoCE",
            Mode::Rocev2 => "RC",
        }
        .into(),
    );
    put("Using_SRQ", "OFF".into());
    put("PCIe_relax_order", "Unsupported".into());
    put("ibv_wr_API", "OFF".into());
    if test.is_bw() {
        put("TX_depth", s.tx_depth.into());
    }
    if matches!(test, Test::SendBw | Test::SendLat) {
        put("RX_depth", s.rx_depth.into());
    }
    put("Mtu", s.mtu.into());
    put("Link_type", "Ethernet".into());
    put("Max_inline_data", 0.into());
    if matches!(test, Test::ReadBw | Test::ReadLat | Test::AtomicLat) {
        put("Outstand_reads", s.outs.into());
    }
    put("rdma_cm_QPs", "OFF".into());
    put("Data_ex_method", "Ethernet".into());
    serde_json::Value::Object(m)
}

/// perftest's `results` object of one bandwidth row (`REPORT_FMT_JSON`): BW in the
/// report's unit (MiB/sec, or Gb/sec with --report_gbits), MsgRate in Mpps.
fn perftest_bw(s: &Settings, r: &BwRow) -> serde_json::Value {
    serde_json::json!({
        "MsgSize": r.size,
        "n_iterations": r.result.ops,
        "BW_peak": bw_value(s, r.result.peak_bytes_per_sec),
        "BW_average": bw_value(s, r.result.avg_bytes_per_sec),
        "MsgRate": r.result.msg_rate_mpps,
    })
}

/// perftest's `results` object of one latency row (`REPORT_FMT_LAT_JSON`), usec.
fn perftest_lat(r: &LatRow) -> serde_json::Value {
    match &r.stats {
        Some(l) => serde_json::json!({
            "MsgSize": r.size,
            "n_iterations": r.iterations,
            "t_min": l.t_min_usec,
            "t_max": l.t_max_usec,
            "t_typical": l.t_typical_usec,
            "t_avg": l.t_avg_usec,
            "t_stdev": l.t_stdev_usec,
            "percentile_99": l.p99_usec,
            "percentile_99.9": l.p999_usec,
        }),
        None => serde_json::json!({ "MsgSize": r.size, "n_iterations": r.iterations }),
    }
}

/// The JSON document of a run.
pub fn json(s: &Settings, f: &Footer<'_>, verified: bool) -> serde_json::Result<String> {
    let results = f
        .client
        .map(|c| c.bw.iter().map(json_bw).collect())
        .unwrap_or_default();
    let mut per_size: Vec<serde_json::Value> = match f.client {
        Some(c) => {
            c.bw.iter()
                .map(|r| perftest_bw(s, r))
                .chain(c.lat.iter().map(perftest_lat))
                .collect()
        }
        None => Vec::new(),
    };
    if let (Some(r), None) = (f.server, f.client) {
        // A server does not measure: perftest's size and iteration keys only.
        per_size = r
            .rounds
            .iter()
            .map(|x| serde_json::json!({ "MsgSize": x.size, "n_iterations": x.iters }))
            .collect();
    }
    let latency = f
        .client
        .map(|c| c.lat.iter().map(json_lat).collect())
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
                value: x.value,
            })
            .collect(),
        _ => Vec::new(),
    };
    let mut path_stats = Vec::new();
    json_paths("client_to_server", f.client_stats(), &mut path_stats);
    json_paths("server_to_client", f.server_stats(), &mut path_stats);
    let mut rc_stats = Vec::new();
    json_rc("client", f.client_stats(), &mut rc_stats);
    json_rc("server", f.server_stats(), &mut rc_stats);
    let test = f
        .server
        .and_then(|r| r.test)
        .filter(|_| f.client.is_none())
        .unwrap_or(s.test);
    let doc = JsonReport {
        test_info: perftest_test_info(s, test),
        results: per_size
            .last()
            .cloned()
            .unwrap_or_else(|| serde_json::json!({})),
        results_per_size: per_size,
        test: test.name(),
        mode: s.role.name(),
        transport: s.mode.name(),
        backend: match s.backend {
            super::cli::BackendKind::Udp => "udp",
            super::cli::BackendKind::Uring => "uring",
            super::cli::BackendKind::Verbs => "verbs",
        },
        paths: s.paths,
        mtu: s.mtu,
        tx_depth: s.tx_depth,
        outs: s.outs,
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
        latency_unit: if test.halves_rtt() {
            "usec, one-way (RTT/2)"
        } else {
            "usec, round trip"
        },
        server_qpn: f.client.map(|c| c.server_qpn),
        bw: results,
        latency,
        server_rounds,
        verified,
        retransmits: total_retransmits(f),
        tail_loss_probes: total_probes(f),
        retransmits_client: f
            .client
            .map(|_| f.client_stats().map_or(0, LinkStats::retransmits)),
        retransmits_server: f
            .server
            .map(|_| f.server_stats().map_or(0, LinkStats::retransmits)),
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
        rc_stats,
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
