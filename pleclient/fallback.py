"""Rows read straight from the checkpoint's files by the client itself.

The slower path a worker takes while no ple-server answers: a server that
restarts takes a second or more to serve again, and a GPU-driven worker's
captured graph waits on its lookups meanwhile. Past a short wait the worker
reads those rows itself (``pleclient.gpu.Watchdog``, the vLLM plugin's host
route), bit for bit the rows the server would have served: a served row is
its segments' bytes one after the other (``pleclient.checkpoint.Segment``),
read here from the same offsets the server reads.

How: ``pread`` into the output row by row, the distinct ids spread over a few
threads (a read releases the GIL, so they wait on the disk together). No
cache and no mapping: the worker's memory does not grow with the table, and
the reads stop once a server is back. The files are opened read-only, as
vLLM's own loader opens them.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pleclient.checkpoint import TableSpec

log = logging.getLogger(__name__)

DEFAULT_THREADS = 16
"""Reads in flight: enough for an NVMe or virtio disk to overlap them, few
enough that a worker's fallback never floods the host."""
MIN_IDS_PER_THREAD = 64
"""A lookup this small is read by one thread: starting more costs more than
it saves."""


class CheckpointReader:
    """Served rows of some tables (``pleclient.checkpoint.TableSpec``, by name),
    read from their checkpoint files."""

    def __init__(self, tables: list[TableSpec], threads: int = DEFAULT_THREADS) -> None:
        self.tables = {spec.name: spec for spec in tables}
        self._fds: dict[str, int] = {}
        self._layouts: dict[str, list[tuple[int, int, list[int], np.ndarray]]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._threads = max(1, threads)
        self._lock = threading.Lock()
        self.rows_read = 0
        """Distinct rows read so far."""
        self.seconds = 0.0
        """Time spent in ``read`` so far."""

    def _layout(self, table: str) -> list[tuple[int, int, list[int], np.ndarray]]:
        """Per segment of ``table``'s rows: (column, bytes, fd per shard, offset
        of row 0 per shard); files opened once."""
        layout = self._layouts.get(table)
        if layout is not None:
            return layout
        spec = self.tables[table]
        layout = []
        column = 0
        for segment in spec.segments:
            shards = sorted(segment.shards, key=lambda s: s.index)
            if [s.index for s in shards] != list(range(len(shards))):
                raise ValueError(f"{spec.name}: {segment.name} shards are not 0..{len(shards) - 1}")
            fds = [self._open(s.path) for s in shards]
            offsets = np.array([s.offset for s in shards], dtype=np.int64)
            layout.append((column, segment.row_bytes, fds, offsets))
            column += segment.row_bytes
        self._layouts[table] = layout
        return layout

    def _open(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            except OSError:
                pass  # advice only
            self._fds[path] = fd
        return fd

    def read(self, table: str, ids: np.ndarray, out: np.ndarray) -> None:
        """The rows of ``ids`` (int64) of the table named ``table`` into
        ``out`` (uint8, ``[len(ids), row_bytes]``). ValueError for an unknown
        table or an id out of range (nothing read); OSError naming the file
        and offset of a read that failed."""
        started = time.monotonic()
        spec = self.tables.get(table)
        if spec is None:
            raise ValueError(f"no table {table!r} in this reader's checkpoint")
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if out.shape != (ids.shape[0], spec.row_bytes) or out.dtype != np.uint8:
            raise ValueError(
                f"out must be uint8 {(ids.shape[0], spec.row_bytes)}, not {out.dtype} {out.shape}"
            )
        if ids.size == 0:
            return
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= spec.rows:
            bad = low if low < 0 else high
            raise ValueError(f"{spec.name}: row id {bad} out of range 0..{spec.rows - 1}")
        with self._lock:  # one lookup at a time: its threads share the pool
            layout = self._layout(table)
            unique, inverse = np.unique(ids, return_inverse=True)
            rows = np.empty((unique.shape[0], spec.row_bytes), dtype=np.uint8)
            parts = max(1, min(self._threads, unique.shape[0] // MIN_IDS_PER_THREAD))
            if parts == 1:
                _read_rows(spec, layout, unique, rows, 0, unique.shape[0])
            else:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self._threads, "ple-fallback")
                bounds = np.linspace(0, unique.shape[0], parts + 1).astype(int)
                futures = [
                    self._pool.submit(_read_rows, spec, layout, unique, rows, a, b)
                    for a, b in itertools.pairwise(bounds)
                ]
                for future in futures:
                    future.result()
            out[:] = rows[inverse.reshape(-1)]
            self.rows_read += unique.shape[0]
            self.seconds += time.monotonic() - started

    def close(self) -> None:
        """Stop the threads and close the files."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._layouts.clear()


def _read_rows(
    spec: TableSpec,
    layout: list[tuple[int, int, list[int], np.ndarray]],
    ids: np.ndarray,
    rows: np.ndarray,
    first: int,
    end: int,
) -> None:
    """Rows ``first..end`` of ``ids`` into the same rows of ``rows``."""
    shard = ids[first:end] // spec.shard_size
    within = ids[first:end] % spec.shard_size
    for column, nbytes, fds, offsets in layout:
        at = offsets[shard] + within * nbytes
        for k in range(end - first):
            i = first + k
            offset = int(at[k])
            fd = fds[int(shard[k])]
            got = os.preadv(fd, [rows[i, column : column + nbytes].data], offset)
            if got != nbytes:
                raise OSError(
                    5,  # EIO
                    f"{spec.name}: short read of row {int(ids[i])} ({got} of {nbytes} bytes) "
                    f"at offset {offset} of {os.readlink(f'/proc/self/fd/{fd}')}: the "
                    "checkpoint file is shorter than its header says",
                )
