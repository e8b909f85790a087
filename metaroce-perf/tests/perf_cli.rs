//! End-to-end tests of the `metaroce-perf` binary: loopback runs, verification, flags.

use std::process::Command;

mod common;

use common::{
    assert_usage_error, figure, free_udp_port, perf, server_output, spawn_server, stderr, stdout,
    temp_path, BW_HEADER,
};

#[test]
fn loopback_write_bw_verifies() {
    let o = perf(&["-n", "200", "-s", "65536"]);
    assert_eq!(o.status.code(), Some(0));
    let s = stdout(&o);
    assert!(s.contains("RDMA_Write BW Test"), "{s}");
    assert!(s.contains(BW_HEADER), "{s}");
    let row = s
        .lines()
        .find(|l| l.trim_start().starts_with("65536"))
        .expect("a row for 65536 bytes");
    assert_eq!(row.split_whitespace().nth(1), Some("200"), "{row}");
    let check = s
        .lines()
        .find(|l| l.starts_with(" Checksum source 0x"))
        .expect("checksum line");
    assert!(check.ends_with("OK"), "{check}");
    let words: Vec<&str> = check.split_whitespace().collect();
    assert_eq!(
        words[2], words[4],
        "source and destination checksums: {check}"
    );
}

/// `-Q 8`: WRITEs posted as lists of 8 with one completion each (`write_batch`); 203 of
/// them (the last list is short), every one counted and verified, with loss so that
/// members are re-sent; and in RoCEv2 mode, where the list is 8 WRITEs awaited together.
#[test]
fn write_bw_with_cq_mod_counts_and_verifies_every_write() {
    for extra in [&["--loss", "2"][..], &["--mode", "rocev2"][..]] {
        let mut args = vec!["-n", "203", "-s", "4096", "-Q", "8"];
        args.extend_from_slice(extra);
        let o = perf(&args);
        assert_eq!(o.status.code(), Some(0), "{extra:?}: {}", stderr(&o));
        let s = stdout(&o);
        let row = s
            .lines()
            .find(|l| l.trim_start().starts_with("4096"))
            .expect("a row for 4096 bytes");
        assert_eq!(
            row.split_whitespace().nth(1),
            Some("203"),
            "{extra:?}: {row}"
        );
        let check = s
            .lines()
            .find(|l| l.starts_with(" Checksum source 0x"))
            .expect("checksum line");
        assert!(check.ends_with("OK"), "{extra:?}: {check}");
    }
}

#[test]
fn loopback_write_bw_under_loss_verifies() {
    let o = perf(&["--loss", "5", "-n", "100"]);
    assert_eq!(o.status.code(), Some(0));
    let s = stdout(&o);
    assert!(s.contains(" Loss            : 5.0%"), "{s}");
    assert!(s.contains("  OK"), "{s}");
    let summary = s
        .lines()
        .find(|l| l.starts_with(" Retransmits: "))
        .expect("summary line");
    let rtx: u64 = summary.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(rtx > 0, "5% loss must cause retransmissions: {summary}");
    assert!(summary.contains("Impairment dropped"), "{summary}");
}

#[test]
fn send_lat_prints_latency_table() {
    let o = perf(&["send_lat", "-n", "100", "-s", "64"]);
    assert_eq!(o.status.code(), Some(0));
    let s = stdout(&o);
    assert!(s.contains("Send Latency Test"), "{s}");
    assert!(
        s.contains(" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]"),
        "{s}"
    );
    let row = s
        .lines()
        .find(|l| l.trim_start().starts_with("64 "))
        .expect("a row for 64 bytes");
    let cols: Vec<f64> = row.split_whitespace().map(|w| w.parse().unwrap()).collect();
    assert_eq!(cols.len(), 9, "{row}");
    assert_eq!(cols[1], 100.0);
    assert!(figure(Some(cols[2]), row) <= cols[3], "min <= max: {row}");
    // The 10 warm-up ping-pongs are checked too.
    assert!(s.contains(" Echo check: 0 of 110"), "{s}");
}

#[test]
fn file_of_odd_length_is_written_and_verified() {
    let path = temp_path("odd.bin");
    let data: Vec<u8> = (0..1_000_003u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&path, &data).unwrap();
    let o = perf(&["--file", path.to_str().unwrap(), "-s", "65536"]);
    std::fs::remove_file(&path).ok();
    assert_eq!(o.status.code(), Some(0));
    let s = stdout(&o);
    // ceil(1_000_003 / 65536) = 16 WRITEs, the last one partial.
    let row = s
        .lines()
        .find(|l| l.trim_start().starts_with("65536"))
        .expect("row");
    assert_eq!(row.split_whitespace().nth(1), Some("16"), "{row}");
    let expected = format!("0x{:08x}", crc32fast::hash(&data));
    let check = s
        .lines()
        .find(|l| l.starts_with(" Checksum source"))
        .expect("checksum line");
    assert!(
        check.contains(&format!("source {expected}  destination {expected}  OK")),
        "the destination must hold the file: {check}"
    );
}

