//! Fuzz targets for the metaroce core.
//!
//! Each target's logic is a plain function here; `fuzz_targets/*.rs` are thin libFuzzer
//! wrappers around them, and `tests/replay.rs` runs the same functions over the committed
//! corpus and regression inputs under `cargo test`, without libFuzzer.
//!
//! * [`wire_parse`]: the packet parsers and emitters, and the ICRC.
//! * [`endpoint_datagrams`]: one endpoint fed arbitrary and mutated datagrams, before and
//!   after a real handshake with an honest in-memory peer.
//! * [`aead_open`]: AEAD packet protection: `open` on raw and mutated sealed packets, and
//!   an AEAD connection fed raw, mutated and replayed datagrams.
//! * [`pair_impaired`]: two endpoints exchanging SENDs and WRITEs over an impaired
//!   in-memory network in virtual time, checked end to end.
//! * [`rc_packets`]: RoCEv2 RC mode: two RC endpoints whose packets the input drops,
//!   mutates (ICRC re-stamped), replays, or injects raw bytes among.

pub mod aead_open;
pub mod endpoint_datagrams;
pub mod pair_impaired;
pub mod rc_packets;
pub mod util;
pub mod wire_parse;

use arbitrary::{Arbitrary, Unstructured};

/// Decode `data` the way `libfuzzer_sys::fuzz_target!(|x: T| ...)` does
/// (`T::arbitrary_take_rest`); `None` if it does not decode (libFuzzer skips such inputs).
pub fn decode<'a, T: Arbitrary<'a>>(data: &'a [u8]) -> Option<T> {
    T::arbitrary_take_rest(Unstructured::new(data)).ok()
}

/// Run the named target on raw input bytes, as the fuzzer would. Returns `false` for an
/// unknown target name.
pub fn run_target(name: &str, data: &[u8]) -> bool {
    match name {
        "wire_parse" => wire_parse::run(data),
        "endpoint_datagrams" => {
            if let Some(input) = decode::<endpoint_datagrams::Input>(data) {
                endpoint_datagrams::run(&input);
            }
        }
        "aead_open" => {
            if let Some(input) = decode::<aead_open::Input>(data) {
                aead_open::run(&input);
            }
        }
        "pair_impaired" => {
            if let Some(input) = decode::<pair_impaired::Input>(data) {
                pair_impaired::run(&input);
            }
        }
        "rc_packets" => {
            if let Some(input) = decode::<rc_packets::Input>(data) {
                rc_packets::run(&input);
            }
        }
        _ => return false,
    }
    true
}

/// The names of every target, as in `Cargo.toml`.
pub const TARGETS: [&str; 5] = [
    "wire_parse",
    "endpoint_datagrams",
    "pair_impaired",
    "aead_open",
    "rc_packets",
];
