#!/usr/bin/env bash
# What each stage of prompt-ahead buys, on the GPU host: bench/evals/northstar.py's
# cold 4-chunk prefill (PLE layer 1 and 16) with the paths a, e, and the two
# prompt-ahead stages, then prompt-ahead-arrival again with the request waiting
# longer in the queue before it is scheduled (one decode step, about half a
# prompt, about one prompt, about three). Reuses device_northstar.sh (build,
# table, trace); each run's JSON and log go under $OUT/q<ms>/. A first run of
# path a alone writes the table (when it is not there yet), so that no timed
# server path runs while the disk may still be busy with the table's writes.
#
#   OUT=$OUT bash bench/device_prompt_ahead.sh            # ≈ 5 min
#   WAITS="7 150 400" OUT=$OUT bash bench/device_prompt_ahead.sh
set -euo pipefail
OUT=${OUT:-.}
WAITS=${WAITS:-7 150 400 1000}
mkdir -p "$OUT/table"
echo "== the table (and path a alone)"
OUT="$OUT/table" DEADLINE_S=${DEADLINE_S:-200} bash bench/device_northstar.sh 1 \
    --batches '' --prompts 4 --paths a >/dev/null
first=1
for wait in $WAITS; do
    mkdir -p "$OUT/q$wait"
    if [ "$first" = 1 ]; then
        paths=a,prompt-ahead-arrival,prompt-ahead,e
        first=0
    else
        paths=a,prompt-ahead-arrival
    fi
    echo "== queue wait $wait ms: $paths"
    OUT="$OUT/q$wait" DEADLINE_S=${DEADLINE_S:-200} bash bench/device_northstar.sh 1 \
        --batches '' --prompts 4 --paths "$paths" --queue-wait-ms "$wait"
done
