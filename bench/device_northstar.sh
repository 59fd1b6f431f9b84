#!/usr/bin/env bash
# bench/evals/northstar.py on the GPU host (no vLLM, no network): builds the native
# modules in place, then runs one part of the matrix. Run from the repository
# root with the trace present: build it where vLLM is (python
# bench/sim/text_trace.py, 34.3 MiB, git-ignored) and carry bench/traces.
#
#   bash bench/device_northstar.sh 1    # decode at ≈ 7 ms (1 000 steps) and prefill: ≈ 7 min
#   bash bench/device_northstar.sh 2    # decode at ≈ 40 ms (250 steps): ≈ 6 min
#   bash bench/device_northstar.sh 1 --batches 32 --paths a,e,d    # a part of a part
#   TRACE=bench/traces/engram-text.npz bash bench/device_northstar.sh 1   # Engram (3 MiB trace)
#
# Environment (all optional):
#   PYTHON      interpreter with torch (CUDA), numpy, msgpack (default python3)
#   TRACE       trace file (default bench/traces/qwen-text.npz)
#   TABLE_DIR   where the table is kept (default build/northstar-table, git-ignored):
#               a later run on the same host reuses it instead of writing it again
#   DEADLINE_S  no path starts that would end later than this many seconds after
#               the benchmark started (default 480: the JSON is written before a
#               10-minute limit, build included)
#   OUT         where northstar-PART.json, northstar-PART.log and build.log go
#               (default .)
# Extra arguments go to bench/evals/northstar.py.
set -euo pipefail

part=${1:?usage: bash bench/device_northstar.sh 1|2|all [arguments for bench/evals/northstar.py]}
shift
PYTHON=${PYTHON:-python3}
TRACE=${TRACE:-bench/traces/qwen-text.npz}
TABLE_DIR=${TABLE_DIR:-build/northstar-table}
DEADLINE_S=${DEADLINE_S:-480}
OUT=${OUT:-.}

if [ ! -f "$TRACE" ]; then
    echo "no trace at $TRACE: build it with python -m bench.sim.text_trace (or engram_trace)" \
         "and carry it" >&2
    exit 2
fi
echo "== build the native modules"
if ! "$PYTHON" setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1; then
    tail -20 "$OUT/build.log" >&2
    echo "the native modules did not build; ple-server needs them" >&2
    exit 2
fi
mkdir -p "$TABLE_DIR"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
echo "== $(nproc) CPUs, $(awk '/^MemTotal:/ {printf "%d GiB", $2 / 1048576}' /proc/meminfo)," \
     "$(df -Ph "$TABLE_DIR" | awk 'NR == 2 {print $4 " free under the table"}')," \
     "$("$PYTHON" -c 'import torch; print("torch", torch.__version__)')"

PYTHONUNBUFFERED=1 "$PYTHON" -m bench.evals.northstar --part "$part" --trace "$TRACE" \
    --table-dir "$TABLE_DIR" --deadline-s "$DEADLINE_S" --json "$OUT/northstar-$part.json" \
    "$@" 2>&1 | tee "$OUT/northstar-$part.log"
