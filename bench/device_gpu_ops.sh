#!/usr/bin/env bash
# The GPU-driven route's two ways of ringing and collecting, on a GPU host
# without vLLM or network (torch with CUDA is enough): the driver's stream
# memory operations against pleclient/gpu_kernels.py's two kernels.
#
#   bash bench/device_gpu_ops.sh            # 96 s on an H100
#   REPS=3 DECODE_ARGS="--rows 400000 --parts 4 --batches 1,32 --paths a,e --prefill 0 \
#       --timed-steps 200" bash bench/device_gpu_ops.sh   # a spread: ≈ 4 min
#
# 1. bench/gpu/channel_check.py --gpu-ops kernels: rows bit-exact eagerly and
#    in 200 graph replays, no host sync, an error answer fails the step, a
#    killed server's wait ends, hints from a graph (its watchdog case waits
#    out the reconnect window: about 35 s);
# 2. bench/gpu/decode.py, paths a (the GPU-resident table) and e (every PLE
#    layer's lookup rung at the step's start, the plugin's order), once with
#    each --gpu-ops: e / a of each is what the route's operations cost a step.
#
# Environment (all optional): PYTHON (default python3); OUT, where the logs and
# JSONs go (default .; decode's under OUT/kernels and OUT/memops, or
# OUT/<rep>-<ops> with REPS); DECODE_ARGS, bench/gpu/decode.py's arguments
# besides --gpu-ops and --json; REPS, decode's runs of each way, interleaved
# and each one starting with the other way (default 1; 3 for a spread: a run
# takes about 25 s on an H100 with --timed-steps 200).
set -uo pipefail
PYTHON=${PYTHON:-python3}
OUT=${OUT:-.}
DECODE_ARGS=${DECODE_ARGS:---rows 400000 --parts 4 --batches 1,32 --paths a,e --prefill 0 --timed-steps 50}
REPS=${REPS:-1}

status=0
for rep in $(seq 1 "$REPS"); do
    order="kernels memops"
    [ $((rep % 2)) -eq 0 ] && order="memops kernels"
    for ops in $order; do
        run=$ops
        [ "$REPS" -gt 1 ] && run=$rep-$ops
        # device_gpu_decode.sh builds the native modules (in place: once) and
        # prints the machine, then runs bench/gpu/decode.py.
        mkdir -p "$OUT/$run"
        # shellcheck disable=SC2086  # DECODE_ARGS: words on purpose
        OUT="$OUT/$run" PYTHON="$PYTHON" bash "$(dirname "$0")/device_gpu_decode.sh" \
            $DECODE_ARGS --gpu-ops "$ops" >"$OUT/gpu-decode-$run.log" 2>&1 || status=1
        echo "== $run"
        grep -E '^\| [0-9]+ \|' "$OUT/gpu-decode-$run.log" || tail -16 "$OUT/gpu-decode-$run.log"
    done
done
echo "== bench/gpu/channel_check.py --gpu-ops kernels"
PYTHONUNBUFFERED=1 "$PYTHON" -m bench.gpu.channel_check --gpu-ops kernels \
    --json "$OUT/channel-check-kernels.json" >"$OUT/channel-check-kernels.log" 2>&1 || status=1
tail -30 "$OUT/channel-check-kernels.log"
exit $status
