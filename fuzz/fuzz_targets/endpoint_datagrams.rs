//! One endpoint fed arbitrary, mutated and forged datagrams before and after a real
//! handshake. Logic: `metaroce_fuzz::endpoint_datagrams`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use metaroce_fuzz::endpoint_datagrams::{run, Input};

fuzz_target!(|input: Input| run(&input));
