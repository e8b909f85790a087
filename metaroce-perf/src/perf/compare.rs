//! `--compare-modes`: write_bw over MetaRoCE and over the RoCEv2 RC mode at several loss
//! rates on loopback, one child process (`metaroce-perf write_bw --mode M --loss L ...
//! --out_json F`) per run, summarised in one table.
//!
//! Every run uses the same size, iterations (or duration), TX depth, MTU and seed, so the
//! same bytes are written and the impairment layers draw the same random streams. Goodput
//! is each run's average bandwidth relative to the same mode's lossless run.

use super::cli::{Mode, Settings};
use super::EXIT_FAILED;
use serde::Serialize;
use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
struct Row {
    mode: &'static str,
    loss_percent: f64,
    bytes: u64,
    iterations: u64,
    bw_avg_mb_per_sec: f64,
    bw_avg_gbit_per_sec: f64,
    msg_rate_mpps: f64,
    retransmitted_packets: u64,
    /// Average bandwidth relative to the same mode's lossless run, in percent.
    goodput_percent: Option<f64>,
    elapsed_sec: f64,
    checksum_ok: bool,
    /// Why the run produced no result (exit status, timeout).
    error: Option<String>,
}

/// The JSON document of `--compare-modes --out_json`.
#[derive(Debug, Serialize)]
struct Doc<'a> {
    test: &'static str,
    size: u64,
    iterations: Option<u64>,
    duration_sec: Option<f64>,
    tx_depth: usize,
    mtu: u32,
    seed: u64,
    rc_timeout: u8,
    loadavg: Option<String>,
    rows: &'a [Row],
    all_ok: bool,
}

fn loadavg() -> Option<String> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    Some(s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

/// The arguments of one child run.
fn child_args(s: &Settings, mode: Mode, loss: f64, json: &std::path::Path) -> Vec<String> {
    let c = s.compare.as_ref();
    let mut a: Vec<String> = vec![
        "write_bw".into(),
        "--mode".into(),
        mode.name().into(),
        "--loss".into(),
        format!("{}", loss * 100.0),
        // Every row, the lossless ones included, goes through the same emulation layer.
        "--emulate".into(),
        "-s".into(),
        s.sizes[0].to_string(),
    ];
    match (s.iters, s.duration) {
        (_, Some(d)) => a.extend(["-D".into(), format!("{}", d.as_secs_f64())]),
        (Some(n), None) => a.extend(["-n".into(), n.to_string()]),
        (None, None) => {}
    }
    a.extend([
        "-t".into(),
        s.tx_depth.to_string(),
        "--mtu".into(),
        s.mtu.to_string(),
        "--seed".into(),
        s.seed.to_string(),
        "--outs".into(),
        s.outs.to_string(),
        "--rc-timeout".into(),
        s.rc_timeout.to_string(),
    ]);
    if let (Mode::Metaroce, Some(p)) = (mode, c.and_then(|c| c.paths)) {
        a.extend(["--paths".into(), p.to_string()]);
    }
    if s.verbose {
        a.push("--verbose".into());
    }
    a.push("--out_json_file".into());
    a.push(json.display().to_string());
    a
}

/// Reads a pipe to the end on a thread (so a chatty child never blocks on a full pipe).
fn drain(r: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(mut r) = r {
            let _ = r.read_to_string(&mut s);
        }
        s
    })
}

/// Runs one child; returns the row (with `error` set when it produced no result).
fn one(s: &Settings, exe: &std::path::Path, mode: Mode, loss: f64, n: usize) -> Row {
    let timeout = s
        .compare
        .as_ref()
        .map_or(Duration::from_secs(300), |c| c.run_timeout);
    let json: PathBuf = std::env::temp_dir().join(format!(
        "metaroce-perf-compare-{}-{}-{n}.json",
        std::process::id(),
        mode.name()
    ));
    let mut row = Row {
        mode: mode.name(),
        loss_percent: loss * 100.0,
        bytes: s.sizes[0],
        iterations: 0,
        bw_avg_mb_per_sec: 0.0,
        bw_avg_gbit_per_sec: 0.0,
        msg_rate_mpps: 0.0,
        retransmitted_packets: 0,
        goodput_percent: None,
        elapsed_sec: 0.0,
        checksum_ok: false,
        error: None,
    };
    let args = child_args(s, mode, loss, &json);
    let mut child = match Command::new(exe)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            row.error = Some(format!("cannot start {}: {e}", exe.display()));
            return row;
        }
    };
    let out = drain(child.stdout.take());
    let err = drain(child.stderr.take());
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break Some(st),
            Ok(None) if start.elapsed() < timeout => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Err(e) => {
                row.error = Some(format!("waiting for the run: {e}"));
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    if s.verbose {
        print!("{stdout}");
    }
    let doc = std::fs::read_to_string(&json)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
    let _ = std::fs::remove_file(&json);
    match (status, &doc) {
        (None, _) if row.error.is_none() => {
            row.error = Some(format!(
                "killed after {:.0} s (--run-timeout)",
                timeout.as_secs_f64()
            ));
        }
        (Some(st), None) => {
            row.error = Some(format!(
                "exit status {}: {}",
                st.code().map_or("signal".to_string(), |c| c.to_string()),
                stderr.trim()
            ));
        }
        _ => {}
    }
    if let Some(d) = doc {
        let r = &d["bw"][0];
        row.iterations = r["iterations"].as_u64().unwrap_or(0);
        row.bw_avg_mb_per_sec = r["bw_avg_mib_per_sec"].as_f64().unwrap_or(0.0);
        row.bw_avg_gbit_per_sec = r["bw_avg_gbit_per_sec"].as_f64().unwrap_or(0.0);
        row.msg_rate_mpps = r["msg_rate_mpps"].as_f64().unwrap_or(0.0);
        row.elapsed_sec = r["elapsed_sec"].as_f64().unwrap_or(0.0);
        row.checksum_ok =
            r["checksum_ok"].as_bool().unwrap_or(false) && d["verified"].as_bool().unwrap_or(false);
        row.retransmitted_packets = d["retransmits"].as_u64().unwrap_or(0);
        if !status.is_some_and(|st| st.success()) && row.error.is_none() {
            row.error = Some(format!(
                "exit status {:?}: {}",
                status.and_then(|s| s.code()),
                stderr.trim()
            ));
        }
    }
    row
}

