"""Model families: how each names and lays out its hashed n-gram tables.

A family reads the tensors of a checkpoint (``pleclient.checkpoint``'s
``TensorEntry``, every file's) and builds the tables it finds into
``TableSpec``\\ s: their served rows' segments, shards and scale, each table
validated per segment. Everything past that — the server, the native data
plane, the row cache, the protocol — sees only the ``TableSpec``: a table of
``rows`` rows of ``row_bytes`` bytes, composed from its segments.

The families, in ``FAMILIES``:

* ``qwen4_exp``: Qwen4Exp / Qwen3.8-Flash-Next's PLE tables (BF16, FP8,
  NVFP4), split into ``shard_<i>`` tensors;
* ``deepseek_v41``: DeepSeek-V4.1's Engram tables (FP8 E4M3 values with a
  UE8M0 scale per 32 columns), one tensor of each a layer.

Each family also names its hasher (``pleclient.ngram``, ``pleclient.engram``:
a layer's row ids from token ids, without the model), which ``hasher_for``
picks by the model's config; the vLLM plugin's per-family files
(``pleclient/vllm_plugin/qwen4_exp.py``, ``deepseek_v41.py``) are the rest of
each adapter.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pleclient.families.base import TableFamily
from pleclient.families.deepseek_v41 import ENGRAM
from pleclient.families.qwen4_exp import QWEN4_EXP

FAMILIES: tuple[TableFamily, ...] = (QWEN4_EXP, ENGRAM)
"""Every family ``pleclient.checkpoint.discover_tables`` looks for."""


def hasher_for(model_dir: str) -> Any:
    """The hasher of the checkpoint's family (``TableFamily.hasher``): the
    family whose layers its config names, else Qwen4Exp's PLE (whose hasher
    says what it cannot read)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = {}
    text = config.get("text_config") or config if isinstance(config, dict) else {}
    for family in FAMILIES:
        if isinstance(text, dict) and family.configures(text):
            return family.hasher(model_dir)
    return QWEN4_EXP.hasher(model_dir)
