//! Two endpoints, a schedule of SENDs and WRITEs, an impairment schedule; end-to-end
//! checks. Logic: `metaroce_fuzz::pair_impaired`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use metaroce_fuzz::pair_impaired::{run, Input};

fuzz_target!(|input: Input| run(&input));
