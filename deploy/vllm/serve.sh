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
PYTHON=${PYTHON:-python3}   # vLLM's Python (pleserver is installed there)
HERE=$(cd "$(dirname "$0")" && pwd)

set -a
# shellcheck source=ple-shm.env
. "$HERE/ple-shm.env"
set +a

# Fail here, in the plugin's own words, rather than in every worker: the server
# the workers will use must answer (VLLM_PLE_SHM_SOCKET if set, else the one in
# the socket directory that serves this checkpoint, found as the workers find
# it). A --model that is no local directory is checked by the workers only.
CHECKPOINT=${VLLM_PLE_SHM_CHECKPOINT:-$MODEL}
if [ -d "$CHECKPOINT" ]; then
    SOCKET=$("$PYTHON" - "$CHECKPOINT" <<'PY'
import sys

from pleclient import PleClient, PleError
from pleclient.vllm_plugin import PleBackendError, SettingsError
from pleclient.vllm_plugin.discovery import find_socket
from pleclient.vllm_plugin.settings import ShmSettings

try:
    s = ShmSettings.from_env()
    if s.socket:
        PleClient.query_tables(s.socket, timeout=s.connect_timeout)
        print(s.socket)
    else:
        print(find_socket(sys.argv[1], s.socket_dir, s.connect_timeout))
except (PleError, PleBackendError, SettingsError) as exc:
    sys.exit(f"serve.sh: {exc}")
PY
    ) || exit 1
    echo "PLE rows for $CHECKPOINT from ple-server at $SOCKET" >&2
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
