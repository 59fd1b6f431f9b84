"""Synthetic PLE checkpoints for the demo, the tests and the benchmarks.

Writes real safetensors files in the layout of Qwen3.8-Flash-Next's PLE tables
(shards split ``ceil(rows/parts)``, partial last shard, optional global FP8
scale, an index file) with deterministic pseudo-random rows that are never
NaN or Inf, so dequantized values compare exactly.

``dtype="NVFP4"`` writes vLLM's NVFP4 layout: per shard ``shard_<i>.weight``
(U8 ``[rows, cols/2]``, packed E2M1) and ``shard_<i>.weight_scale`` (F8_E4M3
``[rows, cols/16]``, positive finite block scales), and one F32
``weight_scale_2``. ``shard_bytes`` gives the rows as the server serves them:
values, then block scales.

``dtype="MXFP8"`` writes a DeepSeek-V4.1 Engram table instead
(``pleclient.families.deepseek_v41``): ``layers.<L>.engram.embed.weight``
(F8_E4M3 ``[rows, cols]``) and ``.scale`` (F8_E8M0 ``[rows, cols/32]``, UE8M0
exponents near 2^0, so decoded values stay normal BF16), one part.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from pleclient.checkpoint import INDEX_FILE, ITEMSIZE, read_header
from pleclient.families.deepseek_v41 import MXFP8, MXFP8_BLOCK
from pleclient.families.qwen4_exp import NVFP4, NVFP4_BLOCK

TABLE_PREFIX = "model.layers.{layer}.ple.ple_embedding.ngram_embedding"
ENGRAM_PREFIX = "layers.{layer}.engram.embed"  # as DeepSeek-V4.1 names it, with no "model."
CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class SyntheticTable:
    layer: int
    rows: int
    cols: int = 160
    dtype: str = "BF16"
    parts: int = 8
    scale: float | None = None  # FP8 default: 0.0125; NVFP4 (weight_scale_2): 1/1024

    def __post_init__(self) -> None:
        if self.dtype == MXFP8 and self.parts != 1:
            raise ValueError(f"an Engram (MXFP8) table is one part, not {self.parts}")

    @property
    def name(self) -> str:
        return (ENGRAM_PREFIX if self.dtype == MXFP8 else TABLE_PREFIX).format(layer=self.layer)

    @property
    def row_bytes(self) -> int:
        if self.dtype == NVFP4:
            return self.cols // 2 + self.cols // NVFP4_BLOCK
        if self.dtype == MXFP8:
            return self.cols + self.cols // MXFP8_BLOCK
        return self.cols * ITEMSIZE[self.dtype]

    def tensors(self) -> list[tuple[str, str, int, int]]:
        """Each shard's tensors as ``(suffix, dtype, first byte, end byte)`` of the
        served row: one for BF16/FP8, values and block scales for NVFP4 and
        for Engram."""
        if self.dtype == NVFP4:
            packed = self.cols // 2
            return [
                ("weight", "U8", 0, packed),
                ("weight_scale", "F8_E4M3", packed, self.row_bytes),
            ]
        if self.dtype == MXFP8:
            return [
                ("weight", "F8_E4M3", 0, self.cols),
                ("scale", "F8_E8M0", self.cols, self.row_bytes),
            ]
        return [("weight", self.dtype, 0, self.row_bytes)]

    def tensor_name(self, index: int, suffix: str) -> str:
        """Shard ``index``'s tensor of ``suffix`` (an Engram table has no
        ``shard_<i>``)."""
        if self.dtype == MXFP8:
            return f"{self.name}.{suffix}"
        return f"{self.name}.shard_{index}.{suffix}"

    def global_scale(self) -> tuple[str, float] | None:
        """The global scale tensor's suffix and value, if the dtype has one."""
        if self.dtype == NVFP4:
            return "weight_scale_2", self.scale if self.scale is not None else 1 / 1024
        if self.dtype.startswith("F8"):
            return "weight_scale", self.scale if self.scale is not None else 0.0125
        return None

    def shard_rows(self) -> list[int]:
        size = math.ceil(self.rows / self.parts)
        return [max(0, min(size, self.rows - i * size)) for i in range(self.parts)]


DEMO_TABLES = (
    SyntheticTable(layer=1, rows=200_003, cols=160, dtype="F8_E4M3", parts=16),
    SyntheticTable(layer=3, rows=100_001, cols=160, dtype="BF16", parts=8),
    SyntheticTable(layer=5, rows=150_001, cols=160, dtype="NVFP4", parts=8),
)


def shard_bytes(table: SyntheticTable, index: int, seed: int = 0) -> np.ndarray:
    """The deterministic contents of one shard, as uint8 [rows, row_bytes]."""
    rows = table.shard_rows()[index]
    rng = np.random.default_rng([seed, table.layer, index])
    data = rng.integers(0, 256, size=(rows, table.row_bytes), dtype=np.uint8)
    return _without_nan(data, table.dtype)


