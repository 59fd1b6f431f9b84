"""DeepSeek-V4.1: its Engram tables' tensors, and their rules.

An Engram table (vLLM 0.33's ``vllm/models/deepseek_v41/common/engram.py``) is
one layer's hashed n-gram embedding, stored as two tensors:

* ``<prefix>.layers.<L>.engram.embed.weight``: F8_E4M3 ``[rows, cols]``;
* ``<prefix>.layers.<L>.engram.embed.scale``: F8_E8M0 ``[rows, cols/32]``, one
  UE8M0 scale (a power of two, ``2^(e-127)``) per 32-column block.

``L`` is the 0-based decoder layer (DeepSeek-V4.1-Flash: 1 and 14). Neither
tensor is split into ``shard_<i>`` tensors: a table is one part. There is no
global scale. Such a table has dtype ``MXFP8`` and is served as one row of
``cols + cols/32`` bytes: the FP8 values, then their scales, the layout of
vLLM's own packed Engram rows (``_engram_lookup_kernel`` with ``PACKED``), so
that one lookup returns everything the layer needs.
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
    rows_problems,
    tensor_problems,
)
from pleclient.families.base import TableFamily, built

VALUES_RE = re.compile(r"^(?P<table>(?:.*\.)?layers\.(?P<layer>\d+)\.engram\.embed)\.weight$")
SCALES_RE = re.compile(r"^(?P<table>(?:.*\.)?layers\.(?P<layer>\d+)\.engram\.embed)\.scale$")

TABLE_NAME = "layers.{layer}.engram.embed"
"""How an Engram table's name ends (any prefix before it), for a layer ``L``."""
MXFP8 = "MXFP8"
"""The dtype name of an Engram table: FP8 E4M3 values + a UE8M0 scale a block."""
MXFP8_BLOCK = 32
"""Columns per Engram block scale (vLLM's ``QUANT_BLOCK``)."""

SEGMENTS = (
    SegmentRule(
        name="values",
        tensor="weight",
        dtype="F8_E4M3",
        per_element=1,
        noun="Engram values",
        not_2d="{e.path}: tensor {e.name} has shape {shape}; Engram values must be 2-D "
        "[rows, cols]",
        missing="{name}: no {name}.weight; the checkpoint is incomplete",
    ),
    SegmentRule(
        name="scales",
        tensor="scale",
        dtype="F8_E8M0",
        per_element=MXFP8_BLOCK,
        noun="Engram scales",
        not_2d="{e.path}: tensor {e.name} has shape {shape}; Engram scales must be 2-D "
        f"[rows, cols/{MXFP8_BLOCK}]",
        missing="{name}: no {name}.scale (F8_E8M0, one scale per "
        f"{MXFP8_BLOCK} columns); the checkpoint is incomplete",
        what="scales",
    ),
)
"""An Engram table's two segments: FP8 values, then their block scales."""


class EngramTables(TableFamily):
    name = "DeepSeek-V4.1 Engram"
    naming = "…layers.<L>.engram.embed.weight and .scale"

    def owns(self, tensor: str) -> bool:
        return bool(VALUES_RE.match(tensor) or SCALES_RE.match(tensor))

    def configures(self, text_config: dict) -> bool:
        return bool(text_config.get("engram_layer_ids"))

    def hasher(self, model_dir: str) -> Any:
        from pleclient.engram import EngramHasher  # (it names tables: this module's)

        return EngramHasher.from_checkpoint(model_dir)

    def tables(self, entries: Iterable[TensorEntry]) -> tuple[list[TableSpec], list[str]]:
        found: dict[str, list[dict[int, TensorEntry]]] = {}
        problems: list[str] = []
        for entry in entries:
            for i, pattern in enumerate((VALUES_RE, SCALES_RE)):
                if m := pattern.match(entry.name):
                    segments = found.setdefault(m["table"], [{}, {}])
                    if 0 in segments[i]:
                        problems.append(
                            f"{entry.name}: duplicate tensor, in {segments[i][0].path} and "
                            f"{entry.path}; remove the stale copy"
                        )
                    else:
                        segments[i][0] = entry
        tables, table_problems = built(_build_table(n, s) for n, s in sorted(found.items()))
        return tables, problems + table_problems


ENGRAM = EngramTables()


def _build_table(
    name: str, segments: list[dict[int, TensorEntry]]
) -> tuple[TableSpec | None, list[str]]:
    """A table from its values and scales tensors, or every problem found:
    each on its own, then the two against each other once both are sound."""
    problems: list[str] = []
    for rule, entries in zip(SEGMENTS, segments, strict=True):
        problems += tensor_problems(rule, entries) + coverage_problems(name, rule, entries, 1)
    if problems:
        return None, problems
    values, scales = segments[0][0], segments[1][0]
    cols = values.shape[1]
    if cols % MXFP8_BLOCK:
        problems.append(
            f"{values.path}: tensor {values.name}: {cols} columns, not a multiple of "
            f"the Engram block size {MXFP8_BLOCK}"
        )
    elif scales.shape[1] != cols // MXFP8_BLOCK:
        problems.append(
            f"{scales.path}: tensor {scales.name} has {scales.shape[1]} scales per row, "
            f"but {cols}-column rows need {cols // MXFP8_BLOCK} (one per {MXFP8_BLOCK} "
            "columns)"
        )
    problems += rows_problems(SEGMENTS[1], segments[0], segments[1])
    if problems:
        return None, problems
    rows = values.shape[0]
    return TableSpec(
        name=name,
        layer=int(VALUES_RE.match(values.name)["layer"]),  # type: ignore[index]
        dtype=MXFP8,
        cols=cols,
        rows=rows,
        parts=1,
        shard_size=rows,
        segments=[
            rule.segment(cols, MXFP8, entries, 1)
            for rule, entries in zip(SEGMENTS, segments, strict=True)
        ],
        files=sorted({values.path, scales.path}),
    ), []
