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
"""

from __future__ import annotations

from pleclient.families.base import TableFamily
from pleclient.families.deepseek_v41 import ENGRAM
from pleclient.families.qwen4_exp import QWEN4_EXP

FAMILIES: tuple[TableFamily, ...] = (QWEN4_EXP, ENGRAM)
"""Every family ``pleclient.checkpoint.discover_tables`` looks for."""
