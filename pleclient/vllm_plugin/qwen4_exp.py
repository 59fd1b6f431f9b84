"""Qwen4Exp adapter (vLLM 0.33 ``vllm.models.qwen4_exp``, NVIDIA and AMD).

``Qwen4ExpNGramEmbedding`` is patched in place (no vLLM file changes):

* ``__init__`` runs the stock constructor — hashing buffers, quantization
  method, prefetch buffers — with the module's storage classes
  (``Qwen4ExpPLEDeviceEmbedding``, ``Qwen4ExpPLEPinnedHostEmbedding``) standing
  in for ``Qwen4ExpPLEShmEmbedding`` for the duration of the call, so nothing
  table-sized is allocated. A storage of any other class fails the build
  (``UnsupportedVllm``: this vLLM picks its storage in a way the plugin does
  not patch). Then: no SP reduce-scatter (every rank holds full
  rows; summing TP copies would multiply them by the TP size), and the storage
  binds to its ple-server table (connect, identity check) — startup fails here
  if the server is missing or serves another checkpoint.
* ``load_weights`` drops ``ngram_embedding.shard_<i>.weight`` tensors and
  NVFP4's ``shard_<i>.weight_scale`` block scales (served by ple-server;
  normally the loader never reads them, see ``loader``) and hands the rest —
  hash buffers, the FP8 ``weight_scale``, NVFP4's ``weight_scale_2`` — to the
  stock code.

``forward``, ``start_prefetch`` and ``compute_ngram_ids`` stay stock: they call
the storage, which now asks the server.

``Qwen4ExpModel`` (NVIDIA) starts every PLE layer's lookup with the step
(``step``): its ``__init__`` stamps the layers of the rank's range once they
are built, and its ``_start_layer_ple_prefetch`` becomes
``step.starting_with_the_step`` of the stock one, so the forward's first call
starts every PLE layer through the stock call (each hashes with its own
buffers) and the later calls find theirs started. The model classes also
declare the shard tensors unused (``loader``).

What is Qwen4Exp's here and what is not: the patch points above, where a
layer's storage and its PLE layer are (``_shm_binding``) and the hashing (the
stock ``compute_ngram_ids``, untouched). Lookups, routes and the step start
know no model family.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch

from pleclient.vllm_plugin import compat, loader, step
from pleclient.vllm_plugin.registration import QWEN4_EXP_STORAGE as STORAGE_NAMES
from pleclient.vllm_plugin.rows import TableBinding

log = logging.getLogger("pleclient.vllm_plugin")

SHARD_PREFIX = "ngram_embedding.shard_"


def patch_nvidia(module: ModuleType) -> None:
    """``vllm.models.qwen4_exp.nvidia.ngram_embedding``."""
    patch_ngram_embedding(module, module.Qwen4ExpNGramEmbedding)


def patch_amd(module: ModuleType) -> None:
    """``vllm.models.qwen4_exp.amd.ple_layer``."""
    patch_ngram_embedding(module, module.Qwen4ExpNGramEmbedding)


def patch_ngram_embedding(module: ModuleType, cls: Any) -> None:  # patched in place
    if cls.__dict__.get("_ple_shm_patched"):
        return
    from pleclient.vllm_plugin.storage import Qwen4ExpPLEShmEmbedding

    original_init = cls.__init__
    original_load_weights = cls.load_weights

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs) -> None:
        saved = {name: module.__dict__[name] for name in STORAGE_NAMES if name in module.__dict__}
        for name in saved:
            setattr(module, name, Qwen4ExpPLEShmEmbedding)
        try:
            original_init(self, *args, **kwargs)
        finally:
            for name, value in saved.items():
                setattr(module, name, value)
        storage = self.ngram_embedding
        if not isinstance(storage, Qwen4ExpPLEShmEmbedding):
            raise compat.unsupported(
                f"vLLM built the PLE row storage {getattr(storage, 'prefix', '?')} as "
                f"{type(storage).__module__}.{type(storage).__qualname__}, not as the "
                f"plugin's {Qwen4ExpPLEShmEmbedding.__name__}: this vLLM's "
                f"{cls.__name__} does not take its storage class from the names the "
                f"plugin replaces in {module.__name__} ({', '.join(STORAGE_NAMES)})"
            )
        self.use_reduce_scatter = False
        storage.bind(self.split_ngram_parts)

    @functools.wraps(original_load_weights)
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from pleclient.vllm_plugin.storage import Qwen4ExpPLEShmEmbedding

        if not isinstance(self.ngram_embedding, Qwen4ExpPLEShmEmbedding):
            return original_load_weights(self, weights)
        dropped: list[str] = []

        def without_shards() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(SHARD_PREFIX):
                    dropped.append(name)  # served by ple-server
                    continue
                yield name, tensor

        loaded = original_load_weights(self, without_shards())
        if dropped:
            log.info(
                "PLE backend shm: dropped %d shard tensor(s) the loader read anyway "
                "(mixed safetensors files with a whole-file load format)",
                len(dropped),
            )
        return loaded

    cls.__init__ = __init__
    cls.load_weights = load_weights
    cls._ple_shm_patched = True
    cls._ple_shm_original = {"__init__": original_init, "load_weights": original_load_weights}
    log.info("PLE backend shm: patched %s.%s", cls.__module__, cls.__qualname__)


def patch_model(module: ModuleType) -> None:
    """``vllm.models.qwen4_exp.nvidia.model``: the model classes declare the
    shard tensors unused, and every PLE layer's lookup starts with the step."""
    loader.patch_model_module(module)
    patch_step_start(module.Qwen4ExpModel)


def patch_step_start(cls: Any) -> None:  # patched in place
    """Every PLE layer's lookup of the rank's range starts at the forward's
    first ``_start_layer_ple_prefetch`` (see ``step``). Idempotent."""
    if cls.__dict__.get("_ple_shm_step_patched"):
        return
    stock = cls.__dict__.get("_start_layer_ple_prefetch")
    if not isinstance(stock, staticmethod):
        log.warning(
            "PLE backend shm: %s.%s has no static _start_layer_ple_prefetch (not vLLM 0.33's "
            "model); PLE lookups start as this vLLM starts them, not with the step",
            cls.__module__,
            cls.__qualname__,
        )
        return
    start = stock.__func__
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs) -> None:
        original_init(self, *args, **kwargs)
        started = step.adopt(self.layers, self.start_layer, self.end_layer, start, _shm_binding)
        if started is not None:
            log.info(
                "PLE backend shm: every PLE layer's lookup of layers %d..%d (%d PLE layers) "
                "starts with the step",
                self.start_layer,
                self.end_layer - 1,
                len(started.ple_layers),
            )

    cls.__init__ = __init__
    cls._start_layer_ple_prefetch = staticmethod(step.starting_with_the_step(start))
    cls._ple_shm_step_patched = True
    cls._ple_shm_step_original = {"__init__": original_init, "_start_layer_ple_prefetch": stock}


def _shm_binding(decoder_layer: Any) -> TableBinding | None:
    """The ple-server table of a decoder layer's PLE layer, or None (no PLE
    layer, or stock storage)."""
    from pleclient.vllm_plugin.storage import Qwen4ExpPLEShmEmbedding

    ple = getattr(decoder_layer, "ple", None)
    if ple is None:
        return None
    storage = ple.ple_embedding.ngram_embedding
    return storage.binding if isinstance(storage, Qwen4ExpPLEShmEmbedding) else None
