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
  are decoded here to the activation dtype, as stock's NVFP4 lookup does
  (``nvfp4``), with the ``weight_scale_2`` parameter the stock loader loads.
  Rows come out in the method's ``lookup_dtype`` (the params dtype), as from
  stock storage; its ``dequantize`` is then a plain cast.

Differences that matter:

* No table: ``weight`` (and NVFP4's ``weight_scale``, the block scales) is a
  0-row, non-persistent buffer (its dtype and device are what the rest of vLLM
  asks it for), so the loader has nothing to fill.
* Every rank gets full rows from the server, so there is nothing to all-reduce
  over the embedding-TP group and no DP id gather: ``reduce_results`` is off and
  the owning ``Qwen4ExpNGramEmbedding`` shards (never reduce-scatters) rows under
  sequence parallelism.
* On a CUDA device with stream memory operations, lookups are GPU-driven
  (``gpu_route``): the ring and the collection are enqueued on the stream, so
  ``start_prefetch`` / ``finalize_prefetch`` sit inside captured CUDA graphs
  (FULL, FULL_AND_PIECEWISE, PIECEWISE alike) with no host sync.
* Otherwise host work (the server round trip) runs eagerly outside captured
  CUDA graphs: the methods that do it are breakable-cudagraph break points
  writing into caller-provided outputs.
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

from pleclient.checkpoint import NVFP4
from pleclient.vllm_plugin import nvfp4
from pleclient.vllm_plugin.errors import PleBackendError
from pleclient.vllm_plugin.gpu_route import GpuPending, GpuRoute
from pleclient.vllm_plugin.identity import Expected
from pleclient.vllm_plugin.rows import PendingLookup, RowService, TableBinding


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
        self._rows = RowService.shared()
        # vLLM declares it a ClassVar; each layer here follows its own settings.
        self.supports_prefetch = self._rows.settings.prefetch  # type: ignore[misc]
        self._num_ngram_heads = num_ngram_heads
        self._binding: TableBinding | None = None
        # A started lookup: the host path's, or the GPU-driven route's.
        self._pending: PendingLookup | tuple[GpuRoute, GpuPending] | None = None
        self._max_ids = max_total_tokens * num_ngram_heads

    def allocate_embedding_weight(
        self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype
    ) -> torch.Tensor:
        del num_embeddings  # the table stays in ple-server
        return torch.empty(0, embedding_dim, dtype=dtype)

    # ------------------------------------------------------------------ setup
    def bind(self, split_ngram_parts: int) -> None:
        """Connect (shared per process) and check the server's table against the
        checkpoint and this layer's geometry; raises at startup on any mismatch."""
        if isinstance(self.embedding_method, Qwen4ExpPLEFp8EmbeddingMethod):
            dtypes: tuple[str, ...] = ("F8_E4M3",)
        elif self._nvfp4:
            dtypes = (NVFP4,)
        else:
            dtypes = ("BF16",)  # converted to the params dtype if that differs
        self._binding = self._rows.bind(
            Expected(
                prefix=self.prefix,
                rows=self.org_vocab_size,
                cols=self.embedding_dim,
                dtypes=dtypes,
                parts=split_ngram_parts,
            ),
            max_ids=self._max_ids,
        )

    @property
    def binding(self) -> TableBinding:
        if self._binding is None:
            raise PleBackendError(
                f"{self.prefix}: the shm PLE embedding was never bound to a ple-server table"
            )
        return self._binding

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
        self._lookup_into(ngram_ids, output)
        return output

    def sync_lookup(self, ngram_ids: torch.Tensor) -> torch.Tensor:
        """The pinned-storage name of ``forward`` (used by the AMD model)."""
        return self.forward(ngram_ids)

    def _lookup_into(self, ngram_ids: torch.Tensor, output: torch.Tensor) -> None:
        route = self._rows.gpu_route(self.binding, output.device, ngram_ids.numel())
        if route is None:
            self._lookup_into_host(ngram_ids, output)
            return
        # GPU-driven: ring and collect on the stream, no break in a graph.
        self._finish_gpu(route, route.start(self.binding, ngram_ids), output)

    def _finish_gpu(self, route: GpuRoute, started: GpuPending, output: torch.Tensor) -> None:
        """Enqueue the collection of ``started`` into ``output`` (NVFP4: the
        served rows, then stock's decode, on the same stream)."""
        if not self._nvfp4:
            self._rows.finish_gpu(route, self.binding, started, output)
            return
        raw = self._served_rows(started.count, output.device)
        self._rows.finish_gpu(route, self.binding, started, raw)
        nvfp4.decode_into(raw, self.weight_scale_2, output)

    def _served_rows(self, count: int, device: torch.device) -> torch.Tensor:
        """Room for ``count`` NVFP4 rows as served: values, then block scales."""
        return torch.empty(
            (count, nvfp4.row_bytes(self.embedding_dim)), dtype=torch.uint8, device=device
        )

    @eager_break_during_capture
    def _lookup_into_host(self, ngram_ids: torch.Tensor, output: torch.Tensor) -> None:
        if not self._nvfp4:
            self._rows.lookup(self.binding, ngram_ids, output)
            return
        raw = self._served_rows(ngram_ids.numel(), output.device)
        self._rows.lookup(self.binding, ngram_ids, raw)
        nvfp4.decode_into(raw, self.weight_scale_2, output)

    def start_prefetch(self, ngram_ids: torch.Tensor) -> None:
        """Send this layer's ids to the server; collected by finalize_prefetch."""
        self._discard_pending()
        route = self._rows.gpu_route(self.binding, self.weight.device, ngram_ids.numel())
        if route is None:
            self._start_prefetch_host(ngram_ids)
            return
        # GPU-driven: the ring is enqueued on the stream, no break in a graph.
        self._pending = (route, route.start(self.binding, ngram_ids))

    @eager_break_during_capture
    def _start_prefetch_host(self, ngram_ids: torch.Tensor) -> None:
        self._pending = self._rows.submit(self.binding, ngram_ids)

    def _discard_pending(self) -> None:
        """Give up a lookup that was started and never used."""
        pending, self._pending = self._pending, None
        if isinstance(pending, PendingLookup):
            self._rows.discard(pending)
        elif pending is not None:
            route, started = pending
            route.discard(started, self.binding.row_bytes, self.weight.device)

    def finalize_prefetch(self, total_tokens: int) -> torch.Tensor:
        """The prefetched rows, ``[total_tokens, heads * cols]``."""
        output = torch.empty(
            (total_tokens, self._num_ngram_heads * self.embedding_dim),
            dtype=self._row_dtype,
            device=self.weight.device,
        )
        self._finalize_into(output)
        return output

    def _finalize_into(self, output: torch.Tensor) -> None:
        pending = self._pending
        if pending is None:
            raise RuntimeError(f"{self.prefix}: shm PLE lookup requires a prior start_prefetch()")
        if isinstance(pending, PendingLookup):
            self._finalize_into_host(output)
            return
        self._pending = None
        route, started = pending
        if started.count != output.shape[0] * self._num_ngram_heads:
            route.discard(started, self.binding.row_bytes, self.weight.device)
            raise RuntimeError(
                f"{self.prefix}: prefetched {started.count} ids, but finalize asks for "
                f"{output.shape[0]} tokens x {self._num_ngram_heads} heads"
            )
        self._finish_gpu(route, started, output)

    @eager_break_during_capture
    def _finalize_into_host(self, output: torch.Tensor) -> None:
        pending, self._pending = self._pending, None
        assert isinstance(pending, PendingLookup)  # (_finalize_into checked)
        if pending.count != output.shape[0] * self._num_ngram_heads:
            self._rows.discard(pending)
            raise RuntimeError(
                f"{self.prefix}: prefetched {pending.count} ids, but finalize asks for "
                f"{output.shape[0]} tokens x {self._num_ngram_heads} heads"
            )
        if not self._nvfp4:
            self._rows.collect(pending, output)
            return
        raw = self._served_rows(pending.count, output.device)
        self._rows.collect(pending, raw)
        nvfp4.decode_into(raw, self.weight_scale_2, output)
