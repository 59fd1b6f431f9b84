"""Find and validate the hashed n-gram tables of a safetensors checkpoint.

Shared by the server (which serves the tables) and the vLLM plugin (which checks
that the server serves the checkpoint vLLM loads). Reads headers and a few
sampled rows only; never the tables themselves.

What a table is, for everyone past this module: a ``TableSpec`` of ``rows``
rows of ``row_bytes`` bytes, each row its ``segments``' bytes one after the
other, each segment stored as ``parts`` shard tensors (shard ``i`` holds rows
``[i*shard_size, i*shard_size + rows_i)`` with ``shard_size = ceil(rows/parts)``).
How a model family names and lays out its tables is the family's
(``pleclient.families``): Qwen4Exp's PLE tables in ``shard_<i>`` tensors,
DeepSeek-V4.1's Engram tables one tensor a segment. This module holds what
they share: reading headers, validating a segment's tensors, the layout, the
fingerprint, and ``discover_tables`` over every family.
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

INDEX_FILE = "model.safetensors.index.json"

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
    BF16/FP8 PLE tables, two for NVFP4 (packed values, then block scales) and
    for Engram (FP8 values, then UE8M0 scales)."""

    name: str
    row_bytes: int
    shards: list[ShardSpec]
    dtype: str  # of the segment's tensors
    tensor: str = "shard_<i>.weight"  # how its tensors' names end, after the table's


@dataclass(frozen=True)
class SegmentRule:
    """What the shard tensors of one segment must be, and the words in which
    a problem with them is reported.

    A table is validated per segment, as the server reads it (the native
    gather composes a served row from its segments): each segment's tensors on
    their own (``tensor_problems``, ``coverage_problems``), then what relates
    the segments of a table (``rows_problems``), then what the family needs
    besides (a global scale)."""

    name: str  # the Segment's
    tensor: str  # how the tensors' names end, after the table's (the Segment's)
    dtype: str | None  # required; None: the shards' own, which the family checks
    per_element: int  # table columns per element of a tensor row
    noun: str  # the tensors, in the problems' words
    not_2d: str  # a tensor that is not 2-D ({e}: the TensorEntry, {shape})
    missing: str  # shard indices without a tensor ({name}, {shown}, {last})
    what: str = ""  # what a row needs of this segment (a later segment's rows)

    def width(self, cols: int) -> int:
        """The tensors' second dimension for a table of ``cols`` columns."""
        return cols // self.per_element

    def row_bytes(self, cols: int, dtype: str) -> int:
        return self.width(cols) * ITEMSIZE[self.dtype or dtype]

    def segment(
        self, cols: int, dtype: str, entries: dict[int, TensorEntry], parts: int
    ) -> Segment:
        """The validated segment of a table of ``cols`` columns whose rows (the
        table's, when ``dtype`` is None) are ``dtype``."""
        return Segment(
            self.name,
            self.row_bytes(cols, dtype),
            shard_specs(entries, parts),
            self.dtype or dtype,
            self.tensor,
        )


@dataclass
class TableSpec:
    """One table: geometry, its segments' shards on disk, scale and
    fingerprint."""

    name: str
    layer: int
    dtype: str  # the served row's: a tensor dtype, or a family's name for a composed row
    cols: int
    rows: int
    parts: int
    shard_size: int
    segments: list[Segment]  # the served row's, in row order (see ``Segment``)
    scale: float | None = None  # FP8: weight_scale; NVFP4: weight_scale_2
    fingerprint: str = ""
    files: list[str] = field(default_factory=list)

    @property
    def shards(self) -> list[ShardSpec]:
        """The first segment's shards: where each part's rows start."""
        return self.segments[0].shards

    @property
    def row_bytes(self) -> int:
        return sum(segment.row_bytes for segment in self.segments)

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
    """Files that may hold a family's table tensors: from the index when there
    is one, else a glob. ``model_dir`` may be a Hugging Face repo id
    (``local_model_dir``)."""
    # (families import this module: its names are what they build tables of)
    from pleclient.families import FAMILIES

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
            {fn for name, fn in weight_map.items() if any(f.owns(name) for f in FAMILIES)}
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
    """Every table of every family (``pleclient.families``) in ``model_dir``,
    validated, by layer; raises CheckpointError listing every problem found
    (or when there is no table at all). ``model_dir`` may be a Hugging Face
    repo id in the local cache (``local_model_dir``)."""
    from pleclient.families import FAMILIES

    model_dir = local_model_dir(model_dir)
    if os.path.isdir(model_dir):  # (a repo id not found stays one, for the error)
        model_dir = os.path.abspath(model_dir)
    files, problems = checkpoint_files(model_dir)
    entries: list[TensorEntry] = []
    for path in files:
        tensors, file_problems = read_header(path)
        problems += file_problems
        entries += tensors.values()
    tables: list[TableSpec] = []
    for family in FAMILIES:
        found, family_problems = family.tables(entries)
        tables += found
        problems += family_problems
    if not tables and not problems:
        named = "; ".join(f"{f.name}: {f.naming}" for f in FAMILIES)
        problems.append(
            f"no PLE tables or other n-gram tables ({named}) in {len(files)} safetensors "
            "file(s); is this the right model directory?"
        )
    if problems:
        raise CheckpointError(model_dir, problems)
    tables.sort(key=lambda t: (t.layer, t.name))
    if fingerprint:
        for table in tables:
            table.fingerprint = table_fingerprint(table)
    return tables


def segment_dtype(
    name: str, rule: SegmentRule, entries: dict[int, TensorEntry]
) -> tuple[str, list[str]]:
    """The dtype of a segment's tensors: the rule's, or (a rule without one)
    the shards' own, which must be one."""
    if rule.dtype is not None:
        return rule.dtype, []
    dtypes = sorted({e.dtype for e in entries.values()})
    if len(dtypes) > 1:
        return dtypes[0], [
            f"{name}: shards have mixed dtypes {dtypes}; every shard must have the same dtype"
        ]
    return dtypes[0], []


def tensor_problems(rule: SegmentRule, entries: dict[int, TensorEntry]) -> list[str]:
    """One segment's tensors, each on its own: the rule's dtype, 2-D, data
    size."""
    problems: list[str] = []
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
    return problems


def coverage_problems(
    name: str, rule: SegmentRule, entries: dict[int, TensorEntry], parts: int
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


def rows_problems(
    rule: SegmentRule, first: dict[int, TensorEntry], entries: dict[int, TensorEntry]
) -> list[str]:
    """A later segment against the first: as many rows in every shard."""
    return [
        f"{e.path}: tensor {e.name} has {e.shape[0]} rows, but {first[i].name} has "
        f"{first[i].shape[0]}; every row needs its {rule.what}"
        for i, e in sorted(entries.items())
        if e.shape[0] != first[i].shape[0]
    ]


def shard_specs(entries: dict[int, TensorEntry], parts: int) -> list[ShardSpec]:
    """Where each of ``parts`` shards starts, from its tensor entry."""
    return [
        ShardSpec(i, entries[i].path, entries[i].offset, entries[i].shape[0]) for i in range(parts)
    ]


def layout(entries: dict[int, TensorEntry], parts: int) -> tuple[int, int, list[str]]:
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
