"""Decode served Engram (MXFP8) rows exactly as vLLM's Engram lookup does.

ple-server answers an Engram row as ``cols`` bytes of FP8 E4M3 values, then
``cols/32`` UE8M0 scale bytes (``pleclient.families.deepseek_v41``): the
layout of vLLM's own packed rows. vLLM 0.33's ``_engram_lookup_kernel``
(``vllm/models/deepseek_v41/common/engram.py``) turns a row into BF16 as::

    value(c) = bf16(fp32(e4m3[c]) * f32_from_bits(scale[c // 32] << 23))

that is ``2^(e - 127)`` for a scale byte ``e`` (``e = 0`` gives 0.0). On CUDA
the rows are decoded by that kernel itself, so rounding and any
flush-to-zero are stock's; elsewhere by the same arithmetic in torch, which
``tests/test_vllm_plugin_engram.py`` checks bit for bit against the kernel
run by Triton's interpreter (for products in FP32's normal range: the
interpreter rounds FP32 subnormals to BF16 otherwise than torch, e.g. 9·2^-133
to 16·2^-133; they need a scale byte under about 10, far from a trained
table's).
"""

from __future__ import annotations

import torch

from pleclient.families.deepseek_v41 import MXFP8_BLOCK
from pleclient.vllm_plugin.kernel_call import KernelCall


def row_bytes(cols: int) -> int:
    """Bytes of one served Engram row of ``cols`` columns."""
    return cols + cols // MXFP8_BLOCK


def decode_into(raw: torch.Tensor, out: torch.Tensor, *, kernel: bool | None = None) -> None:
    """Decode served rows ``raw`` (uint8 ``[n, cols + cols/32]``) into ``out``
    (contiguous BF16, ``n * cols`` elements). ``kernel``: through vLLM's
    Triton kernel (default: on CUDA), else through torch.

    On CUDA the rows' host-to-device copy (``pleclient.torch.copy_rows``) and
    the kernel are both on the current stream, so the kernel reads the rows
    only after they arrived."""
    n = raw.shape[0]
    cols = (raw.shape[1] * MXFP8_BLOCK) // (MXFP8_BLOCK + 1)
    if raw.shape[1] != row_bytes(cols):
        raise ValueError(
            f"served Engram rows of {raw.shape[1]} bytes are no {cols}-column row of FP8 "
            f"values and their scales ({row_bytes(cols)} bytes); is the table an Engram one?"
        )
    if out.dtype != torch.bfloat16 or out.numel() != n * cols or not out.is_contiguous():
        raise ValueError(
            f"Engram rows of {raw.shape[1]} bytes decode into {n} x {cols} contiguous "
            f"BF16 elements; the output is {out.dtype} {tuple(out.shape)}"
        )
    if n == 0:
        return
    values = raw[:, :cols].contiguous()
    scales = raw[:, cols:].contiguous()
    rows = out.view(n, cols)
    through_kernel = raw.is_cuda if kernel is None else kernel
    if through_kernel:
        kernel_call(values, scales, rows).launch()
        return
    scale = (scales.to(torch.int32) << 23).view(torch.float32)
    decoded = values.view(torch.float8_e4m3fn).to(torch.float32).view(n, -1, MXFP8_BLOCK)
    rows.view(n, -1, MXFP8_BLOCK).copy_((decoded * scale[:, :, None]).to(torch.bfloat16))


def kernel_call(values: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor) -> KernelCall:
    """vLLM's ``_engram_lookup_kernel`` over served rows: ``values`` (FP8 bytes
    ``[n, cols]``), ``scales`` (``[n, cols/32]``) into ``rows`` (BF16 ``[n, cols]``),
    with ids ``0..n-1``, one head, the whole range owned, unsorted.

    ``sorted_dst`` gets the ids, as vLLM passes its indices when it does not
    sort: on CUDA ``SORTED`` is a runtime argument, so the sorted branch is
    compiled as well and needs a pointer there (``kernel_call``)."""
    from vllm.models.deepseek_v41.common.engram import _engram_lookup_kernel
    from vllm.triton_utils import triton

    n, cols = rows.shape
    grid = triton.cdiv(n, 16)
    ids = torch.arange(n, dtype=torch.int64, device=rows.device).view(n, 1)
    return KernelCall(
        _engram_lookup_kernel,
        (grid,),
        (
            values.view(torch.float8_e4m3fn),
            scales,
            ids,
            ids,  # sorted_dst: unread unless SORTED
            rows,
            0,
            n,
            n,
            1,
            1,
        ),
        dict(
            HEAD_START=0,
            LOCAL_HEADS=1,
            TOTAL_HEADS=1,
            DIM=cols,
            QUANT_BLOCK=MXFP8_BLOCK,
            BLOCK_R=16,
            GRID=grid,
            SORTED=False,
            PACKED=False,
            OUT_STRIDE=cols,
        ),
    )


class Mxfp8Rows:
    """Served Engram rows, decoded into the BF16 output (``lookups.RowEncoding``)."""

    def __init__(self, cols: int) -> None:
        self.cols = cols
        self.row_bytes = row_bytes(cols)

    def write(self, out: torch.Tensor, fill) -> None:
        raw = torch.empty(
            (out.numel() // self.cols, self.row_bytes), dtype=torch.uint8, device=out.device
        )
        fill(raw)
        decode_into(raw, out)
