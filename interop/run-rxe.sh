#!/usr/bin/env bash
# interop/run-rxe.sh — metaroce's RoCEv2 mode against Linux soft-RoCE (rdma_rxe) in a QEMU
# guest: ibv_rc_pingpong both ways and RDMA WRITE/READ/FETCH_ADD both ways (rdma_rw.c), and
# ibv_rc_pingpong both ways against an RC QP hosted on a MetaRoCE endpoint (--unified), and
# metaroce-verbs (examples/verbs_rc_pingpong) against ibv_rc_pingpong and against the host's
# metaroce RoCEv2 mode (cases 9-12).
#
# Runs as root on a fresh Debian bookworm machine: installs its own dependencies
# (rxe-vm.sh deps, libibverbs-dev, gcc), builds the guest image once, brings up the netns
# link, builds metaroce-rc-pingpong (release) and rdma_rw, runs every case, prints a table
# and exits non-zero if any case failed. A few minutes (each case boots a fresh guest, ~10 s).
#
# Environment: ITERS (pingpong iterations, default 500), RW_ITERS (default 200),
# TESTBED (dir of rxe-vm.sh; default: shared/testbed beside the repository),
# WORK (guest build dir, default /tmp/metaroce-rxe-vm), LOGDIR (default $WORK/interop-logs),
# CASES (space-separated case numbers to run, default all), MD=1 (print the table as
# Markdown for docs/INTEROP.md).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
if [ -z "${TESTBED:-}" ]; then
    for d in "$ROOT/shared/testbed" "$ROOT/../shared/testbed" /work/shared/testbed; do
        [ -f "$d/rxe-vm.sh" ] && { TESTBED=$(cd "$d" && pwd); break; }
    done
fi
[ -n "${TESTBED:-}" ] || { echo "run-rxe: cannot find shared/testbed/rxe-vm.sh (set TESTBED)" >&2; exit 2; }
VM="$TESTBED/rxe-vm.sh"
export WORK=${WORK:-/tmp/metaroce-rxe-vm}
export SHARE=${SHARE:-$WORK/share}
export TIMEOUT=${TIMEOUT:-150}
NS=${NS:-vm-tb}
ITERS=${ITERS:-500}
RW_ITERS=${RW_ITERS:-200}
LOGDIR=${LOGDIR:-$WORK/interop-logs}
HOST_IP=10.77.0.1
GUEST_IP=10.77.0.2

log() { echo "[run-rxe] $*" >&2; }

[ "$(id -u)" = 0 ] || { echo "run-rxe: needs root (netns, tap, raw sockets)" >&2; exit 2; }

# --- dependencies ------------------------------------------------------------------
if ! command -v qemu-system-x86_64 >/dev/null || ! command -v busybox >/dev/null; then
    log "installing QEMU and friends (rxe-vm.sh deps)"
    bash "$VM" deps >"$WORK.deps.log" 2>&1 || { tail -20 "$WORK.deps.log"; exit 1; }
fi
if [ ! -f /usr/include/infiniband/verbs.h ] || ! command -v gcc >/dev/null; then
    log "installing libibverbs-dev gcc"
    apt-get update -qq >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs-dev gcc libc6-dev >/dev/null
fi
mkdir -p "$WORK" "$SHARE" "$LOGDIR"
if [ ! -f "$WORK/initrd.cpio" ] || [ ! -f "$WORK/bzImage" ]; then
    log "building the guest image (rxe-vm.sh build)"
    bash "$VM" build >"$LOGDIR/build.log" 2>&1 || { tail -20 "$LOGDIR/build.log"; exit 1; }
fi
ip netns exec "$NS" true 2>/dev/null && ip -n "$NS" link show tap-vm0 >/dev/null 2>&1 \
    || bash "$VM" net-up 1 >/dev/null 2>&1

# --- binaries ------------------------------------------------------------------------
log "building metaroce-rc-pingpong and rdma_rw"
(cd "$ROOT" && cargo build --release -q -p metaroce-perf --bin metaroce-rc-pingpong)
TARGET_DIR=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps 2>/dev/null \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])' 2>/dev/null \
    || echo "$ROOT/target")
