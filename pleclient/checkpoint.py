"""Find and validate the PLE tables of a safetensors checkpoint.

Shared by the server (which serves the tables) and the vLLM plugin (which checks
that the server serves the checkpoint vLLM loads). Reads headers and a few
sampled rows only; never the tables themselves.

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

import errno
import glob
import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass, field

import numpy as np

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
INDEX_FILE = "model.safetensors.index.json"

NVFP4 = "NVFP4"
"""The dtype name of an NVFP4 table (packed E2M1 values + E4M3 block scales)."""
NVFP4_BLOCK = 16
"""Columns per NVFP4 block scale (vLLM's ``_NVFP4_BLOCK_SIZE``)."""

ITEMSIZE = {
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "U8": 1,
    "I8": 1,
    "I16": 2,
    "I32": 4,
    "I64": 8,
    "F64": 8,
    "BOOL": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "F8_E8M0": 1,
    "F4": 1,
}
TABLE_DTYPES = {"F8_E4M3": True, "F8_E5M2": True, "BF16": False}
"""Supported row dtypes, and whether each needs a ``weight_scale``."""
SCALE_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": None}


class CheckpointError(ValueError):
    """The checkpoint cannot be served; ``problems`` lists every reason found."""

    def __init__(self, model_dir: str, problems: list[str]) -> None:
        self.model_dir = model_dir
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"checkpoint {model_dir}: {len(problems)} problem(s):\n{lines}")


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: absolute file offset, length, dtype, shape."""

    name: str
    path: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShardSpec:
    index: int
    path: str
    offset: int  # absolute byte offset of row 0 in the file
    rows: int


@dataclass(frozen=True)
class Segment:
    """One run of columns of a served row, stored as its own shard tensors.

    A served row is its segments' bytes one after the other: one segment for
    BF16/FP8 tables, two for NVFP4 (packed values, then block scales)."""

    name: str
    row_bytes: int
    shards: list[ShardSpec]
    dtype: str  # of the segment's tensors
    tensor: str = "weight"  # their name after ``shard_<i>.``


@dataclass(frozen=True)
class _SegmentRule:
    """What the shard tensors of one segment must be, and the words in which
    a problem with them is reported.

    A table is validated per segment, as the server reads it (the native
    gather composes a served row from its segments): each segment's tensors on
    their own, then what relates the segments of a table (columns, rows per
    shard), then what the table needs besides (its global scale)."""

    name: str  # the Segment's
    tensor: str  # the tensors' name after ``shard_<i>.``
    dtype: str | None  # required; None: the shards' own, one of TABLE_DTYPES
    per_element: int  # table columns per element of a tensor row
    noun: str  # the tensors, in the problems' words
    not_2d: str  # a tensor that is not 2-D ({e}: the TensorEntry)
    missing: str  # shard indices without a tensor ({name}, {shown}, {last})
    what: str = ""  # what a row needs of this segment (a later segment's rows)

    def width(self, cols: int) -> int:
        """The tensors' second dimension for a table of ``cols`` columns."""
        return cols // self.per_element

    def row_bytes(self, cols: int, dtype: str) -> int:
        return self.width(cols) * ITEMSIZE[self.dtype or dtype]


