"""A stand-in for qwen38-flash-next's ``Qwen3_8FlashNextNGramEmbedding``.

That class ships only in qwen38-flash-next vLLM builds, which are not
installable here. This module reproduces the interface the seed
(``vllm_ple_mmap.py``) patches, faithfully where the seed relies on it:

* module-level ``VocabParallelEmbedding`` (vLLM's), called as
  ``VocabParallelEmbedding(rows, head_dim, params_dtype=…, quant_config=…,
  prefix=…)`` for the row storage;
* ``__init__(config, embedding_dim, ple_dense_layer_id, max_total_tokens,
  max_num_reqs, prefix, quant_config=None, params_dtype=None)``; attributes
  ``head_dim``, ``embedding_dim``, ``split_ngram_parts``, ``ngram_embedding``;
* ``forward_impl(hidden_states, input_ids, query_start_loc, ngram_context,
  output_buffer=None)`` → rows ``[tokens, embedding_dim]`` in the storage dtype
  (hashing, then ``self.ngram_embedding(ids)``);
* ``load_weights`` taking ``ngram_embedding.shard_<i>.weight`` (rows
  ``[i*shard_size, …)``), ``ngram_embedding.weight_scale`` and hash buffers;
* the PLE layer's FP8 scale: ``ngram_embedding.weight_scale`` when the storage
  has a ``weight``, else ``_offload_weight_scale`` (``ple_scale`` below).

The hashing is Qwen4Exp's CPU path (the same n-gram scheme); what is under
test is the storage, not the hash.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding
from vllm.utils.math_utils import round_up


class Qwen3_8FlashNextNGramEmbedding(nn.Module):  # the real class's name
    def __init__(
        self,
        config,
        embedding_dim: int,
        ple_dense_layer_id: int,
        max_total_tokens: int,
        max_num_reqs: int,
        prefix: str,
        quant_config=None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.max_total_tokens = max_total_tokens
        self.max_num_reqs = max_num_reqs
        self.embedding_dim = embedding_dim
        self.ngram_size = int(config.ngram_size)
        self.heads_per_ngram = int(config.heads_per_ngram)
        self.ngram_heads = (self.ngram_size - 1) * self.heads_per_ngram
        self.head_dim = embedding_dim // self.ngram_heads
        self.eos_token_id = int(config.eos_token_id)
        self.split_ngram_parts = int(config.split_ngram_parts)
        multipliers = Qwen4ExpNGramEmbedding._make_layer_multipliers(
            ngram_size=self.ngram_size,
            unigram_vocab_size=int(config.vocab_size),
            seed=int(getattr(config, "seed", 1234)),
            ple_dense_layer_id=ple_dense_layer_id,
        )
        sizes, offsets, total = Qwen4ExpNGramEmbedding._make_vocab_layout(
            ngram_vocab_size_base=int(config.ngram_vocab_size_base),
            ngram_heads=self.ngram_heads,
            ple_dense_layer_id=ple_dense_layer_id,
        )
        self.register_buffer("layer_multipliers", torch.tensor(multipliers))
        self.register_buffer("ngram_heads_vocab_sizes", torch.tensor(sizes))
        self.register_buffer("ngram_heads_offsets", torch.tensor(offsets))
        rows = round_up(total, int(config.make_ngram_vocab_size_divisible_by))
        storage_dtype = (
            torch.float8_e4m3fn
            if getattr(config, "ple_embedding_dtype", None) == "float8_e4m3fn"
            else params_dtype or torch.bfloat16
        )
        self.ngram_embedding = VocabParallelEmbedding(
            rows,
            self.head_dim,
            params_dtype=storage_dtype,
            quant_config=quant_config,
            prefix=f"{prefix}.ngram_embedding",
        )
        if storage_dtype == torch.float8_e4m3fn and hasattr(self.ngram_embedding, "weight"):
            self.ngram_embedding.weight_scale = nn.Parameter(
                torch.full((1,), torch.finfo(torch.float32).min), requires_grad=False
            )

    compute_ngram_ids = Qwen4ExpNGramEmbedding.compute_ngram_ids
    _shift_precompute = staticmethod(Qwen4ExpNGramEmbedding._shift_precompute)
    _shift_apply = staticmethod(Qwen4ExpNGramEmbedding._shift_apply)

    def forward_impl(
        self,
        hidden_states,
        input_ids: torch.Tensor,
        query_start_loc: torch.Tensor,
        ngram_context: torch.Tensor,
        output_buffer: torch.Tensor | None = None,
    ) -> torch.Tensor:
        del hidden_states, output_buffer
        ids = self.compute_ngram_ids(input_ids, query_start_loc, ngram_context)
        return self.ngram_embedding(ids).flatten(-2)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        buffers = dict(self.named_buffers())
        storage = self.ngram_embedding
        shard_size = -(-storage.org_vocab_size // self.split_ngram_parts)
        for name, tensor in weights:
            if name.startswith("ngram_embedding.shard_") and name.endswith(".weight"):
                index = int(name[len("ngram_embedding.shard_") : -len(".weight")])
                start = index * shard_size
                with torch.no_grad():
                    storage.weight[start : start + tensor.shape[0]].copy_(tensor)
                loaded.add("ngram_embedding.weight")
            elif name == "ngram_embedding.weight_scale":
                with torch.no_grad():
                    storage.weight_scale.copy_(tensor.reshape(-1).float())
                loaded.add(name)
            elif name in buffers:
                buffers[name].copy_(tensor)
                loaded.add(name)
        return loaded


def ple_scale(ple_embedding: nn.Module) -> torch.Tensor | None:
    """The FP8 scale as ``Qwen3_8FlashNextPLELayer`` finds it."""
    storage = ple_embedding.ngram_embedding
    if hasattr(storage, "weight"):
        return getattr(storage, "weight_scale", None)
    return getattr(ple_embedding, "_offload_weight_scale", None)


def dequantize(
    ple_embedding: nn.Module, rows: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    scale = ple_scale(ple_embedding)
    if rows.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return rows.to(dtype) * scale.to(dtype)
    return rows.to(dtype)
