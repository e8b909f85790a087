#!/usr/bin/env bash
# experiments/netns/run.sh — MetaRoCE on a real kernel ECMP network, beside its baselines.
#
# As root:   experiments/netns/run.sh [--reps N] [--only exp1,exp1r,exp2,exp3,exp4] [--tag NAME]
#
# 1. builds metaroce-perf and the exp_stall example (release);
# 2. brings up /work/shared/testbed/netns-ecmp.sh: namespaces ${PFX}a ==LINKS== ${PFX}r
#    ==LINKS== ${PFX}b, ECMP on the UDP/TCP 5-tuple, a tbf of RATE on every R egress link;
# 3. turns TSO/GSO off on A's and B's veths, so TCP (iperf3) crosses R as wire-sized
#    packets, like MetaRoCE's UDP (netns-ecmp.sh already turns UDP segmentation off);
# 4. runs experiments.py: [1] goodput vs paths, [2] random loss (MetaRoCE, TCP, RoCEv2 mode
#    if metaroce-perf has it), [3] link failure mid-transfer (exp_stall), [4] random CE marks;
#    (--only exp1r: paths 1 vs paths 8 with ECMP collision handling off and on, interleaved);
#    every measurement REPS times, median reported;
# 5. tears the testbed down (also on error / Ctrl-C).
#
# Writes experiments/netns/results.json (every run + summary) and raw/ (tool outputs), and
# prints the tables.  Plots: python3 experiments/plot_results.py.
#
# Environment: PFX=xp- (namespace prefix; not tb- so that it cannot collide with another
# user of the testbed), LINKS=4, RATE=200mbit, MTU=9000 (jumbo veths so that MetaRoCE's
# 4096-byte path MTU is not IP-fragmented; MTU=1500 switches the transport to pmtu 1024),
# TESTBED=/work/shared/testbed/netns-ecmp.sh.
# Needs: nftables ethtool iperf3 iputils-ping (apt-get install), python3, cargo.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
export TESTBED=${TESTBED:-/work/shared/testbed/netns-ecmp.sh}
export PFX=${PFX:-xp-} LINKS=${LINKS:-4} RATE=${RATE:-200mbit} MTU=${MTU:-9000}

[ "$(id -u)" = 0 ] || { echo "run.sh: needs root (network namespaces)" >&2; exit 1; }
for t in nft ethtool iperf3 ping tc ip python3 cargo; do
  command -v "$t" >/dev/null || {
    echo "run.sh: '$t' missing (apt-get install nftables ethtool iperf3 iputils-ping)" >&2
    exit 1
  }
done

echo "== build" >&2
if ! (cd "$ROOT" && cargo build --release -q -p metaroce-perf --bin metaroce-perf && cargo build --release -q -p metaroce-examples --example exp_stall); then
  if [ -x "$ROOT/target/release/metaroce-perf" ] && [ -x "$ROOT/target/release/examples/exp_stall" ]; then
    echo "run.sh: WARNING: build failed; using the binaries already in target/release" >&2
  else
    exit 1
  fi
fi

echo "== testbed: PFX=$PFX LINKS=$LINKS RATE=$RATE MTU=$MTU" >&2
"$TESTBED" down >/dev/null 2>&1 || true
trap '"$TESTBED" down >&2 || true' EXIT
"$TESTBED" up >&2
for ns in "${PFX}a" "${PFX}b"; do
  for ((i = 0; i < LINKS; i++)); do
    ip netns exec "$ns" ethtool -K "to_r$i" tso off gso off >/dev/null
  done
done

echo "== load before: $(cat /proc/loadavg)" >&2
python3 "$HERE/experiments.py" "$@"
echo "== load after: $(cat /proc/loadavg)" >&2
