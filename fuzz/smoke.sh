#!/usr/bin/env bash
# Fuzz smoke test: build every cargo-fuzz target, replay its committed corpus and
# regression inputs, and fuzz it for a short time. Exits non-zero on any crash, hang or
# failed build. Meant for CI (.ci/run) and for a quick local check.
#
#   fuzz/smoke.sh                    # 60 s per target
#   FUZZ_SECONDS=300 fuzz/smoke.sh   # longer
#
# Environment:
#   FUZZ_SECONDS      fuzzing time per target in seconds (default 60)
#   FUZZ_SANITIZER    none (default) | address  -- see fuzz/README.md
#   FUZZ_TARGETS      space-separated subset of targets (default: all)
#   METAROCE_FUZZ_KNOWN_BUGS  ids of known core bugs to tolerate (default: none, strict)
#
# cargo-fuzz needs nightly-only rustc flags (-Zsanitizer, sanitizer coverage passes); on
# the stable toolchain RUSTC_BOOTSTRAP=1 unlocks them. Build output goes to fuzz/target
# (this directory is its own workspace), crash inputs to fuzz/artifacts/<target>/.
set -euo pipefail

cd "$(dirname "$0")"
FUZZ_SECONDS="${FUZZ_SECONDS:-60}"
FUZZ_SANITIZER="${FUZZ_SANITIZER:-none}"
export RUSTC_BOOTSTRAP=1
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

start=$(date +%s)
stamp() { echo "[fuzz smoke +$(( $(date +%s) - start ))s] $*"; }

if ! cargo fuzz --version >/dev/null 2>&1; then
    stamp "installing cargo-fuzz from crates.io"
    cargo install cargo-fuzz --locked
fi
stamp "$(cargo fuzz --version)"

targets="${FUZZ_TARGETS:-$(cargo fuzz list)}"
stamp "building (sanitizer: $FUZZ_SANITIZER): $(echo $targets)"
cargo fuzz build --sanitizer "$FUZZ_SANITIZER"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
failed=()
for t in $targets; do
    mkdir -p "$work/$t" "corpus/$t" "regressions/$t" "artifacts/$t"
    stamp "$t: replaying corpus/$t and regressions/$t, then fuzzing for ${FUZZ_SECONDS}s"
    # New inputs go to a scratch directory (first corpus argument), so a local run does
    # not add files to the committed corpus. libFuzzer runs every input of every corpus
    # directory before it starts mutating, so regressions are always replayed.
    if ! cargo fuzz run --sanitizer "$FUZZ_SANITIZER" "$t" \
        "$work/$t" "corpus/$t" "regressions/$t" -- \
        -max_total_time="$FUZZ_SECONDS" -timeout=30 -rss_limit_mb=2048 \
        -print_final_stats=1 -artifact_prefix="artifacts/$t/" \
        >"$work/$t.log" 2>&1; then
        failed+=("$t")
        stamp "$t: FAILED; last lines of the log:"
        tail -n 60 "$work/$t.log"
        ls -l "artifacts/$t/" || true
    else
        stamp "$t: ok: $(grep -E '^#[0-9]+.*(DONE|pulse|NEW|REDUCE|INITED)' "$work/$t.log" | tail -n 1)"
        grep -E '^stat::(number_of_executed_units|average_exec_per_sec|new_units_added)' \
            "$work/$t.log" | tr '\n' ' ' || true
        echo
    fi
done

if [ "${#failed[@]}" -ne 0 ]; then
    stamp "crashes in: ${failed[*]} (inputs under fuzz/artifacts/; see fuzz/README.md)"
    exit 1
fi
stamp "all targets ok"
