"""A PLE table served from its safetensors files: mmap, gather, residency, prewarm.

Each checkpoint file is mapped once, read-only, with ``MADV_RANDOM`` (a row is
160–320 bytes: readahead would read many times the bytes used). Never
``MADV_HUGEPAGE`` on these file mappings: it forces 2 MiB readahead.

Rows are gathered with one ``numpy.take`` per *view*: a view is a 2-D
``[rows, row_bytes]`` window over a file mapping at one byte phase. Shards
written back to back in a file share a view, so the common case — every shard
of a table in one file, or in files at the same phase — is a single
``take`` straight into the caller's buffer (the request's slot), with no
intermediate arrays. Requests of ``parallel_min_rows`` or more are split over a
thread pool (``take`` releases the GIL, so page faults overlap across threads).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from pleclient.checkpoint import TableSpec
from pleserver.stats import format_bytes, format_progress

log = logging.getLogger(__name__)

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux ≥ 5.14
PREWARM_BLOCK = 8 << 20

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.mincore.restype = ctypes.c_int


@dataclass
class MappedFile:
    """One checkpoint file, mapped read-only once for every table in it."""

    path: str
    fd: int
    size: int
    mm: mmap.mmap
    flat: np.ndarray  # uint8 view of the whole mapping
    stat: os.stat_result | None = None  # at open: what ``check`` compares against
    problem: str | None = None  # set for good once the file changed in place
    replaced: bool = False  # the path names another file now (logged once)

    @classmethod
    def open(cls, path: str) -> "MappedFile":
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        mm.madvise(mmap.MADV_RANDOM)
        return cls(path, fd, st.st_size, mm, np.frombuffer(mm, dtype=np.uint8), st)

    def check(self) -> str | None:
        """Whether the file changed under the mapping (two stat calls).

        Changed in place (size or mtime): rows may be gone — touching a page
        past the new end of the file raises SIGBUS, which kills the process —
        or different, so the problem is returned (and kept) and its tables
        answer errors. Replaced (another file renamed over the path, as
        downloads and rsync do) or removed: the mapping still holds the old
        file, whole and consistent, so serving goes on; logged once."""
        if self.problem is None and self.stat is not None:
            try:
                st = os.fstat(self.fd)
            except OSError as exc:
                st, error = None, exc.strerror
            if st is None or (st.st_size, st.st_mtime_ns) != (self.stat.st_size,
                                                             self.stat.st_mtime_ns):
                what = f"cannot stat it ({error})" if st is None else (
                    f"size {self.stat.st_size} → {st.st_size} bytes" if st.st_size !=
                    self.stat.st_size else "rewritten in place, same size")
                self.problem = (f"checkpoint file {self.path} changed on disk while "
                                f"ple-server had it mapped ({what}); its tables are no "
                                "longer served: restore the file, then restart ple-server")
                log.error("%s", self.problem)
        if not self.replaced and self.stat is not None:
            try:
                st = os.stat(self.path)
            except OSError:
                st = None
            if st is None or (st.st_dev, st.st_ino) != (self.stat.st_dev, self.stat.st_ino):
                self.replaced = True
                log.warning("checkpoint file %s was %s on disk; ple-server keeps serving the "
                            "file it mapped at start: restart it to serve the new one",
                            self.path, "removed" if st is None else "replaced")
        return self.problem

    @property
    def address(self) -> int:
        return self.flat.ctypes.data

    def close(self) -> None:
        del self.flat
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere: the GC unmaps later
            log.debug("mapping of %s still referenced; left to the garbage collector",
                      self.path)
        os.close(self.fd)


class Table:
    """Row gather over one PLE table's shards (see the module docstring)."""

    def __init__(self, spec: TableSpec, files: dict[str, MappedFile],
                 pool: ThreadPoolExecutor | None = None, parallel_min_rows: int = 16384,
                 dedup_min_rows: int = 4096) -> None:
        self.spec = spec
        self.row_bytes = spec.row_bytes
        self.rows = spec.rows
        self.pool = pool
        self.parallel_min_rows = parallel_min_rows
        self.dedup_min_rows = dedup_min_rows
        self.fully_resident = False  # set by a completed full prewarm
        self.problem: str | None = None  # set by check_files: requests then fail
        self.views: list[np.ndarray] = []
        view_keys: dict[tuple[str, int], int] = {}
        shard_view = np.zeros(spec.parts, dtype=np.int64)
        shard_base = np.zeros(spec.parts, dtype=np.int64)
        for shard in spec.shards:
            mapped = files[shard.path]
            phase = shard.offset % self.row_bytes
            key = (shard.path, phase)
            if key not in view_keys:
                usable = (mapped.size - phase) // self.row_bytes
                view_keys[key] = len(self.views)
                self.views.append(
                    mapped.flat[phase: phase + usable * self.row_bytes]
                    .reshape(usable, self.row_bytes))
            shard_view[shard.index] = view_keys[key]
            shard_base[shard.index] = (shard.offset - phase) // self.row_bytes
        self.shard_view = shard_view
        self.shard_base = shard_base
        self._files = [files[p] for p in spec.files]
        # Shards back to back in one view: row = id + constant, no per-shard math.
        contiguous = len(self.views) == 1 and all(
            shard_base[i] == shard_base[0] + i * spec.shard_size for i in range(spec.parts))
        self.contiguous_base: int | None = int(shard_base[0]) if contiguous else None

    def check_files(self) -> str | None:
        """Check this table's files (``MappedFile.check``); the first problem
        found is kept in ``problem``."""
        for mapped in self._files:
            problem = mapped.check()
            if problem and self.problem is None:
                self.problem = problem
        return self.problem

    # ------------------------------------------------------------------ gather
    def gather(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Write the rows of ``ids`` (int64, validated in ``[0, rows)``) into
        ``out`` (uint8 ``[len(ids), row_bytes]``, C-contiguous), in ids order."""
        n = ids.shape[0]
        if n == 0:
            return
        if n >= self.dedup_min_rows and not self.fully_resident:
            self._gather_dedup(ids, out)
        elif n >= self.parallel_min_rows and self.pool is not None:
            self._gather_parallel(ids, out)
        else:
            self._gather_range(ids, out)

    def _gather_range(self, ids: np.ndarray, out: np.ndarray) -> None:
        if self.contiguous_base is not None:
            rows = ids + self.contiguous_base if self.contiguous_base else ids
            np.take(self.views[0], rows, axis=0, out=out, mode="clip")
            return
        shard = ids // self.spec.shard_size
        rows = self.shard_base[shard] + (ids - shard * self.spec.shard_size)
        if len(self.views) == 1:
            np.take(self.views[0], rows, axis=0, out=out, mode="clip")
            return
        which = self.shard_view[shard]
        for v, view in enumerate(self.views):
            positions = np.flatnonzero(which == v)
            if positions.size:
                out[positions] = np.take(view, rows[positions], axis=0, mode="clip")

    def _gather_parallel(self, ids: np.ndarray, out: np.ndarray) -> None:
        n = ids.shape[0]
        chunks = max(2, min(self.pool._max_workers * 2, n // (self.parallel_min_rows // 4)))
        bounds = np.linspace(0, n, chunks + 1).astype(int)
        futures = [self.pool.submit(self._gather_range, ids[a:b], out[a:b])
                   for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        for f in futures:
            f.result()

    def _gather_dedup(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Cold table, large request: read each distinct row once, in file order
        (sorted ids turn scattered page faults into ascending ones), then expand."""
        unique, inverse = np.unique(ids, return_inverse=True)
        if unique.size > 0.9 * ids.size:  # hardly any repeats: not worth a second copy
            if ids.shape[0] >= self.parallel_min_rows and self.pool is not None:
                self._gather_parallel(ids, out)
            else:
                self._gather_range(ids, out)
            return
        rows = np.empty((unique.size, self.row_bytes), dtype=np.uint8)
        if unique.size >= self.parallel_min_rows and self.pool is not None:
            self._gather_parallel(unique, rows)
        else:
            self._gather_range(unique, rows)
        np.take(rows, inverse, axis=0, out=out, mode="clip")

    # --------------------------------------------------------------- residency
    def shard_ranges(self) -> list[tuple[MappedFile, int, int]]:
        """(file, start offset, length) of every non-empty shard."""
        by_path = {f.path: f for f in self._files}
        return [(by_path[s.path], s.offset, s.rows * self.row_bytes)
                for s in self.spec.shards if s.rows]

    def resident_bytes(self) -> int:
        """Bytes of this table in the page cache (mincore over its shard ranges)."""
        page = mmap.PAGESIZE
        total = 0
        for mapped, offset, length in self.shard_ranges():
            start = offset - offset % page
            npages = -(-(offset + length - start) // page)
            vec = np.zeros(npages, dtype=np.uint8)
            if _libc.mincore(ctypes.c_void_p(mapped.address + start),
                             ctypes.c_size_t(npages * page),
                             ctypes.c_void_p(vec.ctypes.data)) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore on {mapped.path}: {os.strerror(err)}")
            total += int(np.count_nonzero(vec & 1)) * page
        return min(total, self.spec.nbytes)


class Prewarm:
    """Reads tables into the page cache once, within a byte budget, in a thread.

    Budgeted because on unified-memory machines (DGX Spark, GX10) the page cache
    competes with the GPU's memory: the prewarm also stops when MemAvailable
    falls under ``reserve_bytes``. After each block, ``MADV_POPULATE_READ`` maps
    the pages into the server's page tables, so the first lookup of a row does
    not pay a minor fault either."""

    def __init__(self, tables: list[Table], budget_bytes: int | None,
                 reserve_bytes: int = 4 << 30) -> None:
        self.tables = tables
        self.total = sum(t.spec.nbytes for t in tables)
        self.target = self.total if budget_bytes is None else min(self.total, budget_bytes)
        self.reserve_bytes = reserve_bytes
        self.done_bytes = 0
        self.state = "pending"  # pending → running → done | budget | memory | stopped | failed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_progress = None  # callable(Prewarm) | None, e.g. systemd STATUS=

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="prewarm", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def fraction(self) -> float:
        return self.done_bytes / self.target if self.target else 1.0

    def snapshot(self) -> dict:
        return {"state": self.state, "done_bytes": self.done_bytes,
                "target_bytes": self.target, "total_bytes": self.total,
                "fraction": round(self.fraction, 4)}

    def _run(self) -> None:
        self.state = "running"
        started = time.monotonic()
        last_report = 0.0
        buf = bytearray(PREWARM_BLOCK)
        log.info("prewarm: reading %s of %s into the page cache",
                 format_bytes(self.target), format_bytes(self.total))
        try:
            for table in self.tables:
                complete = True
                for mapped, offset, length in table.shard_ranges():
                    pos, end = offset, offset + length
                    while pos < end:
                        if self._stop.is_set():
                            self.state = "stopped"
                            return
                        if self.done_bytes >= self.target:
                            self.state = "budget"
                            return
                        if _mem_available() < self.reserve_bytes:
                            log.warning("prewarm: stopping, MemAvailable below the %.1f GiB "
                                        "reserve", self.reserve_bytes / 2**30)
                            self.state = "memory"
                            return
                        n = min(PREWARM_BLOCK, end - pos, self.target - self.done_bytes)
                        got = os.preadv(mapped.fd, [memoryview(buf)[:n]], pos)
                        if got <= 0:
                            raise OSError(f"{mapped.path}: short read at {pos}")
                        _populate(mapped, pos, got)
                        pos += got
                        self.done_bytes += got
                        now = time.monotonic()
                        if now - last_report >= 2.0:
                            last_report = now
                            log.info("prewarm: %s", format_progress(
                                self.done_bytes, self.target, self.fraction))
                            if self.on_progress:
                                self.on_progress(self)
                    complete = complete and pos >= end
                table.fully_resident = complete
            self.state = "done"
        except Exception:
            self.state = "failed"
            log.exception("prewarm failed; serving continues from disk")
        finally:
            if self.on_progress:
                self.on_progress(self)
            log.info("prewarm %s: %s in %.1f s", self.state, format_bytes(self.done_bytes),
                     time.monotonic() - started)


def _populate(mapped: MappedFile, offset: int, length: int) -> None:
    page = mmap.PAGESIZE
    start = offset - offset % page
    try:
        mapped.mm.madvise(MADV_POPULATE_READ, start, offset + length - start)
    except (OSError, ValueError):
        pass  # kernel without MADV_POPULATE_READ: the first touch faults instead


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def open_tables(specs: list[TableSpec], workers: int = 4, parallel_min_rows: int = 16384,
                dedup_min_rows: int = 4096) -> tuple[list[Table], dict[str, MappedFile],
                                                      ThreadPoolExecutor]:
    """Map every file once and build the tables; the caller closes the files."""
    files: dict[str, MappedFile] = {}
    try:
        for spec in specs:
            for path in spec.files:
                if path not in files:
                    files[path] = MappedFile.open(path)
    except BaseException:
        for f in files.values():
            f.close()
        raise
    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="gather")
    tables = [Table(spec, files, pool, parallel_min_rows, dedup_min_rows) for spec in specs]
    return tables, files, pool
