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

pub const BW_HEADER: &str =
    " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]";
