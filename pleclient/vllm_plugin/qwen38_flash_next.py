"""Seed-interface adapter: ``Qwen3_8FlashNextNGramEmbedding`` (qwen38-flash-next builds).

The class these vLLM builds define (``vllm.models.qwen3_8_flash_next.<platform>.
ple_layer``) has

* ``__init__(config, embedding_dim, ple_dense_layer_id, max_total_tokens,
  max_num_reqs, prefix, quant_config=None, params_dtype=None)`` building its
  storage with the module-level ``VocabParallelEmbedding(rows, head_dim, …)``;
* ``forward_impl(hidden_states, input_ids, query_start_loc, ngram_context)``:
  hashing, then ``self.ngram_embedding(ids)``; rows in the storage dtype;
* ``load_weights`` routing ``ngram_embedding.shard_<i>.weight`` into the table;
* the PLE layer reads the FP8 scale from ``ngram_embedding.weight_scale`` or,
  when the storage has no ``weight``, from ``_offload_weight_scale``.

Patched:

* ``__init__``: the stock constructor runs with ``VocabParallelEmbedding``
  standing in for ``ShmVocabEmbedding`` (duck-typed, no ``weight``, no table) and
  ``quant_config=None`` (no FP8 parameter is created); the storage binds to its
  ple-server table at once (fail fast, identity check).
* ``load_weights``: shard tensors are dropped; ``weight_scale`` becomes
  ``_offload_weight_scale`` (from the checkpoint's catalog if the loader never
  delivered it); the rest goes to the stock code.
* ``forward_impl``: the stock hashing + lookup runs inside the custom op
  ``vllm::ple_shm_lookup`` — opaque to torch.compile, and listable in
  ``-cc.splitting_ops`` so that it runs outside piecewise CUDA graphs::

      -cc.cudagraph_mode=PIECEWISE -cc.splitting_ops+=vllm::ple_shm_lookup
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch
import torch.nn as nn

from pleclient.vllm_plugin.errors import PleBackendError
from pleclient.vllm_plugin.identity import Expected
from pleclient.vllm_plugin.lookups import LayerLookups, StoredRows
from pleclient.vllm_plugin.routes import Routes
from pleclient.vllm_plugin.rows import TableBinding

log = logging.getLogger("pleclient.vllm_plugin")

OP_NAME = "ple_shm_lookup"
"""``torch.ops.vllm.ple_shm_lookup``; list ``vllm::ple_shm_lookup`` in splitting_ops."""
SHARD_PREFIX = "ngram_embedding.shard_"
SCALE_NAME = "ngram_embedding.weight_scale"
ROW_DTYPES = ("BF16", "F8_E4M3", "F8_E5M2")  # whatever the checkpoint holds

_LAYERS: dict[str, Any] = {}
"""prefix → patched layer, for the custom op (which only carries a string)."""


class ShmVocabEmbedding(nn.Module):
    """Stands in for ``VocabParallelEmbedding``: the attributes the PLE code reads,
    and ``forward(ids)`` from ple-server. No ``weight`` on purpose: the PLE layer
    then takes the FP8 scale from ``_offload_weight_scale``. Its lookups run
    inside the custom op, outside graphs: never GPU-driven."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = int(num_embeddings)
        self.org_vocab_size = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.binding: TableBinding | None = None
        self._lookups: LayerLookups | None = None

    def bind(self, expected: Expected) -> None:
        routes = Routes.shared()
        binding = routes.service.bind(expected)
        self.binding = binding
        self._lookups = LayerLookups(
            binding, routes, StoredRows(binding), route=routes.for_layer(binding)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.binding is None or self._lookups is None:
            raise PleBackendError("the shm PLE embedding was never bound to a table")
        out = torch.empty(
            (*ids.shape, self.embedding_dim), dtype=self.binding.storage_dtype, device=ids.device
        )
        self._lookups.lookup(ids, out)
        return out

    def extra_repr(self) -> str:
        return f"rows={self.num_embeddings}, cols={self.embedding_dim}, backend=ple-server"


def patch_module(module: ModuleType) -> None:
    """``vllm.models.qwen3_8_flash_next.<platform>.ple_layer`` (``registration``
    checked that it defines the class)."""
    apply(module.Qwen3_8FlashNextNGramEmbedding)


def apply(cls: Any) -> None:  # a vLLM class, patched in place: Any to mypy
    """Patch the seed-interface class ``cls`` (its module must define
    ``VocabParallelEmbedding``). Idempotent."""
    if cls.__dict__.get("_ple_shm_patched"):
        return
    module: Any = sys.modules[cls.__module__]  # one of its attributes is swapped below
    original_init = cls.__init__
    original_load_weights = cls.load_weights
    original_forward_impl = cls.forward_impl

    signature = inspect.signature(original_init)

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs) -> None:
        bound = signature.bind(self, *args, **kwargs)
        if "quant_config" in signature.parameters:
            bound.arguments["quant_config"] = None  # no FP8 weight parameter
        prefix = bound.arguments["prefix"]
        real = module.VocabParallelEmbedding
        module.VocabParallelEmbedding = lambda num_embeddings, embedding_dim, *_a, **_kw: (
            ShmVocabEmbedding(num_embeddings, embedding_dim)
        )
        try:
            original_init(*bound.args, **bound.kwargs)
        finally:
            module.VocabParallelEmbedding = real
        self._ple_shm_prefix = prefix
        _LAYERS[prefix] = self
        storage = self.ngram_embedding
        storage.bind(
            Expected(
                prefix=prefix,
                rows=storage.org_vocab_size,
                cols=storage.embedding_dim,
                dtypes=ROW_DTYPES,
                parts=int(self.split_ngram_parts),
            )
        )

    @functools.wraps(original_load_weights)
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        rest: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            if name.startswith(SHARD_PREFIX) and name.endswith(".weight"):
                loaded.add(name)  # served by ple-server, never materialized here
            elif name == SCALE_NAME:
                _set_scale(self, tensor)
                loaded.add(name)
            else:
                rest.append((name, tensor))
        loaded.update(original_load_weights(self, rest))
        binding = self.ngram_embedding.binding
        if (
            not hasattr(self, "_offload_weight_scale")
            and binding is not None
            and binding.checkpoint is not None
            and binding.checkpoint.scale is not None
        ):
            _set_scale(self, torch.tensor(binding.checkpoint.scale, dtype=torch.float32))
        return loaded

    def forward_impl(
        self, hidden_states, input_ids, query_start_loc, ngram_context, *args, **kwargs
    ) -> torch.Tensor:
        del hidden_states, args, kwargs
        num_tokens = input_ids.reshape(-1).shape[0]
        storage = self.ngram_embedding
        output = torch.empty(
            (num_tokens, self.embedding_dim),
            dtype=storage.binding.storage_dtype,
            device=input_ids.device,
        )
        getattr(torch.ops.vllm, OP_NAME)(
            input_ids, query_start_loc, ngram_context, output, self._ple_shm_prefix
        )
        return output

    _register_op()
    cls._ple_shm_original_forward_impl = original_forward_impl
    cls.__init__ = __init__
    cls.load_weights = load_weights
    cls.forward_impl = forward_impl
    cls._ple_shm_patched = True
    log.info("PLE backend shm: patched %s.%s", cls.__module__, cls.__qualname__)


def _set_scale(layer: nn.Module, scale: torch.Tensor) -> None:
    device = (
        torch.accelerator.current_accelerator()
        if torch.accelerator.is_available()
        else torch.device("cpu")
    )
    layer.register_buffer(
        "_offload_weight_scale", scale.detach().to(device=device), persistent=False
    )


def _lookup(
    input_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    ngram_context: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    layer = _LAYERS[layer_name]
    rows = layer._ple_shm_original_forward_impl(
        None, input_ids, query_start_loc, ngram_context
    )  # bound: the stock method
    output[: rows.shape[0]].copy_(rows.reshape(rows.shape[0], -1))


def _lookup_fake(
    input_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    ngram_context: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    return None


def _register_op() -> None:
    if hasattr(torch.ops.vllm, OP_NAME):
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op(
        op_name=OP_NAME, op_func=_lookup, mutates_args=["output"], fake_impl=_lookup_fake
    )