#[test]
fn json_output_and_duration_mode() {
    let path = temp_path("out.json");
    let o = perf(&[
        "-D",
        "0.3",
        "-s",
        "4096",
        "--report_gbits",
        "--out_json",
        "--out_json_file",
        path.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0));
    assert!(stdout(&o).contains("BW peak[Gb/sec]"));
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).ok();
    assert_eq!(doc["test"], "write_bw");
    assert_eq!(doc["mode"], "loopback");
    assert_eq!(doc["paths"], 8);
    assert_eq!(doc["verified"], true);
    let r = &doc["bw"][0];
    assert_eq!(r["bytes"], 4096);
    assert!(r["iterations"].as_u64().unwrap() > 0);
    figure(r["bw_avg_mib_per_sec"].as_f64(), "bw_avg_mib_per_sec");
    assert_eq!(r["checksum_source"], r["checksum_destination"]);
    assert_eq!(doc["path_stats"].as_array().unwrap().len(), 16);
}

#[test]
fn all_sizes_one_row_each() {
    let o = perf(&["-a", "-n", "2", "-t", "2"]);
    assert_eq!(o.status.code(), Some(0));
    let s = stdout(&o);
    for k in 1..=23 {
        let size = (1u64 << k).to_string();
        assert!(
            s.lines()
                .any(|l| l.split_whitespace().next() == Some(size.as_str())
                    && l.split_whitespace().nth(1) == Some("2")),
            "row for {size}: {s}"
        );
    }
    assert_eq!(s.matches("  OK").count(), 23, "{s}");
}

#[test]
fn client_and_server_processes() {
    let port = free_udp_port();
    let server = spawn_server(&["--server", "--bind", "127.0.0.1", "-p", &port]);
    let target = format!("127.0.0.1:{port}");
    let client = perf(&["write_bw", &target, "-n", "100", "--loss", "2"]);
    let server = server_output(server);
    assert_eq!(client.status.code(), Some(0));
    assert_eq!(server.status.code(), Some(0));
    let c = stdout(&client);
    assert!(c.contains(&format!("client of {target}")), "{c}");
    let crc = c
        .lines()
        .find(|l| l.starts_with(" Checksum source"))
        .and_then(|l| l.split_whitespace().nth(4).map(str::to_string))
        .expect("destination checksum");
    assert!(c.contains("  OK"), "{c}");
    assert!(
        stdout(&server).contains(&format!("checksum {crc}")),
        "the server reports the same destination checksum"
    );
}

#[test]
fn bad_flags_are_rejected_with_a_message() {
    assert_usage_error(
        &["--loss", "150"],
        "--loss must be a percentage in [0, 100]",
    );
    assert_usage_error(&["--loss", "-1"], "--loss must be a percentage");
    assert_usage_error(&["-s", "0"], "--size must be at least 1 byte");
    assert_usage_error(&["-s", "2147483649"], "--size must be at most 2^31");
    assert_usage_error(&["read_bandwidth"], "unknown test 'read_bandwidth'");
    assert_usage_error(&["foo_bar", "127.0.0.1"], "unknown test 'foo_bar'");
    assert_usage_error(&["--paths", "0"], "--paths must be in 1..=64");
    assert_usage_error(&["--paths", "65"], "--paths must be in 1..=64");
    assert_usage_error(
        &["--mtu", "1000"],
        "--mtu must be 256, 512, 1024, 2048 or 4096",
    );
    assert_usage_error(
        &["--file", "/nonexistent/metaroce"],
        "--file /nonexistent/metaroce",
    );
    assert_usage_error(&["-a", "--file", "x"], "cannot be used with");
    assert_usage_error(&["--backend", "rdma"], "invalid value 'rdma'");
    assert_usage_error(&["-Q", "0"], "--cq-mod must be in 1..=--tx-depth");
    assert_usage_error(
        &["-Q", "200"],
        "--cq-mod must be in 1..=--tx-depth (128), got 200",
    );
    assert_usage_error(&["read_bw", "-Q", "8"], "--cq-mod applies to write_bw only");
    assert_usage_error(&["127.0.0.1:notaport"], "invalid port");
    assert_usage_error(&["--server", "127.0.0.1"], "--server");
    let empty = temp_path("empty.bin");
    std::fs::write(&empty, b"").unwrap();
    assert_usage_error(&["--file", empty.to_str().unwrap()], "the file is empty");
    std::fs::remove_file(&empty).ok();
}

