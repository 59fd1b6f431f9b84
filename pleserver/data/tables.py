"""A PLE table served from its safetensors files: open (or map) them, gather rows.

A table gathers through one native ``TableSource`` (``pleserver._native``),
whatever the io mode (``pleserver.data.plane`` chooses it):

- **direct / buffered**: rows come from the shared row cache; misses are read
  by the shared miss engine from the checkpoint files, opened with
  ``O_DIRECT`` (direct) or through the page cache (buffered);
- **mmap**: each checkpoint file is mapped once, read-only, with
  ``MADV_RANDOM`` (a row is 160–320 bytes: readahead would read many times the
  bytes used; never ``MADV_HUGEPAGE`` on these file mappings, it forces 2 MiB
  readahead), and the source gathers over the mappings: one native call per
  request, whatever the number of files and shards.

The mode is chosen once, as the table's class: a ``MappedTable`` (mmap) or a
``CachedTable`` (direct, buffered); what differs between them is theirs, and
nothing asks which mode it is per request.

Large requests (``parallel_min_rows`` or more) are split over native threads.
A checkpoint file changed under the server is caught by ``check_files``: its
tables then answer errors (``problem``): a truncated file's rows are gone and a
rewritten file would give other rows (in direct mode mixed with old rows still
in the cache). What of a mapped
table is in the page cache (prewarm, residency) is ``pleserver.data.prewarm``'s.

A row of several segments (an NVFP4 table's values and block scales, an
Engram table's FP8 values and UE8M0 scales) costs a read of each on a miss.
With ``resident_scales`` a cached table keeps its scale segments (every one
after the values) in memory of the source's own, read once at open, so a miss
is one read: the scales are 1/9 to 1/33 of the bytes, and half the reads.
"""

from __future__ import annotations

import logging
import mmap
import os
from abc import ABC, abstractmethod

import numpy as np

from pleclient.checkpoint import TableSpec

try:
    from pleserver import _native as nat
except ImportError as _exc:  # a source tree whose extension was never built
    raise ImportError(
        f"pleserver's native module is not built ({_exc}): install the "
        "package (pip install .), or in a source tree run "
        "`python setup.py build_ext --inplace`"
    ) from _exc

log = logging.getLogger("pleserver.table")

KEY_ROW_BITS = 40
"""A row cache key is ``(table_key << 40) | row`` (the native module's layout)."""
DEDUP_PIECE_ROWS = 16384
"""mmap mode: a large request's ids are deduplicated this many at a time, so
what it allocates (the distinct rows, the sort's index arrays) does not grow
with the request: ``DEDUP_PIECE_ROWS × (row_bytes + DEDUP_BYTES_PER_ID)`` a
gathering thread at most."""
DEDUP_BYTES_PER_ID = 64
"""What ``np.unique(…, return_inverse=True)`` holds per id besides the rows:
the sort's permutation and sorted copy, the mask, the inverse (8 bytes each)
and the unique ids, with room to spare."""


_METADATA = {"st_mode": "mode", "st_uid": "owner", "st_gid": "group", "st_nlink": "link count"}
"""What moves a file's ctime without touching its bytes (``CheckpointFile.check``)."""


def scale_segments(spec: TableSpec) -> tuple[int, ...]:
    """The segments of ``spec``'s rows after the first: its scales."""
    return tuple(range(1, len(spec.segments)))


def scale_bytes(specs: list[TableSpec]) -> int:
    """What keeping every table's scale segments in memory takes."""
    return sum(s.rows * sum(s.segments[g].row_bytes for g in scale_segments(s)) for s in specs)


