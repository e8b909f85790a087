#!/usr/bin/env bash
# metaroce-verbs/run-rxe-tests.sh — the crate's device tests on a real verbs stack: builds
# the test binaries on the host, and runs them all in ONE fresh QEMU guest with rdma_rxe
# (shared/testbed/rxe-vm.sh), with METAROCE_VERBS_REQUIRE_DEVICE=1 so a missing device
# fails instead of skipping.
#
# Needs what interop/run-rxe.sh needs (root, QEMU, the guest image in $WORK); it installs
# and builds them the same way when missing. Environment: WORK, SHARE, NS, TESTBED as for
# rxe-vm.sh; TESTS (default "rxe generic_verbs"), the integration test files to run.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
if [ -z "${TESTBED:-}" ]; then
    for d in "$ROOT/shared/testbed" "$ROOT/../shared/testbed" /work/shared/testbed; do
        [ -f "$d/rxe-vm.sh" ] && { TESTBED=$(cd "$d" && pwd); break; }
    done
fi
[ -n "${TESTBED:-}" ] || { echo "run-rxe-tests: cannot find shared/testbed/rxe-vm.sh (set TESTBED)" >&2; exit 2; }
VM="$TESTBED/rxe-vm.sh"
export WORK=${WORK:-/tmp/metaroce-rxe-vm}
export SHARE=${SHARE:-$WORK/share}
export TIMEOUT=${TIMEOUT:-400}
TESTS=${TESTS:-"rxe generic_verbs"}
log() { echo "[run-rxe-tests] $*" >&2; }

if ! command -v qemu-system-x86_64 >/dev/null || ! command -v busybox >/dev/null; then
    log "installing QEMU and friends (rxe-vm.sh deps)"
    bash "$VM" deps >"$WORK.deps.log" 2>&1 || { tail -20 "$WORK.deps.log"; exit 1; }
fi
mkdir -p "$WORK" "$SHARE/.bin"
if [ ! -f "$WORK/initrd.cpio" ] || [ ! -f "$WORK/bzImage" ]; then
    log "building the guest image (rxe-vm.sh build)"
    bash "$VM" build >"$WORK/build.log" 2>&1 || { tail -20 "$WORK/build.log"; exit 1; }
fi

job="set -e"
for t in $TESTS; do
    bin=$(cd "$ROOT" && cargo test -q -p metaroce-verbs --test "$t" --no-run --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]==sys.argv[1]: print(m["executable"])' "$t" | tail -1)
    [ -n "$bin" ] || { log "could not build test $t"; exit 1; }
    cp "$bin" "$SHARE/.bin/verbs-$t"
    job="$job
echo \"=== metaroce-verbs --test $t (in the guest)\"
METAROCE_VERBS_REQUIRE_DEVICE=1 RUST_BACKTRACE=1 ./.bin/verbs-$t --test-threads=1"
done
log "running [$TESTS] in a fresh rxe guest"
bash "$VM" run 0 "$job"
