//! `metaroce-allreduce`: nccl-tests-style collective benchmark (ring all-reduce,
//! all-gather, reduce-scatter, all-to-all) over metaroce or TCP. See `--help`.

#[path = "../coll/mod.rs"]
mod coll;

fn main() {
    std::process::exit(coll::main());
}