PP="$TARGET_DIR/release/metaroce-rc-pingpong"
gcc -O2 -Wall -o "$SHARE/rdma_rw" "$HERE/rdma_rw.c" -libverbs
# metaroce-verbs' ibv_rc_pingpong (libibverbs in the guest, dlopened): copied into the share.
(cd "$ROOT" && cargo build --release -q -p metaroce-verbs --example verbs_rc_pingpong)
cp "$TARGET_DIR/release/examples/verbs_rc_pingpong" "$SHARE/verbs_rc_pingpong"

# --- cases ---------------------------------------------------------------------------
# run_case N "direction" "operation" SIZE ITERS server(host|guest) "host cmd" "guest cmd"
declare -a ROWS=()
FAILED=0

usec_of() {  # pull a per-iteration latency out of a log
    grep -Eo '[0-9.]+ usec/iter|= [0-9]+ us/iter' "$1" | head -1 | grep -Eo '[0-9.]+' || echo "-"
}

run_case() {
    local n=$1 dir=$2 op=$3 size=$4 iters=$5 server=$6 hcmd=$7 gcmd=$8
    if [ -n "${CASES:-}" ] && ! [[ " $CASES " == *" $n "* ]]; then return 0; fi
    local hl="$LOGDIR/case$n.host.log" gl="$LOGDIR/case$n.guest.log" hrc=0 grc=0 t0 t1
    log "case $n: $dir $op ${size} B x $iters"
    t0=$(date +%s)
    if [ "$server" = host ]; then
        ip netns exec "$NS" timeout 140 $hcmd >"$hl" 2>&1 &
        local hp=$!
        sleep 0.3
        bash "$VM" run 0 "$gcmd" >"$gl" 2>&1 || grc=$?
        wait $hp || hrc=$?
    else
        bash "$VM" run 0 "$gcmd" >"$gl" 2>&1 &
        local gp=$!
        ip netns exec "$NS" timeout 140 $hcmd >"$hl" 2>&1 || hrc=$?
        wait $gp || grc=$?
    fi
    t1=$(date +%s)
    local res=PASS
    if [ $hrc != 0 ] || [ $grc != 0 ]; then res="FAIL (host rc $hrc, guest rc $grc)"; FAILED=1; fi
    local gus hus
    gus=$(usec_of "$gl"); hus=$(usec_of "$hl")
    ROWS+=("$n|$dir|$op|$size|$iters|$res|$gus|$hus|$((t1 - t0))")
    if [ "$res" != PASS ]; then
        log "case $n failed; host log:"; tail -15 "$hl" >&2
        log "guest log:"; tail -15 "$gl" >&2
    fi
}

G="ibv_rc_pingpong -d rxe0 -g 1"
run_case 1 "guest client -> host server" "SEND ping-pong (ibv_rc_pingpong)" 64 "$ITERS" host \
    "$PP -s 64 -n $ITERS" "$G -s 64 -n $ITERS $HOST_IP"
run_case 2 "guest client -> host server" "SEND ping-pong (ibv_rc_pingpong)" 4096 "$ITERS" host \
    "$PP -s 4096 -n $ITERS" "$G -s 4096 -n $ITERS $HOST_IP"
run_case 3 "host client -> guest server" "SEND ping-pong (ibv_rc_pingpong)" 64 "$ITERS" guest \
    "$PP -s 64 -n $ITERS $GUEST_IP" "$G -s 64 -n $ITERS"
run_case 4 "host client -> guest server" "SEND ping-pong (ibv_rc_pingpong)" 4096 "$ITERS" guest \
    "$PP -s 4096 -n $ITERS $GUEST_IP" "$G -s 4096 -n $ITERS"
run_case 5 "guest client (active first) <-> host server" "WRITE+READ+FETCH_ADD each way (rdma_rw)" 4096 "$RW_ITERS" host \
    "$PP --rw -s 4096 -n $RW_ITERS" "/mnt/host/rdma_rw -d rxe0 -g 1 -s 4096 -n $RW_ITERS $HOST_IP"
