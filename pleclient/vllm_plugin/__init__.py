"""vLLM plugin: ``VLLM_PLE_BACKEND=shm`` makes the PLE embedding a ple-server client.

Installed with pleserver as the ``vllm.general_plugins`` entry point
``pleserver_shm = pleclient.vllm_plugin:register``. With ``VLLM_PLE_BACKEND``
unset (or ``vllm``) it does nothing at all. With ``shm``:

* ``qwen4_exp``          — vLLM 0.33 Qwen4Exp (NVIDIA and AMD): the n-gram
  embedding's storage becomes ``storage.Qwen4ExpPLEShmEmbedding``;
* ``qwen38_flash_next``  — the seed interface ``Qwen3_8FlashNextNGramEmbedding``
  of qwen38-flash-next vLLM builds, with the custom op ``vllm::ple_shm_lookup``;
* ``loader``             — vLLM's loader never reads the shard tensors;
* ``rows``               — the worker's ple-server session and its reconnects;
  ``routes`` — how a layer's lookups reach it (host or GPU-driven);
  ``lookups`` — one layer's lookups; ``step`` — all of them start with the
  step; ``identity`` — server vs checkpoint check;
* ``prompt_ahead``       — the engine core's scheduler hints every prompt's
  rows to the server when the request arrives and when it is scheduled;
* ``settings``           — every environment knob, with defaults; ``register``
  declares them to vLLM's environment check;
* ``compat``             — the vLLM versions it supports, and the checks that
  stop ``shm`` on a vLLM whose classes it cannot patch;
* ``compilation``        — the lookup ops as splitting ops, and the CUDA-graph
  modes each route runs under (the others stop vLLM at start).
"""

from pleclient.vllm_plugin.errors import (
    IdentityMismatch,
    PleBackendError,
    UnsupportedCompilation,
    UnsupportedVllm,
)
from pleclient.vllm_plugin.registration import register
from pleclient.vllm_plugin.settings import SettingsError

__all__ = [
    "register",
    "PleBackendError",
    "IdentityMismatch",
    "SettingsError",
    "UnsupportedCompilation",
    "UnsupportedVllm",
]
