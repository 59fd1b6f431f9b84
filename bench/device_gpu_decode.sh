#!/usr/bin/env bash
# bench/gpu/decode.py on a GPU host without vLLM or network: builds the native
# modules in place, then runs the benchmark. Run from the repository root.
#
#   bash bench/device_gpu_decode.sh                           # the default run
#   bash bench/device_gpu_decode.sh --batches 32 --paths a,b,d --steps 500
#
# Environment (all optional):
#   PYTHON   interpreter with torch (CUDA), numpy, msgpack (default python3)
#   OUT      where gpu-decode.json, gpu-decode.log and build.log go (default .)
# Extra arguments go to bench/gpu/decode.py.
set -euo pipefail

PYTHON=${PYTHON:-python3}
OUT=${OUT:-.}

echo "== build the native modules"
if ! "$PYTHON" setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1; then
    tail -20 "$OUT/build.log" >&2
    echo "the native modules did not build; ple-server needs them" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
echo "== $(nproc) CPUs, $("$PYTHON" -c 'import torch; print("torch", torch.__version__)')"

PYTHONUNBUFFERED=1 "$PYTHON" -m bench.gpu.decode --json "$OUT/gpu-decode.json" "$@" 2>&1 \
    | tee "$OUT/gpu-decode.log"
