"""DeepSeek-V4.1's Engram layers with their rows from ple-server.

vLLM 0.33's ``Engram`` (``vllm/models/deepseek_v41/common/engram.py``, the one
class of the NVIDIA and the AMD model) holds one ``ParallelEngramEmbedding``
per Engram layer, made by ``Engram._create_embedding``. Patched here:

* ``_create_embedding`` makes ``EngramShmStorage`` instead: no table in the
  process, bound at once to the server's ``layers.<L>.engram.embed`` (connect,
  identity check; startup fails here). It reports what makes vLLM skip its
  own placements: ``dp_size = tp_size = 1`` (every head on every rank: no head
  all-gather, and on NVIDIA no DP hash gather; ROCm's model gathers the ids of
  an Engram DP group whatever the storage says, so that is refused there),
  ``cpu_offload = False`` (no prefetch stream), and a no-op
  ``collapse_huge_pages``.
* ``prepare_embeddings`` (called for every Engram layer at the start of the
  step, right after the hash) starts the layer's lookup: the ids go to the
  server before decoder layer 0 runs;
* ``_ready_rows`` collects them, when the layer needs them, into the layer's
  persistent ``staged_rows`` (a stable address under CUDA graphs), decoded
  from the served MXFP8 rows to BF16 exactly as stock's lookup does
  (``mxfp8.Mxfp8Rows``);
* ``embed`` under sequence parallelism returns this rank's chunk of tokens
  (``ceil(T / tp)`` of them, zero-padded), which stock gets by gathering and
  selecting; with full rows on every rank it is a slice.

The lookups are the layer's ``LayerLookups`` over the route chosen at its
first lookup, as for PLE layers (``storage``).
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Any

import torch
import torch.nn as nn
from vllm.compilation.breakable_cudagraph import eager_break_during_capture

from pleclient.families.deepseek_v41 import MXFP8, TABLE_NAME
from pleclient.vllm_plugin import compat
from pleclient.vllm_plugin.compilation import breakable_capture_running
from pleclient.vllm_plugin.errors import PleBackendError
from pleclient.vllm_plugin.identity import Expected
from pleclient.vllm_plugin.lookups import LayerLookups
from pleclient.vllm_plugin.mxfp8 import Mxfp8Rows
from pleclient.vllm_plugin.routes import Routes
from pleclient.vllm_plugin.rows import TableBinding

log = logging.getLogger("pleclient.vllm_plugin")


class EngramShmStorage(nn.Module):
    """An Engram layer's rows served by ple-server; no table in this process.
    Has what vLLM reads of a ``ParallelEngramEmbedding``: ``dp_size``,
    ``tp_size``, ``cpu_offload``, ``n_hash_cols``, ``part_n_hash_cols``,
    ``dim``, ``lookup`` and ``collapse_huge_pages``."""

    dp_size = 1
    tp_size = 1
    cpu_offload = False

    def __init__(self, layout: Any, layer_hash_index: int, max_tokens: int) -> None:
        super().__init__()
        layer = layout.layer_ids[layer_hash_index]
        head_sizes = [size for order in layout.primes[layer_hash_index] for size in order]
        self.dim = layout.head_dim
        self.n_hash_cols = self.part_n_hash_cols = len(head_sizes)
        self.rows = sum(head_sizes)  # the rows the hash addresses
        routes = Routes.shared()
        binding = routes.service.bind(
            Expected(
                prefix=f"…layers.{layer}.engram.embed_tokens",
                rows=self.rows,
                cols=self.dim,
                dtypes=(MXFP8,),
                parts=1,
                table=TABLE_NAME.format(layer=layer),
                rows_at_least=True,  # (stock reads the first rows of a longer one)
            ),
            max_ids=max_tokens * self.n_hash_cols,
        )
        self.lookups = LayerLookups(
            binding,
            routes,
            Mxfp8Rows(self.dim, binding.max_ids, torch.get_default_device()),
            eager=eager_break_during_capture,
            capturing=breakable_capture_running,
        )

    @property
    def binding(self) -> TableBinding:
        return self.lookups.binding

    def extra_repr(self) -> str:
        return (
            f"rows={self.rows}, cols={self.dim}, heads={self.n_hash_cols}, "
            f"dtype={MXFP8}, backend=ple-server"
        )

    def lookup(self, indices: torch.Tensor, out: torch.Tensor, background: bool = False) -> None:
        """Rows of ``indices`` ``[tokens, heads]`` into ``out`` (BF16
        ``[tokens, heads, dim]``), synchronously (stock's ``lookup``)."""
        del background  # the server's work, not the GPU's
        self.lookups.lookup(indices, out)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        out = torch.empty(
            (indices.shape[0], self.n_hash_cols, self.dim),
            dtype=torch.bfloat16,
            device=indices.device,
        )
        self.lookup(indices, out)
        return out

    def collapse_huge_pages(self) -> None:
        """Nothing to collapse: the table is in ple-server."""


def refuse_amd_data_parallel(platform: str, engram_dp_size: int) -> None:
    """ROCm's DeepSeek-V4.1 model gathers every replica's Engram ids into each
    replica when the Engram DP group has several (it asks the config, not the
    storage, as NVIDIA's does): the plugin's storage would look them all up and
    hand replica 0's rows to every replica. Refused, with the ways out."""
    if platform == "amd" and engram_dp_size > 1:
        raise PleBackendError(
            f"VLLM_PLE_BACKEND=shm: DeepSeek-V4.1's Engram layers on ROCm with an Engram "
            f"data-parallel group of {engram_dp_size} replicas are not supported (vLLM's "
            "ROCm model gathers every replica's Engram ids into each one). Run with "
            "--data-parallel-size 1, on NVIDIA, or unset VLLM_PLE_BACKEND"
        )


def patch_engram_module(module: ModuleType) -> None:
    """``vllm.models.deepseek_v41.common.engram``."""
    patch_engram(module.Engram)


def patch_engram(cls: Any) -> None:  # patched in place
    if cls.__dict__.get("_ple_shm_patched"):
        return
    original = {
        name: cls.__dict__[name]
        for name in ("_create_embedding", "prepare_embeddings", "_ready_rows", "embed")
    }

    def _create_embedding(self, layout: Any, layer_hash_index: int) -> EngramShmStorage:
        from vllm.config import get_current_vllm_config
        from vllm.distributed.parallel_state import get_engram_dp_size

        refuse_amd_data_parallel(compat.platform(), get_engram_dp_size())
        max_tokens = get_current_vllm_config().scheduler_config.max_num_batched_tokens
        return EngramShmStorage(layout, layer_hash_index, max_tokens)

    @functools.wraps(original["prepare_embeddings"])
    def prepare_embeddings(self, hash_ids: torch.Tensor) -> None:
        storage = _shm_storage(self)
        if storage is None:
            return original["prepare_embeddings"](self, hash_ids)
        storage.lookups.start(hash_ids)

    @functools.wraps(original["_ready_rows"])
    def _ready_rows(self, num_tokens: int) -> torch.Tensor:
        storage = _shm_storage(self)
        if storage is None:
            return original["_ready_rows"](self, num_tokens)
        rows = self.staged_rows[:num_tokens]
        storage.lookups.finish(rows)
        return rows

    @functools.wraps(original["embed"])
    def embed(self, hash_ids: torch.Tensor) -> torch.Tensor:
        storage = _shm_storage(self)
        if storage is None or not self.use_sequence_parallel:
            return original["embed"](self, hash_ids)
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        rows = self._ready_rows(hash_ids.shape[0])
        tp_size = get_tensor_model_parallel_world_size()
        chunk = (rows.shape[0] + tp_size - 1) // tp_size
        start = get_tensor_model_parallel_rank() * chunk
        out = rows.new_zeros((chunk, *rows.shape[1:]))
        mine = rows[start : start + chunk]
        out[: mine.shape[0]] = mine
        return out

    cls._create_embedding = _create_embedding
    cls.prepare_embeddings = prepare_embeddings
    cls._ready_rows = _ready_rows
    cls.embed = embed
    cls._ple_shm_patched = True
    cls._ple_shm_original = original
    log.info("PLE backend shm: patched %s.%s", cls.__module__, cls.__qualname__)


def _shm_storage(engram: Any) -> EngramShmStorage | None:
    """The layer's storage when it is the plugin's (an ``Engram`` built before
    the patch keeps stock's, and stock's methods)."""
    storage = engram.embed_tokens
    return storage if isinstance(storage, EngramShmStorage) else None
