"""Qwen4Exp / Qwen3.8-Flash-Next: its PLE tables' tensors, and their rules.

A PLE table is the set of tensors
``<prefix>.layers.<L>.ple.ple_embedding.ngram_embedding.shard_<i>.weight``
(``i`` in ``0..parts-1``; shard ``i`` holds global rows
``[i*shard_size, i*shard_size + rows_i)`` with ``shard_size = ceil(rows/parts)``),
plus ``….ngram_embedding.weight_scale`` — one global scale, required for FP8.

NVFP4 tables (vLLM's ``Qwen4ExpPLENvFp4EmbeddingMethod``) have two tensors per
shard and a global scale of another name:

* ``….shard_<i>.weight``: U8 ``[rows_i, cols/2]``, two E2M1 values per byte
  (the low nibble holds the even column);
* ``….shard_<i>.weight_scale``: F8_E4M3 ``[rows_i, cols/16]``, one scale per
  16-column block;
* ``….ngram_embedding.weight_scale_2``: the global F32 scale.

Such a table has dtype ``NVFP4`` and is served as one row of
``cols/2 + cols/16`` bytes: the packed values, then the block scales (its two
``segments``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from pleclient.checkpoint import (
    SegmentRule,
    TableSpec,
    TensorEntry,
    coverage_problems,
    layout,
    read_scale,
    rows_problems,
    segment_dtype,
    tensor_problems,
)
from pleclient.families.base import TableFamily, built
from pleclient.ngram import NgramHasher

SHARD_RE = re.compile(
    r"^(?P<table>(?:.*\.)?layers\.(?P<layer>\d+)\.ple\.ple_embedding\.ngram_embedding)"
    r"\.shard_(?P<index>\d+)\.weight$"
)
SCALE_RE = re.compile(
    r"^(?P<table>(?:.*\.)?layers\.(?P<layer>\d+)\.ple\.ple_embedding\.ngram_embedding)"
    r"\.weight_scale$"
)
BLOCK_SCALE_RE = re.compile(
    r"^(?P<table>(?:.*\.)?layers\.(?P<layer>\d+)\.ple\.ple_embedding\.ngram_embedding)"
    r"\.shard_(?P<index>\d+)\.weight_scale$"
)
GLOBAL_SCALE_RE = re.compile(
    r"^(?P<table>(?:.*\.)?layers\.(?P<layer>\d+)\.ple\.ple_embedding\.ngram_embedding)"
    r"\.weight_scale_2$"
)
TENSOR_RES = (SHARD_RE, SCALE_RE, BLOCK_SCALE_RE, GLOBAL_SCALE_RE)

NVFP4 = "NVFP4"
"""The dtype name of an NVFP4 table (packed E2M1 values + E4M3 block scales)."""
NVFP4_BLOCK = 16
"""Columns per NVFP4 block scale (vLLM's ``_NVFP4_BLOCK_SIZE``)."""
TABLE_DTYPES = {"F8_E4M3": True, "F8_E5M2": True, "BF16": False}
"""Supported row dtypes, and whether each needs a ``weight_scale``."""

ROWS = SegmentRule(
    name="rows",
    tensor="shard_<i>.weight",
    dtype=None,
    per_element=1,
    noun="shards",
    not_2d="{e.name}: shard is not 2-D (shape must be [rows, cols])",
    missing="{name}: missing shard indices {shown} of 0..{last}; the checkpoint is incomplete",
)
"""The one segment of a BF16 or FP8 table: its whole rows."""
NVFP4_SEGMENTS = (
    SegmentRule(
        name="values",
        tensor="shard_<i>.weight",
        dtype="U8",
        per_element=2,
        noun="NVFP4 values",
        not_2d="{e.path}: tensor {e.name} has shape {shape}; NVFP4 values must be 2-D "
        "[rows, cols/2]",
        missing="{name}: missing shard indices {shown} of 0..{last} (shard_<i>.weight); the "
        "checkpoint is incomplete",
    ),
    SegmentRule(
        name="block_scales",
        tensor="shard_<i>.weight_scale",
        dtype="F8_E4M3",
        per_element=NVFP4_BLOCK,
        noun="NVFP4 block scales",
        not_2d="{e.path}: tensor {e.name} has shape {shape}; NVFP4 block scales must be 2-D "
        f"[rows, cols/{NVFP4_BLOCK}]",
        missing="{name}: missing NVFP4 block scales for shard indices {shown} of 0..{last} "
        "(shard_<i>.weight_scale); the checkpoint is incomplete",
        what="block scales",
    ),
)
"""An NVFP4 table's two segments: packed E2M1 values, then their block scales."""


class Qwen4ExpTables(TableFamily):
    name = "Qwen4Exp PLE"
    naming = "…layers.<L>.ple.ple_embedding.ngram_embedding.shard_<i>.weight"

    def owns(self, tensor: str) -> bool:
        return any(r.match(tensor) for r in TENSOR_RES)

    def configures(self, text_config: dict) -> bool:
        return bool(text_config.get("ple_layer_ids"))

    def hasher(self, model_dir: str) -> Any:
        return NgramHasher.from_checkpoint(model_dir)

    def tables(self, entries: Iterable[TensorEntry]) -> tuple[list[TableSpec], list[str]]:
        shards: dict[str, dict[int, TensorEntry]] = {}
        block_scales: dict[str, dict[int, TensorEntry]] = {}
        scales: dict[str, TensorEntry] = {}
        global_scales: dict[str, TensorEntry] = {}
        problems: list[str] = []
        for entry in entries:
            name = entry.name
            if m := SHARD_RE.match(name) or BLOCK_SCALE_RE.match(name):
                table, index = m["table"], int(m["index"])
                into = shards if m.re is SHARD_RE else block_scales
                previous = into.setdefault(table, {}).get(index)
                if previous is not None:
                    problems.append(
                        f"{name}: duplicate shard, in {previous.path} and "
                        f"{entry.path}; remove the stale copy"
                    )
                    continue
                into[table][index] = entry
            elif m := SCALE_RE.match(name):
                scales[m["table"]] = entry
            elif m := GLOBAL_SCALE_RE.match(name):
                global_scales[m["table"]] = entry
        for name in sorted(set(block_scales) - set(shards)):
            problems.append(
                f"{name}: block scales (shard_<i>.weight_scale) without any "
                f"shard_<i>.weight tensors; the checkpoint is incomplete"
            )
        tables, table_problems = built(
            _build_table(
                name,
                [shards[name]] + ([block_scales[name]] if name in block_scales else []),
                scales.get(name),
                global_scales.get(name),
            )
            for name in sorted(shards)
        )
        return tables, problems + table_problems


QWEN4_EXP = Qwen4ExpTables()


def _build_table(
    name: str,
    segments: list[dict[int, TensorEntry]],
    scale: TensorEntry | None,
    global_scale: TensorEntry | None,
) -> tuple[TableSpec | None, list[str]]:
    """A table from its segments' shard tensors (``shard_<i>.weight``, and for
    NVFP4 ``shard_<i>.weight_scale``) and its scale tensors, or every problem
    found: each segment on its own, then the segments against each other once
    each is sound, then the scale; the layout last, on a sound table."""
    rules = NVFP4_SEGMENTS if len(segments) > 1 else (ROWS,)
    parts = max(max(entries) for entries in segments) + 1
    problems: list[str] = []
    sound = True  # every segment: sound tensors, one per shard, one width
    dtype = NVFP4
    for rule, entries in zip(rules, segments, strict=True):
        segment_type, own = segment_dtype(name, rule, entries)
        if rule.dtype is None:  # the table's dtype is its rows'
            dtype = segment_type
            own += _row_dtype_problems(name, dtype)
        own += tensor_problems(rule, entries)
        own += coverage_problems(name, rule, entries, parts)
        problems += own
        sound = sound and not own
    cols = 0
    if sound:
        cols = segments[0][0].shape[1] * rules[0].per_element
        if dtype == NVFP4:
            problems += _nvfp4_column_problems(segments[0][0], segments[1][0])
        for rule, entries in zip(rules[1:], segments[1:], strict=True):
            problems += rows_problems(rule, segments[0], entries)
    if dtype == NVFP4:
        scale_value, scale_problems = _nvfp4_scale(name, global_scale, scale)
    else:
        scale_value, scale_problems = _rows_scale(name, dtype, scale)
    problems += scale_problems
    if problems:
        return None, problems
    rows, shard_size, problems = layout(segments[0], parts)
    if problems:
        return None, problems
    return TableSpec(
        name=name,
        layer=int(SHARD_RE.match(name + ".shard_0.weight")["layer"]),  # type: ignore[index]
        dtype=dtype,
        cols=cols,
        rows=rows,
        parts=parts,
        shard_size=shard_size,
        segments=[
            rule.segment(cols, dtype, entries, parts)
            for rule, entries in zip(rules, segments, strict=True)
        ],
        scale=scale_value,
        files=sorted({e.path for entries in segments for e in entries.values()}),
    ), []


def _row_dtype_problems(name: str, dtype: str) -> list[str]:
    """Rows of a dtype this family serves (U8 alone: NVFP4 values without
    their block scales)."""
    if dtype == "U8":
        return [
            f"{name}: U8 shards without block scales: an NVFP4 table also needs "
            f"{name}.shard_<i>.weight_scale (F8_E4M3, [rows, cols/16]) per shard and "
            f"{name}.weight_scale_2; use the checkpoint's original files"
        ]
    if dtype not in TABLE_DTYPES:
        return [
            f"{name}: unsupported dtype {dtype} (supported: {', '.join(TABLE_DTYPES)}, {NVFP4})"
        ]
    return []


def _nvfp4_column_problems(values: TensorEntry, block_scales: TensorEntry) -> list[str]:
    """Whole blocks of columns, and one block scale per block."""
    packed = values.shape[1]
    cols = 2 * packed
    if cols % NVFP4_BLOCK:
        return [
            f"{values.path}: tensor {values.name}: {packed} packed bytes per row are "
            f"{cols} columns, not a multiple of the NVFP4 block size {NVFP4_BLOCK}"
        ]
    scale_width = block_scales.shape[1]
    if scale_width != cols // NVFP4_BLOCK:
        return [
            f"{block_scales.path}: tensor {block_scales.name} has {scale_width} block "
            f"scales per row, but {cols}-column rows ({packed} packed bytes) need "
            f"{cols // NVFP4_BLOCK} (one per {NVFP4_BLOCK} columns)"
        ]
    return []


def _rows_scale(name: str, dtype: str, scale: TensorEntry | None) -> tuple[float | None, list[str]]:
    """An FP8 table's ``weight_scale`` (a BF16 table has none)."""
    if not TABLE_DTYPES.get(dtype, False):
        return None, []
    if scale is None:
        return None, [
            f"{name}: {dtype} shards need {name}.weight_scale, which is "
            "missing; use the checkpoint's original files"
        ]
    value, problem = read_scale(scale)
    return value, [problem] if problem else []


def _nvfp4_scale(
    name: str, global_scale: TensorEntry | None, unsharded_scale: TensorEntry | None
) -> tuple[float | None, list[str]]:
    """An NVFP4 table's global ``weight_scale_2``, and no unsharded
    ``weight_scale`` beside it (the layout vLLM's NVFP4 PLE ``load_weights``
    takes)."""
    problems = []
    if unsharded_scale is not None:
        problems.append(
            f"{unsharded_scale.path}: tensor {unsharded_scale.name}: an unsharded "
            "weight_scale beside NVFP4 shards (vLLM refuses it: NVFP4 block scales are "
            "shard_<i>.weight_scale, the global scale is weight_scale_2); remove it"
        )
    if global_scale is None:
        problems.append(
            f"{name}: NVFP4 shards need {name}.weight_scale_2 (the global scale), which "
            "is missing; use the checkpoint's original files"
        )
        return None, problems
    value, problem = read_scale(global_scale)
    return value, problems + ([problem] if problem else [])
