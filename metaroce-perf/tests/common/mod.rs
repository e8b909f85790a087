//! Helpers shared by the end-to-end tests of `metaroce-perf`.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Instant;

/// Run `metaroce-perf` with `args`, echo its output to stderr (shown on failure).
pub fn perf(args: &[&str]) -> Output {
    let t0 = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_metaroce-perf"))
        .args(args)
        .output()
        .expect("run metaroce-perf");
    eprintln!(
        "metaroce-perf {} -> {:?} in {:.2?}\n--- stdout\n{}--- stderr\n{}",
        args.join(" "),
        out.status.code(),
        t0.elapsed(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A fresh path in the temp directory.
pub fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("metaroce-perf-{}-{name}", std::process::id()))
}

/// A measured figure the tool printed or wrote (a bandwidth, a message rate, a time):
/// present, finite and not negative; returns it. Not a speed check: on a loaded machine a
/// rate printed with a few decimals rounds to 0, and asserting it positive asserted a
/// wall-clock speed (the all-reduce test failed that way).
pub fn figure(v: Option<f64>, what: &str) -> f64 {
    let v = v.unwrap_or_else(|| panic!("{what}: not a number"));
    assert!(v.is_finite() && v >= 0.0, "{what}: {v}");
    v
}

pub const BW_HEADER: &str =
    " #bytes     #iterations    BW peak[MiB/sec]    BW average[MiB/sec]   MsgRate[Mpps]";

/// Run `metaroce-perf` with `args` like [`perf`], but kill it if it has not ended after
/// `limit` (a guard against a hang, not a timing assertion): `None` then.
pub fn perf_bounded(args: &[&str], limit: std::time::Duration) -> Option<Output> {
    let t0 = Instant::now();
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let k = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let out_path = temp_path(&format!("bounded{k}.out"));
    let err_path = temp_path(&format!("bounded{k}.err"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_metaroce-perf"))
        .args(args)
        .stdout(std::fs::File::create(&out_path).expect("stdout file"))
        .stderr(std::fs::File::create(&err_path).expect("stderr file"))
        .spawn()
        .expect("run metaroce-perf");
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait for metaroce-perf") {
            break Some(st);
        }
        if t0.elapsed() > limit {
            child.kill().ok();
            child.wait().ok();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let stdout = std::fs::read(&out_path).unwrap_or_default();
    let stderr = std::fs::read(&err_path).unwrap_or_default();
    std::fs::remove_file(&out_path).ok();
    std::fs::remove_file(&err_path).ok();
    eprintln!(
        "metaroce-perf {} -> {:?} in {:.2?}\n--- stdout\n{}--- stderr\n{}",
        args.join(" "),
        status.map(|s| s.code()),
        t0.elapsed(),
        String::from_utf8_lossy(&stdout),
        String::from_utf8_lossy(&stderr)
    );
    Some(Output {
        status: status?,
        stdout,
        stderr,
    })
}

/// A free UDP port on 127.0.0.1 (released again right away; a clash is unlikely).
pub fn free_udp_port() -> String {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string()
}

/// A free TCP port on 127.0.0.1 (released again right away; a clash is unlikely).
pub fn free_tcp_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string()
}

/// Start `metaroce-perf` with `args` (a server) in the background, stdout and stderr
/// piped; [`server_output`] waits for it.
pub fn spawn_server(args: &[&str]) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_metaroce-perf"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run metaroce-perf --server")
}

/// Wait for a server from [`spawn_server`] to end; echo its output to stderr (shown on
/// failure).
pub fn server_output(server: std::process::Child) -> Output {
    let out = server.wait_with_output().expect("wait for the server");
    eprintln!(
        "--- server stdout\n{}--- server stderr\n{}",
        stdout(&out),
        stderr(&out)
    );
    out
}

/// `metaroce-perf args` exits with status 2 and says `message` on stderr.
pub fn assert_usage_error(args: &[&str], message: &str) {
    let o = perf(args);
    assert_eq!(o.status.code(), Some(2), "exit status for {args:?}");
    let e = stderr(&o);
    assert!(e.contains(message), "{args:?}: expected {message:?} in {e}");
}
