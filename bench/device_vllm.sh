#!/usr/bin/env bash
# Real vLLM 0.33 on the GPU host: stock against VLLM_PLE_BACKEND=shm (issue 33).
# Run from the repository root after the bundle of ../shared/gpu-vllm/README.md:
#
#   T0=$(date +%s); . .gpu-bundle/site.sh && T0=$T0 CELLS=exact-1 bash bench/device_vllm.sh
#
# Send the bundle's first part alone: a call that starts no machine still costs
# device time (about 90 s a refused start), and so does every later call
# refused while none is to be had. A transfer carries 64 MiB with the working
# tree: where the tree and a 60 MiB part pass it, cut the parts smaller (site.sh
# joins /tmp/parts/b.* in name order), e.g.
#   cat .gpu-bundle/b.* > /tmp/all && rm .gpu-bundle/b.* \
#     && split -b 58000000 -d -a 2 /tmp/all .gpu-bundle/b. && rm /tmp/all Once
# the first part has a machine, send the other 25 and this script's call in one
# message, so that the host never idles (it resets after 30 s).
#
# It writes the checkpoints the cells need (bench/real_vllm/checkpoint.py on the GPU,
# kept under $WORK and reused by later calls while the host lives), then runs
# bench/real_vllm/coordinator.py's coordinator: each cell (one engine: LLM.generate or
# vllm serve, with its own ple-server where it uses one) in a process group of
# its own that is ended after the cell, one JSON per cell into $OUT/cells, the
# logs' tails into $OUT/logs, the disk probe into $OUT/run.json, and a summary
# table at the end (also $OUT/summary.txt) over this call's cells and the
# earlier calls' on the same host. Cell names and plans: bench/real_vllm/cells.py;
# `python3 -m bench.real_vllm.coordinator plan --cells LIST --warm` prints a call's
# expected timeline.
#
# Environment (all optional but CELLS):
#   CELLS       cell and plan names, comma-separated (e.g. exact-1, or
#               stock-default,shm-default-direct-large-tp)
#   T0          when the device call began (date +%s before site.sh), so that
#               the install counts against the deadline (default: when this
#               script's parent shell started, i.e. the device command's start)
#   DEADLINE_S  seconds after T0 by which every cell has ended (default 540:
#               the summary is out before a 600 s limit); a cell that would not
#               end in time is skipped, and says so
#   OUT         where the results go (default .)
#   WORK        checkpoints, full logs, the host's history (default /tmp/vllm-real)
#   COMMIT      the commit measured, for the JSONs: pass it (git rev-parse --short HEAD
#               here); the device copy's .git, where it has one, may be an older HEAD
#   PYTHON      the interpreter site.sh set up (default python3)
# Extra arguments go to `bench/real_vllm/coordinator.py run`.
set -euo pipefail

# The deadline counts from the device call's start: T0 if given, else when the
# command's shell (this script's parent, which sourced site.sh) started.
call_start() {
    local btime ticks start
    btime=$(awk '/^btime/ {print $2}' /proc/stat 2>/dev/null) || return 1
    ticks=$(getconf CLK_TCK 2>/dev/null) || return 1
    start=$(sed 's/.*) //' "/proc/$PPID/stat" 2>/dev/null | awk '{print $20}') || return 1
    [ -n "$btime" ] && [ -n "$start" ] && echo $(( btime + start / ticks ))
}
if [ -z "${T0:-}" ]; then
    T0=$(call_start || date +%s)
    # A parent that began long before (a shell kept between commands) is not
    # the call's start: count from now, and say so.
    if [ $(( $(date +%s) - T0 )) -gt 300 ]; then
        echo "device_vllm.sh: the parent shell began $(( $(date +%s) - T0 )) s ago;" \
             "counting the deadline from now (pass T0=\$(date +%s) before site.sh)" >&2
        T0=$(date +%s)
    fi
fi
DEADLINE_S=${DEADLINE_S:-540}
OUT=${OUT:-.}
WORK=${WORK:-/tmp/vllm-real}
PYTHON=${PYTHON:-python3}
CELLS=${CELLS:?"CELLS=<cell and plan names, comma-separated> (bench/real_vllm/cells.py)"}
export COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export TOKENIZERS_PARALLELISM=false

mkdir -p "$OUT" "$WORK/ckpt" "$WORK/logs"
if ! (cd / && "$PYTHON" -c 'import importlib.util as u, pleclient._sync, pleserver._native
assert u.find_spec("vllm") and u.find_spec("openai")') >/dev/null 2>&1; then
    echo "device_vllm.sh: vLLM or pleserver is not importable: source .gpu-bundle/site.sh first" >&2
    exit 2
fi
elapsed() { echo $(( $(date +%s) - T0 )); }
echo "== $(nproc) CPUs, $(awk '/^MemTotal:/ {printf "%d GiB", $2 / 1048576}' /proc/meminfo)," \
     "$(df -Ph "$WORK" | awk 'NR == 2 {print $4 " free under " $6}'), commit $COMMIT," \
     "$(elapsed) s since T0"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader || true

# The checkpoints, each after the one it is the FP8 twin of; a complete one of
# the same arguments is reused.
"$PYTHON" -m bench.real_vllm.coordinator checkpoints --cells "$CELLS" --work "$WORK" >"$WORK/checkpoints.txt"
while read -r name args; do
    t=$(date +%s)
    # shellcheck disable=SC2086  # $args: the script's own arguments, word-split on purpose
    if ! "$PYTHON" -m bench.real_vllm.checkpoint --out "$WORK/ckpt/$name" --device cuda --reuse $args \
            </dev/null >"$WORK/logs/checkpoint-$name.log" 2>&1; then
        tail -20 "$WORK/logs/checkpoint-$name.log" >&2
        echo "device_vllm.sh: checkpoint $name was not written (log above)" >&2
        exit 2
    fi
    # On disk before anything is timed: no disk probe or --io direct read
    # competes with the write-back of a table just written.
    sync -f "$WORK/ckpt/$name/config.json"
    echo "== checkpoint $name: $(( $(date +%s) - t )) s ($(du -sh "$WORK/ckpt/$name" | cut -f1))"
done <"$WORK/checkpoints.txt"

echo "== cells, $(elapsed) s since T0, deadline ${DEADLINE_S} s"
"$PYTHON" -m bench.real_vllm.coordinator run --cells "$CELLS" --work "$WORK" --out "$OUT" \
    --t0 "$T0" --deadline-s "$DEADLINE_S" "$@"
