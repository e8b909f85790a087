//! AEAD packet protection: `open` on raw and mutated sealed packets, and an AEAD connection
//! fed raw, mutated and replayed datagrams. Logic: `metaroce_fuzz::aead_open`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: metaroce_fuzz::aead_open::Input| metaroce_fuzz::aead_open::run(&input));
