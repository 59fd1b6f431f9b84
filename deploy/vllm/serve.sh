#!/usr/bin/env bash
# vLLM 0.33 serving Qwen3.8-Flash-Next (architecture Qwen4Exp) with its PLE
# tables served by the host's ple-server instead of held by vLLM.
#
# Before: ple-server runs on this host over the same checkpoint
# (deploy/README.md), and pleserver is installed in vLLM's Python environment
# (`pip install pleserver`, or the container of deploy/container/).
#
#   MODEL=/models/Qwen3.8-Flash-Next TP=1 deploy/vllm/serve.sh [more vllm serve flags]
#
# docs/VLLM.md explains every setting.
set -euo pipefail

MODEL=${MODEL:-/models/Qwen3.8-Flash-Next}
TP=${TP:-1}
HERE=$(cd "$(dirname "$0")" && pwd)

set -a
# shellcheck source=ple-shm.env
. "$HERE/ple-shm.env"
set +a

# Fail here, with the service's own words, rather than in every worker.
if ! pleserver stats --socket "$VLLM_PLE_SHM_SOCKET" >/dev/null; then
    echo "no ple-server on $VLLM_PLE_SHM_SOCKET: systemctl start ple-server" >&2
    exit 1
fi

# CUDA graphs: Qwen4Exp on CUDA runs breakable CUDA graphs by default in vLLM
# 0.33 (VLLM_USE_BREAKABLE_CUDAGRAPH is switched on for it); the PLE lookups are
# break points, so keep that default and do not ask for FULL graphs. Where vLLM
# compiles piecewise graphs instead (ROCm, the qwen38-flash-next builds), the
# plugin adds its lookup ops to the splitting ops by itself.
#
# --engram-config: with VLLM_PLE_BACKEND=shm vLLM allocates no PLE table, so
# cpu_offload / dp_shared_memory have no effect on the PLE layers.
exec vllm serve "$MODEL" \
    --tensor-parallel-size "$TP" \
    "$@"
