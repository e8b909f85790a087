//! Replays every committed input — `corpus/<target>/*` and `regressions/<target>/*` —
//! through the target logic, without libFuzzer: `cargo test` in `fuzz/`.
//!
//! A file in `regressions/<target>/` is an input that once crashed the target; after the
//! fix it must run clean forever. `REPLAY_ONLY=<target>` and `REPLAY_FILE=<path>` narrow
//! the run (e.g. to reproduce one crash with a backtrace).

use std::path::{Path, PathBuf};

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.retain(|p| {
        p.is_file()
            && !p
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'))
    });
    v.sort();
    v
}

fn replay(kind: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    if let Ok(f) = std::env::var("REPLAY_FILE") {
        let target = std::env::var("REPLAY_ONLY").expect("REPLAY_FILE needs REPLAY_ONLY=<target>");
        if kind == "regressions" {
            let data = std::fs::read(&f).expect("read REPLAY_FILE");
            eprintln!("replaying {f} on {target}");
            assert!(
                metaroce_fuzz::run_target(&target, &data),
                "unknown target {target}"
            );
        }
        return;
    }
    let only = std::env::var("REPLAY_ONLY").ok();
    let mut n = 0;
    for target in metaroce_fuzz::TARGETS {
        if only.as_deref().is_some_and(|o| o != target) {
            continue;
        }
        for f in files(&root.join(kind).join(target)) {
            let data = std::fs::read(&f).expect("read input");
            eprintln!("{target}: {}", f.display());
            metaroce_fuzz::run_target(target, &data);
            n += 1;
        }
    }
    eprintln!("{n} {kind} inputs replayed");
}

#[test]
fn corpus() {
    replay("corpus");
}

#[test]
fn regressions() {
    replay("regressions");
}
