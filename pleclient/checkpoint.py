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
        if self.dtype == NVFP4:
            return self.cols // 2 + self.cols // NVFP4_BLOCK
        return self.cols * ITEMSIZE[self.dtype]

    @property
    def segments(self) -> list[Segment]:
        """The served row's segments, in row order (see ``Segment``)."""
        if self.dtype == NVFP4:
            return [
                Segment("values", self.cols // 2, self.shards, "U8"),
                Segment(
                    "block_scales",
                    self.cols // NVFP4_BLOCK,
                    self.block_scale_shards,
                    "F8_E4M3",
                    "weight_scale",
                ),
            ]
        return [Segment("rows", self.row_bytes, self.shards, self.dtype)]

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


def checkpoint_files(model_dir: str) -> tuple[list[str], list[str]]:
    """Files that may hold PLE tensors: from the index when there is one, else a glob."""
    if not os.path.isdir(model_dir):
        return [], [
            f"{model_dir}: not a directory; pass the model's local snapshot "
            "directory (the one with config.json and *.safetensors)"
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
    every problem found (or when there is no table at all)."""
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
        if name in block_scales:
            table, table_problems = _build_nvfp4_table(
                name, shards[name], block_scales[name], global_scales.get(name), scales.get(name)
            )
        else:
            table, table_problems = _build_table(name, shards[name], scales.get(name))
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


def _build_table(
    name: str, entries: dict[int, TensorEntry], scale: TensorEntry | None
) -> tuple[TableSpec | None, list[str]]:
    problems: list[str] = []
    layer = _table_layer(name)
    dtypes = sorted({e.dtype for e in entries.values()})
    if len(dtypes) > 1:
        problems.append(
            f"{name}: shards have mixed dtypes {dtypes}; every shard must have the same dtype"
        )
    dtype = dtypes[0]
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
    widths = sorted({e.shape[1] if len(e.shape) == 2 else -1 for e in entries.values()})
    if -1 in widths:
        bad = [e.name for e in entries.values() if len(e.shape) != 2]
        problems.append(f"{bad[0]}: shard is not 2-D (shape must be [rows, cols])")
    elif len(widths) > 1:
        problems.append(
            f"{name}: shards have mixed widths {widths}; every shard must "
            "have the same number of columns"
        )
    for e in entries.values():
        if (
            dtype in ITEMSIZE
            and len(e.shape) == 2
            and e.nbytes != e.shape[0] * e.shape[1] * ITEMSIZE.get(e.dtype, 0)
        ):
            problems.append(
                f"{e.path}: tensor {e.name}: {e.nbytes} data bytes, but shape "
                f"{list(e.shape)} × {ITEMSIZE.get(e.dtype)} bytes is "
                f"{e.shape[0] * e.shape[1] * ITEMSIZE.get(e.dtype, 0)}"
            )
    parts = max(entries) + 1
    missing = sorted(set(range(parts)) - set(entries))
    if missing:
        problems.append(
            f"{name}: missing shard indices {_shown(missing)} of 0..{parts - 1}; the "
            "checkpoint is incomplete"
        )
    needs_scale = TABLE_DTYPES.get(dtype, False)
    scale_value = None
    if needs_scale and scale is None:
        problems.append(
            f"{name}: {dtype} shards need {name}.weight_scale, which is "
            "missing; use the checkpoint's original files"
        )
    elif scale is not None and needs_scale:
        scale_value, scale_problem = read_scale(scale)
        if scale_problem:
            problems.append(scale_problem)
    if problems:
        return None, problems
    rows, shard_size, problems = _layout(entries, parts)
    if problems:
        return None, problems
    shard_specs = _shard_specs(entries, parts)
    return TableSpec(
        name=name,
        layer=layer,
        dtype=dtype,
        cols=widths[0],
        rows=rows,
        parts=parts,
        shard_size=shard_size,
        shards=shard_specs,
        scale=scale_value,
        files=sorted({e.path for e in entries.values()}),
    ), []


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


def _build_nvfp4_table(
    name: str,
    values: dict[int, TensorEntry],
    block_scales: dict[int, TensorEntry],
    global_scale: TensorEntry | None,
    unsharded_scale: TensorEntry | None,
) -> tuple[TableSpec | None, list[str]]:
    """An NVFP4 table: U8 values and F8_E4M3 block scales per shard, one global
    F32 ``weight_scale_2`` (the layout vLLM's NVFP4 PLE ``load_weights`` takes)."""
    problems: list[str] = []
    kinds = (
        ("values", values, "U8", "[rows, cols/2]"),
        ("block scales", block_scales, "F8_E4M3", f"[rows, cols/{NVFP4_BLOCK}]"),
    )
    for what, entries, dtype, shape in kinds:
        for _, e in sorted(entries.items()):
            if e.dtype != dtype:
                problems.append(
                    f"{e.path}: tensor {e.name} is {e.dtype}, but NVFP4 {what} must be "
                    f"{dtype} (vLLM loads them without a cast); use the checkpoint's "
                    "original files"
                )
            elif len(e.shape) != 2:
                problems.append(
                    f"{e.path}: tensor {e.name} has shape {list(e.shape)}; NVFP4 {what} "
                    f"must be 2-D {shape}"
                )
            elif e.nbytes != e.shape[0] * e.shape[1]:
                problems.append(
                    f"{e.path}: tensor {e.name}: {e.nbytes} data bytes, but shape "
                    f"{list(e.shape)} × 1 bytes is {e.shape[0] * e.shape[1]}"
                )
    if problems:
        return None, problems
    parts = max(max(values), max(block_scales)) + 1
    missing = sorted(set(range(parts)) - set(values))
    if missing:
        problems.append(
            f"{name}: missing shard indices {_shown(missing)} of 0..{parts - 1} "
            "(shard_<i>.weight); the checkpoint is incomplete"
        )
    missing = sorted(set(range(parts)) - set(block_scales))
    if missing:
        problems.append(
            f"{name}: missing NVFP4 block scales for shard indices {_shown(missing)} of "
            f"0..{parts - 1} (shard_<i>.weight_scale); the checkpoint is incomplete"
        )
    for what, entries, _dtype, _shape in kinds:
        widths = sorted({e.shape[1] for e in entries.values()})
        if len(widths) > 1:
            problems.append(
                f"{name}: NVFP4 {what} have mixed widths {widths}; every shard must "
                "have the same number of columns"
            )
    if problems:
        return None, problems
    packed = values[0].shape[1]
    cols = 2 * packed
    scale_width = block_scales[0].shape[1]
    if cols % NVFP4_BLOCK:
        problems.append(
            f"{values[0].path}: tensor {values[0].name}: {packed} packed bytes per row are "
            f"{cols} columns, not a multiple of the NVFP4 block size {NVFP4_BLOCK}"
        )
    elif scale_width != cols // NVFP4_BLOCK:
        problems.append(
            f"{block_scales[0].path}: tensor {block_scales[0].name} has {scale_width} block "
            f"scales per row, but {cols}-column rows ({packed} packed bytes) need "
            f"{cols // NVFP4_BLOCK} (one per {NVFP4_BLOCK} columns)"
        )
    for i in range(parts):
        if block_scales[i].shape[0] != values[i].shape[0]:
            problems.append(
                f"{block_scales[i].path}: tensor {block_scales[i].name} has "
                f"{block_scales[i].shape[0]} rows, but {values[i].name} has "
                f"{values[i].shape[0]}; every row needs its block scales"
            )
    if unsharded_scale is not None:
        problems.append(
            f"{unsharded_scale.path}: tensor {unsharded_scale.name}: an unsharded "
            "weight_scale beside NVFP4 shards (vLLM refuses it: NVFP4 block scales are "
            "shard_<i>.weight_scale, the global scale is weight_scale_2); remove it"
        )
    scale_value = None
    if global_scale is None:
        problems.append(
            f"{name}: NVFP4 shards need {name}.weight_scale_2 (the global scale), which "
            "is missing; use the checkpoint's original files"
        )
    else:
        scale_value, scale_problem = read_scale(global_scale)
        if scale_problem:
            problems.append(scale_problem)
    if problems:
        return None, problems
    rows, shard_size, problems = _layout(values, parts)
    if problems:
        return None, problems

    return TableSpec(
        name=name,
        layer=_table_layer(name),
        dtype=NVFP4,
        cols=cols,
        rows=rows,
        parts=parts,
        shard_size=shard_size,
        shards=_shard_specs(values, parts),
        scale=scale_value,
        files=sorted({e.path for e in (*values.values(), *block_scales.values())}),
        block_scale_shards=_shard_specs(block_scales, parts),
    ), []


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
