"""Keep PLE lookups out of piecewise CUDA graphs without user settings.

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
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

log = logging.getLogger("pleclient.vllm_plugin")

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
