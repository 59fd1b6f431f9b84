#!/usr/bin/env bash
# bench/evals/cold.py on a host without vLLM or network (the GPU host): builds the
# native module in place, holds memory as the model would, and runs every
# contender on the prebuilt trace. Run from the repository root, with the trace
# file present (build it elsewhere: python -m bench.sim.text_trace).
#
#   bash bench/device_cold.sh                # defaults below
#   LEFT_GIB=16 bash bench/device_cold.sh --decode-steps 500
#   HOLD_GIB=1 bash bench/device_cold.sh --table-gib 2   # a small trial
#
# Environment (all optional):
#   PYTHON     interpreter with numpy, msgpack, prometheus_client (default python3)
#   TRACE      trace file (default bench/traces/qwen-text.npz)
#   LEFT_GIB   memory left to the server and the page cache after the holder takes
#              the rest (default 20); the table is twice that
#   HOLD_GIB   memory to hold instead (overrides LEFT_GIB)
#   DIR        where the temporary table goes (default $TMPDIR or /tmp)
#   OUT        where cold-device.json and cold-device.log go (default .)
# Extra arguments go to bench/evals/cold.py.
set -euo pipefail

PYTHON=${PYTHON:-python3}
TRACE=${TRACE:-bench/traces/qwen-text.npz}
LEFT_GIB=${LEFT_GIB:-20}
DIR=${DIR:-${TMPDIR:-/tmp}}
OUT=${OUT:-.}

if [ ! -f "$TRACE" ]; then
    echo "no trace at $TRACE: build it with python -m bench.sim.text_trace and carry it" >&2
    exit 2
fi

echo "== build the native module"
if ! "$PYTHON" setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1; then
    tail -20 "$OUT/build.log" >&2
    echo "native module did not build: running mmap and seed only" >&2
    set -- --contenders mmap,seed "$@"
fi

total_gib=$(awk '/^MemTotal:/ {printf "%d", $2 / 1048576}' /proc/meminfo)
avail_gib=$(awk '/^MemAvailable:/ {printf "%d", $2 / 1048576}' /proc/meminfo)
hold_gib=${HOLD_GIB:-$((avail_gib - LEFT_GIB))}
awk -v h="$hold_gib" 'BEGIN { exit !(h > 0) }' || hold_gib=0
disk_gib=$(df -Pk "$DIR" | awk 'NR == 2 {printf "%d", $4 / 1048576}')
echo "== memory ${total_gib} GiB (${avail_gib} available), holding ${hold_gib} GiB;" \
     "disk free under $DIR: ${disk_gib} GiB; $(nproc) CPUs"

PYTHONUNBUFFERED=1 "$PYTHON" -m bench.evals.cold --trace "$TRACE" --dir "$DIR" \
    --hold-gib "$hold_gib" --json "$OUT/cold-device.json" "$@" 2>&1 | tee "$OUT/cold-device.log"