_ROWS = _SegmentRule(
    name="rows",
    tensor="weight",
    dtype=None,
    per_element=1,
    noun="shards",
    not_2d="{e.name}: shard is not 2-D (shape must be [rows, cols])",
    missing="{name}: missing shard indices {shown} of 0..{last}; the checkpoint is incomplete",
)
"""The one segment of a BF16 or FP8 table: its whole rows."""
_NVFP4_SEGMENTS = (
    _SegmentRule(
        name="values",
        tensor="weight",
        dtype="U8",
        per_element=2,
        noun="NVFP4 values",
        not_2d="{e.path}: tensor {e.name} has shape {shape}; NVFP4 values must be 2-D "
        "[rows, cols/2]",
        missing="{name}: missing shard indices {shown} of 0..{last} (shard_<i>.weight); the "
        "checkpoint is incomplete",
    ),
    _SegmentRule(
        name="block_scales",
        tensor="weight_scale",
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


def _segment_rules(dtype: str) -> tuple[_SegmentRule, ...]:
    return _NVFP4_SEGMENTS if dtype == NVFP4 else (_ROWS,)


@dataclass
class TableSpec:
    """One PLE table: geometry, its shards on disk, scale and fingerprint."""

    name: str
    layer: int
    dtype: str
    cols: int
    rows: int
    parts: int
    shard_size: int
    shards: list[ShardSpec]
    scale: float | None = None  # FP8: weight_scale; NVFP4: weight_scale_2
    fingerprint: str = ""
    files: list[str] = field(default_factory=list)
    block_scale_shards: list[ShardSpec] = field(default_factory=list)  # NVFP4 only

    @property
    def row_bytes(self) -> int:
        return sum(rule.row_bytes(self.cols, self.dtype) for rule in _segment_rules(self.dtype))

    @property
    def segments(self) -> list[Segment]:
        """The served row's segments, in row order (see ``Segment``)."""
        shards = [self.shards, self.block_scale_shards]
        return [
            Segment(
                rule.name,
                rule.row_bytes(self.cols, self.dtype),
                shards[i],
                rule.dtype or self.dtype,
                rule.tensor,
            )
            for i, rule in enumerate(_segment_rules(self.dtype))
        ]

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def info(self) -> dict:
        """The catalog entry sent to clients (see ``pleclient.TableInfo``)."""
        return {
            "name": self.name,
            "layer": self.layer,
            "rows": self.rows,
            "cols": self.cols,
            "dtype": self.dtype,
            "row_bytes": self.row_bytes,
            "scale": self.scale,
            "fingerprint": self.fingerprint,
            "shard_size": self.shard_size,
            "parts": self.parts,
        }


def read_header(path: str) -> tuple[dict[str, TensorEntry], list[str]]:
    """Parse a safetensors header; returns (tensors, problems). Never raises on
    bad content: every problem names the file and what to do."""
    problems: list[str] = []
    at = None  # the offset being read, once the file is open
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            at = 0
            head = f.read(8)
            if len(head) < 8:
                return {}, [
                    f"{path}: {size} bytes, too short for a safetensors header "
                    "(truncated download? fetch the file again)"
                ]
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8:
                return {}, [
                    f"{path}: header length {header_len} runs past the end of the "
                    f"{size}-byte file (truncated or not safetensors; fetch it again)"
                ]
            at = 8
            raw = f.read(header_len)
    except OSError as exc:
        where = "" if at is None else f" at offset {at}"
        return {}, [
            f"{path}: cannot read{where} ({exc.strerror}); check the path and that the "
            "server's user may read the model directory"
        ]
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as exc:
        return {}, [
            f"{path}: malformed safetensors header ({exc}); the file is corrupt, fetch it again"
        ]
    data_start = 8 + header_len
    tensors: dict[str, TensorEntry] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = str(meta["dtype"])
            shape = tuple(int(d) for d in meta["shape"])
            start, end = (int(v) for v in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            problems.append(f"{path}: tensor {name}: malformed header entry {meta!r}")
            continue
        if not 0 <= start <= end or data_start + end > size:
            problems.append(
                f"{path}: tensor {name}: data offsets [{start}, {end}) lie outside the "
                f"file ({size - data_start} data bytes); the file is truncated or corrupt"
            )
            continue
        tensors[name] = TensorEntry(name, path, data_start + start, end - start, dtype, shape)
    return tensors, problems


PLE_TENSOR_RES = (SHARD_RE, SCALE_RE, BLOCK_SCALE_RE, GLOBAL_SCALE_RE)


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hf_cache_dir() -> str:
    """The Hugging Face hub cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``,
    else ``~/.cache/huggingface/hub`` (huggingface_hub's own order)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return os.path.join(home, "hub")


def local_model_dir(model: str, revision: str | None = None) -> str:
    """``model`` itself when it is a directory; else, for a Hugging Face repo id
    (``org/name``) already downloaded, its snapshot directory in the local
    cache (at ``revision``, a branch, tag or commit; default ``main``), as vLLM
    finds it; else ``model`` unchanged, for the caller's error to name. Never
    downloads: ple-server reads what vLLM will load."""
    if os.path.isdir(model) or not _REPO_ID.fullmatch(model) or os.path.exists(model):
        return model
    repo = os.path.join(hf_cache_dir(), "models--" + model.replace("/", "--"))
    ref = revision or "main"
    try:
        with open(os.path.join(repo, "refs", ref)) as f:
            commit = f.read().strip()
    except OSError:
        commit = ref  # a commit hash names its snapshot directly
    snapshot = os.path.join(repo, "snapshots", commit)
    return snapshot if commit and os.path.isdir(snapshot) else model


def checkpoint_files(model_dir: str) -> tuple[list[str], list[str]]:
    """Files that may hold PLE tensors: from the index when there is one, else a
    glob. ``model_dir`` may be a Hugging Face repo id (``local_model_dir``)."""
    model_dir = local_model_dir(model_dir)
    if not os.path.isdir(model_dir):
        repo = (
            f" nor a Hugging Face repo id in the local cache ({hf_cache_dir()}: download it "
            f"first, e.g. `huggingface-cli download {model_dir}`)"
            if _REPO_ID.fullmatch(model_dir)
            else ""
        )
        return [], [
            f"{model_dir}: not a directory{repo}; pass the model's local snapshot "
            "directory (the one with config.json and *.safetensors)"
        ]
    if not os.access(model_dir, os.R_OK | os.X_OK):  # a glob would find nothing, silently
        return [], [
            f"cannot read the model directory {model_dir} (Permission denied for uid "
            f"{os.geteuid()}): let this user read it and its files"
        ]
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return [], [f"{index_path}: unreadable index ({exc}); fix or remove it"]
        names = sorted(
            {fn for name, fn in weight_map.items() if any(r.match(name) for r in PLE_TENSOR_RES)}
        )
        files, problems = [], []
        for fn in names:
            path = os.path.join(model_dir, fn)
            if os.path.exists(path):
                files.append(path)
            else:
                problems.append(
                    f"{index_path} names {fn}, which does not exist; the download is incomplete"
                )
        return files, problems
    return sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))), []


def discover_tables(model_dir: str, *, fingerprint: bool = True) -> list[TableSpec]:
    """Every PLE table in ``model_dir``, validated; raises CheckpointError listing
    every problem found (or when there is no table at all). ``model_dir`` may
    be a Hugging Face repo id in the local cache (``local_model_dir``)."""
    model_dir = local_model_dir(model_dir)
    if os.path.isdir(model_dir):  # (a repo id not found stays one, for the error)
        model_dir = os.path.abspath(model_dir)
    files, problems = checkpoint_files(model_dir)
    shards: dict[str, dict[int, TensorEntry]] = {}
    block_scales: dict[str, dict[int, TensorEntry]] = {}
    scales: dict[str, TensorEntry] = {}
    global_scales: dict[str, TensorEntry] = {}
    for path in files:
        tensors, file_problems = read_header(path)
        problems += file_problems
        for name, entry in tensors.items():
            if m := SHARD_RE.match(name) or BLOCK_SCALE_RE.match(name):
                table, index = m["table"], int(m["index"])
                into = shards if m.re is SHARD_RE else block_scales
                previous = into.setdefault(table, {}).get(index)
                if previous is not None:
                    problems.append(
                        f"{name}: duplicate shard, in {previous.path} and "
                        f"{path}; remove the stale copy"
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
    tables = []
    for name in sorted(shards, key=lambda t: (_table_layer(t), t)):
        segments = [shards[name]] + ([block_scales[name]] if name in block_scales else [])
        table, table_problems = _build_table(
            name, segments, scales.get(name), global_scales.get(name)
        )
        problems += table_problems
        if table is not None:
            tables.append(table)
    if not tables and not problems:
        problems.append(
            f"no PLE tables (tensors named …layers.<L>.ple.ple_embedding."
            f"ngram_embedding.shard_<i>.weight) in {len(files)} safetensors "
            "file(s); is this the right model directory?"
        )
    if problems:
        raise CheckpointError(model_dir, problems)
    if fingerprint:
        for table in tables:
            table.fingerprint = table_fingerprint(table)
    return tables


def _table_layer(table: str) -> int:
    """The layer of a table named from a SHARD_RE match."""
    m = SHARD_RE.match(table + ".shard_0.weight")
    assert m is not None, table
    return int(m["layer"])


def _tensor_problems(
    name: str, rule: _SegmentRule, entries: dict[int, TensorEntry]
) -> tuple[str, list[str]]:
    """One segment's tensors, each on its own: dtype, 2-D, data size. Returns
    the segment's dtype (a table of _ROWS: its shards') and the problems."""
    problems: list[str] = []
    dtype = rule.dtype
    if dtype is None:  # the shards decide: one dtype, and one that is served
        dtypes = sorted({e.dtype for e in entries.values()})
        dtype = dtypes[0]
        if len(dtypes) > 1:
            problems.append(
                f"{name}: shards have mixed dtypes {dtypes}; every shard must have the same dtype"
            )
        if dtype == "U8":
            problems.append(
                f"{name}: U8 shards without block scales: an NVFP4 table also needs "
                f"{name}.shard_<i>.weight_scale (F8_E4M3, [rows, cols/16]) per shard and "
                f"{name}.weight_scale_2; use the checkpoint's original files"
            )
        elif dtype not in TABLE_DTYPES:
            problems.append(
                f"{name}: unsupported dtype {dtype} (supported: {', '.join(TABLE_DTYPES)}, {NVFP4})"
            )
    for _, e in sorted(entries.items()):
        if rule.dtype is not None and e.dtype != rule.dtype:
            problems.append(
                f"{e.path}: tensor {e.name} is {e.dtype}, but {rule.noun} must be "
                f"{rule.dtype} (vLLM loads them without a cast); use the checkpoint's "
                "original files"
            )
        elif len(e.shape) != 2:
            problems.append(rule.not_2d.format(e=e, shape=list(e.shape)))
        elif e.dtype in ITEMSIZE and e.nbytes != e.shape[0] * e.shape[1] * ITEMSIZE[e.dtype]:
            problems.append(
                f"{e.path}: tensor {e.name}: {e.nbytes} data bytes, but shape "
                f"{list(e.shape)} × {ITEMSIZE[e.dtype]} bytes is "
                f"{e.shape[0] * e.shape[1] * ITEMSIZE[e.dtype]}"
            )
    return dtype, problems


def _coverage_problems(
    name: str, rule: _SegmentRule, entries: dict[int, TensorEntry], parts: int
) -> list[str]:
    """One segment's tensors together: all as wide, one for every shard."""
    problems = []
    widths = sorted({e.shape[1] for e in entries.values() if len(e.shape) == 2})
    if len(widths) > 1:
        problems.append(
            f"{name}: {rule.noun} have mixed widths {widths}; every shard must "
            "have the same number of columns"
        )
    missing = sorted(set(range(parts)) - set(entries))
    if missing:
        problems.append(rule.missing.format(name=name, shown=_shown(missing), last=parts - 1))
    return problems


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
    rules = _NVFP4_SEGMENTS if len(segments) > 1 else (_ROWS,)
    parts = max(max(entries) for entries in segments) + 1
    problems: list[str] = []
    sound = True  # every segment: sound tensors, one per shard, one width
    dtype = NVFP4
    for rule, entries in zip(rules, segments, strict=True):
        segment_dtype, own = _tensor_problems(name, rule, entries)
        own += _coverage_problems(name, rule, entries, parts)
        if rule.dtype is None:  # the table's dtype is its rows'
            dtype = segment_dtype
        problems += own
        sound = sound and not own
    cols = 0
    if sound:
        cols = segments[0][0].shape[1] * rules[0].per_element
        if dtype == NVFP4:
            problems += _nvfp4_column_problems(segments[0][0], segments[1][0])
        for rule, entries in zip(rules[1:], segments[1:], strict=True):
            problems += _segment_rows_problems(rule, segments[0], entries)
    if dtype == NVFP4:
        scale_value, scale_problems = _nvfp4_scale(name, global_scale, scale)
    else:
        scale_value, scale_problems = _rows_scale(name, dtype, scale)
    problems += scale_problems
    if problems:
        return None, problems
    rows, shard_size, problems = _layout(segments[0], parts)
    if problems:
        return None, problems
    return TableSpec(
        name=name,
        layer=_table_layer(name),
        dtype=dtype,
        cols=cols,
        rows=rows,
        parts=parts,
        shard_size=shard_size,
        shards=_shard_specs(segments[0], parts),
        scale=scale_value,
        files=sorted({e.path for entries in segments for e in entries.values()}),
        block_scale_shards=_shard_specs(segments[1], parts) if len(segments) > 1 else [],
    ), []


def _segment_rows_problems(
    rule: _SegmentRule, first: dict[int, TensorEntry], entries: dict[int, TensorEntry]
) -> list[str]:
    """A later segment against the first: as many rows in every shard."""
    return [
        f"{e.path}: tensor {e.name} has {e.shape[0]} rows, but {first[i].name} has "
        f"{first[i].shape[0]}; every row needs its {rule.what}"
        for i, e in sorted(entries.items())
        if e.shape[0] != first[i].shape[0]
    ]


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


def _shard_specs(entries: dict[int, TensorEntry], parts: int) -> list[ShardSpec]:
    """Where each of ``parts`` shards starts, from its tensor entry."""
    return [
        ShardSpec(i, entries[i].path, entries[i].offset, entries[i].shape[0]) for i in range(parts)
    ]


def _layout(entries: dict[int, TensorEntry], parts: int) -> tuple[int, int, list[str]]:
    """(rows, shard_size, problems): every shard must hold ``ceil(rows/parts)``
    rows, the last one what is left."""
    problems = []
    rows = sum(e.shape[0] for e in entries.values())
    shard_size = math.ceil(rows / parts)
    for i in range(parts):
        expected = max(0, min(shard_size, rows - i * shard_size))
        if entries[i].shape[0] != expected:
            problems.append(
                f"{entries[i].path}: tensor {entries[i].name} has {entries[i].shape[0]} rows, "
                f"expected {expected} (layout ceil({rows}/{parts}) = {shard_size} rows per "
                "shard, last shard partial)"
            )
    return rows, shard_size, problems


def _shown(indices: list[int]) -> str:
    return ", ".join(map(str, indices[:10])) + (" …" if len(indices) > 10 else "")


def read_scale(entry: TensorEntry) -> tuple[float | None, str | None]:
    """The global FP8 (``weight_scale``) or NVFP4 (``weight_scale_2``) scale as a
    float, or a problem text."""
    count = math.prod(entry.shape)
    if entry.dtype not in SCALE_DTYPES or count != 1:
        return None, (
            f"{entry.path}: tensor {entry.name}: expected one F32/F16/BF16 "
            f"value, found {entry.dtype} of shape {list(entry.shape)}"
        )
    raw = read_at(entry.path, [entry.offset], entry.nbytes)[0]
    if entry.dtype == "BF16":
        value = np.frombuffer(raw[:2] + b"", dtype="<u2").astype("<u4") << 16
        return float(value.view("<f4")[0]), None
    return float(np.frombuffer(raw, dtype=SCALE_DTYPES[entry.dtype])[0]), None


def table_fingerprint(table: TableSpec) -> str:
    """A stable, cheap identity: geometry, scale and sampled rows of every shard.

    Independent of how the shards are spread over files, so a re-packed copy of
    the same checkpoint has the same fingerprint."""
    h = hashlib.sha256()
    h.update(json.dumps([table.dtype, table.cols, table.rows, table.parts, table.scale]).encode())
    segments = table.segments
    for i, shard in enumerate(table.shards):
        h.update(struct.pack("<QQ", shard.index, shard.rows))
        if shard.rows == 0:
            continue
        # Each segment's sampled rows in turn (NVFP4: values, then block
        # scales); one segment hashes exactly as before segments existed.
        for segment in segments:
            part = segment.shards[i]
            rows = sorted({0, shard.rows // 2, shard.rows - 1})
            offsets = [part.offset + r * segment.row_bytes for r in rows]
            for row in read_at(part.path, offsets, segment.row_bytes):
                h.update(row)
    return h.hexdigest()[:32]


def read_at(path: str, offsets: list[int], size: int) -> list[bytes]:
    """``size`` bytes at each of ``offsets`` of ``path`` (fewer at the end of
    the file). An OSError names the file and the offset that failed: a disk
    error (EIO) says where, not only what."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        out = []
        for offset in offsets:
            try:
                out.append(os.pread(fd, size, offset))
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"reading {size} bytes at offset {offset} of {path}: {exc.strerror}"
                    + (" (a disk error? see the kernel log)" if exc.errno == errno.EIO else ""),
                ) from None
        return out
    finally:
        os.close(fd)