run_case 6 "host client (active first) <-> guest server" "WRITE+READ+FETCH_ADD each way (rdma_rw)" 65536 50 guest \
    "$PP --rw -s 65536 -n 50 $GUEST_IP" "/mnt/host/rdma_rw -d rxe0 -g 1 -s 65536 -n 50"
# The same ping-pong with the host QP on a MetaRoCE endpoint (RoCEv2 selected per QP,
# raw-IP backend attached to the endpoint: metaroce_tokio::Endpoint::with_rocev2).
run_case 7 "guest client -> host server (QP on a MetaRoCE endpoint)" "SEND ping-pong (ibv_rc_pingpong)" 4096 "$ITERS" host \
    "$PP --unified -s 4096 -n $ITERS" "$G -s 4096 -n $ITERS $HOST_IP"
run_case 8 "host client (QP on a MetaRoCE endpoint) -> guest server" "SEND ping-pong (ibv_rc_pingpong)" 64 "$ITERS" guest \
    "$PP --unified -s 64 -n $ITERS $GUEST_IP" "$G -s 64 -n $ITERS"
# metaroce-verbs (RcQp on the guest's rxe0 through libibverbs) against the stock tool, both
# roles in one guest over rxe loopback, and against metaroce's native RoCEv2 RC QP on the host.
V="/mnt/host/verbs_rc_pingpong -d rxe0 -g 1"
run_case 9 "guest: metaroce-verbs client -> ibv_rc_pingpong server" "SEND ping-pong (metaroce-verbs vs stock)" 4096 "$ITERS" host \
    "true" "$G -s 4096 -n $ITERS > /tmp/srv.log 2>&1 & sleep 1; $V -s 4096 -n $ITERS 127.0.0.1 && wait \$! && cat /tmp/srv.log"
run_case 10 "guest: ibv_rc_pingpong client -> metaroce-verbs server" "SEND ping-pong (stock vs metaroce-verbs)" 64 "$ITERS" host \
    "true" "$V -s 64 -n $ITERS > /tmp/srv.log 2>&1 & sleep 1; $G -s 64 -n $ITERS 127.0.0.1 && wait \$! && cat /tmp/srv.log"
run_case 11 "guest metaroce-verbs client -> host server (metaroce RoCEv2 RC)" "SEND ping-pong (metaroce-verbs vs metaroce-rc-pingpong)" 4096 "$ITERS" host \
    "$PP -s 4096 -n $ITERS" "$V -s 4096 -n $ITERS $HOST_IP"
run_case 12 "host client (metaroce RoCEv2 RC) -> guest metaroce-verbs server" "SEND ping-pong (metaroce-rc-pingpong vs metaroce-verbs)" 64 "$ITERS" guest \
    "$PP -s 64 -n $ITERS $GUEST_IP" "$V -s 64 -n $ITERS"

# --- report --------------------------------------------------------------------------
echo
if [ "${MD:-0}" = 1 ]; then
    echo "| # | direction | operation | size (B) | iterations | result | guest us/iter | host us/iter | wall s |"
    echo "|---|---|---|---|---|---|---|---|---|"
    for r in "${ROWS[@]}"; do echo "| ${r//|/ | } |"; done
else
    printf '%-2s %-45s %-42s %6s %5s %-6s %9s %9s %5s\n' '#' direction operation size iters result 'guest-us' 'host-us' wall
    for r in "${ROWS[@]}"; do
        IFS='|' read -r a b c d e f g h i <<<"$r"
        printf '%-2s %-45s %-42s %6s %5s %-6s %9s %9s %5s\n' "$a" "$b" "$c" "$d" "$e" "$f" "$g" "$h" "$i"
    done
fi
pass=0; fail=0
for r in "${ROWS[@]}"; do [[ "$r" == *"|PASS|"* ]] && pass=$((pass+1)) || fail=$((fail+1)); done
echo "logs: $LOGDIR"
echo "$pass passed, $fail failed"
exit $FAILED