class CheckpointFile:
    """One checkpoint file, opened once for every table in it (read-only).

    ``direct``: opened with ``O_DIRECT`` (reads bypass the page cache)."""

    HELD = "open"  # how the server holds the file, in messages

    def __init__(self, path: str, fd: int, direct: bool = False) -> None:
        self.path = path
        self.fd = fd
        self.direct = direct
        self.stat = os.fstat(fd)  # at open: what ``check`` compares against
        self.size = self.stat.st_size
        self.problem: str | None = None  # set for good once the file changed in place
        self.replaced = False  # the path names another file now (logged once)

    @classmethod
    def open(cls, path: str, direct: bool = False) -> CheckpointFile:
        """Raises OSError; EINVAL with ``direct`` means the file system refuses
        ``O_DIRECT``."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
        try:
            return cls(path, fd, direct)
        except BaseException:
            os.close(fd)
            raise

    @property
    def address(self) -> int:
        """Address of the file's mapping (0: not mapped)."""
        return 0

    def check(self) -> str | None:
        """Whether the file changed under the server (two stat calls).

        Changed in place (its size, its modification time, or its change time
        without any metadata change that would explain it — a rewrite whose
        mtime was put back moves the ctime, which no one can set): rows may be
        gone — a read comes back short, a mapped page past the new end fails
        its request — or different, so the problem is returned (and kept) and
        its tables answer errors. A ctime moved by a chmod, chown or link
        (mode, owner or link count changed) is logged, not a problem. Replaced
        (another file renamed over the path, as downloads and rsync do) or
        removed: the open file is still the old one, whole and consistent, so
        serving goes on; logged once."""
        if self.problem is None:
            try:
                st = os.fstat(self.fd)
            except OSError as exc:
                st, error = None, exc.strerror
            what = None
            if st is None:
                what = f"cannot stat it ({error})"
            elif st.st_size != self.stat.st_size:
                what = f"size {self.stat.st_size} → {st.st_size} bytes"
            elif st.st_mtime_ns != self.stat.st_mtime_ns:
                what = "rewritten in place, same size"
            elif st.st_ctime_ns != self.stat.st_ctime_ns:
                changed = [
                    name for name in _METADATA if getattr(st, name) != getattr(self.stat, name)
                ]
                if changed:
                    log.warning(
                        "checkpoint file %s: its %s changed; ple-server keeps serving it",
                        self.path,
                        ", ".join(_METADATA[name] for name in changed),
                    )
                    self.stat = st  # the ctime that explains, as the baseline
                else:
                    what = (
                        "rewritten in place, same size and modification time: its change "
                        "time moved with no chmod, chown or link to explain it"
                    )
            if what is not None:
                self.problem = (
                    f"checkpoint file {self.path} changed on disk while "
                    f"ple-server had it {self.HELD} ({what}); its tables are no "
                    "longer served: restore the file, then restart ple-server"
                )
                log.error("%s", self.problem)
        if not self.replaced:
            try:
                st = os.stat(self.path)
            except OSError:
                st = None
            if st is None or (st.st_dev, st.st_ino) != (self.stat.st_dev, self.stat.st_ino):
                self.replaced = True
                log.warning(
                    "checkpoint file %s was %s on disk; ple-server keeps serving the "
                    "file it had %s at start: restart it to serve the new one",
                    self.path,
                    "removed" if st is None else "replaced",
                    self.HELD,
                )
        return self.problem

    def close(self) -> None:
        os.close(self.fd)


class MappedFile(CheckpointFile):
    """A checkpoint file mapped read-only (mmap mode), once for every table in it."""

    HELD = "mapped"

    def __init__(self, path: str, fd: int) -> None:
        super().__init__(path, fd)
        self.mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ)
        self.mm.madvise(mmap.MADV_RANDOM)
        self.flat = np.frombuffer(self.mm, dtype=np.uint8)  # uint8 view of the mapping

    @classmethod
    def open(cls, path: str, direct: bool = False) -> MappedFile:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return cls(path, fd)
        except BaseException:
            os.close(fd)
            raise

    @property
    def address(self) -> int:
        return self.flat.ctypes.data

    def close(self) -> None:
        del self.flat
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere: the GC unmaps later
            log.debug("mapping of %s still referenced; left to the garbage collector", self.path)
        os.close(self.fd)


