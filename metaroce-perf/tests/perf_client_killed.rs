//! `metaroce-perf --server` ends by itself, in bounded time, when its client process is
//! killed mid-run — in both modes. (MetaRoCE mode used to wait forever: nothing noticed the
//! dead peer on the idle control stream.)

mod common;

use common::{free_tcp_port, free_udp_port};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(args: &[&str], out: &std::path::Path) -> Proc {
    Proc(
        Command::new(env!("CARGO_BIN_EXE_metaroce-perf"))
            .args(args)
            .stdout(std::fs::File::create(out).unwrap())
            .stderr(Stdio::null())
            .spawn()
            .expect("run metaroce-perf"),
    )
}

/// Start a server, a long client run against it, kill the client once the run is under
/// way, and wait (with a generous guard) for the server to exit on its own.
fn server_ends_when_client_is_killed(server_args: &[&str], client_args: &[&str], tag: &str) {
    let server_out = common::temp_path(&format!("killed-{tag}-server.out"));
    let client_out = common::temp_path(&format!("killed-{tag}-client.out"));
    let mut server = spawn(server_args, &server_out);
    std::thread::sleep(Duration::from_millis(500));
    let mut client = spawn(client_args, &client_out);
    // Wait until the client reports it is running (its preamble), then a little more.
    let t0 = Instant::now();
    while !std::fs::read_to_string(&client_out)
        .unwrap_or_default()
        .contains("#bytes")
        && t0.elapsed() < Duration::from_secs(60)
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    client.0.kill().unwrap();
    client.0.wait().unwrap();
    let killed = Instant::now();
    let guard = Duration::from_secs(90);
    let status = loop {
        if let Some(st) = server.0.try_wait().unwrap() {
            break Some(st);
        }
        if killed.elapsed() > guard {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let srv = std::fs::read_to_string(&server_out).unwrap_or_default();
    let cli = std::fs::read_to_string(&client_out).unwrap_or_default();
    std::fs::remove_file(&server_out).ok();
    std::fs::remove_file(&client_out).ok();
    println!(
        "{tag}: server exited {:?} after its client was killed, status {:?}\n--- server\n{srv}--- client\n{cli}",
        killed.elapsed(),
        status.map(|s| s.code())
    );
    assert!(
        status.is_some(),
        "{tag}: the server was still running {guard:?} after its client was killed"
    );
}

#[test]
fn metaroce_server_ends_when_its_client_is_killed() {
    let port = free_udp_port();
    let addr = format!("127.0.0.1:{port}");
    server_ends_when_client_is_killed(
        &["--server", "--bind", "127.0.0.1", "-p", &port],
        &["write_bw", &addr, "-D", "60", "-s", "65536"],
        "metaroce",
    );
}

#[test]
fn rocev2_server_ends_when_its_client_is_killed() {
    let port = free_udp_port();
    let oob = free_tcp_port();
    server_ends_when_client_is_killed(
        &[
            "--server",
            "--mode",
            "rocev2",
            "--bind",
            "127.0.0.1",
            "-p",
            &port,
            "--oob-port",
            &oob,
        ],
        &[
            "write_bw",
            "--mode",
            "rocev2",
            "127.0.0.1",
            "--oob-port",
            &oob,
            "-D",
            "60",
            "-s",
            "65536",
        ],
        "rocev2",
    );
}
