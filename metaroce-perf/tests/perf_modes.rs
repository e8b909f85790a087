//! End-to-end tests of `metaroce-perf`'s tests in both modes (`--mode metaroce` and the
//! RoCEv2-compatible RC mode), the RoCEv2 client/server exchange, `--compare-modes`, and
//! the combinations that are refused.

mod common;

use common::{
    assert_usage_error, figure, free_tcp_port, free_udp_port, perf, server_output, spawn_server,
    stderr, stdout, temp_path, BW_HEADER,
};

const LAT_HEADER: &str = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]";

/// The line of the verification verdict of each test.
fn verdict_prefix(test: &str) -> &'static str {
    match test {
        "write_bw" | "read_bw" => " Checksum source 0x",
        "send_bw" => " Checksum ",
        "write_lat" | "read_lat" => " Data check: ",
        "atomic_lat" => " Atomic check: ",
        "send_lat" => " Echo check: ",
        _ => unreachable!(),
    }
}

/// Runs `test` in `mode` on loopback with `extra` arguments; checks exit 0, the perftest
/// table, the verdict line, the paths line and the JSON document; returns stdout.
fn run_verified(test: &str, mode: &str, extra: &[&str]) -> String {
    let json = temp_path(&format!("{test}-{mode}.json"));
    let mut args = vec![
        test,
        "--mode",
        mode,
        "--out_json_file",
        json.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = perf(&args);
    assert_eq!(o.status.code(), Some(0), "{test} --mode {mode}");
    let s = stdout(&o);
    let bw = test.ends_with("_bw");
    assert!(
        s.contains(if bw { BW_HEADER } else { LAT_HEADER }),
        "table header of {test}: {s}"
    );
    let verdict = s
        .lines()
        .find(|l| l.starts_with(verdict_prefix(test)))
        .unwrap_or_else(|| panic!("verdict line of {test}: {s}"));
    assert!(verdict.ends_with("  OK"), "{verdict}");
    match mode {
        "rocev2" => {
            assert!(
                s.contains(" Paths           : 1 (RoCEv2 RC, go-back-N)"),
                "{s}"
            );
            assert!(
                s.contains(" ICRC: verified on every packet received"),
                "{s}"
            );
            assert!(s.contains(" of 0 bad") || s.contains(": 0 of "), "{s}");
        }
        _ => assert!(s.contains(" Paths           : 8"), "{s}"),
    }
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).ok();
    assert_eq!(doc["test"], test);
    assert_eq!(doc["transport"], mode);
    assert_eq!(doc["verified"], true);
    if bw {
        let r = &doc["bw"][0];
        assert_eq!(r["checksum_ok"], true);
        assert!(r["bytes"].as_u64().is_some_and(|b| b > 0), "{r}");
        assert!(r["iterations"].as_u64().is_some_and(|n| n > 0), "{r}");
        figure(r["bw_avg_mib_per_sec"].as_f64(), "bw_avg_mib_per_sec");
    } else {
        let r = &doc["latency"][0];
        assert_eq!(r["ok"], true);
        let min = figure(r["t_min_usec"].as_f64(), "t_min_usec");
        assert!(min <= figure(r["t_max_usec"].as_f64(), "t_max_usec"), "{r}");
    }
    if mode == "rocev2" {
        assert_eq!(doc["paths"], 1);
        assert_eq!(doc["rc_stats"].as_array().unwrap().len(), 2);
        for side in doc["rc_stats"].as_array().unwrap() {
            assert_eq!(side["rx_bad_icrc"], 0);
        }
    }
    s
}

fn both_modes(test: &str, extra: &[&str]) {
    for mode in ["metaroce", "rocev2"] {
        run_verified(test, mode, extra);
    }
}

/// The numeric columns of the row of `size`.
fn row(s: &str, size: &str) -> Vec<f64> {
    let line = s
        .lines()
        .find(|l| l.split_whitespace().next() == Some(size))
        .unwrap_or_else(|| panic!("a row for {size}: {s}"));
    line.split_whitespace()
        .map(|w| w.parse().unwrap())
        .collect()
}

#[test]
fn write_bw_both_modes() {
    both_modes("write_bw", &["-n", "40", "-s", "16384"]);
}

