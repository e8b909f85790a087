//! Examples of using metaroce from a Rust service. The package has no library API of its
//! own: its content is the programs under `examples/`, run with
//! `cargo run -p metaroce-examples --example NAME`.
//!
//! The tools (`metaroce-perf`, `metaroce-rc-pingpong`) live in the `metaroce-perf` package.
