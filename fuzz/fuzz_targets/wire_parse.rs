//! `Packet::parse`, every header parser, emit round trips and the ICRC on arbitrary bytes.
//! Logic: `metaroce_fuzz::wire_parse`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| metaroce_fuzz::wire_parse::run(data));
