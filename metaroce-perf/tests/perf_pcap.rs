//! `metaroce-perf --pcap`: every recorded packet must carry a valid ICRC for its
//! synthesized headers (checked by the test bed's independent Python implementation) and
//! decode as RoCEv2 in tshark.

use std::path::{Path, PathBuf};
use std::process::Command;

fn checker() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/testbed/check_icrc_pcap.py")
}

fn have(cmd: &str, arg: &str) -> bool {
    Command::new(cmd)
        .arg(arg)
        .output()
        .is_ok_and(|o| o.status.success())
}

fn capture(name: &str, args: &[&str]) -> PathBuf {
    let path =
        std::env::temp_dir().join(format!("metaroce-perf-{}-{name}.pcap", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_metaroce-perf"))
        .args(args)
        .arg("--pcap")
        .arg(&path)
        .output()
        .expect("run metaroce-perf");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0));
    assert!(stdout.contains(" Capture: "), "{stdout}");
    path
}

/// Packets in a classic little-endian pcap.
fn count_packets(path: &Path) -> usize {
    let d = std::fs::read(path).unwrap();
    assert_eq!(&d[..4], &0xa1b2_c3d4u32.to_le_bytes(), "classic LE pcap");
    assert_eq!(
        u32::from_le_bytes(d[20..24].try_into().unwrap()),
        1,
        "Ethernet"
    );
    let (mut off, mut n) = (24, 0);
    while off + 16 <= d.len() {
        let incl = u32::from_le_bytes(d[off + 8..off + 12].try_into().unwrap()) as usize;
        off += 16 + incl;
        n += 1;
    }
    assert_eq!(off, d.len(), "no truncated record");
    n
}

fn check_icrc(path: &Path, packets: usize) {
    let script = checker();
    if !script.exists() || !have("python3", "--version") {
        eprintln!(
            "NOTE: skipping the ICRC check: python3 or {} is missing",
            script.display()
        );
        return;
    }
    let out = Command::new("python3")
        .arg(&script)
        .arg(path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().unwrap_or("");
    eprintln!("check_icrc_pcap.py: {last}");
    assert!(out.status.success(), "{text}");
    assert_eq!(last, format!("{packets} RoCEv2 packets, 0 with bad ICRC"));
}

fn check_tshark(path: &Path, packets: usize) {
    if !have("tshark", "--version") {
        eprintln!("NOTE: tshark not on PATH: skipping the dissector check");
        return;
    }
    let out = Command::new("tshark")
        .arg("-r")
        .arg(path)
        .args(["-T", "fields", "-E", "separator=,"])
        .args(["-e", "infiniband.bth.opcode"])
        .args(["-e", "infiniband.bth.destqp"])
        .args(["-e", "infiniband.bth.psn"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), packets, "one line per packet");
    for (i, l) in lines.iter().enumerate() {
        let f: Vec<&str> = l.split(',').collect();
        assert!(
            f.len() == 3 && f.iter().all(|x| !x.is_empty()),
            "packet {}: opcode/destqp/psn missing: {l:?}",
            i + 1
        );
    }
}

#[test]
fn pcap_of_write_bw_verifies_and_decodes() {
    let path = capture("bw", &["-n", "30", "-s", "65536", "--loss", "2"]);
    let n = count_packets(&path);
    // 30 WRITEs of 16 packets, ACKs, the handshake and the control messages.
    assert!(n > 480, "{n} packets");
    check_icrc(&path, n);
    check_tshark(&path, n);
    std::fs::remove_file(&path).ok();
}

#[test]
fn pcap_of_send_lat_is_capped() {
    let path = capture(
        "lat",
        &[
            "send_lat",
            "-n",
            "200",
            "-s",
            "8",
            "--pcap-max-packets",
            "300",
        ],
    );
    let n = count_packets(&path);
    assert_eq!(n, 300, "the cap bounds the capture");
    check_icrc(&path, n);
    check_tshark(&path, n);
    std::fs::remove_file(&path).ok();
}

#[test]
fn pcap_of_rocev2_read_bw_verifies_and_decodes() {
    // The RC mode's packets are standard RoCEv2 (READ requests and responses, ACKs): every
    // one must carry the ICRC of the synthesized headers it was sent with.
    let path = capture(
        "rc",
        &[
            "read_bw", "--mode", "rocev2", "-n", "20", "-s", "16384", "--loss", "2",
        ],
    );
    let n = count_packets(&path);
    // 20 READs of 4 response packets plus the requests.
    assert!(n >= 100, "{n} packets");
    check_icrc(&path, n);
    check_tshark(&path, n);
    std::fs::remove_file(&path).ok();
}
