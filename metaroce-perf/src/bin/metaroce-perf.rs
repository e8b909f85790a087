//! `metaroce-perf`: perftest-style benchmark of the MetaRoCE transport. See `--help`.

#[path = "../perf/mod.rs"]
mod perf;

fn main() {
    std::process::exit(perf::main());
}
