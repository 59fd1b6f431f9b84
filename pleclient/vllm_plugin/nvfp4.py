"""Decode served NVFP4 PLE rows exactly as vLLM's NVFP4 embedding method does.

ple-server answers an NVFP4 row as ``cols/2`` bytes of packed E2M1 values (low
nibble = even column) followed by ``cols/16`` F8_E4M3 block scales — the bytes
of ``shard_<i>.weight`` and ``shard_<i>.weight_scale`` for that row. The
global ``weight_scale_2`` stays a vLLM parameter, loaded by the stock loader.

Stock ``Qwen4ExpPLENvFp4EmbeddingMethod`` decodes looked-up rows two ways, and
so do we, on the same inputs:

* CPU: ``dequantize_to_dtype(values, block_scales, weight_scale_2, params_dtype,
  swizzle=False)`` — the same function on the same bytes.
* CUDA (device and pinned storage alike): its Triton kernel
  ``_lookup_nvfp4_ple_embedding_kernel``. We call that very kernel, on
  contiguous copies of the served values and block scales with ids
  ``0..n-1`` and an owned range ``[0, n)``: row ``k`` of our copies is byte for
  byte the table row stock reads for id ``ids[k]``, every id is owned (the
  server answers full rows), and each element goes through the same
  ``_e2m1_inline(code) * _e4m3_inline(scale) * weight_scale_2`` in float32 and
  the same store into the ``params_dtype`` output. Same kernel, same bytes,
  same order of operations: the same bits. (``dequantize_to_dtype`` on CUDA
  would dispatch to another kernel, ``_triton_dequantize_nvfp4``; stock's
  lookup never uses it, so neither do we.)

``Nvfp4Rows`` is the encoding a layer's lookups apply (``lookups``): room for
the served rows, then this decode into the layer's output.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pleclient.families.qwen4_exp import NVFP4_BLOCK
from pleclient.vllm_plugin.kernel_call import KernelCall


def row_bytes(cols: int) -> int:
    """Bytes of one served NVFP4 row of ``cols`` columns."""
    return cols // 2 + cols // NVFP4_BLOCK


def decode_into(raw: torch.Tensor, global_scale: torch.Tensor, out: torch.Tensor) -> None:
    """Decode served rows ``raw`` (uint8 ``[n, cols/2 + cols/16]``) into ``out``
    (contiguous, ``n * cols`` elements of the activation dtype), as stock does.

    On CUDA the rows' host-to-device copy (``pleclient.torch.copy_rows``) and
    this kernel are both on the current stream, so the kernel reads the rows
    only after they arrived."""
    n = raw.shape[0]
    packed = (raw.shape[1] * 8) // 9  # cols/2 of the cols/2 + cols/16 bytes
    cols = 2 * packed
    if raw.shape[1] != row_bytes(cols) or out.numel() != n * cols or not out.is_contiguous():
        raise ValueError(
            f"NVFP4 rows of {raw.shape[1]} bytes decode into {n} x {cols} contiguous "
            f"elements; the output is {tuple(out.shape)}"
        )
    if n == 0:
        return
    values = raw[:, :packed].contiguous()
    scales = raw[:, packed:].contiguous()
    rows = out.view(n, cols)
    if raw.is_cuda:
        kernel_call(values, scales, global_scale, rows).launch()
        return
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        dequantize_to_dtype,
    )

    rows.copy_(
        dequantize_to_dtype(
            values, scales.view(torch.float8_e4m3fn), global_scale, out.dtype, swizzle=False
        )
    )


def kernel_call(
    values: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, rows: torch.Tensor
) -> KernelCall:
    """Stock's ``_lookup_nvfp4_ple_embedding_kernel`` over served rows: packed
    ``values`` ``[n, cols/2]`` and block ``scales`` ``[n, cols/16]`` (uint8) into
    ``rows`` ``[n, cols]``, with ids ``0..n-1`` and the range ``[0, n)`` owned."""
    from vllm.models.qwen4_exp.common.ngram_embedding import _lookup_nvfp4_ple_embedding_kernel
    from vllm.triton_utils import triton

    n, cols = rows.shape
    ids = torch.arange(n, dtype=torch.int64, device=rows.device)
    return KernelCall(
        _lookup_nvfp4_ple_embedding_kernel,
        (n,),
        (
            values,
            scales,  # uint8, as stock passes weight_scale.view(torch.uint8)
            global_scale,
            ids,
            rows,
            cols,
            0,
            n,
        ),
        dict(BLOCK_D=triton.next_power_of_2(cols)),
    )


class Nvfp4Rows:
    """Served NVFP4 rows, decoded into the output (``lookups.RowEncoding``).
    ``global_scale`` gives the layer's ``weight_scale_2`` as loaded now."""

    def __init__(self, cols: int, global_scale: Callable[[], torch.Tensor]) -> None:
        self.cols = cols
        self.row_bytes = row_bytes(cols)
        self.global_scale = global_scale

    def write(self, out: torch.Tensor, fill: Callable[[torch.Tensor], None]) -> None:
        raw = torch.empty(
            (out.numel() // self.cols, self.row_bytes), dtype=torch.uint8, device=out.device
        )
        fill(raw)
        decode_into(raw, self.global_scale(), out)