#[test]
fn write_lat_both_modes() {
    for mode in ["metaroce", "rocev2"] {
        let s = run_verified("write_lat", mode, &["-n", "40", "-s", "64"]);
        assert!(s.contains("RDMA_Write Latency Test"), "{s}");
        assert!(s.contains("RTT/2 of a WRITE ping-pong"), "{s}");
        let cols = row(&s, "64");
        assert_eq!(cols.len(), 9);
        assert_eq!(cols[1], 40.0);
        assert!(cols[2] <= cols[3], "min <= max");
        // 10 warm-up iterations are checked too.
        assert!(
            s.contains("0 of 50 at the client, 0 of 50 at the server"),
            "{s}"
        );
    }
}

#[test]
fn read_bw_both_modes() {
    for mode in ["metaroce", "rocev2"] {
        let s = run_verified("read_bw", mode, &["-n", "40", "-s", "16384", "-t", "8"]);
        assert!(s.contains("RDMA_Read BW Test"), "{s}");
        assert!(s.contains(" Outstand reads  : 16"), "{s}");
        assert_eq!(row(&s, "16384")[1], 40.0);
    }
}

#[test]
fn read_lat_both_modes() {
    for mode in ["metaroce", "rocev2"] {
        let s = run_verified("read_lat", mode, &["-n", "40", "-s", "1024"]);
        assert!(
            s.contains("round trip of one READ at a time (not halved)"),
            "{s}"
        );
        assert!(s.contains(" Data check: 0 of 50 READs"), "{s}");
    }
}

#[test]
fn atomic_lat_both_modes() {
    for mode in ["metaroce", "rocev2"] {
        let s = run_verified("atomic_lat", mode, &["-n", "40"]);
        assert!(s.contains("Atomic FETCH_AND_ADD Latency Test"), "{s}");
        assert_eq!(row(&s, "8")[1], 40.0);
        let check = s
            .lines()
            .find(|l| l.starts_with(" Atomic check: "))
            .unwrap();
        // "... final counter 0xF, expected 0xE = initial ... + sum of 50 adds  OK"
        let words: Vec<&str> = check.split_whitespace().collect();
        let found = words[words.iter().position(|w| *w == "counter").unwrap() + 1];
        let expected = words[words.iter().position(|w| *w == "expected").unwrap() + 1];
        assert_eq!(found.trim_end_matches(','), expected, "{check}");
        assert!(check.contains("0 of 50 fetched values wrong"), "{check}");
        assert!(check.contains("sum of 50 adds"), "{check}");
    }
}

#[test]
fn send_bw_both_modes() {
    for mode in ["metaroce", "rocev2"] {
        let s = run_verified("send_bw", mode, &["-n", "60", "-s", "8192", "-r", "16"]);
        assert!(s.contains("Send BW Test"), "{s}");
        assert!(s.contains("(60 of 60 messages)  OK"), "{s}");
    }
}

#[test]
fn send_lat_both_modes() {
    both_modes("send_lat", &["-n", "40", "-s", "256"]);
}

#[test]
fn rocev2_under_loss_verifies() {
    // Go-back-N recovers every loss; a shorter ACK timeout (16.8 ms) keeps tail losses quick.
    for (test, extra) in [
        ("write_bw", &["-n", "30", "-s", "16384"][..]),
        ("read_bw", &["-n", "30", "-s", "16384"][..]),
        ("send_bw", &["-n", "30", "-s", "16384"][..]),
        ("atomic_lat", &["-n", "30"][..]),
        ("write_lat", &["-n", "30", "-s", "4096"][..]),
    ] {
        let mut args = extra.to_vec();
        args.extend([
            "--loss",
            "3",
            "--dup",
            "1",
            "--reorder",
            "1",
            "--rc-timeout",
            "12",
        ]);
        let s = run_verified(test, "rocev2", &args);
        let summary = s.lines().find(|l| l.starts_with(" Retransmits: ")).unwrap();
        assert!(
            summary.contains("over 1 path (RoCEv2 RC, go-back-N)"),
            "{summary}"
        );
        assert!(summary.contains("Impairment dropped"), "{summary}");
    }
}