const HEADER: &str = " mode      loss  #bytes  #iterations  BW average[MiB/sec]  MsgRate[Mpps]  retransmitted[pkts]  goodput vs 0%  time[s]  checksum";

fn print_row(s: &Settings, r: &Row) {
    let bw = if s.report_gbits {
        r.bw_avg_gbit_per_sec
    } else {
        r.bw_avg_mb_per_sec
    };
    let goodput = r
        .goodput_percent
        .map_or_else(|| "-".to_string(), |g| format!("{g:.1}%"));
    let verdict = match (&r.error, r.checksum_ok) {
        (Some(_), _) => "FAILED",
        (None, true) => "OK",
        (None, false) => "MISMATCH",
    };
    println!(
        " {:<8} {:>5}  {:>6}  {:>11}  {:>18.2}  {:>13.6}  {:>19}  {:>13}  {:>7.2}  {}",
        r.mode,
        format!("{:.0}%", r.loss_percent),
        r.bytes,
        r.iterations,
        bw,
        r.msg_rate_mpps,
        r.retransmitted_packets,
        goodput,
        r.elapsed_sec,
        verdict
    );
    if let Some(e) = &r.error {
        println!("   ^ {e}");
    }
}

/// Runs the comparison; returns the exit status (1 if any run failed or mismatched).
pub fn run(s: &Settings) -> i32 {
    let Some(c) = &s.compare else {
        return EXIT_FAILED;
    };
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("metaroce-perf: cannot find my own executable: {e}");
            return EXIT_FAILED;
        }
    };
    let rule = "-".repeat(HEADER.len());
    println!("{rule}");
    println!(" RDMA_Write BW: MetaRoCE vs RoCEv2 RC, loopback, loss applied by both endpoints");
    let runs = match (s.iters, s.duration) {
        (_, Some(d)) => format!("{:.1} s per run", d.as_secs_f64()),
        (Some(n), None) => format!("{n} WRITEs per run"),
        (None, None) => String::new(),
    };
    println!(
        " {} B WRITEs, {runs}, TX depth {}, MTU {}, seed {}; metaroce: {} paths; rocev2: 1 QP, go-back-N, ACK timeout 2^{} x 4.096 us",
        s.sizes[0],
        s.tx_depth,
        s.mtu,
        s.seed,
        c.paths.unwrap_or(8),
        s.rc_timeout
    );
    let example = child_args(s, Mode::Rocev2, 0.05, std::path::Path::new("F"));
    println!(
        " each row: metaroce-perf {}",
        example
            .join(" ")
            .replace("--mode rocev2", "--mode MODE")
            .replace("--loss 5", "--loss LOSS")
    );
    let load = loadavg();
    if let Some(l) = &load {
        println!(" load average at start: {l}");
    }
    println!("{rule}");
    println!("{HEADER}");
    let mut rows = Vec::new();
    let mut n = 0;
    for mode in [Mode::Metaroce, Mode::Rocev2] {
        let mut base: Option<f64> = None;
        for &loss in &c.losses {
            let mut row = one(s, &exe, mode, loss, n);
            n += 1;
            if loss == 0.0 && row.error.is_none() {
                base = Some(row.bw_avg_mb_per_sec);
            }
            row.goodput_percent = base
                .filter(|b| *b > 0.0 && row.error.is_none())
                .map(|b| row.bw_avg_mb_per_sec / b * 100.0);
            print_row(s, &row);
            rows.push(row);
        }
    }
    println!("{rule}");
    let all_ok = rows.iter().all(|r| r.error.is_none() && r.checksum_ok);
    if let Some(l) = loadavg() {
        println!(" load average at end: {l}");
    }
    println!(
        " Goodput = BW average relative to the same mode's 0% run. Retransmitted packets: metaroce \
         counts selective retransmissions and tail-loss probes of both sides, rocev2 the packets \
         go-back-N sent again."
    );
    if let Some(path) = &s.out_json {
        let doc = Doc {
            test: "write_bw",
            size: s.sizes[0],
            iterations: s.iters,
            duration_sec: s.duration.map(|d| d.as_secs_f64()),
            tx_depth: s.tx_depth,
            mtu: s.mtu,
            seed: s.seed,
            rc_timeout: s.rc_timeout,
            loadavg: load,
            rows: &rows,
            all_ok,
        };
        let text = match serde_json::to_string_pretty(&doc) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("metaroce-perf: {e}");
                return EXIT_FAILED;
            }
        };
        if let Err(e) = std::fs::write(path, text + "\n") {
            eprintln!("metaroce-perf: --out_json_file {}: {e}", path.display());
            return EXIT_FAILED;
        }
    }
    if all_ok {
        0
    } else {
        eprintln!("metaroce-perf: a run failed or its data did not verify");
        EXIT_FAILED
    }
}