def _without_nan(data: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "F8_E4M3":  # 0x7F / 0xFF are NaN
        data[(data & 0x7F) == 0x7F] ^= 0x01
    elif dtype == "F8_E5M2":  # exponent all ones: Inf / NaN
        data[(data & 0x7C) == 0x7C] ^= 0x40
    elif dtype == "BF16":
        words = data.view("<u2")
        words[(words & 0x7F80) == 0x7F80] ^= 0x4000
    elif dtype == NVFP4:  # any value byte is valid; block scales positive, finite
        scales = data[:, (data.shape[1] * 8) // 9 :]  # cols/2 values, then cols/16 scales
        scales &= 0x7F
        scales[scales == 0x7F] = 0x7E
    elif dtype == MXFP8:  # E4M3 values without NaN; UE8M0 exponents 2^-8 .. 2^11
        values_end = (data.shape[1] * MXFP8_BLOCK) // (MXFP8_BLOCK + 1)
        values = data[:, :values_end]
        values[(values & 0x7F) == 0x7F] ^= 0x01
        data[:, values_end:] = 119 + data[:, values_end:] % 20
    return data


# A tensor's bytes, or a callable returning an iterator of byte chunks.
Producer = bytes | Callable[[], Iterable[bytes]]


def write_safetensors(path: str, tensors: list[tuple[str, str, tuple[int, ...], Producer]]) -> None:
    """Write ``(name, dtype, shape, producer)`` tensors; a producer is bytes or a
    callable returning an iterator of byte chunks (for tables larger than RAM)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, _ in tensors:
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _name, _dtype, _shape, producer in tensors:
            chunks = (
                [producer] if isinstance(producer, (bytes, bytearray, memoryview)) else producer()
            )
            for chunk in chunks:
                f.write(chunk)
    os.replace(tmp, path)


def write_checkpoint(
    model_dir: str,
    tables: tuple[SyntheticTable, ...] | list[SyntheticTable] = DEMO_TABLES,
    *,
    files: int = 2,
    seed: int = 0,
    index: bool = True,
    extra_tensor: bool = True,
) -> str:
    """Write a checkpoint with ``tables`` spread over ``files`` safetensors files.

    The first file also holds a small non-PLE tensor (as real checkpoints mix
    tensors), which also puts the shards after it at an offset that is not a
    multiple of the row size. A table of one part has its segments' tensors
    in different files (an Engram table's values and scales)."""
    os.makedirs(model_dir, exist_ok=True)
    per_file: list[list] = [[] for _ in range(files)]
    if extra_tensor:
        per_file[0].append(("model.embed_tokens.weight", "BF16", (3, 5), bytes(30)))
    for table in tables:
        for i, rows in enumerate(table.shard_rows()):
            for j, (suffix, dtype, lo, hi) in enumerate(table.tensors()):
                name = table.tensor_name(i, suffix)
                shape = (rows, (hi - lo) // ITEMSIZE[dtype])
                where = j % files if table.parts == 1 else i * files // table.parts
                per_file[where].append(
                    (name, dtype, shape, _shard_producer(table, i, seed, lo, hi))
                )
        if (global_scale := table.global_scale()) is not None:
            suffix, value = global_scale
            per_file[-1].append((f"{table.name}.{suffix}", "F32", (), struct.pack("<f", value)))
    weight_map = {}
    for n, tensors in enumerate(per_file):
        filename = f"model-{n + 1:05d}-of-{files:05d}.safetensors"
        write_safetensors(os.path.join(model_dir, filename), tensors)
        weight_map.update({name: filename for name, *_ in tensors})
    if index:
        with open(os.path.join(model_dir, INDEX_FILE), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(
            {
                "ple_tables": [
                    {
                        "layer": t.layer,
                        "rows": t.rows,
                        "cols": t.cols,
                        "dtype": t.dtype,
                        "parts": t.parts,
                    }
                    for t in tables
                ]
            },
            f,
            indent=1,
        )
    return model_dir


def _shard_producer(table: SyntheticTable, index: int, seed: int, lo: int, hi: int):
    """Bytes ``[lo, hi)`` of every served row of one shard: one tensor's data."""
    rows = table.shard_rows()[index]
    rows_per_chunk = max(1, CHUNK_BYTES // table.row_bytes)

    def produce():
        if rows * table.row_bytes <= CHUNK_BYTES:
            yield np.ascontiguousarray(shard_bytes(table, index, seed)[:, lo:hi]).tobytes()
            return
        rng = np.random.default_rng([seed, table.layer, index])
        for start in range(0, rows, rows_per_chunk):
            n = min(rows_per_chunk, rows - start)
            chunk = rng.integers(0, 256, size=(n, table.row_bytes), dtype=np.uint8)
            chunk = _without_nan(chunk, table.dtype)
            yield np.ascontiguousarray(chunk[:, lo:hi]).tobytes()

    return produce


def read_reference(model_dir: str, table_name: str) -> np.ndarray:
    """The whole table as uint8 [rows, row_bytes], read with plain file reads
    (independent of the server's mmap code; for tests on small tables). An
    NVFP4 row is its packed values, then its block scales, as served; an
    Engram row its FP8 values, then its scales."""
    entries = {}
    for fn in sorted(os.listdir(model_dir)):
        if fn.endswith(".safetensors"):
            tensors, problems = read_header(os.path.join(model_dir, fn))
            assert not problems, problems
            entries.update(tensors)
    by_suffix: dict[str, list] = {}
    for n, e in entries.items():
        if n.startswith(table_name + ".shard_"):
            index, suffix = n[len(table_name + ".shard_") :].split(".", 1)
            by_suffix.setdefault(suffix, []).append((int(index), e))
        elif n in (table_name + ".weight", table_name + ".scale"):  # an Engram table's
            by_suffix.setdefault(n[len(table_name) + 1 :], []).append((0, e))
    columns = []
    for suffix in ("weight", "weight_scale", "scale"):  # the served row's order
        parts = []
        for _, e in sorted(by_suffix.get(suffix, []), key=lambda t: t[0]):
            with open(e.path, "rb") as f:
                f.seek(e.offset)
                raw = np.frombuffer(f.read(e.nbytes), dtype=np.uint8)
                parts.append(raw.reshape(e.shape[0], -1))
        if parts:
            columns.append(np.concatenate(parts))
    return np.concatenate(columns, axis=1) if len(columns) > 1 else columns[0]