class Table(ABC):
    """Row gather over one PLE table's shards (see the module docstring); a
    ``MappedTable`` or a ``CachedTable``, by the io mode.

    ``key``: the table's number in the row cache's keys (and the hot-set file).
    ``cache`` and ``engine``: the row cache and the miss engine (a cached
    table's; None for a mapped one)."""

    mode: str  # the io mode, as config and stats name it

    def __init__(
        self,
        spec: TableSpec,
        key: int,
        files: dict[str, CheckpointFile],
        *,
        cache: nat.RowCache | None,
        engine: nat.ReadEngine | None,
        threads: int,
        parallel_min_rows: int,
        resident: tuple[int, ...] = (),
    ) -> None:
        self.spec = spec
        self.key = key
        self.row_bytes = spec.row_bytes
        self.rows = spec.rows
        self.threads = max(1, threads)
        self.parallel_min_rows = parallel_min_rows
        self.problem: str | None = None  # set by check_files: requests then fail
        self._files = [files[p] for p in spec.files]
        # One entry per segment of every shard, shard-major: an NVFP4 row is
        # gathered natively from its values and its block scales (see
        # ``TableSpec.segments``), and cached whole.
        segments = spec.segments
        shards = [
            (files[s.path].fd, s.offset, s.rows, s.path, files[s.path].address)
            for i in range(spec.parts)
            for s in (segment.shards[i] for segment in segments)
        ]
        direct = any(files[p].direct for p in spec.files)
        self.source = nat.TableSource(
            key,
            self.row_bytes,
            spec.shard_size,
            shards,
            cache,
            engine,
            direct,
            segments=[segment.row_bytes for segment in segments],
            resident=resident,
        )

    def check_files(self) -> str | None:
        """Check this table's files (``CheckpointFile.check``); the first problem
        found is kept in ``problem``."""
        for f in self._files:
            problem = f.check()
            if problem and self.problem is None:
                self.problem = problem
        return self.problem

    # ------------------------------------------------------------------ gather
    def _threads_for(self, n: int) -> int:
        return self.threads if n >= self.parallel_min_rows else 1

    def gather(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Write the rows of ``ids`` (int64, validated in ``[0, rows)``) into
        ``out`` (uint8 ``[len(ids), row_bytes]``, C-contiguous), in ids order.
        May block on disk reads; raises ``nat.ReadError`` when one fails."""
        if ids.shape[0]:
            self.source.gather(ids, out, self._threads_for(ids.shape[0]))

    @abstractmethod
    def gather_inline(self, ids: np.ndarray, out: np.ndarray) -> bool:
        """What the serving loop may answer without blocking other channels:
        True once every row is in ``out``."""

    @property
    def scratch_bytes(self) -> int:
        """What one thread gathering from this table natively allocates at
        most, the miss path's read buffers aside (those have a bound of their
        own, ``nat.set_read_memory``)."""
        return int(self.source.scratch_bytes)

    @property
    def dedup_scratch_bytes(self) -> int:
        """What a Python thread's ``gather`` allocates at most besides."""
        return 0

    @property
    def fill_scratch_bytes(self) -> int:
        """What a thread filling the row cache from this table allocates at most
        besides ``scratch_bytes`` (``fill``: the hot-set refill, the hint reader)."""
        return int(self.source.fill_scratch_bytes)

    def cached_mask(self, ids: np.ndarray) -> np.ndarray:
        """Whether each row of ``ids`` (int64, validated) is in the row cache
        (all False without one): no I/O, no counters, no use in the eviction
        policy."""
        return np.zeros(ids.shape[0], dtype=np.bool_)

    def fill(self, ids: np.ndarray) -> int:
        """Read the rows of ``ids`` into the row cache (hot-set refill); the
        number inserted."""
        return self.source.fill(ids)

    # ------------------------------------------------------------------ shards
    def shard_ranges(self) -> list[tuple[CheckpointFile, int, int]]:
        """(file, start offset, length) of every non-empty shard (of every
        segment: an NVFP4 table's values and block scales)."""
        by_path = {f.path: f for f in self._files}
        return [
            (by_path[s.path], s.offset, s.rows * segment.row_bytes)
            for segment in self.spec.segments
            for s in segment.shards
            if s.rows
        ]


