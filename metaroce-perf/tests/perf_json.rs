//! perftest's surface: `--out_json` / `--out_json_file` and the JSON keys a perftest JSON
//! consumer reads, `MiB/sec` labels, the server banner naming the client's test, and
//! progress lines when stderr is not a terminal.

mod common;
use common::*;
use std::process::Command;

/// Read a JSON report the way a perftest consumer does: `test_info.test` names the test,
/// `results` is one object with perftest's keys and number values.
fn perftest_consumer(path: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).expect("the JSON report");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    assert!(doc["test_info"].is_object(), "test_info: {doc}");
    assert!(doc["test_info"]["test"].is_string());
    assert!(doc["results"].is_object(), "results is an object: {doc}");
    assert!(doc["results"]["MsgSize"].is_u64());
    assert!(doc["results"]["n_iterations"].is_u64());
    doc
}

/// The numbers of the last table row that starts with `size`.
fn row(stdout: &str, size: u64) -> Vec<f64> {
    stdout
        .lines()
        .rfind(|l| l.split_whitespace().next() == Some(&size.to_string()))
        .expect("a table row")
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect()
}

#[test]
fn bw_json_has_perftests_keys_and_the_tables_values() {
    let path = temp_path("perftest-bw.json");
    let o = perf(&[
        "write_bw",
        "-a",
        "-n",
        "20",
        "--out_json",
        "--out_json_file",
        path.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0));
    let s = stdout(&o);
    assert!(s.contains(BW_HEADER), "MiB/sec labels: {s}");
    assert!(!s.contains("MB/sec"), "{s}");
    let doc = perftest_consumer(&path);
    std::fs::remove_file(&path).ok();
    assert_eq!(doc["test_info"]["test"], "RDMA_Write_BW_Test");
    assert_eq!(doc["test_info"]["Link_type"], "Ethernet");
    assert_eq!(doc["test_info"]["Mtu"], 4096);
    let r = &doc["results"];
    // perftest's file after -a holds the last size.
    assert_eq!(r["MsgSize"], 1u64 << 23);
    let t = row(&s, 1 << 23);
    assert_eq!(r["n_iterations"].as_f64(), Some(t[1]));
    for (key, col) in [("BW_peak", 2), ("BW_average", 3), ("MsgRate", 4)] {
        let v = figure(r[key].as_f64(), key);
        // The table prints BW with 2 decimals, MsgRate with 6.
        let tol = if key == "MsgRate" { 1e-6 } else { 0.006 };
        assert!((v - t[col]).abs() <= tol, "{key} {v} vs table {}", t[col]);
    }
    let per = doc["results_per_size"]
        .as_array()
        .expect("results_per_size");
    assert_eq!(per.len(), 23);
    assert_eq!(per[0]["MsgSize"], 2);
    assert!(per.iter().all(|x| x["BW_average"].as_f64().is_some()));
    // metaroce's own figures stay beside perftest's.
    assert_eq!(doc["verified"], true);
    assert!(doc["bw"][0]["bw_avg_mib_per_sec"].as_f64().is_some());
}

#[test]
fn lat_json_has_perftests_latency_keys() {
    let path = temp_path("perftest-lat.json");
    let o = perf(&[
        "send_lat",
        "-s",
        "64",
        "-n",
        "200",
        "--out_json_file",
        path.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0));
    let doc = perftest_consumer(&path);
    std::fs::remove_file(&path).ok();
    assert_eq!(doc["test_info"]["test"], "Send_Latency_Test");
    let r = &doc["results"];
    assert_eq!(r["MsgSize"], 64);
    assert_eq!(r["n_iterations"], 200);
    let t = row(&stdout(&o), 64);
    for (key, col) in [
        ("t_min", 2),
        ("t_max", 3),
        ("t_typical", 4),
        ("t_avg", 5),
        ("t_stdev", 6),
        ("percentile_99", 7),
        ("percentile_99.9", 8),
    ] {
        let v = r[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} is a number"));
        assert!((v - t[col]).abs() <= 0.006, "{key} {v} vs table {}", t[col]);
    }
    assert!(r["t_min"].as_f64() <= r["t_avg"].as_f64());
}

#[test]
fn out_json_alone_writes_perftest_out_json_in_the_working_directory() {
    let dir = temp_path("cwd");
    std::fs::create_dir_all(&dir).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_metaroce-perf"))
        .args(["read_lat", "-n", "50", "--out_json"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let doc = perftest_consumer(&dir.join("perftest_out.json"));
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(doc["test_info"]["test"], "RDMA_Read_Latency_Test");
    assert_eq!(doc["test_info"]["Outstand_reads"], 16);
}

#[test]
fn server_banner_names_the_clients_test() {
    let port = free_udp_port();
    let server = spawn_server(&["--server", "--bind", "127.0.0.1", "-p", &port]);
    let client = perf(&[
        "send_lat",
        &format!("127.0.0.1:{port}"),
        "-n",
        "50",
        "-s",
        "32",
    ]);
    let server = server_output(server);
    let out = stdout(&server);
    assert_eq!(client.status.code(), Some(0));
    assert_eq!(server.status.code(), Some(0));
    assert!(out.contains("Send Latency Test"), "{out}");
    assert!(!out.contains("RDMA_Write BW Test"), "{out}");
    assert!(out.contains("runs send_lat"), "{out}");
}

#[test]
fn progress_lines_on_a_pipe_for_a_long_run_only() {
    // stderr is a pipe here: a 5 s run shows progress lines, a short one none.
    let long = perf(&["write_bw", "-D", "5", "-s", "65536"]);
    assert_eq!(long.status.code(), Some(0));
    let lines: Vec<String> = stderr(&long)
        .lines()
        .filter(|l| l.starts_with(" progress 65536 B:"))
        .map(str::to_owned)
        .collect();
    assert!(!lines.is_empty(), "no progress line: {}", stderr(&long));
    // The first line comes after the quiet period, so at most one per second after 3 s.
    assert!(lines.len() <= 3, "{lines:?}");
    let short = perf(&["write_bw", "-n", "100"]);
    assert_eq!(short.status.code(), Some(0));
    assert!(!stderr(&short).contains(" progress "), "{}", stderr(&short));
}
