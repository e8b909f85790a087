//! RoCEv2 RC mode: two RC endpoints whose packets are dropped, mutated (ICRC re-stamped),
//! replayed or joined by raw bytes. Logic: `metaroce_fuzz::rc_packets`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use metaroce_fuzz::rc_packets::{run, Input};

fuzz_target!(|input: Input| run(&input));
