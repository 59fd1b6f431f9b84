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


class DecodeBuffers:
    """What decoding up to ``rows`` served rows of ``cols`` columns takes beside
    its output, made once: the served rows, their values and scales apart (the
    kernel reads each as a table of its own) and the ids ``0..rows-1``."""

    def __init__(self, rows: int, cols: int, device: torch.device) -> None:
        self.rows = rows
        self.raw = torch.empty((rows, row_bytes(cols)), dtype=torch.uint8, device=device)
        self.device = self.raw.device  # ("cuda" made "cuda:<current>")
        self.values = torch.empty((rows, cols), dtype=torch.uint8, device=device)
        self.scales = torch.empty((rows, cols // MXFP8_BLOCK), dtype=torch.uint8, device=device)
        self.ids = torch.arange(rows, dtype=torch.int64, device=device).view(rows, 1)

    def holds(self, rows: int, device: torch.device) -> bool:
        return rows <= self.rows and device == self.device


def decode_into(
    raw: torch.Tensor,
    out: torch.Tensor,
    *,
    kernel: bool | None = None,
    buffers: DecodeBuffers | None = None,
) -> None:
    """Decode served rows ``raw`` (uint8 ``[n, cols + cols/32]``) into ``out``
    (contiguous BF16, ``n * cols`` elements). ``kernel``: through vLLM's
    Triton kernel (default: on CUDA), else through torch. ``buffers``: where
    the values, scales and ids go (else temporaries).

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
    ids = None
    if buffers is not None and buffers.holds(n, raw.device):
        values = buffers.values[:n].copy_(raw[:, :cols])
        scales = buffers.scales[:n].copy_(raw[:, cols:])
        ids = buffers.ids[:n]
    else:
        values = raw[:, :cols].contiguous()
        scales = raw[:, cols:].contiguous()
    rows = out.view(n, cols)
    through_kernel = raw.is_cuda if kernel is None else kernel
    if through_kernel:
        kernel_call(values, scales, rows, ids).launch()
        return
    scale = (scales.to(torch.int32) << 23).view(torch.float32)
    decoded = values.view(torch.float8_e4m3fn).to(torch.float32).view(n, -1, MXFP8_BLOCK)
    rows.view(n, -1, MXFP8_BLOCK).copy_((decoded * scale[:, :, None]).to(torch.bfloat16))


def kernel_call(
    values: torch.Tensor,
    scales: torch.Tensor,
    rows: torch.Tensor,
    ids: torch.Tensor | None = None,
) -> KernelCall:
    """vLLM's ``_engram_lookup_kernel`` over served rows: ``values`` (FP8 bytes
    ``[n, cols]``), ``scales`` (``[n, cols/32]``) into ``rows`` (BF16 ``[n, cols]``),
    with ids ``0..n-1`` (``ids``, int64 ``[n, 1]``, or made here), one head, the
    whole range owned, unsorted.

    ``sorted_dst`` gets the ids, as vLLM passes its indices when it does not
    sort: on CUDA ``SORTED`` is a runtime argument, so the sorted branch is
    compiled as well and needs a pointer there (``pleclient.vllm_plugin.kernel_call``)."""
    from vllm.models.deepseek_v41.common.engram import _engram_lookup_kernel
    from vllm.triton_utils import triton

    n, cols = rows.shape
    grid = triton.cdiv(n, 16)
    if ids is None:
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
    """Served Engram rows, decoded into the BF16 output (``lookups.RowEncoding``).

    With ``max_rows`` and a CUDA ``device``, what a lookup of up to that many
    rows takes beside its output is made here, when the layer is built
    (``DecodeBuffers``): vLLM sizes its KV cache from a profile run that skips
    the Engram layers, so GPU memory a step takes in them must be taken
    before it, as stock's own ``staged_rows`` is. A larger lookup (none in a
    step of at most the engine's batched tokens) takes temporaries."""

    def __init__(self, cols: int, max_rows: int = 0, device: torch.device | None = None) -> None:
        self.cols = cols
        self.row_bytes = row_bytes(cols)
        self.buffers = (
            DecodeBuffers(max_rows, cols, device)
            if max_rows > 0 and device is not None and device.type == "cuda"
            else None
        )

    def write(self, out: torch.Tensor, fill) -> None:
        n = out.numel() // self.cols
        if self.buffers is not None and self.buffers.holds(n, out.device):
            raw = self.buffers.raw[:n]
        else:
            raw = torch.empty((n, self.row_bytes), dtype=torch.uint8, device=out.device)
        fill(raw)
        decode_into(raw, out, buffers=self.buffers)
