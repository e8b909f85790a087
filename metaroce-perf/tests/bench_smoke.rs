//! `metaroce-bench` drives `metaroce-perf` as a child and reads its JSON report: if the two
//! drift apart (a flag renamed, a key moved), every metaroce figure silently turns into an
//! error line. This runs the quick metaroce measures once and checks each produced a figure.

use std::process::Command;

#[test]
fn bench_gets_a_figure_from_every_metaroce_measure() {
    let dir = std::env::temp_dir().join(format!("metaroce-bench-smoke-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("bench.json");
    let out = Command::new(env!("CARGO_BIN_EXE_metaroce-bench"))
        .args([
            "--reps",
            "1",
            "--quick",
            "--only",
            "metaroce_rtt64_udp,metaroce_rate64_udp,metaroce_rate64q_udp",
            "--out_json",
        ])
        .arg(&json)
        .output()
        .expect("run metaroce-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "metaroce-bench failed: {stdout}");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("JSON report")).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let measures = doc["measures"].as_array().expect("measures");
    let names: Vec<&str> = measures.iter().filter_map(|m| m["name"].as_str()).collect();
    assert_eq!(
        names,
        // The filter also matches the per-CPU-second variant of the 64 B rate.
        [
            "metaroce_rate64_udp",
            "metaroce_rate64q_udp",
            "metaroce_rate64_udp_cpu",
            "metaroce_rtt64_udp"
        ],
        "{stdout}"
    );
    for m in measures {
        assert_eq!(m["errors"].as_array().map(Vec::len), Some(0), "{m}");
        // A figure, not a speed check: present, finite, not negative.
        let median = m["median"].as_f64();
        assert!(
            median.is_some_and(|v| v.is_finite() && v >= 0.0),
            "no figure: {m}"
        );
        let samples = m["samples"].as_array().unwrap();
        assert_eq!(samples.len(), 1, "{m}");
        assert!(samples[0]["packets"].as_u64().unwrap_or(0) > 0, "{m}");
    }
}
