#!/usr/bin/env bash
# metaroce-verbs/run-rxe-perf.sh — metaroce-perf --backend verbs beside perftest in ONE
# rdma_rxe guest, same run: ib_write_bw vs write_bw at 64 KiB, ib_send_lat vs send_lat at
# 64 B (both sides of each on the guest's rxe0, RC loopback), and the ratios.
# Environment: WORK, SHARE, TESTBED as for rxe-vm.sh; BW_ITERS (default 2000), LAT_ITERS
# (default 2000), REPS (default 3: each pair is run REPS times, interleaved; the medians
# are compared); LAYERS (default "raw threads runtime"): send_lat is also run, in each rep,
# with each of these `--verbs-layer`s (the default one, runtimes, is the send_lat above),
# to show what each layer of metaroce-verbs costs; LAYERS="" skips them.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
if [ -z "${TESTBED:-}" ]; then
    for d in "$ROOT/shared/testbed" "$ROOT/../shared/testbed" /work/shared/testbed; do
        [ -f "$d/rxe-vm.sh" ] && { TESTBED=$(cd "$d" && pwd); break; }
    done
fi
VM="$TESTBED/rxe-vm.sh"
export WORK=${WORK:-/tmp/metaroce-rxe-vm}
export SHARE=${SHARE:-$WORK/share}
export TIMEOUT=${TIMEOUT:-500}
BW_ITERS=${BW_ITERS:-2000}
LAT_ITERS=${LAT_ITERS:-2000}
REPS=${REPS:-3}
LAYERS=${LAYERS-raw threads runtime}
(cd "$ROOT" && cargo build --release -q -p metaroce-perf --bin metaroce-perf)
TARGET_DIR=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
mkdir -p "$SHARE"
cp "$TARGET_DIR/release/metaroce-perf" "$SHARE/metaroce-perf"
LOG="$WORK/rxe-perf.log"
bash "$VM" run 0 "
P='./metaroce-perf --backend verbs -d rxe0 -x 1'
for r in \$(seq $REPS); do
  ib_write_bw -d rxe0 -x 1 -s 65536 -n $BW_ITERS --report_gbits > /tmp/s.log 2>&1 & sleep 1
  ib_write_bw -d rxe0 -x 1 -s 65536 -n $BW_ITERS --report_gbits 127.0.0.1 | awk '\$1==65536 {print \"ib_write_bw_gbps=\" \$4}'
  wait
  \$P write_bw -s 65536 -n $BW_ITERS | grep '^write_bw_gbps='
  ib_send_lat -d rxe0 -x 1 -s 64 -n $LAT_ITERS > /tmp/s.log 2>&1 & sleep 1
  ib_send_lat -d rxe0 -x 1 -s 64 -n $LAT_ITERS 127.0.0.1 | awk '\$1==64 {print \"ib_send_lat_typical_usec=\" \$5}'
  wait
  \$P send_lat -s 64 -n $LAT_ITERS | grep '^send_lat_typical_usec='
  for l in $LAYERS; do
    \$P send_lat -s 64 -n $LAT_ITERS --verbs-layer \$l | sed -n \"s/^send_lat_typical_usec=/send_lat_\${l}_usec=/p\"
  done
done
" | tee "$LOG" | grep -E '^(ib_)?(write_bw_gbps|send_lat_typical_usec|send_lat_[a-z]+_usec)=' > "$WORK/rxe-perf.kv" || true
python3 - "$WORK/rxe-perf.kv" <<'PY'
import sys, statistics as st
kv = {}
for line in open(sys.argv[1]):
    k, v = line.strip().split('=')
    kv.setdefault(k, []).append(float(v))
need = ['ib_write_bw_gbps', 'write_bw_gbps', 'ib_send_lat_typical_usec', 'send_lat_typical_usec']
missing = [k for k in need if k not in kv]
if missing:
    print('missing figures:', missing); sys.exit(1)
m = {k: st.median(v) for k, v in kv.items()}
for k in need + sorted(k for k in kv if k not in need):
    print(f'{k:28s} runs {kv[k]} median {m[k]:.4f}')
bw = m['write_bw_gbps'] / m['ib_write_bw_gbps']
lat = m['send_lat_typical_usec'] / m['ib_send_lat_typical_usec']
print(f'write_bw 64 KiB: metaroce-verbs / ib_write_bw = {bw:.3f} (target >= 0.9)')
print(f'send_lat 64 B:   metaroce-verbs / ib_send_lat = {lat:.3f} (target <= 1.2)')
for k in sorted(k for k in m if k.startswith('send_lat_') and k != 'send_lat_typical_usec'):
    print(f'  --verbs-layer {k[9:-5]:9s} / ib_send_lat = {m[k] / m["ib_send_lat_typical_usec"]:.3f}')
PY
