"""The Qwen4Exp PLE storage that holds no table: rows come from ple-server.

``Qwen4ExpPLEShmEmbedding`` takes the place of vLLM's
``Qwen4ExpPLEDeviceEmbedding`` / ``Qwen4ExpPLEPinnedHostEmbedding`` inside
``Qwen4ExpNGramEmbedding`` (see ``qwen4_exp``). It keeps their interface:

* ``forward(ngram_ids)`` / ``sync_lookup(ngram_ids)`` → rows ``[*ids, cols]``;
* ``start_prefetch(ngram_ids)`` then ``finalize_prefetch(total_tokens)`` →
  ``[tokens, heads * cols]``: the request goes to the server before the
  preceding decoder layer runs, the rows are collected when this layer needs
  them;
* ``dequantize`` and the FP8 ``weight_scale`` parameter come unchanged from the
  quantization method, so dequantization is exactly stock.
* NVFP4: the server answers each row as packed values then block scales; they
  are decoded to the activation dtype, as stock's NVFP4 lookup does
  (``nvfp4.Nvfp4Rows``, the layer's encoding, chosen in ``bind``), with the
  ``weight_scale_2`` parameter the stock loader loads. Rows come out in the
  method's ``lookup_dtype`` (the params dtype), as from stock storage; its
  ``dequantize`` is then a plain cast.

Differences that matter:

* No table: ``weight`` (and NVFP4's ``weight_scale``, the block scales) is a
  0-row, non-persistent buffer (its dtype and device are what the rest of vLLM
  asks it for), so the loader has nothing to fill.
* Every rank gets full rows from the server, so there is nothing to all-reduce
  over the embedding-TP group and no DP id gather: ``reduce_results`` is off and
  the owning ``Qwen4ExpNGramEmbedding`` shards (never reduce-scatters) rows under
  sequence parallelism.
* The lookups themselves are the layer's ``LayerLookups`` (``lookups``), over
  the route chosen at its first lookup (``routes``). On a CUDA device with
  stream memory operations that is the GPU-driven route: the ring and the
  collection are enqueued on the stream, so ``start_prefetch`` /
  ``finalize_prefetch`` sit inside captured CUDA graphs (FULL,
  FULL_AND_PIECEWISE, PIECEWISE alike) with no host sync. Otherwise the host
  route's work (the server round trip) runs eagerly outside captured CUDA
  graphs: breakable-cudagraph break points writing into caller-provided
  outputs.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.models.qwen4_exp.common.ngram_embedding import (
    Qwen4ExpPLEEmbedding,
    Qwen4ExpPLEEmbeddingMethod,
    Qwen4ExpPLEFp8EmbeddingMethod,
    Qwen4ExpPLENvFp4EmbeddingMethod,
)

from pleclient.families.qwen4_exp import NVFP4
from pleclient.vllm_plugin.compilation import breakable_capture_running
from pleclient.vllm_plugin.errors import PleBackendError
from pleclient.vllm_plugin.identity import Expected
from pleclient.vllm_plugin.lookups import LayerLookups, RowEncoding, StoredRows
from pleclient.vllm_plugin.nvfp4 import Nvfp4Rows
from pleclient.vllm_plugin.routes import Routes
from pleclient.vllm_plugin.rows import TableBinding


class Qwen4ExpPLEShmEmbedding(Qwen4ExpPLEEmbedding):
    """PLE rows served by ple-server; no table in this process."""

    supports_prefetch: ClassVar[bool] = True  # per instance: VLLM_PLE_SHM_PREFETCH
    weight: torch.Tensor  # a 0-row buffer (see __init__), for its dtype and device
    weight_scale_2: torch.Tensor  # NVFP4 only: the global scale, a loaded parameter

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        params_dtype: torch.dtype,
        padding_size: int,
        prefix: str,
        embedding_method: Qwen4ExpPLEEmbeddingMethod,
        num_ngram_heads: int = 1,
        max_total_tokens: int = 0,
        data_parallel_rank: int = 0,
        reduce_results: bool = True,
    ) -> None:
        del reduce_results  # full rows on every rank: nothing to reduce
        super().__init__(
            num_embeddings,
            embedding_dim,
            params_dtype=params_dtype,
            padding_size=padding_size,
            prefix=prefix,
            embedding_method=embedding_method,
            num_ngram_heads=num_ngram_heads,
            max_total_tokens=max_total_tokens,
            data_parallel_rank=data_parallel_rank,
            reduce_results=False,
        )
        # The 0-row placeholders: buffers, so the loader expects nothing for them.
        # NVFP4's block scales are table-sized too; its weight_scale_2 stays a
        # parameter, loaded as stock loads it.
        self._nvfp4 = isinstance(embedding_method, Qwen4ExpPLENvFp4EmbeddingMethod)
        for name in ("weight", "weight_scale") if self._nvfp4 else ("weight",):
            placeholder = self._parameters.pop(name)
            assert placeholder is not None  # the quantization method registers it
            self.register_buffer(name, placeholder.data, persistent=False)
        # The dtype of the rows forward/finalize_prefetch return: the stored one,
        # or NVFP4's decoded params dtype (the method's lookup dtype).
        self._row_dtype = embedding_method.lookup_dtype(self)
        self._routes = Routes.shared()
        # vLLM declares it a ClassVar; each layer here follows its own settings.
        self.supports_prefetch = self._routes.service.settings.prefetch  # type: ignore[misc]
        self._num_ngram_heads = num_ngram_heads
        self._lookups: LayerLookups | None = None
        self._max_ids = max_total_tokens * num_ngram_heads

    def allocate_embedding_weight(
        self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype
    ) -> torch.Tensor:
        del num_embeddings  # the table stays in ple-server
        return torch.empty(0, embedding_dim, dtype=dtype)

    # ------------------------------------------------------------------ setup
    def bind(self, split_ngram_parts: int) -> None:
        """Connect (shared per process) and check the server's table against the
        checkpoint and this layer's geometry; raises at startup on any mismatch.
        The layer's rows encoding is chosen here, once."""
        if isinstance(self.embedding_method, Qwen4ExpPLEFp8EmbeddingMethod):
            dtypes: tuple[str, ...] = ("F8_E4M3",)
        elif self._nvfp4:
            dtypes = (NVFP4,)
        else:
            dtypes = ("BF16",)  # converted to the params dtype if that differs
        binding = self._routes.service.bind(
            Expected(
                prefix=self.prefix,
                rows=self.org_vocab_size,
                cols=self.embedding_dim,
                dtypes=dtypes,
                parts=split_ngram_parts,
            ),
            max_ids=self._max_ids,
        )
        encoding: RowEncoding = (
            Nvfp4Rows(self.embedding_dim, lambda: self.weight_scale_2)
            if self._nvfp4
            else StoredRows(binding)
        )
        self._lookups = LayerLookups(
            binding,
            self._routes,
            encoding,
            eager=eager_break_during_capture,
            capturing=breakable_capture_running,
        )

    @property
    def lookups(self) -> LayerLookups:
        if self._lookups is None:
            raise PleBackendError(
                f"{self.prefix}: the shm PLE embedding was never bound to a ple-server table"
            )
        return self._lookups

    @property
    def binding(self) -> TableBinding:
        return self.lookups.binding

    def extra_repr(self) -> str:
        return (
            f"rows={self.org_vocab_size}, cols={self.embedding_dim}, "
            f"dtype={NVFP4 if self._nvfp4 else self.weight.dtype}, backend=ple-server"
        )

    # --------------------------------------------------------------- lookups
    def forward(self, ngram_ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ngram_ids`` in the storage dtype (NVFP4: decoded to the
        params dtype), ``[*ids.shape, cols]``."""
        output = torch.empty(
            (*ngram_ids.shape, self.embedding_dim),
            dtype=self._row_dtype,
            device=ngram_ids.device,
        )
        self.lookups.lookup(ngram_ids, output)
        return output

    def sync_lookup(self, ngram_ids: torch.Tensor) -> torch.Tensor:
        """The pinned-storage name of ``forward`` (used by the AMD model)."""
        return self.forward(ngram_ids)

    def start_prefetch(self, ngram_ids: torch.Tensor) -> None:
        """Send this layer's ids to the server; collected by finalize_prefetch."""
        self.lookups.start(ngram_ids)

    def finalize_prefetch(self, total_tokens: int) -> torch.Tensor:
        """The prefetched rows, ``[total_tokens, heads * cols]``."""
        output = torch.empty(
            (total_tokens, self._num_ngram_heads * self.embedding_dim),
            dtype=self._row_dtype,
            device=self.weight.device,
        )
        self.lookups.finish(output)
        return output
