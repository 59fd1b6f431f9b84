"""Keep PLE lookups out of piecewise CUDA graphs, and refuse graphs they cannot run in.

A lookup is host work (a round trip to ple-server), which a captured CUDA graph
cannot contain. Qwen4Exp on CUDA (vLLM 0.33) uses breakable CUDA graphs by
default, and the shm storage's lookup methods are break points, so nothing is
needed there. Where vLLM compiles piecewise graphs instead (the seed-interface
builds; Qwen4Exp on ROCm), the ops that run the lookup must be splitting ops.
``CompilationConfig.set_splitting_ops_for_v1`` fills vLLM's default list; this
adds ``SPLITTING_OPS`` to it whenever the list is non-empty (an empty list, or
a mode without piecewise graphs, stays as it is). An explicit
``-cc.splitting_ops`` list is extended too, so users need not repeat vLLM's
attention ops to add ours.

What each route runs under (``-cc.cudagraph_mode``, as vLLM settles it):

===================  ===========================  ==============================
mode                 GPU-driven route             host route
===================  ===========================  ==============================
NONE                 yes                          yes
PIECEWISE            yes (inside the graphs, or   yes (eager breaks, or between
                     between them as splitting    the pieces as splitting ops)
                     ops)
FULL,                yes (inside the graph)       no: a full graph would hold
FULL_DECODE_ONLY,                                 the host's round trip
FULL_AND_PIECEWISE
===================  ===========================  ==============================

Splitting ops: any list, vLLM's default, an explicit one (extended with
``SPLITTING_OPS``) or ``[]`` (no pieces: vLLM then turns PIECEWISE into NONE
and FULL_AND_PIECEWISE into FULL, judged as above). The refusal comes as early
as the route is known: when vLLM settles its compilation config
(``check_graph_mode``, in the process that builds the config) with
``VLLM_PLE_SHM_GPU_PATH=off``; with ``auto``, when the worker chooses the route
at its first lookup (``routes.Routes``, with ``full_graph_mode``), before any
graph is captured.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from types import ModuleType
from typing import Any

from pleclient.vllm_plugin.errors import UnsupportedCompilation
from pleclient.vllm_plugin.settings import ENV_BACKEND, ENV_GPU_PATH

log = logging.getLogger("pleclient.vllm_plugin")

FULL_GRAPH_MODES = ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
"""``-cc.cudagraph_mode`` values that capture whole steps in one CUDA graph."""

SPLITTING_OPS = (
    "vllm::ple_shm_lookup",  # seed interface (qwen38_flash_next adapter)
    "vllm::qwen4_exp_amd_ple_ngram_embedding",  # Qwen4Exp ROCm lookup ops
    "vllm::qwen4_exp_amd_ple_ngram_embedding_pinned",
)


def patch_compilation_module(module: ModuleType) -> None:
    """``vllm.config.compilation``."""
    cls = module.CompilationConfig
    original = cls.set_splitting_ops_for_v1
    if getattr(original, "_ple_shm_wrapped", False):
        return

    @functools.wraps(original)
    def set_splitting_ops_for_v1(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        check_graph_mode(self)
        ops = self.splitting_ops
        if ops:
            added = [op for op in SPLITTING_OPS if op not in ops]
            ops.extend(added)
            if added:
                log.info(
                    "PLE backend shm: PLE lookups split out of CUDA graphs (%s)", ", ".join(added)
                )
        return result

    set_splitting_ops_for_v1._ple_shm_wrapped = True  # type: ignore[attr-defined]
    cls.set_splitting_ops_for_v1 = set_splitting_ops_for_v1


def check_graph_mode(config: object) -> None:
    """Raise ``UnsupportedCompilation`` when vLLM settled on full CUDA graphs
    and the lookups take the host path for sure (``VLLM_PLE_SHM_GPU_PATH=off``).
    ``config``: vLLM's ``CompilationConfig``, after its splitting ops are set."""
    mode = getattr(getattr(config, "cudagraph_mode", None), "name", None)
    gpu_path = os.environ.get(ENV_GPU_PATH, "").strip().lower() or "auto"
    if mode in FULL_GRAPH_MODES and gpu_path == "off":
        raise full_graphs_refused(mode, f"the host path ({ENV_GPU_PATH}=off)")


def current_compilation_config() -> Any:
    """The compilation config of the vLLM config in effect, or None (outside a
    vLLM run, which has not imported ``vllm.config``: nothing of vLLM is
    imported here)."""
    module = sys.modules.get("vllm.config")  # a vLLM run has imported it
    if module is None:
        return None
    return getattr(module.get_current_vllm_config_or_none(), "compilation_config", None)


def full_graph_mode(compilation: Any = None) -> str | None:
    """The ``-cc.cudagraph_mode`` of ``compilation`` (default: the config in
    effect) when it captures full graphs (one of ``FULL_GRAPH_MODES``), else
    None; None too outside a vLLM run."""
    if compilation is None:
        compilation = current_compilation_config()
    mode = getattr(getattr(compilation, "cudagraph_mode", None), "name", None)
    return mode if mode in FULL_GRAPH_MODES else None


def full_graphs_refused(mode: str, route: str) -> UnsupportedCompilation:
    """The error for full CUDA graphs (``mode``) over host-path lookups."""
    return UnsupportedCompilation(
        f"{ENV_BACKEND}=shm: -cc.cudagraph_mode={mode} captures whole steps in CUDA "
        f"graphs, and PLE lookups on {route} are host work (a round trip to "
        "ple-server per PLE layer), which a CUDA graph cannot hold. Use "
        "-cc.cudagraph_mode=PIECEWISE (the lookups run between the graphs) or NONE "
        f"(or --enforce-eager); or, on a GPU with stream memory operations, "
        f"{ENV_GPU_PATH}=auto, whose GPU-driven lookups full graphs hold"
    )


def breakable_capture_running() -> bool:
    """Whether vLLM's breakable CUDA-graph capture is under way in this thread
    (``BreakableCUDAGraphCapture``): an eager break's call then is the one made
    at capture, before the GPU ran the segment recorded ahead of it, and a
    replay's call comes after the capture ended."""
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

    return BreakableCUDAGraphCapture.current() is not None