#[test]
fn rocev2_several_sizes_reuse_regions() {
    // -a runs 23 sizes; the RC endpoint reuses (cannot free) its regions between them.
    let o = perf(&["write_lat", "--mode", "rocev2", "-a", "-n", "2"]);
    assert_eq!(o.status.code(), Some(0));
    let s = stdout(&o);
    for k in 1..=23 {
        let size = (1u64 << k).to_string();
        assert!(
            s.lines()
                .any(|l| l.split_whitespace().next() == Some(size.as_str())),
            "row for {size}"
        );
    }
    assert!(s.contains("  OK"), "{s}");
}

#[test]
fn rocev2_client_and_server_processes() {
    let udp = free_udp_port();
    let oob = free_tcp_port();
    let server = spawn_server(&[
        "--server",
        "--mode",
        "rocev2",
        "--bind",
        "127.0.0.1",
        "-p",
        &udp,
        "--oob-port",
        &oob,
    ]);
    let client = perf(&[
        "read_bw",
        "--mode",
        "rocev2",
        "127.0.0.1",
        "--oob-port",
        &oob,
        "-n",
        "50",
        "-s",
        "16384",
        "--loss",
        "1",
        "--rc-timeout",
        "12",
    ]);
    let server = server_output(server);
    assert_eq!(client.status.code(), Some(0));
    assert_eq!(server.status.code(), Some(0));
    let c = stdout(&client);
    assert!(c.contains("client of 127.0.0.1"), "{c}");
    assert!(c.contains(&format!("exchange over TCP port {oob}")), "{c}");
    assert!(
        c.contains(&format!("127.0.0.1:{udp}  QPN 0x")),
        "remote line: {c}"
    );
    let crc = c
        .lines()
        .find(|l| l.starts_with(" Checksum source"))
        .and_then(|l| l.split_whitespace().nth(2).map(str::to_string))
        .expect("source checksum");
    assert!(c.contains("  OK"), "{c}");
    let srv = stdout(&server);
    assert!(
        srv.contains(&format!("checksum {crc}")),
        "the server reports the checksum of the memory the client read: {srv}"
    );
    assert!(
        srv.contains("Waiting for a client on TCP 127.0.0.1:"),
        "{srv}"
    );
}

#[test]
fn compare_modes_prints_six_rows() {
    let json = temp_path("compare.json");
    let o = perf(&[
        "--compare-modes",
        "-s",
        "4096",
        "-n",
        "40",
        "--rc-timeout",
        "12",
        "--out_json_file",
        json.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0));
    let s = stdout(&o);
    assert!(s.contains(" mode      loss  #bytes  #iterations  BW average[MiB/sec]  MsgRate[Mpps]  retransmitted[pkts]  goodput vs 0%"), "{s}");
    let rows: Vec<&str> = s
        .lines()
        .filter(|l| l.starts_with(" metaroce ") || l.starts_with(" rocev2 "))
        .collect();
    assert_eq!(rows.len(), 6, "{s}");
    for (r, (mode, loss)) in rows.iter().zip([
        ("metaroce", "0%"),
        ("metaroce", "1%"),
        ("metaroce", "5%"),
        ("rocev2", "0%"),
        ("rocev2", "1%"),
        ("rocev2", "5%"),
    ]) {
        let w: Vec<&str> = r.split_whitespace().collect();
        assert_eq!((w[0], w[1]), (mode, loss), "{r}");
        assert_eq!(w[2], "4096", "{r}");
        assert_eq!(w[3], "40", "{r}");
        figure(w[4].parse().ok(), r);
        assert!(w[7].ends_with('%'), "goodput: {r}");
        assert_eq!(*w.last().unwrap(), "OK", "{r}");
    }
    assert!(
        rows[0].contains("100.0%") && rows[3].contains("100.0%"),
        "{s}"
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).ok();
    assert_eq!(doc["all_ok"], true);
    assert_eq!(doc["rows"].as_array().unwrap().len(), 6);
    // 5% loss makes go-back-N resend packets.
    assert!(doc["rows"][5]["retransmitted_packets"].as_u64().unwrap() > 0);
}

