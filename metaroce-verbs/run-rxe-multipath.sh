#!/usr/bin/env bash
# metaroce-verbs/run-rxe-multipath.sh — the K-QP multipath tests on rdma_rxe, in ONE fresh
# QEMU guest (shared/testbed/rxe-vm.sh) on the netns link:
#   * tests/rxe_multipath.rs in the guest (METAROCE_VERBS_REQUIRE_DEVICE=1): K = 4 over rxe
#     loopback, a QP forced to ERR mid-transfer, and a K = 4 connection to the host;
#   * the host end of that last test: examples/mp_rc_peer.rs (metaroce's software RoCEv2 RC
#     QPs on raw sockets at 10.77.0.1 in the netns);
#   * tcpdump on the host side of the tap (the netns bridge) during the run; the capture
#     must show exactly K = 4 distinct UDP source ports from the guest to port 4791, i.e.
#     one connection spread over 4 ECMP flows.
# Needs root (netns, raw sockets). Environment as rxe-vm.sh: WORK, SHARE, NS, BR, TESTBED.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
if [ -z "${TESTBED:-}" ]; then
    for d in "$ROOT/shared/testbed" "$ROOT/../shared/testbed" /work/shared/testbed; do
        [ -f "$d/rxe-vm.sh" ] && { TESTBED=$(cd "$d" && pwd); break; }
    done
fi
[ -n "${TESTBED:-}" ] || { echo "run-rxe-multipath: cannot find shared/testbed/rxe-vm.sh (set TESTBED)" >&2; exit 2; }
VM="$TESTBED/rxe-vm.sh"
export WORK=${WORK:-/tmp/metaroce-rxe-vm}
export SHARE=${SHARE:-$WORK/share}
export NS=${NS:-vm-tb}
export BR=${BR:-br-vm}
export TIMEOUT=${TIMEOUT:-400}
K=4
log() { echo "[run-rxe-multipath] $*" >&2; }
[ "$(id -u)" = 0 ] || { log "needs root (netns, raw sockets)"; exit 2; }
command -v tcpdump >/dev/null || { log "tcpdump missing (rxe-vm.sh deps installs it)"; exit 2; }
mkdir -p "$WORK" "$SHARE/.bin"
if [ ! -f "$WORK/initrd.cpio" ] || [ ! -f "$WORK/bzImage" ]; then
    log "building the guest image (rxe-vm.sh build)"
    bash "$VM" build >"$WORK/build.log" 2>&1 || { tail -20 "$WORK/build.log"; exit 1; }
fi
ip netns exec "$NS" true 2>/dev/null && ip -n "$NS" link show tap-vm0 >/dev/null 2>&1 \
    || bash "$VM" net-up 1 >/dev/null 2>&1

artifact() {  # cargo args... -> the executable it builds
    (cd "$ROOT" && cargo build -q "$@" --message-format=json 2>/dev/null) | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable"): print(m["executable"])' | tail -1
}
log "building tests/rxe_multipath.rs and examples/mp_rc_peer.rs"
(cd "$ROOT" && cargo build -q -p metaroce-verbs --example mp_rc_peer)
TEST=$(cd "$ROOT" && cargo test -q -p metaroce-verbs --test rxe_multipath --no-run --message-format=json 2>/dev/null | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable"): print(m["executable"])' | tail -1)
PEER=$(artifact -p metaroce-verbs --example mp_rc_peer)
[ -n "$TEST" ] && [ -n "$PEER" ] || { log "build failed"; exit 1; }
cp "$TEST" "$SHARE/.bin/verbs-rxe_multipath"

PCAP="$WORK/multipath.pcap"; rm -f "$PCAP" "$SHARE/mp-region"
ip netns exec "$NS" tcpdump -i "$BR" -n -U -s 128 -w "$PCAP" udp port 4791 >"$WORK/tcpdump.log" 2>&1 &
TD=$!
ip netns exec "$NS" timeout 300 "$PEER" 10.77.0.1 10.77.0.1:18600 $((1 << 20)) "$SHARE/mp-region" >"$WORK/mp-peer.log" 2>&1 &
PP=$!
cleanup() { kill "$TD" 2>/dev/null || true; kill "$PP" 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq 50); do [ -s "$SHARE/mp-region" ] && break; sleep 0.1; done
sleep 1  # tcpdump attaches
rc=0
bash "$VM" run 0 "METAROCE_VERBS_REQUIRE_DEVICE=1 METAROCE_MP_PEER=10.77.0.1:18600 METAROCE_MP_REGION=/mnt/host/mp-region RUST_BACKTRACE=1 ./.bin/verbs-rxe_multipath --test-threads=1 --nocapture" \
    | tee "$WORK/multipath-guest.log" || rc=$?
wait "$PP" || { log "mp_rc_peer failed:"; tail -5 "$WORK/mp-peer.log" >&2; rc=1; }
sleep 1; kill -INT "$TD" 2>/dev/null || true; wait "$TD" 2>/dev/null || true
trap - EXIT
# Source ports of the guest's packets towards RoCEv2's port: one per QP of the connection.
PORTS=$(tcpdump -r "$PCAP" -n 'src host 10.77.0.2 and udp dst port 4791' 2>/dev/null \
    | sed -n 's/.* 10\.77\.0\.2\.\([0-9]*\) > 10\.77\.0\.1\.4791:.*/\1/p' | sort -un | tr '\n' ' ')
HPORTS=$(tcpdump -r "$PCAP" -n 'src host 10.77.0.1 and udp dst port 4791' 2>/dev/null \
    | sed -n 's/.* 10\.77\.0\.1\.\([0-9]*\) > 10\.77\.0\.2\.4791:.*/\1/p' | sort -un | tr '\n' ' ')
NPKT=$(tcpdump -r "$PCAP" -n 'src host 10.77.0.2' 2>/dev/null | wc -l)
EXPECT=$(sed -n 's/.*MP-PORTS //p' "$WORK/multipath-guest.log" | tr -d '\r' | tr ' ' '\n' | sort -un | tr '\n' ' ')
log "capture: $NPKT packets from the guest; guest source ports: $PORTS(expected $EXPECT); host source ports: $HPORTS"
n=$(echo $PORTS | wc -w)
if [ "$n" != "$K" ]; then log "FAIL: $n distinct guest source ports, want $K"; rc=1; fi
if [ "$PORTS" != "$EXPECT" ]; then log "FAIL: captured ports differ from rdma_get_udp_sport's"; rc=1; fi
[ $rc = 0 ] && log "PASS: one connection, $K QPs, $K UDP source ports"
exit $rc
