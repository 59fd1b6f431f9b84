"""Is the server serving the checkpoint vLLM loads? Checked before any lookup.

The table a layer will read is compared on three sides:

* the checkpoint vLLM loads (``pleclient.checkpoint.discover_tables`` over the
  directory of ``--model``, or ``VLLM_PLE_SHM_CHECKPOINT``): layer, rows, cols,
  dtype, parts, scale and the table fingerprint (sampled rows of every shard);
* the server's catalog entry for that table (``TableInfo``);
* the geometry the model was built with (rows = the padded n-gram vocabulary,
  cols = the head dimension, the row dtype its quantization method expects, and
  the bytes of a served row in that dtype: NVFP4 ``cols/2 + cols/16``).

Any difference stops startup with an error that prints both sides.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass
from typing import TypeVar

from pleclient import TableInfo
from pleclient.checkpoint import (
    ITEMSIZE,
    CheckpointError,
    TableSpec,
    discover_tables,
    local_model_dir,
)
from pleclient.families.deepseek_v41 import MXFP8, MXFP8_BLOCK
from pleclient.families.qwen4_exp import NVFP4, NVFP4_BLOCK
from pleclient.vllm_plugin.errors import IdentityMismatch, PleBackendError
from pleclient.vllm_plugin.settings import ENV_ALLOW_DUMMY, ENV_CHECKPOINT

log = logging.getLogger("pleclient.vllm_plugin")

_LAYER_TABLE_RE = re.compile(r"(?:^|\.)(layers\.(\d+)\.ple\.ple_embedding)(?:\.|$)")


@dataclass(frozen=True)
class Expected:
    """What the model built around one layer needs from its table."""

    prefix: str  # the module prefix of the layer's embedding in vLLM
    rows: int
    cols: int
    dtypes: tuple[str, ...]  # row dtypes the model can use unchanged
    parts: int
    table: str | None = None
    """How the table's name ends, when the prefix does not say (an Engram
    layer: ``layers.<L>.engram.embed``); None: a PLE layer's, from the prefix."""
    rows_at_least: bool = False
    """``rows`` is what the model addresses, and a checkpoint table may hold
    more (vLLM's Engram loader reads the first ``rows``); else exactly."""

    @property
    def table_suffix(self) -> str:
        """How checkpoint table names end for this layer, whatever prefix the
        checkpoint uses: ``table``, or ``layers.<L>.ple.ple_embedding.ngram_embedding``."""
        if self.table is not None:
            return self.table
        m = _LAYER_TABLE_RE.search(self.prefix)
        if m is None:
            raise PleBackendError(
                f"cannot tell which PLE layer {self.prefix!r} is (no 'layers.<L>.ple."
                "ple_embedding' in its name); this model layout is not supported"
            )
        return f"{m.group(1)}.ngram_embedding"

    def row_bytes(self, dtype: str) -> int:
        """Bytes of one served row of ``dtype`` for this layer's ``cols``."""
        if dtype == NVFP4:
            return self.cols // 2 + self.cols // NVFP4_BLOCK
        if dtype == MXFP8:
            return self.cols + self.cols // MXFP8_BLOCK
        return self.cols * ITEMSIZE[dtype]


_Table = TypeVar("_Table", TableInfo, TableSpec)


def select(tables: list[_Table], suffix: str, where: str) -> _Table:
    """The one table (TableInfo or TableSpec) whose name ends with ``suffix``."""
    matches = [t for t in tables if t.name == suffix or t.name.endswith("." + suffix)]
    if len(matches) == 1:
        return matches[0]
    known = ", ".join(t.name for t in tables) or "none"
    what = "several tables" if matches else "no table"
    raise IdentityMismatch(f"{where} has {what} for {suffix}; its tables: {known}")