#[test]
fn help_describes_the_modes() {
    let o = perf(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    let s = stdout(&o);
    for needle in [
        "write_bw",
        "write_lat",
        "read_bw",
        "read_lat",
        "atomic_lat",
        "send_bw",
        "send_lat",
        "--mode",
        "--compare-modes",
        "--oob-port",
        "--server",
        "--report_gbits",
        "--out_json",
        "--out_json_file",
        "--tx-depth",
        "--pcap",
        "loopback",
    ] {
        assert!(s.contains(needle), "--help lacks {needle}: {s}");
    }
}

#[test]
fn emulate_routes_a_lossless_run_through_the_impairment_layer() {
    let o = perf(&["-n", "100", "--emulate"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("Impairment dropped 0 of"), "{out}");
    assert!(out.contains("OK"), "{out}");
}

#[test]
fn peak_of_a_single_message_is_its_average() {
    // One 32 MiB READ takes longer than the 100 ms peak window: the peak is the rate over
    // its whole time in flight, not 32 MiB per window.
    let o = perf(&["read_bw", "-s", "33554432", "-n", "1"]);
    assert_eq!(o.status.code(), Some(0));
    let s = stdout(&o);
    let row: Vec<&str> = s
        .lines()
        .find(|l| l.trim_start().starts_with("33554432"))
        .expect("a row for 33554432 bytes")
        .split_whitespace()
        .collect();
    let peak: f64 = row[2].parse().unwrap();
    let avg: f64 = row[3].parse().unwrap();
    assert!((peak - avg).abs() <= 0.011, "peak {peak} vs average {avg}");
    assert_eq!(row[1], "1", "one iteration");
    figure(row[4].parse().ok(), "message rate");
}

#[test]
fn a_word_that_is_no_test_and_no_host_is_called_an_unknown_test() {
    assert_usage_error(
        &["nosuchtest"],
        "unknown test 'nosuchtest' (expected one of: write_bw",
    );
    assert_usage_error(&["nosuchtest"], "or give the server address as HOST:PORT");
}

#[test]
fn unwritable_out_json_fails_before_the_run() {
    let o = perf(&["-n", "10", "--out_json_file", "/nonexistent/x.json"]);
    assert_ne!(o.status.code(), Some(0));
    assert!(stderr(&o).contains("--out_json_file /nonexistent/x.json"));
    assert!(!stdout(&o).contains(BW_HEADER), "no run: {}", stdout(&o));
}

#[test]
fn preamble_counts_spare_ports_and_warm_up() {
    let o = perf(&["send_lat", "-n", "20", "-s", "64"]);
    assert_eq!(o.status.code(), Some(0));
    let s = stdout(&o);
    assert!(
        s.contains(" Paths           : 8 (+ 24 spare source ports for re-rolls)"),
        "{s}"
    );
    assert!(
        s.contains(" Iterations      : 20 (+ 10 warm-up, not measured)"),
        "{s}"
    );
}

/// `--backend uring` runs write_bw (with loss, so retransmissions go through io_uring too)
/// and send_lat end to end, and the JSON names the backend.
#[test]
fn uring_backend_write_bw_and_send_lat_verify() {
    let o = perf(&[
        "--backend",
        "uring",
        "--loss",
        "2",
        "-n",
        "300",
        "-s",
        "65536",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let s = stdout(&o);
    let check = s
        .lines()
        .find(|l| l.starts_with(" Checksum source 0x"))
        .expect("checksum line");
    assert!(check.ends_with("OK"), "{check}");
    assert!(
        !stderr(&o).contains("using udp"),
        "io_uring fell back: {}",
        stderr(&o)
    );
    let json = temp_path("uring-lat.json");
    let o = perf(&[
        "send_lat",
        "--backend",
        "uring",
        "-s",
        "64",
        "-n",
        "500",
        "--out_json_file",
        json.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    assert_eq!(doc["backend"], "uring");
    assert_eq!(doc["latency"][0]["echo_mismatches"], 0);
    assert_eq!(doc["latency"][0]["samples"], 500);
}

/// With io_uring turned off by the environment, `--backend uring` warns and runs over UDP.
#[test]
fn uring_backend_falls_back_to_udp_when_turned_off() {
    let o = Command::new(env!("CARGO_BIN_EXE_metaroce-perf"))
        .args(["--backend", "uring", "-n", "50", "-s", "4096"])
        .env("METAROCE_IO_URING", "0")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("using udp"), "{}", stderr(&o));
    assert!(stdout(&o).contains("  OK"), "{}", stdout(&o));
}