#[test]
fn bad_combinations_are_rejected() {
    assert_usage_error(
        &["--mode", "rocev2", "--paths", "4"],
        "RoCEv2 RC mode uses one QP and one UDP source port (--paths must be 1)",
    );
    assert_usage_error(&["--mode", "rocev2", "--ce", "1"], "--ce: RoCEv2 RC mode");
    assert_usage_error(
        &["--mode", "rocev2", "read_bw", "10.0.0.1:4791"],
        "give the server as HOST without a port",
    );
    assert_usage_error(&["atomic_lat", "-s", "64"], "-s must be 8");
    assert_usage_error(&["atomic_lat", "-a"], "-a does not apply to atomic_lat");
    assert_usage_error(
        &["read_bw", "--file", "Cargo.toml"],
        "--file applies to write_bw only",
    );
    assert_usage_error(
        &["--compare-modes", "read_bw"],
        "--compare-modes runs write_bw",
    );
    assert_usage_error(
        &["--compare-modes", "--loss", "1"],
        "--compare-modes sets the loss itself",
    );
    assert_usage_error(&["--compare-modes", "--mode", "rocev2"], "runs both modes");
    assert_usage_error(&["--compare-modes", "--server"], "loopback only");
    assert_usage_error(
        &["--compare-modes", "--losses", "1,x"],
        "'x' is not a number",
    );
    assert_usage_error(&["--losses", "1"], "--compare-modes");
    assert_usage_error(&["--rc-timeout", "0"], "--rc-timeout must be in 1..=31");
    assert_usage_error(&["--outs", "0"], "--outs must be in 1..=255");
    assert_usage_error(&["--rx-depth", "0"], "--rx-depth must be in 1..=65536");
    assert_usage_error(&["--mode", "rdma"], "invalid value 'rdma'");
}

#[test]
fn a_failed_check_exits_1_in_every_test() {
    // --selftest-mismatch (hidden) corrupts one byte of what the client checks against
    // after the transfer: every test must notice, say MISMATCH and exit 1.
    for mode in ["metaroce", "rocev2"] {
        for test in [
            "write_bw",
            "write_lat",
            "read_bw",
            "read_lat",
            "atomic_lat",
            "send_bw",
            "send_lat",
        ] {
            let mut args = vec![test, "--mode", mode, "-n", "5", "--selftest-mismatch"];
            if test != "atomic_lat" {
                args.extend(["-s", "1024"]);
            }
            let o = perf(&args);
            assert_eq!(o.status.code(), Some(1), "{test} --mode {mode}");
            let s = stdout(&o);
            let verdict = s
                .lines()
                .find(|l| l.starts_with(verdict_prefix(test)))
                .unwrap_or_else(|| panic!("verdict line of {test}: {s}"));
            assert!(verdict.ends_with("  MISMATCH"), "{verdict}");
            assert!(stderr(&o).contains("data verification FAILED"));
        }
    }
}

#[test]
fn a_failure_on_the_server_side_ends_the_client() {
    // Under 50% loss the server's echo SEND (send_lat) or reply WRITE (write_lat) often
    // exhausts its retry budget. The server reports that over the control channel and the
    // client ends with the server's error, instead of waiting forever for an echo (a run
    // may also succeed, or fail on the client's own side first).
    let limit = std::time::Duration::from_secs(120);
    let mut server_reports = 0;
    for (test, mode, seed) in [
        ("send_lat", "rocev2", "1"),
        ("send_lat", "rocev2", "2"),
        ("send_lat", "rocev2", "3"),
        ("write_lat", "rocev2", "4"),
        ("send_lat", "metaroce", "5"),
    ] {
        let args = [
            test, "--loss", "50", "-n", "50", "--mode", mode, "--seed", seed,
        ];
        let o = common::perf_bounded(&args, limit)
            .unwrap_or_else(|| panic!("{args:?} did not end within {limit:?}"));
        match o.status.code() {
            Some(0) => {}
            Some(1) => {
                let e = stderr(&o);
                assert!(e.contains("metaroce-perf: "), "{args:?}: {e}");
                server_reports += usize::from(e.contains("the server reported an error: "));
            }
            other => panic!("{args:?}: exit status {other:?}"),
        }
    }
    eprintln!("runs ended by the server's report: {server_reports}");
}