class MappedTable(Table):
    """io = mmap: rows gathered over the files' mappings; the page cache is the
    cache (``pleserver.data.prewarm`` reads it in and measures it)."""

    mode = "mmap"

    def __init__(
        self,
        spec: TableSpec,
        key: int,
        files: dict[str, CheckpointFile],
        *,
        threads: int,
        parallel_min_rows: int,
        dedup_min_rows: int,
    ) -> None:
        super().__init__(
            spec,
            key,
            files,
            cache=None,
            engine=None,
            threads=threads,
            parallel_min_rows=parallel_min_rows,
        )
        self.dedup_min_rows = dedup_min_rows
        self.fully_resident = False  # set by a completed full prewarm

    def gather(self, ids: np.ndarray, out: np.ndarray) -> None:
        n = ids.shape[0]
        if n >= self.dedup_min_rows and not self.fully_resident:
            self._gather_dedup(ids, out, self._threads_for(n))
        else:
            super().gather(ids, out)

    def gather_inline(self, ids: np.ndarray, out: np.ndarray) -> bool:
        """The gather itself (page faults are the page cache's business)."""
        self.gather(ids, out)
        return True

    def _gather_dedup(self, ids: np.ndarray, out: np.ndarray, threads: int) -> None:
        """Cold mapped table, large request: read each distinct row once, in file
        order (sorted ids turn scattered page faults into ascending ones), then
        expand; ``DEDUP_PIECE_ROWS`` ids at a time."""
        for at in range(0, ids.shape[0], DEDUP_PIECE_ROWS):
            piece, into = ids[at : at + DEDUP_PIECE_ROWS], out[at : at + DEDUP_PIECE_ROWS]
            unique, inverse = np.unique(piece, return_inverse=True)
            if unique.size > 0.9 * piece.size:  # hardly any repeats: not worth a second copy
                self.source.gather(piece, into, threads)
                continue
            rows = np.empty((unique.size, self.row_bytes), dtype=np.uint8)
            self.source.gather(unique, rows, threads)
            np.take(rows, inverse, axis=0, out=into, mode="clip")

    @property
    def dedup_scratch_bytes(self) -> int:
        """A deduplicated piece's rows and index arrays."""
        return DEDUP_PIECE_ROWS * (self.row_bytes + DEDUP_BYTES_PER_ID)


class CachedTable(Table):
    """io = direct or buffered: rows from the shared row cache, misses read by
    the shared miss engine."""

    def __init__(
        self,
        spec: TableSpec,
        key: int,
        files: dict[str, CheckpointFile],
        *,
        mode: str,
        cache: nat.RowCache,
        engine: nat.ReadEngine,
        threads: int,
        parallel_min_rows: int,
        resident_scales: bool,
    ) -> None:
        # The scale segments read into memory at start (``resident_scales``):
        # a missed row is then one read, its values.
        super().__init__(
            spec,
            key,
            files,
            cache=cache,
            engine=engine,
            threads=threads,
            parallel_min_rows=parallel_min_rows,
            resident=scale_segments(spec) if resident_scales else (),
        )
        self.mode = mode  # direct | buffered

    def gather_inline(self, ids: np.ndarray, out: np.ndarray) -> bool:
        """The cache hits only (no I/O); a request with a miss returns False,
        to be handed off."""
        return self.source.gather_hits(ids, out) == 0

    def cached_mask(self, ids: np.ndarray) -> np.ndarray:
        mask = np.zeros(ids.shape[0], dtype=np.uint8)
        if ids.shape[0]:
            self.source.cached(ids, mask)
        return mask.view(np.bool_)