def verify(
    server: TableInfo, socket: str, checkpoint: TableSpec, checkpoint_dir: str, expected: Expected
) -> None:
    """Raise IdentityMismatch naming both sides unless all three agree."""
    fields = (
        "layer",
        "rows",
        "cols",
        "dtype",
        "row_bytes",
        "parts",
        "shard_size",
        "scale",
        "fingerprint",
    )
    diffs = [
        f"{f}: server {getattr(server, f)!r} ≠ checkpoint {getattr(checkpoint, f)!r}"
        for f in fields
        if getattr(server, f) != getattr(checkpoint, f)
    ]
    if diffs:
        raise IdentityMismatch(
            f"ple-server at {socket} serves {server.name} from another checkpoint than "
            f"the one vLLM loads ({checkpoint_dir}): " + "; ".join(diffs) + ". Restart "
            f"ple-server with --model {checkpoint_dir} (the checkpoint vLLM loads), or "
            "start vLLM on the checkpoint the server serves."
        )
    model: list[tuple[str, object, object]] = [
        (f, getattr(checkpoint, f), want)
        for f, want in (("rows", expected.rows), ("cols", expected.cols), ("parts", expected.parts))
        if getattr(checkpoint, f) != want
        and not (f == "rows" and expected.rows_at_least and checkpoint.rows > want)
    ]
    if checkpoint.dtype not in expected.dtypes:
        model.append(("dtype", checkpoint.dtype, " or ".join(expected.dtypes)))
    elif checkpoint.row_bytes != expected.row_bytes(checkpoint.dtype):
        model.append(("row_bytes", checkpoint.row_bytes, expected.row_bytes(checkpoint.dtype)))
    if model:
        raise IdentityMismatch(
            f"{checkpoint.name} in {checkpoint_dir} does not fit the model vLLM built for "
            f"{expected.prefix}: "
            + "; ".join(
                f"{f}: checkpoint {have!r}, model expects {want!r}" for f, have, want in model
            )
            + ". The checkpoint and the model config disagree; check --model."
        )


def checkpoint_dir(
    override: str | None = None, *, model: str | None = None, revision: str | None = None
) -> str:
    """The local directory of the checkpoint vLLM loads: ``override``, else
    ``model`` (vLLM's ``--model``, at ``revision``), else the model of vLLM's
    current config."""
    path: str | None
    if override:
        path = override
        source = ENV_CHECKPOINT
    else:
        path, revision = (model, revision) if model else _vllm_model()
        source = "vLLM's --model"
        if path:  # a repo id: its snapshot in the local cache, as vLLM loads it
            path = local_model_dir(path, revision)
    if not path or not os.path.isdir(path):
        raise PleBackendError(
            f"VLLM_PLE_BACKEND=shm cannot find the checkpoint to check the server "
            f"against ({source} is {path!r}, not a local directory); set "
            f"{ENV_CHECKPOINT} to the model's local snapshot directory"
        )
    return os.path.abspath(path)


@functools.lru_cache(maxsize=4)
def checkpoint_tables(model_dir: str) -> list[TableSpec]:
    """The checkpoint's PLE tables with fingerprints (read once per process)."""
    try:
        return discover_tables(model_dir, fingerprint=True)
    except CheckpointError as exc:
        raise IdentityMismatch(
            f"VLLM_PLE_BACKEND=shm cannot read the PLE tables of the checkpoint vLLM "
            f"loads, so it cannot check that ple-server serves the same one: {exc}\n"
            f"(with --load-format dummy, set {ENV_ALLOW_DUMMY}=1 to run without PLE rows)"
        ) from None


def load_format() -> str | None:
    try:
        from vllm.config import get_current_vllm_config

        load_config = get_current_vllm_config().load_config
    except Exception:  # no config context: not a vLLM run
        return None
    return str(getattr(load_config, "load_format", None) or "") or None


def _vllm_model() -> tuple[str | None, str | None]:
    try:
        from vllm.config import get_current_vllm_config

        model_config = get_current_vllm_config().model_config
    except Exception:
        return None, None
    if model_config is None:
        return None, None
    return getattr(model_config, "model", None), getattr(model_config, "revision", None)
